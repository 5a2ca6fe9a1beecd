"""Byte sizes as people write them: 32GiB (binary), 32GB / 32000MB (decimal), or plain bytes; counts of things."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


MAX_SIZE = 2**50  # 1024 TiB: more than any device or host holds; larger values are typos (or overflow later)
_MAX_SIZE_TEXT = "1 B to 1024 TiB"


def shown(text: object, limit: int = 40) -> str:
    """repr of a value typed by a user, cut short so that one error line stays one readable line."""
    if isinstance(text, int) and text.bit_length() > 10_000:  # repr refuses ints past 4300 digits
        return f"an integer of {text.bit_length()} bits"
    full = repr(text)
    return full if len(full) <= limit else f"{full[:limit]}... ({len(str(text))} characters)"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 trial`, `2 trials` (`plural`: where adding an s is wrong: process, processes)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def parse_size(text: str | int | float) -> int:
    """Bytes from '32GiB' (2**30), '32GB' (10**9), '32000MB', '1.5TiB' or a plain number of bytes.

    Raises ValueError naming the text for anything else, including zero and negative sizes and sizes past
    MAX_SIZE (never OverflowError: a number of 400 digits is refused like any other out-of-range size).
    """
    value: int | float
    if isinstance(text, int) and not isinstance(text, bool):
        value, scale = text, 1  # exact: 10**400 from a YAML file must not go through float
    elif isinstance(text, float):
        value, scale = text, 1
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(
                f"size {shown(text)} is not understood: use a number with B, KB, MB, GB, TB (powers of 1000) "
                "or KiB, MiB, GiB, TiB (powers of 1024), e.g. 32GiB")
        value, scale = float(match.group(1)), _UNITS[match.group(2).upper()]
    if value != value:  # NaN compares false with everything
        raise ValueError(f"size {shown(text)} is not a number: allowed {_MAX_SIZE_TEXT}")
    if value <= 0:
        raise ValueError(f"size {shown(text)} must be positive")
    if value * scale > MAX_SIZE:  # float('9' * 400) is inf, which compares fine; int(round(inf)) would not
        raise ValueError(f"size {shown(text)} is too large: allowed {_MAX_SIZE_TEXT}")
    size = int(round(value * scale))
    if size <= 0:
        raise ValueError(f"size {shown(text)} must be positive (at least 1 byte)")
    return size


SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def exact_size(size: int) -> str:
    """A size as format_size says it, with its bytes where that rounds: two sizes a refusal compares must not read
    alike ("23.5 GiB exceeds 23.5 GiB")."""
    return format_size(size) if parse_size(format_size(size)) == size else f"{format_size(size)} ({size} bytes)"


def format_size(num_bytes: float | None) -> str:
    """Binary units with three significant figures, e.g. '1.50 GiB'."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in SIZE_UNITS:
        if value < 1024 or unit == "TiB":
            return f"{sign}{_figures(value, unit)} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _figures(value: float, unit: str) -> str:
    """A size's number in `unit`: three significant figures; 1000-1023 of a unit in whole units ('1020 MiB', not
    '1.02e+03'), bytes whole."""
    return f"{value:{'.0f' if unit == 'B' or value >= 999.5 else '.3g'}}"


def format_span(low: float, high: float) -> str:
    """An interval of sizes in the unit of its upper end, the unit written once: '0.66-1.06 GiB', '677-904 MiB'."""
    high_text = format_size(high)
    unit = high_text.rsplit(" ", 1)[1]
    return f"{_figures(low / 1024 ** SIZE_UNITS.index(unit), unit)}-{high_text}"
