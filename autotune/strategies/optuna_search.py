"""`optuna` (TPE, multivariate; the default) and `optuna-gp` (Gaussian process) over the whole space.

Encoding: one parameter per knob. Ordered knobs (zero_stage, micro_batch, ckpt_interval) are integers
indexing their list of choices, so the sampler's kernels see that micro-batch 4 lies between 2 and 8;
unordered knobs (precision and the offloads) are categorical. A knob combination that is not a valid
config (e.g. CPU offload with ZeRO-0, a micro-batch that does not divide the global batch, a config a
replay surface never measured) is told at once as an infeasible completed trial with the penalty value,
without running or recording anything, and the nearest untried valid config runs in its place: the
sampler learns the invalid region as it learns the out-of-memory one, and every proposal costs at most
two asks however sparse the valid configs are. One categorical over the flat index of valid configs would
avoid invalid proposals but hide every relation between configs from the sampler.

Objective: samples/s, maximised. A failure (oom, crash, timeout, unsupported) or a pruned config is a
COMPLETE trial with value PENALTY and a positive `memory` constraint (Trial.set_constraint), so the
sampler learns from it (a FAIL trial would be ignored); TPE ranks infeasible trials below all feasible
ones, and among themselves by how far they broke the constraint. Feasible trials carry
peak/budget - 1 <= 0.

The study lives in the storage of the run directory when one is given. A resumed study keeps what it
learnt; a trial left RUNNING by a killed tuner is taken over: told from the recorded result if the driver
recorded one, and otherwise proposed again before anything else (ahead of warm-start trials still
waiting in the queue), so the config that was in flight runs again first.
"""

from __future__ import annotations

import random
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from autotune.config import KNOBS, Config, ConfigError
from autotune.estimate import estimate
from autotune.results import TrialResult
from autotune.strategies import SearchContext

ORDERED = ("zero_stage", "micro_batch", "ckpt_interval")
PENALTY = 0.0  # samples/s told for a config that did not run within budget
INVALID_CONSTRAINT = 1.0  # constraint told for invalid combinations and for failures with no memory figure
WARM_START = 5  # the estimator's best predicted configs (one per memory layout and precision), tried first
STARTUP_TRIALS = 8  # proposals (including the warm start) before the model-based sampler takes over
STUDY_NAME = "autotune"


def tpe(context: SearchContext) -> "OptunaStrategy":
    # constant_liar: trials still running (several in flight on a Ray cluster) count as bad, so that
    # concurrent proposals spread out instead of repeating one guess.
    sampler = optuna.samplers.TPESampler(seed=context.seed, multivariate=True, n_startup_trials=STARTUP_TRIALS,
                                         constant_liar=True)
    return OptunaStrategy(context, sampler, "optuna")


def gp(context: SearchContext) -> "OptunaStrategy":
    sampler = optuna.samplers.GPSampler(seed=context.seed, n_startup_trials=STARTUP_TRIALS)
    return OptunaStrategy(context, sampler, "optuna-gp")


