"""Script mode for loops that build their own DataLoader: a hand-written Accelerate loop
(`Accelerator(deepspeed_plugin=...)`, autotune.script.accelerate_loop) and a Lightning Trainer with a DeepSpeed
strategy (autotune.script.lightning_loop). The slow tests tune the unchanged fixture scripts in tests/scripts/
with real DeepSpeed trials on the CPU (gloo, fp32) and train them again with the recommendation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

from autotune.cli import main
from autotune.values.results import read_results
from autotune.trials.runner import extensions_dir, free_port
from autotune.script import accelerate_loop, lightning_loop
from autotune.script.loaders import batch_flag, first_tensor, rebatched
from autotune.script.shim import ScriptVerdict

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# Micro-batches 2 and 4 of the scripts' global batch of 8 (DataLoader 4 x accumulation 2): accumulation 4 and 2.
SPACE = """\
zero_stage: [1, 2]
micro_batch: [2, 4]
ckpt_interval: [0]
precision: [fp32]
offload_optimizer: [none]
offload_param: [none]
"""


# -- the parts that need no trial ---------------------------------------------------------------------------------
def test_rebatched_keeps_the_loaders_sampling_and_changes_only_its_batch_size():
    data = TensorDataset(torch.arange(10))
    loader = DataLoader(data, batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(1))
    again = rebatched(loader, 3)
    assert isinstance(again.sampler, RandomSampler) and again.sampler is loader.sampler
    assert again.drop_last and again.batch_size == 3
    assert [len(b[0]) for b in again] == [3, 3, 3]
    plain = rebatched(DataLoader(data, batch_size=4), 5)
    assert [b[0].tolist() for b in plain] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # order kept, last batch kept
    # Batches the script makes itself cannot be resized from outside.
    own = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    assert rebatched(own, 3) is None
    assert rebatched(DataLoader(data, batch_size=None), 3) is None
    sampler = BatchSampler(SequentialSampler(data), 2, False)
    assert rebatched(DataLoader(data, batch_sampler=sampler), 3) is None  # passed by the script, even a plain one


def test_batch_flags_are_found_by_name_and_value():
    args = ["--ds-config", "c.json", "--batch-size", "4", "--steps", "4"]
    assert batch_flag(args, 4) == "--batch-size"
    assert batch_flag(args, 8) is None  # the flag's value is not the loader's batch: not the flag that set it
    assert batch_flag(["--per_device_train_batch_size=16"], 16) == "--per_device_train_batch_size"
    assert batch_flag(["--steps", "4"], 4) is None


def test_the_first_batch_is_found_inside_lists_and_dicts():
    tokens = torch.zeros(3, 5, dtype=torch.long)
    assert first_tensor(([tokens], 7), torch.Tensor) is tokens  # Lightning: (batch, batch_idx)
    assert first_tensor(({"input_ids": tokens},), torch.Tensor) is tokens
    assert first_tensor((torch.tensor(1.0), 3), torch.Tensor) is None  # no batch dimension


def test_a_loop_that_steps_at_every_batch_cannot_keep_the_global_batch():
    calls = []
    wrapped = SimpleNamespace(backward=lambda loss, sync_gradients=True: calls.append(sync_gradients))
    accelerator = SimpleNamespace(gradient_state=SimpleNamespace(end_of_dataloader=False))
    loop = accelerator_loop(micro=2, accumulation=4)
    accelerate_loop._check_accumulation(accelerator, wrapped, loop)
    for sync in (False, False, False, True, False, False, False, True):  # `with accelerator.accumulate(model):`
        wrapped.backward(1.0, sync_gradients=sync)
    accelerator.gradient_state.end_of_dataloader = True
    wrapped.backward(1.0, sync_gradients=True)  # the epoch's last batch ends an accumulation early: allowed
    accelerator.gradient_state.end_of_dataloader = False
    assert len(calls) == 9
    with pytest.raises(ScriptVerdict) as caught:
        wrapped.backward(1.0, sync_gradients=True)  # no accumulate(): a boundary at the first batch
    assert caught.value.verdict == "ignores_accumulation"
    assert "accumulation 4" in str(caught.value) and "micro_batch: [8]" in str(caught.value)


def accelerator_loop(micro: int, accumulation: int) -> accelerate_loop.Loop:
    return accelerate_loop.Loop(script_micro=4, micro=micro, accumulation=accumulation, loader_factor=1,
                                micro_auto=True)


def test_recommendations_name_the_loaders_batch_and_keep_what_the_frameworks_set():
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    model = {"accelerate": accelerator_loop(2, 4).to_dict()}
    out, flags, text = accelerate_loop.recommendation(ds, model, ["--ds-config", "c.json", "--batch-size", "4"])
    assert out["train_micro_batch_size_per_gpu"] == "auto" and out["gradient_accumulation_steps"] == 4
    assert out["train_batch_size"] == 8 and flags == ["--batch-size", "2"] and "batches of 2" in text
    out, flags, text = accelerate_loop.recommendation(ds, model, [])  # the script ran its default batch size
    assert flags == [] and "batch_size=2" in text
    model = {"lightning": lightning_loop.Loop(4, 2, 2, 4).to_dict()}
    out, flags, text = lightning_loop.recommendation(ds, model, ["--cpu", "--batch-size", "4", "--accumulate", "2"])
    assert set(lightning_loop.TRAINER_KEYS).isdisjoint(out) and out["zero_optimization"] == {"stage": 2}
    assert flags == ["--batch-size", "2", "--accumulate", "4"] and "DeepSpeedStrategy(config=" in text


# -- real trials ------------------------------------------------------------------------------------------------
def tune(out: Path, script: Path, script_args: str, capsys) -> tuple[int, str]:
    space = out.parent / "space.yaml"
    space.write_text(SPACE)
    code = main(["tune", "--script", str(script), "--script-args", script_args, "--space", str(space),
                 "--strategy", "optuna", "--trials", "2", "--memory-budget", "6GiB", "--out", str(out)])
    return code, capsys.readouterr().out


def run_unchanged(script: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The user's script on its own, one rank, as a launcher would start it.

    A port taken between free_port() and the script's own bind (another process's ephemeral port: the user's
    launcher would pick another too) is tried again with a new one."""
    for _ in range(3):
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "TORCH_EXTENSIONS_DIR": extensions_dir(sys.executable),
               "DS_ACCELERATOR": "cpu"}
        ran = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=600)
        if "EADDRINUSE" not in ran.stderr:
            break
    return ran


