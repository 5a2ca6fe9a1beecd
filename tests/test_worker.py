"""The worker's parts that need no DeepSpeed run: the built-in model, the stopping rule, the file protocol,
failure classification, the DeepSpeed config translation, and /proc memory readings."""

import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch

from autotune.values.config import Config
from autotune.values.dsconfig import DsOptions, ds_config
from autotune.worker import procmem
from autotune.worker.main import CPU_OOM, Unsupported, classify, prepared_ds_config
from autotune.worker.measure import (BEHIND, MAX_STEPS, REASONS, SLOW, STABLE, TIME_LIMIT, MeasureSettings, iqr, median_rel_se,
                                     stop_reason)
from autotune.worker.model import GPT, build, count_parameters, synthetic_batch
from autotune.worker.protocol import WorkerSpec, events_path, read_events, record_phase
from autotune.values.workload import PRESETS, ModelShape, make_workload
from autotune.backends.deepspeed import DeepSpeedBackend

SMALL_GPT = ModelShape("small-gpt", layers=4, hidden=64, heads=4, vocab=128, seq_len=32)
SMALL_LLAMA = ModelShape("small-llama", layers=2, hidden=64, heads=4, vocab=128, seq_len=32, ffn_hidden=172,
                         kv_heads=2, arch="llama")


# -- model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [PRESETS["tiny"], SMALL_GPT, SMALL_LLAMA], ids=lambda s: s.name)
def test_model_has_the_parameters_the_estimator_counts(shape):
    assert count_parameters(GPT(shape)) == shape.params


def _loss_and_grads(shape, ckpt_interval):
    torch.manual_seed(0)
    model = GPT(shape, ckpt_interval)
    tokens, targets = synthetic_batch(shape, 2, torch.Generator().manual_seed(1))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, saved


@pytest.mark.slow  # the first non-reentrant checkpoint in a process takes seconds (lazy imports)
@pytest.mark.parametrize("shape", [SMALL_GPT, SMALL_LLAMA], ids=lambda s: s.name)
def test_checkpointing_changes_memory_not_results(shape):
    loss0, grads0, saved0 = _loss_and_grads(shape, 0)
    loss1, grads1, saved1 = _loss_and_grads(shape, 1)
    loss2, grads2, saved2 = _loss_and_grads(shape, 2)
    assert loss0 == pytest.approx(loss1, rel=1e-6) == pytest.approx(loss2, rel=1e-6)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(grads2[name], grads0[name], rtol=1e-4, atol=1e-6)
    # Forward keeps only segment inputs when checkpointing: far less than every layer's activations.
    assert sum(saved1) < 0.6 * sum(saved0)
    assert sum(saved2) < 0.6 * sum(saved0)


def test_attention_is_fused_no_score_matrix_is_saved():
    shape = ModelShape("wide-seq", layers=1, hidden=32, heads=4, vocab=64, seq_len=256)
    sizes = []
    model = GPT(shape)
    tokens, targets = synthetic_batch(shape, 1, torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(tuple(t.shape)) or t, lambda t: t):
        model(tokens, targets)
    assert sizes  # something was saved
    assert not [s for s in sizes if s[-2:] == (shape.seq_len, shape.seq_len)]


GEMMA2_LIKE = replace(SMALL_LLAMA, name="small-gemma2", norms_per_layer=4, qk_norm=True, tied_embeddings=True)


