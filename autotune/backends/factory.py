"""The one place a backend is built: a registry of backend kinds, each a builder from the sweep's settings,
and the constructors of the backend classes (nothing outside `autotune/backends/` calls a backend class:
tests/test_architecture.py). `autotune tune`, `autotune sweep`, `autotune surface record` and the Ray driver's
workers call `make_backend`; what builds a backend from other inputs (`autotune trial`, script mode's first
trial, a shipped script on a Ray node, the Gymnasium environment with its step-time noise, calibration and
loaded surface, the distorted simulation of RL training) calls the kind's constructor here
(`deepspeed_backend`, `script_backend`, `simulated_backend`, `replay_backend`, `distorted_backend`). Which
kinds each front end offers is read from the registry's flags (`backend_names`), never listed beside it.
A user adds a kind with `register_backend`, or hands the library any object with `run(config) -> TrialResult`
(`as_backend` adapts it).
"""

from __future__ import annotations

import os
import re
import time
from importlib import import_module
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from autotune.backends import Backend
from autotune.files import short
from autotune.values.argtypes import given_path, takes
from autotune.values.config import Config, ConfigError
from autotune.values.results import TrialResult

if TYPE_CHECKING:
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.backends.distorted import DistortedBackend
    from autotune.backends.replay import ReplayBackend
    from autotune.backends.script import ScriptBackend
    from autotune.backends.simulated import SimulatedBackend
    from autotune.values.settings import RunSettings
    from autotune.worker.measure import MeasureSettings


@dataclass(frozen=True)
class TrialOptions:
    """How real trials run, beyond the sweep's settings: where their logs go and how long they take."""

    logs_dir: str | None = None  # default: the run directory's logs/
    timeout_s: float | None = None  # default: the backend's
    measure: "MeasureSettings | None" = None  # default: the backend's
    sleep_s: float = 0.0  # tests and benchmarks: every trial also takes this long
    # The backend runs trials one after another on this machine (a local sweep's loop, `surface record`): the next
    # trial's ranks start ahead from its first trial (autotune.trials.runner.Spares). Otherwise from its second: a
    # Ray task's backend runs one trial.
    in_sequence: bool = False


class RunHome(Protocol):
    """What a builder reads of the sweep's run directory (autotune.search.rundir.RunDir, a layer above): the folder
    (a script sweep's script.json) and where trial logs go."""

    @property
    def path(self) -> Path: ...

    @property
    def logs_dir(self) -> Path: ...


Builder = Callable[["RunSettings", "RunHome | None", TrialOptions], Backend]


KIND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a name `--backend` takes, and run.json keeps


@dataclass(frozen=True)
class BackendKind:
    name: str
    build: Builder
    real: bool = False  # its trials run on devices: Ray asks for them, the machine is checked first
    sweep: bool = True  # `autotune tune --backend` and sweep files offer it (script mode has --script instead)
    measures: bool = False  # it measures configs itself: `autotune surface record` offers it (not a replay)
    env: bool = False  # the Gymnasium environment offers it (`EnvConfig.backend`)
    train: bool = False  # RL training runs on it (`autotune rl train --backend`)
    ships: bool = False  # its trials need the sweep's own files on a Ray node (script mode: drivers/ray_script.py)

    def __post_init__(self) -> None:
        """A kind the registry can name and build (a bad one registered would break every later error that lists
        the kinds): one line naming what is wrong."""
        if not isinstance(self.name, str) or not KIND_NAME.fullmatch(self.name):
            raise ConfigError(f"BackendKind name {short(self.name)}: allowed a name of letters, digits, '-', '_' and "
                              "'.' (what --backend and run.json say), e.g. 'mine'")
        # Its signature asked now, not a TypeError from make_backend in the middle of a run (a TypeError raised
        # inside the builder itself stays its own).
        if not callable(self.build) or not takes(self.build, 3):
            raise ConfigError(f"BackendKind {self.name!r} build {short(self.build)}: allowed a callable "
                              "build(settings, run_dir, options) -> Backend (it is called with those three)")
        for flag in ("real", "sweep", "measures", "env", "train", "ships"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"BackendKind {self.name!r} {flag} {short(getattr(self, flag))}: allowed True or "
                                  "False")


_REGISTRY: dict[str, BackendKind] = {}
# Test and benchmark hook, read by the driver process (not by Ray workers): seconds every simulated trial
# also sleeps, so that a test can kill the tuner mid-trial.
SLEEP_ENV = "AUTOTUNE_SIMULATED_TRIAL_SLEEP_S"


def simulated_sleep_s(backend: str) -> float:
    """Seconds each simulated trial sleeps (a test hook); a value that is not a finite number >= 0 is a
    ConfigError naming the variable, not a ValueError traceback."""
    from argparse import ArgumentTypeError

    from autotune.values.argtypes import non_negative_float

    if backend != "simulated":
        return 0.0
    text = os.environ.get(SLEEP_ENV) or "0"
    try:
        return non_negative_float(text)
    except ArgumentTypeError as err:
        raise ConfigError(f"environment variable {SLEEP_ENV}={text[:40]!r}: {err}") from None


