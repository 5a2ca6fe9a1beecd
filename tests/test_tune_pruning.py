"""Estimator consultation before each trial: pruning by probability and value, and what measured and
out-of-memory results teach it."""

from __future__ import annotations

import math

from autotune.values.config import Config
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.prediction.estimate import Calibration, estimate
from autotune.values.hardware import PROFILES
from autotune.search.pruning import MIN_FIT_PROBABILITY, VALUE_SLACK, VALUE_Z, Pruner, cause_counts, describe_causes
from autotune.values.results import TrialResult
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.strategies import SearchContext, make_strategy
from autotune.values.workload import make_workload

WORKLOAD, HARDWARE = make_workload("tiny"), PROFILES["cpu"]
SMALL, BIG = Config(0, 1, 0, "bf16"), Config(0, 8, 0, "fp32")


def test_a_config_far_over_the_budget_is_pruned_with_its_probability_interval_and_reason():
    big = estimate(BIG, WORKLOAD, HARDWARE)
    budget = big.peak_bytes // 5  # predicted 5x over
    pruned = Pruner(WORKLOAD, HARDWARE, budget).check(BIG, "deepspeed")
    assert pruned.status == "pruned" and pruned.backend == "deepspeed" and pruned.wall_time_s == 0
    assert pruned.extra["cause"] == "device_memory" and pruned.extra["predicted_peak_bytes"] == big.peak_bytes
    assert pruned.extra["predicted_memory"] == big.memory.to_dict()
    assert pruned.extra["fit_probability"] < MIN_FIT_PROBABILITY
    low, high = pruned.extra["predicted_peak_interval_bytes"]
    assert low < big.peak_bytes < high  # the 90% interval around the (uncalibrated) prediction
    assert pruned.extra["expected_gain_samples_per_s"] < 0.01 * big.throughput_samples_per_s
    assert "probability" in pruned.error and f"largest term: {big.memory.dominant}" in pruned.error


def test_a_config_predicted_just_over_with_a_wide_interval_stays_a_candidate():
    big = estimate(BIG, WORKLOAD, HARDWARE)
    pruner = Pruner(WORKLOAD, HARDWARE, int(big.peak_bytes / 1.09))  # predicted 9% over, nothing measured
    assert pruner.check(BIG, "deepspeed") is None
    assert MIN_FIT_PROBABILITY < pruner.fit_probability(BIG) < 0.5


def measured(config: Config, peak: int, step: float = 16.0) -> TrialResult:
    return TrialResult(config, "ok", throughput_samples_per_s=1.0, step_time_s=step, peak_memory_bytes=peak)


def test_measured_trials_narrow_the_interval_and_may_then_prune():
    cal = Calibration(memory_scale=1.1, samples=2)
    predicted = estimate(BIG, WORKLOAD, HARDWARE, cal).peak_bytes
    budget = int(predicted / 1.15)
    pruner = Pruner(WORKLOAD, HARDWARE, budget)
    wide = pruner.recalibrated(cal, [measured(SMALL, estimate(SMALL, WORKLOAD, HARDWARE, cal).peak_bytes)])
    assert wide.check(BIG, "simulated") is None  # micro-batch 8 and fp32 not measured: still wide
    # Configs sharing BIG's knob values measured as predicted: the interval narrows, 15% over is now too much.
    neighbours = [Config(0, 8, 0, "bf16"), Config(0, 4, 0, "fp32"), Config(1, 8, 0, "fp32"), Config(0, 2, 0, "fp32")]
    narrow = pruner.recalibrated(cal, [measured(c, estimate(c, WORKLOAD, HARDWARE, cal).peak_bytes)
                                       for c in [SMALL, *neighbours]])
    assert narrow.forecast(BIG).peak_log[1] < wide.forecast(BIG).peak_log[1] / 2
    assert narrow.check(BIG, "simulated").extra["fit_probability"] < MIN_FIT_PROBABILITY


def test_a_config_that_cannot_beat_the_best_even_optimistically_is_pruned_for_value():
    pruner = Pruner(WORKLOAD, HARDWARE, 100 * 2**30)
    forecast = pruner.forecast(SMALL)
    fast = forecast.throughput * math.exp(VALUE_Z * math.hypot(forecast.time_log[1], VALUE_SLACK))
    assert pruner.check(SMALL, "simulated", best_throughput=fast * 0.99) is None
    pruned = pruner.check(SMALL, "simulated", best_throughput=fast * 1.01)
    assert pruned.extra["cause"] == "value" and pruned.extra["best_throughput_samples_per_s"] == fast * 1.01
    assert abs(pruned.extra["optimistic_throughput_samples_per_s"] - fast) < 1e-9 * fast
    assert "below the best found" in pruned.error
    assert describe_causes(cause_counts([pruned]), "predicted over") == "1 predicted slower than the best found"


