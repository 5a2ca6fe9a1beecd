"""`autotune tune --policy DIR` (TuneSpec.policy): `rl` and `hybrid` search with an exported policy (`autotune rl
export`: policy.pt + policy.json) in place of the shipped one, from the CLI and from a sweep file; a folder that is not
an exported policy, a policy of another layout, and --policy with another strategy are one-line errors with exit 2
and no run directory; run.json keeps the folder and a resume with another one is refused. Simulated backend, no
RLlib: the exported policy is the shipped one's files with other weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import autotune.rl.policy as policy_module
from autotune.api import Plan, TuneSpec, tune_many
from autotune.commands.sweep_file import load_sweep
from autotune.policies import policy_path
from autotune.rl.network import NetSpec, policy_net
from autotune.rl.policy import Policy, digest, layout, save_policy
from autotune.values.config import ConfigError
from autotune.values.settings import RunSettings
from autotune.values.workload import make_workload
from cli_run import cli

FLAGS = ["--model", "gpt2-medium", "--gpus", "2", "--global-batch", "32", "--hardware", "a100-40gb",
         "--memory-budget", "12GiB", "--backend", "simulated", "--trials", "4", "--quiet"]
WORKLOAD = make_workload("gpt2-medium", 32, 2)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The shipped policy's folder copied, its weights perturbed: an exported policy that walks elsewhere."""
    folder = tmp_path_factory.mktemp("exported") / "mypol"
    shutil.copytree(policy_path(), folder)
    weights = torch.load(folder / "policy.pt", weights_only=True)
    generator = torch.Generator().manual_seed(0)
    torch.save({k: v + torch.randn(v.shape, generator=generator) for k, v in weights.items()}, folder / "policy.pt")
    return folder


@pytest.fixture
def loads(monkeypatch) -> list[Path]:
    """The folders Policy.load read, in order."""
    seen: list[Path] = []
    original = Policy.load.__func__  # type: ignore[attr-defined]

    def load(cls, path, check_layout=True):
        seen.append(Path(path).resolve())
        return original(cls, path, check_layout)

    monkeypatch.setattr(policy_module.Policy, "load", classmethod(load))
    return seen


def configs(run: Path) -> list[dict]:
    return [json.loads(line)["config"] for line in (run / "trials.jsonl").read_text().splitlines()]


