"""Script mode as a second reviewer found it: DeepSpeed's "autotuning" block reaching DeepSpeed (trials and the
user's training stopped at step 5), `trial --script` refusing a micro-batch of the script's own global batch, keys
that disagree at --gpus N, an Accelerate loop's precision, losses divided by the accumulation, launch.sh's
DeepSpeed launcher for a script without --local_rank, and an MLP's attention.

Unit-level where the real file formats suffice; one real launch (DeepSpeed's launcher on the CPU, a tiny script)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import test_script_review
from autotune.cli import main
from autotune.commands import trial as trial_command
from autotune.outputs import script as session
from autotune.outputs.launch import Launch
from autotune.script import accelerate_loop, batch, lightning_loop, merge
from autotune.script.inspect_model import describe, model_info, watch_attention
from autotune.script.shim import KEEP_SCRIPT_BATCH, Shim, ScriptVerdict, watch_local_rank
from autotune.trials.runner import free_port
from autotune.values.config import Config, ConfigError
from autotune.values.dsconfig import ds_config
from autotune.values.results import TrialResult, read_results
from autotune.worker.protocol import WorkerSpec

ROOT = Path(__file__).resolve().parents[1]
AUTOTUNING = {"enabled": True, "tuner_type": "gridsearch", "start_profile_step": 3, "end_profile_step": 5}


# -- 1: DeepSpeed's "autotuning" block is the tuner's to read, never DeepSpeed's to run -----------------------------

def test_the_autotuning_block_reaches_neither_a_trial_nor_the_recommendation(tmp_path, monkeypatch):
    workload = session.placeholder(8, 1)
    trial = ds_config(Config(1, 2, 0, "fp32"), workload)
    user = {"train_batch_size": 8, "wall_clock_breakdown": False, "autotuning": AUTOTUNING}
    merged = merge.merge(user, trial)
    assert "autotuning" not in merged and user["autotuning"] == AUTOTUNING  # the script's own dict untouched
    assert merged["train_batch_size"] == 8
    # The recommendation: the script's own config with the tuned keys, the block left out, and the outputs say so.
    monkeypatch.setattr(test_script_review, "USER_CONFIG", {**test_script_review.USER_CONFIG, "autotuning": AUTOTUNING})
    run_dir, _ = test_script_review.recommended_run(tmp_path)
    best = json.loads((run_dir.path / "best_ds_config.json").read_text())
    assert "autotuning" not in best and best["gradient_clipping"] == 0.5
    report = (run_dir.path / "report.md").read_text()
    assert "best_ds_config.json leaves out the script's 'autotuning' block, as every trial did" in report


# -- 2: trial --script runs the script's own global batch at any micro-batch that divides it -----------------------

class FakeBackend:
    """What run_script_trial needs of a script backend; `run` checks the workload as DeepSpeedBackend.run does
    (ds_config), and returns what the shim would have seen (`model`: None for a trial that never reached it)."""

    made: list["FakeBackend"] = []
    model: dict | None = None

    def __init__(self, script, workload, *args, **kwargs) -> None:
        self.workload = workload
        FakeBackend.made.append(self)

    def run(self, config: Config) -> TrialResult:
        ds_config(config, self.workload)  # raised for micro-batch 32 at the placeholder's global batch 16
        extra = {"log_dir": "logs/x"}
        if self.model is not None:
            extra.update(script_model=self.model, global_batch=self.model["global_batch"])
            return TrialResult(config, "ok", throughput_samples_per_s=10.0, step_time_s=3.2, peak_memory_bytes=2**27,
                               wall_time_s=5.0, backend="script", extra={**extra, "step_time_iqr_s": 0.1,
                                                                         "steps_measured": 3, "stop_reason": "stable",
                                                                         "launch_to_first_step_s": 4.0})
        return TrialResult(config, "crash", wall_time_s=5.0, backend="script", error="boom", extra=extra)


def test_trial_script_runs_a_micro_batch_of_the_scripts_global_batch_that_the_default_would_refuse(
        tmp_path, monkeypatch, capsys):
    script = tmp_path / "train_dict.py"
    script.write_text("print('hi')\n")
    FakeBackend.made.clear()
    FakeBackend.model = {**model_info(nn.Linear(4, 1)), "global_batch": 32, "seq_len": None,
                         "batch": {"global_batch": 32, "micro_batch": 32, "accumulation": 1, "ranks": 1,
                                   "source": "DeepSpeed config"}}
    monkeypatch.setattr(trial_command, "script_backend", FakeBackend)
    argv = ["trial", "--script", str(script), "--zero-stage", "1", "--micro-batch", "32", "--precision", "fp32",
            "--hardware", "cpu", "--run-dir", str(tmp_path / "t")]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    [result] = read_results(tmp_path / "t" / "trials.jsonl")
    assert result.status == "ok" and "unsupported" not in out
    assert "global batch 32 (micro-batch 32 x gradient accumulation 1 x 1 rank, from the DeepSpeed config): the " \
           "script's own, kept" in out
    # A script that states no batch size: one micro-batch per rank where the tuner's default 16 cannot be split.
    FakeBackend.model = {**FakeBackend.model, "batch": None}
    assert main([*argv[:-1], str(tmp_path / "n")]) == 0
    assert FakeBackend.made[-1].workload.global_batch == 32
    assert "global batch 32: micro-batch 32 x 1 rank, as the script states no batch size where DeepSpeed gets it " \
           "and the tuner's default 16 is no multiple of it" in " ".join(capsys.readouterr().out.split())
    # A trial that never showed the model: the header names the script, not the placeholder's figures.
    FakeBackend.model = None
    assert main([*argv[:-1], str(tmp_path / "u")]) == 1
    out = capsys.readouterr().out
    assert "unknown" not in out and "4.3M" not in out
    assert "train_dict.py: its model not seen (the trial did not reach deepspeed.initialize), global batch not read" \
        in " ".join(out.split())


# -- 3: keys that disagree at --gpus N keep train_batch_size, in one note ---------------------------------------------

def test_disagreeing_batch_keys_keep_train_batch_size_and_say_so():
    found = batch.from_ds_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}, 2)
    assert (found.global_batch, found.micro_batch, found.accumulation, found.ranks) == (8, 4, 1, 2)
    assert batch.ScriptBatch.from_dict(found.to_dict()) == found  # through model.json
    settings = test_script_review.script_settings()
    settings = replace(settings, workload=replace(settings.workload, gpus=2))
    settings, settled, notes = session.with_global_batch(settings, {"batch": found.to_dict()}, None)
    assert settings.workload.global_batch == 8 and settings.choices.micro_batch == (1, 2, 4)
    assert "tuner's default" not in notes[0]
    assert notes[0].startswith("global batch 8 (train_batch_size of the DeepSpeed config; the script's batch keys "
                               "disagree at 2 ranks, which DeepSpeed refuses: train_micro_batch_size_per_gpu 8 x 2 "
                               "ranks is no split of train_batch_size 8; train_batch_size wins): the script's own, kept")
    assert not any("the script's own 4 added" in n for n in notes)  # the split is the tuner's, not the script's
    # No split keeps a train_batch_size that is no multiple of the ranks: one line, the first trial's verdict.
    with pytest.raises(ConfigError, match=r"train_batch_size 9, which is no multiple of its 2 ranks"):
        batch.from_ds_config({"train_batch_size": 9, "train_micro_batch_size_per_gpu": 9}, 2)


def test_the_shim_stops_on_a_train_batch_size_no_split_keeps(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    workload = session.placeholder(None, 2)
    config = Config(0, 1, 0, "fp32")
    spec = WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path), extra={KEEP_SCRIPT_BATCH: True})
    with pytest.raises(ScriptVerdict, match="no multiple of its 2 ranks") as verdict:
        Shim(spec, 0).batch_of({"train_batch_size": 9})
    assert verdict.value.verdict == "global_batch_indivisible"
    spec = replace(spec, extra={KEEP_SCRIPT_BATCH: False})  # the tuner's global batch runs: nothing to stop
    assert Shim(spec, 0).batch_of({"train_batch_size": 9}) is None


# -- 4: an Accelerate loop's (or Lightning Trainer's) precision narrows the space -------------------------------------

def test_an_accelerate_loops_precision_is_recorded_and_narrows_the_space():
    class Plugin:
        deepspeed_config = {"bf16": {"enabled": False}}

    class Accelerator:  # what the patch reads of accelerate.Accelerator before the engine exists
        mixed_precision = "no"
        deepspeed_plugin = Plugin()
        deepspeed_engine_wrapped = None

        def _prepare_deepspeed(self, *args):
            return args

    shim = SimpleNamespace(via_trainer=False, model={}, script_precision=None, write_model=lambda: None)
    accelerate_loop.patch(SimpleNamespace(Accelerator=Accelerator), shim)
    Accelerator()._prepare_deepspeed("model")
    assert shim.script_precision == ("fp32", "the Accelerator's mixed_precision 'no'")
    assert [lightning_loop.precision_of(p) for p in ("32-true", "bf16-mixed", "16-mixed", "64-true")] == \
        ["fp32", "bf16", "fp16", None]
    settings = test_script_review.script_settings()
    settings = replace(settings, choices=replace(settings.choices, precision=("bf16", "fp32")))
    model = {"class": "Sequential", "checkpoint_switch": None, "script_precision": "fp32",
             "script_precision_source": "the Accelerator's mixed_precision 'no'"}
    narrowed, notes = session.narrowed(settings, model)
    assert narrowed.choices.precision == ("fp32",) and {c.precision for c in narrowed.space()} == {"fp32"}
    assert "precision: fp32 only, the script's own (the Accelerator's mixed_precision 'no')" in notes[-1]
    # A space without the script's precision is kept, and said.
    narrowed, notes = session.narrowed(settings, {**model, "script_precision": "fp16"})
    assert narrowed.choices.precision == ("bf16", "fp32") and "does not hold" in notes[-1]


# -- 5: the Trainer's and Lightning's losses, divided by the accumulation before engine.backward --------------------

def test_losses_handed_over_divided_by_the_accumulation_are_recorded_whole(tmp_path):
    workload = session.placeholder(None, 1)
    config = Config(0, 1, 0, "fp32")
    shim = Shim(WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path)), 0)
    shim.engine = SimpleNamespace(gradient_accumulation_steps=lambda: 4)
    loss = torch.tensor(0.25)
    assert shim.unscaled(loss) is loss  # DeepSpeed's own loop, Accelerate: the engine scales it
    shim.via_trainer = True
    assert float(shim.unscaled(loss)) == 1.0
    shim.via_trainer, shim.model = False, {"via": lightning_loop.VIA}
    assert float(shim.unscaled(loss)) == 1.0
    assert shim.unscaled(torch.tensor(0.25, dtype=torch.bfloat16)).dtype == torch.bfloat16  # its quantum kept


# -- 6: launch.sh's DeepSpeed launcher for a script that takes no --local_rank ----------------------------------------

def test_the_shim_sees_whether_the_scripts_parser_takes_local_rank(monkeypatch):
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", argparse.ArgumentParser.parse_args)  # restored after
    monkeypatch.setattr(sys, "argv", ["/x/train.py", "--steps", "3"])
    written: list[bool] = []
    shim = SimpleNamespace(takes_local_rank=None, model={}, write_model=lambda: written.append(True))
    watch_local_rank(shim)
    argparse.ArgumentParser(prog="other").parse_args([])  # a library's parser, its own arguments: not the script's
    strict = argparse.ArgumentParser()
    strict.add_argument("--steps", type=int)
    assert strict.parse_args().steps == 3 and shim.takes_local_rank is False
    shim = SimpleNamespace(takes_local_rank=None, model={"class": "M"}, write_model=lambda: written.append(True))
    watch_local_rank(shim)
    strict.add_argument("--local_rank", type=int, default=-1)
    strict.parse_args()
    assert shim.takes_local_rank is True and shim.model["takes_local_rank"] is True and written


def test_launch_sh_passes_options_before_the_script_to_the_launcher(tmp_path):
    launch = Launch(1, 1, "/usr/bin", (), program=("train.py", "--steps", "3"))
    sh = tmp_path / "launch.sh"
    sh.write_text(launch.script().replace("exec deepspeed", "exec echo deepspeed"))
    ran = subprocess.run(["bash", str(sh), "deepspeed", "--no_local_rank", "--master_port=1234"], capture_output=True,
                         text=True, check=True)
    assert ran.stdout.split() == ["deepspeed", "--num_gpus", "1", "--no_local_rank", "--master_port=1234", "train.py",
                                  "--steps", "3"]
    ran = subprocess.run(["bash", str(sh), "deepspeed"], capture_output=True, text=True, check=True)  # set -u: none
    assert ran.stdout.split() == ["deepspeed", "--num_gpus", "1", "train.py", "--steps", "3"]
    ran = subprocess.run(["bash", str(sh), "deepspeed", "other.py", "-v"], capture_output=True, text=True, check=True)
    assert ran.stdout.split() == ["deepspeed", "--num_gpus", "1", "other.py", "-v"]


STRICT_SCRIPT = test_script_review.DICT_SCRIPT.replace(
    'parser.add_argument("--local_rank", type=int, default=-1)\n', "")


@pytest.mark.slow
def test_launch_sh_under_deepspeeds_launcher_runs_a_script_without_local_rank(tmp_path, monkeypatch):
    assert "--local_rank" not in STRICT_SCRIPT
    monkeypatch.setattr(test_script_review, "DICT_SCRIPT", STRICT_SCRIPT)
    run_dir, _ = test_script_review.recommended_run(tmp_path, seen={"takes_local_rank": False})
    launch = (run_dir.path / "launch.sh").read_text()
    assert "# This script takes no --local_rank: the deepspeed form passes --no_local_rank." in launch
    assert "deepspeed) exec deepspeed --num_gpus 1 --no_local_rank \"$@\"" in launch
    assert "launch.sh's deepspeed form passes --no_local_rank" in (run_dir.path / "report.md").read_text()
    ran = subprocess.run(["bash", str(run_dir.path / "launch.sh"), "deepspeed", f"--master_port={free_port()}"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in ran.stdout.splitlines() if line.startswith("ENGINE ")]
    assert ran.returncode == 0 and lines, ran.stderr[-3000:]
    engine = json.loads(lines[-1].removeprefix("ENGINE "))
    assert (engine["micro"], engine["accumulation"], engine["stage"]) == (4, 2, 1)  # the recommendation


# -- 7: a model without attention ------------------------------------------------------------------------------------

def test_an_mlp_is_described_as_showing_no_attention():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    info = model_info(model)
    watch_attention(model, info, lambda: None)
    model(torch.randn(2, 8))
    assert "attention" not in info
    text = describe(info)
    assert text.startswith("no attention seen in the first forward") and "SDPA" not in text
    assert describe({}).startswith("attention fused SDPA (assumed: nothing showed it)")  # the forward never seen
