"""PPO training of the masked policy on `autotune/DeepSpeedMemory-v0`, with RLlib's new API stack.

Why PPO: the action space is small and discrete with a mask per state, episodes are short (a handful of
trials), and the simulated environment is cheap, so an on-policy method with many short rollouts is a
good fit; PPO is RLlib's best-kept algorithm on the new stack and the one its action-masking example
targets. (DQN-style methods would need the mask inside the target's max as well; APPO/IMPALA pay off
only with many more CPUs than this machine has.)

Run directory (`--out`):
    settings.json       the training settings (a resumed run must keep those that shape the policy; its
                        `iterations`: the most asked for or trained, never fewer than its checkpoints hold)
    progress.jsonl      one line per iteration: timesteps, episodes, return, trials per episode,
                        fraction of episodes within 2% of the optimum, OOM trials, seconds
    checkpoints/NNNNNN  RLlib algorithm checkpoints: the last `keep_checkpoints` (2 by default, `--keep-checkpoints`;
                        0 keeps every one), the older ones removed as each new one completes
    checkpoints/latest  the name of the newest complete one (written after it and its policy's export)
    policy/             the policy exported at the last checkpoint (policy.pt + policy.json + PROVENANCE.md, written
                        whole beside it and swapped in: the previous complete policy or the new one), what
                        `autotune tune --strategy rl --policy RUN/policy` loads without Ray (as it loads
                        any folder `autotune rl export` writes)
    .lock               held by the training process (autotune.search.rundir.RunFolder): a second one is refused
    logs/               an internal error's traceback (autotune.cli)

`--out` is a new or empty folder, or one of these (`check_run_folder`): a folder holding anything else (a sweep's,
an exported policy) is refused before anything is written. A session stopped before its first checkpoint takes
back what it wrote (settings.json, progress.jsonl, a checkpoint cut short): the folder starts over with any flags.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from autotune.backends.factory import backend_names
from autotune.values.config import ConfigError
from autotune.files import _umask, fsync_dir, sha256, write_atomic
from autotune.trials.interrupts import deferred_signals, stop_signals_as_interrupt
from autotune.search.rundir import RunFolder
from autotune.values.settings import differences
from autotune.values.units import format_size, shown

if TYPE_CHECKING:
    from autotune.backends.replay import Surface

BACKENDS = backend_names(sweep=None, train=True)  # the kinds RL training runs on
# Settings that may differ when a run is resumed: they change how, not what, is trained.
RESUMABLE = ("iterations", "workers", "envs_per_worker", "checkpoint_every", "keep_checkpoints")
# Settings that only one backend reads: the other's training ignores them (not compared on resume, not said in
# the command or the provenance of its policy).
SIMULATED_ONLY = ("noise", "randomize", "pool_size", "cpu_share")
REPLAY_ONLY = ("surfaces", "memory_budget_bytes")
PROGRESS = "progress.jsonl"
TRAINING_ENV = "autotune-training"
SETTINGS = "settings.json"


@dataclass(frozen=True)
class TrainSettings:
    iterations: int = 100
    backend: str = "simulated"
    surfaces: tuple[str, ...] = ()  # replay backend: surface JSONL files drawn per episode
    # replay backend: memory budgets per device, one drawn per episode (EnvConfig.memory_budget); none: the
    # device's memory, where nothing a surface measured runs out of memory (`autotune rl train` gives
    # `replay_budgets` of its surfaces instead)
    memory_budget_bytes: tuple[int, ...] = ()
    seed: int = 0
    workers: int = 0  # remote env runners; 0 samples in the training process
    envs_per_worker: int = 4  # vectorised copies of the environment per runner
    horizon: int = 24  # trials per episode at most
    # Where episodes start (autotune.rl.simulator STARTS): at the estimator's best predicted config, as
    # `--strategy rl` does. ("mixed", half at random, trained slower towards a worse policy from there.)
    start: str = "estimator"
    noise: float = 0.1  # simulated step-time noise sigma (real timings scatter by 10-40%)
    # Training tasks the GPU sampler draws once and reuses (the CPU sampler a quarter as many). Each
    # environment copy caches every task's landscape (~0.1 s of estimator calls to build): a pool bigger
    # than that cache would rebuild landscapes all the time.
    pool_size: int = 384
    cpu_share: float = 0.25  # share of episodes on the CPU profile with search_spaces/cpu.yaml
    randomize: float = 0.3  # spread of the hidden truth around the estimator (autotune.rl.simulator)
    # The return is the best throughput found / optimum, minus trial costs and memory penalties
    # (envs/reward.py "improvement"): the search objective itself. ("throughput" also pays every trial's
    # own throughput, which favours stopping early at a merely good config.)
    reward: str = "improvement"
    # 0.003 rather than 0.01: a cheaper trial lets the policy search ~9 trials before it stops instead of ~5
    # (autotune/policies/default/PROVENANCE.md).
    trial_cost: float = 0.003
    # A price per trial-second in units of the task's trial at its predicted best (envs/reward.py; 0: every trial
    # alike). With the simulated worlds' GPU-like trial times, an offloaded optimizer's trial costs ~2x.
    second_cost: float = 0.0
    # The observation carries each action's predicted trial seconds (EnvConfig.observe_seconds): a policy priced in
    # seconds can then tell a cheap trial from a dear one before it runs it.
    observe_seconds: bool = False
    # An out-of-memory trial costs a trial and a little more: with the environment's default penalty
    # (0.5 + 0.5 x overshoot, against gains of at most 1 per episode) the policy learnt to stop early
    # rather than approach the memory cliff where the fast configs are.
    oom_penalty: float = 0.2
    hiddens: tuple[int, ...] = (128, 128)
    lr: float = 3e-4
    train_batch: int = 4096
    minibatch: int = 512
    epochs: int = 6
    entropy: float = 0.01
    gamma: float = 0.95
    checkpoint_every: int = 5
    keep_checkpoints: int = 2  # the newest checkpoints kept; 0: every one (`--keep-checkpoints`)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}: allowed {list(BACKENDS)}")
        if self.backend == "replay" and not self.surfaces:
            raise ConfigError("the replay backend needs at least one surface")
        if self.backend != "replay" and self.memory_budget_bytes:
            raise ConfigError(f"memory_budget_bytes is for the replay backend (the {self.backend} one draws a "
                              f"budget with each task)")
        for budget in self.memory_budget_bytes:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
                raise ConfigError(f"memory_budget_bytes: {budget!r}: must be a positive integer (bytes)")
        for name in ("iterations", "envs_per_worker", "horizon", "pool_size", "train_batch", "minibatch", "epochs",
                     "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        keep = self.keep_checkpoints
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ConfigError(f"keep_checkpoints={keep!r}: must be 0 (every one) or a positive integer")
        if self.workers < 0:
            raise ConfigError(f"workers={self.workers!r}: must be 0 or more")
        if not 0 <= self.cpu_share < 1:
            raise ConfigError(f"cpu_share={self.cpu_share!r}: must be in [0, 1)")
        if self.minibatch > self.train_batch:
            raise ConfigError(f"minibatch={self.minibatch} exceeds train_batch={self.train_batch} (--minibatch, "
                              "--train-batch): allowed a minibatch of at most the train batch")
        object.__setattr__(self, "surfaces", tuple(str(s) for s in self.surfaces))
        object.__setattr__(self, "memory_budget_bytes", tuple(self.memory_budget_bytes))
        object.__setattr__(self, "hiddens", tuple(int(h) for h in self.hiddens))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["surfaces"], out["hiddens"] = list(self.surfaces), list(self.hiddens)
        out["memory_budget_bytes"] = list(self.memory_budget_bytes)
        return out

    def applied(self) -> dict[str, Any]:
        """to_dict() without the settings this backend's training ignores."""
        return applied(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainSettings":
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ConfigError(f"unknown training setting(s) {unknown}: allowed {sorted(allowed)}")
        return cls(**{**data, "surfaces": tuple(data.get("surfaces", ())), "hiddens": tuple(data.get("hiddens", (128, 128))),
                      "memory_budget_bytes": tuple(data.get("memory_budget_bytes", ()))})

    def command(self, out: str | Path) -> str:
        """The `autotune rl train` command line that trains with these settings into `out`."""
        flags = ["--out", str(out), "--iterations", str(self.iterations), "--backend", self.backend]
        for surface in self.surfaces:
            flags += ["--surface", surface]
        if self.memory_budget_bytes:
            flags += ["--memory-budget", ",".join(map(str, self.memory_budget_bytes))]
        used = self.applied()
        for flag, key in (("--workers", "workers"), ("--seed", "seed"), ("--horizon", "horizon"), ("--noise", "noise"),
                          ("--randomize", "randomize"), ("--trial-cost", "trial_cost"),
                          ("--second-cost", "second_cost"),
                          ("--oom-penalty", "oom_penalty"), ("--train-batch", "train_batch"), ("--minibatch", "minibatch"),
                          ("--epochs", "epochs"), ("--pool-size", "pool_size"), ("--envs-per-worker", "envs_per_worker"),
                          ("--checkpoint-every", "checkpoint_every"), ("--keep-checkpoints", "keep_checkpoints")):
            if key in used:
                flags += [flag, str(getattr(self, key))]
        flags += ["--hiddens", ",".join(map(str, self.hiddens))]
        if self.observe_seconds:
            flags.append("--observe-seconds")
        return shlex.join(["autotune", "rl", "train", *flags])

    def env_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"backend": self.backend, "horizon": self.horizon, "start": self.start,
                                  "reward": {"mode": self.reward, "trial_cost": self.trial_cost,
                                             "second_cost": self.second_cost,
                                             "oom_penalty": self.oom_penalty, "over_budget_coef": self.oom_penalty,
                                             "failure_penalty": self.oom_penalty},
                                  "observe_seconds": self.observe_seconds,
                                  "cache_size": self.pool_size + max(1, self.pool_size // 4) + 8,
                                  # ~16 ms a step that training never reads (500x the step itself)
                                  "chance_info": False}
        if self.backend == "simulated":
            config.update(noise=self.noise, randomize=self.randomize, samplers=samplers(
                "train", self.pool_size, self.seed, self.cpu_share))
        else:
            config["surface"] = list(self.surfaces)
            if self.memory_budget_bytes:
                config["memory_budget"] = list(self.memory_budget_bytes)
        return config


def applied(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Training settings (TrainSettings.to_dict()) without those their backend ignores."""
    ignored = SIMULATED_ONLY if settings.get("backend") == "replay" else REPLAY_ONLY
    return {k: v for k, v in settings.items() if k not in ignored}


REPLAY_QUANTILES = (0.25, 0.5, 0.75, 1.0)


def replay_budgets(surfaces: Iterable["Surface"]) -> tuple[int, ...]:
    """The default budgets of replay training: the measured peaks of the surfaces' runs (pooled) at their
    quartiles and at the largest, so that an episode's budget cuts through the configs (three in four run out
    of memory at the lowest) or fits every one that ran. () where no run recorded a peak."""
    peaks = sorted(r.peak_memory_bytes for s in surfaces for r in s.results.values() if r.ok and r.peak_memory_bytes)
    if not peaks:
        return ()
    return tuple(sorted({peaks[round(q * (len(peaks) - 1))] for q in REPLAY_QUANTILES}))


def shown_budgets(budgets: Iterable[int]) -> str:
    return ", ".join(format_size(b) for b in budgets)


# Held out of every training split: the larger presets of the environment's sampler, and `tiny`, the
# model of the committed real surfaces, so that evaluating on them is evaluating on an unseen shape.
HELD_OUT_PRESETS = ("gpt2-large", "llama-13b", "tiny")
CPU_SAMPLER = {"profiles": ["cpu"], "held_out_profiles": [], "space": "cpu", "max_params": 1e9, "gpu_counts": [1, 2],
               # The CPU box has 24 GiB and small models: budgets down to a few percent make the cliff bite.
               "budget_fractions": [1.0, 0.5, 0.25, 0.12, 0.08, 0.05, 0.03], "held_out_budget_fractions": [0.08]}


def samplers(split: str, pool_size: int, seed: int, cpu_share: float) -> list[dict[str, Any]]:
    """WorkloadSampler settings (with weights) of the training tasks, or of a held-out split ("test")."""
    gpu: dict[str, Any] = {"weight": 1.0 - cpu_share, "split": split, "pool_size": pool_size, "seed": seed,
                           "held_out_presets": list(HELD_OUT_PRESETS)}
    cpu: dict[str, Any] = {**CPU_SAMPLER, "weight": cpu_share, "split": split, "pool_size": max(1, pool_size // 4),
                           "seed": seed + 1, "held_out_presets": list(HELD_OUT_PRESETS)}
    return [s for s in (gpu, cpu) if s["weight"] > 0]


@dataclass(frozen=True)
class Iteration:
    """One line of progress.jsonl."""

    iteration: int
    timesteps: int
    episodes: int
    episode_return: float | None
    trials: float | None  # trials per episode
    within_2pct: float | None  # fraction of episodes ending on a config within 2% of the optimum
    best_over_optimum: float | None
    oom_trials: float | None  # per episode
    seconds: float  # wall time of the whole run so far, over resumed sessions

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Start:
    """What a `train` call is about to do, once it holds its run folder and the settings are checked."""

    out: Path
    target: int  # the iterations asked for, over resumed sessions
    done: int  # the iterations of the checkpoint it resumes from (0: none)
    checkpoint: Path | None  # the checkpoint it resumes from

    @property
    def nothing_to_train(self) -> bool:
        return self.checkpoint is not None and self.done >= self.target


@dataclass(frozen=True)
class TrainResult:
    out: Path
    iterations: int
    resumed_from: int  # the iteration of the checkpoint resumed from (0: fresh)
    last: Iteration | None
    checkpoint: Path | None
    policy: Path | None


class TrainingRun(RunFolder):
    """The files of one training run (module doc). Not a sweep's RunDir (it holds no trials, study or
    report, and its settings are TrainSettings), but the same lock, atomic writes and fsync'd appends
    (autotune.search.rundir.RunFolder): one `autotune rl train` at a time trains into a directory."""

    holder = "trainer"

    checkpoints = property(lambda self: self.path / "checkpoints")
    policy = property(lambda self: self.path / "policy")

    def latest_checkpoint(self) -> Path | None:
        pointer = self.checkpoints / "latest"
        if not pointer.is_file():
            return None
        path = self.checkpoints / pointer.read_text().strip()
        return path if path.is_dir() else None

    def point_latest(self, name: str) -> None:
        """Move the `latest` pointer to checkpoint `name` (once it is complete)."""
        self.write_text("checkpoints/latest", name + "\n")

    def settings(self) -> TrainSettings | None:
        data = self.read_json(SETTINGS)
        return TrainSettings.from_dict(data) if data is not None else None

    def checkpoint_names(self) -> list[str]:
        """The checkpoint folders it holds (NNNNNN), oldest first."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p.name for p in self.checkpoints.iterdir() if p.is_dir() and p.name.isdigit())

    def discard(self, kept: Iterable[str] = ()) -> None:
        """Take back what a session that completed no checkpoint wrote: settings.json, progress.jsonl and the
        checkpoint folders other than `kept` (one cut short by the stop). Without them the folder holds no run, and
        training there starts over with any flags."""
        for name in (SETTINGS, PROGRESS):
            (self.path / name).unlink(missing_ok=True)
        for name in self.checkpoint_names():
            if name not in kept:
                shutil.rmtree(self.checkpoints / name, ignore_errors=True)
        pointer = self.checkpoints / "latest"
        if not kept and os.path.lexists(pointer):
            pointer.unlink()
        if self.checkpoints.is_dir() and not any(self.checkpoints.iterdir()):
            self.checkpoints.rmdir()

    def write_settings(self, settings: TrainSettings) -> None:
        self.write_json(SETTINGS, settings.to_dict())

    def progress(self) -> list[Iteration]:
        path = self.path / PROGRESS
        if not path.is_file():
            return []
        rows = []
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    rows.append(Iteration(**json.loads(line)))
                except (json.JSONDecodeError, TypeError):
                    break  # a line torn by a kill: everything after it is re-trained
        return rows

    def keep_progress(self, upto: int) -> list[Iteration]:
        """Drop progress lines of iterations after the checkpoint a resumed run restarts from."""
        rows = [r for r in self.progress() if r.iteration <= upto]
        self.write_text(PROGRESS, "".join(json.dumps(r.to_dict()) + "\n" for r in rows))
        return rows

    def append_progress(self, row: Iteration) -> None:
        self.append_line(PROGRESS, json.dumps(row.to_dict()))


