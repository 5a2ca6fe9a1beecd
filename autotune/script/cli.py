"""The command-line flags of script mode, shared by `autotune tune` and `autotune trial` (kept free of heavy
imports: the CLI builds every command's parser at start)."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING

from autotune.values.argtypes import input_file
from autotune.values.config import ConfigError

if TYPE_CHECKING:
    from autotune.backends.script import Script


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("script mode (tune your own training script, unchanged)")
    group.add_argument("--script", type=input_file, default=None,
                       help="your DeepSpeed training script; each trial runs it with the trial's config applied at "
                            "deepspeed.initialize (instead of the built-in --model)")
    group.add_argument("--script-args", default="",
                       help='the script\'s arguments as one string, e.g. "--deepspeed_config ds.json --steps 100"')


def script_from(args: argparse.Namespace) -> "Script":
    from autotune.backends.script import Script

    try:
        script_args = tuple(shlex.split(args.script_args or ""))
    except ValueError as err:
        raise ConfigError(f"--script-args {args.script_args!r}: {err}") from None
    return Script(str(args.script), script_args)
