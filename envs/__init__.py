"""Gymnasium environments of ds-autotune (installed as `autotune.envs`).

Importing this package registers `autotune/DeepSpeedMemory-v0` (envs/deepspeed_memory.py):
`gymnasium.make("autotune/DeepSpeedMemory-v0", env_config={...})`, or, with RLlib, the class
`autotune.envs.DeepSpeedMemoryEnv` with its `env_config`. The keys are `EnvConfig`'s (envs/config.py),
which the environment also takes in place of the dict; where episodes come from is its `EpisodeSource`
(envs/episodes.py).
"""
import gymnasium

from autotune.envs.config import EnvConfig
from autotune.envs.deepspeed_memory import DeepSpeedMemoryEnv
from autotune.envs.episodes import Episode, EpisodeSource, TaskSource
from autotune.envs.sampler import Task, WorkloadSampler

ENV_ID = "autotune/DeepSpeedMemory-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="autotune.envs.deepspeed_memory:DeepSpeedMemoryEnv")

__all__ = ["ENV_ID", "DeepSpeedMemoryEnv", "EnvConfig", "Episode", "EpisodeSource", "Task", "TaskSource",
           "WorkloadSampler"]
