"""The trial's micro-batch brought to a training loop that builds its own DataLoader (a hand-written Accelerate
loop, a Lightning Trainer): the loader is rebuilt with the trial's batch size, everything else kept (dataset,
sampler and its shuffling, collate function, workers, drop_last), so that the engine's micro-batch is what the
model is fed. The global batch stays the script's: the trial's gradient accumulation makes up the difference.

`batch_flag` finds the script's own flag that set that batch size, to word the recommendation in the script's
units. Nothing here imports torch at module level (the CLI imports script mode's light modules)."""

from __future__ import annotations

import re
from typing import Any, Sequence

from autotune.script.batch import flag_with_value

# Flags that set a DataLoader's batch size: --batch-size, --batch_size, --per_device_train_batch_size, --bs ...
_BATCH_FLAG = re.compile(r"^--?([\w.-]*batch[\w.-]*size[\w.-]*|bs|micro[\w.-]*batch[\w.-]*)$", re.IGNORECASE)


def rebatched(loader: Any, micro_batch: int) -> Any | None:
    """A DataLoader like `loader` that yields batches of `micro_batch`; None where its batches are not made by
    a plain batch size (a batch sampler of its own, batch_size=None): those cannot be resized from outside."""
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset

    if getattr(loader, "batch_size", None) is None or type(loader.batch_sampler) is not BatchSampler:
        return None
    iterable = isinstance(loader.dataset, IterableDataset)
    workers = loader.num_workers
    return DataLoader(
        loader.dataset, batch_size=micro_batch, sampler=None if iterable else loader.sampler,
        num_workers=workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers if workers else False, pin_memory_device=loader.pin_memory_device)


def batch_flag(script_args: Sequence[str], batch_size: int) -> str | None:
    """The script's flag that (probably) set its DataLoader's batch size: a batch-size-like flag whose value is
    `batch_size` (None: the script was run with its default, or sets it elsewhere)."""
    found = flag_with_value(script_args, _BATCH_FLAG, (batch_size,))
    return found[0] if found else None


def first_tensor(values: Any, tensor_type: type, depth: int = 3) -> Any | None:
    """The first tensor of at least one dimension in `values`, looking into lists, tuples and dicts (a
    Lightning batch reaches the engine as the list its DataLoader yields), or None."""
    if isinstance(values, tensor_type):
        return values if values.dim() >= 1 else None  # type: ignore[attr-defined]  # a torch.Tensor
    if depth == 0:
        return None
    items = values.values() if isinstance(values, dict) else values if isinstance(values, (list, tuple)) else ()
    for item in items:
        found = first_tensor(item, tensor_type, depth - 1)
        if found is not None:
            return found
    return None
