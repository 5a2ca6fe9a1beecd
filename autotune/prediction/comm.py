"""Collective communication of one optimizer step, per ZeRO stage and gradient accumulation (pure arithmetic).

What DeepSpeed launches per optimizer step of `gas` micro-steps over dp data-parallel ranks, for N parameters
of p bytes (the model's dtype, DeepSpeed's default communication dtype), with the bucket sizes
autotune.values.dsconfig writes:
- ZeRO-0: one all-reduce of the gradients at the accumulation boundary, in buckets of 5e8 elements
  (engine.allreduce_gradients); nothing overlaps it.
- ZeRO-1: at the boundary, a reduce-scatter of the gradients (reduce_scatter: true) and, after the
  optimizer step, an all-gather of the updated 16-bit partitions (allgather_bucket_size); no overlap_comm.
- ZeRO-2: a reduce-scatter of the gradients in every micro-step (the gradients are partitioned, so each
  micro-step's must be reduced before the next overwrites them), overlapped with backward (overlap_comm),
  and one all-gather of the updated partitions per step.
- ZeRO-3: in every micro-step an all-gather of the parameters in forward and again in backward (one per
  module, partly prefetched behind compute) and a reduce-scatter of the gradients; the updated
  parameters stay partitioned (no all-gather after the step).
- Offload (optimizer or parameters) moves state over the host link (autotune.prediction.estimate's offload term); the
  collectives above are the same.
Time of one collective of S bytes (NCCL's algorithms, alpha-beta model; B the bus bandwidth per device of
the link the group crosses, alpha its latency per algorithm step; a group spanning nodes runs at the
inter-node figures: its slowest hop bounds every step of a ring):
- reduce-scatter, all-gather (ring): (dp-1)/dp * S / B + (dp-1) * alpha per launch;
- all-reduce: the faster of ring, 2(dp-1)/dp * S / B + 2(dp-1) * alpha, and tree (double binary tree,
  latency-bound messages), 2 * S / B + 2 * ceil(log2 dp) * alpha, per launch.
(Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005;
NCCL's tests define bus bandwidth with the same (dp-1)/dp factors, so a profile's figure is the busbw
that nccl-tests reports.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autotune.values.config import Config
from autotune.values.dsconfig import Buckets
from autotune.values.hardware import Hardware
from autotune.values.workload import Workload

STAGE0_ALLREDUCE_BUCKET = 500_000_000  # DeepSpeed's default allreduce_bucket_size (elements)
COMM_OVERLAP = 0.5  # share of ZeRO-2/3 communication hidden behind compute (overlap_comm, stage-3 prefetch)
OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Collective:
    """`launches` calls of one kind per optimizer step, moving `nbytes` in all (the full tensor: an all-reduce's
    buffer, a reduce-scatter's input, an all-gather's output); `overlap` of their time is hidden by compute."""

    op: str
    nbytes: float
    launches: int
    overlap: float = 0.0
    what: str = ""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op {self.op!r}: allowed {', '.join(OPS)}")


@dataclass(frozen=True)
class Link:
    """The link a data-parallel group's collectives cross: bus bandwidth per device and latency per step."""

    bandwidth: float  # bytes/s
    latency_s: float

    @classmethod
    def of(cls, dp: int, hardware: Hardware) -> "Link":
        if dp <= hardware.gpus_per_node:
            return cls(hardware.intra_node_bw, hardware.intra_node_latency_s)
        return cls(hardware.inter_node_bw, hardware.inter_node_latency_s)


def _launches(elements: int, bucket: int) -> int:
    return max(1, math.ceil(elements / max(bucket, 1)))


def step_collectives(config: Config, workload: Workload, p: int) -> tuple[Collective, ...]:
    """The collectives of one optimizer step of `config` (none on one rank)."""
    m, dp, stage = workload.model, workload.gpus, config.zero_stage
    if dp <= 1:
        return ()
    n = m.params
    gas = workload.grad_accumulation(config.micro_batch) or 1
    buckets = Buckets.for_hidden(m.hidden)
    grads = float(p * n)
    if stage == 0:
        return (Collective("all_reduce", grads, _launches(n, STAGE0_ALLREDUCE_BUCKET), 0.0, "gradients"),)
    reduce_launches = _launches(n, buckets.reduce)
    if stage == 1:
        return (Collective("reduce_scatter", grads, reduce_launches, 0.0, "gradients"),
                Collective("all_gather", grads, _launches(n, buckets.allgather), 0.0, "updated parameters"))
    if stage == 2:
        return (Collective("reduce_scatter", gas * grads, gas * reduce_launches, COMM_OVERLAP, "gradients"),
                Collective("all_gather", grads, _launches(n, buckets.allgather), 0.0, "updated parameters"))
    # ZeRO-3: one gather per module with partitioned parameters (about four linear layers per transformer
    # layer, plus the embeddings and the head), in forward and again in backward.
    modules = 4 * m.layers + 2
    return (Collective("all_gather", 2 * gas * grads, 2 * gas * modules, COMM_OVERLAP, "parameters (forward, backward)"),
            Collective("reduce_scatter", gas * grads, gas * reduce_launches, COMM_OVERLAP, "gradients"))


def collective_time(c: Collective, dp: int, link: Link) -> float:
    """Seconds the collective takes over `link` among `dp` ranks (before any overlap)."""
    if dp <= 1:
        return 0.0
    per_launch = c.nbytes / c.launches
    if c.op == "all_reduce":
        ring = 2 * (dp - 1) / dp * per_launch / link.bandwidth + 2 * (dp - 1) * link.latency_s
        tree = 2 * per_launch / link.bandwidth + 2 * math.ceil(math.log2(dp)) * link.latency_s
        return c.launches * min(ring, tree)
    return c.launches * ((dp - 1) / dp * per_launch / link.bandwidth + (dp - 1) * link.latency_s)


def comm_time(config: Config, workload: Workload, hardware: Hardware, p: int) -> float:
    """Seconds per optimizer step that communication adds to the step (the part compute does not hide)."""
    dp = workload.gpus
    link = Link.of(dp, hardware)
    return sum(collective_time(c, dp, link) * (1 - c.overlap) for c in step_collectives(config, workload, p))


def bytes_sent_per_device(config: Config, workload: Workload, p: int) -> float:
    """Bytes each rank sends per optimizer step under ring algorithms (the volume the ZeRO paper counts)."""
    dp = workload.gpus
    if dp <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (dp - 1) / dp, "reduce_scatter": (dp - 1) / dp, "all_gather": (dp - 1) / dp}
    return sum(factor[c.op] * c.nbytes for c in step_collectives(config, workload, p))
