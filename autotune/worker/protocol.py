"""The files through which the runner and a trial's ranks talk, inside the trial's log directory.

runner -> ranks: `spec.json` (WorkerSpec).
ranks -> runner: `rank<r>.events.jsonl` (one line per phase entered, with the pid: the runner learns the
ranks' pids and where a hung trial stopped) and `rank<r>.json` (the rank's report: measurements, or a
structured failure with its status). Nothing here is read from free text such as stderr.
A phase may be recorded again with more detail: `build_ops` once per C++ op (`op`, and `building` when it
must be compiled first), `measure` after each measured step (`step`). `describe_phase` turns rank 0's
latest event into what the live progress line shows.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from autotune.values.config import Config
from autotune.files import write_atomic
from autotune.worker.device import ACCELERATORS
from autotune.worker.measure import MeasureSettings
from autotune.values.workload import Workload

SPEC = "spec.json"
PHASES = ("start", "build_ops", "dist_init", "build", "initialize", "warmup", "measure", "done")
# What a person reads for each phase (the worker's and the script shim's, which adds `script`).
PHASE_LABELS = {"start": "starting", "build_ops": "loading ops", "dist_init": "initializing (distributed)",
                "build": "initializing (model)", "initialize": "initializing (DeepSpeed engine)",
                "script": "running the script", "warmup": "warming up", "measure": "measuring", "done": "finishing"}
# Failure statuses a rank reports itself; `timeout` and the watchdog's `oom` are the runner's verdicts.
RANK_FAILURES = ("oom", "unsupported", "crash", "untrained")
# Injected by tests: `hang`: the rank (and a child it starts) hangs before importing torch; `overflow[:N]`: the first
# N optimizer steps' gradients (every step's without N) overflow, as a model whose fp16 gradients overflow.
FAULTS = ("hang", "overflow")


@dataclass(frozen=True)
class WorkerSpec:
    config: Config
    workload: Workload
    ds_config: Mapping[str, Any]
    log_dir: str
    measure: MeasureSettings = MeasureSettings()
    memory_budget_bytes: int | None = None  # CUDA: the allocator's cap; CPU: enforced by the runner's watchdog
    seed: int = 0
    launch_time: float = 0.0  # time.time() when the runner launched the trial
    fault: str | None = None
    # py-cpuinfo's answer for this machine, computed once by the tuner: DeepSpeed's op builders ask for
    # it twice per op load, through a subprocess each time (~3 s per trial otherwise).
    cpu_info: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # DeepSpeed's accelerator the ranks must run on, from the hardware profile (Hardware.accelerator): the
    # runner sets it in the ranks' environment, each rank checks it got it (autotune.worker.device).
    accelerator: str = "cpu"

    def __post_init__(self) -> None:
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator={self.accelerator!r}: allowed {list(ACCELERATORS)}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = self.config.to_dict()
        out["workload"] = self.workload.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WorkerSpec":
        values = dict(data)
        values["config"] = Config.from_dict(values["config"])
        values["workload"] = Workload.from_dict(values["workload"])
        values["measure"] = MeasureSettings(**values.get("measure", {}))
        return cls(**values)

    def write(self) -> Path:
        path = Path(self.log_dir) / SPEC
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def read(cls, path: str | Path) -> "WorkerSpec":
        return cls.from_dict(json.loads(Path(path).read_text()))


def report_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.json"


def events_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.events.jsonl"


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Write then rename: a reader never sees half a file, even if the writer is killed."""
    write_atomic(path, json.dumps(data, allow_nan=False))


def record_phase(log_dir: str | Path, rank: int, phase: str, **info: Any) -> None:
    line = json.dumps({"t": time.time(), "phase": phase, "pid": os.getpid(), **info})
    with events_path(log_dir, rank).open("a") as out:
        out.write(line + "\n")


def read_events(log_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    path = events_path(log_dir, rank)
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written as we read
    return events


# The worker's phases as its events mark their starts (autotune.worker.main), and the `phases_s` key of each one's
# seconds: from one event to the next.
PHASE_KEYS = (("start", "import_s"), ("build_ops", "build_ops_s"), ("dist_init", "dist_init_s"), ("build", "build_s"),
              ("initialize", "initialize_s"), ("warmup", "warmup_s"), ("measure", "measure_s"))


def phases_from_events(events: list[dict[str, Any]], launch_time: float | None) -> dict[str, float]:
    """A rank's `phases_s` as its events show them: each phase that ended (the next began) and, from the trial's
    launch, its spawn; for a rank stopped from outside (past the memory budget, a timeout), which reports none."""
    starts: dict[str, float] = {}
    for event in events:
        starts.setdefault(event.get("phase", ""), float(event["t"]))  # a phase's first event is its start
    phases = {"spawn_s": starts["start"] - launch_time} if launch_time and "start" in starts else {}
    for (phase, key), (following, _) in zip(PHASE_KEYS, PHASE_KEYS[1:]):
        if phase in starts and following in starts:
            phases[key] = starts[following] - starts[phase]
    return phases


def read_report(log_dir: str | Path, rank: int) -> dict[str, Any] | None:
    path = report_path(log_dir, rank)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def describe_phase(events: list[dict[str, Any]]) -> str | None:
    """The latest event of a rank as a person reads it: 'building ops (cpu_adam)', 'measuring (step 4)';
    None before the rank recorded anything."""
    if not events:
        return None
    last = events[-1]
    phase = str(last.get("phase"))
    label = PHASE_LABELS.get(phase, phase)
    if phase == "build_ops" and last.get("op"):
        label = f"{'building' if last.get('building') else 'loading'} ops ({last['op']})"
    elif phase == "measure" and last.get("step"):
        label += f" (step {last['step']})"
    return label


def current_phase(log_dir: str | Path, rank: int = 0) -> str | None:
    """describe_phase of a running trial's rank (rank 0 by default)."""
    return describe_phase(read_events(log_dir, rank))
