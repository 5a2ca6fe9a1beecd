"""Batch sweeps: a YAML file lists workloads; each is tuned in its own run directory, all at once on one
Ray cluster (drivers/ray.py shares it fairly), and a summary table (markdown and CSV) gives each
workload's recommended config, throughput, memory and a link to its report.

```yaml
defaults:                 # optional: every workload's keys unless it sets them
  backend: simulated      # deepspeed | simulated | replay
  strategy: optuna
  trials: 20
workloads:
  - name: gpt2-xl-8gpu    # its run directory: <out>/<name>
    model: gpt2-xl        # a preset, or a shape: {layers: 48, hidden: 1600, heads: 25, vocab: 50257, seq_len: 1024},
                          # or a Hugging Face config.json / model directory / cached Hub id, or a shape file
    gpus: 8
    global_batch: 256
    hardware: a100-40gb
    memory_budget: 40GiB
```
Workload keys: name, model, gpus, global_batch, hardware, memory_budget, space, strategy, trials, time_budget,
stop_when (the convergence stop, as --stop-when), backend, surface (replay), seed, gpus_per_trial. Every error names the file, the key, the value and what
is allowed.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.values.config import ConfigError
from autotune.files import exists, is_file, load_yaml, read_bytes, short, write_atomic
from autotune.values.argtypes import duration, positive_int, seed, size, stop_probability
from autotune.search.convergence import DEFAULT_STOP_WHEN, recorded
from autotune.backends.factory import backend_kind, backend_names
from autotune.api import TuneSpec, resolve
from autotune.backends.replay import replay_workload
from autotune.trials.devices import AUTO, require_here
from autotune.values.hardware import Hardware, load_hardware
from autotune.drivers.sweep import Budget
from autotune.search.rundir import RunDir
from autotune.values.settings import RunSettings
from autotune.values.space import Space
from autotune.strategies import STRATEGIES
from autotune.values.units import format_size
from autotune.drivers.stop import StopReason
from autotune.values.models import SHAPE_KEYS, UnknownModel
from autotune.values.workload import PRESETS, ModelShape, Workload, make_workload

WORKLOAD_KEYS = ("name", "model", "gpus", "global_batch", "hardware", "memory_budget", "space", "strategy", "trials",
                 "time_budget", "stop_when", "backend", "surface", "seed", "gpus_per_trial")
TOP_KEYS = ("defaults", "workloads", "concurrency")
DEFAULT_TRIALS = 20
DEFAULT_STRATEGY = "optuna"  # many workloads at once: Optuna keeps several trials of each in flight
SUMMARY_MD = "sweep_summary.md"
SUMMARY_CSV = "sweep_summary.csv"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")  # a directory name, short enough for any file system


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload of a sweep file, resolved: its run settings, space and budget."""

    name: str
    settings: RunSettings
    space: Space
    budget: Budget
    gpus_per_trial: int | None = None
    chosen_budget: int | None = None  # memory_budget as the file gives it (None: the hardware's, its default)


@dataclass(frozen=True)
class SweepFile:
    path: Path
    workloads: tuple[WorkloadSpec, ...]
    concurrency: int | None = None


def load_sweep(path: str | Path) -> SweepFile:
    path = Path(path)
    if not is_file(path):
        raise ConfigError(f"sweep file {str(path)!r}: no such file")
    data = load_yaml(path, f"a sweep file (YAML with {', '.join(TOP_KEYS)})")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(TOP_KEYS)}, got {type(data).__name__}")
    _check_keys(data, TOP_KEYS, str(path))
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{path}: defaults: expected a mapping of workload keys, got {short(defaults)}")
    _check_keys(defaults, tuple(k for k in WORKLOAD_KEYS if k != "name"), f"{path}: defaults")
    entries = data.get("workloads")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: workloads: expected a non-empty list of workloads, got {short(entries)}")
    specs, names = [], set()
    for i, entry in enumerate(entries):
        where = f"{path}: workloads[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(WORKLOAD_KEYS)}, got {short(entry)}")
        _check_keys(entry, WORKLOAD_KEYS, where)
        spec = _workload({**defaults, **entry}, where, path.parent)
        if spec.name in names:
            raise ConfigError(f"{where}.name: {spec.name!r} is used twice: names must be unique (one run directory each)")
        names.add(spec.name)
        specs.append(spec)
    concurrency = data.get("concurrency")
    if concurrency is not None and (not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1):
        raise ConfigError(f"{path}: concurrency: {short(concurrency)}: allowed a positive integer")
    return SweepFile(path, tuple(specs), concurrency)


