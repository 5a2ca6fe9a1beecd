"""grid and random on a replay surface's space: the configs it measured (Space.only), where the raw estimator
predicts none of them to fit the budget (as on a CPU, before calibration). grid once launched nothing there
("the strategy proposes nothing more; 0 trials launched")."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

import autotune
from autotune.backends.replay import ReplayBackend, load_surface, replay_settings, surface_space
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget, Sweep
from autotune.outputs.report import no_fit_verdict
from autotune.prediction.estimate import estimate
from autotune.search.pruning import Pruner
from autotune.strategies import SearchContext
from autotune.strategies.grid import GridStrategy
from autotune.values.config import Config
from autotune.values.results import TrialResult
from autotune.values.space import Space

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
MiB = 2**20
BUDGET = 720 * MiB  # measured: z0 mb4 ck1 fp32 (709 MiB) and z3 mb1 ck0 fp32 (702 MiB) fit; the raw estimator: none
# Two micro-batches of three layouts, as benchmarks/gpu_validation.py --configs 6 measures them.
MEASURED = (Config(0, 4, 1, "fp32", "none", "none"), Config(0, 8, 1, "fp32", "none", "none"),
            Config(2, 4, 1, "fp32", "cpu", "none"), Config(2, 8, 1, "fp32", "cpu", "none"),
            Config(3, 1, 0, "fp32", "none", "none"), Config(3, 4, 0, "fp32", "none", "none"))


@pytest.fixture(scope="module")
def surface_path(tmp_path_factory) -> Path:
    """The committed tiny CPU surface's lines of the six configs."""
    path = tmp_path_factory.mktemp("surface") / "six.jsonl"
    lines = [line for line in TINY.read_text().splitlines()
             if Config.from_dict(json.loads(line)["config"]) in MEASURED]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def space(surface_path) -> Space:
    space = surface_space(load_surface(surface_path))
    assert space.only is not None and set(space) == set(MEASURED)
    assert len(Space(space.choices, space.workload, space.hardware)) > len(MEASURED)  # the unrestricted space
    # The defect's condition: before any trial the estimator puts every measured config over the budget.
    assert not any(estimate(c, space.workload, space.hardware).fits(BUDGET) for c in space)
    return space


def sweep(name: str, space: Space, surface_path: Path, budget: int, trials: int) -> tuple[Sweep, StopReason]:
    s = Sweep.in_memory(space, budget, name, "replay", 0)
    return s, run_local(s, ReplayBackend(load_surface(surface_path), budget), Budget(trials, stop_when=0),
                        QuietProgress())


def launched(s: Sweep) -> list[TrialResult]:
    return [r for r in s.results if r.status != "pruned"]


def test_grid_walks_the_restricted_space_and_launches_trials(space, surface_path):
    grid = GridStrategy(SearchContext(space, BUDGET))
    assert {c for configs in grid.plan.values() for c in configs} == set(MEASURED)  # its sub-space: all six
    s, stop = sweep("grid", space, surface_path, BUDGET, trials=len(space))
    assert stop == StopReason.DONE
    ran = [r.config for r in launched(s)]
    assert ran and set(ran) <= set(MEASURED)
    assert ran[0] == Config(0, 4, 1, "fp32", "none", "none")  # ZeRO 0 first, its smallest micro-batch
    assert s.best is not None and s.best.fits(BUDGET)


def test_grid_covers_its_sub_space_where_everything_fits(space, surface_path):
    # The device's whole memory: every measured config fits; grid runs stage 0 and 2 to micro-batch 8 and skips
    # stage 3, whose largest micro-batch (4) is smaller than the previous stage's (DeepSpeed's rule).
    s, _ = sweep("grid", space, surface_path, space.hardware.memory_bytes, trials=len(space))
    assert [r.config for r in launched(s)] == [c for c in MEASURED if c.zero_stage != 3]


def test_random_covers_the_measured_configs(space, surface_path):
    s, _ = sweep("random", space, surface_path, BUDGET, trials=len(space))
    assert launched(s)
    assert sorted(r.config for r in s.results) == sorted(MEASURED)  # each once, launched or pruned, none else
    s, _ = sweep("random", space, surface_path, space.hardware.memory_bytes, trials=len(space))
    assert sorted(r.config for r in launched(s)) == sorted(MEASURED)


def test_tune_with_grid_on_the_surface_launches_trials(surface_path, tmp_path):
    settings, _ = replay_settings(surface_path, memory_budget=BUDGET, strategy="grid")
    spec = autotune.TuneSpec(settings.workload, settings.hardware, BUDGET, strategy="grid", trials=6,
                             backend="replay", surface=str(surface_path), space=settings.choices)
    result = autotune.tune(spec, out=tmp_path / "run")
    ran = [r for r in result.results if r.status != "pruned"]
    assert ran and {r.config for r in ran} <= set(MEASURED)
    assert result.best is not None and result.verdict.startswith("recommended ")


def test_no_fit_verdict_counts_the_restricted_space(surface_path, space):
    settings, _ = replay_settings(surface_path, memory_budget=BUDGET, strategy="grid")
    pruner = Pruner.for_settings(settings)
    untried = sum(pruner.check(c, settings.backend) is None for c in space)
    assert 0 < untried <= len(MEASURED)
    left = f"{untried} untried configs are" if untried > 1 else "1 untried config is"
    assert f"though {left} predicted to fit" in no_fit_verdict(settings)
