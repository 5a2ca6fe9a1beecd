"""Script mode, the parts that need no trial: merging the trial's keys into a script's config, reading a
model's shape, narrowing the space, and the command line's refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from torch import nn

from autotune.cli import main
from autotune.config import Config, ConfigError
from autotune.dsconfig import DsOptions, ds_config
from autotune.hardware import PROFILES
from autotune.rundir import RunSettings
from autotune.script import merge
from autotune.script.inspect_model import checkpoint_switch, model_info, shape_from_info
from autotune.script.session import first_config, narrowed, placeholder
from autotune.search_spaces import load_choices
from autotune.space import Space

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
    assert not (tmp_path / "r").exists()
