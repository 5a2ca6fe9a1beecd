"""Script mode against the real thing: the examples, unchanged, tuned with real DeepSpeed trials on the CPU
(gloo, fp32, no offload), and the recommended config passed back to the same unchanged script. (Issue 18's
plain script with its global batch of 1 is tuned in tests/test_script_ray.py, on a local Ray instance.)"""

from __future__ import annotations

import json
import shlex
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autotune
from autotune.cli import main
from autotune.script import alike
from autotune.values.config import ConfigError
from autotune.outputs.handoff import validate
from autotune.values.results import read_results
from autotune.trials.runner import extensions_dir, free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = ROOT / "tests" / "scripts"  # scripts written as users write them, outside any example
# No offload (an offloaded optimizer would compile DeepSpeed's CPU Adam, minutes); checkpointing 0-2 so that
# the space has to lose what a model cannot apply.
SPACE = """\
zero_stage: [0, 1, 2]
micro_batch: [4, 8]
ckpt_interval: [0, 1, 2]
precision: [fp32]
offload_optimizer: [none]
offload_param: [none]
"""
HF_ARGS = "--use_cpu true --report_to none --save_strategy no --disable_tqdm true"


@pytest.fixture(scope="module")
def space_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("space") / "space.yaml"
    path.write_text(SPACE)
    return path


