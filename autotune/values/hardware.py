"""Hardware profiles: what the estimator needs to know about a device and its links.

Figures are vendor datasheet peaks (dense, no sparsity) scaled by nothing: the estimator applies its
own efficiency terms, and calibration (autotune.prediction.calibrate) fits them to measurements of a real machine.
A user adds a profile with a YAML file of the same keys (`--hardware my-gpu.yaml`).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from autotune.values.allocator import ALLOCATORS, DEFAULT_ALLOCATOR
from autotune.values.argtypes import given_path
from autotune.values.config import PRECISIONS, ConfigError
from autotune.files import exists, is_file, load_yaml, short
from autotune.values.models import did_you_mean
from autotune.values.units import format_size, parse_size

GB = 10**9
GiB = 2**30
TFLOPS = 10**12


MAX_BYTES = 2**63 - 1
CPU_BF16 = ("native", "emulated")
# bf16 where the CPU has no bf16 instructions (no AVX-512 BF16, AMX or Arm BF16): torch's fallback GEMM converts
# element by element. A training step of the built-in tiny model ran 30.3x slower than fp32 on a Xeon with
# oneDNN's bf16 turned off (benchmarks/cpu_bf16.py), 32x on an AMD EPYC with AVX2 only (issue 24: 0.42 against
# 13.3 samples/s).
EMULATED_BF16_SLOWDOWN = 30.0


def _finite_number(value: Any) -> bool:
    """An int or float a float can hold (math.isfinite raises OverflowError for an int past 1.8e308)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _positive_number(value: Any) -> bool:
    return _finite_number(value) and value > 0


