"""MemoryPlanner plans a Trainer(deterministic=True) run as a deterministic one: the setting is read from the
training process (where Lightning's Trainer applied it) and passed to the planning, and to FSDP's planning process,
whose own torch flags are not the Trainer's (memplan.estimator.determinism)."""
from __future__ import annotations

import types

import pytest
import torch
from op_reading import op_transients

import memplan
from memplan.callback import MemoryPlanner, fit_start, fsdp_plan
from memplan.demos import GPTLM, RandomTokens
from memplan.estimator.fsdp import FsdpSettings
from memplan.planner import tracing

MODEL = dict(vocab_size=64, context=256, d_model=128, n_layers=1, n_heads=2, dropout=0.0)
TWO_BLOCKS = dict(MODEL, n_layers=2)
"""FSDP gives each repeated block its own fully_shard."""
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
EXTRA = 65 * 131_072
"""The dQ accumulators a deterministic backward keeps beyond the one (one block, 2 heads of 64, 256 tokens, batch 1,
an H100's 132 SMs: 66 splits of [1, 256, 2, 64] fp32)."""


class Traced(Exception):
    """Raised by the stand-in planner after one trace of the callback's estimator."""


def one_trace(request, estimator):
    raise Traced(estimator(micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=1))


@pytest.fixture
def lightning_flags(monkeypatch):
    """torch's deterministic flags and CUBLAS_WORKSPACE_CONFIG (Lightning sets both) restored after the test."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (restored, or removed, at the end)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    benchmark = torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark


def held_in_the_callback_s_trace(make_trainer, monkeypatch, **trainer) -> int:
    """The flash backward's temporaries in the trace of the callback's request, traced for an H100 (this CPU
    machine's own planning would trace for its CPU ranks, where flash attention does not run)."""
    real = tracing.estimator_for
    monkeypatch.setattr(fit_start, "estimator_for", lambda *a, **kw: real(*a, **{**kw, "device": "H100-80GB"}))
    seen = op_transients(monkeypatch, FLASH_BACKWARD)
    with pytest.raises(Traced):
        make_trainer([MemoryPlanner(planner=one_trace)], max_steps=1, **trainer).fit(
            GPTLM(**MODEL), datamodule=RandomTokens(batch_size=1, vocab_size=64, context=256))
    (held,) = set(seen)
    return held


def test_the_trainer_s_deterministic_setting_reaches_the_callback_s_planning(make_trainer, monkeypatch,
                                                                            lightning_flags):
    plain = held_in_the_callback_s_trace(make_trainer, monkeypatch)
    assert held_in_the_callback_s_trace(make_trainer, monkeypatch, deterministic=True) - plain == EXTRA
    assert held_in_the_callback_s_trace(make_trainer, monkeypatch, deterministic="warn") == plain  # warn-only


def planner_in_the_planning_process(request, estimator):
    """FSDP's planning process runs this (by reference: this module): one FSDP trace, and its estimate back."""
    return types.SimpleNamespace(strategy="ddp", estimate=estimator(
        micro_batch_size=1, precision="bf16-mixed", checkpointing=False, world_size=2))


@pytest.mark.slow
def test_fsdp_s_planning_process_traces_with_the_setting_it_is_sent(lightning_flags):
    """The planning process's torch flags are its own (off); the estimate it sends back is the deterministic one."""
    torch.use_deterministic_algorithms(False)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 64, (1, 256), generator=g), torch.randint(0, 64, (1, 256), generator=g)
    sent = fsdp_plan.plan_in_subprocess(GPTLM(**TWO_BLOCKS), batch, None, FsdpSettings(),
                                        planner_in_the_planning_process, "H100-80GB", True).estimate

    def here(deterministic):
        return memplan.estimate(lambda: GPTLM(**TWO_BLOCKS), batch, precision="bf16-mixed", device="H100-80GB",
                                strategy="fsdp", world_size=2, fsdp=FsdpSettings(), deterministic=deterministic)

    on, off = here(True), here(False)
    assert (sent.peak_allocated, sent.notes) == (on.peak_allocated, on.notes)
    assert on.peak_allocated > off.peak_allocated
    assert any("_scaled_dot_product_flash_attention_backward (2 a step)" in n for n in sent.notes)
