"""Issue 18's script as users most often write it: a small GPT whose blocks call `nn.MultiheadAttention` with a
causal mask and its default `need_weights=True` (so torch materialises every head's s x s attention weights:
an eager attention), `deepspeed.initialize(args=...)`, its config from `--deepspeed_config`
(plain_ds_config.json: micro-batch 1, no accumulation) and `--steps` calls of `engine.step()`. The model's
size is set by flags, so that the attention's s^2 term can be made to matter (`--seq-len 512`).
(tests/scripts/plain_ds_train.py is the same loop with `need_weights=False`: torch then runs SDPA.)

    python tests/scripts/mha_gpt_train.py --deepspeed --deepspeed_config tests/scripts/plain_ds_config.json --steps 30

(with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, or under the `deepspeed` launcher).
"""

import argparse

import deepspeed
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(seq, device=tokens.device))
        for block in self.blocks:
            x = block(x, self.mask[:seq, :seq])
        return self.head(self.ln(x))


def main() -> None:
    parser = argparse.ArgumentParser(description="train a small GPT (nn.MultiheadAttention) with DeepSpeed")
    parser.add_argument("--steps", type=int, default=30, help="engine.step() calls")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq_len, args.dropout)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (micro, args.seq_len + 1)).to(engine.device)
        logits = engine(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    if engine.global_rank == 0:
        print(f"training done: {args.steps} steps, global batch {engine.train_batch_size()}", flush=True)


if __name__ == "__main__":
    main()
