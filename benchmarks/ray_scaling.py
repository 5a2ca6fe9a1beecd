"""How a sweep's wall time grows with the number of trials in flight on Ray, and what the driver adds per
trial (issue 7, "scale on paper").

A private local Ray instance fakes `--slots` devices with a custom resource ("slot"), so 16 trials can be
in flight on a 2-core machine: each trial is the simulated backend's result for an Optuna proposal
(gpt2-xl on 8 x A100-40GB), and it sleeps its simulated trial time scaled down by `--scale` (a trial the
estimator says takes 60 s sleeps 60 x scale s). Everything else is the real driver: Optuna's one study in
SQLite, pruning, the trial log, Ray tasks and `ray.wait`.

Per concurrency K: wall time, the ideal wall time (total sleep / K, a lower bound), efficiency, the slot
time lost per trial ((K x wall - total sleep) / trials: the gap between a trial ending and the next one
starting in its slot, all driver and Ray costs included), and the driver's CPU time per trial.

Usage: nice -n 19 python benchmarks/ray_scaling.py [--trials 48] [--concurrency 1 2 4 8 16] [--scale 0.02]
Writes benchmarks/results/<--name>.md and .json (ray_scaling: short trials, where the driver is the limit;
ray_scaling_long: --trials 32 --fixed-s 2, trials long enough to scale).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the private instance binds loopback only

from rich.console import Console
from rich.table import Table

from autotune.backends.simulated import SimulatedBackend
from autotune.drivers.sweep import Sweep
from autotune.drivers.progress import QuietProgress
from autotune.drivers.ray import Job, TrialResources, run_ray
from autotune.drivers.sweep import Budget
from autotune.values.hardware import PROFILES
from autotune.search.rundir import RunDir, RunSettings
from autotune.search_spaces import load_choices
from autotune.values.workload import make_workload

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class ScaledSleep:
    """Builds, on the worker, a simulated backend whose trials sleep their simulated wall time x scale."""

    settings: RunSettings
    scale: float
    fixed_s: float | None = None  # every trial sleeps this long instead

    def __call__(self):
        return _Sleeper(SimulatedBackend(self.settings.workload, self.settings.hardware,
                                         self.settings.memory_budget_bytes, seed=0), self.scale, self.fixed_s)


class _Sleeper:
    def __init__(self, inner, scale: float, fixed_s: float | None) -> None:
        self.inner, self.scale, self.fixed_s, self.name = inner, scale, fixed_s, inner.name

    def run(self, config):
        result = self.inner.run(config)
        slept = self.fixed_s if self.fixed_s is not None else result.wall_time_s * self.scale
        time.sleep(slept)
        return replace(result, extra={**result.extra, "slept_s": slept})


def settings() -> RunSettings:
    workload = make_workload("gpt2-xl", 256, 8)
    hardware = PROFILES["a100-40gb"]
    return RunSettings(workload, hardware, 40 * 2**30, "optuna", "simulated", 0, load_choices("default"))


def one_sweep(k: int, trials: int, scale: float, base: Path, fixed_s: float | None = None) -> dict:
    s = settings()
    run = RunDir(base / f"k{k}")
    run.write_settings(s)
    sweep = Sweep.open(run, s, s.space())
    job = Job(f"k{k}", sweep, Budget(trials), TrialResources(cpus=0.0, custom=(("slot", 1.0),)),
              ScaledSleep(s, scale, fixed_s), QuietProgress())
    cpu0, t0 = time.process_time(), time.perf_counter()
    reason = run_ray([job], concurrency=k)[job.name]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ran = [r for r in sweep.results if r.status != "pruned"]
    sleeps = [r.extra.get("slept_s", 0.0) for r in ran]
    slept = sum(sleeps)
    # The shortest possible makespan: all slots busy, and no shorter than the longest trial (or, for equal
    # trials, than the number of rounds).
    ideal = max(-(-len(ran) // k) * fixed_s if fixed_s else slept / k, max(sleeps, default=0.0))
    return {"concurrency": k, "trials": len(ran), "pruned": len(sweep.results) - len(ran), "stopped": reason,
            "wall_s": wall, "ideal_s": ideal, "efficiency": ideal / wall, "slept_s": slept,
            "lost_slot_s_per_trial": (k * wall - slept) / len(ran), "driver_cpu_s_per_trial": cpu / len(ran),
            "best": sweep.best.throughput_samples_per_s if sweep.best else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=48)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--scale", type=float, default=0.01, help="sleep = simulated trial wall time x scale")
    parser.add_argument("--fixed-s", type=float, default=None, help="every trial sleeps this long instead")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--name", default="ray_scaling", help="results file stem (default: %(default)s)")
    args = parser.parse_args()
    import optuna
    import ray

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = Console()
    ray.init(num_cpus=2, resources={"slot": args.slots}, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="rs") as tmp:
            for k in args.concurrency:
                row = one_sweep(k, args.trials, args.scale, Path(tmp), args.fixed_s)
                rows.append(row)
                console.print(f"K={k}: {row['wall_s']:.1f} s wall, ideal {row['ideal_s']:.1f} s, "
                              f"lost {row['lost_slot_s_per_trial'] * 1000:.0f} ms of slot time per trial", highlight=False)
    finally:
        ray.shutdown()
    length = f"{args.fixed_s:g} s each" if args.fixed_s else f"simulated length x {args.scale}"
    table = Table(title=f"Ray driver scaling: {args.trials} Optuna trials, {length}")
    for column in ("K in flight", "wall s", "ideal s", "efficiency", "slot time lost per trial", "driver CPU per trial"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["concurrency"]), f"{r['wall_s']:.1f}", f"{r['ideal_s']:.1f}", f"{r['efficiency']:.0%}",
                      f"{r['lost_slot_s_per_trial'] * 1000:.0f} ms", f"{r['driver_cpu_s_per_trial'] * 1000:.0f} ms")
    console.print(table)
    meta = {"command": " ".join(["python", *sys.argv]), "machine": f"{os.cpu_count()} cores, {platform.platform()}",
            "ray": ray.__version__, "trials": args.trials, "scale": args.scale, "fixed_s": args.fixed_s, "slots": args.slots,
            "when": time.strftime("%Y-%m-%d %H:%M")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# Ray driver scaling ({meta['when']})", "",
             f"`{meta['command']}` on {meta['machine']}, Ray {meta['ray']}; a shared, loaded machine: timings are noisy.",
             f"{args.trials} Optuna trials per row (gpt2-xl, 8 x A100-40GB, simulated), each sleeping "
             + (f"{args.fixed_s:g} s" if args.fixed_s else f"its simulated trial time x {args.scale}")
             + f"; {args.slots} fake device slots (custom resource). Ideal: every slot always busy, and never less than the longest trial.", "",
             "| K in flight | wall s | ideal s | efficiency | slot time lost per trial | driver CPU per trial |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['wall_s']:.1f} | {r['ideal_s']:.1f} | {r['efficiency']:.0%} | "
                     f"{r['lost_slot_s_per_trial'] * 1000:.0f} ms | {r['driver_cpu_s_per_trial'] * 1000:.0f} ms |")
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