@pytest.mark.parametrize("shape", [PRESETS["tiny"], SMALL_LLAMA, GEMMA2_LIKE], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_is_built_in_its_training_dtype_and_seeded(shape, dtype):
    torch.manual_seed(3)
    model = build(shape, 1, "cpu", dtype)
    assert count_parameters(model) == shape.params
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(dtype, "cpu")}
    assert (model.head.weight is model.embed.weight) == shape.tied_embeddings  # one tensor, as GPT(shape) ties it
    torch.manual_seed(3)
    again = build(shape, 1, "cpu", dtype)
    torch.manual_seed(4)
    other = build(shape, 1, "cpu", dtype)
    for (name, p), q, r in zip(model.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(p, q), name  # same seed, same weights
        if name.endswith("bias"):
            assert not p.any(), name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert not torch.equal(p, r), name  # drawn from the seeded generator, not left as torch.empty's
            assert p.float().std().item() == pytest.approx(0.02, rel=0.1), name
    tokens, targets = synthetic_batch(shape, 2, torch.Generator().manual_seed(1))
    assert math.log(shape.vocab) - 0.5 < model(tokens, targets).item() < math.log(shape.vocab) + 0.5  # untrained


def test_model_build_refuses_a_parameter_it_cannot_initialize(monkeypatch):
    monkeypatch.delattr("autotune.worker.model.RMSNorm.reset_parameters")
    with pytest.raises(ValueError, match="no initializer for"):
        build(SMALL_LLAMA, 0, "cpu", torch.bfloat16)


def test_model_rejects_a_checkpoint_interval_beyond_its_layers():
    with pytest.raises(ValueError, match="ckpt_interval=5"):
        GPT(SMALL_GPT, 5)


# -- stopping rule -----------------------------------------------------------------------------------
def test_stops_when_the_median_is_known_well_enough():
    settings = MeasureSettings(min_steps=3, max_steps=20, rel_tol=0.04)
    assert stop_reason([1.0, 1.01], 1.0, settings) is None  # below min_steps
    assert stop_reason([1.0, 1.01, 0.99], 3.0, settings) == STABLE
    assert stop_reason([1.0, 1.5, 0.6], 3.0, settings) is None  # too noisy to stop
    noisy = [1.0, 1.5, 0.6] * 6
    assert stop_reason(noisy[:19], 19.0, settings) is None
    assert stop_reason(noisy + [1.0, 1.0], 20.0, settings) == MAX_STEPS


def test_a_growing_memory_peak_holds_measurement_back():
    settings = MeasureSettings(min_steps=3, max_steps=20, rel_tol=0.04, mem_rel_tol=0.01)
    steady_times = [1.0, 1.0, 1.0]
    mib = 2**20
    assert stop_reason(steady_times, 3.0, settings, [300 * mib, 330 * mib, 360 * mib]) is None  # still creeping
    assert stop_reason(steady_times, 3.0, settings, [300 * mib, 330 * mib, 331 * mib]) == STABLE  # +0.3%
    assert stop_reason(steady_times, 3.0, settings) == STABLE  # peak unknown: time alone decides
    no_memory_rule = MeasureSettings(min_steps=3, mem_rel_tol=None)
    assert stop_reason(steady_times, 3.0, no_memory_rule, [300 * mib, 330 * mib, 360 * mib]) == STABLE
    assert stop_reason([1.0] * 20, 20.0, settings, [i * mib for i in range(20)]) == MAX_STEPS


def test_time_limit_stops_after_at_least_one_step():
    settings = MeasureSettings(min_steps=3, max_steps=20, max_measure_s=5.0)
    assert stop_reason([], 10.0, settings) is None
    assert stop_reason([6.0], 6.0, settings) == TIME_LIMIT


def test_fixed_settings_never_stop_early():
    settings = MeasureSettings.fixed(2, 5)
    assert [stop_reason([1.0] * n, n, settings) for n in range(1, 6)] == [None] * 4 + [MAX_STEPS]
    assert stop_reason([100.0], 100.0, replace(settings, expected_step_s=1.0)) is None  # even far behind


def test_a_config_far_behind_stops_after_its_second_measured_step():
    expected = MeasureSettings(min_steps=3, max_steps=20, expected_step_s=2.0)  # slow_factor 5: 10 s
    assert stop_reason([20.0], 20.0, expected) is None  # one step 10x what was expected: maybe noise
    assert stop_reason([20.0, 21.0], 41.0, expected) == SLOW  # two: the config is slow
    assert stop_reason([9.0], 9.0, expected) is None  # 4.5x: measured in full
    assert stop_reason([9.0, 9.5, 9.2], 28.0, expected) == STABLE
    assert stop_reason([20.0], 20.0, MeasureSettings(min_steps=3)) is None  # nothing expected yet
    assert stop_reason([20.0], 20.0, replace(expected, slow_factor=None)) is None  # the rule off
    assert SLOW in REASONS  # every rank learns it from rank 0 (worker.main.agree)


def test_a_config_behind_the_best_stops_at_its_minimum_of_steps(tmp_path):
    mib = 2**20
    behind = MeasureSettings(min_steps=3, max_steps=20, best_step_s=1.0)  # margin 10%: every step over 1.1 s
    spread = [1.3, 1.6, 1.2]  # too spread for `stable` (the median's error 12%)
    assert stop_reason(spread[:2], 2.9, behind) is None  # below min_steps
    assert stop_reason(spread, 4.1, behind) == BEHIND
    assert stop_reason([1.3, 1.6, 1.05], 4.0, behind) is None  # one step near the best: measured on
    assert stop_reason(spread, 4.1, behind, [300 * mib, 330 * mib, 360 * mib]) is None  # its peak still growing
    assert stop_reason([1.3, 1.31, 1.29], 3.9, behind) == STABLE  # steady: measured as any config
    assert stop_reason(spread, 4.1, MeasureSettings(min_steps=3)) is None  # nothing measured before it
    assert stop_reason(spread, 4.1, replace(behind, behind_margin=None)) is None  # the rule off
    assert MeasureSettings.fixed(2, 5).behind_margin is None and BEHIND in REASONS
    with pytest.raises(ValueError):
        MeasureSettings(behind_margin=-0.1)
    # The backend sets it from its trials: the fastest median step measured so far.
    backend = DeepSpeedBackend(make_workload("tiny"), logs_dir=tmp_path)
    assert backend._measure_for(None).best_step_s is None
    backend._fastest_step_s = 0.25
    assert backend._measure_for(None).best_step_s == 0.25


def test_a_config_run_again_is_measured_in_full(tmp_path):
    # Confirmation re-runs the best configs to measure them: a first step slowed by something else (script mode's
    # lazy setup, 51x) stopped a repeat of the best as `slow` after one step, and that step entered its median.
    from autotune.trials.runner import RunOutcome

    seen = []

    def ranks(spec, options):
        seen.append(spec.measure)
        return RunOutcome("crash", "rank 0 exited with code 1", (None,), 0.1, 0.0, spec.log_dir, (), (1,))

    backend = DeepSpeedBackend(make_workload("tiny"), logs_dir=tmp_path, ranks_ahead=False)
    backend.start_ranks = ranks
    backend._fastest_step_s = 0.25  # an earlier trial measured a step of 0.25 s
    first, other = Config(2, 4, 0, "fp32"), Config(1, 4, 0, "fp32")
    for config in (first, other, first):
        backend.run(config)
    assert seen[0].best_step_s == seen[1].best_step_s == 0.25 and seen[0].slow_step_s() is not None
    assert seen[2] == backend.measure and seen[2].slow_step_s() is None and seen[2].behind_step_s() is None


def test_spread_statistics():
    assert median_rel_se([1.0]) == math.inf
    assert median_rel_se([2.0, 2.0, 2.0]) == 0.0
    assert median_rel_se([1.0, 2.0, 3.0]) == pytest.approx(1.2533 * 1.0 / math.sqrt(3) / 2.0)
    assert iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0)
    assert iqr([3.0]) == 0.0


