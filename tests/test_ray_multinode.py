"""Trials whose ranks span a Ray cluster's nodes (issue 16, autotune/drivers/ray_ranks.py).

Unit tests of the rank layout, the placement count, the interface lookup and the judge over every node's
evidence; then, on a real two-node Ray cluster on this machine (`ray start`, nodes on 127.0.0.11 and
127.0.0.12, 2 CPUs each, token authentication as in test_ray_cluster.py), 4-rank trials of the tiny model
with CPU ranks (gloo) spread 2 + 2 over the nodes: the same verdicts (ok, and oom under a small budget) and
the same training as on one node; `tune --gpus 4` on the cluster, a node killed mid-trial and the trial run
again on a node that replaced it; `--gpus 8` refused in one line."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.values.config import Config
from autotune.drivers.ray_ranks import NodeLost, RankBundles, Site, layout, merge, placeable, interface_of
from autotune.values.dsconfig import DsOptions
from autotune.values.hardware import PROFILES
from autotune.values.results import read_results
from autotune.trials.runner import RankShare
from autotune.worker.measure import MeasureSettings
from autotune.values.workload import make_workload

HEAD_IP, WORKER_IP, SPARE_IP = "127.0.0.11", "127.0.0.12", "127.0.0.13"
CPU_RANKS = RankBundles(4, (("CPU", 1.0),))
MEASURE = MeasureSettings(warmup_steps=1, min_steps=2, max_steps=2, rel_tol=0.5, max_measure_s=60.0)
OK_CONFIG, OOM_CONFIG = Config(2, 1, 0, "fp32"), Config(0, 1, 0, "fp32")
SMALL_BUDGET = 200 * 2**20  # per rank: below what a rank holds once torch and DeepSpeed are imported
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # 4 ranks on 2 cores, wherever they run


# -- units ------------------------------------------------------------------------------------------------

def test_ranks_are_numbered_per_node_with_rank_0_on_the_first_bundles_node():
    sites = [Site(node, "10.0.0.%d" % i, (), None) for i, node in enumerate(["b", "a", "b", "a", "c"])]
    seats = layout(sites)
    assert [(s.rank, s.local_rank, s.local_world_size, s.node_rank) for s in seats] == [
        (0, 0, 2, 0), (2, 0, 2, 1), (1, 1, 2, 0), (3, 1, 2, 1), (4, 0, 1, 2)]


def test_the_bundles_the_cluster_holds_count_alive_nodes_whole_bundles_only():
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0, "GPU": 3.0}}, {"Alive": True, "Resources": {"CPU": 8.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]
    assert placeable(CPU_RANKS, nodes) == 10
    assert placeable(RankBundles(4, (("GPU", 1.0),)), nodes) == 3
    assert placeable(RankBundles(2, (("GPU", 2.0), ("CPU", 1.0))), nodes) == 1


def test_the_interface_of_a_node_address_is_the_one_carrying_it():
    import ipaddress
    import socket

    assert interface_of("127.0.0.1") == interface_of("127.0.0.12") == "lo"  # lo holds 127.0.0.0/8
    networks = []
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family == socket.AF_INET and addr.netmask:
                assert interface_of(addr.address) == name  # its own address
                networks.append(ipaddress.ip_network(f"{addr.address}/{addr.netmask}", strict=False))
    # documentation ranges (RFC 5737): one of them is on no interface here
    outside = next(ip for ip in ("198.51.100.77", "203.0.113.77", "192.0.2.77")
                   if not any(ipaddress.ip_address(ip) in net for net in networks))
    assert interface_of(outside) is None
    assert interface_of("not-an-ip") is None


def _share(rank, report=None, exit_seen=None, verdict=None, tail=""):
    return RankShare((rank,), verdict, (report,), (exit_seen,), (exit_seen if exit_seen is not None else -9,),
                     (100 * (rank + 1),), (1000 + rank,), {rank: tail}, 10.0 + rank, 20.0 + rank)


def test_every_nodes_evidence_is_judged_together_as_the_runner_judges_one_nodes():
    ok = {"status": "ok"}
    oom = {"status": "oom", "phase": "measure", "error": "MemoryError: "}
    # rank 2's own oom wins over its peers, killed once it failed
    outcome = merge([_share(0), _share(2, oom, 1), _share(1), _share(3)], "/logs", 4242)
    assert (outcome.status, outcome.error) == ("oom", "rank 2 in measure: MemoryError: ")
    assert outcome.wall_time_s == 23.0 - 10.0 and outcome.observed_peaks == (100, 200, 300, 400)
    # a rank that died without a report is the cause, quoted with its own stderr
    died = merge([_share(0), _share(1), _share(2), _share(3, None, -9, tail="; last lines: bye")], "/l", 1)
    assert died.status == "crash" and died.error == "rank 3 was killed by signal SIGKILL without a report; last lines: bye"
    # a node's watchdog verdict comes first
    over = merge([_share(0, ok, 0), _share(1, verdict=("oom", "rank 1 grew"))], "/l", 1)
    assert (over.status, over.error) == ("oom", "rank 1 grew")
    assert merge([_share(0, ok, 0), _share(1, ok, 0)], "/l", 1).status == "ok"


def test_a_node_lost_for_good_is_recorded_as_a_crash_naming_it():
    from autotune.drivers.loop import Flight
    from autotune.drivers.ray import RayExecutor

    messages: list[str] = []
    job = SimpleNamespace(progress=SimpleNamespace(message=messages.append), sweep=SimpleNamespace(backend_name="deepspeed"))
    executor = RayExecutor(max_failures=1)
    lost = NodeLost("a node of the trial was lost mid-trial (ActorDiedError: the actor died)")
    _, again = executor._lost(Flight(job, OK_CONFIG, attempt=1), lost, 5.0)
    assert again is None and "submitting it again" in messages[0]  # None: the loop submits it again
    _, reply = executor._lost(Flight(job, OK_CONFIG, attempt=2), lost, 5.0)
    assert reply.result.status == "crash" and reply.result.extra["attempts"] == 2
    assert reply.result.error.startswith("its worker or node died 2 times: NodeLost: a node of the trial was lost")


# -- a real two-node cluster ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    from test_ray_cluster import two_node_cluster

    with two_node_cluster("rm", {**os.environ, **ONE_THREAD}, HEAD_IP, WORKER_IP, cpus=2) as c:
        yield c


# The driver of the spanning trials: a process of its own (Ray reads the cluster's token settings once).
SPANNING_DRIVER = """
import functools, sys, ray
from autotune.trials.cluster import connect
from autotune.drivers.ray_ranks import run_spanning_trial
from autotune.values.results import append_result
import test_ray_multinode as t

