"""`autotune tune`: search the space for the fastest config that fits the memory budget, with real
DeepSpeed trials (or the simulated / replay backends), resumable, and write the recommendation and a
report into the run directory."""

from __future__ import annotations

import argparse
import os
import re
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.backends import Backend
from autotune.calibrate import calibrator, quality, save_calibration
from autotune.commands.common import add_workload_arguments, positive_int, size, space_from, target_from
from autotune.config import KNOBS, Config, ConfigError
from autotune.dsconfig import DsOptions
from autotune.interrupts import sigterm_as_interrupt
from autotune.drivers.local import DONE, FATAL, INTERRUPTED, STALLED, TIME, TRIALS, run_local
from autotune.drivers.progress import ConsoleProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.pruning import Pruner
from autotune.report import write_outputs
from autotune.results import TrialResult
from autotune.rundir import RunDir, RunSettings
from autotune.script.cli import add_arguments as script_arguments
from autotune.search_spaces import load_choices
from autotune.space import Choices, Space
from autotune.strategies import STRATEGIES, SearchContext, make_strategy
from autotune.units import format_size
from autotune.workload import make_workload

if TYPE_CHECKING:
    from autotune.drivers.ray import RayOptions

BACKENDS = ("deepspeed", "simulated", "replay")
DEFAULT_STRATEGY = "hybrid"  # the trained policy's first proposals, then Optuna (strategies/hybrid.py)
# Test hook: seconds every simulated trial sleeps, so that a test can kill the tuner mid-trial.
SLEEP_ENV = "AUTOTUNE_SIMULATED_TRIAL_SLEEP_S"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """Seconds from '8h', '90m', '1h30m', '45s' or a plain number of seconds."""
    compact = text.strip().lower().replace(" ", "")
    parts = _DURATION.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise argparse.ArgumentTypeError(f"duration {text!r} is not understood: use e.g. 8h, 90m, 1h30m, 45s")
    seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be positive")
    return seconds


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a non-negative integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, default_model=None)
    parser.add_argument("--memory-budget", type=size, default=None,
                        help="memory budget per device, e.g. 2GiB (2**30) or 2GB (10**9) (default: the hardware's)")
    parser.add_argument("--strategy", choices=list(STRATEGIES), default=DEFAULT_STRATEGY,
                        help="search strategy (default: %(default)s)")
    parser.add_argument("--trials", type=positive_int, default=30,
                        help="trials to launch, over all sessions of a resumed sweep (default: %(default)s)")
    parser.add_argument("--time-budget", type=duration, default=None,
                        help="no trial starts once the trials have taken this long, e.g. 8h, 90m")
    parser.add_argument("--backend", choices=BACKENDS, default="deepspeed",
                        help="deepspeed: real trials; simulated: the estimator; replay: a measured surface "
                             "(default: %(default)s)")
    parser.add_argument("--surface", type=Path, default=None, help="replay surface (JSONL of results), for --backend replay")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the strategy (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<model>-<strategy>-<time>)")
    parser.add_argument("--resume", action="store_true", help="continue the sweep in --out")
    add_ray_arguments(parser)
    script_arguments(parser)


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the Ray driver (drivers/ray.py), shared with `autotune sweep`."""
    parser.add_argument("--ray-address", default=None,
                        help="run the trials on this Ray cluster (host:port or auto; 'local' starts a private "
                             "instance on loopback), several at once")
    parser.add_argument("--concurrency", type=positive_int, default=None,
                        help="with --ray-address: trials in flight at most (default: as many as the cluster holds)")
    parser.add_argument("--gpus-per-trial", type=positive_int, default=None,
                        help="with --ray-address: GPUs one real trial asks for (default: --gpus)")


def run(args: argparse.Namespace) -> int:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress display says what matters
    settings, space = resolve(args)
    name = f"script-{args.script.stem}" if args.script else settings.workload.model.name
    out = args.out or Path("runs") / f"{name}-{settings.strategy}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = RunDir(out)
    if args.resume and not run_dir.exists():
        raise ConfigError(f"--resume: {out} holds no sweep to resume")
    if not args.resume and run_dir.exists():
        raise ConfigError(f"{out} already holds a sweep: pass --resume to continue it, or choose another --out")
    with run_dir.locked(), sigterm_as_interrupt():
        if args.script and args.resume:
            settings = script_mode().resumed(run_dir, settings, script_mode().script_from(args))
        elif args.script:  # the first trial shows the script's model (autotune.script.session)
            settings, space, fatal = script_mode().first_trial(run_dir, settings, space, script_mode().script_from(args))
            if fatal:
                run_dir.write_settings(settings)
                return script_mode().stopped(run_dir, settings, fatal)
        if args.resume:
            differences = run_dir.read_settings().differences(settings)
            if differences:
                raise ConfigError(f"--resume: {out} was started with other settings ({'; '.join(differences)}): "
                                  "repeat the original command with --resume")
        else:
            run_dir.write_settings(settings)
        return tune(run_dir, settings, space, Budget(args.trials, args.time_budget), args.resume, ray_options(args))


def ray_options(args: argparse.Namespace) -> "RayOptions | None":
    from autotune.drivers.ray import RayOptions

    if args.ray_address is None:
        for flag, value in (("--concurrency", args.concurrency), ("--gpus-per-trial", args.gpus_per_trial)):
            if value is not None:
                raise ConfigError(f"{flag} {value}: only with --ray-address (trials run one at a time locally)")
        return None
    return RayOptions(args.ray_address, args.concurrency, args.gpus_per_trial)


def open_sweep(run_dir: RunDir, settings: RunSettings, space: Space, backend_name: str) -> Sweep:
    """The sweep of a run directory: its recorded history, strategy (its study in the run's storage), pruner."""
    pruner = Pruner(settings.workload, settings.hardware, settings.memory_budget_bytes)
    context = SearchContext(space, settings.memory_budget_bytes, settings.seed, pruner.predict,
                            run_dir.storage())
    strategy = make_strategy(settings.strategy, context)
    return Sweep(strategy, pruner, run_dir.append, backend_name, run_dir.results(),
                 calibrator(settings.workload, settings.hardware), len(space))


def nothing_fits(sweep: Sweep, space: Space) -> bool:
    """Every config would be pruned: say so rather than record the whole space."""
    return not any(sweep.pruner.check(c, sweep.backend_name) is None for c in space)


def close_sweep(run_dir: RunDir, settings: RunSettings, sweep: Sweep):
    """Save the calibration and write the outputs (summary, recommended configs, report, plots)."""
    if sweep.pruner.calibration.samples:
        measured = sweep.measured()
        save_calibration(run_dir.path, sweep.pruner.calibration, settings.workload, settings.hardware,
                         quality(measured, settings.workload, settings.hardware, sweep.pruner.calibration))
    return write_outputs(run_dir, settings, sweep.results)


def tune(run_dir: RunDir, settings: RunSettings, space: Space, budget: Budget, resume: bool,
         ray: "RayOptions | None" = None) -> int:
    backend = make_backend(settings, space, run_dir)
    progress = ConsoleProgress(budget.trials)
    sweep = open_sweep(run_dir, settings, space, backend.name)
    history = list(sweep.results)
    w = settings.workload
    progress.message(
        f"{'resuming' if resume else 'tuning'} {w.model.name} (global batch {w.global_batch}, {w.gpus} x "
        f"{settings.hardware.name}) under {format_size(settings.memory_budget_bytes)}: {settings.strategy} over "
        f"{len(space)} configs, {settings.backend} backend, up to {budget.trials} trials"
        + (f"; {len(history)} recorded already" if history else "") + f" -> {run_dir.path}")
    if nothing_fits(sweep, space):
        reason = NOTHING_FITS
    elif ray is not None:
        from autotune.drivers.ray import run_one

        reason = run_one(sweep, settings, run_dir, budget, ray, progress)
    else:
        reason = run_local(sweep, backend, budget, progress)
    outputs = close_sweep(run_dir, settings, sweep)
    if settings.backend == "script":
        for line in script_mode().finish(run_dir, settings, outputs.best):
            progress.message(line)
    progress.message(f"stopped: {STOP_TEXT.get(reason, reason)}; {sweep.launched} trials launched, "
                     f"{len(sweep.results)} recorded in {run_dir.trials_path}")
    progress.message(outputs.verdict)
    if outputs.best is not None:
        progress.message(f"recommended config: {run_dir.path / 'best_ds_config.json'} "
                         f"(Hugging Face: {run_dir.path / 'best_hf_ds_config.json'})")
    progress.message(f"report: {run_dir.path / 'report.md'}")
    if reason == INTERRUPTED:
        progress.message(f"interrupted: continue with the same command and --resume --out {run_dir.path}")
        return 130
    return 0 if outputs.best is not None else 1


NOTHING_FITS = "nothing fits"
STOP_TEXT = {NOTHING_FITS: "no config of the space is predicted to fit, nothing was run",
             TRIALS: "trial budget spent", TIME: "time budget spent", DONE: "the strategy has nothing left to try",
             STALLED: "the strategy kept proposing known or pruned configs", INTERRUPTED: "interrupted",
             FATAL: "a failure no other config can avoid (above)",
             "no node": "no node of the Ray cluster has the resources one trial needs, nothing was run"}


def resolve(args: argparse.Namespace) -> tuple[RunSettings, Space]:
    """The sweep's settings and space from the command line; ConfigError for bad combinations."""
    if args.backend == "replay":
        return _resolve_replay(args)
    if args.script:
        return script_mode().resolve(args)
    if args.surface is not None:
        raise ConfigError(f"--surface {args.surface} is only for --backend replay (got --backend {args.backend})")
    args.model = args.model or "tiny"
    # Real trials run here unless a remote Ray cluster runs them (its nodes' GPUs are Ray's to place).
    here = args.ray_address in (None, "local")
    target = target_from(args, real=args.backend == "deepspeed", check=here)
    workload, hardware = target.workload, target.hardware
    space = space_from(args, workload, hardware)
    budget = args.memory_budget or hardware.memory_bytes
    settings = RunSettings(workload, hardware, budget, args.strategy, args.backend, args.seed, space.choices)
    return settings, space


def _resolve_replay(args: argparse.Namespace) -> tuple[RunSettings, Space]:
    from autotune.backends.replay import load_surface, surface_choices, surface_space

    if args.surface is None:
        raise ConfigError("--backend replay needs --surface FILE (a JSONL of measured results)")
    surface = load_surface(args.surface)
    recorded = surface.workload
    if recorded is None:
        workload = make_workload(args.model or "tiny", args.global_batch, args.gpus or 1)
    else:
        workload = recorded
        for flag, given, value in (("--model", args.model, recorded.model.name),
                                   ("--global-batch", args.global_batch, recorded.global_batch),
                                   ("--gpus", args.gpus, recorded.gpus)):
            if given is not None and given != value:
                raise ConfigError(f"{flag} {given}: the surface {args.surface} was recorded with {value}")
    hardware = args.hardware
    if hardware is None:
        from autotune.hardware import load_hardware
        hardware = load_hardware(surface.hardware or "cpu")
    choices = surface_choices(surface)
    if args.space is not None:
        narrowed = load_choices(args.space)
        choices = Choices(**{k: tuple(v for v in choices.knob_values(k) if v in narrowed.knob_values(k))
                             for k in KNOBS}, nvme_path=narrowed.nvme_path)
    space = surface_space(surface, hardware, workload, choices)
    budget = args.memory_budget or hardware.memory_bytes
    settings = RunSettings(workload, hardware, budget, args.strategy, "replay", args.seed, choices,
                           surface=str(Path(args.surface).resolve()))
    return settings, space


def make_backend(settings: RunSettings, space: Space, run_dir: RunDir) -> Backend:
    budget = settings.memory_budget_bytes
    if settings.backend == "simulated":
        from autotune.backends.simulated import SimulatedBackend

        backend: Backend = SimulatedBackend(settings.workload, settings.hardware, budget, seed=settings.seed,
                                            nvme_path=settings.choices.nvme_path)
        sleep_s = float(os.environ.get(SLEEP_ENV, "0") or 0)
        return SleepingBackend(backend, sleep_s) if sleep_s > 0 else backend
    if settings.backend == "replay":
        from autotune.backends.replay import ReplayBackend

        return ReplayBackend(settings.surface, budget)
    if settings.backend == "script":
        return script_mode().make_backend(settings, run_dir)
    from autotune.backends.deepspeed import DeepSpeedBackend

    return DeepSpeedBackend(settings.workload, budget, settings.hardware, DsOptions(nvme_path=settings.choices.nvme_path),
                            logs_dir=run_dir.logs_dir)


def script_mode():
    """autotune.script.session, imported when a sweep tunes a user's script (--script)."""
    from autotune.script import session

    return session


class SleepingBackend:
    """A backend whose every trial also takes `sleep_s` of wall time (tests of kill and resume)."""

    def __init__(self, inner: Backend, sleep_s: float) -> None:
        self.inner = inner
        self.name = inner.name
        self.sleep_s = sleep_s

    def run(self, config: Config) -> TrialResult:
        time.sleep(self.sleep_s)
        return self.inner.run(config)
