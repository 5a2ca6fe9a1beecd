"""Ranks started ahead (issue 41: cheaper trials): a sweep's trials with and without the next trial's ranks
importing while the current one runs (autotune.trials.runner.Spares).

Each round runs the same sequence of real trials (default: six fp32 configs of tiny, ZeRO 0-2, one rank) twice,
on a fresh backend each: `cold`, every rank started with its trial (ranks_ahead=False), and `ahead`, the product's
default for a local sweep's backend (in_sequence: from its second trial on, its ranks were started during the
trial before). The order of the two alternates from round to round, so that load drift hits both alike. Per arm,
over every round: the median wall seconds of a trial and of launch to its first measured step, over the trials
from the second on (where `ahead` runs on ranks started ahead); the median sequence's seconds in all; and the
median step time, paired config by config, to show that the measurement is no different. `--script PATH`: the
same with script mode's trials of that script (its arguments in --script-args), after an untimed first trial that
shows the frameworks it imports (which a sweep's spares import too, as after a script sweep's first trial).

    python benchmarks/ranks_ahead.py [--rounds 3] [--trials 6] [--gpus 1] [--hardware auto] [--model tiny]
        [--script examples/train_plain.py --script-args '--deepspeed_config examples/ds_config.json --steps 30']

Writes ranks_ahead.md and ranks_ahead.json (with --script: ranks_ahead_<script's name>.*) to --out (default
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.backends.script import Script, ScriptBackend
from autotune.trials.devices import AUTO, cpu_model, resolve_hardware
from autotune.values.config import Config
from autotune.values.dsconfig import DsOptions
from autotune.values.hardware import PROFILES, Hardware
from autotune.values.results import TrialResult
from autotune.values.workload import Workload, make_workload

HERE = Path(__file__).parent
RESULTS = HERE / "results"
ARMS = ("cold", "ahead")
FIRST_AHEAD = 1  # index of a sweep backend's first trial that can run on ranks started ahead (its second)


def configs(count: int, ranks: int, global_batch: int, checkpointing: bool = True) -> list[Config]:
    """ZeRO 0-2, then again with checkpointing (or, for a script whose model may have no switch for it, with half
    the micro-batch)."""
    stages = (0, 1, 2)
    micro = max(1, global_batch // ranks // 2)
    again = (micro, 1) if checkpointing else (max(1, micro // 2), 0)
    return [Config(stages[i % 3], *((micro, 0) if i // 3 % 2 == 0 else again), "fp32") for i in range(count)]


def sequence(arm: str, todo: list[Config], workload: Workload, hardware: Hardware, logs: Path,
             script: Script | None, frameworks: tuple[str, ...]) -> tuple[list[TrialResult], float]:
    options = {"ranks_ahead": arm == "ahead", "in_sequence": True}
    backend = (DeepSpeedBackend(workload, None, hardware, DsOptions(force_ds_cpu_optimizer=False), logs,
                                timeout_s=900, **options) if script is None else
               ScriptBackend(script, workload, None, hardware, logs_dir=logs, timeout_s=900, frameworks=frameworks,
                             **options))
    t0 = time.time()
    try:
        results = [backend.run(config) for config in todo]
    finally:
        backend.close()
    return results, time.time() - t0


def run(rounds: int, todo: list[Config], workload: Workload, hardware: Hardware, logs: Path,
        console: Console, script: Script | None) -> list[dict]:
    frameworks = () if script is None else learned_frameworks(script, todo[0], workload, hardware, logs / "first")
    out = []
    for round_ in range(rounds):
        for arm in (ARMS if round_ % 2 == 0 else ARMS[::-1]):
            results, spent = sequence(arm, todo, workload, hardware, logs / f"{round_}-{arm}", script, frameworks)
            bad = [r for r in results if r.status != "ok"]
            if bad:
                raise SystemExit(f"round {round_ + 1} {arm}: {bad[0].config.label()} {bad[0].status}: {bad[0].error}")
            out.append({"round": round_ + 1, "arm": arm, "seconds": spent, "results": [r.to_dict() for r in results]})
            walls = [r.wall_time_s or 0.0 for r in results]
            console.print(f"round {round_ + 1} {arm:5}: {spent:5.1f} s in all, trials "
                          + " ".join(f"{w:.1f}" for w in walls), highlight=False)
    return out


def learned_frameworks(script: Script, config: Config, workload: Workload, hardware: Hardware,
                       logs: Path) -> tuple[str, ...]:
    """A script sweep's first trial, untimed: the frameworks the script imports (autotune.script.shim.FRAMEWORKS)."""
    result = ScriptBackend(script, workload, None, hardware, logs_dir=logs, timeout_s=900, ranks_ahead=False).run(config)
    if result.status != "ok":
        raise SystemExit(f"the script's first trial: {result.status}: {result.error}")
    return tuple((result.extra.get("script_model") or {}).get("frameworks") or ())


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def summary(runs: list[dict]) -> dict:
    rows = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        later = [t for r in mine for t in r["results"][FIRST_AHEAD:]]
        rows[arm] = {
            "sequences": len(mine), "later_trials": len(later),
            "started_ahead": sum(t.get("import_ahead_s") is not None for t in later),
            "wall_s": median([t["wall_time_s"] for t in later]),
            "first_step_s": median([t["launch_to_first_step_s"] for t in later]),
            "import_s": median([t["phases_s"]["import_s"] for t in later]),
            "initialize_s": median([t["phases_s"]["initialize_s"] for t in later]),
            "import_ahead_s": median([t["import_ahead_s"] for t in later
                                      if t.get("import_ahead_s") is not None]),
            "sequence_s": median([r["seconds"] for r in mine]),
        }
    # Paired by round and position (the same config): each arm's step time, wall and sequence over cold's.
    pairs = [(c, a) for c in runs if c["arm"] == "cold" for a in runs if a["arm"] == "ahead" and a["round"] == c["round"]]
    step = [ta["step_time_s"] / tc["step_time_s"] for c, a in pairs for tc, ta in zip(c["results"], a["results"])]
    wall = [ta["wall_time_s"] / tc["wall_time_s"] for c, a in pairs
            for tc, ta in zip(c["results"][FIRST_AHEAD:], a["results"][FIRST_AHEAD:])]
    rows["paired"] = {"step_time_ratio": median(step), "step_time_ratio_range": [min(step), max(step)],
                      "wall_ratio_later": median(wall),
                      "sequence_ratio": median([a["seconds"] / c["seconds"] for c, a in pairs])}
    return rows


