"""The Ray driver against a real two-node Ray cluster on this machine (issue 7): `ray start --head` plus a
second node joined to it, with token authentication; the driver runs as the CLI in a subprocess, connecting
by address, as a user would. Simulated sweeps, a 3-workload batch sweep, real DeepSpeed trials, a worker
node killed mid-sweep, the driver killed and resumed, a wrong token refused; afterwards no process of the
cluster is left.

Nodes take 127.0.0.2 and 127.0.0.3 (loopback: the traffic never leaves the machine; Ray 2.60 binds its
gRPC servers to all interfaces unless a node's IP is exactly 127.0.0.1, which only a lone head can have,
so token authentication is what guards them, see docs/ray.md)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from autotune.backends.factory import SLEEP_ENV
from autotune.values.results import read_results
from micro import MICRO_FILE

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))
HEAD_IP, WORKER_IP, VICTIM_IP = "127.0.0.2", "127.0.0.3", "127.0.0.4"
NO_OFFLOAD_SPACE = """zero_stage: [0, 1]
micro_batch: [4, 8]
ckpt_interval: [0]
precision: [fp32]
offload_optimizer: [none]
offload_param: [none]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    base: Path  # short: Ray's socket paths live under the temp dir and must stay under ~107 characters
    address: str
    env: dict[str, str]
    nodes: dict[str, subprocess.Popen] = field(default_factory=dict)
    killed: list[psutil.Process] = field(default_factory=list)  # every process of a node that was ended

    def start_node(self, name: str, ip: str, head: bool = False, cpus: int = 1) -> None:
        args = [RAY, "start", "--block", f"--node-ip-address={ip}", f"--num-cpus={cpus}", "--num-gpus=0",
                "--object-store-memory=80000000", "--disable-usage-stats", f"--temp-dir={self.base / name}"]
        if head:
            args += ["--head", f"--port={self.address.split(':')[1]}", "--include-dashboard=false"]
        else:
            args += [f"--address={self.address}"]
        log = open(self.base / f"{name}.log", "w")
        # Own session (process group) per node: the node and everything it spawned can be ended by id.
        self.nodes[name] = subprocess.Popen(["nice", "-n", "19", *args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_nodes(self, count: int, timeout: float = 120) -> None:
        script = ("import ray,time; ray.init(address=%r, log_to_driver=False)\n"
                  "t=time.time()\n"
                  "while sum(n['Alive'] for n in ray.nodes()) < %d and time.time()-t < %f: time.sleep(0.5)\n"
                  "print(sum(n['Alive'] for n in ray.nodes()))") % (self.address, count, timeout)
        out = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True, text=True,
                             timeout=timeout + 60)
        assert out.stdout.strip().splitlines()[-1:] == [str(count)], out.stderr[-2000:]

    def node_processes(self, name: str) -> list[psutil.Process]:
        """A node's process group and all their descendants (the raylet's workers, running trials)."""
        group = self.nodes[name].pid
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == group:
                    found[proc.pid] = proc
                    found.update({c.pid: c for c in proc.children(recursive=True)})
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        return list(found.values())

    def kill_node(self, name: str) -> list[str]:
        """SIGKILL every process of a node, as if its machine died; returns their names."""
        names = []
        for proc in self.node_processes(name):
            try:
                names.append(proc.name())
                proc.kill()
                self.killed.append(proc)
            except psutil.NoSuchProcess:
                pass
        return names

    def stop_node(self, name: str) -> None:
        """SIGTERM, then (Ray's servers take their time) SIGKILL of the node's processes and descendants."""
        group = self.nodes[name].pid
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.time() + 3
        while time.time() < deadline and _group_alive(group):
            time.sleep(0.2)
        self.kill_node(name)
        self.nodes[name].wait(timeout=30)

    def processes(self) -> list[psutil.Process]:
        """Every process still alive that belongs to this cluster (its temp dir on the command line)."""
        left = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(str(self.base) in part for part in proc.info["cmdline"] or ()):
                    left.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return left


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group_alive(group: int) -> bool:
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == group and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return False


@contextlib.contextmanager
def two_node_cluster(prefix: str, env: dict[str, str], head_ip: str, worker_ip: str,
                     cpus: int = 1) -> Iterator[Cluster]:
    """A head and a worker node with token authentication; on exit every node is stopped and no process of
    theirs may be left."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    token = base / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    c = Cluster(base, f"{head_ip}:{free_port()}",
                {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "DS_ACCELERATOR": "cpu"})
    try:
        c.start_node("head", head_ip, head=True, cpus=cpus)
        time.sleep(3)
        c.start_node("worker", worker_ip, cpus=cpus)
        c.wait_nodes(2)
        yield c
    finally:
        for name in list(c.nodes):
            c.stop_node(name)
        psutil.wait_procs(c.killed, timeout=10)
        left = c.processes() + [p for p in c.killed if _alive(p)]
        for proc in left:
            proc.kill()
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"processes of the test cluster left behind: {[p.pid for p in left]}"


# Module-scoped: only this module uses it, and two idle nodes kept until the session's end would take the cores'
# time from every test after it.
@pytest.fixture(scope="module")
def cluster():
    env = dict(os.environ)
    env.pop(SLEEP_ENV, None)
    with two_node_cluster("rt", env, HEAD_IP, WORKER_IP) as c:
        yield c


def autotune(cluster: Cluster, *args: str, sleep_s: float = 0.0, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**cluster.env, **({SLEEP_ENV: str(sleep_s)} if sleep_s else {})}
    return subprocess.run(["nice", "-n", "19", sys.executable, "-m", "autotune.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def launched(results):
    return [r for r in results if r.status != "pruned"]


def test_batch_sweep_of_two_workloads_and_one_that_cannot_fit(cluster, tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("""
defaults: {backend: simulated, strategy: optuna, trials: 4}
workloads:
  - {name: tiny-a, model: tiny, global_batch: 16, memory_budget: 0.85GiB}
  - {name: gpt2-8gpu, model: gpt2-medium, gpus: 8, global_batch: 64, hardware: a100-40gb, memory_budget: 40GiB}
  - {name: too-big, model: llama-70b, gpus: 1, global_batch: 8, hardware: a100-40gb, memory_budget: 1GiB}
""")
    out = tmp_path / "sweep"
    run = autotune(cluster, "sweep", str(sweep), "--ray-address", cluster.address, "--out", str(out), "--json",
                   "--mlflow", sleep_s=0.5)
    assert run.returncode == 1, run.stderr[-3000:]  # one workload has no recommendation
    rows = {r["workload"]: r for r in _csv(out / "sweep_summary.csv")}
    # --json: the summary rows on stdout, alone; --mlflow: one parent run per workload in <out>/mlflow.db
    doc = json.loads(run.stdout)
    assert doc["out"] == str(out) and not doc["interrupted"] and doc["summary_csv"] == str(out / "sweep_summary.csv")
    assert {r["workload"]: r["recommended"] for r in doc["workloads"]} == {n: r["recommended"] for n, r in rows.items()}
    _check_tracked(f"sqlite:///{out / 'mlflow.db'}", out, {"tiny-a": 4, "gpt2-8gpu": 4, "too-big": 0})
    assert set(rows) == {"tiny-a", "gpt2-8gpu", "too-big"}
    for name in ("tiny-a", "gpt2-8gpu"):
        assert rows[name]["recommended"] and float(rows[name]["throughput_samples_per_s"]) > 0
        assert len(launched(read_results(out / name / "trials.jsonl"))) == 4
        assert (out / rows[name]["report"]).is_file()
    assert rows["too-big"]["recommended"] == "" and "no config" in rows["too-big"]["stopped"]
    assert not (out / "too-big" / "trials.jsonl").exists()  # nothing ran, nothing recorded
    md = (out / "sweep_summary.md").read_text()
    assert "[report](tiny-a/report.md)" in md and "too-big" in md
    # The two workloads shared the cluster: their trials interleave in time (progress: stderr with --json).
    starts = [line.split()[0] for line in run.stderr.splitlines() if " start " in line]
    assert {"tiny-a", "gpt2-8gpu"} <= set(starts[:4])


def _check_tracked(uri: str, out: Path, children: dict[str, int]) -> None:
    """Each workload a parent run (named <sweep>/<workload>) with one nested run per launched trial."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("ds-autotune").experiment_id])
    parents = {r.info.run_name: r for r in runs if "mlflow.parentRunId" not in r.data.tags}
    assert set(parents) == {f"{out.name}/{name}" for name in children}
    for name, count in children.items():
        parent = parents[f"{out.name}/{name}"]
        nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert len(nested) == count
        if count:
            assert sorted(int(r.data.tags["autotune.trial"]) for r in nested) == \
                [r.extra["trial"] for r in launched(read_results(out / name / "trials.jsonl"))]
        assert parent.info.status == "FINISHED" and ("best.config" in parent.data.tags) == bool(count)


def test_real_deepspeed_trials_on_both_nodes(cluster, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(NO_OFFLOAD_SPACE)  # no offload: no DeepSpeedCPUAdam build
    out = tmp_path / "real"
    run = autotune(cluster, "tune", "--model", MICRO_FILE, "--strategy", "optuna", "--trials", "2", "--space", str(space),
                   "--backend", "deepspeed", "--out", str(out), "--ray-address", cluster.address, "--concurrency", "2",
                   timeout=600)
    results = read_results(out / "trials.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(results) == 2 and all(r.backend == "deepspeed" for r in results)
    assert all(r.status == "ok" and r.peak_memory_bytes > 0 for r in results), [r.error for r in results]
    assert {r.extra["node_ip"] for r in results} == {HEAD_IP, WORKER_IP}
    assert all(Path(r.extra["log_dir"]).parent == out / "logs" for r in results)
    # Two trials in flight at once: each folder carries the number its result is recorded under, none shared.
    assert sorted(Path(r.extra["log_dir"]).name[:5] for r in results) == ["0001-", "0002-"]
    assert all(Path(r.extra["log_dir"]).name.startswith(f"{r.extra['trial']:04d}-") for r in results)
    assert sorted(p.name[:5] for p in (out / "logs").iterdir() if p.name[:4].isdigit()) == ["0001-", "0002-"]


def test_worker_node_killed_mid_sweep_its_trial_runs_elsewhere(cluster, tmp_path):
    cluster.start_node("victim", VICTIM_IP)
    try:
        cluster.wait_nodes(3)
        out = tmp_path / "killed"
        env = {**cluster.env, SLEEP_ENV: "6"}
        driver = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-m", "autotune.cli", "tune", "--model", "tiny", "--strategy", "optuna",
             "--trials", "6", "--backend", "simulated", "--out", str(out), "--ray-address", cluster.address],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # As soon as a trial runs there (each sleeps 6 s): waiting for a first result instead raced the victim's
        # own first trial, which had started with it and ended with it on a loaded machine.
        _wait_for(lambda: any("run_trial" in _name(p) for p in cluster.node_processes("victim")), 120)
        killed = cluster.kill_node("victim")  # the machine dies: its raylet and the workers running trials
        assert "raylet" in killed and any("run_trial" in n for n in killed), killed
        stdout, stderr = driver.communicate(timeout=300)
        assert driver.returncode == 0, stderr[-3000:]
    finally:
        cluster.stop_node("victim")
        del cluster.nodes["victim"]
    results = read_results(out / "trials.jsonl")
    assert len(launched(results)) == 6 and len({r.config for r in results}) == len(results)
    retried = [r for r in results if r.extra.get("attempts", 1) > 1]
    assert retried and all(r.extra["node_ip"] != VICTIM_IP for r in retried), stdout
    assert "its worker or node died" in stdout


def test_tune_on_the_cluster_driver_killed_and_resumed_keeps_the_run_directory_contract(cluster, tmp_path):
    out = tmp_path / "resumed"
    args = ["nice", "-n", "19", sys.executable, "-m", "autotune.cli", "tune", "--model", "tiny", "--strategy", "optuna",
            "--trials", "6", "--backend", "simulated", "--seed", "5", "--out", str(out), "--ray-address", cluster.address,
            "--concurrency", "2"]
    driver = subprocess.Popen(args, env={**cluster.env, SLEEP_ENV: "1.5"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    _wait_for(lambda: len(launched(read_results(out / "trials.jsonl"))) >= 2, 180)
    driver.kill()  # SIGKILL: no cleanup at all; two trials were in flight
    driver.wait()
    before = (out / "trials.jsonl").read_text()
    run = autotune(cluster, *args[6:], "--resume", sleep_s=0.5)
    assert run.returncode == 0, run.stderr[-3000:]
    after = (out / "trials.jsonl").read_text()
    assert after.startswith(before)  # nothing recorded was lost or rewritten
    results = read_results(out / "trials.jsonl")
    ran = launched(results)
    assert len(ran) == 6 and len({r.config for r in results}) == len(results)
    # The run directory contract of the local driver holds.
    assert {r.extra["node_ip"] for r in ran} == {HEAD_IP, WORKER_IP}  # both nodes ran trials
    assert [r.extra["trial"] for r in results] == list(range(1, len(results) + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trials"] == len(results) and summary["best"] is not None
    for name in ("best_ds_config.json", "best_hf_ds_config.json", "report.md", "study.db", "run.json"):
        assert (out / name).is_file(), name
    # One Optuna study holds every launched trial, told with its result, none left running.
    import optuna

    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{out / 'study.db'}")
    states = [t.state for t in study.get_trials()]
    assert optuna.trial.TrialState.RUNNING not in states
    # (a launched config that did not fit is PRUNED with status oom: strategies/optuna_search.py)
    told = {json.dumps(t.params, sort_keys=True) for t in study.get_trials() if t.state.is_finished()
            and t.user_attrs.get("status") not in (None, "pruned", "invalid", "repeat", "unlikely to fit")}
    assert len(told) >= len(ran)


def test_a_wrong_token_or_none_is_refused_at_once_in_one_line(cluster, tmp_path):
    bad = tmp_path / "bad_token"
    bad.write_text(secrets.token_hex(32))
    env = dict(cluster.env)
    try:
        for case, auth in (("wrong", {"RAY_AUTH_TOKEN_PATH": str(bad)}), ("none", {"RAY_AUTH_MODE": "disabled"})):
            cluster.env = {**env, **auth}
            run = autotune(cluster, "tune", "--model", "tiny", "--backend", "simulated", "--strategy", "random",
                           "--trials", "2", "--out", str(tmp_path / case), "--ray-address", cluster.address, timeout=180)
            assert run.returncode == 2, (case, run.stderr)
            # Ray's own warning, repeated every second while ray.init retried a refused token, is not shown: one
            # line says why, within the probe's bound rather than ray.init's 20 s.
            lines = [line for line in run.stderr.splitlines() if not line.startswith("tuning tiny")]
            assert lines == [f"autotune tune: error: --ray-address (RayOptions' `address`) {cluster.address}: the cluster refused this process "
                             "(RPC error: InvalidAuthToken: Authentication token is missing or incorrect); are "
                             "RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN_PATH=FILE, RAY_AUTH_TOKEN, or "
                             "~/.ray/auth_token) set in this environment?"], (case, run.stderr)
            assert not (tmp_path / case / "trials.jsonl").exists()
    finally:
        cluster.env = env


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return ""


def _wait_for(condition, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if condition():
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.3)
    raise AssertionError("timed out waiting")


def _csv(path: Path) -> list[dict]:
    import csv

    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))