RunDir = TrainingRun  # the name callers (autotune/commands/rl.py, tests) import


# What a training run's folder holds (module doc); anything else in --out is another tool's.
OWN_FILES = (SETTINGS, PROGRESS, "checkpoints", "policy", ".lock", "logs")
SWEEP_FILES = ("run.json", "trials.jsonl", "summary.json", "study.db")  # a `tune` sweep's (search/rundir.py)
POLICY_FILES = ("policy.pt", "policy.json")  # an exported policy's (rl/policy.py)
CHECKPOINT_FILES = ("rllib_checkpoint.json", "learner_group", "algorithm_state.pkl")  # an RLlib checkpoint's


RUN_FILES = (SETTINGS, PROGRESS, "checkpoints")  # a training run's own (OWN_FILES without the lock, logs, policy)
EXPORT_FILES = (*POLICY_FILES, "PROVENANCE.md")  # what `autotune rl export` writes into its --out (export_checkpoint)


def _own(name: str, own: Iterable[str] = OWN_FILES) -> bool:
    """One of `own` (a training run's files by default), or the temporary file or folder of an atomic write of one
    (files.atomic_output, export_checkpoint)."""
    own = tuple(own)
    return name in own or (name.endswith(".tmp") and any(name.startswith(f".{o}.") for o in own))


