"""The RL policy's parts that need no Ray: the masked network, the exported policy file, the distorted
training environment, the training figures and settings, and the `rl` and `hybrid` strategies through
the real sweep loop on the simulated and replay backends."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from autotune.backends.replay import ReplayBackend, load_surface, surface_space
from autotune.backends.simulated import SimulatedBackend
from autotune.values.config import ConfigError
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.envs import DeepSpeedMemoryEnv
from autotune.envs.sampler import Task
from autotune.values.hardware import PROFILES
from autotune.search.pruning import Pruner
from autotune.values.results import TrialResult, append_result
from autotune.rl.figures import episode_figures
from autotune.rl.network import NetSpec, mask_logits, policy_net
from autotune.rl.policy import Policy, layout, save_policy
from autotune.rl.simulator import DistortedBackend, TrainingEnv, TrainingEnvFactory, distorted_task
from autotune.rl.train import TrainSettings, prepare, samplers
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.strategies import STRATEGIES, SearchContext, make_strategy
from autotune.strategies.hybrid import HybridStrategy
from autotune.strategies.rl import RLStrategy
from autotune.values.workload import make_workload

optuna.logging.set_verbosity(optuna.logging.WARNING)
GiB = 2**30
N_ACTIONS = len(layout()["actions"])
N_FEATURES = len(layout()["features"])
GPU_WORKLOAD = make_workload("gpt2-xl", 64, 8)
GPU = PROFILES["a100-40gb"]
SMALL_POOL = samplers("train", 8, 0, 0.25)


def random_policy(folder: Path, seed: int = 0, horizon: int = 16, seconds: bool = False) -> Policy:
    """A policy with random weights, saved and loaded as a trained one would be (`seconds`: trained on the
    observation with each action's predicted trial seconds)."""
    torch.manual_seed(seed)
    spec = NetSpec(len(layout(seconds)["features"]), N_ACTIONS, (32, 32))
    net = policy_net(spec)
    torch.nn.init.normal_(net[-1].weight, std=1.0)  # not near-uniform: choices differ between actions
    save_policy(folder, spec, net.state_dict(), {**layout(seconds), "training": {"settings": {"horizon": horizon}}})
    return Policy.load(folder)


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Policy:
    return random_policy(tmp_path_factory.mktemp("policy"))


# -- network and policy file --------------------------------------------------------------------------

def test_masked_logits_give_forbidden_actions_zero_probability():
    logits = torch.randn(64, N_ACTIONS) * 10
    mask = (torch.rand(64, N_ACTIONS) < 0.4).float()
    mask[:, 1] = 1.0  # at least one allowed per row
    masked = mask_logits(logits, mask)
    probs = torch.softmax(masked, dim=-1)
    assert torch.all(probs[mask == 0] == 0)
    assert torch.allclose(probs.sum(-1), torch.ones(64))
    assert torch.all(mask.gather(1, masked.argmax(-1, keepdim=True)) == 1)
    assert torch.equal(masked[mask == 1], logits[mask == 1])


def test_policy_round_trips_through_its_files(tmp_path, policy):
    obs = {"observations": np.random.default_rng(0).uniform(-1, 1, N_FEATURES).astype(np.float32),
           "action_mask": np.ones(N_ACTIONS, np.float32)}
    again = Policy.load(policy.path)
    assert np.array_equal(again.logits(obs), policy.logits(obs))
    assert json.loads((policy.path / "policy.json").read_text())["actions"] == layout()["actions"]
    assert not policy.observes_seconds
    other = random_policy(tmp_path / "other", seed=1)
    assert not np.allclose(other.logits(obs), policy.logits(obs))


def test_policy_acts_only_within_the_mask(policy):
    rng = np.random.default_rng(1)
    for _ in range(300):
        mask = (rng.random(N_ACTIONS) < 0.3).astype(np.float32)
        mask[rng.integers(N_ACTIONS)] = 1.0
        obs = {"observations": rng.uniform(-1, 1, N_FEATURES).astype(np.float32), "action_mask": mask}
        assert mask[policy.act(obs)] == 1.0
    with pytest.raises(ValueError, match="allows no action"):
        policy.act({"observations": np.zeros(N_FEATURES, np.float32), "action_mask": np.zeros(N_ACTIONS, np.float32)})


def test_policy_of_another_layout_or_missing_files_is_refused(tmp_path, policy):
    with pytest.raises(ConfigError, match="policy.pt and policy.json"):
        Policy.load(tmp_path)
    folder = tmp_path / "old"
    spec = NetSpec(N_FEATURES, N_ACTIONS, (8,))
    save_policy(folder, spec, policy_net(spec).state_dict(), {**layout(), "actions": ["stop", "run"]})
    with pytest.raises(ConfigError, match="another environment layout.*autotune rl train"):
        Policy.load(folder)
    assert Policy.load(folder, check_layout=False).spec == spec


# -- the distorted training environment ----------------------------------------------------------------

def test_training_env_passes_gymnasiums_checker_and_keeps_a_flat_info():
    env = TrainingEnv({"samplers": SMALL_POOL, "noise": 0.1, "start": "mixed", "seed": 0})
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=3)
    keys = set(info)
    rng = np.random.default_rng(0)
    for _ in range(200):
        obs, _, terminated, truncated, info = env.step(int(rng.choice(np.flatnonzero(obs["action_mask"]))))
        assert set(info) == keys and all(isinstance(v, (int, float, str)) for v in info.values())
        if terminated or truncated:
            obs, info = env.reset()


