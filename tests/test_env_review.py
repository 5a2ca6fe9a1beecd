"""The environment under a reviewer's edge cases: an interrupted step, steps past the end, close(), a space with
no valid config, bad reward coefficients and backend options, and vector environments without flat_info."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.backends.factory import simulated_backend
from autotune.envs import DeepSpeedMemoryEnv
from autotune.envs.actions import RUN, STOP, action_index
from autotune.envs.episodes import episode_of
from autotune.envs.landscape import build_landscape
from autotune.envs.reward import Reward
from autotune.envs.sampler import Task
from autotune.values.config import ConfigError
from autotune.values.hardware import PROFILES
from autotune.values.space import Choices, Space
from autotune.values.workload import make_workload

GiB = 2**30
TINY, CPU = make_workload("tiny"), PROFILES["cpu"]
UP = action_index("micro_batch+")
SPACE = {"zero_stage": [0, 1, 2, 3], "micro_batch": [1, 2, 4, 8, 16], "ckpt_interval": [0], "precision": ["fp32"]}


class Flaky:
    """A backend object: the simulation's results, a KeyboardInterrupt at call `interrupt_at` (as Ctrl-C in a
    trial), and a record of what ran and of close()."""

    name = "flaky"

    def __init__(self, interrupt_at: int = 0) -> None:
        self.sim = simulated_backend(TINY, CPU, GiB)
        self.interrupt_at, self.calls, self.ran, self.closed = interrupt_at, 0, [], 0

    def run(self, config):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        self.ran.append(config)
        return self.sim.run(config)

    def close(self) -> None:
        self.closed += 1


def flaky_env(backend: Flaky, horizon: int = 16) -> DeepSpeedMemoryEnv:
    return DeepSpeedMemoryEnv({"backend": backend, "workload": TINY, "hardware": CPU, "memory_budget": "1GiB",
                               "space": SPACE, "start": "default", "horizon": horizon, "chance_info": False})


def label(env: DeepSpeedMemoryEnv) -> str:
    assert env._episode is not None
    return env._episode.landscape.configs[env._current].label()


def test_an_interrupted_step_changes_nothing_and_uses_no_step_of_the_horizon():
    backend = Flaky(interrupt_at=4)
    env = flaky_env(backend, horizon=5)
    env.reset(seed=0)
    for _ in range(3):
        observation, *_ = env.step(UP)  # mb 2, 4, 8
    assert label(env) == "z0 mb8 ck0 fp32"
    with pytest.raises(KeyboardInterrupt):
        env.step(UP)  # the trial of mb16 interrupted
    assert label(env) == "z0 mb8 ck0 fp32" and env._steps == 3 and env._trials == 3
    again, _, _, truncated, info = env.step(UP)  # the same move, from where the episode was
    assert backend.ran[-1].label() == "z0 mb16 ck0 fp32" == label(env) and not info["invalid_action"]
    assert info["trials"] == 4 and not truncated  # the 4th step of 5


def test_a_move_off_the_space_is_invalid_whatever_the_mask_says():
    backend = Flaky()
    env = flaky_env(backend)
    env.reset(seed=0)
    for _ in range(4):
        env.step(UP)
    assert label(env) == "z0 mb16 ck0 fp32"  # the top micro-batch: micro_batch+ leads nowhere
    env._mask_now[UP] = 1.0  # a mask out of step with the config
    _, reward, _, _, info = env.step(UP)
    assert info["invalid_action"] and info["result"] == {} and reward == -Reward().invalid_action_penalty
    assert len(backend.ran) == 4 and label(env) == "z0 mb16 ck0 fp32"


def test_a_step_after_the_episode_ended_is_refused_and_runs_nothing():
    backend = Flaky()
    env = flaky_env(backend, horizon=2)
    env.reset(seed=0)
    env.step(RUN)
    *_, terminated, truncated, _ = env.step(UP)
    assert truncated and not terminated
    with pytest.raises(gym.error.ResetNeeded, match=r"step\(\) called after the episode ended: call reset\(\)"):
        env.step(UP)
    env.reset(seed=0)
    env.step(RUN)
    *_, terminated, _, _ = env.step(STOP)
    assert terminated
    with pytest.raises(gym.error.ResetNeeded, match="after the episode ended"):
        env.step(RUN)
    assert len(backend.ran) == 3
    env.reset(seed=0)
    env.step(RUN)  # a reset starts a new episode
    assert len(backend.ran) == 4


def test_close_closes_the_backends_the_environment_made_and_eviction_the_evicted_ones(tmp_path, monkeypatch):
    closed: list[DeepSpeedBackend] = []
    monkeypatch.setattr(DeepSpeedBackend, "close", lambda self: closed.append(self))
    env = DeepSpeedMemoryEnv({"backend": "deepspeed", "workload": "tiny", "hardware": "cpu",
                              "memory_budget": ["1GiB", "2GiB"], "cache_size": 1, "chance_info": False,
                              "backend_options": {"logs_dir": str(tmp_path)}})
    seen = []
    for seed in range(20):  # until both budgets were drawn: the second episode evicts the first (cache of 1)
        env.reset(seed=seed)
        assert env._episode is not None
        if not seen or env._episode.backend is not seen[-1]:
            seen.append(env._episode.backend)
        if len(seen) == 2:
            break
    assert len(seen) == 2 and closed == [seen[0]]
    env.close()
    assert closed == seen
    with pytest.raises(gym.error.ResetNeeded):
        env.step(RUN)
    backend = Flaky()  # a backend object: closed with the environment, as a sweep's end closes it
    env = flaky_env(backend)
    env.reset(seed=0)
    env.close()
    assert backend.closed == 1


@pytest.mark.parametrize("data, words", [
    ({"workload": "tiny", "space": {"micro_batch": [3]}}, "no micro-batch of the space (3) divides"),
    ({"workload": "tiny", "space": {"offload_optimizer": ["nvme"], "zero_stage": [3]}}, "NVMe offload needs"),
    ({"backend": "replay", "surface": "benchmarks/surfaces/tiny-cpu.jsonl", "space": {"micro_batch": [64]}},
     "no micro-batch of the space (64) divides"),
])
def test_a_space_without_a_valid_config_is_refused_when_the_environment_is_made(data, words):
    with pytest.raises(ConfigError) as err:
        DeepSpeedMemoryEnv(data)
    assert str(err.value).startswith("the space holds no valid config for tiny on 1 x cpu: ") and words in str(err.value)
    assert "\n" not in str(err.value)


def test_an_episode_of_an_empty_landscape_is_the_same_one_line_error():
    """A sampled task's or another source's landscape (TaskSource refuses its own when made)."""
    choices = Choices(micro_batch=(3,))
    space = Space(choices, TINY, CPU)
    land = build_landscape(space, simulated_backend(TINY, CPU, GiB).estimate)
    with pytest.raises(ConfigError, match="the space holds no valid config for tiny on 1 x cpu: no micro-batch"):
        episode_of(Task(TINY, CPU, GiB, choices), simulated_backend(TINY, CPU, GiB), land, 1.0, None)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_reward_coefficient_must_be_finite(value):
    with pytest.raises(ConfigError) as err:
        DeepSpeedMemoryEnv({"workload": "tiny", "reward": {"trial_cost": value}})
    assert str(err.value) == f"reward trial_cost={value!r}: must be a finite number >= 0"


def test_backend_options_are_checked_against_the_backends_signature_when_the_config_is_made():
    with pytest.raises(ConfigError) as err:
        DeepSpeedMemoryEnv({"backend": "deepspeed", "workload": "tiny", "backend_options": {"timeout": 3}})
    message = str(err.value)
    assert message.startswith("unknown backend_options key(s) ['timeout']: allowed [") and "\n" not in message
    assert "'timeout_s'" in message and "'logs_dir'" in message and "'ranks_ahead'" in message
    with pytest.raises(ConfigError, match=r"key\(s\) \['hardware'\]: the environment sets"):
        DeepSpeedMemoryEnv({"backend": "deepspeed", "workload": "tiny", "backend_options": {"hardware": "cpu"}})
    with pytest.raises(ConfigError, match="deepspeed backend only, not backend='simulated'"):
        DeepSpeedMemoryEnv({"workload": "tiny", "backend_options": {"timeout_s": 3}})
    env = DeepSpeedMemoryEnv({"backend": "deepspeed", "workload": "tiny", "backend_options": {"timeout_s": 3}})
    assert env.config.backend_options == {"timeout_s": 3}


def test_a_vector_environment_merges_the_nested_info():
    """Without flat_info: one copy's masked action (nothing ran) beside another's trial in the same step."""
    config = {"workload": "tiny", "memory_budget": "800MiB", "chance_info": False}
    envs = gym.vector.SyncVectorEnv([lambda: DeepSpeedMemoryEnv(config) for _ in range(2)])
    _, first = envs.reset(seed=0)
    _, _, _, _, info = envs.step(np.array([STOP, RUN]))  # stop is masked before any trial
    assert first["result"] == {} and first["best"] == {}  # nothing ran yet: empty, not None
    assert list(info["_result"]) == [True, True] and list(info["result"]["_status"]) == [False, True]
    assert list(info["invalid_action"]) == [True, False]
    envs.close()
