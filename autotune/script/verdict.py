"""The exception a script-mode trial ends with when the script, not the config, keeps it from being measured
(its own module: the shim and the loop patches it imports both raise it)."""

from __future__ import annotations


class ScriptVerdict(Exception):
    """The script, not the config, keeps the trial from being measured."""

    def __init__(self, verdict: str, message: str) -> None:
        super().__init__(message)
        self.verdict = verdict
