"""The GPU kit for a 15-minute window: one device call of at most 9 minutes that does everything (issue 25).

Phases, in order, each ending by its deadline (benchmarks/kit_plan.py; a phase that ends early leaves its time
to the next):

1. install: scripts/gpu-validate installs the bundle offline before this starts and says how long it took;
2. startup: this process's imports, the device probe and the plan;
3. preflight: the packages the later phases import, imported (seconds: tune and the trials' ranks in a child started
   as they are), then DeepSpeed's JIT ops that the recording's and tune's configs load, built once in a child
   (DeepSpeedBackend.preflight, autotune/trials/ops.py), so that no trial waits for a build;
4. recording: real surfaces of two models (llama-1b and llama-3b at sequence length 1024 on a GPU), pairs of
   configs on either side of each layout's predicted out-of-memory cliff, round-robin over the models, cliffs
   inside the range first, cheap layouts first among equals; a pair starts only if its expected time fits;
5. tune: `autotune tune` on the first model, as a user runs it (study.db, hybrid, `--confirm 1`; on the GPU with
   `--allocator expandable`, the recording having run PyTorch's default: `allocator_pairs`), under a memory
   budget that half of its space is predicted to fit, so that the cliff lies inside; stopped at its deadline as
   Ctrl-C would stop it;
6. analysis: per surface, gpu_validation's figures (peak error raw and calibrated, cliffs, replayed searches);
   tune's trials against the raw estimator;
7. pack: at most 8 files in --out (kit.md, kit.json, console.log, the two surfaces, tune's summary and report,
   logs.tar.gz with everything else).

    scripts/gpu-validate gpu-bundle -- --out DIR               # on the GPU machine: the whole call
    python benchmarks/gpu_kit.py --cpu --out DIR                # CI: the same phases at tiny scale, on the CPU

A second call with the same --work resumes the recording with layouts not recorded yet (the surfaces are analysed
whole) and runs tune in a fresh folder (work/tune-2, ...): no call reports an earlier call's results as its own.

Exit 0 with results written; 1 when the call ran but this machine cannot run its trials (a package the later phases
import is missing, the ops do not build, the ranks see no GPU), tune exits with an error, or the results could not be
packed (kit.md, kit.json and console.log written all the same); 2 before anything runs, nothing written: bad input,
or no CUDA GPU here without --cpu; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the kit's modules beside this file

import gpu_validation as gv  # noqa: E402
import kit_plan as kp  # noqa: E402
from kit_pack import MAX_FILES, PackError, check_folders, pack  # noqa: E402
from kit_tune import GRACE_S, TuneArgs, fresh_run_dir, run_until, tune_outcome, tune_succeeded  # noqa: E402

from autotune.values.argtypes import positive_float, positive_int  # noqa: E402
from autotune.cli import ArgumentParser  # noqa: E402
from autotune.values.config import Config, ConfigError  # noqa: E402
from autotune.prediction.estimate import estimate, states_fit  # noqa: E402
from autotune.values.hardware import PROFILES, Hardware  # noqa: E402
from autotune.values.results import TrialResult, read_results  # noqa: E402
from autotune.values.space import Choices, Space  # noqa: E402
from autotune.values.units import counted, format_size  # noqa: E402
from autotune.values.workload import PRESETS, ModelShape, Workload  # noqa: E402

GiB = 2**30
# tune's space: no optimizer offload on the GPU, so that its ops are the recording's (fused_adam) and no trial
# waits for DeepSpeedCPUAdam's first build (37 s on the H200); offload is measured in the recording.
TUNE_GPU_CHOICES = Choices(zero_stage=(0, 1, 2, 3), micro_batch=(1, 2, 4, 8, 16, 32), ckpt_interval=(0, 1),
                           precision=("bf16", "fp16"))  # fp16 too: no fp16 trial had trained before issue 40
TUNE_CPU_CHOICES = Choices(zero_stage=(0, 2), micro_batch=(1, 4, 16), ckpt_interval=(0, 1), precision=("fp32",))
# The CPU check records fp32 only: bf16 is emulated on most CPUs (~30x slower, issue 24).
RECORD_CPU_CHOICES = Choices(zero_stage=(0, 2), micro_batch=(1, 4, 16), ckpt_interval=(0, 1), precision=("fp32",),
                             offload_optimizer=("none", "cpu"))


@dataclass(frozen=True)
class KitMode:
    """What differs between the GPU call and the CPU check."""

    name: str  # cuda | cpu
    models: tuple[ModelShape, ...]
    seq_len: int | None  # None: each model's own
    global_batch: int
    record_choices: Choices
    tune_choices: Choices
    times: kp.TrialTimes
    overheads: kp.Overheads
    limit_s: float
    trial_timeout_s: float
    max_measure_s: float
    record_fit_share: float  # recording budget: this share of the first model's space is predicted to fit
    tune_fit_share: float  # tune's budget: likewise, of tune's space
    max_configs: int | None  # recorded configs at most (the CPU check keeps CI short)
    max_tune_trials: int | None  # tune's trials at most (None: as many as its time holds)
    seeds: int  # replayed searches per strategy in the analysis
    budget_unit: int  # budgets are whole multiples of this
    # tune's CUDA allocator mode (autotune.values.allocator): on the GPU, expandable segments, while the recording runs
    # PyTorch's default, so that one call measures both modes on the first model (`allocator_pairs`).
    tune_allocator: str = "default"


GPU_KIT = KitMode("cuda", (PRESETS["llama-1b"], gv.LLAMA_3B), 1024, 32, gv.GPU_CHOICES, TUNE_GPU_CHOICES,
                  kp.GPU_TIMES, kp.GPU_OVERHEADS, 540.0, 240.0, 8.0, 0.85, 0.5, None, None, 3, GiB, "expandable")
CPU_KIT = KitMode("cpu", gv.CPU_MODELS, None, 16, RECORD_CPU_CHOICES, TUNE_CPU_CHOICES, kp.CPU_TIMES,
                  kp.CPU_OVERHEADS, 1200.0, 180.0, 5.0, 0.5, 0.75, 4, kp.MIN_TUNE_TRIALS, 1, 32 * 2**20)


class Log:
    """Every line the kit prints, kept for console.log."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)


class Clock:
    """Seconds since the call started (the wrapper's start, install included)."""

    def __init__(self, started_at: float | None = None) -> None:
        ago = max(0.0, time.time() - started_at) if started_at is not None else 0.0
        self.origin = time.monotonic() - ago

    def now(self) -> float:
        return time.monotonic() - self.origin

    def at(self, offset_s: float) -> float:
        """The monotonic time of an offset from the start."""
        return self.origin + offset_s

    def left(self, offset_s: float) -> float:
        return offset_s - self.now()


@dataclass(frozen=True)
class PhaseRecord:
    name: str
    deadline_s: float
    start_s: float
    end_s: float
    outcome: str

    @property
    def past_deadline_s(self) -> float:
        return max(0.0, self.end_s - self.deadline_s)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "deadline_s": round(self.deadline_s, 1), "start_s": round(self.start_s, 1),
                "end_s": round(self.end_s, 1), "seconds": round(self.end_s - self.start_s, 1),
                "past_deadline_s": round(self.past_deadline_s, 1), "outcome": self.outcome}


# -- what to record -----------------------------------------------------------------------------------------

def kit_workload(shape: ModelShape, mode: KitMode) -> Workload:
    return Workload(replace(shape, seq_len=mode.seq_len) if mode.seq_len else shape, mode.global_batch)


