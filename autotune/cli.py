"""`autotune` command line: one module per command under autotune/commands.

One error path for every command: bad input is one line `autotune <cmd>: error: ...` and exit 2 (argparse's
type functions in autotune.values.argtypes, and ConfigError from the library); a DeepSpeed op the trials need that
cannot be built (autotune.trials.ops.OpBuildFailed) is one line naming the fix, exit 1; Ctrl-C is exit 130; anything else is a
bug or a fault of the machine, reported as one line naming the exception and the file its traceback was
written to, exit 1 (`--debug` prints the traceback too); a full disk (autotune.files.disk_full) is one line naming
the path and "no space left", exit 1. Never a bare traceback.

The habits of other command lines (issue 43): bare `autotune` prints the commands and exits 2, `--version`; a
mistyped choice or flag gets its closest name; a reader that leaves early (`| head -1`) ends the command quietly,
exit 0; DeepSpeed's log lines go to stderr, so that stdout holds only the command's output; `--quiet` / `--verbose`
before or after the command (the displays read `args.quiet` / `args.verbose`)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import tempfile
import traceback
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, NoReturn, Sequence

from autotune import __version__
from autotune.values.config import ConfigError
from autotune.values.models import did_you_mean
from autotune.files import NoSpaceLeft, disk_full
from autotune.trials.ops import OpBuildFailed
from autotune.values.settings import SETTINGS

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
# Flags of every command, before or after its name: (flag, help).
GLOBAL_FLAGS = (
    ("--debug", "on an internal error, print its traceback (it is always written to a log file)"),
    ("--quiet", "print only the results and errors: no progress, live line or notes (warnings still go to stderr)"),
    ("--verbose", "also print DeepSpeed's INFO log lines and each trial's phases as they change, on stderr"),
)
DEEPSPEED_LOGGING = "deepspeed.utils.logging"  # creates the logger "DeepSpeed" with a handler on sys.stdout


class ArgumentParser(argparse.ArgumentParser):
    """Bad input is one line naming the value, and exit code 2; a mistyped choice gets its closest name."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            hint = did_you_mean(value, action.choices or ())
            if not hint:
                raise
            choices = ", ".join(map(repr, action.choices or ()))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint}: choose from {choices}") from None


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="autotune", description="Find the fastest DeepSpeed memory config that fits.")
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    for flag, help_text in GLOBAL_FLAGS:
        parser.add_argument(flag, action="store_true", help=help_text)
    # Not required by argparse: bare `autotune` prints the commands (main), not only argparse's one line.
    sub = parser.add_subparsers(dest="command", metavar="command", parser_class=ArgumentParser)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"autotune.commands.{name.replace('-', '_')}")
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        for each in parsers_by_prog(command).values():  # `surface record --quiet` too
            for flag, flag_help in GLOBAL_FLAGS:  # SUPPRESS keeps `autotune --debug tune` from being reset to False
                each.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=flag_help)
        # _run_dir: where the internal-error log goes; a command sets it once it knows its run directory
        command.set_defaults(_run=module.run, _prog=command.prog, _run_dir=None)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line parsed, or SystemExit(2) after one line: an unrecognized argument is named by the
    command that does not know it (with its closest flag), bare `autotune` prints the commands on stdout."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # After `--`, the script's own arguments as the shell split them (`tune --script train.py -- --deepspeed ...`).
    script_argv = argv[argv.index("--") + 1:] if "--" in argv else None
    ours = with_negative_values(argv[:argv.index("--")] if script_argv is not None else argv, parser)
    args, extra = parser.parse_known_args(ours)
    args.script_argv = script_argv
    if args.command is None and not extra:
        parser.print_help(sys.stdout)  # the commands, as `git` alone prints them; the error line on stderr
        parser.error(f"a command is required: one of {', '.join(COMMANDS)} ({parser.prog} COMMAND --help)")
    owner = parsers_by_prog(parser).get(getattr(args, "_prog", parser.prog), parser)
    if extra:  # argparse would name `autotune`, whichever command did not know them
        flag = next((a.split("=")[0] for a in extra if a.startswith("-")), "")
        if args.command and flag in owner._option_string_actions:  # the command's own flag, before its name
            owner.error(f"{flag} before the command: {args.command}'s options go after its name "
                        f"({parser.prog} {args.command} {flag} ...)")
        owner.error(f"unrecognized arguments: {' '.join(extra)}{did_you_mean(flag, owner._option_string_actions)}")
    if args.quiet and args.verbose:
        owner.error("--quiet and --verbose: choose one")
    if script_argv is not None and not getattr(args, "script", None):
        owner.error(f"arguments after --: {' '.join(script_argv) or 'none'}: only with --script (they are the script's)")
    if vars(args).get("script_args") and not getattr(args, "script", None):
        owner.error(f"--script-args {args.script_args!r}: only with --script (they are the script's)")
    if script_argv is not None and vars(args).get("script_args"):
        owner.error("--script-args and arguments after --: choose one way to give the script's arguments")
    return args


