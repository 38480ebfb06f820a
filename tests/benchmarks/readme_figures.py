"""The figures README.md quotes, as the committed benchmarks/results/*.json give them: one function per claim of
test_readme_figures.py, each returning the claim's figures as README prints them (strings, in the order the
claim's pattern groups them), plus the JSON loader and the number formats they share."""
from __future__ import annotations

import json
import math
import statistics
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
NUM = r"([-+]?[\d,]*\.?\d+)"


@cache
def results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def pct(x: float, places: int = 3) -> str:
    return f"{100 * x:.{places}f}"


def signed_pct(x: float, places: int = 2) -> str:
    return f"{100 * x:+.{places}f}"


def _worst(rows: list[dict], key: str) -> dict:
    return max(rows, key=lambda r: abs(r[key]))


def cpu_table() -> tuple[str, ...]:
    s, rows = results("accuracy_cpu")["summary"], results("accuracy_cpu")["rows"]
    whole, step2 = _worst(rows, "error"), _worst(rows, "error_vs_step2")
    step2_bytes = step2["estimate"]["peak_allocated"] - step2["truth"]["phase_peaks"]["step2"]
    return (
        pct(s["memplan"]["median_abs_error"]), pct(s["memplan"]["worst_abs_error"]), whole["case"],
        f"{abs(whole['error_bytes']):,}", "under" if whole["error_bytes"] < 0 else "over",
        pct(s["memplan_vs_step2"]["median_abs_error"]), pct(s["memplan_vs_step2"]["worst_abs_error"]), step2["case"],
        f"{abs(step2_bytes):,}", "under" if step2_bytes < 0 else "over",
        pct(s["rule_3p_2act"]["median_abs_error"], 1), pct(s["rule_3p_2act"]["worst_abs_error"], 1),
        pct(s["rule_4x_weights"]["median_abs_error"], 1), pct(s["rule_4x_weights"]["worst_abs_error"], 1),
    )


def cpu_counts() -> tuple[str, ...]:
    report = results("accuracy_cpu")
    rows = report["rows"]
    return (
        report["machine"]["cpu"], report["date"][:10], str(sum(1 for r in rows if r["error_bytes"] == 0)),
        str(len(rows)), str(sum(1 for r in rows if abs(r["error"]) <= 1e-4)),
    )


def realmodels() -> tuple[str, ...]:
    report = results("realmodels")
    s, rows = report["summary"], [r for r in report["rows"] if "error" in r]
    worst = _worst(rows, "error")
    torch_order = sum(1 for r in report["rows"] if r.get("loop") == "torch")
    return (
        str(s["cases"]), str(torch_order), report["date"][:10], report["machine"]["cpu"], str(s["all"]["measured"]),
        pct(s["all"]["median_abs_error"]), signed_pct(worst["error"], 3), worst["case"],
    )


def heldout() -> tuple[str, ...]:
    s = results("heldout_sweep")["summary"]
    return (str(s["cases"]), str(s["within_0.1%"]), pct(s["median_abs_error"]), signed_pct(s["worst_error"], 3),
            s["worst_case"])


def heldout6() -> tuple[str, ...]:
    s = results("heldout_sweep6")["summary"]
    return (str(s["cases"]), str(s["within_0.1%"]), pct(s["median_abs_error"]), signed_pct(s["worst_error"], 3),
            s["worst_case"], ", ".join(s["estimate_failed"]) or "none")


def fsdp() -> tuple[str, ...]:
    s = results("accuracy_fsdp_cpu")["summary"]
    rows = results("accuracy_fsdp_cpu")["rows"]
    errors = [e for r in rows for e in r["errors"]]
    rest = sorted(abs(e) for e in errors if abs(e) > 1e-5)
    return (
        str(s["cases"]), str(s["rank_figures"]), pct(s["median_abs_error"]), signed_pct(max(errors, key=abs)),
        str(len(errors) - len(rest)), str(s["rank_figures"]), str(len(rest)), pct(rest[0], 2), pct(rest[-1], 2),
    )


