"""Every file the tool reads or writes goes through here.

Reading: `read_text`, `load_yaml`, `load_json` turn every way a file can be unreadable (missing, a
directory, not UTF-8, not valid YAML/JSON, nested too deep) into a one-line ConfigError naming the file
(and the line, where the parser knows it). What the data must hold is the caller's to check.

Writing: `write_atomic` / `atomic_output` write a unique temporary name in the target's directory
(created with O_EXCL and O_NOFOLLOW by tempfile.mkstemp, so a planted symlink is never followed), fsync
it, rename it over the target and fsync the directory: a crash leaves the old file or the new one, never
half of one, and a rename once returned survives a power loss. `append_line` appends one fsync'd line
to a file it refuses to open through a symlink; `open_lock` opens a lock file the same way, without
truncating it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import reprlib
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import yaml

from autotune.errors import ConfigError

_SHORT = reprlib.Repr()
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = _SHORT.maxset = 6
_SHORT.maxlevel = 3


def short(value: Any) -> str:
    """repr(value) cut to a readable length: what an error message quotes of a bad value."""
    return _SHORT.repr(value)


# -- reading

def is_file(path: str | Path) -> bool:
    """Path.is_file that answers False, never raises, for any name (too long, a NUL, unreadable parents)."""
    try:
        return os.path.isfile(path)
    except (OSError, ValueError):
        return False


def exists(path: str | Path) -> bool:
    try:
        return os.path.lexists(path)
    except (OSError, ValueError):
        return False


def read_bytes(path: str | Path, what: str = "a file") -> bytes:
    """The file's bytes; ConfigError naming the file if it is missing, not a regular file or unreadable."""
    path = Path(path)
    try:
        # O_NONBLOCK: a FIFO planted where a file is expected is refused below instead of blocking the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (expected {what})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err}): expected {what}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{path}: is a directory, not {what}")
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{path}: not a regular file: expected {what}")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err}): expected {what}") from None
    finally:
        os.close(fd)


def read_text(path: str | Path, what: str = "a file") -> str:
    """The file's text; ConfigError naming the file if it cannot be read or is not UTF-8."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}): "
                          f"expected {what}") from None


def load_yaml(path: str | Path, what: str = "a YAML file") -> Any:
    """The file's YAML data; ConfigError with file:line for anything the parser refuses."""
    return parse_yaml(read_text(path, what), path, what)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it keeps the last silently: `trials: 3` then
    `trials: 4` ran 4). Merge keys (`<<: *base`) still merge, the mapping's own keys overriding the merged ones."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):  # before flatten_mapping folds the merged keys in
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: SafeConstructor's own error says so
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {short(key)} given twice (first on line {first}): allowed each key once "
                        "in a mapping", key_node.start_mark)
                lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, path: str | Path, what: str = "a YAML file") -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = " ".join(str(err.problem or err.context or "unreadable").split())
        raise ConfigError(f"{where}: not valid YAML ({problem}): expected {what}") from None
    except yaml.YAMLError as err:
        first = " ".join(str(err).split())[:200]
        raise ConfigError(f"{path}: not valid YAML ({first}): expected {what}") from None
    # PyYAML's constructors raise plain errors too: a date such as 2024-13-45, a number too long to convert,
    # nesting deeper than Python's recursion limit.
    except (ValueError, TypeError, OverflowError, RecursionError) as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())[:200]}): expected {what}") from None


def load_json(path: str | Path, what: str = "a JSON file") -> Any:
    """The file's JSON data; ConfigError with file:line for anything the parser refuses."""
    return parse_json(read_text(path, what), path, what)