connect(sys.argv[1])
task = ray.remote(run_spanning_trial).options(num_cpus=0)
for name, config, budget in (("ok", t.OK_CONFIG, None), ("oom", t.OOM_CONFIG, t.SMALL_BUDGET)):
    reply = ray.get(task.remote(t._backend(f"{sys.argv[2]}/{name}", budget), config, t.CPU_RANKS))
    append_result(f"{sys.argv[2]}/spanning.jsonl", reply.result)
"""


def _backend(logs: Path | str, budget: int | None = None) -> functools.partial:
    return functools.partial(DeepSpeedBackend, make_workload("tiny", global_batch=4, gpus=4), budget, PROFILES["cpu"],
                             DsOptions(), str(logs), timeout_s=600, measure=MEASURE, env=ONE_THREAD)


def _ranks_left(path: Path) -> list[int]:
    """Processes still alive whose command line names something under `path` (a trial's rank)."""
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(path) in part for part in proc.info["cmdline"] or ()) and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


@pytest.mark.slow
def test_four_ranks_over_two_nodes_give_the_verdicts_and_training_of_one_node(cluster, tmp_path):
    env = {**cluster.env, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), cluster.env.get("PYTHONPATH", "")])}
    run = subprocess.run(["nice", "-n", "19", sys.executable, "-c", SPANNING_DRIVER, cluster.address, str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    spanning = {r.status: r for r in read_results(tmp_path / "spanning.jsonl")}
    local = {"ok": _backend(tmp_path / "local")().run(OK_CONFIG),
             "oom": _backend(tmp_path / "local", SMALL_BUDGET)().run(OOM_CONFIG)}
    for name in ("ok", "oom"):
        assert spanning[name].status == local[name].status == name, (spanning[name].error, local[name].error)
        # two ranks on each node, rank 0 where the first bundle went
        ips = spanning[name].extra["node_ips"]
        assert sorted(ips) == sorted([HEAD_IP, HEAD_IP, WORKER_IP, WORKER_IP]) and ips[0] == ips[1] != ips[2] == ips[3]
        assert spanning[name].extra["nodes"] == 2 and spanning[name].extra["node_ip"] == ips[0]
        log_dir = Path(spanning[name].extra["log_dir"])
        assert json.loads((log_dir / "result.json").read_text())["status"] == name  # recorded beside its logs
        assert not _ranks_left(tmp_path / name)
    ok, alone = spanning["ok"], local["ok"]
    assert ok.extra["ranks"] == 4 and ok.throughput_samples_per_s > 0 and ok.peak_memory_bytes > SMALL_BUDGET
    # The same training: same seed, same data, same loss at the first step whichever node a rank was on.
    assert ok.extra["loss_first"] == pytest.approx(alone.extra["loss_first"], rel=1e-3)
    assert "past the memory budget" in spanning["oom"].error


def _tune(cluster, out: Path, space: Path, *args: str) -> list[str]:
    return ["nice", "-n", "19", sys.executable, "-m", "autotune.cli", "tune", "--model", "tiny", "--gpus", "4",
            "--global-batch", "4", "--backend", "deepspeed", "--strategy", "grid", "--trials", "1", "--space",
            str(space), "--out", str(out), "--ray-address", cluster.address, *args]


@pytest.mark.slow
def test_tune_refuses_more_ranks_than_the_whole_cluster_holds_in_one_line(cluster, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("zero_stage: [0]\nmicro_batch: [1]\nckpt_interval: [0]\nprecision: [fp32]\n")
    cmd = _tune(cluster, tmp_path / "refused", space)
    cmd[cmd.index("--gpus") + 1] = cmd[cmd.index("--global-batch") + 1] = "8"
    run = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("autotune tune: error: --gpus (the workload's `gpus`) 8: the Ray cluster cannot place 8 ranks of 1 CPU, not even "
                           "across its nodes: it holds 4"), last
    assert not (tmp_path / "refused" / "trials.jsonl").exists()


@pytest.mark.slow
def test_a_sweep_workload_the_cluster_cannot_place_gets_its_verdict_and_the_others_go_on(cluster, tmp_path):
    """`tune` refuses such a command (above); in a sweep file it is one workload's verdict, named by the workload,
    and the other workloads run (exit 1: one workload has no recommendation)."""
    (tmp_path / "one.yaml").write_text("zero_stage: [0]\nmicro_batch: [1]\nckpt_interval: [0]\nprecision: [fp32]\n")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("defaults: {hardware: cpu, memory_budget: 8GiB, confirm: 0}\nworkloads:\n"
                     "  - {name: wide, model: tiny, gpus: 8, global_batch: 8, backend: deepspeed, space: one.yaml, "
                     "trials: 1}\n"
                     "  - {name: small, model: tiny, backend: simulated, trials: 2}\n")
    run = subprocess.run(["nice", "-n", "19", sys.executable, "-m", "autotune.cli", "sweep", str(sweep), "--out",
                          str(tmp_path / "out"), "--ray-address", cluster.address],
                         env=cluster.env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "wide: gpus 8: the Ray cluster cannot place 8 ranks of 1 CPU, not even across its nodes: it holds 4" \
        in run.stdout + run.stderr
    summary = {name: json.loads((tmp_path / "out" / name / "summary.json").read_text()) for name in ("wide", "small")}
    assert summary["wide"]["stop_reason"] == "no node" and summary["wide"]["trials"] == 0
    assert summary["small"]["trials"] == 2 and summary["small"]["best"] is not None


def _node_of(pid: int, cluster) -> str | None:
    """The cluster node (by name) that started `pid`: one of its ancestors (the rank's actor, the node's
    raylet) is in that node's process group."""
    groups = {proc.pid: name for name, proc in cluster.nodes.items()}
    try:
        for ancestor in psutil.Process(pid).parents():
            name = groups.get(os.getpgid(ancestor.pid))
            if name:
                return name
    except (psutil.NoSuchProcess, ProcessLookupError):
        pass
    return None


@pytest.mark.slow
def test_a_node_killed_mid_trial_the_trial_runs_again_and_no_rank_is_left(cluster, tmp_path):
    """Last in this module: it replaces the worker node."""
    space = tmp_path / "space.yaml"
    space.write_text("zero_stage: [0]\nmicro_batch: [1]\nckpt_interval: [0]\nprecision: [fp32]\n")
    out = tmp_path / "killed"
    driver = subprocess.Popen(_tune(cluster, out, space), env=cluster.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        victim = _wait_for_ranks_on_worker(out, cluster, 240)
        _check_rendezvous(out, 240)
        killed = cluster.kill_node("worker")  # the machine dies: its raylet, the rank actors, their ranks
        assert "raylet" in killed, killed
        cluster.start_node("spare", SPARE_IP, cpus=2)  # a node takes its place: the trial runs again
        stdout, stderr = driver.communicate(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, stderr[-3000:]
    (result,) = read_results(out / "trials.jsonl")
    # At least one retry: on a loaded 2-core machine (the suite's two workers) it once took two.
    assert result.status == "ok" and result.extra["attempts"] >= 2, result.error
    assert sorted(set(result.extra["node_ips"])) == [HEAD_IP, SPARE_IP]
    assert "its worker or node died" in stdout
    psutil.wait_procs([p for p in (_proc(pid) for pid in victim) if p is not None], timeout=20)
    assert not _ranks_left(out), "rank processes left behind"


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _check_rendezvous(out: Path, timeout: float) -> None:
    """Every rank has rank 0's node address and port, and its own node's interface; rank 0's store listens on
    that address only (not on every interface)."""
    ranks = {}
    for path in out.glob("logs/*/rank*.events.jsonl"):
        env = psutil.Process(json.loads(path.read_text().splitlines()[0])["pid"]).environ()
        ranks[int(env["RANK"])] = env
    master = ranks[0]["MASTER_ADDR"], int(ranks[0]["MASTER_PORT"])
    assert master[0] in (HEAD_IP, WORKER_IP)
    assert {(e["MASTER_ADDR"], int(e["MASTER_PORT"]), e["WORLD_SIZE"]) for e in ranks.values()} == {(*master, "4")}
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for _, e in sorted(ranks.items())] == [
        ("0", "2", "0"), ("1", "2", "0"), ("0", "2", "1"), ("1", "2", "1")]
    assert {e["GLOO_SOCKET_IFNAME"] for e in ranks.values()} == {"lo"}  # 127.0.0.0/8 is on lo
    rank0 = next(path for path in out.glob("logs/*/rank0.events.jsonl"))
    proc = psutil.Process(json.loads(rank0.read_text().splitlines()[0])["pid"])
    deadline = time.time() + timeout
    while time.time() < deadline:  # the store opens once the rank has imported torch and DeepSpeed
        listening = {(c.laddr.ip, c.laddr.port) for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        if any(port == master[1] for _, port in listening):
            assert (master[0], master[1]) in listening and ("0.0.0.0", master[1]) not in listening, listening
            return
        time.sleep(0.2)
    raise AssertionError("rank 0 never listened on its store's port")


def _wait_for_ranks_on_worker(out: Path, cluster, timeout: float) -> list[int]:
    """Once every rank of the first attempt has started: the pids of the ranks on the worker node."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        events = sorted(out.glob("logs/*/rank*.events.jsonl"))
        if len(events) == 4:
            pids = [json.loads(path.read_text().splitlines()[0])["pid"] for path in events]
            on_worker = [pid for pid in pids if _node_of(pid, cluster) == "worker"]
            if len(on_worker) == 2:
                return on_worker
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start on both nodes: {list(out.glob('logs/*/*'))}")
