"""`autotune trial`: one real DeepSpeed trial of one config, its measured result next to the estimator's
prediction. The result is appended to `<run-dir>/trials.jsonl` and its logs kept in `<run-dir>/logs/`.
Before the trial, a child process builds (first use) or loads the DeepSpeed ops it needs (autotune.trials.ops).
Exit status: 0 if the trial ran (`ok`), 1 if it failed (oom, unsupported, timeout, crash) or an op it needs cannot
be built (one line naming the fix, nothing recorded), 2 for bad input."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console, JustifyMethod
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.values.argtypes import duration, existing_dir, gpu_count, int_range, non_negative_int, output_dir
from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.backends.factory import deepspeed_backend, script_backend
from autotune.prediction.calibrate import calibrator, load_calibration, quality, save_calibration
from autotune.commands.common import (MODEL_HELP, SEQ_LEN_HELP, add_json_argument, emit_json, hardware_name,
                                      json_command, make_dir, model_name, positive_int, size, target_from)
from autotune.commands.script import script_target
from autotune.values.config import OFFLOADS, PRECISIONS, ZERO_STAGES, Config, ConfigError
from autotune.values.dsconfig import DsOptions
from autotune.prediction.estimate import MEMORY_TERMS, Calibration, Estimate, estimate
from autotune.values.hardware import PROFILES, Hardware
from autotune.values.results import TrialResult, append_result, read_results, repair_tail
from autotune.commands.script import add_arguments as script_arguments, script_from
from autotune.script.batch import settle
from autotune.script.inspect_model import describe
from autotune.outputs.script import learned_workload, reached_initialize, script_batch_of
from autotune.values.settings import within_device
from autotune.values.space import invalid_reason
from autotune.values.units import counted, format_size
from autotune.worker.measure import MeasureSettings
from autotune.values.workload import Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    knobs = parser.add_argument_group("the config")
    knobs.add_argument("--zero-stage", type=int_range(min(ZERO_STAGES), max(ZERO_STAGES)), choices=ZERO_STAGES,
                       required=True)
    knobs.add_argument("--micro-batch", type=positive_int, required=True, help="samples per device per micro-step")
    knobs.add_argument("--ckpt-interval", type=non_negative_int, default=0,
                       help="0: no activation checkpointing; k: checkpointed segments of k layers (default: 0)")
    knobs.add_argument("--precision", choices=PRECISIONS, required=True)
    knobs.add_argument("--offload-optimizer", choices=OFFLOADS, default="none")
    knobs.add_argument("--offload-param", choices=OFFLOADS, default="none")
    knobs.add_argument("--nvme-path", type=nvme_dir, default=None,
                       help="directory for NVMe offload: an existing writable directory on the NVMe drive")
    work = parser.add_argument_group("the workload and machine")
    work.add_argument("--model", type=model_name, default="tiny", help=MODEL_HELP)
    work.add_argument("--seq-len", type=positive_int, default=None, help=SEQ_LEN_HELP)
    work.add_argument("--gpus", type=gpu_count, default=None,
                      help="data-parallel ranks on this machine (default: the GPUs found with --hardware auto, else 1)")
    work.add_argument("--global-batch", type=positive_int, default=None,
                      help="samples per optimizer step over all ranks (default: 16 for tiny, else 32 x gpus)")
    work.add_argument("--hardware", type=hardware_name, default=None,
                      help="the machine the trial runs on: auto (default: this machine's devices), a profile "
                           f"({', '.join(PROFILES)}) or a YAML file; a GPU profile needs its GPUs here")
    work.add_argument("--memory-budget", type=size, default=None,
                      help="per device, e.g. 2GiB: on CUDA the allocator's cap, on the CPU each rank's resident "
                           "set (the trial ends as oom past it) (default: none)")
    run = parser.add_argument_group("the run")
    run.add_argument("--run-dir", type=output_dir, default=None,
                     help="where trials.jsonl, logs/ and calibration.json live (default: runs/trials/<model>-b<batch>-g<gpus>)")
    run.add_argument("--timeout", type=duration, default=600.0,
                     help="time before the trial is ended, e.g. 600 (seconds) or 10m (default: 600)")
    run.add_argument("--warmup-steps", type=non_negative_int, default=MeasureSettings.warmup_steps,
                     help="optimizer steps before measuring (default: %(default)s)")
    run.add_argument("--max-steps", type=positive_int, default=MeasureSettings.max_steps,
                     help="measured optimizer steps at most; fewer once the step time is stable (default: %(default)s)")
    run.add_argument("--calibrate", action="store_true",
                     help="after the trial, fit the estimator to every ok trial of --run-dir and save calibration.json")
    add_json_argument(parser)
    script_arguments(parser)


def nvme_dir(text: str) -> str:
    """--nvme-path: an existing writable directory (a mount of the NVMe drive; one that is missing is a typo)."""
    return str(existing_dir(text))


def measure_settings(args: argparse.Namespace) -> MeasureSettings:
    """The trial's measurement from --warmup-steps and --max-steps (checked by their argparse types)."""
    return MeasureSettings(warmup_steps=args.warmup_steps, min_steps=min(MeasureSettings.min_steps, args.max_steps),
                           max_steps=args.max_steps)


