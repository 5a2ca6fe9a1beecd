"""`autotune tune`: search the space for the fastest config that fits the memory budget, with real
DeepSpeed trials (or the simulated / replay backends), resumable, and write the recommendation and a
report into the run directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import autotune
from autotune.api import (BUDGET_FIELDS, BUILT_IN_TRAINER, SweepStart, TuneResult, TuneSpec, refuse_untrained,
                          spec_options)
from autotune.values.argtypes import (gpu_count, output_dir, ray_address)
from autotune.backends.replay import replay_workload
from autotune.commands import script as script_command
from autotune.commands.common import (add_json_argument, add_workload_arguments, emit_json, json_command, positive_int,
                                      target_from)
from autotune.values.config import ConfigError
from autotune.trials.interrupts import stop_signals_as_interrupt
from autotune.drivers.progress import ConsoleProgress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget
from autotune.outputs.handoff import Handoff
from autotune.search.pruning import cause_counts, describe_causes
from autotune.search.rundir import RunDir
from autotune.values.settings import RunSettings, masked
from autotune.prediction.scale import at_target
from autotune.search_spaces import choices_for, space_note
from autotune.commands.script import add_arguments as script_arguments, script_from
from autotune.values.space import Space
from autotune.outputs import tracking, wandb_tracking
from autotune.values.units import counted, format_size
from autotune.values.ds_autotuning import read_autotuning
from autotune.files import load_json
from autotune.values.hardware import Hardware, sold_size_note
from autotune.values.models import load_model

if TYPE_CHECKING:
    from autotune.drivers.ray import RayOptions


DEFAULT_MODEL = "tiny"  # when neither --model nor --script names one (a replay surface names its own)
DEFAULT_MODEL_NOTE = f"model: {DEFAULT_MODEL} (the default; --model to choose)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # None in args: --model given or not (--script refuses it, a replay surface brings its own)
    add_workload_arguments(parser, default_model=None,
                           shown_default=f"{DEFAULT_MODEL}; with --backend replay, the surface's; with --script, the "
                                         "script's")
    add_option_arguments(parser)
    parser.add_argument("--out", type=output_dir, default=None,
                        help="run directory (default: runs/<model>-<strategy>-<time>)")
    parser.add_argument("--resume", action="store_true", help="continue the sweep in --out")
    add_tracking_arguments(parser)
    add_json_argument(parser)
    add_ray_arguments(parser)
    script_arguments(parser)


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per option of the sweep, as TuneSpec declares it (autotune.api.spec_options); the workload flags that
    `estimate` and `trial` share come from add_workload_arguments."""
    for _, opt, default in spec_options():
        if opt.workload or opt.flag == "--mlflow-uri":  # --mlflow-uri beside --mlflow: add_tracking_arguments
            continue
        if opt.choices is not None:
            parser.add_argument(opt.flag, choices=list(opt.choices()), default=default, help=opt.help, action=Given)
        else:
            parser.add_argument(opt.flag, type=opt.parse, default=default, metavar=opt.metavar, help=opt.help,
                                action=Given)


