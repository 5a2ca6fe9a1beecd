"""The one tuning loop: jobs (sweeps) propose configs, an executor runs them, results go back to their sweep.

    fill the free slots: the job with the fewest devices in use proposes, or the free devices wait for it until
    its trial fits (Job.next_config: budget, fatal verdict (the backend's, a DeepSpeed op failing in a second
    trial, or three configs crashing alike before any ran), strategy done or stalled, a sequential strategy
    waiting for its result); the executor submits; wait for one result; record it in its sweep; repeat until no
    job proposes and nothing is in flight.

Executors only submit and wait: `LocalExecutor` runs one trial at a time in this process (drivers/local.py),
`RayExecutor` several at once on a Ray cluster (drivers/ray.py). A trial whose executor lost it (a dead Ray
worker or node) comes back as no reply and is submitted again. Ctrl-C (KeyboardInterrupt) or SIGTERM: the
executor cancels what is in flight (the deepspeed backend ends its trial's processes), nothing unfinished is
recorded, every job stops as INTERRUPTED (but one that had spent its budget), and `--resume` runs the lost trials again.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Protocol, Sequence

from autotune.backends import Backend
from autotune.values.config import Config
from autotune.drivers.progress import Progress, QuietProgress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget
from autotune.trials.ops import REPEATED_BUILD_FAILURES, build_failure
from autotune.values.results import STDERR_TAIL, TrialResult

ASKS_PER_SLOT = 3  # proposals asked for one free slot before a sweep waits for a result in flight
# Crashes alike (one cause, word for word) of this many configs, none having run, after which a sweep stops: a
# script or environment that fails whatever the config would crash every trial (Job._repeated_crash).
REPEATED_CRASHES = 3


@dataclass(frozen=True)
class TrialResources:
    """What one trial asks the executor for (Ray resources; the local executor runs one trial at a time)."""

    cpus: float = 1.0
    gpus: float = 0.0
    custom: tuple[tuple[str, float], ...] = ()
    # Real trials: their ranks, and what one rank asks for, so that a trial no node holds can be spread over
    # several (drivers/ray_ranks.py); 0 / (): a trial that runs whole on one node or not at all.
    ranks: int = 0
    per_rank: tuple[tuple[str, float], ...] = ()

    def demand(self) -> dict[str, float]:
        out = {"CPU": self.cpus, "GPU": self.gpus, **dict(self.custom)}
        return {k: v for k, v in out.items() if v > 0}

    @property
    def devices(self) -> float:
        """The scarce resource a trial holds, for sharing the executor between sweeps."""
        return self.gpus or sum(dict(self.custom).values()) or self.cpus

    def options(self) -> dict[str, Any]:
        return {"num_cpus": self.cpus, "num_gpus": self.gpus, "resources": dict(self.custom)}

    def describe(self) -> str:
        return ", ".join(f"{v:g} {k}" for k, v in self.demand().items()) or "nothing"


@dataclass(frozen=True)
class TrialReply:
    """What running a trial gives back: its result, and the backend's verdict that no config can succeed."""

    result: TrialResult
    fatal: str | None = None


@dataclass
class Flight:
    job: "Job"
    config: Config
    attempt: int = 1
    submitted: float = field(default_factory=time.monotonic)


class Trials(Protocol):
    """What the loop asks of what it runs trials for: a sweep (drivers/sweep.py's Sweep) or a surface being
    recorded (drivers/recording.py's Recording)."""

    best: TrialResult | None

    @property
    def backend_name(self) -> str:
        """The backend a result the executor makes up (a trial its worker lost) is recorded for."""
        ...

    @property
    def launched(self) -> int: ...

    @property
    def next_number(self) -> int:
        """1-based position of the next result in its record."""
        ...

    def budget_spent(self, budget: Budget, in_flight: int = 0) -> StopReason | None: ...

    def next_config(self, budget: Budget | None = None, in_flight: Collection[Config] = ()) -> Config | None: ...

    def ended(self) -> StopReason:
        """Why next_config proposes nothing more."""
        ...

    def finish(self, config: Config, result: TrialResult) -> TrialResult:
        """Record a launched trial's result; returns it as recorded."""
        ...


