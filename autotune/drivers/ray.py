"""The Ray executor of the tuning loop (drivers/loop.py): several trials in flight on a Ray cluster, for one
sweep (`autotune tune --ray-address`) or several at once (`autotune sweep`).

Each trial is one Ray task that builds the sweep's backend on whichever node Ray picks and runs one config
there; the task asks for the trial's devices as Ray resources (`TrialResources`), so Ray never places two
trials on one GPU. Everything else stays in this driver process, exactly as in the local driver: the
strategy (Optuna's one study in the run directory's storage, grid, random, rl, hybrid), pruning, the
append-only trial log, the best result, resume. A failed trial (oom, timeout, crash) is a TrialResult the
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

import os
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rich.console import Console

from autotune.backends import Backend
from autotune.backends.factory import TrialOptions, as_backend, backend_kind, make_backend, simulated_sleep_s
from autotune.config import Config, ConfigError
from autotune.drivers.loop import Flight, Job, TrialReply, TrialResources, run_jobs
from autotune.drivers.stop import StopReason
from autotune.drivers.progress import STATUS_STYLE, Progress, _headline
from autotune.drivers.sweep import Budget, Sweep
from autotune.results import TrialResult
from autotune.units import format_size

if TYPE_CHECKING:
    from autotune.rundir import RunDir, RunSettings

LOCAL = "local"  # --ray-address local: start a private single-node Ray instance for this run
MAX_FAILURES = 3  # resubmissions of a trial whose worker or node died
# Ray (2.60) binds its servers to loopback only when the node's IP is literally 127.0.0.1, and resolves
# 127.0.0.1 to the routable address unless this variable is 0 (its switch for single-machine clusters).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@dataclass(frozen=True)
class RayOptions:
    address: str  # a cluster's address (host:port, or "auto"), or "local"
    concurrency: int | None = None  # trials in flight at most (None: as many as the cluster holds)
    gpus_per_trial: int | None = None  # None: the workload's data-parallel size
    max_failures: int = MAX_FAILURES


def trial_resources(settings: "RunSettings", gpus_per_trial: int | None = None) -> TrialResources:
    """Real trials on GPUs take one GPU per rank (Ray sets CUDA_VISIBLE_DEVICES, so trials never share a
    device); real trials on CPU hardware take one CPU per rank; simulated and replay trials compute an
    estimate or read a table and take one CPU."""
    ranks = settings.workload.gpus
    if gpus_per_trial is not None and gpus_per_trial < ranks:
        raise ConfigError(f"--gpus-per-trial {gpus_per_trial}: a trial of this workload runs {ranks} ranks, "
                          f"one per device: allowed {ranks} or more")
    if not backend_kind(settings.backend).real:
        return TrialResources(cpus=1.0)
    if settings.hardware.is_cpu:
        return TrialResources(cpus=float(ranks))
    return TrialResources(cpus=1.0, gpus=float(gpus_per_trial or ranks))


def connect(address: str, num_cpus: int | None = None) -> None:
    """Connect this process to a Ray cluster (or start a private local one of `num_cpus` CPUs, default every
    core); one-line error on failure."""
    if address == LOCAL and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")  # read when ray is imported: bind the instance to loopback
    import ray

    if ray.is_initialized():
        return
    try:
        if address == LOCAL:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as err:  # noqa: BLE001  (ConnectionError, AuthenticationError, RuntimeError, ...)
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hint = ("; is it running, and if it uses token authentication, are RAY_AUTH_MODE=token and its token "
                "(RAY_AUTH_TOKEN_PATH=FILE, RAY_AUTH_TOKEN, or ~/.ray/auth_token) set in this environment?")
        raise ConfigError(f"--ray-address {address}: cannot connect to Ray: {message}{hint}") from None


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def fits_some_node(resources: TrialResources) -> bool:
    """Some alive node has every resource one trial asks for."""
    import ray

    demand = resources.demand()
    for node in ray.nodes():
        if node.get("Alive") and all(node.get("Resources", {}).get(k, 0.0) >= v for k, v in demand.items()):
            return True
    return False


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

    def __init__(self, max_failures: int = MAX_FAILURES) -> None:
        import ray

        self.ray = ray
        self.task = ray.remote(run_trial)
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
            result = TrialResult(flight.config, "crash", wall_time_s=elapsed, backend=job.sweep.backend_name,
                                 error=f"trial raised {_first(err.cause if err.cause else err)}")
        except rex.RayError as err:  # worker or node died: the trial did not finish, run it again
            if flight.attempt <= self.max_failures:
                job.progress.message(f"lost      {flight.config.label():<28} its worker or node died "
                                     f"({type(err).__name__}): submitting it again")
                return flight, None
            result = TrialResult(flight.config, "crash", wall_time_s=elapsed, backend=job.sweep.backend_name,
                                 error=f"its worker or node died {flight.attempt} times: {_first(err)}")
        return flight, TrialReply(replace(result, extra={**result.extra, "attempts": flight.attempt}), fatal)

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
    """Run every job to its end on the connected cluster; returns each job's stop reason by name."""
    for job in jobs:
        if job.reason is None and not fits_some_node(job.resources):
            job.reason = StopReason.NO_NODE
            job.progress.message(f"{job.name}: no node of the cluster has {job.resources.describe()} for one "
                                 "trial: nothing runs for this workload")
    return run_jobs(jobs, RayExecutor(max_failures), concurrency)


