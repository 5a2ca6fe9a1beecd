"""Issue 41's search in seconds: how many trial-seconds each strategy spends until its recommendation is within
98% of the optimum, the guided strategies' cost-aware picks beside the same strategy blind to seconds.

Trials take seconds here as they would on a GPU (issue 41, "Measured in seconds"):
- simulated worlds: the distorted simulation (autotune.rl.simulator: a hidden structured distortion of the
  estimator, step-time noise) with GPU-like trial times (the distorted backend's `trial_times`:
  autotune.prediction.trial_time at the config's true step time, `fits` from its true peak, each op's first build
  once per run, every trial on ranks started ahead (the run's first: during its op's build), optimizer offload's
  and ZeRO-3's initialize, fp16's expected skipped warm-up steps; the world's
  noise, 3% or 10%, on the step times and on the trial times alike). Worlds:
  - `held-out GPU`: rl_evaluation's held-out simulated GPU tasks (the test split of the policy's training samplers,
    held-out shapes, budgets and the l4 profile), `held-out CPU` its CPU ones, a fresh distortion per seed;
  - `distorted`: search_efficiency's 12 GPU workloads (GPT-2 and Llama presets, 1 to 32 GPUs);
- replay worlds, their recorded wall times (no noise: the same at either level): `replay` the committed CPU
  surfaces (benchmarks/surfaces, at the device's memory and at the median measured peak), `replay-gpu` the shared
  H200 surfaces (search_efficiency.GPU_SURFACES, 2-8 configs each, at the budgets they were recorded with).

Strategies: rl, hybrid, optuna (the default), `optuna-flat` (optuna with every trial costing alike, as before
issue 41's cost-aware picks: search_efficiency.SCHEDULES; `hybrid-flat` on request), random, grid, and `deepspeed`: DeepSpeed's autotuner's own order in
its fast mode (benchmarks/peer_deepspeed_autotuner.py, DeepSpeedSchedule), each through the tuner's loop (the
estimator's pruning, calibration, the convergence figure recorded after every trial, the stop off) for up to
--trials launched trials. Per strategy and world: trials to 98% (median), trial-seconds to 95% and 98% (launched
trials' wall times summed, pruned configs costing nothing; median, 5th and 95th percentile, a run that never got
there counting as infinite), trials and trial-seconds until the convergence stop (the tuner's --stop-when and
minimum trials, within the default 30), each strategy's median trial-seconds to 98% over optuna's, optuna-flat's and the
deepspeed schedule's, and which strategy is fastest in seconds. Then issue 41's done-when, as it stands: the
default strategy's median trial-seconds to 98% on the held-out GPU worlds at 3% noise at most 0.6x optuna-flat's and
0.5x the deepspeed schedule's, no worse in trials.

    python benchmarks/search_seconds.py [--noise 0.03,0.1] [--seeds 5] [--trials 30] [--tasks 16]
        [--worlds held-out,distorted,replay] [--strategies rl,hybrid,optuna,optuna-flat,random,grid,deepspeed]
        [--part /tmp/part.json]   (write this run's runs only, to combine later)
        [--combine part1.json part2.json ...]   (the tables of earlier parts, nothing run; a later part's run
                                                 replaces an earlier one of the same strategy, world, noise,
                                                 task and seed: a strategy re-run after a change)

Writes benchmarks/results/search_seconds.md and .json (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import optuna
from rich.console import Console

import rl_evaluation as rle  # beside this script
import search_efficiency as se
from autotune.api import DEFAULT_STRATEGY, DEFAULT_TRIALS
from autotune.rl.policy import Policy
from autotune.rl.simulator import distorted_task

ROOT = Path(__file__).resolve().parent
STRATEGIES = ("rl", "hybrid", "optuna", "optuna-flat", "random", "grid", "deepspeed")
WORLD_GROUPS = {"held-out": ("held-out GPU", "held-out CPU"), "distorted": ("distorted",),
                "replay": ("replay", "replay-gpu")}
NOISY = ("held-out GPU", "held-out CPU", "distorted")  # the worlds whose trials carry the noise level
REFERENCES = ("optuna", "optuna-flat", "deepspeed")
# Issue 41's done-when: the default strategy's median trial-seconds to 98% on the held-out GPU worlds at 3% noise,
# over optuna's without cost-awareness (optuna-flat: search_efficiency.SCHEDULES) and over the deepspeed
# schedule's, at most these; no worse in trials.
GOAL_WORLD, GOAL_NOISE = "held-out GPU", 0.03
GOAL_OVER = {"optuna-flat": 0.6, "deepspeed": 0.5}
POLICY_STRATEGIES = ("hybrid", "rl")  # the strategies the RL policy proposes in
CHEAP_SHARE = 0.85  # cost_spread's tasks where picking cheap trials can save little: cheapest >= this x median
BOOTSTRAP = 2000  # resamples of the goal world's paired runs for the ratio's interval


def run_record(world: str, noise: float | None, task: str, strategy: str, seed: int, curve: list[float],
               walls: list[float], chances: list[float], oom: int, pruned: int) -> dict:
    return {"world": world, "noise": noise, "task": task, "strategy": strategy, "seed": seed, "curve": curve,
            "walls": walls, "chances": chances, "oom": oom, "pruned": pruned}


def held_out_runs(args, noise: float, console: Console) -> list[dict]:
    """rl_evaluation's held-out simulated tasks (its loop, `run_one`), every strategy on the same truth and noise."""
    policy = Policy.load(args.policy)
    out = []
    for kind, task, _ in rle.simulated_tasks(args.tasks, 0):
        world = f"held-out {kind.upper()}"
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            truth = distorted_task(task, args.randomize, noise, seed)
            line = []
            for name in args.strategies:
                curve, oom, pruned, _, _, _, walls, chances = rle.run_one(
                    name, truth.landscape.space, truth.with_noise_seed(seed), task.memory_budget_bytes, truth.optimum,
                    args.trials, seed, policy, lambda r, t=truth: t.true_throughput(r.config))
                out.append(run_record(world, noise, rle.task_name(task), name, seed, curve, walls, chances, oom,
                                      pruned))
                spent = se.seconds_to(curve, walls)
                line.append(f"{name} {sec(spent)}{' s' if math.isfinite(spent) else ''}")
            console.print(f"{world} noise {noise:g} {rle.task_name(task)} seed {seed}: " + "  ".join(line),
                          highlight=False)
    return out


