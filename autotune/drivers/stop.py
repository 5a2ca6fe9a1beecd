"""Why a sweep's loop ended, with the text people read."""

from __future__ import annotations

from enum import Enum

from autotune.search.convergence import Convergence


class StopReason(str, Enum):
    """A str, so that it compares equal to its value and prints in JSON and tables as before."""

    TRIALS = "trials"
    TIME = "time"
    DONE = "done"  # the strategy's own end, some config of the space untried
    EXHAUSTED = "space exhausted"  # every config of the space tried or pruned (drivers/sweep.py `Sweep.ended`)
    CONVERGED = "converged"  # little chance that an untried config beats the best (autotune/search/convergence.py)
    NOT_WORTH = "not worth a trial"  # no untried config is expected to pay for its trial on the run (--train-for)
    STALLED = "stalled"
    INTERRUPTED = "interrupted"
    FATAL = "fatal"  # the backend says no config can succeed (e.g. a user's script that never steps)
    NOTHING_FITS = "nothing fits"  # at the start, or once the trials that ran leave no config predicted to fit
    NO_NODE = "no node"  # no node of the Ray cluster has the resources one trial asks for

    def __str__(self) -> str:
        return self.value

    @property
    def text(self) -> str:
        return _TEXT[self]

    def describe(self, convergence: Convergence | None = None) -> str:
        """The text, with the convergence stop's figure where it ended the search."""
        if self is StopReason.CONVERGED and convergence is not None:
            return f"search converged: {convergence.describe()}"
        if self is StopReason.NOT_WORTH and convergence is not None and convergence.expected_gain is not None:
            # The largest share is one config's; its trial costs more than that share of the run (the rule compares
            # each config's expected saving with its own trial's seconds), however cheap the trials so far were.
            return (f"{self.text} (the most any is expected to save: {convergence.expected_gain:.2%} of the run, "
                    "less than its own trial would cost)")
        return self.text


_TEXT = {
    StopReason.TRIALS: "trial budget spent",
    StopReason.TIME: "time budget spent (the next trial would not end within it)",
    # Not "nothing left to try" (that is EXHAUSTED): `rl` ends at its policy's training horizon with untried configs
    # left.
    StopReason.DONE: "the strategy proposes nothing more (its own end: grid's list or its early stop, rl's "
                     "training horizon)",
    StopReason.EXHAUSTED: "every config of the space was tried or pruned",
    StopReason.CONVERGED: "search converged: little chance that an untried config is faster",
    StopReason.NOT_WORTH: "no untried config is expected to save the training run (--train-for) more time than its "
                          "trial costs",
    StopReason.STALLED: "the strategy kept proposing known or pruned configs",
    StopReason.INTERRUPTED: "interrupted",
    StopReason.FATAL: "a failure no other config can avoid (the verdict names it)",
    # Also where trials ran first and showed it (a launched config out of host memory, say): "nothing (more)".
    StopReason.NOTHING_FITS: "no config of the space is predicted to fit, nothing (more) to run",
    StopReason.NO_NODE: "no node of the Ray cluster has the resources one trial needs, nothing was run",
}