_SIZE_KEYS = {"memory_bytes", "host_memory_bytes", "runtime_overhead_bytes"}
_INT_KEYS = _SIZE_KEYS | {"gpus_per_node"}
# key: (lower bound check, upper bound check, what is allowed)
_RANGES: dict[str, tuple[Any, Any, str]] = {
    "memory_bytes": (lambda v: v > 0, lambda v: v <= MAX_BYTES, "a positive size such as 80GiB"),
    "host_memory_bytes": (lambda v: v > 0, lambda v: v <= MAX_BYTES, "a positive size such as 1024GiB"),
    "runtime_overhead_bytes": (lambda v: v >= 0, lambda v: v <= MAX_BYTES, "a size >= 0 such as 1GiB"),
    "gpus_per_node": (lambda v: v >= 1, lambda v: v <= 2**20, "a whole number >= 1"),
    **{key: (lambda v: v > 0, lambda v: True, "a positive number (e.g. 768e9)")
       for key in ("mem_bandwidth", "host_link_bw", "intra_node_bw", "inter_node_bw", "cpu_adam_params_per_s",
                   "nvme_bw")},
    "step_overhead_s": (lambda v: v >= 0, lambda v: True, "a number of seconds >= 0"),
    **{key: (lambda v: v >= 0, lambda v: v <= 1, "a number of seconds in [0, 1] (e.g. 1e-5)")
       for key in ("intra_node_latency_s", "inter_node_latency_s")},
    **{key: (lambda v: v >= 0, lambda v: True, "a number of seconds >= 0 (e.g. 0.2)")
       for key in ("zero1_micro_step_s", "zero2_micro_step_s", "zero3_micro_step_s", "param_offload_step_s")},
    "max_efficiency": (lambda v: v > 0, lambda v: v <= 1, "a fraction in (0, 1]"),
    "half_efficiency_tokens": (lambda v: v >= 0, lambda v: True, "a number of tokens >= 0"),
}
_FLOAT_KEYS = set(_RANGES) - _INT_KEYS
_ADDED_KEYS = {"intra_node_latency_s", "inter_node_latency_s",  # keys later than the first run.json files
               "zero1_micro_step_s", "zero2_micro_step_s", "zero3_micro_step_s", "param_offload_step_s"}


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int  # per device
    peak_flops: dict[str, float]  # per precision; a precision absent here is unsupported on this device
    mem_bandwidth: float  # device memory, bytes/s
    host_link_bw: float  # device <-> host memory, bytes/s per device (PCIe)
    intra_node_bw: float  # collective bus bandwidth per device inside a node, bytes/s
    inter_node_bw: float  # collective bus bandwidth per device across nodes, bytes/s
    gpus_per_node: int = 8
    host_memory_bytes: int = 1024 * GiB  # per node
    cpu_adam_params_per_s: float = 1.0e9  # DeepSpeedCPUAdam updates per second, per device's share of host cores
    nvme_bw: float = 3.0 * GB  # per node
    runtime_overhead_bytes: int = 1 * GiB  # context, communicator and allocator slack outside the model's tensors
    step_overhead_s: float = 0.01  # launch latency and Python per optimizer step
    max_efficiency: float = 0.5  # best fraction of peak FLOP/s a transformer step reaches
    half_efficiency_tokens: float = 1024.0  # tokens per micro-batch at which efficiency is half the best
    is_cpu: bool = False
    # Latency of one step of a collective's algorithm (autotune.prediction.comm), inside a node and across nodes: what a
    # small message costs (NCCL over NVLink ~10 us, over InfiniBand/RoCE a few tens of us). Defaults keep the
    # profiles and run.json files written before these keys loading.
    intra_node_latency_s: float = 1e-5
    inter_node_latency_s: float = 3e-5
    # DeepSpeed's own work per micro-step at ZeRO stages 1-3 beyond compute and collectives, in seconds per 1e9
    # parameters of the model: gradient bucketing and hooks (stage 2 without an offloaded optimizer, whose
    # gradients take the offload path, priced there), gathering and releasing every module's parameters twice
    # (stage 3). 0: not measured on this device (every profile but the Hopper ones: autotune.prediction.estimate).
    zero1_micro_step_s: float = 0.0
    zero2_micro_step_s: float = 0.0
    zero3_micro_step_s: float = 0.0
    # ZeRO-3 with its parameters on the host and its optimizer on the device, per optimizer step, in seconds per 1e9
    # parameters of a rank's partition: the updated fp32 partition copied into the host's 16-bit one (DeepSpeed's
    # stage3.py, _reassign_or_swap_out_partitioned_parameters: a device-to-host copy that changes dtype, which torch
    # makes through an fp32 copy on the host). 0: not measured on this device (as the ZeRO terms).
    param_offload_step_s: float = 0.0
    # A CPU profile read off the machine it runs on (autotune.trials.devices): "native" or "emulated" bf16 (then
    # peak_flops prices bf16 EMULATED_BF16_SLOWDOWN times below fp32); None: not read (GPUs, the stock profile).
    cpu_bf16: str | None = None
    # The CUDA caching allocator's mode the trials run with (autotune.values.allocator): "default" or "expandable".
    allocator: str = DEFAULT_ALLOCATOR

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"name: {short(self.name)}: allowed a non-empty string")
        for key, (low, high, allowed) in _RANGES.items():
            value = getattr(self, key)
            if key in _INT_KEYS:
                good = isinstance(value, int) and not isinstance(value, bool)
            else:
                good = _finite_number(value)
            if not good or not low(value) or not high(value):
                raise ConfigError(f"{key}: {short(value)}: allowed {allowed}")
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ConfigError(f"peak_flops: {short(self.peak_flops)}: allowed a mapping of precision "
                              f"({', '.join(PRECISIONS)}) to FLOP/s, at least one")
        for precision, flops in self.peak_flops.items():
            if precision not in PRECISIONS:
                raise ConfigError(f"peak_flops: precision {short(precision)}: allowed {', '.join(PRECISIONS)}")
            if not _positive_number(flops):
                raise ConfigError(f"peak_flops.{precision}: {short(flops)}: allowed a positive number of FLOP/s")
        if not isinstance(self.is_cpu, bool):
            raise ConfigError(f"is_cpu: {short(self.is_cpu)}: allowed true or false")
        if self.cpu_bf16 is not None and (self.cpu_bf16 not in CPU_BF16 or not self.is_cpu):
            raise ConfigError(f"cpu_bf16: {short(self.cpu_bf16)}: allowed {', '.join(CPU_BF16)} on a CPU profile "
                              "(is_cpu: true), or null")
        if self.allocator not in ALLOCATORS or (self.is_cpu and self.allocator != DEFAULT_ALLOCATOR):
            allowed = DEFAULT_ALLOCATOR if self.is_cpu else ", ".join(ALLOCATORS)
            raise ConfigError(f"allocator: {short(self.allocator)}: allowed {allowed}"
                              + (" (a CUDA allocator mode; a CPU profile has none)" if self.is_cpu else ""))

    def supports(self, precision: str) -> bool:
        return precision in self.peak_flops

    @property
    def accelerator(self) -> str:
        """DeepSpeed's accelerator that runs this profile's trials (with gloo on cpu, NCCL on cuda)."""
        return "cpu" if self.is_cpu else "cuda"

    def with_(self, **changes: Any) -> "Hardware":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def with_cpu_bf16(profile: Hardware, how: str) -> Hardware:
    """A CPU profile as a CPU that runs bf16 `how` ("native" or "emulated") runs it: emulated, bf16 is priced
    EMULATED_BF16_SLOWDOWN times slower than fp32 (native keeps the profile's figure; calibration fits it)."""
    if how not in CPU_BF16:
        raise ConfigError(f"cpu bf16 {short(how)}: allowed {', '.join(CPU_BF16)}")
    flops = dict(profile.peak_flops)
    if how == "emulated" and "bf16" in flops:
        flops["bf16"] = flops.get("fp32", flops["bf16"]) / EMULATED_BF16_SLOWDOWN
    return profile.with_(peak_flops=flops, cpu_bf16=how)


