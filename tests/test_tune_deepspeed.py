"""`autotune tune --backend deepspeed`: real DeepSpeed trials of the tiny model on the CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.outputs.handoff import validate
from autotune.values.results import read_results
from micro import MICRO_FILE

# No offload: an offloaded optimizer would compile DeepSpeed's CPU Adam (minutes) on first use.
SPACE = """\
zero_stage: [0, 1]
micro_batch: [8]
ckpt_interval: [0]
precision: [fp32]
offload_optimizer: [none]
offload_param: [none]
"""


@pytest.fixture
def space_file(tmp_path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path


@pytest.mark.slow
def test_real_sweep_writes_every_output(space_file, tmp_path, capsys):
    out = tmp_path / "run"
    # Global batch 8: micro-batch 8 without accumulation, one micro-step a step (the outputs do not depend on it).
    code = main(["tune", "--model", MICRO_FILE, "--global-batch", "8", "--backend", "deepspeed", "--space",
                 str(space_file), "--memory-budget", "3GiB", "--strategy", "optuna", "--trials", "2", "--out",
                 str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    results = read_results(out / "trials.jsonl")
    assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
    assert {r.config.zero_stage for r in results} == {0, 1}
    # A local sweep starts the next trial's ranks from its first trial (issue 41): the second's imports were made
    # during the first's, off its clock; none is left when the sweep ends.
    assert results[0].extra["import_ahead_s"] is None and results[1].extra["import_ahead_s"] > 0
    assert not list((out / "logs" / "spares").iterdir())
    for r in results:
        assert r.backend == "deepspeed" and r.throughput_samples_per_s > 0 and r.peak_memory_bytes > 0
        assert Path(r.extra["log_dir"]).parent == out / "logs" and (Path(r.extra["log_dir"]) / "result.json").is_file()
    for name in ("run.json", "study.db", "calibration.json", "summary.json", "report.md", "best_ds_config.json",
                 "best_hf_ds_config.json", "plots/throughput_vs_memory.png", "plots/best_so_far.png",
                 "plots/memory_breakdown.png"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    best = max(results, key=lambda r: r.throughput_samples_per_s)
    assert summary["best"]["config"] == best.config.to_dict() and summary["trials"] == 2
    validate(json.loads((out / "best_ds_config.json").read_text()))
    assert json.loads((out / "calibration.json").read_text())["samples"] == 2
    assert f"recommended config: {out / 'best_ds_config.json'}" in printed and f"report: {out / 'report.md'}" in printed


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_ctrl_c_ends_the_running_trials_processes(space_file, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "autotune.cli", "tune", "--backend", "deepspeed", "--space",
                             str(space_file), "--memory-budget", "3GiB", "--trials", "2", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    trial_processes: set[int] = set()
    deadline = time.monotonic() + 300
    # A trial's log directory (the op preflight before it writes logs/preflight.stderr only).
    while time.monotonic() < deadline and not any(p.is_dir() for p in out.glob("logs/*")):
        time.sleep(0.2)
    time.sleep(3)  # the worker is starting (importing torch and DeepSpeed)
    trial_processes = descendants(proc.pid)
    assert trial_processes, "no trial process was started"
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    time.sleep(0.5)
    assert not [pid for pid in trial_processes if alive(pid)], output
    assert read_results(out / "trials.jsonl") == []  # the interrupted trial is not recorded: --resume runs it
    assert "interrupted" in output
