"""Where the environment's episodes come from: an `EpisodeSource`.

At every reset `DeepSpeedMemoryEnv` asks its source for an `Episode` (the task, the backend its trials
run on, the estimator's view of its space, the reward's normaliser) and for the index of the start
config; at every step the source may add to the info what only it knows. Every random draw is made
from the generator the environment passes (its `np_random`), so a seeded environment repeats its
episodes.

`TaskSource` is the default source, what `env_config` describes: a fixed workload, tasks drawn by a
WorkloadSampler, or replay surfaces; the training simulator (autotune/rl/simulator.py) wraps it in a
source whose trials run on a hidden truth that differs from the estimator.

Building a task's landscape (enumerating and estimating its space) costs far more than an episode, so
landscapes and layouts are cached (`EstimatorCaches`, which several environment copies may share) and
so are the episodes of each task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from autotune.backends import Backend
from autotune.backends.factory import as_backend, deepspeed_backend, replay_backend, simulated_backend
from autotune.backends.replay import (ENV_KEYS, Surface, check_replay_workload, load_surface, surface_choices,
                                      surface_space)
from autotune.backends.simulated import SimulatedBackend
from autotune.values.config import Config, ConfigError
from autotune.trials.devices import resolve_hardware
from autotune.prediction.estimate import Estimate, estimate
from autotune.values.hardware import Hardware, load_hardware
from autotune.values.results import TrialResult
from autotune.values.settings import memory_budget
from autotune.search_spaces import default_choices
from autotune.values.space import Space
from autotune.values.workload import Workload

from autotune.envs import observation as obs
from autotune.envs.config import EnvConfig
from autotune.envs.landscape import Landscape, Layout, LruCache, build_landscape, build_layout, validity_key
from autotune.envs.sampler import Task, WorkloadSampler


@dataclass(frozen=True)
class Episode:
    """What one reset fixes: the task, how trials run, and the estimator's view of its space."""

    task: Task
    backend: Backend
    landscape: Landscape
    reference: float  # the reward's normaliser
    optimum: float | None  # the task's true best where known
    predicted_best: float
    static: np.ndarray  # per config: the observation's config, prediction and per-action blocks
    task_features: np.ndarray
    task_info: dict[str, Any]
    # The reward's unit of trial time (envs/reward.py `second_cost`): the predicted wall seconds of a trial of the
    # config predicted best (autotune.prediction.trial_time, every op built), so that a trial's price in seconds
    # reads alike for a 1M and a 70B model.
    seconds_unit: float = 1.0


def episode_of(task: Task, backend: Backend, land: Landscape, reference: float, optimum: float | None) -> Episode:
    """An Episode with its precomputed observation blocks."""
    if len(land) == 0:  # (a sampled task's, or another source's: TaskSource refuses its own when made)
        land.space.require_configs()
    budget = task.memory_budget_bytes
    predicted_best = land.predicted_best(budget)
    share = float(land.feasible(budget).mean())
    return Episode(task, backend, land, reference, optimum, predicted_best,
                   obs.config_blocks(land, budget, predicted_best), obs.task_features(task, share),
                   {**task.to_dict(), "backend": backend.name}, seconds_unit(task, land))


def seconds_unit(task: Task, land: Landscape) -> float:
    """The predicted wall seconds of a trial of the config predicted best within the budget (of all, if none fits):
    its `Landscape.trial_seconds`."""
    fits = land.feasible(task.memory_budget_bytes)
    throughput = np.where(fits, land.throughput, -np.inf) if fits.any() else land.throughput
    return max(float(land.trial_seconds[int(np.argmax(throughput))]), 1e-6)


class EpisodeSource(Protocol):
    """What the environment asks at reset and step. Draw only from `rng`."""

    def episode(self, rng: np.random.Generator) -> Episode:
        """The next episode's task, backend and landscape."""
        ...

    def start(self, episode: Episode, rng: np.random.Generator) -> int:
        """The index (in episode.landscape) of the config the episode starts at."""
        ...

    def info(self, episode: Episode, info: dict[str, Any], result: TrialResult | None) -> dict[str, Any]:
        """The info the environment returns, given its own (`result`: this step's trial, None if none ran)."""
        ...


