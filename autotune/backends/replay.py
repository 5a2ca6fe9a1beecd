"""The replay backend: trials looked up in a surface, a JSONL table of measured TrialResults
(ARCHITECTURE.md section 3), so tuners can be compared on real landscapes in milliseconds.

- An unmeasured config is refused with a ConfigError naming it: asking for it is a bug of the caller
  (the environment masks such configs; `surface_space` gives the space of measured ones).
- A recorded peak over the search's budget counts as `oom` for that search (`TrialResult.under_budget`),
  so one surface recorded without a budget serves every budget.
- A config recorded more than once (a re-measurement) is replayed from its last line.

Surfaces written by `autotune surface record` carry the workload and hardware on each line
(`workload`, `hardware` keys); `load_surface` reads them back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from autotune.values.config import KNOBS, OFFLOADS, PRECISIONS, Config, ConfigError
from autotune.files import is_file
from autotune.values.hardware import Hardware, load_hardware
from autotune.values.results import TrialResult, read_results, relabel_note, relabelled
from autotune.values.settings import RunSettings
from autotune.values.space import Choices, Space
from autotune.values.workload import Workload, make_workload

if TYPE_CHECKING:
    from autotune.values.settings import RunSettings


@dataclass(frozen=True)
class Surface:
    path: str
    # Per config: its measurement of median throughput when it was measured more than once
    # (`autotune surface record --repeats`), else its last line (a crash then rerun: the rerun).
    results: Mapping[Config, TrialResult]
    workload: Workload | None  # None when the lines do not say, or disagree
    hardware: str | None
    notes: tuple[str, ...] = ()  # what reading it changed (old records read as untrained), for the user

    def __len__(self) -> int:
        return len(self.results)

    @property
    def configs(self) -> tuple[Config, ...]:
        return tuple(self.results)

    def best(self, budget_bytes: int | None) -> TrialResult | None:
        """The fastest result that ran within `budget_bytes` (the optimum of the table), or None."""
        fitting = [r for r in self.results.values() if r.fits(budget_bytes)]
        return max(fitting, key=lambda r: r.throughput_samples_per_s or 0.0, default=None)


def load_surface(path: str | Path) -> Surface:
    path = Path(path)
    if not is_file(path):
        raise ConfigError(f"surface {str(path)!r}: no such file (record one with `autotune surface record`)")
    try:
        lines = read_results(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not lines:
        raise ConfigError(f"surface {str(path)!r} holds no results")
    results = {r.config: r for r in lines}
    measured: dict[Config, list[TrialResult]] = {}
    for r in lines:
        if r.status != "crash":
            measured.setdefault(r.config, []).append(r)
    for config, runs in measured.items():
        if len(runs) > 1:
            results[config] = median_run(runs)
    workloads = {_json_key(r.extra.get("workload")) for r in lines}
    workload = None
    if len(workloads) == 1 and lines[0].extra.get("workload"):
        workload = Workload.from_dict(lines[0].extra["workload"])
    hardware_names = {r.extra.get("hardware") for r in lines}
    hardware = hardware_names.pop() if len(hardware_names) == 1 else None
    note = relabel_note(relabelled(lines), path)
    return Surface(str(path), results, workload, hardware, (note,) if note else ())


def median_run(runs: list[TrialResult]) -> TrialResult:
    """The measurement of median throughput (the lower of the two middle ones for an even count; a run that
    did not fit or failed counts as 0 samples/s): a surface's single noisy spike does not become its optimum."""
    ordered = sorted(runs, key=lambda r: (r.throughput_samples_per_s or 0.0) if r.ok else 0.0)
    return ordered[(len(ordered) - 1) // 2]


def _json_key(value: object) -> str:
    return json.dumps(value, sort_keys=True)


class ReplayBackend:
    name = "replay"
    fatal: str | None = None  # no config can succeed here (Backend protocol)

    def __init__(self, surface: Surface | str | Path, memory_budget_bytes: int | None = None) -> None:
        self.surface = surface if isinstance(surface, Surface) else load_surface(surface)
        self.memory_budget_bytes = memory_budget_bytes
        self.notes = self.surface.notes
        # Resolved once: replay is on the hot path of environment steps.
        self._replayed = {config: self._as_replay(result) for config, result in self.surface.results.items()}

    def _as_replay(self, result: TrialResult) -> TrialResult:
        seen = result.under_budget(self.memory_budget_bytes)
        return replace(seen, backend=self.name, extra={**seen.extra, "recorded_backend": result.backend})

    def close(self) -> None:
        """Nothing held between trials."""

    def run(self, config: Config) -> TrialResult:
        try:
            return self._replayed[config]
        except KeyError:
            raise ConfigError(f"{config.to_json()} was not measured in the surface {self.surface.path} "
                              f"({len(self.surface)} configs): replay cannot run it") from None


def surface_choices(surface: Surface) -> Choices:
    """Per knob, the values the surface measured: numbers ascending, names in the ARCHITECTURE.md order."""
    order = {"precision": PRECISIONS, "offload_optimizer": OFFLOADS, "offload_param": OFFLOADS}

    def measured(knob: str) -> tuple[Any, ...]:
        seen = {getattr(c, knob) for c in surface.results}
        return tuple(v for v in order[knob] if v in seen) if knob in order else tuple(sorted(seen))

    return Choices(zero_stage=measured("zero_stage"), micro_batch=measured("micro_batch"),
                   ckpt_interval=measured("ckpt_interval"), precision=measured("precision"),
                   offload_optimizer=measured("offload_optimizer"), offload_param=measured("offload_param"))


def surface_space(surface: Surface, hardware: Hardware | None = None, workload: Workload | None = None,
                  choices: Choices | None = None) -> Space:
    """The space of the configs the surface measured (`Space.restrict`), narrowed by `choices` if given.

    Workload and hardware default to those recorded in the surface.
    """
    workload = workload or surface.workload
    if workload is None:
        raise ConfigError(f"surface {surface.path} does not record its workload: pass one")
    if hardware is None:
        if surface.hardware is None:
            raise ConfigError(f"surface {surface.path} does not record its hardware: pass one")
        hardware = load_hardware(surface.hardware)
    return Space(choices or surface_choices(surface), workload, hardware).restrict(surface.results)


def replay_workload(surface_path: str | Path, model: str | None = None, global_batch: int | None = None,
                    gpus: int | None = None) -> Workload:
    """A replay sweep's workload: the surface's (a given model, batch or GPU count must agree with it), or, when
    the surface does not record one, the one these name."""
    surface = load_surface(surface_path)
    recorded = surface.workload
    if recorded is None:
        return make_workload(model or "tiny", global_batch, gpus or 1)
    for flag, given, value in (("--model", model, recorded.model.name),
                               ("--global-batch", global_batch, recorded.global_batch),
                               ("--gpus", gpus, recorded.gpus)):
        if given is not None and given != value:
            raise ConfigError(f"{flag} {given}: the surface {surface_path} was recorded with {value}")
    return recorded


def searched_space(settings: RunSettings) -> Space:
    """A run directory's space as its sweep searched it (what its report and tracking count): the settings' space,
    restricted to the replay surface's measured configs where it replayed one (unrestricted if that file can no
    longer be read)."""
    space = settings.space()
    if settings.surface is None:
        return space
    try:
        return space.restrict(load_surface(settings.surface).results)
    except ConfigError:
        return space


def replay_space(surface_path: str | Path, workload: Workload, hardware: Hardware | str | None = None,
                 space: Choices | str | None = None) -> Space:
    """A replay sweep's space: the surface's measured knob values, narrowed by `space` (a preset, a YAML path
    or Choices), restricted to the configs it measured, on its hardware unless one is given."""
    from autotune.trials.devices import AUTO, resolve_hardware
    from autotune.search_spaces import load_choices

    surface = load_surface(surface_path)
    if hardware is None:
        hardware = load_hardware(surface.hardware or "cpu")
    elif not isinstance(hardware, Hardware):  # auto (this machine's devices) or a profile's name
        hardware = resolve_hardware(hardware, real=False)[0] if hardware == AUTO else load_hardware(hardware)
    choices = surface_choices(surface)
    if space is not None:
        narrowed = space if isinstance(space, Choices) else load_choices(space)
        kept = {k: tuple(v for v in choices.knob_values(k) if v in narrowed.knob_values(k)) for k in KNOBS}
        for knob, values in kept.items():
            if not values:  # the knob emptied: name the values asked for and why none is left
                asked = ", ".join(map(str, narrowed.knob_values(knob)))
                measured = ", ".join(map(str, choices.knob_values(knob)))
                raise ConfigError(f"--space {space}: {knob} {asked} was not measured in the surface {surface_path} "
                                  f"(it measured {knob} {measured}), so the space holds no {knob}: allowed a space "
                                  f"with one of {measured}")
        choices = Choices(**kept, nvme_path=narrowed.nvme_path)
    return surface_space(surface, hardware, workload, choices).require_configs()


def replay_settings(surface_path: str | Path, *, model: str | None = None, global_batch: int | None = None,
                    gpus: int | None = None, hardware: Hardware | str | None = None, space: str | None = None,
                    memory_budget: int | None = None, strategy: str, seed: int = 0) -> tuple["RunSettings", Space]:
    """A replay sweep's settings and space (replay_workload, replay_space; the budget's default is
    autotune.values.settings.memory_budget's, as for every sweep)."""
    from autotune.values.settings import RunSettings, memory_budget as default_budget

    resolved = replay_space(surface_path, replay_workload(surface_path, model, global_batch, gpus), hardware, space)
    settings = RunSettings(resolved.workload, resolved.hardware, default_budget(memory_budget, resolved.hardware),
                           strategy, "replay", seed, resolved.choices, surface=str(Path(surface_path).resolve()))
    return settings, resolved
