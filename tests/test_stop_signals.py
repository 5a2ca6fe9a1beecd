"""SIGHUP (the terminal the tuner ran in closed) and SIGTERM end a sweep as Ctrl-C does: the trial in flight
stopped, the outputs written, exit 130, resumable; `nohup` keeps SIGHUP ignored (autotune/trials/interrupts.py)."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.backends.factory import SLEEP_ENV
from autotune.trials.interrupts import stop_signals_as_interrupt


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_is_ctrl_c_within_the_block_and_the_old_handler_comes_back(signum):
    before = signal.getsignal(signum)
    with pytest.raises(KeyboardInterrupt):
        with stop_signals_as_interrupt():
            os.kill(os.getpid(), signum)
            time.sleep(1)  # the handler runs at the next bytecode boundary, well within this
    assert signal.getsignal(signum) is before


def test_an_ignored_sighup_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals_as_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def _tune(out: Path, trials: int, *, stdout, nohup: bool = False) -> subprocess.Popen:
    command = [sys.executable, "-m", "autotune.cli", "tune", "--backend", "simulated", "--strategy", "random",
               "--trials", str(trials), "--memory-budget", "0.85GiB", "--seed", "4", "--out", str(out)]
    return subprocess.Popen(["nohup", *command] if nohup else command, env={**os.environ, SLEEP_ENV: "0.5"},
                            stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait_for_lines(path: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not (path.exists() and path.read_text().count("\n") >= count):
        assert proc.poll() is None and time.monotonic() < deadline, f"{path}: not {count} lines"
        time.sleep(0.05)


@pytest.mark.slow  # two simulated sweeps of 0.5 s trials: ~8 s
def test_a_closed_terminal_ends_the_sweep_with_its_outputs_written_and_nohup_outlives_it(tmp_path):
    run = tmp_path / "run"
    master, slave = pty.openpty()  # the tuner's terminal
    proc = _tune(run, 12, stdout=slave)
    os.close(slave)
    try:
        _wait_for_lines(run / "trials.jsonl", 2, proc)
        proc.send_signal(signal.SIGHUP)  # what the kernel sends when the terminal hangs up...
    finally:
        os.close(master)  # ...and from then on every write to it fails (EIO)
    assert proc.wait(timeout=60) == 130
    stop = json.loads((run / "stop.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert stop["stop_reason"] == "interrupted" and summary["trials"] == len((run / "trials.jsonl").read_text().splitlines())
    assert (run / "report.md").is_file()

    ignored = tmp_path / "nohup"
    with open(tmp_path / "nohup.out", "w") as log:
        proc = _tune(ignored, 4, stdout=log, nohup=True)
        _wait_for_lines(ignored / "trials.jsonl", 1, proc)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0
    assert json.loads((ignored / "stop.json").read_text())["stop_reason"] == "trials"
