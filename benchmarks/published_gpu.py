"""memplan's estimates against GPU memory others measured and published (issue 22 §3).

Nobody here has run memplan on a GPU; these are the next best truth. Each figure below is a published
measurement with its source, the quoted line, the conditions the source states (model, batch, input size,
precision, optimizer, GPU, torch version, checkpointing, training loop) and the quantity it measured:

- `max_memory_reserved` (torch.cuda.max_memory_reserved): memplan's `peak_reserved`;
- `max_memory_allocated`: memplan's `peak_allocated`;
- `nvml_used` (NVML / nvidia-smi "used" of a device the process has to itself): memplan's `device_total`,
  the reserved peak plus the CUDA context memplan assumes (memplan/estimator/cuda/overheads.py) for the CUDA module
  loading of the run: the 2022 runs used CUDA 11.2, which has no lazy loading, so they are estimated
  with CUDA_MODULE_LOADING=EAGER.

Each step is rebuilt from what the source shows: the model from its code (torchvision's ViT-L/16 in
benchmarks/published_gpu_models.py, written out module for module since torchvision is not a dependency; BERT
from transformers' BertConfig; torchtitan's Llama 3.1 8B from benchmarks/torchtitan_memory.py), no weights, and
the training loop's order (Fabric's and Lightning's: zero_grad between forward and backward; the 2022
Trainer's: gradients zeroed in place and kept, `set_to_none=False` being torch 1.x's default; a plain
`torch.autocast` keeps its weight-cast cache).

memplan traces the torch it runs with. Where the published run's torch kept memory differently, the
benchmark reproduces that torch too (`memplan_published_torch`), from the torch source of the time:
- torch 2.1's flash attention (FlashAttention v1; attention.cu `_scaled_dot_product_flash_attention_cuda`
  at v2.1: `attention.view({batch_size, max_seqlen_batch_q, num_heads, head_dim}).transpose(1,2)`) returns
  its output as (batch, seq, heads, dim) whatever the input's layout, so nn.MultiheadAttention's
  `permute(2, 0, 1, 3).contiguous()` copies it and the out-projection saves the copy; since torch 2.2
  (FlashAttention-2, `empty_like(q)`) the output follows the query's layout and that copy is a view;
- foreach Adam before July 2023 (`denom = torch._foreach_add(exp_avg_sq_sqrt, eps)`: two parameter-sized
  intermediate lists; one since then: pytorch/pytorch#97712, 2023-07-12, "minimizing memory as much as I could
  in the Adam family. There is a minimum budget of 1 intermediate"): Adam2_0;
- torch 1.10's softmax backward took its input (`_softmax_backward_data(grad, result, dim, self)`), so
  softmax kept its input alive beside its output (torch 1.11 passes the dtype): torch_1_10_softmax.
Both columns are reported. The goal (issue 22: median <= 1 %, worst <= 3 %) counts figures measured with
torch >= 2.1 of a quantity memplan reports; older ones are reported beside it.

    .venv/bin/python -m benchmarks.published_gpu [--only NAME ...]

writes benchmarks/results/published_gpu.{json,md} (with --only: prints, writes nothing). Traces run on
CPU fake tensors; no figure here was measured by this project. The figures are in benchmarks.published_gpu_figures,
the ViT and the older-torch stand-ins in benchmarks.published_gpu_models; this module runs and reports them.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time
from dataclasses import asdict

from benchmarks.published_gpu_figures import (
    FIGURES,
    GB,
    HF_CONTEXT_MIB,
    HF_PAGE,
    QUANTITIES,
    RASBT,
    Figure,
    GiB,
    MiB,
)
from benchmarks.published_gpu_models import (  # noqa: F401 (tests/benchmarks imports them from here)
    Adam2_0,
    AdamW2022,
    VisionTransformer,
    torch_1_10_softmax,
    torch_2_1_flash_layout,
)
from benchmarks.results_io import machine, write_results

GOAL_MEDIAN, GOAL_WORST = 0.01, 0.03


def _differs_under_published_torch(fig: Figure) -> bool:
    """Figures whose published torch keeps memory differently from this torch in a way reproduced here: the
    June 2023 nightly's flash attention (16-bit) and foreach Adam (the ViT-L/16 runs), torch 1.10's softmax
    saving its input (the 2022 Trainer runs)."""
    return fig.name.startswith("vit-l16-") or fig.source == HF_PAGE


def run(fig: Figure) -> dict:
    started = time.perf_counter()
    field_name = QUANTITIES[fig.quantity]
    est = fig.estimate(False)
    row = {**{k: v for k, v in asdict(fig).items() if k != "estimate"},
           "memplan_bytes": getattr(est, field_name), "memplan_field": field_name, "peak_allocated": est.peak_allocated,
           "peak_reserved": est.peak_reserved, "device_total": est.device_total, "cuda_context": est.cuda_context,
           "peak_phase": est.peak_phase, "parameters": est.num_parameters}
    row["error"] = row["memplan_bytes"] / fig.published_bytes - 1
    again = fig.estimate(True) if _differs_under_published_torch(fig) else est
    row["memplan_published_torch_bytes"] = getattr(again, field_name)
    row["published_torch"] = {"peak_allocated": again.peak_allocated, "peak_reserved": again.peak_reserved,
                              "device_total": again.device_total, "peak_phase": again.peak_phase}
    row["error_published_torch"] = row["memplan_published_torch_bytes"] / fig.published_bytes - 1
    if fig.quantity == "nvml_used" and fig.source == HF_PAGE:
        # The same figure without the context: published used minus the page's own context reading, against
        # memplan's reserved peak (as published torch), so the context assumption and the step separate.
        ex_context = fig.published_bytes - HF_CONTEXT_MIB * MiB
        row["reserved_check"] = {"published_minus_page_context_bytes": ex_context,
                                 "memplan_reserved_bytes": again.peak_reserved,
                                 "error": again.peak_reserved / ex_context - 1}
    row["trace_seconds"] = round(time.perf_counter() - started, 1)
    return row


def summarize(rows: list[dict], key: str) -> dict:
    """Median and worst |error| over the goal's figures (torch >= 2.1) and over all of them."""
    def stats(subset: list[dict]) -> dict | None:
        if not subset:
            return None
        errors = [abs(r[key]) for r in subset]
        worst = max(subset, key=lambda r: abs(r[key]))
        return {"figures": len(subset), "median_abs_error": statistics.median(errors),
                "worst_abs_error": max(errors), "worst": worst["name"], "worst_error": worst[key]}

    goal = [r for r in rows if r["torch_at_least_2_1"]]
    out = {"goal_set": stats(goal), "all": stats(rows),
           "goal_set_single_gpu": stats([r for r in goal if "fsdp2" not in r["name"]])}
    if out["goal_set"] is not None:
        out["goal_set"]["met"] = (out["goal_set"]["median_abs_error"] <= GOAL_MEDIAN
                                  and out["goal_set"]["worst_abs_error"] <= GOAL_WORST)
    return out


