"""The estimator's view of one search space, computed once per task and cached, so that environment
steps cost array lookups rather than estimator calls.

- `Layout`: the valid configs of a space and the table of where each edit action leads. It depends only
  on what decides validity (`validity_key`), so the many sampled workloads that differ only in shape
  share one.
- `Landscape`: a layout plus, per config, the predicted peak and throughput for one workload on one
  hardware, and the config's feature row.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Generic, Hashable, Mapping, TypeVar

import numpy as np

from autotune.backends.simulated import host_need_bytes
from autotune.values.config import KNOBS, OFFLOADS, PRECISIONS, Config
from autotune.prediction.estimate import Estimate
from autotune.prediction.trial_time import ALL_OPS, JobSize, model_for, op_for, trial_time_at
from autotune.values.space import Space

from autotune.envs.actions import ACTIONS, EDITS, FIRST_EDIT, ORDERED_KNOBS

T = TypeVar("T")
CONFIG_FEATURES = 4 + len(PRECISIONS) + 2 * len(OFFLOADS)
_CKPT_COLUMN = 3  # holds the raw interval in a layout, interval / layers in a landscape


@dataclass(frozen=True, eq=False)
class Layout:
    configs: tuple[Config, ...]
    index: Mapping[Config, int]
    moves: np.ndarray  # (configs, actions): index of the config an edit leads to, -1 if none (stop/run: -1)
    edit_mask: np.ndarray  # (configs, actions) float32: 1 where an edit leads somewhere
    features: np.ndarray  # (configs, CONFIG_FEATURES) float32, raw ckpt interval in _CKPT_COLUMN
    codes: np.ndarray  # (configs, knobs) int64: the index of each config's value in its knob's choices

    @cached_property
    def value_counts(self) -> np.ndarray:
        """(knobs,): how many values of each knob the numbering below holds."""
        n, knobs = self.codes.shape
        return self.codes.max(axis=0) + 1 if n else np.ones(knobs, dtype=np.int64)

    @cached_property
    def value_ids(self) -> np.ndarray:
        """(configs, knobs): each config's knob values numbered across all knobs (knob values side by side)."""
        return self.codes + np.concatenate([[0], np.cumsum(self.value_counts)[:-1]])

    @cached_property
    def value_knobs(self) -> np.ndarray:
        """(knob values,): the knob (its index in KNOBS) of each column of `value_onehot`."""
        return np.repeat(np.arange(len(self.value_counts)), self.value_counts)

    @cached_property
    def value_onehot(self) -> np.ndarray:
        """(configs, knob values) float: 1 where a config has that knob value."""
        ids = self.value_ids
        onehot = np.zeros((len(ids), int(ids.max()) + 1 if ids.size else 0))
        onehot[np.arange(len(ids))[:, None], ids] = 1.0
        return onehot


@dataclass(frozen=True, eq=False)
class Landscape:
    space: Space
    layout: Layout
    peak: np.ndarray  # predicted peak bytes per device
    throughput: np.ndarray  # predicted samples/s
    host_fits: np.ndarray  # offloaded state fits the node's host memory
    features: np.ndarray  # (configs, CONFIG_FEATURES) float32

    def __len__(self) -> int:
        return len(self.layout.configs)

    @property
    def configs(self) -> tuple[Config, ...]:
        return self.layout.configs

    @property
    def index(self) -> Mapping[Config, int]:
        return self.layout.index

    @property
    def moves(self) -> np.ndarray:
        return self.layout.moves

    @property
    def edit_mask(self) -> np.ndarray:
        return self.layout.edit_mask

    @property
    def codes(self) -> np.ndarray:
        return self.layout.codes

    @cached_property
    def log_throughput(self) -> np.ndarray:
        return np.log(np.maximum(self.throughput, 1e-30))

    @cached_property
    def log_peak(self) -> np.ndarray:
        return np.log(np.maximum(self.peak, 1.0))

    @cached_property
    def trial_seconds(self) -> np.ndarray:
        """(configs,): each config's predicted trial seconds at its predicted step time, its op built
        (autotune.prediction.trial_time; an op's first build is `first_build_s`, paid once per run)."""
        workload, hardware = self.space.workload, self.space.hardware
        size, model = JobSize.of(workload, hardware), model_for(hardware)
        return np.array([trial_time_at(config, size, workload.global_batch / max(float(t), 1e-30), model,
                                       ops_built=ALL_OPS).total_s
                         for config, t in zip(self.configs, self.throughput)], dtype=np.float64)

    @cached_property
    def trial_ops(self) -> tuple[str | None, ...]:
        """Per config, the op its optimizer loads (None: none)."""
        return tuple(op_for(config) for config in self.configs)

    @cached_property
    def first_build_s(self) -> np.ndarray:
        """(configs,): the predicted first build of each config's op (0 where it loads none)."""
        model = model_for(self.space.hardware)
        return np.array([model.op_build(op) if op else 0.0 for op in self.trial_ops], dtype=np.float64)

    def feasible(self, budget_bytes: int) -> np.ndarray:
        """Predicted to run within the budget (and the host's memory)."""
        return (self.peak <= budget_bytes) & self.host_fits

    def predicted_best(self, budget_bytes: int) -> float:
        """Best predicted throughput within the budget; over all configs if none fits."""
        fits = self.feasible(budget_bytes)
        return float(self.throughput[fits].max() if fits.any() else self.throughput.max())


