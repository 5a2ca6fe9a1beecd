"""Strategies against the simulated and replay backends, through the real sweep loop."""

from __future__ import annotations

import json
from collections import Counter

import optuna
import pytest

from autotune.backends.replay import ReplayBackend, load_surface, surface_space
from autotune.backends.simulated import SimulatedBackend
from autotune.values.config import Config
from autotune.drivers.local import run_local
from autotune.drivers.stop import StopReason
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.prediction.estimate import Calibration, estimate
from autotune.values.hardware import PROFILES
from autotune.search.pruning import MIN_FIT_PROBABILITY, Pruner
from autotune.values.results import TrialResult
from autotune.search.rundir import RunDir
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.strategies import STRATEGIES, SearchContext, make_strategy
from autotune.strategies.grid import EARLY_STOP
from autotune.strategies.guide import LIKELY
from autotune.strategies.optuna_search import FIT_TO_RUN, INVALID_CONSTRAINT, PENALTY, WARM_START, OptunaStrategy
from autotune.values.workload import make_workload

optuna.logging.set_verbosity(optuna.logging.WARNING)
GiB = 2**30
# A GPU workload whose optimum needs more than stage and micro-batch (CPU optimizer offload).
WORKLOAD = make_workload("gpt2-large", 64, 4)
HARDWARE = PROFILES["v100-32gb"]
BUDGET = 16 * GiB
# The "real" machine of the simulated backend differs from the estimator the tuner holds.
TRUTH = Calibration(activation_scale=1.3, flops_scale=0.7)


@pytest.fixture(scope="module")
def gpu_space() -> Space:
    return Space(load_choices("default"), WORKLOAD, HARDWARE)


def sweep(name: str, space: Space, backend, budget: int, trials: int, seed: int = 0, storage=None,
          stop_when: float | None = None) -> Sweep:
    """`stop_when`: the convergence stop's threshold (None: the default; 0: off, for tests of a strategy's own
    stopping rule or of its order over the whole space)."""
    record: list[TrialResult] = []
    s = Sweep.in_memory(space, budget, name, backend.name, seed, record=record.append, calibrate=False, storage=storage)
    budget_ = Budget(trials) if stop_when is None else Budget(trials, stop_when=stop_when)
    s.stop_reason = run_local(s, backend, budget_, QuietProgress())
    assert record == s.results  # everything decided was recorded, in order
    return s


def launched(s: Sweep) -> list[TrialResult]:
    return [r for r in s.results if r.status != "pruned"]


def optimum(space: Space, backend, budget: int) -> float:
    return max(r.throughput_samples_per_s for r in map(backend.run, space) if r.fits(budget))


@pytest.mark.parametrize("name", ["grid", "random", "optuna", pytest.param("optuna-gp", marks=pytest.mark.slow)])
def test_each_strategy_on_simulated_backend(name, gpu_space):
    backend = SimulatedBackend(WORKLOAD, HARDWARE, BUDGET, noise=0.05, seed=1, calibration=TRUTH)
    s = sweep(name, gpu_space, backend, BUDGET, trials=12 if name == "optuna-gp" else 25)
    runs = launched(s)
    assert runs and len(runs) <= 25
    configs = [r.config for r in s.results]
    assert len(configs) == len(set(configs)), "a config was recorded twice"
    assert all(c in gpu_space for c in configs)
    for r in runs:  # nothing the estimator rules out whatever its error was launched
        assert Pruner(WORKLOAD, HARDWARE, BUDGET).forecast(r.config).peak_interval(4.0)[0] <= BUDGET
    for r in s.results:  # pruned: unlikely to fit (by probability, not a fixed margin), or no gain possible
        if r.status == "pruned":
            assert r.extra["fit_probability"] < MIN_FIT_PROBABILITY or r.extra["cause"] == "value"
    best = max((r for r in runs if r.fits(BUDGET)), key=lambda r: r.throughput_samples_per_s)
    assert s.best == best
    best_seen = best.throughput_samples_per_s / optimum(gpu_space, SimulatedBackend(
        WORKLOAD, HARDWARE, BUDGET, calibration=TRUTH), BUDGET)
    assert best_seen > {"grid": 0.6, "random": 0.6, "optuna": 0.85, "optuna-gp": 0.6}[name]


