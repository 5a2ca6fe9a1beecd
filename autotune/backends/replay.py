"""The replay backend: trials looked up in a surface, a JSONL table of measured TrialResults
(ARCHITECTURE.md section 3), so tuners can be compared on real landscapes in milliseconds.

- An unmeasured config is refused with a ConfigError naming it: asking for it is a bug of the caller
  (the environment masks such configs; `surface_space` gives the space of measured ones).
- A recorded peak over the search's budget counts as `oom` for that search (`TrialResult.under_budget`),
  so one surface recorded without a budget serves every budget.
- A config recorded more than once (`surface record --repeats`, a crash run again) is replayed from the
  median of its measurements (`replayed_run`): a crash or timeout counts only where it has none.

Surfaces written by `autotune surface record` carry the workload and hardware on each line
(`workload`, `hardware` keys); `load_surface` reads them back. Every replay (`autotune tune --backend replay`,
its library and sweep-file forms, the environment) checks through `check_replay` that what it is asked to
replay is what the surface recorded: a surface whose lines disagree, or another model, batch, GPU count or
hardware, is refused in one line, never passed off as another workload's or machine's measurements.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from autotune.values.config import KNOBS, OFFLOADS, PRECISIONS, Config, ConfigError
from autotune.files import is_file
from autotune.values.hardware import Hardware, load_hardware
from autotune.values.results import TrialResult, read_results, relabel_note, relabelled, torn_tail
from autotune.values.settings import RunSettings
from autotune.values.space import Choices, Space
from autotune.values.workload import Workload, make_workload
from autotune.values.units import counted, format_size

if TYPE_CHECKING:
    from autotune.values.settings import RunSettings


@dataclass(frozen=True)
class Surface:
    path: str
    # Per config: the median of its measurements, else its last failure (replayed_run).
    results: Mapping[Config, TrialResult]
    workload: Workload | None  # None when no line says, or the lines disagree (`mixed`)
    hardware: str | None
    notes: tuple[str, ...] = ()  # what reading it changed (old records read as untrained, a torn last line)
    mixed: str | None = None  # the two workloads or hardwares its lines disagree on: check_replay refuses it

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
        if path.is_dir():
            raise ConfigError(f"surface {str(path)!r} is a directory: name a surface's JSONL file in it")
        raise ConfigError(f"surface {str(path)!r}: no such file (record one with `autotune surface record`)")
    try:
        lines = read_results(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not lines:
        raise ConfigError(f"surface {str(path)!r} holds no results")
    runs: dict[Config, list[TrialResult]] = {}
    for r in lines:
        runs.setdefault(r.config, []).append(r)
    results = {config: replayed_run(config_runs) for config, config_runs in runs.items()}
    workloads: dict[str, Any] = {}  # each recorded workload once, in the order first seen
    hardware_names: dict[str, None] = {}
    backends = list(dict.fromkeys(r.backend for r in lines))  # a simulation's lines are no measurements'
    for r in lines:
        if r.extra.get("workload") is not None:
            workloads.setdefault(_json_key(r.extra["workload"]), r.extra["workload"])
        if r.extra.get("hardware") is not None:
            hardware_names.setdefault(str(r.extra["hardware"]), None)
    recorded = [_recorded_workload(data, path) for data in workloads.values()]
    mixed = None
    if len(recorded) > 1:
        mixed = f"its lines were recorded with two workloads, {_describe(recorded[0])} and {_describe(recorded[1])}"
    elif len(hardware_names) > 1:
        first, second = list(hardware_names)[:2]
        mixed = f"its lines were recorded on two hardwares, {first} and {second}"
    elif len(backends) > 1:
        mixed = f"its lines were recorded by two backends, {backends[0]} and {backends[1]}"
    workload = recorded[0] if len(recorded) == 1 else None
    hardware = next(iter(hardware_names)) if len(hardware_names) == 1 else None
    notes = (relabel_note(relabelled(lines), path), torn_tail(path))
    return Surface(str(path), results, workload, hardware, tuple(note for note in notes if note), mixed)


def _recorded_workload(data: Any, path: Path) -> Workload:
    try:
        return Workload.from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"surface {path}: its recorded workload {err}") from None


def _describe(workload: Workload) -> str:
    return f"{workload.model.name} (global batch {workload.global_batch}, {workload.gpus} GPU(s))"


# What a config's lines say of it, in that order: measurements (the run fitted or did not fit the recording's
# budget: its median), then a verdict without figures, then a failure that is no verdict (a crash: the last one).
MEASURED = ("ok", "oom")
VERDICTS = ("unsupported", "untrained")


def replayed_run(runs: list[TrialResult]) -> TrialResult:
    """The line replayed for a config recorded in `runs` (its lines, in file order): the median of its measurements
    (`ok` and `oom` runs), else its last `unsupported`/`untrained` verdict, else its last line (a crash, a timeout:
    a failure that says nothing of the config counts only where nothing else was recorded)."""
    for statuses in (MEASURED, VERDICTS):
        chosen = [r for r in runs if r.status in statuses]
        if chosen:
            return median_run(chosen) if statuses is MEASURED else chosen[-1]
    return runs[-1]


def median_run(runs: list[TrialResult]) -> TrialResult:
    """The measurement of median throughput (the lower of the two middle ones for an even count; a run that
    did not fit or failed counts as 0 samples/s): a surface's single noisy spike does not become its optimum."""
    ordered = sorted(runs, key=lambda r: (r.throughput_samples_per_s or 0.0) if r.ok else 0.0)
    return ordered[(len(ordered) - 1) // 2]


# How check_replay names what it was given: tune's flags, or the environment's keys.
FLAGS = {"model": "--model", "global_batch": "--global-batch", "gpus": "--gpus", "hardware": "--hardware",
         "seq_len": "--seq-len"}
ENV_KEYS = {"model": "env_config['workload']", "global_batch": "env_config['workload'] global_batch",
            "gpus": "env_config['workload'] gpus", "hardware": "env_config['hardware']",
            "seq_len": "env_config['workload'] seq_len"}


def check_replay(surface: Surface, *, model: str | None = None, global_batch: int | None = None,
                 gpus: int | None = None, hardware: Hardware | None = None, given_hardware: str | None = None,
                 names: Mapping[str, str] = FLAGS, seq_len: int | None = None) -> None:
    """Refuse, in one line, to replay `surface` as anything but what it recorded: a surface whose lines disagree on
    the workload or the hardware, or a model, global batch, GPU count or hardware (the profile's name) other than
    its own. What the surface does not record (old records) is not checked. `given_hardware`: how the hardware
    was asked for, where that is not its name (`auto`); `names`: the flags or keys to name."""
    if surface.mixed:
        raise ConfigError(f"surface {surface.path}: {surface.mixed}: replay refuses a surface of several; "
                          "split it into one surface per workload, hardware and backend")
    recorded = surface.workload
    if recorded is not None:
        for key, given, value in (("model", model, recorded.model.name), ("global_batch", global_batch,
                                                                           recorded.global_batch),
                                  ("gpus", gpus, recorded.gpus), ("seq_len", seq_len, recorded.model.seq_len)):
            if given is not None and given != value:
                raise ConfigError(f"{names[key]} {given}: the surface {surface.path} was recorded with {value}")
    if hardware is not None and surface.hardware is not None and hardware.name != surface.hardware:
        asked = hardware.name if given_hardware in (None, hardware.name) else f"{given_hardware} ({hardware.name})"
        raise ConfigError(f"{names['hardware']} {asked}: the surface {surface.path} was recorded on "
                          f"{surface.hardware}: replay it on {surface.hardware} (or give no hardware)")


def check_replay_workload(surface: Surface, workload: Workload | None, hardware: Hardware | None = None,
                          given_hardware: str | None = None, names: Mapping[str, str] = FLAGS) -> None:
    """check_replay for a whole workload (None: none given): its model, batch and GPU count, and its model's shape
    where the surface records the same model's name (the environment's `workload` may be a shape of its own)."""
    if workload is None:
        check_replay(surface, hardware=hardware, given_hardware=given_hardware, names=names)
        return
    check_replay(surface, model=workload.model.name, global_batch=workload.global_batch, gpus=workload.gpus,
                 hardware=hardware, given_hardware=given_hardware, names=names)
    recorded = surface.workload
    if recorded is not None and workload.model != recorded.model:
        raise ConfigError(f"{names['model']} {workload.model.name}: its shape is not the one the surface "
                          f"{surface.path} was recorded with")


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
                              f"({counted(len(self.surface), 'config')}): replay cannot run it") from None


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


