"""The one place a sweep's backend is built: a registry of backend kinds, each a builder from the sweep's
settings. `autotune tune`, `autotune sweep`, `autotune surface record` and the Ray driver's workers call
`make_backend` (the Gymnasium environment builds its own, with options a sweep has not: step-time noise, a
calibration, a loaded surface); a user adds a kind with `register_backend`, or hands the library any object
with `run(config) -> TrialResult` (`as_backend` adapts it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from autotune.backends import Backend
from autotune.config import Config, ConfigError
from autotune.results import TrialResult

if TYPE_CHECKING:
    from autotune.rundir import RunDir
    from autotune.settings import RunSettings
    from autotune.worker.measure import MeasureSettings


@dataclass(frozen=True)
class TrialOptions:
    """How real trials run, beyond the sweep's settings: where their logs go and how long they take."""

    logs_dir: str | None = None  # default: the run directory's logs/
    timeout_s: float | None = None  # default: the backend's
    measure: "MeasureSettings | None" = None  # default: the backend's
    sleep_s: float = 0.0  # tests and benchmarks: every trial also takes this long


Builder = Callable[["RunSettings", "RunDir | None", TrialOptions], Backend]


@dataclass(frozen=True)
class BackendKind:
    name: str
    build: Builder
    real: bool = False  # its trials run on devices: Ray asks for them, the machine is checked first


_REGISTRY: dict[str, BackendKind] = {}
# Test and benchmark hook, read by the driver process (not by Ray workers): seconds every simulated trial
# also sleeps, so that a test can kill the tuner mid-trial.
SLEEP_ENV = "AUTOTUNE_SIMULATED_TRIAL_SLEEP_S"


def simulated_sleep_s(backend: str) -> float:
    """Seconds each simulated trial sleeps (a test hook); a value that is not a finite number >= 0 is a
    ConfigError naming the variable, not a ValueError traceback."""
    from argparse import ArgumentTypeError

    from autotune.argtypes import non_negative_float

    if backend != "simulated":
        return 0.0
    text = os.environ.get(SLEEP_ENV) or "0"
    try:
        return non_negative_float(text)
    except ArgumentTypeError as err:
        raise ConfigError(f"environment variable {SLEEP_ENV}={text[:40]!r}: {err}") from None


def register_backend(kind: BackendKind) -> None:
    """Add (or replace) a backend kind; `RunSettings.backend` names it."""
    _REGISTRY[kind.name] = kind


def backend_kind(name: str) -> BackendKind:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"backend {name!r}: allowed {', '.join(_REGISTRY)}") from None


def backend_names() -> tuple[str, ...]:
    """The registered kinds `autotune tune --backend` offers (script mode has --script instead)."""
    return tuple(name for name in _REGISTRY if name != "script")


def make_backend(settings: "RunSettings", run_dir: "RunDir | None" = None,
                 options: TrialOptions = TrialOptions()) -> Backend:
    """The backend of a sweep with these settings (trial logs under `run_dir`'s logs/ or options.logs_dir)."""
    backend = backend_kind(settings.backend).build(settings, run_dir, options)
    return SleepingBackend(backend, options.sleep_s) if options.sleep_s > 0 else backend


def _logs_dir(run_dir: "RunDir | None", options: TrialOptions) -> Path:
    if options.logs_dir is not None:
        return Path(options.logs_dir)
    if run_dir is None:
        raise ConfigError("real trials need a directory for their logs: a run directory or TrialOptions.logs_dir")
    return run_dir.logs_dir


def _simulated(settings: "RunSettings", run_dir: "RunDir | None", options: TrialOptions) -> Backend:
    from autotune.backends.simulated import SimulatedBackend

    return SimulatedBackend(settings.workload, settings.hardware, settings.memory_budget_bytes, seed=settings.seed,
                            nvme_path=settings.choices.nvme_path)


def _replay(settings: "RunSettings", run_dir: "RunDir | None", options: TrialOptions) -> Backend:
    from autotune.backends.replay import ReplayBackend

    if settings.surface is None:
        raise ConfigError("the replay backend needs a surface (a JSONL of measured results)")
    return ReplayBackend(settings.surface, settings.memory_budget_bytes)


def _deepspeed_options(options: TrialOptions) -> dict[str, Any]:
    chosen = {"timeout_s": options.timeout_s, "measure": options.measure}
    return {k: v for k, v in chosen.items() if v is not None}


def _deepspeed(settings: "RunSettings", run_dir: "RunDir | None", options: TrialOptions) -> Backend:
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.dsconfig import DsOptions

    return DeepSpeedBackend(settings.workload, settings.memory_budget_bytes, settings.hardware,
                            DsOptions(nvme_path=settings.choices.nvme_path), logs_dir=_logs_dir(run_dir, options),
                            **_deepspeed_options(options))


def _script(settings: "RunSettings", run_dir: "RunDir | None", options: TrialOptions) -> Backend:
    from autotune.backends.script import Script, ScriptBackend, read_script_info
    from autotune.dsconfig import DsOptions

    if run_dir is None:
        raise ConfigError("the script backend reads its script from the run directory: pass one")
    script = Script.from_dict(read_script_info(run_dir.path)["script"])
    return ScriptBackend(script, settings.workload, settings.memory_budget_bytes, settings.hardware,
                         DsOptions(nvme_path=settings.choices.nvme_path), _logs_dir(run_dir, options),
                         **_deepspeed_options(options))


for _kind in (BackendKind("deepspeed", _deepspeed, real=True),  # real short runs of the built-in model
              BackendKind("simulated", _simulated),  # the estimator's prediction
              BackendKind("replay", _replay),  # a surface of measured results
              BackendKind("script", _script, real=True)):  # real short runs of the user's own script
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
    a user's own objective, or a test's fake."""

    def __init__(self, objective: Any, name: str | None = None) -> None:
        if not callable(getattr(objective, "run", None)):
            raise ConfigError(f"backend {objective!r}: needs a run(config) -> TrialResult method")
        self.objective = objective
        self.name = name or getattr(objective, "name", None) or type(objective).__name__

    @property
    def fatal(self) -> str | None:
        return getattr(self.objective, "fatal", None)

    def run(self, config: Config) -> TrialResult:
        return self.objective.run(config)

    def close(self) -> None:
        close = getattr(self.objective, "close", None)
        if callable(close):
            close()


def as_backend(obj: Any) -> Backend:
    """`obj` itself if it is a full Backend, else adapted (ObjectiveBackend)."""
    if isinstance(obj, Backend):
        return obj
    return ObjectiveBackend(obj)
