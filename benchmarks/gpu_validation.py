"""GPU validation kit: record real surfaces of two workloads sized to this machine's GPU, then measure how well
the estimator and the search strategies do on them.

1. Detects the GPU (`autotune.trials.devices.probe`, profile from `auto_hardware`) and picks two workloads whose
   model states (16 bytes per parameter, mixed-precision Adam) take about 20% and about 60% of the
   device's memory (`choose_gpu_models`): the out-of-memory cliff then falls inside the space at a budget of
   the whole device, for a ~1B and a ~3B model on an 80 GB card.
2. Records a real surface of each (DeepSpeed trials through the deepspeed backend, ZeRO 0-3 x micro-batch x
   checkpointing x bf16/fp16 x optimizer/parameter offload to the CPU) within a time budget: `--minutes` of
   trials for this call, split between the surfaces. Memory layouts (stage, checkpointing, precision,
   offloads) are taken in a balanced order (`balanced_layouts`), as many as the predicted trial times allow
   (`select_subset`), each measured on either side of its predicted cliff (`bracket`: the largest
   micro-batch predicted to fit and the next one). Resumable through `autotune surface record`'s machinery:
   configs already in a surface are skipped, so a second call with the same arguments measures more layouts.
   Offloaded optimizer state uses torch's AdamW (`zero_force_ds_cpu_optimizer: false`), so no trial waits for
   DeepSpeedCPUAdam's C++ build.
3. Writes, per surface: the estimator's peak-memory error (MAPE before calibration, and after calibrating on 3
   trials, on the others), the Spearman rank correlation of predicted and measured throughput, the
   out-of-memory cliff per layout (largest micro-batch predicted to fit vs measured to fit), and `grid`,
   `optuna` and `hybrid` replayed on the recorded surface (trials to reach 98% of its optimum).

    python benchmarks/gpu_validation.py [--minutes 6] [--seeds 5]         # on a CUDA machine
    python benchmarks/gpu_validation.py --cpu --out DIR [--configs 6]      # CI: DeepSpeed's CPU accelerator
    python benchmarks/gpu_validation.py --cpu --out DIR --seq-len 64 --global-batch 4  # shorter steps (tests)

Writes benchmarks/surfaces/<hardware>-<model>.jsonl (--cpu: <out>/surfaces/) and <out>/gpu_validation.md and
.json (default out: benchmarks/results). Exit 0 with results, 1 when a trial found this machine unable to run
any config, 2 on bad input, 130 when interrupted (run the same command again to resume).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # search_efficiency beside this file, also when imported from elsewhere

from autotune.cli import ArgumentParser  # noqa: E402
from autotune.values.argtypes import non_negative_float, positive_float, positive_int  # noqa: E402
from search_efficiency import finite  # noqa: E402  (beside this file)
from autotune.values.config import Config, ConfigError  # noqa: E402
from autotune.prediction.estimate import Calibration, Estimate, estimate  # noqa: E402
from autotune.values.hardware import PROFILES, Hardware  # noqa: E402
from autotune.values.results import TrialResult, read_results  # noqa: E402
from autotune.values.space import Choices, Space  # noqa: E402
from autotune.values.units import format_size  # noqa: E402
from autotune.values.workload import PRESETS, ModelShape, Workload  # noqa: E402

NEAR = 0.98
STRATEGIES = ("grid", "optuna", "hybrid")
STATE_BYTES_PER_PARAM = 16  # mixed-precision Adam: 2 weights + 2 gradients + 12 optimizer (ZeRO paper)
# Model states as a fraction of the device's memory for the two workloads: a small one whose cliff comes from
# activations at large micro-batches, a large one where only offload or small micro-batches fit.
SLOT_FRACTIONS = (0.2, 0.6)
CALIBRATION_TRIALS = 3
LAYOUT_KNOBS = ("zero_stage", "ckpt_interval", "precision", "offload_optimizer", "offload_param")

# Llama 3.2 3B's shape with this project's 32k vocabulary: the ~3B step between llama-1b and llama-7b.
LLAMA_3B = ModelShape("llama-3b", 28, 3072, 24, 32000, 2048, ffn_hidden=8192, kv_heads=8, arch="llama")
GPU_MODELS: tuple[ModelShape, ...] = tuple(sorted(
    [PRESETS[n] for n in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b", "llama-7b",
                          "llama-13b")] + [LLAMA_3B], key=lambda s: s.params))
# The CPU check: the built-in tiny GPT and a Llama of the same size (rotary, SwiGLU, grouped KV heads).
TINY_LLAMA = ModelShape("tiny-llama", 4, 256, 4, 4096, 256, ffn_hidden=704, kv_heads=2, arch="llama")
CPU_MODELS = (PRESETS["tiny"], TINY_LLAMA)
MODELS = {s.name: s for s in GPU_MODELS + CPU_MODELS}

GPU_CHOICES = Choices(zero_stage=(0, 1, 2, 3), micro_batch=(1, 2, 4, 8, 16, 32), ckpt_interval=(0, 1),
                      precision=("bf16", "fp16"), offload_optimizer=("none", "cpu"), offload_param=("none", "cpu"))
# fp32 only: bf16 is emulated on many CPUs, each trial ~30x slower (issue 24; benchmarks/results/cpu_bf16.md).
CPU_CHOICES = Choices(zero_stage=(0, 2, 3), micro_batch=(1, 4, 16), ckpt_interval=(0, 1),
                      precision=("fp32",), offload_optimizer=("none", "cpu"), offload_param=("none",))
GPU_GLOBAL_BATCH = 32
CPU_GLOBAL_BATCH = 16


@dataclass(frozen=True)
class Mode:
    """What differs between a GPU run and the CPU check."""

    name: str  # cuda | cpu
    choices: Choices
    global_batch: int
    trial_overhead_s: float  # launch, imports, deepspeed.initialize: a trial's cost beyond its steps
    minutes: float
    timeout_s: float
    max_steps: int
    max_measure_s: float


GPU_MODE = Mode("cuda", GPU_CHOICES, GPU_GLOBAL_BATCH, 25.0, 6.0, 300.0, 4, 20.0)
CPU_MODE = Mode("cpu", CPU_CHOICES, CPU_GLOBAL_BATCH, 6.0, 6.0, 180.0, 2, 10.0)


class KitError(RuntimeError):
    """This machine cannot run the kit's trials (not a bad argument): exit 1."""