def validity_key(space: Space) -> Hashable:
    """What decides which configs of an unrestricted space are valid (autotune.values.space.invalid_reason):
    spaces with equal keys have equal `configs`. tests/test_env_landscape.py checks this on sampled tasks."""
    if space.only is not None:
        raise ValueError("a restricted space has its own configs")
    w, hw, ch = space.workload, space.hardware, space.choices
    return (ch, w.global_batch, w.gpus, min(w.model.layers, max(ch.ckpt_interval)),
            tuple(p for p in ch.precision if hw.supports(p)))


def build_layout(space: Space) -> Layout:
    configs = space.configs
    n = len(configs)
    moves = _moves(space, configs)
    features = np.zeros((n, CONFIG_FEATURES), dtype=np.float32)
    for i, c in enumerate(configs):
        row = [c.zero_stage / 3, min(1.0, np.log2(c.micro_batch) / 6), float(c.ckpt_interval > 0), c.ckpt_interval]
        row += [float(c.precision == p) for p in PRECISIONS]
        row += [float(c.offload_optimizer == o) for o in OFFLOADS]
        row += [float(c.offload_param == o) for o in OFFLOADS]
        features[i] = row
    choices = space.choices
    codes = np.array([[choices.knob_values(k).index(getattr(c, k)) for k in KNOBS] for c in configs],
                     dtype=np.int64).reshape(n, len(KNOBS))
    return Layout(configs, {c: i for i, c in enumerate(configs)}, moves, (moves >= 0).astype(np.float32), features,
                  codes)


def build_landscape(space: Space, estimator: Callable[[Config], Estimate], layout: Layout | None = None) -> Landscape:
    """`layout`: the space's layout if already known (shared by validity key), else built."""
    layout = layout or build_layout(space)
    workload, hardware = space.workload, space.hardware
    estimates = [estimator(c) for c in layout.configs]
    peak = np.array([e.peak_bytes for e in estimates], dtype=np.float64)
    throughput = np.array([e.throughput_samples_per_s for e in estimates], dtype=np.float64)
    host_fits = np.array([host_need_bytes(e, workload, hardware) <= hardware.host_memory_bytes for e in estimates],
                         dtype=bool)
    features = layout.features.copy()
    features[:, _CKPT_COLUMN] = np.minimum(1.0, features[:, _CKPT_COLUMN] / workload.model.layers)
    return Landscape(space, layout, peak, throughput, host_fits, features)


def _moves(space: Space, configs: tuple[Config, ...]) -> np.ndarray:
    """Vectorised over configs, in a grid whose ordered knobs are sorted by value."""
    n = len(configs)
    moves = np.full((n, len(ACTIONS)), -1, dtype=np.int32)
    if not n:
        return moves
    rank = {}  # knob -> value -> grid coordinate
    for knob in KNOBS:
        values = space.choices.knob_values(knob)
        ordered = sorted(values) if knob in ORDERED_KNOBS else values
        rank[knob] = {v: i for i, v in enumerate(ordered)}
    codes = np.array([[rank[k][getattr(c, k)] for k in KNOBS] for c in configs], dtype=np.int64)
    sizes = tuple(len(rank[k]) for k in KNOBS)
    grid = np.full(sizes, -1, dtype=np.int32)
    grid[tuple(codes.T)] = np.arange(n, dtype=np.int32)
    for column, edit in enumerate(EDITS, FIRST_EDIT):
        k = edit.knob_position
        if edit.step:  # the nearest valid config in that direction along the knob
            target = moves[:, column]
            for distance in range(1, sizes[k]):
                moved = codes.copy()
                moved[:, k] += edit.step * distance
                inside = (moved[:, k] >= 0) & (moved[:, k] < sizes[k])
                moved[:, k] = np.clip(moved[:, k], 0, sizes[k] - 1)
                found = np.where(inside, grid[tuple(moved.T)], -1)
                todo = target < 0
                target[todo] = found[todo]
        elif edit.value in rank[edit.knob]:
            moved = codes.copy()
            moved[:, k] = rank[edit.knob][edit.value]
            moves[:, column] = np.where(codes[:, k] == moved[:, k], -1, grid[tuple(moved.T)])
    return moves


class LruCache(Generic[T]):
    """Least-recently-used values by key; an environment keeps its own (no global state). `on_evict` is told each
    value dropped (by `get` beyond `size`, or by `clear`): what holds processes is closed there."""

    def __init__(self, size: int, on_evict: Callable[[T], None] | None = None) -> None:
        self.size = size
        self.on_evict = on_evict
        self._items: OrderedDict[Hashable, T] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        item = self._items[key] = build()
        while len(self._items) > self.size:
            self._evict()
        return item

    def clear(self) -> None:
        while self._items:
            self._evict()

    def _evict(self) -> None:
        _, item = self._items.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(item)
