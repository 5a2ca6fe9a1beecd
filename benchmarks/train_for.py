"""Issue 41's stop in seconds (`--train-for`): what it saves a user whose training run lasts H, against the
convergence stop alone.

hybrid (the default strategy until 2026-11-29) runs with the stop off for up to 30 launched trials on rl_evaluation's held-out
simulated tasks (12 GPU, 4 CPU; a fresh hidden distortion per seed, the world's noise on step and trial times, trials
taking GPU-like seconds: autotune.prediction.trial_time), recording after every trial the figures both rules read
(the chance of a better config; the best untried config's expected gain per second of its trial). Each rule is then
replayed on the records: the convergence stop (`--stop-when 0.05`, the default), `--train-for H` alone
(`--stop-when 0`) and both (the default with `--train-for H`), at least 6 trials, at most 30. Per rule and H: trials
and trial-seconds until the stop, the recommendation's true throughput over the optimum (median, 5th percentile,
share under 98%), and what the user pays in all, the search's trial-seconds plus H at the recommendation's speed
(H / (best/opt), H being the run at the optimum's speed; the rule is told the same H), in hours, mean over runs,
beside an oracle that stopped each run at its cheapest trial.
(Search and training count the same devices: a trial runs on the workload's GPUs, as the training does.)

    python benchmarks/train_for.py [--seeds 5] [--first-seed 0] [--tasks 16] [--noise 0.03] [--jobs 2]

Writes benchmarks/results/train_for.md and .json (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import optuna

import rl_evaluation as rle  # beside this script
import search_efficiency as se
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.rl.policy import Policy
from autotune.rl.simulator import distorted_task
from autotune.search.convergence import DEFAULT_STOP_WHEN, MIN_TRIALS

ROOT = Path(__file__).resolve().parent
TRIALS = 30
HOURS = (0.5, 1.0, 4.0, 24.0)
GOOD = 0.98


def run_seed(seed: int, tasks: int, noise: float) -> list[dict]:
    """Every held-out task at `seed`: hybrid with the stop off, the figures after each launched trial."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy = Policy.load(rle.policy_path())
    runs = []
    for kind, task, _ in rle.simulated_tasks(tasks, 0):
        truth = distorted_task(task, 0.3, noise, seed)
        backend = truth.with_noise_seed(seed)
        sweep = Sweep.in_memory(truth.landscape.space, task.memory_budget_bytes,
                                lambda context: rle.strategy_for("hybrid", context, policy), backend.name, seed)
        run_local(sweep, backend, Budget(TRIALS, stop_when=0), QuietProgress())
        run = {"kind": kind, "task": rle.task_name(task), "seed": seed, "curve": [], "walls": [], "chances": [],
               "per_s": []}
        best_measured, best_true = 0.0, 0.0
        for r in sweep.results:
            if r.status == "pruned":
                continue
            run["walls"].append(r.wall_time_s)
            run["chances"].append(r.extra.get("chance_of_better"))
            run["per_s"].append(r.extra.get("gain_per_trial_s"))
            if r.fits(task.memory_budget_bytes) and r.throughput_samples_per_s > best_measured:
                best_measured, best_true = r.throughput_samples_per_s, truth.true_throughput(r.config)
            run["curve"].append(best_true / truth.optimum)
        runs.append(run)
        print(f"{kind} {run['task']} seed {seed}: {len(run['curve'])} trials", flush=True)
    return runs


def rules(hours: float) -> dict[str, callable]:
    train_s = hours * 3600

    def chance(c, p):
        return c is not None and c < DEFAULT_STOP_WHEN

    def seconds(c, p):
        return p is not None and p * train_s < 1

    return {"--stop-when 0.05 (default)": chance, f"--train-for {hours:g}h --stop-when 0": seconds,
            f"--train-for {hours:g}h": lambda c, p: chance(c, p) or seconds(c, p)}


def stop_at(run: dict, rule) -> int:
    last = min(TRIALS, len(run["curve"]))
    return next((i for i in range(MIN_TRIALS, last + 1) if rule(run["chances"][i - 1], run["per_s"][i - 1])), last)


def paid_h(run: dict, stop: int, hours: float) -> float:
    """Search trial-seconds until `stop` plus the training run at the recommendation's speed, in hours."""
    return sum(run["walls"][:stop]) / 3600 + hours / max(run["curve"][stop - 1], 1e-9)


def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    i = q * (len(xs) - 1)
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def table(runs: list[dict]) -> list[dict]:
    rows = []
    for hours in HOURS:
        oracle = statistics.fmean(min(paid_h(r, s, hours) for s in range(1, min(TRIALS, len(r["curve"])) + 1))
                                  for r in runs)
        for name, rule in rules(hours).items():
            stops = [stop_at(r, rule) for r in runs]
            quality = [r["curve"][s - 1] for r, s in zip(runs, stops)]
            rows.append({"hours": hours, "rule": name, "trials": statistics.median(stops),
                         "trial_s": statistics.median(sum(r["walls"][:s]) for r, s in zip(runs, stops)),
                         "best_over_opt": statistics.median(quality), "p5": percentile(quality, 0.05),
                         "under_98": sum(q < GOOD for q in quality) / len(quality),
                         "paid_h": statistics.fmean(paid_h(r, s, hours) for r, s in zip(runs, stops)),
                         "oracle_h": oracle})
    return rows


def markdown(result: dict) -> str:
    lines = ["# The stop in seconds: `--train-for` (issue 41)", "",
             f"`{result['command']}` ({result['minutes']:.1f} min, {result['machine']}; {result['source']}).", "",
             __doc__.split("\n\n")[0].replace("\n", " "), ""]
    for kind, rows in result["tables"].items():
        runs = sum(r["kind"] == kind for r in result["runs"])
        lines += [f"## held-out {kind.upper()}, {result['noise']:.0%} noise ({runs} runs)", "",
                  "| H | rule | trials to stop | trial-s at stop | best/opt | 5th pct | under 98% | paid, h (mean) "
                  "| oracle, h |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['hours']:g} h | {r['rule']} | {r['trials']:g} | {r['trial_s']:.0f} | "
                         f"{r['best_over_opt']:.3f} | {r['p5']:.3f} | {r['under_98']:.0%} | {r['paid_h']:.3f} | "
                         f"{r['oracle_h']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--noise", type=float, default=0.03)
    parser.add_argument("--jobs", type=int, default=2, help="processes, one seed each at a time")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "train_for")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = [r for part in pool.map(run_seed, seeds, [args.tasks] * len(seeds), [args.noise] * len(seeds))
                for r in part]
    kinds = sorted({r["kind"] for r in runs}, key=lambda k: k != "gpu")
    result = {"command": "python benchmarks/train_for.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "minutes": (time.perf_counter() - started) / 60, "machine": se.machine(), "source": se.source_state(),
              "noise": args.noise, "tables": {k: table([r for r in runs if r["kind"] == k]) for k in kinds},
              "runs": runs}
    text = markdown(result)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=lambda v: None) + "\n")
    args.out.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0 if all(math.isfinite(r["paid_h"]) for rows in result["tables"].values() for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
