"""benchmarks.published_gpu's models and older torch's memory behaviour: torchvision's ViT-L/16 module for module,
and stand-ins for what a published figure's torch kept that this torch does not (torch 2.1's flash attention
layout, torch 1.10's softmax backward, torch 2.0's foreach Adam, 2022's AdamW)."""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


# --- torchvision's ViT-L/16 (torchvision/models/vision_transformer.py), module for module ------------------
class _MLPBlock(nn.Sequential):
    def __init__(self, dim: int, mlp: int):
        super().__init__(nn.Linear(dim, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, dim), nn.Dropout(0.0))


class _EncoderBlock(nn.Module):
    def __init__(self, heads: int, dim: int, mlp: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _MLPBlock(dim, mlp)

    def forward(self, input):
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + input
        return x + self.mlp(self.ln_2(x))


class _Encoder(nn.Module):
    def __init__(self, seq: int, layers: int, heads: int, dim: int, mlp: int):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", _EncoderBlock(heads, dim, mlp))
                                                for i in range(layers)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, input):
        return self.ln(self.layers(self.dropout(input + self.pos_embedding)))


class VisionTransformer(nn.Module):
    """torchvision.models.vit_l_16 (patch 16, 24 layers, 16 heads, width 1024, MLP 4096, dropout 0), with the
    head replaced by Linear(1024, classes) as the scripts do."""

    def __init__(self, image: int = 224, patch: int = 16, layers: int = 24, heads: int = 16, dim: int = 1024,
                 mlp: int = 4096, classes: int = 10):
        super().__init__()
        self.patch, self.dim = patch, dim
        self.conv_proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = _Encoder((image // patch) ** 2 + 1, layers, heads, dim, mlp)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(dim, classes)))

    def forward(self, x):
        n, _, h, w = x.shape
        x = self.conv_proj(x).reshape(n, self.dim, (h // self.patch) * (w // self.patch)).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


@contextlib.contextmanager
def torch_2_1_flash_layout():
    """torch <= 2.1's flash attention output layout (see the module docstring): the 16-bit SDPA output is
    laid out (batch, seq, heads, dim) in memory, so the caller's permute + contiguous copies it."""
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, *args, **kwargs):
        out = original(query, key, value, *args, **kwargs)
        if query.dtype in (torch.float16, torch.bfloat16):
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return out

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class _SoftmaxSavingInput(torch.autograd.Function):
    """softmax as torch <= 1.10's autograd ran it: `_softmax_backward_data(grad, result, dim, self)` kept the
    input (under autocast: its float32 cast) alive beside the output; torch 1.11 passes the input's dtype."""

    @staticmethod
    def forward(ctx, x, dim):
        out = torch.softmax(x, dim)
        ctx.dim = dim
        ctx.save_for_backward(x.to(out.dtype), out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, ctx.dim, x.dtype), None


@contextlib.contextmanager
def torch_1_10_softmax():
    """F.softmax saving its input as torch 1.10 did (see _SoftmaxSavingInput)."""
    original = F.softmax

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        return _SoftmaxSavingInput.apply(x if dtype is None else x.to(dtype), dim)

    F.softmax = softmax
    try:
        yield
    finally:
        F.softmax = original


class Adam2_0(torch.optim.Optimizer):
    """torch.optim.Adam(foreach=True) as torch 2.0 and the nightlies before July 2023 ran it (`_multi_tensor_adam`):
    `exp_avg_sq_sqrt = torch._foreach_sqrt(...)` then `denom = torch._foreach_add(exp_avg_sq_sqrt, eps)`, two
    parameter-sized lists of intermediates alive at the update. The '[foreach] Minimize intermediates' changes of
    July 2023 (pytorch/pytorch#97712, #104898) made the add in place: one list, as torch 2.1.0 (and memplan's
    trace of this torch's Adam) has. Values are not what memplan estimates; only the tensors and when they live."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:  # torch's _init_group: the moments are made at the first step
                    self.state[p].update(step=0, exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                         exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                self.state[p]["step"] += 1
            grads = [p.grad for p in params]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            beta1, beta2 = group["betas"]
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            step_size = [-group["lr"] / (1 - beta1 ** n) for n in steps]
            exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(exp_avg_sq_sqrt, [(1 - beta2 ** n) ** 0.5 for n in steps])
            denom = torch._foreach_add(exp_avg_sq_sqrt, group["eps"])
            torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


class AdamW2022(torch.optim.Optimizer):
    """transformers.AdamW (optimization.py, v4.16, the Trainer's default 'adamw_hf' in 2022), parameter by
    parameter: `denom = exp_avg_sq.sqrt().add_(eps)`, one parameter's intermediate at a time."""

    def __init__(self, params, lr: float = 5e-5, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"] * (1.0 - beta2 ** state["step"]) ** 0.5 / (1.0 - beta1 ** state["step"])
                p.addcdiv_(exp_avg, denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])


def _meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()

