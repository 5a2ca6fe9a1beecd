"""The simulated backend: the estimator's prediction as a trial, the OOM cliff, seeded noise."""

import statistics
from dataclasses import replace

import pytest

from autotune.backends import Backend
from autotune.backends.simulated import SimulatedBackend
from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import Calibration, estimate
from autotune.values.hardware import PROFILES
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.values.workload import make_workload

GiB = 2**30
TINY = make_workload("tiny")
CPU = PROFILES["cpu"]
Z2 = Config(2, 4, 1, "bf16")


def test_ok_result_is_the_estimate():
    backend = SimulatedBackend(TINY, CPU, 24 * GiB)
    assert isinstance(backend, Backend) and backend.name == "simulated"
    result = backend.run(Z2)
    est = estimate(Z2, TINY, CPU)
    assert result.status == "ok" and result.backend == "simulated"
    assert result.step_time_s == pytest.approx(est.step_time_s)
    assert result.throughput_samples_per_s == pytest.approx(est.throughput_samples_per_s)
    assert result.tokens_per_s == pytest.approx(est.tokens_per_s)
    assert result.peak_memory_bytes == est.peak_bytes
    assert result.memory_budget_bytes == 24 * GiB
    assert result.wall_time_s == pytest.approx(15.0 + 10 * est.step_time_s)


def test_oom_cliff_at_the_predicted_peak():
    peak = estimate(Z2, TINY, CPU).peak_bytes
    assert SimulatedBackend(TINY, CPU, peak).run(Z2).status == "ok"
    over = SimulatedBackend(TINY, CPU, peak - 1).run(Z2)
    assert over.status == "oom" and over.throughput_samples_per_s is None
    assert over.peak_memory_bytes == peak  # the need, so a reward can grow with the overshoot
    assert "exceeds the budget" in over.error


def test_calibration_changes_the_prediction():
    plain = SimulatedBackend(TINY, CPU, 24 * GiB).run(Z2)
    slow = SimulatedBackend(TINY, CPU, 24 * GiB, calibration=Calibration(flops_scale=0.5)).run(Z2)
    assert slow.throughput_samples_per_s < plain.throughput_samples_per_s


def test_unsupported_precisions_and_invalid_configs_are_results():
    fp16 = SimulatedBackend(TINY, CPU, 24 * GiB).run(Config(0, 1, 0, "fp16"))
    assert fp16.status == "unsupported" and "fp16" in fp16.error
    v100 = SimulatedBackend(make_workload("gpt2-small"), PROFILES["v100-32gb"], 32 * GiB)
    assert v100.run(Config(0, 1, 0, "bf16")).status == "unsupported"
    batch = SimulatedBackend(TINY, CPU, 24 * GiB).run(Config(0, 3, 0, "bf16"))
    assert batch.status == "unsupported" and "micro_batch 3" in batch.error
    with pytest.raises(ConfigError, match="micro_batch 3"):
        SimulatedBackend(TINY, CPU, 24 * GiB).estimate(Config(0, 3, 0, "bf16"))


def test_offload_beyond_host_memory_is_an_oom():
    workload = make_workload("llama-7b", global_batch=8, gpus=8)
    roomy = PROFILES["a100-80gb"]
    config = Config(3, 1, 1, "bf16", "cpu", "cpu")
    assert SimulatedBackend(workload, roomy, 80 * GiB).run(config).status == "ok"
    small_host = replace(roomy, host_memory_bytes=8 * GiB)
    result = SimulatedBackend(workload, small_host, 80 * GiB).run(config)
    assert result.status == "oom" and "host memory" in result.error


def test_noise_is_seeded_multiplicative_and_centred():
    def draws(seed):
        backend = SimulatedBackend(TINY, CPU, 24 * GiB, noise=0.2, seed=seed)
        return [backend.run(Z2).step_time_s for _ in range(400)]

    exact = estimate(Z2, TINY, CPU).step_time_s
    first, again, other = draws(1), draws(1), draws(2)
    assert first == again and first != other
    assert statistics.median(first) == pytest.approx(exact, rel=0.05)  # lognormal: median 1
    ratios = sorted(t / exact for t in first)
    assert ratios[20] < 0.8 and ratios[-20] > 1.25  # ~ exp(+-1.64 * 0.2)


def test_no_noise_is_deterministic_and_noise_must_be_non_negative():
    backend = SimulatedBackend(TINY, CPU, 24 * GiB)
    assert backend.run(Z2) == backend.run(Z2)
    with pytest.raises(ConfigError, match="noise"):
        SimulatedBackend(TINY, CPU, 24 * GiB, noise=-0.1)
    with pytest.raises(ConfigError, match="budget"):
        SimulatedBackend(TINY, CPU, 0)


def test_with_budget_shares_predictions_not_verdicts():
    peak = estimate(Z2, TINY, CPU).peak_bytes
    roomy = SimulatedBackend(TINY, CPU, 24 * GiB)
    tight = roomy.with_budget(peak // 2)
    assert roomy.run(Z2).status == "ok" and tight.run(Z2).status == "oom"
    assert roomy.run(Z2).status == "ok"
    assert tight.memory_budget_bytes == peak // 2 and roomy.memory_budget_bytes == 24 * GiB


def test_every_config_of_the_cpu_space_runs_fast_and_matches_feasibility():
    space = Space(load_choices("cpu"), TINY, CPU)
    budget = 1 * GiB
    backend = SimulatedBackend(TINY, CPU, budget)
    for config in space:
        result = backend.run(config)
        fits = estimate(config, TINY, CPU).peak_bytes <= budget
        assert result.status == ("ok" if fits else "oom"), config
