"""Real RLlib training (PPO, new API stack) on a local Ray instance with small resources: a couple of
iterations produce a checkpoint and a policy; the trained module respects the action mask; the exported
policy loads without Ray and proposes valid configs; training resumes from the last checkpoint through
the command line; Ray is shut down afterwards."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autotune.backends.simulated import SimulatedBackend
from autotune.cli import main
from autotune.values.hardware import PROFILES
from autotune.rl.policy import Policy
from autotune.rl.simulator import TrainingEnv
from autotune.rl.train import RunDir, TrainSettings, train
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.strategies import SearchContext
from autotune.strategies.rl import RLStrategy
from autotune.values.workload import make_workload

pytestmark = pytest.mark.slow
GiB = 2**30
# Small enough to train in seconds: 8 GPU + 2 CPU tasks, 256 steps per iteration, 2 environment copies.
SETTINGS = TrainSettings(iterations=2, pool_size=8, train_batch=256, minibatch=64, epochs=2, envs_per_worker=2,
                         checkpoint_every=1, hiddens=(32, 32))


def ray_running() -> bool:
    import ray

    return ray.is_initialized()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "policy-test"
    rows = []
    result = train(out, SETTINGS, on_iteration=rows.append)
    assert not ray_running()  # the local instance it started is shut down
    return out, result, rows


def test_training_writes_progress_checkpoints_and_a_policy(trained):
    out, result, rows = trained
    assert result.iterations == 2 and result.resumed_from == 0
    assert [r.iteration for r in rows] == [1, 2]
    assert rows[-1].timesteps >= 2 * SETTINGS.train_batch and rows[-1].episodes > 0
    for row in rows:  # the figures of the issue, per iteration
        assert row.episode_return is not None and 1 <= row.trials <= SETTINGS.horizon
        assert 0 <= row.within_2pct <= 1 and 0 < row.best_over_optimum <= 1
    run = RunDir(out)
    assert [r.iteration for r in run.progress()] == [1, 2]
    assert result.checkpoint == run.latest_checkpoint() and result.checkpoint.name == "000002"
    meta = json.loads((out / "policy" / "policy.json").read_text())
    assert meta["training"]["checkpoint"] == "000002" and meta["training"]["settings"] == SETTINGS.to_dict()
    assert (out / "policy" / "policy.pt").stat().st_size < 100_000


def test_trained_module_respects_the_mask_and_matches_the_exported_policy(trained):
    from ray.rllib.core.columns import Columns
    from ray.rllib.core.rl_module.rl_module import RLModule

    out, result, _ = trained
    module = RLModule.from_checkpoint(result.checkpoint / "learner_group" / "learner" / "rl_module" / "default_policy")
    policy = Policy.load(out / "policy")
    env = TrainingEnv({**SETTINGS.env_config(), "seed": 0})
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    for step in range(150):
        batch = {Columns.OBS: {k: torch.as_tensor(v).unsqueeze(0) for k, v in obs.items()}}
        logits = module.forward_inference(batch)[Columns.ACTION_DIST_INPUTS]
        dist = module.get_inference_action_dist_cls().from_logits(logits)
        sampled = int(dist.sample()[0])
        allowed = obs["action_mask"] > 0.5
        assert allowed[sampled] and allowed[int(logits.argmax())]
        assert np.allclose(logits[0].detach().numpy()[allowed], policy.logits(obs)[allowed], atol=1e-5)
        obs, _, terminated, truncated, _ = env.step(sampled if rng.random() < 0.5 else policy.act(obs))
        if terminated or truncated:
            obs, _ = env.reset()


def test_exported_policy_proposes_valid_configs_without_ray(trained):
    out, _, _ = trained
    assert not ray_running()
    policy = Policy.load(out / "policy")
    workload, hardware = make_workload("gpt2-medium", 32, 2), PROFILES["a100-40gb"]
    space = Space(load_choices("default"), workload, hardware)
    budget = 20 * GiB
    strategy = RLStrategy(SearchContext(space, budget, 0), policy)
    backend = SimulatedBackend(workload, hardware, budget)
    proposed = []
    while (config := strategy.propose()) is not None:
        assert config in space and config not in proposed
        proposed.append(config)
        strategy.observe(config, backend.run(config).under_budget(budget))
    assert 1 <= len(proposed) <= SETTINGS.horizon
    assert not ray_running()


def test_sigterm_stops_training_cleanly_and_the_cli_resumes_from_the_last_checkpoint(trained, capsys):
    out, _, _ = trained
    flags = ["--pool-size", "8", "--train-batch", "256", "--minibatch", "64", "--epochs", "2", "--envs-per-worker", "2",
             "--checkpoint-every", "1", "--hiddens", "32,32", "--out", str(out)]
    # A separate process, stopped with SIGTERM once it has trained (and checkpointed) iteration 3 of 6.
    process = subprocess.Popen([sys.executable, "-m", "autotune.cli", "rl", "train", "--iterations", "6", *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    try:
        for line in process.stdout:
            seen.append(line)
            if line.startswith("iter    3/6"):
                # Checkpoint 3 lands about an iteration (a second or so) after this line: wait for it, and
                # fail (rather than wait forever) if a loaded machine let the trainer run past it or end.
                while (latest := RunDir(out).latest_checkpoint()) is None or latest.name < "000003":
                    assert process.poll() is None, "the trainer ended before its checkpoint 3: " + "".join(seen)
                    time.sleep(0.05)
                process.send_signal(signal.SIGTERM)
                break
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, "".join(seen) + rest
    assert "from checkpoint 000002" in "".join(seen) and "interrupted" in rest
    # Ray's and RLlib's notices (token authentication's default, the new API stack, deprecations) drowned the lines.
    said = "".join(seen) + rest
    assert not any(notice in said for notice in ("Token authentication", "new API stack", "DeprecationWarning",
                                                 "gputil")), said
    assert RunDir(out).latest_checkpoint().name == "000003"

    code = main(["rl", "train", "--iterations", "4", *flags, "--json"])
    captured = capsys.readouterr()
    printed = captured.err  # --json: the progress lines on stderr, one JSON document on stdout
    assert code == 0, printed
    assert "from checkpoint 000003" in printed and "iter    4/4" in printed and "within 2% of optimum" in printed
    doc = json.loads(captured.out)
    assert doc["out"] == str(out) and doc["iterations"] == 4 and doc["resumed_from"] == 3 and not doc["interrupted"]
    assert doc["checkpoint"] == str(out / "checkpoints" / "000004") and doc["policy"] == str(out / "policy")
    assert doc["last"]["iteration"] == 4 and doc["settings"]["iterations"] == 4
    assert [r.iteration for r in RunDir(out).progress()] == [1, 2, 3, 4]
    assert RunDir(out).latest_checkpoint().name == "000004"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["000003", "000004"]
    meta = json.loads((out / "policy" / "policy.json").read_text())
    assert meta["training"]["checkpoint"] == "000004"
    assert meta["training"]["command"] == RunDir(out).settings().command(out)
    assert "--iterations 4" in meta["training"]["command"]
    assert [r["iteration"] for r in meta["training"]["progress"]] == [1, 2, 3, 4]
    assert not ray_running()


def test_export_writes_a_ray_free_policy_with_its_provenance(trained, tmp_path, capsys):
    out, _, _ = trained
    latest = RunDir(out).latest_checkpoint()
    assert main(["rl", "export", str(latest), "--out", str(tmp_path / "shipped")]) == 0
    assert "PROVENANCE.md" in capsys.readouterr().out
    policy = Policy.load(tmp_path / "shipped")
    rng = np.random.default_rng(0)
    obs = {"observations": rng.uniform(-1, 1, policy.spec.obs_dim).astype(np.float32),
           "action_mask": np.ones(policy.spec.n_actions, np.float32)}
    assert np.allclose(policy.logits(obs), Policy.load(out / "policy").logits(obs))  # the same network
    provenance = (tmp_path / "shipped" / "PROVENANCE.md").read_text()
    assert RunDir(out).settings().command(out) in provenance and f"Seed {SETTINGS.seed}" in provenance
    assert f"| {int(latest.name)} | " in provenance  # the figures of the exported iteration
    assert policy.meta["training"]["checkpoint"] == latest.name
    assert main(["rl", "export", str(latest), "--out", str(tmp_path / "again"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["policy"] == str(tmp_path / "again") and doc["provenance"]
    assert {Path(p).name for p in doc["files"]} >= {"policy.pt", "policy.json", "PROVENANCE.md"}
    code = main(["rl", "export", str(tmp_path), "--out", str(tmp_path / "x")])
    assert code == 2 and "not an RLlib algorithm checkpoint" in capsys.readouterr().err


def test_a_run_directory_refuses_other_settings(trained, capsys):
    out, _, _ = trained
    code = main(["rl", "train", "--iterations", "4", "--out", str(out), "--seed", "9"])
    assert code == 2
    said = capsys.readouterr()
    err = said.err
    assert "other settings" in err and "seed: recorded 0, given 9" in err and len(err.strip().splitlines()) == 1
    assert "resuming" not in said.out  # not said of a run it refuses
