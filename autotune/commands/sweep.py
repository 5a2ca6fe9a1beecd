"""`autotune sweep sweep.yaml`: tune every workload of a sweep file at once on a Ray cluster, one run
directory each, and write the sweep summary (markdown and CSV)."""

from __future__ import annotations

import argparse
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.backends.factory import backend_kind
from autotune.trials.devices import require_here
from autotune.values.argtypes import output_dir, positive_int, ray_address
from autotune.values.config import ConfigError
from autotune.commands.common import add_json_argument, emit_json, json_command
from autotune.commands.tune import add_tracking_arguments, tracking_uri
from autotune.outputs import wandb_tracking
from autotune.drivers.stop import StopReason
from autotune.search.rundir import SETTINGS, SWEEP_COPY, RunDir
from autotune.values.units import counted

if TYPE_CHECKING:
    from autotune.api import Plan
    from autotune.commands.sweep_file import SweepFile
    from autotune.values.settings import RunSettings


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
    parser.add_argument("--wandb", default=None, metavar="PROJECT",
                        help="log every workload's trials and recommendation to this Weights & Biases project, a "
                             "group per workload, in place of the workloads' own wandb keys, as --mlflow/--mlflow-uri "
                             "take the place of their mlflow_uri (default: each workload's wandb key, else off; needs "
                             f"the {wandb_tracking.EXTRA} extra: pip install 'ds-autotune[{wandb_tracking.EXTRA}]')")
    add_json_argument(parser)


@json_command
def run(args: argparse.Namespace) -> int:
    """The sweep file's workloads -> the one runner (autotune.api.tune_many), on the Ray cluster -> the summary."""
    from rich.console import Console

    from autotune.api import holds_trials, tune_many
    from autotune.commands.report import sweep_rows
    from autotune.commands.sweep_file import load_sweep
    from autotune.drivers.ray import LabelledProgress, RayOptions
    from autotune.files import read_bytes, write_atomic
    from autotune.outputs.sweep import SUMMARY_CSV, SUMMARY_MD, summary_row, write_summary
    from autotune.trials.cluster import LOCAL
    from autotune.trials.interrupts import stop_signals_as_interrupt
    from autotune.values.settings import masked

    sweep_file = load_sweep(args.sweep_file)
    if args.resume and args.out is None:
        raise ConfigError("--resume needs --out DIR (the sweep directory to continue)")
    out = args.out or Path("runs") / f"sweep-{args.sweep_file.stem}-{datetime.now():%Y%m%d-%H%M%S}"
    args._run_dir = out  # an internal error's traceback goes to its logs/ (autotune.cli), once it exists
    mlflow = tracking_uri(args, out)
    wandb_tracking.check_project(args.wandb)  # a name W&B refuses, or no wandb package: one line, nothing run
    if args.ray_address == LOCAL:  # this machine runs the real trials: refuse what it cannot run, up front
        for spec in sweep_file.workloads:
            if backend_kind(spec.settings.backend).real:
                try:
                    require_here(spec.settings.hardware, spec.settings.workload.gpus, spec.chosen_budget)
                except ConfigError as err:
                    raise ConfigError(f"{sweep_file.path}: workload {spec.name!r}: {err}") from None
    if os.path.lexists(out / SETTINGS):
        raise ConfigError(f"{out} holds an `autotune tune` run ({SETTINGS}), not a sweep directory (one folder per "
                          "workload): choose another --out")
    check_same_sweep(out, sweep_file, args.resume)
    # A workload's directory with a trial recorded holds the sweep; one interrupted before its first, its settings
    # only, is started over by the same command (api.check_out), and continued by --resume
    held = [holds_trials(RunDir(out / spec.name)) for spec in sweep_file.workloads]
    if not args.resume and any(held):
        busy = sweep_file.workloads[held.index(True)].name
        raise ConfigError(f"{out} already holds this sweep (workload {busy!r}): pass --resume to continue it, "
                          "or choose another --out")
    if args.resume and not any(RunDir(out / spec.name).exists() for spec in sweep_file.workloads):
        raise ConfigError(f"--resume: {out} holds no sweep of {sweep_file.path} to resume: run the command without "
                          "--resume")
    console = Console(soft_wrap=True)  # one line per event, wrapped by the terminal (COLUMNS where set)
    plans = [spec.plan(out, mlflow, args.wandb) for spec in sweep_file.workloads]
    for spec in sweep_file.workloads:  # what a workload took by default (a model: tiny, as `autotune tune` says)
        for note in spec.notes:
            console.print(f"{spec.name}: {note}", highlight=False)
    names = [spec.name for spec in sweep_file.workloads]
    shows = {name: LabelledProgress(name, plan.spec.trials, console) for name, plan in zip(names, plans)}
    # A workload the cluster cannot place gets its own verdict (no node), the others go on: never tune's refusal
    executor = RayOptions(args.ray_address, args.concurrency or sweep_file.concurrency, refuse_unplaceable=False)

    def started() -> None:  # every run directory held: what produced them
        check_same_sweep(out, sweep_file, args.resume)  # another sweep file's, kept since the check above
        write_atomic(out / SWEEP_COPY, read_bytes(sweep_file.path, "the sweep file"))
    if args.resume and all(finished(plan) for plan in plans):  # nothing to run: no Ray started for it
        console.print(f"nothing left to run: every workload of {out} has finished with this budget; the summary is "
                      "rewritten from their run directories", highlight=False)
        rows = dict(zip(names, sweep_rows(out, names)))
    else:
        with stop_signals_as_interrupt():
            try:
                results = tune_many(plans, executor=executor, progress=lambda plan: shows[str(plan.name)],
                                    say=lambda line: console.print(line, highlight=False),
                                    resume_hint=f"restore {sweep_file.path} as it was", started=started)
            finally:
                for show in shows.values():
                    show.close()  # the last batch of pruned configs
        rows = {name: summary_row(name, _settings(RunDir(result.run_dir), plan), result.run_dir, out, result.best,
                                  result.summary, result.verdict, result.stopped)
                for name, plan, result in zip(names, plans, results)}
    write_summary(out, list(rows.values()))
    for name, row in rows.items():  # why each one stopped, as its report says it (a resume says the same)
        console.print(f"[bold]{name}[/bold] stopped: {row['stopped']}; {counted(row['trials'], 'trial')} launched, "
                      f"{counted(row['pruned'], 'config')} pruned", highlight=False)
    print(f"sweep summary: {out / SUMMARY_MD} ({out / SUMMARY_CSV})")
    interrupted = any(r["stopped"] == "interrupted" for r in rows.values())
    if args.json:
        emit_json(args, {"out": str(out), "summary_md": str(out / SUMMARY_MD), "summary_csv": str(out / SUMMARY_CSV),
                         "interrupted": interrupted, "mlflow": mlflow and masked(mlflow),
                         "workloads": list(rows.values())})
    if interrupted:
        print(f"interrupted: continue with the same command and --resume --out {out}")
        return 130
    # 1 when any workload got no recommendation (nothing fits, a script that cannot be tuned, no trial within the
    # budget): the others' outputs are written all the same (docs/ray.md, "Exit status").
    return 0 if all(r["recommended"] for r in rows.values()) else 1


