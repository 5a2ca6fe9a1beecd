"""Issue 14, processes: what a killed tuner leaves in /dev/shm is removed at the next start (never a live
trial's), nothing of a trial or of `--ray-address local` listens beyond loopback whatever the environment
says, an unreachable `--ray-address` is one line, and SIGKILL / SIGTERM of a tuner mid-trial lose nothing.

The slow tests run real DeepSpeed trials (two ranks of the tiny model on the CPU) and a real local Ray
instance; the others run the real runner on a hanging worker, or the functions on a temporary directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from autotune.backends.factory import SLEEP_ENV
from autotune.values.config import Config, ConfigError
from autotune.trials import cluster
from autotune.values.dsconfig import ds_config
from autotune.values.results import read_results
from autotune.trials.runner import (OWNER_PREFIX, SHM_DIR, LaunchOptions, claim_port, release_port, remove_stale_shm,
                             run_worker)
from autotune.worker.protocol import WorkerSpec, read_events
from autotune.values.workload import make_workload

UID = os.getuid()
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def segments(port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    return sorted(shm_dir.glob(f"deepspeed_allreduce_buffer_{UID}_127.0.0.1_{port}_*"))


def marker(port: int, shm_dir: Path = SHM_DIR) -> Path:
    return shm_dir / f"{OWNER_PREFIX}_{UID}_{port}.owner"


def fake_segments(port: int, shm_dir: Path, ranks: int = 2) -> list[Path]:
    paths = [shm_dir / f"deepspeed_allreduce_buffer_{UID}_127.0.0.1_{port}_{rank}" for rank in range(ranks)]
    for path in paths:
        path.write_bytes(b"x")
    return paths


def claimed_by_a_dead_runner(shm_dir: Path) -> int:
    """A port claimed by a runner process that has exited since (as a SIGKILLed tuner's)."""
    code = "import sys; from pathlib import Path; from autotune.trials.runner import claim_port; print(claim_port(Path(sys.argv[1])))"
    return int(subprocess.run([sys.executable, "-c", code, str(shm_dir)], capture_output=True, text=True,
                              check=True).stdout)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def listeners(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of these processes."""
    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections("inet")
        except psutil.Error:
            continue
        found += [(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.Error:
        return []


def other_interface() -> str | None:
    """A non-loopback interface with an IPv4 address, if this machine has one."""
    for name, addrs in psutil.net_if_addrs().items():
        if name != "lo" and any(a.family == socket.AF_INET and not a.address.startswith("127.") for a in addrs):
            return name
    return None


# -- stale shared memory: the rules, on a temporary directory

def test_only_segments_of_dead_runners_nobody_holds_are_removed(tmp_path):
    dead = claimed_by_a_dead_runner(tmp_path)
    dead_segments = fake_segments(dead, tmp_path)
    live = claim_port(tmp_path)  # this process: a live runner
    live_segments = fake_segments(live, tmp_path)
    held = claimed_by_a_dead_runner(tmp_path)  # its runner is dead, but a survivor still holds a segment
    held_segments = fake_segments(held, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(1, flush=True); "
                               "time.sleep(600)", str(held_segments[1])], stdout=subprocess.PIPE, text=True)
    other_ns = 1
    marker(other_ns, tmp_path).write_text(json.dumps({"pid": 1, "started": 0.0, "pidns": "pid:[1]"}))
    ns_segments = fake_segments(other_ns, tmp_path)  # a container sharing /dev/shm: its pids are not ours to judge
    torn_new, torn_old = 2, 3  # markers whose runner died between creating and writing them
    marker(torn_new, tmp_path).write_text("")
    marker(torn_old, tmp_path).write_text("")
    os.utime(marker(torn_old, tmp_path), (time.time() - 3600, time.time() - 3600))
    torn_segments = fake_segments(torn_new, tmp_path) + fake_segments(torn_old, tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = 4
    marker(planted, tmp_path).symlink_to(victim)  # a link planted where a marker would be: never followed
    try:
        assert holder.stdout.readline().strip() == "1"
        assert json.loads(marker(dead, tmp_path).read_text())["pid"] != os.getpid()
        removed = set(remove_stale_shm(tmp_path))
        assert removed == {*dead_segments, marker(dead, tmp_path), held_segments[0], *torn_segments[2:],
                           marker(torn_old, tmp_path)}
        assert all(p.exists() for p in live_segments + ns_segments + torn_segments[:2] + [held_segments[1]])
        assert marker(live, tmp_path).exists() and marker(held, tmp_path).exists()  # looked at again next time
        assert marker(planted, tmp_path).is_symlink() and victim.read_text() == "keep"
    finally:
        holder.kill()
        holder.wait()
    assert set(remove_stale_shm(tmp_path)) == {held_segments[1], marker(held, tmp_path)}  # the survivor is gone
    release_port(live, tmp_path)
    assert not marker(live, tmp_path).exists()


def test_claiming_a_port_never_takes_a_marked_one_nor_follows_a_link(tmp_path, monkeypatch):
    ports = iter([5000, 5001, 5002])
    monkeypatch.setattr("autotune.trials.runner.free_port", lambda: next(ports))
    marker(5000, tmp_path).write_text("{}")  # another trial's
    victim = tmp_path / "victim"
    victim.write_text("keep")
    marker(5001, tmp_path).symlink_to(victim)
    assert claim_port(tmp_path) == 5002
    owner = json.loads(marker(5002, tmp_path).read_text())
    assert owner["pid"] == os.getpid() and owner["started"] == psutil.Process().create_time()
    assert victim.read_text() == "keep" and marker(5000, tmp_path).read_text() == "{}"
    for port in (5000, 5001, 5002):  # only its own marker is dropped at the end of the trial
        release_port(port, tmp_path)
    assert marker(5000, tmp_path).exists() and marker(5001, tmp_path).is_symlink()
    assert not marker(5002, tmp_path).exists()


def test_a_trial_start_removes_what_a_killed_tuners_trial_left(tmp_path):
    """The real runner (a hanging worker: no torch) against the real /dev/shm."""
    dead = claimed_by_a_dead_runner(SHM_DIR)
    left = fake_segments(dead, SHM_DIR)
    live = claim_port()  # a trial of a live tuner (this one) beside it
    kept = fake_segments(live, SHM_DIR)
    try:
        workload = make_workload("tiny")
        config = Config(1, 4, 0, "fp32")
        spec = WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path / "trial"), fault="hang")
        outcome = run_worker(spec, LaunchOptions(timeout_s=1.0))
        assert outcome.status == "timeout"
        assert not any(p.exists() for p in left) and not marker(dead).exists()
        assert all(p.exists() for p in kept) and marker(live).exists()
        assert not marker(outcome.master_port).exists()  # the trial's own claim ends with it
    finally:
        for path in [*left, *kept, marker(dead)]:
            path.unlink(missing_ok=True)
        release_port(live)


# -- Ray addresses

def test_an_unreachable_ray_address_is_one_line_and_records_nothing(tmp_path):
    run = subprocess.run([sys.executable, "-m", "autotune.cli", "tune", "--model", "tiny", "--backend", "simulated",
                          "--trials", "2", "--ray-address", "127.0.0.1:1", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune tune: error: cannot reach Ray cluster at 127.0.0.1:1")
    assert "Traceback" not in run.stdout + run.stderr
    assert not (tmp_path / "run").exists()
    sweep = tmp_path / "sweep.yaml"  # a sweep file's workloads: nor a sweep directory, its copy or a lock
    sweep.write_text("defaults: {backend: simulated, hardware: cpu, trials: 2}\nworkloads: [{name: a, model: tiny}]\n")
    run = subprocess.run([sys.executable, "-m", "autotune.cli", "sweep", str(sweep), "--ray-address", "127.0.0.1:1",
                          "--out", str(tmp_path / "sweep")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("autotune sweep: error: cannot reach Ray cluster"), run.stderr
    assert not (tmp_path / "sweep").exists()


def serving(reply: bytes | None):
    """A port on 127.0.0.2 (Ray, and so the probe, replaces 127.0.0.1 by this machine's routable address)
    that accepts connections and answers each first message with `reply` (None: never says a word)."""
    server = socket.create_server(("127.0.0.2", 0))
    accepted = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            if reply is not None:
                try:
                    conn.recv(65536)
                    conn.sendall(reply)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in accepted:
        conn.close()


@pytest.fixture
def silent_server():
    """A port that accepts connections and never says a word (not a Ray server)."""
    yield from serving(None)


def test_a_port_that_is_no_ray_server_is_refused(silent_server):
    with pytest.raises(ConfigError, match=rf"cannot reach Ray cluster at 127.0.0.2:{silent_server}: nothing there "
                                          "answered as a Ray server"):
        cluster.check_reachable(f"127.0.0.2:{silent_server}", timeout_s=0.5)
    with pytest.raises(ConfigError, match="allowed local, auto, HOST:PORT"):
        cluster.check_reachable("nohost")


def test_ray_init_that_never_returns_is_bounded():
    release = threading.Event()

    class Stuck:  # Ray retrying a server that accepted the connection, in calls no signal interrupts
        def init(self, **kwargs):
            release.wait(60)

    try:
        err = cluster._init_within(Stuck(), "10.0.0.1:6379", timeout_s=0.3)
        assert isinstance(err, TimeoutError) and "0.3 s" in str(err)
    finally:
        release.set()


def test_what_a_library_writes_to_the_stderr_descriptor_is_held_then_passed_on_or_dropped():
    code = ("import os, sys\nfrom autotune.trials import cluster\n"
            "for keep in (True, False):\n"
            "    with cluster._stderr_held() as held:\n"
            "        os.write(2, f'native {keep}\\n'.encode())\n"
            "        print(f'python {keep}', file=sys.stderr)\n"
            "        held.keep = keep\n"
            "    print(f'after {keep}', file=sys.stderr)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == ["native True", "python True", "after True", "after False"]


@pytest.fixture
def http2_server():
    """A port that answers as an HTTP/2 server (its SETTINGS frame), then never again: a gRPC endpoint that
    is no Ray cluster (or a proxy that accepts every connection)."""
    yield from serving(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]) + bytes([0, 0, 0, 4, 1, 0, 0, 0, 0]))  # SETTINGS, ACK


@pytest.mark.slow
def test_real_ray_against_a_server_that_is_no_ray_cluster_gives_up_in_one_line(http2_server):
    code = ("import sys\nfrom autotune.values.config import ConfigError\nfrom autotune.trials import cluster\n"
            "cluster.CONNECT_TIMEOUT_S = 3\ntry:\n    cluster.connect(sys.argv[1])\nexcept ConfigError as err:\n"
            "    print(err)\n    sys.exit(2)\n")
    run = subprocess.run([sys.executable, "-c", code, f"127.0.0.2:{http2_server}"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout.strip() == (f"cannot reach Ray cluster at 127.0.0.2:{http2_server}: no Ray cluster answered "
                                  "within 3 s; is it a Ray cluster's address (the head's GCS port, or ray://HOST:PORT "
                                  "of its Ray Client server)? And if it uses token authentication, are "
                                  "RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN_PATH=FILE, RAY_AUTH_TOKEN, or "
                                  "~/.ray/auth_token) set in this environment?")


LOCAL_RAY_SWEEP_SLEEP_S = "2"


@pytest.mark.slow
def test_ray_local_ignores_the_environment_and_listens_on_loopback_only(tmp_path):
    """`tune --ray-address local` with RAY_ADDRESS naming nothing and Ray's all-interfaces switch inherited:
    it starts its own instance, every process of which listens on loopback only."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", cluster.LOOPBACK_ENV: "1",
           SLEEP_ENV: LOCAL_RAY_SWEEP_SLEEP_S}
    out = tmp_path / "run"
    tuner = subprocess.Popen([sys.executable, "-m", "autotune.cli", "tune", "--model", "tiny", "--backend",
                              "simulated", "--strategy", "random", "--trials", "2", "--concurrency", "1",
                              "--ray-address", "local", "--out", str(out)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen: list[tuple[int, str, int]] = []
        names: set[str] = set()
        deadline = time.monotonic() + 120
        while tuner.poll() is None and time.monotonic() < deadline:
            procs = tree(tuner.pid)
            names = set()
            for pid in procs:
                try:
                    names.add(psutil.Process(pid).name())
                except psutil.Error:
                    pass
            if {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names):
                time.sleep(1.0)  # the trial's worker and the agents are up
                seen = listeners(tree(tuner.pid))
                break
            time.sleep(0.2)
        output, _ = tuner.communicate(timeout=120)
    finally:
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()
    assert tuner.returncode == 0, output
    assert len(read_results(out / "trials.jsonl")) == 2
    assert seen, f"no listening socket seen among {names}"
    assert {ip for _, ip, _ in seen} <= set(LOOPBACK), seen
    assert len({pid for pid, _, _ in seen}) >= 3  # the driver, the GCS, the raylet (and workers) were looked at


# -- real trials: sockets, SIGKILL then --resume, SIGTERM

TUNER = textwrap.dedent("""
    # `autotune tune` with the deepspeed backend measuring 2-3 steps, so that a trial takes seconds
    import sys
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.backends.factory import BackendKind, register_backend
    from autotune.cli import main
    from autotune.values.dsconfig import DsOptions
    from autotune.worker.measure import MeasureSettings

    def build(settings, run_dir, options):
        return DeepSpeedBackend(settings.workload, settings.memory_budget_bytes, settings.hardware, DsOptions(),
                                logs_dir=run_dir.logs_dir, timeout_s=900,
                                measure=MeasureSettings(1, 2, 3, 0.5, 60.0))

    register_backend(BackendKind("deepspeed", build, real=True))
    sys.exit(main(sys.argv[1:]))
""")
SPACE = """\
zero_stage: [0, 1]
micro_batch: [8]
ckpt_interval: [0]
precision: [fp32]
offload_optimizer: [none]
offload_param: [none]
"""
PAST_RENDEZVOUS = ("build", "initialize", "warmup", "measure")


def _ranks_past_rendezvous(log_dir: Path, tuner: int, ranks: int = 2) -> list[int] | None:
    """The pids of the trial's ranks once all of them, children of `tuner` (a resumed trial's log
    directory also holds the events of the killed tuner's ranks), are past the rendezvous."""
    events = [read_events(log_dir, rank) for rank in range(ranks)]
    if all(e and e[-1]["phase"] in PAST_RENDEZVOUS for e in events):
        pids = [e[-1]["pid"] for e in events]
        if all(psutil.pid_exists(pid) and psutil.Process(pid).ppid() == tuner for pid in pids):
            return pids
    return None


def _wait_for_trial(out: Path, tuner: subprocess.Popen, timeout: float = 600) -> list[int]:
    """The rank pids of the tuner's trial that runs once one trial is recorded, when both ranks are past
    the rendezvous (the first trial's ranks are gone before it is recorded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert tuner.poll() is None, tuner.communicate()[0]
        if (out / "trials.jsonl").is_file() and len(read_results(out / "trials.jsonl")) == 1:
            for log_dir in sorted((out / "logs").iterdir()):
                try:
                    pids = _ranks_past_rendezvous(log_dir, tuner.pid)
                except psutil.Error:
                    continue
                if pids:
                    return pids
        time.sleep(0.1)
    raise AssertionError(f"no second trial got past its rendezvous in {timeout} s")


def _port_of(tuner_pid: int) -> int:
    """The master port of the trial the tuner runs: the one it claimed."""
    for path in SHM_DIR.glob(f"{OWNER_PREFIX}_{UID}_*.owner"):
        try:
            if json.loads(path.read_text())["pid"] == tuner_pid:
                return int(path.name[:-len(".owner")].rsplit("_", 1)[1])
        except (OSError, ValueError, KeyError):
            continue
    raise AssertionError(f"no port claimed by the tuner {tuner_pid}")


@pytest.mark.slow
def test_real_trials_listen_on_loopback_and_survive_sigkill_resume_and_sigterm(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    out = tmp_path / "run"
    argv = [sys.executable, "-c", TUNER, "tune", "--model", "tiny", "--gpus", "2", "--hardware", "cpu",
            "--backend", "deepspeed", "--space", str(space), "--memory-budget", "3GiB", "--strategy", "grid",
            "--trials", "2", "--out", str(out)]
    env = dict(os.environ)
    iface = other_interface()
    if iface:  # an inherited choice of a routable interface: single-node trials use loopback anyway
        env.update(GLOO_SOCKET_IFNAME=iface, NCCL_SOCKET_IFNAME=iface)
    tuner = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    resumed = None
    try:
        # 1. trial 1 is recorded; trial 2 runs: every socket of the trial listens on loopback
        pids = _wait_for_trial(out, tuner)
        port = _port_of(tuner.pid)
        seen = listeners(tree(tuner.pid))
        assert {ip for _, ip, _ in seen} <= set(LOOPBACK), seen
        assert any(p == port and pid == pids[0] for pid, _, p in seen), (port, seen)  # rank 0 serves the store
        assert {pid for pid, _, _ in seen} == set(pids)  # gloo's sockets of both ranks
        first = (out / "trials.jsonl").read_bytes()
        assert [r.status for r in read_results(out / "trials.jsonl")] == ["ok"]

        # 2. SIGKILL: no cleanup runs; the ranks die with the tuner, the port's claim stays (no shared-memory
        # segment: trials do not load DeepSpeed's shm_comm, autotune.worker.main.skip_inference_ops)
        tuner.kill()
        tuner.wait()
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(gone(pid) for pid in pids)
        left = segments(port)
        # The port's claim stays until the next start of any ds-autotune process on the machine: under xdist that
        # may be another test's (CI at 6465771 saw it gone), so only its removal by the resume below is asserted.
        assert left == []
        assert (out / "trials.jsonl").read_bytes() == first

        # 3. --resume: its first trial start removes the claim; then SIGTERM mid-trial ends every rank
        resumed = subprocess.Popen(argv + ["--resume"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        pids = _wait_for_trial(out, resumed)
        assert not any(p.exists() for p in left) and not marker(port).exists()
        port = _port_of(resumed.pid)
        resumed.send_signal(signal.SIGTERM)
        output, _ = resumed.communicate(timeout=120)
        assert resumed.returncode == 130, output
        assert "Traceback" not in output
        assert all(gone(pid) for pid in pids)
        assert not segments(port) and not marker(port).exists()
        assert (out / "trials.jsonl").read_bytes() == first  # the interrupted trial is not recorded: nothing lost
    finally:
        for proc in (tuner, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
