"""`autotune tune` and `autotune report` end to end on the simulated backend, bad flags, pruning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.outputs.handoff import validate
from autotune.prediction.estimate import estimate
from autotune.values.hardware import PROFILES
from autotune.values.results import STATUSES, read_results
from autotune.search.rundir import RunDir
from autotune.values.workload import make_workload
from cli_run import cli

GiB = 2**30
SUMMARY_KEYS = {"best", "trials", "best_trial_index", "strategy", "memory_budget_bytes", "status_counts", "trial_seconds",
                "trial_seconds_to_best"}
PLOTS = ("throughput_vs_memory.png", "best_so_far.png", "memory_breakdown.png")


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "tiny-optuna"
    assert main(["tune", "--model", "tiny", "--memory-budget", "0.85GiB", "--strategy", "optuna", "--trials", "8",
                 "--backend", "simulated", "--seed", "1", "--out", str(out)]) == 0
    return out


def test_simulated_tune_writes_every_output(simulated_run):
    for name in ("run.json", "trials.jsonl", "study.db", "best_ds_config.json", "best_hf_ds_config.json",
                 "summary.json", "report.md", *(f"plots/{p}" for p in PLOTS)):
        assert (simulated_run / name).is_file(), name
    for plot in PLOTS:
        assert (simulated_run / "plots" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = read_results(simulated_run / "trials.jsonl")
    summary = json.loads((simulated_run / "summary.json").read_text())
    # the chance of a better config as the sweep went, and why it stopped (api.close_sweep's reason)
    assert set(summary) == SUMMARY_KEYS | {"convergence", "stop_reason", "stopped"}
    assert summary["stop_reason"] == "trials"
    assert summary["trials"] == len(results)
    assert sum(r.status != "pruned" for r in results) == 8
    assert summary["strategy"] == "optuna" and summary["memory_budget_bytes"] == int(0.85 * GiB)
    assert summary["status_counts"] == {s: sum(r.status == s for r in results) for s in STATUSES}
    fitting = [r for r in results if r.fits(int(0.85 * GiB))]
    # the fastest; an exact tie (z0 and z1 here) to the lower peak, then the smaller config (confirm.candidates)
    best = min(fitting, key=lambda r: (-r.throughput_samples_per_s, r.peak_memory_bytes, r.config))
    assert summary["best"] == {"config": best.config.to_dict(), "throughput_samples_per_s": best.throughput_samples_per_s,
                               "peak_memory_bytes": best.peak_memory_bytes}
    assert results[summary["best_trial_index"] - 1] == best
    ds = json.loads((simulated_run / "best_ds_config.json").read_text())
    validate(ds)  # DeepSpeed's own parser
    assert ds["train_micro_batch_size_per_gpu"] == best.config.micro_batch
    assert ds["zero_optimization"]["stage"] == best.config.zero_stage
    hf = json.loads((simulated_run / "best_hf_ds_config.json").read_text())
    assert hf["train_batch_size"] == 16 and hf["train_micro_batch_size_per_gpu"] == best.config.micro_batch
    report = (simulated_run / "report.md").read_text()
    assert "## Top" in report and best.config.label() in report and "plots/best_so_far.png" in report


def test_report_command_regenerates_the_outputs(simulated_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(simulated_run, copy, ignore=shutil.ignore_patterns("summary.json", "report.md", "plots", "best_*"))
    code, out, _ = cli(["report", str(copy)], capsys)
    assert code == 0 and "recommended" in out
    assert json.loads((copy / "summary.json").read_text()) == json.loads((simulated_run / "summary.json").read_text())
    assert (copy / "report.md").read_text() == (simulated_run / "report.md").read_text()
    assert all((copy / "plots" / p).is_file() for p in PLOTS) and (copy / "best_ds_config.json").is_file()


def test_report_of_a_folder_without_a_sweep_is_a_usage_error(tmp_path, capsys):
    code, _, err = cli(["report", str(tmp_path)], capsys)
    assert code == 2 and "not a run directory" in err and err.count("\n") == 1


def test_a_sweep_with_no_fitting_config_says_why_and_exits_non_zero(tmp_path, capsys):
    code, out, _ = cli(["tune", "--backend", "simulated", "--strategy", "optuna", "--memory-budget", "300MB", "--trials", "5",
                        "--out", str(tmp_path / "r")], capsys)
    assert code == 1
    workload, hardware = make_workload("tiny"), PROFILES["cpu"]
    smallest = min((estimate(c, workload, hardware) for c in RunDir(tmp_path / "r").read_settings().space()),
                   key=lambda e: e.peak_bytes)
    assert "no config fits the budget of 286 MiB: the smallest predicted peak is" in out
    assert smallest.config.label() in out and f"dominated by {smallest.memory.dominant}" in out
    # tiny's peak is the CPU process's own overhead, which each device has: more devices would not help.
    assert smallest.memory.dominant == "overhead" and "raise the budget (each device has it" in out
    assert "more devices" not in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["best"] is None and summary["best_trial_index"] is None
    assert not (tmp_path / "r" / "best_ds_config.json").exists()


def test_configs_predicted_not_to_fit_are_recorded_as_pruned_and_never_run(tmp_path, capsys):
    # 10 GiB (16 before issue 17): pruning by probability keeps configs predicted a little over the budget
    # until trials narrow their intervals, so a tighter budget makes the far-over configs this test needs.
    budget = 10 * GiB
    code, out, _ = cli(["tune", "--backend", "simulated", "--model", "gpt2-large", "--gpus", "4", "--global-batch", "64",
                        "--hardware", "v100-32gb", "--strategy", "random", "--memory-budget", "10GiB",
                        "--trials", "15", "--seed", "3", "--out", str(tmp_path / "r")], capsys)
    assert code == 0
    results = read_results(tmp_path / "r" / "trials.jsonl")
    pruned = [r for r in results if r.status == "pruned"]
    ran = [r for r in results if r.status != "pruned"]
    assert pruned and len(ran) == 15
    for r in pruned:  # unlikely to fit (by probability, issue 17), or unable to beat the best found
        assert (r.extra["cause"] == "device_memory" and r.extra["fit_probability"] < 0.05
                and "probability" in r.error) or (r.extra["cause"] == "value" and "best found" in r.error)
        assert r.wall_time_s == 0 and r.throughput_samples_per_s is None
        assert r.extra["cause"] != "device_memory" or r.extra["predicted_peak_interval_bytes"][0] > budget
    assert any(r.extra["cause"] == "device_memory" for r in pruned)
    assert "pruned" in out
    assert "| pruned |" in (tmp_path / "r" / "report.md").read_text()


def test_no_trial_within_budget_though_configs_should_fit(tmp_path, capsys):
    code, out, _ = cli(["tune", "--backend", "simulated", "--strategy", "random", "--memory-budget", "0.7GiB",
                        "--trials", "3", "--seed", "2", "--out", str(tmp_path / "r")], capsys)
    assert code == 1
    assert "no trial ran within the budget of 717 MiB, though" in out and "configs are predicted to fit" in out


def test_time_budget_starts_no_trial_expected_to_end_after_it(tmp_path, capsys):
    # The simulated backend's trials of tiny take 40-75 s here: the sweep's expectation (the trial-time model scaled
    # by its own trials) learns that from its first.
    code, out, _ = cli(["tune", "--backend", "simulated", "--strategy", "random", "--memory-budget", "2GiB",
                        "--trials", "50", "--time-budget", "10m", "--out", str(tmp_path / "r")], capsys)
    assert code == 0 and "time budget spent (the next trial would not end within it)" in out
    times = [r.wall_time_s for r in read_results(tmp_path / "r" / "trials.jsonl") if r.status != "pruned"]
    assert len(times) >= 5 and sum(times) <= 600 < sum(times) + max(times)


def test_a_resumed_sweep_keeps_its_seconds(tmp_path, capsys):
    # The first session's one trial takes more than its minute (a sweep's first trial always starts: nothing to
    # judge by before it); resumed with 5, the second counts the first's seconds.
    args = ["tune", "--backend", "simulated", "--strategy", "random", "--memory-budget", "2GiB", "--trials", "50",
            "--out", str(tmp_path / "r")]
    assert cli(args + ["--time-budget", "1m"], capsys)[0] == 0
    first = read_results(tmp_path / "r" / "trials.jsonl")
    assert len(first) == 1 and first[0].wall_time_s > 60
    code, out, _ = cli(args + ["--time-budget", "5m", "--resume"], capsys)
    assert code == 0 and "time budget spent" in out
    times = [r.wall_time_s for r in read_results(tmp_path / "r" / "trials.jsonl")]
    assert len(times) > len(first) and sum(times) <= 300 < sum(times) + max(times)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["trial_seconds"] == pytest.approx(sum(times), abs=0.06)


def test_a_resumed_sweep_without_strategy_goes_on_with_the_one_it_was_started_with(tmp_path, capsys):
    # As a sweep begun under the earlier default (hybrid) and resumed after the default changed: no --strategy.
    args = ["tune", "--backend", "simulated", "--memory-budget", "2GiB", "--out", str(tmp_path / "r")]
    assert cli(args + ["--strategy", "random", "--trials", "2"], capsys)[0] == 0
    code, out, _ = cli(args + ["--trials", "4", "--resume"], capsys)
    assert code == 0 and "was started with --strategy random: it goes on with it" in out
    assert len(read_results(tmp_path / "r" / "trials.jsonl")) == 4
    assert json.loads((tmp_path / "r" / "run.json").read_text())["strategy"] == "random"
    for given in ("grid", "optuna"):  # a flag still must match, the default's value too
        code, _, err = cli(args + ["--strategy", given, "--trials", "5", "--resume"], capsys)
        assert code == 2 and f"strategy: recorded 'random', given '{given}'" in err and err.count("\n") == 1


def test_a_resume_without_budget_flags_goes_on_with_the_last_sessions_budget(tmp_path, capsys):
    # `--resume` alone ran to the default 30 trials, whatever the sweep was given; a flag given wins and is kept.
    args = ["tune", "--backend", "simulated", "--memory-budget", "2GiB", "--stop-when", "0", "--out", str(tmp_path / "r")]
    assert cli(args + ["--trials", "2"], capsys)[0] == 0
    assert cli(args + ["--trials", "4", "--resume"], capsys)[0] == 0
    code, out, _ = cli(["tune", "--backend", "simulated", "--memory-budget", "2GiB", "--out", str(tmp_path / "r"),
                        "--resume"], capsys)
    assert code == 0 and "--resume: as its last session, where no flag says otherwise: --trials 4, --stop-when 0" in out
    assert len(read_results(tmp_path / "r" / "trials.jsonl")) == 4 and "trial budget spent" in out
    assert json.loads((tmp_path / "r" / "run.json").read_text())["budget"]["trials"] == 4


def test_a_resume_refused_for_a_flag_that_narrows_the_space_is_one_line_naming_the_flag_first(tmp_path, capsys):
    args = ["tune", "--backend", "simulated", "--memory-budget", "2GiB", "--trials", "2", "--out", str(tmp_path / "r")]
    assert cli(args, capsys)[0] == 0
    for flag, setting in ((["--stack", "accelerate"], "stack: recorded 'deepspeed', given 'accelerate'; space."),
                          (["--target-gpus", "4"], "target_gpus: recorded None, given 4; space.micro_batch")):
        code, out, err = cli(args + flag + ["--resume"], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and setting in err, (out, err)


def test_a_second_tuner_on_the_same_directory_is_refused(simulated_run, capsys):
    with RunDir(simulated_run).locked():
        code, _, err = cli(["tune", "--model", "tiny", "--strategy", "optuna", "--memory-budget", "0.85GiB", "--trials", "9",
                            "--backend", "simulated", "--seed", "1", "--out", str(simulated_run), "--resume"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "is in use by another tuner (pid" in err


def test_resume_with_other_settings_is_refused(simulated_run, capsys):
    code, _, err = cli(["tune", "--memory-budget", "1GiB", "--trials", "9", "--backend", "simulated", "--seed", "1",
                        "--out", str(simulated_run), "--resume"], capsys)
    assert code == 2 and err.count("\n") == 1 and "memory_budget_bytes" in err and "--resume" in err


def test_a_resume_with_another_model_says_so_first_and_counts_what_follows(simulated_run, capsys):
    code, _, err = cli(["tune", "--backend", "simulated", "--model", "gpt2-small", "--out", str(simulated_run),
                        "--resume"], capsys)
    assert code == 2 and err.count("\n") == 1 and len(err) < 800, err  # not one key of each setting it implies
    assert "other settings (workload.model: recorded 'tiny', given 'gpt2-small'; " in err and " more): " in err


BAD_FLAGS = [
    (["--trials", "0"], "'0'"),
    (["--trials", "many"], "'many'"),
    (["--memory-budget", "2XB"], "2XB"),
    (["--memory-budget=-1GiB"], "-1GiB"),
    (["--strategy", "bayes"], "bayes"),
    (["--backend", "gpu"], "gpu"),
    (["--time-budget", "8y"], "8y"),
    (["--time-budget", "0h"], "0h"),
    (["--seed", "-1"], "-1"),
    (["--seed", "x"], "'x'"),
    (["--model", "gpt5"], "gpt5"),
    (["--hardware", "tpu"], "tpu"),
    (["--gpus", "0"], "'0'"),
    (["--global-batch", "-4"], "-4"),
    (["--space", "no-such-space.yaml"], "no-such-space.yaml"),
    (["--surface", "s.jsonl"], "--surface"),
    (["--backend", "replay"], "--surface"),
    (["--backend", "replay", "--surface", "missing.jsonl"], "missing.jsonl"),
    (["--trails", "3"], "--trails"),
    (["--resume"], "--resume"),
    (["--script-args", "--steps 5"], "--script-args '--steps 5': only with --script"),  # never silently ignored
]


@pytest.mark.parametrize("flags,named", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_every_bad_flag_is_a_one_line_error_with_exit_code_2(flags, named, tmp_path, capsys):
    argv = ["tune", "--backend", "simulated", *flags]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "new")]
    code, out, err = cli(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("autotune") and " error: " in err, err
    assert named in err
    assert not (tmp_path / "new" / "trials.jsonl").exists()


def test_an_existing_sweep_is_not_overwritten_without_resume(simulated_run, capsys):
    before = (simulated_run / "trials.jsonl").read_bytes()
    code, _, err = cli(["tune", "--backend", "simulated", "--out", str(simulated_run)], capsys)
    assert code == 2 and "already holds a sweep" in err and err.count("\n") == 1
    assert (simulated_run / "trials.jsonl").read_bytes() == before


def test_a_folder_a_new_sweep_would_write_over_is_refused_and_left_as_it_was(simulated_run, tmp_path, capsys):
    """Nothing the user keeps there is replaced: their own report.md, a trials.jsonl without the run.json a sweep
    resumes from (autotune trial's, or a sweep's whose settings are gone), `autotune sweep`'s directory; nor does a
    sweep go into a tune run's."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("MY NOTES\n")
    code, _, err = cli(["tune", "--backend", "simulated", "--trials", "2", "--out", str(mine)], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds report.md but no sweep (no run.json)" in err, err
    assert sorted(p.name for p in mine.iterdir()) == ["report.md"] and (mine / "report.md").read_text() == "MY NOTES\n"

    orphan = tmp_path / "orphan"
    shutil.copytree(simulated_run, orphan, ignore=shutil.ignore_patterns("run.json", ".lock"))
    before = (orphan / "trials.jsonl").read_bytes()
    for resume in ([], ["--resume"]):  # neither way a dead end: the line says what to do
        code, _, err = cli(["tune", "--backend", "simulated", "--out", str(orphan), *resume], capsys)
        assert code == 2 and err.count("\n") == 1 and "holds a trials.jsonl but no run.json" in err, err
        assert "restore the sweep's run.json to resume it" in err
    assert (orphan / "trials.jsonl").read_bytes() == before and not (orphan / "run.json").exists()

    swept = tmp_path / "swept"
    swept.mkdir()
    (swept / "sweep.yaml").write_text("workloads:\n  - {name: a}\n")
    code, _, err = cli(["tune", "--backend", "simulated", "--out", str(swept)], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds a batch sweep (sweep.yaml)" in err, err
    assert [p.name for p in swept.iterdir()] == ["sweep.yaml"]
    run_json = (simulated_run / "run.json").read_bytes()
    code, _, err = cli(["sweep", str(swept / "sweep.yaml"), "--out", str(simulated_run)], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds an `autotune tune` run (run.json)" in err, err
    assert (simulated_run / "run.json").read_bytes() == run_json and not (simulated_run / "sweep.yaml").exists()


def test_a_resume_of_nothing_says_to_start_without_resume(tmp_path, capsys):
    # As after a Ctrl-C in a script sweep's first trial: the folder exists, no sweep in it.
    (tmp_path / "r").mkdir()
    code, _, err = cli(["tune", "--backend", "simulated", "--out", str(tmp_path / "r"), "--resume"], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds no sweep to resume" in err
    assert "run the command without --resume" in err


@pytest.fixture(scope="module")
def surface_file(tmp_path_factory) -> Path:
    """A replay surface of the tiny CPU space recorded (without a budget) from the simulated backend."""
    from autotune.backends.simulated import SimulatedBackend
    from autotune.search_spaces import load_choices
    from autotune.values.space import Space

    workload, hardware = make_workload("tiny"), PROFILES["cpu"]
    backend = SimulatedBackend(workload, hardware, 10**12, noise=0.1, seed=2)
    path = tmp_path_factory.mktemp("surface") / "tiny.jsonl"
    lines = []
    for i, config in enumerate(Space(load_choices("cpu"), workload, hardware)):
        if i % 6:  # a sixth of the space measured
            continue
        line = {**backend.run(config).to_dict(), "memory_budget_bytes": None}
        lines.append(json.dumps({**line, "workload": workload.to_dict(), "hardware": "cpu"}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow  # every measured config of the narrowed surface, through the study in SQLite
def test_replay_backend_searches_the_surface_narrowed_by_space(surface_file, tmp_path, capsys):
    from autotune.backends.replay import load_surface

    space = tmp_path / "bf16.yaml"
    space.write_text("zero_stage: [0, 1, 2, 3]\nmicro_batch: [1, 2, 4, 8]\nckpt_interval: [0, 1, 2]\n"
                     "precision: [bf16]\noffload_optimizer: [none, cpu]\noffload_param: [none, cpu]\n")
    out = tmp_path / "r"
    code, printed, _ = cli(["tune", "--backend", "replay", "--surface", str(surface_file), "--space", str(space),
                            "--memory-budget", "0.85GiB", "--strategy", "optuna", "--trials", "200",
                            "--stop-when", "0", "--out", str(out)], capsys)  # the stop off: the whole space
    assert code == 0, printed
    surface = load_surface(surface_file)
    measured_bf16 = {c for c in surface.configs if c.precision == "bf16"}
    results = read_results(out / "trials.jsonl")
    assert {r.config for r in results} == measured_bf16  # every measured bf16 config once, nothing else
    assert f"over {len(measured_bf16)} configs" in printed
    for r in results:
        recorded = surface.results[r.config].under_budget(int(0.85 * GiB))
        if r.status != "pruned":
            assert (r.backend, r.status, r.throughput_samples_per_s) == ("replay", recorded.status,
                                                                         recorded.throughput_samples_per_s)
    best = max((r for r in measured_bf16_results(surface, int(0.85 * GiB))), key=lambda r: r.throughput_samples_per_s)
    assert json.loads((out / "summary.json").read_text())["best"]["config"] == best.config.to_dict()
    settings = RunDir(out).read_settings()
    assert settings.surface == str(surface_file.resolve()) and settings.choices.precision == ("bf16",)


def measured_bf16_results(surface, budget):
    return [r.under_budget(budget) for c, r in surface.results.items()
            if c.precision == "bf16" and r.under_budget(budget).fits(budget)]


@pytest.mark.parametrize("flags, word", [
    (["--hardware", "h100-80gb", "--memory-budget", "800MiB"], "--hardware h100-80gb: the surface"),
    (["--model", "gpt2-small", "--hardware", "a100-40gb"], "--model gpt2-small: the surface"),
])
def test_replay_on_hardware_or_a_model_other_than_the_surfaces_is_refused(surface_file, tmp_path, capsys, flags, word):
    code, _, err = cli(["tune", "--backend", "replay", "--surface", str(surface_file), *flags, "--trials", "3",
                        "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and err.count("\n") == 1 and word in err and "recorded" in err and not (tmp_path / "r").exists()


def test_replay_with_a_workload_other_than_the_surfaces_is_refused(surface_file, tmp_path, capsys):
    code, _, err = cli(["tune", "--backend", "replay", "--surface", str(surface_file), "--global-batch", "32",
                        "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "--global-batch 32" in err and err.count("\n") == 1
