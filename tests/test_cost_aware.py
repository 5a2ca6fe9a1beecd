"""Issue 41's cost-aware search: a guided pick weighs what a trial teaches or may gain against the seconds it
would take (SearchContext.trial_seconds: autotune.prediction.trial_time at the calibrated step time, weighed by
the probability of fitting, first op builds included). Simulated GPU worlds with GPU-like trial times."""

from __future__ import annotations

import pytest

from autotune.api import DEFAULT_STRATEGY
from autotune.backends.simulated import SimulatedBackend
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget, Sweep
from autotune.prediction.estimate import Calibration
from autotune.prediction.trial_time import CPU_ADAM, FUSED_ADAM, model_for, trial_time
from autotune.search.pruning import Pruner
from autotune.search_spaces import load_choices
from autotune.values.config import Config
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult
from autotune.values.space import Space
from autotune.values.workload import make_workload

GiB = 2**30
TRUTH = Calibration(activation_scale=1.3, flops_scale=0.7)  # the simulated machine is not the estimator's


def world(model: str, batch: int, gpus: int, profile: str, budget_gib: int):
    workload, hardware = make_workload(model, batch, gpus), PROFILES[profile]
    space = Space(load_choices("default"), workload, hardware)
    backend = SimulatedBackend(workload, hardware, budget_gib * GiB, seed=1, calibration=TRUTH, trial_times=True)
    return space, backend, budget_gib * GiB


def run(space: Space, backend, budget: int, trials: int, strategy: str = DEFAULT_STRATEGY) -> list[TrialResult]:
    sweep = Sweep.in_memory(space, budget, strategy, backend.name, seed=0)
    run_local(sweep, backend, Budget(trials, stop_when=0), QuietProgress())
    return [r for r in sweep.results if r.status != "pruned"]


def offloads(config: Config) -> bool:
    return config.offload_optimizer != "none" or config.offload_param != "none"


def best_of(space: Space, backend, budget: int) -> TrialResult:
    return max((r for r in map(backend.run, space) if r.fits(budget)), key=lambda r: r.throughput_samples_per_s)


def test_where_offload_never_wins_no_offload_trial_is_among_the_first_five():
    space, backend, budget = world("llama-1b", 64, 1, "h100-80gb", 60)
    assert not offloads(best_of(space, backend, budget).config)  # the world: its optimum keeps everything on the GPU
    first = run(space, backend, budget, 5)
    assert len(first) == 5
    assert not any(offloads(r.config) for r in first), [r.config.label() for r in first]


def test_where_nothing_fits_without_offload_the_search_launches_offload_and_finds_a_fitting_config():
    space, backend, budget = world("llama-7b", 16, 1, "a100-80gb", 80)
    fitting = [r for r in map(backend.run, space) if r.fits(budget)]
    assert fitting and all(offloads(r.config) for r in fitting)  # the world: only offloaded configs fit
    ran = run(space, backend, budget, 6)
    assert offloads(ran[0].config)  # the first trial is likely to fit, so it offloads
    assert any(r.ok and r.fits(budget) for r in ran)


