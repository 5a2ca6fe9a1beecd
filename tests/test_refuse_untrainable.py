"""A model the built-in trial model does not build (a mixture of experts, multi-head latent attention) is refused
up front for real trials, `autotune tune` and sweep files alike: one line naming the model and what is allowed,
exit 2, nothing written or launched (autotune.values.shapes.untrained_reason, the worker's own decision). And sweep
files name a bad default as `defaults.<key>` and take a written-out search space."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.api import TuneSpec
from autotune.cli import main
from autotune.commands.sweep_file import load_sweep
from autotune.values.config import ConfigError
from autotune.values.models import load_model
from autotune.values.shapes import PRESETS, untrained_reason
from autotune.values.workload import Workload, make_workload

HF_CONFIGS = Path(__file__).resolve().parent / "hf_configs"

# The user's report: Mixtral-8x7B's config.json.
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 8,
           "num_experts_per_tok": 2, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False}
# Multi-head latent attention without experts, as a shape file.
DENSE_MLA = ("name: dense-mla\nlayers: 2\nhidden: 64\nheads: 2\nvocab: 64\nseq_len: 32\narch: llama\nhead_dim: 32\n"
             "rope_head_dim: 16\nkv_lora_rank: 16\nv_head_dim: 16\nffn_hidden: 32\n")


@pytest.fixture
def mixtral(tmp_path: Path) -> Path:
    folder = tmp_path / "hf" / "mix"
    folder.mkdir(parents=True)
    path = folder / "config.json"
    path.write_text(json.dumps(MIXTRAL))
    return path


def one_line(err: str) -> str:
    assert err.count("\n") == 1, err
    return err


# -- the one decision ------------------------------------------------------------------------------------

def test_what_the_built_in_model_does_not_build_is_named():
    moe = load_model(str(HF_CONFIGS / "qwen1.5-moe-a2.7b.json"))
    assert "a mixture of experts (60 experts, 4 per token)" == untrained_reason(moe)
    lite = load_model(str(HF_CONFIGS / "deepseek-v2-lite.json"))
    reason = untrained_reason(lite) or ""
    assert "mixture of experts" in reason and "multi-head latent attention (kv_lora_rank=512)" in reason
    assert untrained_reason(replace(PRESETS["tiny"], norms_per_layer=3)) == \
        "norms_per_layer=3 (the built-in model builds 1, 2 or 4)"
    assert all(untrained_reason(shape) is None for shape in PRESETS.values())
    for name in ("qwen3-8b", "gemma-3-1b", "gemma-3-4b-text"):  # dense families it builds
        assert untrained_reason(load_model(str(HF_CONFIGS / f"{name}.json"))) is None


# -- autotune tune -----------------------------------------------------------------------------------------

def test_tune_refuses_a_mixture_of_experts_before_writing_anything(mixtral, tmp_path, capsys):
    out = tmp_path / "runs" / "mix"
    assert main(["tune", "--model", str(mixtral), "--trials", "2", "--out", str(out)]) == 2
    err = one_line(capsys.readouterr().err)
    assert (f"--model {mixtral}: a mixture of experts (8 experts, 2 per token) is estimated but not trained by the "
            "built-in model: use --backend simulated, or --script with your own training script") in err
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_tune_refuses_latent_attention_and_names_both(tmp_path, capsys):
    mla = tmp_path / "mla.yaml"
    mla.write_text(DENSE_MLA)
    out = tmp_path / "out"
    assert main(["tune", "--model", str(mla), "--trials", "2", "--out", str(out), "--json"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--model {mla}: multi-head latent attention (kv_lora_rank=16) is estimated but not trained" in err
    lite = HF_CONFIGS / "deepseek-v2-lite.json"
    assert main(["tune", "--model", str(lite), "--out", str(out)]) == 2
    err = one_line(capsys.readouterr().err)
    assert "mixture of experts (64 experts, 6 per token) with multi-head latent attention" in err
    assert not out.exists()


def test_the_refusal_comes_before_the_machine_check(mixtral, tmp_path, capsys):
    """A profile this machine cannot run is refused too, but the model is the first thing to fix."""
    out = tmp_path / "out"
    assert main(["tune", "--model", str(mixtral), "--hardware", "h100-80gb", "--gpus", "8", "--out", str(out)]) == 2
    assert "a mixture of experts" in one_line(capsys.readouterr().err)
    assert not out.exists()


def test_the_library_refuses_real_trials_and_allows_estimates(mixtral):
    workload = make_workload(str(mixtral))
    with pytest.raises(ConfigError, match=r"^model mix: a mixture of experts \(8 experts, 2 per token\) is estimated "
                                          r"but not trained by the built-in model: use backend 'simulated'"):
        TuneSpec(workload, "a100-80gb")  # deepspeed, the default
    assert TuneSpec(workload, "a100-80gb", backend="simulated").backend == "simulated"
    assert TuneSpec(Workload(PRESETS["tiny"], 16, 1), "cpu").backend == "deepspeed"


# -- sweep files -------------------------------------------------------------------------------------------

def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_a_sweep_refuses_a_real_trial_workload_before_anything_runs(mixtral, tmp_path, capsys):
    sweep = write(tmp_path, f"workloads:\n  - {{name: ok, model: tiny}}\n"
                            f"  - {{name: mix, model: {mixtral}, backend: deepspeed}}\n")
    out = tmp_path / "sweep-out"
    assert main(["sweep", str(sweep), "--out", str(out)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{sweep}: workloads[1].model: '" in err  # the value quoted (a long path cut short)
    assert ("config.json': a mixture of experts (8 experts, 2 per token) is estimated but not trained by the built-in "
            "model: allowed with backend simulated, or script: your own training script in place of model") in err
    assert not out.exists()


def test_a_sweep_names_the_workload_that_would_train_it(mixtral, tmp_path):
    """As other keys that do not go together (a model and a script): the workload is named, whichever gave them."""
    relative = mixtral.relative_to(tmp_path)  # relative to the sweep file's folder
    sweep = write(tmp_path, f"defaults: {{model: {relative}, backend: deepspeed}}\nworkloads:\n  - {{name: a}}\n")
    with pytest.raises(ConfigError, match=r"workloads\[0\]\.model: 'hf/mix/config\.json': a mixture of experts"):
        load_sweep(sweep)
    # the sweep's own default backend (simulated) estimates it
    sweep = write(tmp_path, f"workloads:\n  - {{name: a, model: {relative}}}\n")
    (spec,) = load_sweep(sweep).workloads
    assert spec.settings.backend == "simulated" and spec.settings.workload.model.experts == 8


def test_a_bad_default_is_named_as_a_default(tmp_path):
    cases = [
        ("defaults: {memory_budget: -4GiB}\nworkloads:\n  - {name: a, model: tiny}",
         "defaults.memory_budget: '-4GiB': size '-4GiB' must be positive"),
        ("defaults: {gpus: 0}\nworkloads:\n  - {name: a, model: tiny}", "defaults.gpus: 0:"),
        ("defaults: {hardware: h900}\nworkloads:\n  - {name: a, model: tiny}", "defaults.hardware: unknown hardware"),
        ("defaults: {model: tiny4}\nworkloads:\n  - {name: a}", "defaults.model: 'tiny4': allowed tiny"),
        ("defaults: {strategy: bayes}\nworkloads:\n  - {name: a}", "defaults.strategy: 'bayes': allowed"),
        # a workload's own value is named as its own, the default's as the default's
        ("defaults: {trials: 5}\nworkloads:\n  - {name: a, trials: 0}", "workloads[0].trials: 0:"),
        ("defaults: {trials: 0}\nworkloads:\n  - {name: a, trials: 3}\n  - {name: b}", "defaults.trials: 0:"),
    ]
    for text, expected in cases:
        with pytest.raises(ConfigError) as err:
            load_sweep(write(tmp_path, text))
        message = str(err.value)
        assert message.startswith(str(tmp_path / "sweep.yaml")) and expected in message, (text, message)
        assert "\n" not in message
    overridden = write(tmp_path, "defaults: {memory_budget: 1GiB}\nworkloads:\n  - {name: a, model: tiny}")
    assert load_sweep(overridden).workloads[0].chosen_budget == 2**30


def test_a_written_out_space_is_a_space(tmp_path):
    sweep = write(tmp_path, "workloads:\n  - {name: a, model: tiny, space: {precision: [bf61]}}")
    with pytest.raises(ConfigError) as err:
        load_sweep(sweep)
    assert str(err.value) == (f"{sweep}: workloads[0].space: precision: bad value 'bf61': allowed one of fp32, "
                              "fp16, bf16")
    sweep = write(tmp_path, "defaults: {space: {zero_stage: [9]}}\nworkloads:\n  - {name: a, model: tiny}")
    with pytest.raises(ConfigError, match=r"defaults\.space: zero_stage: bad value 9: allowed one of 0, 1, 2, 3"):
        load_sweep(sweep)
    sweep = write(tmp_path, "workloads:\n  - {name: a, model: tiny, space: [fp32]}")
    with pytest.raises(ConfigError, match=r"workloads\[0\]\.space: \['fp32'\]: allowed a preset name \(default, cpu\), "
                                          r"a search-space YAML path .*or a mapping of knob -> list of values"):
        load_sweep(sweep)
    sweep = write(tmp_path, "workloads:\n  - {name: a, model: tiny, hardware: cpu, "
                            "space: {zero_stage: [0, 2], micro_batch: [1, 2], precision: [fp32]}}")
    (spec,) = load_sweep(sweep).workloads
    choices = spec.settings.choices
    assert (choices.zero_stage, choices.micro_batch, choices.precision) == ((0, 2), (1, 2), ("fp32",))
    assert len(spec.space) == len(list(spec.space))
