"""Predictions with an uncertainty (autotune.prediction.uncertainty), the guided search's most valuable picks
(strategies/guide.py), and a replayed sweep on the committed CPU surface that never prunes its optimum."""

from __future__ import annotations

import json
import re
import math
from pathlib import Path

import pytest
from cli_run import cli

from autotune.backends.replay import ReplayBackend, load_surface, surface_space
from autotune.values.config import Config
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.strategies import guide
from autotune.prediction.uncertainty import NOISE_MEMORY, PRIOR_MEMORY, Forecast, fit_error_model

SURFACE = Path(__file__).resolve().parent.parent / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
CK2 = [Config(0, 2, 2, "bf16"), Config(1, 4, 2, "bf16"), Config(2, 2, 2, "fp32"), Config(0, 4, 2, "fp32")]
CK0 = Config(0, 2, 0, "bf16")


def test_a_knob_value_no_trial_used_keeps_a_wide_interval_until_one_does():
    over = [(c, 0.0) for c in CK2]  # the calibrated estimator exact on four checkpointing-on configs
    model = fit_error_model(over, PRIOR_MEMORY, NOISE_MEMORY)
    covered, uncovered = model.predict(Config(0, 4, 2, "bf16")), model.predict(CK0)
    assert model.uncovered(CK0) == ("ckpt_interval=0",) and model.uncovered(Config(0, 4, 2, "bf16")) == ()
    assert uncovered[1] > 2 * covered[1]  # checkpointing off: still the prior's width
    assert uncovered[1] >= dict(PRIOR_MEMORY[1])["ckpt_interval"]
    # One checkpointing-off trial, 20% below the prediction: the interval narrows and moves.
    taught = fit_error_model(over + [(Config(1, 2, 0, "bf16"), math.log(0.8))], PRIOR_MEMORY, NOISE_MEMORY)
    mean, sigma = taught.predict(CK0)
    assert sigma < uncovered[1] / 2 and mean < math.log(0.9)


def test_a_censored_observation_raises_the_offsets_of_its_knob_values():
    base = fit_error_model([(c, 0.0) for c in CK2], PRIOR_MEMORY, NOISE_MEMORY)
    bound = 0.1  # ran out of memory: the peak is more than 10% above the prediction
    censored = fit_error_model([(c, 0.0) for c in CK2], PRIOR_MEMORY, NOISE_MEMORY, [(CK0, bound)])
    assert censored.predict(CK0)[0] > base.predict(CK0)[0] + 0.05
    assert censored.predict(CK0)[1] < base.predict(CK0)[1]
    # Other configs sharing none of its uncovered values hardly move.
    assert abs(censored.predict(CK2[1])[0] - base.predict(CK2[1])[0]) < 0.02


def test_forecast_probability_interval_and_expected_gain():
    f = Forecast(1000, 10.0, (0.0, 0.1), (0.0, 0.2))
    assert f.fit_probability(1000) == pytest.approx(0.5)
    assert f.fit_probability(int(1000 * math.exp(0.1645))) == pytest.approx(0.95, abs=1e-3)
    low, high = f.peak_interval()
    assert low == pytest.approx(1000 * math.exp(-0.1645), rel=1e-3) and high == pytest.approx(1000 * math.exp(0.1645),
                                                                                               rel=1e-3)
    assert f.expected_gain(0.0) == pytest.approx(10 * math.exp(0.02))
    assert 0 < f.expected_gain(12.0) < f.expected_gain(10.0) < f.expected_gain(8.0)
    assert f.value(1000, 10.0) == pytest.approx(0.5 * f.expected_gain(10.0))


@pytest.fixture(scope="module")
def surface():
    return load_surface(SURFACE)


def test_guided_search_runs_the_most_valuable_config_per_second_each_time(surface):
    """On the real CPU surface: each proposal after the first is the untried config of the highest probability x
    expected gain per second of its trial by the forecast of the trials before it (or, once none is worth a trial,
    the likeliest to fit), and the search reaches the surface's fastest config."""
    space = surface_space(surface)
    budget = space.hardware.memory_bytes
    sweep = Sweep.in_memory(space, budget, "optuna", "replay", seed=0)
    backend = ReplayBackend(surface, budget)
    proposers = []
    for _ in range(8):
        tried = {r.config for r in sweep.results}
        best = max((r.throughput for r in sweep.results if r.fits(budget)), default=0.0)
        expected = guide.most_valuable(sweep.strategy.context, tried, best)
        config = sweep.next_config()
        sweep.finish(config, backend.run(config))
        proposers.append(sweep.strategy.study.trials[-1].user_attrs.get("proposed_by"))
        if proposers[-1] in ("warm start", "expected gain"):
            assert config == expected
    assert proposers[0] == "warm start" and proposers.count("expected gain") >= 5
    fastest = max(r.throughput for r in surface.results.values() if r.ok and r.fits(budget))
    assert max(r.throughput for r in sweep.results if r.fits(budget)) >= 0.98 * fastest
    for r in sweep.results:  # every pruned record says what it was judged by
        if r.status == "pruned":
            assert 0 <= r.extra["fit_probability"] <= 1 and r.extra["cause"] in ("device_memory", "value")
            assert r.extra["cause"] != "device_memory" or r.extra["fit_probability"] < 0.05


