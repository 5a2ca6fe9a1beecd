"""The distorted simulation's backend: the true landscape of one task (the estimator's, with a hidden
distortion drawn per episode) run like the simulated backend, with the noise-free optimum known.
`autotune.rl.simulator` draws the distortions and trains on it (its docstring says how they are drawn);
it is built through the factory (`autotune.backends.factory.distorted_backend`).

A result's `wall_time_s` is a flat `trial_overhead_s + measured_steps * step` by default; with `trial_times=True` a
GPU-like trial time (autotune.backends.simulated.TrialClock, issue 41): the trial-time model at the config's true
(distorted, noise-free) step time, `fits` from its true peak against the budget and the host's memory, each op's
first build once per run (a new noise seed is a new run), and the world's noise on it from a stream of its own
(the throughput noise draws are unchanged)."""

from __future__ import annotations

import copy
import math
from typing import Mapping, Protocol
from dataclasses import dataclass

import numpy as np

from autotune.backends.simulated import TrialClock, side_stream
from autotune.values.config import KNOBS, Config
from autotune.values.results import TrialResult
from autotune.values.space import Space
from autotune.values.units import format_size


# The hidden throughput offsets' spreads, as `spread` divided by these: each knob value's own offset (an offload's
# values other than none; none is 0), and micro-batch's trend per doubling besides.
OWN_DIVISOR = {"zero_stage": 2, "micro_batch": 6, "ckpt_interval": 4, "precision": 2, "offload_optimizer": 2,
               "offload_param": 2}
TREND_DIVISOR = 4