def _foreign_folder(path: Path, own: Iterable[str], kinds: Iterable[tuple[str, tuple[str, ...]]]) -> str | None:
    """What `path` holds when it is neither absent, nor empty, nor a folder of only `own` files: the first of `kinds`
    ((what, its files)) whose files it holds, or the files that are not `own`; None where it is one of those.
    ConfigError, one line, for a path that is not a folder or cannot be listed."""
    if not os.path.lexists(path):
        return None
    if not path.is_dir():
        return "a file"
    try:
        names = sorted(os.listdir(path))
    except OSError as err:
        raise ConfigError(f"{path}: cannot list it ({err.strerror or err.__class__.__name__})") from None
    own = tuple(own)
    foreign = [name for name in names if not _own(name, own)]
    if not foreign:
        return None

    def some(found: list[str]) -> str:
        listed = ", ".join(shown(n, 60) if not n.isprintable() or len(n) > 60 else n for n in found[:3])
        return listed + (f" and {len(found) - 3} more" if len(found) > 3 else "")

    for kind, files in kinds:
        if found := [n for n in files if n in names]:
            return f"{kind} ({some(found)})"
    if path.name == "checkpoints" and "latest" in names:
        return f"a training run's checkpoints (the run is {path.parent})"
    return f"files that are not {'a training run' if own == OWN_FILES else 'an exported policy'}'s ({some(foreign)})"


