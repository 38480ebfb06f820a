"""cuDNN RNNs as CUDA runs them: one `_cudnn_rnn` op per nn.LSTM / GRU / RNN call, with cuDNN's buffers.

On CUDA, `aten::lstm` / `gru` / `rnn_tanh` / `rnn_relu` (aten/src/ATen/native/RNN.cpp) call the cuDNN stub when
`use_cudnn(input)`: cuDNN enabled, a CUDA input with elements, float / double / half, or bfloat16 where cuDNN
supports it (sm80+). aten/src/ATen/native/cudnn/RNN.cpp `_cudnn_impl` then calls `_cudnn_rnn` once for all layers,
with the module's flat weight buffer (RNNBase.flatten_parameters made the parameters views of one buffer when the
module moved to the GPU) and the process's dropout state (`get_dropout_state`: one per device, made by the first
training call with dropout > 0, never freed). Autograd (CudnnRnnBackward0) saves input, weights, hx, cx, the
output, the reserve buffer, the flat weight buffer and the dropout state; the backward `_cudnn_rnn_backward` returns
dx, dhx, dcx and one flat weight gradient whose views are the parameters' gradients.
A CPU trace instead runs the per-step decomposition (`_lstm_impl`, or oneDNN's `mkldnn_rnn_layer`), saving
per-gate tensors. `CudnnRnns.register` puts CUDA's path on AutogradCPU for fake tensors: the RNN entry calls
`aten._cudnn_rnn` (Meta kernels registered here give it cuDNN's reserve and give its backward the real outputs).
Real CPU tensors keep the CPU path (`OpOverload.decompose`). Under autocast, aten/src/ATen/cudnn/AutocastRNN.cpp
casts input, hx, cx to float16 (float16 even under bfloat16 autocast) and copies the weights into a new float16
flat buffer per call, kept for backward; its weight gradient is float16, cast back to each parameter's dtype.

Sizes cuDNN decides (cudnnGetRNNTempSpaceSizes is opaque), ruled from the H100 readings (sm90, torch 2.11+cu130,
cuDNN 9; benchmarks/results/gpu_campaign_raw_h100/ops/lstm-b32.json and gru-b32.json: 2 layers, hidden 256,
input 128, batch 32, seq 64, float32, dropout 0.1, standard algorithm; u = seq x batch x hidden x itemsize):
- reserve (training only): per layer and direction LSTM keeps 6 u (4 gates, c, h), GRU 7 u, less the last layer's
  h (the output, passed to the backward); plus one bit per element of each inner layer's output when dropout is
  on (the mask), plus 512 bytes. LSTM 11 u + 64 KiB + 512 and GRU 13 u + 64 KiB + 512 match both readings to the
  byte; the per-layer counts are fitted (the structure is derived); RNN_TANH / RELU (2 u: gate, h) are unmeasured.
- workspace (held during each call, forward and backward alike: RNN.cpp asks the same size for both):
  (1.59375 x gates + 10.1875) x seq x batch x hidden x 4 bytes (cuDNN computes in float32 for half inputs) + 512,
  times the directions. Fitted to the two readings (exact there); its scaling in seq, batch and hidden is assumed,
  as are directions, layers (not scaled) and other input sizes.
- dropout state: 48 bytes (a curandState) per thread, 1024 threads per SM: 6,488,064 bytes on a 132-SM H100.
Also held during a call: the contiguous copy of a batch-first (transposed) input, and in the backward of the
incoming gradient and zeros for the outputs whose gradient is undefined (RNN.cpp `_cudnn_rnn_backward`). Each call's
blocks are taken in RNN.cpp's order (`allocation_steps`): the forward's workspace after its outputs and before the
reserve, so that with expandable segments its hole lies below the reserve the backward keeps, as on the GPU.
Not emulated: packed sequences (they keep the CPU path), fp16's persistent algorithms (RNN.cpp `get_algo`: other
reserve and workspace sizes), projections (LSTM proj_size: the rule counts hidden, not proj), and weights that are
not one contiguous chunk (cuDNN then copies them into a new flat buffer per call; the trace assumes them flattened).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memplan.compat.torch import excluding_autocast_cpu, is_fake, override_kernel

aten = torch.ops.aten

RNN_RELU, RNN_TANH, LSTM, GRU = 0, 1, 2, 3
"""cudnnRNNMode_t."""
MODE_NAMES = {RNN_RELU: "RNN relu", RNN_TANH: "RNN tanh", LSTM: "LSTM", GRU: "GRU"}
MEASURED_SMS = 132
"""The readings' GPU: an H100 SXM."""
GATES = {RNN_RELU: 1, RNN_TANH: 1, LSTM: 4, GRU: 3}
RESERVE_UNITS_PER_LAYER = {RNN_RELU: 2, RNN_TANH: 2, LSTM: 6, GRU: 7}
"""seq x batch x hidden tensors the reserve keeps per layer and direction (LSTM, GRU fitted; RNN by analogy)."""
WORKSPACE_PER_GATE, WORKSPACE_BASE = 1.59375, 10.1875
"""Workspace in seq x batch x hidden float32 units: WORKSPACE_PER_GATE x gates + WORKSPACE_BASE (fitted)."""
PAD_BYTES = 512
"""What both readings hold beyond the structured sizes, in the reserve and the workspace alike."""
CURAND_STATE_BYTES, THREADS_PER_SM = 48, 1024

