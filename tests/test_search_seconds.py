"""Issue 41, "Measured in seconds": the simulated worlds' GPU-like trial times (autotune.backends.simulated.TrialClock
on the trial-time model), DeepSpeed's autotuner's order as a strategy (benchmarks/peer_deepspeed_autotuner.py), and
the benchmarks' trial-seconds arithmetic (benchmarks/search_efficiency.py, search_seconds.py). No trial runs here."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from autotune.backends.replay import ReplayBackend, load_surface, surface_space
from autotune.backends.simulated import SimulatedBackend
from autotune.drivers.sweep import Sweep
from autotune.envs.actions import JUMP
from autotune.envs.sampler import Task
from autotune.prediction.estimate import estimate
from autotune.prediction.trial_time import CPU_ADAM, CUDA, FUSED_ADAM, trial_time
from autotune.rl.simulator import distorted_task
from autotune.search_spaces import load_choices
from autotune.strategies import SearchContext, guide
from autotune.values.config import Config
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult
from autotune.values.space import Choices, Space
from autotune.values.workload import make_workload

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import peer_deepspeed_autotuner as peer  # noqa: E402
import search_efficiency as se  # noqa: E402
import search_seconds as ss  # noqa: E402

GiB = 2**30
H100 = PROFILES["h100-80gb"]
MEDIUM = make_workload("gpt2-medium", 32)  # 0.35e9 parameters, one GPU
BUDGET = 40 * GiB
PLAIN = Config(2, 4, 0, "bf16")  # 14.7 GiB predicted: fits
OFFLOAD = Config(2, 4, 0, "bf16", "cpu")  # 8.9 GiB: fits
TOO_BIG = Config(0, 32, 0, "bf16")  # 63 GiB: out of memory at 40 GiB
BOTH = frozenset({FUSED_ADAM, CPU_ADAM})


def model_s(config: Config, fits: bool = True, built: frozenset[str] = BOTH, ahead: bool = True) -> float:
    """A run's trial after its first (on ranks started ahead) unless `ahead` is False."""
    step = estimate(config, MEDIUM, H100).step_time_s
    return trial_time(config, MEDIUM, H100, step, fits=fits, ops_built=built, ahead=ahead).total_s


def clocked(**kwargs) -> SimulatedBackend:
    return SimulatedBackend(MEDIUM, H100, BUDGET, trial_times=True, **kwargs)


def test_a_simulated_trial_takes_the_trial_time_models_seconds_at_its_step_time():
    backend = clocked()
    first, again = backend.run(PLAIN), backend.run(PLAIN)
    assert first.status == "ok" and first.step_time_s == pytest.approx(estimate(PLAIN, MEDIUM, H100).step_time_s)
    # the run's first: FusedAdam's first build in it, its ranks started while the op built (Spares.start_first)
    assert first.wall_time_s == pytest.approx(model_s(PLAIN, built=frozenset()))
    assert again.wall_time_s == pytest.approx(model_s(PLAIN))  # on ranks the first started, as the deepspeed backend's
    assert first.wall_time_s - again.wall_time_s == pytest.approx(CUDA.op_build(FUSED_ADAM))
    assert first.extra["import_ahead_s"] > 0 and again.extra["import_ahead_s"] > 0  # what the sweep reads
    # cold, the first trial would pay its imports and initialize's first call as well
    assert model_s(PLAIN, built=frozenset(), ahead=False) - first.wall_time_s == pytest.approx(
        CUDA.launch_s - CUDA.ahead_launch_s + CUDA.initialize_s - CUDA.ahead_initialize_s)


def test_optimizer_offload_costs_more_and_its_op_builds_once_per_run():
    backend = clocked()
    backend.run(PLAIN)  # FusedAdam built
    offload_first, offload_again = backend.run(OFFLOAD), backend.run(OFFLOAD)
    assert offload_first.wall_time_s - offload_again.wall_time_s == pytest.approx(CUDA.op_build(CPU_ADAM))
    assert offload_again.wall_time_s == pytest.approx(model_s(OFFLOAD))
    assert offload_again.wall_time_s > backend.run(PLAIN).wall_time_s + 5  # initialize pins the host's buffers
    assert backend.run(Config(2, 8, 0, "bf16", "cpu")).wall_time_s < offload_first.wall_time_s  # built already
    # A new run (reseed; a copy at another budget) builds its ops again.
    backend.reseed(1)
    assert backend.run(PLAIN).wall_time_s == pytest.approx(model_s(PLAIN, built=frozenset()))
    assert backend.with_budget(BUDGET).run(PLAIN).wall_time_s == pytest.approx(model_s(PLAIN, built=frozenset()))


