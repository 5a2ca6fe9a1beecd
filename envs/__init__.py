"""Gymnasium environments of ds-autotune (installed as `autotune.envs`).

Importing this package registers `autotune/DeepSpeedMemory-v0` (envs/deepspeed_memory.py):
`gymnasium.make("autotune/DeepSpeedMemory-v0", env_config={...})`, or, with RLlib, the class
`autotune.envs.DeepSpeedMemoryEnv` with its `env_config`.
"""
import gymnasium

from autotune.envs.deepspeed_memory import DeepSpeedMemoryEnv
from autotune.envs.sampler import Task, WorkloadSampler

ENV_ID = "autotune/DeepSpeedMemory-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="autotune.envs.deepspeed_memory:DeepSpeedMemoryEnv")

__all__ = ["ENV_ID", "DeepSpeedMemoryEnv", "Task", "WorkloadSampler"]
