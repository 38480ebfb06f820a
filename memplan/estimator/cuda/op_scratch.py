"""Temporaries that CUDA ops allocate through the caching allocator while they run, and free before they return.

Each rule is read from the op's CUDA implementation in ATen (torch 2.11) and checked against the H100's
op-by-op readings (benchmarks/results/gpu_campaign_raw_h100/ops/, peak inside the op - max(before, after);
benchmarks/results/op_transients.md). CUDA targets only, native and emulated traces alike: a CPU target's
kernel probe measures what CPU kernels do.

- `_softmax_backward_data` (aten/src/ATen/native/cuda/SoftMax.cu, `softmax_backward_cuda_out`):
  `Tensor tmp = grad * output;` then `host_softmax_backward(tmp, output, ...)`, which makes `tmp` and
  `output` contiguous. The product is one input's size (in the promoted dtype, laid out as TensorIterator
  lays out a binary op's output), held beside the output gradient. log_softmax's backward has no product.
  H100: [2, 8, 256, 256] fp32 -> 4,194,304 B; [4, 8, 256, 256] -> 8,388,608; [1024, 4] -> 16,384.
- `_safe_softmax` (aten/src/ATen/native/transformers/attention.cpp): `out = softmax(self)`, then
  `masked = self.isneginf()` (a bool per element), `masked_rows = all(masked, dim, keepdim)` (a bool per
  row) and a 0-dim `zero` on the device, and `where_out(out, ...)` writes into `out`. H100: [2, 8, 256, 256]
  fp32 -> 1,048,576 + 4,096 + 512 = 1,053,184 B; [4, 8, 256, 256] -> 2,105,856.
- `_scaled_dot_product_efficient_attention_backward` (transformers/cuda/attention_backward.cu,
  `_efficient_attention_backward`): `grad_out` (as [B, M, H, K]) made contiguous; `delta` [B, H, M] fp32.
  The fp32 kernels do not compute delta themselves (mem_eff_attention/kernel_backward.h
  `kKernelComputesDelta = kIsHalf && ...`): `(grad_out * out).sum(-1).transpose(-2, -1).contiguous()` holds
  the product, the row sums and delta at once. Then the kernel's workspace: a dQ accumulator per query tile
  (`kNeedsAccumGradQ`: split keys are enabled from sm70), `workspace_size()`. H100, bert-b16-ckpt
  [16, 4, 128, 64] fp32 -> 2,097,152 + 32,768 + 32,768 = 2,162,688 B. The half kernels' workspace is modelled
  with 64 x 64 query tiles; their dK / dV accumulators (head dims above a kernel's register tile, > 128) are not.
- `embedding` (aten/src/ATen/native/Embedding.cpp): `weight.index_select(0, indices.reshape(-1))`: indices of
  more than one dim that cannot be flattened as a view are copied. H100: [32, 64] int64 -> 16,384 B.
- `cumsum` / `cumprod` (aten/src/ATen/native/ReduceOps.cpp `impl_func_cum_ops`): the kernel runs on
  `self.to(result.scalar_type())`, a copy when the result's dtype differs (a bool or int32 input sums in
  int64); a single scanned run (`numel == size(dim)`) goes through cub's scan, whose temporary storage
  took one block for 4 elements (more for long runs: not modelled). H100: [2, 256] bool -> 4,096 B;
  [8, 128] -> 8,192; [4] int32 -> 1,024.

- `_scaled_dot_product_flash_attention_backward` (transformers/cuda/attention_backward.cu
  `_flash_attention_backward`, flash_attn/flash_api.cpp `mha_bwd`): `grad_out` and `out` as [B, S, H, D] made
  contiguous; `softmax_d` [B, H, S rounded up to 128] fp32 (returned by mha_bwd, dropped by its caller); the dQ
  accumulator [B, S rounded to 128, H, D rounded to 32 (64 above 128)] fp32 (`loop` is always true). Under
  `torch.use_deterministic_algorithms(True)` (not warn_only: attention_backward.cu `_flash_attention_backward`
  passes `deterministic` to mha_bwd only then) the accumulator is `at::zeros({nsplits, B, S_r, H, D_r})` with
  nsplits = ceil(SMs / (B x H)), one per split of the keys the kernel's grid then runs (flash_api.cpp `mha_bwd`
  at pytorch 03b7c19, the statements `const int nsplits = (dprops->multiProcessorCount + batch_size * num_heads -
  1) / (batch_size * num_heads);` and `dq_accum = at::zeros({nsplits, ...})` after `bool loop = true;`; line
  numbers not given: the pytorch snapshot was too large to bring here); read on an H200 (torch 2.11): the requested
  bytes of 12 backwards, 6 of them deterministic (5 with more than one split; head dims 64-128, 72), as the rule
  gives (benchmarks/results/
  gpu_rules.md). The
  setting is the trace's (`deterministic`, estimator/determinism.py: estimate(deterministic=...), a config's
  trainer.deterministic, the Trainer MemoryPlanner runs in), not the tracing process's flag. With
  fewer key/value heads than query heads (GQA), dK and dV at the query's head count in the input dtype, summed
  into the outputs at the end. The H100 ran
  cuDNN attention there (sm90, cuDNN > 9.15 prefers it; memplan emulates flash): its backward held 512 B more
  than this rule, gpt2-b8-bf16mixed [8, 4, 128, 64] bf16 1,065,472 B (rule 1,064,960), llama-gqa-b4-bf16mixed
  [4, 8, 256, 32] with 2 key/value heads 2,130,432 B (rule 2,129,920).
- Advanced indexing, masks and sort (index, index_put with accumulate, a mask's nonzero, masked_select,
  masked_scatter and its backward, sort's index buffers): cuda/index_scratch.py.

- `embedding_dense_backward` over more than 3072 indices: the sort's buffers, then the two-pass or the fused
  kernel's (cuda/embedding_scratch.py; read on an H200 in 7 shapes, both paths, to the byte).
- `binary_cross_entropy_with_logits`: the composite's log-sigmoid, pos_weight's weight and elementwise loss (from
  Loss.cpp; not read on a GPU: the CPU probe measures the same composite's).

Not modelled (measured, small or data dependent): cub's storage for a cumsum over a long single run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memplan.compat.torch import disable_current_modes
from memplan.estimator.cuda.embedding_scratch import embedding_backward_scratch
from memplan.estimator.cuda.index_scratch import RULES as INDEX_RULES
from memplan.estimator.determinism import Deterministic, splits_flash_backward

aten = torch.ops.aten

_ALIGN = 512  # the caching allocator's kMinBlockSize
_F32 = 4
_MEM_EFF_TILE = 64
"""Query rows and dQ columns per tile of the memory-efficient backward's dQ accumulator (kBlockSizeI,
MatmulGradQ's ThreadblockShape::kN for the sm80 kernels with head dim <= 64, which sm90 runs too)."""
_TILE_HEADER = 4  # GradQTempStorage's lock, counter and pad: 4 int32 before each tile's fp32 buffer


