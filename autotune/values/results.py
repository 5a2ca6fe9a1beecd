"""TrialResult: the record of one trial (ARCHITECTURE.md section 3), one JSON line of trials.jsonl or of a
replay surface.

`TrialResult.from_dict` is the one check of a line's shape: every field's type and range, and the known
extra keys the tool reads back (workload, hardware, trial, predicted_peak_bytes, ...); anything else is a
ConfigError naming the field. `iter_results` adds the file and line. Appends go through
`autotune.files.append_line` (fsync'd, never through a symlink), after `repair_tail` has made sure the
file ends with a complete line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from autotune.values.config import Config, ConfigError
from autotune.files import append_line, parse_json, read_text, short, write_atomic
from autotune.values.units import format_size
from autotune.values.workload import Workload

# untrained: the trial ran but its record does not show training (every optimizer step skipped by fp16's loss
# scaler, a loss not finite, or one that never moved): its figures measure no real training step (TRAINING_FAULTS).
STATUSES = ("ok", "oom", "unsupported", "timeout", "crash", "pruned", "untrained")
FAILURES = ("oom", "unsupported", "timeout", "crash", "untrained")
OVERFLOW, NONFINITE, FLAT = "overflow", "nonfinite", "flat"
TRAINING_FAULTS = (OVERFLOW, NONFINITE, FLAT)  # an untrained result's `fault`
# DeepSpeed's DynamicLossScaler.update_scale, on an overflow at its minimum scale (raise_error_at_min_scale).
SCALER_AT_MINIMUM = "Current loss scale already at minimum"
STDERR_TAIL = "; last lines of stderr:"  # where a trial's error quotes its rank's stderr (autotune.trials.runner)
MAX_BYTES = 2**63 - 1  # byte counts are int64 wherever they are stored (SQLite, numpy)
# What steers the tuner's logic from a result's extra keys, typed (TrialResult.phase, .repeat_of, .cause) and
# checked whenever a result is made, not only when one is read back. The JSON line is unchanged: they stay flat
# keys beside the others, so records written before and after load alike.
SEARCH, CONFIRM = "search", "confirm"
PHASES = (SEARCH, CONFIRM)  # a search trial, or a repeat of confirmation (autotune.search.confirm)
# What a failed or pruned result ran out of (autotune.search.pruning.CAUSES describes each).
DEVICE_MEMORY, HOST_MEMORY, NVME_SPACE, VALUE = "device_memory", "host_memory", "nvme_space", "value"
CAUSE_NAMES = (DEVICE_MEMORY, HOST_MEMORY, NVME_SPACE, VALUE)


# A trial's figures as trackers log them (MLflow's metrics, W&B's summary; autotune.outputs): its measurement, what
# it was launched on, and the evidence that its steps trained (optimizer steps applied and skipped, first/last loss)
TRACKED_FIGURES = ("throughput_samples_per_s", "tokens_per_s", "peak_memory_bytes", "step_time_s", "wall_time_s",
                   "predicted_peak_bytes", "predicted_throughput_samples_per_s", "chance_of_better",
                   "steps_applied", "steps_skipped", "loss_first", "loss_last")


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
            raise ConfigError(f"status={short(self.status)}: allowed {', '.join(STATUSES)}")
        if self.status == "ok" and not (self.throughput_samples_per_s or 0) > 0:
            raise ConfigError("an ok result needs a positive throughput_samples_per_s")
        for name in _STEERING.keys() & self.extra.keys():
            check, allowed = _STEERING[name]
            _checked(name, self.extra[name], check, allowed)

    # The extra keys that steer logic, typed.
    @property
    def phase(self) -> str:
        """SEARCH, or CONFIRM for a repeat of a config already run (`extra["phase"]`, absent: search)."""
        return str(self.extra.get("phase") or SEARCH)

    @property
    def repeat_of(self) -> int | None:
        """A repeat's trial number of the config's first run (`extra["repeat_of"]`), else None."""
        value = self.extra.get("repeat_of")
        return None if value is None else int(value)

    @property
    def cause(self) -> str | None:
        """What the result ran out of, as recorded (`extra["cause"]`: CAUSE_NAMES), else None
        (autotune.search.pruning.cause_of also reads it from older records' messages)."""
        value = self.extra.get("cause")
        return None if value is None else str(value)

    @property
    def global_batch(self) -> int | None:
        """The global batch a script trial ran (`extra["global_batch"]`: the script's own, when kept), else None:
        the workload's."""
        value = self.extra.get("global_batch")
        return None if value is None else int(value)

    @property
    def script_model(self) -> dict[str, Any] | None:
        """What a script trial learned of its model (`extra["script_model"]`, autotune.script.shim), else None."""
        return self.extra.get("script_model")

    @property
    def runs(self) -> int | None:
        """Confirmed: how many launches the throughput is the median of (`extra["runs"]`), else None."""
        value = self.extra.get("runs")
        return None if value is None else int(value)

    @property
    def throughput_runs(self) -> tuple[float, ...]:
        """Confirmed: each launch's throughput (`extra["throughput_runs"]`), else ()."""
        return tuple(self.extra.get("throughput_runs") or ())

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
                           error=f"peak {_sizes(self.peak_memory_bytes, budget_bytes)} exceeds the budget of "
                                 f"{_sizes(budget_bytes, self.peak_memory_bytes)}")
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
    def from_dict(cls, data: Any) -> "TrialResult":
        """A result from its JSON object; ConfigError naming the first field that is not allowed."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{short(data)}: expected a JSON object with config, status, ...")
        if "config" not in data or "status" not in data:
            raise ConfigError(f"missing {'config' if 'config' not in data else 'status'}: a result needs config and "
                              "status")
        raw_config = data["config"]
        if not isinstance(raw_config, dict):
            raise ConfigError(f"config: {short(raw_config)}: expected an object of knobs")
        try:
            config = Config.from_dict(raw_config)
        except ConfigError as err:
            raise ConfigError(f"config: {err}") from None
        known = {f.name for f in fields(cls)} - {"extra", "config"}
        kwargs: dict[str, Any] = {}
        for name in known & set(data):
            check, allowed = _FIELDS[name]
            kwargs[name] = _checked(name, data[name], check, allowed)
        extra = {k: v for k, v in data.items() if k not in known and k != "config"}
        for name in _EXTRAS.keys() & extra.keys():
            check, allowed = _EXTRAS[name]
            extra[name] = _checked(name, extra[name], check, allowed)
        return cls(config=config, **kwargs, extra=extra)

    @classmethod
    def from_json(cls, line: str) -> "TrialResult":
        return cls.from_dict(parse_json(line, "a trial result", "a JSON object"))


def error_line(error: str | None) -> str:
    """A trial's error as one line: its first, without the announcement of the stderr lines after it."""
    line = error.strip().splitlines()[0] if error and error.strip() else "unknown"
    return line.removesuffix(STDERR_TAIL)


