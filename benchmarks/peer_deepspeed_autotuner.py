"""DeepSpeed's own autotuner (`deepspeed --autotuning tune`) next to `autotune tune`, on the tiny model, on
this machine, in one run.

Both search the same model, the same micro-batch range (1..8) and the same machine:
- DeepSpeed's autotuner (ZeRO stage and micro-batch only, DeepSpeed's defaults otherwise: fast mode,
  metric throughput, profile steps 3..5), launched as its documentation says, on this file as the user
  script (`--worker` mode: the built-in tiny GPT on synthetic tokens, taking `--deepspeed_config`);
- `autotune tune --model tiny --backend deepspeed` over the CPU space, optuna, --trials N.
For each: experiments run, wall time, the best config and its throughput as the tuner reported it, and
that config's throughput measured by the same worker (autotune's deepspeed backend, global batch 16,
median of two fresh trials), so the two recommendations are compared on one ruler. If DeepSpeed's
autotuner fails on this machine, the table says how (its exit code and the log lines that explain it).

    python benchmarks/peer_deepspeed_autotuner.py [--trials 12]

Writes benchmarks/results/peer_deepspeed_autotuner.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
MICRO_BATCHES = (1, 2, 4, 8)


def worker(argv: list[str]) -> None:
    """The user script DeepSpeed's autotuner launches: train the tiny GPT with the config it is given."""
    import deepspeed
    import torch

    from autotune.worker.model import GPT, synthetic_batch
    from autotune.values.workload import preset

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=10)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    shape = preset("tiny")
    model = GPT(shape)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    generator = torch.Generator().manual_seed(0)
    for _ in range(args.steps):  # with autotuning on, the engine itself exits after end_profile_step
        for _ in range(engine.gradient_accumulation_steps()):
            tokens, targets = synthetic_batch(shape, engine.train_micro_batch_size_per_gpu(), generator)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()


def user_config(work: Path) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": "all"},
        "autotuning": {
            "enabled": True,
            "fast": True,
            "metric": "throughput",
            "results_dir": str(work / "autotuning_results"),
            "exps_dir": str(work / "autotuning_exps"),
            "min_train_micro_batch_size_per_gpu": min(MICRO_BATCHES),
            "max_train_micro_batch_size_per_gpu": max(MICRO_BATCHES),
            "num_tuning_micro_batch_sizes": len(MICRO_BATCHES),
        },
    }


def run_deepspeed_autotuner(work: Path, env: dict) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    config = work / "ds_config.json"
    config.write_text(json.dumps(user_config(work), indent=2))
    launcher = Path(sys.executable).with_name("deepspeed")
    cmd = [str(launcher), "--autotuning", "tune", "--num_gpus", "1", str(Path(__file__).resolve()), "--worker",
           "--deepspeed", "--deepspeed_config", str(config)]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=3600 * 3)
    (work / "autotuner.log").write_text(done.stdout + done.stderr)
    peer = collect(work, " ".join(cmd), done.returncode, time.monotonic() - start)
    (work / "peer.json").write_text(json.dumps(peer, indent=2))  # --reuse-deepspeed reads it back
    return peer


def collect(work: Path, command: str, exit_code: int, wall_time_s: float) -> dict:
    """What DeepSpeed's autotuner left in its work directory."""
    exps_dir, results_dir = work / "autotuning_exps", work / "autotuning_results"
    exps = sorted(p for p in exps_dir.glob("*.json") if p.stem != "profile_model_info") if exps_dir.is_dir() else []
    finished = list(results_dir.glob("*/metrics.json")) if results_dir.is_dir() else []
    optimal = results_dir / "ds_config_optimal.json"
    summary_file = results_dir / "summary.txt"
    lines = (work / "autotuner.log").read_text().splitlines()
    explain = [line for line in lines if any(k in line for k in ("Error", "error", "Traceback", "No such file", "not found",
                                                          "Unable", "failed", "exit"))][-8:]
    return {"command": command, "exit_code": exit_code, "wall_time_s": wall_time_s,
            "experiments_started": len(exps), "experiments_with_metrics": len(finished),
            "best_ds_config": json.loads(optimal.read_text()) if optimal.exists() else None,
            "summary": summary_file.read_text() if summary_file.exists() else None,
            "explain": explain, "log": str(work / "autotuner.log")}


def run_autotune(work: Path, trials: int, env: dict) -> dict:
    out = work / "autotune-run"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(Path(sys.executable).with_name("autotune")), "tune", "--model", "tiny", "--backend", "deepspeed",
           "--space", "cpu", "--memory-budget", "4GiB", "--strategy", "optuna", "--trials", str(trials),
           "--out", str(out)]
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=6 * 3600)
    wall = time.monotonic() - start
    (work / "autotune.log").write_text(done.stdout + done.stderr)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    return {"command": " ".join(cmd), "exit_code": done.returncode, "wall_time_s": wall,
            "experiments": (summary or {}).get("status_counts", {}), "summary": summary, "run_dir": str(out)}


