"""benchmarks/stop_floor.py (issue 28): where a threshold on the convergence figure stops a recorded run, and the
oracle's floor (the first trial at 98% of the optimum)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "stop_floor", Path(__file__).resolve().parents[1] / "benchmarks" / "stop_floor.py")
assert _SPEC is not None and _SPEC.loader is not None
stop_floor = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(stop_floor)

RUN = {"curve": [0.8, 0.9, 0.95, 0.99, 0.99, 0.99, 1.0, 1.0],
       "chances": [1.0, 0.9, 0.5, 0.04, 0.3, 0.2, 0.03, 0.01]}


def test_the_stop_waits_for_the_minimum_and_the_threshold():
    assert stop_floor.stop_at(RUN, 0.05, 6, 30) == 7  # trial 4 is under 5% but before the minimum
    assert stop_floor.stop_at(RUN, 0.05, 3, 30) == 4
    assert stop_floor.stop_at(RUN, 0.25, 6, 30) == 6
    assert stop_floor.stop_at(RUN, 0.001, 6, 30) == 8  # never under: the run's last trial
    assert stop_floor.stop_at(RUN, 0.05, 6, 5) == 5  # the trial budget ends it


def test_the_oracle_stops_at_the_first_trial_at_98_percent():
    assert stop_floor.first_good(RUN, 30) == 4
    assert stop_floor.first_good({"curve": [0.5, 0.9]}, 30) == 2  # never there: the last trial


def test_auc_ranks_the_sweeps_already_there_lower():
    assert stop_floor.auc([0.1, 0.2], [0.5, 0.6]) == 1.0
    assert stop_floor.auc([0.5], [0.5]) == 0.5
    assert stop_floor.auc([], [0.5]) is None


def test_search_seconds_runs_are_read_per_noise_level_for_the_default_strategy(tmp_path, capsys):
    import json

    def run(strategy: str, noise: float) -> dict:
        return {"world": "held-out GPU", "noise": noise, "strategy": strategy, **RUN}

    path = tmp_path / "search_seconds.json"
    path.write_text(json.dumps({"runs": [run("optuna", 0.03)] * 3 + [run("optuna", 0.1)] * 2 + [run("hybrid", 0.03)]}))
    stop_floor.main([str(path), "--noise", "0.03"])
    out = capsys.readouterr().out
    assert "held-out GPU, 3% noise, optuna (3 runs)" in out and "hybrid" not in out
    stop_floor.main([str(path), "--strategy", "hybrid"])
    assert "held-out GPU, hybrid (1 runs)" in capsys.readouterr().out


def _stop_bounds():
    spec = importlib.util.spec_from_file_location(
        "stop_bounds", Path(__file__).resolve().parents[1] / "benchmarks" / "stop_bounds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stop_bounds_traces_both_figures_and_the_search_with_the_offsets_known():
    """benchmarks/stop_bounds.py: per launched trial the recommendation, the product's figure and the informed one;
    and the knob-order search, which in a world without distortion runs the optimum first."""
    from autotune.envs.sampler import Task
    from autotune.rl.simulator import distorted_task
    from autotune.search_spaces import load_choices
    from autotune.values.hardware import PROFILES
    from autotune.values.workload import make_workload

    bounds = _stop_bounds()
    task = Task(make_workload("gpt2-small", 32, 1), PROFILES["l4"], 6 * 2**30, load_choices("default"))
    run = bounds.one_sweep(task, seed=0, noise=0.03, trials=7)
    assert len(run["curve"]) == len(run["product"]) == len(run["informed"]) == 7
    assert all(0.0 <= c <= 1.0 for c in run["product"] + run["informed"]) and 0 < run["curve"][-1] <= 1.0
    assert run["product"] != run["informed"]  # two figures of the same trials, told different things
    assert run["knob_order_reach"] >= 1
    assert bounds.knob_order_reach(distorted_task(task, 0.0, 0.0, seed=0)) == 1
