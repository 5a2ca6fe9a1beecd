"""The handoff (autotune/outputs/handoff.py): the files `autotune tune` writes train a tiny model as written through
deepspeed.initialize, the Hugging Face Trainer, Accelerate's DeepSpeedPlugin with DummyOptim, and `accelerate
launch --config_file` (slow: real DeepSpeed on the CPU accelerator, gloo, one process each, tests/handoff_train.py);
and a stack that cannot apply a knob is not offered it (--stack)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import yaml

from autotune.api import TuneSpec, resolution, tune
from autotune.cli import main
from autotune.values.config import Config, ConfigError
from autotune.values.dsconfig import RECIPE_AUTO, hf_ds_config
from autotune.outputs.handoff import (ACCELERATE_CONFIG, DS_CONFIG, HF_DS_CONFIG, TRAINER_ARGS, Handoff,
                                      checkpointing_key, narrow_choices)
from autotune.values.hardware import PROFILES
from autotune.search.rundir import RunSettings
from autotune.outputs.launch import LAUNCH_FILE, ORIGIN_FILE, Origin
from autotune.trials.runner import (LOOPBACK_IFNAME, MASTER_ADDR, LaunchOptions, extensions_dir, free_port,
                                    remove_shm_buffers, trial_environment)
from autotune.search_spaces import load_choices
from autotune.values.space import Choices
from autotune.values.workload import make_workload

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "handoff_train.py"
# No offload (it would build DeepSpeed's CPU Adam, minutes). Checkpointing every layer or every 2: the Trainer
# stack keeps 1 only, so the recommendation has gradient checkpointing on.
SPACE = """\
zero_stage: [1, 2]
micro_batch: [4, 8]
ckpt_interval: [1, 2]
precision: [bf16]
offload_optimizer: [none]
offload_param: [none]
"""


def settings(stack: str = "deepspeed", space: str = "cpu") -> RunSettings:
    return RunSettings(make_workload("tiny"), PROFILES["cpu"], 2**34, "optuna", "simulated", 0, load_choices(space),
                       stack=stack)


# ---- the space narrowed to the stack ----

def test_trainer_and_accelerate_keep_only_the_on_off_checkpointing_intervals():
    choices = load_choices("default")
    assert choices.ckpt_interval == (0, 1, 2, 4, 8)
    assert narrow_choices(choices, "deepspeed") == (choices, None)
    for stack in ("trainer", "accelerate"):
        narrowed, note = narrow_choices(choices, stack)
        assert narrowed.ckpt_interval == (0, 1)
        assert dataclasses.replace(narrowed, ckpt_interval=choices.ckpt_interval) == choices  # nothing else changed
        assert note is not None and f"--stack {stack}" in note and "[2, 4, 8] removed" in note
    assert narrow_choices(Choices(ckpt_interval=(0, 1)), "trainer") == (Choices(ckpt_interval=(0, 1)), None)
    with pytest.raises(ConfigError, match=r"ckpt_interval \[2, 4\] holds no value .* allowed 0 \(off\) and 1"):
        narrow_choices(Choices(ckpt_interval=(2, 4)), "accelerate")
    with pytest.raises(ConfigError, match="stack 'keras': allowed deepspeed, trainer, accelerate"):
        narrow_choices(choices, "keras")


def test_the_door_narrows_settings_and_space_to_the_stack_together():
    resolved = resolution(TuneSpec(make_workload("tiny"), PROFILES["cpu"], space="default", stack="trainer"))
    narrowed, space = resolved.settings, resolved.space
    assert narrowed.stack == "trainer" and space.choices == narrowed.choices and narrowed.choices.ckpt_interval == (0, 1)
    assert {c.ckpt_interval for c in space} == {0, 1} and any("--stack trainer" in n for n in resolved.notes)
    assert RunSettings.from_dict(json.loads(json.dumps(narrowed.to_dict()))) == narrowed  # run.json keeps the stack


def test_run_json_without_a_stack_is_deepspeed_and_a_bad_one_is_refused():
    data = settings().to_dict()
    del data["stack"]  # a run directory from before --stack
    assert RunSettings.from_dict(data).stack == "deepspeed"
    with pytest.raises(ConfigError, match="stack: 'jax': allowed deepspeed, trainer, accelerate"):
        RunSettings.from_dict({**data, "stack": "jax"})


def test_tune_spec_stack():
    spec = TuneSpec(make_workload("tiny"), PROFILES["cpu"], space="default", stack="accelerate")
    assert spec.settings().stack == "accelerate" and spec.settings().choices.ckpt_interval == (0, 1)
    with pytest.raises(ConfigError, match="stack 'tf'"):
        TuneSpec(make_workload("tiny"), PROFILES["cpu"], stack="tf")


def test_cli_stack_says_what_it_removed_and_resume_keeps_it(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["tune", "--backend", "simulated", "--strategy", "random", "--trials", "2", "--space", "default",
            "--out", str(out)]
    assert main([*argv, "--stack", "trainer"]) == 0
    printed = capsys.readouterr().out
    assert "--stack trainer: ckpt_interval [2, 4, 8] removed from the space" in printed
    assert f"recommended config: {out / DS_CONFIG}" in printed and "--gradient_accumulation_steps" in printed
    run = json.loads((out / "run.json").read_text())
    assert run["stack"] == "trainer" and run["space"]["ckpt_interval"] == [0, 1]
    assert "- Stack: trainer: the space held only what the Hugging Face Trainer can apply" in (out / "report.md").read_text()
    assert main([*argv, "--stack", "trainer", "--trials", "3", "--resume"]) == 0
    capsys.readouterr()
    assert main([*argv, "--trials", "4", "--resume"]) == 2  # another stack is another sweep
    assert "was started with other settings" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        main([*argv, "--stack", "pytorch-lightning"])
    assert refused.value.code == 2 and "invalid choice: 'pytorch-lightning'" in capsys.readouterr().err


# ---- what the files hold, checked with the Trainer's and Accelerate's own config code (no engine) ----

def hf_config(config: Config) -> dict:
    return hf_ds_config(config, make_workload("tiny"))


def test_the_trainer_accepts_the_hf_config_with_the_recommended_arguments_and_keeps_the_tuned_values(tmp_path):
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = Config(3, 4, 1, "bf16")
    handoff = Handoff(config, make_workload("tiny"), PROFILES["cpu"], "trainer", tmp_path)
    recommended = handoff.trainer_args()
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.init}
    assert set(recommended) <= set(defaults)  # every key is a TrainingArguments field
    args = SimpleNamespace(**{**defaults, **recommended, "world_size": 1}, get_warmup_steps=lambda steps: 0)
    hf = HfTrainerDeepSpeedConfig(hf_config(config))
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=256)), 100)  # raises on a mismatch
    filled = hf.config
    assert filled["zero_optimization"]["reduce_bucket_size"] == hf_config(config)["zero_optimization"]["reduce_bucket_size"]
    assert filled["zero_optimization"]["reduce_bucket_size"] != 256 * 256  # the tuned size, not the Trainer's hidden^2
    assert filled["optimizer"]["params"]["lr"] == defaults["learning_rate"] and filled["gradient_clipping"] == 1.0
    # The default arguments are refused, as the Trainer refuses them: hence recommended_trainer_args.json.
    plain = HfTrainerDeepSpeedConfig(hf_config(config))
    plain.trainer_config_process(SimpleNamespace(**{**defaults, "world_size": 1}, get_warmup_steps=lambda steps: 0))
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        plain.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=256)), 100)


def test_accelerate_dummy_optim_fills_every_auto_of_the_hf_config():
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=hf_config(Config(2, 8, 0, "bf16")))
    # What Accelerator.prepare fills for DummyOptim (lr, weight_decay) and itself (clipping); nothing else is auto.
    plugin.deepspeed_config_process(must_match=False, **{"optimizer.params.lr": 3e-4,
                                                         "optimizer.params.weight_decay": 0.01, "gradient_clipping": 1.0})
    assert plugin.deepspeed_config["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                              "weight_decay": 0.01}
    assert len(RECIPE_AUTO) == 3
    # The old flavour (betas and eps "auto") fails as users saw it.
    old = hf_config(Config(2, 8, 0, "bf16"))
    old["optimizer"]["params"]["betas"] = "auto"
    with pytest.raises(ValueError, match="optimizer.params.betas` not found in kwargs"):
        DeepSpeedPlugin(hf_ds_config=old).deepspeed_config_process(
            must_match=False, **{"optimizer.params.lr": 3e-4, "optimizer.params.weight_decay": 0.0})


def test_accelerate_config_names_the_hf_config_and_nothing_accelerate_refuses_beside_it(tmp_path):
    handoff = Handoff(Config(3, 4, 0, "bf16"), make_workload("tiny", 32, 2), PROFILES["cpu"], "accelerate", tmp_path)
    written = yaml.safe_load(handoff.accelerate_yaml())
    assert written["distributed_type"] == "DEEPSPEED" and written["num_processes"] == 2
    assert written["deepspeed_config"] == {"deepspeed_config_file": str(tmp_path / HF_DS_CONFIG), "zero3_init_flag": True}
    assert "mixed_precision" not in written  # accelerate refuses it beside a deepspeed_config_file


def test_report_section_explains_an_interval_the_trainer_cannot_apply(tmp_path):
    workload = make_workload("gpt2-small", 64)
    handoff = Handoff(Config(2, 8, 4, "bf16"), workload, PROFILES["a100-80gb"], "deepspeed", tmp_path)
    text = "\n".join(handoff.markdown())
    assert "## Using the recommendation" in text and "Activation checkpointing: segments of 4 layers (3 segments" in text
    assert "checkpoint(run_segment, x, self.layers[start:start + k], use_reentrant=False)" in text and "k = 4" in text
    assert "Note: ckpt_interval 4 is applied in the model's code" in text
    assert str(tmp_path) not in text  # relative paths: a copied run directory regenerates the same report
    assert "--per_device_train_batch_size 8 --gradient_accumulation_steps 8 --bf16 true" in text
    assert "use_cpu" not in handoff.trainer_args()
    assert any("--stack trainer" in line for line in handoff.console_lines())
    off = Handoff(Config(2, 8, 0, "bf16"), workload, PROFILES["a100-80gb"], "trainer", tmp_path)
    assert "Activation checkpointing: off." in off.markdown() and off.ckpt_mismatch() is None


# ---- the files train a tiny model, as written ----

@pytest.fixture(scope="module")
def recommended(tmp_path_factory) -> tuple[Path, Config]:
    """One simulated sweep with --stack trainer; its outputs serve every training test below."""
    base = tmp_path_factory.mktemp("handoff")
    (base / "space.yaml").write_text(SPACE)
    out = base / "run"
    assert main(["tune", "--backend", "simulated", "--strategy", "optuna", "--trials", "3", "--space",
                 str(base / "space.yaml"), "--stack", "trainer", "--out", str(out)]) == 0
    best = Config.from_dict(json.loads((out / "summary.json").read_text())["best"]["config"])
    assert best.ckpt_interval == 1  # [1, 2] narrowed to [1]
    return out, best


def train(mode: str, run: Path, monkeypatch, *extra: str, launched: bool = False) -> dict:
    """tests/handoff_train.py in a fresh process (its own process group, Accelerate state and DeepSpeed engine)."""
    port = free_port()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", extensions_dir(sys.executable))  # ops built once per environment
    # The venv's ninja, as the runner's trials use: the system's reads its build log as stale and rebuilds the ops.
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
    if launched:
        command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(run / ACCELERATE_CONFIG),
                   "--main_process_port", str(port), str(SCRIPT), mode, str(run), *extra]
    else:
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": MASTER_ADDR,
                           "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(key, value)
        command = [sys.executable, str(SCRIPT), mode, str(run), *extra]
    try:
        done = subprocess.run(command, cwd=run.parent, capture_output=True, text=True, timeout=600)
    finally:
        remove_shm_buffers(MASTER_ADDR, port)
    lines = [line for line in done.stdout.splitlines() if line.startswith("HANDOFF ")]
    assert done.returncode == 0 and lines, (done.stdout[-2000:], done.stderr[-4000:])
    return json.loads(lines[-1].removeprefix("HANDOFF "))


def check_tuned(ran: dict, run: Path, best: Config) -> None:
    ds = json.loads((run / DS_CONFIG).read_text())
    assert ran["micro_batch"] == best.micro_batch and ran["accumulation"] == ds["gradient_accumulation_steps"] > 1
    assert ran["train_batch_size"] == 16 and ran["zero_stage"] == best.zero_stage
    assert ran["bf16"] is True and ran["fp16"] is False
    assert ran["reduce_bucket_size"] == ds["zero_optimization"]["reduce_bucket_size"]  # the tuned size
    assert ran["optimizer_steps"] == 2 and ran["checkpointing"] is True
    assert ran["losses"] and all(math.isfinite(loss) for loss in ran["losses"])


@pytest.mark.slow
def test_recommended_trainer_args_and_hf_config_train_with_the_trainer(recommended, monkeypatch, tmp_path):
    run, best = recommended
    assert json.loads((run / TRAINER_ARGS).read_text())["deepspeed"] == str(run.resolve() / HF_DS_CONFIG)
    ran = train("trainer", run, monkeypatch, str(tmp_path / "out"))
    check_tuned(ran, run, best)
    # The recipe's "auto" values came from TrainingArguments' defaults.
    assert ran["optimizer"]["params"] == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert ran["gradient_clipping"] == 1.0 and len(ran["losses"]) == 2


@pytest.mark.slow
def test_hf_config_trains_with_an_accelerate_plugin_and_dummy_optim(recommended, monkeypatch):
    run, best = recommended
    ran = train("plugin", run, monkeypatch)
    check_tuned(ran, run, best)
    assert ran["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert ran["mixed_precision"] == "bf16" and ran["gradient_clipping"] == 1.0


@pytest.mark.slow
def test_accelerate_launch_with_the_recommended_config_file(recommended, monkeypatch):
    run, best = recommended
    ran = train("launched", run, monkeypatch, launched=True)
    check_tuned(ran, run, best)
    assert ran["processes"] == 1 and ran["optimizer"]["params"]["lr"] == 3e-4


# ---- launch.sh: the launch command with the trials' environment (autotune/outputs/launch.py) ----

@pytest.fixture
def key_cache():
    """checkpointing_key caches the installed transformers' answer: a test that mocks it starts and ends clean."""
    checkpointing_key.cache_clear()
    yield
    checkpointing_key.cache_clear()


