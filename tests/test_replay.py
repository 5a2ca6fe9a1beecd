"""The replay backend over hand-made surfaces: lookups, the budget as an OOM cliff, refusals."""

import json
from pathlib import Path

import pytest

from autotune.backends import Backend
from autotune.backends.replay import ReplayBackend, load_surface, surface_choices, surface_space
from autotune.values.config import Config, ConfigError
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult, append_result
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.values.workload import make_workload

MiB = 2**20
TINY = make_workload("tiny")
EXTRA = {"workload": TINY.to_dict(), "hardware": "cpu"}
FAST = Config(0, 8, 0, "bf16")
SMALL = Config(3, 1, 1, "bf16", "cpu", "cpu")
CRASHED = Config(1, 2, 0, "fp32")


def write_surface(path: Path, results: list[TrialResult]) -> Path:
    for result in results:
        append_result(path, result)
    return path


@pytest.fixture
def surface_path(tmp_path: Path) -> Path:
    return write_surface(tmp_path / "surface.jsonl", [
        TrialResult(FAST, "ok", 40.0, 40.0 * 256, 0.4, 900 * MiB, None, 12.0, "deepspeed", extra=EXTRA),
        TrialResult(SMALL, "ok", 10.0, 10.0 * 256, 1.6, 300 * MiB, None, 20.0, "deepspeed", extra=EXTRA),
        TrialResult(CRASHED, "crash", wall_time_s=3.0, backend="deepspeed", error="exit code 1", extra=EXTRA),
    ])


def test_replays_recorded_results_under_a_budget(surface_path):
    backend = ReplayBackend(surface_path, memory_budget_bytes=500 * MiB)
    assert isinstance(backend, Backend) and backend.name == "replay"
    small = backend.run(SMALL)
    assert small.status == "ok" and small.throughput_samples_per_s == 40.0 / 4
    assert small.backend == "replay" and small.extra["recorded_backend"] == "deepspeed"
    assert small.memory_budget_bytes == 500 * MiB and small.wall_time_s == 20.0
    fast = backend.run(FAST)  # measured at 900 MiB: over this search's budget
    assert fast.status == "oom" and fast.throughput_samples_per_s is None
    assert fast.peak_memory_bytes == 900 * MiB and "exceeds the budget" in fast.error
    crashed = backend.run(CRASHED)
    assert crashed.status == "crash" and crashed.error == "exit code 1"
    assert ReplayBackend(surface_path, memory_budget_bytes=1024 * MiB).run(FAST).status == "ok"
    assert ReplayBackend(surface_path).run(FAST).status == "ok"  # no budget: as recorded


def test_unmeasured_config_is_refused_with_its_name(surface_path):
    backend = ReplayBackend(surface_path, 500 * MiB)
    missing = Config(2, 4, 1, "bf16")
    with pytest.raises(ConfigError) as err:
        backend.run(missing)
    assert missing.to_json() in str(err.value) and "not measured" in str(err.value)
    assert str(surface_path) in str(err.value)


def test_surface_metadata_best_and_a_config_measured_again_replays_its_median(surface_path):
    append_result(surface_path, TrialResult(SMALL, "ok", 12.0, 12.0 * 256, 1.3, 310 * MiB, None, 19.0, "deepspeed",
                                            extra=EXTRA))
    # Two measurements: the lower of the two middle ones (one lucky run does not win).
    assert load_surface(surface_path).results[SMALL].throughput_samples_per_s == 10.0
    append_result(surface_path, TrialResult(SMALL, "ok", 11.0, 11.0 * 256, 1.45, 305 * MiB, None, 19.0, "deepspeed",
                                            extra=EXTRA))
    surface = load_surface(surface_path)
    assert len(surface) == 3 and surface.workload == TINY and surface.hardware == "cpu"
    median = surface.results[SMALL]  # the whole line of the median run: its peak and step time too
    assert (median.throughput_samples_per_s, median.peak_memory_bytes, median.step_time_s) == (11.0, 305 * MiB, 1.45)
    assert surface.best(500 * MiB).config == SMALL
    assert surface.best(2000 * MiB).config == FAST
    assert surface.best(100 * MiB) is None


