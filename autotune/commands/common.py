"""Arguments shared by several commands, with one-line errors that name the bad value."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from autotune.config import ConfigError
from autotune.devices import AUTO, LocalMachine, auto_hardware, check_machine, probe
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


def hardware_name(text: str) -> Hardware | str:
    if text == AUTO:
        return AUTO  # detected when the command runs (autotune.devices)
    try:
        return load_hardware(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_workload_arguments(parser: argparse.ArgumentParser, *, default_model: str | None = "tiny") -> None:
    parser.add_argument("--model", type=model_name, default=default_model,
                        help=f"built-in model preset: {', '.join(PRESETS)} (default: %(default)s)")
    parser.add_argument("--gpus", type=positive_int, default=None,
                        help="data-parallel devices (default: the GPUs found with --hardware auto, else 1)")
    parser.add_argument("--global-batch", type=positive_int, default=None,
                        help="samples per optimizer step over all devices (default: 16 for tiny, else 32 x gpus)")
    parser.add_argument("--hardware", type=hardware_name, default=None, help=HARDWARE_HELP)
    parser.add_argument("--space", default=None,
                        help="search-space YAML, or a preset name: default, cpu (default: cpu on CPU hardware)")


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
    workload = make_workload(args.model, args.global_batch, gpus)
    if real and check:
        check_here(hardware, gpus, getattr(args, "memory_budget", None), machine)
    return Target(workload, hardware, machine)


def hardware_of(args: argparse.Namespace, *, real: bool) -> tuple[Hardware, LocalMachine | None]:
    """--hardware as a profile, and the machine if it was probed for `auto` (the default for real trials)."""
    if args.hardware == AUTO or (args.hardware is None and real):
        machine = probe()
        return auto_hardware(machine), machine
    return args.hardware or PROFILES["cpu" if getattr(args, "model", None) == "tiny" else "a100-80gb"], None


def gpus_found(machine: LocalMachine | None) -> int:
    """--gpus's default: every GPU that --hardware auto found, else one rank."""
    return len(machine.gpus) if machine is not None and machine.gpus else 1


def check_here(hardware: Hardware, ranks: int, memory_budget_bytes: int | None,
               machine: LocalMachine | None = None) -> None:
    """Refuse a profile whose real trials cannot run on this machine (autotune.devices.check_machine)."""
    if not hardware.is_cpu:  # the CPU accelerator runs anywhere: no need to probe
        check_machine(hardware, ranks, machine or probe(), memory_budget_bytes or hardware.memory_bytes)


def space_from(args: argparse.Namespace, workload: Workload, hardware: Hardware) -> Space:
    name = args.space or ("cpu" if hardware.is_cpu else "default")
    return Space(load_choices(name), workload, hardware)


def fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
