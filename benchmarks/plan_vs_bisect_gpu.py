"""Issue 3's GPU figures (needs a CUDA GPU; not yet run: no GPU has been lent to this project so far).

For each shipped config, on the local GPU 0, at the precision and checkpointing memplan plans:
  memplan   -- the largest micro-batch memplan predicts fits (a bisection over memplan.estimate with
               the margin set to 0), and the wall time of `memplan suggest --gpus 1` on the config;
  truth     -- the largest micro-batch that runs two real training steps without OOM, found by
               bisection, each probe in a fresh process (an OOM leaves the allocator fragmented);
  lightning -- wall time of Lightning's BatchSizeFinder(mode="binsearch") on the same model.
Goals: memplan's micro-batch runs (no OOM) and is >= 90 % of truth; planning takes <= 1/10 of the
BatchSizeFinder's time.

    python -m benchmarks.plan_vs_bisect_gpu [--only gpt2-small ...]
writes benchmarks/results/plan_vs_bisect_gpu.json and .md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from benchmarks.results_io import write_results

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("gpt2-small", "resnet", "cnn")


def _config(name: str) -> str:
    return str(ROOT / "configs" / f"{name}.yaml")


def _probe(name: str, micro: int, precision: str, checkpointing: bool) -> bool:
    """Two real steps at `micro` in a fresh process: True if no OOM."""
    code = (
        "import sys, torch\n"
        "from memplan.config import load_config\n"
        "from memplan.estimator.measure import measure_cuda_peak\n"
        f"loaded = load_config({_config(name)!r})\n"
        "try:\n"
        f"    measure_cuda_peak(loaded.build_model, lambda: loaded.example_batch({micro}), optimizer=loaded.optimizer,\n"
        f"                      precision={precision!r}, checkpointing={checkpointing!r})\n"
        "except torch.OutOfMemoryError:\n"
        "    sys.exit(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode not in (0, 3):
        raise RuntimeError(f"probe {name} micro {micro} failed: {out.stderr[-2000:]}")
    return out.returncode == 0


def _bisect(fits, low: int = 1, cap: int = 1 << 14) -> int:
    """Largest m in [low, cap] with fits(m), assuming monotone; 0 if even `low` does not fit."""
    if not fits(low):
        return 0
    hi = low
    while hi < cap and fits(hi * 2):
        hi *= 2
    lo, hi = hi, min(hi * 2, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def run_one(name: str) -> dict:
    import torch

    from memplan.config import load_config

    started = time.perf_counter()
    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "memplan", "suggest", "--gpus", "1", _config(name), "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    suggest_s = time.perf_counter() - started
    precision, ckpt = plan["precision"], plan["gradient_checkpointing"]
    loaded = load_config(_config(name))
    free = torch.cuda.mem_get_info()[0]
    memplan_max = _bisect(lambda m: loaded.estimate(m, precision=precision, checkpointing=ckpt,
                                                    device=None).device_total <= free)
    truth_max = _bisect(lambda m: _probe(name, m, precision, ckpt))
    memplan_runs = memplan_max > 0 and _probe(name, memplan_max, precision, ckpt)
    bsf_s = _batch_size_finder_seconds(name, precision)
    return {"config": name, "precision": precision, "checkpointing": ckpt, "suggest_seconds": suggest_s,
            "planned_micro_batch": plan["micro_batch_size"], "memplan_max_micro_batch": memplan_max,
            "truth_max_micro_batch": truth_max, "memplan_max_runs": memplan_runs,
            "ratio": memplan_max / truth_max if truth_max else None, "batch_size_finder_seconds": bsf_s}


def _batch_size_finder_seconds(name: str, precision: str) -> float:
    code = (
        "import time, pytorch_lightning as pl\n"
        "from pytorch_lightning.callbacks import BatchSizeFinder\n"
        "from memplan.config import load_config\n"
        f"loaded = load_config({_config(name)!r})\n"
        "model = loaded.build_model(); dm = loaded.data.instantiate()\n"
        f"trainer = pl.Trainer(accelerator='gpu', devices=1, precision={precision!r}, max_steps=1, logger=False,\n"
        "                     enable_checkpointing=False, callbacks=[BatchSizeFinder(mode='binsearch')])\n"
        "t = time.perf_counter(); trainer.fit(model, datamodule=dm); print(time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("plan_vs_bisect_gpu needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    rows = [run_one(name) for name in (args.only or CONFIGS)]
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    lines = [f"# memplan's micro-batch vs real bisection ({report['gpu']}, torch {report['torch']}, {report['date']})", "",
             "| config | precision | ckpt | memplan max | truth max | ratio | memplan's runs | suggest s | BatchSizeFinder s |",
             "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{100 * r['ratio']:.0f}%"
        lines.append(f"| {r['config']} | {r['precision']} | {r['checkpointing']} | {r['memplan_max_micro_batch']} | "
                     f"{r['truth_max_micro_batch']} | {ratio} | {r['memplan_max_runs']} | {r['suggest_seconds']:.1f} | "
                     f"{r['batch_size_finder_seconds']:.1f} |")
    write_results("plan_vs_bisect_gpu", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
