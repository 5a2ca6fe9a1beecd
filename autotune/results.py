"""TrialResult: the record of one trial (ARCHITECTURE.md section 3), one JSON line of trials.jsonl or of a
replay surface."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from autotune.config import Config

STATUSES = ("ok", "oom", "unsupported", "timeout", "crash", "pruned")
FAILURES = ("oom", "unsupported", "timeout", "crash")
BACKENDS = ("deepspeed", "simulated", "replay")


@dataclass(frozen=True)
class TrialResult:
    config: Config
    status: str
    throughput_samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    peak_memory_bytes: int | None = None
    memory_budget_bytes: int | None = None
    wall_time_s: float = 0.0
    backend: str = "simulated"
    error: str | None = None
    # Further keys of the JSON line (e.g. predicted_peak_bytes, peak_memory_growth_bytes, step_time_iqr_s,
    # log_dir): kept flat in the JSON and round-tripped unchanged.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: allowed {list(STATUSES)}")
        if self.status == "ok" and not (self.throughput_samples_per_s or 0) > 0:
            raise ValueError("an ok result needs a positive throughput_samples_per_s")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    # The measured values where the caller already knows they exist: throughput for an ok result (every ok
    # result has one), peak memory and step time for a result that measured them. Any other is a bug of
    # the caller, raised here instead of surfacing later as a None in arithmetic.
    @property
    def throughput(self) -> float:
        """throughput_samples_per_s of a result that ran."""
        if self.throughput_samples_per_s is None:
            raise ValueError(f"a {self.status} result of {self.config.label()} has no throughput")
        return self.throughput_samples_per_s

    @property
    def peak_bytes(self) -> int:
        """peak_memory_bytes of a result that measured it."""
        if self.peak_memory_bytes is None:
            raise ValueError(f"a {self.status} result of {self.config.label()} has no measured peak memory")
        return self.peak_memory_bytes

    @property
    def step_time(self) -> float:
        """step_time_s of a result that measured it."""
        if self.step_time_s is None:
            raise ValueError(f"a {self.status} result of {self.config.label()} has no measured step time")
        return self.step_time_s

    def fits(self, budget_bytes: int | None) -> bool:
        """Ran and stayed within `budget_bytes` (no budget: ran)."""
        if not self.ok:
            return False
        return budget_bytes is None or self.peak_memory_bytes is None or self.peak_memory_bytes <= budget_bytes

    def under_budget(self, budget_bytes: int | None) -> "TrialResult":
        """This result as a search with `budget_bytes` sees it: a peak over budget is an `oom`."""
        if self.ok and not self.fits(budget_bytes):
            return replace(self, status="oom", throughput_samples_per_s=None, tokens_per_s=None,
                           memory_budget_bytes=budget_bytes,
                           error=f"peak {self.peak_memory_bytes} bytes exceeds the budget of {budget_bytes} bytes")
        return replace(self, memory_budget_bytes=budget_bytes) if budget_bytes != self.memory_budget_bytes else self

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config.to_dict()}
        for f in fields(self):
            if f.name not in ("config", "extra"):
                out[f.name] = getattr(self, f.name)
        out.update(self.extra)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, default=_finite)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrialResult":
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["config"] = Config.from_dict(dict(data["config"]))
        return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def from_json(cls, line: str) -> "TrialResult":
        return cls.from_dict(json.loads(line))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"{value!r} is not JSON serialisable")


def read_results(path: str | Path) -> list[TrialResult]:
    """Every complete line of a JSONL file; a torn last line (a crash mid-write) is ignored."""
    return list(iter_results(path))


def iter_results(path: str | Path) -> Iterator[TrialResult]:
    path = Path(path)
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield TrialResult.from_json(line)
        except (json.JSONDecodeError, KeyError, ValueError) as err:
            if number == len(lines) and not line.endswith("\n"):
                return  # torn final write
            raise ValueError(f"{path}:{number}: not a TrialResult: {err}") from None


def append_result(path: str | Path, result: TrialResult) -> None:
    """Append one line and fsync it, so that a result once reported survives any crash after."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_torn_tail(path)
    with path.open("a") as out:
        out.write(result.to_json() + "\n")
        out.flush()
        os.fsync(out.fileno())


def _drop_torn_tail(path: Path) -> None:
    """A crash mid-write leaves a last line without its newline: that result was never complete."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)


def write_results(path: str | Path, results: Iterable[TrialResult]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(r.to_json() + "\n" for r in results))
    tmp.replace(path)
