"""benchmarks.gpu_campaign's bookkeeping: a part's Settings, the Recorder that rewrites part<N>.json after every
change and logs every line, and the children it runs (killed at the part's deadline) with their marked results."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.processes import run_group

ROOT = Path(__file__).resolve().parent.parent
FORMAT = 1
"""Version of the part<N>.json layout (benchmarks.gpu_results reads it)."""

@dataclass(frozen=True, kw_only=True)
class Settings:
    """One part's run."""

    part: int
    """1 to 4."""
    out: Path
    """Folder for part<N>.json and part<N>.log."""
    budget_s: float
    """Seconds after which nothing new starts and running children are killed."""
    dry_run: bool
    """CPU, tiny sizes: checks the campaign, measures nothing of a GPU."""
    jobs: int
    """Estimate processes at once (CPU work)."""
    measure_jobs: int
    """GPU measurement processes at once (each reads only its own process's memory)."""
    only: tuple[str, ...] = ()
    """The sections to run (all when empty); the environment always runs."""
    cases: tuple[str, ...] = ()
    """The accuracy / op-profile cases to keep (all when empty)."""

    def chosen(self, names) -> list[str]:
        return [n for n in names if not self.cases or n in self.cases]


class Recorder:
    """The part's JSON, rewritten atomically after every change, and its log."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.deadline = time.monotonic() + settings.budget_s
        settings.out.mkdir(parents=True, exist_ok=True)
        self.path = settings.out / f"part{settings.part}.json"
        self.log_path = settings.out / f"part{settings.part}.log"
        self.data: dict = {"format": FORMAT, "part": settings.part, "dry_run": settings.dry_run,
                           "started": _now(), "budget_s": settings.budget_s, "sections": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        line = f"[{_now()}] {message}"
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".part", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=1, default=repr)
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def section(self, name: str):
        """A dict to fill; its status (done / error / out of time) and seconds are recorded however it ends."""
        entry: dict = {"status": "running"}
        self.data["sections"][name] = entry
        if self.settings.only and name != "environment" and name not in self.settings.only:
            entry["status"] = "skipped: not asked (--only)"
            yield None
            return
        if self.left() <= 5:
            entry["status"] = "skipped: out of time"
            self.log(f"{name}: skipped, out of time")
            self.save()
            yield None
            return
        self.log(f"{name}: start ({self.left():.0f} s left)")
        self.save()
        started = time.monotonic()
        try:
            yield entry
            entry["status"] = "done"
        except subprocess.TimeoutExpired as err:
            entry["status"] = "out of time"
            entry["error"] = f"TimeoutExpired: {err.cmd if isinstance(err.cmd, str) else ' '.join(err.cmd)}"[:2000]
        except Exception as err:  # noqa: BLE001 -- a failed section is recorded; the next one still runs
            entry["status"] = "error"
            entry["error"] = f"{type(err).__name__}: {err}"[:4000]
            entry["traceback"] = traceback.format_exc()[-4000:]
        finally:
            entry["seconds"] = time.monotonic() - started
            self.log(f"{name}: {entry['status']} in {entry['seconds']:.1f} s"
                     + (f" -- {entry['error'][:300]}" if "error" in entry else ""))
            self.save()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_child(rec: Recorder, argv: list[str], *, env: dict | None = None,
              cap_s: float = 600) -> subprocess.CompletedProcess:
    """Run a child in the repository root, killed at the part's deadline (or after cap_s; a dry run has no
    cap_s: on a loaded CPU it is slow, and its caller tells a hang by lack of CPU progress)."""
    cap_s = rec.left() if rec.settings.dry_run else cap_s
    return run_group(argv, cwd=ROOT, env=env, timeout=max(1.0, min(cap_s, rec.left())))


def marked_json(stdout: str, marker: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        raise RuntimeError(f"no line starting {marker.strip()!r} in the child's output")
    return json.loads(lines[-1][len(marker):])