def check_same_sweep(out: Path, sweep_file: "SweepFile", resume: bool) -> None:
    """A sweep directory holds one sweep: the one its kept sweep file (SWEEP_COPY) names the workloads of. Another
    file's (workloads added or left out) is refused in one line naming them, with --resume too (a resume is the same
    sweep): its copy, summary and run directories stay the first sweep's."""
    from autotune.commands.sweep_file import kept_names

    kept = kept_names(out)
    ours = [spec.name for spec in sweep_file.workloads]
    if kept is None or set(kept) == set(ours):
        return
    lacks, adds = [n for n in kept if n not in ours], [n for n in ours if n not in kept]
    differs = "; ".join(part for part in (lacks and f"it lacks {', '.join(lacks)}", adds and f"it adds {', '.join(adds)}")
                        if part)
    way_out = ("a resume continues the same sweep: its workloads as they were, or choose another --out" if resume
               else "choose another --out")
    raise ConfigError(f"{out} holds another sweep ({out / SWEEP_COPY}: workloads {', '.join(kept)}), not "
                      f"{sweep_file.path}'s ({differs}): {way_out}")


# Why a session ended that a resume with the same settings and budget ends on again at once, running nothing: the budget
# spent, or the search over by its own rule (replayed from the same record). Not interrupted or unrecorded (a session
# to go on), nor a fatal failure, no node or a stalled strategy, which a resume may get past (a script fixed, a
# cluster grown, another proposal).
FINISHED = frozenset({StopReason.TRIALS, StopReason.TIME, StopReason.DONE, StopReason.EXHAUSTED, StopReason.CONVERGED,
                      StopReason.NOT_WORTH, StopReason.NOTHING_FITS})


def finished(plan: "Plan") -> bool:
    """A workload's run directory whose last session ended for good (FINISHED, stop.json matching the record) under
    the plan's settings and budget, with no tracker to catch up (MLflow or W&B, which a resume logs to) and no tuner
    on it. Anything else (a script's settings, known after its first trial, included) is for the runner to take."""
    from autotune.outputs.report import read_stop

    run_dir = RunDir(Path(str(plan.out)))
    if plan.spec.mlflow_uri or plan.spec.wandb or plan.resolved is None or not run_dir.exists() \
            or run_dir.busy() is not None:
        return False
    try:
        recorded = read_stop(run_dir)
        same = (not run_dir.read_settings().differences(plan.resolved.settings)
                and run_dir.recorded_budget() == plan.spec.budget_record())
        return same and recorded is not None and recorded[0] in FINISHED and recorded[1] == len(run_dir.results())
    except ConfigError:  # a damaged record: the runner's checks say what is wrong with it
        return False


def _settings(run_dir: "RunDir", plan: "Plan") -> "RunSettings":
    """A workload's settings as its run directory keeps them; as its plan resolves them where Ctrl-C came before
    they were written."""
    from autotune.api import resolution

    return run_dir.read_settings() if run_dir.exists() else (plan.resolved or resolution(plan.spec)).settings
