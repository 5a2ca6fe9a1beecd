"""Times `autotune estimate` over the whole default space of a 7B-class workload (goal: under 2 s).

Prints configs per second: in-process ranking (median of 5 runs) and the whole command as a user runs
it (process start and imports included, median of 3). Writes benchmarks/results/estimate_speed.md.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from autotune.prediction.ranking import rank_configs as rank
from autotune.values.hardware import PROFILES
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.values.workload import make_workload

RESULTS = Path(__file__).parent / "results"
ARGS = ["--model", "llama-7b", "--gpus", "8", "--global-batch", "512", "--hardware", "a100-80gb",
        "--space", "default"]


def main() -> None:
    workload = make_workload("llama-7b", 512, 8)
    hardware = PROFILES["a100-80gb"]
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        space = Space(load_choices("default"), workload, hardware)  # enumeration included
        ranking = rank(space, hardware.memory_bytes)
        timings.append(time.perf_counter() - start)
    configs = len(ranking.space)
    in_process = statistics.median(timings)
    command = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "autotune.cli", "estimate", *ARGS], check=True,
                       capture_output=True)
        command.append(time.perf_counter() - start)
    whole = statistics.median(command)
    rows = [
        ("configs in the default space (llama-7b, 8 x a100-80gb, batch 512)", f"{configs}"),
        ("predicted to fit", f"{len(ranking.fits)}"),
        ("enumerate + estimate + rank, median of 5", f"{in_process * 1000:.1f} ms"),
        ("configs per second (in process)", f"{configs / in_process:,.0f}"),
        ("`autotune estimate` command, median of 3 (process start and imports included)", f"{whole:.2f} s"),
    ]
    lines = ["# estimate speed\n", f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
             f"python {platform.python_version()}; command: autotune estimate {' '.join(ARGS)}\n",
             "| measure | value |", "| --- | --- |", *(f"| {a} | {b} |" for a, b in rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "estimate_speed.md").write_text(text)


if __name__ == "__main__":
    main()
