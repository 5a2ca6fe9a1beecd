"""The Ray executor of the tuning loop (drivers/loop.py): several trials in flight on a Ray cluster, for one
sweep (`autotune tune --ray-address`) or several at once (`autotune sweep`).

Each trial is one Ray task that builds the sweep's backend on whichever node Ray picks and runs one config
there; the task asks for the trial's devices as Ray resources (`TrialResources`), so Ray never places two
trials on one GPU. A trial that no node holds (more ranks than any node's devices) spreads its ranks over
several nodes instead: a placement group and one actor per rank (drivers/ray_ranks.py), coordinated by a
task beside the driver; a node it loses is retried as below. Everything else stays in this driver
process, exactly as in the local driver: the strategy (Optuna's one study in the run directory's storage,
grid, random, rl, hybrid), pruning, the append-only trial log, the best result, resume. A failed trial (oom, timeout, crash) is a TrialResult the
backend returns, never a Ray error.

Why Ray Core tasks with `ray.wait` rather than Ray Tune's Tuner: our Sweep already is the searcher, the
budget, the record and the resume (RunDir); Tune would add a second experiment state (its own trial
directories, checkpoints and `Tuner.restore`) that has to be kept consistent with ours, and its trial actors
and result reporting add their own cost per trial (benchmarks/ray_scaling.py measures this driver's). What
Tune's FailureConfig gives, retrying a trial whose worker or node died, is done here in a few lines, visibly:
the task is submitted without Ray's own retries; a system failure (node died, worker crashed) resubmits the
same config, up to `max_failures` times, and says so; the trial is recorded once, with its attempts.

Concurrency: trials in flight are bounded by `concurrency` and by what the cluster holds (a proposal made
while no device is free would be made with less information than one made when the device frees up).
Several sweeps share the cluster fairly: a free slot goes to the sweep with the fewest devices in use.
A strategy that wants a result before proposing again (grid, the rl policy's walk) re-proposes its trial
in flight: that sweep waits for a result, the others go on.

Interrupt (Ctrl-C, SIGTERM): in-flight tasks are cancelled (a KeyboardInterrupt inside the task: the
deepspeed backend ends its process group) and not recorded, so `--resume` runs them again; the Optuna
trials they leave RUNNING are taken over by the resumed study.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rich.console import Console

from autotune.backends import Backend
from autotune.backends.factory import TrialOptions, as_backend, backend_kind, make_backend
from autotune.values.argtypes import whole
from autotune.values.config import Config, ConfigError
from autotune.drivers.loop import Flight, Job, TrialReply, TrialResources, run_jobs
from autotune.drivers.ray_ranks import NodeLost
from autotune.drivers.stop import StopReason
from autotune.drivers.progress import STATUS_STYLE, LiveProgress, Progress, _headline, pruned_line
from autotune.drivers.sweep import Budget, Sweep
from autotune.values.results import TrialResult
from autotune.values.units import counted, format_size
from autotune.trials.cluster import connect, disconnect

if TYPE_CHECKING:
    from autotune.drivers.ray_ranks import RankBundles
    from autotune.search.rundir import RunDir
    from autotune.values.settings import RunSettings

MAX_FAILURES = 3  # resubmissions of a trial whose worker or node died


@dataclass(frozen=True)
class RayOptions:
    address: str  # a cluster's address (host:port, or "auto"), or "local"
    concurrency: int | None = None  # trials in flight at most (None: as many as the cluster holds)
    gpus_per_trial: int | None = None  # None: the workload's data-parallel size
    max_failures: int = MAX_FAILURES
    # A workload whose trial the cluster cannot place, even spread over its nodes: True: the call is refused, one
    # ConfigError, as the command is wrong for this cluster; False (`autotune sweep`): that workload stops
    # StopReason.NO_NODE, its own verdict, and the others go on; None: True where the call tunes one workload
    # (tune()), False for several (tune_many), never by the workloads left when the cluster's turn comes (a sweep's
    # others may have ended before it).
    refuse_unplaceable: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address.strip():
            raise ConfigError(f"RayOptions address {self.address!r}: allowed a cluster's address (host:port or "
                              "'auto') or 'local' (a private cluster on this machine)")
        for name, least in (("concurrency", 1), ("gpus_per_trial", 1), ("max_failures", 0)):
            value = getattr(self, name)
            if value is None and name != "max_failures":
                continue
            number = whole(value)
            if number is None or number < least:
                raise ConfigError(f"RayOptions {name} {value!r}: allowed a whole number >= {least}"
                                  + ("" if name == "max_failures" else " or None"))
            object.__setattr__(self, name, number)
        if not (self.refuse_unplaceable is None or isinstance(self.refuse_unplaceable, bool)):
            raise ConfigError(f"RayOptions refuse_unplaceable {self.refuse_unplaceable!r}: allowed True, False or None")


def trial_resources(settings: "RunSettings", gpus_per_trial: int | None = None) -> TrialResources:
    """Real trials on GPUs take one GPU per rank (Ray sets CUDA_VISIBLE_DEVICES, so trials never share a
    device); real trials on CPU hardware take one CPU per rank; simulated and replay trials compute an
    estimate or read a table and take one CPU."""
    ranks = settings.workload.gpus
    if gpus_per_trial is not None and gpus_per_trial < ranks:
        raise ConfigError(f"--gpus-per-trial (RayOptions' `gpus_per_trial`) {gpus_per_trial}: a trial of this workload runs {ranks} ranks, "
                          f"one per device: allowed {ranks} or more")
    if not backend_kind(settings.backend).real:
        return TrialResources(cpus=1.0)
    if settings.hardware.is_cpu:
        if gpus_per_trial is not None:  # taken silently, it changed nothing
            raise ConfigError(f"--gpus-per-trial (RayOptions' `gpus_per_trial`) {gpus_per_trial}: the {settings.hardware.name} profile's trials "
                              "take one CPU per rank and no GPU: allowed with a GPU hardware profile only")
        return TrialResources(cpus=float(ranks), ranks=ranks, per_rank=(("CPU", 1.0),))
    return TrialResources(cpus=1.0, gpus=float(gpus_per_trial or ranks), ranks=ranks, per_rank=(("GPU", 1.0),))


def fits_some_node(resources: TrialResources) -> bool:
    """Some alive node has every resource one trial asks for."""
    import ray

    demand = resources.demand()
    for node in ray.nodes():
        if node.get("Alive") and all(node.get("Resources", {}).get(k, 0.0) >= v for k, v in demand.items()):
            return True
    return False


def trial_slots(resources: TrialResources, concurrency: int | None = None) -> int:
    """How many trials asking for `resources` the cluster runs at once (at most `concurrency`)."""
    capacity = cluster_capacity()
    slots = min((int(capacity.get(k, 0.0) // v) for k, v in resources.demand().items()), default=1)
    return max(1, min(slots, concurrency or slots))


def cluster_capacity() -> dict[str, float]:
    import ray

    return dict(ray.cluster_resources())


# -- the trial task (runs on a worker node)

def run_trial(make_backend: Callable[[], Backend], config: Config) -> TrialReply:
    """One trial in a Ray worker: build the backend there (it holds no state worth shipping) and run."""
    import ray

    backend = as_backend(make_backend())
    try:
        result = backend.run(config)
    finally:
        backend.close()
    extra = {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id()}
    return TrialReply(replace(result, extra={**result.extra, **extra}), backend.fatal)


# -- the scheduler

class RayExecutor:
    """Submits each trial as a Ray task (the resources of its job) and waits for the first to finish."""

    def __init__(self, max_failures: int = MAX_FAILURES, spans: dict[str, "RankBundles"] | None = None) -> None:
        import ray

        from autotune.drivers.ray_ranks import run_spanning_trial

        self.ray = ray
        self.task = ray.remote(run_trial)
        self.spanning_task = ray.remote(run_spanning_trial)
        self.spans = spans or {}  # job name -> its trials' rank bundles, for jobs whose trials span nodes
        self.refs: dict[Any, Flight] = {}
        self.max_failures = max_failures

    def room(self, job: Job) -> bool:
        """One more trial of `job` fits beside those in flight (by the cluster's total resources)."""
        capacity = cluster_capacity()
        used: dict[str, float] = {}
        for flight in self.refs.values():
            for k, v in flight.job.resources.demand().items():
                used[k] = used.get(k, 0.0) + v
        return all(used.get(k, 0.0) + v <= capacity.get(k, 0.0) + 1e-9 for k, v in job.resources.demand().items())

    def submit(self, flight: Flight) -> None:
        job = flight.job
        assert job.make_backend is not None, f"job {job.name}: a Ray worker builds the backend, from make_backend"
        bundles = self.spans.get(job.name)
        if bundles is not None:  # its placement group holds the devices; the task only coordinates, beside the driver
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=True)
            ref = self.spanning_task.options(max_retries=0, num_cpus=0, scheduling_strategy=here).remote(
                job.make_backend, flight.config, bundles)
        else:
            ref = self.task.options(max_retries=0, **job.resources.options()).remote(job.make_backend, flight.config)
        self.refs[ref] = flight
        job.progress.message(f"start     {flight.config.label():<28} {len(self.refs)} in flight"
                             + (f" (attempt {flight.attempt})" if flight.attempt > 1 else ""))

    def wait(self) -> tuple[Flight, TrialReply | None]:
        from ray import exceptions as rex

        done, _ = self.ray.wait(list(self.refs), num_returns=1)
        ref = done[0]
        flight = self.refs.pop(ref)
        job = flight.job
        elapsed = time.monotonic() - flight.submitted
        fatal = None
        try:
            reply: TrialReply = self.ray.get(ref)
            result, fatal = reply.result, reply.fatal
        except rex.OutOfMemoryError as err:  # Ray's memory monitor killed the worker: the host ran out
            result = TrialResult(flight.config, "oom", wall_time_s=elapsed, backend=job.sweep.backend_name,
                                 error=f"Ray killed the trial's worker for lack of host memory: {_first(err)}")
        except rex.RayTaskError as err:  # the trial code raised: a crash of this trial, recorded
            cause = err.cause if err.cause else err
            if isinstance(cause, NodeLost):  # a node of a multi-node trial died: as below
                return self._lost(flight, cause, elapsed)
            result = TrialResult(flight.config, "crash", wall_time_s=elapsed, backend=job.sweep.backend_name,
                                 error=f"trial raised {_first(cause)}")
        except rex.RayError as err:  # worker or node died: the trial did not finish, run it again
            return self._lost(flight, err, elapsed)
        return flight, TrialReply(replace(result, extra={**result.extra, "attempts": flight.attempt}), fatal)

    def _lost(self, flight: Flight, err: BaseException, elapsed: float) -> tuple[Flight, TrialReply | None]:
        """The trial's worker or node died: run it again, or after `max_failures` resubmissions record it."""
        job = flight.job
        if flight.attempt <= self.max_failures:
            job.progress.message(f"lost      {flight.config.label():<28} its worker or node died "
                                 f"({type(err).__name__}): submitting it again")
            return flight, None
        result = TrialResult(flight.config, "crash", wall_time_s=elapsed, backend=job.sweep.backend_name,
                             error=f"its worker or node died {flight.attempt} times: {_first(err)}")
        return flight, TrialReply(replace(result, extra={**result.extra, "attempts": flight.attempt}), None)

    def in_flight(self) -> int:
        return len(self.refs)

    def cancel(self) -> None:
        for ref in self.refs:
            self.ray.cancel(ref)  # a KeyboardInterrupt in the task: the backend ends its processes
        if self.refs:
            self.ray.wait(list(self.refs), num_returns=len(self.refs), timeout=15)
        self.refs.clear()


