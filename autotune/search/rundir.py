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
so a killed tuner never leaves the directory locked, and a second live tuner is refused at once; `busy()` asks
without taking it (a shared lock for an instant), so that a command can name the holder before it does anything. The lock
file is opened without following a symlink and never through a second hard link (autotune.files.open_lock):
a planted `.lock -> victim` is refused, the victim untouched. Taking the lock repairs the end of
`trials.jsonl` (autotune.values.results.repair_tail) before anything is appended; `notes` says what was repaired.

The lock, atomic writes and fsync'd appends are `RunFolder`'s, which the run directory of a policy's
training (autotune/rl/train.py TrainingRun) shares; what the two hold differs.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, TypeVar

from autotune.values.argtypes import given_path
from autotune.values.config import ConfigError, first_line
from autotune.files import append_line, disk_full, load_json, open_lock, short, write_atomic
from autotune.values.results import TrialResult, append_result, read_results, repair_tail
from autotune.values.settings import SETTINGS, RunSettings
from autotune.search.study_storage import SQLITE_HEADER, open_storage, study_name

if TYPE_CHECKING:
    import optuna

TRIALS = "trials.jsonl"
STUDY = "study.db"
LOCK = ".lock"
BUDGET = "budget"  # run.json's key of the last session's budget (RunDir.record_budget)
SWEEP_COPY = "sweep.yaml"  # a sweep file as its sweep directory keeps it: each workload's run directory is inside


class RunDirBusy(ConfigError):
    """Another tuner holds the run directory."""


R = TypeVar("R", bound="RunFolder")


class RunFolder:
    """What every run directory shares (a sweep's RunDir, a policy training run's autotune.rl.train.TrainingRun):
    a lock held by one process for the whole run, atomic writes, and appends that survive a crash."""

    holder = "process"  # who holds the lock, as the refusal names it: "in use by another <holder>"

    def __init__(self, path: str | Path) -> None:
        # `~` expanded as every path the library takes (docs/python.md); RunDir(5) is one line, not pathlib's TypeError
        self.path = given_path(path, f"{type(self).__name__} path", "a folder's path (str or pathlib.Path)")
        self.notes: list[str] = []  # what taking the lock repaired (a torn record moved aside), for the caller to say

    @contextmanager
    def locked(self: R) -> Iterator[R]:
        """Hold the directory for one process; a second one gets RunDirBusy at once."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = open_lock(self.path / LOCK)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode("utf-8", "replace").strip() or "unknown"
                raise RunDirBusy(f"{self.path} is in use by another {self.holder} (pid {holder}); "
                                 "wait for it to finish or choose another --out") from None
            os.ftruncate(fd, 0)  # ours now: open_lock refused a symlink or a second hard link
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                self.repair()
                yield self
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def busy(self) -> str | None:
        """The pid of the process that holds the directory now ('unknown' if it wrote none), or None when no process
        holds it. Nothing is created or written: a folder without a lock file is free."""
        try:
            fd = os.open(self.path / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:  # absent (never held), or not a file a lock can be: locked() says which when it is taken
            return None
        try:
            try:  # shared, for an instant: a holder's exclusive lock refuses it; nobody else's is held
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.pread(fd, 64, 0).decode("utf-8", "replace").strip() or "unknown"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def repair(self) -> None:
        """Make the directory's append-only files whole before anything is appended (under the lock)."""

    def write_text(self, name: str, text: str) -> Path:
        """Write atomically (a crash leaves the old file or the new one, never half of one), durably."""
        path = self.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, text)

    def write_json(self, name: str, data: Any) -> Path:
        """Write atomically (a crash leaves the old file or the new one, never half of one)."""
        return self.write_text(name, json.dumps(data, indent=2) + "\n")

    def read_json(self, name: str) -> Any:
        """The JSON file's data, None if there is no such file; ConfigError naming it if it is not JSON."""
        path = self.path / name
        return load_json(path) if os.path.lexists(path) else None

    def append_line(self, name: str, line: str) -> None:
        """Append one line and fsync it (the file is an append-only record); never through a symlink."""
        append_line(self.path / name, line)


def check_study_file(path: Path) -> None:
    """A run directory's study.db, before SQLite opens it: absent, or a regular file that is an SQLite database
    (or empty: SQLite makes one of it). A symbolic link is refused (SQLite would write through it, to whatever
    it points at), as is anything else (a folder, a FIFO, a file of other data: SQLite's "file is not a
    database" would come mid-sweep); a one-line ConfigError naming the file."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err}): expected the sweep's Optuna study") from None
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(f"{path} is a symbolic link: refusing to open the sweep's Optuna study through it (remove "
                          "it, or name a shared database with --storage sqlite:///PATH)")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path}: not a regular file: expected the sweep's Optuna study (an SQLite database)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            head = os.read(fd, len(SQLITE_HEADER))
        finally:
            os.close(fd)
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err}): expected the sweep's Optuna study") from None
    if head and head != SQLITE_HEADER:
        raise ConfigError(f"{path}: not an SQLite database (it starts {head[:8]!r}): expected the sweep's Optuna "
                          "study; move it aside to resume without it")


READ_ONLY = "attempt to write a readonly database"  # SQLite's words (SQLITE_READONLY)


def check_study_writable(path: Path) -> None:
    """A run directory's study.db, its SQLite journal files and its folder writable by this process (SQLite writes
    -wal and -shm files beside it), before a sweep's first write: else a one-line ConfigError naming the file, not
    SQLite's "attempt to write a readonly database" wrapped by Optuna mid-sweep. An absent file is fine."""
    for name in (path.name, f"{path.name}-wal", f"{path.name}-shm"):
        target = path.with_name(name)
        if os.path.lexists(target) and not os.access(target, os.W_OK, effective_ids=True):
            raise ConfigError(f"{target}: read-only ({READ_ONLY}): the sweep writes its Optuna study there; make it "
                              f"writable (chmod u+w {target}) or move {path.name} aside to resume without it")
    if not os.access(path.parent, os.W_OK | os.X_OK, effective_ids=True):
        raise ConfigError(f"{path.parent}: read-only folder ({READ_ONLY}): SQLite writes {path.name}'s journal "
                          "beside it; make the run directory writable")


