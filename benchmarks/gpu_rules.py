"""CUDA op rules written from source, read on a real GPU: cub's radix-sort storage (sort over 4096 along its dim),
flash attention's backward under deterministic algorithms, embedding's backward over 3072 indices and index_put's
sort over more than one cub tile (the last two read on the H200 in session 13), masked_scatter's prefix sums and its
backward's nonzero (cases written in session 14, no reading yet), and channels_last pooling backwards given an NCHW
gradient (benchmarks/gpu_rules_pools.py, session 15, no reading yet).

    python -m benchmarks.gpu_rules --out DIR [--cpu]      on the GPU: DIR/gpu_rules.json
    python -m benchmarks.gpu_rules --report RAW.json     here: benchmarks/results/gpu_rules.{json,md}

Each case runs the op for real on the GPU under a TorchDispatchMode that reads the caching allocator around every
aten op (as benchmarks.gpu_ops does): the op's transient is its peak minus the larger of what was allocated before
and after it (memory the kernel held only while it ran). For the same op memplan's rule
(memplan.estimator.cuda.op_scratch.cuda_op_scratch_bytes) is computed on meta copies of the op's real arguments,
for this GPU's compute capability and SM count, with deterministic algorithms as the case ran them. Two figures
per op: the most bytes its temporaries requested at once (the allocator's history: blocks allocated and freed inside
the op; the rule's phases unrounded), which is what a rule claims, and the allocated transient (block rounding and
blocks the allocator leaves unsplit included), which memplan's allocator model (estimator/allocator.py) adds.
`--report` re-computes the rule on this tree for each recorded op's arguments and renders the comparison.
`--cpu` checks the script on CPU with tiny sizes: no GPU figure, the readings are 0.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import traceback
from pathlib import Path

from benchmarks import gpu_rules_pools as pools

SORTS = (  # (shape, dtype, dim, stable, descending, the path the rule takes)
    ((8, 50257), "float32", -1, False, False, "segments < 128: by full sort"),
    ((1, 50257), "float32", -1, False, False, "one row"),
    ((65536,), "int64", -1, True, False, "one row"),
    ((127, 5000), "float32", -1, False, True, "segments < 128: by full sort"),
    ((128, 5000), "float32", -1, False, False, "segmented radix sort"),
    ((4096, 32000), "bfloat16", -1, False, True, "segmented radix sort"),
    ((256, 8192), "float16", -1, True, True, "segmented radix sort"),
    ((16384, 64), "float32", 0, False, False, "along dim 0: a contiguous copy, segments < 128"),
    ((2_000_000,), "float32", -1, False, False, "one row"),
)
FLASH = (  # (batch, heads, seq, head dim)
    (1, 32, 8192, 128),
    (2, 16, 4096, 128),
    (8, 12, 1024, 64),
    (1, 8, 1024, 64),
    (2, 12, 512, 72),
    (16, 16, 256, 64),
)
EMBEDDINGS = (  # (tokens, rows, dim, dtype, deterministic): the backward's sort and its two paths past 3072 indices
    (8192, 50257, 768, "float32", False),
    (16384, 32000, 1024, "bfloat16", False),
    (4096, 400, 256, "float32", False),  # two-pass: 809 partial segments, not over 4 x 400 blocks
    (4096, 64, 256, "float32", False),  # fused: 64 blocks, 473 partial segments
    (16384, 400, 256, "float32", False),  # fused
    (16384, 400, 256, "bfloat16", False),  # fused, into a float32 copy of the gradient
    (16384, 400, 256, "float32", True),  # deterministic algorithms: two-pass
)
INDEX_PUTS = (  # (self shape, index count): index_put_ with accumulate over more than one cub tile (no reading yet)
    ((1000, 64), 65536),
    ((50000,), 200000),
)
MASKED_SCATTERS = (  # (batch, seq, hidden, image tokens a row, spare feature rows, dtype): image features into token
    (8, 1024, 4096, 576, 0, "bfloat16"),  # embeddings, as LLaVA, under the ids' mask broadcast over the hidden dim
    (4, 2048, 2048, 256, 0, "float32"),
    (4, 2048, 2048, 256, 1024, "float32"),  # more features than image tokens: the backward pads with zeros and cats
)
CPU_SORTS = (((8, 5000), "float32", -1, False, False, "dry run"),)
RULED = ("aten.sort.", "_flash_attention_backward", "embedding_dense_backward", "index_put", "masked_scatter",
         "masked_select", *pools.RULED)


def _meta(value):
    import torch

    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def encode(value):
    """An op argument as JSON: a tensor as {"tensor": [shape, stride, dtype]}, containers item by item."""
    import torch

    if isinstance(value, torch.Tensor):
        layout = {"tensor": [list(value.shape), list(value.stride()), str(value.dtype).removeprefix("torch.")]}
        if value.dtype == torch.bool and value.device.type != "meta":  # a mask: its count decides some rules
            layout["nonzero"] = int(torch.count_nonzero(value))
        return layout
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    return repr(value)


def decode(value):
    """`encode`'s inverse, tensors as meta tensors of that layout."""
    import torch

    if isinstance(value, dict) and set(value) == {"tensor"}:
        shape, stride, dtype = value["tensor"]
        return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="meta")
    if isinstance(value, dict) and set(value) == {"tensor", "nonzero"}:  # a mask, real on the CPU with its count,
        shape, stride, _ = value["tensor"]  # its first elements set, in its recorded layout (broadcast dims too)
        base_shape = [size if step else 1 for size, step in zip(shape, stride)]
        flat = torch.zeros(math.prod(base_shape), dtype=torch.bool)
        flat[: value["nonzero"] * flat.numel() // max(1, math.prod(shape))] = True
        base = torch.empty_strided(base_shape, [step or 1 for step in stride], dtype=torch.bool)
        return base.copy_(flat.view(base_shape)).expand(shape)
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def rule(func, args, kwargs, gpu, deterministic) -> tuple[tuple, int]:
    """(phases, their block-rounded peak) memplan adds inside `func` on `gpu`: its op rule's (cuda/op_scratch.py) and
    the kernel's contiguous copies of its inputs as a phase of their own (kernels/scratch.py), as the trace does."""
    from memplan.estimator.cuda.op_scratch import cuda_op_scratch, rounded_peak
    from memplan.estimator.kernels.scratch import cuda_contiguous_copies
    copies = cuda_contiguous_copies(func, args)
    phases = cuda_op_scratch(func, args, kwargs, gpu, deterministic=deterministic) + ((copies,) if any(copies) else ())
    return phases, rounded_peak(phases)


def requested_peak(phases) -> int:
    """The most bytes a rule's buffers ask for at once (as requested: no block rounding)."""
    return max((sum(held) for held in phases), default=0)


def _temporaries(events: list[dict]) -> tuple[list[int], int]:
    """From the allocator's history inside one op: the sizes of the blocks allocated and freed inside it, in order,
    and the most bytes of them live at once (as requested). A block is a temporary when a free of its address
    follows its allocation: the caching allocator hands a freed block's address to a later request (the op's
    output may start where a temporary was), so an address freed earlier says nothing."""
    freed_after = set()
    for i, e in enumerate(events):
        if e["action"] == "free_requested":
            freed_after.update(j for j in range(i) if events[j]["action"] == "alloc" and events[j]["addr"] == e["addr"])
    sizes, live, peak, alive = [], 0, 0, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc" and i in freed_after:
            sizes.append(e["size"])
            alive[e["addr"]] = e["size"]
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_requested" and e["addr"] in alive:
            live -= alive.pop(e["addr"])
    return sizes, peak


def _reading_mode(cuda: bool, gpu):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from memplan.estimator.determinism import process_deterministic

    class Readings(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ruled = any(key in str(func) for key in RULED)
            if not (cuda and ruled):
                out = func(*args, **kwargs)
                if ruled:
                    self.rows.append(self._row(func, args, kwargs, 0, 0, 0, []))
                return out
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            try:
                out = func(*args, **kwargs)
                torch.cuda.synchronize()
                events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            self.rows.append(self._row(func, args, kwargs, before, peak, after, events))
            return out

        @staticmethod
        def _row(func, args, kwargs, before, peak, after, events) -> dict:
            deterministic = process_deterministic()  # what this process ran the op under
            phases, rounded = rule(func, decode(encode(args)), decode(encode(kwargs)), gpu, deterministic)
            sizes, requested = _temporaries(events)
            return {"op": str(func), "args": encode(args), "kwargs": encode(kwargs),
                    "before": before, "peak": peak, "after": after,
                    "gpu_transient": max(0, peak - max(before, after)),
                    "gpu_temporaries": sizes, "gpu_requested_peak": requested,
                    "rule_phases": [list(held) for held in phases], "rule_requested_peak": requested_peak(phases),
                    "rule": rounded}

    return Readings()


def _sort_case(spec, device: str, gpu, cuda: bool) -> list[dict]:
    import torch

    shape, dtype, dim, stable, descending, path = spec
    dt = getattr(torch, dtype)
    x = (torch.randint(0, 1 << 40, shape, device=device, dtype=dt) if not dt.is_floating_point
         else torch.randn(shape, device=device).to(dt))
    mode = _reading_mode(cuda, gpu)
    with mode:
        torch.sort(x, dim=dim, stable=stable, descending=descending)
    return [dict(row, case=f"sort {list(shape)} {dtype} dim={dim} stable={stable}", path=path)
            for row in mode.rows]


def _flash_case(spec, deterministic: bool, gpu) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads, seq, dim = spec
    q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn_like(out)
        mode = _reading_mode(True, gpu)
        with mode:
            out.backward(grad)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    splits = -(-gpu.sm_count // (batch * heads)) if deterministic else 1
    return [dict(row, case=f"flash backward B={batch} H={heads} S={seq} D={dim} deterministic={deterministic}",
                 path=f"{splits} split(s)") for row in mode.rows]


def _embedding_case(spec, gpu) -> list[dict]:
    import torch
    import torch.nn.functional as F

    tokens, rows, dim, dtype, deterministic = spec
    weight = torch.randn(rows, dim, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
    out = F.embedding(torch.randint(0, rows, (tokens,), device="cuda"), weight)
    grad = torch.randn_like(out)
    mode = _reading_mode(True, gpu)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with mode:
            out.backward(grad)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    return [dict(row, case=f"embedding backward {tokens} tokens {rows}x{dim} {dtype} deterministic={deterministic}",
                 path="sort, then two-pass or fused") for row in mode.rows]


def _index_put_case(spec, gpu) -> list[dict]:
    import torch

    shape, count = spec
    target = torch.zeros(shape, device="cuda")
    index = torch.randint(0, shape[0], (count,), device="cuda")
    values = torch.randn(count, *shape[1:], device="cuda")
    mode = _reading_mode(True, gpu)
    with mode:
        target.index_put_((index,), values, accumulate=True)
    return [dict(row, case=f"index_put_ accumulate {list(shape)} {count} indices", path="sort over tiles")
            for row in mode.rows]


def _masked_scatter_case(spec, gpu) -> list[dict]:
    import torch

    batch, seq, hidden, tokens, spare, dtype = spec
    embeds = torch.randn(batch, seq, hidden, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
    ids_mask = torch.zeros(batch, seq, 1, dtype=torch.bool, device="cuda")
    ids_mask[:, 1:1 + tokens] = True
    features = torch.randn(batch * tokens + spare, hidden, device="cuda", dtype=embeds.dtype, requires_grad=True)
    mode = _reading_mode(True, gpu)
    with mode:
        out = embeds.masked_scatter(ids_mask.expand_as(embeds), features)
        out.backward(torch.ones_like(out))
    return [dict(row, case=f"masked_scatter {[batch, seq, hidden]} {tokens} image tokens a row +{spare} {dtype}",
                 path="prefix sums; backward: nonzero and selection") for row in mode.rows]


def run(cpu: bool) -> dict:
    import torch

    from memplan.estimator.cuda.op_scratch import CudaGpu

    cuda = not cpu
    if cuda:
        props = torch.cuda.get_device_properties(0)
        gpu = CudaGpu(compute_capability=torch.cuda.get_device_capability(0), sm_count=props.multi_processor_count)
        device_info = {"name": props.name, "sm_count": props.multi_processor_count,
                       "compute_capability": list(torch.cuda.get_device_capability(0)),
                       "torch": torch.__version__, "cuda": torch.version.cuda}
    else:
        gpu = CudaGpu(compute_capability=(9, 0), sm_count=132)
        device_info = {"name": "cpu dry run (no GPU figure)", "torch": torch.__version__}
    rows, errors = [], []
    for spec in CPU_SORTS if cpu else SORTS:
        try:
            rows.extend(_sort_case(spec, "cpu" if cpu else "cuda", gpu, cuda))
        except Exception as err:  # noqa: BLE001 -- one case's failure is recorded, the others run
            errors.append({"case": repr(spec), "error": "".join(traceback.format_exception_only(err))[-400:]})
        if cuda:
            torch.cuda.empty_cache()
    for spec in () if cpu else FLASH:
        for deterministic in (False, True):
            try:
                rows.extend(_flash_case(spec, deterministic, gpu))
            except Exception as err:  # noqa: BLE001
                errors.append({"case": f"flash {spec} deterministic={deterministic}",
                               "error": "".join(traceback.format_exception_only(err))[-400:]})
            torch.cuda.empty_cache()
    for case, specs in (() if cpu else ((_embedding_case, EMBEDDINGS), (_index_put_case, INDEX_PUTS),
                                        (_masked_scatter_case, MASKED_SCATTERS), (pools.pool_case, pools.POOLS))):
        for spec in specs:
            try:
                rows.extend(case(spec, gpu))
            except Exception as err:  # noqa: BLE001
                errors.append({"case": f"{case.__name__} {spec}",
                               "error": "".join(traceback.format_exception_only(err))[-400:]})
            torch.cuda.empty_cache()
    return {"device": device_info, "python": platform.python_version(), "rows": rows, "errors": errors}


def report(raw: Path) -> dict:
    """The GPU's readings against this tree's rules (re-computed for the recorded arguments and GPU)."""
    from memplan.estimator.cuda.op_scratch import CudaGpu

    data = json.loads(raw.read_text())
    device = data["device"]
    gpu = CudaGpu(compute_capability=tuple(device["compute_capability"]), sm_count=device["sm_count"])
    rows = []
    for row in data["rows"]:
        args, kwargs = decode(row["args"]), decode(row["kwargs"])
        deterministic = "deterministic=True" in row["case"]  # the trace's setting, as an estimate passes it
        phases, rounded = rule(_op(row["op"]), args, kwargs, gpu, deterministic)
        rows.append({"case": row["case"], "path": row["path"], "op": row["op"],
                     "gpu_requested_peak": row["gpu_requested_peak"], "rule_requested_peak": requested_peak(phases),
                     "gpu_transient": row["gpu_transient"], "rule_rounded": rounded,
                     "recorded_rule_requested_peak": row["rule_requested_peak"]})
    exact = sum(r["gpu_requested_peak"] == r["rule_requested_peak"] for r in rows)
    return {"device": device, "source": str(raw), "rows": rows, "exact": exact, "n": len(rows),
            "errors": data["errors"]}


def _op(name: str):
    import torch

    namespace, rest = name.split(".", 1)
    packet, overload = rest.rsplit(".", 1)
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="on the GPU: folder for gpu_rules.json")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU with tiny sizes (no GPU figure)")
    parser.add_argument("--report", type=Path, help="a GPU run's gpu_rules.json: render it against this tree's rules")
    args = parser.parse_args(argv)
    if bool(args.out) == bool(args.report):
        parser.error("give --out DIR (measure) or --report RAW.json (render)")
    if args.report:
        from benchmarks.gpu_rules_render import render
        from benchmarks.results_io import RESULTS

        result = report(args.report)
        (RESULTS / "gpu_rules.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / "gpu_rules.md").write_text(render(result))
        print(f"requested bytes exact in {result['exact']} of {result['n']} ops; "
              f"wrote {RESULTS / 'gpu_rules.md'}")
        return 0
    data = run(args.cpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_rules.json").write_text(json.dumps(data, indent=1))
    for row in data["rows"]:
        print(f"{row['case']:<60} requested: gpu {row['gpu_requested_peak']:>13,} "
              f"rule {row['rule_requested_peak']:>13,}"
              f"  allocated: gpu {row['gpu_transient']:>13,} rule {row['rule']:>13,}")
    for err in data["errors"]:
        print("ERROR", err["case"], err["error"])
    return 0 if not data["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
