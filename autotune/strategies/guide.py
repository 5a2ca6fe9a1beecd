"""Model-guided picks shared by the strategies that read the sweep's forecast (SearchContext.forecast):
what to measure to identify the estimator's error model, and what is worth running now.

- `identifying`: the warm start. The untried config whose measurement shrinks most the variance of the
  predictions of the configs predicted best (Bayesian linear regression's exact variance reduction on the
  knob-value offsets of autotune.prediction.uncertainty, memory and throughput), weighed by its probability of
  fitting (an out-of-memory teaches only a bound), per second of its trial. Its first picks therefore cover the
  knob values the best candidates share but no trial used (checkpointing on and off, each precision, offload
  on and off), rather than the best predicted config of each memory layout, and the cheapest config that
  teaches it (an offloaded optimizer's trial takes twice a GPU trial's seconds).
- `most_valuable`: the untried config of the highest expected gain over the best found, weighed by its
  probability of fitting (probability x E[max(throughput - best, 0)], the throughput log-normal), per second
  of its trial once a best was found (the first pick is the likeliest best, whatever it costs).
- `nearby`: the same, among the neighbours of the best config found (one knob one step away): a local
  search beside the model, for the optimum the additive error model does not predict.

Seconds (issue 41): a trial's expected wall seconds (SearchContext.trial_seconds: autotune.prediction.trial_time
at the calibrated step time, out-of-memory deaths and first op builds weighed in) divide what it is worth, so that
a search under a time budget buys the most gain, or information, per second; without them every trial costs one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection

import numpy as np

from autotune.values.config import KNOBS, Config
from autotune.strategies import SearchContext
from autotune.prediction.uncertainty import Forecast

TARGETS = 8  # configs "predicted best" whose uncertainty the warm start shrinks
# A guided pick is one at least this likely to fit, while there is one: even odds, as a config whose knob
# values no trial covered is never much likelier (its interval is wide; a stricter floor never covers them:
# the estimator world's optimum at 97% of the budget stayed out of reach at 0.8), and an out-of-memory
# still teaches a bound. The warm start asks a little more (IDENTIFY_LIKELY): its picks are chosen for what
# they teach, not for their value.
LIKELY = 0.5
NEARLY = 0.9
IDENTIFY_LIKELY = 0.65
# A step around the best runs if at least this likely to fit: where the optimum sits at the budget's edge,
# its neighbour is the gamble worth taking, and an out-of-memory there bounds the memory model where the best
# configs are. Measured on the replay surfaces (benchmarks/search_efficiency.py --surfaces-only, 10 seeds,
# offload prior of the memory model then 0.07):
# at 0.8 optuna never ran tiny-cpu's optimum 0.9% under the 0.71 GiB budget in 50 trials (hybrid: 70% of
# runs), at 0.5 optuna always (10 trials) and hybrid never, at 0.3 optuna always and hybrid in 30%; no OOM
# share above 0.4% and the other surfaces unchanged at 0.3, while 0.2 ran small-llama 7% out of memory.
NEAR_LIKELY = 0.3
ORDERED = ("zero_stage", "micro_batch", "ckpt_interval")  # knobs whose values lie on a line


def forecasts(context: SearchContext, tried: Collection[Config], likely: float = 0.0) -> dict[Config, Forecast]:
    """The forecast of every untried config of the space (in the space's order) at least LIKELY to fit, or
    if none is, nearly as likely as the likeliest (before any trial an uncalibrated estimator may predict
    every config over the budget)."""
    assert context.forecast is not None, "a guided pick needs the sweep's forecast"
    found = {c: context.forecast(c) for c in context.space if c not in tried}
    fit = {c: f.fit_probability(context.budget_bytes) for c, f in found.items()}
    floor = min(likely or LIKELY, NEARLY * max(fit.values(), default=0.0))
    return {c: f for c, f in found.items() if fit[c] >= floor}


def seconds(context: SearchContext, configs: Collection[Config]) -> np.ndarray:
    """Each config's trial's expected seconds (ones where the sweep predicts none)."""
    if context.trial_seconds is None:
        return np.ones(len(configs))
    return np.array([max(context.trial_seconds(c), 1e-9) for c in configs])


def identifying(context: SearchContext, tried: Collection[Config]) -> Config | None:
    assert context.uncertainty is not None, "a guided pick needs the sweep's error models"
    found = forecasts(context, tried, IDENTIFY_LIKELY)
    if not found:
        return None
    budget = context.budget_bytes
    configs = list(found)
    fit = np.array([found[c].fit_probability(budget) for c in configs])
    worth = fit * np.array([found[c].throughput_interval()[1] for c in configs])
    order = np.argsort(-worth, kind="stable")[:TARGETS]
    targets = [configs[i] for i in order]
    weights = worth[order] / max(float(worth[order].max()), 1e-300)
    errors = context.uncertainty()
    info = errors.time.information(configs, targets, weights) + errors.memory.information(configs, targets, weights)
    return configs[int(np.argmax(fit * info / seconds(context, configs)))]


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


def neighbours(context: SearchContext, config: Config) -> list[Config]:
    """The configs of the space one step from `config`: the next value up or down of one ordered knob
    (ZeRO stage, micro-batch, checkpoint interval) or another value of one unordered knob; a step that
    makes no valid config (ZeRO-0 with an offload) takes the offloads off with it."""
    space = context.space
    out: list[Config] = []
    for knob in KNOBS:
        values = space.choices.knob_values(knob)
        here = values.index(getattr(config, knob))
        steps = [i for i in (here - 1, here + 1) if 0 <= i < len(values)] if knob in ORDERED else \
            [i for i in range(len(values)) if i != here]
        for i in steps:
            for other in (replace(config, **{knob: values[i]}),
                          replace(config, **{knob: values[i], "offload_optimizer": "none", "offload_param": "none"})):
                if other in space and other != config:
                    if other not in out:
                        out.append(other)
                    break
    return out


def nearby(context: SearchContext, tried: Collection[Config], incumbent: Config, best: float) -> Config | None:
    """The untried neighbour of `incumbent` (the best config found) at least NEAR_LIKELY to fit that is worth
    most a second (probability x expected gain / trial seconds; among equals the fastest forecast), or None."""
    assert context.forecast is not None, "a guided pick needs the sweep's forecast"
    budget = context.budget_bytes
    found = {c: context.forecast(c) for c in neighbours(context, incumbent) if c not in tried}
    near = [c for c, f in found.items() if f.fit_probability(budget) >= NEAR_LIKELY]
    cost = dict(zip(near, seconds(context, near)))
    return max(near, key=lambda c: (found[c].value(budget, best) / cost[c], found[c].throughput), default=None)
