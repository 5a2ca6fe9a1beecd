"""The typed configuration of `autotune/DeepSpeedMemory-v0`: `EnvConfig`.

The environment takes an `EnvConfig` or a plain `env_config` dict with the same keys (RLlib and
`gymnasium.make(..., env_config={...})` pass dicts): `EnvConfig.from_dict` checks the keys, and the
constructor normalises each value (a preset name to a Workload, a size string to bytes, a dict of
settings to a WorkloadSampler, ...) and raises a one-line ConfigError naming what is wrong.
"""

from __future__ import annotations

import inspect
import numbers
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from autotune.backends.factory import backend_names
from autotune.values.config import ConfigError
from autotune.prediction.estimate import Calibration
from autotune.values.hardware import Hardware, load_hardware
from autotune.search_spaces import load_choices
from autotune.values.space import Choices, parse_choices
from autotune.values.units import parse_size, shown
from autotune.values.workload import Workload, make_workload

from autotune.envs.reward import Reward
from autotune.envs.sampler import WorkloadSampler

BACKENDS = backend_names(sweep=None, env=True)  # the kinds the environment offers (the factory's flags)
# The deepspeed backend's arguments that the environment passes from its own keys (TaskSource.task_backend).
ENV_SET_OPTIONS = ("workload", "memory_budget_bytes", "hardware")
STARTS = ("random", "default", "estimator")
DEFAULT_SAMPLER = {"split": "train", "pool_size": 256}