def check_trials(out: Path, via: str, info_key: str) -> list:
    results = read_results(out / "trials.jsonl")
    assert [r.status for r in results] == ["ok"] * 2, [r.error for r in results]
    assert results[0].config.micro_batch == 2  # the first trial: the smallest micro-batch, accumulation 4
    for r in results:
        model = r.extra["script_model"]
        assert "script_verdict" not in r.extra and model["via"] == via
        assert model["micro_batch_seen"] == r.config.micro_batch  # the trial's micro-batch reached the loader
        used = json.loads((Path(r.extra["log_dir"]) / "ds_config.json").read_text())
        assert used["train_micro_batch_size_per_gpu"] == r.config.micro_batch
        assert used["train_batch_size"] == 8 == r.extra["global_batch"]  # the script's global batch, kept
        assert used["gradient_accumulation_steps"] == 8 // r.config.micro_batch == model[info_key]["accumulation"]
        assert used["zero_optimization"]["stage"] == r.config.zero_stage
        assert model[info_key]["loader_batch"] == 4 and model[info_key]["loader_batch_now"] == r.config.micro_batch
    return results


@pytest.mark.slow
def test_a_hand_written_accelerate_loop_is_tuned_and_its_recommendation_trains(tmp_path, capsys):
    out = tmp_path / "run"
    config = SCRIPTS / "accelerate_loop_config.json"
    code, printed = tune(out, SCRIPTS / "accelerate_loop_train.py",
                         f"--ds-config {config} --batch-size 4 --steps 16", capsys)
    assert code == 0, printed
    assert "global batch 8 (micro-batch 4 x gradient accumulation 2 x 1 rank, from the DeepSpeed config): the " \
           "script's own, kept" in printed
    check_trials(out, accelerate_loop.VIA, accelerate_loop.INFO)
    best = json.loads((out / "best_ds_config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())["best"]["config"]
    micro, stage = summary["micro_batch"], summary["zero_stage"]
    assert best["train_micro_batch_size_per_gpu"] == "auto"  # as the script's config had it: the loader decides
    assert (best["train_batch_size"], best["gradient_accumulation_steps"]) == (8, 8 // micro)
    assert best["gradient_clipping"] == 1.0 and best["zero_optimization"]["stage"] == stage
    flags = json.loads((out / "script.json").read_text())["recommended_script_flags"]
    assert flags == ["--batch-size", str(micro)] and f"pass --batch-size {micro}" in printed
    ran = run_unchanged(SCRIPTS / "accelerate_loop_train.py",
                        ["--ds-config", str(out / "best_ds_config.json"), *flags, "--steps", "4"], tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (f"training done: 4 steps, batches of {micro}, global batch 8, accumulation {8 // micro}, zero stage "
            f"{stage}") in ran.stdout


@pytest.mark.slow
def test_an_accelerate_loop_too_short_for_the_trials_accumulation_names_its_batches_and_its_flag(tmp_path, capsys):
    """Accelerate calls engine.step() at accumulation boundaries only: 6 batches at micro-batch 1 (accumulation 8)
    step the optimizer never. The verdict counts the loop's batches (its backward passes), so it names the
    script's --steps and how many batches measuring needs (2 optimizer steps x 8), not "never stepped"."""
    code = main(["trial", "--script", str(SCRIPTS / "accelerate_loop_train.py"), "--script-args",
                 f"--ds-config {SCRIPTS / 'accelerate_loop_config.json'} --batch-size 4 --steps 6",
                 "--zero-stage", "0", "--micro-batch", "1", "--precision", "fp32", "--run-dir", str(tmp_path / "t"),
                 "--json"])
    result = json.loads(capsys.readouterr().out)["result"]
    assert code == 1 and result["script_verdict"] == "too_few_steps", result
    assert "6 micro-batches (engine.backward() calls), 0 optimizer steps at the trial's gradient accumulation 8" \
        in result["error"]
    assert "pass --steps 16 or more" in result["error"]


@pytest.mark.slow
def test_a_lightning_deepspeed_script_is_tuned_and_its_recommendation_trains(tmp_path, capsys):
    out = tmp_path / "run"
    code, printed = tune(out, SCRIPTS / "lightning_train.py", "--cpu --batch-size 4 --accumulate 2 --steps 5", capsys)
    assert code == 0, printed
    assert "global batch 8 (micro-batch 4 x gradient accumulation 2 x 1 rank" in printed
    results = check_trials(out, lightning_loop.VIA, lightning_loop.INFO)
    # max_steps counts optimizer steps at the trial's accumulation: 5, one of them warm-up.
    assert all(3 <= r.extra["steps_measured"] <= 4 for r in results)
    best = json.loads((out / "best_ds_config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())["best"]["config"]
    micro, stage = summary["micro_batch"], summary["zero_stage"]
    assert set(lightning_loop.TRAINER_KEYS).isdisjoint(best) and best["zero_optimization"]["stage"] == stage
    flags = json.loads((out / "script.json").read_text())["recommended_script_flags"]
    assert flags == ["--batch-size", str(micro), "--accumulate", str(8 // micro)]
    ran = run_unchanged(SCRIPTS / "lightning_train.py",
                        ["--cpu", "--ds-config", str(out / "best_ds_config.json"), *flags, "--steps", "3"], tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (f"training done: 3 steps, global batch 8, micro-batch {micro}, accumulation {8 // micro}, zero stage "
            f"{stage}") in ran.stdout
