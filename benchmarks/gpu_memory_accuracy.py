"""Predicted vs measured peak memory of the real GPU trials committed under benchmarks/gpu-runs/ (three runs on one
H200, benchmarks/trial_time.py's RUNS), with the estimator's CUDA terms (autotune.prediction.cuda_memory) beside what
each trial measured.

Trials are read as the product reads them (autotune.values.results.read_results): every record file of each run
(a kit's surfaces, a `tune` run's trials.jsonl: the kit's own of 11-30 in kit/work/tune), a trial recorded twice (the
kit's surface and its work/ copy) once; the `tune` run kept without its run.json (11-30's) is planned with the
workload benchmarks/trial_time.py's KEPT_RECORDS names. Only valid trials count: status ok. The fp16 trials of
11-26 and 11-27 skipped every optimizer step and are read as `untrained` (their peaks lack Adam's state); they are
listed, not measured. Those of 11-30 trained.

Per valid trial: the product's measured peak (the allocator's reserved peak + the memory outside it), the
allocator's allocated peak, the reserve (reserved - allocated) and the memory outside the allocator, each beside
its prediction, then
- at run: the raw prediction the product made when the trial ran (`predicted_peak_bytes` of its result.json: a
  `tune` run's trials.jsonl records the calibrated one from its second trial on);
- now: the estimator now, raw (uncalibrated). Every trial of both runs ran the built-in model before its RMSNorm
  computed in fp32 (autotune.worker.model.MODEL_REVISION 2; their records have no `model_revision`), so the bytes
  that term adds (estimate.norm_upcast_bytes) are taken off their prediction; records of revision 2 or later are
  predicted as they are;
- calibrated: the estimator calibrated (autotune.prediction.calibrate) on the first valid trial of the trial's
  sweep (a kit surface of one model, or a `tune` run), for the sweep's other trials (the calibration absorbs the
  model revision: it is fitted on a trial of the same one).

The summary gives the raw error over all valid trials, over the newest run's and over those no term of the
estimator's memory was fitted on (FITTED_ON names the trials each term rests on; issue 40's goal on those of the runs
it was set on, ISSUE_40_RUNS); a held-out trial whose config and workload a term was fitted on in another trial is
marked (the ZeRO-2 offload config ran in all three runs and measured the same bytes).

    python benchmarks/gpu_memory_accuracy.py [--runs DIR ...]

Prints the table and writes benchmarks/results/gpu_memory_accuracy.md. tests/test_gpu_memory_accuracy.py holds the
goals of issues 25 and 40 on the trials they were set on, and the figures of all three runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import trial_time  # beside this script: the runs, and the workload of a run kept without its run.json
from autotune.prediction.calibrate import fit_calibration
from autotune.prediction.estimate import Calibration, Estimate, estimate, norm_upcast_bytes
from autotune.values.config import Config
from autotune.values.hardware import PROFILES, Hardware, hardware_from_dict
from autotune.values.results import TrialResult, read_results
from autotune.values.workload import Workload

HERE = Path(__file__).resolve().parent
RUNS = trial_time.RUNS
OUT = HERE / "results" / "gpu_memory_accuracy.md"
GiB = 2**30
NORM_UPCAST_REVISION = 2  # autotune.worker.model.MODEL_REVISION from which RMSNorm computes in fp32
ISSUE_40_RUNS = ("h200-2026-11-26", "h200-2026-11-27")  # the runs issues 25's and 40's goals were set on

# What each term of autotune.prediction.cuda_memory rests on: the trials (run/sweep/trial folder) whose measurements
# set or chose it. The untrained fp16 trials of 11-26 (z3 ... fp16 oo=cpu) are named where they were used, though they
# are not measurements of peaks any more; terms taken from DeepSpeed's source with nothing fitted name none.
FIT_11_26 = ("h200-2026-11-26/kit/llama-1b/0001-z0_mb16_ck0_bf16", "h200-2026-11-26/kit/llama-3b/0001-z0_mb8_ck0_bf16",
             "h200-2026-11-26/tune/0001-z2_mb8_ck4_bf16_oo_cpu", "h200-2026-11-26/tune/0003-z1_mb2_ck1_bf16_oo_cpu")
Z3_11_27 = "h200-2026-11-27/kit/llama-1b/0001-z3_mb8_ck0_bf16"
FITTED_ON: dict[str, tuple[str, ...]] = {
    "outside: CUDA context (MEASURED_CONTEXT) and libraries (LIBRARIES)": FIT_11_26,
    "outside: ZeRO-3 with an offload (ZERO3_OUTSIDE; the three untrained ZeRO-3 fp16 trials of 11-26), "
    "none without one": (Z3_11_27,),
    "reserve: half the LM head's 12-byte peak (HEAD_RESERVE_FRACTION)": FIT_11_26,
    "reserve: ZeRO 0's 16-bit flattening copies (checked on the two ZeRO 0 trials)": FIT_11_26[:2],
    "reserve/allocated: ZeRO-3's step gradient cached, not allocated (size from DeepSpeed's source; the trial "
    "chose cached over freed)": (Z3_11_27,),
    "allocated: ZeRO-Offload's device staging buffer (DeepSpeed's source, not fitted)": (),
    "allocated/reserve: ZeRO-3's live window of gathered parameters (the untrained ZeRO-3 trials of 11-26)": (),
    "allocated: ZeRO 0's fp16 step (estimate.fp16_fp32_gradient_bytes: DeepSpeed's source, checked on two trials)":
        ("h200-2026-11-30/kit/work/tune/0003-z0_mb1_ck0_fp16", "h200-2026-11-30/kit/llama-1b/0007-z0_mb16_ck1_fp16"),
}


@dataclass(frozen=True)
class GpuTrial:
    """One valid trial of a real GPU run, rebuilt as the product planned it."""

    run: str  # the run's folder under gpu-runs/
    sweep: str  # kit/<model> or tune
    name: str  # the trial's log folder
    config: Config
    workload: Workload
    hardware: Hardware
    result: TrialResult
    at_run_bytes: int  # the raw prediction the product made when the trial ran (its result.json's)

    @property
    def key(self) -> str:
        return f"{self.run}/{self.sweep}/{self.name}"

    @property
    def label(self) -> str:
        return _label(self.config)

    @property
    def allocated(self) -> int:
        return int(self.result.extra["peak_allocated_bytes"])

    @property
    def reserved(self) -> int:
        return int(self.result.extra["peak_reserved_bytes"])

    @property
    def outside(self) -> int:
        return int(self.result.extra["outside_allocator_bytes"])

    @property
    def peak(self) -> int:
        return int(self.result.peak_bytes or 0)

    @property
    def old_model(self) -> bool:
        """Whether the trial ran the built-in model before its RMSNorm computed in fp32."""
        return int(self.result.extra.get("model_revision") or 0) < NORM_UPCAST_REVISION

    def predict(self, calibration: Calibration = Calibration()) -> Estimate:
        return estimate(self.config, self.workload, self.hardware, calibration)

    def raw_bytes(self) -> int:
        """The raw prediction now, for the model the trial ran (the fp32 norms' bytes off for an old record)."""
        off = norm_upcast_bytes(self.config, self.workload) if self.old_model else 0
        return self.predict().peak_bytes - off

    def raw_allocated_bytes(self) -> int:
        """The raw prediction's allocated peak: its peak less the allocator's reserve and the memory outside it."""
        mem = self.predict().memory
        return self.raw_bytes() - mem.allocator_reserve - mem.outside_allocator


@dataclass(frozen=True)
class Loaded:
    valid: tuple[GpuTrial, ...]
    untrained: tuple[tuple[str, str], ...]  # (run/sweep/trial, config) of the records read as untrained
    recorded_ok: tuple[GpuTrial, ...]  # recorded ok, the untrained ones included (load_trials)


def _label(config: Config) -> str:
    c = config
    text = f"z{c.zero_stage} mb{c.micro_batch} ck{c.ckpt_interval} {c.precision}"
    if c.offload_optimizer != "none":
        text += f" oo={c.offload_optimizer}"
    if c.offload_param != "none":
        text += f" op={c.offload_param}"
    return text


def _run_json(path: Path) -> dict[str, Any]:
    """The run.json of the `tune` run a record file belongs to ({} for a kit's surface)."""
    run = path.parent / "run.json"
    return json.loads(run.read_text()) if run.exists() else {}


def _planned(result: TrialResult, path: Path) -> tuple[Workload, Hardware]:
    """The workload and hardware a record was planned with: its own (a kit surface's) or its run's."""
    extra, run = result.extra, _run_json(path)
    kept = trial_time.KEPT_RECORDS.get((path.parent.parent.name, path.parent.name))
    workload = kept or Workload.from_dict(extra.get("workload") or run["workload"])
    profile = extra.get("hardware")
    if isinstance(profile, str) or kept:  # a kept run: on the H200, as every run here (trial_time reads it so too)
        return workload, PROFILES[profile if isinstance(profile, str) else "h200"]
    return workload, hardware_from_dict(run["hardware"], str(path))


def _at_run(result: TrialResult, top: Path, name: str) -> int:
    """The raw prediction of the trial's own result.json: a `tune` run's record carries the calibrated one from its
    second trial on."""
    own = next(top.rglob(f"{name}/result.json"), None)
    data = json.loads(own.read_text()) if own else result.extra
    return int(data["predicted_peak_bytes"])


def _record_files(run: Path) -> list[Path]:
    """A run's trial records: JSONL files, not the ranks' event logs."""
    return sorted(p for p in run.rglob("*.jsonl") if not p.name.endswith(".events.jsonl"))


def load(runs: Sequence[Path] = RUNS) -> Loaded:
    """The valid trials of the runs, each once, sweeps in name order and trials in record order."""
    seen: set[str] = set()
    recorded_ok: list[GpuTrial] = []
    untrained: list[tuple[str, str]] = []
    for run in runs:
        for path in _record_files(run):
            top = path.relative_to(run).parts[0]
            for result in read_results(path):
                name = Path(result.extra.get("log_dir") or f"line-{len(seen)}").name
                # A kit's surface is kit/<model> (its work/ copy the same); a `tune` run its folder.
                surface = "workload" in result.extra
                sweep = (f"{top}/{result.extra['workload']['model']['name']}" if surface
                         else path.parent.relative_to(run).as_posix())
                key = f"{run.name}/{sweep}/{name}"
                if key in seen:
                    continue  # the kit's surface and its work/ copy
                seen.add(key)
                if result.status == "untrained":
                    untrained.append((key, _label(result.config)))
                if result.ok or result.extra.get("recorded_status") == "ok":
                    recorded_ok.append(GpuTrial(run.name, sweep, name, result.config, *_planned(result, path), result,
                                                _at_run(result, run / top, name)))
    order = {t.key: i for i, t in enumerate(recorded_ok)}
    recorded_ok.sort(key=lambda t: (t.run, t.sweep, order[t.key]))
    valid = tuple(t for t in recorded_ok if t.result.ok)
    return Loaded(valid, tuple(untrained), tuple(recorded_ok))


def load_trials(runs: Sequence[Path] = RUNS[:1]) -> list[GpuTrial]:
    """Every trial recorded ok in `runs` (the first run by default), the untrained fp16 ones included: what
    tests/test_allocator.py checks the expandable allocator's prediction against (their allocated peak plus the
    memory outside it). The accuracy figures here use `load`'s valid trials only."""
    return list(load(runs).recorded_ok)


def fitted_keys() -> set[str]:
    return {key for keys in FITTED_ON.values() for key in keys}


def held_out(trials: Sequence[GpuTrial]) -> list[GpuTrial]:
    """The trials no term was fitted on."""
    return [t for t in trials if t.key not in fitted_keys()]


def repeats_a_fitted_config(trial: GpuTrial, trials: Sequence[GpuTrial]) -> bool:
    """Whether a term was fitted on another trial of the same config and workload (on the same GPU)."""
    return any(t.key in fitted_keys() and (t.config, t.workload) == (trial.config, trial.workload) for t in trials)


def calibrated_on_first(trials: Sequence[GpuTrial]) -> dict[str, int]:
    """Per trial key, its peak predicted by the estimator calibrated on its sweep's first valid trial (that trial
    itself is left out)."""
    out: dict[str, int] = {}
    sweeps: dict[tuple[str, str], list[GpuTrial]] = {}
    for t in trials:
        sweeps.setdefault((t.run, t.sweep), []).append(t)
    for members in sweeps.values():
        first = members[0]
        calibration = fit_calibration([first.result], first.workload, first.hardware)
        for t in members[1:]:
            out[t.key] = t.predict(calibration).peak_bytes
    return out


def errors(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(median, worst) absolute relative error of (predicted, measured) pairs."""
    rel = [abs(p / m - 1.0) for p, m in pairs]
    return statistics.median(rel), max(rel)


def raw_errors(trials: Sequence[GpuTrial]) -> tuple[float, float]:
    return errors([(t.raw_bytes(), t.peak) for t in trials])


def allocated_gap_per_logit(t: GpuTrial) -> float:
    """Measured minus predicted allocated peak, in bytes per logit of a micro-batch (the LM head's unit)."""
    m = t.workload.model
    return (t.allocated - t.raw_allocated_bytes()) / (t.config.micro_batch * m.seq_len * m.vocab)


def _row(t: GpuTrial, calibrated: dict[str, int], mark: str) -> str:
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    est = t.predict()
    mem = est.memory
    raw = t.raw_bytes()
    alloc_pred = t.raw_allocated_bytes()
    cal = calibrated.get(t.key)
    return (f"| {t.run[5:]} {t.sweep} | {t.workload.model.name} s{t.workload.model.seq_len} | {t.label}{mark} | "
            f"{g(t.peak)} | {g(t.allocated)} / {g(alloc_pred)} | {allocated_gap_per_logit(t):+.2f} | "
            f"{g(t.reserved - t.allocated)} / {g(mem.allocator_reserve)} | {g(t.outside)} / "
            f"{g(mem.outside_allocator)} | {g(t.at_run_bytes)} | {t.at_run_bytes / t.peak:.3f} | {g(raw)} | "
            f"{raw / t.peak:.3f} | {f'{cal / t.peak:.3f}' if cal is not None else '-'} | "
            f"{t.result.step_time_s:.2f} / {est.step_time_s:.2f} |")


def report(loaded: Loaded) -> str:
    trials = loaded.valid
    calibrated = calibrated_on_first(trials)
    held = held_out(trials)
    runs = sorted({t.run for t in trials})
    lines = [
        "# GPU peak memory: predicted vs measured",
        "",
        f"`python benchmarks/gpu_memory_accuracy.py`: the {len(trials)} valid trials of {', '.join(runs)} "
        "(benchmarks/gpu-runs/, one H200; PyTorch's default allocator, but expandable segments in the kit's `tune` of "
        "11-30, kit/work/tune, whose reserve is predicted 0). `peak` is the product's figure: the caching "
        "allocator's reserved peak plus the memory outside it; each part is given measured / predicted. `at run`: "
        "the raw prediction the product made when the trial ran. `now`: the estimator now, raw, less the fp32 "
        "RMSNorm's bytes (estimate.norm_upcast_bytes) for these records of the model before it (no "
        "`model_revision`). `calibrated`: calibrated on the first valid trial of the trial's sweep, for the sweep's "
        "other trials. `*`: held out (no term fitted on it); `**`: held out, but its config and workload were "
        "measured again in a trial a term was fitted on. `alloc gap`: measured minus predicted allocated peak per "
        "logit of a micro-batch. `step s`: measured step time and the raw estimate's.",
        "",
        "| run, sweep | model | config | peak GiB | alloc meas / pred | alloc gap B/logit | reserve meas / pred | "
        "outside meas / pred | at run | at run / peak | now | now / peak | calibrated / peak | step s meas / pred |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    marks = {t.key: (" **" if repeats_a_fitted_config(t, trials) else " *") for t in held}
    lines += [_row(t, calibrated, marks.get(t.key, "")) for t in trials]
    lines += ["", f"Left out, read as untrained (every optimizer step skipped, recorded ok or crash): "
              f"{len(loaded.untrained)} fp16 records: "
              + "; ".join(f"{key.rsplit('/', 1)[0]} {label}" for key, label in loaded.untrained) + "."]
    at_run = errors([(t.at_run_bytes, t.peak) for t in trials])
    latest = runs[-1]
    new = [t for t in trials if t.run == latest]
    held_40 = [t for t in held if t.run in ISSUE_40_RUNS]
    now_first = raw_errors([t for t in trials if t.run in ISSUE_40_RUNS])
    now, now_new, now_held, now_40 = raw_errors(trials), raw_errors(new), raw_errors(held), raw_errors(held_40)
    cal = errors([(calibrated[t.key], t.peak) for t in trials if t.key in calibrated]) if calibrated else None
    lines += [
        "",
        "| raw prediction | trials | median abs error | worst abs error | goal |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| at run, all valid | {len(trials)} | {at_run[0]:.1%} | {at_run[1]:.1%} | |",
        f"| now, all valid | {len(trials)} | {now[0]:.1%} | {now[1]:.1%} | median <= 8%, worst <= 15% (issue 25, set "
        f"on {' and '.join(ISSUE_40_RUNS)}: {now_first[0]:.1%}, {now_first[1]:.1%}) |",
        f"| now, the newest run ({latest}) | {len(new)} | {now_new[0]:.1%} | {now_new[1]:.1%} | |",
        f"| now, held out (marked * and **) | {len(held)} | {now_held[0]:.1%} | {now_held[1]:.1%} | |",
        f"| now, held out when issue 40 was closed ({'; '.join(f'{t.run[5:]} {t.label}' for t in held_40)}) | "
        f"{len(held_40)} | {now_40[0]:.1%} | {now_40[1]:.1%} | median <= 5%, worst <= 10% (issue 40) |",
    ]
    if cal is not None:
        lines.append(f"| now, calibrated on each sweep's first valid trial | {len(calibrated)} | {cal[0]:.1%} | "
                     f"{cal[1]:.1%} | <= 5% |")
    z3_ckpt = [t.label for t in trials if t.config.zero_stage == 3 and t.config.ckpt_interval]
    lines += ["", f"Valid ZeRO-3 trials with activation checkpointing: {', '.join(z3_ckpt) or 'none'} (the checkpointed "
              "ZeRO-3 trials of 11-26 and 11-27 are fp16, untrained)."]
    lines += ["", "What each term was fitted on (autotune.prediction.cuda_memory's; the last, autotune.prediction.estimate's):", ""]
    lines += [f"- {term}: {', '.join(keys) if keys else 'nothing'}" for term, keys in FITTED_ON.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="+", default=list(RUNS), help="folders of real GPU runs")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = report(load(args.runs))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
