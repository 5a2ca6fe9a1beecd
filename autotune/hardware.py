"""Hardware profiles: what the estimator needs to know about a device and its links.

Figures are vendor datasheet peaks (dense, no sparsity) scaled by nothing: the estimator applies its
own efficiency terms, and calibration (autotune.calibrate) fits them to measurements of a real machine.
A user adds a profile with a YAML file of the same keys (`--hardware my-gpu.yaml`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from autotune.config import ConfigError
from autotune.units import parse_size

GB = 10**9
GiB = 2**30
TFLOPS = 10**12


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


def _gpu(name: str, memory_gib: int, fp32: float, half: float, bf16: bool, bw: float, pcie: float,
         nvlink: float, net: float, **extra: Any) -> Hardware:
    flops = {"fp32": fp32 * TFLOPS, "fp16": half * TFLOPS}
    if bf16:
        flops["bf16"] = half * TFLOPS
    return Hardware(name, memory_gib * GiB, flops, bw * GB, pcie * GB, nvlink * GB, net * GB, **extra)


PROFILES: dict[str, Hardware] = {
    "v100-32gb": _gpu("v100-32gb", 32, 15.7, 125, False, 900, 12, 130, 6, host_memory_bytes=512 * GiB),
    "a100-40gb": _gpu("a100-40gb", 40, 19.5, 312, True, 1555, 24, 230, 22),
    "a100-80gb": _gpu("a100-80gb", 80, 19.5, 312, True, 2039, 24, 230, 22, host_memory_bytes=2048 * GiB),
    "h100-80gb": _gpu("h100-80gb", 80, 67, 989, True, 3350, 50, 370, 45, host_memory_bytes=2048 * GiB,
                      cpu_adam_params_per_s=2.0e9, half_efficiency_tokens=2048.0),
    "h200": _gpu("h200", 140, 67, 989, True, 4800, 50, 370, 45, host_memory_bytes=2048 * GiB,
                 cpu_adam_params_per_s=2.0e9, half_efficiency_tokens=2048.0),
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
    # figures replace these guesses (autotune.calibrate).
    "cpu": Hardware("cpu", 24 * GiB, {"fp32": 0.10 * TFLOPS, "bf16": 0.10 * TFLOPS}, 20 * GB, 10 * GB,
                    2 * GB, 1 * GB, gpus_per_node=2, host_memory_bytes=24 * GiB, cpu_adam_params_per_s=2.0e8,
                    nvme_bw=1 * GB, runtime_overhead_bytes=int(0.6 * GiB), step_overhead_s=0.02,
                    max_efficiency=0.5, half_efficiency_tokens=256.0, is_cpu=True),
}

_SIZE_KEYS = {"memory_bytes", "host_memory_bytes", "runtime_overhead_bytes"}


def load_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name, or a YAML file: `base: a100-80gb` plus the keys to change."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        raise ConfigError(
            f"unknown hardware {name_or_path!r}: allowed {sorted(PROFILES)} or a YAML file of profile keys")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of hardware keys, got {type(data).__name__}")
    base_name = data.pop("base", None)
    allowed = {f.name for f in fields(Hardware)}
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}: allowed base, {', '.join(sorted(allowed))}")
    if base_name is not None:
        if base_name not in PROFILES:
            raise ConfigError(f"{path}: base={base_name!r}: allowed {sorted(PROFILES)}")
        base = asdict(PROFILES[base_name])
    else:
        base = {}
    base.update(data)
    base.setdefault("name", path.stem)
    for key in _SIZE_KEYS & set(base):
        try:
            base[key] = parse_size(base[key])
        except ValueError as err:
            raise ConfigError(f"{path}: {key}: {err}") from None
    try:
        return Hardware(**base)
    except TypeError as err:
        raise ConfigError(f"{path}: {err}") from None
