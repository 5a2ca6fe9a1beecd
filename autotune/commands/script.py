"""The command-line side of script mode (`--script` of `autotune tune` and `autotune trial`): the placeholder
workload and the hardware, refused before any trial where this machine cannot run them. The sweep's settings
are autotune.api.resolve's (TuneSpec.for_script); what script mode adds to a sweep is autotune.script.session's."""

from __future__ import annotations

import argparse

from autotune.commands.common import hardware_of
from autotune.trials.devices import gpus_found, require_here
from autotune.values.hardware import Hardware
from autotune.script.session import placeholder
from autotune.values.workload import Workload


def script_target(args: argparse.Namespace) -> tuple[Workload, Hardware]:
    """The placeholder workload and the hardware (--hardware, default auto: this machine's devices), refused
    before any trial if this machine cannot run it (unless a remote Ray cluster runs the trials)."""
    hardware, machine = hardware_of(args, real=True)
    workload = placeholder(args.global_batch, args.gpus or gpus_found(machine))
    if getattr(args, "ray_address", None) in (None, "local"):  # a remote cluster's devices are Ray's to place
        require_here(hardware, workload.gpus, args.memory_budget, machine)
    return workload, hardware
