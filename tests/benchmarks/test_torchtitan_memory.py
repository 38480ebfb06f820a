"""benchmarks/torchtitan_memory.py rebuilds torchtitan's Llama 3.1 8B step of December 2024; the pieces that
differ from a plain loop must do what torchtitan's code does (CPU, small or meta tensors; no 8B trace here)."""
from __future__ import annotations

import os

import torch

from benchmarks import torchtitan_memory as tt
from memplan.estimator.allocator_config import AllocatorConfig


def test_benchmark_optimizer_clips_gradients_to_max_norm_before_its_step():
    """torchtitan's train.py calls utils.clip_grad_norm_(max_norm=1.0, foreach=True) before optimizers.step():
    after the benchmark's step the gradients' total norm is 1, whatever it was."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    for p in params:
        p.grad = 10 * torch.randn(p.shape, generator=g)
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])) > 5
    tt.adamw(params).step()
    total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    torch.testing.assert_close(total, torch.tensor(1.0), atol=1e-5, rtol=1e-5)


def test_rope_table_covers_the_training_sequence_as_torchtitan_sizes_it():
    """train.py sets model_config.max_seq_len = training.seq_len, and precompute_freqs_cis makes one row per
    position up to max_seq_len (no 2x margin at that commit)."""
    with torch.device("meta"):
        model = tt.Transformer()
    assert tuple(model.freqs_cis.shape) == (tt.SEQ, tt.DIM // tt.HEADS // 2)
    assert model.freqs_cis.dtype == torch.complex64


def test_default_setting_traces_the_default_allocator_and_restores_the_callers_settings(monkeypatch):
    """The compared setting runs with the caching allocator's defaults even where the caller has set
    expandable segments; the '-expandable' rows set them; the caller's variables come back afterwards."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert not tt.SETTINGS["op"].expandable and tt.SETTINGS["op-expandable"].expandable
    with tt.allocator_settings(tt.SETTINGS["op"].expandable):
        assert AllocatorConfig.from_env().expandable_segments is False
    with tt.allocator_settings(tt.SETTINGS["op-expandable"].expandable):
        assert AllocatorConfig.from_env().expandable_segments is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in os.environ


def test_both_published_figures_are_compared_with_their_own_gpu_count():
    """Table 1 (8 GPUs) and Table 3 (128 GPUs) are each compared with the trace of their own rank count."""
    rows = [{"gpus": 8, "checkpointing": "op", "pools": "per stream", "allocator": "default", "peak_reserved_gib": 82.0},
            {"gpus": 128, "checkpointing": "op", "pools": "per stream", "allocator": "default",
             "peak_reserved_gib": 67.0},
            {"gpus": 8, "checkpointing": "op", "pools": "one pool", "allocator": "default", "peak_reserved_gib": 70.0}]
    by_gpus = {c["gpus"]: c for c in tt.compare(rows)}
    assert set(by_gpus) == {8, 128}
    assert by_gpus[8]["published_gib"] == 82.4 and by_gpus[8]["estimated_gib"] == 82.0
    assert by_gpus[128]["published_gib"] == 67.0 and by_gpus[128]["relative_error"] == 0.0
