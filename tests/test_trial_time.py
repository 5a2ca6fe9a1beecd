"""Trial time as a prediction (issue 41, autotune/prediction/trial_time.py): the real trials of both H200 runs and
the CPU surfaces predicted as benchmarks/trial_time.py tabulates them, the directions the model must move in,
calibration on a sweep's own trials, and the estimator's hook. No trial runs here."""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from autotune.prediction.estimate import estimate, states_fit, trial_time_of
from autotune.prediction.trial_time import (CPU, CPU_ADAM, CUDA, DEFAULT_MEASURE, FP16_WORST_SKIPPED_STEPS, FUSED_ADAM,
                                            JobSize, Steps, calibrated, model_for, op_for, trial_time, trial_time_at)
from autotune.values.config import Config
from autotune.values.dsconfig import ds_config
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult
from autotune.values.workload import make_workload
from autotune.worker.main import needed_builders
from autotune.worker.measure import MeasureSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import trial_time as bench  # noqa: E402

H200 = PROFILES["h200"]
LLAMA_1B = make_workload("llama-1b", 32)
BOTH = frozenset({FUSED_ADAM, CPU_ADAM})
GOAL = 0.30  # issue 41: the trial-time model against the shared GPU phases, each within 30%
# ... or within this many seconds: trials on ranks started ahead take 2-6 s (11-30), where one step's spread and the
# first step's lazy allocations are a second.
NEAR_S = 1.5


def near(predicted: float, recorded: float) -> bool:
    return abs(bench.error(predicted, recorded)) <= GOAL or abs(predicted - recorded) <= NEAR_S


@pytest.fixture(scope="module")
def gpu() -> list[bench.GpuTrial]:
    return bench.gpu_trials()


def test_the_runs_hold_the_trials_the_readmes_name(gpu):
    valid = [t for t in gpu if t.valid]
    # 11-26 and 11-27: 14 trials, 6 trained, 3 out of memory, 5 fp16 untrained; 11-30: 22 trials (kit surfaces 12, its
    # tune 6, the user's tune 4 from its trials.jsonl), 17 trained, 5 out of memory
    assert len(gpu) == 36 and len(valid) == 31
    assert sum(t.result.status == "oom" for t in valid) == 8
    assert {t.run for t in valid} == {"h200-2026-11-26", "h200-2026-11-27", "h200-2026-11-30"}


COLD_AHEAD = "on a rank started ahead, its initialize as cold"


def beyond_the_model(t: bench.GpuTrial) -> str | None:
    """Why a valid trial's wall time is outside what the trial-time model prices, or None."""
    c = t.result.config
    if c.offload_param != "none" or c.precision == "fp32":  # benchmarks/gpu_step_time.py: 3.5-4.3x and 0.46x
        return "its step time, which the estimator does not price"
    if t.phases and t.result.extra["steps_measured"] > t.measure.min_steps + 1:
        return "measured long"  # the stop rule's tail, priced as its mean (extra_measure_steps)
    if t.result.step_time_s and abs(t.measure.max_measure_s / t.result.step_time_s - 1) < 0.05:
        return "its step at its measurement's time limit"  # 1 step or 2 as the first one falls either side
    if t.ahead and c.zero_stage < 3 and c.offload_optimizer == "none" and t.phases.get("initialize_s", 0) > 3:
        return COLD_AHEAD  # 2 of 7 such trials on 11-30
    return None


def test_every_valid_gpu_trial_within_30_percent_of_its_wall_time_at_the_estimators_step(gpu):
    # "Each within 30%" read per trial, on its whole wall time, with the step time a search has before any trial
    # (the estimator's, raw): every trained trial and every out-of-memory one of the three runs, but those whose
    # seconds went where the model prices a mean or the estimator a step it does not know (named here, so that a
    # new miss fails); each run's trials in all within 20% (what a time budget adds up).
    beyond = [(t.name, beyond_the_model(t)) for t in gpu if t.valid and beyond_the_model(t)]
    assert beyond == [("0003-z3_mb16_ck1_fp16_op_cpu", "its step time, which the estimator does not price"),
                      ("0004-z3_mb32_ck1_fp16_op_cpu", "its step time, which the estimator does not price"),
                      ("0001-z3_mb8_ck0_bf16_oo_cpu", "its step at its measurement's time limit"),
                      ("0001-z3_mb8_ck1_bf16", "measured long"),
                      ("0003-z0_mb1_ck0_fp16", COLD_AHEAD),
                      ("0004-z1_mb2_ck0_bf16", "measured long"),
                      ("0005-z2_mb2_ck0_bf16", COLD_AHEAD),
                      ("0006-z0_mb2_ck0_bf16", "measured long"),
                      ("0003-z0_mb1_ck4_fp32", "its step time, which the estimator does not price")]
    for t in (t for t in gpu if t.valid and not beyond_the_model(t)):
        predicted = t.predict(t.estimator_step_s()).total_s
        assert near(predicted, t.result.wall_time_s), (t.run, t.label, predicted)
    for run in {t.run for t in gpu}:
        valid = [t for t in gpu if t.valid and t.run == run]
        predicted = sum(t.predict(t.estimator_step_s()).total_s for t in valid)
        assert abs(bench.error(predicted, sum(t.result.wall_time_s for t in valid))) <= 0.2, run


