"""`autotune rl`: train the RL policy (RLlib PPO on the simulated environment) and export it.

    autotune rl train [--iterations N] [--backend simulated|replay] [--surface FILE ...] [--memory-budget SIZE[,SIZE...]]
                      [--workers K] [--out runs/policy-NAME] [--ray-address ADDR] [--seed N] ...
    autotune rl export RUN | RUN/checkpoints/NNNNNN | RUN/checkpoints/latest --out DIR

`train` resumes the run in --out when there is one (from its last checkpoint), and prints one line per
iteration (under --quiet only its result, the `done:` line, and errors); --out is a new or empty folder or one of
its runs, anything else (a sweep's, an exported policy's) is refused. `export` writes the checkpoint given, or the
latest of a run (RUN, RUN/checkpoints/latest), and says which. The exported policy (DIR/policy.pt + policy.json)
is what `autotune tune --strategy rl --policy DIR` (or `--strategy hybrid --policy DIR`) loads, without Ray.
"""

from __future__ import annotations

import argparse
import functools
import logging
from datetime import datetime
from pathlib import Path

from rich.console import Console

from autotune.values.argtypes import (input_file, int_range, non_negative_float, output_dir, positive_int, ray_address,
                                      seed, shown_path, size)
from autotune.commands.common import add_json_argument, emit_json, json_command
from autotune.values.config import ConfigError
from autotune.values.units import counted, shown


MAX_WIDTH, MAX_LAYERS = 65536, 16  # a policy network past these is a typo (and would not fit in memory)
MAX_RUNNERS = 4096  # Ray actors (or environment copies) of one training run: more is a typo that Ray would queue


def widths(text: str) -> tuple[int, ...]:
    allowed = f"comma-separated integers from 1 to {MAX_WIDTH}, at most {MAX_LAYERS} of them, e.g. 128,128"
    parts = text.split(",")
    if len(parts) > MAX_LAYERS or any(len(part.strip()) > 6 for part in parts):
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected {allowed}")
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected {allowed}") from None
    if not values or min(values) <= 0 or max(values) > MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected {allowed}")
    return values


MAX_KEPT = 1_000_000  # --keep-checkpoints past this is a typo ("all" or 0 keeps every one)


def kept_checkpoints(text: str) -> int:
    """--keep-checkpoints: how many of the newest checkpoints a run keeps; 0 or `all`: every one (0)."""
    if text.strip().lower() == "all":
        return 0
    allowed = f"expected a count of checkpoints from 1 to {MAX_KEPT}, or 0 or all to keep every one"
    if len(text) > 12:
        raise argparse.ArgumentTypeError(f"{shown(text)}: {allowed}")
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)}: {allowed}") from None
    if not 0 <= value <= MAX_KEPT:
        raise argparse.ArgumentTypeError(f"{shown(text)}: {allowed}")
    return value


