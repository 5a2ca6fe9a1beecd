"""What the `behind` stop of a measurement (autotune/worker/measure.py) saves, replayed on recorded step times.

Each committed record of real trials with their measured step times (the CPU surfaces in benchmarks/surfaces/, the
H200 runs' records in benchmarks/gpu-runs/), in its recorded order: each trial's measurement is replayed through
`stop_reason` with the sweep's best step time so far (the fastest median step of the earlier trials that were ok),
as the deepspeed backend now sets it, and without it (the rule before issue 41's `behind`). The memory peak is
taken as settled (the records hold no per-step peaks). Per record: trials, those that stop `behind`, measured steps
and seconds saved, and the saving's share of the record's trial wall seconds.

    python benchmarks/measure_behind.py [--out DIR]

Writes measure_behind.md and measure_behind.json to --out (default benchmarks/results/). Seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table

from autotune.values.results import TrialResult, read_results
from autotune.worker.measure import BEHIND, MeasureSettings, stop_reason
from search_efficiency import machine, source_state  # beside this script

ROOT = Path(__file__).resolve().parent
RECORDS = ("surfaces/tiny-cpu.jsonl", "surfaces/small-llama-cpu.jsonl", "gpu-runs/h200-2026-11-26/tune/trials.jsonl",
           "gpu-runs/h200-2026-11-27/tune/trials.jsonl", "gpu-runs/h200-2026-11-26/kit/surfaces/h200-llama-3b.jsonl")


def stop_at(times: Sequence[float], settings: MeasureSettings) -> tuple[int, str | None]:
    """The measured steps after which `settings` stop, and why (all of them, None: the record ended first)."""
    for n in range(1, len(times) + 1):
        why = stop_reason(times[:n], sum(times[:n]), settings)
        if why is not None:
            return n, why
    return len(times), None


def replay(results: Sequence[TrialResult]) -> dict:
    best: float | None = None
    trials = behind = saved_steps = steps = 0
    saved_s = wall_s = 0.0
    for r in results:
        times = [float(t) for t in r.extra.get("step_times_s") or []]
        wall_s += r.wall_time_s
        if not times:
            continue
        trials += 1
        steps += len(times)
        before, _ = stop_at(times, MeasureSettings())
        now, why = stop_at(times, MeasureSettings(best_step_s=best))
        if why == BEHIND:
            behind += 1
        saved_steps += before - now
        saved_s += sum(times[now:before])
        if r.status == "ok" and r.step_time_s:
            best = min(best if best is not None else r.step_time_s, r.step_time_s)
    return {"trials": trials, "behind": behind, "steps": steps, "saved_steps": saved_steps,
            "saved_s": round(saved_s, 1), "wall_s": round(wall_s, 1),
            "saved_share": saved_s / wall_s if wall_s else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    rows = {name: replay(read_results(ROOT / name)) for name in RECORDS}
    table = Table(*("record", "trials", "behind", "steps saved", "seconds saved", "of trial-s"))
    for name, r in rows.items():
        table.add_row(name, str(r["trials"]), str(r["behind"]), f"{r['saved_steps']} of {r['steps']}",
                      f"{r['saved_s']:.0f}", f"{r['saved_share']:.1%} of {r['wall_s']:.0f}")
    Console().print(table)
    command = "python benchmarks/measure_behind.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# The `behind` stop of a measurement, replayed on recorded step times (issue 41)", "",
             f"`{command.strip()}` ({machine()}; {source_state()}).", "",
             "Each record's trials in their recorded order, each measurement replayed through "
             "autotune.worker.measure.stop_reason with the best step time of the earlier ok trials (`behind`: every "
             "one of at least 3 measured steps over 1.1x it) and without (the rule before); peaks taken as settled. "
             "A record's measurement ended where it did, so a saving is counted only within its recorded steps.", "",
             "| record | trials | stopped behind | steps saved | seconds saved | share of the trials' wall seconds |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {name} | {r['trials']} | {r['behind']} | {r['saved_steps']} of {r['steps']} | {r['saved_s']:.0f} | "
              f"{r['saved_share']:.1%} of {r['wall_s']:.0f} s |" for name, r in rows.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "measure_behind.md").write_text("\n".join(lines) + "\n")
    (args.out / "measure_behind.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
