"""`--json` on every command that reports: stdout holds exactly one JSON document (json.loads of the whole
of it), with what the tables say, built from the library's values; progress goes to stderr; bad input is
still one line on stderr and exit 2, with nothing on stdout. Simulated and replay backends (fast); `trial
--json` runs real DeepSpeed trials in tests/test_trial_cli.py and test_script_real.py, `sweep --json` a real
Ray cluster in tests/test_ray_cluster.py, `rl train/export --json` RLlib in tests/test_rl_training.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import build_parser
from autotune.search.pruning import CAUSES
from autotune.values.results import STATUSES, read_results
from cli_run import cli

SPACE = """zero_stage: [0, 1, 2]
micro_batch: [4, 8]
ckpt_interval: [0]
precision: [fp32, bf16]
offload_optimizer: [none]
offload_param: [none]
"""
REPORTING = (["estimate"], ["tune"], ["report"], ["trial"], ["surface", "show"], ["surface", "record"], ["sweep"],
             ["rl", "train"], ["rl", "export"])


@pytest.fixture(scope="module")
def space_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("space") / "small.yaml"
    path.write_text(SPACE)
    return path


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> tuple[Path, dict, str]:
    """`autotune tune --json` as a user runs it: its own process, stdout a pipe."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    run = subprocess.run([sys.executable, "-m", "autotune.cli", "tune", "--model", "tiny", "--backend", "simulated",
                          "--strategy", "optuna", "--trials", "5", "--memory-budget", "0.85GiB", "--seed", "3",
                          "--out", str(out), "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, json.loads(run.stdout), run.stderr


def test_every_reporting_command_has_json(capsys):
    parser = build_parser()
    for command in REPORTING:
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--help"])
        assert "--json" in capsys.readouterr().out, command


