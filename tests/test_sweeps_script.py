"""Script workloads of a sweep file (issue 26): `script:` (relative to the file's folder) and `script_args:` instead
of `model:`; the workload is tuned as `autotune tune --script` tunes it (its first trial shows the model, then
the search), through the same sweep runner (autotune.api) as every workload, within the batch on one Ray cluster."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.drivers.ray_script import LOG_FILES
from autotune.values.config import ConfigError
from autotune.values.results import read_results
from autotune.commands.sweep_file import load_sweep
from tests.test_script_ray import SPACE  # the small fp32 space of real script trials

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "job").mkdir()
    shutil.copy(SCRIPTS / "plain_ds_train.py", tmp_path / "job" / "plain_ds_train.py")
    return tmp_path


def test_a_script_workload_loads_as_tune_script_would(folder):
    path = write(folder, "workloads:\n  - {name: s, script: job/plain_ds_train.py, script_args: [--steps, 30],"
                         " global_batch: 8, gpus: 1, hardware: cpu, memory_budget: 6GiB}\n")
    (spec,) = load_sweep(path).workloads
    assert spec.tune is not None and spec.tune.script == str(folder / "job" / "plain_ds_train.py")
    assert spec.tune.script_args == ("--steps", "30") and spec.tune.script_global_batch == 8
    assert spec.settings.backend == "script" and spec.settings.workload.model.name == "unknown"  # until its first trial
    assert spec.settings.workload.global_batch == 8 and spec.budget.trials == 20


@pytest.mark.parametrize("workload, expected", [
    ("{name: s, script: job/missing.py}", "workloads[0].script: 'job/missing.py': no such file"),
    ("{name: s, script: [a.py]}", "workloads[0].script: ['a.py']: allowed a Python script's path"),
    ("{name: s, script: job/plain_ds_train.py, model: tiny}",
     "workloads[0].model: 'tiny': a workload tunes a model or a script, not both (allowed: one of model, script)"),
    ("{name: s, script: job/plain_ds_train.py, script_args: --steps 30}",
     "workloads[0].script_args: '--steps 30': allowed a list of strings"),
    ("{name: s, script: job/plain_ds_train.py, script_args: [--x, {a: 1}]}", "workloads[0].script_args:"),
    ("{name: s, model: tiny, script_args: [--steps, 30]}",
     "workloads[0].script_args: ['--steps', 30]: only with script"),
    ("{name: s, script: job/plain_ds_train.py, backend: simulated}",
     "workloads[0].backend: 'simulated': a script's trials are real runs: allowed deepspeed"),
    ("{name: s, script: job/plain_ds_train.py, surface: s.jsonl}", "workloads[0]: surface is only for backend replay"),
    ("{name: s, script: job/plain_ds_train.py, global_batch: 0}", "workloads[0].global_batch: 0:"),
])
def test_bad_script_workloads_get_one_line_errors(folder, workload, expected):
    path = write(folder, f"workloads:\n  - {workload}\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)) and expected in message, message


def test_a_workloads_own_script_replaces_the_defaults_model_and_its_own_model_their_script(folder):
    path = write(folder, "defaults: {model: tiny, trials: 1}\nworkloads:\n  - {name: s, script: job/plain_ds_train.py}\n"
                         "  - {name: m}\n")
    script, model = load_sweep(path).workloads
    assert script.settings.backend == "script" and model.settings.workload.model.name == "tiny"
    path = write(folder, "defaults: {script: job/plain_ds_train.py, script_args: [--steps, 3]}\nworkloads:\n"
                         "  - {name: m, model: tiny}\n")
    (model,) = load_sweep(path).workloads
    assert model.tune.script is None and model.settings.workload.model.name == "tiny"
    # both from defaults: named there (none is the workload's own)
    path = write(folder, "defaults: {model: tiny, script: job/plain_ds_train.py}\nworkloads:\n  - {name: s}\n")
    with pytest.raises(ConfigError, match=r"sweep.yaml: defaults.model: 'tiny': a workload tunes a model or a script"):
        load_sweep(path)


@pytest.mark.slow
def test_a_script_is_tuned_from_a_sweep_file_beside_a_model_and_a_script_that_cannot_be(folder, capsys):
    """Real trials on a local Ray instance: the plain script's first trial shows its model and global batch, the
    search goes on within the batch (with a simulated model workload), the recommendation is the script's own
    config with the tuned keys; a script that never initializes DeepSpeed ends its own workload only."""
    shutil.copy(SCRIPTS / "plain_ds_config.json", folder / "job" / "plain_ds_config.json")
    (folder / "job" / "space.yaml").write_text(SPACE)
    (folder / "eval").mkdir()
    (folder / "eval" / "train.py").write_text("import deepspeed\nprint('I only evaluate')\n")
    config = folder / "job" / "plain_ds_config.json"
    path = write(folder, f"""\
