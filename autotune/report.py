"""Outputs of a sweep, written from its run directory alone (so `autotune report runs/NAME` regenerates
them): `summary.json` (the contract of ARCHITECTURE.md section 3), `best_ds_config.json` (checked with
DeepSpeed's own parser) and `best_hf_ds_config.json`, `report.md`, and `plots/*.png`."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from autotune.config import Config
from autotune.dsconfig import DsOptions, ds_config, hf_ds_config, validate
from autotune.drivers.sweep import best_of
from autotune.estimate import estimate
from autotune.pruning import (CAUSES, DEVICE_MEMORY, HOST_MEMORY, NVME_SPACE, Pruner, cause_counts, cause_of,
                              host_need_bytes)
from autotune.results import STATUSES, TrialResult
from autotune.rundir import RunDir, RunSettings
from autotune.study_storage import masked
from autotune.units import format_size

TOP = 10
OPTUNA_STRATEGIES = ("optuna", "optuna-gp", "hybrid")  # the strategies that keep an Optuna study
CLOSE_CALL = 0.13  # median throughput difference between two launches of one config here (ARCHITECTURE.md section 4)


@dataclass(frozen=True)
class Outputs:
    best: TrialResult | None
    summary: dict
    files: tuple[Path, ...]
    verdict: str  # one line: the recommendation, or why nothing fits


def summarize(results: Sequence[TrialResult], settings: RunSettings) -> dict:
    budget = settings.memory_budget_bytes
    best = best_of(results, budget)
    index = None
    if best is not None:
        index = next(i for i, r in enumerate(results, 1)
                     if r.fits(budget) and r.throughput >= best.throughput)
    counts = Counter(r.status for r in results)
    return {
        "best": None if best is None else {"config": best.config.to_dict(),
                                           "throughput_samples_per_s": best.throughput_samples_per_s,
                                           "peak_memory_bytes": best.peak_memory_bytes},
        "trials": len(results),
        "best_trial_index": index,
        "strategy": settings.strategy,
        "memory_budget_bytes": budget,
        "status_counts": {status: counts.get(status, 0) for status in STATUSES},
    }


def no_fit_verdict(settings: RunSettings, results: Sequence[TrialResult] = ()) -> str:
    """Why there is no recommendation, naming the resource that ran out: nothing in the space is predicted
    to fit (device memory, host memory for offloaded state, NVMe space), or no trial found one."""
    space = settings.space()
    pruner = Pruner.for_settings(settings)
    checks = {c: pruner.check(c, settings.backend) for c in space}
    budget = format_size(settings.memory_budget_bytes)
    if not checks:
        return f"no config fits: the space has no valid config for this workload (budget {budget})"
    predicted = sum(r is None for r in checks.values())
    if predicted:
        ran = cause_counts(r for r in results if r.status != "pruned")
        hit = f"; the trials ran out of {_cause_list(ran)}" if ran else ""
        advice = "run more trials" + (" or raise the budget" if ran and ran.most_common(1)[0][0] == DEVICE_MEMORY
                                      else "")
        return (f"no trial ran within the budget of {budget}, though {predicted} configs are predicted to fit"
                f"{hit}: {advice}")
    counts = cause_counts(r for r in checks.values() if r is not None)
    main = counts.most_common(1)[0][0]
    if main == DEVICE_MEMORY and len(counts) == 1:
        estimates = [pruner.predict(c) for c in checks]
        smallest = min(estimates, key=lambda e: e.peak_bytes)
        term = smallest.memory.dominant
        return (f"no config fits the budget of {budget}: the smallest predicted peak is "
                f"{format_size(smallest.peak_bytes)} ({smallest.config.label()}), dominated by {term} "
                f"({format_size(getattr(smallest.memory, term))}): raise the budget or use more devices")
    # Some configs fit the device but not the host (or the NVMe path): that, not the budget, is the limit.
    limits, fixes = [], []
    if counts[HOST_MEMORY]:
        host = [c for c, r in checks.items() if r is not None and cause_of(r) == HOST_MEMORY]
        need = {c: host_need_bytes(pruner.predict(c), settings.workload, settings.hardware) for c in host}
        least = min(host, key=need.__getitem__)
        limits.append(f"{counts[HOST_MEMORY]} need more host memory for offloaded state than the "
                      f"{format_size(settings.hardware.host_memory_bytes)} of one {settings.hardware.name} node "
                      f"(the least, {least.label()}, needs {format_size(need[least])})")
        fixes.append("a node with more host memory, more GPUs to shard the state over, or NVMe offload "
                     "(a space with an nvme_path)")
    if counts[NVME_SPACE]:
        limits.append(f"{counts[NVME_SPACE]} need more NVMe space than is free at {settings.choices.nvme_path}")
        fixes.append("more free space at the NVMe path")
    device = f"{counts[DEVICE_MEMORY]} configs are predicted over the {budget} device budget and the other " \
        if counts[DEVICE_MEMORY] else ""
    return (f"no config fits: {device}{' and '.join(limits)}; raising the budget would not help, "
            f"{' or '.join(fixes)} would")


def _cause_list(counts: Counter[str]) -> str:
    return ", ".join(f"{CAUSES[c]} ({n})" for c, n in counts.most_common())


def write_outputs(run: RunDir, settings: RunSettings, results: Sequence[TrialResult] | None = None) -> Outputs:
    from autotune import plots  # matplotlib takes a second or two to import: only when writing outputs

    results = run.results() if results is None else list(results)
    summary = summarize(results, settings)
    best = best_of(results, settings.memory_budget_bytes)
    files = [run.write_json("summary.json", summary)]
    run.plots_dir.mkdir(parents=True, exist_ok=True)
    files.append(plots.throughput_vs_memory(results, settings.memory_budget_bytes, best,
                                            run.plots_dir / "throughput_vs_memory.png"))
    files.append(plots.best_so_far(results, settings.memory_budget_bytes, run.plots_dir / "best_so_far.png"))
    if best is not None:
        options = DsOptions(nvme_path=settings.choices.nvme_path)
        ds = ds_config(best.config, settings.workload, options)
        validate(ds, settings.workload.gpus)
        files.append(run.write_json("best_ds_config.json", ds))
        files.append(run.write_json("best_hf_ds_config.json", hf_ds_config(best.config, settings.workload, options)))
        est = estimate(best.config, settings.workload, settings.hardware)
        files.append(plots.memory_breakdown(est, settings.memory_budget_bytes, best.peak_memory_bytes,
                                            run.plots_dir / "memory_breakdown.png"))
        verdict = (f"recommended {best.config.label()}: {best.throughput_samples_per_s:.3g} samples/s, "
                   f"peak {format_size(best.peak_memory_bytes)} of {format_size(settings.memory_budget_bytes)} "
                   f"(trial {summary['best_trial_index']})")
    else:
        verdict = no_fit_verdict(settings, results)
    report = run.path / "report.md"
    run.write_text("report.md", markdown(results, settings, summary, best, verdict, study=study_line(run, settings)))
    files.append(report)
    return Outputs(best, summary, tuple(files), verdict)


def study_line(run: RunDir, settings: RunSettings) -> str | None:
    """Where the Optuna study is and how its trial numbers map to this report's (strategies/optuna_search.py)."""
    if settings.strategy not in OPTUNA_STRATEGIES:
        return None
    storage = masked(settings.storage) or f"sqlite:///{run.study_path.resolve()}"
    return (f"- Optuna study: `{run.study_name(settings.storage)}` in `{storage}` (optuna-dashboard or the `optuna` "
            "CLI read it). Optuna numbers its trials from 0 and also keeps proposals that never ran (invalid "
            "combinations, repeats: PRUNED or FAIL); each trial's user attribute `report_trial` is its trial "
            "number in this report and trials.jsonl, and its knobs' values are user attributes under their names")


