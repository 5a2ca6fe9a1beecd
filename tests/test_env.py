"""The Gymnasium environment: API conformance, masking, rewards on hand-made results, episodes."""

from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import autotune.envs
from autotune.backends.simulated import SimulatedBackend
from autotune.values.config import Config, ConfigError
from autotune.envs import ENV_ID, DeepSpeedMemoryEnv
from autotune.envs import observation as obs
from autotune.envs.actions import ACTIONS, FIRST_EDIT, JUMP, RUN, STOP, action_index
from autotune.envs.reward import Reward
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult, append_result
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.values.workload import make_workload

GiB, MiB = 2**30, 2**20
TINY = make_workload("tiny")
CPU = PROFILES["cpu"]


@pytest.fixture(scope="session")
def partial_surface(tmp_path_factory) -> Path:
    """Simulated results of two thirds of the tiny CPU space, written as a surface (a hand-made
    landscape whose unmeasured configs the mask must avoid)."""
    path = tmp_path_factory.mktemp("surface") / "partial.jsonl"
    backend = SimulatedBackend(TINY, CPU, 24 * GiB)
    extra = {"workload": TINY.to_dict(), "hardware": "cpu"}
    for i, config in enumerate(Space(load_choices("cpu"), TINY, CPU)):
        if i % 3:
            append_result(path, replace(backend.run(config), backend="deepspeed", extra=extra))
    return path


def random_episode(env, rng, seed=None):
    """Steps with uniformly random allowed actions; yields (obs, action, reward, info) per step."""
    observation, info = env.reset(seed=seed)
    done = False
    while not done:
        action = int(rng.choice(np.flatnonzero(observation["action_mask"])))
        observation, reward, terminated, truncated, info = env.step(action)
        done = terminated or truncated
        yield observation, action, reward, info


def test_registered_on_import_and_made_by_id():
    assert ENV_ID == "autotune/DeepSpeedMemory-v0" and ENV_ID in gym.registry
    env = gym.make(ENV_ID, env_config={"workload": "tiny", "memory_budget": "1GiB"})
    observation, _ = env.reset(seed=0)
    assert env.observation_space.contains(observation)
    assert isinstance(env.unwrapped, autotune.envs.DeepSpeedMemoryEnv)


@pytest.mark.parametrize("config", [
    {"workload": "tiny", "memory_budget": "1GiB", "noise": 0.1},
    {"sampler": {"pool_size": 8}},
    {"workload": {"model": "llama-7b", "global_batch": 64, "gpus": 8}, "hardware": "a100-80gb", "start": "estimator"},
    {"workload": "llama-1b", "hardware": "h100-80gb", "memory_budget": "29GiB", "observe_seconds": True},
])
def test_check_env_simulated(config):
    check_env(gym.make(ENV_ID, env_config=config).unwrapped, skip_render_check=True)


def test_check_env_replay(partial_surface):
    check_env(DeepSpeedMemoryEnv({"backend": "replay", "surface": str(partial_surface),
                                  "memory_budget": ["700MiB", "1GiB"]}), skip_render_check=True)


def test_observation_layout_is_documented():
    env = DeepSpeedMemoryEnv({"workload": "tiny"})
    assert env.observation_space["observations"].shape == (len(obs.FEATURES),) == (obs.SIZE,)
    assert env.observation_space["action_mask"].shape == (len(ACTIONS),)
    assert len(set(obs.FEATURES)) == len(obs.FEATURES)


def expected_edit(space: Space, config: Config, action: str) -> Config | None:
    """Brute force over Space.is_valid: where an edit action should lead (None: nowhere)."""
    if "=" in action:
        knob, value = action.split("=")
        if value not in space.choices.knob_values(knob) or getattr(config, knob) == value:
            return None
        target = replace(config, **{knob: value})
        return target if space.is_valid(target) else None
    knob, up = action[:-1], action.endswith("+")
    current = getattr(config, knob)
    values = sorted(v for v in space.choices.knob_values(knob) if (v > current if up else v < current))
    for value in values if up else reversed(values):
        target = replace(config, **{knob: value})
        if space.is_valid(target):
            return target
    return None