def test_distortion_hides_a_truth_whose_optimum_is_exhausted():
    task = Task(GPU_WORKLOAD, GPU, 20 * GiB, load_choices("default"))
    truth = distorted_task(task, 0.3, 0.0, seed=5)
    same = distorted_task(task, 0.3, 0.0, seed=5)
    assert np.array_equal(truth.throughput, same.throughput)  # a seed fixes the draw
    configs = truth.landscape.configs
    results = [truth.run(c) for c in configs]
    fitting = [r.throughput_samples_per_s for r in results if r.fits(task.memory_budget_bytes)]
    assert truth.optimum == pytest.approx(max(fitting))
    assert all(r.status in ("ok", "oom") for r in results)
    # The truth is not the estimator: its ranking differs, but not beyond recognition.
    nominal = truth.landscape.throughput
    ratio = truth.throughput / nominal
    assert ratio.std() > 0.05
    assert np.corrcoef(np.log(nominal), np.log(truth.throughput))[0, 1] > 0.5
    flat = distorted_task(task, 0.0, 0.0, seed=5)
    assert np.allclose(flat.throughput, nominal) and np.allclose(flat.peak, flat.landscape.peak)


def test_distortion_widths_are_the_spreads_it_draws_and_its_knob_offsets_leave_the_per_config_term():
    """Distortion.widths and knob_offsets (what benchmarks/stop_bounds.py tells a figure and a search): over many
    draws a knob value's offset spreads as widths says, and the truth less the knob offsets is the per-config term."""
    from autotune.backends.distorted import Distortion

    task = Task(GPU_WORKLOAD, GPU, 20 * GiB, load_choices("default"))
    space = Space(task.choices, task.workload, task.hardware)
    draws = [Distortion.draw(space, 0.3, np.random.default_rng(seed)) for seed in range(400)]
    for k, (knob, width) in enumerate(Distortion.widths(space, 0.3)):
        offsets = np.array([d.throughput[k] for d in draws])  # draws x values
        if knob.startswith("offload"):
            offsets = offsets[:, np.asarray(space.choices.knob_values(knob)) != "none"]
        assert np.sqrt((offsets ** 2).mean()) == pytest.approx(width, rel=0.15), knob
    truth = distorted_task(task, 0.3, 0.0, seed=5)
    codes = truth.landscape.codes
    rest = np.log(truth.throughput / truth.landscape.throughput) - truth.distortion.knob_offsets(codes)
    assert rest.std() == pytest.approx(truth.distortion.per_config_sigma, rel=0.2)


def test_episode_info_judges_the_best_config_by_its_true_throughput():
    env = TrainingEnv({"samplers": SMALL_POOL, "noise": 0.3, "start": "estimator", "seed": 1})
    obs, info = env.reset(seed=2)
    assert math.isfinite(info["optimum_throughput"]) or math.isnan(info["optimum_throughput"])
    obs, _, _, _, info = env.step(1)  # run the start config
    backend = env.unwrapped._episode.backend
    assert isinstance(backend, DistortedBackend)
    if info["status"] == "ok":
        true = backend.true_throughput(env.unwrapped._episode.landscape.configs[env.unwrapped._current])
        assert info["best_true_throughput"] == pytest.approx(true)
        assert info["best_throughput"] != pytest.approx(true)  # the noisy measurement
        assert info["best_true_throughput"] <= info["optimum_throughput"] * (1 + 1e-9)


def test_env_copies_of_one_runner_share_their_estimator_caches():
    import pickle

    factory = TrainingEnvFactory()
    first, second = factory({"samplers": SMALL_POOL, "seed": 0}), factory({"samplers": SMALL_POOL, "seed": 1})
    first.reset(seed=0)
    assert len(second.source.caches.landscapes) == len(first.source.caches.landscapes) == 1  # built once, seen by both
    second.reset(seed=0)
    assert second._episode.landscape is first._episode.landscape
    assert second._episode.backend is not first._episode.backend  # each copy draws its own hidden truth
    fresh = pickle.loads(pickle.dumps(factory))({"samplers": SMALL_POOL})
    assert len(fresh.source.caches.landscapes) == 0  # another process starts its own caches


