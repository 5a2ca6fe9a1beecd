"""PNG plots of a sweep (matplotlib's object API, no pyplot state): throughput against peak memory with
the budget line and the Pareto front, the best result so far by trial, and the estimator's memory
breakdown of the recommended config. `figures` names what the trials' figures are: `measured`, or `predicted`
(the simulated backend) or `replayed` (a recorded surface), so that no plot calls a prediction measured."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from autotune.prediction.estimate import MEMORY_TERMS, Estimate
from autotune.files import atomic_output
from autotune.values.results import FAILURES, TrialResult
from autotune.values.units import counted

GiB = 2**30


def _save(fig: Figure, path: Path) -> None:
    """PNG to a unique temporary name, then renamed over `path`: a reader never sees half a plot."""
    with atomic_output(path) as handle:
        fig.savefig(handle, format="png", dpi=110)


def pareto_front(results: Sequence[TrialResult]) -> list[TrialResult]:
    """Results no other result beats on both throughput (higher) and peak memory (lower), by memory."""
    points = sorted((r for r in results if r.ok and r.peak_memory_bytes),
                    key=lambda r: (r.peak_bytes, -r.throughput))
    front: list[TrialResult] = []
    for result in points:
        if not front or result.throughput > front[-1].throughput:
            front.append(result)
    return front


def throughput_vs_memory(results: Sequence[TrialResult], budget_bytes: int, best: TrialResult | None,
                         path: Path, figures: str = "measured") -> Path:
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    ok = [r for r in results if r.ok and r.peak_memory_bytes]
    ax.scatter([r.peak_bytes / GiB for r in ok], [r.throughput for r in ok],
               s=28, color="tab:blue", label=f"ran ({len(ok)})", zorder=3)
    failed = [r for r in results if r.status in FAILURES and r.peak_memory_bytes]
    if failed:
        ax.scatter([r.peak_bytes / GiB for r in failed], [0] * len(failed), marker="x", color="tab:red",
                   label=f"failed, {figures} peak ({len(failed)})", zorder=3)
    pruned = [r for r in results if r.status == "pruned" and r.extra.get("predicted_peak_bytes")]
    if pruned:
        ax.scatter([r.extra["predicted_peak_bytes"] / GiB for r in pruned], [0] * len(pruned), marker="v",
                   color="grey", alpha=0.5, label=f"pruned, predicted peak ({len(pruned)})", zorder=2)
    front = pareto_front(ok)
    if front:
        ax.step([r.peak_bytes / GiB for r in front], [r.throughput for r in front],
                where="post", color="tab:green", label="Pareto front", zorder=2)
    if best is not None and best.peak_memory_bytes:
        ax.scatter([best.peak_memory_bytes / GiB], [best.throughput], marker="*", s=220,
                   color="gold", edgecolor="black", label="recommended", zorder=4)
    ax.axvline(budget_bytes / GiB, color="tab:red", linestyle="--", label=f"budget {budget_bytes / GiB:.3g} GiB")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title("Throughput against peak memory, every trial" + ("" if figures == "measured" else f" ({figures})"))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    _save(fig, path)
    return path


def best_so_far(results: Sequence[TrialResult], budget_bytes: int, path: Path) -> Path:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    launched = [r for r in results if r.status != "pruned"]
    xs = list(range(1, len(launched) + 1))
    best, curve = 0.0, []
    for r in launched:
        if r.fits(budget_bytes):
            best = max(best, r.throughput)
        curve.append(best)
    ax.scatter(xs, [r.throughput if r.ok else 0.0 for r in launched], s=18,
               c=["tab:blue" if r.ok else "tab:red" for r in launched], label="trial (red: failed)", zorder=3)
    ax.step(xs, curve, where="post", color="tab:green", label="best within budget so far")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("launched trial")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title("Best result so far")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    _save(fig, path)
    return path


def memory_breakdown(est: Estimate, budget_bytes: int, measured_bytes: int | None, path: Path,
                     figures: str = "measured", calibrated: int = 0) -> Path:
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.subplots()
    left = 0.0
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:olive", "tab:cyan", "tab:gray")
    for term, color in zip(MEMORY_TERMS, colors):
        width = getattr(est.memory, term) / GiB
        ax.barh([0], [width], left=left, color=color, label=f"{term} {width:.3g} GiB")
        left += width
    ax.axvline(budget_bytes / GiB, color="tab:red", linestyle="--", label="budget")
    if measured_bytes:
        ax.axvline(measured_bytes / GiB, color="black", linestyle=":", label=f"{figures} peak {measured_bytes / GiB:.3g} GiB")
    ax.set_yticks([0], [est.config.label()])
    ax.set_xlabel("GiB per device")
    ax.set_title("Estimator's memory breakdown of the recommended config"
                 + (f", calibrated on {counted(calibrated, 'trial')}" if calibrated else ""))
    fig.legend(fontsize="small", loc="outside lower center", ncol=3)
    _save(fig, path)
    return path
