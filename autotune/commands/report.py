"""`autotune report runs/NAME`: regenerate a sweep's outputs from its run directory; `autotune report DIR` of an
`autotune sweep` directory: every workload's, and the sweep summary (no Ray, no trial)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from autotune.values.argtypes import existing_dir
from autotune.values.config import ConfigError
from autotune.values.results import TrialResult
from autotune.values.settings import RunSettings
from autotune.commands.common import add_json_argument, emit_json, json_command
from autotune.api import own_outputs
from autotune.outputs.report import Outputs, check_record, check_not_gone, tables, write_outputs
from autotune.outputs.sweep import SUMMARY_CSV, SUMMARY_MD, summary_row, write_summary
from autotune.search.rundir import SWEEP_COPY, RunDir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=existing_dir,
                        help="run directory of a sweep (holds run.json and trials.jsonl), or the directory of an "
                             "`autotune sweep` (holds sweep.yaml): its workloads' outputs and sweep summary")
    add_json_argument(parser)


@json_command
def run(args: argparse.Namespace) -> int:
    run_dir = RunDir(args.run_dir)
    args._run_dir = args.run_dir  # an internal error's traceback goes to its logs/ (autotune.cli)
    if not run_dir.settings_path.exists() and (run_dir.path / SWEEP_COPY).is_file():
        return _sweep(args, run_dir.path)
    settings, results, outputs = regenerate(run_dir)
    if args.json:
        # What report.md's tables say, from the same functions: the top configs and the failures by cause.
        emit_json(args, {**outputs.to_dict(run_dir.path), **tables(results, settings.memory_budget_bytes)})
        return 0 if outputs.best is not None else 1
    print(outputs.verdict)
    for line in outputs.notes:  # script mode: how to use the script's own config
        print(line)
    for path in outputs.files:
        print(f"  {path}")
    return 0 if outputs.best is not None else 1


def check(run_dir: RunDir) -> RunSettings:
    """What regenerating a run directory's outputs needs, refused in one line before anything is written: no tuner
    on it, its settings and the files the outputs are made of readable (check_record)."""
    holder = run_dir.busy()
    if holder is not None:  # its tuner writes the outputs when it ends: two writers would race on them
        raise ConfigError(f"{run_dir.path} is in use by pid {holder}: its report is written when the sweep ends "
                          "(run autotune report then)")
    settings = run_dir.read_settings()
    # stop.json and calibration.json readable, the record there: else one line naming the file, nothing written
    check_record(run_dir)
    return settings


def regenerate(run_dir: RunDir) -> tuple[RunSettings, list[TrialResult], Outputs]:
    """A run directory's outputs rewritten from its record alone (check first), under its lock: its settings, the
    record as read there and the outputs."""
    settings = check(run_dir)
    with run_dir.locked():  # no tuner starts on it while the outputs are rewritten
        for note in run_dir.notes:  # what taking it repaired (a torn last line moved aside), as `tune` says it
            print(note, file=sys.stderr, flush=True)
        results = run_dir.results()
        check_not_gone(run_dir, results)  # a record whose only line was torn is gone too
        return settings, results, write_outputs(run_dir, settings, results, own=own_outputs(settings))


def sweep_rows(out: Path, names: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The sweep summary's rows of the workloads `names` of the sweep directory `out`, each from its run directory
    (<out>/<name>, its outputs rewritten as `autotune report` does); every one checked before any is written."""
    runs = [RunDir(out / name) for name in names]
    for run in runs:
        check(run)
    rows = []
    for name, run in zip(names, runs):
        settings, _, outputs = regenerate(run)
        rows.append(summary_row(name, settings, run.path, out, outputs.best, outputs.summary, outputs.verdict,
                                outputs.summary.get("stopped", "")))
    return rows


def _sweep(args: argparse.Namespace, out: Path) -> int:
    """The directory of an `autotune sweep`: its workloads' outputs and its summary, from their run directories (the
    workloads its kept sweep file names; one with nothing recorded yet is said and left out)."""
    from autotune.commands.sweep_file import kept_names

    names = kept_names(out) or ()
    recorded = [name for name in names if RunDir(out / name).exists()]
    if not recorded:  # one line, not one per workload before it
        raise ConfigError(f"{out}: a sweep directory whose workloads ({', '.join(names)}) recorded nothing: no summary "
                          "to write")
    for name in names:
        if name not in recorded:
            print(f"{name}: nothing recorded in {out / name} (interrupted before its settings were written): not in "
                  "the summary", file=sys.stderr)
    rows = sweep_rows(out, recorded)
    write_summary(out, rows)
    if args.json:
        emit_json(args, {"out": str(out), "summary_md": str(out / SUMMARY_MD), "summary_csv": str(out / SUMMARY_CSV),
                         "workloads": rows})
    else:
        for row in rows:
            print(f"{row['workload']}: {row['verdict']}")
        print(f"sweep summary: {out / SUMMARY_MD} ({out / SUMMARY_CSV})")
    return 0 if all(row["recommended"] for row in rows) else 1
