"""The estimator over a whole space: which configs are predicted to fit a budget, fastest first, and which
term breaks the budget for the others (`autotune estimate`)."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.prediction.estimate import Calibration, Estimate, estimate
from autotune.values.space import Space


@dataclass(frozen=True)
class Ranking:
    """What `autotune estimate` prints: the space's configs predicted, ranked against a budget."""

    space: Space
    budget_bytes: int
    fits: tuple[Estimate, ...]  # fastest first
    too_big: tuple[Estimate, ...]  # smallest peak first

    def groups(self) -> list[tuple[str, list[Estimate]]]:
        """Non-fitting configs by the term that dominates their peak, biggest group first."""
        by_term: dict[str, list[Estimate]] = {}
        for est in self.too_big:
            by_term.setdefault(est.memory.dominant, []).append(est)
        return sorted(by_term.items(), key=lambda item: -len(item[1]))


def rank_configs(space: Space, budget_bytes: int, calibration: Calibration = Calibration()) -> Ranking:
    """Every config of `space` predicted: those that fit `budget_bytes` fastest first, the others by peak."""
    estimates = [estimate(config, space.workload, space.hardware, calibration) for config in space]
    fits = sorted((e for e in estimates if e.fits(budget_bytes)), key=lambda e: -e.throughput_samples_per_s)
    too_big = sorted((e for e in estimates if not e.fits(budget_bytes)), key=lambda e: e.peak_bytes)
    return Ranking(space, budget_bytes, tuple(fits), tuple(too_big))
