"""The simulated backend: a trial is the estimator's prediction, with optional seeded noise.

What a result holds:
- step time: the estimator's step time times a seeded multiplicative noise factor exp(noise * N(0, 1))
  (lognormal, median 1); throughput is the global batch over that step time. Real step times on a
  shared machine scatter by ~10-40% (ARCHITECTURE.md section 4), so RL training on this backend can add noise
  of that size.
- memory: the estimator's predicted peak per device, without noise (measured peaks repeat within ~2%).
  A peak over the budget is the OOM cliff: status `oom`, with the predicted peak kept in
  `peak_memory_bytes` so that a reward can grow with the overshoot. Offloaded state that exceeds the
  node's host memory is an `oom` too.
- a config the workload or hardware cannot run (e.g. fp16 where the profile has no fp16) is
  `unsupported`, with the reason.
- `wall_time_s` is the duration a real trial of this config would take (launch overhead plus measured
  steps): deterministic for a seed, so drivers with time budgets and Ray's scale tests can use it.
  Nothing sleeps.

Predictions are cached per config (compactly): a run after the first costs a dictionary lookup and one
noise draw; without noise, the whole result is reused.
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import numpy as np

from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import Calibration, Estimate, estimate, host_need_bytes
from autotune.values.hardware import Hardware
from autotune.values.results import TrialResult
from autotune.values.settings import check_budget
from autotune.values.space import invalid_reason
from autotune.values.units import format_size
from autotune.values.workload import Workload


class _Prediction(NamedTuple):
    """What a run needs from the estimate, kept small: environments cache thousands of these."""

    invalid_reason: str | None
    peak_bytes: int
    host_need_bytes: int
    step_time_s: float
    dominant_term: str


class SimulatedBackend:
    name = "simulated"
    fatal: str | None = None  # no config can succeed here (Backend protocol)

    def __init__(self, workload: Workload, hardware: Hardware, memory_budget_bytes: int, noise: float = 0.0,
                 seed: int | np.random.Generator | None = None, calibration: Calibration = Calibration(), *,
                 nvme_path: str | None = None, trial_overhead_s: float = 15.0, measured_steps: int = 10) -> None:
        check_budget(memory_budget_bytes)
        if not math.isfinite(noise) or noise < 0:
            raise ConfigError(f"noise={noise!r}: must be >= 0 (0 turns noise off; 0.1 is ~10% step-time spread)")
        self.workload = workload
        self.hardware = hardware
        self.memory_budget_bytes = int(memory_budget_bytes)
        self.noise = float(noise)
        self.calibration = calibration
        self.nvme_path = nvme_path
        self.trial_overhead_s = trial_overhead_s
        self.measured_steps = measured_steps
        self._rng = np.random.default_rng(seed)
        self._cache: dict[Config, _Prediction] = {}  # shared by with_budget() copies
        self._results: dict[Config, TrialResult] = {}  # outcomes that involve no noise, for this budget

    def with_budget(self, memory_budget_bytes: int) -> "SimulatedBackend":
        """The same simulation under another budget, sharing the estimate cache (predictions do not
        depend on the budget) and the noise stream."""
        check_budget(memory_budget_bytes)
        other = copy.copy(self)
        other.memory_budget_bytes = int(memory_budget_bytes)
        other._results = {}
        return other

    def reseed(self, seed: int | np.random.Generator | None) -> None:
        """Restart the noise stream from a seed, or draw from a given generator (an environment passes its own)."""
        self._rng = np.random.default_rng(seed)

    def estimate(self, config: Config) -> Estimate:
        """The noise-free prediction for `config` (ConfigError if the config cannot run here). The backend
        keeps what a run of it needs, so an environment that estimates a whole space once makes every
        later run a lookup."""
        reason = invalid_reason(config, self.workload, self.hardware, self.nvme_path)
        if reason:
            self._cache[config] = _Prediction(reason, 0, 0, 0.0, "")
            raise ConfigError(f"{config.to_json()}: {reason}")
        est = estimate(config, self.workload, self.hardware, self.calibration)
        self._cache[config] = _Prediction(None, est.peak_bytes, host_need_bytes(est, self.workload, self.hardware),
                                          est.step_time_s, est.memory.dominant)
        return est

    def _lookup(self, config: Config) -> _Prediction:
        cached = self._cache.get(config)
        if cached is None:
            try:
                self.estimate(config)
            except ConfigError:
                pass
            cached = self._cache[config]
        return cached

    def close(self) -> None:
        """Nothing held between trials."""

    def run(self, config: Config) -> TrialResult:
        result = self._results.get(config)
        if result is not None:  # deterministic outcomes are built once
            return result
        reason, peak, host_need, step, dominant = self._lookup(config)
        budget = self.memory_budget_bytes
        if reason is not None:
            result = TrialResult(config, "unsupported", memory_budget_bytes=budget, backend=self.name, error=reason)
        elif peak > budget:  # "cause": a key of autotune.search.pruning.CAUSES
            result = TrialResult(config, "oom", peak_memory_bytes=peak, memory_budget_bytes=budget,
                                 wall_time_s=self.trial_overhead_s, backend=self.name,
                                 extra={"predicted_peak_bytes": peak, "cause": "device_memory"},
                                 error=f"predicted peak {format_size(peak)} exceeds the budget {format_size(budget)}"
                                       f" (largest term: {dominant})")
        elif host_need > self.hardware.host_memory_bytes:
            result = TrialResult(config, "oom", peak_memory_bytes=peak, memory_budget_bytes=budget,
                                 wall_time_s=self.trial_overhead_s, backend=self.name,
                                 extra={"predicted_peak_bytes": peak, "cause": "host_memory"},
                                 error=f"offloaded state needs {format_size(host_need)} of host memory per node,"
                                       f" more than the {format_size(self.hardware.host_memory_bytes)} there")
        else:
            if self.noise:
                step *= math.exp(self.noise * self._rng.standard_normal())
            samples = self.workload.global_batch / step
            result = TrialResult(config, "ok", throughput_samples_per_s=samples,
                                 tokens_per_s=samples * self.workload.model.seq_len, step_time_s=step,
                                 peak_memory_bytes=peak, memory_budget_bytes=budget,
                                 wall_time_s=self.trial_overhead_s + self.measured_steps * step,
                                 backend=self.name, extra={"predicted_peak_bytes": peak})
            if self.noise:
                return result
        self._results[config] = result
        return result