class OptunaStrategy:
    def __init__(self, context: SearchContext, sampler: optuna.samplers.BaseSampler, name: str) -> None:
        self.name = name
        self.context = context
        self.space = context.space
        self.rng = random.Random(context.seed)
        self.distributions = _distributions(self.space)
        self.study = optuna.create_study(storage=context.storage, study_name=STUDY_NAME, direction="maximize",
                                         sampler=sampler, load_if_exists=True)
        self.outcomes: dict[Config, tuple[float, float]] = {}  # config -> (value, constraint) told
        self.pending: dict[Config, optuna.trial.Trial] = {}  # asked, not yet told
        self.resumed: list[Config] = []  # in flight when an earlier tuner was killed: proposed first
        trials = self.study.get_trials(deepcopy=False)
        for trial in trials:
            config = self.config_of(trial.params)
            if trial.state == TrialState.COMPLETE and config is not None:
                assert trial.value is not None, "a complete trial of a single-objective study has its value"
                self.outcomes.setdefault(config, (trial.value, sum(trial.constraints.values())))
            elif trial.state == TrialState.RUNNING:
                if config is None or config in self.pending:
                    self.study.tell(trial.number, state=TrialState.FAIL)
                else:
                    self.pending[config] = optuna.trial.Trial(self.study, trial._trial_id)
                    self.resumed.append(config)
        if not trials:
            for config in self.warm_start():
                self.study.enqueue_trial(self.params_of(config))

    # -- the Strategy interface

    def propose(self) -> Config | None:
        while self.resumed:
            resumed = self.resumed.pop(0)
            if resumed in self.pending:  # not already told from the recorded history
                return resumed
        trial = self.study.ask(self.distributions)
        config = self.config_of(trial.params)
        if config is not None and config not in self.outcomes:
            self.pending[config] = trial
            return config
        # An invalid combination, or a config already measured: the sampler learns that at once (the
        # penalty, or the known result again), and the nearest config not tried yet runs in its place.
        # So a proposal costs at most two asks, however sparse the valid configs are in the knob grid
        # (a replay surface that measured a fraction of the space).
        if config is None:
            self._tell(trial, PENALTY, INVALID_CONSTRAINT, "invalid")
        else:
            self._tell(trial, *self.outcomes[config], "repeat")
        nearest = self.nearest_untried(trial.params)
        if nearest is None:
            return None
        self.study.enqueue_trial(self.params_of(nearest))
        self.pending[nearest] = self.study.ask(self.distributions)
        return nearest

    def nearest_untried(self, params: dict[str, Any]) -> Config | None:
        """The untried valid config closest to a proposal: index distance on ordered knobs, 1 per other
        knob that differs; ties broken by the seeded generator."""
        wanted = []
        for knob in KNOBS:
            values = self.space.choices.knob_values(knob)
            wanted.append(params[f"{knob}_index"] if knob in ORDERED else values.index(params[knob]))
        best, best_distance = [], None
        for config in self.space:
            if config in self.outcomes or config in self.pending:
                continue
            codes = self.space.encode(config)
            distance = sum(abs(a - b) if knob in ORDERED else int(a != b) for knob, a, b in zip(KNOBS, codes, wanted))
            if best_distance is None or distance < best_distance:
                best, best_distance = [config], distance
            elif distance == best_distance:
                best.append(config)
        return self.rng.choice(best) if best else None

    def observe(self, config: Config, result: TrialResult) -> None:
        value, constraint = self.outcome(result)
        if config in self.pending:
            self._tell(self.pending.pop(config), value, constraint, result.status)
        elif config not in self.outcomes:
            self._add(config, value, constraint, result.status)
        self.outcomes.setdefault(config, (value, constraint))

    def _add(self, config: Config, value: float, constraint: float, status: str) -> None:
        self.study.add_trial(optuna.trial.create_trial(
            params=self.params_of(config), distributions=self.distributions, value=value,
            constraints={"memory": constraint}, user_attrs={"status": status}))

    # -- encoding

    def params_of(self, config: Config) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for knob in KNOBS:
            value = getattr(config, knob)
            if knob in ORDERED:
                params[f"{knob}_index"] = self.space.choices.knob_values(knob).index(value)
            else:
                params[knob] = value
        return params

    def config_of(self, params: dict[str, Any]) -> Config | None:
        """The config of a trial's parameters, or None if that combination is not a valid config here."""
        values = {}
        try:
            for knob in KNOBS:
                if knob in ORDERED:
                    values[knob] = self.space.choices.knob_values(knob)[params[f"{knob}_index"]]
                else:
                    values[knob] = params[knob]
            config = Config(**values)
        except (KeyError, IndexError, ConfigError):
            return None
        return config if self.space.is_valid(config) else None

    def outcome(self, result: TrialResult) -> tuple[float, float]:
        """(value, memory constraint) told to the sampler for a result."""
        budget = self.context.budget_bytes
        if result.fits(budget):
            peak = result.peak_memory_bytes
            return float(result.throughput_samples_per_s or 0.0), (peak / budget - 1.0) if peak else 0.0
        peak = result.peak_memory_bytes or result.extra.get("predicted_peak_bytes")
        if result.status in ("oom", "pruned") and peak:
            return PENALTY, max(peak / budget - 1.0, 0.01)
        return PENALTY, INVALID_CONSTRAINT

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

    def _tell(self, trial: optuna.trial.Trial, value: float, constraint: float, status: str) -> None:
        if "memory" not in trial.constraints:  # a killed tuner may have set it before it could tell
            trial.set_constraint("memory", constraint)
        trial.set_user_attr("status", status)
        self.study.tell(trial, value)


def _distributions(space) -> dict[str, BaseDistribution]:
    out: dict[str, BaseDistribution] = {}
    for knob in KNOBS:
        values = space.choices.knob_values(knob)
        if knob in ORDERED:
            out[f"{knob}_index"] = IntDistribution(0, len(values) - 1)
        else:
            out[knob] = CategoricalDistribution(list(values))
    return out
