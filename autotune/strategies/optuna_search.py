"""`optuna` (TPE, multivariate; the default) and `optuna-gp` (Gaussian process) over the whole space.

Encoding: one parameter per knob, over its real values (micro_batch 1/2/4/8), as optuna-dashboard's slice,
contour and importance plots show them. The samplers see ordered knobs (zero_stage, micro_batch, ckpt_interval) as
integers indexing their list of choices (`<knob>_index`, strategies/sampler_view.py), so their kernels see that
micro-batch 4 lies between 2 and 8; unordered knobs (precision and the offloads) are categorical. Studies
written before the real values (index parameters) resume as they are: the samplers see both encodings alike,
and queued trials are carried over. A knob combination that is not a valid
config (e.g. CPU offload with ZeRO-0, a micro-batch that does not divide the global batch, a config a
replay surface never measured) is told at once as an infeasible pruned trial, without running or
recording anything, and the nearest untried valid config runs in its place: the
sampler learns the invalid region as it learns the out-of-memory one, and every proposal costs at most
two asks however sparse the valid configs are. One categorical over the flat index of valid configs would
avoid invalid proposals but hide every relation between configs from the sampler.

Objective: samples/s, maximised (metric name `throughput_samples_per_s`), with one memory constraint,
peak/budget - 1 (<= 0 fits). How each proposal is kept in the study, so that the `optuna` CLI and
optuna-dashboard read it as the run directory does:
- a config that ran and fit is COMPLETE with its throughput and its constraint;
- a config that ran and failed (oom, crash, timeout, unsupported, a peak over the budget) is PRUNED with its
  positive constraint and no value: the dashboard shows it infeasible, not as a throughput of 0. The samplers
  see it as before, COMPLETE with value PENALTY (sampler_view.SAMPLER_VALUE_KEY; a FAIL trial would be
  ignored): TPE ranks it among the infeasible trials by its constraint, the GP models its value;
- a config the estimator pruned (never ran) is PRUNED with its predicted constraint, and an invalid
  combination is PRUNED with INVALID_CONSTRAINT and the reason: TPE ranks PRUNED and COMPLETE trials that
  break a constraint alike (below every feasible trial, among themselves by how far they broke it); the
  GP sampler models COMPLETE trials only, so it learns the out-of-memory region from the trials that ran;
- a proposal of a config already tried is FAIL (`repeat`): it carries nothing new for the sampler;
- every trial's user attributes hold the knobs' real values under their own names too (zero_stage,
  micro_batch, ...; study user attribute `space` lists each knob's values), `status`, who proposed it, and
  once known `report_trial` (its 1-based line in trials.jsonl, the trial number of the report, which differs
  from Optuna's 0-based numbers that also count proposals that never reached trials.jsonl), throughput, step
  time and peak memory.
The constraint is written as the system attribute `constraints` (a list, the format of the samplers'
`constraints_func`): optuna-dashboard 0.21 reads feasibility from it and not from Optuna 5's
`Trial.set_constraint` keys (`constraints:<name>`); Optuna reads both.

The study lives in the storage of the run directory when one is given (autotune.search.study_storage). A resumed
study keeps what it learnt; a trial left RUNNING by a killed tuner is taken over: told from the recorded
result if the driver recorded one, and otherwise proposed again before anything else (ahead of warm-start
trials still waiting in the queue), so the config that was in flight runs again first. What the study does not
hold is kept beside it, as its system attribute RANDOM_STATE_KEY after each proposal: the samplers' random state
(sampler_view) and the generator that breaks the nearest untried config's ties, so that a resumed sweep draws what
the uninterrupted one would have drawn next (the same seed, the same sweep: docs/tune.md).
"""

from __future__ import annotations

import json
import random
import time
import warnings
from typing import Any, Callable

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.study import get_all_study_names
from optuna.trial import TrialState

from autotune.values.config import KNOBS, Config, ConfigError
from autotune.prediction.estimate import estimate
from autotune.values.results import TrialResult
from autotune.strategies import SearchContext, guide
from autotune.strategies.sampler_view import INDEX, SAMPLER_VALUE_KEY, SamplerView