_ENTRIES = {"lstm.input": LSTM, "gru.input": GRU, "rnn_tanh.input": RNN_TANH, "rnn_relu.input": RNN_RELU}


@dataclass(frozen=True, kw_only=True)
class RnnShape:
    """One `_cudnn_rnn` call as cuDNN sizes its buffers."""

    mode: int
    """cudnnRNNMode_t: RNN_RELU, RNN_TANH, LSTM or GRU."""
    tokens: int
    """seq x batch (the packed input's rows for a packed sequence)."""
    hidden: int
    """Hidden size (the cell's, where LSTM has a projection)."""
    layers: int
    """num_layers."""
    directions: int
    """2 for bidirectional, else 1."""
    itemsize: int
    """Bytes per element of the input (after autocast's cast)."""
    dropout: bool
    """Training with dropout > 0 between layers."""


def reserve_bytes(shape: RnnShape) -> int:
    """cuDNN's training reserve (cudnnGetRNNTempSpaceSizes), by the rule in the module docstring."""
    unit = shape.tokens * shape.hidden * shape.itemsize
    kept = (RESERVE_UNITS_PER_LAYER[shape.mode] * shape.layers - 1) * shape.directions
    mask = (shape.layers - 1) * shape.tokens * shape.directions * shape.hidden // 8 if shape.dropout else 0
    return kept * unit + mask + PAD_BYTES


def workspace_bytes(shape: RnnShape) -> int:
    """The workspace each `_cudnn_rnn` / `_cudnn_rnn_backward` call holds while it runs."""
    math_itemsize = max(4, shape.itemsize)  # promote_rnn_math_type: half and bfloat16 compute in float32
    units = WORKSPACE_PER_GATE * GATES[shape.mode] + WORKSPACE_BASE
    return int(units * shape.tokens * shape.hidden * math_itemsize) * shape.directions + PAD_BYTES


def dropout_state_bytes(sm_count: int) -> int:
    """cudnnDropoutGetStatesSize on a GPU of `sm_count` streaming multiprocessors (the hardware catalog's)."""
    return CURAND_STATE_BYTES * THREADS_PER_SM * sm_count


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _shape(input, weight_args, batch_sizes, batch_first: bool) -> RnnShape:
    """weight_args: (mode, hidden_size, proj_size, num_layers, dropout, train, bidirectional)."""
    mode, hidden, _proj, layers, dropout, train, bidirectional = weight_args
    tokens = input.shape[0] if len(batch_sizes) else input.shape[0] * input.shape[1]
    return RnnShape(mode=mode, tokens=tokens, hidden=hidden, layers=layers, directions=2 if bidirectional else 1,
                    itemsize=input.element_size(), dropout=bool(train and dropout > 0))