class Given(argparse.Action):
    """Store the value and note that the flag was given (`args._given`): a value equal to the default cannot say
    whether the user typed it (`--resume --strategy optuna` on a random sweep is a difference to refuse)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace._given = {*getattr(namespace, "_given", ()), self.dest}


def spec_options_from(args: argparse.Namespace) -> dict[str, Any]:
    """The options of the sweep as the flags give them (TuneSpec's keywords)."""
    values = {name: getattr(args, opt.key) for name, opt, _ in spec_options()}
    values["mlflow_uri"] = mlflow_choice(args)
    values["surface"] = None if args.surface is None else str(args.surface)
    values.update(resumed_strategy(args))
    values.update(resumed_budget(args))
    return values


def resumed_budget(args: argparse.Namespace) -> dict[str, Any]:
    """On --resume, the budget of the sweep's last session (run.json's, RunDir.record_budget) where no flag sets
    it: `--resume` alone goes on to the trials and time the sweep was given, not to the defaults. A flag given wins
    (and is kept for the next resume)."""
    if not args.resume or args.out is None:
        return {}
    try:
        recorded = RunDir(args.out).recorded_budget()
    except ConfigError:
        return {}  # not a run directory (yet), or a run.json the library's refusal names
    given: set[str] = getattr(args, "_given", set())
    flags = {name: opt for name, opt, _ in spec_options() if name in BUDGET_FIELDS}
    taken = {name: recorded[name] for name, opt in flags.items()
             if name in recorded and opt.key not in given and recorded[name] != getattr(args, opt.key)}
    if taken:
        args._notes = [*getattr(args, "_notes", []), "--resume: as its last session, where no flag says otherwise: "
                       + ", ".join(f"{flags[name].flag} {shown_budget(name, value)}" for name, value in taken.items())]
    return taken


def shown_budget(name: str, value: Any) -> str:
    """A budget value as its flag takes it (seconds with their unit; None, a flag not given then: 'none')."""
    if value is None:
        return "none"
    return f"{value:g}s" if name.endswith("_s") else f"{value:g}"


def resumed_strategy(args: argparse.Namespace) -> dict[str, Any]:
    """On --resume where no flag sets the strategy, the one the sweep was started with: a sweep begun under the
    earlier default (hybrid, until 2026-11-29) goes on as it began rather than refusing its own command; every
    other setting must still match (api.begin)."""
    if not args.resume or args.out is None or "strategy" in getattr(args, "_given", ()):
        return {}
    try:
        recorded = RunDir(args.out).read_settings().strategy
    except ConfigError:
        return {}  # not a run directory (yet): the library's refusal names it
    if recorded == args.strategy:
        return {}
    args._notes = [*getattr(args, "_notes", []), f"--resume: {args.out} was started with --strategy {recorded}: "
                   "it goes on with it"]
    return {"strategy": recorded}


def add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    """MLflow tracking (autotune/outputs/tracking.py), shared with `autotune sweep`."""
    parser.add_argument("--mlflow", action="store_true",
                        help="log every trial and the recommendation to MLflow, in sqlite:///<out>/mlflow.db (needs "
                             f"the {tracking.EXTRA} extra: pip install 'ds-autotune[{tracking.EXTRA}]')")
    parser.add_argument("--mlflow-uri", default=None, metavar="URI",
                        help="log to this MLflow tracking URI instead (http://SERVER:5000, sqlite:///PATH, "
                             "postgresql://...); a resumed sweep continues its parent run there")


def tracking_uri(args: argparse.Namespace, folder: Path) -> str | None:
    """The MLflow URI of --mlflow / --mlflow-uri (None: no tracking); ConfigError when mlflow is missing."""
    return tracking.resolve_uri(args.mlflow_uri if args.mlflow_uri is not None else args.mlflow, folder)


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the Ray driver (drivers/ray.py), shared with `autotune sweep`."""
    parser.add_argument("--ray-address", type=ray_address, default=None,
                        help="run the trials on this Ray cluster (host:port or auto; 'local' starts a private "
                             "instance on loopback), several at once")
    parser.add_argument("--concurrency", type=positive_int, default=None,
                        help="with --ray-address: trials in flight at most (default: as many as the cluster holds)")
    parser.add_argument("--gpus-per-trial", type=gpu_count, default=None,
                        help="with --ray-address: GPUs one real trial asks for (default: --gpus)")


@json_command
def run(args: argparse.Namespace) -> int:
    """argparse -> TuneSpec -> autotune.tune() -> print (issue 26: the CLI is a client of the library)."""
    # Every check that can refuse the command comes before anything is written to the run directory.
    defaulted = args.model is None and not args.script and args.backend != "replay"
    spec = script_spec_from(args) if args.script else spec_from(args)
    ray = ray_options(args)
    notes = ([DEFAULT_MODEL_NOTE] if defaulted else []) + getattr(args, "_notes", [])
    sold = sold_size_note(spec.hardware) if isinstance(spec.hardware, Hardware) and args.memory_budget is None else None
    notes += [sold] if sold and not args.resume else []
    progress = TuneConsole(args, spec.trials, notes, spec.time_budget_s)
    with stop_signals_as_interrupt():
        try:
            result = autotune.tune(spec, args.out, resume=args.resume, executor=ray, callbacks=progress)
        finally:
            progress.close()  # the last batch of pruned configs, before the summary; the live line ends on any error
    start = progress.start
    if start is None and result.stop_reason is StopReason.INTERRUPTED:  # Ctrl-C before the sweep's headline
        print(f"{args._prog}: {result.verdict}", file=sys.stderr)
        if args.json:
            emit_json(args, result.to_dict())
        return 130
    if start is None:  # a script's first trial showed it cannot be tuned as it is: tune() ended before the search
        report = result.run_dir / "report.md"
        progress.result(f"stopped after the first trial; recorded in {result.run_dir / 'trials.jsonl'}"
                        + (f"; report: {report}" if report.is_file() else ""))
        if args.json:
            emit_json(args, result.to_dict())
        return 1
    mlflow = tracking.resolve_uri(spec.mlflow_uri, result.run_dir)
    return conclude(progress, start.run_dir, start.settings, result, start.budget, mlflow,
                    (lambda data: emit_json(args, data)) if args.json else None, spec.wandb)


def spec_from(args: argparse.Namespace) -> TuneSpec:
    """The library's request from the command line: the workload and hardware the flags name (a replay
    surface's own; --hardware auto probed for real trials, refused here when this machine cannot run them),
    the rest as given; every default is autotune.api.resolve's."""
    if args.backend == "replay":
        if args.surface is None:
            raise ConfigError("--backend replay needs --surface FILE (a JSONL of measured results)")
        workload = replay_workload(args.surface, args.model, args.global_batch, args.gpus, getattr(args, "seq_len", None))
        hardware = args.hardware
    else:
        args.model = args.model or DEFAULT_MODEL
        if args.backend == BUILT_IN_TRAINER:  # first: no other setting would let real trials train it
            refuse_untrained(load_model(args.model, getattr(args, "seq_len", None)), f"--model {args.model}",
                             "use --backend simulated, or --script with your own training script")
        # Real trials run here unless a remote Ray cluster runs them (its nodes' GPUs are Ray's to place).
        here = args.ray_address in (None, "local")
        target = target_from(args, real=args.backend == "deepspeed", check=here)
        workload, hardware = target.workload, target.hardware
    return TuneSpec(workload, hardware, **spec_options_from(args))


def script_spec_from(args: argparse.Namespace) -> TuneSpec:
    """--script: the library's script request (TuneSpec.for_script), refused here in the CLI's words where the
    flags cannot tune a script, its hardware checked against this machine (autotune.commands.script)."""
    if args.model is not None:
        raise ConfigError(f"--model {args.model} with --script {args.script}: choose one (the script brings its model)")
    if args.backend != "deepspeed":
        raise ConfigError(f"--backend {args.backend} with --script: a script's trials are real runs (--backend deepspeed)")
    if args.target_gpus is not None:
        raise ConfigError(f"--target-gpus {args.target_gpus}: not with --script (a script's trials run at the scale it "
                          "is launched with)")
    script = script_from(args)  # the script exists and its arguments parse
    workload, hardware = script_command.script_target(args)
    options = {**spec_options_from(args), "backend": "deepspeed"}
    options.update(autotuning_options(args, script.args, hardware))
    return TuneSpec(workload, hardware, **options, script=script.path, script_args=script.args,
                    script_global_batch=args.global_batch)


def autotuning_options(args: argparse.Namespace, script_args: tuple[str, ...], hardware: Hardware) -> dict[str, Any]:
    """What the `"autotuning"` block of the script's ds_config.json asks (DeepSpeed's own autotuner's), as options
    where no flag set them (autotune.values.ds_autotuning): the strategy, the trials, the space's micro-batches and
    ZeRO stages; each key it cannot apply is a line of the headline (args._notes)."""
    path = script_command.script_ds_config(script_args)
    block = None if path is None else read_autotuning(load_json(path, "the script's DeepSpeed config"), str(path))
    if block is None:
        return {}
    defaults = {name: default for name, _, default in spec_options()}
    options = {name: value for name, value in block.options.items() if getattr(args, name) == defaults[name]}
    taken = ", ".join(f"{name} {value}" for name, value in options.items())
    args._notes = [*getattr(args, "_notes", []), f"{path}: autotuning block read: {taken or 'no option taken'}"
                   + (", the space narrowed to its micro-batches and ZeRO stages" if block.micro_batch or
                      block.micro_batches or block.zero_stages else ""), *block.notes]
    return {**options, "space": block.narrowed(choices_for(args.space, hardware))}


class TuneConsole(ConsoleProgress):
    """`autotune tune`'s display: ConsoleProgress, and the sweep's headline once it has begun (the run
    directory locked, its settings written or checked)."""

    def __init__(self, args: argparse.Namespace, trials: int, notes: list[str] | None = None,
                 time_budget_s: float | None = None) -> None:
        super().__init__(trials, quiet=getattr(args, "quiet", False), verbose=getattr(args, "verbose", False),
                         time_budget_s=time_budget_s)
        self.args = args
        # Said first: before the sweep's first line (a script's first trial's, or the headline), after every check
        # that can refuse the command, so nothing comes before a refusal.
        self.notes = notes or []
        self.start: SweepStart | None = None

    def message(self, text: str) -> None:
        notes, self.notes = self.notes, []
        for line in [*notes, text]:
            super().message(line)

    def begun(self, start: SweepStart) -> None:
        self.start = start
        self.use_space(start.space)
        self.args._run_dir = start.run_dir.path  # an internal error's traceback goes to its logs/ (autotune.cli)
        if start.resumed:
            self.resumed_with(start.run_dir.results())
        for line in headline(start.run_dir, start.settings, start.space, start.budget, start.resumed):
            self.message(line)


def mlflow_choice(args: argparse.Namespace) -> str | bool | None:
    """--mlflow-uri, else --mlflow (True: the run directory's own store), else None: no tracking."""
    return args.mlflow_uri if args.mlflow_uri is not None else (True if args.mlflow else None)


def ray_options(args: argparse.Namespace) -> "RayOptions | None":
    from autotune.drivers.ray import RayOptions

    if args.ray_address is None:
        for flag, value in (("--concurrency", args.concurrency), ("--gpus-per-trial", args.gpus_per_trial)):
            if value is not None:
                raise ConfigError(f"{flag} {value}: only with --ray-address (trials run one at a time locally)")
        return None
    return RayOptions(args.ray_address, args.concurrency, args.gpus_per_trial)


def headline(run_dir: RunDir, settings: RunSettings, space: Space, budget: Budget, resume: bool) -> list[str]:
    """What the console says once the run directory is held: what taking it repaired, the sweep in one line,
    and what the hardware changed in the space."""
    lines = list(run_dir.notes)  # what taking the run directory repaired (autotune.search.rundir)
    history = run_dir.results()
    w = settings.workload
    lines.append(
        f"{'resuming' if resume else 'tuning'} {w.model.name} (global batch {w.global_batch}, {w.gpus} x "
        f"{settings.hardware.name}"
        + (f", predicting {settings.target_gpus}" if settings.target_gpus is not None else "") + f") under {format_size(settings.memory_budget_bytes)}: {settings.strategy} over "
        f"{counted(len(space), 'config')}, {settings.backend} backend, up to {counted(budget.trials, 'trial')}"
        + (f"; {len(history)} recorded already" if history else "") + f" -> {run_dir.path}")
    if (hardware_note := space_note(settings.hardware, settings.choices)) is not None:
        lines.append(hardware_note)
    return lines


def conclude(progress: ConsoleProgress, run_dir: RunDir, settings: RunSettings, result: TuneResult, budget: Budget,
             mlflow: str | None, emit: Callable[[dict], None] | None, wandb: str | None = None) -> int:
    """The console's account of a finished sweep (and --json's document); the exit code. Its results are said
    under --quiet too (progress.result), the rest is a note (progress.message)."""
    pruned = [r for r in result.results if r.status == "pruned"]
    if len(pruned) > 1:
        progress.message(f"pruned {len(pruned)} configs in all: {describe_causes(cause_counts(pruned), 'predicted over')}"
                         " (each with its reason in trials.jsonl and report.md)")
    # No trials.jsonl where nothing was recorded (nothing fits at the start, no node): none is named.
    recorded = f"{len(result.results)} recorded in {run_dir.trials_path}" if result.results else "nothing recorded"
    unfinished = result.stop_reason == StopReason.INTERRUPTED
    # in flight at Ctrl-C and not recorded: one whose line was written just before it is not said again
    numbers = {r.extra.get("trial") for r in result.results}
    stopped = [run.config.label() for run in progress.running.values() if run.number not in numbers] if unfinished else []
    progress.result(f"stopped: {result.stopped}; {counted(result.launched, 'trial')} launched, {recorded}"
                    + (f"; stopped in flight, not recorded (--resume runs it again): {', '.join(stopped)}"
                       if stopped else ""))
    progress.result(result.verdict)
    if result.best is not None and not result.notes and not unfinished:  # an unfinished sweep recommends nothing yet
        for line in Handoff.of(result.best.config, at_target(settings), run_dir.path).console_lines():
            progress.result(line)
    elif progress.quiet:  # a script's own lines (Outputs.notes) came from tune() as notes, unsaid under --quiet
        for line in result.notes:
            progress.result(line)
    if (run_dir.path / "report.md").is_file():  # none where Ctrl-C came before the sweep was opened
        progress.result(f"report: {run_dir.path / 'report.md'}")
    if mlflow is not None:
        progress.result(f"MLflow: {masked(mlflow)} (experiment and parent run in {run_dir.path / tracking.STATE})")
    if wandb is not None:
        progress.result(f"W&B: {wandb_tracking.where(run_dir, wandb)}")
    if emit is not None:
        emit({**result.to_dict(), "budget": {"trials": budget.trials, "time_s": budget.time_s, "confirm": budget.confirm,
                                             "stop_when": budget.stop_when, "train_s": budget.train_s},
              "strategy": settings.strategy, "backend": settings.backend,
              "mlflow": None if mlflow is None else {"uri": masked(mlflow),
                                                     **tracking.parent_of(run_dir, mlflow)}})
    if unfinished:  # the verdict said how to continue it
        return 130
    return 0 if result.best is not None else 1