@pytest.fixture(scope="module")
def surface_file(tmp_path_factory):
    """A replay surface of the tiny model on the CPU space, recorded without a budget from a simulated
    machine unlike the estimator; a fifth of the configs left unmeasured."""
    workload, hardware = make_workload("tiny"), PROFILES["cpu"]
    space = Space(load_choices("cpu"), workload, hardware)
    backend = SimulatedBackend(workload, hardware, 10**12, noise=0.1, seed=3,
                               calibration=Calibration(activation_scale=1.4, overhead_bytes=int(0.5 * GiB)))
    path = tmp_path_factory.mktemp("surface") / "tiny-cpu.jsonl"
    with path.open("w") as out:
        for i, config in enumerate(space):
            if i % 5 == 4:
                continue
            line = backend.run(config).to_dict()
            line["memory_budget_bytes"] = None
            out.write(json.dumps({**line, "workload": workload.to_dict(), "hardware": "cpu"}) + "\n")
    return path


@pytest.mark.parametrize("name", ["grid", "random", "optuna", pytest.param("optuna-gp", marks=pytest.mark.slow)])
def test_each_strategy_on_replay_backend(name, surface_file):
    surface = load_surface(surface_file)
    space = surface_space(surface)
    budget = int(0.80 * GiB)
    backend = ReplayBackend(surface, budget)  # refuses (raises) any config the surface did not measure
    s = sweep(name, space, backend, budget, trials=10 if name == "optuna-gp" else 20)
    runs = launched(s)
    assert runs
    assert {r.config for r in s.results} <= set(surface.configs)
    assert len({r.config for r in s.results}) == len(s.results)
    for r in runs:  # what ran is what the surface recorded, as this budget sees it
        recorded = surface.results[r.config].under_budget(budget)
        assert (r.status, r.throughput_samples_per_s) == (recorded.status, recorded.throughput_samples_per_s)
    best = surface.best(budget)
    assert s.best.throughput_samples_per_s >= {"grid": 0.6, "random": 0.6, "optuna": 0.9, "optuna-gp": 0.6}[name] * (
        best.throughput_samples_per_s)


def test_grid_searches_stage_and_micro_batch_like_deepspeed(gpu_space):
    # A budget where the optimum needs CPU offload, outside grid's sub-space (at 14-15 GiB, since the CUDA
    # allocator's reserve and 16-bit logits' gradient cast are counted, ZeRO-1 mb2 without offload is the optimum).
    BUDGET = 16 * GiB  # noqa: N806
    backend = SimulatedBackend(WORKLOAD, HARDWARE, BUDGET, seed=1, calibration=TRUTH)
    s = sweep("grid", gpu_space, backend, BUDGET, trials=100)
    assert s.stop_reason == StopReason.DONE
    runs = [r.config for r in launched(s)]
    defaults = {k: v for k, v in gpu_space.choices.default().items() if k not in ("zero_stage", "micro_batch")}
    # Other knobs at the space's defaults (bf16 is unsupported on a V100: the nearest valid precision).
    assert {(c.ckpt_interval, c.offload_optimizer, c.offload_param) for c in runs} == {
        (defaults["ckpt_interval"], defaults["offload_optimizer"], defaults["offload_param"])}
    assert {c.precision for c in runs} == {"fp16"}
    stages = [c.zero_stage for c in runs]
    assert stages == sorted(stages)
    for stage in set(stages):
        mbs = [c.micro_batch for c in runs if c.zero_stage == stage]
        assert mbs == sorted(mbs)
        fitting = [c.micro_batch for c in gpu_space if c.zero_stage == stage and c.ckpt_interval == 0
                   and c.precision == "fp16" and c.offload_optimizer == c.offload_param == "none"
                   and estimate(c, WORKLOAD, HARDWARE).fits(BUDGET)]
        assert max(mbs) <= max(fitting)  # never beyond the largest micro-batch predicted to fit
    # Its best is the best of its sub-space; the true optimum (CPU offload) is outside it.
    assert optimum(gpu_space, backend, BUDGET) > s.best.throughput_samples_per_s


class Decreasing:
    """Every trial slower than the one before: grid must stop EARLY_STOP trials after the first."""

    name = "simulated"

    def __init__(self):
        self.calls = 0

    def run(self, config: Config) -> TrialResult:
        self.calls += 1
        return TrialResult(config, "ok", throughput_samples_per_s=100.0 / self.calls, peak_memory_bytes=GiB,
                           backend=self.name)


