"""The space of configs: knob choices (from a YAML preset) narrowed to what is valid for one workload
on one kind of hardware. Encodes configs as per-knob indices (Optuna, Gymnasium MultiDiscrete) and as
one flat index into the enumerated valid configs."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Iterator, Sequence

from autotune.files import short
from autotune.values.config import KNOBS, OFFLOADS, PRECISIONS, ZERO_STAGES, Config, ConfigError
from autotune.values.argtypes import whole
from autotune.values.hardware import Hardware
from autotune.values.workload import Workload, divisors


@dataclass(frozen=True)
class Choices:
    """Values to try per knob; the first value of each knob is its default."""

    zero_stage: tuple[int, ...] = ZERO_STAGES
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    ckpt_interval: tuple[int, ...] = (0, 1)
    precision: tuple[str, ...] = ("bf16", "fp32")
    offload_optimizer: tuple[str, ...] = ("none",)
    offload_param: tuple[str, ...] = ("none",)
    nvme_path: str | None = None

    def __post_init__(self) -> None:
        for knob in KNOBS:
            values = knob_values(knob, getattr(self, knob))
            object.__setattr__(self, knob, values)  # a tuple (hashable, as a frozen value is), of ints or strs
            if not values:
                raise ConfigError(f"{knob}: needs at least one value")
            if len(set(values)) != len(values):
                raise ConfigError(f"{knob}: repeated values in {list(values)}")

    def knob_values(self, knob: str) -> tuple:
        return getattr(self, knob)

    def outside(self, config: Config) -> tuple[str, Any, tuple] | None:
        """The first knob of `config` whose value is none of the space's: (knob, value, the values allowed)."""
        for knob in KNOBS:
            if getattr(config, knob) not in self.knob_values(knob):
                return knob, getattr(config, knob), self.knob_values(knob)
        return None

    def default(self) -> dict[str, object]:
        return {knob: getattr(self, knob)[0] for knob in KNOBS}

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {knob: list(getattr(self, knob)) for knob in KNOBS}
        out["nvme_path"] = self.nvme_path
        return out


def invalid_reason(config: Config, workload: Workload, hardware: Hardware, nvme_path: str | None) -> str | None:
    """Why `config` cannot run for this workload on this hardware (ARCHITECTURE.md section 2), or None."""
    if workload.grad_accumulation(config.micro_batch) is None:
        return (f"global batch {workload.global_batch} is not a multiple of micro_batch {config.micro_batch}"
                f" x {workload.gpus} GPU(s)")
    if config.ckpt_interval > workload.model.layers:
        return f"ckpt_interval {config.ckpt_interval} exceeds the model's {workload.model.layers} layers"
    if not hardware.supports(config.precision):
        return f"precision {config.precision} is not supported on {hardware.name}"
    if config.offload_optimizer != "none" and config.zero_stage < 1:
        return "offload_optimizer needs zero_stage >= 1"
    if config.offload_optimizer == "nvme" and config.zero_stage != 3:
        return "NVMe optimizer offload (ZeRO-Infinity) needs zero_stage 3"
    if config.offload_param != "none" and config.zero_stage != 3:
        return "offload_param needs zero_stage 3"
    if "nvme" in (config.offload_optimizer, config.offload_param) and not nvme_path:
        return "NVMe offload needs an nvme_path"
    return None


