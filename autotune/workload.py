"""What is being trained: a transformer's shape, the global batch and the data-parallel size."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from autotune.config import ConfigError

ARCHITECTURES = ("gpt", "llama")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer.

    `gpt`: learned positions, tied embeddings, biases, LayerNorm, GELU MLP of `ffn_hidden`.
    `llama`: rotary positions, untied embeddings, no biases, RMSNorm, SwiGLU MLP, grouped KV heads.
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

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model {key}={value!r}: must be a positive integer")
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"model arch={self.arch!r}: allowed {list(ARCHITECTURES)}")
        if self.hidden % self.heads:
            raise ConfigError(f"model hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.heads % self.kv_heads:
            raise ConfigError(f"model heads={self.heads} is not divisible by kv_heads={self.kv_heads}")

    @property
    def kv_dim(self) -> int:
        return self.hidden * self.kv_heads // self.heads

    @property
    def layer_params(self) -> int:
        h, f = self.hidden, self.ffn_hidden
        if self.arch == "gpt":
            return (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return h * h + 2 * h * self.kv_dim + h * h + 3 * h * f + 2 * h

    @property
    def embedding_params(self) -> int:
        """Input embedding, positions and (if untied) the output head."""
        if self.arch == "gpt":
            return self.vocab * self.hidden + self.seq_len * self.hidden
        return 2 * self.vocab * self.hidden

    @property
    def params(self) -> int:
        final_norm = 2 * self.hidden if self.arch == "gpt" else self.hidden
        return self.layers * self.layer_params + self.embedding_params + final_norm

    @property
    def largest_module_params(self) -> int:
        """The biggest single weight tensor's module: what ZeRO-3 must gather whole at once."""
        h, f = self.hidden, self.ffn_hidden
        return max(self.vocab * h, 3 * h * h + 3 * h, h * f + f)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
DEFAULT_GLOBAL_BATCH = {"tiny": 16}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}: allowed {sorted(PRESETS)}") from None


@dataclass(frozen=True)
class Workload:
    """One training job: `gpus` data-parallel ranks share `global_batch` samples per optimizer step."""

    model: ModelShape
    global_batch: int
    gpus: int = 1

    def __post_init__(self) -> None:
        for key in ("global_batch", "gpus"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key}={value!r}: must be a positive integer")

    def grad_accumulation(self, micro_batch: int) -> int | None:
        """global_batch / (micro_batch * gpus) if that is a positive integer, else None."""
        per_step = micro_batch * self.gpus
        if per_step <= 0 or self.global_batch % per_step:
            return None
        return self.global_batch // per_step

    def with_(self, **changes: Any) -> "Workload":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "global_batch": self.global_batch, "gpus": self.gpus}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Workload":
        model = data["model"]
        shape = preset(model) if isinstance(model, str) else ModelShape(**model)
        return cls(shape, int(data["global_batch"]), int(data.get("gpus", 1)))


def make_workload(model: str, global_batch: int | None = None, gpus: int = 1) -> Workload:
    shape = preset(model)
    if global_batch is None:
        global_batch = DEFAULT_GLOBAL_BATCH.get(model, 8 * gpus * 4)
    return Workload(shape, global_batch, gpus)


