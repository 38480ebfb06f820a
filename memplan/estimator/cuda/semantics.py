"""Make a trace on (fake) CPU tensors follow CUDA's semantics where they change memory.

On a CPU-only torch build memplan traces a CUDA target's step on fake CPU tensors. CPU and CUDA
differ in which tensors an op creates and what autograd saves; `emulate_cuda` switches the CPU
dispatch to CUDA's choices while it is active, through one `torch.library.Library` that is destroyed
on exit (so nothing leaks into later code):

1. Autocast policy (cuda_autocast.py): CUDA's cast lists on the AutocastCPU key. layer_norm, softmax,
   log_softmax, group_norm, rms_norm, exp, pow, sum ... run in fp32 as on CUDA; ops only CPU casts
   (cat, stack, cross_entropy_loss ...) fall through; binary_cross_entropy raises as on CUDA.
2. Dropout: aten::dropout on AutogradCPU takes the fused `native_dropout` path, as CUDA does when
   `is_fused_kernel_acceptable` (aten/src/ATen/native/Dropout.cpp: CUDA, 0 < p < 1, numel > 0), so
   autograd saves a 1-byte bool mask instead of `_dropout_impl`'s full-dtype noise tensor.
   feature_dropout, alpha_dropout and in-place dropout_ take `_dropout_impl` on both devices.
3. Scaled dot-product attention (cuda_sdpa.py): CUDA's backend choice for the target compute
   capability, calling the same aten op (flash / memory-efficient / math) with the same padding.
4. RMSNorm: `rms_norm` calls `_fused_rms_norm` on every device (aten/src/ATen/native/layer_norm.cpp
   `rms_norm_symint`); CUDA has a kernel for it (`_fused_rms_norm_cuda`), so autograd saves input
   and rstd, while CPU falls to its CompositeImplicitAutograd decomposition, which saves an fp32
   copy of the input and the normalized product. A CPU kernel registered here gives CPU the CUDA
   dispatch (autograd node FusedRmsNormBackward0).
5. softmax / log_softmax of fp16 with dtype=float: CUDA calls `_softmax(x, dim, half_to_float=True)`
   without an fp32 copy of the input (aten/src/ATen/native/SoftMax.cpp, `input_.is_cuda()` branch).
   Emulated on fake tensors (CPU has no such kernel, so real CPU tensors keep the copy).
6. cuDNN RNNs (cuda/rnn.py): nn.LSTM / GRU / RNN call `aten._cudnn_rnn` once per module call, as CUDA's
   `use_cudnn` dispatch does, so autograd saves cuDNN's reserve and the flat weight buffer instead of per-gate
   tensors; under autocast the weights are cast to float16 and re-flattened per call (AutocastRNN.cpp). The
   reserve, workspace and dropout state sizes are rules fitted to H100 readings (cuda/rnn.py). Fake tensors only.
7. `apply_cuda_optimizer_defaults`: foreach=True where CUDA would default to it.

Known differences not emulated
------------------------------
- cuDNN RNNs (emulated, cuda/rnn.py): the reserve (cudnnGetRNNTempSpaceSizes, internal to cuDNN) and
  workspace sizes are rules fitted to one LSTM and one GRU shape read on an H100 (exact there); other shapes,
  GPUs and cuDNN versions follow the rule's assumed scaling. Not emulated: packed sequences (they keep the CPU
  path: `_lstm_impl` in aten/src/ATen/native/RNN.cpp or `mkldnn_rnn_layer`), fp16's persistent algorithms,
  LSTM projections' sizes, and weights that are not one contiguous chunk (cuDNN copies them per call).
  nn.LSTMCell / GRUCell are emulated (autocast policy).
- cuDNN attention: sdp_utils.cpp `check_prefer_cudnn_attention` puts cuDNN first on sm90 / sm100 /
  sm103 with cuDNN > 9.15.0, which depends on the runtime cuDNN. We use flash there; cuDNN saves the
  same out + fp32 logsumexp (B, H, L, 1), and it also takes attn_mask where we use efficient.
  FlashAttention-3 (`torch.backends.cuda.enable_flash_sdp` FA3 opt-in) is not emulated either.
- Scratch memory inside kernels: cuDNN convolution workspaces are a
  rule fitted to sm90 / cuDNN 9 measurements, not cuDNN's algorithm choice (cuda/conv_workspace.py);
  cuBLAS workspaces: see cuda/workspaces.py. A sum / mean's staging buffer is modelled (cuda/reductions.py),
  and so are softmax backward's product, _safe_softmax's masks, the memory-efficient attention backward's
  delta and workspace, flash backward's dq accumulator and softmax_d (cuda/op_scratch.py), and indexing's and
  sort's index buffers (cuda/index_scratch.py); benchmarks/results/op_transients.md compares them op by op.
- Embedding backward: `embedding_dense_backward_cuda` (aten/src/ATen/native/cuda/Embedding.cu) over more
  than 3072 indices sorts them with int64 temporaries the size of the index tensor; CPU does not. Its
  contiguous copies of a non-contiguous gradient and indices are modelled (kernels/scratch.py). The dense
  weight gradient is the same.
- Batch norm: cuDNN `cudnn_batch_norm` (aten/src/ATen/native/cudnn/BatchNorm.cpp) saves a reserve
  tensor besides save_mean / save_var; per-channel sizes, negligible.
- Autocast rules registered outside aten: an op's own AutocastCUDA kernel (torchvision's roi_align, nms ...)
  is stood in for by its AutocastCPU kernel, an op with an AutocastCPU kernel only falls through
  (autocast.py's docstring); `_cudnn_rnn`'s autocast is emulated inside the RNN entry (cuda/rnn.py).
- fused optimizers: no torch optimizer defaults to fused=True on CUDA (torch/optim/adam.py: "give the
  fused impl bake-in time"); a user's fused=True runs the CPU fused kernels, which like CUDA's keep
  no per-parameter temporaries.
- Under torch.inference_mode() the Autograd keys are skipped, so dropout / SDPA / softmax keep the CPU
  path there (only the autocast policy applies); training steps are unaffected.
- The registrations are process-wide: another thread running CPU ops during the emulation sees CUDA
  semantics too. Nesting works (the inner registrations shadow the outer ones until they exit).
- The Python weight-cast cache is dropped when the outermost torch.autocast exits through a wrapper
  around `torch.clear_autocast_cache`, which torch.autocast.__exit__ looks up at call time; if a
  torch release stops doing so, the cache lives until the emulation ends instead.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from memplan.compat.torch import OpOverload, is_fake, override_kernel
from memplan.estimator.cuda.autocast import CastCache, KernelLibraries, register_cuda_autocast, wrap_clear_autocast_cache
from memplan.estimator.cuda.rnn import CudnnRnns
from memplan.estimator.cuda.sdpa import cuda_sdpa_kernel, register_cpu_reference_kernels

__all__ = ["emulate_cuda", "apply_cuda_optimizer_defaults"]

aten = torch.ops.aten


@contextlib.contextmanager
def emulate_cuda(*, compute_capability: tuple[int, int], autocast_dtype: torch.dtype | None) -> Iterator[None]:
    """While active, CPU tensors (real or fake) follow CUDA's dispatch for a GPU of
    `compute_capability`. `autocast_dtype` is the dtype the caller gives `torch.autocast("cpu")`
    around the forward (the caller enters autocast; None: the step runs without autocast).

    Run the whole step inside, backward included: a graph recorded here calls ops such as
    `_fused_rms_norm_backward` whose CPU kernels (used by real tensors; fake ones use meta kernels)
    exist only while the emulation is active."""
    if not (
        isinstance(compute_capability, tuple) and len(compute_capability) == 2
        and all(isinstance(v, int) and v >= 0 for v in compute_capability) and compute_capability[0] >= 1
    ):
        raise ValueError(f"compute_capability must be (major, minor), e.g. (8, 0); got {compute_capability!r}")
    if autocast_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"autocast_dtype must be None, torch.float16 or torch.bfloat16; got {autocast_dtype!r}")
    libraries = KernelLibraries()
    lib = libraries.library("aten")
    cache = CastCache()
    original_clear_autocast_cache = torch.clear_autocast_cache
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            if autocast_dtype is not None:
                register_cuda_autocast(libraries, lower_dtype=autocast_dtype, cache=cache)
                torch.clear_autocast_cache = wrap_clear_autocast_cache(cache)
            override_kernel(lib, "dropout", _dropout, "AutogradCPU")
            override_kernel(lib, "scaled_dot_product_attention", cuda_sdpa_kernel(compute_capability), "AutogradCPU")
            override_kernel(lib, "softmax.int", _softmax_kernel(aten._softmax.default), "AutogradCPU")
            override_kernel(lib, "log_softmax.int", _softmax_kernel(aten._log_softmax.default), "AutogradCPU")
            override_kernel(lib, "_fused_rms_norm", _fused_rms_norm, "CPU")
            override_kernel(lib, "_fused_rms_norm_backward", _fused_rms_norm_backward, "CPU")
            register_cpu_reference_kernels(lib)
            CudnnRnns(compute_capability).register(lib)
        yield
    finally:
        torch.clear_autocast_cache = original_clear_autocast_cache
        cache.clear()
        libraries.destroy()


def apply_cuda_optimizer_defaults(optimizer: torch.optim.Optimizer) -> None:
    """Set foreach=True in each param group where it is None, as torch's built-in optimizers decide
    on CUDA: their functional step calls `_default_to_fused_or_foreach` (torch/optim/optimizer.py),
    which picks foreach when every param is a CUDA tensor. On CPU, and on fake tensors (whose type is
    not in `_foreach_supported_types`), they take the for-loop, whose temporaries are one parameter's
    size instead of all of them. Exceptions mirrored: differentiable=True (except SGD, which passes
    differentiable=False there), fused=True, Adam/AdamW with a Tensor lr and capturable=False
    (adam.py). Adafactor has no such default (foreach None means the for-loop). fused is never a
    CUDA default, so it is left alone."""
    if not isinstance(optimizer, _CUDA_FOREACH_DEFAULT):
        return
    for group in optimizer.param_groups:
        if group.get("foreach") is not None or group.get("fused"):
            continue
        if group.get("differentiable") and not isinstance(optimizer, torch.optim.SGD):
            continue
        tensor_lr = isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable", False)
        if tensor_lr and isinstance(optimizer, torch.optim.Adam):
            continue
        group["foreach"] = True


_CUDA_FOREACH_DEFAULT = (
    torch.optim.Adadelta, torch.optim.Adagrad, torch.optim.Adam, torch.optim.Adamax, torch.optim.ASGD,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.SGD,
)  # AdamW subclasses Adam


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """at::dropout (Dropout.cpp) with CUDA's `is_fused_kernel_acceptable`."""
    if input.is_nested or (train and 0 < p < 1 and input.numel() > 0):
        return aten.native_dropout.default(input, p, train)[0]
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not train or input.numel() == 0:
        return input  # _dropout_impl returns its input unchanged
    return input.mul(input.new_zeros(()))  # p == 1