@pytest.mark.parametrize("env_config", [
    {"workload": "tiny", "memory_budget": "1GiB"},
    {"workload": {"model": "llama-7b", "global_batch": 48, "gpus": 8}, "hardware": "v100-32gb"},
])
def test_mask_allows_exactly_the_valid_edits(env_config):
    env = DeepSpeedMemoryEnv({**env_config, "start": "default"})
    env.reset(seed=0)
    land = env._episode.landscape
    space = land.space
    assert set(land.configs) == set(space.configs)
    for i, config in enumerate(land.configs):
        for a, action in enumerate(ACTIONS[FIRST_EDIT:JUMP], FIRST_EDIT):
            target = expected_edit(space, config, action)
            moved = land.moves[i, a]
            assert (moved >= 0) == (target is not None), (config, action)
            if target is not None:
                assert land.configs[moved] == target, (config, action)


def test_mask_avoids_unmeasured_configs_on_replay(partial_surface):
    env = DeepSpeedMemoryEnv({"backend": "replay", "surface": str(partial_surface), "memory_budget": "800MiB",
                              "horizon": 40})
    measured = {r.config for r in autotune.backends.replay.load_surface(partial_surface).results.values()}
    rng = np.random.default_rng(0)
    visited = 0
    for episode in range(30):  # the replay backend raises on an unmeasured config: none may be reached
        for _, action, _, info in random_episode(env, rng, seed=episode):
            if info["result"]:
                assert Config.from_dict(info["result"]["config"]) in measured
                visited += 1
    assert visited > 150
    land = env._episode.landscape
    assert set(land.configs) == measured
    full = Space(load_choices("cpu"), TINY, CPU)
    avoided = 0
    for i, config in enumerate(land.configs):
        for a, action in enumerate(ACTIONS[FIRST_EDIT:JUMP], FIRST_EDIT):
            target = expected_edit(land.space, config, action)  # the restricted space: measured configs only
            assert (land.moves[i, a] >= 0) == (target is not None)
            if target is not None:
                assert land.configs[land.moves[i, a]] == target
            avoided += expected_edit(full, config, action) not in (target, None)
    assert avoided > 50  # edits whose nearest valid config is unmeasured went further, or nowhere


def test_stop_and_run_masks_truncation_and_best_tracking():
    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "1GiB", "horizon": 3, "start": "default"})
    observation, info = env.reset(seed=0)
    mask = observation["action_mask"]
    assert mask[STOP] == 0 and mask[RUN] == 1 and info["result"] == {} and info["best"] == {}
    start = info["config"]
    observation, reward, terminated, truncated, info = env.step(RUN)
    assert info["result"]["config"] == start and info["trials"] == 1
    assert observation["action_mask"][RUN] == 0 and observation["action_mask"][STOP] == 1
    assert info["best"]["config"] == start and info["best"]["step"] == 1
    up = action_index("micro_batch+")
    observation, reward, terminated, truncated, info = env.step(up)
    assert info["config"]["micro_batch"] == 2 * start["micro_batch"] and not terminated and not truncated
    best = max((info["best"]["throughput_samples_per_s"],))
    assert best >= info["result"]["throughput_samples_per_s"] or info["best"]["config"] == info["config"]
    observation, reward, terminated, truncated, info = env.step(up)
    assert truncated and not terminated and info["trials"] == 3


def test_masked_action_runs_nothing_and_is_penalised():
    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "1GiB"})
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(STOP)  # no trial yet
    assert reward == -Reward().invalid_action_penalty and info["invalid_action"] and info["result"] == {}
    assert info["trials"] == 0 and not terminated
    # No action at all (outside Discrete(18)) is the caller's error, not a masked action: it was penalised as one.
    for action in (18, -1, 2.5):
        with pytest.raises(ValueError, match=rf"action {action!r}: allowed an integer 0\.\.17"):
            env.step(action)
    assert env.step(np.int64(STOP))[4]["trials"] == 0  # numpy's integers are actions


def test_info_result_is_the_trial_result_dict():
    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "900MiB", "noise": 0.1})
    rng = np.random.default_rng(1)
    backend = SimulatedBackend(TINY, CPU, 900 * MiB)
    for _, _, _, info in random_episode(env, rng, seed=3):
        if info["result"]:
            result = TrialResult.from_dict(info["result"])
            assert result.to_dict() == info["result"]
            assert result.status == backend.run(result.config).status