def efficiency_args(args, noise: float, worlds: tuple[str, ...]) -> argparse.Namespace:
    """search_efficiency's arguments for its own runs of these worlds."""
    return argparse.Namespace(seeds=args.seeds, first_seed=args.first_seed, trials=args.trials,
                              strategies=tuple(args.strategies), worlds=worlds, noise=noise,
                              stop_when=se.DEFAULT_STOP_WHEN, min_trials=se.MIN_TRIALS)


def efficiency_runs(args, noise: float | None, worlds: tuple[str, ...], console: Console) -> list[dict]:
    """search_efficiency's worlds (its loop, `run_sweep`): the distorted GPU workloads, or the replay surfaces."""
    ns = efficiency_args(args, noise if noise is not None else 0.0, worlds)
    runs = [r for world in ("replay", "replay-gpu") if world in worlds for r in se.replay_runs(ns, console, world)]
    if "distorted" in worlds:
        runs += se.simulated_runs(ns, console)
    return [run_record(r.world, None if r.world.startswith("replay") else noise, r.task, r.strategy, r.seed, r.curve,
                       r.walls or [], r.chances or [], r.oom, r.pruned) for r in runs]


def stop_at(run: dict) -> int:
    """Launched trials until the convergence stop (the tuner's defaults, within DEFAULT_TRIALS) would have ended the
    run; else its own end."""
    for i, chance in enumerate(run["chances"][:DEFAULT_TRIALS]):
        if i + 1 >= se.MIN_TRIALS and chance is not None and chance < se.DEFAULT_STOP_WHEN:
            return i + 1
    return min(len(run["curve"]), DEFAULT_TRIALS)


def trials_to(run: dict, level: float = se.NEAR) -> float:
    return next((i + 1 for i, v in enumerate(run["curve"]) if v >= level - 1e-9), math.inf)


def run_key(run: dict) -> tuple:
    return run["strategy"], run["world"], run["noise"], run["task"], run["seed"]


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else math.nan


