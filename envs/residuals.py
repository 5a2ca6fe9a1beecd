"""What an episode's trials say about where the estimator is wrong, and the predictions corrected by it.

The estimator's errors on a machine are structured: a ZeRO stage, a precision or an offload path is
slower than modelled for every config that uses it, and the memory model is off by a factor for the
whole workload. So the log-ratio of measured to predicted throughput is modelled as a sum over knobs
of an offset per knob value, each estimated from the trials that used that value and shrunk towards
zero when few did (`SHRINK` pseudo-trials of no offset). Memory is corrected pessimistically by the
largest measured-over-predicted peak ratio seen; an out-of-memory trial without a measured peak counts
as at least the budget. The `jump` action (envs/actions.py) moves to the best config these corrected
predictions leave unmeasured.
"""

from __future__ import annotations

import math

import numpy as np

from autotune.results import TrialResult

SHRINK = 1.0


class Residuals:
    """Per episode: the trials seen, and the corrected predictions of every config of the landscape."""

    def __init__(self, codes: np.ndarray, throughput: np.ndarray, peak: np.ndarray) -> None:
        self.codes = codes  # (configs, knobs): each config's value index per knob
        self.log_throughput = np.log(np.maximum(throughput, 1e-30))
        self.log_peak = np.log(np.maximum(peak, 1.0))
        self._indices: list[int] = []
        self._ratios: list[float] = []  # log(measured / predicted throughput) of ok trials
        self._memory = -math.inf  # largest log(measured / predicted peak)

    def observe(self, index: int, result: TrialResult, budget_bytes: int) -> None:
        if result.status == "ok" and result.fits(budget_bytes) and result.throughput_samples_per_s:
            self._indices.append(index)
            self._ratios.append(math.log(result.throughput_samples_per_s) - self.log_throughput[index])
        peak = result.peak_memory_bytes
        if result.status == "oom" or (result.status == "ok" and not result.fits(budget_bytes)):
            peak = max(peak or 0, budget_bytes)
        if peak and result.status in ("ok", "oom"):
            self._memory = max(self._memory, math.log(peak) - self.log_peak[index])

    def throughput(self) -> np.ndarray:
        """Corrected predicted throughput of every config."""
        if not self._ratios:
            return np.exp(self.log_throughput)
        measured = self.codes[self._indices]
        ratios = np.asarray(self._ratios)
        base = float(ratios.mean())
        log = self.log_throughput + base
        for k in range(self.codes.shape[1]):
            size = int(self.codes[:, k].max()) + 1
            sums = np.bincount(measured[:, k], weights=ratios - base, minlength=size)
            counts = np.bincount(measured[:, k], minlength=size)
            log = log + (sums / (counts + SHRINK))[self.codes[:, k]]
        return np.exp(log)

    def peak(self) -> np.ndarray:
        """Corrected predicted peak of every config (the predictions until a peak was measured)."""
        factor = math.exp(self._memory) if math.isfinite(self._memory) else 1.0
        return np.exp(self.log_peak) * factor