def _checked(name: str, value: Any, check: Any, allowed: str) -> Any:
    try:
        ok, value = check(value)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ConfigError(f"{name}: {short(value)}: allowed {allowed}")
    return value


def _number(value: Any) -> tuple[bool, Any]:
    """A finite number >= 0, as a float (JSON has no int/float distinction worth keeping here)."""
    if value is None:
        return True, None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False, value
    number = float(value)
    return math.isfinite(number) and number >= 0, number


def _bytes(value: Any) -> tuple[bool, Any]:
    """A whole number of bytes, 0..MAX_BYTES (an integral float such as 1e9 is taken as the integer)."""
    if value is None:
        return True, None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return False, value
    return 0 <= value <= MAX_BYTES, value


def _count(value: Any) -> tuple[bool, Any]:
    if value is None:
        return True, None
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BYTES, value


def _text(value: Any) -> tuple[bool, Any]:
    return value is None or isinstance(value, str), value


def _name(value: Any) -> tuple[bool, Any]:
    return isinstance(value, str) and bool(value), value


def _workload(value: Any) -> tuple[bool, Any]:
    """A workload as Workload.to_dict() writes it (a surface's lines carry theirs)."""
    if value is None:
        return True, None
    try:
        Workload.from_dict(value)
    except ConfigError as err:
        raise ConfigError(f"workload: {err}") from None
    return True, value


