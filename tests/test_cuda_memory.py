"""The CUDA memory terms (autotune.prediction.cuda_memory): each behaves, and none touches the CPU profile."""

from __future__ import annotations

from autotune.values.config import Config
from autotune.prediction.cuda_memory import (MEASURED_CONTEXT, ZERO3_OUTSIDE, allocator_reserve_bytes,
                                             cuda_context_bytes, logit_gradient_cast_bytes, nccl_bytes, offload_staging_bytes,
                                             outside_allocator_bytes, zero3_live_params_bytes,
                                             zero3_step_allocated_bytes, zero3_step_cached_bytes,
                                             zero3_step_excess_bytes, zero3_step_gradient_bytes)
from autotune.prediction.estimate import MEMORY_TERMS, estimate
from autotune.values.hardware import PROFILES
from autotune.values.workload import PRESETS, Workload

GiB = 2**30
H200, CPU = PROFILES["h200"], PROFILES["cpu"]
LLAMA = PRESETS["llama-1b"]


def cfg(**kw) -> Config:
    base = dict(zero_stage=2, micro_batch=4, ckpt_interval=1, precision="bf16", offload_optimizer="none",
                offload_param="none")
    return Config(**{**base, **kw})


def test_context_is_the_measured_one_on_the_h200_and_scales_with_the_sms():
    assert cuda_context_bytes(H200) == MEASURED_CONTEXT
    assert cuda_context_bytes(PROFILES["h100-80gb"]) == MEASURED_CONTEXT
    assert cuda_context_bytes(PROFILES["l4"]) < cuda_context_bytes(PROFILES["a100-80gb"]) < MEASURED_CONTEXT
    assert cuda_context_bytes(H200.with_(name="my-gpu")) == MEASURED_CONTEXT  # unknown GPU: the measured one


def test_nccl_buffers_only_with_several_ranks_and_more_across_nodes():
    one, eight, sixteen = (Workload(LLAMA, 64, gpus=g) for g in (1, 8, 16))
    assert nccl_bytes(one, H200) == 0
    assert 0 < nccl_bytes(eight, H200) < nccl_bytes(sixteen, H200) < GiB
    c = cfg()
    assert outside_allocator_bytes(c, eight, H200) - outside_allocator_bytes(c, one, H200) == nccl_bytes(eight, H200)


def test_zero3_costs_more_outside_the_allocator_only_in_fp16_with_an_offload():
    """11-26's ZeRO-3 trials, all fp16 and offloaded, held 0.40 GiB more, and 11-30's fp16 ones with the parameters
    offloaded; 11-27's z3 mb8 ck0 bf16 on one rank as ZeRO 0 did, and 11-30's bf16 ones with the optimizer
    offloaded as ZeRO-2's offload did."""
    w = Workload(LLAMA, 32)
    assert outside_allocator_bytes(cfg(zero_stage=3), w, H200) == outside_allocator_bytes(cfg(zero_stage=2), w, H200)
    for offload in ({"offload_optimizer": "cpu"}, {"offload_param": "cpu"}):
        zero2 = outside_allocator_bytes(cfg(zero_stage=2, offload_optimizer="cpu"), w, H200)
        assert outside_allocator_bytes(cfg(zero_stage=3, **offload), w, H200) == zero2  # bf16
        fp16 = outside_allocator_bytes(cfg(zero_stage=3, precision="fp16", **offload), w, H200)
        assert fp16 - zero2 == ZERO3_OUTSIDE
    assert (outside_allocator_bytes(cfg(zero_stage=3, precision="fp16"), w, H200)
            == outside_allocator_bytes(cfg(zero_stage=2, precision="fp16"), w, H200))


