"""`autotune sweep sweep.yaml`: tune every workload of a sweep file at once on a Ray cluster, one run
directory each, and write the sweep summary (markdown and CSV)."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from autotune.values.argtypes import output_dir, positive_int, ray_address
from autotune.commands.common import add_json_argument, emit_json, json_command
from autotune.commands.tune import add_tracking_arguments, tracking_uri


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sweep_file", type=Path, help="sweep YAML listing the workloads (see examples/sweep.yaml)")
    parser.add_argument("--ray-address", type=ray_address, default="local",
                        help="Ray cluster (host:port or auto); 'local' starts a private instance on loopback "
                             "(default: %(default)s)")
    parser.add_argument("--concurrency", type=positive_int, default=None,
                        help="trials in flight at most, over all workloads (default: the file's, else as many "
                             "as the cluster holds)")
    parser.add_argument("--out", type=output_dir, default=None, help="sweep directory (default: runs/sweep-<file>-<time>)")
    parser.add_argument("--resume", action="store_true", help="continue the sweep in --out")
    add_tracking_arguments(parser)  # --mlflow: sqlite:///<out>/mlflow.db, one parent run per workload
    add_json_argument(parser)


@json_command
def run(args: argparse.Namespace) -> int:
    from autotune.trials.interrupts import sigterm_as_interrupt
    from autotune.values.settings import masked
    from autotune.search.sweeps import SUMMARY_CSV, SUMMARY_MD, load_sweep, run_sweep

    sweep_file = load_sweep(args.sweep_file)
    if args.resume and args.out is None:
        from autotune.values.config import ConfigError

        raise ConfigError("--resume needs --out DIR (the sweep directory to continue)")
    out = args.out or Path("runs") / f"sweep-{args.sweep_file.stem}-{datetime.now():%Y%m%d-%H%M%S}"
    args._run_dir = out  # an internal error's traceback goes to its logs/ (autotune.cli), once it exists
    mlflow = tracking_uri(args, out)
    with sigterm_as_interrupt():
        rows = run_sweep(sweep_file, out, args.ray_address, args.resume, args.concurrency or sweep_file.concurrency,
                         mlflow=mlflow)
    print(f"sweep summary: {out / SUMMARY_MD} ({out / SUMMARY_CSV})")
    interrupted = any(r["stopped"] == "interrupted" for r in rows.values())
    if args.json:
        emit_json(args, {"out": str(out), "summary_md": str(out / SUMMARY_MD), "summary_csv": str(out / SUMMARY_CSV),
                         "interrupted": interrupted, "mlflow": mlflow and masked(mlflow),
                         "workloads": list(rows.values())})
    if interrupted:
        print(f"interrupted: continue with the same command and --resume --out {out}")
        return 130
    return 0 if all(r["recommended"] for r in rows.values()) else 1