def row(runs: list[dict], matched: dict[int, float]) -> dict:
    """One strategy's figures over its runs in one world and noise level (`matched`: match_deepspeed's)."""
    to_98 = [se.seconds_to(r["curve"], r["walls"], se.NEAR) for r in runs]
    stops = [stop_at(r) for r in runs]
    launched = sum(len(r["curve"]) for r in runs)
    return {"runs": len(runs),
            "median_trials_to_98": median(trials_to(r) for r in runs),
            "reached_98_share": sum(math.isfinite(t) for t in to_98) / len(runs),
            "median_trial_s_to_95": median(se.seconds_to(r["curve"], r["walls"], se.FAR) for r in runs),
            "median_trial_s_to_98": median(to_98),
            "p5_trial_s_to_98": se.quantile(to_98, 0.05),
            "p95_trial_s_to_98": se.quantile(to_98, 0.95),
            "median_trials_to_stop": median(stops),
            "median_trial_s_at_stop": median(sum(r["walls"][:n]) for r, n in zip(runs, stops)),
            "median_best_at_stop": median(r["curve"][n - 1] if n else 0.0 for r, n in zip(runs, stops)),
            "median_trial_s_per_trial": median(w for r in runs for w in r["walls"]),
            "median_trial_s_all": median(sum(r["walls"]) for r in runs),
            "median_trial_s_to_deepspeed_final": median(matched[id(r)] for r in runs if id(r) in matched),
            "oom_share": sum(r["oom"] for r in runs) / launched if launched else 0.0}


def tables(runs: list[dict], strategies: tuple[str, ...]) -> dict:
    """Per (world, noise): the strategies' rows, their ratios to the references, and the fastest in seconds."""
    out: dict = {}
    keys = sorted({(r["world"], r["noise"]) for r in runs}, key=lambda k: (world_order(k[0]), k[1] or 0.0))
    for world, noise in keys:
        mine = [r for r in runs if r["world"] == world and r["noise"] == noise]
        matched = match_deepspeed(mine)
        rows = {s: row([r for r in mine if r["strategy"] == s], matched) for s in strategies
                if any(r["strategy"] == s for r in mine)}
        for s, data in rows.items():
            for ref in REFERENCES:
                if ref in rows:
                    data[f"trial_s_to_98_over_{ref}"] = se.ratio(data["median_trial_s_to_98"],
                                                                 rows[ref]["median_trial_s_to_98"])
                    data[f"trials_to_98_over_{ref}"] = se.ratio(data["median_trials_to_98"],
                                                                rows[ref]["median_trials_to_98"])
            if "deepspeed" in rows:
                data["trial_s_to_deepspeed_final_over_deepspeed"] = se.ratio(
                    data["median_trial_s_to_deepspeed_final"], rows["deepspeed"]["median_trial_s_to_deepspeed_final"])
        out[title(world, noise)] = {"world": world, "noise": noise, "tasks": sorted({r["task"] for r in mine}),
                                    "seeds": sorted({r["seed"] for r in mine}), "strategies": rows,
                                    "fastest": fastest(rows)}
    return out


def world_order(world: str) -> int:
    order = [w for group in WORLD_GROUPS.values() for w in group]
    return order.index(world) if world in order else len(order)


def title(world: str, noise: float | None) -> str:
    return f"{world}, {noise:.0%} noise" if noise is not None else f"{world}, recorded wall times"


def fastest(rows: dict) -> str | None:
    """The strategy of the least median trial-seconds to 98% (then the least 95th percentile, the most runs that got
    there; equals named together); None where no strategy's median run got there."""
    done = {s: (d["median_trial_s_to_98"], d["p95_trial_s_to_98"], -d["reached_98_share"]) for s, d in rows.items()
            if math.isfinite(d["median_trial_s_to_98"])}
    if not done:
        return None
    best = min(done.values())
    tied = [s for s, key in done.items() if key == best]
    return tied[0] if len(tied) == 1 else " = ".join(tied) + " (tied)"


