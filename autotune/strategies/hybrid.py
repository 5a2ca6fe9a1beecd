"""`hybrid` (the default of `autotune tune`): the trained policy's walk, interleaved with Optuna, then Optuna.

The policy (strategies/rl.py) walks from the estimator's best predicted config, editing one knob at a
time where its training says the gains lie; Optuna starts from its estimator warm start (the best
predicted config of each memory layout and precision) and TPE. The two take turns until the policy
stops or has proposed `POLICY_TRIALS` configs; Optuna continues alone for the rest of the budget.
Every result, whoever proposed it, is told to the Optuna study as it arrives (`add_trial` of a completed
trial: the warm start of `enqueue_trial` without running anything twice), so TPE models the policy's
neighbourhood of the optimum from the first trials on.

Why take turns rather than let the policy go first: measured on the held-out tasks of
benchmarks/rl_evaluation.py, a walk of 8 policy trials followed by Optuna delayed Optuna's warm start,
whose configs (different layouts and precisions) are the best few guesses there are, and reached 98% of
the optimum later than Optuna alone; taking turns keeps both kinds of guess in the first trials.

Resume: the policy is deterministic and Optuna's study is stored, so a resumed sweep replays the walk
from the record and reloads the study.
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

    def __init__(self, context: SearchContext, policy: Any = None, policy_trials: int = POLICY_TRIALS,
                 interleave: bool = True) -> None:
        self.policy = RLStrategy(context, policy, max_trials=policy_trials)
        self.search = tpe(context)
        self.interleave = interleave
        self.in_policy = True
        self.policy_turn = True

    def propose(self) -> Config | None:
        if self.in_policy and (self.policy_turn or not self.interleave):
            config = self.policy.propose()
            if config is not None:
                self.policy_turn = False
                return config
            self.in_policy = False
        self.policy_turn = True
        return self.search.propose()

    def observe(self, config: Config, result: TrialResult) -> None:
        if self.in_policy:
            self.policy.observe(config, result)
        self.search.observe(config, result)


def hybrid(context: SearchContext) -> HybridStrategy:
    return HybridStrategy(context)