def _refuse_foreign(out: str | Path, own: Iterable[str], kinds: Iterable[tuple[str, tuple[str, ...]]], whose: str,
                    kept: tuple[str, str]) -> None:
    """ConfigError, one line, where `out` holds what `_foreign_folder` finds: not `whose` folder (`kept`: what --out
    takes besides a new or empty folder)."""
    path = Path(out)
    what = _foreign_folder(path, own, kinds)
    if what == "a file":
        raise ConfigError(f"{path} exists and is not a directory: give --out a new folder or {whose}")
    if what is not None:
        raise ConfigError(f"{path} holds {what}, not {kept[0]}: --out takes a new or empty folder, or {kept[1]}")


def check_run_folder(out: str | Path) -> None:
    """ConfigError, one line, where `out` is neither new, nor empty, nor a training run's folder: a `tune` sweep's,
    an exported policy's, a checkpoint's or any other folder of files is refused before anything is written there."""
    _refuse_foreign(out, OWN_FILES, (("a `tune` sweep", SWEEP_FILES), ("an exported policy", POLICY_FILES),
                                     ("an RLlib checkpoint", CHECKPOINT_FILES)), "a training run's",
                    ("an `autotune rl train` run", "the folder of a training run to resume it"))


def check_policy_folder(out: str | Path) -> None:
    """ConfigError, one line, where `out` (where `autotune rl export` writes a policy) is neither new, nor empty, nor
    an exported policy's folder (policy.pt, policy.json, PROVENANCE.md, which the export replaces): a training run's,
    a `tune` sweep's, a checkpoint's or any other folder of files is refused before anything is written there."""
    _refuse_foreign(out, EXPORT_FILES, (("an `autotune rl train` run", RUN_FILES), ("a `tune` sweep", SWEEP_FILES),
                                        ("an RLlib checkpoint", CHECKPOINT_FILES)), "an exported policy's",
                    ("an exported policy", "the folder of an earlier exported policy to replace it"))


def check_resumable(run: TrainingRun, settings: TrainSettings) -> None:
    """ConfigError, one line, where `run` holds a training run whose settings that shape the policy differ."""
    previous = run.settings()
    if previous is None:
        return
    given = {k: v for k, v in settings.applied().items() if k not in RESUMABLE}
    recorded = {k: v for k, v in previous.to_dict().items() if k in given}
    differ = differences(recorded, given)
    if differ:
        unsaved = "" if run.latest_checkpoint() is not None else \
            f" (it holds no checkpoint: remove {run.path / SETTINGS} to start over there with other settings)"
        raise ConfigError(f"{run.path} holds a training run with other settings ({'; '.join(differ)}): "
                          f"use another --out, or the same settings to resume it{unsaved}")


