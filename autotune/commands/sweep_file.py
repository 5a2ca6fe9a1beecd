"""Sweep files: a YAML file lists workloads, each turned into the TuneSpec `autotune tune` would build for it (beside
the CLI's spec_from, with the same option table: autotune.api.spec_options). `autotune sweep` runs them all through
the one runner (autotune.api.tune_many), at once on a Ray cluster, and writes the summary (autotune.outputs.sweep).

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
Workload keys: name, model, seq_len (tokens per sample, as --seq-len: it replaces the model's), script, script_args,
gpus, global_batch, hardware, gpus_per_trial, and every option of
`autotune tune` under its flag's name (api.spec_options: memory_budget, strategy, trials, time_budget, backend,
space, seed, surface, storage, confirm, mlflow_uri, stack, target_gpus, stop_when, train_for, trial_timeout, wandb,
allocator, policy: an exported policy's folder, relative to this file's folder, for strategy rl or hybrid); `space:`
may also be written out, a mapping of knob -> list of values as a search-space YAML holds
(`space: {zero_stage: [1, 2], precision: [bf16]}`). A key whose value is text (a path, a URI, a W&B project) takes a
string only; a count, size or duration a number or its text, as its flag does. Neither model nor script: the model is
tiny, as `autotune tune`'s (WorkloadSpec.notes says so). A workload's own `script:` replaces the defaults' `model:`
and `seq_len:`, and its own `model:` the defaults' `script:` and `script_args:` (REPLACES); both in one workload is an
error.
`concurrency:` (top level): trials in flight at most, over all workloads. Every error names the file, the key
(`defaults.<key>` for a value the workload takes from defaults), the value and what is allowed. A model the built-in
trial model does not build (a mixture of experts, multi-head latent attention) is refused with backend deepspeed,
before anything runs.

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
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autotune.api import BUILT_IN_TRAINER, Plan, Resolved, TuneSpec, refuse_untrained, resolution, spec_options
from autotune.backends.replay import replay_workload
from autotune.commands.tune import DEFAULT_MODEL
from autotune.files import exists, is_file, load_yaml, short
from autotune.outputs.sweep import OWN_NAMES
from autotune.search.rundir import SWEEP_COPY, RunDir
from autotune.search_spaces import PRESETS as SPACE_PRESETS, load_choices
from autotune.trials.devices import AUTO
from autotune.values.argtypes import positive_int
from autotune.values.config import ConfigError
from autotune.values.hardware import Hardware, load_hardware
from autotune.values.models import SHAPE_KEYS, UnknownModel
from autotune.values.space import Choices, parse_choices
from autotune.values.workload import PRESETS, ModelShape, Workload, make_workload

WORKLOAD_KEYS = ("name", "model", "seq_len", "script", "script_args", "gpus", "global_batch", "hardware", "gpus_per_trial",
                 *(opt.key for _, opt, _ in spec_options()))
TOP_KEYS = ("defaults", "workloads", "concurrency")
# A sweep's own defaults where they differ from `autotune tune`'s: many workloads at once, simulated unless asked
# (Optuna keeps several trials of each in flight).
SWEEP_DEFAULTS = {"trials": 20, "strategy": "optuna", "backend": "simulated"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")  # a directory name, short enough for any file system


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload of a sweep file: the TuneSpec `autotune tune` would build for it, resolved as the runner will
    (its settings and space: a script's until its first trial has shown the model)."""

    name: str
    tune: TuneSpec
    resolved: Resolved
    gpus_per_trial: int | None = None
    notes: tuple[str, ...] = ()  # what the console says of it first (a model it took by default)

    @property
    def settings(self):  # noqa: ANN201  (RunSettings; read by the sweep command's checks and the tests)
        return self.resolved.settings

    @property
    def space(self):  # noqa: ANN201
        return self.resolved.space

    @property
    def budget(self):  # noqa: ANN201
        return self.tune.budget()

    @property
    def chosen_budget(self) -> int | None:
        """memory_budget as the file gives it (None: the hardware's, its default)."""
        return self.tune.memory_budget_bytes

    def plan(self, out: Path, mlflow: str | None, wandb: str | None = None) -> Plan:
        """Its run in the sweep directory `out`: <out>/<name>, resumed if it holds one; `mlflow` and `wandb` (the
        command's --mlflow/--mlflow-uri and --wandb) in place of the workload's own mlflow_uri and wandb."""
        run_dir = out / self.name
        tune = self.tune if mlflow is None else replace(self.tune, mlflow_uri=mlflow)
        tune = tune if wandb is None else replace(tune, wandb=wandb)
        return Plan(tune, run_dir, resume=RunDir(run_dir).exists(), name=self.name,
                    resolved=self.resolved, gpus_per_trial=self.gpus_per_trial,
                    tracking_name=f"{out.name}/{self.name}")