Phases = tuple[tuple[int, ...], ...]
"""An op's temporaries: per phase of the op, in order, the bytes of each buffer it holds at once (one
allocation each, as the caching allocator sees them)."""


@dataclass(frozen=True, kw_only=True)
class CudaGpu:
    """What some ops' temporaries depend on besides their arguments."""

    compute_capability: tuple[int, int]
    """(major, minor): which kernels and tile sizes run (cub's sort tunings)."""
    sm_count: int
    """Streaming multiprocessors (deterministic flash backward's splits, cub's sort grid)."""

    @classmethod
    def for_gpu(cls, name: str, compute_capability: tuple[int, int]) -> CudaGpu:
        """The GPU named `name` (a catalog name or NVML's), its SMs from the hardware catalog."""
        from memplan.hardware.catalog import streaming_multiprocessors

        return cls(compute_capability=tuple(compute_capability),
                   sm_count=streaming_multiprocessors(name, compute_capability))


GENERIC_GPU = CudaGpu(compute_capability=(8, 0), sm_count=108)
"""An A100's: the generic CUDA target's compute capability (estimator/target.py)."""


def cuda_op_scratch(func, args, kwargs, gpu: CudaGpu = GENERIC_GPU, *,
                    deterministic: Deterministic = False) -> Phases:
    """The temporaries `func`'s CUDA implementation allocates and frees inside the op on `gpu`, beyond its inputs
    and outputs, with deterministic algorithms as `deterministic` says (estimator/determinism.py): () for ops
    without a rule here."""
    rule = _RULES.get(func)
    if rule is None:
        return ()
    extra = {"gpu": gpu} if func in _BY_GPU else {}
    if func in BY_DETERMINISM:
        extra["deterministic"] = deterministic
    phases = rule(*args, **extra, **kwargs)
    return tuple(held for held in phases if any(held))


def cuda_op_scratch_bytes(func, args, kwargs, gpu: CudaGpu = GENERIC_GPU, *,
                          deterministic: Deterministic = False) -> int:
    """The most bytes (block-rounded) `func`'s temporaries hold at once on `gpu`."""
    return rounded_peak(cuda_op_scratch(func, args, kwargs, gpu, deterministic=deterministic))


def rounded_peak(phases: Phases) -> int:
    """The most bytes (each request block-rounded) a rule's phases hold at once."""
    return max((sum(_rounded(n) for n in held) for held in phases), default=0)


def _softmax_backward(grad, output, dim, input_dtype) -> Phases:
    with disable_current_modes():  # TensorIterator's layout for the product, on meta tensors
        product = torch.mul(_meta_like(grad), _meta_like(output))
    held = [_nbytes(product)]
    if not product.is_contiguous():
        held.append(_nbytes(product))  # host_softmax_backward: grad_.contiguous() of the product
    if not output.is_contiguous():
        held.append(_nbytes(output))  # and output_.contiguous()
    return (tuple(held),)


def _safe_softmax(self, dim, dtype=None) -> Phases:
    copy = _nbytes(self) if not self.is_contiguous() else 0  # softmax's input_.contiguous(), freed after
    rows = self.numel() // max(self.size(dim), 1) if self.dim() else 1
    return (copy,), (self.numel(), rows, 1)  # isneginf, all(.., keepdim), the 0-dim zero (itemsize <= 8)