def measure(config_dict: dict, repeats: int, logs: Path) -> list[float]:
    """Throughput of one config by autotune's deepspeed backend (global batch 16), fresh trials."""
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.values.config import Config
    from autotune.values.hardware import PROFILES
    from autotune.values.workload import make_workload

    backend = DeepSpeedBackend(make_workload("tiny"), 4 * 2**30, PROFILES["cpu"], logs_dir=logs)
    out = []
    for _ in range(repeats):
        result = backend.run(Config.from_dict(config_dict))
        out.append(result.throughput_samples_per_s or 0.0)
    return out


def deepspeed_best_config(best: dict | None) -> dict | None:
    """DeepSpeed's optimal ds_config as a config of autotune's knobs (its other knobs at their defaults)."""
    if not best:
        return None
    stage = best.get("zero_optimization", {}).get("stage", 0)
    precision = "bf16" if best.get("bf16", {}).get("enabled") else ("fp16" if best.get("fp16", {}).get("enabled") else "fp32")
    return {"zero_stage": int(stage), "micro_batch": int(best["train_micro_batch_size_per_gpu"]), "ckpt_interval": 0,
            "precision": precision, "offload_optimizer": "none", "offload_param": "none"}


def main() -> None:
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        worker(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "peer-deepspeed-autotuner")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "peer_deepspeed_autotuner")
    parser.add_argument("--reuse-deepspeed", action="store_true",
                        help="take DeepSpeed's autotuner's results from an earlier run in --work instead of rerunning it")
    args = parser.parse_args()
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    peer_work = args.work / "deepspeed-autotuner"
    if args.reuse_deepspeed:
        peer = json.loads((peer_work / "peer.json").read_text())  # an earlier run of this script, same machine
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        print("running DeepSpeed's autotuner ...", flush=True)
        peer = run_deepspeed_autotuner(peer_work, env)
    print(f"DeepSpeed's autotuner: exit {peer['exit_code']} after {peer['wall_time_s']:.0f} s, "
          f"{peer['experiments_started']} experiments", flush=True)
    print(f"running autotune tune (--trials {args.trials}) ...", flush=True)
    ours = run_autotune(args.work, args.trials, env)
    print(f"  exit {ours['exit_code']} after {ours['wall_time_s']:.0f} s", flush=True)
    peer_config = deepspeed_best_config(peer["best_ds_config"])
    ours_config = (ours["summary"] or {}).get("best", {}) and ours["summary"]["best"]["config"]
    for name, config, row in (("deepspeed", peer_config, peer), ("autotune", ours_config, ours)):
        row["config"] = config
        row["same_worker_samples_per_s"] = measure(config, args.repeats, args.work / f"remeasure-{name}") if config else []
    result = {"deepspeed_autotuner": peer, "autotune": ours, "trials": args.trials, "repeats": args.repeats,
              "reused_deepspeed_run": args.reuse_deepspeed}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    peer, ours = result["deepspeed_autotuner"], result["autotune"]

    def tp(row):
        values = row["same_worker_samples_per_s"]
        return f"{statistics.median(values):.3g} ({', '.join(f'{v:.3g}' for v in values)})" if values else "-"

    total = re.search(r"Total number of experiments: (\d+)", peer.get("summary") or "")
    peer_exps = (f"{total.group(1)} by its own count; " if total else "") + (
        f"{peer['experiments_started']} launched, {peer['experiments_with_metrics']} with a metric")
    ours_counts = ours["experiments"]
    ours_exps = sum(n for s, n in ours_counts.items() if s != "pruned")
    lines = ["# DeepSpeed's autotuner vs autotune tune (tiny model, this machine)", "",
             "| tuner | exit | experiments run | wall time | best config | its throughput, same worker (samples/s) |",
             "| --- | ---: | --- | ---: | --- | --- |",
             f"| `deepspeed --autotuning tune` | {peer['exit_code']} | {peer_exps} | {peer['wall_time_s']:.0f} s | "
             f"{_label(peer.get('config'))} | {tp(peer)} |",
             f"| `autotune tune` (optuna) | {ours['exit_code']} | {ours_exps} launched, {ours_counts.get('pruned', 0)} pruned "
             f"({', '.join(f'{n} {s}' for s, n in ours_counts.items() if n)}) | {ours['wall_time_s']:.0f} s | "
             f"{_label(ours.get('config'))} | {tp(ours)} |", ""]
    if peer["exit_code"] != 0 or not peer.get("config"):
        lines += ["DeepSpeed's autotuner did not produce a recommendation. Its exit code and the log lines "
                  f"that explain it (full log: `{peer['log']}`):", "", "```"] + peer["explain"] + ["```", ""]
    elif peer["explain"]:
        distinct = list(dict.fromkeys(line for line in peer["explain"] if "Traceback" not in line))
        lines += ["DeepSpeed's autotuner finished, but its log reports errors on this machine (full log: "
                  f"`{peer['log']}`):", "", "```"] + distinct + ["```", ""]
    lines += [f"Commands: `{peer['command']}`; `{ours['command']}`.", ""]
    return "\n".join(lines)


def _label(config: dict | None) -> str:
    if not config:
        return "none"
    from autotune.values.config import Config

    return Config.from_dict(config).label()


if __name__ == "__main__":
    main()
