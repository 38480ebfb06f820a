"""torchtitan's published Llama 3.1 8B memory figures against memplan's estimate (issue 21 §2, issue 22 §3).

The source (torchtitan, benchmarks/llama3_h100_202412_torchtitan.md): Table 1, "1D Parallelism (FSDP). Llama 3.1
8B model. 8 GPUs. Local batch size 2, global batch size 16. Selective activation checkpointing." Row "| FSDP |
5,762 | 82.4 |" (TPS/GPU, Memory(GiB)); Table 3, the same on 128 GPUs (global batch 256): "| FSDP | 5,605 | 67.0 |".
torchtitan logs the memory as `torch.cuda.max_memory_reserved()` in GiB (torchtitan/metrics.py,
`max_reserved_gib`); the page takes the maximum over all GPUs.

The setting, from torchtitan at the commit the page names (9dec370, 2024-12-26):
- model: torchtitan/models/llama/model.py at that commit, rebuilt here on the meta device with its
  module structure and op order (separate wq / wk / wv / wo and w1 / w2 / w3 linears, RoPE through
  complex multiplication, `repeat_kv` before SDPA, torchtitan's RMSNorm); Llama 3.1 8B's sizes from
  torchtitan/models/llama/__init__.py (dim 4096, 32 layers, 32 heads, 8 KV heads, multiple_of 1024,
  ffn_dim_multiplier 1.3, vocabulary 128256, rope_theta 500000); `freqs_cis` for max_seq_len, which train.py
  sets to the sequence length. The blocks sit in an nn.ModuleList (torchtitan: an nn.ModuleDict keyed by
  layer id, the same modules).
- sequence 8192 (train_configs/llama3_8b.toml), local batch 2, 8 ranks (128 for Table 3), FSDP2 applied as
  torchtitan's parallelize_llama.py `apply_fsdp` does, through the model's configure_model (memplan's
  FsdpSettings(configure_model=True)): fully_shard on each block with reshard_after_forward=True except
  the last block (False: "FSDP would prefetch it immediately"), then on the root, whose parameters stay
  unsharded from forward to backward (torchtitan passes reshard_after_forward=True for the root, which the
  torch of that date ignored: FSDPState._lazy_init sets the root's post_forward_mesh_info to None; torch 2.13
  does the same when it is left unset, as here); MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32).
- activation checkpointing: selective, option 'op' (parallelize_llama.py `_save_list`: every
  second aten.mm recomputed, the rest of mm and the SDPA outputs kept): memplan's Checkpointing 'op'.
- the step as train.py runs it: `pred = model(input_ids)`, cross_entropy(pred.flatten(0, 1).float(), labels)
  with `pred` alive until `del pred` before backward; utils.clip_grad_norm_(max_norm 1.0, foreach=True) on
  the DTensor gradients (torch.nn.utils.get_total_norm + clip_grads_with_norm_) before the step; AdamW with
  foreach=True (torchtitan/optimizer.py: fused=False -> foreach); optimizers.zero_grad() before each forward:
  memplan's loop="torch" (zero_grad after the step, the same memory).
- the caching allocator: its default settings. torchtitan's run_llama_train.sh sets
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, but the page does not say how its runs were launched, and
  that script cannot have launched Table 3: it is single-node (`torchrun --nproc_per_node`, rendezvous on
  localhost), and the repository's multi-node launcher (multinode_trainer.slurm) sets no allocator
  configuration; nothing in torchtitan's Python sets one. Traced with the default allocator memplan is
  within 1 % of both published figures; with expandable segments it is under both by 2.5-4 % (the rows
  "expandable segments" below). So the default allocator is the setting compared; this is an inference
  from the two figures and the launchers, not a statement of the page. The other reading is not ruled out:
  the runs used expandable segments and memplan's model of them is about 3 GiB low here. This project has
  measured no expandable-segments case on a GPU (every GPU campaign ran with PYTORCH_CUDA_ALLOC_CONF unset;
  its FSDP2 case, one GPU, default allocator, is within 0.3 %: benchmarks/results/memory_gaps_gpu.md).

The caching allocator keeps each stream's freed blocks for that stream. FSDP2 all-gathers into buffers
it allocates on its all-gather copy-in stream and reduce-scatters into the sharded gradients, allocated
on its reduce-scatter stream; memplan keeps those pools apart (memplan.estimator.allocator). The row
"one pool" traces the same step with every block shared by all streams, the model before per-stream
pools, to show what the streams account for.

What was checked against the code of that date and found to change nothing here (the traced torch, 2.13,
behaves the same): FSDP2's stream layout (read in torch 2.6.0's source, branched from main shortly before
the run's nightly of 2024-12-23: the all-gather output and copy-in buffer on the copy-in stream, forward and
backward; the reduce-scatter input on the default stream; the reduce-scatter output, the sharded gradients,
on the reduce-scatter stream; one reduce-scatter input kept until the next reduce-scatter; the last
all-gather result freed by the root's post-forward); FSDP2's backward prefetch of one block; foreach AdamW's
one parameter-sized intermediate list;
no record_stream on any collective's tensors (torchtitan's init_distributed sets
TORCH_NCCL_AVOID_RECORD_STREAMS=1, and ProcessGroupNCCL drops the stashed tensors at `wait()`). Known
differences: the GPUs were 96 GB H100s (Grand Teton, HBM2e), traced here as the catalog's H100-80GB (sm90:
the same kernels and allocator; the budget is not used by an estimate); flash attention's backward scratch
(dq_accum, 256 MiB a call) is not traced (adding it moves nothing here); the embedding backward's
data-dependent partial sums are not traced.

    .venv/bin/python -m benchmarks.torchtitan_memory [--settings op op-expandable op-one-pool op-128 ...]

writes benchmarks/results/torchtitan_memory.{json,md}. Traces run on CPU fake tensors (no GPU).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.results_io import machine, write_results

SOURCE = ("https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/"
          "benchmarks/llama3_h100_202412_torchtitan.md")
QUOTE = ("**Table 1** 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. "
         "Selective activation checkpointing. | Techniques | TPS/GPU | Memory(GiB) | ... | FSDP | 5,762 | 82.4 |")
QUOTE_128 = ("**Table 3** 1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch size 2, global batch size "
             "256. Selective activation checkpointing. | Techniques | TPS/GPU | Memory(GiB) | ... | FSDP | 5,605 | 67.0 |")
PUBLISHED_GIB = {8: 82.4, 128: 67.0}
"""Published max_memory_reserved (GiB) by number of GPUs: Table 1 and Table 3."""
GOAL = 0.05
GiB = 1 << 30

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ, LOCAL_BATCH, WORLD = 4096, 32, 32, 8, 128256, 8192, 2, 8
FFN = 1024 * ((int(1.3 * int(2 * 4 * DIM / 3)) + 1023) // 1024)  # 14336
EXPANDABLE = "expandable_segments:True"
"""run_llama_train.sh's PYTORCH_CUDA_ALLOC_CONF (see the module docstring for why it is not the default here)."""


