"""`autotune rl train` and `rl export` when stopped at a bad moment, and the folders they write: an export is swapped
in whole and `latest` moves only after it; a run with nothing left to train exports a missing policy again; `rl
export --out` refuses a run's or a sweep's folder; a stop during teardown of a finished run is no interrupt; a
policy.pt of random bytes or a policy.json of another environment is one line; PROVENANCE.md shows every iteration.
Fakes stand in for RLlib except in the one slow test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cli_run import cli

import autotune.rl.train as training
from autotune.rl.network import NetSpec, policy_net
from autotune.rl.policy import Policy, layout
from autotune.rl.train import Iteration, RunDir, TrainSettings

N_FEATURES, N_ACTIONS = len(layout()["features"]), len(layout()["actions"])
FLAGS = ["--pool-size", "8", "--train-batch", "256", "--minibatch", "64", "--epochs", "1", "--envs-per-worker", "2",
         "--checkpoint-every", "1", "--hiddens", "32,32"]
SMALL = TrainSettings(iterations=2, pool_size=8, train_batch=256, minibatch=64, epochs=1, envs_per_worker=2,
                      checkpoint_every=1, hiddens=(32, 32))


class FakeModule:
    spec = NetSpec(N_FEATURES, N_ACTIONS, (8,))

    def policy_state(self):
        return policy_net(self.spec).state_dict()


class FakeAlgo:
    """RLlib's Algorithm as train() uses it: an iteration a train(), a checkpoint folder RLModule reads (faked)."""

    def __init__(self, on_stop=None):
        self.iteration, self.on_stop = 0, on_stop

    def train(self):
        self.iteration += 1
        return {"training_iteration": self.iteration, "num_env_steps_sampled_lifetime": 256 * self.iteration,
                "env_runners": {"num_episodes_lifetime": 10 * self.iteration, "episode_return_mean": 0.5}}

    def save_to_path(self, path):
        (Path(path) / "learner_group" / "learner" / "rl_module" / "default_policy").mkdir(parents=True)

    def restore_from_path(self, path):
        self.iteration = int(Path(path).name)

    def stop(self):
        if self.on_stop:
            self.on_stop()


@pytest.fixture
def fake_rllib(monkeypatch):
    """train() and export_checkpoint() without Ray: returns the list the fake algorithms go into."""
    from ray.rllib.core.rl_module.rl_module import RLModule

    algos: list[FakeAlgo] = []

    class Config:
        def build_algo(self):
            algos.append(FakeAlgo(getattr(fake_rllib_stop, "hook", None)))
            return algos[-1]

    monkeypatch.setattr(training, "connect_ray", lambda *a, **k: False)
    monkeypatch.setattr(training, "algorithm_config", lambda settings, env=None: Config())
    monkeypatch.setattr(RLModule, "from_checkpoint", classmethod(lambda cls, path: FakeModule()))
    fake_rllib_stop.hook = None
    return algos


def fake_rllib_stop():  # holds the on_stop hook of the next fake algorithm
    pass


def sigint():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the handler runs at the next bytecode: here, not later


def exported_at(folder: Path) -> str:
    return Policy.load(folder).meta["training"]["checkpoint"]


# -- 1: an export cut short, and a run with nothing left to train ----------------------------------------------------

def test_an_export_cut_short_keeps_the_previous_policy_whole_and_latest_unmoved(fake_rllib, tmp_path, monkeypatch,
                                                                                 capsys):
    out = tmp_path / "run"
    code, said, err = cli(["rl", "train", "--iterations", "1", *FLAGS, "--out", str(out)], capsys)
    assert code == 0 and exported_at(out / "policy") == "000001", said + err
    import autotune.rl.policy as policy_module

    real = policy_module.save_policy

    def cut_short(folder, *args):  # Ctrl-C once policy.pt is written, before policy.json
        real(folder, *args)
        os.unlink(Path(folder) / "policy.json")
        sigint()

    monkeypatch.setattr(policy_module, "save_policy", cut_short)
    code, said, _ = cli(["rl", "train", "--iterations", "2", *FLAGS, "--out", str(out)], capsys)
    assert code == 130 and "resumes from checkpoint" in said and said.strip().endswith("000001"), said
    assert RunDir(out).latest_checkpoint().name == "000001"  # the pointer moves after the export only
    assert exported_at(out / "policy") == "000001"  # the previous policy, whole
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # the half-written one taken back
    monkeypatch.setattr(policy_module, "save_policy", real)
    code, said, _ = cli(["rl", "train", "--iterations", "2", *FLAGS, "--out", str(out)], capsys)
    assert code == 0 and "from checkpoint 000001" in said and exported_at(out / "policy") == "000002"