# -- choosing the workloads --------------------------------------------------------------------------------

def fit_share(shape: ModelShape, hardware: Hardware, budget: int, choices: Choices, global_batch: int) -> float:
    """Share of the space's configs predicted to fit `budget` for this model."""
    workload = Workload(shape, global_batch)
    space = Space(choices, workload, hardware)
    if not len(space):
        return 0.0
    return sum(estimate(c, workload, hardware).peak_bytes <= budget for c in space) / len(space)


def choose_gpu_models(hardware: Hardware, candidates: Sequence[ModelShape] = GPU_MODELS,
                      fractions: Sequence[float] = SLOT_FRACTIONS, choices: Choices = GPU_CHOICES,
                      global_batch: int = GPU_GLOBAL_BATCH) -> tuple[ModelShape, ...]:
    """One model per fraction: the candidate whose model states are nearest that fraction of the device's
    memory (on a log scale), among those with the out-of-memory cliff inside the space (some configs
    predicted to fit the device, some not), each model chosen once."""
    memory = hardware.memory_bytes
    inside = [s for s in candidates if 0.0 < fit_share(s, hardware, memory, choices, global_batch) < 1.0]
    chosen: list[ModelShape] = []
    for fraction in fractions:
        target = fraction * memory / STATE_BYTES_PER_PARAM
        pool = [s for s in inside if s not in chosen] or [s for s in candidates if s not in chosen]
        if not pool:
            raise ConfigError(f"{len(candidates)} candidate models for {len(fractions)} workloads: need more")
        chosen.append(min(pool, key=lambda s: abs(math.log(s.params / target))))
    return tuple(chosen)


# -- which configs to run ----------------------------------------------------------------------------------

def layout(config: Config) -> tuple:
    """Everything but the micro-batch: the configs whose memory grows with the micro-batch alone."""
    return tuple(getattr(config, k) for k in LAYOUT_KNOBS)


def layout_label(key: tuple) -> str:
    zero, ckpt, precision, opt, param = key
    text = f"z{zero} ck{ckpt} {precision}"
    return text + (f" oo={opt}" if opt != "none" else "") + (f" op={param}" if param != "none" else "")


def balanced_layouts(space: Space, seed: int = 0, inside: Callable[[tuple], bool] | None = None) -> list[tuple]:
    """The space's layouts in an order whose every prefix spreads over each knob's values: each next layout
    is of the ZeRO stage chosen least so far, then the one whose other values were chosen least (summed over
    the knobs), preferring one whose cliff is `inside` the micro-batch range, ties in a shuffled order fixed
    by `seed`. The stage comes first: without it, offloads (ZeRO-3 only) would pull ZeRO-3 in again and
    again."""
    remaining = sorted({layout(c) for c in space})
    random.Random(seed).shuffle(remaining)
    counts: Counter = Counter()
    order = []
    while remaining:
        best = min(remaining, key=lambda key: (counts[(0, key[0])],
                                               sum(counts[(i, v)] for i, v in enumerate(key) if i),
                                               0 if inside is None or inside(key) else 1))
        remaining.remove(best)
        order.append(best)
        counts.update(enumerate(best))
    return order


