"""A trial's wall time as a prediction (issue 41, "seconds, not trials"): what launching, building, initializing,
warming up and measuring a config costs before its first measured step and after it, so that a search can weigh
what a trial would teach against what it would take. Pure arithmetic: the search asks it for every config.

A trial of the deepspeed backend (autotune.worker.main) goes through these phases, each recorded in its result's
`phases_s`:
    launch      spawn the rank, import torch and DeepSpeed, the process group            (launch_s)
    ops         load the op the optimizer needs, building it on first use                  (ops_s, ops_build_s)
    build       the model: on the device in its dtype (ZeRO 0-2), under zero.Init (ZeRO-3) (build_s)
    initialize  deepspeed.initialize: ZeRO's partitions, offload's pinned host buffers      (initialize_s)
    warm-up     untimed steps until one was applied: the first step's lazy allocations and,
                in fp16, the loss scale's search down from 2^16                            (warmup_s)
    measure     min_steps .. max_steps at the step time, at most max_measure_s             (measure_s)
    exit        the rank's exit, freeing offload's pinned host memory                      (exit_s)
A config that does not fit dies in its first step, after launch, build and initialize (`fits=False`); one whose model
states alone do not fit (`states_fit=False`), inside deepspeed.initialize as it allocates them. A trial on
ranks started ahead, during the trial before (`ahead=True`: the deepspeed backend's spares, a result's
`import_ahead_s`), finds its imports made: its launch is a handoff and its initialize lacks the first call's imports.

The terms (CUDA and CPU below) were fitted on the phases of the real trials committed in benchmarks/: both H200
runs (benchmarks/gpu-runs/h200-2026-11-26 and -27: 11 trials with `phases_s`, 3 out of memory, read from their
rank event logs) and the CPU surfaces (benchmarks/surfaces/tiny-cpu.jsonl, small-llama-cpu.jsonl: 252 trials);
benchmarks/trial_time.py prints each trial's prediction beside its record (benchmarks/results/trial_time.md).
Their machines differ from a user's: `calibrated` fits three scales (fixed overhead, initialize, per step) on the
sweep's own trials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Protocol, Sequence

from autotune.values.config import Config
from autotune.values.hardware import Hardware
from autotune.values.results import TrialResult
from autotune.values.workload import Workload

FUSED_ADAM, CPU_ADAM = "fused_adam", "cpu_adam"  # DeepSpeed's op names, as the preflight reports them
ALL_OPS = frozenset({FUSED_ADAM, CPU_ADAM})
BILLION = 1e9
# fp16's dynamic loss scaler (DeepSpeed's DynamicLossScaler, initial_scale_power 16, hysteresis 2, min scale 1):
# one skipped step spends the hysteresis, each further one halves the scale, so every step overflowing skips
# 1 + 16 steps before the scaler gives up (autotune.worker.training.SETTLE_STEPS holds warm-up past it).
FP16_WORST_SKIPPED_STEPS = 17
# The scales' pull towards 1 in calibration, in trials: one trial moves a scale halfway (in log) to its record.
PRIOR_TRIALS = 1.0
SCALE_BOUNDS = (0.2, 5.0)


class Measure(Protocol):
    """What a trial's measurement asks (autotune.worker.measure.MeasureSettings has these fields)."""

    @property
    def warmup_steps(self) -> int: ...

    @property
    def min_steps(self) -> int: ...

    @property
    def max_steps(self) -> int: ...

    @property
    def max_measure_s(self) -> float: ...


@dataclass(frozen=True)
class Steps:
    """A measurement's steps, as autotune.worker.measure.MeasureSettings' defaults (a sweep's trials)."""

    warmup_steps: int = 1
    min_steps: int = 3
    max_steps: int = 20
    max_measure_s: float = 60.0


DEFAULT_MEASURE = Steps()


