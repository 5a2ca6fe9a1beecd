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

Resume: the same seed, the same sweep (docs/tune.md), wherever it was interrupted. Optuna's study is stored (its
samplers' random state too: strategies/optuna_search.py) and the policy is deterministic, but whose turn it is,
how many guided turns Optuna took and where the policy's walk is are this object's own state, and whether a policy
proposal was refused depended on the sweep's forecast when it was made, which a resumed sweep, its forecast learnt
from the whole record, cannot give again (tiny at 850 MiB, seed 11: configs already measured were refused at 77-79%
likely to fit, a few points under FIT_TO_RUN, which a forecast learnt from more trials may cross). So each refusal
is kept in the study as it is made (REFUSED_KEY: the number of the policy's proposal, its config, its probability),
and the record a resumed sweep tells before its first proposal is replayed then (`_replay`): Optuna's first guided
proposals, then the turns as they were taken, each proposal of the policy refused as it was, answered from the
record as the sweep answered it (a config recorded earlier), or the record's next trial; Optuna's turns take the
next trial. Past the record the forecast decides again, as it did in the interrupted session after the same
trials. A study kept before refusals were (no REFUSED_KEY) replays a proposal neither recorded earlier nor the
record's next trial as refused (the sweep records every other proposal), and one recorded earlier as answered.
"""

from __future__ import annotations

from typing import Any, Sequence

from optuna.trial import TrialState

from autotune.values.config import Config
from autotune.values.results import TrialResult
from autotune.strategies import SearchContext
from autotune.strategies.optuna_search import FIT_TO_RUN, tpe
from autotune.strategies.rl import RLStrategy

POLICY_TRIALS = 12
# Optuna's guided proposals before the policy's first turn: its first and GUIDED_TURNS more (8 in all, as before
# the guided search dropped its identifying warm start: benchmarks/results/search_valuable.md).
GUIDED_TURNS = 7
# The study's system attribute keeping the policy's refused proposals: [[its number among the policy's proposals,
# the config's label, its probability of fitting], ...] (module doc, Resume).
REFUSED_KEY = "autotune:policy_refused"


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
        self.policy_proposals = 0  # the policy's proposals so far, refused ones included: a refusal's number
        # The results told before the first proposal (a resumed sweep's record), replayed then; None once proposing.
        self.history: list[tuple[Config, TrialResult]] | None = []
        study = self.search.study
        if self._refusals() is None and not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,
                                                                                     TrialState.PRUNED)):
            # A new sweep (or one that was told nothing yet, so refused nothing): its refusals are kept from the start.
            study._storage.set_study_system_attr(study._study_id, REFUSED_KEY, [])

    def propose(self) -> Config | None:
        self.search.follow_record()  # the record told, before the policy's first proposal too
        if self.history is not None:
            history, self.history = self.history, None
            replayed = self._replay(history)
            if replayed is not None:
                return replayed  # the record went otherwise than the walk: the policy's proposal, live
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
        as the tuner refuses a pruned one (the policy proposes again without it), and never runs. Each refusal is
        kept in the study (REFUSED_KEY), for a resumed sweep's replay."""
        forecast = self.search.context.forecast if self.search.guided else None
        while True:
            config = self.policy.propose()
            if config is None:
                return None
            number = self.policy_proposals
            self.policy_proposals += 1
            if forecast is None:
                return config
            p = forecast(config).fit_probability(self.search.context.budget_bytes)
            if p >= FIT_TO_RUN:
                return config
            self._keep_refusal(number, config, p)
            self._refuse(config, p)

    def _refuse(self, config: Config, p: float) -> None:
        self.policy.observe(config, TrialResult(config, "pruned", error=f"unlikely to fit (probability {p:.0%})"))

    # -- resume

    def _refusals(self) -> dict[int, tuple[str, float]] | None:
        """The policy's refused proposals the study keeps, by number; None where it keeps none (a study of a sweep
        begun before they were kept)."""
        study = self.search.study
        kept = study._storage.get_study_system_attrs(study._study_id).get(REFUSED_KEY)
        if not isinstance(kept, list):
            return None
        return {int(number): (str(label), float(p)) for number, label, p in kept}

    def _keep_refusal(self, number: int, config: Config, p: float) -> None:
        """Keep a refusal in the study, where a study keeps them (`_refusals`; a sweep begun with this code)."""
        refusals = self._refusals()
        if refusals is None:
            return
        refusals[number] = (config.label(), p)
        study = self.search.study
        study._storage.set_study_system_attr(study._study_id, REFUSED_KEY,
                                             [[n, label, q] for n, (label, q) in sorted(refusals.items())])

    def _replay(self, history: Sequence[tuple[Config, TrialResult]]) -> Config | None:
        """A resumed sweep's record, replayed as the sessions before took their turns (module doc, Resume): this
        object's state as it was after the record's last trial. Returns the policy's proposal that the record does
        not follow (trials that ran in parallel, recorded in the order they ended), to be proposed live; None once
        the record is replayed."""
        if not history:
            return None
        refusals = self._refusals()
        known: dict[Config, TrialResult] = {}  # the record so far: what the sweep answered a known proposal with
        turn, at = 0, 0
        guided = self.search.guided

        def optunas() -> None:
            """The record's next trial is Optuna's proposal: a guided turn after the first (optuna_search._guided)."""
            nonlocal turn, at
            turn += bool(known)
            known.setdefault(*history[at])
            at += 1

        while at < len(history):
            if guided and turn < GUIDED_TURNS:
                optunas()
                continue
            if self.in_policy and (self.policy_turn or not self.interleave):
                config = self._replayed_proposal(history[at][0], known, refusals)
                if config is not None:
                    self.policy_turn = False
                    self.proposed.add(config)
                    if config in known:  # the sweep answered it from the record
                        self.policy.observe(config, known[config])
                        continue
                    if config == history[at][0]:
                        known.setdefault(*history[at])
                        self.policy.observe(*history[at])
                        at += 1
                        continue
                    self._replayed(turn)
                    return config
                self.in_policy = False
            self.policy_turn = True
            optunas()
        self._replayed(turn)
        return None

    def _replayed_proposal(self, recorded: Config, known: dict[Config, TrialResult],
                           refusals: dict[int, tuple[str, float]] | None) -> Config | None:
        """The policy's next proposal in the replay of the record (`recorded`: its next trial), each one refused as
        it was when it was made."""
        while True:
            config = self.policy.propose()
            if config is None:
                return None
            number = self.policy_proposals
            self.policy_proposals += 1
            if refusals is not None:
                label, p = refusals.get(number, ("", 1.0))
                if label != config.label():
                    return config
            elif self.search.guided and config not in known and config != recorded:
                p = 0.0  # refused (the sweep records every proposal it does not answer from the record)
            else:
                return config
            self._refuse(config, p)

    def _replayed(self, turn: int) -> None:
        """The replay's end: Optuna's guided turns as they were."""
        if self.search.guided:
            self.search.turn = turn

    @property
    def notes(self) -> list[str]:
        """What following the record changed in its study (optuna_search.Record.follow), for the sweep to say."""
        return self.search.notes

    def observe(self, config: Config, result: TrialResult) -> None:
        if self.history is not None:
            self.history.append((config, result))  # a resumed sweep's record: replayed at the first proposal
        if self.in_policy:
            self.policy.observe(config, result)
        self.search.observe(config, result, proposed_by="policy" if config in self.proposed else "record")


def hybrid(context: SearchContext, policy: Any = None) -> HybridStrategy:
    """`hybrid` with the shipped policy, or `policy` (a loaded Policy: TuneSpec.policy's, strategies.with_policy)."""
    return HybridStrategy(context, policy)