def run_unchanged(script: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The user's script on its own, one rank, as `deepspeed --num_gpus 1` would start it.

    A port taken between free_port() and the script's own bind (another process's ephemeral port: the user's
    launcher would pick another too) is tried again with a new one."""
    for _ in range(3):
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "TORCH_EXTENSIONS_DIR": extensions_dir(sys.executable)}
        ran = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=600)
        if "EADDRINUSE" not in ran.stderr:
            break
    return ran


def tune(out: Path, space: Path, script: Path, script_args: str, capsys, trials: int = 3,
         resume: bool = False) -> tuple[int, str]:
    code = main(["tune", "--script", str(script), "--script-args", script_args, "--space", str(space),
                 "--strategy", "optuna", "--trials", str(trials), "--memory-budget", "6GiB", "--out", str(out)]
                + (["--resume"] if resume else []))
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_plain_script_with_a_config_path_is_tuned_and_its_recommendation_trains(space_file, tmp_path, capsys):
    """Started from Python (`autotune.tune(TuneSpec.for_script(...))`, issue 26), resumed with `autotune tune
    --script --resume`: both doors to one sweep, and the CLI's resume goes through the library's."""
    out = tmp_path / "run"
    script_args = f"--deepspeed_config {EXAMPLES / 'ds_config.json'} --steps 5"
    spec = autotune.TuneSpec.for_script(EXAMPLES / "train_plain.py", script_args.split(), memory_budget_bytes=6 * 2**30,
                                        space=str(space_file), strategy="optuna", trials=3)
    result = autotune.tune(spec, out)
    assert [r.status for r in result.results] == ["ok"] * 3, [r.error for r in result.results]
    assert all(r.backend == "script" for r in result.results) and result.best is not None
    best = json.loads((out / "best_ds_config.json").read_text())
    assert best["scheduler"]["type"] == "WarmupLR"  # the script's own config, tuned keys merged in
    assert best["zero_optimization"]["stage"] == result.best.config.zero_stage
    assert "## Script mode" in (out / "report.md").read_text()
    # Resumed: the shape learned by the first trial is kept and the sweep goes on; another script (the same
    # file with other arguments) is refused, from the command line and from Python.
    code, printed = tune(out, space_file, EXAMPLES / "train_plain.py", script_args, capsys, trials=4, resume=True)
    assert code == 0, printed
    assert tune(out, space_file, EXAMPLES / "train_plain.py", "--steps 5", capsys, trials=5, resume=True)[0] == 2
    with pytest.raises(ConfigError, match=r"--resume \(resume=True\): .* tuned .*train_plain.py"):
        autotune.tune(autotune.TuneSpec.for_script(EXAMPLES / "train_plain.py", ["--steps", "5"],
                                                   memory_budget_bytes=6 * 2**30, space=str(space_file),
                                                   strategy="optuna", trials=5), out, resume=True)
    results = read_results(out / "trials.jsonl")
    assert len(results) >= 4 and {r.status for r in results} == {"ok"}, [r.error for r in results]
    searched = [r for r in results if r.extra.get("phase") != "confirm"]  # a close call's confirmation repeats one
    assert len({r.config for r in searched}) == len(searched) >= 3
    # The third trial ran on shim ranks started during the second (issue 41), their imports off its clock; the first
    # (its own backend, learning the model) and the second (the sweep backend's first) started their own. Each
    # trained, as the loop below checks.
    assert [r.extra["import_ahead_s"] is not None for r in results[:3]] == [False, False, True]
    assert results[0].config.zero_stage == 0 and results[0].config.micro_batch == 4  # the plain first trial
    for r in results:
        assert r.backend == "script" and r.throughput_samples_per_s > 0 and r.peak_memory_bytes > 0
        assert r.extra["basic_optimizer"] == "FusedAdam"  # the script's AdamW from its config file
        used = json.loads((Path(r.extra["log_dir"]) / "ds_config.json").read_text())
        assert used["zero_optimization"]["stage"] == r.config.zero_stage
        assert used["train_micro_batch_size_per_gpu"] == r.config.micro_batch
        assert used["scheduler"]["type"] == "WarmupLR" and used["optimizer"]["params"]["lr"] == 3e-4
        assert r.extra["script_model"]["micro_batch_seen"] == r.config.micro_batch
        # The engine's steps counted as the worker counts them (issue 40): all applied, the state there to measure.
        assert r.extra["steps_skipped"] == 0 and r.extra["steps_applied"] == 1 + r.extra["steps_measured"]
        assert r.extra["optimizer_state_bytes"] > 0 and r.extra["loss_first"] != r.extra["loss_last"]
    # What the estimator learned from the model handed to deepspeed.initialize, and what it did with it.
    settings = json.loads((out / "run.json").read_text())
    assert settings["backend"] == "script"
    model = settings["workload"]["model"]
    assert (model["layers"], model["hidden"], model["vocab"], model["seq_len"]) == (2, 128, 1024, 64)
    assert settings["workload"]["global_batch"] == 16  # ds_config.json's train_batch_size, kept
    assert settings["space"]["ckpt_interval"] == [0]  # TinyLM has no checkpointing switch
    assert json.loads((out / "calibration.json").read_text())["samples"] >= 2
    report = (out / "report.md").read_text()
    assert "## Script mode" in report and "activation checkpointing was removed from the space" in report
    assert "activation checkpointing was removed" in printed

    best = json.loads((out / "best_ds_config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert best["train_micro_batch_size_per_gpu"] == summary["best"]["config"]["micro_batch"]
    assert best["zero_optimization"]["stage"] == summary["best"]["config"]["zero_stage"]
    assert best["scheduler"]["type"] == "WarmupLR"  # the script's own settings survive
    # No files for other stacks built from the built-in config beside the script's own recommendation.
    assert not (out / "best_hf_ds_config.json").exists() and not (out / "best_accelerate_config.yaml").exists()
    assert "Hugging Face Trainer:" not in printed
    validate(best)
    # `autotune report` rewrites the script's recommendation and section, not the built-in config's.
    before = (out / "best_ds_config.json").read_text()
    assert main(["report", str(out)]) == 0
    assert "best_ds_config.json is the script's own DeepSpeed config" in capsys.readouterr().out
    assert (out / "best_ds_config.json").read_text() == before
    assert (out / "report.md").read_text().count("## Script mode") == 1
    # launch.sh runs the script's own command with the recommendation in it (its config argument now names
    # best_ds_config.json), under torchrun, in the trials' environment: what the user types.
    launch = (out / "launch.sh").read_text()
    command = shlex.join([str(EXAMPLES / "train_plain.py"), "--deepspeed_config", str(out / "best_ds_config.json"),
                          "--steps", "5"])
    assert f"#   bash launch.sh torchrun {command}" in launch and f"[ $# -gt 0 ] || set -- {command}" in launch
    assert f"launch: bash {out / 'launch.sh'} torchrun {command}" in printed
    report = (out / "report.md").read_text()
    assert f"- Launch: `bash launch.sh torchrun {command}`" in report
    assert "as the script's own config" in report and "recommended_trainer_args.json" not in report  # not written
    for _ in range(3):  # a port taken by another process meanwhile is tried again, as a user would
        ran = subprocess.run(["bash", str(out / "launch.sh"), "torchrun"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=600, env={**os.environ, "PET_MASTER_PORT": str(free_port())})
        if "EADDRINUSE" not in ran.stderr:
            break
    assert ran.returncode == 0 and "training done" in ran.stdout, ran.stderr[-3000:]


@pytest.mark.slow
def test_hugging_face_trainer_script_is_tuned_with_checkpointing_and_its_recommendation_trains(space_file, tmp_path,
                                                                                              capsys):
    out = tmp_path / "run"
    code, printed = tune(out, space_file, EXAMPLES / "train_hf.py",
                         f"--deepspeed {EXAMPLES / 'ds_config_hf.json'} --output_dir {tmp_path / 'hf'} "
                         f"--max_steps 5 {HF_ARGS}", capsys, trials=3)
    assert code == 0, printed
    results = read_results(out / "trials.jsonl")
    assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]
    first = results[0].extra["script_model"]
    assert first["class"] == "GPT2LMHeadModel" and first["via"] == "transformers.TrainingArguments"
    assert (first["layers"], first["hidden"], first["seq_len"]) == (2, 128, 64)
    # The third trial ran on ranks started during the second that had imported the Trainer too (issue 41: the
    # frameworks the first trial showed); the checks below show its TrainingArguments still took the trial's config.
    assert "transformers.trainer" in first["frameworks"]
    assert [r.extra["import_ahead_s"] is not None for r in results] == [False, False, True]
    settings = json.loads((out / "run.json").read_text())
    assert settings["space"]["ckpt_interval"] == [0, 1]  # the model's switch: every layer or none
    # TrainingArguments' per_device_train_batch_size (default 8) x accumulation 1 x 1 rank: kept by every trial.
    assert settings["workload"]["global_batch"] == 8 and first["batch"]["source"] == "TrainingArguments"
    for r in results:
        used = json.loads((Path(r.extra["log_dir"]) / "ds_config.json").read_text())
        assert used["train_batch_size"] == 8 == used["train_micro_batch_size_per_gpu"] * used["gradient_accumulation_steps"]
        assert used["train_micro_batch_size_per_gpu"] == r.config.micro_batch == r.extra["script_model"]["micro_batch_seen"]
        assert used["zero_optimization"]["stage"] == r.config.zero_stage
        assert used["scheduler"]["type"] == "WarmupDecayLR"  # the script's scheduler, its "auto" values filled
        assert r.extra["script_model"]["checkpointing_on"] == (r.config.ckpt_interval == 1)
    info = json.loads((out / "script.json").read_text())
    flags = info["recommended_trainer_flags"]
    best = json.loads((out / "best_ds_config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())["best"]["config"]
    assert best["train_micro_batch_size_per_gpu"] == summary["micro_batch"]
    assert best["optimizer"]["params"]["lr"] == "auto"  # still the script's config, for the Trainer to fill
    assert "TrainingArguments" in printed
    ran = run_unchanged(EXAMPLES / "train_hf.py", ["--deepspeed", str(out / "best_ds_config.json"), "--output_dir",
                                                    str(tmp_path / "again"), "--max_steps", "2", *HF_ARGS.split(),
                                                    *flags], tmp_path)
    assert ran.returncode == 0 and "training done: 2 steps" in ran.stdout, ran.stderr[-3000:]


@pytest.mark.slow
def test_script_passing_a_dict_keeps_its_own_optimizer(tmp_path, capsys):
    code = main(["trial", "--script", str(EXAMPLES / "train_dict.py"), "--script-args", "--steps 5",
                 "--zero-stage", "2", "--micro-batch", "8", "--precision", "fp32", "--run-dir", str(tmp_path / "t"),
                 "--json"])
    printed = json.loads(capsys.readouterr().out)
    result = printed["result"]
    assert code == 0, result["error"]
    assert result["basic_optimizer"] == "SGD" and result["script_model"]["via"] == "deepspeed.initialize"
    # 5 steps, 1 of warm-up: the script ends after 4 measured ones unless the step time is stable at 3 already
    # (on a quiet machine it is).
    assert (result["stop_reason"], result["steps_measured"]) in {("script_ended", 4), ("stable", 3), ("stable", 4)}
    used = json.loads((Path(result["log_dir"]) / "ds_config.json").read_text())
    # The script's own global batch of 32 (its dict), at micro-batch 8: accumulation 4.
    assert used["zero_optimization"]["stage"] == 2 and used["gradient_accumulation_steps"] == 4
    assert used["train_batch_size"] == 32 == result["global_batch"] == printed["global_batch"]["global_batch"]
    assert used["gradient_clipping"] == 0.5 and used["zero_allow_untested_optimizer"] is True
    assert printed["model"]["layers"] == 4 and printed["prediction"]["memory"]["total"] > 0


BROKEN = {
    "crashed_before_initialize": "import deepspeed\nraise RuntimeError('no data found')\n",
    "never_initialized": "import deepspeed\nprint('I only evaluate')\n",
    "never_stepped": ("import deepspeed, torch\nmodel = torch.nn.Linear(4, 4)\n"
                      "engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), "
                      "config={'train_batch_size': 16, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})\n"
                      "print('initialized, leaving')\n"),
    "ignores_micro_batch": ("import deepspeed, torch\nmodel = torch.nn.Linear(4, 1)\n"
                            "engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), "
                            "config={'train_batch_size': 16, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})\n"
                            "for _ in range(10):\n"
                            "    engine.backward(engine(torch.randn(16, 4)).sum())  # its own batch of 16\n"
                            "    engine.step()\n"),
}


@pytest.mark.slow
@pytest.mark.parametrize("verdict", list(BROKEN))
def test_a_script_that_cannot_be_tuned_stops_the_sweep_after_the_first_trial(verdict, space_file, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(BROKEN[verdict])
    code, printed = tune(tmp_path / "run", space_file, script, "", capsys, trials=5)
    assert code == 1
    results = read_results(tmp_path / "run" / "trials.jsonl")
    assert len(results) == 1 and results[0].status == "crash"
    assert results[0].extra["script_verdict"] == verdict
    assert f"the script cannot be tuned as it is: {verdict}" in printed
    assert "stopped after the first trial" in printed
    if verdict == "crashed_before_initialize":
        assert "no data found" in results[0].error
    assert "cannot be tuned as it is" in (tmp_path / "run" / "report.md").read_text()


@pytest.mark.slow
def test_a_script_failing_at_its_third_step_whatever_the_config_stops_the_sweep_in_one_line(space_file, tmp_path,
                                                                                             capsys):
    """Past the first trial: two configs apart in layout crashing alike after their steps (the same exit, at the same line, after the
    same 3 optimizer steps) end the sweep (autotune.script.alike), where a reviewer's sweep ran all its trials into
    the same `fatal: bad data (exit code 3)`; their records keep the steps they took."""
    script = tmp_path / "train.py"
    script.write_text("import sys, deepspeed, torch\nmodel = torch.nn.Linear(4, 1)\n"
                      "engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={"
                      "'train_batch_size': 8, 'optimizer': {'type': 'AdamW', 'params': {'torch_adam': True}}})\n"
                      "for step in range(10):\n"
                      "    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 4)\n"
                      "    for _ in range(engine.gradient_accumulation_steps()):\n"
                      "        engine.backward(engine(x).sum()); engine.step()\n"
                      "    if step == 2:\n        sys.exit('fatal: bad data')\n")
    code, printed = tune(tmp_path / "run", space_file, script, "", capsys, trials=8)
    assert code == 1
    results = read_results(tmp_path / "run" / "trials.jsonl")
    assert {r.status for r in results} == {"crash"}
    # It stops at the first trial whose config is apart in layout (alike.apart) from an earlier one crashed alike.
    *earlier, last = results
    assert any(alike.apart(r.config, last.config) for r in earlier)
    assert not any(alike.apart(a.config, b.config) for i, a in enumerate(earlier) for b in earlier[i + 1:])
    assert [r.extra.get("steps_applied") for r in results] == [3] * len(results)  # what ran before the failure, kept
    assert last.extra["script_verdict"] == "fails_alike_after_initialize"
    said = "fails_alike_after_initialize: fatal: bad data (train.py:9 in <module>), after 3 optimizer steps, in "
    assert f"stopping: {said}" in printed and "stopped: a failure no other config can avoid" in printed
    report = (tmp_path / "run" / "report.md").read_text()
    assert report.split("\n")[2].startswith(f"**The script cannot be tuned as it is: {said}")
    assert "No trial has figures: the script stopped the sweep" in report and "run more trials" not in report


@pytest.mark.slow
def test_a_loop_too_short_for_the_trials_accumulation_names_the_micro_steps_and_the_flag(tmp_path, capsys):
    """A global batch of 4 (train_batch_size 4) at micro-batch 1 is accumulation 4: 6 micro-batches are
    one optimizer step, all warm-up; the verdict asks for 8 through the script's own --steps."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**json.loads((SCRIPTS / "plain_ds_config.json").read_text()),
                                  "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}))
    code = main(["trial", "--script", str(SCRIPTS / "plain_ds_train.py"), "--script-args",
                 f"--deepspeed --deepspeed_config {config} --steps 6", "--zero-stage", "0", "--micro-batch", "1",
                 "--precision", "fp32", "--run-dir", str(tmp_path / "t"), "--json"])
    printed = json.loads(capsys.readouterr().out)
    result = printed["result"]
    assert code == 1 and result["script_verdict"] == "too_few_steps"
    assert "6 micro-batches (engine.backward() calls), 1 optimizer step at the trial's gradient accumulation 4" \
        in result["error"]
    assert "pass --steps 8 or more" in result["error"]
    assert printed["global_batch"]["script"]["global_batch"] == 4  # the script's, not the tuner's default of 16