def _seq_major_copy_bytes(t, batch_first: bool, packed: bool) -> int:
    """RNN.cpp: `input.transpose(0, 1)` for batch_first, then `.contiguous()`: a copy unless already contiguous."""
    if not isinstance(t, torch.Tensor):
        return 0
    view = t.transpose(0, 1) if batch_first and not packed else t
    return 0 if view.is_contiguous() else _nbytes(t)


def _hold(nbytes: int) -> list[tuple[str, int]]:
    return [("hold", nbytes)] if nbytes > 0 else []


def allocation_steps(func, args, out) -> list[tuple[str, object]]:
    """A `_cudnn_rnn` / `_cudnn_rnn_backward` call's allocations in RNN.cpp's order ([] for other ops), as steps:
    ("track", an output), ("hold", a local's bytes), ("drop", n: the last n locals, freed newest first as C++
    destroys them at a function's return).

    `_cudnn_rnn`: `x = input.contiguous()`, output, hy, cy, the weight buffer where none was given, then
    `workspace` and (`fn_train`) `reserve`; x and the workspace freed at return. `_cudnn_rnn_backward`:
    `at::zeros_like` for each undefined gradient (output, hy, cy); `_cudnn_rnn_backward_input`: x, `dy =
    grad_output.contiguous()`, dx, dhx, dcx, its workspace, its locals freed; (output_mask[3])
    `_cudnn_rnn_backward_weight`: x, `dw = at::zeros(...)`, its workspace, its locals freed; the zeros last."""
    if func is aten._cudnn_rnn.default and len(args) >= 15:
        input, batch_first, batch_sizes = args[0], args[10], args[14]
        shape = _shape(input, (*args[6:10], *args[11:14]), batch_sizes, batch_first)
        x = _seq_major_copy_bytes(input, batch_first, bool(len(batch_sizes)))
        return [*_hold(x), *(("track", t) for t in (*out[:3], out[4])), *_hold(workspace_bytes(shape)),
                ("track", out[3]), ("drop", 1 + (x > 0))]
    if func is aten._cudnn_rnn_backward.default and len(args) >= 22:
        input, hx, cx, output, grad_output, grad_hy, grad_cy = (args[i] for i in (0, 4, 5, 6, 7, 8, 9))
        batch_first, batch_sizes, mask = args[14], args[18], args[21]
        packed = bool(len(batch_sizes))
        workspace = workspace_bytes(_shape(input, (*args[10:14], *args[15:18]), batch_sizes, batch_first))
        zeros = [n for n in (_nbytes(output) if grad_output is None else 0, _nbytes(hx) if grad_hy is None else 0,
                             _nbytes(cx) if cx is not None and grad_cy is None else 0) if n > 0]
        x = _seq_major_copy_bytes(input, batch_first, packed)
        # an undefined grad_output's zeros are contiguous batch-first, so copied seq-major too
        dy = _nbytes(output) if grad_output is None and batch_first and not packed else \
            _seq_major_copy_bytes(grad_output, batch_first, packed)
        steps = [*(s for n in zeros for s in _hold(n)), *_hold(x), *_hold(dy),
                 *(("track", t) for t in out[:3] if isinstance(t, torch.Tensor)), *_hold(workspace),
                 ("drop", 1 + (x > 0) + (dy > 0))]
        if mask[3] and out[3]:
            steps += [*_hold(x), ("track", out[3][0]), *_hold(workspace), ("drop", 1 + (x > 0))]
        return steps + [("drop", len(zeros))]
    return []


