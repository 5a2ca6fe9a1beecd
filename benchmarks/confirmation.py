"""Confirmation of close calls: how often it changes the recommendation, and by how much.

A search recommends the config with the best measurement; with launch-to-launch noise that is often a
lucky launch (the winner's curse). With `--confirm K` (autotune/search/confirm.py) the sweep leaves a share of its
trials to re-run the best and the configs within the launch spread of it, and recommends the best median.
This benchmark runs the tuner's own loop (Sweep + run_local, the Optuna strategy, estimator pruning and
calibration, as `autotune tune` does) twice per seed, at the same trial budget:

- `off`: `--confirm 0`, every trial searches; the pick is the best single measurement;
- `on`: `--confirm K`; "before" is what the same run would have picked from its search trials alone,
  "after" the confirmed pick. "Changed" counts runs whose pick moved; the loss is 1 - the pick's *true*
  throughput over the optimum (the best feasible true throughput of the space).

Truths ("worlds"):
- `replay`: benchmarks/surfaces/tiny-cpu.jsonl, 216 configs of the tiny model measured on this machine,
  at the device's memory and at a budget through the middle of the measured peaks;
- `distorted`: four simulated GPU workloads whose truth differs from the estimator (autotune.rl.simulator,
  spread 0.3), as in benchmarks/search_efficiency.py.
Launch noise, injected on every trial (the true throughput times a factor per launch):
- `quiet` lognormal sigma 0.03 (a quiet GPU node);
- `cpu-13%` lognormal with the 13% median difference between two launches measured here (ARCHITECTURE.md
  section 4);
- `cpu-loaded`: factors resampled from this machine's 216 pairs of launches under load
  (surfaces/repeats/tiny-cpu-2026-11-22.jsonl against tiny-cpu-shared-machine.jsonl: each pair's log ratio,
  random sign, over sqrt 2), heavy-tailed (2.3x at worst).
The sweep's prior spread is this machine's 13% in every case, as for real trials; its repeats replace it.

    python benchmarks/confirmation.py [--seeds 30] [--trials 30] [--repeats 2] [--strategy optuna]

Writes benchmarks/results/confirmation.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import optuna
from rich.console import Console
from rich.table import Table

from autotune.search import confirm
from autotune.backends.replay import ReplayBackend, load_surface, surface_space
from autotune.values.config import Config
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.envs.sampler import Task
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult, read_results
from autotune.rl.simulator import distorted_task
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.values.workload import make_workload

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from search_efficiency import SPREAD, finite  # noqa: E402  (the benchmarks share their truths)

GiB = 2**30
WORKLOADS = [  # (model, gpus, global batch, hardware, budget GiB per device), from search_efficiency.py
    ("gpt2-medium", 2, 64, "v100-32gb", 16),
    ("gpt2-xl", 4, 64, "l4", 24),
    ("llama-1b", 8, 256, "h100-80gb", 32),
    ("llama-7b", 8, 256, "a100-80gb", 80),
]
BAD = 0.05  # a pick more than 5% below the optimum


class Noise:
    """A factor per launch: lognormal, or resampled from measured pairs of launches."""

    def __init__(self, name: str, sigma: float = 0.0, log_ratios: tuple[float, ...] = ()) -> None:
        self.name, self.sigma, self.log_ratios = name, sigma, log_ratios

    def factor(self, rng: random.Random) -> float:
        if self.log_ratios:
            return math.exp(rng.choice((-1, 1)) * rng.choice(self.log_ratios) / math.sqrt(2))
        return math.exp(self.sigma * rng.gauss(0.0, 1.0))

    def describe(self) -> dict:
        if not self.log_ratios:
            return {"name": self.name, "sigma": self.sigma,
                    "median_pair_difference": math.expm1(confirm.TYPICAL * self.sigma)}
        ordered = sorted(math.expm1(abs(d)) for d in self.log_ratios)
        return {"name": self.name, "pairs": len(ordered), "median_pair_difference": statistics.median(ordered),
                "p90_pair_difference": ordered[int(0.9 * len(ordered))], "max_pair_difference": ordered[-1]}


def measured_pairs() -> tuple[float, ...]:
    """ln(a/b) of the configs measured in both recordings of the tiny-cpu space on 2026-11-22 (the loaded
    machine's launch-to-launch spread; the quiet 2026-11-23 recording runs 1.8x faster throughout)."""
    quiet = {r.config: r for r in read_results(ROOT / "surfaces" / "repeats" / "tiny-cpu-2026-11-22.jsonl") if r.ok}
    loaded = {r.config: r for r in read_results(ROOT / "surfaces" / "repeats" / "tiny-cpu-shared-machine.jsonl") if r.ok}
    return tuple(math.log(quiet[c].throughput / loaded[c].throughput) for c in quiet if c in loaded)


class Noisy:
    """A backend whose ok results are scaled by a launch noise factor (seeded)."""

    def __init__(self, inner, noise: Noise, seed: int) -> None:
        self.inner, self.noise, self.rng = inner, noise, random.Random(seed)
        self.name = inner.name
        self.fatal = None

    def run(self, config: Config) -> TrialResult:
        result = self.inner.run(config)
        if not result.ok:
            return result
        f = self.noise.factor(self.rng)
        return replace(result, throughput_samples_per_s=result.throughput * f,
                       tokens_per_s=None if result.tokens_per_s is None else result.tokens_per_s * f,
                       step_time_s=None if result.step_time_s is None else result.step_time_s / f)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Truth:
    world: str
    task: str
    space: Space
    budget: int
    make: Callable[[], object]  # a fresh noise-free backend
    true: Callable[[Config], float]
    optimum: float


@dataclass
class Run:
    world: str
    task: str
    noise: str
    seed: int
    loss_off: float
    loss_before: float
    loss_after: float
    changed: bool
    repeats: int
    finalists: int

    @property
    def gain(self) -> float:
        """True throughput gained by the change, as a share of the optimum (negative: lost)."""
        return self.loss_before - self.loss_after


def truths() -> list[Truth]:
    out = []
    surface = load_surface(ROOT / "surfaces" / "tiny-cpu.jsonl")
    space = surface_space(surface)
    peaks = sorted(r.peak_memory_bytes for r in surface.results.values() if r.ok and r.peak_memory_bytes)
    for budget in sorted({space.hardware.memory_bytes, peaks[len(peaks) // 2]}):
        best = surface.best(budget)
        assert best is not None
        out.append(Truth("replay", f"tiny-cpu {budget / GiB:.2f}GiB", space, budget,
                         lambda b=budget: ReplayBackend(surface, b),
                         lambda c, b=budget: surface.results[c].under_budget(b).throughput_samples_per_s or 0.0,
                         best.throughput))
    choices = load_choices("default")
    for model, gpus, batch, hw, budget_gib in WORKLOADS:
        task = Task(make_workload(model, batch, gpus), PROFILES[hw], budget_gib * GiB, choices)
        distorted = distorted_task(task, SPREAD, 0.0, seed=0)
        assert distorted.optimum is not None
        out.append(Truth("distorted", f"{model} x{gpus} {hw} {budget_gib}GiB", distorted.landscape.space,
                         budget_gib * GiB, lambda d=distorted: d, distorted.true_throughput, distorted.optimum))
    return out


def sweep(truth: Truth, noise: Noise, seed: int, trials: int, repeats: int, strategy: str) -> Sweep:
    backend = Noisy(truth.make(), noise, seed)
    # As for real trials: this machine's spread until repeats measure it.
    s = Sweep.in_memory(truth.space, truth.budget, strategy, backend.name, seed, launch_sigma=confirm.MACHINE_SIGMA)
    run_local(s, backend, Budget(trials, confirm=repeats), QuietProgress())
    return s


def one(truth: Truth, noise: Noise, seed: int, args) -> Run:
    def loss(pick: TrialResult | None) -> float:
        return 1.0 if pick is None else 1.0 - truth.true(pick.config) / truth.optimum

    off = sweep(truth, noise, seed, args.trials, 0, args.strategy)
    on = sweep(truth, noise, seed, args.trials, args.repeats, args.strategy)
    before = confirm.recommend([r for r in on.results if not confirm.is_repeat(r)], truth.budget)
    after = confirm.recommend(on.results, truth.budget)
    finalists = confirm.confirmation(on.results, truth.budget, confirm.MACHINE_SIGMA)
    return Run(truth.world, truth.task, noise.name, seed, loss(confirm.recommend(off.results, truth.budget)),
               loss(before), loss(after), (before and before.config) != (after and after.config),
               sum(confirm.is_repeat(r) for r in on.results), len(finalists.finalists) if finalists else 0)


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else math.nan


def summarize(runs: list[Run]) -> list[dict]:
    rows = []
    for world in ("replay", "distorted"):
        for noise in dict.fromkeys(r.noise for r in runs):
            rs = [r for r in runs if r.world == world and r.noise == noise]
            if not rs:
                continue
            changed = [r for r in rs if r.changed]
            rows.append({
                "world": world, "noise": noise, "runs": len(rs),
                "repeat_trials_mean": mean(r.repeats for r in rs),
                "changed_share": len(changed) / len(rs),
                "changed_better": sum(r.gain > 1e-9 for r in changed),
                "changed_worse": sum(r.gain < -1e-9 for r in changed),
                "mean_gain_when_changed": mean(r.gain for r in changed),
                "loss_off_mean": mean(r.loss_off for r in rs),
                "loss_before_mean": mean(r.loss_before for r in rs),
                "loss_after_mean": mean(r.loss_after for r in rs),
                "bad_off_share": sum(r.loss_off > BAD for r in rs) / len(rs),
                "bad_after_share": sum(r.loss_after > BAD for r in rs) / len(rs),
                "on_better_than_off": sum(r.loss_after < r.loss_off - 1e-9 for r in rs),
                "on_worse_than_off": sum(r.loss_after > r.loss_off + 1e-9 for r in rs),
            })
    return rows


COLUMNS = ("world", "noise", "runs", "repeats/run", "pick changed", "changed: better/worse", "gain when changed",
           "loss off", "loss before", "loss after", f"loss>{BAD:.0%} off", f"loss>{BAD:.0%} after",
           "on vs off: better/worse")


def cells(row: dict) -> list[str]:
    def pct(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.1%}"

    return [row["world"], row["noise"], str(row["runs"]), f"{row['repeat_trials_mean']:.1f}",
            f"{row['changed_share']:.0%}", f"{row['changed_better']}/{row['changed_worse']}",
            pct(row["mean_gain_when_changed"]), pct(row["loss_off_mean"]), pct(row["loss_before_mean"]),
            pct(row["loss_after_mean"]), f"{row['bad_off_share']:.0%}", f"{row['bad_after_share']:.0%}",
            f"{row['on_better_than_off']}/{row['on_worse_than_off']}"]


def markdown(result: dict, args) -> str:
    noises = "; ".join(f"{n['name']}: median difference between two launches {n['median_pair_difference']:.0%}"
                       + (f", p90 {n['p90_pair_difference']:.0%}, worst {n['max_pair_difference']:.0%}"
                          if "pairs" in n else "") for n in result["noises"])
    lines = ["# Confirmation of close calls", "",
             f"`python benchmarks/confirmation.py --seeds {args.seeds} --trials {args.trials} --repeats {args.repeats} "
             f"--strategy {args.strategy}` ({result['seconds'] / 60:.1f} min on {result['machine']}).", "",
             f"Per seed, two sweeps at the same budget of {args.trials} trials: `off` (--confirm 0) and `on` "
             f"(--confirm {args.repeats}); loss = 1 - the pick's true throughput / the optimum, mean over runs. "
             "`before`: the `on` run's pick from its search trials alone; `after`: its confirmed pick (best median). "
             "`pick changed`: runs where confirmation moved the pick; `better/worse`: in true throughput. "
             "`on vs off`: runs where the confirmed pick is truly better / worse than the unconfirmed run's.", "",
             f"Noise: {noises}.", "",
             "| " + " | ".join(COLUMNS) + " |", "| " + " | ".join(["---"] * 2 + ["---:"] * (len(COLUMNS) - 2)) + " |"]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in result["rows"]]
    lines += ["", "Tasks: " + "; ".join(result["tasks"]), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=confirm.DEFAULT_REPEATS)
    parser.add_argument("--strategy", default="optuna")
    parser.add_argument("--worlds", default="replay,distorted")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "confirmation")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = Console(width=180)
    noises = [Noise("quiet", 0.03), Noise("cpu-13%", confirm.MACHINE_SIGMA), Noise("cpu-loaded", log_ratios=measured_pairs())]
    start = time.perf_counter()
    runs: list[Run] = []
    chosen = [t for t in truths() if t.world in args.worlds.split(",")]
    for truth in chosen:
        for noise in noises:
            batch = [one(truth, noise, seed, args) for seed in range(args.seeds)]
            runs += batch
            console.print(f"{truth.world:9} {truth.task:30} {noise.name:10}: changed {sum(r.changed for r in batch):2}"
                          f"/{len(batch)}, loss off {mean(r.loss_off for r in batch):.3f} before "
                          f"{mean(r.loss_before for r in batch):.3f} after {mean(r.loss_after for r in batch):.3f}",
                          highlight=False)
    rows = summarize(runs)
    result = {"seconds": time.perf_counter() - start,
              "machine": f"{platform.node() or 'this machine'}, {platform.processor() or platform.machine()}",
              "noises": [n.describe() for n in noises], "tasks": [f"{t.world}: {t.task}" for t in chosen],
              "rows": rows, "runs": [asdict(r) for r in runs]}
    table = Table(title="confirmation of close calls")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*cells(row))
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(finite(result), indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result, args))
    console.print(f"wrote {args.out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
