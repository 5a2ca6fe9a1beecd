"""`autotune estimate`: every config of the space, predicted; those that fit ranked by throughput,
those that do not grouped by the memory term that breaks the budget. A config fits when its predicted peak is
within the budget and its offloaded state within the profile's host memory per node (host_need_bytes, the
figure tune's pruner and the simulated backend judge host memory by): one within the budget but over host
memory is counted apart, in one line, and not ranked. With --calibration (a run directory
or its calibration.json), predicted with that calibration, each peak with its 90% interval and probability of
fitting (autotune.prediction.uncertainty: wide for knob values that run's trials did not cover)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from autotune.values.allocator import describe as describe_allocator
from autotune.commands.common import (add_json_argument, add_workload_arguments, emit_json, json_command, positive_int,
                                      size, space_from, target_from)
from autotune.prediction.estimate import MEMORY_TERMS, Calibration, Estimate, host_need_bytes, over_host_memory
from autotune.values.hardware import Hardware, sold_size_note
from autotune.search.pruning import Pruner
from autotune.prediction.ranking import Ranking, rank_configs
from autotune.search_spaces import space_note
from autotune.values.settings import memory_budget
from autotune.values.units import counted, format_size, format_span


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    # tune's name for the same idea; --gpu-memory, its first name here, still works
    parser.add_argument("--memory-budget", "--gpu-memory", dest="memory_budget", type=size, default=None,
                        help="memory budget per device, e.g. 32GiB (2**30), 32GB or 32000MB (10**9, 10**6), at most the"
                             " hardware's memory (default: the hardware's memory)")
    parser.add_argument("--top", type=positive_int, default=10, help="rows of the ranking to show (default: 10)")
    parser.add_argument("--calibration", type=Path, default=None, metavar="PATH",
                        help="a run directory (its calibration.json and trials) or a calibration file: predict with "
                             "that calibration and show each peak's 90%% interval and probability of fitting")
    add_json_argument(parser)


@json_command
def run(args: argparse.Namespace) -> int:
    target = target_from(args, real=False)
    workload, hardware = target.workload, target.hardware
    budget = memory_budget(args.memory_budget, hardware)
    pruner = Pruner.from_run(args.calibration, workload, hardware, budget) if args.calibration else None
    space = space_from(args, workload, hardware)
    ranking = rank_configs(space, budget, pruner.calibration if pruner else Calibration())
    note = space_note(hardware, space.choices)
    sold = sold_size_note(hardware) if args.memory_budget is None else None
    if args.json:
        out = as_json(ranking, hardware, args.top, pruner)
        if target.machine is not None:
            out["detected"] = {"machine": target.machine.describe(), "hardware": hardware.to_dict()}
        if note is not None:
            out["note"] = note
        if sold is not None:
            out["budget_note"] = sold
        emit_json(args, out)
    else:
        console = Console()  # the terminal's width (COLUMNS where set): a narrow one folds the table's columns
        for line in () if getattr(args, "quiet", False) else (target.detected(), note):  # notes; the tables: results
            if line:
                console.print(line, soft_wrap=True)  # prose: one line each, the terminal folds it
        show(ranking, hardware, args.top, pruner, console)
        if sold and not getattr(args, "quiet", False):  # under the ranking its budget made
            console.print(sold, soft_wrap=True)
    return 0


def _uncertain(pruner: Pruner | None, est: Estimate) -> dict:
    """A calibrated prediction's 90% peak interval and probability of fitting (none without a calibration)."""
    if pruner is None:
        return {}
    forecast = pruner.forecast(est.config)
    low, high = forecast.peak_interval()
    return {"peak_interval_bytes": [int(low), int(high)], "fit_probability": forecast.fit_probability(pruner.budget_bytes)}


def host_split(ranking: Ranking, hardware: Hardware) -> tuple[Ranking, tuple[Estimate, ...]]:
    """`ranking` without the configs within the budget whose offloaded state is predicted over the profile's host
    memory (all of a node's ranks together: host_need_bytes), and those, smallest host need first. Such a config
    does not run: the simulated backend fails it out of host memory and tune's pruner then drops every config of
    no smaller need (autotune.search.pruning)."""
    workload = ranking.space.workload
    kept: list[Estimate] = []
    over_host: list[Estimate] = []
    for e in ranking.fits:  # one pass, the ranking's order kept
        (over_host if over_host_memory(e, workload, hardware) else kept).append(e)
    over_host.sort(key=lambda e: host_need_bytes(e, workload, hardware))
    return replace(ranking, fits=tuple(kept)), tuple(over_host)


