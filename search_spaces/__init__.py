"""YAML presets of the search space and their loader.

A preset maps each knob to the list of values to try; the first value of a list is that knob's default.
`nvme_path` (optional) is the directory NVMe offload writes to; without it NVMe configs are invalid.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from autotune.values.config import ConfigError
from autotune.files import is_file, load_yaml
from autotune.values.hardware import Hardware, bf16_note
from autotune.values.models import did_you_mean
from autotune.values.space import Choices, Space, parse_choices as parse_choices  # its parser, re-exported
from autotune.values.workload import Workload

PRESET_DIR = Path(__file__).parent
PRESETS = ("default", "cpu")

def preset_path(name: str) -> Path:
    return PRESET_DIR / f"{name}.yaml"


def load_choices(name_or_path: str | Path) -> Choices:
    """Choices from a preset name (`default`, `cpu`) or a YAML file path."""
    text = str(name_or_path)
    path = preset_path(text) if text in PRESETS else Path(text)
    if not is_file(path):
        hint = did_you_mean(text, PRESETS)  # defualt -> default
        what = "is a directory: name a YAML file in it" if path.is_dir() else "no such file"
        raise ConfigError(f"search space {text!r}{hint}: {what}; presets are {list(PRESETS)}")
    data = load_yaml(path, "a search space (YAML: knob -> list of values)")
    return parse_choices(data, str(path))


def default_choices(hardware: Hardware) -> Choices:
    """The space when none is named: `cpu` on CPU hardware, else `default`; on a CPU that emulates bf16
    (Hardware.cpu_bf16) without bf16, whose every trial would run ~30x slower than fp32 (a named space with
    bf16 still runs it)."""
    choices = load_choices("cpu" if hardware.is_cpu else "default")
    if hardware.cpu_bf16 == "emulated" and len(choices.precision) > 1 and "bf16" in choices.precision:
        choices = replace(choices, precision=tuple(p for p in choices.precision if p != "bf16"))
    return choices


def choices_for(name_or_path: str | Path | None, hardware: Hardware) -> Choices:
    """A preset's or YAML file's choices; None: default_choices."""
    return load_choices(name_or_path) if name_or_path else default_choices(hardware)


def space_for(name_or_path: str | Path | None, workload: Workload, hardware: Hardware, *, check: bool = True) -> Space:
    """The space of a preset or YAML file for this workload and hardware (None: default_choices); with `check`,
    ConfigError naming why when it holds no valid config (Space.require_configs). A script sweep passes
    check=False: its global batch is settled by its first trial."""
    space = Space(choices_for(name_or_path, hardware), workload, hardware)
    return space.require_configs() if check else space


def space_note(hardware: Hardware, choices: Choices) -> str | None:
    """One line on what the hardware changed in the space (bf16 on a CPU that emulates it), or None."""
    note = bf16_note(hardware)
    if hardware.cpu_bf16 != "emulated" or note is None:
        return note
    if "bf16" in choices.precision:
        return f"{note}: its trials will run that much slower"
    return f"{note}: left out of the space (name a --space with bf16 to try it)"
