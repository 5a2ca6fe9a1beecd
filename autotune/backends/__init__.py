"""Backends run one config and return its TrialResult: `deepspeed` (a real short run), `simulated`
(the estimator's prediction) and `replay` (a table of measured results)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from autotune.config import Config
from autotune.results import TrialResult


@runtime_checkable
class Backend(Protocol):
    name: str  # "deepspeed" | "simulated" | "replay", written to TrialResult.backend

    def run(self, config: Config) -> TrialResult:
        """Run (or look up) one trial. Failures are results with a status, never exceptions."""
        ...
