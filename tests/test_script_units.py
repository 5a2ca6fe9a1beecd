"""Script mode, the parts that need no trial: merging the trial's keys into a script's config, reading a
model's shape and the script's global batch, keeping that batch (the space, the shim's config, --global-batch),
narrowing the space, and the command line's refusals."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from autotune.cli import main
from autotune.values.config import Config, ConfigError
from autotune.values.dsconfig import DsOptions, ds_config
from autotune.values.hardware import PROFILES
from autotune.backends.script import Script
from autotune.search.rundir import RunDir, RunSettings
from autotune.script import batch, merge
from autotune.script.inspect_model import checkpoint_switch, model_info, shape_from_info, watch_attention
from autotune.api import own_outputs
from autotune.outputs.report import write_outputs
from autotune.outputs.script import first_config, narrowed, placeholder, save, with_global_batch
from autotune.script.shim import KEEP_SCRIPT_BATCH, Shim, ScriptVerdict
from autotune.worker.protocol import WorkerSpec
from autotune.values.workload import micro_batch_divisors
from autotune.search_spaces import load_choices
from autotune.values.space import Space

USER = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 64,
    "optimizer": {"type": "Lamb", "params": {"lr": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7}},
    "gradient_clipping": 0.3,
    "fp16": {"enabled": True, "loss_scale_window": 77},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": True},
    "wall_clock_breakdown": True,
}


def trial(config: Config) -> dict:
    return ds_config(config, placeholder(16, 1), DsOptions(force_ds_cpu_optimizer=False))


def test_merge_applies_the_memory_keys_and_keeps_the_scripts_other_settings():
    merged = merge.merge(USER, trial(Config(1, 4, 0, "bf16", "cpu")))
    assert (merged["train_batch_size"], merged["train_micro_batch_size_per_gpu"], merged["gradient_accumulation_steps"]) == (16, 4, 4)
    assert merged["bf16"]["enabled"] is True and merged["fp16"]["enabled"] is False
    assert merged["fp16"]["loss_scale_window"] == 77  # the script's own loss scaling stays
    zero = merged["zero_optimization"]
    assert zero["stage"] == 1 and zero["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in zero  # the trial has none: the script's offload goes
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert merged["zero_force_ds_cpu_optimizer"] is False
    for key in ("optimizer", "scheduler", "gradient_clipping", "wall_clock_breakdown"):
        assert merged[key] == USER[key], key
    assert USER["zero_optimization"]["stage"] == 3  # the script's dict is not modified


def test_merge_into_no_config_gives_a_complete_one():
    merged = merge.merge({}, trial(Config(0, 8, 0, "fp32")))
    assert merged["optimizer"]["type"] == "AdamW" and merged["gradient_accumulation_steps"] == 2


def test_load_config_reads_paths_and_dicts_and_names_a_missing_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(USER))
    assert merge.load_config(str(path)) == USER == merge.load_config(USER)
    assert merge.load_config(None) == {}
    with pytest.raises(ConfigError, match="nope.json"):
        merge.load_config(str(tmp_path / "nope.json"))


def test_json_safe_turns_infinities_into_null():
    assert merge.json_safe({"a": float("inf"), "b": [1.5, float("nan")], "c": (1, 2)}) == {"a": None, "b": [1.5, None], "c": [1, 2]}


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, 8, batch_first=True)
        self.mlp = nn.Linear(hidden, hidden)


class PlainLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 64)
        self.blocks = nn.ModuleList(Block(64) for _ in range(3))
        self.extra = nn.ModuleList([nn.Linear(64, 64)])


def test_model_info_of_a_plain_module_tree():
    model = PlainLM()
    info = model_info(model)
    assert info["params"] == sum(p.numel() for p in model.parameters())
    assert (info["layers"], info["hidden"], info["vocab"], info["heads"]) == (3, 64, 500, 8)
    assert info["source"] == "modules" and info["checkpoint_switch"] is None


@pytest.mark.slow  # importing transformers takes seconds
def test_model_info_of_a_hugging_face_model_reads_its_config_and_switch():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=100, n_positions=16))
    info = model_info(model)
    assert (info["layers"], info["hidden"], info["heads"], info["vocab"]) == (3, 32, 4, 100)
    assert info["source"] == "config" and checkpoint_switch(model) in ("activation_checkpointing_enable",
                                                                        "gradient_checkpointing_enable")


class BuggyModel(nn.Module):
    """A user's model whose first forward fails in its own code."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.fail = nn.Linear(4, 4), True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("my model bug")
        return self.proj(x)


