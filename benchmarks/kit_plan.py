"""The one-call GPU kit's time plan (benchmarks/gpu_kit.py): what each phase of one device call may take, how long
a trial is expected to take, and which configs the recording window holds.

GPU time comes in 15-minute windows, the machine's start included; one command runs at most 10 minutes and the
kit is planned for 9 (540 s). Its phases run in order, each ending by its deadline (seconds from the call's
start), and a phase that ends early leaves its time to the next one. Recording takes pairs of configs (a
layout's two micro-batches on either side of its predicted cliff) round-robin over the models, while their
expected time fits what is left of its window; tune gets a fixed share after it.

A trial's expected time is the product's (autotune/prediction/trial_time.py, fitted on both GPU runs' `phases_s`);
the phases' overheads below are measured where marked (the H200 runs, benchmarks/gpu-runs/h200-2026-11-26 and
h200-2026-11-27: their consoles and kit.md), the other figures are the plan's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from autotune.prediction.trial_time import (CPU, CPU_ADAM, CUDA, FUSED_ADAM, JobSize, Steps, TrialTimeModel,
                                            trial_time_at)
from autotune.values.config import Config

# startup: the kit's own start between the install and the preflight (its imports, the device probe, the plan)
PHASES = ("install", "startup", "preflight", "recording", "tune", "analysis", "pack")
MIN_CONFIGS = 10  # recorded configs over the two models (issue 25)
TUNE_TRIALS = 5  # 4 search trials and 1 confirmation repeat (confirm.SHARE: a quarter of --trials at most)
MIN_TUNE_TRIALS = 4  # below this, confirm.SHARE leaves no trial for the repeat


class PlanError(ValueError):
    """The limit cannot hold the phases at all (one line)."""


@dataclass(frozen=True)
class TrialTimes:
    """A kit trial's expected wall time: the product's trial-time model (autotune.prediction.trial_time, the one place
    it is decided) at the recording's measurement (`warmup_steps`, then exactly `measure_steps`), with the ops the
    kit's preflight built before the first trial."""

    model: TrialTimeModel
    warmup_steps: int
    measure_steps: int

    @property
    def launch_s(self) -> float:
        """Launch and imports: the overhead gpu_validation's Mode charges every trial."""
        return self.model.launch_s

    def seconds(self, config: Config, params: float, step_s: float, fits: bool, *, ahead: bool = False,
                states_fit: bool = True) -> float:
        """Expected wall time of `config`'s trial: a config that does not fit fails in its first step (in
        deepspeed.initialize where its model states do not fit, `states_fit` False); `ahead`: on the rank the trial
        before started (a pair's second). The kit's cap on measuring (8 s) cuts only configs slower than 4 s a step:
        planned uncut, the safe side."""
        measure = Steps(self.warmup_steps, self.measure_steps, self.measure_steps, UNCAPPED_S)
        return trial_time_at(config, JobSize(params), step_s, self.model, fits=fits, ops_built=PREFLIGHT_OPS,
                             measure=measure, ahead=ahead, states_fit=states_fit).total_s


UNCAPPED_S = 1e9
PREFLIGHT_OPS = frozenset({FUSED_ADAM, CPU_ADAM})  # the preflight builds every op of the space before trial 1
# Fitted on both H200 runs' phases and the CPU surfaces: autotune/prediction/trial_time.py names the data per term,
# benchmarks/trial_time.py checks each trial.
GPU_TIMES = TrialTimes(CUDA, warmup_steps=1, measure_steps=2)
CPU_TIMES = TrialTimes(CPU, warmup_steps=1, measure_steps=1)


@dataclass(frozen=True)
class Overheads:
    """The phases' fixed costs, in seconds (planned; measured where noted)."""

    # scripts/gpu-validate from its start: its checks of the interpreter (`import torch`: seconds) and the
    # pip install --no-index of the bundle (11-27 on the H200: 10.2 s; 19 s on a 2-core CPU machine)
    install_s: float
    startup_s: float  # the kit's process until its preflight: imports, device probe, plan (11-27: 5.7 s)
    # the import check (seconds: tune's command, Optuna's study.db storage), then a child imports torch and DeepSpeed
    # and builds the first op (fused_adam: 30.5 s on 11-26; 42 s with the child's imports on 11-27)
    preflight_s: float
    tune_fixed_s: float  # tune's start, its own preflight (ops built: a load), report and plots
    analysis_s: float  # the surfaces' figures and replayed searches
    pack_s: float  # copying the results, the logs' tarball
    margin_s: float  # the call ends this far inside its limit

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


GPU_OVERHEADS = Overheads(install_s=15.0, startup_s=10.0, preflight_s=50.0, tune_fixed_s=20.0, analysis_s=20.0,
                          pack_s=5.0, margin_s=20.0)
# On the CPU the ops (shm_comm, fused_adam, cpu_adam) take minutes to build the first time (405 s here), 11 s after;
# the preflight's own, fused_adam, took 90 s on a fresh AMD EPYC (2 cores), so its deadline is the ~130 s its line
# announces (autotune.trials.ops.FIRST_BUILD_S) plus the imports: a first call's build is not "past its deadline".
CPU_OVERHEADS = Overheads(install_s=30.0, startup_s=15.0, preflight_s=140.0, tune_fixed_s=25.0, analysis_s=40.0,
                          pack_s=5.0, margin_s=20.0)


