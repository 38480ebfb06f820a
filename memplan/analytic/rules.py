"""What each layer allocates, saves for backward, and frees, on CPU, in torch's order.

One small function per layer type. Each takes the input activation and returns the output activation
and a backward function; the backward takes the gradient of the output (one reference, owned) and
returns the gradient of the input (or None when the input needs none). Every rule was read off
`tools/autograd/derivatives.yaml` and checked against a real CPU step (see tests/test_analytic.py):

- Linear saves its input; under autocast it saves the bf16 copies of input and weight (cache off),
  and the weight copy only when the input needs a gradient. A non-contiguous 3-D input goes through
  matmul: a contiguous copy (saved), mm, then an out-of-place bias add.
- ReLU, Tanh, Sigmoid save their output; GELU saves its input.
- Dropout on CPU saves a full-size noise tensor of the input's dtype (not a bool mask).
- Conv2d saves input and weight (bf16 copies under autocast, the weight copy even when the input
  needs no gradient: one derivative formula covers all three inputs); BatchNorm saves its input plus two
  fp32 per-channel stats; LayerNorm saves its input plus fp32 mean and rstd per row.
- MaxPool saves its input and int64 indices of the output's size; AvgPool saves its input.
- Embedding saves only the ids (part of the batch); its weight gradient is dense.
- Cross-entropy runs in fp32 (a cast copy under autocast) and saves the log-softmax output.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

from memplan.analytic.tape import Buf, Tape

F32, LOW, I64 = 4, 2, 8

Backward = Callable[[Buf], "Buf | None"]


@dataclass
class Act:
    """An activation flowing between layers."""

    buf: Buf
    """Its storage."""
    shape: tuple[int, ...]
    """Full shape, batch first."""
    itemsize: int
    """Bytes per element (4 fp32, 2 bf16)."""
    requires_grad: bool
    """Whether autograd tracks it."""
    contiguous: bool = True
    """False for the transposed output of a batch_first RNN."""

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


GradSink = Callable[[str, Buf], None]
"""Receives a parameter's finished gradient ('weight' or 'bias') instead of it becoming `.grad` at once:
a weight used at every step of a loop accumulates its gradients first."""


def _param_grad(tape: Tape, numel: int, amp: bool, sink: GradSink | None = None) -> Buf:
    """A parameter's gradient as its backward op makes it: bf16 scratch under autocast, else the .grad."""
    if amp:
        return tape.new(numel * LOW)
    return tape.new(numel * F32, "activation" if sink else "gradients")


def _finish_param_grad(
    tape: Tape, grad: Buf | None, numel: int, amp: bool, which: str = "weight", sink: GradSink | None = None
) -> None:
    """ToCopyBackward of the autocast weight copy (an fp32 copy, the bf16 one freed), then AccumulateGrad."""
    if grad is None:
        return
    if amp:
        full = tape.new(numel * F32, "activation" if sink else "gradients")
        tape.drop(grad)
        grad = full
    if sink is not None:
        sink(which, grad)


def _to_fp32(tape: Tape, low: Buf | None, numel: int) -> Buf | None:
    """ToCopyBackward of an autocast input cast: an fp32 copy of the bf16 gradient, which is then freed."""
    if low is None:
        return None
    full = tape.new(numel * F32)
    tape.drop(low)
    return full


def _passthrough(g: Buf) -> Buf:
    return g


