"""Script mode for a Lightning script: `Trainer(strategy="deepspeed_stage_2")` or `DeepSpeedStrategy(...)`, with
the script's own DataLoader (`trainer.fit(model, loader)`, a DataModule, or `train_dataloader()`).

Lightning's DeepSpeedStrategy calls `deepspeed.initialize` in `setup` with its config (the micro-batch from the
DataLoader's batch size, `gradient_accumulation_steps` from `accumulate_grad_batches`), so the shim's wrapper
already gives the engine the trial's keys (ZeRO stage, offload, precision, buckets, micro-batch x accumulation
keeping the script's global batch). `patch` (run by the shim right after Lightning's DeepSpeed strategy module
is imported, `lightning.pytorch` or `pytorch_lightning`) aligns the loop around the engine:
- after `DeepSpeedStrategy.setup`: `trainer.accumulate_grad_batches` is the engine's (Lightning, not the engine,
  decides when to call the optimizer step), and the strategy's config is the one the engine got;
- `DeepSpeedStrategy.process_dataloader` (Lightning's hook for each loader it sets up after `setup`): a
  DataLoader that yields the script's micro-batch is rebuilt at the trial's (autotune.script.loaders).
`max_steps` counts optimizer steps at the trial's accumulation, as the shim does. The Trainer's `precision` (its
DeepSpeed precision plugin casts the inputs to it) is recorded as the script's precision (`script_precision`),
to which the sweep narrows the space (autotune.outputs.script.narrowed).

`recommendation` words the tuned config for such a script: the DataLoader's batch size and
`accumulate_grad_batches` (the script's own flags where they set them) and the config for the strategy.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from autotune.script.accelerate_loop import Shim
from autotune.script.batch import flag_with_value
from autotune.script.loaders import batch_flag, rebatched

VIA = "lightning.Trainer"  # model.json "via" of a Lightning script
INFO = "lightning"  # model.json key: what the patch did to the loop
MODULES = ("lightning.pytorch.strategies.deepspeed", "pytorch_lightning.strategies.deepspeed")
# Keys Lightning sets itself from the Trainer and the DataLoader: it refuses gradient_accumulation_steps in a config
# (accumulate_grad_batches sets it), takes the micro-batch from the DataLoader when the config has none (so the
# engine counts what the loader really yields) and DeepSpeed derives train_batch_size from the two.
TRAINER_KEYS = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")
_ACCUMULATE_FLAG = re.compile(r"^--?[\w.-]*accum[\w.-]*$", re.IGNORECASE)  # --accumulate-grad-batches, --grad_accum


@dataclass(frozen=True)
class Loop:
    """The loop's batch before and during the trial, per process."""

    script_micro: int  # the micro-batch Lightning gave DeepSpeed (the DataLoader's, or the config's)
    script_accumulation: int  # accumulate_grad_batches as the script set it
    micro: int  # the trial's
    accumulation: int  # the trial's

    def to_dict(self) -> dict[str, Any]:
        return {"loader_batch": self.script_micro, "loader_batch_now": self.micro,
                "accumulate_grad_batches": self.script_accumulation, "accumulation": self.accumulation}


def patch(module: Any, shim: Shim) -> None:
    """Wrap `module.DeepSpeedStrategy.setup` and `.process_dataloader` (module: Lightning's strategy module)."""
    cls = module.DeepSpeedStrategy
    setup, process_dataloader = cls.setup, cls.process_dataloader

    def patched_setup(self: Any, trainer: Any) -> None:
        own = precision_of(getattr(trainer, "precision", None))  # before the engine: the Trainer's own
        shim.script_precision = (own, f"the Trainer's precision {trainer.precision!r}") if own else None
        setup(self, trainer)
        engine = self.model
        if not hasattr(engine, "gradient_accumulation_steps"):
            return  # not fitting: no engine to align with
        loop = Loop(script_micro=int(self.config["train_micro_batch_size_per_gpu"]),
                    script_accumulation=int(trainer.accumulate_grad_batches),
                    micro=engine.train_micro_batch_size_per_gpu(), accumulation=engine.gradient_accumulation_steps())
        self._autotune_loop = loop
        trainer.accumulate_grad_batches = loop.accumulation
        if isinstance(engine.config, dict):  # the strategy's config, in place (Lightning reads its ZeRO stage)
            self.config.clear()
            self.config.update(copy.deepcopy(engine.config))
        shim.model["via"] = VIA
        shim.model[INFO] = loop.to_dict()
        shim.write_model()

    def patched_process_dataloader(self: Any, dataloader: Any) -> Any:
        dataloader = process_dataloader(self, dataloader)
        loop = getattr(self, "_autotune_loop", None)
        if loop is None or loop.micro == loop.script_micro or getattr(dataloader, "batch_size", None) != loop.script_micro:
            return dataloader
        return rebatched(dataloader, loop.micro) or dataloader  # its own batch sampler: the shim's check names it

    cls.setup, cls.process_dataloader = patched_setup, patched_process_dataloader


def precision_of(precision: Any) -> str | None:
    """The knob's precision of a Lightning Trainer's `precision` ("32-true", "bf16-mixed", "16-mixed", ...): what
    its DeepSpeed precision plugin casts the inputs to; None for any other (64-bit, transformer-engine, ...)."""
    text = str(precision or "")
    for prefix, value in (("bf16", "bf16"), ("16", "fp16"), ("32", "fp32")):
        if text.startswith(prefix):
            return value
    return None


def recommendation(ds: Mapping[str, Any], model: Mapping[str, Any],
                   script_args: Sequence[str]) -> tuple[dict[str, Any], list[str], str]:
    """For a Lightning script: the config to give its DeepSpeedStrategy (`config=`; without the keys Lightning
    sets from the Trainer), the script flags that set its DataLoader's batch size and accumulate_grad_batches
    to the tuned ones (where the script's own flags set them), and a sentence."""
    info = model.get(INFO) or {}
    out = {k: v for k, v in ds.items() if k not in TRAINER_KEYS}
    micro, accumulation = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    flags: list[str] = []
    loader_flag = batch_flag(script_args, int(info["loader_batch"])) if info.get("loader_batch") else None
    accumulate = flag_with_value(script_args, _ACCUMULATE_FLAG, (int(info.get("accumulate_grad_batches", 0)),))
    accumulate_flag = accumulate[0] if accumulate else None
    if loader_flag:
        flags += [loader_flag, str(micro)]
    if accumulate_flag:
        flags += [accumulate_flag, str(accumulation)]
    text = (f"the script's DataLoader must yield batches of {micro} "
            f"({f'pass {loader_flag} {micro}' if loader_flag else f'build it with batch_size={micro}'}) and the "
            f"Trainer accumulate {accumulation} of them "
            f"({f'pass {accumulate_flag} {accumulation}' if accumulate_flag else f'accumulate_grad_batches={accumulation}'})"
            "; give the config to DeepSpeedStrategy(config=...)")
    return out, flags, text