def test_a_rank_started_ahead_and_a_death_in_initialize_are_priced_as_they_ran(gpu):
    """11-30: trials on ranks started ahead launched in 0.0-1.95 s (cold: 3.1-4.6 s); llama-3b at ZeRO 0, its model
    states over the budget, died inside deepspeed.initialize in 3.7 s (ahead) and 8.9 s (cold), not after it."""
    ahead = [t for t in gpu if t.run == "h200-2026-11-30" and t.ahead and t.phases and not beyond_the_model(t)]
    assert len(ahead) >= 5
    for t in ahead:
        assert t.predict(t.result.step_time).launch_s < 0.5 and t.phases["spawn_s"] + t.phases["import_s"] < 2.0
    predicted = sum(t.predict(t.result.step_time).total_s for t in ahead)
    assert abs(bench.error(predicted, sum(t.result.wall_time_s for t in ahead))) <= 0.2
    died = {t.name: t for t in gpu if not t.states_fit}
    assert sorted(died) == ["0002-z0_mb2_ck1_fp16", "0004-z0_mb1_ck1_fp16"]
    for t in died.values():
        ours = t.predict(t.estimator_step_s())
        assert ours.warmup_s == 0 and near(ours.total_s, t.result.wall_time_s), t.name
        est = estimate(t.result.config, t.workload, t.hardware)
        assert not states_fit(est, t.workload, t.result.memory_budget_bytes)  # what the product decides it from
        assert not trial_time_of(est, t.workload, t.hardware, budget_bytes=t.result.memory_budget_bytes).fits


def test_launch_to_first_step_and_measurement_each_within_30_percent_at_the_measured_step(gpu):
    # The same reading per part, at each trial's own step time (the trial-time model alone): the untrained fp16
    # trials too (their time was spent), but the one that measured 12 steps of min 3 (its skipped steps' times
    # spread: the stop rule's tail, priced as half a step beyond min_steps on average).
    ran = [t for t in gpu if t.phases]
    long = [t for t in ran if t.result.extra["steps_measured"] > t.measure.min_steps + 1]
    assert [(t.name, t.result.config.precision) for t in long] == [
        ("trial-12-steps", "fp16"), ("0001-z3_mb8_ck1_bf16", "bf16"), ("0004-z1_mb2_ck0_bf16", "bf16"),
        ("0006-z0_mb2_ck0_bf16", "bf16")]  # 11-30's kit tune: 9, 7 and 19 steps (the confirmation repeat's 19)
    for t in (t for t in ran if t not in long and beyond_the_model(t) != COLD_AHEAD):
        own = t.predict(t.result.step_time)
        first, measured = float(t.result.extra["launch_to_first_step_s"]), t.phases["measure_s"]
        assert near(own.total_s, t.result.wall_time_s), (t.run, t.label)
        assert near(own.launch_to_first_step_s, first), (t.run, t.label)
        at_limit = beyond_the_model(t) == "its step at its measurement's time limit"
        assert near(own.measure_s, measured) or at_limit, (t.run, t.label)


def test_calibration_on_a_sweeps_earlier_trials_keeps_its_later_ones_within_30_percent(gpu):
    # calibrated on the earlier trials the model describes (a trial measured long would scale every step after it)
    for t in (t for t in gpu if t.valid and not beyond_the_model(t)):
        earlier = [e for e in bench.earlier_in_sweep(gpu, t) if not beyond_the_model(e)]
        if earlier:
            predicted = t.predict(t.estimator_step_s(), t.calibrated_model(earlier)).total_s
            assert near(predicted, t.result.wall_time_s), (t.run, t.label)


