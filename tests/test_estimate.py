"""The estimator against DeepSpeed's own model-state estimators, called for real, and its shape."""

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from autotune.values.config import Config
from autotune.prediction.estimate import Calibration, estimate
from autotune.values.hardware import PROFILES
from autotune.values.workload import make_workload

GPU = PROFILES["a100-80gb"]
MODELS = ["gpt2-small", "gpt2-xl", "llama-7b"]
GPU_COUNTS = [1, 4, 8, 16, 64]
DS_BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor on host memory


def _states(est):
    mem = est.memory
    return mem.weights + mem.gradients + mem.optimizer_states


def _nodes(gpus):
    return max(1, gpus // GPU.gpus_per_node), min(gpus, GPU.gpus_per_node)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_zero2_matches_deepspeed(model, gpus):
    """ZeRO-2, 16-bit: device model states equal DeepSpeed's (2N + 18N/dp; with offload, 2N).
    Host memory with optimizer offload: ours is the steady state, 16 bytes/param (fp32 master, m, v, fp32
    gradient) spread over the nodes, plus, with gradient accumulation (here 64 micro-steps), the 16-bit
    host buffers in which stage_1_and_2.py accumulates each partition's gradients (accumulated_grads_in_cpu,
    2 bytes/param; DeepSpeed's estimator leaves them out, so they are subtracted before comparing).
    DeepSpeed's figure is per node too, with a 1.5x safety factor, and max(4 x all GPUs, 16) bytes/param:
    the fp32 weights every process loads at start-up, not divided across nodes. They agree on one node of up
    to 4 GPUs; beyond that DeepSpeed's is the larger."""
    workload = make_workload(model, 64 * gpus, gpus)
    n = workload.model.params
    nodes, per_node = _nodes(gpus)
    for offload in ("none", "cpu"):
        est = estimate(Config(2, 1, 0, "bf16", offload), workload, GPU)
        ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(n, per_node, nodes, cpu_offload=offload == "cpu")
        assert _states(est) == pytest.approx(ds_gpu, rel=1e-6, abs=16)
        if offload == "cpu":
            host_per_node = est.host_bytes * per_node - 2 * (n // gpus) * per_node  # minus accumulation buffers
            assert host_per_node == pytest.approx(16 * n / nodes, rel=1e-6)
            if nodes == 1 and gpus <= 4:
                assert host_per_node * DS_BUFFER_FACTOR == pytest.approx(ds_cpu, rel=1e-6)
            else:
                assert ds_cpu == pytest.approx(n * max(4 * gpus, 16) * DS_BUFFER_FACTOR, rel=1e-6)
                assert ds_cpu > host_per_node * DS_BUFFER_FACTOR


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpus", GPU_COUNTS)
def test_zero3_differs_from_deepspeed_by_documented_terms(model, gpus):
    """ZeRO-3: DeepSpeed's estimator adds 4 bytes x the largest layer (an fp32 copy) and counts a 4-byte
    gradient partition as persistent. What stage 3 keeps is a 16-bit gradient partition; the fp32 gradient
    exists per optimizer sub-group during the step and the gathered largest layer is 16-bit: both are in our
    `buffers` term, not in model states. So ours = DeepSpeed's - 4 x largest - 2N/dp without offload, and
    = DeepSpeed's - 4 x largest with optimizer (and parameter) offload."""
    workload = make_workload(model, 64 * gpus, gpus)
    m = workload.model
    n, largest = m.params, m.largest_module_params
    nodes, per_node = _nodes(gpus)
    cases = {("none", "none"): (False, False), ("cpu", "none"): (True, False), ("cpu", "cpu"): (True, True)}
    for (opt, param), (cpu_offload, cpu_offload_params) in cases.items():
        est = estimate(Config(3, 1, 0, "bf16", opt, param), workload, GPU)
        ds_cpu, ds_gpu, ds_largest = estimate_zero3_model_states_mem_needs(
            n, largest, per_node, nodes, cpu_offload=cpu_offload, cpu_offload_params=cpu_offload_params)
        pinned_difference = ds_largest + (2 * n // gpus if not cpu_offload else 0)
        assert _states(est) == pytest.approx(ds_gpu - pinned_difference, rel=1e-6, abs=16)
        assert est.memory.buffers >= 2 * largest  # the gathered 16-bit layer
        if cpu_offload:
            assert est.host_bytes * per_node * DS_BUFFER_FACTOR == pytest.approx(ds_cpu, rel=1e-6)


def test_zero_stages_shard_in_order():
    workload = make_workload("llama-7b", 512, 16)
    states = [_states(estimate(Config(s, 1, 0, "bf16"), workload, GPU)) for s in range(4)]
    assert states[0] > states[1] > states[2] > states[3]
    n = workload.model.params
    assert states[0] == 20 * n  # 2 weights + 2 grads + 4 fp32 grads + 12 optimizer
    assert states[3] == 16 * n // 16


def test_activations_follow_the_checkpoint_interval_and_micro_batch():
    """With checkpointing, the LM head's peak (start of backward) and one segment's recomputation come one
    after the other (measured on the built-in model, see autotune/prediction/estimate.py), so the peak is the larger
    of the two plus the segment inputs. For gpt2-medium (vocabulary 50257) the head's 2.5 GB exceed the
    recomputation of up to 8 layers: longer segments only save inputs, until all 24 layers at once cost
    more than the head (changed from act[1] < act[2] < ... < act[0] <= act[24], which added both peaks)."""
    workload = make_workload("gpt2-medium", 64)
    act = {k: estimate(Config(1, 4, k, "bf16"), workload, GPU).memory.activations for k in (0, 1, 2, 4, 8, 24)}
    assert act[8] < act[4] < act[2] < act[1] < act[24] < act[0]
    # Without the big head (a small vocabulary), the classic trade-off: a layer keeps 16 hidden-sized tensors
    # per token and a segment input one, so the optimum sqrt(24 / 16) is about 1 layer per segment, and one
    # segment of all layers saves nothing.
    small_vocab = workload.with_(model=workload.model.__class__(**{**workload.model.to_dict(), "vocab": 512}))
    act = {k: estimate(Config(1, 4, k, "bf16"), small_vocab, GPU).memory.activations for k in (0, 1, 2, 4, 8, 24)}
    assert act[1] < act[2] < act[4] < act[8] < act[0] <= act[24]
    small, big = (estimate(Config(1, b, 0, "bf16"), workload, GPU).memory.activations for b in (2, 4))
    assert big == pytest.approx(2 * small, rel=0.01)
    fp32 = estimate(Config(1, 4, 0, "fp32"), workload, GPU).memory.activations
    assert fp32 > 1.5 * act[0]


def test_korthikanti_per_layer_figure_without_dropout():
    """34 bytes/token/hidden per layer in 16 bits (Korthikanti et al.) minus the two dropout masks = 32."""
    from autotune.prediction.estimate import _activation_bytes

    workload = make_workload("gpt2-medium", 64)
    m = workload.model
    two_layers = workload.with_(model=m.__class__(**{**m.to_dict(), "layers": 2}))
    one_layer = workload.with_(model=m.__class__(**{**m.to_dict(), "layers": 1}))
    c = Config(1, 4, 0, "bf16")
    per_layer = _activation_bytes(c, two_layers) - _activation_bytes(c, one_layer)
    sbh = m.seq_len * 4 * m.hidden
    logsumexp = 4 * m.heads * m.seq_len * 4
    assert per_layer - logsumexp == 32 * sbh


def test_step_time_reflects_recompute_offload_and_communication():
    workload = make_workload("gpt2-xl", 256, 16)
    def t(**kw):
        return estimate(Config(**{"zero_stage": 2, "micro_batch": 4, "ckpt_interval": 0,
                                            "precision": "bf16", **kw}), workload, GPU)
    base = t()
    assert t(ckpt_interval=1).step_time_s > base.step_time_s  # recomputation costs a forward
    assert t(offload_optimizer="cpu").step_time_s > base.step_time_s
    assert t(zero_stage=3).time["communication"] > base.time["communication"]  # 1.5x volume
    assert t(precision="fp32").step_time_s > 3 * base.step_time_s
    assert t(micro_batch=8).throughput_samples_per_s > base.throughput_samples_per_s  # efficiency grows
    single = estimate(Config(2, 4, 0, "bf16"), workload.with_(gpus=1, global_batch=16), GPU)
    assert single.time["communication"] == 0


def test_cpu_offload_on_the_cpu_accelerator_saves_nothing():
    """ARCHITECTURE.md section 4: on the CPU, offloaded state lives in the same RSS as everything else."""
    workload = make_workload("tiny")
    cpu = PROFILES["cpu"]
    plain = estimate(Config(3, 4, 0, "bf16"), workload, cpu)
    offloaded = estimate(Config(3, 4, 0, "bf16", "cpu", "cpu"), workload, cpu)
    assert offloaded.host_bytes == 0
    assert offloaded.peak_bytes >= plain.peak_bytes - plain.memory.buffers


def test_calibration_terms_apply():
    workload = make_workload("tiny")
    cpu = PROFILES["cpu"]
    c = Config(2, 4, 1, "bf16")
    base = estimate(c, workload, cpu)
    cal = estimate(c, workload, cpu, Calibration(overhead_bytes=0, activation_scale=2.0, flops_scale=2.0))
    assert cal.memory.overhead == 0
    assert cal.memory.activations == pytest.approx(2 * base.memory.activations, rel=1e-6)
    assert cal.time["compute"] == pytest.approx(base.time["compute"] / 2)


def test_fits_and_dominant_term():
    workload = make_workload("llama-13b", 64, 1)
    est = estimate(Config(0, 1, 0, "bf16"), workload, GPU)
    assert not est.fits(GPU.memory_bytes)
    assert est.memory.dominant == "optimizer_states"
    assert est.fits(est.peak_bytes) and not est.fits(est.peak_bytes - 1)
    assert est.fits(est.peak_bytes - 1, margin=0.01)
