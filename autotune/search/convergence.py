"""When a search is done: the chance that some config not yet tried beats the best measured by more than
the launch noise, and the rule that stops the search once that chance is small.

The chance comes from the error models of autotune.prediction.uncertainty (the sweep's, recalibrated after every
trial): each untried config that the pruner would still run (probability of fitting at least its floor)
fits in a draw if its drawn peak is within the budget, and beats the best if its drawn throughput exceeds
best x (1 + margin), the margin being the typical difference between two launches of one config (at least
MIN_MARGIN). The configs' errors are drawn jointly, from the posterior of the knob-value offsets (a knob
value no trial used at its prior width, shared by every config that takes it), because they are strongly
correlated: a product of per-config probabilities would treat fifty fp16 configs as fifty independent
chances when they share one unknown fp16 offset. Each config adds a residual of its own: what the knob values
leave unexplained less the launch spread (the question is about a config's typical speed, not one launch), half
of it (PAIR_SHARE) shared through pairs of knob values (`Process`).

Four calibrations keep the figure from staying high where the trials already say the estimator's shape is
right (issue 28: on the simulated worlds the chance stayed near 1 for 20 trials at 3% launch noise even where
the estimator was exact):
- the time model is the *evidenced* one (ErrorModel.evidenced, autotune.prediction.uncertainty): the knob values' prior
  widths scaled by empirical-Bayes estimates from the offsets the trials measured, one common scale and then
  one per knob shrunk to it, so an untried value is as uncertain as its knob's measured values turned out to be
  (at 3% launch noise the per-knob stage stopped a median 2 trials sooner for the same recommendations);
- the per-config residual is what the evidenced fit leaves unexplained beyond the launch spread, estimated as a
  variance component (`per_config`): the residuals' sum of squares less what the launch noise accounts for, over
  the fit's degrees of freedom, with the prior's per-config spread (NOISE_TIME's, less the machine's launch
  spread it includes) counted as NOISE_TIME's weight in trials. Before, the prior's total noise (0.15, launch
  spread included) was weighed against the residuals and the launch spread taken off after: on the simulated
  worlds at 3% launch noise that left ~0.09 per config where the trials showed ~0.05 (the worlds' own
  per-config term is 0.05), summed over hundreds of untried configs;
- the trials are conditioned at that same noise: a trial's log-ratio is its knob values' offsets plus its config's
  residual plus one launch's spread. The evidenced fit estimates one noise for both, its prior holding this CPU's
  13% launch spread (NOISE_TIME), so where launches are quieter (a GPU's, the simulated worlds' 3%) it took the
  trials for noisier than the figure says they are (~0.10 after 12 trials at 3% where residual plus launch gave
  0.06-0.08) and the offsets for less certain. At 3% this stopped 25 -> 21.5 trials on seeds 0-3 (23.5 -> 23 held
  out), at the optimum in the median and 0.965 at the 5th percentile (before 0.969); at 10% it changed nothing
  (the two noises are close there);
- half of a config's residual is shared through pairs of knob values (`Process`, a Gaussian process over the
  configs): the estimator's formulas miss interactions, and on the committed real surfaces pairs explain 75%
  (tiny-cpu) and 25% (small-llama-cpu) of what the knob values leave (benchmarks/pair_share.py). Drawn
  independently, hundreds of near-twins of the tried configs counted as as many chances to beat the best; shared,
  a near-twin of a trial that measured close to its fit is close too. On the replay surfaces this stopped 17.5 ->
  15 trials, every sweep at the optimum; on the simulated worlds at 3% noise, which have no pairwise structure
  (their per-config term is independent: the share's worst case), 21.5 -> 20 on seeds 0-3 and 23 -> 20.5 held
  out with the same recommendations at the stop (0.965 and 0.956 at the 5th percentile); at 10%, 22 -> 21 and
  24.5 -> 23, the 5th percentile the same (0.767, 0.840). Where the figure said 5-20% at 3% noise, 22% of the
  recommendations were more than 2% short on seeds 0-3 (before 7%; held out 11%, before 9%): the price, in such
  a world, of a share it does not have.
Forecasts, pruning and every strategy's proposals keep the plain model.
The best is one launch too: its typical speed may lie below what it measured (a lucky launch), and every untried
config is compared with it, so each draw shifts the best by one shared N(0, launch spread) term. At 10% launch
noise (benchmarks/results/search_efficiency_stop.md) that moved the confirmed recommendation's 5th percentile from
0.789 to 0.851 of the optimum for 3.5 more trials in the median; at 3% it changed little. The winner's curse (the
best is the fastest of many launches, so biased upwards) is not modelled: the figure still trusts a lucky best.
Drawing the best's typical speed from its launch combined with the fit at its config was tried (80a3a9d, reverted):
at 10% noise it stopped fewer sweeps (77% -> 44%) for the same confirmed recommendation and no better calibration
(benchmarks/results/search_efficiency_stop_fitted_best.md).

    chance = P(some untried config fits and is more than `margin` faster than the best)   (DRAWS draws)

Only configs whose marginal chance is not negligible (MIN_MARGINAL) are drawn, at most MAX_DRAWN of them, so a
space of thousands of configs costs one eigendecomposition of at most that many rows. The draws use a fixed
seed: the figure is a function of the recorded trials, so a resumed sweep computes the same one.

The rule (`StopRule`): stop the search once the chance is below the threshold (`--stop-when`, default
DEFAULT_STOP_WHEN; 0 turns it off) after at least MIN_TRIALS launched search trials. With the length of the
training run (`--train-for`, issue 41), also once no untried config's expected saving of that run (`expected_gains`:
the share of it a config is expected to save, from the same marginals) pays for its predicted trial seconds: the
chance says whether a better config is likely, this whether finding it pays (benchmarks/train_for.py). The
thresholds were chosen on benchmarks/search_efficiency.py (benchmarks/results/search_efficiency_stop.md); the minimum
does not bind there (in no committed run is the figure under 0.27 in the first 5 trials, and in the simulated worlds
raising it to 10 changes no stop at the default threshold). Why the stop takes a median 20-23 trials in the
simulated worlds rather than the issue's 12: benchmarks/stop_floor.py (results/stop_floor.md).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
from scipy.special import ndtr

from autotune.values.argtypes import STOP_WHEN_ALLOWED
from autotune.values.config import KNOBS, Config, ConfigError
from autotune.search.confirm import MACHINE_SIGMA
from autotune.prediction.uncertainty import NOISE_TIME, ErrorModel, Forecast, Uncertainty

DEFAULT_STOP_WHEN = 0.05
MIN_TRIALS = 6  # launched search trials before the rule may stop a search
MIN_MARGIN = 0.02  # "faster" means faster by at least this much, whatever the launch noise
TYPICAL = math.sqrt(2) * 0.6744897501960817  # median |ln(a/b)| of two launches, in sigmas (autotune.search.confirm)
DRAWS = 1000
SEED = 28
MIN_MARGINAL = 1e-5  # a config less likely than this to fit and beat the best is left out of the draws
MAX_DRAWN = 400  # at most this many configs are drawn (the likeliest)
# The per-config spread beyond launch noise before any trial: the prior noise of the time model less the
# launch spread of this machine that it includes, counted as the prior's weight in trials (`per_config`).
RESIDUAL_PRIOR = math.sqrt(max(NOISE_TIME[0] ** 2 - MACHINE_SIGMA ** 2, 0.0))
RESIDUAL_WEIGHT = NOISE_TIME[1]
PAIR_SHARE = 0.5  # of the per-config residual, the share pairs of knob values carry (`Process`)


@dataclass(frozen=True)
class Convergence:
    """The rule's figure after a search trial: the chance that an untried config is more than `margin`
    faster than the best measured, over the `candidates` untried configs that could still run."""

    chance: float
    margin: float  # relative: 0.02 is 2%
    trials: int  # launched search trials it was computed after
    candidates: int = 0
    # The most any one untried config is expected to save of a training run at the best's speed: max over configs
    # of P(fit) x E[(1 - best / its speed)+], from its marginal (a one-step expected improvement, as Bayesian
    # optimisation's stopping rules use, in the run's time); None: not computed (nothing measured yet, an older record).
    expected_gain: float | None = None
    # The same per second of the config's trial, the best such ratio (`--train-for`'s stop); None: not computed.
    gain_per_trial_s: float | None = None

    def describe(self) -> str:
        """'3% chance an untried config is >2% faster'."""
        return f"{percent(self.chance)} chance an untried config is >{self.margin:.0%} faster"

    def to_extra(self) -> dict[str, Any]:
        """What a trial's record carries (trials.jsonl `extra`)."""
        gains = {k: float(f"{v:.6g}") for k, v in (("expected_gain", self.expected_gain),
                                                    ("gain_per_trial_s", self.gain_per_trial_s)) if v is not None}
        return {"chance_of_better": round(self.chance, 6), "better_margin": round(self.margin, 6), **gains}