# What `rl export` takes, as its errors say.
CHECKPOINT_FORMS = "allowed a training run's folder (RUN), RUN/checkpoints, RUN/checkpoints/NNNNNN or RUN/checkpoints/latest"


def resolve_checkpoint(given: str | Path) -> Path:
    """The checkpoint folder `autotune rl export` exports: `given` itself (RUN/checkpoints/NNNNNN), or the one a
    `latest` pointer names, or the latest of a training run's folder (RUN) or of its `checkpoints` folder.
    ConfigError, one line, where there is none."""
    path = Path(given)
    if not os.path.lexists(path):
        hint = ""
        if path.parent.name == "checkpoints":
            run = TrainingRun(path.parent.parent)
            held = run.checkpoint_names()
            try:
                keep = (run.settings() or TrainSettings()).keep_checkpoints
            except ConfigError:
                keep = TrainSettings().keep_checkpoints
            kept = f"its newest {keep}" if keep else "every one"
            hint = (f" ({path.parent} holds {', '.join(held)}: the run keeps {kept}, --keep-checkpoints)"
                    if held else f" ({path.parent} holds no checkpoint)")
        raise ConfigError(f"{shown(str(path), 200)}: no such checkpoint{hint}; {CHECKPOINT_FORMS}")
    if path.is_dir() and path.name == "checkpoints" and (path / "latest").is_file():
        path = path / "latest"
    elif path.is_dir() and (path / "checkpoints").is_dir() and not (path / "learner_group").exists():
        run = TrainingRun(path)
        latest = run.latest_checkpoint()
        if latest is None:
            held = run.checkpoint_names()
            raise ConfigError(f"{path}: a training run without a complete checkpoint" +
                              (f" (its checkpoints folder holds {', '.join(held)}, none marked complete by "
                               f"checkpoints/latest)" if held else ": train it further, `autotune rl train --out "
                                                                   f"{path}`"))
        return latest
    if path.is_file():
        if path.name != "latest":
            raise ConfigError(f"{path} is a file: give a checkpoint folder (RUN/checkpoints/NNNNNN), a training run's "
                              f"folder (RUN: its latest checkpoint) or its checkpoints/latest")
        try:
            name = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot be read ({err.__class__.__name__})") from None
        target = path.parent / name
        if not name or "/" in name or not target.is_dir():
            raise ConfigError(f"{path} names checkpoint {shown(name)}, which {path.parent} does not hold")
        return target
    return path


def check_replay_budgets(surfaces: Iterable["Surface"], budgets: Iterable[int]) -> str | None:
    """Replay training's budgets against its surfaces: ConfigError, one line, where no config of any surface fits
    any of them (every episode would run out of memory, and nothing would be learnt of throughput); a one-line
    warning where some of them fit none (their episodes all run out of memory); None where every one fits some."""
    surfaces, budgets = list(surfaces), sorted(budgets)
    unfit = [b for b in budgets if not any(s.best(b) is not None for s in surfaces)]
    if not unfit:
        return None
    peaks = [r.peak_memory_bytes for s in surfaces for r in s.results.values() if r.ok and r.peak_memory_bytes]
    shown_unfit = shown_budgets(unfit)
    if not peaks:
        raise ConfigError(f"--memory-budget {shown_unfit}: no config of the surfaces ran (none is ok): every episode "
                          f"would fail")
    least = min(peaks)
    why = (f"no config of any surface fits {'it' if len(unfit) == 1 else 'them'} (the smallest measured peak is "
           f"{format_size(least)}, {least} bytes)")
    if len(unfit) == len(budgets):
        raise ConfigError(f"--memory-budget {shown_unfit}: {why}: every episode would run out of memory; give "
                          f"budgets of at least {-(-least // 2**20)}MiB")
    return (f"warning: --memory-budget {shown_unfit}: {why}: the episodes drawn at "
            f"{'it' if len(unfit) == 1 else 'them'} ({len(unfit)} of {len(budgets)} budgets) all run out of memory")


def checkpoint_iteration(checkpoint: Path | None) -> int:
    """The iteration a checkpoint of this module holds, by its name (NNNNNN); 0 for none or another name."""
    return int(checkpoint.name) if checkpoint is not None and checkpoint.name.isdigit() else 0


def prepare(out: str | Path, settings: TrainSettings) -> tuple[TrainingRun, TrainSettings, Path | None]:
    """The run directory, the settings it records, and the checkpoint to resume from (None: fresh).
    A directory holding a run resumes it, if the settings that shape the policy agree. The recorded
    `iterations` are those asked for, or those the checkpoint holds where it holds more: a run asked for fewer
    than it has trained says what it holds."""
    run = TrainingRun(out)
    check_resumable(run, settings)
    checkpoint = run.latest_checkpoint()
    run.path.mkdir(parents=True, exist_ok=True)
    recorded = replace(settings, iterations=max(settings.iterations, checkpoint_iteration(checkpoint)))
    run.write_settings(recorded)
    return run, recorded, checkpoint