def _check_keys(data: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}: allowed {', '.join(allowed)}")


def _workload(entry: dict[str, Any], where: str, base: Path) -> WorkloadSpec:
    """Resolve one workload entry with the same parsers, defaults and checks as `autotune tune`."""
    def parse(key: str, parser, allowed: str):
        value = entry.get(key)
        if value is None:
            return None
        try:
            return parser(str(value))
        except (argparse.ArgumentTypeError, ConfigError, ValueError, OverflowError) as err:
            raise ConfigError(f"{where}.{key}: {short(value)}: {err} (allowed {allowed})") from None

    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}.name: {short(name)}: allowed letters, digits, '.', '_' and '-', at most 100 (a directory name)")
    model = entry.get("model", "tiny")
    strategy = entry.get("strategy", DEFAULT_STRATEGY)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ConfigError(f"{where}.strategy: {short(strategy)}: allowed {', '.join(STRATEGIES)}")
    backend = entry.get("backend", "simulated")
    offered = backend_names()  # the registry's sweep kinds, a user's included (a --script: `autotune tune`)
    if not isinstance(backend, str) or backend not in offered:
        raise ConfigError(f"{where}.backend: {short(backend)}: allowed {', '.join(offered)}")
    gpus = parse("gpus", positive_int, "a positive integer")
    global_batch = parse("global_batch", positive_int, "a positive integer")
    space_name = None if entry.get("space") is None else _path_or_name(entry["space"], base)
    memory_budget = parse("memory_budget", size, "a size such as 40GiB or 2GB")
    seed_value = parse("seed", seed, "a non-negative integer") or 0
    hardware: Hardware | str | None = None
    if entry.get("hardware") == AUTO:
        hardware = AUTO
    elif entry.get("hardware") is not None:
        try:
            hardware = load_hardware(_path_or_name(entry["hardware"], base))
        except ConfigError as err:
            raise ConfigError(f"{where}.hardware: {err}") from None
    try:
        surface = None
        if backend == "replay":
            if entry.get("surface") is None:
                raise ConfigError("backend replay needs a surface (a JSONL of measured results)")
            surface = _path_or_name(entry["surface"], base)
            workload = replay_workload(surface, model if isinstance(model, str) else None, global_batch, gpus)
        else:
            if entry.get("surface") is not None:
                raise ConfigError(f"surface is only for backend replay (got backend {backend})")
            workload = _model_workload(model, global_batch, gpus or 1, where, base)
        # The library's own defaults (autotune.api.resolve). Real trials default to this machine's devices;
        # whether they can run is checked by run_sweep, which knows whether this machine or a cluster runs them.
        settings, space = resolve(TuneSpec(workload, hardware, memory_budget_bytes=memory_budget, strategy=strategy,
                                           backend=backend, space=space_name, seed=seed_value, surface=surface))
    except ConfigError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(str(where)) else f"{where}: {message}") from None
    trials = parse("trials", positive_int, "a positive integer") or DEFAULT_TRIALS
    time_budget = parse("time_budget", duration, "a duration such as 8h, 90m, 45s")
    gpus_per_trial = parse("gpus_per_trial", positive_int, "a positive integer")
    stop_when = parse("stop_when", stop_probability, "a probability from 0 to 1; 0: off")
    budget = Budget(trials, time_budget, stop_when=DEFAULT_STOP_WHEN if stop_when is None else stop_when)
    return WorkloadSpec(name, settings, space, budget, gpus_per_trial, memory_budget)