def _efficient_attention_backward(grad_out, query, *rest, **kwargs) -> Phases:
    """Arguments: (grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, ...)."""
    batch, heads, queries, head_dim = query.shape
    rows = batch * heads * queries
    copy = 0 if grad_out.transpose(1, 2).is_contiguous() else _nbytes(grad_out)
    delta = rows * _F32
    tiles = -(-queries // _MEM_EFF_TILE) * -(-head_dim // _MEM_EFF_TILE)
    per_head = tiles * (_TILE_HEADER + _MEM_EFF_TILE * _MEM_EFF_TILE)
    workspace = batch * heads * (-(-per_head // 4) * 4) * _F32
    if query.dtype in (torch.float16, torch.bfloat16):  # the kernel computes delta into an empty tensor
        return ((copy, delta, workspace),)
    product = grad_out.numel() * _F32  # (grad_out * out), its row sums, delta: one expression's temporaries
    return (copy, product, delta, delta), (copy, delta, workspace)


def _flash_attention_backward(grad_out, query, key, *rest, gpu: CudaGpu, deterministic: Deterministic,
                              **kwargs) -> Phases:
    """Arguments: (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
    is_causal, philox_seed, philox_offset); q, k, v, out as [B, H, S, D]."""
    out = rest[1]
    batch, heads, queries, head_dim = query.shape
    copies = [0 if t.transpose(1, 2).is_contiguous() else _nbytes(t) for t in (grad_out, out)]
    rows = -(-queries // 128) * 128  # round_multiple(seqlen_q, 128)
    rounded_head = -(-head_dim // (32 if head_dim <= 128 else 64)) * (32 if head_dim <= 128 else 64)
    softmax_d = batch * heads * rows * _F32
    splits = -(-gpu.sm_count // (batch * heads)) if splits_flash_backward(deterministic) and batch * heads else 1
    dq_accum = splits * batch * rows * heads * rounded_head * _F32
    expanded = 0 if key.size(1) == heads else batch * key.size(2) * heads * head_dim * query.element_size()
    return ((*copies, softmax_d, dq_accum, expanded, expanded),)


def _embedding(weight, indices, *rest) -> Phases:
    """Arguments: (weight, indices, padding_idx, scale_grad_by_freq, sparse)."""
    if indices.dim() <= 1 or indices.is_contiguous():
        return ()
    return ((_nbytes(indices),),)


def _cumulative(self, dim, dtype=None) -> Phases:
    if self.dim() == 0 or self.numel() == 0:
        return ()
    result = dtype or (torch.int64 if not (self.is_floating_point() or self.is_complex()) else self.dtype)
    cub = 1 if self.numel() == self.size(dim) else 0  # ScanUtils.cuh scan_dim: one run -> cub's temp storage
    cast = 0 if result == self.dtype else self.numel() * torch.empty((), dtype=result, device="meta").element_size()
    return ((cast, cub),)


def _bce_with_logits(input, target, weight=None, pos_weight=None, reduction=1) -> Phases:
    """Loss.cpp `binary_cross_entropy_with_logits`, one op to the trace and a composite to the GPU: log_sigmoid of the
    input (CUDA's forward keeps no buffer beside it), with pos_weight `(pos_weight - 1)` and its product with the
    target (the weight, freed at the block's end), then the elementwise loss `(1 - target)` beside the log-sigmoid
    until the reduction (reduction 0: that loss is the op's output, counted as such)."""
    log_sigmoid = _nbytes(input)
    phases = [(log_sigmoid,)]
    if pos_weight is not None:
        with disable_current_modes():
            weight_shape = torch.broadcast_shapes(pos_weight.shape, target.shape)
        phases.append((log_sigmoid, _nbytes(pos_weight), math.prod(weight_shape) * pos_weight.element_size()))
    if reduction != 0:
        phases.append((log_sigmoid, _nbytes(target)))
    return tuple(phases)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rounded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


_RULES = {
    aten._softmax_backward_data.default: _softmax_backward,
    aten._safe_softmax.default: _safe_softmax,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_attention_backward,
    aten.embedding.default: _embedding,
    aten.binary_cross_entropy_with_logits.default: _bce_with_logits,
    aten.embedding_dense_backward.default: embedding_backward_scratch,
    aten.cumsum.default: _cumulative,
    aten.cumprod.default: _cumulative,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_attention_backward,
    **INDEX_RULES,
}
_BY_GPU = frozenset({aten._scaled_dot_product_flash_attention_backward.default, aten.sort.default, aten.sort.stable,
                     aten.embedding_dense_backward.default, aten.index_put.default, aten.index_put_.default,
                     aten._index_put_impl_.default})
"""Rules that take the GPU (keyword `gpu`)."""
BY_DETERMINISM = frozenset({aten._scaled_dot_product_flash_attention_backward.default, aten.index_put.default,
                            aten.index_put_.default, aten._index_put_impl_.default,
                            aten.embedding_dense_backward.default})
"""Rules that take the trace's deterministic-algorithms setting (keyword `deterministic`)."""