@pytest.mark.slow
def test_the_first_trial_shows_the_tuner_an_eager_multihead_attention(tmp_path, capsys):
    """Issue 18's script as most write it (nn.MultiheadAttention with need_weights left True): the first trial
    sees the eager attention in the model's first forward, and the sweep's shape (run.json) counts it."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE.replace("micro_batch: [4, 8]", "micro_batch: [1]").replace("[0, 1, 2]\nprecision",
                                                                                      "[0]\nprecision"))
    out = tmp_path / "run"
    code, printed = tune(out, space, SCRIPTS / "mha_gpt_train.py",
                         f"--deepspeed --deepspeed_config {SCRIPTS / 'plain_ds_config.json'} --steps 8 --dropout 0.1",
                         capsys, trials=1)
    assert code == 0, printed
    [first] = read_results(out / "trials.jsonl")
    seen = first.extra["script_model"]
    assert (seen["attention"], seen["attention_source"], seen["attention_dropout"]) == ("eager", "first forward", True)
    assert seen["tied_embeddings"] is False and seen["dtype"] == "float32"
    model = json.loads((out / "run.json").read_text())["workload"]["model"]
    assert (model["attention"], model["attention_dropout"], model["tied_embeddings"]) == ("eager", True, False)
    assert "attention eager (s x s scores kept) (seen in the first forward), with dropout" in printed
    assert "attention eager" in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_two_rank_trial_of_a_script_that_ends_with_destroy_process_group_keeps_its_measurement(tmp_path, capsys):
    """The plain example runs to its end and calls torch.distributed.destroy_process_group(), as PyTorch asks: on
    2 ranks the trial is measured (no barrier on the group the script has destroyed), not a crash in `done`. Three
    steps: one warm-up and two measured, fewer than the measurement's least (3), so the script always ends first (at
    4 the measurement could be `stable` at the script's last step, and was once in CI)."""
    code = main(["trial", "--script", str(EXAMPLES / "train_plain.py"), "--script-args",
                 f"--deepspeed_config {EXAMPLES / 'ds_config.json'} --steps 3 --layers 1 --hidden 32 --seq-len 16 "
                 "--vocab 64", "--gpus", "2", "--zero-stage", "0", "--micro-batch", "4", "--precision", "fp32",
                 "--run-dir", str(tmp_path / "t"), "--json"])
    result = json.loads(capsys.readouterr().out)["result"]
    assert code == 0 and result["status"] == "ok", result.get("error")
    assert result["stop_reason"] == "script_ended" and result["steps_measured"] >= 1
    assert result["ranks"] == 2 and result["step_time_s"] > 0 and result["peak_memory_bytes"] > 0
    for rank in (0, 1):  # each rank's own report: measured, on a world of 2
        report = json.loads((Path(result["log_dir"]) / f"rank{rank}.json").read_text())
        assert (report["status"], report["world_size"], report["stop_reason"]) == ("ok", 2, "script_ended")
