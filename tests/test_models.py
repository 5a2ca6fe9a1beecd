"""Your own model (autotune/values/models.py): presets, Hugging Face config.json files and model directories read
offline, cached Hub ids, YAML/JSON shape files, --seq-len; parameter counts against the published figures;
the estimator and the built-in model on the new shape fields; one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autotune.cli import main
from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import estimate
from autotune.values.hardware import PROFILES
from autotune.values.models import DEFAULT_SEQ_LEN, HF_TYPES, load_model
from autotune.commands.sweep_file import load_sweep
from autotune.worker.model import GPT, count_parameters, synthetic_batch, unsupported_reason
from autotune.values.workload import PRESETS, ModelShape, Workload, make_workload

# The published config.json files, as they are on the Hugging Face Hub (values copied; nothing downloaded).
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256}
LLAMA_2_7B = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf", "architectures": ["LlamaForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": True,
    "vocab_size": 32000}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.37.2", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}
GEMMA_7B = {  # no tie_word_embeddings: Gemma ties them
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 24576, "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0",
    "use_cache": True, "vocab_size": 256000}
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 256000}
GPT2 = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256,
    "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257}
GPT2_MEDIUM = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256,
    "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 1024, "n_head": 16, "n_layer": 24, "n_positions": 1024,
    "n_special": 0, "predict_special_tokens": True, "resid_pdrop": 0.1, "summary_activation": None,
    "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
    "summary_use_proj": True, "vocab_size": 50257}
PYTHIA_1_4B = {
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 16, "num_hidden_layers": 24,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.24.0", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}
PHI_2 = {
    "_name_or_path": "microsoft/phi-2", "architectures": ["PhiForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 50256, "embd_pdrop": 0.0, "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
    "model_type": "phi", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "partial_rotary_factor": 0.4, "qk_layernorm": False, "resid_pdrop": 0.1, "rope_scaling": None,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.37.0",
    "use_cache": True, "vocab_size": 51200}
PHI_3_MINI = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True, "attention_bias": False,
    "vocab_size": 32064}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
    "vocab_size": 32000}

# (config, published size, the exact count of the checkpoint's tensors)
PUBLISHED = {
    "llama-3-8b": (LLAMA_3_8B, 8.03e9, 8_030_261_248),
    "llama-2-7b": (LLAMA_2_7B, 6.74e9, 6_738_415_616),
    "mistral-7b-v0.1": (MISTRAL_7B, 7.24e9, 7_241_732_096),
    "qwen2-7b": (QWEN2_7B, 7.62e9, 7_615_616_512),
    "gemma-7b": (GEMMA_7B, 8.54e9, 8_537_680_896),
    "gemma-2-9b": (GEMMA_2_9B, 9.24e9, 9_241_705_984),
    "gpt2": (GPT2, 124e6, 124_439_808),
    "gpt2-medium": (GPT2_MEDIUM, 355e6, 354_823_168),
    "pythia-1.4b": (PYTHIA_1_4B, 1.41e9, 1_414_647_808),
    "phi-2": (PHI_2, 2.78e9, 2_779_683_840),
    "phi-3-mini": (PHI_3_MINI, 3.82e9, 3_821_079_552),
    "mixtral-8x7b": (MIXTRAL_8X7B, 46.7e9, 46_702_792_704),
}


def write_config(folder: Path, config: dict, name: str = "config.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(config))
    return path


# -- parameter counts --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_the_published_figures(name, tmp_path):
    config, published, exact = PUBLISHED[name]
    shape = load_model(str(write_config(tmp_path / name, config)))
    assert shape.params == pytest.approx(published, rel=0.01)
    assert shape.params == exact


def test_every_supported_type_is_covered_by_a_published_config():
    families = {json.loads(p.read_text())["model_type"] for p in (Path(__file__).parent / "hf_configs").glob("*.json")}
    assert set(HF_TYPES) == {config["model_type"] for config, _, _ in PUBLISHED.values()} | {"mistral"} | families


def test_mixtral_counts_every_expert_but_a_token_goes_through_two(tmp_path):
    shape = load_model(str(write_config(tmp_path, MIXTRAL_8X7B)))
    assert (shape.experts, shape.experts_per_token) == (8, 2)
    active = shape.layers * shape.active_layer_params + shape.embedding_params + shape.norm_params
    assert active == pytest.approx(12.9e9, rel=0.01)  # Mixtral's published active parameters


def test_shapes_read_from_configs(tmp_path):
    gemma = load_model(str(write_config(tmp_path / "g", GEMMA_7B)))
    assert (gemma.head_dim, gemma.q_dim, gemma.tied_embeddings, gemma.arch) == (256, 4096, True, "llama")
    qwen = load_model(str(write_config(tmp_path / "q", QWEN2_7B)))
    assert (qwen.qkv_bias, qwen.kv_heads, qwen.tied_embeddings) == (True, 4, False)
    gpt2 = load_model(str(write_config(tmp_path / "gpt2", GPT2)))
    assert (gpt2.arch, gpt2.positions, gpt2.max_positions, gpt2.tied_embeddings) == ("gpt", "learned", 1024, True)
    neox = load_model(str(write_config(tmp_path / "p", PYTHIA_1_4B)))
    assert (neox.arch, neox.positions, neox.tied_embeddings, neox.qkv_bias) == ("gpt", "rotary", False, True)
    phi = load_model(str(write_config(tmp_path / "phi", PHI_2)))
    assert (phi.norms_per_layer, phi.lm_head_bias, phi.positions) == (1, True, "rotary")


# -- where a model comes from ------------------------------------------------------------------------

def test_a_file_a_directory_and_a_cached_hub_id_give_the_same_shape(tmp_path, monkeypatch):
    folder = tmp_path / "Meta-Llama-3-8B"
    path = write_config(folder, LLAMA_3_8B)
    from_file, from_dir = load_model(str(path)), load_model(str(folder))
    assert from_file == from_dir and from_file.name == "Meta-Llama-3-8B"  # no _name_or_path: the folder's name
    cache = tmp_path / "hub"
    repo = cache / "models--meta-llama--Meta-Llama-3-8B"
    write_config(repo / "snapshots" / "aaaa", {**LLAMA_3_8B, "num_hidden_layers": 1})  # an older snapshot
    write_config(repo / "snapshots" / "bbbb", LLAMA_3_8B)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbbb")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    cached = load_model("meta-llama/Meta-Llama-3-8B")
    assert cached.name == "meta-llama/Meta-Llama-3-8B"
    assert replace(cached, name=from_file.name) == from_file
    # HF_HOME/hub when HF_HUB_CACHE is not set
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    home = tmp_path / "hf-home"
    write_config(home / "hub" / "models--gpt2" / "snapshots" / "cccc", GPT2)
    monkeypatch.setenv("HF_HOME", str(home))
    assert load_model("gpt2").params == 124_439_808


def test_a_hub_id_not_in_the_cache_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as info:
        load_model("meta-llama/Llama-3.1-8B")
    message = str(info.value)
    assert "\n" not in message and "meta-llama/Llama-3.1-8B" in message
    assert str(tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B") in message and "config.json" in message


def test_name_or_path_names_the_model_when_it_is_a_hub_id(tmp_path):
    assert load_model(str(write_config(tmp_path / "x", PHI_2))).name == "microsoft/phi-2"
    local = {**LLAMA_3_8B, "_name_or_path": str(tmp_path / "somewhere")}
    (tmp_path / "somewhere").mkdir()
    assert load_model(str(write_config(tmp_path / "mine", local))).name == "mine"
    assert load_model(str(write_config(tmp_path, LLAMA_3_8B, "llama3.json"))).name == "llama3"


def test_yaml_and_json_shape_files(tmp_path):
    yaml_file = tmp_path / "my-llama.yaml"
    yaml_file.write_text("layers: 2\nhidden: 128\nheads: 4\nkv_heads: 2\nvocab: 1000\nseq_len: 64\n"
                         "ffn_hidden: 344\narch: llama\ntied_embeddings: true\n")
    shape = load_model(str(yaml_file))
    assert (shape.name, shape.layers, shape.kv_heads, shape.tied_embeddings) == ("my-llama", 2, 2, True)
    json_file = tmp_path / "shape.json"
    json_file.write_text(json.dumps({**shape.to_dict(), "name": "from-json"}))
    assert load_model(str(json_file)) == replace(shape, name="from-json")
    based = tmp_path / "wide.yml"
    based.write_text("base: llama-7b\nlayers: 16\n")
    wide = load_model(str(based))
    assert wide == replace(PRESETS["llama-7b"], name="wide", layers=16)
    no_seq = tmp_path / "no-seq.yaml"
    no_seq.write_text("layers: 2\nhidden: 64\nheads: 2\nvocab: 100\n")
    with pytest.raises(ConfigError, match="missing key.*seq_len.*--seq-len"):
        load_model(str(no_seq))
    assert load_model(str(no_seq), seq_len=32).seq_len == 32


def test_seq_len_defaults_and_overrides(tmp_path):
    llama = write_config(tmp_path / "l", LLAMA_3_8B)
    assert load_model(str(llama)).seq_len == DEFAULT_SEQ_LEN == 4096  # max_position_embeddings 8192, capped
    assert load_model(str(write_config(tmp_path / "p", PHI_2))).seq_len == 2048  # its own, under the cap
    assert load_model(str(llama), seq_len=8192).seq_len == 8192
    gpt2 = write_config(tmp_path / "g", GPT2)
    short = load_model(str(gpt2), seq_len=256)
    assert (short.seq_len, short.max_positions, short.params) == (256, 1024, 124_439_808)  # the table stays
    with pytest.raises(ConfigError, match="seq_len 2048 is longer than the model's learned position table"):
        load_model(str(gpt2), seq_len=2048)
    # Presets: --seq-len replaces theirs; a learned table grows to fit, never shrinks.
    assert load_model("tiny", seq_len=512).max_positions == 512
    assert load_model("gpt2-small", seq_len=512).params == PRESETS["gpt2-small"].params
    assert load_model("llama-7b", seq_len=4096) == replace(PRESETS["llama-7b"], seq_len=4096)
    assert make_workload(str(llama), seq_len=1024).model.seq_len == 1024
    assert make_workload("tiny", seq_len=128).global_batch == 16  # the preset's default batch


# -- shapes on file stay as they were ----------------------------------------------------------------

def test_dicts_of_existing_shapes_are_unchanged_and_new_fields_round_trip(tmp_path):
    for shape in PRESETS.values():
        assert set(shape.to_dict()) == {"name", "layers", "hidden", "heads", "vocab", "seq_len", "ffn_hidden",
                                        "kv_heads", "arch"}
        assert ModelShape(**shape.to_dict()) == shape
    old = {"model": {"name": "tiny", "layers": 4, "hidden": 256, "heads": 4, "vocab": 4096, "seq_len": 256,
                     "ffn_hidden": 1024, "kv_heads": 4, "arch": "gpt"}, "global_batch": 16, "gpus": 1}
    assert Workload.from_dict(old) == make_workload("tiny")
    for name, (config, _, _) in PUBLISHED.items():
        shape = load_model(str(write_config(tmp_path / name, config)))
        assert ModelShape(**shape.to_dict()) == shape
        assert Workload.from_dict(make_workload(shape).to_dict()).model == shape
    gemma = load_model(str(write_config(tmp_path / "gemma", GEMMA_7B))).to_dict()
    assert gemma["head_dim"] == 256 and gemma["tied_embeddings"] is True and "experts" not in gemma


# -- the estimator -----------------------------------------------------------------------------------

def test_the_estimator_counts_all_experts_states_and_the_routed_experts_work(tmp_path):
    mixtral = load_model(str(write_config(tmp_path, MIXTRAL_8X7B)), seq_len=2048)
    dense = replace(mixtral, experts=2, experts_per_token=2)  # what one token goes through, as a model
    config, hardware = Config(0, 1, 0, "bf16"), PROFILES["h100-80gb"]
    moe_est, dense_est = (estimate(config, Workload(s, 8, 1), hardware) for s in (mixtral, dense))
    assert moe_est.memory.weights == 2 * mixtral.params > 3 * dense_est.memory.weights
    assert moe_est.memory.activations == dense_est.memory.activations
    assert moe_est.time["compute"] == pytest.approx(dense_est.time["compute"], rel=1e-3)  # routers differ


def test_the_estimator_follows_head_dim_and_tied_embeddings(tmp_path):
    gemma = load_model(str(write_config(tmp_path, GEMMA_7B)), seq_len=1024)
    narrow = replace(gemma, head_dim=gemma.hidden // gemma.heads)
    config, hardware = Config(0, 1, 0, "bf16"), PROFILES["h100-80gb"]
    wide_est, narrow_est = (estimate(config, Workload(s, 8, 1), hardware) for s in (gemma, narrow))
    assert gemma.params > narrow.params and wide_est.memory.activations > narrow_est.memory.activations
    untied = replace(gemma, tied_embeddings=False)
    assert untied.params - gemma.params == gemma.vocab * gemma.hidden


# -- the built-in model --------------------------------------------------------------------------------

SMALL = {
    "gemma-like": ModelShape("g", 2, 64, 4, 128, 16, ffn_hidden=96, kv_heads=2, arch="llama", head_dim=32,
                             tied_embeddings=True),
    "qwen-like": ModelShape("q", 2, 64, 4, 128, 16, ffn_hidden=96, kv_heads=2, arch="llama", qkv_bias=True),
    "gemma2-like": ModelShape("g2", 2, 64, 4, 128, 16, ffn_hidden=96, arch="llama", head_dim=32,
                              tied_embeddings=True, norms_per_layer=4),
    "neox-like": ModelShape("n", 2, 64, 4, 128, 16, arch="gpt", positions="rotary", tied_embeddings=False),
    "phi2-like": ModelShape("p", 2, 64, 4, 128, 16, arch="gpt", positions="rotary", tied_embeddings=False,
                            norms_per_layer=1, lm_head_bias=True),
    "gpt2-long-table": ModelShape("t", 2, 64, 4, 128, 16, max_positions=64),
}


@pytest.mark.parametrize("name", SMALL)
def test_the_built_in_model_builds_the_dense_shapes_with_the_counted_parameters(name):
    shape = SMALL[name]
    torch.manual_seed(0)
    model = GPT(shape, ckpt_interval=1)
    assert count_parameters(model) == shape.params
    tokens, targets = synthetic_batch(shape, 2, torch.Generator().manual_seed(0))
    model(tokens, targets).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_built_in_model_refuses_a_mixture_of_experts(tmp_path):
    mixtral = load_model(str(write_config(tmp_path, MIXTRAL_8X7B)))
    reason = unsupported_reason(mixtral)
    assert reason and "mixture of experts" in reason and "\n" not in reason
    with pytest.raises(ValueError, match="mixture of experts"):
        GPT(replace(mixtral, layers=1, hidden=64, heads=4, kv_heads=2, head_dim=0, ffn_hidden=32, vocab=64))
    assert unsupported_reason(PRESETS["tiny"]) is None


# -- the command line ----------------------------------------------------------------------------------

def test_estimate_of_a_llama_3_8b_config(tmp_path, capsys):
    path = write_config(tmp_path / "Meta-Llama-3-8B", LLAMA_3_8B)
    assert main(["estimate", "--model", str(path), "--gpus", "8", "--top", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    shape = ModelShape(**data["workload"]["model"])
    assert shape.params == pytest.approx(8.03e9, rel=0.01) and shape.seq_len == 4096
    assert main(["estimate", "--model", str(path.parent), "--seq-len", "1024", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Meta-Llama-3-8B: 8,030.3M parameters")


def _config_file(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("make, fragments", [
    (lambda d: str(d / "absent" / "config.json"), ["no such file or directory"]),
    (lambda d: str(d), ["has no config.json"]),
    (lambda d: str(_config_file(d, "config.json", b'{"model_type": "llama",')), ["not valid JSON", "line 1"]),
    (lambda d: str(_config_file(d, "config.json", b'{"model_type": "ll\xffama"}')), ["not UTF-8"]),
    (lambda d: str(_config_file(d, "config.json", json.dumps({"model_type": "falcon", "hidden_size": 8}).encode())),
     ["model_type 'falcon' is not supported", "supported deepseek_v2, deepseek_v3, gemma, gemma2"]),
    (lambda d: str(_config_file(d, "config.json", json.dumps(
        {k: v for k, v in LLAMA_3_8B.items() if k != "hidden_size"}).encode())), ["missing key hidden_size"]),
    (lambda d: str(_config_file(d, "config.json", json.dumps({**LLAMA_3_8B, "num_hidden_layers": "32"}).encode())),
     ["num_hidden_layers='32'"]),
    (lambda d: str(_config_file(d, "shape.yaml", b"layers: 2\nwidth: 8\n")), ["unknown key(s) width"]),
    (lambda d: str(_config_file(d, "shape.yaml", b"layers: [2\n")), ["not valid YAML"]),
    (lambda d: str(_config_file(d, "shape.yaml", b"layers: 2\nlayers: 3\n")), ["shape.yaml:2", "'layers' given twice"]),
    (lambda d: str(_config_file(d, "model.txt", b"hello")), ["expected a Hugging Face config.json"]),
    (lambda d: "no-such-org/no-such-model", ["not in the local Hugging Face cache", "config.json"]),
])
def test_bad_models_are_one_line_and_exit_2(make, fragments, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    spec = make(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["estimate", "--model", spec]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autotune estimate: error:"), err
    for fragment in fragments:
        assert fragment in err, err


def test_a_seq_len_the_model_cannot_run_is_one_line_and_exit_2(tmp_path, capsys):
    path = write_config(tmp_path, GPT2)
    assert main(["estimate", "--model", str(path), "--seq-len", "4096"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seq_len 4096" in err and "1024 positions" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", "tiny", "--seq-len", "0"])
    assert exit_info.value.code == 2


def test_a_sweep_file_names_a_config_relative_to_itself(tmp_path):
    write_config(tmp_path / "models" / "pythia", PYTHIA_1_4B)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("workloads:\n  - {name: a, model: models/pythia, gpus: 2}\n")
    workload = load_sweep(sweep).workloads[0].settings.workload
    assert workload.model.params == 1_414_647_808 and workload.gpus == 2


# -- a real trial ----------------------------------------------------------------------------------------

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
              "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 1024, "max_position_embeddings": 128, "tie_word_embeddings": True}


@pytest.mark.slow
def test_a_real_trial_of_a_config_json_on_the_cpu(tmp_path):
    path = write_config(tmp_path / "tiny-llama", TINY_LLAMA)
    argv = [sys.executable, "-m", "autotune.cli", "trial", "--model", str(path), "--hardware", "cpu",
            "--zero-stage", "2", "--micro-batch", "2", "--precision", "fp32", "--global-batch", "4",
            "--warmup-steps", "1", "--max-steps", "2", "--run-dir", str(tmp_path / "run"), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["result"]["status"] == "ok" and out["result"]["backend"] == "deepspeed"
    assert out["prediction"]["memory"]["total"] > 0
    # A mixture of experts is refused by the built-in model, as unsupported, not built as something else.
    moe = write_config(tmp_path / "tiny-mixtral", {**TINY_LLAMA, "model_type": "mixtral", "num_local_experts": 4,
                                                   "num_experts_per_tok": 2})
    argv[argv.index(str(path))] = str(moe)
    argv[argv.index(str(tmp_path / "run"))] = str(tmp_path / "run-moe")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stderr[-3000:]
    result = json.loads(done.stdout)["result"]
    assert result["status"] == "unsupported" and "mixture of experts" in result["error"]
