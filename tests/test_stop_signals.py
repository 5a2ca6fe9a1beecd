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


def test_ctrl_c_before_the_headline_is_exit_130_one_line_and_the_same_command_starts_over(tmp_path, monkeypatch,
                                                                                          capsys):
    from autotune import api
    from autotune.cli import main

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    argv = ["tune", "--backend", "simulated", "--strategy", "random", "--trials", "2", "--out", str(tmp_path / "run")]
    with monkeypatch.context() as patched:
        patched.setattr(api, "hold", interrupt)  # the run directory's lock: before the sweep's headline
        assert main(argv) == 130
    out, err = capsys.readouterr()
    assert "stopped after the first trial" not in out + err and err.count("\n") == 1
    assert err.startswith("autotune tune: interrupted before its first trial: nothing was recorded in ")
    with monkeypatch.context() as patched:
        patched.setattr(api, "open_sweep", interrupt)  # after the headline and run.json: no report is written
        assert main(argv) == 130
    out, err = capsys.readouterr()
    assert "interrupted before its first trial" in out and "report:" not in out
    assert main(argv) == 0  # the same command, without --resume


def test_a_sweep_interrupted_before_its_first_trial_is_exit_130_and_the_same_command_starts_it(tmp_path, monkeypatch,
                                                                                                capsys):
    from autotune import api
    from autotune.cli import main

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("defaults: {backend: simulated, strategy: random, trials: 2}\n"
                     "workloads:\n  - {name: a, model: tiny}\n  - {name: b, model: tiny}\n")
    argv = ["sweep", str(sweep), "--out", str(tmp_path / "out")]
    with monkeypatch.context() as patched:
        patched.setattr(api, "open_sweep", interrupt)  # run.json written, nothing recorded
        assert main(argv) == 130
    capsys.readouterr()
    assert (tmp_path / "out" / "a" / "run.json").is_file()
    assert "a | tiny" in (tmp_path / "out" / "sweep_summary.md").read_text()  # each workload's row, as it stands

    class Reached(Exception):
        pass

    def reached(plans, **kwargs):
        raise Reached  # the runner: the same command was not refused ("already holds this sweep")

    with monkeypatch.context() as patched:
        patched.setattr(api, "tune_many", reached)
        assert main(argv) == 1
    assert "internal error: Reached" in capsys.readouterr().err


def test_a_ctrl_c_swallowed_by_a_finalizer_is_raised_again():
    """A Ctrl-C that landed in a weakref callback run by the garbage collector was printed as 'Exception ignored'
    and lost: a sweep ran on to its end and exited 0 (a reviewer's `autotune sweep`, SIGINT at 1 s)."""
    import gc

    class Finalized:
        def __del__(self):
            raise KeyboardInterrupt  # as a SIGINT arriving while the collector runs it

    before = sys.unraisablehook
    with pytest.raises(KeyboardInterrupt):
        with stop_signals_as_interrupt():
            Finalized()
            gc.collect()
            deadline = time.monotonic() + 30  # the SIGINT sent again (after 0.05 s) is met at a step of this loop
            while time.monotonic() < deadline:
                time.sleep(0.01)
    assert sys.unraisablehook is before