def test_zero3_step_gradient_is_a_cached_segment_on_cuda():
    """ZeRO-3's fp32 sub-group gradient lives in step(), after backward: on CUDA it moves from the allocated buffers
    to the reserve (same total); the CPU profile keeps it a buffer, as before."""
    w = Workload(LLAMA, 32)
    z3 = cfg(zero_stage=3, ckpt_interval=0)
    grad = 4 * min(10**9, LLAMA.params)
    assert zero3_step_gradient_bytes(z3, w) == grad
    assert zero3_step_gradient_bytes(z3, Workload(LLAMA, 32, gpus=8)) == 4 * (LLAMA.params // 8)
    for other in (cfg(zero_stage=2), cfg(zero_stage=3, offload_optimizer="cpu")):  # offloaded: the host's gradients
        assert zero3_step_gradient_bytes(other, w) == 0
    assert zero3_step_cached_bytes(z3, w, H200) == grad
    assert allocator_reserve_bytes(z3, w, H200) - allocator_reserve_bytes(cfg(zero_stage=2, ckpt_interval=0), w,
                                                                          H200) == grad
    cuda, cpu = estimate(z3, w, H200).memory, estimate(z3, w, CPU).memory
    assert cpu.buffers - cuda.buffers == grad  # the rest of the buffers is the same on both
    assert cuda.allocator_reserve >= grad


def test_zero3_step_above_small_activations_is_allocated():
    """Where the step's gradient and its 16-bit flattened copy outgrow the backward's activations, the step is the
    allocated peak: its excess is a buffer and no longer a cached segment."""
    w = Workload(LLAMA, 32)
    sub = min(10**9, LLAMA.params)
    z3, z3_fp32 = cfg(zero_stage=3), cfg(zero_stage=3, precision="fp32")
    assert zero3_step_excess_bytes(z3, w, H200, activations=10**12) == 0
    assert zero3_step_excess_bytes(z3, w, H200, activations=0) == 6 * sub  # fp32 gradient + bf16 flat copy
    assert zero3_step_excess_bytes(z3_fp32, w, H200, activations=0) == 4 * sub  # .to(fp32) of fp32 is the copy
    assert zero3_step_cached_bytes(z3, w, H200, activations=4 * sub) == 2 * sub
    assert zero3_step_cached_bytes(z3, w, H200, activations=0) == 0
    # Expandable segments: no reserve, and the gradient stays allocated until a GPU measures that freed pages
    # serve the activations (the optimistic side); the CPU profile counts it as a buffer too.
    expandable = H200.with_(allocator="expandable")
    assert estimate(z3, w, expandable).memory.allocator_reserve == 0
    assert zero3_step_allocated_bytes(z3, w, expandable, activations=10**12) == 4 * sub
    assert zero3_step_allocated_bytes(z3, w, CPU, activations=10**12) == 4 * sub
    assert zero3_step_allocated_bytes(z3, w, H200, activations=10**12) == 0


def test_offload_staging_buffer_of_zero1_and_2():
    """stage_1_and_2.py's temp_grad_buffer_for_gpu_offload: the largest parameter, in the training dtype."""
    w = Workload(LLAMA, 32)
    for stage in (1, 2):
        assert offload_staging_bytes(cfg(zero_stage=stage, offload_optimizer="cpu"), w, H200) == \
            2 * LLAMA.largest_module_params
        assert offload_staging_bytes(cfg(zero_stage=stage), w, H200) == 0
    assert offload_staging_bytes(cfg(zero_stage=2, offload_optimizer="cpu", precision="fp32"), w, H200) == \
        4 * LLAMA.largest_module_params
    assert offload_staging_bytes(cfg(zero_stage=3, offload_optimizer="cpu"), w, H200) == 0
    on, off = (estimate(cfg(offload_optimizer=o), w, H200).memory.buffers for o in ("cpu", "none"))
    assert on - off == 2 * LLAMA.largest_module_params


def test_reserve_grows_with_the_logits_of_a_micro_batch():
    w = Workload(LLAMA, 32)
    small, large = (allocator_reserve_bytes(cfg(micro_batch=mb), w, H200) for mb in (2, 8))
    assert large == 4 * small > 0


def test_zero0_16_bit_flattening_and_zero3_gathers_add_to_the_reserve():
    w = Workload(LLAMA, 32)
    assert (allocator_reserve_bytes(cfg(zero_stage=0), w, H200) - allocator_reserve_bytes(cfg(zero_stage=1), w, H200)
            == 2 * LLAMA.params)
    assert allocator_reserve_bytes(cfg(zero_stage=0, precision="fp32"), w, H200) == \
        allocator_reserve_bytes(cfg(zero_stage=1, precision="fp32"), w, H200)
    # ZeRO-3 on one rank fetches nothing without parameter offload; with it, one live window of 1e9 parameters.
    z3 = cfg(zero_stage=3, offload_optimizer="cpu")
    assert zero3_live_params_bytes(z3, w, H200) == 0
    offload = cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
    assert zero3_live_params_bytes(offload, w, H200) == 2 * min(LLAMA.params, 10**9)
    assert zero3_live_params_bytes(z3, Workload(LLAMA, 32, gpus=8), H200) > 0


def test_every_term_is_zero_on_the_cpu_profile():
    w = Workload(PRESETS["tiny"], 16, gpus=2)
    for c in (cfg(), cfg(zero_stage=0), cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
              cfg(zero_stage=3), cfg(zero_stage=2, offload_optimizer="cpu")):
        assert outside_allocator_bytes(c, w, CPU) == allocator_reserve_bytes(c, w, CPU) == 0
        assert zero3_live_params_bytes(c, w, CPU) == offload_staging_bytes(c, w, CPU) == 0
        assert zero3_step_excess_bytes(c, w, CPU, activations=0) == zero3_step_cached_bytes(c, w, CPU) == 0
        mem = estimate(c, w, CPU).memory
        assert mem.allocator_reserve == mem.outside_allocator == 0 and mem.overhead == CPU.runtime_overhead_bytes


def test_the_breakdown_names_the_terms_and_sums_them():
    est = estimate(cfg(), Workload(LLAMA, 32), H200)
    assert {"allocator_reserve", "outside_allocator"} <= set(MEMORY_TERMS)
    data = est.memory.to_dict()
    assert data["total"] == sum(data[t] for t in MEMORY_TERMS) == est.peak_bytes
    assert data["allocator_reserve"] > 0 and data["outside_allocator"] > 0 and data["overhead"] == 0


def test_at_16_bits_on_cuda_the_head_also_holds_the_logits_gradient_cast_back():
    """2 bytes per logit, in the activations' peak: the loss upcasts the logits, so backward casts their fp32
    gradient back to the training dtype; none in fp32 (no cast) or on the CPU profile."""
    w = Workload(LLAMA, 32)
    logits = 8 * LLAMA.seq_len * LLAMA.vocab
    assert logit_gradient_cast_bytes(cfg(micro_batch=8, precision="bf16"), w, H200) == 2 * logits
    assert logit_gradient_cast_bytes(cfg(micro_batch=8, precision="fp16"), w, H200) == 2 * logits
    assert logit_gradient_cast_bytes(cfg(micro_batch=8, precision="fp32"), w, H200) == 0
    assert logit_gradient_cast_bytes(cfg(micro_batch=8, precision="bf16"), w, CPU) == 0
    bf16 = cfg(micro_batch=8, precision="bf16", ckpt_interval=0)
    assert estimate(bf16, w, H200).memory.activations - estimate(bf16, w, CPU).memory.activations == 2 * logits
