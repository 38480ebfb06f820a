"""Scaled dot-product attention as CUDA runs it: the backend choice and the fused ops it calls.

CPU picks its own SDPA backend (`_scaled_dot_product_flash_attention_for_cpu` or math), so a CPU
trace saves what the CPU kernels save. `cuda_sdpa_kernel` replaces `aten::scaled_dot_product_attention`
on AutogradCPU with the CUDA composite: choose flash / memory-efficient / math as
`select_sdp_backend` does for the target GPU, then call the same aten op with the same
preprocessing, so autograd records ScaledDotProductFlashAttentionBackward0 (saving q, k, v, out and
an fp32 logsumexp) instead of an L x S attention matrix.

Sources: sdp_utils_cpp.h as shipped with torch 2.13 (torch/include/ATen/native/transformers/), the
.cpp files as read at a recent pytorch/pytorch main (the wheel ships no .cpp):
- aten/src/ATen/native/transformers/attention.cpp `scaled_dot_product_attention`: the per-backend
  preprocessing (pad_last_dim<8> for flash, convert_boolean_attn_mask, preprocess_mask for
  efficient, should_compute_logsumexp).
- aten/src/ATen/native/transformers/cuda/sdp_utils.cpp `can_use_flash_attention`,
  `can_use_mem_efficient_attention`, `select_sdp_backend`; the shared checks are in
  aten/src/ATen/native/transformers/sdp_utils_cpp.h.
- aten/src/ATen/Context.h: default priority flash, efficient, math, cuDNN.
The fused ops have meta kernels (torch/_meta_registrations.py), so fake tensors work. For real CPU
tensors `register_cpu_reference_kernels` adds CPU kernels that compute the same result in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memplan.compat.torch import override_kernel, sdp_priority_order

aten = torch.ops.aten
Backend = Literal["flash", "efficient", "math"]

# at::SDPBackend (aten/src/ATen/SDPBackend.h)
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3
_DEFAULT_PRIORITY = (_FLASH, _EFFICIENT, _MATH, _CUDNN)


def select_backend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, enable_gqa: bool, *, compute_capability: tuple[int, int],
) -> Backend:
    """The backend `select_sdp_backend` picks on a GPU of `compute_capability`, honouring
    torch.backends.cuda.enable_*_sdp and sdpa_kernel(..., set_priority=True). cuDNN attention is not
    emulated (it needs the runtime cuDNN version) and is skipped."""
    order = sdp_priority_order()
    if order is None:
        order = _DEFAULT_PRIORITY
    args = (query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, compute_capability)
    for backend in order:
        if backend == _FLASH and torch.backends.cuda.flash_sdp_enabled() and _can_use_flash(*args):
            return "flash"
        if backend == _EFFICIENT and torch.backends.cuda.mem_efficient_sdp_enabled() and _can_use_efficient(*args):
            return "efficient"
        if backend == _MATH and torch.backends.cuda.math_sdp_enabled():
            return "math"
    raise RuntimeError(
        "No available kernel for scaled_dot_product_attention on the emulated GPU (flash and "
        "memory-efficient do not apply and math is disabled; cuDNN attention is not emulated)."
    )


def _requires_grad(*tensors: torch.Tensor) -> bool:
    """`input_requires_grad` / `should_compute_logsumexp`: any input requires grad, grad mode on."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _dense_ok(q, k, v, enable_gqa: bool, *, supports_gqa: bool) -> bool:
    """check_tensor_shapes, check_batch_size_and_num_heads_dense, check_nonzero_sequence_lengths_dense."""
    if not (q.dim() == k.dim() == v.dim() == 4) or any(t.is_nested for t in (q, k, v)):
        return False
    if not q.size(0) == k.size(0) == v.size(0) or q.size(2) == 0 or k.size(2) == 0:
        return False
    if enable_gqa and supports_gqa:  # check_grouped_query_attention<requires_same_num_heads=true>
        return k.size(1) == v.size(1) and q.size(1) % k.size(1) == 0
    return q.size(1) == k.size(1) == v.size(1)


