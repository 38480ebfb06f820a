"""Which buffers CUDA's embedding backward allocates past 3072 indices, read with the allocator's history and C++
stacks.

Session 13's first H200 reading (benchmarks.gpu_rules) matched the two-pass rule (memplan/estimator/cuda/
embedding_scratch.py) within 14 B for 50257 and 32000 rows, but showed one more block of rows x dim x 4 B for 400
rows. This reads every block the op asks for, in order, with the C++ function that asked, over a grid of rows
around the index count. It showed that block to be the op's output (the harness had taken it for a temporary: its
address had been freed earlier) and the fused atomic path taken for few rows; the result is
benchmarks/results/gpu_rules_raw/embedding_paths_h200.json (recorded with a `kept` field, now dropped: it took
an address freed anywhere for a freed block, the fault benchmarks.gpu_rules had; the op's output is dropped at once
here in any case).

    python -m benchmarks.gpu_embedding_paths OUT.json        (on a CUDA machine; about a minute)
"""
from __future__ import annotations

import json
import sys

GRID = [(4096, rows, 256, "float32") for rows in (64, 400, 1000, 2000, 4095, 4096, 4097, 8192, 50257)] + [
    (4096, 400, 256, "bfloat16"), (4096, 50257, 256, "bfloat16"), (16384, 400, 256, "float32"),
    (4096, 400, 64, "float32"), (8192, 2000, 768, "float32")]
"""(index count, rows, dim, dtype)."""


def _frames(event: dict) -> list[str]:
    names = [f.get("name", "") for f in event.get("frames", [])]
    return [n for n in names if "at::native" in n or "embedding" in n.lower()][:6]


def read(tokens: int, rows: int, dim: int, dtype: str) -> dict:
    import torch

    indices = torch.randint(0, rows, (tokens,), device="cuda")
    grad = torch.randn(tokens, dim, device="cuda", dtype=getattr(torch, dtype))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all", max_entries=100_000)
    try:
        torch.ops.aten.embedding_dense_backward(grad, indices, rows, -1, False)
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    blocks = [{"size": e["size"], "frames": _frames(e)} for e in events if e["action"] == "alloc"]
    return {"tokens": tokens, "rows": rows, "dim": dim, "dtype": dtype, "before": before,
            "after": torch.cuda.memory_allocated(), "blocks": blocks}


def main(argv: list[str] | None = None) -> int:
    import torch

    out = (argv if argv is not None else sys.argv[1:])[0]
    result = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
              "rows": [], "errors": []}
    for spec in GRID:
        try:
            result["rows"].append(read(*spec))
        except Exception as err:  # one failed case is recorded; the others go on
            result["errors"].append({"case": list(spec), "error": f"{type(err).__name__}: {err}"})
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        row = result["rows"][-1] if result["rows"] and result["rows"][-1]["rows"] == spec[1] else None
        if row:
            print(spec, [(b["size"], b["frames"][:2]) for b in row["blocks"]], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
