"""cuBLAS and cuBLASLt workspaces, allocated where torch allocates them: at a thread's first call.

aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.11): `getCurrentCUDABlasHandle()` hands each thread its
own handle and gives it a workspace per (handle, stream) on first use (`setWorkspaceForHandle`), through
the caching allocator, never freed. Every cuBLAS call takes the handle: mm, addmm, bmm, baddbmm, addmv,
dot... A cuBLASLt call (`gemm_and_bias`: addmm with a 1-D bias, `addmm_out_cuda_impl`'s Lt path) also
takes a cuBLASLt workspace per (handle, stream) from `getCUDABlasLtWorkspace()`, unless
TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 shares the cuBLAS one.

In a training step the forward, the loss and the optimizer run on the Python thread; the backward runs
on the autograd engine's device thread, with its own handle: a checkpointed block's forward, recomputed
in the backward, takes that thread's cuBLASLt workspace too. Measured on an H200 (torch 2.11.0+cu130,
benchmarks/results/gpu_campaign_raw/part1.json, cuda_overheads): 32 MiB per thread for cuBLAS, and a bf16
addmm with a bias left 1 MiB more; the zoo's models with biased Linear layers ran 1 MiB (2 MiB with
checkpointing) above the estimate that lacked it.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

CUBLAS_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten._addmm_activation.default, aten.bmm.default,
    aten.baddbmm.default, aten.addbmm.default, aten.mv.default, aten.addmv.default, aten.dot.default,
    aten.vdot.default,
})
"""Ops whose CUDA kernel calls cuBLAS through the thread's handle (and so takes its workspace)."""
_LT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
CUDNN_OPS = frozenset({
    aten.convolution.default, aten.convolution_backward.default, aten._convolution.default,
    aten.cudnn_convolution.default, aten.cudnn_convolution_transpose.default, aten.cudnn_batch_norm.default,
    aten._cudnn_rnn.default,
})
"""Ops that run cuDNN on CUDA (convolutions, cuDNN batch norm and RNNs): the first loads its handle."""
ATTENTION_KERNELS = {
    aten._scaled_dot_product_flash_attention.default: "flash",
    aten._scaled_dot_product_flash_attention_backward.default: "flash",
    aten._flash_attention_forward.default: "flash",
    aten._flash_attention_backward.default: "flash",
    aten._scaled_dot_product_efficient_attention.default: "efficient",
    aten._scaled_dot_product_efficient_attention_backward.default: "efficient",
    aten._efficient_attention_forward.default: "efficient",
    aten._efficient_attention_backward.default: "efficient",
}
"""SDPA's fused kernels by family: in 16 bits each family's first call loads its kernel images into the context."""
_HALF = (torch.float16, torch.bfloat16)


def takes_cublaslt(func, args, kwargs) -> bool:
    """Whether `addmm_out_cuda_impl` runs this addmm through cuBLASLt (`isInputCompliesAddmmCudaLt`, torch
    2.11, CUDA >= 12.1): beta 1, a contiguous 1-D bias as long as the output's rows, float/double/half/bf16,
    both matrices larger than 1 x 1 in each dimension."""
    if func not in (aten.addmm.default, aten._addmm_activation.default) or len(args) < 3:
        return False
    bias, mat1, mat2 = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    if beta != 1 or not all(isinstance(t, torch.Tensor) for t in (bias, mat1, mat2)):
        return False
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.dtype not in _LT_DTYPES:
        return False
    return (bias.is_contiguous() and (bias.dim() == 1 or bias.squeeze().dim() == 1)
            and bias.size(-1) == mat2.size(1) and min(*mat1.shape, *mat2.shape) > 1)


class LibraryWorkspaces:
    """Which workspaces an op allocates now: a thread's first cuBLAS call its cuBLAS workspace, its first
    cuBLASLt call its cuBLASLt workspace (none where unified), per stream; and whether cuDNN ran."""

    def __init__(self, cublas_bytes: int, cublaslt_bytes: int, conv=None, rnn=None) -> None:
        self.cublas_bytes, self.cublaslt_bytes = cublas_bytes, cublaslt_bytes
        self._taken: set[tuple[str, bool, int]] = set()
        self.cudnn_used = False
        """Whether the step ran a cuDNN op (its handle and kernels then sit in the context, outside the allocator)."""
        self.attention_16bit: set[str] = set()
        """The fused attention kernel families ("flash", "efficient") the step ran in 16 bits (their kernel images
        then sit in the context)."""
        self.conv = conv
        """A cuda.conv_workspace.ConvWorkspaces: each convolution's cuDNN workspace, held while it runs (None: none)."""
        self.rnn = rnn
        """A cuda.rnn.CudnnRnnBuffers: a cuDNN RNN's dropout state (first use) and each call's blocks (None: none)."""

    def rnn_steps(self, func, args, out) -> list[tuple[str, object]]:
        """A cuDNN RNN call's dropout state (at first use), outputs and own buffers in RNN.cpp's order, as the
        tracker's `_in_order` steps ([] for any other op, or without cuDNN RNNs)."""
        return self.rnn.call_steps(func, args, out) if self.rnn is not None else []

    def conv_calls(self, func, args, out) -> list[tuple[torch.Tensor, int]]:
        """A convolution's cuDNN calls in order, each (the output it allocates, then its workspace's bytes, held
        until the call ends): [] for any other op, or without the convolution rule."""
        return [] if self.conv is None else self.conv.calls(func, args, out)

    def due(self, func, args, kwargs, *, backward: bool, stream: int) -> list[int]:
        """Bytes of each workspace `func` allocates on first use, in order ([] for most ops)."""
        if func not in CUBLAS_OPS:
            self.cudnn_used = self.cudnn_used or func in CUDNN_OPS
            family = ATTENTION_KERNELS.get(func)
            if family and args and isinstance(args[0], torch.Tensor) and args[0].dtype in _HALF:
                self.attention_16bit.add(family)
            return []
        out = []
        for library, nbytes, used in (("cublas", self.cublas_bytes, True),
                                      ("cublaslt", self.cublaslt_bytes, takes_cublaslt(func, args, kwargs))):
            key = (library, backward, stream)
            if used and nbytes and key not in self._taken:
                self._taken.add(key)
                out.append(nbytes)
        return out
