"""The training figures of one finished episode, from the training environment's last `info`
(autotune.rl.simulator.TrainingEnv: flat keys `trials`, `best_throughput`, `best_true_throughput`,
`optimum_throughput`).

`within_2pct`: the episode's best feasible config reaches 98% of the task's optimum (the best feasible
true throughput of the whole space, known on the simulated backend by exhausting it). The best config is
judged by its noise-free throughput where known, not by a lucky draw of the step-time noise.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

NEAR_OPTIMUM = 0.98


def episode_figures(info: Mapping[str, Any], oom_trials: int = 0) -> dict[str, float | None]:
    optimum = float(info.get("optimum_throughput", -1.0))  # -1: unknown (the flat info's ABSENT)
    found = float(info.get("best_true_throughput") or info.get("best_throughput") or 0.0)
    ratio = None if math.isnan(optimum) or optimum <= 0 else min(found / optimum, 1.0)
    return {
        "trials": float(info.get("trials", 0)),
        "within_2pct": None if ratio is None else float(ratio >= NEAR_OPTIMUM),
        "best_over_optimum": ratio,
        "found_feasible": float(found > 0),
        "oom_trials": float(oom_trials),
    }