@dataclass(frozen=True)
class TrialTimeModel:
    """One accelerator's terms, in seconds (`_per_b`: per 1e9 parameters of the model, or of the rank's partition
    where ZeRO partitions them), and the scales calibration fitted (1: none)."""

    launch_s: float  # spawn, imports, process group: one rank
    ahead_launch_s: float  # a rank started ahead, during the trial before (autotune.trials.runner.Spares): its handoff
    launch_s_per_extra_rank: float  # ranks of one node importing side by side on its cores
    dist_init_s: float  # the communicator, when there are several ranks
    op_load_s: float  # loading a built op
    op_build_s: tuple[tuple[str, float], ...]  # an op's first build (op name, seconds)
    build_s: float
    build_s_per_b: float  # ZeRO 0-2: the model in its dtype on the device
    zero3_build_s_per_b: float  # ZeRO-3: under zero.Init, each parameter partitioned as it is made
    param_offload_build_s_per_b: float  # ... and moved to pinned host memory
    initialize_s: float  # fixed: mostly what deepspeed.initialize's first call imports ...
    ahead_initialize_s: float  # ... which a rank started ahead has made: what is left of it there
    initialize_s_per_b: float
    zero3_initialize_s: float  # ZeRO-3's partitioned optimizer and its hooks
    offload_initialize_s: float  # optimizer offload: DeepSpeedCPUAdam and its pinned host buffers, fixed ...
    offload_initialize_s_per_b: float  # ... and per 1e9 parameters of the partition (ZeRO 0-2)
    zero3_offload_initialize_s_per_b: float  # ... (ZeRO-3)
    param_offload_initialize_s_per_b: float
    first_step_s: float  # the first step over a steady one: lazy allocations, kernels' first calls
    fp16_skipped_steps: float  # warm-up steps fp16's loss-scale search is expected to skip
    extra_measure_steps: float  # measured steps beyond min_steps expected: the stop rule waits out a spread
    oom_s: float  # an out-of-memory trial: from its first step's start to its exit, fixed ...
    oom_step_fraction: float  # ... and this part of a step
    oom_initialize_fraction: float  # the part of deepspeed.initialize a trial whose model states do not fit gets through
    exit_s: float
    offload_exit_s: float  # freeing offload's pinned host memory, fixed ...
    offload_exit_s_per_b: float  # ... and per 1e9 parameters of the partition
    fixed_scale: float = 1.0  # calibration: launch, op loads, build, exit
    initialize_scale: float = 1.0  # calibration: deepspeed.initialize
    step_scale: float = 1.0  # calibration: warm-up and measurement
    samples: int = 0  # trials calibration used

    def op_build(self, op: str) -> float:
        return dict(self.op_build_s).get(op, 0.0)

    def with_(self, **changes: Any) -> "TrialTimeModel":
        return replace(self, **changes)