def algorithm_config(settings: TrainSettings, env: Any = None) -> Any:
    """RLlib PPOConfig (new API stack) for the settings; `env` overrides the environment class (tests)."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from autotune.rl.callbacks import EpisodeFigures
    from autotune.rl.module import MaskedPolicyModule

    env_config = settings.env_config() if env is None else {}
    if env is None:
        from ray.tune.registry import register_env

        from autotune.rl.simulator import TrainingEnvFactory

        # RLlib takes an environment creator by registered name; each runner process unpickles its own.
        register_env(TRAINING_ENV, TrainingEnvFactory())
        env = TRAINING_ENV
    return (
        PPOConfig()
        .environment(env=env, env_config=env_config)
        .env_runners(num_env_runners=settings.workers, num_envs_per_env_runner=settings.envs_per_worker,
                     rollout_fragment_length="auto", num_cpus_per_env_runner=1)
        .learners(num_learners=0)
        .training(train_batch_size_per_learner=settings.train_batch, minibatch_size=settings.minibatch,
                  num_epochs=settings.epochs, lr=settings.lr, gamma=settings.gamma, lambda_=0.95,
                  entropy_coeff=settings.entropy, vf_loss_coeff=0.5, clip_param=0.2)
        .rl_module(rl_module_spec=RLModuleSpec(module_class=MaskedPolicyModule,
                                               model_config={"hiddens": list(settings.hiddens), "activation": "tanh"}))
        .callbacks(EpisodeFigures)
        .debugging(seed=settings.seed)
        .reporting(metrics_num_episodes_for_smoothing=100)
    )


def _metric(runners: Mapping[str, Any], key: str) -> float | None:
    value = runners.get(key)
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def iteration_row(result: Mapping[str, Any], seconds: float) -> Iteration:
    runners = result.get("env_runners", {})
    return Iteration(
        iteration=int(result["training_iteration"]),
        timesteps=int(result.get("num_env_steps_sampled_lifetime", runners.get("num_env_steps_sampled_lifetime", 0))),
        episodes=int(runners.get("num_episodes_lifetime", 0)),
        episode_return=_metric(runners, "episode_return_mean"), trials=_metric(runners, "trials"),
        within_2pct=_metric(runners, "within_2pct"), best_over_optimum=_metric(runners, "best_over_optimum"),
        oom_trials=_metric(runners, "oom_trials"), seconds=round(seconds, 2))


def training_meta(run: TrainingRun, checkpoint: str) -> dict[str, Any]:
    """How the policy of `checkpoint` was trained: command, settings and figures, from its run directory (named
    by its absolute path); the command and settings train to the checkpoint's own iteration."""
    settings = run.settings()
    if settings is not None and checkpoint.isdigit() and int(checkpoint) > 0:
        settings = replace(settings, iterations=int(checkpoint))
    rows = [r for r in run.progress() if not checkpoint.isdigit() or r.iteration <= int(checkpoint)]
    meta: dict[str, Any] = {
        "command": settings.command(run.path.resolve()) if settings else None,
        "settings": settings.to_dict() if settings else None, "checkpoint": checkpoint,
        "figures": rows[-1].to_dict() if rows else None, "progress": [r.to_dict() for r in rows],
        "exported": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if settings is not None and settings.backend == "replay":
        meta["surfaces"] = [{"path": path, "sha256": file_digest(path)} for path in settings.surfaces]
    return meta


def file_digest(path: str | Path) -> str | None:
    """The SHA-256 of a file's bytes, None where it cannot be read."""
    try:
        return sha256(path)
    except OSError:
        return None


def export_checkpoint(checkpoint: str | Path, folder: str | Path, meta: Mapping[str, Any] | None = None) -> Path:
    """The policy network of an RLlib checkpoint (or of the latest of a training run, `resolve_checkpoint`) as
    policy.pt + policy.json (loads without Ray), with PROVENANCE.md: the training command, seed and figures, when the
    checkpoint lies in a training run. `folder` is new, empty or an exported policy's (check_policy_folder): the
    policy is written into a temporary folder beside it, then swapped in whole (swap_in)."""
    checkpoint = resolve_checkpoint(checkpoint)  # a run's folder or its checkpoints/latest: the one it names
    module_dir = checkpoint / "learner_group" / "learner" / "rl_module" / "default_policy"
    if not module_dir.is_dir():
        raise ConfigError(f"{checkpoint}: not an RLlib algorithm checkpoint of this policy ({module_dir} is missing); "
                          f"{CHECKPOINT_FORMS}")
    check_policy_folder(folder)  # never over a run's, a sweep's or anyone's files: they would be replaced
    from ray.rllib.core.rl_module.rl_module import RLModule

    from autotune.rl.policy import layout, save_policy

    module: Any = RLModule.from_checkpoint(module_dir.resolve())  # a MaskedPolicyModule (spec, policy_state)
    if meta is None:
        from autotune.envs import ENV_ID
        from autotune.envs.observation import size

        meta = {**layout(module.spec.obs_dim == size(seconds=True)), "env": ENV_ID}
        run = TrainingRun(checkpoint.parent.parent)
        if run.settings() is not None:
            meta["training"] = training_meta(run, checkpoint.name)
    final = Path(folder)
    if final.is_symlink():
        final = final.resolve()  # the folder it names is replaced, the link stays
    final.parent.mkdir(parents=True, exist_ok=True)
    # Written whole beside it, then swapped in: the folder is the old complete policy or the new one, never a mix
    # or a half-written one (a Ctrl-C or a kill mid-export leaves at most a `.NAME.*.tmp` folder beside it).
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        os.chmod(staging, 0o777 & ~_umask())  # what mkdir would have made (mkdtemp makes it 0700)
        save_policy(staging, module.spec, module.policy_state(), meta)
        if meta.get("training"):
            write_atomic(staging / "PROVENANCE.md", provenance(meta["training"]))
        fsync_dir(staging)
        swap_in(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


RENAME_EXCHANGE = 2  # renameat2(2): swap two names in one step (Linux 3.15+, most local filesystems)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one step (renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc 2.28+, or not Linux
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    at_cwd = -100  # AT_FDCWD
    return renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), RENAME_EXCHANGE) == 0


