"""A hand-written Accelerate training loop with DeepSpeed, as users write it, knowing nothing of ds-autotune:
`Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`, its own DataLoader of `--batch-size`
samples, its own torch optimizer, and the gradient accumulation Accelerate applies (`accelerator.accumulate`).
Its DeepSpeed config (accelerate_loop_config.json) leaves the micro-batch to the DataLoader ("auto") and
accumulates 2 batches, so its global batch is batch size x 2 x ranks.

    python tests/scripts/accelerate_loop_train.py --ds-config tests/scripts/accelerate_loop_config.json \
        --batch-size 4 --steps 20

(with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, or under `accelerate launch`).
"""

import argparse

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
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
    parser = argparse.ArgumentParser(description="train a small GPT with Accelerate and DeepSpeed")
    parser.add_argument("--ds-config", required=True, help="DeepSpeed config for the DeepSpeedPlugin")
    parser.add_argument("--batch-size", type=int, default=4, help="the DataLoader's batch size")
    parser.add_argument("--steps", type=int, default=20, help="batches to train on (micro-steps)")
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.ds_config), mixed_precision="bf16")
    torch.manual_seed(0)
    vocab = 256
    data = TensorDataset(torch.randint(0, vocab, (256, args.seq_len + 1)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = GPT(vocab, hidden=64, layers=2, heads=4, seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step = 0
    while step < args.steps:
        for (tokens,) in loader:
            with accelerator.accumulate(model):
                logits = model(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            step += 1
            if step % 10 == 0:
                accelerator.print(f"step {step}/{args.steps} loss {loss.item():.4f}")
            if step == args.steps:
                break
    engine = accelerator.deepspeed_engine_wrapped.engine
    accelerator.print(f"training done: {args.steps} steps, batches of {tokens.shape[0]}, global batch "
                      f"{engine.train_batch_size()}, accumulation {accelerator.gradient_accumulation_steps}, "
                      f"zero stage {engine.zero_optimization_stage()}")


if __name__ == "__main__":
    main()
