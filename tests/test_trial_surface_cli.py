"""`autotune trial` checks its record file before it launches anything; `autotune surface show --json` carries the
table's notes; `autotune surface record` says true counts; a directory given for a file is named as one. The trials
are faked (DeepSpeedBackend.run) or simulated: no DeepSpeed trial runs here."""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

import autotune
from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.backends.simulated import SimulatedBackend
from autotune.cli import main
from autotune.values.results import read_results

TRIAL = ["trial", "--model", "tiny", "--zero-stage", "1", "--micro-batch", "4", "--precision", "fp32",
         "--hardware", "cpu"]

SPACE = """zero_stage: [0, 2]
micro_batch: [2, 4]
ckpt_interval: [0]
precision: [bf16]
"""


@pytest.fixture
def launched(monkeypatch):
    """The configs a trial was launched for (none built, none run: a trial's result is the simulated backend's)."""
    calls: list = []
    simulated = SimulatedBackend(autotune.make_workload("tiny"), autotune.load_hardware("cpu"), 2**34, seed=0)

    def ran(self, config):
        calls.append(config)
        return replace(simulated.run(config), backend="deepspeed")

    monkeypatch.setattr(DeepSpeedBackend, "run", ran)
    monkeypatch.setattr(DeepSpeedBackend, "preflight", lambda self, configs, say: None)
    return calls


def good_line(config_stage: int = 0) -> str:
    simulated = SimulatedBackend(autotune.make_workload("tiny"), autotune.load_hardware("cpu"), 2**34, seed=0)
    return replace(simulated.run(autotune.Config(config_stage, 4, 0, "fp32")), backend="deepspeed").to_json()


# -- 1. `autotune trial`: a record it could not write or read is refused before the trial ----------------------

def test_trial_refuses_a_linked_record_before_launching(tmp_path, launched, capsys):
    run = tmp_path / "run"
    run.mkdir()
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("")
    (run / "trials.jsonl").symlink_to(elsewhere)
    assert main([*TRIAL, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and len(err.strip().splitlines()) == 1, err
    assert launched == [] and not (run / "logs").exists() and elsewhere.read_text() == ""


def test_trial_with_calibrate_refuses_a_bad_record_line_before_launching(tmp_path, launched, capsys):
    run = tmp_path / "run"
    run.mkdir()
    record = run / "trials.jsonl"
    before = good_line() + "\n" + json.dumps({"config": {"zero_stage": 0}, "status": "ok"}) + "\n"
    record.write_text(before)
    assert main([*TRIAL, "--run-dir", str(run), "--calibrate"]) == 2
    err = capsys.readouterr().err
    assert f"{record}:2: not a trial result" in err, err
    assert launched == [] and record.read_text() == before  # nothing ran, nothing appended


def test_trial_with_calibrate_records_and_refits_on_a_good_record(tmp_path, launched, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "trials.jsonl").write_text(good_line(0) + "\n")
    assert main([*TRIAL, "--run-dir", str(run), "--calibrate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(launched) == 1 and len(read_results(run / "trials.jsonl")) == 2
    assert doc["calibration"]["samples"] == 2 and (run / "calibration.json").exists()


# -- 2. `surface show --json` carries what the table says -------------------------------------------------------

def record(space_file: Path, out: Path, *extra: str) -> int:
    return main(["surface", "record", "--model", "tiny", "--space", str(space_file), "--out", str(out),
                 "--backend", "simulated", "--memory-budget", "1GiB", *extra])


@pytest.fixture
def space_file(tmp_path: Path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path


def test_surface_show_json_carries_the_mixed_workloads_and_the_torn_line(space_file, tmp_path, capsys):
    one, two = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert record(space_file, one, "--limit", "2") == 0
    assert record(space_file, two, "--limit", "2", "--global-batch", "32") == 0
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(one.read_text() + two.read_text() + '{"config": {"zero')
    capsys.readouterr()
    assert main(["surface", "show", str(mixed)]) == 0
    table = capsys.readouterr().out
    assert main(["surface", "show", str(mixed), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"] is None and "two workloads" in doc["mixed"]
    assert len(doc["notes"]) == 2 and "incomplete last line" in doc["notes"][0] and "replay refuses" in doc["notes"][1]
    assert all(note in table for note in doc["notes"])


def test_surface_show_json_of_a_plain_surface_has_no_notes(space_file, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert record(space_file, out) == 0
    capsys.readouterr()
    assert main(["surface", "show", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["notes"] == [] and doc["mixed"] is None


# -- 3. `surface record`'s last line says true counts -----------------------------------------------------------

def test_record_with_repeats_counts_trials_not_configs(space_file, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert record(space_file, out, "--repeats", "3") == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"{out}: 12 trials of 4 configs recorded now, 4 of 4 measured 3 times", last
    assert len(read_results(out)) == 12


def test_record_with_configs_counts_them_and_what_the_surface_holds(space_file, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert record(space_file, out, "--limit", "3") == 0
    wanted = tmp_path / "wanted.jsonl"
    configs = {json.dumps(r.config.to_dict()) for r in read_results(out)}
    missing = next(json.dumps(c.to_dict()) for c in (autotune.Config(z, m, 0, "bf16") for z in (0, 2) for m in (2, 4))
                   if json.dumps(c.to_dict()) not in configs)
    wanted.write_text(missing + "\n")
    capsys.readouterr()
    assert record(space_file, out, "--configs", str(wanted), "--json") == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert (f"{out}: 1 config recorded now, 1 of the 1 config of --configs measured; the surface holds 4 of the "
            "space's 4 configs") in captured.err, captured.err
    assert doc["trials"] == 1 and doc["surface_configs"] == 4 and doc["selected"] == 1


# -- 4. a directory where a file is named -----------------------------------------------------------------------

def test_configs_naming_a_directory_says_so(space_file, tmp_path, capsys):
    assert record(space_file, tmp_path / "s.jsonl", "--configs", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "no such file" not in err, err
    assert not os.path.exists(tmp_path / "s.jsonl")
