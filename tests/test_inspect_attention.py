"""The model as it really runs: ModelShape's attention, the estimator's attention term, and what script mode's
model inspection (autotune.script.inspect_model) reads off tiny real nn.Modules."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import estimate
from autotune.values.hardware import PROFILES
from autotune.script.inspect_model import model_info, shape_from_info, watch_attention
from autotune.values.shapes import PRESETS, ModelShape, with_seq_len
from autotune.values.workload import Workload

TINY = PRESETS["tiny"]


# -- ModelShape.attention -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["math_kernel", "", 3, None])
def test_an_unknown_attention_is_one_line_naming_it_and_the_allowed_ones(bad):
    with pytest.raises(ConfigError) as err:
        replace(TINY, attention=bad)
    assert str(err.value) == f"model attention={bad!r}: allowed ['sdpa', 'eager', 'flash', 'math']"


def test_attention_dropout_must_be_a_bool():
    with pytest.raises(ConfigError, match="model attention_dropout=1: must be true or false"):
        replace(TINY, attention_dropout=1)


def test_the_default_attention_leaves_every_old_dict_as_it_was_and_others_round_trip():
    for shape in PRESETS.values():
        assert "attention" not in shape.to_dict() and "attention_dropout" not in shape.to_dict()
        assert ModelShape(**shape.to_dict()) == shape
    for attention in ("eager", "flash", "math"):
        shape = replace(TINY, attention=attention, attention_dropout=True)
        data = shape.to_dict()
        assert data["attention"] == attention and data["attention_dropout"] is True
        assert ModelShape(**data) == shape


# -- the estimator's attention term ---------------------------------------------------------------------

def activations(shape: ModelShape, micro: int, precision: str = "bf16", ckpt: int = 0) -> int:
    config = Config(0, micro, ckpt, precision, "none", "none")
    return estimate(config, Workload(shape, 8, 1), PROFILES["cpu"]).memory.activations


@pytest.mark.parametrize("precision,p", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("micro", [1, 4])
def test_eager_attention_keeps_every_heads_s_by_s_softmax_per_layer(precision, p, micro):
    b, a, s, layers = micro, TINY.heads, TINY.seq_len, TINY.layers
    fused = activations(TINY, micro, precision)
    eager = activations(replace(TINY, attention="eager"), micro, precision)
    # each layer: the softmax output (p bytes a score) instead of SDPA's fp32 logsumexp per query and head
    assert eager - fused == layers * (b * a * s * s * p - b * a * s * 4)
    dropout = activations(replace(TINY, attention="eager", attention_dropout=True), micro, precision)
    assert dropout - eager == layers * b * a * s * s * (1 + p)  # its 1-byte mask and its output
    assert activations(replace(TINY, attention="flash"), micro, precision) == fused
    assert activations(replace(TINY, attention="sdpa", attention_dropout=True), micro, precision) == fused


def test_korthikanti_5as_over_h_in_16_bit_with_dropout():
    shape = replace(TINY, attention="eager", attention_dropout=True)
    b, a, s = 2, TINY.heads, TINY.seq_len
    assert activations(shape, 2) - activations(TINY, 2) == TINY.layers * (5 * b * a * s * s - 4 * b * a * s)


def test_math_kernel_attention_is_fp32_whatever_the_precision():
    b, a, s, layers = 2, TINY.heads, TINY.seq_len, TINY.layers
    for dropout, per_score in ((False, 4), (True, 12)):
        shape = replace(TINY, attention="math", attention_dropout=dropout)
        assert activations(shape, 2, "bf16") - activations(TINY, 2, "bf16") == layers * (
            b * a * s * s * per_score - b * a * s * 4)


def test_a_checkpointed_eager_model_pays_the_term_only_inside_the_recomputed_segment():
    # a long sequence, so that recomputing a segment (not the LM head) is the activation peak
    shape = with_seq_len(replace(TINY, vocab=512), 2048)
    eager = replace(shape, attention="eager")
    b, a, s = 1, shape.heads, shape.seq_len
    term = b * a * s * s * 2 - b * a * s * 4
    for ckpt in (1, 2):
        assert activations(eager, 1, ckpt=ckpt) - activations(shape, 1, ckpt=ckpt) == ckpt * term
    assert activations(eager, 1) - activations(shape, 1) == shape.layers * term


# -- inspection of real modules -------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, need_weights: bool | None, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        if self.need_weights is None:  # the default: need_weights=True
            x = x + self.attn(x, x, x, attn_mask=mask)[0]
        else:
            x = x + self.attn(x, x, x, attn_mask=mask, need_weights=self.need_weights)[0]
        return x + self.mlp(x)


class MhaLM(nn.Module):
    def __init__(self, need_weights: bool | None = None, dropout: float = 0.0, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(Block(need_weights, dropout) for _ in range(2))
        self.head = nn.Linear(32, 64, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ManualAttention(nn.Module):
    """Attention written by hand: scores, softmax, weighted sum (or one SDPA call)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.qkv, self.fused = nn.Linear(16, 48), fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.fused:
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1) @ v


