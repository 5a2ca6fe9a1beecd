"""Every failure named (issue 27): a full disk, an unsatisfiable request, a space narrowed to nothing, a precision
the hardware cannot run, a dead tuner's shared memory, a study.db that is a link or not a database. Each is one
line naming what and why; nothing recorded is changed. The bad inputs themselves are in the corpus too
(tests/bad_inputs/corpus.yaml); here, what the corpus cannot set up: faults injected with the real exception
types, and what must (not) have happened besides the exit code."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import sys
from pathlib import Path

import optuna
import pytest
from sqlalchemy.exc import OperationalError

import autotune.trials.runner as runner
from autotune import files
from autotune.api import TuneSpec, tune
from autotune.values.config import ConfigError
from autotune.values.hardware import load_hardware
from autotune.values.space import Choices, Space
from autotune.values.workload import make_workload

sys.path.insert(0, str(Path(__file__).parent / "bad_inputs"))
import corpus  # noqa: E402  (call_main: the CLI in this process, its exit code and stderr)

SIM = ["tune", "--backend", "simulated", "--strategy", "optuna", "--seed", "1"]
FULL = "database or disk is full"


def lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def sqlite_full() -> OperationalError:
    """What SQLAlchemy raises when SQLite cannot grow the database (SQLITE_FULL)."""
    return OperationalError("INSERT INTO trials (number, study_id, state) VALUES (?, ?, ?)", (0, 1, "RUNNING"),
                            sqlite3.OperationalError(FULL))


def storage_internal_error() -> optuna.exceptions.StorageInternalError:
    """What Optuna's RDBStorage raises for it at a commit: StorageInternalError from the OperationalError."""
    try:
        raise sqlite_full()
    except OperationalError as err:
        try:
            raise optuna.exceptions.StorageInternalError(
                "An exception is raised during the commit. This typically happens due to invalid data in the "
                "commit, e.g. exceeding max length. ") from err
        except optuna.exceptions.StorageInternalError as wrapped:
            return wrapped