def run_ray(jobs: Sequence[Job], concurrency: int | None = None,
            max_failures: int = MAX_FAILURES) -> dict[str, StopReason]:
    """Run every job to its end on the connected cluster; returns each job's stop reason by name. A job whose
    trial no node holds spreads each trial's ranks over several nodes (drivers/ray_ranks.py) if the cluster
    holds them all together."""
    from autotune.drivers.ray_ranks import bundles_of, placeable

    spans = {}
    for job in jobs:
        if job.reason is None and not fits_some_node(job.resources):
            bundles = bundles_of(job.resources)
            if bundles is not None and placeable(bundles) >= bundles.ranks:
                spans[job.name] = bundles
                job.progress.message(f"no node of the cluster has {job.resources.describe()} for one "
                                     f"trial: each trial spreads its {bundles.describe()} over several nodes")
                continue
            job.reason = StopReason.NO_NODE
            # no name: a sweep's display prefixes its workload's (LabelledProgress), tune's has one sweep
            job.progress.message(f"no node of the cluster has {job.resources.describe()} for one "
                                 + (f"trial, nor can all its nodes together place {bundles.describe()}"
                                    if bundles is not None else "trial") + ": nothing runs for this workload")
    return run_jobs(jobs, RayExecutor(max_failures, spans), concurrency)


