"""A trial's log folder, `<run-dir>/logs/<NNNN>-<config label>/`, carries the number its result is recorded under in
trials.jsonl (docs/trials.md), whatever order trials in flight together finish in: the deepspeed backend names the
folder at launch after the trials recorded then, and the sweep moves it to the recorded number when it records the
result (autotune.backends.deepspeed.settle_log_dir, from drivers/sweep.py). `-attempt<k>` only for a second folder
of one config at one number (interrupted and resumed, or lost and resubmitted). On a real Ray cluster:
tests/test_script_ray.py's sweep (its trials 2 and 3 in flight together) and tests/test_ray_cluster.py's."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.backends.deepspeed import DeepSpeedBackend, folder_label
from autotune.drivers.loop import Flight, Job, TrialReply, run_jobs
from autotune.drivers.progress import QuietProgress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget, Sweep
from autotune.search.rundir import RunDir, RunSettings
from autotune.search_spaces import load_choices
from autotune.trials.runner import LaunchOptions, RunOutcome
from autotune.values.config import Config
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult, read_results
from autotune.values.workload import make_workload
from autotune.worker.protocol import WorkerSpec

BUDGET = 2**31
FOLDER = re.compile(r"(\d{4,})-(.+?)(-attempt\d+)?")
LAUNCHED: list[str] = []  # the log folder of every trial launched in this process, as named at launch


def settings() -> RunSettings:
    return RunSettings(make_workload("tiny"), PROFILES["cpu"], BUDGET, "random", "deepspeed", 0, load_choices("cpu"))


def fake_ranks(spec: WorkerSpec, options: LaunchOptions) -> RunOutcome:
    """A trial's ranks as the runner's outcome, without a process: a line in the trial's folder, a crash."""
    LAUNCHED.append(spec.log_dir)
    (Path(spec.log_dir) / "rank0.stderr").write_text(f"{spec.config.label()}\n")
    return RunOutcome("crash", f"rank 0 exited with code 1 (see {spec.log_dir}/rank0.stderr)", (None,), 0.1,
                      time.time(), spec.log_dir, (), (1,))


def fake_deepspeed(run_dir: Path) -> DeepSpeedBackend:
    """The deepspeed backend of a run directory whose trials' ranks are `fake_ranks`."""
    s = settings()
    backend = DeepSpeedBackend(s.workload, s.memory_budget_bytes, s.hardware, logs_dir=run_dir / "logs",
                               ranks_ahead=False)
    backend.start_ranks = fake_ranks
    return backend


class Overlapping:
    """An executor with two trials in flight at once: each is launched when submitted (its backend names its log
    folder then, after the trials recorded so far), and the later launch finishes first."""

    def __init__(self, backend: DeepSpeedBackend, slots: int = 2) -> None:
        self.backend, self.slots = backend, slots
        self.flights: list[tuple[Flight, TrialReply]] = []

    def room(self, job: Job) -> bool:
        return len(self.flights) < self.slots

    def submit(self, flight: Flight) -> None:
        self.flights.append((flight, TrialReply(self.backend.run(flight.config))))

    def wait(self) -> tuple[Flight, TrialReply | None]:
        return self.flights.pop()

    def in_flight(self) -> int:
        return len(self.flights)

    def cancel(self) -> None:
        self.flights.clear()


def open_sweep(path: Path) -> tuple[RunDir, Sweep]:
    run = RunDir(path)
    s = settings()
    run.write_settings(s)
    return run, Sweep.open(run, s, s.space())


def check_folders(run: RunDir, launched: int) -> list[TrialResult]:
    """Every launched trial's record names its own folder, numbered as the record; no number shared, no attempt."""
    results = [r for r in read_results(run.trials_path) if r.status != "pruned"]
    assert len(results) == launched
    for r in results:
        folder = Path(r.extra["log_dir"])
        assert folder.parent == run.logs_dir and folder.is_dir(), r.extra["log_dir"]
        assert folder.name == f"{r.extra['trial']:04d}-{folder_label(r.config)}", (folder.name, r.extra["trial"])
        assert (folder / "rank0.stderr").read_text() == f"{r.config.label()}\n"  # its own trial's logs moved with it
        assert json.loads((folder / "result.json").read_text())["log_dir"] == str(folder)
        assert r.error == f"rank 0 exited with code 1 (see {folder}/rank0.stderr)"  # the message names where it is
    folders = sorted(p.name for p in run.logs_dir.iterdir() if p.is_dir() and FOLDER.fullmatch(p.name))
    numbers = [int(FOLDER.fullmatch(name).group(1)) for name in folders]
    assert len(set(numbers)) == len(numbers) == launched, folders
    assert not any("attempt" in name for name in folders), folders
    return results


def test_trials_in_flight_together_get_the_numbers_they_are_recorded_under(tmp_path):
    run, sweep = open_sweep(tmp_path / "run")
    backend = fake_deepspeed(run.path)
    reasons = run_jobs([Job("overlap", sweep, Budget(6, confirm=0), progress=QuietProgress())], Overlapping(backend),
                       concurrency=2)
    assert reasons == {"overlap": StopReason.TRIALS}
    check_folders(run, 6)