def test_a_first_forward_that_raises_surfaces_the_models_own_error():
    """The attention watch's hooks must not replace the model's error ("OrderedDict mutated during iteration":
    an always_call hook removing itself while torch iterates the hooks of a failed forward)."""
    model, info, seen = BuggyModel(), model_info(BuggyModel()), []
    watch_attention(model, info, lambda: seen.append(1))
    later = []  # a forward hook registered after the watch's, as DeepSpeed's engine registers its own
    model.register_forward_hook(lambda *_: later.append(1), always_call=True)
    with pytest.raises(ValueError, match="my model bug") as raised:
        model(torch.randn(2, 4))
    assert raised.value.__context__ is None  # nothing raised while handling it
    assert seen == [1] and not _get_current_function_mode_stack()  # the watch ended, its torch function mode left
    model.fail = False
    model(torch.randn(2, 4))  # a later forward is not watched, and takes the hooks off
    model(torch.randn(2, 4))
    assert seen == [1] and later == [1, 1, 1] and len(model._forward_hooks) == 1 and not model._forward_pre_hooks


def test_shape_from_info_keeps_the_parameter_count():
    model = PlainLM()
    info = {**model_info(model), "seq_len": 32}
    shape = shape_from_info(info, 32, "plain")
    assert (shape.layers, shape.hidden, shape.vocab, shape.seq_len) == (3, 64, 500, 32)
    assert shape.params == pytest.approx(info["params"], rel=0.02)
    unknown = shape_from_info({"params": 10**6}, None, "mlp")  # nothing recognisable: a rough transformer
    assert unknown.params == pytest.approx(10**6, rel=0.05) and unknown.seq_len == 1


def settings(ckpt=(0, 1, 2)) -> RunSettings:
    choices = replace(load_choices("cpu"), ckpt_interval=ckpt)
    return RunSettings(placeholder(16, 1), PROFILES["cpu"], 2**32, "optuna", "script", 0, choices)


def test_a_model_without_a_switch_loses_checkpointing_and_the_note_says_so():
    narrowed_settings, notes = narrowed(settings(), {"class": "PlainLM", "checkpoint_switch": None})
    assert narrowed_settings.choices.ckpt_interval == (0,)
    assert len(notes) == 1 and "PlainLM offers no activation-checkpointing switch" in notes[0]


def test_a_hugging_face_switch_keeps_interval_one_only():
    narrowed_settings, notes = narrowed(settings(), {"class": "GPT2", "checkpoint_switch": "gradient_checkpointing_enable"})
    assert narrowed_settings.choices.ckpt_interval == (0, 1)
    assert "checkpoints every layer" in notes[0] and "[2]" in notes[0]
    assert narrowed(settings((0, 1)), {"class": "GPT2", "checkpoint_switch": "x"})[1] == []


def test_the_first_trial_is_plain_and_small():
    space = Space(load_choices("cpu"), placeholder(16, 1), PROFILES["cpu"])
    config = first_config(space)
    assert (config.ckpt_interval, config.offload_optimizer, config.offload_param) == (0, "none", "none")
    assert config.micro_batch == min(space.choices.micro_batch)