def one_line_refusal(argv: list[str], out: Path, capsys) -> str:
    code, _, err = cli(["tune", *argv, "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and " error: " in err, err
    assert not out.exists()  # nothing written
    return err


@pytest.mark.parametrize("strategy", ["rl", "hybrid"])
def test_the_cli_option_reaches_the_strategy_and_run_json(strategy, exported, loads, tmp_path, capsys):
    shipped, mine = tmp_path / "shipped", tmp_path / "mine"
    assert cli(["tune", *FLAGS, "--strategy", strategy, "--out", str(shipped)], capsys)[0] == 0
    assert loads and set(loads) == {policy_path().resolve()}  # without --policy: the shipped one, as before
    assert json.loads((shipped / "run.json").read_text())["policy"] is None
    loads.clear()
    assert cli(["tune", *FLAGS, "--strategy", strategy, "--policy", str(exported), "--out", str(mine)], capsys)[0] == 0
    assert loads and set(loads) == {exported.resolve()}
    assert json.loads((mine / "run.json").read_text())["policy"] == str(exported.resolve())
    if strategy == "rl":  # the same seed, another walk (hybrid's first proposals are Optuna's)
        assert configs(mine) != configs(shipped)


def test_a_sweep_files_policy_reaches_the_strategy(exported, loads, tmp_path):
    folder = tmp_path / "sweeps"
    folder.mkdir()
    shutil.copytree(exported, folder / "pol")
    sweep = folder / "sweep.yaml"
    sweep.write_text("defaults: {backend: simulated, trials: 4, strategy: rl, hardware: a100-40gb, gpus: 2, "
                     "global_batch: 32, memory_budget: 12GiB}\n"
                     "workloads:\n  - {name: mine, model: gpt2-medium, policy: pol}\n"
                     "  - {name: shipped, model: gpt2-medium}\n")
    mine, shipped = load_sweep(sweep).workloads
    assert mine.tune.policy == str(folder / "pol") and shipped.tune.policy is None  # relative to the file's folder
    out = tmp_path / "out"
    tune_many([mine.plan(out, None), shipped.plan(out, None)])
    assert set(loads) == {(folder / "pol").resolve(), policy_path().resolve()}
    assert json.loads((out / "mine" / "run.json").read_text())["policy"] == str((folder / "pol").resolve())
    assert configs(out / "mine") != configs(out / "shipped")
    with pytest.raises(ConfigError, match=r"workloads\[0\].*--policy \(`policy`\): only with --strategy \(`strategy`\) rl or hybrid"):
        sweep.write_text("workloads:\n  - {name: mine, model: gpt2-medium, strategy: optuna, policy: pol}\n")
        load_sweep(sweep)


def test_a_folder_that_is_no_exported_policy_is_refused(exported, tmp_path, capsys):
    argv = [*FLAGS, "--strategy", "rl", "--policy"]
    assert "no such folder" in one_line_refusal([*argv, str(tmp_path / "missing")], tmp_path / "a", capsys)
    assert "not a folder" in one_line_refusal([*argv, str(exported / "policy.pt")], tmp_path / "a", capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    err = one_line_refusal([*argv, str(empty)], tmp_path / "a", capsys)
    assert f"--policy (`policy`) {empty}" in err and "policy.json" in err and "policy.pt" in err and "autotune rl export" in err
    damaged = tmp_path / "damaged"
    shutil.copytree(exported, damaged)
    (damaged / "policy.pt").write_bytes(b"not torch")
    assert "do not load as a policy" in one_line_refusal([*argv, str(damaged)], tmp_path / "a", capsys)


def test_a_policy_of_another_layout_is_refused(exported, tmp_path, capsys):
    argv = [*FLAGS, "--strategy", "hybrid", "--policy"]
    actions = tmp_path / "actions"  # trained on other actions: Policy.load's own check
    spec = NetSpec(len(layout()["features"]), 2, (8,))
    save_policy(actions, spec, policy_net(spec).state_dict(), {**layout(), "actions": ["stop", "run"]})
    assert "another environment layout" in one_line_refusal([*argv, str(actions)], tmp_path / "a", capsys)
    inputs = tmp_path / "inputs"  # the layout's names, a network of other inputs than the environment's observation
    spec = NetSpec(50, len(layout()["actions"]), (8,))
    save_policy(inputs, spec, policy_net(spec).state_dict(), layout())
    err = one_line_refusal([*argv, str(inputs)], tmp_path / "a", capsys)
    assert "50 observation features" in err and f"{len(layout()['features'])} and" in err
    mismatched = tmp_path / "mismatched"  # policy.json says one network, policy.pt holds another
    shutil.copytree(exported, mismatched)
    meta = json.loads((mismatched / "policy.json").read_text())
    (mismatched / "policy.json").write_text(json.dumps({**meta, "spec": {**meta["spec"], "hiddens": [64]}}))
    assert "do not load as a policy" in one_line_refusal([*argv, str(mismatched)], tmp_path / "a", capsys)


@pytest.mark.parametrize("strategy", ["optuna", "grid", "random", "optuna-gp"])
def test_policy_with_another_strategy_is_refused(strategy, exported, tmp_path, capsys):
    err = one_line_refusal([*FLAGS, "--strategy", strategy, "--policy", str(exported)], tmp_path / "a", capsys)
    assert "--policy (`policy`): only with --strategy (`strategy`) rl or hybrid" in err
    with pytest.raises(ConfigError, match=r"only with --strategy \(`strategy`\) rl or hybrid"):
        TuneSpec(WORKLOAD, "a100-40gb", strategy=strategy, backend="simulated", policy=exported)


def test_a_resume_with_another_policy_is_refused(exported, loads, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*FLAGS, "--strategy", "rl", "--out", str(out)]
    assert cli(["tune", *argv, "--policy", str(exported)], capsys)[0] == 0
    before = (out / "trials.jsonl").read_bytes(), (out / "run.json").read_bytes()
    for other in (["--policy", str(policy_path())], []):  # another policy, or the shipped one
        code, _, err = cli(["tune", *argv, "--resume", *other], capsys)
        assert code == 2 and err.count("\n") == 1 and "--resume" in err and "policy: " in err, err
        assert str(exported.resolve()) in err
        assert ((out / "trials.jsonl").read_bytes(), (out / "run.json").read_bytes()) == before
    original = (exported / "policy.pt").read_bytes()  # the same folder, exported into again: another policy
    weights = torch.load(exported / "policy.pt", weights_only=True)
    torch.save({k: v + 1 for k, v in weights.items()}, exported / "policy.pt")
    code, _, err = cli(["tune", *argv, "--resume", "--policy", str(exported)], capsys)
    assert code == 2 and err.count("\n") == 1 and "policy_sha256: " in err, err
    assert ((out / "trials.jsonl").read_bytes(), (out / "run.json").read_bytes()) == before
    (exported / "policy.pt").write_bytes(original)
    loads.clear()  # the same policy: the sweep goes on with it, its earlier walk replayed from the record
    assert cli(["tune", *argv, "--resume", "--policy", str(exported), "--trials", "6"], capsys)[0] == 0
    assert set(loads) == {exported.resolve()}
    assert (out / "trials.jsonl").read_bytes().startswith(before[0])
    assert sum(r["status"] != "pruned" for r in map(json.loads, (out / "trials.jsonl").read_text().splitlines())) == 6


def test_the_library_records_the_policy_and_refuses_another_on_resume(exported, tmp_path):
    spec = TuneSpec(WORKLOAD, "a100-40gb", memory_budget_bytes=12 * 2**30, strategy="rl",
                    trials=2, backend="simulated", policy=exported)
    out = tmp_path / "lib"
    tune_many([Plan(spec, out)])
    recorded = json.loads((out / "run.json").read_text())
    assert recorded["policy"] == str(exported.resolve()) and recorded["policy_sha256"] == digest(exported)
    assert RunSettings.from_dict(recorded) == spec.settings()
    assert RunSettings.from_dict({k: v for k, v in recorded.items() if k != "policy_sha256"}).policy_sha256 is None
    with pytest.raises(ConfigError, match="run.json: policy_sha256: 3: allowed a policy's digest or null"):
        RunSettings.from_dict({**recorded, "policy_sha256": 3})
    shipped = TuneSpec(WORKLOAD, "a100-40gb", memory_budget_bytes=12 * 2**30, strategy="rl",
                       trials=3, backend="simulated")
    with pytest.raises(ConfigError, match="started with other settings .*policy: recorded .*, given None"):
        tune_many([Plan(shipped, out, resume=True)])
