"""torchtitan's published Llama 3.1 8B memory figure against memplan's estimate (issue 21 §2).

The source (torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Table 1): "1D Parallelism (FSDP).
Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. Selective activation
checkpointing." Row "| FSDP | 5,762 | 82.4 |" (TPS/GPU, Memory(GiB)); torchtitan logs the memory as
`torch.cuda.max_memory_reserved()` in GiB (torchtitan/metrics.py, `max_reserved_gib`).

The setting, from torchtitan at the end of 2024 (the commit before the benchmark was published):
- model: torchtitan/models/llama/model.py at that commit, rebuilt here on the meta device with its
  module structure and op order (separate wq / wk / wv / wo and w1 / w2 / w3 linears, RoPE through
  complex multiplication, `repeat_kv` before SDPA, torchtitan's RMSNorm); Llama 3.1 8B's sizes from
  torchtitan/models/llama/__init__.py (dim 4096, 32 layers, 32 heads, 8 KV heads, multiple_of 1024,
  ffn_dim_multiplier 1.3, vocabulary 128256, rope_theta 500000). The blocks sit in an nn.ModuleList
  (torchtitan: an nn.ModuleDict keyed by layer id, the same modules).
- sequence 8192 (train_configs/llama3_8b.toml), local batch 2, 8 ranks, FSDP2 fully_shard on each
  block and the root, MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32).
- activation checkpointing: selective, option 'op' (parallelize_llama.py `_save_list`: every
  second aten.mm recomputed, the rest of mm and the SDPA outputs kept): memplan's Checkpointing 'op'.
- AdamW with foreach=True (torchtitan/optimizer.py: fused=False -> foreach), loss
  cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1)) (train.py).
- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (run_llama_train.sh).

Known differences: torchtitan keeps the last block unsharded after its forward
(reshard_after_forward=False for the last layer), memplan reshards every block (one block's bf16
parameters, 0.4 GiB, less); torchtitan clips gradients (max_norm 1.0: per-parameter norms, MiB);
the GPUs were 96 GB H100s (Grand Teton, HBM2e), traced here as the catalog's H100-80GB (sm90: the
same kernels and allocator; the budget is not used by an estimate).

    .venv/bin/python -m benchmarks.torchtitan_memory [--settings op none full]

writes benchmarks/results/torchtitan_memory.{json,md}. Traces run on CPU fake tensors (no GPU).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.results_io import machine, write_results

SOURCE = ("https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/"
          "benchmarks/llama3_h100_202412_torchtitan.md")
QUOTE = ("**Table 1** 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. "
         "Selective activation checkpointing. | Techniques | TPS/GPU | Memory(GiB) | ... | FSDP | 5,762 | 82.4 |")
PUBLISHED_GIB = 82.4
GOAL = 0.05
GiB = 1 << 30

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ, LOCAL_BATCH, WORLD = 4096, 32, 32, 8, 128256, 8192, 2, 8
FFN = 1024 * ((int(1.3 * int(2 * 4 * DIM / 3)) + 1023) // 1024)  # 14336


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk)


def repeat_kv(x, n_rep: int):
    bs, slen, n_kv, head_dim = x.shape
    return x.unsqueeze(3).expand(bs, slen, n_kv, n_rep, head_dim).reshape(bs, slen, n_kv * n_rep, head_dim)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)

    def attention(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = rotary(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, HEADS // KV_HEADS), repeat_kv(xv, HEADS // KV_HEADS)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        freqs = 1.0 / (500000.0 ** (torch.arange(0, DIM // HEADS, 2)[: DIM // HEADS // 2].float() / (DIM // HEADS)))
        t = torch.arange(SEQ * 2, device=freqs.device)
        angles = torch.outer(t, freqs).float()
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=True)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def loss(model, batch):
    tokens, labels = batch
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten(0, 1))


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)


def estimate(setting: str = "op"):
    """memplan's estimate of torchtitan's step with memplan checkpointing `setting` ('op' is torchtitan's)."""
    from memplan.estimator import estimate as memplan_estimate
    from memplan.estimator.fsdp import FsdpSettings

    with torch.device("meta"):
        model = Transformer()
    batch = (torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ)), torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ)))
    previous = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # run_llama_train.sh's, for this trace only
    try:
        return memplan_estimate(model, batch, loss=loss, optimizer=adamw, precision="32-true", checkpointing=setting,
                                device="H100-80GB", strategy="fsdp", world_size=WORLD,
                                fsdp=FsdpSettings(sharding_strategy="FULL_SHARD", param_dtype="bfloat16",
                                                  reduce_dtype="float32"))
    finally:
        if previous is None:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = previous


def run(setting: str) -> dict:
    started = time.perf_counter()
    est = estimate(setting)
    return {"checkpointing": setting, "peak_reserved_bytes": est.peak_reserved,
            "peak_reserved_gib": round(est.peak_reserved / GiB, 2), "peak_allocated_gib": round(est.peak_allocated / GiB, 2),
            "peak_phase": est.peak_phase, "parameters": est.num_parameters,
            "trace_seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["op", "none", "full"],
                        help="memplan checkpointing settings to trace ('op' is torchtitan's; the others bracket it)")
    args = parser.parse_args()
    rows = [run(s) for s in args.settings]
    for row in rows:
        print(row, flush=True)
    op = next((r for r in rows if r["checkpointing"] == "op"), None)
    summary = {}
    if op is not None:
        error = op["peak_reserved_gib"] / PUBLISHED_GIB - 1
        summary = {"published_gib": PUBLISHED_GIB, "estimated_gib": op["peak_reserved_gib"],
                   "relative_error": round(error, 4), "goal": GOAL, "met": abs(error) <= GOAL}
    lines = ["# torchtitan Llama 3.1 8B (8 x H100, FSDP2, local batch 2, seq 8192, selective op AC): memory",
             "", f"Source: {SOURCE}", "", f"Quote: {QUOTE}", "",
             "| memplan checkpointing | estimated max_memory_reserved (GiB) | peak allocated (GiB) | peak phase |",
             "| --- | ---: | ---: | --- |"]
    lines += [f"| {r['checkpointing']} | {r['peak_reserved_gib']} | {r['peak_allocated_gib']} | {r['peak_phase']} |"
              for r in rows]
    if summary:
        lines += ["", f"Published {PUBLISHED_GIB} GiB; estimated {summary['estimated_gib']} GiB "
                      f"({summary['relative_error']:+.1%}); goal within {GOAL:.0%}: {'met' if summary['met'] else 'not met'}."]
    lines += ["", "Traced on CPU fake tensors (no GPU); see the module docstring for the setting and the known "
                  "differences.", "", "    .venv/bin/python -m benchmarks.torchtitan_memory"]
    write_results("torchtitan_memory", {"machine": machine(), "source": SOURCE, "quote": QUOTE, "rows": rows,
                                        "summary": summary}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
