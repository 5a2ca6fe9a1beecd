"""Estimator consultation before a trial: a config predicted to exceed the memory budget by more than a
safety margin is not run. It is recorded as a `pruned` TrialResult carrying the prediction and the
reason, and the strategy learns it as it would an out-of-memory failure.

The margin only has to cover the estimator's over-prediction (a config predicted at 1.2x the budget
that really fits is lost if the margin is below 0.2). Before calibration it is UNCALIBRATED_MARGIN;
once the estimator is calibrated on measured results, the margin becomes the worst over-prediction
seen on this run's measured configs, kept between MIN_MARGIN and UNCALIBRATED_MARGIN.

Out-of-memory results teach the pruner too (calibration only learns from trials that ran): a config
with the same memory layout (ZeRO stage, checkpointing, offloads) as one that ran out of memory, and
predicted to need at least as much, is pruned whatever the margin. Within one layout the estimator's
order of configs by memory (micro-batch, precision) is reliable even where its absolute figures are not.
A config of another layout is pruned from OTHER_LAYOUT_SLACK more: the estimator's error differs a little
between layouts. (On the distorted simulation of benchmarks/search_efficiency.py this took Optuna's
out-of-memory trials from 5.6% to 4.4% of those launched, at no measurable cost in trials to 98%.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from autotune.config import Config
from autotune.estimate import Calibration, Estimate, estimate
from autotune.hardware import Hardware
from autotune.results import TrialResult
from autotune.units import format_size
from autotune.workload import Workload

UNCALIBRATED_MARGIN = 0.25
MIN_MARGIN = 0.05
OTHER_LAYOUT_SLACK = 0.05


@dataclass(frozen=True)
class Pruner:
    workload: Workload
    hardware: Hardware
    budget_bytes: int
    calibration: Calibration = Calibration()
    margin: float = UNCALIBRATED_MARGIN
    out_of_memory: frozenset[Config] = frozenset()  # configs that ran out of memory in this sweep

    def predict(self, config: Config) -> Estimate:
        return estimate(config, self.workload, self.hardware, self.calibration)

    def check(self, config: Config, backend: str) -> TrialResult | None:
        """A `pruned` result if `config` is predicted not to fit even with the margin, else None."""
        est = self.predict(config)
        if not est.fits(self.budget_bytes, self.margin):
            reason = (f"predicted peak {format_size(est.peak_bytes)} exceeds the budget of "
                      f"{format_size(self.budget_bytes)} by more than the {self.margin:.0%} safety margin (largest "
                      f"term: {est.memory.dominant} {format_size(getattr(est.memory, est.memory.dominant))})")
        else:
            smaller = self._smaller_out_of_memory(config, est.peak_bytes)
            if smaller is None:
                return None
            reason = f"{smaller.label()} ran out of memory with a predicted peak no larger than this config's " \
                     f"{format_size(est.peak_bytes)}"
            if layout(smaller) != layout(config):
                reason += f" less {OTHER_LAYOUT_SLACK:.0%} (another memory layout)"
        return TrialResult(config, "pruned", memory_budget_bytes=self.budget_bytes, backend=backend, error=reason,
                           extra={"predicted_peak_bytes": est.peak_bytes,
                                  "predicted_throughput_samples_per_s": est.throughput_samples_per_s,
                                  "predicted_memory": est.memory.to_dict(), "pruning_margin": self.margin})

    def with_out_of_memory(self, config: Config) -> "Pruner":
        return replace(self, out_of_memory=self.out_of_memory | {config})

    def _smaller_out_of_memory(self, config: Config, peak: int) -> Config | None:
        for other in sorted(self.out_of_memory):
            slack = 1.0 if layout(other) == layout(config) else 1.0 + OTHER_LAYOUT_SLACK
            if self.predict(other).peak_bytes * slack <= peak:
                return other
        return None

    def recalibrated(self, calibration: Calibration, measured: Iterable[TrialResult]) -> "Pruner":
        """This pruner with a new calibration and the margin that calibration earns on `measured`."""
        if calibration.samples <= 0:
            return replace(self, calibration=calibration)
        over = [self._over_prediction(calibration, r) for r in measured if r.ok and r.peak_memory_bytes]
        margin = UNCALIBRATED_MARGIN if not over else min(max(max(over), MIN_MARGIN), UNCALIBRATED_MARGIN)
        return replace(self, calibration=calibration, margin=margin)

    def _over_prediction(self, calibration: Calibration, result: TrialResult) -> float:
        predicted = estimate(result.config, self.workload, self.hardware, calibration).peak_bytes
        return predicted / result.peak_bytes - 1.0


def layout(config: Config) -> tuple:
    """What decides where memory goes, apart from micro-batch and precision."""
    return (config.zero_stage, config.ckpt_interval, config.offload_optimizer, config.offload_param)