def test_cpu_surfaces_wall_times_within_their_tolerance():
    # One set of CPU terms for a quiet machine (tiny: imports 2.3 s) and a loaded one (small-llama: 7.1 s): raw,
    # the median trial within 35%; calibrated on a surface's first 3 trials, the median of the rest within 20%.
    for name, steps, results in bench.cpu_trials():
        raw, rest = bench.cpu_errors(steps, results)
        assert statistics.median(raw) <= 0.35, name
        assert statistics.median(rest) <= 0.20, name
        assert statistics.median(rest) < statistics.median(raw), name


# -- directions ---------------------------------------------------------------------------------------------

def predict(config: Config, step_s: float = 1.0, **options) -> float:
    return trial_time(config, LLAMA_1B, H200, step_s, ops_built=BOTH, **options).total_s


def test_offload_costs_more_initialize_and_parameter_offload_more_still():
    plain, optimizer, both = (trial_time(Config(3, 4, 1, "bf16", o, p), LLAMA_1B, H200, 1.0, ops_built=BOTH)
                              for o, p in (("none", "none"), ("cpu", "none"), ("cpu", "cpu")))
    assert plain.initialize_s < optimizer.initialize_s < both.initialize_s
    assert plain.exit_s < optimizer.exit_s  # pinned host memory freed at exit
    assert predict(Config(2, 4, 1, "bf16")) < predict(Config(2, 4, 1, "bf16", "cpu"))
    # as measured at 1.1e9 on the H200s: ZeRO 1-2 initialize 6.4-9.3 s without offload, 17.3-29.1 s with it
    assert 6.4 <= trial_time(Config(2, 4, 1, "bf16"), LLAMA_1B, H200, 1.0).initialize_s <= 9.3
    assert 17.3 <= trial_time(Config(2, 4, 1, "bf16", "cpu"), LLAMA_1B, H200, 1.0).initialize_s <= 29.1


def test_a_built_op_costs_nothing_and_an_unbuilt_one_its_first_build():
    for config, op in ((Config(2, 4, 1, "bf16"), FUSED_ADAM), (Config(2, 4, 1, "bf16", "cpu"), CPU_ADAM)):
        assert op_for(config) == op
        fresh = trial_time(config, LLAMA_1B, H200, 1.0)
        built = trial_time(config, LLAMA_1B, H200, 1.0, ops_built={op})
        assert built.ops_build_s == 0 and fresh.ops_build_s == CUDA.op_build(op) > 0
        assert fresh.total_s - built.total_s == pytest.approx(CUDA.op_build(op))
        assert fresh.ops_s == built.ops_s > 0  # loading it is paid either way
    torch_adam = trial_time(Config(2, 4, 1, "bf16", "cpu"), LLAMA_1B, H200, 1.0, ds_cpu_adam=False)
    assert torch_adam.ops_s == torch_adam.ops_build_s == 0


def test_the_op_is_the_one_the_worker_loads():
    names = {"FusedAdamBuilder": FUSED_ADAM, "CPUAdamBuilder": CPU_ADAM}
    for config in (Config(0, 4, 1, "bf16"), Config(2, 4, 1, "bf16", "cpu"), Config(3, 4, 1, "fp16", "cpu", "cpu")):
        assert [names[b] for b in needed_builders("cuda", [ds_config(config, LLAMA_1B)])] == [op_for(config)]


def test_fp16_warmup_is_priced_above_bf16s_and_its_worst_case_above_that():
    bf16 = trial_time(Config(2, 4, 1, "bf16"), LLAMA_1B, H200, 2.0, ops_built=BOTH)
    fp16 = trial_time(Config(2, 4, 1, "fp16"), LLAMA_1B, H200, 2.0, ops_built=BOTH)
    assert fp16.warmup_s == pytest.approx(bf16.warmup_s + CUDA.fp16_skipped_steps * 2.0)
    assert fp16.worst_s - fp16.total_s >= (FP16_WORST_SKIPPED_STEPS - CUDA.fp16_skipped_steps) * 2.0
    assert bf16.worst_s >= bf16.total_s


def test_the_fp16_worst_case_is_near_the_trial_that_ran_the_loss_scale_search_to_its_end():
    # 11-27's fp16-trial: z2 mb2 fp16 with 20 warm-up steps, every step overflowing (the model before its RMSNorm ran
    # in fp32) until the scaler gave up at its 18th step, 65.5 s after launch; its steps took 2.21 s (the same
    # config's 12-step trial).
    config = Config(2, 2, 0, "fp16")
    searched = CUDA.with_(fp16_skipped_steps=FP16_WORST_SKIPPED_STEPS)
    to_the_end = trial_time(config, LLAMA_1B, H200, 2.21, ops_built=BOTH, model=searched)
    assert abs(bench.error(to_the_end.launch_to_first_step_s, 65.5)) <= GOAL
    assert trial_time(config, LLAMA_1B, H200, 2.21, ops_built=BOTH).worst_s >= to_the_end.total_s


