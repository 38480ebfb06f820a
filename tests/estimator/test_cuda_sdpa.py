"""emulate_cuda and scaled dot-product attention: a CPU trace (real or fake tensors) picks the backend CUDA would
(flash, efficient, math) and saves what that backend saves, with values matching the math reference; the
emulation is undone on error. The rest of emulate_cuda is tests/estimator/test_cuda_semantics.py's."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from cuda_emulation import BF16, FP16, FP32, cuda_autocast, modes, saved_tensors
from torch.nn.attention import SDPBackend, sdpa_kernel

from memplan.estimator.cuda.sdpa import select_backend
from memplan.estimator.cuda.semantics import emulate_cuda

# --- scaled dot-product attention ---------------------------------------------------------------

def qkv(dtype, *, heads=4, kv_heads=None, length=128, kv_length=None, head_dim=64):
    kv_heads, kv_length = kv_heads or heads, kv_length or length
    make = lambda h, n: torch.randn(2, h, n, head_dim, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(heads, length), make(kv_heads, kv_length), make(kv_heads, kv_length)


def has_attention_matrix(saved, length, kv_length=None):
    return any(shape[-2:] == (length, kv_length or length) for shape, _ in saved)


@modes()
def test_bf16_on_sm90_uses_flash_and_saves_no_attention_matrix(mode):
    with mode():
        q, k, v = qkv(BF16)
        _, cpu_saved = saved_tensors(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
        with emulate_cuda(compute_capability=(9, 0), autocast_dtype=None):
            out, saved = saved_tensors(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
            out.float().sum().backward()
    assert has_attention_matrix(cpu_saved, 128)  # CPU takes math with dropout
    assert out.grad_fn.name() == "ScaledDotProductFlashAttentionBackward0"
    assert not has_attention_matrix(saved, 128)
    assert ((2, 4, 128), FP32) in saved  # the logsumexp
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@modes()
def test_fp32_uses_efficient_attention(mode):
    with mode():
        q, k, v = qkv(FP32)
        with emulate_cuda(compute_capability=(8, 0), autocast_dtype=None):
            out, saved = saved_tensors(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            out.sum().backward()
    assert out.grad_fn.name() == "ScaledDotProductEfficientAttentionBackward0"
    assert not has_attention_matrix(saved, 128)
    assert q.grad.shape == q.shape


@modes()
def test_autocast_sdpa_casts_then_picks_flash(mode):
    with mode():
        q, k, v = qkv(FP32)
        with cuda_autocast():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with emulate_cuda(compute_capability=(9, 0), autocast_dtype=BF16):
            out.float().sum().backward()
    assert out.dtype == BF16
    assert out.grad_fn.name() == "ScaledDotProductFlashAttentionBackward0"
    assert k.grad.dtype == FP32


@pytest.mark.parametrize(
    ("dtype", "expected"), [(BF16, "math"), (FP16, "efficient"), (FP32, "efficient")]
)
def test_sm70_never_uses_flash(dtype, expected):
    q, k, v = qkv(dtype)
    assert select_backend(q, k, v, None, 0.0, False, False, compute_capability=(7, 0)) == expected
    with emulate_cuda(compute_capability=(7, 0), autocast_dtype=None):
        out, saved = saved_tensors(lambda: F.scaled_dot_product_attention(q, k, v))
    assert "Flash" not in out.grad_fn.name()
    assert has_attention_matrix(saved, 128) == (expected == "math")


def test_backend_choice_follows_cuda_rules():
    def choice(q, k, v, mask=None, dropout_p=0.0, is_causal=False, gqa=False, cc=(8, 0)):
        return select_backend(q, k, v, mask, dropout_p, is_causal, gqa, compute_capability=cc)

    bf16 = qkv(BF16)
    assert choice(*bf16) == "flash"
    assert choice(*bf16, mask=torch.ones(128, 128, dtype=torch.bool)) == "efficient"  # flash: no mask
    assert choice(*qkv(BF16, kv_length=64), is_causal=True) == "efficient"  # non-square causal
    assert choice(*qkv(BF16, head_dim=208), cc=(8, 6)) == "efficient"  # sm86 training, (192, 224]
    assert choice(*qkv(BF16, head_dim=256), cc=(8, 6), dropout_p=0.1) == "efficient"
    assert choice(*qkv(BF16, head_dim=256), cc=(8, 6)) == "flash"
    assert choice(*qkv(BF16, head_dim=208), cc=(9, 0)) == "flash"
    assert choice(*qkv(BF16, head_dim=512)) == "efficient"  # flash: head_dim <= 256
    assert choice(*qkv(FP32, head_dim=62)) == "math"  # efficient: head_dim % 4 on sm80
    assert choice(*qkv(FP16, head_dim=60), cc=(7, 5)) == "math"  # efficient: head_dim % 8 for fp16
    base = torch.randn(2, 4, 128, 65)
    offset_q = base[..., 1:]  # storage offset 1: not 4-element aligned for sm80's efficient kernel
    assert choice(offset_q, offset_q, offset_q) == "math"
    assert choice(offset_q, offset_q, offset_q, cc=(7, 5)) == "efficient"  # checked on sm80+ only
    assert choice(*qkv(BF16, heads=8, kv_heads=2), gqa=True) == "flash"
    assert choice(*qkv(FP32, heads=8, kv_heads=2), gqa=True) == "math"  # 2.13 efficient: no GQA
    with sdpa_kernel([SDPBackend.MATH]):
        assert choice(*bf16) == "math"


@modes()
def test_gqa_and_odd_head_dim_run_through_flash(mode):
    with mode():
        q, k, v = qkv(BF16, heads=8, kv_heads=2, head_dim=60)
        with emulate_cuda(compute_capability=(8, 0), autocast_dtype=None):
            out, saved = saved_tensors(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.1)
            )
            out.float().sum().backward()
    assert out.shape == (2, 8, 128, 60)
    assert ((2, 8, 128, 64), BF16) in saved and ((2, 2, 128, 64), BF16) in saved  # padded to 64
    assert k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize(
    "case",
    ["flash_causal", "flash_gqa_padded", "efficient_mask", "efficient_causal_nonsquare", "math_sm70"],
)
def test_emulated_attention_matches_the_math_reference(case):
    """Real CPU tensors: the reference kernels behind the fused ops compute the same values and
    gradients as the CPU math path."""
    kwargs, cc = {}, (8, 0)
    if case == "flash_causal":
        tensors, kwargs = qkv(BF16), {"is_causal": True}
    elif case == "flash_gqa_padded":
        tensors, kwargs = qkv(BF16, heads=4, kv_heads=2, head_dim=20), {"enable_gqa": True, "scale": 0.3}
    elif case == "efficient_mask":
        tensors = qkv(FP32)
        kwargs = {"attn_mask": torch.rand(128, 128) > 0.3}
    elif case == "efficient_causal_nonsquare":
        tensors, kwargs = qkv(FP32, length=96, kv_length=128), {"is_causal": True}
    else:
        tensors, cc = qkv(BF16), (7, 0)
    grads = []
    for emulate in (False, True):
        for t in tensors:
            t.grad = None
        ctx = emulate_cuda(compute_capability=cc, autocast_dtype=None) if emulate else contextlib.nullcontext()
        with ctx:  # backward too: the fused ops' CPU kernels exist only inside the emulation
            out = F.scaled_dot_product_attention(*tensors, **kwargs)
            out.float().pow(2).sum().backward()
        grads.append([out.detach().float()] + [t.grad.float() for t in tensors])
    for reference, emulated in zip(*grads):
        if tensors[0].dtype == BF16:  # two summation orders in bf16 differ by a few units in the last place of the
            # tensor's largest values (2**-8 of it), anywhere in it: bound the difference by the tensor's scale
            scale = reference.abs().max().item()
            torch.testing.assert_close(emulated, reference, atol=2 ** -5 * scale, rtol=3e-2)
        else:
            torch.testing.assert_close(emulated, reference, atol=1e-4, rtol=1e-4)


def test_emulation_is_undone_on_error():
    clear = torch.clear_autocast_cache
    with pytest.raises(KeyError):
        with emulate_cuda(compute_capability=(8, 0), autocast_dtype=BF16):
            raise KeyError("boom")
    assert torch.clear_autocast_cache is clear
    q, k, v = qkv(BF16)
    assert F.scaled_dot_product_attention(q, k, v).grad_fn.name() != "ScaledDotProductFlashAttentionBackward0"