def match_deepspeed(runs: list[dict]) -> dict[int, float]:
    """Per run (by id), the trial-seconds until its recommendation was as good as the deepspeed schedule's final one
    on the same task and seed (its true best/optimum at its end); absent where that schedule found nothing."""
    schedule = {(r["world"], r["noise"], r["task"], r["seed"]): r for r in runs if r["strategy"] == "deepspeed"}
    out = {}
    for r in runs:
        ds = schedule.get((r["world"], r["noise"], r["task"], r["seed"]))
        if ds is not None and ds["curve"] and ds["curve"][-1] > 0:
            out[id(r)] = se.seconds_to(r["curve"], r["walls"], ds["curve"][-1])
    return out


def paired(runs: list[dict], mine: str, ref: str, draws: int = BOOTSTRAP, seed: int = 41) -> dict:
    """`mine` against `ref` on the goal world's runs both made (same task and seed): how many got to 98% in fewer
    trial-seconds (wins) and in more (losses), and the 90% bootstrap interval of the ratio of their medians (the
    pairs drawn with replacement): how firmly the done-when's ratio sits where it does on these worlds."""
    goal = [r for r in runs if r["world"] == GOAL_WORLD and r["noise"] == GOAL_NOISE]
    seconds = {name: {(r["task"], r["seed"]): se.seconds_to(r["curve"], r["walls"], se.NEAR)
                      for r in goal if r["strategy"] == name} for name in (mine, ref)}
    keys = sorted(set(seconds[mine]) & set(seconds[ref]))
    if not keys:
        return {}
    x, y = (np.array([seconds[name][k] for k in keys]) for name in (mine, ref))
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(draws):
        i = rng.integers(0, len(keys), len(keys))
        ratios.append(se.ratio(float(np.median(x[i])), float(np.median(y[i]))))
    low, high = np.nanpercentile(np.array(ratios), [5, 95])
    return {"runs": len(keys), "wins": int(np.sum(x < y)), "losses": int(np.sum(x > y)),
            "ratio_low": float(low), "ratio_high": float(high)}


def goals(result: dict, runs: list[dict]) -> dict:
    """Issue 41's done-when on the default strategy, each ratio with its paired comparison (`paired`)."""
    data = result["tables"].get(title(GOAL_WORLD, GOAL_NOISE))
    if not data or DEFAULT_STRATEGY not in data["strategies"]:
        return {}
    mine = data["strategies"][DEFAULT_STRATEGY]
    out: dict = {"strategy": DEFAULT_STRATEGY, "world": title(GOAL_WORLD, GOAL_NOISE)}
    for ref, limit in GOAL_OVER.items():
        if ref not in data["strategies"]:
            continue
        over = mine[f"trial_s_to_98_over_{ref}"]
        out[f"trial_s_to_98_over_{ref}"] = over
        out[f"at_most_{limit}x_{ref}"] = bool(over <= limit)
        out[f"trials_no_worse_than_{ref}"] = bool(mine["median_trials_to_98"] <= data["strategies"][ref]["median_trials_to_98"])
        out[f"paired_{ref}"] = paired(runs, DEFAULT_STRATEGY, ref)
    if "deepspeed" in data["strategies"]:
        out["trial_s_to_deepspeed_final_over_deepspeed"] = mine["trial_s_to_deepspeed_final_over_deepspeed"]
    # The RL policy against Optuna alone (issue 41's second goal), alone and in its role in `hybrid`.
    out["policy_over_optuna"] = {name: {"ratio": data["strategies"][name]["trial_s_to_98_over_optuna"],
                                        "paired": paired(runs, name, "optuna")}
                                 for name in POLICY_STRATEGIES
                                 if name in data["strategies"] and "optuna" in data["strategies"]}
    return out


