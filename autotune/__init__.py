"""ds-autotune: finds the fastest DeepSpeed memory configuration that fits."""

from autotune.config import Config, ConfigError
from autotune.results import TrialResult
from autotune.workload import ModelShape, Workload

__all__ = ["Config", "ConfigError", "ModelShape", "TrialResult", "Workload"]
__version__ = "0.1.0"
