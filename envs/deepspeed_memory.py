"""`autotune/DeepSpeedMemory-v0`: tune one workload's DeepSpeed memory config under a memory budget,
one trial per step.

Episode. `reset` picks a task (a fixed workload, one drawn by the workload sampler, or a replay
surface) and a start config (not yet measured). Each `step` applies an action (envs/actions.py): an
edit of the current config, or a `jump` to the best unmeasured config of the predictions corrected by
the episode's trials (envs/residuals.py), followed by one trial of the new config through the backend;
`run` (a trial of the current config); or `stop`. The episode terminates on `stop` and is truncated after
`horizon` steps.

Observation: `{"observations": float32 vector (envs/observation.py FEATURES), "action_mask": float32
0/1 per action}` (the layout of RLlib's action-masking examples). The mask forbids edits that lead to
configs invalid for the task (Space.invalid_reason) or, on replay, not measured in the surface;
`run` once the current config was measured; `stop` before any trial.

Reward: envs/reward.py. `info`: `result` (the TrialResult as a dict, None when nothing ran), `config`
(current), `best` (the episode's best feasible config, throughput, peak and step, or None), `trials`,
`action`, `invalid_action`, `task`, `reference_throughput` (the reward's normaliser) and
`optimum_throughput` (the task's true best where known: simulated without noise, replay; else None).

env_config keys (all optional):
    backend         "simulated" (default) | "replay" | "deepspeed", or an object with `name` and
                    `run(config) -> TrialResult` (then workload, hardware and budget are required)
    workload        preset name, Workload, or {"model": preset | shape dict, "global_batch": n, "gpus": n};
                    without it the simulated backend draws tasks from the sampler
    sampler         WorkloadSampler or a dict of its settings (default: split "train", pool of 256 tasks)
    hardware        profile name, YAML path or Hardware (default: the surface's, cpu for tiny, else a100-80gb)
    memory_budget   bytes or a size like "2GiB", or a list of them drawn per episode (default: device memory)
    space           search-space preset, YAML path or Choices (default: cpu on CPU hardware, else default;
                    on replay, the surface's measured values)
    surface         replay: a surface path, or a list of them drawn per episode
    horizon         steps per episode (default 16)
    start           "random" (default) | "default" (the space's default config) | "estimator" (best
                    predicted to fit, else the smallest predicted peak)
    noise           simulated: step-time noise sigma (default 0)
    calibration     Calibration or dict of its fields, for the simulated backend and the predictions
    reward          dict of envs/reward.py Reward fields
    mask_revisits   also mask edits to configs measured earlier in the episode (default False)
    flat_info       info as numbers and strings with the same keys at every step (the TrialResult and the
                    configs as JSON strings, NaN where unknown), as gymnasium's vector environments and
                    RLlib need (they merge infos key by key); default False
    reference_throughput  object/deepspeed backends: the reward's normaliser instead of the estimator's best
    backend_options deepspeed: keyword arguments of DeepSpeedBackend
    cache_size      landscapes kept per environment (default 256)
    seed            seed of the first reset when reset() is given none
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import gymnasium as gym
import numpy as np

from autotune.backends import Backend
from autotune.backends.factory import as_backend
from autotune.backends.replay import ReplayBackend, Surface, load_surface, surface_choices, surface_space
from autotune.backends.simulated import SimulatedBackend
from autotune.config import KNOBS, Config, ConfigError
from autotune.estimate import Calibration, Estimate, estimate
from autotune.hardware import Hardware, PROFILES, load_hardware
from autotune.results import TrialResult
from autotune.search_spaces import load_choices
from autotune.space import Choices, Space
from autotune.units import parse_size
from autotune.workload import Workload, make_workload

from autotune.envs import observation as obs
from autotune.envs.actions import ACTIONS, FIRST_EDIT, JUMP, RUN, STOP
from autotune.envs.landscape import Landscape, Layout, LruCache, build_landscape, build_layout, validity_key
from autotune.envs.residuals import Residuals
from autotune.envs.reward import Reward
from autotune.envs.sampler import Task, WorkloadSampler

BACKENDS = ("simulated", "replay", "deepspeed")
STARTS = ("random", "default", "estimator")
CONFIG_KEYS = ("backend", "workload", "sampler", "hardware", "memory_budget", "space", "surface", "horizon", "start",
               "noise", "calibration", "reward", "mask_revisits", "flat_info", "reference_throughput", "backend_options",
               "cache_size", "seed")
DEFAULT_SAMPLER = {"split": "train", "pool_size": 256}


@dataclass(frozen=True)
class Episode:
    """What one reset fixes: the task, how trials run, and the estimator's view of its space."""

    task: Task
    backend: Backend
    landscape: Landscape
    reference: float
    optimum: float | None
    predicted_best: float
    static: np.ndarray  # per config: the observation's config, prediction and per-action blocks
    task_features: np.ndarray
    task_info: dict[str, Any]


