"""A model shape from a name, a file or a directory: what `--model` (and a workload's model) may be.

`load_model(spec, seq_len)` takes, in this order:
- a built-in preset name (`autotune.values.shapes.PRESETS`);
- a Hugging Face `config.json`, or a model directory holding one, read with the standard library (no
  transformers, no network): the model types of `HF_TYPES`;
- a YAML or JSON file of this project's own shape keys (`ModelShape`'s fields), optionally on top of a
  preset (`base: llama-7b`);
- a Hugging Face Hub id (`meta-llama/Llama-3.1-8B`), looked up only in the local Hugging Face cache
  (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), never downloaded.

Sequence length: `seq_len` when given; else a preset's or shape file's own; for a Hugging Face config
`max_position_embeddings` (`n_positions` for GPT-2) capped at DEFAULT_SEQ_LEN, since a 128k-token context
is rarely what one trains at and activations grow with it. A model with a learned position table (GPT-2)
cannot run longer sequences than its table: asking for them is an error.

Every error is a ConfigError of one line naming the value and what is allowed.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Callable, Iterable

from autotune.files import parse_yaml
from autotune.values.config import ConfigError
from autotune.values.shapes import PRESETS, ModelShape, with_seq_len

DEFAULT_SEQ_LEN = 4096  # an HF config's context length is capped at this unless --seq-len says otherwise
SHAPE_KEYS = tuple(f.name for f in fields(ModelShape))
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
_MISSING = object()


class UnknownModel(ConfigError):
    """The text names no preset, no file or directory, and no Hub id in the local cache."""


def load_model(spec: str, seq_len: int | None = None) -> ModelShape:
    """The model shape `spec` names (a preset, a config.json, a model directory, a shape file, a cached
    Hub id), at `seq_len` tokens per sample if given. ConfigError (one line) if it names none."""
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0):
        raise ConfigError(f"seq_len={seq_len!r}: must be a positive integer")
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownModel(f"model {spec!r}: {ALLOWED}")
    if spec in PRESETS:
        return with_seq_len(PRESETS[spec], seq_len)
    path = Path(spec).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"model directory {spec}: has no config.json (a Hugging Face model directory holds one)")
        data = _read_json(config)
        return _from_hf(data, str(config), _hf_name(data, _local_name(path, path.name)), seq_len)
    if path.is_file():
        return _from_file(path, seq_len)
    if _HUB_ID.match(spec) and not spec.endswith((".json", ".yaml", ".yml")):
        cache = hub_cache()
        cached = cached_config(spec, cache)
        if cached is not None:
            return _from_hf(_read_json(cached), str(cached), spec, seq_len)
        hint = did_you_mean(spec, PRESETS)  # llama-7 -> llama-7b
        raise UnknownModel(f"unknown model {spec!r}{hint}: not a preset ({', '.join(PRESETS)}), no such file or "
                           f"directory, and not in the local Hugging Face cache ({cache / _cache_folder(spec)}): pass a "
                           "config.json path, a model directory or a YAML/JSON shape file (nothing is downloaded)")
    raise UnknownModel(f"model {spec}{did_you_mean(spec, PRESETS)}: no such file or directory; {ALLOWED}")


def did_you_mean(word: Any, names: Iterable[Any]) -> str:
    """' (did you mean NAME?)' for a mistyped name: the names it begins (h100 -> h100-80gb; gpt2 -> its four
    sizes), else difflib's closest (llama-7 -> llama-7b); '' when none is close. Every name a user types gets it:
    models, hardware profiles, strategies, space presets, the command line's choices. Here because this module is
    the lightest of the values every one of them imports."""
    if not isinstance(word, str) or not word:
        return ""
    texts = [name for name in names if isinstance(name, str)]
    by_case = {name.lower(): name for name in texts}  # A100-80GB -> a100-80gb, not difflib's h100-80gb
    if word.lower() in by_case and by_case[word.lower()] != word:
        return f" (did you mean {by_case[word.lower()]}?)"
    close = [name for name in texts if name.lower().startswith(word.lower()) and name != word][:4]
    close = close or [by_case[m] for m in difflib.get_close_matches(word.lower(), list(by_case), n=1)]
    if not close:
        return ""
    return f" (did you mean {close[0] if len(close) == 1 else ', '.join(close[:-1]) + ' or ' + close[-1]}?)"


ALLOWED = ("allowed: a preset (" + ", ".join(PRESETS) + "), a Hugging Face config.json or model directory, "
           "a Hub id in the local Hugging Face cache, or a YAML/JSON shape file")


# -- the Hugging Face cache ---------------------------------------------------------------------------

def hub_cache() -> Path:
    """The Hugging Face Hub cache folder, as huggingface_hub finds it (without importing it)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _cache_folder(hub_id: str) -> str:
    return "models--" + hub_id.replace("/", "--")