def first_forward(model: nn.Module, batch: torch.Tensor) -> dict:
    info, seen = model_info(model), []
    watch_attention(model, info, lambda: seen.append(dict(info)))
    model(batch)
    model(batch)  # only the first forward is watched
    assert len(seen) == 1
    return info


def test_multihead_attention_is_eager_until_a_forward_shows_need_weights_false():
    tokens = torch.randint(0, 64, (2, 16))
    info = model_info(MhaLM())
    assert (info["attention"], info["attention_source"]) == ("eager", "nn.MultiheadAttention")
    assert first_forward(MhaLM(), tokens)["attention"] == "eager"  # need_weights defaults to True
    seen = first_forward(MhaLM(need_weights=False), tokens)
    assert (seen["attention"], seen["attention_source"], seen["attention_calls"]) == ("sdpa", "first forward", {"sdpa": 2})
    dropped = first_forward(MhaLM(need_weights=True, dropout=0.1), tokens)
    assert dropped["attention"] == "eager" and dropped["attention_dropout"] is True
    # need_weights=False with dropout on the CPU: torch's SDPA has no fused CPU kernel with dropout
    assert first_forward(MhaLM(need_weights=False, dropout=0.1), tokens)["attention"] == "math"


def test_hand_written_attention_is_told_by_its_softmax_or_its_sdpa_call():
    x = torch.randn(2, 12, 16)
    assert first_forward(ManualAttention(fused=False), x)["attention"] == "eager"
    assert first_forward(ManualAttention(fused=True), x)["attention"] == "sdpa"
    assert "attention" not in first_forward(nn.Sequential(nn.Linear(16, 16), nn.Softmax(-1)), x)  # no s x s


def test_a_hugging_face_style_config_names_attention_experts_and_dropout():
    class HfLike(nn.Module):
        def __init__(self, **config) -> None:
            super().__init__()
            self.config = SimpleNamespace(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                          vocab_size=64, **config)
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    assert model_info(HfLike(_attn_implementation="eager"))["attention"] == "eager"
    assert model_info(HfLike(_attn_implementation="flash_attention_2"))["attention"] == "flash"
    info = model_info(HfLike(attn_implementation="sdpa", attention_dropout=0.1))
    assert (info["attention"], info["attention_source"], info["attention_dropout"]) == ("sdpa", "config", True)
    moe = model_info(HfLike(num_local_experts=8, num_experts_per_tok=2))
    assert (moe["experts"], moe["experts_per_token"], "attention" in moe) == (8, 2, False)
    shape = shape_from_info({**moe, "params": 10**7}, 16, "moe")
    assert (shape.experts, shape.experts_per_token) == (8, 2)
    assert abs(shape.params - 10**7) < shape.layers * (2 * shape.hidden + 1) * shape.experts  # one MLP column


def test_tied_embeddings_dtype_and_the_shape_they_give():
    untied, tied = model_info(MhaLM()), model_info(MhaLM(tied=True).to(torch.bfloat16))
    assert (untied["tied_embeddings"], untied["dtype"]) == (False, "float32")
    assert (tied["tied_embeddings"], tied["dtype"]) == (True, "bfloat16")
    assert tied["params"] == untied["params"] - 64 * 32  # the shared weight counts once
    for info in (untied, tied):
        shape = shape_from_info(info, 16, "mha")
        assert shape.tied_embeddings is info["tied_embeddings"] and shape.attention == "eager"
        assert abs(shape.params - info["params"]) < shape.layers * (2 * shape.hidden + 1)


def test_hugging_face_gpt2_attention_as_it_runs():
    transformers = pytest.importorskip("transformers")
    for impl, dropout, want in (("eager", 0.0, "eager"), ("sdpa", 0.0, "sdpa"), ("sdpa", 0.1, "math")):
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                         attn_pdrop=dropout, bos_token_id=0, eos_token_id=0, attn_implementation=impl)
        model = transformers.GPT2LMHeadModel(config).train()
        assert model_info(model)["attention"] == impl
        info = first_forward(model, torch.randint(0, 64, (1, 16)))
        assert info["attention"] == want and info["tied_embeddings"] is True
        shape = shape_from_info(info, 16, "gpt2")
        assert (shape.ffn_hidden, shape.attention) == (4 * 32, want)  # GPT-2's shape, exactly
