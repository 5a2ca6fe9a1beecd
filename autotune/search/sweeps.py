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
Workload keys: name, model, script, script_args, gpus, global_batch, hardware, memory_budget, space, strategy,
trials, time_budget, stop_when (the convergence stop, as --stop-when), backend, surface (replay), seed,
gpus_per_trial. Every error names the file, the key, the value and what is allowed.

A workload may tune the user's own training script instead of a model, as `autotune tune --script` does:

```yaml
  - name: my-script
    script: train.py      # relative to this file's folder
    script_args: [--deepspeed_config, /data/ds_config.json, --epochs, "1"]  # passed as given, as --script-args
    global_batch: 64      # optional: the recipe's override (default: the script's own)
```
Its first trial (on the cluster) shows the model and the script's global batch, then the search runs within the
batch; the recommendation is the script's own DeepSpeed config with the tuned keys. Its trials are real runs:
backend deepspeed (the default for a script); model and surface are not allowed with it.

Each workload becomes the TuneSpec `autotune tune` would build (WorkloadSpec.tune) and runs through the one
sweep runner's phases (autotune.api: plan_run, hold, open_sweep, close_run); only its trials
differ: every workload's are jobs of one Ray driver (drivers/ray.run_ray).
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autotune.values.config import ConfigError
from autotune.files import exists, is_file, load_yaml, read_bytes, short, write_atomic
from autotune.values.argtypes import duration, positive_int, seed, size, stop_probability
from autotune.search.convergence import DEFAULT_STOP_WHEN, recorded
from autotune.backends.factory import backend_kind, backend_names
from autotune.api import Resolved, TuneSpec, resolve
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

WORKLOAD_KEYS = ("name", "model", "script", "script_args", "gpus", "global_batch", "hardware", "memory_budget", "space",
                 "strategy", "trials", "time_budget", "stop_when", "backend", "surface", "seed", "gpus_per_trial")
TOP_KEYS = ("defaults", "workloads", "concurrency")
DEFAULT_TRIALS = 20
DEFAULT_STRATEGY = "optuna"  # many workloads at once: Optuna keeps several trials of each in flight
SUMMARY_MD = "sweep_summary.md"
SUMMARY_CSV = "sweep_summary.csv"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")  # a directory name, short enough for any file system


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload of a sweep file, resolved: the TuneSpec `autotune tune` would build for it, its run
    settings, space and budget (a script's settings until its first trial has shown the model)."""

    name: str
    settings: RunSettings
    space: Space
    budget: Budget
    gpus_per_trial: int | None = None
    chosen_budget: int | None = None  # memory_budget as the file gives it (None: the hardware's, its default)
    tune: TuneSpec | None = None  # what the one sweep runner (autotune.api) runs for it


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
    script = entry.get("script")
    model = entry.get("model", "tiny" if script is None else None)
    strategy = entry.get("strategy", DEFAULT_STRATEGY)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ConfigError(f"{where}.strategy: {short(strategy)}: allowed {', '.join(STRATEGIES)}")
    if script is not None:
        script_path, script_args = _script(entry, where, base)
        backend = entry.get("backend", "deepspeed")
        if backend != "deepspeed":
            raise ConfigError(f"{where}.backend: {short(backend)}: a script's trials are real runs: allowed deepspeed "
                              "(or no backend key)")
    else:
        if entry.get("script_args") is not None:
            raise ConfigError(f"{where}.script_args: {short(entry['script_args'])}: only with script (allowed: a "
                              "workload that names a script)")
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
        elif entry.get("surface") is not None:
            raise ConfigError(f"surface is only for backend replay (got backend {backend})")
        if script is not None:
            # `autotune tune --script`'s spec: the first trial shows the model (global_batch: the recipe's override)
            tune = TuneSpec.for_script(script_path, script_args, gpus=gpus or 1, global_batch=global_batch,
                                       hardware=hardware, memory_budget_bytes=memory_budget, strategy=strategy,
                                       space=space_name, seed=seed_value)
        else:
            if backend != "replay":
                workload = _model_workload(model, global_batch, gpus or 1, where, base)
            tune = TuneSpec(workload, hardware, memory_budget_bytes=memory_budget, strategy=strategy,
                            backend=backend, space=space_name, seed=seed_value, surface=surface)
        # The library's own defaults (autotune.api.resolve). Real trials default to this machine's devices;
        # whether they can run is checked by run_sweep, which knows whether this machine or a cluster runs them.
        settings, space = resolve(tune)
    except ConfigError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(str(where)) else f"{where}: {message}") from None
    trials = parse("trials", positive_int, "a positive integer") or DEFAULT_TRIALS
    time_budget = parse("time_budget", duration, "a duration such as 8h, 90m, 45s")
    gpus_per_trial = parse("gpus_per_trial", positive_int, "a positive integer")
    stop_when = parse("stop_when", stop_probability, "a probability from 0 to 1; 0: off")
    tune = replace(tune, trials=trials, time_budget_s=time_budget,
                   stop_when=DEFAULT_STOP_WHEN if stop_when is None else stop_when)
    return WorkloadSpec(name, settings, space, tune.budget(), gpus_per_trial, memory_budget, tune)


