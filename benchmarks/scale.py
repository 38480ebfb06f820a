"""Scale: how long memplan takes, and how much host memory, to estimate models too big to run here.

    .venv/bin/python -m benchmarks.scale                 # writes benchmarks/results/scale.{json,md}
    .venv/bin/python -m benchmarks.scale --only llama2-7b-h100

Each scenario runs `memplan.estimate` in a fresh process and reports the trace's wall time and the
process's peak RSS (ru_maxrss: imports included; the RSS after imports is reported apart). Goals for
the Llama-2-7B-sized model: trace < 60 s, peak RSS < 2 GiB; for the Mixtral-8x7B-shaped MoE (both
experts paths, balanced routing assumed) and the Llama-2-70B-shaped dense model: < 30 s, < 1 GiB.
Timings depend on the machine's load: take them on a quiet machine.

The 7B model is never built in this process or any other outside memplan.estimate: its build callable
is handed to estimate(), which builds it under fake tensors (a real build would allocate 27 GB).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import resource
import sys
import time

from benchmarks.accuracy_cpu import _run_json
from benchmarks.results_io import machine, write_results
from benchmarks.zoo import Case
from benchmarks.zoo_models import _hf, causal_lm_batch, hf_loss

GiB = 1 << 30
MiB = 1 << 20
GOAL_TRACE_S = 60.0
GOAL_RSS_BYTES = 2 * GiB
LARGE_GOAL_TRACE_S = 30.0
LARGE_GOAL_RSS_BYTES = 1 * GiB
"""Goals for the 8x7B MoE and 70B dense shapes (issue 10)."""

LLAMA2_7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, max_position_embeddings=4096, use_cache=False,
)
LLAMA2_70B = dict(
    vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, max_position_embeddings=4096, use_cache=False,
)
MIXTRAL_8X7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096, use_cache=False,
)
GPT2_124M = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, use_cache=False)

_llama2_7b = Case(
    name="llama2-7b", family="llama2-7b",
    build=functools.partial(_hf, "LlamaForCausalLM", "LlamaConfig", **LLAMA2_7B),
    make_batch=functools.partial(causal_lm_batch, seq_len=4096, vocab=LLAMA2_7B["vocab_size"]),
    loss=hf_loss, batch_size=1, precision="bf16-mixed", checkpointing=True, optimizer="adamw",
)
_llama2_70b = Case(
    name="llama2-70b", family="llama2-70b",
    build=functools.partial(_hf, "LlamaForCausalLM", "LlamaConfig", **LLAMA2_70B),
    make_batch=functools.partial(causal_lm_batch, seq_len=4096, vocab=LLAMA2_70B["vocab_size"]),
    loss=hf_loss, batch_size=1, precision="bf16-mixed", checkpointing=True, optimizer="adamw",
)


def _mixtral(experts_implementation: str) -> Case:
    """Mixtral-8x7B's shape; experts_implementation picks transformers' experts path ("grouped_mm" is
    what transformers 5.x chooses by default where torch._grouped_mm dispatches)."""
    return Case(
        name=f"mixtral-8x7b-{experts_implementation}", family="mixtral-8x7b",
        build=functools.partial(_hf, "MixtralForCausalLM", "MixtralConfig", **MIXTRAL_8X7B,
                                experts_implementation=experts_implementation),
        make_batch=functools.partial(causal_lm_batch, seq_len=4096, vocab=MIXTRAL_8X7B["vocab_size"]),
        loss=hf_loss, batch_size=1, precision="bf16-mixed", checkpointing=True, optimizer="adamw",
    )


_gpt2_124m = Case(
    name="gpt2-124m", family="gpt2-124m",
    build=functools.partial(_hf, "GPT2LMHeadModel", "GPT2Config", **GPT2_124M),
    make_batch=functools.partial(causal_lm_batch, seq_len=1024, vocab=GPT2_124M["vocab_size"]),
    loss=hf_loss, batch_size=8, precision="32-true", optimizer="adamw",
)

SCENARIOS: dict[str, tuple[Case, str, dict]] = {
    "llama2-7b-cpu": (_llama2_7b, "cpu", {}),
    "llama2-7b-h100": (_llama2_7b, "H100-80GB", {}),
    "mixtral-8x7b-h100": (_mixtral("grouped_mm"), "H100-80GB", {}),
    "mixtral-8x7b-eager-h100": (_mixtral("eager"), "H100-80GB", {}),
    "llama2-70b-h100": (_llama2_70b, "H100-80GB", {}),
    "gpt2-124m-cpu": (_gpt2_124m, "cpu", {}),
    "gpt2-124m-h100-bf16mixed": (_gpt2_124m, "H100-80GB", {"precision": "bf16-mixed"}),
}
"""name -> (case, device, overrides of the case's settings)."""


def _rss_bytes() -> int:
    """Current resident set size, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def estimate_one(name: str) -> dict:
    """One scenario in this (fresh) process."""
    import torch

    from memplan.estimator import estimate

    case, device, overrides = SCENARIOS[name]
    torch.set_num_threads(2)
    batch = case.make_batch(case.batch_size)
    rss_before = _rss_bytes()
    cpu_started = time.process_time()
    started = time.perf_counter()
    result = estimate(
        case.build, batch, loss=case.loss, optimizer=case.optimizer,
        precision=overrides.get("precision", case.precision),
        checkpointing=overrides.get("checkpointing", case.checkpointing), device=device,
    )
    return {
        "scenario": name,
        "device": device,
        "estimate_wall_seconds": round(time.perf_counter() - started, 3),
        "estimate_cpu_seconds": round(time.process_time() - cpu_started, 3),
        "rss_after_imports_bytes": rss_before,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "estimate": result.to_dict(),
    }


def render_markdown(report: dict) -> str:
    lines = [
        "# memplan trace cost at scale",
        "",
        f"{report['date']} · torch {report['machine']['torch']} · {report['machine']['cpu']} "
        f"({report['machine']['cpu_count']} cores). Each scenario in a fresh process. MiB/GiB = 2^20/2^30 bytes.",
        f"Goals: Llama-2-7B trace < {GOAL_TRACE_S:.0f} s and peak RSS < {GOAL_RSS_BYTES / GiB:.0f} GiB; "
        f"Mixtral-8x7B and Llama-2-70B shapes < {LARGE_GOAL_TRACE_S:.0f} s and < {LARGE_GOAL_RSS_BYTES / GiB:.0f} GiB.",
        "",
        "CPU s: the process's CPU time during estimate() (all threads), less distorted than wall time by a "
        "loaded machine.",
        "",
        "| scenario | device | precision | ckpt | params | trace s | CPU s | process peak RSS MiB | RSS after imports MiB "
        "| estimated peak_allocated GiB | device_total GiB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        if "estimate" not in r:
            lines.append(f"| {r['scenario']} | failed: {r.get('error_message', '').splitlines()[-1:]} | | | | | | | | | |")
            continue
        e = r["estimate"]
        lines.append(
            f"| {r['scenario']} | {r['device']} | {e['precision']} | {e['checkpointing']} | {e['num_parameters']:,} "
            f"| {e['trace_seconds']:.1f} | {r.get('estimate_cpu_seconds', float('nan')):.1f} | {r['max_rss_bytes'] / MiB:,.0f} | {r['rss_after_imports_bytes'] / MiB:,.0f} "
            f"| {e['peak_allocated'] / GiB:.2f} | {e['device_total'] / GiB:.2f} |"
        )
    lines += ["", *(f"- {g}" for g in report["goals"])]
    return "\n".join(lines) + "\n"


def goals(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["scenario"].startswith("llama2-7b-"):
            goal_s, goal_rss = GOAL_TRACE_S, GOAL_RSS_BYTES
        elif r["scenario"].startswith(("mixtral-8x7b", "llama2-70b")):
            goal_s, goal_rss = LARGE_GOAL_TRACE_S, LARGE_GOAL_RSS_BYTES
        else:
            continue
        if "estimate" not in r:
            out.append(f"{r['scenario']}: failed: NOT met")
            continue
        t, rss = r["estimate"]["trace_seconds"], r["max_rss_bytes"]
        ok = t < goal_s and rss < goal_rss
        out.append(f"{r['scenario']}: trace {t:.1f} s (goal < {goal_s:.0f} s), peak RSS {rss / GiB:.2f} GiB "
                   f"(goal < {goal_rss / GiB:.0f} GiB): {'met' if ok else 'NOT met'}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), metavar="SCENARIO")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/ also with --only")
    parser.add_argument("--one", choices=sorted(SCENARIOS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        json.dump(estimate_one(args.one), sys.stdout)
        sys.stdout.write("\n")
        return 0
    rows = []
    for name in args.only or list(SCENARIOS):
        result, wall, error = _run_json(["benchmarks.scale", "--one", name])
        row = result or {"scenario": name, "error_message": error}
        row["process_seconds"] = round(wall, 2)
        rows.append(row)
        print(f"{name:28s} process {wall:6.1f} s  {'ok' if result else 'FAILED: ' + error}", flush=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "rows": rows,
        "goals": goals(rows),
    }
    markdown = render_markdown(report)
    print(markdown)
    if args.write or not args.only:
        write_results("scale", report, markdown, indent=1)
    return 0 if all("estimate" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
