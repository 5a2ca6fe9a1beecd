"""The Hugging Face Trainer with DeepSpeed: a small GPT-2 built from a config (no download) on synthetic tokens.

    deepspeed --num_gpus 1 examples/train_hf.py --deepspeed examples/ds_config_hf.json --output_dir /tmp/hf \
        --max_steps 20 --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --bf16 true

Every `TrainingArguments` flag is accepted (HfArgumentParser). The Trainer calls `deepspeed.initialize`
itself, through Accelerate.
"""

from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class ModelArguments:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    vocab: int = 1024
    seq_len: int = 64
    samples: int = 4096


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        self.tokens = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    config = GPT2Config(n_layer=model_args.layers, n_embd=model_args.hidden, n_head=model_args.heads,
                        vocab_size=model_args.vocab, n_positions=model_args.seq_len,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    data = RandomTokens(model_args.samples, model_args.seq_len, model_args.vocab)
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    result = trainer.train()
    if training_args.process_index == 0:
        print(f"training done: {result.global_step} steps, loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
