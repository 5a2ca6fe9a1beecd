"""Script mode for a hand-written Accelerate loop: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))` with the
script's own DataLoader, model and optimizer passed to `accelerator.prepare`.

Accelerate calls `deepspeed.initialize` inside `prepare` with the plugin's config (its "auto" micro-batch filled
from the DataLoader's batch size), so the shim's wrapper already gives the engine the trial's keys (ZeRO stage,
offload, precision, buckets, micro-batch x accumulation keeping the script's global batch) and applies
checkpointing to the model. What the wrapper cannot reach is the loop around the engine; `patch` (run by the
shim right after `accelerate.accelerator` is imported) wraps `Accelerator._prepare_deepspeed` so that once the
engine exists:
- each DataLoader of that `prepare` call (or a later one) that yields the script's micro-batch is rebuilt with
  the trial's (autotune.script.loaders.rebatched) and prepared again, so the model is fed the engine's
  micro-batch;
- `accelerator.gradient_accumulation_steps` is the engine's, so `with accelerator.accumulate(model):` marks the
  trial's accumulation boundaries (Accelerate, not the engine, decides them: `accelerator.backward` sets the
  engine's boundary from `sync_gradients`);
- the plugin's config is the one the engine got (Accelerate reads its ZeRO stage when saving or unwrapping);
- a loop that steps at every batch although the trial accumulates (no `accelerator.accumulate`) is stopped
  with the verdict `ignores_accumulation`: it cannot keep its global batch at another micro-batch;
- the script's precision (`accelerator.mixed_precision` before the engine is built: the Accelerator's argument and
  the plugin's config) is recorded (`script_precision`): the loop feeds the model inputs of that precision, so the
  sweep narrows the space to it (autotune.outputs.script.narrowed).
A Trainer script goes through Accelerate too; its batch is already the trial's (TrainingArguments), so the
patch leaves it alone.

`recommendation` words the tuned config for such a script: the DataLoader's batch size (the script's own flag
where one set it) and the config to pass to the plugin.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from autotune.script.loaders import batch_flag, rebatched
from autotune.script.verdict import ScriptVerdict

VIA = "accelerate.Accelerator"  # model.json "via" of a hand-written Accelerate loop
PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}  # Accelerate's mixed_precision -> the knob's value
INFO = "accelerate"  # model.json key: what the patch did to the loop


class Shim(Protocol):
    """What the patch needs of autotune.script.shim.Shim (not imported here: the shim imports this module)."""

    via_trainer: bool
    model: dict[str, Any]
    # The precision the script's framework runs (fp32/bf16/fp16) and what set it, for model.json (None: not known)
    script_precision: tuple[str, str] | None

    def write_model(self) -> None: ...


@dataclass(frozen=True)
class Loop:
    """The loop's batch before and during the trial, per process."""

    script_micro: int  # the micro-batch Accelerate gave DeepSpeed from the script (the DataLoader's, or the config's)
    micro: int  # the trial's
    accumulation: int  # the trial's
    loader_factor: int  # DataLoader batch size per micro-batch: the processes with split_batches, else 1
    micro_auto: bool  # the script's config left the micro-batch to the DataLoader ("auto")

    def to_dict(self) -> dict[str, Any]:
        return {"loader_batch": self.script_micro * self.loader_factor, "script_micro_batch": self.script_micro,
                "loader_batch_now": self.micro * self.loader_factor, "accumulation": self.accumulation,
                "micro_batch_auto": self.micro_auto}


def patch(module: Any, shim: Shim) -> None:
    """Wrap `module.Accelerator._prepare_deepspeed` (module: accelerate.accelerator, just imported)."""
    cls = module.Accelerator
    original = cls._prepare_deepspeed

    def prepare_deepspeed(self: Any, *args: Any) -> Any:
        if shim.via_trainer:
            return original(self, *args)
        before = copy.deepcopy(self.deepspeed_plugin.deepspeed_config)  # the script's, its "auto" not yet filled
        # Read off the plugin's config before the trial's replaces it: Accelerator(mixed_precision=...) set it there
        own = PRECISIONS.get(self.mixed_precision)
        shim.script_precision = (own, f"the Accelerator's mixed_precision {self.mixed_precision!r}") if own else None
        had_engine = self.deepspeed_engine_wrapped is not None
        result = list(original(self, *args))
        wrapped = self.deepspeed_engine_wrapped
        if wrapped is None:
            return tuple(result)  # no model prepared yet: nothing is known of the trial's batch
        if not had_engine:
            loop = _adopt(self, wrapped, before, shim)
        else:
            loop = self._autotune_loop
        _rebatch(self, args, result, loop)
        return tuple(result)

    cls._prepare_deepspeed = prepare_deepspeed


