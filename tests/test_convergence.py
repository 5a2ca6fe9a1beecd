"""The convergence stop (issue 28, autotune/search/convergence.py): a sweep ends once the chance that an untried config
beats the best by more than the launch noise is small, not before its optimum where that hides behind pruned
configs, resumes with the same figures, and `--stop-when 0` turns it off; bad values are one line, exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import autotune
from autotune.api import DEFAULT_STRATEGY
from autotune.backends.replay import load_surface, replay_settings
from autotune.values.config import KNOBS, ConfigError
from autotune.search.convergence import (Convergence, Joint, StopRule, chance_of_better, describe_trace, expected_gains,
                                         margin_of)
from autotune.drivers.stop import StopReason
from cli_run import cli

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "benchmarks" / "surfaces" / "small-llama-cpu.jsonl"
TINY = ROOT / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
GiB = 2**30


def spec(surface: Path, budget: float, **kw) -> autotune.TuneSpec:
    settings, _ = replay_settings(surface, memory_budget=int(budget * GiB), strategy=DEFAULT_STRATEGY)
    return autotune.TuneSpec(settings.workload, settings.hardware, settings.memory_budget_bytes, backend="replay",
                             surface=str(surface), space=settings.choices, **kw)


def optimum(surface: Path, budget: float) -> float:
    best = load_surface(surface).best(int(budget * GiB))
    assert best is not None
    return best.throughput


def chances(result: autotune.TuneResult) -> list[float]:
    return [r.extra["chance_of_better"] for r in result.results if r.status != "pruned"]


def test_stops_early_where_little_is_left(tmp_path):
    result = autotune.tune(spec(SMALL, 1.19), tmp_path / "run")
    assert result.stop_reason == StopReason.CONVERGED
    assert 6 <= result.launched < 15  # the default budget is 30
    assert result.best is not None and result.best.throughput == optimum(SMALL, 1.19)
    assert chances(result)[-1] < 0.05 <= max(chances(result))
    assert re.fullmatch(r"search converged: (\d+|<1)% chance an untried config is >2% faster", result.stopped)
    data = result.to_dict()
    assert data["stop_reason"] == "converged" and data["chance_of_better"] == chances(result)[-1]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [c for _, c in summary["convergence"]["trace"]] == chances(result)
    last = [r for r in result.results if r.status != "pruned"][-1].extra
    assert summary["convergence"]["expected_gain"] == last["expected_gain"] >= 0
    assert summary["convergence"]["gain_per_trial_s"] == last["gain_per_trial_s"] >= 0
    assert "Chance of a better config" in (tmp_path / "run" / "report.md").read_text()


def test_does_not_stop_before_an_optimum_behind_pruned_configs(tmp_path):
    # tiny-cpu at 0.71 GiB: the optimum sits 0.9% under the budget, next to configs that run out of memory (or,
    # in other searches, are pruned), and the search reaches it after a few trials: the chance stays high until then.
    result = autotune.tune(spec(TINY, 0.71), tmp_path / "run")
    assert result.best is not None and result.best.throughput == optimum(TINY, 0.71)
    found = next(i for i, r in enumerate((r for r in result.results if r.status != "pruned"), 1)
                 if r.throughput_samples_per_s == optimum(TINY, 0.71))
    assert found > 1
    assert min(chances(result)[:found - 1]) >= 0.05
    assert sum(r.status in ("oom", "pruned") for r in result.results) > 0  # the cliff is part of the search


def test_resume_in_the_middle_gives_the_same_figures_and_stop(tmp_path):
    whole = autotune.tune(spec(SMALL, 1.19), tmp_path / "whole")
    assert whole.stop_reason == StopReason.CONVERGED
    cut = whole.launched - 2
    first = autotune.tune(spec(SMALL, 1.19, trials=cut), tmp_path / "resumed")
    assert first.stop_reason == StopReason.TRIALS and first.launched == cut
    resumed = autotune.tune(spec(SMALL, 1.19), tmp_path / "resumed", resume=True)
    assert resumed.stop_reason == StopReason.CONVERGED
    assert resumed.launched == whole.launched
    assert chances(resumed) == chances(whole)
    assert resumed.stopped == whole.stopped


def test_stop_when_zero_turns_it_off(tmp_path):
    result = autotune.tune(spec(SMALL, 1.19, stop_when=0), tmp_path / "run")
    assert result.stop_reason != StopReason.CONVERGED
    stopped = autotune.tune(spec(SMALL, 1.19), tmp_path / "stopped")
    assert result.launched > stopped.launched
    assert chances(result)[:stopped.launched] == chances(stopped)  # the figure is still computed and recorded


@pytest.mark.parametrize("value, fragment", [
    ("-0.1", "'-0.1' must be a probability from 0 to below 1"),
    ("1.5", "'1.5' must be a probability from 0 to below 1"),
    # 1 stopped every sweep at its 6th trial, saying "search converged: 99% chance an untried config is faster".
    ("1", "'1' must be a probability from 0 to below 1"),
    ("abc", "'abc' is not a number: allowed a probability from 0 to below 1"),
])
def test_bad_stop_when_is_one_line_exit_2(tmp_path, monkeypatch, capsys, value, fragment):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["tune", "--backend", "simulated", "--model", "tiny", "--trials", "2",
                        f"--stop-when={value}"], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("autotune tune: error: argument --stop-when: "), err
    assert fragment in err and "0 turns the convergence stop off" in err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("value", [-1, 1, 1.01, "0.05", True, float("nan")])
def test_bad_stop_when_in_the_library(value):
    with pytest.raises(ConfigError, match="stop_when .*: allowed a probability from 0 to below 1"):
        spec(SMALL, 1.19, stop_when=value)


def test_rule_needs_a_few_trials_and_a_threshold():
    low = Convergence(0.01, 0.02, 5)
    assert not StopRule(0.05, 6).met(low)
    assert StopRule(0.05, 6).met(Convergence(0.01, 0.02, 6))
    assert not StopRule(0.0, 6).met(Convergence(0.0, 0.02, 30))
    assert not StopRule(0.05, 6).met(None)
    assert margin_of(0.0) == 0.02 and round(margin_of(0.1), 3) == 0.1
    assert describe_trace([(1, 0.41), (5, 0.08), (9, 0.03)]) == "41% (#1) ... 8% (#5) ... 3% (#9)"


def test_the_rule_in_seconds_weighs_the_expected_gain_against_a_trials_seconds():
    """--train-for: stop once no untried config's expected gain x the training run's seconds pays for its trial."""
    figure = Convergence(0.5, 0.02, 6, 10, expected_gain=0.01, gain_per_trial_s=0.01 / 30)  # 1% for a 30 s trial
    assert StopRule(0.05, 6, train_s=2 * 3600).met(figure) is False  # 72 s saved > 30 s spent: go on
    assert StopRule(0.05, 6, train_s=1800).met(figure) is True  # 18 s saved < 30 s
    assert StopRule(0.0, 6, train_s=1800).met(figure) is True  # the chance's threshold off, the seconds' on
    assert not StopRule(0.05, 6, train_s=1800).met(Convergence(0.5, 0.02, 5, 10, 0.01, 0.01 / 30))  # too early
    assert not StopRule(0.05, 6).met(figure)  # off without a training length
    assert Convergence(0.5, 0.02, 6, 0, 0.0123456789, 4.2e-7).to_extra() == {
        "chance_of_better": 0.5, "better_margin": 0.02, "expected_gain": 0.0123457, "gain_per_trial_s": 4.2e-7}


def test_expected_gain_is_the_log_normal_partial_expectation():
    """Each row's expected saving of a run at the best's speed, P(fit) x E[(1 - e^-X)+] (X its log speed over the
    best's), against a Monte Carlo of the same model."""
    memory = Joint(np.zeros((3, 1)), np.zeros(1), np.eye(1) * 0.01, 0.05)
    time = Joint(np.eye(3), np.array([0.0, 0.05, -0.2]), np.eye(3) * 0.02, 0.03)
    room = np.array([0.2, -0.05, 0.0])
    below = np.array([0.0, 0.1, 0.0])  # log(best) - log(predicted speed)
    got = expected_gains(memory, room, time, below, best_sd=0.02)
    rng = np.random.default_rng(0)
    n = 400_000
    for i in range(3):
        m_mean, m_sd = memory.marginal()
        t_mean, t_sd = time.marginal()
        fits = (m_mean[i] + m_sd[i] * rng.standard_normal(n)) <= room[i]
        x = t_mean[i] - below[i] + np.sqrt(t_sd[i] ** 2 + 0.02 ** 2) * rng.standard_normal(n)
        want = float(np.mean(fits)) * float(np.mean(np.maximum(1 - np.exp(-x), 0.0)))  # the share of the run saved
        assert got[i] == pytest.approx(want, rel=0.03, abs=1e-5)
    assert got[2] < got[0]  # slower by its prediction: less to expect


def test_train_for_stops_a_short_training_runs_search_sooner_and_records_its_figures(tmp_path):
    """A training run of a minute is not worth many trials; one of ten hours is (the committed tiny-cpu surface,
    its recorded trial seconds); every search trial records the figures the rule read, and a resume reads them."""
    short = autotune.tune(spec(TINY, 24.0, stop_when=0, train_for_s=60), tmp_path / "short")
    long = autotune.tune(spec(TINY, 24.0, stop_when=0, train_for_s=36000), tmp_path / "long")
    assert short.stop_reason == long.stop_reason == StopReason.NOT_WORTH
    assert short.stopped.startswith(StopReason.NOT_WORTH.text + " (the most any is expected to save: ")
    assert short.stopped.endswith("of the run, less than its own trial would cost)")  # why it did not pay
    assert 6 <= short.launched < long.launched < 30
    ran = [r for r in long.results if r.status != "pruned"]
    assert all(r.extra["gain_per_trial_s"] >= 0 and r.extra["expected_gain"] >= 0 for r in ran)
    last = ran[-1].extra
    assert last["gain_per_trial_s"] * 36000 < 1 <= min(r.extra["gain_per_trial_s"] for r in ran[5:-1]) * 36000
    cut = autotune.tune(spec(TINY, 24.0, stop_when=0, train_for_s=36000, trials=long.launched - 1), tmp_path / "cut")
    resumed = autotune.tune(spec(TINY, 24.0, stop_when=0, train_for_s=36000), tmp_path / "cut", resume=True)
    assert cut.stop_reason == StopReason.TRIALS and resumed.launched == long.launched


def test_bad_train_for_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["tune", "--backend", "simulated", "--model", "tiny", "--trials", "2", "--train-for", "soon"],
                       capsys)
    assert code == 2 and err.count("\n") == 1 and "--train-for" in err and "soon" in err, err
    with pytest.raises(ConfigError, match="train for -5.0: must be a positive number of seconds"):
        spec(SMALL, 1.19, train_for_s=-5.0)
    from autotune.commands.sweep_file import load_sweep

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("workloads:\n  - {name: a, model: tiny, train_for: 2h}\n")
    assert [w.tune.train_for_s for w in load_sweep(sweep).workloads] == [7200.0]