def replay_workload(surface_path: Surface | str | Path, model: str | None = None, global_batch: int | None = None,
                    gpus: int | None = None, seq_len: int | None = None) -> Workload:
    """A replay sweep's workload: the surface's (a given model, batch or GPU count must agree with it: check_replay),
    or, when no line of the surface records one (records older than that key), the one these name (tiny by
    default)."""
    surface = surface_path if isinstance(surface_path, Surface) else load_surface(surface_path)
    check_replay(surface, model=model, global_batch=global_batch, gpus=gpus, seq_len=seq_len)
    if surface.workload is None:
        return make_workload(model or "tiny", global_batch, gpus or 1)
    return surface.workload


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


def replay_space(surface_path: Surface | str | Path, workload: Workload, hardware: Hardware | str | None = None,
                 space: Choices | str | None = None) -> Space:
    """A replay sweep's space: the surface's measured knob values, narrowed by `space` (a preset, a YAML path
    or Choices), restricted to the configs it measured, on its hardware unless one is given."""
    from autotune.trials.devices import AUTO, resolve_hardware
    from autotune.search_spaces import load_choices

    surface = surface_path if isinstance(surface_path, Surface) else load_surface(surface_path)
    given = hardware if isinstance(hardware, str) else None
    if hardware is None:
        hardware = load_hardware(surface.hardware or "cpu")
    elif not isinstance(hardware, Hardware):  # auto (this machine's devices) or a profile's name
        hardware = resolve_hardware(hardware, real=False)[0] if hardware == AUTO else load_hardware(hardware)
    check_replay_workload(surface, workload, hardware, given)
    choices = surface_choices(surface)
    if space is not None:
        narrowed = space if isinstance(space, Choices) else load_choices(space)
        kept = {k: tuple(v for v in choices.knob_values(k) if v in narrowed.knob_values(k)) for k in KNOBS}
        for knob, values in kept.items():
            if not values:  # the knob emptied: name the values asked for and why none is left
                asked = ", ".join(map(str, narrowed.knob_values(knob)))
                measured = ", ".join(map(str, choices.knob_values(knob)))
                raise ConfigError(f"--space (`space`) {space}: {knob} {asked} was not measured in the surface {surface.path} "
                                  f"(it measured {knob} {measured}), so the space holds no {knob}: allowed a space "
                                  f"with one of {measured}")
        choices = Choices(**kept, nvme_path=narrowed.nvme_path)
    return surface_space(surface, hardware, workload, choices).require_configs()


