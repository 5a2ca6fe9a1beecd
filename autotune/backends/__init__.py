"""Backends run one config and return its TrialResult: `deepspeed` (a real short run), `simulated`
(the estimator's prediction), `replay` (a table of measured results) and `script` (a user's script)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from autotune.values.config import Config
from autotune.values.results import TrialResult


@runtime_checkable
class Backend(Protocol):
    """What drivers call. Build one with `autotune.backends.factory.make_backend`; adapt a plain objective
    (anything with `run`) with `autotune.backends.factory.as_backend`."""

    name: str  # "deepspeed" | "simulated" | "replay" | "script" | a user's, written to TrialResult.backend

    @property
    def fatal(self) -> str | None:
        """Set once the backend knows no config can succeed (a script that never steps, a rank on the wrong
        accelerator): drivers stop launching. Drivers only read it: a plain attribute or a property."""
        ...

    def run(self, config: Config) -> TrialResult:
        """Run (or look up) one trial. Failures are results with a status, never exceptions."""
        ...

    def close(self) -> None:
        """Release what the backend holds (processes, files); called once by the driver at the end."""
        ...
