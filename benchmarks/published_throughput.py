"""The step-time model (memplan/planner/costs.py) against training throughput others have published.

Each figure below is a published measurement whose conditions are stated (model, sequence, micro-batch,
accumulation, GPUs, precision, sharding, activation checkpointing), with its source and the quoted row.
For each, the benchmark builds the model's architecture on the meta device (a plain decoder: the
published model's width, depth, heads, FFN and vocabulary; the parameter count is checked against the
published one where the source gives it), traces one steady-state step with memplan.estimate at
micro-batch 1 and 2 (bf16-mixed, on the catalog's GPU), and predicts tokens/s per GPU with
memplan.planner.predict_step, exactly as the planner ranks candidates.

Checkpointing the planner cannot express yet is predicted from what it can: torchtitan's selective
*layer* AC (every other block) as the mean of the step with and without full checkpointing, its selective
*op* AC (save matmul and attention outputs, recompute the rest, except every second matmul: torchtitan's
`_save_list` policy) by recomputing the in-block elementwise and reduction ops and half the in-block matmuls.

    .venv/bin/python -m benchmarks.published_throughput [--only NAME ...]

writes benchmarks/results/published_throughput.{json,md}: each figure, the prediction, the relative error,
and the median and worst. Traces run on CPU (fake tensors); nothing here needs a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.results_io import machine, write_results

TORCHTITAN_A100 = ("https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/"
                   "docs/performance.md")
TORCHTITAN_H100 = ("https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/"
                   "benchmarks/llama3_h100_202412_torchtitan.md")
LLM_FOUNDRY = ("https://github.com/mosaicml/llm-foundry/blob/061f2c7ce64e655100286584a7629e2a09f827ba/"
               "scripts/train/benchmarking/README.md")
TORCHTITAN_PRECISION = ("torchtitan's job config: mixed_precision_param = 'bfloat16', mixed_precision_reduce = "
                        "'float32' (FSDP2 gathers bf16 parameters, reduces fp32 gradients)")
TORCHTITAN_8B_CONFIG = ("torchtitan/models/llama/train_configs/llama3_8b.toml at 08a5a9f (seq_len = 8192, "
                        "selective_ac_option = 'op', AdamW)")


@dataclass(frozen=True, kw_only=True)
class Arch:
    """A decoder-only transformer, as the sources describe it."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool
    """SwiGLU MLP and RMSNorm (Llama); else GELU MLP and LayerNorm with learned positions (MPT as benchmarked)."""
    tied: bool = False
    source: str = ""


