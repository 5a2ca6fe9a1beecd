"""Ranks started ahead of their trial (autotune.trials.runner.Spares, `python -m autotune.worker --spare`): a sweep's
trials from its third on run on ranks whose imports were made during the trial before, measure as any trial does,
and nothing of them is left behind; ranks that cannot run the next trial are ended, and the trial starts its own."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE, Popen

import psutil
import pytest

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.trials.runner import (LaunchOptions, Placement, SpareRank, Spares, ahead_allowed, run_worker,
                                   trial_environment)
from autotune.values.config import Config
from autotune.values.dsconfig import ds_config
from autotune.values.hardware import PROFILES
from autotune.values.workload import make_workload
from autotune.worker.main import SPARE_DEVICE_EXIT
from autotune.worker.measure import MeasureSettings
from autotune.worker.protocol import WorkerSpec, read_events


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def settles(pid: int, wanted, timeout: float = 10.0) -> bool:
    """The process's status is `wanted` within `timeout` (a signal is delivered asynchronously)."""
    deadline = time.time() + timeout
    while not wanted(psutil.Process(pid).status()):
        if time.time() > deadline:
            return False
        time.sleep(0.01)
    return True


def sleeper(tmp_path: Path, name: str) -> SpareRank:
    """A stand-in spare: a process that never becomes ready."""
    proc = Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=PIPE, start_new_session=True)
    return SpareRank(proc, tmp_path / f"{name}.ready", tmp_path / f"{name}.stdout", tmp_path / f"{name}.stderr")


def hang_spec(tmp_path: Path) -> WorkerSpec:
    """A trial whose rank hangs after reading its spec (the `hang` fault)."""
    config, workload = Config(1, 4, 0, "fp32"), make_workload("tiny")
    return WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path / "trial"), fault="hang")


def test_ranks_ahead_only_for_the_worker_or_shim_launched_here_with_a_core_beside_each_rank():
    assert ahead_allowed(LaunchOptions(ranks=1), cores=2)
    assert ahead_allowed(LaunchOptions(ranks=4), cores=16)
    assert ahead_allowed(LaunchOptions(ranks=1, module="autotune.script"), cores=2)  # script mode's shim
    assert not ahead_allowed(LaunchOptions(ranks=2), cores=2)  # spares' imports would take the ranks' cores
    assert not ahead_allowed(LaunchOptions(ranks=1, launcher="torchrun"), cores=8)
    assert not ahead_allowed(LaunchOptions(ranks=1, module="my.worker"), cores=8)  # no --spare to start it with
    place = Placement((0,), (0,), 1, 2, 0, "10.0.0.1", 29500)
    assert not ahead_allowed(LaunchOptions(ranks=1, placement=place), cores=8)


def test_spares_another_trial_cannot_use_are_ended_and_unready_ones_wait_while_a_trial_measures(tmp_path):
    spares = Spares(tmp_path)
    key = Spares.key(["python", "-m", "autotune.worker"], [{"RANK": "0", "MASTER_PORT": "1"}])
    assert key == Spares.key(["python", "-m", "autotune.worker"], [{"RANK": "0", "MASTER_PORT": "2"}])  # port aside
    other = Spares.key(["python", "-m", "autotune.worker"], [{"RANK": "0", "OMP_NUM_THREADS": "1"}])

    spare = sleeper(tmp_path, "a")
    spares.held = key, [spare]
    spares.hold_unready()  # not ready: off the cores while the trial measures
    assert settles(spare.proc.pid, lambda status: status == psutil.STATUS_STOPPED)
    spares.resume()
    assert settles(spare.proc.pid, lambda status: status != psutil.STATUS_STOPPED)
    assert spares.take(other) is None and gone(spare.proc.pid) and spares.held is None

    dead = sleeper(tmp_path, "b")
    spares.held = key, [dead]
    dead.proc.kill()
    dead.proc.wait()
    assert spares.take(key) is None  # a trial never goes to a rank that died

    alive = sleeper(tmp_path, "c")
    spares.held = key, [alive]
    assert spares.take(key) == [alive] and spares.held is None
    spares.held = key, [alive]
    spares.close()
    assert gone(alive.proc.pid) and spares.held is None


