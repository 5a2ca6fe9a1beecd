"""bf16 against fp32 on this CPU: the factor behind `autotune.values.hardware.EMULATED_BF16_SLOWDOWN` (issue 24).

Times one training step (forward and backward, one rank, one thread) of the built-in `tiny` model, as a
trial trains it, in fp32 and in bf16, each in a child process, median of several steps after a warm-up step:
- as this CPU runs it (oneDNN with whatever bf16 instructions the CPU has);
- with oneDNN capped at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`, oneDNN's documented cap): bf16 as a CPU without
  AVX-512 BF16 or AMX runs it, e.g. the AMD EPYC (AVX2 only) machines of this workplace. On such a machine
  the two rows agree; on a Xeon with AMX the second shows what an AVX2-only CPU pays.
It also prints what `autotune.trials.devices.cpu_bf16` reads off this machine. Writes benchmarks/results/cpu_bf16.md
and .json. Usage: python benchmarks/cpu_bf16.py [--steps 3] [--micro-batch 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

from autotune.trials.devices import cpu_bf16, cpu_flags, cpu_model
from autotune.values.hardware import EMULATED_BF16_SLOWDOWN

RESULTS = Path(__file__).parent / "results"
CAPS = {"this CPU as it is": {}, "oneDNN capped at AVX2 (an AVX2-only CPU)": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
STEP = """
import json, statistics, sys, time, torch
from autotune.values.workload import make_workload
from autotune.worker.model import GPT, synthetic_batch
torch.set_num_threads(1)
dtype, micro_batch, steps = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
shape = make_workload("tiny").model
torch.manual_seed(0)
model = GPT(shape, 0).to(dtype)
tokens, targets = synthetic_batch(shape, micro_batch, torch.Generator().manual_seed(0), torch.device("cpu"))
times = []
for _ in range(steps + 1):  # the first: warm-up (oneDNN's kernels are made on first use)
    start = time.perf_counter()
    model(tokens, targets).backward()
    times.append(time.perf_counter() - start)
print(json.dumps(statistics.median(times[1:])))
"""


def step_time(dtype: str, micro_batch: int, steps: int, env: dict[str, str]) -> float:
    import os

    done = subprocess.run([sys.executable, "-c", STEP, dtype, str(micro_batch), str(steps)], check=True,
                          capture_output=True, text=True, env={**os.environ, **env})
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    flags = cpu_flags() or frozenset()
    rows = []
    for name, env in CAPS.items():
        fp32 = step_time("float32", args.micro_batch, args.steps, env)
        bf16 = step_time("bfloat16", args.micro_batch, args.steps, env)
        rows.append({"run": name, "fp32_s": fp32, "bf16_s": bf16, "bf16_over_fp32": bf16 / fp32})
        print(f"{name}: fp32 {fp32:.3f} s, bf16 {bf16:.3f} s per step ({bf16 / fp32:.2f}x fp32's time)", flush=True)
    found = {"cpu": cpu_model(), "cpu_bf16": cpu_bf16(),
             "bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"}), "python": platform.python_version(),
             "micro_batch": args.micro_batch, "steps": args.steps, "rows": rows,
             "emulated_bf16_slowdown_in_use": EMULATED_BF16_SLOWDOWN}
    lines = ["# bf16 against fp32 on the CPU", "",
             f"CPU: {found['cpu']}; `autotune.trials.devices.cpu_bf16()`: **{found['cpu_bf16']}** (bf16 flags: "
             f"{', '.join(found['bf16_flags']) or 'none'}). One training step of `tiny` (4.3M parameters, seq 256, "
             f"micro-batch {args.micro_batch}), one thread, median of {args.steps} steps after a warm-up step.", "",
             "| run | fp32 s/step | bf16 s/step | bf16 time / fp32 time |", "| --- | ---: | ---: | ---: |",
             *(f"| {r['run']} | {r['fp32_s']:.3f} | {r['bf16_s']:.3f} | {r['bf16_over_fp32']:.2f} |" for r in rows), "",
             f"The estimator prices emulated bf16 {EMULATED_BF16_SLOWDOWN:.0f}x slower than fp32 "
             "(`autotune.values.hardware.EMULATED_BF16_SLOWDOWN`); native bf16 keeps the profile's figure until calibration "
             "fits it.", ""]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_bf16.md").write_text(text)
    (RESULTS / "cpu_bf16.json").write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