def test_episode_figures():
    base = {"trials": 4, "best_throughput": 99.0, "best_true_throughput": 97.0, "optimum_throughput": 100.0}
    assert episode_figures(base, 1) == {"trials": 4.0, "within_2pct": 0.0, "best_over_optimum": 0.97,
                                        "found_feasible": 1.0, "oom_trials": 1.0}
    assert episode_figures({**base, "best_true_throughput": 98.5})["within_2pct"] == 1.0
    nothing = episode_figures({**base, "best_throughput": 0.0, "best_true_throughput": 0.0})
    assert nothing["within_2pct"] == 0.0 and nothing["found_feasible"] == 0.0
    unknown = episode_figures({**base, "optimum_throughput": float("nan")})
    assert unknown["within_2pct"] is None and unknown["best_over_optimum"] is None


# -- training settings ---------------------------------------------------------------------------------

def test_training_settings_are_checked_and_a_run_resumes_only_with_the_same_ones(tmp_path):
    with pytest.raises(ConfigError, match="backend='nvme'"):
        TrainSettings(backend="nvme")
    with pytest.raises(ConfigError, match="needs at least one surface"):
        TrainSettings(backend="replay")
    with pytest.raises(ConfigError, match="minibatch=512 exceeds train_batch=256"):
        TrainSettings(train_batch=256)
    settings = TrainSettings(iterations=3, seed=4)
    run, _, checkpoint = prepare(tmp_path, settings)
    assert checkpoint is None and run.settings() == settings
    prepare(tmp_path, TrainSettings(iterations=10, seed=4, workers=2))  # more iterations, other resources: fine
    with pytest.raises(ConfigError, match=r"other settings \(seed: recorded 4, given 5\)"):
        prepare(tmp_path, TrainSettings(iterations=10, seed=5))
    assert TrainSettings.from_dict(settings.to_dict()) == settings
    # A price per trial-second (issue 41) reaches the environment's reward and the command that trains again.
    priced = TrainSettings(trial_cost=0.0, second_cost=0.005)
    assert priced.env_config()["reward"]["second_cost"] == 0.005 and "--second-cost 0.005" in priced.command("o")
    old = {k: v for k, v in priced.to_dict().items() if k not in ("second_cost", "observe_seconds")}  # from before
    assert TrainSettings.from_dict(old).second_cost == 0.0 and not TrainSettings.from_dict(old).observe_seconds
    observing = TrainSettings(observe_seconds=True)
    assert observing.env_config()["observe_seconds"] and observing.command("o").endswith("--observe-seconds")


def fake_train(calls: list, rows: tuple = (), interrupt: bool = False):
    """autotune.rl.train.train without RLlib: says it starts (fresh), reports `rows`, then returns or is interrupted."""
    from autotune.rl.train import Start, TrainResult

    def train(out, settings, *, on_iteration, on_start, **_):
        calls.append(settings)
        on_start(Start(Path(out), settings.iterations, 0, None))
        if interrupt:
            raise KeyboardInterrupt
        for row in rows:
            on_iteration(row)
        return TrainResult(Path(out), settings.iterations, 0, rows[-1] if rows else None, None, None)

    return train


def small_run(out: Path, iterations: int, checkpoint: int | None, **settings):
    """A training run's folder as `autotune rl train` leaves it (default settings), without RLlib: its settings,
    progress lines and, with `checkpoint`, an (empty) checkpoint folder that `latest` names."""
    from autotune.rl.train import Iteration

    run, _, _ = prepare(out, TrainSettings(iterations=iterations, **settings))
    for i in range(1, (checkpoint or 0) + 1):
        run.append_progress(Iteration(i, 10 * i, i, 0.5, 3.0, 0.1, 0.9, 0.2, float(i)))
    if checkpoint:
        (run.checkpoints / f"{checkpoint:06d}").mkdir(parents=True)
        run.point_latest(f"{checkpoint:06d}")
    return run


