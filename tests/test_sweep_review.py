"""`autotune sweep`'s directory holds one sweep: another sweep file's workloads refused (new or --resume), names that
would collide with the directory's own files or with each other (case) refused, an empty file said to be empty; a
resume of a finished sweep runs nothing; `autotune report DIR` of a sweep directory rewrites its summary; `--resume`
without `--out` refused in the library's words. No Ray: the runner is stubbed, run directories written by hand."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import autotune
import autotune.api
from autotune.cli import main
from autotune.commands.sweep_file import load_sweep
from autotune.outputs.report import record_stop
from autotune.outputs.sweep import OWN_NAMES, SUMMARY_CSV, SUMMARY_MD
from autotune.search.rundir import SWEEP_COPY, RunDir
from autotune.values.config import Config, ConfigError
from autotune.values.results import TrialResult

MiB = 2**20
TWO = "defaults: {backend: simulated, trials: 2}\nworkloads:\n  - {name: a}\n  - {name: b}\n"


def write(folder: Path, text: str, name: str = "sweep.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture
def never_runs(monkeypatch):
    """The runner, stubbed: a call is recorded and refused (exit 2), so that a test sees whether Ray would start."""
    calls = []

    def stub(plans, **kwargs):
        calls.append((plans, kwargs))
        raise ConfigError("stub: nothing runs")
    monkeypatch.setattr(autotune.api, "tune_many", stub)
    return calls


def finished_sweep(tmp_path: Path, text: str = TWO, stop: str = "trials") -> tuple[Path, Path]:
    """A sweep file and its directory as a finished `autotune sweep` leaves them: the copy, and each workload's run
    directory with its settings, budget, two trials and stop.json (`stop`: why its session ended)."""
    path = write(tmp_path, text, "mine.yaml")
    out = tmp_path / "out"
    out.mkdir()
    write(out, text, SWEEP_COPY)
    for spec in load_sweep(path).workloads:
        run = RunDir(out / spec.name)
        run.path.mkdir()
        run.write_settings(spec.settings, spec.tune.budget_record())
        budget = spec.settings.memory_budget_bytes
        results = [TrialResult(Config(stage, 8, 0, "bf16"), "ok", throughput_samples_per_s=6.0 + stage,
                               step_time_s=16 / (6.0 + stage), peak_memory_bytes=(800 + stage) * MiB,
                               memory_budget_bytes=budget, wall_time_s=1.0, backend="simulated",
                               extra={"trial": stage + 1}) for stage in (0, 1)]
        for result in results:
            run.append(result)
        record_stop(run, results, stop)
    return path, out


def summary(out: Path) -> list[dict]:
    with open(out / SUMMARY_CSV, newline="") as handle:
        return list(csv.DictReader(handle))


# --- the sweep file (items 3, 4, 9)

@pytest.mark.parametrize("text", ["", "\n", "# nothing yet\n"])
def test_an_empty_sweep_file_is_said_to_be_empty(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    message = str(err.value)
    assert message.startswith(f"{path}: the file is empty: expected a mapping with keys defaults, workloads") \
        and "NoneType" not in message and "\n" not in message


@pytest.mark.parametrize("name", [*OWN_NAMES, "Logs", "SWEEP.yaml", "Sweep_Summary.CSV"])
def test_a_workload_named_as_one_of_the_sweep_directorys_own_files_is_refused(tmp_path, name):
    path = write(tmp_path, f"workloads:\n  - {{name: ok}}\n  - {{name: '{name}'}}\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    message = str(err.value)
    assert message.startswith(f"{path}: workloads[1].name: {name!r}: the sweep directory's own file or folder: allowed "
                              "any name but sweep.yaml, sweep_summary.md, sweep_summary.csv, logs") and "\n" not in message


def test_the_reserved_names_are_what_the_sweep_directory_writes():
    assert {SWEEP_COPY, SUMMARY_MD, SUMMARY_CSV, "logs", "mlflow.db", "mlartifacts"} <= set(OWN_NAMES)


def test_names_that_differ_only_in_case_are_refused(tmp_path):
    path = write(tmp_path, "workloads:\n  - {name: Big}\n  - {name: small}\n  - {name: BIG}\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert str(err.value) == (f"{path}: workloads[2].name: 'BIG': the same as 'Big' but for case, one folder on a "
                              "case-insensitive file system: allowed names that differ in more than case")
    with pytest.raises(ConfigError, match=r"workloads\[1\]\.name: 'a' is used twice"):
        load_sweep(write(tmp_path, "workloads:\n  - {name: a}\n  - {name: a}\n"))


def test_a_name_the_sweep_directory_uses_never_reaches_a_run(tmp_path, never_runs, capsys):
    path = write(tmp_path, "defaults: {backend: simulated, trials: 2}\nworkloads:\n  - {name: sweep_summary.csv}\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "workloads[0].name: 'sweep_summary.csv'" in capsys.readouterr().err
    assert never_runs == [] and not (tmp_path / "out").exists()


# --- one sweep per directory (items 1, 2)

def test_another_sweep_file_into_the_same_directory_is_refused_naming_the_workloads(tmp_path, never_runs, capsys):
    path, out = finished_sweep(tmp_path)
    other = write(tmp_path, "defaults: {backend: simulated, trials: 2}\nworkloads:\n  - {name: c}\n", "other.yaml")
    kept = (out / SWEEP_COPY).read_bytes()
    for extra in ([], ["--resume"]):
        assert main(["sweep", str(other), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{out} holds another sweep ({out / SWEEP_COPY}: workloads a, b), not {other}'s (it lacks a, b; it " \
               "adds c)" in err and "choose another --out" in err and "\n" not in err
    assert never_runs == [] and (out / SWEEP_COPY).read_bytes() == kept and not (out / "c").exists()
    assert not (out / SUMMARY_CSV).exists()


def test_a_resume_with_workloads_left_out_is_refused_naming_them(tmp_path, never_runs, capsys):
    path, out = finished_sweep(tmp_path)
    fewer = write(tmp_path, "defaults: {backend: simulated, trials: 2}\nworkloads:\n  - {name: a}\n", "fewer.yaml")
    assert main(["sweep", str(fewer), "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "(it lacks b)" in err and "a resume continues the same sweep" in err
    assert never_runs == [] and (out / SWEEP_COPY).read_text() == TWO


def test_the_same_workloads_with_resume_pass_the_check(tmp_path):
    from autotune.commands.sweep import check_same_sweep

    path, out = finished_sweep(tmp_path)
    reordered = write(tmp_path, "defaults: {backend: simulated, trials: 5}\nworkloads:\n  - {name: b}\n  - {name: a}\n",
                      "more.yaml")
    check_same_sweep(out, load_sweep(reordered), True)  # the same sweep, a larger budget: no refusal


def test_a_sweep_file_kept_meanwhile_by_another_sweep_is_not_overwritten(tmp_path, monkeypatch, capsys):
    """Two sweeps started together into one directory: the one that gets to write its copy second finds the other's
    and stops there (its copy, and so the summary, stay the first's)."""
    path = write(tmp_path, TWO, "mine.yaml")
    out = tmp_path / "out"
    theirs = "workloads:\n  - {name: c}\n"

    def runner(plans, *, started, **_):
        write(out, theirs, SWEEP_COPY)  # the other sweep's, written after this one's check
        started()
        raise AssertionError("started() let the sweep run")
    monkeypatch.setattr(autotune.api, "tune_many", runner)
    out.mkdir()
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    assert "holds another sweep" in capsys.readouterr().err and (out / SWEEP_COPY).read_text() == theirs


# --- a finished sweep (items 6, 7)

def test_a_resume_of_a_finished_sweep_runs_nothing_and_rewrites_the_summary(tmp_path, never_runs, capsys):
    path, out = finished_sweep(tmp_path)
    assert main(["sweep", str(path), "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert never_runs == []  # no Ray started
    assert f"nothing left to run: every workload of {out} has finished" in printed
    assert "a stopped: trial budget spent; 2 trials launched" in printed
    rows = summary(out)
    assert [(r["workload"], r["trials"], r["recommended"], r["stopped"]) for r in rows] == [
        ("a", "2", "z1 mb8 ck0 bf16", "trial budget spent"), ("b", "2", "z1 mb8 ck0 bf16", "trial budget spent")]
    assert (out / "a" / "report.md").is_file()


@pytest.mark.parametrize("change", ["budget", "interrupted", "tracked"])
def test_a_sweep_with_something_left_goes_to_the_runner(tmp_path, never_runs, change):
    text = TWO.replace("trials: 2", "trials: 3") if change == "budget" else TWO
    path, out = finished_sweep(tmp_path, stop="interrupted" if change == "interrupted" else "trials")
    write(tmp_path, text, "mine.yaml")
    extra = ["--wandb", "p"] if change == "tracked" else []
    if change == "tracked":
        pytest.importorskip("wandb")
    assert main(["sweep", str(path), "--out", str(out), "--resume", *extra]) == 2
    assert len(never_runs) == 1


def test_report_of_a_sweep_directory_rewrites_its_summary(tmp_path, capsys):
    path, out = finished_sweep(tmp_path)
    RunDir(out / "b").settings_path.unlink()
    RunDir(out / "b").trials_path.unlink()  # b: nothing recorded yet
    assert main(["report", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"sweep summary: {out / SUMMARY_MD}" in captured.out and "a: recommended z1 mb8 ck0 bf16" in captured.out
    assert "b: nothing recorded" in captured.err
    assert [r["workload"] for r in summary(out)] == ["a"] and (out / SUMMARY_MD).is_file()


def test_report_of_a_sweep_directory_in_use_writes_nothing(tmp_path, capsys):
    path, out = finished_sweep(tmp_path)
    with RunDir(out / "b").locked():
        assert main(["report", str(out)]) == 2
    assert "is in use by pid" in capsys.readouterr().err
    assert not (out / SUMMARY_CSV).exists() and not (out / "a" / "report.md").exists()


# --- --resume without --out (item 5)

def test_resume_without_out_is_refused_in_the_library_and_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = autotune.TuneSpec(autotune.make_workload("tiny"), "cpu", backend="simulated", trials=1)
    with pytest.raises(ConfigError) as err:
        autotune.tune(spec, resume=True)
    assert str(err.value).startswith("--resume needs --out DIR (the run directory to continue")
    assert main(["tune", "--backend", "simulated", "--trials", "1", "--resume"]) == 2
    assert "--resume needs --out DIR (the run directory to continue" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
