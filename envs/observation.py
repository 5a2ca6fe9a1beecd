"""The observation vector: every feature scaled into [-1, 1], in blocks whose layout is fixed for all
tasks (documented in FEATURES, one name per entry).

Only what a tuner knows on real hardware goes in: the task, the current config, the estimator's
predictions (for the current config and for where each action leads; for `jump`, corrected by this
episode's measurements, envs/residuals.py), the results measured in this episode, and for where each
action leads the probability of fitting the budget that those results give. Never the true optimum: the replay surface's best is used to scale rewards, not to observe.
"""

from __future__ import annotations

import math

import numpy as np

from autotune.envs.actions import ACTIONS
from autotune.envs.landscape import CONFIG_FEATURES, Landscape
from autotune.envs.sampler import Task

TASK_FEATURES = (
    "log10 parameters / 11", "log2 layers / 7", "log2 hidden / 14", "log2 seq_len / 13", "log2 vocab / 18",
    "log2 global_batch / 13", "log2 data-parallel size / 7", "llama architecture",
    "log2 device memory GiB / 7", "budget / device memory", "log2 budget GiB / 7",
    "log10 best peak FLOP/s / 16", "fp16 supported", "bf16 supported", "cpu accelerator",
    "log10 host link bytes/s / 12", "log10 collective bus bytes/s / 12",
    "log2 ZeRO-3 model states per device / budget / 8", "share of the space predicted to fit",
)
CONFIG_NAMES = ("zero_stage / 3", "log2 micro_batch / 6", "checkpointing on", "ckpt_interval / layers",
                "precision=fp32", "precision=fp16", "precision=bf16", "offload_optimizer=none",
                "offload_optimizer=cpu", "offload_optimizer=nvme", "offload_param=none", "offload_param=cpu",
                "offload_param=nvme")
PREDICTION_NAMES = ("predicted log2 peak / budget / 4", "predicted throughput / predicted best / 2")
# The statuses the shipped policy was trained to see, one slot each; a later status shares the slot of the one the
# policy should take it for (an untrained trial, like a crash, gave no measurement), so the layout stays its own.
OBSERVED_STATUSES = ("none", "ok", "oom", "unsupported", "timeout", "crash", "pruned")
SAME_SLOT_AS = {"untrained": "crash"}
RESULT_NAMES = (*(f"last status {s}" for s in OBSERVED_STATUSES), "last throughput / best so far",
                "last log2 peak / budget / 4", "last log2 measured / predicted throughput / 2",
                "last log2 measured / predicted peak / 2")
EPISODE_NAMES = ("steps left / horizon", "trials / horizon", "a feasible config found", "current config is the best",
                 "best so far / predicted best / 2", "current config measured",
                 "log2 jump target's corrected throughput / best so far / 2")
FIT_NAME = "probability its config fits (memory error model, envs/residuals.py; 0: leads nowhere)"
# Issue 41: a trial's price in seconds differs by config (an offloaded optimizer's initialize ~2x, an op's first
# build), so a policy trained on `second_cost` can see it; appended, so that the base layout's offsets stay.
SECONDS_NAME = ("log2 predicted trial seconds / the task's trial at its predicted best / 3, an op's first build in "
                "this episode included (autotune.prediction.trial_time; 0: leads nowhere)")
FEATURES = (
    *(f"task: {n}" for n in TASK_FEATURES),
    *(f"config: {n}" for n in CONFIG_NAMES),
    *(f"config: {n}" for n in PREDICTION_NAMES),
    *(f"action {a}: {n}" for a in ACTIONS for n in PREDICTION_NAMES),
    *(f"result: {n}" for n in RESULT_NAMES),
    *(f"episode: {n}" for n in EPISODE_NAMES),
    *(f"action {a}: {FIT_NAME}" for a in ACTIONS),
)
assert len(CONFIG_NAMES) == CONFIG_FEATURES