def cost_spread(runs: list[dict]) -> list[dict]:
    """Per task of the goal world, every strategy's launched trials after each run's first (which carries the
    first op builds): the cheapest, 10th percentile and median seconds of a trial. Cheapest / median is the most a
    search that picks cheap trials saves per trial there; the rest of a ratio in seconds has to come from fewer
    trials."""
    goal = [r for r in runs if r["world"] == GOAL_WORLD and r["noise"] == GOAL_NOISE]
    out = []
    for task in sorted({r["task"] for r in goal}):
        mine = [r for r in goal if r["task"] == task and r["walls"]]
        walls = sorted(w for r in mine for w in r["walls"][1:])
        if walls:
            out.append({"task": task, "trials": len(walls), "first_s": median(r["walls"][0] for r in mine),
                        "cheapest_s": walls[0], "p10_s": walls[len(walls) // 10], "median_s": median(walls)})
    return out


def sec(value: float) -> str:
    return "never" if math.isinf(value) else ("-" if math.isnan(value) else f"{value:,.0f}")


def times(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else ("0 (ref. never)" if value == 0 else f"{value:.2f}")


COLUMNS = ("strategy", "runs", "trials to 98%", "reached 98%", "trial-s to 95%", "trial-s to 98%", "p5", "p95",
           "trials to stop", "trial-s at stop", "best/opt at stop", "s/trial", "98% s / optuna's", "/ optuna-flat's",
           "98% s / deepspeed's", "trial-s to deepspeed's final", "/ deepspeed's")


def cells(s: str, d: dict) -> list[str]:
    return [s, str(d["runs"]), se.fmt(d["median_trials_to_98"]), f"{d['reached_98_share']:.0%}",
            sec(d["median_trial_s_to_95"]), sec(d["median_trial_s_to_98"]), sec(d["p5_trial_s_to_98"]),
            sec(d["p95_trial_s_to_98"]), se.fmt(d["median_trials_to_stop"]), sec(d["median_trial_s_at_stop"]),
            f"{d['median_best_at_stop']:.3f}", sec(d["median_trial_s_per_trial"]),
            times(d.get("trial_s_to_98_over_optuna")), times(d.get("trial_s_to_98_over_optuna-flat")),
            times(d.get("trial_s_to_98_over_deepspeed")),
            sec(d["median_trial_s_to_deepspeed_final"]), times(d.get("trial_s_to_deepspeed_final_over_deepspeed"))]


def markdown(result: dict) -> str:
    lines = ["# Search in seconds (issue 41)", "",
             f"`{result['command']}`; " + "; ".join(f"`{p['command']}` ({p['seconds'] / 60:.1f} min, {p['machine']}; "
                                                    f"{p['source']})" for p in result["parts"])
             + (". A later part's run replaces an earlier one of the same strategy, world, noise, task and seed."
                if len(result["parts"]) > 1 else "."), "",
             "Trials take seconds as on a GPU: a simulated trial the trial-time model's wall time "
             "(autotune.prediction.trial_time at the config's true step time: launch (every trial on ranks started "
             "ahead, the run's first during its op's build), op load and each op's first "
             "build once per run, model build, deepspeed.initialize with ZeRO-3's and optimizer offload's longer "
             "ones, warm-up with fp16's expected skipped steps, measurement, exit; a config that does not fit dies "
             "in its first step) times the world's noise (the level named, on the step times too); a replayed trial "
             "the wall time its surface recorded (no noise). Trial-seconds: the launched trials' wall times summed "
             "until the recommendation (the best measured config) is within 98% (95%) of the optimum by its true "
             "throughput, pruned configs costing nothing; `never` where that run (the median run, the percentile's "
             "run) did not get there within the trial budget. p5 / p95: the 5th and 95th percentile over runs "
             "(nearest rank). Stop: the convergence stop at the tuner's defaults (--stop-when "
             f"{se.DEFAULT_STOP_WHEN:g}, at least {se.MIN_TRIALS} trials, at most {DEFAULT_TRIALS}). Ratios: of the "
             "medians to 98% (`0 (ref. never)`: the reference's median run never got there; `inf`: this one's did "
             "not). `deepspeed`: DeepSpeed's autotuner's order in its fast mode (benchmarks/peer_deepspeed_autotuner.py, "
             "DeepSpeedSchedule: the profile run at ZeRO-3, then stages 0-3, each with its micro-batch search; stage "
             "and micro-batch only), through the same loop as the others (so the estimator prunes configs it "
             "predicts will not fit, which DeepSpeed itself would launch). `trial-s to deepspeed's final`: the "
             "trial-seconds until the recommendation was as good (true throughput) as the deepspeed schedule's final "
             "one on the same task and seed (the schedule's own: until it first had it); median over the runs where "
             "the schedule found a config, and its ratio to the schedule's.", ""]
    g = result.get("goals")
    if g:
        parts = []
        for ref, limit in GOAL_OVER.items():
            if f"trial_s_to_98_over_{ref}" in g:
                over = g[f"trial_s_to_98_over_{ref}"]
                said = f"{over:.2f}x {ref}'s" if math.isfinite(over) and over > 0 else \
                    (f"{ref}'s median run never got there (ratio {over:g})" if over == 0 else f"ratio {over}")
                pair = g.get(f"paired_{ref}") or {}
                spread = (f"; paired over {pair['runs']} runs: faster in {pair['wins']}, slower in {pair['losses']}, "
                          f"the ratio's 90% bootstrap interval {times(pair['ratio_low'])}-{times(pair['ratio_high'])}"
                          if pair else "")
                parts.append(f"{said} (goal <= {limit}: {'met' if g[f'at_most_{limit}x_{ref}'] else 'not met'}; "
                             f"trials no worse: {'yes' if g[f'trials_no_worse_than_{ref}'] else 'no'}{spread})")
        lines += [f"**Issue 41's done-when** ({g['strategy']}, the default strategy, on {g['world']}): "
                  f"median trial-seconds to 98% " + "; ".join(parts) + ".", ""]
        policy = g.get("policy_over_optuna") or {}
        if policy:
            lines += ["The RL policy against `optuna` alone (`hybrid`: its turns after Optuna's first 8 guided "
                      "proposals, `optuna` the same search without them; `rl`: the policy alone): median trial-seconds "
                      "to 98% " + "; ".join(
                          f"{name} {times(p['ratio'])}x optuna's" + (
                              f" (paired over {p['paired']['runs']} runs: faster in {p['paired']['wins']}, slower in "
                              f"{p['paired']['losses']}, the ratio's 90% bootstrap interval "
                              f"{times(p['paired']['ratio_low'])}-{times(p['paired']['ratio_high'])})"
                              if p["paired"] else "") for name, p in policy.items()) + ".", ""]
        if "trial_s_to_deepspeed_final_over_deepspeed" in g:
            lines += [f"Where the deepspeed schedule never gets within 98%, the comparison that holds is to its own final "
                      f"recommendation: {g['strategy']} is as good as it after "
                      f"{times(g['trial_s_to_deepspeed_final_over_deepspeed'])}x the schedule's median trial-seconds "
                      "to it.", ""]
    lines += bound_lines(result)
    lines += ["Fastest in seconds (least median trial-seconds to 98%): "
              + "; ".join(f"{name}: {data['fastest'] or 'none got there in the median run'}"
                          for name, data in result["tables"].items()) + ".", ""]
    for name, data in result["tables"].items():
        lines += [f"## {name}", "", f"{len(data['tasks'])} tasks x seeds {seed_text(data['seeds'])}; fastest in "
                  f"seconds: {data['fastest'] or 'none (no median run got there)'}.", "",
                  "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1),
                  *("| " + " | ".join(cells(s, d)) + " |" for s, d in data["strategies"].items()), "",
                  "Tasks: " + "; ".join(data["tasks"]), ""]
    return "\n".join(lines)


def bound_lines(result: dict) -> list[str]:
    """The paragraph and table of cost_spread: what picking cheap trials can do for the goal's ratio in seconds."""
    spread = result.get("cost_spread")
    if not spread:
        return []
    cheap = [t for t in spread if t["cheapest_s"] >= CHEAP_SHARE * t["median_s"]]
    first, each = median(t["first_s"] for t in cheap), median(t["median_s"] for t in cheap)
    goal = result["tables"].get(title(GOAL_WORLD, GOAL_NOISE), {}).get("strategies", {})
    flat = goal.get("optuna-flat", {}).get("median_trials_to_98", math.nan)
    limit = GOAL_OVER["optuna-flat"]
    needed = 1 + (limit * (first + each * (flat - 1)) - first) / each  # trials at `each` after a `first`
    return [f"What bounds the ratio in seconds on {title(GOAL_WORLD, GOAL_NOISE)} (`cost_spread`): the seconds of "
            f"the launched trials after each run's first, every strategy's runs. In {len(cheap)} of {len(spread)} "
            f"tasks the cheapest trial costs at least {CHEAP_SHARE:.0%} of the median one: there a search that picks "
            f"cheap trials saves at most {1 - CHEAP_SHARE:.0%} a trial, and the first trial (the first op builds in "
            f"it) costs about the same in every strategy ({first:.0f} s, then {each:.0f} s a trial, medians over "
            f"these tasks). So {limit}x optuna-flat's {se.fmt(flat)} trials in seconds "
            + (f"asks for {needed:.1f} trials at those costs: fewer trials, not cheaper ones." if needed >= 1 else
               f"is less than the first trial alone ({limit * (first + each * (flat - 1)):.0f} s against {first:.0f} "
               "s), which every strategy pays alike: no order of the trials after it can reach that ratio."), "",
            "| task | trials | first trial s (median) | cheapest s | p10 s | median s | cheapest / median |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            *(f"| {t['task']} | {t['trials']} | {sec(t['first_s'])} | {t['cheapest_s']:.1f} | {t['p10_s']:.1f} | "
              f"{t['median_s']:.1f} | {t['cheapest_s'] / t['median_s']:.2f} |" for t in spread), ""]


def seed_text(seeds: list[int]) -> str:
    return f"{seeds[0]}..{seeds[-1]}" if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)) \
        else ", ".join(map(str, seeds))


def collect(args, console: Console) -> list[dict]:
    runs: list[dict] = []
    for noise in args.noise:
        if "held-out" in args.worlds:
            runs += held_out_runs(args, noise, console)
        if "distorted" in args.worlds:
            runs += efficiency_runs(args, noise, ("distorted",), console)
    if "replay" in args.worlds:  # recorded wall times: one pass serves every noise level
        runs += efficiency_runs(args, None, ("replay", "replay-gpu"), console)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=lambda t: [float(x) for x in t.split(",")], default=[0.03, 0.1],
                        help="the simulated worlds' noise levels (step and trial times), comma-separated")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help="launched trials per run at most")
    parser.add_argument("--tasks", type=int, default=16, help="rl_evaluation's held-out tasks (3/4 GPU, 1/4 CPU)")
    parser.add_argument("--randomize", type=float, default=0.3, help="spread of the hidden truth (as in training)")
    parser.add_argument("--policy", type=Path, default=rle.policy_path())
    parser.add_argument("--worlds", type=lambda t: t.split(","), default=list(WORLD_GROUPS),
                        help=f"comma-separated, from {', '.join(WORLD_GROUPS)}")
    parser.add_argument("--strategies", type=lambda t: t.split(","), default=list(STRATEGIES))
    parser.add_argument("--part", type=Path, default=None, help="write this run's runs here (JSON), no tables")
    parser.add_argument("--combine", type=Path, nargs="+", default=None,
                        help="parts written by --part: their tables, nothing run")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "search_seconds")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/search_seconds.py", *(sys.argv[1:] if argv is None else argv)])
    console = Console(width=max(Console().width, 160))
    if args.combine:
        parts = [json.loads(p.read_text()) for p in args.combine]
    else:
        unknown = set(args.worlds) - set(WORLD_GROUPS)
        if unknown:
            parser.error(f"unknown worlds {sorted(unknown)}: allowed {', '.join(WORLD_GROUPS)}")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        start = time.monotonic()
        source = se.source_state()
        runs = collect(args, console)
        parts = [{"command": command, "seconds": time.monotonic() - start, "machine": se.machine(), "source": source,
                  "strategies": list(args.strategies), "runs": runs}]
        if args.part is not None:
            args.part.parent.mkdir(parents=True, exist_ok=True)
            args.part.write_text(json.dumps(se.finite(parts[0])) + "\n")
            console.print(f"wrote {args.part}")
            return 0
    strategies = tuple(dict.fromkeys(s for p in parts for s in p["strategies"]))
    runs = list({run_key(r): {**r, "chances": [math.nan if c is None else c for c in r["chances"]]}
                 for p in parts for r in p["runs"]}.values())  # the last part's run of each key
    result: dict = {"command": command, "parts": [{k: v for k, v in p.items() if k != "runs"} for p in parts],
                    "tables": tables(runs, strategies)}
    result["goals"] = goals(result, runs)
    result["cost_spread"] = cost_spread(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(result))
    args.out.with_suffix(".json").write_text(json.dumps(se.finite({**result, "runs": runs}), indent=1) + "\n")
    console.print(markdown(result), highlight=False)
    console.print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