_NUMBER = "a number >= 0 or null"
_BYTES = f"a whole number of bytes 0..{MAX_BYTES} or null"
_FIELDS: dict[str, tuple[Any, str]] = {
    "status": (lambda v: (isinstance(v, str), v), ", ".join(STATUSES)),
    "throughput_samples_per_s": (_number, _NUMBER),
    "tokens_per_s": (_number, _NUMBER),
    "step_time_s": (_number, _NUMBER),
    "peak_memory_bytes": (_bytes, _BYTES),
    "memory_budget_bytes": (_bytes, _BYTES),
    "wall_time_s": (lambda v: _number(v) if v is not None else (False, v), "a number >= 0"),
    "backend": (_name, "a backend name"),
    "error": (_text, "a string or null"),
}
# Extra keys the tool reads back (report, plots, progress, replay, recording); others pass through unchecked.
_EXTRAS: dict[str, tuple[Any, str]] = {
    "trial": (_count, "a trial number or null"),
    "chance_of_better": (_number, _NUMBER),  # autotune.search.convergence: after this search trial
    "better_margin": (_number, _NUMBER),
    "expected_gain": (_number, _NUMBER),  # and the stop in seconds' (--train-for)
    "gain_per_trial_s": (_number, _NUMBER),
    "predicted_peak_bytes": (_number, _NUMBER),
    "peak_memory_growth_bytes": (lambda v: (v is None or _number(abs(v))[0], v), "a number or null"),
    "baseline_memory_bytes": (_number, _NUMBER),
    "step_time_iqr_s": (_number, _NUMBER),
    "launch_to_first_step_s": (_number, _NUMBER),
    "steps_measured": (_count, "a whole number or null"),
    "stop_reason": (_text, "a string or null"),
    "log_dir": (_text, "a string or null"),
    "node_ip": (_text, "a string or null"),
    "hardware": (_text, "a hardware profile name or null"),
    "recorded_backend": (_text, "a string or null"),
    "script_verdict": (_text, "a string or null"),
    "workload": (_workload, "a workload object {model, global_batch, gpus} or null"),
    # What the trial's optimizer steps did (autotune.worker.training): every trial since issue 40 records them.
    "steps_applied": (_count, "a whole number or null"),
    "steps_skipped": (_count, "a whole number or null"),
    "recorded_status": (_text, "a string or null"),
}
# Extra keys that steer logic (TrialResult.phase, .repeat_of, .cause, .global_batch, .script_model, .runs,
# .throughput_runs): checked when a result is made.
_STEERING: dict[str, tuple[Any, str]] = {
    "phase": (lambda v: (v is None or v in PHASES, v), f"{', '.join(PHASES)} or null"),
    "repeat_of": (lambda v: (v is None or (_count(v)[0] and v >= 1), v), "a trial number >= 1 or null"),
    "cause": (lambda v: (v is None or v in CAUSE_NAMES, v), f"{', '.join(CAUSE_NAMES)} or null"),
    "global_batch": (lambda v: (v is None or (_count(v)[0] and v >= 1), v), "a global batch >= 1 or null"),
    "script_model": (lambda v: (v is None or isinstance(v, dict), v), "an object or null"),
    "runs": (lambda v: (v is None or (_count(v)[0] and v >= 1), v), "a number of launches >= 1 or null"),
    "fault": (lambda v: (v is None or v in TRAINING_FAULTS, v), f"{', '.join(TRAINING_FAULTS)} or null"),
    "throughput_runs": (lambda v: (v is None or (isinstance(v, list)
                                                 and all(x is not None and _number(x)[0] for x in v)), v),
                        "a list of throughputs or null"),
}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"{value!r} is not JSON serialisable")


def as_recorded_proves(result: TrialResult) -> TrialResult:
    """`result` as its own record shows it. An ok result written before trials counted their optimizer steps (no
    `steps_applied`) whose loss never moved (`loss_first == loss_last`) skipped every step, as every fp16 trial on a
    GPU did before issue 40 (benchmarks/gpu-runs): its throughput is that of steps without an update and its peak
    lacks the optimizer's state. It is read as `untrained` (fault `overflow`), the recorded status kept beside it
    (`recorded_status`), so that nothing replays, calibrates on or recommends it; anything else is returned as is."""
    extra = result.extra
    first, last = extra.get("loss_first"), extra.get("loss_last")
    if "steps_applied" in extra:
        return result
    if result.ok and first is not None and first == last:
        error = (f"recorded as ok before ds-autotune checked that trials train: its loss never moved ({first:g} at "
                 "the first and the last step), so every optimizer step was skipped (an fp16 loss scaler's "
                 "overflows) and its figures measure no training")
    elif result.status == "crash" and SCALER_AT_MINIMUM in (result.error or ""):
        error = f"recorded as a crash: every step overflowed until the fp16 loss scaler gave up ({SCALER_AT_MINIMUM})"
    else:
        return result
    return replace(result, status="untrained", throughput_samples_per_s=None, tokens_per_s=None, error=error,
                   extra={**extra, "fault": OVERFLOW, "recorded_status": result.status})


