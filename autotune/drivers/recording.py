"""Recording a replay surface: every config of a space run through a backend, each result appended (fsync'd)
to a JSONL file as soon as it is known, resumable (configs already in the file are skipped), in a shuffled
order fixed by a seed so that a partial surface covers the space evenly; its trials run on the sweeps' trial loop
and local executor (drivers/loop.py, drivers/local.py: a backend's fatal verdict stops it, Ctrl-C keeps what
finished). `autotune surface record` and the GPU validation kit call it; the replay backend
(autotune.backends.replay) reads what it writes.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Collection

from autotune.backends import Backend
from autotune.backends.factory import as_backend
from autotune.drivers.local import LocalExecutor
from autotune.drivers.loop import Job, run_jobs
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget
from autotune.files import short
from autotune.values.argtypes import given_path, whole
from autotune.values.config import Config, ConfigError
from autotune.values.results import TrialResult, append_result, read_results, repair_tail
from autotune.values.space import Space
from autotune.values.units import counted, exact_size, format_size


SAME_BUDGET = 0.001  # budgets this close (relative) are one surface's


def _limit(limit: Any) -> int | None:
    """How many configs a call records at most: None (all) or a positive whole number of any integer type; else one
    line (a slice would take -1 as "all but the last" and 0 as nothing, and "3" would be a TypeError)."""
    number = whole(limit)
    if limit is not None and (number is None or number < 1):
        raise ConfigError(f"limit {short(limit)}: allowed None (every config) or a positive whole number")
    return number


@dataclass(frozen=True)
class Recorded:
    recorded: int  # configs run by this call
    total_measured: int  # configs of the space now in the file
    fatal: str | None = None  # the backend's (or a repeated op build failure's) line that stopped the recording

    def to_dict(self) -> dict[str, int | str | None]:
        return {"recorded": self.recorded, "total_measured": self.total_measured, "fatal": self.fatal}


class RecordingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a recording once every finished trial was in the file: what it holds now (`recorded`), and
    the configs still to measure (`left`), which the same call records when run again."""

    def __init__(self, recorded: Recorded, left: int) -> None:
        super().__init__()
        self.recorded, self.left = recorded, left


def record_surface(space: Space, backend: Backend, out: Path, *, order_seed: int = 0, limit: int | None = None,
                   retries: int = 1, repeats: int = 1, only: Collection[Config] | None = None,
                   progress: Callable[[str], None] = print) -> Recorded:
    """Run every config of `space` (or of `only`, configs of the space) through `backend` until `out`
    holds `repeats` measurements of it, appending each result.

    Repeats run in passes (every config's second measurement after all first ones, each pass in its own
    shuffled order), so that a config's measurements see the machine at different times. A `crash` is
    re-run up to `retries` times (now, or on a later resume): on a shared machine a trial can fail for
    reasons that are not its config's (e.g. a port taken between choosing and binding it). Every attempt
    stays in the file; the replay backend uses the median of a config's measurements. The trials run on the sweeps'
    loop: a backend's fatal verdict, or a DeepSpeed op failing to build in a second trial, stops the recording
    (`Recorded.fatal` says why); Ctrl-C raises RecordingInterrupted (a KeyboardInterrupt) once every finished
    trial is in the file.
    """
    if not isinstance(space, Space):
        raise ConfigError(f"space {short(space)}: allowed a Space, e.g. autotune.Space(choices, workload, hardware)")
    budget = getattr(backend, "memory_budget_bytes", None)  # the backend's own (as_backend may wrap it)
    backend = as_backend(backend)  # an object with run(config) -> TrialResult, or one line saying what it lacks
    out = given_path(out, "out", "a surface's JSONL file (str or pathlib.Path)")  # `~` expanded, as every path
    if any(isinstance(n, bool) or not isinstance(n, int) for n in (retries, repeats)) or retries < 0 or repeats < 1:
        raise ConfigError(f"retries {short(retries)}, repeats {short(repeats)}: need retries >= 0 and repeats >= 1 "
                          "(whole numbers)")
    limit = _limit(limit)
    workload, hardware = space.workload, space.hardware
    repaired = repair_tail(out)  # before the first append: a torn last line is moved aside, not merged into
    if repaired:
        progress(repaired)
    existing = read_results(out)
    for result in existing:
        recorded_for = result.extra.get("workload")
        if recorded_for is not None and recorded_for != workload.to_dict():
            raise ConfigError(f"{out} was recorded for another workload ({describe_workload(recorded_for)}): "
                              f"choose another --out (`out`) or the same --model/--gpus/--global-batch (the space's "
                              "workload)")
        if result.backend != backend.name:  # a simulation's figures beside measurements would replay as measured
            raise ConfigError(f"{out} was recorded by the {result.backend} backend, not {backend.name}: choose another "
                              "--out (`out`), or the same backend")
        on = result.extra.get("hardware")
        if on is not None and on != hardware.name:
            raise ConfigError(f"{out} was recorded on {on!r}, not {hardware.name!r}: choose another --out (`out`) or "
                              "the same --hardware (the space's)")
        # A trial past its budget is stopped as out of memory: measurements at two budgets are not one surface. The
        # default budget is the machine's memory as read now, which moves by a few hundred KiB from boot to boot.
        recorded = result.memory_budget_bytes
        if budget is not None and recorded is not None and abs(recorded - budget) > SAME_BUDGET * max(recorded, budget):
            raise ConfigError(f"{out} was recorded under a memory budget of {exact_size(recorded)}, not "
                              f"{exact_size(budget)}: choose another --out (`out`) or the same --memory-budget "
                              "(the backend's)")
    if only is not None:
        for config in only:
            if config not in space:
                raise ConfigError(f"{config.label()} is not a config of the space recorded "
                                  f"({space.invalid_reason(config) or 'not one of its combinations'})")
    configs = [c for c in space if only is None or c in only]
    last = {r.config: r for r in existing}
    crashes = Counter(r.config for r in existing if r.status == "crash")
    measured = Counter(r.config for r in existing if r.status != "crash")

    def missing(config: Config) -> int:
        """Measurements still to take; a config whose crashes used up its retries has none."""
        if measured[config] == 0 and config in last and crashes[config] > retries:
            return 0
        return max(repeats - measured[config], 0)

    todo = []
    for n in range(1, repeats + 1):  # pass n: the configs that still lack an n-th measurement
        due = [c for c in configs if missing(c) and measured[c] < n]
        random.Random(order_seed + n - 1).shuffle(due)
        todo += due
    if limit is not None:
        todo = todo[:limit]
    total = sum(1 for c in configs if missing(c) == 0)
    progress(f"{out}: {counted(len(space), 'config')} in the space{f', {len(configs)} to record' if only is not None else ''}"
             f", {total} already measured{f' {repeats} times' if repeats > 1 else ''}, {len(todo)} to run "
             f"on the {backend.name} backend")
    recording = Recording(out, todo, {"workload": workload.to_dict(), "hardware": hardware.name}, crashes, measured,
                          retries, progress, backend.name)
    job = Job("record", recording, Budget(trials=len(todo) * (retries + 1)))
    # The one trial loop and its local executor, as a sweep's trials run (drivers/loop.py, drivers/local.py).
    reason = run_jobs([job], LocalExecutor(backend))[job.name]
    done = Recorded(recording.done, sum(1 for c in configs if missing(c) == 0), job.fatal)
    if reason is StopReason.INTERRUPTED:  # every finished trial is in the file; a resume runs the rest
        raise RecordingInterrupted(done, sum(1 for c in configs if missing(c)))
    return done


