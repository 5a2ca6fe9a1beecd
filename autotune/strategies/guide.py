"""Model-guided picks shared by the strategies that read the sweep's forecast (SearchContext.forecast): what is
worth running now.

- `most_valuable`: the untried config of the highest expected gain over the best found, weighed by its
  probability of fitting (probability x E[max(throughput - best, 0)], the throughput log-normal of the error
  model of autotune.prediction.uncertainty, updated after every trial), per second of its trial once a best was
  found (the first pick is the likeliest best, whatever it costs). A config whose knob values no trial used has
  the widest interval, so the expected gain itself sends trials where the model is unsure and it matters.

Seconds (issue 41): a trial's expected wall seconds (SearchContext.trial_seconds: autotune.prediction.trial_time
at the calibrated step time, out-of-memory deaths and first op builds weighed in) divide what it is worth, so that
a search under a time budget buys the most gain, or information, per second; without them every trial costs one.
"""

from __future__ import annotations

from typing import Collection

import numpy as np

from autotune.values.config import Config
from autotune.strategies import SearchContext
from autotune.prediction.uncertainty import Forecast

# A guided pick is one at least this likely to fit, while there is one: even odds, as a config whose knob
# values no trial covered is never much likelier (its interval is wide; a stricter floor never covers them:
# the estimator world's optimum at 97% of the budget stayed out of reach at 0.8), and an out-of-memory
# still teaches a bound.
LIKELY = 0.5
NEARLY = 0.9
ORDERED = ("zero_stage", "micro_batch", "ckpt_interval")  # knobs whose values lie on a line


def forecasts(context: SearchContext, tried: Collection[Config]) -> dict[Config, Forecast]:
    """The forecast of every untried config of the space (in the space's order) at least LIKELY to fit, or
    if none is, nearly as likely as the likeliest (before any trial an uncalibrated estimator may predict
    every config over the budget)."""
    assert context.forecast is not None, "a guided pick needs the sweep's forecast"
    found = {c: context.forecast(c) for c in context.space if c not in tried}
    fit = {c: f.fit_probability(context.budget_bytes) for c, f in found.items()}
    floor = min(LIKELY, NEARLY * max(fit.values(), default=0.0))
    return {c: f for c, f in found.items() if fit[c] >= floor}


def seconds(context: SearchContext, configs: Collection[Config]) -> np.ndarray:
    """Each config's trial's expected seconds (ones where the sweep predicts none)."""
    if context.trial_seconds is None:
        return np.ones(len(configs))
    return np.array([max(context.trial_seconds(c), 1e-9) for c in configs])


def most_valuable(context: SearchContext, tried: Collection[Config], best: float) -> Config | None:
    found = forecasts(context, tried)
    if not found:
        return None
    configs = list(found)
    value = np.array([found[c].value(context.budget_bytes, best) for c in configs])
    per = seconds(context, configs) if best > 0 else np.ones(len(configs))
    return configs[int(np.argmax(value / per))]


def most_worth(context: SearchContext, tried: Collection[Config], best: float) -> float:
    """The largest probability x expected gain over `best` of an untried config (samples/s), whatever it costs."""
    found = forecasts(context, tried)
    return max((f.value(context.budget_bytes, best) for f in found.values()), default=0.0)


def worth(context: SearchContext, config: Config, best: float) -> float:
    """Probability of fitting x expected gain over `best`, in samples/s."""
    assert context.forecast is not None, "a guided pick needs the sweep's forecast"
    return context.forecast(config).value(context.budget_bytes, best)


def likeliest(context: SearchContext, tried: Collection[Config]) -> Config | None:
    """The untried config most likely to fit."""
    found = forecasts(context, tried)
    return max(found, key=lambda c: found[c].fit_probability(context.budget_bytes)) if found else None


def fit_probability(context: SearchContext, config: Config) -> float:
    assert context.forecast is not None, "a guided pick needs the sweep's forecast"
    return context.forecast(config).fit_probability(context.budget_bytes)
