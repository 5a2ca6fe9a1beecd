"""Trials whose ranks span a Ray cluster's nodes (issue 16): `--gpus 16` on 8-GPU nodes, measured for real.

A trial of N ranks that no single node holds gets a placement group of N bundles, one device each (a GPU on
GPU clusters, a CPU for CPU ranks), strategy PACK: as few nodes as the cluster allows, so that the ranks of
a node talk over its own links. One `RankHost` actor per bundle starts its rank as a subprocess with the
runner (autotune.trials.runner.Trial with a `Placement`: the runner's environment, true peak per rank, the memory
watchdog, the timeout, every process of the rank ended on any outcome) and watches it; the driver-side trial
(`SpanningLaunch`, which the backend calls in place of `run_worker`) polls every actor, ends all ranks once
one has failed and the others had the runner's grace to report, and judges every node's evidence together
with the runner's `judge`. The backend then makes its TrialResult exactly as for a single-node trial.

Rendezvous, on the cluster's network only: MASTER_ADDR is rank 0's node's address as Ray knows it (the
address the nodes already reach each other at), MASTER_PORT a port free on that address; rank 0 binds the
torch.distributed store to that address, not to every interface (autotune.worker.main.host_store). Each
node's ranks bind gloo's (and NCCL's) sockets to the interface carrying that node's address
(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); where no interface carries it (e.g. an address behind NAT) they
are left to what the environment says, and gloo/NCCL pick by host name. On GPUs each rank sees every GPU
of the trial on its node (CUDA_VISIBLE_DEVICES, in local-rank order) and takes LOCAL_RANK's, as under
torchrun; NCCL across nodes is untested here (no GPU cluster).

A node lost mid-trial (its actor or node died, or a call to it went unanswered for CALL_TIMEOUT_S) raises
`NodeLost` once every surviving rank is ended: the Ray driver runs the trial again (drivers/ray.py,
max_failures) and records it `crash`, naming the lost node, if it never completes. A trial whose bundles the
cluster can no longer place at all (fewer devices alive than ranks) is a NodeLost too. The placement group
and every actor are removed on any outcome, the tuner's interruption (KeyboardInterrupt) included.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from autotune.values.results import TrialResult
from autotune.trials.runner import LaunchOptions, Placement, RankShare, RunOutcome, Trial, judge
from autotune.worker.protocol import WorkerSpec

if TYPE_CHECKING:
    from autotune.backends import Backend
    from autotune.values.config import Config
    from autotune.drivers.loop import TrialReply, TrialResources

STRATEGY = "PACK"  # fewest nodes first; spans nodes only when one cannot hold the bundles
POLL_S = 0.25  # between looks at the actors (each actor's rank is watched through the runner's own checks)
FIRST_CALL_TIMEOUT_S = 180.0  # an actor's first answer: its worker process starts (slow on a loaded machine)
CALL_TIMEOUT_S = 60.0  # any later call unanswered this long: its node is taken as lost
PLACE_CHECK_S = 2.0  # while the placement group waits, how often to check the cluster can still hold it
END_TIMEOUT_S = 30.0  # for the surviving actors to end their ranks before they are killed


class NodeLost(Exception):
    """A node (or the actor of a rank on it) was lost mid-trial: not the config's fault, run it again."""