# -- dense, convolution ----------------------------------------------------------------------------
def linear(
    tape: Tape, x: Act, in_f: int, out_f: int, bias: bool, amp: bool, sink: GradSink | None = None
) -> tuple[Act, Backward]:
    rows = x.numel // in_f
    c = LOW if amp else F32
    # autocast casts right to left: bias, weight, input
    b_low = tape.new(out_f * LOW) if amp and bias else None
    w_low = tape.new(out_f * in_f * LOW) if amp else None
    x_cast = amp and x.itemsize != LOW
    x_in = tape.new(x.numel * LOW) if x_cast else tape.ref(x.buf)
    split = not x.contiguous and len(x.shape) >= 3
    if split:  # matmul on a non-contiguous input: contiguous copy, mm, out-of-place bias add
        clone = tape.new(x.numel * c)
        tape.drop(x_in)
        x_in = clone
        out = tape.new(rows * out_f * c)
        if bias:
            added = tape.new(rows * out_f * c)
            tape.drop(out)
            out = added
    else:
        out = tape.new(rows * out_f * c)
    saved = tape.save(x_in, w_low if x.requires_grad else None)
    tape.drop(b_low, w_low, x_in)

    def backward(g: Buf) -> Buf | None:
        gb = _param_grad(tape, out_f, amp, sink) if bias and split else None
        gi = tape.new(x.numel * c) if x.requires_grad else None
        gw = _param_grad(tape, out_f * in_f, amp, sink)
        if bias and not split:
            gb = _param_grad(tape, out_f, amp, sink)
        tape.release(saved)
        tape.drop(g)
        if x_cast:
            gi = _to_fp32(tape, gi, x.numel)
        _finish_param_grad(tape, gw, out_f * in_f, amp, "weight", sink)
        _finish_param_grad(tape, gb, out_f, amp, "bias", sink)
        return gi

    return Act(out, (*x.shape[:-1], out_f), c, True), backward


def conv2d(tape: Tape, x: Act, out_shape: tuple[int, ...], kernel: int, bias: bool, amp: bool) -> tuple[Act, Backward]:
    c = LOW if amp else F32
    c_in, c_out = x.shape[1], out_shape[1]
    w_numel = c_out * c_in * kernel * kernel
    b_low = tape.new(c_out * LOW) if amp and bias else None
    w_low = tape.new(w_numel * LOW) if amp else None
    x_cast = amp and x.itemsize != LOW
    x_in = tape.new(x.numel * LOW) if x_cast else tape.ref(x.buf)
    out = Act(tape.new(prod(out_shape) * c), out_shape, c, True)
    saved = tape.save(x_in, w_low)  # one derivative formula for input, weight and bias: both always saved
    tape.drop(b_low, w_low, x_in)

    def backward(g: Buf) -> Buf | None:  # one convolution_backward op: input, weight, bias grads
        gi = tape.new(x.numel * c) if x.requires_grad else None
        gw = _param_grad(tape, w_numel, amp)
        gb = _param_grad(tape, c_out, amp) if bias else None
        tape.release(saved)
        tape.drop(g)
        if x_cast:
            gi = _to_fp32(tape, gi, x.numel)
        _finish_param_grad(tape, gw, w_numel, amp)
        _finish_param_grad(tape, gb, c_out, amp)
        return gi

    return out, backward


# -- elementwise, normalisation, pooling -----------------------------------------------------------
def _input_sized_backward(tape: Tape, nbytes: int, saved) -> Backward:
    """Backward of an op whose input gradient is one new input-sized buffer: make it, release what the
    forward saved, drop the incoming gradient."""
    def backward(g: Buf) -> Buf:
        gi = tape.new(nbytes)
        tape.release(saved)
        tape.drop(g)
        return gi

    return backward


def activation(tape: Tape, x: Act, kind: str) -> tuple[Act, Backward | None]:
    out = Act(tape.new(x.nbytes), x.shape, x.itemsize, x.requires_grad, x.contiguous)
    if not x.requires_grad:
        return out, None
    saved = tape.save(x.buf if kind == "gelu" else out.buf)

    return out, _input_sized_backward(tape, x.nbytes, saved)


def dropout(tape: Tape, x: Act, p: float) -> tuple[Act, Backward | None]:
    if p == 0:  # F.dropout returns its input
        return Act(tape.ref(x.buf), x.shape, x.itemsize, x.requires_grad, x.contiguous), _passthrough
    noise = tape.new(x.nbytes)  # empty_like().bernoulli_().div_(1 - p), then input * noise
    out = Act(tape.new(x.nbytes), x.shape, x.itemsize, x.requires_grad, x.contiguous)
    saved = tape.save(noise) if x.requires_grad else ()
    tape.drop(noise)
    if not x.requires_grad:
        return out, None

    return out, _input_sized_backward(tape, x.nbytes, saved)