class Scripted:
    """A backend returning hand-made results in order, whatever the config."""

    name = "deepspeed"

    def __init__(self, results):
        self.results = list(results)
        self.seen = []

    def run(self, config):
        self.seen.append(config)
        return replace(self.results.pop(0), config=config)


def scripted_env(results, reward=None, horizon=10):
    backend = Scripted(results)
    env = DeepSpeedMemoryEnv({"backend": backend, "workload": "tiny", "hardware": "cpu", "memory_budget": 1000,
                              "reference_throughput": 100.0, "horizon": horizon, "start": "default",
                              "reward": reward or {}})
    env.reset(seed=0)
    return env, backend


def ok(throughput, peak=500):
    return TrialResult(Config(0, 1, 0, "bf16"), "ok", throughput, peak_memory_bytes=peak, backend="deepspeed")


def test_rewards_on_hand_made_results():
    cfg = Config(0, 1, 0, "bf16")
    results = [ok(50.0), ok(80.0), ok(90.0, peak=1500),
               TrialResult(cfg, "oom", peak_memory_bytes=1500, backend="deepspeed", error="OOM"),
               TrialResult(cfg, "oom", peak_memory_bytes=9000, backend="deepspeed", error="OOM"),
               TrialResult(cfg, "oom", backend="deepspeed", error="OOM"),
               TrialResult(cfg, "crash", backend="deepspeed", error="exit 1"),
               TrialResult(cfg, "timeout", backend="deepspeed", error="timeout")]
    env, backend = scripted_env(results)
    spec = Reward()
    rewards = []
    for _ in results:
        mask = env._mask_now
        action = RUN if mask[RUN] else int(np.flatnonzero(mask[2:])[0] + 2)
        _, reward, _, _, info = env.step(action)
        rewards.append(reward)
    c = spec.trial_cost
    assert rewards[0] == pytest.approx(0.5 - c)
    assert rewards[1] == pytest.approx(0.8 - c)
    assert info["best"]["throughput_samples_per_s"] == 80.0  # the 90 ran over budget
    over = -spec.oom_penalty - spec.over_budget_coef * 0.5 - c
    assert rewards[2] == pytest.approx(over) and rewards[3] == pytest.approx(over)
    assert rewards[4] == pytest.approx(-spec.oom_penalty - spec.over_budget_coef * spec.over_budget_cap - c)
    assert rewards[5] == pytest.approx(-spec.oom_penalty - c)
    assert rewards[6] == rewards[7] == pytest.approx(-spec.failure_penalty - c)
    # stop after 8 of 10 steps: the best (80) deployed for the 2 steps left, the stop's own included
    _, reward, terminated, _, info = env.step(STOP)
    assert terminated and reward == pytest.approx(2 * 0.8)
    assert len(backend.seen) == len(results)


def test_improvement_mode_and_coefficients():
    env, _ = scripted_env([ok(50.0), ok(40.0), ok(70.0)],
                          reward={"mode": "improvement", "trial_cost": 0.0, "oom_penalty": 2.0})
    rewards = []
    for _ in range(3):
        mask = env._mask_now
        action = RUN if mask[RUN] else int(np.flatnonzero(mask[2:])[0] + 2)
        rewards.append(env.step(action)[1])
    assert rewards == pytest.approx([0.5, 0.0, 0.2])  # sums to the best found / reference
    assert env.step(STOP)[1] == 0.0
    with pytest.raises(ConfigError, match="unknown reward key"):
        DeepSpeedMemoryEnv({"workload": "tiny", "reward": {"oom": 1}})
    with pytest.raises(ConfigError, match="mode"):
        Reward(mode="best")