def write_launch(tmp_path: Path, handoff: Handoff) -> tuple[str, Path]:
    path = tmp_path / LAUNCH_FILE
    path.write_text(handoff.launch().script())
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)  # the shell parses it
    assert checked.returncode == 0, checked.stderr
    return path.read_text(), path


def test_launch_file_has_both_forms_and_the_environment_the_trials_got(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")  # autotune.trials.ops rewrites it for DeepSpeed's op builder
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))  # the ops folder: none built yet
    handoff = Handoff(Config(2, 4, 0, "bf16"), make_workload("tiny", 16, 2), PROFILES["cpu"], "deepspeed", tmp_path)
    # No op built there (a simulated sweep's): nothing is promised reused (a reviewer's said "no rebuild")
    assert "none built here yet" in "\n".join(handoff.console_lines()) and "no rebuild" not in handoff.launch().script()
    assert "no trial of this sweep built one here" in "\n".join(handoff.markdown())
    (Path(extensions_dir(sys.executable)) / "fused_adam").mkdir(parents=True)  # as a trial builds it
    text, path = write_launch(tmp_path, handoff)
    assert "torchrun) exec torchrun --nnodes 1 --nproc_per_node 2 \"$@\"" in text
    assert "deepspeed) exec deepspeed --num_gpus 2 \"$@\"" in text and "accelerate" not in text
    trials = trial_environment(LaunchOptions(ranks=2), "cpu")  # what the runner gives a trial's ranks
    extensions = extensions_dir(sys.executable)
    assert trials["TORCH_EXTENSIONS_DIR"] == extensions
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    for line in (f"export TORCH_EXTENSIONS_DIR={extensions}", "export DS_ACCELERATOR=cpu",
                 f"export OMP_NUM_THREADS={threads}", "export TORCH_CUDA_ARCH_LIST=9.0",
                 "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                 f'export PATH={Path(sys.executable).parent}:"$PATH"'):
        assert line in text.splitlines(), line
    assert handoff.launch().env() == {k: trials[k] if k != "OMP_NUM_THREADS" else threads for k in handoff.launch().env()}
    assert "mpi4py" in text and "GLOO_SOCKET_IFNAME" not in text  # a trial's loopback rendezvous stays the trial's
    # Shown where the user reads: the console's lines and the report's section, which name the extension dir.
    console = "\n".join(handoff.console_lines())
    assert f"launch: bash {path} torchrun train.py (or deepspeed): 2 processes" in console
    assert f"TORCH_EXTENSIONS_DIR={extensions} (DeepSpeed's ops as the tuner built them: your run reuses them" in console
    report = "\n".join(handoff.markdown())
    assert "### Launching" in report and "bash launch.sh torchrun train.py" in report
    assert "torchrun --nnodes 1 --nproc_per_node 2 train.py" in report and "deepspeed --num_gpus 2 train.py" in report
    assert f"`TORCH_EXTENSIONS_DIR={extensions}` is where the tuner built DeepSpeed's C++ ops" in report
    assert str(tmp_path) not in report
    done = subprocess.run(["bash", str(path), "mpirun", "train.py"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage: bash" in done.stderr and "torchrun|deepspeed" in done.stderr


def test_a_report_written_elsewhere_keeps_the_trials_environment(tmp_path, monkeypatch, capsys):
    # `autotune report` from another Python environment wrote its own PATH and an ops folder never built, while
    # report.md said the tuner built the ops there: the session that ran the trials records where (origin.json).
    out = tmp_path / "run"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (Path(extensions_dir(sys.executable)) / "cpu_adam").mkdir(parents=True)  # as the trials built it
    assert main(["tune", "--model", "tiny", "--backend", "simulated", "--trials", "2", "--space", "cpu",
                 "--out", str(out), "--quiet"]) == 0
    origin = Origin.read(out / ORIGIN_FILE)
    assert origin == Origin.here() and origin.python == sys.executable
    written = (out / LAUNCH_FILE).read_text()
    other = tmp_path / "other-venv" / "bin" / "python"
    monkeypatch.setattr(sys, "executable", str(other))
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("PATH", f"{other.parent}{os.pathsep}{os.environ['PATH']}")
    assert main(["report", str(out), "--quiet"]) == 0
    assert (out / LAUNCH_FILE).read_text() == written
    assert f"`TORCH_EXTENSIONS_DIR={extensions_dir(origin.python)}` is where the tuner built" in (out / "report.md").read_text()
    (out / ORIGIN_FILE).unlink()  # a run directory from before the record: this environment's, as before
    assert main(["report", str(out), "--quiet"]) == 0
    assert "export OMP_NUM_THREADS=7" in (out / LAUNCH_FILE).read_text().splitlines()
    capsys.readouterr()


def test_launch_file_of_a_gpu_job_over_several_machines(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's own setting wins, as in a trial
    handoff = Handoff(Config(3, 2, 0, "bf16"), make_workload("gpt2-small", 64, 16), PROFILES["a100-80gb"], "deepspeed",
                      tmp_path)
    text, _ = write_launch(tmp_path, handoff)
    assert "export DS_ACCELERATOR=cuda" in text and "export OMP_NUM_THREADS=3" in text
    assert "exec torchrun --nnodes 2 --nproc_per_node 8 --node_rank \"${NODE_RANK:?" in text
    assert "exec deepspeed --num_nodes 2 --num_gpus 8 --hostfile \"${HOSTFILE:?" in text and "on 2 machines of 8" in text
    # DeepSpeed's launcher forwards to the other machines only a few prefixes and a .deepspeed_env's lines: the
    # settings go into the file DS_ENV_FILE names, after the user's own lines. Run with a stand-in `deepspeed`.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "deepspeed").write_text('#!/bin/sh\necho "$*"; cat "$DS_ENV_FILE"\n')
    (fake / "deepspeed").chmod(0o755)
    path = tmp_path / "launch-here.sh"
    path.write_text("\n".join(f'export PATH={fake}:"$PATH"' if line.startswith("export PATH=") else line
                              for line in text.splitlines()) + "\n")
    (tmp_path / ".deepspeed_env").write_text("MY_SETTING=1")  # no final newline: still a line of its own
    ran = subprocess.run(["bash", str(path), "deepspeed", "train.py", "--epochs", "1"], cwd=tmp_path, text=True,
                         capture_output=True, env={**os.environ, "HOME": str(tmp_path / "home"), "HOSTFILE": "hosts"})
    assert ran.returncode == 0, ran.stderr
    args, *forwarded = ran.stdout.splitlines()
    assert args == "--num_nodes 2 --num_gpus 8 --hostfile hosts train.py --epochs 1"
    assert forwarded[0] == "MY_SETTING=1" and "DS_ACCELERATOR=cuda" in forwarded and "OMP_NUM_THREADS=3" in forwarded


def test_launch_file_of_a_cpu_job_keeps_every_rank_on_this_machine(tmp_path):
    # The CPU trials ran all 4 ranks here (the profile's 2 "devices" a node are for the estimate's collectives):
    # a launch over 2 machines would ask for a NODE_RANK the user never needed.
    handoff = Handoff(Config(2, 2, 0, "fp32"), make_workload("tiny", 16, 4), PROFILES["cpu"], "accelerate", tmp_path)
    text, _ = write_launch(tmp_path, handoff)
    assert "torchrun) exec torchrun --nnodes 1 --nproc_per_node 4 \"$@\"" in text and "NODE_RANK" not in text
    assert handoff.accelerate_config()["num_machines"] == 1 and handoff.accelerate_config()["num_processes"] == 4


def test_launch_file_has_each_stacks_form(tmp_path, key_cache):
    accelerate = Handoff(Config(2, 4, 1, "bf16"), make_workload("tiny", 16, 2), PROFILES["cpu"], "accelerate", tmp_path)
    text, _ = write_launch(tmp_path, accelerate)
    assert f"accelerate) exec accelerate launch --config_file {tmp_path / ACCELERATE_CONFIG} \"$@\" ;;" in text
    assert "torchrun) exec torchrun --nnodes 1 --nproc_per_node 2" in text  # with DeepSpeedPlugin in the script
    assert accelerate.launch().usage()[0] == "accelerate train.py"
    trainer = Handoff(Config(2, 4, 1, "bf16"), make_workload("tiny", 16, 2), PROFILES["cpu"], "trainer", tmp_path)
    text, _ = write_launch(tmp_path, trainer)
    flags = shlex.join(trainer.trainer_flags())
    assert f"#   bash launch.sh torchrun train.py {flags}" in text and f"--deepspeed {tmp_path / HF_DS_CONFIG}" in flags
    assert "accelerate" not in text
    assert any(line.startswith("torchrun --nnodes 1 --nproc_per_node 2 train.py --per_device_train_batch_size 4")
               for line in trainer.launch().commands())


def test_cli_writes_the_launch_file_for_the_target_gpus(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("autotune.trials.devices.nvidia_driver_present", lambda: False)  # an A100 tuned on a CPU
    out = tmp_path / "run"
    assert main(["tune", "--model", "gpt2-small", "--hardware", "a100-80gb", "--backend", "simulated", "--strategy",
                 "random", "--trials", "3", "--gpus", "2", "--target-gpus", "4", "--global-batch", "64",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    text = (out / LAUNCH_FILE).read_text()
    assert "exec torchrun --nnodes 1 --nproc_per_node 4" in text and "exec deepspeed --num_gpus 4" in text
    # No trial ran, and not on an A100: a template for the target, nothing of this machine (issue 43)
    assert "# ds-autotune: TEMPLATE for " in text and "export TORCH_EXTENSIONS_DIR=" not in text
    assert f"launch: bash {out / LAUNCH_FILE} torchrun train.py" in printed and "4 processes" in printed
    report = (out / "report.md").read_text()
    assert "torchrun --nnodes 1 --nproc_per_node 4 train.py" in report
    # The verdict is the 4 devices' prediction: the latency beside it says it is the 2 trials' devices' measurement
    assert "- The best measured on the trials' 2 devices, " in report and "Its other measures" not in report


def fake_transformers(monkeypatch, *fields: str) -> None:
    module = ModuleType("transformers")
    module.TrainingArguments = dataclasses.make_dataclass("TrainingArguments", [(f, bool, False) for f in fields])
    monkeypatch.setitem(sys.modules, "transformers", module)


def test_trainer_args_follow_the_installed_transformers(tmp_path, monkeypatch, key_cache):
    handoff = Handoff(Config(2, 4, 1, "bf16"), make_workload("tiny"), PROFILES["cpu"], "trainer", tmp_path)
    fake_transformers(monkeypatch, "activation_checkpointing", "gradient_checkpointing")  # 5.x: the old name an alias
    assert handoff.trainer_args()["activation_checkpointing"] is True and "gradient_checkpointing" not in handoff.trainer_args()
    assert "--activation_checkpointing true" in shlex.join(handoff.trainer_flags())
    checkpointing_key.cache_clear()
    fake_transformers(monkeypatch, "gradient_checkpointing")  # an older version
    assert handoff.trainer_args()["gradient_checkpointing"] is True and "activation_checkpointing" not in handoff.trainer_args()
    checkpointing_key.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed: the key every version so far accepts
    assert checkpointing_key() == "gradient_checkpointing"


@pytest.mark.slow
def test_the_written_torchrun_form_trains_and_reuses_the_tuners_op_build(recommended, tmp_path):
    """`bash launch.sh torchrun ...` from an environment with none of the trials' settings (no venv on PATH, no
    TORCH_EXTENSIONS_DIR): the file supplies them, DeepSpeed loads the ops the tuner built, rebuilds none. The
    script's deepspeed mode: best_ds_config.json as written, through deepspeed.initialize (the optimizer and
    the tuned batch, stage, precision, bucket size and checkpointing it ran with)."""
    run, best = recommended
    extensions = Path(extensions_dir(sys.executable))
    built = {p: p.stat().st_mtime_ns for p in extensions.rglob("*.so")}
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "MASTER_ADDR", "MASTER_PORT", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != str(Path(sys.executable).parent))
    env.update(GLOO_SOCKET_IFNAME=LOOPBACK_IFNAME, PET_MASTER_PORT=str(port))  # torchrun's --master_port, unclashed
    try:
        done = subprocess.run(["bash", str(run / LAUNCH_FILE), "torchrun", str(SCRIPT), "deepspeed", str(run)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        remove_shm_buffers(MASTER_ADDR, port)
    lines = [line for line in done.stdout.splitlines() if line.startswith("HANDOFF ")]
    assert done.returncode == 0 and lines, (done.stdout[-2000:], done.stderr[-4000:])
    ran = json.loads(lines[-1].removeprefix("HANDOFF "))
    check_tuned(ran, run, best)
    assert ran["optimizer"]["params"]["lr"] == 1e-4 and len(ran["losses"]) == 2 * ran["accumulation"]
    after = {p: p.stat().st_mtime_ns for p in extensions.rglob("*.so")}
    assert after and all(after[p] == mtime for p, mtime in built.items())  # loaded from the tuner's dir, none rebuilt
    assert "Building extension module" not in done.stderr + done.stdout


def test_checking_a_config_with_deepspeeds_parser_prints_nothing(tmp_path):
    """`autotune.tune()` prints nothing: DeepSpeed's import, in the tuner's own process to check the recommended
    config, logged "Setting accelerator to CPU. If you have GPU ..." on stdout where no GPU is seen (a reviewer's
    notebook run); its other warnings stay. Nor does that import change os.environ (lightning_fabric, which it
    pulls in, sets PYTORCH_NVML_BASED_CUDA_CHECK=1)."""
    code = ("import logging, os\nfrom autotune.outputs.handoff import validate\nbefore = dict(os.environ)\n"
            "validate({'train_batch_size': 4, 'train_micro_batch_size_per_gpu': 4})\n"
            "print('ENVIRON CHANGED', sorted(k for k in before.keys() | os.environ.keys() "
            "if before.get(k) != os.environ.get(k)))\n"
            "logging.getLogger('DeepSpeed').warning('still said')\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    ran = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    said = ran.stdout + ran.stderr
    assert "Setting accelerator" not in said and "still said" in said, said
    assert "ENVIRON CHANGED []" in ran.stdout, said


class StandIn(importlib.abc.MetaPathFinder):
    """Imports module `name` from the file `path` instead of where it lives."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_file_location(fullname, self.path) if fullname == self.name else None


def test_a_simulated_tune_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    """tune() checks its recommendation with DeepSpeed's config parser, imported in this process: os.environ stays as
    it was across that import (ARCHITECTURE.md). The parser imported is a stand-in whose import adds one variable and
    changes another, as lightning_fabric's sets PYTORCH_NVML_BASED_CUDA_CHECK (the real one is imported once per
    process); monkeypatch puts the modules and variables back after the test."""
    kept = dict(os.environ)
    real = importlib.import_module("deepspeed.runtime.config")  # the parent packages, as tune() finds them
    for key in set(os.environ) - set(kept):  # what a first import here changed, undone: not this test's subject
        del os.environ[key]
    os.environ.update(kept)
    stand_in = tmp_path / "config.py"
    stand_in.write_text("import os\nos.environ['AUTOTUNE_TEST_ADDED'] = '1'\nos.environ['AUTOTUNE_TEST_KEPT'] = 'after'\n"
                        "class DeepSpeedConfig:\n    def __init__(self, config):\n        self.config = config\n")
    monkeypatch.setattr(sys.modules["deepspeed.runtime"], "config", real)
    monkeypatch.delitem(sys.modules, "deepspeed.runtime.config")  # so that the next import runs the stand-in
    monkeypatch.setattr(sys, "meta_path", [StandIn("deepspeed.runtime.config", stand_in), *sys.meta_path])
    monkeypatch.setenv("AUTOTUNE_TEST_KEPT", "before")
    monkeypatch.setenv("AUTOTUNE_TEST_ADDED", "x")
    monkeypatch.delenv("AUTOTUNE_TEST_ADDED")  # absent now, and removed after the test whatever the tune did
    before = dict(os.environ)
    spec = TuneSpec(make_workload("tiny"), PROFILES["cpu"], memory_budget_bytes=2**30, strategy="random", trials=1,
                    backend="simulated", seed=0)
    tune(spec, out=tmp_path / "run")
    assert sys.modules["deepspeed.runtime.config"].__file__ == str(stand_in)  # the stand-in was imported
    assert dict(os.environ) == before