def over_host_line(over_host: tuple[Estimate, ...], ranking: Ranking, hardware: Hardware) -> str | None:
    """'27 configs within the budget but over host memory, not ranked (...needs at least 1.13 TiB per node of the
    a100-40gb profile's 1 TiB: z3 mb4 ...)', or None where there are none."""
    if not over_host:
        return None
    need = host_need_bytes(over_host[0], ranking.space.workload, hardware)
    return (f"{counted(len(over_host), 'config')} within the budget but over host memory, not ranked (their offloaded state needs "
            f"at least {format_size(need)} per node of the {hardware.name} profile's "
            f"{format_size(hardware.host_memory_bytes)}: {over_host[0].config.label()})")


def nothing_fits_line(ranking: Ranking, over_host: tuple[Estimate, ...], hardware: Hardware) -> str:
    """Why no config is predicted to fit, in one line: the host memory the configs within the budget need, and the
    smallest predicted peak of the others against the budget (`ranking` and `over_host` as host_split returns
    them). Each with how much it is over: 40.2 GiB and 40 GiB both print as '40 GiB'."""
    reasons = []
    if over_host:
        need = host_need_bytes(over_host[0], ranking.space.workload, hardware)
        limit = hardware.host_memory_bytes
        reasons.append(f"{'the' if ranking.too_big else 'all'} {counted(len(over_host), 'config')} within the budget of "
                       f"{format_size(ranking.budget_bytes)} per device need at least {format_size(need)} of host "
                       f"memory per node for their offloaded state ({over_host[0].config.label()}), "
                       f"{format_size(need - limit)} over the {hardware.name} profile's {format_size(limit)}")
    if ranking.too_big:
        best = ranking.too_big[0]  # smallest peak first
        others = f"the other {counted(len(ranking.too_big), 'config')}' " if over_host else "the "
        reasons.append(f"{others}smallest predicted peak is {format_size(best.peak_bytes)} "
                       f"({best.config.label()}), {format_size(best.peak_bytes - ranking.budget_bytes)} over the "
                       f"budget of {format_size(ranking.budget_bytes)} per device")
    return "no config is predicted to fit: " + "; ".join(reasons)


def as_json(ranking: Ranking, hardware: Hardware, top: int, pruner: Pruner | None = None) -> dict:
    """The ranking as `--json` prints it (docs/estimate.md): configs over host memory are not in "fit" but in
    "over_host_memory"; so fit_count + over_host_memory.count + the do_not_fit counts = configs."""
    workload = ranking.space.workload
    ranking, over_host = host_split(ranking, hardware)
    smallest = over_host[0] if over_host else None
    return {
        "workload": workload.to_dict(),
        "hardware": hardware.name,
        "memory_budget_bytes": ranking.budget_bytes,
        "host_memory_bytes": hardware.host_memory_bytes,
        "configs": len(ranking.space),
        "fit": [dict(e.to_dict(), gradient_accumulation_steps=workload.grad_accumulation(e.config.micro_batch),
                     host_need_bytes=host_need_bytes(e, workload, hardware), **_uncertain(pruner, e))
                for e in ranking.fits[:top]],
        "fit_count": len(ranking.fits),
        "do_not_fit": [{"term": term, "count": len(group), "smallest_peak_bytes": group[0].peak_bytes,
                        "config": group[0].config.to_dict()} for term, group in ranking.groups()],
        "over_host_memory": {"count": len(over_host),
                             "smallest_need_bytes": host_need_bytes(smallest, workload, hardware) if smallest else None,
                             "config": smallest.config.to_dict() if smallest else None},
        "nothing_fits": None if ranking.fits else nothing_fits_line(ranking, over_host, hardware),
    }


def _interval_cells(pruner: Pruner | None, est: Estimate) -> tuple[str, ...]:
    if pruner is None:
        return ()
    found = _uncertain(pruner, est)
    low, high = found["peak_interval_bytes"]
    return format_span(low, high), f"{found['fit_probability']:.0%}"


def _short(term: str) -> str:
    names = {"optimizer_states": "optim", "activations": "activ", "allocator_reserve": "reserve",
             "outside_allocator": "outside"}
    return names.get(term, term)


