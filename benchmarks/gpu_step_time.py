"""Predicted vs measured step time of the real GPU trials committed under benchmarks/gpu-runs/ (three runs on one
H200), the estimator's raw step time (no calibration: what a search has before its first trial) with and without
the terms fitted on these trials: ZeRO's per micro-step (Hardware.zero{1,2,3}_micro_step_s) and parameter offload's
per step (Hardware.param_offload_step_s).

Trials are read by benchmarks/trial_time.py's loader (each once, as the product reads them, with the workload its
spec names; KEPT_RECORDS for the one run folder kept without its logs); valid trials with a step time only (status
ok: the fp16 trials of 11-26 and 11-27 skipped every step and are read as untrained).

    python benchmarks/gpu_step_time.py

Prints the table and writes benchmarks/results/gpu_step_time.md. tests/test_gpu_step_time.py holds the figures.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import trial_time  # beside this script: its loader reads every trial of the runs as the product reads them
from autotune.prediction.estimate import estimate
from autotune.values.config import Config
from autotune.values.hardware import Hardware
from autotune.values.results import TrialResult
from autotune.values.workload import Workload

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "gpu_step_time.md"
# The terms fitted on these trials: ZeRO's per micro-step, and parameter offload's per step.
NO_FITTED_TERMS = {"zero1_micro_step_s": 0.0, "zero2_micro_step_s": 0.0, "zero3_micro_step_s": 0.0,
                "param_offload_step_s": 0.0}


@dataclass(frozen=True)
class StepTrial:
    run: str
    result: TrialResult
    workload: Workload
    hardware: Hardware

    @property
    def config(self) -> Config:
        return self.result.config

    @property
    def measured_s(self) -> float:
        return float(self.result.step_time_s or 0.0)

    def predicted_s(self, fitted_terms: bool = True) -> float:
        hardware = self.hardware if fitted_terms else self.hardware.with_(**NO_FITTED_TERMS)
        return estimate(self.config, self.workload, hardware).step_time_s

    @property
    def kind(self) -> str:
        """The group the summary reports: what the step-time model prices differently."""
        c = self.config
        if c.offload_param != "none":
            return "parameters offloaded"
        if c.precision == "fp32":
            return "fp32"
        return "ZeRO 0" if c.zero_stage == 0 else "ZeRO 1-3"


def load(runs: Sequence[Path] = trial_time.RUNS) -> list[StepTrial]:
    """The valid trials of the runs with a step time (trained: status ok), each once (trial_time.gpu_trials)."""
    return [StepTrial(t.run, t.result, t.workload, t.hardware) for t in trial_time.gpu_trials(runs)
            if t.result.ok and t.result.step_time_s]


def error(predicted: float, measured: float) -> float:
    return abs(predicted / measured - 1.0)


def summary(trials: Sequence[StepTrial]) -> dict[str, dict[str, float]]:
    """Per group: trials, median absolute error with and without the fitted terms."""
    out = {}
    for kind in sorted({t.kind for t in trials}):
        group = [t for t in trials if t.kind == kind]
        out[kind] = {"trials": len(group),
                     "median_error_without": statistics.median(error(t.predicted_s(False), t.measured_s) for t in group),
                     "median_error": statistics.median(error(t.predicted_s(), t.measured_s) for t in group)}
    return out


def table(trials: Sequence[StepTrial]) -> list[str]:
    lines = ["| run | model | seq | config | micro-steps | measured s | predicted s (no fitted term) | predicted s | "
             "predicted / measured |", "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for t in trials:
        w = t.workload
        lines.append(f"| {t.run[5:]} | {w.model.name} | {w.model.seq_len} | {t.config.label()} | "
                     f"{w.grad_accumulation(t.config.micro_batch)} | {t.measured_s:.3f} | {t.predicted_s(False):.3f} | "
                     f"{t.predicted_s():.3f} | {t.predicted_s() / t.measured_s:.2f} |")
    lines += ["", "| group | trials | median error, no fitted term | median error |", "| --- | ---: | ---: | ---: |"]
    for kind, row in summary(trials).items():
        lines.append(f"| {kind} | {row['trials']} | {row['median_error_without']:.0%} | {row['median_error']:.0%} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    trials = load()
    lines = ["# GPU step time: the estimator's raw prediction against the H200 trials", "",
             "`python benchmarks/gpu_step_time.py`: every valid trial of benchmarks/gpu-runs (1 x H200, DeepSpeed "
             "0.19.8, torch 2.11), its median measured step against the `h200` profile's raw step time without and "
             "with the terms fitted on these trials: ZeRO's per micro-step (Hardware.zero{1,2,3}_micro_step_s) and "
             "parameter offload's per step (Hardware.param_offload_step_s, on its two trials): the ZeRO 1-3 and "
             "parameter-offload rows are not held out.", "", *table(trials), "",
             "Not priced yet (one trial): fp32, at micro-batch 1 0.46x its prediction."]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