def _model_workload(model: Any, global_batch: int | None, gpus: int, where: str,
                    base: Path | None = None) -> Workload:
    """`model:` as a preset, a Hugging Face config.json or model directory (relative to the sweep file's
    folder), a cached Hub id, a YAML/JSON shape file (autotune.values.models), or a mapping of shape keys."""
    if isinstance(model, str):
        local = base / model if base is not None and model not in PRESETS else None
        try:
            return make_workload(str(local) if local is not None and exists(local) else model, global_batch, gpus)
        except UnknownModel:
            raise ConfigError(f"{where}.model: {short(model)}: {ALLOWED_MODELS}") from None
        except ConfigError as err:
            raise ConfigError(f"{where}.model: {err}") from None
        except (OSError, ValueError) as err:  # a name the filesystem refuses to look up (too long)
            raise ConfigError(f"{where}.model: {short(model)}: {err.strerror if isinstance(err, OSError) else err}; "
                              f"{ALLOWED_MODELS}") from None
    if isinstance(model, dict):
        shape = {"name": "custom", **model}
        unknown = [key for key in shape if key not in SHAPE_KEYS and key != "name"]
        if unknown:
            raise ConfigError(f"{where}.model: {short(model)}: unknown key {short(unknown[0])}; allowed keys "
                              f"{', '.join(SHAPE_KEYS)}")
        try:
            return Workload(ModelShape(**shape), global_batch or 32 * gpus, gpus)
        except TypeError as err:
            raise ConfigError(f"{where}.model: {short(model)}: {err}; allowed keys "
                              f"{', '.join(SHAPE_KEYS)}") from None
        except ConfigError as err:
            raise ConfigError(f"{where}.model: {err}") from None
    raise ConfigError(f"{where}.model: {short(model)}: {ALLOWED_MODELS}")


ALLOWED_MODELS = (f"allowed {', '.join(PRESETS)}, a Hugging Face config.json or model directory, a Hub id in the local "
                  "Hugging Face cache, a YAML/JSON shape file, or a mapping of shape keys")




def _path_or_name(value: Any, base: Path) -> str:
    """A preset name as is; a relative file path relative to the sweep file's folder."""
    text = str(value)
    candidate = base / text
    return str(candidate) if ("/" in text or text.endswith((".yaml", ".yml", ".jsonl"))) and exists(candidate) else text


# -- running a sweep

def run_sweep(sweep_file: SweepFile, out: Path, address: str, resume: bool, concurrency: int | None = None,
              console=None, mlflow: str | None = None) -> dict[str, dict]:
    """Tune every workload of the file at once on the Ray cluster at `address`; write each run directory and
    the sweep summary. Returns the summary rows by workload name. `mlflow`: an MLflow tracking URI, where each
    workload is a parent run of its trials (autotune.outputs.tracking), or None."""
    from autotune.outputs.tracking import tracked
    from rich.console import Console

    from autotune.backends.factory import simulated_sleep_s
    from autotune.api import close_sweep
    from autotune.drivers.sweep import Sweep
    from autotune.drivers import ray as ray_driver
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = console or Console(width=160)
    if address == ray_driver.LOCAL:  # this machine runs the real trials: refuse what it cannot run, up front
        for spec in sweep_file.workloads:
            if backend_kind(spec.settings.backend).real:
                try:
                    require_here(spec.settings.hardware, spec.settings.workload.gpus, spec.chosen_budget)
                except ConfigError as err:
                    raise ConfigError(f"{sweep_file.path}: workload {spec.name!r}: {err}") from None
    out.mkdir(parents=True, exist_ok=True)
    runs = {spec.name: RunDir(out / spec.name) for spec in sweep_file.workloads}
    if not resume and any(run.exists() for run in runs.values()):
        busy = next(name for name, run in runs.items() if run.exists())
        raise ConfigError(f"{out} already holds this sweep (workload {busy!r}): pass --resume to continue it, "
                          "or choose another --out")
    if resume and not any(run.exists() for run in runs.values()):
        raise ConfigError(f"--resume: {out} holds no sweep of {sweep_file.path} to resume")
    with ExitStack() as stack:
        for spec in sweep_file.workloads:
            run = stack.enter_context(runs[spec.name].locked())
            if run.exists():
                differences = run.read_settings().differences(spec.settings)
                if differences:
                    raise ConfigError(f"--resume: {run.path} was started with other settings "
                                      f"({'; '.join(differences)}): restore {sweep_file.path} as it was")
            else:
                run.write_settings(spec.settings)
        # what produced these run directories
        write_atomic(out / "sweep.yaml", read_bytes(sweep_file.path, "the sweep file"))
        jobs, reasons, sweeps, trackers = [], {}, {}, {}
        for spec in sweep_file.workloads:
            run = runs[spec.name]
            sweep = Sweep.open(run, spec.settings, spec.space)
            sweeps[spec.name] = sweep
            progress = ray_driver.LabelledProgress(spec.name, spec.budget.trials, console)
            sweep.tracker = trackers[spec.name] = stack.enter_context(
                tracked(mlflow, run, spec.settings, sweep.results, progress.message, name=f"{out.name}/{spec.name}"))
            if sweep.nothing_fits(spec.space):
                reasons[spec.name] = StopReason.NOTHING_FITS
                progress.message("no config of the space is predicted to fit: nothing runs for this workload")
                continue
            resources = ray_driver.trial_resources(spec.settings, spec.gpus_per_trial)
            backend = ray_driver.BackendSpec(spec.settings, str(run.path.resolve()),
                                             simulated_sleep_s(spec.settings.backend))
            jobs.append(ray_driver.Job(spec.name, sweep, spec.budget, resources, backend, progress))
        if jobs:
            ray_driver.connect(address)
            try:
                console.print(f"Ray cluster {address}: {ray_driver.describe_cluster()}; {len(jobs)} workloads "
                              f"at once" + (f", at most {concurrency} trials in flight" if concurrency else ""),
                              highlight=False)
                reasons.update(ray_driver.run_ray(jobs, concurrency))
            finally:
                ray_driver.disconnect()
                for job in jobs:
                    if isinstance(job.progress, ray_driver.LabelledProgress):
                        job.progress.close()  # the last batch of pruned configs
        rows = {}
        for spec in sweep_file.workloads:
            outputs = close_sweep(runs[spec.name], spec.settings, sweeps[spec.name])
            trackers[spec.name].finish(outputs.best, outputs.summary, outputs.files, outputs.verdict,
                                       str(reasons[spec.name]))
            rows[spec.name] = summary_row(spec, runs[spec.name], out, outputs, reasons[spec.name])
        write_summary(out, list(rows.values()))
    return rows


