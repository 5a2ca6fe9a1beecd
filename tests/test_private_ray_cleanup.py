"""The Ray agents a private instance (`--ray-address local`, `autotune sweep`) leaves behind when its driver is
killed with SIGKILL: ray::DashboardAgent and ray::RuntimeEnvAgent outlive their raylet by about a minute (blocked
publishing its death to the GCS, which is gone too: autotune.trials.cluster.reap_orphaned_agents), and the next
private start ends them. Only those: never an agent still under its raylet, nor one of a session ds-autotune did not
start (a user's own cluster)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from autotune.trials import cluster

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="Linux /proc")
ROOT = Path(__file__).resolve().parents[1]


def session(root: Path, marked: bool) -> Path:
    logs = root / "logs"
    logs.mkdir(parents=True)
    if marked:
        (root / cluster.PRIVATE_MARK).write_text("1\n")
    return logs


def fake(title: str, log: Path, parent: str | None = None) -> subprocess.Popen:
    """A process titled `title` holding `log` open (its stdout), a child of this process, or of a bash named
    `parent` (then the Popen is that bash's)."""
    command = f"exec -a {title} sleep 60 > {log}"
    if parent is not None:
        command = f"{command} & wait"
    popen = subprocess.Popen(["bash", "-c", command], executable=parent)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the title shows
        pids = [popen.pid] + [c.pid for c in psutil.Process(popen.pid).children()]
        if any(psutil.Process(p).cmdline()[:1] == [title] for p in pids if psutil.pid_exists(p)):
            return popen
        time.sleep(0.02)
    raise AssertionError(f"{title} never showed")


def titled(popen: subprocess.Popen) -> int:
    """The pid of the titled process (the bash itself, or its child under a fake raylet)."""
    children = psutil.Process(popen.pid).children()
    return children[0].pid if children else popen.pid


def test_only_orphaned_agents_of_a_marked_session_are_ended(tmp_path):
    raylet = tmp_path / "raylet"  # a bash whose process name is `raylet`: the parent of a running agent
    raylet.symlink_to(shutil.which("bash") or "/bin/bash")
    marked, unmarked = session(tmp_path / "private", True), session(tmp_path / "users", False)
    procs = {
        "orphan": fake("ray::DashboardAgent", marked / "dashboard_agent.out"),
        "orphan2": fake("ray::RuntimeEnvAgent", marked / "runtime_env_agent.out"),
        "under its raylet": fake("ray::RuntimeEnvAgent", marked / "runtime_env_agent.err", parent=str(raylet)),
        "a user's cluster": fake("ray::DashboardAgent", unmarked / "dashboard_agent.out"),
        "not an agent": fake("ray::IDLE", marked / "worker.out"),
    }
    pids = {name: titled(p) for name, p in procs.items()}
    try:
        ended = cluster.reap_orphaned_agents()
        assert {pids["orphan"], pids["orphan2"]} <= set(ended)
        assert not {pids[n] for n in ("under its raylet", "a user's cluster", "not an agent")} & set(ended)
        assert procs["orphan"].wait(timeout=5) == -signal.SIGKILL
        assert procs["orphan2"].wait(timeout=5) == -signal.SIGKILL
        for name in ("under its raylet", "a user's cluster", "not an agent"):
            assert procs[name].poll() is None, name
    finally:
        for p in procs.values():
            for pid in {titled(p), p.pid} if p.poll() is None else ():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)


def test_no_proc_no_reaping(tmp_path):
    assert cluster.reap_orphaned_agents(tmp_path / "none") == []


DRIVER = textwrap.dedent("""
    import sys, time
    import ray
    from autotune.trials import cluster
    cluster.connect(cluster.LOCAL, num_cpus=1)
    print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
    if sys.argv[1] == "hold":
        time.sleep(600)
    cluster.disconnect()
""")


def driver(mode: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    popen = subprocess.Popen([sys.executable, "-c", DRIVER, mode], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, env=env)
    assert popen.stdout is not None
    return popen, popen.stdout.readline().strip()


def agents_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if p.cmdline()[:1] and p.cmdline()[0] in cluster.AGENT_TITLES]


@pytest.mark.slow
def test_the_next_private_start_ends_the_agents_a_killed_one_left(tmp_path):
    first, folder = driver("hold")
    agents: list[psutil.Process] = []
    try:
        assert (Path(folder) / cluster.PRIVATE_MARK).is_file()  # its session is marked as ds-autotune's
        deadline = time.monotonic() + 20
        while len(agents) < 2 and time.monotonic() < deadline:
            agents = agents_of(first.pid)
            time.sleep(0.1)
        assert {a.cmdline()[0] for a in agents} == set(cluster.AGENT_TITLES)
        first.kill()
        first.wait()
        time.sleep(2)
        assert all(a.is_running() and a.status() != psutil.STATUS_ZOMBIE for a in agents)  # Ray leaves them ~60 s
        second, _ = driver("exit")
        assert second.wait(timeout=60) == 0
        gone = time.monotonic() + 5
        while any(a.is_running() and a.status() != psutil.STATUS_ZOMBIE for a in agents) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not [a for a in agents if a.is_running() and a.status() != psutil.STATUS_ZOMBIE]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        for a in agents:
            try:
                a.kill()
            except psutil.Error:
                pass
