"""Deterministic algorithms as an input of the estimate (memplan.estimator.determinism): estimate(deterministic=...)
reaches the CUDA rules that depend on it, whatever torch's flags are in the process that traces; None follows them."""
from __future__ import annotations

import pytest
import torch
from op_reading import op_transients

import memplan
from memplan.demos import GPTLM
from memplan.estimator.cuda.op_scratch import cuda_op_scratch_bytes
from memplan.estimator.determinism import process_deterministic
from memplan.units import KiB, MiB

aten = torch.ops.aten
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default
MODEL = dict(vocab_size=64, context=256, d_model=128, n_layers=1, n_heads=2, dropout=0.0)
"""One block, 2 heads of 64: on an H100 (132 SMs) the deterministic backward keeps ceil(132 / 2) = 66 dQ copies."""


def tokens(batch: int = 1, seq: int = 256):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, 64, (batch, seq), generator=g)


def extra_accumulators(batch: int, heads: int, seq: int, head_dim: int, sm_count: int) -> int:
    """The dQ accumulators beyond the one a non-deterministic backward keeps: (splits - 1) x [B, S128, H, D32]
    fp32, where the one buffer of all splits is block-rounded (512 B): this shape's are multiples of 512 already."""
    splits = -(-sm_count // (batch * heads))
    return (splits - 1) * batch * (-(-seq // 128) * 128) * heads * (-(-head_dim // 32) * 32) * 4


def flash_held(monkeypatch, **kwargs) -> tuple[set[int], memplan.MemoryEstimate]:
    """What the flash backward holds inside the op in the estimate's steps, and the estimate (H100, bf16-mixed)."""
    seen = op_transients(monkeypatch, FLASH_BACKWARD)
    est = memplan.estimate(lambda: GPTLM(**MODEL), tokens(), precision="bf16-mixed", device="H100-80GB", **kwargs)
    monkeypatch.undo()
    return set(seen), est


def test_the_argument_moves_the_flash_backward_by_the_accumulators_whatever_the_process_flags(monkeypatch,
                                                                                              process_flags):
    torch.use_deterministic_algorithms(True)  # the tracing process says deterministic; the argument wins
    (off,), plain = flash_held(monkeypatch, deterministic=False)
    torch.use_deterministic_algorithms(False)
    (on,), det = flash_held(monkeypatch, deterministic=True)
    assert on - off == extra_accumulators(1, 2, 256, 64, 132) == 65 * 131_072
    assert det.peak_allocated > plain.peak_allocated
    assert not any("deterministic" in n for n in plain.notes)
    assert any("deterministic=True" in n and "_scaled_dot_product_flash_attention_backward (1 a step)" in n
               for n in det.notes)


def test_warn_only_keeps_flash_s_single_accumulator(monkeypatch):
    """Lightning's deterministic='warn' is warn-only: attention_backward.cu runs the non-deterministic kernel."""
    (warn,), est = flash_held(monkeypatch, deterministic="warn")
    (off,), _ = flash_held(monkeypatch, deterministic=False)
    assert warn == off
    assert any("deterministic='warn', warn-only" in n and "no op of this step" in n for n in est.notes)


def test_none_follows_the_process_flags(monkeypatch, process_flags):
    torch.use_deterministic_algorithms(True)
    assert process_deterministic() is True
    (followed,), _ = flash_held(monkeypatch)
    (given,), _ = flash_held(monkeypatch, deterministic=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert process_deterministic() == "warn"
    torch.use_deterministic_algorithms(False)
    (unset,), _ = flash_held(monkeypatch)
    assert followed == given and unset == followed - extra_accumulators(1, 2, 256, 64, 132)


def test_index_put_sorts_under_deterministic_algorithms_warn_only_too():
    """TensorAdvancedIndexing.cpp: accumulate || (deterministicAlgorithms() && value.numel() > 1): the flag, warn-only
    or not. 2048 int64 indices: the linear index, sorted, original and arange(N) (16,384 B each), cub's block."""
    meta = dict(device="meta")
    args = (torch.empty(2048, 256, **meta), [torch.empty(2048, dtype=torch.int64, **meta)],
            torch.empty(2048, 256, **meta), False)
    assert cuda_op_scratch_bytes(aten.index_put_.default, args, {}, deterministic=False) == 0
    assert cuda_op_scratch_bytes(aten.index_put_.default, args, {}, deterministic="warn") == 66_048
    assert cuda_op_scratch_bytes(aten.index_put_.default, args, {}, deterministic=True) == 66_048
    one = (args[0], args[1], torch.empty((), **meta), False)  # one value: index_put_'s own kernel still
    assert cuda_op_scratch_bytes(aten.index_put_.default, one, {}, deterministic=True) == 0


def test_a_lightning_step_under_determinism_has_lightning_s_cublas_workspace(monkeypatch):
    """Trainer(deterministic=True or 'warn') sets CUBLAS_WORKSPACE_CONFIG=:4096:8 (32 MiB a handle; an A100's default
    is 8 MiB + 128 KiB); a plain torch loop keeps the process's environment."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)

    def workspaces(**kwargs) -> int:
        return memplan.estimate(lambda: GPTLM(**MODEL), tokens(), device="A100-80GB", **kwargs).workspaces

    plain, warn = workspaces(deterministic=False), workspaces(deterministic="warn")
    handles = (warn - plain) // (32 * MiB - 8320 * KiB)
    assert handles >= 1 and warn - plain == handles * (32 * MiB - 8320 * KiB)
    assert workspaces(deterministic=True, loop="torch") == workspaces(deterministic=False, loop="torch") == plain


@pytest.mark.parametrize("bad", ["yes", 1, "True"])
def test_a_bad_setting_is_one_error_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"^deterministic must be True, False or 'warn'.*got") as caught:
        memplan.estimate(lambda: GPTLM(**MODEL), tokens(), device="H100-80GB", deterministic=bad)
    assert caught.value.argument == "deterministic"