class CudnnRnnBuffers:
    """Per trace: the dropout state a CUDA process makes at its first training RNN call with dropout, and the
    blocks each cuDNN RNN call holds while it runs (see the module docstring)."""

    def __init__(self, *, sm_count: int) -> None:
        self.sm_count = sm_count
        self._dropout_state = False
        self._calls: set[tuple[int, bool, torch.dtype]] = set()

    def due(self, func, args) -> list[int]:
        """[the dropout state's bytes] at the first training `_cudnn_rnn` with dropout > 0, else []."""
        if func is aten._cudnn_rnn.default and len(args) > 12 and args[12] and args[11] > 0 and not self._dropout_state:
            self._dropout_state = True
            return [dropout_state_bytes(self.sm_count)]
        return []

    def call_steps(self, func, args, out) -> list[tuple[str, object]]:
        """`allocation_steps`, after ("keep", the dropout state's bytes) at the first training call with dropout:
        `_cudnn_impl` calls `get_dropout_state` (`_cudnn_init_dropout_state`) before `_cudnn_rnn`."""
        if func is aten._cudnn_rnn.default and len(args) >= 15:
            self._calls.add((args[6], bool(args[13]), args[0].dtype))
        return [*(("keep", n) for n in self.due(func, args)), *allocation_steps(func, args, out)]

    def notes(self) -> list[str]:
        """What the estimate's cuDNN RNN sizes rest on, once an RNN took cuDNN's path."""
        if not self._calls:
            return []
        outside = [f"this GPU ({self.sm_count} SMs; measured: 132)"] if self.sm_count != MEASURED_SMS else []
        outside += sorted({MODE_NAMES[mode] for mode, _, _ in self._calls} - {"LSTM", "GRU"})
        outside += ["bidirectional"] * any(bidirectional for _, bidirectional, _ in self._calls)
        outside += sorted({str(dtype).removeprefix("torch.") for _, _, dtype in self._calls} - {"float32"})
        text = ("cuDNN RNN reserve, workspace and dropout state modelled from two sm90 / cuDNN 9 readings (2-layer "
                "LSTM and GRU, float32, unidirectional); packed sequences keep the CPU path")
        return [text + ("; outside the measured range: " + ", ".join(outside) if outside else "")]


# --- the emulation: the RNN entries take cuDNN's op; Meta kernels give it cuDNN's buffers ---------------------

def cudnn_acceptable(input: torch.Tensor, params, compute_capability: tuple[int, int]) -> bool:
    """RNN.cpp `use_cudnn` for the emulated GPU, in a trace: the module's weights (or its input) are fake. A batch
    the loader gave is a real tensor in the trace, so a real input with fake weights is traced too; real weights
    and input (a real CPU run) keep the CPU path."""
    dtypes = (torch.float32, torch.float64, torch.float16) + ((torch.bfloat16,) if compute_capability >= (8, 0) else ())
    traced = is_fake(input) or any(is_fake(p) for p in params)
    return traced and torch.backends.cudnn.enabled and input.numel() > 0 and input.dtype in dtypes


def _autocast_half(params) -> bool:
    """AutocastRNN.cpp `needs_cast_and_flatten`: autocast on and the weights floating, neither double nor half."""
    w = params[0]
    return (torch.is_autocast_enabled("cpu") and w.is_floating_point()
            and w.dtype not in (torch.float64, torch.float16))


