"""The estimator against the committed H200 trials of the three runs (benchmarks/gpu-runs/h200-2026-11-26, -27 and
-30; issues 25, 40 and 41): the peak predicted as the GPU holds it (allocator reserve + memory outside it), raw, on
the valid trials only (the fp16 ones of 11-26 and 11-27 never trained), and on those no term was fitted on."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from autotune.prediction.estimate import fp16_fp32_gradient_bytes, norm_upcast_bytes

ROOT = Path(__file__).resolve().parents[1]
# The valid trials of the runs issues 25 and 40 set their goals on.
FIRST_TWO = {
    "h200-2026-11-26/kit/llama-1b/0001-z0_mb16_ck0_bf16", "h200-2026-11-26/kit/llama-3b/0001-z0_mb8_ck0_bf16",
    "h200-2026-11-26/tune/0001-z2_mb8_ck4_bf16_oo_cpu", "h200-2026-11-26/tune/0003-z1_mb2_ck1_bf16_oo_cpu",
    "h200-2026-11-27/kit/llama-1b/0001-z3_mb8_ck0_bf16", "h200-2026-11-27/tune/0001-z2_mb8_ck4_bf16_oo_cpu",
}
# 11-30's: the kit's surfaces (kit/<model>), the kit's own `tune` (kit/work/tune, expandable segments) and a user's
# `tune` kept without its run.json (tune).
THIRD = {
    "h200-2026-11-30/kit/llama-1b/0001-z0_mb8_ck0_bf16", "h200-2026-11-30/kit/llama-1b/0003-z3_mb16_ck1_fp16_op_cpu",
    "h200-2026-11-30/kit/llama-1b/0004-z3_mb32_ck1_fp16_op_cpu", "h200-2026-11-30/kit/llama-1b/0005-z1_mb16_ck0_bf16_oo_cpu",
    "h200-2026-11-30/kit/llama-1b/0007-z0_mb16_ck1_fp16", "h200-2026-11-30/kit/llama-1b/0008-z0_mb32_ck1_fp16",
    "h200-2026-11-30/kit/llama-3b/0001-z3_mb8_ck0_bf16_oo_cpu", "h200-2026-11-30/kit/work/tune/0001-z3_mb8_ck1_bf16",
    "h200-2026-11-30/kit/work/tune/0002-z0_mb2_ck0_bf16", "h200-2026-11-30/kit/work/tune/0003-z0_mb1_ck0_fp16",
    "h200-2026-11-30/kit/work/tune/0004-z1_mb2_ck0_bf16", "h200-2026-11-30/kit/work/tune/0005-z2_mb2_ck0_bf16",
    "h200-2026-11-30/kit/work/tune/0006-z0_mb2_ck0_bf16", "h200-2026-11-30/tune/0001-z2_mb8_ck4_bf16_oo_cpu",
    "h200-2026-11-30/tune/0002-z3_mb4_ck0_bf16_oo_cpu", "h200-2026-11-30/tune/0003-z0_mb1_ck4_fp32",
    "h200-2026-11-30/tune/0004-z2_mb8_ck4_bf16_oo_cpu",
}


def _bench():
    """The benchmark, imported as tests/test_gpu_step_time.py imports its own (beside it: trial_time, its runs)."""
    benchmarks = str(ROOT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import gpu_memory_accuracy

    return gpu_memory_accuracy


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


def test_every_valid_trial_of_the_runs_once(trials, loaded):
    assert len(trials) == len(FIRST_TWO | THIRD) and {t.key for t in trials} == FIRST_TWO | THIRD  # surface, work/: once
    assert all(t.config.precision == "bf16" for t in trials if t.key in FIRST_TWO)
    # Every fp16 record of 11-26 and 11-27 skipped every step: read as untrained, listed, not measured; 11-30's five
    # trained.
    assert len(loaded.untrained) == 5 and all("fp16" in label for _, label in loaded.untrained)
    assert sum(t.config.precision == "fp16" for t in trials) == 5
    for t in trials:
        expandable = t.sweep == "kit/work/tune"  # the kit runs its own tune with expandable segments
        assert t.hardware.name == "h200" and not t.hardware.is_cpu
        assert t.hardware.allocator == ("expandable" if expandable else "default")
        assert t.reserved + t.outside == t.peak  # the product's peak, as the worker measures it
    # The user's tune kept without run.json is planned with the workload its records show.
    kept = [t for t in trials if t.run == "h200-2026-11-30" and t.sweep == "tune"]
    assert len(kept) == 4 and all(t.workload.model.seq_len == 2048 and t.workload.global_batch == 32 for t in kept)


def test_old_records_are_predicted_for_the_model_they_ran(trials):
    """No record of 11-26 or 11-27 has `model_revision`: the fp32 RMSNorm's bytes come off their prediction; 11-30's
    ran the model with it."""
    for t in trials:
        assert t.old_model == (t.key in FIRST_TWO)
        off = norm_upcast_bytes(t.config, t.workload) if t.old_model else 0
        assert t.raw_bytes() == t.predict().peak_bytes - off
        if t.config.precision != "fp32":
            assert norm_upcast_bytes(t.config, t.workload) > 0


def test_raw_peaks_of_all_valid_trials(trials):
    first_two = [t for t in trials if t.key in FIRST_TWO]
    errors = _errors(first_two)
    # Issue 25's goal was median <= 8% and worst <= 15% on these.
    assert statistics.median(errors) <= 0.02 and max(errors) <= 0.05
    # The first run's trials: before the terms of issue 40 1.7% median, 9.8% worst; now 2.7% and 4.7% (the logits'
    # 16-bit gradient moved z0 mb16 ck0 from 2.5% to 4.7% over, whose head reserve the model overstates).
    first = _errors([t for t in trials if t.run == "h200-2026-11-26"])
    assert statistics.median(first) <= 0.03 and max(first) <= 0.05
    # All three runs: 3.6% median. Two trials beyond issue 25's 15%: the only fp32 one, 27% under (its allocated
    # peak 3.4 GiB above the states and activations predicted: not modeled), and ZeRO-3's fp16 parameter offload at
    # micro-batch 32, 19% over (its reserve predicted twice what it held).
    everything = _errors(trials)
    assert statistics.median(everything) <= 0.04
    beyond = {t.label for t, e in zip(trials, everything) if e > 0.15}
    assert beyond == {"z0 mb1 ck4 fp32", "z3 mb32 ck1 fp16 op=cpu"}


def test_zero0_fp16_step_is_the_peak_where_backward_holds_less(trials):
    """FP16_Optimizer's step casts every gradient to fp32 and flattens the copies (8 bytes a parameter) after backward
    freed the activations: at micro-batch 1 and at 16 with checkpointing both H200 trials peaked there, at the same
    allocated bytes (24.06 a parameter), which the states plus the activations undershot by 8% or overshot by 17%."""
    fp16 = {t.label: t for t in trials if t.config.zero_stage == 0 and t.config.precision == "fp16"}
    assert set(fp16) == {"z0 mb1 ck0 fp16", "z0 mb16 ck1 fp16", "z0 mb32 ck1 fp16"}
    step = fp16["z0 mb1 ck0 fp16"]
    # The same peak (to a MiB): the step's, not backward's.
    assert abs(step.allocated - fp16["z0 mb16 ck1 fp16"].allocated) <= 2**20
    for label in ("z0 mb1 ck0 fp16", "z0 mb16 ck1 fp16"):
        t = fp16[label]
        assert abs(t.raw_allocated_bytes() / t.allocated - 1) <= 0.01
        assert 2 * fp16_fp32_gradient_bytes(t.config, t.workload) == 8 * t.workload.model.params
    # Larger micro-batches peak in backward, above the step: the step adds nothing there.
    big = fp16["z0 mb32 ck1 fp16"]
    assert big.predict().memory.activations > 2 * fp16_fp32_gradient_bytes(big.config, big.workload)
    assert big.allocated > step.allocated


def test_held_out_trials_within_the_issue_goal(bench, trials):
    """Issue 40: raw median <= 5% and worst <= 10% on the trials of its runs no term was fitted on. 11-30's are held
    out too, but the two the fp16 step was checked on; two of them are beyond 15% (test_raw_peaks_of_all_valid_trials)."""
    held = bench.held_out(trials)
    issue_40 = [t for t in held if t.run in bench.ISSUE_40_RUNS]
    assert [t.key for t in issue_40] == ["h200-2026-11-27/tune/0001-z2_mb8_ck4_bf16_oo_cpu"]
    assert bench.repeats_a_fitted_config(issue_40[0], trials)  # the first run's tune measured the same bytes
    assert statistics.median(_errors(issue_40)) <= 0.05 and max(_errors(issue_40)) <= 0.10
    assert {t.key for t in held} == (THIRD | {issue_40[0].key}) - bench.fitted_keys()
    assert len(held) == 16 and statistics.median(_errors(held)) <= 0.06


def test_each_fitted_trial_is_a_valid_one(bench, trials):
    assert bench.fitted_keys() <= {t.key for t in trials}


def test_calibrated_on_each_sweeps_first_trial(bench, trials):
    calibrated = bench.calibrated_on_first(trials)
    peaks = {t.key: t.peak for t in trials}
    errors = {key: abs(pred / peaks[key] - 1) for key, pred in calibrated.items()}
    first_two = [key for key in calibrated if key in FIRST_TWO]
    assert first_two == ["h200-2026-11-26/tune/0003-z1_mb2_ck1_bf16_oo_cpu"]  # their only sweep with two
    assert errors[first_two[0]] <= 0.05
    # With 11-30's sweeps: 14 trials, 4.4% median; the fp32 trial 27% under, as raw.
    assert len(calibrated) == 14 and statistics.median(errors.values()) <= 0.05
    assert max(errors, key=errors.get) == "h200-2026-11-30/tune/0003-z0_mb1_ck4_fp32"


def test_each_part_near_its_measurement(trials):
    """The terms are named and each follows its own measurement, not one sum: outside the allocator within
    0.1 GiB on every trial; the reserve within a factor of 2.1 on the trials of 11-26 and 11-27 (it is the hardest
    term: 0.55 to 15 GiB measured), predicted 0 with expandable segments (0.13-2.2 GiB measured there)."""
    for t in trials:
        mem = t.predict().memory
        assert abs(mem.outside_allocator - t.outside) <= 0.1 * 2**30
        assert mem.overhead == 0
        reserve = t.reserved - t.allocated
        if t.hardware.allocator == "expandable":
            assert mem.allocator_reserve == 0 and reserve <= 2.2 * 2**30
        elif t.key in FIRST_TWO:
            assert 1 / 2.1 <= mem.allocator_reserve / reserve <= 2.1


def test_the_report_is_written(bench, tmp_path):
    out = tmp_path / "gpu_memory_accuracy.md"
    assert bench.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert "| now, all valid | 23 |" in text and "| now, held out (" in text and "5 fp16 records" in text
