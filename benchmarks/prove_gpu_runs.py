"""Rewrite the committed GPU runs' records (benchmarks/gpu-runs/) as they prove themselves (issue 40).

Every fp16 trial of both H200 runs skipped every optimizer step: recorded `ok` with a loss that never moved, or
`crash` when the loss scaler gave up. The product reads such records as `untrained`
(autotune.values.results.as_recorded_proves); this writes that reading into the committed copies, so that no file
of the repository holds them as measurements: status `untrained`, no throughput, the cause in `error`, `fault`
and the recorded status kept beside it (`recorded_status`); every other key as it was. A rank's own report
(`rank0.json`, no config) recorded `ok` with a loss that never moved gets the same three keys. The runs' raw files
stay in ../shared/gpu-runs/. Idempotent: a second run changes nothing.

    python benchmarks/prove_gpu_runs.py [FOLDER]   (default: benchmarks/gpu-runs)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from autotune.values.results import OVERFLOW, TrialResult, as_recorded_proves

HERE = Path(__file__).resolve().parent
PROVEN = ("status", "throughput_samples_per_s", "tokens_per_s", "error", "fault", "recorded_status")


def proven(record: Any) -> Any:
    """`record` (a result's or a rank's JSON object) as it proves itself; anything else as it is."""
    if not isinstance(record, dict) or "status" not in record:
        return record
    if "config" in record:
        result = TrialResult.from_dict(record)
        shown = as_recorded_proves(result)
        if shown is result:
            return record
        return {**record, **{k: shown.to_dict()[k] for k in PROVEN}}
    first, last = record.get("loss_first"), record.get("loss_last")
    if record["status"] == "ok" and first is not None and first == last and "steps_applied" not in record:
        return {**record, "status": "untrained", "fault": OVERFLOW, "recorded_status": "ok"}
    return record


def rewrite(path: Path) -> bool:
    """`path` (a JSONL of records, a result or rank JSON, or a JSON holding one under `result`) rewritten where a
    record changed; True if it did."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        lines = text.splitlines()
        out = [line if not line.strip() else _line(line) for line in lines]
        new = "\n".join(out) + ("\n" if text.endswith("\n") else "")
    else:
        data = json.loads(text)
        shown = {**data, "result": proven(data["result"])} if isinstance(data, dict) and "result" in data \
            else proven(data)
        new = text if shown == data else json.dumps(shown, indent=_indent(text)) + ("\n" if text.endswith("\n") else "")
    if new == text:
        return False
    path.write_text(new)
    return True


def _line(line: str) -> str:
    record = json.loads(line)
    shown = proven(record)
    return line if shown == record else json.dumps(shown)


def _indent(text: str) -> int | None:
    second = text.split("\n", 2)[1] if text.count("\n") > 1 else ""
    return len(second) - len(second.lstrip(" ")) or None


def main(argv: list[str] | None = None) -> int:
    folder = Path((argv if argv is not None else sys.argv[1:] or [str(HERE / "gpu-runs")])[0])
    paths = sorted(p for p in folder.rglob("*") if p.suffix in (".json", ".jsonl") and not p.name.endswith(
        ".events.jsonl"))
    changed = [p for p in paths if rewrite(p)]
    for path in changed:
        print(f"proven: {path.relative_to(folder)}")
    print(f"{len(changed)} of {len(paths)} record files rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
