"""Scale-down trials (`autotune tune --target-gpus M`): trials run at the workload's own data-parallel size N,
and the calibrated estimator carries each measured config to a job of M devices with the same global batch.

Per measured config, anchored on its own measurement (the estimator supplies only what changes with the
device count: ZeRO's partitioning of model states and buffers, the micro-batch's share of the global batch,
and the collectives of autotune.prediction.comm):
    peak at M       = measured peak at N + (predicted peak at M - predicted peak at N)
    throughput at M = measured throughput at N x (predicted throughput at M / predicted throughput at N)
(both predictions with the calibration fitted to this run's measured trials: autotune.prediction.calibrate).
Each peak at M gets the 90% interval of autotune.prediction.uncertainty's error model for that config (fitted on this
run's trials by calibrate.fit_uncertainty: the spread of log(measured / predicted) per knob value, noise
included) and the probability that it fits. A config is flagged as a close call when the budget lies inside
that interval, or within the calibration's worst relative peak error on this run's measured trials
(`memory_error`; the typical one is reported beside it) of the peak: either way the prediction cannot tell
whether it fits.

The recommendation for M: among the configs measured to fit the budget at N and predicted to fit at M, the
best predicted throughput at M; configs that fit with the error to spare come first, a flagged one is chosen
only when no other fits.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from autotune.prediction.calibrate import fit_calibration, fit_uncertainty, usable
from autotune.values.argtypes import whole
from autotune.values.config import Config, ConfigError
from autotune.prediction.estimate import Calibration, estimate
from autotune.values.hardware import Hardware
from autotune.values.results import TrialResult
from autotune.values.space import Choices
from autotune.prediction.uncertainty import Z90, normal_cdf
from autotune.values.workload import Workload, divisors

if TYPE_CHECKING:
    from autotune.values.settings import RunSettings


def check_target(target_gpus: Any, workload: Workload) -> None:
    """ConfigError (one line) unless `target_gpus` is a whole number >= the workload's GPUs that divides its
    global batch."""
    if target_gpus is None:
        return
    if whole(target_gpus) is None or target_gpus < workload.gpus:  # any integer type (numpy's)
        raise ConfigError(f"--target-gpus (`target_gpus`) {target_gpus!r}: allowed a whole number >= the workload's "
                          f"--gpus ({workload.gpus}): trials run at --gpus and predict the larger job")
    if workload.global_batch % target_gpus:
        raise ConfigError(f"--target-gpus (`target_gpus`) {target_gpus}: the global batch {workload.global_batch} does not divide "
                          f"over {target_gpus} devices: allowed a target that divides it "
                          f"({', '.join(str(d) for d in divisors(workload.global_batch) if d >= workload.gpus)}) or another "
                          "--global-batch")


def narrow_choices(choices: Choices, workload: Workload, target_gpus: int | None) -> tuple[Choices, str | None]:
    """The space's micro-batches that keep the global batch divisible both at the workload's GPUs and at the
    target (a config of the same global batch must exist at both); a note naming the ones dropped, None if
    none were; ConfigError if none is left."""
    if target_gpus is None:
        return choices, None
    target = workload.with_(gpus=target_gpus)
    kept = tuple(m for m in choices.micro_batch if workload.grad_accumulation(m) and target.grad_accumulation(m))
    if not kept:
        raise ConfigError(f"--target-gpus (`target_gpus`) {target_gpus}: no micro-batch of the space ({', '.join(map(str, choices.micro_batch))}) "
                          f"divides the global batch {workload.global_batch} at both {workload.gpus} and {target_gpus} "
                          f"device(s): allowed micro-batches dividing {workload.global_batch // target_gpus} "
                          f"({', '.join(map(str, divisors(workload.global_batch // target_gpus)))})")
    # named only where the target is why: a micro-batch the trials' own device count refuses is no loss of it
    dropped = [m for m in choices.micro_batch if m not in kept and workload.grad_accumulation(m)]
    if not dropped:
        return choices, None
    note = (f"--target-gpus {target_gpus}: micro-batch {', '.join(map(str, dropped))} left out of the space (global "
            f"batch {workload.global_batch} does not divide into micro-batch x {target_gpus} devices)")
    return replace(choices, micro_batch=kept), note


def for_target(settings: "RunSettings", target_gpus: int, *, script: bool = False) -> tuple["RunSettings", str | None]:
    """`settings` tuned for `target_gpus` devices: checked, the space's micro-batches narrowed to those valid at
    both sizes; the note of narrow_choices."""
    if script:
        raise ConfigError(f"--target-gpus (`target_gpus`) {target_gpus}: not with --script (a script's trials run at the scale it "
                          "is launched with)")
    check_target(target_gpus, settings.workload)
    choices, note = narrow_choices(settings.choices, settings.workload, target_gpus)
    return replace(settings, choices=choices, target_gpus=target_gpus), note


def at_target(settings: "RunSettings") -> "RunSettings":
    """The settings the recommendation is handed off with: the workload at the target's device count."""
    if settings.target_gpus is None:
        return settings
    return replace(settings, workload=settings.workload.with_(gpus=settings.target_gpus))


