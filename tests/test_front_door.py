"""One front door (issue 26): `autotune tune` is argparse -> TuneSpec -> autotune.tune() -> print, and the
library decides every default in one place (autotune.api.resolve)."""

from __future__ import annotations

import json

import pytest

import autotune
from autotune.api import resolve
from autotune.cli import main
from autotune.values.config import ConfigError
from autotune.values.hardware import PROFILES
from autotune.values.settings import RunSettings, memory_budget
from autotune.values.space import Space
from autotune.values.workload import make_workload

GiB = 2**30


@pytest.fixture
def heard(monkeypatch):
    """Every sweep autotune.tune() is asked for: its spec, and what it returned."""
    calls: list[tuple[autotune.TuneSpec, autotune.TuneResult]] = []
    real = autotune.tune

    def listening(spec, *args, **kwargs):
        result = real(spec, *args, **kwargs)
        calls.append((spec, result))
        return result

    monkeypatch.setattr(autotune, "tune", listening)
    return calls


def test_the_cli_sweep_goes_through_the_library(heard, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["tune", "--model", "tiny", "--memory-budget", "0.85GiB", "--strategy", "random", "--trials", "3",
            "--backend", "simulated", "--seed", "2", "--stack", "trainer", "--space", "default", "--out", str(out)]
    assert main(argv) == 0
    assert len(heard) == 1
    spec, result = heard[0]
    assert isinstance(spec, autotune.TuneSpec)
    assert (spec.strategy, spec.trials, spec.backend, spec.seed, spec.stack) == ("random", 3, "simulated", 2, "trainer")
    assert spec.memory_budget_bytes == int(0.85 * GiB) and spec.workload.model.name == "tiny"
    assert result.run_dir == out and (out / "run.json").is_file()
    printed = capsys.readouterr().out
    assert "--stack trainer: ckpt_interval" in printed  # the library's note, on the CLI's console
    assert "tuning tiny (global batch 16, 1 x cpu) under " in printed
    assert f"report: {out / 'report.md'}" in printed
    # A resumed sweep and a replay of a surface come through the same door.
    assert main([*argv, "--resume"]) == 0
    assert len(heard) == 2 and heard[1][1].results[:len(result.results)] == result.results


def test_cli_json_comes_from_the_library_result(heard, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["tune", "--backend", "simulated", "--trials", "2", "--strategy", "grid", "--out", str(out),
                 "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    (spec, result), = heard
    assert document["recorded"] == len(result.results) and document["stop_reason"] == result.stop_reason.value
    assert document["strategy"] == spec.strategy == "grid" and document["budget"]["trials"] == 2


def test_a_refused_request_reaches_no_run_directory(heard, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["tune", "--backend", "simulated", "--space", "default", "--global-batch", "7", "--gpus", "2",
                 "--out", str(out)])
    assert code == 2 and "the space holds no valid config" in capsys.readouterr().err
    assert heard == [] and not out.exists()  # refused inside tune(), before anything is written


def test_resolve_decides_the_defaults_once():
    workload = make_workload("tiny", global_batch=16)
    settings, space = resolve(autotune.TuneSpec(workload, "cpu", backend="simulated", strategy="grid"))
    assert isinstance(settings, RunSettings) and isinstance(space, Space)
    assert settings.hardware.name == "cpu" and settings.memory_budget_bytes == PROFILES["cpu"].memory_bytes
    assert settings.memory_budget_bytes == memory_budget(None, PROFILES["cpu"])
    # No hardware named: the model's default profile (cpu for tiny), as `autotune tune` gives it.
    defaulted, _ = resolve(autotune.TuneSpec(workload, backend="simulated", strategy="grid"))
    assert defaulted == settings
    chosen, _ = resolve(autotune.TuneSpec(workload, "cpu", memory_budget_bytes=GiB, backend="simulated"))
    assert chosen.memory_budget_bytes == GiB


@pytest.mark.parametrize("changes, message", [
    ({"memory_budget_bytes": 0}, "memory budget 0: must be a positive number of bytes"),
    ({"memory_budget_bytes": -5}, "memory budget -5"),
    ({"seed": -1}, "seed -1: allowed a whole number >= 0"),
    ({"strategy": ""}, "strategy '': allowed a name"),
    ({"stack": "tf"}, "stack 'tf': allowed deepspeed, trainer, accelerate"),
    ({"target_gpus": 0}, "target_gpus 0: allowed null or a whole number >= the workload's gpus"),
])
def test_run_settings_refuse_a_bad_value_in_one_line(changes, message):
    settings, _ = resolve(autotune.TuneSpec(make_workload("tiny"), "cpu", backend="simulated"))
    values = {**settings.__dict__, **changes}
    with pytest.raises(ConfigError) as refused:
        RunSettings(**values)
    assert message in str(refused.value) and "\n" not in str(refused.value)
