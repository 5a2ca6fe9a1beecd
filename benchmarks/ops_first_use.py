"""What building DeepSpeed's ops at their first use saves a real sweep (issue 41), on this machine's accelerator.

The same `autotune tune` (deepspeed backend, real trials) runs twice, each on a fresh TORCH_EXTENSIONS_DIR so that
every op it loads is built:
- `space up front`: as sweeps did before: first the preflight of every config of the space (DeepSpeedBackend.preflight
  over the space, which is what `autotune tune` ran before its first trial), then the sweep;
- `first use`: the sweep alone, which builds each op just before the first trial that loads it
  (DeepSpeedBackend.prepare).
Per run: the ops built (the libraries under the fresh folder), the seconds of the up-front preflight, the sweep's
wall seconds (its own builds included), its trials and how many offloaded the optimizer.

    python benchmarks/ops_first_use.py [--model tiny] [--hardware cpu] [--trials 3] [--out DIR]

Writes ops_first_use.md and ops_first_use.json to --out (default benchmarks/results/). Minutes on a CPU: fused_adam's
first build takes ~130 s and cpu_adam's ~200 s on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import autotune
from autotune.api import resolve
from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.values.results import read_results
from search_efficiency import machine, source_state  # beside this script

ROOT = Path(__file__).resolve().parent
MODES = ("space up front", "first use")


def built_ops(folder: Path) -> list[str]:
    """The ops whose library a build left under `folder`."""
    return sorted(p.parent.name for p in folder.glob("*/*.so"))


def run_mode(mode: str, args: argparse.Namespace, work: Path, console: Console) -> dict:
    ext = work / f"ext-{mode.replace(' ', '-')}"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    preflight_s = 0.0
    if mode == "space up front":
        spec = autotune.TuneSpec(autotune.make_workload(args.model), autotune.load_hardware(args.hardware))
        settings, space = resolve(spec)
        backend = DeepSpeedBackend(settings.workload, settings.memory_budget_bytes, settings.hardware,
                                   logs_dir=work / "preflight-logs", env={"TORCH_EXTENSIONS_DIR": str(ext)})
        start = time.monotonic()
        backend.preflight(list(space), lambda line: console.print(f"  {mode}: {line}", highlight=False))
        preflight_s = time.monotonic() - start
    out = work / f"run-{mode.replace(' ', '-')}"
    argv = [sys.executable, "-m", "autotune.cli", "tune", "--model", args.model, "--hardware", args.hardware,
            "--backend", "deepspeed", "--trials", str(args.trials), "--confirm", "0", "--out", str(out)]
    start = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=ROOT.parent, capture_output=True, text=True)
    sweep_s = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{mode}: autotune tune exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    results = [r for r in read_results(out / "trials.jsonl") if r.status != "pruned"]
    row = {"mode": mode, "ops_built": built_ops(ext), "preflight_s": round(preflight_s, 1),
           "sweep_s": round(sweep_s, 1), "total_s": round(preflight_s + sweep_s, 1),
           "trials": len(results), "offloaded": sum(r.config.offload_optimizer != "none" for r in results),
           "trial_s": round(sum(r.wall_time_s for r in results), 1)}
    console.print(f"{mode}: {row}", highlight=False)
    return row


def markdown(rows: list[dict], command: str, where: str, minutes: float) -> str:
    lines = ["# DeepSpeed's ops built at their first use (issue 41)", "",
             f"`{command}` ({minutes:.1f} min, {where}).", "",
             "The same real sweep twice, each on a fresh TORCH_EXTENSIONS_DIR: `space up front` first runs the preflight "
             "of every config of the space (what `autotune tune` did before its first trial), `first use` builds each "
             "op just before the first trial that loads it. Seconds: wall time; the sweep's own include its builds.",
             "", "| mode | ops built | up-front preflight s | sweep s | in all s | trials | offloaded | trial-s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {', '.join(r['ops_built']) or 'none'} | {r['preflight_s']:.0f} | "
                     f"{r['sweep_s']:.0f} | {r['total_s']:.0f} | {r['trials']} | {r['offloaded']} | {r['trial_s']:.0f} |")
    before, now = rows
    lines += ["", f"In all: {now['total_s']:.0f} s against {before['total_s']:.0f} s "
                  f"({now['total_s'] / before['total_s']:.2f}x)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--hardware", default="cpu")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    console = Console()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ops-first-use-") as tmp:
        rows = [run_mode(mode, args, Path(tmp), console) for mode in MODES]
    minutes = (time.monotonic() - started) / 60
    command = "python benchmarks/ops_first_use.py " + " ".join(argv if argv is not None else sys.argv[1:])
    where = f"{machine()}; {source_state()}"
    table = Table(*("mode", "ops built", "preflight s", "sweep s", "in all s", "trials", "offloaded"))
    for r in rows:
        table.add_row(r["mode"], ", ".join(r["ops_built"]), f"{r['preflight_s']:.0f}", f"{r['sweep_s']:.0f}",
                      f"{r['total_s']:.0f}", str(r["trials"]), str(r["offloaded"]))
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ops_first_use.md").write_text(markdown(rows, command.strip(), where, minutes))
    (args.out / "ops_first_use.json").write_text(json.dumps({"rows": rows, "where": where}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