def _can_use_flash(q, k, v, mask, dropout_p, is_causal, enable_gqa, cc) -> bool:
    """can_use_flash_attention (sdp_utils.cpp), non-ROCm build."""
    head = q.size(-1)
    if mask is not None or not _dense_ok(q, k, v, enable_gqa, supports_gqa=True):
        return False
    if not (k.size(-1) == head and v.size(-1) == head and head <= 256):  # check_head_dim_size_flash
        return False
    if not (8, 0) <= cc <= (12, 1):  # check_flash_attention_hardware_support: [sm80, sm121]
        return False
    sm86_89_or_120 = (8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)
    if sm86_89_or_120 and _requires_grad(q, k, v) and not (head <= 192 or (dropout_p == 0 and head > 224)):
        return False  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if is_causal and q.size(-2) != k.size(-2):  # check_flash_causal_non_square_seqlens
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return False  # check_dtypes_low_precision (sm80+: fp16, bf16)
    return all(t.stride(-1) == 1 for t in (q, k, v)) or head == 1  # last-dim stride, singleton ok


def _gemm_alignment(dtype: torch.dtype, cc: tuple[int, int]) -> int:
    """minimum_gemm_alignment (sdp_utils.cpp), in elements."""
    is_half = dtype in (torch.float16, torch.bfloat16)
    use_tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and is_half)
    alignment = 4 if cc[0] >= 8 else 1
    return max(alignment, 128 // (16 if is_half else 32)) if use_tensor_cores else alignment


def _can_use_efficient(q, k, v, mask, dropout_p, is_causal, enable_gqa, cc) -> bool:
    """can_use_mem_efficient_attention (sdp_utils.cpp), non-ROCm build. GQA: the torch 2.13 kernel
    needs equal head counts (its meta backward gives grad_k the query's heads), so enable_gqa with
    fewer k/v heads falls back to math; pytorch main has since added GQA support here."""
    if not (5, 0) <= cc <= (12, 1) or not _dense_ok(q, k, v, enable_gqa, supports_gqa=False):
        return False
    align = _gemm_alignment(q.dtype, cc)
    head, head_v = q.size(-1), v.size(-1)
    if not (k.size(-1) == head and head % align == 0 and head_v % align == 0 and head > 0 and head_v > 0):
        return False  # check_head_dim_size_mem_efficient
    if cc[0] >= 8 and any(t.numel() and t.storage_offset() % align for t in (q, k, v)):
        return False  # check_data_ptr_alignment_mem_efficient
    if not all(t.stride(-1) == 1 for t in (q, k, v)) or (mask is not None and mask.stride(-1) != 1):
        return False  # check_last_dim_stride_equals_1_dense<false>: GPU masks need stride 1 too
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cc[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype in dtypes and q.dtype == k.dtype == v.dtype


def _convert_boolean_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """convert_boolean_attn_mask (attention.cpp): True = attend; bool -> additive -inf mask."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), -math.inf, zero)


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask (attention.cpp): pad the bias's last dim to a multiple of 8 when its strides
    are not aligned (the padded copy is what autograd keeps), then expand to (B, H, L, S)."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        last = mask.size(-1)
        mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _pad_last_dim_8(t: torch.Tensor) -> torch.Tensor:
    """pad_last_dim<8, false> (attention.cpp): flash needs head_dim % 8 == 0."""
    rest = t.size(-1) % 8
    return t if rest == 0 else torch.nn.functional.pad(t, (0, 8 - rest))


def cuda_sdpa_kernel(compute_capability: tuple[int, int]):
    """A kernel for aten::scaled_dot_product_attention on AutogradCPU that runs CUDA's composite."""

    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False,
    ):
        backend = select_backend(
            query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, compute_capability=compute_capability
        )
        mask = _convert_boolean_mask(attn_mask, query.dtype)
        if backend == "flash":
            head = query.size(-1)
            scale = scale if scale is not None else 1.0 / math.sqrt(head)  # sdp::calculate_scale
            q, k, v = (_pad_last_dim_8(t) for t in (query, key, value))
            out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
            return out if out.size(-1) == head else out[..., :head]  # post_process_flash_output
        if backend == "efficient":
            if mask is not None:
                mask = _preprocess_mask(mask, query, key)
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, mask, _requires_grad(query, key, value), dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]

    return scaled_dot_product_attention


# --- CPU reference kernels for the fused ops (real CPU tensors only; fake tensors use the metas) ---