def test_a_spare_imports_says_it_is_ready_and_leaves_when_no_trial_comes(tmp_path):
    ready = tmp_path / "spare.ready"
    proc = Popen([sys.executable, "-m", "autotune.worker", "--spare", str(ready)], stdin=PIPE, stdout=PIPE,
                 stderr=PIPE, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not ready.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        told = json.loads(ready.read_text())
        assert told["pid"] == proc.pid and told["import_s"] > 0
        proc.stdin.close()  # the sweep ended: no trial for it
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


# A rank that made a spare's imports, then DeepSpeed's initialize of a tiny ZeRO-2 model on one gloo rank: the modules
# that initialize still imported, one per line.
INITIALIZE_AFTER_SPARE = """
import json, os, sys
from autotune.worker.main import spare_imports
reading, waiting = os.pipe()  # a spare's stdin, its trial not handed over yet
sys.stdin = os.fdopen(reading)
spare_imports(initialize=True)
import deepspeed, torch
from autotune.worker.model import build
from autotune.values.workload import make_workload
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
model = build(make_workload("tiny").model, 0, torch.device("cpu"), torch.float32)
ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
      "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
before = set(sys.modules)
deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
print(json.dumps(sorted(set(sys.modules) - before)))
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_a_spares_imports_leave_deepspeeds_initialize_nothing_to_import():
    # Without INITIALIZE_IMPORTS, this initialize imported ~1,400 modules (TorchDynamo and Inductor through DeepSpeed's
    # Muon optimizer, its expert-parallel modules): ~1.2 s of the tiny model's 1.4 s initialize here, on the trial's
    # clock. A DeepSpeed that imports more at initialize shows here first.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # A trial's environment: the ops (fused_adam, the CPU's shm_comm) the other real trials build and load, not
    # a second build in torch's default folder (~2 minutes on a fresh machine).
    env = trial_environment(LaunchOptions(ranks=1), "cpu")
    done = subprocess.run([sys.executable, "-c", INITIALIZE_AFTER_SPARE, str(port)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = json.loads(done.stdout.splitlines()[-1])
    assert not [m for m in imported if m.startswith(("torch._dynamo", "torch._inductor", "deepspeed."))], imported
    assert len(imported) <= 5, imported


def test_a_trial_whose_spare_dies_before_taking_it_starts_its_own_ranks(tmp_path, monkeypatch):
    # A spare that reads its trial, then exits as one whose imports opened the device does.
    lost = tmp_path / "lost"
    proc = Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); print('device opened', file=sys.stderr); "
                  f"sys.exit({SPARE_DEVICE_EXIT})"], stdin=PIPE, stderr=open(f"{lost}.stderr", "wb"), start_new_session=True)
    spare = SpareRank(proc, Path(f"{lost}.ready"), Path(f"{lost}.stdout"), Path(f"{lost}.stderr"))
    spares = Spares(tmp_path / "spares")
    monkeypatch.setattr(spares, "take", lambda key: [spare])
    spec = hang_spec(tmp_path)
    outcome = run_worker(spec, LaunchOptions(ranks=1, timeout_s=3.0), spares)
    assert outcome.status == "timeout" and "in hang" in outcome.error  # the trial's own rank ran it, to its hang
    assert proc.returncode == 3 and proc.pid in outcome.pids
    hung = read_events(spec.log_dir, 0)[-1]
    assert hung["phase"] == "hang" and hung["pid"] != proc.pid
    assert "device opened" in (Path(spec.log_dir) / "rank0.ahead.stderr").read_text()
    assert not lost.with_suffix(".stderr").exists()
    assert spares.off  # its exit said its imports opened the device: every spare's would, none is started again
    spares.start(sys.executable, "autotune.worker", [{}])
    assert spares.held is None


@pytest.mark.parametrize("module", ["autotune.worker", "autotune.script"])
def test_the_worker_and_the_shim_want_a_spec_or_spare(module):
    done = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give the trial's spec.json, or --spare READY" in done.stderr


@pytest.mark.slow
def test_a_sweeps_first_trial_runs_on_ranks_started_while_its_ops_built(tmp_path, monkeypatch):
    import autotune.backends.deepspeed as backend_module

    def building(*args, before_child, **kwargs):  # the preflight of a fresh machine: a child builds for a while
        before_child()
        (spare,) = backend.spares.held[1]
        deadline = time.time() + 120
        while not spare.ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        return ("fused_adam",)

    monkeypatch.setattr(backend_module, "preflight", building)
    measure = MeasureSettings(warmup_steps=1, min_steps=2, max_steps=3, rel_tol=0.5, max_measure_s=60.0)
    backend = DeepSpeedBackend(make_workload("tiny", global_batch=4), None, PROFILES["cpu"], logs_dir=tmp_path / "logs",
                               timeout_s=600, measure=measure, in_sequence=True)
    config = Config(0, 2, 0, "fp32")
    try:
        backend.prepare(config, lambda line: None)
        first = backend.run(config)
    finally:
        backend.close()
    assert first.status == "ok", first.error
    assert first.extra["import_ahead_s"] > 0 and first.extra["phases_s"]["import_s"] < first.extra["import_ahead_s"]
    assert first.extra["steps_applied"] >= 1 and first.extra["loss_last"] != first.extra["loss_first"]
    assert backend.spares.held is None and not [p for p in (tmp_path / "logs" / "spares").iterdir()]

    # A backend of one trial (`autotune trial`, a Ray task's) starts none while its ops build.
    lone = DeepSpeedBackend(make_workload("tiny", global_batch=4), None, PROFILES["cpu"], logs_dir=tmp_path / "lone")
    monkeypatch.setattr(backend_module, "preflight", lambda *args, before_child, **kwargs: before_child() or ())
    lone.prepare(config, lambda line: None)
    assert lone.spares.held is None


@pytest.mark.slow
def test_a_sweeps_trials_from_the_third_run_on_ranks_started_ahead_and_nothing_is_left(tmp_path):
    measure = MeasureSettings(warmup_steps=1, min_steps=2, max_steps=3, rel_tol=0.5, max_measure_s=60.0)
    backend = DeepSpeedBackend(make_workload("tiny", global_batch=4), None, PROFILES["cpu"], logs_dir=tmp_path / "logs",
                               timeout_s=600, measure=measure)
    assert ahead_allowed(backend.launch), "a machine with 2 cores or more"
    configs = [Config(0, 2, 0, "fp32"), Config(1, 2, 0, "fp32"), Config(0, 2, 1, "fp32")]
    results = [backend.run(c) for c in configs]
    assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]
    first, second, third = results
    assert first.extra["import_ahead_s"] is None and second.extra["import_ahead_s"] is None
    assert third.extra["import_ahead_s"] > third.extra["phases_s"]["import_s"]  # made before its launch
    assert third.extra["launch_to_first_step_s"] < third.extra["import_ahead_s"] + third.extra["launch_to_first_step_s"]
    # It trained as any trial: optimizer steps applied, loss finite and moving, its own logs.
    assert third.extra["steps_applied"] >= 1 and third.extra["loss_last"] != third.extra["loss_first"]
    log_dir = Path(third.extra["log_dir"])
    assert log_dir.name.startswith("0003-") and (log_dir / "rank0.stderr").exists()
    assert sorted(p.name[:4] for p in (tmp_path / "logs").iterdir() if p.name[0].isdigit()) == ["0001", "0002", "0003"]

    # The spare started during the third trial dies: the fourth starts its own ranks and is measured as well.
    key, held = backend.spares.held
    held[0].proc.kill()
    held[0].proc.wait()
    fourth = backend.run(Config(1, 2, 1, "fp32"))
    assert fourth.status == "ok" and fourth.extra["import_ahead_s"] is None
    assert Path(fourth.extra["log_dir"]).name.startswith("0004-")
    assert gone(held[0].proc.pid)

    _, waiting = backend.spares.held
    backend.close()
    assert all(gone(r.proc.pid) for r in waiting) and backend.spares.held is None
    assert not [p for p in (tmp_path / "logs" / "spares").iterdir()]
