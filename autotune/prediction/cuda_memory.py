"""Device memory a CUDA trial holds beyond its tensors: the caching allocator's reserve, and the memory outside
that allocator. The product's peak on CUDA is the allocator's reserved peak plus what lies outside it
(autotune.worker.device); the tensor terms of autotune.prediction.estimate predict the allocated peak, so these two
terms make the prediction the peak the product measures. Pure arithmetic; the CPU profile has none of these terms
(ZeRO-3's step gradient, which it counts as a buffer, is sized here for both).

Sources: two real GPU runs on one H200 (torch 2.11 + CUDA 13, DeepSpeed 0.19.8; benchmarks/gpu-runs/h200-2026-11-26/
and h200-2026-11-27/, allocated / reserved / outside figures per trial) and how DeepSpeed and PyTorch's caching
allocator allocate. Only trials that trained count as measurements: every fp16 trial of both runs skipped every
optimizer step (autotune.values.results reads them as untrained), which leaves 6 valid trials (ZeRO 0 x 2, ZeRO-1
and ZeRO-2 with the optimizer offloaded, ZeRO-3 on one rank; the ZeRO-2 offload config twice). What the H200 could
not tell apart is said where it is used; benchmarks/gpu_memory_accuracy.py names the trials each term rests on.

Outside the allocator (`outside_allocator_bytes`):
- CUDA context: measured 0.514 GiB on the H200 before the model (cuda_context_bytes, every trial). About half
  is local memory the driver reserves for every resident thread (1 KiB default stack x 2048 threads x 132
  SMs = 0.26 GiB); the rest (driver heaps, lazily loaded modules) is taken as the same on every GPU. Other
  generations scale by their SM count and threads per SM (not measured on them).
- Libraries: kernel images of cuBLAS/cuBLASLt, PyTorch, flash attention and DeepSpeed's ops loaded on first use
  (their workspaces come from the caching allocator and count as allocated): measured 0.78 GiB beyond the
  context with ZeRO 0 (both trials), 0.82-0.83 with ZeRO 1-2.
- ZeRO-3 in fp16 with an offload: 0.40 GiB more (1.69-1.74 GiB outside against 1.29-1.34 for stages 0-2 in the
  three ZeRO-3 trials of 11-26, all with the optimizer offloaded, all fp16; 1.69 in the two trained ones of 11-30,
  the parameters offloaded). Not ZeRO-3 itself: on one rank without offload it held 1.389 GB outside, as ZeRO 0 did
  (11-27 and 11-30, bf16); nor its offload in bf16: 1.31-1.34 GiB with the optimizer offloaded (11-30, llama-1b and
  llama-3b); nor fp16 at other stages: z2 mb2 fp16 held 1.389 GB too (11-27 fp16-trial), ZeRO 0's fp16 trials 1.29
  GiB (11-30). Mechanism unknown.
- ZeRO-1/2 with the optimizer offloaded: 42-48 MB more (1.431 and 1.437 GB; the pinned host buffers' mappings,
  most likely): 0.3% of those peaks, left out as block rounding is below.
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
- ZeRO-3's optimizer step without optimizer offload: the fp32 gradient of the sub-group being stepped (4 bytes x
  min(sub_group_size, partition); stage3.py `_prepare_fp32_grad_for_sub_group`, freed in `_release_sub_group`) is
  allocated in step(), after backward freed the activations, so it does not add to the allocated peak
  (`zero3_step_excess_bytes`: only what the step holds above the activations, its 16-bit flattened copy included).
  No freed activation block is that large, so it gets a segment of its own, and the next micro-steps'
  activations, served best-fit from their own blocks, leave that segment idle: cached at the backward peak
  (`zero3_step_cached_bytes`). Either way the peak counts the backward's activations plus that segment, or the
  step's own peak where it is larger. Measured on z3 mb8 ck0 bf16 (11-27, the one valid ZeRO-3 trial): reserve
  5.06 GB against 1.57 for the head's half, allocated 36.0 GB against 38.5 predicted with the gradient counted as
  allocated; its out-of-memory twin (mb16, in its first step: no optimizer step yet) reported 2.93 GiB reserved
  but unallocated, the head's half exactly. With expandable segments the gradient stays allocated, as before
  (`zero3_step_allocated_bytes`): freed pages could serve the activations, but that is not measured.
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

ZeRO-Offload's device staging buffer (`offload_staging_bytes`, allocated, so a buffer): ZeRO-1/2 with the optimizer
offloaded keep one buffer of the largest parameter's size, in the training dtype, on the device for the whole run
(stage_1_and_2.py, `temp_grad_buffer_for_gpu_offload`: gradients accumulated on the host come back through it).
0.13 GB for llama-1b (its 65.5M-element embedding); from the source, not fitted.

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
    offloaded = config.offload_optimizer != "none" or config.offload_param != "none"
    # Measured only with an offload in fp16 (module docstring); not in bf16, nor on one rank without offload.
    zero3 = ZERO3_OUTSIDE if config.zero_stage == 3 and offloaded and config.precision == "fp16" else 0
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


def _precision_bytes(config: Config) -> int:
    return 2 if config.precision in ("fp16", "bf16") else 4


def _sub_group_params(workload: Workload) -> int:
    """Parameters of one ZeRO-3 optimizer sub-group on a rank (sub_group_size, at most its partition)."""
    return min(Buckets.for_hidden(workload.model.hidden).sub_group, workload.model.params // workload.gpus)


def zero3_step_gradient_bytes(config: Config, workload: Workload) -> int:
    """ZeRO-3's fp32 gradient of the sub-group being stepped; none with the optimizer offloaded (its gradients go to
    the host). The CPU profile counts it as a buffer; on CUDA it is a cached segment (module docstring)."""
    if config.zero_stage != 3 or config.offload_optimizer != "none":
        return 0
    return 4 * _sub_group_params(workload)


def zero3_step_excess_bytes(config: Config, workload: Workload, hardware: Hardware, activations: int) -> int:
    """What ZeRO-3's optimizer step holds on CUDA above the backward's `activations`, which it outlives: the fp32
    sub-group gradient and the 16-bit flattened copy it is converted from (the same tensor in fp32). Allocated."""
    step = 0 if hardware.is_cpu else zero3_step_gradient_bytes(config, workload)
    if not step:
        return 0
    p = _precision_bytes(config)
    flat = p * _sub_group_params(workload) if p == 2 else 0
    return max(0, step + flat - activations)


def zero3_step_allocated_bytes(config: Config, workload: Workload, hardware: Hardware, activations: int) -> int:
    """The part of ZeRO-3's step gradient the estimate counts as allocated (a buffer): all of it on the CPU profile
    and with expandable segments (their freed pages could serve the activations, but no GPU has measured it, and
    that is the side that launches configs that do not fit), else what the step holds above the activations."""
    if hardware.is_cpu or hardware.allocator == "expandable":
        return zero3_step_gradient_bytes(config, workload)
    return zero3_step_excess_bytes(config, workload, hardware, activations)


def zero3_step_cached_bytes(config: Config, workload: Workload, hardware: Hardware,
                            activations: int | None = None) -> int:
    """The step's fp32 gradient segment, cached at the backward's peak (module docstring), less what the step itself
    holds above the activations (then it is allocated, at the step's peak). Without `activations` (the estimate
    passes them) the step is taken to stay below them."""
    step = 0 if hardware.is_cpu else zero3_step_gradient_bytes(config, workload)
    excess = 0 if activations is None else zero3_step_excess_bytes(config, workload, hardware, activations)
    return max(0, step - excess)


def offload_staging_bytes(config: Config, workload: Workload, hardware: Hardware) -> int:
    """ZeRO-1/2 optimizer offload's device buffer of the largest parameter (module docstring)."""
    if hardware.is_cpu or config.zero_stage not in (1, 2) or config.offload_optimizer == "none":
        return 0
    return _precision_bytes(config) * workload.model.largest_module_params


