"""The simulated backend: a trial is the estimator's prediction, with optional seeded noise.

What a result holds:
- step time: the estimator's step time times a seeded multiplicative noise factor exp(noise * N(0, 1))
  (lognormal, median 1); throughput is the global batch over that step time. Real step times on a
  shared machine scatter by ~10-40% (ARCHITECTURE.md section 4), so RL training on this backend can add noise
  of that size.
- memory: the estimator's predicted peak per device, without noise (measured peaks repeat within ~2%).
  A peak over the budget is the OOM cliff: status `oom`, with the predicted peak kept in
  `peak_memory_bytes` so that a reward can grow with the overshoot. Offloaded state that exceeds the
  node's host memory is an `oom` too.
- a config the workload or hardware cannot run (e.g. fp16 where the profile has no fp16) is
  `unsupported`, with the reason.
- `wall_time_s` is the duration a real trial of this config would take, deterministic for a seed, so drivers
  with time budgets and Ray's scale tests can use it. Nothing sleeps. By default a flat launch overhead plus
  the measured steps (`trial_overhead_s + measured_steps * step`); with `trial_times=True` a GPU-like trial time
  (`TrialClock`, issue 41): autotune.prediction.trial_time's phases at the config's noise-free step time
  (launch, op load, model build, deepspeed.initialize with ZeRO-3's and optimizer offload's longer ones,
  warm-up with fp16's expected skipped steps (none since 11-30), measurement, exit), a config over the budget or the host's
  memory dying in its first step (`fits=False`), the first trial of the run that uses an op (FusedAdam,
  DeepSpeedCPUAdam) paying its build once, every trial after the run's first, and a first one that builds its op, on
  ranks started ahead (its launch a handoff, its initialize without the first call's imports; `import_ahead_s`
  recorded), and the world's noise on the whole (exp(noise * N(0, 1)), drawn
  from a stream of its own, so the step-time noise draws are the same with and without it). Off by default:
  tests pin the flat figure, and the environment's reward reads no wall time.

Predictions are cached per config (compactly): a run after the first costs a dictionary lookup and one
noise draw; without noise, the whole result is reused.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import Calibration, Estimate, estimate, host_need_bytes
from autotune.prediction.trial_time import (ALL_OPS, DEFAULT_MEASURE, JobSize, Measure, TrialTimeModel,
                                            model_for, op_for, trial_time_at)
from autotune.values.hardware import Hardware
from autotune.values.results import TrialResult
from autotune.values.settings import check_budget
from autotune.values.space import invalid_reason
from autotune.values.units import format_size
from autotune.values.workload import Workload


WALL_STREAM = 41  # the wall-time noise's stream beside a seed's own (issue 41): [WALL_STREAM, seed]


def side_stream(seed: int | np.random.Generator | None) -> np.random.Generator:
    """A generator of its own for `seed` that leaves the seed's stream as it was: [WALL_STREAM, seed] for an int,
    a child of a generator's seed sequence (drawing nothing from it), fresh entropy otherwise."""
    if isinstance(seed, np.random.Generator):
        sequence = getattr(seed.bit_generator, "seed_seq", None)
        return np.random.default_rng(sequence.spawn(1)[0] if isinstance(sequence, np.random.SeedSequence) else None)
    return np.random.default_rng(None if seed is None else [WALL_STREAM, int(seed)])


