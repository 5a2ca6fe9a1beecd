"""The tuning library: `tune(spec)` wires a sweep together (run directory, strategy, pruning, backend, the
loop on this machine or a Ray cluster) and returns what it found. The CLI's `autotune tune` is a client of
it, as is anyone's notebook:

    import autotune
    spec = autotune.TuneSpec(autotune.make_workload("tiny"), autotune.load_hardware("cpu"),
                             memory_budget_bytes=2 * 2**30, strategy="optuna", trials=10, backend="simulated")
    result = autotune.tune(spec, out="runs/notebook")
    result.best.config, result.best_ds_config

A backend is a registered kind's name (`deepspeed`, `simulated`, `replay`; `autotune.register_backend` adds
one) or any object with `run(config) -> TrialResult` (a user's own objective, run on this machine).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Iterator, Sequence

from autotune.backends import Backend
from autotune.backends.replay import check_replay_budget, load_surface, replay_space
from autotune.backends.factory import TrialOptions, as_backend, backend_kind, backend_names, make_backend, simulated_sleep_s
from autotune.prediction.calibrate import CALIBRATION_FILE, quality, save_calibration
from autotune.values.config import ConfigError
from autotune.search.confirm import prior_sigma, recommend
from autotune.values.allocator import ALLOCATORS, check_allocator
from autotune.values.argtypes import (check_seed, duration, given_path, non_negative_int, positive_int, seed as seed_value,
                                      size, stop_probability, whole)
from autotune.trials.cluster import LOCAL, connect
from autotune.trials.devices import AUTO, resolve_hardware
from autotune.search.convergence import DEFAULT_STOP_WHEN, Convergence, check_stop_when, check_seconds
from autotune.drivers.local import run_local
from autotune.drivers.progress import Progress, QuietProgress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget, Hooks, Sweep
from autotune.files import SQLITE_FULL, NoSpaceLeft, disk_full, make_dir, sha256, short
from autotune.outputs.handoff import narrow_choices
from autotune.outputs.launch import ORIGIN_FILE, Origin
from autotune.values.hardware import Hardware, load_hardware
from autotune.outputs.report import OUTPUT_FILES, STOP_FILE, Outputs, OwnWriter, check_not_gone, write_outputs
from autotune.values.results import TrialResult, relabel_note, relabelled
from autotune.trials.runner import remove_stale_shm_at_start
from autotune.search.rundir import STUDY, SWEEP_COPY, RunDir, RunDirBusy, read_only_named
from autotune.values.settings import (DEFAULT_STACK, SETTINGS, STACKS, RunSettings, check_budget, check_stack, is_url,
                                      masked, memory_budget)
from autotune.prediction.scale import check_target, narrow_choices as narrow_for_target
from autotune.search_spaces import choices_for
from autotune.values.space import Choices, Space
from autotune.strategies import POLICY_STRATEGIES, STRATEGIES, check_strategy, strategy_name, with_policy
from autotune.search.study_storage import canonical as canonical_storage, check_storage, optuna_warnings_only
from autotune.outputs.tracking import (Tracker, check_reachable as check_reachable_tracking, check_uri as check_tracking_uri,
                                       resolve_uri as tracking_uri, tracked)
from autotune.outputs.wandb_tracking import check_project
from autotune.values.shapes import ModelShape, untrained_reason
from autotune.values.workload import Workload

if TYPE_CHECKING:
    from autotune.backends.script import Script
    from autotune.drivers.ray import RayOptions

# Optuna guided by the sweep's forecast (strategies/optuna_search.py): on the held-out simulated GPU worlds it reaches
# 98% of the optimum in fewer trial-seconds than `hybrid`, the same search with the RL policy's turns (213 against
# 217 s; `hybrid` faster in 20 of 240 runs, slower in 52: benchmarks/results/search_seconds.md).
DEFAULT_STRATEGY = "optuna"
DEFAULT_TRIALS = 30
# TuneSpec's fields that make a session's budget (TuneSpec.budget): run.json keeps the last session's, which a
# resume may change (autotune tune --resume takes it where no flag sets one)
BUDGET_FIELDS = ("trials", "time_budget_s", "confirm", "stop_when", "train_for_s")


OPTION = "option"  # the metadata key of a TuneSpec field that is an option of the sweep


@dataclass(frozen=True)
class Option:
    """One option of a sweep as every front end offers it, declared once on its TuneSpec field (issue 42): `autotune
    tune`'s flag, the sweep file's key (the flag's name with underscores: `--memory-budget` is `memory_budget`), the
    parser of its text (the CLI's and the sweep file's), its help. A new option is a field declared with `option`,
    plus the place it takes effect."""

    flag: str
    help: str
    parse: Callable[[str], Any] = str
    choices: Callable[[], Sequence[str]] | None = None  # asked when a front end is built (a registry's names)
    metavar: str | None = None
    path: bool = False  # a file's path: a sweep file's is relative to the sweep file's folder
    workload: bool = False  # the CLI's flag is one of the workload flags `estimate` and `trial` share too
    allowed: str = ""  # what a value may be, for an error (options with choices list them)

    @property
    def key(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def value(self, raw: Any) -> Any:
        """The option's value from a sweep file's (its text parsed as the flag's); ConfigError naming what is
        allowed (the caller names the key)."""
        if self.choices is not None:
            allowed = list(self.choices())
            if not isinstance(raw, str) or raw not in allowed:
                raise ConfigError(f"{short(raw)}: allowed {', '.join(map(str, allowed))}")
            return raw
        try:
            return self.parse(str(raw))
        except (argparse.ArgumentTypeError, ConfigError, ValueError, OverflowError) as err:
            raise ConfigError(f"{short(raw)}: {err}" + (f" (allowed {self.allowed})" if self.allowed else "")) from None


def option(default: Any, flag: str, help: str, parse: Callable[[str], Any] = str, **kwargs: Any) -> Any:
    """A TuneSpec field that is an option of the sweep (Option's fields as keywords)."""
    return field(default=default, metadata={OPTION: Option(flag, help, parse, **kwargs)})


def spec_options() -> tuple[tuple[str, Option, Any], ...]:
    """The options of a sweep, in TuneSpec's order: (field name, Option, default)."""
    return tuple((f.name, f.metadata[OPTION], f.default) for f in fields(TuneSpec) if OPTION in f.metadata)


@dataclass(frozen=True)
class TuneSpec:
    """What to tune: the workload on the hardware under a memory budget per device, and how to search. The fields
    declared with `option` are the sweep's options: `autotune tune`'s flags and a sweep file's keys come from them."""

    workload: Workload
    # A profile, its name, "auto" (this machine's devices) or None: "auto" for real trials, a replay surface's
    # own, else cpu for tiny and a100-80gb for the other models (autotune.trials.devices.resolve_hardware).
    hardware: Hardware | str | None = None
    # per device; default: the hardware's memory (settings.memory_budget)
    memory_budget_bytes: int | None = option(
        None, "--memory-budget", "memory budget per device, e.g. 2GiB (2**30) or 2GB (10**9) (default: the hardware's)",
        size, allowed="a size such as 40GiB or 2GB")
    # A registered name (autotune.strategies.STRATEGIES), or the user's own Strategy: an object with propose()
    # and observe(config, result), or a callable building one from the SearchContext (autotune.strategies says
    # what the sweep does with it, a resume included: pass the object again).
    strategy: Any = option(DEFAULT_STRATEGY, "--strategy", "search strategy (default: %(default)s)",
                           choices=lambda: list(STRATEGIES))
    trials: int = option(DEFAULT_TRIALS, "--trials",
                         "trials to launch, over all sessions of a resumed sweep (default: %(default)s)", positive_int,
                         allowed="a positive integer")
    time_budget_s: float | None = option(
        None, "--time-budget", "the trials' wall time: no trial starts that is expected to end after it (a "
        "sweep's first always does), e.g. 8h, 90m", duration,
        allowed="a duration such as 8h, 90m, 45s")
    # a registered kind's name, or an object with run(config) -> TrialResult
    backend: Any = option("deepspeed", "--backend", "deepspeed: real trials; simulated: the estimator; replay: a "
                          "measured surface (default: %(default)s)", choices=lambda: backend_names())
    # Choices, a preset name or a YAML path; default: cpu or default preset
    space: Choices | str | None = option(None, "--space", "search-space YAML, or a preset name: default, cpu (default: "
                                         "cpu on CPU hardware)", path=True, workload=True)
    seed: int = option(0, "--seed", "seed of the strategy, 0 to 2**32-1 (default: %(default)s)", seed_value)
    surface: str | None = option(None, "--surface", "replay surface (JSONL of results), for --backend replay",
                                 path=True)
    # Where the Optuna study lives (autotune.search.study_storage): an Optuna RDB URL (sqlite:///..., postgresql://...)
    # or a journal file's path; None: study.db in the run directory, which holds everything else either way.
    storage: str | None = option(
        None, "--storage", "keep the Optuna study in this storage instead of study.db in --out (which holds "
        "everything else): an Optuna RDB URL (sqlite:///PATH, postgresql://USER:PASS@HOST/DB, mysql+pymysql://...) or "
        "a journal file's path; one study per run directory, named in report.md; repeat it with --resume",
        metavar="URL")
    # Confirmation of close calls (autotune/search/confirm.py): after the search, the best config and those within
    # the launch spread of it run up to this many more times in fresh processes, and the recommendation is
    # the best median. The repeats count in `trials` (at most a quarter of them while the search could still
    # use them). None: 2 for backends whose trials run on devices (deepspeed, script), 0 otherwise.
    confirm: int | None = option(
        None, "--confirm", "confirmation of close calls: after the search, the best config and those within the "
        "launch-to-launch spread of it (at most 3) run up to K more times each in fresh processes, and the "
        "recommendation is the best median; the repeats count in --trials, at most a quarter of them while the search "
        "could still use them; 0: off (default: 2 for real trials, deepspeed and --script; 0 for simulated and "
        "replay)", non_negative_int, metavar="K", allowed="a whole number of repeats >= 0")
    # MLflow tracking (autotune/outputs/tracking.py, the `tracking` extra): a tracking URI (sqlite:///PATH,
    # http://SERVER, ...), True for sqlite:///<run dir>/mlflow.db, None: off. Not a setting of the sweep: a
    # resumed sweep may add or change it (the parent run of each store is kept in the run directory).
    mlflow_uri: str | bool | None = option(
        None, "--mlflow-uri", "log every trial and the recommendation to this MLflow tracking URI (http://SERVER:5000, "
        "sqlite:///PATH, postgresql://...); a resumed sweep continues its parent run there", metavar="URI")
    # What will train with the recommendation (autotune/outputs/handoff.py): deepspeed (every knob), trainer or
    # accelerate (activation checkpointing on/off only: the space keeps ckpt_interval 0 and 1).
    stack: str = option(DEFAULT_STACK, "--stack", "what will train with the recommendation: deepspeed (your loop "
                        "around deepspeed.initialize: every knob), trainer (Hugging Face Trainer) or accelerate: these "
                        "switch activation checkpointing on or off only, so the space keeps ckpt_interval 0 and 1 "
                        "(default: %(default)s)", choices=lambda: list(STACKS))
    # Scale-down trials (autotune/prediction/scale.py): trials run at workload.gpus and the calibrated estimator predicts
    # each measured config at this many devices (same global batch); the recommendation is chosen for it.
    target_gpus: int | None = option(
        None, "--target-gpus", "tune for a job of M devices while the trials run on --gpus (fewer): the estimator, "
        "calibrated on the trials, predicts each measured config's memory and throughput at M (same global batch); the "
        "report shows both and the recommendation is chosen for M", positive_int, metavar="M",
        allowed="a positive integer")
    # The convergence stop (autotune/search/convergence.py): the search ends once the chance that an untried config
    # beats the best by more than the launch noise falls below this (after a few trials); 0: off.
    stop_when: float = option(
        DEFAULT_STOP_WHEN, "--stop-when", "end the search once the chance that an untried config is faster than the "
        "best by more than the launch noise falls below P (after a few trials; the estimator's error model gives the "
        "chance, shown after each trial); then confirmation runs; --trials stays the upper bound; 0: off (default: "
        "%(default)s)", stop_probability, metavar="P", allowed="a probability from 0 to below 1; 0: off")
    # The stop in seconds (autotune/search/convergence.py StopRule.train_s): how long the recommendation will train;
    # the search also ends once no untried config is expected to save that run more seconds than its trial costs.
    train_for_s: float | None = option(
        None, "--train-for", "how long the recommended config will train, e.g. 6h: the search also ends once no "
        "untried config is expected to save that run more time than its own trial costs (the share of the run it is "
        "expected to save x this, against its predicted trial seconds) (default: off)", duration, metavar="DURATION",
        allowed="a duration such as 6h or 90m")
    # A trial's wall-clock limit (its clock paused while DeepSpeed's C++ ops build); None: the backend's (600 s).
    trial_timeout_s: float | None = option(
        None, "--trial-timeout", "end a trial that has not finished within this long, e.g. 20m (default: 600 s; the "
        "clock pauses while a trial builds DeepSpeed's C++ ops)", duration, allowed="a duration such as 20m or 900s")
    # Weights & Biases tracking (autotune/outputs/wandb_tracking.py, the `wandb` extra): a project; None: off. As MLflow
    # tracking, not a setting of the sweep.
    wandb: str | None = option(
        None, "--wandb", "log every trial and the recommendation to this Weights & Biases project, a run per trial in "
        "a group per sweep (offline with WANDB_MODE=offline: `wandb sync` uploads them; needs the wandb extra: pip "
        "install 'ds-autotune[wandb]')", metavar="PROJECT")
    # The CUDA caching allocator's mode (autotune.values.allocator: default or expandable); None: the profile's, else
    # what this process's PYTORCH_CUDA_ALLOC_CONF says. It lands in the sweep's hardware (Hardware.allocator).
    allocator: str | None = option(
        None, "--allocator", "the CUDA caching allocator's mode the trials run with and the estimator prices: default, "
        "or expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: its free blocks go back when an allocation "
        "needs them; the recommendation's launch sets it) (default: the profile's, else what your "
        "PYTORCH_CUDA_ALLOC_CONF says)", choices=lambda: list(ALLOCATORS), workload=True)
    # Script mode (autotune/outputs/script.py): the user's training script and its arguments instead of the
    # built-in model; build it with TuneSpec.for_script. Its first trial shows the tuner the model and the
    # script's global batch (kept unless `script_global_batch` names another), and the recommendation is the
    # script's own DeepSpeed config with the tuned keys.
    script: str | None = None
    script_args: tuple[str, ...] = ()
    script_global_batch: int | None = None
    # The policy `rl` and `hybrid` search with (autotune/strategies/rl.py): an exported one (`autotune rl export`: a
    # folder of policy.pt + policy.json); None: the shipped one (autotune/policies/default). A setting of the sweep:
    # run.json keeps its folder (RunSettings.policy), and a resumed sweep must name the same. Last, so that no field
    # moves.
    policy: str | Path | None = option(
        None, "--policy", "with --strategy rl or hybrid: the policy they search with, a folder that `autotune rl "
        "export` wrote (policy.pt + policy.json) (default: the shipped policy); --resume takes the same",
        path=True, metavar="DIR", allowed="the folder of an exported policy")

    def __post_init__(self) -> None:
        if not isinstance(self.workload, Workload):
            raise ConfigError(f"workload {short(self.workload)}: allowed a Workload, e.g. autotune.make_workload("
                              "'llama-7b', global_batch=256, gpus=8)")
        self._expand_paths()
        check_stack(self.stack)
        self.mode.check(self)
        if self.allocator is not None:
            check_allocator(self.allocator)
        check_target(self.target_gpus, self.workload)
        check_strategy(self.strategy)
        # Whole numbers of any integer type (numpy's np.int64) are kept as ints: run.json's JSON takes no np.int64.
        if whole(self.trials) is None or self.trials <= 0:
            raise ConfigError(f"trials {short(self.trials)}: must be a positive integer")
        object.__setattr__(self, "trials", whole(self.trials))
        try:  # the CLI's --seed check: numpy's and Optuna's samplers refuse more, deep inside a sweep
            object.__setattr__(self, "seed", check_seed(self.seed))
        except argparse.ArgumentTypeError as err:
            raise ConfigError(f"seed {err}") from None
        if self.memory_budget_bytes is not None:
            check_budget(self.memory_budget_bytes)
        for name, said in (("time_budget_s", "time budget"), ("train_for_s", "train for"),
                           ("trial_timeout_s", "trial timeout")):
            object.__setattr__(self, name, check_seconds(getattr(self, name), said))
        if self.storage is not None:
            canonical_storage(self.storage)
        if self.confirm is not None:
            if whole(self.confirm) is None or self.confirm < 0:
                raise ConfigError(f"confirm {self.confirm!r}: must be a whole number of repeats >= 0 (0: no "
                                  "confirmation; None: the backend's default)")
            object.__setattr__(self, "confirm", whole(self.confirm))
        check_tracking_uri(self.mlflow_uri)
        check_project(self.wandb)
        check_stop_when(self.stop_when)
        if self.policy is not None:
            check_policy(self.policy, self.strategy)

    def _expand_paths(self) -> None:
        """Every path of the spec checked for its type and `~` expanded (argtypes.given_path, as `out` is): the
        space's YAML file, the hardware's, the replay surface, the policy's folder, the script, a journal storage.
        A preset's or a profile's name is no path and stays as it is (none starts with `~`)."""
        def expanded(name: str, value: Any, allowed: str, keep: tuple[type, ...] = (), text: bool = False) -> None:
            """`text`: kept as a str whatever it was given as (run.json keeps it so)."""
            if value is None or isinstance(value, keep) or (name == "space" and value == ""):  # "": the default
                return
            path = given_path(value, name, allowed)
            object.__setattr__(self, name, str(path) if text or isinstance(value, str) else path)

        expanded("hardware", self.hardware, "a profile's name (e.g. cpu, a100-80gb), 'auto', a YAML file of profile "
                 "keys, a Hardware (autotune.load_hardware) or None", (Hardware,))
        expanded("space", self.space, "a preset's name (default, cpu), a YAML file, a Choices or None", (Choices,))
        expanded("surface", self.surface, "a replay surface's JSONL file (with backend 'replay') or None", text=True)
        expanded("policy", self.policy, "the folder of an exported policy (policy.pt + policy.json) or None")
        expanded("script", self.script, "a training script's path (TuneSpec.for_script) or None", text=True)
        storage = self.storage
        if not (isinstance(storage, str) and is_url(storage)):
            expanded("storage", storage, "an Optuna RDB URL (sqlite:///PATH, postgresql://...), a journal file's path "
                     "or None", text=True)

    @property
    def strategy_name(self) -> str:
        """The name `run.json` keeps: a registered strategy's, or the user's object's."""
        return strategy_name(self.strategy)

    @property
    def policy_folder(self) -> str | None:
        """The --policy folder as run.json keeps it (absolute); None: the shipped policy."""
        return None if self.policy is None else str(Path(self.policy).resolve())

    @property
    def policy_sha256(self) -> str | None:
        """The --policy files' digest as run.json keeps it: a resume after the folder was exported into again is
        refused, as for another folder."""
        if self.policy is None:
            return None
        from autotune.rl.policy import digest

        return digest(self.policy)

    def search_strategy(self) -> Any:
        """What the sweep builds its strategy from (drivers.sweep.Sweep.open): None for a registered name with its
        defaults (run.json's `strategy` names it), the policy strategy's builder with the --policy policy, or the
        user's own Strategy object or builder."""
        if not isinstance(self.strategy, str):
            return self.strategy
        if self.policy is None:
            return None
        from autotune.strategies.rl import load_policy

        return with_policy(self.strategy, load_policy(self.policy))

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else as_backend(self.backend).name

    @property
    def trial_hardware(self) -> Hardware:
        """The profile the sweep predicts with: a CPU profile whose real trials run on this CPU takes this CPU's
        bf16 (autotune.trials.devices.resolve_hardware: emulated bf16 is priced ~30x slower and left out by default)."""
        real = isinstance(self.backend, str) and backend_kind(self.backend).real
        named = load_hardware(self.hardware) if isinstance(self.hardware, str) and self.hardware != AUTO else self.hardware
        return resolve_hardware(named, real=real, model=self.workload.model.name, allocator=self.allocator)[0]

    def settings(self) -> RunSettings:
        """The run directory's settings (`run.json`): what a resumed sweep must match (resolve)."""
        return resolution(self).settings

    def budget(self) -> Budget:
        return Budget(self.trials, self.time_budget_s, self.confirm, self.stop_when, self.train_for_s)

    def budget_record(self) -> dict[str, Any]:
        """The budget by its fields' names (BUDGET_FIELDS), as run.json keeps the last session's."""
        return {name: getattr(self, name) for name in BUDGET_FIELDS}

    def trial_options(self) -> TrialOptions:
        """How each trial runs, wherever it runs (this machine, a Ray node): the options that take effect in a trial's
        backend, not in the search."""
        return TrialOptions(timeout_s=self.trial_timeout_s, sleep_s=simulated_sleep_s(self.backend_name))

    @classmethod
    def for_script(cls, script: str | Path, script_args: Iterable[str] = (), *, gpus: int = 1,
                   global_batch: int | None = None, **options: Any) -> "TuneSpec":
        """Tune the user's own script: `autotune.tune(TuneSpec.for_script("train.py", ["--epochs", "1"]))` as
        `autotune tune --script train.py --script-args '--epochs 1'` does. The workload is a placeholder until
        the first trial has shown the model; `global_batch` changes the script's recipe (None: its own)."""
        from autotune.outputs.script import placeholder

        if isinstance(script_args, (str, bytes)):  # tuple("--steps 6") would be its characters
            raise ConfigError(f"script_args {short(script_args)}: allowed a list of arguments, e.g. ['--steps', '6'] "
                              "(shlex.split splits a command line)")
        if global_batch is not None:
            if whole(global_batch) is None or global_batch <= 0:
                raise ConfigError(f"global_batch {short(global_batch)}: allowed a positive integer, or None (the "
                                  "script's)")
            global_batch = whole(global_batch)
        return cls(placeholder(global_batch, gpus), script=str(script), script_args=tuple(script_args),
                   script_global_batch=global_batch, **options)

    @property
    def mode(self) -> "BuiltIn | ScriptRun":
        """What it tunes, asked through one interface by the runner: the built-in model, or the user's script (the
        one place a spec is asked which)."""
        return BUILT_IN if self.script is None else ScriptRun(self.script, tuple(self.script_args),
                                                             self.script_global_batch, self.trial_timeout_s)

    def script_spec(self) -> "Script":
        """The script and its arguments (autotune.backends.script.Script); ConfigError without one."""
        mode = self.mode
        if not isinstance(mode, ScriptRun):
            raise ConfigError("this sweep tunes the built-in model, not a script")
        return mode.script


def check_policy(policy: str | Path, strategy: Any) -> None:
    """TuneSpec.policy: only for a policy strategy (`rl`, `hybrid`), and the folder of an exported policy that fits
    the environment (strategies/rl.py load_policy); else ConfigError, one line."""
    if not (isinstance(policy, (str, Path)) and str(policy)):
        raise ConfigError(f"--policy (`policy`) {short(policy)}: allowed the folder of an exported policy (policy.pt + "
                          "policy.json)")
    if not (isinstance(strategy, str) and strategy in POLICY_STRATEGIES):
        raise ConfigError(f"--policy (`policy`): only with --strategy (`strategy`) {' or '.join(POLICY_STRATEGIES)} "
                          f"(got {strategy_name(strategy)})")
    from autotune.strategies.rl import load_policy

    load_policy(policy)


@dataclass(frozen=True)
class Resolved:
    """A spec with every default decided: the sweep's settings, its space, and what resolving changed in the
    request, for people (the stack's and the target's narrowing of the space)."""

    settings: RunSettings
    space: Space
    notes: tuple[str, ...] = ()


def resolve(spec: TuneSpec) -> tuple[RunSettings, Space]:
    """The sweep's settings (`run.json`) and space: the one place a sweep's defaults are decided (the hardware,
    the budget through autotune.values.settings.memory_budget, the space preset, the stack, the target devices, a
    replay surface's workload, hardware and measured configs). ConfigError, one line, for a request no config
    can satisfy."""
    resolved = resolution(spec)
    return resolved.settings, resolved.space


def resolution(spec: TuneSpec) -> Resolved:
    """resolve, with the notes."""
    return spec.mode.resolution(spec)


def check_surface(spec: TuneSpec, got: str) -> None:
    """A replay surface only with the replay backend (the CLI's refusal too: one place, one message), else a
    sweep would record a surface it never reads, and its resume without it would be refused. `got`: what the spec
    asks instead, in the CLI's words."""
    if spec.surface is not None and spec.backend != "replay":
        raise ConfigError(f"--surface (`surface`) {spec.surface} is only for --backend replay (got {got})")


def _model_resolution(spec: TuneSpec) -> Resolved:
    """The built-in model's settings and space (a replay surface's, where it replays one)."""
    check_surface(spec, f"--backend {spec.backend_name}")
    if spec.backend == "replay":
        if spec.surface is None:
            raise ConfigError("the replay backend needs a surface (a JSONL of measured results)")
        surface = load_surface(spec.surface)
        space = replay_space(surface, spec.workload, spec.hardware, spec.space)
        if spec.memory_budget_bytes is not None:
            check_replay_budget(surface, spec.memory_budget_bytes)
        read_notes = surface.notes  # what reading it changed: a torn last line left out
    else:
        read_notes = ()
        hardware = spec.trial_hardware
        choices = spec.space if isinstance(spec.space, Choices) else choices_for(spec.space, hardware)
        space = Space(choices, spec.workload, hardware).require_configs()
    choices, stack_note = narrow_choices(space.choices, spec.stack)
    target_choices, target_note = narrow_for_target(choices, spec.workload, spec.target_gpus)
    space = replace(space, choices=target_choices).require_configs()  # a replay surface's restriction kept
    settings = RunSettings(space.workload, space.hardware, memory_budget(spec.memory_budget_bytes, space.hardware),
                           spec.strategy_name, spec.backend_name, spec.seed, space.choices,
                           surface=None if spec.surface is None else str(Path(spec.surface).resolve()),
                           surface_sha256=None if spec.surface is None else sha256(spec.surface),
                           storage=None if spec.storage is None else canonical_storage(spec.storage),
                           stack=spec.stack, target_gpus=spec.target_gpus, policy=spec.policy_folder,
                           policy_sha256=spec.policy_sha256)
    return Resolved(settings, space, tuple(note for note in (*read_notes, stack_note, target_note) if note))


def _script_resolution(spec: TuneSpec) -> Resolved:
    """A script sweep's settings before the script has shown its model (`autotune tune --script`'s, from the
    library): the placeholder workload, the space unchecked (the first trial settles the global batch)."""
    check_surface(spec, "--script")
    hardware = spec.trial_hardware
    choices = spec.space if isinstance(spec.space, Choices) else choices_for(spec.space, hardware)
    choices, stack_note = narrow_choices(choices, spec.stack)
    settings = RunSettings(spec.workload, hardware, memory_budget(spec.memory_budget_bytes, hardware),
                           spec.strategy_name, "script", spec.seed, choices,
                           storage=None if spec.storage is None else canonical_storage(spec.storage), stack=spec.stack,
                           policy=spec.policy_folder, policy_sha256=spec.policy_sha256)
    return Resolved(settings, settings.space(), (stack_note,) if stack_note else ())


@dataclass(frozen=True)
class TuneResult:
    """What a sweep found: the best result within budget, every result in order, why it stopped, and where
    the recommendation and report are."""

    best: TrialResult | None
    results: tuple[TrialResult, ...]
    stop_reason: StopReason
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    verdict: str = ""
    files: tuple[Path, ...] = ()  # the outputs written (summary, recommended configs, report, plots)
    convergence: Convergence | None = None  # the chance of a better config after the last search trial
    notes: tuple[str, ...] = ()  # script mode: how to use the script's own config (Outputs.notes)

    @property
    def stopped(self) -> str:
        """Why it stopped, for people (with the convergence stop's figure)."""
        return self.stop_reason.describe(self.convergence)

    @property
    def best_ds_config(self) -> Path | None:
        return self._written("best_ds_config.json")

    @property
    def best_hf_ds_config(self) -> Path | None:
        """None where the sweep wrote none (no recommendation; script mode, whose script has its own launch)."""
        return self._written("best_hf_ds_config.json")

    def _written(self, name: str) -> Path | None:
        path = self.run_dir / name
        return path if self.best is not None and path.is_file() else None

    @property
    def launched(self) -> int:
        return sum(r.status != "pruned" for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        """What `autotune tune --json` prints: the recommendation, why the sweep stopped, the counts and the
        files (JSON types only)."""
        outputs = Outputs(self.best, self.summary, self.files, self.verdict).to_dict(self.run_dir)
        return {"run_dir": outputs.pop("run_dir"), "stop_reason": self.stop_reason.value,
                "stopped": self.stopped, "launched": self.launched, "recorded": len(self.results),
                "chance_of_better": None if self.convergence is None else self.convergence.chance, **outputs}


def tune(spec: TuneSpec, out: str | Path | None = None, *, resume: bool = False, executor: "RayOptions | None" = None,
         callbacks: Progress | None = None) -> TuneResult:
    """Run the sweep `spec` describes into the run directory `out` (default runs/<model>-<strategy>-<time>),
    or continue it there (`resume`), on this machine or on a Ray cluster (`executor`). `callbacks` hears of
    every trial (autotune.drivers.progress.Progress; ConsoleProgress prints what `autotune tune` prints).
    The one runner's case of one sweep (tune_many). Each argument of the wrong kind is one ConfigError naming it,
    before anything is written."""
    if not isinstance(spec, TuneSpec):
        raise ConfigError(f"spec {short(spec)}: allowed a TuneSpec, e.g. autotune.TuneSpec(autotune.make_workload("
                          "'tiny'), 'cpu', backend='simulated')")
    out = check_out_arg(out)
    if executor is not None:
        from autotune.drivers.ray import RayOptions

        if not isinstance(executor, RayOptions):
            raise ConfigError(f"executor {short(executor)}: allowed autotune.RayOptions(address) (trials on a Ray "
                              "cluster) or None (this machine)")
    check_callbacks(callbacks)
    plan = Plan(spec, out, resume, gpus_per_trial=executor.gpus_per_trial if executor is not None else None)
    return tune_many([plan], executor=executor, progress=lambda _: callbacks or QuietProgress())[0]


PROGRESS_METHODS = ("started", "finished", "pruned", "message")  # autotune.drivers.progress.Progress


def check_callbacks(callbacks: Any) -> None:
    """tune()'s `callbacks`: None, or a Progress (every one of its methods: a sweep calls each); else one line
    naming what is missing."""
    if callbacks is None:
        return
    missing = [name for name in PROGRESS_METHODS if not callable(getattr(callbacks, name, None))]
    if missing:
        raise ConfigError(f"callbacks {short(callbacks)}: allowed None or a Progress, an object with methods "
                          f"{', '.join(PROGRESS_METHODS)} (missing: {', '.join(missing)}), e.g. "
                          "autotune.ConsoleProgress() or a subclass of autotune.QuietProgress")


def check_out_arg(out: Any) -> Path | None:
    """tune()'s (and a Plan's) `out`: None (a new folder under runs/) or a folder's path, `~` expanded."""
    if out is None:
        return None
    return given_path(out, "out", "a run directory's path (str or pathlib.Path), or None: a new folder "
                      "runs/<model>-<strategy>-<time>")


def check_plans(plans: Any) -> None:
    """tune_many's plans: one or more Plans of a TuneSpec, no two with the same run directory (the second would
    find the first's lock, held by this very process)."""
    if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence) or not plans:
        raise ConfigError(f"plans {short(plans)}: allowed a list of one or more Plans")
    seen: dict[Path, int] = {}
    for i, plan in enumerate(plans):
        if not isinstance(plan, Plan) or not isinstance(plan.spec, TuneSpec):
            raise ConfigError(f"plan {short(plan)}: allowed a Plan of a TuneSpec")
        out = check_out_arg(plan.out)
        if out is None and plan.resume:  # a default run directory is a new one: nothing there to continue
            raise ConfigError("--resume needs --out DIR (the run directory to continue; from Python, resume=True "
                              "needs out=DIR)")
        if out is None:
            continue
        key = Path(os.path.abspath(out))
        if key in seen:
            raise ConfigError(f"plans {seen[key]} and {i} both have out={str(out)!r}: allowed one plan per run "
                              "directory (out=None gives each a new one)")
        seen[key] = i


@dataclass(frozen=True)
class Plan:
    """One sweep of the runner: what to tune, its run directory (None: runs/<model>-<strategy>-<time>) and whether
    it continues the sweep there; for one of many, its name, its resolution already checked (a sweep file's), the
    GPUs one real trial asks for on Ray (None: the workload's ranks) and its tracking parent run's name."""

    spec: TuneSpec
    out: str | Path | None = None
    resume: bool = False
    name: str | None = None
    resolved: Resolved | None = None
    gpus_per_trial: int | None = None
    tracking_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.resume, bool):  # "no" is a true string: it would resume
            raise ConfigError(f"resume {short(self.resume)}: allowed True (continue the sweep in `out`) or False")


@optuna_warnings_only()
def tune_many(plans: Sequence[Plan], *, executor: "RayOptions | None" = None,
              progress: Callable[[Plan], Progress] | None = None, say: Callable[[str], None] | None = None,
              resume_hint: str | None = None, started: Callable[[], None] | None = None) -> list[TuneResult]:
    """The one runner (issue 42): `autotune tune`, `autotune.tune()`, `autotune sweep` and script mode go through it.
    Every plan's checks pass before any run directory is written (plan_run); then each is held (its lock, a
    script's first trial, its settings written or checked: hold; `started()` once all are), opened (open_sweep),
    its trials run (on this machine one sweep after another, each backend's op preflight and launch spread decided
    here: run_here; on a Ray cluster all at once, one driver sharing it: drivers.ray.run_on_cluster), and its
    outputs written (close_run). `progress(plan)` gives each sweep's display (default: quiet); `say` hears the
    runner's own lines (default: the first sweep's display); `resume_hint`: what a resumed sweep whose settings
    differ is told to do. Returns each plan's TuneResult, in order. Ctrl-C (KeyboardInterrupt) during the checks
    raises (nothing was written); from the first run directory held on, anywhere, it ends every sweep with
    StopReason.INTERRUPTED, no exception (_Session)."""
    check_plans(plans)
    remove_stale_shm_at_start()  # what trials of a killed tuner left in /dev/shm, whatever its run
    shows = [progress(plan) if progress is not None else QuietProgress() for plan in plans]
    runs: list[RunPlan] = []
    for plan, show in zip(plans, shows):
        runs.append(plan_run(plan.spec, plan.out, plan.resume, executor, show, plan.resolved, plan.gpus_per_trial,
                             taken=[run.run_dir.path for run in runs]))
    say = say or shows[0].message
    session = _Session(plans, runs, shows, executor)
    results: list[TuneResult] = []
    try:
        with ExitStack() as stack:
            if executor is not None:
                stack.callback(_disconnect)  # a script's first trial may have connected (drivers/ray_script_first)
                if executor.address != LOCAL:  # a cluster that cannot be reached: one line before any run directory
                    connect(executor.address)
            session.checked = True
            try:
                session.hold_and_open(stack, resume_hint or RESUME_HINT, started)
                session.run(say)
            except KeyboardInterrupt:  # before the trials, or between them: every sweep ends INTERRUPTED
                session.interrupt()
            results = session.close()
    except KeyboardInterrupt:  # while the run directories were let go: what the sweeps were, nothing more written
        if not session.checked:
            raise  # during the checks (the cluster's connection): nothing was written
        return results or [session.interrupted(i) for i in range(len(runs))]
    return results


class _Session:
    """tune_many's sweeps from the moment their run directories are held: each held (hold), opened (open_sweep),
    run (here or on Ray) and closed (close_run). Ctrl-C (KeyboardInterrupt) anywhere in that ends every sweep
    INTERRUPTED, no exception: one opened has its outputs so far written, as an interrupted trial's sweep has; one
    not opened yet is told as it stands (`interrupted`), its directory as the same call accepts it again (a new
    sweep that recorded nothing: check_out)."""

    def __init__(self, plans: Sequence[Plan], runs: list[RunPlan], shows: list[Progress],
                 executor: "RayOptions | None") -> None:
        self.plans, self.runs, self.shows, self.executor = plans, runs, shows, executor
        self.checked = False  # every check passed: from here an interrupt ends the sweeps, not the call
        self.opened: dict[int, tuple[Sweep, Tracker]] = {}
        self.reasons: dict[int, StopReason] = {}
        self.backends: dict[int, Backend] = {}  # this machine's, until their loop (or an interrupt) closes them

    def hold_and_open(self, stack: ExitStack, resume_hint: str, started: Callable[[], None] | None) -> None:
        for run, show in zip(self.runs, self.shows):
            hold(stack, run, show, resume_hint)
        if started is not None:
            started()
        for i, (plan, run, show) in enumerate(zip(self.plans, self.runs, self.shows)):
            if run.ended is not None:  # a script's first trial showed it cannot be tuned as it is
                continue
            begun = getattr(show, "begun", None)
            if callable(begun):  # a display's headline (`autotune tune`), once the run directory is held
                begun(SweepStart(run.run_dir, run.settings, run.space, plan.spec.budget(), run.resume))
            own = plan.spec.search_strategy()  # None: settings.strategy's registered defaults
            if self.executor is None:  # this machine runs the trials: the backend now, its launch spread known
                self.backends[i] = run.objective or make_backend(  # closed by its loop (drivers/local.py)
                    run.settings, run.run_dir, replace(plan.spec.trial_options(), in_sequence=True))
            sigma = prior_sigma(run.settings.backend, self.backends.get(i))  # a simulation's own noise, if it says
            sweep, tracker, reason = open_sweep(stack, run.run_dir, run.settings, run.space, show, run.tracking, own,
                                                plan.tracking_name, sigma, plan.spec.wandb)
            self.opened[i] = sweep, tracker
            if run.resume:  # opened: its record read, nothing refused; `tune --resume` takes this budget next
                run.run_dir.record_budget(plan.spec.budget_record())
            if reason is not None:
                self.reasons[i] = reason
                self._close_backend(i)  # no loop will run it
                if len(self.plans) > 1:
                    show.message("no config of the space is predicted to fit: nothing runs for this workload")

    def run(self, say: Callable[[str], None]) -> None:
        todo = [i for i in self.opened if i not in self.reasons]
        if self.executor is None:
            for i in todo:
                backend = self.backends.pop(i)  # run_here closes it
                self.reasons[i] = run_here(self.opened[i][0], backend, self.plans[i].spec.budget(), self.shows[i])
                if self.reasons[i] is StopReason.INTERRUPTED:  # Ctrl-C in a trial: the next sweeps do not start
                    self.interrupt()
                    return
        elif todo:
            from autotune.drivers.ray import ClusterRun, run_on_cluster

            plans, runs = self.plans, self.runs
            executor = self.executor
            if executor.refuse_unplaceable is None:  # one workload (tune()): refused; several: each its verdict
                executor = replace(executor, refuse_unplaceable=len(plans) == 1)
            ran = run_on_cluster([ClusterRun(plans[i].name or runs[i].settings.workload.model.name, self.opened[i][0],
                                             runs[i].settings, runs[i].run_dir, plans[i].spec.budget(), self.shows[i],
                                             plans[i].gpus_per_trial, plans[i].spec.trial_options()) for i in todo],
                                 executor, say)
            self.reasons.update(zip(todo, ran))

    def interrupt(self) -> None:
        """Ctrl-C: every sweep without a stop reason stops INTERRUPTED, no backend is left open."""
        for i in list(self.backends):
            self._close_backend(i)
        for i in self.opened:
            self.reasons.setdefault(i, StopReason.INTERRUPTED)

    def close(self) -> list[TuneResult]:
        """Each sweep's result: its outputs written (close_run) when it was opened; a second Ctrl-C while they are
        written leaves the rest as they stand."""
        results = []
        hurried = False  # Ctrl-C while outputs were written
        for i, run in enumerate(self.runs):
            if i not in self.opened or hurried:  # ended by a script's first trial (its own result), or interrupted
                results.append(self.interrupted(i))
                continue
            sweep, tracker = self.opened[i]
            try:
                results.append(close_run(run.run_dir, run.settings, sweep, tracker, self.reasons[i], self.shows[i]))
            except KeyboardInterrupt:
                hurried = True
                results.append(self.interrupted(i))
        return results

    def interrupted(self, i: int) -> TuneResult:
        """Sweep `i` as Ctrl-C left it, its outputs not (re)written: what its record holds and its recommendation."""
        run = self.runs[i]
        if run.ended is not None:
            return run.ended
        opened = self.opened.get(i)
        if opened is not None:
            results, best = tuple(opened[0].results), opened[0].best
        else:
            results = tuple(recorded(run.run_dir))
            best = recommend(results, run.settings.memory_budget_bytes)
        if results:
            verdict = (f"interrupted: {len(results)} recorded in {run.run_dir.trials_path}; the same command with "
                       "--resume (resume=True from Python) continues it")
        else:
            verdict = (f"interrupted before its first trial: nothing was recorded in {run.run_dir.path}; the same "
                       "command starts the sweep")
        return TuneResult(best, results, StopReason.INTERRUPTED, run.run_dir.path, verdict=verdict)

    def _close_backend(self, i: int) -> None:
        backend = self.backends.pop(i, None)
        if backend is not None:
            backend.close()


def recorded(run_dir: RunDir) -> list[TrialResult]:
    """The trials a run directory records ([] where it records none, or where they cannot be read now)."""
    if not run_dir.trials_path.is_file():
        return []
    try:
        return run_dir.results()
    except (ConfigError, OSError, ValueError):
        return []


def run_here(sweep: Sweep, backend: Backend, budget: Budget, progress: Progress) -> StopReason:
    """One open sweep's trials on this machine (each op its backend's trials load built before the first trial that
    loads it: drivers/local.py); returns why it stopped."""
    try:
        for note in getattr(backend, "notes", ()):  # what reading its records changed (a replay surface's)
            progress.message(note)
    except BaseException:  # Ctrl-C before its loop, which closes it
        backend.close()
        raise
    return run_local(sweep, backend, budget, progress)


def _disconnect() -> None:
    if "ray" in sys.modules:  # connected only if imported
        from autotune.trials.cluster import disconnect

        disconnect()


@dataclass
class RunPlan:
    """One sweep's run directory, every check passed and nothing written yet (plan_run); `hold` then takes
    the directory and updates `settings` and `space` (a script's first trial) or sets `ended`."""

    spec: TuneSpec
    run_dir: RunDir
    resume: bool
    settings: RunSettings
    space: Space
    executor: "RayOptions | None"
    tracking: str | None
    objective: Backend | None
    before: set[str]  # the startup files already there (undone_unless_started)
    dir_flag: str  # how errors creating the directory name it
    ended: TuneResult | None = None
    notes: tuple[str, ...] = ()  # what reading the surface, the stack or the target changed: said once held (hold)


def plan_run(spec: TuneSpec, out: str | Path | None, resume: bool, executor: "RayOptions | None",
             progress: Progress, resolved: Resolved | None = None, gpus_per_trial: int | None = None,
             taken: Collection[Path] = ()) -> RunPlan:
    """Every check that can refuse a sweep, before anything is written to its run directory `out` (default
    runs/<model>-<strategy>-<time>, a new folder: none of `taken`, the other plans' run directories): the spec
    resolved (or `resolved`, already), a script's shipment to Ray and what one trial asks the cluster for
    (`gpus_per_trial`), the directory new or resumable, the study storage, the tracking URI."""
    out = check_out_arg(out)
    mode = spec.mode
    if executor is not None:
        mode.check_shipping(out)
    resolved = resolved or resolution(spec)
    settings, space = resolved.settings, resolved.space
    if executor is not None:
        from autotune.drivers.ray import trial_resources

        trial_resources(settings, gpus_per_trial)
    run_dir = RunDir(out if out is not None else default_run_dir(mode.run_name(settings), settings.strategy, taken))
    check_out(run_dir, resume)
    check_storage(settings.storage, run_dir.study_name(settings.storage), resume)
    objective = None if isinstance(spec.backend, str) else as_backend(spec.backend)
    if objective is not None and executor is not None:
        raise ConfigError("a backend object runs on this machine only: register a backend kind to run on Ray")
    tracking = tracking_uri(spec.mlflow_uri, run_dir.path)
    if tracking is not None:  # a server that does not answer: one line before anything is written, not minutes
        check_reachable_tracking(tracking)
    return RunPlan(spec, run_dir, resume, settings, space, executor, tracking, objective, startup_files(run_dir, resume),
                   "--out (`out`)" if out is not None else "the default run directory", notes=resolved.notes)


RESUME_HINT = "repeat the original command with --resume (from Python: the original TuneSpec with resume=True)"


def hold(stack: ExitStack, plan: RunPlan, progress: Progress, resume_hint: str = RESUME_HINT) -> RunPlan:
    """Take the planned run directory for the rest of `stack` (its lock; the startup files of a sweep that
    recorded no trial there before removed, for a new sweep, check_out; its own undone if it fails before its first
    trial; a full disk named), run a script's first trial (or read what a resumed one learned), and write the
    settings of a new sweep or check a resumed one's (`resume_hint`: what to do when they differ). `plan.ended` is
    set when the script's first trial ended the sweep."""
    run_dir = plan.run_dir
    make_dir(run_dir.path, plan.dir_flag)
    stack.enter_context(run_dir.locked())
    if not plan.resume and plan.before:  # a sweep that recorded no trial before (check_out): this one starts over
        if holds_trials(run_dir):  # recorded meanwhile, by a tuner that held it between the check and the lock
            raise already_held(run_dir)
        for name in STARTUP_FILES:
            (run_dir.path / name).unlink(missing_ok=True)
        plan.before = set()
    stack.enter_context(undone_unless_started(run_dir, plan.before))
    stack.enter_context(no_space_named(run_dir, plan.settings.storage))
    plan.settings, plan.space, plan.ended = plan.spec.mode.start(run_dir, plan.settings, plan.space, plan.resume,
                                                                  progress, plan.executor)
    if plan.ended is None:
        begin(run_dir, plan.settings, plan.resume, resume_hint, plan.spec.budget_record())
    for line in plan.notes:  # after a resumed sweep's settings are checked: a refusal is its one line
        progress.message(line)
    if plan.ended is not None:
        return plan
    if plan.resume:  # records that do not show training are read as untrained: say so once
        note = relabel_note(relabelled(run_dir.results()), run_dir.trials_path)
        if note:
            progress.message(note)
    return plan


# The backend kind whose trials train the built-in model (autotune.worker.model); simulated and replay only estimate
# or read, and script mode trains the user's own model.
BUILT_IN_TRAINER = "deepspeed"


def refuse_untrained(shape: ModelShape, named: str, instead: str) -> None:
    """ConfigError, one line, when real trials would get a model the built-in model does not build
    (autotune.values.shapes.untrained_reason: a mixture of experts, multi-head latent attention), before anything is
    written or launched: `named` is how the front end names the model (`--model X`, a sweep file's key), `instead`
    what it allows instead, in its words."""
    reason = untrained_reason(shape)
    if reason is not None:
        raise ConfigError(f"{named}: {reason} is estimated but not trained by the built-in model: {instead}")


class BuiltIn:
    """The built-in model (autotune.worker.model): resolved from the spec alone, nothing runs before the search,
    the handoff writes the recommendation."""

    def check(self, spec: TuneSpec) -> None:
        """Real trials of a model the built-in model does not build are refused (the front ends refuse it first,
        in their own words: autotune.commands.tune, autotune.commands.sweep_file)."""
        if isinstance(spec.backend, str) and spec.backend not in backend_names():
            kept = " (a training script's trials: TuneSpec.for_script)" if spec.backend in backend_names(sweep=None) else ""
            raise ConfigError(f"backend {spec.backend!r}: allowed {', '.join(backend_names())}{kept}")
        if spec.backend == BUILT_IN_TRAINER:
            refuse_untrained(spec.workload.model, f"model {spec.workload.model.name}",
                             "use backend 'simulated' to estimate it, or TuneSpec.for_script with your own training "
                             "script")

    def resolution(self, spec: TuneSpec) -> Resolved:
        return _model_resolution(spec)

    def run_name(self, settings: RunSettings) -> str:
        return settings.workload.model.name

    def check_shipping(self, out: str | Path | None) -> None:
        """Nothing travels: a node builds the model from the settings."""

    def start(self, run_dir: RunDir, settings: RunSettings, space: Space, resume: bool, progress: Progress,
              executor: "RayOptions | None") -> tuple[RunSettings, Space, "TuneResult | None"]:
        return settings, space, None


BUILT_IN = BuiltIn()


@dataclass(frozen=True)
class ScriptRun:
    """The user's own training script (autotune.outputs.script): its first trial shows the model and its global
    batch (`global_batch`: the recipe's override), its files travel with each trial to a Ray node, and its own
    DeepSpeed config with the tuned keys is the recommendation (own_outputs)."""

    path: str
    args: tuple[str, ...] = ()
    global_batch: int | None = None
    trial_timeout_s: float | None = None  # --trial-timeout: the first trial's limit too (None: the backend's)

    @property
    def script(self) -> "Script":
        from autotune.backends.script import Script

        return Script(self.path, self.args)

    def check(self, spec: TuneSpec) -> None:
        self.script  # noqa: B018  (the file exists and is Python)
        if spec.backend != "deepspeed":
            raise ConfigError(f"backend {spec.backend_name!r} with a script: a script's trials are real runs (backend "
                              "deepspeed)")
        if spec.target_gpus is not None:
            raise ConfigError(f"target_gpus {spec.target_gpus} with a script: a script runs at its launch's scale "
                              "(allowed: null)")

    def resolution(self, spec: TuneSpec) -> Resolved:
        return _script_resolution(spec)

    def run_name(self, settings: RunSettings) -> str:
        return f"script-{Path(self.path).stem}"

    def check_shipping(self, out: str | Path | None) -> None:
        """Its files travel with each trial: not too many."""
        from autotune.script.ship import plan

        plan(self.path, self.args, exclude=(out,) if out is not None else ())

    def start(self, run_dir: RunDir, settings: RunSettings, space: Space, resume: bool, progress: Progress,
              executor: "RayOptions | None") -> tuple[RunSettings, Space, "TuneResult | None"]:
        """Before its search: resumed, the workload its first trial learned; new, that first trial (on a Ray node
        with `executor`: autotune.drivers.ray_script_first), whose settings and space the sweep then uses. A first
        trial that shows the script cannot be tuned as it is ends the sweep: its outputs and a FATAL result."""
        from autotune.outputs import script as session

        if resume:
            settings = session.resumed(run_dir, settings, self.script, self.global_batch)
            stuck = session.unresumable(run_dir)  # its first trial ended it before the script showed its model
            if stuck is None:
                return settings, settings.space(), None
            progress.message(stuck[0])
            return settings, space, self.ended(run_dir, run_dir.read_settings(), progress, stuck[1])
        remote = None
        if executor is not None:
            from autotune.drivers.ray_script_first import first_trial_runner

            remote = first_trial_runner(executor, run_dir, settings, self.script, session.DEFAULT_TIMEOUT_S
                                        if self.trial_timeout_s is None else self.trial_timeout_s, progress.message)
        settings, space, fatal = session.first_trial(run_dir, settings, space, self.script, self.trial_timeout_s,
                                                     global_batch=self.global_batch, remote=remote,
                                                     say=progress.message)
        if fatal is None:
            return settings, space, None
        run_dir.write_settings(settings)
        return settings, space, self.ended(run_dir, settings, progress, fatal)

    def ended(self, run_dir: RunDir, settings: RunSettings, progress: Progress, fatal: str) -> "TuneResult":
        """The sweep ended by its first trial's verdict `fatal`: its outputs, their lines told, a FATAL result."""
        outputs = write_outputs(run_dir, settings, own=own_outputs(settings), stop_reason=StopReason.FATAL)
        for line in outputs.notes:
            progress.message(line)
        return TuneResult(None, tuple(run_dir.results()), StopReason.FATAL, run_dir.path, outputs.summary, fatal,
                          outputs.files, notes=outputs.notes)


def own_outputs(settings: RunSettings) -> OwnWriter | None:
    """What a sweep's run directory writes in place of the handoff's files: a script sweep's own config with the
    tuned keys (autotune.outputs.script), else None (the one place a run directory's settings are asked which)."""
    if settings.backend != "script":
        return None
    from autotune.outputs.script import outputs

    return outputs


@dataclass(frozen=True)
class SweepStart:
    """What `tune()` tells callbacks that have a `begun(start)` method, once the run directory is held and the
    settings are written (a new sweep) or checked (a resumed one), before the first trial."""

    run_dir: RunDir
    settings: RunSettings
    space: Space
    budget: Budget
    resumed: bool


def default_run_dir(name: str, strategy: str, taken: Collection[Path] = ()) -> Path:
    """runs/<model>-<strategy>-<time>; a Hub id's owner/name becomes owner--name (one folder). A default run
    directory is a new one: where that folder exists already (two sweeps started in one second) or another plan of
    the same call took it (`taken`), the first of <...>-2, <...>-3, ... that is free."""
    # One folder under runs/ whatever the names hold: a user strategy's name is the user's to choose ("a/../../x").
    strategy = re.sub(r"[/\\\x00]+", "-", strategy)
    # Within a file name's 255 bytes however long the names (the time and a -N suffix after them).
    model, strategy = (part.encode()[:limit].decode(errors="ignore")
                       for part, limit in ((name.replace("/", "--"), 128), (strategy, 96)))
    base = Path("runs") / f"{model}-{strategy}-{datetime.now():%Y%m%d-%H%M%S}"
    path, n = base, 1
    while os.path.lexists(path) or path in taken:
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_out(run_dir: RunDir, resume: bool) -> None:
    """A new sweep needs a directory that holds none, or one whose sweep recorded no trial (interrupted before its
    first result: it starts over, `hold`); a resumed one, the directory of one (its settings written); neither one
    that a live tuner holds (named first: its pid, not "pass --resume")."""
    holder = run_dir.busy()
    if holder is not None:
        raise RunDirBusy(f"{run_dir.path} is in use by another tuner (pid {holder}); wait for it to finish or choose "
                         "another --out (`out`)")
    if os.path.lexists(run_dir.path / SWEEP_COPY):  # `autotune sweep`'s directory: its workloads' folders are inside
        raise ConfigError(f"{run_dir.path} holds a batch sweep ({SWEEP_COPY}), not a run directory: choose another --out "
                          "(`out`)")
    if run_dir.trials_path.exists() and not os.path.lexists(run_dir.settings_path):
        raise ConfigError(f"{run_dir.path} holds a {run_dir.trials_path.name} but no {SETTINGS} (`autotune trial`'s "
                          "trials, or a sweep whose settings are gone): no sweep can be resumed or started over there; "
                          f"choose another --out (`out`), or restore the sweep's {SETTINGS} to resume it")
    if resume and not run_dir.exists():
        raise ConfigError(f"--resume (resume=True): {run_dir.path} holds no sweep to resume (nothing of one was "
                          "recorded there, e.g. one interrupted before it wrote its settings, or a script's interrupted in "
                          "its first trial): run the command without --resume (the call with resume=False)")
    if not resume and holds_trials(run_dir):
        raise already_held(run_dir)
    if not run_dir.exists():  # a new sweep would replace these, which no sweep of this folder wrote (logs/ it adds to:
        # a sweep that failed before its first trial leaves its error log or op build's there for the corrected command)
        found = [name for name in (*OUTPUT_FILES, run_dir.plots_dir.name, CALIBRATION_FILE)
                 if os.path.lexists(run_dir.path / name)]
        if found:
            raise ConfigError(f"{run_dir.path} holds {', '.join(found)} but no sweep (no {SETTINGS}): a new sweep "
                              "would write over them; choose another --out (`out`), or move them")
    if run_dir.exists():  # its trials.jsonl gone while its outputs count trials: not a sweep to start over on them
        check_not_gone(run_dir)


def already_held(run_dir: RunDir) -> ConfigError:
    return ConfigError(f"{run_dir.path} already holds a sweep: pass --resume (resume=True from Python) to continue it, "
                       "or choose another --out (`out`)")


def holds_trials(run_dir: RunDir) -> bool:
    """A trial is recorded there (trials.jsonl is not empty): the directory holds a sweep a new one must not
    replace. Its settings alone (run.json, the study, origin.json) are what a sweep interrupted before its first
    result left, which the same call, with resume or without, takes up."""
    try:
        return os.lstat(run_dir.trials_path).st_size > 0 or not run_dir.trials_path.is_file()
    except OSError:  # none there, or no folder to hold one (what making it says: make_dir)
        return False


# What a new sweep writes before its first trial (the lock stays: it records nothing). Removed again when the
# sweep fails before one (an unreachable Ray cluster, a fault), so that the corrected command is not refused
# with "already holds a sweep".
STARTUP_FILES = (SETTINGS, ORIGIN_FILE, STUDY, f"{STUDY}-wal", f"{STUDY}-shm", f"{STUDY}-journal")


@contextmanager
def undone_unless_started(run_dir: RunDir, before: set[str]) -> Iterator[None]:
    """Under the run directory's lock: if the sweep fails (not Ctrl-C) before recording any trial, remove the
    startup files it wrote, i.e. those not in `before` (a resumed sweep passes them all: nothing is removed)."""
    try:
        yield
    except Exception:
        if not run_dir.trials_path.exists():
            for name in set(STARTUP_FILES) - before:
                (run_dir.path / name).unlink(missing_ok=True)
        raise


@contextmanager
def no_space_named(run_dir: RunDir, storage: str | None) -> Iterator[None]:
    """A full disk met by the sweep as autotune.files.NoSpaceLeft naming where: the file that did not fit, or
    the study's database (SQLite's "database or disk is full", wrapped by Optuna as StorageInternalError)."""
    try:
        yield
    except NoSpaceLeft:
        raise
    except Exception as err:
        database = (masked(storage) or storage) if storage is not None else str(run_dir.study_path)
        full = disk_full(err)
        if full is None:
            read_only = read_only_named(err, database)  # SQLite's "attempt to write a readonly database", named
            if read_only is None:
                raise
            raise read_only from err
        raise NoSpaceLeft(full[0] or (database if full[1] == SQLITE_FULL else str(run_dir.path)), full[1]) from err


def startup_files(run_dir: RunDir, resume: bool) -> set[str]:
    """The startup files `undone_unless_started` keeps: all for a resumed sweep, else those already there."""
    return set(STARTUP_FILES) if resume else {n for n in STARTUP_FILES if (run_dir.path / n).exists()}


RESUME_DIFFERENCES_SHOWN = 6  # of a refused resume's differing settings, in its one line


def begin(run_dir: RunDir, settings: RunSettings, resume: bool, hint: str = RESUME_HINT,
          budget: dict[str, Any] | None = None) -> None:
    """Write a new sweep's settings, or check that a resumed one is started with the same (under its lock;
    `hint`: what the refusal tells the user to do); a new one's with this session's `budget` (a resumed one's is
    recorded once its sweep opened: _Session.hold_and_open)."""
    if resume:
        differences = run_dir.read_settings().differences(settings)
        if differences:  # the first ones name the flag at fault; a knob's values that follow from it, counted
            shown = "; ".join(differences[:RESUME_DIFFERENCES_SHOWN]) + (
                f"; and {len(differences) - RESUME_DIFFERENCES_SHOWN} more" if len(differences) > RESUME_DIFFERENCES_SHOWN
                else "")
            raise ConfigError(f"--resume (resume=True): {run_dir.path} was started with other settings ({shown}): {hint}")
    else:
        run_dir.write_settings(settings, budget)
    # This session's trials start here: launch.sh, also as `autotune report` writes it elsewhere, gives their environment.
    run_dir.write_json(ORIGIN_FILE, Origin.here().to_dict())


def open_sweep(stack: ExitStack, run_dir: RunDir, settings: RunSettings, space: Space, progress: Progress,
               tracking: str | None, strategy: Any = None, name: str | None = None,
               launch_sigma: float | None = None, wandb: str | None = None) -> tuple[Sweep, Tracker, StopReason | None]:
    """The Sweep of a held run directory with its tracker (open for the rest of `stack`; `name`: the MLflow
    parent run's), both given every hook when made: the tracker, `progress`'s lines, the launch spread of its
    backend (`launch_sigma`; None: its kind's); and StopReason.NOTHING_FITS when no config of the space is
    predicted to fit and nothing is recorded yet (nothing runs). A resumed sweep with a record carries on as the
    session it resumes would have (Sweep.refused_at_start): that session went on recording what its strategy
    proposed (each pruned) once its trials showed nothing fits, and stopping a resume of an interrupted one here
    left the configs it had not reached out of the record."""
    tracker = stack.enter_context(tracked(tracking, run_dir, settings, run_dir.results(), progress.message, name=name,
                                          wandb=wandb))
    hooks = Hooks(tracker, progress.pruned, progress.message)
    storage = run_dir.storage(settings.storage)
    stack.callback(release_storage, storage)  # a notebook's process outlives the sweep: no connection left open
    sweep = Sweep.open(run_dir, settings, space, strategy, hooks=hooks, launch_sigma=launch_sigma, storage=storage)
    return sweep, tracker, sweep.refused_at_start(space)


def release_storage(storage: Any) -> None:
    """The connections an Optuna RDB storage pools (study.db and its -wal and -shm files stay open otherwise)."""
    engine = getattr(storage, "engine", None)
    if engine is not None:
        engine.dispose()


def close_run(run_dir: RunDir, settings: RunSettings, sweep: Sweep, tracker: Tracker, reason: StopReason,
              progress: Progress) -> TuneResult:
    """The outputs of a sweep whose trials have ended (close_sweep), told to its tracker; `progress` hears a
    script sweep's lines on its own config."""
    # The record, not the sweep's list: Ctrl-C (or a closed terminal) between a trial's durable line and the list
    # leaves the record one trial ahead, and the outputs count what a resume finds.
    results = run_dir.results()
    outputs = close_sweep(run_dir, settings, sweep, results, reason)
    # The tracker keeps the record beside the outputs: every trial, why the session ended, the calibration
    record = [path for path in (run_dir.trials_path, run_dir.path / STOP_FILE, run_dir.path / CALIBRATION_FILE)
              if path.is_file()]
    tracker.finish(outputs.best, outputs.summary, [*outputs.files, *record], outputs.verdict, reason.value)
    for line in [*getattr(sweep.strategy, "notes", ()), *outputs.notes]:  # what following trials.jsonl changed
        progress.message(line)
    return TuneResult(outputs.best, tuple(results), reason, run_dir.path, outputs.summary, outputs.verdict,
                      outputs.files, sweep.convergence, outputs.notes)


def close_sweep(run_dir: RunDir, settings: RunSettings, sweep: Sweep, results: Sequence[TrialResult],
                reason: StopReason | None = None) -> Outputs:
    """Save the calibration and write the outputs of the recorded `results` (summary, recommended configs, report,
    plots; `reason`: why the session ended, recorded in summary.json and said in report.md)."""
    if sweep.pruner.calibration.samples:
        measured = sweep.measured()
        save_calibration(run_dir.path, sweep.pruner.calibration, settings.workload, settings.hardware,
                         quality(measured, settings.workload, settings.hardware, sweep.pruner.calibration))
    return write_outputs(run_dir, settings, results, own_outputs(settings), stop_reason=reason)