class Recording:
    """A surface being recorded, as the trial loop drives it (drivers/loop.py's `Trials`): the configs to run in
    order, a crashed one proposed again at once while it has retries left, each result appended (fsync'd) to
    the surface with what it was recorded for, and a progress line per trial."""

    def __init__(self, out: Path, todo: list[Config], extra: dict, crashes: Counter, measured: Counter, retries: int,
                 progress: Callable[[str], None], backend_name: str) -> None:
        self.out, self.todo, self.extra, self.retries = out, todo, extra, retries
        self.crashes, self.measured = crashes, measured  # per config, the file's attempts so far (updated here)
        self.say, self.backend_name = progress, backend_name
        self.launched = 0  # trials run by this call
        self.done = 0  # configs of `todo` run to an end (a result that is not a crash, or out of retries)
        self.best: TrialResult | None = None
        self.started = time.monotonic()

    @property
    def next_number(self) -> int:
        return self.launched + 1

    def budget_spent(self, budget: Budget, in_flight: int = 0) -> StopReason | None:
        return StopReason.TRIALS if self.launched + in_flight >= budget.trials else None

    def next_config(self, budget: Budget | None = None, in_flight: Collection[Config] = ()) -> Config | None:
        return self.todo[self.done] if self.done < len(self.todo) else None

    def ended(self) -> StopReason:
        return StopReason.DONE

    def finish(self, config: Config, result: TrialResult) -> TrialResult:
        result = replace(result, extra={**result.extra, **self.extra})
        append_result(self.out, result)
        self.launched += 1
        n, total = self.done + 1, len(self.todo)
        elapsed = time.monotonic() - self.started
        self.say(f"[{n}/{total}] {config.label():<28} {_outcome(result)}  {result.wall_time_s:5.1f}s  "
                 f"elapsed {_clock(elapsed)}  left ~{_clock(elapsed / n * (total - n))}")
        self.crashes[config] += result.status == "crash"
        self.measured[config] += result.status != "crash"
        if result.status == "crash" and self.crashes[config] <= self.retries:
            self.say(f"[{n}/{total}] {config.label():<28} crashed: running it again "
                     f"(attempt {self.crashes[config] + 1} of {self.retries + 1})")
        else:
            self.done += 1
        return result


def _outcome(result: TrialResult) -> str:
    if result.ok:
        return (f"ok     {result.throughput_samples_per_s:8.3g} samples/s  peak "
                f"{format_size(result.peak_memory_bytes):>9}")
    reason = (result.error or "").splitlines()[0][:80] if result.error else ""
    return f"{result.status:<6} {reason}"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def describe_workload(workload: dict) -> str:
    model = workload.get("model", {})
    name = model.get("name", model) if isinstance(model, dict) else model
    ranks = workload.get("gpus")
    return f"{name}, global batch {workload.get('global_batch')}, {ranks} rank{'' if ranks == 1 else 's'}"