ORDERED = guide.ORDERED
PENALTY = 0.0  # samples/s told for a config that ran and failed, or did not fit the budget
INVALID_CONSTRAINT = 1.0  # constraint told for invalid combinations and for failures with no memory figure
WARM_START = 5  # the estimator's best predicted configs (one per memory layout and precision), tried first
STARTUP_TRIALS = 8  # proposals (including the warm start) before the model-based sampler takes over
STUDY_NAME = "autotune"  # the study's name in a run directory's own study.db
METRIC = "throughput_samples_per_s"
CONSTRAINTS_KEY = "constraints"  # the trial system attribute optuna-dashboard reads feasibility from
MEASURES = ("throughput_samples_per_s", "tokens_per_s", "step_time_s", "peak_memory_bytes")
REASON_CHARS = 500  # a failure's error, as a user attribute, is cut to this
# The status of a sampled proposal refused as unlikely to fit (FIT_TO_RUN): told to the study, neither run nor
# recorded, and still untried (a resumed study does not count it as tried either).
UNLIKELY = "unlikely to fit"
# With the sweep's forecast (SearchContext.forecast) every proposal is the most valuable untried config (probability
# of fitting x expected gain over the best, per second of its trial: guide.most_valuable), the first one the
# likeliest best; TPE proposes when that config is not worth its risk (below), and a TPE proposal less likely than
# FIT_TO_RUN to fit is told as infeasible (its constraint: median predicted peak / budget - 1) and the nearest
# untried config likely to fit runs instead. Measured against the warm start that first identified the estimator's
# error (4 configs picked for what they teach) and turns taken with steps around the best and TPE
# (benchmarks/results/search_valuable.md): on held-out simulated GPU worlds at 3% noise the median trial-seconds to
# 98% of the optimum fell from 253 s to 209 s (seeds 0-9, where it was chosen; 244 -> 213 s on seeds 10-19), and on
# the real CPU surfaces replayed from 142 s to 109 s: the error model's expected gain already weighs what a trial
# teaches, and the picks made for information alone cost their seconds without that gain.
FIT_TO_RUN = 0.8
STOP_GAIN = 0.002  # below this x best, no untried config's probability x expected gain is worth a trial
# A most valuable config less than FIT_TO_RUN likely to fit runs only if worth this x best: a gamble on an
# out-of-memory for under 2% cannot move the search across the 98%-of-optimum mark (at 0.2% the real
# small-llama surface at 1.19 GiB spent one trial in 14 out of memory after its optimum); TPE, whose
# proposals are all likely to fit, takes that turn instead.
GAMBLE_GAIN = 0.02
# The study's system attribute keeping the random state a resumed sweep draws on (module doc): {"sampler": the
# samplers' generators (SamplerView.random_state), "nearest": the tie-breaking generator's state}.
RANDOM_STATE_KEY = "autotune:random_state"


def tpe(context: SearchContext, strategy: str = "optuna") -> "OptunaStrategy":
    """TPE over the space; `strategy`: the sweep's strategy as the study names it (the hybrid's is `hybrid`)."""
    # constant_liar: trials still running (several in flight on a Ray cluster) count as bad, so that
    # concurrent proposals spread out instead of repeating one guess.
    sampler = optuna.samplers.TPESampler(seed=context.seed, multivariate=True, n_startup_trials=STARTUP_TRIALS,
                                         constant_liar=True)
    return OptunaStrategy(context, sampler, "optuna", strategy)


def gp(context: SearchContext) -> "OptunaStrategy":
    sampler = optuna.samplers.GPSampler(seed=context.seed, n_startup_trials=STARTUP_TRIALS)
    return OptunaStrategy(context, sampler, "optuna-gp")


