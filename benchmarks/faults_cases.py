"""benchmarks.faults' cases: issue 23's list of bad inputs and faults and more of the same kinds, each with what
memplan must answer (benchmarks.faults replays them)."""
from __future__ import annotations

from benchmarks.faults_setup import (
    A100,
    GPT_HEADS,
    GPU,
    LLAMA_HEADS,
    Case,
    anchored,
    fifo,
    logs,
    pair_whole,
    plan_file,
    planned_then_moved,
    raw_file,
    record,
    sample,
    says,
    says_not,
    short_lines,
    two_ranks,
    unchanged,
    with_changes,
)


def cases() -> list[Case]:
    big = "9" * 20
    c: list[Case] = []
    # 1. absurd sizes on the command line
    c += [
        Case(id="gpus-20-digits", kind="absurd size", argv=["suggest", *GPU, "--gpus", big, "CONFIG"],
             fragment="argument --gpus: must be from 1 to 64"),
        Case(id="gpus-1000-one-node", kind="absurd size", argv=["suggest", *GPU, "--gpus", "1000", "CONFIG"],
             fragment="argument --gpus: must be from 1 to 64 (GPUs per node); for more GPUs, add nodes with --nodes"),
        Case(id="gpus-5000-digits", kind="absurd size", argv=["suggest", *GPU, "--gpus", "9" * 5000, "CONFIG"],
             fragment="argument --gpus: must be a whole number"),
        Case(id="nodes-10e7", kind="absurd size", argv=["suggest", *GPU, "--nodes", "10000000", "CONFIG"],
             fragment="argument --nodes: must be from 1 to 32,768"),
        Case(id="global-batch-10e30-flag", kind="absurd size",
             argv=["suggest", *GPU, "--global-batch-size", "1" + "0" * 30, "CONFIG"],
             fragment="argument --global-batch-size: must be from 1 to 16,777,216"),
        Case(id="gpu-memory-negative", kind="absurd size", argv=["suggest", "--gpu-memory", "-5GiB", "CONFIG"],
             fragment="argument --gpu-memory: must be a positive size"),
        Case(id="gpu-memory-no-unit", kind="absurd size", argv=["suggest", "--gpu-memory", "24", "CONFIG"],
             fragment="argument --gpu-memory: 24 what?"),
        Case(id="gpu-memory-24TiB", kind="absurd size", argv=["suggest", "--gpu-memory", "24TiB", "CONFIG"],
             fragment="--gpu-memory 24.00 TiB is outside what a GPU has"),
        Case(id="margin-inf", kind="absurd size", argv=["suggest", *GPU, "--margin", "inf", "CONFIG"],
             fragment="argument --margin: must be a fraction"),
        Case(id="estimate-batch-10e30", kind="absurd size",
             argv=["estimate", "CONFIG", "--batch-size", "1" + "0" * 30],
             fragment="argument --batch-size: must be from 1"),
        Case(id="estimate-ddp-10e7", kind="absurd size", argv=["estimate", "CONFIG", "--batch-size", "4", "--ddp",
                                                               "10000000"], fragment="argument --ddp: must be from 1"),
        Case(id="validate-steps-10e9", kind="absurd size", argv=["validate", "CONFIG", "--steps", "1000000000"],
             fragment="argument --steps: must be from 1 to 1,000"),
        Case(id="watch-interval-inf", kind="absurd size", argv=["watch", "DIR", "--interval", "inf"],
             fragment="argument --interval: must be a number of seconds"),
        Case(id="watch-interval-nan", kind="absurd size", argv=["watch", "DIR", "--interval", "nan"],
             fragment="argument --interval: must be a number of seconds"),
        Case(id="report-version-negative", kind="absurd size", argv=["report", "DIR", "--version", "-1"],
             fragment="argument --version: must be from 0"),
    ]
    # 1b. absurd sizes in the YAML
    for cid, changes, fragment in [
        ("yaml-global-batch-10e30", {"memplan.global_batch_size": 10**30},
         "memplan.global_batch_size must be a positive int up to 16,777,216"),
        ("yaml-prefetch-10e9", {"memplan.prefetch_factor": 10**9},
         "memplan.prefetch_factor must be a positive int up to 64"),
        ("yaml-workers-10e6", {"data.init_args.num_workers": 10**6},
         "data.init_args.num_workers must be a whole number from 0 to 256"),
        ("yaml-data-batch-10e30", {"data.init_args.batch_size": 10**30, "memplan.global_batch_size": None},
         "data.init_args.batch_size must be a whole number from 1 to 16,777,216"),
        ("yaml-devices-10e30", {"trainer.devices": 10**30}, "trainer.devices is per node and must be at most 64"),
        ("yaml-num-nodes-10e30", {"trainer.num_nodes": 10**30},
         "trainer.num_nodes must be a whole number from 1 to 32,768"),
        ("yaml-accumulate-10e30", {"trainer.accumulate_grad_batches": 10**30},
         "trainer.accumulate_grad_batches must be a whole number"),
        ("yaml-config-global-batch-2e33", {"memplan.global_batch_size": None, "data.init_args.batch_size": 1 << 20,
                                           "trainer.devices": 8, "trainer.accumulate_grad_batches": 1 << 10},
         "a global batch of 8,589,934,592 samples is more than the 16,777,216 memplan plans for"),
        ("yaml-global-batch-string", {"memplan.global_batch_size": "64"},
         "memplan.global_batch_size must be a positive int"),
        ("yaml-margin-1.5", {"memplan.margin": 1.5}, "memplan.margin must be a fraction"),
        ("yaml-section-typo", {"modle": {"class_path": "x"}},
         "modle: is not a LightningCLI section (did you mean 'model'?)"),
        ("yaml-extra-top-level-key", {"notes": "run 3"}, "notes: in"),
        ("yaml-fit-subcommand-section", {"fit": {"trainer": {"devices": 1}}}, "fit: in"),
    ]:
        c.append(Case(id=cid, kind="absurd size (YAML)", argv=["suggest", *GPU, "CONFIG"], config=with_changes(changes),
                      fragment=fragment))
    # 1b'. configs LightningCLI would refuse, and config values that do not fit together
    c += [
        Case(id="yaml-anchor-holder", kind="absurd size (YAML)", argv=["suggest", *GPU, "CONFIG"], config=anchored(),
             fragment="defaults: in", check=says("is not a key LightningCLI's fit accepts at the top level",
                                                 "define each anchor where its value is first used")),
        Case(id="heads-not-dividing-width", kind="config values", argv=["estimate", "CONFIG", "--batch-size", "2"],
             config=GPT_HEADS, fragment="model.init_args.n_heads (3) does not divide model.init_args.d_model (100)",
             check=says("set model.init_args.n_heads to a divisor of 100 (2, 4, 5)")),
        Case(id="heads-not-dividing-width-transformers", kind="config values", argv=["suggest", *GPU, "CONFIG"],
             config=LLAMA_HEADS,
             fragment="model.init_args.num_attention_heads (3) does not divide model.init_args.hidden_size (100)"),
    ]
    # 1c. files that are not (small) files
    c += [
        Case(id="config-dev-zero", kind="not a file", argv=["suggest", *GPU, "/dev/zero"], config=None,
             fragment="config file /dev/zero is a character device, not a regular file"),
        Case(id="config-fifo", kind="not a file", argv=["suggest", *GPU, "DIR/pipe.yaml"], config=None,
             setup=fifo("pipe.yaml"), fragment="is a FIFO (named pipe), not a regular file"),
        Case(id="config-folder", kind="not a file", argv=["suggest", *GPU, "DIR"], config=None,
             fragment="is a folder, not a regular file"),
        Case(id="config-17MiB", kind="not a file", argv=["suggest", *GPU, "DIR/big.yaml"], config=None,
             setup=raw_file("big.yaml", b"# " + b"x" * (17 << 20) + b"\n"), fragment="is larger than 16.00 MiB"),
        Case(id="config-binary", kind="not a file", argv=["suggest", *GPU, "DIR/bin.yaml"], config=None,
             setup=raw_file("bin.yaml", bytes(range(256)) * 4), fragment="is not UTF-8 text"),
        Case(id="config-empty", kind="not a file", argv=["suggest", *GPU, "DIR/empty.yaml"], config=None,
             setup=raw_file("empty.yaml", b""), fragment="got an empty file"),
        Case(id="config-missing", kind="not a file", argv=["suggest", *GPU, "DIR/none.yaml"], config=None,
             fragment="does not exist"),
        Case(id="plan-dev-zero", kind="not a file", argv=["validate", "CONFIG", "--plan", "/dev/zero"],
             fragment="--plan /dev/zero is a character device"),
        Case(id="plan-fifo", kind="not a file", argv=["validate", "CONFIG", "--plan", "DIR/x.plan.json"],
             setup=fifo("x.plan.json"), fragment="is a FIFO (named pipe)"),
    ]
    # 1d. plan files
    for cid, changes, fragment in [
        ("plan-micro-10e30", {"micro_batch_size": 10**30, "global_batch_size": 8 * 10**30},
         "Plan.micro_batch_size must be a whole number from 1 to 16,777,216"),
        ("plan-format-string", {"format": "1"}, "plan file format must be the number 1"),
        ("plan-alternatives-missing", {"alternatives": [{"world_size": 1}]}, "Plan.alternatives[0] lacks"),
        ("plan-alternatives-unknown", {"alternatives": [{"speed": 1}]},
         "Plan.alternatives[0] has unknown keys ['speed']"),
        ("plan-alternatives-not-list", {"alternatives": {"a": 1}}, "Plan.alternatives must be a list"),
        ("plan-gpus-twice", {"gpus": [0, 0]}, "Plan.gpus names a GPU twice"),
        ("plan-world-10e7", {"world_size": 10**7, "accumulate_grad_batches": 1, "micro_batch_size": 1,
                             "global_batch_size": 10**7}, "Plan.world_size must be a whole number from 1 to 262,144"),
        ("plan-peak-negative", {"predicted_peak_bytes": -1}, "Plan.predicted_peak_bytes must be an int >= 0"),
    ]:
        c.append(Case(id=cid, kind="bad plan file", argv=["validate", "CONFIG", "--plan", "DIR/x.plan.json"],
                      setup=plan_file(changes), fragment=fragment))
    # 1e. implausible plans: explained, or refused
    c += [
        Case(id="global-batch-509-on-4", kind="implausible plan", expect="answer",
             argv=["suggest", *GPU, "--gpus", "4", "--json", "CONFIG"],
             config=with_changes({"memplan.global_batch_size": 509}),
             fragment="the plan uses 1 of the 4 GPUs per node --gpus gives",
             check=says("does not split evenly over 2, 3, 4 ranks")),
        Case(id="global-batch-509-on-3", kind="implausible plan", expect="answer",
             argv=["suggest", *GPU, "--gpus", "3", "--json", "CONFIG"],
             config=with_changes({"memplan.global_batch_size": 509}),
             fragment="the plan uses 1 of the 3 GPUs per node --gpus gives"),
        Case(id="gpus-48-global-1024", kind="implausible plan", expect="answer",
             argv=["suggest", *GPU, "--gpus", "48", "--json", "CONFIG"],
             config=with_changes({"memplan.global_batch_size": 1024}),
             fragment="of the 48 GPUs per node --gpus gives",  # (1 since the step-time model: more are no faster)
             check=says("no setting is predicted faster", "does not split evenly over")),
        Case(id="more-ranks-than-batch", kind="implausible plan", argv=["suggest", *GPU, "--gpus", "8", "--nodes", "16",
                                                                        "CONFIG"],
             fragment="--gpus 8 x --nodes 16 = 128 ranks, more than the global batch of 64"),
    ]
    # --output
    c += [
        Case(id="output-exists", kind="output", argv=["suggest", *GPU, "CONFIG", "--output", "DIR/planned.yaml"],
             setup=raw_file("planned.yaml", b"the user's\n"), fragment="pass --force",
             check=unchanged("planned.yaml", "the user's\n")),
        Case(id="output-is-source", kind="output", argv=["suggest", *GPU, "CONFIG", "--output", "CONFIG"],
             fragment="is the source config"),
        Case(id="output-plan-json", kind="output", argv=["suggest", *GPU, "CONFIG", "--output", "DIR/x.plan.json"],
             fragment="names a plan file; --output names the planned config"),
    ]
    c.append(Case(id="planned-pair-moved", kind="output", expect="answer", setup=planned_then_moved, argv=[],
                  command=["PYTHON", "ROOT/launch/train.py", "fit", "--config", "DIR/b/planned.yaml",
                           "--trainer.max_steps=2", "--trainer.accelerator=cpu", "--trainer.logger=false",
                           "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"],
                  env={"CUDA_VISIBLE_DEVICES": ""}, fragment="MemoryPlanner summary"))
    for delay in (0.5, 2.0, 3.5, 5.0, 6.5):
        c.append(Case(id=f"sigterm-suggest-output-{delay:g}s", kind="preemption", expect="signal",
                      argv=["suggest", *GPU, "CONFIG", "--output", "DIR/planned.yaml"], sigterm_after_s=delay,
                      check=pair_whole))
    # 4. run logs
    c += [
        Case(id="log-impossible-values", kind="logs", expect="answer",
             argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs(two_ranks(sample(3, 0, peak_bytes=10**30) + sample(4, 0, process_bytes=-5),
                                  record("sample", 10**20, 1))),
             fragment="1 impossible peak_bytes, 1 impossible process_bytes", check=says("1 impossible step")),
        Case(id="log-rank01-beside-rank1", kind="logs", expect="answer",
             argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs({**two_ranks(), "rank01.jsonl": two_ranks()["rank1.jsonl"]}),
             fragment="not read: rank01.jsonl: not a name MemoryPlanner writes"),
        Case(id="log-fifo", kind="logs", expect="answer", argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs(two_ranks(), fifos=("rank2.jsonl",)),
             fragment="could not read rank2.jsonl: not a regular file"),
        Case(id="log-fifo-watch-once", kind="logs", expect="answer", argv=["watch", "DIR/logs", "--once"],
             setup=logs(two_ranks(), fifos=("rank2.jsonl",)), fragment="rank2.jsonl"),
        Case(id="log-20000-runs", kind="logs", expect="answer", argv=["watch", "DIR/logs", "--once"],
             setup=logs({"rank0.jsonl": "".join(sample(1, 0, run=f"2026-{i:06d}",
                                                       time=float(i)) for i in range(20_000))}),
             fragment="19,994 older", check=short_lines(400)),
        Case(id="log-sigterm-blame", kind="logs", expect="answer", argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs({"rank0.jsonl": record("apply", 0, 0, layout={"world_size": 2}) + sample(1, 0)
                         + record("end", 1, 0, status="failed: RuntimeError: Connection closed by peer", time=1500.0),
                         "rank1.jsonl": record("apply", 0, 1, layout={"world_size": 2}) + sample(1, 1)
                         + record("end", 1, 1, status="failed: RankTerminated: 143", time=1400.0)}),
             fragment="rank 1 failed: RankTerminated: 143 (SIGTERM received)"),
        Case(id="log-over-long-line", kind="logs", expect="answer",
             argv=["report", "DIR/logs", "--output", "DIR/r.png"],
             setup=logs(two_ranks('{"event": "sample", "x": "' + "y" * (2 << 20) + '"}\n')),
             fragment="line longer than 1.00 MiB"),
        Case(id="log-empty-folder", kind="logs", argv=["report", "DIR/logs"], setup=logs({}),
             fragment="no MemoryPlanner rank logs"),
        Case(id="log-not-a-folder", kind="logs", argv=["report", "DIR/none"], fragment="does not exist"),
        Case(id="log-only-garbage", kind="logs", argv=["report", "DIR/logs"],
             setup=logs({"rank0.jsonl": "\x00\x01 garbage\n[1]\n"}), fragment="no readable MemoryPlanner record"),
        Case(id="watch-piped-ends-with-the-run", kind="logs", expect="answer",
             argv=["watch", "DIR/logs", "--interval", "0.1"],
             setup=logs(two_ranks()), fragment="ended: finished", check=says("rank 0 step 2", "rank 1 step 2")),
    ]
    # 3. NVML going wrong (simulated)
    two = [A100, A100]
    for cid, value, fragment in [
        ("cvd-garbage", "garbage", "CUDA_VISIBLE_DEVICES='garbage': 'garbage' is not a GPU index or UUID"),
        ("cvd-0-0", "0,0", "CUDA_VISIBLE_DEVICES='0,0' names '0' twice"),
        ("cvd-7", "7", "CUDA_VISIBLE_DEVICES='7': GPU 7 does not exist here"),
        ("cvd-empty", "", "CUDA_VISIBLE_DEVICES='' is empty"),
    ]:
        c.append(Case(id=cid, kind="NVML", argv=["suggest", "CONFIG"], gpus=two, env={"CUDA_VISIBLE_DEVICES": value},
                      fragment=fragment))
    c += [
        Case(id="nvml-timeout-all", kind="NVML", argv=["suggest", "CONFIG"], gpus=two,
             nvml={"failing": {"nvmlDeviceGetMemoryInfo": "NVML_ERROR_TIMEOUT"}},
             fragment="no visible GPU answers NVML: cuda:0 (NVML index 0, NVIDIA A100-SXM4-80GB): NVML cannot read"),
        Case(id="nvml-zero-total", kind="NVML", argv=["suggest", "CONFIG"], gpus=[{**A100, "total_bytes": 0}],
             fragment="NVML reports 0 bytes of memory on it", check=says_not("DeviceBudget")),
        Case(id="nvml-one-lost-gpus-1", kind="NVML", expect="answer",
             argv=["suggest", "CONFIG", "--gpus", "1", "--json"],
             gpus=[A100, {**A100, "failing": {"nvmlDeviceGetMemoryInfo": "NVML_ERROR_GPU_IS_LOST"}}],
             fragment="left out of the plan: cuda:1 (NVML index 1"),
        Case(id="nvml-runtimeerror-one-gpu", kind="NVML", expect="answer", argv=["suggest", "CONFIG", "--json"],
             gpus=[A100, {**A100, "raising": {"nvmlDeviceGetMemoryInfo": "RuntimeError: binding bug"}}],
             fragment="planning on the 1 GPU(s) that answer"),
        Case(id="nvml-init-runtimeerror", kind="NVML", argv=["suggest", "CONFIG"], gpus=two,
             nvml={"raising": {"nvmlInit": "RuntimeError: driver timed out"}},
             fragment="nvmlInit raised RuntimeError: driver timed out"),
        Case(id="nvml-more-gpus-than-answer", kind="NVML", argv=["suggest", "CONFIG", "--gpus", "2"],
             gpus=[A100, {**A100, "failing": {"nvmlDeviceGetMemoryInfo": "NVML_ERROR_GPU_IS_LOST"}}],
             fragment="--gpus 2: this node has 1 GPU(s) visible to NVML, and 1 more that do not answer"),
        Case(id="devices-cvd-garbage", kind="NVML", expect="answer", argv=["devices"], gpus=two,
             env={"CUDA_VISIBLE_DEVICES": "garbage"}, fragment="'garbage' is not a GPU index or UUID"),
    ]
    return c

