"""Rules for the sequence layers: the pre-LN transformer block, LSTM and GRU, on CPU.

- Attention: `_scaled_dot_product_flash_attention_for_cpu` saves q, k, v (views of the qkv
  projection, so that whole tensor stays), its output and an fp32 logsumexp of (batch, heads, seq).
  Its output transposes back to (batch, seq, width) without a copy. Backward makes three gradient
  tensors, stacks them (unbind's backward) and copies once more (the permuted view's reshape).
- A residual add saves nothing; its input buffer accumulates the two incoming gradients out of
  place. Under autocast the residual stream stays fp32, so each branch's gradient is cast to bf16.
- LSTM on CPU runs oneDNN (`mkldnn_rnn_layer`, one call per layer): it saves input, weights, h0/c0,
  output, hy/cy and a uint8 workspace whose size is oneDNN's (`lstm_workspace_bytes`). Under
  autocast the op takes bf16 copies of input, weights and states.
- GRU on CPU runs ATen's cell loop: inputs projected for the whole sequence at once, then per step
  an addmm (saving the hidden state), two in-place sigmoids (saving the gate tensor), and two
  in-place muls that each clone their input: 7 x batch x hidden elements saved per step.
"""
from __future__ import annotations

from memplan.analytic.rules import F32, LOW, Act, Backward, activation, dropout, layer_norm, linear
from memplan.analytic.tape import Buf, Tape
from memplan.estimator.kernels.scratch import lstm_workspace_bytes



def attention_block(tape: Tape, x: Act, heads: int, mlp_ratio: int, p: float, amp: bool) -> tuple[Act, Backward]:
    batch, seq, width = x.shape
    c = LOW if amp else F32
    # x + drop(proj(sdpa(qkv(ln1(x)))))
    h1, ln1_bw = layer_norm(tape, x)
    qkv, qkv_bw = linear(tape, h1, width, 3 * width, True, amp)
    tape.drop(h1.buf)
    attn, lse = tape.new(batch * seq * width * c), tape.new(batch * heads * seq * F32)
    sdpa_saved = tape.save(qkv.buf, attn, lse)
    tape.drop(lse)
    proj, proj_bw = linear(tape, Act(attn, x.shape, c, True), width, width, True, amp)
    branch, drop1_bw = dropout(tape, proj, p)
    tape.drop(proj.buf)
    x1 = Act(tape.new(x.numel * max(x.itemsize, c)), x.shape, max(x.itemsize, c), True)
    tape.drop(branch.buf)
    # x1 + drop(fc2(gelu(fc1(ln2(x1)))))
    h2, ln2_bw = layer_norm(tape, x1)
    up, fc1_bw = linear(tape, h2, width, mlp_ratio * width, True, amp)
    tape.drop(h2.buf)
    act, gelu_bw = activation(tape, up, "gelu")
    down, fc2_bw = linear(tape, act, mlp_ratio * width, width, True, amp)
    tape.drop(up.buf, act.buf)
    branch, drop2_bw = dropout(tape, down, p)
    tape.drop(down.buf)
    out = Act(tape.new(x1.nbytes), x.shape, x1.itemsize, True)
    tape.drop(branch.buf, qkv.buf, attn, x1.buf)

    def branch_grad(g: Buf) -> Buf:
        """AddBackward hands the residual gradient to the branch, cast if the branch ran in bf16."""
        if c == x1.itemsize:
            return tape.ref(g)
        return tape.new(x.numel * c)

    def accumulate(resid: Buf, other: Buf) -> Buf:
        total = tape.new(x.numel * x1.itemsize)
        tape.drop(resid, other)
        return total

    def backward(g: Buf) -> Buf:
        # MLP branch
        g1 = accumulate(g, ln2_bw(fc1_bw(gelu_bw(fc2_bw(drop2_bw(branch_grad(g)))))))
        # attention branch
        ga = proj_bw(drop1_bw(branch_grad(g1)))
        grads = [tape.new(x.numel * c) for _ in range(3)]  # d q, d k, d v
        tape.release(sdpa_saved)
        tape.drop(ga)
        stacked = tape.new(3 * x.numel * c)  # unbind backward
        tape.drop(*grads)
        flat = tape.new(3 * x.numel * c)  # reshape of the permuted gradient
        tape.drop(stacked)
        return accumulate(g1, ln1_bw(qkv_bw(flat)))

    return out, backward


