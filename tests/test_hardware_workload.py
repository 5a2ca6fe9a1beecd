import pytest

from autotune.values.config import ConfigError
from autotune.values.hardware import PROFILES, load_hardware
from autotune.values.workload import PRESETS, ModelShape, Workload, make_workload


@pytest.mark.parametrize("name", ["v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "l4", "cpu"])
def test_required_profiles_exist(name):
    assert load_hardware(name).name == name


def test_cpu_profile_refuses_fp16_and_v100_bf16():
    assert not PROFILES["cpu"].supports("fp16") and PROFILES["cpu"].supports("bf16")
    assert not PROFILES["v100-32gb"].supports("bf16")


def test_user_profile_errors_name_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: a100-80gb\nmemory: 40GiB\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key\(s\) \['memory'\]"):
        load_hardware(str(bad))
    bad.write_text("base: a200\n")
    with pytest.raises(ConfigError, match="base='a200'"):
        load_hardware(str(bad))
    bad.write_text("base: l4\nmemory_bytes: huge\n")
    with pytest.raises(ConfigError, match="memory_bytes: size 'huge'"):
        load_hardware(str(bad))


@pytest.mark.parametrize("name, billions", [("gpt2-small", 0.124), ("gpt2-xl", 1.56), ("llama-7b", 6.74),
                                            ("llama-13b", 13.0), ("llama-70b", 69.0)])
def test_preset_parameter_counts_match_the_published_models(name, billions):
    assert PRESETS[name].params / 1e9 == pytest.approx(billions, rel=0.02)


def test_workload_validation():
    with pytest.raises(ConfigError, match="global_batch=0"):
        Workload(PRESETS["tiny"], 0)
    with pytest.raises(ConfigError, match="not divisible by heads"):
        ModelShape("odd", 2, 100, 3, 10, 10)
    assert make_workload("tiny").grad_accumulation(4) == 4
    assert make_workload("tiny", 16, 2).grad_accumulation(8) == 1
    assert make_workload("tiny", 16, 2).grad_accumulation(16) is None
    with pytest.raises(ConfigError, match="unknown model 'gpt9'"):
        make_workload("gpt9")
