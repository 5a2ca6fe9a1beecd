"""How early any stop could end a sweep, from a search_efficiency run's per-run records (issue 28).

The convergence stop's goal is a median of at most 12 launched trials until the stop with the recommendation at
least 0.98 of the optimum in the median and 0.95 at the 5th percentile. Two things bound what a stop can do,
whatever its figure, and this script reads both from the `runs` of benchmarks/search_efficiency.py's JSON (each
run's `curve`, the recommendation's true throughput over the optimum after each launched trial, and `chances`,
the convergence figure after each trial; simulated and replay sweeps confirm nothing, so the figure is a function
of the trials so far):

- the oracle's floor: a stop that knew the truth would end each sweep at the first trial whose recommendation is
  at 98% of the optimum (the sweep's last trial where none is); for the median of the stopped recommendations to
  be at 0.98, at least half of the sweeps must end at or after that trial, so the median trials until the stop
  is at least about the median of those first trials;
- the figure's own threshold trade-off: the stop at every threshold from 0.05 to 0.8 (at least --min-trials
  trials, at most --trials), so the threshold that would bring the median stop to 12 trials shows what the
  recommendation's 5th percentile would then be; and, after 10 and 12 trials, the share of sweeps already at
  98% and how well the figure ranks those above the rest (AUC: the chance that a sweep at 98% shows a lower
  figure than one not yet there).

    python benchmarks/stop_floor.py benchmarks/results/search_efficiency_stop_noise3.json [--world distorted]
        [--noise 0.03] [--strategy optuna]   (default: the default strategy)

Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from autotune.api import DEFAULT_STRATEGY
from autotune.search.convergence import MIN_TRIALS

THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
GOOD = 0.98


def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    i = q * (len(xs) - 1)
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def stop_at(run: dict, threshold: float, min_trials: int, trials: int) -> int:
    """Launched trials until the stop at `threshold` (1-based), or the run's last trial within `trials`."""
    last = min(trials, len(run["curve"]))
    return next((i for i, c in enumerate(run["chances"][:last], 1) if i >= min_trials and c < threshold), last)


def first_good(run: dict, trials: int) -> int:
    last = min(trials, len(run["curve"]))
    return next((i for i, b in enumerate(run["curve"][:last], 1) if b >= GOOD), last)


def auc(good: list[float], bad: list[float]) -> float | None:
    if not good or not bad:
        return None
    return sum((g < b) + 0.5 * (g == b) for g in good for b in bad) / (len(good) * len(bad))


def report(runs: list[dict], name: str, min_trials: int, trials: int) -> list[str]:
    out = [f"## {name} ({len(runs)} runs)", ""]
    floor = statistics.median(first_good(r, trials) for r in runs)
    out += [f"Oracle's floor (median first trial at {GOOD:.0%} of the optimum, the last trial where never): "
            f"{floor:g} trials.", ""]
    out += ["| after trials | sweeps at 98% | figure, median (at 98%) | figure, median (not yet) | AUC |",
            "| ---: | ---: | ---: | ---: | ---: |"]
    for t in (10, 12):
        good = [r["chances"][t - 1] for r in runs if len(r["curve"]) >= t and r["curve"][t - 1] >= GOOD]
        bad = [r["chances"][t - 1] for r in runs if len(r["curve"]) >= t and r["curve"][t - 1] < GOOD]
        area = auc(good, bad)
        out.append(f"| {t} | {len(good) / max(len(good) + len(bad), 1):.0%} | "
                   f"{statistics.median(good) if good else float('nan'):.2f} | "
                   f"{statistics.median(bad) if bad else float('nan'):.2f} | "
                   f"{'-' if area is None else f'{area:.2f}'} |")
    out += ["", "| threshold | trials to stop | best/opt at stop | 5th pct | stopped < 98% |",
            "| ---: | ---: | ---: | ---: | ---: |"]
    for th in THRESHOLDS:
        stops = [stop_at(r, th, min_trials, trials) for r in runs]
        bests = [r["curve"][s - 1] for r, s in zip(runs, stops)]
        out.append(f"| {th:g} | {statistics.median(stops):g} | {statistics.median(bests):.3f} | "
                   f"{percentile(bests, 0.05):.3f} | {sum(b < GOOD for b in bests) / len(bests):.0%} |")
    return out + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="search_efficiency or search_seconds JSON files")
    parser.add_argument("--world", default=None, help="one world only (default: each)")
    parser.add_argument("--noise", type=float, default=None,
                        help="one noise level only (search_seconds' runs hold several; default: all)")
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY)
    parser.add_argument("--min-trials", type=int, default=MIN_TRIALS)
    parser.add_argument("--trials", type=int, default=30, help="the default trial budget the goals are about")
    args = parser.parse_args(argv)
    lines: list[str] = []
    for path in args.results:
        data = json.loads(path.read_text())
        worlds = sorted({r["world"] for r in data["runs"]} if args.world is None else {args.world})
        for world in worlds:
            runs = [r for r in data["runs"] if r["world"] == world and r["strategy"] == args.strategy
                    and r.get("chances") and (args.noise is None or r.get("noise") == args.noise)]
            noise = "" if args.noise is None else f", {args.noise:.0%} noise"
            if runs:
                lines += report(runs, f"{path.name}: {world}{noise}, {args.strategy}", args.min_trials, args.trials)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