def test_a_price_per_trial_second_charges_each_trial_its_seconds_in_the_episodes_unit():
    # Issue 41: a trial twice as long (an offloaded optimizer's) costs twice as much, a pruned config nothing.
    cfg = Config(0, 1, 0, "bf16")
    results = [replace(ok(50.0), wall_time_s=10.0), replace(ok(60.0), wall_time_s=20.0),
               TrialResult(cfg, "oom", backend="deepspeed", error="OOM", wall_time_s=4.0),
               TrialResult(cfg, "pruned", backend="deepspeed", error="unlikely to fit")]
    env, _ = scripted_env(results, reward={"mode": "improvement", "trial_cost": 0.001, "second_cost": 0.01,
                                           "oom_penalty": 0.2})
    unit = env._episode.seconds_unit
    # The unit: the predicted seconds of a trial of the tiny model's config predicted best on the CPU.
    assert 1.0 < unit < 60.0
    rewards = []
    for _ in results:
        mask = env._mask_now
        rewards.append(env.step(RUN if mask[RUN] else int(np.flatnonzero(mask[2:])[0] + 2))[1])
    assert rewards[0] == pytest.approx(0.5 - 0.001 - 0.01 * 10 / unit)
    assert rewards[1] == pytest.approx(0.1 - 0.001 - 0.01 * 20 / unit)
    assert rewards[2] == pytest.approx(-0.2 - 0.001 - 0.01 * 4 / unit)
    assert rewards[3] == pytest.approx(-0.001)


def test_the_seconds_block_prices_each_move_and_an_ops_first_build_until_a_trial_loaded_it():
    # Issue 41: with observe_seconds, each action's predicted trial seconds follow the base layout, unchanged.
    config = {"workload": {"model": "gpt2-xl", "global_batch": 64, "gpus": 8}, "hardware": "a100-40gb",
              "memory_budget": "20GiB", "start": "estimator", "seed": 0}
    plain, _ = DeepSpeedMemoryEnv(config).reset(seed=0)
    env = DeepSpeedMemoryEnv({**config, "observe_seconds": True})
    seen, _ = env.reset(seed=0)
    vector = seen["observations"]
    assert env.observation_space["observations"].shape == (obs.size(True),) == (obs.SIZE + len(ACTIONS),)
    assert np.array_equal(vector[:obs.SIZE], plain["observations"])
    assert len(set(obs.features(True))) == obs.size(True)
    ep, cur = env._episode, env._current
    land = ep.landscape
    seconds = vector[obs.SECONDS_AT:]
    assert seconds[STOP] == 0.0
    # No trial yet: every move pays its op's first build.
    run_s = land.trial_seconds[cur] + land.first_build_s[cur]
    assert land.first_build_s[cur] > 0 and seconds[RUN] == pytest.approx(obs.seconds_feature(run_s, ep.seconds_unit))
    offload = action_index("offload_optimizer=cpu")
    target = land.moves[cur, offload]
    assert land.configs[cur].offload_optimizer == "none" and target >= 0
    assert seconds[offload] > seconds[RUN]  # an offloaded optimizer's initialize and cpu_adam's build cost more
    for action in np.flatnonzero(land.moves[cur] < 0):
        if action not in (RUN, JUMP):
            assert seconds[action] == 0.0  # leads nowhere
    after, *_ = env.step(RUN)  # loads fused_adam: its first build is paid
    assert after["observations"][obs.SECONDS_AT + RUN] == pytest.approx(
        obs.seconds_feature(land.trial_seconds[cur], ep.seconds_unit))
    assert after["observations"][obs.SECONDS_AT + offload] == pytest.approx(seconds[offload])  # cpu_adam not built


def test_simulated_reward_is_one_at_the_optimum():
    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "800MiB", "start": "estimator"})
    _, info = env.reset(seed=0)
    assert info["optimum_throughput"] == info["reference_throughput"] > 0
    _, reward, _, _, info = env.step(RUN)  # the estimator's best is the noise-free optimum here
    assert info["result"]["status"] == "ok"
    assert reward == pytest.approx(1.0 - Reward().trial_cost)
    assert info["best"]["throughput_samples_per_s"] == pytest.approx(info["optimum_throughput"])


def test_replay_reference_is_the_surface_best(partial_surface):
    surface = autotune.backends.replay.load_surface(partial_surface)
    env = DeepSpeedMemoryEnv({"backend": "replay", "surface": str(partial_surface), "memory_budget": "800MiB"})
    _, info = env.reset(seed=0)
    best = surface.best(800 * MiB)
    assert info["reference_throughput"] == info["optimum_throughput"] == best.throughput_samples_per_s
    assert info["task"]["backend"] == "replay" and info["task"]["memory_budget_bytes"] == 800 * MiB


def test_seeded_episodes_repeat():
    def trace(seed):
        env = DeepSpeedMemoryEnv({"sampler": {"pool_size": 16}, "noise": 0.2})
        rng = np.random.default_rng(5)
        return [(a, r, info["config"]) for _, a, r, info in random_episode(env, rng, seed=seed)]

    assert trace(1) == trace(1)
    assert trace(1) != trace(2)


