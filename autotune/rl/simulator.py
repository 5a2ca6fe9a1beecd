"""A simulated hardware whose truth differs from the estimator, for training and evaluating the policy.

The plain simulated backend *is* the estimator: on it, the estimator's best predicted config is the
optimum, so every strategy warm-started by the estimator finds it on its first trial and nothing is
learnt or measured. Real machines differ from the estimator in structured ways (a ZeRO stage or an
offload path slower than modelled, activations bigger than counted, a micro-batch trend), and a useful
policy must learn to trust the predictions only as far as the measurements confirm them.

So each task gets a hidden *distortion*, drawn per episode and never observed:
- throughput: log factor = sum over knobs of a random offset per knob value (ZeRO stage, precision,
  each offload value, checkpointing interval; micro-batch as a random trend in log2 plus offsets),
  plus a small per-config offset; spread `s`: stage, precision and offload offsets have sigma s/2,
  the micro-batch trend s/4 per doubling, checkpointing s/4, the per-config term s/6;
- memory: one factor for the task (sigma s/3), one per ZeRO stage and per checkpointing interval (s/8):
  the out-of-memory cliff moves, mostly as a whole;
and trials also carry the backend's multiplicative step-time noise. The observation keeps the nominal
estimator's predictions, exactly as on real hardware. The optimum (best feasible true throughput,
noise-free) is known by exhausting the space.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from autotune.config import KNOBS, Config, ConfigError
from autotune.envs.config import EnvConfig
from autotune.envs.deepspeed_memory import DeepSpeedMemoryEnv
from autotune.envs.episodes import Episode, EstimatorCaches, TaskSource, start_index
from autotune.envs.landscape import Landscape, build_landscape
from autotune.envs.sampler import Task, WorkloadSampler
from autotune.backends.simulated import SimulatedBackend
from autotune.results import TrialResult
from autotune.space import Space
from autotune.units import format_size

STARTS = ("random", "default", "estimator", "mixed")
MIXED_ESTIMATOR_SHARE = 0.5  # "mixed" starts: this share at the estimator's best, the rest at random


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
                trend = rng.normal(0.0, spread / 4) * np.log2(np.asarray(values, dtype=float))
                throughput.append(trend + rng.normal(0.0, spread / 6, n))
            elif knob == "ckpt_interval":
                throughput.append(rng.normal(0.0, spread / 4, n))
            elif knob in ("offload_optimizer", "offload_param"):
                offsets = rng.normal(0.0, spread / 2, n)
                throughput.append(np.where(np.asarray(values) == "none", 0.0, offsets))
            else:  # zero_stage, precision
                throughput.append(rng.normal(0.0, spread / 2, n))
            memory.append(rng.normal(0.0, spread / 8, n) if knob in ("zero_stage", "ckpt_interval") else np.zeros(n))
        return cls(tuple(throughput), tuple(memory), float(rng.normal(0.0, spread / 3)), spread / 6,
                   int(rng.integers(2**31)))

    def factors(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(throughput factor, memory factor) per row of knob codes."""
        log_t = sum(table[codes[:, k]] for k, table in enumerate(self.throughput))
        log_m = self.memory_task + sum(table[codes[:, k]] for k, table in enumerate(self.memory))
        # Per-config term: a deterministic draw per config (hash of its codes), so that it does not
        # depend on which configs are in the array.
        keys = (codes * np.array([1, 31, 997, 30011, 900001, 27000023])[:codes.shape[1]]).sum(axis=1)
        unit = np.random.default_rng(self.seed).normal(0.0, 1.0, 4096)
        log_t = log_t + self.per_config_sigma * unit[(keys + self.seed) % 4096]
        return np.exp(log_t), np.exp(log_m)