def cached_config(hub_id: str, cache: Path | None = None) -> Path | None:
    """`<cache>/models--owner--name/snapshots/<revision>/config.json`: the revision `refs/main` points to,
    else the newest snapshot holding a config.json; None if the cache has none."""
    repo = (cache or hub_cache()) / _cache_folder(hub_id)
    main = repo / "refs" / "main"
    try:
        revision = main.read_text().strip() if main.is_file() else ""
    except OSError:
        revision = ""
    if revision and (repo / "snapshots" / revision / "config.json").is_file():
        return repo / "snapshots" / revision / "config.json"
    snapshots = [p for p in (repo / "snapshots").glob("*/config.json") if p.is_file()]
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None


# -- files --------------------------------------------------------------------------------------------

def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it: {err.strerror or err}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of model keys, got {type(data).__name__}")
    return data


def _read_yaml(path: Path) -> dict[str, Any]:
    data = parse_yaml(_text(path), path, "a mapping of model shape keys")  # a key given twice refused too
    if not isinstance(data, dict):
        got = "the file is empty" if data is None else f"got {type(data).__name__}"
        raise ConfigError(f"{path}: {got}: expected a mapping of model shape keys")
    return data


def _from_file(path: Path, seq_len: int | None) -> ModelShape:
    if path.suffix in (".yaml", ".yml"):
        return _from_shape(_read_yaml(path), path, seq_len)
    if path.suffix != ".json":
        raise ConfigError(f"model file {path}: expected a Hugging Face config.json, or a .json/.yaml file of "
                          f"shape keys ({', '.join(SHAPE_KEYS)})")
    data = _read_json(path)
    if "model_type" in data or "architectures" in data:
        name = _local_name(path.parent, path.parent.name) if path.stem == "config" else path.stem
        return _from_hf(data, str(path), _hf_name(data, name), seq_len)
    return _from_shape(data, path, seq_len)


def _local_name(folder: Path, fallback: str) -> str:
    """A model directory's name: the folder's, resolved when it is '.'."""
    return fallback or folder.resolve().name or "model"


def _from_shape(data: dict[str, Any], path: Path, seq_len: int | None) -> ModelShape:
    """This project's own shape keys, optionally on top of a preset (`base: <preset>`)."""
    data = dict(data)
    base = data.pop("base", None)
    unknown = sorted(set(data) - set(SHAPE_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(map(str, unknown))}: allowed base, "
                          f"{', '.join(SHAPE_KEYS)} (a Hugging Face config.json has a model_type)")
    values: dict[str, Any] = {}
    if base is not None:
        if base not in PRESETS:
            raise ConfigError(f"{path}: base={base!r}: allowed {', '.join(PRESETS)}")
        values = {k: v for k, v in asdict(PRESETS[base]).items()}
        if {"hidden", "heads"} & set(data) and "head_dim" not in data:
            values["head_dim"] = 0  # follows the new hidden / heads
        if "hidden" in data and "ffn_hidden" not in data and PRESETS[base].arch == "gpt":
            values["ffn_hidden"] = 0
    values.update(data)
    values["name"] = data.get("name", path.stem)  # a shape on top of a preset is another model
    if seq_len is not None:
        values["seq_len"] = seq_len
    if base is not None and "max_positions" not in data and values.get("max_positions") and "seq_len" in values:
        values["max_positions"] = max(values["max_positions"], values["seq_len"])  # as with a preset: grows to fit
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq_len") if k not in values]
    if missing:
        hint = " (or pass --seq-len)" if missing == ["seq_len"] else ""
        raise ConfigError(f"{path}: missing key(s) {', '.join(missing)}{hint}: required layers, hidden, heads, "
                          "vocab, seq_len")
    try:
        return ModelShape(**values)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


# -- Hugging Face config.json -------------------------------------------------------------------------