@dataclass(frozen=True)
class Space:
    choices: Choices
    workload: Workload
    hardware: Hardware
    only: frozenset[Config] | None = field(default=None, compare=False)  # e.g. the configs of a replay surface

    def __post_init__(self) -> None:  # a wrong part would fail later, deep in a sweep, as an AttributeError
        for name, kind, example in (("choices", Choices, "autotune.Choices(zero_stage=(1, 2))"),
                                    ("workload", Workload, "autotune.make_workload('tiny')"),
                                    ("hardware", Hardware, "autotune.load_hardware('cpu')")):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"Space {name} {short(getattr(self, name))}: allowed a {kind.__name__}, e.g. "
                                  f"{example}")

    def invalid_reason(self, config: Config) -> str | None:
        outside = self.choices.outside(config)
        if outside is not None:
            knob, value, allowed = outside
            return f"{knob}={value!r} is not in the space: allowed {list(allowed)}"
        reason = invalid_reason(config, self.workload, self.hardware, self.choices.nvme_path)
        if reason is None and self.only is not None and config not in self.only:
            reason = "not measured in the replay surface"
        return reason

    def is_valid(self, config: Config) -> bool:
        return self.invalid_reason(config) is None

    @cached_property
    def configs(self) -> tuple[Config, ...]:
        """Every valid config, in knob order (stage, micro-batch, interval, precision, offloads)."""
        product = itertools.product(*(self.choices.knob_values(k) for k in KNOBS))
        candidates = (Config(*values) for values in product)
        return tuple(c for c in candidates if self.is_valid(c))

    @cached_property
    def _index(self) -> dict[Config, int]:
        return {config: i for i, config in enumerate(self.configs)}

    def __len__(self) -> int:
        return len(self.configs)

    def __iter__(self) -> Iterator[Config]:
        return iter(self.configs)

    def __contains__(self, config: object) -> bool:
        return config in self._index

    def index(self, config: Config) -> int:
        try:
            return self._index[config]
        except KeyError:
            raise ConfigError(f"{config.to_json()} is not a valid config of this space: "
                              f"{self.invalid_reason(config)}") from None

    def config_at(self, index: int) -> Config:
        if not 0 <= index < len(self.configs):
            raise ConfigError(f"config index {index} out of range 0..{len(self.configs) - 1}")
        return self.configs[index]

    @property
    def knob_sizes(self) -> tuple[int, ...]:
        return tuple(len(self.choices.knob_values(k)) for k in KNOBS)

    def encode(self, config: Config) -> tuple[int, ...]:
        """Per-knob indices into the choices (a MultiDiscrete point)."""
        try:
            return tuple(self.choices.knob_values(k).index(getattr(config, k)) for k in KNOBS)
        except ValueError:
            raise ConfigError(f"{config.to_json()}: {self.invalid_reason(config)}") from None

    def decode(self, indices: Sequence[int]) -> Config:
        """The config at per-knob indices; raises ConfigError if it is not valid here."""
        if len(indices) != len(KNOBS):
            raise ConfigError(f"expected {len(KNOBS)} knob indices, got {len(indices)}")
        values = []
        for knob, i in zip(KNOBS, indices):
            options = self.choices.knob_values(knob)
            if not 0 <= int(i) < len(options):
                raise ConfigError(f"{knob} index {i} out of range 0..{len(options) - 1}")
            values.append(options[int(i)])
        config = Config(*values)
        reason = self.invalid_reason(config)
        if reason:
            raise ConfigError(f"{config.to_json()} is not valid: {reason}")
        return config

    def sample(self, rng: random.Random) -> Config:
        if not self.configs:
            raise ConfigError("the space has no valid config for this workload")
        return self.configs[rng.randrange(len(self.configs))]

    def default(self) -> Config:
        """The first valid config when knobs are taken at their defaults as far as possible."""
        defaults = self.choices.default()
        for config in sorted(self.configs, key=lambda c: sum(getattr(c, k) != defaults[k] for k in KNOBS)):
            return config
        raise ConfigError("the space has no valid config for this workload")

    def empty_reason(self) -> str | None:
        """Why the space holds no valid config, as one clause naming the knob and the value at fault (None: it
        holds some). The knob no value of which can run is named first; else the reason most configs fail."""
        if self.configs:
            return None
        workload, choices = self.workload, self.choices
        batch, gpus = workload.global_batch, workload.gpus
        micro = choices.micro_batch
        if not any(workload.grad_accumulation(m) for m in micro):
            listed = ", ".join(map(str, micro))
            if batch % gpus:
                return (f"global batch {batch} does not divide over {gpus} GPU(s), so no micro-batch of the space "
                        f"({listed}) divides {batch} / {gpus}: allowed a global batch that is a multiple of "
                        f"micro-batch x {gpus} (e.g. {', '.join(str(m * gpus) for m in micro[:3])})")
            per_gpu = batch // gpus
            fits = divisors(per_gpu)
            return (f"no micro-batch of the space ({listed}) divides the {per_gpu} sample(s) per GPU of global batch "
                    f"{batch} over {gpus} GPU(s): allowed micro-batches {', '.join(map(str, fits[:8]))}"
                    f"{', ...' if len(fits) > 8 else ''}")
        if not any(self.hardware.supports(p) for p in choices.precision):
            runs = ", ".join(p for p in PRECISIONS if self.hardware.supports(p))
            return (f"precision {', '.join(choices.precision)} is not supported on {self.hardware.name} (the space's "
                    f"only precision{'s' if len(choices.precision) > 1 else ''}): allowed {runs}")
        if all(k > workload.model.layers for k in choices.ckpt_interval):
            return (f"ckpt_interval {', '.join(map(str, choices.ckpt_interval))} exceeds the model's "
                    f"{workload.model.layers} layers: allowed 0 to {workload.model.layers}")
        reasons = Counter(self.invalid_reason(Config(*values))
                          for values in itertools.product(*(choices.knob_values(k) for k in KNOBS)))
        return str(reasons.most_common(1)[0][0])

    def require_configs(self) -> "Space":
        """The space itself; ConfigError naming why when it holds no valid config (an unsatisfiable request is
        refused before anything runs, not answered with 0 configs)."""
        reason = self.empty_reason()
        if reason is not None:
            raise ConfigError(f"the space holds no valid config for {self.workload.model.name} on "
                              f"{self.workload.gpus} x {self.hardware.name}: {reason}")
        return self

    def restrict(self, configs: Iterable[Config]) -> "Space":
        return Space(self.choices, self.workload, self.hardware, frozenset(configs))


