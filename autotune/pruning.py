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

Device memory is not the only limit: offloaded state lives in the node's host memory (all its ranks'
together) and ZeRO-Infinity's in the NVMe path's free space. A config predicted over either (with the same
margin) is pruned too, and every pruned result names its cause (`extra["cause"]`: CAUSES), so that the
console, the report and the verdict say what to change: the budget is the answer to device memory only.
A trial that ran out of host memory teaches the pruner as a device out-of-memory does, by host need.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable

from autotune.config import Config, ConfigError
from autotune.estimate import Calibration, Estimate, estimate, host_need_bytes, nvme_need_bytes
from autotune.hardware import Hardware
from autotune.results import TrialResult
from autotune.units import format_size
from autotune.workload import Workload

if TYPE_CHECKING:
    from autotune.rundir import RunSettings

UNCALIBRATED_MARGIN = 0.25
MIN_MARGIN = 0.05
OTHER_LAYOUT_SLACK = 0.05

DEVICE_MEMORY, HOST_MEMORY, NVME_SPACE = "device_memory", "host_memory", "nvme_space"
# What a person reads for each cause (the console's pruned summary, the report, the verdict).
CAUSES = {DEVICE_MEMORY: "device memory", HOST_MEMORY: "host memory (offloaded state)", NVME_SPACE: "NVMe space"}
NO_SPACE_MARKERS = ("no space left on device", "enospc", "nvme space")


def free_bytes(path: str | None) -> int | None:
    """Free space at `path` on this machine; None when there is no such path here."""
    if not path or not os.path.exists(path):
        return None
    return shutil.disk_usage(path).free


def cause_of(result: TrialResult) -> str | None:
    """The resource a failed or pruned result ran out of (a key of CAUSES), or None for other failures.
    The pruner and the backends record it (`extra["cause"]`); older records are read from their message."""
    recorded = result.extra.get("cause")
    if recorded in CAUSES:
        return str(recorded)
    if result.status not in ("oom", "pruned", "crash"):
        return None
    text = (result.error or "").lower()
    if any(marker in text for marker in NO_SPACE_MARKERS):
        return NVME_SPACE
    if "host memory" in text:
        return HOST_MEMORY
    return DEVICE_MEMORY if result.status in ("oom", "pruned") else None


def cause_counts(results: Iterable[TrialResult]) -> Counter[str]:
    """How many of `results` ran out of (or were predicted over) each resource."""
    return Counter(c for c in map(cause_of, results) if c is not None)


def describe_causes(counts: Counter[str], verb: str = "over", then: str = "over") -> str:
    """'790 predicted over device memory, 22 over host memory (offloaded state)' (verb 'predicted over'),
    largest first; `then` replaces `verb` after the first."""
    return ", ".join(f"{n} {verb if i == 0 else then} {CAUSES[c]}" for i, (c, n) in enumerate(counts.most_common()))


@dataclass(frozen=True)
class Pruner:
    workload: Workload
    hardware: Hardware
    budget_bytes: int
    calibration: Calibration = Calibration()
    margin: float = UNCALIBRATED_MARGIN
    out_of_memory: frozenset[Config] = frozenset()  # configs that ran out of device memory in this sweep
    out_of_host_memory: frozenset[Config] = frozenset()  # configs whose offloaded state ran out of host memory
    nvme_free_bytes: int | None = None  # free space at the NVMe path where trials run (None: not checked)

    @classmethod
    def for_settings(cls, settings: "RunSettings") -> "Pruner":
        """The pruner of a sweep: its budget, and the NVMe path's free space where its trials run on this
        machine (a real backend; a simulated machine's disk is not this one's)."""
        from autotune.backends.factory import backend_kind

        try:
            real = backend_kind(settings.backend).real
        except ConfigError:  # a backend object the caller passed: its machine is not known
            real = False
        nvme = free_bytes(settings.choices.nvme_path) if real else None
        return cls(settings.workload, settings.hardware, settings.memory_budget_bytes, nvme_free_bytes=nvme)

    def predict(self, config: Config) -> Estimate:
        return estimate(config, self.workload, self.hardware, self.calibration)

    def check(self, config: Config, backend: str) -> TrialResult | None:
        """A `pruned` result if `config` is predicted not to fit even with the margin, else None."""
        est = self.predict(config)
        found = self._over_limit(est) or self._smaller_out_of_memory(config, est)
        if found is None:
            return None
        cause, reason = found
        return TrialResult(config, "pruned", memory_budget_bytes=self.budget_bytes, backend=backend, error=reason,
                           extra={"predicted_peak_bytes": est.peak_bytes,
                                  "predicted_throughput_samples_per_s": est.throughput_samples_per_s,
                                  "predicted_memory": est.memory.to_dict(), "pruning_margin": self.margin,
                                  "cause": cause})

    def _over_limit(self, est: Estimate) -> tuple[str, str] | None:
        """(cause, reason) for the first limit the prediction exceeds by more than the margin: device memory,
        then the node's host memory, then the NVMe path's free space."""
        margin = f"by more than the {self.margin:.0%} safety margin"
        if not est.fits(self.budget_bytes, self.margin):
            term = est.memory.dominant
            return DEVICE_MEMORY, (f"predicted peak {format_size(est.peak_bytes)} exceeds the budget of "
                                   f"{format_size(self.budget_bytes)} {margin} (largest term: {term} "
                                   f"{format_size(getattr(est.memory, term))})")
        host = host_need_bytes(est, self.workload, self.hardware)
        if host > self.hardware.host_memory_bytes * (1 + self.margin):
            return HOST_MEMORY, (f"offloaded state needs {format_size(host)} of host memory per node, more than "
                                 f"the {format_size(self.hardware.host_memory_bytes)} of {self.hardware.name} {margin}")
        nvme = nvme_need_bytes(est, self.workload, self.hardware)
        if self.nvme_free_bytes is not None and nvme > self.nvme_free_bytes * (1 + self.margin):
            return NVME_SPACE, (f"offloaded state needs {format_size(nvme)} of NVMe space per node, more than "
                                f"the {format_size(self.nvme_free_bytes)} free at the NVMe path {margin}")
        return None

    def with_out_of_memory(self, config: Config, cause: str | None = DEVICE_MEMORY) -> "Pruner":
        """This pruner taught that `config` ran out of `cause` (a device or host memory; others teach nothing)."""
        if cause == HOST_MEMORY:
            return replace(self, out_of_host_memory=self.out_of_host_memory | {config})
        if cause == DEVICE_MEMORY:
            return replace(self, out_of_memory=self.out_of_memory | {config})
        return self

    def _smaller_out_of_memory(self, config: Config, est: Estimate) -> tuple[str, str] | None:
        for other in sorted(self.out_of_memory):
            slack = 1.0 if layout(other) == layout(config) else 1.0 + OTHER_LAYOUT_SLACK
            if self.predict(other).peak_bytes * slack <= est.peak_bytes:
                reason = (f"{other.label()} ran out of memory with a predicted peak no larger than this config's "
                          f"{format_size(est.peak_bytes)}")
                if layout(other) != layout(config):
                    reason += f" less {OTHER_LAYOUT_SLACK:.0%} (another memory layout)"
                return DEVICE_MEMORY, reason
        host = host_need_bytes(est, self.workload, self.hardware)
        for other in sorted(self.out_of_host_memory):
            if host and host_need_bytes(self.predict(other), self.workload, self.hardware) <= host:
                return HOST_MEMORY, (f"{other.label()} ran out of host memory with offloaded state predicted no "
                                     f"larger than this config's {format_size(host)}")
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