@dataclass(frozen=True)
class RankBundles:
    """A trial's ranks as Ray placement-group bundles: `ranks` of `bundle` each (e.g. 1 GPU, or 1 CPU)."""

    ranks: int
    bundle: tuple[tuple[str, float], ...]

    def resources(self) -> dict[str, float]:
        return {k: v for k, v in self.bundle if v > 0}

    def actor_options(self) -> dict[str, Any]:
        """A rank's actor takes its whole bundle (Ray sets CUDA_VISIBLE_DEVICES to a GPU bundle's device)."""
        res = self.resources()
        return {"num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0), "resources": res}

    def describe(self) -> str:
        return f"{self.ranks} ranks of " + " + ".join(f"{v:g} {k}" for k, v in self.bundle)


def bundles_of(resources: "TrialResources") -> RankBundles | None:
    """The per-rank bundles of a trial's resources; None for a trial that cannot be split (not real ranks)."""
    return RankBundles(resources.ranks, resources.per_rank) if resources.ranks and resources.per_rank else None


def placeable(bundles: RankBundles, nodes: Sequence[dict[str, Any]] | None = None) -> int:
    """How many of these bundles the cluster's alive nodes hold at most, all together (by their totals)."""
    if nodes is None:
        import ray

        nodes = ray.nodes()
    want = bundles.resources()
    total = 0
    for node in nodes:
        if node.get("Alive"):
            have = node.get("Resources", {})
            total += min((int(have.get(k, 0.0) // v) for k, v in want.items()), default=0)
    return total


def interface_of(ip: str) -> str | None:
    """The network interface carrying `ip` on this machine: the one with that address, else the one whose
    network contains it (127.0.0.2 is on `lo`); None if none does."""
    import psutil

    try:
        wanted = ipaddress.ip_address(ip)
    except ValueError:
        return None
    containing = None
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6) or not addr.address:
                continue
            try:
                own = ipaddress.ip_address(addr.address.split("%")[0])
                if own == wanted:
                    return name
                if addr.netmask and containing is None and own.version == wanted.version and \
                        wanted in ipaddress.ip_network(f"{own}/{addr.netmask}", strict=False):
                    containing = name
            except ValueError:
                continue
    return containing


def free_port_on(ip: str) -> int:
    """A port nothing listens on at `ip` now (rank 0's store binds it moments later)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((ip, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Site:
    """Where one bundle landed."""

    node_id: str
    ip: str
    gpu_ids: tuple[str, ...]  # the GPUs Ray gave this bundle's actor
    ifname: str | None


@dataclass(frozen=True)
class Seat:
    """One bundle's rank in the trial."""

    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int


def layout(sites: Sequence[Site]) -> list[Seat]:
    """Ranks for the bundles, per bundle: contiguous per node, rank 0 on bundle 0's node, nodes in the order
    their first bundle comes (torchrun's numbering: a node's ranks are its local ranks plus an offset)."""
    nodes: dict[str, list[int]] = {}
    for index, site in enumerate(sites):
        nodes.setdefault(site.node_id, []).append(index)
    seats: dict[int, Seat] = {}
    rank = 0
    for node_rank, members in enumerate(nodes.values()):
        for local_rank, index in enumerate(members):
            seats[index] = Seat(rank, local_rank, len(members), node_rank)
            rank += 1
    return [seats[i] for i in range(len(sites))]


class RankHost:
    """A Ray actor in one bundle of a multi-node trial: starts, watches and ends its rank (runner.Trial).
    Its methods run on the actor's main thread, which must stay the ranks' parent: a rank dies with it."""

    def __init__(self) -> None:
        self.trial: Trial | None = None
        self.done = False
        self.result: RankShare | None = None

    def where(self) -> Site:
        import ray

        context = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        gpus = tuple(str(g) for g in context.get_accelerator_ids().get("GPU", []))
        return Site(context.get_node_id(), ip, gpus, interface_of(ip))

    def free_port(self, ip: str) -> int:
        return free_port_on(ip)

    def start(self, spec: WorkerSpec, options: LaunchOptions) -> None:
        log_dir = Path(spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)  # on a node that does not share the driver's filesystem
        self.trial = Trial(spec, options, log_dir)
        self.trial.launch()

    def poll(self) -> tuple[bool, bool]:
        """(over here, failing here)."""
        trial = self.trial
        assert trial is not None, "poll before start"
        if not self.done and trial.check():
            self.done = True
            trial.stop_watching()
        return self.done, trial.failing()

    def finish(self) -> RankShare | None:
        """End the rank (every process of it) and hand over what was seen; the same answer when asked again."""
        if self.result is None and self.trial is not None:
            trial = self.trial
            if not self.done:
                trial.stop_watching()
            trial.end()
            self.result = trial.share()
        return self.result


class SpanningLaunch:
    """The backend's `start_ranks` for a trial spanning nodes: same contract as runner.run_worker (every
    process ended when it returns or raises), plus NodeLost when a node of the trial dies."""

    def __init__(self, bundles: RankBundles, poll_s: float = POLL_S) -> None:
        self.bundles = bundles
        self.poll_s = poll_s
        self.sites: list[Site] = []  # per rank, once placed

    def __call__(self, spec: WorkerSpec, options: LaunchOptions) -> RunOutcome:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = self.bundles.ranks
        if options.ranks != n:
            raise ValueError(f"a trial of {options.ranks} ranks launched as {self.bundles.describe()}")
        group = placement_group([self.bundles.resources()] * n, strategy=STRATEGY)
        actors: list[Any] = []
        try:
            self._wait_placed(group)
            host = ray.remote(RankHost)
            actors = [host.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i), max_restarts=0,
                                   **self.bundles.actor_options()).remote() for i in range(n)]
            sites: list[Site] = self._get([a.where.remote() for a in actors], FIRST_CALL_TIMEOUT_S)
            seats = layout(sites)
            first = next(i for i, s in enumerate(seats) if s.rank == 0)
            master = sites[first].ip
            port = self._get([actors[first].free_port.remote(master)])[0]
            self._get([actor.start.remote(spec, replace(options, ranks=1, placement=self._placement(
                seat, sites, seats, index, master, port))) for index, (actor, seat) in enumerate(zip(actors, seats))])
            self.sites = [sites[i] for i in sorted(range(n), key=lambda i: seats[i].rank)]
            self._watch(actors, options.grace_s)
            shares = self._get([a.finish.remote() for a in actors])
            return merge(shares, str(spec.log_dir), port)
        except NodeLost:
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError) as err:
            text = str(err).strip()
            raise NodeLost(f"a node of the trial was lost mid-trial ({type(err).__name__}"
                           f"{': ' + text.splitlines()[0][:200] if text else ''})") from None
        finally:
            self._end(actors)
            remove_placement_group(group)

    def _placement(self, seat: Seat, sites: Sequence[Site], seats: Sequence[Seat], index: int, master: str,
                   port: int) -> Placement:
        site = sites[index]
        env = {}
        if site.gpu_ids:  # every GPU of the trial on this node, in local-rank order: the rank takes LOCAL_RANK's
            peers = sorted((s.local_rank, sites[i].gpu_ids[0]) for i, s in enumerate(seats)
                           if sites[i].node_id == site.node_id and sites[i].gpu_ids)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu for _, gpu in peers)
        return Placement((seat.rank,), (seat.local_rank,), seat.local_world_size, self.bundles.ranks,
                         seat.node_rank, master, port, site.ifname, env)

    def _wait_placed(self, group: Any) -> None:
        """Wait for the bundles, for as long as the cluster could still hold them (other trials may have the
        devices now); fewer devices alive than ranks is a NodeLost."""
        import ray

        while not ray.wait([group.ready()], timeout=PLACE_CHECK_S)[0]:
            if placeable(self.bundles) < self.bundles.ranks:
                raise NodeLost(f"the cluster's alive nodes no longer hold {self.bundles.describe()} (a node was "
                               "lost?)")

    def _watch(self, actors: Sequence[Any], grace_s: float) -> None:
        """Until every rank is over, or one has failed and the others had `grace_s` to report."""
        done = [False] * len(actors)
        failed_at: float | None = None
        while True:
            waiting = [i for i, d in enumerate(done) if not d]
            states = self._get([actors[i].poll.remote() for i in waiting])
            failing = False
            for i, (over, bad) in zip(waiting, states):
                done[i] = over
                failing = failing or bad
            now = time.monotonic()
            if failing:
                failed_at = failed_at or now
            if all(done) or (failed_at is not None and now - failed_at >= grace_s):
                return
            time.sleep(self.poll_s)

    def _get(self, refs: list[Any], timeout: float = CALL_TIMEOUT_S) -> list[Any]:
        import ray

        return list(ray.get(refs, timeout=timeout))

    def _end(self, actors: Sequence[Any]) -> None:
        """Every surviving actor ends its rank, then every actor is killed (a rank dies with its actor)."""
        import ray

        if actors:
            ray.wait([a.finish.remote() for a in actors], num_returns=len(actors), timeout=END_TIMEOUT_S)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass


def merge(shares: Sequence[RankShare | None], log_dir: str, port: int) -> RunOutcome:
    """One RunOutcome from every node's share, judged as the runner judges its own ranks."""
    got = sorted((s for s in shares if s is not None), key=lambda s: s.ranks[0])
    ranks = tuple(r for s in got for r in s.ranks)
    tails = {r: text for s in got for r, text in s.tails.items()}
    verdict = next((s.verdict for s in got if s.verdict is not None), None)
    reports = tuple(rep for s in got for rep in s.reports)
    exits = tuple(c for s in got for c in s.exits_seen)
    codes = tuple(c for s in got for c in s.codes)
    status, error = judge(verdict, ranks, reports, exits, codes, "direct", _tail_of(tails))
    launched = min(s.launch_time for s in got)
    return RunOutcome(status, error, reports, max(s.ended_at for s in got) - launched, launched, log_dir,
                      tuple(p for s in got for p in s.pids), codes, tuple(p for s in got for p in s.peaks), port)


def _tail_of(tails: dict[int, str]) -> Callable[[str], str]:
    def tail(name: str) -> str:
        rank = name.removeprefix("rank")
        return tails.get(int(rank), "") if rank.isdigit() else ""
    return tail


def run_spanning_trial(make_backend: Callable[[], "Backend"], config: "Config", bundles: RankBundles) -> "TrialReply":
    """A Ray task (the Ray driver's, for a trial no node holds): build the backend, run the config with its
    ranks spread over the cluster; NodeLost propagates (the driver runs the trial again)."""
    import ray

    from autotune.backends.factory import as_backend
    from autotune.drivers.loop import TrialReply

    backend = as_backend(make_backend())
    if not hasattr(backend, "start_ranks"):
        return TrialReply(TrialResult(config, "crash", backend=backend.name,
                                      error=f"the {backend.name} backend cannot run a trial across nodes"))
    launch = SpanningLaunch(bundles)
    # A DeepSpeedBackend (or a subclass: script mode): its launch hook.
    backend.start_ranks = launch
    try:
        result = backend.run(config)
    finally:
        backend.close()
    ips = [site.ip for site in launch.sites]
    extra = {"node_ip": ips[0] if ips else ray.util.get_node_ip_address(), "node_ips": ips,
             "nodes": len(set(s.node_id for s in launch.sites))}
    return TrialReply(replace(result, extra={**result.extra, **extra}), getattr(backend, "fatal", None))
