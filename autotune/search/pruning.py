"""Estimator consultation before a trial: a config is not run when it is unlikely to fit the memory
budget, or when it cannot beat the best result found even if the estimator is as wrong in its favour as it
plausibly is. It is recorded as a `pruned` TrialResult carrying the prediction, the probability and the
gain it was judged by, and the strategy learns it as it would an out-of-memory failure.

Predictions are distributions (autotune.prediction.uncertainty): the calibrated estimate times a log-normal error
whose width depends on which knob values the measured trials covered. A config is pruned for memory
only when its probability of fitting is below MIN_FIT_PROBABILITY (a config predicted 9% over the budget
with a wide interval stays a candidate; one predicted 5x over does not), and for value only when the
optimistic end of its throughput (VALUE_Z standard deviations up) is still below the best measured
throughput. Pruning is conservative on purpose: a wrongly pruned config is never run again, while a
wrongly kept one costs one trial, and its result narrows the intervals.

Out-of-memory results narrow the intervals too: a known peak is an observation like any other, and an
out-of-memory failure without a peak is the censored observation "peak > budget", which lifts the memory
offsets of its knob values (what it says about configs of the same layout, predicted no smaller, follows
from the probability instead of a fixed rule).

Device memory is not the only limit: offloaded state lives in the node's host memory (all its ranks'
together) and ZeRO-Infinity's in the NVMe path's free space. A config unlikely to fit either (the same
memory error applied) is pruned too, and every pruned result names its cause (`extra["cause"]`: CAUSES),
so that the console, the report and the verdict say what to change: the budget is the answer to device
memory only. A trial that ran out of host memory prunes configs of no smaller predicted host need.
"""

from __future__ import annotations

import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import (Calibration, Estimate, estimate, host_need_bytes, nvme_need_bytes,
                                          states_fit)
from autotune.prediction.trial_time import (TrialTime, TrialTimeModel, calibrated, model_for, op_for, ran_ahead,
                                            trial_time, without_ops_s)
from autotune.values.hardware import Hardware
from autotune.values.results import DEVICE_MEMORY, HOST_MEMORY, NVME_SPACE, VALUE, TrialResult
from autotune.prediction.uncertainty import PRIOR_MEMORY, PRIOR_UNCERTAINTY, Forecast, Uncertainty, normal_cdf
from autotune.values.units import format_size
from autotune.values.workload import Workload

if TYPE_CHECKING:
    from autotune.values.settings import RunSettings

MIN_FIT_PROBABILITY = 0.05  # below this probability of fitting, a config is not run
# Standard deviations of the throughput error above the median that value pruning grants a config (3:
# 0.13% one-sided). The time model is rough (its residuals reach 2.5 sd on the committed CPU surface), so
# only a config far behind the best is dropped for value.
VALUE_Z = 3.0
# Added (in quadrature) to the throughput model's sigma for value pruning only: one measurement of a
# config can be far off its typical speed (the committed CPU surfaces changed by a median 14.5% between two
# recordings, and single configs by 2x), and the optimum is often such a lucky measurement.
VALUE_SLACK = 0.25

# What a person reads for each cause (the console's pruned summary, the report, the verdict).
CAUSES = {DEVICE_MEMORY: "device memory", HOST_MEMORY: "host memory (offloaded state)", NVME_SPACE: "NVMe space",
          VALUE: "the best throughput found (no gain expected)"}
NO_SPACE_MARKERS = ("no space left on device", "enospc", "nvme space")


def free_bytes(path: str | None) -> int | None:
    """Free space at `path` on this machine; None when there is no such path here."""
    if not path or not os.path.exists(path):
        return None
    return shutil.disk_usage(path).free


def cause_of(result: TrialResult) -> str | None:
    """The resource a failed or pruned result ran out of (a key of CAUSES), or None for other failures.
    The pruner and the backends record it (`TrialResult.cause`); older records are read from their message."""
    recorded = result.cause
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
    return ", ".join(f"{n} {verb if i == 0 else then} {CAUSES[c]}" if c != VALUE else f"{n} predicted slower than "
                     "the best found" for i, (c, n) in enumerate(counts.most_common()))