def test_an_out_of_memory_trial_is_cheaper_than_one_that_fits():
    for hardware in (H200, PROFILES["cpu"]):
        config = Config(0, 8, 0, "bf16")
        ok = trial_time(config, LLAMA_1B, hardware, 1.0, ops_built=BOTH)
        oom = trial_time(config, LLAMA_1B, hardware, 1.0, ops_built=BOTH, fits=False)
        assert not oom.fits and oom.measure_s == 0 and oom.total_s < ok.total_s
        assert oom.launch_s + oom.build_s + oom.initialize_s == pytest.approx(ok.launch_s + ok.build_s
                                                                              + ok.initialize_s)


def test_bigger_models_slower_steps_and_more_steps_cost_more():
    small, big = make_workload("llama-1b", 32), make_workload("llama-7b", 32)
    config = Config(3, 4, 1, "bf16", "cpu")
    assert trial_time(config, small, H200, 1.0).total_s < trial_time(config, big, H200, 1.0).total_s
    assert predict(Config(0, 4, 1, "bf16"), 1.0) < predict(Config(0, 4, 1, "bf16"), 2.0)
    assert predict(Config(0, 4, 1, "bf16"), measure=Steps(1, 2, 2, 60)) < predict(Config(0, 4, 1, "bf16"),
                                                                                 measure=Steps(1, 5, 20, 60))


def test_measurement_stops_at_its_time_limit():
    slow = trial_time(Config(0, 4, 1, "bf16"), LLAMA_1B, H200, 7.0, ops_built=BOTH, measure=Steps(1, 3, 20, 10.0))
    assert slow.measure_s == pytest.approx(14.0)  # the step that crossed 10 s ends it
    assert trial_time(Config(0, 4, 1, "bf16"), LLAMA_1B, H200, 20.0, measure=Steps(1, 3, 20, 10.0)).measure_s == 20.0


def test_zero3_and_several_ranks_change_the_start_as_measured():
    assert predict(Config(0, 4, 1, "bf16")) < predict(Config(3, 4, 1, "bf16"))  # zero.Init and ZeRO-3's initialize
    one = trial_time_at(Config(2, 4, 1, "bf16"), JobSize(1.1e9), 1.0, CPU)
    four = trial_time_at(Config(2, 4, 1, "bf16"), JobSize(1.1e9, 4, 4), 1.0, CPU)
    assert four.launch_s > one.launch_s  # ranks of one node import on its cores, then gloo's process group


def test_each_accelerator_has_its_terms_and_the_default_measure_is_the_workers():
    assert model_for(H200) is CUDA and model_for(PROFILES["a100-80gb"]) is CUDA and model_for(PROFILES["cpu"]) is CPU
    defaults = MeasureSettings()
    assert {f.name: getattr(DEFAULT_MEASURE, f.name) for f in fields(Steps)} == {
        f.name: getattr(defaults, f.name) for f in fields(Steps)}
    ours = trial_time(Config(2, 4, 1, "bf16"), LLAMA_1B, H200, 1.0, measure=defaults)
    assert ours == trial_time(Config(2, 4, 1, "bf16"), LLAMA_1B, H200, 1.0)


def test_trial_time_is_fast_enough_for_every_config_of_a_space():
    configs = [Config(z, mb, ck, p, o) for z in (0, 1, 2, 3) for mb in (1, 2, 4, 8, 16) for ck in (0, 1, 2)
               for p in ("bf16", "fp16") for o in ("none", "cpu")] * 5
    start = time.perf_counter()
    for config in configs:
        trial_time(config, LLAMA_1B, H200, 1.0)
    assert (time.perf_counter() - start) / len(configs) < 1e-3  # ~10 us each here


# -- calibration ------------------------------------------------------------------------------------------

def record(config: Config, wall: float, step: float, phases: dict[str, float]) -> TrialResult:
    return TrialResult(config, "ok", 32 / step, None, step, None, None, wall, "deepspeed", None,
                       {"phases_s": phases, "steps_measured": 3})