def test_grid_stops_after_five_trials_without_improvement(gpu_space):
    # The device's whole memory: more configs of grid's sub-space are predicted to fit than it will run.
    s = sweep("grid", gpu_space, Decreasing(), HARDWARE.memory_bytes, trials=100, stop_when=0)
    assert len(launched(s)) == 1 + EARLY_STOP
    assert s.stop_reason == StopReason.DONE


def test_grid_skips_stages_whose_model_states_do_not_fit():
    workload = make_workload("llama-7b", 64, 8)  # 16 bytes x 7B of ZeRO-0 model states: 112 GB > 80 GiB
    space = Space(load_choices("default"), workload, PROFILES["a100-80gb"])
    budget = 80 * GiB
    backend = SimulatedBackend(workload, PROFILES["a100-80gb"], budget)
    s = sweep("grid", space, backend, budget, trials=100)
    stages = {r.config.zero_stage for r in launched(s)}
    assert stages and 0 not in stages
    assert not any(r.status == "oom" for r in s.results)


def test_random_is_uniform_over_the_space_without_replacement_and_seeded():
    space = Space(load_choices("cpu"), make_workload("tiny"), PROFILES["cpu"])
    budget = 100 * GiB
    backend = SimulatedBackend(space.workload, space.hardware, budget)
    first = sweep("random", space, backend, budget, trials=10**6, seed=5, stop_when=0)
    assert first.stop_reason == StopReason.EXHAUSTED
    assert sorted(r.config for r in first.results) == sorted(space)
    again = sweep("random", space, backend, budget, trials=10, seed=5)
    other = sweep("random", space, backend, budget, trials=10, seed=6)
    # (the same records: value pruning may add pruned ones to the 10 launched)
    assert [r.config for r in again.results] == [r.config for r in first.results][:len(again.results)]
    assert [r.config for r in other.results] != [r.config for r in again.results]
    # Uniform: every stage shows up in the first third about as often as it does in the space.
    share = Counter(r.config.zero_stage for r in first.results[: len(space) // 3])
    expected = Counter(c.zero_stage for c in space)
    assert all(share[stage] > 0.5 * n / 3 for stage, n in expected.items())


def test_optuna_in_a_sweep_starts_at_the_likeliest_best_and_goes_by_expected_gain(gpu_space):
    # In a sweep (SearchContext.forecast): first the config predicted most valuable, likely to fit; then the most
    # valuable untried config per second of its trial (no configs picked for information alone: the expected
    # gain already sends trials where the model is unsure, benchmarks/results/search_valuable.md).
    backend = SimulatedBackend(WORKLOAD, HARDWARE, BUDGET)
    s = sweep("optuna", gpu_space, backend, BUDGET, trials=4)
    first = [r.config for r in s.results if r.status != "pruned"]
    assert len(first) == len(set(first)) == 4
    assert Pruner(WORKLOAD, HARDWARE, BUDGET).fit_probability(first[0]) >= LIKELY
    proposers = [t.user_attrs.get("proposed_by") for t in s.strategy.study.trials if "report_trial" in t.user_attrs]
    assert proposers[0] == "warm start" and set(proposers[1:]) <= {"expected gain", "likeliest to fit", "optuna",
                                                                   "nearest untried"}
    assert all(r.fits(BUDGET) for r in s.results if r.status != "pruned")


def test_optuna_without_a_sweep_is_warm_started_with_the_estimators_best_configs(gpu_space):
    strategy = make_strategy("optuna", SearchContext(gpu_space, BUDGET))
    predicted = sorted((estimate(c, WORKLOAD, HARDWARE) for c in gpu_space), key=lambda e: -e.throughput_samples_per_s)
    first = [strategy.propose() for _ in range(WARM_START)]
    assert first[0] == next(e.config for e in predicted if e.fits(BUDGET))
    assert all(estimate(c, WORKLOAD, HARDWARE).fits(BUDGET) for c in first)


def test_a_queued_proposal_shows_it_is_running_with_only_what_changed_written(gpu_space, monkeypatch):
    # Its knobs, label and proposer were written when it was enqueued: asking it writes its status alone (each
    # attribute a storage commit, ~9 a trial before).
    strategy = make_strategy("optuna", SearchContext(gpu_space, BUDGET))
    writes: list[str] = []
    storage = strategy.study._storage
    set_attr = storage.set_trial_user_attr
    monkeypatch.setattr(storage, "set_trial_user_attr", lambda tid, key, value: writes.append(key) or
                        set_attr(tid, key, value))
    config = strategy.propose()
    running = strategy.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    assert len(running) == 1 and writes == ["status"]
    attrs = running[0].user_attrs
    assert attrs["status"] == "running" and attrs["config"] == config.label() and attrs["proposed_by"] == "warm start"
    assert {knob: attrs[knob] for knob in config.to_dict()} == config.to_dict()


def test_optuna_starts_with_the_smallest_predicted_config_when_none_is_predicted_to_fit(gpu_space):
    estimates = [estimate(c, WORKLOAD, HARDWARE) for c in gpu_space]
    smallest = min(estimates, key=lambda e: e.peak_bytes)
    budget = int(smallest.peak_bytes / 1.1)  # within the pruning margin of the smallest only
    strategy = make_strategy("optuna", SearchContext(gpu_space, budget))
    assert strategy.warm_start() == [smallest.config]
    assert strategy.propose() == smallest.config


def test_optuna_keeps_failures_infeasible_and_never_run_proposals_out_of_complete(gpu_space, monkeypatch):
    budget = 12 * GiB
    backend = SimulatedBackend(WORKLOAD, HARDWARE, budget, calibration=Calibration(activation_scale=2.0))
    # Every turn TPE's (in a guided sweep it proposes only where no guided pick is worth its risk): its invalid,
    # repeated and unlikely proposals are what the study must keep apart.
    monkeypatch.setattr(OptunaStrategy, "_guided", lambda self: None)
    s = sweep("optuna", gpu_space, backend, budget, trials=25)
    statuses = Counter(r.status for r in s.results)
    # (Guided by the sweep's forecast, Optuna proposes few configs that get pruned or fail.)
    assert statuses["oom"] + statuses["pruned"] > 0
    study = s.strategy.study
    trials = study.get_trials()
    State = optuna.trial.TrialState
    by_status = {}
    for t in trials:
        by_status.setdefault(t.user_attrs["status"], []).append(t)
    # Only the configs that ran and fit are COMPLETE: one per such trial, as trials.jsonl has them.
    complete = [t for t in trials if t.state == State.COMPLETE]
    fit = [r for r in launched(s) if r.fits(budget)]
    assert len(complete) == len(fit) and len(launched(s)) == 25
    assert sorted(t.user_attrs["report_trial"] for t in complete) == [r.extra["trial"] for r in fit]
    # A config that ran and failed is infeasible with no value (no throughput of 0 in the dashboard's plots);
    # the samplers still see it COMPLETE at PENALTY, as before (sampler_view).
    view = s.strategy.study.sampler
    for t in by_status.get("oom", []):
        assert t.state == State.PRUNED and t.value is None and list(t.constraints.values())[0] > 0
        assert t.user_attrs["feasible"] is False
        seen = view.trial(t)
        assert seen.state == State.COMPLETE and seen.value == PENALTY and seen.constraints == t.constraints
    ran = [t for t in trials if "report_trial" in t.user_attrs and t.user_attrs["status"] != "pruned"]
    assert sorted(t.user_attrs["report_trial"] for t in ran) == [r.extra["trial"] for r in launched(s)]
    for t in by_status["ok"]:
        assert t.state == State.COMPLETE and t.value > 0 and list(t.constraints.values())[0] <= 0
        config = s.strategy.config_of(t.params)
        assert s.known[config].throughput_samples_per_s == pytest.approx(t.value)
        assert t.user_attrs["throughput_samples_per_s"] == pytest.approx(t.value)
    # Pruned configs never ran: PRUNED, infeasible, under their trial number in trials.jsonl.
    assert len(by_status.get("pruned", [])) == statuses["pruned"]
    for t in by_status.get("pruned", []):
        assert t.state == State.PRUNED and t.value is None and list(t.constraints.values())[0] > 0
        assert s.results[t.user_attrs["report_trial"] - 1].status == "pruned"
    # Invalid combinations and repeats are told without running or recording anything.
    for t in by_status.get("invalid", []):
        assert t.state == State.PRUNED and list(t.constraints.values()) == [INVALID_CONSTRAINT]
        assert t.user_attrs["reason"] and "report_trial" not in t.user_attrs
    for t in by_status.get("repeat", []):
        assert t.state == State.FAIL and "report_trial" not in t.user_attrs
    # A sampled proposal the forecast finds unlikely to fit: infeasible by its median predicted peak, not run.
    for t in by_status.get("unlikely to fit", []):
        assert t.state == State.PRUNED and list(t.constraints.values())[0] > 0 and "report_trial" not in t.user_attrs
        assert t.user_attrs["fit_probability"] < FIT_TO_RUN
    assert by_status.get("invalid") or by_status.get("repeat") or by_status.get("unlikely to fit")


def test_optuna_same_seed_same_sweep(gpu_space, monkeypatch):
    backend = SimulatedBackend(WORKLOAD, HARDWARE, BUDGET, calibration=TRUTH)
    guided = [[r.config for r in sweep("optuna", gpu_space, backend, BUDGET, 15, seed=seed).results] for seed in (7, 7)]
    assert guided[0] == guided[1]
    monkeypatch.setattr(OptunaStrategy, "_guided", lambda self: None)  # TPE's turns: they follow the seed
    runs = [[r.config for r in sweep("optuna", gpu_space, backend, BUDGET, 15, seed=seed).results]
            for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("done", [1, 4, 9], ids=["warm-start-queued", "last-warm-start", "sampler"])
def test_optuna_resumed_study_reruns_the_trial_in_flight(done, tmp_path, gpu_space):
    # With done=1, warm-start trials still wait in the study's queue: the re-run must go ahead of them.
    url = RunDir(tmp_path).storage()
    backend = SimulatedBackend(WORKLOAD, HARDWARE, BUDGET, calibration=TRUTH)
    context = SearchContext(gpu_space, BUDGET, 0, None, url)
    first = make_strategy("optuna", context)
    history = []
    for _ in range(done):
        config = first.propose()
        history.append(backend.run(config).under_budget(BUDGET))
        first.observe(config, history[-1])
    in_flight = first.propose()  # the tuner dies while this one runs
    del first

    second = make_strategy("optuna", context)
    for result in history:
        second.observe(result.config, result)
    assert second.propose() == in_flight
    states = Counter(t.state for t in second.study.get_trials())
    assert states[optuna.trial.TrialState.RUNNING] == 1  # only the re-run
    assert {c for c in second.outcomes} >= {r.config for r in history}
    second.observe(in_flight, backend.run(in_flight).under_budget(BUDGET))
    assert not any(t.state == optuna.trial.TrialState.RUNNING for t in second.study.get_trials())
    assert second.propose() not in {r.config for r in history} | {in_flight}


def test_optuna_resume_tells_a_result_that_was_recorded_but_never_told(tmp_path, gpu_space):
    url = RunDir(tmp_path).storage()
    backend = SimulatedBackend(WORKLOAD, HARDWARE, BUDGET, calibration=TRUTH)
    context = SearchContext(gpu_space, BUDGET, 0, None, url)
    first = make_strategy("optuna", context)
    config = first.propose()
    result = backend.run(config).under_budget(BUDGET)  # recorded, then the tuner died before observe
    del first

    second = make_strategy("optuna", context)
    second.observe(config, result)
    nxt = second.propose()
    assert nxt != config
    State = optuna.trial.TrialState
    done = [t for t in second.study.get_trials() if t.user_attrs.get("status") == result.status]
    assert [second.config_of(t.params) for t in done] == [config]
    assert done[0].state == (State.COMPLETE if result.fits(BUDGET) else State.PRUNED)
    assert (done[0].value or PENALTY) == pytest.approx(second.outcome(result)[0])


def test_the_search_strategies_are_registered_and_constructible(gpu_space):
    for name in ("grid", "random", "optuna", "optuna-gp"):  # rl and hybrid: tests/test_rl*.py
        assert name in STRATEGIES
        strategy = make_strategy(name, SearchContext(gpu_space, BUDGET))
        assert strategy.name == name
        assert strategy.propose() in gpu_space


class ScriptLikeBackend:
    """Fails for a reason of its own after two trials, as a user's script that stops stepping would."""

    name = "simulated"

    def __init__(self) -> None:
        self.inner = SimulatedBackend(WORKLOAD, HARDWARE, BUDGET)
        self.runs = 0
        self.fatal: str | None = None

    def run(self, config: Config) -> TrialResult:
        self.runs += 1
        if self.runs == 2:
            self.fatal = "never_steps: the script never called engine.step()"
        return self.inner.run(config)


def test_the_local_loop_stops_when_the_backend_reports_a_fatal_failure(gpu_space):
    backend = ScriptLikeBackend()
    s = sweep("random", gpu_space, backend, BUDGET, trials=10)
    assert s.stop_reason == "fatal" and backend.runs == 2 and len(launched(s)) == 2