def test_tune_json_holds_the_recommendation_budget_counts_and_files(tuned):
    out, doc, err = tuned
    results = read_results(out / "trials.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert doc["run_dir"] == str(out) and doc["report"] == str(out / "report.md")
    assert doc["stop_reason"] == "trials" and doc["stopped"] == "trial budget spent"
    assert doc["summary"] == summary and doc["status_counts"] == summary["status_counts"]
    assert set(doc["status_counts"]) == set(STATUSES)
    assert doc["recorded"] == len(results) and doc["launched"] == sum(r.status != "pruned" for r in results) == 5
    assert doc["memory_budget_bytes"] == int(0.85 * 2**30)
    assert doc["budget"] == {"trials": 5, "time_s": None, "confirm": None, "stop_when": 0.05, "train_s": None}
    assert doc["strategy"] == "optuna" and doc["backend"] == "simulated" and doc["mlflow"] is None
    best = doc["best"]
    assert best["config"] == summary["best"]["config"]
    assert best["throughput_samples_per_s"] == summary["best"]["throughput_samples_per_s"] > 0
    assert 0 < best["peak_memory_bytes"] <= doc["memory_budget_bytes"]
    assert best["trial"] == summary["best_trial_index"] and best["label"] in doc["verdict"]
    assert set(doc["recommended"]) >= {"best_ds_config.json", "best_hf_ds_config.json"}
    for path in (*doc["recommended"].values(), *doc["files"]):
        assert Path(path).is_file()
    ds = json.loads(Path(doc["recommended"]["best_ds_config.json"]).read_text())
    assert ds["train_micro_batch_size_per_gpu"] == best["config"]["micro_batch"]
    # The progress a person reads went to stderr.
    assert "trial   1/5" in err and "recommended" in err


def test_report_json_matches_what_tune_printed(tuned, capfd):
    out, doc, _ = tuned
    code, stdout, err = cli(["report", str(out), "--json"], capfd)
    assert code == 0, err
    report = json.loads(stdout)
    for key in ("run_dir", "verdict", "best", "summary", "status_counts", "recommended", "report",
                "memory_budget_bytes"):
        assert report[key] == doc[key], key
    assert sorted(report["files"]) == sorted(doc["files"])
    # What report.md's tables say: the top configs (the best first) and the failures by cause.
    top, text = report["top_configs"], Path(report["report"]).read_text()
    assert top and top[0]["config"] == doc["best"]["config"] and top[0]["rank"] == 1
    assert top[0]["throughput_samples_per_s"] == doc["best"]["throughput_samples_per_s"]
    assert f"## Top {len(top)} config" in text and all(f"| {t['trial']} |" in text for t in top)
    failed = sum(n for s, n in doc["status_counts"].items() if s != "ok")
    assert sum(f["count"] for f in report["failures"]) == failed
    for f in report["failures"]:
        assert f["count"] == len(f["trials"]) == len(f["configs"]) and f["status"] != "ok"
        assert f["ran_out_of"] is None or f["ran_out_of"] in CAUSES


def test_surface_record_show_and_replay_tune_in_json(space_file, tmp_path, capfd):
    surface = tmp_path / "surface.jsonl"
    code, stdout, err = cli(["surface", "record", "--model", "tiny", "--hardware", "cpu", "--space", str(space_file),
                             "--backend", "simulated", "--out", str(surface), "--json"], capfd)
    assert code == 0, err
    recorded = json.loads(stdout)
    assert recorded["recorded"] == recorded["total_measured"] == recorded["configs"] == 12
    assert recorded["surface"] == str(surface) and recorded["backend"] == "simulated"
    assert recorded["workload"]["model"]["name"] == "tiny" and recorded["hardware"] == "cpu"
    assert len(read_results(surface)) == 12 and "12 configs recorded now" in err

    code, stdout, err = cli(["surface", "show", str(surface), "--memory-budget", "0.85GiB", "--top", "3", "--json"],
                            capfd)
    assert code == 0, err
    shown = json.loads(stdout)
    assert shown["configs"] == 12 and sum(shown["status_counts"].values()) == 12
    assert shown["memory_budget_bytes"] == int(0.85 * 2**30)
    fastest = shown["fastest"]
    assert [row["rank"] for row in fastest] == [1, 2, 3]
    speeds = [row["throughput_samples_per_s"] for row in fastest]
    assert speeds == sorted(speeds, reverse=True) and all(row["status"] == "ok" for row in fastest)
    assert all(row["peak_memory_bytes"] <= shown["memory_budget_bytes"] for row in fastest)

    run = tmp_path / "replay"
    code, stdout, err = cli(["tune", "--backend", "replay", "--surface", str(surface), "--strategy", "random",
                             "--trials", "12", "--memory-budget", "0.85GiB", "--out", str(run), "--json"], capfd)
    assert code == 0, err
    tuned = json.loads(stdout)
    assert tuned["backend"] == "replay" and tuned["stop_reason"] in ("trials", "done", "converged")
    # every config ran: the recommendation is the surface's optimum (configs tied with it may come first)
    assert tuned["best"]["throughput_samples_per_s"] == fastest[0]["throughput_samples_per_s"]
    assert tuned["best"]["config"] in [row["config"] for row in fastest if row["throughput_samples_per_s"] ==
                                       fastest[0]["throughput_samples_per_s"]]


def test_estimate_json_is_alone_on_stdout(capfd):
    code, stdout, err = cli(["estimate", "--model", "tiny", "--hardware", "cpu", "--top", "2", "--json"], capfd)
    assert code == 0, err
    doc = json.loads(stdout)
    assert len(doc["fit"]) == 2 and doc["fit"][0]["throughput_samples_per_s"] >= doc["fit"][1]["throughput_samples_per_s"]


@pytest.mark.parametrize("argv, named", [
    (["tune", "--backend", "replay", "--json"], "--backend replay needs --surface"),  # in the command (ConfigError)
    (["tune", "--trials", "0", "--json"], "--trials"),  # at parse time (argparse)
    (["report", "/no/such/run", "--json"], "/no/such/run"),
    (["surface", "show", "/no/such/surface.jsonl", "--json"], "/no/such/surface.jsonl"),
    (["tune", "--backend", "simulated", "--mlflow-uri", " ", "--json"], "MLflow tracking URI"),
])
def test_bad_input_with_json_is_one_line_on_stderr_and_nothing_on_stdout(argv, named, tmp_path, capfd):
    code, stdout, err = cli([*argv, *(["--out", str(tmp_path / "run")] if argv[0] == "tune" else [])], capfd)
    assert code == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and named in err
    assert not (tmp_path / "run" / "run.json").exists()
    # stdout is itself again afterwards
    print("after")
    assert capfd.readouterr().out == "after\n"
