"""Trial overhead (launch to first measured step) and measured time per trial, ours vs the launchers.

The same config of the tiny model (default: ZeRO-2, micro-batch 4, checkpoint every layer, bf16, global
batch 16, one rank) runs through the deepspeed backend with three launchers, rounds interleaved so that
load drift on a shared machine hits them alike:
- ours: the runner starts the ranks itself (`direct`), measuring until the step time is stable;
- torchrun: `python -m torch.distributed.run`, same worker and measurement;
- deepspeed: DeepSpeed's own launcher (`deepspeed --num_gpus N --module ...`), same worker and measurement;
- deepspeed fixed: DeepSpeed's launcher with the fixed schedule of DeepSpeed's autotuner (profile steps
  3 to 5: 2 warm-up steps and 3 measured ones).
Per variant: the median over rounds of launch-to-first-measured-step and where it went (spawn of the
interpreters, imports, C++ ops, DeepSpeed initialize, warm-up), the measured time and steps, the wall
time, and the throughput. Our repeated trials also give the spread of repeated measurements.

    python benchmarks/trial_overhead.py [--rounds 5] [--gpus 1]

Writes benchmarks/results/trial_overhead.md and trial_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.config import Config
from autotune.hardware import PROFILES
from autotune.results import TrialResult
from autotune.worker.measure import MeasureSettings
from autotune.workload import make_workload

HERE = Path(__file__).parent
RESULTS = HERE / "results"
CONFIG = Config(2, 4, 1, "bf16")
VARIANTS = {  # name: (launcher, measurement)
    "ours (direct, adaptive)": ("direct", MeasureSettings()),
    "torchrun (same worker)": ("torchrun", MeasureSettings()),
    "deepspeed launcher (same worker)": ("deepspeed", MeasureSettings()),
    "deepspeed launcher, fixed 2+3 steps": ("deepspeed", MeasureSettings.fixed(2, 3)),
}
PHASES = ("spawn_s", "import_s", "build_ops_s", "dist_init_s", "build_s", "initialize_s", "warmup_s")


def run(rounds: int, gpus: int, logs: Path) -> dict[str, list[TrialResult]]:
    workload = make_workload("tiny", gpus=gpus)
    out: dict[str, list[TrialResult]] = {name: [] for name in VARIANTS}
    with Progress() as progress:
        task = progress.add_task("trials", total=rounds * len(VARIANTS))
        for round_ in range(rounds):
            for name, (launcher, measure) in VARIANTS.items():
                backend = DeepSpeedBackend(workload, None, PROFILES["cpu"], logs_dir=logs / f"{round_}-{launcher}",
                                           timeout_s=900, measure=measure, launcher=launcher)
                result = backend.run(CONFIG)
                out[name].append(result)
                progress.console.print(f"round {round_ + 1} {name:38s} {result.status} "
                                       f"first step {result.extra.get('launch_to_first_step_s', 0):.1f} s, "
                                       f"wall {result.wall_time_s:.1f} s")
                progress.advance(task)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return "-"
    mid = statistics.median(values)
    return f"{(max(values) - min(values)) / mid:.1%} (max-min), {statistics.pstdev(values) / statistics.mean(values):.1%} (cv)"


def report(results: dict[str, list[TrialResult]], gpus: int) -> str:
    console = Console(width=170)
    table = Table(title=f"tiny, {CONFIG.label()}, global batch 16, {gpus} rank(s): medians over rounds")
    columns = ["variant", "ok", "launch to 1st measured step s", *(p.replace("_s", "") for p in PHASES),
               "measured s", "steps", "wall s", "samples/s"]
    for column in columns:
        table.add_column(column, justify="right")
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for name, rs in results.items():
        ok = [r for r in rs if r.ok]
        phases = [median([r.extra["phases_s"][p] for r in ok]) for p in PHASES]
        measured = median([r.extra["phases_s"]["measure_s"] for r in ok])
        cells = [name, f"{len(ok)}/{len(rs)}", f"{median([r.extra['launch_to_first_step_s'] for r in ok]):.1f}",
                 *(f"{p:.1f}" for p in phases), f"{measured:.1f}", f"{median([r.extra['steps_measured'] for r in ok]):.0f}",
                 f"{median([r.wall_time_s for r in ok]):.1f}", f"{median([r.throughput_samples_per_s for r in ok]):.2f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    ours = [r for r in results["ours (direct, adaptive)"] if r.ok]
    throughput = [r.throughput_samples_per_s for r in ours]
    peaks = [r.peak_memory_bytes for r in ours]
    iqr = [r.extra["step_time_iqr_s"] / r.step_time_s for r in ours]
    stops = [r.extra["stop_reason"] for r in ours]
    baseline = results["deepspeed launcher, fixed 2+3 steps"]
    ours_first = median([r.extra["launch_to_first_step_s"] for r in ours])
    ds_first = median([r.extra["launch_to_first_step_s"] for r in baseline if r.ok])
    summary = [
        f"- launch to first measured step: ours {ours_first:.1f} s vs DeepSpeed's launcher with the autotuner's "
        f"fixed schedule {ds_first:.1f} s ({1 - ours_first / ds_first:.0%} less)",
        f"- wall time per trial: ours {median([r.wall_time_s for r in ours]):.1f} s vs "
        f"{median([r.wall_time_s for r in baseline if r.ok]):.1f} s",
        f"- repeated measurements of the same config ({len(ours)} fresh trials, ours): throughput median "
        f"{median(throughput):.2f} samples/s, spread {spread(throughput)}; peak memory spread {spread(peaks)}",
        f"- within a trial: step-time IQR / median, median over trials {median(iqr):.1%}; stop reasons {sorted(set(stops))}, "
        f"steps measured {[r.extra['steps_measured'] for r in ours]}",
        f"- machine: {os.cpu_count()} cores, load average at the end {os.getloadavg()[0]:.1f} (shared with other work)",
    ]
    for line in summary:
        console.print(line)
    header = ["# Trial overhead: ours vs torchrun and DeepSpeed's launcher", "",
              f"`python benchmarks/trial_overhead.py --rounds {len(ours)} --gpus {gpus}`. Overhead is everything before the "
              "first measured step: interpreter spawn (the launcher's own interpreters included), imports, "
              "C++ op loading, DeepSpeed initialize, warm-up.", ""]
    return "\n".join(header + summary + [""] + lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=1, help="ranks (default: 1)")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = run(args.rounds, args.gpus, Path(tempfile.mkdtemp(prefix="trial_overhead-")))
    (RESULTS / "trial_overhead.json").write_text(json.dumps(
        {name: [r.to_dict() for r in rs] for name, rs in results.items()}, indent=1) + "\n")
    (RESULTS / "trial_overhead.md").write_text(report(results, args.gpus))


if __name__ == "__main__":
    main()