defaults: {{strategy: optuna, trials: 2, hardware: cpu, memory_budget: 6GiB, stop_when: 0}}
workloads:
  - name: plain
    script: job/plain_ds_train.py
    script_args: [--deepspeed, --deepspeed_config, {config}, --steps, 30]
    space: job/space.yaml
  - name: evaluates
    script: eval/train.py
    space: job/space.yaml
  - {{name: model, model: tiny, backend: simulated}}
""")
    out = folder / "out"
    code = main(["sweep", str(path), "--out", str(out), "--ray-address", "local"])
    printed = capsys.readouterr()
    assert code == 1, printed.err[-3000:]  # the evaluating script has no recommendation
    with open(out / "sweep_summary.csv", newline="") as handle:
        rows = {r["workload"]: r for r in csv.DictReader(handle)}
    results = read_results(out / "plain" / "trials.jsonl")
    assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
    assert all(r.backend == "script" and r.extra["global_batch"] == 1 for r in results)
    assert rows["plain"]["backend"] == "script" and rows["plain"]["recommended"]
    assert rows["plain"]["model"] != "unknown" and rows["plain"]["global_batch"] == "1"  # what its first trial showed
    settings = json.loads((out / "plain" / "run.json").read_text())
    assert settings["backend"] == "script" and settings["workload"]["global_batch"] == 1
    best = json.loads((out / "plain" / "best_ds_config.json").read_text())
    assert best["optimizer"] == json.loads(config.read_text())["optimizer"]  # the script's own, tuned keys merged
    assert best["train_batch_size"] == 1 and "## Script mode" in (out / "plain" / "report.md").read_text()
    assert (out / "plain" / "script.json").is_file()
    # The verdict on Ray: after one trial of its 2, run from the shipped copy.
    (failed,) = read_results(out / "evaluates" / "trials.jsonl")
    assert failed.status == "crash" and failed.extra["script_verdict"] == "never_initialized"
    assert "script_copy" in failed.extra
    assert rows["evaluates"]["recommended"] == "" and "the script cannot be tuned as it is: never_initialized" in printed.out
    assert rows["model"]["recommended"] and rows["model"]["trials"] == "2"

    # Resumed with a third trial each: the script's workload keeps what its first trial learned (no new first
    # trial), nothing recorded is repeated.
    before = (out / "plain" / "trials.jsonl").read_text()
    path.write_text(path.read_text().replace("trials: 2", "trials: 3"))
    code = main(["sweep", str(path), "--out", str(out), "--ray-address", "local", "--resume"])
    printed = capsys.readouterr()
    assert code == 1, printed.err[-3000:]
    results = read_results(out / "plain" / "trials.jsonl")
    assert (out / "plain" / "trials.jsonl").read_text().startswith(before) and len(results) == 3
    assert results[2].status == "ok" and results[2].extra["trial"] == 3 and "first trial of" not in printed.out
    # Run from a fresh shipped copy, its log files landed on the driver (not carried in the result).
    assert Path(results[2].extra["script_copy"]).parent != folder / "job" and LOG_FILES not in results[2].extra
    resumed = json.loads((out / "plain" / "run.json").read_text())
    assert resumed.pop("budget")["trials"] == 3 and settings.pop("budget")["trials"] == 2  # the session's, kept
    assert resumed == settings