# Block offsets in the vector.
TASK_AT = 0
CONFIG_AT = TASK_AT + len(TASK_FEATURES)
PREDICTION_AT = CONFIG_AT + CONFIG_FEATURES
ACTIONS_AT = PREDICTION_AT + len(PREDICTION_NAMES)
RESULT_AT = ACTIONS_AT + len(ACTIONS) * len(PREDICTION_NAMES)
EPISODE_AT = RESULT_AT + len(RESULT_NAMES)
FIT_AT = EPISODE_AT + len(EPISODE_NAMES)
SIZE = FIT_AT + len(ACTIONS)
SECONDS_AT = SIZE  # the seconds block, where the environment observes seconds (EnvConfig.observe_seconds)
SECONDS_FEATURES = tuple(f"action {a}: {SECONDS_NAME}" for a in ACTIONS)
STATUS_SLOT = {status: i for i, status in enumerate(OBSERVED_STATUSES)}
STATUS_SLOT.update({status: STATUS_SLOT[like] for status, like in SAME_SLOT_AS.items()})


def features(seconds: bool = False) -> tuple[str, ...]:
    """The observation's feature names: the base layout, and the seconds block after it where observed."""
    return (*FEATURES, *SECONDS_FEATURES) if seconds else FEATURES


def size(seconds: bool = False) -> int:
    return len(features(seconds))


def seconds_feature(seconds: np.ndarray, unit: float) -> np.ndarray:
    """log2(seconds / unit) / 3, clipped: 0 at the unit, -1 at 1/8 of it, +1 at 8 times it."""
    return np.clip(np.log2(np.maximum(seconds, 1e-9) / unit) / 3, -1.0, 1.0)


def _clip(x: float) -> float:
    return min(1.0, max(-1.0, x))


def task_features(task: Task, share_fitting: float) -> np.ndarray:
    w, hw, budget = task.workload, task.hardware, task.memory_budget_bytes
    m = w.model
    gib = 2**30
    bus = hw.intra_node_bw if w.gpus <= hw.gpus_per_node else hw.inter_node_bw
    states = 16 * m.params / w.gpus
    values = (
        math.log10(m.params) / 11, math.log2(m.layers) / 7, math.log2(m.hidden) / 14, math.log2(m.seq_len) / 13,
        math.log2(m.vocab) / 18, math.log2(w.global_batch) / 13, math.log2(w.gpus) / 7, float(m.arch == "llama"),
        math.log2(hw.memory_bytes / gib) / 7, budget / hw.memory_bytes, math.log2(budget / gib) / 7,
        math.log10(max(hw.peak_flops.values())) / 16, float(hw.supports("fp16")), float(hw.supports("bf16")),
        float(hw.is_cpu), math.log10(hw.host_link_bw) / 12, math.log10(bus) / 12,
        math.log2(states / budget) / 8, share_fitting,
    )
    return np.array([_clip(v) for v in values], dtype=np.float32)


def peak_feature(peak: np.ndarray, budget: int) -> np.ndarray:
    """log2(peak / budget) / 4, clipped: 0 at the budget, -1 at 1/16 of it, +1 at 16 times it."""
    return np.clip(np.log2(np.maximum(peak, 1.0) / budget) / 4, -1.0, 1.0)


def ratio_feature(value: float, reference: float, scale: float = 2.0) -> float:
    """log2(value / reference) / scale, clipped to [-1, 1]."""
    if value <= 0 or reference <= 0:
        return -1.0
    return _clip(math.log2(value / reference) / scale)


def config_blocks(land: Landscape, budget: int, predicted_best: float) -> np.ndarray:
    """Per config, the observation from CONFIG_AT to RESULT_AT: the config's features, its predictions,
    and the predictions for where each action leads (zeros where it leads nowhere)."""
    n = len(land)
    peak = peak_feature(land.peak, budget).astype(np.float32)
    throughput = np.clip(land.throughput / predicted_best / 2, 0.0, 1.0).astype(np.float32)
    out = np.zeros((n, RESULT_AT - CONFIG_AT), dtype=np.float32)
    out[:, :CONFIG_FEATURES] = land.features
    out[:, CONFIG_FEATURES] = peak
    out[:, CONFIG_FEATURES + 1] = throughput
    has = land.moves >= 0
    safe = np.where(has, land.moves, 0)
    per_action = np.stack([np.where(has, peak[safe], 0.0), np.where(has, throughput[safe], 0.0)], axis=-1)
    out[:, CONFIG_FEATURES + 2:] = per_action.reshape(n, -1)
    return out
