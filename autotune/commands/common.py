"""Arguments shared by several commands, with one-line errors that name the bad value."""

from __future__ import annotations

import argparse
import sys

from autotune.config import ConfigError
from autotune.hardware import PROFILES, Hardware, load_hardware
from autotune.space import Space
from autotune.units import parse_size
from autotune.workload import PRESETS, Workload, make_workload
from autotune.search_spaces import load_choices


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


def model_name(text: str) -> str:
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}: allowed {', '.join(PRESETS)}")
    return text


def hardware_name(text: str) -> Hardware:
    try:
        return load_hardware(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_workload_arguments(parser: argparse.ArgumentParser, *, default_model: str | None = "tiny") -> None:
    parser.add_argument("--model", type=model_name, default=default_model,
                        help=f"built-in model preset: {', '.join(PRESETS)} (default: %(default)s)")
    parser.add_argument("--gpus", type=positive_int, default=1, help="data-parallel devices (default: 1)")
    parser.add_argument("--global-batch", type=positive_int, default=None,
                        help="samples per optimizer step over all devices (default: 16 for tiny, else 32 x gpus)")
    parser.add_argument("--hardware", type=hardware_name, default=None,
                        help=f"profile: {', '.join(PROFILES)}, or a YAML file (default: cpu for tiny, else a100-80gb)")
    parser.add_argument("--space", default=None,
                        help="search-space YAML, or a preset name: default, cpu (default: cpu on CPU hardware)")


def workload_from(args: argparse.Namespace) -> Workload:
    return make_workload(args.model, args.global_batch, args.gpus)


def hardware_from(args: argparse.Namespace) -> Hardware:
    if args.hardware is not None:
        return args.hardware
    return PROFILES["cpu" if args.model == "tiny" else "a100-80gb"]


def space_from(args: argparse.Namespace, workload: Workload, hardware: Hardware) -> Space:
    name = args.space or ("cpu" if hardware.is_cpu else "default")
    return Space(load_choices(name), workload, hardware)


def fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