# -- a full disk -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("raised", [sqlite_full, storage_internal_error], ids=["OperationalError", "StorageInternalError"])
def test_a_full_study_database_is_one_line_naming_it_and_nothing_is_lost(raised, tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert corpus.call_main([*SIM, "--trials", "2", "--out", str(run)])[0] == 0
    recorded = (run / "trials.jsonl").read_bytes()

    def full(*args, **kwargs):
        raise raised()

    with monkeypatch.context() as patch:
        patch.setattr(optuna.storages.RDBStorage, "_create_new_trial", full)  # under Optuna's cache
        code, stderr = corpus.call_main([*SIM, "--trials", "4", "--out", str(run), "--resume"])
    assert code == 1 and len(lines(stderr)) == 1, stderr
    line = lines(stderr)[0]
    assert str(run / "study.db") in line and "no space left" in line and "internal error" not in line, line
    assert (run / "trials.jsonl").read_bytes() == recorded  # nothing half-written
    code, stderr = corpus.call_main([*SIM, "--trials", "4", "--out", str(run), "--resume"])  # room again: goes on
    assert code == 0, stderr
    after = (run / "trials.jsonl").read_bytes()
    assert after.startswith(recorded) and len(after.splitlines()) == 4


def test_a_full_disk_under_trials_jsonl_names_it_and_leaves_no_torn_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert corpus.call_main([*SIM, "--trials", "2", "--out", str(run)])[0] == 0
    trials = run / "trials.jsonl"
    recorded = trials.read_bytes()
    real_write = os.write

    def write(fd: int, data: bytes) -> int:  # the file system takes 10 bytes of the line, then is full
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(trials.resolve()):
            if os.fstat(fd).st_size == len(recorded):
                return real_write(fd, data[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with monkeypatch.context() as patch:
        patch.setattr(files.os, "write", write)
        code, stderr = corpus.call_main([*SIM, "--trials", "3", "--out", str(run), "--resume"])
    assert code == 1 and len(lines(stderr)) == 1, stderr
    assert str(trials) in lines(stderr)[0] and "no space left" in lines(stderr)[0]
    assert trials.read_bytes() == recorded  # the 10 bytes that fitted were taken back


def test_disk_full_reads_the_exception_chain():
    assert files.disk_full(storage_internal_error()) == (None, FULL)
    assert files.disk_full(OSError(errno.ENOSPC, "No space left on device", "/x/y")) == ("/x/y", "No space left on device")
    assert files.disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))[1] == "Disk quota exceeded"
    assert files.disk_full(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert files.disk_full(optuna.exceptions.StorageInternalError("exceeding max length")) is None


# -- an unsatisfiable request ----------------------------------------------------------------------------

def test_an_unsatisfiable_sweep_is_refused_before_its_run_directory_is_made(tmp_path):
    spec = TuneSpec(make_workload("tiny", 7, 2), load_hardware("cpu"), backend="simulated", trials=2)
    with pytest.raises(ConfigError, match=r"7 / 2"):
        tune(spec, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("choices, workload, named", [
    (Choices(precision=("fp16",)), ("tiny", 16, 1), "precision fp16 is not supported on cpu"),
    (Choices(micro_batch=(4,)), ("tiny", 6, 2), "allowed micro-batches 1, 3"),
    (Choices(ckpt_interval=(99,)), ("tiny", 16, 1), "ckpt_interval 99 exceeds"),
    (Choices(zero_stage=(0,), offload_optimizer=("cpu",)), ("tiny", 16, 1), "offload_optimizer needs zero_stage >= 1"),
])
def test_an_empty_space_says_which_knob_and_why(choices, workload, named):
    space = Space(choices, make_workload(*workload), load_hardware("cpu"))
    with pytest.raises(ConfigError, match=named):
        space.require_configs()
    full = Space(Choices(), make_workload("tiny"), load_hardware("cpu"))
    assert full.empty_reason() is None and full.require_configs() is full


# -- a precision the hardware cannot run -----------------------------------------------------------------

def test_trial_fp16_on_cpu_is_refused_before_anything_is_launched(tmp_path, monkeypatch):
    from autotune.backends.deepspeed import DeepSpeedBackend

    def launched(*args, **kwargs):
        raise AssertionError("a trial was launched")

    monkeypatch.setattr(DeepSpeedBackend, "run", launched)
    monkeypatch.setattr(DeepSpeedBackend, "preflight", launched)
    code, stderr = corpus.call_main(["trial", "--zero-stage", "0", "--micro-batch", "4", "--precision", "fp16",
                                     "--hardware", "cpu", "--run-dir", str(tmp_path / "t")])
    assert code == 2 and len(lines(stderr)) == 1 and "fp16" in stderr and "not supported on cpu" in stderr, stderr
    assert not (tmp_path / "t").exists()


# -- a dead tuner's shared memory ------------------------------------------------------------------------

def test_any_command_start_removes_segments_of_dead_runners_only(tmp_path, monkeypatch):
    from test_procs_robust import claimed_by_a_dead_runner, fake_segments, marker

    dead = claimed_by_a_dead_runner(tmp_path)  # another run's tuner, SIGKILLed: its marker names a gone pid
    dead_segments = fake_segments(dead, tmp_path)
    live = runner.claim_port(tmp_path)  # a live runner (this process): never touched
    live_segments = fake_segments(live, tmp_path)
    monkeypatch.setattr(runner, "SHM_DIR", tmp_path)
    code, _ = corpus.call_main(["surface", "show", str(tmp_path / "none.jsonl")])  # any command, even one refused
    assert code == 2
    assert not any(p.exists() for p in [*dead_segments, marker(dead, tmp_path)])
    assert all(p.exists() for p in [*live_segments, marker(live, tmp_path)])
    runner.release_port(live, tmp_path)


def test_estimate_leaves_shared_memory_alone(tmp_path, monkeypatch):
    from test_procs_robust import claimed_by_a_dead_runner, fake_segments

    segments = fake_segments(claimed_by_a_dead_runner(tmp_path), tmp_path)
    monkeypatch.setattr(runner, "SHM_DIR", tmp_path)
    assert corpus.call_main(["estimate", "--json"])[0] == 0  # runs no trial: not its to clean
    assert all(p.exists() for p in segments)


# -- study.db --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["symlink", "not a database", "folder"])
def test_a_study_db_that_is_a_link_or_not_a_database_is_one_line(how, tmp_path):
    run = tmp_path / "run"
    assert corpus.call_main(["tune", "--backend", "simulated", "--strategy", "random", "--trials", "2",
                             "--out", str(run)])[0] == 0
    study = run / "study.db"
    elsewhere = tmp_path / "elsewhere.db"
    study.rename(elsewhere)
    if how == "symlink":
        study.symlink_to(elsewhere)
    elif how == "folder":
        study.mkdir()
    else:
        study.write_text(json.dumps({"not": "a database"}))
    recorded = (run / "trials.jsonl").read_bytes()
    code, stderr = corpus.call_main(["tune", "--backend", "simulated", "--strategy", "random", "--trials", "3",
                                     "--out", str(run), "--resume"])
    assert code == 2 and len(lines(stderr)) == 1 and str(study) in stderr, stderr
    assert "internal error" not in stderr
    assert (run / "trials.jsonl").read_bytes() == recorded
    assert elsewhere.read_bytes().startswith(b"SQLite format 3")  # the link's target untouched
