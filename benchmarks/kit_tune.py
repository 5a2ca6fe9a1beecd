"""The one-call GPU kit's main job (benchmarks/gpu_kit.py): `autotune tune` as a user runs it, in a child process
that is stopped at the phase's deadline as Ctrl-C would stop it, and what its run directory says afterwards.

tune keeps its Optuna study in `study.db` (SQLAlchemy: scripts/gpu-bundle carries it), builds its own ops
preflight (a load: the kit's preflight built them), and with `--confirm` re-runs the close calls in fresh
processes. Its `--time-budget` leaves the confirmation room; the deadline is the hard stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from autotune.values.results import CONFIRM, read_results

GRACE_S = 20.0  # after the interrupt: tune ends its trial's ranks and writes its report


@dataclass(frozen=True)
class TuneArgs:
    """One tune run's command line."""

    model: str
    seq_len: int | None
    global_batch: int
    hardware: str  # auto, or a profile name (the CPU check: cpu)
    space: Path  # a search-space YAML the kit writes
    memory_budget_bytes: int
    trials: int
    time_budget_s: float
    confirm: int
    out: Path
    seed: int = 0
    allocator: str = "default"  # the CUDA allocator's mode (autotune.values.allocator), named: not the environment's

    def argv(self, python: str = sys.executable) -> list[str]:
        argv = [python, "-m", "autotune.cli", "tune", "--model", self.model, "--global-batch", str(self.global_batch),
                "--hardware", self.hardware, "--allocator", self.allocator, "--space", str(self.space),
                "--memory-budget", str(self.memory_budget_bytes),
                "--trials", str(self.trials), "--time-budget", f"{self.time_budget_s:.0f}s",
                "--confirm", str(self.confirm), "--seed", str(self.seed), "--out", str(self.out)]
        return argv + (["--seq-len", str(self.seq_len)] if self.seq_len else [])


def fresh_run_dir(work: Path, name: str = "tune") -> Path:
    """A run directory no earlier call used: `work/tune`, else `work/tune-2`, `tune-3`, ... (never an earlier call's,
    whose results stay: tune refuses a folder that holds a sweep unless resumed, and the kit must report this
    call's tune, not the last one's)."""
    n = 1
    while True:
        path = work / (name if n == 1 else f"{name}-{n}")
        if not path.exists():
            return path
        n += 1


def tune_succeeded(returncode: int | None, interrupted: bool, summary: bool) -> bool:
    """tune ended as planned: exit 0, or stopped by the kit's deadline (its Ctrl-C: exit 130) with its summary written.
    Anything else (a bad argument: 2, an error or no recommendation: 1, killed after the grace) is a failure."""
    return returncode == 0 or (interrupted and returncode == 130 and summary)


@dataclass(frozen=True)
class Ran:
    returncode: int | None
    interrupted: bool  # the deadline came: SIGINT
    killed: bool  # and it did not end within the grace: SIGKILL
    seconds: float


def run_until(argv: Sequence[str], deadline: float, say: Callable[[str], None], grace_s: float = GRACE_S,
              env: dict[str, str] | None = None) -> Ran:
    """Run `argv`, each output line to `say`, until it ends or the monotonic `deadline`: then SIGINT to its
    process group (as a terminal's Ctrl-C), and SIGKILL to it `grace_s` later. Its own session, so that the
    signals reach its trials' ranks too and nothing else."""
    started = time.monotonic()
    child = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                             env=env, start_new_session=True)
    assert child.stdout is not None
    stream = child.stdout

    def pump() -> None:
        for line in stream:
            say(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    interrupted = killed = False
    try:
        child.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        interrupted = True
        say(f"deadline: interrupting tune (pid {child.pid}); it has {grace_s:.0f} s to write its report")
        _signal(child, signal.SIGINT)
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            killed = True
            _signal(child, signal.SIGKILL)
            child.wait()
    finally:
        if child.poll() is None:  # this process was interrupted: the child goes with it
            _signal(child, signal.SIGKILL)
            child.wait()
    reader.join(timeout=5.0)
    return Ran(child.returncode, interrupted, killed, time.monotonic() - started)


def _signal(child: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)  # its own session: the group is the child and what it started
    except (ProcessLookupError, PermissionError):
        pass


def tune_outcome(out: Path) -> dict[str, Any]:
    """What the run directory holds: the summary, the trials by status, the confirmation repeats."""
    summary_path, trials_path = out / "summary.json", out / "trials.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    results = read_results(trials_path) if trials_path.exists() else []
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    repeats = [r for r in results if r.phase == CONFIRM]
    best = (summary or {}).get("best") or {}
    return {"summary": summary is not None, "trials": len(results), "status_counts": statuses,
            "confirm_repeats": len(repeats), "wall_s": sum(r.wall_time_s for r in results),
            "best": best.get("config"), "best_throughput_samples_per_s": best.get("throughput_samples_per_s"),
            "best_peak_memory_bytes": best.get("peak_memory_bytes"),
            "confirmation": (summary or {}).get("confirmation") is not None}
