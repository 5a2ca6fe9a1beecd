"""`autotune surface`: record a replay surface (every config of a space, run for real) and summarise one.

    autotune surface record --model tiny --space search_spaces/cpu.yaml --out surface.jsonl
    autotune surface show surface.jsonl [--memory-budget 1GiB]

`record` is resumable: configs already in the output file are skipped, so an interrupted recording
(Ctrl-C, a crash, a reboot) continues where it stopped; each result is fsync'd as soon as it is known.
A crashed trial is run again (`--retries`, default once), now or on resume; every attempt is kept.
Configs run in a shuffled order fixed by `--seed`, so that a partial surface covers the space evenly.
Each line also records the workload and the hardware profile (`workload`, `hardware` keys), which the
replay backend reads back. Record without a memory budget below the machine's memory: the replay backend
applies any search's budget to the recorded peaks afterwards.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autotune.values.argtypes import duration, output_dir, output_file, seed
from autotune.backends.factory import TrialOptions, backend_names, make_backend
from autotune.backends.replay import load_surface
from autotune.values.config import Config, ConfigError, first_line
from autotune.commands.common import (add_json_argument, add_workload_arguments, emit_json, json_command, make_dir,
                                      positive_int, size, space_from, target_from)
from autotune.files import is_file
from autotune.values.results import STATUSES, TrialResult, read_results
from autotune.values.settings import RunSettings, memory_budget
from autotune.drivers.recording import Recorded, RecordingInterrupted, describe_workload, record_surface
from autotune.trials.interrupts import stop_signals_as_interrupt
from autotune.values.units import counted, format_size
from autotune.worker.measure import MeasureSettings

BACKENDS = backend_names(sweep=None, measures=True)  # replay reads a surface; script mode is `autotune tune --script`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="surface_command", required=True, parser_class=type(parser),
                                metavar="{record,show}")  # what a missing one's error names
    record = sub.add_parser("record", help="run every config of a space and append each result to a JSONL surface")
    add_workload_arguments(record)
    record.add_argument("--out", type=output_file, required=True,
                        help="surface file (JSONL); an existing one is resumed")
    record.add_argument("--backend", choices=BACKENDS, default="deepspeed",
                        help="deepspeed: real trials (default); simulated: the estimator, for quick experiments")
    record.add_argument("--memory-budget", type=size, default=None,
                        help="per-device budget the trials run under (default: the hardware's memory)")
    record.add_argument("--timeout", type=duration, default=None,
                        help="time per trial before it is ended, e.g. 600 (seconds) or 10m")
    record.add_argument("--logs", type=output_dir, default=None,
                        help="deepspeed: directory of the trials' logs (default: <out without .jsonl>.logs)")
    record.add_argument("--limit", type=positive_int, default=None, help="record at most this many new configs")
    record.add_argument("--max-steps", type=positive_int, default=10,
                        help="deepspeed: measured optimizer steps at most per trial (default: %(default)s)")
    record.add_argument("--max-measure-s", type=duration, default=30.0,
                        help="deepspeed: seconds of measured steps at most per trial, at least one step "
                             "(default: %(default)s; a surface has hundreds of trials)")
    record.add_argument("--seed", type=seed, default=0,
                        help="order in which configs run, 0 to 2**32-1 (default: %(default)s)")
    record.add_argument("--retries", type=int, default=1, choices=range(0, 4), metavar="{0..3}",
                        help="times a crashed trial is run again (default: %(default)s)")
    record.add_argument("--repeats", type=int, default=1, choices=range(1, 10), metavar="{1..9}",
                        help="measurements of each config, taken in passes over the configs; replay uses "
                             "each config's median (default: %(default)s)")
    record.add_argument("--configs", type=Path, default=None,
                        help="record only the configs of this JSONL file (a surface, trials.jsonl, or one "
                             "config object per line), e.g. to measure the fastest ones again")
    add_json_argument(record)
    record.set_defaults(_surface=run_record, _prog=record.prog)  # errors name "autotune surface record"
    show = sub.add_parser("show", help="summarise a surface: statuses, and the fastest configs within a budget")
    show.add_argument("surface", type=Path)
    show.add_argument("--memory-budget", type=size, default=None, help="budget to apply (default: none)")
    show.add_argument("--top", type=positive_int, default=10)
    add_json_argument(show)
    show.set_defaults(_surface=run_show, _prog=show.prog)


@json_command
def run(args: argparse.Namespace) -> int:
    return args._surface(args)


# -- record -----------------------------------------------------------------------------------------

def run_record(args: argparse.Namespace) -> int:
    target = target_from(args, real=args.backend == "deepspeed")
    workload, hardware = target.workload, target.hardware
    space = space_from(args, workload, hardware)
    budget = memory_budget(args.memory_budget, hardware)
    logs = args.logs or args.out.parent / f"{args.out.stem}.logs"
    # A recording runs every config of the space: a grid, in the order `record` shuffles.
    settings = RunSettings(workload, hardware, budget, "grid", args.backend, args.seed, space.choices)
    defaults = MeasureSettings()
    measure = MeasureSettings(defaults.warmup_steps, min(defaults.min_steps, args.max_steps), args.max_steps,
                              defaults.rel_tol, args.max_measure_s)
    only = None if args.configs is None else configs_in(args.configs, space)
    make_dir(args.out.parent, "--out")  # every input checked: now the surface's folder may be created
    before = len(read_results(args.out))  # the lines already there (record_surface refuses a file it cannot read)
    # A recording runs its trials one after another here: the next trial's ranks start ahead from its first.
    backend = make_backend(settings, options=TrialOptions(str(logs), args.timeout, measure, in_sequence=True))
    console = Console(highlight=False, soft_wrap=True)
    # Progress (the machine found, op builds, a line a config) unsaid under --quiet; the totals below are results.
    say = (lambda *_: None) if getattr(args, "quiet", False) else console.print
    if target.detected():
        say(target.detected())
    try:
        with stop_signals_as_interrupt():  # a process manager's SIGTERM, a closed terminal: as Ctrl-C
            preflight = getattr(backend, "preflight", None)
            if preflight is not None:  # the C++ ops the configs need, built before the first trial (trials.ops)
                preflight(list(space) if only is None else only, say)
            done = record_surface(space, backend, args.out, order_seed=args.seed, limit=args.limit,
                                  retries=args.retries, repeats=args.repeats, only=only, progress=say)
    except RecordingInterrupted as stop:  # every finished trial is in the file: the same command skips them
        part = stop.recorded
        counts = RecordCounts.read(args.out, before, space)
        print(f"{args._prog}: interrupted: {counts.now(part, args.repeats)} in {args.out}, "
              f"{counts.measured(part, part.total_measured + stop.left, args.repeats, only)}; the same command "
              "records the rest", file=sys.stderr)
        if args.json:
            emit_json(args, {"surface": str(args.out), **part.to_dict(), **counts.to_dict(), "left": stop.left,
                             "interrupted": True})
        return 130
    finally:
        backend.close()  # the next trial's ranks, started ahead for a trial that will not come
    counts = RecordCounts.read(args.out, before, space)
    console.print(f"{args.out}: {counts.now(done, args.repeats)}, "
                  f"{counts.measured(done, len(space) if only is None else len(only), args.repeats, only)}"
                  + (f"; the surface holds {counts.surface_configs} of the space's {len(space)} configs"
                     if only is not None else ""))
    if done.fatal:
        console.print(f"stopped: {done.fatal}")
    if args.json:
        emit_json(args, {"surface": str(args.out), "workload": workload.to_dict(), "hardware": hardware.name,
                         "backend": args.backend, **done.to_dict(), **counts.to_dict(), "configs": len(space),
                         "selected": None if only is None else len(only),
                         "logs": str(logs) if args.backend == "deepspeed" else None})
    return 1 if done.fatal else 0


class RecordCounts:
    """What this call added to the surface, read back from the file (read_results) past the `before` lines it held:
    `Recorded.recorded` counts configs run to an end once per pass, so with --repeats it is trials, not configs."""

    def __init__(self, new: list[TrialResult], surface_configs: int) -> None:
        self.trials = len(new)  # lines appended: every measurement and every crashed attempt
        self.configs = len({r.config for r in new})
        self.surface_configs = surface_configs  # configs of the space with at least one line in the file

    @classmethod
    def read(cls, out: Path, before: int, space) -> "RecordCounts":
        results = read_results(out)
        return cls(results[before:], len({r.config for r in results if r.config in space}))

    def now(self, done: Recorded, repeats: int) -> str:
        if repeats == 1:  # one trial a config (a crash's retries aside): configs run to an end
            return f"{counted(done.recorded, 'config')} recorded now"
        return f"{counted(self.trials, 'trial')} of {counted(self.configs, 'config')} recorded now"

    def measured(self, done: Recorded, of: int, repeats: int, only: list[Config] | None) -> str:
        times = f" {repeats} times" if repeats > 1 else ""
        return (f"{done.total_measured} of {of} measured{times}" if only is None
                else f"{done.total_measured} of the {counted(of, 'config')} of --configs measured{times}")

    def to_dict(self) -> dict[str, int]:
        return {"trials": self.trials, "trial_configs": self.configs, "surface_configs": self.surface_configs}


def configs_in(path: Path, space) -> list[Config]:
    """The configs named in a JSONL file (lines with a "config" object, or config objects), each of `space`."""
    if not is_file(path):
        if path.is_dir():
            raise ConfigError(f"--configs {str(path)!r} is a directory: name a JSONL file of configs")
        raise ConfigError(f"--configs {str(path)!r}: no such file")
    configs: list[Config] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            config = Config.from_dict(data["config"] if isinstance(data, dict) and "config" in data else data)
        except (ValueError, TypeError, KeyError, ConfigError) as err:
            raise ConfigError(f"--configs {path}:{n}: not a config ({first_line(err)}); expected a JSON object "
                              f"of knob values, or a result line with one under \"config\"") from None
        if config not in space:
            raise ConfigError(f"--configs {path}:{n}: {config.label()} is not a config of the space recorded "
                              f"({space.invalid_reason(config) or 'not one of its combinations'})")
        if config not in configs:
            configs.append(config)
    if not configs:
        raise ConfigError(f"--configs {path}: no configs in it")
    return configs


# -- show -------------------------------------------------------------------------------------------

def run_show(args: argparse.Namespace) -> int:
    surface = load_surface(args.surface)
    budget = args.memory_budget
    results = [r.under_budget(budget) for r in surface.results.values()]
    console = Console(highlight=False, soft_wrap=True)
    workload = surface.workload
    who = "unknown workload" if workload is None else describe_workload(workload.to_dict())
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    console.print(f"{args.surface}: {counted(len(results), 'config')} of {who} on {surface.hardware or 'unknown hardware'}; "
                  + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
                  + (f" under a budget of {format_size(budget)}" if budget else ""))
    notes = [*surface.notes, *([f"{args.surface}: {surface.mixed}: replay refuses it"] if surface.mixed else [])]
    for note in notes:  # --json carries them too (`notes`, `mixed`)
        console.print(note)
    ranked = sorted((r for r in results if r.ok), key=lambda r: -(r.throughput_samples_per_s or 0))
    table = Table(title=f"Fastest {counted(min(args.top, len(ranked)), 'config')}" + (f" within {format_size(budget)}" if budget
                                                                           else ""))
    for column in ("#", "config", "samples/s", "step s", "peak", "trial s"):
        table.add_column(column, justify="right" if column != "config" else "left")
    if args.json:
        emit_json(args, {"surface": str(args.surface), "workload": None if workload is None else workload.to_dict(),
                         "hardware": surface.hardware, "configs": len(results), "status_counts": counts,
                         "notes": notes, "mixed": surface.mixed,
                         "memory_budget_bytes": budget,
                         "fastest": [dict(r.to_dict(), rank=i, label=r.config.label())
                                     for i, r in enumerate(ranked[:args.top], 1)]})
        return 0
    for i, r in enumerate(ranked[:args.top], 1):
        # fixed decimals: a column whose figures line up (".4g" printed 49.1 over 46.49)
        table.add_row(str(i), r.config.label(), f"{r.throughput_samples_per_s:,.2f}", f"{r.step_time_s or 0:.3f}",
                      format_size(r.peak_memory_bytes), f"{r.wall_time_s:.1f}")
    console.print(table)
    return 0