@pytest.mark.parametrize("name", ["optuna", "hybrid"])
@pytest.mark.parametrize("where", ["machine", "median peak"])
def test_replay_reaches_the_optimum_of_the_committed_surface_and_never_prunes_it(surface, name, where):
    space = surface_space(surface)
    peaks = sorted(r.peak_memory_bytes for r in surface.results.values() if r.ok and r.peak_memory_bytes)
    # The machine's memory, or the median peak: half the configs run out of memory, and the optimum's peak
    # lies within 1% of the budget (less than a peak's spread between two runs: README of the surfaces).
    budget = space.hardware.memory_bytes if where == "machine" else peaks[len(peaks) // 2]
    best = surface.best(budget)
    sweep = Sweep.in_memory(space, budget, name, "replay", seed=0)
    # The search's own record over 25 trials, as benchmarks/search_efficiency.py judges it: the convergence stop
    # off, so that its share of out-of-memory trials is not over a sweep the stop cut short.
    run_local(sweep, ReplayBackend(surface, budget), Budget(25, stop_when=0), QuietProgress())
    assert sweep.best is not None
    if where == "machine":
        assert sweep.best.config == best.config
    else:
        assert sweep.best.throughput_samples_per_s >= 0.95 * best.throughput_samples_per_s
    assert not any(r.config == best.config and r.status == "pruned" for r in sweep.results)
    launched = [r for r in sweep.results if r.status != "pruned"]
    # The most valuable picks gamble near the cliff where the fast configs are: at the median peak 4 of 25 ran out
    # of memory (2 before the optimum, which it found at trial 5).
    assert sum(r.status == "oom" for r in launched) <= len(launched) // 5
    for r in sweep.results:  # every pruned record says what it was judged by
        if r.status == "pruned":
            assert 0 <= r.extra["fit_probability"] <= 1 and r.extra["cause"] in ("device_memory", "value")
            assert r.extra["cause"] != "device_memory" or r.extra["fit_probability"] < 0.05


def test_estimate_with_a_runs_calibration_shows_each_peaks_interval_and_probability(tmp_path, capfd, monkeypatch):
    run = tmp_path / "r"
    args = ["--model", "tiny", "--hardware", "cpu"]
    assert cli(["tune", *args, "--backend", "simulated", "--memory-budget", "0.7GiB", "--strategy", "optuna",
                "--trials", "6", "--seed", "1", "--out", str(run)], capfd)[0] == 0
    code, out, _ = cli(["estimate", *args, "--gpu-memory", "0.7GiB", "--calibration", str(run), "--json"], capfd)
    assert code == 0
    rows = json.loads(out)["fit"]
    assert rows and all(0.0 <= r["fit_probability"] <= 1.0 for r in rows)
    assert all(lo < r["memory"]["total"] * 1.5 and lo < hi for r in rows for lo, hi in [r["peak_interval_bytes"]])
    code, out, _ = cli(["estimate", *args, "--gpu-memory", "0.7GiB", "--calibration", str(run)], capfd)
    assert code == 0 and "90%" in out and "fits" in out  # the interval and probability columns
    # At 80 columns each config is one line, its knobs as its label, its interval in one unit (0.55-0.82 GiB):
    # the knobs' seven columns folded each row over four lines ("sampl / es/s", "677 / MiB- / 1.06 / GiB").
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = cli(["estimate", *args, "--gpu-memory", "0.7GiB", "--calibration", str(run), "--top", "3"], capfd)
    rows = [line for line in out.splitlines() if line.lstrip()[:1] in ("1", "2", "3") and "│" in line]
    assert code == 0 and len(rows) == 3 and all(len(line) <= 80 for line in out.splitlines() if "│" in line or "┃" in line)
    assert all(re.search(r"│ z\d mb\d+ ck\d+ \w+.*│ [\d.]+-[\d.]+ [KMG]iB │", line) for line in rows), rows
    # A calibration fitted for another workload is refused: one line, exit 2.
    code, _, err = cli(["estimate", "--model", "gpt2-small", "--hardware", "cpu", "--calibration", str(run)], capfd)
    assert code == 2 and "another workload" in err