@dataclass(frozen=True)
class Group:
    """Configs of one model recorded together (a layout's pair straddling its predicted cliff), in order."""

    model: str
    configs: tuple[Config, ...]
    seconds: tuple[float, ...]  # expected wall time of each

    @property
    def total_s(self) -> float:
        return sum(self.seconds)


def interleave(queues: Sequence[Sequence[Group]]) -> list[Group]:
    """The models' groups round-robin (first of each model, then second of each, ...): a window cut short still
    holds both models."""
    out: list[Group] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def fill(groups: Iterable[Group], window_s: float) -> list[Group]:
    """The groups, in order, whose expected time fits what is left of `window_s` (one that does not is skipped
    and a later, cheaper one may still fit): what the recording runs when trials take what they are expected
    to."""
    chosen, used = [], 0.0
    for group in groups:
        if used + group.total_s <= window_s:
            chosen.append(group)
            used += group.total_s
    return chosen


@dataclass(frozen=True)
class CallPlan:
    limit_s: float
    deadlines: tuple[tuple[str, float], ...]  # (phase, end in seconds from the call's start), in order
    recording: tuple[Group, ...]  # what the window holds at the expected trial times
    tune_trials: int
    tune_trial_s: float
    overheads: Overheads

    def deadline(self, phase: str) -> float:
        return dict(self.deadlines)[phase]

    def planned_s(self, phase: str) -> float:
        """The phase's share of the limit: its deadline less the previous one's."""
        names = [name for name, _ in self.deadlines]
        i = names.index(phase)
        return self.deadlines[i][1] - (self.deadlines[i - 1][1] if i else 0.0)

    @property
    def recording_configs(self) -> int:
        return sum(len(g.configs) for g in self.recording)

    @property
    def recording_trials_s(self) -> float:
        return sum(g.total_s for g in self.recording)

    def models(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for group in self.recording:
            counts[group.model] = counts.get(group.model, 0) + len(group.configs)
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {"limit_s": self.limit_s, "deadlines": dict(self.deadlines),
                "planned_s": {name: self.planned_s(name) for name, _ in self.deadlines},
                "recording_configs": self.recording_configs, "recording_models": self.models(),
                "recording_trials_s": self.recording_trials_s,
                "recording": [{"model": g.model, "configs": [c.label() for c in g.configs],
                               "seconds": list(g.seconds)} for g in self.recording],
                "tune_trials": self.tune_trials, "tune_trial_s": self.tune_trial_s,
                "overheads": self.overheads.to_dict()}


def plan_call(limit_s: float, overheads: Overheads, queue: Sequence[Group], tune_trial_s: float,
              tune_trials: int = TUNE_TRIALS) -> CallPlan:
    """Deadlines for one call of `limit_s` seconds: the fixed phases at their costs, tune `tune_trials` trials of
    `tune_trial_s` plus its fixed cost, recording what is left. Raises PlanError when nothing is left for it."""
    if tune_trials < MIN_TUNE_TRIALS:
        raise PlanError(f"tune trials {tune_trials}: at least {MIN_TUNE_TRIALS}, so that one is a confirmation repeat")
    tune_s = overheads.tune_fixed_s + tune_trials * tune_trial_s
    ends, t = [], 0.0
    window = (limit_s - overheads.margin_s - overheads.install_s - overheads.startup_s - overheads.preflight_s
              - tune_s - overheads.analysis_s - overheads.pack_s)
    if window <= 0:
        raise PlanError(f"a limit of {limit_s:.0f} s leaves no time for recording: install, start-up, preflight, tune "
                        f"({tune_s:.0f} s), analysis and packing take {limit_s - window:.0f} s")
    for name, seconds in (("install", overheads.install_s), ("startup", overheads.startup_s),
                          ("preflight", overheads.preflight_s),
                          ("recording", window), ("tune", tune_s), ("analysis", overheads.analysis_s),
                          ("pack", overheads.pack_s)):
        t += seconds
        ends.append((name, t))
    return CallPlan(limit_s, tuple(ends), tuple(fill(queue, window)), tune_trials, tune_trial_s, overheads)


def plan_holding_configs(limit_s: float, overheads: Overheads, queue: Sequence[Group], tune_trial_s: float,
                         tune_trials: int = TUNE_TRIALS) -> CallPlan:
    """plan_call, with tune given a trial fewer (never under MIN_TUNE_TRIALS) while that lets the recording hold
    MIN_CONFIGS it would not hold otherwise: the recorded configs are the kit's first goal (issue 25)."""
    plan = plan_call(limit_s, overheads, queue, tune_trial_s, tune_trials)
    while plan.recording_configs < MIN_CONFIGS and plan.tune_trials > MIN_TUNE_TRIALS:
        fewer = plan_call(limit_s, overheads, queue, tune_trial_s, plan.tune_trials - 1)
        if fewer.recording_configs <= plan.recording_configs:
            break
        plan = fewer
    return plan


def tune_trials_for(available_s: float, fixed_s: float, trial_s: float) -> int:
    """Trials tune is given for the time it has: what fits, and never fewer than MIN_TUNE_TRIALS (its time
    budget and the deadline end it if they run long)."""
    return max(MIN_TUNE_TRIALS, int((available_s - fixed_s) // trial_s) if trial_s > 0 else MIN_TUNE_TRIALS)


def tune_time_budget(available_s: float, fixed_s: float, trial_s: float) -> float:
    """tune's --time-budget (its trials' wall time: no trial starts that tune expects to end after it): what it has
    less its fixed cost and half a trial, a margin for that expectation's error before the call's deadline."""
    return max(1.0, available_s - fixed_s - trial_s / 2)