class _Config:
    """Typed reads of a config.json's keys, with errors naming the file, the key and the model type."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data, self.where, self.model_type = data, where, data.get("model_type")

    def count(self, key: str, default: int = 0) -> int:
        """A non-negative integer (a number of layers or experts, where 0 is meaningful)."""
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{self.where}: {key}={value!r}: must be a non-negative integer")
        return value

    def int(self, *keys: str, default: Any = _MISSING) -> Any:
        for key in keys:
            value = self.data.get(key)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{self.where}: {key}={value!r}: must be a positive integer")
            return value
        if default is _MISSING:
            raise ConfigError(f"{self.where}: missing key {' or '.join(keys)} (model_type {self.model_type})")
        return default

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}: {key}={value!r}: must be true or false")
        return value


def _llama_family(c: _Config, *, tied: bool = False, head_dim: int = 0, **extra: Any) -> dict[str, Any]:
    heads = c.int("num_attention_heads")
    return dict(arch="llama", layers=c.int("num_hidden_layers"), hidden=c.int("hidden_size"), heads=heads,
                kv_heads=c.int("num_key_value_heads", default=heads), vocab=c.int("vocab_size"),
                ffn_hidden=c.int("intermediate_size"), head_dim=c.int("head_dim", default=head_dim),
                tied_embeddings=c.bool("tie_word_embeddings", tied), positions="rotary",
                context=c.int("max_position_embeddings", default=None), **extra)


def _llama(c: _Config) -> dict[str, Any]:
    # attention_bias puts biases on q, k, v (and o: h more per layer, not counted); mlp_bias is not counted.
    return _llama_family(c, qkv_bias=c.bool("attention_bias", False))


def _qwen2(c: _Config) -> dict[str, Any]:
    return _llama_family(c, qkv_bias=True)


def _gemma(c: _Config) -> dict[str, Any]:
    return _llama_family(c, tied=True, head_dim=256)


def _gemma2(c: _Config) -> dict[str, Any]:
    return _llama_family(c, tied=True, head_dim=256, norms_per_layer=4)


def _mixtral(c: _Config) -> dict[str, Any]:
    return _llama_family(c, experts=c.int("num_local_experts", default=8),
                         experts_per_token=c.int("num_experts_per_tok", default=2))


def _qwen3(c: _Config) -> dict[str, Any]:
    # Qwen3: an RMSNorm on each query and key head (q_norm, k_norm) and its own head_dim (128).
    return _llama_family(c, qkv_bias=c.bool("attention_bias", False), qk_norm=True)


def _qwen_moe_layers(c: _Config, layers: int) -> int:
    """Qwen2/3-MoE's MoE layers (Qwen2MoeDecoderLayer): not in mlp_only_layers and every
    decoder_sparse_step-th; the others have a dense MLP of intermediate_size."""
    only = c.data.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"{c.where}: mlp_only_layers={only!r}: must be a list of layer indices")
    step = c.int("decoder_sparse_step", default=1)
    return sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)


def _moe(values: dict[str, Any], moe_layers: int, experts: int, per_token: int, width: int,
         **shared: Any) -> dict[str, Any]:
    """A dense reading turned MoE: experts of `width`, the other layers keep the dense MLP; no MoE layer (or
    a single expert) leaves it dense."""
    if not moe_layers or experts <= 1:
        return values
    dense = values["layers"] - moe_layers
    return {**values, **shared, "experts": experts, "experts_per_token": per_token, "ffn_hidden": width,
            "dense_layers": dense, "dense_ffn_hidden": values["ffn_hidden"] if dense else 0}


def _qwen2_moe(c: _Config) -> dict[str, Any]:
    # A shared expert of shared_expert_intermediate_size behind a sigmoid gate (Qwen2MoeSparseMoeBlock).
    values = _llama_family(c, qkv_bias=True)
    shared = c.count("shared_expert_intermediate_size")
    return _moe(values, _qwen_moe_layers(c, values["layers"]), c.count("num_experts"), c.int("num_experts_per_tok"),
                c.int("moe_intermediate_size"), shared_ffn_hidden=shared, shared_gate=shared > 0)


def _qwen3_moe(c: _Config) -> dict[str, Any]:
    values = _qwen3(c)
    return _moe(values, _qwen_moe_layers(c, values["layers"]), c.count("num_experts"), c.int("num_experts_per_tok"),
                c.int("moe_intermediate_size"))


# transformers' Gemma3TextConfig defaults: gemma-3-4b/12b/27b's config.json (model_type gemma3) hold a
# text_config of a few keys and leave the rest to them.
_GEMMA3_TEXT = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072}


def _gemma3_text(c: _Config) -> dict[str, Any]:
    # Gemma 2's four norms per layer and tied embeddings, plus q/k norms; sliding-window layers are not modelled.
    c = _Config({**_GEMMA3_TEXT, **c.data}, c.where)
    return _llama_family(c, tied=True, head_dim=256, norms_per_layer=4, qk_norm=True)


def _deepseek(c: _Config) -> dict[str, Any]:
    # DeepSeek-V2/V3 (modeling_deepseek.py): multi-head latent attention, and DeepSeekMoE from layer
    # first_k_dense_replace on, every moe_layer_freq-th: n_routed_experts of moe_intermediate_size, and
    # n_shared_experts of them fused into one shared MLP. attention_bias (false in every release) is not counted.
    # A query/key head is qk_nope_head_dim + qk_rope_head_dim wide whatever head_dim says (transformers writes
    # the rotary part there), and every head has its own key and value (num_key_value_heads = heads).
    rope = c.int("qk_rope_head_dim")
    values = {**_llama_family(c), "head_dim": c.int("qk_nope_head_dim") + rope, "kv_heads": c.int("num_attention_heads"),
              "q_lora_rank": c.int("q_lora_rank", default=0), "kv_lora_rank": c.int("kv_lora_rank"),
              "rope_head_dim": rope, "v_head_dim": c.int("v_head_dim")}
    layers, first = values["layers"], c.count("first_k_dense_replace")
    freq = c.int("moe_layer_freq", default=1)
    moe_layers = sum(1 for i in range(layers) if i >= first and i % freq == 0)
    routed = c.count("n_routed_experts")
    if not routed:
        return values
    width = c.int("moe_intermediate_size")
    return _moe(values, moe_layers, routed, c.int("num_experts_per_tok"), width,
                shared_ffn_hidden=c.count("n_shared_experts") * width)


def _gpt2(c: _Config) -> dict[str, Any]:
    hidden = c.int("n_embd", "hidden_size")
    table = c.int("n_positions", "n_ctx", "max_position_embeddings", default=1024)
    return dict(arch="gpt", layers=c.int("n_layer", "num_hidden_layers"), hidden=hidden,
                heads=c.int("n_head", "num_attention_heads"), vocab=c.int("vocab_size"),
                ffn_hidden=c.int("n_inner", default=4 * hidden), tied_embeddings=c.bool("tie_word_embeddings", True),
                positions="learned", max_positions=table, context=table)


def _gpt_neox(c: _Config) -> dict[str, Any]:
    # Parallel attention and MLP (use_parallel_residual) still have a norm each; rotary on part of each head.
    return dict(arch="gpt", layers=c.int("num_hidden_layers"), hidden=c.int("hidden_size"),
                heads=c.int("num_attention_heads"), vocab=c.int("vocab_size"), ffn_hidden=c.int("intermediate_size"),
                tied_embeddings=c.bool("tie_word_embeddings", False), positions="rotary",
                qkv_bias=c.bool("attention_bias", True), context=c.int("max_position_embeddings", default=None))


def _phi(c: _Config) -> dict[str, Any]:
    # Phi-1/1.5/2: one LayerNorm per layer shared by parallel attention and MLP, a biased LM head.
    heads = c.int("num_attention_heads")
    return dict(arch="gpt", layers=c.int("num_hidden_layers"), hidden=c.int("hidden_size"), heads=heads,
                kv_heads=c.int("num_key_value_heads", default=heads), vocab=c.int("vocab_size"),
                ffn_hidden=c.int("intermediate_size"), tied_embeddings=c.bool("tie_word_embeddings", False),
                positions="rotary", norms_per_layer=1, lm_head_bias=True,
                context=c.int("max_position_embeddings", default=None))


HF_TYPES: dict[str, Callable[[_Config], dict[str, Any]]] = {
    "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "gemma": _gemma, "gemma2": _gemma2,
    "gemma3_text": _gemma3_text, "gpt2": _gpt2, "gpt_neox": _gpt_neox, "llama": _llama, "mistral": _llama,
    "mixtral": _mixtral, "phi": _phi, "phi3": _llama, "qwen2": _qwen2, "qwen2_moe": _qwen2_moe, "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
}


def _hf_name(data: dict[str, Any], fallback: str) -> str:
    """`_name_or_path` when it is a Hub id (not a local path), else the fallback."""
    name = data.get("_name_or_path")
    if isinstance(name, str) and _HUB_ID.match(name) and not Path(name).expanduser().exists():
        return name
    return fallback


def _from_hf(data: dict[str, Any], where: str, name: str, seq_len: int | None) -> ModelShape:
    model_type = data.get("model_type")
    reader = HF_TYPES.get(model_type) if isinstance(model_type, str) else None
    if reader is None:
        what = f"model_type {model_type!r} is not supported" if model_type is not None else "no model_type"
        text = data.get("text_config")
        inner = text.get("model_type") if isinstance(text, dict) else None
        if inner in HF_TYPES:  # a multimodal config (gemma3, llava, ...): its language model is what trains here
            what += (f" (a multimodal config): pass its text_config (model_type {inner!r}) as a config.json of its "
                     "own, which is supported")
        raise ConfigError(f"{where}: {what}: supported {', '.join(sorted(HF_TYPES))}")
    values = reader(_Config(data, where))
    context = values.pop("context") or DEFAULT_SEQ_LEN
    table = values.get("max_positions", 0)
    if seq_len is not None and table and seq_len > table:
        raise ConfigError(f"{where}: seq_len {seq_len} is longer than the model's learned position table "
                          f"({table} positions)")
    values["seq_len"] = seq_len or min(context, DEFAULT_SEQ_LEN)
    try:
        return ModelShape(name=name, **values)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