def test_an_out_of_memory_trial_dies_in_its_first_step_and_still_builds_its_op():
    backend = clocked()
    oom = backend.run(TOO_BIG)
    assert oom.status == "oom"
    assert oom.wall_time_s == pytest.approx(model_s(TOO_BIG, fits=False, built=frozenset()))
    assert backend.run(TOO_BIG).wall_time_s == pytest.approx(model_s(TOO_BIG, fits=False))
    roomy = SimulatedBackend(MEDIUM, H100, 80 * GiB, trial_times=True)
    roomy.run(PLAIN)
    assert roomy.run(TOO_BIG).status == "ok" and roomy.run(TOO_BIG).wall_time_s > backend.run(TOO_BIG).wall_time_s
    assert backend.run(PLAIN).wall_time_s == pytest.approx(model_s(PLAIN))  # the OOM trial had built FusedAdam


def test_fp16_takes_bf16s_time_zero3_longer_and_unsupported_nothing():
    backend = clocked()
    backend.run(PLAIN)
    # no skipped steps expected: every fp16 trial of the 11-30 H200 run applied its first step
    assert backend.run(Config(2, 4, 0, "fp16")).wall_time_s == pytest.approx(backend.run(PLAIN).wall_time_s)
    assert backend.run(Config(3, 4, 0, "bf16")).wall_time_s > backend.run(PLAIN).wall_time_s + 2  # initialize
    unsupported = backend.run(Config(0, 64, 0, "bf16"))  # 64 does not divide the global batch of 32
    assert unsupported.status == "unsupported" and unsupported.wall_time_s == 0


def test_trial_times_carry_the_worlds_noise_and_leave_its_throughput_draws_as_they_were():
    plain = SimulatedBackend(MEDIUM, H100, BUDGET, noise=0.1, seed=3)
    timed = clocked(noise=0.1, seed=3)
    configs = [PLAIN, OFFLOAD, TOO_BIG, Config(1, 2, 0, "bf16"), PLAIN, PLAIN]
    assert [plain.run(c).throughput_samples_per_s for c in configs] == \
        [timed.run(c).throughput_samples_per_s for c in configs]
    logs = [math.log(timed.run(PLAIN).wall_time_s / model_s(PLAIN)) for _ in range(400)]
    assert abs(float(np.mean(logs))) < 0.02 and 0.085 < float(np.std(logs)) < 0.115
    assert clocked(noise=0.1, seed=3).run(PLAIN).wall_time_s == clocked(noise=0.1, seed=3).run(PLAIN).wall_time_s
    # Off by default: the flat overhead plus measured steps the other tests pin.
    assert plain.run(TOO_BIG).wall_time_s == 15.0


def test_distorted_worlds_take_gpu_like_times_at_the_true_step_time():
    task = Task(MEDIUM, H100, BUDGET, load_choices("default"))
    world = distorted_task(task, 0.3, 0.0, seed=4)
    assert world.clock is not None
    index = world.landscape.index
    ran = [c for c in world.landscape.space if c in index and world.feasible[index[c]]]
    failed = [c for c in world.landscape.space if c in index and not world.feasible[index[c]]]
    first = world.run(ran[0])
    step = MEDIUM.global_batch / world.true_throughput(ran[0])
    own = trial_time(ran[0], MEDIUM, H100, step, ops_built=frozenset(), ahead=True).total_s  # imports made as it built
    assert first.wall_time_s == pytest.approx(own)
    oom = world.run(failed[0])
    assert oom.status == "oom"
    step = MEDIUM.global_batch / world.true_throughput(failed[0])
    assert oom.wall_time_s < trial_time(failed[0], MEDIUM, H100, step).total_s
    # A fresh noise seed is a fresh run: its first trial builds its op again; the same seed draws the same times.
    again = world.with_noise_seed(9)
    assert again.run(ran[0]).wall_time_s == pytest.approx(own)
    noisy = distorted_task(task, 0.3, 0.1, seed=4)
    assert [noisy.with_noise_seed(2).run(c).wall_time_s for c in ran[:3]] == \
        [noisy.with_noise_seed(2).run(c).wall_time_s for c in ran[:3]]


class Predicted:
    def __init__(self, fits: bool) -> None:
        self._fits = fits

    def fits(self, budget_bytes: int) -> bool:
        return self._fits