def markdown(results: Sequence[TrialResult], settings: RunSettings, summary: dict, best: TrialResult | None,
             verdict: str, study: str | None = None) -> str:
    w, budget = settings.workload, settings.memory_budget_bytes
    launched = [r for r in results if r.status != "pruned"]
    counts = ", ".join(f"{n} {s}" for s, n in summary["status_counts"].items() if n)
    lines = [
        f"# ds-autotune report: {w.model.name}",
        "",
        f"- Workload: {w.model.name} ({w.model.params / 1e6:,.1f}M parameters, seq {w.model.seq_len}), "
        f"global batch {w.global_batch}, {w.gpus} x {settings.hardware.name}",
        f"- Memory budget: {format_size(budget)} per device",
        f"- Strategy: {settings.strategy}, backend: {settings.backend}, seed {settings.seed}",
        f"- Trials: {len(results)} recorded, {len(launched)} launched ({counts or 'none'}); "
        f"trial time {sum(r.wall_time_s for r in results) / 60:.1f} min",
        *([study] if study else []),
        "",
        f"**{verdict[0].upper() + verdict[1:]}.**",
        "",
    ]
    if best is not None:
        lines += ["Use `best_ds_config.json` with `deepspeed.initialize(config=...)`, or `best_hf_ds_config.json` "
                  "with the Hugging Face Trainer / Accelerate (pass the same micro-batch, accumulation and "
                  "precision in the training arguments).", ""]
    lines += _top_table(results, budget)
    lines += _close_call(results, budget, settings.backend)
    lines += _failures(results)
    lines += ["## Plots", "", "![throughput against peak memory](plots/throughput_vs_memory.png)", "",
              "![best so far](plots/best_so_far.png)", ""]
    if best is not None:
        lines += ["![memory breakdown of the recommended config](plots/memory_breakdown.png)", ""]
    return "\n".join(lines)