def test_surface_space_is_the_measured_configs(surface_path):
    surface = load_surface(surface_path)
    space = surface_space(surface)
    assert set(space) == {FAST, SMALL, CRASHED}
    assert space.workload == TINY and space.hardware == PROFILES["cpu"]
    assert space.invalid_reason(Config(0, 1, 0, "bf16")) is not None
    choices = surface_choices(surface)
    assert choices.zero_stage == (0, 1, 3) and choices.precision == ("fp32", "bf16")
    narrowed = surface_space(surface, choices=load_choices("cpu"))
    assert set(narrowed) == {FAST, SMALL, CRASHED}
    # The cpu preset's full space, restricted, names why an unmeasured config is out.
    full = Space(load_choices("cpu"), TINY, PROFILES["cpu"]).restrict(surface.results)
    assert full.invalid_reason(Config(2, 4, 1, "bf16")) == "not measured in the replay surface"


def test_surface_without_metadata_needs_workload(tmp_path):
    path = write_surface(tmp_path / "bare.jsonl", [TrialResult(FAST, "ok", 40.0, backend="deepspeed")])
    surface = load_surface(path)
    assert surface.workload is None and surface.hardware is None
    with pytest.raises(ConfigError, match="does not record its workload"):
        surface_space(surface)
    assert len(surface_space(surface, PROFILES["cpu"], TINY)) == 1


def test_bad_surface_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_surface(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="holds no results"):
        load_surface(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"config": {"zero_stage": 9, "micro_batch": 1, "ckpt_interval": 0, "precision": "bf16"}}\n'
                      '{"status": "ok"}\n')
    with pytest.raises(ConfigError, match="broken.jsonl:1"):
        load_surface(broken)


def test_torn_last_line_is_ignored_and_said(surface_path):
    assert load_surface(surface_path).notes == ()
    with surface_path.open("a") as out:
        out.write(json.dumps({"config": Config(2, 2, 0, "bf16").to_dict(), "status": "ok"})[:30])
    surface = load_surface(surface_path)
    assert len(surface) == 3
    assert surface.notes == (f"{surface_path}:4: an incomplete last line (30 characters, a write cut short) was left "
                             "out; the results before it are read",)
    # A sweep replaying it says so too (it said nothing: a measured config silently missing from the search).
    from autotune.api import resolution
    from autotune import TuneSpec

    spec = TuneSpec(make_workload("tiny"), backend="replay", surface=surface_path, memory_budget_bytes=2 * 2**30)
    assert surface.notes[0] in resolution(spec).notes


def test_an_append_drops_a_torn_last_line(surface_path):
    with surface_path.open("a") as out:
        out.write('{"config": {"zero_stage"')
    append_result(surface_path, TrialResult(SMALL, "ok", 11.0, backend="deepspeed", extra=EXTRA))
    lines = surface_path.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)


def test_measured_values_of_a_result():
    ran = TrialResult(FAST, "ok", 40.0, 40.0 * 256, 0.4, 900 * MiB)
    assert (ran.throughput, ran.peak_bytes, ran.step_time) == (40.0, 900 * MiB, 0.4)
    crashed = TrialResult(CRASHED, "crash", error="exit code 1")
    for name in ("throughput", "peak_bytes", "step_time"):
        with pytest.raises(ValueError, match=f"a crash result of {CRASHED.label()} has no"):
            getattr(crashed, name)


COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"