class TrialClock:
    """A simulated world's GPU-like trial times (issue 41), one clock per run: what
    autotune.prediction.trial_time predicts for a config at its true step time, the first trial of the run that
    loads an op paying its build (once per op and run, out of memory or not: the op loads before the model is
    built), every trial after the run's first on ranks started ahead (as the deepspeed backend's spares run them),
    and the run's first too where it builds its op (the backend starts its ranks while the op builds,
    `Spares.start_first`: the H200's tune of 2026-11-30, trial 1, imports made 12 s ahead during cpu_adam's build),
    and the world's multiplicative noise exp(noise * N(0, 1)) on the whole, from `rng`."""

    def __init__(self, workload: Workload, hardware: Hardware, noise: float, rng: np.random.Generator,
                 measure: Measure = DEFAULT_MEASURE, model: TrialTimeModel | None = None) -> None:
        self.size = JobSize.of(workload, hardware)
        self.model = model or model_for(hardware)
        self.noise = float(noise)
        self.rng = rng
        self.measure = measure
        self.ops_built: set[str] = set()
        self.launched = 0  # trials of this run so far
        self._seconds: dict[tuple[Config, bool, bool], float] = {}  # without op builds and noise, per (config, fits, ahead)

    def new_run(self, rng: np.random.Generator) -> "TrialClock":
        """The same world's clock for another run: no op built yet, noise from `rng` (the cache is shared)."""
        other = copy.copy(self)
        other.rng, other.ops_built, other.launched = rng, set(), 0
        return other

    def expected_s(self, config: Config, step_time_s: float, fits: bool, ahead: bool = False) -> float:
        """The trial's predicted seconds with every op built and no noise."""
        key = (config, fits, ahead)
        seconds = self._seconds.get(key)
        if seconds is None:
            seconds = trial_time_at(config, self.size, step_time_s, self.model, fits=fits, ops_built=ALL_OPS,
                                    measure=self.measure, ahead=ahead).total_s
            self._seconds[key] = seconds
        return seconds

    def launch(self, config: Config, step_time_s: float, fits: bool) -> tuple[float, dict[str, float]]:
        """A trial of `config` now: its seconds (expected, on ranks started ahead after the run's first or while its
        op builds; the op's first build if this run has not built it; noise) and what its result records of ranks
        started ahead, as the deepspeed backend's (`import_ahead_s`: the imports made before it, the launch it
        saves; none for a run's first that builds no op)."""
        op = op_for(config)
        building = op if op is not None and op not in self.ops_built else None
        ahead = self.launched > 0 or building is not None
        self.launched += 1
        seconds = self.expected_s(config, step_time_s, fits, ahead)
        if building is not None:
            self.ops_built.add(building)
            seconds += self.model.op_build(building)
        if self.noise:
            seconds *= math.exp(self.noise * self.rng.standard_normal())
        return seconds, {"import_ahead_s": self.model.launch_s} if ahead else {}


class _Prediction(NamedTuple):
    """What a run needs from the estimate, kept small: environments cache thousands of these."""

    invalid_reason: str | None
    peak_bytes: int
    host_need_bytes: int
    step_time_s: float
    dominant_term: str