class DistortedBackend:
    """A backend over the true landscape of one task: `run(config)` like the simulated backend, with the
    distortion applied, and the noise-free optimum known."""

    name = "simulated"
    fatal: str | None = None  # no config can succeed here (Backend protocol)

    def __init__(self, landscape: Landscape, codes: np.ndarray, budget_bytes: int, distortion: Distortion,
                 noise: float, rng: np.random.Generator, trial_overhead_s: float = 15.0, measured_steps: int = 10):
        t_factor, m_factor = distortion.factors(codes)
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

    def with_noise_seed(self, seed: int) -> "DistortedBackend":
        """The same truth with its own stream of step-time noise."""
        other = copy.copy(self)
        other.rng = np.random.default_rng(seed)
        return other

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
            return TrialResult(config, "oom", peak_memory_bytes=peak, memory_budget_bytes=budget,
                               wall_time_s=self.trial_overhead_s, backend=self.name, error=why)
        samples = float(self.throughput[index])
        if self.noise:
            samples /= math.exp(self.noise * self.rng.standard_normal())
        step = self.workload.global_batch / samples
        return TrialResult(config, "ok", throughput_samples_per_s=samples,
                           tokens_per_s=samples * self.workload.model.seq_len, step_time_s=step,
                           peak_memory_bytes=peak, memory_budget_bytes=budget,
                           wall_time_s=self.trial_overhead_s + self.measured_steps * step, backend=self.name)


def distorted_task(task: Task, spread: float, noise: float, seed: int) -> DistortedBackend:
    """The distorted simulation of one task on its own (benchmarks): the same draw for the same seed."""
    space = Space(task.choices, task.workload, task.hardware)
    nominal = SimulatedBackend(task.workload, task.hardware, task.hardware.memory_bytes,
                               nvme_path=task.choices.nvme_path)
    landscape = build_landscape(space, nominal.estimate)
    if not len(landscape):
        raise ConfigError(f"the space has no valid config for {task.workload.model.name}")
    rng = np.random.default_rng(seed)
    return DistortedBackend(landscape, landscape.codes, task.memory_budget_bytes,
                            Distortion.draw(space, spread, rng), noise, rng)


class DistortedSource:
    """Episodes of the distorted simulation: `base`'s tasks (drawn by one of `samplers`, picked by weight,
    where there are several), each with a fresh hidden truth on the simulated backend (other backends'
    episodes are left as they are); starts as `base`'s, or `mixed`; and a flat info that judges the best
    config found by its true throughput."""

    def __init__(self, base: TaskSource, spread: float = 0.3, samplers: tuple[WorkloadSampler, ...] = (),
                 weights: np.ndarray | None = None, mixed_start: bool = False) -> None:
        self.base = base
        self.spread = spread
        self.samplers = samplers
        self.weights = weights if weights is not None else np.ones(len(samplers)) / max(1, len(samplers))
        self.mixed_start = mixed_start

    @property
    def caches(self) -> EstimatorCaches:
        return self.base.caches

    def episode(self, rng: np.random.Generator) -> Episode:
        sampler = None
        if len(self.samplers) > 1:
            sampler = self.samplers[int(rng.choice(len(self.samplers), p=self.weights))]
        episode = self.base.episode(rng, sampler)
        if self.base.config.kind != "simulated" or not isinstance(episode.backend, SimulatedBackend):
            return episode
        land = episode.landscape
        # A fresh hidden truth every episode (the base source caches episodes per task).
        distortion = Distortion.draw(land.space, self.spread, rng)
        backend = DistortedBackend(land, land.codes, episode.task.memory_budget_bytes, distortion,
                                   self.base.config.noise, rng)
        optimum = backend.optimum
        return replace(episode, backend=backend, optimum=optimum,
                       reference=optimum if optimum else episode.reference)

    def start(self, episode: Episode, rng: np.random.Generator) -> int:
        if self.mixed_start and rng.random() < MIXED_ESTIMATOR_SHARE:
            return start_index("estimator", episode, rng)
        return self.base.start(episode, rng)

    def info(self, episode: Episode, info: dict[str, Any], result: TrialResult | None) -> dict[str, Any]:
        """A flat info of numbers and strings with the same keys at every step: RLlib steps several copies
        of the environment as one gymnasium vector env, which merges infos key by key and cannot merge a
        None in one copy with a dict in another (the base environment's `result` and `best`)."""
        best = info.get("best")
        true_best = 0.0
        if best and isinstance(episode.backend, DistortedBackend):
            true_best = episode.backend.true_throughput(Config.from_dict(best["config"]))
        optimum = info.get("optimum_throughput")
        return {"trials": int(info["trials"]), "action": str(info["action"]),
                "status": "none" if result is None else result.status,
                "best_throughput": float(best["throughput_samples_per_s"]) if best else 0.0,
                "best_true_throughput": true_best,
                "optimum_throughput": float(optimum) if optimum else float("nan")}


