"""A process's resident memory on Linux, from /proc (ARCHITECTURE.md section 4).

`VmHWM` is the true peak resident set since the process started or since its last reset (writing 5 to
/proc/<pid>/clear_refs); polling `VmRSS` would miss short peaks. The runner's watchdog reads the ranks'
VmHWM from outside, so a peak between two polls is still seen.
"""

from __future__ import annotations

from pathlib import Path


def _status(pid: int | str, key: str) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    return None  # e.g. a zombie has no memory lines


def peak_rss(pid: int | str = "self") -> int | None:
    """VmHWM in bytes: the highest resident set since start or since the last `reset_peak`."""
    return _status(pid, "VmHWM")


def rss(pid: int | str = "self") -> int | None:
    return _status(pid, "VmRSS")


def reset_peak(pid: int | str = "self") -> None:
    """Set the peak back to the current resident set (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