def swap_in(new: Path, folder: Path) -> None:
    """Put the complete folder `new` at `folder` (same parent), the folder there before removed: in one step where
    the system can exchange two names, else by moving the old one aside first (a kill between the two renames leaves
    no folder, and the old one as a `.NAME.*.tmp` beside it)."""
    if os.path.lexists(folder) and _exchange(new, folder):
        shutil.rmtree(new, ignore_errors=True)  # `new` now names the old folder
    else:
        if os.path.lexists(folder):
            aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
            os.rename(folder, aside)  # onto the empty folder just made
            os.rename(new, folder)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(new, folder)
    fsync_dir(folder.parent)


def policy_exported(run: TrainingRun, checkpoint: Path) -> bool:
    """Whether the run's policy/ is complete (policy.pt, and policy.json that reads) and exported at `checkpoint`."""
    if not (run.policy / "policy.pt").is_file():
        return False
    try:
        meta = json.loads((run.policy / "policy.json").read_text())
    except (OSError, ValueError):
        return False
    training = meta.get("training") if isinstance(meta, dict) else None
    return isinstance(training, dict) and training.get("checkpoint") == checkpoint.name


PROVENANCE_ROWS = 30  # iterations PROVENANCE.md's figures show one by one; a longer run's table is thinned


def provenance(training: Mapping[str, Any]) -> str:
    """PROVENANCE.md of an exported policy."""
    settings = training.get("settings") or {}
    rows = training.get("progress") or []
    if len(rows) <= PROVENANCE_ROWS:
        shown, which = rows, "per iteration"
    else:  # a long run: its first iteration, every 5th and its last (progress.jsonl and policy.json hold every one)
        last = rows[-1]["iteration"]
        shown = [r for r in rows if r["iteration"] % 5 == 0 or r["iteration"] in (1, last)]
        which = f"iteration 1, every 5th and {last}, of {len(rows)} iterations; policy.json holds every one"
    lines = ["# Policy provenance", "",
             f"Trained by: `{training.get('command')}`", "",
             f"Seed {settings.get('seed')}; checkpoint {training.get('checkpoint')}; exported {training.get('exported')}.",
             "Algorithm: PPO (RLlib new API stack), masked MLP policy (autotune/rl/module.py) on "
             f"autotune/DeepSpeedMemory-v0 {environment(settings, training.get('surfaces'))}", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in applied(settings).items()), "",
             f"## Training figures ({which}; means over the last 500 episodes)", "",
             "| iteration | env steps | episodes | return | trials/episode | within 2% of optimum | best/optimum "
             "| OOM trials/episode | minutes |", "|---|---|---|---|---|---|---|---|---|"]

    def f(x: Any, pattern: str) -> str:
        return "-" if x is None else format(x, pattern)

    for r in shown:
        lines.append(f"| {r['iteration']} | {r['timesteps']:,} | {r['episodes']:,} | {f(r['episode_return'], '.3f')} | "
                     f"{f(r['trials'], '.2f')} | {f(r['within_2pct'], '.1%')} | {f(r['best_over_optimum'], '.3f')} | "
                     f"{f(r['oom_trials'], '.2f')} | {r['seconds'] / 60:.1f} |")
    return "\n".join(lines) + "\n"


def environment(settings: Mapping[str, Any], surfaces: Any) -> str:
    """What the policy's episodes were, for PROVENANCE.md: the distorted simulation, or the replayed surfaces
    (each with its SHA-256 when the export read it) at their budgets."""
    if settings.get("backend") != "replay":
        return "with the distorted simulation (autotune/rl/simulator.py)."
    digests = {s.get("path"): s.get("sha256") for s in surfaces or () if isinstance(s, Mapping)}
    shown = "; ".join(f"`{path}`" + (f" (SHA-256 {digests[path]})" if digests.get(path) else "")
                      for path in settings.get("surfaces") or ())
    budgets = settings.get("memory_budget_bytes") or []
    at = f"budgets {shown_budgets(budgets)}, one drawn per episode" if len(budgets) > 1 else \
        f"a budget of {shown_budgets(budgets)}" if budgets else "the device's memory"
    return f"replaying measured surfaces (autotune/backends/replay.py): {shown}; at {at}."


def connect_ray(address: str | None, workers: int) -> bool:
    """Connect to Ray: the cluster at `address` (autotune.drivers.ray.connect), or, without one (or with
    "local"), a private local instance sized for the runners. True if this call connected (the caller
    then disconnects); False if this process already was."""
    from autotune.trials.cluster import LOCAL, connect

    imported = sys.modules.get("ray")  # not imported here: only connect() needs Ray
    if imported is not None and imported.is_initialized():
        return False
    if address and address != LOCAL:
        connect(address)
    else:  # a local instance sized for the runners (with every core, Ray would start workers to match)
        connect(LOCAL, num_cpus=max(1, workers))
    return True


