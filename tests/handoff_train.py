"""A user's training script for tests/test_handoff.py: a tiny GPT-2 (built from a config, no download) trained
for two optimizer steps on random tokens with the files `autotune tune` wrote, as report.md says to use them.

    python tests/handoff_train.py deepspeed RUN_DIR      deepspeed.initialize(config=best_ds_config.json)
    python tests/handoff_train.py trainer RUN_DIR        TrainingArguments(**recommended_trainer_args.json)
    python tests/handoff_train.py plugin RUN_DIR         Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))
    accelerate launch --config_file RUN_DIR/best_accelerate_config.yaml tests/handoff_train.py launched RUN_DIR

It prints one line `HANDOFF {json}`: what the DeepSpeed engine ran with, for the test to compare with the files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

STEPS = 2  # optimizer steps
SEQ, VOCAB = 32, 256


def checkpointing_switch(model: GPT2LMHeadModel):
    """The switch the report names: activation_checkpointing_enable from transformers 5.x (gradient_... warns)."""
    return getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, samples: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def facts(engine, model: GPT2LMHeadModel, losses: list[float]) -> dict:
    zero = engine.config["zero_optimization"]
    return {"micro_batch": engine.train_micro_batch_size_per_gpu(), "accumulation": engine.gradient_accumulation_steps(),
            "train_batch_size": engine.train_batch_size(), "zero_stage": engine.zero_optimization_stage(),
            "bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(), "optimizer_steps": engine.global_steps,
            "reduce_bucket_size": zero.get("reduce_bucket_size"), "optimizer": engine.config.get("optimizer"),
            "gradient_clipping": engine.config.get("gradient_clipping"), "lr": engine.get_lr()[0],
            "checkpointing": model.is_gradient_checkpointing, "losses": losses}


def with_deepspeed(run: Path) -> dict:
    import deepspeed

    config = json.loads((run / "best_ds_config.json").read_text())
    model = tiny_model()
    if config["activation_checkpointing"]["number_checkpoints"]:
        checkpointing_switch(model)()  # interval 1: every layer (the stacks' on/off switch)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=str(run / "best_ds_config.json"))
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    loader = torch.utils.data.DataLoader(RandomTokens(micro * accumulation * STEPS), batch_size=micro)
    losses = []
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return facts(engine, model, losses)


def with_trainer(run: Path, out: Path) -> dict:
    from transformers import Trainer, TrainingArguments

    recommended = json.loads((run / "recommended_trainer_args.json").read_text())
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, report_to="none", save_strategy="no",
                             disable_tqdm=True, logging_steps=1, **recommended)
    model = tiny_model()
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(64))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return facts(trainer.model_wrapped, model, losses)


def with_accelerate(run: Path, plugin: bool) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
    from transformers import get_linear_schedule_with_warmup

    hf_config = run / "best_hf_ds_config.json"
    accelerator = (Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(hf_config))) if plugin
                   else Accelerator())  # under accelerate launch: the plugin comes from the config file
    config = json.loads(hf_config.read_text())
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    model = tiny_model()
    if config["activation_checkpointing"]["number_checkpoints"]:
        checkpointing_switch(model)()
    optimizer = DummyOptim(model.parameters(), lr=3e-4, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: get_linear_schedule_with_warmup(opt, 1, 10))
    loader = torch.utils.data.DataLoader(RandomTokens(micro * accumulation * STEPS), batch_size=micro)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return {**facts(model, model.module, losses), "mixed_precision": accelerator.mixed_precision,
            "processes": accelerator.num_processes}


def main() -> None:
    mode, run = sys.argv[1], Path(sys.argv[2])
    if mode == "deepspeed":
        result = with_deepspeed(run)
    elif mode == "trainer":
        result = with_trainer(run, Path(sys.argv[3]))
    elif mode in ("plugin", "launched"):
        result = with_accelerate(run, plugin=mode == "plugin")
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("HANDOFF " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