def test_replay_training_draws_budgets_across_the_surfaces_peaks_so_that_episodes_run_out_of_memory(
        tiny_surface, tmp_path, monkeypatch, capsys):
    from cli_run import cli

    from autotune.rl.train import replay_budgets

    surface = load_surface(tiny_surface)
    peaks = sorted(r.peak_memory_bytes for r in surface.results.values() if r.ok)
    calls: list = []
    monkeypatch.setattr("autotune.rl.train.train", fake_train(calls))
    replay = ["rl", "train", "--backend", "replay", "--surface", str(tiny_surface), "--out", str(tmp_path / "p")]
    code, out, err = cli(replay, capsys)
    assert code == 0, err
    budgets = calls[-1].memory_budget_bytes
    assert budgets == replay_budgets([surface]) and len(budgets) == 4
    assert budgets[0] == peaks[round(0.25 * (len(peaks) - 1))] and budgets[-1] == peaks[-1]
    assert "replay backend at " in out and ("GiB" in out or "MiB" in out)
    env = TrainingEnv({**calls[-1].env_config(), "seed": 0})
    assert env.config.memory_budget == budgets
    rng, seen, statuses = np.random.default_rng(0), set(), []
    obs, _ = env.reset(seed=0)
    for _ in range(200):
        seen.add(env._episode.task.memory_budget_bytes)
        obs, _, terminated, truncated, info = env.step(int(rng.choice(np.flatnonzero(obs["action_mask"]))))
        statuses.append(info["status"])
        if terminated or truncated:
            obs, _ = env.reset()
    assert seen <= set(budgets) and len(seen) > 1 and "oom" in statuses  # at the device's memory: never
    # --memory-budget: one size or several (argtypes.size each), recorded; another one on resume is refused
    code, _, err = cli([*replay, "--memory-budget", "1GiB,600MiB"], capsys)
    assert code == 0 and calls[-1].memory_budget_bytes == (600 * 2**20, 2**30)
    assert calls[-1].env_config()["memory_budget"] == [600 * 2**20, 2**30]
    assert "--memory-budget 629145600,1073741824" in calls[-1].command("o")
    run, _, _ = prepare(tmp_path / "r", calls[-1])
    assert json.loads((run.path / "settings.json").read_text())["memory_budget_bytes"] == [600 * 2**20, 2**30]
    with pytest.raises(ConfigError, match=r"memory_budget_bytes: recorded \[600 MiB, 1 GiB\], given \[1 GiB\]"):
        prepare(tmp_path / "r", TrainSettings(backend="replay", surfaces=(str(tiny_surface),),
                                              memory_budget_bytes=(2**30,)))
    code, _, err = cli(["rl", "train", "--memory-budget", "1GiB", "--out", str(tmp_path / "s")], capsys)
    assert code == 2 and "--memory-budget is only for --backend replay" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match="memory_budget_bytes is for the replay backend"):
        TrainSettings(memory_budget_bytes=(2**30,))


def test_quiet_training_prints_its_result_alone(tmp_path, monkeypatch, capsys):
    from cli_run import cli

    from autotune.rl.train import Iteration

    rows = (Iteration(1, 10, 1, 0.5, 3.0, 0.1, 0.9, 0.2, 1.0),)
    monkeypatch.setattr("autotune.rl.train.train", fake_train([], rows))
    code, out, _ = cli(["rl", "train", "--iterations", "1", "--out", str(tmp_path / "p")], capsys)
    assert code == 0 and "training a policy in" in out and "iter    1/1" in out and "done: 1 iteration;" in out
    code, out, _ = cli(["rl", "train", "--quiet", "--iterations", "1", "--out", str(tmp_path / "p")], capsys)
    assert code == 0 and out.splitlines() == [line for line in out.splitlines() if line.startswith("done: ")] != []


def test_an_interrupt_before_the_first_checkpoint_says_that_the_command_starts_over(tmp_path, monkeypatch, capsys):
    from cli_run import cli

    monkeypatch.setattr("autotune.rl.train.train", fake_train([], interrupt=True))
    code, out, _ = cli(["rl", "train", "--out", str(tmp_path / "p")], capsys)
    assert code == 130 and "nothing was saved, the same command starts over" in out and "resumes" not in out
    small_run(tmp_path / "q", 10, 5)
    code, out, _ = cli(["rl", "train", "--out", str(tmp_path / "q")], capsys)
    assert code == 130 and f"resumes from checkpoint {tmp_path / 'q' / 'checkpoints' / '000005'}" in out