class SimulatedBackend:
    name = "simulated"
    fatal: str | None = None  # no config can succeed here (Backend protocol)

    def __init__(self, workload: Workload, hardware: Hardware, memory_budget_bytes: int, noise: float = 0.0,
                 seed: int | np.random.Generator | None = None, calibration: Calibration = Calibration(), *,
                 nvme_path: str | None = None, trial_overhead_s: float = 15.0, measured_steps: int = 10,
                 trial_times: bool = False, measure: Measure = DEFAULT_MEASURE) -> None:
        check_budget(memory_budget_bytes)
        if not math.isfinite(noise) or noise < 0:
            raise ConfigError(f"noise={noise!r}: must be >= 0 (0 turns noise off; 0.1 is ~10% step-time spread)")
        self.workload = workload
        self.hardware = hardware
        self.memory_budget_bytes = int(memory_budget_bytes)
        self.noise = float(noise)
        self.calibration = calibration
        self.nvme_path = nvme_path
        self.trial_overhead_s = trial_overhead_s
        self.measured_steps = measured_steps
        self._rng = np.random.default_rng(seed)
        # GPU-like wall times (trial_times), their noise from a stream of their own.
        self._clock = TrialClock(workload, hardware, self.noise, side_stream(seed), measure) if trial_times else None
        self._cache: dict[Config, _Prediction] = {}  # shared by with_budget() copies
        self._results: dict[Config, TrialResult] = {}  # outcomes that involve no noise, for this budget

    def with_budget(self, memory_budget_bytes: int) -> "SimulatedBackend":
        """The same simulation under another budget, sharing the estimate cache (predictions do not
        depend on the budget) and the noise stream."""
        check_budget(memory_budget_bytes)
        other = copy.copy(self)
        other.memory_budget_bytes = int(memory_budget_bytes)
        other._results = {}
        if self._clock is not None:  # another run: its ops not built yet
            other._clock = self._clock.new_run(self._clock.rng)
        return other

    def reseed(self, seed: int | np.random.Generator | None) -> None:
        """Restart the noise stream from a seed, or draw from a given generator (an environment passes its own);
        with trial times, a new run: no op built yet, the wall-time noise from the seed's side stream."""
        self._rng = np.random.default_rng(seed)
        if self._clock is not None:
            self._clock = self._clock.new_run(side_stream(seed))

    def estimate(self, config: Config) -> Estimate:
        """The noise-free prediction for `config` (ConfigError if the config cannot run here). The backend
        keeps what a run of it needs, so an environment that estimates a whole space once makes every
        later run a lookup."""
        reason = invalid_reason(config, self.workload, self.hardware, self.nvme_path)
        if reason:
            self._cache[config] = _Prediction(reason, 0, 0, 0.0, "")
            raise ConfigError(f"{config.to_json()}: {reason}")
        est = estimate(config, self.workload, self.hardware, self.calibration)
        self._cache[config] = _Prediction(None, est.peak_bytes, host_need_bytes(est, self.workload, self.hardware),
                                          est.step_time_s, est.memory.dominant)
        return est

    def _lookup(self, config: Config) -> _Prediction:
        cached = self._cache.get(config)
        if cached is None:
            try:
                self.estimate(config)
            except ConfigError:
                pass
            cached = self._cache[config]
        return cached

    def close(self) -> None:
        """Nothing held between trials."""

    def run(self, config: Config) -> TrialResult:
        result = self._outcome(config)
        if self._clock is None or result.status == "unsupported":
            return result
        step = self._lookup(config).step_time_s  # noise-free: the config's true step time
        seconds, ahead = self._clock.launch(config, step, result.status == "ok")
        return replace(result, wall_time_s=seconds, extra={**result.extra, **ahead})

    def _outcome(self, config: Config) -> TrialResult:
        result = self._results.get(config)
        if result is not None:  # deterministic outcomes are built once
            return result
        reason, peak, host_need, step, dominant = self._lookup(config)
        budget = self.memory_budget_bytes
        if reason is not None:
            result = TrialResult(config, "unsupported", memory_budget_bytes=budget, backend=self.name, error=reason)
        elif peak > budget:  # "cause": a key of autotune.search.pruning.CAUSES
            result = TrialResult(config, "oom", peak_memory_bytes=peak, memory_budget_bytes=budget,
                                 wall_time_s=self.trial_overhead_s, backend=self.name,
                                 extra={"predicted_peak_bytes": peak, "cause": "device_memory"},
                                 error=f"predicted peak {format_size(peak)} exceeds the budget {format_size(budget)}"
                                       f" (largest term: {dominant})")
        elif host_need > self.hardware.host_memory_bytes:
            result = TrialResult(config, "oom", peak_memory_bytes=peak, memory_budget_bytes=budget,
                                 wall_time_s=self.trial_overhead_s, backend=self.name,
                                 extra={"predicted_peak_bytes": peak, "cause": "host_memory"},
                                 error=f"offloaded state needs {format_size(host_need)} of host memory per node,"
                                       f" more than the {format_size(self.hardware.host_memory_bytes)} there")
        else:
            if self.noise:
                step *= math.exp(self.noise * self._rng.standard_normal())
            samples = self.workload.global_batch / step
            result = TrialResult(config, "ok", throughput_samples_per_s=samples,
                                 tokens_per_s=samples * self.workload.model.seq_len, step_time_s=step,
                                 peak_memory_bytes=peak, memory_budget_bytes=budget,
                                 wall_time_s=self.trial_overhead_s + self.measured_steps * step,
                                 backend=self.name, extra={"predicted_peak_bytes": peak})
            if self.noise:
                return result
        self._results[config] = result
        return result