# CUDA, fitted on the H200 runs (one rank, llama-1b 1.1e9 and llama-3b 3.0e9 parameters; 11-26 and 11-27: `phases_s`
# of 11 trials, the rank event logs of 3 out-of-memory ones; 11-30: 17 trained trials and 5 out of memory, the first
# with fp16 trials that trained and with trials on ranks started ahead). The runs' host-side phases differ by up to
# 1.7x (11-27's imports and offload initialize slower): where they differ a term sits between the runs' medians, and
# `calibrated` moves the terms to the machine at hand.
# - launch: spawn + imports + process group 3.6-7.2 s; medians 4.0 s (11-26) and 5.7 s (11-27): 4.8 priced; 3.1-4.6 s
#   cold on 11-30; on a rank started ahead 0.0-1.95 s (median 0.01 over 10 trials): 0.05 priced;
# - op load 0.3-1.1 s once built; first builds: fused_adam 30.5 s (11-26 kit, trial 1), cpu_adam 37.0 s (11-26 tune,
#   trial 1) with their loads;
# - build on the device (11-27): 0.04-0.07 s at ZeRO 0-2; under zero.Init 0.43-0.58 s for 1.1e9 (0.45 s per 1e9),
#   with parameter offload 5.4 and 7.2 s for 3.0e9 (+1.7 s per 1e9);
# - initialize without offload: ZeRO 0-2 6.4-9.3 s at 1.1e9 (median 7.0), 7.8 and 8.4 s at 3.0e9 (ZeRO 0); ZeRO-3
#   8.8 and 10.4 s at 1.1e9 (+2.5 s); cold on 11-30 6.1 and 8.7 s. On a rank started ahead the first call's imports
#   are made: 0.39-0.58 s in 5 of 7 trials at ZeRO 0-2 (the per-parameter term's 0.66 s alone priced; the other two
#   paid 6.7 and 7.1 s), ZeRO-3 3.9 s. With the optimizer offloaded (pinning ~16 bytes a parameter on the host):
#   ZeRO 1-2 at 1.1e9 17.3, 17.4 (11-26) and 29.1 s (11-27): +10.3 s and +22.0 s; 11-30: 9.7-12.8 s per 1e9; 14 s
#   priced, as before (at 12 the slow 11-27 trial fell 33% short); ZeRO-3 at 1.1e9 14.0 (11-26) and 20.5 s (11-27),
#   with both offloads at 3.0e9 23.8 and 34.5 s (11-26): +4.1 to +10.0 s per 1e9, 6.5 s priced, and 0.5 s per 1e9 for the parameters (the only trials that offload them offload both);
# - warm-up (one step) over the measured step: 0.4-5.1 s, median 2.0 (11-26, 11-27); 0.36-6.8 s, median 1.02 over
#   17 trials of 11-30, the code that runs now: 1.0 priced;
# - measured steps: 10 of 11 stopped at min_steps (2 or 3), one (fp16, its skipped steps' times spread) at 12 of 3;
#   half a step beyond min_steps is priced (the CPU surfaces' mean: 0.6);
# - out of memory: 0.9-1.8 s from the first step's start to the record; in initialize (11-30: llama-3b at ZeRO 0,
#   its 48 GB of model states over a 45 GiB budget) 2.9 s (ahead) and 4.4 s (cold) from its start: half of it priced;
# - exit: 0.2 s after the last step; with an offload 1.6-5.1 s at 1.1e9 (median 3.0), 5.8 and 5.9 s at 3.0e9.
# fp16's expected skipped steps: none. No fp16 trial of 11-26 or 11-27 trained; the five of 11-30 (the model's RMSNorm
# in fp32) each applied its first step at the initial scale 2^16 (FP16_WORST_SKIPPED_STEPS stays the worst case).
CUDA = TrialTimeModel(
    launch_s=4.8, ahead_launch_s=0.05, launch_s_per_extra_rank=0.0, dist_init_s=2.0,  # NCCL's communicator: unmeasured
    op_load_s=0.8, op_build_s=((FUSED_ADAM, 30.0), (CPU_ADAM, 36.0)),
    build_s=0.05, build_s_per_b=0.02, zero3_build_s_per_b=0.45, param_offload_build_s_per_b=1.7,
    initialize_s=6.4, ahead_initialize_s=0.0, initialize_s_per_b=0.6, zero3_initialize_s=2.5,
    offload_initialize_s=0.0, offload_initialize_s_per_b=14.0, zero3_offload_initialize_s_per_b=6.5,
    param_offload_initialize_s_per_b=0.5,
    first_step_s=1.0, fp16_skipped_steps=0.0, extra_measure_steps=0.5,
    oom_s=0.6, oom_step_fraction=0.3, oom_initialize_fraction=0.5, exit_s=0.2, offload_exit_s=0.7, offload_exit_s_per_b=2.0)

# The model built in fp32 on the host and moved by deepspeed.initialize, as trials did before 2026-11-27 (11-26:
# 9.2-12.5 s for 1.1e9, 25.8 s for 3.0e9: 8.6 s per 1e9), and as the CPU profile's trials do.
HOST_BUILD_S_PER_B = 8.6

# The CPU accelerator (gloo, DeepSpeed's C++ ops), fitted on the surfaces of the 2-core development machine
# (benchmarks/surfaces/tiny-cpu.jsonl: 216 trials of a 4.3e6-parameter model, quiet; small-llama-cpu.jsonl: 36 of
# 6.3e6, under load) and benchmarks/results/extrapolation_trials.jsonl (1, 2 and 4 ranks under a load of 10-15).
# Models of a few million parameters: the terms are fixed, the per-1e9 ones the host's.
# - launch: median 2.3 s quiet, 7.1 s under load; each extra rank's imports share the cores (+2.5 s a rank), gloo's
#   process group 0.3-2.0 s;
# - op load 0.07-0.3 s; first builds one after the other on the 2-core machine under a load average of 2-5 (a
#   preflight of all three: 405 s; 11 s once built): fused_adam 130 s, cpu_adam 200 s;
# - build 0.05-0.34 s;
# - initialize, medians: quiet 0.9 s at ZeRO 0 and 1.8-2.2 s at ZeRO 1-3 (offloads within 0.3 s of it); under load
#   3.0 s at ZeRO 0, 5.8 s at ZeRO-3, 7.4 s with the optimizer offloaded: 2.4 s priced, ZeRO-3 +0.8, offload +0.6;
# - warm-up over a measured step: median 0.07 s quiet, 0.6 s under load; measured steps: min_steps + 0.6 (tiny, mean);
# - exit 0.1-0.3 s.
CPU = TrialTimeModel(
    launch_s=3.2, ahead_launch_s=3.2, launch_s_per_extra_rank=2.5, dist_init_s=0.6,
    op_load_s=0.15, op_build_s=((FUSED_ADAM, 130.0), (CPU_ADAM, 200.0)),
    build_s=0.15, build_s_per_b=HOST_BUILD_S_PER_B, zero3_build_s_per_b=HOST_BUILD_S_PER_B,
    param_offload_build_s_per_b=0.0,
    initialize_s=2.4, ahead_initialize_s=2.4, initialize_s_per_b=0.0, zero3_initialize_s=0.8,
    offload_initialize_s=0.6, offload_initialize_s_per_b=0.0, zero3_offload_initialize_s_per_b=0.0,
    param_offload_initialize_s_per_b=0.0,
    first_step_s=0.2, fp16_skipped_steps=3.0, extra_measure_steps=0.5,
    oom_s=0.5, oom_step_fraction=0.5, oom_initialize_fraction=0.5, exit_s=0.15, offload_exit_s=0.0, offload_exit_s_per_b=0.0)


