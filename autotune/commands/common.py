"""Arguments shared by several commands, with one-line errors that name the bad value."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TextIO

from autotune.values.config import ConfigError
from autotune.files import make_dir  # noqa: F401  (the commands create their output folders with it)
from autotune.trials.devices import AUTO, LocalMachine, check_auto_ranks, gpus_found, require_here, resolve_hardware
from autotune.values.hardware import PROFILES, Hardware, load_hardware
from autotune.values.models import load_model
from autotune.values.space import Space
from autotune.values.argtypes import gpu_count, positive_int, shown_path, size  # noqa: F401  (the commands' flags use them)
from autotune.values.workload import PRESETS, Workload, make_workload
from autotune.search_spaces import space_for

if TYPE_CHECKING:
    from autotune.api import Option


def model_name(text: str) -> str:
    """--model: a preset, a Hugging Face config.json or model directory, a cached Hub id or a YAML/JSON shape
    file (autotune.values.models), checked here; the text itself is kept (make_workload reads it again)."""
    try:
        load_model(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    except OSError as err:  # a name the file system refuses (too long, say) is not a model either
        raise argparse.ArgumentTypeError(f"model {shown_path(text)}: {err.strerror or err}") from None
    return text


def hardware_name(text: str) -> Hardware | str:
    if text == AUTO:
        return AUTO  # detected when the command runs (autotune.trials.devices)
    try:
        return load_hardware(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    except OSError as err:
        raise argparse.ArgumentTypeError(f"hardware {shown_path(text)}: {err.strerror or err}") from None


def add_workload_arguments(parser: argparse.ArgumentParser, *, default_model: str | None = "tiny",
                           shown_default: str | None = None) -> None:
    """The workload's flags; `shown_default`: what --help says the model's default is, where the command decides
    it later (tune: tiny, unless a replay surface or --script brings one)."""
    model_help = MODEL_HELP if shown_default is None else MODEL_HELP.replace("%(default)s", shown_default)
    parser.add_argument("--model", type=model_name, default=default_model, help=model_help)
    parser.add_argument("--seq-len", type=positive_int, default=None, help=SEQ_LEN_HELP)
    parser.add_argument("--gpus", type=gpu_count, default=None,
                        help="data-parallel devices, 1 to 4096 (default: the GPUs found with --hardware auto, else 1)")
    parser.add_argument("--global-batch", type=positive_int, default=None,
                        help="samples per optimizer step over all devices (default: 16 for tiny, else 32 x gpus; with "
                             "--script, the script's own: given, it changes the script's recipe)")
    parser.add_argument("--hardware", type=hardware_name, default=None, help=HARDWARE_HELP)
    for opt in (workload_option("allocator"), workload_option("space")):  # options of a sweep, declared on TuneSpec
        if opt.choices is not None:
            parser.add_argument(opt.flag, choices=list(opt.choices()), default=None, help=opt.help)
        else:
            parser.add_argument(opt.flag, type=opt.parse, default=None, help=opt.help)


def workload_option(name: str) -> "Option":
    """The Option of TuneSpec field `name` (autotune.api.spec_options)."""
    from autotune.api import spec_options

    return next(opt for field_name, opt, _ in spec_options() if field_name == name)


MODEL_HELP = (f"a built-in preset ({', '.join(PRESETS)}), a Hugging Face config.json or model directory (read "
              "offline), a Hub id found in the local Hugging Face cache, or a YAML/JSON file of shape keys "
              "(default: %(default)s)")
SEQ_LEN_HELP = ("tokens per sample (default: the preset's or shape file's; for a Hugging Face config its "
                "max_position_embeddings, at most 4096)")
HARDWARE_HELP = (f"auto (this machine's devices), a profile ({', '.join(PROFILES)}) or a YAML file (default: auto "
                 "for real trials, else cpu for tiny and a100-80gb for the other models)")


@dataclass(frozen=True)
class Target:
    """What a command tunes for: the workload and the hardware profile, and the machine when it was probed."""

    workload: Workload
    hardware: Hardware
    machine: LocalMachine | None = None

    def detected(self) -> str | None:
        """A line saying what --hardware auto found, or None when nothing was detected."""
        if self.machine is None:
            return None
        return f"detected {self.machine.describe()}: profile {self.hardware.name}"


def target_from(args: argparse.Namespace, *, real: bool, check: bool = True) -> Target:
    """The workload and hardware of a command. Real trials default to `--hardware auto`, and with `check`
    (they run on this machine, not on a Ray cluster's nodes) a profile this machine cannot run is refused
    here, before any trial: ConfigError naming the profile and what the machine has."""
    hardware, machine = hardware_of(args, real=real)
    gpus = args.gpus or gpus_found(machine)
    if machine is not None and not real:  # a prediction for this machine (estimate --hardware auto)
        check_auto_ranks(machine, gpus)
    workload = make_workload(args.model, args.global_batch, gpus, getattr(args, "seq_len", None))
    if real and check:
        require_here(hardware, gpus, getattr(args, "memory_budget", None), machine)
    return Target(workload, hardware, machine)


def hardware_of(args: argparse.Namespace, *, real: bool) -> tuple[Hardware, LocalMachine | None]:
    """--hardware as a profile, and the machine if it was probed for `auto` (the default for real trials)."""
    return resolve_hardware(args.hardware, real=real, model=getattr(args, "model", None),
                            allocator=getattr(args, "allocator", None))


def space_from(args: argparse.Namespace, workload: Workload, hardware: Hardware, *, check: bool = True) -> Space:
    """--space for this workload and hardware; with `check`, refused in one line when it holds no valid config."""
    return space_for(args.space, workload, hardware, check=check)


def fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


# -- --json: one JSON document on stdout ------------------------------------------------------------------

JSON_HELP = "print one JSON document on stdout (what the tables say); progress and messages go to stderr"


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def json_command(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command's `run` with --json: while it runs, whatever is written to stdout (progress, a library's log
    line, a child process's output) goes to stderr, so that stdout holds only the document `emit_json` writes.
    Errors are unchanged: one line on stderr, exit 2 (autotune.cli)."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        if not getattr(args, "json", False):
            return run(args)
        with _stdout_to_stderr() as stdout:
            args._json_out = stdout
            return run(args)

    return wrapper


def emit_json(args: argparse.Namespace, data: Any) -> None:
    """Write the command's JSON document to its real stdout (see json_command)."""
    stream: TextIO = getattr(args, "_json_out", None) or sys.stdout
    stream.write(json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n")
    stream.flush()


def jsonable(value: Any) -> Any:
    """`value` in JSON types: paths and enums as their text, a value with to_dict() as that, NaN and
    infinities as null (JSON has none)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, Enum):
        return jsonable(value.value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    return str(value)


@contextmanager
def _stdout_to_stderr() -> Iterator[TextIO]:
    """Point stdout at stderr (the file descriptor too, which child processes inherit) and yield a stream on
    the real stdout. Where stdout is no file descriptor (a test's captured stream), only sys.stdout moves."""
    sys.stdout.flush()
    try:
        out_fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        real = sys.stdout
        with redirect_stdout(sys.stderr):
            yield real
        return
    saved = os.dup(out_fd)
    real = os.fdopen(saved, "w", closefd=True)
    try:
        os.dup2(err_fd, out_fd)
        with redirect_stdout(sys.stderr):
            yield real
    finally:
        sys.stdout.flush()
        os.dup2(saved, out_fd)
        real.close()
