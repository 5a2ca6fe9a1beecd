"""The GPU validation kit (benchmarks/gpu_validation.py, scripts/gpu-bundle, scripts/gpu-validate): its pure
logic on hand-made inputs, its refusals, that it runs without Ray, and (slow) the whole kit on the CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.values.config import Config
from autotune.trials.devices import LocalMachine
from autotune.values.hardware import PROFILES
from autotune.values.results import STATUSES, TrialResult, read_results
from autotune.values.space import Choices, Space
from autotune.values.workload import PRESETS, Workload

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "benchmarks" / "gpu_validation.py"
SURFACE = ROOT / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
MiB = 2**20


def _load_kit():
    spec = importlib.util.spec_from_file_location("gpu_validation", KIT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_validation", module)
    spec.loader.exec_module(module)
    return module


g = _load_kit()
H100 = PROFILES["h100-80gb"].with_(memory_bytes=81559 * MiB)  # as an H100 80GB HBM3 reports itself


def ok(config: Config, peak_mib: float, throughput: float = 10.0, wall: float = 5.0, **extra) -> TrialResult:
    return TrialResult(config, "ok", throughput_samples_per_s=throughput, step_time_s=1.0,
                       peak_memory_bytes=int(peak_mib * MiB), wall_time_s=wall, extra=extra)


def oom(config: Config, wall: float = 5.0) -> TrialResult:
    return TrialResult(config, "oom", wall_time_s=wall, error="CUDA out of memory")


# -- choosing the workloads --------------------------------------------------------------------------------

def test_an_80gb_gpu_gets_a_1b_and_a_3b_model_with_the_cliff_inside_the_space():
    small, large = g.choose_gpu_models(H100)
    assert (small.name, large.name) == ("llama-1b", "llama-3b")
    assert 0.9e9 < small.params < 1.5e9 and 2.5e9 < large.params < 7.5e9
    for shape in (small, large):
        share = g.fit_share(shape, H100, H100.memory_bytes, g.GPU_CHOICES, g.GPU_GLOBAL_BATCH)
        assert 0 < share < 1


def test_workloads_follow_the_device_memory():
    l4 = g.choose_gpu_models(PROFILES["l4"])
    h200 = g.choose_gpu_models(PROFILES["h200"])
    h100 = g.choose_gpu_models(H100)
    assert [s.params for s in l4] < [s.params for s in h100] < [s.params for s in h200]
    for models in (l4, h100, h200):
        assert len(set(models)) == 2 and models[0].params < models[1].params


def test_a_model_without_a_cliff_in_the_space_is_not_chosen():
    # gpt2-small fits every config of an 80 GB card: nearest to a tiny target, but no cliff to validate.
    small = PRESETS["gpt2-small"]
    assert g.fit_share(small, H100, H100.memory_bytes, g.GPU_CHOICES, 32) == 1.0
    chosen = g.choose_gpu_models(H100, [small, PRESETS["llama-1b"], g.LLAMA_3B], fractions=(0.001,))
    assert chosen == (PRESETS["llama-1b"],)


# -- which configs to run ----------------------------------------------------------------------------------

def gpu_space(shape=PRESETS["llama-1b"]) -> Space:
    return Space(g.GPU_CHOICES, Workload(shape, g.GPU_GLOBAL_BATCH), H100)


def test_balanced_layouts_spread_every_prefix_over_the_knobs():
    space = gpu_space()
    order = g.balanced_layouts(space, seed=0)
    assert sorted(order) == sorted({g.layout(c) for c in space}) and len(order) == len(set(order))
    first = order[:4]
    assert {key[0] for key in first} == {0, 1, 2, 3}  # every ZeRO stage among the first four
    assert {key[1] for key in order[:2]} == {0, 1} and {key[2] for key in order[:2]} == {"bf16", "fp16"}
    assert g.balanced_layouts(space, seed=0) == order
    assert any(g.balanced_layouts(space, seed=s) != order for s in range(1, 5))


def test_balanced_layouts_prefer_a_cliff_inside_among_equals():
    space = gpu_space()
    plain = g.balanced_layouts(space, seed=0)
    wanted = plain[1]
    assert g.balanced_layouts(space, seed=0, inside=lambda key: key == wanted)[0] == wanted


def layout_configs(*mbs: int, zero: int = 0) -> list[Config]:
    return [Config(zero, mb, 0, "bf16") for mb in mbs]


@pytest.mark.parametrize("limit, expected", [(2, [2, 4]), (8, [4, 8]), (0, [1, 2]), (4, [4, 8])])
def test_bracket_is_the_predicted_cliff_and_the_next_micro_batch(limit, expected):
    configs = layout_configs(8, 1, 4, 2)
    picked = g.bracket(configs, lambda c: c.micro_batch <= limit)
    assert [c.micro_batch for c in picked] == expected


def test_bracket_of_a_single_config_is_that_config():
    assert g.bracket(layout_configs(4), lambda c: True) == layout_configs(4)


def small_space() -> Space:
    choices = Choices(zero_stage=(0, 2), micro_batch=(1, 2, 4), ckpt_interval=(0, 1), precision=("bf16",))
    return Space(choices, Workload(PRESETS["tiny"], 16), PROFILES["cpu"])


def test_select_subset_takes_whole_picks_in_order_while_time_allows():
    space = small_space()
    order = g.balanced_layouts(space, seed=0)
    every = lambda configs: list(configs)  # noqa: E731
    ten = lambda c: 10.0  # noqa: E731
    subset = g.select_subset(space, order, every, ten, available_s=65)
    assert len(subset) == 6 and {g.layout(c) for c in subset} == set(order[:2])
    assert len(g.select_subset(space, order, every, ten, available_s=0)) == 3  # at least one layout
    assert len(g.select_subset(space, order, every, ten, available_s=1000, cap=7)) == 6


def test_select_subset_does_not_count_measured_configs_so_a_second_call_extends_the_first():
    space = small_space()
    order = g.balanced_layouts(space, seed=0)
    pick = lambda configs: list(configs)[:2]  # noqa: E731
    first = g.select_subset(space, order, pick, lambda c: 10.0, available_s=40)
    second = g.select_subset(space, order, pick, lambda c: 10.0, available_s=40, measured=first)
    assert len(first) == 4 and second[:4] == first and len(second) == 8


def test_trial_seconds_count_steps_only_where_the_config_fits():
    space = small_space()
    config = space.configs[0]
    predicted = g.estimate(config, space.workload, space.hardware)
    mode = g.CPU_MODE
    fits = g.trial_seconds(predicted, predicted.peak_bytes, mode)
    assert fits > mode.trial_overhead_s
    assert g.trial_seconds(predicted, predicted.peak_bytes - 1, mode) == mode.trial_overhead_s
    assert g.trial_seconds(predicted, predicted.peak_bytes, mode, scale=2.0) == pytest.approx(2 * fits)


def test_time_scale_is_measured_over_predicted_without_op_builds_and_bounded():
    a, b = layout_configs(1, 2)
    results = [ok(a, 500, wall=30.0, phases_s={"build_ops_s": 20.0}), ok(b, 500, wall=10.0)]
    assert g.time_scale(results, lambda c: 10.0) == pytest.approx(1.0)
    assert g.time_scale(results[:1], lambda c: 10.0) == 1.0
    assert g.time_scale(results, lambda c: 1000.0) == 0.25
    assert g.time_scale(results, lambda c: 0.1) == 4.0


class FakeBackend:
    name = "fake"

    def __init__(self, fatal: str | None = None) -> None:
        self.fatal, self.ran = fatal, []

    def run(self, config: Config) -> TrialResult:
        self.ran.append(config)
        return ok(config, 100)


def test_timed_runs_within_the_deadline_and_stops_at_it_or_at_a_fatal_finding():
    import contextlib
    import time

    config = layout_configs(1)[0]
    status = lambda text: contextlib.nullcontext()  # noqa: E731
    inner = FakeBackend()
    assert g.Timed(inner, time.monotonic() + 100, lambda c: 10.0, status).run(config).ok and inner.ran == [config]
    with pytest.raises(g.OutOfTime):
        g.Timed(inner, time.monotonic() + 5, lambda c: 10.0, status).run(config)
    with pytest.raises(g.KitError, match="no GPU"):
        g.Timed(FakeBackend(fatal="no GPU here"), time.monotonic() + 100, lambda c: 1.0, status).run(config)
    assert inner.ran == [config]


# -- figures -----------------------------------------------------------------------------------------------

def test_mape_and_spearman_on_hand_made_numbers():
    assert g.mape([(110, 100), (90, 100), (200, 200)]) == pytest.approx(0.2 / 3)
    assert g.mape([]) is None
    assert g.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert g.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert g.spearman([1, 2], [1, 2]) is None
    assert g.spearman([1, 2, 3], [5, 5, 5]) is None


def test_spread_sample_takes_the_smallest_median_and_largest_predicted_peak():
    configs = layout_configs(1, 2, 4, 8, 16)
    results = [ok(c, 100) for c in configs]
    picked = g.spread_sample(results, lambda c: c.micro_batch)
    assert [r.config.micro_batch for r in picked] == [1, 4, 16]
    assert g.spread_sample(results[:2], lambda c: c.micro_batch) == results[:2]


def test_layout_cliffs_compare_predicted_and_measured_fit_per_layout():
    space = Space(Choices(zero_stage=(0, 1, 2), micro_batch=(1, 2, 4, 8), ckpt_interval=(0,), precision=("bf16",)),
                  Workload(PRESETS["tiny"], 16), PROFILES["cpu"])
    z0, z1, z2 = (layout_configs(1, 2, 4, 8, zero=z) for z in (0, 1, 2))
    results = [
        ok(z0[1], 500), oom(z0[2]),  # stage 0: fits at 2, not at 4, as predicted
        ok(z1[1], 500), ok(z1[2], 900),  # stage 1: 4 is measured at 900 MiB, over the 800 MiB budget
        ok(z2[2], 700), ok(z2[3], 790),  # stage 2: fits at 8 where the estimator said only up to 2
        TrialResult(z2[0], "crash", wall_time_s=1.0, error="port taken"),  # says nothing about memory
    ]
    fits = lambda c: c.micro_batch <= (4 if c.zero_stage == 1 else 2)  # noqa: E731
    calibrated = lambda c: c.micro_batch <= 8  # noqa: E731
    cliffs = {c.layout: c for c in g.layout_cliffs(results, space, fits, calibrated, 800 * MiB)}
    stage0, stage1, stage2 = (cliffs[f"z{z} ck0 bf16"] for z in (0, 1, 2))
    assert (stage0.predicted, stage0.measured_fit, stage0.measured_oom, stage0.verdict) == (2, 2, 4, "agree")
    assert (stage1.predicted, stage1.measured_fit, stage1.measured_oom, stage1.verdict) == (4, 2, 4, "optimistic")
    assert (stage2.predicted, stage2.measured_fit, stage2.measured_oom, stage2.verdict) == (2, 8, None, "cautious")
    assert stage2.micro_batches == (4, 8) and stage2.calibrated == 8


def test_trials_to_98_percent():
    assert g.trials_to([0.5, 0.97, 0.99, 1.0]) == 3
    assert g.trials_to([0.98]) == 1
    assert g.trials_to([0.2, 0.9]) == math.inf
    assert g.trials_to([]) == math.inf
    assert g.trials_to([0.5, 0.9], level=0.9) == 2


def test_measured_budget_is_the_median_ok_peak():
    configs = layout_configs(1, 2, 4, 8)
    results = [ok(configs[0], 300), ok(configs[1], 100), ok(configs[2], 200), oom(configs[3])]
    assert g.measured_budget(results) == 200 * MiB
    assert g.measured_budget([oom(configs[3])]) is None


# -- the command line --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, word", [(["--minutes", "-1"], "-1"), (["--models", "gpt5"], "gpt5"),
                                         (["--configs", "0"], "0"), (["--strategies", "best"], "best"),
                                         (["--timeout", "soon"], "soon"), (["--seq-len", "0"], "0"),
                                         (["--global-batch", "none"], "none")])
def test_bad_flags_exit_2_with_one_line_naming_the_value(flags, word, capsys):
    with pytest.raises(SystemExit) as exit_:
        g.parse_args(["--cpu", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and word in err and len(err.strip().splitlines()) == 1


def test_without_a_gpu_the_kit_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    import autotune.trials.devices

    monkeypatch.setattr(autotune.trials.devices, "probe", lambda: LocalMachine((), 24 * 2**30, 2))
    assert g.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--cpu" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "gpu_validation.json").exists()


def test_minutes_0_only_analyses_and_an_empty_folder_gives_an_empty_report(tmp_path):
    assert g.main(["--cpu", "--minutes", "0", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert report["surfaces"] == [] and report["accelerator"] == "cpu"
    assert not list((tmp_path / "surfaces").glob("*.jsonl"))


def test_analysis_of_a_real_surface_runs_without_ray_or_a_database(tmp_path):
    """The kit must run where Ray (and Optuna's SQL storage) is not installed: import both fails here."""
    code = f"""
import importlib.abc, json, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("ray", "sqlalchemy", "alembic"):
            raise ImportError(f"{{name}} is not installed")
sys.meta_path.insert(0, Absent())
sys.path.insert(0, {str(KIT.parent)!r})
import gpu_validation as g
from pathlib import Path
from autotune.values.hardware import PROFILES
from autotune.search_spaces import load_choices
from autotune.values.workload import make_workload
mode = g.Mode("cpu", load_choices("cpu"), 16, 6.0, 1.0, 60.0, 1, 5.0)
plan = g.Plan(make_workload("tiny"), PROFILES["cpu"], mode, 24 * 2**30, 0, Path({str(SURFACE)!r}), Path("."))
out = g.analyse(plan, seeds=1, strategies=("grid", "optuna", "hybrid"), trials=12)
assert not [m for m in sys.modules if m.split(".")[0] in ("ray", "sqlalchemy")]
print(json.dumps(g.finite(out)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["measured"] == len(read_results(SURFACE)) > 100
    assert 0 < out["memory"]["mape_uncalibrated"] < 1 and out["memory"]["held_out"] == out["throughput"]["configs"] - 3
    assert -1 <= out["throughput"]["spearman_calibrated"] <= 1
    assert set(out["search"]["strategies"]) == {"grid", "optuna", "hybrid"}
    for row in out["search"]["strategies"].values():
        assert 0 <= row["median_final"] <= 1 and row["median_launched"] <= 12
    assert {c["verdict"] for c in out["cliffs"]} <= {"agree", "optimistic", "cautious", "mixed"}


# -- the scripts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpu-bundle", "gpu-validate"])
def test_scripts_are_executable_and_parse(name):
    path = ROOT / "scripts" / name
    assert os.access(path, os.X_OK)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, **(env or {})})


def test_gpu_bundle_refuses_a_bad_python_version_before_downloading(tmp_path):
    done = run_script("scripts/gpu-bundle", str(tmp_path / "b"), "--python-version", "twelve")
    assert done.returncode == 2 and "twelve" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_gpu_bundle_carries_what_tune_needs_for_its_study_db(tmp_path):
    """SQLAlchemy, alembic, Mako and greenlet (Optuna's RDB storage: `tune` keeps its study in study.db), from
    the requirement list the script resolves, without building or downloading anything."""
    done = run_script("scripts/gpu-bundle", str(tmp_path / "b"), "--list")
    assert done.returncode == 0, done.stderr
    names = {line.split("==")[0].lower(): line.split("==")[1] for line in done.stdout.split()}
    assert {"ds-autotune", "sqlalchemy", "alembic", "mako", "greenlet", "optuna", "deepspeed"} <= set(names)
    assert "torch" not in names and all(names.values())
    assert not (tmp_path / "b").exists()


def test_gpu_validate_refuses_a_missing_bundle_and_one_for_another_python(tmp_path):
    done = run_script("scripts/gpu-validate", str(tmp_path / "nothing"))
    assert done.returncode == 2 and "nothing" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "BUNDLE.txt").write_text("python_version=3.99\n")
    (bundle / "x-1.0-py3-none-any.whl").write_bytes(b"")
    done = run_script("scripts/gpu-validate", str(bundle), "--", "--cpu", env={"PYTHON": sys.executable,
                                                                               "GPU_VALIDATE_TARGET": str(tmp_path / "t")})
    assert done.returncode == 2 and "3.99" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()


# -- the whole kit on the CPU ------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_kit_records_and_analyses_two_surfaces_on_the_cpu_and_resumes(tmp_path):
    # 64 tokens per sample (not the models' own 256) and a global batch of 4 (not 16): micro-batches 1 and 4,
    # at most 4 micro-steps a step, so that a layout with an offloaded optimizer (~1.5 s a micro-step on a
    # 2-core Xeon) takes seconds, not a minute.
    command = [sys.executable, str(KIT), "--cpu", "--out", str(tmp_path), "--configs", "4", "--max-steps", "1",
               "--seeds", "1", "--trials", "4", "--minutes", "15", "--seq-len", "64", "--global-batch", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/4]" in done.stdout and "[4/4]" in done.stdout  # a progress line per trial
    surfaces = sorted((tmp_path / "surfaces").glob("*.jsonl"))
    assert [p.name for p in surfaces] == ["cpu-tiny-llama.jsonl", "cpu-tiny.jsonl"]
    lines = {p.name: read_results(p) for p in surfaces}
    for results in lines.values():
        assert len(results) == 4 and all(r.status in STATUSES for r in results)
        assert sum(r.ok for r in results) >= 3
    report = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert report["accelerator"] == "cpu" and [s["model"] for s in report["surfaces"]] == ["tiny", "tiny-llama"]
    for s in report["surfaces"]:
        assert s["measured"] == 4 and sum(s["status_counts"].values()) == 4
        assert (s["workload"]["model"]["seq_len"], s["workload"]["global_batch"]) == (64, 4)
        assert all(r.extra["workload"] == s["workload"] for r in lines[f"cpu-{s['model']}.jsonl"])
        assert math.isfinite(s["memory"]["mape_uncalibrated"]) and s["memory"]["mape_uncalibrated"] >= 0
        assert math.isfinite(s["memory"]["mape_calibrated_all"])
        assert s["budget_bytes"] > 0 and len(s["cliffs"]) == 2
        assert set(s["search"]["strategies"]) == {"grid", "optuna", "hybrid"}
    markdown = (tmp_path / "gpu_validation.md").read_text()
    assert "| tiny | " in markdown and "| tiny-llama | " in markdown and "| hybrid |" in markdown

    again = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("4 already measured, 0 to run") == 2
    assert {p.name: len(read_results(p)) for p in surfaces} == {name: 4 for name in lines}