@pytest.mark.parametrize("kwargs", [{"warmup_steps": -1}, {"min_steps": 0}, {"min_steps": 5, "max_steps": 4},
                                    {"max_measure_s": 0}, {"slow_factor": 0}, {"expected_step_s": -1.0}])
def test_measure_settings_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        MeasureSettings(**kwargs)


# -- protocol ----------------------------------------------------------------------------------------
def test_spec_round_trips_through_its_file(tmp_path):
    config, workload = Config(2, 4, 1, "bf16"), make_workload("tiny")
    spec = WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path),
                      MeasureSettings(warmup_steps=2, max_steps=7), 2**30, seed=3, launch_time=12.5)
    assert WorkerSpec.read(spec.write()) == spec


def test_events_skip_a_line_being_written(tmp_path):
    record_phase(tmp_path, 0, "start")
    record_phase(tmp_path, 0, "build", device="cpu")
    with events_path(tmp_path, 0).open("a") as out:
        out.write('{"t": 1, "pha')
    events = read_events(tmp_path, 0)
    assert [e["phase"] for e in events] == ["start", "build"]
    assert events[1]["device"] == "cpu" and events[0]["pid"] == os.getpid()
    assert read_events(tmp_path, 1) == []


# -- failure classification -------------------------------------------------------------------------
@pytest.mark.parametrize("err, status", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
    (MemoryError(), "oom"),
    (RuntimeError(f"[enforce fail at alloc_cpu.cpp:121] . {CPU_OOM}: you tried to allocate 123 bytes."), "oom"),
    (Unsupported("precision fp16 is not supported"), "unsupported"),
    (RuntimeError("Connection closed by peer"), "crash"),
    (ValueError("an error occurred"), "crash"),
    (KeyboardInterrupt(), "crash"),
])
def test_failures_are_classified_by_type_not_by_words(err, status):
    got, message = classify(err)
    assert got == status
    assert message


def test_offload_without_forced_cpu_adam_uses_torch_adam():
    workload = make_workload("tiny")
    offload = Config(2, 4, 0, "bf16", "cpu")
    relaxed = prepared_ds_config(ds_config(offload, workload, DsOptions(force_ds_cpu_optimizer=False)))
    assert relaxed["optimizer"]["params"]["torch_adam"] is True
    forced = prepared_ds_config(ds_config(offload, workload, DsOptions()))
    assert "torch_adam" not in forced["optimizer"]["params"]
    plain = prepared_ds_config(ds_config(Config(2, 4, 0, "bf16"), workload, DsOptions(force_ds_cpu_optimizer=False)))
    assert "torch_adam" not in plain["optimizer"]["params"]


