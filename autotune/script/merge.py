"""The trial's knobs applied to whatever DeepSpeed config a user's script passes.

The trial's DeepSpeed config (autotune.values.dsconfig.ds_config) decides the memory-relevant keys: the batch
arithmetic, precision, the ZeRO section (stage, buckets, offloads) and `zero_force_ds_cpu_optimizer`.
Everything else the script wrote (optimizer, scheduler, gradient clipping, logging, ...) is kept, and
within the sections the trial touches the script's other keys stay too (e.g. fp16 loss scaling). Dropped: the
"autotuning" block (DROPPED), DeepSpeed's own autotuner's instructions, which the tuner reads before its first trial
(autotune.values.ds_autotuning): enabled, it turns DeepSpeed's engine into one of that autotuner's experiments,
whose timers and flops profiler run every step and which ends the process after `end_profile_step` + 1 steps.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Mapping

from autotune.values.config import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
OFFLOAD_KEYS = ("offload_optimizer", "offload_param")
# Not training config: DeepSpeed's autotuner's instructions (enabled: the engine exits at end_profile_step + 1).
DROPPED = ("autotuning",)


def load_config(source: Any) -> dict[str, Any]:
    """The script's config as a dict: a path to a JSON file, a dict, or None (no config: {})."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"DeepSpeed config {str(source)!r} passed by the script does not exist") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"DeepSpeed config {str(source)!r} passed by the script is not JSON: {err}") from None
    to_dict = getattr(source, "to_dict", None) or getattr(source, "config", None)  # e.g. HfDeepSpeedConfig
    if callable(to_dict):
        return copy.deepcopy(dict(to_dict()))
    if isinstance(to_dict, Mapping):
        return copy.deepcopy(dict(to_dict))
    raise ConfigError(f"DeepSpeed config of type {type(source).__name__}: expected a path, a dict or None")


def pop_config(given: dict[str, Any]) -> Any:
    """The config a `deepspeed.initialize` call passes (`given`: its bound arguments by name), taken out of them:
    `config`, else `config_params`, else the `--deepspeed_config` / `--deepscale_config` of its `args` (a copy of
    the script's namespace without it replaces `args`: the script's own stays as it was). None: no config."""
    source = given.pop("config", None)
    if source is None:
        source = given.pop("config_params", None)
    else:
        given.pop("config_params", None)
    cli_args = given.get("args")
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(cli_args, attr, None) is not None:
            source = getattr(cli_args, attr) if source is None else source
            cli_args = copy.copy(cli_args)
            setattr(cli_args, attr, None)
            given["args"] = cli_args
    return source


def merge(user: Mapping[str, Any], trial: Mapping[str, Any]) -> dict[str, Any]:
    """`user` with the memory-relevant keys of `trial` (a complete config from dsconfig.ds_config), less DROPPED."""
    out = {key: copy.deepcopy(value) for key, value in user.items() if key not in DROPPED}
    for key in BATCH_KEYS:
        out[key] = trial[key]
    for name in ("bf16", "fp16"):
        section = dict(out.get(name) or {})
        for key, value in trial[name].items():
            if key == "enabled" or key not in section:
                section[key] = value
        out[name] = section
    if isinstance(out.get("amp"), Mapping):
        out["amp"] = {**out["amp"], "enabled": False}  # apex AMP would fight the trial's precision
    zero = {k: v for k, v in dict(out.get("zero_optimization") or {}).items() if k not in OFFLOAD_KEYS}
    zero.update(trial["zero_optimization"])
    out["zero_optimization"] = zero
    if "zero_force_ds_cpu_optimizer" in trial:
        out["zero_force_ds_cpu_optimizer"] = trial["zero_force_ds_cpu_optimizer"]
    if "optimizer" not in out and "optimizer" in trial and not user:
        out["optimizer"] = copy.deepcopy(trial["optimizer"])  # the script passed no config at all
    return out


def json_safe(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy that survives strict JSON: a script's dict may hold tuples, objects, or infinities (the
    Trainer's finalized config does), which become lists, their str() and None."""
    return _finite(json.loads(json.dumps(config, default=str)))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