def percent(p: float) -> str:
    """41%, 3%, <1% (a chance drawn as 0 is not a certainty: '<1%' unless exactly none could beat it)."""
    if 0 < p < 0.005:
        return "<1%"
    return f"{p:.0%}"


@dataclass(frozen=True)
class StopRule:
    """Stop the search once the chance of a better config is below `threshold` (0: never), or with `train_s` once no
    untried config pays for its trial on the training run, after at least `min_trials` launched search trials."""

    threshold: float = DEFAULT_STOP_WHEN
    min_trials: int = MIN_TRIALS
    # How long the recommendation will train (`--train-for`); None: off. With it, the search also stops once no
    # untried config is expected to save its training run more seconds than its own trial costs (gain x train_s <
    # trial seconds; the devices count on both sides alike).
    train_s: float | None = None

    def __post_init__(self) -> None:
        check_stop_when(self.threshold)
        check_seconds(self.train_s, "train_s")

    def met(self, state: Convergence | None) -> bool:
        return self.chance_met(state) or self.seconds_met(state)

    def chance_met(self, state: Convergence | None) -> bool:
        return (self.threshold > 0 and state is not None and state.trials >= self.min_trials
                and state.chance < self.threshold)

    def seconds_met(self, state: Convergence | None) -> bool:
        """No untried config pays for its trial on the training run (`train_s`)."""
        return (self.train_s is not None and state is not None and state.trials >= self.min_trials
                and state.gain_per_trial_s is not None and state.gain_per_trial_s * self.train_s < 1.0)


