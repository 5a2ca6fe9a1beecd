"""`autotune report runs/NAME`: regenerate a sweep's outputs from its run directory."""

from __future__ import annotations

import argparse
import sys

from autotune.values.argtypes import existing_dir
from autotune.values.config import ConfigError
from autotune.commands.common import add_json_argument, emit_json, json_command
from autotune.api import own_outputs
from autotune.outputs.report import check_not_gone, check_record, tables, write_outputs
from autotune.search.rundir import RunDir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=existing_dir, help="run directory of a sweep (holds run.json and trials.jsonl)")
    add_json_argument(parser)


@json_command
def run(args: argparse.Namespace) -> int:
    run_dir = RunDir(args.run_dir)
    args._run_dir = args.run_dir  # an internal error's traceback goes to its logs/ (autotune.cli)
    holder = run_dir.busy()
    if holder is not None:  # its tuner writes the outputs when it ends: two writers would race on them
        raise ConfigError(f"{run_dir.path} is in use by pid {holder}: its report is written when the sweep ends "
                          "(run autotune report then)")
    settings = run_dir.read_settings()
    # stop.json and calibration.json readable, the record there: else one line naming the file, nothing written
    check_record(run_dir)
    with run_dir.locked():  # no tuner starts on it while the outputs are rewritten
        for note in run_dir.notes:  # what taking it repaired (a torn last line moved aside), as `tune` says it
            print(note, file=sys.stderr, flush=True)
        results = run_dir.results()
        check_not_gone(run_dir, results)  # a record whose only line was torn is gone too
        outputs = write_outputs(run_dir, settings, results, own=own_outputs(settings))
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
