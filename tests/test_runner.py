"""The runner against real worker processes that hang (the `hang` fault stops a rank before it imports
torch, after starting a child process): timeout, the tuner's interruption, the tuner's death, and that no
process of the trial is left behind. Real DeepSpeed trials are in test_trial_real.py."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.values.config import Config
from autotune.values.dsconfig import ds_config
from autotune.trials.runner import (LaunchOptions, describe_exit, extensions_dir, free_port, remove_shm_buffers,
                                    run_worker)
from autotune.worker.protocol import WorkerSpec, read_events
from autotune.values.workload import make_workload

CONFIG = Config(1, 4, 0, "bf16")


def gone(pid: int) -> bool:
    """Not running: absent, or a zombie waiting for a parent that is not ours (e.g. the container's init)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def hang_spec(tmp_path, ranks=1):
    workload = make_workload("tiny", gpus=ranks)
    return WorkerSpec(CONFIG, workload, ds_config(CONFIG, workload), str(tmp_path / "trial"), fault="hang")


def wait_for_hang(log_dir, ranks, timeout=60.0):
    """The pids of every rank and of each rank's child, once all ranks hang."""
    deadline = time.time() + timeout
    while True:
        events = [read_events(log_dir, r) for r in range(ranks)]
        if all(e and e[-1]["phase"] == "hang" for e in events):
            return [e[-1]["pid"] for e in events] + [e[-1]["child_pid"] for e in events]
        if time.time() > deadline:
            break
        time.sleep(0.05)
    raise AssertionError(f"ranks did not reach the hang in {timeout} s")


@pytest.mark.parametrize("ranks", [1, 2])
def test_hanging_trial_times_out_and_leaves_no_process(tmp_path, ranks):
    spec = hang_spec(tmp_path, ranks)
    started = time.time()
    outcome = run_worker(spec, LaunchOptions(ranks=ranks, timeout_s=2.0))
    assert outcome.status == "timeout"
    assert "timeout of 2 s" in outcome.error and "in hang" in outcome.error
    assert 2.0 <= outcome.wall_time_s <= time.time() - started
    hung = wait_for_hang(spec.log_dir, ranks, timeout=0)  # the ranks got there before being killed
    assert len(hung) == 2 * ranks
    assert set(hung) <= set(outcome.pids)
    assert all(gone(pid) for pid in outcome.pids)
    assert all(code == -signal.SIGKILL for code in outcome.exit_codes)


TUNER = textwrap.dedent("""
    import sys
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.values.config import Config
    from autotune.values.workload import make_workload
    backend = DeepSpeedBackend(make_workload("tiny", gpus=2), logs_dir=sys.argv[1], timeout_s=600, fault="hang")
    try:
        backend.run(Config(1, 4, 0, "bf16"))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
""")


def _start_tuner(tmp_path):
    logs = tmp_path / "logs"
    tuner = subprocess.Popen([sys.executable, "-c", TUNER, str(logs)], stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(logs.glob("*/rank1.events.jsonl")) and time.time() < deadline:
        time.sleep(0.05)
    (log_dir,) = logs.iterdir()
    return tuner, log_dir, wait_for_hang(log_dir, 2)


@pytest.mark.slow
def test_interrupting_the_tuner_ends_every_process_of_the_trial(tmp_path):
    tuner, _, pids = _start_tuner(tmp_path)
    for rank_pid in pids[:2]:  # ranks find the interpreter's own tools (ninja for op builds) first
        environ = psutil.Process(rank_pid).environ()
        assert environ["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
        assert environ["TORCH_EXTENSIONS_DIR"] == extensions_dir(sys.executable)  # C++ ops per environment
    tuner.send_signal(signal.SIGINT)
    out, _ = tuner.communicate(timeout=30)
    assert tuner.returncode == 130 and out.strip() == "interrupted"  # the interrupt reached the tuner
    assert all(gone(pid) for pid in pids)  # both ranks and the children they started


@pytest.mark.slow
def test_ranks_die_with_a_killed_tuner(tmp_path):
    tuner, _, pids = _start_tuner(tmp_path)
    ranks, children = pids[:2], pids[2:]
    tuner.send_signal(signal.SIGKILL)  # no cleanup code runs: the kernel ends the ranks (PR_SET_PDEATHSIG)
    tuner.wait()
    deadline = time.time() + 10
    while not all(gone(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in ranks)
    for pid in children:  # what a rank started is beyond the kernel's reach here; end it ourselves
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_launch_options_and_helpers():
    with pytest.raises(ValueError, match="launcher='mpirun'"):
        LaunchOptions(launcher="mpirun")
    with pytest.raises(ValueError, match="ranks=0"):
        LaunchOptions(ranks=0)
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free indeed
    assert describe_exit(-9) == "was killed by signal SIGKILL"
    assert extensions_dir("/a/.venv/bin/python") != extensions_dir("/b/.venv/bin/python")
    assert describe_exit(3) == "exited with code 3"


def test_rank_0_names_a_taken_rendezvous_port_and_its_report_says_which(monkeypatch):
    """The bind's EADDRINUSE becomes PortTaken, whose report carries the port the runner relaunches on; any other
    failure's report carries none."""
    import datetime

    import torch

    from autotune.worker.main import PortTaken, host_store, port_evidence

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(name, value)
        # Set (empty: not torchrun's), so that monkeypatch restores its absence after host_store sets it: left set
        # in this process, every later trial it launched waited on a store nobody served.
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "")
        with pytest.raises(PortTaken, match=f"127.0.0.1:{port} was taken by another process") as raised:
            host_store(torch, datetime.timedelta(seconds=5))
    assert port_evidence(raised.value) == {"port_taken": port}
    assert port_evidence(OSError(98, "Address already in use")) == {}


def test_a_trials_ranks_host_their_own_store_whatever_the_tuner_inherited(monkeypatch):
    """A tuner started under torchrun's agent (or a process where host_store ran) passed TORCHELASTIC_USE_AGENT_STORE
    on: rank 0 then hosted no store and every rank waited 30 minutes in dist_init (seen in CI)."""
    from autotune.trials.runner import ranks_environment

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "TORCHELASTIC_USE_AGENT_STORE" not in ranks_environment(LaunchOptions(), "cpu", free_port())


def test_a_config_deepspeed_cannot_express_is_unsupported_without_a_launch(tmp_path):
    backend = DeepSpeedBackend(make_workload("tiny"), 2**30, logs_dir=tmp_path)
    result = backend.run(Config(3, 4, 0, "bf16", "nvme"))
    assert result.status == "unsupported" and "nvme_path" in result.error
    log_dir = tmp_path / "0001-z3_mb4_ck0_bf16_oo_nvme"
    assert result.extra["log_dir"] == str(log_dir)
    assert json.loads((log_dir / "result.json").read_text())["status"] == "unsupported"
    assert not list(log_dir.glob("rank*"))  # nothing was launched


def test_only_the_trials_own_shm_buffers_are_removed(tmp_path):
    uid = os.getuid()
    ours = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_4242_{rank}" for rank in (0, 1)]
    others = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_42420_0",  # another trial's port
              tmp_path / f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_4242_0",  # another user's
              tmp_path / f"deepspeed_allreduce_buffer_{uid}_10.0.0.1_4242_0"]  # another master
    for path in ours + others:
        path.write_bytes(b"x")
    assert sorted(remove_shm_buffers("127.0.0.1", 4242, tmp_path)) == ours
    assert all(p.exists() for p in others) and not any(p.exists() for p in ours)
