"""The estimator over a whole space: which configs are predicted to fit a budget, fastest first, and which
term breaks the budget for the others (`autotune estimate`); and the library's one-config prediction
(`autotune.predict`). Both check what they are given: a wrong argument is one ConfigError naming it and what is
allowed, not an AttributeError from deep inside the arithmetic."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from autotune.files import short
from autotune.prediction.estimate import Calibration, Estimate, estimate
from autotune.values.argtypes import given_path, whole
from autotune.values.config import Config, ConfigError
from autotune.values.hardware import Hardware, load_hardware
from autotune.values.space import Choices, Space, invalid_reason
from autotune.values.units import parse_size
from autotune.values.workload import Workload


@dataclass(frozen=True)
class Ranking:
    """What `autotune estimate` prints: the space's configs predicted, ranked against a budget."""

    space: Space
    budget_bytes: int
    fits: tuple[Estimate, ...]  # fastest first
    too_big: tuple[Estimate, ...]  # smallest peak first

    def groups(self) -> list[tuple[str, list[Estimate]]]:
        """Non-fitting configs by the term that dominates their peak, biggest group first."""
        by_term: dict[str, list[Estimate]] = {}
        for est in self.too_big:
            by_term.setdefault(est.memory.dominant, []).append(est)
        return sorted(by_term.items(), key=lambda item: -len(item[1]))


def rank_configs(space: Space, budget_bytes: int | float | str,
                 calibration: Calibration = Calibration()) -> Ranking:
    """Every config of `space` predicted: those that fit `budget_bytes` (a positive number of bytes, or a size such
    as '40GiB') fastest first, the others by peak."""
    if not isinstance(space, Space):
        instead = (" (Choices are the knobs' values: a Space adds the workload and hardware)"
                   if isinstance(space, Choices) else "")
        raise ConfigError(f"space {short(space)}: allowed a Space, e.g. autotune.Space(choices, workload, "
                          f"hardware){instead}")
    budget = budget_of(budget_bytes)
    calibration = _calibration(calibration)
    estimates = [estimate(config, space.workload, space.hardware, calibration) for config in space]
    fits = sorted((e for e in estimates if e.fits(budget)), key=lambda e: -e.throughput_samples_per_s)
    too_big = sorted((e for e in estimates if not e.fits(budget)), key=lambda e: e.peak_bytes)
    return Ranking(space, budget, tuple(fits), tuple(too_big))


def predict(config: Config | Mapping[str, Any], workload: Workload, hardware: Hardware | str,
            calibration: Calibration = Calibration()) -> Estimate:
    """One config's memory and step time (`autotune.predict`): `config` a Config or a mapping of its knobs,
    `hardware` a Hardware or a profile's name or YAML file (autotune.load_hardware)."""
    if isinstance(config, Mapping):
        config = Config.from_dict(dict(config))
    if not isinstance(config, Config):
        raise ConfigError(f"config {short(config)}: allowed a Config, e.g. autotune.Config(zero_stage=2, "
                          "micro_batch=4, ckpt_interval=0, precision='bf16'), or a dict of its knobs")
    if not isinstance(workload, Workload):
        raise ConfigError(f"workload {short(workload)}: allowed a Workload, e.g. autotune.make_workload('llama-7b', "
                          "global_batch=256, gpus=8)")
    hardware = hardware_of(hardware)
    # A config that cannot run has no figures to give (no nvme_path is needed to price NVMe offload)
    reason = invalid_reason(config, workload, hardware, nvme_path="any")
    if reason is not None:
        raise ConfigError(f"config {config.label()}: {reason}")
    return estimate(config, workload, hardware, _calibration(calibration))


def hardware_of(hardware: Any) -> Hardware:
    """A Hardware, or the profile a name or YAML file names (`~` expanded); else ConfigError."""
    if isinstance(hardware, Hardware):
        return hardware
    allowed = "a Hardware (autotune.load_hardware), a profile's name (e.g. cpu, a100-80gb) or a YAML file of profile keys"
    return load_hardware(str(given_path(hardware, "hardware", allowed)))


def budget_of(budget: Any) -> int:
    """A memory budget given to the library: a positive number of bytes, or a size such as '40GiB' (parse_size:
    NaN, infinity and sizes past its maximum refused)."""
    allowed = "a positive number of bytes, or a size such as 40GiB or 2GB"
    number: int | float | None = whole(budget)  # any integer type (numpy's np.int64) as an int, exact
    if number is None and isinstance(budget, numbers.Real) and not isinstance(budget, bool):
        number = float(budget)  # numpy's float32 as a float
    if number is None and not isinstance(budget, str):
        raise ConfigError(f"budget_bytes {short(budget)}: allowed {allowed}")
    try:
        return parse_size(budget if number is None else number)
    except ValueError as err:
        raise ConfigError(f"budget_bytes: {err} (allowed {allowed})") from None


def _calibration(calibration: Any) -> Calibration:
    if not isinstance(calibration, Calibration):
        raise ConfigError(f"calibration {short(calibration)}: allowed a Calibration (autotune.Calibration(); "
                          "a run directory's calibration.json, autotune.prediction.calibrate)")
    return calibration
