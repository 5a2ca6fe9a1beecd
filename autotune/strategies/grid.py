"""`grid`: DeepSpeed's own autotuner's behaviour, the baseline to beat.

As `deepspeed --autotuning tune` does (deepspeed/autotuning/autotuner.py, `tune` and `tune_space`):
ZeRO stages in order 0-3; only the stage and the micro-batch are searched, every other knob stays at
the space's default (the first value of its list); a stage whose model states do not fit is skipped;
micro-batches are tried from the smallest up to the largest predicted to fit, and a stage whose largest
fitting micro-batch is smaller than the previous stage's is skipped; the search stops after
`EARLY_STOP` trials in a row without improvement. DeepSpeed uses its own model-state and activation
estimates for the memory decisions; here they come from autotune.prediction.estimate, as the sweep's forecast
holds them (SearchContext.forecast: recalibrated after each trial): "predicted to fit" is even odds of fitting
(the forecast's median peak within the budget; before any trial, the estimator's own peak), or, where none of
grid's configs is that likely (an uncalibrated estimator can put every config over the budget, as on a CPU:
grid then ran nothing), nearly as likely as the likeliest of them (strategies.guide's floor). Grid walks the
search's space as given, a replay surface's measured configs (`Space.only`) included.
"""

from __future__ import annotations

from functools import cached_property
from typing import Generator

from autotune.values.config import KNOBS, Config
from autotune.prediction.estimate import estimate
from autotune.values.results import TrialResult
from autotune.strategies import SearchContext
from autotune.strategies.guide import LIKELY, NEARLY
from autotune.strategies.optuna_search import StudyRecord

EARLY_STOP = 5  # DeepSpeed's tuner_early_stopping default


class GridStrategy:
    name = "grid"

    def __init__(self, context: SearchContext) -> None:
        self.context = context
        self.known: dict[Config, TrialResult] = {}
        self._plan = self._walk()
        self._waiting: Config | None = None
        self.study = StudyRecord(context, self.name)

    def propose(self) -> Config | None:
        self.study.follow_record()
        if self._waiting is not None and self._waiting not in self.known:
            return self._waiting  # asked again before the last proposal's result came back
        try:
            self._waiting = next(self._plan)
        except StopIteration:
            self._waiting = None
        return self._waiting

    @property
    def notes(self) -> list[str]:
        """What following the record changed in its study (optuna_search.Record.follow), for the sweep to say."""
        return self.study.notes

    def observe(self, config: Config, result: TrialResult) -> None:
        self.known[config] = result
        self.study.observe(config, result, self.name)

    def stage_config(self, stage: int, micro_batch: int) -> Config | None:
        """The valid config of this stage and micro-batch closest to the space's defaults."""
        defaults = self.context.space.choices.default()
        candidates = [c for c in self.context.space if c.zero_stage == stage and c.micro_batch == micro_batch]
        if not candidates:
            return None
        return min(candidates, key=lambda c: sum(getattr(c, k) != defaults[k] for k in KNOBS))

    @cached_property
    def plan(self) -> dict[int, list[Config]]:
        """Grid's sub-space: per ZeRO stage, ascending, its config of each micro-batch (stage_config), of the
        search's space (a replay surface's: its measured configs)."""
        space = self.context.space
        return {stage: [c for mb in sorted(space.choices.micro_batch) if (c := self.stage_config(stage, mb))]
                for stage in sorted(space.choices.zero_stage)}

    def fitting(self, configs: list[Config]) -> list[Config]:
        """Those of `configs` predicted to fit the budget (the module's docstring), as the sweep knows it now."""
        budget, forecast = self.context.budget_bytes, self.context.forecast
        if forecast is None:  # no sweep: the estimator's own point prediction
            space = self.context.space
            predict = self.context.predict or (lambda c: estimate(c, space.workload, space.hardware))
            return [c for c in configs if predict(c).fits(budget)]
        likeliest = max((forecast(c).fit_probability(budget) for cs in self.plan.values() for c in cs),
                        default=0.0)
        floor = min(LIKELY, NEARLY * likeliest)
        return [c for c in configs if forecast(c).fit_probability(budget) >= floor]

    def _walk(self) -> Generator[Config, None, None]:
        """Yields configs to run; results arrive in self.known (already-known configs are not yielded)."""
        budget = self.context.budget_bytes
        best = 0.0
        stall = 0
        previous_max = 0
        for stage, plan in self.plan.items():
            fitting = self.fitting(plan)
            if not fitting:
                continue  # the model states (plus the smallest micro-batch) do not fit at this stage
            largest = max(c.micro_batch for c in fitting)
            if largest < previous_max:
                continue  # a higher stage only pays off when it lets a bigger micro-batch run
            previous_max = largest
            for config in fitting:
                if config not in self.known:
                    yield config
                result = self.known[config]
                if not result.fits(budget):
                    break  # bigger micro-batches of this stage will not fit either
                throughput = result.throughput_samples_per_s or 0.0
                if throughput > best:
                    best, stall = throughput, 0
                else:
                    stall += 1
                    if stall >= EARLY_STOP:
                        return
