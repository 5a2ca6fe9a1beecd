"""The local driver: trials one at a time on this machine, within a budget of trials and time.

Ctrl-C (KeyboardInterrupt) or SIGTERM during a trial: the backend ends the trial's processes (the
deepspeed runner kills its process group before the interrupt leaves `run`), the loop stops, and the
unfinished trial is not recorded, so `--resume` runs it again.
"""

from __future__ import annotations

from autotune.backends import Backend
from autotune.drivers.progress import Progress
from autotune.drivers.sweep import Budget, Sweep

# Why a loop ended.
TRIALS, TIME, DONE, STALLED, INTERRUPTED = "trials", "time", "done", "stalled", "interrupted"
FATAL = "fatal"  # the backend says no config can succeed (e.g. a user's script that never steps)


def run_local(sweep: Sweep, backend: Backend, budget: Budget, progress: Progress) -> str:
    """Run trials until the budget is spent or the strategy is done; returns why it stopped."""
    sweep.on_pruned = progress.pruned
    try:
        while True:
            if sweep.launched >= budget.trials:
                return TRIALS
            if budget.time_s is not None and sweep.spent_s >= budget.time_s:
                return TIME
            config = sweep.next_config()
            if config is None:
                return STALLED if sweep.stalled else DONE
            progress.started(sweep.next_number, sweep.launched + 1, config)
            result = sweep.finish(config, backend.run(config))
            progress.finished(result, sweep.launched, sweep.best)
            fatal = getattr(backend, "fatal", None)
            if fatal:
                progress.message(f"stopping: {fatal}")
                return FATAL
    except KeyboardInterrupt:
        return INTERRUPTED
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()