def published_gpu() -> tuple[str, ...]:
    report = results("published_gpu")
    s, figures = report["summary"], report["figures"]
    as_published, this_torch = s["memplan_published_torch"], s["memplan"]
    old = [f for f in figures if not f["torch_at_least_2_1"]]
    old_errors = [abs(f["error_published_torch"]) for f in old]
    old_worst = max(old, key=lambda f: abs(f["error_published_torch"]))
    return (
        str(len(figures)), str(as_published["goal_set"]["figures"]),
        pct(as_published["goal_set"]["median_abs_error"], 2), signed_pct(as_published["goal_set"]["worst_error"]),
        as_published["goal_set"]["worst"],
        pct(this_torch["goal_set"]["median_abs_error"], 2), signed_pct(this_torch["goal_set"]["worst_error"]),
        this_torch["goal_set"]["worst"], "met" if as_published["goal_set"]["met"] else "not met",
        str(len(old)), pct(statistics.median(old_errors), 2), signed_pct(old_worst["error_published_torch"]),
    )


def torchtitan() -> tuple[str, ...]:
    report = results("torchtitan_memory")
    rows = {r["setting"]: r for r in report["rows"]}
    op, one_pool, s = rows["op"], rows["op-one-pool"], report["summary"]
    return (f"{op['peak_reserved_gib']:.2f}", f"{s['published_gib']}", signed_pct(s["relative_error"], 1),
            f"{100 * s['goal']:.0f}", f"{op['side_stream_reserved_gib']:.2f}", f"{one_pool['peak_reserved_gib']:.2f}")


def suite_time() -> tuple[str, ...]:
    report = results("test_suite_time")
    (run,) = report["runs"]
    return (str(run["passed"]), f"{run['wall_minutes']:.1f}", report["cpu_model"], run["load_range"],
            f"{run['cpu_minutes']:.1f}", f"{run['cpu_minutes'] / report['usable_cores']:.1f}")


def suite_stress() -> tuple[str, ...]:
    report = results("test_suite_stress")
    runs = report["runs"]
    passed = "every run passed" if all(r["exit"] == 0 for r in runs) else "a run failed"
    return (str(len(runs)), passed, str(report["burners"]), " and ".join(f"{r['wall_minutes']:.1f}" for r in runs),
            report["commit"])


def logs_at_scale() -> tuple[str, ...]:
    r = results("logs_at_scale")
    return (str(round(math.log10(r['lines']))), str(r["ranks"]), f"{r['log_bytes'] / 1e6:.0f}", f"{r['report']['wall_s']:.1f}",
            f"{r['report']['peak_rss_mib']:.0f}", r["cpu"])


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}"


def accuracy_gpu() -> tuple[str, ...]:
    """The H200's rows come from several calls: session 9's (the newest call's commit) and the first campaign's."""
    report = results("accuracy_gpu")
    env, s, rows = report["environment"], report["summary"], report["rows"]
    measured = [r for r in rows if "error" not in r["truth"]]
    newest = max(env["runs"], key=lambda run: run["date"])["memplan_commit"]
    session9 = [r for r in measured if r["run"]["memplan_commit"] == newest]
    first = [r for r in measured if r["run"]["memplan_commit"] != newest]
    (first_commit,) = {r["run"]["memplan_commit"] for r in first}
    figures, figures9 = [], []
    for key in ("native_err_allocated", "native_err_reserved", "native_err_nvml"):
        worst, worst9 = (_worst([r for r in rs if r[key] is not None], key) for rs in (measured, session9))
        figures += [pct(s[key]["median_abs"], 2), signed_pct(worst[key]), worst["case"]]
        figures9 += [signed_pct(worst9[key]), worst9["case"]]
    goal = all(s[k]["median_abs"] <= 0.03 and s[k]["worst_abs"] <= 0.06 and s[k]["most_under"] >= -0.02
               for k in ("native_err_allocated", "native_err_reserved", "native_err_nvml"))
    outside = [r["truth"]["nvml_process_peak"] - r["truth"]["max_reserved"] for r in measured
               if r["truth"].get("nvml_process_peak") is not None]
    context = results("cuda_overheads_gpu")["replaces"]["_CONTEXT_LAZY_BYTES[9]"]["now"]
    return (env["gpu"]["name"], env["driver"], env["torch"], str(len(measured)), str(len(_zoo_cases())),
            str(len(session9)), str(len({r["run"]["file"] for r in session9})), newest[:7], str(len(first)),
            first_commit[:7], str(s["native_err_allocated"]["n"]), *figures, "met" if goal else "not met",
            str(len(session9)), *figures9, _mib(min(outside)), _mib(max(outside)), _mib(context))


def _zoo_cases() -> dict:
    from benchmarks.zoo import CASES

    return CASES