def test_a_trial_costs_its_seconds_weighed_by_its_chance_of_fitting_and_its_first_op_build():
    space, _, budget = world("llama-1b", 64, 1, "h100-80gb", 60)
    pruner = Pruner(space.workload, space.hardware, budget)
    on_gpu = Config(1, 4, 0, "bf16", "none", "none")
    offloaded = Config(1, 4, 0, "bf16", "cpu", "none")
    model = model_for(space.hardware)
    # Its whole trial (the op's first build included) weighed by its chance of fitting, its death in the first
    # step by the rest; the offloaded one about twice as long.
    step = pruner.predict(on_gpu).step_time_s
    whole, dies = (trial_time(on_gpu, space.workload, space.hardware, step, model=model, fits=fits).total_s
                   for fits in (True, False))
    p = pruner.fit_probability(on_gpu)
    assert 0.5 < p < 1 and dies < whole
    assert pruner.trial_seconds(on_gpu) == pytest.approx(p * whole + (1 - p) * dies)
    assert model.op_build(FUSED_ADAM) < whole
    assert pruner.trial_seconds(offloaded) > 1.5 * pruner.trial_seconds(on_gpu)
    # Once a trial loaded FusedAdam, the next one does not build it again; cpu_adam is still to build.
    est = pruner.predict(on_gpu)  # measured as predicted
    ran = TrialResult(on_gpu, "ok", step_time_s=step, throughput_samples_per_s=est.throughput_samples_per_s,
                      peak_memory_bytes=est.peak_bytes, memory_budget_bytes=budget)
    taught = pruner.recalibrated(pruner.calibration, [ran])
    assert taught.ops_used == {FUSED_ADAM}
    same_odds = pruner.forecast(on_gpu)  # what the trial taught of memory aside
    assert pruner.trial_seconds(on_gpu) - taught.trial_seconds(on_gpu, same_odds) == pytest.approx(
        model.op_build(FUSED_ADAM))
    assert CPU_ADAM not in taught.ops_used
    # Unlikely to fit: mostly a death in its first step, far shorter than a whole trial.
    huge = Config(0, 64, 0, "fp32", "none", "none")
    assert pruner.fit_probability(huge) < 0.01
    assert taught.trial_seconds(huge) < 0.5 * trial_time(huge, space.workload, space.hardware,
                                                         pruner.predict(huge).step_time_s, model=model).total_s


def test_the_wall_seconds_a_sweep_expects_are_the_model_scaled_by_its_own_trials_less_their_op_phase():
    space, _, budget = world("llama-1b", 64, 1, "h100-80gb", 60)
    pruner = Pruner(space.workload, space.hardware, budget)
    a, b = Config(1, 4, 0, "bf16", "none", "none"), Config(1, 4, 0, "bf16", "cpu", "none")
    def ran(wall: float, **extra) -> TrialResult:
        return TrialResult(a, "ok", 10.0, wall_time_s=wall, extra=extra)

    assert pruner.expected_wall_s([a], []) is None  # nothing ran: nothing to judge by
    assert pruner.expected_wall_s([a], [ran(1.0)]) == pytest.approx(1.0)  # a took 1 s: a again, 1 s
    other = pruner.expected_wall_s([b], [ran(1.0)])  # b in a's seconds, as the model has them
    assert other > 1.5  # the offloaded optimizer's initialize
    # A trial that took 2 s beyond a 40 s op build: its op's phase left out, the next ones scaled alike.
    built = ran(42.0, phases_s={"build_ops_s": 40.0})
    assert pruner.expected_wall_s([a, b], [built]) == pytest.approx(2 * (1 + other))
    pruned = TrialResult(b, "pruned", error="unlikely to fit")
    assert pruner.expected_wall_s([a], [built, pruned]) == pytest.approx(2.0)
    # The first trial to load an op, its phases unrecorded (a simulated GPU's), may hold the op's build: the trials
    # after it judge, where there are any.
    assert pruner.expected_wall_s([a], [ran(100.0), ran(3.0)]) == pytest.approx(3.0)
    assert pruner.expected_wall_s([a], [ran(100.0)]) == pytest.approx(100.0)


def test_a_time_budget_starts_no_trial_expected_to_end_after_it_and_a_sweeps_first_always():
    from test_user_strategy import FixedOrder

    space, backend, budget = world("llama-1b", 64, 1, "h100-80gb", 60)
    order = [c for c in space if c.offload_optimizer == "none" and c.offload_param == "none"][:30]

    def sweep_for(time_s: float) -> tuple[Sweep, StopReason]:
        sweep = Sweep.in_memory(space, budget, lambda context: FixedOrder(order), backend.name, seed=0)
        return sweep, run_local(sweep, backend, Budget(30, time_s, stop_when=0), QuietProgress())

    sweep, reason = sweep_for(600.0)
    ran = [r for r in sweep.results if r.status != "pruned"]
    assert reason == StopReason.TIME and 2 <= len(ran) < 30
    assert sweep.spent_s <= 600.0 + ran[-1].wall_time_s  # the last one started expected to end within it
    following = next(c for c in order if c not in sweep.known)
    assert sweep.spent_s + sweep.pruner.expected_wall_s([following], sweep.results) > 600.0
    first, reason = sweep_for(1.0)  # less than any trial: the first runs, nothing to judge by before it
    assert reason == StopReason.TIME and len([r for r in first.results if r.status != "pruned"]) == 1