def bf16_note(hardware: Hardware) -> str | None:
    """One line on how this CPU runs bf16, for the console and the report; None where there is nothing to say."""
    if hardware.cpu_bf16 == "emulated":
        return (f"bf16: emulated on this CPU (no AVX-512 BF16 or AMX): priced {EMULATED_BF16_SLOWDOWN:.0f}x slower "
                "than fp32")
    if hardware.cpu_bf16 == "native":
        return "bf16: native on this CPU"
    return None


def _gpu(name: str, memory_gib: int, fp32: float, half: float, bf16: bool, bw: float, pcie: float,
         nvlink: float, net: float, **extra: Any) -> Hardware:
    flops = {"fp32": fp32 * TFLOPS, "fp16": half * TFLOPS}
    if bf16:
        flops["bf16"] = half * TFLOPS
    return Hardware(name, memory_gib * GiB, flops, bw * GB, pcie * GB, nvlink * GB, net * GB, **extra)


# ZeRO's per-micro-step work on one H200 (DeepSpeed 0.19.8, torch 2.11, 1 rank: no collective to hide it), fitted
# on the step times of benchmarks/gpu-runs (benchmarks/gpu_step_time.py): a 1.1B Llama's ZeRO-3 steps took 2.3x the
# prediction without it (+0.18 to +0.26 s per micro-step over 4 trials), ZeRO-2's at micro-batch 2 2.4x (+0.079 s;
# 1 trial), ZeRO-1's 1.3x (+0.017 s; 1 trial), where ZeRO 0's were within 3-26%. The H100 shares the chip's
# generation and DeepSpeed's code path; no other GPU was measured.
HOPPER_STEP_TERMS = {"zero1_micro_step_s": 0.015, "zero2_micro_step_s": 0.072, "zero3_micro_step_s": 0.2,
                     # 11-30: z3 ck1 fp16 with the parameters offloaded at 1 and 2 micro-steps took 3.15 and 3.19 s
                     # a step more than predicted without it (the same at either count: once a step), 1.1e9
                     # parameters on one rank.
                     "param_offload_step_s": 2.9}