def parse_json(text: str, where: str | Path, what: str = "JSON") -> Any:
    """`text` as JSON; `where` (a file, or file:line) names it in the error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        # Some of json's messages end in "at" ("Unterminated string starting at"): no second one.
        at = "" if err.msg.endswith(" at") else " at"
        line = f"line {err.lineno} " if "\n" in text.rstrip("\n") else ""  # a file's JSON of several lines
        raise ConfigError(f"{where}: not valid JSON ({err.msg}{at} {line}column {err.colno}): expected {what}") from None
    except (ValueError, RecursionError) as err:  # an integer too long to convert, nesting too deep
        raise ConfigError(f"{where}: not valid JSON ({' '.join(str(err).split())[:200]}): expected {what}") from None


# -- a full disk

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
SQLITE_FULL = "database or disk is full"  # SQLITE_FULL's message, in sqlite3's and SQLAlchemy's errors


class NoSpaceLeft(Exception):
    """The file system holding `path` is full (or the user's quota spent): a fault of the machine that the
    CLI names in one line (exit 1), not a bug. What was recorded before is whole: appends and SQLite
    transactions are all-or-nothing, atomic writes leave the old file."""

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path = str(path)
        super().__init__(f"{path}: no space left on its device ({detail}): free some space, then run the command "
                         "again (a sweep with --resume: nothing recorded before is lost)")


def disk_full(err: BaseException) -> tuple[str | None, str] | None:
    """If `err`, or an exception it was raised from (Optuna's StorageInternalError wraps SQLAlchemy's
    OperationalError), says the disk is full: (the file it names, None for a database's; what said so)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, NoSpaceLeft):
            return current.path, "no space left on device"
        if isinstance(current, OSError) and current.errno in NO_SPACE_ERRNOS:
            name = current.filename
            return (None if name is None else os.fsdecode(name)), current.strerror or "no space left on device"
        if SQLITE_FULL in str(current):
            return None, SQLITE_FULL
        current = current.__cause__ or current.__context__
    return None


def _with_name(err: OSError, path: Path) -> OSError:
    """`err` naming `path` when it names no file (os.write's and fsync's errors do not), so that a full disk
    is reported with the file that did not fit."""
    if err.filename is None and err.errno is not None:
        named = OSError(err.errno, err.strerror, str(path))
        named.__cause__ = err
        return named
    return err


# -- writing

def _umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def fsync_dir(directory: str | Path) -> None:
    """Make a rename or a new name in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_output(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content into; on a clean exit it replaces `path` (fsync'd, renamed,
    directory fsync'd); on an error the target is untouched and the temporary file removed."""
    path = Path(path)
    directory = path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # what open() would have created (mkstemp makes it 0600)
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)  # replaces a symlink at `path` itself, never its target
    except BaseException as err:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(err, OSError):
            raise _with_name(err, path)  # a new error keeps the first as its cause
        raise
    fsync_dir(directory)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` with `data` (text is written as UTF-8) atomically and durably."""
    path = Path(path)
    with atomic_output(path) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    """`data` as JSON (NaN and infinities refused), written with `write_atomic`."""
    text = json.dumps(data, indent=indent, allow_nan=False)
    return write_atomic(path, text + "\n" if indent is not None else text)


def _refuse_link(path: Path, err: OSError, doing: str) -> None:
    if err.errno == errno.ELOOP:
        raise ConfigError(f"{path} is a symbolic link: refusing to {doing} through it (remove it)") from None


def append_line(path: str | Path, line: str) -> None:
    """Append `line` and a newline to `path` (created if absent), fsync'd; refused if `path` is a symlink."""
    path = Path(path)
    created = not os.path.lexists(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        _refuse_link(path, err, "append")
        raise
    try:
        size = os.fstat(fd).st_size
        data = (line + "\n").encode("utf-8")
        try:
            while data:  # one write in practice; a short write is finished, not lost
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except OSError as err:
            if err.errno in NO_SPACE_ERRNOS:  # the part that fitted is taken back: no torn line is left
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    pass  # the next start repairs a torn tail (autotune.values.results.repair_tail)
            raise _with_name(err, path)  # a new error keeps the first as its cause
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


def open_lock(path: str | Path) -> int:
    """A descriptor of the lock file `path`, created if absent, never truncated here and never opened through
    a symlink or a second hard link (either could point at someone else's file)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as err:
        _refuse_link(path, err, "open a lock")
        raise ConfigError(f"{path}: cannot open the lock file ({err.strerror or err})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        kind = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"has {info.st_nlink} hard links"
        raise ConfigError(f"{path}: the lock file {kind}: refusing to use it (remove it)")
    return fd


def make_dir(path: Path, flag: str) -> Path:
    """Create an output directory (and its parents) once every input is checked; a file system that refuses
    (read-only, full, a name it does not allow) is a ConfigError naming the path, not an OSError traceback."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot create the directory: {err.strerror or err}") from None
    return path


def sha256(*paths: str | Path) -> str:
    """The SHA-256 of the files' bytes, one after another (OSError where one cannot be read)."""
    hasher = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                hasher.update(block)
    return hasher.hexdigest()
