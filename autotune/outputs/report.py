"""Outputs of a sweep, written from its run directory alone (so `autotune report runs/NAME` regenerates
them): `summary.json` (the contract of ARCHITECTURE.md section 3), `best_ds_config.json` (checked with
DeepSpeed's own parser), `best_hf_ds_config.json`, `recommended_trainer_args.json` and
`best_accelerate_config.yaml` (autotune/outputs/handoff.py), `launch.sh` (autotune/outputs/launch.py), `report.md`, and
`plots/*.png`."""

from __future__ import annotations

import math
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from autotune.backends.factory import backend_kind
from autotune.backends.replay import searched_space
from autotune.drivers.stop import StopReason
from autotune.search import convergence
from autotune.values.config import Config, ConfigError
from autotune.outputs.handoff import ACCELERATE_CONFIG, DS_CONFIG, HF_DS_CONFIG, TRAINER_ARGS, Handoff, stack_line
from autotune.outputs.launch import LAUNCH_FILE, ORIGIN_FILE, Origin, template_reason
from autotune.search.confirm import (DEFAULT_REPEATS, SHARE, Confirmation, as_one, candidates, confidence_words,
                                     confirmation, is_repeat, prior_sigma, recommend, trials_to_confirm)
from autotune.files import load_json, short
from autotune.prediction.calibrate import load_calibration
from autotune.prediction.estimate import Calibration, estimate
from autotune.search.pruning import (CAUSES, DEVICE_MEMORY, HOST_MEMORY, NVME_SPACE, Pruner, cause_counts, cause_of,
                              describe_causes, host_need_bytes)
from autotune.values.results import STATUSES, TrialResult, error_line
from autotune.search.rundir import STUDY, RunDir
from autotune.search.study_storage import optuna_warnings_only
from autotune.values.settings import RunSettings
from autotune.prediction.scale import ScaleReport, at_target, project
from autotune.search_spaces import space_note
from autotune.values.settings import masked
from autotune.values.units import counted, format_size

TOP = 10
OPTUNA_STRATEGIES = ("optuna", "optuna-gp", "hybrid")  # the strategies that keep an Optuna study
DASHBOARD_EXTRA = "pip install 'ds-autotune[dashboard]'"  # optuna-dashboard (pyproject.toml's extra)
# What a backend's figures are, where they are no measurement of this sweep: (the word for them, why).
FIGURES = {"simulated": ("predicted", "the simulated backend predicts every figure from the estimator: no trial ran"),
           "replay": ("replayed", "the replay backend reads every figure from a recorded surface: measured then, "
                                  "not by this sweep")}


STOP_FILE = "stop.json"  # why the sweep's last session ended, with the trials it had recorded then


@dataclass(frozen=True)
class Stopped:
    """Why the sweep's last session ended (summary.json's `stop_reason` and `stopped`): the runner says it when it
    writes the outputs, and it is kept in stop.json, so that `autotune report` (outputs from the run directory
    alone) says it again while the record holds the same trials."""

    reason: str | None  # a StopReason's value; None: not recorded
    text: str
    lost: int = 0  # trials stop.json counted that the record no longer holds (a torn last line moved aside)

    @property
    def interrupted(self) -> bool:
        return self.reason == StopReason.INTERRUPTED.value

    @property
    def unfinished(self) -> bool:
        """Interrupted, or its last session ended without saying why (killed: SIGKILL, a crash of the machine), or
        its record lost trials since: a sweep that may go on, whose best so far is no recommendation."""
        return self.interrupted or self.reason is None

    def to_dict(self, run: RunDir) -> dict[str, Any]:
        """summary.json's keys, the resume hint first for an unfinished sweep."""
        hint = {"resume": run.resume_hint()} if self.unfinished else {}
        return {**hint, "stop_reason": self.reason, "stopped": self.text}


NOT_RECORDED = ("not recorded: the sweep's last session ended without writing its outputs (killed?), its record lost "
                "trials since they were written (a torn last line moved aside), or it ran before stop reasons were "
                "recorded")
STOP_WHAT = "why the sweep's last session ended (JSON: stop_reason and trials)"


def stop_reason_of(reason: str) -> StopReason:
    try:
        return StopReason(reason)
    except ValueError:
        raise ConfigError(f"stop reason {reason!r}: allowed {', '.join(r.value for r in StopReason)}") from None


def record_stop(run: RunDir, results: Sequence[TrialResult], reason: str) -> Path:
    """stop.json: why the session ended (a StopReason's value, from the runner) and how many trials were recorded."""
    return run.write_json(STOP_FILE, {"stop_reason": stop_reason_of(reason).value, "trials": len(results)})


def read_stop(run: RunDir) -> tuple[StopReason, int] | None:
    """stop.json's reason and count of trials; None where there is none. A file that is not one (not JSON, a
    reason or count it cannot hold) is a one-line ConfigError naming it, as a damaged run.json is: the outputs are
    not rewritten from a record that is not what the sweep wrote."""
    path = run.path / STOP_FILE
    if not os.path.lexists(path):
        return None
    data = load_json(path, STOP_WHAT)  # ConfigError naming file:line
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {short(data)}: expected a JSON object: {STOP_WHAT}")
    missing = [key for key in ("stop_reason", "trials") if key not in data]
    if missing:
        raise ConfigError(f"{path}: missing key(s) {', '.join(missing)}: expected {STOP_WHAT}")
    count = data["trials"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"{path}: trials: {short(count)}: expected a whole number of trials >= 0")
    reason = data["stop_reason"]
    if not isinstance(reason, str):
        raise ConfigError(f"{path}: stop_reason: {short(reason)}: allowed {', '.join(r.value for r in StopReason)}")
    try:
        return stop_reason_of(reason), count
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def stopped(run: RunDir, results: Sequence[TrialResult]) -> Stopped:
    """Why the sweep stopped, as stop.json recorded it while the record held these same trials; else not recorded
    (a killed session, a record grown since, or one that lost trials since: `lost`). A stop.json that cannot be read
    is a ConfigError (read_stop)."""
    recorded = read_stop(run)
    if recorded is None or recorded[1] != len(results):
        lost = recorded[1] - len(results) if recorded is not None and recorded[1] > len(results) else 0
        return Stopped(None, NOT_RECORDED, lost)
    why = recorded[0]
    return Stopped(why.value, why.describe(convergence.recorded(results)))


def check_record(run: RunDir, results: Sequence[TrialResult] | None = None) -> None:
    """Before `autotune report` rewrites a run directory's outputs: the files they are made of that a sweep wrote
    beside trials.jsonl (stop.json, calibration.json) readable, and a record that is there. A run directory whose
    trials.jsonl is gone (or empty) while its outputs describe trials is refused: rewriting them would say that no
    trial ran beside the recommendation files left from before. `results`: the record as read under the lock (None:
    before it, where a missing or empty file is what counts). One-line ConfigErrors naming the file."""
    read_stop(run)
    run_calibration(run)
    check_not_gone(run, results)


