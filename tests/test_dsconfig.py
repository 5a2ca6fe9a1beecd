import pytest

from autotune.values.config import KNOBS, Config, ConfigError
from autotune.outputs.handoff import validate
from autotune.values.dsconfig import RECIPE_AUTO, DsOptions, ds_config, hf_ds_config
from autotune.values.hardware import PROFILES
from autotune.search_spaces import load_choices
from autotune.values.space import Choices, Space
from autotune.values.workload import make_workload


def _with_nvme(choices: Choices) -> Choices:
    return Choices(**{k: getattr(choices, k) for k in KNOBS}, nvme_path="/local_nvme")


SPACES = {
    "cpu/tiny": (Space(load_choices("cpu"), make_workload("tiny"), PROFILES["cpu"]), DsOptions()),
    "default/gpt2-small x4": (Space(_with_nvme(load_choices("default")), make_workload("gpt2-small", 256, 4),
                                    PROFILES["a100-80gb"]), DsOptions(nvme_path="/local_nvme")),
}


@pytest.mark.parametrize("name", SPACES)
def test_deepspeed_parser_accepts_every_valid_config(name):
    space, options = SPACES[name]
    assert len(space) > 100
    for config in space:
        ds = ds_config(config, space.workload, options)
        parsed = validate(ds, space.workload.gpus)
        assert parsed.zero_optimization_stage == config.zero_stage
        assert parsed.train_micro_batch_size_per_gpu == config.micro_batch
        assert parsed.gradient_accumulation_steps * config.micro_batch * space.workload.gpus == ds["train_batch_size"]
        assert parsed.bfloat16_config.enabled == (config.precision == "bf16")
        assert parsed.float16_config.enabled == (config.precision == "fp16")
        if config.precision == "fp16":
            assert parsed.float16_config.loss_scale == 0  # dynamic loss scaling
        zero = parsed.zero_config
        assert (zero.offload_optimizer is not None and zero.offload_optimizer.device != "none") == (
            config.offload_optimizer != "none")
        assert (zero.offload_param is not None and zero.offload_param.device != "none") == (
            config.offload_param != "none")
        if config.offload_optimizer != "none":
            assert zero.offload_optimizer.device == config.offload_optimizer


def test_activation_checkpointing_section_counts_segments():
    workload = make_workload("gpt2-small", 64)
    ds = ds_config(Config(2, 4, 4, "bf16"), workload)
    assert ds["activation_checkpointing"]["number_checkpoints"] == 3
    assert ds_config(Config(2, 4, 0, "bf16"), workload)["activation_checkpointing"]["number_checkpoints"] is None


def test_force_ds_cpu_optimizer_is_written_for_offload_only():
    workload = make_workload("tiny")
    assert ds_config(Config(2, 4, 0, "bf16", "cpu"), workload, DsOptions(force_ds_cpu_optimizer=False))[
        "zero_force_ds_cpu_optimizer"] is False
    assert "zero_force_ds_cpu_optimizer" not in ds_config(Config(2, 4, 0, "bf16"), workload)


def test_invalid_configs_are_refused():
    workload = make_workload("tiny")
    with pytest.raises(ConfigError, match="multiple of micro_batch 32"):
        ds_config(Config(1, 32, 0, "bf16"), workload)
    with pytest.raises(ConfigError, match="nvme_path"):
        ds_config(Config(3, 4, 0, "bf16", "nvme"), workload)


def test_hf_flavour_leaves_only_the_recipe_to_auto_and_keeps_tuned_ones():
    workload = make_workload("gpt2-small", 64, 2)
    config = Config(3, 4, 2, "bf16", "cpu", "cpu")
    hf, ds = hf_ds_config(config, workload), ds_config(config, workload)
    assert hf["train_batch_size"] == 64
    # lr, weight decay and clipping are the recipe's; betas and eps stay concrete (DummyOptim cannot fill them)
    assert hf["optimizer"]["params"] == {"lr": "auto", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": "auto"}
    assert hf["gradient_clipping"] == "auto"
    zero = hf["zero_optimization"]
    assert zero == ds["zero_optimization"]  # the tuned buckets, not the Trainer's hidden^2
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu" and isinstance(zero["reduce_bucket_size"], int)
    assert hf["train_micro_batch_size_per_gpu"] == 4 and hf["gradient_accumulation_steps"] == 8
    assert hf["bf16"]["enabled"] is True

    def autos(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from autos(value, f"{prefix}{key}.")
            elif value == "auto":
                yield prefix + key

    assert sorted(autos(hf)) == sorted(RECIPE_AUTO)