class OptunaStrategy:
    def __init__(self, context: SearchContext, sampler: optuna.samplers.BaseSampler, name: str,
                 strategy: str | None = None) -> None:
        self.name = name  # who proposes (user attribute proposed_by)
        self.strategy = strategy or name  # the sweep's strategy, the study's user attribute `strategy`
        self.context = context
        self.space = context.space
        self.rng = random.Random(context.seed)
        self.distributions = _distributions(self.space)
        ordered = {knob: self.space.choices.knob_values(knob) for knob in ORDERED}
        self.study = optuna.create_study(storage=context.storage, study_name=context.study_name,
                                         direction="maximize", sampler=SamplerView(sampler, ordered),
                                         load_if_exists=True)
        self.outcomes: dict[Config, tuple[float, float]] = {}  # config -> (value, constraint) told
        self.report_trials: dict[Config, int] = {}  # config -> its trial number in trials.jsonl
        self.pending: dict[Config, optuna.trial.Trial] = {}  # asked, not yet told
        self.resumed: list[Config] = []  # in flight when an earlier tuner was killed: proposed first
        self.record = Record()  # what the sweep told of its record, until the study follows it (follow_record)
        self.notes: list[str] = []  # what following the record changed in the study, for the sweep to say
        trials = self.study.get_trials(deepcopy=False)
        for trial in trials:
            config = self.config_of(trial.params)
            if trial.state in (TrialState.COMPLETE, TrialState.PRUNED) and config is not None:
                if trial.user_attrs.get("status") == UNLIKELY:
                    # Refused, never run nor recorded: untried, as it stayed in the session that refused it (a later
                    # proposal may run it, or the pruner record it), so the resumed search reaches what that one did.
                    continue
                value = trial.value if trial.state == TrialState.COMPLETE else PENALTY
                assert value is not None, "a complete trial of a single-objective study has its value"
                self.outcomes.setdefault(config, (value, sum(trial.constraints.values())))
                if isinstance(trial.user_attrs.get("report_trial"), int):
                    self.report_trials.setdefault(config, trial.user_attrs["report_trial"])
            elif trial.state == TrialState.RUNNING:
                if config is None or config in self.pending:
                    optuna.trial.Trial(self.study, trial._trial_id).set_user_attr("status", "abandoned")
                    self.study.tell(trial.number, state=TrialState.FAIL)
                else:
                    self.pending[config] = optuna.trial.Trial(self.study, trial._trial_id)
                    self.resumed.append(config)
            elif trial.state == TrialState.WAITING:
                self._requeue(trial)
        self._kept_state = self._restore_random_state()
        self.guided = context.forecast is not None  # the guided picks read the forecast alone
        # Guided proposals since the first one (hybrid's policy waits for GUIDED_TURNS of them): a resumed study
        # goes on where it was (the trials it was told; a proposal in flight counts when it is proposed again, and the
        # hybrid sets the count again from its replay of the record).
        self.turn = self._turns_taken(trials) if self.guided else 0
        # Nothing untried is worth a trial (probability x expected gain) nor likely to fit: proposals end.
        self.exhausted = False
        self._describe()
        if not trials and not self.guided:
            for config in self.warm_start():
                self._enqueue(config, "warm start")

    def _describe(self) -> None:
        """What a reader of the study (optuna CLI, optuna-dashboard) needs to read it without the run directory."""
        describe(self.study, self.context, self.strategy)

    # -- the Strategy interface

    def propose(self) -> Config | None:
        config = self._propose()
        self._keep_random_state()
        return config

    def _propose(self) -> Config | None:
        self.follow_record()
        while self.resumed:
            resumed = self.resumed.pop(0)
            if resumed in self.pending:  # not already told from the recorded history
                if self.guided and (set(self.outcomes) | set(self.pending)) - {resumed}:
                    self.turn += 1  # the guided turn that proposed it, taken again (its study counts told trials)
                return resumed
        if self.guided and not self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            picked = self._guided()
            if picked is not None:
                return picked
            if self.exhausted:
                return None
        while True:
            trial = self.study.ask(self.distributions)
            config = self.config_of(trial.params)
            if config is not None and config not in self.outcomes and config not in self.pending:
                if self._likely_to_fit(trial, config):
                    self._asked(trial, config)
                    return config
                break
            # An invalid combination, or a config already tried or in flight: the sampler learns that at once
            # (an infeasible pruned trial; a repeat carries nothing new and fails).
            self._refuse(trial, config)
            if not self._queued(trial):
                break
            # A queued config (a warm start the hybrid's policy already ran): the queue goes on, and Optuna
            # asks its next entry before sampling, so the nearest config below is not enqueued behind it.
        # The nearest config not tried yet runs in place of a sampled proposal that cannot run. So a proposal
        # costs at most two asks once the queue is empty, however sparse the valid configs are in the knob
        # grid (a replay surface that measured a fraction of the space).
        nearest = self.nearest_untried(trial.params, likely=True) or self.nearest_untried(trial.params)
        if nearest is None:
            return None
        return self._run_queued(nearest, "nearest untried")

    def _run_queued(self, config: Config, proposed_by: str) -> Config:
        self._enqueue(config, proposed_by)
        trial = self.study.ask(self.distributions)
        assert self.config_of(trial.params) == config, "the queue was empty: the enqueued config is asked next"
        self._asked(trial, config)
        return config

    def _guided(self) -> Config | None:
        """The most valuable untried config by the sweep's forecast; None: TPE's turn."""
        tried = set(self.outcomes) | set(self.pending)
        if not tried:  # the config predicted most valuable first: where the estimator is right, the answer
            picked = guide.most_valuable(self.context, tried, 0.0)
            return None if picked is None else self._run_queued(picked, "warm start")
        self.turn += 1
        best = self.best_value()
        picked = guide.most_valuable(self.context, tried, best)
        if picked is None:
            return None
        if best and guide.most_worth(self.context, tried, best) < STOP_GAIN * best:
            # Nothing left is worth a trial: the trials left go to the configs likeliest to fit (the
            # pruner drops those that cannot gain), not to out-of-memory failures.
            likeliest = guide.likeliest(self.context, tried)
            if likeliest is None or guide.fit_probability(self.context, likeliest) < guide.LIKELY:
                self.exhausted = True  # and none likely to fit: the search is over
                return None
            return self._run_queued(likeliest, "likeliest to fit")
        if best and guide.fit_probability(self.context, picked) < FIT_TO_RUN \
                and guide.worth(self.context, picked, best) < GAMBLE_GAIN * best:
            return None
        return self._run_queued(picked, "expected gain")

    def _turns_taken(self, trials: list[optuna.trial.FrozenTrial]) -> int:
        """The guided turns a stored study took: each turn ends in one proposal of this search's own after the
        warm start (not the hybrid's policy, not a record), told COMPLETE or PRUNED (ran, or pruned by the
        sweep); a sampled proposal refused as unlikely to fit or invalid is part of the turn that follows it."""
        # ("near the best": a step around the best, in studies written before 2026-11-29)
        own = {"expected gain", "near the best", "likeliest to fit", "nearest untried", self.name}
        return sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                   and t.user_attrs.get("proposed_by") in own
                   and t.user_attrs.get("status") not in (UNLIKELY, "invalid"))

    def best_value(self) -> float:
        """The best throughput told of a config that fit."""
        return max((value for value, constraint in self.outcomes.values() if constraint <= 0), default=0.0)

    def _likely_to_fit(self, trial: optuna.trial.Trial, config: Config) -> bool:
        """Whether a sampled proposal is likely enough to fit to run; if not, it is told as infeasible, with
        the median predicted peak as its constraint."""
        if not self.guided or self._queued(trial):
            return True
        assert self.context.forecast is not None
        forecast = self.context.forecast(config)
        p = forecast.fit_probability(self.context.budget_bytes)
        if p >= FIT_TO_RUN:
            return True
        attrs = {**config.to_dict(), "config": config.label(), "proposed_by": self._proposer(trial),
                 "status": UNLIKELY, "fit_probability": p, "feasible": False,
                 "predicted_peak_bytes": int(forecast.peak_bytes)}
        self._finish(trial, TrialState.PRUNED, None, max(forecast.peak_bytes / self.context.budget_bytes - 1.0, 0.01),
                     attrs)
        return False

    def _refuse(self, trial: optuna.trial.Trial, config: Config | None) -> None:
        """Tell a proposal that will not run: PRUNED (infeasible) if invalid, FAIL if a repeat."""
        if config is None:
            attrs = {**self._decoded(trial.params), "proposed_by": self._proposer(trial), "status": "invalid",
                     "reason": self._invalid_reason(trial.params), "feasible": False}
            self._finish(trial, TrialState.PRUNED, None, INVALID_CONSTRAINT, attrs)
            return
        attrs = {**config.to_dict(), "config": config.label(), "proposed_by": self._proposer(trial),
                 "status": "repeat"}
        if config in self.report_trials:
            attrs["repeat_of_report_trial"] = self.report_trials[config]
        self._finish(trial, TrialState.FAIL, None, None, attrs)

    def _requeue(self, trial: optuna.trial.FrozenTrial) -> None:
        """A trial queued by a study begun before the real values: its index parameters, as values."""
        fixed = trial.system_attrs.get("fixed_params", {})
        if any(f"{knob}{INDEX}" in fixed for knob in ORDERED):
            values = {k: v for k, v in self._decoded(fixed).items() if k in KNOBS}
            self.study._storage.set_trial_system_attr(trial._trial_id, "fixed_params", values)

    def _queued(self, trial: optuna.trial.Trial) -> bool:
        """Whether an asked trial came from the study's queue (enqueue_trial) rather than the sampler."""
        return "fixed_params" in trial.storage.get_trial_system_attrs(trial._trial_id)

    def nearest_untried(self, params: dict[str, Any], likely: bool = False) -> Config | None:
        """The untried valid config closest to a proposal: index distance on ordered knobs, 1 per other
        knob that differs; ties broken by the seeded generator. `likely`: among those at least FIT_TO_RUN
        likely to fit (the sweep's forecast)."""
        forecast = self.context.forecast if likely and self.guided else None
        decoded = self._decoded(params)
        wanted = [self.space.choices.knob_values(knob).index(decoded[knob]) for knob in KNOBS]
        best, best_distance = [], None
        for config in self.space:
            if config in self.outcomes or config in self.pending:
                continue
            if forecast is not None and forecast(config).fit_probability(self.context.budget_bytes) < FIT_TO_RUN:
                continue
            codes = self.space.encode(config)
            distance = sum(abs(a - b) if knob in ORDERED else int(a != b) for knob, a, b in zip(KNOBS, codes, wanted))
            if best_distance is None or distance < best_distance:
                best, best_distance = [config], distance
            elif distance == best_distance:
                best.append(config)
        return self.rng.choice(best) if best else None

    def observe(self, config: Config, result: TrialResult, proposed_by: str = "record") -> None:
        """Tell the study `result`; a config it never asked for (a resumed sweep's record, the hybrid's
        policy) is added as a finished trial, `proposed_by` saying whose it was."""
        self.record.told(config, result)
        state, value, constraint = self.outcome_state(result)
        learnt = self.outcome(result)[0]  # what the samplers see (sampler_view): PENALTY for a failure
        ran = state == TrialState.PRUNED and result.status != "pruned"
        if config in self.pending:
            self._finish(self.pending.pop(config), state, value, constraint, self._result_attrs(result, constraint),
                         learnt if ran else None)
        elif config not in self.outcomes:
            self.study.add_trial(recorded_trial(config, result, self.context.budget_bytes, self.distributions,
                                                proposed_by))
        self.outcomes.setdefault(config, (PENALTY if value is None else value, constraint))
        if isinstance(result.extra.get("trial"), int):
            self.report_trials.setdefault(config, result.extra["trial"])

    # -- encoding

    def params_of(self, config: Config) -> dict[str, Any]:
        return {knob: getattr(config, knob) for knob in KNOBS}

    def _decoded(self, params: dict[str, Any]) -> dict[str, Any]:
        """The knobs' values a trial's parameters stand for (whether or not they make a valid config); the
        parameters are values, or indices for ordered knobs in a study begun before 2026-11-26."""
        values: dict[str, Any] = {}
        for knob in KNOBS:
            index = params.get(f"{knob}{INDEX}")
            if knob in params:
                values[knob] = params[knob]
            elif knob in ORDERED and isinstance(index, int):
                choices = self.space.choices.knob_values(knob)
                if 0 <= index < len(choices):
                    values[knob] = choices[index]
        return values

    def config_of(self, params: dict[str, Any]) -> Config | None:
        """The config of a trial's parameters, or None if that combination is not a valid config here."""
        values = self._decoded(params)
        try:
            config = Config(**values)
        except (TypeError, ConfigError):
            return None
        return config if self.space.is_valid(config) else None

    def _invalid_reason(self, params: dict[str, Any]) -> str:
        try:
            return self.space.invalid_reason(Config(**self._decoded(params))) or "not a valid config"
        except (TypeError, ConfigError) as err:
            return str(err)

    def outcome(self, result: TrialResult) -> tuple[float, float]:
        """(value, memory constraint) the sampler learns from a result."""
        return outcome(result, self.context.budget_bytes)

    def outcome_state(self, result: TrialResult) -> tuple[TrialState, float | None, float]:
        """(state, value, constraint) of a result's trial (module doc)."""
        return outcome_state(result, self.context.budget_bytes)

    def follow_record(self) -> None:
        """Once the sweep has told its record (a resumed sweep tells all of it before the first proposal): a
        trial of the study that claims a report_trial the record does not hold (a line removed from trials.jsonl
        by hand) leaves the study, so that the study follows the record (the study as it was is kept as a copy);
        its config is untried again."""
        if self.record.followed:
            return
        followed = self.record.follow(self.study, self.config_of, self.distributions, self.context.budget_bytes)
        if followed is None:
            return
        self.study, untried, note = followed
        self.notes.append(note)
        for config in untried:
            self.outcomes.pop(config, None)
            self.report_trials.pop(config, None)
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            running = self.config_of(trial.params)  # the resumed trial in flight, as the new study holds it
            if running is not None and running in self.pending:
                self.pending[running] = optuna.trial.Trial(self.study, trial._trial_id)

    def warm_start(self) -> list[Config]:
        """The configs the estimator predicts fastest among those predicted to fit, one per structure
        (stage, precision, offloads, checkpointing on or off): where the estimator is wrong about a whole
        structure (a slow offload path, a precision), the next structure's best is already queued."""
        space, budget = self.space, self.context.budget_bytes
        predict = self.context.predict or (lambda c: estimate(c, space.workload, space.hardware))
        estimates = [predict(c) for c in space]
        fitting = sorted((e for e in estimates if e.fits(budget)), key=lambda e: -e.throughput_samples_per_s)
        if not fitting:
            # Nothing is predicted to fit (an uncalibrated estimator can be far off, as on a CPU): measure the
            # config predicted smallest first; it is the likeliest to fit, and calibrates the estimator.
            return [min(estimates, key=lambda e: e.peak_bytes).config] if estimates else []
        picked: dict[tuple, Config] = {}
        for e in fitting:
            c = e.config
            picked.setdefault((c.zero_stage, c.precision, c.offload_optimizer, c.offload_param, c.ckpt_interval > 0), c)
            if len(picked) == WARM_START:
                break
        return list(picked.values())

    # -- helpers

    def _random_state(self) -> dict[str, Any]:
        version, state, gauss = self.rng.getstate()
        sampler = self.study.sampler
        return {"sampler": sampler.random_state() if isinstance(sampler, SamplerView) else {},
                "nearest": [version, list(state), gauss]}

    def _restore_random_state(self) -> str:
        """The random state a stored study kept (module doc) set again; returns the state as JSON, as kept."""
        kept = self.study._storage.get_study_system_attrs(self.study._study_id).get(RANDOM_STATE_KEY)
        if isinstance(kept, dict):
            sampler = self.study.sampler
            if isinstance(sampler, SamplerView) and isinstance(kept.get("sampler"), dict):
                sampler.set_random_state(kept["sampler"])
            if isinstance(kept.get("nearest"), list):
                version, state, gauss = kept["nearest"]
                self.rng.setstate((version, tuple(state), gauss))
        return json.dumps(self._random_state())

    def _keep_random_state(self) -> None:
        """Keep the random state in the study where a proposal drew on it (module doc)."""
        state = self._random_state()
        text = json.dumps(state)
        if text != self._kept_state:
            self.study._storage.set_study_system_attr(self.study._study_id, RANDOM_STATE_KEY, state)
            self._kept_state = text

    def _proposer(self, trial: optuna.trial.Trial) -> str:
        """Who proposed an asked trial: an enqueued trial says so itself (warm start, nearest untried)."""
        return str(trial.user_attrs.get("proposed_by", self.name))

    def _enqueue(self, config: Config, proposed_by: str) -> None:
        """Queue a config; a queued trial (WAITING, e.g. a warm start the hybrid's policy left no room for)
        shows its knobs' values too."""
        self.study.enqueue_trial(self.params_of(config), user_attrs={
            **config.to_dict(), "config": config.label(), "proposed_by": proposed_by, "status": "queued"})

    def _asked(self, trial: optuna.trial.Trial, config: Config) -> None:
        """A proposal about to run: its knobs' values show in the study while it runs."""
        self.pending[config] = trial
        held = trial.user_attrs  # a queued trial's, set when it was enqueued: each write is a storage commit
        for key, value in {**config.to_dict(), "config": config.label(), "proposed_by": self._proposer(trial),
                           "status": "running"}.items():
            if held.get(key) != value:  # no attribute's value is None
                trial.set_user_attr(key, value)

    def _result_attrs(self, result: TrialResult, constraint: float) -> dict[str, Any]:
        return result_attrs(result, constraint)

    def _finish(self, trial: optuna.trial.Trial, state: TrialState, value: float | None, constraint: float | None,
                attrs: dict[str, Any], learnt: float | None = None) -> None:
        """Tell `trial`; `learnt`: the value the samplers see for a PRUNED trial that ran (sampler_view)."""
        for key, item in attrs.items():
            trial.set_user_attr(key, item)
        if constraint is not None:
            # The list format (module doc): optuna-dashboard reads it, Optuna's samplers too.
            trial.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_KEY, [constraint])
        if learnt is not None:
            trial.storage.set_trial_system_attr(trial._trial_id, SAMPLER_VALUE_KEY, learnt)
        self.study.tell(trial, value, state=state)