def unplaceable(resources: TrialResources) -> str | None:
    """Why the cluster cannot run one trial (no node holds it and its ranks cannot be spread either), or None."""
    from autotune.drivers.ray_ranks import bundles_of, placeable

    bundles = bundles_of(resources)
    if bundles is None or fits_some_node(resources):
        return None  # fits, or cannot be spread: run_ray says so (StopReason.NO_NODE)
    can = placeable(bundles)
    if can < bundles.ranks:
        return (f"the Ray cluster cannot place {bundles.describe()}, not even across its nodes: it holds {can} "
                f"({describe_cluster()}); allowed at most {can}")
    return None


def _first(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


class LabelledProgress:
    """Progress lines of one sweep among several, each prefixed with its workload's name; no live status
    line (several trials are in flight at once); pruned configs one line per batch (`close` prints the last)."""

    def __init__(self, label: str, total_trials: int, console: Console) -> None:
        self.label = label
        self.total = total_trials
        self.console = console
        self._pruned: list[TrialResult] = []

    def started(self, number: int, launched: int, config: Config) -> None:
        self.message(f"start     {config.label()}")

    def finished(self, result: TrialResult, launched: int, best: TrialResult | None) -> None:
        self.close()
        style = STATUS_STYLE.get(result.status, "")
        throughput = f"{result.throughput_samples_per_s:9.2f} samples/s" if result.throughput_samples_per_s else " " * 19
        best_text = f"best {best.throughput_samples_per_s:.2f} (#{best.extra.get('trial', '?')})" if best else "best -"
        error = f"  {_headline(result.error, 80)}" if result.error and not result.ok else ""
        node = f" @{result.extra['node_ip']}" if result.extra.get("node_ip") else ""
        self.console.print(
            f"[bold]{self.label}[/bold] trial {launched:>3}/{self.total} #{result.extra.get('trial', '?'):<4} "
            f"{result.config.label():<28} [{style}]{result.status:<11}[/{style}] {throughput}  peak "
            f"{format_size(result.peak_memory_bytes):>9}  {result.wall_time_s:6.1f} s{node}  {best_text}{error}",
            highlight=False)

    def pruned(self, result: TrialResult) -> None:
        self._pruned.append(result)

    def message(self, text: str) -> None:
        self.close()
        self.console.print(f"[bold]{self.label}[/bold] {text}", highlight=False)

    def close(self) -> None:
        """Print the batch of pruned configs gathered since the last line."""
        batch, self._pruned = self._pruned, []
        if batch:
            self.console.print(f"[bold]{self.label}[/bold] {pruned_line(batch, 80)}", highlight=False)


@dataclass(frozen=True)
class BackendSpec:
    """Builds a sweep's backend on a worker node: the same backend `autotune tune` builds locally.
    `run_dir` must be absolute (workers do not share the driver's working directory); on a multi-node
    cluster it should be on a filesystem every node mounts, or trial logs stay on the node that ran them."""

    settings: "RunSettings"
    run_dir: str
    options: TrialOptions = TrialOptions()  # how each trial runs (TuneSpec.trial_options)

    def __call__(self) -> Backend:
        from autotune.search.rundir import RunDir

        return make_backend(self.settings, RunDir(self.run_dir), self.options)


@dataclass(frozen=True)
class ClusterRun:
    """One open sweep whose trials the cluster runs: a job of the driver (job_for)."""

    name: str
    sweep: Sweep
    settings: "RunSettings"
    run_dir: "RunDir"
    budget: Budget
    progress: Progress
    gpus_per_trial: int | None = None  # None: the workload's ranks
    options: TrialOptions = TrialOptions()  # how each trial runs (TuneSpec.trial_options)


def run_on_cluster(runs: Sequence[ClusterRun], options: RayOptions, say: Callable[[str], None]) -> list[StopReason]:
    """Every open sweep's trials at once on the cluster at `options.address` (connected here, disconnected at the
    end), one driver sharing it fairly: `autotune tune --ray-address` (one sweep), `autotune sweep` (several).
    Returns why each stopped, in order. A trial the cluster cannot place: a ConfigError first, nothing run
    (`options.refuse_unplaceable`, tune's), else that sweep's StopReason.NO_NODE, said by `say` naming it."""
    connect(options.address)
    try:
        jobs = []
        for run in runs:
            resources = trial_resources(run.settings, run.gpus_per_trial)
            unplaced = unplaceable(resources)
            if unplaced is not None and options.refuse_unplaceable:  # `tune`: the command is wrong for this cluster
                raise ConfigError(f"--gpus (the workload's `gpus`) {resources.ranks}: {unplaced}")
            if isinstance(run.progress, LiveProgress):  # its ETA divides the trials left among the slots
                run.progress.set_slots(trial_slots(resources, options.concurrency))
            jobs.append(job_for(run.name, run.sweep, run.settings, run.run_dir, run.budget, resources, run.progress,
                                run.options))
            if unplaced is not None:  # one workload of a sweep file: its own verdict, the others go on
                jobs[-1].reason = StopReason.NO_NODE
                # The runner's line (unlabelled), naming the workload and its key once: not tune's --gpus flag
                say(f"{run.name}: gpus {resources.ranks}: {unplaced}: nothing runs for this workload")
        limit = f", at most {options.concurrency} in flight" if options.concurrency else ""
        shape = (f"one trial asks for {resources.describe()}" if len(runs) == 1 else
                 f"{len(runs)} workloads at once")
        say(f"Ray cluster {options.address}: {describe_cluster()}; {shape}{limit}")
        reasons = run_ray(jobs, options.concurrency, options.max_failures)
        return [reasons[job.name] for job in jobs]
    finally:
        disconnect()


def job_for(name: str, sweep: Sweep, settings: "RunSettings", run_dir: "RunDir", budget: Budget,
            resources: TrialResources, progress: Progress, options: TrialOptions = TrialOptions()) -> Job:
    """The Ray driver's job for one open sweep (the cluster is connected): each trial's backend built on its
    node from the settings, or, for a script, from its shipped files (drivers/ray_script.py)."""
    if backend_kind(settings.backend).ships:
        from autotune.drivers.ray_script import script_job

        return script_job(sweep, settings, run_dir, budget, resources, progress, name=name, options=options)
    return Job(name, sweep, budget, resources, BackendSpec(settings, str(run_dir.path.resolve()), options), progress)


def describe_cluster() -> str:
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    totals = cluster_capacity()
    shown = {k: v for k, v in totals.items() if k in ("CPU", "GPU") or not (k.startswith("node:") or "memory" in k)}
    return f"{counted(len(alive), 'node')}, " + ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items()))
