"""The benchmark zoo trains, and the truth harness reads the allocator's peak to the byte."""
from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from subprocess_run import run_watched

from benchmarks.cpu_truth import analyze_trace, training
from benchmarks.zoo import CASES, OPTIMIZERS
from memplan.estimator.checkpointing import find_repeated_blocks
from memplan.estimator.result import PRECISIONS
from memplan.truth import train

ROOT = Path(__file__).resolve().parents[2]

# linear-b64-sgd: Linear(1000, 1000), x: 64 x 1000 fp32, y: 64 int64 targets, cross-entropy, plain SGD
# (no state; its foreach update is in place). Worked out by hand:
PARAMS = 1000 * 1000 * 4 + 1000 * 4  # weight + bias = 4_004_000
BATCH = 64 * 1000 * 4 + 64 * 8  # x + y = 256_512
LOGITS = 64 * 1000 * 4  # addmm output; log_softmax's output and every [64, 1000] gradient are this size
LOSS_AND_TOTAL_WEIGHT = 4 + 4  # nll_loss_forward's scalar output and its total_weight (saved for backward)
# The truth trains through a real Trainer.fit, which adds bytes of its own:
RNG_STATES = 5056  # isolate_rng's copy of the CPU generator's state while Trainer.fit starts (freed)
CLOSURE_LOSS = 4  # the closure's `loss / accumulate_grad_batches`, alive through the backward
# build: parameters, then the batch; then Trainer.fit's setup.
BUILD_PEAK = PARAMS + BATCH + RNG_STATES  # 4_265_568
# step 1 peaks in backward at the bias gradient: the logits' gradient (log_softmax backward) is still
# alive while mm writes grad W and sum writes grad b.
STEP1_PEAK = PARAMS + BATCH + LOSS_AND_TOTAL_WEIGHT + CLOSURE_LOSS + LOGITS + PARAMS  # 8_520_524
# between steps: parameters, gradients (set_to_none happens after the next forward), batch.
STEP2_START = PARAMS + PARAMS + BATCH  # 8_264_512
# step 2 peaks in forward, Lightning's order: last step's gradients are alive while the logits
# (freed right after, as log_softmax saves its output, not its input), log-probs and loss exist.
STEP2_PEAK = STEP2_START + LOGITS + LOGITS + LOSS_AND_TOTAL_WEIGHT  # 8_776_520


def test_truth_of_one_linear_layer_is_the_hand_worked_figure():
    proc = run_watched(
        [sys.executable, "-m", "benchmarks.cpu_truth", "linear-b64-sgd"],
        cwd=ROOT, check=True,
    )
    truth = json.loads(proc.stdout.splitlines()[-1])
    assert truth["phase_peaks"] == {"build": BUILD_PEAK, "step1": STEP1_PEAK, "step2": STEP2_PEAK}
    assert truth["phase_start_allocated"]["step2"] == STEP2_START
    assert truth["peak_allocated"] == STEP2_PEAK == 8_776_520
    assert truth["loop"] == "Trainer.fit"
    assert truth["peak_phase"] == "step2"
    assert truth["end_allocated"] == STEP2_START
    assert truth["baseline_allocated"] == 0
    assert truth["counter_mismatches"] == 0
    assert truth["scratch_at_peak"] == 0


def _memory(ts: float, nbytes: int, total: int, addr: int) -> dict:
    return {
        "ph": "i", "name": "[memory]", "ts": ts, "tid": 1,
        "args": {"Bytes": nbytes, "Total Allocated": total, "Addr": addr, "Device Type": 0, "Ev Idx": int(ts)},
    }


def _span(name: str, start: float, end: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start, "tid": 1}


def test_analyze_trace_finds_phase_peaks_and_kernel_scratch():
    trace = {"traceEvents": [
        _span("memplan.truth.build", 0, 10, "user_annotation"),
        _span("memplan.truth.step1", 10, 20, "user_annotation"),
        _span("memplan.truth.step2", 20, 40, "user_annotation"),
        _span("aten::conv", 21, 30),
        _span("aten::empty", 22, 23),
        # events out of time order, as in a real chrome trace
        _memory(35, -200, 100, 0xB),  # conv's output, freed after conv returned: not scratch
        _memory(1, 100, 100, 0xA),
        _memory(11, 50, 150, 0xC),
        _memory(15, -50, 100, 0xC),
        _memory(22.5, 200, 300, 0xB),  # conv's output, via aten::empty
        _memory(25, 300, 600, 0xD),  # a workspace conv frees before returning: scratch
        _memory(28, -300, 300, 0xD),
    ]}
    result = analyze_trace(trace)
    assert result["peak_allocated"] == 600
    assert result["phase_peaks"] == {"build": 100, "step1": 150, "step2": 600}
    assert result["peak_phase"] == "step2"
    assert result["peak_op_stack"] == ["aten::conv"]
    assert result["scratch_at_peak"] == 300
    assert result["peak_without_scratch"] == 300
    assert result["largest_scratch"] == {"op": "aten::conv", "bytes": 300}
    assert result["op_transient_at_peak"] == {"op": "aten::conv", "bytes": 300}
    assert result["end_allocated"] == 100
    assert result["counter_mismatches"] == 0


def test_analyze_trace_counts_events_the_running_total_disagrees_with():
    trace = {"traceEvents": [_memory(1, 100, 100, 0xA), _memory(2, 100, 250, 0xB)]}
    assert analyze_trace(trace)["counter_mismatches"] == 1


