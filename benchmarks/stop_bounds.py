"""What any stop could do on the default search's own trials, given what no real sweep knows (issue 28).

The convergence stop's goal is a median of at most 12 launched trials until the stop, the recommendation at
least 0.98 of the optimum in the median and 0.95 at the 5th percentile. benchmarks/stop_floor.py bounds it by the
search (when its recommendation first reaches 98%) and by the product's figure (its thresholds' trade-off). This
script asks the two questions that remain, on hybrid sweeps of the distorted world of
benchmarks/search_efficiency.py (its workloads, SPREAD, noise and seeds; the stop off, `--trials` each):

- **Is it the width of the priors?** Beside the product's figure, the same figure (autotune.search.convergence.assess)
  told what only the simulation knows: the throughput error model's prior width per knob is the world's own
  (Distortion.widths), held there (no empirical Bayes), and the per-config spread is the world's. Both read the
  same trials. The informed figure keeps the product's model: independent offsets per knob value. The world's
  micro-batch offsets are mostly one trend in log2(micro-batch), which that model cannot express, so its width
  there is the root mean square over the values: wider than the product's learnt one between tried values.
- **How much is there to learn?** Run the feasible configs in the order of their throughput as their knob
  values explain it (Distortion.knob_offsets: the truth less the per-config term), noise-free: the trials until
  98% of the optimum of a search that knew every knob value's offset and nothing else. Against it, the search's
  own first trial at 98%: the gap is the trials spent learning the offsets.

    python benchmarks/stop_bounds.py [--seeds 4] [--first-seed 0] [--noise 0.03] [--trials 30]
        [--out benchmarks/results/stop_bounds_noise3]

Prints markdown (stop_floor.py's tables, one per figure) and writes it with the per-sweep traces as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from autotune.backends.distorted import Distortion
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.envs.sampler import Task
from autotune.prediction.calibrate import error_observations
from autotune.prediction.uncertainty import NOISE_TIME, PRIOR_TIME, Uncertainty, fit_error_model
from autotune.rl.simulator import distorted_task
from autotune.search import confirm
from autotune.search.confirm import prior_sigma
from autotune.search.convergence import MIN_TRIALS, assess
from autotune.search_spaces import load_choices
from autotune.values.hardware import PROFILES
from autotune.values.workload import make_workload

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from search_efficiency import SPREAD, WORKLOADS, GiB, machine, source_state  # noqa: E402  (the same worlds)
from stop_floor import GOOD, first_good, report  # noqa: E402

STRATEGY = "hybrid"  # the default when these were measured (optuna since 2026-11-29)


def informed_chance(sweep: Sweep, backend, space, budget: int, launched: int, best) -> float:
    """The convergence figure after the sweep's trials (`best`: their recommendation, None if nothing fits), with
    the world's own prior widths and per-config spread (independent per config, as the world draws it)."""
    if best is None:
        return 1.0
    pruner = sweep.pruner
    sigma = confirm.spread(confirm.candidates(sweep.results, budget), sweep.launch_sigma).sigma
    seen = error_observations(pruner.measured, pruner.oom_peaks, pruner.workload, pruner.hardware,
                              pruner.calibration, budget)
    widths = (PRIOR_TIME[0], Distortion.widths(space, SPREAD))
    errors = Uncertainty(pruner.uncertainty.memory, fit_error_model(seen.time, widths, NOISE_TIME, evidence_weight=None))
    tried = {r.config for r in sweep.results}
    return assess((c for c in space if c not in tried), pruner.forecast, errors, budget, best.throughput, sigma,
                  launched, pruner.min_fit_probability, residual=backend.distortion.per_config_sigma,
                  pair_share=0.0).chance  # the world's per-config term is independent


def knob_order_reach(backend) -> int:
    """Trials until 98% of the optimum, running the feasible configs by their knob-explained throughput."""
    feasible = np.flatnonzero(backend.feasible)
    explained = backend.landscape.throughput * np.exp(backend.distortion.knob_offsets(backend.landscape.codes))
    order = feasible[np.argsort(-explained[feasible], kind="stable")]
    reached = np.maximum.accumulate(backend.throughput[order]) >= GOOD * backend.optimum
    return int(np.argmax(reached)) + 1


def one_sweep(task: Task, seed: int, noise: float, trials: int) -> dict:
    backend = distorted_task(task, SPREAD, noise, seed)
    space = backend.landscape.space
    sweep = Sweep.in_memory(space, task.memory_budget_bytes, STRATEGY, backend.name, seed,
                            launch_sigma=prior_sigma(backend.name, backend))
    curve: list[float] = []
    product: list[float] = []
    informed: list[float] = []
    for n in range(1, trials + 1):
        run_local(sweep, backend, Budget(n, stop_when=0), QuietProgress())
        launched = sum(r.status != "pruned" for r in sweep.results)
        if launched == len(curve):
            break  # the strategy had nothing left to run
        best = confirm.recommend(sweep.results, task.memory_budget_bytes)
        curve.append(backend.true_throughput(best.config) / backend.optimum if best else 0.0)
        product.append(sweep.convergence.chance if sweep.convergence else 1.0)
        informed.append(informed_chance(sweep, backend, space, task.memory_budget_bytes, launched, best))
    return {"seed": seed, "curve": curve, "product": product, "informed": informed,
            "knob_order_reach": knob_order_reach(backend)}


def markdown(runs: list[dict], args, trials: int) -> str:
    reach = [r["knob_order_reach"] for r in runs]
    first = [first_good(r, trials) for r in runs]
    lines = [f"# What any stop could do on the default search's trials: distorted world, {args.noise:.0%} noise",
             "", f"`python benchmarks/stop_bounds.py --seeds {args.seeds} --first-seed {args.first_seed} "
             f"--noise {args.noise} --trials {trials}` ({len(runs)} hybrid sweeps, the stop off; "
             f"{machine()}; {source_state()}). What the tables mean: the script's docstring.", "",
             "| | trials to 98% of the optimum, median | 90th pct |", "| --- | ---: | ---: |",
             f"| the configs in the order of their knob-explained throughput (offsets known) | "
             f"{statistics.median(reach):g} | {np.quantile(reach, 0.9):g} |",
             f"| the search (its first trial at 98%; the last trial where never) | {statistics.median(first):g} | "
             f"{np.quantile(first, 0.9):g} |", ""]
    for figure, what in (("product", "the product's figure"),
                         ("informed", "the figure told the world's prior widths and per-config spread")):
        lines += report([{"curve": r["curve"], "chances": r[figure]} for r in runs], what, MIN_TRIALS, trials)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.03)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    choices = load_choices("default")
    runs = []
    for model, gpus, batch, hw, budget_gib in WORKLOADS:
        task = Task(make_workload(model, batch, gpus), PROFILES[hw], budget_gib * GiB, choices)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run = one_sweep(task, seed, args.noise, args.trials)
            runs.append({"workload": f"{model} x{gpus} {hw} {budget_gib}GiB", **run})
            print(f"{runs[-1]['workload']:32} seed {seed}: best/opt after 12 {run['curve'][min(11, len(run['curve']) - 1)]:.3f}"
                  f", figure {run['product'][min(11, len(run['product']) - 1)]:.2f} (informed "
                  f"{run['informed'][min(11, len(run['informed']) - 1)]:.2f}), offsets known: 98% at "
                  f"{run['knob_order_reach']}", file=sys.stderr, flush=True)
    text = markdown(runs, args, args.trials)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                             "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
