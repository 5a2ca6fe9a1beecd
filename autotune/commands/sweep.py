"""`autotune sweep sweep.yaml`: tune every workload of a sweep file at once on a Ray cluster, one run
directory each, and write the sweep summary (markdown and CSV)."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from autotune.argtypes import output_dir, positive_int, ray_address


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


def run(args: argparse.Namespace) -> int:
    from autotune.interrupts import sigterm_as_interrupt
    from autotune.sweeps import SUMMARY_CSV, SUMMARY_MD, load_sweep, run_sweep

    sweep_file = load_sweep(args.sweep_file)
    if args.resume and args.out is None:
        from autotune.config import ConfigError

        raise ConfigError("--resume needs --out DIR (the sweep directory to continue)")
    out = args.out or Path("runs") / f"sweep-{args.sweep_file.stem}-{datetime.now():%Y%m%d-%H%M%S}"
    args._run_dir = out  # an internal error's traceback goes to its logs/ (autotune.cli), once it exists
    with sigterm_as_interrupt():
        rows = run_sweep(sweep_file, out, args.ray_address, args.resume, args.concurrency or sweep_file.concurrency)
    print(f"sweep summary: {out / SUMMARY_MD} ({out / SUMMARY_CSV})")
    interrupted = any(r["stopped"] == "interrupted" for r in rows.values())
    if interrupted:
        print(f"interrupted: continue with the same command and --resume --out {out}")
        return 130
    return 0 if all(r["recommended"] for r in rows.values()) else 1
