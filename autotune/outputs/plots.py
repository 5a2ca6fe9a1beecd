"""PNG plots of a sweep (matplotlib's object API, no pyplot state): throughput against peak memory with
the budget line and the Pareto front, the best result so far by trial, and the estimator's memory
breakdown of the recommended config. `figures` names what the trials' figures are: `measured`, or `predicted`
(the simulated backend) or `replayed` (a recorded surface), so that no plot calls a prediction measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from autotune.prediction.estimate import MEMORY_TERMS, Estimate
from autotune.files import atomic_output
from autotune.values.results import FAILURES, TrialResult
from autotune.values.units import counted

GiB = 2**30
DPI = 110
PAD, RIGHT = 0.1, 0.3  # inches: between texts; right of the axes, for its last x tick label's overhang


def _arrange(fig: Figure, ax: Axes, legend_below: bool = False) -> None:
    """Margins around the one axes `ax` measured from the texts around it (tick labels, axis labels, its title,
    with `legend_below` the figure's legend, beside the points, never over them), not by a layout engine:
    constrained layout drew every figure twice on saving, a whole draw to lay it out, most of a sweep's output time."""
    renderer = FigureCanvasAgg(fig).get_renderer()

    def inches(texts: Sequence[Any], side: str) -> float:
        return max((getattr(t.get_window_extent(renderer), side) / fig.dpi for t in texts
                    if t.get_visible() and t.get_text()), default=0.0)

    width, height = fig.get_size_inches()
    left = inches(ax.get_yticklabels(), "width") + inches([ax.yaxis.label], "width") + 3 * PAD
    below = inches(ax.get_xticklabels(), "height") + inches([ax.xaxis.label], "height") + 3 * PAD
    if legend_below:
        legend = fig.legend(fontsize="small", loc="lower center", ncol=3, bbox_to_anchor=(0.5, 0.01))
        below += legend.get_window_extent(renderer).height / fig.dpi + PAD
    top = inches([ax.title], "height") + 2 * PAD
    fig.subplots_adjust(left=left / width, right=1 - RIGHT / width, top=1 - top / height, bottom=below / height)


def _save(fig: Figure, path: Path) -> None:
    """PNG to a unique temporary name, then renamed over `path`: a reader never sees half a plot."""
    with atomic_output(path) as handle:
        fig.savefig(handle, format="png")


def pareto_front(results: Sequence[TrialResult]) -> list[TrialResult]:
    """Results no other result beats on both throughput (higher) and peak memory (lower), by memory."""
    points = sorted((r for r in results if r.ok and r.peak_memory_bytes),
                    key=lambda r: (r.peak_bytes, -r.throughput))
    front: list[TrialResult] = []
    for result in points:
        if not front or result.throughput > front[-1].throughput:
            front.append(result)
    return front


# How far the memory axis reaches past the larger of the budget and the highest peak of a trial that ran: beyond
# it, failed and pruned configs (predicted peaks out to 20x the budget) would squeeze every point that ran into the
# axis's first few percent; they are drawn at its right edge instead, counted in the legend.
X_MARGIN = 1.15
HEADROOM = 1.12  # the top of the throughput axis over the highest point: the recommended star is drawn whole


def throughput_vs_memory(results: Sequence[TrialResult], budget_bytes: int, best: TrialResult | None,
                         path: Path, figures: str = "measured") -> Path:
    """Every trial's throughput against its peak memory per device, the budget line and the Pareto front; failed
    and pruned configs on the throughput axis's zero line (failures drawn over pruned ones and the budget line).
    The memory axis is linear, up to X_MARGIN over the budget and every peak of a trial that ran: what sits past it
    (configs pruned far over the budget) is drawn at its right edge as a '>' and counted in its legend entry.
    A log axis was the other way; it keeps the far configs but spreads the ones that ran (a few GiB apart near the
    budget) over a sliver of it, and reads less directly as GiB against the budget."""
    fig = Figure(figsize=(8, 5.5), dpi=DPI)
    ax = fig.subplots()
    ok = [r for r in results if r.ok and r.peak_memory_bytes]
    failed = [r for r in results if r.status in FAILURES and r.peak_memory_bytes]
    pruned = [r for r in results if r.status == "pruned" and r.extra.get("predicted_peak_bytes")]
    x_max = X_MARGIN * max([budget_bytes / GiB, *(r.peak_bytes / GiB for r in ok)])

    past: list[tuple[str, list[float]]] = []  # (what, peaks) beyond the axis, said at its right edge

    def zero_line(points: Sequence[float], marker: str, what: str, label: str, **style: Any) -> None:
        """Configs with no throughput on the zero line at their peak; those past the axis at its edge, as '>'."""
        inside = [x for x in points if x <= x_max]
        beyond = [x for x in points if x > x_max]
        if inside:
            ax.scatter(inside, [0] * len(inside), marker=marker, label=label, **style)
            label = "_"  # one legend entry
        if beyond:
            ax.scatter([x_max] * len(beyond), [0] * len(beyond), marker=">", label=label, clip_on=False, **style)
            past.append((what, beyond))

    ax.scatter([r.peak_bytes / GiB for r in ok], [r.throughput for r in ok],
               s=28, color="tab:blue", label=f"ran ({len(ok)})", zorder=3)
    if pruned:
        zero_line([r.extra["predicted_peak_bytes"] / GiB for r in pruned], "v", "pruned",
                  f"pruned, predicted peak ({len(pruned)})", s=30, color="grey", alpha=0.5, zorder=2)
    if failed:  # over the pruned triangles and the budget line: at y=0 both would hide them
        zero_line([r.peak_bytes / GiB for r in failed], "x", "failed", f"failed, {figures} peak ({len(failed)})",
                  s=60, color="tab:red", linewidths=2, zorder=5)
    if past:
        farthest = max(max(peaks) for _, peaks in past)
        ax.annotate(f"{' and '.join(f'{len(peaks)} {what}' for what, peaks in past)} past {x_max:.3g} GiB "
                    f"(up to {farthest:.3g} GiB) at the edge", xy=(x_max, 0), xytext=(-6, 9),
                    textcoords="offset points", ha="right", va="bottom", fontsize="small", color="dimgrey",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1}, zorder=6)
    front = pareto_front(ok)
    if front:
        ax.step([r.peak_bytes / GiB for r in front], [r.throughput for r in front],
                where="post", color="tab:green", label="Pareto front", zorder=2)
    if best is not None and best.peak_memory_bytes:
        ax.scatter([best.peak_memory_bytes / GiB], [best.throughput], marker="*", s=220,
                   color="gold", edgecolor="black", label="recommended", zorder=4)
    ax.axvline(budget_bytes / GiB, color="tab:red", linestyle="--", linewidth=1.2, zorder=1.5,
               label=f"budget {budget_bytes / GiB:.3g} GiB")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title("Throughput against peak memory, every trial" + ("" if figures == "measured" else f" ({figures})"))
    top = max([r.throughput for r in ok], default=0.0) * HEADROOM or 1.0
    ax.set_ylim(-0.04 * top, top)  # below 0: the zero line's markers whole, not cut by the axis
    ax.set_xlim(0, x_max)
    ax.grid(alpha=0.3)
    _arrange(fig, ax, legend_below=True)
    _save(fig, path)
    return path


