"""What `autotune tune --script` and `autotune trial --script` add to the built-in model's flow.

Tune: the model is not known before the script runs, so the first trial (a safe config: no ZeRO sharding
decision forced, the smallest micro-batch, no checkpointing, no offload) runs before the search and
teaches the tuner the model (autotune.script.inspect_model) and the script's global batch
(autotune.script.batch; that trial already runs it): the sweep's workload gets the model's shape and the
script's global batch (never changed unless --global-batch is given, and then the console and report say
the recipe changed), `micro_batch` keeps the values that divide that global batch, the estimator is
calibrated on that first measurement, and `ckpt_interval` keeps only the values the model's own switch can
apply (none without one). A first trial that fails because of the script (it crashes
before `deepspeed.initialize`, never calls it, never steps, ...) ends the sweep at once with that verdict.
The run directory gets `script.json` (the script, its arguments, the model learned, the notes), and the
recommendation `best_ds_config.json` is the script's own config with the tuned keys (optimizer, scheduler
and the rest as the script had them), plus the Trainer flags to pass with it where the script uses the
Hugging Face Trainer.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from autotune.backends.factory import script_backend
from autotune.backends.script import SCRIPT_FILE, Script, read_script_info, user_config
from autotune.values.config import Config, ConfigError
from autotune.values.dsconfig import DsOptions, ds_config
from autotune.prediction.estimate import estimate
from autotune.outputs.handoff import DS_CONFIG, checkpointing_key, validate
from autotune.values.results import TrialResult
from autotune.search.rundir import RunDir
from autotune.values.settings import RunSettings
from autotune.script import accelerate_loop, batch, lightning_loop, merge
from autotune.script.inspect_model import describe, shape_from_info
from autotune.values.space import Space
from autotune.values.units import format_size
from autotune.values.workload import PRESETS, Workload

DEFAULT_GLOBAL_BATCH = 16  # only where the script states no batch size and --global-batch is not given


def placeholder(global_batch: int | None, gpus: int) -> Workload:
    """The workload before the script has shown its model: only the batch arithmetic is real, and only when
    --global-batch is given (else the first trial runs the script's own and the workload learns it)."""
    shape = replace(PRESETS["tiny"], name="unknown")
    return Workload(shape, global_batch or DEFAULT_GLOBAL_BATCH, gpus)


def first_config(space: Space) -> Config:
    """The first trial: the space's default config without checkpointing or offload (any model can run it)."""
    plain = [c for c in space if c.ckpt_interval == 0 and c.offload_optimizer == c.offload_param == "none"]
    if not plain:
        raise ConfigError("script mode needs a config without checkpointing and offload in the space (ckpt_interval 0, "
                          "offload none) for its first trial")
    default = space.default()
    return min(plain, key=lambda c: (c.zero_stage != default.zero_stage, c.micro_batch,
                                     c.precision != default.precision))


def learned_workload(model: dict[str, Any], workload: Workload, script: Script) -> Workload:
    shape = shape_from_info(model, model.get("seq_len"), f"{Path(script.path).stem}:{model.get('class', 'model')}")
    return replace(workload, model=shape)


def script_batch_of(model: dict[str, Any] | None) -> batch.ScriptBatch | None:
    """The global batch the script asked for, as the shim recorded it with the model (None: not read)."""
    found = (model or {}).get("batch")
    return batch.ScriptBatch.from_dict(found) if found else None


def with_global_batch(settings: RunSettings, model: dict[str, Any] | None,
                      given: int | None) -> tuple[RunSettings, batch.Settled, list[str]]:
    """The settings with the global batch settled (the script's unless --global-batch) and the micro-batches
    that keep it; the line that says which, and a note for the micro-batches removed."""
    found = script_batch_of(model)
    settled = batch.settle(found, given, DEFAULT_GLOBAL_BATCH)
    workload = replace(settings.workload, global_batch=settled.global_batch)
    choices = settings.choices
    own = found.micro_batch if found is not None and not settled.changed else None
    kept, removed = batch.micro_batches(choices.micro_batch, settled.global_batch, workload.gpus, own)
    notes = [settled.line()]
    if removed:
        notes.append(f"micro_batch: {removed} removed from the space: they do not divide the global batch "
                     f"{settled.global_batch} over {workload.gpus} rank(s)")
    if own is not None and own not in choices.micro_batch:
        notes.append(f"micro_batch: the script's own {own} added to the space")
    return replace(settings, workload=workload, choices=replace(choices, micro_batch=kept)), settled, notes


def narrowed(settings: RunSettings, model: dict[str, Any]) -> tuple[RunSettings, list[str]]:
    """The settings with the learned workload and the checkpointing values the model can apply."""
    choices, notes = settings.choices, []
    wanted = choices.ckpt_interval
    switch = model.get("checkpoint_switch")
    kept = tuple(v for v in wanted if v in ((0, 1) if switch else (0,)))
    if switch and any(v > 1 for v in wanted):
        notes.append(f"ckpt_interval: {model.get('class')}.{switch} checkpoints every layer, so only 0 and 1 are "
                     f"tried (removed: {[v for v in wanted if v > 1]})")
    elif not switch and any(v > 0 for v in wanted):
        notes.append(f"ckpt_interval: {model.get('class')} offers no activation-checkpointing switch "
                     "(gradient_checkpointing_enable), so activation checkpointing was removed from the space")
    if not kept:
        kept = (0,)
    return replace(settings, choices=replace(choices, ckpt_interval=kept)), notes


def first_trial(run_dir: RunDir, settings: RunSettings, space: Space, script: Script,
                timeout_s: float = 600.0, global_batch: int | None = None,
                remote: Callable[[Config, bool], tuple[TrialResult, str | None]] | None = None,
                ) -> tuple[RunSettings, Space, str | None]:
    """Run the first trial, record it, and return the sweep's settings and space for the model and global
    batch it showed (`global_batch`: --global-batch, which overrides the script's), and the script's verdict
    if the script (not the config) failed. `remote(config, keep_script_batch)` runs the trial elsewhere
    (a Ray task: autotune.drivers.ray_script_first) and returns its result and verdict."""
    config = first_config(space)
    print(f"first trial of {script.path}: {config.label()} (shows the tuner the script's model and global batch)",
          flush=True)
    if remote is not None:
        result, fatal = remote(config, global_batch is None)
    else:
        backend = script_backend(script, settings.workload, settings.memory_budget_bytes, settings.hardware,
                                 DsOptions(nvme_path=settings.choices.nvme_path), run_dir.logs_dir, timeout_s,
                                 shape_known=False, keep_script_batch=global_batch is None)
        result, fatal = backend.run(config), backend.fatal
    model = result.script_model
    notes: list[str] = []
    settled: batch.Settled | None = None
    if model:
        settings, settled, notes = with_global_batch(settings, model, global_batch)
    elif fatal is None:  # the sweep goes on, but nothing was learned
        settings, settled, notes = with_global_batch(settings, None, global_batch)
        notes[0] = (f"the first trial ended ({result.status}) before deepspeed.initialize, so the script's global "
                    f"batch is unknown: global batch {settled.global_batch} "
                    f"({'--global-batch' if global_batch else 'the tuner default: pass --global-batch to set it'})")
    if notes:
        print(notes[0], flush=True)
    if model:
        print(f"model: {model.get('class')}, {model['params']:,} parameters; {describe(model)}", flush=True)
        settings = replace(settings, workload=learned_workload(model, settings.workload, script))
        settings, more = narrowed(settings, model)
        notes += more
        if settings.hardware.supports(config.precision):
            est = estimate(config, settings.workload, settings.hardware)
            result = replace(result, extra={**result.extra, "predicted_peak_bytes": est.peak_bytes,
                                            "predicted_throughput_samples_per_s": est.throughput_samples_per_s})
    result = replace(result, extra={**result.extra, "trial": 1}).under_budget(settings.memory_budget_bytes)
    print(f"first trial {result.status}: " + (f"{result.throughput_samples_per_s:.4g} samples/s, peak "
          f"{format_size(result.peak_memory_bytes)}" if result.ok else str(result.error).splitlines()[0]), flush=True)
    run_dir.append(result)
    save(run_dir, script, model, notes, fatal, settled)
    return settings, settings.space(), fatal


def save(run_dir: RunDir, script: Script, model: dict[str, Any] | None, notes: list[str], fatal: str | None,
         settled: batch.Settled | None = None) -> None:
    run_dir.write_json(SCRIPT_FILE, {"script": script.to_dict(), "model": model, "notes": notes, "fatal": fatal,
                                     "global_batch": settled.to_dict() if settled else None})


def load(run_dir: RunDir) -> dict[str, Any]:
    return read_script_info(run_dir.path)


def resumed(run_dir: RunDir, settings: RunSettings, script: Script, global_batch: int | None = None) -> RunSettings:
    """A resumed script sweep: the same script and arguments, and the workload learned the first time (its
    global batch included, unless --global-batch names another: the differences check refuses that)."""
    stored = Script.from_dict(load(run_dir)["script"])
    if (stored.absolute, stored.args) != (script.absolute, script.args):
        raise ConfigError(f"--resume: {run_dir.path} tuned {stored.absolute} {shlex.join(stored.args)!r}, not "
                          f"{script.absolute} {shlex.join(script.args)!r}")
    known = run_dir.read_settings()
    wanted = known.workload.global_batch if global_batch is None else global_batch
    if (known.workload.global_batch, known.workload.gpus) != (wanted, settings.workload.gpus):
        return settings  # the differences check names them
    return replace(settings, workload=known.workload, choices=known.choices)



def recommendation(best: TrialResult, settings: RunSettings) -> tuple[dict[str, Any], list[str]]:
    """The script's own config with the best config's keys, and the Trainer flags that go with it."""
    trial = ds_config(best.config, settings.workload, DsOptions(nvme_path=settings.choices.nvme_path))
    ds = merge.merge(user_config(best) or {}, trial)
    flags = ["--per_device_train_batch_size", str(trial["train_micro_batch_size_per_gpu"]),
             "--gradient_accumulation_steps", str(trial["gradient_accumulation_steps"]),
             "--bf16", str(best.config.precision == "bf16").lower(), "--fp16", str(best.config.precision == "fp16").lower(),
             f"--{checkpointing_key()}", str(best.config.ckpt_interval > 0).lower()]
    return ds, flags


@dataclass(frozen=True)
class ScriptOutputs:
    """Script mode's outputs over the generic ones (autotune.outputs.report.write_outputs writes them, once):
    JSON files by name (the script's own best_ds_config.json, script.json with the recommended flags), the
    report's section, and lines for the console."""

    files: tuple[tuple[str, Any], ...]
    section: tuple[str, ...]
    notes: tuple[str, ...]
    program: tuple[str, ...] = ()  # the script and its arguments with the recommendation in them (launch.sh's)


def outputs(run_dir: RunDir, settings: RunSettings, best: TrialResult | None) -> ScriptOutputs:
    """What a script sweep recommends: the script's own config with the tuned keys, and how to use it."""
    info = load(run_dir)
    files: list[tuple[str, Any]] = []
    lines = list(info.get("notes") or [])
    if info.get("fatal"):
        lines.insert(0, f"the script cannot be tuned as it is: {info['fatal']}")
    if best is not None:
        ds, flags = recommendation(best, settings)
        via = (info.get("model") or {}).get("via")
        loops = {accelerate_loop.VIA: accelerate_loop.recommendation, lightning_loop.VIA: lightning_loop.recommendation}
        if not _has_auto(ds):
            validate(ds, settings.workload.gpus)
        if via in loops:  # the script's own DataLoader: its batch size is the script's to set (after validate:
            # the loop's framework fills some batch keys itself)
            ds, info["recommended_script_flags"], advice = loops[via](ds, info["model"], info["script"]["args"])
        info["recommended_trainer_flags"] = flags
        trainer = (info.get("model") or {}).get("via") == "transformers.TrainingArguments"
        program = with_recommendation(info["script"], str(run_dir.path.resolve() / DS_CONFIG),
                                      flags if trainer else info.get("recommended_script_flags") or [],
                                      add=trainer and "--deepspeed" in info["script"]["args"])
        files += [(DS_CONFIG, ds), (SCRIPT_FILE, info)]
        text = ("best_ds_config.json is the script's own DeepSpeed config with the tuned keys: pass it where the "
                "script takes its config")
        if trainer:
            text += f", with these TrainingArguments (the Trainer checks them against the config): {' '.join(flags)}"
        elif via in loops:
            text += f"; {advice}"
        lines.append(text)
    model = info.get("model") or {}
    section = ["", "## Script mode", "", f"- Script: `{info['script']['path']}` `{shlex.join(info['script']['args'])}`"]
    if model:
        shape = settings.workload.model
        section.append(f"- Model seen at deepspeed.initialize: {model.get('class')}, {model['params'] / 1e6:,.2f}M "
                       f"parameters, {model.get('layers', '?')} layers, hidden {model.get('hidden', '?')}, sequence "
                       f"{model.get('seq_len', '?')} (shape the estimator uses: {shape.layers} layers, hidden "
                       f"{shape.hidden}, MLP {shape.ffn_hidden}, vocab {shape.vocab}); {describe(model)}")
    section += [f"- {line}" for line in lines] + [""]
    return ScriptOutputs(tuple(files), tuple(section), tuple(lines), program if best is not None else ())


# DeepSpeed config keys: a JSON file argument holding one is the script's config
DS_KEYS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "zero_optimization", "optimizer", "fp16", "bf16"})