# -- LSTM (oneDNN) ---------------------------------------------------------------------------------
# The workspace size is oneDNN's rule, shared with the trace: memplan.estimator.kernels.scratch.


def lstm(tape: Tape, x: Act, hidden: int, num_layers: int, amp: bool) -> tuple[Act, Backward]:
    batch, seq, in_features = x.shape
    s = LOW if amp else F32
    state_bytes = num_layers * batch * hidden * x.itemsize  # zeros(..., dtype=input.dtype)
    h0, c0 = tape.new(state_bytes), tape.new(state_bytes)
    source = tape.new(x.nbytes)  # input.transpose(0, 1).contiguous()
    cur = Act(tape.ref(source), (seq, batch, in_features), x.itemsize, x.requires_grad)
    layers = []
    for _ in range(num_layers):
        in_f = cur.shape[-1]
        weights = (4 * hidden * in_f, 4 * hidden * hidden, 4 * hidden, 4 * hidden)
        states_cast = amp and x.itemsize != LOW
        hx = tape.new(batch * hidden * LOW) if states_cast else tape.ref(h0)
        cx = tape.new(batch * hidden * LOW) if states_cast else tape.ref(c0)
        w_low = [tape.new(n * LOW) for n in reversed(weights)] if amp else []  # autocast's weight copies
        x_cast = amp and cur.itemsize != LOW
        x_in = tape.new(cur.numel * LOW) if x_cast else tape.ref(cur.buf)
        out = tape.new(seq * batch * hidden * s)
        hy, cy = tape.new(batch * hidden * s), tape.new(batch * hidden * s)
        workspace = tape.new(lstm_workspace_bytes(seq, batch, in_f, hidden, s))
        saved = tape.save(x_in, *w_low, hx, cx, out, hy, cy, workspace)
        tape.drop(x_in, *w_low, hx, cx, hy, cy, workspace, cur.buf)
        layers.append((saved, cur, x_cast, weights))
        cur = Act(out, (seq, batch, hidden), s, True)
    h_n, c_n = tape.new(num_layers * batch * hidden * s), tape.new(num_layers * batch * hidden * s)
    tape.drop(source, h0, c0, h_n, c_n)  # the module returns only the output sequence

    def backward(g: Buf) -> Buf | None:
        for saved, inp, x_cast, weights in reversed(layers):
            # mkldnn_rnn_layer_backward answers in fp32 whatever the input dtype; d h0 / d c0 are dropped
            gi = tape.new(inp.numel * F32)
            grads = [tape.new(n * F32, "activation" if amp else "gradients") for n in weights]
            tape.drop(tape.new(batch * hidden * F32), tape.new(batch * hidden * F32))
            if amp:  # the engine casts each gradient to its input's dtype (the bf16 copies)
                gi = _cast(tape, gi, inp.numel * LOW)
                grads = [_cast(tape, grad, n * LOW) for grad, n in zip(grads, weights)]
            tape.release(saved)
            tape.drop(g)
            if amp:  # then ToCopyBackward of the input's and the weights' casts
                if x_cast:
                    gi = _cast(tape, gi, inp.numel * F32)
                for grad, n in zip(grads, weights):
                    tape.new(n * F32, "gradients")  # the .grad, held by the parameter
                    tape.drop(grad)
            if not inp.requires_grad:
                tape.drop(gi)
                gi = None
            g = gi
        return g

    return Act(cur.buf, (batch, seq, hidden), s, True, contiguous=False), backward


def _cast(tape: Tape, buf: Buf, nbytes: int) -> Buf:
    """A dtype conversion of a gradient: the copy is made, then the original freed."""
    copy = tape.new(nbytes)
    tape.drop(buf)
    return copy


