"""What `autotune tune --script` and `autotune trial --script` add to the built-in model's flow.

Tune: the model is not known before the script runs, so the first trial (a safe config: no ZeRO sharding
decision forced, the smallest micro-batch, no checkpointing, no offload) runs before the search and
teaches the tuner the model (autotune.script.inspect_model) and the script's global batch
(autotune.script.batch; that trial already runs it): the sweep's workload gets the model's shape and the
script's global batch (never changed unless --global-batch is given, and then the console and report say
the recipe changed), `micro_batch` keeps the values that divide that global batch, the estimator is
calibrated on that first measurement, and `ckpt_interval` keeps only the values the model's own switch can
apply (none without one). A first trial that fails because of the script (it crashes
before `deepspeed.initialize`, never calls it, never steps, runs out of time before it, ...) ends the sweep at
once with that verdict, which the report puts first; such a sweep learned no model, so its resume runs no trial.
The run directory gets `script.json` (the script, its arguments, the model learned, the notes), and the
recommendation `best_ds_config.json` is the script's own config with the tuned keys (optimizer, scheduler
and the rest as the script had them), plus the Trainer flags to pass with it where the script uses the
Hugging Face Trainer. launch.sh runs the script's command with the file in place of the config it names; a
script that builds its config in code is run through autotune.script.apply (the trials' merge at
deepspeed.initialize), and where that cannot apply (the Trainer, a loop's framework) the outputs say that the
command does not carry the recommendation and which keys to put into the script's config.
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
from autotune.values.results import TrialResult, error_line
from autotune.worker.protocol import read_events
from autotune.search.rundir import RunDir
from autotune.values.settings import RunSettings
from autotune.script import accelerate_loop, alike, apply, batch, lightning_loop, merge
from autotune.script.inspect_model import describe, shape_from_info
from autotune.values.space import Space
from autotune.values.units import format_size
from autotune.values.workload import PRESETS, Workload

DEFAULT_GLOBAL_BATCH = 16  # only where the script states no batch size and --global-batch is not given
DEFAULT_TIMEOUT_S = 600.0  # a trial's limit without --trial-timeout (the backend's default)
# The first trial's verdict where it ran out of time in the script before deepspeed.initialize: what comes before
# it is the same whatever the config, so every trial would (the shim's own verdicts: autotune.script.shim.VERDICTS).
TIMED_OUT = "timed_out_before_initialize"
RUNNING_SCRIPT = "script"  # the shim's phase from the script's start to deepspeed.initialize (autotune.script.shim)
INITIALIZING = "initialize"  # the shim's phase inside deepspeed.initialize


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
    # The script's own micro-batch joins the space; none where its keys disagree (the split is the tuner's)
    own = found.micro_batch if found is not None and not settled.changed and not found.conflict else None
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
    precision, more = script_precision(choices.precision, model)
    return replace(settings, choices=replace(choices, ckpt_interval=kept, precision=precision)), notes + more


def script_precision(wanted: tuple[str, ...], model: dict[str, Any]) -> tuple[tuple[str, ...], list[str]]:
    """The space's precisions for a script whose framework runs one of its own (an Accelerate loop's
    mixed_precision, a Lightning Trainer's precision: the loop casts its inputs to it, so another precision's model
    fails on them or trains another recipe): that one alone, with a note; the space's own where none is known."""
    own, source = model.get("script_precision"), model.get("script_precision_source") or "the script"
    if not own or wanted == (own,):
        return wanted, []
    if own not in wanted:
        return wanted, [f"precision: the script runs {own} ({source}), which the space ({list(wanted)}) does not "
                        f"hold: its trials may fail or train another recipe; give the space {own}"]
    return (own,), [f"precision: {own} only, the script's own ({source}): its loop feeds the model inputs of that "
                    f"precision (removed: {[p for p in wanted if p != own]})"]


