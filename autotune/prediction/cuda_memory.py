"""Device memory a CUDA trial holds beyond its tensors: the caching allocator's reserve, and the memory outside
that allocator. The product's peak on CUDA is the allocator's reserved peak plus what lies outside it
(autotune.worker.device); the tensor terms of autotune.prediction.estimate predict the allocated peak, so these two
terms make the prediction the peak the product measures. Pure arithmetic; never used for the CPU profile.

Sources: the first real GPU run (one H200, torch 2.11 + CUDA 13, DeepSpeed 0.19.8,
benchmarks/gpu-runs/h200-2026-11-26/, 7 ok trials with allocated / reserved / outside figures) and how
DeepSpeed and PyTorch's caching allocator allocate. What the H200 could not tell apart is said where it is used.

Outside the allocator (`outside_allocator_bytes`):
- CUDA context: measured 0.514 GiB on the H200 before the model (cuda_context_bytes, every trial). About half
  is local memory the driver reserves for every resident thread (1 KiB default stack x 2048 threads x 132
  SMs = 0.26 GiB); the rest (driver heaps, lazily loaded modules) is taken as the same on every GPU. Other
  generations scale by their SM count and threads per SM (not measured on them).
- Libraries: kernel images of cuBLAS/cuBLASLt, PyTorch, flash attention and DeepSpeed's ops loaded on first use
  (their workspaces come from the caching allocator and count as allocated): measured 0.78 GiB beyond the
  context with ZeRO 0 (both trials), 0.82-0.83 with ZeRO 1-2.
- ZeRO-3: 0.40 GiB more (1.69-1.74 GiB outside against 1.29-1.34 for stages 0-2, all three ZeRO-3 trials).
  Those three were also the only fp16 ones, so the H200 data cannot say whether ZeRO-3 or fp16 costs it.
- NCCL, when a trial has several ranks: buffers per channel and connection (NCCL's defaults: 4 MiB Simple +
  ~4.5 MiB LL128 + 0.25 MiB LL), 16 channels x 2 ring connections inside a node, as many again for the
  network when ranks span nodes. Not measured here (every H200 trial had one rank).

The caching allocator's reserve (`allocator_reserve_bytes`): reserved minus allocated at the peak, blocks
cached but not in use. Measured 0.55-15.9 GiB; what it follows:
- Fragmentation from the biggest transient tensors, the LM head's logit chain (16-bit logits, fp32 upcast,
  log-softmax, two fp32 gradients; 12 bytes per logit at its peak), allocated and freed every micro-step in
  three sizes that activations, recomputed layers and gathered parameters then split: the reserve was
  0.56-0.62 x the head's 12-byte peak in the checkpointed trials at micro-batch >= 4 (0.38 at micro-batch 2,
  0.15 for ZeRO 0 without checkpointing once its flattening copies are counted): half of it.
- ZeRO 0 in 16-bit (DeepSpeed's FP16_Optimizer, also for bf16): flattening the weights clones them, so the
  weights' and the clones' per-parameter blocks are freed and cached; the 16-bit gradients reuse one set, the
  other (2 bytes x parameters) stays cached (fused_optimizer.py, __init__).
- ZeRO-3 with gathered parameters (parameter offload, or several ranks): each module's parameters are
  fetched into blocks of their own sizes three times per micro-step (forward, recomputation, backward) between
  activations; about one live window of them (below) stays cached as freed blocks. On one rank without
  parameter offload DeepSpeed uses the partition itself (NoGatherHandle) and nothing is fetched.
- Block rounding (2 MiB for large blocks, 20 MiB segments for 1-10 MiB requests) is below 1% of these peaks and
  is left out.
- With expandable segments (`Hardware.allocator`, autotune.values.allocator) the allocator unmaps its free blocks' pages
  when an allocation would not fit, so none of the above decides whether a config fits: the reserve is 0 (its
  20 MiB pages, below 1% as above, left out). The peak a trial shows can still be higher when memory is
  plentiful (pages stay mapped until an allocation needs them); the prediction is what must fit. Not measured
  on a GPU yet: the GPU kit runs configs in both modes side by side (benchmarks/gpu_kit.py).

The live window of ZeRO-3 (`zero3_live_params_bytes`, allocated, so a buffer): with the reuse distance and live
parameters autotune.values.dsconfig writes (1e9 each), DeepSpeed releases no parameter that comes back within 1e9
elements of the trace (partitioned_param_coordinator.py, __params_to_release), so up to that many gathered
parameters stay on the device. With it the ZeRO-3 trials with parameter offload were predicted within 0.4 and
1.0 GiB of their allocated peaks instead of 2.3 and 2.9 below.
"""