ALLOWED = {"zero_stage": list(ZERO_STAGES), "precision": list(PRECISIONS),
           "offload_optimizer": list(OFFLOADS), "offload_param": list(OFFLOADS)}


_ALLOWED: dict[str, tuple[str, Any]] = {
    "zero_stage": ("one of " + ", ".join(map(str, ZERO_STAGES)), lambda v: v in ZERO_STAGES),
    "micro_batch": ("positive integers", lambda v: v >= 1),
    "ckpt_interval": ("integers >= 0 (0 turns checkpointing off)", lambda v: v >= 0),
    "precision": ("one of " + ", ".join(PRECISIONS), lambda v: v in PRECISIONS),
    "offload_optimizer": ("one of " + ", ".join(OFFLOADS), lambda v: v in OFFLOADS),
    "offload_param": ("one of " + ", ".join(OFFLOADS), lambda v: v in OFFLOADS),
}
_INT_KNOBS = {"zero_stage", "micro_batch", "ckpt_interval"}
_EXAMPLE = {knob: list(getattr(Choices, knob)) for knob in KNOBS}  # the defaults, as an example


def knob_value(knob: str, value: Any) -> Any:
    """One value of `knob` as a Config takes it (a whole number of any integer type as an int: numpy's np.int64);
    None where it is not one of the values the knob allows."""
    if knob in _INT_KNOBS:
        value = whole(value)
    elif not isinstance(value, str):
        value = None
    return value if value is not None and _ALLOWED[knob][1](value) else None


def knob_values(knob: str, raw: Any) -> tuple:
    """A knob's values given to Choices (a list or tuple; a str is no list of values: '12' would be 1 and 2), as a
    tuple; else one line naming the knob, the bad value and what is allowed."""
    allowed = _ALLOWED[knob][0]
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise ConfigError(f"Choices {knob} {short(raw)}: allowed a list of {allowed}, e.g. {knob}={_EXAMPLE[knob]}")
    values = tuple(knob_value(knob, value) for value in raw)
    for value, checked in zip(raw, values):
        if checked is None:
            raise ConfigError(f"Choices {knob}: bad value {short(value)}: allowed {allowed}")
    return values


def parse_choices(data: Any, source: str = "<space>") -> Choices:
    """Choices from a mapping of knob -> list of values (a search-space YAML's, a run.json's `space`); ConfigError naming
    `source` and the first value not allowed."""
    if not isinstance(data, dict):
        got = "empty" if data is None else f"got {type(data).__name__}"
        raise ConfigError(f"{source}: {got}: expected a mapping of knob -> list of values")
    unknown = set(data) - set(KNOBS) - {"nvme_path"}
    if unknown:
        key = sorted(unknown, key=str)[0]
        raise ConfigError(f"{source}: unknown knob {key!r}: allowed {', '.join(KNOBS)}, nvme_path")
    values: dict[str, Any] = {}
    for knob, raw in data.items():
        if knob == "nvme_path":
            if raw is not None and not isinstance(raw, str):
                raise ConfigError(f"{source}: nvme_path: {short(raw)} must be a directory path or null")
            values[knob] = raw
            continue
        allowed = _ALLOWED[knob][0]
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{source}: {knob}: {short(raw)} must be a non-empty list of {allowed}")
        for value in raw:
            if knob_value(knob, value) is None:
                raise ConfigError(f"{source}: {knob}: bad value {short(value)}: allowed {allowed}")
        values[knob] = tuple(raw)
    try:
        return Choices(**values)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