def with_recommendation(script: dict[str, Any], config_path: str, flags: list[str], add: bool) -> tuple[str, ...]:
    """The script's command line with the recommendation in it: the argument that named the script's DeepSpeed
    config (`_is_ds_config`) names `config_path`; each of `flags` (flag, value pairs) replaces the value the script
    was given, and with `add` is added where it was not given (a Trainer script parsing its TrainingArguments from
    the command line)."""
    args = list(script["args"])
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        before = flag if eq else (args[i - 1] if i else "")
        if value.endswith(".json") and _is_ds_config(value, before):
            args[i] = f"{flag}={config_path}" if eq else config_path
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in args and args.index(flag) + 1 < len(args):
            args[args.index(flag) + 1] = value
        elif any(a.startswith(f"{flag}=") for a in args):
            args = [f"{flag}={value}" if a.startswith(f"{flag}=") else a for a in args]
        elif add:
            args += [flag, value]
    return (script["path"], *args)


def _is_ds_config(path: str, flag: str) -> bool:
    """A file that can be read is one if it holds DeepSpeed's keys (a model's config.json after --config_name is
    not); one that cannot (the command was run from another folder) if its flag names deepspeed or ds_config."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return any(word in flag for word in ("deepspeed", "ds_config"))
    return isinstance(document, dict) and bool(DS_KEYS & set(document))


def _has_auto(ds: dict[str, Any]) -> bool:
    return "auto" in json.dumps(ds)
