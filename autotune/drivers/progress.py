"""Progress of a sweep for people: one line per trial (number, config, status, throughput, memory,
best so far, the chance that an untried config is faster (the convergence stop's figure, autotune.search.convergence),
the sweep's ETA), one line per batch of pruned configs (how many, and what each was predicted
to exceed: autotune.search.pruning.CAUSES; every config and its reason stay in trials.jsonl and report.md), and,
while a trial runs, a live line with its config, its phase (loading or building DeepSpeed's C++ ops,
initializing, warming up, measuring: read from the backend, `PhaseReporter`), its elapsed time and the ETA.

The ETA is the median wall time of the trials seen so far times the trials left, divided by the trials
that run at once (`set_slots`: 1 locally, the Ray executor's slots); it says nothing until one trial
has finished. Times are this process's clock, not the results' `wall_time_s` (a simulated trial's is the
time a real one would take): a trial started here runs from `started` to `finished`; a trial the Ray
executor ran (no `started`) counts the time since the previous result, times the slots.

How much it says (`autotune --quiet` / `--verbose`): quiet, only what `result` is given (the command's results),
no trial lines, pruned lines, live line or messages; verbose, also each phase of the running trial as it changes,
on stderr, from a thread that reads the phase as the live line does (`PhaseWatch`).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

from rich.console import Console
from rich.status import Status

from autotune.values.config import Config, ConfigError
from autotune.search.convergence import percent
from autotune.search.pruning import cause_counts, describe_causes
from autotune.values.results import TrialResult
from autotune.values.units import counted, format_size

LABEL_WIDTH = 28  # the config column's width until the space is known: most labels of a default space fit
STATUS_STYLE = {"ok": "green", "oom": "red", "crash": "red", "timeout": "yellow", "unsupported": "yellow",
                "pruned": "dim", "untrained": "red"}
PhaseSource = Callable[[], "str | None"]


class Progress(Protocol):
    def started(self, number: int, launched: int, config: Config) -> None: ...
    def finished(self, result: TrialResult, launched: int, best: TrialResult | None) -> None: ...
    def pruned(self, result: TrialResult) -> None: ...
    def message(self, text: str) -> None: ...


@runtime_checkable
class PhaseReporter(Protocol):
    """A backend that can say where its trial in flight is (DeepSpeedBackend: rank 0's latest phase)."""

    def phase(self) -> str | None: ...


@runtime_checkable
class LiveProgress(Protocol):
    """A progress display that shows the running trial's phase and an ETA (ConsoleProgress); drivers feed
    it what they know, a plain Progress needs neither."""

    def follow(self, phase: PhaseSource) -> None: ...
    def set_slots(self, slots: int) -> None: ...


class QuietProgress:
    def started(self, number: int, launched: int, config: Config) -> None:
        pass

    def finished(self, result: TrialResult, launched: int, best: TrialResult | None) -> None:
        pass

    def pruned(self, result: TrialResult) -> None:
        pass

    def message(self, text: str) -> None:
        pass


def eta_s(durations: Sequence[float], remaining: int, slots: int = 1, running_s: float = 0.0) -> float | None:
    """Seconds until `remaining` more trials (the running one included) are done, `slots` at a time, at the
    median of `durations`; the running one has already run `running_s`. None before any trial finished."""
    if not durations:
        return None
    if remaining <= 0:
        return 0.0
    median = statistics.median(durations)
    return max(median * math.ceil(remaining / max(slots, 1)) - min(running_s, median), 0.0)


def format_clock(seconds: float) -> str:
    """Elapsed time as a clock: 0:42, 12:05, 1:02:03."""
    s = int(seconds)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def format_duration(seconds: float) -> str:
    """A rough duration for an ETA: 40 s, 7 min, 2 h 05 min."""
    if seconds < 60:
        return f"{max(int(round(seconds / 10.0)) * 10, 10) if seconds >= 10 else int(math.ceil(seconds))} s"
    minutes = int(round(seconds / 60))
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


@dataclass
class _Running:
    number: int
    launched: int
    config: Config
    since: float


class PhaseWatch:
    """Under --verbose: a thread that reads the running trial's phase every `every_s` and says each new one."""

    def __init__(self, phase: PhaseSource, say: Callable[[str], None], every_s: float) -> None:
        self._phase, self._say, self._every_s = phase, say, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="autotune-phases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        last = None
        while True:
            try:
                phase = self._phase()
            except OSError:  # a trial's directory going away as it ends
                phase = None
            if phase is not None and phase != last:
                self._say(phase)
                last = phase
            if self._stop.wait(self._every_s):
                return


class ConsoleProgress:
    """What `autotune tune` prints, for a sweep from Python too (`autotune.tune(spec, callbacks=ConsoleProgress())`).
    `total_trials`: the trials a line counts to (`trial 3/30`); None, and whenever a sweep tells it its start
    (`begun`, as tune() does), the sweep's own budget (TuneSpec.trials), which a line never contradicts."""

    def __init__(self, total_trials: int | None = None, console: Console | None = None, *,
                 clock: Callable[[], float] = time.monotonic, slots: int = 1, phase_every_s: float = 0.5,
                 quiet: bool = False, verbose: bool = False, errors: Console | None = None,
                 time_budget_s: float | None = None) -> None:
        if total_trials is not None and (isinstance(total_trials, bool) or not isinstance(total_trials, int)
                                         or total_trials <= 0):
            raise ConfigError(f"total_trials {total_trials!r}: allowed a positive integer, or None (the sweep's "
                              "trials, told when it begins)")
        self.total: int | None = total_trials
        # --time-budget: no trial starts that is expected to end after it (drivers/sweep.py), so the ETA is the sooner
        # of the trials left and the trials of the median's length that still fit in it; `walls` are the recorded
        # wall times (a simulated trial's is a GPU's, not this clock's), every session's (`resumed_with`).
        self.time_budget_s = time_budget_s
        self.walls: list[float] = []
        # soft_wrap: one line per trial, as long as it is, whatever the terminal's width (a terminal folds it)
        self.console = console or Console(soft_wrap=True)
        self.quiet, self.verbose = quiet, verbose
        self.errors = errors or Console(stderr=True, soft_wrap=True, highlight=False)  # --verbose's phases
        self._watch: PhaseWatch | None = None
        self.clock = clock
        self.slots = slots
        self.durations: list[float] = []  # wall time of each trial finished in this session
        self.done = 0  # trials finished over every session (the sweep's `launched` at the last result)
        self.running: dict[Config, _Running] = {}
        self._phase: PhaseSource | None = None
        self._phase_every_s = phase_every_s
        self._phase_read: tuple[float, str | None] = (-math.inf, None)
        self._pruned: list[TrialResult] = []  # the batch not yet summarised
        self._status: Status | None = None
        self._last_result = clock()  # for results of trials not started here (Ray)
        self.chance: float | None = None  # of a better config, after the latest search trial
        self.label_width = LABEL_WIDTH  # the config column's: the space's longest label once known (use_space)

    # -- what drivers tell it (LiveProgress) ------------------------------------------------------------
    def begun(self, start: Any) -> None:
        """The sweep's start (autotune.api.SweepStart: its run directory held, before its first trial): its trial
        budget and time budget are what the lines count to, its space sizes the config column, a resumed sweep's
        earlier trials count in its time budget."""
        self.total = start.budget.trials
        if start.budget.time_s is not None:
            self.time_budget_s = start.budget.time_s
        self.use_space(start.space)
        if start.resumed:
            self.resumed_with(start.run_dir.results())

    def follow(self, phase: PhaseSource) -> None:
        """Read the running trial's phase from `phase` (a backend's `phase`)."""
        self._phase = phase

    def use_space(self, configs: Iterable[Config]) -> None:
        """Size the config column to the space's longest label, so that no status column shifts under it."""
        self.label_width = max((len(c.label()) for c in configs), default=LABEL_WIDTH)

    def set_slots(self, slots: int) -> None:
        self.slots = max(1, slots)
        self._last_result = self.clock()  # the trials start now

    # -- Progress -------------------------------------------------------------------------------------
    def started(self, number: int, launched: int, config: Config) -> None:
        self._flush_pruned()
        self.done = max(self.done, launched - 1 - len(self.running))
        self.running[config] = _Running(number, launched, config, self.clock())
        self._phase_read = (-math.inf, None)
        self._show()
        if self.verbose and self._phase is not None and self._watch is None:
            label = f"trial {launched}/{self._total} (#{number}) {config.label()}"
            self._watch = PhaseWatch(self._phase, lambda phase: self.errors.print(f"{label}: {phase}"),
                                     self._phase_every_s)

    def resumed_with(self, results: Sequence[TrialResult]) -> None:
        """A resumed sweep's earlier trials, whose wall times count in its time budget."""
        self.walls = [r.wall_time_s for r in results if r.status != "pruned"]

    def finished(self, result: TrialResult, launched: int, best: TrialResult | None) -> None:
        run = self.running.pop(result.config, None)
        self.walls.append(result.wall_time_s)
        now = self.clock()
        self.durations.append(now - run.since if run is not None else (now - self._last_result) * self.slots)
        self._last_result = now
        self.done = max(self.done, launched)
        self._flush_pruned()
        if not self.running:
            self._stop()
        if self.quiet:
            return
        style = STATUS_STYLE.get(result.status, "")
        throughput = f"{result.throughput_samples_per_s:8.2f} samples/s" if result.throughput_samples_per_s else " " * 18
        best_text = (f"best {best.throughput_samples_per_s:.2f} (#{best.extra.get('trial', '?')})" if best
                     else "best -")
        chance = result.extra.get("chance_of_better")
        if isinstance(chance, (int, float)) and not isinstance(chance, bool):
            self.chance = float(chance)
            best_text += f"  chance of a better config {percent(self.chance)}"
        eta = self.eta()
        eta_text = f"  ETA {format_duration(eta)}" if eta else ""
        error = f"  {_headline(result.error)}" if result.error and not result.ok else _far_behind(result)
        self.console.print(
            f"trial {launched:>3}/{self._total} #{result.extra.get('trial', '?'):<4} {result.config.label():<{self.label_width}} "
            f"[{style}]{result.status:<11}[/{style}] {throughput}  peak {format_size(result.peak_memory_bytes):>9}  "
            f"{result.wall_time_s:6.1f} s  {best_text}{eta_text}{error}", highlight=False)

    def pruned(self, result: TrialResult) -> None:
        """Gathered into one line per batch (printed before the next trial or message)."""
        self._pruned.append(result)
        self._show()

    def message(self, text: str) -> None:
        """A note (what the sweep is, what it repaired, where it stands): not under --quiet."""
        self._flush_pruned()
        if not self.running:
            self._stop()
        if not self.quiet:
            self.console.print(text, highlight=False)

    def result(self, text: str) -> None:
        """A line of the command's result (the recommendation, where the files are): always said."""
        self._flush_pruned()
        if not self.running:
            self._stop()
        self.console.print(text, highlight=False)

    def close(self) -> None:
        """Print the last batch of pruned configs and end the live line."""
        self._flush_pruned()
        self._stop()

    # -- the live line -------------------------------------------------------------------------------
    def eta(self) -> float | None:
        """Seconds until the sweep's trial budget (or its time budget) is spent, at the median trial time so far."""
        if self.total is None:  # not told yet: no ETA
            return None
        remaining = self.total - self.done
        if self.time_budget_s is not None and self.walls:
            left_s = self.time_budget_s - sum(self.walls)
            may_start = math.floor(max(left_s, 0.0) / max(statistics.median(self.walls), 1e-9))
            remaining = min(remaining, max(may_start, len(self.running)))
        running = max((self.clock() - r.since for r in self.running.values()), default=0.0)
        return eta_s(self.durations, remaining, self.slots, running)

    def live_line(self) -> str:
        """What the live line says now."""
        now = self.clock()
        if not self.running:
            return f"pruning: {counted(len(self._pruned), 'config')} predicted not to fit so far"
        eta = self.eta()
        eta_text = f" · sweep ETA {format_duration(eta)}" if eta is not None else ""
        if self.time_budget_s is not None and self.walls:
            eta_text = (f" · {format_duration(sum(self.walls))} of the {format_duration(self.time_budget_s)} time "
                        f"budget spent{eta_text}")
        if self.chance is not None:
            eta_text = f" · chance of a better config {percent(self.chance)}{eta_text}"
        if len(self.running) == 1:
            run = next(iter(self.running.values()))
            phase = self._current_phase(now) or "running"
            return (f"trial {run.launched}/{self._total} (#{run.number}) {run.config.label()}: {phase} · "
                    f"{format_clock(now - run.since)}{eta_text}")
        oldest = min(self.running.values(), key=lambda r: r.since)
        return (f"{len(self.running)} trials running (longest: {oldest.config.label()}, "
                f"{format_clock(now - oldest.since)}){eta_text}")

    @property
    def _total(self) -> str:
        return "?" if self.total is None else str(self.total)

    def __rich__(self) -> str:
        return self.live_line()

    def _current_phase(self, now: float) -> str | None:
        if self._phase is None:
            return None
        at, phase = self._phase_read
        if now - at >= self._phase_every_s:  # rendered ~12 times a second: read the events file less often
            try:
                phase = self._phase()
            except OSError:  # a trial's directory going away as it ends
                phase = None
            self._phase_read = (now, phase)
        return phase

    def _show(self) -> None:
        if self._status is None and not self.quiet:
            self._status = self.console.status(self)  # re-rendered on every refresh: elapsed time and phase
            self._status.start()

    def _stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _flush_pruned(self) -> None:
        batch, self._pruned = self._pruned, []
        if batch and not self.quiet:
            self.console.print(pruned_line(batch, label_width=self.label_width), highlight=False)


def pruned_line(batch: Sequence[TrialResult], width: int = 110, label_width: int = LABEL_WIDTH) -> str:
    """One line for a batch of pruned configs: a single one with its reason, several counted by cause."""
    if len(batch) == 1:
        result = batch[0]
        return (f"pruned    #{result.extra.get('trial', '?'):<4} {result.config.label():<{label_width}} "
                f"[dim]{_headline(result.error, width)}[/dim]")
    numbers = [r.extra.get("trial") for r in batch]
    span = f" (#{numbers[0]}-#{numbers[-1]})" if None not in (numbers[0], numbers[-1]) else ""
    causes = describe_causes(cause_counts(batch), "predicted over")
    return f"pruned    {len(batch)} configs{span}: {causes or 'predicted not to fit'}"


def _far_behind(result: TrialResult) -> str:
    """How early a config far behind stopped measuring (autotune.worker.measure's `slow`), or ''."""
    extra = result.extra
    if extra.get("stop_reason") != "slow" or not result.step_time_s or not extra.get("expected_step_time_s"):
        return ""
    steps = extra.get("steps_measured", 1)
    return (f"  far behind: measured {steps} step{'s' if steps != 1 else ''} ({result.step_time_s:.1f} s, "
            f"{result.step_time_s / extra['expected_step_time_s']:.0f}x the expected "
            f"{extra['expected_step_time_s']:.2g} s), not the full measurement")


def _headline(error: str | None, width: int = 110) -> str:
    line = (error or "").strip().splitlines()[:1] or [""]
    text = line[0] if len(line[0]) <= width else line[0][: width - 3] + "..."
    return text.replace("[", "\\[")
