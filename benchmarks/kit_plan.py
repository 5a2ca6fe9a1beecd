"""The one-call GPU kit's time plan (benchmarks/gpu_kit.py): what each phase of one device call may take, how long
a trial is expected to take, and which configs the recording window holds.

GPU time comes in 15-minute windows, the machine's start included; one command runs at most 10 minutes and the
kit is planned for 9 (540 s). Its phases run in order, each ending by its deadline (seconds from the call's
start), and a phase that ends early leaves its time to the next one. Recording takes pairs of configs (a
layout's two micro-batches on either side of its predicted cliff) round-robin over the models, while their
expected time fits what is left of its window; tune gets a fixed share after it.

Measured figures (the first GPU run, benchmarks/gpu-runs/h200-2026-11-26, `phases_s` of its 6 trials and its
console) are marked as such; the other figures are the plan's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from autotune.values.config import Config

PHASES = ("install", "preflight", "recording", "tune", "analysis", "pack")
MIN_CONFIGS = 10  # recorded configs over the two models (issue 25)
TUNE_TRIALS = 5  # 4 search trials and 1 confirmation repeat (confirm.SHARE: a quarter of --trials at most)
MIN_TUNE_TRIALS = 4  # below this, confirm.SHARE leaves no trial for the repeat


class PlanError(ValueError):
    """The limit cannot hold the phases at all (one line)."""


@dataclass(frozen=True)
class TrialTimes:
    """What one trial's wall time is made of beyond its steps, in seconds."""

    launch_s: float  # launcher, importing torch and DeepSpeed
    build_s_per_b: float  # the model built in fp32 on the CPU, then moved (ZeRO 0-2), per 1e9 parameters
    build_z3_s_per_b: float  # the same under ZeRO-3's zero.Init
    initialize_s: float  # deepspeed.initialize: fixed part
    initialize_s_per_b: float  # and per 1e9 parameters
    offload_optimizer_s: float  # initialize's extra with the optimizer offloaded (pinned host buffers)
    offload_param_s_per_b: float  # and with the parameters offloaded, per 1e9 parameters
    first_step_factor: float  # the warm-up step over a steady one (lazy allocations, ZeRO-3's first trace)
    warmup_steps: int
    measure_steps: int

    def seconds(self, config: Config, params: float, step_s: float, fits: bool) -> float:
        """Expected wall time of `config`'s trial: a config that does not fit fails in its first step."""
        billions = params / 1e9
        build = (self.build_z3_s_per_b if config.zero_stage == 3 else self.build_s_per_b) * billions
        init = self.initialize_s + self.initialize_s_per_b * billions
        init += self.offload_optimizer_s if config.offload_optimizer != "none" else 0.0
        init += self.offload_param_s_per_b * billions if config.offload_param != "none" else 0.0
        first = self.first_step_factor * step_s
        steps = (first + max(0, self.warmup_steps - 1) * step_s + self.measure_steps * step_s) if fits else first
        return self.launch_s + build + init + steps


# Measured on the H200 (phases_s): launch 3.5-4.1 s; the CPU build 9.7 s for 1.1B and 25.8 s for 3.0B parameters
# (8.6 s per 1e9), 7.2 s for 3.0B under zero.Init; initialize 7.1 s (1.1B) and 8.4 s (3.0B) at ZeRO-0, 17.3-17.4 s
# with optimizer offload, 34.5 s with both offloads (3.0B); warm-up 2.5 step times (2.6 s for a 1.05 s step).
# Checked against the wall times less the op builds: 25.5 s (1.1B z0 mb16) against 25.3 s planned, 48.4 s (3.0B
# z0 mb8) against 52 s, 20.7 s (1.1B z0 mb32, oom in warm-up) against 23 s.
GPU_TIMES = TrialTimes(launch_s=4.0, build_s_per_b=8.6, build_z3_s_per_b=2.4, initialize_s=6.0,
                       initialize_s_per_b=1.0, offload_optimizer_s=10.0, offload_param_s_per_b=5.0,
                       first_step_factor=2.5, warmup_steps=1, measure_steps=2)
# The CPU check (ARCHITECTURE.md section 4: a 10M-parameter trial 13-16 s, imports 2.6 s, initialize 4-7 s).
CPU_TIMES = TrialTimes(launch_s=3.0, build_s_per_b=10.0, build_z3_s_per_b=10.0, initialize_s=6.0,
                       initialize_s_per_b=0.0, offload_optimizer_s=2.0, offload_param_s_per_b=0.0,
                       first_step_factor=2.0, warmup_steps=1, measure_steps=1)


@dataclass(frozen=True)
class Overheads:
    """The phases' fixed costs, in seconds (planned; measured where noted)."""

    install_s: float  # pip install --no-index of the bundle (the H200 run: about 1 s)
    preflight_s: float  # a child imports torch and DeepSpeed (3.5-4 s) and builds the first op (fused_adam: 30.5 s)
    tune_fixed_s: float  # tune's start, its own preflight (ops built: a load), report and plots
    analysis_s: float  # the surfaces' figures and replayed searches
    pack_s: float  # copying the results, the logs' tarball
    margin_s: float  # the call ends this far inside its limit

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


GPU_OVERHEADS = Overheads(install_s=10.0, preflight_s=45.0, tune_fixed_s=20.0, analysis_s=20.0, pack_s=5.0,
                          margin_s=20.0)
# On the CPU the ops (shm_comm, fused_adam, cpu_adam) take minutes to build the first time (405 s here), 11 s after.
CPU_OVERHEADS = Overheads(install_s=10.0, preflight_s=60.0, tune_fixed_s=25.0, analysis_s=40.0, pack_s=5.0,
                          margin_s=20.0)


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
    window = (limit_s - overheads.margin_s - overheads.install_s - overheads.preflight_s - tune_s
              - overheads.analysis_s - overheads.pack_s)
    if window <= 0:
        raise PlanError(f"a limit of {limit_s:.0f} s leaves no time for recording: install, preflight, tune "
                        f"({tune_s:.0f} s), analysis and packing take {limit_s - window:.0f} s")
    for name, seconds in (("install", overheads.install_s), ("preflight", overheads.preflight_s),
                          ("recording", window), ("tune", tune_s), ("analysis", overheads.analysis_s),
                          ("pack", overheads.pack_s)):
        t += seconds
        ends.append((name, t))
    return CallPlan(limit_s, tuple(ends), tuple(fill(queue, window)), tune_trials, tune_trial_s, overheads)


def tune_trials_for(available_s: float, fixed_s: float, trial_s: float) -> int:
    """Trials tune is given for the time it has: what fits, and never fewer than MIN_TUNE_TRIALS (its time
    budget and the deadline end it if they run long)."""
    return max(MIN_TUNE_TRIALS, int((available_s - fixed_s) // trial_s) if trial_s > 0 else MIN_TUNE_TRIALS)


def tune_time_budget(available_s: float, fixed_s: float, trial_s: float) -> float:
    """tune's --time-budget (its trials' wall time, after which none starts): what it has less its fixed cost
    and half a trial, since the last trial to start runs to its end."""
    return max(1.0, available_s - fixed_s - trial_s / 2)