def _cast_and_flatten(params: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`copy_weights_to_flat_buf_views` in float16: a new flat buffer and tensors sharing its storage (set_, no
    autograd view), each the differentiable copy of one parameter."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float16, device=params[0].device)
    storage, offset, views = flat.untyped_storage(), 0, []
    for p in params:
        part = flat.new_empty(0).set_(storage, offset, (p.numel(), 1))  # (a factory this small would be made real)
        views.append(part.copy_(p.reshape(-1, 1)))
        offset += p.numel()
    return flat, views


def _half(t):
    """autocast's cached_cast(kHalf, t) for an activation or state (never cached: not a leaf parameter)."""
    eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
    return t.to(torch.float16) if eligible and t.dtype != torch.float16 else t


class CudnnRnns:
    """Installs the cuDNN RNN path for one emulation. The dropout state is not a traced tensor: the tracker
    allocates it at the first training call with dropout (`CudnnRnnBuffers.due`), and the op is given None."""

    def __init__(self, compute_capability: tuple[int, int]) -> None:
        self.compute_capability = tuple(compute_capability)

    def register(self, lib: torch.library.Library) -> None:
        for name, mode in _ENTRIES.items():
            override_kernel(lib, name, self._entry(name, mode), "AutogradCPU")
        override_kernel(lib, "_cudnn_rnn", _cudnn_rnn_meta, "Meta")
        override_kernel(lib, "_cudnn_rnn_backward", _cudnn_rnn_backward_meta, "Meta")

    def _entry(self, name: str, mode: int):
        base, _, overload = name.partition(".")
        op = getattr(getattr(aten, base), overload)

        def kernel(*args):
            input, params = args[0], args[2]
            if not cudnn_acceptable(input, params, self.compute_capability):
                return op.decompose(*args)
            if not is_fake(input):  # the loader's real batch: the op runs on the weights' fake device
                input = next(p for p in params if is_fake(p)).fake_mode.from_tensor(input)
            return self._run(mode, input, *args[1:])

        kernel.__name__ = f"cudnn_{base}"
        return kernel

    def _run(self, mode: int, input, hidden, params, *flags):
        """`_cudnn_impl`: flags are (has_biases, num_layers, dropout, train, bidirectional, batch_first)."""
        has_biases, num_layers, dropout, train, bidirectional, batch_first = flags
        hx, cx = (hidden[0], hidden[1]) if mode == LSTM else (hidden, None)
        hidden_size, proj_size = hx.size(2), 0
        if cx is not None and cx.size(2) != hx.size(2):
            hidden_size, proj_size = cx.size(2), hx.size(2)
        weights, weight_buf = list(params), params[0].detach()  # the flat buffer the parameters are views of
        if _autocast_half(params):
            with excluding_autocast_cpu():
                weight_buf, weights = _cast_and_flatten(weights)
                input, hx, cx = _half(input), _half(hx), _half(cx)
        stride0 = (4 if has_biases else 2) + (1 if proj_size else 0)
        with excluding_autocast_cpu():
            out = aten._cudnn_rnn(input, weights, stride0, weight_buf, hx, cx, mode, hidden_size, proj_size,
                                  num_layers, batch_first, dropout, train, bidirectional, [], None)
        return (out[0], out[1], out[2]) if mode == LSTM else (out[0], out[1])


def _cudnn_rnn_meta(*args):
    """aten::_cudnn_rnn's outputs as RNN.cpp makes them: output (seq-major, transposed back for batch_first),
    hy, cy, the reserve (sized by `reserve_bytes`) and the flat weight buffer it was given."""
    input, weight, _stride0, weight_buf, hx, cx = args[:6]
    mode, hidden, proj, layers, batch_first, dropout, train, bidirectional, batch_sizes = args[6:15]
    directions = 2 if bidirectional else 1
    out_size = (proj or hidden) * directions
    packed = bool(len(batch_sizes))
    if packed:
        output = input.new_empty((input.shape[0], out_size))
    else:
        seq, batch = (input.shape[1], input.shape[0]) if batch_first else input.shape[:2]
        output = input.new_empty((seq, batch, out_size))
        output = output.transpose(0, 1) if batch_first else output
    hy = hx.new_empty(hx.shape)
    cy = cx.new_empty(cx.shape) if cx is not None else hx.new_empty(0)
    shape = _shape(input, (mode, hidden, proj, layers, dropout, train, bidirectional), batch_sizes, batch_first)
    reserve = input.new_empty(reserve_bytes(shape) if train else 0, dtype=torch.uint8)
    if weight_buf is None:  # not flattened: RNN.cpp copies the weights into a new buffer
        weight_buf = input.new_empty(sum(w.numel() for w in weight))
    return output, hy, cy, reserve, weight_buf


def _cudnn_rnn_backward_meta(*args):
    """aten::_cudnn_rnn_backward's outputs: dx (seq-major, transposed back), dhx, dcx (made whether or not they
    are needed) and, when output_mask[3], views of one flat weight gradient in the weight buffer's dtype."""
    input, weight, _stride0, weight_buf, hx, cx = args[:6]
    batch_first, batch_sizes, mask = args[14], args[18], args[21]
    if batch_first and not len(batch_sizes):
        dx = input.new_empty((input.shape[1], input.shape[0], *input.shape[2:])).transpose(0, 1)
    else:
        dx = input.new_empty(input.shape)
    dhx = hx.new_empty(hx.shape)
    dcx = cx.new_empty(cx.shape) if cx is not None else None
    grads = []
    if mask[3]:
        dw = weight_buf.new_empty(sum(w.numel() for w in weight))
        offset = 0
        for w in weight:
            grads.append(dw[offset:offset + w.numel()].view(w.shape))
            offset += w.numel()
    return dx, dhx, dcx, grads