@pytest.mark.parametrize("damage", ["missing", "empty", "half", "stale"])
def test_a_run_with_nothing_left_to_train_exports_its_policy_again(fake_rllib, tmp_path, capsys, damage):
    out = tmp_path / "run"
    assert cli(["rl", "train", "--iterations", "2", *FLAGS, "--out", str(out)], capsys)[0] == 0
    policy = out / "policy"
    if damage == "missing":
        for p in policy.iterdir():
            p.unlink()
        policy.rmdir()
    elif damage == "empty":
        for p in policy.iterdir():
            p.unlink()
    elif damage == "half":
        (policy / "policy.json").unlink()
    else:  # what the old order left: latest moved to 000002, the policy still 000001's
        meta = json.loads((policy / "policy.json").read_text())
        meta["training"]["checkpoint"] = "000001"
        (policy / "policy.json").write_text(json.dumps(meta))
    code, said, err = cli(["rl", "train", "--iterations", "2", *FLAGS, "--out", str(out), "--json"], capsys)
    assert code == 0, err
    assert "nothing to train" in err and "policy None" not in err and f"policy {policy}" in err
    assert json.loads(said)["policy"] == str(policy) and exported_at(policy) == "000002"
    assert (policy / "PROVENANCE.md").is_file()
    from autotune.strategies.rl import load_policy

    assert load_policy(policy).meta["training"]["checkpoint"] == "000002"  # what `tune --policy RUN/policy` loads


# -- 2: rl export --out --------------------------------------------------------------------------------------------