def bracket(configs: Sequence[Config], fits: Callable[[Config], bool]) -> list[Config]:
    """A layout's two configs on either side of its predicted cliff: the largest micro-batch predicted to fit
    and the next larger one (the two largest where all fit, the two smallest where none does). Measuring
    both says whether the cliff is where the estimator puts it, and the fastest config of a layout is
    usually its largest micro-batch that fits."""
    ranked = sorted(configs, key=lambda c: c.micro_batch)
    fitting = [i for i, c in enumerate(ranked) if fits(c)]
    first = max(0, min(fitting[-1] if fitting else 0, len(ranked) - 2))
    return ranked[first:first + 2]


def select_subset(space: Space, order: Sequence[tuple], pick: Callable[[Sequence[Config]], list[Config]],
                  seconds: Callable[[Config], float], available_s: float, measured: Iterable[Config] = (),
                  cap: int | None = None) -> list[Config]:
    """The `pick` of each layout, in `order`, while the predicted time of the configs not yet `measured`
    stays within `available_s` and the subset within `cap` configs; at least one layout. A prefix of the
    same order: a later call with time left extends what an earlier one measured."""
    by_layout: dict[tuple, list[Config]] = defaultdict(list)
    for config in space:
        by_layout[layout(config)].append(config)
    done = set(measured)
    chosen: list[Config] = []
    cost = 0.0
    for key in order:
        configs = pick(by_layout.get(key, []))
        extra = sum(seconds(c) for c in configs if c not in done)
        if chosen and (cost + extra > available_s or (cap is not None and len(chosen) + len(configs) > cap)):
            break
        chosen += configs
        cost += extra
    return chosen


def trial_seconds(predicted: Estimate, budget: int, mode: Mode, scale: float = 1.0) -> float:
    """A trial's expected wall time: the fixed overhead, plus warm-up and measured steps where it fits
    (a config over the budget fails at its first step)."""
    seconds = mode.trial_overhead_s
    if predicted.peak_bytes <= budget:
        steps = min(mode.max_steps * predicted.step_time_s, mode.max_measure_s)
        seconds += predicted.step_time_s + steps
    return seconds * scale


def time_scale(results: Sequence[TrialResult], expected: Callable[[Config], float]) -> float:
    """Measured over predicted trial time on what a surface already holds (1 without two results), within
    [0.25, 4]: the machine's real speed sizes the next call's subset. A first-use C++ op build (once per
    machine) is left out of the measured time."""
    if len(results) < 2:
        return 1.0
    predicted = sum(expected(r.config) for r in results)
    measured = sum(r.wall_time_s - ((r.extra.get("phases_s") or {}).get("build_ops_s") or 0.0) for r in results)
    return min(4.0, max(0.25, measured / predicted)) if predicted > 0 else 1.0


# -- figures -----------------------------------------------------------------------------------------------

def mape(pairs: Iterable[tuple[float, float]]) -> float | None:
    """Mean absolute percentage error of (predicted, measured) pairs; None without any."""
    errors = [abs(p - m) / m for p, m in pairs if m]
    return statistics.mean(errors) if errors else None


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation; None below 3 points or where either side is constant."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    from scipy.stats import spearmanr

    value = float(spearmanr(xs, ys).statistic)
    return value if math.isfinite(value) else None


def spread_sample(ok: Sequence[TrialResult], peak: Callable[[Config], int], n: int = CALIBRATION_TRIALS) -> list:
    """`n` ok results spread over the predicted peaks (smallest, ..., largest): what a tuner's first trials
    would calibrate on. All of them when there are no more than `n`."""
    ranked = sorted(ok, key=lambda r: (peak(r.config), r.config))
    if len(ranked) <= n:
        return list(ranked)
    picks = sorted({round(i * (len(ranked) - 1) / (n - 1)) for i in range(n)}) if n > 1 else [0]
    return [ranked[i] for i in picks]


