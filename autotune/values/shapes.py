"""The transformer shapes the estimator counts: ModelShape, and the built-in presets.

(autotune.values.models reads a shape from a name, a file or a directory; autotune.values.workload adds the batch and the
data-parallel size. Both build on this module, which imports neither.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from autotune.values.config import ConfigError

ARCHITECTURES = ("gpt", "llama")
POSITIONS = ("learned", "rotary")
# How attention runs: "sdpa" and "flash" keep no s x s scores (fused kernels: the estimator's default);
# "eager" materialises them and keeps the softmax output for backward (and, with attention dropout, its mask
# and output): Korthikanti et al.'s 5as/h term per token and layer; "math" is SDPA on torch's math kernel (on
# the CPU whenever dropout_p > 0): the scores in fp32 whatever the model's dtype, and dropout's mask in fp32.
ATTENTIONS = ("sdpa", "eager", "flash", "math")
# Fields added after the first nine; to_dict() writes each only where it differs from its default, so the
# dicts of every shape that could be written before (presets, surfaces, run.json files) stay the same.
_EXTENDED = ("head_dim", "tied_embeddings", "positions", "max_positions", "qkv_bias", "lm_head_bias",
             "norms_per_layer", "experts", "experts_per_token", "attention", "attention_dropout", "qk_norm",
             "q_lora_rank", "kv_lora_rank", "rope_head_dim", "v_head_dim", "dense_layers", "dense_ffn_hidden",
             "shared_ffn_hidden", "shared_gate")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer.

    `gpt` family: LayerNorm, biases, GELU MLP of `ffn_hidden`; by default learned positions and tied
    embeddings (GPT-2). `llama` family: RMSNorm, no biases, gated (SwiGLU/GeGLU) MLP, grouped KV heads; by
    default rotary positions and untied embeddings. Per-model variations on top of the family:
    `head_dim` (0: hidden / heads; Gemma's is wider), `tied_embeddings`, `positions` (`learned` or
    `rotary`: GPT-NeoX and Phi-2 are the gpt family with rotary positions), `max_positions` (rows of a learned
    position table; 0: seq_len), `qkv_bias` (Qwen2), `lm_head_bias` (Phi-2), `norms_per_layer` (1: one norm
    shared by parallel attention and MLP, Phi-2; 4: Gemma 2's pre and post norms), and `experts` /
    `experts_per_token` (a Mixtral-style MoE MLP: a router and `experts` MLPs of `ffn_hidden`, each token
    through `experts_per_token` of them), `attention` (how it runs: `sdpa` / `flash`, fused, the default, or
    `eager`, its s x s scores materialised; `math`: SDPA on torch's math kernel, materialised in fp32) and `attention_dropout` (dropout on the attention probabilities in
    training: an eager attention then keeps its mask and output too). None / 0 / "" mean the family's default.

    Today's families (2025-26 configs), all default off: `qk_norm` (an RMSNorm of head_dim on each query and
    key head: Qwen3, Gemma 3); multi-head latent attention when `kv_lora_rank` > 0 (DeepSeek-V2/V3, arXiv
    2405.04434 section 2.1): keys and values come up from a latent of `kv_lora_rank` per token, queries from
    one of `q_lora_rank` (0: projected directly), `head_dim` is a query/key head (qk_nope_head_dim +
    `rope_head_dim`, the decoupled rotary part, one key head shared by all heads) and `v_head_dim` a value head;
    and for a MoE, `dense_layers` of its layers with a dense MLP of `dense_ffn_hidden` (0: ffn_hidden;
    DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers) and an always-on shared expert MLP of
    `shared_ffn_hidden` (0: none), behind a sigmoid gate when `shared_gate` (Qwen2-MoE).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int = 0  # 0: 4 * hidden
    kv_heads: int = 0  # 0: heads
    arch: str = "gpt"
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool | None = None  # None: gpt ties, llama does not
    positions: str = ""  # "": learned for gpt, rotary for llama
    max_positions: int = 0  # learned positions' table rows; 0: seq_len
    qkv_bias: bool | None = None  # None: gpt has biases, llama has none
    lm_head_bias: bool = False
    norms_per_layer: int = 2
    experts: int = 1
    experts_per_token: int = 1
    attention: str = "sdpa"
    attention_dropout: bool = False
    qk_norm: bool = False
    q_lora_rank: int = 0  # MLA's query latent; 0: queries projected from hidden directly
    kv_lora_rank: int = 0  # > 0: multi-head latent attention
    rope_head_dim: int = 0  # MLA: the rotary part of head_dim
    v_head_dim: int = 0  # MLA: a value head's width; 0: head_dim
    dense_layers: int = 0  # MoE: layers whose MLP is dense
    dense_ffn_hidden: int = 0  # their MLP width; 0: ffn_hidden
    shared_ffn_hidden: int = 0  # MoE: the shared experts' MLP width, every token through it; 0: none
    shared_gate: bool = False  # MoE: the shared MLP's output scaled by a sigmoid gate (hidden -> 1)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"model name={str(self.name)[:80]!r}: must be a non-empty string")
        for key in ("layers", "hidden", "heads", "vocab", "seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {key}={value!r}: must be a positive integer")
        for key in ("ffn_hidden", "kv_heads", "head_dim", "max_positions", "q_lora_rank", "kv_lora_rank",
                    "rope_head_dim", "v_head_dim", "dense_layers", "dense_ffn_hidden", "shared_ffn_hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"model {key}={value!r}: must be a positive integer (0: the default)")
        for key in ("norms_per_layer", "experts", "experts_per_token"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {key}={value!r}: must be a positive integer")
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"model arch={self.arch!r}: allowed {list(ARCHITECTURES)}")
        gpt = self.arch == "gpt"
        for key in ("tied_embeddings", "qkv_bias", "lm_head_bias"):
            value = getattr(self, key)
            if value is None and key != "lm_head_bias":
                object.__setattr__(self, key, gpt)
            elif not isinstance(value, bool):
                raise ConfigError(f"model {key}={value!r}: must be true or false")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"model attention={self.attention!r}: allowed {list(ATTENTIONS)}")
        for key in ("attention_dropout", "qk_norm", "shared_gate"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"model {key}={getattr(self, key)!r}: must be true or false")
        if not self.positions:
            object.__setattr__(self, "positions", "learned" if gpt else "rotary")
        if self.positions not in POSITIONS:
            raise ConfigError(f"model positions={self.positions!r}: allowed {list(POSITIONS)}")
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ConfigError(f"model hidden={self.hidden} is not divisible by heads={self.heads}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.heads % self.kv_heads:
            raise ConfigError(f"model heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.positions == "learned":
            if self.max_positions == 0:
                object.__setattr__(self, "max_positions", self.seq_len)
            if self.max_positions < self.seq_len:
                raise ConfigError(f"model seq_len={self.seq_len} is longer than its learned position table "
                                  f"(max_positions={self.max_positions})")
        else:
            object.__setattr__(self, "max_positions", 0)
        if self.experts_per_token > self.experts:
            raise ConfigError(f"model experts_per_token={self.experts_per_token} is more than experts={self.experts}")
        self._check_latent_attention()
        self._check_moe_layers()

    def _check_latent_attention(self) -> None:
        if not self.mla:
            for key in ("q_lora_rank", "rope_head_dim", "v_head_dim"):
                if getattr(self, key):
                    raise ConfigError(f"model {key}={getattr(self, key)}: needs kv_lora_rank > 0 (multi-head "
                                      "latent attention)")
            return
        if self.arch != "llama":
            raise ConfigError(f"model kv_lora_rank={self.kv_lora_rank}: multi-head latent attention needs arch "
                              f"llama, not {self.arch!r}")
        if not 0 < self.rope_head_dim < self.head_dim:
            raise ConfigError(f"model rope_head_dim={self.rope_head_dim}: must be positive and less than "
                              f"head_dim={self.head_dim} (multi-head latent attention)")
        if self.kv_heads != self.heads:
            raise ConfigError(f"model kv_heads={self.kv_heads}: multi-head latent attention has one key and "
                              f"value per head (kv_heads = heads = {self.heads})")

    def _check_moe_layers(self) -> None:
        if self.moe:
            if self.dense_layers >= self.layers:
                raise ConfigError(f"model dense_layers={self.dense_layers}: must be less than layers={self.layers} "
                                  "(a MoE needs a MoE layer)")
            return
        for key in ("dense_layers", "dense_ffn_hidden", "shared_ffn_hidden", "shared_gate"):
            if getattr(self, key):
                raise ConfigError(f"model {key}={getattr(self, key)!r}: needs experts > 1 (a mixture of experts)")

    @property
    def q_dim(self) -> int:
        """Width of the attention's queries: heads x head_dim (hidden unless head_dim is set)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def o_dim(self) -> int:
        """Width of the attention's output (the o-projection's input): heads x the value head."""
        return self.heads * (self.v_head_dim or self.head_dim)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        return self.experts > 1

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def norm_params(self) -> int:
        """One norm: LayerNorm's weight and bias (gpt), RMSNorm's weight (llama)."""
        return 2 * self.hidden if self.arch == "gpt" else self.hidden

    @property
    def attention_params(self) -> int:
        h, q = self.hidden, self.q_dim
        if self.mla:
            # DeepSeek-V2 section 2.1.2-2.1.3 (modeling_deepseek's DeepseekV2Attention): hidden -> query latent
            # (normed) -> queries, or hidden -> queries; hidden -> KV latent + the shared rotary key; KV latent
            # (normed) -> each head's non-rotary key and its value; values -> hidden.
            ql, kvl, rope = self.q_lora_rank, self.kv_lora_rank, self.rope_head_dim
            queries = (h * ql + ql + ql * q) if ql else h * q
            keys_values = h * (kvl + rope) + kvl + kvl * (q - self.heads * rope + self.o_dim)
            return queries + keys_values + self.o_dim * h + self._qk_norm_params
        qkv = q + 2 * self.kv_dim
        return (h * qkv + (qkv if self.qkv_bias else 0) + q * h + (h if self.arch == "gpt" else 0)
                + self._qk_norm_params)

    @property
    def _qk_norm_params(self) -> int:
        return 2 * self.head_dim * (2 if self.arch == "gpt" else 1) if self.qk_norm else 0

    def _mlp(self, width: int) -> int:
        h = self.hidden
        return (h * width + width) + (width * h + h) if self.arch == "gpt" else 3 * h * width

    @property
    def expert_params(self) -> int:
        """One MLP (one expert of a MoE layer)."""
        return self._mlp(self.ffn_hidden)

    def _layer(self, mlps: int) -> int:
        router = self.hidden * self.experts if self.moe else 0
        # The shared experts: one MLP every token goes through (DeepSeekMoE, arXiv 2401.06066 section 3.2).
        shared = (self._mlp(self.shared_ffn_hidden) if self.shared_ffn_hidden else 0) + self.hidden * self.shared_gate
        return (self.attention_params + mlps * self.expert_params + router + shared
                + self.norms_per_layer * self.norm_params)

    @property
    def layer_params(self) -> int:
        """Every parameter of one (MoE) layer, all experts included (what the model states hold)."""
        return self._layer(self.experts)

    @property
    def active_layer_params(self) -> int:
        """The parameters of one (MoE) layer that one token goes through (FLOPs): the routed experts only."""
        return self._layer(self.experts_per_token)

    @property
    def dense_layer_params(self) -> int:
        """One of a MoE's dense layers (its MLP of dense_ffn_hidden)."""
        return (self.attention_params + self._mlp(self.dense_ffn_hidden or self.ffn_hidden)
                + self.norms_per_layer * self.norm_params)

    @property
    def active_layers_params(self) -> int:
        """What one token goes through in all the layers together."""
        return (self.layers - self.dense_layers) * self.active_layer_params + self.dense_layers * self.dense_layer_params

    @property
    def embedding_params(self) -> int:
        """Input embedding, learned positions and (if untied) the output head."""
        n = self.vocab * self.hidden + self.max_positions * self.hidden
        if not self.tied_embeddings:
            n += self.vocab * self.hidden
        return n + (self.vocab if self.lm_head_bias else 0)

    @property
    def params(self) -> int:
        layers = (self.layers - self.dense_layers) * self.layer_params + self.dense_layers * self.dense_layer_params
        return layers + self.embedding_params + self.norm_params

    @property
    def active_params(self) -> int:
        """Parameters less the routed experts a token skips: a MoE's "activated parameters" as Mixtral and
        Qwen publish them (embeddings included; DeepSeek's figures leave out the input embedding)."""
        return self.active_layers_params + self.embedding_params + self.norm_params

    @property
    def largest_module_params(self) -> int:
        """The biggest single weight tensor's module: what ZeRO-3 must gather whole at once."""
        h, f, q = self.hidden, self.ffn_hidden, self.q_dim
        dense = self.dense_ffn_hidden if self.dense_layers else 0
        return max(self.vocab * h, 3 * h * q + 3 * q, h * f + f, h * dense, h * self.shared_ffn_hidden,
                   self.o_dim * h)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        own_head_dim = self.hidden % self.heads != 0  # then head_dim is needed to read the dict back
        defaults = ModelShape(self.name, self.layers, self.hidden, self.heads, self.vocab, self.seq_len,
                              self.ffn_hidden, self.kv_heads, self.arch,
                              head_dim=self.head_dim if own_head_dim else 0)
        for key in _EXTENDED:
            if data[key] == getattr(defaults, key) and not (key == "head_dim" and own_head_dim):
                del data[key]
        return data


