"""What spreading a trial's ranks over two nodes costs (issue 16, autotune/drivers/ray_ranks.py).

A Ray cluster on this machine (`ray start`, token authentication): two 2-CPU nodes carrying a custom resource
"span" (127.0.0.21, .22) and one 4-CPU node "one" (127.0.0.23). The same 4-rank trial of the tiny model
(CPU ranks, gloo, OMP_NUM_THREADS=1) runs alternately
- spread: a placement group of 4 bundles of 1 CPU + 1 span, 2 ranks on each 2-CPU node (the multi-node path);
- one node: today's path, one Ray task asking for 4 CPUs on the 4-CPU node, all ranks its subprocesses;
`--repeats` times each (interleaved), and the table gives the medians: the task's round trip as the driver
sees it (placement group, actors, the trial), the trial's own wall time (first rank launched to every rank
ended), launch to first step, the median step time and the throughput. All "nodes" share this machine's
cores, so the network is loopback: what is measured is the placement and coordination cost, not a real
interconnect.

Usage: nice -n 19 python benchmarks/multinode_trial.py [--repeats 3]
Writes benchmarks/results/multinode_trial.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

BASE = Path(tempfile.mkdtemp(prefix="mb", dir="/tmp"))  # short: Ray's socket paths must stay short
TOKEN = BASE / "token"
TOKEN.write_text(secrets.token_hex(32))
TOKEN.chmod(0o600)
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(TOKEN))  # read once, when Ray connects

from autotune.backends.deepspeed import DeepSpeedBackend  # noqa: E402
from autotune.values.config import Config  # noqa: E402
from autotune.values.dsconfig import DsOptions  # noqa: E402
from autotune.values.hardware import PROFILES  # noqa: E402
from autotune.worker.measure import MeasureSettings  # noqa: E402
from autotune.values.workload import make_workload  # noqa: E402

RAY = str(Path(sys.executable).with_name("ray"))
CONFIG = Config(2, 1, 0, "bf16")
MEASURE = MeasureSettings(warmup_steps=1, min_steps=5, max_steps=5, rel_tol=0.5, max_measure_s=120.0)
RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster() -> tuple[str, list[subprocess.Popen]]:
    address = f"127.0.0.21:{free_port()}"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    nodes = []
    for name, ip, cpus, resources in (("head", "127.0.0.21", 2, {"span": 2}), ("w", "127.0.0.22", 2, {"span": 2}),
                                      ("one", "127.0.0.23", 4, {"one": 1})):
        args = [RAY, "start", "--block", f"--node-ip-address={ip}", f"--num-cpus={cpus}", "--num-gpus=0",
                f"--resources={json.dumps(resources)}", "--object-store-memory=80000000", "--disable-usage-stats",
                f"--temp-dir={BASE / name}"]
        args += (["--head", f"--port={address.split(':')[1]}", "--include-dashboard=false"] if name == "head"
                 else [f"--address={address}"])
        nodes.append(subprocess.Popen(args, env=env, stdout=open(BASE / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        time.sleep(3 if name == "head" else 0)
    return address, nodes


def stop_cluster(nodes: list[subprocess.Popen]) -> None:
    for node in nodes:
        try:
            os.killpg(node.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    time.sleep(3)
    for node in nodes:
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import ray

    from autotune.drivers.ray import run_trial
    from autotune.trials.cluster import connect
    from autotune.drivers.ray_ranks import RankBundles, run_spanning_trial

    address, nodes = start_cluster()
    rows: dict[str, list[dict]] = {"spread": [], "one node": []}
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # the head's GCS port opens a few seconds after `ray start`
            try:
                socket.create_connection(("127.0.0.21", int(address.split(":")[1])), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        connect(address)
        deadline = time.time() + 120
        while sum(n["Alive"] for n in ray.nodes()) < 3 and time.time() < deadline:
            time.sleep(0.5)
        spread = ray.remote(run_spanning_trial).options(num_cpus=0)
        whole = ray.remote(run_trial).options(num_cpus=4, resources={"one": 1})
        bundles = RankBundles(4, (("CPU", 1.0), ("span", 1.0)))
        for repeat in range(args.repeats):
            for name in rows:
                make = partial(DeepSpeedBackend, make_workload("tiny", global_batch=4, gpus=4), None, PROFILES["cpu"],
                               DsOptions(), str(BASE / "logs" / f"{name.replace(' ', '_')}{repeat}"), timeout_s=900,
                               measure=MEASURE, env={"OMP_NUM_THREADS": "1"})
                started = time.monotonic()
                ref = spread.remote(make, CONFIG, bundles) if name == "spread" else whole.remote(make, CONFIG)
                result = ray.get(ref).result
                round_trip = time.monotonic() - started
                assert result.status == "ok", result.error
                row = {"round_trip_s": round_trip, "trial_wall_s": result.wall_time_s,
                       "launch_to_first_step_s": result.extra["launch_to_first_step_s"],
                       "step_time_s": result.step_time_s, "throughput": result.throughput_samples_per_s,
                       "node_ips": result.extra.get("node_ips") or [result.extra.get("node_ip")]}
                rows[name].append(row)
                print(f"{name:9} #{repeat + 1}: round trip {round_trip:6.1f} s, trial {result.wall_time_s:6.1f} s, "
                      f"step {result.step_time_s:.3f} s on {row['node_ips']}", flush=True)
    finally:
        ray.shutdown()
        stop_cluster(nodes)
        shutil.rmtree(BASE, ignore_errors=True)
    keys = ("round_trip_s", "trial_wall_s", "launch_to_first_step_s", "step_time_s", "throughput")
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in keys} for name, runs in rows.items()}
    lines = [f"# A 4-rank trial spread over two nodes vs on one node (medians of {args.repeats}, interleaved)", "",
             f"Machine: {platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}; "
             "all nodes on this machine (loopback), shared with other work. tiny model, global batch 4, "
             f"{CONFIG.label()}, {MEASURE.min_steps} measured steps, CPU ranks (gloo), OMP_NUM_THREADS=1.", "",
             "| placement | round trip (s) | trial wall (s) | launch to first step (s) | step (s) | samples/s |",
             "|---|---|---|---|---|---|"]
    for name, m in medians.items():
        lines.append(f"| {name} | {m['round_trip_s']:.1f} | {m['trial_wall_s']:.1f} | {m['launch_to_first_step_s']:.1f} "
                     f"| {m['step_time_s']:.3f} | {m['throughput']:.2f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "multinode_trial.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "multinode_trial.json").write_text(json.dumps({"runs": rows, "medians": medians}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