def _adopt(accelerator: Any, wrapped: Any, before: Mapping[str, Any], shim: Shim) -> Loop:
    """The engine was just built by the shim's deepspeed.initialize: align Accelerate with it."""
    engine = wrapped.engine
    plugin = accelerator.deepspeed_plugin
    factor = accelerator.num_processes if accelerator.split_batches else 1
    loop = Loop(script_micro=int(plugin.deepspeed_config["train_micro_batch_size_per_gpu"]),
                micro=engine.train_micro_batch_size_per_gpu(), accumulation=engine.gradient_accumulation_steps(),
                loader_factor=factor, micro_auto=before.get("train_micro_batch_size_per_gpu") == "auto")
    accelerator._autotune_loop = loop
    accelerator.gradient_accumulation_steps = loop.accumulation
    if isinstance(engine.config, dict):  # the plugin's config, in place (Accelerate holds references to it)
        plugin.deepspeed_config.clear()
        plugin.deepspeed_config.update(copy.deepcopy(engine.config))
        plugin.hf_ds_config.set_stage_and_offload()
    _check_accumulation(accelerator, wrapped, loop)
    shim.model["via"] = VIA
    shim.model[INFO] = loop.to_dict()
    shim.write_model()
    return loop


def _rebatch(accelerator: Any, args: Sequence[Any], result: list[Any], loop: Loop) -> None:
    """Each DataLoader of this prepare call that yields the script's micro-batch, rebuilt at the trial's."""
    from torch.utils.data import DataLoader

    if loop.micro == loop.script_micro:
        return
    for i, given in enumerate(args):
        if not isinstance(given, DataLoader) or given.batch_size != loop.script_micro * loop.loader_factor:
            continue
        loader = rebatched(given, loop.micro * loop.loader_factor)
        if loader is None:
            continue  # its own batch sampler: the shim's first-batch check names the mismatch
        old = result[i]
        if old in accelerator._dataloaders:
            accelerator._dataloaders.remove(old)
        result[i] = accelerator.prepare_data_loader(loader)


def _check_accumulation(accelerator: Any, wrapped: Any, loop: Loop) -> None:
    """Stop a loop that ends every batch at an accumulation boundary while the trial accumulates."""
    backward = wrapped.backward
    since = [0]  # micro-batches since the last boundary

    def checked(loss: Any, sync_gradients: bool = True, **kwargs: Any) -> Any:
        since[0] += 1
        if sync_gradients:
            early = since[0] < loop.accumulation and not accelerator.gradient_state.end_of_dataloader
            since[0] = 0
            if early:
                raise ScriptVerdict("ignores_accumulation", (
                    f"the loop steps the optimizer at every batch (accelerator.backward outside `with "
                    f"accelerator.accumulate(model):`), so the trial's gradient accumulation {loop.accumulation} "
                    f"cannot keep the script's global batch at micro-batch {loop.micro}: wrap the step in "
                    f"accelerator.accumulate(model), or tune at the script's own micro-batch "
                    f"(a space with micro_batch: [{loop.micro * loop.accumulation}], accumulation 1)"))
        return backward(loss, sync_gradients=sync_gradients, **kwargs)

    wrapped.backward = checked


def recommendation(ds: Mapping[str, Any], model: Mapping[str, Any],
                   script_args: Sequence[str]) -> tuple[dict[str, Any], list[str], str]:
    """For a hand-written Accelerate loop: the config to give its DeepSpeedPlugin, the script flags that set its
    DataLoader's batch size to the tuned micro-batch (empty when no flag of the script set it), and a sentence."""
    info = model.get(INFO) or {}
    out = dict(ds)
    micro, accumulation = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    factor = max(1, int(info.get("loader_batch", 1)) // max(1, int(info.get("script_micro_batch", 1))))
    loader = micro * factor
    if info.get("micro_batch_auto"):
        # As the script had it: Accelerate fills it from the DataLoader, and DeepSpeed's check of train_batch_size
        # then fails loudly if the DataLoader was not given the new batch size.
        out["train_micro_batch_size_per_gpu"] = "auto"
    flag = batch_flag(script_args, int(info["loader_batch"])) if info.get("loader_batch") else None
    flags = [flag, str(loader)] if flag else []
    how = f"pass {flag} {loader}" if flag else f"build it with batch_size={loader}"
    text = (f"give the config to DeepSpeedPlugin(hf_ds_config=...); the script's DataLoader must yield batches of "
            f"{loader} ({how}); Accelerate then accumulates {accumulation} of them per optimizer step (the config's "
            "gradient_accumulation_steps, applied by `accelerator.accumulate`)")
    return out, flags, text
