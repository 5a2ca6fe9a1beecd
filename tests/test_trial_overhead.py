"""benchmarks/trial_overhead.py on a GPU machine, without one: `--hardware auto` resolves this machine's profile
(a CUDA one here, by a stubbed probe) and the report shows every phase, per variant and per trial, with the
model as built (issue 25: the phases per trial on CUDA as on the CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from autotune.values.config import Config
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult

ROOT = Path(__file__).resolve().parents[1]
PHASES = {"spawn_s": 0.1, "import_s": 3.7, "build_ops_s": 0.8, "dist_init_s": 0.0, "build_s": 0.3,
          "initialize_s": 6.1, "warmup_s": 2.6, "measure_s": 2.3}
BUILT = {"dtype": "bfloat16", "device": "cuda:0", "tensors": 148, "peak_growth_bytes": 2 * 2**30, "cast_or_moved": 0,
         "storage_kept": 0, "same_parameters": True}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("trial_overhead", ROOT / "benchmarks" / "trial_overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _result(config: Config) -> TrialResult:
    return TrialResult(config, "ok", throughput_samples_per_s=12.0, step_time_s=2.0, peak_memory_bytes=40 * 2**30,
                       wall_time_s=20.0, backend="deepspeed",
                       extra={"phases_s": PHASES, "build": BUILT, "launch_to_first_step_s": 13.6, "steps_measured": 3,
                              "step_time_iqr_s": 0.02, "stop_reason": "stable"})


def test_auto_hardware_on_a_gpu_machine_reports_every_phase(bench, monkeypatch, tmp_path):
    asked = []

    def resolve(choice, *, real):
        asked.append((choice, real))
        return PROFILES["h100-80gb"], None

    def run(rounds, workload, hardware, variants, logs):
        assert hardware.accelerator == "cuda" and workload.model.name == "llama-1b"
        return {name: [_result(bench.CONFIG) for _ in range(rounds)] for name in variants}

    monkeypatch.setattr(bench, "resolve_hardware", resolve)
    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(sys, "argv", ["trial_overhead.py", "--model", "llama-1b", "--variants", "ours", "--rounds", "2",
                                      "--out", str(tmp_path)])
    bench.main()
    assert asked == [("auto", True)]
    md = (tmp_path / "trial_overhead.md").read_text()
    assert "llama-1b" in md and "h100-80gb (cuda)" in md
    header = next(line for line in md.splitlines() if line.startswith("| variant | ok |"))
    assert all(f" {phase.removesuffix('_s')} |" in header for phase in bench.PHASES)
    trials = [line for line in md.splitlines() if line.startswith("| ours |")]
    assert len(trials) == 2  # one row per trial, only the variant asked for
    assert all("| 0.3 | 6.1 |" in line and "bfloat16 on cuda:0 | 2048 | 0 of 148 |" in line for line in trials)


def test_unknown_variant_is_refused(bench, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["trial_overhead.py", "--variants", "ours,pdsh"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
