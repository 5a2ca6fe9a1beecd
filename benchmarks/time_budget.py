"""Does a sweep end within its --time-budget? (issue 41)

On rl_evaluation's held-out simulated GPU worlds (GPU-like trial times: each op's first build, an offloaded
optimizer's longer initialize, 3% noise), the default strategy runs under a time budget of K times the task's unit
(the predicted seconds of a trial of its predicted best config, envs/episodes.py `seconds_unit`), the convergence stop
at its default, once under the rule as shipped (no trial starts that the sweep expects to end after the budget:
drivers/sweep.py `Sweep._overruns`) and once under the rule before it (no trial starts once the budget is spent).
Per rule and K: runs, the trial-seconds past the budget (median, 90th percentile, worst, as a share of the budget),
the runs that ended within it, the median trials launched and the recommendation's true throughput over the optimum
at the end (median, 5th percentile).

    python benchmarks/time_budget.py [--budgets 4,8] [--seeds 3] [--strategy hybrid] [--out DIR]

Writes time_budget.md and time_budget.json to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import numpy as np
from rich.console import Console

import rl_evaluation as rle  # beside this script
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.envs.episodes import seconds_unit
from autotune.rl.policy import Policy
from autotune.rl.simulator import distorted_task
from search_efficiency import machine, source_state

ROOT = Path(__file__).resolve().parent
RULES = ("expected end", "spent")  # as shipped; before issue 41's change


def run(task, seed: int, k: float, strategy: str, rule: str, policy: Policy) -> dict:
    truth = distorted_task(task, 0.3, 0.03, seed)
    unit = seconds_unit(task, truth.landscape)
    budget_s = k * unit
    space, budget = truth.landscape.space, task.memory_budget_bytes
    sweep = Sweep.in_memory(space, budget, lambda context: rle.strategy_for(strategy, context, policy),
                            truth.name, seed)
    with mock.patch.object(Sweep, "_overruns", lambda *a: False) if rule == "spent" else mock.MagicMock():
        reason = run_local(sweep, truth.with_noise_seed(seed), Budget(30, budget_s), QuietProgress())
    best = sweep.best
    value = truth.true_throughput(best.config) / truth.optimum if best is not None else 0.0
    return {"task": rle.task_name(task), "seed": seed, "k": k, "rule": rule, "budget_s": budget_s,
            "spent_s": sweep.spent_s, "over": max(0.0, sweep.spent_s - budget_s) / budget_s,
            "launched": sweep.launched, "best": value, "reason": str(reason)}


def summary(runs: list[dict]) -> dict:
    over = sorted(r["over"] for r in runs)
    best = sorted(r["best"] for r in runs)
    return {"runs": len(runs), "over_median": statistics.median(over), "over_p90": over[int(0.9 * (len(over) - 1))],
            "over_max": over[-1], "within": sum(r["over"] == 0 for r in runs) / len(runs),
            "launched": statistics.median(r["launched"] for r in runs), "best_median": statistics.median(best),
            "best_p5": best[max(0, int(np.ceil(0.05 * len(best))) - 1)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=lambda t: [float(x) for x in t.split(",")], default=[4.0, 8.0],
                        help="time budgets in units of the task's predicted best trial")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--strategy", default="hybrid")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    console = Console()
    policy = Policy.load(rle.policy_path())
    runs = []
    for kind, task, _ in rle.simulated_tasks(16, 0):
        if kind != "gpu":
            continue
        for seed in range(args.seeds):
            for k in args.budgets:
                line = []
                for rule in RULES:
                    r = run(task, seed, k, args.strategy, rule, policy)
                    runs.append(r)
                    line.append(f"{rule}: {r['spent_s']:,.0f} s, {r['launched']} trials, {r['best']:.3f}")
                console.print(f"{rle.task_name(task)} seed {seed} budget {k:g} units "
                              f"({runs[-1]['budget_s']:,.0f} s): " + "; ".join(line), highlight=False)
    rows = {f"{rule} x{k:g}": summary([r for r in runs if r["rule"] == rule and r["k"] == k])
            for k in args.budgets for rule in RULES}
    command = "python benchmarks/time_budget.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# A sweep within its --time-budget (issue 41)", "",
             f"`{command.strip()}` ({machine()}; {source_state()}).", "",
             f"Held-out simulated GPU worlds (rl_evaluation's, GPU-like trial times, 3% noise), `{args.strategy}` with "
             "the convergence stop at its default and at most 30 trials, under a time budget of K units (a unit: the "
             "task's predicted trial of its predicted best config). `expected end`: no trial starts that the sweep "
             "expects to end after the budget (as shipped); `spent`: no trial starts once it is spent (before). Past "
             "the budget: the trial-seconds beyond it, as a share of it.", "",
             "| rule | K | runs | past the budget: median | p90 | worst | runs within it | trials (median) | "
             "best/opt at the end (median) | p5 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k in args.budgets:
        for rule in RULES:
            s = rows[f"{rule} x{k:g}"]
            lines.append(f"| {rule} | {k:g} | {s['runs']} | {s['over_median']:.0%} | {s['over_p90']:.0%} | "
                         f"{s['over_max']:.0%} | {s['within']:.0%} | {s['launched']:g} | {s['best_median']:.3f} | "
                         f"{s['best_p5']:.3f} |")
    console.print("\n".join(lines[6:]), highlight=False)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "time_budget.md").write_text("\n".join(lines) + "\n")
    (args.out / "time_budget.json").write_text(json.dumps({"command": command, "rows": rows, "runs": runs},
                                                          indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
