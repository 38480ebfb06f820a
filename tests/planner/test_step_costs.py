"""estimator/flops.py through memplan.estimate: each op's FLOPs and bytes against hand-computed values.

Every case runs the real estimator on CPU fake tensors (fp32, CPU target) and picks the ops of one class
and phase out of MemoryEstimate.step_costs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memplan.estimator import estimate

F32 = 4


def ops_of(model: nn.Module, batch: tuple, loss, *, device: str = "cpu", precision: str = "32-true",
           checkpointing: bool = False):
    est = estimate(model, batch, loss=loss, optimizer="sgd", device=device, precision=precision,
                   checkpointing=checkpointing)
    return est.step_costs


def test_linear_forward_and_backward_matmuls():
    # x (8, 64) @ W^T (64, 32): 2 x 8 x 64 x 32 FLOPs; reads x and W, writes the (8, 32) output.
    model = nn.Linear(64, 32, bias=False)
    costs = ops_of(model, (torch.randn(8, 64),), lambda m, b: m(b[0]).sum())
    forward = [o for o in costs.ops if o.phase == "forward" and o.op_class == "matmul"]
    backward = [o for o in costs.ops if o.phase == "backward" and o.op_class == "matmul"]
    assert [(o.flops, o.bytes, o.dtype) for o in forward] == [(2 * 8 * 64 * 32, F32 * (8 * 64 + 64 * 32 + 8 * 32), "fp32")]
    # The input needs no gradient: only the weight's, grad_out^T (32, 8) @ x (8, 64).
    assert [(o.flops, o.bytes) for o in backward] == [(2 * 32 * 8 * 64, F32 * (8 * 32 + 8 * 64 + 32 * 64))]
    assert costs.flops("forward", classes=("matmul",)) == 2 * 8 * 64 * 32


def test_addmm_reads_the_bias_and_bf16_halves_the_bytes():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    costs = ops_of(model, (torch.randn(8, 64),), lambda m, b: m(b[0]).float().sum(), device="A100-80GB",
                   precision="bf16-mixed")
    forward = [o for o in costs.ops if o.phase == "forward" and o.op_class == "matmul"]
    assert [(o.flops, o.bytes, o.dtype) for o in forward] == [
        (2 * 8 * 64 * 32, 2 * (32 + 8 * 64 + 64 * 32 + 8 * 32), "bf16"),
        (2 * 8 * 32 * 16, 2 * (16 + 8 * 32 + 32 * 16 + 8 * 16), "bf16"),
    ]
    casts = [o for o in costs.ops if o.phase == "forward" and o.cast]
    # autocast casts both weights, both biases and the input to bf16, the loss's .float() the output back:
    # read 4 bytes and write 2, or read 2 and write 4, per element
    assert sorted(o.bytes for o in casts) == sorted(6 * n for n in (32 * 64, 32, 8 * 64, 16 * 32, 16, 8 * 16))


def test_scaled_dot_product_attention():
    # q, k, v (B=2, H=4, T=128, D=32): forward QK^T and PV, 2 x 2BHT^2D; backward recomputes the scores
    # and makes dV, dP, dQ, dK: 5 x 2BHT^2D. Causal: the kernel skips the masked half.
    b, h, t, d = 2, 4, 128, 32

    class Attention(nn.Module):
        def __init__(self, causal: bool):
            super().__init__()
            self.proj, self.causal = nn.Linear(d, d), causal

        def forward(self, x):
            q = self.proj(x)
            return F.scaled_dot_product_attention(q, q, q, is_causal=self.causal)

    x = torch.randn(b, h, t, d)
    for causal, divisor in ((False, 1), (True, 2)):
        costs = ops_of(Attention(causal), (x,), lambda m, batch: m(batch[0]).sum())
        attention = [(o.phase, o.flops) for o in costs.ops if o.op_class == "attention"]
        assert attention == [("forward", 2 * 2 * b * h * t * t * d // divisor),
                             ("backward", 5 * 2 * b * h * t * t * d // divisor)]
        q_k_v_out = F32 * 4 * b * h * t * d
        forward = next(o for o in costs.ops if o.op_class == "attention")
        assert forward.bytes == q_k_v_out + F32 * b * h * t  # + the log-sum-exp per query row


def test_convolution():
    # Conv2d 3 -> 8, 3x3, padding 1 on (2, 3, 16, 16): 2 x (2 x 8 x 16 x 16 outputs) x (3 x 3 x 3) FLOPs.
    model = nn.Conv2d(3, 8, 3, padding=1)
    costs = ops_of(model, (torch.randn(2, 3, 16, 16),), lambda m, b: m(b[0]).sum())
    conv = [o for o in costs.ops if o.phase == "forward" and o.op_class == "matmul"]
    assert [(o.flops, o.dtype, o.convolution) for o in conv] == [(2 * (2 * 8 * 16 * 16) * (3 * 3 * 3), "tf32", True)]
    assert conv[0].bytes == F32 * (2 * 3 * 16 * 16 + 8 * 3 * 3 * 3 + 8 + 2 * 8 * 16 * 16)
    backward = [o for o in costs.ops if o.phase == "backward" and o.op_class == "matmul"]
    # the weight gradient only (the input needs none): as many FLOPs as the forward
    assert [o.flops for o in backward] == [2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)]


def test_layer_norm_is_a_reduction_over_its_inputs():
    # native_layer_norm reads x (8, 64), weight and bias (64 each); writes y (8, 64), mean and rstd (8 each).
    model = nn.LayerNorm(64)
    costs = ops_of(model, (torch.randn(8, 64),), lambda m, b: m(b[0]).sum())
    norm = [o for o in costs.ops if o.phase == "forward" and o.op_class == "reduction" and o.flops == 8 * 64 + 2 * 64]
    assert len(norm) == 1
    assert norm[0].bytes == F32 * (8 * 64 + 2 * 64 + 8 * 64 + 8 + 8)


def test_checkpointed_blocks_recompute_their_forward_in_backward():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(32, 32)

        def forward(self, x):
            return torch.relu(self.linear(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks, self.head = nn.ModuleList([Block(), Block()]), nn.Linear(32, 4)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    model = Net()
    batch = (torch.randn(16, 32),)
    plain = ops_of(model, batch, lambda m, b: m(b[0]).sum())
    ckpt = ops_of(model, batch, lambda m, b: m(b[0]).sum(), checkpointing=True)
    in_block = [o for o in plain.ops if o.phase == "forward" and o.in_block]
    assert {o.op_class for o in in_block} == {"matmul", "elementwise"}
    assert plain.flops("recompute") == 0
    # the recompute is each block's forward again: its matmul FLOPs exactly
    assert ckpt.flops("recompute", classes=("matmul",)) == 2 * (2 * 16 * 32 * 32)
    assert ckpt.flops("forward") == plain.flops("forward")
    assert ckpt.flops("backward") == plain.flops("backward")


def test_optimizer_ops_are_counted_in_their_phase():
    model = nn.Linear(100, 10)
    est = estimate(model, (torch.randn(4, 100),), loss=lambda m, b: m(b[0]).sum(), optimizer="adamw")
    optimizer = [o for o in est.step_costs.ops if o.phase == "optimizer"]
    assert optimizer and all(o.op_class in ("elementwise", "reduction") for o in optimizer)
    # AdamW reads and writes at least the parameters, gradients and both moments once: 4 x 2 x 1010 x 4 bytes
    assert est.step_costs.bytes("optimizer") >= 4 * 2 * 1010 * F32
    summary = est.to_dict()["step_costs"]
    assert summary["optimizer"]["bytes"] == est.step_costs.bytes("optimizer") and summary["recompute"]["ops"] == 0


def test_a_matmul_records_its_alignment_in_elements():
    # A language model's head over a vocabulary of 50257 (GPT-2's, odd): the logits' rows are 50257 elements long,
    # so the forward GEMM and both backward ones have a dimension with no power of two in it; a 64 -> 32 layer
    # is aligned to the 16 elements the record tops out at, a 64 -> 20 one to 4 (20 = 4 x 5).
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 20, bias=False), nn.Linear(20, 50257, bias=False))
    x = torch.randn(8, 64, requires_grad=True)
    costs = ops_of(model, (x,), lambda m, b: m(b[0]).float().sum(), device="A100-80GB", precision="bf16-mixed")
    matmuls = [o for o in costs.ops if o.op_class == "matmul"]
    forward = [o.align for o in matmuls if o.phase == "forward"]
    assert forward == [16, 4, 1]
    backward = sorted(o.align for o in matmuls if o.phase == "backward")  # two GEMMs per layer
    assert backward == [1, 1, 4, 4, 16, 16]
    assert all(o.align == 16 for o in costs.ops if o.op_class != "matmul")