def first_trial(run_dir: RunDir, settings: RunSettings, space: Space, script: Script,
                timeout_s: float | None = None, global_batch: int | None = None,
                remote: Callable[[Config, bool], tuple[TrialResult, str | None]] | None = None,
                say: Callable[[str], None] = lambda line: None) -> tuple[RunSettings, Space, str | None]:
    """Run the first trial, record it, and return the sweep's settings and space for the model and global
    batch it showed (`global_batch`: --global-batch, which overrides the script's), and the script's verdict
    if the script (not the config) failed. `timeout_s`: the trial's limit (--trial-timeout; None: the backend's
    600 s). `remote(config, keep_script_batch)` runs the trial elsewhere (a Ray task:
    autotune.drivers.ray_script_first) and returns its result and verdict. `say` hears the lines for people (the
    sweep's progress callback: nothing is printed here)."""
    config = first_config(space)
    say(f"first trial of {script.path}: {config.label()} (shows the tuner the script's model and global batch)")
    if remote is not None:
        result, fatal = remote(config, global_batch is None)
    else:
        backend = script_backend(script, settings.workload, settings.memory_budget_bytes, settings.hardware,
                                 DsOptions(nvme_path=settings.choices.nvme_path), run_dir.logs_dir,
                                 DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
                                 shape_known=False, keep_script_batch=global_batch is None)
        result, fatal = backend.run(config), backend.fatal
    model = result.script_model
    if fatal is None and not model and result.status == "timeout" and waited_in_script(result):
        fatal = f"{TIMED_OUT}: {result.error}"  # no config changes what comes before deepspeed.initialize
        result = replace(result, extra={**result.extra, "script_verdict": TIMED_OUT})
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
        say(notes[0])
    if model:
        say(f"model: {model.get('class')}, {model['params']:,} parameters; {describe(model)}")
        settings = replace(settings, workload=learned_workload(model, settings.workload, script))
        settings, more = narrowed(settings, model)
        more += precision_unrun(asked_precision(user_config(result), model), settings)
        notes += more
        for line in more:  # before the search: what the space lost and why
            say(line)
        if settings.hardware.supports(config.precision):
            est = estimate(config, settings.workload, settings.hardware)
            result = replace(result, extra={**result.extra, "predicted_peak_bytes": est.peak_bytes,
                                            "predicted_throughput_samples_per_s": est.throughput_samples_per_s})
    number = len(run_dir.results()) + 1  # 1, but for a record that holds trials already
    result = replace(result, extra={**result.extra, "trial": number}).under_budget(settings.memory_budget_bytes)
    say(f"first trial {result.status}: " + (f"{result.throughput_samples_per_s:.4g} samples/s, peak "
        f"{format_size(result.peak_memory_bytes)}" if result.ok else error_line(result.error)))
    run_dir.append(result)
    save(run_dir, script, model, notes, fatal, settled)
    return settings, settings.space(), fatal


def asked_precision(user: dict[str, Any] | None, model: dict[str, Any] | None) -> str | None:
    """The precision the script's own DeepSpeed config `user` asks for: fp16 or bf16 where that block is enabled, fp32
    where neither is (DeepSpeed's default); None where it is not known: no config recorded, a value left to the
    framework ("auto"), a Trainer's config without the blocks (its TrainingArguments decide), or a loop whose framework
    runs a precision of its own (narrowed: `script_precision` says it)."""
    model = model or {}
    if not isinstance(user, dict) or model.get("script_precision"):
        return None
    stated = False
    for name, key in (("fp16", "fp16"), ("bf16", "bf16"), ("bf16", "bfloat16")):
        block = user.get(key)
        if isinstance(block, dict) and "enabled" in block:
            if block["enabled"] == "auto":
                return None
            stated = True
            if block["enabled"] is True:
                return name
    if not stated and model.get("via") == "transformers.TrainingArguments":
        return None
    return "fp32"


