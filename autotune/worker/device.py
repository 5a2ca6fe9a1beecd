"""A trial rank's device: the accelerator its spec names (checked before the model is built), the rank
pinned to a GPU of its own, the memory budget applied to CUDA's allocator, and how its memory is read.

Peak memory, the figure a budget is compared with:
- CPU: the process's true peak resident set (VmHWM after a reset, autotune.worker.procmem);
- CUDA: what `nvidia-smi` shows for the rank's process at its peak: the caching allocator's max reserved
  bytes since the reset, plus the device memory outside that allocator (the CUDA context, NCCL's buffers,
  library workspaces). The outside part is the device's used memory less the allocator's reserved bytes,
  measured once when the device is opened (the context) and again after the measured steps (context and
  communicator buffers); the larger counts. It relies on trials never sharing a GPU (one rank per device,
  the tuner process itself never touches the GPU); another process on the same device would be counted too,
  which errs on the side of not fitting.
The budget on CUDA caps the caching allocator (`set_per_process_memory_fraction`) at the budget less the
memory outside it, so that an over-budget config fails with the allocator's OutOfMemoryError as it would on
a card of that size.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from autotune.worker import procmem

ACCELERATORS = ("cpu", "cuda")


class AcceleratorMismatch(Exception):
    """DeepSpeed's accelerator in this rank is not the one the trial was planned for: no config can run."""


class BudgetBelowContext(MemoryError):
    """The budget leaves nothing to the allocator once the CUDA context is counted."""


class Memory(Protocol):
    def current(self) -> int: ...
    def peak(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak_allocated(self) -> int | None: ...
    def finish(self) -> None: ...
    def details(self) -> dict[str, int]: ...


def check_accelerator(wanted: str, got: str, device_count: int, local_rank: int) -> None:
    if got != wanted:
        raise AcceleratorMismatch(
            f"the trial was planned for DeepSpeed's {wanted} accelerator (from the hardware profile) but this "
            f"rank got {got} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', 'unset')})")
    if wanted != "cpu" and not 0 <= local_rank < device_count:
        raise AcceleratorMismatch(f"rank with LOCAL_RANK {local_rank} has no GPU of its own: {device_count} "
                                  f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def allocator_fraction(budget_bytes: int, total_bytes: int, outside_bytes: int) -> float:
    """The fraction of the device the caching allocator may reserve so that it plus the memory outside it
    stays within the budget."""
    room = budget_bytes - outside_bytes
    if room <= 0:
        raise BudgetBelowContext(f"the memory budget of {budget_bytes / 2**20:.0f} MiB is used up by the CUDA "
                                 f"context and libraries ({outside_bytes / 2**20:.0f} MiB) before the model")
    return min(1.0, room / total_bytes)


def open_device(wanted: str, accel: Any, torch: Any, local_rank: int, budget_bytes: int | None) -> Memory:
    """Check the accelerator, pin this rank to its GPU (before the communicator binds to a device), cap the
    allocator at the budget, and return the rank's memory reader."""
    got = accel.device_name()
    check_accelerator(wanted, got, accel.device_count() if got != "cpu" else 0, local_rank)
    if got == "cpu":
        return CpuMemory()  # the runner's watchdog enforces the budget on the resident set
    accel.set_device(local_rank)
    memory = CudaMemory(torch.cuda, local_rank)
    if budget_bytes:
        total = torch.cuda.get_device_properties(local_rank).total_memory
        torch.cuda.set_per_process_memory_fraction(allocator_fraction(budget_bytes, total, memory.outside), local_rank)
    return memory


class CpuMemory:
    """The whole process's resident set: on DeepSpeed's CPU accelerator, that is the device memory."""

    def current(self) -> int:
        return procmem.rss() or 0

    def peak(self) -> int:
        return procmem.peak_rss() or 0

    def reset_peak(self) -> None:
        procmem.reset_peak()

    def peak_allocated(self) -> None:
        return None

    def finish(self) -> None:
        pass

    def details(self) -> dict[str, int]:
        return {}


class CudaMemory:
    """Device memory as nvidia-smi shows it for this rank (module docstring). `cuda` is `torch.cuda`."""

    def __init__(self, cuda: Any, device: int) -> None:
        self.cuda, self.device = cuda, device
        self.context = self._outside()  # before the model: the CUDA context and nothing else of ours
        self.outside = self.context

    def _outside(self) -> int:
        free, total = self.cuda.mem_get_info(self.device)
        return max(0, total - free - self.cuda.memory_reserved(self.device))

    def current(self) -> int:
        return self.cuda.memory_reserved(self.device) + self.outside

    def peak(self) -> int:
        return self.cuda.max_memory_reserved(self.device) + self.outside

    def reset_peak(self) -> None:
        self.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        return self.cuda.max_memory_allocated(self.device)

    def finish(self) -> None:
        """After the measured steps: the communicator's buffers exist now (NCCL allocates on first use)."""
        self.outside = max(self.outside, self._outside())

    def details(self) -> dict[str, int]:
        return {"cuda_context_bytes": self.context, "outside_allocator_bytes": self.outside,
                "peak_reserved_bytes": self.cuda.max_memory_reserved(self.device)}