def drive(strategy, outcome) -> list[Config]:
    """Proposals until the strategy is done, each answered with `outcome(config)`."""
    order = []
    while (config := strategy.propose()) is not None:
        order.append(config)
        strategy.observe(config, outcome(config))
        assert len(order) < 100
    return order


def test_the_deepspeed_schedule_runs_stages_in_order_and_its_micro_batch_search_within_each():
    workload = make_workload("gpt2-small", 64)
    space = Space(load_choices("default"), workload, H100)
    # Predicted to fit: up to micro-batch 16 at ZeRO 0, 32 at ZeRO 1, 64 at ZeRO 2 and 3; truly out of memory
    # above those, but ZeRO 1's 32; throughput grows with the micro-batch and the stage.
    largest = {0: 16, 1: 32, 2: 64, 3: 64}
    context = SearchContext(space, BUDGET, predict=lambda c: Predicted(c.micro_batch <= largest[c.zero_stage]))

    def outcome(config: Config) -> TrialResult:
        if config.micro_batch > largest[config.zero_stage] or (config.zero_stage, config.micro_batch) == (1, 32):
            return TrialResult(config, "oom", peak_memory_bytes=2 * BUDGET)
        return TrialResult(config, "ok", throughput_samples_per_s=config.micro_batch + config.zero_stage / 10,
                           peak_memory_bytes=GiB)

    schedule = peer.DeepSpeedSchedule(context)
    order = drive(schedule, outcome)
    assert [(c.zero_stage, c.micro_batch) for c in order] == [
        (3, 1),  # the model-info profile run
        (0, 1), (0, 16), (0, 8),  # the user's micro-batch, the largest predicted to fit, then half of it
        (1, 16), (1, 32),  # from the largest so far; 32 is out of memory, so 16 stays the largest
        (2, 16), (2, 64), (2, 32),  # from 16: the largest predicted (64) runs; then half of it
        (3, 64)]  # from 64, the largest so far, which is also the largest predicted: nothing else to tune
    assert all((c.ckpt_interval, c.precision, c.offload_optimizer, c.offload_param) == (0, "bf16", "none", "none")
               for c in order)  # the space's defaults: stage and micro-batch only
    assert schedule.order == order
    # A failed profile run ends it, as DeepSpeed's autotuner tunes nothing then.
    failed = peer.DeepSpeedSchedule(context)
    assert drive(failed, lambda c: TrialResult(c, "oom", peak_memory_bytes=2 * BUDGET)) == [order[0]]


def test_the_deepspeed_schedule_searches_for_the_largest_micro_batch_and_stops_at_a_plateau():
    workload = make_workload("gpt2-small", 64)
    choices = Choices(zero_stage=(0,), micro_batch=(1, 2, 4, 8, 16, 32, 64), ckpt_interval=(0,), precision=("bf16",),
                      offload_optimizer=("none",), offload_param=("none",))
    context = SearchContext(Space(choices, workload, H100), BUDGET, predict=lambda c: Predicted(True))
    # Predicted: everything fits. Truly up to 16; from 1 to 8 the gain is under 5%: a plateau ends the binary search
    # at 8, so 16 (the fastest) is never tried.
    gains = {1: 10.0, 2: 15.0, 4: 18.0, 8: 10.3, 16: 40.0}

    def outcome(config: Config) -> TrialResult:
        if config.micro_batch not in gains:
            return TrialResult(config, "oom", peak_memory_bytes=2 * BUDGET)
        return TrialResult(config, "ok", throughput_samples_per_s=gains[config.micro_batch], peak_memory_bytes=GiB)

    order = drive(peer.DeepSpeedSchedule(context), outcome)
    # No ZeRO-3 in the space: no profile run. The user's 1; the largest predicted, 64, fails (its 1.05x and 0.95x are
    # no micro-batches here); the binary search's first middle, 8, plateaus; then the list from half the largest.
    assert [c.micro_batch for c in order] == [1, 64, 8, 4]
    assert peer.tuning_list([1, 2, 4, 8, 16, 32, 64], 1, 16) == [8, 16]
    assert peer.tuning_list([1, 2, 3, 4, 5, 6, 7, 8], 1, 8) == [4, 8]
    assert peer.tuning_list([1, 2, 4, 8, 16, 32, 64], 16, 16) == [16]


