"""What the estimator needs to know about a user's model, read off the model handed to
`deepspeed.initialize` (no source of the model is needed).

- parameter count: every parameter, at its full size under ZeRO-3 (`ds_numel`);
- layers, hidden, heads, vocab, MLP width: from a Hugging Face style `config` when the model has one
  (num_hidden_layers / n_layer, hidden_size / n_embd, ...), else from the module tree: the longest
  `nn.ModuleList` of blocks of one type is the layer stack, the largest `nn.Embedding` gives vocab and
  hidden, `num_heads`-like attributes give heads;
- sequence length: from the first batch the engine sees (measured by the shim, not here);
- checkpointing switch: `activation_checkpointing_enable` / `gradient_checkpointing_enable` (Hugging
  Face models that support it);
- how attention runs (`attention`: eager / sdpa / flash): what the first forward does (`watch_attention`: a
  softmax over an s x s tensor is an eager attention, materialised scores; a call of
  `F.scaled_dot_product_attention` is sdpa, as `nn.MultiheadAttention(need_weights=False)` takes in torch 2.x,
  while its default `need_weights=True` is eager), else a Hugging Face config's `_attn_implementation`, else
  `nn.MultiheadAttention` modules (eager: their default); attention dropout (`attn_pdrop`, `attention_dropout`,
  an MHA's `dropout`), which an eager attention pays for;
- mixture of experts (`num_local_experts` / `num_experts`, `num_experts_per_tok`), tied embeddings (the input
  embedding's weight *is* the output layer's) and the parameters' dtype (recorded: DeepSpeed casts the model to
  the trial's precision, so it does not change the estimate).

`shape_from_info` turns that into the estimator's ModelShape (attention, experts, tied embeddings included).
Its MLP width is solved from the parameter count, so that the estimator's model states (16 bytes per parameter and so on) use the true count even
for a model that is not the textbook transformer; calibration on the first trials absorbs the rest.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any, Callable

from autotune.values.shapes import ATTENTIONS
from autotune.values.workload import ModelShape

HF_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "vocab": ("vocab_size",),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "kv_heads": ("num_key_value_heads",),
}
HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "n_heads", "nhead")
EXPERT_KEYS = {"experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
               "experts_per_token": ("num_experts_per_tok", "moe_top_k")}
DROPOUT_KEYS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob", "attn_dropout")
NONE_SEEN = "none seen"  # attention_source where the first forward ran no attention torch could see (an MLP)
# attention_source where the model shows none before its first forward (no config, no module named for attention):
# what a trial that ended before that forward (a verdict in the engine's first-batch check) says of an MLP
NO_MODULE = "no attention module"
# Hugging Face attn_implementation values -> the estimator's attention (flex attention is a fused kernel).
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash",
                "flex_attention": "sdpa"}


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
    impl = getattr(config, "_attn_implementation", None) if config is not None else None
    if config is not None and not isinstance(config, dict):
        config = getattr(config, "to_dict", lambda: vars(config))()
    if isinstance(config, dict):
        impl = impl or config.get("_attn_implementation") or config.get("attn_implementation")
        for key, names in {**HF_KEYS, **EXPERT_KEYS}.items():
            for name in names:
                if isinstance(config.get(name), int) and config[name] > 0:
                    info[key] = config[name]
                    break
        if info.keys() & HF_KEYS.keys():
            info["source"] = "config"
        dropout = next((config[k] for k in DROPOUT_KEYS if isinstance(config.get(k), (int, float))), None)
        if dropout is not None:
            info["attention_dropout"] = float(dropout) > 0
    if isinstance(impl, str) and impl:
        info["attention_impl"] = impl
        info["attention"] = HF_ATTENTION.get(impl.split("|")[0].rsplit("/", 1)[-1], "sdpa")
        info["attention_source"] = "config"
    mha = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    if mha and "attention" not in info:
        info["attention"], info["attention_source"] = "eager", "nn.MultiheadAttention"  # need_weights=True
        info["attention_dropout"] = any(float(m.dropout) > 0 for m in mha)
    if "attention" not in info and not any(_names_attention(m) for m in model.modules()):
        info["attention_source"] = NO_MODULE  # the first forward, once watched, says what it saw instead
    tied = _tied_embeddings(model, torch)
    if tied is not None:
        info["tied_embeddings"] = tied
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())
    if dtypes:
        info["dtype"] = dtypes.most_common(1)[0][0]
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


def _names_attention(module: Any) -> bool:
    """A module whose class is named for attention (`CausalSelfAttention`, `GPT2Attention`, `MultiheadAttention`,
    `Attn`): the model may run one, whatever its first forward was seen to do."""
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name


def _tied_embeddings(model: Any, torch: Any) -> bool | None:
    """Whether the input embedding's weight is the output layer's (None: no embedding, or no output layer)."""
    inputs = getattr(model, "get_input_embeddings", None)
    outputs = getattr(model, "get_output_embeddings", None)
    if callable(inputs) and callable(outputs):
        try:
            into, out = inputs(), outputs()
        except (NotImplementedError, AttributeError):
            into = out = None
        if into is not None and out is not None:
            return getattr(into, "weight", None) is getattr(out, "weight", None)
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if not embeddings:
        return None
    biggest = max(embeddings, key=lambda m: m.num_embeddings)
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == biggest.num_embeddings
             and m.in_features == biggest.embedding_dim]
    if not heads:
        return None
    return any(m.weight is biggest.weight for m in heads)


def watch_attention(model: Any, info: dict[str, Any], seen: Callable[[], None]) -> None:
    """Watch the model's first forward and record in `info` how its attention really ran, then call `seen`:
    a softmax over the last dimension of a (..., s, s) tensor is an eager attention (materialised scores), a
    call of `F.scaled_dot_product_attention` a fused one (sdpa), and `nn.MultiheadAttention`'s
    `F.multi_head_attention_forward` is eager with `need_weights=True` (its default: the weights are
    returned, so torch computes them) and sdpa without; an SDPA call with dropout on the CPU is `math` (no
    fused CPU kernel takes dropout). Found neither (a flash kernel outside torch, no
    attention): `info` stays as `model_info` left it. Only the first forward is watched, and only the calls the
    model's own Python makes (a torch function mode sees no call made inside another torch function)."""
    import torch
    from torch.overrides import TorchFunctionMode

    calls = Counter[str]()
    functional = torch.nn.functional
    sdpa, mha = functional.scaled_dot_product_attention, functional.multi_head_attention_forward
    mha_args = inspect.signature(mha)

    def sdpa_args(*args: Any, **kwargs: Any) -> dict[str, Any]:
        named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p"), args))
        return {**named, **kwargs}
    softmaxes = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            if func is sdpa:
                bound = sdpa_args(*args, **kwargs)
                # No fused CPU kernel takes dropout: torch runs its math kernel, scores materialised in fp32.
                math = float(bound.get("dropout_p") or 0) > 0 and getattr(bound.get("query"), "is_cpu", False)
                calls["math" if math else "sdpa"] += 1
                if math:
                    info["attention_dropout"] = True
            elif func is mha:
                bound = mha_args.bind(*args, **kwargs).arguments
                dropout = bound.get("training", True) and float(bound.get("dropout_p") or 0) > 0
                # need_weights=False runs SDPA, on the math kernel where it has dropout on the CPU
                kind = ("eager" if bound.get("need_weights", True) else
                        "math" if dropout and getattr(bound.get("query"), "is_cpu", False) else "sdpa")
                calls[kind] += 1
                if dropout and kind != "sdpa":
                    info["attention_dropout"] = True
            elif func in softmaxes and args and isinstance(args[0], torch.Tensor):
                x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
                if x.dim() >= 3 and x.shape[-1] == x.shape[-2] > 1 and dim in (-1, x.dim() - 1):
                    calls["eager"] += 1
            return func(*args, **kwargs)

    mode = Watch()
    state = {"entered": False, "done": False}

    # The hooks are removed by the pre-hook of the next forward, never by `leave` itself: when the forward
    # raises, torch calls an always_call hook while iterating the module's forward hooks, and removing it there
    # ("OrderedDict mutated during iteration") would replace the model's own error.
    def enter(*_: Any) -> None:
        if state["done"]:
            before.remove()
            after.remove()
        if state["entered"]:  # a later forward (or one inside the first): not watched
            return
        state["entered"] = True
        mode.__enter__()

    def leave(*_: Any) -> None:
        if state["done"] or not state["entered"]:
            return
        state["done"] = True
        mode.__exit__(None, None, None)
        if calls:
            info["attention"] = calls.most_common(1)[0][0]
            info["attention_source"] = "first forward"
            info["attention_calls"] = dict(calls)
        elif "attention" not in info:  # an MLP, or a kernel outside torch: nothing to say it runs one
            info["attention_source"] = NONE_SEEN
        seen()

    before = model.register_forward_pre_hook(enter)
    after = model.register_forward_hook(leave, always_call=True)


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
    extras = {key: info[key] for key, kind in (("attention", str), ("attention_dropout", bool),
                                               ("tied_embeddings", bool), ("experts", int),
                                               ("experts_per_token", int)) if isinstance(info.get(key), kind)}
    if extras.get("attention") not in ATTENTIONS:
        extras.pop("attention", None)
    experts = max(int(extras.get("experts", 1)), 1)
    extras["experts"] = experts
    extras["experts_per_token"] = min(max(int(extras.get("experts_per_token", 1)), 1), experts)
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
    def shape(ffn: int) -> ModelShape:
        return ModelShape(name, layers, hidden, heads, vocab, seq, ffn_hidden=ffn, kv_heads=kv_heads, **extras)

    # The count is linear in the MLP width (every expert's MLP included): solve it for the model's count.
    one, two = shape(1).params, shape(2).params
    ffn = (n - one) // (two - one) + 1
    return shape(max(int(ffn), 1))