def test_a_run_asked_for_fewer_iterations_than_it_holds_trains_nothing_and_keeps_its_record(
        tmp_path, monkeypatch, capsys):
    from cli_run import cli

    import autotune.rl.train as training

    def no_ray(*_args, **_kwargs):
        raise AssertionError("Ray started for a run with nothing to train")

    monkeypatch.setattr(training, "connect_ray", no_ray)
    run = small_run(tmp_path / "pol1", 7, 7)
    code, out, err = cli(["rl", "train", "--iterations", "3", "--out", str(run.path)], capsys)
    assert code == 0, err
    assert f"{run.path} is already trained to 7 iterations (--iterations 3 asks for no more): nothing to train" in out
    assert "resuming" not in out and "done: 7 iterations" in out
    assert run.settings().iterations == 7
    # Asked for more: recorded; interrupted at 5 of 7 and asked for 6: 6, not 7.
    prepare(run.path, TrainSettings(iterations=9))
    assert run.settings().iterations == 9
    interrupted = small_run(tmp_path / "int", 7, 5)
    prepare(interrupted.path, TrainSettings(iterations=6))
    assert interrupted.settings().iterations == 6
    # The provenance names the run by its absolute path and the iterations of the checkpoint exported.
    monkeypatch.chdir(tmp_path)
    meta = training.training_meta(training.TrainingRun("pol1"), "000007")
    assert f"--out {run.path.resolve()} --iterations 7 " in meta["command"] and meta["settings"]["iterations"] == 7
    earlier = training.training_meta(training.TrainingRun("pol1"), "000005")
    assert "--iterations 5 " in earlier["command"] and [r["iteration"] for r in earlier["progress"]] == [1, 2, 3, 4, 5]


def test_the_provenance_of_a_replay_trained_policy_names_its_surface_and_the_settings_that_applied(
        tiny_surface, tmp_path):
    import hashlib

    from autotune.rl.train import provenance, training_meta

    replay = TrainSettings(iterations=2, backend="replay", surfaces=(str(tiny_surface),),
                           memory_budget_bytes=(600 * 2**20, 2**30))
    run, _, _ = prepare(tmp_path / "r", replay)
    text = provenance(training_meta(run, "000002"))
    digest = hashlib.sha256(tiny_surface.read_bytes()).hexdigest()
    assert f"`{tiny_surface}` (SHA-256 {digest})" in text and "budgets 600 MiB, 1 GiB, one drawn per episode" in text
    assert "simulat" not in text and "memory_budget_bytes=[629145600, 1073741824]" in text
    for ignored in ("noise", "randomize", "pool_size", "cpu_share"):
        assert f"{ignored}=" not in text and f"--{ignored.replace('_', '-')} " not in text
    simulated, _, _ = prepare(tmp_path / "s", TrainSettings(iterations=2))
    text = provenance(training_meta(simulated, "000002"))
    assert "with the distorted simulation (autotune/rl/simulator.py)" in text and "noise=0.1" in text
    assert "memory_budget_bytes" not in text and "surfaces=" not in text
    # noise, say, shapes no replayed episode: not compared when such a run resumes
    prepare(tmp_path / "r", TrainSettings(iterations=2, backend="replay", surfaces=(str(tiny_surface),),
                                          memory_budget_bytes=(600 * 2**20, 2**30), noise=0.5))


def test_a_second_trainer_is_refused_before_anything_is_said(tmp_path, capsys):
    from cli_run import cli

    from autotune.rl.train import TrainingRun

    run = small_run(tmp_path / "polk", 5, None)
    with TrainingRun(run.path).locked():
        code, out, err = cli(["rl", "train", "--out", str(run.path)], capsys)
    assert code == 2 and "is in use by another trainer" in err and out == ""


def test_a_training_runs_folder_given_as_the_policy_names_its_policy_folder(tmp_path):
    from autotune.strategies.rl import load_policy

    random_policy(tmp_path / "pol1" / "policy")
    hint = f"(a training run: its policy is '{tmp_path / 'pol1' / 'policy'}')"
    with pytest.raises(ConfigError, match=re.escape(hint)):
        load_policy(tmp_path / "pol1")
    with pytest.raises(ConfigError, match=re.escape(hint)):
        Policy.load(tmp_path / "pol1")
    with pytest.raises(ConfigError) as refused:  # any other folder: no hint
        load_policy(tmp_path)
    assert "training run" not in str(refused.value)


def test_a_training_run_shares_the_run_folder_lock_and_atomic_files(tmp_path):
    from autotune.rl.train import Iteration, TrainingRun
    from autotune.search.rundir import RunDir, RunDirBusy, RunFolder

    run, _, _ = prepare(tmp_path / "run", TrainSettings(iterations=3, seed=4))
    assert isinstance(run, TrainingRun) and isinstance(run, RunFolder) and not isinstance(run, RunDir)
    assert json.loads((run.path / "settings.json").read_text()) == TrainSettings(iterations=3, seed=4).to_dict()
    rows = [Iteration(i, 10 * i, i, 0.5, 3.0, 0.1, 0.9, 0.2, float(i)) for i in (1, 2, 3)]
    for row in rows:
        run.append_progress(row)
    assert run.progress() == rows and run.keep_progress(2) == rows[:2] and run.progress() == rows[:2]
    (run.checkpoints / "000002").mkdir(parents=True)
    run.point_latest("000002")
    assert run.latest_checkpoint() == run.checkpoints / "000002"
    assert not list(run.path.rglob("*.tmp"))
    with run.locked():
        with pytest.raises(RunDirBusy, match=r"is in use by another trainer \(pid \d+\)"):
            with TrainingRun(run.path).locked():
                pass
    with TrainingRun(run.path).locked():  # released
        pass


