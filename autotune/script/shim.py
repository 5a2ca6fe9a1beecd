"""One rank of a script-mode trial: `python -m autotune.script <spec.json>` runs the user's script, unchanged,
with the trial's config applied where the script hands its config to DeepSpeed.

Before the script runs, the shim imports DeepSpeed, refuses what this accelerator cannot run and builds the
C++ ops the trial needs (as the built-in worker does), then replaces `deepspeed.initialize` with a wrapper:
- the script's config (the `config` / `config_params` argument as a path or a dict, or
  `args.deepspeed_config`) gets the trial's memory-relevant keys (autotune.script.merge);
- the script's global batch is read from what it hands over (autotune.script.batch) and recorded; where the
  spec says to keep it (`keep_script_batch`: the tuner does not know it yet), the trial runs that global batch
  at its micro-batch (accumulation = global / (micro-batch x ranks)) instead of the spec's;
- the model's own activation-checkpointing switch is set from `ckpt_interval` (autotune.script.inspect_model);
- the model is inspected (parameter count, layers, hidden, ...) and the result written to `model.json`;
- the engine that comes back is measured: every optimizer step (all micro-steps, data loading included) is
  timed between gradient-accumulation boundaries, the process's true peak memory is read as the worker
  reads it (autotune.worker.device), and after the measured steps (autotune.worker.measure) the rank writes
  its report and ends the run. As in the worker, the engine's steps are counted applied or skipped
  (autotune.worker.training): warm-up lasts until one was applied, only applied steps are timed, and a run
  whose steps did not train ends `untrained`.
A Hugging Face `TrainingArguments` is patched when transformers is imported (transformers.training_args), so
that the Trainer builds its data loader with the trial's micro-batch and checks its own arguments against
the merged config: the Trainer then calls `deepspeed.initialize` through Accelerate, which the wrapper sees.

Failures the script causes whatever the config are reported with a `verdict` so that the tuner stops after
the first trial: `crashed_before_initialize`, `never_initialized`, `never_stepped`, `too_few_steps`,
`ignores_micro_batch` (the script feeds batches of another size than the engine's micro-batch),
`global_batch_indivisible` (the trial's micro-batch cannot keep the script's global batch).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import inspect
import os
import runpy
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from autotune.worker.device import AcceleratorMismatch, open_device
from autotune.worker.imports import mlflow_kept_out
from autotune.worker.main import (Unsupported, agree, check_supported, classify, die_with_parent, oom_cause,
                                  host_store, load_ops, port_evidence, prepared_ds_config, spare_imports,
                                  untrained_evidence, wait_for_trial)
from autotune.worker.training import Ledger, Untrained, state_bytes
from autotune.worker.measure import iqr, median_rel_se, stop_reason
from autotune.worker.protocol import WorkerSpec, record_phase, report_path, write_json_atomic
from autotune.values.config import ConfigError
from autotune.script import accelerate_loop, alike, batch as script_batch, lightning_loop, merge
from autotune.script.verdict import ScriptVerdict
from autotune.script.inspect_model import checkpoint_switch, model_info, set_checkpointing, watch_attention
from autotune.script.loaders import first_tensor

MODEL_FILE = "model.json"  # what rank 0 learned about the model (and the first batch)
USER_CONFIG_FILE = "user_ds_config.json"  # the config as the script passed it, before the trial's keys
USED_CONFIG_FILE = "ds_config.json"  # the merged config DeepSpeed got
VERDICTS = ("crashed_before_initialize", "never_initialized", "never_stepped", "too_few_steps",
            "ignores_micro_batch", "global_batch_indivisible", "ignores_accumulation")
KEEP_SCRIPT_BATCH = "keep_script_batch"  # spec extra: run the script's own global batch, not the spec's
SCRIPT_CWD = "script_cwd"  # spec extra: the working directory the script runs in (a Ray trial's shipped copy)
# spec extra: how the command that runs the trial takes another micro-batch, for global_batch_indivisible's advice
# (a sweep's space by default; `autotune trial`'s --micro-batch)
MICRO_BATCH_FIX = "micro_batch_fix"
SPACE_FIX = "give the space one of them, or pass --global-batch to change the recipe"
SCRIPT_ENDED = "script_ended"  # stop reason: the script finished its own loop before the measurement did
# The training frameworks whose import a spare rank makes ahead (~2 s for transformers' Trainer on the 2-core CPU),
# those the script had imported by deepspeed.initialize in its first trial (the model's `frameworks`): the backend
# names them in the ranks' environment (FRAMEWORKS_ENV, comma-separated).
FRAMEWORKS = ("transformers.trainer", "accelerate.accelerator", "lightning.pytorch", "pytorch_lightning")
FRAMEWORKS_ENV = "AUTOTUNE_SCRIPT_FRAMEWORKS"
FRAMEWORK_PACKAGES = tuple(sorted({name.split(".")[0] for name in FRAMEWORKS}))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.script")
    parser.add_argument("spec", nargs="?")
    parser.add_argument("--spare", metavar="READY", help="start ahead of a trial: import, write READY, wait on stdin")
    args, _ = parser.parse_known_args(argv)  # DeepSpeed's launcher adds --local_rank
    if (args.spec is None) == (args.spare is None):
        parser.error("give the trial's spec.json, or --spare READY")
    die_with_parent()
    ahead = None
    if args.spare is not None:  # torch's and DeepSpeed's imports off the trial's clock, as the worker's
        with mlflow_kept_out():
            ahead = spare_imports()
        ahead += import_frameworks(os.environ.get(FRAMEWORKS_ENV, ""))
        args.spec = wait_for_trial(args.spare, ahead)
    spec = WorkerSpec.read(args.spec)
    rank = int(os.environ.get("RANK", "0"))
    shim = Shim(spec, rank, ahead)
    shim.phase("start")
    try:
        shim.prepare()
        shim.run_script()
        report = shim.script_ended()
        code = 0 if report["status"] == "ok" else 1
    except BaseException as err:  # every failure becomes a report; the runner decides what comes next
        print_failure(err)
        report, code = shim.failure(err), 1
    shim.finish(report, code)
    return code  # not reached: finish() ends the process


class Shim:
    def __init__(self, spec: WorkerSpec, rank: int, ahead: float | None = None) -> None:
        self.spec, self.rank = spec, rank
        self.ahead = ahead  # the seconds a spare rank spent importing before it was handed this trial
        self.started = time.time()
        self.phases: dict[str, float] = {"spawn_s": self.started - spec.launch_time if spec.launch_time else 0.0}
        self.last_lap = self.started
        self.last_phase = "start"
        self.initialized = False
        self.engine: Any = None
        self.model: dict[str, Any] = {}
        self.user_config_recorded = False
        self.steps = 0  # optimizer steps so far
        # engine.backward() calls so far: one per micro-batch, whether the loop calls engine.step() after each
        # (DeepSpeed's convention) or only at accumulation boundaries (Accelerate's)
        self.micro_steps = 0
        self.script_batch: script_batch.ScriptBatch | None = None  # the batch the script asked for
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.ledger = Ledger(fp16=spec.config.precision == "fp16")  # what the optimizer steps did
        self.measuring = False
        self.loss: Any = None
        self.mark = 0.0  # perf_counter at the end of the last optimizer step
        self.first_step = 0.0
        self.startup_peak = 0
        self.world = 1
        self.model_switch: str | None = None
        self.via_trainer = False  # the config came through Hugging Face TrainingArguments
        # The precision the script's framework runs and what set it (accelerate_loop, lightning_loop): None unknown
        self.script_precision: tuple[str, str] | None = None
        # Whether the script's own parser takes DeepSpeed's launcher's --local_rank=N (watch_local_rank): None unknown
        self.takes_local_rank: bool | None = None
        self.stderr: StderrTail | None = None  # what the script wrote to sys.stderr (its last line), while it ran
        self.env_watch: _EnvBeforeImport | None = None  # whether the script set the environment before its frameworks

    # -- bookkeeping ----------------------------------------------------------------------------------
    def phase(self, name: str, **info: Any) -> None:
        self.last_phase = name
        record_phase(self.spec.log_dir, self.rank, name, **info)

    def lap(self, name: str) -> None:
        now = time.time()
        self.phases[name] = now - self.last_lap
        self.last_lap = now

    def write(self, name: str, data: dict[str, Any]) -> None:
        if self.rank == 0:
            write_json_atomic(Path(self.spec.log_dir) / name, merge.json_safe(data))

    def write_model(self) -> None:
        """What rank 0 learned about the model so far (MODEL_FILE, read by autotune/backends/script.py)."""
        self.write(MODEL_FILE, self.model)

    # -- before the script ----------------------------------------------------------------------------
    def prepare(self) -> None:
        import torch

        with mlflow_kept_out():  # seconds of every rank's start; the script may still import MLflow itself
            import deepspeed
        from deepspeed.accelerator import get_accelerator

        self.torch, self.deepspeed = torch, deepspeed
        self.lap("import_s")
        self.accel = get_accelerator()
        device = self.accel.device_name()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # The budget caps the allocator here too: the script's own allocations count as the worker's do.
        self.memory = open_device(self.spec.accelerator, self.accel, torch, local_rank, self.spec.memory_budget_bytes)
        self.phase("build_ops", device=device)
        trial = prepared_ds_config(self.spec.ds_config)
        check_supported(self.spec, trial, self.accel)
        if self.spec.cpu_info:
            import cpuinfo

            cpuinfo.get_cpu_info = lambda: dict(self.spec.cpu_info)  # DeepSpeed's builders ask at call time
        load_ops(trial, self.accel, lambda op, building: self.phase("build_ops", op=op, building=building))
        self.lap("build_ops_s")
        from deepspeed.constants import default_pg_timeout

        # The script's own env:// initialization joins this loopback-only store instead of opening one.
        self.store = host_store(torch, default_pg_timeout)
        self.baseline = self.memory.current()
        self.original_initialize = deepspeed.initialize
        deepspeed.initialize = self.initialize
        after_import("transformers.training_args", self.patch_training_arguments)
        # A hand-written Accelerate loop: its DataLoader and accumulation follow the trial (accelerate_loop).
        after_import("accelerate.accelerator", lambda m: accelerate_loop.patch(m, self))
        for name in lightning_loop.MODULES:  # a Lightning Trainer's DeepSpeedStrategy: the same (lightning_loop)
            after_import(name, lambda m: lightning_loop.patch(m, self))

    def run_script(self) -> None:
        script = self.spec.extra["script"]
        sys.argv = [script, *self.spec.extra.get("script_args", ())]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` would have it
        if self.spec.extra.get(SCRIPT_CWD):
            os.chdir(self.spec.extra[SCRIPT_CWD])  # relative paths as on the driver, in the shipped copy
        self.phase("script")
        watch_local_rank(self)
        self.env_watch = _EnvBeforeImport(FRAMEWORK_PACKAGES)
        sys.meta_path.insert(0, self.env_watch)
        self.stderr = StderrTail(sys.stderr)  # the script's own last words (argparse's error line) for its failure
        sys.stderr = self.stderr
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            if sys.stderr is self.stderr:
                sys.stderr = self.stderr.stream

    # -- the trial's config where the script passes its own ----------------------------------------------
    @property
    def ranks(self) -> int:
        return int(os.environ.get("WORLD_SIZE") or self.spec.workload.gpus)

    def trial_config(self, user: dict[str, Any], found: script_batch.ScriptBatch | None) -> dict[str, Any]:
        """The script's config `user` with the trial's keys; `found`: the global batch the script asks for."""
        if not self.user_config_recorded:
            self.write(USER_CONFIG_FILE, user)
            self.user_config_recorded = True
        if self.script_batch is None:  # the first place the script states it (TrainingArguments, then initialize)
            self.script_batch = found
        trial = dict(self.spec.ds_config)
        if self.spec.extra.get(KEEP_SCRIPT_BATCH) and self.script_batch is not None:
            try:
                trial.update(script_batch.trial_keys(self.script_batch.global_batch, self.spec.config.micro_batch,
                                                     self.ranks))
            except ConfigError as err:
                fix = self.spec.extra.get(MICRO_BATCH_FIX) or SPACE_FIX
                raise ScriptVerdict("global_batch_indivisible",
                                    f"the script's global batch {self.script_batch.describe()}: {err}; {fix}") from None
        return prepared_ds_config(merge.merge(user, trial))

    def batch_of(self, user: dict[str, Any]) -> script_batch.ScriptBatch | None:
        """The global batch the script's DeepSpeed config asks for; one no split keeps (train_batch_size no multiple
        of the ranks) is the verdict where the trial must run it, else unknown (the tuner's is run)."""
        try:
            return script_batch.from_ds_config(user, self.ranks)
        except ConfigError as err:
            if self.spec.extra.get(KEEP_SCRIPT_BATCH):
                raise ScriptVerdict("global_batch_indivisible", str(err)) from None
            return None

    def patch_training_arguments(self, module: Any) -> None:
        cls = module.TrainingArguments
        original = cls.__post_init__
        shim = self

        def post_init(args: Any) -> None:
            if args.deepspeed:  # a Trainer without DeepSpeed is left alone (and never initializes)
                found = script_batch.from_training_arguments(args, shim.ranks)  # before the trial's values
                ds = shim.trial_config(merge.load_config(args.deepspeed), found)
                args.deepspeed = ds
                shim.via_trainer = True
                args.per_device_train_batch_size = ds["train_micro_batch_size_per_gpu"]
                args.gradient_accumulation_steps = ds["gradient_accumulation_steps"]
                args.bf16 = bool(ds["bf16"]["enabled"])
                args.fp16 = bool(ds["fp16"]["enabled"])
                if not shim.spec.config.ckpt_interval:  # the knob decides; switched on at initialize
                    # By either name: transformers 5.x reads `activation_checkpointing`, and takes its deprecated
                    # alias `gradient_checkpointing` only when the new name is unset.
                    for name in ("gradient_checkpointing", "activation_checkpointing"):
                        if hasattr(args, name):
                            setattr(args, name, False)
            original(args)

        cls.__post_init__ = post_init

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        self.lap("script_to_initialize_s")
        self.phase("initialize")
        given = inspect.signature(self.original_initialize).bind_partial(*args, **kwargs).arguments
        user = merge.load_config(merge.pop_config(given))
        ds = self.trial_config(user, self.batch_of(user))
        self.write(USED_CONFIG_FILE, ds)
        model = given.get("model")
        if model is None:
            raise ScriptVerdict("never_initialized", "the script called deepspeed.initialize without a model")
        self.apply_checkpointing(model)
        self.model = model_info(model)
        self.model["via"] = "transformers.TrainingArguments" if self.via_trainer else "deepspeed.initialize"
        self.model["checkpointing_on"] = bool(self.spec.config.ckpt_interval) and self.model_switch is not None
        self.model["batch"] = self.script_batch.to_dict() if self.script_batch else None  # the script's recipe
        self.model["global_batch"] = ds["train_batch_size"]  # what this trial ran
        if self.takes_local_rank is not None:  # launch.sh's DeepSpeed launcher needs --no_local_rank where False
            self.model["takes_local_rank"] = self.takes_local_rank
        if self.script_precision is not None:  # the loop feeds inputs of this precision: the sweep keeps it
            self.model["script_precision"], self.model["script_precision_source"] = self.script_precision
        # A framework imported ahead reads the environment before the script could set it (HF_HUB_OFFLINE, HF_HOME are
        # read at import): none is named where the script changed the environment before importing its first.
        changed = self.env_watch is None or self.env_watch.changed
        self.model["frameworks"] = [] if changed else [name for name in FRAMEWORKS if name in sys.modules]
        self.write_model()
        watch_attention(model, self.model, self.write_model)  # how attention really runs: seen in the first forward
        result = self.original_initialize(**given, config=ds)
        self.initialized = True
        self.attach(result[0])
        self.lap("initialize_s")
        self.phase("warmup")  # at least one step: the measurement begins after an applied one
        return result

    def apply_checkpointing(self, model: Any) -> None:
        interval = self.spec.config.ckpt_interval
        switch = checkpoint_switch(model)
        self.model_switch = switch
        if switch is None:
            if interval:
                raise Unsupported(f"ckpt_interval {interval}: {type(model).__name__} offers no activation-"
                                  "checkpointing switch (gradient_checkpointing_enable)")
            return
        if interval > 1:
            raise Unsupported(f"ckpt_interval {interval}: {type(model).__name__}.{switch} checkpoints every "
                              "layer (interval 1); segments of several layers cannot be applied")
        set_checkpointing(model, bool(interval))

    # -- measuring the engine the script got back ---------------------------------------------------------
    def attach(self, engine: Any) -> None:
        self.engine = engine
        self.world = self.torch.distributed.get_world_size() if self.torch.distributed.is_initialized() else 1
        step, backward = engine.step, engine.backward

        def measured_step(*args: Any, **kwargs: Any) -> Any:
            before, skipped_before = engine.global_steps, engine.skipped_steps
            out = step(*args, **kwargs)
            if engine.global_steps != before:  # a gradient-accumulation boundary: the optimizer stepped
                self.optimizer_stepped(skipped_before)
            return out

        def kept_loss(loss: Any, *args: Any, **kwargs: Any) -> Any:
            self.loss = self.unscaled(loss)
            self.micro_steps += 1
            return backward(loss, *args, **kwargs)

        engine.step, engine.backward = measured_step, kept_loss
        self.hook = engine.register_forward_pre_hook(self.first_batch, with_kwargs=True)
        self.accel.synchronize()
        self.mark = time.perf_counter()

    def unscaled(self, loss: Any) -> Any:
        """The loss a micro-batch computed, as recorded (loss_first, loss_last): the Hugging Face Trainer and
        Lightning hand engine.backward their loss already divided by the gradient accumulation (DeepSpeed's own
        loops and Accelerate's let the engine scale it), so that trials at different accumulations would record
        losses that differ by it; times the engine's accumulation, theirs compare with every other trial's."""
        if loss is not None and (self.via_trainer or self.model.get("via") == lightning_loop.VIA):
            return loss.detach() * self.engine.gradient_accumulation_steps()
        return loss

    def first_batch(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.hook.remove()
        tensor = first_tensor((*args, *kwargs.values()), self.torch.Tensor)  # also inside a list (Lightning's batch)
        if tensor is None:
            return
        batch = int(tensor.shape[0])
        self.model["micro_batch_seen"] = batch
        if tensor.dim() >= 2 and not tensor.is_floating_point():
            self.model["seq_len"] = int(tensor.shape[1])  # token ids: (batch, sequence)
        self.write_model()
        wanted = self.engine.train_micro_batch_size_per_gpu()
        if batch != wanted:
            raise ScriptVerdict("ignores_micro_batch", (
                f"the script feeds batches of {batch} samples, not the engine's micro-batch of {wanted}: build the "
                "data loader with engine.train_micro_batch_size_per_gpu() (or pass training_data to "
                "deepspeed.initialize) so that the micro-batch can be tuned"))

    def start_measuring(self, **taken: Any) -> None:
        """After warm-up, which ends with an applied step: the optimizer's state exists when the window opens.
        `taken`: the step's event keys (optimizer_stepped)."""
        self.measuring = True
        self.ledger.optimizer_state_bytes = state_bytes(self.engine.basic_optimizer)
        self.startup_peak = self.memory.peak()
        self.memory.reset_peak()
        self.first_step = time.time()
        self.lap("warmup_s")
        self.phase("measure", **{**taken, "optimizer_state_bytes": self.ledger.optimizer_state_bytes})

    def optimizer_stepped(self, skipped_before: int) -> None:
        self.accel.synchronize()
        now = time.perf_counter()
        elapsed, self.mark = now - self.mark, now
        self.steps += 1
        applied = self.ledger.observe(self.engine, skipped_before, self.loss, self.measuring)
        # Every step's event says how far the script got and what its steps did: a trial that runs out of time
        # keeps them (autotune.backends.script), and a script that stops stepping shows it (autotune.script.alike).
        taken = {"steps": self.steps, **self.ledger.evidence()}
        if not self.measuring:
            try:
                if self.ledger.warming(self.spec.measure.warmup_steps):  # until a step was applied (fp16's scale)
                    self.phase("warmup", **taken)
                    return
            except Untrained as err:
                self.finish(self.failure(err), 1)
            self.start_measuring(**taken)
            return
        if applied:  # a skipped step skips the update: not a step of this config's training
            self.times.append(elapsed)
            self.peaks.append(self.memory.peak() - self.baseline)
        reason = agree(self.torch, self.world, self.engine.device,
                       lambda: stop_reason(self.times, time.time() - self.first_step, self.spec.measure, self.peaks,
                                           self.ledger.skipped_measuring))
        self.phase("measure", step=len(self.times), **taken)  # step: measured so far, for the live progress line
        if reason is not None:
            self.finish_measured(reason)

    def finish_measured(self, reason: str) -> None:
        """End the run with the measurement, or as untrained when its steps do not show training."""
        fault = self.ledger.verdict()
        if fault is not None:
            self.finish(self.failure(self.ledger.untrained(*fault)), 1)
        self.finish(self.measured(reason), 0)

    # -- the end --------------------------------------------------------------------------------------
    def measured(self, reason: str) -> dict[str, Any]:
        self.lap("measure_s")
        self.phase("done")
        # Every rank is past its last collective before anyone exits; a script that ran to its end may have
        # destroyed the group already (torch.distributed.destroy_process_group()), its collectives all done.
        if self.world > 1 and self.torch.distributed.is_initialized():
            self.torch.distributed.barrier()
        engine, times = self.engine, self.times
        self.memory.finish()
        return {
            "status": "ok", "rank": self.rank, "pid": os.getpid(), "world_size": self.world,
            "device": self.accel.device_name(), "step_times_s": times, "peak_growth_per_step_bytes": self.peaks,
            "step_time_s": statistics.median(times), "step_time_iqr_s": iqr(times),
            "step_time_rel_se": median_rel_se(times) if len(times) > 1 else None, "stop_reason": reason,
            "baseline_memory_bytes": self.baseline, "peak_memory_bytes": self.memory.peak(),
            "startup_peak_bytes": self.startup_peak, "peak_allocated_bytes": self.memory.peak_allocated(),
            "first_step_time": self.first_step, "phases_s": self.phases, "import_ahead_s": self.ahead,
            **self.ledger.evidence(), "optimizer": type(engine.optimizer).__name__,
            "basic_optimizer": type(engine.basic_optimizer).__name__,
            "threads": self.torch.get_num_threads(), "model": self.model, "checkpoint_switch": self.model_switch,
            **self.memory.details(),
        }

    def script_ended(self) -> dict[str, Any]:
        """The script returned on its own: measured enough, or one of the script's verdicts."""
        if not self.initialized:
            raise ScriptVerdict("never_initialized", "the script ended without calling deepspeed.initialize")
        needed = max(self.spec.measure.warmup_steps, 1) + 1
        if self.steps == 0 and self.micro_steps == 0:
            raise ScriptVerdict("never_stepped", "the script called deepspeed.initialize but ended before any "
                                "backward pass (engine.backward())")
        if self.steps and not self.ledger.applied:  # however many steps it ran, none trained
            raise self.ledger.untrained(*(self.ledger.verdict() or ("overflow", "no optimizer step was applied")))
        if not self.times:  # counted in optimizer steps at this trial's accumulation, worded in the script's units
            raise ScriptVerdict("too_few_steps", script_batch.steps_needed(
                self.micro_steps, self.steps, self.engine.gradient_accumulation_steps(), needed,
                self.spec.extra.get("script_args", ())))
        fault = self.ledger.verdict()
        if fault is not None:
            raise self.ledger.untrained(*fault)
        return self.measured(SCRIPT_ENDED)

    def failure(self, err: BaseException) -> dict[str, Any]:
        if isinstance(err, SystemExit) and err.code in (None, 0):
            try:
                return self.script_ended()  # sys.exit(0) is the script ending normally
            except ScriptVerdict as ended:
                err = ended
        status, message = classify(err)
        if isinstance(err, SystemExit):  # the script's sys.exit(N) or argparse's error: in its own words
            message = self.exit_message(err)
        verdict = getattr(err, "verdict", None)
        if verdict is None and not self.initialized and self.last_phase == "script":
            verdict = "crashed_before_initialize"
            message = f"the script failed before calling deepspeed.initialize: {message}"
        elif verdict is not None:
            message = str(err)
        # What the script got to before it failed (its steps' ledger, the steps measured) and where it was raised:
        # the record keeps them, and a failure two configs share is the script's (autotune.script.alike).
        done = {"steps": self.steps, **self.ledger.evidence(),
                **({"step_times_s": list(self.times)} if self.times else {})} if self.initialized else {}
        return {"status": status, "error": message, "exception": type(err).__name__, "phase": self.last_phase,
                "rank": self.rank, "pid": os.getpid(), "verdict": verdict, "model": self.model or None,
                "initialized": self.initialized, "site": alike.site_of(err), **done,
                "fatal": isinstance(err, AcceleratorMismatch), **untrained_evidence(err), **port_evidence(err),
                **({"cause": oom_cause(err, self.spec.accelerator)} if status == "oom" else {})}

    def exit_message(self, err: SystemExit) -> str:
        """A nonzero sys.exit as the script says it: its message (sys.exit("...")), else the exit code with the
        last line the script wrote to stderr (argparse's `prog: error: ...`)."""
        if isinstance(err.code, str):
            return err.code.strip().splitlines()[-1] if err.code.strip() else "exit code 1"
        said = self.stderr.last_line() if self.stderr is not None else ""
        return f"{said} (exit code {err.code})" if said else f"exit code {err.code}"

    def finish(self, report: dict[str, Any], code: int) -> None:
        write_json_atomic(report_path(self.spec.log_dir, self.rank), merge.json_safe(report))
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter and process-group teardown, as the worker does: nothing more is needed from
        # this process, and the script's own loop must not go on.
        os._exit(code)


# The shim's own verdicts: each says everything in its message (the report's error), no traceback of the shim's.
OWN_VERDICTS = (ScriptVerdict, Unsupported, Untrained, AcceleratorMismatch, ConfigError)


def print_failure(err: BaseException) -> None:
    """What a failed rank writes to its stderr, whose last lines the trial's error quotes: the script's own
    exception as Python would print it, from the script's first frame (the shim and runpy frames above it left
    out); for sys.exit, only a message given to it, as Python prints it; nothing for the shim's own verdicts, whose
    message is the error itself."""
    if isinstance(err, OWN_VERDICTS):
        return
    if isinstance(err, SystemExit):
        if isinstance(err.code, str):
            print(err.code, file=sys.stderr)
        return
    tb = err.__traceback__
    while tb is not None and _internal(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    if tb is None and isinstance(err, SyntaxError) and err.filename and not _internal(err.filename):
        # The script did not compile: no frame of its own; Python's own lines name its file, line and caret.
        traceback.print_exception(type(err), err, None)
        return
    # All frames internal: the shim's own failure (an import, a build), printed whole.
    traceback.print_exception(type(err), err, tb if tb is not None else err.__traceback__)


def _internal(filename: str) -> bool:
    """A frame of the shim or of runpy, which stand between `python -m autotune.script` and the script."""
    return filename == __file__ or filename.endswith(("runpy.py", "<frozen runpy>"))


class StderrTail:
    """sys.stderr while the script runs: writes go on to `stream`, and the last lines are kept (`last_line`)."""

    def __init__(self, stream: Any, keep: int = 20) -> None:
        self.stream, self.keep = stream, keep
        self.lines: list[str] = []
        self.partial = ""

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        try:
            *done, self.partial = (self.partial + str(text)).split("\n")
            self.lines = (self.lines + done)[-self.keep:]
        except Exception:  # noqa: BLE001  (keeping lines never breaks the script's own write)
            pass
        return written

    def last_line(self) -> str:
        """The last non-blank line written (the line being written counts)."""
        return next((line.strip() for line in reversed([*self.lines, self.partial]) if line.strip()), "")

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self.stream, name)


def import_frameworks(names: str) -> float:
    """A spare rank's imports of the script's frameworks (`names`: comma-separated, of FRAMEWORKS), after MLflow is
    importable again as the script would find it. One that fails is left to the script. Returns the seconds."""
    t0 = time.time()
    for name in filter(None, names.split(",")):
        if name in FRAMEWORKS:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (the script's own import says what is wrong, in its trial)
                pass
    return time.time() - t0


def watch_local_rank(shim: Shim) -> None:
    """Record in `shim.takes_local_rank` whether the script's command-line parser (the first `parse_args()` of a
    parser named after the script, which reads sys.argv) would take the `--local_rank=N` DeepSpeed's launcher adds:
    a strict parser without it exits on it ("unrecognized arguments"). `parse_known_args` takes anything: not
    recorded, nor is another parser (a library's own prog)."""
    original = argparse.ArgumentParser.parse_args
    prog = os.path.basename(sys.argv[0])

    def parse_args(parser: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        if args is None and shim.takes_local_rank is None and parser.prog == prog:
            options = list(parser._option_string_actions)  # argparse's own index of its option strings
            shim.takes_local_rank = any(o == "--local_rank" or (parser.allow_abbrev and o.startswith("--local_rank"))
                                        for o in options)
            if shim.model:  # parsed after deepspeed.initialize
                shim.model["takes_local_rank"] = shim.takes_local_rank
                shim.write_model()
        return original(parser, args, namespace)

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign,assignment]  # watched on purpose


def after_import(name: str, callback: Callable[[Any], None]) -> None:
    """Call `callback(module)` right after `name` is imported, or now if it was (a spare rank's frameworks)."""
    if sys.modules.get(name) is not None:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _EnvBeforeImport(importlib.abc.MetaPathFinder):
    """Whether the environment differs, when the first of `packages` is imported, from what it was at this finder's
    creation (`changed`; None until one is imported). Finds nothing itself: the import goes on as it would."""

    def __init__(self, packages: tuple[str, ...]) -> None:
        self.packages, self.environ = packages, dict(os.environ)
        self.changed: bool | None = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname in self.packages:
            sys.meta_path.remove(self)
            self.changed = dict(os.environ) != self.environ
        return None


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `callback(module)` once, right after `name` is imported (if the script ever imports it)."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            callback(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]  # patches this one loader on purpose
        return spec
