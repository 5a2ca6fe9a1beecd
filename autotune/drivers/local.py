"""The local driver: trials one at a time on this machine, within a budget of trials and time.

Ctrl-C (KeyboardInterrupt) or SIGTERM during a trial: the backend ends the trial's processes (the
deepspeed runner kills its process group before the interrupt leaves `run`), the loop stops, and the
unfinished trial is not recorded, so `--resume` runs it again.
"""

from __future__ import annotations

from autotune.backends import Backend
from autotune.backends.factory import as_backend
from autotune.drivers.progress import Progress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget, Sweep


def run_local(sweep: Sweep, backend: Backend, budget: Budget, progress: Progress) -> StopReason:
    """Run trials until the budget is spent or the strategy is done; returns why it stopped."""
    sweep.on_pruned = progress.pruned
    backend = as_backend(backend)
    try:
        while True:
            spent = sweep.budget_spent(budget)
            if spent:
                return spent
            config = sweep.next_config()
            if config is None:
                return StopReason.STALLED if sweep.stalled else StopReason.DONE
            progress.started(sweep.next_number, sweep.launched + 1, config)
            result = sweep.finish(config, backend.run(config))
            progress.finished(result, sweep.launched, sweep.best)
            if backend.fatal:
                progress.message(f"stopping: {backend.fatal}")
                return StopReason.FATAL
    except KeyboardInterrupt:
        return StopReason.INTERRUPTED
    finally:
        backend.close()