def logit_gradient_cast_bytes(config: Config, workload: Workload, hardware: Hardware) -> int:
    """CUDA at 16 bits: the loss upcasts the logits to fp32, so backward casts their fp32 gradient back to the training
    dtype, a 2-byte-per-logit tensor allocated while its source (and the head's 12 bytes) still live. Not fitted: the
    dtype's size; on the H200 the allocated peak was 1.66-1.89 bytes per logit above the estimate without it in the
    three trials the head dominates (z0 mb16 ck0, z2 mb8 ck4 twice; benchmarks/results/gpu_memory_accuracy.md)."""
    if hardware.is_cpu or config.precision not in ("fp16", "bf16"):
        return 0
    m = workload.model
    return 2 * config.micro_batch * m.seq_len * m.vocab


def allocator_reserve_bytes(config: Config, workload: Workload, hardware: Hardware,
                            activations: int | None = None) -> int:
    """Bytes the caching allocator holds cached but unused at the peak (module docstring); `activations`, the
    estimate's, decide how much of ZeRO-3's step is cached rather than allocated."""
    if hardware.is_cpu or hardware.allocator == "expandable":
        return 0
    m = workload.model
    p = 2 if config.precision in ("fp16", "bf16") else 4
    logits = config.micro_batch * m.seq_len * m.vocab
    reserve = HEAD_RESERVE_FRACTION * HEAD_BYTES_PER_LOGIT * logits
    if config.zero_stage == 0 and p == 2:
        reserve += p * m.params  # FP16_Optimizer's flattening: one 16-bit copy of per-parameter blocks
    reserve += zero3_live_params_bytes(config, workload, hardware)  # fetched-parameter blocks, one window
    reserve += zero3_step_cached_bytes(config, workload, hardware, activations)  # idle in backward
    return int(reserve)
