"""Parsers of the values people type, shared by the CLI's flags and the sweep file: each returns the value or
raises argparse.ArgumentTypeError with a one-line message naming the text and what is allowed.

Every number has a range, so that nothing typed overflows later (a float of 400 digits is inf; a seed past
2**32 - 1 is refused by numpy deep inside a sweep, after its run directory was written), and every output
path is checked before anything is written: its nearest existing ancestor must be a writable directory."""

from __future__ import annotations

import argparse
import errno
import inspect
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Callable

from autotune.errors import ConfigError
from autotune.values.units import parse_size, shown

MAX_INT = 2**31 - 1  # counts (trials, steps, batch, tokens): C code below us takes int32; more is a typo
MAX_GPUS = 4096  # devices of one data-parallel group: larger than any DeepSpeed run this tool plans for
MAX_SEED = 2**32 - 1  # what numpy's and Optuna's samplers accept
MAX_SECONDS = 366 * 86400  # a duration or timeout of more than a year is a typo
_DIGITS = re.compile(r"\s*[-+]?[0-9_]+\s*")


def int_range(low: int, high: int, what: str = "") -> Callable[[str], int]:
    """A parser of integers from `low` to `high`; `what` says why the maximum (e.g. 'GPUs')."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            if _DIGITS.fullmatch(text):  # only digits, but past Python's 4300-digit conversion limit
                raise argparse.ArgumentTypeError(f"{shown(text)} is too large: allowed {low} to {high}{what}") from None
            raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None
        if value < low:
            kind = {0: "0 or a positive integer", 1: "a positive integer"}.get(low, f"at least {low}")
            raise argparse.ArgumentTypeError(f"{shown(text)} must be {kind}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{shown(text)} is too large: allowed {low} to {high}{what}")
        return value

    parse.__name__ = f"integer from {low} to {high}"  # argparse names the type in its own messages
    return parse


positive_int = int_range(1, MAX_INT)
non_negative_int = int_range(0, MAX_INT)
gpu_count = int_range(1, MAX_GPUS, " GPUs")
SEEDS = f"0 to {MAX_SEED} (2**32 - 1), the seeds numpy and Optuna accept"


def whole(value: Any) -> int | None:
    """`value` as an int if it is a whole number of any integer type (numpy's np.int64 as Python's int), else None;
    a bool is no number here (True is no seed or batch)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def check_seed(value: Any, text: str | None = None) -> int:
    """A strategy's seed, the one check of the CLI's --seed (`seed`) and the library's TuneSpec.seed: a whole
    number (any integer type) from 0 to MAX_SEED, returned as an int, else ArgumentTypeError naming the value
    (`text`: as typed) and the range."""
    named = shown(value if text is None else text)
    number = whole(value)
    if number is None:
        raise argparse.ArgumentTypeError(f"{named} is not a whole number: allowed {SEEDS}")
    value = number
    if value < 0:
        raise argparse.ArgumentTypeError(f"{named} must be 0 or a positive integer: allowed {SEEDS}")
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"{named} is too large: allowed {SEEDS}")
    return value


def seed(text: str) -> int:
    """--seed: check_seed of the number typed."""
    try:
        value = int(text)
    except ValueError:
        if _DIGITS.fullmatch(text):  # only digits, but past Python's 4300-digit conversion limit
            raise argparse.ArgumentTypeError(f"{shown(text)} is too large: allowed {SEEDS}") from None
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer: allowed {SEEDS}") from None
    return check_seed(value, text)