def register_backend(kind: BackendKind) -> None:
    """Add (or replace) a backend kind; `RunSettings.backend` names it."""
    if not isinstance(kind, BackendKind):
        raise ConfigError(f"backend kind {short(kind)}: allowed a BackendKind(name, build), e.g. autotune.BackendKind("
                          "'mine', lambda settings, run_dir, options: Mine())")
    _REGISTRY[kind.name] = kind


def backend_kind(name: str) -> BackendKind:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"backend {name!r}: allowed {', '.join(_REGISTRY)}") from None


def backend_names(*, sweep: bool | None = True, measures: bool | None = None, env: bool | None = None,
                  train: bool | None = None) -> tuple[str, ...]:
    """The registered kinds with these flags (None: either), in the order they were registered; by default
    those `autotune tune --backend` and sweep files offer."""
    wanted = {"sweep": sweep, "measures": measures, "env": env, "train": train}
    return tuple(name for name, kind in _REGISTRY.items()
                 if all(value is None or getattr(kind, flag) == value for flag, value in wanted.items()))


def make_backend(settings: "RunSettings", run_dir: "RunHome | str | os.PathLike[str] | None" = None,
                 options: TrialOptions = TrialOptions()) -> Backend:
    """The backend of a sweep with these settings (trial logs under `run_dir`'s logs/ or options.logs_dir;
    `run_dir`: a RunDir, or a folder's path). A wrong argument is one ConfigError naming it."""
    from autotune.values.settings import RunSettings

    if not isinstance(settings, RunSettings):
        raise ConfigError(f"settings {short(settings)}: allowed a RunSettings, a sweep's settings, e.g. "
                          "autotune.TuneSpec(...).settings() or autotune.RunDir(path).read_settings()")
    home: RunHome | None
    if run_dir is None or not isinstance(run_dir, (str, os.PathLike)) and hasattr(run_dir, "path") and hasattr(
            run_dir, "logs_dir"):
        home = run_dir
    else:  # a folder's path (`~` expanded), or one line naming what it is not
        home = Home(given_path(run_dir, "run_dir", "a RunDir (autotune.RunDir(path)), a folder's path or None"))
    if not isinstance(options, TrialOptions):
        raise ConfigError(f"options {short(options)}: allowed a TrialOptions (autotune.TrialOptions(...))")
    kind = backend_kind(settings.backend)
    backend = as_backend(kind.build(settings, home, options), f"backend kind {kind.name!r}: its build returned")
    return SleepingBackend(backend, options.sleep_s) if options.sleep_s > 0 else backend


@dataclass(frozen=True)
class Home:
    """A folder as a builder's RunHome (make_backend given a path): trial logs in its logs/, as a RunDir's."""

    path: Path

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"


def _logs_dir(run_dir: "RunHome | None", options: TrialOptions) -> Path:
    if options.logs_dir is not None:
        return given_path(options.logs_dir, "TrialOptions.logs_dir", "a folder's path or None")
    if run_dir is None:
        raise ConfigError("real trials need a directory for their logs: a run directory or TrialOptions.logs_dir")
    return run_dir.logs_dir


# The constructors: each class's own arguments, its module imported only when asked for (deepspeed and script
# import the runner; the environment and RL training never need them). For the type checker each one is its
# class, so every call is checked against the class's own __init__.

def _lazy(module: str, cls: str, doc: str) -> Callable[..., Any]:
    def construct(*args: Any, **kwargs: Any) -> Any:
        return getattr(import_module(module), cls)(*args, **kwargs)

    construct.__doc__ = f"{cls}(...): {doc}"
    return construct


if TYPE_CHECKING:
    simulated_backend = SimulatedBackend
    replay_backend = ReplayBackend
    deepspeed_backend = DeepSpeedBackend
    script_backend = ScriptBackend
    distorted_backend = DistortedBackend
else:
    simulated_backend = _lazy("autotune.backends.simulated", "SimulatedBackend",
                              "the estimator's prediction as a trial")
    replay_backend = _lazy("autotune.backends.replay", "ReplayBackend", "a surface of measured results")
    deepspeed_backend = _lazy("autotune.backends.deepspeed", "DeepSpeedBackend",
                              "real short runs of the built-in model")
    script_backend = _lazy("autotune.backends.script", "ScriptBackend", "real short runs of the user's own script")
    distorted_backend = _lazy("autotune.backends.distorted", "DistortedBackend",
                              "the distorted simulation RL training runs on (a task's landscape and hidden "
                              "distortion, not a sweep's settings: no registered kind)")


# The kinds' builders from a sweep's settings.

def _simulated(settings: "RunSettings", run_dir: "RunHome | None", options: TrialOptions) -> Backend:
    return simulated_backend(settings.workload, settings.hardware, settings.memory_budget_bytes, seed=settings.seed,
                            nvme_path=settings.choices.nvme_path)


