"""A script's global batch: what the user's training recipe is, which a memory tuner must keep.

The global batch (samples per optimizer step, over every data-parallel rank) is part of what the model learns:
its learning rate and schedule are tuned for it. Script mode reads it from what the script hands DeepSpeed and
keeps it fixed; the trial only chooses how it is split (micro-batch x gradient accumulation x ranks). Sources:
- a DeepSpeed config (`from_ds_config`): `train_batch_size`, else `train_micro_batch_size_per_gpu` x
  `gradient_accumulation_steps` (default 1) x ranks, DeepSpeed's own arithmetic. Accelerate's
  `DeepSpeedPlugin` fills these keys before its `deepspeed.initialize` call, so its config arrives complete;
- Hugging Face `TrainingArguments` (`from_training_arguments`): per_device_train_batch_size x
  gradient_accumulation_steps x ranks (the Trainer's config holds "auto" there);
- any other loop that knows its micro-batch and accumulation (`ScriptBatch.of`).
`trial_keys` splits a kept global batch for one trial's micro-batch, `micro_batches` narrows the space to the
micro-batches that keep it, and `steps_needed` words the verdict of a script whose loop is too short for the
trial's accumulation. Nothing here imports DeepSpeed or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

from autotune.script.merge import BATCH_KEYS
from autotune.values.config import ConfigError
from autotune.values.units import counted
from autotune.values.workload import accumulation as accumulation_steps, micro_batch_divisors

DS_CONFIG = "DeepSpeed config"
TRAINING_ARGUMENTS = "TrainingArguments"


@dataclass(frozen=True)
class ScriptBatch:
    """The batch arithmetic a script runs with: global = micro_batch x accumulation x ranks."""

    global_batch: int
    micro_batch: int
    accumulation: int
    ranks: int
    source: str  # where it was read: DS_CONFIG, TRAINING_ARGUMENTS, ...
    # Where the config's batch keys disagree at these ranks (DeepSpeed would refuse it): what they make instead of
    # train_batch_size, which is kept (micro_batch and accumulation are then a split of it, not the script's own).
    conflict: str = ""

    def __post_init__(self) -> None:
        for key in ("global_batch", "micro_batch", "accumulation", "ranks"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"the script's {key} {value!r}: must be a positive integer")
        if self.global_batch != self.micro_batch * self.accumulation * self.ranks:
            raise ConfigError(f"the script's global batch {self.global_batch} is not its micro-batch "
                              f"{self.micro_batch} x accumulation {self.accumulation} x {self.ranks} rank(s)")

    @classmethod
    def of(cls, micro_batch: int, accumulation: int, ranks: int, source: str) -> "ScriptBatch":
        return cls(micro_batch * accumulation * ranks, micro_batch, accumulation, ranks, source)

    def describe(self) -> str:
        """e.g. `1 (micro-batch 1 x gradient accumulation 1 x 1 rank, from the DeepSpeed config)`."""
        if self.conflict:
            return (f"{self.global_batch} (train_batch_size of the {self.source}; the script's batch keys disagree "
                    f"at {self.ranks} rank{'s' if self.ranks > 1 else ''}, which DeepSpeed refuses: {self.conflict}; "
                    "train_batch_size wins)")
        return (f"{self.global_batch} (micro-batch {self.micro_batch} x gradient accumulation {self.accumulation} "
                f"x {self.ranks} rank{'s' if self.ranks > 1 else ''}, from the {self.source})")

    def to_dict(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "micro_batch": self.micro_batch,
                "accumulation": self.accumulation, "ranks": self.ranks, "source": self.source,
                **({"conflict": self.conflict} if self.conflict else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ScriptBatch":
        return cls(data["global_batch"], data["micro_batch"], data["accumulation"], data["ranks"], data["source"],
                   data.get("conflict", ""))


def _positive(value: Any) -> int | None:
    """A batch key's value if it is a positive integer ("auto", None, junk: unknown)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def from_ds_config(config: Mapping[str, Any], ranks: int, source: str = DS_CONFIG) -> ScriptBatch | None:
    """The batch a DeepSpeed config asks for on `ranks` data-parallel ranks, by DeepSpeed's rules
    (deepspeed.runtime.config: any two of the three keys fix the third; one key alone means no accumulation);
    None when it sets no batch size (or only "auto"). Keys that disagree at these ranks (DeepSpeed refuses such a
    config: e.g. train_batch_size 8 with train_micro_batch_size_per_gpu 8 on 2 ranks) keep train_batch_size, the
    samples per optimizer step the recipe states, split as micro-batch train_batch_size / ranks (`conflict` says
    what the keys made); ConfigError where train_batch_size is no multiple of the ranks (no split keeps it)."""
    total = _positive(config.get("train_batch_size"))
    micro = _positive(config.get("train_micro_batch_size_per_gpu"))
    accumulation = _positive(config.get("gradient_accumulation_steps"))
    if total is None:
        return ScriptBatch.of(micro, accumulation or 1, ranks, source) if micro is not None else None
    if micro is None:
        micro, rest = divmod(total, (accumulation or 1) * ranks)
        accumulation = accumulation or 1
    elif accumulation is None:
        accumulation, rest = divmod(total, micro * ranks)
    else:
        rest = total - micro * accumulation * ranks
    if not rest and micro and accumulation:
        return ScriptBatch(total, micro, accumulation, ranks, source)
    if total % ranks:
        raise ConfigError(f"the script's {source} sets train_batch_size {total}, which is no multiple of its {ranks} "
                          "ranks: no micro-batch x gradient accumulation keeps it; give it a multiple of the ranks, "
                          "or pass --global-batch")
    given = [f"{key} {config[key]}" for key in BATCH_KEYS[1:] if _positive(config.get(key)) is not None]
    made = " x ".join([*given, f"{ranks} rank{'s' if ranks > 1 else ''}"])
    return ScriptBatch(total, total // ranks, 1, ranks, source, conflict=f"{made} is no split of train_batch_size {total}")


def from_training_arguments(args: Any, ranks: int) -> ScriptBatch | None:
    """The Hugging Face Trainer's batch: per_device_train_batch_size x gradient_accumulation_steps x ranks."""
    micro = _positive(getattr(args, "per_device_train_batch_size", None))
    accumulation = _positive(getattr(args, "gradient_accumulation_steps", None))
    if micro is None or accumulation is None:
        return None
    return ScriptBatch.of(micro, accumulation, ranks, TRAINING_ARGUMENTS)


def trial_keys(global_batch: int, micro_batch: int, ranks: int) -> dict[str, int]:
    """The DeepSpeed batch keys that run `global_batch` at `micro_batch` on `ranks` ranks; ConfigError naming
    the micro-batches that would keep it when this one does not divide it."""
    steps = accumulation_steps(global_batch, micro_batch, ranks)
    if steps is None:
        raise ConfigError(f"the global batch {global_batch} is not a multiple of micro_batch {micro_batch} x "
                          f"{ranks} rank(s): micro-batches that keep it: {micro_batch_divisors(global_batch, ranks)}")
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": steps}


def micro_batches(wanted: Sequence[int], global_batch: int, ranks: int,
                  script_micro: int | None = None) -> tuple[tuple[int, ...], list[int]]:
    """The space's micro-batches that keep `global_batch` (plus the script's own micro-batch, what it runs
    today, when that keeps it too), and those removed. ConfigError when none is left."""
    keep = set(micro_batch_divisors(global_batch, ranks))
    kept = [m for m in wanted if m in keep]
    if script_micro is not None and script_micro in keep and script_micro not in kept:
        kept.append(script_micro)
    removed = [m for m in wanted if m not in keep]
    if not kept:
        raise ConfigError(f"micro_batch {list(wanted)}: none keeps the global batch {global_batch} on {ranks} "
                          f"rank(s); allowed: {micro_batch_divisors(global_batch, ranks) or 'none (not a multiple of the ranks)'}")
    return tuple(sorted(kept)), removed


@dataclass(frozen=True)
class Settled:
    """The workload's global batch and why: the script's own (kept), --global-batch (the recipe changed when it
    differs from the script's), or the tuner's default where the script states none."""

    global_batch: int
    script: ScriptBatch | None  # what the script asks for; None: it states no batch size DeepSpeed sees
    given: int | None  # --global-batch

    @property
    def changed(self) -> bool:
        return self.given is not None and self.script is not None and self.given != self.script.global_batch

    @property
    def defaulted(self) -> bool:
        """Neither the script nor --global-batch stated it: the tuner's choice."""
        return self.given is None and self.script is None

    def line(self) -> str:
        """One line for the console and the report."""
        if self.given is None and self.script is not None:
            return (f"global batch {self.script.describe()}: the script's own, kept; every trial and the "
                    "recommendation split it as micro-batch x gradient accumulation x ranks")
        if self.changed:
            assert self.script is not None and self.given is not None
            return (f"the training recipe changed: global batch from the script's {self.script.describe()} to "
                    f"{self.given} (--global-batch); the recommendation trains with {self.given} samples per "
                    "optimizer step, so the script's learning rate and schedule may need retuning")
        if self.given is not None:
            known = "the same as the script's" if self.script else "the script's own could not be read"
            return f"global batch {self.given} (--global-batch; {known})"
        return (f"global batch {self.global_batch}: the tuner's default, as the script states no batch size where "
                "DeepSpeed gets it; pass --global-batch to set it")

    def to_dict(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "script": self.script.to_dict() if self.script else None,
                "given": self.given, "changed": self.changed}


def settle(script: ScriptBatch | None, given: int | None, default: int) -> Settled:
    """The global batch a sweep keeps: --global-batch if given, else the script's, else `default`."""
    chosen = given if given is not None else script.global_batch if script is not None else default
    return Settled(chosen, script, given)


# Flags that set how long a script trains: a name with one of these words (e.g. --steps, --max_steps, --iters).
_LOOP_FLAG = re.compile(r"^--?[\w.-]*(step|iter|batches)[\w.-]*$", re.IGNORECASE)


def flag_with_value(script_args: Sequence[str], name_matches: re.Pattern[str], values: Collection[int]
                    ) -> tuple[str, int] | None:
    """The first `--flag N` / `--flag=N` of the script's arguments whose name matches and whose value is one of
    `values`, as (flag, N): the flag that (probably) set a figure the trial measured."""
    args = list(script_args)
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if not value and i + 1 < len(args):
            value = args[i + 1]
        if name_matches.match(name) and value.isdigit() and int(value) in values:
            return name, int(value)
    return None


def loop_flag(script_args: Sequence[str], *counts: int) -> tuple[str, int] | None:
    """The script's own flag that (probably) set its loop length: a step-like flag whose value is one of
    `counts` (the micro-batches or optimizer steps the script ran), as (flag, value)."""
    return flag_with_value(script_args, _LOOP_FLAG, counts)


def steps_needed(micro_steps: int, optimizer_steps: int, accumulation: int, needed: int,
                 script_args: Sequence[str] = ()) -> str:
    """Why a script's loop is too short for the trial, in its own units: `needed` optimizer steps at this
    accumulation are `needed x accumulation` micro-batches (engine.backward() calls), and which flag to raise."""
    micro_needed = needed * accumulation
    text = (f"the script ended after {counted(micro_steps, 'micro-batch', 'micro-batches')} (engine.backward() "
            f"calls), {counted(optimizer_steps, 'optimizer step')} at the trial's gradient accumulation "
            f"{accumulation}; measuring needs {needed} optimizer steps (1 or more after warm-up), i.e. "
            f"{micro_needed} micro-batches")
    flag = loop_flag(script_args, micro_steps, optimizer_steps)
    if flag is not None:
        name, value = flag
        # A flag equal to the micro-batches counts loader batches (engine.backward() calls); one equal to the
        # optimizer steps counts those (the Trainer's --max_steps). Where both are equal (no accumulation), either reading agrees.
        wanted = micro_needed if value == micro_steps else needed
        text += f": pass {name} {wanted} or more (more give a steadier median)"
    else:
        text += ": let the script run that long (more give a steadier median)"
    return text