seed.__name__ = f"integer from 0 to {MAX_SEED}"  # argparse names the type in its own messages


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """Seconds from '8h', '90m', '1h30m', '45s' or a plain number of seconds (a number alone: '1h30' is
    refused): more than 0, at most a year."""
    compact = text.strip().lower().replace(" ", "")
    if compact.startswith("-"):
        raise argparse.ArgumentTypeError(f"duration {shown(text)} must be positive")
    parts = _DURATION.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise argparse.ArgumentTypeError(f"duration {shown(text)} is not understood: use e.g. 8h, 90m, 1h30m, 45s")
    if len(parts) > 1 and any(not unit for _, unit in parts):  # '1h30': 1 h 30 s as read, 90 min as meant
        raise argparse.ArgumentTypeError(f"duration {shown(text)} is not understood: give each number its unit, "
                                         "e.g. 1h30m, 90m")
    seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"duration {shown(text)} must be positive")
    if seconds > MAX_SECONDS:  # also inf, from a number of 400 digits
        raise argparse.ArgumentTypeError(f"duration {shown(text)} is too long: allowed more than 0 s, at most 366d")
    return seconds


def _number(text: str, allowed: str, ok: Callable[[float], bool]) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"{shown(text)} must be {allowed}")
    return value


def non_negative_float(text: str) -> float:
    return _number(text, "a finite number >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    return _number(text, "a finite number > 0", lambda v: v > 0)


STOP_WHEN_ALLOWED = "a probability from 0 to below 1, e.g. 0.05 (0 turns the convergence stop off)"


def stop_probability(text: str) -> float:
    """--stop-when: a probability from 0 to below 1 (0: the convergence stop off; 1 would stop every sweep at its
    first chance, whatever the chance, and call it converged)."""
    allowed = STOP_WHEN_ALLOWED
    try:
        return _number(text, allowed, lambda v: 0 <= v < 1)
    except argparse.ArgumentTypeError as err:
        if str(err).endswith("must be " + allowed):
            raise
        raise argparse.ArgumentTypeError(f"{err}: allowed {allowed}") from None


_ADDRESS = re.compile(r"(?:ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


def ray_address(text: str) -> str:
    """--ray-address: local (a private instance on loopback), auto, or [ray://]host:port with a port of 1 to 65535."""
    match = _ADDRESS.fullmatch(text)
    if text in ("local", "auto") or (match and 1 <= int(match.group(2)) <= 65535):
        return text
    raise argparse.ArgumentTypeError(f"{shown(text)} is not a Ray address: allowed local, auto or host:port "
                                     "(port 1 to 65535), e.g. 10.0.0.5:6379")


# -- paths the library is given ------------------------------------------------------------------------------

def given_path(value: Any, name: str, allowed: str = "a path (str or pathlib.Path)") -> Path:
    """A path handed to the library (TuneSpec's files, tune()'s `out`, record_surface's file...): a non-empty str
    or os.PathLike, with `~` expanded as the CLI's shell expands it for the CLI (a `~user` that names no user is
    left as it is); else ConfigError naming it (`name`) and what is `allowed`. The one place the library expands
    `~`, so that no path it takes creates a folder named `~`."""
    text: Any = None
    if isinstance(value, (str, os.PathLike)):
        try:
            text = os.fspath(value)
        except TypeError:  # a __fspath__ that returns neither str nor bytes
            text = None
    if not isinstance(text, str) or not text or "\0" in text:
        raise ConfigError(f"{name} {shown(value)}: allowed {allowed}")
    return Path(os.path.expanduser(text))


def takes(function: Any, count: int) -> bool:
    """Whether `function` (a class: its __init__) can be called with `count` positional arguments, asked of its
    signature before the call, so that a user's builder with the wrong parameters is one line naming it, while a
    TypeError raised inside it stays its own. True where no signature can be read (some builtins)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*[None] * count)
    except TypeError:
        return False
    return True


# -- paths read ---------------------------------------------------------------------------------------------

def shown_path(text: str) -> str:
    """A path as an error names it: whole unless absurdly long (a 300-character name is itself the problem)."""
    return shown(text, 200)


def input_file(text: str) -> Path:
    """A file the command reads: it exists, is a regular file (not a directory or a device) and is readable."""
    path = Path(text)
    if not text or "\0" in text or not os.path.exists(path):
        raise argparse.ArgumentTypeError(f"{shown_path(text)}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{shown_path(text)} is not a regular file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{shown_path(text)} is not readable")
    return path


def input_dir(text: str) -> Path:
    """A directory the command reads (e.g. a checkpoint): it exists and is a directory."""
    if not text or "\0" in text or not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{shown_path(text)}: no such directory")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{shown_path(text)} is not a directory")
    return Path(text)


# -- paths written to -----------------------------------------------------------------------------------

def output_dir(text: str) -> Path:
    """A directory the command creates or writes into: an existing writable directory, or a new one whose
    nearest existing ancestor is a writable directory, with names the file system allows."""
    path = _output_path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{shown_path(text)} exists and is not a directory")
        _writable(path, text)
    return path


def output_file(text: str) -> Path:
    """A file the command creates or appends to: an existing writable regular file, or a new one in a
    directory that exists or can be created."""
    path = _output_path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{shown_path(text)} is a directory: name a file (e.g. {text.rstrip('/')}/out.jsonl)")
    if path.exists():
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{shown_path(text)} is not a regular file")
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{shown_path(text)} is not writable")
    elif text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{shown_path(text)} ends with '{os.sep}': name a file, not a directory")
    return path


def existing_dir(text: str) -> Path:
    """A directory that must exist, and that the command writes into (e.g. a run directory's outputs)."""
    path = output_dir(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{shown_path(text)}: no such directory")
    return path


def _output_path(text: str) -> Path:
    """The path, once its names fit the file system and its nearest existing ancestor is a writable directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: name a file or directory")
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{shown_path(text)} contains a NUL character")
    path = Path(text)
    absolute = Path(os.path.abspath(text))
    ancestor = _nearest_existing(absolute)
    name_max = _limit(ancestor, "PC_NAME_MAX", 255)
    for part in absolute.parts:
        if len(os.fsencode(part)) > name_max:
            raise argparse.ArgumentTypeError(f"{shown_path(text)}: a name of {len(os.fsencode(part))} bytes: "
                                             f"allowed at most {name_max} bytes per name")
    path_max = _limit(ancestor, "PC_PATH_MAX", 4096)
    if len(os.fsencode(str(absolute))) >= path_max:
        raise argparse.ArgumentTypeError(f"{shown_path(text)} is {len(os.fsencode(str(absolute)))} bytes long as an "
                                         f"absolute path: allowed less than {path_max}")
    if os.path.lexists(absolute) and not os.path.exists(absolute):
        raise argparse.ArgumentTypeError(f"{shown_path(text)} is a symbolic link to nothing")
    if ancestor != absolute:
        if not ancestor.is_dir():
            raise argparse.ArgumentTypeError(f"{shown_path(text)}: {ancestor} is not a directory")
        _writable(ancestor, text)
    return path


def _nearest_existing(absolute: Path) -> Path:
    """The path itself or its closest ancestor that exists (a file too: a path under a file has one)."""
    for candidate in (absolute, *absolute.parents):
        try:
            os.stat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as err:
            if err.errno == errno.ENAMETOOLONG:  # the length check names it, against the ancestor's limit
                continue
            raise argparse.ArgumentTypeError(f"{candidate}: {err.strerror or err}") from None
        return candidate
    return Path(absolute.anchor)


def _writable(directory: Path, text: str) -> None:
    if not os.access(directory, os.W_OK | os.X_OK):
        where = "" if Path(os.path.abspath(text)) == directory else f": {directory}"
        raise argparse.ArgumentTypeError(f"{shown_path(text)}{where} is not a writable directory")


def _limit(path: Path, name: str, default: int) -> int:
    """A file-system limit at `path` (pathconf), or the usual Linux value where it cannot be asked."""
    try:
        value = os.pathconf(path if path.is_dir() else path.parent, name)
    except (OSError, ValueError):
        return default
    return value if value > 0 else default
