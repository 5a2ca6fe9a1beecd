"""Weights & Biases tracking beside MLflow (autotune/outputs/wandb_tracking.py, issue 43), offline so that it runs here:
a sweep is a group of runs, its parent (job type sweep) holding the settings and the recommendation, a run per
launched trial; a resumed sweep logs only what is missing. The runs are read back from W&B's own offline files."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.values.config import ConfigError

pytest.importorskip("wandb")  # the wandb extra, which the suite installs (scripts/test)

@pytest.fixture(autouse=True)
def fresh_wandb_session():
    """Each test its own W&B session: one an earlier test of this process left may name a service that is gone
    ("Failed to connect to service on socket", seen in CI), and W&B reads its settings once per session."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


BLOCK = 32768  # W&B's .wandb files are LevelDB logs: 32 KiB blocks of records, each a protobuf Record


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a record header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            return  # a record still being written
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def offline_runs(run_dir: Path, wait_s: float = 20.0) -> list[dict]:
    """Each offline run folder's run: its id, group, job type, name, config and summary as recorded. W&B's service
    process writes the files after `finish` returns: a file without its run record yet is read again, for up to
    `wait_s` (a loaded CI machine once read one before its first record was written)."""
    deadline = time.monotonic() + wait_s
    while True:
        runs = _offline_runs(run_dir)
        if all("job" in r for r in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def _offline_runs(run_dir: Path) -> list[dict]:
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        run: dict = {"config": {}, "summary": {}}
        for record in records(next(folder.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                run.update(id=r.run_id, group=r.run_group, job=r.job_type, name=r.display_name)
                run["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "summary":
                run["summary"].update({(u.key or ".".join(u.nested_key)): json.loads(u.value_json)
                                       for u in record.summary.update})
        runs.append(run)
    return runs


@pytest.mark.slow  # two simulated sweeps and eight W&B runs: ~9 s
def test_a_sweep_is_a_group_of_a_parent_and_its_trials_and_a_resume_logs_only_the_new_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    argv = ["tune", "--backend", "simulated", "--strategy", "random", "--seed", "3", "--wandb", "proj", "--out", str(run)]
    assert main([*argv, "--trials", "3"]) == 0
    runs = offline_runs(run)
    trials = [r for r in runs if r["job"] == "trial"]
    (parent,) = [r for r in runs if r["job"] == "sweep"]
    assert len(trials) == 3 and {r["group"] for r in runs} == {"run"}
    recorded = [json.loads(line) for line in (run / "trials.jsonl").read_text().splitlines()]
    launched = [r for r in recorded if r["status"] != "pruned"]
    assert sorted(r["summary"]["trial"] for r in trials) == [r["trial"] for r in launched]
    first = next(r for r in trials if r["summary"]["trial"] == launched[0]["trial"])
    assert first["config"]["zero_stage"] == launched[0]["config"]["zero_stage"]
    assert first["summary"]["throughput_samples_per_s"] == pytest.approx(launched[0]["throughput_samples_per_s"])
    summary = json.loads((run / "summary.json").read_text())
    assert parent["config"]["strategy"] == "random" and parent["summary"]["stop_reason"] == "trials"
    assert parent["summary"]["best.config"] == config_label(summary) and parent["summary"]["trials_recorded"] == 3
    saved = run / "wandb" / parent_folder(run, parent["id"]) / "files"
    assert (saved / "report.md").is_file() and (saved / "plots" / "best_so_far.png").is_file()  # the outputs
    assert (saved / "trials.jsonl").read_text() == (run / "trials.jsonl").read_text()  # and the record
    # Copies, not W&B's symlinks: the next session's outputs do not show through, nor does a synced copy dangle.
    assert not (saved / "report.md").is_symlink()
    first_report = (saved / "report.md").read_text()
    assert first_report == (run / "report.md").read_text()
    # Resumed to 5 trials: the two new ones logged, none again; the parent continues (the same id).
    assert main([*argv, "--trials", "5", "--resume"]) == 0
    assert (saved / "report.md").read_text() == first_report != (run / "report.md").read_text()
    again = offline_runs(run)
    assert not any(r["summary"].get("logged_late") for r in again)  # each logged in the session that ran it
    assert len([r for r in again if r["job"] == "trial"]) == 5
    assert {r["id"] for r in again if r["job"] == "sweep"} == {parent["id"]}
    assert json.loads((run / "wandb.json").read_text())["proj"]["logged"] == [
        r["trial"] for r in map(json.loads, (run / "trials.jsonl").read_text().splitlines()) if r["status"] != "pruned"]


def config_label(summary: dict) -> str:
    from autotune.values.config import Config

    return Config.from_dict(summary["best"]["config"]).label()


def parent_folder(run: Path, run_id: str) -> str:
    return sorted(p.name for p in (run / "wandb").glob(f"offline-run-*-{run_id}"))[-1]


def test_mlflow_refusing_leaves_no_wandb_state_and_wandb_failing_ends_mlflow_failed(tmp_path, monkeypatch):
    """Both trackers on: MLflow's store is opened first (it is the one that refuses), so a refusal leaves no W&B
    state in the run directory; W&B failing to open after it ends MLflow's parent FAILED, not left RUNNING."""
    from autotune.outputs import tracking, wandb_tracking
    from autotune.search.rundir import RunDir

    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    settings = None  # neither open that runs here reads them

    def refused():
        raise ConfigError("MLflow tracking URI x: refused")

    monkeypatch.setattr(tracking.MlflowTracker, "open", classmethod(lambda cls, *a, **k: refused()))
    with pytest.raises(ConfigError, match="refused"):
        with tracking.tracked("x", run_dir, settings, [], warn=print, wandb="proj"):
            pass
    assert not (run_dir.path / wandb_tracking.STATE).exists()

    ended = []

    class Parent:
        final_status = "FINISHED"

        def end(self, status):
            ended.append(status)

    monkeypatch.setattr(tracking.MlflowTracker, "open", classmethod(lambda cls, *a, **k: Parent()))
    monkeypatch.setattr(wandb_tracking.WandbTracker, "open", classmethod(lambda cls, *a, **k: refused()))
    with pytest.raises(ConfigError):
        with tracking.tracked("x", run_dir, settings, [], warn=print, wandb="proj"):
            pass
    assert ended == ["FAILED"]


def test_a_project_name_is_checked_and_a_missing_wandb_named(monkeypatch):
    import importlib.util

    from autotune.outputs.wandb_tracking import check_project

    for name in ("a/b", "x:y", "a#1", "50%", "q?", "a\\b", "p" * 129):  # what W&B refuses, after the sweep ran
        with pytest.raises(ConfigError, match="allowed a project name of at most 128 characters, none of "):
            check_project(name)
    check_project("p" * 128)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--wandb \(`wandb`\) proj: W&B tracking needs wandb: pip install 'ds-autotune\[wandb\]'"):
        check_project("proj")


@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    """No W&B credentials anywhere wandb looks (its variables, a netrc, its settings files under HOME), a W&B
    session that reads them afresh (wandb reads its settings once per process), and no login prompt: one fails
    the test."""
    import wandb
    from wandb.sdk.lib.wbauth import prompt

    for name in [n for n in os.environ if n.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))  # not there
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")

    def never(*args, **kwargs):
        raise AssertionError("W&B's login prompt")

    monkeypatch.setattr(prompt, "prompt_and_save_api_key", never)
    wandb.teardown()
    yield home
    wandb.teardown()


@pytest.mark.slow  # a simulated sweep of two trials and three W&B runs: ~6 s
def test_without_an_api_key_the_runs_are_written_offline_and_one_line_says_how_to_sync(no_wandb_key, tmp_path,
                                                                                       capfd):
    run = tmp_path / "run"
    assert main(["tune", "--backend", "simulated", "--seed", "3", "--trials", "2", "--wandb", "proj",
                 "--out", str(run)]) == 0
    out = capfd.readouterr()
    text = out.out + out.err
    runs = offline_runs(run)
    assert sorted(r["job"] for r in runs) == ["sweep", "trial", "trial"] and {r["group"] for r in runs} == {"run"}
    assert json.loads((run / "wandb.json").read_text())["proj"]["logged"] == [1, 2]
    lines = [line for line in text.splitlines() if line.startswith("W&B project")]
    assert lines == [f"W&B project proj runs offline (no API key configured): its runs stay in {run / 'wandb'}/; "
                     f"after `wandb login` (or with WANDB_API_KEY set), `wandb sync {run / 'wandb'}/offline-run-*` "
                     "uploads them"]
    assert "tracking stopped" not in text and "API key" not in text.replace(lines[0], "")
    # The last lines say where the runs are, as they say MLflow's store.
    assert f"W&B: project proj, group run, offline in {run / 'wandb'}/ (`wandb sync {run / 'wandb'}/offline-run-*` " \
           "uploads them)" in out.out


@pytest.mark.slow  # two simulated sweeps, four W&B runs: ~6 s
def test_trials_of_a_session_without_tracking_are_logged_on_resume_and_marked_late(tmp_path, monkeypatch):
    """trials.jsonl keeps no clock time: a trial logged in a later session says so (its run's times are the
    logging's)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    argv = ["tune", "--backend", "simulated", "--strategy", "random", "--seed", "3", "--out", str(run)]
    assert main([*argv, "--trials", "2"]) == 0
    assert main([*argv, "--trials", "3", "--resume", "--wandb", "proj"]) == 0
    trials = {r["summary"]["trial"]: r["summary"] for r in offline_runs(run) if r["job"] == "trial"}
    assert sorted(trials) == [1, 2, 3]
    assert [bool(trials[n].get("logged_late")) for n in (1, 2, 3)] == [True, True, False]


def test_a_key_in_the_environment_or_the_netrc_is_online_and_wandb_mode_offline_says_so(no_wandb_key, monkeypatch):
    import wandb
    from urllib.parse import urlsplit

    from autotune.outputs.wandb_tracking import offline_reason
    from wandb.sdk import wandb_setup

    assert offline_reason() == "no API key configured"
    host = urlsplit(wandb_setup.singleton().settings.base_url).netloc
    (no_wandb_key / ".netrc").write_text(f"machine {host}\n  login user\n  password {'a' * 40}\n")
    assert offline_reason() is None  # `wandb login`'s entry
    (no_wandb_key / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "b" * 40)
    wandb.teardown()
    assert offline_reason() is None
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb.teardown()
    assert offline_reason() == "WANDB_MODE=offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    wandb.teardown()
    assert offline_reason() is None  # nothing logged at all: W&B's no-op runs


@pytest.mark.slow  # two simulated sweeps, five W&B runs: ~8 s
def test_a_trial_interrupted_while_it_is_logged_is_one_run_after_the_resume(tmp_path, monkeypatch):
    """Each attempt at a trial's run had a random id: a Ctrl-C (or SIGKILL) while W&B logged it left a partial run
    in the group, some without even a run record, which the printed `wandb sync` picked up, and the resume added a
    second run for the trial. A trial's id is now the same in every session, and partial folders are dropped."""
    import wandb

    from autotune.outputs import wandb_tracking

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    argv = ["tune", "--backend", "simulated", "--strategy", "random", "--seed", "3", "--wandb", "proj", "--out", str(run),
            "--trials", "3"]
    real = wandb_tracking.WandbTracker._init

    def interrupted(self, job, name, run_id, config):
        started = real(self, job, name, run_id, config)
        if job == "trial" and name.startswith("#2 "):
            raise KeyboardInterrupt  # the run started, its values not logged yet
        return started

    monkeypatch.setattr(wandb_tracking.WandbTracker, "_init", interrupted)
    assert main(argv) == 130
    monkeypatch.undo()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # the process ends: W&B finishes what it left running
    parent_id = json.loads((run / "wandb.json").read_text())["proj"]["parent_id"]
    assert [r["summary"]["trial"] for r in offline_runs(run) if r["job"] == "trial"] == [1]  # nothing to sync of #2
    # What a SIGKILL during wandb.init leaves: a folder of trial 2's run with no run record.
    partial = run / "wandb" / f"offline-run-20260101_000000-{parent_id}-2"
    partial.mkdir()
    (partial / f"run-{parent_id}-2.wandb").write_bytes(b":W&B\x00\x00\x00")
    assert main([*argv, "--resume"]) == 0
    runs = [r for r in offline_runs(run) if r["job"] == "trial"]
    assert sorted(r["id"] for r in runs) == [f"{parent_id}-{n}" for n in (1, 2, 3)] and not partial.exists()
    trials = {r["id"]: r["summary"] for r in runs}
    assert [bool(trials[f"{parent_id}-{n}"].get("logged_late")) for n in (1, 2, 3)] == [False, True, False]
    assert json.loads((run / "wandb.json").read_text())["proj"]["logged"] == [1, 2, 3]
