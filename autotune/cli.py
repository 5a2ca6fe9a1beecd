"""`autotune` command line: one module per command under autotune/commands.

One error path for every command: bad input is one line `autotune <cmd>: error: ...` and exit 2 (argparse's
type functions in autotune.values.argtypes, and ConfigError from the library); a DeepSpeed op the trials need that
cannot be built (autotune.trials.ops.OpBuildFailed) is one line naming the fix, exit 1; Ctrl-C is exit 130; anything else is a
bug or a fault of the machine, reported as one line naming the exception and the file its traceback was
written to, exit 1 (`--debug` prints the traceback too); a full disk (autotune.files.disk_full) is one line naming
the path and "no space left", exit 1. Never a bare traceback."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn, Sequence

from autotune.values.config import ConfigError
from autotune.files import NoSpaceLeft, disk_full
from autotune.trials.ops import OpBuildFailed

# command name -> module under autotune.commands exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "estimate": "Predict memory and throughput of every config of a space, before running anything.",
    "tune": "Search for the fastest config within a memory budget; resumable; writes the recommendation and a report.",
    "report": "Regenerate a sweep's summary, recommended configs, report.md and plots from its run directory.",
    "trial": "Run one real DeepSpeed trial of one config; print its measurements next to the estimator's prediction.",
    "surface": "Record a replay surface (every config of a space, run for real; resumable), or summarise one.",
    "rl": "Train the RL policy with RLlib (PPO) on the simulated environment, resumably; export a checkpoint's policy.",
    "sweep": "Tune many workloads of a sweep YAML at once on a Ray cluster; one run directory each and a summary table.",
}
# Commands that run sweeps or trials: at their start, the shared-memory segments of dead tuners' trials go
CLEANS_SHM = frozenset({"tune", "trial", "surface", "sweep"})
ERROR_LOG = "last-error.log"  # under the user's cache directory when no run directory is known
DEBUG_HELP = "on an internal error, print its traceback (it is always written to a log file)"


class ArgumentParser(argparse.ArgumentParser):
    """Bad input is one line naming the value, and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="autotune", description="Find the fastest DeepSpeed memory config that fits.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"autotune.commands.{name.replace('-', '_')}")
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        # also after the command's name; SUPPRESS keeps `autotune --debug tune` from being reset to False
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        # _run_dir: where the internal-error log goes; a command sets it once it knows its run directory
        command.set_defaults(_run=module.run, _prog=command.prog, _run_dir=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = argparse.Namespace(_prog="autotune", _run_dir=None,
                              debug="--debug" in (sys.argv[1:] if argv is None else argv))
    try:
        args = build_parser().parse_args(argv)  # argparse's own errors: one line, SystemExit(2)
        if args.command in CLEANS_SHM:
            from autotune.trials.runner import remove_stale_shm_at_start

            remove_stale_shm_at_start()  # what trials of a killed tuner left in /dev/shm, whatever its run
        return int(args._run(args) or 0)
    except ConfigError as err:
        print(f"{args._prog}: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except (OpBuildFailed, NoSpaceLeft) as err:  # the machine cannot build an op, or its disk is full: what to fix
        print(f"{args._prog}: error: {one_line(str(err))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{args._prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `autotune estimate --json | head`: the reader left, nothing to report
        _silence_stdout()
        return 1
    except Exception as err:  # noqa: BLE001  the guard: anything else is one line and a log, not a traceback
        full = disk_full(err)
        if full is not None:  # a full disk, wherever it was met: the machine's fault, named (no log: no room)
            where = full[0] or getattr(args, "_run_dir", None) or os.getcwd()
            print(f"{args._prog}: error: {one_line(str(NoSpaceLeft(where, full[1])))}", file=sys.stderr)
            return 1
        return internal_error(args, err)


def internal_error(args: argparse.Namespace, err: Exception) -> int:
    """Say that a bug (or a fault of the machine) ended the command, in one line naming where the traceback
    was written; print the traceback as well under --debug. Exit status 1."""
    text = "".join(traceback.format_exception(err))
    log = write_error_log(text, getattr(args, "_run_dir", None))
    where = f"traceback in {log}" if isinstance(log, Path) else f"traceback not saved: {log}"
    message = one_line(f"{type(err).__name__}: {err}")
    if getattr(args, "debug", False):
        print(text, end="", file=sys.stderr)
    print(f"{args._prog}: internal error: {message} ({where})", file=sys.stderr)
    return 1


def write_error_log(text: str, run_dir: str | Path | None) -> Path | str:
    """The traceback in `<run_dir>/logs/` when the command has a run directory (one file per error), else in
    the user's cache (~/.cache/ds-autotune/last-error.log), else a new file in the temp directory; the path,
    or why it could not be written. Written under a fresh name then renamed: a planted symlink is replaced,
    never followed."""
    stamp = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{os.getpid()}"
    places: list[tuple[Path, str | None]] = []
    if run_dir is not None and Path(run_dir).is_dir():
        places.append((Path(run_dir) / "logs", f"error-{stamp}.log"))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    places.append((Path(cache) / "ds-autotune", ERROR_LOG))
    places.append((Path(tempfile.gettempdir()), None))  # None: keep mkstemp's unique name
    reason = "no place to write it"
    for folder, name in places:
        temp = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix="ds-autotune-error-", suffix=".log", dir=folder)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            if name is None:
                return Path(temp)
            os.replace(temp, folder / name)
            return folder / name
        except OSError as err:
            reason = f"{folder}: {err.strerror or err}"
            if temp is not None and name is not None:
                Path(temp).unlink(missing_ok=True)
    return reason


# What str.splitlines breaks at, besides "\n": shown escaped when a message quotes a value holding one.
_BREAKS = {c: c.encode("unicode_escape").decode() for c in "\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


def one_line(text: str) -> str:
    """The message on one line, whatever it holds: a parser's message may quote several lines of a file (joined
    with spaces), a value typed may hold a carriage return (escaped: '\\r')."""
    joined = " ".join(part.strip() for part in text.strip().split("\n"))
    return "".join(_BREAKS.get(c, c) for c in joined)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured by a test)
        pass


if __name__ == "__main__":
    sys.exit(main())