def relabelled(results: Iterable[TrialResult]) -> int:
    """How many of `results` were read as untrained though recorded otherwise (as_recorded_proves)."""
    return sum(r.status == "untrained" and r.extra.get("recorded_status") is not None for r in results)


def _sizes(num_bytes: int | None, other: int | None) -> str:
    """`num_bytes` in binary units, its exact bytes added where `other` rounds to the same figure."""
    shown = format_size(num_bytes)
    return f"{shown} ({num_bytes:,} bytes)" if num_bytes is not None and shown == format_size(other) else shown


def relabel_note(count: int, source: str | Path) -> str | None:
    """The one line a reader of `source` tells the user when `count` of its results were relabelled, else None."""
    if not count:
        return None
    return (f"{source}: {count} fp16 trial(s) recorded before ds-autotune checked training skipped every optimizer step "
            "(the loss scaler's overflows): read as untrained, not as measurements")


def read_results(path: str | Path) -> list[TrialResult]:
    """Every complete line of a JSONL file; a torn last line (a crash mid-write) is ignored."""
    return list(iter_results(path))


def iter_results(path: str | Path) -> Iterator[TrialResult]:
    """The results of a JSONL file (none if it does not exist), each as its record proves it (as_recorded_proves). A
    last line without its newline that is not complete JSON is a write cut short and is left out; any other bad
    line is a ConfigError naming file:line and the field."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    lines = read_text(path, "a JSONL file of trial results").splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if number == len(lines) and _torn(line):
            return  # torn final write (torn_tail says so)
        data = parse_json(line, f"{path}:{number}", "one JSON object per line (a trial result)")
        try:
            result = TrialResult.from_dict(data)
        except ConfigError as err:
            raise ConfigError(f"{path}:{number}: not a trial result: {err}") from None
        yield as_recorded_proves(result)


def torn_tail(path: str | Path) -> str | None:
    """The one line a reader of `path` tells the user when iter_results left its last line out (a write cut short:
    no newline and not complete JSON), else None. `repair_tail` moves such a line aside before an append."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    lines = read_text(path, "a JSONL file of trial results").splitlines(keepends=True)
    if not lines or not _torn(lines[-1]):
        return None
    return (f"{path}:{len(lines)}: an incomplete last line ({len(lines[-1])} characters, a write cut short) was "
            "left out; the results before it are read")


def _torn(last_line: str) -> bool:
    return bool(last_line.strip()) and not last_line.endswith("\n") and not _complete_json(last_line)


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def append_result(path: str | Path, result: TrialResult) -> None:
    """Append one line and fsync it, so that a result once reported survives any crash after."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    repair_tail(path)
    append_line(path, result.to_json())


def repair_tail(path: str | Path) -> str | None:
    """Make `path` end with a complete line before anything is appended to it.

    A last line without its newline that is complete JSON is a record whose newline was lost (a file
    truncated by one byte, an editor): it is kept and the newline added. One that is not (a write cut
    short by a crash) is moved to `<path>.torn-<n>` and cut off; the returned line says so. None when
    there was nothing to repair."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        if os.path.islink(path):
            raise ConfigError(f"{path} is a symbolic link: refusing to write through it (remove it)") from None
        raise ConfigError(f"{path}: cannot be opened for appending ({err.strerror or err})") from None
    with os.fdopen(fd, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return None
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return None
        handle.seek(0)
        data = handle.read()
        start = data.rfind(b"\n") + 1
        tail = data[start:]
        try:
            complete = _complete_json(tail.decode("utf-8"))
        except UnicodeDecodeError:
            complete = False
        if complete:
            handle.seek(size)
            handle.write(b"\n")
            handle.flush()
            os.fsync(handle.fileno())
            return None
        aside = _free_name(path, "torn")
        write_atomic(aside, tail)
        handle.truncate(start)
        handle.flush()
        os.fsync(handle.fileno())
    line = data.count(b"\n", 0, start) + 1
    return (f"{path}:{line}: an incomplete last line ({len(tail)} bytes, a write cut short) was moved to {aside}; "
            "the results before it are kept")


def _free_name(path: Path, tag: str) -> Path:
    n = 1
    while os.path.lexists(path.with_name(f"{path.name}.{tag}-{n}")):
        n += 1
    return path.with_name(f"{path.name}.{tag}-{n}")


def write_results(path: str | Path, results: Iterable[TrialResult]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(r.to_json() + "\n" for r in results))
