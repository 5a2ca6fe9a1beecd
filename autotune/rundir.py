"""The run directory of a sweep (ARCHITECTURE.md section 3): `run.json` (the sweep's settings), `trials.jsonl`
(append-only, every trial in order), the Optuna study, the outputs, `logs/<trial>/`, and a lock.

Optuna storage: SQLite through RDBStorage (`study.db`). Every ask and tell is one SQLite transaction,
all-or-nothing even when the process is SIGKILLed mid-write, and SQLite's locks are kernel locks that
die with the process. The database runs in WAL mode with synchronous=NORMAL: a commit survives any
crash of the process (only a power loss can drop the last commits, and then `trials.jsonl`, fsync'd per
line, is the record the resumed study is reconciled with), and it skips the ~10 ms fsync per commit that
the default mode pays about twenty times per trial. Optuna's JournalStorage on a file was the
alternative: it survives a crash too, but its file lock (a symlink or an exclusively created file)
outlives a SIGKILLed holder, and the next tuner has to wait out a grace period or have it removed.

Lock: `fcntl.flock` on `.lock`, held for the whole sweep. The kernel drops it when the holder dies,
so a killed tuner never leaves the directory locked, and a second live tuner is refused at once.

The lock, atomic writes and fsync'd appends are `RunFolder`'s, which the run directory of a policy's
training (autotune/rl/train.py TrainingRun) shares; what the two hold differs.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

from autotune.config import ConfigError
from autotune.hardware import Hardware
from autotune.results import TrialResult, append_result, read_results
from autotune.search_spaces import parse_choices
from autotune.space import Choices, Space
from autotune.workload import Workload

if TYPE_CHECKING:
    import optuna

SETTINGS = "run.json"
TRIALS = "trials.jsonl"
STUDY = "study.db"
LOCK = ".lock"


class RunDirBusy(ConfigError):
    """Another tuner holds the run directory."""


@dataclass(frozen=True)
class RunSettings:
    """What defines a sweep: a resumed sweep must be started with the same settings."""

    workload: Workload
    hardware: Hardware
    memory_budget_bytes: int
    strategy: str
    backend: str
    seed: int
    choices: Choices
    surface: str | None = None

    def space(self) -> Space:
        return Space(self.choices, self.workload, self.hardware)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload.to_dict(), "hardware": self.hardware.to_dict(),
                "memory_budget_bytes": self.memory_budget_bytes, "strategy": self.strategy,
                "backend": self.backend, "seed": self.seed, "space": self.choices.to_dict(),
                "surface": self.surface}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSettings":
        return cls(workload=Workload.from_dict(data["workload"]), hardware=Hardware(**data["hardware"]),
                   memory_budget_bytes=int(data["memory_budget_bytes"]), strategy=data["strategy"],
                   backend=data["backend"], seed=int(data["seed"]),
                   choices=parse_choices(data["space"], SETTINGS), surface=data.get("surface"))

    def differences(self, other: "RunSettings") -> list[str]:
        """`key: this != other` for every setting that differs."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{key}: {theirs[key]!r} != {mine[key]!r}" for key in mine if mine[key] != theirs[key]]


R = TypeVar("R", bound="RunFolder")


class RunFolder:
    """What every run directory shares (a sweep's RunDir, a policy training run's autotune.rl.train.TrainingRun):
    a lock held by one process for the whole run, atomic writes, and appends that survive a crash."""

    holder = "process"  # who holds the lock, as the refusal names it: "in use by another <holder>"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @contextmanager
    def locked(self: R) -> Iterator[R]:
        """Hold the directory for one process; a second one gets RunDirBusy at once."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / LOCK, "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                raise RunDirBusy(f"{self.path} is in use by another {self.holder} (pid {holder}); "
                                 "wait for it to finish or choose another --out") from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            try:
                yield self
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def write_text(self, name: str, text: str) -> Path:
        """Write atomically (a crash leaves the old file or the new one, never half of one)."""
        path = self.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        return path

    def write_json(self, name: str, data: Any) -> Path:
        """Write atomically (a crash leaves the old file or the new one, never half of one)."""
        return self.write_text(name, json.dumps(data, indent=2) + "\n")

    def read_json(self, name: str) -> Any:
        """The JSON file's data, None if there is no such file."""
        path = self.path / name
        return json.loads(path.read_text()) if path.is_file() else None

    def append_line(self, name: str, line: str) -> None:
        """Append one line and fsync it (the file is an append-only record)."""
        with open(self.path / name, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


class RunDir(RunFolder):
    """A sweep's run directory."""

    holder = "tuner"

    trials_path = property(lambda self: self.path / TRIALS)
    settings_path = property(lambda self: self.path / SETTINGS)
    study_path = property(lambda self: self.path / STUDY)
    logs_dir = property(lambda self: self.path / "logs")
    plots_dir = property(lambda self: self.path / "plots")

    def storage(self) -> "optuna.storages.RDBStorage":
        """The run's Optuna storage (SQLite, WAL, synchronous=NORMAL)."""
        import optuna

        path = self.study_path.resolve()

        def connect() -> sqlite3.Connection:
            connection = sqlite3.connect(path, timeout=30)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            return connection

        self.path.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"creator": connect})

    def exists(self) -> bool:
        """Holds a sweep (settings or trials), as opposed to an empty or absent folder."""
        return self.settings_path.exists() or self.trials_path.exists()

    def results(self) -> list[TrialResult]:
        return read_results(self.trials_path)

    def append(self, result: TrialResult) -> None:
        append_result(self.trials_path, result)

    def read_settings(self) -> RunSettings:
        if not self.settings_path.exists():
            raise ConfigError(f"{self.path} is not a run directory: no {SETTINGS}")
        try:
            return RunSettings.from_dict(json.loads(self.settings_path.read_text()))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(f"{self.settings_path}: not valid run settings: {err}") from None

    def write_settings(self, settings: RunSettings) -> None:
        self.write_json(SETTINGS, settings.to_dict())

    def trial_log_dir(self, number: int) -> Path:
        return self.logs_dir / f"{number:04d}"