@dataclass(frozen=True)
class SweepFile:
    path: Path
    workloads: tuple[WorkloadSpec, ...]
    concurrency: int | None = None


def load_sweep(path: str | Path) -> SweepFile:
    path = Path(path)
    if not is_file(path):
        if os.path.isdir(path):
            raise ConfigError(f"sweep file {str(path)!r}: a directory: allowed a sweep YAML file")
        if exists(path):
            raise ConfigError(f"sweep file {str(path)!r}: not a regular file: allowed a sweep YAML file")
        raise ConfigError(f"sweep file {str(path)!r}: no such file")
    data = load_yaml(path, f"a sweep file (YAML with {', '.join(TOP_KEYS)})")
    if data is None:  # nothing but blanks and comments: YAML's null, not a wrong type
        raise ConfigError(f"{path}: the file is empty: expected a mapping with keys {', '.join(TOP_KEYS)} "
                          "(see examples/sweep.yaml)")
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
    specs: list[WorkloadSpec] = []
    names: dict[str, str] = {}  # a name without case -> as first given: one run directory on any file system
    for i, entry in enumerate(entries):
        where = f"{path}: workloads[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(WORKLOAD_KEYS)}, got {short(entry)}")
        _check_keys(entry, WORKLOAD_KEYS, where)
        taken = _taken(defaults, entry)
        spec = _workload({**taken, **entry}, _Where(where, f"{path}: defaults", frozenset(taken) - set(entry)),
                         path.parent)
        first = names.get(spec.name.casefold())
        if first == spec.name:
            raise ConfigError(f"{where}.name: {spec.name!r} is used twice: names must be unique (one run directory each)")
        if first is not None:
            raise ConfigError(f"{where}.name: {spec.name!r}: the same as {first!r} but for case, one folder on a "
                              "case-insensitive file system: allowed names that differ in more than case")
        names[spec.name.casefold()] = spec.name
        specs.append(spec)
    concurrency = data.get("concurrency")
    if concurrency is not None and (not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1):
        raise ConfigError(f"{path}: concurrency: {short(concurrency)}: allowed a positive integer")
    return SweepFile(path, tuple(specs), concurrency)


