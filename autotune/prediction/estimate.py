"""Per-device memory and step-time predictions for a config, before anything runs (pure arithmetic).

Sources, per term (see also ARCHITECTURE.md section 5):
- Model states: ZeRO (Rajbhandari et al., SC'20, section 3, table 1) as DeepSpeed implements it:
  a 16-bit copy of the weights, gradients, and 12 bytes/param of optimizer state (fp32 master, Adam m, v),
  plus the fp32 gradient partition DeepSpeed keeps for stages 1-2 (counted by
  `estimate_zero2_model_states_mem_needs` too). ZeRO-1 shards the optimizer, ZeRO-2 also the gradients,
  ZeRO-3 also the weights. fp32 training keeps the same layout with 4-byte weights and gradients (DeepSpeed's
  ZeRO still holds a flat fp32 master partition); without ZeRO, fp32 Adam holds only m and v.
- Activations: Korthikanti et al. 2022, s*b*h*(34 + 5*a*s/h) bytes per layer in 16 bits, derived here
  tensor by tensor for a model without dropout and with fused attention (SDPA): the a*s^2 score term
  vanishes and what is saved is 8h + 2f elements per token for a GELU MLP of width f (34 -> 32 bytes
  per token when f = 4h and there are no dropout masks). Recomputation keeps only segment inputs and
  one live segment. The LM head's peak (12 bytes per logit: the fp32 log-softmax and two gradients)
  is counted separately: for small models with big vocabularies it dominates. Checked against the
  built-in model's measured peaks (autotune.worker.model; benchmarks/memory_accuracy.py): with
  checkpointing the head's peak and a segment's recomputation come one after the other, not together.
- Buffers: the ZeRO bucket sizes written by autotune.values.dsconfig (Buckets), ZeRO-3's gathered largest
  module and prefetch bucket, the fp32 gradient of one optimizer sub-group during a ZeRO-3 step (on CUDA with the
  default allocator only what that step holds above the activations it outlives); on CUDA also ZeRO-3's live
  window of gathered parameters and ZeRO-Offload's device staging buffer (autotune.prediction.cuda_memory).
- On CUDA, the peak the product measures is the caching allocator's reserved peak plus the memory outside it:
  `allocator_reserve` and `outside_allocator` (autotune.prediction.cuda_memory, from the H200 run) replace the profile's
  flat `runtime_overhead_bytes`, which only the CPU profile uses (`overhead` is 0 on CUDA unless calibrated).
- Step time: 6*N*tokens FLOPs (+2*N*tokens when layers are recomputed, + attention's 12*L*s^2*h per
  sample) at an efficiency that grows with tokens per micro-batch; ZeRO's collectives per stage and micro-step
  (autotune.prediction.comm: ring/tree all-reduce, reduce-scatter, all-gather with bandwidth and latency); offload transfers over the host link and
  CPU Adam time; NVMe reads and writes for ZeRO-Infinity.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.prediction.comm import STAGE0_ALLREDUCE_BUCKET, comm_time
from autotune.values.config import Config
from autotune.prediction.cuda_memory import (allocator_reserve_bytes, logit_gradient_cast_bytes, offload_staging_bytes,
                                             outside_allocator_bytes,
                                             zero3_live_params_bytes, zero3_step_allocated_bytes)
from autotune.prediction.trial_time import DEFAULT_MEASURE, Measure, TrialTime, TrialTimeModel, trial_time
from autotune.values.dsconfig import NVME_OPTIMIZER_BUFFERS, NVME_PARAM_BUFFERS, Buckets, nvme_param_buffer_elements
from autotune.values.hardware import Hardware
from autotune.values.workload import ModelShape, Workload

MEMORY_TERMS = ("weights", "gradients", "optimizer_states", "activations", "buffers", "allocator_reserve",
                "outside_allocator", "overhead")


@dataclass(frozen=True)
class Calibration:
    """Free terms fitted to measurements of one workload on one machine (autotune.prediction.calibrate)."""

    overhead_bytes: int | None = None  # replaces hardware.runtime_overhead_bytes (0 on CUDA: see estimate())
    memory_scale: float = 1.0  # allocator slack on model states and buffers
    activation_scale: float = 1.0  # saved activations as the framework really keeps them
    flops_scale: float = 1.0  # effective FLOP/s relative to the profile's
    # Per precision, a further factor on flops_scale: a profile's ratio between precisions can be wrong for
    # a device (the stock cpu profile rates bf16 as fp32; a CPU with AMX-BF16 runs it ~10x faster).
    precision_scales: tuple[tuple[str, float], ...] = ()
    step_overhead_s: float | None = None  # replaces hardware.step_overhead_s
    # Collective time relative to the profile's interconnect (autotune.prediction.comm); 1 where only one rank was measured.
    comm_scale: float = 1.0
    reserve_scale: float = 1.0  # the caching allocator's reserve (CUDA) as measured on this machine
    samples: int = 0  # how many measured results the fit used

    def __post_init__(self) -> None:
        # From JSON the pairs come back as lists, or as a mapping written by hand.
        pairs = self.precision_scales.items() if isinstance(self.precision_scales, dict) else self.precision_scales
        object.__setattr__(self, "precision_scales", tuple((str(k), float(v)) for k, v in pairs))

    def flops_scale_for(self, precision: str) -> float:
        return self.flops_scale * dict(self.precision_scales).get(precision, 1.0)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["precision_scales"] = dict(self.precision_scales)
        return data


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    buffers: int
    overhead: int
    # CUDA only (autotune.prediction.cuda_memory): cached but unused blocks of the caching allocator at the peak, and the
    # device memory outside it (context, libraries, NCCL). 0 on the CPU profile.
    allocator_reserve: int = 0
    outside_allocator: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, term) for term in MEMORY_TERMS)

    @property
    def dominant(self) -> str:
        """The largest term: the one to attack when a config does not fit."""
        return max(MEMORY_TERMS, key=lambda term: getattr(self, term))

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class Estimate:
    config: Config
    memory: MemoryBreakdown  # per device
    host_bytes: int  # per device, offloaded state and pinned buffers in host memory
    nvme_bytes: int  # per device
    step_time_s: float
    time: dict[str, float] = field(compare=False)  # compute, recompute, communication, zero, offload, optimizer, overhead
    global_batch: int = 0
    tokens_per_sample: int = 0

    @property
    def peak_bytes(self) -> int:
        return self.memory.total

    @property
    def throughput_samples_per_s(self) -> float:
        return self.global_batch / self.step_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.throughput_samples_per_s * self.tokens_per_sample

    def fits(self, budget_bytes: int, margin: float = 0.0) -> bool:
        """Predicted peak within budget * (1 + margin)."""
        return self.peak_bytes <= budget_bytes * (1.0 + margin)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "memory": self.memory.to_dict(), "host_bytes": self.host_bytes,
                "nvme_bytes": self.nvme_bytes, "step_time_s": self.step_time_s, "time": dict(self.time),
                "throughput_samples_per_s": self.throughput_samples_per_s, "tokens_per_s": self.tokens_per_s}


def host_need_bytes(est: Estimate, workload: Workload, hardware: Hardware) -> int:
    """Host memory the offloaded state of all ranks of one node needs."""
    return est.host_bytes * min(workload.gpus, hardware.gpus_per_node)


def over_host_memory(est: Estimate, workload: Workload, hardware: Hardware) -> bool:
    """Whether a node's offloaded state is predicted over the profile's host memory (such a config does not run:
    the simulated backend fails it out of host memory, `estimate` counts it apart)."""
    return host_need_bytes(est, workload, hardware) > hardware.host_memory_bytes


def nvme_need_bytes(est: Estimate, workload: Workload, hardware: Hardware) -> int:
    """NVMe space the offloaded state of all ranks of one node needs (they share the node's path)."""
    return est.nvme_bytes * min(workload.gpus, hardware.gpus_per_node)


def trial_time_of(est: Estimate, workload: Workload, hardware: Hardware, *, budget_bytes: int,
                  ops_built: frozenset[str] | set[str] = frozenset(), measure: Measure = DEFAULT_MEASURE,
                  model: TrialTimeModel | None = None) -> TrialTime:
    """What running `est`'s config as a trial would take (autotune.prediction.trial_time), at its predicted step time
    (calibrated where `est` is): a trial whose predicted peak is over the sweep's `budget_bytes` dies out of memory in
    its first step, one whose model states alone are over it in deepspeed.initialize. `ops_built`: the ops the sweep
    has built; `model`: calibrated terms."""
    return trial_time(est.config, workload, hardware, est.step_time_s, fits=est.fits(budget_bytes),
                      ops_built=ops_built, measure=measure, model=model, states_fit=states_fit(est, workload, budget_bytes))


def states_fit(est: Estimate, workload: Workload, budget_bytes: int) -> bool:
    """Whether the device's model states (weights, gradients, optimizer states, and what deepspeed.initialize holds
    with them) alone fit `budget_bytes`: where they do not, a trial dies as deepspeed.initialize allocates them."""
    m = est.memory
    initialize = fp16_fp32_gradient_bytes(est.config, workload)
    return m.weights + m.gradients + m.optimizer_states + initialize <= budget_bytes


def model_states(config: Config, workload: Workload) -> tuple[int, int, int]:
    """(weights, gradients, optimizer_states) bytes per device before any offload."""
    n, dp = workload.model.params, workload.gpus
    p = 2 if config.precision in ("fp16", "bf16") else 4
    stage = config.zero_stage
    weights = p * n if stage < 3 else p * n // dp
    if stage == 0:
        # Mixed precision: fp32 master + m + v. DeepSpeed's BF16_Optimizer also accumulates fp32 gradients all
        # along; its FP16_Optimizer keeps the 16-bit ones, and makes fp32 ones only in its steps
        # (fp16_fp32_gradient_bytes).
        grads = p * n + (4 * n if config.precision == "bf16" else 0)
        optim = 12 * n if p == 2 else 8 * n
    else:
        low_grads = p * n if stage == 1 else p * n // dp
        grads = low_grads + (4 * n // dp if stage < 3 else 0)
        optim = 12 * n // dp
    return weights, grads, optim


def fp16_fp32_gradient_bytes(config: Config, workload: Workload) -> int:
    """ZeRO 0's fp16 optimizer (deepspeed/runtime/fp16/fused_optimizer.py) keeps 16-bit gradients and makes fp32 ones
    only in its steps, 4 bytes a parameter: in deepspeed.initialize, zeros for the one step that creates Adam's
    state (so the states hold 18 bytes a parameter there); in training, each gradient cast to fp32 and those copies
    flattened into one, twice as much at once, after backward freed the activations. Measured on the H200 (11-30,
    llama-1b, 1,024 tokens): micro-batch 1 without checkpointing and 16 with it both peaked at 24.06 bytes a
    parameter allocated, the states' 16 and the step's 8; llama-3b's states (16 bytes a parameter: 44.9 of a 45
    GiB budget) died in deepspeed.initialize."""
    if config.zero_stage != 0 or config.precision != "fp16":
        return 0
    return 4 * workload.model.params


def _attention_bytes(config: Config, m: ModelShape, p: int) -> int:
    """What one layer's attention keeps beyond q, k, v and its output. Fused (SDPA, flash): the fp32
    logsumexp per query and head. Eager: the s x s softmax output of every head, which backward reads (the
    scores before it are freed: their matmul saves q and k), and with attention dropout its 1-byte mask and
    its output too: Korthikanti et al.'s 5as/h per token in 16-bit (measured with torch's saved-tensor
    hooks on nn.MultiheadAttention(need_weights=True): 2.0 bytes per score in bf16, 4.0 in fp32). Math (SDPA
    on torch's math kernel, as on the CPU with dropout): fp32 softmax output, and with dropout its fp32 mask
    and output: 4 or 12 bytes per score in any dtype (measured: 4.0 and 12.0, torch 2.13).
    """
    scores = config.micro_batch * m.heads * m.seq_len ** 2
    if m.attention == "eager":
        return scores * (p + (1 + p if m.attention_dropout else 0))
    if m.attention == "math":
        return scores * (12 if m.attention_dropout else 4)
    return config.micro_batch * m.heads * m.seq_len * 4


def _attention_elements(m: ModelShape) -> int:
    """What one layer's attention keeps per token for backward, in elements, beyond its input norm: its
    output (the o-projection's input), q, k, v for SDPA, the rotary outputs of q and k, and with q/k norms
    (Qwen3, Gemma 3) those norms' inputs and outputs."""
    q, o = m.q_dim, m.o_dim
    if m.mla:
        # Multi-head latent attention as transformers trains it, tensor by tensor (saved-tensor hooks on
        # DeepseekV2/V3Attention, transformers 5.23, SDPA; 7008 against 7025 measured per token and layer of
        # a 4-head test model): the norm outputs feeding the projections (2h; MHA's rotary term stands for
        # them), the query latent's norm (input, normalised, output: 3 x q_lora_rank), the KV latent with the
        # shared rotary key (kv_lora_rank + rope_head_dim) and its norm (2 x kv_lora_rank), then every head's
        # key (q wide) rebuilt from the latent for SDPA, kv_b_proj's whole output (each head's non-rotary key
        # and value: SDPA keeps the value as a view of it), SDPA's query and output, and the o-projection's
        # input (a copy). The latent shrinks the inference KV cache, not what training keeps: per-head K and V
        # are materialised (DeepSeek-V3's own trainer recomputes them, arXiv 2412.19437 section 3.3.2).
        latent = 3 * m.q_lora_rank + (m.kv_lora_rank + m.rope_head_dim) + 2 * m.kv_lora_rank
        kv_up = m.heads * (m.head_dim - m.rope_head_dim) + o
        return 2 * m.hidden + latent + (q + q) + kv_up + 2 * o + (4 * q if m.qk_norm else 0)
    kept = o + (q + 2 * m.kv_dim)
    if m.positions == "rotary":
        kept += q + m.kv_dim  # rotary outputs of q and k
    if m.qk_norm:
        kept += 2 * (q + m.kv_dim)
    return kept


def _mlp_elements(m: ModelShape, width: int) -> int:
    return 2 * width if m.arch == "gpt" else 4 * width  # GELU in and out; gate, up, act, product


def _norm_upcast_bytes(m: ModelShape, p: int) -> int:
    """What RMSNorm computed in fp32 at 16-bit precision (autotune.worker.model.RMSNorm, as Hugging Face's) adds per
    token and layer: backward keeps each norm's fp32 copy of its input instead of the 16-bit input, 2 bytes more
    an element; the q/k norms' inputs are views of the fused projection, kept anyway (SDPA's value is a view of
    it), so theirs add all 4 bytes. LayerNorm's kernel computes in fp32 inside and keeps its 16-bit input.
    Measured on the built-in model with saved-tensor hooks (tests/test_worker.py)."""
    if p != 2 or m.arch != "llama":
        return 0
    return 2 * m.hidden * m.norms_per_layer + (4 * (m.q_dim + m.kv_dim) if m.qk_norm else 0)


def norm_upcast_bytes(config: Config, workload: Workload) -> int:
    """The activation bytes of the fp32 RMSNorm (autotune.worker.model.MODEL_REVISION 2) in `config`'s estimate: what
    a trial recorded before it (a record without `model_revision`) did not hold."""
    return _activation_bytes(config, workload) - _activation_bytes(config, workload, fp32_norms=False)


def _activation_bytes(config: Config, workload: Workload, fp32_norms: bool = True) -> int:
    m = workload.model
    p = 2 if config.precision in ("fp16", "bf16") else 4
    tokens = config.micro_batch * m.seq_len
    h = m.hidden
    # Norms' inputs and outputs (two norms: 4h; one shared by parallel attention and MLP: 2h; Gemma 2's
    # four: 6h) and the attention's own.
    per_token = 2 * h * min(m.norms_per_layer, 2) + h * max(m.norms_per_layer - 2, 0) + _attention_elements(m)
    upcast = _norm_upcast_bytes(m, p) if fp32_norms else 0
    dense_width = m.dense_ffn_hidden or m.ffn_hidden
    dense = tokens * ((per_token + _mlp_elements(m, dense_width)) * p + upcast) + _attention_bytes(config, m, p)
    layer, active_width = dense, dense_width
    if m.moe:
        # Each token through its routed experts only (a router picks experts_per_token of them): their MLPs,
        # its gathered input and weighted output; the shared experts' MLP (and its gate's scaled output) for
        # every token. The experts no token was routed to keep nothing.
        mlp = m.experts_per_token * (_mlp_elements(m, m.ffn_hidden) + 2 * h)
        if m.shared_ffn_hidden:
            mlp += _mlp_elements(m, m.shared_ffn_hidden) + (h if m.shared_gate else 0)
        layer = tokens * ((per_token + mlp) * p + upcast) + _attention_bytes(config, m, p)
        active_width = m.ffn_hidden * m.experts_per_token + m.shared_ffn_hidden
        if m.dense_layers:
            active_width = max(active_width, dense_width)
    # The LM head at the start of backward: the fp32 log-softmax kept for backward, its gradient and the
    # gradient of its input, 12 bytes per logit in fp32 and in bf16 (measured on the built-in model: 12.0
    # and 12.3; the 16-bit logits and the fp32 upcast are freed in forward, nothing saves them).
    head = tokens * m.vocab * 12 + (tokens * 2 * h if upcast else 0)  # and the final norm's fp32 copy
    if not config.ckpt_interval:
        return (m.layers - m.dense_layers) * layer + m.dense_layers * dense + head
    # Checkpointed: the segment inputs stay; the head's peak is over before backward recomputes the first
    # segment, so the two peaks do not add up (measured: segments of 1, 2 and 4 layers of tiny all peak at
    # the head). Recomputing one segment holds its layers' activations and the gradients in flight.
    segments = math.ceil(m.layers / config.ckpt_interval)
    inputs = segments * tokens * m.hidden * p
    widest = max(layer, dense) if m.dense_layers else layer
    recompute = config.ckpt_interval * widest + tokens * ((active_width + m.hidden) * p + 4 * m.hidden)
    return inputs + max(head, recompute)


def estimate(config: Config, workload: Workload, hardware: Hardware,
             calibration: Calibration = Calibration()) -> Estimate:
    m, dp = workload.model, workload.gpus
    n = m.params
    p = 2 if config.precision in ("fp16", "bf16") else 4
    stage = config.zero_stage
    n_local = n if stage == 0 else n // dp  # parameters whose optimizer state this device owns
    buckets = Buckets.for_hidden(m.hidden)

    weights, grads, optim = model_states(config, workload)
    host_weights = host_optim = nvme = 0
    # Offload: the fp32 gradient partition and the optimizer states move (ZeRO-Offload); with offloaded
    # optimizer, ZeRO-2/3 stream 16-bit gradients to the host in buckets instead of keeping them.
    if config.offload_optimizer != "none":
        moved = optim + 4 * n_local
        optim = 0
        grads = p * n if stage == 1 else 0
        if config.offload_optimizer == "nvme":
            nvme += moved
            # Pinned swap buffers, per rank: buffer_count x the largest sub-group of its partition, in fp32
            # (deepspeed/runtime/swap_tensor/optimizer_utils.py: SwapBufferManager(largest_numel, buffer_count)).
            host_optim += NVME_OPTIMIZER_BUFFERS * min(buckets.sub_group, n_local) * 4
        else:
            host_optim += moved
        if stage in (1, 2) and (workload.grad_accumulation(config.micro_batch) or 1) > 1:
            # ZeRO-1/2 offload accumulates gradients across micro-steps in host buffers of the 16-bit
            # dtype, one per parameter of the partition (stage_1_and_2.py: accumulated_grads_in_cpu).
            host_optim += p * n_local
    if config.offload_param != "none":
        if config.offload_param == "nvme":
            nvme += weights
            # Pinned swap buffers, per rank whatever the ranks: buffer_count x buffer_size in the training dtype
            # (partitioned_param_swapper.py).
            host_weights += NVME_PARAM_BUFFERS * nvme_param_buffer_elements(workload) * p
        else:
            host_weights += weights
        weights = 0
    if hardware.is_cpu:
        # On the CPU accelerator, "offloaded" state lives in the same RAM as everything else.
        weights, optim, host_weights, host_optim = weights + host_weights, optim + host_optim, 0, 0

    # On CUDA at 16 bits the head's peak also holds its gradient cast back to the training dtype (cuda_memory).
    activations = int((_activation_bytes(config, workload) + logit_gradient_cast_bytes(config, workload, hardware))
                      * calibration.activation_scale)
    buffers = max(0, 2 * fp16_fp32_gradient_bytes(config, workload) - activations)  # the step's peak above backward's
    if stage == 0 and dp > 1:
        buffers += min(n, STAGE0_ALLREDUCE_BUCKET) * p
    elif stage in (1, 2):
        buffers += buckets.reduce * p * (2 if stage == 2 else 1) + buckets.allgather * p
    elif stage == 3:
        buffers += (buckets.reduce + buckets.prefetch + m.largest_module_params) * p
        # The fp32 gradient of the sub-group being stepped. On CUDA the step comes after backward freed the
        # activations: only what it holds above them counts, its segment is in the reserve (cuda_memory).
        buffers += zero3_step_allocated_bytes(config, workload, hardware, activations)
        buffers += zero3_live_params_bytes(config, workload, hardware)  # 0 on the CPU profile
    buffers += offload_staging_bytes(config, workload, hardware)  # ZeRO-Offload's device buffer; 0 on the CPU profile

    scale = calibration.memory_scale
    # On CUDA the reserve and the memory outside the allocator are modeled (autotune.prediction.cuda_memory) and replace
    # the profile's flat runtime overhead; a calibration's fitted overhead still adds to them.
    default_overhead = hardware.runtime_overhead_bytes if hardware.is_cpu else 0
    overhead = default_overhead if calibration.overhead_bytes is None else calibration.overhead_bytes
    memory = MemoryBreakdown(weights=int(weights * scale), gradients=int(grads * scale),
                             optimizer_states=int(optim * scale), activations=activations,
                             buffers=int(buffers * scale), overhead=int(overhead),
                             allocator_reserve=int(allocator_reserve_bytes(config, workload, hardware, activations)
                                                   * calibration.reserve_scale),
                             outside_allocator=outside_allocator_bytes(config, workload, hardware))

    time = _step_time(config, workload, hardware, calibration, p, n_local)
    return Estimate(config, memory, int(host_weights + host_optim), int(nvme), sum(time.values()), time,
                    workload.global_batch, m.seq_len)


def _step_time(config: Config, workload: Workload, hardware: Hardware, calibration: Calibration,
               p: int, n_local: int) -> dict[str, float]:
    m, dp = workload.model, workload.gpus
    gas = workload.grad_accumulation(config.micro_batch) or 1
    tokens = config.micro_batch * m.seq_len
    # Per token, the parameters it goes through (a MoE layer's routed experts only) and attention's scores.
    layer_flops = (2 * tokens * m.active_layers_params
                   + 2 * config.micro_batch * m.layers * m.seq_len ** 2 * (m.q_dim + m.o_dim))
    forward = layer_flops + 2 * tokens * m.vocab * m.hidden
    ranks_per_node = min(dp, hardware.gpus_per_node)
    # CPU ranks share the machine's cores.
    peak = hardware.peak_flops[config.precision] / (ranks_per_node if hardware.is_cpu else 1)
    efficiency = hardware.max_efficiency * tokens / (tokens + hardware.half_efficiency_tokens)
    rate = peak * efficiency * calibration.flops_scale_for(config.precision)
    compute = gas * 3 * forward / rate
    recompute = gas * layer_flops / rate if config.ckpt_interval else 0.0

    # The collectives of each ZeRO stage per micro-step and per step, ring/tree over the intra- or inter-node
    # link (autotune.prediction.comm).
    comm = comm_time(config, workload, hardware, p) * calibration.comm_scale

    offload = 0.0
    if config.offload_param != "none":
        # Each micro-step fetches this rank's partition for forward and again for backward.
        link = hardware.host_link_bw if config.offload_param == "cpu" else hardware.nvme_bw / ranks_per_node
        offload += gas * 2 * p * n_local / link
        if config.offload_param == "cpu" and config.offload_optimizer == "none":
            offload += hardware.param_offload_step_s * n_local / 1e9  # the step's update copied to the host
    if config.offload_optimizer != "none":
        offload += 2 * p * n_local / hardware.host_link_bw  # gradients down, updated weights up
        if config.offload_optimizer == "nvme":
            offload += 2 * 16 * n_local / (hardware.nvme_bw / ranks_per_node)
        optimizer = n_local / hardware.cpu_adam_params_per_s
    else:
        optimizer = (2 * (16 + p) * n_local) / hardware.mem_bandwidth  # read and write weights and states
    # ZeRO's own work each micro-step (hooks, buckets, gathers), in proportion to the model's parameters: every
    # rank's hooks see each of them, whatever its partition. A ZeRO-2 optimizer offloaded streams the gradients to
    # the host instead (priced in `offload`).
    per_gparam = {1: hardware.zero1_micro_step_s, 2: hardware.zero2_micro_step_s,
                  3: hardware.zero3_micro_step_s}.get(config.zero_stage, 0.0)
    if config.zero_stage == 2 and config.offload_optimizer != "none":
        per_gparam = 0.0
    zero = gas * per_gparam * m.params / 1e9
    overhead = hardware.step_overhead_s if calibration.step_overhead_s is None else calibration.step_overhead_s
    return {"compute": compute, "recompute": recompute, "communication": comm, "zero": zero, "offload": offload,
            "optimizer": optimizer, "overhead": overhead}