def batch_norm(tape: Tape, x: Act) -> tuple[Act, Backward]:
    """Saves the input and fp32 mean / invstd per channel."""
    return _norm(tape, x, stats=x.shape[1], param_width=x.shape[1])


def layer_norm(tape: Tape, x: Act) -> tuple[Act, Backward]:
    """Saves the input and fp32 mean / rstd per row."""
    width = x.shape[-1]
    return _norm(tape, x, stats=x.numel // width, param_width=width)


def _norm(tape: Tape, x: Act, *, stats: int, param_width: int) -> tuple[Act, Backward]:
    out = Act(tape.new(x.nbytes), x.shape, x.itemsize, True)
    mean, inv = tape.new(stats * F32), tape.new(stats * F32)
    saved = tape.save(x.buf, mean, inv)
    tape.drop(mean, inv)

    def backward(g: Buf) -> Buf | None:
        gi = tape.new(x.nbytes) if x.requires_grad else None
        tape.new(param_width * F32, "gradients")  # weight
        tape.new(param_width * F32, "gradients")  # bias
        tape.release(saved)
        tape.drop(g)
        return gi

    return out, backward


def pool(tape: Tape, x: Act, kind: str, out_shape: tuple[int, ...]) -> tuple[Act, Backward | None]:
    out = Act(tape.new(prod(out_shape) * x.itemsize), out_shape, x.itemsize, x.requires_grad)
    if not x.requires_grad:
        return out, None
    indices = tape.new(prod(out_shape) * I64) if kind == "max" else None
    saved = tape.save(x.buf, indices)
    tape.drop(indices)

    return out, _input_sized_backward(tape, x.nbytes, saved)


def flatten(tape: Tape, x: Act) -> tuple[Act, Backward | None]:
    shape = (x.shape[0], prod(x.shape[1:]))
    if x.contiguous:
        return Act(tape.ref(x.buf), shape, x.itemsize, x.requires_grad), _passthrough
    out = Act(tape.new(x.nbytes), shape, x.itemsize, x.requires_grad)  # reshape copies
    return out, _passthrough


def embedding(tape: Tape, ids: Act, num_embeddings: int, dim: int) -> tuple[Act, Backward]:
    out = Act(tape.new(ids.numel * dim * F32), (*ids.shape, dim), F32, True)

    def backward(g: Buf) -> None:
        tape.new(num_embeddings * dim * F32, "gradients")  # embedding_dense_backward
        tape.drop(g)
        return None

    return out, backward


# -- the loss --------------------------------------------------------------------------------------
def cross_entropy(tape: Tape, logits: Act, amp: bool) -> tuple[tuple[Buf, ...], Backward]:
    """F.cross_entropy on (rows, classes) logits: log_softmax (saved) then nll_loss, in fp32.

    Returns the storages that outlive the forward (the loss, and nll_loss's total_weight, which
    stays until the backward is over) and the backward.
    """
    cast = amp and logits.itemsize != F32
    x32 = tape.new(logits.numel * F32) if cast else tape.ref(logits.buf)
    log_probs = tape.new(logits.numel * F32)
    loss, total_weight = tape.new(F32), tape.new(F32)
    saved = tape.save(log_probs)
    tape.drop(log_probs, x32)

    def backward(_: Buf | None) -> Buf:
        seed = tape.new(F32)  # ones_like(loss)
        g_nll = tape.new(logits.numel * F32)
        tape.drop(seed)
        g = tape.new(logits.numel * F32)  # _log_softmax_backward_data
        tape.release(saved)
        tape.drop(g_nll)
        if cast:
            low = tape.new(logits.numel * logits.itemsize)
            tape.drop(g)
            g = low
        return g

    return (loss, total_weight), backward