def kept_names(folder: Path) -> tuple[str, ...] | None:
    """The workload names of the sweep file a sweep directory keeps (its copy, SWEEP_COPY), read as written: nothing
    resolved (its relative paths were the original file's folder's). None where it keeps none; a copy that names no
    workloads is a ConfigError naming it (the folder's sweep cannot be told)."""
    path = folder / SWEEP_COPY
    if not os.path.lexists(path):
        return None
    data = load_yaml(path, "the sweep file kept by its sweep directory")
    entries = data.get("workloads") if isinstance(data, dict) else None
    names = [e.get("name") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    if not names or not all(isinstance(name, str) for name in names):
        raise ConfigError(f"{path}: names no workloads: not the copy of a sweep file that `autotune sweep` keeps, so "
                          f"which sweep {folder} holds is unknown: choose another --out")
    return tuple(str(name) for name in names)


# A workload tunes a model or a script: its own one replaces the other that defaults give, as its own keys replace
# the defaults' (a script's arguments go with the script).
REPLACES = {"script": ("model", "seq_len"), "model": ("script", "script_args")}


def _taken(defaults: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """The defaults a workload takes: all but those its own keys replace (REPLACES)."""
    replaced = {key for own in entry for key in REPLACES.get(own, ())}
    return {key: value for key, value in defaults.items() if key not in replaced}


@dataclass(frozen=True)
class _Where:
    """A workload's place in its sweep file (`<file>: workloads[i]`, what str() gives). A bad value is named where it
    is set (`at`): the workload's own entry, or the file's defaults for a key it takes from them
    (`<file>: defaults.memory_budget`); a workload's keys that do not go together are named as the workload's."""

    entry: str
    defaults: str = ""
    inherited: frozenset[str] = frozenset()  # the keys the workload takes from defaults

    def __str__(self) -> str:
        return self.entry

    def at(self, key: str) -> str:
        return f"{self.defaults if key in self.inherited else self.entry}.{key}"

    def names(self, message: str) -> bool:
        """Whether an error already says where it is (else it is prefixed with the workload's place)."""
        return message.startswith(self.entry) or bool(self.defaults) and message.startswith(self.defaults)


def _check_keys(data: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}: allowed {', '.join(allowed)}")


def _options(entry: dict[str, Any], where: _Where, base: Path) -> dict[str, Any]:
    """TuneSpec's options as the entry gives them (parsed as `autotune tune` parses its flags), else the sweep's
    defaults where they differ from tune's."""
    values: dict[str, Any] = {}
    for name, opt, _ in spec_options():
        raw = entry.get(opt.key, SWEEP_DEFAULTS.get(opt.key))
        if raw is None:
            continue
        if opt.key == "space" and not isinstance(raw, str):
            values[name] = _inline_space(raw, where.at(opt.key))
            continue
        if (opt.path or opt.parse is str) and opt.choices is None and not isinstance(raw, str):
            # text taken as given (a path, a URI, a project): anything but a string is a mistake, never its str()
            raise ConfigError(f"{where.at(opt.key)}: {short(raw)}: allowed {TEXT_KEYS.get(opt.key, 'a string')}")
        try:
            if opt.key == "space":  # a preset or a search-space YAML: refused here, naming the key, when neither
                values[name] = raw if raw in SPACE_PRESETS else _folder(raw, base)
                if raw not in SPACE_PRESETS and not is_file(Path(values[name])):
                    raise ConfigError(f"{short(raw)}: no such file (nor {(base / raw).resolve()}): {ALLOWED_SPACE}")
                load_choices(values[name])
                continue
            if opt.key == "policy":  # a folder, never a preset's name: relative to this file's folder if there
                values[name] = _folder(raw, base)
                if not exists(Path(values[name])):
                    raise ConfigError(f"{short(raw)}: no such folder (nor {(base / str(raw)).resolve()}): allowed an exported "
                                      "policy's folder (`autotune rl export --out`), relative to the sweep file's folder")
            else:
                values[name] = _path_or_name(raw, base) if opt.path else opt.value(raw)
        except ConfigError as err:
            raise ConfigError(f"{where.at(opt.key)}: {err}") from None
    return values


def _workload(entry: dict[str, Any], where: _Where, base: Path) -> WorkloadSpec:
    """Resolve one workload entry with the same parsers, defaults and checks as `autotune tune`."""
    def parse(key: str, parser, allowed: str):
        value = entry.get(key)
        if value is None:
            return None
        try:
            return parser(str(value))
        except (argparse.ArgumentTypeError, ConfigError, ValueError, OverflowError) as err:
            raise ConfigError(f"{where.at(key)}: {short(value)}: {err} (allowed {allowed})") from None

    name = entry.get("name")
    if name is None:
        raise ConfigError(f"{where}: no name: each workload needs one, its run directory's (<out>/<name>): letters, "
                          "digits, '.', '_' and '-', at most 100")
    if not isinstance(name, str):
        raise ConfigError(f"{where}.name: {short(name)}: allowed a name (a string of letters, digits, '.', '_' and "
                          "'-', at most 100: its run directory's)")
    if not _NAME.match(name):
        raise ConfigError(f"{where}.name: {short(name)}: allowed letters, digits, '.', '_' and '-', at most 100 (a directory name)")
    if name.casefold() in {own.casefold() for own in OWN_NAMES}:
        raise ConfigError(f"{where}.name: {short(name)}: the sweep directory's own file or folder: allowed any name "
                          f"but {', '.join(OWN_NAMES)}")
    script = entry.get("script")
    model = entry.get("model")
    notes: tuple[str, ...] = ()
    if model is None and script is None and entry.get("backend") != "replay":  # as `autotune tune` without --model
        model, notes = DEFAULT_MODEL, (f"model: {DEFAULT_MODEL} (the default; model: or script: to choose)",)
    if script is not None:
        script_path, script_args = _script(entry, where, base)
        if entry.get("backend", "deepspeed") != "deepspeed":
            raise ConfigError(f"{where.at('backend')}: {short(entry['backend'])}: a script's trials are real runs: "
                              "allowed deepspeed (or no backend key)")
        entry = {**entry, "backend": "deepspeed"}
    elif entry.get("script_args") is not None:
        raise ConfigError(f"{where.at('script_args')}: {short(entry['script_args'])}: only with script (allowed: a "
                          "workload that names a script)")
    options = _options(entry, where, base)
    backend = options["backend"]
    seq_len = parse("seq_len", positive_int, "a positive integer: tokens per sample, as --seq-len")
    if seq_len is not None and script is not None:
        raise ConfigError(f"{where.at('seq_len')}: {seq_len}: a script brings its model and its sequence length "
                          "(allowed: seq_len with model)")
    gpus = parse("gpus", positive_int, "a positive integer")
    global_batch = parse("global_batch", positive_int, "a positive integer")
    gpus_per_trial = parse("gpus_per_trial", positive_int, "a positive integer")
    hardware: Hardware | str | None = None
    if entry.get("hardware") == AUTO:
        hardware = AUTO
    elif entry.get("hardware") is not None:
        if not isinstance(entry["hardware"], str):
            raise ConfigError(f"{where.at('hardware')}: {short(entry['hardware'])}: allowed {TEXT_KEYS['hardware']}")
        try:
            hardware = load_hardware(_path_or_name(entry["hardware"], base))
        except ConfigError as err:
            raise ConfigError(f"{where.at('hardware')}: {err}") from None
    try:
        if backend == "replay":
            if options.get("surface") is None:
                raise ConfigError("backend replay needs a surface (a JSONL of measured results)")
            workload = replay_workload(options["surface"], model if isinstance(model, str) else None, global_batch, gpus,
                                       seq_len)
        elif options.get("surface") is not None:
            raise ConfigError(f"surface is only for backend replay (got backend {backend})")
        if script is not None:
            # `autotune tune --script`'s spec: the first trial shows the model (global_batch: the recipe's override)
            tune = TuneSpec.for_script(script_path, script_args, gpus=gpus or 1, global_batch=global_batch,
                                       hardware=hardware, **options)
        else:
            if backend != "replay":
                workload = _model_workload(model, global_batch, gpus or 1, where.at("model"), base, seq_len)
                if backend == BUILT_IN_TRAINER:  # before any trial launches (the worker would find it unsupported)
                    refuse_untrained(workload.model, f"{where}.model: {short(model)}",
                                     "allowed with backend simulated, or script: your own training script in "
                                     "place of model")
            tune = TuneSpec(workload, hardware, **options)
        # The library's own defaults (autotune.api.resolve). Real trials default to this machine's devices;
        # whether they can run is checked by `autotune sweep`, which knows whether this machine or a cluster runs them.
        resolved = resolution(tune)
    except ConfigError as err:
        message = str(err)
        raise ConfigError(message if where.names(message) else f"{where}: {message}") from None
    return WorkloadSpec(name, tune, resolved, gpus_per_trial, notes)


def _script(entry: dict[str, Any], where: _Where, base: Path) -> tuple[str, tuple[str, ...]]:
    """`script:` (a Python file, relative to the sweep file's folder) and `script_args:` (a list of strings) of
    a workload that tunes the user's script, as `autotune tune --script FILE --script-args ARGS`."""
    script, args = entry["script"], entry.get("script_args")
    if entry.get("model") is not None:  # both the workload's own, or both the defaults' (REPLACES)
        raise ConfigError(f"{where.at('model')}: {short(entry['model'])}: a workload tunes a model or a script, not "
                          "both (allowed: one of model, script)")
    if not isinstance(script, str) or not script.strip():
        raise ConfigError(f"{where.at('script')}: {short(script)}: allowed a Python script's path, relative to the "
                          "sweep file's folder")
    path = base / script
    if not is_file(path):
        raise ConfigError(f"{where.at('script')}: {short(script)}: no such file {str(path)!r} (allowed a Python "
                          "script's path, relative to the sweep file's folder)")
    if args is None:
        args = []
    if not isinstance(args, list) or any(isinstance(a, (bool, dict, list)) or a is None for a in args):
        raise ConfigError(f"{where.at('script_args')}: {short(args)}: allowed a list of strings (the script's "
                          "arguments, as --script-args splits them)")
    return str(path), tuple(str(a) for a in args)


def _model_workload(model: Any, global_batch: int | None, gpus: int, key: str,
                    base: Path | None = None, seq_len: int | None = None) -> Workload:
    """`model:` as a preset, a Hugging Face config.json or model directory (relative to the sweep file's
    folder), a cached Hub id, a YAML/JSON shape file (autotune.values.models), or a mapping of shape keys; `key`
    names it in errors (`<file>: workloads[0].model`); `seq_len` (the workload's own key) replaces the model's."""
    if isinstance(model, str):
        local = base / model if base is not None and model not in PRESETS else None
        try:
            return make_workload(str(local) if local is not None and exists(local) else model, global_batch, gpus,
                                 seq_len)
        except UnknownModel:
            raise ConfigError(f"{key}: {short(model)}: {ALLOWED_MODELS}") from None
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
        except (OSError, ValueError) as err:  # a name the filesystem refuses to look up (too long)
            raise ConfigError(f"{key}: {short(model)}: {err.strerror if isinstance(err, OSError) else err}; "
                              f"{ALLOWED_MODELS}") from None
    if isinstance(model, dict):
        shape = {"name": "custom", **model}
        unknown = [key for key in shape if key not in SHAPE_KEYS and key != "name"]
        if unknown:
            raise ConfigError(f"{key}: {short(model)}: unknown key {short(unknown[0])}; allowed keys "
                              f"{', '.join(SHAPE_KEYS)}")
        try:
            return make_workload(ModelShape(**shape), global_batch or 32 * gpus, gpus, seq_len)
        except TypeError as err:
            raise ConfigError(f"{key}: {short(model)}: {err}; allowed keys "
                              f"{', '.join(SHAPE_KEYS)}") from None
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None
    raise ConfigError(f"{key}: {short(model)}: {ALLOWED_MODELS}")


ALLOWED_MODELS = (f"allowed {', '.join(PRESETS)}, a Hugging Face config.json or model directory, a Hub id in the local "
                  "Hugging Face cache, a YAML/JSON shape file, or a mapping of shape keys")


ALLOWED_SPACE = (f"allowed a preset name ({', '.join(SPACE_PRESETS)}), a search-space YAML path (relative to the "
                 "sweep file's folder), or a mapping of knob -> list of values")
# What a key whose value is text (a path, a URI, a name) allows: anything but a string is refused with this.
TEXT_KEYS = {
    "wandb": "a W&B project name (a string)",
    "mlflow_uri": "an MLflow tracking URI (a string: sqlite:///PATH, http://SERVER:5000, postgresql://...)",
    "storage": "an Optuna storage (a string: an RDB URL such as sqlite:///PATH, or a journal file's path)",
    "surface": "a replay surface's path (a string: a JSONL file, relative to the sweep file's folder)",
    "policy": "an exported policy's folder (a string: `autotune rl export --out`, relative to the sweep file's folder)",
    "hardware": "a hardware profile's name, auto, or a hardware YAML's path (a string, relative to the sweep file's "
                "folder)",
}


def _inline_space(value: Any, key: str) -> Choices:
    """`space:` written out in the sweep file, a mapping of knob -> list of values as a search-space YAML holds
    (autotune.values.space.parse_choices), its first bad value named; anything else that is not a preset name or a
    path is refused naming what is allowed."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {short(value)}: {ALLOWED_SPACE}")
    return parse_choices(value, key)


def _folder(value: Any, base: Path) -> str:
    """A path (an exported policy's folder, a file): relative to the sweep file's folder where it is there, else as
    given (the library's check names it)."""
    text = str(value)
    candidate = base / text
    return str(candidate) if exists(candidate) else text


def _path_or_name(value: Any, base: Path) -> str:
    """A preset name as is; a relative file path relative to the sweep file's folder."""
    text = str(value)
    return _folder(text, base) if "/" in text or text.endswith((".yaml", ".yml", ".jsonl")) else text