class Job:
    """One sweep (or recording) under the loop: what it runs trials for, budget, what a trial asks for, and how a
    worker builds its backend (a picklable callable; None where the executor holds the backend)."""

    def __init__(self, name: str, sweep: Trials, budget: Budget, resources: TrialResources = TrialResources(),
                 make_backend: Callable[[], Backend] | None = None, progress: Progress = QuietProgress()) -> None:
        self.name = name
        self.sweep = sweep
        self.budget = budget
        self.resources = resources
        self.make_backend = make_backend
        self.progress = progress
        self.in_flight: list[Flight] = []
        self.waiting = False  # the strategy wants a result before it proposes again
        self.reason: StopReason | None = None  # why it stopped, once it has
        self.fatal: str | None = None  # the backend said no config can succeed: propose nothing more
        self.build_failures: Counter[str | None] = Counter()  # op -> trials that crashed loading it (autotune.trials.ops)
        self.crashes: list[TrialResult] = []  # while no trial has run: the crashes, for _repeated_crash
        self.ran = False  # some trial of this job ran (ok)

    @property
    def devices_in_use(self) -> float:
        return len(self.in_flight) * self.resources.devices

    def next_config(self) -> Config | None:
        """A config to launch now, or None (and `reason` set once nothing is in flight either)."""
        sweep, budget = self.sweep, self.budget
        if self.fatal:
            self._stop(StopReason.FATAL)
            return None
        spent = sweep.budget_spent(budget, len(self.in_flight))
        if spent:
            self._stop(spent)
            return None
        flying = {f.config for f in self.in_flight}
        for _ in range(ASKS_PER_SLOT):
            config = sweep.next_config(budget, flying)
            if config is None:
                self._stop(sweep.ended())  # converged, stalled or done
                return None
            if config not in flying:
                return config
        self.waiting = True  # a sequential strategy: its next proposal needs the result in flight
        return None

    def record(self, flight: Flight, reply: TrialReply) -> None:
        result = self.sweep.finish(flight.config, reply.result)
        self.progress.finished(result, self.sweep.launched, self.sweep.best)
        fatal = reply.fatal or self._repeated_build_failure(reply.result) or self._repeated_crash(result)
        if fatal and not self.fatal:
            self.fatal = fatal
            self.progress.message(f"stopping: {self.fatal}")

    def _repeated_build_failure(self, result: TrialResult) -> str | None:
        """A DeepSpeed op that failed to build or load in a second trial is the environment's failure, not the
        configs': its one line (autotune.trials.ops), which stops the sweep. Counted here, where every trial's result
        comes back (a Ray worker's backend sees one trial)."""
        failure = build_failure(result)
        if failure is None:
            return None
        self.build_failures[failure.op] += 1
        return failure.line() if self.build_failures[failure.op] >= REPEATED_BUILD_FAILURES else None

    def _repeated_crash(self, result: TrialResult) -> str | None:
        """The same crash (its cause up to the quoted stderr) in REPEATED_CRASHES configs while no trial has run,
        among them ZeRO stage 0 and a partitioned stage, and fp32 or two precisions: the script's or the environment's
        failure (a script that exits at its fifth step whatever the config), so every other config would spend its
        trial on it too: the line that stops the sweep. Crashes alike only where ZeRO partitions (a script's
        optimizer DeepSpeed will not partition) or only in one reduced precision (a loop that feeds fp32 into a bf16
        model) are those configs' own. Not timeouts: a slow config times out in the same words as a hung one."""
        self.ran = self.ran or result.status == "ok"
        if self.ran or result.status != "crash" or not result.error:
            return None
        self.crashes.append(result)
        cause = result.error.split(STDERR_TAIL, 1)[0]
        alike = [r for r in self.crashes if (r.error or "").split(STDERR_TAIL, 1)[0] == cause]
        configs = [r.config for r in alike]
        stages, precisions = {c.zero_stage > 0 for c in configs}, {c.precision for c in configs}
        if len(alike) < REPEATED_CRASHES or len(stages) < 2 or ("fp32" not in precisions and len(precisions) < 2):
            return None
        logs = result.extra.get("log_dir")
        return (f"{len(alike)} configs crashed alike ({', '.join(c.label() for c in configs)}) and none has run: "
                f"{cause}: a failure of the script or the environment, not of a config; fix it"
                + (f" (logs: {logs})" if logs else "") + " and start again")

    def _stop(self, reason: StopReason) -> None:
        if self.in_flight:
            self.waiting = True  # results in flight may give the strategy more to propose
        else:
            self.reason = reason


class Executor(Protocol):
    def room(self, job: Job) -> bool:
        """One more trial of `job` may start now."""
        ...

    def submit(self, flight: Flight) -> None: ...

    def wait(self) -> tuple[Flight, TrialReply | None]:
        """The next finished trial; no reply when the executor lost it (submit it again)."""
        ...

    def in_flight(self) -> int: ...

    def cancel(self) -> None:
        """End whatever is in flight (interrupted)."""
        ...


def run_jobs(jobs: Sequence[Job], executor: Executor, concurrency: int | None = None) -> dict[str, StopReason]:
    """Run every job to its end; returns each job's stop reason by name."""

    def fairest(ready: Sequence[Job]) -> Job:
        return min(ready, key=lambda j: (j.devices_in_use, j.sweep.launched))

    def fill() -> None:
        while concurrency is None or executor.in_flight() < concurrency:
            ready = [j for j in jobs if j.reason is None and not j.waiting]
            if not ready:
                return
            job = fairest(ready)
            if not executor.room(job):
                # The free devices wait for the workload served least, until enough of them are free for its
                # wider trial: given to a narrower workload, they kept it waiting until that one had finished.
                if executor.in_flight():
                    return
                ready = [j for j in ready if executor.room(j)]
                if not ready:
                    return
                job = fairest(ready)
            config = job.next_config()
            if config is not None:
                submit(Flight(job, config))

    def submit(flight: Flight) -> None:
        flight.job.in_flight.append(flight)
        executor.submit(flight)

    try:
        while True:
            fill()
            if not executor.in_flight():
                break
            flight, reply = executor.wait()
            job = flight.job
            job.in_flight.remove(flight)
            job.waiting = False
            if reply is None:
                submit(Flight(job, flight.config, flight.attempt + 1))
            else:
                job.record(flight, reply)
    except KeyboardInterrupt:
        executor.cancel()
        for job in jobs:
            if job.reason is None:  # one whose budget was spent, nothing in flight, ended before the interrupt
                job.reason = (None if job.in_flight else job.sweep.budget_spent(job.budget)) or StopReason.INTERRUPTED
    return {job.name: job.reason or StopReason.DONE for job in jobs}
