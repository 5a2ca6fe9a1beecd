"""`autotune report runs/NAME`: regenerate a sweep's outputs from its run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.report import write_outputs
from autotune.rundir import RunDir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="run directory of a sweep (holds run.json and trials.jsonl)")


def run(args: argparse.Namespace) -> int:
    run_dir = RunDir(args.run_dir)
    outputs = write_outputs(run_dir, run_dir.read_settings())
    print(outputs.verdict)
    for path in outputs.files:
        print(f"  {path}")
    return 0 if outputs.best is not None else 1
