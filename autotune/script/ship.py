"""What a script-mode trial on another machine needs of the driver's files (`autotune tune --script ...
--ray-address`): the script's directory (its modules, configs, small data) and the files its arguments name
outside it, packed once on the driver and unpacked for each trial on the node that runs it.

- `plan` (driver): the files to ship, refused in one line (ConfigError) when they are more than
  SHIP_LIMIT_BYTES or MAX_FILES: a Ray trial carries them in Ray's object store, and every trial unpacks
  them. Left out of the script's directory: version-control, cache and virtual-environment folders, and
  ds-autotune run directories (their trial logs grow while the sweep runs). An argument that names an
  existing file or folder (`path` or `--flag=path`, relative to the driver's working directory or absolute)
  is rewritten to the shipped copy when it lies in the script's directory; a file outside it up to
  OUTSIDE_FILE_MAX is shipped beside it; anything else it names (a folder outside, a large file) is left as
  it is, for every node to read at that path, and `Shipment.notes` says so.
- `pack` (driver): the files as one gzipped tar.
- `unpack` (node): the tar into a fresh directory; `Landed` is the script's path, its arguments and the
  working directory there (the copy of the driver's, when that lies in the script's directory).
"""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from autotune.values.config import ConfigError
from autotune.values.units import counted, format_size

SHIP_LIMIT_BYTES = 64 * 2**20  # what one trial carries and unpacks
MAX_FILES = 10_000
OUTSIDE_FILE_MAX = 8 * 2**20  # a file named in the arguments outside the script's directory (a config, not data)
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache",
                          ".ruff_cache", ".tox", ".ipynb_checkpoints", "node_modules", "wandb", "mlruns"})
RUN_DIR_MARKERS = ("run.json", "trials.jsonl", ".lock")  # a ds-autotune run directory (autotune.search.rundir)
OUTSIDE = ".autotune-files"  # in the bundle: the files named outside the script's directory, one folder each


@dataclass(frozen=True)
class PathArg:
    """A script argument that names a shipped file or folder: `prefix` (`--flag=` or '') + its bundle path."""

    index: int
    prefix: str
    target: str  # relative to the bundle's top


@dataclass(frozen=True)
class Shipment:
    """What travels with each trial, relative to the bundle's top: `<root name>/...` (the script's
    directory) and `.autotune-files/<n>/<name>` (the file argument n names outside it)."""

    root: str  # the script's directory on the driver (absolute)
    script: str  # the script, relative to the bundle's top
    files: tuple[tuple[str, str], ...]  # (source path on the driver, path in the bundle)
    args: tuple[str, ...]  # the script's arguments as given
    paths: tuple[PathArg, ...]  # the arguments rewritten on the node
    cwd: str  # the working directory on the node, relative to the bundle's top
    size: int  # bytes, before packing
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        return (f"{counted(len(self.files), 'file')}, {format_size(self.size)} from {self.root} travel with each trial "
                f"(unpacked on its node; {counted(len(self.paths), 'argument path')} point into the copy)")


@dataclass(frozen=True)
class Landed:
    """The script unpacked on a node: run `script` with `args` in `cwd`."""

    top: str
    script: str
    args: tuple[str, ...]
    cwd: str