# What the built-in trial model (autotune.worker.model) builds: the norms of a layer it has (1: Phi-2's parallel
# block; 2: pre-norms; 4: Gemma 2's pre and post norms).
BUILT_IN_NORMS = (1, 2, 4)


def untrained_reason(shape: ModelShape) -> str | None:
    """What of this shape the built-in trial model (autotune.worker.model) does not build, as a phrase ("a mixture
    of experts (8 experts, 2 per token)"), or None when it builds it. The estimator counts every shape; only real
    trials of the built-in model need this: `autotune tune` and sweep files refuse such a model up front with the
    deepspeed backend (autotune.api.refuse_untrained), and a trial that gets one anyway is `unsupported` (the worker)."""
    missing = []
    if shape.moe:
        missing.append(f"a mixture of experts ({shape.experts} experts, {shape.experts_per_token} per token)")
    if shape.mla:
        missing.append(f"multi-head latent attention (kv_lora_rank={shape.kv_lora_rank})")
    if shape.norms_per_layer not in BUILT_IN_NORMS:
        missing.append(f"norms_per_layer={shape.norms_per_layer} (the built-in model builds "
                       f"{', '.join(map(str, BUILT_IN_NORMS[:-1]))} or {BUILT_IN_NORMS[-1]})")
    return " with ".join(missing) or None


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 50257, seq: int = 1024) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, vocab, seq)


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int, kv: int = 0, seq: int = 2048) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, 32000, seq, ffn_hidden=ffn, kv_heads=kv, arch="llama")


PRESETS: dict[str, ModelShape] = {
    # Trains in seconds on two CPU cores; big enough that activations and model states are measurable.
    "tiny": ModelShape("tiny", layers=4, hidden=256, heads=4, vocab=4096, seq_len=256),
    "gpt2-small": _gpt("gpt2-small", 12, 768, 12),
    "gpt2-medium": _gpt("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt("gpt2-large", 36, 1280, 20),
    "gpt2-xl": _gpt("gpt2-xl", 48, 1600, 25),
    "llama-1b": _llama("llama-1b", 22, 2048, 32, 5632, kv=4),
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 11008),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 13824),
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 28672, kv=8, seq=4096),
}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}: allowed {sorted(PRESETS)}") from None


def with_seq_len(shape: ModelShape, seq_len: int | None) -> ModelShape:
    """The shape at another sequence length (None: as it is); a learned position table grows to fit it."""
    if seq_len is None or seq_len == shape.seq_len:
        return shape
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ConfigError(f"seq_len={seq_len!r}: must be a positive integer")
    if shape.positions == "learned":
        return replace(shape, seq_len=seq_len, max_positions=max(shape.max_positions, seq_len))
    return replace(shape, seq_len=seq_len)