def precision_refused(precision: str, settings: RunSettings) -> str | None:
    """Why no trial runs `precision`: the hardware does not (fp16 on the CPU: DeepSpeed refuses it), or the space
    leaves it out; None where trials may run it."""
    hw = settings.hardware
    if not hw.supports(precision):
        return ("DeepSpeed refuses fp16 on the CPU (its CPU accelerator)" if hw.is_cpu and precision == "fp16"
                else f"the {hw.name} profile does not run it")
    if precision not in settings.choices.precision:
        return f"the space's precisions are {list(settings.choices.precision)}"
    return None


def precision_unrun(asked: str | None, settings: RunSettings) -> list[str]:
    """The first trial's note where the script's config asks for a precision no trial will run: its trials and
    recommendation run another, said before the search."""
    why = precision_refused(asked, settings) if asked else None
    if asked is None or why is None:
        return []
    return [f"precision: the script's config asks for {asked}, which no trial runs ({why}): the trials and the "
            f"recommendation run {' or '.join(settings.choices.precision)} instead"]


def precision_changed(asked: str | None, best: TrialResult, settings: RunSettings,
                      results: list[TrialResult]) -> list[str]:
    """The line where the recommendation runs another precision than the script's config asked for, and why."""
    runs = best.config.precision
    if asked is None or asked == runs:
        return []
    why = precision_refused(asked, settings)
    if why is None:
        theirs = [r for r in results if r.config.precision == asked and r.status != "pruned"]
        ok = [r for r in theirs if r.ok and r.throughput_samples_per_s]
        if ok:
            fastest = max(r.throughput_samples_per_s or 0.0 for r in ok)
            why = (f"the fastest {asked} trial measured {fastest:.3g} samples/s, the recommendation "
                   f"{best.throughput_samples_per_s:.3g}")
        elif theirs:
            why = f"no {asked} trial ran within the budget ({', '.join(sorted({r.status for r in theirs}))})"
        else:
            why = f"no {asked} config was tried"
        why += f"; a space of precision [{asked}] keeps the script's"
    return [f"precision: the script's config asks for {asked}; the recommendation runs {runs} ({why})"]


def later_verdict(results: list[TrialResult]) -> str | None:
    """The verdict of a trial after the first that stopped the sweep (the shim's, or a failure of the script's own in
    two configs: autotune.script.alike), as `verdict: why`; None where none did."""
    stopped = next((r for r in reversed(results) if r.extra.get("script_verdict")), None)
    if stopped is None:
        return None
    return f"{stopped.extra['script_verdict']}: {stopped.extra.get(alike.WHY) or stopped.error or ''}"


def waited_in_script(result: TrialResult) -> bool:
    """Whether a trial's rank 0 was last running the script itself (not importing or building ops), before it
    reached deepspeed.initialize (its events in the trial's log folder; unknown: False)."""
    return _phases(result)[-1:] == [RUNNING_SCRIPT]


def reached_initialize(result: TrialResult) -> bool:
    """Whether a trial's rank 0 got into deepspeed.initialize (its events; unknown: False): a trial stopped there
    before the model was read (a micro-batch that cannot keep the script's global batch) did."""
    return INITIALIZING in _phases(result)


def _phases(result: TrialResult) -> list[Any]:
    log_dir = result.extra.get("log_dir")
    return [e.get("phase") for e in read_events(log_dir, 0)] if isinstance(log_dir, str) else []


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
        raise ConfigError(f"--resume (resume=True): {run_dir.path} tuned {stored.absolute} {shlex.join(stored.args)!r}, not "
                          f"{script.absolute} {shlex.join(script.args)!r}")
    known = run_dir.read_settings()
    wanted = known.workload.global_batch if global_batch is None else global_batch
    if (known.workload.global_batch, known.workload.gpus) != (wanted, settings.workload.gpus):
        return settings  # the differences check names them
    return replace(settings, workload=known.workload, choices=known.choices)


