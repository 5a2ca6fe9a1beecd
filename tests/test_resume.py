"""Kill the tuner (SIGKILL at a random point, Ctrl-C, SIGTERM) and resume: no trial lost or repeated."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest

from autotune.cli import main
from autotune.backends.factory import SLEEP_ENV
from autotune.values.config import KNOBS, Config
from autotune.values.results import read_results
from autotune.search.rundir import RunDir
from autotune.strategies.optuna_search import STUDY_NAME

TRIALS = 8
SLEEP_S = "0.25"


def tune_command(out: Path, strategy: str) -> list[str]:
    return [sys.executable, "-m", "autotune.cli", "tune", "--backend", "simulated", "--strategy", strategy,
            "--trials", str(TRIALS), "--memory-budget", "0.85GiB", "--seed", "4", "--out", str(out)]


def start(out: Path, strategy: str, sleep_s: str = SLEEP_S) -> subprocess.Popen:
    env = {**os.environ, SLEEP_ENV: sleep_s}
    return subprocess.Popen(tune_command(out, strategy), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= count:
            return
        assert proc.poll() is None, f"tuner ended early: {proc.stdout.read()}"
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {count} lines")


def running_configs(run: Path) -> list[Config]:
    """Configs of the trials the killed tuner left RUNNING in its study."""
    choices = RunDir(run).read_settings().choices
    study = optuna.load_study(study_name=STUDY_NAME, storage=RunDir(run).storage())
    out = []
    for trial in study.get_trials(states=[optuna.trial.TrialState.RUNNING]):
        p = trial.params
        if len(p) < len(KNOBS):
            continue  # killed while the sampler was still filling in the parameters: nothing was in flight
        out.append(Config(**{k: choices.knob_values(k)[p[f"{k}_index"]] if f"{k}_index" in p else p[k] for k in KNOBS}))
    return out


def tune_in_process(out: Path, strategy: str, *extra: str) -> int:
    return main(tune_command(out, strategy)[3:] + list(extra))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optuna", "random", "grid"])
def test_sigkill_at_a_random_point_then_resume(strategy, tmp_path):
    seed = random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    kill_after, extra_s = rng.randint(1, TRIALS - 2), rng.uniform(0, float(SLEEP_S))
    where = f"(kill point seed {seed}: after {kill_after} lines + {extra_s:.2f} s)"
    run = tmp_path / "run"
    proc = start(run, strategy)
    wait_for_lines(run / "trials.jsonl", kill_after, proc)
    time.sleep(extra_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = read_results(run / "trials.jsonl")
    in_flight = running_configs(run) if strategy == "optuna" else []

    assert tune_in_process(run, strategy, "--resume") == 0
    after = read_results(run / "trials.jsonl")
    assert after[: len(before)] == before, f"recorded trials changed {where}"
    configs = [r.config for r in after]
    assert len(configs) == len(set(configs)), f"a config ran twice {where}"
    assert sum(r.status != "pruned" for r in after) == TRIALS, where
    assert [r.extra["trial"] for r in after] == list(range(1, len(after) + 1))
    if strategy == "optuna":
        # At most one trial was in flight; unless its result was recorded before the kill, it runs first.
        assert len(in_flight) <= 1, where
        pending = [c for c in in_flight if c not in {r.config for r in before}]
        if pending:
            assert after[len(before)].config == pending[0], where
        states = {t.state for t in optuna.load_study(study_name=STUDY_NAME, storage=RunDir(run).storage()).get_trials()}
        assert optuna.trial.TrialState.RUNNING not in states
    # The same seed, the same sweep: the resumed sweep is the sweep that was never interrupted (Optuna's study keeps
    # its samplers' random state; tests/test_resume_same_sweep.py interrupts each strategy at chosen trials).
    assert tune_in_process(tmp_path / "reference", strategy) == 0
    reference = [r.config for r in read_results(tmp_path / "reference" / "trials.jsonl")]
    # Which session parted from the reference, if one did (once under load, seed 155330: the second config).
    labels = [c.label() for c in in_flight]
    assert [r.config for r in before] == reference[:len(before)], f"the killed session's own trials differ {where}"
    assert configs == reference, f"the resumed trials differ (in flight at the kill: {labels}) {where}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trials"] == len(after)
    # The seconds spent before the kill are kept, beside the resumed session's.
    assert summary["trial_seconds"] == pytest.approx(sum(r.wall_time_s for r in after), abs=0.06)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_stops_cleanly_and_resume_finishes(sig, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setenv(SLEEP_ENV, "1")

    def interrupt_third_trial() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                (run / "trials.jsonl").exists() and (run / "trials.jsonl").read_text().count("\n") >= 2):
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(os.getpid(), sig)  # as the terminal (Ctrl-C) or a process manager (SIGTERM) would

    killer = threading.Thread(target=interrupt_third_trial)
    killer.start()
    code = tune_in_process(run, "optuna")
    killer.join()
    out = capsys.readouterr().out
    assert code == 130, out
    assert out.count(f"continue it with the same command and --resume --out {run}") == 1  # said once
    assert "recommended config:" not in out and "best so far" in out  # no recommendation of an unfinished sweep
    before = read_results(run / "trials.jsonl")
    assert len(before) == 2  # the interrupted trial is not recorded...
    assert (run / "summary.json").is_file() and (run / "report.md").is_file()  # ...the outputs are written
    monkeypatch.delenv(SLEEP_ENV)
    assert tune_in_process(run, "optuna", "--resume") == 0
    after = read_results(run / "trials.jsonl")
    assert after[:2] == before and sum(r.status != "pruned" for r in after) == TRIALS
    assert len({r.config for r in after}) == len(after)


@pytest.mark.slow
def test_a_second_live_tuner_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    proc = start(run, "random", sleep_s="1")
    try:
        wait_for_lines(run / "trials.jsonl", 1, proc)
        code = main(["tune", "--backend", "simulated", "--strategy", "random", "--trials", str(TRIALS),
                     "--memory-budget", "0.85GiB", "--seed", "4", "--out", str(run), "--resume"])
        err = capsys.readouterr().err
        assert code == 2
        assert f"is in use by another tuner (pid {proc.pid})" in err and err.count("\n") == 1
    finally:
        proc.kill()
        proc.wait()
    lines = (run / "trials.jsonl").read_text()
    # Once the holder is gone (even killed), the lock is free again.
    with RunDir(run).locked():
        pass
    assert (run / "trials.jsonl").read_text() == lines
