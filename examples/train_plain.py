"""A plain DeepSpeed training loop: a small transformer language model on synthetic tokens.

    deepspeed --num_gpus 1 examples/train_plain.py --deepspeed_config examples/ds_config.json --steps 20

(or `python examples/train_plain.py ...` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set).
The optimizer and scheduler come from the config file; the batch is built with the engine's micro-batch.
It knows nothing of ds-autotune: `autotune tune --script examples/train_plain.py --script-args
"--deepspeed_config examples/ds_config.json"` tunes it as it is.
"""

import argparse

import deepspeed
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.zeros(seq_len, hidden))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = self.causal[: tokens.shape[1], : tokens.shape[1]].to(x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.hidden, args.layers, heads=4, seq_len=args.seq_len)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro = engine.train_micro_batch_size_per_gpu()
    generator = torch.Generator().manual_seed(engine.global_rank)
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = torch.randint(0, args.vocab, (micro, args.seq_len + 1), generator=generator).to(engine.device)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    if engine.global_rank == 0:
        print("training done", flush=True)
    # As PyTorch asks at the end of training: a gloo process group left to the interpreter's exit can abort it
    # ("terminate called without an active exception", pytorch/pytorch#190489).
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