def test_ray_is_joined_through_the_clusters_connect_and_local_training_sizes_its_instance(monkeypatch):
    import sys
    import types

    import autotune.trials.cluster as ray_driver
    from autotune.rl.train import connect_ray

    calls = []
    fake = types.SimpleNamespace(is_initialized=lambda: False, init=lambda **kw: calls.append(("init", kw)))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(ray_driver, "connect", lambda address, num_cpus=None: calls.append(("connect", address, num_cpus)))
    assert connect_ray("10.0.0.1:6379", 2) and calls == [("connect", "10.0.0.1:6379", None)]
    calls.clear()
    for address in (None, "local"):
        assert connect_ray(address, 3)
    assert calls == [("connect", "local", 3)] * 2
    fake.is_initialized = lambda: True  # already connected: nothing to do, nothing to disconnect
    calls.clear()
    assert not connect_ray("10.0.0.1:6379", 2) and calls == []


def test_training_tasks_hold_out_the_test_split_and_tiny():
    env = TrainingEnv({"samplers": samplers("train", 64, 0, 0.5), "seed": 0})
    assert [s.pool[0].hardware.is_cpu for s in env.source.samplers] == [False, True]
    for sampler in env.source.samplers:
        for task in sampler.pool:
            assert task.workload.model.name != "tiny" and sampler.held_out(task) == ()
    small = TrainingEnv({"samplers": samplers("train", 4, 0, 0.5), "seed": 0})
    kinds = set()
    for i in range(30):
        small.reset(seed=i)
        kinds.add(small._episode.task.hardware.is_cpu)
    assert kinds == {True, False}  # both samplers draw episodes


# -- the rl and hybrid strategies through the sweep loop -------------------------------------------------

def sweep(strategy, space: Space, backend, budget: int, trials: int) -> Sweep:
    pruner = Pruner(space.workload, space.hardware, budget)
    record: list[TrialResult] = []
    s = Sweep(strategy, pruner, record.append, backend.name, (), None, len(space))
    run_local(s, backend, Budget(trials), QuietProgress())
    assert record == s.results
    return s


@pytest.fixture(scope="module")
def gpu_space() -> Space:
    return Space(load_choices("default"), GPU_WORKLOAD, GPU)


def test_a_pruned_proposal_is_not_a_trial_and_never_proposed_again(gpu_space):
    strategy = RLStrategy(SearchContext(gpu_space, 20 * GiB, 0))  # the shipped policy
    refused = []
    for _ in range(5):  # the tuner prunes the policy's first five proposals
        config = strategy.propose()
        assert config is not None and config not in refused
        refused.append(config)
        strategy.observe(config, TrialResult(config, "pruned", error="predicted over budget"))
        assert strategy.proposed == 0 and strategy.env.unwrapped._trials == 0
    config = strategy.propose()
    assert config not in refused and strategy.proposed == 1


def test_rl_walks_from_the_estimators_best_and_never_repeats(gpu_space, policy):
    budget = 20 * GiB
    backend = SimulatedBackend(GPU_WORKLOAD, GPU, budget, noise=0.1, seed=0)
    strategy = RLStrategy(SearchContext(gpu_space, budget, 0), policy)
    s = sweep(strategy, gpu_space, backend, budget, 40)
    configs = [r.config for r in s.results]
    # One episode of the training horizon at most; a proposal the tuner prunes is recorded but is no trial.
    assert 1 <= sum(r.status != "pruned" for r in s.results) <= 16
    assert len(set(configs)) == len(configs) and all(c in gpu_space for c in configs)
    pruner = Pruner(GPU_WORKLOAD, GPU, budget)
    fitting = [c for c in gpu_space if pruner.predict(c).fits(budget)]
    start = max(fitting, key=lambda c: pruner.predict(c).throughput_samples_per_s)
    # The first trial is the start config or one edit away from it.
    first = configs[0]
    assert first == start or sum(getattr(first, k) != getattr(start, k) for k in first.to_dict()) == 1
    # Deterministic: the same walk again.
    again = sweep(RLStrategy(SearchContext(gpu_space, budget, 0), policy), gpu_space,
                  SimulatedBackend(GPU_WORKLOAD, GPU, budget, noise=0.1, seed=0), budget, 40)
    assert [r.config for r in again.results] == configs