def check_not_gone(run: RunDir, results: Sequence[TrialResult] | None = None) -> None:
    """check_record's refusal of a run directory whose trials.jsonl is gone (or empty) while what was written from
    it (summary.json, stop.json, the recommendation) counts trials; `autotune tune --resume` asks it too, before a
    sweep started over would write its outputs over them."""
    gone = (not results) if results is not None else (not os.path.lexists(run.trials_path)
                                                      or os.path.getsize(run.trials_path) == 0)
    if not gone:
        return
    recorded = read_stop(run)
    what = "no trials.jsonl" if not os.path.lexists(run.trials_path) else "an empty trials.jsonl"
    if os.path.lexists(run.path / "summary.json"):
        try:
            summary = run.read_json("summary.json")
        except ConfigError as err:
            raise ConfigError(f"{run.path}: {what}, but a summary.json from an earlier write ({err}): the record is "
                              "gone; nothing rewritten") from None
        count = summary.get("trials") if isinstance(summary, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count != 0:
            counts = (f"counts {counted(count, 'trial')}" if isinstance(count, int) and not isinstance(count, bool)
                      else "is from an earlier write")
            raise ConfigError(f"{run.path}: {what}, but its summary.json {counts}: the record is gone; nothing "
                              "rewritten")
    if recorded is not None and recorded[1]:
        raise ConfigError(f"{run.path}: {what}, but its {STOP_FILE} counts {counted(recorded[1], 'trial')}: the "
                          "record is gone; nothing rewritten")
    for name in (DS_CONFIG, LAUNCH_FILE):
        if os.path.lexists(run.path / name):
            raise ConfigError(f"{run.path}: {what}, but its {name} holds a recommendation from trials: the record "
                              "is gone; nothing rewritten")


@dataclass(frozen=True)
class Outputs:
    best: TrialResult | None
    summary: dict
    files: tuple[Path, ...]
    verdict: str  # one line: the recommendation, or why nothing fits
    notes: tuple[str, ...] = ()  # script mode: how to use the script's own config (replaces the handoff's lines)

    def to_dict(self, run_dir: Path) -> dict[str, Any]:
        """What `autotune report --json` prints (and `tune --json`, with the stop reason): JSON types only, byte
        counts whole (whole_bytes)."""
        best = self.best
        return whole_bytes({
            "run_dir": str(run_dir), "verdict": self.verdict,
            "best": None if best is None else {**best.to_dict(), "label": best.config.label(),
                                               "trial": self.summary.get("best_trial_index")},
            "memory_budget_bytes": self.summary.get("memory_budget_bytes"),
            "status_counts": self.summary.get("status_counts", {}),
            "summary": self.summary,
            "recommended": {p.name: str(p) for p in self.files  # best_ds_config.json, best_hf_ds_config.json, ...
                            if p.name.startswith(("best_", "recommended_")) and p.parent == Path(run_dir)},
            "report": str(Path(run_dir) / "report.md"),
            "files": [str(p) for p in self.files],
        })


def whole_bytes(value: Any, key: str = "") -> Any:
    """`value` (JSON types) with every byte count a whole number: a key ending in `_bytes` that holds a float (a
    record's predicted peak is read back as one: values.results parses it as a number) or a list of them holds ints,
    as every measured peak does."""
    if isinstance(value, dict):
        return {k: whole_bytes(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [whole_bytes(v, key) for v in value]
    if key.endswith("_bytes") and isinstance(value, float) and math.isfinite(value):
        return round(value)
    return value


def recommendation(results: Sequence[TrialResult],
                   settings: RunSettings) -> tuple[TrialResult | None, ScaleReport | None]:
    """The recommended result, decided here once for summary.json, report.md and the handoff files: the best
    median within the budget (close calls confirmed, autotune.search.confirm), or with --target-gpus the measured result
    of the config chosen for the target (autotune.prediction.scale), with the projection."""
    scaled = scale_report(results, settings)
    if scaled is None:
        return recommend(results, settings.memory_budget_bytes), None
    return _pick_result(results, scaled, settings.memory_budget_bytes), scaled


def summarize(results: Sequence[TrialResult], settings: RunSettings) -> dict:
    """summary.json's content."""
    return _summary(results, settings, *recommendation(results, settings))


def _summary(results: Sequence[TrialResult], settings: RunSettings, best: TrialResult | None,
             scaled: ScaleReport | None) -> dict:
    budget = settings.memory_budget_bytes
    index = None
    if best is not None:  # the pick's first run
        index = next(i for i, r in enumerate(results, 1) if r.config == best.config and r.status != "pruned")
    counts = Counter(r.status for r in results)
    summary: dict[str, Any] = {
        "best": None if best is None else {"config": best.config.to_dict(),
                                           "throughput_samples_per_s": best.throughput_samples_per_s,
                                           "peak_memory_bytes": best.peak_memory_bytes},
        "trials": len(results),
        "best_trial_index": index,
        "strategy": settings.strategy,
        "memory_budget_bytes": budget,
        "status_counts": {status: counts.get(status, 0) for status in STATUSES},
        # What the sweep's trials took (each trial's wall time, a pruned config none): in all, and until the
        # recommendation's first run ended (issue 41: a search is judged in seconds).
        "trial_seconds": round(sum(r.wall_time_s for r in results), 1),
        "trial_seconds_to_best": None if index is None else round(sum(r.wall_time_s for r in results[:index]), 1),
    }
    if best is not None and best.runs is not None:
        summary["best"].update(runs=best.runs, throughput_runs=list(best.throughput_runs))
    confirmed = confirmation(results, budget, prior_sigma(settings.backend))
    if confirmed is not None and confirmed.repeats:
        summary["confirmation"] = confirmed.to_dict()
    points = convergence.trace(results)
    if points:  # the chance of a better config after each search trial (autotune.search.convergence)
        last = convergence.recorded(results)
        summary["convergence"] = {"chance_of_better": points[-1][1], "margin": last.margin if last else None,
                                  "expected_gain": last.expected_gain if last else None,
                                  "gain_per_trial_s": last.gain_per_trial_s if last else None,
                                  "trace": [list(p) for p in points]}
    if scaled is not None:
        summary["target"] = scaled.to_dict()
    return summary


def no_fit_verdict(settings: RunSettings, results: Sequence[TrialResult] = (), interrupted: bool = False,
                   no_node: bool = False, at_fault: str = "the program's or the environment's") -> str:
    """Why there is no recommendation, naming the resource that ran out (device memory, host memory for
    offloaded state, NVMe space): configs predicted to fit are still untried (`interrupted`: no advice, as
    interrupted_verdict puts the resume first), or none is left. The budget is named as the fix only where raising
    it would let some config run. `no_node`: the sweep stopped because the Ray cluster cannot run one trial
    (StopReason.NO_NODE), which no budget or further trial on it changes. `at_fault`: whose failure one that every
    config tried had is (a mode's own input: OwnOutputs.at_fault)."""
    if no_node:
        return no_node_verdict(settings)
    space = searched_space(settings)
    pruner = Pruner.for_settings(settings)
    budget = format_size(settings.memory_budget_bytes)
    recorded = {r.config: r for r in results}
    # Each config's fate: its recorded result, else the pruner's verdict (None: predicted to fit, untried).
    fate = {c: recorded.get(c) or pruner.check(c, settings.backend) for c in space}
    if not fate:
        return f"no config fits: the space has no valid config for this workload (budget {budget})"
    untried = sum(r is None for r in fate.values())
    ran = cause_counts(r for r in results if r.status != "pruned")
    if untried:
        left = f"{counted(untried, 'untried config')} {'is' if untried == 1 else 'are'} predicted to fit"
        hit = f"; the trials ran out of {_cause_list(ran)}" if ran else ""
        if interrupted:  # interrupted_verdict says to go on with --resume: not "run more trials" (a new sweep)
            return f"no trial ran within the budget of {budget} yet, though {left}{hit}"
        failed = [r for r in results if r.status in ("crash", "timeout", "untrained")]
        if failed and len(failed) == sum(r.status != "pruned" for r in results):
            # Every trial failed without a verdict on its config (no oom, no unsupported): more trials of the same
            # program fail the same way (a script crashing at step 3, hanging, or whose loss is not finite).
            return (f"no trial ran within the budget of {budget}, though {left}: every launched trial failed "
                    f"({_status_list(failed)}; the first: {error_line(failed[0].error)[:200]}), in every config "
                    f"tried: {at_fault} failure, not a config's; fix what fails (logs/ and the failures below), then "
                    "start again")
        # The budget is the fix only for device memory, and only below the device's own.
        below = settings.memory_budget_bytes < settings.hardware.memory_bytes
        advice = "run more trials" + (" or raise the budget" if below and ran and ran.most_common(1)[0][0] == DEVICE_MEMORY
                                      else "")
        return f"no trial ran within the budget of {budget}, though {left}{hit}: {advice}"
    counts = cause_counts(r for r in fate.values() if r is not None)
    if not counts:
        return f"no config ran within the budget of {budget}, for reasons other than memory (see the failures)"
    if set(counts) == {DEVICE_MEMORY}:
        smallest = min((pruner.predict(c) for c in fate), key=lambda e: e.peak_bytes)
        # A peak its trials saw (measured, or recorded in a replayed surface) says more than a prediction.
        seen = [(r.peak_memory_bytes, c) for c, r in fate.items() if r is not None and r.peak_memory_bytes
                and settings.backend != "simulated"]
        if seen and min(seen, key=lambda s: s[0])[0] <= smallest.peak_bytes:
            peak, config = min(seen, key=lambda s: s[0])
            smallest = pruner.predict(config)
            said = f"the smallest peak its trials saw is {format_size(peak)} ({config.label()}), its prediction"
        else:
            said = f"the smallest predicted peak is {format_size(smallest.peak_bytes)} ({smallest.config.label()}),"
        term = smallest.memory.dominant
        return (f"no config fits the budget of {budget}: {said} dominated by {term} "
                f"({format_size(getattr(smallest.memory, term))}): {_fits_with(term)}")
    hw = settings.hardware
    details, fixes = [], []
    if counts[DEVICE_MEMORY]:
        # Raising the budget helps only up to the device's memory, and only configs nothing else keeps out.
        device = replace(pruner, budget_bytes=max(hw.memory_bytes, settings.memory_budget_bytes))
        helped = sum(device.check(c, settings.backend) is None for c, r in fate.items()
                     if r is not None and cause_of(r) == DEVICE_MEMORY)
        if device.budget_bytes > settings.memory_budget_bytes and helped:
            details.append(f"device budget {budget} of the {format_size(hw.memory_bytes)} of a {hw.name}")
            fixes.append(f"raise the budget ({counted(helped, 'more config')} would fit in all of the device's memory)")
        else:
            details.append(f"device memory {budget}")
            fixes.append("devices with more memory")
    fixes.append("more GPUs (ZeRO shards the model states over them)")
    if counts[HOST_MEMORY]:
        host = [c for c, r in fate.items() if r is not None and cause_of(r) == HOST_MEMORY]
        need = {c: host_need_bytes(pruner.predict(c), settings.workload, hw) for c in host}
        least = min(host, key=need.__getitem__)
        details.append(f"host memory {format_size(hw.host_memory_bytes)} per {hw.name} node, while the smallest "
                       f"offloaded state ({least.label()}) needs {format_size(need[least])}")
        fixes.append("a node with more host memory, or NVMe offload (a space with an nvme_path)")
    if counts[NVME_SPACE]:
        details.append(f"{format_size(pruner.nvme_free_bytes)} free at {settings.choices.nvme_path}")
        fixes.append("more free space at the NVMe path")
    return (f"no config fits: {describe_causes(counts, 'configs over')} ({'; '.join(details)}); it needs "
            f"{', '.join(fixes[:-1])} or {fixes[-1]}")


def no_node_verdict(settings: RunSettings) -> str:
    """No node of the Ray cluster (nor its nodes together, for ranks that can be spread) holds one trial: what one
    trial asks for (drivers/ray.trial_resources) and the two ways out."""
    ranks = settings.workload.gpus
    if not backend_kind(settings.backend).real:
        need, fewer = "1 CPU", ""
    else:
        device = "one CPU" if settings.hardware.is_cpu else "at least one GPU"
        need = f"{counted(ranks, 'rank')}, {device} per rank"
        fewer = ", or with fewer gpus" if ranks > 1 else ""
    return (f"no trial could run: no node of the Ray cluster, nor all its nodes together, has what one trial needs "
            f"({need}): run it on a cluster with such nodes{fewer}")


def _cause_list(counts: Counter[str]) -> str:
    return ", ".join(f"{CAUSES[c]} ({n})" for c, n in counts.most_common())


class OwnOutputs(Protocol):
    """What a mode writes in place of the handoff's files (script mode's: autotune.outputs.script.ScriptOutputs):
    JSON documents by file name, the report's section, lines for the console."""

    @property
    def files(self) -> tuple[tuple[str, Any], ...]: ...

    @property
    def section(self) -> tuple[str, ...]: ...

    @property
    def notes(self) -> tuple[str, ...]: ...

    @property
    def program(self) -> tuple[str, ...]: ...  # what launch.sh runs after its launcher (empty: nothing recommended)

    @property
    def verdict(self) -> str: ...  # why the mode's input stopped the sweep, the report's headline first ('': none)

    @property
    def title(self) -> str: ...  # the report's title where the workload is not known ('': the workload's name)

    @property
    def workload(self) -> str: ...  # the Workload line where the workload is not known ('': the workload's figures)

    @property
    def launch_notes(self) -> tuple[str, ...]: ...  # comment lines for launch.sh: how its command applies the config

    @property
    def no_local_rank(self) -> bool: ...  # the program takes no --local_rank: DeepSpeed's launcher must not pass it

    @property
    def at_fault(self) -> str: ...  # whose failure one in every config tried is ("the script's"), for the verdict


OwnWriter = Callable[[RunDir, RunSettings, "TrialResult | None"], OwnOutputs]


def write_outputs(run: RunDir, settings: RunSettings, results: Sequence[TrialResult] | None = None,
                  own: OwnWriter | None = None, stop_reason: str | None = None) -> Outputs:
    """Summary, plots, report and the recommendation as each stack takes it (the handoff), or what `own` writes
    in their place (a mode's own recommendation: autotune.api.own_outputs decides). `stop_reason`: why the sweep's
    session ended (a StopReason), from the runner, kept in stop.json; None (`autotune report`): what it recorded."""
    from autotune.outputs import plots  # matplotlib takes a second or two to import: only when writing outputs

    results = run.results() if results is None else list(results)
    check_output_paths(run)
    if stop_reason is not None:
        record_stop(run, results, stop_reason)
    stop = stopped(run, results)  # a stop.json that is not one: ConfigError, before anything is written
    best, scaled = recommendation(results, settings)
    # As `autotune estimate --calibration <run>` predicts it: the report's figures are the calibrated ones. Read
    # before anything is written: a calibration.json that is not one is refused (run_calibration).
    calibration = run_calibration(run) if best is not None else Calibration()
    summary = {**stop.to_dict(run), **_summary(results, settings, best, scaled)}
    files = [run.write_json("summary.json", summary)]
    figures = FIGURES.get(settings.backend, ("measured", ""))[0]
    usage: list[str] = []  # the report's section on using the recommendation (autotune/outputs/handoff.py)
    run.plots_dir.mkdir(parents=True, exist_ok=True)
    files.append(plots.throughput_vs_memory(results, settings.memory_budget_bytes, best,
                                            run.plots_dir / "throughput_vs_memory.png", figures=figures))
    files.append(plots.best_so_far(results, settings.memory_budget_bytes, run.plots_dir / "best_so_far.png"))
    # A mode's own outputs (script mode: the script's own config with the tuned keys) instead of the handoff's
    # files (files for the other stacks, built from ours, would not be the script's), its report section and lines.
    script = own(run, settings, best) if own is not None else None
    own_section, own_notes = (list(script.section), list(script.notes)) if script is not None else ([], [])
    if script is not None:
        files += [run.write_json(name, document) for name, document in script.files]
    origin = Origin.read(run.path / ORIGIN_FILE)  # the environment the trials ran in, not this process's
    if best is not None:
        if script is None:
            handoff = Handoff.of(best.config, at_target(settings), run.path, origin)  # for the target's devices
            files += handoff.write(run)  # best_ds_config.json, best_hf_ds_config.json, trainer args, accelerate config
            launch = handoff.launch()
            why = template_reason(settings.backend, settings.hardware)
            if why and not launch.template:  # no trial ran in this environment: launch.sh is the target's template
                run.write_text(LAUNCH_FILE, replace(launch, template=why).script())
            usage = handoff.markdown()
        else:  # the script's own command under a launcher, in the environment its trials ran in
            launch = replace(Handoff.of(best.config, at_target(settings), run.path, origin).launch(), stack="deepspeed",
                             trainer_flags=(), program=script.program, no_local_rank=script.no_local_rank)
            sh = launch.script().split("\n")
            sh[2:2] = [f"# {line}" for line in script.launch_notes]  # after the shebang and the title line
            files.append(run.write_text(LAUNCH_FILE, "\n".join(sh)))
            own_notes += launch.console_lines(str(run.path / LAUNCH_FILE))
            own_section.insert(-1, f"- Launch: `bash {LAUNCH_FILE} torchrun {launch.train()}` (or `deepspeed`): "
                                   f"{counted(launch.processes, 'process', 'processes')} in the environment the trials ran in")
        files.append(breakdown_plot(run, settings, best, scaled, calibration, figures))
        runs = best.runs
        verdict = (f"recommended {best.config.label()}: {best.throughput_samples_per_s:.3g} samples/s"
                   + (f" (median of {counted(runs, 'run')})" if runs else "") + ", "
                   f"peak {format_size(best.peak_memory_bytes)} of {format_size(settings.memory_budget_bytes)} "
                   + (f"(the highest of its runs; trial {summary['best_trial_index']} the first)" if runs
                      else f"(trial {summary['best_trial_index']})"))
    elif script is not None and script.verdict:  # the script, not the configs, stopped the sweep: no "run more"
        verdict = script.verdict
    else:
        verdict = no_fit_verdict(settings, results, stop.unfinished, no_node=stop.reason == StopReason.NO_NODE.value,
                                 **({"at_fault": script.at_fault} if script is not None else {}))
    if scaled is not None:
        if scaled.rows:  # else no trial fits even here: the verdict above says why
            verdict = target_verdict(scaled, settings)
    if stop.unfinished:  # what to do first, then the best so far: no recommendation of an unfinished sweep
        verdict = interrupted_verdict(verdict, results, run, killed=not stop.interrupted, lost=stop.lost)
    with optuna_warnings_only():  # Optuna's "A new study created" lines: the study's own note says what changed
        own_notes += keep_study(run, settings, results)
    report = run.path / "report.md"
    text = markdown(results, settings, summary, best, verdict, study=study_line(run, settings),
                    usage=usage, scaled=scaled, stop=stop, own=script)
    run.write_text("report.md", text + "\n".join(own_section))
    files.append(report)
    return Outputs(best, summary, tuple(files), verdict, tuple(own_notes))


def keep_study(run: RunDir, settings: RunSettings, results: Sequence[TrialResult]) -> list[str]:
    """The record in the sweep's Optuna study, for a strategy that keeps no study of its own (rl, a user's; random
    and grid write theirs as they go: optuna_search.StudyRecord), so that every strategy's study loads and reads
    alike; what following the record changed in it (a line of trials.jsonl gone: the study as it was kept as a
    copy), as `tune --resume` says it. A storage that cannot be opened for writing (a read-only copy of a run) is
    left as it is."""
    if settings.strategy in OPTUNA_STRATEGIES:
        return []
    import optuna

    from autotune.strategies import SearchContext
    from autotune.strategies.optuna_search import StudyRecord

    try:
        storage = run.storage(settings.storage)
    except ConfigError:
        return []
    try:
        context = SearchContext(searched_space(settings), settings.memory_budget_bytes, settings.seed, storage=storage,
                                study_name=run.study_name(settings.storage))
        study = StudyRecord(context, settings.strategy)
        for result in results:
            # as the sweep tells a strategy its record; a config outside the space (a user's strategy's, recorded
            # before the sweep refused such proposals) has no place among the study's distributions
            if not is_repeat(result) and context.space.choices.outside(result.config) is None:
                study.observe(result.config, result)
        study.follow_record()
        return study.notes
    finally:
        if isinstance(storage, optuna.storages.RDBStorage):
            storage.engine.dispose()


def interrupted_verdict(verdict: str, results: Sequence[TrialResult], run: RunDir, killed: bool = False,
                        lost: int = 0) -> str:
    """The verdict of an interrupted sweep (`killed`: one whose last session ended without saying why; `lost`: the
    trials its record lost since its last outputs were written, a torn last line moved aside): that it is
    unfinished and how to continue it first, then the best so far (not called a recommendation)."""
    launched = sum(r.status != "pruned" for r in results)
    best = re.sub(r"^recommended\b", "best so far", verdict) if verdict.startswith("recommended") else verdict
    if lost:  # its last session did write its outputs: the record is what changed since (a resume runs them again)
        return (f"its record lost {counted(lost, 'trial')} since its outputs were written ({len(results)} of "
                f"{len(results) + lost} left in {run.trials_path.name}), unfinished: {run.resume_hint()}; {best}")
    when = f"after {counted(launched, 'finished trial')}" if launched else "before any trial finished"
    how = "ended without writing its outputs (killed?)" if killed else "interrupted"
    return f"{how} {when}, unfinished: {run.resume_hint()}; {best}"


def breakdown_plot(run: RunDir, settings: RunSettings, best: TrialResult, scaled: ScaleReport | None,
                   calibration: Calibration, figures: str) -> Path:
    """plots/memory_breakdown.png: the estimator's breakdown of the recommended config, calibrated as the report's
    predictions are, on the devices it is recommended for: with --target-gpus the target's (beside its predicted
    peak there, report.md's table's figure), else the trials' (beside the peak measured)."""
    from autotune.outputs import plots

    pick = scaled.pick if scaled is not None else None
    if pick is not None and pick.config == best.config:
        target = at_target(settings)
        est = estimate(best.config, target.workload, settings.hardware, calibration)
        return plots.memory_breakdown(est, settings.memory_budget_bytes, pick.peak_bytes,
                                      run.plots_dir / "memory_breakdown.png", figures="predicted",
                                      calibrated=calibration.samples, devices=target.workload.gpus,
                                      measured_devices=settings.workload.gpus)
    est = estimate(best.config, settings.workload, settings.hardware, calibration)
    # A simulated sweep's "calibration" is fitted to the estimator's own figures: no trial calibrated it.
    return plots.memory_breakdown(est, settings.memory_budget_bytes, best.peak_memory_bytes,
                                  run.plots_dir / "memory_breakdown.png", figures=figures,
                                  calibrated=0 if figures == FIGURES["simulated"][0] else calibration.samples,
                                  devices=settings.workload.gpus)


def scale_report(results: Sequence[TrialResult], settings: RunSettings) -> ScaleReport | None:
    """The measured configs carried to --target-gpus (autotune/prediction/scale.py); None without a target."""
    if settings.target_gpus is None:
        return None
    return project(results, settings.workload, settings.hardware, settings.memory_budget_bytes, settings.target_gpus)


def _pick_result(results: Sequence[TrialResult], scaled: ScaleReport, budget: int) -> TrialResult | None:
    """The measured result (at the trials' GPUs) of the config chosen for the target."""
    if scaled.pick is None:
        return None
    return next((r for r in results if r.config == scaled.pick.config and r.fits(budget)), None)


def target_verdict(scaled: ScaleReport, settings: RunSettings) -> str:
    """One line: the config chosen for the target, its prediction there and its measurement here."""
    pick, budget = scaled.pick, settings.memory_budget_bytes
    n, m = scaled.measured_gpus, scaled.target_gpus
    if pick is None:
        return (f"no config measured on {counted(n, 'device')} is predicted to fit {format_size(budget)} on {m}: raise the "
                "budget or measure more configs")
    close = (f"; a close call: {pick.fit_probability:.0%} likely to fit (the budget within its peak's 90% interval "
             f"or the calibration's {scaled.memory_error:.0%} memory error)" if pick.close else "")
    return (f"recommended for {counted(m, 'device')} {pick.config.label()}: predicted {pick.throughput:.3g} samples/s, peak "
            f"{format_size(pick.peak_bytes)} of {format_size(budget)} on {m} (measured on {n}: "
            f"{pick.measured_throughput:.3g} samples/s, peak {format_size(pick.measured_peak_bytes)}, trial "
            f"{pick.trial}){close}")


def target_table(scaled: ScaleReport | None) -> list[str]:
    """Measured at N next to predicted at M for the top configs, close calls flagged."""
    if scaled is None:
        return []
    n, m = scaled.measured_gpus, scaled.target_gpus
    lines = [f"## Predicted at {counted(m, 'device')} (measured at {n})", "",
             f"Each config measured within the budget on {counted(n, 'device')}, carried to {m} with the same global batch by "
             f"the estimator calibrated on this run's {counted(scaled.samples, 'measured trial')} (the change in ZeRO's "
             f"partitioning, micro-steps and communication, anchored on the measurement). Memory error of the "
             f"calibrated estimator on those trials: {scaled.typical_memory_error:.1%} typical, "
             f"{scaled.memory_error:.1%} worst. The peak at {m} comes with its 90% interval (the error model of "
             "autotune.prediction.uncertainty for that config) and the probability that it fits; a config is flagged **close "
             "call** when the budget lies inside that interval or within the worst error of its peak. The "
             f"recommendation is the best predicted throughput at {m} among configs predicted to fit there, close "
             "calls last.", ""]
    if not scaled.rows:
        return lines + [f"No config measured within the budget on {counted(n, 'device')} can run at {m}.", ""]
    lines += [f"| rank | trial | config | samples/s at {n} | peak at {n} | predicted samples/s at {m} | "
              f"predicted peak at {m} | of budget | fits at {m} |",
              "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for rank, row in enumerate(scaled.rows[:TOP], 1):
        fits = ("close call" if row.close else "yes") if row.fits else ("no, close call" if row.close else "no")
        fits += f" ({row.fit_probability:.0%})"
        low, high = row.peak_interval
        pick = " (pick)" if scaled.pick is not None and row.config == scaled.pick.config else ""
        lines.append(f"| {rank} | {row.trial if row.trial is not None else ''} | {row.config.label()}{pick} | "
                     f"{row.measured_throughput:.3g} | {format_size(row.measured_peak_bytes)} | {row.throughput:.3g} | "
                     f"{format_size(row.peak_bytes)} ({format_size(low)}-{format_size(high)}) | "
                     f"{_pct(row.peak_bytes, scaled.budget_bytes)} | {fits} |")
    return lines + [""]


# The files the outputs replace as a set (with plots/): what a new sweep must not find in a folder that holds none.
OUTPUT_FILES = ("summary.json", "report.md", STOP_FILE, DS_CONFIG, HF_DS_CONFIG, TRAINER_ARGS, ACCELERATE_CONFIG,
                LAUNCH_FILE)


def check_output_paths(run: RunDir) -> None:
    """Refuse, before writing any output, a run directory where an output file is a directory or plots/ is not
    one: the outputs are replaced as a set, never half of them."""
    if run.plots_dir.exists() and not run.plots_dir.is_dir():
        raise ConfigError(f"{run.plots_dir} is not a directory: the report's plots go there (remove or rename it)")
    for name in OUTPUT_FILES:
        if (run.path / name).is_dir():
            raise ConfigError(f"{run.path / name} is a directory: the report writes a file there (remove or rename it)")


def study_line(run: RunDir, settings: RunSettings) -> str | None:
    """Where the Optuna study is and how its trial numbers map to this report's (strategies/optuna_search.py); a
    strategy that samples no study of its own has its recorded trials written there too (StudyRecord). The storage
    run.json names, else the run directory's study.db, where it exists: None where it does not (the search never
    opened one: a script that stopped its sweep at the first trial; or it was removed since)."""
    if settings.storage is None and not run.study_path.exists():
        return None
    where = (f"`{masked(settings.storage)}`" if settings.storage else
             f"`{STUDY}` here (`optuna-dashboard sqlite:///{STUDY}` in this directory)")
    return (f"- Optuna study: `{run.study_name(settings.storage)}` in {where}; optuna-dashboard (`{DASHBOARD_EXTRA}`) "
            "and the `optuna` CLI read it. Optuna numbers its trials from 0 and also keeps proposals that never ran "
            "(invalid combinations, repeats: PRUNED or FAIL); each trial's user attribute `report_trial` is its trial "
            "number in this report and trials.jsonl, and its knobs' values are user attributes under their names")


def model_flops_per_token(m: Any) -> float:
    """Training FLOPs a token costs the model, recomputation not counted (6N plus attention's 12 x layers x seq x
    hidden: PaLM's model-FLOPS utilization, arXiv 2204.02311 appendix B)."""
    return 6.0 * m.params + 12.0 * m.layers * m.seq_len * m.hidden


def best_measures(best: TrialResult, settings: RunSettings) -> str:
    """The recommendation in the measures other than throughput a user may rank by (DeepSpeed's autotuning metric:
    latency, flops): at a fixed model and global batch each is throughput in other units, so the ranking is the same."""
    w = settings.workload
    # A result without its step time (a user's objective) has it from its throughput (an ok result's is positive)
    step_s = best.step_time_s or w.global_batch / best.throughput
    latency = f"latency {step_s:.3g} s per optimizer step (global batch {w.global_batch})"
    if not best.tokens_per_s:  # a result without tokens/s (a user's objective): no FLOPS to give, not 0
        return latency
    tflops = model_flops_per_token(w.model) * best.tokens_per_s / w.gpus / 1e12
    return f"{latency}, model FLOPS {tflops:.3g} TFLOP/s per device (recomputation not counted)"


def markdown(results: Sequence[TrialResult], settings: RunSettings, summary: dict, best: TrialResult | None,
             verdict: str, study: str | None = None, usage: Sequence[str] = (),
             scaled: ScaleReport | None = None, stop: Stopped | None = None,
             own: OwnOutputs | None = None) -> str:
    """`own`: a mode's own outputs (a script sweep's): where its workload was never seen (no trial showed the
    script's model) their title and Workload line, no placeholder's figures; where its input stopped the sweep
    (the script cannot be tuned as it is) that verdict, first."""
    title = own.title if own is not None and own.title else settings.workload.model.name
    unseen = own.workload if own is not None else ""
    w, budget = settings.workload, settings.memory_budget_bytes
    launched = [r for r in results if r.status != "pruned"]
    counts = ", ".join(f"{n} {s}" for s, n in summary["status_counts"].items() if n)
    bold = [f"**{verdict[0].upper() + verdict[1:]}.**", ""]
    # An unfinished sweep says so, and how to go on, first; a script that stopped the sweep says why first.
    first = (stop is not None and stop.unfinished) or (own is not None and bool(own.verdict))
    figures, why = FIGURES.get(settings.backend, ("measured", ""))
    lines = [
        f"# ds-autotune report: {title}",
        "",
        *(bold if first else []),
        (f"- Workload: {unseen}" if unseen else
         f"- Workload: {w.model.name} ({w.model.params / 1e6:,.1f}M parameters, seq {w.model.seq_len}), "
         f"global batch {w.global_batch}, {w.gpus} x {settings.hardware.name}"),
        f"- Memory budget: {format_size(budget)} per device",
        *([f"- {note[0].upper()}{note[1:]}"] if (note := space_note(settings.hardware, settings.choices)) else []),
        *([f"- Target: {counted(settings.target_gpus, 'device')}, predicted from the trials on {w.gpus} (--target-gpus)"]
          if settings.target_gpus is not None else []),
        f"- Strategy: {settings.strategy}, backend: {settings.backend}, seed {settings.seed}",
        *([f"- Figures {figures}: {why}; throughput, step time, peak memory and trial time below are not "
           "measurements of this sweep"] if why else []),
        f"- Trials: {len(results)} recorded, {len(launched)} launched ({counts or 'none'}); "
        f"{'' if figures == 'measured' else figures + ' '}trial time {summary['trial_seconds'] / 60:.1f} min"
        + (f" ({summary['trial_seconds_to_best'] / 60:.1f} min to the recommendation's first run)"
           if summary["trial_seconds_to_best"] is not None else ""),
        *([f"- Stopped: {stop.text}"] if stop is not None else []),
        *([study] if study else []),
        *([f"- Stack: {line}"] if (line := stack_line(settings.stack)) else []),
        *_limits(results),
        *_convergence(results),
        "",
        *([] if first else bold),
    ]
    if best is not None:
        # With --target-gpus the verdict is the target's prediction; these are the trials' own measurements
        whose = ("Its other measures" if settings.target_gpus is None else
                 f"The best measured on the trials' {counted(w.gpus, 'device')}, {best.config.label()}, in other measures")
        lines[-1:-1] = [f"- {whose}: {best_measures(best, settings)}"]
        template = template_reason(settings.backend, settings.hardware)
        how = f"a template for the target: {template}" if template else "with the trials' environment"
        use = "The files hold the best so far, not a recommendation: use them" if first else "Use it"
        if usage:
            lines += [f"{use} with DeepSpeed (`best_ds_config.json`), the Hugging Face "
                      "Trainer (`recommended_trainer_args.json` with `best_hf_ds_config.json`) or Accelerate "
                      f"(`best_accelerate_config.yaml`), launched by `launch.sh` (torchrun or deepspeed, {how}): see "
                      "[Using the recommendation](#using-the-recommendation).", ""]
        else:  # script mode: its own config and command, no files for other stacks
            lines += [f"{use} as the script's own config (`best_ds_config.json`), launched by `launch.sh` (torchrun "
                      "or deepspeed, the script's command with it): see [Script mode](#script-mode).", ""]
    lines += _top_table(results, budget, _no_figures(results, own))
    lines += target_table(scaled)
    lines += _confirmation(results, budget, settings.backend)
    lines += _failures(results, stop)
    lines += usage
    lines += ["## Plots", "", "![throughput against peak memory](plots/throughput_vs_memory.png)", "",
              "![best so far](plots/best_so_far.png)", ""]
    if best is not None:
        lines += ["![memory breakdown of the recommended config](plots/memory_breakdown.png)", ""]
    return "\n".join(lines)


def _convergence(results: Sequence[TrialResult]) -> list[str]:
    """The chance of a better config as the sweep went (the convergence stop's figure, --stop-when)."""
    points = convergence.trace(results)
    last = convergence.recorded(results)
    if not points or last is None:
        return []
    return [f"- Chance of a better config (an untried one >{last.margin:.0%} faster, by the estimator's error "
            f"model) after each trial: {convergence.describe_trace(points)}"]


def top_configs(results: Sequence[TrialResult], budget: int) -> list[TrialResult]:
    """The report's top configs within the budget, fastest first: one result per config, as the recommendation
    counts it (the median of its runs where it was re-run, its highest peak)."""
    return [as_one(c, budget) for c in candidates(results, budget)][:TOP]


def tables(results: Sequence[TrialResult], budget: int) -> dict[str, list[dict[str, Any]]]:
    """report.md's top-configs and failures tables as JSON types (`autotune report --json`)."""
    top = [{"rank": rank, "trial": r.extra.get("trial"), "config": r.config.to_dict(), "label": r.config.label(),
            "throughput_samples_per_s": r.throughput, "runs": r.extra.get("runs", 1), "tokens_per_s": r.tokens_per_s,
            "step_time_s": r.step_time_s, "peak_memory_bytes": r.peak_memory_bytes,
            "of_budget": r.peak_memory_bytes / budget if r.peak_memory_bytes else None,
            "predicted_peak_bytes": r.extra.get("predicted_peak_bytes")}
           for rank, r in enumerate(top_configs(results, budget), 1)]
    failures = [{"status": status, "ran_out_of": limit, "cause": _clipped(group[0].error), "count": len(group),
                 "trials": [r.extra.get("trial") for r in group], "configs": [r.config.label() for r in group]}
                for (status, limit, _), group in failure_groups(results)]
    return whole_bytes({"top_configs": top, "failures": failures})


def _no_figures(results: Sequence[TrialResult], own: OwnOutputs | None) -> str:
    """What the top-configs table says where it has no row: why no trial has figures within the budget."""
    if own is not None and own.verdict:  # the mode's input (a script) stopped the sweep: no budget was involved
        return ("No trial has figures: the script stopped the sweep before any config was measured (the verdict "
                "above says why).")
    launched = [r for r in results if r.status != "pruned"]
    if launched and all(r.status in ("crash", "timeout", "untrained", "unsupported") for r in launched):
        return ("No trial has figures: every launched trial failed before it was measured (the failures below say "
                "how).")
    return "No trial ran within the budget."


def _top_table(results: Sequence[TrialResult], budget: int, none: str = "No trial ran within the budget.") -> list[str]:
    # One row per config, as the recommendation counts it: the median of its runs where it was re-run (the
    # confirmation section has each run), so the table and the headline say the same figure.
    fitting = top_configs(results, budget)
    if not fitting:
        return ["## Top configs", "", none, ""]
    lines = [f"## Top {counted(len(fitting), 'config')} within budget", "",
             "| rank | trial | stage | micro | ckpt | precision | offload opt | offload param | samples/s | runs | "
             "tokens/s | step s | peak | of budget | predicted peak |",
             "| ---: | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for rank, r in enumerate(fitting, 1):
        c: Config = r.config
        predicted = r.extra.get("predicted_peak_bytes")
        lines.append(
            f"| {rank} | {r.extra.get('trial', '')} | {c.zero_stage} | {c.micro_batch} | {c.ckpt_interval} | "
            f"{c.precision} | {c.offload_optimizer} | {c.offload_param} | {r.throughput:.3g} | "
            f"{r.extra.get('runs', 1)} | {_num(r.tokens_per_s)} | {_num(r.step_time_s)} | "
            f"{format_size(r.peak_memory_bytes)} | {_pct(r.peak_memory_bytes, budget)} | {format_size(predicted)} |")
    return lines + [""]


def run_calibration(run: RunDir) -> Calibration:
    """The calibration the sweep saved (none: the estimator's own). One that cannot be read is a one-line
    ConfigError naming it, as a damaged run.json is: a breakdown drawn without it would disagree with the report's
    calibrated predictions."""
    return load_calibration(run.path) or Calibration()


def _status_list(results: Sequence[TrialResult]) -> str:
    """'3 crashes, 1 timeout': the failures' statuses, counted."""
    counts = Counter(r.status for r in results)
    plural = {"crash": "crashes", "untrained": "untrained"}
    return ", ".join(counted(n, status, plural.get(status, status + "s")) for status, n in counts.items())


def _fits_with(term: str) -> str:
    """What makes room where `term` (an estimate's memory term) dominates the smallest peak: ZeRO shards only the
    model states over more devices; activations are the micro-batch's and the rest is each device's own."""
    if term in ("weights", "gradients", "optimizer_states"):
        return "raise the budget or use more devices (ZeRO shards the model states over them)"
    if term == "activations":
        return "raise the budget, or a space with smaller micro-batches or activation checkpointing"
    return "raise the budget (each device has it, whatever their number)"


def _confirmation(results: Sequence[TrialResult], budget: int, backend: str) -> list[str]:
    """Each finalist's runs and how sure the pick is (autotune/search/confirm.py); with no repeats, whether the
    runner-up is within the launch spread, and how to settle it."""
    confirmed = confirmation(results, budget, prior_sigma(backend))
    if confirmed is None or len(confirmed.finalists) + confirmed.repeats < 2:
        return []
    spread = confirmed.spread
    if not confirmed.repeats:
        if spread.sigma <= 0:
            return []
        fitting = sorted((r for r in results if r.fits(budget)), key=lambda r: -r.throughput)
        first, second = fitting[0], fitting[1]
        gap = first.throughput / second.throughput - 1
        if gap >= spread.typical:
            return []
        trials, search_first = trials_to_confirm(results, budget, DEFAULT_REPEATS, prior_sigma(backend))
        first_search = (f" after {counted(search_first, 'more search trial')} (confirmation takes at most "
                        f"{SHARE:.0%} of --trials while the search can use them)" if search_first else "")
        return [f"Close call: the runner-up ({second.config.label()}) is {gap:.0%} slower, less than the "
                f"{spread.typical:.0%} median difference between two launches of one config ({spread.source}); "
                "nothing was re-measured (confirmation off, or no trials left for it): `autotune tune ... --resume "
                f"--confirm {DEFAULT_REPEATS} --trials {trials}` runs the close calls again in fresh processes"
                f"{first_search} and recommends the best median.", ""]
    return _confirmation_table(confirmed)


def _confirmation_table(confirmed: Confirmation) -> list[str]:
    spread = confirmed.spread
    lines = ["## Confirmation of close calls", "",
             f"{counted(confirmed.repeats, 'repeat trial')} re-ran the best config and those within the launch spread of it "
             f"in fresh processes; the recommendation is the best median. Launch spread: two launches of one config "
             f"differ by {spread.typical:.0%} typically (from {spread.source}).", "",
             "| config | trials | runs | median samples/s | min - max | pick faster in |",
             "| --- | --- | ---: | ---: | --- | --- |"]
    wins = {c.other.config: c for c in confirmed.comparisons}
    for c in confirmed.finalists:
        versus = wins.get(c.config)
        faster = "(the pick)" if versus is None else f"{versus.wins} of {counted(versus.pairs, 'pair')} of runs"
        failed = f", {c.failed} failed" if c.failed else ""
        lines.append(f"| {c.config.label()} | {', '.join(f'#{t}' for t in c.trials)} | {c.runs}{failed} | "
                     f"{c.median:.3g} | {min(c.throughputs):.3g} - {max(c.throughputs):.3g} | {faster} |")
    lines.append("")
    pick = confirmed.pick
    if not confirmed.comparisons:
        lines += [f"How sure: {pick.config.label()} was the only config within the spread of the best after its "
                  f"{counted(pick.runs, 'run')}: no close call.", ""]
        return lines
    runner = min(confirmed.comparisons, key=lambda c: c.gap)
    p = confirmed.probability
    chance = "" if p is None else f" (a {p:.0%} chance that it is faster than every other config listed, given that spread)"
    lines += [f"How sure: {confidence_words(p)}{chance}. Its median is {runner.gap:.0%} above the runner-up "
              f"{runner.other.config.label()}'s, whose runs it beat in {runner.wins} of {counted(runner.pairs, 'pair')}."
              + (" Either is a fine choice: the difference is within what one launch to the next varies."
                 if p is not None and p < 0.6 else ""), ""]
    return lines


def _limits(results: Sequence[TrialResult]) -> list[str]:
    """The status summary's lines on what ran out: configs pruned and trials that failed, by resource."""
    pruned = cause_counts(r for r in results if r.status == "pruned")
    failed = cause_counts(r for r in results if r.status in ("oom", "crash"))
    lines = []
    if pruned:
        lines.append(f"- Pruned (not run): {describe_causes(pruned, 'predicted over')}")
    if failed:
        lines.append(f"- Out of memory or space: {describe_causes(failed, 'trials ran out of', 'of')}")
    untrained = [r for r in results if r.status == "untrained"]
    if untrained:  # their figures are no measurement: named, so that nobody reads them as configs that lost
        faults = ", ".join(f"{r.config.label()} ({r.extra.get('fault') or 'untrained'})" for r in untrained)
        lines.append(f"- Did not train (every step skipped by the fp16 loss scaler, a loss not finite or never "
                     f"moving; not measurements): {faults}")
    return lines


def failure_groups(results: Sequence[TrialResult]) -> list[tuple[tuple[str, str | None, str], list[TrialResult]]]:
    """The results that are not ok, grouped by status, the resource that ran out (a pruning cause, None for another
    failure) and their error's first line with its numbers blanked; by status, the largest groups first."""
    groups: dict[tuple[str, str | None, str], list[TrialResult]] = defaultdict(list)
    for r in results:
        if not r.ok:
            groups[(r.status, cause_of(r), _cause(r.error))].append(r)
    return sorted(groups.items(), key=lambda item: (item[0][0], -len(item[1])))


def _failures(results: Sequence[TrialResult], stop: Stopped | None = None) -> list[str]:
    groups = failure_groups(results)
    if not groups and stop is not None and stop.reason == StopReason.NO_NODE.value:  # not "every trial ran"
        ran = "no trial failed" if results else "no trial ran"
        return ["## Failures and pruned configs", "",
                f"None: {ran}, and no node of the Ray cluster has the resources one trial needs (see the verdict).", ""]
    if not groups:
        return ["## Failures and pruned configs", "", "None: every trial ran within the budget.", ""]
    lines = ["## Failures and pruned configs, by cause", "",
             "| status | ran out of | cause | count | configs (first 3) |", "| --- | --- | --- | ---: | --- |"]
    for (status, cause_key, _), group in groups:
        limit = CAUSES[cause_key] if cause_key else "-"
        configs = "; ".join(f"#{r.extra.get('trial', '')} {r.config.label()}{_judged(r)}" for r in group[:3])
        # The first's own words, its figures kept (the others say the same with their own figures).
        said = ("" if len(group) == 1 else f"#{group[0].extra.get('trial', '')}: ") + _clipped(group[0].error)
        lines.append(f"| {status} | {limit} | {said.replace('|', '/')} | {len(group)} | {configs} |")
    return lines + [""]


def _judged(result: TrialResult) -> str:
    """What a pruned config was judged by (autotune.search.pruning): ' (fits 2%, peak 1.1 GiB-1.3 GiB, 90%)'."""
    p, interval = result.extra.get("fit_probability"), result.extra.get("predicted_peak_interval_bytes")
    if result.status != "pruned" or p is None or not interval:
        return ""
    return f" (fits {p:.0%}, peak {format_size(interval[0])}-{format_size(interval[1])}, 90%)"


def _clipped(error: str | None, limit: int = 200) -> str:
    line = error_line(error)
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def _cause(error: str | None) -> str:
    """An error's first line with its numbers blanked, so that one cause groups its trials."""
    return re.sub(r"\d+(\.\d+)?(\s?[KMGT]i?B)?", "N", error_line(error))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _pct(part: int | None, whole: int) -> str:
    return "-" if not part else f"{part / whole:.0%}"