def test_export_refuses_an_out_that_holds_a_run_a_sweep_or_other_files(fake_rllib, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(["rl", "train", "--iterations", "1", *FLAGS, "--out", str(run)], capsys)[0] == 0
    before = sorted(p.name for p in run.iterdir())
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "run.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for out, what in ((run, "holds an `autotune rl train` run (settings.json"), (sweep, "holds a `tune` sweep (run.json)"),
                      (run / "checkpoints", "a training run's checkpoints"), (other, "not an exported policy's (notes.txt)"),
                      (run / "settings.json", "exists and is not a directory")):
        code, said, err = cli(["rl", "export", str(run), "--out", str(out)], capsys)
        assert code == 2 and what in err and err.count("\n") == 1 and not said, (out, err)
    assert sorted(p.name for p in run.iterdir()) == before and os.listdir(sweep) == ["run.json"]
    assert cli(["rl", "train", "--iterations", "1", *FLAGS, "--out", str(run)], capsys)[0] == 0  # resumes still
    # new, empty, or an earlier exported policy (replaced whole): written
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty", tmp_path / "new", run / "policy"):
        code, said, err = cli(["rl", "export", str(run), "--out", str(out)], capsys)
        assert code == 0, err
        assert sorted(os.listdir(out)) == ["PROVENANCE.md", "policy.json", "policy.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# -- 3: the exit status of a stop near the end ----------------------------------------------------------------------

def test_a_stop_while_a_finished_run_tears_down_is_no_interrupt(fake_rllib, tmp_path, capsys):
    fake_rllib_stop.hook = sigint  # Ctrl-C while the algorithm stops, every iteration trained and exported
    out = tmp_path / "run"
    code, said, err = cli(["rl", "train", "--iterations", "2", *FLAGS, "--out", str(out)], capsys)
    assert code == 0 and "done: 2 iterations" in said and "interrupted" not in said + err, said + err
    assert exported_at(out / "policy") == "000002"
    # Not finished: the same stop is an interrupt (exit 130), and says where it resumes.
    fake_rllib_stop.hook = None
    calls = []

    def stop_in_export(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            sigint()
        return real(*args, **kwargs)

    real = training.export_checkpoint
    training_export = pytest.MonkeyPatch()
    training_export.setattr(training, "export_checkpoint", stop_in_export)
    try:
        code, said, err = cli(["rl", "train", "--iterations", "4", *FLAGS, "--out", str(out)], capsys)
    finally:
        training_export.undo()
    assert code == 130 and said.strip().endswith("resumes from checkpoint " + str(out / "checkpoints" / "000003"))


def test_ray_exit_handlers_meet_no_ctrl_c_once_the_command_is_done(tmp_path):
    # An exit handler registered before (as Ray's shutdown is, at its import) that gets a Ctrl-C: ignored, no traceback.
    script = textwrap.dedent("""
        import atexit, os, signal, time
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.3), print("handler ran")))
        from autotune.commands.rl import ignore_stops_at_exit
        ignore_stops_at_exit()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "handler ran" in done.stdout and "KeyboardInterrupt" not in done.stderr, done


# -- 4: a damaged policy -------------------------------------------------------------------------------------------

def copy_policy(folder: Path) -> Path:
    import shutil

    from autotune.policies import policy_path

    shutil.copytree(policy_path(), folder)
    return folder


def test_random_bytes_or_another_environment_are_one_line(tmp_path, capsys):
    from autotune.strategies.rl import load_policy
    from autotune.values.config import ConfigError

    folder = copy_policy(tmp_path / "p")
    for junk in (os.urandom(4096), b"PK\x03\x04" + os.urandom(4096), b"\x80\x02" + os.urandom(4096)):
        (folder / "policy.pt").write_bytes(junk)
        with pytest.raises(ConfigError) as refused:
            load_policy(folder)
        text = str(refused.value)
        assert f"{folder}/policy.pt is not a torch weights file (" in text and text.endswith("): export it again")
        assert "weights_only" not in text and "arbitrary code" not in text and "\n" not in text
    folder = copy_policy(tmp_path / "q")
    meta = json.loads((folder / "policy.json").read_text())
    for env in ("CartPole-v1", 3):
        (folder / "policy.json").write_text(json.dumps({**meta, "env": env}))
        with pytest.raises(ConfigError, match="trained on environment .* not autotune/DeepSpeedMemory-v0"):
            load_policy(folder)


# -- 5: PROVENANCE.md's figures ------------------------------------------------------------------------------------

def test_provenance_shows_every_iteration_or_says_which(tmp_path):
    def rows(n):
        return [Iteration(i, 256 * i, 10 * i, 0.5, 3.0, 0.1, 0.9, 0.2, float(i)).to_dict() for i in range(1, n + 1)]

    text = training.provenance({"settings": SMALL.to_dict(), "progress": rows(3)})
    assert "per iteration" in text and all(f"\n| {i} | " in text for i in (1, 2, 3))
    text = training.provenance({"settings": SMALL.to_dict(), "progress": rows(101)})
    shown = [int(line.split("|")[1]) for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert shown == [1, *range(5, 101, 5), 101] and "every 5th and 101, of 101 iterations" in text


# -- 1 and 3 with RLlib: a Ctrl-C in the final export ----------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_in_the_final_export_resumes_and_leaves_a_usable_policy(tmp_path, capsys):
    out = tmp_path / "run"
    # A separate process whose export of checkpoint 2 (the last) gets a Ctrl-C once policy.pt is written.
    script = textwrap.dedent("""
        import os, signal, sys, time
        from pathlib import Path
        import autotune.rl.policy as policy
        real = policy.save_policy
        def save(folder, *args):
            real(folder, *args)
            if '"000002"' in (Path(folder) / "policy.json").read_text():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
        policy.save_policy = save
        from autotune.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    argv = ["rl", "train", "--iterations", "2", *FLAGS, "--out", str(out), "--json"]
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stdout + done.stderr
    assert "resumes from checkpoint" in done.stderr and "000001" in done.stderr and "Traceback" not in done.stderr
    assert json.loads(done.stdout)["interrupted"] and RunDir(out).latest_checkpoint().name == "000001"
    assert exported_at(out / "policy") == "000001"
    code, said, err = cli(argv, capsys)
    assert code == 0 and "from checkpoint 000001" in err and exported_at(out / "policy") == "000002", err
    # policy/ lost (as an older version could leave it): the same command, with nothing to train, exports it again
    for p in (out / "policy").iterdir():
        p.unlink()
    code, said, err = cli(argv, capsys)
    assert code == 0 and "nothing to train" in err and json.loads(said)["policy"] == str(out / "policy"), err
    policy = Policy.load(out / "policy")
    assert policy.meta["training"]["checkpoint"] == "000002" and policy.spec.hiddens == (32, 32)
