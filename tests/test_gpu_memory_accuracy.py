"""The estimator against the committed H200 trials of both runs (benchmarks/gpu-runs/h200-2026-11-26 and -27, issues
25 and 40): the peak predicted as the GPU holds it (allocator reserve + memory outside it), raw, on the valid trials
only (the fp16 ones never trained), and on those no CUDA term was fitted on."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

from autotune.prediction.estimate import norm_upcast_bytes

ROOT = Path(__file__).resolve().parents[1]
VALID = {
    "h200-2026-11-26/kit/llama-1b/0001-z0_mb16_ck0_bf16", "h200-2026-11-26/kit/llama-3b/0001-z0_mb8_ck0_bf16",
    "h200-2026-11-26/tune/0001-z2_mb8_ck4_bf16_oo_cpu", "h200-2026-11-26/tune/0003-z1_mb2_ck1_bf16_oo_cpu",
    "h200-2026-11-27/kit/llama-1b/0001-z3_mb8_ck0_bf16", "h200-2026-11-27/tune/0001-z2_mb8_ck4_bf16_oo_cpu",
}


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
def loaded(bench):
    return bench.load()


@pytest.fixture(scope="module")
def trials(loaded):
    return list(loaded.valid)


def _errors(trials) -> list[float]:
    return [abs(t.raw_bytes() / t.peak - 1) for t in trials]


def test_every_valid_trial_of_both_runs_once_and_no_fp16(trials, loaded):
    assert len(trials) == len(VALID) and {t.key for t in trials} == VALID  # the kit's surface and work/ copy: once
    assert all(t.config.precision == "bf16" for t in trials)
    # Every fp16 record of both runs skipped every step: read as untrained, listed, not measured.
    assert len(loaded.untrained) == 5 and all("fp16" in label for _, label in loaded.untrained)
    for t in trials:
        assert t.hardware.name == "h200" and not t.hardware.is_cpu and t.hardware.allocator == "default"
        assert t.reserved + t.outside == t.peak  # the product's peak, as the worker measures it


def test_old_records_are_predicted_for_the_model_they_ran(trials):
    """No record of either run has `model_revision`: the fp32 RMSNorm's bytes come off their prediction."""
    for t in trials:
        assert t.old_model
        assert t.raw_bytes() == t.predict().peak_bytes - norm_upcast_bytes(t.config, t.workload)
        assert norm_upcast_bytes(t.config, t.workload) > 0


def test_raw_peaks_of_all_valid_trials(trials):
    errors = _errors(trials)
    assert statistics.median(errors) <= 0.02 and max(errors) <= 0.05
    # The first run's trials: before the terms of issue 40 1.7% median, 9.8% worst; now 2.7% and 4.7% (the logits'
    # 16-bit gradient moved z0 mb16 ck0 from 2.5% to 4.7% over, whose head reserve the model overstates).
    first = _errors([t for t in trials if t.run == "h200-2026-11-26"])
    assert statistics.median(first) <= 0.03 and max(first) <= 0.05


def test_held_out_trials_within_the_issue_goal(bench, trials):
    """Issue 40: raw median <= 5% and worst <= 10% on the trials no term was fitted on."""
    held = bench.held_out(trials)
    assert [t.key for t in held] == ["h200-2026-11-27/tune/0001-z2_mb8_ck4_bf16_oo_cpu"]
    assert bench.repeats_a_fitted_config(held[0], trials)  # the first run's tune measured the same bytes
    assert statistics.median(_errors(held)) <= 0.05 and max(_errors(held)) <= 0.10


def test_each_fitted_trial_is_a_valid_one(bench, trials):
    assert bench.fitted_keys() <= {t.key for t in trials}


def test_calibrated_on_each_sweeps_first_trial_within_5_percent(bench, trials):
    calibrated = bench.calibrated_on_first(trials)
    assert list(calibrated) == ["h200-2026-11-26/tune/0003-z1_mb2_ck1_bf16_oo_cpu"]  # the only sweep with two
    peaks = {t.key: t.peak for t in trials}
    assert all(abs(pred / peaks[key] - 1) <= 0.05 for key, pred in calibrated.items())


def test_each_part_near_its_measurement(trials):
    """The terms are named and each follows its own measurement, not one sum: outside the allocator within
    0.1 GiB, the reserve within a factor of 2.1 (it is the hardest term: 0.55 to 15 GiB measured)."""
    for t in trials:
        mem = t.predict().memory
        assert abs(mem.outside_allocator - t.outside) <= 0.1 * 2**30
        reserve = t.reserved - t.allocated
        assert 1 / 2.1 <= mem.allocator_reserve / reserve <= 2.1
        assert mem.overhead == 0


def test_the_report_is_written(bench, tmp_path):
    out = tmp_path / "gpu_memory_accuracy.md"
    assert bench.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert "| now, all valid | 6 |" in text and "| now, held out (" in text and "5 fp16 records" in text
