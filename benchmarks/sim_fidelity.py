"""How well the simulated backend's landscape matches a real one (goal: rank correlation >= 0.8, and no
config the surface records as fitting predicted not to fit by more than 10%).

On a recorded surface (default: the committed tiny CPU surface), the estimator is calibrated
(autotune.prediction.calibrate.fit_calibration) with at most 3 of the surface's own ok results, and the simulated
backend with that calibration is compared with the measurements:

- throughput: Spearman rank correlation between simulated and measured throughput over the configs the
  surface measured as ok (the feasible ones). Headline: the 3 calibration results picked as a tuner's
  first trials would spread, the ok configs of smallest, median and largest predicted peak; also the
  spread over 20 random triples, and the uncalibrated estimator.
- memory: predicted vs measured peak per config, and, at budgets where 25%, 50% and 75% of the measured
  configs fit, the agreement on which configs fit; a config measured as fitting but predicted over the
  budget by more than 10% is a miss the tuner would pay for (it would prune a good config).

    python benchmarks/sim_fidelity.py [--surface FILE]

Writes benchmarks/results/sim_fidelity.md, .json and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from autotune.backends.replay import load_surface  # noqa: E402
from autotune.backends.simulated import SimulatedBackend  # noqa: E402
from autotune.prediction.calibrate import fit_calibration  # noqa: E402
from autotune.prediction.estimate import Calibration  # noqa: E402
from autotune.values.hardware import load_hardware  # noqa: E402
from autotune.values.results import TrialResult  # noqa: E402
from autotune.values.units import format_size  # noqa: E402

HERE = Path(__file__).parent
RESULTS = HERE / "results"
SURFACE = HERE / "surfaces" / "tiny-cpu.jsonl"
MISS_TOLERANCE = 0.10
GOAL_RHO = 0.8


def spread_triple(ok: list[TrialResult], predict) -> list[TrialResult]:
    """The ok results of smallest, median and largest predicted peak."""
    ranked = sorted(ok, key=lambda r: predict(r).peak_bytes)
    return [ranked[0], ranked[len(ranked) // 2], ranked[-1]]


def rank_correlation(ok: list[TrialResult], simulated: SimulatedBackend) -> float:
    sim = [simulated.estimate(r.config).throughput_samples_per_s for r in ok]
    return float(spearmanr(sim, [r.throughput_samples_per_s for r in ok]).statistic)


def fit_agreement(ran: list[TrialResult], simulated: SimulatedBackend, budget: int) -> dict:
    """Which configs fit `budget`: measured (ok within it) vs simulated (not oom)."""
    rows = {"budget_bytes": budget, "agree": 0, "both_fit": 0, "both_not": 0, "measured_fit_predicted_not": 0,
            "misses_over_10pct": 0, "worst_overshoot": 0.0, "predicted_fit_measured_not": 0}
    for r in ran:
        measured_fits = r.fits(budget)
        predicted = simulated.estimate(r.config).peak_bytes
        predicted_fits = predicted <= budget
        rows["agree"] += measured_fits == predicted_fits
        rows["both_fit"] += measured_fits and predicted_fits
        rows["both_not"] += not measured_fits and not predicted_fits
        if measured_fits and not predicted_fits:
            rows["measured_fit_predicted_not"] += 1
            overshoot = predicted / budget - 1
            rows["worst_overshoot"] = max(rows["worst_overshoot"], overshoot)
            rows["misses_over_10pct"] += overshoot > MISS_TOLERANCE
        rows["predicted_fit_measured_not"] += predicted_fits and not measured_fits
    rows["agreement"] = rows["agree"] / len(ran)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--surface", type=Path, default=SURFACE)
    parser.add_argument("--triples", type=int, default=20, help="random calibration triples for the spread")
    parser.add_argument("--repeat", type=Path, default=None,
                        help="a second recording of some of the surface's configs (autotune surface record --limit N "
                             "--seed S): the rank correlation between two measurements of the same configs is the "
                             "most any simulator can reach on this machine")
    parser.add_argument("--hardware", default=None,
                        help="hardware profile or YAML to simulate with (default: the surface's own profile)")
    args = parser.parse_args()
    surface = load_surface(args.surface)
    workload = surface.workload
    hardware = load_hardware(args.hardware or surface.hardware or "cpu")
    results = list(surface.results.values())
    ok = [r for r in results if r.ok]
    # Statuses other than ok/oom (crash, timeout) say nothing about memory fit: left out of that part.
    ran = [r for r in results if r.status in ("ok", "oom")]
    budget = hardware.memory_bytes

    def backend(calibration: Calibration) -> SimulatedBackend:
        return SimulatedBackend(workload, hardware, budget, calibration=calibration)

    plain = backend(Calibration())
    triple = spread_triple(ok, lambda r: plain.estimate(r.config))
    calibration = fit_calibration(triple, workload, hardware)
    simulated = backend(calibration)
    rho = rank_correlation(ok, simulated)
    rho_plain = rank_correlation(ok, plain)
    by_group = {}  # where the simulator's ranking holds and where it breaks
    for knob in ("precision", "zero_stage"):
        for value in sorted({getattr(r.config, knob) for r in ok}):
            group = [r for r in ok if getattr(r.config, knob) == value]
            if len(group) >= 4:
                by_group[f"{knob}={value}"] = rank_correlation(group, simulated)
    rng = random.Random(0)
    rhos = sorted(rank_correlation(ok, backend(fit_calibration(rng.sample(ok, 3), workload, hardware)))
                  for _ in range(args.triples))

    peaks = sorted(r.peak_memory_bytes for r in ran if r.peak_memory_bytes)
    budgets = [peaks[int(q * (len(peaks) - 1))] for q in (0.25, 0.5, 0.75)]
    agreements = [fit_agreement(ran, simulated, b) for b in budgets]
    peak_errors = [simulated.estimate(r.config).peak_bytes / r.peak_memory_bytes - 1 for r in ok]
    time_errors = [simulated.estimate(r.config).step_time_s / r.step_time_s - 1 for r in ok]

    if args.repeat is not None:
        again = {c: r for c, r in load_surface(args.repeat).results.items() if r.ok}
        both = [r for r in ok if r.config in again]
        if len(both) >= 4:
            measured = [r.throughput_samples_per_s for r in both]
            noise_ceiling = {
                "configs": len(both),
                "spearman_measured_twice": float(spearmanr(measured, [again[r.config].throughput_samples_per_s
                                                                      for r in both]).statistic),
                "spearman_simulated_same_configs": rank_correlation(both, simulated),
                "median_abs_throughput_change": statistics.median(
                    abs(again[r.config].throughput_samples_per_s / r.throughput_samples_per_s - 1) for r in both)}
        else:
            noise_ceiling = None
    else:
        noise_ceiling = None

    counts = {s: sum(r.status == s for r in results) for s in sorted({r.status for r in results})}
    summary = {
        "surface": str(args.surface), "repeat": str(args.repeat) if args.repeat else None, "configs": len(results), "status_counts": counts,
        "calibrated_with": [r.config.label() for r in triple], "calibration": calibration.to_dict(),
        "hardware": hardware.name, "spearman_throughput": rho, "spearman_uncalibrated": rho_plain,
        "spearman_within": by_group,
        "spearman_random_triples": {"median": statistics.median(rhos), "min": rhos[0], "max": rhos[-1],
                                    "triples": len(rhos)},
        "peak_relative_error": {"median_abs": statistics.median(abs(e) for e in peak_errors),
                                "worst_under": min(peak_errors), "worst_over": max(peak_errors)},
        "step_time_relative_error": {"median_abs": statistics.median(abs(e) for e in time_errors),
                                     "worst_under": min(time_errors), "worst_over": max(time_errors)},
        "fit_agreement": agreements,
        "noise_ceiling": noise_ceiling,
        "goal_met": rho >= GOAL_RHO and all(a["misses_over_10pct"] == 0 for a in agreements),
    }
    show(summary)
    write(summary, ok, simulated)


def show(s: dict) -> None:
    console = Console(width=150, highlight=False)
    console.print(f"{s['surface']} (profile {s['hardware']}): {s['configs']} configs ({', '.join(f'{n} {k}' for k, n in s['status_counts'].items())}); "
                  f"calibrated with {', '.join(s['calibrated_with'])}")
    table = Table(title="Simulated vs measured")
    table.add_column("measure")
    table.add_column("value", justify="right")
    triples = s["spearman_random_triples"]
    table.add_row("Spearman rho, throughput over ok configs (goal >= 0.8)", f"{s['spearman_throughput']:.3f}")
    table.add_row(f"  with {triples['triples']} random calibration triples: median (min-max)",
                  f"{triples['median']:.3f} ({triples['min']:.3f}-{triples['max']:.3f})")
    table.add_row("  uncalibrated estimator", f"{s['spearman_uncalibrated']:.3f}")
    for group, value in s["spearman_within"].items():
        table.add_row(f"  within {group} configs only", f"{value:.3f}")
    pe, te = s["peak_relative_error"], s["step_time_relative_error"]
    if s["noise_ceiling"]:
        n = s["noise_ceiling"]
        table.add_row(f"  measured twice, {n['configs']} configs: measurement vs measurement",
                      f"{n['spearman_measured_twice']:.3f}")
        table.add_row("  same configs: simulated vs measured", f"{n['spearman_simulated_same_configs']:.3f}")
        table.add_row("  same configs: median |throughput change| between measurements",
                      f"{n['median_abs_throughput_change']:.1%}")
    table.add_row("peak: median |error| (worst under / over)",
                  f"{pe['median_abs']:.1%} ({pe['worst_under']:+.1%} / {pe['worst_over']:+.1%})")
    table.add_row("step time: median |error| (worst under / over)",
                  f"{te['median_abs']:.1%} ({te['worst_under']:+.1%} / {te['worst_over']:+.1%})")
    console.print(table)
    fits = Table(title="Which configs fit (measured ok within the budget vs predicted peak within it)")
    for column in ("budget", "agreement", "both fit", "both not", "measured fits, predicted not",
                   "... by > 10%", "worst overshoot", "predicted fits, measured not"):
        fits.add_column(column, justify="right")
    for a in s["fit_agreement"]:
        fits.add_row(format_size(a["budget_bytes"]), f"{a['agreement']:.1%}", str(a["both_fit"]), str(a["both_not"]),
                     str(a["measured_fit_predicted_not"]), str(a["misses_over_10pct"]), f"{a['worst_overshoot']:+.1%}",
                     str(a["predicted_fit_measured_not"]))
    console.print(fits)
    console.print(f"goal met: {s['goal_met']}")


def write(s: dict, ok: list[TrialResult], simulated: SimulatedBackend) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sim_fidelity.json").write_text(json.dumps(s, indent=2) + "\n")
    triples = s["spearman_random_triples"]
    pe, te = s["peak_relative_error"], s["step_time_relative_error"]
    lines = ["# Simulator fidelity", "",
             f"`python benchmarks/sim_fidelity.py --surface {s['surface']}`, hardware profile `{s['hardware']}`: "
             f"{s['configs']} configs "
             f"({', '.join(f'{n} {k}' for k, n in s['status_counts'].items())}); estimator calibrated with "
             f"{len(s['calibrated_with'])} of the surface's results ({', '.join(s['calibrated_with'])}).", "",
             "| measure | value |", "| --- | --- |",
             f"| Spearman rho, simulated vs measured throughput over ok configs (goal >= 0.8) | {s['spearman_throughput']:.3f} |",
             f"| same, {triples['triples']} random calibration triples: median (min-max) | "
             f"{triples['median']:.3f} ({triples['min']:.3f}-{triples['max']:.3f}) |",
             f"| same, uncalibrated estimator | {s['spearman_uncalibrated']:.3f} |",
             *(f"| same, within {g} configs only | {v:.3f} |" for g, v in s["spearman_within"].items()),
             *([f"| measured twice ({s['noise_ceiling']['configs']} configs, `--repeat {s['repeat']}`): Spearman rho "
                f"between the two measurements / simulated vs measured on the same configs / median abs. throughput "
                f"change | {s['noise_ceiling']['spearman_measured_twice']:.3f} / "
                f"{s['noise_ceiling']['spearman_simulated_same_configs']:.3f} / "
                f"{s['noise_ceiling']['median_abs_throughput_change']:.1%} |"] if s["noise_ceiling"] else []),
             f"| peak: median abs. error (worst under / over) | {pe['median_abs']:.1%} ({pe['worst_under']:+.1%} / {pe['worst_over']:+.1%}) |",
             f"| step time: median abs. error (worst under / over) | {te['median_abs']:.1%} ({te['worst_under']:+.1%} / {te['worst_over']:+.1%}) |",
             "", "| budget | agreement on fit | both fit | both not | measured fits, predicted not | by > 10% | worst overshoot | predicted fits, measured not |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a in s["fit_agreement"]:
        lines.append(f"| {format_size(a['budget_bytes'])} | {a['agreement']:.1%} | {a['both_fit']} | {a['both_not']} | "
                     f"{a['measured_fit_predicted_not']} | {a['misses_over_10pct']} | {a['worst_overshoot']:+.1%} | "
                     f"{a['predicted_fit_measured_not']} |")
    lines += ["", f"Goal met: {s['goal_met']}.", "", "![simulated vs measured](sim_fidelity.png)"]
    (RESULTS / "sim_fidelity.md").write_text("\n".join(lines) + "\n")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    measured = [r.throughput_samples_per_s for r in ok]
    sim = [simulated.estimate(r.config).throughput_samples_per_s for r in ok]
    left.scatter(measured, sim, s=14)
    left.set_xlabel("measured samples/s")
    left.set_ylabel("simulated samples/s (calibrated)")
    left.set_title(f"throughput, Spearman {s['spearman_throughput']:.2f}")
    peaks = [r.peak_memory_bytes / 2**20 for r in ok]
    predicted = [simulated.estimate(r.config).peak_bytes / 2**20 for r in ok]
    right.scatter(peaks, predicted, s=14)
    low, high = min(peaks + predicted), max(peaks + predicted)
    right.plot([low, high], [low, high], color="grey", linewidth=1)
    right.set_xlabel("measured peak MiB")
    right.set_ylabel("predicted peak MiB (calibrated)")
    right.set_title("peak memory per config")
    fig.tight_layout()
    fig.savefig(RESULTS / "sim_fidelity.png", dpi=110)


if __name__ == "__main__":
    main()
