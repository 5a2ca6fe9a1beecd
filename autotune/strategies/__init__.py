"""Search strategies: each proposes configs one at a time and learns from their results.

One interface for all (`Strategy`), so that one driver loop runs any of them against any backend.
`propose()` returns the next config to try, or None when the strategy has nothing left to try;
`observe(config, result)` tells it the outcome. Observing a config the strategy never proposed is
allowed (a resumed sweep replays its recorded history this way) and observing a config twice is harmless.
Strategies never run anything themselves and never see pruning decisions except as `pruned` results.

The protocol is public: `TuneSpec(strategy=...)` takes a registered name (STRATEGIES), a user's object with
`propose()` and `observe(config, result)` (and optionally `name`, which names the run: `run.json`, the report),
or a callable that builds one from the sweep's `SearchContext` (a class whose `__init__` takes the context).
What the sweep does with it, for any strategy:
- a proposal already recorded is observed again with its recorded result and not run; one the pruner skips
  is observed as a `pruned` result; the others run, in the order proposed, until the budget ends the sweep
  (or `propose()` returns None: StopReason.DONE, or StopReason.EXHAUSTED once every config of the space was tried
  or pruned);
- a resumed sweep (`tune(..., resume=True)`, given the strategy again) observes every recorded search result
  in order before the first `propose()` (repeats of confirmation are not observed), so a strategy that
  proposes what it has not seen carries on where the first session stopped.
tests/test_user_strategy.py runs a user-written strategy through `autotune.tune()`.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from autotune.values.argtypes import takes
from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import Estimate
from autotune.files import short
from autotune.values.models import did_you_mean
from autotune.values.results import TrialResult
from autotune.values.space import Space
from autotune.prediction.uncertainty import Forecast, Uncertainty


@runtime_checkable
class Strategy(Protocol):
    name: str

    def propose(self) -> Config | None:
        """The next config to run; None when done."""
        ...

    def observe(self, config: Config, result: TrialResult) -> None:
        """The outcome of `config` (as the search's budget sees it: over budget is `oom`)."""
        ...


@dataclass(frozen=True)
class SearchContext:
    """What a strategy may use: the space, the budget, a seed, the estimator and a study storage."""

    space: Space
    budget_bytes: int
    seed: int = 0
    predict: Callable[[Config], Estimate] | None = None  # the estimator as calibrated when the search starts
    storage: Any = None  # Optuna storage (URL or storage object) of the run directory; None: in memory
    study_name: str = "autotune"  # the sweep's study in that storage (autotune.search.study_storage.study_name)
    # The prediction with its uncertainty as the sweep's pruner knows it now (recalibrated after each result):
    # probability of fitting, throughput interval, expected gain. None: no sweep (the estimator alone).
    forecast: Callable[[Config], Forecast] | None = None
    uncertainty: Callable[[], Uncertainty] | None = None  # the error models behind `forecast`, as they are now
    # A config's trial's expected wall seconds as the sweep predicts them now (autotune.prediction.trial_time,
    # weighed by the probability of fitting): what a guided pick divides its worth by. None: every trial alike.
    trial_seconds: Callable[[Config], float] | None = None


# strategy name -> "module:factory", factory(context) -> Strategy. Later strategies (rl, hybrid) add entries.
STRATEGIES: dict[str, str] = {
    "grid": "autotune.strategies.grid:GridStrategy",
    "random": "autotune.strategies.random_search:RandomStrategy",
    "optuna": "autotune.strategies.optuna_search:tpe",
    "optuna-gp": "autotune.strategies.optuna_search:gp",
    "rl": "autotune.strategies.rl:rl",
    "hybrid": "autotune.strategies.hybrid:hybrid",
}


# The registered strategies that search with a trained policy, and may take another than the shipped one
# (TuneSpec.policy, `autotune tune --policy DIR`): their factories take it as `policy`.
POLICY_STRATEGIES = ("rl", "hybrid")


def with_policy(name: str, policy: Any) -> Callable[[SearchContext], Strategy]:
    """The builder of the registered policy strategy `name` searching with `policy` (a loaded
    autotune.rl.policy.Policy) in place of the shipped one: what Sweep.open builds the sweep's strategy from."""
    if name not in POLICY_STRATEGIES:
        raise ConfigError(f"--policy (`policy`): only with --strategy {' or '.join(POLICY_STRATEGIES)} (got --strategy {name})")
    module_name, factory = STRATEGIES[name].split(":")
    return functools.partial(getattr(importlib.import_module(module_name), factory), policy=policy)


def _is_strategy_object(obj: Any) -> bool:
    return not isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in ("propose", "observe"))


def _not_a_strategy(obj: Any) -> ConfigError:
    return ConfigError(f"strategy {short(obj)}: not a Strategy: needs propose() -> Config | None and "
                       f"observe(config, result) methods (autotune.strategies.Strategy), or a name: allowed "
                       f"{', '.join(STRATEGIES)}")


def _check_builder(builder: Any) -> None:
    """A builder the sweep can call with its SearchContext alone (docs/python.md), asked of its signature: a class
    whose __init__ takes other arguments is one line naming it, not a TypeError from deep inside the sweep (a
    TypeError raised inside the builder itself stays its own)."""
    if not takes(builder, 1):
        raise ConfigError(f"strategy {short(builder)}: a builder is called with one argument, the sweep's "
                          "SearchContext: allowed a callable (a class whose __init__ takes it) builder(context) -> "
                          "Strategy, a Strategy object or a name")


def check_strategy(strategy: Any) -> None:
    """A registered name, a Strategy object, or a callable building one from the SearchContext; else one line
    naming what is missing."""
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            hint = did_you_mean(strategy, STRATEGIES)
            raise ConfigError(f"strategy {strategy!r}{hint}: allowed {', '.join(STRATEGIES)}")
    elif not _is_strategy_object(strategy):
        if not callable(strategy):
            raise _not_a_strategy(strategy)
        _check_builder(strategy)


def strategy_name(strategy: Any) -> str:
    """What names the sweep's strategy (`run.json`, the default run directory, the report): a registered
    name itself, else the object's (or class's) `name`, else its class's or function's name."""
    if isinstance(strategy, str):
        return strategy
    name = getattr(strategy, "name", None)
    if isinstance(name, str) and name:
        return name
    if isinstance(strategy, type) or not _is_strategy_object(strategy):
        return str(getattr(strategy, "__name__", type(strategy).__name__))
    return type(strategy).__name__


def make_strategy(strategy: Any, context: SearchContext) -> Strategy:
    """The sweep's strategy: a registered name's, the user's object itself, or what the user's callable
    builds from `context`."""
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            hint = did_you_mean(strategy, STRATEGIES)
            raise ConfigError(f"unknown strategy {strategy!r}{hint}: allowed {', '.join(STRATEGIES)}")
        module_name, factory = STRATEGIES[strategy].split(":")
        return getattr(importlib.import_module(module_name), factory)(context)
    if _is_strategy_object(strategy):
        return strategy
    if not callable(strategy):
        raise _not_a_strategy(strategy)
    _check_builder(strategy)
    built = strategy(context)
    if not _is_strategy_object(built):
        raise _not_a_strategy(built)
    return built