def start_index(how: str, episode: Episode, rng: np.random.Generator) -> int:
    """The start config: "random", "default" (the space's default) or "estimator" (the best predicted to
    fit the budget, else the smallest predicted peak)."""
    land = episode.landscape
    if how == "random":
        return int(rng.integers(len(land)))
    if how == "default":
        return land.index[land.space.default()]
    fits = land.feasible(episode.task.memory_budget_bytes)
    if fits.any():
        return int(np.flatnonzero(fits)[np.argmax(land.throughput[fits])])
    return int(np.argmin(land.peak))


@dataclass
class EstimatorCaches:
    """The estimator's views, per (workload, hardware, space) and per validity key: shareable by the
    environment copies of one process (they are not pickled with a factory, see rl/simulator.py)."""

    landscapes: LruCache[Any]
    layouts: LruCache[Layout]

    @classmethod
    def sized(cls, size: int) -> "EstimatorCaches":
        return cls(LruCache(size), LruCache(size))


# -- the default source --------------------------------------------------------------------------------

class TaskSource:
    """The episodes `env_config` describes: replay surfaces (one drawn per episode), tasks drawn by a
    WorkloadSampler, or a fixed workload; budgets drawn from `memory_budget` where it lists several.
    A fixed workload's or a surface's space that holds no valid config is refused when the source is made."""

    def __init__(self, config: EnvConfig, caches: EstimatorCaches | None = None) -> None:
        self.config = config
        self.caches = caches if caches is not None else EstimatorCaches.sized(config.cache_size)
        # Per task: landscape, budget, backend; an evicted episode's backend is closed (a real one holds ranks).
        self.episodes: LruCache[Episode] = LruCache(config.cache_size, on_evict=self._close_backend)
        self.sampler = config.task_sampler()
        self.surfaces: tuple[Surface, ...] = tuple(load_surface(p) for p in config.surface) \
            if config.kind == "replay" else ()
        for surface in self.surfaces:  # another workload's or machine's measurements are refused here, not replayed
            check_replay_workload(surface, config.workload, config.hardware, names=ENV_KEYS)
        self._replay_spaces = {surface.path: self._replay_space(surface) for surface in self.surfaces}
        self._fixed = self._fixed_space() if config.workload is not None and config.kind != "replay" else None
        self._backend_object = as_backend(config.backend) if config.kind == "object" else None

    # -- EpisodeSource

    def episode(self, rng: np.random.Generator, sampler: WorkloadSampler | None = None) -> Episode:
        """The next episode (`sampler`: draw the task with this one instead of the configured one)."""
        config = self.config
        if config.kind == "replay":
            surface = self.surfaces[int(rng.integers(len(self.surfaces)))]
            space = self._replay_spaces[surface.path]
            budget = self._pick_budget(rng, space.hardware)
            episode = self.episodes.get(("replay", surface.path, budget),
                                        lambda: self._replay_episode(surface, space, budget))
        else:
            sampler = sampler if sampler is not None else self.sampler
            task = sampler.sample(rng) if sampler is not None else self._fixed_task(rng)
            key = (task.workload, repr(task.hardware), task.choices, task.memory_budget_bytes)
            build = self._simulated_episode if config.kind == "simulated" else self._estimator_episode
            episode = self.episodes.get(key, lambda: build(task))
        if isinstance(episode.backend, SimulatedBackend):
            episode.backend.reseed(rng)  # noise draws come from the environment's seeded generator
        return episode

    def start(self, episode: Episode, rng: np.random.Generator) -> int:
        return start_index(self.config.start, episode, rng)

    def info(self, episode: Episode, info: dict[str, Any], result: TrialResult | None) -> dict[str, Any]:
        return info

    def close(self) -> None:
        """Close every backend this source made (the environment's close()) and forget their episodes; a backend
        object given is closed too, as a sweep's end closes it."""
        self.episodes.clear()
        if self._backend_object is not None:
            self._backend_object.close()

    def _close_backend(self, episode: Episode) -> None:
        if episode.backend is not self._backend_object:  # the object given serves every episode until close()
            episode.backend.close()

    def task_backend(self, task: Task, surface: Surface | None = None) -> Backend:
        """The one place the environment builds a backend for a task: simulated (at the device's memory;
        an episode narrows it with `with_budget`), replay (of `surface`), the given object, or deepspeed."""
        config = self.config
        if config.kind == "simulated":
            return simulated_backend(task.workload, task.hardware, task.hardware.memory_bytes, config.noise,
                                     calibration=config.calibration, nvme_path=task.choices.nvme_path)
        if config.kind == "replay":
            assert surface is not None
            return replay_backend(surface, task.memory_budget_bytes)
        if self._backend_object is not None:
            return self._backend_object
        return deepspeed_backend(task.workload, memory_budget_bytes=task.memory_budget_bytes, hardware=task.hardware,
                                 **config.backend_options)  # (EnvConfig refuses options that these set)

    # -- tasks

    def _pick_budget(self, rng: np.random.Generator, hardware: Hardware) -> int:
        """One of the configured budgets, drawn; none configured: the sweep's own default (settings.memory_budget)."""
        budgets = self.config.memory_budget
        return memory_budget(budgets[int(rng.integers(len(budgets)))] if budgets else None, hardware)

    def _fixed_task(self, rng: np.random.Generator) -> Task:
        space = self._fixed
        assert space is not None
        return Task(space.workload, space.hardware, self._pick_budget(rng, space.hardware), space.choices)

    def _fixed_space(self) -> Space:
        """A fixed workload's space: the given one (else the hardware's default) on the given hardware (else cpu
        for tiny, a100-80gb for the rest)."""
        workload = self.config.workload
        assert workload is not None
        hardware, _ = resolve_hardware(self.config.hardware, real=False, model=workload.model.name)
        return Space(self.config.space or default_choices(hardware), workload, hardware).require_configs()

    def _replay_space(self, surface: Surface) -> Space:
        """A surface's measured configs within the given space (else the values it measured), on the given hardware
        (else its own)."""
        workload = self.config.workload or surface.workload
        if workload is None:
            raise ConfigError(f"surface {surface.path} does not record its workload: set env_config['workload']")
        hardware = self.config.hardware or load_hardware(surface.hardware or "cpu")
        choices = self.config.space or surface_choices(surface)
        return surface_space(surface, hardware, workload, choices).require_configs()

    # -- episodes per backend

    def _simulated_episode(self, task: Task) -> Episode:
        def build() -> tuple[Landscape, SimulatedBackend]:
            base = self.task_backend(task)
            assert isinstance(base, SimulatedBackend)
            return self._build_landscape(task, base.estimate), base  # primes the backend's predictions

        land, base = self.caches.landscapes.get(("simulated", task.workload, repr(task.hardware), task.choices),
                                                build)
        budget = task.memory_budget_bytes
        best = land.predicted_best(budget)
        # Without noise the simulated landscape is the estimator's: its best within budget is the optimum.
        optimum = best if land.feasible(budget).any() and not self.config.noise else None
        return episode_of(task, base.with_budget(budget), land, best, optimum)

    def _replay_episode(self, surface: Surface, space: Space, budget: int) -> Episode:
        workload, hardware, choices = space.workload, space.hardware, space.choices
        task = Task(workload, hardware, budget, choices)
        land = self.caches.landscapes.get(("replay", surface.path, workload, repr(hardware), choices),
                                          lambda: build_landscape(space, self._estimator(workload, hardware)))
        best = surface.best(budget)
        if best is not None:
            reference = optimum = float(best.throughput_samples_per_s or 0.0)
        else:  # nothing fits: scale by the best measured throughput regardless of the budget
            ran = [r.throughput_samples_per_s or 0.0 for r in surface.results.values() if r.ok]
            reference, optimum = (max(ran) if ran else land.predicted_best(budget)), None
        return episode_of(task, self.task_backend(task, surface), land, reference, optimum)

    def _estimator_episode(self, task: Task) -> Episode:
        """deepspeed and backend objects: the landscape is the estimator's; the optimum is unknown."""
        key = ("estimator", task.workload, repr(task.hardware), task.choices)
        land = self.caches.landscapes.get(key, lambda: self._build_landscape(
            task, self._estimator(task.workload, task.hardware)))
        backend = self.task_backend(task)
        reference = float(self.config.reference_throughput or land.predicted_best(task.memory_budget_bytes))
        return episode_of(task, backend, land, reference, None)

    def _build_landscape(self, task: Task, estimator: Callable[[Config], Estimate]) -> Landscape:
        """The task's landscape; valid configs and moves are worked out once per validity key."""
        space = Space(task.choices, task.workload, task.hardware)
        layout = self.caches.layouts.get(validity_key(space), lambda: build_layout(space))
        return build_landscape(space, estimator, layout)

    def _estimator(self, workload: Workload, hardware: Hardware) -> Callable[[Config], Estimate]:
        calibration = self.config.calibration
        return lambda config: estimate(config, workload, hardware, calibration)