def read_only_named(err: BaseException, path: str) -> ConfigError | None:
    """The one-line ConfigError of a write refused by a read-only database (SQLite's words anywhere in `err`'s
    chain: Optuna wraps them as "An exception is raised during the commit"), naming `path`; None for another
    error."""
    seen: BaseException | None = err
    while seen is not None:
        if READ_ONLY in str(seen):
            return ConfigError(f"{path}: read-only ({READ_ONLY}): the sweep writes its Optuna study there; make it "
                               "writable, or move it aside to resume without it")
        seen = seen.__cause__ or seen.__context__
    return None


class RunDir(RunFolder):
    """A sweep's run directory."""

    holder = "tuner"

    trials_path = property(lambda self: self.path / TRIALS)
    settings_path = property(lambda self: self.path / SETTINGS)
    study_path = property(lambda self: self.path / STUDY)
    logs_dir = property(lambda self: self.path / "logs")
    plots_dir = property(lambda self: self.path / "plots")

    def storage(self, url: str | None = None) -> "optuna.storages.BaseStorage":
        """The run's Optuna storage: the one the sweep names (`url`, autotune.search.study_storage), or by default
        study.db here (SQLite, WAL, synchronous=NORMAL)."""
        import optuna

        if url is not None:
            return open_storage(url)

        check_study_file(self.study_path)
        if self.path.exists():  # a new run directory is made below
            check_study_writable(self.study_path)
        path = self.study_path.resolve()

        def connect() -> sqlite3.Connection:
            connection = sqlite3.connect(path, timeout=30)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            return connection

        self.path.mkdir(parents=True, exist_ok=True)
        from sqlalchemy.exc import DatabaseError

        try:
            return optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"creator": connect})
        except DatabaseError as err:  # a damaged database past its header; a full disk is the CLI's to name
            if disk_full(err) is not None:
                raise
            raise ConfigError(f"{self.study_path}: not a usable SQLite database ({first_line(err.orig or err)}): "
                              f"expected the sweep's Optuna study; move it aside to resume without it") from None

    def study_name(self, url: str | None = None) -> str:
        """The name of the sweep's study in its storage (autotune.search.study_storage): the one run.json recorded
        when the sweep began, so that a sweep resumed on another host (a container's new hostname) or from a
        moved directory goes on in its own study; else the name a new sweep takes here."""
        data = self.read_json(SETTINGS) if url is not None else None
        if isinstance(data, dict) and "study" in data:  # absent from run.json before the name was recorded
            if not isinstance(data["study"], str) or not data["study"]:
                raise ConfigError(f"{self.settings_path}: study: {short(data['study'])}: allowed a study name")
            return data["study"]
        return study_name(self.path, url)

    @property
    def sweep_dir(self) -> Path | None:
        """The sweep directory of `autotune sweep` this run directory is a workload of (it keeps the sweep file),
        else None: a workload is continued through its sweep."""
        return self.path.parent if (self.path.parent / SWEEP_COPY).is_file() else None

    def resume_hint(self) -> str:
        """How to continue this sweep: its own command, or its sweep's for a workload of one."""
        if self.sweep_dir is not None:
            return f"continue it with the same `autotune sweep` command and --resume --out {self.sweep_dir}"
        return f"continue it with the same command and --resume --out {self.path} (resume=True from Python)"

    def exists(self) -> bool:
        """Holds a sweep (settings or trials), as opposed to an empty or absent folder."""
        return self.settings_path.exists() or self.trials_path.exists()

    def repair(self) -> None:
        note = repair_tail(self.trials_path)
        if note:
            self.notes.append(note)

    def results(self) -> list[TrialResult]:
        return read_results(self.trials_path)

    def append(self, result: TrialResult) -> None:
        append_result(self.trials_path, result)

    def read_settings(self) -> RunSettings:
        if not os.path.lexists(self.settings_path):
            raise ConfigError(f"{self.path} is not a run directory: no {SETTINGS}")
        data = load_json(self.settings_path, "the run settings a sweep wrote (JSON)")
        return RunSettings.from_dict(data, str(self.settings_path))

    def write_settings(self, settings: RunSettings, budget: Mapping[str, Any] | None = None) -> None:
        """A new sweep's run.json: its settings and, in a storage the user named, its study's name; `budget`: its
        session's (record_budget)."""
        study = {} if settings.storage is None else {"study": self.study_name(settings.storage)}
        self.write_json(SETTINGS, {**settings.to_dict(), **study, **({BUDGET: dict(budget)} if budget else {})})

    def record_budget(self, budget: Mapping[str, Any]) -> None:
        """run.json's `budget`: the trials, time and stop rules of the session that began last (TuneSpec's names),
        which `autotune tune --resume` takes where no flag sets them. Not a setting: a resume may change it."""
        data = self.read_json(SETTINGS)
        if isinstance(data, dict) and data.get(BUDGET) != budget:
            self.write_json(SETTINGS, {**data, BUDGET: dict(budget)})

    def recorded_budget(self) -> dict[str, Any]:
        """The budget of the session that began last ({} where run.json has none: a sweep from before it)."""
        data = self.read_json(SETTINGS)
        budget = data.get(BUDGET) if isinstance(data, dict) else None
        return dict(budget) if isinstance(budget, dict) else {}