def _softmax_kernel(inner: OpOverload):
    """softmax / log_softmax with CUDA's fp16 -> fp32 branch (SoftMax.cpp)."""

    def kernel(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if input.dtype == torch.float16 and dtype == torch.float32 and is_fake(input):
            return inner(input, dim, True)
        return inner(input if dtype is None else input.to(dtype), dim, False)

    return kernel


def _rms_dims(input: torch.Tensor, normalized_shape) -> tuple[int, ...]:
    return tuple(range(input.dim() - len(normalized_shape), input.dim()))


def _fused_rms_norm(input, normalized_shape, weight=None, eps=None):
    """CPU kernel for aten::_fused_rms_norm: rms_norm_composite's arithmetic (layer_norm.cpp), run
    below autograd so that autograd records CUDA's FusedRmsNormBackward0 node."""
    x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    rstd = torch.rsqrt(x.pow(2).mean(_rms_dims(input, normalized_shape), keepdim=True) + eps)
    out = x * rstd
    if weight is not None:
        out = out * weight
    return out.to(input.dtype).contiguous(), rstd


def _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    dims = _rms_dims(input, normalized_shape)
    x_hat = input.to(rstd.dtype) * rstd
    grad = grad_out.to(rstd.dtype)
    grad_w = grad * weight.to(rstd.dtype) if weight is not None else grad
    grad_input = rstd * (grad_w - x_hat * (grad_w * x_hat).mean(dims, keepdim=True))
    grad_weight = None
    if weight is not None and output_mask[1]:
        grad_weight = (grad * x_hat).sum(tuple(range(input.dim() - len(dims)))).to(weight.dtype)
    return (grad_input.to(input.dtype) if output_mask[0] else None), grad_weight