@dataclass(frozen=True)
class Setting:
    """One traced variant of the step."""

    checkpointing: str = "op"
    """memplan's checkpointing ('op' is torchtitan's)."""
    expandable: bool = False
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (run_llama_train.sh) instead of the default allocator."""
    one_pool: bool = False
    """Every allocation on the default stream's pool (memplan before per-stream pools)."""
    world: int = WORLD
    """Data-parallel ranks."""


SETTINGS = {
    "op": Setting(), "op-expandable": Setting(expandable=True), "op-one-pool": Setting(one_pool=True),
    "op-128": Setting(world=128), "op-128-expandable": Setting(world=128, expandable=True),
    "none": Setting(checkpointing="none"), "full": Setting(checkpointing="full"),
}
"""The rows, by the name --settings takes."""


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
        t = torch.arange(SEQ, device=freqs.device)  # max_seq_len = training.seq_len (train.py)
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

    def configure_model(self):
        """torchtitan's apply_fsdp (parallelize_llama.py, 2024-12) on memplan's fake mesh."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self._device_mesh["data_parallel"]  # set by memplan, as Lightning's ModelParallelStrategy does
        config = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32)}
        for layer_id, block in enumerate(self.layers):
            fully_shard(block, **config, reshard_after_forward=layer_id < len(self.layers) - 1)
        fully_shard(self, **config)  # the root: kept unsharded after forward, as torch did then


def loss(model, batch):
    """train.py's step: `pred` stays alive through the loss and is deleted before backward."""
    tokens, labels = batch
    pred = model(tokens)
    out = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
    del pred
    return out


class ClippedAdamW(torch.optim.AdamW):
    """AdamW whose step first clips the gradients as torchtitan's utils.clip_grad_norm_ does (train.py, before
    `optimizers.step()`): the total norm over the DTensor gradients with foreach, then an in-place scale."""

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            total_norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, total_norm, True)
        return super().step(closure)


def adamw(params):
    return ClippedAdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)


@contextlib.contextmanager
def one_pool():
    """Every allocation counted on the default stream: one pool for all streams (memplan before it kept
    the caching allocator's per-stream pools)."""
    import memplan.estimator.api as api

    class DefaultStreamOnly(api.StreamNumbers):
        def current(self) -> int:
            return 0

    original, api.StreamNumbers = api.StreamNumbers, DefaultStreamOnly
    try:
        yield
    finally:
        api.StreamNumbers = original


