"""DeepSpeed's own `"autotuning"` block of a ds_config.json, read as ds-autotune's options where it maps (issue 43).

A user who would run `deepspeed --autotuning run train.py --deepspeed ds_config.json` keeps that block; `autotune
tune --script train.py -- --deepspeed ds_config.json` honours it: which search, how many trials, which micro-batches and
ZeRO stages, the metric; every key it cannot apply is one line saying why (DeepSpeed's keys and defaults:
deepspeed/autotuning/constants.py). Flags given on the command line win over the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from autotune.errors import ConfigError
from autotune.files import short
from autotune.values.space import Choices

BLOCK = "autotuning"
TUNERS = {"gridsearch": "grid", "random": "random", "model_based": "optuna"}  # DeepSpeed's tuner -> our strategy
METRICS = ("throughput", "latency", "flops")
# Keys that only steer DeepSpeed's own autotuner's machinery: nothing of ds-autotune to set from them.
MACHINERY = {"results_dir", "exps_dir", "overwrite", "start_profile_step", "end_profile_step", "metric_path",
             "arg_mappings", "model_info", "model_info_path", "mp_size"}


@dataclass(frozen=True)
class Autotuning:
    """What a ds_config's autotuning block asks, as ds-autotune's options (TuneSpec keywords), the space it narrows
    to, the metric to report beside throughput, and one line per key not applied."""

    options: Mapping[str, Any] = field(default_factory=dict)  # strategy, trials
    micro_batch: tuple[int, int] | None = None  # the inclusive range of micro-batches to try
    micro_batches: int | None = None  # how many of them (num_tuning_micro_batch_sizes)
    zero_stages: tuple[int, ...] | None = None
    metric: str = "throughput"
    notes: tuple[str, ...] = ()
    source: str = "ds_config.json"  # the file the block is in, named by its errors

    def narrowed(self, choices: Choices) -> Choices:
        """`choices` within the block's micro-batch range and count and its ZeRO stages; ConfigError when nothing of a
        knob is left."""
        micro = choices.micro_batch
        if self.micro_batch is not None:
            low, high = self.micro_batch
            micro = tuple(m for m in micro if low <= m <= high)
        if self.micro_batches is not None and len(micro) > self.micro_batches:
            step = (len(micro) - 1) / max(self.micro_batches - 1, 1)  # spread over the range, both ends kept
            micro = tuple(micro[round(i * step)] for i in range(self.micro_batches))
        stages = choices.zero_stage if self.zero_stages is None else tuple(
            s for s in choices.zero_stage if s in self.zero_stages)
        if not micro or not stages:
            knob = "micro-batch" if not micro else "ZeRO stage"
            raise ConfigError(f"{self.source}: {BLOCK}: no {knob} of the space "
                              f"({choices.micro_batch if not micro else choices.zero_stage}) is within the block's range")
        return replace(choices, micro_batch=micro, zero_stage=stages)


def read_autotuning(ds_config: Mapping[str, Any], source: str = "ds_config.json") -> Autotuning | None:
    """The autotuning block of `ds_config` (None without one, or with `enabled: false`); ConfigError naming `source`,
    the key and what is allowed for a value it cannot read."""
    block = ds_config.get(BLOCK)
    if block is None:
        return None
    where = f"{source}: {BLOCK}"
    if not isinstance(block, Mapping):
        raise ConfigError(f"{where}: {short(block)}: allowed an object of DeepSpeed's autotuning keys")
    if block.get("enabled") is False:
        return None
    options: dict[str, Any] = {}
    notes: list[str] = []
    tuner = block.get("tuner_type")
    if tuner is not None:
        if tuner not in TUNERS:
            raise ConfigError(f"{where}.tuner_type: {short(tuner)}: allowed {', '.join(TUNERS)}")
        options["strategy"] = TUNERS[tuner]
    trials = block.get("tuner_num_trials")
    if trials is not None:
        options["trials"] = _whole(trials, f"{where}.tuner_num_trials", 1)
    metric = block.get("metric", "throughput")
    if metric not in METRICS:
        raise ConfigError(f"{where}.metric: {short(metric)}: allowed {', '.join(METRICS)}")
    if metric != "throughput":  # each is throughput in other units at a fixed model and global batch
        notes.append(f"{where}.metric {metric}: ranked as throughput (at a fixed model and global batch the fastest "
                     "step is the highest throughput and the most model FLOPS); report.md gives the recommendation's "
                     "latency per step and model FLOPS beside it")
    low = block.get("min_train_micro_batch_size_per_gpu")
    high = block.get("max_train_micro_batch_size_per_gpu")
    micro = None
    if low is not None or high is not None:
        micro = (_whole(low, f"{where}.min_train_micro_batch_size_per_gpu", 1) if low is not None else 1,
                 _whole(high, f"{where}.max_train_micro_batch_size_per_gpu", 1) if high is not None else 2**31)
        if micro[0] > micro[1]:
            raise ConfigError(f"{where}: min_train_micro_batch_size_per_gpu {micro[0]} > "
                              f"max_train_micro_batch_size_per_gpu {micro[1]}: allowed min <= max")
    count = block.get("num_tuning_micro_batch_sizes")
    micro_batches = None if count is None else _whole(count, f"{where}.num_tuning_micro_batch_sizes", 1)
    for key in ("max_train_batch_size", "min_train_batch_size"):
        if block.get(key) is not None:
            notes.append(f"{where}.{key} {block[key]}: not applied: ds-autotune keeps the script's global batch (it "
                         "tunes memory and speed, never what the model learns)")
    if block.get("tuner_early_stopping") is not None:
        notes.append(f"{where}.tuner_early_stopping {block['tuner_early_stopping']}: not applied: the search stops when "
                     "the chance of a better config falls below --stop-when")
    if block.get("fast") is not None:
        notes.append(f"{where}.fast {block['fast']}: not applied: the space is the one ds-autotune searches (every "
                     "ZeRO stage, micro-batch, checkpointing, precision and offload it holds)")
    for key in sorted(MACHINERY & set(block)):
        notes.append(f"{where}.{key}: not applied: it steers DeepSpeed's own autotuner's runs")
    unknown = sorted(set(block) - MACHINERY - {"enabled", "tuner_type", "tuner_num_trials", "metric",
                                               "min_train_micro_batch_size_per_gpu", "max_train_micro_batch_size_per_gpu",
                                               "num_tuning_micro_batch_sizes", "max_train_batch_size",
                                               "min_train_batch_size", "tuner_early_stopping", "fast"})
    notes += [f"{where}.{key}: not applied: not a key of DeepSpeed's autotuning" for key in unknown]
    return Autotuning(options, micro, micro_batches, _stages(ds_config, source), metric, tuple(notes), source)


def _stages(ds_config: Mapping[str, Any], source: str) -> tuple[int, ...] | None:
    """The ZeRO stages DeepSpeed's autotuner would try from the config's own `zero_optimization.stage`: a list of
    them, or "all" (None: every stage of the space); a single stage is the script's own, not a request to tune."""
    zero = ds_config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, Mapping) else None
    if not isinstance(stage, list):
        return None if stage in (None, "all") or isinstance(stage, int) else _bad_stage(stage, source)
    if "all" in stage:
        return None
    if not stage or any(s not in (0, 1, 2, 3) for s in stage):
        _bad_stage(stage, source)
    return tuple(sorted(set(stage)))


def _bad_stage(stage: Any, source: str) -> tuple[int, ...]:
    raise ConfigError(f"{source}: zero_optimization.stage: {short(stage)}: allowed 0-3, a list of them, or \"all\"")


def _whole(value: Any, where: str, low: int) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, float) and math.isfinite(value)
                                                                     and value.is_integer())
    if not ok or int(value) < low:
        raise ConfigError(f"{where}: {short(value)}: allowed a whole number >= {low}")
    return int(value)
