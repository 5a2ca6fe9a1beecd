"""The CUDA caching allocator's mode, a memory knob of a sweep (issue 25): PyTorch's default, or
`expandable_segments:True`, with which the allocator maps physical pages into one growing segment per stream
and, when an allocation would not fit, unmaps the pages of its free blocks and hands them to it (PyTorch's
c10/cuda/CUDACachingAllocator.cpp, Note [Expandable Segments]: 20 MiB pages in the large pool).

On the H200 the default allocator's reserve (reserved minus allocated at the peak: blocks cached but not in use,
fragments of the logit chain, FP16_Optimizer's freed clones, ZeRO-3's fetched parameters) put the peak 1.9-17.6
GiB above what the tensors needed (autotune.prediction.cuda_memory). With expandable segments that reserve is given back
when an allocation needs it, so what must fit is the allocated peak plus the memory outside the allocator.

The mode is a property of the hardware as the trials see it (`Hardware.allocator`): the estimator prices the
reserve by it, every trial's environment carries it (`environment`), and the recommendation's launch exports it.
A user's own PYTORCH_CUDA_ALLOC_CONF (or torch >= 2.9's PYTORCH_ALLOC_CONF) with `expandable_segments:True`
reads as `expandable` (`from_environment`); its other options are kept.
"""

from __future__ import annotations

from typing import Mapping

from autotune.values.config import ConfigError

ALLOCATORS = ("default", "expandable")
DEFAULT_ALLOCATOR = "default"
ENV = "PYTORCH_CUDA_ALLOC_CONF"
ENV_NAMES = (ENV, "PYTORCH_ALLOC_CONF")  # torch 2.9 added the second, device-neutral name; either is read
OPTION = "expandable_segments"


def check_allocator(name: object) -> str:
    if name not in ALLOCATORS:
        raise ConfigError(f"allocator {name!r}: allowed {', '.join(ALLOCATORS)}")
    return str(name)


def _options(value: str) -> dict[str, str]:
    """`key:value,key:value` (torch's format) as a mapping, in order."""
    out: dict[str, str] = {}
    for part in value.split(","):
        key, _, val = part.strip().partition(":")
        if key:
            out[key.strip()] = val.strip()
    return out


def from_environment(env: Mapping[str, str]) -> str:
    """The mode `env`'s allocator settings choose (the first of ENV_NAMES set wins, as in torch)."""
    for name in ENV_NAMES:
        if env.get(name):
            return "expandable" if _options(env[name]).get(OPTION, "").lower() == "true" else "default"
    return DEFAULT_ALLOCATOR


def environment(allocator: str, env: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables a CUDA trial of mode `allocator` gets, on top of `env` (the tuner's own): `env`'s
    settings with `expandable_segments` set to the mode, nothing when the mode is the default and `env` sets none."""
    check_allocator(allocator)
    name = next((n for n in ENV_NAMES if env.get(n)), ENV)
    options = _options(env.get(name, ""))
    if allocator == "expandable":
        options[OPTION] = "True"
    elif OPTION in options:
        options[OPTION] = "False"
    if not options:
        return {}
    return {name: ",".join(f"{k}:{v}" for k, v in options.items())}


def describe(allocator: str) -> str:
    """For the estimate's and the report's lines."""
    if allocator == "expandable":
        return f"expandable segments ({ENV}={OPTION}:True): the allocator's free blocks go back when needed"
    return "PyTorch's default caching allocator"