def test_seconds_to_98_sums_the_launched_trials_wall_times_until_the_recommendation_gets_there():
    curve = [0.5, 0.9, 0.97, 0.99, 1.0]
    walls = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert se.seconds_to(curve, walls, 0.95) == 60.0
    assert se.seconds_to(curve, walls, 0.98) == 100.0
    assert se.seconds_to(curve[:3], walls[:3], 0.98) == math.inf
    run = se.Run("distorted", "task", "optuna", 0, curve, 0, 2, 5, 1.0, 0.1,
                 chances=[0.5, 0.4, 0.3, 0.2, 0.01], walls=walls)
    assert run.seconds_to() == 100.0 and run.seconds_to(0.95) == 60.0
    assert run.stop_at() == 5 and run.seconds_at_stop() == 150.0  # at least 6 trials, else the run's end
    assert run.stop_at(0.25, 3) == 4 and run.seconds_at_stop(0.25, 3) == 100.0
    assert se.ratio(50.0, 100.0) == 0.5 and se.ratio(math.inf, 100.0) == math.inf
    assert se.ratio(50.0, math.inf) == 0.0 and math.isnan(se.ratio(math.inf, math.inf))


def test_search_seconds_rows_take_medians_and_percentiles_over_runs_and_match_the_schedule():
    def record(strategy: str, seed: int, curve: list[float], walls: list[float]) -> dict:
        return ss.run_record("held-out GPU", 0.03, "task", strategy, seed, curve, walls, [0.5] * len(curve), 0, 0)

    runs = [record("optuna", 0, [0.5, 0.99], [10.0, 20.0]),  # 30 s to 98%
            record("optuna", 1, [0.99], [40.0]),  # 40 s
            record("optuna", 2, [0.5, 0.6], [5.0, 5.0]),  # never
            record("deepspeed", 0, [0.5, 0.9], [1.0, 1.0]),
            record("deepspeed", 1, [0.7], [2.0]),
            record("deepspeed", 2, [0.6], [3.0])]
    table = ss.tables(runs, ("optuna", "deepspeed"))["held-out GPU, 3% noise"]
    optuna, deepspeed = table["strategies"]["optuna"], table["strategies"]["deepspeed"]
    assert optuna["median_trial_s_to_98"] == 40.0 and optuna["p5_trial_s_to_98"] == 30.0
    assert optuna["p95_trial_s_to_98"] == math.inf and optuna["median_trials_to_98"] == 2
    assert optuna["reached_98_share"] == pytest.approx(2 / 3)
    assert deepspeed["median_trial_s_to_98"] == math.inf and table["fastest"] == "optuna"
    assert optuna["trial_s_to_98_over_deepspeed"] == 0.0 and optuna["trial_s_to_98_over_optuna"] == 1.0
    # As good as the schedule's final recommendation (0.9, 0.7, 0.6): optuna 30, 40 and 10 s; the schedule 2, 2, 3 s.
    assert optuna["median_trial_s_to_deepspeed_final"] == 30.0 and deepspeed["median_trial_s_to_deepspeed_final"] == 2.0
    assert optuna["median_trial_s_at_stop"] == 30.0  # no stop before the runs' ends


def test_the_done_when_ratio_comes_with_its_paired_wins_and_bootstrap_interval():
    def record(strategy: str, seed: int, seconds: float) -> dict:
        reached = math.isfinite(seconds)
        return ss.run_record("held-out GPU", 0.03, "task", strategy, seed, [0.99 if reached else 0.5],
                             [seconds if reached else 50.0], [0.5], 0, 0)

    mine = [10.0, 20.0, 30.0, 40.0, math.inf]
    ref = [20.0, 20.0, 60.0, 80.0, math.inf]
    runs = [record("hybrid", i, s) for i, s in enumerate(mine)] + [record("optuna-flat", i, s) for i, s in enumerate(ref)]
    runs.append(record("hybrid", 9, 1.0))  # no pair: left out
    pair = ss.paired(runs, "hybrid", "optuna-flat")
    assert (pair["runs"], pair["wins"], pair["losses"]) == (5, 3, 0)
    assert pair["ratio_low"] <= 30.0 / 60.0 <= pair["ratio_high"] and pair["ratio_high"] <= 1.0
    assert ss.paired(runs, "hybrid", "deepspeed") == {}


