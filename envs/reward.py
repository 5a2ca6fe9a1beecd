"""The environment's reward: throughput normalised per workload, penalties for memory and failures.

Normalisation. Throughput is divided by the task's *reference throughput*, so that a trial at the
task's best config earns about 1 whether the model has 1M or 70B parameters:
- simulated backend: the noise-free optimum of the task (the estimator's best throughput over the
  configs predicted to fit the budget);
- replay backend: the best throughput the surface measured within the budget;
- deepspeed (and any other backend object): the estimator's best predicted throughput within the budget
  (calibrated if the environment is given a calibration), so rewards can exceed 1 where the estimator
  is pessimistic.
When no config fits, the reference is the best throughput over all configs, ignoring the budget.

Per trial (`mode="throughput"`, the default):
    ok within budget:          throughput / reference - trial_cost
    oom (incl. over budget):   -oom_penalty - over_budget_coef * min(over_budget_cap, peak / budget - 1) - trial_cost
    crash, timeout, unsupported: -failure_penalty - trial_cost
    pruned:                    -trial_cost
`trial_cost` is a trial's price whatever it takes; `second_cost` (issue 41, 0 by default) adds a price per
trial-second, in units of the episode's `seconds_unit` (the predicted seconds of a trial of the config predicted
best): a trial that takes twice as long (an offloaded optimizer's) costs twice as much, an out-of-memory trial
the seconds it burnt before dying, a pruned config none.
A peak over budget is counted wherever the result carries one (the simulated backend reports the
predicted need, replay the measured peak; a real OOM may carry none, then only the fixed penalty applies).

`stop` ends the episode and "deploys" the best feasible config found for the steps left in the
horizon, counting the stop step: (horizon - steps_before_stop) * best / reference. So stopping is never
worse than re-running the best config until the horizon, and better by the trial costs saved; an agent
stops once it believes it has found the best.

`mode="improvement"` rewards only progress of the best feasible throughput:
    ok within budget: max(0, throughput - best_before) / reference - trial_cost; penalties as above;
    stop: 0. The return is then the best found / reference minus penalties and costs: the search
    objective "find the best config in few trials" itself.

An action the mask forbids (only possible when a caller ignores the mask) runs nothing and earns
-invalid_action_penalty.

Defaults are chosen so that one OOM costs about as much as a trial at the optimum earns
(0.5 + up to 0.5 * 2 overshoot), so a policy learns to avoid the cliff without fearing to approach it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from autotune.values.config import ConfigError
from autotune.values.results import TrialResult

MODES = ("throughput", "improvement")


@dataclass(frozen=True)
class Reward:
    mode: str = "throughput"
    oom_penalty: float = 0.5
    over_budget_coef: float = 0.5
    over_budget_cap: float = 2.0
    failure_penalty: float = 0.5
    trial_cost: float = 0.01
    second_cost: float = 0.0
    invalid_action_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"reward mode={self.mode!r}: allowed {list(MODES)}")
        for f in fields(self):
            if f.name != "mode":
                value = getattr(self, f.name)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                    raise ConfigError(f"reward {f.name}={value!r}: must be a finite number >= 0")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "Reward":
        data = dict(data or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown reward key(s) {unknown}: allowed {allowed}")
        return cls(**data)

    def trial(self, result: TrialResult, budget_bytes: int, reference: float, best_before: float,
              seconds_unit: float = 1.0) -> float:
        """Reward of one trial seen under `budget_bytes` (`best_before`: best feasible throughput so far, 0 if none;
        `seconds_unit`: the episode's unit of trial time)."""
        cost = self.trial_cost + self.second_cost * result.wall_time_s / seconds_unit
        if result.status == "ok" and result.fits(budget_bytes):
            throughput = result.throughput_samples_per_s or 0.0
            gain = throughput if self.mode == "throughput" else max(0.0, throughput - best_before)
            return gain / reference - cost
        if result.status in ("oom", "ok"):  # an ok result over budget is an oom for this search
            over = 0.0
            if result.peak_memory_bytes is not None:
                over = min(self.over_budget_cap, max(0.0, result.peak_memory_bytes / budget_bytes - 1.0))
            return -self.oom_penalty - self.over_budget_coef * over - cost
        if result.status == "pruned":
            return -cost
        return -self.failure_penalty - cost

    def stop(self, best: float, reference: float, steps_left: int) -> float:
        """Reward of `stop` with `steps_left` steps of the horizon left, counting the stop step."""
        if self.mode == "improvement":
            return 0.0
        return steps_left * best / reference