def check_stop_when(value: Any, name: str = "stop_when") -> float:
    """`value` as a threshold, or ConfigError naming it and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < 1:
        raise ConfigError(f"{name} {value!r}: allowed {STOP_WHEN_ALLOWED}")
    return float(value)


def check_seconds(value: float | None, name: str = "train_s") -> float | None:
    """`value` (None: off) as a positive number of seconds (a time budget, a training run), or ConfigError naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ConfigError(f"{name} {value!r}: must be a positive number of seconds")
    return float(value)  # numpy's too, as a float (run.json's JSON takes no np.float32)


def margin_of(launch_sigma: float | None) -> float:
    """The relative margin a config must beat the best by: the typical difference of two launches."""
    return max(MIN_MARGIN, math.expm1(TYPICAL * (launch_sigma or 0.0)))


def assess(untried: Iterable[Config], forecast: Callable[[Config], Forecast], errors: Uncertainty,
           budget_bytes: int, best: float | None, launch_sigma: float | None, trials: int,
           min_fit: float = 0.0, residual: float | None = None, pair_share: float = PAIR_SHARE,
           seconds: Callable[[Config], float] | None = None) -> Convergence:
    """The figure of a sweep: `untried` configs, their forecasts and the error models behind them, the best
    measured throughput (None: nothing fits yet, chance 1), the launch spread, the launched search trials;
    `residual`: the per-config spread where it is known (a simulated world's), else estimated (`per_config`), and
    `pair_share` the part of it that pairs of knob values share (`Process`); `seconds`: a config's expected trial
    seconds (the gain per trial-second is then computed too)."""
    margin = margin_of(launch_sigma)
    if not best:
        return Convergence(1.0, margin, trials)
    configs, peaks, speeds = [], [], []
    for c in untried:
        f = forecast(c)
        if f.fit_probability(budget_bytes) >= min_fit:
            configs.append(c)
            peaks.append(max(f.predicted_peak_bytes, 1))
            speeds.append(max(f.predicted_throughput, 1e-300))
    if not configs:  # nothing left to gain
        return Convergence(0.0, margin, trials, 0, 0.0, None if seconds is None else 0.0)
    room = math.log(budget_bytes) - np.log(np.array(peaks, dtype=float))
    needed = math.log(best * (1 + margin)) - np.log(np.array(speeds))
    time_model = evidenced(errors.time)
    if residual is None:
        residual = per_config(time_model, launch_sigma or 0.0)
    memory = Joint(*errors.memory.joint(configs), errors.memory.noise)
    time = Process.conditioned(time_model, configs, residual, launch_sigma or 0.0, pair_share)
    best_sd = launch_sigma or 0.0
    gains = expected_gains(memory, room, time, needed - math.log1p(margin), best_sd)
    per_s = None if seconds is None else float(np.max(gains / np.array([max(seconds(c), 1e-9) for c in configs])))
    return Convergence(chance_of_better(memory, room, time, needed, best_sd=best_sd), margin, trials, len(configs),
                       float(np.max(gains)), per_s)