def _replay(settings: "RunSettings", run_dir: "RunHome | None", options: TrialOptions) -> Backend:
    if settings.surface is None:
        raise ConfigError("the replay backend needs a surface (a JSONL of measured results)")
    return replay_backend(settings.surface, settings.memory_budget_bytes)


def _deepspeed_options(options: TrialOptions) -> dict[str, Any]:
    chosen = {"timeout_s": options.timeout_s, "measure": options.measure}
    return {**{k: v for k, v in chosen.items() if v is not None}, "in_sequence": options.in_sequence}


def _deepspeed(settings: "RunSettings", run_dir: "RunHome | None", options: TrialOptions) -> Backend:
    from autotune.values.dsconfig import DsOptions

    return deepspeed_backend(settings.workload, settings.memory_budget_bytes, settings.hardware,
                             DsOptions(nvme_path=settings.choices.nvme_path), logs_dir=_logs_dir(run_dir, options),
                             **_deepspeed_options(options))


def _script(settings: "RunSettings", run_dir: "RunHome | None", options: TrialOptions) -> Backend:
    from autotune.backends.script import Script, read_script_info
    from autotune.values.dsconfig import DsOptions

    if run_dir is None:
        raise ConfigError("the script backend reads its script from the run directory: pass one")
    info = read_script_info(run_dir.path)
    frameworks = tuple((info.get("model") or {}).get("frameworks") or ())  # what its first trial showed it imports
    return script_backend(Script.from_dict(info["script"]), settings.workload, settings.memory_budget_bytes,
                          settings.hardware, DsOptions(nvme_path=settings.choices.nvme_path),
                          _logs_dir(run_dir, options), frameworks=frameworks, **_deepspeed_options(options))


for _kind in (BackendKind("deepspeed", _deepspeed, real=True, measures=True, env=True),
              BackendKind("simulated", _simulated, measures=True, env=True, train=True),
              BackendKind("replay", _replay, env=True, train=True),
              BackendKind("script", _script, real=True, sweep=False, ships=True)):  # `autotune tune --script`
    register_backend(_kind)


class SleepingBackend:
    """A backend whose every trial also takes `sleep_s` of wall time (tests of kill and resume)."""

    def __init__(self, inner: Backend, sleep_s: float) -> None:
        self.inner = inner
        self.name = inner.name
        self.sleep_s = sleep_s

    @property
    def fatal(self) -> str | None:
        return self.inner.fatal

    def run(self, config: Config) -> TrialResult:
        time.sleep(self.sleep_s)
        return self.inner.run(config)

    def close(self) -> None:
        self.inner.close()


class ObjectiveBackend:
    """Any object with `run(config) -> TrialResult` (and optionally `name`, `fatal`, `close`) as a Backend:
    a user's own objective or backend, or a test's fake. What its `run` returns is checked: anything but a
    TrialResult is one ConfigError here, not an AttributeError where the sweep reads it. Every other attribute
    is the objective's (a `prepare`, `phase` or `notes` the drivers ask for)."""

    def __init__(self, objective: Any, name: str | None = None, given: str = "backend") -> None:
        if not callable(getattr(objective, "run", None)):
            raise ConfigError(f"{given} {short(objective)}: needs a run(config) -> TrialResult method")
        self.objective = objective
        self.name = name or getattr(objective, "name", None) or type(objective).__name__

    def __getattr__(self, attribute: str) -> Any:  # only what this class does not define itself
        if attribute == "objective":  # not set yet (copy, pickle): no recursion through the lookup below
            raise AttributeError(attribute)
        return getattr(self.objective, attribute)

    @property
    def fatal(self) -> str | None:
        return getattr(self.objective, "fatal", None)

    def run(self, config: Config) -> TrialResult:
        result = self.objective.run(config)
        if not isinstance(result, TrialResult):
            raise ConfigError(f"backend {self.name!r}: run({config.label()}) returned {short(result)} (a "
                              f"{type(result).__name__}): allowed a TrialResult, e.g. autotune.TrialResult(config, "
                              "'ok', throughput_samples_per_s=..., step_time_s=..., peak_memory_bytes=...)")
        return result

    def close(self) -> None:
        close = getattr(self.objective, "close", None)
        if callable(close):
            close()


def as_backend(obj: Any, given: str = "backend") -> Backend:
    """`obj` itself if it is one of this package's backends, else adapted (ObjectiveBackend), so that what a user's
    backend returns is checked (a full Backend of the user's too); `given` names it in the refusal of an object
    without `run`."""
    if isinstance(obj, Backend) and _ours(obj):
        return obj
    return ObjectiveBackend(obj, given=given)


def _ours(obj: Any) -> bool:
    """Built by this package (or a subclass of one of its backends: a user's DeepSpeedBackend with other settings):
    its results are TrialResults by construction, and the drivers set attributes on it (`start_ranks`)."""
    return any(cls.__module__.startswith("autotune.backends") for cls in type(obj).__mro__)