def cliff_budget(peaks: Iterable[int], share: float, cap: int, unit: int = GiB) -> int:
    """A budget that `share` of the predicted `peaks` fit, a whole number of `unit`s (at least one), at most
    `cap`: the cliff then lies inside the space."""
    ranked = sorted(peaks)
    if not ranked:
        raise ConfigError("no configs to place a budget in")
    at = ranked[min(len(ranked) - 1, max(0, math.ceil(share * len(ranked)) - 1))]
    return min(cap, max(unit, math.ceil(at / unit) * unit))


def cliff_first_layouts(keys: Sequence[tuple], inside: Callable[[tuple], bool], cost: Callable[[tuple], float],
                        ) -> list[tuple]:
    """Layouts in the order the window takes them: each next one of the ZeRO stage taken least so far, then one
    whose cliff lies inside the micro-batch range (its pair straddles it), then the one whose other values were
    taken least, then the cheapest (gpu_validation.balanced_layouts' spread, the cliff and the clock first)."""
    remaining = sorted(keys)
    counts: Counter = Counter()
    order = []
    while remaining:
        best = min(remaining, key=lambda key: (counts[(0, key[0])], 0 if inside(key) else 1,
                                               sum(counts[(i, v)] for i, v in enumerate(key) if i), cost(key), key))
        remaining.remove(best)
        order.append(best)
        counts.update(enumerate(best))
    return order


def recording_groups(plan: gv.Plan, times: kp.TrialTimes) -> list[kp.Group]:
    """The plan's layouts as pairs straddling their predicted cliffs, in cliff_first_layouts' order, each with its
    configs' expected trial times."""
    space = plan.space
    predicted = {c: plan.predict(c) for c in space}
    fits = {c: predicted[c].peak_bytes <= plan.planning_budget for c in space}
    by_layout: dict[tuple, list[Config]] = defaultdict(list)
    for config in space:
        by_layout[gv.layout(config)].append(config)
    pairs = {key: gv.bracket(configs, fits.__getitem__) for key, configs in by_layout.items()}

    def seconds(config: Config, ahead: bool) -> float:
        est = predicted[config]
        return times.seconds(config, plan.workload.model.params, est.step_time_s, fits[config], ahead=ahead,
                             states_fit=states_fit(est, plan.workload, plan.planning_budget))

    def pair_seconds(key: tuple) -> tuple[float, ...]:
        # a pair's second trial runs on the rank its first started (11-30: its imports made ahead)
        return tuple(seconds(c, ahead=i > 0) for i, c in enumerate(pairs[key]))

    order = cliff_first_layouts(list(by_layout), lambda key: 0 < sum(fits[c] for c in by_layout[key]) < len(by_layout[key]),
                                lambda key: sum(pair_seconds(key)))
    return [kp.Group(plan.name, tuple(pairs[key]), pair_seconds(key)) for key in order]