def test_zoo_covers_the_families_and_settings_the_benchmark_promises():
    families = {case.family for case in CASES.values()}
    assert {"mlp", "cnn", "resnet18", "lstm", "gru", "gpt2", "bert", "llama-gqa", "vit", "t5", "bart", "mixer",
            "mixtral-moe"} <= families
    assert {case.precision for case in CASES.values()} == set(PRECISIONS)
    assert {case.optimizer for case in CASES.values()} == set(OPTIMIZERS)
    assert all(case.name == name for name, case in CASES.items())
    for case in CASES.values():
        if case.checkpointing:
            assert len(find_repeated_blocks(case.build())) >= 2, case.name


def _distinct_at_batch_size_2() -> list[str]:
    """CASES' names for the real step, one per model, batch, loss and settings but precision: at batch size 2 a
    case that is an earlier one but for its name and batch size (mlp-b64 is mlp-b1024) would run the very same
    step again, and one that differs only in its precision (gpt2-b8-bf16mixed is gpt2-b8 in bf16-mixed) the same
    model, batch and loss in another precision, whose real step costs 2-5 times the float32 one on a CPU without
    bfloat16 kernels (an AVX2-only AMD EPYC: 170 CPU-s for the 9 such cases). The float32 case of a group is kept,
    and every precision keeps its first case, so each precision's own path still trains once."""
    groups: dict = {}
    for name in sorted(CASES):
        groups.setdefault(replace(CASES[name], name="", batch_size=2, precision="32-true"), []).append(name)
    names = [next((n for n in group if CASES[n].precision == "32-true"), group[0]) for group in groups.values()]
    for precision in PRECISIONS:
        if all(CASES[n].precision != precision for n in names):
            names.append(next(n for n in sorted(CASES) if CASES[n].precision == precision))
    return sorted(names)


def test_the_cases_left_out_of_the_real_step_are_a_kept_case_in_another_batch_size_or_precision():
    kept = _distinct_at_batch_size_2()
    assert {CASES[n].precision for n in kept} == set(PRECISIONS)
    for name in set(CASES) - set(kept):
        step = replace(CASES[name], name="", batch_size=2, precision="32-true")
        assert any(replace(CASES[k], name="", batch_size=2, precision="32-true") == step for k in kept), name
    assert {"mlp-b64", "gpt2-b8", "gpt2-b8-bf16mixed", "llama-gqa-b4-bf16mixed"} <= set(CASES) - set(kept)
    assert "llama-gqa-b2-bf16true" in kept  # the only bf16-true case


@pytest.mark.parametrize("name", _distinct_at_batch_size_2())
def test_every_case_trains_one_real_step_at_batch_size_2(name):
    case = CASES[name]
    torch.manual_seed(0)
    batch_again = case.make_batch(2)
    for a, b in zip(_tensors(case.make_batch(2)), _tensors(batch_again)):
        assert torch.equal(a, b)
    case = _short_if_a_precision_twin(case)
    losses, got_grad, models = [], set(), []

    def loss(model, batch):
        if not models:  # before the first backward: watch every gradient land
            models.append(model)
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _, n=n: got_grad.add(n))
        out = case.loss(model, batch)
        losses.append(out.detach())
        return out

    train(replace(training(case, batch_size=2, steps=1), loss=loss), loop=case.loop)
    (model,) = models
    assert model.training
    config = getattr(model, "config", None)
    if config is not None:
        assert config._attn_implementation == "sdpa"
    assert len(losses) == 1 and losses[0].dim() == 0 and math.isfinite(losses[0].item())
    untrained = [n for n, p in model.named_parameters() if p.requires_grad and n not in got_grad]
    assert untrained == []


#: tokens per sequence for a precision twin's real step (below)
TWIN_SEQ_LEN = 32


def _short_if_a_precision_twin(case):
    """The case, or, where it was kept only for its precision's path (its float32 twin, the same model, batch and
    loss, trains here too) and its batch is token sequences, the case on TWIN_SEQ_LEN tokens a sequence: what this
    test checks (a finite loss, every parameter's gradient, SDPA, train mode) does not depend on the length, and
    llama-gqa-b2-bf16true's 256 tokens cost 35 CPU-s on an AVX2-only AMD EPYC (bfloat16 matmuls without oneDNN
    bfloat16 kernels; its float32 twin 1.7), the suite's costliest real step."""
    twin = replace(case, name="", batch_size=2, precision="32-true")
    make = case.make_batch
    if (case.precision == "32-true" or not isinstance(make, functools.partial) or "seq_len" not in make.keywords
            or not any(replace(CASES[n], name="", batch_size=2) == twin for n in _distinct_at_batch_size_2())):
        return case
    return replace(case, make_batch=functools.partial(make, seq_len=TWIN_SEQ_LEN))


def test_a_precision_twin_trains_on_short_sequences_and_a_float32_case_at_full_length():
    short = _short_if_a_precision_twin(CASES["llama-gqa-b2-bf16true"])
    assert short.make_batch(2)["input_ids"].shape == (2, TWIN_SEQ_LEN) and short.precision == "bf16-true"
    for name in ("llama-gqa-b2", "mixtral-moe-b4", "vit-b32-bf16mixed-ckpt"):  # float32; no twin; no sequences
        assert _short_if_a_precision_twin(CASES[name]) is CASES[name]


def _tensors(batch):
    from memplan.batching import iter_tensors

    return list(iter_tensors(batch))
