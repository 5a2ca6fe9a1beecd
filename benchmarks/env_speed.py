"""Steps per second of `autotune/DeepSpeedMemory-v0` on one core (goal: >= 5,000 on the simulated backend).

The process is pinned to one CPU. A trivial random policy picks among the allowed actions except
`stop`, so every episode runs its full horizon (16) and resets are counted at their real share; the
policy's own cost (a few microseconds) is included, so the figures are conservative. Each scenario
runs several times; the table gives the median and the range. Rates are per second of the process's CPU
time (one dedicated core), and per wall second under whatever else the shared machine was running.

Scenarios: fixed workloads (tiny on the CPU profile; llama-7b on 8 x A100 over the default GPU space);
the workload sampler with its default pool of 256 tasks after a warm-up (as during RL training),
and without a pool (every reset a never-seen task: its estimates are computed then); the replay backend
on the committed surface.

    python benchmarks/env_speed.py [--steps 20000] [--repeats 5]

Writes benchmarks/results/env_speed.md and env_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from autotune.envs import DeepSpeedMemoryEnv
from autotune.envs.actions import STOP

HERE = Path(__file__).parent
RESULTS = HERE / "results"
SURFACE = HERE / "surfaces" / "tiny-cpu.jsonl"
GOAL = 5000

SCENARIOS = {
    "simulated, tiny on cpu (fixed)": {"workload": "tiny", "memory_budget": "900MiB"},
    "simulated, llama-7b on 8 x a100-80gb (fixed)": {
        "workload": {"model": "llama-7b", "global_batch": 256, "gpus": 8}, "hardware": "a100-80gb"},
    "simulated, sampler pool of 256 tasks (warm)": {"sampler": {"split": "train", "pool_size": 256}},
    "simulated, sampler pool of 256 tasks, noise 0.1 (warm)": {
        "sampler": {"split": "train", "pool_size": 256}, "noise": 0.1},
    "simulated, sampler without pool (every task new)": {"sampler": {"split": "train", "pool_size": None}},
    "replay, committed tiny cpu surface": {"backend": "replay", "surface": str(SURFACE),
                                           "memory_budget": ["700MiB", "800MiB", "1GiB"]},
}


def run(env: DeepSpeedMemoryEnv, steps: int, rng: random.Random, seed: int) -> tuple[float, float, int]:
    """(steps per CPU second, steps per wall second, episodes)."""
    observation, _ = env.reset(seed=seed)
    resets = 0
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        mask = observation["action_mask"].copy()
        mask[STOP] = 0.0
        allowed = np.flatnonzero(mask)
        action = int(allowed[rng.randrange(len(allowed))]) if len(allowed) else STOP
        observation, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            observation, _ = env.reset()
            resets += 1
    return steps / (time.process_time() - cpu), steps / (time.perf_counter() - start), resets


def measure(name: str, config: dict, steps: int, repeats: int) -> dict:
    env = DeepSpeedMemoryEnv(config)
    warm = time.perf_counter()
    if "pool_size" in config.get("sampler", {}) and config["sampler"]["pool_size"]:
        # One pass over the pool: every task's landscape is built once, as early in a training run.
        pool = config["sampler"]["pool_size"]
        run(env, 16 * pool * 6, random.Random(0), seed=0)
    warm = time.perf_counter() - warm
    rates, walls, resets = [], [], 0
    for repeat in range(repeats):
        rate, wall, resets = run(env, steps, random.Random(repeat), seed=100 + repeat)
        rates.append(rate)
        walls.append(wall)
    return {"scenario": name, "median_steps_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "median_steps_per_wall_s": statistics.median(walls), "repeats": repeats, "steps": steps,
            "episodes_per_repeat": resets, "warmup_s": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    core = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {core})
    rows = []
    for name, config in SCENARIOS.items():
        if config.get("backend") == "replay" and not SURFACE.exists():
            print(f"skipped (no surface at {SURFACE}): {name}")
            continue
        steps = args.steps if "without pool" not in name else max(2000, args.steps // 10)
        rows.append(measure(name, config, steps, args.repeats))
        print(f"{name}: {rows[-1]['median_steps_per_s']:,.0f} steps per CPU second")

    table = Table(title=f"Environment steps per second on one core (goal >= {GOAL:,})")
    for column in ("scenario", "steps per CPU s (median)", "range", "steps per wall s", "warm-up s", "goal"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for r in rows:
        table.add_row(r["scenario"], f"{r['median_steps_per_s']:,.0f}", f"{r['min']:,.0f}-{r['max']:,.0f}",
                      f"{r['median_steps_per_wall_s']:,.0f}", f"{r['warmup_s']:.1f}",
                      "met" if r["median_steps_per_s"] >= GOAL else "below")
    Console(width=140).print(table)

    load = os.getloadavg()[0]
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, pinned to core "
               f"{core}, load average {load:.1f} at the end")
    lines = ["# Environment speed", "",
             f"`python benchmarks/env_speed.py --steps {args.steps} --repeats {args.repeats}`; {machine}. "
             "Random allowed actions except stop (full 16-step episodes, resets included); median of the repeats. "
             "Steps per CPU second is what one dedicated core does (the machine is shared, so the process waits "
             "for its core part of the wall time); steps per wall second is what it did under the load of the run.",
             "", "| scenario | steps per CPU s (median) | range | steps per wall s | warm-up s | goal 5,000 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['median_steps_per_s']:,.0f} | {r['min']:,.0f}-{r['max']:,.0f} | "
                     f"{r['median_steps_per_wall_s']:,.0f} | {r['warmup_s']:.1f} | "
                     f"{'met' if r['median_steps_per_s'] >= GOAL else 'below'} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "env_speed.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "env_speed.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