def make_plans(mode: KitMode, hardware: Hardware, work: Path) -> list[gv.Plan]:
    """One gpu_validation.Plan per model. On a GPU the trials run under a budget at which `record_fit_share` of
    the first model's space is predicted to fit (at most the device): cliffs inside, on an 80 GB card as on a
    141 GB one. On the CPU they run under the host's memory and the pairs are placed at the median predicted
    peak (gpu_validation's CPU check: the device is the host's RAM)."""
    gv_mode = gv.Mode(mode.name, mode.record_choices, mode.global_batch, mode.times.launch_s, 0.0,
                      mode.trial_timeout_s, mode.times.measure_steps, mode.max_measure_s)
    workloads = [kit_workload(shape, mode) for shape in mode.models]
    first = Space(mode.record_choices, workloads[0], hardware)
    budget = cliff_budget((estimate(c, workloads[0], hardware).peak_bytes for c in first), mode.record_fit_share,
                          hardware.memory_bytes, mode.budget_unit)
    plans = []
    for workload in workloads:
        planning = budget
        if mode.name == "cpu":
            space = Space(mode.record_choices, workload, hardware)
            peaks = sorted(estimate(c, workload, hardware).peak_bytes for c in space)
            planning = peaks[(len(peaks) - 1) // 2]
        trial_budget = hardware.memory_bytes if mode.name == "cpu" else budget
        name = f"{hardware.name}-{workload.model.name}"
        plans.append(gv.Plan(workload, hardware, gv_mode, trial_budget, planning, work / "surfaces" / f"{name}.jsonl",
                             work / "logs" / name))
    return plans


def cap_groups(groups: Sequence[kp.Group], max_configs: int | None) -> list[kp.Group]:
    """The first groups holding at most `max_configs` configs (all without a cap)."""
    if max_configs is None:
        return list(groups)
    out, n = [], 0
    for group in groups:
        if n + len(group.configs) > max_configs:
            break
        out.append(group)
        n += len(group.configs)
    return out


def recorded_configs(path: Path) -> set[Config]:
    """The configs a surface already holds, whatever their status: record_surface (retries 0) runs none of them
    again."""
    return {r.config for r in read_results(path)} if path.exists() else set()


def unrecorded(groups: Sequence[kp.Group], recorded: set[Config]) -> list[kp.Group]:
    """The groups less the configs an earlier call recorded (a group recorded whole is left out): a second call
    with the same --work measures further layouts, as gpu_validation.py's second call does."""
    out = []
    for group in groups:
        kept = [(c, s) for c, s in zip(group.configs, group.seconds) if c not in recorded]
        if kept:
            out.append(kp.Group(group.model, tuple(c for c, _ in kept), tuple(s for _, s in kept)))
    return out


# -- tune's workload and budget ----------------------------------------------------------------------------

@dataclass(frozen=True)
class TunePlan:
    workload: Workload
    space: Space
    budget_bytes: int
    fit_share: float  # of tune's space predicted to fit the budget: inside (0, 1) puts the cliff in the space
    trial_s: float  # expected trial time of a config predicted to fit (median)


def make_tune_plan(mode: KitMode, hardware: Hardware) -> TunePlan:
    workload = kit_workload(mode.models[0], mode)
    hardware = hardware.with_(allocator=mode.tune_allocator)  # tune predicts its budget's cliff in its own mode
    space = Space(mode.tune_choices, workload, hardware)
    predicted = {c: estimate(c, workload, hardware) for c in space}
    budget = cliff_budget((p.peak_bytes for p in predicted.values()), mode.tune_fit_share, hardware.memory_bytes,
                          mode.budget_unit)
    fitting = [c for c in space if predicted[c].peak_bytes <= budget]
    seconds = [mode.times.seconds(c, workload.model.params, predicted[c].step_time_s, True) for c in fitting]
    # tune measures until its step times settle (3-20 steps): a few more steps than the recording's.
    trial_s = (statistics.median(seconds) if seconds else mode.times.launch_s) + 3 * statistics.median(
        predicted[c].step_time_s for c in fitting or space)
    return TunePlan(workload, space, budget, len(fitting) / len(space), trial_s)


def space_yaml(choices: Choices) -> str:
    lines = []
    for knob in ("zero_stage", "micro_batch", "ckpt_interval", "precision", "offload_optimizer", "offload_param"):
        lines.append(f"{knob}: [{', '.join(str(v) for v in getattr(choices, knob))}]")
    return "\n".join(lines) + "\n"


# -- the phases ---------------------------------------------------------------------------------------------

class Deadline(Exception):
    """The next trial would end past the phase's deadline."""


class Watched:
    """The backend a recording pair runs on: refuses a trial expected to end past the deadline, keeps what
    ran."""

    def __init__(self, inner: Any, model: str, deadline: float, expected: Callable[[Config], float],
                 ran: list[tuple[str, TrialResult]]) -> None:
        self.inner, self.model, self.deadline, self.expected, self.ran = inner, model, deadline, expected, ran
        self.name = inner.name

    def run(self, config: Config) -> TrialResult:
        if getattr(self.inner, "fatal", None):
            raise gv.KitError(self.inner.fatal)
        if time.monotonic() + self.expected(config) > self.deadline:
            raise Deadline()
        result = self.inner.run(config)
        self.ran.append((self.model, result))
        return result


def measured_scale(ran: Sequence[tuple[str, TrialResult]], expected: dict[tuple[str, Config], float]) -> float:
    """Measured over expected trial time so far (1 below two trials), within [0.5, 3]: what the next pairs are
    expected to take. A first-use op build is left out (the preflight should have done it)."""
    if len(ran) < 2:
        return 1.0
    planned = sum(expected[(m, r.config)] for m, r in ran)
    took = sum(r.wall_time_s - ((r.extra.get("phases_s") or {}).get("build_ops_s") or 0.0) for _, r in ran)
    return min(3.0, max(0.5, took / planned)) if planned > 0 else 1.0


# What the phases after the preflight import, imported at its start (seconds), so that a package the bundle lacks
# fails the call there in one line rather than after minutes of recording (11-26: tune's "No module named
# 'sqlalchemy'"). `?name`: found, not imported.
# The kit's own process: the recording's driver and the analysis (its top-level imports ran at its start).
KIT_IMPORTS = ("autotune.backends.deepspeed", "autotune.values.dsconfig", "autotune.drivers.recording",
               "autotune.worker.measure", "autotune.backends.replay", "autotune.prediction.calibrate", "scipy.stats")
# What it starts with `python -m` from its folder (tune_phase, the backend's ranks: this interpreter, this
# environment): tune's command and strategy, Optuna's storage of study.db (SQLAlchemy; alembic, which imports Mako)
# and the ranks' module. DeepSpeed is only found: the ops' child imports it next (seconds), and its one line names a
# module that DeepSpeed lacks.
CHILD_IMPORTS = ("autotune.cli", "autotune.commands.tune", "autotune.strategies.hybrid", "autotune.worker.main",
                 "optuna", "sqlalchemy", "sqlalchemy.orm", "alembic.command", "alembic.config", "alembic.migration",
                 "alembic.script", "?deepspeed")


def first_import_failure(names: Sequence[str]) -> str | None:
    """The first of `names` that cannot be imported (`?name`: found), as one line naming the missing module; None when
    all can. Runs in the kit's process and, as its source, in a child (import_failure_in_child)."""
    import importlib
    import importlib.util

    for entry in names:
        name = entry.lstrip("?")
        try:
            if entry.startswith("?"):
                if importlib.util.find_spec(name) is None:
                    return f"no module named {name!r}"
            else:
                importlib.import_module(name)
        except ModuleNotFoundError as err:
            missing = err.name or name
            return f"no module named {missing!r}" + ("" if missing == name else f" (imported by {name})")
        except Exception as err:  # there but failing to load (a broken or mismatched build): its first line
            return f"{name}: {type(err).__name__}: {err}".splitlines()[0]
    return None


def import_failure_in_child(names: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None,
                            timeout_s: float = 120.0) -> str | None:
    """first_import_failure in a child of this interpreter started as tune and the ranks are (the environment and
    folder given, default this process's: the folder's autotune/ first on its path)."""
    code = ("from __future__ import annotations\nimport sys\nfrom typing import Sequence\n"
            + inspect.getsource(first_import_failure)
            + "\nprint(first_import_failure(sys.argv[1:]) or '')\n")
    try:
        done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"the check's child failed: {err}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0:
        return f"the check's child exited {done.returncode}: {(done.stderr.strip().splitlines() or ['-'])[-1][:200]}"
    return lines[-1] if lines and lines[-1] else None


def check_imports(log: Log) -> None:
    """Raises KitError (one line naming the module) when the kit's process, or a child started as tune and the
    ranks are, cannot import what the later phases import."""
    def fix(failure: str, autotune: str) -> str:
        if "'autotune" in failure:
            return f"{autotune} lacks it"
        return ("install it for this Python: scripts/gpu-validate with a bundle that holds it (scripts/gpu-bundle's "
                "list of packages)")

    started = time.monotonic()
    failure = first_import_failure(KIT_IMPORTS)
    if failure:
        how = fix(failure, "the autotune on its path (the bundle's: rebuild it with scripts/gpu-bundle)")
        raise gv.KitError(f"the kit's Python ({sys.executable}) cannot import what its recording and analysis need: "
                          f"{failure}; fix: {how}")
    failure = import_failure_in_child(CHILD_IMPORTS)
    if failure:
        # 11-27: tune, started from the root, imported the checkout's autotune/, which lacked a module
        how = fix(failure, "the autotune/ that folder puts first (run from the root of a whole checkout)")
        raise gv.KitError(f"{sys.executable} started from {os.getcwd()}, as tune and the trials' ranks are, cannot "
                          f"import what they need: {failure}; fix: {how}")
    log(f"preflight: the later phases' packages import ({len(KIT_IMPORTS) + len(CHILD_IMPORTS)} modules, "
        f"{time.monotonic() - started:.1f} s)")


def preflight(plans: Sequence[gv.Plan], groups: Sequence[kp.Group], tune: TunePlan, timeout_s: float,
              log: Log) -> tuple[str, ...]:
    """Check that the later phases' packages import (check_imports: seconds), then build the ops the recording's and
    tune's configs load, once, before any trial (autotune.trials.ops; the ops depend on a config's optimizer and
    offload, not on its workload, so one backend asks for all)."""
    check_imports(log)
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.values.dsconfig import DsOptions

    plan = plans[0]
    backend = DeepSpeedBackend(plan.workload, memory_budget_bytes=plan.trial_budget, hardware=plan.hardware,
                               ds_options=DsOptions(force_ds_cpu_optimizer=False), logs_dir=plan.logs.parent)
    configs = [c for g in groups for c in g.configs] + list(tune.space)
    return backend.preflight(configs, lambda line: log(f"preflight: {line}"), timeout_s=timeout_s)


def record(plans: Sequence[gv.Plan], groups: Sequence[kp.Group], mode: KitMode, clock: Clock, deadline_s: float,
           seed: int, log: Log) -> dict[str, Any]:
    """Run the groups in order while each one's expected time (scaled by the trials measured so far) fits before
    `deadline_s`; a group that does not is skipped for a later, cheaper one. Every trial ends by the deadline
    plus a grace (its timeout)."""
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.values.dsconfig import DsOptions
    from autotune.drivers.recording import record_surface
    from autotune.worker.measure import MeasureSettings

    by_name = {p.name: p for p in plans}
    base = {(g.model, c): s for g in groups for c, s in zip(g.configs, g.seconds)}  # a config of either model
    settings = MeasureSettings(warmup_steps=mode.times.warmup_steps, min_steps=mode.times.measure_steps,
                               max_steps=mode.times.measure_steps, max_measure_s=mode.max_measure_s)
    ran: list[tuple[str, TrialResult]] = []
    scale, skipped, started = 1.0, 0, clock.now()
    for group in groups:
        left = clock.left(deadline_s)
        if group.total_s * scale > left:
            skipped += 1
            continue
        plan = by_name[group.model]
        # A group's trials run in sequence: its second on ranks started during its first (their imports off its clock).
        backend = DeepSpeedBackend(plan.workload, memory_budget_bytes=plan.trial_budget, hardware=plan.hardware,
                                   ds_options=DsOptions(force_ds_cpu_optimizer=False), logs_dir=plan.logs,
                                   timeout_s=min(mode.trial_timeout_s, max(30.0, left + GRACE_S)),
                                   measure=settings, seed=seed, in_sequence=True)
        seconds = dict(zip(group.configs, group.seconds))
        watched = Watched(backend, group.model, clock.at(deadline_s), lambda c: seconds[c] * scale, ran)
        try:
            record_surface(plan.space, watched, plan.path, only=group.configs, retries=0, order_seed=seed,
                           progress=lambda line, m=group.model: log(f"{m}: {line}"))
        except Deadline:
            skipped += 1
        finally:
            backend.close()  # the ranks its last trial started for a next one
        if backend.fatal:
            raise gv.KitError(backend.fatal)
        scale = measured_scale(ran, base)
        log(f"recording: {len(ran)} trials, {sum(r.wall_time_s for _, r in ran):.0f} s in trials of "
            f"{clock.now() - started:.0f} s, {clock.left(deadline_s):.0f} s left; trial time scale {scale:.2f}")
    elapsed = clock.now() - started
    trials_s = sum(r.wall_time_s for _, r in ran)
    per_model = Counter(model for model, _ in ran)
    return {"configs": len(ran), "per_model": dict(per_model),
            "status_counts": dict(Counter(r.status for _, r in ran)),
            "trials_s": trials_s, "phase_s": elapsed, "trial_share": trials_s / elapsed if elapsed > 0 else None,
            "groups_skipped": skipped, "time_scale": scale,
            "recorded_before": {p.name: len(recorded_configs(p.path)) - per_model.get(p.name, 0) for p in plans}}


def tune_phase(tune: TunePlan, mode: KitMode, hardware_arg: str, clock: Clock, deadline_s: float, scale: float,
               work: Path, seed: int, log: Log) -> dict[str, Any]:
    """`autotune tune` on the first model, given what is left until `deadline_s`."""
    available = clock.left(deadline_s)
    trial_s = tune.trial_s * scale
    fixed = mode.overheads.tune_fixed_s
    if available < fixed + trial_s:
        log(f"tune: {available:.0f} s left, less than one trial ({fixed + trial_s:.0f} s): not run")
        return {"ran": False, "note": f"{available:.0f} s left"}
    out = fresh_run_dir(work)  # never an earlier call's: its results stay, and this call reports its own
    space_file = work / f"{out.name}-space.yaml"
    space_file.write_text(space_yaml(mode.tune_choices))
    trials = kp.tune_trials_for(available, fixed, trial_s)
    args = TuneArgs(tune.workload.model.name, mode.seq_len, mode.global_batch, hardware_arg, space_file,
                    tune.budget_bytes, min(trials, mode.max_tune_trials or trials),
                    kp.tune_time_budget(available, fixed, trial_s), 1, out, seed,
                    tune.space.hardware.allocator)
    argv = args.argv()
    log(f"tune: {' '.join(argv[1:])}  (budget {format_size(tune.budget_bytes)}: {tune.fit_share:.0%} of its "
        f"{len(tune.space)} configs predicted to fit; ~{trial_s:.0f} s a trial, {available:.0f} s left)")
    ran = run_until(argv, clock.at(deadline_s), lambda line: log(f"tune: {line}"),
                    env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})  # no wrapped lines in the log
    outcome = tune_outcome(args.out)
    ok = tune_succeeded(ran.returncode, ran.interrupted, outcome["summary"])
    log(f"tune: exit {ran.returncode} after {ran.seconds:.0f} s{' (interrupted at the deadline)' if ran.interrupted else ''}"
        f"; {counted(outcome['trials'], 'trial')}, {counted(outcome['confirm_repeats'], 'confirmation repeat')}"
        + ("" if ok else f"; error: tune failed (exit {ran.returncode})"))
    return {"ran": True, "out": str(args.out), "succeeded": ok, "argv": argv[1:], "returncode": ran.returncode,
            "interrupted": ran.interrupted,
            "killed": ran.killed, "seconds": ran.seconds, "budget_bytes": tune.budget_bytes,
            "fit_share": tune.fit_share, "space_configs": len(tune.space), "trials_given": args.trials,
            "time_budget_s": args.time_budget_s, **outcome, "memory": tune_memory(args.out, tune),
            "measured": tune_measured(args.out)}


