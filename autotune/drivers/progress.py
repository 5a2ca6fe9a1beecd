"""Progress of a sweep for people: one line per trial (number, config, status, throughput, memory,
best so far) and, while a trial runs, a live status line with its config and elapsed time."""

from __future__ import annotations

from typing import Protocol

from rich.console import Console
from rich.status import Status

from autotune.config import Config
from autotune.results import TrialResult
from autotune.units import format_size

STATUS_STYLE = {"ok": "green", "oom": "red", "crash": "red", "timeout": "yellow", "unsupported": "yellow",
                "pruned": "dim"}


class Progress(Protocol):
    def started(self, number: int, launched: int, config: Config) -> None: ...
    def finished(self, result: TrialResult, launched: int, best: TrialResult | None) -> None: ...
    def pruned(self, result: TrialResult) -> None: ...
    def message(self, text: str) -> None: ...


class QuietProgress:
    def started(self, number: int, launched: int, config: Config) -> None:
        pass

    def finished(self, result: TrialResult, launched: int, best: TrialResult | None) -> None:
        pass

    def pruned(self, result: TrialResult) -> None:
        pass

    def message(self, text: str) -> None:
        pass


class ConsoleProgress:
    def __init__(self, total_trials: int, console: Console | None = None) -> None:
        self.total = total_trials
        self.console = console or Console(width=max(Console().width, 160))  # one line per trial, unwrapped
        self._status: Status | None = None

    def started(self, number: int, launched: int, config: Config) -> None:
        status = self.console.status(f"trial {launched}/{self.total} (#{number}) {config.label()}: running")
        status.start()
        self._status = status

    def finished(self, result: TrialResult, launched: int, best: TrialResult | None) -> None:
        self._stop()
        style = STATUS_STYLE.get(result.status, "")
        throughput = f"{result.throughput_samples_per_s:8.2f} samples/s" if result.throughput_samples_per_s else " " * 18
        best_text = (f"best {best.throughput_samples_per_s:.2f} (#{best.extra.get('trial', '?')})" if best
                     else "best -")
        error = f"  {_headline(result.error)}" if result.error and not result.ok else ""
        self.console.print(
            f"trial {launched:>3}/{self.total} #{result.extra.get('trial', '?'):<4} {result.config.label():<28} "
            f"[{style}]{result.status:<11}[/{style}] {throughput}  peak {format_size(result.peak_memory_bytes):>9}  "
            f"{result.wall_time_s:6.1f} s  {best_text}{error}", highlight=False)

    def pruned(self, result: TrialResult) -> None:
        self.console.print(f"pruned    #{result.extra.get('trial', '?'):<4} {result.config.label():<28} "
                           f"[dim]{_headline(result.error)}[/dim]", highlight=False)

    def message(self, text: str) -> None:
        self._stop()
        self.console.print(text, highlight=False)

    def _stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def _headline(error: str | None, width: int = 110) -> str:
    line = (error or "").strip().splitlines()[:1] or [""]
    text = line[0] if len(line[0]) <= width else line[0][: width - 3] + "..."
    return text.replace("[", "\\[")
