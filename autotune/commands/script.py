"""The command-line side of script mode (`--script` of `autotune tune` and `autotune trial`): its flags, the script
and its arguments, the placeholder workload and the hardware, refused before any trial where this machine cannot
run them. The sweep's settings are autotune.api.resolve's (TuneSpec.for_script); what script mode adds to a sweep
is autotune.outputs.script's."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.commands.common import hardware_of
from autotune.trials.devices import gpus_found, require_here
from autotune.values.hardware import Hardware
from autotune.outputs.script import placeholder
from autotune.values.argtypes import input_file
from autotune.values.config import ConfigError
from autotune.values.workload import Workload

if TYPE_CHECKING:
    from autotune.backends.script import Script


def script_target(args: argparse.Namespace) -> tuple[Workload, Hardware]:
    """The placeholder workload and the hardware (--hardware, default auto: this machine's devices), refused
    before any trial if this machine cannot run it (unless a remote Ray cluster runs the trials)."""
    hardware, machine = hardware_of(args, real=True)
    workload = placeholder(args.global_batch, args.gpus or gpus_found(machine))
    if getattr(args, "ray_address", None) in (None, "local"):  # a remote cluster's devices are Ray's to place
        require_here(hardware, workload.gpus, args.memory_budget, machine)
    return workload, hardware


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("script mode (tune your own training script, unchanged)")
    group.add_argument("--script", type=input_file, default=None,
                       help="your DeepSpeed training script; each trial runs it with the trial's config applied at "
                            "deepspeed.initialize (instead of the built-in --model)")
    group.add_argument("--script-args", default="",
                       help='the script\'s arguments as one string, e.g. "--deepspeed_config ds.json --steps 100"; or '
                            'give them after --, as the shell splits them: --script train.py -- --deepspeed ds.json')


def script_from(args: argparse.Namespace) -> "Script":
    from autotune.backends.script import Script  # not at import: the CLI builds every command's parser at start

    if getattr(args, "seq_len", None) is not None:  # it would be ignored: the script's own data decide it
        raise ConfigError(f"--seq-len {args.seq_len} with --script {args.script}: the script brings its model and its "
                          "sequence length (allowed: --seq-len with --model)")
    if getattr(args, "script_argv", None) is not None:  # after `--`: as the shell split them
        return Script(str(args.script), tuple(args.script_argv))
    try:
        script_args = tuple(shlex.split(args.script_args or ""))
    except ValueError as err:
        raise ConfigError(f"--script-args {args.script_args!r}: {err}") from None
    return Script(str(args.script), script_args)


CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--deepscale_config")  # how scripts name their ds_config.json


def script_ds_config(script_args: tuple[str, ...]) -> Path | None:
    """The DeepSpeed config file the script's arguments name (`--deepspeed_config FILE`, `--deepspeed FILE`, or
    `=FILE`), if it is a JSON file there; None otherwise (the script may build its config itself)."""
    for i, arg in enumerate(script_args):
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_FLAGS:
            path = Path(value if eq else script_args[i + 1] if i + 1 < len(script_args) else "")
            if path.suffix == ".json" and path.is_file():
                return path
    return None