@json_command
def run(args: argparse.Namespace) -> int:
    if args.script:  # the user's own script instead of the built-in model (autotune.outputs.script)
        return run_script_trial(args)
    target = target_from(args, real=True)
    workload, hardware = target.workload, target.hardware
    config = Config(args.zero_stage, args.micro_batch, args.ckpt_interval, args.precision,
                    args.offload_optimizer, args.offload_param)
    check_config(config, workload, hardware, args.nvme_path)
    check_budget_here(args.memory_budget, hardware)
    measure = measure_settings(args)
    name = workload.model.name.replace("/", "--")  # a preset's name, or a file's model's (a Hub id: owner--name)
    run_dir = created_run_dir(args, f"runs/trials/{name}-b{workload.global_batch}-g{workload.gpus}")
    check_record(run_dir / "trials.jsonl", read=args.calibrate)  # a trial that runs is recorded (and refitted on)
    calibration = load_calibration(run_dir, workload, hardware) or Calibration()
    backend = deepspeed_backend(workload, args.memory_budget, hardware, DsOptions(nvme_path=args.nvme_path),
                                run_dir / "logs", args.timeout, measure, calibration=calibration)
    prediction = backend.predict(config)
    backend.preflight([config], lambda line: print(line, file=sys.stderr, flush=True))  # OpBuildFailed: exit 1
    if args.json:
        result = backend.run(config)
    else:
        result = _run_with_progress(backend, config)
    append_result(run_dir / "trials.jsonl", result)
    # The table compares the trial with what was predicted before it ran; a fit that includes it is shown apart.
    refit = _recalibrate(run_dir, workload, hardware) if args.calibrate else None
    after = None if refit is None or prediction is None else estimate(config, workload, hardware, refit)
    if args.json:
        emit_json(args, {"result": result.to_dict(), "prediction": prediction.to_dict() if prediction else None,
                         "calibration": (refit or backend.calibration).to_dict(),
                         "calibrated_prediction": after.to_dict() if after else None, "run_dir": str(run_dir)})
        return 0 if result.ok else 1
    show(result, prediction, backend.calibration, workload, hardware, run_dir)
    if refit is not None:
        now = "" if after is None else (f"; {config.label()} now predicted {after.throughput_samples_per_s:,.3g} "
                                        f"samples/s, peak {format_size(after.peak_bytes)}")
        print(f"{run_dir / 'calibration.json'}: refitted on {counted(refit.samples, 'ok trial')}{now}")
    elif args.calibrate:
        print(f"--calibrate: no ok trial in {run_dir / 'trials.jsonl'} to fit on; calibration.json unchanged")
    return 0 if result.ok else 1


