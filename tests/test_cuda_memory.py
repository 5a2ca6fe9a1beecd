"""The CUDA memory terms (autotune.prediction.cuda_memory): each behaves, and none touches the CPU profile."""

from __future__ import annotations

from autotune.values.config import Config
from autotune.prediction.cuda_memory import (MEASURED_CONTEXT, allocator_reserve_bytes, cuda_context_bytes, nccl_bytes,
                                  outside_allocator_bytes, zero3_live_params_bytes)
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


def test_zero3_costs_more_outside_the_allocator():
    w = Workload(LLAMA, 32)
    assert outside_allocator_bytes(cfg(zero_stage=3), w, H200) > outside_allocator_bytes(cfg(zero_stage=2), w, H200)


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
    for c in (cfg(), cfg(zero_stage=0), cfg(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")):
        assert outside_allocator_bytes(c, w, CPU) == allocator_reserve_bytes(c, w, CPU) == 0
        assert zero3_live_params_bytes(c, w, CPU) == 0
        mem = estimate(c, w, CPU).memory
        assert mem.allocator_reserve == mem.outside_allocator == 0 and mem.overhead == CPU.runtime_overhead_bytes


def test_the_breakdown_names_the_terms_and_sums_them():
    est = estimate(cfg(), Workload(LLAMA, 32), H200)
    assert {"allocator_reserve", "outside_allocator"} <= set(MEMORY_TERMS)
    data = est.memory.to_dict()
    assert data["total"] == sum(data[t] for t in MEMORY_TERMS) == est.peak_bytes
    assert data["allocator_reserve"] > 0 and data["outside_allocator"] > 0 and data["overhead"] == 0
