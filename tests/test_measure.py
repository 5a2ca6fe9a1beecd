"""When a measurement stops (autotune.worker.measure): a config far behind (`slow`) is cut early on what its steps
show, never on one step's noise."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune.worker.measure import SLOW, SLOW_FACTOR, MeasureSettings, far_behind, stop_reason

EXPECTED = 0.008  # the review's sweep: a step of this config expected to take 8 ms
SETTINGS = MeasureSettings(min_steps=3, max_steps=20, expected_step_s=EXPECTED)


def test_one_noisy_step_does_not_end_a_trial_as_slow():
    """The review's trial: its first measured step 48 ms against 8 ms expected (6x, noise: other configs' first
    measured steps were 4-5x their medians) ended it `slow`, that one step recorded as its throughput."""
    assert stop_reason([0.048], 0.048, SETTINGS) != SLOW
    assert stop_reason([0.048, 0.008], 0.056, SETTINGS) != SLOW
    assert stop_reason([0.048, 0.008, 0.0085], 0.065, SETTINGS) != SLOW


@pytest.mark.parametrize("n", range(1, 8))
@pytest.mark.parametrize("factor", [6, 10, 51, 1000])
def test_a_single_outlier_never_ends_a_trial_wherever_it_falls(n, factor):
    """One step `factor` times the expected among steps within the limit (even right at it), first or anywhere."""
    within = SLOW_FACTOR * EXPECTED
    for at in range(n):
        times = [within] * n
        times[at] = factor * EXPECTED
        assert not far_behind(times, SETTINGS), (times, at)
        assert stop_reason(times, sum(times), SETTINGS) != SLOW


def test_a_config_truly_far_behind_is_still_cut_early():
    """Every step many times the expected one (emulated bf16: ~30x): cut after two measured steps, fewer than its
    minimum of steps for `stable` or `behind`; a noisier one once most of its steps are past the limit."""
    assert stop_reason([0.24, 0.25], 0.49, SETTINGS) == SLOW
    assert stop_reason([0.045, 0.2], 0.25, SETTINGS) == SLOW  # 5.6x and 25x: both past 40 ms
    assert stop_reason([0.045, 0.03], 0.075, SETTINGS) is None  # one within the limit
    assert stop_reason([0.045, 0.03, 0.05], 0.125, SETTINGS) == SLOW  # two of three past: the median is
    assert stop_reason([0.045, 0.03, 0.05, 0.02], 0.145, SETTINGS) is None  # two of four: the median is not
    assert stop_reason([0.045, 0.03, 0.05, 0.02, 0.06], 0.205, SETTINGS) == SLOW


def test_the_slow_rule_is_off_where_nothing_is_expected_or_it_is_turned_off():
    assert not far_behind([1.0, 1.0], MeasureSettings(min_steps=3))
    assert not far_behind([1.0, 1.0], replace(SETTINGS, slow_factor=None))
    assert stop_reason([1.0] * 2, 2.0, replace(MeasureSettings.fixed(1, 5), expected_step_s=EXPECTED)) is None