def _first(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


class LabelledProgress:
    """Progress lines of one sweep among several, each prefixed with its workload's name; no live status
    line (several trials are in flight at once)."""

    def __init__(self, label: str, total_trials: int, console: Console) -> None:
        self.label = label
        self.total = total_trials
        self.console = console

    def started(self, number: int, launched: int, config: Config) -> None:
        self.message(f"start     {config.label()}")

    def finished(self, result: TrialResult, launched: int, best: TrialResult | None) -> None:
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
        self.message(f"pruned    #{result.extra.get('trial', '?'):<4} {result.config.label():<28} "
                     f"[dim]{_headline(result.error, 80)}[/dim]")

    def message(self, text: str) -> None:
        self.console.print(f"[bold]{self.label}[/bold] {text}", highlight=False)


@dataclass(frozen=True)
class BackendSpec:
    """Builds a sweep's backend on a worker node: the same backend `autotune tune` builds locally.
    `run_dir` must be absolute (workers do not share the driver's working directory); on a multi-node
    cluster it should be on a filesystem every node mounts, or trial logs stay on the node that ran them."""

    settings: "RunSettings"
    run_dir: str
    sleep_s: float = 0.0  # test and benchmark hook: every trial also sleeps this long

    def __call__(self) -> Backend:
        from autotune.rundir import RunDir

        return make_backend(self.settings, RunDir(self.run_dir), TrialOptions(sleep_s=self.sleep_s))


def run_one(sweep: Sweep, settings: "RunSettings", run_dir: "RunDir", budget: Budget, options: RayOptions,
            progress: Progress) -> StopReason:
    """`autotune tune --ray-address`: one sweep's trials on the cluster; returns why it stopped."""
    resources = trial_resources(settings, options.gpus_per_trial)
    sleep_s = simulated_sleep_s(settings.backend)
    connect(options.address)
    try:
        progress.message(f"Ray cluster {options.address}: {describe_cluster()}; one trial asks for "
                         f"{resources.describe()}"
                         + (f", at most {options.concurrency} in flight" if options.concurrency else ""))
        job = Job(settings.workload.model.name, sweep, budget, resources,
                  BackendSpec(settings, str(run_dir.path.resolve()), sleep_s), progress)
        return run_ray([job], options.concurrency, options.max_failures)[job.name]
    finally:
        disconnect()


def describe_cluster() -> str:
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    totals = cluster_capacity()
    shown = {k: v for k, v in totals.items() if k in ("CPU", "GPU") or not (k.startswith("node:") or "memory" in k)}
    return f"{len(alive)} nodes, " + ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items()))
