"""Trial overhead (launch to first measured step) and measured time per trial, ours vs the launchers.

The same config (ZeRO-2, micro-batch 4, checkpoint every layer, bf16) of a model (default: tiny, global batch
16, one rank) runs through the deepspeed backend with three launchers, rounds interleaved so that load drift
on a shared machine hits them alike:
- ours: the runner starts the ranks itself (`direct`), measuring until the step time is stable;
- torchrun: `python -m torch.distributed.run`, same worker and measurement;
- deepspeed: DeepSpeed's own launcher (`deepspeed --num_gpus N --module ...`), same worker and measurement;
- deepspeed fixed: DeepSpeed's launcher with the fixed schedule of DeepSpeed's autotuner (profile steps
  3 to 5: 2 warm-up steps and 3 measured ones).
Per variant: the median over rounds of launch-to-first-measured-step and where it went (spawn of the
interpreters, imports, C++ ops, building the model, DeepSpeed initialize, warm-up), the measured time and
steps, the wall time, and the throughput; then every trial's phases and its model as built (dtype, device,
what initialize cast or moved). Our repeated trials also give the spread of repeated measurements.
`--hardware auto` (the default) runs on this machine's accelerator: CUDA on a GPU machine, DeepSpeed's CPU
accelerator otherwise (a profile name forces one).

    python benchmarks/trial_overhead.py [--rounds 5] [--gpus 1] [--hardware auto] [--model tiny]
                                        [--global-batch N] [--variants ours,torchrun,...] [--out DIR]

Writes trial_overhead.md and trial_overhead.json to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.values.config import Config
from autotune.trials.devices import AUTO, resolve_hardware
from autotune.values.hardware import PROFILES, Hardware
from autotune.values.results import TrialResult
from autotune.worker.measure import MeasureSettings
from autotune.values.workload import Workload, make_workload

HERE = Path(__file__).parent
RESULTS = HERE / "results"
CONFIG = Config(2, 4, 1, "bf16")
VARIANTS = {  # name: (short name, launcher, measurement)
    "ours (direct, adaptive)": ("ours", "direct", MeasureSettings()),
    "torchrun (same worker)": ("torchrun", "torchrun", MeasureSettings()),
    "deepspeed launcher (same worker)": ("deepspeed", "deepspeed", MeasureSettings()),
    "deepspeed launcher, fixed 2+3 steps": ("deepspeed-fixed", "deepspeed", MeasureSettings.fixed(2, 3)),
}
PHASES = ("spawn_s", "import_s", "build_ops_s", "dist_init_s", "build_s", "initialize_s", "warmup_s")


def run(rounds: int, workload: Workload, hardware: Hardware, variants: list[str],
        logs: Path) -> dict[str, list[TrialResult]]:
    out: dict[str, list[TrialResult]] = {name: [] for name in variants}
    with Progress() as progress:
        task = progress.add_task("trials", total=rounds * len(variants))
        for round_ in range(rounds):
            for name in variants:
                _, launcher, measure = VARIANTS[name]
                backend = DeepSpeedBackend(workload, None, hardware, logs_dir=logs / f"{round_}-{launcher}",
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


def report(results: dict[str, list[TrialResult]], workload: Workload, hardware: Hardware, command: str) -> str:
    console = Console(width=170)
    what = (f"{workload.model.name}, {CONFIG.label()}, global batch {workload.global_batch}, {workload.gpus} rank(s) "
            f"on {hardware.name} ({hardware.accelerator})")
    table = Table(title=f"{what}: medians over rounds")
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
                 f"{median([r.wall_time_s for r in ok]):.1f}", f"{median([r.throughput_samples_per_s or 0.0 for r in ok]):.2f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    summary = []
    ours = [r for r in results.get("ours (direct, adaptive)", []) if r.ok]
    fixed = [r for r in results.get("deepspeed launcher, fixed 2+3 steps", []) if r.ok]
    if ours and fixed:
        ours_first = median([r.extra["launch_to_first_step_s"] for r in ours])
        ds_first = median([r.extra["launch_to_first_step_s"] for r in fixed])
        summary += [
            f"- launch to first measured step: ours {ours_first:.1f} s vs DeepSpeed's launcher with the autotuner's "
            f"fixed schedule {ds_first:.1f} s ({1 - ours_first / ds_first:.0%} less)",
            f"- wall time per trial: ours {median([r.wall_time_s for r in ours]):.1f} s vs "
            f"{median([r.wall_time_s for r in fixed]):.1f} s"]
    if ours:
        throughput = [r.throughput_samples_per_s or 0.0 for r in ours]
        peaks = [float(r.peak_memory_bytes or 0) for r in ours]
        iqr = [r.extra["step_time_iqr_s"] / r.step_time_s for r in ours]
        summary += [
            f"- repeated measurements of the same config ({len(ours)} fresh trials, ours): throughput median "
            f"{median(throughput):.2f} samples/s, spread {spread(throughput)}; peak memory spread {spread(peaks)}",
            f"- within a trial: step-time IQR / median, median over trials {median(iqr):.1%}; stop reasons "
            f"{sorted({r.extra['stop_reason'] for r in ours})}, steps measured {[r.extra['steps_measured'] for r in ours]}"]
    summary.append(f"- machine: {os.cpu_count()} cores, load average at the end {os.getloadavg()[0]:.1f} "
                   "(shared with other work)")
    for line in summary:
        console.print(line)
    trials = trial_lines(results)
    console.print(*trials, sep="\n")
    header = ["# Trial overhead: ours vs torchrun and DeepSpeed's launcher", "",
              f"`{command}`: {what}. Overhead is everything before the first measured step: interpreter spawn "
              "(the launcher's own interpreters included), imports, C++ op loading, building the model, DeepSpeed "
              "initialize, warm-up.", ""]
    return "\n".join(header + summary + [""] + lines + ["", "Each trial (seconds):", ""] + trials) + "\n"


def trial_lines(results: dict[str, list[TrialResult]]) -> list[str]:
    """Every trial's phases, and its model as built: dtype, device, the build's peak over the baseline, and how
    many parameters deepspeed.initialize cast or moved (0: built where it trains)."""
    columns = ["variant", "round", "status", "launch to 1st step", *(p.replace("_s", "") for p in PHASES), "measure",
               "built as", "build peak MiB", "cast or moved by initialize"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for name, rs in results.items():
        for round_, r in enumerate(rs, 1):
            phases = r.extra.get("phases_s") or {}
            built = r.extra.get("build") or {}
            cells = [VARIANTS[name][0], str(round_), r.status, f"{r.extra.get('launch_to_first_step_s', float('nan')):.1f}",
                     *(f"{phases[p]:.1f}" if p in phases else "-" for p in (*PHASES, "measure_s")),
                     f"{built['dtype']} on {built['device']}" if built else "-",
                     f"{built['peak_growth_bytes'] / 2**20:.0f}" if built else "-",
                     f"{built['cast_or_moved']} of {built['tensors']}" if built else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=1, help="ranks (default: 1)")
    parser.add_argument("--hardware", choices=[AUTO, *PROFILES], default=AUTO,
                        help="the trials' profile (default: auto, this machine's accelerator)")
    parser.add_argument("--model", default="tiny", help="a preset or Hugging Face config (default: tiny)")
    parser.add_argument("--global-batch", type=int, default=None, help="default: the model's")
    short = {v[0]: name for name, v in VARIANTS.items()}
    parser.add_argument("--variants", default=",".join(short),
                        help=f"comma-separated, of {', '.join(short)} (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the .md and .json go (default: %(default)s)")
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in short]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed {list(short)}")
    hardware, _ = resolve_hardware(args.hardware if args.hardware == AUTO else PROFILES[args.hardware], real=True)
    workload = make_workload(args.model, global_batch=args.global_batch, gpus=args.gpus)
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args.rounds, workload, hardware, [short[v] for v in args.variants.split(",")],
                  Path(tempfile.mkdtemp(prefix="trial_overhead-")))
    (args.out / "trial_overhead.json").write_text(json.dumps(
        {name: [r.to_dict() for r in rs] for name, rs in results.items()}, indent=1) + "\n")
    command = "python benchmarks/trial_overhead.py " + " ".join(sys.argv[1:])
    (args.out / "trial_overhead.md").write_text(report(results, workload, hardware, command.strip()))


if __name__ == "__main__":
    main()