def test_the_cli_says_why_a_search_was_not_worth_another_trial(tmp_path, capsys):
    code, out, _ = cli(["tune", "--backend", "replay", "--surface", str(TINY), "--memory-budget", "24GiB",
                        "--stop-when", "0", "--train-for", "1m", "--out", str(tmp_path / "run"), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["stop_reason"] == "not worth a trial" and doc["budget"]["train_s"] == 60.0
    assert doc["launched"] < 30 and "more time than its trial costs" in doc["stopped"]

def test_correlated_configs_are_not_independent_chances():
    # 50 configs sharing one unknown offset (sd 0.2), each needing +0.3 to beat the best: one chance of
    # P(z > 1.5) = 6.7%, not 1 - (1 - 0.067)^50 = 97%.
    n = 50
    rows = np.ones((n, 1))
    time = Joint(rows, np.zeros(1), np.array([[0.04]]), 0.0)
    memory = Joint(rows, np.zeros(1), np.array([[1e-6]]), 0.0)
    p = chance_of_better(memory, np.full(n, 1.0), time, np.full(n, 0.3))
    assert 0.04 < p < 0.10


def test_the_environment_exposes_the_chance_in_info():
    from autotune.envs import DeepSpeedMemoryEnv

    for flat in (False, True):
        env = DeepSpeedMemoryEnv({"backend": "replay", "surface": str(SMALL), "memory_budget": int(1.19 * GiB),
                                  "horizon": 6, "flat_info": flat})
        obs, info = env.reset(seed=0)
        assert info["chance_of_better"] == 1.0  # nothing measured yet
        seen = []
        for _ in range(5):
            action = int(np.flatnonzero(obs["action_mask"][:-1])[0])
            obs, _, terminated, truncated, info = env.step(action)
            seen.append(info["chance_of_better"])
            if terminated or truncated:
                break
        assert all(0.0 <= p <= 1.0 for p in seen)
    # Training never reads it: its environments leave it out (autotune.rl.train; ~16 ms a step).
    quiet = DeepSpeedMemoryEnv({"backend": "replay", "surface": str(SMALL), "memory_budget": int(1.19 * GiB),
                                "horizon": 6, "flat_info": True, "chance_info": False})
    obs, info = quiet.reset(seed=0)
    assert "chance_of_better" not in info
    assert "chance_of_better" not in quiet.step(int(np.flatnonzero(obs["action_mask"][:-1])[0]))[4]


def _model(offsets: dict, noise: float, trials: int = 24, surface: Path = SMALL):
    """A time error model fitted on `trials` configs of `surface`'s space whose log-ratios are `offsets` by
    knob value plus launch noise `noise` (seeded)."""
    from autotune.backends.replay import surface_space
    from autotune.prediction.uncertainty import NOISE_TIME, PRIOR_TIME, fit_error_model

    rng = np.random.default_rng(0)
    configs = list(surface_space(load_surface(surface)))[:trials]
    observed = [(c, sum(offsets.get((k, getattr(c, k)), 0.0) for k in ("zero_stage", "micro_batch"))
                 + noise * rng.standard_normal()) for c in configs]
    return fit_error_model(observed, PRIOR_TIME, NOISE_TIME)


def test_per_config_spread_is_not_held_at_the_forecasts_floor():
    from autotune.search.convergence import RESIDUAL_PRIOR, per_config
    from autotune.prediction.uncertainty import NOISE_TIME, PRIOR_TIME, fit_error_model

    quiet = _model({}, 0.03)
    assert quiet.noise == NOISE_TIME[2]  # forecasts keep the floor
    # The figure: residuals no larger than the launch noise leave only the prior's weight, shrinking with trials.
    assert per_config(quiet, 0.03) < 0.05
    assert per_config(_model({}, 0.03, trials=8), 0.03) > per_config(quiet, 0.03)
    assert per_config(_model({}, 0.3), 0.0) > 0.2  # a noisy world as it is, where the launches do not explain it
    assert per_config(_model({}, 0.3), 0.3) < 0.1  # ... and launch noise of that size does
    empty = fit_error_model([], PRIOR_TIME, NOISE_TIME)
    assert per_config(empty) == pytest.approx(RESIDUAL_PRIOR)  # no trials: the prior's per-config spread


def test_untried_values_narrow_only_where_the_trials_show_small_offsets():
    from autotune.search.convergence import evidenced
    from autotune.prediction.uncertainty import NOISE_TIME, PRIOR_TIME, fit_error_model

    empty = fit_error_model([], PRIOR_TIME, NOISE_TIME)
    assert evidenced(empty) == empty  # no evidence: the prior
    right = evidenced(_model({}, 0.03))  # the estimator's shape is right: its offsets are small
    assert dict(right.value_prior)["precision"] < 0.75 * dict(PRIOR_TIME[1])["precision"]
    values = sorted({getattr(c, "zero_stage") for c in load_surface(SMALL).results})
    wrong = evidenced(_model({("zero_stage", v): 0.4 * (-1) ** i for i, v in enumerate(values)}, 0.03))
    assert dict(wrong.value_prior)["precision"] > dict(right.value_prior)["precision"]


def test_each_knob_keeps_its_own_width_where_its_values_differ_and_the_others_narrow():
    """The evidenced model's per-knob stage: offsets of 0.4 on ZeRO stages widen that knob's untried values past
    the common scale while micro-batch, whose measured values agree, narrows below it."""
    from autotune.search.convergence import evidenced
    from autotune.prediction.uncertainty import PRIOR_TIME

    values = sorted({getattr(c, "zero_stage") for c in load_surface(SMALL).results})
    wrong = _model({("zero_stage", v): 0.4 * (-1) ** i for i, v in enumerate(values)}, 0.03)
    widths, base = dict(evidenced(wrong).value_prior), dict(PRIOR_TIME[1])
    common = wrong.evidence_scale
    assert widths["zero_stage"] / base["zero_stage"] > 1.2 * common
    assert widths["micro_batch"] / base["micro_batch"] < 0.9 * common

def test_known_widths_are_held_and_a_known_per_config_spread_is_used():
    """The hooks benchmarks/stop_bounds.py gives a figure the world's own spreads through: prior widths held as
    given (no empirical Bayes) and the per-config spread as given, each moving the figure the way it should."""
    from autotune.backends.replay import surface_space
    from autotune.prediction.uncertainty import (NOISE_MEMORY, NOISE_TIME, PRIOR_MEMORY, PRIOR_TIME, Uncertainty,
                                                 fit_error_model)
    from autotune.search.convergence import assess, evidenced

    fitted = _model({}, 0.03)
    observed = [(c, 0.0) for c in list(surface_space(load_surface(SMALL)))[:24]]
    held = fit_error_model(observed, PRIOR_TIME, NOISE_TIME, evidence_weight=None)
    assert evidenced(held).value_prior == PRIOR_TIME[1] and evidenced(held).evidence_scale == 1.0
    assert dict(evidenced(fitted).value_prior)["precision"] < dict(PRIOR_TIME[1])["precision"]  # EB narrows it
    narrow = fit_error_model(observed, (PRIOR_TIME[0], tuple((k, 0.02) for k, _ in PRIOR_TIME[1])), NOISE_TIME,
                             evidence_weight=None)
    space = list(surface_space(load_surface(SMALL)))
    untried = space[24:]
    memory = fit_error_model([], PRIOR_MEMORY, NOISE_MEMORY)

    def chance(time_model, residual):
        forecast = Uncertainty(memory, time_model).forecast
        return assess(untried, lambda c: forecast(c, 1, 100.0), Uncertainty(memory, time_model), 10, 100.0, 0.03,
                      24, residual=residual).chance

    assert chance(held, 0.0) > chance(narrow, 0.0)  # wider held widths: likelier that an untried one is faster
    assert chance(narrow, 0.2) > chance(narrow, 0.0)  # a larger per-config spread: likelier too


def test_the_process_is_the_knob_value_model_conditioned_at_its_own_noise_where_pairs_share_nothing():
    """At pair share 0 the figure's process is the knob-value model with the trials conditioned at hypot(a config's
    own residual, one launch's spread), where the fit estimated one noise for both, and each untried config's
    residual its own: the same means and covariances as that model's weight-space posterior."""
    import math

    from autotune.backends.replay import surface_space
    from autotune.prediction.uncertainty import _features, _posterior, columns_of
    from autotune.search.convergence import Process, evidenced, per_config

    space = list(surface_space(load_surface(TINY)))
    model = evidenced(_model({}, 0.01, trials=10, surface=TINY))
    residual = per_config(model, 0.01)
    assert math.hypot(residual, 0.01) < 0.7 * model.noise  # the prior's 0.15 still weighs in the fit's own noise
    untried = space[10:]
    process = Process.conditioned(model, untried, residual, 0.01, pair_share=0.0)
    columns = columns_of(space)
    widths = dict(model.value_prior)
    prior = np.diag([model.common_prior ** 2] + [widths[k] ** 2 for k, _ in columns])
    xs = np.array([_features(columns, c) for c, _ in model.observed])
    mean, cov = _posterior(prior, xs, np.array([y for _, y in model.observed]), math.hypot(residual, 0.01))
    rows = np.array([_features(columns, c) for c in untried])
    assert process.mean == pytest.approx(rows @ mean, abs=1e-9)
    keep = np.arange(0, len(untried), 7)
    drawn = np.cov(process.draws(keep, 20000, np.random.default_rng(0)))
    exact = rows[keep] @ cov @ rows[keep].T + residual ** 2 * np.eye(len(keep))
    assert drawn == pytest.approx(exact, abs=0.1 * exact.max())
    assert process.sd == pytest.approx(np.sqrt(np.einsum("ij,jk,ik->i", rows, cov, rows) + residual ** 2))


def test_pairs_of_knob_values_make_near_twins_move_together_and_lower_the_figure():
    """With a share of the residual on pairs of knob values, an untried config that shares most pairs with a
    trial measured above the knob values' fit follows it, two near-twins covary more than configs with little in
    common, the marginal spread stays the prior's before any trial, and hundreds of near-twins of the tried
    configs are fewer independent chances to beat the best: the figure is lower."""
    from autotune.backends.replay import surface_space
    from autotune.prediction.uncertainty import NOISE_MEMORY, NOISE_TIME, PRIOR_MEMORY, PRIOR_TIME, Uncertainty
    from autotune.prediction.uncertainty import fit_error_model
    from autotune.search.convergence import Process, assess, evidenced

    space = list(surface_space(load_surface(TINY)))
    lucky = space[0]
    twin = next(c for c in space[1:] if sum(getattr(c, k) != getattr(lucky, k) for k in KNOBS) == 1)
    observed = [(c, 0.0) for c in space[1:40] if c != twin] + [(lucky, 0.3)]
    model = evidenced(fit_error_model(observed, PRIOR_TIME, NOISE_TIME))
    far = next(c for c in space[100:] if all(getattr(c, k) != getattr(lucky, k) for k in ("micro_batch", "precision")))
    alone, paired = (Process.conditioned(model, [twin, far], 0.2, 0.01, pair_share=s) for s in (0.0, 0.5))
    # The twin follows the lucky trial through their shared pairs, the far config hardly.
    assert paired.mean[0] - alone.mean[0] > max(0.01, 3 * abs(paired.mean[1] - alone.mean[1]))
    prior_only = Process.conditioned(fit_error_model([], PRIOR_TIME, NOISE_TIME), [twin, far], 0.1, 0.01, 0.5)
    assert prior_only.sd == pytest.approx(Process.conditioned(fit_error_model([], PRIOR_TIME, NOISE_TIME),
                                                              [twin, far], 0.1, 0.01, 0.0).sd)
    # Before the trials: near-twins covary more with pairs, configs with little in common no more; a config's own
    # variance is the same.
    codes = Process.conditioned(model, [lucky, twin, far], 0.2, 0.01).configs
    with_pairs, without = paired.kernel(codes, codes), alone.kernel(codes, codes)
    assert with_pairs[0, 1] > without[0, 1] + 0.01 and with_pairs[0, 2] < with_pairs[0, 1] - 0.01
    assert np.diag(with_pairs) == pytest.approx(np.diag(without))

    errors = Uncertainty(fit_error_model([], PRIOR_MEMORY, NOISE_MEMORY), fit_error_model(observed, PRIOR_TIME,
                                                                                              NOISE_TIME))
    untried = [c for c in space if c not in dict(observed)]

    def chance(share: float) -> float:
        return assess(untried, lambda c: errors.forecast(c, 1, 100.0), errors, 10, 125.0, 0.01, 40,
                      residual=0.1, pair_share=share).chance

    assert chance(0.5) < chance(0.0)
    censored = fit_error_model([(space[0], 0.0)], PRIOR_MEMORY, NOISE_MEMORY, [(space[1], 0.1)])
    with pytest.raises(ValueError, match="out-of-memory bounds"):
        Process.conditioned(censored, space[2:], 0.1, 0.01)
