"""The summary of a sweep of many workloads (`autotune sweep`): one row per workload, its recommended config,
throughput, memory, why it stopped and a link to its report, as markdown and CSV in the sweep directory."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Mapping

from autotune.files import write_atomic
from autotune.outputs.tracking import LOCAL_ARTIFACTS, LOCAL_DB
from autotune.search.rundir import SWEEP_COPY
from autotune.values.results import TrialResult
from autotune.values.settings import RunSettings
from autotune.values.units import format_size

SUMMARY_MD = "sweep_summary.md"
SUMMARY_CSV = "sweep_summary.csv"
# What a sweep directory holds of its own beside the workloads' run directories (<out>/<name>): a workload of one
# of these names would collide with it (compared without case: a case-insensitive file system takes A for a).
# logs/: autotune.cli's tracebacks; mlflow.db (and SQLite's side files) and mlartifacts/: --mlflow's local store.
OWN_NAMES = (SWEEP_COPY, SUMMARY_MD, SUMMARY_CSV, "logs", LOCAL_DB, f"{LOCAL_DB}-journal", f"{LOCAL_DB}-wal",
             f"{LOCAL_DB}-shm", LOCAL_ARTIFACTS)
CSV_COLUMNS = ("workload", "model", "gpus", "global_batch", "hardware", "memory_budget", "strategy", "backend",
               "trials", "pruned", "recommended", "throughput_samples_per_s", "peak_memory_bytes", "config_json",
               "stopped", "verdict", "report")


# What the counts mean: the console's "pruned N configs: ... predicted over host memory" counts pruned configs only,
# a verdict's "configs over host memory" every config of the space, the launched trials that ran out included.
LEGEND = ("*trials*: trials launched; *pruned*: configs predicted not to fit (or not to beat the best), run by no "
          "trial, as the console's `pruned` lines count them. A verdict's \"N configs over ...\" counts every config "
          "of the space by the resource it lacks: the pruned ones and the launched trials that ran out of it.")


def summary_row(name: str, settings: RunSettings, run_dir: Path, out: Path, best: TrialResult | None,
                summary: Mapping[str, Any], verdict: str, stopped: str) -> dict[str, Any]:
    """One workload's row (`settings`: its run's, a script's as its first trial learned). `trials`: the trials
    launched, as the console and `tune --json`'s `launched` count them; `pruned`: the configs recorded as pruned
    (predicted not to fit, or not to beat the best), which ran no trial."""
    w = settings.workload
    pruned = summary.get("status_counts", {}).get("pruned", 0)
    return {
        "workload": name, "model": w.model.name, "gpus": w.gpus, "global_batch": w.global_batch,
        "hardware": settings.hardware.name, "memory_budget": format_size(settings.memory_budget_bytes),
        "strategy": settings.strategy, "backend": settings.backend,
        "trials": summary.get("trials", 0) - pruned, "pruned": pruned,  # none: interrupted before it was opened
        "recommended": best.config.label() if best else "",
        "config_json": best.config.to_json() if best else "",
        "throughput_samples_per_s": round(best.throughput, 3) if best else "",
        "peak_memory": format_size(best.peak_memory_bytes) if best and best.peak_memory_bytes else "",
        "peak_memory_bytes": best.peak_memory_bytes if best else "",
        "stopped": stopped,
        "verdict": verdict,
        "report": str((run_dir / "report.md").relative_to(out)),
    }


def write_summary(out: Path, rows: list[dict]) -> tuple[Path, Path]:
    md, csv_path = out / SUMMARY_MD, out / SUMMARY_CSV
    lines = ["# Sweep summary", "",
             "| workload | model | gpus | global batch | budget | trials | pruned | recommended config | samples/s | "
             "peak memory | stopped | report |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |"]
    for r in rows:
        cells = (r["workload"], r["model"], r["gpus"], r["global_batch"], r["memory_budget"], r["trials"], r["pruned"],
                 r["recommended"] or "none: " + r["verdict"], r["throughput_samples_per_s"], r["peak_memory"],
                 r["stopped"], f"[report]({r['report']})")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", LEGEND, ""]
    write_atomic(md, "\n".join(lines))
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(csv_path, table.getvalue())
    return md, csv_path


def _cell(value: Any) -> str:
    """A value as one markdown table cell: on one line (a verdict may quote a script's stderr over several, which
    would end the row), its '|' escaped (which would split the cell)."""
    return " ".join(str(value).split()).replace("|", "\\|")
