"""A short episode of the environment on the real deepspeed backend (tiny model, CPU, real trials)."""

import pytest

from autotune.values.config import Config
from autotune.envs import DeepSpeedMemoryEnv
from autotune.envs.actions import RUN, STOP, action_index
from autotune.envs.reward import Reward
from autotune.values.space import Choices
from autotune.worker.measure import MeasureSettings


@pytest.mark.slow
def test_real_episode_runs_trials_and_rewards_them(tmp_path):
    env = DeepSpeedMemoryEnv({
        "backend": "deepspeed", "workload": {"model": "tiny", "global_batch": 8}, "hardware": "cpu",
        "memory_budget": "3GiB", "horizon": 4, "start": "default",
        # Big micro-batches of a global batch of 8: few micro-steps per optimizer step, so short trials.
        "space": Choices(zero_stage=(0, 2), micro_batch=(4, 8), ckpt_interval=(0, 1), precision=("fp32",)),
        # Short trials: one warm-up step and two measured steps each.
        "backend_options": {"logs_dir": str(tmp_path / "logs"), "measure": MeasureSettings.fixed(1, 2)},
    })
    observation, info = env.reset(seed=0)
    start = Config.from_dict(info["config"])
    assert start == Config(0, 4, 0, "fp32") and observation["action_mask"][RUN] == 1
    up = action_index("micro_batch+")
    assert observation["action_mask"][up] == 1 and observation["action_mask"][action_index("micro_batch-")] == 0

    observation, reward, terminated, truncated, info = env.step(RUN)  # the start config: 2 micro-steps per step
    first = info["result"]
    assert first["backend"] == "deepspeed" and first["status"] == "ok", first.get("error")
    assert first["config"] == start.to_dict()
    assert first["peak_memory_bytes"] > 0 and first["throughput_samples_per_s"] > 0
    assert (tmp_path / "logs").is_dir()
    reference = info["reference_throughput"]
    assert reward == pytest.approx(first["throughput_samples_per_s"] / reference - Reward().trial_cost)

    observation, reward, terminated, truncated, info = env.step(up)  # z0 mb8
    second = info["result"]
    assert second["status"] == "ok" and second["config"]["micro_batch"] == 8
    best = max(first["throughput_samples_per_s"], second["throughput_samples_per_s"])
    assert info["best"]["throughput_samples_per_s"] == best and info["trials"] == 2
    assert info["optimum_throughput"] is None  # unknown on real hardware

    observation, reward, terminated, truncated, info = env.step(STOP)
    assert terminated and not truncated
    assert reward == pytest.approx(2 * best / reference)  # steps 3 and 4 of the horizon