@dataclass(frozen=True)
class Pruner:
    workload: Workload
    hardware: Hardware
    budget_bytes: int
    calibration: Calibration = Calibration()
    uncertainty: Uncertainty = PRIOR_UNCERTAINTY
    out_of_memory: frozenset[Config] = frozenset()  # configs that ran out of device memory in this sweep
    out_of_host_memory: frozenset[Config] = frozenset()  # configs whose offloaded state ran out of host memory
    nvme_free_bytes: int | None = None  # free space at the NVMe path where trials run (None: not checked)
    min_fit_probability: float = MIN_FIT_PROBABILITY
    value_z: float = VALUE_Z
    # What the uncertainty was fitted on: the measured results, and each device out-of-memory's peak if known.
    measured: tuple[TrialResult, ...] = field(default=(), compare=False, repr=False)
    oom_peaks: tuple[tuple[Config, int | None], ...] = field(default=(), compare=False, repr=False)
    # Each config's estimate under this calibration, made once: a sweep's figure asks for every untried config's
    # twice a trial (its forecast and its trial's seconds). A pruner `replace`d gets an empty one.
    _estimates: dict[Config, Estimate] = field(default_factory=dict, init=False, compare=False, repr=False)

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

    @classmethod
    def from_run(cls, path: str | Path, workload: Workload, hardware: Hardware, budget_bytes: int) -> "Pruner":
        """The pruner a run directory's record implies (its calibration, and the uncertainty its trials leave),
        or one from a calibration file alone; ConfigError if it has no calibration or was fitted for another
        workload or hardware (autotune.prediction.calibrate.load_calibration)."""
        from autotune.prediction.calibrate import load_calibration, usable
        from autotune.values.results import read_results

        path = Path(path)
        calibration = load_calibration(path, workload, hardware)
        if calibration is None:
            raise ConfigError(f"{path}: no calibration there (a run directory with calibration.json, or the file)")
        trials = path / "trials.jsonl"
        results = read_results(trials) if path.is_dir() and trials.is_file() else []
        pruner = cls(workload, hardware, budget_bytes, calibration)
        for r in results:
            if r.status == "oom" and cause_of(r) == DEVICE_MEMORY:
                pruner = replace(pruner, out_of_memory=pruner.out_of_memory | {r.config},
                                 oom_peaks=pruner.oom_peaks + ((r.config, r.peak_memory_bytes),))
        return pruner.recalibrated(calibration, usable(results))

    def predict(self, config: Config) -> Estimate:
        found = self._estimates.get(config)
        if found is None:
            found = self._estimates[config] = estimate(config, self.workload, self.hardware, self.calibration)
        return found

    def forecast(self, config: Config) -> Forecast:
        """The calibrated prediction of `config` with its uncertainty."""
        est = self.predict(config)
        return self.uncertainty.forecast(config, est.peak_bytes, est.throughput_samples_per_s)

    def fit_probability(self, config: Config) -> float:
        return self.forecast(config).fit_probability(self.budget_bytes)

    @cached_property
    def trial_time_model(self) -> TrialTimeModel:
        """The trial-time terms of this machine, their scales fitted on the measured trials that recorded phases."""
        return calibrated(model_for(self.hardware), self.measured, self.workload, self.hardware)

    @cached_property
    def ranks_ahead(self) -> bool:
        """Whether this sweep's next trial is expected on ranks started ahead (autotune.trials.runner.Spares): a
        measured trial ran on them, so its backend starts them."""
        return any(ran_ahead(r) for r in self.measured)

    @cached_property
    def ops_used(self) -> frozenset[str]:
        """The ops this sweep's trials have loaded (built once, then only loaded)."""
        configs = [r.config for r in self.measured] + sorted(self.out_of_memory)
        return frozenset(op for op in map(op_for, configs) if op is not None)

    def trial_seconds(self, config: Config, forecast: Forecast | None = None) -> float:
        """The expected wall seconds of `config`'s trial (autotune.prediction.trial_time at its calibrated step
        time): its whole run weighed by its probability of fitting, its death in the first step by the rest, and
        the first build of an op no trial of this sweep has loaded yet (the deepspeed backend builds an op just before
        the first trial that loads it; where an earlier sweep of the environment built it, the price stays: it
        keeps cpu_adam's configs from being launched only to learn. Pricing such ops as built was tried: the warm
        start then launched an offloaded optimizer where offload never wins, and the replay surface at its median
        peak ran 3 out-of-memory trials in 25, not 2.)"""
        return self._weighed_seconds(config, forecast, lambda t: t.total_s)

    def _weighed_seconds(self, config: Config, forecast: Forecast | None, part: Callable[[TrialTime], float]) -> float:
        est = self.predict(config)
        p = (forecast or self.forecast(config)).fit_probability(self.budget_bytes)
        seconds = [part(trial_time(config, self.workload, self.hardware, est.step_time_s, fits=fits,
                                   ops_built=self.ops_used, model=self.trial_time_model, ahead=self.ranks_ahead,
                                   states_fit=states_fit(est, self.workload, self.budget_bytes))) for fits in (True, False)]
        return p * seconds[0] + (1 - p) * seconds[1]

    def expected_wall_s(self, configs: Iterable[Config], ran: Sequence[TrialResult]) -> float | None:
        """The wall seconds `configs`' trials are expected to take apart from loading or building ops: the
        trial-time model (weighed by fitting, as trial_seconds) scaled by how long the trials that `ran` took
        against it, less their ops' phase (geometric mean: a simulated backend's flat times included); None where
        none ran, nothing to judge by. A trial that loaded an op before any other of `ran` without recording its
        phases may hold that op's build: left out while other trials can judge. An op's first build is not
        expected: whether the environment has it built, only the backend knows."""
        def own(config: Config) -> float:
            return self._weighed_seconds(config, None, lambda t: t.total_s - t.ops_s - t.ops_build_s)

        loaded: set[str | None] = set()
        first: list[TrialResult] = []
        later: list[TrialResult] = []
        for r in ran:
            if r.status == "pruned" or without_ops_s(r) <= 0:
                continue
            op = op_for(r.config)
            (first if op not in loaded and not r.extra.get("phases_s") else later).append(r)
            loaded.add(op)
        basis = later or first
        if not basis:
            return None
        logs = [math.log(without_ops_s(r) / own(r.config)) for r in basis]
        return math.exp(sum(logs) / len(logs)) * sum(map(own, configs))

    def check(self, config: Config, backend: str, best_throughput: float | None = None) -> TrialResult | None:
        """A `pruned` result if `config` is unlikely to fit, or cannot beat `best_throughput` (the best
        measured so far) even at the optimistic end of its throughput; else None."""
        est = self.predict(config)
        forecast = self.uncertainty.forecast(config, est.peak_bytes, est.throughput_samples_per_s)
        found = (self._over_limit(est, forecast) or self._smaller_out_of_host_memory(config, est)
                 or self._no_gain(forecast, best_throughput))
        if found is None:
            return None
        cause, reason = found
        low, high = forecast.peak_interval()
        fast = self.optimistic_throughput(forecast)
        return TrialResult(config, "pruned", memory_budget_bytes=self.budget_bytes, backend=backend, error=reason,
                           extra={"predicted_peak_bytes": est.peak_bytes,
                                  "predicted_throughput_samples_per_s": est.throughput_samples_per_s,
                                  "predicted_memory": est.memory.to_dict(),
                                  "predicted_peak_interval_bytes": [int(low), int(high)],
                                  "fit_probability": round(forecast.fit_probability(self.budget_bytes), 6),
                                  "optimistic_throughput_samples_per_s": fast,
                                  "best_throughput_samples_per_s": best_throughput,
                                  "expected_gain_samples_per_s": forecast.value(self.budget_bytes,
                                                                                best_throughput or 0.0),
                                  "cause": cause})

    def _over_limit(self, est: Estimate, forecast: Forecast) -> tuple[str, str] | None:
        """(cause, reason) for the first limit the config is unlikely to fit: device memory, then the node's
        host memory, then the NVMe path's free space."""
        floor = f"below the {self.min_fit_probability:.0%} a config needs to run"
        p = forecast.fit_probability(self.budget_bytes)
        if p < self.min_fit_probability:
            term = est.memory.dominant
            low, high = forecast.peak_interval()
            return DEVICE_MEMORY, (f"predicted peak {format_size(forecast.peak_bytes)} ({format_size(low)}-"
                                   f"{format_size(high)}, 90%) fits the budget of {format_size(self.budget_bytes)} "
                                   f"with probability {p:.1%}, {floor} (largest term: {term} "
                                   f"{format_size(getattr(est.memory, term))})")
        host = host_need_bytes(est, self.workload, self.hardware)
        p = self._probability_within(host, self.hardware.host_memory_bytes)
        if p < self.min_fit_probability:
            return HOST_MEMORY, (f"offloaded state needs {format_size(host)} of host memory per node, more than "
                                 f"the {format_size(self.hardware.host_memory_bytes)} of {self.hardware.name} "
                                 f"(probability {p:.1%} of fitting, {floor})")
        nvme = nvme_need_bytes(est, self.workload, self.hardware)
        p = 1.0 if self.nvme_free_bytes is None else self._probability_within(nvme, self.nvme_free_bytes)
        if p < self.min_fit_probability:
            return NVME_SPACE, (f"offloaded state needs {format_size(nvme)} of NVMe space per node, more than "
                                f"the {format_size(self.nvme_free_bytes or 0)} free at the NVMe path "
                                f"(probability {p:.1%} of fitting, {floor})")
        return None

    def _probability_within(self, need: int, limit: int) -> float:
        """P(need <= limit), with the memory model's spread (its knob offsets are about device memory)."""
        if need <= 0:
            return 1.0
        if limit <= 0:
            return 0.0
        sigma = self.uncertainty.memory.noise + PRIOR_MEMORY[0]  # the common offset's prior: host need is not fitted
        return normal_cdf(math.log(limit / need) / sigma)

    def optimistic_throughput(self, forecast: Forecast) -> float:
        """The throughput `value_z` sd above the median, the measurement spread VALUE_SLACK included."""
        return forecast.throughput * math.exp(self.value_z * math.hypot(forecast.time_log[1], VALUE_SLACK))

    def _no_gain(self, forecast: Forecast, best: float | None) -> tuple[str, str] | None:
        if not best:
            return None
        fast = self.optimistic_throughput(forecast)
        if fast >= best:
            return None
        return VALUE, (f"predicted {forecast.throughput:.3g} samples/s, at most {fast:.3g} at the optimistic end "
                       f"({self.value_z:g} sd), below the best found ({best:.3g})")

    def _smaller_out_of_host_memory(self, config: Config, est: Estimate) -> tuple[str, str] | None:
        host = host_need_bytes(est, self.workload, self.hardware)
        for other in sorted(self.out_of_host_memory):
            if host and host_need_bytes(self.predict(other), self.workload, self.hardware) <= host:
                return HOST_MEMORY, (f"{other.label()} ran out of host memory with offloaded state predicted no "
                                     f"larger than this config's {format_size(host)}")
        return None

    def with_out_of_memory(self, config: Config, cause: str | None = DEVICE_MEMORY,
                           peak_bytes: int | None = None) -> "Pruner":
        """This pruner taught that `config` ran out of `cause` (a device or host memory; others teach nothing):
        a device out-of-memory is an observation of its peak (`peak_bytes`, or "over the budget" if unknown)."""
        if cause == HOST_MEMORY:
            return replace(self, out_of_host_memory=self.out_of_host_memory | {config})
        if cause == DEVICE_MEMORY:
            taught = replace(self, out_of_memory=self.out_of_memory | {config},
                             oom_peaks=self.oom_peaks + ((config, peak_bytes),))
            return taught._refit()
        return self

    def recalibrated(self, calibration: Calibration, measured: Iterable[TrialResult]) -> "Pruner":
        """This pruner with a new calibration and the uncertainty it leaves on `measured`."""
        return replace(self, calibration=calibration, measured=tuple(measured))._refit()

    def _refit(self) -> "Pruner":
        from autotune.prediction.calibrate import fit_uncertainty

        return replace(self, uncertainty=fit_uncertainty(self.measured, self.oom_peaks, self.workload, self.hardware,
                                                         self.calibration, self.budget_bytes))