def test_an_out_of_memory_result_lowers_the_fit_probability_of_its_neighbours():
    failed = Config(2, 4, 0, "bf16")
    pruner = Pruner(WORKLOAD, HARDWARE, int(estimate(failed, WORKLOAD, HARDWARE).peak_bytes * 1.1))
    before = {c: pruner.fit_probability(c) for c in (Config(2, 8, 0, "bf16"), Config(2, 4, 0, "fp32"), SMALL)}
    taught = pruner.with_out_of_memory(failed)  # no peak: "over the budget", a censored observation
    assert taught.out_of_memory == {failed} and taught.uncertainty.memory.censored == 1
    after = {c: taught.fit_probability(c) for c in before}
    assert all(after[c] < before[c] for c in before)
    assert taught.fit_probability(failed) < 0.2 and after[SMALL] > 2 * after[Config(2, 8, 0, "bf16")]
    assert taught.check(SMALL, "simulated") is None  # another stage, smaller: still worth a try
    # A known peak is an exact observation.
    known = pruner.with_out_of_memory(failed, peak_bytes=pruner.budget_bytes * 3)
    assert known.uncertainty.memory.samples == 1 and known.uncertainty.memory.censored == 0
    assert known.fit_probability(Config(2, 8, 0, "bf16")) < after[Config(2, 8, 0, "bf16")]


class Cliff:
    """Runs out of memory from micro-batch 4 up, whatever the estimator thinks."""

    name = "simulated"

    def __init__(self):
        self.ran: list[Config] = []

    def run(self, config: Config) -> TrialResult:
        self.ran.append(config)
        if config.micro_batch >= 4:
            return TrialResult(config, "oom", peak_memory_bytes=3 * 2**30, backend=self.name, error="oom")
        return measured(config, 2**30)


def test_sweep_never_launches_what_an_earlier_out_of_memory_rules_out():
    # Not by a fixed rule any more: the out-of-memory results' peaks make the bigger configs unlikely to fit.
    space = Space(load_choices("cpu"), WORKLOAD, HARDWARE)
    budget = 2 * 2**30
    backend = Cliff()
    pruner = Pruner(WORKLOAD, HARDWARE, budget)
    record: list[TrialResult] = []
    sweep = Sweep(make_strategy("random", SearchContext(space, budget, 1)), pruner, record.append, "simulated",
                  space_size=len(space))
    run_local(sweep, backend, Budget(10**6), QuietProgress())
    ooms = [r.config for r in record if r.status == "oom"]
    assert ooms and len(backend.ran) < len(space)
    for config in backend.ran:  # nothing launched after a smaller config of its layout ran out of memory
        earlier = backend.ran[: backend.ran.index(config)]
        assert not any(o in earlier and o.micro_batch <= config.micro_batch and o.precision == config.precision
                       and (o.zero_stage, o.ckpt_interval, o.offload_optimizer, o.offload_param)
                       == (config.zero_stage, config.ckpt_interval, config.offload_optimizer, config.offload_param)
                       for o in ooms)
    pruned = [r for r in record if r.status == "pruned"]
    assert pruned and all(r.extra["fit_probability"] < MIN_FIT_PROBABILITY for r in pruned)
    # A resumed sweep remembers: the recorded out-of-memory results rebuild the same pruner.
    resumed = Sweep(make_strategy("random", SearchContext(space, budget, 1)), pruner, [].append, "simulated", record)
    assert resumed.pruner.out_of_memory == frozenset(ooms)
    assert resumed.pruner.uncertainty == sweep.pruner.uncertainty


def test_a_pruner_estimates_a_config_once_and_a_recalibrated_one_afresh(monkeypatch):
    import autotune.search.pruning as pruning

    made: list[Calibration] = []
    monkeypatch.setattr(pruning, "estimate", lambda *args: made.append(args[3]) or estimate(*args))
    pruner = Pruner(WORKLOAD, HARDWARE, 2**30)
    assert pruner.predict(BIG) is pruner.predict(BIG) and pruner.forecast(BIG) and len(made) == 1
    faster = pruner.recalibrated(Calibration(flops_scale=2.0), [])  # twice the FLOP/s: not the cached estimate
    assert faster.predict(BIG).step_time_s == estimate(BIG, WORKLOAD, HARDWARE, Calibration(flops_scale=2.0)).step_time_s
    assert made == [Calibration(), Calibration(flops_scale=2.0)]
    assert faster.predict(BIG).step_time_s < pruner.predict(BIG).step_time_s
