"""When to stop measuring, and what a list of step times says.

A trial measures optimizer steps until the median step time is known well enough: at least `min_steps`,
then stop as soon as the standard error of the median (1.2533 s / sqrt(n), s the sample standard
deviation) is within `rel_tol` of the median, and the memory peak has stopped growing (the last step
raised it by at most `mem_rel_tol` of the peak growth: on the CPU the resident set creeps up over the
first steps, by up to ~20% for ZeRO-3, as freed blocks are reused imperfectly); never more than
`max_steps` steps or `max_measure_s` seconds. A noisy config is thus measured longer and a steady one
stops early; `stop_reason` records which. A config far behind stops early (`slow`): more than half of its measured
steps, and two at least, took over `slow_factor` times what the tuner expected (`expected_step_s`: the larger of the
estimator's prediction and the fastest step measured so far; unset before any config was measured), so its median
is past that limit and more steps would only refine a throughput already known to lose (on a CPU that emulates bf16
a step takes ~30x its fp32 time: minutes per trial). One step never decides it, however slow: a single step's noise
(48 ms against 8 ms expected; configs' first measured steps at 4-5x their medians) once ended a trial as `slow`
with that one step recorded as its throughput (`far_behind`).
A config behind the best stops at `min_steps` (`behind`, issue 41: a measurement ends once its figure is good
enough for the decision at hand): every measured step slower than the fastest step time any trial of the sweep
measured (`best_step_s`, a median) by more than `behind_margin`, so its median cannot come near the best's
however many steps follow, its memory peak settled as for `stable`. Its throughput is then known to 3 steps, not
to `rel_tol`: enough to rank it behind, and for calibration. Where steps spread (fp16's skipped steps, a loaded
host) this is what saves steps: `stable` already stops a steady config at `min_steps`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

STABLE, MAX_STEPS, TIME_LIMIT, SLOW, BEHIND = "stable", "max_steps", "time_limit", "slow", "behind"
REASONS = (STABLE, MAX_STEPS, TIME_LIMIT, SLOW, BEHIND)
SLOW_FACTOR = 5.0
# "Behind" means every step at least this much slower than the best median: above the median step-to-step spread of
# a CPU trial (10% interquartile range, ARCHITECTURE.md section 4), far above a GPU's (3%).
BEHIND_MARGIN = 0.1


@dataclass(frozen=True)
class MeasureSettings:
    warmup_steps: int = 1  # optimizer steps not timed: lazy allocations, ZeRO-3's first trace
    min_steps: int = 3
    max_steps: int = 20
    rel_tol: float = 0.04
    max_measure_s: float = 60.0
    mem_rel_tol: float | None = 0.01  # None: the memory peak does not hold measurement back
    slow_factor: float | None = SLOW_FACTOR  # None: never stop a slow config early
    expected_step_s: float | None = None  # set per trial by the backend (None: nothing expected)
    behind_margin: float | None = BEHIND_MARGIN  # None: a config behind the best is measured in full
    best_step_s: float | None = None  # the fastest step time the sweep measured, set per trial by the backend

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be >= 0")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"min_steps={self.min_steps}, max_steps={self.max_steps}: need 1 <= min <= max")
        if self.rel_tol < 0 or self.max_measure_s <= 0:
            raise ValueError(f"rel_tol={self.rel_tol}, max_measure_s={self.max_measure_s}: must be positive")
        if self.behind_margin is not None and self.behind_margin < 0:
            raise ValueError(f"behind_margin={self.behind_margin}: must be >= 0, or None")
        for name in ("slow_factor", "expected_step_s", "best_step_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value}: must be positive, or None")

    @classmethod
    def fixed(cls, warmup_steps: int, steps: int) -> "MeasureSettings":
        """Exactly `steps` measured steps (no early stop), e.g. to compare with a fixed-step run."""
        return cls(warmup_steps, steps, steps, 0.0, 1e9, None, None, behind_margin=None)

    def slow_step_s(self) -> float | None:
        """A step time past which the config is far behind (None: no such limit for this trial)."""
        if self.slow_factor is None or self.expected_step_s is None:
            return None
        return self.slow_factor * self.expected_step_s

    def behind_step_s(self) -> float | None:
        """A step time every measured step exceeding it puts the config behind the best (None: no such limit)."""
        if self.behind_margin is None or self.best_step_s is None:
            return None
        return (1 + self.behind_margin) * self.best_step_s


def median_rel_se(times: Sequence[float]) -> float:
    """Standard error of the median relative to the median (normal approximation); inf below 2 samples."""
    if len(times) < 2:
        return math.inf
    median = statistics.median(times)
    return 1.2533 * statistics.stdev(times) / math.sqrt(len(times)) / median if median > 0 else math.inf


def stop_reason(times: Sequence[float], elapsed_s: float, settings: MeasureSettings,
                peaks: Sequence[int] = (), skipped: int = 0) -> str | None:
    """Why to stop after these measured step times, or None to measure another step. `peaks`: the memory
    peak's growth over the baseline after each measured step (empty: not known); `skipped`: steps taken since
    measurement began that the loss scaler skipped (not timed; they count towards `max_steps`)."""
    n = len(times)
    if far_behind(times, settings):
        return SLOW
    if n + skipped >= settings.max_steps:
        return MAX_STEPS
    if n >= 1 and elapsed_s >= settings.max_measure_s:
        return TIME_LIMIT
    if n < settings.min_steps or memory_growing(peaks, settings):
        return None
    if median_rel_se(times) <= settings.rel_tol:
        return STABLE
    behind = settings.behind_step_s()
    if behind is not None and min(times) > behind:
        return BEHIND
    return None


def far_behind(times: Sequence[float], settings: MeasureSettings) -> bool:
    """Whether these measured step times put the config far behind (`slow`): at least two measured, and their lower
    median past MeasureSettings.slow_step_s, i.e. more than half of them past it. A single step past the limit among
    steps within it never is, wherever it falls; a config whose every step is past it is at its second step."""
    slow = settings.slow_step_s()
    return slow is not None and len(times) >= 2 and statistics.median_low(times) > slow


def memory_growing(peaks: Sequence[int], settings: MeasureSettings) -> bool:
    if settings.mem_rel_tol is None or len(peaks) < 2:
        return False
    return peaks[-1] - peaks[-2] > settings.mem_rel_tol * max(peaks[-1], 1)


def iqr(times: Sequence[float]) -> float:
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return q3 - q1