def outcome(result: TrialResult, budget: int) -> tuple[float, float]:
    """(value, memory constraint) the sampler learns from a result."""
    if result.fits(budget):
        peak = result.peak_memory_bytes
        return float(result.throughput_samples_per_s or 0.0), (peak / budget - 1.0) if peak else 0.0
    peak = result.peak_memory_bytes or result.extra.get("predicted_peak_bytes")
    if result.status in ("oom", "pruned") and peak:
        return PENALTY, max(peak / budget - 1.0, 0.01)
    return PENALTY, INVALID_CONSTRAINT


def outcome_state(result: TrialResult, budget: int) -> tuple[TrialState, float | None, float]:
    """(state, value, constraint) of a result's trial: PRUNED with no value for a config that never ran or did not
    fit (module doc)."""
    value, constraint = outcome(result, budget)
    if result.status == "pruned" or not result.fits(budget):
        return TrialState.PRUNED, None, constraint
    return TrialState.COMPLETE, value, constraint


def result_attrs(result: TrialResult, constraint: float) -> dict[str, Any]:
    """A told trial's user attributes: its status, feasibility, report_trial and measures."""
    attrs: dict[str, Any] = {"status": result.status, "feasible": constraint <= 0}
    if isinstance(result.extra.get("trial"), int):
        attrs["report_trial"] = result.extra["trial"]
    for key in MEASURES:
        if getattr(result, key) is not None:
            attrs[key] = getattr(result, key)
    if result.status == "pruned" and result.extra.get("predicted_peak_bytes"):
        attrs["predicted_peak_bytes"] = result.extra["predicted_peak_bytes"]
    if result.error:
        attrs["reason"] = result.error[:REASON_CHARS]
    return attrs


