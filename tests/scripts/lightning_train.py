"""A Lightning training script with DeepSpeed ZeRO, as users write it, knowing nothing of ds-autotune: a
LightningModule (small GPT), its own DataLoader of `--batch-size` samples, `Trainer(strategy=DeepSpeedStrategy(
stage=2), accumulate_grad_batches=2, max_steps=...)` (or
`DeepSpeedStrategy(config=--ds-config)`). Its global batch is batch size x 2 x ranks.

Lightning runs its DeepSpeed strategy on CUDA GPUs only (DeepSpeedStrategy.setup_environment refuses any other
accelerator). So that this script runs here, on DeepSpeed's CPU accelerator, `--cpu` uses a subclass that lifts
that one check and hands DeepSpeed a device index (on a GPU, leave `--cpu` out: the stock strategy).

    python tests/scripts/lightning_train.py --cpu --batch-size 4 --steps 10

(with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set).
"""

import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed on DeepSpeed's CPU accelerator: Lightning checks for CUDA, DeepSpeed does not need it."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's CUDA-only check

    def setup_distributed(self) -> None:
        self.set_world_ranks()  # without the check that device indices (None on the CPU) are the local ranks
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)  # DeepSpeed reads the index as its device rank


class GPT(L.LightningModule):
    def __init__(self, vocab: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 32) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), float("-inf")), 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(seq, device=tokens.device))
        mask = self.mask[:seq, :seq].to(x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask)
        return self.head(self.ln(x))

    def training_step(self, batch: tuple[torch.Tensor], index: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.float().reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description="train a small GPT with Lightning and DeepSpeed ZeRO-2")
    parser.add_argument("--batch-size", type=int, default=4, help="the DataLoader's batch size")
    parser.add_argument("--accumulate", type=int, default=2, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--steps", type=int, default=10, help="Trainer(max_steps=...)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--cpu", action="store_true", help="DeepSpeed on its CPU accelerator (see above)")
    parser.add_argument("--ds-config", default=None, help="a DeepSpeed config for the strategy (default: ZeRO-2)")
    args = parser.parse_args()

    L.seed_everything(0)
    data = TensorDataset(torch.randint(0, 256, (512, args.seq_len + 1)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    zero = {"config": args.ds_config} if args.ds_config else {"stage": 2}
    strategy = CPUDeepSpeedStrategy(**zero) if args.cpu else DeepSpeedStrategy(**zero)
    trainer = L.Trainer(accelerator="cpu" if args.cpu else "auto", devices=1, strategy=strategy,
                        precision="bf16-mixed", accumulate_grad_batches=args.accumulate, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(GPT(seq_len=args.seq_len), loader)
    engine = trainer.strategy.deepspeed_engine
    if trainer.is_global_zero:
        print(f"training done: {trainer.global_step} steps, global batch {engine.train_batch_size()}, "
              f"micro-batch {engine.train_micro_batch_size_per_gpu()}, accumulation "
              f"{engine.gradient_accumulation_steps()}, zero stage {engine.zero_optimization_stage()}", flush=True)


if __name__ == "__main__":
    main()
