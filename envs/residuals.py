"""What an episode's trials say about where the estimator is wrong, and the predictions corrected by it.

The estimator's errors on a machine are structured: a ZeRO stage, a precision or an offload path is
slower than modelled for every config that uses it, and the memory model is off by a factor for the
whole workload. So the log-ratio of measured to predicted throughput is modelled as a sum over knobs
of an offset per knob value, each estimated from the trials that used that value and shrunk towards
zero when few did (`SHRINK` pseudo-trials of no offset). Memory is corrected pessimistically by the
largest measured-over-predicted peak ratio seen; an out-of-memory trial without a measured peak counts
as at least the budget. The `jump` action (envs/actions.py) moves to the best config these corrected
predictions leave unmeasured.

Beside it, the probability that a config fits comes from the memory error model of autotune/prediction/uncertainty.py
(the sweep's own: one offset per knob value plus a common one, Gaussian priors, an out-of-memory trial
without a peak as the bound "peak > budget"), updated one trial at a time over the layout's knob values.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtr

from autotune.values.config import KNOBS
from autotune.search.convergence import MIN_MARGIN, Joint, chance_of_better
from autotune.values.results import TrialResult
from autotune.prediction.uncertainty import NOISE_MEMORY, NOISE_TIME, PRIOR_MEMORY, PRIOR_TIME, censor, condition

from autotune.envs.landscape import Landscape

SHRINK = 1.0


class Residuals:
    """Per episode: the trials seen, and the corrected predictions of every config of the landscape.

    Kept as running sums per knob value, so that a step costs one small matrix-vector product (the
    environment asks after every trial)."""

    def __init__(self, landscape: Landscape) -> None:
        layout = landscape.layout
        self.values, self.onehot = layout.value_ids, layout.value_onehot  # computed once per layout
        self.log_predicted, self.log_peak = landscape.log_throughput, landscape.log_peak
        self.sums = np.zeros(self.onehot.shape[1])  # per knob value: sum of log(measured / predicted) ...
        self.counts = np.zeros(self.onehot.shape[1])  # ... over this many ok trials
        self.total, self.trials = 0.0, 0
        self.memory = 0.0  # largest log(measured / predicted peak); 0 until a peak is known
        self.memory_known = False
        # The memory error model: mean and covariance of (common offset, offset per knob value).
        self.belief_mean, self.belief_cov = np.zeros(1 + self.onehot.shape[1]), _memory_prior(layout.value_knobs)
        self._value_knobs = layout.value_knobs

    def observe(self, index: int, result: TrialResult, budget_bytes: int) -> None:
        if result.status == "ok" and result.fits(budget_bytes) and result.throughput_samples_per_s:
            ratio = math.log(result.throughput_samples_per_s) - self.log_predicted[index]
            ids = self.values[index]
            self.sums[ids] += ratio
            self.counts[ids] += 1
            self.total += ratio
            self.trials += 1
        peak = result.peak_memory_bytes
        if result.status == "oom" or (result.status == "ok" and not result.fits(budget_bytes)):
            peak = max(peak or 0, budget_bytes)
        if peak and result.status in ("ok", "oom"):
            ratio = math.log(peak) - self.log_peak[index]
            self.memory = ratio if not self.memory_known else max(self.memory, ratio)
            self.memory_known = True
        if result.status in ("ok", "oom"):
            row = self._rows(np.array([index]))[0]
            if result.peak_memory_bytes:  # known, whatever the status: exact
                y = math.log(result.peak_memory_bytes) - self.log_peak[index]
                self.belief_mean, self.belief_cov = condition(self.belief_mean, self.belief_cov, row, y, NOISE_MEMORY[0])
            elif result.status == "oom":
                bound = math.log(budget_bytes) - self.log_peak[index]
                self.belief_mean, self.belief_cov = censor(self.belief_mean, self.belief_cov, row, bound, NOISE_MEMORY[0])

    def _rows(self, indices: np.ndarray) -> np.ndarray:
        """The error model's features of configs `indices`: the common offset, then their knob values."""
        return np.concatenate((np.ones((len(indices), 1)), self.onehot[indices]), axis=1)

    def fit_probability(self, indices: np.ndarray, budget_bytes: int) -> np.ndarray:
        """P(peak <= budget) of the configs `indices` under the memory error model."""
        rows = self._rows(indices)
        mean = self.log_peak[indices] + rows @ self.belief_mean
        var = ((rows @ self.belief_cov) * rows).sum(axis=1) + NOISE_MEMORY[0] ** 2
        return ndtr((math.log(budget_bytes) - mean) / np.sqrt(var))

    def chance_of_better(self, untried: np.ndarray, budget_bytes: int, best: float, margin: float = MIN_MARGIN) -> float:
        """The convergence stop's figure (autotune.search.convergence) for configs `untried`: the chance that one fits
        and is more than `margin` faster than `best`. Memory: the error model above; throughput: the corrected
        predictions, each knob value's offset as wide as its trials leave it (independent Gaussians)."""
        if not best:
            return 1.0
        if not len(untried):
            return 0.0
        rows = self._rows(untried)
        memory = Joint(rows, self.belief_mean, self.belief_cov, NOISE_MEMORY[0])
        room = math.log(budget_bytes) - self.log_peak[untried]
        base = self.total / self.trials if self.trials else 0.0
        offsets = (self.sums - self.counts * base) / (self.counts + SHRINK)
        per_knob = dict(PRIOR_TIME[1])
        prior = np.array([per_knob.get(KNOBS[k], 0.0) for k in self._value_knobs]) ** 2
        noise = NOISE_TIME[0] ** 2
        common = noise / self.trials if self.trials else PRIOR_TIME[0] ** 2
        cov = np.diag(np.concatenate(([common], 1.0 / (1.0 / prior + self.counts / noise))))
        time = Joint(rows, np.concatenate(([base], offsets)), cov, 0.0)
        needed = math.log(best * (1 + margin)) - self.log_predicted[untried]
        return chance_of_better(memory, room, time, needed)

    def log_throughput(self) -> np.ndarray:
        """Log of the corrected predicted throughput of every config."""
        if not self.trials:
            return self.log_predicted
        base = self.total / self.trials
        offsets = (self.sums - self.counts * base) / (self.counts + SHRINK)
        return self.log_predicted + base + self.onehot @ offsets

    def throughput(self) -> np.ndarray:
        """Corrected predicted throughput of every config."""
        return np.exp(self.log_throughput())

    def fits(self, budget_bytes: int) -> np.ndarray:
        """Configs whose corrected predicted peak is within the budget."""
        return self.log_peak <= math.log(budget_bytes) - self.memory

    def peak_at(self, index: int) -> float:
        return math.exp(self.log_peak[index] + self.memory)

    def peak(self) -> np.ndarray:
        """Corrected predicted peak of every config (the predictions until a peak was measured)."""
        return np.exp(self.log_peak + self.memory)


def _memory_prior(value_knobs: np.ndarray) -> np.ndarray:
    """The prior covariance of (common offset, one offset per knob value): PRIOR_MEMORY's widths."""
    per_knob = dict(PRIOR_MEMORY[1])
    return np.diag([PRIOR_MEMORY[0] ** 2] + [per_knob.get(KNOBS[k], 0.0) ** 2 for k in value_knobs])
