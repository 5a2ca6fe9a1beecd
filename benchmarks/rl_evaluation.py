"""Evaluation of the RL policy against the searches, side by side in one run, on workloads the policy
never saw in training:

- held-out simulated tasks: the test split of the training samplers (held-out model shapes, budget
  fractions and the `l4` profile for GPUs; held-out shapes and budget for the CPU profile), each on a
  distorted simulation (autotune.rl.simulator: the truth differs from the estimator by a hidden,
  structured distortion and trials carry step-time noise), a fresh distortion per seed;
- the committed real replay surfaces (benchmarks/surfaces/*.jsonl), at the device's memory and at a
  budget that cuts through the surface's measured peaks.

Every strategy (rl, hybrid, optuna, random, grid, and `deepspeed`: DeepSpeed's autotuner's own order in its fast
mode, benchmarks/peer_deepspeed_autotuner.py's DeepSpeedSchedule) runs through the same sweep loop as
`autotune tune` (estimator pruning included) for up to --trials launched trials, >= 5 seeds each. Figures per
strategy (those of the search-efficiency benchmark): median trials to reach 98% of the optimum (runs that never
reach it count as infinite), median best/optimum after 5 and 10 trials, mean OOM trials per run, and
the share of runs within 5% of the optimum after 5 trials. A simulated run's best config is judged by
its true, noise-free throughput; the optimum is the best feasible true throughput of the space.

In seconds (issue 41): simulated trials take GPU-like wall times (the distorted backend's `trial_times`:
autotune.prediction.trial_time at the config's true step time, each op's first build once per run, the world's
noise on them), replayed ones their recorded wall times; per strategy the trial-seconds (launched trials' wall
times summed) to 95% and 98% of the optimum (median, 5th and 95th percentile) and at the convergence stop
(search_efficiency's rule on the figure each trial recorded), and the median's ratio to optuna's and to the
deepspeed schedule's.

    python benchmarks/rl_evaluation.py [--seeds 5] [--tasks 16] [--trials 25] [--policy DIR]

Writes benchmarks/results/rl_evaluation.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import optuna
from rich.console import Console
from rich.table import Table

from autotune.backends.replay import ReplayBackend, load_surface, surface_space
from search_efficiency import (FAR, finite, machine, quantile, ratio, seconds_to, source_state,  # beside this script
                               strategy_arg)
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.envs.sampler import Task, WorkloadSampler
from autotune.rl.policy import Policy
from autotune.rl.simulator import distorted_task
from autotune.rl.train import samplers
from autotune.values.space import Space
from autotune.strategies import SearchContext, make_strategy
from autotune.strategies.hybrid import HybridStrategy
from autotune.strategies.rl import RLStrategy
from autotune.policies import policy_path
from autotune.api import DEFAULT_TRIALS
from autotune.search.convergence import DEFAULT_STOP_WHEN, MIN_TRIALS

ROOT = Path(__file__).resolve().parent
STRATEGIES = ("rl", "hybrid", "optuna", "random", "grid", "deepspeed")
EXTRA = {"hybrid-interleaved": lambda c, p: HybridStrategy(c, p, interleave=True)}  # design comparisons
NEAR = 0.98


@dataclass
class Run:
    kind: str  # "gpu", "cpu" (held-out simulated) or "replay"
    task: str
    strategy: str
    seed: int
    curve: list[float]  # best/optimum after each launched trial (0 before any feasible one)
    oom: int
    pruned: int
    launched: int
    held_out: tuple[str, ...] = ()
    proposal_ms: list[float] = field(default_factory=list)
    # The convergence stop's figure (autotune.search.convergence) after the run's last trial: for rl, at its own stop.
    chance_at_end: float = math.nan
    walls: list[float] = field(default_factory=list)  # each launched trial's wall seconds
    chances: list[float] = field(default_factory=list)  # the convergence figure after each launched trial

    def trials_to(self, level: float) -> float:
        return next((i + 1 for i, v in enumerate(self.curve) if v >= level), math.inf)

    def seconds_to(self, level: float) -> float:
        """Trial-seconds until best/optimum reached `level` (inf: never)."""
        return seconds_to(self.curve, self.walls, level)

    def stop_at(self) -> int:
        """Launched trials until the convergence stop (the tuner's threshold and minimum trials) would have ended
        the run, within the tuner's default trial budget; else the run's own end."""
        for i, p in enumerate(self.chances[:DEFAULT_TRIALS]):
            if i + 1 >= MIN_TRIALS and p < DEFAULT_STOP_WHEN:
                return i + 1
        return min(len(self.curve), DEFAULT_TRIALS)

    def seconds_at_stop(self) -> float:
        return sum(self.walls[:self.stop_at()])

    def after(self, n: int) -> float:
        if not self.curve:
            return 0.0
        return self.curve[min(n, len(self.curve)) - 1]


class Timed:
    """A strategy wrapper that times each proposal (the policy's inference cost)."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.ms = inner, inner.name, []

    def propose(self):
        start = time.perf_counter()
        config = self.inner.propose()
        self.ms.append(1000 * (time.perf_counter() - start))
        return config

    def observe(self, config, result) -> None:
        self.inner.observe(config, result)


def strategy_for(name: str, context: SearchContext, policy: Policy):
    if name in EXTRA:
        return EXTRA[name](context, policy)
    if name == "rl":
        return RLStrategy(context, policy)
    if name == "hybrid":
        return HybridStrategy(context, policy)
    return make_strategy(strategy_arg(name), context)


def run_one(name: str, space: Space, backend, budget: int, optimum: float, trials: int, seed: int, policy: Policy,
            true_value) -> tuple[list[float], int, int, int, list[float], float, list[float], list[float]]:
    """(curve, OOM trials, pruned, launched, proposal ms, chance at the end, each launched trial's wall seconds and
    convergence figure)."""
    # Calibrated from the measured trials as `autotune tune` does: the pruner's margin adapts.
    sweep = Sweep.in_memory(space, budget, lambda context: Timed(strategy_for(name, context, policy)),
                            backend.name, seed)
    strategy = sweep.strategy
    # The convergence stop off: each strategy ends by its own rule (rl's stop action) or the trial budget.
    run_local(sweep, backend, Budget(trials, stop_when=0), QuietProgress())
    curve, walls, chances, best_measured, best_true = [], [], [], 0.0, 0.0
    for result in sweep.results:
        if result.status == "pruned":
            continue
        walls.append(float(result.wall_time_s))
        chances.append(float(result.extra.get("chance_of_better", math.nan)))
        if result.fits(budget) and result.throughput_samples_per_s > best_measured:
            # The tuner recommends its best measured config; judge that config by its true throughput.
            best_measured = result.throughput_samples_per_s
            best_true = true_value(result)
        curve.append(best_true / optimum)
    oom = sum(r.status == "oom" for r in sweep.results)
    pruned = sum(r.status == "pruned" for r in sweep.results)
    chance = sweep.convergence.chance if sweep.convergence is not None else math.nan
    return curve, oom, pruned, len(curve), strategy.ms, chance, walls, chances


def simulated_tasks(count: int, seed: int) -> list[tuple[str, Task, tuple[str, ...]]]:
    """Held-out tasks: the test split of the training samplers, 3/4 GPU and 1/4 CPU."""
    out = []
    settings = samplers("test", 64, 1000 + seed, 0.25)
    for part, n in zip(settings, (count - count // 4, count // 4)):
        s = dict(part)
        s.pop("weight")
        sampler = WorkloadSampler(**{**s, "pool_size": None})
        rng = np.random.default_rng(seed + (7 if s.get("profiles") == ["cpu"] else 0))
        kind = "cpu" if s.get("profiles") == ["cpu"] else "gpu"
        while sum(k == kind for k, _, _ in out) < n:
            task = sampler.draw(rng)
            truth = distorted_task(task, 0.3, 0.0, 0)
            if truth.optimum is None or truth.feasible.sum() < 3:
                continue  # nothing (or almost nothing) fits: no search to compare
            out.append((kind, task, sampler.held_out(task)))
    return out


def task_name(task: Task) -> str:
    w = task.workload
    return (f"{w.model.name} ({w.model.params / 1e6:,.0f}M) x{w.gpus} {task.hardware.name} batch {w.global_batch} "
            f"{task.memory_budget_bytes / 2**30:.1f}GiB")


def evaluate(args: argparse.Namespace, console: Console) -> list[Run]:
    policy = Policy.load(args.policy)
    runs: list[Run] = []
    tasks = simulated_tasks(args.tasks, 0)
    names = args.strategies
    jobs = len(tasks) * args.seeds * len(names)
    surfaces = sorted((ROOT / "surfaces").glob("*.jsonl")) if (ROOT / "surfaces").is_dir() else []
    done = 0
    for kind, task, held in tasks:
        for seed in range(args.seeds):
            truth = distorted_task(task, args.randomize, args.noise, seed)
            space = truth.landscape.space
            for name in names:
                backend = truth.with_noise_seed(seed)  # the same truth and noise draws for every strategy
                curve, oom, pruned, launched, ms, chance, walls, chances = run_one(
                    name, space, backend, task.memory_budget_bytes, truth.optimum, args.trials, seed, policy,
                    lambda r, t=truth: t.true_throughput(r.config))
                runs.append(Run(kind, task_name(task), name, seed, curve, oom, pruned, launched, held, ms, chance,
                                walls, chances))
                done += 1
            console.print(f"[{done}/{jobs}] {kind} {task_name(task)} seed {seed} "
                          + "  ".join(f"{r.strategy} {r.after(5):.2f}/{r.trials_to(NEAR)}" for r in runs[-len(names):]),
                          highlight=False)
    for path in surfaces:
        surface = load_surface(path)
        space = surface_space(surface)
        peaks = sorted(r.peak_memory_bytes for r in surface.results.values() if r.ok and r.peak_memory_bytes)
        budgets = [space.hardware.memory_bytes] + ([peaks[len(peaks) // 2]] if peaks else [])
        for budget in budgets:
            best = surface.best(budget)
            if best is None:
                continue
            optimum = best.throughput_samples_per_s
            for seed in range(args.seeds):
                for name in names:
                    curve, oom, pruned, launched, ms, chance, walls, chances = run_one(
                        name, space, ReplayBackend(surface, budget), budget, optimum, args.trials, seed, policy,
                        lambda r: r.throughput_samples_per_s)
                    runs.append(Run("replay", f"{path.name} ({len(surface)} configs) {budget / 2**30:.2f}GiB", name, seed, curve, oom, pruned,
                                    launched, ("surface",), ms, chance, walls, chances))
            console.print(f"replay {path.name} at {budget / 2**30:.2f}GiB: {args.seeds} seeds done", highlight=False)
    return runs


def estimator_bounds(args: argparse.Namespace) -> dict[str, float]:
    """How far the estimator alone gets on the held-out simulated tasks: the share of (task, seed) runs
    whose best predicted config, and the truly best of the five best predicted configs (picked by an
    oracle, no noise), are within 5% of the optimum. A search must beat the second figure to be within 5%
    after 5 trials without learning from its measurements."""
    top1 = top5 = runs = 0
    for _, task, _ in simulated_tasks(args.tasks, 0):
        for seed in range(args.seeds):
            truth = distorted_task(task, args.randomize, args.noise, seed)
            land = truth.landscape
            fits = np.flatnonzero(land.feasible(task.memory_budget_bytes))
            best = fits[np.argsort(-land.throughput[fits])][:5]
            true = np.where(truth.feasible, truth.throughput, 0.0)[best]
            runs += 1
            top1 += bool(true[0] >= 0.95 * truth.optimum)
            top5 += bool(true.max() >= 0.95 * truth.optimum)
    return {"runs": runs, "best_predicted_within_5pct": top1 / runs, "best_of_top5_predicted_within_5pct": top5 / runs}


def load_times(policy: Path) -> dict:
    """Time to load the policy files, and what a fresh process pays to import torch (and whether Ray is imported)."""
    import subprocess

    times = []
    for _ in range(5):
        start = time.perf_counter()
        Policy.load(policy)
        times.append(1000 * (time.perf_counter() - start))
    code = ("import time, sys; t = time.perf_counter(); import torch; d = time.perf_counter() - t; "
            f"from autotune.rl.policy import Policy; Policy.load({str(policy)!r}); "
            "print(d, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return {"load_ms": statistics.median(times), "torch_import_s": float(out[0]), "ray_imported": out[1]}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summary(runs: list[Run], kind: str | None) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r.strategy for r in runs):
        mine = [r for r in runs if r.strategy == name and (kind is None or r.kind == kind)]
        if not mine:
            continue
        reach = [r.trials_to(NEAR) for r in mine]
        rows.append({
            "strategy": name, "runs": len(mine),
            "median_trials_to_98pct": median(reach),
            "reached_98pct": sum(math.isfinite(x) for x in reach) / len(mine),
            "best_over_optimum_after_5": median([r.after(5) for r in mine]),
            "best_over_optimum_after_10": median([r.after(10) for r in mine]),
            "within_5pct_after_5": sum(r.after(5) >= 0.95 for r in mine) / len(mine),
            "oom_trials_per_run": statistics.mean(r.oom for r in mine),
            "pruned_per_run": statistics.mean(r.pruned for r in mine),
            "launched_per_run": statistics.mean(r.launched for r in mine),
            # Checked against the convergence stop: the chance of a better config where the run ended.
            "median_chance_at_end": median([r.chance_at_end for r in mine]),
            "chance_below_5pct_at_end": sum(r.chance_at_end < 0.05 for r in mine) / len(mine),
            "best_over_optimum_at_end": median([r.after(len(r.curve)) for r in mine]),
            # Where the figure said the run was done (under 5%): how close its best was to the optimum.
            "best_at_end_where_under_5pct": median([r.after(len(r.curve)) for r in mine if r.chance_at_end < 0.05]),
            "end_under_5pct_below_98": sum(r.chance_at_end < 0.05 and r.after(len(r.curve)) < NEAR for r in mine)
            / len(mine),
            **seconds_figures(mine),
        })
    by_name = {row["strategy"]: row for row in rows}
    for row in rows:
        for ref in ("optuna", "deepspeed"):
            if ref in by_name:
                row[f"trial_s_to_98_over_{ref}"] = ratio(row["median_trial_s_to_98"],
                                                         by_name[ref]["median_trial_s_to_98"])
    return rows


def seconds_figures(runs: list[Run]) -> dict:
    """Issue 41's trial-seconds over `runs` (search_efficiency.seconds_row's figures)."""
    to_95 = [r.seconds_to(FAR) for r in runs]
    to_98 = [r.seconds_to(NEAR) for r in runs]
    return {"median_trial_s_to_95": median(to_95), "median_trial_s_to_98": median(to_98),
            "p5_trial_s_to_98": quantile(to_98, 0.05), "p95_trial_s_to_98": quantile(to_98, 0.95),
            "median_trials_to_stop": median([r.stop_at() for r in runs]),
            "median_trial_s_at_stop": median([r.seconds_at_stop() for r in runs]),
            "median_trial_s_per_trial": median([w for r in runs for w in r.walls])}


def fmt(x: float, pattern: str) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "never"
    if isinstance(x, float) and math.isnan(x):
        return "-"
    return format(x, pattern)


COLUMNS = (("strategy", "strategy", "s"), ("runs", "runs", "d"), ("median trials to 98%", "median_trials_to_98pct", "g"),
           ("runs reaching 98%", "reached_98pct", ".0%"), ("best/opt after 5", "best_over_optimum_after_5", ".3f"),
           ("best/opt after 10", "best_over_optimum_after_10", ".3f"), ("within 5% after 5", "within_5pct_after_5", ".0%"),
           ("OOM trials/run", "oom_trials_per_run", ".2f"), ("pruned/run", "pruned_per_run", ".1f"),
           ("launched/run", "launched_per_run", ".1f"), ("chance of better at end", "median_chance_at_end", ".0%"),
           ("ended under 5%", "chance_below_5pct_at_end", ".0%"), ("best/opt at end", "best_over_optimum_at_end", ".3f"),
           ("best/opt at end, under 5%", "best_at_end_where_under_5pct", ".3f"),
           ("under 5% but < 98%", "end_under_5pct_below_98", ".0%"))
# Issue 41: the same runs in trial-seconds.
SECONDS_COLUMNS = (("strategy", "strategy", "s"), ("runs", "runs", "d"), ("trials to 98%", "median_trials_to_98pct", "g"),
                   ("trial-s to 95%", "median_trial_s_to_95", ",.0f"), ("trial-s to 98%", "median_trial_s_to_98", ",.0f"),
                   ("p5", "p5_trial_s_to_98", ",.0f"), ("p95", "p95_trial_s_to_98", ",.0f"),
                   ("trials to stop", "median_trials_to_stop", "g"), ("trial-s at stop", "median_trial_s_at_stop", ",.0f"),
                   ("s/trial", "median_trial_s_per_trial", ",.0f"),
                   ("98% s / optuna's", "trial_s_to_98_over_optuna", ".2f"),
                   ("98% s / deepspeed's", "trial_s_to_98_over_deepspeed", ".2f"))
CLASSES = (("gpu", "held-out simulated GPU tasks"), ("cpu", "held-out simulated CPU tasks"),
           ("replay", "real replay surfaces"), (None, "all"))


def tables(runs: list[Run]) -> dict[str, list[dict]]:
    return {title: summary(runs, kind) for kind, title in CLASSES if any(kind is None or r.kind == kind for r in runs)}


def markdown(runs: list[Run], args: argparse.Namespace, policy: Policy, seconds: float) -> str:
    lines = ["# RL policy evaluation", "",
             f"`python benchmarks/rl_evaluation.py --seeds {args.seeds} --tasks {args.tasks} --trials {args.trials}"
             f" --randomize {args.randomize} --noise {args.noise} --strategies {','.join(args.strategies)}`"
             f" ({seconds / 60:.1f} min, {args.machine}; {args.source}).", "",
             "Chance of better at end: the convergence stop's figure (autotune.search.convergence, the quantity the "
             "environment's info carries as `chance_of_better`) after the run's last trial; for rl that is where the "
             "trial budget or the policy's training horizon ended the run (the tuner masks the policy's own stop "
             "since commit 3bca35c; before, its stop ended most runs, and `ended under 5%` and `best/opt at end, "
             "under 5%` checked that stop against the figure the tuner would have stopped on).", "",
             f"Policy: `{args.policy}` (trained {policy.meta.get('training', {}).get('figures', {}).get('iteration', '?')}"
             f" iterations). Optimum: best feasible true throughput of the space; trials counted as launched"
             " (pruned configs cost nothing).", ""]
    for title, rows in tables(runs).items():
        lines += [f"## {title}", "", "| " + " | ".join(c for c, _, _ in COLUMNS) + " |",
                  "|" + "---|" * len(COLUMNS)]
        for row in rows:
            lines.append("| " + " | ".join(fmt(row[k], p) for _, k, p in COLUMNS) + " |")
        lines += ["", "In trial-seconds (launched trials' wall times summed; median, and 5th / 95th percentile over "
                  "runs; the ratios are of the medians to 98%):", "",
                  "| " + " | ".join(c for c, _, _ in SECONDS_COLUMNS) + " |", "|" + "---|" * len(SECONDS_COLUMNS)]
        for row in rows:
            lines.append("| " + " | ".join(fmt(row.get(k, math.nan), p) for _, k, p in SECONDS_COLUMNS) + " |")
        lines.append("")
    ms = [m for r in runs if r.strategy == "rl" for m in r.proposal_ms]
    if ms:
        load = load_times(args.policy)
        lines += [f"Policy inference, without Ray: loading the policy files {load['load_ms']:.1f} ms (median of 5; "
                  f"Python's import of torch not counted: {load['torch_import_s']:.1f} s in a fresh process), "
                  f"a proposal of `rl` median {median(ms):.2f} ms (p95 {np.percentile(ms, 95):.2f} ms, max "
                  f"{max(ms):.1f} ms over {len(ms)} proposals; the first one of a search builds the environment's "
                  f"view of the space). Ray imported: {'yes' if load['ray_imported'] == 'True' else 'no'}.", ""]
    bounds = estimator_bounds(args)
    lines += [f"The estimator alone on the held-out simulated tasks ({bounds['runs']} task x seed runs): its best "
              f"predicted config is within 5% of the optimum in {bounds['best_predicted_within_5pct']:.0%} of them, "
              f"the truly best of its five best predicted configs in {bounds['best_of_top5_predicted_within_5pct']:.0%}.",
              ""]
    names = list(dict.fromkeys(r.strategy for r in runs))
    lines += ["## Per task (median over seeds: trials to 98% / best/optimum after 5)", "",
              "| task | held out | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for task in dict.fromkeys(r.task for r in runs):
        mine = [r for r in runs if r.task == task]
        cells = []
        for name in names:
            rs = [r for r in mine if r.strategy == name]
            cells.append(f"{fmt(median([r.trials_to(NEAR) for r in rs]), 'g')} / {median([r.after(5) for r in rs]):.2f}")
        lines.append(f"| {task} | {','.join(mine[0].held_out) or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def show(runs: list[Run], console: Console) -> None:
    for title, rows in tables(runs).items():
        table = Table(title=title)
        for column, _, _ in COLUMNS:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*(fmt(row[k], p) for _, k, p in COLUMNS))
        console.print(table)
        seconds = Table(title=f"{title}: trial-seconds")
        for column, _, _ in SECONDS_COLUMNS:
            seconds.add_column(column, justify="right")
        for row in rows:
            seconds.add_row(*(fmt(row.get(k, math.nan), p) for _, k, p in SECONDS_COLUMNS))
        console.print(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=16, help="held-out simulated tasks (3/4 GPU, 1/4 CPU)")
    parser.add_argument("--trials", type=int, default=25, help="launched trials per run at most")
    parser.add_argument("--randomize", type=float, default=0.3, help="spread of the hidden truth (as in training)")
    parser.add_argument("--noise", type=float, default=0.1, help="step-time noise sigma (as in training)")
    parser.add_argument("--policy", type=Path, default=policy_path(), help="policy directory (default: the shipped one)")
    parser.add_argument("--strategies", type=lambda t: t.split(","), default=list(STRATEGIES),
                        help=f"comma-separated, from {', '.join((*STRATEGIES, *EXTRA))} (default: the first six)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "rl_evaluation")
    args = parser.parse_args(argv)
    unknown = set(args.strategies) - set(STRATEGIES) - set(EXTRA)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}: allowed {', '.join((*STRATEGIES, *EXTRA))}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = Console(width=max(Console().width, 160))
    start = time.monotonic()
    args.source = source_state()
    runs = evaluate(args, console)
    seconds = time.monotonic() - start
    args.machine = machine()
    show(runs, console)
    policy = Policy.load(args.policy)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(runs, args, policy, seconds))
    data = {"settings": {k: str(v) for k, v in vars(args).items()}, "tables": tables(runs),
            "runs": [{k: v for k, v in r.__dict__.items() if k != "proposal_ms"} for r in runs]}
    args.out.with_suffix(".json").write_text(json.dumps(finite(data), indent=1))
    console.print(f"written {args.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