@dataclass(frozen=True)
class EnvConfig:
    """What one environment tunes and how (all keys optional).

    backend         "simulated" (default) | "replay" | "deepspeed", or an object with `run(config) ->
                    TrialResult` (and optionally `name`, `fatal`, `close`, which the environment's close() calls:
                    autotune.backends.factory.as_backend adapts it; then workload, hardware and budget are required)
    workload        preset name, Workload, or {"model": preset | shape dict, "global_batch": n, "gpus": n};
                    without it the simulated backend draws tasks from the sampler
    sampler         WorkloadSampler or a dict of its settings (default: split "train", pool of 256 tasks)
    hardware        profile name, YAML path or Hardware (default: the surface's, cpu for tiny, else a100-80gb;
                    on replay, a hardware or workload other than the surface's is refused)
    memory_budget   bytes or a size like "2GiB", or a list of them drawn per episode (default: device memory)
    space           search-space preset name, YAML path, Choices, or a mapping of knob -> list of values (a
                    space YAML's content) (default: cpu on CPU hardware, else default; on replay, the surface's
                    measured values)
    surface         replay: a surface path, or a list of them drawn per episode
    horizon         steps per episode (default 16)
    start           "random" (default) | "default" (the space's default config) | "estimator" (best
                    predicted to fit, else the smallest predicted peak)
    noise           simulated: step-time noise sigma (default 0)
    calibration     Calibration or dict of its fields, for the simulated backend and the predictions
    reward          Reward or dict of envs/reward.py Reward fields
    observe_seconds the observation also carries each action's predicted trial seconds (envs/observation.py
                    SECONDS_FEATURES, after the base layout); a policy trained with it needs it (default False)
    mask_revisits   also mask edits to configs measured earlier in the episode (default False)
    flat_info       info as numbers and strings with the same keys at every step (the TrialResult and the
                    configs as JSON strings, -1 where a figure is unknown: ABSENT), as gymnasium's vector
                    environments and RLlib need (they merge infos key by key); default False
    chance_info     info carries `chance_of_better` (default True); ~16 ms a step of Monte Carlo draws, so
                    training, which never reads it, turns it off (autotune.rl.train)
    reference_throughput  object/deepspeed backends: the reward's normaliser instead of the estimator's best
    backend_options deepspeed: keyword arguments of DeepSpeedBackend but those the environment's keys set
                    (ENV_SET_OPTIONS); an unknown one is refused here. Its trial logs go to its `logs_dir`,
                    default "runs/logs" under the current directory
    cache_size      landscapes kept per environment (default 256)
    seed            seed of the first reset when reset() is given none: an integer >= 0 (default None)

    The fields hold the normalised values (Workload, WorkloadSampler, Hardware, Choices, bytes, ...);
    None means "not given". `sampler` stays None when the default sampler applies (`task_sampler()`).
    """

    backend: Any = "simulated"  # a name of BACKENDS or a backend object
    workload: Workload | None = None
    sampler: WorkloadSampler | None = None
    hardware: Hardware | None = None
    memory_budget: tuple[int, ...] = ()  # bytes; several: one drawn per episode
    space: Choices | None = None
    surface: tuple[str, ...] = ()
    horizon: int = 16
    start: str = "random"
    noise: float = 0.0
    calibration: Calibration = Calibration()
    reward: Reward = Reward()
    observe_seconds: bool = False
    mask_revisits: bool = False
    flat_info: bool = False
    chance_info: bool = True
    reference_throughput: float | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    cache_size: int = 256
    seed: int | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # the dataclass is frozen
            object.__setattr__(self, name, value)

        _positive_int(self.horizon, "horizon")
        if self.start not in STARTS:
            raise ConfigError(f"start={self.start!r}: allowed {list(STARTS)}")
        put("reward", self.reward if isinstance(self.reward, Reward) else Reward.from_dict(self.reward))
        put("mask_revisits", bool(self.mask_revisits))
        put("observe_seconds", bool(self.observe_seconds))
        put("flat_info", bool(self.flat_info))
        put("chance_info", bool(self.chance_info))
        put("calibration", _calibration(self.calibration))
        _positive_int(self.cache_size, "cache_size")
        put("seed", _seed(self.seed))
        backend = self.backend
        if not isinstance(backend, str):
            if not callable(getattr(backend, "run", None)):
                raise ConfigError(f"backend {backend!r}: allowed {list(BACKENDS)} or an object with name and run()")
        elif backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r}: allowed {list(BACKENDS)}")
        noise = self.noise
        if not isinstance(noise, (int, float)) or not 0 <= noise < float("inf"):
            raise ConfigError(f"noise={noise!r}: must be a number >= 0 (step-time noise sigma)")
        if self.kind != "simulated" and noise:
            raise ConfigError("noise applies to the simulated backend only")
        put("backend_options", _backend_options(self.kind, self.backend_options))
        reference = self.reference_throughput
        if reference is not None and not (isinstance(reference, (int, float)) and reference > 0):
            raise ConfigError(f"reference_throughput={reference!r}: must be a positive number")
        put("memory_budget", _budgets(self.memory_budget))
        if self.space is not None and not isinstance(self.space, Choices):
            put("space", _space(self.space))
        if self.hardware is not None and not isinstance(self.hardware, Hardware):
            put("hardware", load_hardware(str(self.hardware)))
        surface = self.surface
        put("surface", () if not surface else (str(surface),) if isinstance(surface, (str, os.PathLike)) else
            tuple(str(s) for s in surface))

        if self.kind == "replay":
            if not self.surface:
                raise ConfigError("the replay backend needs env_config['surface']: a surface JSONL path (or a list)")
            if self.workload is not None:
                put("workload", _workload(self.workload))
            return  # (a sampler is not used on replay)
        if self.workload is not None:
            put("workload", _workload(self.workload))
        elif self.kind == "simulated":
            if self.sampler is not None and not isinstance(self.sampler, WorkloadSampler):
                put("sampler", _sampler(self.sampler))
        else:
            raise ConfigError(f"the {self.kind} backend needs env_config['workload']")
        if self.draws_tasks and (self.memory_budget or self.hardware or self.space):
            raise ConfigError("memory_budget, hardware and space come from the sampler: set them in its settings")
        if self.sampler is not None and not self.draws_tasks:
            raise ConfigError("sampler applies to the simulated backend without a fixed workload")

    # -- derived -----------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """The backend's kind: a name of BACKENDS, or "object" for a backend object."""
        return self.backend if isinstance(self.backend, str) else "object"

    @property
    def draws_tasks(self) -> bool:
        """Each episode's task comes from a WorkloadSampler (simulated backend without a fixed workload)."""
        return self.kind == "simulated" and self.workload is None

    def task_sampler(self) -> WorkloadSampler | None:
        """The sampler that draws the tasks: the given one or the default (None: a fixed workload or replay)."""
        if not self.draws_tasks:
            return None
        return self.sampler if self.sampler is not None else _sampler(DEFAULT_SAMPLER)

    # -- dicts -------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "EnvConfig":
        """An `env_config` dict (unknown keys are an error)."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(CONFIG_KEYS))
        if unknown:
            raise ConfigError(f"unknown env_config key(s) {unknown}: allowed {list(CONFIG_KEYS)}")
        # A key given as None is "not given", except where None is no value at all (as ever).
        if "workload" in data and data["workload"] is None:
            _workload(None)
        if "sampler" in data and data["sampler"] is None:
            _sampler(None)
        return cls(**data)

    @classmethod
    def of(cls, value: "EnvConfig | Mapping[str, Any] | None") -> "EnvConfig":
        """`value` itself, or the EnvConfig of an `env_config` dict (None: all defaults)."""
        if isinstance(value, EnvConfig):
            return value
        if value is None or isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ConfigError(f"env_config {value!r}: expected an EnvConfig or a dict")

    def to_dict(self) -> dict[str, Any]:
        """The keys that differ from the defaults, with their normalised values (`from_dict` takes it back)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if callable(f.default_factory) else f.default
            if value is not None and value != default:
                out[f.name] = value
        return out