def train(out: str | Path, settings: TrainSettings, *, ray_address: str | None = None, env: Any = None,
          on_iteration: Callable[[Iteration], None] = lambda row: None,
          on_start: Callable[[Start], None] = lambda start: None,
          policy_meta: Mapping[str, Any] | None = None) -> TrainResult:
    """Train until `settings.iterations` (counted over resumed sessions), checkpointing every
    `checkpoint_every` iterations and at the end; a run whose checkpoint holds as many trains nothing (and
    starts no Ray), but exports its policy again where policy/ is missing, incomplete or of another checkpoint.
    `on_start` is told what it will do once the run folder is held and the settings are checked, before Ray starts.
    Ctrl-C or SIGTERM raise KeyboardInterrupt after stopping the algorithm and the Ray instance this call started;
    the last checkpoint stays. A stop that comes once every iteration is trained and the policy exported (while the
    algorithm and Ray stop) is no interrupt: the run is done."""
    from autotune.trials.cluster import disconnect

    check_run_folder(out)
    with TrainingRun(out).locked():
        run, _, checkpoint = prepare(out, settings)
        begun = Start(run.path, settings.iterations, checkpoint_iteration(checkpoint), checkpoint)
        on_start(begun)
        if begun.nothing_to_train:
            assert checkpoint is not None
            rows = [r for r in run.progress() if r.iteration <= begun.done]
            policy = _policy_of(run, checkpoint, policy_meta)
            return TrainResult(run.path, begun.done, begun.done, rows[-1] if rows else None, checkpoint, policy)
        held = run.checkpoint_names() if checkpoint is None else []
        connected = False
        algo = None
        done: TrainResult | None = None  # every iteration trained, its checkpoint complete and its policy exported
        try:
            connected = connect_ray(ray_address, settings.workers)
            with stop_signals_as_interrupt():  # installed after Ray's own handler
                algo = algorithm_config(settings, env).build_algo()
                resumed_from = 0
                if checkpoint is not None:
                    algo.restore_from_path(str(checkpoint.resolve()))
                    resumed_from = int(algo.iteration)
                rows = run.keep_progress(resumed_from)
                offset = rows[-1].seconds if rows else 0.0
                start = time.monotonic()
                last = rows[-1] if rows else None
                meta = dict(policy_meta) if policy_meta is not None else _default_meta(settings.observe_seconds)
                while algo.iteration < settings.iterations:
                    result = algo.train()
                    last = iteration_row(result, offset + time.monotonic() - start)
                    run.append_progress(last)
                    on_iteration(last)
                    if last.iteration % settings.checkpoint_every == 0 or last.iteration >= settings.iterations:
                        checkpoint = _checkpoint(algo, run, last, meta)
                        if last.iteration >= settings.iterations:
                            done = TrainResult(run.path, last.iteration, resumed_from, last, checkpoint, run.policy)
                        _prune(run, settings)
                if done is None:  # restored at (or past) the iterations asked for: its policy as it is
                    assert checkpoint is not None
                    done = TrainResult(run.path, int(algo.iteration), resumed_from, last, checkpoint,
                                       _policy_of(run, checkpoint, meta))
        except KeyboardInterrupt:
            if done is None:
                if checkpoint is None and run.latest_checkpoint() is None:  # stopped before its first checkpoint
                    run.discard(kept=held)
                raise
            # trained and exported: a stop now (while checkpoints are pruned) ends no work
        except BaseException:
            if checkpoint is None and run.latest_checkpoint() is None:
                run.discard(kept=held)
            raise
        finally:
            _stop(algo, disconnect if connected else None, finished=done is not None)
        assert done is not None
        return done


def _default_meta(seconds: bool) -> dict[str, Any]:
    from autotune.envs import ENV_ID
    from autotune.rl.policy import layout

    return {**layout(seconds), "env": ENV_ID}


def _policy_of(run: TrainingRun, checkpoint: Path, policy_meta: Mapping[str, Any] | None) -> Path | None:
    """The run's policy/ exported at `checkpoint`: exported again where it is missing, incomplete (an export cut
    short by an older version) or another checkpoint's. None, with a warning on stderr, where the checkpoint does
    not export (it is not an RLlib checkpoint of this policy)."""
    if policy_exported(run, checkpoint):
        return run.policy
    settings = run.settings()
    meta = dict(policy_meta) if policy_meta is not None else \
        _default_meta(settings.observe_seconds if settings is not None else False)
    try:
        return export_checkpoint(checkpoint, run.policy, {**meta, "training": training_meta(run, checkpoint.name)})
    except ConfigError as err:
        print(f"warning: {run.policy} could not be exported again from checkpoint {checkpoint.name}: {err}",
              file=sys.stderr)
        return None


def _stop(algo: Any, disconnect: Callable[[], None] | None, finished: bool) -> None:
    """Stop the algorithm and Ray with Ctrl-C, SIGTERM and SIGHUP held back: one that comes meanwhile cuts neither
    short (Ray's shutdown half done would leave its processes, and its exit handler would meet the signal). It
    changes nothing: a `finished` run is done, any other is ending on an exception (a stop: KeyboardInterrupt)
    already. A second signal stops the stopping (KeyboardInterrupt, unless the run is `finished`)."""
    try:
        with deferred_signals():
            if algo is not None:
                algo.stop()
            if disconnect is not None:
                disconnect()
    except KeyboardInterrupt:
        if not finished:
            raise


def _checkpoint(algo: Any, run: TrainingRun, row: Iteration, meta: Mapping[str, Any]) -> Path:
    """Save checkpoint NNNNNN, export its policy, then point `latest` at it: a stop before the pointer moves
    resumes from the previous one, whatever policy/ holds (the old complete one or the new one)."""
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    name = f"{row.iteration:06d}"
    path = run.checkpoints / name
    if path.exists():
        shutil.rmtree(path)
    algo.save_to_path(str(path.resolve()))  # RLlib's filesystem layer needs absolute paths
    export_checkpoint(path, run.policy, {**meta, "training": training_meta(run, name)})
    run.point_latest(name)
    return path


def _prune(run: TrainingRun, settings: TrainSettings) -> None:
    """Remove the checkpoints older than the newest `keep_checkpoints` (0: every one is kept)."""
    if settings.keep_checkpoints:
        for old in run.checkpoint_names()[:-settings.keep_checkpoints]:
            shutil.rmtree(run.checkpoints / old, ignore_errors=True)
