"""A DeepSpeed loop that builds its config as a dict in code and its own torch optimizer: a small MLP
regression on synthetic data (no token ids, no embedding).

    deepspeed --num_gpus 1 examples/train_dict.py --steps 20 [--config-json best_ds_config.json]

`--config-json` replaces the dict written here (e.g. with a tuned config); without it the script uses its own.
"""

import argparse
import json

import deepspeed
import torch
from torch import nn

CONFIG = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 32,
    "gradient_clipping": 0.5,
    "zero_allow_untested_optimizer": True,  # a torch optimizer under ZeRO
    "bf16": {"enabled": False},
    "zero_optimization": {"stage": 1},
    "steps_per_print": 1000,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--config-json", default=None, help="a DeepSpeed config file instead of the built-in dict")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    config = json.load(open(args.config_json)) if args.config_json else CONFIG

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.depth)]
    model = nn.Sequential(nn.Linear(16, args.width), nn.Sequential(*blocks), nn.Linear(args.width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    generator = torch.Generator().manual_seed(engine.global_rank)
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(micro, 16, generator=generator)
            y = x.sum(dim=1, keepdim=True)
            loss = nn.functional.mse_loss(engine(x.to(engine.device, dtype)).float(), y.to(engine.device))
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