def created_run_dir(args: argparse.Namespace, default: str) -> Path:
    """--run-dir (or the default), created once every input is checked; an internal error's traceback goes
    to its logs/ (autotune.cli)."""
    run_dir = make_dir(Path(args.run_dir or default), "--run-dir" if args.run_dir else "the default run directory")
    args._run_dir = run_dir
    return run_dir


def check_record(path: Path, read: bool = False) -> None:
    """Refuse, before anything is launched, a record file the trial's result could not be appended to, or (`read`:
    --calibrate) one whose lines the refit after the trial could not read: a trial that runs is recorded and shown.
    The append's own checks (repair_tail: a symbolic link, a file that cannot be opened for appending, a torn last
    line moved aside, as the append would) and the refit's own reader (read_results) do it, as ConfigErrors."""
    if os.path.lexists(path) and not os.path.islink(path) and not os.path.isfile(path):
        kind = "is a directory" if os.path.isdir(path) else "is not a regular file"
        raise ConfigError(f"{path} {kind}: the trial's result cannot be appended to it (remove it)")
    repaired = repair_tail(path)  # ConfigError for a link or an unwritable file; a torn tail moved aside
    if repaired:
        print(repaired, file=sys.stderr)
    if not os.path.lexists(path) and not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{path}: cannot be created ({path.parent} is not writable)")
    if read:
        read_results(path)  # what _recalibrate reads after the trial: a bad line refused now, not after


def check_config(config: Config, workload: Workload, hardware: Hardware, nvme_path: str | None) -> None:
    """Refuse, before anything is launched, configs that cannot be written for this workload or run on this
    hardware: a precision the profile does not support (Hardware.supports; fp16 on cpu, which DeepSpeed's CPU
    accelerator refuses) would launch ranks only to record `unsupported`."""
    if not hardware.supports(config.precision):
        runs = ", ".join(p for p in PRECISIONS if hardware.supports(p))
        why = " (DeepSpeed's CPU accelerator refuses it)" if hardware.is_cpu else ""
        raise ConfigError(f"--precision {config.precision}: not supported on {hardware.name}{why}: allowed {runs}")
    reason = invalid_reason(config, workload, hardware, nvme_path)
    if reason:
        raise ConfigError(f"{config.label()}: {reason}")


def check_budget_here(budget: int | None, hardware: Hardware) -> None:
    """A chosen --memory-budget is at most the device's memory, as tune's and estimate's are (one-line ConfigError)."""
    if budget is not None:
        within_device(budget, hardware)


def _run_with_progress(backend: DeepSpeedBackend, config: Config) -> TrialResult:
    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        progress.add_task(f"real DeepSpeed trial of {config.label()} on {counted(backend.workload.gpus, 'rank')}", total=None)
        return backend.run(config)


def _recalibrate(run_dir: Path, workload: Workload, hardware: Hardware) -> Calibration | None:
    results = [r for r in read_results(run_dir / "trials.jsonl") if r.backend == "deepspeed"]
    calibration = calibrator(workload, hardware)(results)
    if not calibration.samples:
        return None
    save_calibration(run_dir, calibration, workload, hardware, quality(results, workload, hardware, calibration))
    return calibration