def test_bad_env_config_gives_one_line_errors():
    for config, match in [({"backend": "gpu"}, "allowed"), ({"horizon": 0}, "horizon"),
                          ({"start": "best"}, "start"), ({"workload": "gpt5"}, "unknown model"),
                          ({"backend": "replay"}, "surface"), ({"backend": "deepspeed"}, "workload"),
                          ({"workload": "tiny", "memory_budget": "lots"}, "size"), ({"colour": 1}, "unknown"),
                          ({"backend": "replay", "surface": "/nonexistent.jsonl"}, "no such file"),
                          ({"sampler": {"split": "dev"}}, "split"),
                          ({"workload": "tiny", "sampler": {}}, "sampler"),
                          ({"sampler": {"size": 3}}, "unknown sampler setting"), ({"noise": -1}, "noise"),
                          ({"workload": "tiny", "backend": "replay", "surface": "x", "noise": 0.1}, "simulated backend only"),
                          ({"backend": Scripted([]), "workload": "tiny", "reference_throughput": 0}, "reference")]:
        with pytest.raises(ConfigError, match=match):
            DeepSpeedMemoryEnv(config)


def test_flat_info_serves_vector_environments():
    make = lambda: DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "800MiB", "flat_info": True})  # noqa: E731
    envs = gym.vector.SyncVectorEnv([make, make])
    observation, _ = envs.reset(seed=0)
    rng = np.random.default_rng(0)
    statuses = set()
    for _ in range(100):
        actions = [int(rng.choice(np.flatnonzero(mask))) for mask in observation["action_mask"]]
        observation, _, _, _, info = envs.step(actions)
        statuses.update(info["status"])
        for text in info["result"]:
            if text:
                TrialResult.from_json(text)
    assert {"ok", "oom"} <= statuses
    assert info["reference_throughput"].dtype == np.float64
    # Gymnasium's checker steps twice with one seed and compares the infos: a NaN (an oom's throughput) equals
    # nothing, so the flat info failed it; what is not there is -1.
    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "800MiB", "flat_info": True})
    check_env(env, skip_render_check=True)
    observation, _ = env.reset(seed=0)
    infos = []
    while not any(info["status"] == "oom" for info in infos):
        observation, _, done, cut, info = env.step(int(rng.choice(np.flatnonzero(observation["action_mask"]))))
        infos.append(info)
        if done or cut:
            observation, _ = env.reset()
    oom = infos[-1]
    assert oom["throughput_samples_per_s"] == -1.0 and oom["peak_memory_bytes"] > 0


def test_check_env_on_the_committed_surface():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
    env = DeepSpeedMemoryEnv({"backend": "replay", "surface": str(path), "memory_budget": ["700MiB", "800MiB"]})
    check_env(env, skip_render_check=True)
    rng = np.random.default_rng(0)
    for seed in range(5):
        for _, _, _, info in random_episode(env, rng, seed=seed):
            assert info["task"]["backend"] == "replay"


def test_residuals_correct_the_knob_values_that_measured_off_the_prediction():
    from autotune.envs.residuals import Residuals

    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "24GiB", "start": "default"})
    env.reset(seed=0)
    land = env._episode.landscape
    model = Residuals(land)
    assert np.allclose(model.throughput(), land.throughput) and np.allclose(model.peak(), land.peak)
    fp32 = [i for i, c in enumerate(land.configs) if c.precision == "fp32"]
    bf16 = [i for i, c in enumerate(land.configs) if c.precision == "bf16"]
    budget = 24 * GiB
    for i in fp32[:3]:  # fp32 measures at half its prediction, bf16 as predicted
        model.observe(i, TrialResult(land.configs[i], "ok", land.throughput[i] / 2,
                                     peak_memory_bytes=int(land.peak[i])), budget)
    for i in bf16[:3]:
        model.observe(i, TrialResult(land.configs[i], "ok", land.throughput[i],
                                     peak_memory_bytes=int(land.peak[i])), budget)
    ratio = model.throughput() / land.throughput
    assert ratio[fp32].max() < 0.75 and ratio[bf16].min() > 0.9  # the precision's offset, shrunk towards 0
    assert np.allclose(model.peak(), land.peak)
    oom = fp32[5]  # out of memory, without a peak, under a budget 1.25 x its prediction: at least the budget
    model.observe(oom, TrialResult(land.configs[oom], "oom", error="OOM"), int(land.peak[oom] * 1.25))
    assert np.allclose(model.peak() / land.peak, 1.25)