def expected_gains(memory: LogRatios, room: np.ndarray, time: LogRatios, below_best: np.ndarray,
                   best_sd: float = 0.0) -> np.ndarray:
    """Per row, P(memory log-ratio <= room) x E[(1 - exp(-Y))+], Y = time log-ratio - below_best + d, d ~ N(0,
    best_sd^2) (Y: the config's log speed over the best's): the share of a training run at the best's speed that
    running this config instead is expected to save, from the marginals (a log-normal's partial expectation:
    Phi(mu/s) - exp(-mu + s^2/2) Phi((mu - s^2)/s))."""
    m_mean, m_sd = memory.marginal()
    t_mean, t_sd = time.marginal()
    sd = np.maximum(np.sqrt(t_sd ** 2 + best_sd ** 2), 1e-12)
    mu = t_mean - below_best
    saved = ndtr(mu / sd) - np.exp(-mu + sd ** 2 / 2) * ndtr((mu - sd ** 2) / sd)
    return ndtr((room - m_mean) / np.maximum(m_sd, 1e-12)) * np.maximum(saved, 0.0)


def per_config(model: ErrorModel, launch_sigma: float = 0.0) -> float:
    """The spread of a config's typical log-ratio that no knob value explains, the launch noise left out: a
    variance component, (prior weight x RESIDUAL_PRIOR^2 + the residuals' sum of squares less what launch noise
    of `launch_sigma` explains over the fit's degrees of freedom) / (prior weight + those degrees of freedom).
    The question is about a config's typical speed, not one launch; where the trials' residuals are no larger
    than their launch noise, the prior's weight alone keeps it above 0, shrinking as trials come."""
    dof = model.residual_dof
    excess = max(model.residual_ss - dof * launch_sigma ** 2, 0.0)
    return math.sqrt((RESIDUAL_WEIGHT * RESIDUAL_PRIOR ** 2 + excess) / (RESIDUAL_WEIGHT + dof))


def evidenced(model: ErrorModel) -> ErrorModel:
    """The model the figure draws from: `model` refitted with the knob values' prior widths scaled by what the
    trials showed of the values they used (ErrorModel.evidenced, empirical Bayes). Where the estimator's shape
    is right the fitted offsets come out small, and so do an untried value's and the fitted values' spread;
    where it is wrong they stay wide or widen. A model without that twin is used as it is."""
    return model.evidenced if model.evidenced is not None else model


