"""Memory that CPU kernels allocate inside themselves, where no fake tensor shows it.

A fake tensor runs an op's meta kernel, which gives the outputs' shapes but knows nothing of buffers
the real kernel makes and frees while it runs, nor of outputs whose size the real library decides.
Where such memory follows a rule, it is modelled here; where it does not (oneDNN's convolution and LSTM
scratchpads, which depend on the algorithm oneDNN picks, and half-precision matmuls' operand packing),
memplan.estimator.kernels.probe measures it per shape on the planning host.
"""
from __future__ import annotations

import torch

from memplan.compat.torch import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes, op_overload, suggest_memory_format

_PAGE = 4096
"""oneDNN rounds each workspace part up to a 4 KiB page (rnn_utils set_offsets)."""

_F32 = 4


def _good_ld(dim: int, itemsize: int) -> int:
    """oneDNN's rnn_utils::get_good_ld: 64-byte aligned, and not a multiple of 256 elements."""
    block = 64 // itemsize
    ld = -(-dim // block) * block
    return ld + block if ld % 256 == 0 else ld


def lstm_workspace_bytes(seq: int, batch: int, in_features: int, hidden: int, itemsize: int) -> int:
    """Bytes of the uint8 workspace one `mkldnn_rnn_layer` call (training, 1 layer, 1 direction)
    saves for backward: gates, h_t, layer/iteration states and their diffs, each rounded up to a
    4 KiB page (oneDNN rnn_utils set_workspace_sizes / set_offsets). `itemsize`: 4 (fp32) or 2.
    Checked byte for byte against the real kernel over seq, batch, input, hidden and dtype."""
    states = 2 * (seq + 1) * batch
    width = max(in_features, hidden)
    parts = (
        seq * batch * _good_ld(4 * hidden, itemsize) * itemsize,  # gates
        seq * batch * _good_ld(hidden, itemsize) * itemsize,      # h_t
        states * _good_ld(width, itemsize) * itemsize,            # states (layer == iter)
        states * hidden * itemsize,                               # c states
        states * _good_ld(width, _F32) * _F32,                    # diff layer states
        states * _good_ld(width, _F32) * _F32,                    # diff iteration states
        states * hidden * _F32,                                   # diff c states
    )
    return sum(-(-part // _PAGE) * _PAGE for part in parts)


def rnn_workspace_bytes(func, args) -> int | None:
    """The real workspace of `aten.mkldnn_rnn_layer` (whose meta kernel returns an empty one), or None
    for any other op. Arguments: (input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode,
    hidden_size, num_layers, has_biases, bidirectional, batch_first, train). The kernel makes one whenever grad
    mode is on, whatever `train` (the module's mode) and the inputs' requires_grad say, and none under no_grad
    (a frozen LSTM encoder run under torch.no_grad: 0 bytes, +94 % counted otherwise; read on the real kernel,
    tests/estimator/test_lstm_grad_mode.py)."""
    if func is not torch.ops.aten.mkldnn_rnn_layer.default:
        return None
    if not torch.is_grad_enabled():
        return 0
    x = args[0]  # always time-major here: aten's mkldnn_rnn transposes a batch-first input before the
    # layer call and still passes batch_first=True along (checked against the real kernel)
    seq, batch, hidden = x.shape[0], x.shape[1], args[10]
    return lstm_workspace_bytes(seq, batch, x.shape[-1], hidden, x.element_size())


def with_rnn_workspace(func, args, out):
    """`out` with a library-sized workspace output given the size the real kernel gives it (mkldnn_rnn_layer's,
    `rnn_workspace_bytes`); `out` itself for any other op. Called under the fake mode: the workspace is fake."""
    nbytes = rnn_workspace_bytes(func, args)
    if not nbytes or out[3].numel() != 0:
        return out
    return (*out[:3], torch.empty(nbytes, dtype=torch.uint8, device=out[3].device))


def promotion_scratch_bytes(func, tensors: list[torch.Tensor]) -> int:
    """CPU TensorIterator copies each input whose dtype differs from the common dtype into a
    temporary of the common dtype before running a pointwise kernel (TensorIteratorBase::compute_types:
    `if (common_device == kCPU) ... op.tensor().to(common_dtype_)`); CUDA casts on the fly instead.
    Returns the bytes of those temporaries, 0 when the inputs already agree. `where`'s boolean condition is no
    operand (TensorCompare.cpp where_self_out promotes self and other only): it is never copied; nor is
    `masked_fill`'s mask (its out-of-place form clones self and fills it in place, the mask read as bool: a full-size
    mask made from an activation read +34 % counted as a float copy)."""
    if func.overloadpacket is torch.ops.aten.where:
        tensors = tensors[1:]
    elif func.overloadpacket is torch.ops.aten.masked_fill:
        tensors = tensors[:1] + tensors[2:]
    if torch.Tag.pointwise not in func.tags or len(tensors) < 2:
        return 0
    first = tensors[0].dtype
    if all(t.dtype == first for t in tensors):
        return 0
    try:
        _, common = elementwise_dtypes(*tensors, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    except (TypeError, ValueError, RuntimeError):
        return 0
    itemsize = torch.empty((), dtype=common, device="meta").element_size()
    return sum(t.numel() * itemsize for t in tensors if t.dtype != common)


def ctc_backward_scratch_bytes(func, args) -> int:
    """`_ctc_loss_backward` makes `log_beta = at::empty_like(log_alpha)` and frees it before returning,
    on CPU and CUDA alike (aten/src/ATen/native/LossCTC.cpp, cuda/LossCTC.cu). Arguments: (grad,
    log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, ...)."""
    if func not in (torch.ops.aten._ctc_loss_backward.Tensor, torch.ops.aten._ctc_loss_backward.default):
        return 0
    log_alpha = args[6]
    return log_alpha.numel() * log_alpha.element_size()


_aten = torch.ops.aten
_CUDA_CONTIGUOUS_COPIES = {
    # op: (the positions of the tensor arguments the CUDA kernel makes contiguous, the position of the tensor whose
    # suggested memory format it makes them contiguous in; None: the default, row-major format)
    _aten._softmax.default: ((0,), None),  # cuda/SoftMax.cu host_softmax: input_.contiguous()
    _aten._log_softmax.default: ((0,), None),
    _aten._log_softmax_backward_data.default: ((0, 1), None),  # host_softmax_backward: grad_, output_ .contiguous()
    # softmax's backward makes its product contiguous instead (cuda/op_scratch.py)
    # cuda/layer_norm_kernel.cu layer_norm_cuda: input.expect_contiguous()
    _aten.native_layer_norm.default: ((0,), None),
    _aten.native_layer_norm_backward.default: ((0, 1), None),  # dY.contiguous(), input.expect_contiguous()
    # DilatedMaxPool2d.cu max_pool2d_with_indices_backward_out_cuda: gradOutput_, indices_ .contiguous(memory_format)
    _aten.max_pool2d_with_indices_backward.default: ((0, 7), 1),
    # AveragePool2d.cu avg_pool2d_backward_out_cuda: input_ and gradOutput_ .contiguous(memory_format)
    _aten.avg_pool2d_backward.default: ((0, 1), 1),
}  # embedding's backward: its copies are held through its sort (cuda/embedding_scratch.py)


def cuda_contiguous_copies(func, args) -> tuple[int, ...]:
    """CUDA softmax, log_softmax, log_softmax's backward and layer_norm copy a non-contiguous input into a
    contiguous temporary before launching (source lines above; torch 2.x). A transposed activation
    fed to them holds that copy while the kernel runs. CUDA targets only: on a CPU target the kernel
    probe measures what CPU kernels do. Sourced from ATen; on an H100 (benchmarks/results/op_transients.md)
    MLP-Mixer's layer norms and their backwards on transposed inputs held exactly this copy, and an embedding's
    backward its gradient's and indices' copies (lstm-b32: [32, 64, 128] fp32 + [32, 64] int64 = 1,064,960 B).
    max_pool2d's and avg_pool2d's backwards copy into the input's suggested memory format instead: a channels_last
    CNN flattened into a linear head gets its gradient back NCHW and copied (the CPU kernels do the same, -22 %
    measured there without it; from source, not read on a GPU: benchmarks/gpu_rules_pools.py has the cases).
    Returns the bytes of each copy: each `.contiguous()` is a request of its own to the caching allocator (a
    1 MiB copy and a 16 KiB one take two small-pool blocks, where their sum, over 1 MiB, would take a large
    block and can take a cached 2 MiB one whole). Embedding's backward makes the same copies inside its own rule
    (cuda/embedding_scratch.py), which holds them through the sort it runs over more than 3072 indices."""
    rule = _CUDA_CONTIGUOUS_COPIES.get(func)
    if rule is None:
        return ()
    positions, layout_of = rule
    memory_format = torch.contiguous_format if layout_of is None else suggest_memory_format(args[layout_of])
    return tuple(
        t.numel() * t.element_size()
        for t in (args[i] for i in positions if i < len(args))
        if isinstance(t, torch.Tensor) and not t.is_contiguous(memory_format=memory_format)
    )


_GLOO_FLAT_BUFFER = {
    # op: the position of the tensor whose size gloo's flat buffer takes (the schemas: output, input, group, ...)
    op_overload("c10d", "_allgather_base_"): 0,  # ProcessGroupGloo's allgather: newLikeFlat(outputs), copied out
    op_overload("c10d", "_reduce_scatter_base_"): 1,  # the input reduced in a flat copy, this rank's part copied out
}
_GLOO_FLAT_BUFFER.pop(None, None)  # (no distributed package)


def gloo_flat_buffer_bytes(func, args) -> int:
    """The buffer gloo, the CPU backend, makes for a collective on whole tensors and holds while the op runs: the
    size of an all-gather's output, or of a reduce-scatter's input (FSDP2's two collectives). A CPU target
    only: NCCL writes the output in place. memplan's fake process group returns at once, so the trace has no
    such allocation. Seen in real 4-rank FSDP2 runs with gloo (torch 2.13): inside each `c10d::_allgather_base_`
    the profiler shows an allocation of the output's bytes and its free; inside `c10d::_reduce_scatter_base_`
    one of the input's bytes (a clone the returned work holds), freed after the op. The estimate is the usual
    rank's: gloo's worker thread also holds that clone and lets it go a little later, so a rank can peak one
    gradient block higher (one rank in 3 of 6 four-rank runs; tests/estimator/test_fsdp_gloo.py allows it)."""
    position = _GLOO_FLAT_BUFFER.get(func)
    if position is None or position >= len(args) or not isinstance(args[position], torch.Tensor):
        return 0
    return args[position].numel() * args[position].element_size()
