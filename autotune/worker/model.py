"""The built-in decoder-only transformer trained by a trial: plain PyTorch, random init, no downloads.

It follows `autotune.values.workload.ModelShape` exactly (so `ModelShape.params` counts its parameters) and is
written the way the estimator's memory formulas assume: fused attention (`scaled_dot_product_attention`,
no materialised s x s scores), no dropout, and with `ckpt_interval = k` the layers run in checkpointed
segments of k layers (only segment inputs are kept; backward recomputes one segment at a time).

It builds the dense shapes `autotune.values.models` reads from Hugging Face configs, up to what changes neither the
parameter count nor the memory (GPT-NeoX's and Phi-2's partial rotary is applied to whole heads, Gemma's
GeGLU is SwiGLU): head_dim, tied or untied embeddings, learned or rotary positions, q/k/v biases, a biased LM
head, one norm per layer (parallel attention and MLP) or Gemma 2's four, q/k norms (Qwen3, Gemma 3). A
mixture-of-experts shape and multi-head latent attention (DeepSeek) are refused (`unsupported_reason`): their
router and experts, and the latent projections, are not built here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from autotune.values.shapes import untrained_reason
from autotune.values.workload import ModelShape


# What a trial's record says it trained (`model_revision`): 2 computes RMSNorm in fp32 (issue 40); records without
# it (1) come from the model whose RMSNorm ran in the training dtype (autotune.prediction.estimate.norm_upcast_bytes).
MODEL_REVISION = 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:  # as LayerNorm's: what `build` calls once the weight is allocated
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the training dtype, as Hugging Face's LlamaRMSNorm: in fp16 the backward of rsqrt of a
        # small mean square (block 0's input is the raw embedding, std 0.02) exceeds 65504, so every fp16 step
        # overflowed. Backward keeps the fp32 copy of x instead of x (autotune.prediction.estimate prices it).
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def unsupported_reason(shape: ModelShape) -> str | None:
    """Why the built-in model cannot be this shape (autotune.values.shapes.untrained_reason), or None when it can."""
    reason = untrained_reason(shape)
    if reason is None:
        return None
    return (f"model {shape.name}: {reason} is not built by the built-in trial model; estimate it, or tune your own "
            "script (--script)")


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.heads, self.kv_heads = shape.heads, shape.kv_heads
        self.head_dim = shape.head_dim
        # ModelShape's __post_init__ resolved a None qkv_bias to the architecture's default: a bool here.
        self.qkv = nn.Linear(shape.hidden, shape.q_dim + 2 * shape.kv_dim, bias=bool(shape.qkv_bias))
        self.out = nn.Linear(shape.q_dim, shape.hidden, bias=shape.arch == "gpt")
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if shape.qk_norm:  # Qwen3, Gemma 3: each query and key head normed before rotary
            norm = nn.LayerNorm if shape.arch == "gpt" else RMSNorm
            self.q_norm, self.k_norm = norm(shape.head_dim), norm(shape.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = _rotary(q, *rope), _rotary(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gated = shape.arch == "llama"
        bias = not self.gated
        self.up = nn.Linear(shape.hidden, shape.ffn_hidden * (2 if self.gated else 1), bias=bias)
        self.down = nn.Linear(shape.ffn_hidden, shape.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        norm = nn.LayerNorm if shape.arch == "gpt" else RMSNorm
        self.norms = shape.norms_per_layer
        self.norm1, self.attn = norm(shape.hidden), Attention(shape)
        if self.norms >= 2:
            self.norm2 = norm(shape.hidden)
        self.mlp = MLP(shape)
        if self.norms == 4:  # Gemma 2: the attention's and the MLP's outputs are normed too
            self.post_attn_norm, self.post_mlp_norm = norm(shape.hidden), norm(shape.hidden)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.norms == 1:  # parallel attention and MLP on one norm (Phi-2)
            y = self.norm1(x)
            return x + self.attn(y, rope) + self.mlp(y)
        if self.norms == 4:
            x = x + self.post_attn_norm(self.attn(self.norm1(x), rope))
            return x + self.post_mlp_norm(self.mlp(self.norm2(x)))
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """`forward(tokens, targets)` returns the mean next-token cross-entropy (computed in fp32)."""

    def __init__(self, shape: ModelShape, ckpt_interval: int = 0) -> None:
        super().__init__()
        if not 0 <= ckpt_interval <= shape.layers:
            raise ValueError(f"ckpt_interval={ckpt_interval}: allowed 0..{shape.layers}")
        reason = unsupported_reason(shape)
        if reason:
            raise ValueError(reason)
        self.shape, self.ckpt_interval = shape, ckpt_interval
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.pos = nn.Embedding(shape.max_positions, shape.hidden) if shape.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.hidden) if shape.arch == "gpt" else RMSNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=shape.lm_head_bias)
        self.apply(self._init)
        if shape.tied_embeddings:
            # Tied as Hugging Face's GPT-2 ties them: one Parameter in two modules, which ZeRO-3 gathers
            # through the head module's own hooks.
            self.head.weight = self.embed.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.shape.positions != "rotary":
            return None
        dim = self.shape.head_dim
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
        angles = torch.outer(torch.arange(x.shape[1], device=x.device, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def _segment(self, start: int, stop: int):
        def run(x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
            for block in self.blocks[start:stop]:
                x = block(x, tuple(rope) if rope else None)
            return x
        return run

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        rope = self._rope(x)
        rope_args = rope if rope is not None else ()
        step = self.ckpt_interval or self.shape.layers
        for start in range(0, self.shape.layers, step):
            segment = self._segment(start, min(start + step, self.shape.layers))
            if self.ckpt_interval and self.training:
                # Non-reentrant checkpointing works with ZeRO-3's parameter hooks and keeps only x.
                x = checkpoint(segment, x, *rope_args, use_reentrant=False)
            else:
                x = segment(x, *rope_args)
        x = self.norm(x)
        logits = self.head(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(shape: ModelShape, micro_batch: int, generator: torch.Generator,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their shifted targets: the step's cost does not depend on the data."""
    data = torch.randint(0, shape.vocab, (micro_batch, shape.seq_len + 1), generator=generator)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class _SkipMetaInit(TorchFunctionMode):
    """Skips in-place initializers of meta tensors, which write nothing: torch's meta `normal_` imports
    torch._dynamo on first use (2 s and ~75 MB here), which would land in the build's time and peak."""

    INITIALIZERS = frozenset({"normal_", "uniform_", "zero_", "fill_", "zeros_", "ones_", "constant_", "trunc_normal_",
                              "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_"})

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if getattr(func, "__name__", "") in self.INITIALIZERS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def build(shape: ModelShape, ckpt_interval: int = 0, device: torch.device | str = "cpu",
          dtype: torch.dtype = torch.float32) -> GPT:
    """The model built where it trains, in its training dtype: constructed on the meta device (no memory),
    then each parameter allocated on `device` in `dtype` and initialized there, in module order, by that
    device's generator. No fp32 copy on the host and no cast: a bf16 model holds 2 bytes per parameter from
    the start. Seed the device's generator first (`torch.manual_seed`): the same seed, device and dtype give
    the same weights. The values are not `GPT(shape)`'s (those are fp32 draws of the CPU's generator, after
    Linear's own default init), nor the same across dtypes (bf16 is drawn as bf16, not rounded from fp32)."""
    with torch.device("meta"), _SkipMetaInit():
        model = GPT(shape, ckpt_interval)
    if any(True for _ in model.buffers()):
        raise ValueError("build: the model holds buffers, which it would leave uninitialized")
    # meta parameter id -> (it, kept so that its id is not reused; its allocation)
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in model.modules():
        for name, meta in module._parameters.items():
            if meta is None:
                continue
            if id(meta) not in made:  # a tied parameter (one in two modules) stays one tensor
                kind = dtype if meta.is_floating_point() else meta.dtype
                made[id(meta)] = meta, nn.Parameter(torch.empty(meta.shape, device=device, dtype=kind),
                                                    requires_grad=meta.requires_grad)
            module._parameters[name] = made[id(meta)][1]
    done: set[int] = set()
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            GPT._init(module)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()
        else:
            continue
        done.update(id(p) for p in module.parameters(recurse=False))
    missed = [name for name, p in model.named_parameters() if id(p) not in done]
    if missed:  # torch.empty's contents would train: a module type this function does not know
        raise ValueError(f"build: no initializer for {missed[:3]}")
    return model