def test_the_goals_weigh_the_default_against_its_references_and_the_policy_against_optuna_alone():
    def record(strategy: str, seed: int, seconds: float) -> dict:
        return ss.run_record("held-out GPU", 0.03, "task", strategy, seed, [0.99], [seconds], [0.5], 0, 0)

    seconds = {"optuna": [10.0, 20.0, 30.0], "optuna-flat": [30.0, 40.0, 50.0], "hybrid": [20.0, 10.0, 40.0],
               "rl": [40.0, 50.0, 60.0]}
    runs = [record(name, i, s) for name, row in seconds.items() for i, s in enumerate(row)]
    result = {"tables": ss.tables(runs, tuple(seconds))}
    goals = ss.goals(result, runs)
    assert goals["strategy"] == ss.DEFAULT_STRATEGY == "optuna"
    assert goals["trial_s_to_98_over_optuna-flat"] == 0.5 and goals["at_most_0.6x_optuna-flat"]
    policy = goals["policy_over_optuna"]
    assert set(policy) == {"hybrid", "rl"} and "optuna" not in policy
    assert policy["hybrid"]["ratio"] == 1.0 and (policy["hybrid"]["paired"]["wins"], policy["hybrid"]["paired"]["losses"]) == (1, 2)
    assert policy["rl"]["ratio"] == 2.5 and policy["rl"]["paired"]["losses"] == 3
    assert "hybrid 1.00x optuna's (paired over 3 runs: faster in 1, slower in 2" in ss.markdown(
        {**result, "goals": goals, "command": "python benchmarks/search_seconds.py", "parts": []})


def test_replay_sweeps_spend_their_surfaces_recorded_wall_times():
    surface = load_surface(BENCHMARKS / se.GPU_SURFACES[0])  # the 11-26 H200 run: llama-1b, 2 configs
    space = surface_space(surface)
    budget = max(r.memory_budget_bytes or 0 for r in surface.results.values())
    best = surface.best(budget)
    assert best is not None
    outcome = se.run_sweep("optuna", space, ReplayBackend(surface, budget), budget, 5, 0,
                           lambda c: surface.results[c].throughput_samples_per_s or 0.0,
                           best.throughput_samples_per_s)
    recorded = sorted(r.wall_time_s for r in surface.results.values())
    assert outcome.walls is not None and sorted(outcome.walls) == pytest.approx(recorded)


def test_the_flat_baselines_are_the_same_strategies_blind_to_seconds():
    space = Space(load_choices("default"), MEDIUM, H100)
    for name in ("optuna", "hybrid"):
        aware = Sweep.in_memory(space, BUDGET, se.strategy_arg(name), "simulated").strategy
        blind = Sweep.in_memory(space, BUDGET, se.strategy_arg(f"{name}-flat"), "simulated").strategy
        assert type(aware) is type(blind)
        # The hybrid's Optuna half holds the context its guided picks read.
        aware, blind = getattr(aware, "search", aware), getattr(blind, "search", blind)
        assert aware.context.trial_seconds is not None and blind.context.trial_seconds is None


def proposals(name: str, trials: int = 4):
    """A benchmark schedule's first proposals, each run on the clocked simulation and told: (strategy, configs)."""
    strategy = Sweep.in_memory(Space(load_choices("default"), MEDIUM, H100), BUDGET, se.strategy_arg(name),
                               "simulated").strategy
    backend, proposed = clocked(), []
    for _ in range(trials):
        config = strategy.propose()
        assert config is not None
        proposed.append(config)
        strategy.observe(config, backend.run(config))
    return strategy, proposed


def test_the_policy_first_variant_runs_the_policys_first_proposals_then_the_guided_warm_start():
    strategy, proposed = proposals("hybrid-rl2")
    assert isinstance(strategy, se.PolicyFirst) and strategy.first == 2
    assert strategy.policy.proposed == 2 and set(proposed[:2]) == strategy.proposed
    assert not strategy.proposed & set(proposed[2:])  # then the guided warm start, not the policy's turns


def test_the_forecast_jump_variant_jumps_to_the_forecasts_most_valuable_pick_and_may_start_there():
    space = Space(load_choices("default"), MEDIUM, H100)
    backend = clocked()
    starting = Sweep.in_memory(space, BUDGET, se.strategy_arg("rl-fjs"), "simulated").strategy
    first = guide.most_valuable(starting.context, set(), 0.0)
    assert first is not None and starting._landscape().configs[starting.env._current] == first
    strategy = Sweep.in_memory(space, BUDGET, se.strategy_arg("rl-fj"), "simulated").strategy
    assert isinstance(strategy, se.ForecastJump) and strategy.env._current != strategy._landscape().index[first]
    jumps = 0
    for _ in range(8):
        pick = guide.most_valuable(strategy.context, strategy.tried | strategy.pruned, strategy.best)
        config = strategy.propose()
        assert config is not None and strategy.pending is not None
        if strategy.pending[0] == JUMP:
            jumps += 1
            assert config == pick
        strategy.observe(config, backend.run(config))
    assert jumps > 0 and len(strategy.tried) == 8


