"""fp16 numerics of the built-in trial model (issue 40), in plain PyTorch on the CPU (DeepSpeed refuses fp16 on most
CPUs): every architecture it builds keeps finite gradients at the loss scales a dynamic scaler tries first (2^16)
and last (1), and trains; and what RMSNorm in fp32 costs in memory is what the estimator prices."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autotune.prediction.estimate import _activation_bytes
from autotune.values.config import Config
from autotune.values.workload import ModelShape, Workload
from autotune.worker.model import build, synthetic_batch, unsupported_reason

# Each architecture the built-in model builds, at a reduced size (llama-1b's head and width ratios, 2 layers).
LLAMA = ModelShape("llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn_hidden=352, vocab=512, seq_len=32,
                   arch="llama")
GPT = ModelShape("gpt", layers=2, hidden=128, heads=4, vocab=512, seq_len=32)
SHAPES = {
    "llama": LLAMA,
    "gpt": GPT,  # LayerNorm, biases, GELU, learned positions, tied embeddings (GPT-2)
    "qk-norm": replace(LLAMA, name="qk-norm", qk_norm=True, head_dim=32),  # Qwen3, Gemma 3
    "four-norm": replace(LLAMA, name="four-norm", norms_per_layer=4, head_dim=64, tied_embeddings=True),  # Gemma 2
    "parallel": replace(GPT, name="parallel", norms_per_layer=1, positions="rotary", lm_head_bias=True,
                        tied_embeddings=False),  # Phi-2
    "neox": replace(GPT, name="neox", positions="rotary", tied_embeddings=False),  # GPT-NeoX / Pythia
    "qkv-bias": replace(LLAMA, name="qkv-bias", qkv_bias=True),  # Qwen2
}


def test_every_kind_of_norm_and_position_the_model_builds_is_covered():
    assert all(unsupported_reason(s) is None for s in SHAPES.values())
    assert {s.arch for s in SHAPES.values()} == {"llama", "gpt"}  # RMSNorm, LayerNorm
    assert {s.norms_per_layer for s in SHAPES.values()} == {1, 2, 4}  # unsupported_reason refuses any other
    assert {s.positions for s in SHAPES.values()} == {"learned", "rotary"}
    assert any(s.qk_norm for s in SHAPES.values()) and any(s.tied_embeddings for s in SHAPES.values())


def _fp16(shape: ModelShape) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(shape, 0, "cpu", torch.float16)


@pytest.mark.parametrize("scale", [2.0**16, 1.0], ids=["scale 2^16", "scale 1"])
@pytest.mark.parametrize("name", SHAPES)
def test_fp16_gradients_are_finite(name, scale):
    shape = SHAPES[name]
    model = _fp16(shape)
    tokens, targets = synthetic_batch(shape, 2, torch.Generator().manual_seed(1))
    (model(tokens, targets) * scale).backward()
    bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not bad, f"{name}: non-finite gradients at loss scale {scale:g} in {bad}"


@pytest.mark.parametrize("name", SHAPES)
def test_fp16_training_lowers_the_loss_of_a_repeated_batch(name):
    """Mixed precision as DeepSpeed's fp16 optimizers run it: the fp16 model's gradients of a scaled loss, unscaled
    into fp32 master weights that Adam steps, copied back; a step whose gradients overflow is skipped and the scale
    halved. Ten optimizer steps, none skipped, and the loss falls."""
    shape = SHAPES[name]
    model = _fp16(shape)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.Adam(master, lr=1e-3)
    tokens, targets = synthetic_batch(shape, 2, torch.Generator().manual_seed(1))
    scale, losses, skipped = 2.0**16, [], 0
    for _ in range(10):
        for p in params:
            p.grad = None
        loss = model(tokens, targets)
        losses.append(loss.item())
        (loss * scale).backward()
        grads = [p.grad.float() / scale for p in params]
        if not all(torch.isfinite(g).all() for g in grads):
            skipped, scale = skipped + 1, scale / 2
            continue
        for m, g in zip(master, grads):
            m.grad = g
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    assert skipped == 0, f"{name}: {skipped} of 10 steps overflowed"
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.5, losses


def _saved_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    """What forward keeps for backward (saved-tensor hooks, each storage once, parameters left out)."""
    torch.manual_seed(0)
    model = build(shape, 0, "cpu", dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    tokens, targets = synthetic_batch(shape, 2, torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, targets)
    return sum(kept.values())


@pytest.mark.parametrize("name", ["llama", "qk-norm", "four-norm", "gpt"])
def test_the_estimator_prices_the_fp32_norms_at_16_bits(name):
    """RMSNorm in fp32 keeps a 4-byte copy of its input for backward: at 16 bits the estimator's error on one layer
    is its fp32 error at half the bytes, so whatever else it misses, the norms' upcast is counted exactly."""
    shape = SHAPES[name]
    error = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        config = Config(0, 2, 0, precision)
        one, two = replace(shape, layers=1), replace(shape, layers=2)
        measured = _saved_bytes(two, dtype) - _saved_bytes(one, dtype)
        predicted = _activation_bytes(config, Workload(two, 1)) - _activation_bytes(config, Workload(one, 1))
        error[precision] = (predicted - measured, measured)
    (err16, layer16), (err32, _) = error["bf16"], error["fp32"]
    assert abs(err16 - err32 / 2) <= 0.005 * layer16, error  # the norms' fp32 rsqrt of each row beside
