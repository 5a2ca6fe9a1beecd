"""ds-autotune: finds the fastest DeepSpeed memory configuration that fits.

    import autotune
    spec = autotune.TuneSpec(autotune.make_workload("tiny"), autotune.load_hardware("cpu"),
                             memory_budget_bytes=2 * 2**30, strategy="optuna", trials=10, backend="simulated")
    result = autotune.tune(spec, out="runs/notebook")

The library's names are imported when first used (PEP 562), so that `import autotune` stays cheap for the
trial processes, which import the package too.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from importlib.machinery import ModuleSpec
from importlib.util import spec_from_file_location
from typing import TYPE_CHECKING, Any, Sequence

from autotune.values.config import Config, ConfigError
from autotune.values.results import TrialResult
from autotune.values.workload import ModelShape, Workload, make_workload

_MAPPED = ("envs", "search_spaces")  # top-level folders that pyproject.toml's package-dir installs inside autotune


class _CheckoutFolders:
    """A sys.meta_path finder: a checkout's envs/ and search_spaces/ as autotune.envs and autotune.search_spaces,
    where the install puts them. `python -m autotune.cli` run from the repository root imports the checkout's
    autotune/ ('' comes first on sys.path) whatever is installed, and there, without an editable install's import
    hook, nothing else finds the two (issue 40: the GPU kit's tune). Duck-typed: importlib.abc costs an import."""

    def __init__(self, package: str) -> None:
        self.package = package  # this autotune/ folder: only its own sub-packages are served

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: object = None) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != "autotune" or name not in _MAPPED or not path or self.package not in path:
            return None
        folder = os.path.join(os.path.dirname(self.package), name)
        return spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                       submodule_search_locations=[folder])


def _serve_checkout_folders() -> None:
    """The finder, once, when this package is a checkout's (installed, the folders are inside it), before every
    other finder: it serves only this autotune/'s own sub-packages, which an editable install of another checkout
    (a venv shared by two clones) would otherwise serve from that one."""
    package = os.path.dirname(os.path.abspath(__file__))
    if any(os.path.exists(os.path.join(package, name)) for name in _MAPPED) or not all(
            os.path.isfile(os.path.join(os.path.dirname(package), name, "__init__.py")) for name in _MAPPED):
        return
    if not any(type(f).__name__ == "_CheckoutFolders" and getattr(f, "package", None) == package
               for f in sys.meta_path):  # by name: a re-imported autotune has a class of its own
        sys.meta_path.insert(0, _CheckoutFolders(package))


_serve_checkout_folders()

if TYPE_CHECKING:
    from autotune.api import Plan, TuneResult, TuneSpec, tune, tune_many
    from autotune.backends import Backend
    from autotune.backends.factory import BackendKind, TrialOptions, make_backend, register_backend
    from autotune.drivers.progress import ConsoleProgress, Progress, QuietProgress
    from autotune.drivers.ray import RayOptions
    from autotune.drivers.stop import StopReason
    from autotune.prediction.estimate import Calibration, Estimate
    from autotune.prediction.ranking import Ranking, predict, rank_configs
    from autotune.values.hardware import Hardware, load_hardware
    from autotune.drivers.recording import Recorded, record_surface
    from autotune.search.rundir import RunDir
    from autotune.values.settings import RunSettings
    from autotune.values.space import Choices, Space

_LAZY = {
    "tune": "autotune.api", "TuneSpec": "autotune.api", "TuneResult": "autotune.api",
    "tune_many": "autotune.api", "Plan": "autotune.api",
    "Backend": "autotune.backends", "BackendKind": "autotune.backends.factory",
    "TrialOptions": "autotune.backends.factory", "make_backend": "autotune.backends.factory",
    "register_backend": "autotune.backends.factory",
    "Progress": "autotune.drivers.progress", "ConsoleProgress": "autotune.drivers.progress",
    "QuietProgress": "autotune.drivers.progress", "StopReason": "autotune.drivers.stop",
    "RayOptions": "autotune.drivers.ray",
    "predict": "autotune.prediction.ranking", "Estimate": "autotune.prediction.estimate",
    "Calibration": "autotune.prediction.estimate",
    "rank_configs": "autotune.prediction.ranking", "Ranking": "autotune.prediction.ranking",
    "Hardware": "autotune.values.hardware", "load_hardware": "autotune.values.hardware",
    "record_surface": "autotune.drivers.recording", "Recorded": "autotune.drivers.recording",
    "RunDir": "autotune.search.rundir", "RunSettings": "autotune.values.settings",
    "Choices": "autotune.values.space", "Space": "autotune.values.space",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "Config", "ConfigError", "ModelShape", "TrialResult", "Workload", "make_workload",
    "tune", "TuneSpec", "TuneResult", "tune_many", "Plan", "Backend", "BackendKind", "TrialOptions", "make_backend",
    "register_backend", "Progress", "ConsoleProgress", "QuietProgress", "RayOptions", "StopReason", "predict",
    "Estimate",
    "Calibration", "rank_configs", "Ranking", "Hardware", "load_hardware", "record_surface", "Recorded",
    "RunDir", "RunSettings", "Choices", "Space",
]
__version__ = "0.1.0"
