"""The state of one sweep, shared by every driver: the strategy, the estimator's pruning, the recorded
history and the best result so far. A driver asks `next_config()` for work and hands each result to
`finish()`; both record to the run's append-only trial log in order, so the log always holds every
decision made so far and nothing else.

Confirmation of close calls (autotune/search/confirm.py): with `Budget.confirm` repeats per finalist, the search
stops early enough to leave the repeats room, then the finalists run again; a repeat is recorded like any
trial (marked `"phase": "confirm"`) but not told to the strategy, and `best` is the best median."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Collection, Protocol, Sequence

from autotune.search import confirm

from autotune.backends.deepspeed import settle_log_dir
from autotune.prediction.calibrate import calibrator
from autotune.search.convergence import DEFAULT_STOP_WHEN, Convergence, StopRule, assess, recorded
from autotune.files import short
from autotune.values.config import Config, ConfigError
from autotune.drivers.stop import StopReason
from autotune.prediction.estimate import Calibration
from autotune.search.pruning import LivePruner, Pruner, cause_of
from autotune.values.results import TrialResult
from autotune.values.space import Space
from autotune.strategies import SearchContext, Strategy, make_strategy, strategy_name
from autotune.values.units import counted

if TYPE_CHECKING:
    from autotune.search.rundir import RunDir
    from autotune.values.settings import RunSettings


EARLY = (StopReason.CONVERGED, StopReason.NOT_WORTH)  # the convergence stop's reasons: the search ended itself


@dataclass(frozen=True)
class Budget:
    trials: int  # trials launched (pruned configs cost nothing and do not count)
    # The recorded trials' wall time (as their backend reports it), counted over every session of a resumed sweep:
    # no trial starts that is expected to end after it (Sweep._overruns).
    time_s: float | None = None
    # Repeats per finalist of the confirmation of close calls (autotune/search/confirm.py), counted in `trials`;
    # None: the backend's default (confirm.default_repeats: on for real trials, off for simulated and replay).
    confirm: int | None = None
    # The convergence stop (autotune/search/convergence.py): the search ends once the chance that an untried config
    # beats the best by more than the launch noise is below this; 0: off (the trials or time end it).
    stop_when: float = DEFAULT_STOP_WHEN
    # How long the recommendation will train (StopRule.train_s): the search also stops once no untried config is
    # expected to save that run more than its trial costs; None: off.
    train_s: float | None = None


class Listener(Protocol):
    """What hears every result the sweep records, after the record (experiment tracking: autotune.outputs.tracking's
    Tracker, a layer above)."""

    def trial(self, result: TrialResult) -> None: ...


class _Deaf:
    def trial(self, result: TrialResult) -> None:
        pass


def _ignore(_: Any) -> None:
    pass


@dataclass(frozen=True)
class Hooks:
    """Who hears what a sweep does, given when it is made: experiment tracking each recorded result (after the
    record), a display each config pruned and each message (confirmation's finalists)."""

    listener: Listener = _Deaf()
    on_pruned: Callable[[TrialResult], None] = _ignore
    on_message: Callable[[str], None] = _ignore


def measurable(result: TrialResult) -> bool:
    return result.ok and bool(result.peak_memory_bytes) and bool(result.step_time_s)


class Sweep:
    def __init__(self, strategy: Strategy, pruner: Pruner, record: Callable[[TrialResult], None],
                 backend_name: str, history: Sequence[TrialResult] = (),
                 calibrate: Callable[[Sequence[TrialResult]], Calibration] | None = None,
                 space_size: int = 0, live: LivePruner | None = None, space: Space | None = None, *,
                 hooks: Hooks = Hooks(), launch_sigma: float | None = None) -> None:
        self.strategy = strategy
        self.hooks = hooks
        self._space = space  # the configs the convergence stop weighs (None: no such stop)
        # The strategy's view of the pruner as it learns (SearchContext.forecast), when it was given one.
        self._live = live or LivePruner(pruner)
        self.pruner = pruner
        self._record = record
        self.backend_name = backend_name
        self.calibrate = calibrate
        self.results: list[TrialResult] = list(history)
        # The search's own result per config (a repeat of confirmation never replaces it).
        self.known: dict[Config, TrialResult] = {}
        for r in history:
            self.known.setdefault(r.config, r)
        self.best = confirm.recommend(self.results, pruner.budget_bytes)
        self.repeats_run = sum(confirm.is_repeat(r) for r in history)
        # The launch spread assumed until this run's repeats measure it (the caller may know its backend's).
        self.launch_sigma = confirm.prior_sigma(backend_name) if launch_sigma is None else launch_sigma
        self.search_ended: StopReason | None = None  # the strategy had nothing left (this session)
        self.out_of_time = False  # the next trial was predicted to end after the time budget (this session)
        self._announced: tuple[Config, ...] = ()
        self.spent_s = sum(r.wall_time_s for r in history)
        # A strategy that only proposes known or pruned configs is stopped after this many in a row.
        self.max_idle = 2 * space_size + 10
        self.stalled = False  # the latest search ran idle (max_idle proposals known or pruned)
        # The chance of a better config after the latest search trial (autotune.search.convergence); None until
        # computed (a resumed sweep computes it again from its record, once its launch spread is set).
        self.convergence: Convergence | None = None
        for result in history:
            if confirm.is_repeat(result):
                continue
            strategy.observe(result.config, result)
            if result.status == "oom":
                self.pruner = self.pruner.with_out_of_memory(result.config, cause_of(result), result.peak_memory_bytes)
        if self.measured():
            self._learn()

    @classmethod
    def open(cls, run_dir: "RunDir", settings: "RunSettings", space: Space, strategy: Any = None, *,
             hooks: Hooks = Hooks(), launch_sigma: float | None = None, storage: Any = None) -> "Sweep":
        """The sweep of a run directory: its recorded history, strategy (its study in the run's storage: `storage`,
        else opened here), pruner. `strategy`: the user's own Strategy object or builder (autotune.strategies), which
        `settings.strategy` names; None: the registered strategy `settings.strategy`. `launch_sigma`: the spread its
        backend's launches have (confirm.prior_sigma; None: its kind's)."""
        pruner = Pruner.for_settings(settings)
        live = LivePruner(pruner)
        context = SearchContext(space, settings.memory_budget_bytes, settings.seed, pruner.predict,
                                storage or run_dir.storage(settings.storage), run_dir.study_name(settings.storage),
                                forecast=live.forecast, uncertainty=live.uncertainty, trial_seconds=live.trial_seconds)
        chosen = settings.strategy if strategy is None else strategy
        return cls(make_strategy(chosen, context), pruner, run_dir.append, settings.backend,
                   run_dir.results(), calibrator(settings.workload, settings.hardware), len(space), live, space,
                   hooks=hooks, launch_sigma=launch_sigma)

    @classmethod
    def in_memory(cls, space: Space, budget_bytes: int, strategy: str | Callable[[SearchContext], Strategy],
                  backend_name: str, seed: int = 0, *, record: Callable[[TrialResult], None] = lambda r: None,
                  calibrate: bool = True, storage: Any = None, launch_sigma: float | None = None) -> "Sweep":
        """A sweep with no run directory (benchmarks, tests): `strategy` is a name or builds one from its context;
        `record` hears every result in order; `calibrate` refits the estimator on measured trials, as tune does."""
        pruner = Pruner(space.workload, space.hardware, budget_bytes)
        live = LivePruner(pruner)
        context = SearchContext(space, budget_bytes, seed, pruner.predict, storage, forecast=live.forecast,
                                uncertainty=live.uncertainty, trial_seconds=live.trial_seconds)
        built = make_strategy(strategy, context)
        return cls(built, pruner, record, backend_name, (),
                   calibrator(space.workload, space.hardware) if calibrate else None, len(space), live, space,
                   launch_sigma=launch_sigma)

    @property
    def pruner(self) -> Pruner:
        return self._live.pruner

    @pruner.setter
    def pruner(self, pruner: Pruner) -> None:
        self._live.pruner = pruner

    def _shown_nothing_fits(self) -> bool:
        """No trial ran within the budget and what the trials taught leaves no config predicted to fit."""
        return self.best is None and self._space is not None and self.nothing_fits(self._space)

    def nothing_fits(self, space: Space) -> bool:
        """Every config would be pruned: say so rather than record the whole space."""
        return not any(self.pruner.check(c, self.backend_name) is None for c in space)

    def refused_at_start(self, space: Space) -> StopReason | None:
        """NOTHING_FITS for a sweep with nothing recorded whose space is all predicted not to fit: it runs nothing.
        A sweep with a record (resumed) is never refused here: a session whose trials showed nothing fits goes on
        recording each config its strategy proposes as pruned until the strategy ends (`ended` then says nothing
        fits), so a resume of an interrupted session must carry on as that session would have, or the configs it
        had not reached yet are missing from the record; a resume of a session that ended proposes nothing new
        (its budget is spent, or its strategy has nothing left), and says nothing fits as that session did."""
        return StopReason.NOTHING_FITS if not self.results and self.nothing_fits(space) else None

    def budget_spent(self, budget: Budget, in_flight: int = 0) -> StopReason | None:
        """TRIALS or TIME once no further trial may start (trials in flight count as launched); NOTHING_FITS in
        their place where the trials that ran leave no config predicted to fit (what a resume of it says too)."""
        if self.launched + in_flight >= budget.trials:
            if not in_flight and self._shown_nothing_fits():
                return StopReason.NOTHING_FITS
            return StopReason.TRIALS
        if budget.time_s is not None and self.spent_s >= budget.time_s:
            return StopReason.TIME
        return None

    @property
    def launched(self) -> int:
        """Trials that ran (or were started), in this session and earlier ones."""
        return sum(r.status != "pruned" for r in self.results)

    @property
    def next_number(self) -> int:
        """1-based position in the trial log of the next result."""
        return len(self.results) + 1

    def measured(self) -> list[TrialResult]:
        """Results the estimator can be calibrated on: every trial that ran, on whatever backend (a replay
        surface is real measurements; a simulated machine is the machine of that simulation)."""
        return [r for r in self.results if measurable(r)]

    def repeats(self, budget: Budget | None) -> int:
        """Repeats per finalist the confirmation runs under `budget`."""
        if budget is None:
            return 0
        return confirm.default_repeats(self.backend_name) if budget.confirm is None else budget.confirm

    def next_config(self, budget: Budget | None = None, in_flight: Collection[Config] = ()) -> Config | None:
        """The next config to launch, or None when the strategy is done (or stalled) and nothing needs
        confirming, or when confirmation waits for the search's trials in flight. Configs predicted not
        to fit are recorded as pruned here; configs already known are answered from the record. With a
        budget that confirms, the search stops once the trials left are the confirmation's reserve. With a time
        budget, no trial starts that is predicted to end after it (`_overruns`): the sweep ends there (TIME)."""
        if self.out_of_time:
            return None
        config = self._next(budget, in_flight)
        if config is not None and self._overruns(budget, config, in_flight):
            self.out_of_time = True
            return None
        return config

    def _next(self, budget: Budget | None, in_flight: Collection[Config]) -> Config | None:
        repeats = self.repeats(budget)
        if self.search_ended is None:
            self.search_ended = self._converged(budget)
        if not repeats:
            return None if self.search_ended in EARLY else self._search()
        assert budget is not None
        if self.search_ended is None and not self._search_over(budget, repeats, in_flight):
            config = self._search()
            if config is not None:
                return config
            self.search_ended = StopReason.STALLED if self.stalled else StopReason.DONE
        self.stalled = self.search_ended == StopReason.STALLED  # the loop's stop reason, once nothing is left
        if any(c not in self.known for c in in_flight):
            return None  # the finalists depend on the search's trials still running
        plan = confirm.plan(self.results, self.pruner.budget_bytes, repeats, self.launch_sigma, in_flight)
        if plan.next is not None:
            self._announce(plan, repeats, budget.trials - self.launched - len(in_flight))
        return plan.next

    def _overruns(self, budget: Budget | None, config: Config, in_flight: Collection[Config]) -> bool:
        """`config`'s trial would end after the time budget: the trials' seconds so far, and those in flight and its
        own as the sweep expects them (Pruner.expected_wall_s: the trial-time model scaled by this sweep's trials).
        An overnight sweep's budget is when its trials are done, not when the last one may start; a sweep that has
        run no trial yet has nothing to judge by and starts its first."""
        if budget is None or budget.time_s is None:
            return False
        expected = self.pruner.expected_wall_s((*in_flight, config), self.results)
        return expected is not None and self.spent_s + expected > budget.time_s

    def ended(self) -> StopReason:
        """Why the search proposes nothing more: converged (or not worth another trial), nothing fits (no trial ran
        within the budget and what the trials taught leaves no config predicted to fit: what a resume would say at
        its start), every config of the space tried or pruned (whatever the strategy), stalled or done (the
        strategy's own end), or the time budget, which no further trial is predicted to end within."""
        if self.out_of_time:
            return StopReason.TIME
        if self.search_ended in EARLY:
            return self.search_ended
        if self._shown_nothing_fits():
            return StopReason.NOTHING_FITS
        if self._space is not None and all(c in self.known for c in self._space):
            return StopReason.EXHAUSTED
        return StopReason.STALLED if self.stalled else StopReason.DONE

    def _converged(self, budget: Budget | None) -> StopReason | None:
        """Which of the convergence stop's rules is met (autotune/search/convergence.py), if one is."""
        if budget is None or not (budget.stop_when or budget.train_s) or self._space is None:
            return None
        if self.convergence is None and self.results:  # a resumed sweep: the state its record kept
            self.convergence = recorded(self.results)
            if self.convergence is None or (budget.train_s and self.convergence.gain_per_trial_s is None):
                self.convergence = self._assess(self.results, set(self.known))  # a record older than the figure
        rule = StopRule(budget.stop_when, train_s=budget.train_s)
        if rule.chance_met(self.convergence):
            return StopReason.CONVERGED
        return StopReason.NOT_WORTH if rule.seconds_met(self.convergence) else None

    def _assess(self, results: Sequence[TrialResult], tried: Collection[Config]) -> Convergence:
        """The chance that an untried config beats the best of `results` (the recommendation's throughput)."""
        assert self._space is not None, "a sweep without its space has no convergence figure"
        budget = self.pruner.budget_bytes
        best = confirm.recommend(results, budget)
        sigma = confirm.spread(confirm.candidates(results, budget), self.launch_sigma).sigma
        search = sum(r.status != "pruned" and not confirm.is_repeat(r) for r in results)
        # Every untried config's forecast (~0.2 ms each; the strategy's picks reuse them, LivePruner's cache).
        return assess((c for c in self._space if c not in tried), self._live.forecast, self.pruner.uncertainty,
                      budget, best.throughput if best is not None else None, sigma, search,
                      self.pruner.min_fit_probability, seconds=self._live.trial_seconds)

    def _search_over(self, budget: Budget, repeats: int, in_flight: Collection[Config]) -> bool:
        """The trials (or time) left are what confirmation needs."""
        reserve = confirm.reserve(self.results, self.pruner.budget_bytes, repeats, self.launch_sigma,
                                  budget.trials, in_flight)
        if not reserve:
            return False
        if self.launched + len(in_flight) + reserve >= budget.trials:
            return True
        if budget.time_s is None:
            return False
        walls = [r.wall_time_s for r in self.results if r.status != "pruned"]
        typical = sorted(walls)[len(walls) // 2] if walls else 0.0
        return self.spent_s + reserve * typical >= budget.time_s

    def _announce(self, plan: confirm.Plan, repeats: int, left: int) -> None:
        configs = tuple(c.config for c in plan.finalists)
        if configs == self._announced:
            return
        self._announced = configs
        names = ", ".join(f"{c.config.label()} ({c.median:.3g} samples/s, {counted(c.runs, 'run')})"
                          for c in plan.finalists)
        short = f" ({counted(left, 'trial')} of --trials left for it)" if left < plan.wanted else ""
        self.hooks.on_message(f"confirming the close calls in fresh processes, up to {counted(1 + repeats, 'run')} each{short}: {names} "
                        f"(within {plan.spread.typical:.0%} of the best: how much two launches of one config "
                        f"typically differ, from {plan.spread.source})")

    def _search(self) -> Config | None:
        self.stalled = False
        idle = 0
        while idle < self.max_idle:
            config = self.strategy.propose()
            if config is None:
                return None
            self._check_proposal(config)
            if config in self.known:
                self.strategy.observe(config, self.known[config])
            else:
                best = self.best.throughput if self.best is not None else None
                pruned = self.pruner.check(config, self.backend_name, best)
                if pruned is None:
                    return config
                pruned = self._add(pruned)
                self.hooks.on_pruned(pruned)
            idle += 1
        self.stalled = True
        return None

    def _check_proposal(self, config: Any) -> None:
        """A strategy's proposal is a Config whose every knob value is one of the space's: anything else (a user's
        strategy's mistake) is refused before it is recorded, as one line naming the strategy, what it proposed
        and what the space allows, the record so far intact. A value outside the space would be recorded, then
        refused by the outputs' Optuna study (its distributions are the space's values); a combination the
        space's rules refuse (offload without ZeRO, say) is the pruner's and the backend's to answer, as ever."""
        name = strategy_name(self.strategy)
        if not isinstance(config, Config):
            raise ConfigError(f"strategy {name!r}: propose() returned {short(config)}: allowed a Config of the space "
                              "(autotune.Config), or None when it has nothing left to propose")
        if self._space is None:
            return
        outside = self._space.choices.outside(config)
        if outside is not None:
            knob, value, allowed = outside
            raise ConfigError(f"strategy {name!r}: propose() returned {config.label()}, outside the space: "
                              f"{knob} {value!r} is not one of its values (allowed {', '.join(map(repr, allowed))})")

    def finish(self, config: Config, result: TrialResult) -> TrialResult:
        """Record a launched trial's result (a peak over budget becomes `oom`) and tell the strategy; a
        repeat of a known config (confirmation) is recorded as one and told to no strategy."""
        est = self.pruner.predict(config)
        # The prediction the tuner launched on (calibrated as of now) replaces any the backend made.
        extra = {**result.extra, "predicted_peak_bytes": est.peak_bytes, "predicted_step_time_s": est.step_time_s,
                 "predicted_throughput_samples_per_s": est.throughput_samples_per_s}
        first = self.known.get(config)
        if first is not None:
            extra.update(phase=confirm.PHASE, repeat_of=first.extra.get("trial"))
        result = replace(result, config=config, extra=extra).under_budget(self.pruner.budget_bytes)
        if first is None:  # learnt before the record, so that the record carries the convergence figure
            result = self._taught(result)
        result = self._add(result)
        self.spent_s += result.wall_time_s
        self.repeats_run += first is not None
        # The one rule (confirm.recommend) the outputs' recommendation uses too (outputs.report.recommendation,
        # which only adds --target-gpus' pick): the best median within the budget (ties: confirm.candidates).
        self.best = confirm.recommend(self.results, self.pruner.budget_bytes)
        if first is not None and measurable(result):
            self._learn()
        return result

    def _taught(self, result: TrialResult) -> TrialResult:
        """The pruner taught a search trial's result (not yet recorded), and the result with the chance of a
        better config that is left (autotune.search.convergence) in its extra."""
        if result.status == "oom":
            self.pruner = self.pruner.with_out_of_memory(result.config, cause_of(result), result.peak_memory_bytes)
        if measurable(result):
            self._learn(result)
        if self._space is None:
            return result
        self.convergence = self._assess([*self.results, result], {*self.known, result.config})
        return replace(result, extra={**result.extra, **self.convergence.to_extra()})

    def _learn(self, pending: TrialResult | None = None) -> None:
        """The pruner refitted on the measured results (and `pending`, not yet recorded): the estimator's
        scales (unless this sweep does not calibrate) and, either way, the uncertainty of its predictions."""
        measured = self.measured() + ([pending] if pending is not None else [])
        calibration = self.calibrate(measured) if self.calibrate is not None else self.pruner.calibration
        self.pruner = self.pruner.recalibrated(calibration, measured)

    def _add(self, result: TrialResult) -> TrialResult:
        number = self.next_number
        # Its log folder under that number before the record names it (trials in flight together finish in any order).
        result = settle_log_dir(replace(result, extra={**result.extra, "trial": number}), number)
        self._record(result)  # durable before the strategy hears of it: a crash in between is replayed
        self.results.append(result)
        self.hooks.listener.trial(result)  # after the record: a resumed sweep logs what a crash left unlogged
        if not confirm.is_repeat(result):
            self.known[result.config] = result
            self.strategy.observe(result.config, result)
        return result