def recorded_trial(config: Config, result: TrialResult, budget: int, distributions: dict[str, BaseDistribution],
                   proposed_by: str) -> optuna.trial.FrozenTrial:
    """A recorded result as a finished trial of the study (`add_trial`), encoded as a told proposal is."""
    state, value, constraint = outcome_state(result, budget)
    ran = state == TrialState.PRUNED and result.status != "pruned"
    attrs = {**config.to_dict(), "config": config.label(), "proposed_by": proposed_by, **result_attrs(result, constraint)}
    system = {CONSTRAINTS_KEY: [constraint], **({SAMPLER_VALUE_KEY: outcome(result, budget)[0]} if ran else {})}
    return optuna.trial.create_trial(state=state, params={knob: getattr(config, knob) for knob in KNOBS},
                                     distributions=distributions, value=value, user_attrs=attrs, system_attrs=system)


def describe(study: optuna.Study, context: SearchContext, strategy: str) -> None:
    """What a reader of the study (optuna CLI, optuna-dashboard) needs to read it without the run directory."""
    with warnings.catch_warnings():  # set_metric_names is "experimental" in Optuna 5
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([METRIC])
    w, space = context.space.workload, context.space
    described = {
        "workload": f"{w.model.name}, global batch {w.global_batch}, {w.gpus} x {space.hardware.name}",
        "memory_budget_bytes": context.budget_bytes,
        "strategy": strategy,
        "space": {knob: list(space.choices.knob_values(knob)) for knob in KNOBS},
        "parameters": "one per knob, over the values of `space`; each trial's user attributes hold them "
                      "too (trials of a study begun before 2026-11-26 hold " + ", ".join(
                          f"{k}{INDEX}" for k in ORDERED) + ": the index of the value in `space`)",
        "constraints": "one: memory, peak / budget - 1 (<= 0 fits); 1.0 for an invalid combination or a "
                       "failure with no memory figure",
        "states": "COMPLETE: ran and fit (its throughput); PRUNED: never ran (pruned, invalid, unlikely to "
                  "fit) or ran and failed (user attribute status: oom, crash, ...), infeasible; FAIL: a repeat",
        "trial numbers": "user attribute report_trial is the trial's number in trials.jsonl and the report "
                         "(from 1); Optuna's numbers (from 0) also count proposals that never ran",
    }
    current = study.user_attrs
    for key, value in described.items():
        if current.get(key) != value:
            study.set_user_attr(key, value)


