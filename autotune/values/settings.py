"""What defines one sweep, as a value: `RunSettings` (the run directory's `run.json`; a resumed sweep must be
started with the same), validated when it is made, and the defaults every front end shares, decided here once:
the memory budget (`memory_budget`: the hardware's memory per device unless one is chosen) and the training
stacks (`STACKS`). A value module: it imports values only, so that the run directory, the handoff, the
backends and the drivers can all import it without a circle (issue 26)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from autotune.values.config import ConfigError
from autotune.files import short
from autotune.values.argtypes import whole
from autotune.values.hardware import Hardware, hardware_from_dict
from autotune.values.space import Choices, Space, parse_choices
from autotune.values.units import MAX_SIZE, exact_size, format_size
from autotune.values.workload import Workload

SETTINGS = "run.json"  # the file a sweep's settings are written to, in its run directory

# What will train with the recommendation (autotune.outputs.handoff owns what each takes; the names are settings).
STACKS = ("deepspeed", "trainer", "accelerate")
DEFAULT_STACK = "deepspeed"


def check_stack(stack: str) -> str:
    if stack not in STACKS:
        raise ConfigError(f"stack {stack!r}: allowed {', '.join(STACKS)}")
    return stack


def check_budget(value: Any) -> int:
    """A memory budget per device: a positive number of bytes (one-line ConfigError naming the value); a float
    must be finite (NaN and infinity are no number of bytes). Any integer or real type (numpy's too); an int back."""
    number = whole(value)
    if number is None and not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value):
        number = int(float(value))  # numpy's float32 too
    if number is None or not number > 0:
        raise ConfigError(f"memory budget {short(value)}: must be a positive number of bytes")
    if number > MAX_SIZE:  # no device holds it: a typo (the sizes of the command line stop there too)
        raise ConfigError(f"memory budget {short(value)}: too large: allowed 1 B to {format_size(MAX_SIZE)}")
    return number


def memory_budget(chosen: int | None, hardware: Hardware) -> int:
    """The sweep's memory budget per device: the one chosen, else the hardware's memory. The only place this
    default is decided (tests/test_architecture.py holds it)."""
    return hardware.memory_bytes if chosen is None else within_device(check_budget(chosen), hardware)


def within_device(budget: int, hardware: Hardware) -> int:
    """A chosen budget is at most the device's memory: no config could use more, and a recommendation
    "peak 88 GiB of 200 GiB" on an 80 GiB device would not run (one-line ConfigError)."""
    if budget > hardware.memory_bytes:
        device = exact_size(hardware.memory_bytes)
        raise ConfigError(f"memory budget {exact_size(budget)} exceeds {hardware.name}'s {device} per device: allowed "
                          f"up to {device} (the device's memory)")
    return budget