@dataclass(frozen=True)
class LayoutCliff:
    """Where one layout runs out of memory: the largest micro-batch predicted to fit (over the space's
    micro-batches), and the largest measured to fit / smallest measured not to (over those measured)."""

    layout: str
    micro_batches: tuple[int, ...]  # measured (ok or oom)
    predicted: int | None  # largest predicted to fit, uncalibrated estimator; None: none fits
    calibrated: int | None  # the same, calibrated estimator
    measured_fit: int | None  # largest measured to fit
    measured_oom: int | None  # smallest measured not to fit
    verdict: str  # agree | optimistic (a config predicted to fit did not) | cautious (the reverse) | mixed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layout_cliffs(results: Iterable[TrialResult], space: Space, fits: Callable[[Config], bool],
                  calibrated_fits: Callable[[Config], bool], budget: int) -> list[LayoutCliff]:
    """Per layout with a measured config (ok or oom under `budget`), predicted vs measured cliff. Verdicts
    compare prediction and measurement config by config, on the measured configs only."""
    measured: dict[tuple, list[TrialResult]] = defaultdict(list)
    for r in results:
        if r.status in ("ok", "oom"):
            measured[layout(r.config)].append(r.under_budget(budget))
    mbs: dict[tuple, list[Config]] = defaultdict(list)
    for config in space:
        mbs[layout(config)].append(config)
    cliffs = []
    for key in sorted(measured):
        runs = sorted(measured[key], key=lambda r: r.config.micro_batch)
        candidates = mbs.get(key) or [r.config for r in runs]
        optimistic = any(fits(r.config) and not r.ok for r in runs)
        cautious = any(r.ok and not fits(r.config) for r in runs)
        verdict = {(False, False): "agree", (True, False): "optimistic", (False, True): "cautious"}.get(
            (optimistic, cautious), "mixed")
        cliffs.append(LayoutCliff(
            layout_label(key), tuple(r.config.micro_batch for r in runs),
            max((c.micro_batch for c in candidates if fits(c)), default=None),
            max((c.micro_batch for c in candidates if calibrated_fits(c)), default=None),
            max((r.config.micro_batch for r in runs if r.ok), default=None),
            min((r.config.micro_batch for r in runs if not r.ok), default=None), verdict))
    return cliffs


def trials_to(curve: Sequence[float], level: float = NEAR) -> float:
    """Launched trials until the recommendation reached `level` of the optimum; inf if it never did."""
    return next((i + 1 for i, v in enumerate(curve) if v >= level - 1e-9), math.inf)