def checkpoint_path(text: str) -> Path:
    """`rl export`'s CHECKPOINT: any path (what it names is resolved by autotune.rl.train.resolve_checkpoint)."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{shown_path(text)}: no such checkpoint")
    return Path(text)


MAX_BUDGETS = 64  # --memory-budget sizes of replay training: more is a typo


def sizes(text: str) -> tuple[int, ...]:
    """--memory-budget of `rl train`: one size, or several separated by commas (each as argtypes.size reads it)."""
    parts = text.split(",")
    if len(parts) > MAX_BUDGETS:
        raise argparse.ArgumentTypeError(f"{shown(text)}: at most {MAX_BUDGETS} sizes")
    return tuple(sorted({size(part.strip()) for part in parts}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from autotune.rl.train import BACKENDS, TrainSettings

    defaults = TrainSettings()
    sub = parser.add_subparsers(dest="rl_command", required=True, parser_class=type(parser),
                                metavar="{train,export}")  # what a missing one's error names
    train = sub.add_parser("train", help="train a policy with RLlib PPO (resumes the run in --out)",
                           description="Train a policy with RLlib PPO on autotune/DeepSpeedMemory-v0; resumes the run "
                                       "in --out from its last checkpoint.")
    train.add_argument("--iterations", type=positive_int, default=defaults.iterations,
                       help="training iterations in all, over resumed sessions (default: %(default)s)")
    train.add_argument("--backend", choices=BACKENDS, default=defaults.backend,
                       help="simulated: the workload sampler on the distorted simulation; replay: surfaces "
                            "(default: %(default)s)")
    train.add_argument("--surface", type=input_file, action="append", default=[],
                       help="replay surface JSONL (repeat for several), for --backend replay")
    train.add_argument("--memory-budget", type=sizes, default=None,
                       help="--backend replay: memory budget per device, or several separated by commas, one drawn "
                            "per episode, e.g. 600MiB,700MiB (default: the surfaces' measured peaks at their "
                            "quartiles and their largest, so that episodes run out of memory)")
    train.add_argument("--workers", type=int_range(0, MAX_RUNNERS, " runners"), default=defaults.workers,
                       help="remote env runners, at most 4096; 0 samples in this process (default: %(default)s)")
    train.add_argument("--out", type=output_dir, default=None, help="run directory (default: runs/policy-<time>)")
    train.add_argument("--ray-address", type=ray_address, default=None,
                       help="address of a running Ray cluster (default: start a local Ray instance)")
    train.add_argument("--seed", type=seed, default=defaults.seed, help="seed, 0 to 2**32-1 (default: %(default)s)")
    train.add_argument("--horizon", type=positive_int, default=defaults.horizon,
                       help="trials per episode at most (default: %(default)s)")
    train.add_argument("--noise", type=non_negative_float, default=defaults.noise,
                       help="simulated step-time noise sigma (default: %(default)s)")
    train.add_argument("--randomize", type=non_negative_float, default=defaults.randomize,
                       help="spread of the hidden truth around the estimator; 0: the estimator is the truth "
                            "(default: %(default)s)")
    train.add_argument("--trial-cost", type=non_negative_float, default=defaults.trial_cost,
                       help="reward paid per trial, as a share of the optimum's throughput (default: %(default)s)")
    train.add_argument("--second-cost", type=non_negative_float, default=defaults.second_cost,
                       help="reward paid per trial-second, in trials of the config predicted best: a trial twice as "
                            "long costs twice as much (default: %(default)s, every trial alike)")
    train.add_argument("--observe-seconds", action="store_true",
                       help="observe each action's predicted trial seconds (a policy trained so needs them; "
                            "pair with --second-cost)")
    train.add_argument("--oom-penalty", type=non_negative_float, default=defaults.oom_penalty,
                       help="reward lost per out-of-memory trial, plus as much times the overshoot "
                            "(default: %(default)s)")
    train.add_argument("--train-batch", type=positive_int, default=defaults.train_batch,
                       help="environment steps per iteration (default: %(default)s)")
    train.add_argument("--minibatch", type=positive_int, default=defaults.minibatch,
                       help="SGD minibatch (default: %(default)s)")
    train.add_argument("--epochs", type=positive_int, default=defaults.epochs,
                       help="SGD passes over each iteration's batch (default: %(default)s)")
    train.add_argument("--pool-size", type=positive_int, default=defaults.pool_size,
                       help="training tasks drawn once by the GPU sampler (the CPU one draws a quarter as many) "
                            "(default: %(default)s)")
    train.add_argument("--hiddens", type=widths, default=defaults.hiddens,
                       help="hidden layer widths of the policy and value networks, comma-separated "
                            f"(default: {','.join(map(str, defaults.hiddens))})")
    train.add_argument("--envs-per-worker", type=int_range(1, MAX_RUNNERS, " copies"), default=defaults.envs_per_worker,
                       help="environment copies per runner, at most 4096 (default: %(default)s)")
    train.add_argument("--checkpoint-every", type=positive_int, default=defaults.checkpoint_every,
                       help="iterations between checkpoints (default: %(default)s)")
    train.add_argument("--keep-checkpoints", type=kept_checkpoints, default=defaults.keep_checkpoints,
                       metavar="N", help="the newest checkpoints a run keeps, older ones removed as training goes on; "
                                         "0 or all: every one (default: %(default)s)")
    add_json_argument(train)
    train.set_defaults(_rl=run_train, _prog=train.prog)  # errors name "autotune rl train"

    export = sub.add_parser("export", help="write a checkpoint's policy as policy.pt + policy.json (no Ray needed to load)",
                            description="Write the policy of an RLlib checkpoint of `autotune rl train` as policy.pt + "
                                        "policy.json into --out DIR, which `autotune tune --strategy rl --policy DIR` "
                                        "(or --strategy hybrid) loads without Ray.")
    export.add_argument("checkpoint", type=checkpoint_path,
                        help="a training run's folder RUN (its latest checkpoint), RUN/checkpoints/latest, or a "
                             "checkpoint RUN/checkpoints/NNNNNN")
    export.add_argument("--out", type=output_dir, required=True,
                        help="directory to write the policy to (DIR of `autotune tune --policy DIR`)")
    add_json_argument(export)
    export.set_defaults(_rl=run_export, _prog=export.prog)


@json_command
def run(args: argparse.Namespace) -> int:
    return args._rl(args)


def run_train(args: argparse.Namespace) -> int:
    from autotune.rl.train import (RunDir, Start, TrainSettings, check_replay_budgets, check_run_folder,
                                   replay_budgets, shown_budgets, train)
    from autotune.trials.interrupts import deferred_signals

    if args.backend == "replay" and not args.surface:
        raise ConfigError("--backend replay needs --surface FILE (one or more)")
    if args.backend != "replay" and args.surface:
        raise ConfigError(f"--surface is only for --backend replay (got --backend {args.backend})")
    if args.backend != "replay" and args.memory_budget:
        raise ConfigError(f"--memory-budget is only for --backend replay (got --backend {args.backend}: its tasks "
                          f"come with their budgets)")
    from autotune.backends.replay import load_surface

    # read here, before Ray starts, so that a bad surface is one line at once
    surfaces = [load_surface(path) for path in args.surface]
    budgets = args.memory_budget or (replay_budgets(surfaces) if args.backend == "replay" else ())
    # budgets nothing fits: refused where every episode would run out of memory, else said before training
    budget_warning = check_replay_budgets(surfaces, budgets)
    settings = TrainSettings(
        iterations=args.iterations, backend=args.backend, surfaces=tuple(str(p.resolve()) for p in args.surface),
        memory_budget_bytes=tuple(budgets),
        seed=args.seed, workers=args.workers, envs_per_worker=args.envs_per_worker, horizon=args.horizon,
        noise=args.noise, randomize=args.randomize, trial_cost=args.trial_cost, second_cost=args.second_cost,
        observe_seconds=args.observe_seconds, oom_penalty=args.oom_penalty,
        train_batch=args.train_batch, minibatch=args.minibatch,
        epochs=args.epochs, pool_size=args.pool_size, hiddens=args.hiddens, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints)
    out = args.out or Path("runs") / f"policy-{datetime.now():%Y%m%d-%H%M%S}"
    check_run_folder(out)  # a sweep's, an exported policy's or any other folder: refused before anything is said
    args._run_dir = out  # an internal error's traceback goes to its logs/ (autotune.cli), once it exists
    console = Console(soft_wrap=True)  # one line per iteration, wrapped by the terminal (COLUMNS where set)
    # --quiet: the result (`done:`) and errors only; the banner and the iterations are progress
    say = (lambda *_, **__: None) if getattr(args, "quiet", False) else console.print
    backend = settings.backend + (" backend" if settings.backend != "replay" else
                                  f" backend at {shown_budgets(budgets)}" if budgets else " backend at device memory")

    def begin(start: Start) -> None:  # said once the run folder is held and its settings checked, before Ray starts
        if start.nothing_to_train:
            say(f"{out} is already trained to {counted(start.done, 'iteration')} (--iterations {start.target} asks for no "
                f"more): nothing to train", highlight=False)
            return
        if budget_warning:  # said even under --quiet, as errors are
            console.print(budget_warning, highlight=False)
        say(f"{'resuming' if start.checkpoint else 'training'} a policy in {out}: PPO, {counted(start.target, 'iteration')} "
            f"of {settings.train_batch} steps, {backend}, seed {settings.seed}, "
            f"{counted(settings.workers, 'remote runner')}, Ray {'at ' + args.ray_address if args.ray_address else 'local'}"
            + (f"; from checkpoint {start.checkpoint.name}" if start.checkpoint else ""), highlight=False)

    quiet_ray()

    def show(row) -> None:
        def pct(x: float | None) -> str:
            return "   -" if x is None else f"{100 * x:3.0f}%"

        def num(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        say(f"iter {row.iteration:>4}/{settings.iterations}  steps {row.timesteps:>9,}  "
            f"episodes {row.episodes:>8,}  return {num(row.episode_return, '6.2f')}  "
            f"trials/episode {num(row.trials, '5.2f')}  within 2% of optimum {pct(row.within_2pct)}  "
            f"best/optimum {num(row.best_over_optimum, '.3f')}  oom/episode {num(row.oom_trials, '.2f')}  "
            f"{row.seconds / 60:6.1f} min", highlight=False)

    ignore_stops_at_exit()  # after Ray's import: this process's exit handlers (Ray's shutdown) meet no Ctrl-C
    try:
        result = train(out, settings, ray_address=args.ray_address, on_iteration=show, on_start=begin)
    except KeyboardInterrupt:
        with deferred_signals():  # the outcome is decided: a second Ctrl-C cuts its report short no more
            console.print(interrupted(RunDir(out)), highlight=False)
            if args.json:
                saved = RunDir(out).latest_checkpoint()
                emit_json(args, {"out": str(out), "interrupted": True, "checkpoint": str(saved) if saved else None})
        return 130
    with deferred_signals():  # trained and exported: a Ctrl-C now changes nothing (exit 0, no traceback)
        policy = result.policy if result.policy is not None else "not exported (said above)"
        console.print(f"done: {counted(result.iterations, 'iteration')}; checkpoint {result.checkpoint}; policy {policy}",
                      highlight=False)
        if args.json:
            emit_json(args, {"out": str(result.out), "interrupted": False, "iterations": result.iterations,
                             "resumed_from": result.resumed_from, "checkpoint": result.checkpoint,
                             "policy": result.policy, "last": result.last,
                             "settings": RunDir(out).settings() or settings})
    return 0


@functools.cache  # once per process
def ignore_stops_at_exit() -> None:
    """At this process's exit, before the exit handlers registered until now (Ray's shutdown, registered at its
    import), ignore Ctrl-C, SIGTERM and SIGHUP: the command's outcome and exit status are decided by then, and a
    KeyboardInterrupt there would print a traceback ("Exception ignored in atexit callback")."""
    import atexit
    import signal

    def ignore() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                signal.signal(signum, signal.SIG_IGN)
            except (ValueError, OSError):  # not the main thread
                pass

    atexit.register(ignore)


def interrupted(run) -> str:
    """What an interrupted `rl train` leaves: the checkpoint the same command resumes from, or (none) a folder
    that any command starts over in, unless its settings stayed (a second interrupt while training took them back)."""
    saved = run.latest_checkpoint()
    if saved:
        return f"interrupted: the same command resumes from checkpoint {saved}"
    try:
        kept = run.settings() is not None
    except ConfigError:
        kept = True
    if kept:
        return (f"interrupted before the first checkpoint: nothing was saved, the same command starts over; "
                f"{run.path / 'settings.json'} keeps its settings, so other flags are refused there until it is removed")
    return (f"interrupted before the first checkpoint: nothing was saved, the same command starts over, as does one "
            f"with other flags ({run.path} keeps no settings)")


def quiet_ray() -> None:
    """Ray's and RLlib's notices (token authentication's default, the new API stack, deprecations, gputil) drown the
    progress lines: errors only. After Ray's import, which sets its logger's level."""
    import ray  # noqa: F401

    for name in ("ray", "ray.rllib"):  # RLlib's has a level of its own
        logging.getLogger(name).setLevel(logging.ERROR)


def run_export(args: argparse.Namespace) -> int:
    from autotune.rl.train import check_policy_folder, export_checkpoint, resolve_checkpoint

    # before Ray's import: a wrong path is one line at once; --out takes a new or empty folder or an exported policy's
    # (which the export replaces whole), never a training run's, a sweep's or other files
    check_policy_folder(args.out)
    checkpoint = resolve_checkpoint(args.checkpoint)
    quiet_ray()

    folder = export_checkpoint(checkpoint, args.out)
    provenance = (folder / "PROVENANCE.md").is_file()
    if args.json:
        emit_json(args, {"policy": folder, "checkpoint": str(checkpoint),
                         "files": sorted(str(p) for p in folder.iterdir() if p.is_file()), "provenance": provenance})
        return 0
    print(f"policy of checkpoint {checkpoint} written to {folder}" + (" with PROVENANCE.md" if provenance else ""))
    return 0