# The knobs' columns: full names, or the config label's own abbreviations (z2 mb4 ck1 oo=cpu op=cpu) where narrow.
KNOB_COLUMNS = {True: ("stage", "micro", "accum", "ckpt", "prec", "off opt", "off par"),
                False: ("z", "mb", "acc", "ck", "prec", "oo", "op")}


def fit_table(ranking: Ranking, top: int, pruner: Pruner | None, *, terms: bool, label: bool = False) -> Table:
    """The configs predicted to fit, fastest first: each memory term a column too (`terms`), else only the peak,
    the host memory and the throughput, with short headers: 80 columns wide; `label`: the knobs as one column, the
    config's label (z2 mb4 ck1 bf16 oo=cpu), where even that is too wide. A column too narrow folds, never cut."""
    workload = ranking.space.workload
    title = f"Top {counted(min(top, len(ranking.fits)), 'config')} predicted to fit, fastest first"
    table = Table(title=title, show_edge=False)
    knobs = ("config", "acc") if label else KNOB_COLUMNS[terms]
    for column in ("#", *knobs, "peak", *(_short(t) for t in MEMORY_TERMS if terms), "host",
                   *(("step s",) if terms else ()), "samples/s", *(("peak 90%", "fits") if pruner else ())):
        table.add_column(column, justify="left" if column == "config" else "right", overflow="fold")
    for i, est in enumerate(ranking.fits[:top], 1):
        c, mem = est.config, est.memory
        accumulation = str(workload.grad_accumulation(c.micro_batch))
        knob_cells = (c.label(), accumulation) if label else (
            str(c.zero_stage), str(c.micro_batch), accumulation, str(c.ckpt_interval), c.precision,
            c.offload_optimizer, c.offload_param)
        table.add_row(str(i), *knob_cells,
                      format_size(est.peak_bytes), *(format_size(getattr(mem, t)) for t in MEMORY_TERMS if terms),
                      format_size(est.host_bytes), *((f"{est.step_time_s:.3g}",) if terms else ()),
                      f"{est.throughput_samples_per_s:.3g}", *_interval_cells(pruner, est))
    return table


def natural_width(console: Console, table: Table) -> int:
    """The width the table takes unwrapped (rich's own measure is capped at the console's width)."""
    return Measurement.get(console, console.options.update(max_width=2**16), table).maximum


def show(ranking: Ranking, hardware: Hardware, top: int, pruner: Pruner | None = None,
         console: Console | None = None) -> None:
    console = console or Console()
    workload = ranking.space.workload
    ranking, over_host = host_split(ranking, hardware)
    model = workload.model
    active = f" ({model.active_params / 1e6:,.1f}M active per token)" if model.moe else ""  # experts: a share computes
    console.print(f"{model.name}: {model.params / 1e6:,.1f}M parameters{active}, seq {model.seq_len}, global "
                  f"batch {workload.global_batch}, "
                  f"{workload.gpus} x {hardware.name}, budget {format_size(ranking.budget_bytes)} per device; "
                  f"{len(ranking.space)} valid configs, {len(ranking.fits)} predicted to fit", soft_wrap=True)
    if not hardware.is_cpu:  # the reserve column depends on it (autotune.prediction.cuda_memory)
        console.print(f"allocator: {describe_allocator(hardware.allocator)}", soft_wrap=True)
    if not ranking.fits:  # one line saying why, not an empty table
        console.print(nothing_fits_line(ranking, over_host, hardware), soft_wrap=True)
    else:
        line = over_host_line(over_host, ranking, hardware)
        if line:
            console.print(line, soft_wrap=True)
        table = fit_table(ranking, top, pruner, terms=True)
        if natural_width(console, table) > console.width:  # too wide for this terminal: a column for each config
            table = fit_table(ranking, top, pruner, terms=False)
            if natural_width(console, table) > console.width:  # the 90% intervals beside: the knobs as one label
                table = fit_table(ranking, top, pruner, terms=False, label=True)
            table.caption = "memory terms and step times: --json, or a wider terminal (COLUMNS=200)"
        console.print(table)
    if not ranking.too_big:
        return
    groups = Table(title=f"{counted(len(ranking.too_big), 'config')} predicted not to fit, by the term that breaks the budget",
                   show_edge=False)
    for column in ("dominant term", "configs", "smallest peak", "its config"):
        groups.add_column(column, overflow="fold")
    for term, group in ranking.groups():
        best = group[0]
        groups.add_row(term, str(len(group)), format_size(best.peak_bytes), best.config.label())
    console.print(groups)


