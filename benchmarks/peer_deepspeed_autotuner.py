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

`DeepSpeedSchedule` is the order DeepSpeed's autotuner runs its experiments in, as a strategy (propose/observe) that
the search benchmarks run through the tuner's loop beside ours (benchmarks/search_efficiency.py, rl_evaluation.py,
search_seconds.py; issue 41's `deepspeed` schedule). Its docstring says what is emulated and how.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Generator

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
MICRO_BATCHES = (1, 2, 4, 8)
# deepspeed/autotuning/constants.py (0.19.8): a gain under this share is a plateau (METRIC_PERCENT_DIFF_CONST), and
# the micro-batches tuned after the search for the largest (AUTOTUNING_NUM_TUNING_MICRO_BATCH_SIZES_DEFAULT).
PLATEAU = 0.05
NUM_TUNING_MICRO_BATCH_SIZES = 3

Walk = Generator[Any, None, Any]  # yields configs to run; results arrive in DeepSpeedSchedule.known


class DeepSpeedSchedule:
    """DeepSpeed's autotuner's order in its fast mode (`deepspeed --autotuning tune` with `"fast": true`, its default;
    deepspeed/autotuning/autotuner.py of DeepSpeed 0.19.8: `tune`, `tune_space`, `get_min_max_micro_batch_size`,
    `get_tuning_micro_batch_size_list`, `run_tuning_micro_batch_sizes`), as a strategy over a space's configs:

    1. the model-info profile run: ZeRO-3 at the smallest micro-batch (DEFAULT_MIN_MEM_CONFIG: the space's
       smallest at ZeRO-3; none where the space holds no ZeRO-3 config); tuning ends where it did not run (out of
       memory, a crash, or pruned: it needs the model's figures, not a trained step);
    2. ZeRO stages 0, 1, 2, 3 in turn; a stage whose model states plus one micro-batch's activations are predicted
       not to fit is skipped, and so is one whose largest micro-batch predicted to fit is smaller than the largest
       the tuning so far settled on (DeepSpeed's own estimate from the profile run: here the estimator's,
       `SearchContext.predict`);
    3. within a stage, its micro-batch search: the smallest micro-batch on the first stage tuned (the user's, 1),
       the previous stage's largest on the later ones (the stage ends where it fails); then the largest predicted
       to fit, 1.05x and 0.95x of it (where the space holds them), the first that runs is the stage's largest;
       where none runs, a binary search between the two that stops at a failure's bound or where throughput gains
       under 5% (a plateau);
    4. the stage's list to tune: micro-batches from half the largest up to it at a stride of a third of the range,
       those whose gradient accumulation differs from the largest's, and the largest (on a space of doubling
       micro-batches: half the largest, and the largest); then smaller ones with the largest's accumulation,
       downwards while each gains 5% (none on such a space);
    5. fast mode ends the stage there (no other ZeRO knob tuned); the next stage starts from this one's largest
       micro-batch when its best micro-batch is bigger than the best so far.

    Only the stage and the micro-batch are searched: every other knob stays at the space's default (its first
    value; the valid config nearest the defaults where that one is not valid), no offload, precision or
    checkpointing. A config already run is not run again (DeepSpeed skips an experiment whose results exist).
    Micro-batches are the space's: DeepSpeed's integers that the space does not hold are not tried. A run counts as
    failed (metric 0) when it did not fit, failed or was pruned by the tuner's loop it runs in. The recommendation
    is the best measured config, as DeepSpeed's `ds_config_optimal.json`."""

    name = "deepspeed"

    def __init__(self, context: Any) -> None:
        self.context = context
        self.known: dict[Any, Any] = {}
        self.order: list[Any] = []  # the configs proposed, in order
        self._plan = self._walk()
        self._waiting: Any = None

    def propose(self) -> Any:
        if self._waiting is not None and self._waiting not in self.known:
            return self._waiting  # asked again before the last proposal's result came back
        try:
            self._waiting = next(self._plan)
            self.order.append(self._waiting)
        except StopIteration:
            self._waiting = None
        return self._waiting

    def observe(self, config: Any, result: Any) -> None:
        self.known[config] = result

    def config(self, stage: int, micro_batch: int) -> Any:
        """The valid config of this stage and micro-batch nearest the space's defaults (None: there is none)."""
        from autotune.values.config import KNOBS

        space = self.context.space
        defaults = space.choices.default()
        candidates = [c for c in space if c.zero_stage == stage and c.micro_batch == micro_batch]
        return min(candidates, key=lambda c: sum(getattr(c, k) != defaults[k] for k in KNOBS), default=None)

    def predicted_fit(self, config: Any) -> bool:
        from autotune.prediction.estimate import estimate

        space = self.context.space
        predict = self.context.predict or (lambda c: estimate(c, space.workload, space.hardware))
        return bool(predict(config).fits(self.context.budget_bytes))

    def _metric(self, config: Any, records: dict[int, float] | None = None) -> Walk:
        """Runs `config` (unless known) and returns its throughput within the budget, 0 where it did not fit or
        run; kept in the stage's `records` by micro-batch."""
        if config not in self.known:
            yield config
        result = self.known[config]
        metric = float(result.throughput_samples_per_s or 0.0) if result.fits(self.context.budget_bytes) else 0.0
        if records is not None:
            records.setdefault(config.micro_batch, metric)
        return metric

    def _walk(self) -> Walk:
        space = self.context.space
        stages = sorted(space.choices.zero_stage)
        profile = next((c for mb in sorted(space.choices.micro_batch) if (c := self.config(3, mb)) is not None), None)
        if profile is not None:
            if profile not in self.known:
                yield profile
            if self.known[profile].status not in ("ok", "untrained"):
                return  # the model-info profile run failed: DeepSpeed tunes nothing
        best_mbs, max_mbs = 0, 0
        for stage in stages:
            ladder = [mb for mb in sorted(space.choices.micro_batch) if self.config(stage, mb) is not None]
            fitting = [mb for mb in ladder if self.predicted_fit(self.config(stage, mb))]
            if not fitting or max(fitting) < max_mbs:
                continue  # not runnable at this stage, or no bigger micro-batch than the stages before
            records: dict[int, float] = {}
            bounds = yield from self._min_max(stage, ladder, max_mbs, max(fitting), records)
            if bounds is None or bounds[1] < max_mbs:
                continue
            low, high = bounds
            tuned = tuning_list(ladder, low, high)
            for mb in tuned:
                yield from self._metric(self.config(stage, mb), records)
            yield from self._smaller_same_accumulation(stage, ladder, tuned, low, high, records)
            stage_best = max(records, key=lambda mb: records[mb])  # the first of equals, as DeepSpeed's records
            if stage_best > best_mbs:
                best_mbs, max_mbs = stage_best, high

    def _min_max(self, stage: int, ladder: list[int], previous_max: int, calculated_max: int,
                 records: dict[int, float]) -> Walk:
        """get_min_max_micro_batch_size: (smallest, largest) micro-batch that runs at this stage, or None."""
        start = ladder[0] if previous_max < 1 else next((mb for mb in ladder if mb >= previous_max), None)
        if start is None or not (yield from self._metric(self.config(stage, start), records)):
            return None
        used = [start]
        for mb in (math.ceil(1.05 * calculated_max), calculated_max, int(0.95 * calculated_max)):
            if mb not in ladder:
                continue
            if mb in used:
                return start, mb
            if (yield from self._metric(self.config(stage, mb), records)):
                return start, mb
        previous = records[start]
        low, high = ladder.index(start), ladder.index(calculated_max) if calculated_max in ladder else len(ladder) - 1
        while low <= high:  # binary search until low is the smallest that fails
            mid = (low + high) // 2
            mb = ladder[mid]
            if mb in used:
                low = mid + 1
                continue
            metric = yield from self._metric(self.config(stage, mb), records)
            if metric:
                low = mid + 1
                used.append(mb)
                if previous and (metric - previous) / previous < PLATEAU:
                    break  # performance plateaus
                previous = metric
            else:
                high = mid - 1
        return start, ladder[max(low - 1, 0)]

    def _smaller_same_accumulation(self, stage: int, ladder: list[int], tuned: list[int], low: int, high: int,
                                   records: dict[int, float]) -> Walk:
        """run_tuning_micro_batch_sizes' second part: below the largest, with its gradient accumulation, downwards
        while each gains PLATEAU over the best so far."""
        start = tuned[-2] + 1 if len(tuned) > 1 else low
        stride = max((high - start) // 3, 1)
        best = records.get(high, 0.0)
        for mb in reversed(range(start, high, stride)):
            if mb not in ladder:
                continue
            metric = yield from self._metric(self.config(stage, mb), records)
            if not (metric and metric > best * (1 + PLATEAU)):
                break
            best = metric


def tuning_list(ladder: list[int], low: int, high: int) -> list[int]:
    """get_tuning_micro_batch_size_list (one gradient-accumulation step asked, as the peer run's config): from half
    the largest (or the smallest, if larger) up to the largest at a stride of a third of that range, those whose
    accumulation differs from the largest's, and the largest, kept where the space holds them; ascending."""
    start = max(low, high // 2)
    stride = max((high - start) // NUM_TUNING_MICRO_BATCH_SIZES, 1)
    values = [mb for mb in range(start, high, stride) if high // mb != 1] + [high]
    return sorted(mb for mb in dict.fromkeys(values) if mb in ladder)


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
