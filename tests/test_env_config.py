"""The environment's typed config (EnvConfig) and its episode source (envs/episodes.py): dicts and
dataclasses are the same environment, and a source injected in place of the default drives it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from autotune.backends.simulated import SimulatedBackend
from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import Calibration
from autotune.envs import ENV_ID, DeepSpeedMemoryEnv
from autotune.envs import observation as obs
from autotune.envs.actions import RUN, STOP
from autotune.envs.config import CONFIG_KEYS, EnvConfig
from autotune.envs.episodes import Episode, TaskSource, episode_of
from autotune.envs.landscape import build_landscape
from autotune.envs.reward import Reward
from autotune.envs.sampler import Task, WorkloadSampler
from autotune.values.hardware import PROFILES, Hardware
from autotune.values.results import TrialResult, append_result
from autotune.rl.simulator import DistortedSource, TrainingEnv, training_source
from autotune.rl.train import samplers
from autotune.search_spaces import load_choices
from autotune.values.space import Choices, Space
from autotune.values.workload import Workload, make_workload

GiB, MiB = 2**30, 2**20
TINY = make_workload("tiny")
CPU = PROFILES["cpu"]


@pytest.fixture(scope="module")
def surface(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("surface") / "tiny.jsonl"
    backend = SimulatedBackend(TINY, CPU, 24 * GiB)
    extra = {"workload": TINY.to_dict(), "hardware": "cpu"}
    for i, config in enumerate(Space(load_choices("cpu"), TINY, CPU)):
        if i % 2:
            append_result(path, replace(backend.run(config), backend="deepspeed", extra=extra))
    return path


def trace(env, episodes=4, seed=0):
    """Observations, rewards and infos of random masked episodes (the same actions for the same seed)."""
    rng = np.random.default_rng(seed)
    out = []
    for episode in range(episodes):
        observation, info = env.reset(seed=episode if episode % 2 == 0 else None)
        out.append((observation["observations"].tolist(), observation["action_mask"].tolist(), repr(info)))
        done = False
        while not done:
            action = int(rng.choice(np.flatnonzero(observation["action_mask"])))
            observation, reward, terminated, truncated, info = env.step(action)
            out.append((action, reward, observation["observations"].tolist(), repr(info)))
            done = terminated or truncated
    return out


# -- EnvConfig ---------------------------------------------------------------------------------------

def test_defaults_are_the_documented_ones():
    config = EnvConfig()
    assert config == EnvConfig.from_dict({}) == EnvConfig.from_dict(None) == EnvConfig.of(None)
    assert (config.backend, config.horizon, config.start, config.noise, config.cache_size) == \
        ("simulated", 16, "random", 0.0, 256)
    assert config.reward == Reward() and config.calibration == Calibration()
    assert not config.mask_revisits and not config.flat_info and config.chance_info and config.seed is None
    assert not config.observe_seconds
    assert config.draws_tasks and config.sampler is None
    assert config.task_sampler() == WorkloadSampler(split="train", pool_size=256)
    assert config.to_dict() == {}
    assert set(CONFIG_KEYS) == {"backend", "workload", "sampler", "hardware", "memory_budget", "space", "surface",
                                "horizon", "start", "noise", "calibration", "reward", "observe_seconds",
                                "mask_revisits", "flat_info",
                                "chance_info", "reference_throughput", "backend_options", "cache_size", "seed"}
    for key in CONFIG_KEYS:  # every key is documented in the class's table
        assert f"\n    {key} " in EnvConfig.__doc__


@pytest.mark.parametrize("data", [
    {"workload": "tiny", "memory_budget": "900MiB", "noise": 0.1, "start": "default", "seed": 3},
    {"workload": {"model": "llama-7b", "global_batch": 64, "gpus": 8}, "hardware": "a100-80gb",
     "memory_budget": ["40GiB", 60 * GiB], "space": "default", "calibration": {"memory_scale": 1.1},
     "reward": {"mode": "improvement", "trial_cost": 0.0}, "mask_revisits": True, "flat_info": 1, "horizon": 5},
    {"sampler": {"pool_size": 8, "profiles": ["a100-80gb", "l4"]}, "cache_size": 9},
    {"backend": "deepspeed", "workload": "tiny", "hardware": "cpu", "backend_options": {"timeout_s": 60.0},
     "reference_throughput": 12.5},
])
def test_from_dict_normalises_and_round_trips(data):
    config = EnvConfig.from_dict(data)
    assert EnvConfig.from_dict(config.to_dict()) == config
    assert EnvConfig.of(config) is config and EnvConfig.of(data) == config
    assert config.workload is None or isinstance(config.workload, Workload)
    assert config.hardware is None or isinstance(config.hardware, Hardware)
    assert config.space is None or isinstance(config.space, Choices)
    assert config.sampler is None or isinstance(config.sampler, WorkloadSampler)
    assert isinstance(config.reward, Reward) and isinstance(config.calibration, Calibration)
    assert all(isinstance(b, int) for b in config.memory_budget)
    assert isinstance(config.flat_info, bool)
    assert set(config.to_dict()) <= set(data)


def test_values_are_parsed_as_the_environment_always_did():
    config = EnvConfig.from_dict({"workload": "tiny", "memory_budget": "1GiB", "hardware": "cpu", "space": "cpu"})
    assert config.workload == TINY and config.memory_budget == (GiB,)
    assert config.hardware == CPU and config.space == load_choices("cpu")
    assert EnvConfig(workload="tiny", memory_budget=GiB) == EnvConfig.from_dict({"workload": "tiny", "memory_budget": "1GiB"})
    replay = EnvConfig.from_dict({"backend": "replay", "surface": "a.jsonl"})
    assert replay.surface == ("a.jsonl",) and replay.kind == "replay" and replay.task_sampler() is None
    assert EnvConfig.from_dict({"backend": "replay", "surface": Path("a.jsonl")}).surface == ("a.jsonl",)


def test_errors_are_one_line_and_the_same_for_dicts_and_dataclasses():
    with pytest.raises(ConfigError) as err:
        EnvConfig.from_dict({"colour": 1, "horizon": 3})
    assert str(err.value) == f"unknown env_config key(s) ['colour']: allowed {list(CONFIG_KEYS)}"
    for data, match in [({"horizon": 0}, "horizon=0: must be a positive integer"),
                        ({"start": "best"}, r"start='best': allowed \['random', 'default', 'estimator'\]"),
                        ({"backend": "gpu"}, "allowed"), ({"backend": object()}, "an object with name and run"),
                        ({"workload": "gpt5"}, "unknown model"), ({"workload": None}, "workload None: expected"),
                        ({"sampler": None}, "sampler None: expected"), ({"sampler": {"size": 3}}, "unknown sampler"),
                        ({"noise": -1}, "noise=-1"), ({"cache_size": 0}, "cache_size"),
                        ({"workload": "tiny", "memory_budget": "lots"}, "memory_budget: size 'lots'"),
                        ({"memory_budget": "1GiB"}, "come from the sampler"),
                        ({"workload": "tiny", "sampler": {}}, "sampler applies to the simulated backend"),
                        ({"backend": "replay"}, "needs env_config\\['surface'\\]"),
                        ({"backend": "deepspeed"}, "the deepspeed backend needs env_config\\['workload'\\]"),
                        ({"calibration": {"scale": 2}}, "unknown calibration key"),
                        ({"reward": {"oom": 1}}, "unknown reward key")]:
        for make in (EnvConfig.from_dict, DeepSpeedMemoryEnv, lambda d: EnvConfig(**d)):
            if make is not EnvConfig.from_dict and None in data.values():
                continue  # the dataclass reads None as "not given"
            with pytest.raises(ConfigError, match=match) as err:
                make(data)
            assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="expected an EnvConfig or a dict"):
        DeepSpeedMemoryEnv("tiny")
    with pytest.raises(ConfigError, match="no such file"):  # surfaces are read by the environment
        DeepSpeedMemoryEnv(EnvConfig(backend="replay", surface="/nonexistent.jsonl"))


@pytest.mark.parametrize("data", [
    {"workload": "tiny", "memory_budget": ["700MiB", "1GiB"], "noise": 0.1, "start": "estimator"},
    {"sampler": {"pool_size": 8}, "noise": 0.2, "flat_info": True},
])
def test_a_dict_and_its_dataclass_make_the_same_environment(data):
    assert trace(DeepSpeedMemoryEnv(data)) == trace(DeepSpeedMemoryEnv(EnvConfig.from_dict(data)))
    env = DeepSpeedMemoryEnv(EnvConfig.from_dict(data))
    assert env.config == EnvConfig.from_dict(data)


def test_gymnasium_make_takes_a_dict_or_an_env_config():
    data = {"workload": "tiny", "memory_budget": "1GiB", "horizon": 4}
    for env_config in (data, EnvConfig.from_dict(data)):
        env = gym.make(ENV_ID, env_config=env_config)
        assert isinstance(env.unwrapped, DeepSpeedMemoryEnv) and env.unwrapped.config == EnvConfig.from_dict(data)
        observation, _ = env.reset(seed=0)
        assert env.observation_space.contains(observation)
    assert trace(gym.make(ENV_ID, env_config=data).unwrapped) == trace(DeepSpeedMemoryEnv(EnvConfig.from_dict(data)))


@pytest.mark.parametrize("config", [
    EnvConfig(workload="tiny", memory_budget="1GiB", noise=0.1),
    EnvConfig(sampler={"pool_size": 8}),
    EnvConfig(workload=make_workload("llama-7b", 64, 8), hardware="a100-80gb", start="estimator", mask_revisits=True),
])
def test_check_env_on_an_env_config(config):
    check_env(DeepSpeedMemoryEnv(config), skip_render_check=True)
    check_env(gym.make(ENV_ID, env_config=config).unwrapped, skip_render_check=True)


@pytest.mark.parametrize("given, word", [
    ({"workload": "gpt2-small", "hardware": "h100-80gb"}, "env_config['workload'] gpt2-small: the surface"),
    ({"hardware": "h100-80gb"}, "env_config['hardware'] h100-80gb: the surface"),
    ({"workload": {"model": "tiny", "global_batch": 32}}, "global_batch 32: the surface"),
])
def test_a_replay_env_refuses_a_task_other_than_its_surfaces(surface, tmp_path, given, word):
    data = {"backend": "replay", "surface": str(surface), **given}
    with pytest.raises(ConfigError) as err:
        gym.make(ENV_ID, env_config=data)
    assert word in str(err.value) and "recorded" in str(err.value)
    mixed = tmp_path / "mixed.jsonl"  # the surface and a line of another workload
    small = {"workload": make_workload("gpt2-small").to_dict(), "hardware": "cpu"}
    mixed.write_text(surface.read_text() + TrialResult(Config(0, 1, 0, "fp32"), "ok", 1.0, extra=small).to_json() + "\n")
    with pytest.raises(ConfigError, match="its lines were recorded with two workloads"):
        DeepSpeedMemoryEnv(EnvConfig(backend="replay", surface=[str(surface), str(mixed)]))
    env = gym.make(ENV_ID, env_config={"backend": "replay", "surface": str(surface), "workload": "tiny",
                                       "hardware": "cpu"})  # what it recorded: replayed
    assert env.reset(seed=0)[1]["task"]["workload"]["model"]["name"] == "tiny"


def test_check_env_on_a_replay_env_config(surface):
    check_env(DeepSpeedMemoryEnv(EnvConfig(backend="replay", surface=str(surface), memory_budget=["700MiB", "1GiB"])),
              skip_render_check=True)


# -- the episode source ------------------------------------------------------------------------------

class Scripted:
    """A backend returning throughputs in order, whatever the config."""

    name = "scripted"

    def __init__(self, throughputs):
        self.throughputs = list(throughputs)
        self.seen: list[Config] = []

    def run(self, config):
        self.seen.append(config)
        return TrialResult(config, "ok", self.throughputs.pop(0), peak_memory_bytes=100 * MiB, backend=self.name)


class FakeSource:
    """Hand-made episodes in turn, each starting at its space's default config, with an info key of its own."""

    def __init__(self, episodes: list[Episode]) -> None:
        self.episodes = episodes
        self.rngs: list[np.random.Generator] = []
        self.infos = 0

    def episode(self, rng):
        self.rngs.append(rng)
        return self.episodes[(len(self.rngs) - 1) % len(self.episodes)]

    def start(self, episode, rng):
        return episode.landscape.index[episode.landscape.space.default()]

    def info(self, episode, info, result):
        self.infos += 1
        return {**info, "source": episode.task.memory_budget_bytes}