def test_jump_goes_to_the_best_corrected_unmeasured_config_within_budget():
    env, _ = scripted_env([ok(50.0)] * 40, horizon=40)
    land, budget = env._episode.landscape, env._episode.task.memory_budget_bytes
    observation = env._observation()
    for _ in range(6):
        corrected_peak, corrected = env._residuals.peak(), env._residuals.throughput()
        fits = ~env._measured & land.host_fits & (corrected_peak <= budget)
        if not fits.any():
            assert observation["action_mask"][JUMP] == 0
            break
        target = int(np.flatnonzero(fits)[np.argmax(corrected[fits])])
        assert observation["action_mask"][JUMP] == 1 and env._jump == target
        observation, *_ = env.step(JUMP)
        assert env._current == target and env._measured[target]
    env.allowed[:] = False  # a caller's narrowed space with nothing left: jump leads nowhere
    assert env._observation()["action_mask"][JUMP] == 0


def test_jump_finds_a_config_the_estimator_ranks_low_once_trials_show_it():
    """A truth where bf16 runs at a third of its prediction: once a bf16 and an fp32 config are measured,
    jump leaves bf16 (with bf16 alone measured, the model cannot tell a slow precision from a slow machine)."""
    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "24GiB", "start": "estimator",
                              "backend": "simulated"})
    env.reset(seed=0)
    land = env._episode.landscape

    class Truth:
        name = "simulated"

        def run(self, config):
            i = land.index[config]
            slow = 3.0 if config.precision == "bf16" else 1.0
            return TrialResult(config, "ok", land.throughput[i] / slow, peak_memory_bytes=int(land.peak[i]))

    env._episode = replace(env._episode, backend=Truth())
    assert land.configs[env._current].precision == "bf16"  # the estimator's best
    env.step(RUN)
    env.step(JUMP)
    assert land.configs[env._current].precision == "bf16"
    env.step(action_index("precision=fp32"))
    for _ in range(3):
        env.step(JUMP)
        assert land.configs[env._current].precision == "fp32"


def test_each_actions_fit_probability_is_the_sweeps_memory_error_model_of_the_trials_so_far():
    """The observation's per-action probability of fitting is autotune/prediction/uncertainty.py's posterior given the
    episode's measured peaks (one trial at a time here, in one batch there), at the config the action leads to."""
    from autotune.prediction.uncertainty import NOISE_MEMORY, PRIOR_MEMORY, Forecast, fit_error_model

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
    budget = int(0.71 * GiB)
    env = DeepSpeedMemoryEnv({"backend": "replay", "surface": str(path), "memory_budget": [budget]})
    observation, _ = env.reset(seed=0)
    land = env._episode.landscape
    fixed_noise = (NOISE_MEMORY[0], 1e12, NOISE_MEMORY[0])  # the environment does not re-estimate the noise
    observed = []
    statuses = []
    for action in [RUN, action_index("micro_batch-"), action_index("ckpt_interval+"), JUMP, action_index("zero_stage+")]:
        model = fit_error_model(observed, PRIOR_MEMORY, fixed_noise)
        targets = land.moves[env._current].copy()
        targets[RUN], targets[JUMP] = env._current, env._jump
        for a, target in enumerate(targets):
            got = observation["observations"][obs.FIT_AT + a]
            if target < 0:
                assert got == 0.0
                continue
            config = land.configs[target]
            want = Forecast(int(land.peak[target]), 1.0, model.predict(config), (0.0, 0.0)).fit_probability(budget)
            assert got == pytest.approx(want, abs=1e-4), (ACTIONS[a], config.label())
        if not observation["action_mask"][action]:
            continue
        observation, _, _, _, info = env.step(action)
        result = info["result"]
        statuses.append(result["status"])
        config = land.configs[env._current]
        observed.append((config, float(np.log(result["peak_memory_bytes"] / land.peak[env._current]))))
    assert "oom" in statuses and "ok" in statuses  # both sides of the budget were measured