from __future__ import annotations

from autotune.values.config import Config
from autotune.values.dsconfig import Buckets
from autotune.values.hardware import Hardware
from autotune.values.workload import Workload

GiB = 2**30
MiB = 2**20

LOCAL_MEMORY_PER_THREAD = 1024  # bytes: CUDA's default stack size per thread
# (streaming multiprocessors, resident threads per SM) of the built-in profiles' GPUs.
SM_LAYOUT: dict[str, tuple[int, int]] = {
    "v100": (80, 2048), "a100": (108, 2048), "h100": (132, 2048), "h200": (132, 2048), "b200": (148, 2048),
    "l40s": (142, 1536), "a10g": (80, 1536), "l4": (58, 1536),
}
MEASURED_CONTEXT = 552_402_944  # bytes, H200, torch 2.11 + CUDA 13 (cuda_context_bytes of every trial)
CONTEXT_BASE = MEASURED_CONTEXT - 132 * 2048 * LOCAL_MEMORY_PER_THREAD  # what is not local memory
LIBRARIES = int(0.78 * GiB)
ZERO3_OUTSIDE = int(0.40 * GiB)
NCCL_CHANNEL_CONNECTION = 4 * MiB + int(4.5 * MiB) + MiB // 4
NCCL_CHANNELS = 16
NCCL_RING_CONNECTIONS = 2

HEAD_BYTES_PER_LOGIT = 12  # the head's peak, as autotune.prediction.estimate counts it
HEAD_RESERVE_FRACTION = 0.5


def cuda_context_bytes(hardware: Hardware) -> int:
    """The CUDA context of one rank on this profile's GPU (an unknown GPU: the H200's)."""
    name = hardware.name.lower()
    layout = next((v for k, v in SM_LAYOUT.items() if name.startswith(k)), None)
    if layout is None:
        return MEASURED_CONTEXT
    sms, threads = layout
    return CONTEXT_BASE + sms * threads * LOCAL_MEMORY_PER_THREAD


def nccl_bytes(workload: Workload, hardware: Hardware) -> int:
    """NCCL's buffers on one rank: none on one rank; one ring inside a node, another across nodes."""
    if workload.gpus <= 1:
        return 0
    rings = 2 if workload.gpus > hardware.gpus_per_node else 1
    return rings * NCCL_CHANNELS * NCCL_RING_CONNECTIONS * NCCL_CHANNEL_CONNECTION


def outside_allocator_bytes(config: Config, workload: Workload, hardware: Hardware) -> int:
    """Device memory of one rank that the caching allocator does not hold."""
    if hardware.is_cpu:
        return 0
    zero3 = ZERO3_OUTSIDE if config.zero_stage == 3 else 0
    return cuda_context_bytes(hardware) + LIBRARIES + zero3 + nccl_bytes(workload, hardware)


def gathers_parameters(config: Config, workload: Workload) -> bool:
    """Whether ZeRO-3 fetches parameters into new device blocks (not on one rank with them on the device)."""
    return config.zero_stage == 3 and (config.offload_param != "none" or workload.gpus > 1)


def zero3_live_params_bytes(config: Config, workload: Workload, hardware: Hardware) -> int:
    """Gathered ZeRO-3 parameters kept on the device within the reuse distance (module docstring)."""
    if hardware.is_cpu or not gathers_parameters(config, workload):
        return 0
    p = 2 if config.precision in ("fp16", "bf16") else 4
    window = Buckets.for_hidden(workload.model.hidden).max_live_parameters
    return min(workload.model.params, window) * p


def allocator_reserve_bytes(config: Config, workload: Workload, hardware: Hardware) -> int:
    """Bytes the caching allocator holds cached but unused at the peak (module docstring)."""
    if hardware.is_cpu or hardware.allocator == "expandable":
        return 0
    m = workload.model
    p = 2 if config.precision in ("fp16", "bf16") else 4
    logits = config.micro_batch * m.seq_len * m.vocab
    reserve = HEAD_RESERVE_FRACTION * HEAD_BYTES_PER_LOGIT * logits
    if config.zero_stage == 0 and p == 2:
        reserve += p * m.params  # FP16_Optimizer's flattening: one 16-bit copy of per-parameter blocks
    reserve += zero3_live_params_bytes(config, workload, hardware)  # fetched-parameter blocks, one window
    return int(reserve)