def describe(info: dict[str, Any]) -> str:
    """How the model runs, in words, for the console and the report: attention, experts, embeddings, dtype."""
    attention = info.get("attention") or "sdpa"
    source = {"first forward": "seen in the first forward", "config": "the model's config"}.get(
        info.get("attention_source") or "", info.get("attention_source") or "assumed: nothing showed it")
    words = {"eager": "eager (s x s scores kept)", "math": "SDPA on torch's math kernel (s x s scores kept in fp32)",
             "sdpa": "fused SDPA", "flash": "flash"}
    if info.get("attention_source") == NONE_SEEN and not info.get("attention"):
        parts = ["no attention seen in the first forward (no s x s scores priced)"]
    elif info.get("attention_source") == NO_MODULE and not info.get("attention"):  # its first forward not seen
        parts = ["no attention seen (no attention module in the model; no s x s scores priced)"]
    else:
        parts = [f"attention {words.get(attention, attention)} ({source})"
                 + (", with dropout" if info.get("attention_dropout") and attention in ("eager", "math") else "")]
    if int(info.get("experts") or 1) > 1:
        parts.append(f"{info['experts']} experts ({info.get('experts_per_token', 1)} per token)")
    if info.get("tied_embeddings") is not None:
        parts.append("tied embeddings" if info["tied_embeddings"] else "untied embeddings")
    if info.get("dtype"):
        parts.append(f"parameters in {info['dtype']}")
    return ", ".join(parts)
