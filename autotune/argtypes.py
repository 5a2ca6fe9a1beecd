"""Parsers of the values people type, shared by the CLI's flags and the sweep file: each returns the value or
raises argparse.ArgumentTypeError with a one-line message naming the text and what is allowed."""

from __future__ import annotations

import argparse
import re

from autotune.units import parse_size


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """Seconds from '8h', '90m', '1h30m', '45s' or a plain number of seconds."""
    compact = text.strip().lower().replace(" ", "")
    parts = _DURATION.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise argparse.ArgumentTypeError(f"duration {text!r} is not understood: use e.g. 8h, 90m, 1h30m, 45s")
    seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive")
    return seconds


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or a positive integer")
    return value


def _number(text: str, allowed: str, ok) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (ok(value) and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be {allowed}")
    return value


def non_negative_float(text: str) -> float:
    return _number(text, "a finite number >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    return _number(text, "a finite number > 0", lambda v: v > 0)


seed = non_negative_int  # a seed is any integer >= 0