@contextlib.contextmanager
def allocator_settings(expandable: bool):
    """The caching allocator's settings for this trace only: expandable segments, or the defaults (neither
    PYTORCH_ALLOC_CONF nor PYTORCH_CUDA_ALLOC_CONF set)."""
    names = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    previous = {name: os.environ.pop(name, None) for name in names}
    if expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    try:
        yield
    finally:
        for name, value in previous.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def estimate(setting: str | Setting = "op"):
    """memplan's estimate of torchtitan's step under `setting` (a Setting, or its name in SETTINGS)."""
    from memplan.estimator import estimate as memplan_estimate
    from memplan.estimator.fsdp import FsdpSettings

    s = SETTINGS[setting] if isinstance(setting, str) else setting
    with torch.device("meta"):
        model = Transformer()
    batch = (torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ)), torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ)))
    with allocator_settings(s.expandable), one_pool() if s.one_pool else contextlib.nullcontext():
        return memplan_estimate(model, batch, loss=loss, optimizer=adamw, precision="32-true",
                                checkpointing=s.checkpointing, device="H100-80GB", strategy="fsdp",
                                world_size=s.world, loop="torch", fsdp=FsdpSettings(configure_model=True))


def run(name: str) -> dict:
    started = time.perf_counter()
    s = SETTINGS[name]
    est = estimate(s)
    return {"setting": name, "checkpointing": s.checkpointing, "gpus": s.world,
            "allocator": "expandable segments" if s.expandable else "default",
            "pools": "one pool" if s.one_pool else "per stream",
            "peak_reserved_bytes": est.peak_reserved, "peak_reserved_gib": round(est.peak_reserved / GiB, 2),
            "side_stream_reserved_gib": round(est.side_stream_reserved / GiB, 2),
            "peak_allocated_gib": round(est.peak_allocated / GiB, 2),
            "peak_phase": est.peak_phase, "parameters": est.num_parameters,
            "trace_seconds": round(time.perf_counter() - started, 1)}


def compare(rows: list[dict]) -> list[dict]:
    """Each published figure against the rows of its GPU count under torchtitan's 'op' policy, per stream."""
    out = []
    for gpus, published in PUBLISHED_GIB.items():
        for r in rows:
            if (r["gpus"], r["checkpointing"], r["pools"]) == (gpus, "op", "per stream"):
                error = r["peak_reserved_gib"] / published - 1
                out.append({"gpus": gpus, "allocator": r["allocator"], "published_gib": published,
                            "estimated_gib": r["peak_reserved_gib"], "relative_error": round(error, 4),
                            "goal": GOAL, "met": abs(error) <= GOAL})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="the variants to trace ('op': torchtitan's setting with the default allocator; "
                             "'-expandable': PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; '-one-pool': one "
                             "allocator pool for all streams; '-128': Table 3's 128 GPUs; 'none' / 'full' bracket it)")
    args = parser.parse_args()
    rows = []
    for name in args.settings:
        rows.append(run(name))
        print(rows[-1], flush=True)
    comparisons = compare(rows)
    default = [c for c in comparisons if c["allocator"] == "default"]
    summary = {"comparisons": comparisons}
    if default:
        primary = next((c for c in default if c["gpus"] == WORLD), default[0])
        summary.update({k: primary[k] for k in ("published_gib", "estimated_gib", "relative_error", "goal", "met")})
    lines = ["# torchtitan Llama 3.1 8B (H100, FSDP2, local batch 2, seq 8192, selective op AC): memory",
             "", f"Source: {SOURCE}", "", f"Quotes: {QUOTE}", "", QUOTE_128, "",
             "| setting | GPUs | allocator | memplan checkpointing | allocator pools | estimated max_memory_reserved "
             "(GiB) | of it, side streams (GiB) | peak allocated (GiB) | peak phase |",
             "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['setting']} | {r['gpus']} | {r['allocator']} | {r['checkpointing']} | {r['pools']} | "
              f"{r['peak_reserved_gib']} | {r['side_stream_reserved_gib']} | {r['peak_allocated_gib']} | "
              f"{r['peak_phase']} |" for r in rows]
    if comparisons:
        lines += ["", "| GPUs | allocator | published (GiB) | estimated (GiB) | error |", "| ---: | --- | ---: | ---: | ---: |"]
        lines += [f"| {c['gpus']} | {c['allocator']} | {c['published_gib']} | {c['estimated_gib']} | "
                  f"{c['relative_error']:+.1%} |" for c in comparisons]
    if default:
        lines += ["", f"Published {summary['published_gib']} GiB ({WORLD} GPUs); estimated {summary['estimated_gib']} "
                      f"GiB with the default allocator ({summary['relative_error']:+.1%}); goal within {GOAL:.0%}: "
                      f"{'met' if summary['met'] else 'not met'}. The module docstring says why the default allocator "
                      "is the setting compared (the page does not state it)."]
    lines += ["", "Traced on CPU fake tensors (no GPU); see the module docstring for the setting and the known "
                  "differences.", "", "    .venv/bin/python -m benchmarks.torchtitan_memory"]
    write_results("torchtitan_memory", {"machine": machine(), "source": SOURCE, "quote": QUOTE, "quote_128": QUOTE_128,
                                        "rows": rows, "summary": summary}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
