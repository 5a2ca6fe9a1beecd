"""Tasks for the environment: a workload, a hardware profile, a memory budget and a search space.

`WorkloadSampler` draws tasks across the range a policy should generalise over: model shapes from about
1M to 70B parameters (the built-in presets and random GPT/Llama shapes), data-parallel sizes, budgets
as fractions of the device memory, and GPU hardware profiles.

Held-out tasks (for evaluating a policy on workloads it never saw): each of three dimensions has a
held-out part, fixed by the settings and independent of seeds:
- shapes: the presets in `held_out_presets`, and random shapes whose geometry hashes (crc32) into the
  `held_out_shape_fraction` share;
- budgets: the fractions in `held_out_budget_fractions`;
- hardware: the profiles in `held_out_profiles`.
`split="train"` draws only from the non-held-out parts, `split="test"` draws tasks held out in at least
one dimension, `split="all"` draws from everything. `held_out(task)` names a task's held-out dimensions.

With `pool_size`, the sampler draws a fixed pool of tasks once (from `seed`) and samples from it: an
environment caches per-task estimates, so a pool keeps resets cheap.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from autotune.values.config import ConfigError
from autotune.values.hardware import PROFILES, Hardware
from autotune.search_spaces import load_choices
from autotune.values.space import Choices
from autotune.values.workload import PRESETS, ModelShape, Workload

SPLITS = ("train", "test", "all")
DIMENSIONS = ("shape", "budget", "hardware")
GPU_PROFILES = ("v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "l4")
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)
SEQ_LENS = (256, 512, 1024, 2048, 4096)
VOCABS = (4096, 8192, 32000, 50257)


@dataclass(frozen=True)
class Task:
    """One episode's problem: tune `workload` on `hardware` under `memory_budget_bytes` per device."""

    workload: Workload
    hardware: Hardware
    memory_budget_bytes: int
    choices: Choices

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload.to_dict(), "hardware": self.hardware.name,
                "memory_budget_bytes": self.memory_budget_bytes}


def shape_hash(shape: ModelShape) -> float:
    """A stable number in [0, 1) from a shape's geometry (not its name)."""
    key = (shape.arch, shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn_hidden, shape.vocab,
           shape.seq_len)
    return zlib.crc32(repr(key).encode()) / 2**32