class StopFirst:
    """A policy whose first choice is always `stop`, then the first action allowed."""

    meta: dict = {}
    observes_seconds = False

    def act(self, obs) -> int:
        mask = np.asarray(obs["action_mask"])
        return 0 if mask[0] > 0.5 else int(np.flatnonzero(mask > 0.5)[0])


def test_the_policys_own_stop_never_ends_the_search_the_sweep_does(gpu_space):
    budget = 20 * GiB
    s = sweep(RLStrategy(SearchContext(gpu_space, budget, 0), StopFirst()), gpu_space,
              SimulatedBackend(GPU_WORKLOAD, GPU, budget), budget, 6)
    assert sum(r.status != "pruned" for r in s.results) == 6  # its trial budget ended it, not the policy
    # In hybrid the policy may stop: its stop hands the search over to Optuna as soon as the environment allows a
    # stop (after its first trial), not after its 8 turns.
    hybrid = HybridStrategy(SearchContext(gpu_space, budget, 0), StopFirst(), policy_trials=8)
    s = sweep(hybrid, gpu_space, SimulatedBackend(GPU_WORKLOAD, GPU, budget), budget, 6)
    assert sum(r.status != "pruned" for r in s.results) == 6
    assert len(hybrid.proposed) == 1 and not hybrid.in_policy


@pytest.mark.parametrize("seconds", [False, True])
def test_rl_proposals_follow_the_policys_greedy_masked_actions(gpu_space, policy, seconds, tmp_path):
    # A policy trained on each action's predicted trial seconds (issue 41) gets them from the strategy's environment.
    if seconds:
        policy = random_policy(tmp_path / "seconds", seconds=True)
        assert policy.observes_seconds and policy.spec.obs_dim == N_FEATURES + N_ACTIONS
    budget = 20 * GiB
    strategy = RLStrategy(SearchContext(gpu_space, budget, 0), policy)
    backend = SimulatedBackend(GPU_WORKLOAD, GPU, budget)
    shadow = DeepSpeedMemoryEnv({"workload": GPU_WORKLOAD, "hardware": GPU, "memory_budget": budget,
                                 "space": load_choices("default"), "start": "estimator", "mask_revisits": True,
                                 "observe_seconds": seconds})
    obs, _ = shadow.reset(seed=0)
    for _ in range(16):
        config = strategy.propose()
        # The policy's own stop is masked: the sweep decides when the search ends.
        mask = np.array(obs["action_mask"])
        mask[0] = 0
        action = policy.act({**obs, "action_mask": mask})
        assert config is not None
        obs, _, terminated, truncated, info = shadow.step(action)
        assert info["config"] == config.to_dict()
        strategy.observe(config, backend.run(config).under_budget(budget))
        if terminated or truncated:
            assert strategy.propose() is None
            break


def make_surface(path: Path, space: Space, truth: DistortedBackend, keep: float = 0.7) -> Path:
    """A replay surface of a distorted simulation, with some configs left unmeasured."""
    rng = np.random.default_rng(0)
    for config in space:
        if rng.random() < keep:
            result = truth.run(config).under_budget(None)
            extra = {"workload": space.workload.to_dict(), "hardware": space.hardware.name}
            append_result(path, TrialResult(config, result.status, result.throughput_samples_per_s,
                                            result.tokens_per_s, result.step_time_s, result.peak_memory_bytes,
                                            None, result.wall_time_s, "deepspeed", result.error, extra))
    return path


@pytest.fixture(scope="module")
def tiny_surface(tmp_path_factory) -> Path:
    tiny = make_workload("tiny")
    space = Space(load_choices("cpu"), tiny, PROFILES["cpu"])
    truth = distorted_task(Task(tiny, PROFILES["cpu"], PROFILES["cpu"].memory_bytes, space.choices), 0.4, 0.05, 11)
    return make_surface(tmp_path_factory.mktemp("surface") / "tiny.jsonl", space, truth)


def test_rl_on_replay_proposes_only_measured_configs(tiny_surface, policy):
    surface = load_surface(tiny_surface)
    space = surface_space(surface)
    assert len(space) < len(Space(load_choices("cpu"), space.workload, space.hardware))
    for seed in range(4):
        policy_s = random_policy(Path(str(tiny_surface) + f".policy{seed}"), seed=seed)
        budget = int(1.2 * GiB)
        s = sweep(RLStrategy(SearchContext(space, budget, seed), policy_s), space, ReplayBackend(surface, budget),
                  budget, 30)
        assert s.results and all(r.config in surface.results for r in s.results)