def llama_ffn(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan's FeedForward hidden size: 2/3 x 4 x dim, times the multiplier, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


_TT = "torchtitan/models/llama/__init__.py (llama3_configs, llama2_configs); vocab 128256 (Llama 3), 32000 (Llama 2)"
ARCHS = {
    "llama3-8b": Arch(dim=4096, layers=32, heads=32, kv_heads=8, ffn=llama_ffn(4096, 1.3, 1024), vocab=128256,
                      gated=True, source=_TT),
    "llama3-70b": Arch(dim=8192, layers=80, heads=64, kv_heads=8, ffn=llama_ffn(8192, 1.3, 4096), vocab=128256,
                       gated=True, source=_TT),
    "llama2-13b": Arch(dim=5120, layers=40, heads=40, kv_heads=40, ffn=llama_ffn(5120, None, 256), vocab=32000,
                       gated=True, source=_TT),
    "llama2-70b": Arch(dim=8192, layers=80, heads=64, kv_heads=8, ffn=llama_ffn(8192, 1.3, 4096), vocab=32000,
                       gated=True, source=_TT),
    # MPT as llm-foundry benchmarks it: d_model / n_layers / n_heads, expansion ratio 4, vocabulary 50368, tied
    # embeddings, learned positions: memplan's reading of the family, checked against the table's NumParams column.
    "mpt-760m": Arch(dim=1536, layers=24, heads=12, kv_heads=12, ffn=4 * 1536, vocab=50368, gated=False, tied=True),
    "mpt-1b": Arch(dim=2048, layers=24, heads=16, kv_heads=16, ffn=4 * 2048, vocab=50368, gated=False, tied=True),
    "mpt-3b": Arch(dim=2560, layers=32, heads=20, kv_heads=20, ffn=4 * 2560, vocab=50368, gated=False, tied=True),
    "mpt-7b": Arch(dim=4096, layers=32, heads=32, kv_heads=32, ffn=4 * 4096, vocab=50368, gated=False, tied=True),
    "mpt-13b": Arch(dim=5120, layers=40, heads=40, kv_heads=40, ffn=4 * 5120, vocab=50368, gated=False, tied=True),
    "mpt-30b": Arch(dim=7168, layers=48, heads=56, kv_heads=56, ffn=4 * 7168, vocab=50368, gated=False, tied=True),
    "mpt-70b": Arch(dim=8192, layers=80, heads=64, kv_heads=64, ffn=4 * 8192, vocab=50368, gated=False, tied=True),
}


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One published throughput measurement and its conditions."""

    name: str
    arch: str
    seq: int
    micro: int
    accumulation: int
    gpus: int
    gpus_per_node: int
    gpu: str
    """memplan catalog name of the GPU the source used (or the closest catalogued board: see `note`)."""
    checkpointing: str
    """'none', 'full', 'selective-layer' (every other block) or 'selective-op' (torchtitan's op policy)."""
    tokens_per_s_per_gpu: float
    source: str
    quote: str
    published_params: int | None = None
    gather_bytes: int = 4
    """Bytes per parameter of FSDP's all-gathers: 2 where the source gathers bf16 parameters."""
    note: str = ""


FIGURES = (
    # torchtitan, 64 x A100 80GB, FSDP2, bf16 mixed precision (docs/performance.md).
    Figure(name="tt-llama3-8b-a100-sel-layer", arch="llama3-8b", seq=8192, micro=1, accumulation=1, gpus=64,
           gpus_per_node=8, gpu="A100-80GB", checkpointing="selective-layer", tokens_per_s_per_gpu=2904,
           source=TORCHTITAN_A100, gather_bytes=2, quote="| 8B | 1 | selective layer | 2904 | 56.8% |",
           note=f"Llama 3 on 64 A100 (80GB) with FSDP2; sequence from {TORCHTITAN_8B_CONFIG}"),
    Figure(name="tt-llama3-8b-a100-sel-op", arch="llama3-8b", seq=8192, micro=1, accumulation=1, gpus=64,
           gpus_per_node=8, gpu="A100-80GB", checkpointing="selective-op", tokens_per_s_per_gpu=2973,
           source=TORCHTITAN_A100, gather_bytes=2, quote="| 8B | 1 | selective op | 2973 | 58.2% |",
           note=f"sequence from {TORCHTITAN_8B_CONFIG}"),
    Figure(name="tt-llama3-70b-a100-full", arch="llama3-70b", seq=8192, micro=1, accumulation=1, gpus=64,
           gpus_per_node=8, gpu="A100-80GB", checkpointing="full", tokens_per_s_per_gpu=331,
           source=TORCHTITAN_A100, gather_bytes=2, quote="| 70B | 1 | full | 331 | 51.7% |"),
    Figure(name="tt-llama2-13b-a100-none", arch="llama2-13b", seq=4096, micro=2, accumulation=1, gpus=64,
           gpus_per_node=8, gpu="A100-80GB", checkpointing="none", tokens_per_s_per_gpu=2162,
           source=TORCHTITAN_A100, gather_bytes=2, quote="| 13B | 2 | no | 2162 | 61.1%\t|",
           note="'the default sequence length in Llama 2 is 4096' (same page)"),
    Figure(name="tt-llama2-13b-a100-sel-layer", arch="llama2-13b", seq=4096, micro=2, accumulation=1, gpus=64,
           gpus_per_node=8, gpu="A100-80GB", checkpointing="selective-layer", tokens_per_s_per_gpu=1914,
           source=TORCHTITAN_A100, gather_bytes=2, quote="| 13B | 2 | selective layer | 1914 | 54.1% |"),
    Figure(name="tt-llama2-13b-a100-sel-op", arch="llama2-13b", seq=4096, micro=2, accumulation=1, gpus=64,
           gpus_per_node=8, gpu="A100-80GB", checkpointing="selective-op", tokens_per_s_per_gpu=1904,
           source=TORCHTITAN_A100, gather_bytes=2, quote="| 13B | 2 | selective op | 1904 | 53.8% |"),
    Figure(name="tt-llama2-70b-a100-sel-op", arch="llama2-70b", seq=4096, micro=1, accumulation=1, gpus=64,
           gpus_per_node=8, gpu="A100-80GB", checkpointing="selective-op", tokens_per_s_per_gpu=355,
           source=TORCHTITAN_A100, gather_bytes=2, quote="| 70B | 1[^1] | selective op | 355 | 50.8% |"),
    Figure(name="tt-llama2-70b-a100-full", arch="llama2-70b", seq=4096, micro=2, accumulation=1, gpus=64,
           gpus_per_node=8, gpu="A100-80GB", checkpointing="full", tokens_per_s_per_gpu=353,
           source=TORCHTITAN_A100, gather_bytes=2, quote="| 70B | 2 | full | 353 | 50.5% |"),
    # torchtitan, H100 (Grand Teton: 96GB HBM2e, 2.4 TB/s, 500 W power limit), FSDP, no compile, no Float8.
    Figure(name="tt-llama3.1-8b-h100x8", arch="llama3-8b", seq=8192, micro=2, accumulation=1, gpus=8, gpus_per_node=8,
           gpu="H100-80GB", checkpointing="selective-op", tokens_per_s_per_gpu=5762, source=TORCHTITAN_H100, gather_bytes=2,
           quote="Table 1 ... Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. Selective "
                 "activation checkpointing. | FSDP | 5,762 | 82.4 |",
           note="their H100s are 96GB HBM2e at 2.4 TB/s and 500 W; the catalog's H100-80GB is the 700 W SXM "
                f"(3.35 TB/s); sequence and AC option from {TORCHTITAN_8B_CONFIG}"),
    Figure(name="tt-llama3.1-8b-h100x128", arch="llama3-8b", seq=8192, micro=2, accumulation=1, gpus=128,
           gpus_per_node=8, gpu="H100-80GB", checkpointing="selective-op", tokens_per_s_per_gpu=5605,
           source=TORCHTITAN_H100, gather_bytes=2,
           quote="Table 3 ... Llama 3.1 8B model. 128 GPUs. Local batch size 2, global batch size 256. Selective "
                 "activation checkpointing. | FSDP | 5,605 | 67.0 |",
           note="as the 8-GPU row; 400 Gb/s RDMA per GPU between hosts"),
    # llm-foundry (MosaicML), MPT on H100 80GB, amp_bf16, FSDP FULL_SHARD.
    Figure(name="mpt-760m-h100-s2048", arch="mpt-760m", seq=2048, micro=24, accumulation=2, gpus=8, gpus_per_node=8,
           gpu="H100-80GB", checkpointing="none", tokens_per_s_per_gpu=63147, source=LLM_FOUNDRY,
           published_params=760470528,
           quote="|  760m | 2048 | 8 | h100_80gb | 34.9 | 34.9 |  3.453389E+14 | 24 | 2 | 384 | 246 | 505177 | 63147 "
                 "| 786432 | amp_bf16 | DEFAULT | FULL_SHARD | False | False | 760470528 |"),
    Figure(name="mpt-1b-h100-s2048", arch="mpt-1b", seq=2048, micro=14, accumulation=1, gpus=8, gpus_per_node=8,
           gpu="H100-80GB", checkpointing="none", tokens_per_s_per_gpu=45455, source=LLM_FOUNDRY,
           published_params=1315950592,
           quote="|  1b | 2048 | 8 | h100_80gb | 41.82 | 41.82 |  4.138134E+14 | 14 | 1 | 112 | 177 | 363645 | 45455 "
                 "| 229376 | amp_bf16 | DEFAULT | FULL_SHARD | False | False | 1315950592 |"),
    Figure(name="mpt-3b-h100-s8192", arch="mpt-3b", seq=8192, micro=3, accumulation=6, gpus=8, gpus_per_node=8,
           gpu="H100-80GB", checkpointing="none", tokens_per_s_per_gpu=16578, source=LLM_FOUNDRY,
           published_params=2667566080,
           quote="|  3b | 8192 | 8 | h100_80gb | 40.31 | 40.31 |  3.988482E+14 | 3 | 6 | 144 | 16 | 132626 | 16578 "
                 "| 1179648 | amp_bf16 | DEFAULT | FULL_SHARD | False | False | 2667566080 |"),
    Figure(name="mpt-7b-h100-s2048", arch="mpt-7b", seq=2048, micro=6, accumulation=1, gpus=8, gpus_per_node=8,
           gpu="H100-80GB", checkpointing="none", tokens_per_s_per_gpu=10643, source=LLM_FOUNDRY,
           published_params=6658859008,
           quote="|  7b | 2048 | 8 | h100_80gb | 46.44 | 46.44 |  4.595096E+14 | 6 | 1 | 48 | 41 | 85144 | 10643 "
                 "| 98304 | amp_bf16 | DEFAULT | FULL_SHARD | False | False | 6658859008 |"),
    Figure(name="mpt-7b-h100-s4096-ckpt", arch="mpt-7b", seq=4096, micro=16, accumulation=2, gpus=8, gpus_per_node=8,
           gpu="H100-80GB", checkpointing="full", tokens_per_s_per_gpu=8611, source=LLM_FOUNDRY,
           published_params=6667247616,
           quote="|  7b | 4096 | 8 | h100_80gb | 40.42 | 53.9 |  3.999793E+14 | 16 | 2 | 256 | 16 | 68893 | 8611 "
                 "| 1048576 | amp_bf16 | DEFAULT | FULL_SHARD | True | False | 6667247616 |"),
    Figure(name="mpt-13b-h100-s2048", arch="mpt-13b", seq=2048, micro=2, accumulation=1, gpus=8, gpus_per_node=8,
           gpu="H100-80GB", checkpointing="none", tokens_per_s_per_gpu=4792, source=LLM_FOUNDRY,
           published_params=12853954560,
           quote="|  13b | 2048 | 8 | h100_80gb | 39.79 | 39.79 |  3.937055E+14 | 2 | 1 | 16 | 18 | 38336 | 4792 "
                 "| 32768 | amp_bf16 | DEFAULT | FULL_SHARD | False | False | 12853954560 |"),
    Figure(name="mpt-30b-h100-s2048-ckpt", arch="mpt-30b", seq=2048, micro=3, accumulation=21, gpus=8,
           gpus_per_node=8, gpu="H100-80GB", checkpointing="full", tokens_per_s_per_gpu=2002, source=LLM_FOUNDRY,
           published_params=29975214080,
           quote="|  30b | 2048 | 8 | h100_80gb | 38.11 | 50.82 |  3.771361E+14 | 3 | 21 | 504 | 7 | 16022 | 2002 "
                 "| 1032192 | amp_bf16 | DEFAULT | FULL_SHARD | True | False | 29975214080 |"),
    Figure(name="mpt-70b-h100x64-s2048-ckpt", arch="mpt-70b", seq=2048, micro=8, accumulation=4, gpus=64,
           gpus_per_node=8, gpu="H100-80GB", checkpointing="full", tokens_per_s_per_gpu=1039, source=LLM_FOUNDRY,
           published_params=64862437376,
           quote="|  70b | 2048 | 64 | h100_80gb | 42.57 | 56.76 |  4.212583E+14 | 8 | 4 | 2048 | 32 | 66523 | 1039 "
                 "| 4194304 | amp_bf16 | DEFAULT | FULL_SHARD | True | False | 64862437376 |"),
)


# --- the model -----------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        norm = (lambda: nn.RMSNorm(a.dim)) if a.gated else (lambda: nn.LayerNorm(a.dim))
        self.norm1, self.norm2 = norm(), norm()
        self.heads, self.kv_heads, self.head_dim = a.heads, a.kv_heads, a.dim // a.heads
        self.q = nn.Linear(a.dim, a.dim, bias=False)
        self.kv = nn.Linear(a.dim, 2 * a.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(a.dim, a.dim, bias=False)
        self.gated = a.gated
        self.up = nn.Linear(a.dim, (2 if a.gated else 1) * a.ffn, bias=False)
        self.down = nn.Linear(a.ffn, a.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, d))
        h = self.up(self.norm2(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + self.down(h)


class Decoder(nn.Module):
    def __init__(self, a: Arch, seq: int):
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.positions = None if a.gated else nn.Embedding(seq, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = nn.RMSNorm(a.dim) if a.gated else nn.LayerNorm(a.dim)
        self.head = None if a.tied else nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.positions is not None:
            x = x + self.positions.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return x @ self.embed.weight.t() if self.head is None else self.head(x)


def loss(model, batch):
    tokens, = batch
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


# --- prediction ----------------------------------------------------------------------------------
def profile_for(arch: Arch, seq: int, gpu: str):
    """The planner's cost profile of the model: traces at micro-batch 1 and 2, bf16-mixed, one GPU."""
    from memplan.estimator import estimate
    from memplan.planner.profile import CostProfile

    with torch.device("meta"):
        model = Decoder(arch, seq)
    params = sum(p.numel() for p in model.parameters())
    traces = {}
    for micro in (1, 2):
        batch = (torch.randint(0, arch.vocab, (micro, seq)),)
        traces[micro] = estimate(model, batch, loss=loss, optimizer="adamw", precision="bf16-mixed", device=gpu)
    return CostProfile(traces[1].step_costs, high=traces[2].step_costs, high_micro=2, traced_amp=True,
                       parameter_count=params, tokens_per_sample=seq), params


class SelectiveOp:
    """torchtitan's op policy on top of a profile: in-block matmul outputs saved except every second one,
    attention outputs saved, the rest of the in-block forward recomputed."""

    def __init__(self, profile):
        self.profile, self.parameter_count, self.tokens_per_sample = profile, profile.parameter_count, profile.tokens_per_sample

    def ops(self, micro, *, amp, checkpointing):
        from memplan.planner.profile import ScaledOp

        plain = self.profile.ops(micro, amp=amp, checkpointing=False)
        full = self.profile.ops(micro, amp=amp, checkpointing=True)
        recompute = []
        for o in (o for o in full if o.phase == "recompute"):
            if o.op_class == "attention":
                continue
            count = o.count // 2 if o.op_class == "matmul" else o.count
            if count:
                recompute.append(dataclasses.replace(o, count=count) if isinstance(o, ScaledOp) else o)
        return plain + recompute


def predict(fig: Figure, profile) -> float:
    """Predicted tokens/s per GPU of a figure's setting."""
    from memplan.planner import StepSetting, predict_step

    setting = dict(precision="bf16-mixed", micro_batch_size=fig.micro, accumulate_grad_batches=fig.accumulation,
                   world_size=fig.gpus, gpus_per_node=fig.gpus_per_node, nodes=fig.gpus // fig.gpus_per_node,
                   sharding="FULL_SHARD", offload=False, gpu_name=fig.gpu, gather_bytes=fig.gather_bytes)
    if fig.checkpointing == "selective-layer":
        off = predict_step(profile, StepSetting(checkpointing=False, **setting)).step_seconds
        on = predict_step(profile, StepSetting(checkpointing=True, **setting)).step_seconds
        step = (off + on) / 2
    elif fig.checkpointing == "selective-op":
        step = predict_step(SelectiveOp(profile), StepSetting(checkpointing=False, **setting)).step_seconds
    else:
        step = predict_step(profile, StepSetting(checkpointing=fig.checkpointing == "full", **setting)).step_seconds
    return fig.micro * fig.accumulation * fig.seq / step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", help="figure names to run (prints, writes nothing)")
    args = parser.parse_args()
    figures = [f for f in FIGURES if not args.only or f.name in args.only]
    profiles: dict[tuple, tuple] = {}
    rows = []
    for fig in figures:
        key = (fig.arch, fig.seq, fig.gpu)
        started = time.perf_counter()
        if key not in profiles:
            profiles[key] = profile_for(ARCHS[fig.arch], fig.seq, fig.gpu)
        profile, params = profiles[key]
        predicted = predict(fig, profile)
        error = predicted / fig.tokens_per_s_per_gpu - 1
        rows.append({**dataclasses.asdict(fig), "arch_source": ARCHS[fig.arch].source, "params": params,
                     "params_vs_published": (params / fig.published_params - 1) if fig.published_params else None,
                     "predicted_tokens_per_s_per_gpu": predicted, "relative_error": error})
        print(f"{fig.name:32s} published {fig.tokens_per_s_per_gpu:8.0f}  predicted {predicted:8.0f}  {error:+.1%}"
              f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    errors = [abs(r["relative_error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["relative_error"]))
    summary = {"figures": len(rows), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
               "worst": worst["name"]}
    print(f"median |error| {summary['median_abs_error']:.1%}, worst {summary['worst_abs_error']:.1%} ({worst['name']})")
    if args.only:
        return 0
    from memplan.planner import costs

    constants = {"FLOP_EFFICIENCY": costs.FLOP_EFFICIENCY, "BANDWIDTH_EFFICIENCY": costs.BANDWIDTH_EFFICIENCY,
                 "MIN_KERNEL_SECONDS": costs.MIN_KERNEL_SECONDS, "HOST_SECONDS_PER_OP": costs.HOST_SECONDS_PER_OP,
                 "COMM_EFFICIENCY": costs.COMM_EFFICIENCY, "OVERLAP": costs.OVERLAP}
    write_results("published_throughput", {"summary": summary, "constants": constants, "machine": machine(),
                                           "figures": rows}, _markdown(rows, summary))
    return 0


def _markdown(rows: list[dict], summary: dict) -> str:
    lines = [
        "# The step-time model against published training throughput",
        "",
        "`.venv/bin/python -m benchmarks.published_throughput` (benchmarks/published_throughput.py: each figure's "
        "source, quoted row and conditions). Predicted: memplan.planner.predict_step on the costs of two CPU traces "
        "(fake tensors) of the model at micro-batch 1 and 2, bf16-mixed, FSDP FULL_SHARD over the stated GPUs.",
        "",
        f"**{summary['figures']} figures: median |error| {summary['median_abs_error']:.1%}, worst "
        f"{summary['worst_abs_error']:.1%} ({summary['worst']}).**",
        "",
        "| figure | model | seq | micro x accum | GPUs | checkpointing | published tok/s/GPU | predicted | error | params vs published |",
        "|---|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        pv = f"{r['params_vs_published']:+.2%}" if r["params_vs_published"] is not None else "-"
        lines.append(f"| {r['name']} | {r['arch']} | {r['seq']} | {r['micro']} x {r['accumulation']} | {r['gpus']} x "
                     f"{r['gpu']} | {r['checkpointing']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {r['relative_error']:+.1%} | {pv} |")
    lines += ["", "Where the model is furthest off (our reading, not measured):", "", WORST_WHY, "",
              "Conditions beyond the table:", ""]
    for r in rows:
        if r["note"]:
            lines.append(f"- {r['name']}: {r['note']}")
    lines += ["", "Model dimensions: " + _TT + "; MPT's (d_model, n_layers, n_heads, 4x MLP, 50368-token "
              "vocabulary, tied embeddings, learned positions) are memplan's reading of the MPT family, checked "
              "against the table's NumParams column (last column above: within 0.04 %).", "", "Sources:", ""]
    for source in dict.fromkeys(r["source"] for r in rows):
        lines.append(f"- {source}")
    lines.append("")
    return "\n".join(lines)


WORST_WHY = (
    "- torchtitan's H100 rows (+32 %, +37 %): their H100s are not the catalog's board. The source: \"Each H100 GPU "
    "is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth\", \"We used the default 500W power limit\", "
    "and \"the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value\". memplan "
    "predicts for the 700 W H100 SXM (3.35 TB/s, 989 dense bf16 TFLOP/s), so it overshoots these boards.\n"
    "- MPT-760m and MPT-3b on H100 (+26 %, +29 %): the narrowest models of the set (d_model 1536 and 2560). The "
    "model gives every matmul 70 % of the peak; narrow GEMMs on H100 reach less, an effect of matrix size that a "
    "per-class efficiency does not capture (the wider MPT-7b/13b/30b/70b rows are within 7 %).\n"
    "- The A100 rows are all slightly under (-2 % to -9 %): A100's large GEMMs run a little above the 70 % "
    "the model assumes for every GPU.")


if __name__ == "__main__":
    sys.exit(main())
