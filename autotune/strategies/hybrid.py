"""`hybrid`: Optuna's first guided proposals, then the trained policy's turns beside Optuna's.

With the sweep's forecast, Optuna's first GUIDED_TURNS + 1 proposals (its most valuable configs per second)
come first; then the policy (strategies/rl.py: single-knob edits from the estimator's best predicted config and
jumps to the best config of the predictions corrected by its trials) and Optuna take turns, until the policy stops
or has proposed `POLICY_TRIALS` configs, and Optuna (guided picks and TPE) goes on alone. Without a forecast the
policy proposes first. Every result, whoever proposed it, is told to the Optuna study as it arrives (`add_trial`
of a completed trial: the warm start of `enqueue_trial` without running anything twice).

Why this shape: the issue's reading ("the policy's first proposals warm-start the Optuna study, which then
continues") made it policy-first, which on the held-out tasks of benchmarks/rl_evaluation.py before issue 17
reached 98% of the optimum in a median of 10 trials at 3% step-time noise, against 16.5 for Optuna alone; the
guided search then made Optuna's first trials the better ones (with 5 guided proposals before the policy's
turns 232 s to 98% on the held-out GPU worlds, with 8 217 s). Against `optuna` alone (213 s, 240 runs:
benchmarks/results/search_seconds.md) the policy's turns no longer pay, so `optuna` is the default since
2026-11-29 (docs/search.md, "How the strategies compare").

On a Ray cluster, with several trials in flight, Optuna proposes whenever the policy waits for its result.

In the study, a trial the policy proposed has user attribute `proposed_by` = `policy` (Optuna's own say
`warm start`, `expected gain`, `likeliest to fit`, `nearest untried` or `optuna`); otherwise it reads as the
`optuna` strategy's study does (strategies/optuna_search.py: knob values, status, report_trial, throughput, peak,
feasibility).

The policy is the shipped one, or the exported one `autotune tune --policy DIR` names (strategies/rl.py load_policy).

Resume: the policy is deterministic and Optuna's study is stored, so a resumed sweep replays the policy's
proposals from the record and reloads the study.
"""

from __future__ import annotations

from typing import Any

from autotune.values.config import Config
from autotune.values.results import TrialResult
from autotune.strategies import SearchContext
from autotune.strategies.optuna_search import FIT_TO_RUN, tpe
from autotune.strategies.rl import RLStrategy

POLICY_TRIALS = 12
# Optuna's guided proposals before the policy's first turn: its first and GUIDED_TURNS more (8 in all, as before
# the guided search dropped its identifying warm start: benchmarks/results/search_valuable.md).
GUIDED_TURNS = 7


class HybridStrategy:
    name = "hybrid"

    def __init__(self, context: SearchContext, policy: Any = None, policy_trials: int = POLICY_TRIALS,
                 interleave: bool | None = None) -> None:
        # The policy's stop hands over to Optuna (measured: masking it here left fewer runs at 98% of the
        # optimum within 30 trials, 93% against 95%, benchmarks/results/rl_seconds_policy.md).
        self.policy = RLStrategy(context, policy, max_trials=policy_trials, may_stop=True)
        self.search = tpe(context, self.name)  # its study says `strategy: hybrid`
        # With the sweep's forecast, the policy takes turns with Optuna's most valuable configs and TPE.
        self.interleave = self.search.guided if interleave is None else interleave
        self.in_policy = True
        self.policy_turn = True
        self.proposed: set[Config] = set()  # configs the policy proposed, so the study can say whose they were

    def propose(self) -> Config | None:
        self.search.follow_record()  # the record told, before the policy's first proposal too
        if self.search.exhausted:
            return None  # nothing left is worth a trial, by the sweep's forecast
        if self.search.guided and self.search.turn < GUIDED_TURNS:
            return self.search.propose()  # Optuna's most valuable configs first
        return self._turn()

    def _turn(self) -> Config | None:
        """The policy's proposal on its turn, Optuna's otherwise (and once the policy is done)."""
        # While the policy's proposal is still running (a Ray sweep has several trials in flight), Optuna
        # fills the slot: the policy proposes one config at a time.
        waiting = self.policy.pending is not None
        if self.in_policy and not waiting and (self.policy_turn or not self.interleave):
            config = self._policy_proposal()
            if config is not None:
                self.policy_turn = False
                self.proposed.add(config)
                return config
            self.in_policy = False
        self.policy_turn = True
        return self.search.propose()

    def _policy_proposal(self) -> Config | None:
        """The policy's next config; one the sweep's forecast finds unlikely to fit (FIT_TO_RUN) is refused
        as the tuner refuses a pruned one (the policy proposes again without it), and never runs."""
        forecast = self.search.context.forecast if self.search.guided else None
        while True:
            config = self.policy.propose()
            if config is None or forecast is None:
                return config
            p = forecast(config).fit_probability(self.search.context.budget_bytes)
            if p >= FIT_TO_RUN:
                return config
            self.policy.observe(config, TrialResult(config, "pruned", error=f"unlikely to fit (probability {p:.0%})"))

    @property
    def notes(self) -> list[str]:
        """What following the record changed in its study (optuna_search.Record.follow), for the sweep to say."""
        return self.search.notes

    def observe(self, config: Config, result: TrialResult) -> None:
        if self.in_policy:
            self.policy.observe(config, result)
        self.search.observe(config, result, proposed_by="policy" if config in self.proposed else "record")


def hybrid(context: SearchContext, policy: Any = None) -> HybridStrategy:
    """`hybrid` with the shipped policy, or `policy` (a loaded Policy: TuneSpec.policy's, strategies.with_policy)."""
    return HybridStrategy(context, policy)