def show(result: TrialResult, prediction: Estimate | None, calibration: Calibration, workload: Workload,
         hardware: Hardware, run_dir: Path, unseen: str = "") -> None:
    """`unseen`: a script's trial that never showed its model: what the header says instead of the placeholder's
    name, size and global batch."""
    console = Console()  # the terminal's width (COLUMNS where set), never forced wider
    extra = result.extra
    model = workload.model
    what = unseen or (f"{model.name}: {model.params / 1e6:,.1f}M parameters, global batch {workload.global_batch}")
    console.print(f"{what}, {counted(workload.gpus, 'rank')}; {result.config.label()}; "
                  f"budget {format_size(result.memory_budget_bytes) if result.memory_budget_bytes else 'none'}")
    cal = f"calibrated on {counted(calibration.samples, 'trial')}" if calibration.samples else "uncalibrated"
    table = Table(title=f"Trial {result.status}: measured vs predicted ({hardware.name} profile, {cal})")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("", "left"), ("measured", "right"), ("predicted", "right"), ("pred/meas", "right"))
    for column, justify in columns:  # a narrow terminal folds cells, never cuts them; the names' words stay whole
        table.add_column(column, justify=justify, overflow="fold", min_width=21 if not column else None)

    # An out-of-memory trial's peak is where it was stopped or died: a lower bound, no figure to divide by.
    stopped = result.status == "oom"

    def row(name: str, measured: float | None, predicted: float | None, fmt, at_least: bool = False) -> None:
        ratio = f"{predicted / measured:.2f}" if measured and predicted is not None and not at_least else ""
        shown = "-" if measured is None else f">= {fmt(measured)}" if at_least else fmt(measured)
        table.add_row(name, shown, fmt(predicted) if predicted is not None else "-", ratio)

    num = lambda v: f"{v:,.3g}"  # noqa: E731
    row("throughput (samples/s)", result.throughput_samples_per_s,
        prediction.throughput_samples_per_s if prediction else None, num)
    row("tokens/s", result.tokens_per_s, prediction.tokens_per_s if prediction else None, num)
    row("step time (s)", result.step_time_s, prediction.step_time_s if prediction else None, lambda v: f"{v:.3f}")
    row("peak memory per device", result.peak_memory_bytes, prediction.peak_bytes if prediction else None, format_size,
        stopped)
    growth = extra.get("peak_memory_growth_bytes")
    baseline = extra.get("baseline_memory_bytes")
    row("  growth over baseline", growth, prediction.peak_bytes - baseline if prediction and baseline else None,
        format_size, stopped)
    table.add_row("  baseline (before the model)", format_size(baseline), "", "")
    if prediction:
        for term in MEMORY_TERMS:
            table.add_row(f"    {term}", "", format_size(getattr(prediction.memory, term)), "")
    if result.ok:
        table.add_row("step time IQR (s)", f"{extra['step_time_iqr_s']:.3f}", "", "")
        table.add_row("measured steps", f"{extra['steps_measured']} ({extra['stop_reason']})", "", "")
        table.add_row("launch to first measured step (s)", f"{extra['launch_to_first_step_s']:.1f}", "", "")
    if extra.get("steps_applied") is not None:  # what the optimizer steps did (autotune.worker.training)
        scale = f", loss scale {extra['loss_scale']:g}" if extra.get("loss_scale") is not None else ""
        loss = (f"; loss {extra['loss_first']:.4g} -> {extra['loss_last']:.4g}"
                if extra.get("loss_first") is not None and extra.get("loss_last") is not None else "")
        table.add_row("optimizer steps", f"{extra['steps_applied']} applied, {extra['steps_skipped']} skipped{scale}{loss}",
                      "", "")
    table.add_row("trial wall time (s)", f"{result.wall_time_s:.1f}", "", "")
    console.print(table)
    if result.error:
        console.print(f"[bold]{result.status}[/bold]: {result.error}")
    console.print(f"recorded in {run_dir / 'trials.jsonl'}; logs in {extra.get('log_dir')}")