PROFILES: dict[str, Hardware] = {
    "v100-32gb": _gpu("v100-32gb", 32, 15.7, 125, False, 900, 12, 130, 6, host_memory_bytes=512 * GiB),
    "a100-40gb": _gpu("a100-40gb", 40, 19.5, 312, True, 1555, 24, 230, 22),
    "a100-80gb": _gpu("a100-80gb", 80, 19.5, 312, True, 2039, 24, 230, 22, host_memory_bytes=2048 * GiB),
    "h100-80gb": _gpu("h100-80gb", 80, 67, 989, True, 3350, 50, 370, 45, host_memory_bytes=2048 * GiB,
                      cpu_adam_params_per_s=2.0e9, half_efficiency_tokens=2048.0, **HOPPER_STEP_TERMS),
    "h200": _gpu("h200", 140, 67, 989, True, 4800, 50, 370, 45, host_memory_bytes=2048 * GiB,
                 cpu_adam_params_per_s=2.0e9, half_efficiency_tokens=2048.0, **HOPPER_STEP_TERMS),
    "b200": _gpu("b200", 178, 80, 2250, True, 8000, 50, 700, 45, host_memory_bytes=2048 * GiB,
                 cpu_adam_params_per_s=2.0e9, half_efficiency_tokens=4096.0),
    "l40s": _gpu("l40s", 48, 91.6, 362, True, 864, 24, 24, 12, host_memory_bytes=512 * GiB,
                 max_efficiency=0.45, half_efficiency_tokens=1024.0),
    "a10g": _gpu("a10g", 24, 31.2, 70, True, 600, 24, 10, 3, host_memory_bytes=256 * GiB,
                 max_efficiency=0.45, half_efficiency_tokens=512.0),
    "l4": _gpu("l4", 24, 30, 121, True, 300, 24, 10, 3, host_memory_bytes=256 * GiB,
               max_efficiency=0.45, half_efficiency_tokens=512.0),
    # This machine kind: 2 cores, 24 GiB, DeepSpeed's CPU accelerator with gloo. fp16 is refused there.
    # Each rank is a process sharing the host RAM; "device memory" is that RAM. Measured and calibrated
    # figures replace these guesses (autotune.prediction.calibrate).
    "cpu": Hardware("cpu", 24 * GiB, {"fp32": 0.10 * TFLOPS, "bf16": 0.10 * TFLOPS}, 20 * GB, 10 * GB,
                    2 * GB, 1 * GB, gpus_per_node=2, host_memory_bytes=24 * GiB, cpu_adam_params_per_s=2.0e8,
                    nvme_bw=1 * GB, runtime_overhead_bytes=int(0.6 * GiB), step_overhead_s=0.02,
                    max_efficiency=0.5, half_efficiency_tokens=256.0, is_cpu=True,
                    # gloo over loopback, 2 ranks on this loaded machine (load ~7): a 4 KiB all-reduce takes
                    # 0.37 ms (2 steps); 4-16 MiB ones reach 0.4-1.1 GB/s bus bandwidth (/tmp gloo probe, torch 2.13).
                    intra_node_latency_s=2e-4, inter_node_latency_s=4e-4),
}

def _as_number(value: Any) -> Any:
    """A number as people write it in YAML: 768e9 (which PyYAML reads as a string), 1.5e12, 900_000_000."""
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return value
    return value


def _as_size(key: str, value: Any, source: str) -> Any:
    if isinstance(value, str):
        number = _as_number(value)
        if isinstance(number, float):
            value = number
    if key == "runtime_overhead_bytes" and value == 0 and not isinstance(value, bool):
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{source}: {key}: {short(value)}: allowed a size such as 40GiB or a number of bytes")
    try:
        return parse_size(value)
    except (ValueError, OverflowError) as err:  # OverflowError: an infinite or absurdly long number
        raise ConfigError(f"{source}: {key}: {err}") from None


