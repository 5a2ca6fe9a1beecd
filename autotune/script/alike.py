"""The one rule by which a script trial's failure after `deepspeed.initialize` stops the sweep: the script's own
failure, which every other config would spend its trial on too.

The shim's verdicts (autotune.script.shim.VERDICTS) stop a sweep where the script alone is at fault before any
config applies (it crashes before `deepspeed.initialize`, never steps, ...). After the engine exists a failure can be
the config's (out of memory, an optimizer ZeRO will not partition, a precision the loop does not feed), so one trial
proves nothing. Two do, conservatively: trials of two configs apart in layout (`apart`: ZeRO partitioning, precision
or offload), none of the sweep's trials having run (`ok`), each of which took optimizer steps under its config (the engine trained) and then ended the same way after
the same number of optimizer steps (the script's global batch is kept, so that is the same point of its loop):
- a crash with the same exception, message and place it was raised (the innermost frame: file name, line,
  function), as the rank's report says it (`crash_of`);
- a stall: the trial ran out of time, and its rank 0 had stopped stepping long before (no optimizer step for
  STALL_FACTOR times its slowest step and at least STALL_MIN_S), as its events show (`stall_of`); a config merely
  slow keeps stepping until its time runs out, and is no stall.
Out of memory, `untrained`, `unsupported`, the shim's own verdicts and a crash before the first optimizer step (what
the engine runs first depends on the config: dtype, partitioned parameters; the loop's three-configs rule,
autotune.drivers.loop, takes those) never count.

`autotune.backends.script.ScriptBackend` keeps each failed trial's signature in its record (`FAILURE`) and asks
`same_failure` after every trial, with the run directory's record and its own trials as the history; the verdict
(`VERDICT`) and its line go into the record that stopped the sweep (`script_verdict`, `WHY`), which the report puts
first (autotune.outputs.script).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from autotune.values.config import Config
from autotune.values.results import TrialResult

VERDICT = "fails_alike_after_initialize"
FAILURE = "script_failure"  # result extra: the signature of a failure after deepspeed.initialize (crash_of, stall_of)
WHY = "script_verdict_why"  # result extra: the verdict's line, where the record's own error is the trial's
STALL_FACTOR = 10.0
STALL_MIN_S = 10.0
# What makes two failures the same (a stall's seconds are not).
IDENTITY = ("kind", "steps", "exception", "error", "site")


def site_of(err: BaseException) -> str | None:
    """Where `err` was raised: its innermost frame as `file.py:line in function` (the file's name only: a Ray trial
    runs a fresh copy of the script in another folder each time)."""
    tb = err.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{Path(code.co_filename).name}:{tb.tb_lineno} in {code.co_name}"


def crash_of(report: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The signature of a rank's failure report (autotune.script.shim's `failure`) that can be the script's: a crash
    after deepspeed.initialize and at least one optimizer step, not one of the shim's verdicts; else None."""
    if not report or report.get("status") != "crash" or report.get("verdict") or not report.get("initialized"):
        return None
    steps = report.get("steps")
    if not isinstance(steps, int) or steps < 1:
        return None
    return {"kind": "crash", "steps": steps, "exception": report.get("exception"), "error": report.get("error"),
            "site": report.get("site")}


def stall_of(events: Sequence[Mapping[str, Any]], ended_at: float) -> dict[str, Any] | None:
    """The signature of a trial that ran out of time at `ended_at` (epoch seconds) with rank 0's `events`
    (autotune.worker.protocol.read_events), where its script stopped stepping after deepspeed.initialize: its last
    optimizer step (an event with `steps`, autotune.script.shim) long before the end, by its slowest step (the first
    counted from the end of deepspeed.initialize, the `warmup` event without steps); else None."""
    start = next((e.get("t") for e in events if e.get("phase") == "warmup" and "steps" not in e), None)
    stepped = [e for e in events if isinstance(e.get("steps"), int) and e["steps"] >= 1]
    if not isinstance(start, (int, float)) or not stepped:
        return None
    marks = [float(start), *(float(e["t"]) for e in stepped)]
    slowest = max(b - a for a, b in zip(marks, marks[1:]))
    quiet = ended_at - marks[-1]
    if quiet < max(STALL_FACTOR * slowest, STALL_MIN_S):
        return None
    return {"kind": "stall", "steps": stepped[-1]["steps"], "exception": None, "error": None, "site": None,
            "quiet_s": round(quiet, 1), "slowest_step_s": round(slowest, 3)}


def same_failure(history: Iterable[TrialResult], result: TrialResult) -> str | None:
    """The verdict (`VERDICT: why`) where `result` failed as a trial of another config in `history` did, none of
    `history` having run; else None."""
    mine = result.extra.get(FAILURE)
    if result.status not in ("crash", "timeout") or not isinstance(mine, dict):
        return None
    earlier = list(history)
    if any(r.status == "ok" for r in earlier):
        return None
    twin = next((r for r in earlier if apart(r.config, result.config) and r.status == result.status
                 and _same(r.extra.get(FAILURE), mine)), None)
    if twin is None:
        return None
    number = twin.extra.get("trial")
    configs = f"{twin.config.label()}{f' (trial {number})' if number else ''} and {result.config.label()}"
    steps = f"{mine['steps']} optimizer step{'s' if mine['steps'] != 1 else ''}"
    if mine["kind"] == "crash":
        where = f" ({mine['site']})" if mine.get("site") else ""
        error = (str(mine.get("error") or "").strip().splitlines() or [str(mine.get("exception"))])[0]
        why = (f"{error}{where}, after {steps}, in {configs} alike: the same failure of the script whatever "
               "the config")
    else:
        why = (f"the script stopped stepping after {steps} in {configs} alike (no optimizer step in the last "
               f"{mine['quiet_s']:.0f} s before the trial's time ran out, its steps having taken at most "
               f"{mine['slowest_step_s']:.2g} s): it waits or loops there whatever the config")
    return f"{VERDICT}: {why}"


def apart(a: Config, b: Config) -> bool:
    """Whether a failure alike in configs `a` and `b` cannot be either's own: they differ in whether ZeRO partitions,
    in precision or in offload. Not in micro-batch, checkpointing or partitioned stage alone: a failure of ZeRO-3's
    partitioned parameters (a checkpoint saved at step N) comes alike in two ZeRO-3 configs."""
    return ((a.zero_stage > 0) != (b.zero_stage > 0) or a.precision != b.precision
            or (a.offload_optimizer, a.offload_param) != (b.offload_optimizer, b.offload_param))


def _same(theirs: Any, mine: Mapping[str, Any]) -> bool:
    return isinstance(theirs, Mapping) and all(theirs.get(key) == mine.get(key) for key in IDENTITY)