@dataclass(frozen=True)
class Distortion:
    """Hidden log-offsets per knob value (tables indexed like the space's choices) and per config."""

    throughput: tuple[np.ndarray, ...]
    memory: tuple[np.ndarray, ...]
    memory_task: float
    per_config_sigma: float
    seed: int

    @classmethod
    def draw(cls, space: Space, spread: float, rng: np.random.Generator) -> "Distortion":
        throughput, memory = [], []
        for knob in KNOBS:
            values = space.choices.knob_values(knob)
            n = len(values)
            if knob == "micro_batch":
                trend = rng.normal(0.0, spread / TREND_DIVISOR) * np.log2(np.asarray(values, dtype=float))
                throughput.append(trend + rng.normal(0.0, spread / OWN_DIVISOR[knob], n))
            else:
                offsets = rng.normal(0.0, spread / OWN_DIVISOR[knob], n)
                offload = knob in ("offload_optimizer", "offload_param")
                throughput.append(np.where(np.asarray(values) == "none", 0.0, offsets) if offload else offsets)
            memory.append(rng.normal(0.0, spread / 8, n) if knob in ("zero_stage", "ckpt_interval") else np.zeros(n))
        return cls(tuple(throughput), tuple(memory), float(rng.normal(0.0, spread / 3)), spread / 6,
                   int(rng.integers(2**31)))

    @staticmethod
    def widths(space: Space, spread: float) -> tuple[tuple[str, float], ...]:
        """Per knob, the sd of a knob value's throughput offset as `draw` draws it (micro-batch: its trend and
        its own term, root mean square over the space's values): what a convergence figure that knew the
        world's spreads would take as its prior (benchmarks/stop_bounds.py)."""
        out = []
        for knob in KNOBS:
            own = spread / OWN_DIVISOR[knob]
            if knob == "micro_batch":
                logs = np.log2(np.asarray(space.choices.knob_values(knob), dtype=float))
                own = float(np.sqrt(np.mean((spread / TREND_DIVISOR * logs) ** 2) + own ** 2))
            out.append((knob, own))
        return tuple(out)

    def knob_offsets(self, codes: np.ndarray) -> np.ndarray:
        """The log throughput offset of each row of knob codes that its knob values explain (no per-config term)."""
        return sum((table[codes[:, k]] for k, table in enumerate(self.throughput)), np.zeros(len(codes)))

    def factors(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(throughput factor, memory factor) per row of knob codes."""
        log_t = self.knob_offsets(codes)
        log_m = self.memory_task + sum(table[codes[:, k]] for k, table in enumerate(self.memory))
        # Per-config term: a deterministic draw per config (hash of its codes), so that it does not
        # depend on which configs are in the array.
        keys = (codes * np.array([1, 31, 997, 30011, 900001, 27000023])[:codes.shape[1]]).sum(axis=1)
        unit = np.random.default_rng(self.seed).normal(0.0, 1.0, 4096)
        log_t = log_t + self.per_config_sigma * unit[(keys + self.seed) % 4096]
        return np.exp(log_t), np.exp(log_m)


class Landscape(Protocol):
    """What the backend reads of a task's landscape (autotune.envs.landscape.Landscape, built above this layer):
    every config's predicted peak and throughput, whether its host memory fits, and where each config is."""

    @property
    def space(self) -> Space: ...

    @property
    def peak(self) -> np.ndarray: ...

    @property
    def throughput(self) -> np.ndarray: ...

    @property
    def host_fits(self) -> np.ndarray: ...

    @property
    def index(self) -> Mapping[Config, int]: ...


class DistortedBackend:
    """A backend over the true landscape of one task: `run(config)` like the simulated backend, with the
    distortion applied, and the noise-free optimum known."""

    name = "simulated"
    fatal: str | None = None  # no config can succeed here (Backend protocol)

    def __init__(self, landscape: Landscape, codes: np.ndarray, budget_bytes: int, distortion: Distortion,
                 noise: float, rng: np.random.Generator, trial_overhead_s: float = 15.0, measured_steps: int = 10,
                 *, trial_times: bool = False):
        t_factor, m_factor = distortion.factors(codes)
        self.distortion = distortion  # the hidden truth, for benchmarks that ask what knowing it would give
        self.landscape = landscape
        self.workload = landscape.space.workload
        self.memory_budget_bytes = int(budget_bytes)
        self.peak = landscape.peak * m_factor
        self.throughput = landscape.throughput * t_factor
        self.feasible = (self.peak <= budget_bytes) & landscape.host_fits
        self.noise = noise
        self.rng = rng
        self.trial_overhead_s = trial_overhead_s
        self.measured_steps = measured_steps
        # GPU-like wall times, their noise drawn beside the distortion's seed (the same for the same truth).
        self.clock = TrialClock(self.workload, landscape.space.hardware, noise, side_stream(distortion.seed)) \
            if trial_times else None

    def with_noise_seed(self, seed: int) -> "DistortedBackend":
        """The same truth with its own stream of step-time noise (and of wall-time noise: a new run)."""
        other = copy.copy(self)
        other.rng = np.random.default_rng(seed)
        if self.clock is not None:
            other.clock = self.clock.new_run(side_stream(seed))
        return other

    def _clocked(self, config: Config, index: int, fits: bool) -> tuple[float, dict[str, float]]:
        """The trial's GPU-like seconds at the config's true step time and what its result records of ranks started
        ahead (TrialClock.launch; self.clock set)."""
        assert self.clock is not None
        return self.clock.launch(config, self.workload.global_batch / float(self.throughput[index]), fits)

    @property
    def optimum(self) -> float | None:
        """Best noise-free true throughput within the budget, None if nothing fits."""
        return float(self.throughput[self.feasible].max()) if self.feasible.any() else None

    def true_throughput(self, config: Config) -> float:
        return float(self.throughput[self.landscape.index[config]])

    def close(self) -> None:
        """Nothing held between trials."""

    def run(self, config: Config) -> TrialResult:
        index = self.landscape.index.get(config)
        budget = self.memory_budget_bytes
        if index is None:
            reason = self.landscape.space.invalid_reason(config) or "not in the space"
            return TrialResult(config, "unsupported", memory_budget_bytes=budget, backend=self.name, error=reason)
        peak = int(self.peak[index])
        if not self.feasible[index]:
            why = (f"peak {format_size(peak)} exceeds the budget {format_size(budget)}" if peak > budget
                   else "offloaded state exceeds the node's host memory")
            wall, extra = (self.trial_overhead_s, {}) if self.clock is None else self._clocked(config, index, False)
            return TrialResult(config, "oom", peak_memory_bytes=peak, memory_budget_bytes=budget,
                               wall_time_s=wall, backend=self.name, error=why, extra=extra)
        samples = float(self.throughput[index])
        if self.noise:
            samples /= math.exp(self.noise * self.rng.standard_normal())
        step = self.workload.global_batch / samples
        wall, extra = (self.trial_overhead_s + self.measured_steps * step, {}) if self.clock is None \
            else self._clocked(config, index, True)
        return TrialResult(config, "ok", throughput_samples_per_s=samples,
                           tokens_per_s=samples * self.workload.model.seq_len, step_time_s=step,
                           peak_memory_bytes=peak, memory_budget_bytes=budget, wall_time_s=wall, backend=self.name,
                           extra=extra)
