"""The local executor: trials one at a time on this machine, in this process (drivers/loop.py runs the loop).

Ctrl-C (KeyboardInterrupt) or SIGTERM during a trial: the backend ends the trial's processes (the
deepspeed runner kills its process group before the interrupt leaves `run`), the loop stops, and the
unfinished trial is not recorded, so `--resume` runs it again.

Before a trial, a backend with `prepare` (deepspeed) builds the C++ ops it loads if none of its trials loaded them
yet: an op that cannot be built ends the sweep with its one line (autotune.trials.ops.OpBuildFailed), the trials
before it recorded and resumable.
"""

from __future__ import annotations

from autotune.backends import Backend
from autotune.backends.factory import as_backend
from autotune.drivers.loop import Flight, Job, TrialReply, run_jobs
from autotune.drivers.progress import LiveProgress, PhaseReporter, Progress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget, Sweep


class LocalExecutor:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.pending: Flight | None = None

    def room(self, job: Job) -> bool:
        return self.pending is None

    def submit(self, flight: Flight) -> None:
        sweep = flight.job.sweep
        flight.job.progress.started(sweep.next_number, sweep.launched + 1, flight.config)
        self.pending = flight

    def wait(self) -> tuple[Flight, TrialReply | None]:
        flight, self.pending = self.pending, None
        assert flight is not None, "wait() with nothing submitted"
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:  # the ops the trial loads, built at their first use (the deepspeed backend's)
            prepare(flight.config, flight.job.progress.message)
        return flight, TrialReply(self.backend.run(flight.config), self.backend.fatal)

    def in_flight(self) -> int:
        return int(self.pending is not None)

    def cancel(self) -> None:
        self.pending = None  # the backend ended the trial's processes before the interrupt reached here


def run_local(sweep: Sweep, backend: Backend, budget: Budget, progress: Progress) -> StopReason:
    """Run trials until the budget is spent or the strategy is done; returns why it stopped."""
    executor = LocalExecutor(as_backend(backend))
    if isinstance(progress, LiveProgress):
        progress.set_slots(1)
        if isinstance(executor.backend, PhaseReporter):  # the live line shows the running trial's phase
            progress.follow(executor.backend.phase)
    job = Job("local", sweep, budget, progress=progress)
    try:
        return run_jobs([job], executor)[job.name]
    finally:
        executor.backend.close()