@pytest.mark.slow
def test_hybrid_runs_the_policy_first_then_optuna_told_every_result(gpu_space, policy, tmp_path):
    budget = 20 * GiB
    rl_alone = sweep(RLStrategy(SearchContext(gpu_space, budget, 0), policy, max_trials=8), gpu_space,
                     SimulatedBackend(GPU_WORKLOAD, GPU, budget), budget, 30)
    walk = [r.config for r in rl_alone.results]
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    hybrid = HybridStrategy(SearchContext(gpu_space, budget, 0, storage=storage), policy, policy_trials=8)
    s = sweep(hybrid, gpu_space, SimulatedBackend(GPU_WORKLOAD, GPU, budget), budget, 16)
    configs = [r.config for r in s.results]
    assert configs[:len(walk)] == walk and len(walk) < len(configs)  # the policy's proposals first, then Optuna
    assert sum(r.status != "pruned" for r in s.results) == 16  # Optuna used the rest of the budget
    study = optuna.load_study(study_name="autotune", storage=storage)
    # Every result is told: a config that ran and fit is COMPLETE, a failed or pruned one PRUNED.
    told = {tuple(sorted(t.params.items())) for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")}
    for config in configs:
        assert tuple(sorted(hybrid.search.params_of(config).items())) in told  # every result warm-started the study

    interleaved = HybridStrategy(SearchContext(gpu_space, budget, 0), policy, policy_trials=8, interleave=True)
    s = sweep(interleaved, gpu_space, SimulatedBackend(GPU_WORKLOAD, GPU, budget), budget, 16)
    configs = [r.config for r in s.results]
    assert configs[0] == walk[0] and set(walk) <= set(configs)  # the whole walk is there ...
    assert configs[:len(walk)] != walk  # ... among Optuna's proposals


def test_rl_and_hybrid_are_registered_strategies(gpu_space):
    assert {"rl", "hybrid"} <= set(STRATEGIES)
    for name in ("rl", "hybrid"):
        strategy = make_strategy(name, SearchContext(gpu_space, 20 * GiB, 0))
        assert strategy.name == name and strategy.propose() in gpu_space


# -- autotune tune --strategy rl | hybrid ------------------------------------------------------------------

def tune(argv: list[str]) -> int:
    from autotune.cli import main

    return main(["tune", *argv])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["rl", "hybrid"])
def test_tune_with_the_shipped_policy_on_the_simulated_backend(strategy, tmp_path):
    out = tmp_path / strategy
    assert tune(["--model", "gpt2-medium", "--gpus", "2", "--global-batch", "32", "--hardware", "a100-40gb",
                 "--memory-budget", "12GiB", "--backend", "simulated", "--strategy", strategy, "--trials", "12",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["best"] is not None
    results = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    configs = [json.dumps(r["config"], sort_keys=True) for r in results]
    assert len(set(configs)) == len(configs)
    launched = sum(r["status"] != "pruned" for r in results)
    assert launched == 12 if strategy == "hybrid" else 1 <= launched <= 16
    assert (out / "best_ds_config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["rl", "hybrid"])
def test_tune_on_a_replay_surface_runs_only_measured_configs(strategy, tiny_surface, tmp_path):
    out = tmp_path / strategy
    assert tune(["--backend", "replay", "--surface", str(tiny_surface), "--memory-budget", "1.2GiB",
                 "--strategy", strategy, "--trials", "10", "--out", str(out)]) == 0
    measured = {json.dumps(r.config.to_dict(), sort_keys=True) for r in load_surface(tiny_surface).results.values()}
    results = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert results and all(json.dumps(r["config"], sort_keys=True) in measured for r in results)


@pytest.mark.slow
def test_a_hybrid_sweep_resumes_without_rerunning_anything(tmp_path):
    out = tmp_path / "hybrid"
    flags = ["--model", "gpt2-medium", "--gpus", "2", "--global-batch", "32", "--hardware", "a100-40gb",
             "--memory-budget", "12GiB", "--backend", "simulated", "--strategy", "hybrid", "--out", str(out)]
    assert tune([*flags, "--trials", "4"]) == 0
    first = (out / "trials.jsonl").read_text().splitlines()
    assert tune([*flags, "--trials", "14", "--resume"]) == 0
    lines = (out / "trials.jsonl").read_text().splitlines()
    assert lines[:len(first)] == first
    configs = [json.dumps(json.loads(line)["config"], sort_keys=True) for line in lines]
    assert len(set(configs)) == len(configs)
    assert sum(json.loads(line)["status"] != "pruned" for line in lines) == 14