def unresumable(run_dir: RunDir) -> tuple[str, str] | None:
    """Why a script sweep cannot be resumed, and its first trial's verdict; None: it can. A sweep that its first
    trial ended before the script showed its model learned nothing to go on from (its run.json holds the
    placeholder workload, not the script's model and global batch), so no trial may run on it: the script, fixed,
    needs a new sweep, whose first trial shows the model."""
    info = load(run_dir)
    if not info.get("fatal") or info.get("model"):
        return None
    verdict, _, error = str(info["fatal"]).partition(": ")
    return (f"--resume: {run_dir.path} holds nothing to go on from: its first trial ended the sweep before the script "
            f"reached deepspeed.initialize ({verdict}: {error_line(error)}), so the script's model and global batch "
            "were never seen and no trial runs on a stand-in; once the script is fixed, start a new sweep: the same "
            f"command without --resume, with another --out (or after removing {run_dir.path})"), str(info["fatal"])


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
    # Where the script stopped the sweep before anything was recommended: the report's headline (first), else "".
    verdict: str = ""
    # Where no trial showed the script's model: the report's title and Workload line (no placeholder's figures).
    title: str = ""
    workload: str = ""
    launch_notes: tuple[str, ...] = ()  # comment lines for launch.sh's header: how its command applies the config
    no_local_rank: bool = False  # the script's parser takes no --local_rank (launch.sh's deepspeed form says so)
    at_fault: str = "the script's (or its data's)"  # a failure every config tried had (the report's verdict)


# What to do about each verdict, where its message does not say it already.
VERDICT_HINTS = {
    "crashed_before_initialize": "the error is the script's own, before any config applies: fix the script or "
                                 "its arguments, then start a new sweep",
    TIMED_OUT: "the script had not reached deepspeed.initialize when the trial's time ran out, and no config changes "
               "what comes before it: raise --trial-timeout if the script needs longer to start (loading data or a "
               "model), else see where it waits (the trial's rank0.stdout and rank0.stderr in logs/)",
    "never_initialized": "ds-autotune tunes the config a script hands to deepspeed.initialize (itself, or through "
                         "the Hugging Face Trainer, Accelerate or Lightning), and this one never called it",
    alike.VERDICT: "no config avoids a failure the script has after its steps: fix the script (the trials' "
                   "rank0.stderr and rank0.stdout in logs/), then start a new sweep",
}


def cannot_be_tuned(fatal: str) -> tuple[str, list[str]]:
    """The verdict of a script that stopped its sweep, as one line (the verdict, the trial's error in its first
    line: the script's own error line where it wrote one, and what to do), and the rank's last stderr lines."""
    verdict, _, error = fatal.partition(": ")
    lines = error.strip().splitlines()
    hint = VERDICT_HINTS.get(verdict)
    line = f"the script cannot be tuned as it is: {verdict}: {error_line(error)}" + (f"; {hint}" if hint else "")
    return line, lines[1:]


def tuned_keys(ds: dict[str, Any]) -> dict[str, Any]:
    """The keys of a recommended config that the tuner set (autotune.script.merge), as a script's config takes them."""
    keys = {key: ds[key] for key in merge.BATCH_KEYS if key in ds}
    keys.update({name: {"enabled": bool((ds.get(name) or {}).get("enabled"))} for name in ("bf16", "fp16")})
    keys["zero_optimization"] = ds.get("zero_optimization", {})
    if "zero_force_ds_cpu_optimizer" in ds:
        keys["zero_force_ds_cpu_optimizer"] = ds["zero_force_ds_cpu_optimizer"]
    return keys