def model_for(hardware: Hardware) -> TrialTimeModel:
    """The terms of the accelerator that runs `hardware`'s trials (every CUDA profile shares the H200's)."""
    return CPU if hardware.is_cpu else CUDA


@dataclass(frozen=True)
class TrialTime:
    """A trial's predicted wall time, phase by phase (seconds). `ops_build_s` is the first build of an op the sweep
    has not built yet, apart from `ops_s`, loading it; `worst_s` the total when fp16's loss-scale search runs to its
    end and the measurement to its limit."""

    launch_s: float
    ops_s: float
    ops_build_s: float
    build_s: float
    initialize_s: float
    warmup_s: float
    measure_s: float
    exit_s: float
    fits: bool
    worst_s: float

    @property
    def launch_to_first_step_s(self) -> float:
        """As a result records it: everything before the first measured step."""
        return self.launch_s + self.ops_s + self.ops_build_s + self.build_s + self.initialize_s + self.warmup_s

    @property
    def total_s(self) -> float:
        return self.launch_to_first_step_s + self.measure_s + self.exit_s

    def to_dict(self) -> dict[str, float | bool]:
        return {"launch_s": self.launch_s, "ops_s": self.ops_s, "ops_build_s": self.ops_build_s,
                "build_s": self.build_s, "initialize_s": self.initialize_s, "warmup_s": self.warmup_s,
                "measure_s": self.measure_s, "exit_s": self.exit_s, "fits": self.fits, "total_s": self.total_s,
                "worst_s": self.worst_s}


def op_for(config: Config, ds_cpu_adam: bool = True) -> str | None:
    """The op `config`'s optimizer loads (autotune.worker.main.op_builders): FusedAdam on the device, DeepSpeedCPUAdam
    with the optimizer offloaded, none where torch's AdamW steps the offloaded state (`ds_cpu_adam` False:
    DsOptions.force_ds_cpu_optimizer off)."""
    if config.offload_optimizer == "none":
        return FUSED_ADAM
    return CPU_ADAM if ds_cpu_adam else None


@dataclass(frozen=True)
class JobSize:
    """What of a workload and its machine a trial's time depends on beyond the config."""

    params: int | float
    ranks: int = 1
    ranks_per_node: int = 1

    @classmethod
    def of(cls, workload: Workload, hardware: Hardware) -> "JobSize":
        return cls(workload.model.params, workload.gpus, min(workload.gpus, hardware.gpus_per_node))

    def billions(self, partitioned: bool) -> float:
        """The model's parameters in 1e9, or one rank's partition of them."""
        return self.params / BILLION / (self.ranks if partitioned else 1)


