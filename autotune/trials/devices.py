"""The devices of this machine, the hardware profile that describes them (`--hardware auto`), and the check
that a profile's trials can run here at all.

Detection runs in a child process (`python -m autotune.trials.devices` prints JSON), and only where an NVIDIA driver
is installed (elsewhere torch could not see a GPU either): the tuner process never creates a CUDA context of
its own, so none of the device's memory is held by it while trials measure theirs.
A CUDA device is mapped to a built-in profile by its name (`PROFILE_BY_NAME`), with the memory, the number of
devices and the precisions of the device itself (bf16 from compute capability 8.0); a GPU no rule knows gets
the figures of its generation's profile, named after the device. Without CUDA, the `cpu` profile with this
machine's memory and cores, and its bf16 as this CPU runs it (`cpu_bf16`): native with AVX-512 BF16 or AMX,
else emulated, which the profile prices `EMULATED_BF16_SLOWDOWN` times slower than fp32.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from autotune.values.config import ConfigError
from autotune.values.allocator import DEFAULT_ALLOCATOR, check_allocator
from autotune.values.allocator import from_environment as allocator_from_environment
from autotune.values.hardware import CPU_BF16, PROFILES, Hardware, with_cpu_bf16
from autotune.values.units import format_size

AUTO = "auto"
PROBE_TIMEOUT_S = 180.0
# Device name (as CUDA reports it) -> built-in profile, first match wins (L40S before L4, GH200 before H200).
PROFILE_BY_NAME: tuple[tuple[str, str], ...] = (
    (r"\bG?B200\b", "b200"),
    (r"\bG?H200\b", "h200"),
    (r"\bG?H[18]00\b", "h100-80gb"),
    (r"\bA[18]00\b.*\b40GB\b", "a100-40gb"),
    (r"\bA[18]00\b", "a100-80gb"),
    (r"\bV100\b", "v100-32gb"),
    (r"\bL40S\b", "l40s"),
    (r"\bL4\b", "l4"),
    (r"\bA10G?\b", "a10g"),
)
BF16_CAPABILITY = (8, 0)  # Ampere and later
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")
CPUINFO = "/proc/cpuinfo"
# CPU flags (x86 `flags`, Arm `Features`) of bf16 instructions oneDNN uses natively: AVX-512 BF16 (Cooper Lake,
# Zen 4 and later), AMX (Sapphire Rapids and later), Arm's BF16 extension. Without them torch falls back to
# converting each element (measured: benchmarks/results/cpu_bf16.md).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class LocalMachine:
    """What `probe` found: CUDA GPUs visible to this process (none: a CPU machine), host memory and cores."""

    gpus: tuple[Gpu, ...]
    host_memory_bytes: int
    cpu_count: int
    cpu_bf16: str | None = None  # "native" or "emulated" (cpu_bf16()); None: not read


    @property
    def accelerator(self) -> str:
        return "cuda" if self.gpus else "cpu"

    def describe(self) -> str:
        host = f"{self.cpu_count} cores, {format_size(self.host_memory_bytes)} RAM"
        if not self.gpus:
            bf16 = f", bf16 {self.cpu_bf16}" if self.cpu_bf16 else ""
            return f"no CUDA GPU, CPU only ({host}{bf16})"
        names = sorted({g.name for g in self.gpus})
        gpu = self.gpus[0]
        return (f"{len(self.gpus)} x {' / '.join(names)} ({format_size(gpu.memory_bytes)}, "
                f"compute capability {gpu.capability[0]}.{gpu.capability[1]}; {host})")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LocalMachine":
        gpus = tuple(Gpu(str(g["name"]), int(g["memory_bytes"]), (int(g["capability"][0]), int(g["capability"][1])))
                     for g in data.get("gpus", ()))
        bf16 = data.get("cpu_bf16")
        return cls(gpus, int(data["host_memory_bytes"]), int(data["cpu_count"]), None if bf16 is None else str(bf16))


def probe(python: str = sys.executable) -> LocalMachine:
    """This machine's devices as the interpreter `python` (the one trials run with) sees them."""
    if not nvidia_driver_present():  # torch could not see a CUDA device either: spare the import (seconds)
        return LocalMachine((), host_memory_bytes(), os.cpu_count() or 1, cpu_bf16(python=python))
    try:
        done = subprocess.run([python, "-m", "autotune.trials.devices"], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"cannot detect this machine's devices with {python}: {err}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"cannot detect this machine's devices with {python}: {last}")
    return LocalMachine.from_dict(json.loads(done.stdout))


def nvidia_driver_present() -> bool:
    return any(os.path.exists(p) for p in NVIDIA_DRIVER_FILES) or shutil.which("nvidia-smi") is not None


def host_memory_bytes() -> int:
    """Physical memory, or this process's cgroup limit where that is lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = open(path).read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def cpu_bf16(cpuinfo: str = CPUINFO, python: str = sys.executable) -> str:
    """How this CPU runs bf16: "native" or "emulated". The flags of /proc/cpuinfo when it can be read (no
    import, no timing: DeepSpeed's CPU accelerator says bf16 is supported on every CPU); elsewhere torch's own
    answer (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`), asked in a child process as the GPU probe is."""
    flags = cpu_flags(cpuinfo)
    if flags is not None:
        return "native" if flags & BF16_FLAGS else "emulated"
    return "native" if mkldnn_bf16(python) else "emulated"


def cpu_flags(cpuinfo: str = CPUINFO) -> frozenset[str] | None:
    """The first processor's flags (x86) or features (Arm) in /proc/cpuinfo; None where there is none."""
    try:
        text = open(cpuinfo).read()
    except OSError:
        return None
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else None


def cpu_model(cpuinfo: str = CPUINFO) -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else the platform's word for it)."""
    try:
        text = open(cpuinfo).read()
    except OSError:
        text = ""
    match = re.search(r"^model name\s*:(.*)$", text, re.MULTILINE)
    return match.group(1).strip() if match else (platform.processor() or platform.machine())


def mkldnn_bf16(python: str = sys.executable) -> bool:
    """torch's answer: does oneDNN run bf16 on this CPU (False where it cannot be asked)."""
    code = "import torch; print(bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip().endswith("True")


def _probe_here() -> dict[str, Any]:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"name": props.name, "memory_bytes": props.total_memory,
                         "capability": [props.major, props.minor]})
    return {"gpus": gpus, "host_memory_bytes": host_memory_bytes(), "cpu_count": os.cpu_count() or 1}


def profile_name(gpu_name: str) -> str | None:
    for pattern, name in PROFILE_BY_NAME:
        if re.search(pattern, gpu_name, re.IGNORECASE):
            return name
    return None


def auto_hardware(machine: LocalMachine) -> Hardware:
    """The profile of this machine: a built-in one matched by name, with the device's own figures."""
    if not machine.gpus:
        profile = PROFILES["cpu"].with_(memory_bytes=machine.host_memory_bytes,
                                        host_memory_bytes=machine.host_memory_bytes, gpus_per_node=machine.cpu_count)
        return with_cpu_bf16(profile, machine.cpu_bf16) if machine.cpu_bf16 in CPU_BF16 else profile
    gpu = min(machine.gpus, key=lambda g: g.memory_bytes)  # a mixed node: the smallest device bounds a config
    name = profile_name(gpu.name)
    if name is None:  # an unknown GPU: its generation's figures until calibration replaces them
        base = "h100-80gb" if gpu.capability >= (9, 0) else "a100-80gb" if gpu.capability >= (8, 0) else "v100-32gb"
        profile = PROFILES[base].with_(name=re.sub(r"[^a-z0-9]+", "-", gpu.name.lower()).strip("-") or "gpu")
    else:
        profile = PROFILES[name]
    flops = dict(profile.peak_flops)
    if gpu.capability < BF16_CAPABILITY:
        flops.pop("bf16", None)
    elif "bf16" not in flops:
        flops["bf16"] = flops["fp16"]
    return profile.with_(memory_bytes=gpu.memory_bytes, peak_flops=flops, gpus_per_node=len(machine.gpus),
                         host_memory_bytes=machine.host_memory_bytes)


def check_machine(hardware: Hardware, ranks: int, machine: LocalMachine, memory_budget_bytes: int | None = None) -> None:
    """Refuse, before any trial, a profile whose trials cannot run on this machine (ConfigError, one line)."""
    if hardware.is_cpu:
        return  # DeepSpeed's CPU accelerator runs on any machine
    if not machine.gpus:
        raise ConfigError(f"--hardware (`hardware`) {hardware.name} is a GPU profile, but this machine has {machine.describe()}: "
                          "real trials need the GPUs they are measured on; use --hardware auto (or cpu) here, or "
                          "the simulated backend to predict a GPU")
    if ranks > len(machine.gpus):
        raise ConfigError(f"--gpus (the workload's `gpus`) {ranks}: a trial runs one rank per GPU and this machine has {len(machine.gpus)} "
                          f"({machine.describe()}): allowed 1 to {len(machine.gpus)}")
    smallest = min(g.memory_bytes for g in machine.gpus)
    if memory_budget_bytes is not None and memory_budget_bytes > smallest:
        raise ConfigError(f"memory budget {format_size(memory_budget_bytes)} is more than this machine's GPU holds "
                          f"({format_size(smallest)}: {machine.describe()}): allowed up to {format_size(smallest)}")


def resolve_hardware(choice: Hardware | str | None, *, real: bool, model: str | None = None,
                     allocator: str | None = None) -> tuple[Hardware, LocalMachine | None]:
    """A profile from `--hardware` (a Hardware, `auto` or None), and the machine if it was probed: `auto`, the
    default for real trials, detects this machine; otherwise the CPU profile for tiny, else a100-80gb. Its CUDA
    allocator mode (autotune.values.allocator): `allocator` if chosen, else the profile's own when it names one, else
    what this process's PYTORCH_CUDA_ALLOC_CONF says (the trials inherit it); a CPU profile has none."""
    hardware, machine = _resolve_profile(choice, real=real, model=model)
    if allocator is None and not hardware.is_cpu and hardware.allocator == DEFAULT_ALLOCATOR:
        allocator = allocator_from_environment(os.environ)
    return (hardware if allocator is None else hardware.with_(allocator=check_allocator(allocator))), machine


def _resolve_profile(choice: Hardware | str | None, *, real: bool,
                     model: str | None) -> tuple[Hardware, LocalMachine | None]:
    if choice == AUTO or (choice is None and real):
        machine = probe()
        return auto_hardware(machine), machine
    if isinstance(choice, Hardware):
        if real and choice.is_cpu and choice.cpu_bf16 is None:  # a CPU profile run here: this CPU's bf16
            return with_cpu_bf16(choice, cpu_bf16()), None
        return choice, None
    if choice is not None:
        raise ConfigError(f"hardware {choice!r}: expected a profile or {AUTO!r}")
    return PROFILES["cpu" if model == "tiny" else "a100-80gb"], None


def check_auto_ranks(machine: LocalMachine, ranks: int) -> None:
    """A prediction (estimate, the simulated backend) for `--hardware auto`: on a machine without a GPU, auto is
    the cpu profile with one rank per core, and more ranks than cores is a question about GPUs this machine
    cannot answer ("8 x cpu"): refused in one line naming what auto found and what to pass. Real trials on the
    CPU keep any rank count (DeepSpeed's CPU accelerator runs them, their threads shared: runner.rank_threads)."""
    if machine.gpus or ranks <= machine.cpu_count:
        return
    gpu_profiles = ", ".join(name for name, profile in PROFILES.items() if not profile.is_cpu)
    raise ConfigError(f"--gpus (the workload's `gpus`) {ranks} with --hardware auto: auto found {machine.describe()}, whose cpu profile runs "
                      f"1 to {machine.cpu_count} ranks; to predict {ranks} GPUs pass --hardware <a GPU profile> "
                      f"({gpu_profiles}) or a YAML file")


def gpus_found(machine: LocalMachine | None) -> int:
    """--gpus's default: every GPU that `auto` found, else one rank."""
    return len(machine.gpus) if machine is not None and machine.gpus else 1


def require_here(hardware: Hardware, ranks: int, memory_budget_bytes: int | None,
                 machine: LocalMachine | None = None) -> None:
    """Refuse a profile whose real trials cannot run on this machine (check_machine), probing only when the
    profile needs a GPU: the CPU accelerator runs anywhere. `memory_budget_bytes`: a budget the user chose
    (None: the profile's memory, a nominal figure a little above what the device reports: 80 GiB vs 79.1)."""
    if not hardware.is_cpu:
        check_machine(hardware, ranks, machine or probe(), memory_budget_bytes)


if __name__ == "__main__":
    if sys.argv[1:] == ["--cpu"]:  # one line for a person (scripts/test prints it first: CI's timings depend on it)
        print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; bf16 {cpu_bf16()}")
    else:
        print(json.dumps(_probe_here()))