class LivePruner:
    """The pruner of a sweep as it learns (the sweep replaces it after each result): what a strategy reads
    through `SearchContext.forecast` and `SearchContext.trial_seconds`."""

    def __init__(self, pruner: Pruner) -> None:
        self._pruner = pruner
        self._forecasts: dict[Config, Forecast] = {}  # of the current pruner: strategies ask for every config
        self._seconds: dict[Config, float] = {}

    @property
    def pruner(self) -> Pruner:
        return self._pruner

    @pruner.setter
    def pruner(self, pruner: Pruner) -> None:
        if pruner is not self._pruner:
            self._pruner, self._forecasts, self._seconds = pruner, {}, {}

    def forecast(self, config: Config) -> Forecast:
        found = self._forecasts.get(config)
        if found is None:
            found = self._forecasts[config] = self._pruner.forecast(config)
        return found

    def uncertainty(self) -> Uncertainty:
        return self.pruner.uncertainty

    def trial_seconds(self, config: Config) -> float:
        found = self._seconds.get(config)
        if found is None:
            found = self._seconds[config] = self._pruner.trial_seconds(config, self.forecast(config))
        return found


def layout(config: Config) -> tuple:
    """What decides where memory goes, apart from micro-batch and precision."""
    return (config.zero_stage, config.ckpt_interval, config.offload_optimizer, config.offload_param)