def measured_budget(results: Iterable[TrialResult]) -> int | None:
    """The CPU check's budget: the median measured peak of the ok trials, so that about half fit (on the CPU
    the device is the host's RAM, far above any tiny model's peak)."""
    peaks = sorted(r.peak_memory_bytes for r in results if r.ok and r.peak_memory_bytes)
    return peaks[(len(peaks) - 1) // 2] if peaks else None


# -- one surface -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """One surface to record and analyse."""

    workload: Workload
    hardware: Hardware
    mode: Mode
    trial_budget: int  # bytes per device the trials run under (the whole device; on the CPU its RAM)
    planning_budget: int  # where the cliff should fall when choosing layouts
    path: Path
    logs: Path

    @property
    def name(self) -> str:
        return self.workload.model.name

    @property
    def space(self) -> Space:
        return Space(self.mode.choices, self.workload, self.hardware)

    def predict(self, config: Config, calibration: Calibration = Calibration()) -> Estimate:
        return estimate(config, self.workload, self.hardware, calibration)


def make_plans(mode: Mode, hardware: Hardware, models: Sequence[ModelShape], surfaces: Path, logs: Path,
               seq_len: int | None = None) -> list[Plan]:
    """A plan per model, each at `seq_len` tokens per sample (None: the model's own). A surface file holds one
    workload: recording into one of another sequence length is refused (autotune.drivers.recording)."""
    plans = []
    for shape in models:
        workload = Workload(replace(shape, seq_len=seq_len) if seq_len else shape, mode.global_batch)
        trial_budget = hardware.memory_bytes
        planning = trial_budget
        if mode.name == "cpu":  # the median predicted peak: about half the configs fit
            space = Space(mode.choices, workload, hardware)
            peaks = sorted(estimate(c, workload, hardware).peak_bytes for c in space)
            planning = peaks[(len(peaks) - 1) // 2]
        name = f"{hardware.name}-{shape.name}"
        plans.append(Plan(workload, hardware, mode, trial_budget, planning, surfaces / f"{name}.jsonl",
                          logs / name))
    return plans


class OutOfTime(Exception):
    """This call's recording time is spent: the surface is resumed by the next call."""


class Timed:
    """A backend that refuses to start a trial that would end past the deadline, and shows a live line
    while each trial runs."""

    def __init__(self, inner: Any, deadline: float, expected: Callable[[Config], float], status: Callable) -> None:
        self.inner, self.deadline, self.expected, self.status = inner, deadline, expected, status
        self.name = inner.name

    def run(self, config: Config) -> TrialResult:
        fatal = getattr(self.inner, "fatal", None)
        if fatal:
            raise KitError(fatal)
        if time.monotonic() + self.expected(config) > self.deadline:
            raise OutOfTime()
        with self.status(f"running {config.label()} (expected ~{self.expected(config):.0f}s)"):
            return self.inner.run(config)


def record_plan(plan: Plan, available_s: float, args: argparse.Namespace, console: Any) -> dict[str, Any]:
    """Record as much of the plan's subset as `available_s` allows; what was chosen and done."""
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.drivers.recording import record_surface as record
    from autotune.values.dsconfig import DsOptions
    from autotune.worker.measure import MeasureSettings

    mode = plan.mode
    existing = read_results(plan.path) if plan.path.exists() else []

    def base_seconds(config: Config) -> float:
        return trial_seconds(plan.predict(config), plan.trial_budget, mode)

    scale = time_scale(existing, base_seconds)

    def expected(config: Config) -> float:
        return base_seconds(config) * scale

    space = plan.space
    predicted_fit = {c: plan.predict(c).peak_bytes <= plan.planning_budget for c in space}
    by_layout: dict[tuple, list[bool]] = defaultdict(list)
    for config, fit in predicted_fit.items():
        by_layout[layout(config)].append(fit)
    order = balanced_layouts(space, args.seed, lambda key: 0 < sum(by_layout[key]) < len(by_layout[key]))
    subset = select_subset(space, order, lambda configs: bracket(configs, predicted_fit.__getitem__), expected,
                           available_s, [r.config for r in existing], args.configs)
    console.print(f"{plan.name}: {len(space)} configs in the space, {len(existing)} already measured; this call: "
                  f"{len(subset)} configs of {len({layout(c) for c in subset})} layouts within "
                  f"{available_s / 60:.1f} min (trial time scale {scale:.2f})", highlight=False)
    settings = MeasureSettings(warmup_steps=1, min_steps=min(2, args.max_steps), max_steps=args.max_steps,
                               max_measure_s=mode.max_measure_s)
    backend = DeepSpeedBackend(plan.workload, memory_budget_bytes=plan.trial_budget, hardware=plan.hardware,
                               ds_options=DsOptions(force_ds_cpu_optimizer=False), logs_dir=plan.logs,
                               timeout_s=args.timeout, measure=settings, seed=args.seed)
    timed = Timed(backend, time.monotonic() + available_s, expected, console.status)
    stopped = None
    try:
        done = record(space.restrict(subset), timed, plan.path, order_seed=args.seed,
                      progress=lambda line: console.print(f"{plan.name}: {line}", highlight=False))
        recorded = done.recorded
    except OutOfTime:
        stopped = "out of time"
        recorded = None
        console.print(f"{plan.name}: this call's time for it is spent; the same command again measures more")
    if backend.fatal:  # e.g. the ranks found no GPU: no other config would run either
        raise KitError(backend.fatal)
    return {"subset_configs": len(subset), "subset_layouts": len({layout(c) for c in subset}),
            "recorded_now": recorded, "stopped": stopped, "time_scale": scale}


def analyse(plan: Plan, seeds: int, strategies: Sequence[str], trials: int = 50) -> dict[str, Any]:
    """The figures of one recorded surface (module docstring)."""
    from autotune.backends.replay import load_surface
    from autotune.prediction.calibrate import fit_calibration

    surface = load_surface(plan.path)
    results = [r for r in surface.results.values() if r.config in plan.space]
    counts = dict(Counter(r.status for r in results))
    budget = plan.trial_budget if plan.mode.name != "cpu" else measured_budget(results)
    out: dict[str, Any] = {
        "model": plan.name, "params": plan.workload.model.params, "surface": str(plan.path),
        "workload": plan.workload.to_dict(), "space_configs": len(plan.space), "measured": len(results),
        "measured_layouts": len({layout(r.config) for r in results}), "status_counts": counts,
        "budget_bytes": budget, "budget_source": "device memory" if plan.mode.name != "cpu" else
        "median measured peak (CPU check)",
        "median_trial_s": statistics.median(r.wall_time_s for r in results) if results else None,
        "recorded_s": sum(r.wall_time_s for r in results)}
    ok = [r for r in results if r.ok and r.peak_memory_bytes and r.step_time_s]
    if not ok or budget is None:
        out["note"] = "no ok trial: nothing to compare"
        return out
    raw = {r.config: plan.predict(r.config) for r in results}
    fit_on = spread_sample(ok, lambda c: raw[c].peak_bytes)
    calibration = fit_calibration(fit_on, plan.workload, plan.hardware)
    calibrated = {r.config: plan.predict(r.config, calibration) for r in results}
    held_out = [r for r in ok if r not in fit_on]
    out["memory"] = {
        "mape_uncalibrated": mape((raw[r.config].peak_bytes, r.peak_memory_bytes) for r in ok),
        "mape_calibrated_held_out": mape((calibrated[r.config].peak_bytes, r.peak_memory_bytes) for r in held_out),
        "mape_calibrated_all": mape((calibrated[r.config].peak_bytes, r.peak_memory_bytes) for r in ok),
        "calibrated_on": [r.config.label() for r in fit_on], "held_out": len(held_out),
        "calibration": calibration.to_dict()}
    out["step_time"] = {
        "mape_uncalibrated": mape((raw[r.config].step_time_s, r.step_time_s) for r in ok),
        "mape_calibrated_held_out": mape((calibrated[r.config].step_time_s, r.step_time_s) for r in held_out)}
    measured_tput = [r.throughput_samples_per_s for r in ok]
    out["throughput"] = {
        "spearman_uncalibrated": spearman([raw[r.config].throughput_samples_per_s for r in ok], measured_tput),
        "spearman_calibrated": spearman([calibrated[r.config].throughput_samples_per_s for r in ok], measured_tput),
        "configs": len(ok)}
    ran = [r.under_budget(budget) for r in results if r.status in ("ok", "oom")]
    both = {"agree": 0, "predicted_fit_measured_not": 0, "measured_fit_predicted_not": 0}
    for r in ran:
        predicted = raw[r.config].peak_bytes <= budget
        both["agree" if predicted == r.ok else "predicted_fit_measured_not" if predicted else
             "measured_fit_predicted_not"] += 1
    out["fit_agreement"] = {**both, "configs": len(ran), "share": both["agree"] / len(ran) if ran else None}
    space = plan.space
    cliffs = layout_cliffs(results, space, lambda c: plan.predict(c).peak_bytes <= budget,
                           lambda c: plan.predict(c, calibration).peak_bytes <= budget, budget)
    out["cliffs"] = [c.to_dict() for c in cliffs]
    out["cliff_verdicts"] = dict(Counter(c.verdict for c in cliffs))
    out["search"] = replay_search(surface, plan, budget, seeds, strategies, trials)
    return out


def replay_search(surface: Any, plan: Plan, budget: int, seeds: int, strategies: Sequence[str],
                  trials: int = 50) -> dict[str, Any]:
    """Each strategy replayed on the surface (search_efficiency's loop: pruning, calibration, the same
    budget), `seeds` runs each of at most `trials` launched trials (and no more than the measured configs)."""
    import optuna
    from search_efficiency import grid_subspace, sweep

    from autotune.backends.replay import ReplayBackend, surface_space

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    best = surface.best(budget)
    if best is None:
        return {"note": "no measured config fits the budget"}
    # The surface's configs of this plan's space only (a file may hold more, e.g. from other choices).
    space = surface_space(surface, plan.hardware, plan.workload).restrict(
        c for c in surface.results if c in plan.space)
    optimum = best.throughput_samples_per_s

    def truth(config: Config) -> float:
        return surface.results[config].under_budget(budget).throughput_samples_per_s or 0.0

    grid_best = max((truth(c) for c in grid_subspace(space)), default=0.0)
    rows = {}
    for name in strategies:
        curves = []
        for seed in range(seeds):
            curve, oom, pruned, _ = sweep(name, space, ReplayBackend(surface, budget), budget,
                                          min(trials, len(space)), seed, truth, optimum)
            curves.append((curve, oom, pruned))
        reached = [trials_to(c) for c, _, _ in curves]
        rows[name] = {"runs": len(curves), "median_trials_to_98": statistics.median(reached),
                      "reached_98_share": sum(math.isfinite(t) for t in reached) / len(reached),
                      "median_final": statistics.median(c[-1] if c else 0.0 for c, _, _ in curves),
                      "median_launched": statistics.median(len(c) for c, _, _ in curves),
                      "oom_trials": sum(o for _, o, _ in curves), "pruned": sum(p for _, _, p in curves)}
    return {"configs": len(space), "optimum": best.config.label(), "optimum_samples_per_s": optimum,
            "grid_reach": grid_best / optimum, "strategies": rows}


# -- output ------------------------------------------------------------------------------------------------

def fmt(value: Any, kind: str = "g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "never"
    if kind == "%":
        return f"{value:.1%}"
    if kind == "mb":
        return "none" if value is None else str(value)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def format_params(params: float) -> str:
    """A parameter count in three significant figures: '1.10B', '6.55M' (a tiny model is not '0.00B')."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if params >= scale * 0.9995:
            return f"{params / scale:.3g}{unit}"
    return f"{params:.0f}"


def markdown(report: Mapping[str, Any]) -> str:
    lines = ["# GPU validation", "",
             f"`{report['command']}` on {report['machine']} (profile `{report['hardware']}`, DeepSpeed's "
             f"{report['accelerator']} accelerator), {report['seconds'] / 60:.1f} min this call.", "",
             "Per surface: real DeepSpeed trials of memory layouts (a balanced subset of the space), each at the "
             "largest micro-batch predicted to fit and the next one; the estimator calibrated on "
             f"{CALIBRATION_TRIALS} trials spread over the predicted peaks (smallest to largest), its calibrated "
             "error measured on the others; search strategies replayed on the surface (trials to 98% of the "
             "surface's optimum, median over seeds).", "",
             "| model | params | budget | measured | statuses | peak MAPE raw | peak MAPE calibrated (held out) | "
             "step MAPE raw | Spearman raw | Spearman calibrated | fit agreement | cliffs agree |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in report["surfaces"]:
        mem, thr, step = s.get("memory", {}), s.get("throughput", {}), s.get("step_time", {})
        fit, verdicts = s.get("fit_agreement", {}), s.get("cliff_verdicts", {})
        statuses = ", ".join(f"{n} {k}" for k, n in sorted(s["status_counts"].items()))
        lines.append(
            f"| {s['model']} | {format_params(s['params'])} | {format_size(s['budget_bytes']) if s['budget_bytes'] else '-'} | "
            f"{s['measured']}/{s['space_configs']} | {statuses} | {fmt(mem.get('mape_uncalibrated'), '%')} | "
            f"{fmt(mem.get('mape_calibrated_held_out'), '%')} ({mem.get('held_out', 0)}) | "
            f"{fmt(step.get('mape_uncalibrated'), '%')} | {fmt(thr.get('spearman_uncalibrated'))} | "
            f"{fmt(thr.get('spearman_calibrated'))} | {fmt(fit.get('share'), '%')} | "
            f"{verdicts.get('agree', 0)}/{sum(verdicts.values())} |")
    for s in report["surfaces"]:
        lines += ["", f"## {s['model']}: `{s['surface']}`", ""]
        if "note" in s:
            lines += [s["note"], ""]
            continue
        lines += [f"Budget {format_size(s['budget_bytes'])} ({s['budget_source']}); {s['measured']} configs of "
                  f"{s['measured_layouts']} layouts measured, median trial {s['median_trial_s']:.1f} s; calibrated on "
                  f"{', '.join(s['memory']['calibrated_on'])}.", "",
                  "Out-of-memory cliff per layout: the largest micro-batch predicted to fit (raw and calibrated "
                  "estimator, over the space's micro-batches) and measured to fit; `optimistic`: a measured config "
                  "was predicted to fit and did not (a tuner would launch it), `cautious`: the reverse (a tuner "
                  "would prune a config that fits).", "",
                  "| layout | measured micro-batches | predicted | calibrated | measured fit | measured OOM from | verdict |",
                  "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
        for c in s["cliffs"]:
            lines.append(f"| {c['layout']} | {', '.join(map(str, c['micro_batches']))} | {fmt(c['predicted'], 'mb')} | "
                         f"{fmt(c['calibrated'], 'mb')} | {fmt(c['measured_fit'], 'mb')} | {fmt(c['measured_oom'])} | "
                         f"{c['verdict']} |")
        search = s["search"]
        if "strategies" not in search:
            lines += ["", search.get("note", ""), ""]
            continue
        lines += ["", f"Search replayed on the {search['configs']} measured configs (optimum {search['optimum']}, "
                  f"{search['optimum_samples_per_s']:.3g} samples/s; the best of grid's sub-space reaches "
                  f"{search['grid_reach']:.1%} of it):", "",
                  "| strategy | runs | trials to 98% | reached 98% | final best/opt | launched | OOM trials | pruned |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, row in search["strategies"].items():
            lines.append(f"| {name} | {row['runs']} | {fmt(row['median_trials_to_98'])} | {row['reached_98_share']:.0%} | "
                         f"{row['median_final']:.3f} | {fmt(row['median_launched'])} | {row['oom_trials']} | "
                         f"{row['pruned']} |")
    lines.append("")
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------------------

def model_list(text: str) -> tuple[ModelShape, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed a comma-separated list of {', '.join(MODELS)}")
    return tuple(MODELS[n] for n in names)


def strategy_list(text: str) -> tuple[str, ...]:
    from autotune.strategies import STRATEGIES as KNOWN

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in KNOWN for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed a comma-separated list of {', '.join(KNOWN)}")
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="gpu_validation", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="the CPU check (CI): tiny models, DeepSpeed's CPU accelerator, profile cpu")
    parser.add_argument("--minutes", type=non_negative_float, default=None,
                        help=f"minutes of trials for this call, split between the surfaces; 0: analyse what is "
                             f"recorded (default: {GPU_MODE.minutes:g} on a GPU, to fit one 10-minute command with "
                             f"install and analysis; {CPU_MODE.minutes:g} with --cpu)")
    parser.add_argument("--models", type=model_list, default=None,
                        help=f"models instead of the automatic choice: any of {', '.join(MODELS)}")
    parser.add_argument("--configs", type=positive_int, default=None,
                        help="at most this many configs per surface (two per layout; default: as time allows)")
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help=f"measured optimizer steps at most per trial (default: {GPU_MODE.max_steps} on a GPU, "
                             f"{CPU_MODE.max_steps} with --cpu)")
    parser.add_argument("--global-batch", type=positive_int, default=None,
                        help=f"samples per optimizer step (default: {GPU_MODE.global_batch} on a GPU, "
                             f"{CPU_MODE.global_batch} with --cpu); micro-batches that do not divide it leave the space")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per sample of every model (default: each model's own, e.g. 256 for the CPU "
                             "check's tiny models): a shorter one makes each trial's steps shorter")
    parser.add_argument("--timeout", type=positive_float, default=None,
                        help=f"seconds per trial before it is ended (default: {GPU_MODE.timeout_s:g}; "
                             f"{CPU_MODE.timeout_s:g} with --cpu)")
    parser.add_argument("--seed", type=int, default=0, help="order of layouts and configs (default: %(default)s)")
    parser.add_argument("--seeds", type=positive_int, default=5, help="replayed searches per strategy (default: 5)")
    parser.add_argument("--trials", type=positive_int, default=50,
                        help="launched trials at most per replayed search (default: %(default)s)")
    parser.add_argument("--strategies", type=strategy_list, default=STRATEGIES,
                        help=f"strategies to replay (default: {','.join(STRATEGIES)})")
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="folder of gpu_validation.md and .json (default: benchmarks/results)")
    parser.add_argument("--surfaces", type=Path, default=None,
                        help="folder of the recorded surfaces (default: benchmarks/surfaces; with --cpu: <out>/surfaces)")
    parser.add_argument("--logs", type=Path, default=None,
                        help="folder of the trials' logs (default: runs/gpu-validation; with --cpu: <out>/logs)")
    args = parser.parse_args(argv)
    mode = CPU_MODE if args.cpu else GPU_MODE
    if args.global_batch is not None:
        mode = replace(mode, global_batch=args.global_batch)
    args.mode = mode
    args.minutes = mode.minutes if args.minutes is None else args.minutes
    args.max_steps = args.max_steps or mode.max_steps
    args.timeout = args.timeout or mode.timeout_s
    if args.surfaces is None:
        args.surfaces = args.out / "surfaces" if args.cpu else HERE / "surfaces"
    if args.logs is None:
        args.logs = args.out / "logs" if args.cpu else HERE.parent / "runs" / "gpu-validation"
    return args


def detect(args: argparse.Namespace) -> tuple[Hardware, str, tuple[ModelShape, ...]]:
    """The hardware profile, a description of the machine, and the models to record."""
    if args.cpu:
        return PROFILES["cpu"], "this machine's CPU, the CPU check", args.models or CPU_MODELS
    from autotune.trials.devices import auto_hardware, probe

    machine = probe()
    if machine.accelerator != "cuda":
        raise ConfigError(f"no CUDA GPU found here ({machine.describe()}): run on a CUDA machine, or with --cpu "
                          "for the CPU check")
    hardware = auto_hardware(machine)
    return hardware, machine.describe(), args.models or choose_gpu_models(hardware,
                                                                          global_batch=args.mode.global_batch)


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    started = time.monotonic()
    try:
        hardware, machine, models = detect(args)
        console.print(f"{machine}: profile {hardware.name}, {format_size(hardware.memory_bytes)} per device; "
                      f"models {', '.join(f'{m.name} ({format_params(m.params)})' for m in models)}"
                      + (f", {args.seq_len} tokens per sample" if args.seq_len else ""))
        plans = make_plans(args.mode, hardware, models, args.surfaces, args.logs, args.seq_len)
        args.surfaces.mkdir(parents=True, exist_ok=True)
        recording = {}
        deadline = started + args.minutes * 60
        for i, plan in enumerate(plans):
            if args.minutes == 0:
                break
            available = (deadline - time.monotonic()) / (len(plans) - i)  # what one surface left goes to the next
            recording[plan.name] = record_plan(plan, max(0.0, available), args, console)
        surfaces = []
        for plan in plans:
            if not plan.path.exists():
                console.print(f"{plan.name}: no surface at {plan.path} yet")
                continue
            console.print(f"{plan.name}: analysing {plan.path} ...")
            surfaces.append({**analyse(plan, args.seeds, args.strategies, args.trials),
                             "recording": recording.get(plan.name)})
    except ConfigError as err:
        print(f"gpu_validation: error: {err}", file=sys.stderr)
        return 2
    except KitError as err:
        print(f"gpu_validation: this machine cannot run the trials: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpu_validation: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    report = {"command": "python benchmarks/gpu_validation.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine, "hardware": hardware.name, "accelerator": hardware.accelerator,
              "memory_bytes": hardware.memory_bytes, "minutes": args.minutes,
              "seconds": time.monotonic() - started, "surfaces": surfaces}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_validation.json").write_text(json.dumps(finite(report), indent=1) + "\n")
    (args.out / "gpu_validation.md").write_text(markdown(report))
    console.print(markdown(report))
    console.print(f"wrote {args.out / 'gpu_validation.md'} and .json ({report['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
