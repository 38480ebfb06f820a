"""Where a training step's device memory goes, op by op, on a real GPU (the GPU campaign's part 5, issue 22 section 3).

    python -m benchmarks.gpu_ops --case NAME [--cpu]    one zoo case's op-by-op allocator readings
    python -m benchmarks.gpu_ops --conv-grid [--cpu]    each convolution's transient memory (cuDNN workspaces)

`--case`: the zoo case (benchmarks.zoo or benchmarks.accuracy_gpu's extra variants) trains 2 steps through
memplan.truth (a real Lightning `Trainer.fit`, nothing of the estimator) under a TorchDispatchMode that reads the
caching allocator around every aten op, the backward's ops on autograd's thread included: allocated bytes before,
the peak inside the op (the peak statistics are reset before it) and after, and reserved bytes after. An op whose
peak exceeds both its before and its after used memory the trace cannot see (a library workspace: cuDNN, cuBLAS);
those ops get their arguments' shapes. The step's own peak is the highest op peak.

`--conv-grid`: each convolution of the zoo's conv models (shapes taken from a CPU forward with hooks), ViT-L/16's
patch convolution and a few other shapes (Conv1d, Conv3d, depthwise, transposed), at the zoo's batch and 4 times
it, in float32, bfloat16 and float16, called directly: forward, and backward with and without the input's
gradient. Each measurement starts from an emptied cache; `transient` is the op's peak minus what it leaves
allocated (its outputs). torch.backends.cudnn.benchmark stays at its default (False), as Lightning leaves it.

`--cpu` runs the same code on CPU with tiny sizes for the campaign's dry run: it reads no device memory
(every figure 0) and its rows are no GPU figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading

RESULT_MARKER = "GPU_OPS_RESULT "
"""Prefix of the one result line (library output may precede it)."""
PROFILE_CASES = ("cnn-b64-bf16mixed", "resnet18-b16-ckpt", "cnn-b32", "resnet18-b16-sgd-momentum", "llama-gqa-b2",
                 "mixtral-moe-b4", "gpt2-b8-bf16mixed", "mixer-b16-bf16mixed", "resnet18-b8", "resnet18-b16-bf16mixed",
                 "lstm-b32", "gru-b32", "llama-gqa-b4-bf16mixed", "bert-b16-ckpt")
"""The zoo's cases with the largest GPU gaps first (benchmarks/results/accuracy_gpu.md), then one of each other kind."""
DRY_PROFILE_CASES = ("cnn-b32",)
CONV_OPS = ("convolution", "convolution_backward", "cudnn_convolution", "cudnn_batch_norm")


# --- op by op, inside a real training run -------------------------------------------------------------
def _shapes(args) -> list:
    import torch

    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append([list(a.shape), str(a.dtype).removeprefix("torch."), a.is_contiguous()])
        elif isinstance(a, (list, tuple)) and a and all(isinstance(v, int) for v in a):
            out.append(list(a))
        elif isinstance(a, (int, float, bool)) or a is None:
            out.append(a)
    return out[:12]