def tune_measured(out: Path) -> list[dict[str, Any]]:
    """Each trial tune launched (pruned ones were not): its status and measured peak."""
    path = out / "trials.jsonl"
    return [{"config": r.config.label(), "status": r.status, "peak_bytes": r.peak_memory_bytes}
            for r in (read_results(path) if path.exists() else []) if r.status != "pruned"]


def tune_memory(out: Path, tune: TunePlan) -> dict[str, Any]:
    """tune's ok trials against the raw estimator (in tune's allocator mode): predicted over measured peak."""
    path = out / "trials.jsonl"
    rows = []
    for r in read_results(path) if path.exists() else []:
        if r.ok and r.peak_memory_bytes:
            predicted = estimate(r.config, tune.workload, tune.space.hardware).peak_bytes
            rows.append({"config": r.config.label(), "peak_bytes": r.peak_memory_bytes, "predicted_bytes": predicted,
                         "ratio": predicted / r.peak_memory_bytes,
                         "allocated_bytes": r.extra.get("peak_allocated_bytes"),
                         "outside_bytes": r.extra.get("outside_allocator_bytes")})
    errors = [abs(row["ratio"] - 1) for row in rows]
    return {"allocator": tune.space.hardware.allocator, "trials": rows,
            "median_error": statistics.median(errors) if errors else None,
            "worst_error": max(errors) if errors else None}


def allocator_pairs(surface: Path, tune_out: Path) -> list[dict[str, Any]]:
    """The configs of the first model that both the recording (PyTorch's default allocator) and tune (GPU_KIT's
    tune_allocator) ran ok: peak, allocated peak and throughput in each mode, side by side (issue 25: whether
    expandable segments ever lose decides the default)."""
    def ok(path: Path) -> dict[Config, TrialResult]:
        return {r.config: r for r in (read_results(path) if path.exists() else []) if r.ok}

    recorded, tuned = ok(surface), ok(tune_out / "trials.jsonl")
    rows = []
    for config in sorted(set(recorded) & set(tuned)):
        a, b = recorded[config], tuned[config]
        rows.append({"config": config.label(), "peak_default": a.peak_memory_bytes,
                     "peak_tuned": b.peak_memory_bytes, "allocated_default": a.extra.get("peak_allocated_bytes"),
                     "allocated_tuned": b.extra.get("peak_allocated_bytes"),
                     "throughput_default": a.throughput_samples_per_s, "throughput_tuned": b.throughput_samples_per_s})
    return rows


def analysis(plans: Sequence[gv.Plan], mode: KitMode, clock: Clock, deadline_s: float, log: Log) -> list[dict]:
    surfaces = []
    for plan in plans:
        if not plan.path.exists():
            log(f"analysis: {plan.name}: nothing recorded")
            continue
        short = clock.left(deadline_s) < 5.0  # out of time: the figures without the replayed searches
        strategies = () if short else gv.STRATEGIES
        log(f"analysis: {plan.name}{' (no replayed searches: out of time)' if short else ''}")
        try:
            surfaces.append(gv.analyse(plan, mode.seeds, strategies, trials=20))
        except Exception as err:  # one surface's figures failing leaves the other's and the rest of the results
            log(f"analysis: {plan.name}: {type(err).__name__}: {err}")
    return surfaces


# -- which autotune each phase imports ----------------------------------------------------------------------

CHILD_PROBE = "import autotune; print(autotune.__file__)"
MAPPED = ("envs", "search_spaces")  # a checkout's top-level folders that the install puts inside autotune/


