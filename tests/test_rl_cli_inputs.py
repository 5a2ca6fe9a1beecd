"""`autotune rl train` and `autotune rl export` inputs and what they leave behind, and the environment's `seed` and
`space` keys: most checks without RLlib (its training and export replaced by fakes), one tiny real training run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from cli_run import cli

import autotune.rl.train as training
from autotune.backends.replay import load_surface
from autotune.envs import DeepSpeedMemoryEnv, EnvConfig
from autotune.envs.reward import Reward
from autotune.rl.train import (Iteration, TrainingRun, TrainSettings, check_replay_budgets, check_run_folder, prepare,
                               resolve_checkpoint)
from autotune.search_spaces import load_choices
from autotune.values.config import Config, ConfigError
from autotune.values.results import TrialResult

ROOT = Path(__file__).resolve().parents[1]
TINY_SURFACE = ROOT / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
MiB = 2**20
REAL_TRAIN = training.train  # tests replace training.train with a fake where the command line is what they test


def fake_train(calls: list):
    """autotune.rl.train.train without RLlib: records the settings it was given and returns at once."""
    from autotune.rl.train import Start, TrainResult

    def train(out, settings, *, on_iteration, on_start, **_):
        calls.append((Path(out), settings))
        on_start(Start(Path(out), settings.iterations, 0, None))
        return TrainResult(Path(out), settings.iterations, 0, None, None, None)

    return train


def a_run(out: Path, checkpoints: tuple[int, ...], **settings) -> TrainingRun:
    """A training run's folder as `rl train` leaves it, without RLlib: settings, progress and (empty) checkpoint
    folders, `latest` naming the last."""
    run, _, _ = prepare(out, TrainSettings(**{"iterations": max(checkpoints, default=1), **settings}))
    for i in range(1, max(checkpoints, default=0) + 1):
        run.append_progress(Iteration(i, 10 * i, i, 0.5, 3.0, 0.1, 0.9, 0.2, float(i)))
    for i in checkpoints:
        (run.checkpoints / f"{i:06d}").mkdir(parents=True)
    if checkpoints:
        run.point_latest(f"{max(checkpoints):06d}")
    return run


class FakeAlgo:
    """The part of an RLlib Algorithm `train()` uses. `interrupt_at`: the iteration whose training is interrupted
    (Ctrl-C); `cut_save`: a checkpoint save interrupted half-way (its folder made, then the interrupt)."""

    def __init__(self, interrupt_at: int | None = None, cut_save: bool = False) -> None:
        self.iteration, self.interrupt_at, self.cut_save = 0, interrupt_at, cut_save

    def train(self) -> dict:
        if self.iteration + 1 == self.interrupt_at:
            raise KeyboardInterrupt
        self.iteration += 1
        return {"training_iteration": self.iteration, "env_runners": {}}

    def save_to_path(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "rllib_checkpoint.json").write_text("{}")
        if self.cut_save:
            raise KeyboardInterrupt

    def restore_from_path(self, path: str) -> None:
        self.iteration = int(Path(path).name)

    def stop(self) -> None:
        pass


@pytest.fixture
def no_rllib(monkeypatch):
    """train() without Ray or RLlib: the algorithm is a FakeAlgo (set `algo` on the returned holder), the policy's
    export a no-op."""

    class Holder:
        algo = FakeAlgo()

    holder = Holder()

    class Built:
        def build_algo(self):
            return holder.algo

    monkeypatch.setattr(training, "connect_ray", lambda *_a, **_k: False)
    monkeypatch.setattr(training, "algorithm_config", lambda *_a, **_k: Built())
    monkeypatch.setattr(training, "export_checkpoint", lambda *_a, **_k: None)
    return holder


# -- 1. --keep-checkpoints -----------------------------------------------------------------------------------

def test_keep_checkpoints_is_a_flag_recorded_with_the_settings_and_0_or_all_keeps_every_one(tmp_path, monkeypatch,
                                                                                               capsys):
    calls: list = []
    monkeypatch.setattr("autotune.rl.train.train", fake_train(calls))
    for given, kept in (("all", 0), ("0", 0), ("5", 5)):
        code, _, err = cli(["rl", "train", "--keep-checkpoints", given, "--out", str(tmp_path / given)], capsys)
        assert code == 0, err
        assert calls[-1][1].keep_checkpoints == kept and f"--keep-checkpoints {kept}" in calls[-1][1].command("o")
    cli(["rl", "train", "--out", str(tmp_path / "default")], capsys)
    assert calls[-1][1].keep_checkpoints == 2
    for bad in ("-1", "x", "2.5", "9" * 40):
        code, out, err = cli(["rl", "train", "--keep-checkpoints", bad, "--out", str(tmp_path / "bad")], capsys)
        assert code == 2 and err.count("\n") == 1 and "0 or all to keep every one" in err, err
    with pytest.raises(ConfigError, match="keep_checkpoints=-1"):
        TrainSettings(keep_checkpoints=-1)
    # recorded in settings.json, and a resume may change it
    run, _, _ = prepare(tmp_path / "rec", TrainSettings(keep_checkpoints=0))
    assert json.loads((run.path / "settings.json").read_text())["keep_checkpoints"] == 0
    prepare(tmp_path / "rec", TrainSettings(keep_checkpoints=3))
    assert run.settings().keep_checkpoints == 3
    code, out, _ = cli(["rl", "train", "--help"], capsys)
    assert "--keep-checkpoints N" in out


@pytest.mark.parametrize("keep,left", [(0, ["000001", "000002", "000003", "000004"]), (2, ["000003", "000004"])])
def test_checkpoints_beyond_keep_checkpoints_are_removed_and_0_removes_none(tmp_path, no_rllib, keep, left):
    settings = TrainSettings(iterations=4, checkpoint_every=1, keep_checkpoints=keep, train_batch=64, minibatch=32)
    result = training.train(tmp_path / "run", settings)
    assert result.iterations == 4
    run = TrainingRun(tmp_path / "run")
    assert run.checkpoint_names() == left and run.latest_checkpoint().name == "000004"


# -- 2. an interrupt before the first checkpoint ------------------------------------------------------------

def test_an_interrupt_before_the_first_checkpoint_takes_back_what_it_wrote(tmp_path, no_rllib):
    out = tmp_path / "pol6"
    settings = TrainSettings(iterations=10, train_batch=64, minibatch=32)  # checkpoint every 5
    no_rllib.algo = FakeAlgo(interrupt_at=3)  # two iterations recorded in progress.jsonl, then Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        training.train(out, settings)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no settings.json, no progress.jsonl
    prepare(out, TrainSettings(iterations=10, seed=9))  # so other flags start over there (were refused)
    # A save cut short by the interrupt is taken back too.
    cut = tmp_path / "cut"
    no_rllib.algo = FakeAlgo(cut_save=True)
    with pytest.raises(KeyboardInterrupt):
        training.train(cut, settings)
    assert sorted(p.name for p in cut.iterdir()) == [".lock"]
    # After a checkpoint, nothing is taken back: the same command resumes.
    kept = a_run(tmp_path / "kept", (5,), iterations=10, train_batch=64, minibatch=32)
    no_rllib.algo = FakeAlgo(interrupt_at=7)
    with pytest.raises(KeyboardInterrupt):
        training.train(kept.path, settings)
    assert kept.settings() is not None and kept.latest_checkpoint().name == "000005"
    assert [r.iteration for r in kept.progress()] == [1, 2, 3, 4, 5, 6]


def test_the_interrupt_message_says_what_the_folder_keeps(tmp_path, no_rllib, monkeypatch, capsys):
    monkeypatch.setattr("autotune.commands.rl.quiet_ray", lambda: None)
    out = tmp_path / "pol6"
    no_rllib.algo = FakeAlgo(interrupt_at=2)
    code, said, _ = cli(["rl", "train", "--train-batch", "64", "--minibatch", "32", "--out", str(out)], capsys)
    assert code == 130 and "nothing was saved, the same command starts over, as does one with other flags" in said
    no_rllib.algo = FakeAlgo(interrupt_at=2)
    code, said, err = cli(["rl", "train", "--seed", "9", "--train-batch", "64", "--minibatch", "32", "--out", str(out)],
                          capsys)
    assert code == 130 and "other settings" not in err, err  # accepted: it trained (then was interrupted again)
    # Where settings.json stayed (a second interrupt while it was being taken back), the message says so.
    from autotune.commands.rl import interrupted

    left = a_run(tmp_path / "left", ())
    assert f"{left.path / 'settings.json'} keeps its settings, so other flags are refused" in interrupted(left)
    with pytest.raises(ConfigError, match="it holds no checkpoint: remove .*settings.json to start over"):
        prepare(left.path, TrainSettings(seed=9))


# -- 3. --out holding something else -------------------------------------------------------------------------

@pytest.mark.parametrize("files,named", [
    ({"run.json": "{}", "trials.jsonl": ""}, "a `tune` sweep (run.json, trials.jsonl)"),
    ({"policy.pt": "", "policy.json": "{}"}, "an exported policy (policy.pt, policy.json)"),
    ({"notes.txt": "mine"}, "files that are not a training run's (notes.txt)"),
    ({"settings.json": "{}", "trials.jsonl": ""}, "a `tune` sweep (trials.jsonl)"),
])
def test_an_out_folder_holding_anything_but_a_training_run_is_refused(tmp_path, monkeypatch, capsys, files, named):
    calls: list = []
    monkeypatch.setattr("autotune.rl.train.train", fake_train(calls))
    out = tmp_path / "folder"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    code, said, err = cli(["rl", "train", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and not calls and said == "", err
    assert f"{out} holds {named}, not an `autotune rl train` run" in err
    assert "new or empty folder, or the folder of a training run to resume it" in err
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # nothing written
    with pytest.raises(ConfigError, match=re.escape(named)):  # the library's train() too, before Ray
        REAL_TRAIN(out, TrainSettings())


def test_a_new_or_empty_folder_or_a_training_run_is_accepted_as_out(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr("autotune.rl.train.train", fake_train(calls))
    (tmp_path / "empty").mkdir()
    run = a_run(tmp_path / "run", (5,))
    (run.path / ".settings.json.abc.tmp").write_text("")  # an atomic write a kill left
    (run.path / "logs").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty", run.path):
        code, _, err = cli(["rl", "train", "--out", str(out)], capsys)
        assert code == 0, err
    assert [c[0] for c in calls] == [tmp_path / "new", tmp_path / "empty", run.path]
    check_run_folder(tmp_path / "absent")


# -- 4. the environment's seed and space --------------------------------------------------------------------

@pytest.mark.parametrize("seed", ["x", "3", -1, 1.5, True])
def test_an_environment_seed_that_is_no_integer_is_refused_when_made(seed):
    with pytest.raises(ConfigError, match=r"^seed=.*: allowed an integer >= 0 or None$"):
        DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "800MiB", "seed": seed})


def test_an_environment_seed_of_numpy_or_none_is_taken():
    assert EnvConfig.from_dict({"seed": np.int64(3)}).seed == 3 and EnvConfig.from_dict({"seed": None}).seed is None
    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "800MiB", "seed": 4})
    first, _ = env.reset()
    again = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "800MiB", "seed": 4}).reset()[0]
    assert np.array_equal(first["observations"], again["observations"])


def test_an_environment_space_may_be_a_mapping_of_knob_lists():
    mapping = {"zero_stage": [0, 1], "micro_batch": [1, 2], "precision": ["fp32"]}
    env = DeepSpeedMemoryEnv({"workload": "tiny", "memory_budget": "800MiB", "space": mapping})
    assert env.config.space.zero_stage == (0, 1) and env.config.space.precision == ("fp32",)
    env.reset(seed=0)
    assert EnvConfig(space={"zero_stage": (0, 1)}, workload="tiny").space.zero_stage == (0, 1)  # tuples too
    assert EnvConfig(space="cpu", workload="tiny").space == load_choices("cpu")
    with pytest.raises(ConfigError, match=r"env_config\['space'\]: zero_stage: bad value 7"):
        EnvConfig(space={"zero_stage": [7]}, workload="tiny")
    with pytest.raises(ConfigError, match="allowed a preset name, a YAML file path, a mapping of knob -> list of values"):
        EnvConfig(space=3, workload="tiny")


# -- 5. the reward as the docs give it ----------------------------------------------------------------------

def test_the_docs_reward_cases_are_what_the_environment_pays():
    doc = (ROOT / "docs" / "search.md").read_text()
    section = doc[doc.index("- Reward (`envs/reward.py`"):doc.index("- `info`:")]
    assert "cost = trial_cost (0.01) + second_cost (0) x wall seconds / seconds_unit" in section
    assert "-oom_penalty (0.5) - over_budget_coef (0.5) x min(over_budget_cap\n    (2), max(0, peak/budget - 1)) - cost" \
        in section
    assert "-failure_penalty (0.5) - cost" in section and "`pruned`: -cost" in section
    reward, config = Reward(), Config(0, 1, 0, "fp32", "none", "none")
    budget, reference = 1000, 10.0

    def result(status: str, peak: int | None = None, throughput: float | None = None) -> TrialResult:
        return TrialResult(config, status, throughput, None, None, peak, budget, wall_time_s=2.0)

    cost = 0.01
    assert reward.trial(result("ok", 900, 5.0), budget, reference, 0.0) == pytest.approx(0.5 - cost)
    assert reward.trial(result("oom", 1500), budget, reference, 0.0) == pytest.approx(-0.5 - 0.5 * 0.5 - cost)
    assert reward.trial(result("oom", 9000), budget, reference, 0.0) == pytest.approx(-0.5 - 0.5 * 2 - cost)
    assert reward.trial(result("ok", 1500, 5.0), budget, reference, 0.0) == pytest.approx(-0.5 - 0.25 - cost)
    assert reward.trial(result("oom"), budget, reference, 0.0) == pytest.approx(-0.5 - cost)
    assert reward.trial(result("crash"), budget, reference, 0.0) == pytest.approx(-0.5 - cost)
    assert reward.trial(result("pruned"), budget, reference, 0.0) == pytest.approx(-cost)
    priced = Reward(second_cost=0.1)  # 2 wall seconds in units of 4 seconds
    assert priced.trial(result("crash"), budget, reference, 0.0, 4.0) == pytest.approx(-0.5 - cost - 0.05)


# -- 6. --hiddens' default, and what `rl export` takes -------------------------------------------------------

def test_hiddens_default_is_shown_as_it_is_typed(capsys):
    code, out, _ = cli(["rl", "train", "--help"], capsys)
    help_text = " ".join(out.split())
    assert code == 0 and "(default: 128,128)" in help_text and "(128, 128)" not in help_text


def test_export_takes_a_run_its_latest_pointer_or_a_checkpoint_and_says_which(tmp_path, monkeypatch, capsys):
    run = a_run(tmp_path / "pol4", (4, 5))
    five = run.checkpoints / "000005"
    for given in (run.path, run.checkpoints / "latest", run.checkpoints, five):
        assert resolve_checkpoint(given) == five
    assert resolve_checkpoint(run.checkpoints / "000004") == run.checkpoints / "000004"
    with pytest.raises(ConfigError, match=r"000001'?: no such checkpoint \(.* holds 000004, 000005: the run keeps its "
                                          r"newest 2, --keep-checkpoints\)"):
        resolve_checkpoint(run.checkpoints / "000001")
    with pytest.raises(ConfigError, match="is a file: give a checkpoint folder"):
        resolve_checkpoint(run.path / "settings.json")
    (run.checkpoints / "latest").write_text("000009\n")
    with pytest.raises(ConfigError, match="names checkpoint '000009', which .* does not hold"):
        resolve_checkpoint(run.checkpoints / "latest")
    bare = a_run(tmp_path / "bare", ())
    (bare.checkpoints / "000005").mkdir(parents=True)  # cut short: no `latest`
    with pytest.raises(ConfigError, match="a training run without a complete checkpoint"):
        resolve_checkpoint(bare.path)
    # through the command line (the export itself faked: it needs RLlib)
    run.point_latest("000005")
    exported: list = []

    def export(checkpoint, folder, meta=None):
        exported.append(Path(checkpoint))
        Path(folder).mkdir(parents=True, exist_ok=True)
        return Path(folder)

    monkeypatch.setattr(training, "export_checkpoint", export)
    monkeypatch.setattr("autotune.commands.rl.quiet_ray", lambda: None)
    code, out, err = cli(["rl", "export", str(run.path), "--out", str(tmp_path / "e")], capsys)
    assert code == 0, err
    assert exported == [five] and f"policy of checkpoint {five} written to {tmp_path / 'e'}" in out
    code, out, err = cli(["rl", "export", str(run.checkpoints / "latest"), "--out", str(tmp_path / "e2")], capsys)
    assert code == 0 and exported[-1] == five, err
    code, out, err = cli(["rl", "export", str(run.checkpoints / "000001"), "--out", str(tmp_path / "e3")], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds 000004, 000005" in err


# -- 7. a replay budget nothing fits --------------------------------------------------------------------------

def test_a_replay_budget_under_which_no_surface_config_fits_is_refused_or_said(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr("autotune.rl.train.train", fake_train(calls))
    surface = load_surface(TINY_SURFACE)
    least = min(r.peak_memory_bytes for r in surface.results.values() if r.ok and r.peak_memory_bytes)
    need = -(-least // MiB)
    replay = ["rl", "train", "--backend", "replay", "--surface", str(TINY_SURFACE)]
    for budgets in ("1MiB", "1MiB,2MiB"):  # every episode out of memory: refused
        code, out, err = cli([*replay, "--memory-budget", budgets, "--out", str(tmp_path / "r")], capsys)
        assert code == 2 and err.count("\n") == 1 and not calls and out == "", err
        assert "no config of any surface fits" in err and f"{least} bytes" in err and f"at least {need}MiB" in err
    assert not (tmp_path / "r").exists()
    # some budgets that nothing fits among others: one line before training says so
    code, out, err = cli([*replay, "--memory-budget", "1MiB,1GiB", "--out", str(tmp_path / "r")], capsys)
    assert code == 0 and len(calls) == 1, err
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warning == [f"warning: --memory-budget 1 MiB: no config of any surface fits it (the smallest measured peak "
                       f"is 576 MiB, {least} bytes): the episodes drawn at it (1 of 2 budgets) all run out of memory"]
    code, out, err = cli([*replay, "--memory-budget", f"{need}MiB", "--out", str(tmp_path / "r2")], capsys)
    assert code == 0 and calls[-1][1].memory_budget_bytes == (need * MiB,) and "warning" not in out, err
    assert check_replay_budgets([surface], ()) is None  # the device's memory: every config that ran fits
    with pytest.raises(ConfigError, match=f"give budgets of at least {need}MiB"):
        check_replay_budgets([surface], (least - 1,))


# -- real RLlib: one tiny run --------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_tiny_run_keeps_every_checkpoint_with_keep_all_and_exports_any(tmp_path, capsys):
    out = tmp_path / "pol"
    flags = ["--iterations", "3", "--pool-size", "8", "--train-batch", "64", "--minibatch", "32", "--epochs", "1",
             "--envs-per-worker", "1", "--hiddens", "8,8", "--checkpoint-every", "1", "--keep-checkpoints", "all",
             "--quiet", "--out", str(out)]
    code, said, err = cli(["rl", "train", *flags], capsys)
    assert code == 0, said + err
    run = TrainingRun(out)
    assert run.checkpoint_names() == ["000001", "000002", "000003"] and run.settings().keep_checkpoints == 0
    code, said, err = cli(["rl", "export", str(out), "--out", str(tmp_path / "latest")], capsys)
    assert code == 0 and f"policy of checkpoint {out / 'checkpoints' / '000003'}" in said, err
    code, said, err = cli(["rl", "export", str(out / "checkpoints" / "000001"), "--out", str(tmp_path / "one")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "one" / "policy.json").read_text())["training"]["checkpoint"] == "000001"
