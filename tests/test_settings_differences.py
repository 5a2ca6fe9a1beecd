"""A resume refused for other settings names what differs, key by key, as a person reads it
(autotune/values/settings.differences)."""

from __future__ import annotations

from dataclasses import replace

from autotune.search_spaces import load_choices
from autotune.values.hardware import PROFILES
from autotune.values.settings import RunSettings
from autotune.values.workload import make_workload


def _settings() -> RunSettings:
    return RunSettings(make_workload("tiny", global_batch=8), PROFILES["cpu"], 2**30, "grid", "simulated", 0,
                       load_choices("cpu"))


def test_a_space_names_only_the_knobs_that_differ_and_says_when_only_the_order_does():
    settings = _settings()
    choices = settings.choices
    other = replace(settings, choices=replace(choices, micro_batch=(1, 2), precision=tuple(reversed(choices.precision))))
    assert settings.differences(other) == [
        f"space.micro_batch: recorded {list(choices.micro_batch)}, given [1, 2]",
        f"space.precision: recorded {list(choices.precision)}, given {list(reversed(choices.precision))} "
        "(the same values in another order)"]


def test_another_model_or_hardware_is_named_by_its_name_alone():
    settings = _settings()
    other = replace(settings, workload=make_workload("gpt2-small", global_batch=8), hardware=PROFILES["a100-80gb"])
    assert settings.differences(other) == ["workload.model: recorded 'tiny', given 'gpt2-small'",
                                           "hardware: recorded 'cpu', given 'a100-80gb'"]