@dataclass(frozen=True)
class WorkloadSampler:
    split: str = "train"
    profiles: tuple[str, ...] = GPU_PROFILES
    held_out_profiles: tuple[str, ...] = ("l4",)
    budget_fractions: tuple[float, ...] = (1.0, 0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.25)
    held_out_budget_fractions: tuple[float, ...] = (0.6, 0.3)
    held_out_presets: tuple[str, ...] = ("gpt2-large", "llama-13b")
    held_out_shape_fraction: float = 0.2
    min_params: float = 1e6
    max_params: float = 7e10
    preset_probability: float = 0.3
    gpu_counts: tuple[int, ...] = GPU_COUNTS
    space: str = "default"  # search-space preset or YAML path
    pool_size: int | None = None
    seed: int = 0
    _choices: Choices = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"sampler split={self.split!r}: allowed {list(SPLITS)}")
        for name in (*self.profiles, *self.held_out_profiles):
            if name not in PROFILES:
                raise ConfigError(f"sampler profile {name!r}: allowed {sorted(PROFILES)}")
        for name in self.held_out_presets:
            if name not in PRESETS:
                raise ConfigError(f"sampler held-out preset {name!r}: allowed {sorted(PRESETS)}")
        for frac in (*self.budget_fractions, *self.held_out_budget_fractions):
            if not 0 < frac <= 1:
                raise ConfigError(f"sampler budget fraction {frac!r}: must be in (0, 1]")
        if not 0 <= self.held_out_shape_fraction < 1:
            raise ConfigError(f"held_out_shape_fraction={self.held_out_shape_fraction!r}: must be in [0, 1)")
        if not 0 < self.min_params < self.max_params:
            raise ConfigError(f"sampler params range {self.min_params}..{self.max_params} is empty")
        if self.pool_size is not None and self.pool_size < 1:
            raise ConfigError(f"pool_size={self.pool_size!r}: must be a positive integer or None")
        parts = self._parts()
        if self.split in ("train", "all"):
            for dim in DIMENSIONS:
                if not parts[dim][0]:
                    raise ConfigError(f"sampler: every {dim} is held out, nothing left to train on")
        if self.split == "test" and not any(parts[dim][1] for dim in DIMENSIONS):
            raise ConfigError("sampler: split 'test' needs a held-out shape, budget or profile")
        object.__setattr__(self, "_choices", load_choices(self.space))

    def _parts(self) -> dict[str, tuple[tuple, tuple]]:
        train_profiles = tuple(p for p in self.profiles if p not in self.held_out_profiles)
        train_budgets = tuple(f for f in self.budget_fractions if f not in self.held_out_budget_fractions)
        return {"shape": ((True,), (True,) if self.held_out_shape_fraction or self.held_out_presets else ()),
                "budget": (train_budgets, self.held_out_budget_fractions),
                "hardware": (train_profiles, self.held_out_profiles)}

    # -- what is held out ---------------------------------------------------------------------------

    def shape_held_out(self, shape: ModelShape) -> bool:
        if shape.name in PRESETS and PRESETS[shape.name] == shape:
            return shape.name in self.held_out_presets
        return shape_hash(shape) < self.held_out_shape_fraction

    def held_out(self, task: Task) -> tuple[str, ...]:
        """The dimensions in which `task` is held out (empty: a training task)."""
        fraction = task.memory_budget_bytes / task.hardware.memory_bytes
        out = []
        if self.shape_held_out(task.workload.model):
            out.append("shape")
        if any(math.isclose(fraction, f, rel_tol=1e-6) for f in self.held_out_budget_fractions):
            out.append("budget")
        if task.hardware.name in self.held_out_profiles:
            out.append("hardware")
        return tuple(out)

    # -- drawing ------------------------------------------------------------------------------------

    @cached_property
    def pool(self) -> tuple[Task, ...]:
        if self.pool_size is None:
            return ()
        rng = np.random.default_rng(self.seed)
        return tuple(self.draw(rng) for _ in range(self.pool_size))

    def sample(self, rng: np.random.Generator) -> Task:
        """A task from the pool if there is one, else a fresh draw."""
        if self.pool_size is not None:
            return self.pool[int(rng.integers(len(self.pool)))]
        return self.draw(rng)

    def draw(self, rng: np.random.Generator) -> Task:
        held: dict[str, bool | None]  # per dimension: the held-out part, the training part, None: either part
        if self.split == "all":
            held = {dim: None for dim in DIMENSIONS}
        elif self.split == "train":
            held = {dim: False for dim in DIMENSIONS}
        else:
            possible = [dim for dim, (_, held_part) in self._parts().items() if held_part]
            chosen: set[str] = set()
            while not chosen:
                chosen = {dim for dim in possible if rng.random() < 0.5}
            held = {dim: dim in chosen for dim in DIMENSIONS}
        parts = self._parts()
        hardware = PROFILES[self._pick(rng, parts["hardware"], held["hardware"])]
        fraction = float(self._pick(rng, parts["budget"], held["budget"]))
        shape = self._shape(rng, held["shape"])
        workload = self._workload(rng, shape, hardware)
        return Task(workload, hardware, int(fraction * hardware.memory_bytes), self._choices)

    @staticmethod
    def _pick(rng: np.random.Generator, parts: tuple[tuple, tuple], held: bool | None) -> Any:
        options = parts[0] + parts[1] if held is None else parts[1] if held else parts[0]
        return options[int(rng.integers(len(options)))]

    def _shape(self, rng: np.random.Generator, held: bool | None) -> ModelShape:
        for _ in range(1000):
            if rng.random() < self.preset_probability:
                shape = PRESETS[sorted(PRESETS)[int(rng.integers(len(PRESETS)))]]
                if not self.min_params <= shape.params <= self.max_params:
                    continue
            else:
                shape = self._random_shape(rng)
            if held is None or self.shape_held_out(shape) == held:
                return shape
        raise ConfigError("sampler: no model shape found in the allowed part of the space; widen the settings")

    def _random_shape(self, rng: np.random.Generator) -> ModelShape:
        for _ in range(100):
            target = math.exp(rng.uniform(math.log(self.min_params), math.log(self.max_params)))
            arch = "gpt" if rng.random() < 0.5 else "llama"
            ratio = math.exp(rng.uniform(math.log(16), math.log(160)))  # hidden / layers of real models
            hidden = (target * ratio / 12) ** (1 / 3)
            head_dim = 64 if hidden <= 2048 else 128
            hidden = max(head_dim, head_dim * round(hidden / head_dim))
            heads = max(1, hidden // head_dim)
            vocabs = [v for v in VOCABS if v * hidden <= target / 2] or [VOCABS[0]]
            vocab = vocabs[int(rng.integers(len(vocabs)))]
            layers = max(2, round((target - 2 * vocab * hidden) / (12 * hidden * hidden)))
            seq = SEQ_LENS[int(rng.integers(len(SEQ_LENS)))]
            if arch == "gpt":
                shape = ModelShape(f"gpt-{layers}x{hidden}", layers, hidden, heads, vocab, seq)
            else:
                ffn = 64 * round(8 * hidden / 3 / 64)
                kv = heads // 8 if heads % 8 == 0 and rng.random() < 0.5 else heads
                shape = ModelShape(f"llama-{layers}x{hidden}", layers, hidden, heads, vocab, seq, ffn_hidden=ffn,
                                   kv_heads=kv, arch="llama")
            if self.min_params <= shape.params <= self.max_params:
                return shape
        raise ConfigError(f"sampler: cannot draw a shape of {self.min_params:g}..{self.max_params:g} parameters")

    def _workload(self, rng: np.random.Generator, shape: ModelShape, hardware: Hardware) -> Workload:
        # Enough devices that ZeRO-3 model states (16 bytes/param) could fit, give or take offload (/4)
        # and generous data parallelism (x8).
        counts = sorted(self.gpu_counts)
        need = 16 * shape.params / hardware.memory_bytes
        enough = next((g for g in counts if g >= need), counts[-1])
        usable = [g for g in counts if enough / 4 <= g <= enough * 8] or [enough]
        gpus = usable[int(rng.integers(len(usable)))]
        per_device = 2 ** int(rng.integers(0, 7))  # samples per device per optimizer step: 1..64
        return Workload(shape, gpus * per_device, gpus)