def outputs(run_dir: RunDir, settings: RunSettings, best: TrialResult | None) -> ScriptOutputs:
    """What a script sweep recommends: the script's own config with the tuned keys, and how to use it."""
    info = load(run_dir)
    files: list[tuple[str, Any]] = []
    lines = list(info.get("notes") or [])
    tail: list[str] = []  # the failed first trial's stderr lines, after its verdict
    verdict = ""
    results = run_dir.results()
    # The first trial's verdict, else (nothing recommended) a later trial's that stopped the sweep
    fatal = info.get("fatal") or (later_verdict(results) if best is None else None)
    if fatal:
        line, tail = cannot_be_tuned(str(fatal))
        if best is None:
            verdict = line
        else:  # a resumed sweep went on from a first trial that had shown the model
            line = "the first trial ended the sweep's first session: " + line.removeprefix("the script cannot be "
                                                                                          "tuned as it is: ")
            tail = []
        lines.insert(0, line)
    program: tuple[str, ...] = ()
    launch_notes: list[str] = []
    no_local_rank = (info.get("model") or {}).get("takes_local_rank") is False  # as its trials' shim saw it parse
    if best is not None:
        ds, flags = recommendation(best, settings)
        via = (info.get("model") or {}).get("via")
        loops = {accelerate_loop.VIA: accelerate_loop.recommendation, lightning_loop.VIA: lightning_loop.recommendation}
        if not _has_auto(ds):
            validate(ds, settings.workload.gpus)
        if via in loops:  # the script's own DataLoader: its batch size is the script's to set (after validate:
            # the loop's framework fills some batch keys itself)
            ds, info["recommended_script_flags"], advice = loops[via](ds, info["model"], info["script"]["args"])
        trainer = (info.get("model") or {}).get("via") == "transformers.TrainingArguments"
        if trainer:  # TrainingArguments' flags: a script of another stack takes none
            info["recommended_trainer_flags"] = flags
        else:
            info.pop("recommended_trainer_flags", None)
        config_path = str(run_dir.path.resolve() / DS_CONFIG)
        program = with_recommendation(info["script"], config_path,
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
        lines += precision_changed(asked_precision(user_config(best), info.get("model")), best, settings, results)
        if no_local_rank:
            lines.append("the script's parser takes no --local_rank, which DeepSpeed's launcher passes by default: "
                         "launch.sh's deepspeed form passes --no_local_rank (torchrun passes none)")
            launch_notes += ["This script takes no --local_rank: the deepspeed form passes --no_local_rank."]
        dropped = [key for key in merge.DROPPED if key in (user_config(best) or {})]
        if dropped:
            lines.append(f"best_ds_config.json leaves out the script's {', '.join(map(repr, dropped))} block, as every "
                         "trial did: DeepSpeed's own autotuner's instructions (the tuner read them), not training "
                         "config; enabled, DeepSpeed's engine would profile every step and end the training after "
                         "its end_profile_step + 1 steps")
        plain = not trainer and via not in loops  # the config reaches deepspeed.initialize: the trials' merge applies
        switch = (info.get("model") or {}).get("checkpoint_switch")
        if names_config(program, config_path) and plain and switch and best.config.ckpt_interval > 0:
            # No config key turns the model's checkpointing on: the trials called its switch, and so does the wrapper.
            program = apply.command(config_path, program[0], program[1:], True)
            lines.append(f"the recommendation checkpoints activations through the model's {switch}(), which no "
                         f"DeepSpeed config key does: launch.sh runs the script through `python -m {apply.MODULE} "
                         f"--checkpointing on`, as the trials did; without it, call model.{switch}() before "
                         "deepspeed.initialize (its peak was measured with it)")
            launch_notes += [f"The recommendation checkpoints activations: `--module {apply.MODULE} --checkpointing on` "
                             f"calls the model's {switch}()", "before deepspeed.initialize, as the trials did."]
        elif not names_config(program, config_path):  # no argument of the script names its config: set in code
            keys = json.dumps(tuned_keys(ds), separators=(", ", ": "))
            if plain:
                program = apply.command(config_path, program[0], program[1:],
                                        best.config.ckpt_interval > 0 if switch else None)
                lines.append(f"no argument of the script names its DeepSpeed config (it builds it in code), so launch.sh "
                             f"applies best_ds_config.json through `python -m {apply.MODULE}`: it merges the tuned keys "
                             "into the config the script passes to deepspeed.initialize, as the trials did (the script "
                             "unchanged); to launch the script without it, put these keys into that config: " + keys)
                launch_notes += ["The script builds its DeepSpeed config in code: `--module autotune.script.apply` gives "
                                 "the config it passes", "to deepspeed.initialize the tuned keys of best_ds_config.json, as "
                                 "the trials did. Without it, put these into it:", keys]
            else:
                # Its own config, so its own arguments too: a loop's batch flag alone would change its global batch
                # (a DataLoader of the tuned micro-batch at the script's own accumulation), a config never measured.
                program = with_recommendation(info["script"], config_path, [], add=False)
                lines.append("the recommendation is NOT in launch.sh's command: no argument of the script names its "
                             "DeepSpeed config (it sets it in code), so the command runs the script's own config and "
                             "arguments; put these keys of best_ds_config.json into that config (or have the script "
                             "read the file)" + (f" and pass {' '.join(info['recommended_script_flags'])}"
                                                 if info.get("recommended_script_flags") else "") + ": " + keys)
                launch_notes += ["NOT TUNED: the script sets its DeepSpeed config in code and no argument names it, so "
                                 "this command", "runs the script's own config. Put these keys of best_ds_config.json "
                                 "into it (report.md, Script mode):", keys]
    model = info.get("model") or {}
    script_path, args = info["script"]["path"], info["script"]["args"]
    section = ["", "## Script mode", "", f"- Script: `{script_path}`"
               + (f" with arguments `{shlex.join(args)}`" if args else " (no arguments)")]
    title = workload = ""
    if model:
        shape = settings.workload.model
        section.append(f"- Model seen at deepspeed.initialize: {model.get('class')}, {model['params'] / 1e6:,.2f}M "
                       f"parameters, {model.get('layers', '?')} layers, hidden {model.get('hidden', '?')}, sequence "
                       f"{model.get('seq_len', '?')} (shape the estimator uses: {shape.layers} layers, hidden "
                       f"{shape.hidden}, MLP {shape.ffn_hidden}, vocab {shape.vocab}); {describe(model)}")
    elif not any(r.script_model for r in run_dir.results()):
        title, workload = unseen_workload(settings, info)
        section.append("- Model: not seen: no trial reached deepspeed.initialize, where the script hands over its model")
    for line in lines:
        section.append(f"- {line}")
        if tail and line.startswith("the script cannot be tuned"):
            whose = "The first trial's" if info.get("fatal") else "The trial's"
            section += ["", f"  {whose} last lines of stderr:", "", "  ```",
                        *(f"  {t}" for t in tail), "  ```", ""]
    section.append("")
    console = [lines[0] + "".join(f"\n  {t}" for t in tail), *lines[1:]] if verdict else lines
    return ScriptOutputs(tuple(files), tuple(section), tuple(console), program, verdict, title, workload,
                         tuple(launch_notes), no_local_rank)


def unseen_workload(settings: RunSettings, info: dict[str, Any]) -> tuple[str, str]:
    """The report's title and Workload line where no trial showed the script's model: the script's name, what is
    known (the global batch the trials ran, where they ran; none where the first trial ended the sweep)."""
    w, name = settings.workload, Path(info["script"]["path"]).name
    if info.get("fatal"):
        batch_text = "global batch not read"
    else:
        settled = info.get("global_batch") or {}
        how = "--global-batch" if settled.get("given") else "the tuner's default: the script's was not read"
        batch_text = f"global batch {w.global_batch} ({how})"
    return (f"{name} (script)", f"{name}: its model not seen (no trial reached deepspeed.initialize), {batch_text}, "
                                f"{w.gpus} x {settings.hardware.name}")


def names_config(program: tuple[str, ...], config_path: str) -> bool:
    """Whether the command passes `config_path` (an argument of the script named its DeepSpeed config)."""
    return any(arg == config_path or arg.endswith(f"={config_path}") for arg in program[1:])


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
