"""`hybrid` (the default of `autotune tune`): the policy's first proposals, then Optuna.

The trained policy (strategies/rl.py) walks from the estimator's best predicted config for up to
`POLICY_TRIALS` proposals, or until it stops; every result is told to the Optuna study as it arrives
(`add_trial` of a completed trial: the same warm start as `enqueue_trial`, without running anything
twice), so TPE starts from the policy's neighbourhood of the optimum, and continues over the whole space
for the rest of the budget. A resumed sweep replays the policy's walk from the record (it is
deterministic) and reloads the study from its storage.
"""

from __future__ import annotations

from typing import Any

from autotune.config import Config
from autotune.results import TrialResult
from autotune.strategies import SearchContext
from autotune.strategies.optuna_search import tpe
from autotune.strategies.rl import RLStrategy

POLICY_TRIALS = 8


class HybridStrategy:
    name = "hybrid"

    def __init__(self, context: SearchContext, policy: Any = None, policy_trials: int = POLICY_TRIALS) -> None:
        self.policy = RLStrategy(context, policy, max_trials=policy_trials)
        self.search = tpe(context)
        self.in_policy = True

    def propose(self) -> Config | None:
        if self.in_policy:
            config = self.policy.propose()
            if config is not None:
                return config
            self.in_policy = False
        return self.search.propose()

    def observe(self, config: Config, result: TrialResult) -> None:
        if self.in_policy:
            self.policy.observe(config, result)
        self.search.observe(config, result)


def hybrid(context: SearchContext) -> HybridStrategy:
    return HybridStrategy(context)
