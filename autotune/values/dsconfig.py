"""Config + workload -> the DeepSpeed config that realises it, in two flavours:
`ds_config` for `deepspeed.initialize` and `hf_ds_config` for the Hugging Face Trainer / Accelerate."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from autotune.values.config import Config, ConfigError
from autotune.values.workload import Workload

FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                     "hysteresis": 2, "min_loss_scale": 1}
MIN_BUCKET = 2**20  # elements; below this, gloo/NCCL launch many tiny collectives on small models


@dataclass(frozen=True)
class DsOptions:
    """Settings of the written config that are not tuned knobs."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    gradient_clipping: float = 1.0
    nvme_path: str | None = None
    # False lets offloaded optimizer state use torch's Adam instead of DeepSpeedCPUAdam (no C++ build).
    force_ds_cpu_optimizer: bool = True


@dataclass(frozen=True)
class Buckets:
    """ZeRO communication buffer sizes in elements; the estimator counts the same numbers."""

    reduce: int
    allgather: int
    prefetch: int
    param_persistence_threshold: int
    max_live_parameters: int = 10**9
    sub_group: int = 10**9

    @classmethod
    def for_hidden(cls, hidden: int) -> "Buckets":
        # The sizes the HF Trainer picks for "auto" (hidden^2, 0.9 hidden^2, 10 hidden), floored.
        return cls(reduce=max(hidden * hidden, MIN_BUCKET), allgather=max(hidden * hidden, MIN_BUCKET),
                   prefetch=max(int(0.9 * hidden * hidden), MIN_BUCKET), param_persistence_threshold=10 * hidden)


# NVMe offload's pinned host buffers (DeepSpeed's swappers): the optimizer's `buffer_count` buffers of its largest
# sub-group partition in fp32; the parameters' `buffer_count` buffers of `buffer_size` elements
# (nvme_param_buffer_elements). The estimator prices these very numbers (autotune.prediction.estimate).
NVME_OPTIMIZER_BUFFERS = 4
NVME_PARAM_BUFFERS = 5
NVME_PARAM_BUFFER_ELEMENTS = 10**8  # DeepSpeed's default buffer_size


def nvme_param_buffer_elements(workload: Workload) -> int:
    """The parameters' swap buffer: DeepSpeed holds each parameter's partition in one (zero.Init asserts it fits:
    partitioned_param_swapper.get_buffer, "More elements ... than buffer size"), so its default 1e8 elements, or the
    largest parameter's partition where that is more (llama-13b's embedding on one rank: 1.6e8)."""
    return max(NVME_PARAM_BUFFER_ELEMENTS, -(-workload.model.largest_module_params // workload.gpus))


def _offload(device: str, nvme_path: str | None, param_buffer: int | None = None) -> dict[str, Any]:
    """An offload section; `param_buffer`: the parameters' swap buffer in elements (None: the optimizer's)."""
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    if not nvme_path:
        raise ConfigError("NVMe offload needs an nvme_path")
    section: dict[str, Any] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
    section.update({"buffer_count": NVME_PARAM_BUFFERS, "buffer_size": param_buffer, "max_in_cpu": 10**9}
                   if param_buffer is not None else {"buffer_count": NVME_OPTIMIZER_BUFFERS})
    return section


def zero_section(config: Config, workload: Workload, options: DsOptions) -> dict[str, Any]:
    buckets = Buckets.for_hidden(workload.model.hidden)
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage == 0:
        return zero
    zero.update({"overlap_comm": config.zero_stage >= 2, "contiguous_gradients": True,
                 "reduce_scatter": True, "reduce_bucket_size": buckets.reduce})
    if config.zero_stage in (1, 2):
        zero["allgather_bucket_size"] = buckets.allgather
    else:
        zero.update({"stage3_prefetch_bucket_size": buckets.prefetch,
                     "stage3_param_persistence_threshold": buckets.param_persistence_threshold,
                     "stage3_max_live_parameters": buckets.max_live_parameters,
                     "stage3_max_reuse_distance": buckets.max_live_parameters,
                     "sub_group_size": buckets.sub_group})
    if config.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(config.offload_optimizer, options.nvme_path)
    if config.offload_param != "none":
        zero["offload_param"] = _offload(config.offload_param, options.nvme_path, nvme_param_buffer_elements(workload))
    return zero


def ds_config(config: Config, workload: Workload, options: DsOptions = DsOptions()) -> dict[str, Any]:
    """A complete DeepSpeed config for `config` on `workload` (data-parallel over `workload.gpus`)."""
    gas = workload.grad_accumulation(config.micro_batch)
    if gas is None:
        raise ConfigError(f"global batch {workload.global_batch} is not a multiple of micro_batch "
                          f"{config.micro_batch} x {workload.gpus} GPU(s)")
    layers = workload.model.layers
    if config.ckpt_interval > layers:
        raise ConfigError(f"ckpt_interval {config.ckpt_interval} exceeds the model's {layers} layers")
    out: dict[str, Any] = {
        "train_batch_size": workload.global_batch,
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": options.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": options.weight_decay}},
        "gradient_clipping": options.gradient_clipping,
        "zero_optimization": zero_section(config, workload, options),
        "bf16": {"enabled": config.precision == "bf16"},
        "fp16": {"enabled": config.precision == "fp16", **FP16_LOSS_SCALING},
        # The built-in model and script mode checkpoint every `ckpt_interval` layers; this section
        # configures deepspeed.checkpointing for models that use it.
        "activation_checkpointing": {
            "partition_activations": False, "cpu_checkpointing": False,
            "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False,
            "number_checkpoints": -(-layers // config.ckpt_interval) if config.ckpt_interval else None,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.offload_optimizer != "none":
        out["zero_force_ds_cpu_optimizer"] = options.force_ds_cpu_optimizer
    return out


def hf_ds_config(config: Config, workload: Workload, options: DsOptions = DsOptions()) -> dict[str, Any]:
    """The Trainer/Accelerate flavour of `ds_config`: "auto" only where the value is the training recipe's.

    Every tuned value stays concrete: micro-batch, accumulation and the global batch they make, precision,
    ZeRO stage, offload and the bucket sizes (the Trainer would fill an "auto" bucket with hidden^2, not
    what was measured). "auto" is left for the learning rate, weight decay and gradient clipping, which
    the Trainer fills from its `TrainingArguments` and Accelerate from `DummyOptim(lr=, weight_decay=)`
    (and clipping 1.0). Adam's betas and eps stay concrete at the Trainer's defaults: `DummyOptim` cannot
    fill them ("optimizer.params.betas not found in kwargs"), and the Trainer checks them against
    `adam_beta1`, `adam_beta2` and `adam_epsilon`. No scheduler section: the schedule is the recipe's (the
    Trainer's `lr_scheduler_type`; with Accelerate, `DummyScheduler(optimizer, lr_scheduler_callable=...)`).
    """
    out = copy.deepcopy(ds_config(config, workload, options))
    params = out["optimizer"]["params"]
    params["lr"] = params["weight_decay"] = "auto"
    out["gradient_clipping"] = "auto"
    return out


RECIPE_AUTO = ("optimizer.params.lr", "optimizer.params.weight_decay", "gradient_clipping")
"""The only keys `hf_ds_config` leaves "auto"."""
