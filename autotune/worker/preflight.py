"""The op preflight's child: `python -m autotune.worker.preflight < request.json`, started by autotune.trials.ops before a
sweep's first trial, in the environment its ranks get (autotune.trials.runner.trial_environment).

The request: `{"accelerator": "cuda", "ds_configs": [...], "cpu_info": {...} | null}`. The child loads (building
on first use) every op a rank of one of those DeepSpeed configs loads, with the rank's own choice and loader
(autotune.worker.main: op_builders, load_op, its stale build locks), each op once. It says what it does on
stdout, one JSON object a line:

    {"event": "device", "accelerator": "cuda", "capability": "9.0"}
    {"event": "op", "op": "fused_adam", "building": true}
    {"event": "failed", "error": "ValueError: ...", "op": "fused_adam", "arch_list_fault": true, "capability": "9.0"}
    {"event": "done", "ops": ["fused_adam"], "builds": {"FusedAdamBuilder": ["fused_adam", "fused_adam"]}}

A failure's traceback goes to stderr and the exit status is 1. DeepSpeed finding another accelerator than the
request's, or no GPU, is `{"event": "mismatch", ...}` and exit 0: the first trial reports it (unsupported, which
stops the sweep), as it did before there was a preflight.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from autotune.worker.device import AcceleratorMismatch, check_accelerator
from autotune.worker.imports import without_mlflow
from autotune.worker.main import build_failure, classify, die_with_parent, load_op, needed_builders


def emit(event: str, **info: Any) -> None:
    print(json.dumps({"event": event, **info}), flush=True)


def main() -> int:
    die_with_parent()
    without_mlflow()
    request = json.load(sys.stdin)
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    name = accel.device_name()
    try:
        check_accelerator(request["accelerator"], name, accel.device_count() if name != "cpu" else 0, 0)
    except AcceleratorMismatch as err:  # no GPU here (or not the planned one): the first trial says so, fatal
        emit("mismatch", error=str(err))
        return 0
    emit("device", accelerator=name, capability=_capability(name))
    if request.get("cpu_info"):
        import cpuinfo

        info = dict(request["cpu_info"])
        cpuinfo.get_cpu_info = lambda: dict(info)  # DeepSpeed's builders import it at call time (as a rank does)
    names = needed_builders(name, request["ds_configs"])
    current: list[str | None] = [None]  # the op being loaded, for the failure's report
    loaded: list[str] = []
    dirs: dict[str, list[str]] = {}  # builder class -> [op, its build folder's name] (autotune.trials.ops' record)

    def report(op: str, building: bool) -> None:
        current[0] = op
        emit("op", op=op, building=building)

    for builder in names:
        current[0] = None
        try:
            load_op(builder, accel, report)
        except Exception as err:  # noqa: BLE001  (every failure is one event; the traceback stays on stderr)
            traceback.print_exc()
            emit("failed", error=classify(err)[1], **build_failure(err, current[0]))
            return 1
        if current[0] is not None:
            loaded.append(current[0])
            dirs[builder] = [current[0], accel.create_op_builder(builder).name]
    emit("done", ops=loaded, builds=dirs)
    return 0


def _capability(device: str) -> str | None:
    if device != "cuda":
        return None
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


if __name__ == "__main__":
    sys.exit(main())