def run_script_trial(args: argparse.Namespace) -> int:
    """`autotune trial --script`: one trial of the script with one config, next to the estimator's
    prediction for the model the script showed. The trial runs the script's own global batch (the shim reads
    it) unless --global-batch is given."""
    script = script_from(args)
    workload, hardware = script_target(args)
    config = Config(args.zero_stage, args.micro_batch, args.ckpt_interval, args.precision,
                    args.offload_optimizer, args.offload_param)
    keep = args.global_batch is None  # the script's global batch: the shim checks this micro-batch keeps it
    if not keep and workload.grad_accumulation(config.micro_batch) is None:
        raise ConfigError(f"{config.label()}: global batch {workload.global_batch} is not a multiple of micro_batch "
                          f"{config.micro_batch} x {workload.gpus} rank(s)")
    default = workload.global_batch
    if keep and workload.grad_accumulation(config.micro_batch) is None:
        # The shim runs the script's own global batch; the workload's is run only where the script states none:
        # the tuner's default where this micro-batch divides it, else one micro-batch per rank (no accumulation).
        workload = replace(workload, global_batch=config.micro_batch * workload.gpus)
    checked = replace(workload, model=replace(workload.model, layers=10**6))
    check_config(config, checked, hardware, args.nvme_path)
    check_budget_here(args.memory_budget, hardware)
    measure = measure_settings(args)
    run_dir = created_run_dir(args, f"runs/trials/script-{Path(script.path).stem}"
                                    f"{'' if keep else f'-b{workload.global_batch}'}-g{workload.gpus}")
    check_record(run_dir / "trials.jsonl")
    backend = script_backend(script, workload, args.memory_budget, hardware, DsOptions(nvme_path=args.nvme_path),
                             run_dir / "logs", args.timeout, measure, shape_known=False, keep_script_batch=keep,
                             micro_batch_fix=MICRO_BATCH_FIX)
    result = backend.run(config) if args.json else _run_with_progress(backend, config)
    model = result.script_model
    prediction = None
    settled = None
    if model:
        settled = settle(script_batch_of(model), args.global_batch, workload.global_batch)
        workload = replace(learned_workload(model, workload, script), global_batch=settled.global_batch)
        if hardware.supports(config.precision):
            prediction = estimate(config, workload, hardware)
            result = replace(result, extra={**result.extra, "predicted_peak_bytes": prediction.peak_bytes})
    append_result(run_dir / "trials.jsonl", result)
    if args.json:
        emit_json(args, {"result": result.to_dict(), "prediction": prediction.to_dict() if prediction else None,
                         "model": model, "global_batch": settled.to_dict() if settled else None,
                         "run_dir": str(run_dir)})
    else:
        unseen = "" if model else unseen_model(Path(script.path).name, result, keep, workload.global_batch)
        show(result, prediction, calibrator(workload, hardware)([]), workload, hardware, run_dir, unseen)
        if settled is not None and settled.defaulted and settled.global_batch != default:
            print(f"global batch {settled.global_batch}: micro-batch {config.micro_batch} x "
                  f"{counted(workload.gpus, 'rank')}, as the script states no batch size where DeepSpeed gets it and "
                  f"the tuner's default {default} is no multiple of it; pass --global-batch to set it")
        elif settled is not None:
            print(settled.line())
        if model:
            print(f"model seen at deepspeed.initialize: {model.get('class')}, {model['params']:,} parameters, "
                  f"{model.get('layers', '?')} layers, hidden {model.get('hidden', '?')}, "
                  f"checkpointing switch: {model.get('checkpoint_switch') or 'none'}; {describe(model)}")
        verdict = result.extra.get("script_verdict")
        if verdict == "global_batch_indivisible" and keep:  # this trial's micro-batch, not the script, is at fault
            print(f"--micro-batch {config.micro_batch} cannot keep the script's global batch ({verdict}): the error "
                  "above names the micro-batches that can")
        elif verdict:
            print(f"the script cannot be tuned as it is ({verdict})")
    return 0 if result.ok else 1


# The advice of a trial whose micro-batch cannot keep the script's global batch: this command's flags, not a space's.
MICRO_BATCH_FIX = "pass --micro-batch one of them, or --global-batch to change the recipe"


def unseen_model(name: str, result: TrialResult, keep: bool, global_batch: int) -> str:
    """The header of a script trial that never showed its model: how far the trial got (into deepspeed.initialize,
    where the shim stopped it before reading the model, or not that far), and the global batch."""
    where = ("the trial stopped in deepspeed.initialize before the model was read" if reached_initialize(result)
             else "the trial did not reach deepspeed.initialize")
    if result.extra.get("script_verdict") == "global_batch_indivisible":
        batch = "the script's, which this micro-batch cannot keep (below)"
    else:
        batch = "not read" if keep else f"{global_batch} (--global-batch)"
    return f"{name}: its model not seen ({where}), global batch {batch}"