def trial_time(config: Config, workload: Workload, hardware: Hardware, predicted_step_s: float, *,
               fits: bool = True, ops_built: frozenset[str] | set[str] = frozenset(),
               measure: Measure = DEFAULT_MEASURE, model: TrialTimeModel | None = None,
               ds_cpu_adam: bool = True, ahead: bool = False, states_fit: bool = True) -> TrialTime:
    """The predicted wall time of `config`'s trial at `predicted_step_s` a step (the estimator's, calibrated where
    the sweep has trials). `fits` False: it dies out of memory in its first step. `ops_built`: the ops the sweep
    has built (the preflight's), whose first build it no longer pays. `model`: calibrated terms (default: the
    hardware's accelerator's). `ahead`: on ranks started during the trial before. `states_fit` False (with `fits`
    False): it dies in deepspeed.initialize."""
    return trial_time_at(config, JobSize.of(workload, hardware), predicted_step_s, model or model_for(hardware),
                         fits=fits, ops_built=ops_built, measure=measure, ds_cpu_adam=ds_cpu_adam, ahead=ahead,
                         states_fit=states_fit)


def trial_time_at(config: Config, size: JobSize, predicted_step_s: float, model: TrialTimeModel, *,
                  fits: bool = True, ops_built: frozenset[str] | set[str] = frozenset(),
                  measure: Measure = DEFAULT_MEASURE, ds_cpu_adam: bool = True, ahead: bool = False,
                  states_fit: bool = True) -> TrialTime:
    """trial_time for a model of `size.params` parameters (a plan that knows no more of its workload)."""
    m = model
    op = op_for(config, ds_cpu_adam)
    fixed = m.fixed_scale
    launch = _launch(m, size, ahead) * fixed
    ops = (m.op_load_s if op else 0.0) * fixed
    ops_build = m.op_build(op) if op and op not in ops_built else 0.0
    build = _build(m, config, size) * fixed
    initialize = _initialize(m, config, size, ahead) * m.initialize_scale
    step = predicted_step_s * m.step_scale
    before = launch + ops + ops_build + build + initialize
    if not fits and not states_fit:
        initialize *= m.oom_initialize_fraction
        before = launch + ops + ops_build + build + initialize
        return TrialTime(launch, ops, ops_build, build, initialize, 0.0, 0.0, m.oom_s * fixed, False,
                         before + m.oom_s * fixed)
    if not fits:
        dying, exit_s = m.oom_step_fraction * step, m.oom_s * fixed
        return TrialTime(launch, ops, ops_build, build, initialize, dying, 0.0, exit_s, False, before + dying + exit_s)
    skipped = m.fp16_skipped_steps if config.precision == "fp16" else 0.0
    warmup = _warmup(m, step, measure, skipped)
    measured = _measure(step, measure, min(measure.min_steps + m.extra_measure_steps, measure.max_steps))
    exit_s = _exit(m, config, size) * fixed
    worst_skips = FP16_WORST_SKIPPED_STEPS if config.precision == "fp16" else 0
    worst = before + _warmup(m, step, measure, worst_skips) + _measure(step, measure, measure.max_steps) + exit_s
    return TrialTime(launch, ops, ops_build, build, initialize, warmup, measured, exit_s, True, worst)


def _launch(m: TrialTimeModel, size: JobSize, ahead: bool = False) -> float:
    if ahead:  # imported and joined while the trial before ran
        return m.ahead_launch_s
    shared = m.launch_s_per_extra_rank * (size.ranks_per_node - 1)  # ranks of a node import on its cores
    return m.launch_s + shared + (m.dist_init_s if size.ranks > 1 else 0.0)


def _build(m: TrialTimeModel, config: Config, size: JobSize) -> float:
    if config.zero_stage < 3:
        return m.build_s + m.build_s_per_b * size.billions(False)
    rate = m.zero3_build_s_per_b + (m.param_offload_build_s_per_b if config.offload_param != "none" else 0.0)
    return m.build_s + rate * size.billions(True)


def _initialize(m: TrialTimeModel, config: Config, size: JobSize, ahead: bool = False) -> float:
    seconds = (m.ahead_initialize_s if ahead else m.initialize_s) + m.initialize_s_per_b * size.billions(config.zero_stage == 3)
    seconds += m.zero3_initialize_s if config.zero_stage == 3 else 0.0
    if config.offload_optimizer != "none":
        rate = m.zero3_offload_initialize_s_per_b if config.zero_stage == 3 else m.offload_initialize_s_per_b
        seconds += m.offload_initialize_s + rate * size.billions(config.zero_stage > 0)
    if config.offload_param != "none":
        seconds += m.param_offload_initialize_s_per_b * size.billions(True)
    return seconds


def _warmup(m: TrialTimeModel, step: float, measure: Measure, skipped: float) -> float:
    """Warm-up lasts `warmup_steps` (at least one) and until a step was applied: fp16's skipped steps add on."""
    return m.first_step_s * m.step_scale + (max(measure.warmup_steps, 1) + skipped) * step


