"""A tuned config applied to a script that builds its DeepSpeed config in code, as its trials applied it:

    python -m autotune.script.apply [--checkpointing on|off] best_ds_config.json train.py [its arguments ...]

runs `train.py` with its arguments as `python train.py ...` would (its folder first on sys.path, `__main__`), with
`deepspeed.initialize` replaced by a wrapper that gives the config the script passes (`config=` path or dict,
`config_params=`, `args.deepspeed_config`) the memory-relevant keys of the recommendation (autotune.script.merge,
the same merge as a trial's: batch keys, bf16/fp16, the ZeRO section; the script's optimizer, scheduler and other
settings stay as the script has them at run time), and `--checkpointing` sets the model's own activation-
checkpointing switch as the recommended config did. Rank 0 says once, on stderr, what DeepSpeed got.

`launch.sh` of a script sweep runs it under its launcher (`torchrun --module autotune.script.apply ...`, the same
for `deepspeed --module`) where no argument of the script names its DeepSpeed config (autotune.outputs.script):
nothing of ds-autotune runs in the training but this wrapper. A launcher's `--local_rank=N` reaches the script
among its arguments, as without it.
"""

from __future__ import annotations

import inspect
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from autotune.script import merge

MODULE = "autotune.script.apply"
USAGE = f"usage: python -m {MODULE} [--checkpointing on|off] CONFIG.json SCRIPT.py [ARGS ...]"
REQUIRED = (*merge.BATCH_KEYS, "bf16", "fp16", "zero_optimization")


def command(config: str, script: str, args: tuple[str, ...] | list[str], checkpointing: bool | None) -> tuple[str, ...]:
    """What goes after a launcher (`torchrun`, `deepspeed`) to run `script` with `config` applied."""
    flag = () if checkpointing is None else ("--checkpointing", "on" if checkpointing else "off")
    return ("--module", MODULE, *flag, config, script, *args)


def read_recommendation(path: str) -> dict[str, Any]:
    """The recommended config, with the keys the merge takes from it; SystemExit (one line) otherwise."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"{MODULE}: {path}: cannot be read as a DeepSpeed config ({err})") from None
    missing = [key for key in REQUIRED if not isinstance(config, dict) or key not in config]
    if missing:
        raise SystemExit(f"{MODULE}: {path}: no {', '.join(missing)}: expected the best_ds_config.json of a script "
                         "sweep")
    return config


def describe(config: dict[str, Any]) -> str:
    precision = "bf16" if (config.get("bf16") or {}).get("enabled") else \
        "fp16" if (config.get("fp16") or {}).get("enabled") else "fp32"
    zero = config.get("zero_optimization") or {}
    offloads = [f"{k} {v.get('device')}" for k, v in zero.items()
                if k in merge.OFFLOAD_KEYS and isinstance(v, dict) and v.get("device") not in (None, "none")]
    return (f"ZeRO stage {zero.get('stage', 0)}, micro-batch {config['train_micro_batch_size_per_gpu']} x "
            f"accumulation {config['gradient_accumulation_steps']} (global batch {config['train_batch_size']}), "
            f"{precision}" + "".join(f", {o}" for o in offloads))


def wrap(deepspeed: Any, recommended: dict[str, Any], source: str, checkpointing: bool | None) -> None:
    """Replace `deepspeed.initialize` by one that merges `recommended` into the config the script passes."""
    original = deepspeed.initialize
    said: list[bool] = []

    def initialize(*args: Any, **kwargs: Any) -> Any:
        given = inspect.signature(original).bind_partial(*args, **kwargs).arguments
        config = merge.merge(merge.load_config(merge.pop_config(given)), recommended)
        model = given.get("model")
        switched = ""
        if checkpointing is not None and model is not None:
            from autotune.script.inspect_model import checkpoint_switch, set_checkpointing

            if checkpoint_switch(model) is not None:
                set_checkpointing(model, checkpointing)
                switched = f", activation checkpointing {'on' if checkpointing else 'off'}"
        if not said and os.environ.get("RANK", "0") == "0":
            said.append(True)
            print(f"ds-autotune: deepspeed.initialize gets the tuned keys of {source}: {describe(config)}{switched}",
                  file=sys.stderr, flush=True)
        return original(**given, config=config)

    deepspeed.initialize = initialize


def parse(argv: list[str]) -> tuple[bool | None, str, str, list[str]]:
    """(checkpointing, config, script, the script's arguments) from this module's command line. DeepSpeed's launcher
    puts `--local_rank=N` right after the module (where it puts it after a script): it goes first to the script."""
    checkpointing: bool | None = None
    forwarded: list[str] = []
    while argv and argv[0].startswith("--"):
        flag, eq, value = argv[0].partition("=")
        if flag == "--checkpointing":
            value, argv = (value, argv[1:]) if eq else (argv[1] if len(argv) > 1 else "", argv[2:])
            if value not in ("on", "off"):
                raise SystemExit(f"{MODULE}: --checkpointing: allowed on or off\n{USAGE}")
            checkpointing = value == "on"
        elif flag in ("--local_rank", "--local-rank"):
            take = 1 if eq else 2
            forwarded, argv = forwarded + argv[:take], argv[take:]
        else:
            raise SystemExit(f"{MODULE}: {flag}: not an option of this module\n{USAGE}")
    if len(argv) < 2 or not argv[1].endswith(".py"):
        raise SystemExit(USAGE)
    return checkpointing, argv[0], argv[1], [*forwarded, *argv[2:]]


def main(argv: list[str]) -> None:
    checkpointing, source, script, args = parse(argv)
    recommended = read_recommendation(source)
    import deepspeed

    wrap(deepspeed, recommended, source, checkpointing)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` has it (not this folder)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