@dataclass(frozen=True)
class RunSettings:
    """What defines a sweep: a resumed sweep must be started with the same settings."""

    workload: Workload
    hardware: Hardware
    memory_budget_bytes: int
    strategy: str
    backend: str
    seed: int
    choices: Choices
    surface: str | None = None
    storage: str | None = None  # the Optuna study's storage (autotune.search.study_storage); None: study.db here
    stack: str = DEFAULT_STACK  # the user's training stack, which the space was narrowed to (autotune.outputs.handoff)
    # The job's device count the trials at workload.gpus predict (autotune.prediction.scale); None: the trials' own.
    target_gpus: int | None = None
    # The folder of the exported policy `rl` and `hybrid` search with (--policy, absolute); None: the shipped one.
    policy: str | None = None
    # Its files' digest (autotune.rl.policy.digest): a policy exported again into the same folder is another policy.
    policy_sha256: str | None = None
    # The replay surface's digest (files.sha256): a surface whose lines changed replays other figures. None: not
    # replayed, or a run.json written before the digest (its resume is not checked).
    surface_sha256: str | None = None

    def __post_init__(self) -> None:
        # Every builder of settings gets the same one-line refusal, naming the value and what is allowed. A whole
        # number of any integer type (numpy's) is kept as an int, as run.json writes it (json refuses np.int64).
        if whole(self.memory_budget_bytes) is None:  # a whole number of bytes, as run.json keeps it
            raise ConfigError(f"memory budget {short(self.memory_budget_bytes)}: must be a positive number of bytes")
        object.__setattr__(self, "memory_budget_bytes", check_budget(self.memory_budget_bytes))
        seed = whole(self.seed)
        if seed is None or not 0 <= seed <= 2**63 - 1:
            raise ConfigError(f"seed {short(self.seed)}: allowed a whole number >= 0")
        object.__setattr__(self, "seed", seed)
        for key in ("strategy", "backend"):  # a user's own strategy or backend object is named, not listed
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(f"{key} {short(getattr(self, key))}: allowed a name")
        check_stack(self.stack)
        target = self.target_gpus if self.target_gpus is None else whole(self.target_gpus)
        if self.target_gpus is not None and (target is None or target < self.workload.gpus):
            raise ConfigError(f"target_gpus {short(self.target_gpus)}: allowed null or a whole number >= the "
                              f"workload's gpus ({self.workload.gpus})")
        object.__setattr__(self, "target_gpus", target)

    def space(self) -> Space:
        return Space(self.choices, self.workload, self.hardware)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload.to_dict(), "hardware": self.hardware.to_dict(),
                "memory_budget_bytes": self.memory_budget_bytes, "strategy": self.strategy,
                "backend": self.backend, "seed": self.seed, "space": self.choices.to_dict(),
                "surface": self.surface, "storage": masked(self.storage), "stack": self.stack,
                "target_gpus": self.target_gpus, "policy": self.policy,
                "policy_sha256": self.policy_sha256, "surface_sha256": self.surface_sha256}

    @classmethod
    def from_dict(cls, data: Any, source: str = SETTINGS) -> "RunSettings":
        """The settings `to_dict` wrote; ConfigError naming `source` and the first key that is not allowed."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of run settings, got {short(data)}")
        missing = [k for k in ("workload", "hardware", "memory_budget_bytes", "strategy", "backend", "seed", "space")
                   if k not in data]
        if missing:
            raise ConfigError(f"{source}: missing key(s) {', '.join(missing)}: not the run.json of a sweep")
        try:
            workload = Workload.from_dict(data["workload"])
        except ConfigError as err:
            raise ConfigError(f"{source}: workload: {err}") from None
        hardware = hardware_from_dict(data["hardware"], f"{source}: hardware")
        for key, low in (("memory_budget_bytes", 1), ("seed", 0)):
            value = data[key]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 2**63 - 1:
                raise ConfigError(f"{source}: {key}: {short(value)}: allowed a whole number >= {low}")
        for key in ("strategy", "backend"):  # either may be a user's own object's name: not checked against a list
            if not isinstance(data[key], str) or not data[key]:
                raise ConfigError(f"{source}: {key}: {short(data[key])}: allowed a name")
        surface = data.get("surface")
        if surface is not None and not isinstance(surface, str):
            raise ConfigError(f"{source}: surface: {short(surface)}: allowed a path or null")
        storage = data.get("storage")  # absent from the run.json of sweeps before --storage
        if storage is not None and not isinstance(storage, str):
            raise ConfigError(f"{source}: storage: {short(storage)}: allowed a storage URL, a journal path or null")
        stack = data.get("stack", DEFAULT_STACK)  # absent from the run.json of sweeps before --stack
        if stack not in STACKS:
            raise ConfigError(f"{source}: stack: {short(stack)}: allowed {', '.join(STACKS)}")
        target = data.get("target_gpus")  # absent from the run.json of sweeps before --target-gpus
        if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < workload.gpus):
            raise ConfigError(f"{source}: target_gpus: {short(target)}: allowed null or a whole number >= the "
                              f"workload's gpus ({workload.gpus})")
        policy = data.get("policy")  # absent from the run.json of sweeps before --policy
        if policy is not None and not (isinstance(policy, str) and policy):
            raise ConfigError(f"{source}: policy: {short(policy)}: allowed an exported policy's folder or null")
        digest = data.get("policy_sha256")  # absent from the run.json of sweeps before the digest
        if digest is not None and not (isinstance(digest, str) and digest):
            raise ConfigError(f"{source}: policy_sha256: {short(digest)}: allowed a policy's digest or null")
        surface_digest = data.get("surface_sha256")  # absent from the run.json of sweeps before it
        if surface_digest is not None and not (isinstance(surface_digest, str) and surface_digest):
            raise ConfigError(f"{source}: surface_sha256: {short(surface_digest)}: allowed a surface's digest or null")
        return cls(workload=workload, hardware=hardware, memory_budget_bytes=data["memory_budget_bytes"],
                   strategy=data["strategy"], backend=data["backend"], seed=data["seed"],
                   choices=parse_choices(data["space"], f"{source}: space"), surface=surface,
                   storage=storage, stack=stack, target_gpus=target, policy=policy,
                   policy_sha256=digest, surface_sha256=surface_digest)

    def differences(self, given: "RunSettings") -> list[str]:
        """`key: recorded X, given Y` for every setting that differs, `self` being the recorded settings
        (`hardware.allocator: ...` inside a mapping); the space's last, as --stack and --target-gpus narrow it: the
        flag at fault first."""
        recorded = self.to_dict()
        if self.surface_sha256 is None:  # a sweep recorded before the digest: its surface's lines are not checked
            recorded["surface_sha256"] = given.surface_sha256
        return sorted(differences(recorded, given.to_dict()), key=lambda line: line.startswith("space."))


def differences(recorded: Mapping[str, Any], given: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`key: recorded X, given Y` for every key whose value differs between a recorded run's settings and the
    ones given now (a mapping inside both: its keys, as `key.inner`; a named one of another name, a model or a
    hardware profile, by its name alone: the rest follows from it). Sizes (keys ending `_bytes`) read as 2 GiB."""
    out = []
    for key in [*recorded, *(k for k in given if k not in recorded)]:
        a, b = recorded.get(key), given.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and "name" in a and "name" in b and a["name"] != b["name"]:
            out.append(f"{prefix}{key}: recorded {a['name']!r}, given {b['name']!r}")
        elif isinstance(a, dict) and isinstance(b, dict):  # the keys that differ (space.precision), not the whole
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            # a knob's values in another order: the same configs, proposed in another order (grid, Optuna's indices)
            reordered = isinstance(a, list) and isinstance(b, list) and sorted(map(repr, a)) == sorted(map(repr, b))
            out.append(f"{prefix}{key}: recorded {_shown(key, a)}, given {_shown(key, b)}"
                       + (" (the same values in another order)" if reordered else ""))
    return out


def _shown(key: str, value: Any) -> str:
    """A setting as a person reads it: a size in bytes as 2 GiB (a list of sizes as [1 GiB, 2 GiB]), anything
    else as its repr."""
    if key.endswith("_bytes"):
        if isinstance(value, int) and not isinstance(value, bool):
            return format_size(value)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            return "[" + ", ".join(format_size(v) for v in value) + "]"
    return repr(value)


def is_url(storage: str) -> bool:
    return "://" in storage


def masked(storage: str | None) -> str | None:
    """The storage as it may be shown and recorded: a URL's password replaced by ***."""
    if storage is None or not is_url(storage):
        return storage
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(storage)
        return storage if url.password is None else url.render_as_string(hide_password=True)
    except ArgumentError:  # unparseable: hide whatever stands between the scheme and an @
        scheme, _, rest = storage.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}" if "@" in rest else storage