def plan(script: str, args: tuple[str, ...], exclude: tuple[str | Path, ...] = (),
         cwd: str | Path | None = None, limit: int = SHIP_LIMIT_BYTES) -> Shipment:
    """The files a trial of `script args` needs on another machine; ConfigError when they are too many."""
    base = Path(cwd if cwd is not None else os.getcwd()).resolve()
    source = (base / script).resolve()
    root = source.parent
    top = root.name or "script"
    skipped = {Path(p).resolve() for p in exclude}
    files: dict[Path, str] = {}
    size = 0
    for path in _walk(root, skipped):
        size += path.stat().st_size
        files[path] = f"{top}/{path.relative_to(root).as_posix()}"
        if size > limit or len(files) > MAX_FILES:
            largest = max(files, key=lambda p: p.stat().st_size)
            raise ConfigError(
                f"--script {script} with --ray-address: its directory {root} holds more than a Ray trial ships "
                f"({format_size(limit)} = {limit:,} bytes, or {MAX_FILES:,} files): {size:,} bytes in the first "
                f"{len(files):,} files, the largest {largest.relative_to(root)} ({format_size(largest.stat().st_size)}); keep "
                "the script, its modules and configs in a folder of their own, and large data where every node "
                "reads it by an absolute path")
    paths, notes = [], []
    for index, arg in enumerate(args):
        prefix, value = _path_part(arg)
        named = _existing(base, value)
        if named is None:
            continue
        if named.is_relative_to(root) and (named in files or named.is_dir() and _shipped_dir(named, files)):
            target = top if named == root else f"{top}/{named.relative_to(root).as_posix()}"
        elif named.is_file() and named.stat().st_size <= OUTSIDE_FILE_MAX:
            target = f"{OUTSIDE}/{index}/{named.name}"  # one folder per argument: no clash
            files[named] = target
            size += named.stat().st_size
        else:
            what = "a folder" if named.is_dir() else f"a file larger than {format_size(OUTSIDE_FILE_MAX)}"
            where = "left out of" if named.is_relative_to(root) else "outside"
            notes.append(f"{value}: not shipped ({what} {where} {root}): every node must read it at that path")
            continue
        paths.append(PathArg(index, prefix, target))
    if size > limit:
        raise ConfigError(f"--script (`script`) {script} with --ray-address: the script's directory and the files its "
                          f"arguments name hold {format_size(size)}, more than the {format_size(limit)} a Ray "
                          "trial ships; keep large data where every node reads it by an absolute path")
    node_cwd = f"{top}/{base.relative_to(root).as_posix()}" if base.is_relative_to(root) and base != root else top
    return Shipment(str(root), files[source], tuple((str(p), t) for p, t in files.items()), tuple(args),
                    tuple(paths), node_cwd, size, tuple(notes))


def pack(shipment: Shipment) -> bytes:
    """The shipment's files as one gzipped tar (level 1: configs and code shrink, data barely does)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for source, target in shipment.files:
            tar.add(source, arcname=target, recursive=False)
    return buffer.getvalue()


def unpack(shipment: Shipment, bundle: bytes, dest: str | Path) -> Landed:
    """Unpack `bundle` into the (empty) folder `dest`; the script's path, arguments and working directory there."""
    dest = Path(dest)
    with tarfile.open(fileobj=io.BytesIO(bundle), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")  # no absolute paths, links or devices out of `dest`
    args = list(shipment.args)
    for p in shipment.paths:
        args[p.index] = p.prefix + str(dest / p.target)
    cwd = dest / shipment.cwd
    cwd.mkdir(parents=True, exist_ok=True)  # a working directory with nothing shipped in it
    return Landed(str(dest), str(dest / shipment.script), tuple(args), str(cwd))


def _walk(root: Path, skipped: set[Path]):
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")
                         and (here / d) not in skipped and not _is_run_dir(here / d))
        for name in sorted(names):
            path = here / name
            if path.is_file() and not name.endswith((".pyc", ".pyo")):
                yield path


def _is_run_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in RUN_DIR_MARKERS)


def _shipped_dir(folder: Path, files: dict[Path, str]) -> bool:
    return any(p.is_relative_to(folder) for p in files)


def _path_part(arg: str) -> tuple[str, str]:
    """('--flag=', value) for `--flag=value`; ('', arg) for an argument that is no flag; ('', '') for a flag."""
    if arg.startswith("-"):
        flag, sep, value = arg.partition("=")
        return (flag + sep, value) if sep else ("", "")
    return "", arg


def _existing(base: Path, value: str) -> Path | None:
    if not value:
        return None
    try:
        path = (base / value).resolve()
        return path if path.exists() else None
    except (OSError, ValueError):  # a name too long, a NUL byte: no path
        return None
