"""Byte sizes as people write them: 32GiB (binary), 32GB / 32000MB (decimal), or plain bytes."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Bytes from '32GiB' (2**30), '32GB' (10**9), '32000MB', '1.5TiB' or a plain number of bytes.

    Raises ValueError naming the text for anything else, including zero and negative sizes.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(
                f"size {text!r} is not understood: use a number with B, KB, MB, GB, TB (powers of 1000) "
                "or KiB, MiB, GiB, TiB (powers of 1024), e.g. 32GiB")
        value, unit = float(match.group(1)), match.group(2).upper()
    size = int(round(value * _UNITS[unit]))
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def format_size(num_bytes: float | None) -> str:
    """Binary units with three significant figures, e.g. '1.50 GiB'."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
