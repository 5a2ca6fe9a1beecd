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
estimator's predictions, exactly as on real hardware. Trials take GPU-like wall times (issue 41: the distorted
backend's `trial_times`, autotune.prediction.trial_time at the config's true step time, each op's first build
once per episode, the same noise level): the reward and the observation read none of it. The optimum (best
feasible true throughput, noise-free) is known by exhausting the space.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from autotune.values.config import Config, ConfigError
from autotune.envs.config import EnvConfig
from autotune.envs.deepspeed_memory import ABSENT, DeepSpeedMemoryEnv
from autotune.envs.episodes import Episode, EstimatorCaches, TaskSource, start_index
from autotune.envs.landscape import build_landscape
from autotune.envs.sampler import Task, WorkloadSampler
from autotune.backends.distorted import Distortion, DistortedBackend
from autotune.backends.factory import distorted_backend, simulated_backend
from autotune.backends.simulated import SimulatedBackend
from autotune.values.results import TrialResult
from autotune.values.space import Space

STARTS = ("random", "default", "estimator", "mixed")
MIXED_ESTIMATOR_SHARE = 0.5  # "mixed" starts: this share at the estimator's best, the rest at random


def distorted_task(task: Task, spread: float, noise: float, seed: int) -> DistortedBackend:
    """The distorted simulation of one task on its own (benchmarks): the same draw for the same seed."""
    space = Space(task.choices, task.workload, task.hardware)
    nominal = simulated_backend(task.workload, task.hardware, task.hardware.memory_bytes,
                                nvme_path=task.choices.nvme_path)
    landscape = build_landscape(space, nominal.estimate)
    if not len(landscape):
        raise ConfigError(f"the space has no valid config for {task.workload.model.name}")
    rng = np.random.default_rng(seed)
    return distorted_backend(landscape, landscape.codes, task.memory_budget_bytes,
                             Distortion.draw(space, spread, rng), noise, rng, trial_times=True)


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
        backend = distorted_backend(land, land.codes, episode.task.memory_budget_bytes, distortion,
                                    self.base.config.noise, rng, trial_times=True)
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
                "optimum_throughput": float(optimum) if optimum else ABSENT}


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
