import json

import pytest

from autotune.values.config import Config, ConfigError
from autotune.values.units import counted, format_size, parse_size


def test_config_round_trips_through_the_contract_json():
    text = '{"zero_stage": 2, "micro_batch": 4, "ckpt_interval": 1, "precision": "bf16", "offload_optimizer": "none", "offload_param": "none"}'
    config = Config.from_json(text)
    assert json.loads(config.to_json()) == json.loads(text)
    assert Config.from_dict(config.to_dict()) == config
    assert len({config, Config.from_json(text)}) == 1  # hashable, equal by value


@pytest.mark.parametrize("bad, fragment", [
    ({"zero_stage": 4}, "zero_stage=4"),
    ({"micro_batch": 0}, "micro_batch=0"),
    ({"micro_batch": 2.5}, "micro_batch=2.5"),
    ({"ckpt_interval": -1}, "ckpt_interval=-1"),
    ({"precision": "fp8"}, "precision='fp8'"),
    ({"offload_param": "disk"}, "offload_param='disk'"),
    ({"zero_stage": True}, "zero_stage=True"),
])
def test_bad_config_values_are_named(bad, fragment):
    data = {"zero_stage": 1, "micro_batch": 2, "ckpt_interval": 0, "precision": "fp32", **bad}
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        Config.from_dict(data)


def test_unknown_and_missing_keys_are_refused():
    with pytest.raises(ConfigError, match="unknown config key"):
        Config.from_dict({"zero_stage": 1, "micro_batch": 2, "ckpt_interval": 0, "precision": "fp32", "tp": 2})
    with pytest.raises(ConfigError, match="missing"):
        Config.from_dict({"zero_stage": 1})


@pytest.mark.parametrize("text, expected", [
    ("32GiB", 32 * 2**30), ("32GB", 32 * 10**9), ("32000MB", 32 * 10**9), ("1.5TiB", int(1.5 * 2**40)),
    ("512mib", 512 * 2**20), ("40Gib", 40 * 2**30), ("1000", 1000), ("2 GiB", 2 * 2**30),
])
def test_sizes_parse_with_documented_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12XB", "-3GB", "0", "0GiB", "abc"])
def test_bad_sizes_are_refused_naming_the_text(text):
    with pytest.raises(ValueError, match=repr(text).replace("(", r"\(")):
        parse_size(text)


def test_counted():
    assert [counted(n, "trial") for n in (0, 1, 2)] == ["0 trials", "1 trial", "2 trials"]
    assert [counted(n, "process", "processes") for n in (1, 4)] == ["1 process", "4 processes"]


def test_format_size():
    assert format_size(1536 * 2**20) == "1.5 GiB"
    assert format_size(None) == "-"
    # 1000-1023 of a unit in whole units, never '1.02e+03 MiB'
    assert [format_size(n * 2**20) for n in (999, 1020, 1023)] == ["999 MiB", "1020 MiB", "1023 MiB"]
    assert format_size(-1020 * 2**30) == "-1020 GiB" and format_size(5000 * 2**40) == "5000 TiB"
