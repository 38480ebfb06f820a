"""benchmarks/published_gpu.py reproduces older torch's memory behaviour in a few places; each stand-in must
compute what the original computes and keep what the original kept (CPU, small tensors)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.published_gpu import (
    FIGURES, QUANTITIES, Adam2_0, AdamW2022, VisionTransformer, torch_1_10_softmax, torch_2_1_flash_layout,
)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def _two_steps(optimizer_class, **kwargs) -> list[torch.Tensor]:
    params = _params()
    opt = optimizer_class(params, **kwargs)
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (step + 1) * (i + 1))
        opt.step()
    return [p.detach() for p in params]


def test_adam_2_0_updates_as_torch_adam():
    ours = _two_steps(Adam2_0, lr=1e-2)
    torch_adam = _two_steps(torch.optim.Adam, lr=1e-2, foreach=False)
    for a, b in zip(ours, torch_adam):
        torch.testing.assert_close(a, b)


def test_adamw_2022_updates_as_adam_up_to_where_eps_sits():
    """transformers' 2022 AdamW adds eps to sqrt(v) before the bias correction; torch's after it."""
    ours = _two_steps(AdamW2022, lr=1e-2, eps=1e-12)
    torch_adam = _two_steps(torch.optim.Adam, lr=1e-2, eps=1e-12, foreach=False)
    for a, b in zip(ours, torch_adam):
        torch.testing.assert_close(a, b)


def _saved(fn, x) -> list[torch.Tensor]:
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fn(x)
    return kept


def test_torch_1_10_softmax_keeps_its_input_and_differentiates_as_softmax():
    x = torch.randn(2, 3, 5, requires_grad=True)
    weight = torch.randn(2, 3, 5)
    (F.softmax(x, dim=-1) * weight).sum().backward()
    expected, x.grad = x.grad, None
    with torch_1_10_softmax():
        (F.softmax(x, dim=-1) * weight).sum().backward()
        saved = _saved(lambda t: F.softmax(t * 1.0, dim=-1), x)
    torch.testing.assert_close(x.grad, expected)
    assert len([t for t in saved if t.shape == x.shape]) == 2  # its input and its output
    assert len([t for t in _saved(lambda t: F.softmax(t * 1.0, dim=-1), x) if t.shape == x.shape]) == 1


def test_torch_2_1_flash_layout_keeps_values_and_lays_16_bit_output_out_batch_seq_heads():
    q = torch.randn(3, 7, 2, 4, dtype=torch.bfloat16).transpose(1, 2)  # (batch, heads, seq, dim), as MHA passes it
    with torch_2_1_flash_layout():
        out = F.scaled_dot_product_attention(q, q, q)
        out32 = F.scaled_dot_product_attention(q.float(), q.float(), q.float())
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))
    assert out.transpose(1, 2).is_contiguous()
    assert out32.stride() == F.scaled_dot_product_attention(q.float(), q.float(), q.float()).stride()


def test_vit_l16_has_torchvision_parameter_count_with_a_10_class_head():
    with torch.device("meta"):
        model = VisionTransformer()
    # torchvision's vit_l_16: 304,326,632 parameters with its 1000-class head
    assert sum(p.numel() for p in model.parameters()) == 304_326_632 - (1024 * 1000 + 1000) + (1024 * 10 + 10)


def test_every_figure_names_a_quantity_memplan_reports_and_its_conditions():
    assert len(FIGURES) >= 10
    for fig in FIGURES:
        assert fig.quantity in QUANTITIES and fig.source.startswith("https://") and fig.quote and fig.published_bytes > 0
        assert {"model", "batch", "input", "precision", "optimizer", "gpu", "torch", "checkpointing", "loop"} <= set(
            fig.conditions)