CONFIG_KEYS = tuple(f.name for f in fields(EnvConfig))


# -- values ----------------------------------------------------------------------------------------

def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r}: must be a positive integer")
    return value


def _seed(value: Any) -> int | None:
    """None, or an integer >= 0 (numpy's too) as gymnasium's reset(seed=...) takes it."""
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"seed={shown(value)}: allowed an integer >= 0 or None")
    return int(value)


def _space(value: Any) -> Choices:
    """Choices from a preset name or YAML path (search_spaces.load_choices), or from a mapping of knob -> list of
    values, as a space YAML holds (values.space.parse_choices)."""
    if isinstance(value, Mapping):
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
        return parse_choices(data, "env_config['space']")
    if isinstance(value, (str, os.PathLike)):
        return load_choices(value if isinstance(value, str) else Path(value))
    raise ConfigError(f"space {shown(value)}: allowed a preset name, a YAML file path, a mapping of knob -> list of "
                      f"values, or Choices")


def _workload(value: Any) -> Workload:
    if isinstance(value, Workload):
        return value
    if isinstance(value, str):
        return make_workload(value)
    if isinstance(value, Mapping):
        try:
            return Workload.from_dict(dict(value))
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


def _backend_options(kind: str, options: Any) -> dict[str, Any]:
    """deepspeed: keyword arguments of DeepSpeedBackend, the names read from its signature, refused here rather than
    as a TypeError at the first reset."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"backend_options {shown(options)}: allowed a dict of DeepSpeedBackend keyword arguments")
    if not options:
        return {}
    if kind != "deepspeed":
        raise ConfigError(f"backend_options applies to the deepspeed backend only, not backend={kind!r}")
    from autotune.backends.deepspeed import DeepSpeedBackend  # only its signature: imported where it is used

    allowed = [n for n in inspect.signature(DeepSpeedBackend).parameters if n not in ENV_SET_OPTIONS]
    unknown = sorted(set(options) - set(allowed), key=str)
    if set(unknown) & set(ENV_SET_OPTIONS):
        raise ConfigError(f"backend_options key(s) {unknown}: the environment sets {list(ENV_SET_OPTIONS)} from "
                          f"env_config's workload, memory_budget and hardware; allowed {allowed}")
    if unknown:
        raise ConfigError(f"unknown backend_options key(s) {unknown}: allowed {allowed}")
    return dict(options)


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