def hardware_from_dict(data: Any, source: str) -> Hardware:
    """A profile from a mapping of Hardware's keys (a YAML file's, or run.json's `hardware`): sizes may be
    written as 40GiB, numbers as 768e9; anything else not allowed is a ConfigError naming `source` and the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of hardware keys, got {short(data)}")
    allowed = {f.name for f in fields(Hardware)}
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {sorted(map(str, unknown))}: allowed {', '.join(sorted(allowed))}")
    values = dict(data)
    # A run.json written before a key existed: a built-in profile of that name supplies it, so that resuming
    # the sweep finds the same hardware as the profile gives today.
    name = values.get("name")
    known = PROFILES.get(name) if isinstance(name, str) else None
    if known is not None:
        for key in _ADDED_KEYS - set(values):
            values[key] = getattr(known, key)
    for key in _SIZE_KEYS & set(values):
        values[key] = _as_size(key, values[key], source)
    for key in _FLOAT_KEYS & set(values):
        values[key] = _as_number(values[key])
    if isinstance(values.get("gpus_per_node"), str):
        number = _as_number(values["gpus_per_node"])
        if isinstance(number, float) and number.is_integer():
            values["gpus_per_node"] = int(number)
    if isinstance(values.get("peak_flops"), dict):
        values["peak_flops"] = {k: _as_number(v) for k, v in values["peak_flops"].items()}
    missing = [f.name for f in fields(Hardware)
               if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ConfigError(f"{source}: missing key(s) {', '.join(missing)} (or a base: profile to start from)")
    try:
        return Hardware(**values)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A built-in profile by name, or a YAML file (`~` expanded): `base: a100-80gb` plus the keys to change."""
    if isinstance(name_or_path, str) and name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = given_path(name_or_path, "hardware", f"a profile's name ({', '.join(sorted(PROFILES))}) or a YAML file of "
                      "profile keys (str or pathlib.Path)")
    if path.suffix in (".yaml", ".yml") and not is_file(path):
        what = "not a file" if exists(path) else "no such file"
        raise ConfigError(f"hardware {name_or_path}: {what}; allowed {sorted(PROFILES)} or a YAML file of "
                          "profile keys")
    if path.suffix not in (".yaml", ".yml") and exists(path) and not is_file(path):
        raise ConfigError(f"hardware {name_or_path}: not a file; allowed {sorted(PROFILES)} or a YAML "
                          "file of profile keys")
    if path.suffix not in (".yaml", ".yml"):
        hint = did_you_mean(str(name_or_path), PROFILES)  # h100 -> h100-80gb
        raise ConfigError(
            f"unknown hardware {str(name_or_path)!r}{hint}: allowed {sorted(PROFILES)} or a YAML file of profile keys")
    data = load_yaml(path, "a hardware profile (YAML keys of autotune.values.hardware.Hardware)")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of hardware keys, got {short(data)}")
    data = dict(data)
    base_name = data.pop("base", None)
    allowed = {f.name for f in fields(Hardware)}
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(map(str, unknown))}: allowed base, "
                          f"{', '.join(sorted(allowed))}")
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in PROFILES:
            raise ConfigError(f"{path}: base={short(base_name)}: allowed {sorted(PROFILES)}")
        base = asdict(PROFILES[base_name])
    else:
        base = {}
    base.update(data)
    base.setdefault("name", path.stem)
    return hardware_from_dict(base, str(path))


def sold_size_note(hardware: Hardware) -> str | None:
    """The line a default budget gets from a named GPU profile taken as it is (not `--hardware auto`'s device, whose
    memory is what CUDA exposes): the profile carries the size the device is sold as, a little more than CUDA
    exposes of it (an "80 GB" device about 79.2 GiB, docs/estimate.md), so a recommendation near it may not fit."""
    if hardware.is_cpu or PROFILES.get(hardware.name) != hardware:
        return None
    return (f"memory budget: the {hardware.name} profile's {format_size(hardware.memory_bytes)}, the size the device is "
            'sold as; CUDA exposes a little less of it (an "80 GB" device about 79.2 GiB): --memory-budget at the '
            "device's own figure, or --hardware auto on it, for a recommendation that fits it")
