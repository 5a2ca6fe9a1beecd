"""What is being trained: a transformer's shape, the global batch and the data-parallel size."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from autotune.values.argtypes import whole
from autotune.values.config import ConfigError
from autotune.values.models import load_model
# The shape and its presets live in autotune.values.shapes; they are importable from here as they always were.
from autotune.values.shapes import ARCHITECTURES, POSITIONS, PRESETS, ModelShape, preset, with_seq_len  # noqa: F401

DEFAULT_GLOBAL_BATCH = {"tiny": 16}


def accumulation(global_batch: int, micro_batch: int, ranks: int) -> int | None:
    """Gradient accumulation steps that run `global_batch` at `micro_batch` on `ranks` ranks: global_batch /
    (micro_batch * ranks) if that is a positive integer, else None. The one check of whether a micro-batch
    divides a global batch (the space, the trials' DeepSpeed keys, scale-down and a script's batch use it)."""
    per_step = micro_batch * ranks
    if per_step <= 0 or global_batch % per_step:
        return None
    return global_batch // per_step


def divisors(number: int) -> list[int]:
    """Every whole number from 1 that divides `number`, ascending."""
    return [d for d in range(1, number + 1) if number % d == 0]


def micro_batch_divisors(global_batch: int, ranks: int) -> list[int]:
    """Every micro-batch that keeps `global_batch` on `ranks` ranks (a positive whole accumulation)."""
    if global_batch % ranks:
        return []
    return [m for m in divisors(global_batch // ranks) if accumulation(global_batch, m, ranks)]


@dataclass(frozen=True)
class Workload:
    """One training job: `gpus` data-parallel ranks share `global_batch` samples per optimizer step."""

    model: ModelShape
    global_batch: int
    gpus: int = 1

    def __post_init__(self) -> None:
        for key in ("global_batch", "gpus"):
            value = whole(getattr(self, key))  # any integer type (numpy's np.int64), kept as an int: json writes it
            if value is None or value <= 0:
                raise ConfigError(f"{key}={getattr(self, key)!r}: must be a positive integer")
            object.__setattr__(self, key, value)

    def grad_accumulation(self, micro_batch: int) -> int | None:
        """global_batch / (micro_batch * gpus) if that is a positive integer, else None."""
        return accumulation(self.global_batch, micro_batch, self.gpus)

    def with_(self, **changes: Any) -> "Workload":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "global_batch": self.global_batch, "gpus": self.gpus}

    @classmethod
    def from_dict(cls, data: Any) -> "Workload":
        """The workload `to_dict` wrote; ConfigError naming what is not (this reads run.json and surfaces)."""
        if not isinstance(data, dict) or "model" not in data or "global_batch" not in data:
            raise ConfigError(f"{repr(data)[:80]}: expected an object with model, global_batch and gpus")
        model = data["model"]
        if isinstance(model, str):
            shape = preset(model)
        elif isinstance(model, dict):
            names = [f.name for f in fields(ModelShape)]
            unknown = [key for key in model if key not in names]
            missing = [key for key in names[:6] if key not in model]  # name, layers, hidden, heads, vocab, seq_len
            if unknown or missing:
                raise ConfigError(f"model: {'unknown key ' + repr(unknown[0])[:40] if unknown else 'missing ' + missing[0]}:"
                                  f" allowed keys {', '.join(names)}")
            shape = ModelShape(**model)
        else:
            raise ConfigError(f"model {repr(model)[:80]}: expected a preset name or a shape object")
        return cls(shape, data["global_batch"], data.get("gpus", 1))


def make_workload(model: str | ModelShape, global_batch: int | None = None, gpus: int = 1,
                  seq_len: int | None = None) -> Workload:
    """A workload of a model given as a shape or as text: a preset name, a Hugging Face config.json or model
    directory, a Hub id in the local cache, or a YAML/JSON shape file (autotune.values.models.load_model).
    `seq_len` replaces the model's sequence length."""
    if isinstance(model, ModelShape):
        shape = with_seq_len(model, seq_len)
        default_batch = None
    else:
        shape = load_model(model, seq_len)
        default_batch = DEFAULT_GLOBAL_BATCH.get(model)
    if global_batch is None:
        global_batch = default_batch or 8 * gpus * 4
    return Workload(shape, global_batch, gpus)