def package_files(package: Path) -> dict[str, str]:
    """sha256 of each .py and .yaml file of an autotune copy, by its path inside the installed package (a checkout's
    envs/ and search_spaces/ where the install puts them)."""
    roots = [(package, "")] + [(package.parent / name, f"{name}/") for name in MAPPED
                               if not (package / name).is_dir() and (package.parent / name).is_dir()]
    files = {}
    for root, prefix in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts and path.is_file():
                files[prefix + path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def digest(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]


def installed_version(package: Path) -> str | None:
    """The version in the dist-info beside an installed copy (None for a checkout)."""
    for meta in sorted(package.parent.glob("ds_autotune-*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def checkout_head(root: Path = HERE.parent) -> tuple[str | None, str]:
    """The checkout's HEAD (`+changes` when its tree differs) and how it was found, or None and why not."""
    git = shutil.which("git")
    if git is None:
        return None, "git is not installed here"
    if not (root / ".git").exists():
        return None, f"{root} is not a git checkout (no .git: a copy of the files)"
    try:
        head = subprocess.run([git, "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return None, f"git rev-parse HEAD failed: {head.stderr.strip()[:200]}"
        dirty = subprocess.run([git, "-C", str(root), "diff", "--quiet", "HEAD"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"git failed: {err}"
    return head.stdout.strip() + ("+changes" if dirty.returncode == 1 else ""), "git rev-parse HEAD"


def bundle_built_from(bundle: Path | None) -> str | None:
    if bundle is None or not (bundle / "BUNDLE.txt").is_file():
        return None
    for line in (bundle / "BUNDLE.txt").read_text(errors="replace").splitlines():
        if line.startswith("built_from="):
            return line.split("=", 1)[1].strip()
    return None


def same_commit(built_from: str, head: str) -> bool:
    """BUNDLE.txt's short commit names the checkout's HEAD (uncommitted changes on either side: the files decide)."""
    commit = built_from.split("+")[0]
    return commit not in ("", "unknown") and head.split("+")[0].startswith(commit)


def child_package(env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[Path | None, str]:
    """The autotune/ that `python -m autotune...` started from this process's folder imports: tune, the preflight's
    child and every trial's ranks (the folder comes first on their sys.path)."""
    try:
        done = subprocess.run([sys.executable, "-c", CHILD_PROBE], capture_output=True, text=True, timeout=120,
                              env=env, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"probe failed: {err}"
    if done.returncode != 0:
        return None, f"probe failed: {(done.stderr.strip().splitlines() or ['exit %d' % done.returncode])[-1][:200]}"
    return Path(done.stdout.strip().splitlines()[-1]).resolve().parent, "probe"


def autotune_copies(bundle: Path | None, kit_package: Path | None = None, children: Path | None = None,
                    head: tuple[str | None, str] | None = None) -> dict[str, Any]:
    """Which autotune each phase imports, and whether one call runs one version: the kit's own process (plan,
    recording's driver, analysis) imports the one on its sys.path (the bundle's, through scripts/gpu-validate); what it
    starts with `python -m` (the preflight's child, the trials' ranks, tune) imports the folder it starts in first
    (the checkout's, from the repository root). Warnings when the two differ or the bundle was built from another
    commit than the checkout's HEAD."""
    import autotune

    kit_package = (kit_package or Path(autotune.__file__).parent).resolve()
    if children is None:
        children, how = child_package()
    else:
        how = "given"
    head_commit, head_how = head or checkout_head()
    built_from = bundle_built_from(bundle)
    root = HERE.parent.resolve()

    def describe(package: Path | None) -> dict[str, Any]:
        if package is None:
            return {"path": None}
        files = package_files(package)
        checkout = package == (root / "autotune")
        return {"path": str(package), "files": len(files), "digest": digest(files),
                "source": "checkout" if checkout else "installed", "version": installed_version(package),
                "commit": head_commit if checkout else (built_from if bundle is not None else None)}

    kit, child = describe(kit_package), describe(children)
    differing = None
    if kit["path"] and child["path"]:
        a, b = package_files(kit_package), package_files(children)  # type: ignore[arg-type]
        names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
        differing, examples = len(names), names[:5]
    warnings = []
    if built_from is not None and head_commit is not None and not same_commit(built_from, head_commit):
        warnings.append(f"the bundle was built from {built_from} but the checkout is at {head_commit[:12]}"
                        f"{'+changes' if head_commit.endswith('+changes') else ''}: rebuild it with scripts/gpu-bundle")
    if differing:
        warnings.append(f"the kit's autotune ({kit['path']}) and its children's ({child['path']}) differ in "
                        f"{counted(differing, 'file')} ({', '.join(examples)}{', ...' if differing > 5 else ''}): "
                        "this call runs two versions")
    elif differing is None:
        warnings.append(f"could not tell which autotune the children import ({how})")
    return {"kit": kit, "children": child, "children_found_by": how, "differing": differing,
            "bundle": None if bundle is None else str(bundle), "bundle_built_from": built_from, "checkout_head": head_commit,
            "checkout_head_found": head_how if head_commit else f"not determinable here: {head_how}",
            "warnings": warnings}


# -- the results --------------------------------------------------------------------------------------------

def training(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """What each real trial's optimizer steps did (issue 40: every fp16 trial had skipped every step), from the
    recorded surfaces and tune's trials: its status, steps applied and skipped, loss first and last; and its launch
    to first measured step, its deepspeed.initialize, and the imports its ranks made before it where they were started
    ahead (issue 41, autotune.trials.runner.Spares: from tune's second trial on; on a GPU a spare also imports what
    initialize imports at its first call, autotune.worker.main.INITIALIZE_IMPORTS)."""
    rows = []
    for path in paths:
        for r in read_results(path) if path.exists() else []:
            if r.backend != "deepspeed" or r.status == "pruned":
                continue
            e = r.extra
            rows.append({"source": path.parent.name if path.name == "trials.jsonl" else path.stem,
                         "config": r.config.label(), "status": r.status, "fault": e.get("fault"),
                         "steps_applied": e.get("steps_applied"), "steps_skipped": e.get("steps_skipped"),
                         "loss_first": e.get("loss_first"), "loss_last": e.get("loss_last"),
                         "loss_scale": e.get("loss_scale"), "first_step_s": e.get("launch_to_first_step_s"),
                         "initialize_s": (e.get("phases_s") or {}).get("initialize_s"),
                         "import_ahead_s": e.get("import_ahead_s"),
                         # the memory window opens after an applied step: its number, and the state it found
                         "first_applied_step": e.get("first_applied_step"),
                         "optimizer_state_bytes": e.get("optimizer_state_bytes")})
    return rows


def trained(row: dict[str, Any]) -> bool:
    """An ok trial whose applied steps (not counted before issue 40: None) lowered the loss of its repeated batch."""
    first, last = row["loss_first"], row["loss_last"]
    return row["status"] == "ok" and row["steps_applied"] != 0 and first is not None and last is not None \
        and last < first


def tune_cliff(tune: dict) -> tuple[int, int]:
    """tune's measured trials that fit its budget (ok, peak within it) and that did not (out of memory, or a peak past
    the budget): one of each puts a measured cliff inside its space."""
    budget = tune.get("budget_bytes")
    fit = over = 0
    for row in tune.get("measured", []):
        if row["status"] == "oom" or (budget and row["peak_bytes"] and row["peak_bytes"] > budget):
            over += 1
        elif row["status"] == "ok":
            fit += 1
    return fit, over


def state_before_peak(row: dict[str, Any]) -> bool:
    """The trial's memory window opened after an applied step, with the optimizer's state allocated (issue 40: an
    fp16 trial that never stepped measured its peak without Adam's state)."""
    return row["first_applied_step"] is not None and bool(row["optimizer_state_bytes"])


def checks(mode: KitMode, plan: kp.CallPlan, recording: dict, tune: dict, seconds: float, files: int,
           steps: Sequence[dict[str, Any]] = (), copies: dict[str, Any] | None = None) -> dict:
    configs = recording.get("configs", 0)
    fit, over = tune_cliff(tune)
    ok_rows = [r for r in steps if r["status"] == "ok"]
    fp16 = [row for row in steps if " fp16" in f" {row['config']}"]
    fp16_trained = sum(trained(row) for row in fp16)
    target = kp.MIN_CONFIGS if mode.name == "cuda" else min(kp.MIN_CONFIGS, mode.max_configs or kp.MIN_CONFIGS)
    share = recording.get("trial_share")
    return {
        "recorded_configs": {"value": configs, "target": f">= {target}", "met": configs >= target},
        "models_recorded": {"value": len(recording.get("per_model", {})), "target": "2",
                            "met": len(recording.get("per_model", {})) >= 2},
        "recording_trial_share": {"value": share, "target": ">= 0.70", "met": share is not None and share >= 0.7},
        "tune_exit": {"value": tune.get("returncode") if tune.get("ran") else "not run",
                      "target": "0 (130: stopped at its deadline, summary written)",
                      "met": bool(tune.get("succeeded"))},
        "tune_confirmed": {"value": tune.get("confirm_repeats", 0), "target": ">= 1 repeat",
                           "met": tune.get("confirm_repeats", 0) >= 1},
        # Predicted: the budget tune was given. Measured: what its trials then showed (the CPU check's host rarely
        # takes a trial past the budget: its measured cliff is seldom inside).
        "tune_cliff_predicted_inside": {"value": tune.get("fit_share"), "target": "0 < share predicted to fit < 1",
                                        "met": tune.get("fit_share") is not None and 0 < tune["fit_share"] < 1},
        "tune_cliff_measured_inside": {"value": f"{fit} fit, {over} over",
                                       "target": ">= 1 trial fit, >= 1 over the budget",
                                       "met": fit >= 1 and over >= 1},
        "call_seconds": {"value": round(seconds, 1), "target": f"<= {plan.limit_s:.0f}", "met": seconds <= plan.limit_s},
        "result_files": {"value": files, "target": f"<= {MAX_FILES}", "met": files <= MAX_FILES},
        # Every ok trial trained; on a GPU, an fp16 one among them (the CPU check runs fp32 only).
        "ok_trials_trained": {"value": sum(trained(r) for r in ok_rows),
                              "target": f"= {len(ok_rows)} (every ok trial)", "met": all(trained(r) for r in ok_rows)},
        "peak_after_optimizer_state": {"value": sum(state_before_peak(r) for r in ok_rows),
                                       "target": f"= {len(ok_rows)} (every ok trial: an applied step, state bytes > 0)",
                                       "met": all(state_before_peak(r) for r in ok_rows)},
        "fp16_trained": {"value": fp16_trained, "target": ">= 1" if mode.name == "cuda" else "- (fp32 on the CPU)",
                         "met": fp16_trained >= 1 or mode.name != "cuda"},
        "one_autotune_copy": {"value": (copies or {}).get("differing", "-"),
                              "target": "0 files differ between the kit's and its children's autotune",
                              "met": (copies or {}).get("differing") == 0},
    }


def bundle_from(seen: dict[str, Any]) -> str:
    if seen.get("bundle_built_from"):
        return str(seen["bundle_built_from"])
    return "- (its BUNDLE.txt names none)" if seen.get("bundle") else "- (no --bundle: not run by scripts/gpu-validate)"


def copies_markdown(seen: dict[str, Any] | None) -> list[str]:
    """Which autotune each phase imported, the commits, and the warnings (autotune_copies)."""
    if not seen:
        return []

    def cell(copy: dict[str, Any]) -> str:
        if not copy.get("path"):
            return "- (not found)"
        made = (f"ds-autotune {copy['version']}" if copy.get("version") else copy.get("source", ""))
        commit = f", commit {copy['commit']}" if copy.get("commit") else ""
        return f"`{copy['path']}` ({made}{commit}; {copy['files']} files, digest {copy['digest']})"

    lines = ["", "| phases | autotune imported |", "| --- | --- |",
             f"| the kit's process: plan, recording's driver, analysis | {cell(seen['kit'])} |",
             f"| started with `python -m` from its folder: preflight, trials' ranks, tune | {cell(seen['children'])} |",
             "", f"Bundle built from {bundle_from(seen)}; checkout HEAD "
             f"{seen.get('checkout_head') or seen.get('checkout_head_found')}."]
    for warning in seen.get("warnings", []):
        lines += ["", f"**WARNING: {warning}.**"]
    return lines


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


def kit_markdown(report: dict[str, Any]) -> str:
    lines = ["# GPU kit: one call", "",
             f"`{report['command']}` on {report['machine']} (profile `{report['hardware']}`), "
             f"{report['seconds']:.0f} s of a {report['limit_s']:.0f} s limit.", "",
             "| phase | deadline | start | end | took | outcome |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for p in report["phases"]:
        late = p.get("past_deadline_s") or 0.0
        flag = f" **{late:.0f} s past its deadline**" if late >= 1.0 else ""
        lines.append(f"| {p['name']} | {p['deadline_s']:.0f} | {p['start_s']:.0f} | {p['end_s']:.0f} | "
                     f"{p['seconds']:.0f} s | {p['outcome']}{flag} |")
    lines += copies_markdown(report.get("autotune"))
    lines += ["", "| check | value | target | met |", "| --- | ---: | --- | --- |"]
    for name, c in report["checks"].items():
        value = c["value"]
        text = f"{value:.0%}" if name == "recording_trial_share" and value is not None else str(value)
        lines.append(f"| {name} | {text} | {c['target']} | {'yes' if c['met'] else 'no'} |")
    plan, rec = report["plan"], report["recording"]
    before = sum((rec.get("recorded_before") or {}).values())
    lines += ["", f"Planned: {counted(plan['recording_configs'], 'config')} {plan['recording_models']} in "
              f"{plan['recording_trials_s']:.0f} s of trials, tune {counted(plan['tune_trials'], 'trial')} of "
              f"~{plan['tune_trial_s']:.0f} s. Recorded: {counted(rec.get('configs', 0), 'config')} "
              f"{rec.get('per_model', {})}{f' (and {before} by earlier calls)' if before else ''}, "
              f"{rec.get('status_counts', {})}, {fmt_s(rec.get('trials_s'))} in trials of a "
              f"{fmt_s(rec.get('phase_s'))} phase; trial time scale {rec.get('time_scale', 1.0):.2f}."]
    tune = report["tune"]
    if tune.get("ran"):
        lines += ["", f"tune (`{tune.get('out')}`): {counted(tune['trials'], 'trial')} ({tune['status_counts']}), "
                  f"{counted(tune['confirm_repeats'], 'confirmation repeat')}, "
                  f"budget {format_size(tune['budget_bytes'])} ({tune['fit_share']:.0%} of "
                  f"{tune['space_configs']} configs predicted to fit), exit {tune['returncode']}"
                  f"{', interrupted at its deadline' if tune['interrupted'] else ''}; best {tune['best']}.", "",
                  "| tune trial | peak | predicted (raw) | predicted / peak |", "| --- | ---: | ---: | ---: |"]
        for row in tune["memory"]["trials"]:
            lines.append(f"| {row['config']} | {format_size(row['peak_bytes'])} | {format_size(row['predicted_bytes'])} "
                         f"| {row['ratio']:.2f} |")
        mode = tune["memory"].get("allocator", "default")
        pairs = tune.get("allocator_pairs") or []
        if pairs:  # none (the CPU check: both default): no line to read
            lines += ["", f"tune ran with the allocator `{mode}`, the recording with `default`: "
                      f"{counted(len(pairs), 'config')} of the first model ran in both.", "",
                      f"| config | peak: recording (default) | tune ({mode}) | allocated: recording | tune | "
                      "samples/s: recording | tune |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for row in pairs:
                cells = [format_size(row[k]) if row[k] else "-" for k in
                         ("peak_default", "peak_tuned", "allocated_default", "allocated_tuned")]
                lines.append(f"| {row['config']} | {' | '.join(cells)} | {row['throughput_default']:.3g} | "
                             f"{row['throughput_tuned']:.3g} |")
    elif tune:
        lines += ["", f"tune: not run ({tune.get('note', '')})."]
    if report.get("training"):
        lines += ["", "What each trial's optimizer steps did (a trial that did not train is `untrained`, not a "
                  "measurement; its peak was read from the first applied step on, with the optimizer state shown "
                  "allocated), and its launch to first measured step (imports made ahead: on ranks started during "
                  "the trial before):", "", "| source | config | status | steps applied | skipped | first applied | "
                  "optimizer state | loss first -> last | loss scale | launch to 1st step | initialize | "
                  "imports made ahead |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
        for row in report["training"]:
            loss = (f"{row['loss_first']:.4g} -> {row['loss_last']:.4g}"
                    if row["loss_first"] is not None and row["loss_last"] is not None else "-")
            status = row["status"] + (f" ({row['fault']})" if row["fault"] else "")
            first = row.get("first_applied_step")
            lines.append(f"| {row['source']} | {row['config']} | {status} | {row['steps_applied']} | "
                         f"{row['steps_skipped']} | {'-' if first is None else first} | "
                         f"{format_size(row.get('optimizer_state_bytes'))} | {loss} | "
                         f"{row['loss_scale'] if row['loss_scale'] else '-'} | "
                         f"{fmt_s(row.get('first_step_s'))} | {fmt_s(row.get('initialize_s'))} | "
                         f"{fmt_s(row.get('import_ahead_s'))} |")
    if report.get("analysis"):
        lines += ["", gv.markdown(report["analysis"]).replace("# GPU validation", "## Surfaces", 1)]
    return "\n".join(lines) + "\n"


# -- command line -------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="gpu_kit", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU check (CI): tiny models, DeepSpeed's CPU accelerator")
    parser.add_argument("--out", type=Path, default=HERE.parent / "runs" / f"gpu-kit-{time.strftime('%Y%m%d-%H%M%S')}",
                        help=f"results folder: at most {MAX_FILES} files (default: the repository's "
                             "runs/gpu-kit-<time>)")
    parser.add_argument("--work", type=Path, default=None,
                        help="surfaces, logs and tune's run directory (default: <out>-work beside --out), tarred "
                             "into the results")
    parser.add_argument("--limit", type=positive_float, default=None,
                        help=f"seconds for the whole call, install included (default {GPU_KIT.limit_s:g}; "
                             f"--cpu {CPU_KIT.limit_s:g})")
    parser.add_argument("--models", type=gv.model_list, default=None,
                        help="two models to record, the first also tuned (default: llama-1b,llama-3b; --cpu "
                             "tiny,tiny-llama)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help=f"tokens per sample (default {GPU_KIT.seq_len} on a GPU, the models' own with --cpu)")
    parser.add_argument("--global-batch", type=positive_int, default=None,
                        help=f"samples per optimizer step, recording and tune (default {GPU_KIT.global_batch}; --cpu "
                             f"{CPU_KIT.global_batch}); micro-batches that do not divide it leave the space")
    parser.add_argument("--seed", type=int, default=0, help="tune's seed and the trials' (default: %(default)s)")
    parser.add_argument("--bundle", type=Path, default=None,
                        help="the bundle folder scripts/gpu-validate installed (its BUNDLE.txt: which commit it was "
                             "built from)")
    parser.add_argument("--started-at", type=float, default=None,
                        help="epoch seconds the call started (scripts/gpu-validate: before its install)")
    parser.add_argument("--install-s", type=float, default=None, help="seconds the install took (scripts/gpu-validate)")
    parser.add_argument("--caller-dir", type=Path, default=None,
                        help="the folder scripts/gpu-validate was called from: a relative --out or --work is taken "
                             "from there (the script changes to the repository root)")
    args = parser.parse_args(argv)
    if args.caller_dir is not None:  # an absolute --out or --work stays as it is (Path's / keeps the right side)
        args.out = args.caller_dir / args.out
        args.work = None if args.work is None else args.caller_dir / args.work
    mode = CPU_KIT if args.cpu else GPU_KIT
    if args.models is not None:
        if len(args.models) != 2:
            parser.error(f"--models: {len(args.models)} models given: the kit records two")
        if args.models[0].name == args.models[1].name:
            parser.error(f"--models: {args.models[0].name} given twice: the kit records two different models")
        if args.models[0].name not in PRESETS:
            parser.error(f"--models: {args.models[0].name} is tuned too, so it must be one of tune's presets: "
                         f"{', '.join(PRESETS)}")
        mode = replace(mode, models=args.models)
    if args.seq_len is not None:
        mode = replace(mode, seq_len=args.seq_len)
    if args.global_batch is not None:
        mode = replace(mode, global_batch=args.global_batch)
    if args.limit is not None:
        mode = replace(mode, limit_s=args.limit)
    args.mode = mode
    if args.work is None:  # beside the results, never inside them: the results' tarball holds it
        args.work = args.out.parent / f"{args.out.name}-work"
    try:  # pack's rule, refused here before any phase runs rather than by pack after all of them
        check_folders(args.out, args.work)
    except PackError as err:
        parser.error(f"--out: {err}; allowed: a folder outside --work (by default --work is <out>-work, beside it)")
    return args


def detect(mode: KitMode) -> tuple[Hardware, str, str]:
    """The profile, a description of the machine, and tune's --hardware."""
    if mode.name == "cpu":
        return PROFILES["cpu"], "this machine's CPU, the CPU check", "cpu"
    from autotune.trials.devices import auto_hardware, probe

    machine = probe()
    if machine.accelerator != "cuda":
        raise ConfigError(f"no CUDA GPU found here ({machine.describe()}): run on a CUDA machine, or with --cpu")
    return auto_hardware(machine), machine.describe(), "auto"


def start_smi(path: Path) -> subprocess.Popen | None:
    """nvidia-smi's device memory every 250 ms, for the tarball (the H200 run's check on the measured peaks)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        return subprocess.Popen([smi, "--query-gpu=timestamp,memory.used", "--format=csv", "-lms", "250"],
                                stdout=out, stderr=subprocess.DEVNULL)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mode: KitMode = args.mode
    clock = Clock(args.started_at)
    log = Log()
    phases: list[PhaseRecord] = []
    report: dict[str, Any] = {"command": "benchmarks/gpu_kit.py " + " ".join(sys.argv[1:] if argv is None else argv),
                              "mode": mode.name, "limit_s": mode.limit_s}
    code = 0
    try:
        hardware, machine, hardware_arg = detect(mode)
        plans = make_plans(mode, hardware, args.work)
        tune = make_tune_plan(mode, hardware)
        recorded = {p.name: recorded_configs(p.path) for p in plans}  # by an earlier call with this --work
        queue = kp.interleave([unrecorded(recording_groups(p, mode.times), recorded[p.name]) for p in plans])
        queue = cap_groups(queue, mode.max_configs)
        call = kp.plan_holding_configs(mode.limit_s, mode.overheads, queue, tune.trial_s,
                                       tune_trials=mode.max_tune_trials or kp.TUNE_TRIALS)
    except (ConfigError, kp.PlanError) as err:
        print(f"gpu_kit: error: {err}", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    report.update(machine=machine, hardware=hardware.name, plan=call.to_dict(), recording={}, tune={},
                  global_batch=mode.global_batch)
    models = ", ".join(f"{p.name} ({gv.format_params(p.workload.model.params)}, seq {p.workload.model.seq_len})"
                       for p in plans)
    log(f"{machine}: profile {hardware.name}; models {models}, global batch {mode.global_batch}; recording budget "
        f"{format_size(plans[0].trial_budget)}")
    report["autotune"] = seen = autotune_copies(args.bundle)
    log(f"autotune: the kit {seen['kit']['path']} ({seen['kit'].get('digest')}), its children (preflight, trials, "
        f"tune) {seen['children']['path']} ({seen['children'].get('digest')}); checkout HEAD "
        f"{seen['checkout_head'] or seen['checkout_head_found']}; bundle built from {bundle_from(seen)}")
    for warning in seen["warnings"]:
        log(f"WARNING: {warning}")
    earlier = sum(map(len, recorded.values()))
    if earlier:
        log(f"recording: {counted(earlier, 'config')} recorded by earlier calls in {args.work}: this call measures "
            "further layouts; the analysis takes them all")
    log(f"plan ({mode.limit_s:.0f} s): " + ", ".join(f"{n} by {t:.0f} s" for n, t in call.deadlines)
        + f"; recording {call.recording_configs} configs {call.models()} in {call.recording_trials_s:.0f} s of "
          f"{call.planned_s('recording'):.0f} s; tune {call.tune_trials} trials of ~{call.tune_trial_s:.0f} s")
    if call.recording_configs < kp.MIN_CONFIGS and mode.name == "cuda":
        log(f"warning: the window holds {call.recording_configs} configs at the expected trial times, fewer than "
            f"{kp.MIN_CONFIGS}")
    smi = start_smi(args.work / "nvidia-smi-memory.csv") if mode.name == "cuda" else None
    install = args.install_s
    phases.append(PhaseRecord("install", call.deadline("install"), 0.0, install or 0.0,
                              f"{install:.1f} s (scripts/gpu-validate)" if install is not None
                              else "not run here (no bundle: run through scripts/gpu-validate)"))
    phases.append(PhaseRecord("startup", call.deadline("startup"), install or 0.0, clock.now(),
                              "imports, device probe, plan"))
    scale = 1.0
    try:
        start = clock.now()
        try:
            timeout = max(30.0, clock.left(call.deadline("recording")) * 0.5)
            ops = preflight(plans, queue, tune, timeout, log)
            log(f"preflight: ops ready in {clock.now() - start:.0f} s: {', '.join(ops) or 'none needed'}")
            phases.append(PhaseRecord("preflight", call.deadline("preflight"), start, clock.now(),
                                      f"ops ready: {', '.join(ops) or 'none needed'}"))
        except Exception as err:  # OpBuildFailed: one line; nothing else can run
            phases.append(PhaseRecord("preflight", call.deadline("preflight"), start, clock.now(), f"failed: {err}"))
            log(f"preflight: failed: {err}")
            raise gv.KitError(str(err)) from None
        start = clock.now()
        report["recording"] = record(plans, queue, mode, clock, call.deadline("recording"), args.seed, log)
        scale = report["recording"]["time_scale"]
        phases.append(PhaseRecord("recording", call.deadline("recording"), start, clock.now(),
                                  f"{report['recording']['configs']} configs, "
                                  f"{report['recording']['trial_share'] or 0:.0%} of the phase in trials"))
        start = clock.now()
        report["tune"] = tune_phase(tune, mode, hardware_arg, clock, call.deadline("tune"), scale, args.work,
                                    args.seed, log)
        if report["tune"].get("ran"):
            report["tune"]["allocator_pairs"] = allocator_pairs(plans[0].path, Path(report["tune"]["out"]))
        tuned = report["tune"]
        phases.append(PhaseRecord("tune", call.deadline("tune"), start, clock.now(),
                                  f"{counted(tuned.get('trials', 0), 'trial')}, "
                                  f"{counted(tuned.get('confirm_repeats', 0), 'repeat')}, exit {tuned['returncode']}"
                                  f" in {Path(tuned['out']).name}" if tuned.get("ran") else "not run"))
        if tuned.get("ran") and not tuned["succeeded"]:
            log(f"gpu_kit: tune failed (exit {tuned['returncode']}): see its lines above")
            code = 1
    except gv.KitError as err:
        log(f"gpu_kit: this machine cannot run the trials: {err}")
        code = 1
    except KeyboardInterrupt:
        log("gpu_kit: interrupted; writing what there is")
        code = 130
    except Exception as err:  # a window's results are worth more than the fault: log it, write them
        log(f"gpu_kit: internal error in a phase: {type(err).__name__}: {err}")
        log(traceback.format_exc().rstrip())
        code = 1
    start = clock.now()
    surfaces = analysis(plans, mode, clock, call.deadline("analysis"), log) if code != 130 else []
    report["analysis"] = {"command": report["command"], "machine": machine, "hardware": hardware.name,
                          "accelerator": hardware.accelerator, "memory_bytes": hardware.memory_bytes,
                          "minutes": 0.0, "seconds": clock.now(), "surfaces": surfaces}
    phases.append(PhaseRecord("analysis", call.deadline("analysis"), start, clock.now(), f"{len(surfaces)} surfaces"))
    if smi is not None:
        smi.terminate()
        smi.wait()
    start = clock.now()
    tune_out = Path(report["tune"]["out"]) if report["tune"].get("out") else None
    copies: dict[str, Path | None] = {p.path.name: p.path for p in plans}
    # this call's tune only (None: no file, and pack removes an earlier call's from --out)
    copies.update({"tune-summary.json": tune_out / "summary.json" if tune_out else None,
                   "tune-report.md": tune_out / "report.md" if tune_out else None})
    # and kit.md, kit.json, logs.tar.gz, console.log
    files = sum(path is not None and path.is_file() for path in copies.values()) + 4
    report["seconds"] = clock.now()
    phases.append(PhaseRecord("pack", call.deadline("pack"), start, clock.now(), f"{files} files"))
    report["phases"] = [p.to_dict() for p in phases]
    report["training"] = training([*(p.path for p in plans), *([tune_out / "trials.jsonl"] if tune_out else [])])
    report["checks"] = checks(mode, call, report["recording"], report["tune"], report["seconds"], files,
                              report["training"], copies=report["autotune"])
    texts = {"kit.json": json.dumps(gv.finite(report), indent=1) + "\n", "kit.md": kit_markdown(report)}
    try:
        written, unpacked = pack(args.out, copies, texts, args.work, reserved=1), None
    except PackError as err:  # never loses the summary: kit.md, kit.json and console.log still written
        args.out.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (args.out / name).write_text(text)
        written, unpacked = [args.out / name for name in texts], err
    log(kit_markdown(report))
    if unpacked is not None:
        log(f"gpu_kit: error: the results could not be packed ({unpacked}): {args.out} holds kit.md, kit.json and "
            f"console.log only; the surfaces and logs stay in {args.work}")
        code = code or 1
    log(f"gpu_kit: {len(written) + 1} files in {args.out} ({clock.now():.0f} s since the call started)")
    (args.out / "console.log").write_text("\n".join(log.lines) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