def markdown(rows: dict, command: str, workload: Workload, hardware: Hardware, todo: list[Config],
             script: Script | None) -> str:
    p = rows["paired"]
    what = "built-in model" if script is None else f"script mode: {script.path} {' '.join(script.args)}"
    lines = [
        f"# Ranks started ahead: a sweep's trials with and without (issue 41; {what})", "",
        f"`{command}` ({machine()}; load average at the end {os.getloadavg()[0]:.1f}). {workload.model.name}, "
        f"{workload.gpus} rank(s), global batch {workload.global_batch}, on {hardware.name}; each round the same "
        f"{len(todo)} trials ({', '.join(c.label() for c in todo)}) on a fresh backend per arm, the arms' order "
        "alternating. `cold`: every rank started with its trial; `ahead` (a local sweep's default): from the second "
        "trial on, on ranks started during the trial before. Medians over the trials from the second on, all "
        "rounds.", "",
        "| arm | sequences | trials (from 2nd) | on ranks ahead | wall s / trial | launch to 1st step s | import s | "
        "initialize s | imports made ahead s | sequence s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm in ARMS:
        r = rows[arm]
        lines.append(f"| {arm} | {r['sequences']} | {r['later_trials']} | {r['started_ahead']} | {r['wall_s']:.2f} | "
                     f"{r['first_step_s']:.2f} | {r['import_s']:.2f} | {r['initialize_s']:.2f} | "
                     f"{fmt(r['import_ahead_s'])} | {r['sequence_s']:.1f} |")
    lines += ["", f"Paired (same round, same config), ahead / cold: wall per trial from the second "
              f"{p['wall_ratio_later']:.2f}x, whole sequence {p['sequence_ratio']:.2f}x; measured step time "
              f"{p['step_time_ratio']:.2f}x (range {p['step_time_ratio_range'][0]:.2f}-{p['step_time_ratio_range'][1]:.2f}): "
              "the measurement is the same where the ratio is 1 within the machine's trial-to-trial spread.", ""]
    return "\n".join(lines) + "\n"


def fmt(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


def machine() -> str:
    return f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=6, help="trials per sequence (default: 6)")
    parser.add_argument("--gpus", type=int, default=1, help="ranks (default: 1)")
    parser.add_argument("--hardware", choices=[AUTO, *PROFILES], default=AUTO,
                        help="the trials' profile (default: auto, this machine's accelerator)")
    parser.add_argument("--model", default="tiny", help="a preset or Hugging Face config (default: tiny)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--script", type=Path, help="script mode's trials of this script (default: the built-in model)")
    parser.add_argument("--script-args", default="", help="the script's own arguments, one string")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the .md and .json go (default: %(default)s)")
    args = parser.parse_args()
    if args.rounds < 1 or args.trials <= FIRST_AHEAD:
        parser.error(f"--rounds {args.rounds}, --trials {args.trials}: at least 1 round and {FIRST_AHEAD + 1} trials")
    hardware, _ = resolve_hardware(args.hardware if args.hardware == AUTO else PROFILES[args.hardware], real=True)
    workload = make_workload(args.model, global_batch=args.global_batch, gpus=args.gpus)
    todo = configs(args.trials, args.gpus, args.global_batch, checkpointing=args.script is None)
    console = Console()
    script = None if args.script is None else Script(str(args.script), tuple(shlex.split(args.script_args)))
    runs = run(args.rounds, todo, workload, hardware, Path(tempfile.mkdtemp(prefix="ranks_ahead-")), console, script)
    rows = summary(runs)
    command = shlex.join(["python", "benchmarks/ranks_ahead.py", *sys.argv[1:]])
    text = markdown(rows, command, workload, hardware, todo, script)
    console.print(text, highlight=False)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "ranks_ahead" if script is None else f"ranks_ahead_{Path(script.path).stem}"
    (args.out / f"{name}.json").write_text(json.dumps({"command": command, "summary": rows, "runs": runs},
                                                      indent=1) + "\n")
    (args.out / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
