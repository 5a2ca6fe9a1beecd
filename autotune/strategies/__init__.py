"""Search strategies: each proposes configs one at a time and learns from their results.

One interface for all (`Strategy`), so that one driver loop runs any of them against any backend.
`propose()` returns the next config to try, or None when the strategy has nothing left to try;
`observe(config, result)` tells it the outcome. Observing a config the strategy never proposed is
allowed (a resumed sweep replays its recorded history this way) and observing a config twice is harmless.
Strategies never run anything themselves and never see pruning decisions except as `pruned` results.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from autotune.config import Config, ConfigError
from autotune.estimate import Estimate
from autotune.results import TrialResult
from autotune.space import Space
from autotune.uncertainty import Forecast, Uncertainty


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
    study_name: str = "autotune"  # the sweep's study in that storage (autotune.study_storage.study_name)
    # The prediction with its uncertainty as the sweep's pruner knows it now (recalibrated after each result):
    # probability of fitting, throughput interval, expected gain. None: no sweep (the estimator alone).
    forecast: Callable[[Config], Forecast] | None = None
    uncertainty: Callable[[], Uncertainty] | None = None  # the error models behind `forecast`, as they are now


# strategy name -> "module:factory", factory(context) -> Strategy. Later strategies (rl, hybrid) add entries.
STRATEGIES: dict[str, str] = {
    "grid": "autotune.strategies.grid:GridStrategy",
    "random": "autotune.strategies.random_search:RandomStrategy",
    "optuna": "autotune.strategies.optuna_search:tpe",
    "optuna-gp": "autotune.strategies.optuna_search:gp",
    "rl": "autotune.strategies.rl:rl",
    "hybrid": "autotune.strategies.hybrid:hybrid",
}


def make_strategy(name: str, context: SearchContext) -> Strategy:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}: allowed {', '.join(STRATEGIES)}")
    module_name, factory = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module_name), factory)(context)
