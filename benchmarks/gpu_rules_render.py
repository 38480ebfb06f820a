"""benchmarks/gpu_rules.py's report as markdown (benchmarks/results/gpu_rules.md)."""
from __future__ import annotations


def render(result: dict) -> str:
    d = result["device"]
    lines = [
        "# CUDA op rules from source against a GPU's readings: cub sort storage, deterministic flash backward, "
        "embedding backward, index_put with accumulate",
        "",
        f"`python -m benchmarks.gpu_rules --report {result['source']}` (benchmarks/gpu_rules.py). Readings: "
        f"{d['name']} ({d['sm_count']} SMs, sm{d['compute_capability'][0]}{d['compute_capability'][1]}), torch "
        f"{d['torch']} (CUDA {d['cuda']}), one op at a time under a dispatch mode with the allocator's history on. "
        "'requested': the most bytes the op's temporaries (blocks allocated and freed inside it) asked for at once, "
        "against the rule's phases (memplan/estimator/cuda/op_scratch.py, index_scratch.py, cub_sort.py) re-computed "
        "on this tree for the same arguments and GPU. 'allocated': the GPU's peak inside the op minus the larger of "
        "before and after, against the rule block-rounded (512 B); where they differ the caching allocator gave a "
        "larger block (a large request rounded to 2 MiB, or a remainder of 1 MiB or less left unsplit), which "
        "memplan's allocator model adds when it estimates a step, not the rule (from the requested sizes on a fresh "
        "cache it gives the GPU's 41,943,040 for the [2000000] sort and 29,409,280 for the D=72 deterministic "
        "backward; the [127, 5000] sort's extra depends on the blocks earlier cases left cached). Where the GPU's "
        "is smaller (the fused embedding backwards) the op's largest phase came before its output was allocated: "
        "the peak minus what was allocated after the op undercounts it, and memplan counts the rule on top of the "
        "output (over by that much at such an op).",
        "",
        f"**requested bytes exact in {result['exact']} of {result['n']} ops.**",
        "",
        "| case | path | GPU requested | rule requested | GPU allocated | rule block-rounded |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        mark = "" if r["gpu_requested_peak"] == r["rule_requested_peak"] else " (differs)"
        lines.append(f"| {r['case']} | {r['path']} | {r['gpu_requested_peak']:,} | "
                     f"{r['rule_requested_peak']:,}{mark} | "
                     f"{r['gpu_transient']:,} | {r['rule_rounded']:,} |")
    for err in result["errors"]:
        lines.append(f"\nNot measured: {err['case']}: {err['error'].strip()}")
    return "\n".join(lines) + "\n"