@dataclass(frozen=True)
class Projection:
    """One measured config at N devices and its prediction at M."""

    config: Config
    trial: Any  # the trial number in trials.jsonl, when known
    measured_peak_bytes: int
    measured_throughput: float
    peak_bytes: int  # predicted at M
    throughput: float  # predicted at M, samples/s of the global batch
    fits: bool  # predicted peak at M within the budget
    close: bool  # the budget inside the peak's interval, or within the calibration's memory error of the peak
    peak_interval: tuple[int, int] = (0, 0)  # 90% interval of the peak at M
    fit_probability: float = 1.0  # P(peak at M <= budget) under the error model

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "label": self.config.label(), "trial": self.trial,
                "measured_peak_bytes": self.measured_peak_bytes, "measured_throughput": self.measured_throughput,
                "predicted_peak_bytes": self.peak_bytes, "predicted_peak_interval_bytes": list(self.peak_interval),
                "fit_probability": self.fit_probability, "predicted_throughput": self.throughput,
                "fits": self.fits, "close_call": self.close}


@dataclass(frozen=True)
class ScaleReport:
    target_gpus: int
    measured_gpus: int
    budget_bytes: int
    memory_error: float  # worst relative error of the calibrated peak on this run's measured trials
    typical_memory_error: float  # their median
    samples: int  # measured trials the calibration and the error come from
    rows: tuple[Projection, ...]  # every config measured to fit at N, best predicted throughput at M first
    pick: Projection | None

    def to_dict(self) -> dict[str, Any]:
        return {"target_gpus": self.target_gpus, "measured_gpus": self.measured_gpus,
                "memory_error": self.memory_error, "typical_memory_error": self.typical_memory_error,
                "samples": self.samples, "pick": None if self.pick is None else self.pick.to_dict(),
                "configs": [row.to_dict() for row in self.rows]}


def memory_errors(results: Sequence[TrialResult], workload: Workload, hardware: Hardware,
                  calibration: Calibration) -> list[float]:
    """Relative errors of the calibrated peak predictions on the measured results."""
    return [abs(estimate(r.config, workload, hardware, calibration).peak_bytes - r.peak_bytes) / r.peak_bytes
            for r in usable(results) if hardware.supports(r.config.precision)]


def close_call(peak_bytes: float, budget_bytes: int, error: float) -> bool:
    """The budget lies within `error` (relative) of the predicted peak: the prediction cannot tell if it fits."""
    return abs(peak_bytes - budget_bytes) <= error * peak_bytes


def project(results: Sequence[TrialResult], workload: Workload, hardware: Hardware, budget_bytes: int,
            target_gpus: int, calibration: Calibration | None = None) -> ScaleReport:
    """Each config measured to fit at the workload's GPUs, carried to `target_gpus` (module docstring), and the
    recommendation for the target. `calibration`: fitted to `results` when not given."""
    measured = [r for r in usable(results) if hardware.supports(r.config.precision)]
    if calibration is None:
        calibration = fit_calibration(measured, workload, hardware)
    errors = memory_errors(measured, workload, hardware, calibration)
    out_of_memory = [(r.config, r.peak_memory_bytes) for r in results if r.status == "oom"]
    uncertainty = fit_uncertainty(results, out_of_memory, workload, hardware, calibration, budget_bytes)
    worst = max(errors, default=0.0)
    typical = statistics.median(errors) if errors else 0.0
    target = workload.with_(gpus=target_gpus)
    rows = []
    seen: set[Config] = set()
    for r in measured:  # a config's first run (a confirmation repeat adds nothing here)
        if r.config in seen or not r.fits(budget_bytes) or not target.grad_accumulation(r.config.micro_batch):
            continue
        seen.add(r.config)
        here = estimate(r.config, workload, hardware, calibration)
        there = estimate(r.config, target, hardware, calibration)
        peak = max(1, r.peak_bytes + there.peak_bytes - here.peak_bytes)
        throughput = r.throughput * there.throughput_samples_per_s / here.throughput_samples_per_s
        sigma = uncertainty.memory.predict(r.config)[1]  # the spread only: the anchor already holds the offset
        low, high = int(peak * math.exp(-Z90 * sigma)), int(peak * math.exp(Z90 * sigma))
        probability = (normal_cdf(math.log(budget_bytes / peak) / sigma) if sigma > 0
                       else float(peak <= budget_bytes))
        close = low <= budget_bytes <= high or close_call(peak, budget_bytes, worst)
        rows.append(Projection(r.config, r.extra.get("trial"), r.peak_bytes, r.throughput, peak, throughput,
                               peak <= budget_bytes, close, (low, high), probability))
    rows.sort(key=lambda row: -row.throughput)
    fitting = [row for row in rows if row.fits]
    safe = [row for row in fitting if not row.close]
    pick = (safe or fitting)[0] if fitting else None
    return ScaleReport(target_gpus, workload.gpus, budget_bytes, worst, typical, len(measured), tuple(rows), pick)