def _script(entry: dict[str, Any], where: str, base: Path) -> tuple[str, tuple[str, ...]]:
    """`script:` (a Python file, relative to the sweep file's folder) and `script_args:` (a list of strings) of
    a workload that tunes the user's script, as `autotune tune --script FILE --script-args ARGS`."""
    script, args = entry["script"], entry.get("script_args")
    if entry.get("model") is not None:
        raise ConfigError(f"{where}.model: {short(entry['model'])}: a workload tunes a model or a script, not both "
                          "(allowed: one of model, script)")
    if not isinstance(script, str) or not script.strip():
        raise ConfigError(f"{where}.script: {short(script)}: allowed a Python script's path, relative to the sweep "
                          "file's folder")
    path = base / script
    if not is_file(path):
        raise ConfigError(f"{where}.script: {short(script)}: no such file {str(path)!r} (allowed a Python script's "
                          "path, relative to the sweep file's folder)")
    if args is None:
        args = []
    if not isinstance(args, list) or any(isinstance(a, (bool, dict, list)) or a is None for a in args):
        raise ConfigError(f"{where}.script_args: {short(args)}: allowed a list of strings (the script's arguments, "
                          "as --script-args splits them)")
    return str(path), tuple(str(a) for a in args)


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
    workload is a parent run of its trials (autotune.outputs.tracking), or None.

    Each workload goes through the phases of the one sweep runner (autotune.api: plan_run, hold, open_sweep,
    close_run) that `autotune tune` runs; only the trials differ: every workload's are jobs of
    one Ray driver (drivers/ray.run_ray), which shares the cluster fairly among them."""
    from rich.console import Console

    from autotune.api import close_run, hold, open_sweep, plan_run
    from autotune.drivers import ray as ray_driver
    from autotune.trials import cluster
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = console or Console(width=160)
    if address == cluster.LOCAL:  # this machine runs the real trials: refuse what it cannot run, up front
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
    progress = {spec.name: ray_driver.LabelledProgress(spec.name, spec.budget.trials, console)
                for spec in sweep_file.workloads}
    plans = []
    for spec in sweep_file.workloads:  # every check of every workload before any is written
        tune = replace(_tune_spec(spec), mlflow_uri=mlflow)
        plans.append(plan_run(tune, runs[spec.name].path, runs[spec.name].exists(),
                              ray_driver.RayOptions(address, concurrency, spec.gpus_per_trial), progress[spec.name],
                              Resolved(spec.settings, spec.space)))
    with ExitStack() as stack:
        stack.callback(_disconnect)  # a script's first trial may have connected (drivers/ray_script_first)
        for spec, plan in zip(sweep_file.workloads, plans):
            hold(stack, plan, progress[spec.name], resume_hint=f"restore {sweep_file.path} as it was")
        # what produced these run directories
        write_atomic(out / "sweep.yaml", read_bytes(sweep_file.path, "the sweep file"))
        reasons, opened = {}, {}
        for spec, plan in zip(sweep_file.workloads, plans):
            if plan.ended is not None:  # the script cannot be tuned as it is (its first trial said so)
                continue
            sweep, tracker, reason = open_sweep(stack, plan.run_dir, plan.settings, plan.space, progress[spec.name],
                                                plan.tracking, name=f"{out.name}/{spec.name}")
            opened[spec.name] = sweep, tracker
            if reason is not None:
                reasons[spec.name] = reason
                progress[spec.name].message("no config of the space is predicted to fit: nothing runs for this workload")
        jobs = [spec for spec in sweep_file.workloads if spec.name in opened and spec.name not in reasons]
        if jobs:
            cluster.connect(address)
            try:
                console.print(f"Ray cluster {address}: {ray_driver.describe_cluster()}; {len(jobs)} workloads "
                              f"at once" + (f", at most {concurrency} trials in flight" if concurrency else ""),
                              highlight=False)
                by_name = {spec.name: plan for spec, plan in zip(sweep_file.workloads, plans)}
                reasons.update(ray_driver.run_ray(
                    [ray_driver.job_for(spec.name, opened[spec.name][0], by_name[spec.name].settings,
                                        by_name[spec.name].run_dir, spec.budget,
                                        ray_driver.trial_resources(by_name[spec.name].settings, spec.gpus_per_trial),
                                        progress[spec.name]) for spec in jobs], concurrency))
            finally:
                cluster.disconnect()
                for spec in jobs:
                    progress[spec.name].close()  # the last batch of pruned configs
        rows = {}
        for spec, plan in zip(sweep_file.workloads, plans):
            if plan.ended is not None:
                result = plan.ended
            else:
                sweep, tracker = opened[spec.name]
                result = close_run(plan.run_dir, plan.settings, sweep, tracker, reasons[spec.name], progress[spec.name])
            rows[spec.name] = summary_row(spec, plan.run_dir, out, result, result.stop_reason, plan.settings)
        write_summary(out, list(rows.values()))
    return rows


def _disconnect() -> None:
    if "ray" in sys.modules:  # connected only if imported
        from autotune.trials.cluster import disconnect

        disconnect()


def _tune_spec(spec: WorkloadSpec) -> TuneSpec:
    """The workload's TuneSpec (a WorkloadSpec built by hand, without one: from its settings)."""
    if spec.tune is not None:
        return spec.tune
    s, b = spec.settings, spec.budget
    return TuneSpec(s.workload, s.hardware, memory_budget_bytes=s.memory_budget_bytes, strategy=s.strategy,
                    trials=b.trials, time_budget_s=b.time_s, backend=s.backend, space=s.choices, seed=s.seed,
                    surface=s.surface, confirm=b.confirm, stop_when=b.stop_when)


def summary_row(spec: WorkloadSpec, run: RunDir, out: Path, outputs, reason: "StopReason",
                settings: RunSettings | None = None) -> dict:
    """One workload's row of the summary (`settings`: the sweep's, a script's as its first trial learned)."""
    settings = settings or spec.settings
    w, best = settings.workload, outputs.best
    return {
        "workload": spec.name, "model": w.model.name, "gpus": w.gpus, "global_batch": w.global_batch,
        "hardware": settings.hardware.name, "memory_budget": format_size(settings.memory_budget_bytes),
        "strategy": settings.strategy, "backend": settings.backend,
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
