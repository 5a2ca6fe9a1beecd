"""Where a sweep's Optuna study lives (`autotune tune --storage`, TuneSpec.storage).

Default: `study.db` in the run directory (autotune.search.rundir). A storage the user names puts the study in a
shared place instead, so that one optuna-dashboard or `optuna` CLI reads the studies of many sweeps; the
run directory still holds everything else (run.json, trials.jsonl, outputs, logs).

Accepted: an SQLAlchemy URL that Optuna's RDBStorage opens (`sqlite:///PATH`, `postgresql://USER:PASS@HOST/DB`,
`mysql+pymysql://USER:PASS@HOST/DB`, with the database's driver installed), or the path of an Optuna journal
file (JournalFileBackend; created if absent, in a folder that exists). An existing database must be empty or
Optuna's: another application's is refused before RDBStorage would add its tables to it (`_check_tables`). A
relative SQLite or journal path is made absolute, so that a resumed sweep started elsewhere opens the same file. A
URL's password is never written to the run directory: run.json and the report show it masked.

Study name: `autotune` in the run directory's own study.db (one study per file). In a storage the user
names, one study per sweep, named after the host and the run directory (`autotune <host>:<path>`) when it
begins and recorded in its run.json (`study`): sweeps sharing a database never share a study, and a resumed
sweep finds its own even on another host or from a moved directory. A new sweep whose study already exists
there is refused rather than mixed into it.
"""

from __future__ import annotations

import json
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from autotune.values.config import ConfigError, first_line
from autotune.values.settings import is_url, masked

if TYPE_CHECKING:
    import optuna

ALLOWED = ("an Optuna RDB URL (sqlite:///PATH, postgresql://USER:PASS@HOST/DB, mysql+pymysql://USER:PASS@HOST/DB) "
           "or the path of an Optuna journal file")
LOCAL_STUDY = "autotune"  # the study's name in the run directory's own study.db
SQLITE_HEADER = b"SQLite format 3\x00"


def _refuse(storage: str, why: str) -> ConfigError:
    return ConfigError(f"storage {masked(storage)!r}: {why}; allowed: {ALLOWED}")


def canonical(storage: str) -> str:
    """The storage as the sweep records it (syntax checked, local paths absolute); ConfigError if it is not
    one the tuner can use. Opens nothing (open_storage does)."""
    text = storage.strip()
    if not text:
        raise _refuse(storage, "empty")
    if is_url(text):
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(text)
        except ArgumentError:
            raise _refuse(storage, "not a database URL") from None
        if url.get_backend_name() != "sqlite":
            return text
        if url.database in (None, "", ":memory:"):
            raise _refuse(storage, "an in-memory SQLite database keeps nothing for a resumed sweep or a dashboard")
        path = Path(url.database).expanduser().resolve()
        if not path.parent.is_dir():
            raise _refuse(storage, f"folder {path.parent} does not exist")
        return url.set(database=str(path)).render_as_string(hide_password=False)
    path = Path(text).expanduser().resolve()
    if path.is_dir():
        raise _refuse(storage, "a folder, not a journal file")
    if not path.parent.is_dir():
        raise _refuse(storage, f"folder {path.parent} does not exist")
    if path.is_file():
        try:
            with open(path, "rb") as f:
                head = f.readline()
        except OSError as err:
            raise _refuse(storage, f"cannot be read ({err.strerror or type(err).__name__})") from None
        if head.startswith(SQLITE_HEADER):
            raise _refuse(storage, f"an SQLite database: pass sqlite:///{path}")
        if head.strip() and not _is_journal_line(head):
            raise _refuse(storage, "an existing file that is not an Optuna journal")
    return str(path)


def _is_journal_line(line: bytes) -> bool:
    try:
        entry = json.loads(line)
    except ValueError:
        return False
    return isinstance(entry, dict) and "op_code" in entry


def open_storage(storage: str) -> "optuna.storages.BaseStorage":
    """The Optuna storage of a canonical storage string, connected; ConfigError naming it if it cannot be."""
    import optuna

    if not is_url(storage):
        from optuna.storages.journal import JournalFileBackend

        try:
            return optuna.storages.JournalStorage(JournalFileBackend(storage))
        except (OSError, ValueError) as err:
            raise _refuse(storage, f"cannot be opened ({first_line(err)})") from None
    from sqlalchemy.exc import SQLAlchemyError

    try:
        _check_tables(storage)
        return optuna.storages.RDBStorage(storage)
    except ConfigError:  # _check_tables' own line (a ValueError too)
        raise
    except ImportError:
        raise _refuse(storage, "its database driver is not installed (pip install psycopg2-binary for "
                               "postgresql://, pymysql for mysql+pymysql://)") from None
    except (SQLAlchemyError, ValueError, RuntimeError) as err:
        raise _refuse(storage, f"cannot be opened ({first_line(err)})") from None


OPTUNA_TABLES = {"studies", "version_info"}  # what every Optuna RDB schema has (with trials, alembic_version...)


def _check_tables(storage: str) -> None:
    """Refuse a database that holds another application's tables, read-only and before RDBStorage opens it:
    RDBStorage would add its tables to it first and refuse it after. Empty, or Optuna's already: allowed."""
    from sqlalchemy import create_engine, inspect
    from sqlalchemy.engine import make_url

    url = make_url(storage)
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        return  # RDBStorage creates it; connecting here would too
    engine = create_engine(url)
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    if tables and not OPTUNA_TABLES <= tables:
        shown = ", ".join(sorted(tables)[:4]) + (", ..." if len(tables) > 4 else "")
        raise _refuse(storage, f"not an Optuna storage (it holds tables {shown}): give an empty database or an "
                               "Optuna one")


def study_name(run_path: str | Path, storage: str | None) -> str:
    """The sweep's study: `autotune` in its own study.db, `autotune <host>:<run directory>` elsewhere."""
    if storage is None:
        return LOCAL_STUDY
    return f"{LOCAL_STUDY} {socket.gethostname()}:{Path(run_path).resolve()}"


def check_storage(storage: str | None, study: str, resume: bool) -> None:
    """Before a sweep writes anything: the storage opens, and a new sweep does not find its study there
    already (a resumed one may, or may not: its recorded trials are told again). A study none of whose
    trials was recorded (no `report_trial`) is what a new sweep that failed before its first trial left:
    it is removed."""
    if storage is None:
        return
    import optuna

    opened = open_storage(storage)
    try:
        if resume or study not in {s.study_name for s in opened.get_all_studies()}:
            return
        trials = opened.get_all_trials(opened.get_study_id_from_name(study), deepcopy=False)
        recorded = any("report_trial" in t.user_attrs for t in trials)
        if not recorded:
            optuna.delete_study(study_name=study, storage=opened)
    finally:
        if isinstance(opened, optuna.storages.RDBStorage):
            opened.engine.dispose()  # the check's connections: the sweep opens its own
    if recorded:
        raise ConfigError(f"storage {masked(storage)!r} already holds study {study!r} of an earlier sweep in "
                          f"this run directory: resume that sweep with --resume, delete the study (optuna "
                          f"delete-study --study-name {study!r} --storage URL), or choose another --out")


@contextmanager
def optuna_warnings_only() -> Iterator[None]:
    """While sweeps run or a report keeps the study, Optuna says warnings only (not "A new study created", "Trial
    N finished" for each trial): the sweep's display says what matters. A level the user set (other than Optuna's default INFO) is kept, and
    Optuna's level is restored after."""
    import optuna

    level = optuna.logging.get_verbosity()
    if level == optuna.logging.INFO:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)