def gpu_fidelity() -> tuple[str, ...]:
    return _fidelity_now("gpu_fidelity", "H200")


def h200_truths_reread() -> tuple[str, ...]:
    """The cases the first H200 campaign (part1.json) and session 9's calls (part1b, part1c) both measured, all
    with the same truths: allocated, reserved and NVML peaks equal to the byte."""
    raw = RESULTS / "gpu_campaign_raw"
    first, *later = [json.loads((raw / f).read_text())["sections"]["accuracy_zoo"]["rows"]
                     for f in ("part1.json", "part1b.json", "part1c.json")]
    keys = ("max_allocated", "max_reserved", "nvml_process_peak")
    before = {r["case"]: [r["truth"].get(k) for k in keys] for r in first if "error" not in r["truth"]}
    again = [(before[r["case"]], [r["truth"].get(k) for k in keys]) for rows in later for r in rows
             if r["case"] in before]
    assert all(a == b for a, b in again)
    return (str(len(again)),)


def accuracy_gpu_expandable() -> tuple[str, ...]:
    """The H200's run under expandable segments, beside the same cases' default-settings rows."""
    report = results("accuracy_gpu_expandable")
    env, rows = report["environment"], report["rows"]
    assert env["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and env["torch"].startswith("2.11")
    default = {r["case"]: r for r in results("accuracy_gpu")["rows"]}
    key = "emulated_err_reserved"
    off = sorted((r for r in rows if r[key] != 0), key=lambda r: -r[key])  # the least under first
    rnn = [r for r in off if r["case"].startswith(("lstm", "gru"))]
    (other,) = [r for r in off if r not in rnn]
    return (str(len(rows)), str(sum(r[key] == 0 for r in rows)), str(len(rows)), signed_pct(other[key]), other["case"],
            rnn[1]["case"], signed_pct(rnn[1][key]), rnn[0]["case"], signed_pct(rnn[0][key]),
            signed_pct(default[rnn[1]["case"]][key]), signed_pct(default[rnn[0]["case"]][key]))


def gpu_fidelity_expandable() -> tuple[str, ...]:
    report = results("gpu_fidelity_expandable")
    now = report["summary"]["now"]["reserved"]
    rows = {r["case"]: r for r in report["rows"]}
    return (str(now["n"]), pct(now["median_abs"], 2), signed_pct(now["worst"]),
            *(f for case in ("lstm-b32-adagrad", "gru-b32")
              for f in (case, signed_pct(rows[case]["now_err_reserved"]))))


def conv_workspace() -> tuple[str, ...]:
    fit, fidelity = results("conv_workspace_fit"), results("conv_workspace_fidelity")

    def row(card: str, case: str) -> dict:
        return next(r for r in fidelity[card]["rows"] if r["case"] == case)

    h200, h100 = fidelity["H200"]["summary"], fidelity["H100"]["summary"]
    cnn, resnet = row("H200", "cnn-b64-bf16mixed"), row("H100", "resnet18-b8-ckpt-gpu")
    return (f"{100 * fit['loso_median_abs_error_of_workspace']:.0f}",
            pct(h200["conv_before_reserved_median_abs"], 2), pct(h200["conv_after_reserved_median_abs"], 2),
            signed_pct(cnn["before_reserved"]), signed_pct(cnn["after_reserved"]),
            pct(h100["conv_before_reserved_median_abs"], 2), pct(h100["conv_after_reserved_median_abs"], 2),
            signed_pct(resnet["before_reserved"]), signed_pct(resnet["after_reserved"]))


def memory_gaps_vit() -> tuple[str, ...]:
    rows = [r for r in results("memory_gaps_gpu")["rows"] if r["case"].startswith("vit-l16-")]
    return (str(len(rows)), signed_pct(_worst(rows, "native_err_allocated")["native_err_allocated"]),
            signed_pct(_worst(rows, "native_err_reserved")["native_err_reserved"]))


MODEL_NAMES = {"gpt2-small": "GPT-2 small", "vit-l16": "ViT-L/16"}
"""How README names the timed models (benchmarks/gpu_extra.py TIME_MODELS)."""


def step_time_gpu() -> tuple[str, ...]:
    report = results("step_time_gpu")
    rows = [r for r in report["rows"] if "error" in r]
    s, worst = report["summary"], _worst(rows, "error")
    by = {p: [r["error"] for r in rows if r["precision"] == p] for p in ("32-true", "bf16-mixed")}
    return (report["environment"]["gpu"]["name"], str(s["n"]), pct(s["median_abs"], 1), signed_pct(s["worst"], 1),
            MODEL_NAMES[worst["model"]], worst["precision"], str(worst["micro_batch"]),
            "checkpointing" if worst["checkpointing"] else "no checkpointing",
            signed_pct(min(by["32-true"]), 1),
            signed_pct(max(by["32-true"]), 1), signed_pct(min(by["bf16-mixed"]), 1), signed_pct(max(by["bf16-mixed"]), 1))


def step_time_cards() -> tuple[str, ...]:
    now, before = results("step_time_cards"), results("step_time_cards_before")
    figures = []
    for card in ("H200", "H100"):
        (old,), (new,) = ([c["summary"] for c in r["cards"] if c["card"] == card] for r in (before, now))
        figures += [pct(old["median_abs"], 1), pct(new["median_abs"], 1), card, signed_pct(old["worst"], 1),
                    signed_pct(new["worst"], 1)]
    return tuple(figures)


def nccl_one_rank() -> tuple[str, ...]:
    return (_mib(results("cuda_overheads_gpu")["measured"]["nccl_one_rank_outside_allocator"]),)


def plan_vs_bisect_gpu() -> tuple[str, ...]:
    (row,) = [r for r in results("plan_vs_bisect_gpu")["rows"] if r.get("config") == "gpt2-small"]
    ran = {p["micro_batch"]: p["fits"] for p in row["probes"]}
    largest = max(m for m, fits in ran.items() if fits)
    assert ran[row["memplan_max_micro_batch"]] and row.get("truth_max_micro_batch") is None  # the search was cut
    return str(row["memplan_max_micro_batch"]), str(largest)


# --- the second GPU campaign: one H100 (benchmarks/results/*_gpu_h100.json) -------------------------------
def accuracy_gpu_h100() -> tuple[str, ...]:
    from benchmarks.accuracy_gpu import extra_cases

    report = results("accuracy_gpu_h100")
    env, s, rows = report["environment"], report["summary"], report["rows"]
    measured = [r for r in rows if "error" not in r["truth"]]
    native = [r for r in measured if "error" not in r["native"]]
    figures = []
    for key in ("native_err_allocated", "native_err_reserved", "native_err_nvml"):
        worst = _worst(native, key)
        figures += [pct(s[key]["median_abs"], 2), signed_pct(worst[key]), worst["case"]]
    goal = all(s[k]["median_abs"] <= 0.03 and s[k]["worst_abs"] <= 0.06 and s[k]["most_under"] >= -0.02
               for k in ("native_err_allocated", "native_err_reserved", "native_err_nvml"))
    outside = [r["truth"]["nvml_process_peak"] - r["truth"]["max_reserved"] for r in measured]
    context = results("cuda_overheads_gpu_h100")["replaces"]["_CONTEXT_LAZY_BYTES[9]"]["now"]
    zoo, extra = _zoo_cases(), extra_cases()
    return (env["gpu"]["name"], env["driver"], env["torch"], str(sum(r["case"] in zoo for r in rows)),
            str(sum(r["case"] in extra for r in rows)), str(len(measured)), str(len(native)), *figures,
            "met" if goal else "not met", _mib(min(outside)), _mib(max(outside)), _mib(context))


def _fidelity_now(name: str, gpu: str) -> tuple[str, ...]:
    """A gpu_fidelity report's re-estimate of its campaign's cases: n, then median |error| and worst per quantity."""
    report = results(name)
    assert report["campaign"]["gpu"] == gpu
    summary = report["summary"]["now_on_recorded"]
    return (str(summary["allocated"]["n"]),
            *(f for key in ("allocated", "reserved", "nvml")
              for f in (pct(summary[key]["median_abs"], 2), signed_pct(summary[key]["worst"]))))


def gpu_fidelity_h100() -> tuple[str, ...]:
    return _fidelity_now("gpu_fidelity_h100", "H100-80GB")


def accuracy_gpu_h200_s13() -> tuple[str, ...]:
    from benchmarks.accuracy_gpu import extra_cases

    report = results("accuracy_gpu_h200-s13")
    env, s, rows = report["environment"], report["summary"], report["rows"]
    measured = [r for r in rows if "error" not in r["truth"] and "error" not in r["emulated"]]
    figures = []
    for key in ("emulated_err_allocated", "emulated_err_reserved", "emulated_err_nvml"):
        worst = _worst(measured, key)
        figures += [pct(s[key]["median_abs"], 2), signed_pct(worst[key]), worst["case"]]
    zoo, extra = _zoo_cases(), extra_cases()
    return (env["gpu"]["name"], env["driver"], env["torch"], str(sum(r["case"] in zoo for r in rows)),
            str(sum(r["case"] in extra for r in rows)), str(len(measured)), env["memplan_commit"][:7], *figures)


def gpu_fidelity_h200_s13() -> tuple[str, ...]:
    return _fidelity_now("gpu_fidelity_h200-s13", "H200")


def step_time_gpu_h100() -> tuple[str, ...]:
    report = results("step_time_gpu_h100")
    rows = [r for r in report["rows"] if "error" in r]
    s, worst = report["summary"], _worst(rows, "error")
    by = {p: [r["error"] for r in rows if r["precision"] == p] for p in ("32-true", "bf16-mixed")}
    (profiled,) = [r for r in results("kernel_profile_gpu_h100")["rows"]
                   if r["precision"] == "bf16-mixed" and r["micro_batch"] == 8]
    (timed,) = [r for r in rows if r["model"] == "gpt2-small" and r["precision"] == "bf16-mixed"
                and r["micro_batch"] == 8 and not r["checkpointing"]]
    longer = profiled["gpu_busy_seconds_per_step"] > timed["predicted"]["step_seconds"]
    return (report["environment"]["gpu"]["name"], str(s["n"]), pct(s["median_abs"], 1), signed_pct(s["worst"], 1),
            MODEL_NAMES[worst["model"]], worst["precision"], str(worst["micro_batch"]),
            "checkpointing" if worst["checkpointing"] else "no checkpointing",
            signed_pct(min(by["32-true"]), 1), signed_pct(max(by["32-true"]), 1), signed_pct(min(by["bf16-mixed"]), 1),
            signed_pct(max(by["bf16-mixed"]), 1), str(profiled["micro_batch"]),
            f"{100 * profiled['busy_over_unprofiled']:.0f}", "longer" if longer else "no longer")


GPU_PROBE_EVERY = 50
"""The interval of benchmarks.gpu_probes' overhead runs (Trainer(log_every_n_steps=50), the callback's default)."""


def callback_overhead_gpu_h100() -> tuple[str, ...]:
    report = results("callback_gpu_h100")
    o = report["overhead"]
    timed = {r["steps"] for r in o["runs"] if r.get("arm") == "own"}.pop()
    first = o["steps"] - timed
    readings = sum(1 for step in range(first + 1, o["steps"] + 1) if step % GPU_PROBE_EVERY == 0)
    return (report["environment"]["gpu"]["name"], o["precision"], str(o["micro_batch"]),
            signed_pct(o["end_to_end_overhead"]), f"{o['median_step_ms_without']:.2f}",
            f"{o['median_step_ms_with']:.2f}", f"{o['own_us_per_step'] / 1000:.2f}",
            "over" if o["own_overhead"] > 0.005 else "under", "0.5", str(readings), str(timed))


def oom_and_cnn_gpu_h100() -> tuple[str, ...]:
    oom = results("callback_gpu_h100")["oom_retry"]
    (retry,) = [e for e in oom["rank_log"]["notable"] if e["event"] == "oom_retry"]
    assert retry["failed_micro_batch_size"] == oom["loaded_batch"]
    (cnn,) = [r for r in results("plan_vs_bisect_gpu_h100")["rows"] if r.get("config") == "cnn"]
    from benchmarks.plan_vs_bisect_gpu import CAP

    assert cnn["memplan_max_micro_batch"] == cnn["truth_max_micro_batch"] == CAP and cnn["truth_first_oom"] is None
    return (str(oom["loaded_batch"]), retry["phase"], str(retry["micro_batch_size"]), str(oom["global_step"]),
            "finished" if oom["finished"] else "did not finish", cnn["precision"], str(CAP),
            f"{cnn['suggest_seconds']:.1f}", f"{cnn['batch_size_finder_seconds']:.1f}", str(cnn["batch_size_finder_batch"]),
            "met" if cnn["suggest_over_batch_size_finder"] <= 0.1 else "not met")
