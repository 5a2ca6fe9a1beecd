"""How far to trust a calibrated prediction: the estimator's error as a distribution, per config.

Calibration (autotune.prediction.calibrate) fits a few free scales; what it cannot fix is the shape of the formulas,
and that error depends on the knob values: a calibration fitted on checkpointing-on trials says little
about checkpointing off. So the error of the log of each prediction (peak memory; throughput) is modelled
as a sum of one unknown offset per knob value plus a common one plus noise,

    log(measured / predicted) = b0 + sum over knobs of b[knob, value] + noise

with a Gaussian prior on every offset (wide for the common one before any trial, PRIOR_MEMORY /
PRIOR_TIME per knob value) and Bayesian linear regression on the measured trials. A knob value no trial
used keeps its prior width; one that trials cover narrows to what their spread allows. A prediction thus
becomes a log-normal: `Forecast` (mean and sigma of the log-ratio), from which come intervals, the
probability of fitting a budget and the expected gain over the best throughput found.

An out-of-memory trial with no measured peak says only "peak > budget": a censored observation, folded
in by moment matching (assumed density filtering, the one-step expectation propagation update for a step
likelihood), so it moves the offsets of its knob values up by as much as it surprises the model.
Trials whose peak is known (a replay surface, a simulation, a real run that exceeded the budget without
crashing) count as exact observations whatever their status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Iterable, Sequence

import numpy as np

from autotune.values.config import KNOBS, Config

# Prior standard deviations of the log-ratio's terms. Common offset: before any trial the estimator's
# level is uncertain (uncalibrated, ~50% high on this repo's CPU surfaces); each knob value's own
# offset: how far the formulas' shape can be off for one value (checkpointing off was over-predicted by
# ~23% on an outside surface calibrated on checkpointing-on trials only).
# Per knob: the memory formulas' weakest parts are the activations (micro-batch, checkpointing) and the
# offloads (pinned host buffers and the CPU optimizer's own copies; on a CPU accelerator the "offloaded"
# states stay in the measured process); a stage's model states are exact byte counts. With offload at
# 0.07 an offload config measured off its prediction moved the checkpointing and precision offsets instead,
# and hid tiny-cpu's optimum, 0.9% under its 0.71 GiB budget (benchmarks/search_efficiency.py, 10 seeds:
# hybrid reached it in 3 runs of 10; at 0.15, 8 trials for optuna and hybrid, 4.4% and 4.0% OOM).
PRIOR_MEMORY = (0.15, (("zero_stage", 0.07), ("micro_batch", 0.15), ("ckpt_interval", 0.15), ("precision", 0.10),
                       ("offload_optimizer", 0.15), ("offload_param", 0.15)))
PRIOR_TIME = (0.60, tuple((knob, 0.20) for knob in KNOBS))
# Noise: spread of repeated measurements plus what no knob value explains (prior value, its weight in
# trials, and a floor: a model fitted on a few trials explains them too well).
NOISE_MEMORY = (0.04, 3.0, 0.01)
NOISE_TIME = (0.15, 3.0, 0.10)
Z90 = 1.6448536269514722  # two-sided 90% interval


def normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def normal_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


@dataclass(frozen=True)
class ErrorModel:
    """Posterior of the log-ratio's offsets: `columns` name the knob values (after the common offset)."""

    columns: tuple[tuple[str, Any], ...]
    mean: tuple[float, ...]
    cov: tuple[tuple[float, ...], ...] = field(repr=False)
    noise: float
    samples: int = 0  # exact observations
    censored: int = 0  # out-of-memory bounds

    # Prior sd per knob of the offset of a knob value no observation used (not a column).
    value_prior: tuple[tuple[str, float], ...] = ()
    # What the knob values leave unexplained, without `noise`'s floor: the prior's noise and weight with the
    # residuals' sum of squares over their degrees of freedom (observations less the fit's effective
    # parameters, so a fit that explains its few trials too well is not taken at its word). None: as `noise`.
    # The convergence figure's per-config term (autotune.search.convergence); forecasts keep `noise`.
    unexplained: float | None = None
    # The same observations with the knob values' prior widths scaled by what the observations show of them
    # (`evidence_scale`, empirical Bayes): what the convergence figure draws from; forecasts keep this model.
    evidenced: "ErrorModel | None" = field(default=None, repr=False, compare=False)
    evidence_scale: float = 1.0
    # The fit's residual sum of squares over the exact observations and its degrees of freedom (observations
    # less the fit's effective parameters): what the convergence figure estimates the per-config spread from.
    residual_ss: float = 0.0
    residual_dof: float = 0.0
    # The exact observations the posterior was computed from, and the common offset's prior sd: the convergence
    # figure conditions its own process on them (autotune.search.convergence.Process).
    observed: tuple[tuple[Config, float], ...] = field(default=(), repr=False, compare=False)
    common_prior: float = 0.0

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, dict[str, float], frozenset[tuple[str, Any]]]:
        return np.array(self.mean), np.array(self.cov), dict(self.value_prior), frozenset(self.columns)

    def predict(self, config: Config) -> tuple[float, float]:
        """(mean, sigma) of log(measured / predicted) for `config`, the noise included. A knob value that is
        not a column was in no observation: its offset is still the prior's, independent of the rest."""
        mean_b, cov, prior, known = self._arrays
        x = np.array(_features(self.columns, config))
        mean = float(x @ mean_b)
        var = float(x @ cov @ x) + self.noise ** 2 + sum(
            prior.get(k, 0.0) ** 2 for k in KNOBS if (k, getattr(config, k)) not in known)
        return mean, math.sqrt(max(var, 0.0))

    def uncovered(self, config: Config) -> tuple[str, ...]:
        """`config`'s knob values that no observation used, as 'knob=value'."""
        known = set(self.columns)
        return tuple(f"{k}={getattr(config, k)}" for k in KNOBS if (k, getattr(config, k)) not in known)


    def joint(self, configs: Sequence[Config]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The joint distribution of `configs`' log-ratios, the noise left out: (rows, mean, cov) with
        log-ratio_i = rows[i] @ b, b ~ N(mean, cov). A knob value no observation used gets a column of its
        own at its prior width, shared by the configs that take it (so their errors move together)."""
        columns = columns_of(configs, self.columns)
        n = len(columns) + 1
        prior = dict(self.value_prior)
        cov = np.diag([0.0] + [prior.get(k, 0.0) ** 2 for k, _ in columns])
        index = {col: i for i, col in enumerate(columns, 1)}
        keep = [0] + [index[col] for col in self.columns]
        cov[np.ix_(keep, keep)] = np.array(self.cov)
        mean = np.zeros(n)
        mean[keep] = np.array(self.mean)
        rows = np.array([_features(columns, c) for c in configs]).reshape(len(configs), n)
        return rows, mean, cov


def columns_of(configs: Iterable[Config], first: tuple[tuple[str, Any], ...] = ()) -> tuple[tuple[str, Any], ...]:
    """`first`, then one column per other knob value the configs take (sorted, so that a model is the same
    for the same data)."""
    seen = {(k, getattr(c, k)) for c in configs for k in KNOBS} - set(first)
    return first + tuple(sorted(seen, key=lambda kv: (KNOBS.index(kv[0]), str(kv[1]))))


# Empirical Bayes for the knob values' prior widths (the evidenced model), in two stages of EM for variance
# components (EVIDENCE_STEPS steps each), E[b^2] the posterior mean^2 + variance of a fitted knob value's offset:
# - one scale s of every knob's prior sd, s^2 = (EVIDENCE_WEIGHT + sum of E[b^2] / prior^2) / (EVIDENCE_WEIGHT +
#   their count): the prior's s = 1 counted as EVIDENCE_WEIGHT knob values, as the noise's prior counts as trials;
# - then one scale per knob, shrunk to s: s_k^2 = (KNOB_EVIDENCE_WEIGHT s^2 + the knob's own sum) /
#   (KNOB_EVIDENCE_WEIGHT + its count), so a knob whose measured values sit close together narrows its untried
#   values and one whose values differ widely keeps them wide, instead of every knob taking the average. On the
#   hybrid sweeps of benchmarks/search_efficiency.py's distorted world (the same trials, the figure only) at 3%
#   launch noise this stopped 2 trials sooner at the default threshold (27 -> 25 on seeds 0-3, 25.5 -> 23.5 on
#   4-7) with the same recommendations at the stop; at weight 3 the gain was 1.5 and 0.5 trials.
EVIDENCE_WEIGHT = 3.0
KNOB_EVIDENCE_WEIGHT = 1.0
EVIDENCE_STEPS = 12


def fit_error_model(observed: Sequence[tuple[Config, float]], prior: tuple[float, tuple[tuple[str, float], ...]],
                    noise: tuple[float, float, float], censored: Sequence[tuple[Config, float]] = (),
                    evidence_weight: float | None = EVIDENCE_WEIGHT, twin: bool = True) -> ErrorModel:
    """The posterior given exact log-ratios `observed` and lower bounds `censored` (log-ratio > bound), with its
    evidenced twin attached unless `twin` is False (the prior's widths counted as `evidence_weight` knob values;
    None: the widths are known, as where benchmarks/stop_bounds.py gives the figure a simulated world's own). The
    twin costs ~30 times the plain fit, and the convergence figure draws only the time model's."""
    model = _fit(observed, prior, noise, censored)
    if not twin:
        return model
    if evidence_weight is None:
        return replace(model, evidenced=_fit(observed, prior, noise, censored, floored=False))
    widths = [w for k, w in prior[1] if any(col[0] == k for col in model.columns)]
    if not observed or not any(widths):
        return model

    def refit(scales: dict[str, float]) -> ErrorModel:
        return _fit(observed, (prior[0], tuple((k, w * scales[k]) for k, w in prior[1])), noise, censored,
                    floored=False)

    scale = 1.0
    evidenced = model
    for _ in range(EVIDENCE_STEPS):
        pooled = [r for ratios in _evidence(evidenced, prior).values() for r in ratios]
        scale = math.sqrt((evidence_weight + sum(pooled)) / (evidence_weight + len(pooled)))
        evidenced = refit({k: scale for k, _ in prior[1]})
    for _ in range(EVIDENCE_STEPS):
        found = _evidence(evidenced, prior)
        evidenced = refit({k: math.sqrt((KNOB_EVIDENCE_WEIGHT * scale ** 2 + sum(found.get(k, ())))
                                        / (KNOB_EVIDENCE_WEIGHT + len(found.get(k, ())))) for k, _ in prior[1]})
    return replace(model, evidenced=replace(evidenced, evidence_scale=scale), evidence_scale=scale)


def _evidence(model: ErrorModel, prior: tuple[float, tuple[tuple[str, float], ...]]) -> dict[str, list[float]]:
    """Per knob, E[b^2] / prior width^2 of each of its fitted values' offsets (a knob of width 0 has none)."""
    base = dict(prior[1])
    out: dict[str, list[float]] = {}
    for i, ((k, _), m) in enumerate(zip(model.columns, model.mean[1:]), 1):
        if base.get(k):
            out.setdefault(k, []).append((m ** 2 + model.cov[i][i]) / base[k] ** 2)
    return out


def _fit(observed: Sequence[tuple[Config, float]], prior: tuple[float, tuple[tuple[str, float], ...]],
         noise: tuple[float, float, float], censored: Sequence[tuple[Config, float]] = (),
         floored: bool = True) -> ErrorModel:
    """The posterior; its noise from the residuals, prior-weighted. `floored` (forecasts): over the observations,
    at least noise[2]; else (the evidenced twin) over their degrees of freedom left by the fit, no floor."""
    columns = columns_of([c for c, _ in observed] + [c for c, _ in censored])
    n = len(columns) + 1
    knob_prior = dict(prior[1])
    prior_cov = np.diag([prior[0] ** 2] + [knob_prior.get(k, 0.0) ** 2 for k, _ in columns])
    xs = np.array([_features(columns, c) for c, _ in observed]).reshape(len(observed), n)
    ys = np.array([y for _, y in observed])
    sigma = noise[0]
    for _ in range(2 if floored else 3):  # the noise from the residuals of a fit with the previous noise
        used = sigma
        mean, cov = _posterior(prior_cov, xs, ys, sigma)
        residual = float(((ys - xs @ mean) ** 2).sum()) if len(ys) else 0.0
        # Effective parameters of the fit: the trace of its hat matrix, x' cov x / noise^2 over observations.
        effective = float(np.einsum("ij,jk,ik->", xs, cov, xs)) / used ** 2 if len(ys) else 0.0
        if floored:
            sigma = max(math.sqrt((noise[1] * noise[0] ** 2 + residual) / (noise[1] + len(ys))), noise[2])
        else:
            sigma = max(math.sqrt((noise[1] * noise[0] ** 2 + residual)
                                  / (noise[1] + max(len(ys) - effective, 0.0))), 1e-3)
    unexplained = math.sqrt((noise[1] * noise[0] ** 2 + residual) / (noise[1] + max(len(ys) - effective, 0.0)))
    for config, bound in censored:
        mean, cov = censor(mean, cov, _features(columns, config), bound, sigma)
    return ErrorModel(columns, tuple(float(v) for v in mean), tuple(tuple(float(v) for v in row) for row in cov),
                      sigma, len(observed), len(censored), tuple(prior[1]), unexplained,
                      residual_ss=residual, residual_dof=max(len(ys) - effective, 0.0),
                      observed=tuple(observed), common_prior=prior[0])


def _features(columns: tuple[tuple[str, Any], ...], config: Config) -> list[float]:
    return [1.0] + [1.0 if getattr(config, k) == v else 0.0 for k, v in columns]


def _posterior(prior_cov: np.ndarray, xs: np.ndarray, ys: np.ndarray, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    if not len(ys):
        return np.zeros(len(prior_cov)), prior_cov
    precision = np.linalg.inv(prior_cov) + xs.T @ xs / sigma ** 2
    cov = np.linalg.inv(precision)
    return cov @ xs.T @ ys / sigma ** 2, cov


def condition(mean: np.ndarray, cov: np.ndarray, x: np.ndarray, y: float,
              sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """One exact observation y = x.b + noise, folded in (the posterior `_posterior` gives for the batch, one
    row at a time: what the environment updates after every trial)."""
    s = cov @ x
    gain = s / (float(x @ s) + sigma ** 2)
    return mean + gain * (y - float(x @ mean)), cov - np.outer(gain, s)


def censor(mean: np.ndarray, cov: np.ndarray, x: Sequence[float] | np.ndarray, bound: float,
           sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Moment-matched update for "y > bound" (y = x.b + noise)."""
    xv = np.asarray(x, dtype=float)
    s = cov @ xv
    var = float(xv @ s) + sigma ** 2
    sd = math.sqrt(var)
    alpha = (bound - float(xv @ mean)) / sd
    tail = normal_cdf(-alpha)
    if tail < 1e-12:  # so surprising that the Gaussian tail is numerically empty: the bound itself
        ratio = alpha + 1.0 / max(alpha, 1.0)
    else:
        ratio = normal_pdf(alpha) / tail
    mean = mean + s * (ratio / sd)
    cov = cov - np.outer(s, s) * (ratio * (ratio - alpha) / var)
    return mean, cov


@dataclass(frozen=True)
class Forecast:
    """A calibrated prediction with its uncertainty: peak and throughput are log-normal around the
    estimator's figures times exp(mean)."""

    predicted_peak_bytes: int
    predicted_throughput: float
    peak_log: tuple[float, float]  # (mean, sigma) of log(measured peak / predicted)
    time_log: tuple[float, float]  # (mean, sigma) of log(measured throughput / predicted)

    @property
    def peak_bytes(self) -> float:
        """The median peak."""
        return self.predicted_peak_bytes * math.exp(self.peak_log[0])

    @property
    def throughput(self) -> float:
        """The median throughput."""
        return self.predicted_throughput * math.exp(self.time_log[0])

    def peak_interval(self, z: float = Z90) -> tuple[float, float]:
        mean, sigma = self.peak_log
        return (self.predicted_peak_bytes * math.exp(mean - z * sigma),
                self.predicted_peak_bytes * math.exp(mean + z * sigma))

    def throughput_interval(self, z: float = Z90) -> tuple[float, float]:
        mean, sigma = self.time_log
        return (self.predicted_throughput * math.exp(mean - z * sigma),
                self.predicted_throughput * math.exp(mean + z * sigma))

    def fit_probability(self, budget_bytes: int) -> float:
        """P(peak <= budget)."""
        if self.predicted_peak_bytes <= 0:
            return 1.0
        mean, sigma = self.peak_log
        gap = math.log(budget_bytes / self.predicted_peak_bytes) - mean
        if sigma <= 0:
            return 1.0 if gap >= 0 else 0.0
        return normal_cdf(gap / sigma)

    def expected_gain(self, best: float) -> float:
        """E[max(throughput - best, 0)] in samples/s (log-normal throughput), ignoring whether it fits."""
        mean, sigma = self.time_log
        mu = math.log(max(self.predicted_throughput, 1e-300)) + mean
        if best <= 0:
            return math.exp(mu + sigma ** 2 / 2)
        if sigma <= 0:
            return max(math.exp(mu) - best, 0.0)
        d1 = (mu + sigma ** 2 - math.log(best)) / sigma
        return math.exp(mu + sigma ** 2 / 2) * normal_cdf(d1) - best * normal_cdf(d1 - sigma)

    def value(self, budget_bytes: int, best: float) -> float:
        """Expected gain weighed by the probability of fitting: what running it is worth."""
        return self.fit_probability(budget_bytes) * self.expected_gain(best)


@dataclass(frozen=True)
class Uncertainty:
    """The error models of memory and throughput for one sweep (a workload, a machine, a calibration)."""

    memory: ErrorModel
    time: ErrorModel

    def forecast(self, config: Config, predicted_peak_bytes: int, predicted_throughput: float) -> Forecast:
        return Forecast(predicted_peak_bytes, predicted_throughput, self.memory.predict(config),
                        self.time.predict(config))


PRIOR_UNCERTAINTY = Uncertainty(fit_error_model([], PRIOR_MEMORY, NOISE_MEMORY), fit_error_model([], PRIOR_TIME, NOISE_TIME))


def format_interval(low: float, high: float, fmt) -> str:
    """'(0.91 GiB-1.22 GiB, 90%)' with the given value formatter."""
    return f"({fmt(low)}-{fmt(high)}, 90%)"
