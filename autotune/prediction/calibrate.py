"""Fit the estimator's free terms to real trials of one workload on one machine, and keep them with the run.

Memory (whole-process peak per device, as the deepspeed backend measures it):
    peak = overhead + memory_scale x (weights + gradients + optimizer states + buffers)
                    + activation_scale x activations
                    + reserve_scale x allocator reserve + memory outside the allocator   (the last two: CUDA only)
On CUDA, trials that recorded their allocator's figures (allocated and reserved peaks, memory outside the
allocator) fit each part against its own measurement (`_fit_memory_cuda`; overhead is then the offset of the
memory outside the allocator from the model, and may be negative); without them the whole peak is fitted.
Time (wall time of one optimizer step):
    step = (compute + recompute) / flops_scale[precision] + (communication + zero + offload + optimizer) + step_overhead
(one FLOP/s scale per precision measured: `flops_scale` is the most measured one's, `precision_scales`
the others' relative to it, so an unmeasured precision takes the measured machine's speed)
Both are linear in the unknowns, fitted by bounded least squares on relative errors (scipy's lsq_linear),
so one big config does not outweigh the small ones. A weak pull of the scales towards 1 keeps the fit
defined with one or two results; with more, the data decide. The terms come from the estimator itself
(autotune.prediction.estimate), so what calibration cannot fix is the shape of its formulas.

What the scales cannot fix (the formulas' shape, per knob value) is the error model of
autotune.prediction.uncertainty, fitted by `fit_uncertainty` on the same trials plus the out-of-memory ones: it turns
each prediction into an interval that is wide for knob values no trial used.

`<run_dir>/calibration.json` holds `Calibration.to_dict()` (plus, when written here, the workload and
hardware it was fitted for and its errors before and after).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from scipy.optimize import lsq_linear

from autotune.values.config import Config, ConfigError
from autotune.files import load_json, short, write_atomic
from autotune.prediction.estimate import Calibration, estimate
from autotune.values.hardware import Hardware
from autotune.values.results import TrialResult
from autotune.prediction.uncertainty import (NOISE_MEMORY, NOISE_TIME, PRIOR_MEMORY, PRIOR_TIME, Uncertainty,
                                             fit_error_model)
from autotune.values.workload import Workload

CALIBRATION_FILE = "calibration.json"
# Pull of each scale towards 1, in units of one result's relative error. On one rank the model states
# hardly vary between configs, so their scale trades off against the fixed overhead: a firmer pull keeps
# it near 1 unless the data insist (held-out error on benchmarks/memory_accuracy.py: 7% instead of 10-20%).
PRIOR_WEIGHT = 0.01
MEMORY_SCALE_PRIOR = 0.1
OVERHEAD_PRIOR = 0.1  # the step overhead's pull towards the profile's (_fit_time)
GiB = 2**30
SCALE_BOUNDS = (0.05, 20.0)
# FLOP/s scales may go far higher: the cpu profile's 0.1 TFLOPS is a guess that a 2-core AMD EPYC's native bf16
# already beats 14x (fitted on 5 trials of tiny) and a many-core CPU with AMX by 100x or more; capped at 20x, such a
# machine's calibrated step times stayed 90% off.
TIME_SCALE_BOUNDS = (SCALE_BOUNDS[0], 1000.0)
# A CUDA trial's allocator figures (autotune.worker.device), each fitted against its own term.
BREAKDOWN_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes", "outside_allocator_bytes")
CUDA_PRIOR = 1.0  # one trial's worth of pull towards the model (_fit_memory_cuda)


@dataclass(frozen=True)
class FitQuality:
    """Mean absolute percentage errors on the results used, before and after the fit."""

    memory_before: float | None
    memory_after: float | None
    time_before: float | None
    time_after: float | None
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def usable(results: Sequence[TrialResult]) -> list[TrialResult]:
    """Ok results with a measured peak and step time: the only rows the fits below read."""
    return [r for r in results if r.ok and r.peak_memory_bytes and r.step_time_s]


def fit_calibration(results: Sequence[TrialResult], workload: Workload, hardware: Hardware,
                    base: Calibration = Calibration()) -> Calibration:
    """The calibration that best explains `results` (ok trials of `workload` on this machine); `base`
    if there are none."""
    rows = [r for r in usable(results) if hardware.supports(r.config.precision)]
    if not rows:
        return base
    overhead, memory_scale, activation_scale, reserve_scale = _fit_memory(rows, workload, hardware)
    scales, step_overhead = _fit_time(rows, workload, hardware)
    counts = [r.config.precision for r in rows]
    main = max(scales, key=counts.count)  # the most measured precision (the first one among equals)
    relative = tuple((p, scales[p] / scales[main]) for p in scales if p != main)
    return replace(base, overhead_bytes=int(overhead), memory_scale=memory_scale, activation_scale=activation_scale,
                   reserve_scale=reserve_scale, flops_scale=scales[main], precision_scales=relative, step_overhead_s=step_overhead,
                   samples=len(rows))


def calibrator(workload: Workload, hardware: Hardware):
    """`results -> Calibration` for a driver that recalibrates as real results arrive."""
    def fit(results: Sequence[TrialResult]) -> Calibration:
        return fit_calibration(results, workload, hardware)
    return fit


@dataclass(frozen=True)
class ErrorObservations:
    """What the error models are fitted on: log(measured / predicted) of peaks (`memory`) and throughputs
    (`time`) per config, and the out-of-memory bounds log(budget / predicted peak) with no measured peak."""

    memory: tuple[tuple[Config, float], ...]
    time: tuple[tuple[Config, float], ...]
    censored: tuple[tuple[Config, float], ...]


def error_observations(results: Sequence[TrialResult], out_of_memory: Sequence[tuple[Config, int | None]],
                       workload: Workload, hardware: Hardware, calibration: Calibration,
                       budget_bytes: int) -> ErrorObservations:
    """The calibrated estimator's log-ratios: the peak of every result with a measured peak (out-of-memory
    ones with a known peak too) and the throughput of every result with a measured step time; an
    out-of-memory with no peak is the bound "peak > `budget_bytes`"."""
    memory: list[tuple[Config, float]] = []
    time: list[tuple[Config, float]] = []
    censored: list[tuple[Config, float]] = []
    seen: set[Config] = set()
    for r in results:
        if r.config in seen or not hardware.supports(r.config.precision) or r.status not in ("ok", "oom"):
            continue
        seen.add(r.config)
        est = estimate(r.config, workload, hardware, calibration)
        if r.peak_memory_bytes and est.peak_bytes > 0:
            memory.append((r.config, math.log(r.peak_memory_bytes / est.peak_bytes)))
        if r.step_time_s and est.step_time_s > 0:
            time.append((r.config, math.log(est.step_time_s / r.step_time_s)))
    for config, peak in out_of_memory:
        if config in seen or not hardware.supports(config.precision):
            continue
        seen.add(config)
        predicted = estimate(config, workload, hardware, calibration).peak_bytes
        if predicted <= 0:
            continue
        if peak:
            memory.append((config, math.log(peak / predicted)))
        else:
            censored.append((config, math.log(budget_bytes / predicted)))
    return ErrorObservations(tuple(memory), tuple(time), tuple(censored))


def fit_uncertainty(results: Sequence[TrialResult], out_of_memory: Sequence[tuple[Config, int | None]],
                    workload: Workload, hardware: Hardware, calibration: Calibration,
                    budget_bytes: int) -> Uncertainty:
    """The error models of the calibrated estimator, fitted on `error_observations`."""
    seen = error_observations(results, out_of_memory, workload, hardware, calibration, budget_bytes)
    return Uncertainty(fit_error_model(seen.memory, PRIOR_MEMORY, NOISE_MEMORY, seen.censored, twin=False),
                       fit_error_model(seen.time, PRIOR_TIME, NOISE_TIME))


def _memory_terms(result: TrialResult, workload: Workload, hardware: Hardware) -> tuple[float, float, float]:
    """(model states + buffers, activations, the CUDA allocator's reserve + memory outside it) as predicted."""
    mem = estimate(result.config, workload, hardware, Calibration(overhead_bytes=0)).memory
    return (float(mem.weights + mem.gradients + mem.optimizer_states + mem.buffers), float(mem.activations),
            float(mem.allocator_reserve + mem.outside_allocator))


def _has_breakdown(result: TrialResult) -> bool:
    """A CUDA trial that recorded its allocator's figures (autotune.worker.device)."""
    return all(isinstance(result.extra.get(k), (int, float)) and result.extra[k] > 0 for k in BREAKDOWN_KEYS)


def _fit_memory(rows: list[TrialResult], workload: Workload,
                hardware: Hardware) -> tuple[float, float, float, float]:
    """(overhead bytes, memory scale, activation scale, reserve scale)."""
    if not hardware.is_cpu and all(_has_breakdown(r) for r in rows):
        return _fit_memory_cuda(rows, workload, hardware)
    a, b = [], []
    for r in rows:
        states, activations, fixed = _memory_terms(r, workload, hardware)  # fixed: 0 on the CPU profile
        y = float(r.peak_bytes)
        a.append([GiB / y, states / y, activations / y])  # overhead in GiB keeps the columns comparable
        b.append(1.0 - fixed / y)
    a += [[0.0, MEMORY_SCALE_PRIOR, 0.0], [0.0, 0.0, PRIOR_WEIGHT]]
    b += [MEMORY_SCALE_PRIOR, PRIOR_WEIGHT]
    lower = [0.0, SCALE_BOUNDS[0], SCALE_BOUNDS[0]]
    upper = [max(r.peak_bytes for r in rows) / GiB, SCALE_BOUNDS[1], SCALE_BOUNDS[1]]
    solution = lsq_linear(np.array(a), np.array(b), bounds=(lower, upper)).x
    return solution[0] * GiB, float(solution[1]), float(solution[2]), 1.0


def _fit_memory_cuda(rows: list[TrialResult], workload: Workload,
                     hardware: Hardware) -> tuple[float, float, float, float]:
    """Each part of a CUDA peak against its own measurement: the memory outside the allocator (a property of
    the machine's driver and libraries: its mean offset from the model), the allocator's reserve (its geometric
    mean ratio to the model, shrunk towards 1 by one trial's worth), and the allocated peak (scales of the model
    states and the activations, each pulled towards 1 by one trial's worth: on the H200 the allocated error of
    the raw model ranged from -5% to +10% between configs of one machine, so one trial cannot tell the machine's
    scale from its config's shape; benchmarks/results/gpu_memory_accuracy.md)."""
    outside, ratios, a, b = [], [], [], []
    for r in rows:
        est = estimate(r.config, workload, hardware, Calibration(overhead_bytes=0))
        mem = est.memory
        outside.append(r.extra["outside_allocator_bytes"] - mem.outside_allocator)
        reserve = r.extra["peak_reserved_bytes"] - r.extra["peak_allocated_bytes"]
        if mem.allocator_reserve > 0 and reserve > 0:
            ratios.append(math.log(reserve / mem.allocator_reserve))
        y = float(r.extra["peak_allocated_bytes"])
        a.append([(mem.weights + mem.gradients + mem.optimizer_states + mem.buffers) / y, mem.activations / y])
        b.append(1.0)
    a += [[CUDA_PRIOR, 0.0], [0.0, CUDA_PRIOR]]
    b += [CUDA_PRIOR, CUDA_PRIOR]
    scales = lsq_linear(np.array(a), np.array(b), bounds=([SCALE_BOUNDS[0]] * 2, [SCALE_BOUNDS[1]] * 2)).x
    reserve_scale = math.exp(sum(ratios) / (len(ratios) + 1)) if ratios else 1.0
    return statistics.mean(outside), float(scales[0]), float(scales[1]), reserve_scale


def _time_terms(result: TrialResult, workload: Workload, hardware: Hardware) -> tuple[float, float]:
    time = estimate(result.config, workload, hardware, Calibration(step_overhead_s=0.0)).time
    return time["compute"] + time["recompute"], time["communication"] + time["zero"] + time["offload"] + time["optimizer"]


def _fit_time(rows: list[TrialResult], workload: Workload, hardware: Hardware) -> tuple[dict[str, float], float]:
    """(FLOP/s scale per precision measured, step overhead)."""
    precisions = list(dict.fromkeys(r.config.precision for r in rows))
    a, b = [], []
    for r in rows:
        compute, rest = _time_terms(r, workload, hardware)
        y = float(r.step_time)
        row = [0.0] * (len(precisions) + 1)  # unknowns: 1 / scale of each precision, step overhead
        row[precisions.index(r.config.precision)] = compute / y
        row[-1] = 1.0 / y
        a.append(row)
        b.append(1.0 - rest / y)
    for i in range(len(precisions)):
        a.append([PRIOR_WEIGHT if j == i else 0.0 for j in range(len(precisions) + 1)])
        b.append(PRIOR_WEIGHT)
    # The overhead's pull towards the profile's, OVERHEAD_PRIOR of one result's relative error at the median step:
    # where the trials' compute shares are alike, scale and overhead trade off freely, and an unpulled fit priced
    # compute as nearly free (11-30 on the H200: two offloaded trials fitted a 1000x FLOP/s scale and a 2.0 s
    # overhead, and the next trial, in fp32, was predicted at 2.1 s a step against the 17.2 s it took; with ZeRO's
    # step term and this pull the same two fit 1.7x and 0.77 s: 23 s). A firmer pull (0.3) kept a CPU's 150x scale
    # from its fit (tests/test_calibrate.py), where the overhead is a real share of a step of milliseconds.
    typical = statistics.median(r.step_time for r in rows)
    a.append([0.0] * len(precisions) + [OVERHEAD_PRIOR / typical])
    b.append(OVERHEAD_PRIOR * hardware.step_overhead_s / typical)
    lower = [1.0 / TIME_SCALE_BOUNDS[1]] * len(precisions) + [0.0]
    upper = [1.0 / TIME_SCALE_BOUNDS[0]] * len(precisions) + [max(r.step_time for r in rows)]
    *inverses, overhead = lsq_linear(np.array(a), np.array(b), bounds=(lower, upper)).x
    return {p: float(1.0 / inv) for p, inv in zip(precisions, inverses)}, float(overhead)


def quality(results: Sequence[TrialResult], workload: Workload, hardware: Hardware, calibration: Calibration,
            before: Calibration = Calibration()) -> FitQuality:
    rows = [r for r in usable(results) if hardware.supports(r.config.precision)]

    def mape(cal: Calibration, memory: bool) -> float | None:
        if not rows:
            return None
        errors = []
        for r in rows:
            est = estimate(r.config, workload, hardware, cal)
            pred, real = (est.peak_bytes, r.peak_bytes) if memory else (est.step_time_s, r.step_time)
            errors.append(abs(pred - real) / real)
        return statistics.mean(errors)

    return FitQuality(mape(before, True), mape(calibration, True), mape(before, False), mape(calibration, False),
                      len(rows))


def save_calibration(run_dir: str | Path, calibration: Calibration, workload: Workload | None = None,
                     hardware: Hardware | None = None, fit: FitQuality | None = None) -> Path:
    path = Path(run_dir) / CALIBRATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = calibration.to_dict()
    if workload is not None:
        data["workload"] = workload.to_dict()
    if hardware is not None:
        data["hardware"] = hardware.name
    if fit is not None:
        data["fit"] = fit.to_dict()
    return write_atomic(path, json.dumps(data, indent=2) + "\n")


def load_calibration(path: str | Path, workload: Workload | None = None,
                     hardware: Hardware | None = None) -> Calibration | None:
    """The calibration in `path` (a run directory or the file), None if there is none; ConfigError if it
    was fitted for another workload or hardware than the ones given."""
    path = Path(path)
    if path.is_dir():
        path = path / CALIBRATION_FILE
    if not path.exists():
        return None
    data = load_json(path, "a calibration file (JSON)")  # its error names the path and what was expected
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a calibration file (expected a JSON object)")
    if workload is not None and "workload" in data:
        try:
            fitted = Workload.from_dict(data["workload"])
        except ConfigError as err:
            raise ConfigError(f"{path}: workload: {err}") from None
        if fitted != workload:
            raise ConfigError(f"{path}: fitted for another workload ({fitted.model.name}, global batch "
                              f"{fitted.global_batch}, {fitted.gpus} GPU(s)), not {workload.model.name}, global batch "
                              f"{workload.global_batch}, {workload.gpus} GPU(s)")
    if hardware is not None and data.get("hardware") not in (None, hardware.name):
        raise ConfigError(f"{path}: fitted for hardware {data['hardware']!r}, not {hardware.name!r}")
    return Calibration(**_terms(data, path))


FILE_KEYS = ("workload", "hardware", "fit")  # what a calibration file says it was made for (save_calibration)


def _terms(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The Calibration's terms of a calibration file, each checked (a file's other keys: the workload, hardware and
    fit it was made for); one-line ConfigError for a term that is not what it holds."""
    known = [f.name for f in fields(Calibration)]
    unknown = [name for name in data if name not in known and name not in FILE_KEYS]
    if unknown or not data:  # a typo's term would be silently the default; another JSON file, none of them
        found = f"unknown key {short(unknown[0])}" if unknown else "no key"
        raise ConfigError(f"{path}: not a calibration file: {found}; allowed {', '.join(known + list(FILE_KEYS))}")
    terms = {}
    for name, value in data.items():
        if name not in known:
            continue
        if name == "precision_scales":
            if not isinstance(value, dict) or not all(_finite(v) for v in value.values()):
                raise ConfigError(f"{path}: precision_scales: {short(value)}: expected an object of precision: factor")
        elif name == "samples":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{path}: samples: {short(value)}: expected a whole number >= 0")
        elif not (_finite(value) or (value is None and name in ("overhead_bytes", "step_overhead_s"))):
            raise ConfigError(f"{path}: {name}: {short(value)}: expected a number")
        terms[name] = value
    return terms


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