# -- GRU (ATen cell loop) --------------------------------------------------------------------------
class _Accumulator:
    """AccumulateGrad's input buffer for W_hh / b_hh: each step's gradient is added out of place."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.total: dict[str, Buf] = {}

    def __call__(self, which: str, grad: Buf) -> None:
        previous = self.total.get(which)
        if previous is None:
            self.total[which] = grad
            return
        self.total[which] = self.tape.new(grad.nbytes)
        self.tape.drop(previous, grad)

    def finish(self) -> None:
        for grad in self.total.values():
            self.tape.adopt(grad, "gradients")
        self.total = {}


def gru(tape: Tape, x: Act, hidden: int, num_layers: int, amp: bool) -> tuple[Act, Backward]:
    batch, seq, _ = x.shape
    c = LOW if amp else F32
    hs = x.itemsize  # the hidden state keeps h0's dtype: bf16 gate tensors promote back to it
    h0 = tape.new(num_layers * batch * hidden * x.itemsize)
    cur = Act(tape.ref(x.buf), (seq, batch, x.shape[2]), x.itemsize, x.requires_grad, contiguous=False)
    layers, finals = [], []
    for _ in range(num_layers):
        gates, gates_bw = linear(tape, cur, cur.shape[-1], 3 * hidden, True, amp)  # every step's input gates
        accumulator = _Accumulator(tape)
        h = Act(tape.ref(h0), (batch, hidden), x.itemsize, False)
        steps, outputs = [], []
        for _ in range(seq):
            hg, hg_bw = linear(tape, h, hidden, 3 * hidden, True, amp, sink=accumulator)
            clone_n = tape.new(batch * hidden * c)   # mul_'s original self
            new_gate = tape.new(batch * hidden * c)   # tanh_(ig + hg * r)
            h_next = tape.new(batch * hidden * hs)    # h - n, then .mul_(z).add_(n) in place
            clone_h = tape.new(batch * hidden * hs)   # mul_'s original self
            saved = tape.save(hg.buf, clone_n, new_gate, clone_h)
            tape.drop(hg.buf, clone_n, new_gate, clone_h, h.buf)
            steps.append((saved, hg_bw))
            h = Act(h_next, (batch, hidden), hs, True)
            outputs.append(tape.ref(h_next))
        out = Act(tape.new(seq * batch * hidden * hs), (seq, batch, hidden), hs, True)  # stack
        tape.drop(*outputs, gates.buf, cur.buf)
        finals.append(h.buf)
        layers.append((steps, gates_bw, accumulator))
        cur = out
    h_n = tape.new(num_layers * batch * hidden * hs)
    tape.drop(h_n, h0, *finals)

    def layer_backward(g: Buf, steps: list, gates_bw: Backward, accumulator: _Accumulator) -> Buf | None:
        per_step, carried = [], None
        for saved, hg_bw in reversed(steps):
            g_h = None
            if carried is not None:  # this step's output slice + the next step's hidden gradient
                g_h = tape.new(batch * hidden * hs)
                tape.drop(carried)
            scratch = tape.new(4 * batch * hidden * hs)  # elementwise gate gradients in flight
            per_step.append(tape.new(batch * 3 * hidden * c))  # d input gates, stacked at the end
            d_hg = tape.new(batch * 3 * hidden * c)  # cat of the hidden-gate gradients
            tape.drop(scratch, g_h)
            tape.release(saved)
            carried = hg_bw(d_hg)
        tape.drop(carried, g)
        accumulator.finish()
        stacked = tape.new(seq * batch * 3 * hidden * c)  # unbind's backward
        tape.drop(*per_step)
        return gates_bw(stacked)

    def backward(g: Buf) -> Buf | None:
        for steps, gates_bw, accumulator in reversed(layers):
            g = layer_backward(g, steps, gates_bw, accumulator)
        return g

    return Act(cur.buf, (batch, seq, hidden), hs, True, contiguous=False), backward