def check_replay_budget(surface: Surface, budget: int) -> None:
    """Refuse, in one line, a budget above the one a surface's out-of-memory configs were recorded under: such a
    config only ran out of that budget, and would replay as out of memory under any larger one (a wrong
    recommendation, the configs that fit between the two never offered)."""
    recorded = [r.memory_budget_bytes for r in surface.results.values() if r.status == "oom" and r.memory_budget_bytes]
    if recorded and budget > min(recorded):
        ooms = sum(r.status == "oom" for r in surface.results.values())
        raise ConfigError(f"--memory-budget (`memory_budget_bytes`) {format_size(budget)}: the surface {surface.path} "
                          f"was recorded under {format_size(min(recorded))}, and its {ooms} out-of-memory config(s) "
                          f"say nothing of a larger budget: allowed up to {format_size(min(recorded))} (or record "
                          "the surface again under the larger budget)")


def replay_settings(surface_path: str | Path, *, model: str | None = None, global_batch: int | None = None,
                    gpus: int | None = None, hardware: Hardware | str | None = None, space: str | None = None,
                    memory_budget: int | None = None, strategy: str, seed: int = 0) -> tuple["RunSettings", Space]:
    """A replay sweep's settings and space (replay_workload, replay_space; the budget's default is
    autotune.values.settings.memory_budget's, as for every sweep)."""
    from autotune.values.settings import RunSettings, memory_budget as default_budget

    surface = load_surface(surface_path)  # read once: the workload, the space and the budget's check all read it
    resolved = replay_space(surface, replay_workload(surface, model, global_batch, gpus), hardware, space)
    if memory_budget is not None:
        check_replay_budget(surface, memory_budget)
    settings = RunSettings(resolved.workload, resolved.hardware, default_budget(memory_budget, resolved.hardware),
                           strategy, "replay", seed, resolved.choices, surface=str(Path(surface_path).resolve()))
    return settings, resolved
