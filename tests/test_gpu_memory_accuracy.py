"""The estimator against the committed H200 trials (benchmarks/gpu-runs/h200-2026-11-26, issue 25): the peak
predicted as the GPU holds it (allocator reserve + memory outside it), raw and calibrated on each sweep's
first trial."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_memory_accuracy", ROOT / "benchmarks" / "gpu_memory_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def trials(bench):
    return bench.load_trials()


def test_the_seven_ok_trials_are_rebuilt_as_planned(trials):
    assert len(trials) == 7
    assert {t.sweep for t in trials} == {"kit/llama-1b", "kit/llama-3b", "tune"}
    for t in trials:
        assert t.hardware.name == "h200" and not t.hardware.is_cpu
        assert t.reserved + t.outside == t.result.peak_bytes  # the product's peak, as the worker measures it


def test_raw_peaks_within_the_issue_goals(trials):
    errors = [abs(t.predict().peak_bytes / t.result.peak_bytes - 1) for t in trials]
    assert statistics.median(errors) <= 0.08
    assert max(errors) <= 0.15
    before = [abs(t.before_bytes / t.result.peak_bytes - 1) for t in trials]
    assert max(errors) < min(max(before), 0.15) and statistics.median(before) > 0.2  # what it was: 7-40% low


def test_calibrated_on_each_sweeps_first_trial_within_5_percent(bench, trials):
    calibrated = bench.calibrated_on_first(trials)
    assert len(calibrated) == 4  # llama-3b: 2 after its first, tune: 2; llama-1b has one ok trial
    peaks = {t.name: t.result.peak_bytes for t in trials}
    assert all(abs(pred / peaks[name] - 1) <= 0.05 for name, pred in calibrated.items())


def test_each_part_near_its_measurement(trials):
    """The terms are named and each follows its own measurement, not one sum: outside the allocator within
    0.1 GiB, the reserve within a factor of 2.1 (it is the hardest term: 0.55 to 15.9 GiB measured)."""
    for t in trials:
        mem = t.predict().memory
        assert abs(mem.outside_allocator - t.outside) <= 0.1 * 2**30
        reserve = t.reserved - t.allocated
        assert 1 / 2.1 <= mem.allocator_reserve / reserve <= 2.1
        assert mem.overhead == 0


def test_the_report_is_written(bench, trials, tmp_path):
    out = tmp_path / "gpu_memory_accuracy.md"
    assert bench.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert "| after, raw |" in text and "calibrated on each sweep's first trial" in text