def _probs(q, k, bias, is_causal, scale, dropout_p, seed):
    """Softmax(q k^T * scale + bias) in fp32, its logsumexp, and the dropout keep-mask."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1).float()  # GQA: k/v heads divide q's
    scores = q.float() @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias.float()
    if is_causal:  # top-left aligned, as flash (square only) and efficient (CausalFromTopLeft)
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    lse = scores.logsumexp(-1)
    probs = (scores - lse.unsqueeze(-1)).exp()
    keep = None
    if dropout_p > 0:
        generator = torch.Generator().manual_seed(int(seed))
        keep = torch.rand(probs.shape, generator=generator) >= dropout_p
    return probs, lse, keep


def _forward(q, k, v, bias, dropout_p, is_causal, scale):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    seed = int(torch.randint(0, 2**62, ()))
    probs, lse, keep = _probs(q, k, bias, is_causal, scale, dropout_p, seed)
    if keep is not None:
        probs = probs * keep / (1 - dropout_p)
    v_full = v.repeat_interleave(q.size(1) // v.size(1), dim=1).float()
    return (probs @ v_full).to(q.dtype), lse, torch.tensor(seed)


@dataclass(frozen=True)
class _Attention:
    """What shapes one attention call's probabilities besides q and k (the fused op's arguments)."""

    bias: Any
    """Added to the scores (efficient attention's attn_bias); None for none."""
    dropout_p: float
    """Dropout probability on the probabilities."""
    is_causal: bool
    """Top-left aligned causal mask."""
    scale: float | None
    """Scores scale; None for 1/sqrt(head dim)."""


def _backward(grad_out, q, k, v, attention: _Attention, seed):
    bias, dropout_p, is_causal = attention.bias, attention.dropout_p, attention.is_causal
    scale = attention.scale if attention.scale is not None else 1.0 / math.sqrt(q.size(-1))
    groups = q.size(1) // k.size(1)
    probs, _, keep = _probs(q, k, bias, is_causal, scale, dropout_p, seed)
    dropped = probs if keep is None else probs * keep / (1 - dropout_p)
    k_full, v_full = (t.repeat_interleave(groups, dim=1).float() for t in (k, v))
    grad_out = grad_out.float()
    grad_v = dropped.transpose(-2, -1) @ grad_out
    grad_dropped = grad_out @ v_full.transpose(-2, -1)
    grad_probs = grad_dropped if keep is None else grad_dropped * keep / (1 - dropout_p)
    grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
    grad_q = grad_scores @ k_full * scale
    grad_k = grad_scores.transpose(-2, -1) @ q.float() * scale

    def fold(t, like):  # sum the query heads that share one k/v head
        return t.unflatten(1, (like.size(1), groups)).sum(2).to(like.dtype)

    return grad_q.to(q.dtype), fold(grad_k, k), fold(grad_v, v), grad_scores


def register_cpu_reference_kernels(lib: torch.library.Library) -> None:
    """CPU kernels for the CUDA-only fused attention ops, so real CPU tensors run them too."""

    def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        out, lse, seed = _forward(query, key, value, None, dropout_p, is_causal, scale)
        rng = torch.stack([seed, torch.tensor(0)])
        empty = query.new_empty(0)
        return out, lse, None, None, query.size(2), key.size(2), rng, torch.tensor(0), empty

    def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                       dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        return _backward(grad_out, query, key, value, _Attention(None, dropout_p, is_causal, scale), philox_seed[0])[:3]

    def efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        out, lse, seed = _forward(query, key, value, attn_bias, dropout_p, is_causal, scale)
        padded = math.ceil(query.size(2) / 32) * 32 if compute_log_sumexp else 0  # as the meta kernel
        lse_out = lse.new_zeros(*lse.shape[:2], padded)
        lse_out[..., : min(padded, lse.size(-1))] = lse[..., :padded]
        return out, lse_out, seed, torch.tensor(0)

    def efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
                           philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        grad_q, grad_k, grad_v, grad_scores = _backward(
            grad_out, query, key, value, _Attention(attn_bias, dropout_p, is_causal, scale), philox_seed
        )
        grad_bias = grad_scores.to(attn_bias.dtype) if attn_bias is not None and grad_input_mask[3] else None
        return grad_q, grad_k, grad_v, grad_bias

    override_kernel(lib, "_scaled_dot_product_flash_attention", flash, "CPU")
    override_kernel(lib, "_scaled_dot_product_flash_attention_backward", flash_backward, "CPU")
    override_kernel(lib, "_scaled_dot_product_efficient_attention", efficient, "CPU")
    override_kernel(lib, "_scaled_dot_product_efficient_attention_backward", efficient_backward, "CPU")