def test_the_layout_variant_keeps_the_policys_layout_and_takes_the_forecasts_micro_batch_and_checkpointing():
    space = Space(load_choices("default"), MEDIUM, H100)
    plain = Sweep.in_memory(space, BUDGET, "rl", "simulated").strategy
    laid = Sweep.in_memory(space, BUDGET, se.strategy_arg("rl-lay"), "simulated").strategy
    assert isinstance(laid, se.LayoutPolicy)
    backend = clocked()
    for _ in range(8):
        own, config = plain.propose(), laid.propose()
        assert own is not None and config is not None
        if config != own:  # the first proposal the forecast changed: the policy's layout, the forecast's pick in it
            assert se.layout(config) == se.layout(own) and laid.pending == (JUMP, config)
            break
        result = backend.run(config)
        plain.observe(config, result)
        laid.observe(config, result)
    else:
        raise AssertionError("the forecast never changed the policy's proposal in 8 trials")


def test_the_alternating_variant_gives_the_policy_and_optuna_turns_from_the_first_trial():
    strategy, proposed = proposals("hybrid-alt")
    assert isinstance(strategy, se.Alternate) and isinstance(strategy.policy, se.ForecastJump)
    assert [c in strategy.proposed for c in proposed] == [True, False, True, False]
    assert strategy.policy.tried == set(proposed)  # Optuna's trials too: the policy's forecast picks skip them


def test_cost_spread_reads_each_goal_task_s_trials_after_the_first_and_bounds_what_cheap_picks_save():
    def run(task, walls, world=ss.GOAL_WORLD, noise=ss.GOAL_NOISE):
        return {"world": world, "noise": noise, "task": task, "walls": walls}

    runs = [run("a", [46.0, 15.0, 17.0, 18.0]), run("a", [48.0, 16.0, 17.0]), run("b", [150.0, 20.0, 200.0, 400.0]),
            run("a", [1.0, 1.0], noise=0.1), run("c", [])]
    spread = {t["task"]: t for t in ss.cost_spread(runs)}
    assert set(spread) == {"a", "b"}  # the other noise level's run and a run without trials are left out
    assert spread["a"] == {"task": "a", "trials": 5, "first_s": 47.0, "cheapest_s": 15.0, "p10_s": 15.0,
                           "median_s": 17.0}
    assert spread["b"]["cheapest_s"] / spread["b"]["median_s"] == pytest.approx(0.1)
    text = "\n".join(ss.bound_lines({"tables": {ss.title(ss.GOAL_WORLD, ss.GOAL_NOISE): {"strategies": {
        "optuna-flat": {"median_trials_to_98": 8}}}}, "cost_spread": list(spread.values())}))
    # Only task a is one where cheap picks save little (15/17 >= 0.85); 0.6 x (47 + 17 x 7) s = 99.6 s: 47 s and 3.1 x 17 s
    assert "In 1 of 2 tasks" in text and "asks for 4.1 trials" in text


def test_combined_parts_keep_the_last_parts_run_of_each_strategy_world_task_and_seed(tmp_path):
    def part(name, strategy, seeds, wall):
        runs = [{"world": "held-out GPU", "noise": 0.03, "task": "t", "strategy": strategy, "seed": seed,
                 "curve": [1.0], "walls": [wall], "chances": [None], "oom": 0, "pruned": 0} for seed in seeds]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"command": name, "seconds": 60.0, "machine": "m", "source": "s",
                                    "strategies": [strategy], "runs": runs}))
        return str(path)

    out = tmp_path / "out"
    assert ss.main(["--combine", part("a", "rl", [0, 1], 10.0), part("b", "optuna", [0, 1], 20.0),
                    part("c", "rl", [1], 30.0), "--out", str(out)]) == 0
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    walls = {(r["strategy"], r["seed"]): r["walls"] for r in runs}
    assert walls == {("rl", 0): [10.0], ("rl", 1): [30.0], ("optuna", 0): [20.0], ("optuna", 1): [20.0]}
    assert "A later part's run replaces an earlier one" in out.with_suffix(".md").read_text()
