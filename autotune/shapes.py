"""The transformer shapes the estimator counts: ModelShape, and the built-in presets.

(autotune.models reads a shape from a name, a file or a directory; autotune.workload adds the batch and the
data-parallel size. Both build on this module, which imports neither.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from autotune.config import ConfigError

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
             "norms_per_layer", "experts", "experts_per_token", "attention", "attention_dropout")


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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"model name={str(self.name)[:80]!r}: must be a non-empty string")
        for key in ("layers", "hidden", "heads", "vocab", "seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {key}={value!r}: must be a positive integer")
        for key in ("ffn_hidden", "kv_heads", "head_dim", "max_positions"):
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
        if not isinstance(self.attention_dropout, bool):
            raise ConfigError(f"model attention_dropout={self.attention_dropout!r}: must be true or false")
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

    @property
    def q_dim(self) -> int:
        """Width of the attention's queries and output: heads x head_dim (hidden unless head_dim is set)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.experts > 1

    @property
    def norm_params(self) -> int:
        """One norm: LayerNorm's weight and bias (gpt), RMSNorm's weight (llama)."""
        return 2 * self.hidden if self.arch == "gpt" else self.hidden

    @property
    def attention_params(self) -> int:
        h, q, qkv = self.hidden, self.q_dim, self.q_dim + 2 * self.kv_dim
        return h * qkv + (qkv if self.qkv_bias else 0) + q * h + (h if self.arch == "gpt" else 0)

    @property
    def expert_params(self) -> int:
        """One MLP (one expert of a MoE layer)."""
        h, f = self.hidden, self.ffn_hidden
        if self.arch == "gpt":
            return (h * f + f) + (f * h + h)
        return 3 * h * f

    def _layer(self, mlps: int) -> int:
        router = self.hidden * self.experts if self.moe else 0
        return self.attention_params + mlps * self.expert_params + router + self.norms_per_layer * self.norm_params

    @property
    def layer_params(self) -> int:
        """Every parameter of one layer, all experts included (what the model states hold)."""
        return self._layer(self.experts)

    @property
    def active_layer_params(self) -> int:
        """The parameters of one layer that one token goes through (FLOPs): the routed experts only."""
        return self._layer(self.experts_per_token)

    @property
    def embedding_params(self) -> int:
        """Input embedding, learned positions and (if untied) the output head."""
        n = self.vocab * self.hidden + self.max_positions * self.hidden
        if not self.tied_embeddings:
            n += self.vocab * self.hidden
        return n + (self.vocab if self.lm_head_bias else 0)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.norm_params

    @property
    def largest_module_params(self) -> int:
        """The biggest single weight tensor's module: what ZeRO-3 must gather whole at once."""
        h, f, q = self.hidden, self.ffn_hidden, self.q_dim
        return max(self.vocab * h, 3 * h * q + 3 * q, h * f + f)

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
