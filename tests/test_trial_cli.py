"""`autotune trial`: bad input is one line and exit 2 before anything runs; one real trial through the CLI."""

import json
import subprocess
import sys

import pytest

from autotune.cli import main
from autotune.values.results import read_results

BASE = ["trial", "--model", "tiny", "--zero-stage", "2", "--micro-batch", "4", "--precision", "fp32"]


@pytest.mark.parametrize("args, named", [
    (["--zero-stage", "5"], "5"),
    (["--micro-batch", "0"], "'0'"),
    (["--precision", "fp8"], "fp8"),
    (["--offload-optimizer", "disk"], "disk"),
    (["--memory-budget", "lots"], "lots"),
    (["--model", "gpt5"], "gpt5"),
    (["--micro-batch", "3"], "micro_batch 3"),  # 16 is not a multiple of 3
    (["--ckpt-interval", "9"], "ckpt_interval 9"),
    (["--offload-param", "cpu"], "offload_param needs zero_stage 3"),
    (["--zero-stage", "0", "--offload-optimizer", "cpu"], "offload_optimizer needs zero_stage >= 1"),
    (["--zero-stage", "3", "--offload-param", "nvme"], "NVMe offload needs an nvme_path"),
    (["--timeout", "0"], "--timeout: duration '0' must be positive"),
    (["--warmup-steps", "-1"], "--warmup-steps: '-1' must be 0 or a positive integer"),
    (["--hardware", "cpu", "--memory-budget", "100TiB"], "memory budget 100 TiB exceeds cpu's"),
    (["--script", __file__, "--hardware", "cpu", "--memory-budget", "100TiB"], "memory budget 100 TiB exceeds cpu's"),
])
def test_bad_input_is_one_line_and_exit_2(args, named, capsys, tmp_path):
    argv = BASE + ["--run-dir", str(tmp_path / "run")] + args
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "run" / "trials.jsonl").exists()  # nothing ran


def test_calibration_of_another_workload_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "calibration.json").write_text(json.dumps({
        "overhead_bytes": 1, "workload": {"model": "gpt2-small", "global_batch": 32, "gpus": 1}}))
    assert main(BASE + ["--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "fitted for another workload" in err and "gpt2-small" in err


@pytest.mark.slow
def test_real_trial_through_the_cli(tmp_path):
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "autotune.cli", *BASE, "--ckpt-interval", "1", "--memory-budget", "2GiB",
            "--global-batch", "4", "--max-steps", "2", "--run-dir", str(run), "--calibrate", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    result, prediction = out["result"], out["prediction"]
    assert result["status"] == "ok" and result["backend"] == "deepspeed"
    assert result["memory_budget_bytes"] == 2 * 2**30 and result["peak_memory_bytes"] < 2 * 2**30
    assert result["config"] == {"zero_stage": 2, "micro_batch": 4, "ckpt_interval": 1, "precision": "fp32",
                                "offload_optimizer": "none", "offload_param": "none"}
    assert prediction["memory"]["total"] > 0 and prediction["throughput_samples_per_s"] > 0
    # Recorded, with its logs, and the run is now calibrated on it.
    (recorded,) = read_results(run / "trials.jsonl")
    assert recorded.throughput_samples_per_s == result["throughput_samples_per_s"]
    assert (run / "logs").is_dir() and list((run / "logs").glob("0001-*/rank0.stderr"))
    saved = json.loads((run / "calibration.json").read_text())
    assert saved["samples"] == 1 == out["calibration"]["samples"]
    assert saved["workload"]["global_batch"] == 4
    # The prediction is the one made before the trial (no calibration yet); the fit on this very trial is apart,
    # and its peak is close.
    assert prediction != out["calibrated_prediction"]
    assert out["calibrated_prediction"]["memory"]["total"] == pytest.approx(result["peak_memory_bytes"], rel=0.1)


def test_an_out_of_memory_trials_peak_is_shown_as_a_bound_without_a_ratio(tmp_path, capsys):
    from autotune.commands.trial import show
    from autotune.prediction.estimate import Calibration, estimate
    from autotune.values.config import Config
    from autotune.values.hardware import PROFILES
    from autotune.values.results import TrialResult
    from autotune.values.workload import make_workload

    config, workload = Config(0, 8, 0, "fp32"), make_workload("tiny", global_batch=16)
    # Stopped at 605 MiB by the watchdog, past a 600 MiB budget: where it was stopped, not its peak.
    result = TrialResult(config, "oom", peak_memory_bytes=605 * 2**20, memory_budget_bytes=600 * 2**20,
                         wall_time_s=9.0, error="rank 0 grew past the memory budget",
                         extra={"peak_memory_growth_bytes": 400 * 2**20, "baseline_memory_bytes": 205 * 2**20})
    show(result, estimate(config, workload, PROFILES["cpu"]), Calibration(), workload, PROFILES["cpu"], tmp_path)
    cells = [[c.strip() for c in line.split("│")] for line in capsys.readouterr().out.splitlines()]
    rows = {row[1]: row[2:] for row in cells if len(row) > 4}
    for name in ("peak memory per device", "growth over baseline"):
        measured, predicted, ratio = rows[name][:3]
        assert measured.startswith(">= ") and predicted and ratio == "", rows[name]  # a bound: no ratio


def test_at_80_columns_the_rows_names_stay_whole(tmp_path, capsys, monkeypatch):
    """A terminal of 80 columns folded 'optimizer_states' and 'allocator_reserve' in two."""
    from autotune.commands.trial import show
    from autotune.prediction.estimate import MEMORY_TERMS, Calibration, estimate
    from autotune.values.config import Config
    from autotune.values.hardware import PROFILES
    from autotune.values.results import TrialResult
    from autotune.values.workload import make_workload

    monkeypatch.setenv("COLUMNS", "80")
    config, workload = Config(0, 8, 0, "fp32"), make_workload("tiny", global_batch=16)
    result = TrialResult(config, "ok", throughput_samples_per_s=4.5, step_time_s=3.5, peak_memory_bytes=500 * 2**20,
                         wall_time_s=75.0, extra={"peak_memory_growth_bytes": 300 * 2**20, "step_time_iqr_s": 0.4,
                                                  "baseline_memory_bytes": 200 * 2**20, "steps_measured": 6,
                                                  "stop_reason": "time_limit", "launch_to_first_step_s": 8.7,
                                                  "steps_applied": 7, "steps_skipped": 0, "loss_first": 8.365,
                                                  "loss_last": 7.914})
    show(result, estimate(config, workload, PROFILES["cpu"]), Calibration(), workload, PROFILES["cpu"], tmp_path)
    names = [line.split("│")[1].strip() for line in capsys.readouterr().out.splitlines() if line.count("│") > 4]
    assert all(len(line) <= 80 for line in names)
    assert {term for term in MEMORY_TERMS} <= set(names)