def _fmt(nbytes: int, quantity: str, source: str) -> str:
    if source == HF_PAGE:
        return f"{nbytes / MiB:,.0f} MiB"
    if source.startswith(RASBT):
        return f"{nbytes / GB:.2f} GB"
    return f"{nbytes / GiB:.2f} GiB"


def _markdown(rows: list[dict], summary: dict) -> str:
    g, gp = summary["memplan"]["goal_set"], summary["memplan_published_torch"]["goal_set"]
    a, ap = summary["memplan"]["all"], summary["memplan_published_torch"]["all"]
    gs = summary["memplan_published_torch"]["goal_set_single_gpu"]
    lines = [
        "# memplan against GPU memory others published",
        "",
        "`.venv/bin/python -m benchmarks.published_gpu` (benchmarks/published_gpu.py: each figure's source, quote and "
        "conditions). Traced on CPU fake tensors; every GPU figure here is the source's, none was measured by this "
        "project. 'memplan' traces with this torch's kernels; 'as published torch' reproduces the published run's "
        "torch where it kept memory differently (torch 2.1's flash-attention output layout and the June 2023 "
        "foreach Adam for the ViT runs, torch 1.10's softmax for the 2022 Trainer runs; see the module docstring).",
        "",
        f"**Goal set (torch >= 2.1, a quantity memplan reports; {g['figures']} figures): memplan median |error| "
        f"{g['median_abs_error']:.2%}, worst {g['worst_error']:+.2%} ({g['worst']}); as published torch median "
        f"{gp['median_abs_error']:.2%}, worst {gp['worst_error']:+.2%} ({gp['worst']}). Goal: median <= 1 %, "
        "worst <= 3 %.**",
        "",
        f"Goal set without the FSDP2 figure (the one figure on several GPUs, whose launch environment is inferred), as "
        f"published torch: median {gs['median_abs_error']:.2%}, worst {gs['worst_error']:+.2%} ({gs['worst']}).",
        "",
        f"All {a['figures']} figures: memplan median {a['median_abs_error']:.2%}, worst {a['worst_error']:+.2%} "
        f"({a['worst']}); as published torch median {ap['median_abs_error']:.2%}, worst {ap['worst_error']:+.2%}.",
        "",
        "| figure | quantity | torch | published | memplan | error | as published torch | error |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        torch_v = ">= 2.1" if r["torch_at_least_2_1"] else "< 2.1"
        lines.append(f"| {r['name']} | {r['quantity']} | {torch_v} | "
                     f"{_fmt(r['published_bytes'], r['quantity'], r['source'])}"
                     f" | {_fmt(r['memplan_bytes'], r['quantity'], r['source'])} | {r['error']:+.2%} | "
                     f"{_fmt(r['memplan_published_torch_bytes'], r['quantity'], r['source'])} | "
                     f"{r['error_published_torch']:+.2%} |")
    checks = [r for r in rows if "reserved_check" in r]
    if checks:
        lines += ["", f"The 2022 Trainer figures without the CUDA context (published NVML used - the page's own "
                      f"{HF_CONTEXT_MIB} MiB context reading, against memplan's peak_reserved as published torch):", ""]
        lines += [f"- {r['name']}: {r['reserved_check']['published_minus_page_context_bytes'] / MiB:,.0f} MiB vs "
                  f"{r['reserved_check']['memplan_reserved_bytes'] / MiB:,.0f} MiB "
                  f"({r['reserved_check']['error']:+.2%})"
                  for r in checks]
    lines += ["", "## Sources, quotes and conditions", ""]
    for r in rows:
        lines.append(f"- **{r['name']}** ({r['source']}): {r['quote']}. " +
                     "; ".join(f"{k}: {v}" for k, v in r["conditions"].items()) +
                     (f". {r['note']}" if r["note"] else "") + f". Peak phase: {r['peak_phase']}.")
    lines += ["", WHY, ""]
    return "\n".join(lines) + "\n"


WHY = """## Where the figures are off, and why (our reading)

- ViT-L/16 16-bit (16-mixed, bf16-true), this torch: torch 2.1's flash attention returned its output in (batch,
  seq, heads, dim) order, so nn.MultiheadAttention's `permute(2, 0, 1, 3).contiguous()` copied it and the
  out-projection saved the copy: one more (batch x 197 x 1024) 16-bit tensor per block than under torch >= 2.2,
  whose FlashAttention-2 output follows the query's layout (0.4 MB per sample per block, 9.7 MB per sample over
  24 blocks: most of the 12-23 MB per sample the 16-bit figures were under). fp32 takes memory-efficient
  attention, whose output was and is (batch, seq, heads, dim): no difference there.
- ViT-L/16 micro-batch 4 with accumulation, this torch: the peak is the optimizer step, where the June 2023
  nightly's foreach Adam held two parameter-sized intermediate lists (sqrt, then an out-of-place add of eps)
  and torch >= 2.1.0 one: 0.6 GB of bf16.
- ViT-L/16 16-bit, as published torch: a roughly constant 0.1-0.2 GB still under, not explained here;
  candidates: cuDNN's workspace for the 16 x 16 patch convolution (memplan does not model cuDNN workspaces),
  torch 2.1's flash-attention copies of q, k, v (forward) and of five tensors (backward), and the caching
  allocator's reuse of those blocks over a whole epoch (memplan models two steps).
- bert-large (2022, V100, NVML used): torch 1.10's softmax kept its input (one more 16 x 512 x 512 float32
  tensor per layer and sample: 0.4 GB per sample); the CUDA context under EAGER loading is memplan's
  assumption (1536 MiB) against the page's own reading (1343 MiB), +1.3 % of these figures. Gradient clipping
  (max_grad_norm 1.0) is not traced. Without the context (the list above) five of the seven are within
  0.6 %; fp16 at batch 4 (-3.5 %) and Adafactor + fp16 + checkpointing (-7.1 %) are still under, not
  explained here (torch 1.10's autocast and matmul paths were not reproduced op by op).
- torchtitan 8B (FSDP2): traced with run_llama_train.sh's expandable_segments:True the estimate was 3.6 % under
  (and 2.7 % under Table 3's 128-GPU figure); with the caching allocator's defaults it is within 0.1 % (and
  0.7 %). The page does not say how its runs were launched; run_llama_train.sh is single-node, so it cannot have
  launched Table 3, and torchtitan's multi-node launcher of that date sets no allocator configuration. The
  default allocator is the setting compared: an inference from the launchers and the two figures
  (benchmarks/torchtitan_memory.py's docstring), not the page's word. The other reading, that the runs used
  expandable segments and memplan's model of them is about 3 GiB low here, is not ruled out: no GPU run of this
  project has measured expandable segments.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", help="figure names to run (prints, writes nothing)")
    args = parser.parse_args()
    figures = [f for f in FIGURES if not args.only or f.name in args.only]
    rows = []
    for fig in figures:
        row = run(fig)
        rows.append(row)
        print(f"{fig.name:40s} {fig.quantity:20s} published {row['published_bytes'] / GiB:7.2f} GiB  memplan "
              f"{row['memplan_bytes'] / GiB:7.2f} ({row['error']:+.2%})  as published torch "
              f"{row['memplan_published_torch_bytes'] / GiB:7.2f} ({row['error_published_torch']:+.2%})  "
              f"[{row['trace_seconds']} s]", flush=True)
    summary = {"memplan": summarize(rows, "error"), "memplan_published_torch": summarize(rows, "error_published_torch"),
               "goal": {"median_abs_error": GOAL_MEDIAN, "worst_abs_error": GOAL_WORST}}
    print(summary)
    if args.only:
        return 0
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "summary": summary, "figures": rows}
    write_results("published_gpu", report, _markdown(rows, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