@dataclass(frozen=True)
class Joint:
    """Log-ratios rows @ b + noise with b ~ N(mean, cov), the noise independent per row."""

    rows: np.ndarray
    mean: np.ndarray
    cov: np.ndarray
    noise: float

    def marginal(self) -> tuple[np.ndarray, np.ndarray]:
        """Per row, the mean and sd of its log-ratio."""
        var = np.einsum("ij,jk,ik->i", self.rows, self.cov, self.rows) + self.noise ** 2
        return self.rows @ self.mean, np.sqrt(np.maximum(var, 1e-300))

    def draws(self, keep: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """rows[keep] x n joint draws (the offsets shared, the noise per row)."""
        values, vectors = np.linalg.eigh(self.cov)
        root = vectors * np.sqrt(np.maximum(values, 0.0))
        offsets = self.mean[:, None] + root @ rng.standard_normal((len(self.mean), n))
        out = self.rows[keep] @ offsets
        if self.noise > 0:
            out += self.noise * rng.standard_normal(out.shape)
        return out


class LogRatios(Protocol):
    """What `chance_of_better` draws from: per row the marginal (mean, sd) and joint draws of chosen rows."""

    def marginal(self) -> tuple[np.ndarray, np.ndarray]: ...

    def draws(self, keep: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray: ...


@dataclass(frozen=True)
class Kernel:
    """The prior covariance of two configs' typical log-ratios (`Process`), from their knob values' codes."""

    weights: np.ndarray  # per knob, the prior variance of one of its values' offsets
    common: float  # the common offset's prior variance
    paired: np.ndarray  # per knob, whether it counts in pairs (it takes more than one value)
    pair_var: float  # residual^2 x pair share / the number of knob pairs
    own_var: float  # residual^2 x (1 - pair share)

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        agree = a[:, None, :] == b[None, :, :]
        shared = agree[..., self.paired].sum(axis=-1)
        return (self.common + agree @ self.weights + self.pair_var * shared * (shared - 1) / 2
                + self.own_var * agree.all(axis=-1))

    @property
    def variance(self) -> float:
        """A config's covariance with itself (the diagonal of __call__)."""
        paired = int(self.paired.sum())
        return self.common + float(self.weights.sum()) + self.pair_var * paired * (paired - 1) / 2 + self.own_var


@dataclass(frozen=True)
class Process:
    """The typical log-ratios of `configs` given the trials, a Gaussian process. A config's log-ratio is the common
    offset, plus one offset per knob value (shared by every config that takes it), plus its own residual, a share
    `pair_share` of which is one term per pair of knob values (shared by the configs that take both) and the rest
    its own; a trial adds one launch's spread. So two configs covary by the common prior^2, plus the widths^2 of
    the knob values they share, plus residual^2 x pair_share x the share of knob pairs they share.

    Why pairs: the estimator's formulas miss interactions (offload with a stage, micro-batch with checkpointing),
    and on the committed real surfaces pairs of knob values explain much of what the values alone leave (PAIR_SHARE).
    Drawing every config's residual independently counted hundreds of near-twins of the tried configs as as many
    independent chances to beat the best. At pair_share 0 this is the knob-value model of `ErrorModel` conditioned
    on the trials at hypot(residual, launch spread), with an independent residual per config."""

    kernel: Kernel
    configs: np.ndarray  # codes of the configs' knob values (`_codes`), one row each
    gain: np.ndarray  # cov(configs, trials) @ cov(trials)^-1
    cross: np.ndarray  # cov(configs, trials)
    mean: np.ndarray
    sd: np.ndarray

    @classmethod
    def conditioned(cls, model: ErrorModel, configs: Sequence[Config], residual: float, launch_sigma: float,
                    pair_share: float = PAIR_SHARE) -> "Process":
        """`configs`' log-ratios given `model`'s prior widths and exact observations."""
        if model.censored:
            raise ValueError("the convergence figure conditions on exact observations only; this model has "
                             f"{model.censored} out-of-memory bounds")
        codes = _codes([*configs, *(c for c, _ in model.observed)])
        ours, tried = codes[:len(configs)], codes[len(configs):]
        paired = (codes != codes[:1]).any(axis=0)
        pairs = int(paired.sum()) * (int(paired.sum()) - 1) // 2
        share = pair_share if pairs else 0.0
        widths = dict(model.value_prior)
        kernel = Kernel(np.array([widths.get(k, 0.0) ** 2 for k in KNOBS]), model.common_prior ** 2, paired,
                        residual ** 2 * share / max(pairs, 1), residual ** 2 * (1 - share))
        cross = kernel(ours, tried)
        trials = kernel(tried, tried) + (launch_sigma ** 2 + 1e-12) * np.eye(len(tried))
        gain = np.linalg.solve(trials, cross.T).T if len(tried) else cross
        var = kernel.variance - np.einsum("ij,ij->i", gain, cross)
        return cls(kernel, ours, gain, cross, gain @ np.array([y for _, y in model.observed]),
                   np.sqrt(np.maximum(var, 1e-300)))

    def marginal(self) -> tuple[np.ndarray, np.ndarray]:
        return self.mean, self.sd

    def draws(self, keep: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """configs[keep] x n joint draws."""
        rows = self.configs[keep]
        cov = self.kernel(rows, rows) - self.gain[keep] @ self.cross[keep].T
        values, vectors = np.linalg.eigh((cov + cov.T) / 2)
        root = vectors * np.sqrt(np.maximum(values, 0.0))
        return self.mean[keep, None] + root @ rng.standard_normal((len(keep), n))


def _codes(configs: Sequence[Config]) -> np.ndarray:
    """Per config, per knob, an integer naming its value (equal values, equal codes)."""
    seen: list[dict[Any, int]] = [{} for _ in KNOBS]
    return np.array([[index.setdefault(getattr(c, k), len(index)) for k, index in zip(KNOBS, seen)]
                     for c in configs], dtype=int).reshape(len(configs), len(KNOBS))


def chance_of_better(memory: LogRatios, room: np.ndarray, time: LogRatios, needed: np.ndarray, draws: int = DRAWS,
                     seed: int = SEED, best_sd: float = 0.0) -> float:
    """P(some row has its memory log-ratio <= room and its time log-ratio > needed + d), the two models
    independent of each other; d ~ N(0, best_sd^2) is shared by every row: the best's own launch noise (the
    best is one launch, and its typical speed may lie below it, which every untried config is compared with)."""
    m_mean, m_sd = memory.marginal()
    t_mean, t_sd = time.marginal()
    t_sd = np.sqrt(t_sd ** 2 + best_sd ** 2)
    marginal = ndtr((room - m_mean) / m_sd) * ndtr((t_mean - needed) / t_sd)
    keep = np.flatnonzero(marginal >= MIN_MARGINAL)
    if not len(keep):
        return 0.0
    keep = keep[np.argsort(-marginal[keep], kind="stable")[:MAX_DRAWN]]
    rng = np.random.default_rng(seed)
    fits = memory.draws(keep, draws, rng) <= room[keep, None]
    shift = best_sd * rng.standard_normal(draws) if best_sd > 0 else np.zeros(draws)
    beats = time.draws(keep, draws, rng) > needed[keep, None] - shift[None, :]
    return float((fits & beats).any(axis=0).mean())


def recorded(results: Sequence[Any]) -> Convergence | None:
    """The figure the latest search trial of `results` recorded (a resumed sweep keeps the rule's state)."""
    search = [r for r in results if r.status != "pruned" and r.extra.get("phase") != "confirm"]
    if not search or not isinstance(search[-1].extra.get("chance_of_better"), (int, float)):
        return None
    extra = search[-1].extra
    gains = [float(v) if isinstance(v, (int, float)) else None for v in (extra.get("expected_gain"),
                                                                         extra.get("gain_per_trial_s"))]
    return Convergence(float(extra["chance_of_better"]), float(extra.get("better_margin") or MIN_MARGIN), len(search),
                       0, *gains)


def trace(results: Sequence[Any]) -> list[tuple[int, float]]:
    """(trial number, chance) of every recorded result that carries the figure, in order."""
    out: list[tuple[int, float]] = []
    for r in results:
        chance = r.extra.get("chance_of_better")
        if isinstance(chance, (int, float)) and not isinstance(chance, bool):
            out.append((int(r.extra.get("trial") or len(out) + 1), float(chance)))
    return out


def describe_trace(points: Sequence[tuple[int, float]], most: int = 8) -> str:
    """'41% (#3) ... 8% (#9) ... 3% (#12)': the chance as the sweep went, at most `most` points."""
    if not points:
        return ""
    step = max(1, math.ceil(len(points) / most))
    chosen = list(points[::step])
    if chosen[-1] != points[-1]:
        chosen.append(points[-1])
    return " ... ".join(f"{percent(p)} (#{n})" for n, p in chosen)