def test_committed_surface_is_real_measurements_of_the_tiny_cpu_space():
    surface = load_surface(COMMITTED)
    assert surface.workload == TINY and surface.hardware == "cpu"
    space = Space(load_choices("cpu"), TINY, PROFILES["cpu"])
    assert set(surface.results) <= set(space.configs) and len(surface) >= 10
    ok = [r for r in surface.results.values() if r.ok]
    assert len(ok) >= len(surface) // 2
    for r in ok:
        assert r.backend == "deepspeed" and r.throughput_samples_per_s > 0 and r.extra["step_times_s"]
        assert 100 * MiB < r.peak_memory_bytes < 24 * 2**30
    # Under a budget at the median measured peak, the configs above it replay as out of memory.
    peaks = sorted(r.peak_memory_bytes for r in ok)
    budget = peaks[len(peaks) // 2]
    backend = ReplayBackend(surface, budget)
    for r in ok:
        assert backend.run(r.config).status == ("ok" if r.peak_memory_bytes <= budget else "oom")


SURFACES = COMMITTED.parent


def test_second_committed_surface_is_its_model_file_over_its_whole_space():
    """benchmarks/surfaces/README.md: small-llama-cpu.jsonl measured every config of its space file once,
    for the shape in models/small-llama.yaml at global batch 8 (a llama unlike tiny: another landscape)."""
    path = SURFACES / "small-llama-cpu.jsonl"
    lines = path.read_text().splitlines()
    assert all(json.loads(line)["workload"]["model"]["name"] == "small-llama" for line in lines)
    surface = load_surface(path)
    workload = make_workload(str(SURFACES / "models" / "small-llama.yaml"), 8)
    assert surface.workload == workload and surface.hardware == "cpu"
    assert (workload.model.arch, workload.model.layers, workload.model.kv_heads) == ("llama", 8, 2)
    space = Space(load_choices(SURFACES / "small-llama-cpu-space.yaml"), workload, PROFILES["cpu"])
    assert len(space) == 36 and set(surface.results) == set(space.configs) and len(lines) >= 36
    ok = [r for r in surface.results.values() if r.ok]
    assert len(ok) == 36 and all(r.backend == "deepspeed" and r.extra["step_times_s"] for r in ok)
    # Checkpointing off costs memory here: at the median peak some configs of each side fit and some do not.
    budget = sorted(r.peak_memory_bytes for r in ok)[len(ok) // 2]
    for ckpt in (0, 1):
        fits = {r.peak_memory_bytes <= budget for r in ok if r.config.ckpt_interval == ckpt}
        assert fits == {True, False}


# -- what a replay may pass off as what: one check (check_replay) for tune, its library form and the environment

def test_replay_refuses_hardware_other_than_the_surfaces(surface_path):
    from autotune.backends.replay import replay_space

    with pytest.raises(ConfigError) as err:
        replay_space(surface_path, TINY, "h100-80gb")
    assert str(err.value).startswith("--hardware h100-80gb: ") and "recorded on cpu" in str(err.value)
    with pytest.raises(ConfigError, match="--hardware a100-40gb: .* recorded on cpu"):
        replay_space(surface_path, TINY, PROFILES["a100-40gb"])
    for hardware in (None, "cpu", PROFILES["cpu"], "auto"):  # auto: this machine, a CPU, as the surface's was
        assert replay_space(surface_path, TINY, hardware).hardware.name == "cpu"


def test_a_surface_simulated_on_a_gpu_profile_replays_on_that_profile(tmp_path):
    from autotune.backends.replay import replay_settings

    extra = {"workload": make_workload("gpt2-small").to_dict(), "hardware": "a100-80gb"}
    path = write_surface(tmp_path / "gpu.jsonl", [TrialResult(Config(0, 4, 0, "bf16"), "ok", 50.0, None, 0.3,
                                                              9 * 2**30, None, 1.0, "simulated", extra=extra)])
    for hardware in (None, "a100-80gb"):
        settings, _ = replay_settings(path, model="gpt2-small", hardware=hardware, strategy="grid")
        assert settings.hardware.name == "a100-80gb" and settings.workload.model.name == "gpt2-small"
    with pytest.raises(ConfigError, match="--hardware cpu: .* recorded on a100-80gb"):
        replay_settings(path, hardware="cpu", strategy="grid")


def test_a_surface_whose_lines_disagree_is_refused_for_replay(tmp_path, surface_path):
    from autotune.backends.replay import replay_settings, replay_space, replay_workload

    small = make_workload("gpt2-small")
    two_models = write_surface(tmp_path / "two-models.jsonl", [
        TrialResult(FAST, "ok", 40.0, backend="deepspeed", extra=EXTRA),
        TrialResult(SMALL, "ok", 9.0, backend="deepspeed", extra={"workload": small.to_dict(), "hardware": "cpu"})])
    two_machines = write_surface(tmp_path / "two-machines.jsonl", [
        TrialResult(FAST, "ok", 40.0, backend="deepspeed", extra=EXTRA),
        TrialResult(SMALL, "ok", 9.0, backend="simulated", extra={**EXTRA, "hardware": "a100-40gb"})])
    assert "tiny" in load_surface(two_models).mixed and "gpt2-small" in load_surface(two_models).mixed
    assert "cpu and a100-40gb" in load_surface(two_machines).mixed and load_surface(surface_path).mixed is None
    for path in (two_models, two_machines):
        for model in (None, "tiny", "gpt2-small"):
            with pytest.raises(ConfigError, match=f"surface {path}: its lines were recorded with|on two") as err:
                replay_workload(path, model)
            assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match="its lines were recorded"):
            replay_space(path, TINY)  # the library's form (TuneSpec) checks it too
        with pytest.raises(ConfigError, match="its lines were recorded"):
            replay_settings(path, model="gpt2-small", hardware="a100-40gb", strategy="grid")
    # A surface without any workload key (records older than it) keeps its fallback: --model's, else tiny.
    bare = write_surface(tmp_path / "bare.jsonl", [TrialResult(FAST, "ok", 40.0, backend="deepspeed")])
    assert replay_workload(bare) == TINY and replay_workload(bare, "gpt2-small").model.name == "gpt2-small"
    # Lines of one workload, some without the key (an old surface recorded on): one workload, not a mix.
    append_result(bare, TrialResult(SMALL, "ok", 10.0, backend="deepspeed", extra=EXTRA))
    assert load_surface(bare).mixed is None and replay_workload(bare) == TINY


def test_a_measurement_then_a_crash_replays_the_measurement(tmp_path):
    def ok(throughput, peak=300):
        return TrialResult(SMALL, "ok", throughput, None, 1.0, peak * MiB, None, 9.0, "deepspeed", extra=EXTRA)

    def failed(status):
        return TrialResult(SMALL, status, wall_time_s=3.0, backend="deepspeed", error=status, extra=EXTRA)

    def replayed(*lines):
        path = tmp_path / f"s{len(list(tmp_path.iterdir()))}.jsonl"
        return load_surface(write_surface(path, list(lines))).results[SMALL]

    assert replayed(ok(10.0), failed("crash")).throughput_samples_per_s == 10.0  # `--repeats 2`, the second crashed
    assert replayed(ok(10.0), failed("timeout")).throughput_samples_per_s == 10.0
    assert replayed(failed("crash"), ok(10.0)).throughput_samples_per_s == 10.0  # a crash run again
    assert replayed(ok(10.0), failed("crash"), ok(12.0), ok(11.0)).throughput_samples_per_s == 11.0  # the median
    assert replayed(failed("crash"), failed("timeout")).status == "timeout"  # no measurement: its last failure
    assert replayed(failed("unsupported"), failed("crash")).status == "unsupported"
    # An oom is a measurement (of a peak over the recording's budget) at 0 samples/s: the median of the runs.
    assert replayed(ok(10.0), failed("oom")).status == "oom"
    assert replayed(ok(10.0), failed("oom"), ok(12.0)).throughput_samples_per_s == 10.0


def test_a_replayed_out_of_memory_names_sizes(surface_path):
    assert ReplayBackend(surface_path, 500 * MiB).run(FAST).error == "peak 900 MiB exceeds the budget of 500 MiB"
    seen = TrialResult(FAST, "ok", 40.0, None, 0.4, 604749824, None, 12.0, "deepspeed").under_budget(560 * MiB)
    assert seen.error == "peak 577 MiB exceeds the budget of 560 MiB"
    close = TrialResult(FAST, "ok", 40.0, None, 0.4, 560 * MiB + 1000).under_budget(560 * MiB)  # the same 3 figures
    assert close.error == f"peak 560 MiB ({560 * MiB + 1000:,} bytes) exceeds the budget of 560 MiB ({560 * MiB:,} bytes)"


def test_surface_reading_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_surface(tmp_path)
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"config": {"zero_stage": 0}, "status": "ok", "error": "a\u2028line separator"}\n')
    with pytest.raises(ConfigError) as err:
        load_surface(cut)
    assert "Unterminated string starting at column" in str(err.value) and "at at" not in str(err.value)
