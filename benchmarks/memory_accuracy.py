"""Predicted vs measured peak memory of real DeepSpeed trials of the tiny model, before and after calibration.

Runs a grid of 24 configs of `tiny` (one rank, DeepSpeed's CPU accelerator; every ZeRO stage, fp32 and
bf16, micro-batch 1-8, checkpointing off / every layer / every 2 layers, optimizer and parameter offload)
through the deepspeed backend, then compares, per config, the estimator's prediction with the measured
peak growth over the process's baseline (the memory the trial's model, optimizer, activations and
DeepSpeed's buffers add to an idle process that imported torch and DeepSpeed):
- before: the estimator as written (its memory terms without the runtime overhead guess);
- after: calibrated (autotune.prediction.calibrate) on `--fit` configs spread over the grid (every 4th), and
  evaluated on the others (held out) and on all.
The mean absolute percentage error (MAPE) of each, and the worst configs, go to the table.

    python benchmarks/memory_accuracy.py            # run the grid (~5-10 min), then analyse
    python benchmarks/memory_accuracy.py --reuse    # analyse the committed results again

Writes benchmarks/results/memory_accuracy.jsonl (the TrialResults), memory_accuracy.md, memory_accuracy.png.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.prediction.calibrate import fit_calibration
from autotune.values.config import Config
from autotune.prediction.estimate import estimate
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult, read_results, write_results
from autotune.worker.measure import MeasureSettings
from autotune.values.workload import make_workload

HERE = Path(__file__).parent
RESULTS = HERE / "results"
GOAL = 0.10

# (stage, micro-batch, checkpoint interval, precision, offload optimizer, offload params)
GRID = [
    (0, 1, 0, "bf16", "none", "none"), (0, 4, 0, "fp32", "none", "none"), (0, 8, 1, "bf16", "none", "none"),
    (0, 2, 2, "fp32", "none", "none"), (0, 8, 0, "fp32", "none", "none"), (1, 8, 0, "bf16", "none", "none"),
    (1, 4, 1, "fp32", "none", "none"), (1, 1, 0, "fp32", "none", "none"), (1, 2, 0, "bf16", "cpu", "none"),
    (1, 8, 2, "fp32", "cpu", "none"), (2, 4, 0, "bf16", "none", "none"), (2, 8, 0, "fp32", "none", "none"),
    (2, 1, 1, "bf16", "none", "none"), (2, 2, 1, "fp32", "none", "none"), (2, 4, 2, "bf16", "cpu", "none"),
    (2, 8, 0, "fp32", "cpu", "none"), (3, 4, 0, "bf16", "none", "none"), (3, 8, 1, "fp32", "none", "none"),
    (3, 2, 0, "fp32", "none", "none"), (3, 1, 2, "bf16", "none", "none"), (3, 8, 0, "bf16", "cpu", "none"),
    (3, 4, 1, "bf16", "cpu", "cpu"), (3, 8, 2, "fp32", "cpu", "cpu"), (3, 8, 0, "fp32", "cpu", "cpu"),
]
# The same window for every config: RSS still creeps over the first steps (glibc reuses freed blocks
# imperfectly), so windows of different lengths would add noise to the comparison.
MEASURE = MeasureSettings.fixed(warmup_steps=2, steps=3)


def configs() -> list[Config]:
    return [Config(*row) for row in GRID]


def run_grid(out: Path, logs: Path, resume: bool) -> list[TrialResult]:
    workload, hardware = make_workload("tiny"), PROFILES["cpu"]
    backend = DeepSpeedBackend(workload, None, hardware, logs_dir=logs, timeout_s=900, measure=MEASURE)
    done = {r.config: r for r in read_results(out) if r.ok} if resume else {}
    results = []
    with Progress() as progress:
        task = progress.add_task("real trials", total=len(GRID))
        for config in configs():
            result = done.get(config) or backend.run(config)
            results.append(result)
            write_results(out, results)  # keep what ran, whatever happens next
            progress.console.print(f"{config.label():28s} {result.status:8s} "
                                   f"growth {(result.extra.get('peak_memory_growth_bytes') or 0) / 2**20:7.1f} MiB")
            progress.advance(task)
    return results


def mape(pairs: list[tuple[float, float]]) -> float:
    return statistics.mean(abs(pred - real) / real for pred, real in pairs)


def analyse(results: list[TrialResult], fit_every: int) -> str:
    workload, hardware = make_workload("tiny"), PROFILES["cpu"]
    ok = [r for r in results if r.ok]
    fit_set = ok[::fit_every]
    held_out = [r for r in ok if r not in fit_set]
    calibration = fit_calibration(fit_set, workload, hardware)
    calibration_all = fit_calibration(ok, workload, hardware)
    rows = []
    for r in ok:
        baseline = r.extra["baseline_memory_bytes"]
        growth = r.extra["peak_memory_growth_bytes"]
        raw = estimate(r.config, workload, hardware)
        before = raw.peak_bytes - raw.memory.overhead
        after = estimate(r.config, workload, hardware, calibration).peak_bytes - baseline
        rows.append({"result": r, "growth": growth, "baseline": baseline, "before": before, "after": after,
                     "fit": r in fit_set, "dominant": raw.memory.dominant})
    before = mape([(row["before"], row["growth"]) for row in rows])
    after_held = mape([(row["after"], row["growth"]) for row in rows if not row["fit"]])
    after_all = mape([(row["after"], row["growth"]) for row in rows])
    after_in = mape([(estimate(r.config, workload, hardware, calibration_all).peak_bytes
                      - r.extra["baseline_memory_bytes"], r.extra["peak_memory_growth_bytes"]) for r in ok])
    peak_after = mape([(estimate(r.config, workload, hardware, calibration).peak_bytes, r.peak_memory_bytes)
                       for r in held_out])
    worst = sorted(rows, key=lambda row: -abs(row["after"] - row["growth"]) / row["growth"])[:3]

    console = Console(width=160)
    table = Table(title="tiny on DeepSpeed's CPU accelerator: peak growth over the baseline, predicted vs measured")
    for column in ("config", "fit", "baseline MiB", "measured growth MiB", "before MiB", "err", "after MiB", "err",
                   "dominant term"):
        table.add_column(column, justify="right")
    lines = ["| config | used for fit | baseline MiB | measured growth MiB | predicted before MiB | error before |"
             " predicted after MiB | error after | dominant term |", "|" + " --- |" * 9]
    for row in rows:
        r = row["result"]
        cells = [r.config.label(), "yes" if row["fit"] else "", f"{row['baseline'] / 2**20:.0f}",
                 f"{row['growth'] / 2**20:.1f}", f"{row['before'] / 2**20:.1f}",
                 f"{(row['before'] - row['growth']) / row['growth']:+.1%}", f"{row['after'] / 2**20:.1f}",
                 f"{(row['after'] - row['growth']) / row['growth']:+.1%}", row["dominant"]]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    failed = [r for r in results if not r.ok]
    c = calibration
    summary = [
        f"- configs measured: {len(ok)} ok of {len(results)}" + (f"; failed: {', '.join(f'{r.config.label()} ({r.status})' for r in failed)}" if failed else ""),
        f"- MAPE of the peak growth, before calibration (estimator as written, its terms without the overhead guess): **{before:.1%}**",
        f"- MAPE after calibration on {len(fit_set)} configs (every {fit_every}th), on the {len(held_out)} held-out configs: **{after_held:.1%}** (all {len(rows)}: {after_all:.1%}; goal < {GOAL:.0%})",
        f"- MAPE when calibrated on all {len(ok)} (in-sample): {after_in:.1%}; MAPE of the whole-process peak, held out: {peak_after:.1%}",
        "- worst after calibration: " + "; ".join(f"{row['result'].config.label()} {(row['after'] - row['growth']) / row['growth']:+.1%}" for row in worst),
        f"- calibration (fit set): overhead {c.overhead_bytes / 2**20 if c.overhead_bytes else 0:.0f} MiB, "
        f"memory_scale {c.memory_scale:.3f}, activation_scale {c.activation_scale:.3f}",
        f"- baseline (process before the model, median): {statistics.median(row['baseline'] for row in rows) / 2**20:.0f} MiB",
    ]
    for line in summary:
        console.print(line)
    _plot(rows, RESULTS / "memory_accuracy.png")
    header = [
        "# Peak memory: estimator vs real DeepSpeed trials (tiny, CPU accelerator, 1 rank)", "",
        f"`python benchmarks/memory_accuracy.py` on {platform.node() or 'this machine'} "
        f"({os.cpu_count()} cores); DeepSpeed {_version('deepspeed')}, torch {_version('torch')}.",
        "Measured growth: the trial's true peak resident set over the measured steps (VmHWM after clear_refs) "
        "minus the same process's resident set before the model was built.", "",
    ]
    return "\n".join(header + summary + [""] + lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 5))
    real = [row["growth"] / 2**20 for row in rows]
    ax.scatter(real, [row["before"] / 2**20 for row in rows], label="before calibration", marker="x")
    ax.scatter(real, [row["after"] / 2**20 for row in rows], label="after calibration", marker="o", facecolors="none",
               edgecolors="C1")
    top = max(max(real), max(row["before"] / 2**20 for row in rows)) * 1.05
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.set_xlabel("measured peak growth (MiB)")
    ax.set_ylabel("predicted (MiB)")
    ax.set_title("tiny on CPU: predicted vs measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _version(name: str) -> str:
    module = sys.modules.get(name)
    if module is None:
        import importlib.metadata

        return importlib.metadata.version(name)
    return getattr(module, "__version__", "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", action="store_true", help="analyse results/memory_accuracy.jsonl again")
    parser.add_argument("--fit-every", type=int, default=4, help="calibrate on every n-th config (default: 4)")
    parser.add_argument("--logs", default=None, help="trial logs directory (default: a temporary one)")
    parser.add_argument("--resume", action="store_true", help="keep the ok results already in the table, run the rest")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "memory_accuracy.jsonl"
    if args.reuse:
        results = read_results(out)
    else:
        logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="memory_accuracy-"))
        results = run_grid(out, logs, args.resume)
    (RESULTS / "memory_accuracy.md").write_text(analyse(results, args.fit_every))


if __name__ == "__main__":
    main()