def with_negative_values(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--memory-budget -2GiB` as `--memory-budget=-2GiB`, so that the option's own check names the value ("must
    be positive") where argparse would take `-2GiB` for a flag and say "expected one argument". Only after a flag
    that takes one value in some command (no flag starts with a digit)."""
    takes_value = {flag for sub in parsers_by_prog(parser).values() for flag, action in sub._option_string_actions.items()
                   if action.nargs is None and not isinstance(action, argparse._SubParsersAction)}
    out: list[str] = []
    for word in argv:
        if out and len(word) > 1 and word[0] == "-" and word[1].isdigit() and out[-1] in takes_value:
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def parsers_by_prog(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every parser of the command line (subcommands' too) by its program name ("autotune surface show")."""
    found = {parser.prog: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.update(parsers_by_prog(sub))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = argparse.Namespace(_prog="autotune", _run_dir=None,
                              debug="--debug" in (sys.argv[1:] if argv is None else argv))
    try:
        args = parse(argv)  # argparse's own errors: one line, SystemExit(2)
        with deepspeed_logs_to_stderr(verbose=args.verbose):
            if args.command in CLEANS_SHM:
                from autotune.trials.runner import remove_stale_shm_at_start

                remove_stale_shm_at_start()  # what trials of a killed tuner left in /dev/shm, whatever its run
            code = int(args._run(args) or 0)
            sys.stdout.flush()  # here, not at exit: a reader that left is a BrokenPipeError this guard handles
            return code
    except ConfigError as err:
        print(f"{args._prog}: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except (OpBuildFailed, NoSpaceLeft) as err:  # the machine cannot build an op, or its disk is full: what to fix
        print(f"{args._prog}: error: {one_line(str(err))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the command's own handling: where it left things
        print(f"{args._prog}: interrupted{_resume_hint(getattr(args, '_run_dir', None))}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `autotune estimate | head -1`: the reader had what it wanted, as `git log | head`
        _silence_stdout()
        return 0
    except SystemExit as done:
        if done.code == 1 and _stdout_silenced():  # rich's own answer to a reader that left (on_broken_pipe)
            return 0
        raise
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


@contextmanager
def deepspeed_logs_to_stderr(*, verbose: bool) -> Iterator[None]:
    """While a command runs, DeepSpeed's logger writes to stderr (at INFO under --verbose), whenever the
    command imports DeepSpeed: stdout holds only the command's output."""
    hook = DeepSpeedLogs(verbose=verbose)
    if DEEPSPEED_LOGGING in sys.modules:  # imported by an earlier command of this process
        hook.to_stderr()
    sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        sys.meta_path.remove(hook)


class DeepSpeedLogs:
    """An import hook: right after `deepspeed.utils.logging` has made the logger "DeepSpeed" (its handler on
    sys.stdout: "[WARNING] ... Setting accelerator to CPU" amid a table), its handlers write to stderr instead.
    Only that one module is found here (by the finder that would have found it); nothing is imported for it."""

    def __init__(self, *, verbose: bool) -> None:
        self.verbose = verbose

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != DEEPSPEED_LOGGING:
            return None
        for finder in sys.meta_path:  # the finder that would have found it without this hook
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if finder is not self and find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenCall(spec.loader, self.to_stderr)
                return spec
        return None

    def to_stderr(self) -> None:
        ds_logger = logging.getLogger("DeepSpeed")
        level = logging.INFO if self.verbose else logging.WARNING  # DeepSpeed's own default: WARNING
        ds_logger.setLevel(level)
        for kept in [f for f in ds_logger.filters if isinstance(f, _NotTheDriversAccelerator)]:
            ds_logger.removeFilter(kept)  # an earlier command of this process (a test's) added it
        if not self.verbose:
            ds_logger.addFilter(_NotTheDriversAccelerator())
        for handler in ds_logger.handlers:
            if type(handler) is logging.StreamHandler:  # DeepSpeed's own: not a file's, not a test's capture
                handler.stream = _Stderr()  # not setStream: it flushes the old stream, perhaps closed (a test's)
                handler.setLevel(level)


class _NotTheDriversAccelerator(logging.Filter):
    """Drops DeepSpeed's accelerator detection line ("Setting accelerator to CPU. If you have GPU ... we were unable
    to detect it") in this process: the tuner imports DeepSpeed only to check configs, and on a CPU machine the
    line came amid the summary as if something failed. Trials pick their accelerator in their own processes, whose
    logs keep the line; --verbose keeps it here too."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.filename != "real_accelerator.py"


class _ThenCall:
    """A module loader that calls `after()` once the module has run (anything else is the loader's own)."""

    def __init__(self, loader: Any, after: Any) -> None:
        self._loader, self._after = loader, after

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._after()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Stderr:
    """sys.stderr as it is when written to (a test's capture, rich's live display), not when a handler was made."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _stdout_silenced() -> bool:
    """Whether stdout now points at /dev/null (as rich's Console.on_broken_pipe leaves it before SystemExit(1))."""
    try:
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull))
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured by a test)
        return False


def _resume_hint(run_dir: Path | None) -> str:
    """For a sweep's run directory (tune's run.json, a sweep file's copy): how to go on, and that no recorded trial is
    lost; '' for anything else."""
    if run_dir is None:
        return ""
    if (Path(run_dir) / SETTINGS).is_file():
        return (f"; {run_dir} keeps every recorded trial: continue with the same command and --resume (`autotune "
                f"report {run_dir}` writes its outputs so far)")
    from autotune.search.rundir import SWEEP_COPY

    if (Path(run_dir) / SWEEP_COPY).is_file():
        return f"; {run_dir} keeps every recorded trial: continue with the same command and --resume --out {run_dir}"
    return ""


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured by a test)
        pass


if __name__ == "__main__":
    sys.exit(main())