class DeepSpeedMemoryEnv(gym.Env):
    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, env_config: Mapping[str, Any] | None = None, render_mode: str | None = None) -> None:
        config = dict(env_config or {})
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise ConfigError(f"unknown env_config key(s) {unknown}: allowed {list(CONFIG_KEYS)}")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ConfigError(f"render_mode={render_mode!r}: allowed {self.metadata['render_modes']}")
        self.render_mode = render_mode
        self.horizon = _positive_int(config.get("horizon", 16), "horizon")
        self.start = config.get("start", "random")
        if self.start not in STARTS:
            raise ConfigError(f"start={self.start!r}: allowed {list(STARTS)}")
        self.reward_spec = config["reward"] if isinstance(config.get("reward"), Reward) else \
            Reward.from_dict(config.get("reward"))
        self.mask_revisits = bool(config.get("mask_revisits", False))
        self.flat_info = bool(config.get("flat_info", False))
        self.calibration = _calibration(config.get("calibration"))
        self._seed = config.get("seed")
        cache_size = _positive_int(config.get("cache_size", 256), "cache_size")
        self._landscapes: LruCache[Any] = LruCache(cache_size)  # per (workload, hardware, space)
        self._episodes: LruCache[Episode] = LruCache(cache_size)  # per task: landscape, budget and backend
        self._layouts: LruCache[Layout] = LruCache(cache_size)  # per validity_key
        self._setup_tasks(config)

        self.action_space = gym.spaces.Discrete(len(ACTIONS))
        self.observation_space = gym.spaces.Dict({
            "observations": gym.spaces.Box(-1.0, 1.0, (obs.SIZE,), np.float32),
            "action_mask": gym.spaces.Box(0.0, 1.0, (len(ACTIONS),), np.float32),
        })
        self._episode: Episode | None = None

    # -- configuration ------------------------------------------------------------------------------

    def _setup_tasks(self, config: dict[str, Any]) -> None:
        backend = config.get("backend", "simulated")
        self._backend_object: Backend | None = None
        if not isinstance(backend, str):
            if not callable(getattr(backend, "run", None)):
                raise ConfigError(f"backend {backend!r}: allowed {list(BACKENDS)} or an object with name and run()")
            self._backend_object, backend = as_backend(backend), "object"
        elif backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r}: allowed {list(BACKENDS)}")
        self.backend_kind = backend
        self._noise = config.get("noise", 0.0)
        if not isinstance(self._noise, (int, float)) or not 0 <= self._noise < float("inf"):
            raise ConfigError(f"noise={self._noise!r}: must be a number >= 0 (step-time noise sigma)")
        if backend != "simulated" and self._noise:
            raise ConfigError("noise applies to the simulated backend only")
        self._backend_options = dict(config.get("backend_options") or {})
        self._reference_override = config.get("reference_throughput")
        if self._reference_override is not None and not (isinstance(self._reference_override, (int, float))
                                                          and self._reference_override > 0):
            raise ConfigError(f"reference_throughput={self._reference_override!r}: must be a positive number")
        self._budgets = _budgets(config.get("memory_budget"))
        self._surfaces: tuple[Surface, ...] = ()
        self._sampler: WorkloadSampler | None = None
        self._workload: Workload | None = None
        space = config.get("space")
        self._choices: Choices | None = space if isinstance(space, Choices) else \
            (load_choices(space) if space is not None else None)
        hardware = config.get("hardware")
        self._hardware: Hardware | None = hardware if isinstance(hardware, Hardware) or hardware is None else \
            load_hardware(str(hardware))

        if backend == "replay":
            paths = config.get("surface")
            if not paths:
                raise ConfigError("the replay backend needs env_config['surface']: a surface JSONL path (or a list)")
            self._surfaces = tuple(load_surface(p) for p in ([paths] if isinstance(paths, str) else paths))
            if "workload" in config:
                self._workload = _workload(config["workload"])
            return
        if "workload" in config:
            self._workload = _workload(config["workload"])
        elif backend == "simulated":
            sampler = config.get("sampler", DEFAULT_SAMPLER)
            self._sampler = sampler if isinstance(sampler, WorkloadSampler) else _sampler(sampler)
        else:
            raise ConfigError(f"the {backend} backend needs env_config['workload']")
        if self._sampler is not None and (self._budgets or self._hardware or self._choices):
            raise ConfigError("memory_budget, hardware and space come from the sampler: set them in its settings")
        if "sampler" in config and self._sampler is None:
            raise ConfigError("sampler applies to the simulated backend without a fixed workload")

    # -- gymnasium API ------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is None and self._episode is None and self._seed is not None:
            seed = int(self._seed)
        super().reset(seed=seed)
        self._episode = self._new_episode()
        land = self._episode.landscape
        self._current = self._start_index(land)
        self._measured = np.zeros(len(land), dtype=bool)
        self._steps = 0
        self._trials = 0
        self._best_throughput = 0.0
        self._best_before = 0.0
        self._best: dict[str, Any] | None = None
        self._best_index = -1
        self._last: TrialResult | None = None
        self._residuals = Residuals(land)
        self.allowed = np.ones(len(land), dtype=bool)  # configs `jump` may go to (a caller may narrow them)
        return self._observation(), self._info(None, "reset", False)

    def step(self, action: Any):
        if self._episode is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        ep = self._episode
        action = int(action)
        mask = self._mask_now
        self._steps += 1
        terminated, result, invalid = False, None, False
        if not 0 <= action < len(ACTIONS) or not mask[action]:
            reward, invalid = -self.reward_spec.invalid_action_penalty, True
        elif action == STOP:
            reward = self.reward_spec.stop(self._best_throughput, ep.reference, self.horizon - self._steps + 1)
            terminated = True
        else:
            if action == JUMP:
                self._current = self._jump
            elif action != RUN:
                self._current = int(ep.landscape.moves[self._current, action])
            result = self._trial(self._current)
            reward = self.reward_spec.trial(result, ep.task.memory_budget_bytes, ep.reference, self._best_before)
        truncated = not terminated and self._steps >= self.horizon
        name = ACTIONS[action] if 0 <= action < len(ACTIONS) else str(action)
        return self._observation(), float(reward), terminated, truncated, self._info(result, name, invalid)

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self._episode is None:
            return None
        config = self._episode.landscape.configs[self._current]
        last = self._last
        status = "-" if last is None else f"{last.status} {last.throughput_samples_per_s or 0:.4g} samples/s"
        best = "-" if self._best is None else f"{self._best['throughput_samples_per_s']:.4g} samples/s"
        return f"step {self._steps}/{self.horizon} {config.label()}: {status}; best {best}"

    # -- episode mechanics --------------------------------------------------------------------------

    def _trial(self, index: int) -> TrialResult:
        ep = self._episode
        assert ep is not None
        config = ep.landscape.configs[index]
        budget = ep.task.memory_budget_bytes
        result = ep.backend.run(config).under_budget(budget)
        self._residuals.observe(index, result, budget)
        self._measured[index] = True
        self._trials += 1
        self._last = result
        self._best_before = self._best_throughput
        if result.fits(budget) and (result.throughput_samples_per_s or 0.0) > self._best_throughput:
            self._best_throughput = float(result.throughput_samples_per_s or 0.0)
            self._best_index = index
            self._best = {"config": config.to_dict(), "throughput_samples_per_s": self._best_throughput,
                          "peak_memory_bytes": result.peak_memory_bytes, "step": self._steps}
        return result

    def _mask(self) -> np.ndarray:
        ep = self._episode
        assert ep is not None
        mask = ep.landscape.edit_mask[self._current].copy()
        if self.mask_revisits:
            moves = ep.landscape.moves[self._current, FIRST_EDIT:]
            mask[FIRST_EDIT:] *= ~self._measured[moves]
        mask[RUN] = float(not self._measured[self._current])
        mask[JUMP] = float(self._jump >= 0)
        mask[STOP] = float(self._trials > 0)
        return mask

    def _observation(self) -> dict[str, np.ndarray]:
        ep = self._episode
        assert ep is not None
        land, budget, cur = ep.landscape, ep.task.memory_budget_bytes, self._current
        vector = np.zeros(obs.SIZE, dtype=np.float32)
        vector[obs.TASK_AT:obs.CONFIG_AT] = ep.task_features
        vector[obs.CONFIG_AT:obs.RESULT_AT] = ep.static[cur]
        last = self._last
        vector[obs.RESULT_AT + obs.STATUS_SLOT["none" if last is None else last.status]] = 1.0
        at = obs.RESULT_AT + len(obs.STATUS_SLOT)
        if last is not None:
            measured = last.throughput_samples_per_s or 0.0
            if self._best_throughput > 0:
                vector[at] = min(1.0, measured / self._best_throughput)
            if last.peak_memory_bytes is not None:
                vector[at + 1] = obs.ratio_feature(float(last.peak_memory_bytes), budget, 4.0)
                vector[at + 3] = obs.ratio_feature(float(last.peak_memory_bytes), float(land.peak[cur]))
            if measured > 0:
                vector[at + 2] = obs.ratio_feature(measured, float(land.throughput[cur]))
        e = obs.EPISODE_AT
        vector[e] = (self.horizon - self._steps) / self.horizon
        vector[e + 1] = self._trials / self.horizon
        vector[e + 2] = float(self._best is not None)
        vector[e + 3] = float(self._best_index == cur)
        vector[e + 4] = min(1.0, self._best_throughput / ep.predicted_best / 2)
        vector[e + 5] = float(self._measured[cur])
        self._jump_features(vector)
        self._mask_now = self._mask()
        return {"observations": vector, "action_mask": self._mask_now.copy()}

    def _jump_features(self, vector: np.ndarray) -> None:
        """Where `jump` leads (self._jump, -1 if nowhere) and its corrected predictions in the observation."""
        ep = self._episode
        assert ep is not None
        budget, model = ep.task.memory_budget_bytes, self._residuals
        candidates = model.fits(budget) & ~self._measured & self.allowed & ep.landscape.host_fits
        log_throughput = model.log_throughput()
        self._jump = int(np.argmax(np.where(candidates, log_throughput, -np.inf)))
        if not candidates[self._jump]:
            self._jump = -1
            return
        throughput = math.exp(log_throughput[self._jump])
        block = obs.ACTIONS_AT + JUMP * len(obs.PREDICTION_NAMES)
        vector[block] = obs.ratio_feature(model.peak_at(self._jump), budget, 4.0)
        vector[block + 1] = min(1.0, throughput / ep.predicted_best / 2)
        if self._best_throughput > 0:
            vector[obs.EPISODE_AT + 6] = obs.ratio_feature(throughput, self._best_throughput)

    def _info(self, result: TrialResult | None, action: str, invalid: bool) -> dict[str, Any]:
        ep = self._episode
        assert ep is not None
        current = ep.landscape.configs[self._current]
        if self.flat_info:
            return self._flat_info(result, action, invalid, current)
        config = {k: getattr(current, k) for k in KNOBS}
        return {"result": None if result is None else _result_dict(result, config),
                "config": config,
                "best": None if self._best is None else dict(self._best),
                "trials": self._trials, "action": action, "invalid_action": invalid,
                "task": ep.task_info, "reference_throughput": ep.reference,
                "optimum_throughput": ep.optimum}

    def _flat_info(self, result: TrialResult | None, action: str, invalid: bool, current: Config) -> dict[str, Any]:
        """Same keys and value types at every step (vector environments merge infos key by key)."""
        ep = self._episode
        assert ep is not None
        nan = float("nan")
        best = self._best
        return {"trials": self._trials, "action": action, "invalid_action": invalid,
                "status": "none" if result is None else result.status,
                "throughput_samples_per_s": nan if result is None else float(result.throughput_samples_per_s or nan),
                "peak_memory_bytes": nan if result is None or result.peak_memory_bytes is None
                else float(result.peak_memory_bytes),
                "config": current.to_json(), "result": "" if result is None else result.to_json(),
                "best_throughput": self._best_throughput,
                "best_config": "" if best is None else json.dumps(best["config"]),
                "reference_throughput": float(ep.reference),
                "optimum_throughput": nan if ep.optimum is None else float(ep.optimum)}

    def _start_index(self, land: Landscape) -> int:
        if self.start == "random":
            return int(self.np_random.integers(len(land)))
        if self.start == "default":
            return land.index[land.space.default()]
        assert self._episode is not None
        fits = land.feasible(self._episode.task.memory_budget_bytes)
        if fits.any():
            return int(np.flatnonzero(fits)[np.argmax(land.throughput[fits])])
        return int(np.argmin(land.peak))

    # -- tasks --------------------------------------------------------------------------------------

    def _new_episode(self) -> Episode:
        rng = self.np_random
        if self.backend_kind == "replay":
            surface = self._surfaces[int(rng.integers(len(self._surfaces)))]
            hardware = self._hardware or load_hardware(surface.hardware or "cpu")
            budget = self._pick_budget(rng, hardware.memory_bytes)
            episode = self._episodes.get(("replay", surface.path, budget),
                                         lambda: self._replay_episode(surface, hardware, budget))
        else:
            task = self._sampler.sample(rng) if self._sampler is not None else self._fixed_task(rng)
            key = (task.workload, repr(task.hardware), task.choices, task.memory_budget_bytes)
            build = self._simulated_episode if self.backend_kind == "simulated" else self._other_episode
            episode = self._episodes.get(key, lambda: build(task))
        if isinstance(episode.backend, SimulatedBackend):
            episode.backend.reseed(rng)  # noise draws come from the environment's seeded generator
        return episode

    def _pick_budget(self, rng: np.random.Generator, default: int) -> int:
        if not self._budgets:
            return default
        return self._budgets[int(rng.integers(len(self._budgets)))]

    def _fixed_task(self, rng: np.random.Generator) -> Task:
        workload = self._workload
        assert workload is not None
        hardware = self._hardware or PROFILES["cpu" if workload.model.name == "tiny" else "a100-80gb"]
        if self._choices is None:
            self._choices = load_choices("cpu" if hardware.is_cpu else "default")
        return Task(workload, hardware, self._pick_budget(rng, hardware.memory_bytes), self._choices)

    def _simulated_episode(self, task: Task) -> Episode:
        def build() -> tuple[Landscape, SimulatedBackend]:
            base = SimulatedBackend(task.workload, task.hardware, task.hardware.memory_bytes, self._noise,
                                    calibration=self.calibration, nvme_path=task.choices.nvme_path)
            return self._build_landscape(task, base.estimate), base  # primes the backend's predictions

        land, base = self._landscapes.get(("simulated", task.workload, repr(task.hardware), task.choices), build)
        budget = task.memory_budget_bytes
        best = land.predicted_best(budget)
        # Without noise the simulated landscape is the estimator's: its best within budget is the optimum.
        optimum = best if land.feasible(budget).any() and not self._noise else None
        return self._episode_of(task, base.with_budget(budget), land, best, optimum)

    def _replay_episode(self, surface: Surface, hardware: Hardware, budget: int) -> Episode:
        choices = self._choices or surface_choices(surface)
        workload = self._workload or surface.workload
        if workload is None:
            raise ConfigError(f"surface {surface.path} does not record its workload: set env_config['workload']")
        task = Task(workload, hardware, budget, choices)
        land = self._landscapes.get(("replay", surface.path, workload, repr(hardware), choices), lambda: build_landscape(
            surface_space(surface, hardware, workload, choices), self._estimator(workload, hardware)))
        best = surface.best(budget)
        if best is not None:
            reference = optimum = float(best.throughput_samples_per_s or 0.0)
        else:  # nothing fits: scale by the best measured throughput regardless of the budget
            ran = [r.throughput_samples_per_s or 0.0 for r in surface.results.values() if r.ok]
            reference, optimum = (max(ran) if ran else land.predicted_best(budget)), None
        return self._episode_of(task, ReplayBackend(surface, budget), land, reference, optimum)

    def _other_episode(self, task: Task) -> Episode:
        key = ("estimator", task.workload, repr(task.hardware), task.choices)
        land = self._landscapes.get(key, lambda: self._build_landscape(
            task, self._estimator(task.workload, task.hardware)))
        backend = self._backend_object
        if backend is None:
            from autotune.backends.deepspeed import DeepSpeedBackend  # imports torch: only when asked for

            options = {"hardware": task.hardware, **self._backend_options}
            backend = DeepSpeedBackend(task.workload, memory_budget_bytes=task.memory_budget_bytes, **options)
        reference = float(self._reference_override or land.predicted_best(task.memory_budget_bytes))
        return self._episode_of(task, backend, land, reference, None)

    def _build_landscape(self, task: Task, estimator: Callable[[Config], Estimate]) -> Landscape:
        """The task's landscape; valid configs and moves are worked out once per validity key."""
        space = Space(task.choices, task.workload, task.hardware)
        return build_landscape(space, estimator, self._layouts.get(validity_key(space), lambda: build_layout(space)))

    def _estimator(self, workload: Workload, hardware: Hardware) -> Callable[[Config], Estimate]:
        calibration = self.calibration
        return lambda config: estimate(config, workload, hardware, calibration)

    def _episode_of(self, task: Task, backend: Backend, land: Landscape, reference: float,
                    optimum: float | None) -> Episode:
        budget = task.memory_budget_bytes
        predicted_best = land.predicted_best(budget)
        if len(land) == 0:
            raise ConfigError(f"the space has no valid config for {task.workload.model.name} on {task.hardware.name}")
        share = float(land.feasible(budget).mean())
        return Episode(task, backend, land, reference, optimum, predicted_best,
                       obs.config_blocks(land, budget, predicted_best), obs.task_features(task, share),
                       {**task.to_dict(), "backend": backend.name})


