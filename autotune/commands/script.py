"""The command-line side of script mode (`--script` of `autotune tune` and `autotune trial`): the flags
turned into the sweep's settings, refused before any trial where this machine cannot run them.
What script mode adds to a sweep is in autotune.script.session."""

from __future__ import annotations

import argparse

from autotune.commands.common import hardware_of, space_from
from autotune.config import ConfigError
from autotune.devices import gpus_found, require_here
from autotune.hardware import Hardware
from autotune.settings import RunSettings, memory_budget
from autotune.script.cli import script_from
from autotune.script.session import placeholder
from autotune.space import Space
from autotune.workload import Workload


def script_target(args: argparse.Namespace) -> tuple[Workload, Hardware]:
    """The placeholder workload and the hardware (--hardware, default auto: this machine's devices), refused
    before any trial if this machine cannot run it (unless a remote Ray cluster runs the trials)."""
    hardware, machine = hardware_of(args, real=True)
    workload = placeholder(args.global_batch, args.gpus or gpus_found(machine))
    if getattr(args, "ray_address", None) in (None, "local"):  # a remote cluster's devices are Ray's to place
        require_here(hardware, workload.gpus, args.memory_budget, machine)
    return workload, hardware


def resolve(args: argparse.Namespace) -> tuple[RunSettings, Space]:
    """`autotune tune --script`: the sweep's settings before the script has shown its model."""
    if args.model is not None:
        raise ConfigError(f"--model {args.model} with --script {args.script}: choose one (the script brings its model)")
    if args.backend != "deepspeed":
        raise ConfigError(f"--backend {args.backend} with --script: a script's trials are real runs (--backend deepspeed)")
    script = script_from(args)  # the script exists and its arguments parse
    if getattr(args, "ray_address", None):  # its files travel with each trial: refused here when too large
        from autotune.script.ship import plan

        plan(script.path, script.args, exclude=(args.out,) if args.out else ())
    workload, hardware = script_target(args)
    space = space_from(args, workload, hardware, check=False)  # the first trial settles its global batch
    budget = memory_budget(args.memory_budget, hardware)
    return RunSettings(workload, hardware, budget, args.strategy, "script", args.seed, space.choices), space