def test_cli_refuses_a_missing_script_and_a_model_with_a_script(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # refused by --script's argparse type
        main(["tune", "--script", str(tmp_path / "missing.py"), "--out", str(tmp_path / "r")])
    assert refused.value.code == 2 and "missing.py': no such file" in capsys.readouterr().err
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["tune", "--script", str(script), "--model", "tiny", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "choose one" in err
    assert main(["tune", "--script", str(script), "--script-args", "'unclosed", "--out", str(tmp_path / "r")]) == 2
    assert "--script-args" in capsys.readouterr().err
    for command in ("tune", "trial"):  # a sequence length the script's own data decide would be ignored
        where = ["--out", str(tmp_path / "r")] if command == "tune" else [
            "--run-dir", str(tmp_path / "r"), "--zero-stage", "0", "--micro-batch", "1", "--precision", "fp32"]
        assert main([command, "--script", str(script), "--seq-len", "512", *where]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "--seq-len 512 with --script" in err and "allowed: --seq-len with --model" in err
    assert not (tmp_path / "r").exists()


# -- the script's global batch (autotune.script.batch): read, kept, split, overridden ---------------------------

def test_global_batch_from_a_deepspeed_config_follows_deepspeeds_rules():
    def of(config: dict, ranks: int = 1):
        found = batch.from_ds_config(config, ranks)
        return None if found is None else (found.global_batch, found.micro_batch, found.accumulation)

    assert of({"train_micro_batch_size_per_gpu": 1}) == (1, 1, 1)  # the issue's script: micro 1, no accumulation
    assert of({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, ranks=2) == (12, 2, 3)
    assert of({"train_batch_size": 32}, ranks=4) == (32, 8, 1)  # alone: no accumulation
    assert of({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, ranks=2) == (32, 4, 4)
    assert of({"train_batch_size": 32, "gradient_accumulation_steps": 2}, ranks=2) == (32, 8, 2)
    assert of({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 64}) == (64, 64, 1)  # USER above
    for unknown in ({}, {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}):
        assert of(unknown) is None, unknown
    # Keys that disagree (DeepSpeed refuses them): train_batch_size wins, split over the ranks without accumulation
    # (tests/test_script_fixes_batch.py holds the note and the refusal).
    assert of({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}) == (10, 10, 1)  # 10 is no multiple of 4
    assert of({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}) == (8, 8, 1)
    assert batch.from_ds_config({"train_micro_batch_size_per_gpu": 1}, 1).source == "DeepSpeed config"


def test_global_batch_from_training_arguments():
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    found = batch.from_training_arguments(args, ranks=2)
    assert (found.global_batch, found.micro_batch, found.accumulation, found.source) == (16, 4, 2, "TrainingArguments")
    assert "16 (micro-batch 4 x gradient accumulation 2 x 2 ranks, from the TrainingArguments)" == found.describe()
    assert batch.from_training_arguments(SimpleNamespace(), ranks=1) is None


def test_micro_batches_are_the_divisors_that_keep_the_global_batch():
    assert micro_batch_divisors(24, 2) == [1, 2, 3, 4, 6, 12] and micro_batch_divisors(3, 2) == []
    assert batch.micro_batches((1, 2, 4, 8), 1, 1) == ((1,), [2, 4, 8])  # a global batch of 1: micro-batch 1 only
    assert batch.micro_batches((1, 2, 4, 8), 24, 1, script_micro=24) == ((1, 2, 4, 8, 24), [])
    assert batch.micro_batches((4, 8), 16, 1, script_micro=16) == ((4, 8, 16), [])
    with pytest.raises(ConfigError, match=r"micro_batch \[4, 8\]: none keeps the global batch 6 .*allowed: \[1, 2, 3, 6\]"):
        batch.micro_batches((4, 8), 6, 1)
    assert batch.trial_keys(16, 2, 2) == {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                          "gradient_accumulation_steps": 4}
    with pytest.raises(ConfigError, match=r"global batch 1 is not a multiple of micro_batch 2 .*keep it: \[1\]"):
        batch.trial_keys(1, 2, 1)


def script_settings(micro=(1, 2, 4, 8)) -> RunSettings:
    choices = replace(load_choices("cpu"), micro_batch=micro)
    return RunSettings(placeholder(None, 1), PROFILES["cpu"], 2**32, "optuna", "script", 0, choices)


ISSUE_BATCH = {"global_batch": 1, "micro_batch": 1, "accumulation": 1, "ranks": 1, "source": "DeepSpeed config"}


def test_the_scripts_global_batch_becomes_the_workloads_and_narrows_the_micro_batches():
    settings, settled, notes = with_global_batch(script_settings(), {"batch": ISSUE_BATCH}, None)
    assert settings.workload.global_batch == 1 and settings.choices.micro_batch == (1,)
    assert not settled.changed and settled.to_dict()["script"] == ISSUE_BATCH
    assert "global batch 1 (micro-batch 1 x gradient accumulation 1 x 1 rank, from the DeepSpeed config): the " \
           "script's own, kept" in notes[0]
    assert "[2, 4, 8] removed from the space" in notes[1]
    space = settings.space()
    assert {c.micro_batch for c in space} == {1} and {c.zero_stage for c in space} == {0, 1, 2, 3}
    assert {c.offload_optimizer for c in space} == {"none", "cpu"}  # still tuned: stage, offload, precision, ...
    # The script's own micro-batch joins the space when it keeps the global batch.
    own = {**ISSUE_BATCH, "global_batch": 48, "micro_batch": 48}
    settings, _, notes = with_global_batch(script_settings(), {"batch": own}, None)
    assert settings.choices.micro_batch == (1, 2, 4, 8, 48) and "the script's own 48 added" in notes[-1]


def test_global_batch_given_overrides_the_scripts_and_says_the_recipe_changed(tmp_path):
    settings, settled, notes = with_global_batch(script_settings(), {"batch": ISSUE_BATCH}, 16)
    assert settings.workload.global_batch == 16 and settings.choices.micro_batch == (1, 2, 4, 8)
    assert settled.changed and settled.to_dict()["given"] == 16
    assert notes[0].startswith("the training recipe changed: global batch from the script's 1 (micro-batch 1")
    assert "to 16 (--global-batch)" in notes[0]
    # The same as the script's, or nothing read from the script: no change to report.
    assert not with_global_batch(script_settings(), {"batch": ISSUE_BATCH}, 1)[1].changed
    settings, settled, notes = with_global_batch(script_settings(), {"batch": None}, None)
    assert settings.workload.global_batch == 16 and "the tuner's default" in notes[0]
    # The report's Script mode section carries the line (and the console gets it from the outputs' notes).
    run_dir = RunDir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    settings, settled, notes = with_global_batch(script_settings(), {"batch": ISSUE_BATCH}, 16)
    save(run_dir, Script(str(script)), None, notes, None, settled)
    outputs = write_outputs(run_dir, settings, own=own_outputs(settings))  # as the runner writes a script's
    assert outputs.notes[0] == notes[0]
    report = (tmp_path / "report.md").read_text()
    assert report.count("## Script mode") == 1
    assert "- the training recipe changed: global batch from the script's 1" in report
    assert json.loads((tmp_path / "script.json").read_text())["global_batch"]["changed"] is True


def test_too_few_steps_counts_micro_steps_at_the_trials_accumulation_and_names_the_scripts_flag():
    # The issue: 30 micro-batches at accumulation 16 made 1 optimizer step; 2 are needed (1 of warm-up).
    text = batch.steps_needed(30, 1, 16, 2, ["--deepspeed", "--deepspeed_config", "c.json", "--steps", "30"])
    assert "30 micro-batches (engine.backward() calls), 1 optimizer step at the trial's gradient accumulation 16" \
        in text
    assert "i.e. 32 micro-batches" in text and text.endswith("pass --steps 32 or more (more give a steadier median)")
    # The Trainer's --max_steps counts optimizer steps.
    assert "pass --max_steps 2 or more" in batch.steps_needed(4, 1, 4, 2, ["--max_steps=1", "--bf16", "true"])
    assert "let the script run that long" in batch.steps_needed(3, 1, 2, 2, ["--epochs", "1"])


def shim_for(tmp_path, micro: int, keep: bool) -> Shim:
    workload = placeholder(None, 1)
    config = Config(0, micro, 0, "bf16")
    spec = WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path), extra={KEEP_SCRIPT_BATCH: keep})
    return Shim(spec, 0)


def test_the_shim_runs_the_scripts_global_batch_at_the_trials_micro_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    user = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    shim = shim_for(tmp_path, 2, keep=True)
    used = shim.trial_config(user, batch.from_ds_config(user, 1))
    assert (used["train_batch_size"], used["train_micro_batch_size_per_gpu"], used["gradient_accumulation_steps"]) == (4, 2, 2)
    assert used["optimizer"] == user["optimizer"]
    # Not kept (the tuner knows the global batch, or --global-batch): the spec's keys, the script's recorded.
    shim = shim_for(tmp_path, 2, keep=False)
    used = shim.trial_config(user, batch.from_ds_config(user, 1))
    assert (used["train_batch_size"], used["gradient_accumulation_steps"]) == (16, 8)
    assert shim.script_batch.global_batch == 4
    # A micro-batch that cannot keep it is the verdict, naming those that can.
    shim = shim_for(tmp_path, 8, keep=True)
    with pytest.raises(ScriptVerdict, match=r"global batch 4 \(micro-batch 1 .*keep it: \[1, 2, 4\]") as verdict:
        shim.trial_config(user, batch.from_ds_config(user, 1))
    assert verdict.value.verdict == "global_batch_indivisible"


def test_the_shim_reads_the_trainers_batch_before_it_sets_the_trials(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")

    class TrainingArguments:  # the fields the shim reads and sets, as transformers.TrainingArguments has them
        def __init__(self, **kwargs) -> None:
            self.__dict__.update(bf16=False, fp16=False, gradient_checkpointing=True, **kwargs)
            self.__post_init__()

        def __post_init__(self) -> None:
            pass

    module = SimpleNamespace(TrainingArguments=TrainingArguments)
    shim = shim_for(tmp_path, 2, keep=True)
    shim.patch_training_arguments(module)
    args = TrainingArguments(deepspeed={"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"},
                             per_device_train_batch_size=4, gradient_accumulation_steps=3)
    assert shim.script_batch.to_dict() == {"global_batch": 24, "micro_batch": 4, "accumulation": 3, "ranks": 2,
                                           "source": "TrainingArguments"}
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 6)  # 2 x 6 x 2 = 24 kept
    assert args.deepspeed["train_batch_size"] == 24


def test_the_shim_switches_the_trainers_checkpointing_off_by_either_name(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")

    class TrainingArguments:  # transformers 5.x: `gradient_checkpointing` is an alias, read when the new name is unset
        def __init__(self, **kwargs) -> None:
            self.__dict__.update({"bf16": False, "fp16": False, "gradient_checkpointing": None,
                                  "activation_checkpointing": None, **kwargs})
            self.__post_init__()

        def __post_init__(self) -> None:
            if self.activation_checkpointing is None and self.gradient_checkpointing is not None:
                self.activation_checkpointing = self.gradient_checkpointing

    shim = shim_for(tmp_path, 2, keep=True)  # ckpt_interval 0
    shim.patch_training_arguments(SimpleNamespace(TrainingArguments=TrainingArguments))
    for given in ("activation_checkpointing", "gradient_checkpointing"):
        args = TrainingArguments(deepspeed={"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"},
                                 per_device_train_batch_size=4, gradient_accumulation_steps=1, **{given: True})
        assert args.activation_checkpointing is False and args.gradient_checkpointing is False, given


def test_a_spare_imports_only_the_known_frameworks_and_a_patch_applies_to_one_imported_already(monkeypatch):
    import sys

    from autotune.script.shim import after_import, import_frameworks

    monkeypatch.setitem(sys.modules, "transformers.trainer", None)  # None: `import` raises ImportError
    monkeypatch.delitem(sys.modules, "calendar", raising=False)
    assert import_frameworks("transformers.trainer,calendar,") >= 0  # a failure is left to the script's own import
    assert "calendar" not in sys.modules  # not a training framework: never imported ahead
    seen = []
    after_import("json", seen.append)  # imported already: patched now, not at an import that will not come
    assert seen == [json]
    after_import("autotune_not_imported_yet", seen.append)
    try:
        assert seen == [json] and type(sys.meta_path[0]).__name__ == "_AfterImport"
    finally:
        sys.meta_path.pop(0)


@pytest.mark.parametrize("set_before", [False, True])
def test_frameworks_are_named_for_spares_only_where_the_script_set_no_environment_before_importing_them(
        set_before, monkeypatch):
    import importlib.util
    import sys

    from autotune.script.shim import _EnvBeforeImport

    watch = _EnvBeforeImport(("autotune_fake_framework",))
    sys.meta_path.insert(0, watch)
    try:
        if set_before:  # as a script's `os.environ["HF_HUB_OFFLINE"] = "1"` above `import transformers`
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert importlib.util.find_spec("json") is not None and watch.changed is None  # another package: not yet
        assert importlib.util.find_spec("autotune_fake_framework") is None  # the import goes on (and fails) as ever
        assert watch.changed is set_before and watch not in sys.meta_path
    finally:
        if watch in sys.meta_path:
            sys.meta_path.remove(watch)


# -- launch.sh's command: the script's own, with the recommendation in it --------------------------------------

def test_the_launch_command_names_the_recommendation_where_the_script_took_its_config(tmp_path):
    from autotune.outputs.script import with_recommendation
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 16}))
    other = tmp_path / "data.json"
    other.write_text(json.dumps({"rows": 3}))
    best = "/run/best_ds_config.json"
    script = {"path": "/w/train.py", "args": ["--cfg", str(config), "--config_name", str(other), "--batch-size", "16"]}
    assert with_recommendation(script, best, ["--batch-size", "4"], add=False) == (  # a model's config is no DS config
        "/w/train.py", "--cfg", best, "--config_name", str(other), "--batch-size", "4")
    # A path that no longer resolves (report regenerated elsewhere) is known by its flag; `--flag=value` forms too.
    script = {"path": "t.py", "args": ["--deepspeed=gone/ds.json", "--per_device_train_batch_size=8"]}
    assert with_recommendation(script, best, ["--per_device_train_batch_size", "2", "--bf16", "true"], add=False) == (
        "t.py", f"--deepspeed={best}", "--per_device_train_batch_size=2")
    # A Trainer script that parses TrainingArguments from its command line gets the flags it was not given.
    script = {"path": "hf.py", "args": ["--deepspeed", "gone.json", "--output_dir", "o"]}
    assert with_recommendation(script, best, ["--per_device_train_batch_size", "2", "--bf16", "true"], add=True) == (
        "hf.py", "--deepspeed", best, "--output_dir", "o", "--per_device_train_batch_size", "2", "--bf16", "true")
