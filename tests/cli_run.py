"""`cli(argv, capture)`: run `autotune` in this process; capture is pytest's capsys, or capfd where the command
moves file descriptors (--json puts stdout aside while it runs)."""

from __future__ import annotations

from typing import Any

from autotune.cli import main


def cli(argv: list[str], capture: Any) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `autotune argv`."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capture.readouterr()
    return code, out, err