def best_so_far(results: Sequence[TrialResult], budget_bytes: int, path: Path) -> Path:
    fig = Figure(figsize=(8, 4.5), dpi=DPI)
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
    _arrange(fig, ax)
    _save(fig, path)
    return path


def memory_breakdown(est: Estimate, budget_bytes: int, measured_bytes: int | None, path: Path,
                     figures: str = "measured", calibrated: int = 0, devices: int = 1,
                     measured_devices: int | None = None) -> Path:
    """The estimator's breakdown of `est`'s config on `devices` devices, beside the budget and its peak:
    `measured_bytes` as the trials' `figures` say, or with `measured_devices` (a --target-gpus recommendation, its
    breakdown on the target) the peak predicted there from the trials on that many."""
    fig = Figure(figsize=(8, 3.8), dpi=DPI)
    ax = fig.subplots()
    left = 0.0
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:olive", "tab:cyan", "tab:gray")
    for term, color in zip(MEMORY_TERMS, colors):
        width = getattr(est.memory, term) / GiB
        ax.barh([0], [width], left=left, color=color, label=f"{term} {width:.3g} GiB")
        left += width
    ax.axvline(budget_bytes / GiB, color="tab:red", linestyle="--", label="budget")
    if measured_bytes:
        at = "" if measured_devices is None else f" on {devices} (from the trials on {measured_devices})"
        ax.axvline(measured_bytes / GiB, color="black", linestyle=":",
                   label=f"{'predicted' if measured_devices is not None else figures} peak{at} {measured_bytes / GiB:.3g} GiB")
    ax.set_yticks([0], [est.config.label()])
    ax.set_xlabel("GiB per device")
    where = counted(devices, "device") + ("" if measured_devices is None else
                                          f" (the target; the trials ran on {measured_devices})")
    # Two lines: one at 8 inches was cut at the right edge ("calibrated on 12 t").
    ax.set_title("Estimator's memory breakdown of the recommended config\n"
                 f"on {where}" + (f", calibrated on {counted(calibrated, 'trial')}" if calibrated else
                                  ", predicted: no trial ran" if figures == "predicted" and measured_devices is None
                                  else ""),
                 fontsize="medium")
    _arrange(fig, ax, legend_below=True)
    _save(fig, path)
    return path