def hand_made(budget: int, throughputs) -> Episode:
    task = Task(TINY, CPU, budget, load_choices("cpu"))
    estimator = SimulatedBackend(TINY, CPU, CPU.memory_bytes).estimate
    land = build_landscape(Space(task.choices, TINY, CPU), estimator)
    return episode_of(task, Scripted(throughputs), land, reference=100.0, optimum=200.0)


def test_an_injected_source_drives_the_environment():
    first, second = hand_made(GiB, [50.0, 80.0]), hand_made(2 * GiB, [10.0])
    source = FakeSource([first, second])
    env = DeepSpeedMemoryEnv({"workload": "tiny", "horizon": 3}, source=source)
    assert env.source is source
    observation, info = env.reset(seed=0)
    assert source.rngs == [env.np_random]  # draws come from the environment's generator
    default = first.landscape.space.default()
    assert Config.from_dict(info["config"]) == default and info["source"] == GiB
    assert info["reference_throughput"] == 100.0 and info["optimum_throughput"] == 200.0
    assert info["task"]["memory_budget_bytes"] == GiB and info["task"]["backend"] == "scripted"
    assert np.allclose(observation["observations"][obs.TASK_AT:obs.CONFIG_AT], first.task_features)
    _, reward, terminated, _, info = env.step(RUN)
    assert first.backend.seen == [default] and info["result"]["throughput_samples_per_s"] == 50.0
    assert reward == pytest.approx(0.5 - Reward().trial_cost) and not terminated
    _, reward, terminated, _, info = env.step(STOP)
    assert terminated and reward == pytest.approx(2 * 0.5)  # the horizon's 2 steps left at the best, 50/100
    assert source.infos == 3
    _, info = env.reset()
    assert info["source"] == 2 * GiB and len(source.rngs) == 2  # the next episode


def test_the_training_env_is_the_environment_with_a_distorted_source():
    data = {"samplers": samplers("train", 8, 0, 0.25), "noise": 0.1, "start": "mixed", "seed": 0}
    env = TrainingEnv(data)
    assert type(env.source) is DistortedSource and isinstance(env.source.base, TaskSource)
    assert env.config.start == "random" and env.source.mixed_start
    config, source = training_source(data)
    injected = DeepSpeedMemoryEnv(config, source=source)
    assert trace(env, 6) == trace(injected, 6)
    with pytest.raises(ConfigError, match="randomize"):
        TrainingEnv({"randomize": -1})
    with pytest.raises(ConfigError, match="either sampler or samplers"):
        TrainingEnv({"sampler": {}, "samplers": [{}]})