# -- /proc memory ------------------------------------------------------------------------------------
def test_peak_is_a_true_high_water_mark_and_resets():
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from autotune.worker import procmem\n"
        "before = procmem.rss()\n"
        "block = bytearray(200 * 2**20); block[::4096] = b'x' * len(block[::4096]); del block\n"
        "peak = procmem.peak_rss(); after = procmem.rss()\n"
        "procmem.reset_peak(); reset = procmem.peak_rss()\n"
        "print(before, peak, after, reset)\n" % os.getcwd())
    before, peak, after, reset = map(int, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert peak - before >= 190 * 2**20  # the freed block's pages are in the peak...
    assert after < peak - 150 * 2**20  # ...not in the resident set any more
    assert reset < peak - 150 * 2**20  # and the reset brought the peak back down


def test_memory_of_another_process_and_of_a_gone_one():
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert procmem.peak_rss(proc.pid) >= procmem.rss(proc.pid) > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert procmem.peak_rss(proc.pid) is None


# -- C++ op builds --------------------------------------------------------------------------------------
def test_a_build_lock_left_by_a_killed_builder_is_removed(tmp_path, monkeypatch):
    from autotune.worker.main import clear_stale_build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = tmp_path / "some_op"
    build_dir.mkdir()
    lock = build_dir / "lock"
    lock.touch()
    assert not clear_stale_build_lock("some_op")  # fresh: a builder may be writing its ninja file
    os.utime(lock, (time.time() - 600, time.time() - 600))
    compiler = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
                                cwd=build_dir, stdout=subprocess.PIPE, text=True)
    try:
        assert compiler.stdout.readline().strip() == "ready"
        assert not clear_stale_build_lock("some_op") and lock.exists()  # someone is building there
    finally:
        compiler.kill()
        compiler.wait()
    assert clear_stale_build_lock("some_op") and not lock.exists()  # old, nobody building: stale


def test_a_load_waiting_on_a_lock_whose_holder_died_goes_on_once_the_lock_turns_stale(tmp_path, monkeypatch):
    """torch waits on a build lock forever: a lock left a moment before the load began (a rank of the trial
    before, killed while it held it) was too fresh to clear then, and must be cleared while the load waits."""
    from torch.utils.file_baton import FileBaton

    from autotune.worker.main import STALE_LOCK_AGE_S, _sweeping_stale_locks, clear_stale_build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_op" / "lock"
    lock.parent.mkdir()
    lock.touch()
    left_at = time.time() - STALE_LOCK_AGE_S + 1.0  # stale in a second
    os.utime(lock, (left_at, left_at))
    assert not clear_stale_build_lock("some_op")  # too fresh when the load begins

    def load() -> None:  # what torch's load does when another process holds the lock
        with _sweeping_stale_locks("some_op", every_s=0.1):
            FileBaton(str(lock), wait_seconds=0.05).wait()

    loading = threading.Thread(target=load, daemon=True)
    loading.start()
    loading.join(timeout=60)
    assert not loading.is_alive() and not lock.exists()


@pytest.mark.slow
def test_a_rank_imports_deepspeed_without_mlflow():
    """DeepSpeed's autotuner imports MLflow wherever it is installed (the tracking extra installs it here):
    seconds of every rank's start. A rank keeps it out; the tuner's config checks and a script-mode rank keep it
    out of DeepSpeed's import only (tracking, or the user's script, may import it after)."""
    pytest.importorskip("mlflow")  # installed by the tracking extra, which the suite runs with
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    report = "import deepspeed.autotuning.autotuner as a; print(a.has_mlflow, sys.modules.get('mlflow') is not None)"

    def run(code):
        done = subprocess.run([sys.executable, "-c", f"import sys; {code}"], capture_output=True, text=True, env=env,
                              timeout=300)
        return done.stdout.split() or [done.stderr[-2000:]]

    assert run(report) == ["True", "True"]  # DeepSpeed as it is
    assert run(f"from autotune.worker.imports import without_mlflow; without_mlflow(); {report}") == ["False", "False"]
    then_import = "import mlflow; print(mlflow.__name__)"
    assert run("from autotune.worker.imports import mlflow_kept_out\nwith mlflow_kept_out(): import deepspeed\n"
               f"{report}; {then_import}") == ["False", "False", "mlflow"]  # script mode's shim
    assert run("from autotune.outputs.handoff import validate; validate({'train_batch_size': 2}); "
               f"print('mlflow' in sys.modules); {then_import}") == ["False", "mlflow"]  # the tuner