def _top_table(results: Sequence[TrialResult], budget: int) -> list[str]:
    fitting = sorted((r for r in results if r.fits(budget)), key=lambda r: -r.throughput)
    if not fitting:
        return ["## Top configs", "", "No trial ran within the budget.", ""]
    lines = [f"## Top {min(TOP, len(fitting))} configs within budget", "",
             "| rank | trial | stage | micro | ckpt | precision | offload opt | offload param | samples/s | "
             "tokens/s | step s | peak | of budget | predicted peak |",
             "| ---: | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for rank, r in enumerate(fitting[:TOP], 1):
        c: Config = r.config
        predicted = r.extra.get("predicted_peak_bytes")
        lines.append(
            f"| {rank} | {r.extra.get('trial', '')} | {c.zero_stage} | {c.micro_batch} | {c.ckpt_interval} | "
            f"{c.precision} | {c.offload_optimizer} | {c.offload_param} | {r.throughput:.3g} | "
            f"{_num(r.tokens_per_s)} | {_num(r.step_time_s)} | {format_size(r.peak_memory_bytes)} | "
            f"{_pct(r.peak_memory_bytes, budget)} | {format_size(predicted)} |")
    return lines + [""]


def _close_call(results: Sequence[TrialResult], budget: int, backend: str) -> list[str]:
    fitting = sorted((r for r in results if r.fits(budget)), key=lambda r: -r.throughput)
    if backend != "deepspeed" or len(fitting) < 2:
        return []
    first, second = fitting[0], fitting[1]
    gap = first.throughput / second.throughput - 1
    if gap >= CLOSE_CALL:
        return []
    return [f"Close call: the runner-up ({second.config.label()}) is {gap:.0%} slower, less than the "
            f"{CLOSE_CALL:.0%} median difference between two launches of one config on a CPU box; "
            "re-measure both in fresh processes before relying on the order.", ""]


def _failures(results: Sequence[TrialResult]) -> list[str]:
    groups: dict[tuple[str, str], list[TrialResult]] = defaultdict(list)
    for r in results:
        if not r.ok:
            groups[(r.status, _cause(r.error))].append(r)
    if not groups:
        return ["## Failures and pruned configs", "", "None: every trial ran within the budget.", ""]
    lines = ["## Failures and pruned configs, by cause", "", "| status | cause | count | configs (first 3) |",
             "| --- | --- | ---: | --- |"]
    for (status, cause), group in sorted(groups.items(), key=lambda item: (item[0][0], -len(item[1]))):
        configs = "; ".join(f"#{r.extra.get('trial', '')} {r.config.label()}" for r in group[:3])
        lines.append(f"| {status} | {cause.replace('|', '/')} | {len(group)} | {configs} |")
    return lines + [""]


def _cause(error: str | None) -> str:
    """An error's first line with its numbers blanked, so that one cause groups its trials."""
    first = (error or "unknown").strip().splitlines()[0] if (error or "").strip() else "unknown"
    return re.sub(r"\d+(\.\d+)?(\s?[KMGT]i?B)?", "N", first)[:140]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _pct(part: int | None, whole: int) -> str:
    return "-" if not part else f"{part / whole:.0%}"