class Record:
    """What a sweep told a study's keeper of its record (trials.jsonl): each result by (report_trial, config), so
    that the study can follow the record once all of it is told (`follow`)."""

    def __init__(self) -> None:
        self.pairs: dict[tuple[int, Config], TrialResult] = {}
        self.followed = False

    def told(self, config: Config, result: TrialResult) -> None:
        if not self.followed and isinstance(result.extra.get("trial"), int):
            self.pairs.setdefault((result.extra["trial"], config), result)

    def follow(self, study: optuna.Study, config_of: Callable[[dict[str, Any]], Config | None],
               distributions: dict[str, BaseDistribution],
               budget: int) -> tuple[optuna.Study, list[Config], str] | None:
        """Make `study` follow the record: trials claiming a report_trial the record does not hold (by number and
        config) are left out of a new study of the same name, the study as it was kept as a copy (nothing is
        lost), and recorded results the study lacked under their number are added. Returns (the new study, the
        configs removed, a line saying so), or None when the study already follows the record (or lives in
        memory). Done once: later results are told as they come."""
        self.followed = True
        pairs, self.pairs = self.pairs, {}
        storage = study._storage
        if isinstance(storage, optuna.storages.InMemoryStorage):
            return None
        trials = study.get_trials(deepcopy=False)
        claimed = {t.number: (t.user_attrs["report_trial"], config_of(t.params)) for t in trials
                   if isinstance(t.user_attrs.get("report_trial"), int)}
        stale = {n for n, pair in claimed.items() if pair not in pairs}
        if not stale:
            return None
        name, when = study.study_name, time.strftime("%Y-%m-%d %H:%M:%S")
        kept_as = f"{name} (before following trials.jsonl, {when})"
        optuna.copy_study(from_study_name=name, from_storage=storage, to_storage=storage, to_study_name=kept_as)
        attrs = dict(study.user_attrs)
        # What the strategies keep beside the trials (the metric's name, the random state, the hybrid's refusals).
        system = storage.get_study_system_attrs(study._study_id)
        optuna.delete_study(study_name=name, storage=storage)
        followed = optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=study.sampler)
        for key, value in attrs.items():
            followed.set_user_attr(key, value)
        for key, value in system.items():
            storage.set_study_system_attr(followed._study_id, key, value)
        followed.add_trials([t for t in trials if t.number not in stale])
        kept = {pair for n, pair in claimed.items() if n not in stale}
        for (number, config), result in pairs.items():  # recorded, but under another number in the study
            if (number, config) not in kept:
                followed.add_trial(recorded_trial(config, result, budget, distributions, "record"))
        removed = sorted((claimed[n] for n in stale), key=lambda pair: pair[0])
        names = ", ".join(f"{number} ({config.label() if config is not None else '?'})" for number, config in removed)
        note = (f"the Optuna study {name!r} followed trials.jsonl: it held report_trial {names}, which the record "
                f"does not; the study as it was is kept as {kept_as!r}")
        followed.set_user_attr("followed_record", note)
        recorded = {config for _, config in pairs}
        return followed, [c for _, c in removed if c is not None and c not in recorded], note


