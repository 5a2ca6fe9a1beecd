"""Outputs of a sweep from hand-made results: summary.json contract, Pareto front, report tables, plots."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autotune.values.config import Config, ConfigError
from autotune.values.hardware import PROFILES
from autotune.outputs.plots import pareto_front
from autotune.outputs.report import NOT_RECORDED, _confirmation_table, _top_table, summarize, tables, write_outputs
from autotune.search.confirm import confirmation, prior_sigma, recommend
from autotune.values.results import STATUSES, TrialResult, append_result
from autotune.search.rundir import RunDir, RunSettings
from autotune.search_spaces import load_choices
from autotune.values.workload import make_workload

GiB = 2**30
BUDGET = 2 * GiB


def ok(mb: int, throughput: float, peak_gib: float, trial: int, stage: int = 2) -> TrialResult:
    return TrialResult(Config(stage, mb, 0, "bf16"), "ok", throughput_samples_per_s=throughput,
                       tokens_per_s=throughput * 256, step_time_s=16 / throughput, peak_memory_bytes=int(peak_gib * GiB),
                       memory_budget_bytes=BUDGET, wall_time_s=10.0, backend="deepspeed",
                       extra={"trial": trial, "predicted_peak_bytes": int(peak_gib * GiB * 1.05)})


def failed(status: str, mb: int, error: str, trial: int, peak_gib: float | None = None) -> TrialResult:
    return TrialResult(Config(1, mb, 1, "fp32"), status, peak_memory_bytes=int(peak_gib * GiB) if peak_gib else None,
                       memory_budget_bytes=BUDGET, wall_time_s=5.0 if status != "pruned" else 0.0,
                       backend="deepspeed", error=error,
                       extra={"trial": trial, "predicted_peak_bytes": int(3 * GiB)})


@pytest.fixture
def results() -> list[TrialResult]:
    return [
        ok(1, 10.0, 1.0, 1),
        failed("oom", 8, "peak 2600000000 bytes exceeds the budget of 2147483648 bytes", 2, 2.4),
        ok(2, 14.0, 1.2, 3),
        failed("pruned", 16, "predicted peak 3.1 GiB exceeds the budget of 2 GiB by more than the 25% safety margin", 4),
        ok(4, 14.0, 1.6, 5, stage=1),  # ties the best: best_trial_index is the first to reach it
        failed("crash", 2, "exit code 1: RuntimeError: boom\nTraceback ...", 6),
        failed("oom", 4, "peak 2500000000 bytes exceeds the budget of 2147483648 bytes", 7, 2.3),
        ok(1, 12.0, 0.9, 8, stage=3),
    ]


@pytest.fixture
def settings() -> RunSettings:
    return RunSettings(make_workload("tiny"), PROFILES["cpu"], BUDGET, "optuna", "deepspeed", 0, load_choices("cpu"))


def test_summary_follows_the_contract(results, settings):
    summary = summarize(results, settings)
    assert summary == {
        "best": {"config": Config(2, 2, 0, "bf16").to_dict(), "throughput_samples_per_s": 14.0,
                 "peak_memory_bytes": int(1.2 * GiB)},
        "trials": 8,
        "best_trial_index": 3,
        "strategy": "optuna",
        "memory_budget_bytes": BUDGET,
        "status_counts": {"ok": 4, "oom": 2, "unsupported": 0, "timeout": 0, "crash": 1, "pruned": 1,
                          "untrained": 0},
        "trial_seconds": 55.0,  # 4 trials of 10 s, 3 failures of 5 s, the pruned config none
        "trial_seconds_to_best": 25.0,  # trials 1-3
    }
    assert list(summary["status_counts"]) == list(STATUSES)


def test_summary_without_a_fitting_result(settings):
    summary = summarize([failed("oom", 8, "too big", 1, 2.5)], settings)
    assert summary["best"] is None and summary["best_trial_index"] is None and summary["trials"] == 1


def test_pareto_front_keeps_results_no_other_beats_on_both_axes(results):
    front = pareto_front(results)
    assert [(r.peak_memory_bytes, r.throughput_samples_per_s) for r in front] == [
        (int(0.9 * GiB), 12.0), (int(1.2 * GiB), 14.0)]


@pytest.mark.slow  # imports matplotlib and DeepSpeed (its config parser) the first time
def test_outputs_from_a_run_directory(results, settings, tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_settings(settings)
    for r in results:
        append_result(run.trials_path, r)
    outputs = write_outputs(run, settings)
    assert outputs.best == results[2]
    # Trials recorded and no stop.json: the session that ran them was killed; its best is no recommendation yet.
    assert outputs.verdict.startswith("ended without writing its outputs (killed?) after 7 finished trials, "
                                      f"unfinished: continue it with the same command and --resume --out {run.path} "
                                      "(resume=True from Python); ")
    assert "best so far z2 mb2 ck0 bf16" in outputs.verdict and "(trial 3)" in outputs.verdict
    for name in ("summary.json", "best_ds_config.json", "best_hf_ds_config.json", "report.md",
                 "plots/throughput_vs_memory.png", "plots/best_so_far.png", "plots/memory_breakdown.png"):
        assert (run.path / name).is_file(), name
    # ...and why the sweep stopped: not recorded here (no runner wrote outputs for these trials before)
    assert json.loads((run.path / "summary.json").read_text()) == {
        "resume": f"continue it with the same command and --resume --out {run.path} (resume=True from Python)",
        "stop_reason": None,
        "stopped": NOT_RECORDED, **summarize(results, settings)}
    report = (run.path / "report.md").read_text()
    assert report.split("\n")[2].startswith("**Ended without writing its outputs (killed?)")  # first, not "Recommended"
    assert "The files hold the best so far, not a recommendation" in report
    top = [line for line in report.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")
           or line.startswith("| 3 |") or line.startswith("| 4 |")]
    assert [line.split("|")[2].strip() for line in top] == ["3", "5", "8", "1"]  # fastest first, by trial number
    # Failures grouped by cause: both OOMs share one cause once their numbers are blanked; the first is quoted.
    assert "| oom | device memory | #2: peak 2600000000 bytes exceeds the budget of 2147483648 bytes | 2 |" in report
    assert "| crash | - | exit code 1: RuntimeError: boom | 1 |" in report
    assert "| pruned | device memory |" in report
    # Two configs within this machine's noise of each other: the report says so.
    assert "Close call" in report


def test_the_top_table_says_each_configs_median_as_the_recommendation_does():
    # z2 mb2 measured 14.0 in the search, then 11.0 when re-run: 12.5 as the recommendation counts it, behind
    # a config measured once at 13.0 (the table said 14.0 first while the headline said 13.0).
    repeat = ok(2, 11.0, 1.3, 9)
    repeat = TrialResult(**{**repeat.__dict__, "extra": {**repeat.extra, "phase": "confirm"}})
    trials = [ok(2, 14.0, 1.2, 3), ok(4, 13.0, 1.5, 5), repeat]
    rows = [line.split("|") for line in _top_table(trials, BUDGET) if line.startswith(("| 1 |", "| 2 |"))]
    assert [(r[2].strip(), r[9].strip(), r[10].strip()) for r in rows] == [("5", "13", "1"), ("3", "12.5", "2")]
    assert recommend(trials, BUDGET).config == Config(2, 4, 0, "bf16")
    assert rows[1][13].strip() == "1.3 GiB"  # the highest peak of its runs, what a user plans for


def test_the_report_counts_one_config_and_one_repeat_in_the_singular():
    # "Top 1 configs", "1 repeat trials re-ran": one fitting config, re-run once.
    repeat = ok(2, 13.0, 1.3, 2)
    repeat = TrialResult(**{**repeat.__dict__, "extra": {**repeat.extra, "phase": "confirm", "repeat_of": 1}})
    trials = [ok(2, 14.0, 1.2, 1), repeat]
    assert _top_table(trials, BUDGET)[0] == "## Top 1 config within budget"
    confirmed = confirmation(trials, BUDGET, prior_sigma("deepspeed"))
    assert confirmed is not None and confirmed.repeats == 1
    text = "\n".join(_confirmation_table(confirmed))
    assert "1 repeat trial re-ran the best config" in text and "after its 2 runs" in text


def test_report_json_has_the_tables_top_configs_and_failures_by_cause(results):
    doc = tables(results, BUDGET)
    top = doc["top_configs"]
    assert [(t["rank"], t["trial"], t["throughput_samples_per_s"]) for t in top] == [(1, 3, 14.0), (2, 5, 14.0),
                                                                                      (3, 8, 12.0), (4, 1, 10.0)]
    assert top[0]["config"] == Config(2, 2, 0, "bf16").to_dict() and top[0]["of_budget"] == pytest.approx(0.6)
    assert top[0]["peak_memory_bytes"] == int(1.2 * GiB) and top[0]["runs"] == 1
    failures = {(f["status"], f["ran_out_of"]): f for f in doc["failures"]}
    assert failures[("oom", "device_memory")]["count"] == 2 and failures[("oom", "device_memory")]["trials"] == [2, 7]
    assert failures[("crash", None)]["cause"] == "exit code 1: RuntimeError: boom"
    assert failures[("pruned", "device_memory")]["configs"] == [Config(1, 16, 1, "fp32").label()]
    assert sum(f["count"] for f in doc["failures"]) == 4


def test_report_settings_round_trip(settings):
    assert RunSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings


def test_the_failure_table_groups_by_cause_and_shows_the_first_ones_figures():
    from autotune.outputs.report import _failures

    def oom(trial: int, peak: str, term: str = "activations") -> TrialResult:
        return TrialResult(Config(0, trial, 0, "fp32"), "oom", error=f"peak {peak} over the budget 2 GiB (largest term: "
                           f"{term})\ntraceback", extra={"trial": trial})

    rows = [line for line in _failures([oom(1, "3.5 GiB"), oom(2, "900 MiB"), oom(3, "4 GiB", "optimizer_states")])
            if line.startswith("| oom")]
    assert rows == ["| oom | device memory | #1: peak 3.5 GiB over the budget 2 GiB (largest term: activations) | 2 | #1 z0 mb1 ck0 "
                    "fp32; #2 z0 mb2 ck0 fp32 |",
                    "| oom | device memory | peak 4 GiB over the budget 2 GiB (largest term: optimizer_states) | 1 | #3 z0 mb3 ck0 "
                    "fp32 |"]
    long = TrialResult(Config(0, 1, 0, "fp32"), "crash", error="word " * 100, extra={"trial": 1})
    (row,) = [line for line in _failures([long]) if line.startswith("| crash")]
    assert "word word ... | 1 |" in row and len(row) < 260


def test_a_result_without_tokens_per_second_gets_no_flops_figure():
    from autotune.outputs.report import best_measures

    settings = RunSettings(make_workload("tiny", global_batch=8), PROFILES["cpu"], 2**30, "grid", "simulated", 0,
                           load_choices("cpu"))
    best = TrialResult(Config(1, 4, 0, "fp32"), "ok", throughput_samples_per_s=8.0, step_time_s=1.0)
    assert best_measures(best, settings) == "latency 1 s per optimizer step (global batch 8)"
    assert "model FLOPS" in best_measures(replace(best, tokens_per_s=2048.0), settings)
    # a user's objective may give no step time (it raised TypeError): from the throughput
    assert best_measures(replace(best, step_time_s=None, throughput_samples_per_s=4.0), settings) == \
        "latency 2 s per optimizer step (global batch 8)"


def test_a_resumes_refusal_shows_sizes_as_people_read_them():
    settings = RunSettings(make_workload("tiny", global_batch=8), PROFILES["cpu"], 2**30, "grid", "simulated", 0,
                           load_choices("cpu"))
    assert replace(settings, memory_budget_bytes=2 * 2**30).differences(settings) == [
        "memory_budget_bytes: recorded 2 GiB, given 1 GiB"]


@pytest.mark.slow  # imports matplotlib and DeepSpeed (its config parser) the first time
def test_the_memory_breakdown_is_the_calibrated_prediction(results, settings, tmp_path, monkeypatch):
    # The report's predictions are calibrated on the run's trials: its breakdown plot showed the raw estimate
    # (0.81 GiB against the report's 657 MiB for one config), as if the estimator were 18% high.
    from autotune.outputs import plots
    from autotune.prediction.calibrate import save_calibration
    from autotune.prediction.estimate import Calibration, estimate

    run = RunDir(tmp_path / "run")
    run.write_settings(settings)
    for r in results:
        append_result(run.trials_path, r)
    calibration = Calibration(overhead_bytes=3 * 2**20, memory_scale=0.8, samples=4)
    save_calibration(run.path, calibration, settings.workload, settings.hardware)
    drawn = []
    monkeypatch.setattr(plots, "memory_breakdown", lambda est, *args, **kwargs: drawn.append((est, kwargs)) or
                        run.plots_dir / "memory_breakdown.png")
    write_outputs(run, settings)
    (est, kwargs), = drawn
    assert est == estimate(results[2].config, settings.workload, settings.hardware, calibration)
    assert est.peak_bytes != estimate(results[2].config, settings.workload, settings.hardware).peak_bytes
    assert kwargs["calibrated"] == 4
    # Unreadable: refused before anything is written (the breakdown drawn uncalibrated disagreed with report.md).
    (run.path / "calibration.json").write_text("{not json")
    before = {name: (run.path / name).read_bytes() for name in ("summary.json", "report.md")}
    drawn.clear()
    with pytest.raises(ConfigError, match=r"calibration.json: not valid JSON \(.*column 2\)"):
        write_outputs(run, settings)
    assert not drawn and {name: (run.path / name).read_bytes() for name in before} == before
    (run.path / "calibration.json").unlink()  # none: the estimator's own
    write_outputs(run, settings)
    assert drawn[0][0] == estimate(results[2].config, settings.workload, settings.hardware)


def test_a_sweep_whose_every_trial_failed_says_to_fix_it_not_to_run_more(settings):
    # A script crashing at step 3 in every trial: "run more trials" would crash them too.
    from autotune.outputs.report import no_fit_verdict

    crashes = [failed("crash", mb, "exit code 1: RuntimeError: boom at step 3\nTraceback ...", i)
               for i, mb in enumerate((1, 2), 1)]
    hung = TrialResult(Config(1, 4, 1, "fp32"), "timeout", memory_budget_bytes=BUDGET, wall_time_s=600.0,
                       backend="deepspeed", error="no step within 600 s", extra={"trial": 3})
    verdict = no_fit_verdict(settings, [*crashes, hung])
    assert "every launched trial failed (2 crashes, 1 timeout; the first: exit code 1: RuntimeError: boom at step 3)" \
        in verdict and verdict.endswith("then start again") and "run more trials" not in verdict
    oom = failed("oom", 8, "peak 2.4 GiB exceeds the budget of 2 GiB", 4, 2.4)  # a verdict on a config: search on
    assert "run more trials" in no_fit_verdict(settings, [*crashes, oom])



def test_a_sweep_no_node_could_run_says_so_not_to_run_more_trials(settings, tmp_path):
    # StopReason.NO_NODE (drivers/ray.py): the cluster, not the budget, kept every trial from running.
    run = RunDir(tmp_path / "run")
    wide = replace(settings, workload=make_workload("tiny", gpus=4))
    run.write_settings(wide)
    outputs = write_outputs(run, wide, [], stop_reason="no node")
    assert outputs.verdict == ("no trial could run: no node of the Ray cluster, nor all its nodes together, has what "
                               "one trial needs (4 ranks, one CPU per rank): run it on a cluster with such nodes, or "
                               "with fewer gpus")
    report = (run.path / "report.md").read_text()
    failures = report.split("## Failures and pruned configs", 1)[1].split("##", 1)[0]
    assert "None: no trial ran, and no node of the Ray cluster has the resources one trial needs" in failures
    assert "every trial ran within the budget" not in report and "run more trials" not in report