def test_calibration_moves_a_biased_model_towards_the_records(gpu):
    sweep = [t for t in gpu if t.run == "h200-2026-11-27" and t.sweep == "tune"]
    terms = sweep[0].model()  # as the code of then ran them
    biased = terms.with_(launch_s=2 * terms.launch_s, initialize_s=0.5 * terms.initialize_s, first_step_s=0.0,
                         offload_initialize_s_per_b=0.5 * terms.offload_initialize_s_per_b)
    fitted = calibrated(biased, [t.result for t in sweep], sweep[0].workload, H200, sweep[0].measure)
    assert fitted.samples == 2 and fitted.fixed_scale < 1 < fitted.initialize_scale and fitted.step_scale > 1

    def misses(model) -> tuple[float, ...]:
        """Over the sweep: each group's predicted seconds less its recorded ones, and the mean absolute wall error."""
        own = [t.predict(t.result.step_time, model) for t in sweep]
        fixed = sum(p.launch_s + p.build_s + p.exit_s - (t.phases["spawn_s"] + t.phases["import_s"]
                                                         + t.phases["build_s"] + t.result.wall_time_s
                                                         - sum(t.phases.values())) for p, t in zip(own, sweep))
        initialize = sum(p.initialize_s - t.phases["initialize_s"] for p, t in zip(own, sweep))
        steps = sum(p.warmup_s + p.measure_s - t.phases["warmup_s"] - t.phases["measure_s"] for p, t in zip(own, sweep))
        wall = statistics.mean(abs(bench.error(p.total_s, t.result.wall_time_s)) for p, t in zip(own, sweep))
        return abs(fixed), abs(initialize), abs(steps), wall

    assert all(after < before for after, before in zip(misses(fitted), misses(biased)))


def test_calibration_is_pulled_towards_one_and_needs_recorded_phases():
    config = Config(2, 4, 1, "bf16")
    ours = trial_time(config, LLAMA_1B, H200, 1.0, ops_built=BOTH)
    phases = {"spawn_s": 0.0, "import_s": 2 * ours.launch_s, "dist_init_s": 0.0, "build_s": 2 * ours.build_s,
              "build_ops_s": ours.ops_s, "initialize_s": 2 * ours.initialize_s, "warmup_s": ours.warmup_s,
              "measure_s": ours.measure_s}
    wall = sum(phases.values()) + 2 * ours.exit_s
    one = calibrated(CUDA, [record(config, wall, 1.0, phases)], LLAMA_1B, H200)
    assert one.fixed_scale == pytest.approx(math.sqrt(2)) and one.initialize_scale == pytest.approx(math.sqrt(2))
    assert one.step_scale == pytest.approx(1.0) and one.samples == 1
    many = calibrated(CUDA, [record(config, wall, 1.0, phases)] * 9, LLAMA_1B, H200)
    assert many.initialize_scale == pytest.approx(2 ** 0.9)  # nine trials against the prior's one
    assert calibrated(one, [], LLAMA_1B, H200) == CUDA  # nothing recorded: the terms as they are
    oom = TrialResult(config, "oom", wall_time_s=20.0)
    assert calibrated(CUDA, [oom], LLAMA_1B, H200).samples == 0


# -- the estimator's hook -------------------------------------------------------------------------------------

def test_the_estimator_prices_an_estimates_trial():
    config = Config(2, 4, 1, "bf16")
    est = estimate(config, LLAMA_1B, H200)
    ours = trial_time_of(est, LLAMA_1B, H200, budget_bytes=H200.memory_bytes, ops_built=BOTH)
    assert ours == trial_time(config, LLAMA_1B, H200, est.step_time_s, ops_built=BOTH) and ours.fits
    assert not trial_time_of(est, LLAMA_1B, H200, budget_bytes=est.peak_bytes - 1).fits


def test_a_rank_stopped_from_outside_has_its_phases_read_from_its_events():
    """A rank the runner stops past the memory budget reports nothing: its events give the phases that ended, as the
    rank's own report would (the phase it died in left out), and the spawn from the trial's launch."""
    from autotune.worker.protocol import phases_from_events

    events = [{"t": 10.0, "phase": "start"}, {"t": 13.5, "phase": "build_ops"},
              {"t": 13.9, "phase": "build_ops", "op": "fused_adam", "building": False}, {"t": 14.0, "phase": "dist_init"},
              {"t": 14.1, "phase": "build"}, {"t": 14.6, "phase": "initialize"}, {"t": 21.0, "phase": "warmup"}]
    assert phases_from_events(events, launch_time=9.8) == pytest.approx(
        {"spawn_s": 0.2, "import_s": 3.5, "build_ops_s": 0.5, "dist_init_s": 0.1, "build_s": 0.5, "initialize_s": 6.4})
    assert phases_from_events(events[:1], None) == {} and phases_from_events([], 9.8) == {}
