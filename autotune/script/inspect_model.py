"""What the estimator needs to know about a user's model, read off the model handed to
`deepspeed.initialize` (no source of the model is needed).

- parameter count: every parameter, at its full size under ZeRO-3 (`ds_numel`);
- layers, hidden, heads, vocab, MLP width: from a Hugging Face style `config` when the model has one
  (num_hidden_layers / n_layer, hidden_size / n_embd, ...), else from the module tree: the longest
  `nn.ModuleList` of blocks of one type is the layer stack, the largest `nn.Embedding` gives vocab and
  hidden, `num_heads`-like attributes give heads;
- sequence length: from the first batch the engine sees (measured by the shim, not here);
- checkpointing switch: `activation_checkpointing_enable` / `gradient_checkpointing_enable` (Hugging
  Face models that support it).

`shape_from_info` turns that into the estimator's ModelShape. Its MLP width is solved from the parameter
count, so that the estimator's model states (16 bytes per parameter and so on) use the true count even
for a model that is not the textbook transformer; calibration on the first trials absorbs the rest.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from autotune.workload import ModelShape

HF_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "vocab": ("vocab_size",),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "kv_heads": ("num_key_value_heads",),
}
HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "n_heads", "nhead")


def checkpoint_switch(model: Any) -> str | None:
    """The name of the model's standard activation-checkpointing switch, or None."""
    if getattr(model, "supports_gradient_checkpointing", True) is False:
        return None
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        if callable(getattr(model, name, None)):
            return name
    return None


def set_checkpointing(model: Any, enabled: bool) -> None:
    """Turn the model's own checkpointing on (every layer) or off. Raises if it has no switch."""
    switch = checkpoint_switch(model)
    if switch is None:
        raise ValueError(f"{type(model).__name__} offers no activation-checkpointing switch")
    if enabled:
        getattr(model, switch)({"use_reentrant": False})  # non-reentrant: works with ZeRO-3's hooks
        return
    disable = switch.replace("_enable", "_disable")
    if getattr(model, "is_gradient_checkpointing", True) and callable(getattr(model, disable, None)):
        getattr(model, disable)()


def model_info(model: Any) -> dict[str, Any]:
    """Parameter count and whatever shape the model reveals (missing keys: not recognisable)."""
    import torch

    params = sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters())
    info: dict[str, Any] = {"class": type(model).__name__, "params": params,
                            "trainable_params": sum(int(getattr(p, "ds_numel", 0) or p.numel())
                                                    for p in model.parameters() if p.requires_grad),
                            "checkpoint_switch": checkpoint_switch(model)}
    config = getattr(model, "config", None)
    if config is not None and not isinstance(config, dict):
        config = getattr(config, "to_dict", lambda: vars(config))()
    if isinstance(config, dict):
        for key, names in HF_KEYS.items():
            for name in names:
                if isinstance(config.get(name), int) and config[name] > 0:
                    info[key] = config[name]
                    break
        if info.keys() & HF_KEYS.keys():
            info["source"] = "config"
    if "layers" not in info:
        stack = _layer_stack(model, torch)
        if stack:
            info["layers"] = len(stack)
            info["layer_class"] = type(stack[0]).__name__
            info["source"] = "modules"
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if embeddings:
        biggest = max(embeddings, key=lambda m: m.num_embeddings)
        info.setdefault("vocab", biggest.num_embeddings)
        info.setdefault("hidden", biggest.embedding_dim)
    if "heads" not in info:
        for module in model.modules():
            heads = next((getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)), None)
            if heads:
                info["heads"] = heads
                break
    return info


def _layer_stack(model: Any, torch: Any) -> list[Any]:
    """The longest ModuleList (or Sequential) whose children are all of one type: the repeated blocks."""
    best: list[Any] = []
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = list(module.children())
            kinds = Counter(type(c) for c in children)
            if len(children) > len(best) and len(kinds) == 1 and list(children[0].parameters()):
                best = children
    return best


def shape_from_info(info: dict[str, Any], seq_len: int | None, name: str) -> ModelShape:
    """The estimator's view of the model: a transformer with this parameter count and the shape found."""
    layers = max(int(info.get("layers") or 1), 1)
    hidden = int(info.get("hidden") or 0)
    n = int(info["params"])
    if hidden <= 0:
        hidden = max(64, int((n / (12 * layers)) ** 0.5))  # a transformer of that size, roughly
    heads = int(info.get("heads") or 0)
    if heads <= 0 or hidden % heads:
        heads = next(h for h in (hidden // 64, 8, 4, 2, 1) if h > 0 and hidden % h == 0)
    kv_heads = int(info.get("kv_heads") or heads)
    if heads % kv_heads:
        kv_heads = heads
    vocab = max(int(info.get("vocab") or 1), 1)
    seq = max(int(seq_len or 1), 1)
    probe = ModelShape(name, layers, hidden, heads, vocab, seq, ffn_hidden=4 * hidden, kv_heads=kv_heads)
    # gpt layer: 4h^2 + 9h + 2hf + f (+ norms); solve f so that the shape's count is the model's.
    fixed = probe.params - layers * (2 * hidden * probe.ffn_hidden + probe.ffn_hidden)
    ffn = (n - fixed) // (layers * (2 * hidden + 1))
    return ModelShape(name, layers, hidden, heads, vocab, seq, ffn_hidden=max(int(ffn), 1), kv_heads=kv_heads)