RESULT_FIELDS = tuple(f.name for f in fields(TrialResult) if f.name not in ("config", "extra"))


def _result_dict(result: TrialResult, config: dict[str, Any]) -> dict[str, Any]:
    """TrialResult.to_dict() with the config's dict precomputed (asdict dominated the step time)."""
    out: dict[str, Any] = {"config": dict(config)}
    for name in RESULT_FIELDS:
        out[name] = getattr(result, name)
    out.update(result.extra)
    return out


# -- env_config parsing ------------------------------------------------------------------------------

def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r}: must be a positive integer")
    return value


def _workload(value: Any) -> Workload:
    if isinstance(value, Workload):
        return value
    if isinstance(value, str):
        return make_workload(value)
    if isinstance(value, Mapping):
        try:
            return Workload.from_dict(value)
        except (KeyError, TypeError) as err:
            raise ConfigError(f"workload {dict(value)!r}: {err}; expected model, global_batch, gpus") from None
    raise ConfigError(f"workload {value!r}: expected a preset name, a Workload or a dict")


def _sampler(settings: Any) -> WorkloadSampler:
    if not isinstance(settings, Mapping):
        raise ConfigError(f"sampler {settings!r}: expected a WorkloadSampler or a dict of its settings")
    allowed = [f.name for f in fields(WorkloadSampler) if f.init]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown sampler setting(s) {unknown}: allowed {allowed}")
    values = {**DEFAULT_SAMPLER, **settings}
    for key in ("profiles", "held_out_profiles", "budget_fractions", "held_out_budget_fractions",
                "held_out_presets", "gpu_counts"):
        if key in values:  # lists from JSON/YAML settings
            values[key] = tuple(values[key])
    return WorkloadSampler(**values)


def _budgets(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    try:
        return tuple(parse_size(v) for v in values)
    except ValueError as err:
        raise ConfigError(f"memory_budget: {err}") from None


def _calibration(value: Any) -> Calibration:
    if value is None:
        return Calibration()
    if isinstance(value, Calibration):
        return value
    if isinstance(value, Mapping):
        allowed = [f.name for f in fields(Calibration)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown calibration key(s) {unknown}: allowed {allowed}")
        return Calibration(**value)
    raise ConfigError(f"calibration {value!r}: expected a Calibration or a dict of its fields")

