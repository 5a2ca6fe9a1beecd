"""`autotune` command line: one module per command under autotune/commands."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from autotune.config import ConfigError

# command name -> module under autotune.commands exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "estimate": "Predict memory and throughput of every config of a space, before running anything.",
    "tune": "Search for the fastest config within a memory budget; resumable; writes the recommendation and a report.",
    "report": "Regenerate a sweep's summary, recommended configs, report.md and plots from its run directory.",
    "trial": "Run one real DeepSpeed trial of one config; print its measurements next to the estimator's prediction.",
    "surface": "Record a replay surface (every config of a space, run for real; resumable), or summarise one.",
    "rl": "Train the RL policy with RLlib (PPO) on the simulated environment, resumably; export a checkpoint's policy.",
    "sweep": "Tune many workloads of a sweep YAML at once on a Ray cluster; one run directory each and a summary table.",
}


class ArgumentParser(argparse.ArgumentParser):
    """Bad input is one line naming the value, and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="autotune", description="Find the fastest DeepSpeed memory config that fits.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"autotune.commands.{name.replace('-', '_')}")
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(_run=module.run, _prog=command.prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ConfigError as err:
        print(f"{args._prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{args._prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