def _measure(step: float, measure: Measure, steps: float) -> float:
    """`steps` measured steps, cut where the elapsed time first reaches max_measure_s (at least one step)."""
    if step <= 0:
        return 0.0
    by_time = max(1, math.ceil(measure.max_measure_s / step))
    return min(steps, by_time) * step


def _exit(m: TrialTimeModel, config: Config, size: JobSize) -> float:
    if config.offload_optimizer == "none" and config.offload_param == "none":
        return m.exit_s
    return m.exit_s + m.offload_exit_s + m.offload_exit_s_per_b * size.billions(config.zero_stage > 0)


def calibrated(model: TrialTimeModel, results: Sequence[TrialResult], workload: Workload, hardware: Hardware,
               measure: Measure = DEFAULT_MEASURE) -> TrialTimeModel:
    """`model` with its three scales fitted on the sweep's `results` that recorded their phases (`phases_s`) and a
    step time: fixed overhead (launch, model build, exit), deepspeed.initialize, and the steps (warm-up and
    measurement, predicted at each trial's own step time: the step time's error is the estimator's to calibrate).
    Each scale is the geometric mean of recorded over predicted, pulled towards 1 by PRIOR_TRIALS; op builds are
    left as they are (a sweep sees at most one of each)."""
    base = model.with_(fixed_scale=1.0, initialize_scale=1.0, step_scale=1.0, samples=0)
    rows = [(r, r.extra["phases_s"]) for r in results if r.extra.get("phases_s") and r.step_time_s]
    if not rows:
        return base
    ratios: dict[str, list[float]] = {"fixed": [], "initialize": [], "steps": []}
    for result, phases in rows:
        predicted = trial_time(result.config, workload, hardware, result.step_time, measure=measure, model=base,
                               ops_built=ALL_OPS, ahead=ran_ahead(result))
        for group, (recorded, ours) in _groups(result, phases, predicted).items():
            if recorded > 0 and ours > 0:
                ratios[group].append(math.log(recorded / ours))
    scale = {group: _shrunk(logs) for group, logs in ratios.items()}
    return base.with_(fixed_scale=scale["fixed"], initialize_scale=scale["initialize"], step_scale=scale["steps"],
                      samples=len(rows))


def ran_ahead(result: TrialResult) -> bool:
    """Whether the trial ran on ranks started ahead (its imports made before it: `import_ahead_s` recorded)."""
    return result.extra.get("import_ahead_s") is not None


def without_ops_s(result: TrialResult) -> float:
    """A trial's recorded wall seconds less the loading and building of its ops (`phases_s` build_ops_s, where
    recorded) and any launch lost to a taken rendezvous port (`relaunched`)."""
    phases = result.extra.get("phases_s") or {}
    return _launched_s(result) - float(phases.get("build_ops_s", 0.0))


def _launched_s(result: TrialResult) -> float:
    """The wall seconds of the launch that ran the trial (autotune.trials.runner's relaunches apart)."""
    return result.wall_time_s - sum(float(r.get("seconds", 0.0)) for r in result.extra.get("relaunched") or ())


def _groups(result: TrialResult, phases: Mapping[str, float], predicted: TrialTime) -> dict[str, tuple[float, float]]:
    """(recorded, predicted) seconds of each calibrated group of one trial; the exit is what the wall time holds
    beyond the recorded phases."""
    exit_s = max(_launched_s(result) - sum(phases.values()), 0.0)
    fixed = sum(phases.get(k, 0.0) for k in ("spawn_s", "import_s", "dist_init_s", "build_s")) + exit_s
    steps = phases.get("warmup_s", 0.0) + phases.get("measure_s", 0.0)
    return {"fixed": (fixed, predicted.launch_s + predicted.build_s + predicted.exit_s),
            "initialize": (phases.get("initialize_s", 0.0), predicted.initialize_s),
            "steps": (steps, predicted.warmup_s + predicted.measure_s)}


def _shrunk(logs: Sequence[float]) -> float:
    """exp of the logs' mean with PRIOR_TRIALS trials of log 0 beside them, within SCALE_BOUNDS."""
    if not logs:
        return 1.0
    low, high = SCALE_BOUNDS
    return min(max(math.exp(sum(logs) / (len(logs) + PRIOR_TRIALS)), low), high)