def _op_mode(cuda: bool):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    main = threading.get_ident()

    class OpReadings(TorchDispatchMode):
        """One row per aten op: [step, op, on the main thread, before, peak, after, reserved after, shapes]."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list] = []
            self.step = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not cuda:
                out = func(*args, **kwargs)
                self.rows.append([self.step, str(func), threading.get_ident() == main, 0, 0, 0, 0, None])
                return out
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = func(*args, **kwargs)
            peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            name = str(func)
            wide = peak > max(before, after) or any(k in name for k in CONV_OPS)
            self.rows.append([self.step, name, threading.get_ident() == main, before, peak, after,
                              torch.cuda.memory_reserved(), _shapes(args) if wide else None])
            return out

    return OpReadings()


def profile_case(name: str, cpu: bool) -> dict:
    import torch

    from benchmarks.accuracy_gpu import all_cases
    from benchmarks.zoo import make_optimizer
    from memplan.truth.runs import Training, train

    case = all_cases()[name]
    cuda = not cpu
    mode = _op_mode(cuda)

    def step_start(step: int) -> None:
        mode.step = step

    run = Training(build=case.build, make_batch=lambda: case.make_batch(case.batch_size), loss=case.loss,
                   optimizer=lambda params: make_optimizer(case.optimizer, params), precision=case.precision,
                   checkpointing=case.checkpointing, steps=2, on_step_start=step_start)
    with mode:
        train(run, loop=case.loop, accelerator="cpu" if cpu else "cuda")
    if cuda:
        torch.cuda.synchronize()
    rows = mode.rows
    step2 = [r for r in rows if r[0] == 2]
    transient: dict[str, int] = {}
    for r in rows:
        extra = r[4] - max(r[3], r[5])
        if extra > 0:
            transient[r[1]] = max(transient.get(r[1], 0), extra)
    return {"case": name, "precision": case.precision, "checkpointing": case.checkpointing, "loop": case.loop,
            "batch": case.batch_size, "ops": len(rows),
            "peak_allocated_step2": max((r[4] for r in step2), default=0),
            "peak_allocated": max((r[4] for r in rows), default=0),
            "max_reserved_seen": max((r[6] for r in rows), default=0),
            "largest_transient_by_op": dict(sorted(transient.items(), key=lambda kv: -kv[1])[:15]),
            "columns": ["step", "op", "main_thread", "before", "peak", "after", "reserved_after", "shapes"],
            "rows": rows}


# --- convolutions, one by one ------------------------------------------------------------------------
def _zoo_conv_shapes(cpu: bool) -> list[dict]:
    """Each distinct convolution of the zoo's conv cases: its module's settings and per-sample input shape."""
    import torch
    from torch import nn

    from benchmarks.zoo import CASES

    seen: dict[tuple, dict] = {}
    for case in CASES.values():
        model = case.build().eval()
        convs = [m for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))]
        if not convs:
            continue
        found: list = []
        hooks = [m.register_forward_hook(lambda m, a, o: found.append((m, tuple(a[0].shape[1:])))) for m in convs]
        with torch.no_grad():
            case.loss(model, case.make_batch(1))
        for h in hooks:
            h.remove()
        for m, sample in found:
            key = (type(m).__name__, m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.groups,
                   m.bias is not None, sample)
            if key in seen:
                seen[key]["batches"] = sorted({*seen[key]["batches"], case.batch_size, 4 * case.batch_size})
                continue
            seen[key] = ({"source": case.family, "dims": len(m.kernel_size), "c_in": m.in_channels,
                        "c_out": m.out_channels, "kernel": list(m.kernel_size), "stride": list(m.stride),
                        "padding": list(m.padding), "groups": m.groups, "bias": m.bias is not None,
                        "sample": list(sample), "batches": [case.batch_size, 4 * case.batch_size]})
        if cpu and len(seen) >= 2:
            break
    return list(seen.values())


def conv_shapes(cpu: bool) -> list[dict]:
    shapes = _zoo_conv_shapes(cpu)
    if cpu:
        return [dict(s, batches=[1]) for s in shapes[:2]]

    def conv(source, dims, c_in, c_out, k, s, p, groups, bias, sample, batches, transposed=False):
        return {"source": source, "dims": dims, "c_in": c_in, "c_out": c_out, "kernel": [k] * dims,
                "stride": [s] * dims, "padding": [p] * dims, "groups": groups, "bias": bias, "sample": sample,
                "batches": batches, "transposed": transposed}

    return shapes + [
        conv("vit-l16 patch", 2, 3, 1024, 16, 16, 0, 1, True, [3, 224, 224], [16, 64]),
        conv("resnet50 stem", 2, 3, 64, 7, 2, 3, 1, False, [3, 224, 224], [32, 128]),
        conv("resnet50 3x3", 2, 128, 128, 3, 1, 1, 1, False, [128, 28, 28], [32, 128]),
        conv("resnet50 1x1", 2, 256, 1024, 1, 1, 0, 1, False, [256, 14, 14], [32, 128]),
        conv("convnext dw7", 2, 96, 96, 7, 1, 3, 96, True, [96, 56, 56], [32, 128]),
        conv("whisper conv1", 1, 80, 768, 3, 1, 1, 1, True, [80, 3000], [4, 16]),
        conv("wav2vec2 conv0", 1, 1, 512, 10, 5, 0, 1, False, [1, 16000], [4, 16]),
        conv("video conv3d", 3, 3, 64, 3, 1, 1, 1, True, [3, 16, 112, 112], [2, 8]),
        conv("unet up", 2, 128, 64, 2, 2, 0, 1, True, [128, 64, 64], [8, 32], transposed=True),
    ]


def conv_grid(cpu: bool) -> dict:
    import torch

    device = "cpu" if cpu else "cuda"
    dtypes = (torch.float32,) if cpu else (torch.float32, torch.bfloat16, torch.float16)
    rows, errors = [], []
    for shape in conv_shapes(cpu):
        for batch in shape["batches"]:
            for dtype in dtypes:
                try:
                    rows.extend(_one_conv(shape, batch, dtype, device))
                except Exception as err:  # noqa: BLE001 -- an OOM or unsupported shape is recorded, the grid goes on
                    errors.append({"shape": shape, "batch": batch, "dtype": str(dtype), "error": str(err)[:300]})
    return {"cudnn": torch.backends.cudnn.version() if not cpu else None,
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "allow_tf32": torch.backends.cudnn.allow_tf32,
            "rows": rows, "errors": errors}


def _one_conv(shape: dict, batch: int, dtype, device: str) -> list[dict]:
    import torch

    cuda = device == "cuda"
    dims, transposed = shape["dims"], shape.get("transposed", False)
    x = torch.randn(batch, *shape["sample"], device=device, dtype=dtype)
    w_shape = ([shape["c_in"], shape["c_out"] // shape["groups"]] if transposed
               else [shape["c_out"], shape["c_in"] // shape["groups"]]) + shape["kernel"]
    w = torch.randn(w_shape, device=device, dtype=dtype)
    b = torch.randn(shape["c_out"], device=device, dtype=dtype) if shape["bias"] else None
    geometry = (shape["stride"], shape["padding"], [1] * dims, transposed, [0] * dims, shape["groups"])
    aten = torch.ops.aten

    def measured(what: str, fn) -> dict:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        reserved_before = torch.cuda.memory_reserved() if cuda else 0
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        after = torch.cuda.memory_allocated() if cuda else 0
        reserved = torch.cuda.memory_reserved() if cuda else 0
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t is not None]
        row = {**{k: shape[k] for k in ("source", "dims", "c_in", "c_out", "kernel", "stride", "padding", "groups",
                                         "bias", "sample")},
               "transposed": transposed, "batch": batch, "dtype": str(dtype).removeprefix("torch."), "what": what,
               "input_bytes": x.nbytes, "output_bytes": sum(t.nbytes for t in outputs),
               "before": before, "peak": peak, "after": after, "transient": peak - after,
               "reserved_growth": reserved - reserved_before}
        del out, outputs
        return row

    y = measured("forward", lambda: aten.convolution(x, w, b, *geometry))
    gy = torch.randn(aten.convolution(x, w, b, *geometry).shape, device=device, dtype=dtype)
    bias_sizes = [shape["c_out"]] if b is not None else None
    rows = [y]
    for what, mask in (("backward input+weight", [True, True, b is not None]),
                       ("backward weight only", [False, True, b is not None])):
        rows.append(measured(what, lambda mask=mask: aten.convolution_backward(gy, x, w, bias_sizes, *geometry, mask)))
    return rows


# --- the campaign's part 5 --------------------------------------------------------------------------
def conv_grid_section(rec, entry: dict, dry: bool) -> None:
    """The convolution grid in one child process (in this one for a dry run); its rows in DIR/conv_grid.json."""
    from benchmarks.gpu_campaign_record import marked_json, run_child

    if dry:
        result = conv_grid(cpu=True)
    else:
        done = run_child(rec, [sys.executable, "-m", "benchmarks.gpu_ops", "--conv-grid"], cap_s=200)
        entry["stderr_tail"] = done.stderr.strip()[-1500:]
        if done.returncode != 0:
            raise RuntimeError(f"gpu_ops --conv-grid exited {done.returncode}")
        result = marked_json(done.stdout, RESULT_MARKER)
    _write_json(rec.settings.out / "conv_grid.json", result)
    entry.update({k: v for k, v in result.items() if k != "rows"}, measurements=len(result["rows"]))
    rec.log(f"conv grid: {len(result['rows'])} measurements, {len(result['errors'])} errors")


def op_profiles(rec, entry: dict, names: list[str], dry: bool) -> None:
    """Each case's op readings in its own GPU process (measure_jobs at once); rows in DIR/ops/<case>.json, the
    summary (peaks, largest transients by op) in the part's JSON."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.gpu_campaign_record import marked_json, run_child

    entry.update(cases=list(names), summaries={})

    def one(name: str) -> None:
        if dry:
            result = profile_case(name, cpu=True)
        elif rec.left() <= 10:
            entry["summaries"][name] = {"error": "skipped: out of time"}
            return
        else:
            try:
                done = run_child(rec, [sys.executable, "-m", "benchmarks.gpu_ops", "--case", name], cap_s=240)
            except subprocess.TimeoutExpired:
                entry["summaries"][name] = {"error": "killed: out of time"}
                return
            if done.returncode != 0:
                entry["summaries"][name] = {"error": done.stderr.strip()[-1500:] or f"exit {done.returncode}"}
                return
            result = marked_json(done.stdout, RESULT_MARKER)
        _write_json(rec.settings.out / "ops" / f"{name}.json", result)
        entry["summaries"][name] = {k: v for k, v in result.items() if k not in ("rows", "columns")}
        rec.log(f"ops {name}: {result['ops']} ops, step-2 peak {result['peak_allocated_step2']}, "
                f"largest transients {json.dumps(result['largest_transient_by_op'])[:300]}")
        rec.save()

    with ThreadPoolExecutor(1 if dry else rec.settings.measure_jobs) as pool:
        list(pool.map(one, names))


def _write_json(path, data) -> None:
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--case", help="a zoo case (or an extra GPU variant) to read op by op")
    what.add_argument("--conv-grid", action="store_true", help="each convolution's transient memory")
    parser.add_argument("--cpu", action="store_true", help="on CPU with tiny sizes (the dry run)")
    args = parser.parse_args(argv)
    result = conv_grid(args.cpu) if args.conv_grid else profile_case(args.case, args.cpu)
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
