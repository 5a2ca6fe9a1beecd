import random
from collections import Counter

import pytest

from autotune.values.config import KNOBS, Config, ConfigError
from autotune.values.hardware import PROFILES
from autotune.search_spaces import load_choices, parse_choices, preset_path
from autotune.values.space import Choices, Space
from autotune.values.workload import make_workload


@pytest.fixture(scope="module")
def cpu_space():
    return Space(load_choices("cpu"), make_workload("tiny"), PROFILES["cpu"])


def test_cpu_preset_count_and_rules(cpu_space):
    # 4 micro-batches x 3 intervals x 2 precisions, times offload combinations per stage:
    # stage 0: none/none; stages 1-2: optimizer none|cpu; stage 3: optimizer x param.
    assert len(cpu_space) == 24 * (1 + 2 + 2 + 4) == 216
    for config in cpu_space:
        assert config.precision != "fp16"  # refused on the CPU accelerator
        if config.offload_optimizer != "none":
            assert config.zero_stage >= 1
        if config.offload_param != "none":
            assert config.zero_stage == 3
        assert 16 % config.micro_batch == 0


def test_invalid_reasons_name_the_rule():
    workload = make_workload("tiny", global_batch=12)
    space = Space(load_choices("default"), workload, PROFILES["a100-80gb"])
    reason = space.invalid_reason
    assert "multiple of micro_batch 8" in reason(Config(1, 8, 0, "bf16"))
    assert "exceeds the model's 4 layers" in reason(Config(1, 4, 8, "bf16"))
    assert "offload_optimizer needs zero_stage >= 1" in reason(Config(0, 4, 0, "bf16", "cpu"))
    assert "offload_param needs zero_stage 3" in reason(Config(2, 4, 0, "bf16", "cpu", "cpu"))
    assert "needs an nvme_path" in reason(Config(3, 4, 0, "bf16", "nvme"))
    assert "zero_stage 3" in reason(Config(2, 4, 0, "bf16", "nvme"))
    assert "not supported on v100" in Space(space.choices, workload, PROFILES["v100-32gb"]).invalid_reason(
        Config(1, 4, 0, "bf16"))
    assert "not supported on cpu" in Space(space.choices, workload, PROFILES["cpu"]).invalid_reason(
        Config(1, 4, 0, "fp16"))
    assert reason(Config(3, 4, 2, "bf16", "cpu", "cpu")) is None


def test_nvme_configs_need_a_path():
    workload = make_workload("gpt2-small", global_batch=64)
    without = Space(load_choices("default"), workload, PROFILES["a100-80gb"])
    with_path = Space(Choices(**{**{k: tuple(v) for k, v in without.choices.to_dict().items() if k in KNOBS},
                                 "nvme_path": "/local_nvme"}), workload, PROFILES["a100-80gb"])
    assert not any("nvme" in (c.offload_optimizer, c.offload_param) for c in without)
    nvme = [c for c in with_path if "nvme" in (c.offload_optimizer, c.offload_param)]
    assert nvme and all(c.zero_stage == 3 for c in nvme)


def test_encodings_round_trip(cpu_space):
    for i, config in enumerate(cpu_space):
        assert cpu_space.index(config) == i
        assert cpu_space.config_at(i) == config
        assert cpu_space.decode(cpu_space.encode(config)) == config
    with pytest.raises(ConfigError, match="not valid"):
        cpu_space.decode((0, 0, 0, 0, 1, 0))  # stage 0 with optimizer offload
    with pytest.raises(ConfigError, match="out of range"):
        cpu_space.config_at(len(cpu_space))
    assert cpu_space.knob_sizes == (4, 4, 3, 2, 2, 2)


def test_sample_is_uniform_over_valid_configs(cpu_space):
    rng = random.Random(0)
    counts = Counter(cpu_space.sample(rng) for _ in range(21600))
    assert set(counts) == set(cpu_space.configs)
    assert max(counts.values()) < 3 * min(counts.values())


def test_default_takes_first_values(cpu_space):
    assert cpu_space.default() == Config(0, 1, 0, "bf16", "none", "none")


def test_restrict_to_measured(cpu_space):
    measured = list(cpu_space)[:5]
    narrow = cpu_space.restrict(measured)
    assert list(narrow) == measured
    assert "not measured" in narrow.invalid_reason(list(cpu_space)[10])


def test_default_preset_is_gpu_sized():
    choices = load_choices("default")
    assert max(choices.micro_batch) >= 64
    assert set(choices.precision) == {"fp32", "fp16", "bf16"}
    assert set(choices.offload_optimizer) == set(choices.offload_param) == {"none", "cpu", "nvme"}
    assert len(choices.ckpt_interval) > 2


@pytest.mark.parametrize("text, fragments", [
    ("zero_stage: [0, 1]\ntensor_parallel: [1, 2]\n", ["bad.yaml", "unknown knob 'tensor_parallel'", "zero_stage"]),
    ("precision: [bf16, fp8]\n", ["bad.yaml", "precision", "'fp8'", "fp32, fp16, bf16"]),
    ("micro_batch: [1, two]\n", ["bad.yaml", "micro_batch", "'two'", "positive integers"]),
    ("micro_batch: 4\n", ["bad.yaml", "micro_batch", "4", "list"]),
    ("zero_stage: [0, 5]\n", ["bad.yaml", "zero_stage", "5", "0, 1, 2, 3"]),
    ("offload_param: [none, true]\n", ["bad.yaml", "offload_param", "True", "none, cpu, nvme"]),
    ("- 1\n- 2\n", ["bad.yaml", "mapping"]),
])
def test_bad_yaml_names_file_key_value_and_allowed(tmp_path, text, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_choices(path)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_presets_ship_inside_the_package():
    assert preset_path("cpu").is_file() and preset_path("default").is_file()
    assert parse_choices({"zero_stage": [3]}).zero_stage == (3,)