class StudyRecord:
    """The study of a strategy that samples none of its own (random, grid; the report writes the record of any
    other into it): every recorded result as a finished trial, encoded as the optuna strategy's study holds it,
    so that optuna-dashboard, the `optuna` CLI and optuna.load_study read every strategy's sweep alike. A result
    already in the study (same report_trial and config) is not added twice; the study follows the record
    (Record.follow) at the first proposal. No storage (a sweep in memory): nothing is kept."""

    def __init__(self, context: SearchContext, strategy: str) -> None:
        self.context = context
        self.distributions = _distributions(context.space)
        self.record = Record()
        self.notes: list[str] = []
        self.study: optuna.Study | None = None
        self.there: set[tuple[int, Config | None]] = set()
        if context.storage is None:
            return
        storage, name = context.storage, context.study_name
        # Loaded when there (create_study(load_if_exists=True) would log that it found one, at every close).
        self.study = (optuna.load_study(study_name=name, storage=storage) if name in get_all_study_names(storage)
                      else optuna.create_study(storage=storage, study_name=name, direction="maximize"))
        describe(self.study, context, strategy)
        self.there = self._there()

    def _there(self) -> set[tuple[int, Config | None]]:
        assert self.study is not None
        return {(t.user_attrs["report_trial"], self.config_of(t.params)) for t in self.study.get_trials(deepcopy=False)
                if isinstance(t.user_attrs.get("report_trial"), int)}

    def config_of(self, params: dict[str, Any]) -> Config | None:
        try:
            config = Config(**{knob: params[knob] for knob in KNOBS if knob in params})
        except (TypeError, ConfigError):
            return None
        return config if self.context.space.is_valid(config) else None

    def observe(self, config: Config, result: TrialResult, proposed_by: str = "record") -> None:
        number = result.extra.get("trial")
        if self.study is None or not isinstance(number, int):
            return
        self.record.told(config, result)
        if (number, config) in self.there:
            return
        self.study.add_trial(recorded_trial(config, result, self.context.budget_bytes, self.distributions,
                                            proposed_by))
        self.there.add((number, config))

    def follow_record(self) -> None:
        """At the first proposal: the study follows the record told so far (Record.follow)."""
        if self.study is None or self.record.followed:
            return
        followed = self.record.follow(self.study, self.config_of, self.distributions, self.context.budget_bytes)
        if followed is not None:
            self.study, _, note = followed
            self.notes.append(note)
            self.there = self._there()


def _distributions(space) -> dict[str, BaseDistribution]:
    """Each knob over its values; the samplers see ordered knobs as indices (sampler_view)."""
    return {knob: CategoricalDistribution(list(space.choices.knob_values(knob))) for knob in KNOBS}