def test_one_trial_at_a_time_keeps_the_folder_it_launched_in(tmp_path):
    """A local sweep's trial is recorded under the number its folder was named with at launch: nothing moves."""
    run, sweep = open_sweep(tmp_path / "run")
    backend = fake_deepspeed(run.path)
    LAUNCHED.clear()
    run_jobs([Job("one", sweep, Budget(4, confirm=0), progress=QuietProgress())], Overlapping(backend, slots=1))
    results = check_folders(run, 4)
    assert [r.extra["log_dir"] for r in results] == LAUNCHED


def test_a_second_attempt_at_a_number_is_marked_and_a_foreign_folder_left_alone(tmp_path):
    from autotune.backends.deepspeed import settle_log_dir

    logs = tmp_path / "logs"
    config = Config(2, 4, 0, "fp32")
    # Launched as 0002 (another trial was in flight), recorded third: moved to 0003.
    (logs / "0002-z2_mb4_ck0_fp32").mkdir(parents=True)
    result = TrialResult(config, "crash", error=f"see {logs}/0002-z2_mb4_ck0_fp32/rank0.stderr",
                         extra={"log_dir": str(logs / "0002-z2_mb4_ck0_fp32"), "trial": 3})
    moved = settle_log_dir(result, 3)
    assert moved.extra == {"log_dir": str(logs / "0003-z2_mb4_ck0_fp32"), "trial": 3}
    assert moved.error == f"see {logs}/0003-z2_mb4_ck0_fp32/rank0.stderr"
    assert not (logs / "0002-z2_mb4_ck0_fp32").exists() and (logs / "0003-z2_mb4_ck0_fp32").is_dir()
    # A second attempt at number 3 of that config (the first was interrupted at 3, or lost): -attempt2.
    (logs / "0004-z2_mb4_ck0_fp32").mkdir()
    again = settle_log_dir(replace(result, extra={"log_dir": str(logs / "0004-z2_mb4_ck0_fp32")}), 3)
    assert again.extra["log_dir"] == str(logs / "0003-z2_mb4_ck0_fp32-attempt2")
    # Launched at its number already (one trial at a time, an attempt included): as it is.
    assert settle_log_dir(again, 3) == again
    # Not a folder of this config's trial (a user's objective names its own), or not on this machine: as it is.
    for foreign in (str(tmp_path / "mine"), str(logs / "0005-z0_mb8_ck0_fp32"), str(logs / "0006-z2_mb4_ck0_fp32")):
        other = replace(result, extra={"log_dir": foreign})
        assert settle_log_dir(other, 3) == other
    assert settle_log_dir(replace(result, extra={}), 3).extra == {}


def test_a_crash_after_the_move_before_the_record_loses_nothing(tmp_path):
    """The folder is moved before the record is appended: a tuner killed in between leaves it under its number,
    and the resumed trial at that number, of the same config, is its -attempt2."""
    run, sweep = open_sweep(tmp_path / "run")
    backend = fake_deepspeed(run.path)
    config = next(c for c in settings().space() if sweep.pruner.check(c, "deepspeed") is None)
    first = backend.run(config)

    def killed(result: TrialResult) -> None:
        raise KeyboardInterrupt  # as a SIGKILL between the move and the append

    sweep._record = killed
    with pytest.raises(KeyboardInterrupt):
        sweep.finish(config, first)
    assert not run.trials_path.exists()
    kept = run.logs_dir / f"0001-{folder_label(config)}"
    assert (kept / "rank0.stderr").is_file()
    run, sweep = open_sweep(tmp_path / "run")  # resumed
    recorded = sweep.finish(config, backend.run(config))
    assert Path(recorded.extra["log_dir"]).name == f"0001-{folder_label(config)}-attempt2"
    assert read_results(run.trials_path)[0].extra["log_dir"] == recorded.extra["log_dir"]
    assert (kept / "rank0.stderr").is_file()


def test_a_first_trial_run_again_after_an_interrupt_is_number_one_again(tmp_path):
    """A run directory whose first trial was interrupted before anything was recorded (a script's first trial) keeps
    that attempt's folder; the same command's first trial is 0001 again (-attempt2 for the same config), and the
    second is 0002: no two trials recorded under one number (a reviewer's logs held 0001 stale, then trials 1 and 2
    both at 0002)."""
    run, sweep = open_sweep(tmp_path / "run")
    backend = fake_deepspeed(run.path)
    configs = [c for c in settings().space() if sweep.pruner.check(c, "deepspeed") is None][:2]
    (run.logs_dir / f"0001-{folder_label(configs[0])}").mkdir(parents=True)  # the interrupted attempt's
    first = backend.run(configs[0])  # recorded as it is, as a script's first trial is (outputs/script.first_trial)
    run.append(replace(first, extra={**first.extra, "trial": 1}))
    second = backend.run(configs[1])
    assert [Path(r.extra["log_dir"]).name for r in (first, second)] == [
        f"0001-{folder_label(configs[0])}-attempt2", f"0002-{folder_label(configs[1])}"]
    # Outside a run directory the folders already there are counted instead.
    outside = DeepSpeedBackend(make_workload("tiny"), BUDGET, PROFILES["cpu"], logs_dir=tmp_path / "loose",
                               ranks_ahead=False)
    (tmp_path / "loose" / "0001-x").mkdir(parents=True)
    assert outside._new_log_dir(configs[0]).name == f"0002-{folder_label(configs[0])}"