def summary_row(spec: WorkloadSpec, run: RunDir, out: Path, outputs, reason: "StopReason") -> dict:

    w, best = spec.settings.workload, outputs.best
    return {
        "workload": spec.name, "model": w.model.name, "gpus": w.gpus, "global_batch": w.global_batch,
        "hardware": spec.settings.hardware.name, "memory_budget": format_size(spec.settings.memory_budget_bytes),
        "strategy": spec.settings.strategy, "backend": spec.settings.backend,
        "trials": outputs.summary["trials"],
        "recommended": best.config.label() if best else "",
        "config_json": best.config.to_json() if best else "",
        "throughput_samples_per_s": round(best.throughput_samples_per_s, 3) if best else "",
        "peak_memory": format_size(best.peak_memory_bytes) if best and best.peak_memory_bytes else "",
        "peak_memory_bytes": best.peak_memory_bytes if best else "",
        "stopped": reason.describe(recorded(run.results())),
        "verdict": outputs.verdict,
        "report": str((run.path / "report.md").relative_to(out)),
    }


CSV_COLUMNS = ("workload", "model", "gpus", "global_batch", "hardware", "memory_budget", "strategy", "backend",
               "trials", "recommended", "throughput_samples_per_s", "peak_memory_bytes", "config_json", "stopped",
               "verdict", "report")


def write_summary(out: Path, rows: list[dict]) -> tuple[Path, Path]:
    md, csv_path = out / SUMMARY_MD, out / SUMMARY_CSV
    lines = ["# Sweep summary", "",
             "| workload | model | gpus | global batch | budget | trials | recommended config | samples/s | "
             "peak memory | stopped | report |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['model']} | {r['gpus']} | {r['global_batch']} | {r['memory_budget']} | "
                     f"{r['trials']} | {r['recommended'] or 'none: ' + r['verdict']} | {r['throughput_samples_per_s']} | "
                     f"{r['peak_memory']} | {r['stopped']} | [report]({r['report']}) |")
    lines.append("")
    write_atomic(md, "\n".join(lines))
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(csv_path, table.getvalue())
    return md, csv_path