def training_source(env_config: Mapping[str, Any] | None = None,
                    caches: EstimatorCaches | None = None) -> tuple[EnvConfig, DistortedSource]:
    """The environment's config and the distorted source of a training `env_config`: the environment's
    keys plus `randomize`, `samplers` and the start `mixed` (see TrainingEnv)."""
    config = dict(env_config or {})
    spread = float(config.pop("randomize", 0.3))
    if not math.isfinite(spread) or spread < 0:
        raise ConfigError(f"randomize={spread!r}: must be >= 0")
    start = config.get("start", "random")
    if start not in STARTS:
        raise ConfigError(f"start={start!r}: allowed {list(STARTS)}")
    mixed = start == "mixed"
    if mixed:
        config["start"] = "random"
    chosen: tuple[WorkloadSampler, ...] = ()
    weights = np.ones(0)
    if "samplers" in config:
        if "sampler" in config:
            raise ConfigError("give either sampler or samplers, not both")
        settings = [dict(s) for s in config.pop("samplers")]
        if not settings:
            raise ConfigError("samplers: needs at least one sampler's settings")
        weights = np.array([float(s.pop("weight", 1.0)) for s in settings])
        if (weights <= 0).any() or not np.isfinite(weights).all():
            raise ConfigError(f"samplers: weights {weights.tolist()} must be positive numbers")
        chosen = tuple(WorkloadSampler(**s) for s in settings)
        weights = weights / weights.sum()
        config["sampler"] = chosen[0]
    parsed = EnvConfig.from_dict(config)
    return parsed, DistortedSource(TaskSource(parsed, caches), spread, chosen, weights, mixed)


class TrainingEnv(DeepSpeedMemoryEnv):
    """`autotune/DeepSpeedMemory-v0` on the distorted simulation: the base environment with a
    DistortedSource (simulated backend only; other backends behave as in the base environment). Extra
    env_config keys: `randomize` (the spread s above, default 0.3; 0 turns the distortion off) and the
    start `mixed` (half the episodes at the estimator's best predicted config, half at random: inference
    starts at the former, training needs the latter to explore), and `samplers`: a list of
    WorkloadSampler settings, each with a `weight`, one of which draws each episode's task (e.g. GPU
    profiles on the default space and the CPU profile on cpu.yaml). `caches`: estimator caches shared
    with other copies (TrainingEnvFactory)."""

    source: DistortedSource

    def __init__(self, env_config: Mapping[str, Any] | None = None, render_mode: str | None = None, *,
                 caches: EstimatorCaches | None = None) -> None:
        config, source = training_source(env_config, caches)
        super().__init__(config, render_mode, source=source)


class TrainingEnvFactory:
    """Creates the environment copies of one RLlib env runner (`env=` of the algorithm config), sharing
    their estimator caches: every copy draws from the same task pool, and building a task's landscape
    (enumerating and estimating its space) costs far more than the episodes that use it. Each process
    gets its own caches (they are not pickled)."""

    def __init__(self) -> None:
        self._caches: EstimatorCaches | None = None

    def __call__(self, env_config: Mapping[str, Any] | None = None) -> TrainingEnv:
        env = TrainingEnv(env_config, caches=self._caches)
        if self._caches is None:
            self._caches = env.source.caches
        return env

    def __getstate__(self) -> dict[str, Any]:
        return {"_caches": None}
