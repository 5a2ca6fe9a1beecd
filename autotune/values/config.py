"""The knobs of a DeepSpeed memory configuration (ARCHITECTURE.md section 2) as one value."""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

from autotune.errors import ConfigError as ConfigError  # where the library's callers have always found it
from autotune.files import short

ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "fp16", "bf16")
OFFLOADS = ("none", "cpu", "nvme")
KNOBS = ("zero_stage", "micro_batch", "ckpt_interval", "precision", "offload_optimizer", "offload_param")


def first_line(err: BaseException) -> str:
    """An exception's message cut to its first line (its type's name if it has none), for a one-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(frozen=True, order=True)
class Config:
    zero_stage: int
    micro_batch: int
    ckpt_interval: int
    precision: str
    offload_optimizer: str = "none"
    offload_param: str = "none"

    def __post_init__(self) -> None:
        for name in ("zero_stage", "micro_batch", "ckpt_interval"):
            value = getattr(self, name)
            if type(value) is int:  # the common case, on every config a space or episode makes
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ConfigError(f"{name}={value!r}: must be an integer")
            object.__setattr__(self, name, int(value))  # numpy's integers as Python's: hashed, compared, dumped alike
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"zero_stage={self.zero_stage!r}: allowed {list(ZERO_STAGES)}")
        if self.micro_batch < 1:
            raise ConfigError(f"micro_batch={self.micro_batch!r}: must be a positive integer")
        if self.ckpt_interval < 0:
            raise ConfigError(f"ckpt_interval={self.ckpt_interval!r}: must be 0 (off) or a positive integer")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}: allowed {list(PRECISIONS)}")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOADS:
                raise ConfigError(f"{name}={getattr(self, name)!r}: allowed {list(OFFLOADS)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        if not isinstance(data, dict):
            raise ConfigError(f"config {short(data)}: allowed an object of its knobs {list(KNOBS)}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown config key(s) {sorted(unknown)}: allowed {list(KNOBS)}")
        missing = [k for k in KNOBS[:4] if k not in data]
        if missing:
            raise ConfigError(f"config is missing {missing}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"config {short(text)}: not JSON ({first_line(err)}): allowed an object of its knobs "
                              f"{list(KNOBS)}") from None
        return cls.from_dict(data)

    def label(self) -> str:
        """Short human-readable form for tables and plots."""
        parts = [f"z{self.zero_stage}", f"mb{self.micro_batch}", f"ck{self.ckpt_interval}", self.precision]
        if self.offload_optimizer != "none":
            parts.append(f"oo={self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"op={self.offload_param}")
        return " ".join(parts)
