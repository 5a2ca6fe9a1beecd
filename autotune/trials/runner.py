"""Launch one trial's ranks on this machine, watch them, end them all, and say what happened.

Launchers (all single-node, no pdsh/ssh; a trial whose ranks span nodes gives each node's runner its share,
`Placement`, from autotune.drivers.ray_ranks, which judges the shares together with `judge`):
- `direct` (default): the runner starts the N rank processes itself with the environment torchrun would
  give them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...). No launcher interpreter in between:
  that saves an import of torch per trial, the runner knows every rank's pid and exit status, and each
  rank asks the kernel to kill it if the runner dies.
- `torchrun` and `deepspeed`: the same worker through `torch.distributed.run` or DeepSpeed's own
  launcher, for comparison (benchmarks/trial_overhead.py).
Every process is started in a new session (its own process group). A fresh MASTER_PORT is chosen per trial.
Nothing of a trial listens beyond loopback: rank 0 serves the rendezvous store on MASTER_ADDR (127.0.0.1;
autotune.worker.main.host_store) and gloo's and NCCL's sockets are bound to `lo`. A multi-node share
binds them to its node's cluster address and the interface that carries it instead.
A trial's port is claimed with an owner marker beside DeepSpeed's shared-memory segments, so that the
segments of a trial whose tuner was killed (SIGKILL: no cleanup ran) are removed when the next ds-autotune
sweep or trial command starts on the machine (any run: remove_stale_shm_at_start), and again at each trial's
start; never a segment whose marker's runner is alive, nor one some process still holds.

While the trial runs, the runner polls (every `poll_s`): the ranks' reports, their exits, the wall-clock
timeout (paused while a rank builds DeepSpeed's C++ ops, a one-time cost per machine), and on the CPU the
memory budget: each rank's VmHWM (a true peak, so a spike between polls is not missed) against the budget.
On timeout, budget breach, a failed rank (after a short grace for the others to report), or an exception
in the runner itself (KeyboardInterrupt: the tuner's interruption), every process of the trial is killed
(process groups, then any descendant that left them) and reaped before `run_worker` returns or raises.
A trial whose rank 0 found its rendezvous port taken (another process bound it after the claim) is launched
again once on a newly claimed port, the first launch's rank files set aside in its log folder; its outcome says so.

Spares (issue 41: cheaper trials): a runner given `Spares` starts, while a trial runs, the next trial's ranks
(`python -m autotune.worker --spare`, script mode's `python -m autotune.script --spare`) once the trial's own
ranks have made their imports; they import torch and DeepSpeed (~1 s of a 4.3 s trial of tiny on the 2-core
CPU, 4.9-5.2 s of every H200 trial's 17-23 s to its first measured step) and wait. The next trial whose ranks
would start with the same command and environment (all but its rendezvous port) is handed to them instead of new
processes (`ahead_allowed`: where a core beside each rank is free for a spare's imports). A spare still importing
when a trial starts measuring is stopped (SIGSTOP) until that trial ends, so it never takes a core from a measured
step. A spare that dies before it takes its trial is replaced by the trial's own ranks; one whose imports opened
the device (it would hold device memory beside the trial running meanwhile) exits, and no spare is started again.

The verdict comes from structured signals only: the runner's own observations (timeout, budget), the
ranks' report files (ok / oom / unsupported / crash with the exception type), and exit codes and signals.
stderr is kept in the logs and its last lines are quoted in a crash's message, never parsed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from subprocess import DEVNULL, PIPE, Popen
from typing import Any, Callable, Mapping, Sequence

import psutil

from autotune.values.allocator import environment as allocator_environment
from autotune.values.results import STDERR_TAIL
from autotune.trials.ops import with_deepspeed_arch_list
from autotune.worker import procmem
from autotune.worker.main import PARENT_ENV, SPARE_DEVICE_EXIT
from autotune.worker.protocol import WorkerSpec, read_events, read_report

LAUNCHERS = ("direct", "torchrun", "deepspeed")
STDERR_TAIL_LINES = 15
MAX_BUILD_PAUSE_S = 1800.0  # a first-use C++ op build longer than this counts against the timeout
MASTER_ADDR = "127.0.0.1"
LOOPBACK_IFNAME = "lo"  # Linux's loopback interface
SHM_DIR = Path("/dev/shm")
OWNER_PREFIX = "ds-autotune_trial"  # SHM_DIR/<prefix>_<uid>_<port>.owner: the runner that owns that port's segments
STALE_MARKER_AGE_S = 60.0  # an unreadable marker this old was left by a runner killed while writing it
SPARE_MODULES = ("autotune.worker", "autotune.script")  # the ranks that can be started ahead of a trial (`--spare`)
PER_TRIAL_ENV = ("MASTER_PORT",)  # what a trial's ranks' environment holds that the spares' cannot know yet
RELAUNCHES = 1  # a trial whose rendezvous port another process took is launched again, on another port, this often


@dataclass(frozen=True)
class Placement:
    """This runner's share of a trial whose ranks span nodes (autotune.drivers.ray_ranks): which ranks it starts
    and where all of them meet. LaunchOptions.placement None: every rank here, meeting on loopback."""

    ranks: tuple[int, ...]  # the global ranks started here
    local_ranks: tuple[int, ...]  # their index among the trial's ranks on this node (LOCAL_RANK)
    local_world_size: int  # the trial's ranks on this node
    world_size: int
    node_rank: int
    master_addr: str  # rank 0's node's address on the cluster's network: its store listens there only
    master_port: int
    ifname: str | None = None  # the interface carrying this node's address; None: unknown, left to gloo/NCCL
    env: Mapping[str, str] = field(default_factory=dict)  # e.g. CUDA_VISIBLE_DEVICES: this node's devices of the trial


@dataclass(frozen=True)
class LaunchOptions:
    ranks: int = 1
    timeout_s: float = 600.0
    memory_budget_bytes: int | None = None  # per rank; enforced here on the CPU, by the allocator on CUDA
    launcher: str = "direct"
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the trial's processes
    poll_s: float = 0.05
    grace_s: float = 3.0  # after one rank fails, how long the others get to write their own report
    python: str = sys.executable
    module: str = "autotune.worker"  # what each rank runs: `python -m <module> <spec.json>` (script mode: autotune.script)
    placement: Placement | None = None  # a share of a multi-node trial; None: all `ranks` here
    allocator: str | None = None  # CUDA's allocator mode (autotune.values.allocator); None: the environment's

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}: allowed {list(LAUNCHERS)}")
        if self.ranks < 1 or self.timeout_s <= 0:
            raise ValueError(f"ranks={self.ranks}, timeout_s={self.timeout_s}: must be positive")
        if self.placement is not None and (len(self.placement.ranks) != self.ranks or self.launcher != "direct"):
            raise ValueError(f"placement of ranks {self.placement.ranks}: needs ranks={len(self.placement.ranks)} "
                             f"and the direct launcher (got ranks={self.ranks}, launcher={self.launcher!r})")


@dataclass(frozen=True)
class RunOutcome:
    status: str  # ok | oom | unsupported | timeout | crash
    error: str | None
    reports: tuple[dict[str, Any] | None, ...]  # per rank, as written by the rank (None: none written)
    wall_time_s: float
    launch_time: float
    log_dir: str
    pids: tuple[int, ...]  # every process of the trial the runner saw (all ended when it returns)
    exit_codes: tuple[int | None, ...]  # per launched process; negative: killed by that signal
    observed_peaks: tuple[int, ...] = ()  # CPU ranks: the highest VmHWM the runner read, per rank seen
    master_port: int = 0  # of the trial's rendezvous (and of its shared-memory segments)
    # Launches before this one whose rendezvous port another process took (`relaunch`): port, seconds, logs moved to.
    relaunched: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class RankShare:
    """What one runner saw of its ranks of a multi-node trial, all of them ended: the evidence the driver-side
    trial (autotune.drivers.ray_ranks) judges with `judge`, as a runner judges its own ranks."""

    ranks: tuple[int, ...]
    verdict: tuple[str, str] | None  # the runner's own: timeout or the budget watchdog
    reports: tuple[dict[str, Any] | None, ...]
    exits_seen: tuple[int | None, ...]  # before anything was killed
    codes: tuple[int | None, ...]
    peaks: tuple[int, ...]
    pids: tuple[int, ...]
    tails: Mapping[int, str]  # rank -> the last lines of its stderr, as a crash message quotes them
    launch_time: float
    ended_at: float


def extensions_dir(python: str) -> str:
    """Where DeepSpeed's JIT-built ops for the environment of `python` (its venv or prefix) are kept."""
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha1(prefix.encode()).hexdigest()[:12]
    return os.path.join(cache, "ds-autotune", "torch_extensions", f"{os.path.basename(prefix) or 'root'}-{key}")


def remove_shm_buffers(addr: str, port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Unlink the shared-memory allreduce buffers DeepSpeed's CPU accelerator made for one trial.

    Its shm_comm op creates one POSIX segment of ~66 MB per rank, named after the uid, master address and
    port, and never unlinks it: without this, a sweep of a few hundred trials fills /dev/shm, i.e. RAM."""
    removed = []
    for path in shm_dir.glob(_buffer_glob(addr, port)):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _buffer_glob(addr: str, port: int) -> str:
    return f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the owner marker of a trial's shared memory --------------------------------------------------------
# A tuner killed with SIGKILL runs no cleanup: its trial's segments would stay until reboot. So each trial
# first claims its port with a marker beside the segments (same machine, same lifetime: tmpfs), naming the
# runner process that owns them; every later trial start removes the segments of markers whose owner is gone.

def _marker(port: int, shm_dir: Path) -> Path:
    return shm_dir / f"{OWNER_PREFIX}_{os.getuid()}_{port}.owner"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def claim_port(shm_dir: Path = SHM_DIR, attempts: int = 20) -> int:
    """A free port for a trial's rendezvous, with this process recorded as the owner of its segments.
    The marker is created exclusively and without following links, so a port another runner holds (or a
    file planted in the shared directory) is never taken over; without a usable directory, a plain port."""
    owner = json.dumps({"pid": os.getpid(), "started": psutil.Process().create_time(), "pidns": _pid_namespace()})
    for _ in range(attempts):
        port = free_port()
        try:
            fd = os.open(_marker(port, shm_dir), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue  # another trial's port (or a stale marker the next cleanup removes)
        except OSError:
            return port  # no shared-memory directory here: nothing to leak, nothing to mark
        with os.fdopen(fd, "w") as out:
            out.write(owner)
        return port
    return free_port()


def release_port(port: int, shm_dir: Path = SHM_DIR) -> None:
    """This process's trial of `port` has ended and its segments are gone: drop its marker (only its own:
    a port claimed without a marker may carry another runner's, or a file someone else planted)."""
    if _marker_pid(_marker(port, shm_dir)) == os.getpid():
        _marker(port, shm_dir).unlink(missing_ok=True)


def _marker_pid(marker: Path) -> int | None:
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd) as handle:
        if os.fstat(handle.fileno()).st_uid != os.getuid():
            return None
        try:
            return int(json.loads(handle.read(4096))["pid"])
        except (ValueError, TypeError, KeyError, OSError):
            return None


def remove_stale_shm(shm_dir: Path = SHM_DIR, addr: str = MASTER_ADDR) -> list[Path]:
    """Remove what trials of dead runners left in `shm_dir` (their segments and markers); returns what was
    removed. Never touches a marker of another user, of a live runner, of another pid namespace (a container
    sharing /dev/shm, whose processes cannot be seen from here), nor a segment some process still holds."""
    stale = [(path, port) for path, port in _markers(shm_dir) if _owner_gone(path)]
    if not stale:
        return []
    held = _held_files(shm_dir)
    removed: list[Path] = []
    for marker, port in stale:
        segments = list(shm_dir.glob(_buffer_glob(addr, port)))
        busy = [s for s in segments if s.name in held]
        for segment in segments:
            if segment.name not in held:
                try:
                    segment.unlink()
                    removed.append(segment)
                except FileNotFoundError:
                    pass
        if not busy:  # a survivor (e.g. a launcher's orphan) still holds some: look again next time
            marker.unlink(missing_ok=True)
            removed.append(marker)
    return removed


def remove_stale_shm_at_start(shm_dir: Path | None = None) -> list[Path]:
    """At the start of any sweep or trial command (autotune.cli) and of `autotune.tune()`: remove_stale_shm, so
    that the segments of a tuner killed with SIGKILL (~66 MB per rank) go with the next ds-autotune process on
    the machine, whatever run or command it is, not only at the next real trial. Never fails the command."""
    try:
        return remove_stale_shm(SHM_DIR if shm_dir is None else shm_dir)
    except OSError:
        return []


def _markers(shm_dir: Path) -> list[tuple[Path, int]]:
    found = []
    for path in shm_dir.glob(f"{OWNER_PREFIX}_{os.getuid()}_*.owner"):
        port = path.name[:-len(".owner")].rsplit("_", 1)[-1]
        if port.isdigit():
            found.append((path, int(port)))
    return found


def _owner_gone(marker: Path) -> bool:
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # a link, or gone meanwhile: not ours to judge
    with os.fdopen(fd) as handle:
        if os.fstat(handle.fileno()).st_uid != os.getuid():
            return False
        text = handle.read(4096)
        age = time.time() - os.fstat(handle.fileno()).st_mtime
    try:
        owner = json.loads(text)
        pid, started, pidns = int(owner["pid"]), float(owner["started"]), str(owner.get("pidns", ""))
    except (ValueError, TypeError, KeyError):
        return age > STALE_MARKER_AGE_S  # its runner died between creating and writing it
    if pidns != _pid_namespace():
        return False
    try:
        proc = psutil.Process(pid)
        return proc.status() == psutil.STATUS_ZOMBIE or abs(proc.create_time() - started) > 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _held_files(shm_dir: Path) -> set[str]:
    """Names of the files directly in `shm_dir` that some process visible here has open or mapped."""
    prefix = os.path.realpath(shm_dir) + os.sep
    held: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    held.add(target[len(prefix):].removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.rstrip("\n").split(maxsplit=5)[5:]
                    if path and path[0].startswith(prefix):
                        held.add(path[0][len(prefix):].removesuffix(" (deleted)"))
        except OSError:
            continue  # gone, or another user's
    return held


def trial_environment(options: LaunchOptions, accelerator: str,
                      base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every process of a trial starts from (the runner adds the rendezvous and rank variables),
    and the op preflight's (autotune.trials.ops) and launch.sh's (autotune.outputs.launch): this process's (or
    `base`: a recorded one), the options' extra variables, then what trials need (on CUDA, the sweep's allocator
    mode)."""
    # The trial's accelerator wins over the caller's environment: the trial runs where it was planned to.
    env = {**(os.environ if base is None else base), **options.env, "PYTHONUNBUFFERED": "1",
           "DS_ACCELERATOR": accelerator}
    # The interpreter's own bin directory first, as an activated venv has it: DeepSpeed's op builds call
    # `ninja` from PATH, and two ninja versions (the venv's, the system's) do not read each other's
    # build logs, so they rebuild the C++ ops (minutes) every time the other one ran last.
    bin_dir = os.path.dirname(options.python)
    if env.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        env["PATH"] = os.pathsep.join(part for part in (bin_dir, env.get("PATH")) if part)
    # One C++ op cache per Python environment: two venvs sharing torch's default cache directory write
    # build files with their own include paths into the same folders and rebuild each other's ops.
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir(options.python))
    if accelerator == "cuda" and options.allocator is not None:  # the sweep's allocator mode, over the tuner's own
        env.update(allocator_environment(options.allocator, env))
    # An arch list DeepSpeed's op builder parses (a CUDA image's `9.0a` crashes every FusedAdam build).
    return with_deepspeed_arch_list(env)


def rank_threads(env: Mapping[str, str], local_size: int, cpus: int | None = None) -> str:
    """OMP_NUM_THREADS of each of `local_size` ranks on one machine (also the launch file's, autotune.outputs.launch):
    `env`'s own, else an even share of the cores (this machine's, or `cpus`). Ranks share the cores; oversubscribed
    OpenMP threads spin against each other."""
    if "OMP_NUM_THREADS" in env:
        return env["OMP_NUM_THREADS"]
    return str(max(1, (cpus or os.cpu_count() or 1) // local_size))


@dataclass(frozen=True)
class SpareRank:
    proc: Popen
    ready: Path  # written by the rank once its imports are done
    stdout: Path  # what it printed before its trial (moved into the trial's log when handed over)
    stderr: Path


class Spares:
    """Ranks started ahead of the trial that will use them (one set at a time), in `folder`; `close` ends them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.held: tuple[tuple, list[SpareRank]] | None = None
        self.stopped: list[SpareRank] = []
        self.started = 0
        self.off = False  # a spare's imports opened the device: on this machine every one's would, none starts

    @staticmethod
    def key(argv: Sequence[str], envs: Sequence[Mapping[str, str]]) -> tuple:
        """What a set of ranks must share with a trial's to run it: command and environment, but for PER_TRIAL_ENV."""
        return tuple(argv), tuple(tuple(sorted((k, v) for k, v in env.items() if k not in PER_TRIAL_ENV))
                                  for env in envs)

    def start(self, python: str, module: str, envs: Sequence[Mapping[str, str]]) -> None:
        """Start one rank of `python -m module` per environment of `envs` (ending any set held before)."""
        self.close()
        if self.off:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.started += 1
        ranks = []
        for i, env in enumerate(envs):
            name = self.folder / f"spare{self.started}.rank{i}"
            ready, out, err = (Path(f"{name}.{ext}") for ext in ("ready", "stdout", "stderr"))
            ready.unlink(missing_ok=True)
            with out.open("wb") as stdout, err.open("wb") as stderr:
                proc = Popen([python, "-m", module, "--spare", str(ready)], env=dict(env), stdin=PIPE, stdout=stdout,
                             stderr=stderr, start_new_session=True)
            ranks.append(SpareRank(proc, ready, out, err))
        self.held = self.key([python, "-m", module], envs), ranks

    def start_first(self, options: LaunchOptions, accelerator: str) -> None:
        """Ranks for the next trial of `options` before any trial started them (a sweep's first trial waits for its
        ops to build: its imports are made meanwhile), where spares are allowed and none are held."""
        if self.held is None and ahead_allowed(options):
            envs = direct_environments(options, ranks_environment(options, accelerator, 0))
            self.start(options.python, options.module, envs)

    def take(self, key: tuple) -> list[SpareRank] | None:
        """The held ranks if they can run a trial of `key` and are alive; else None (and any held set is ended)."""
        held, self.held = self.held, None
        if held is None:
            return None
        if held[0] == key and all(r.proc.poll() is None for r in held[1]):
            return held[1]
        self.drop(held[1])
        return None

    def drop(self, ranks: Sequence[SpareRank]) -> None:
        """End ranks no trial will run on and remove their files (what they printed is their imports'); one that
        exited because its imports opened the device turns spares off."""
        self.off = self.off or any(r.proc.poll() == SPARE_DEVICE_EXIT for r in ranks)
        _end([r.proc for r in ranks])
        for rank in ranks:
            for path in (rank.ready, rank.stdout, rank.stderr):
                path.unlink(missing_ok=True)

    def hand_over(self, ranks: Sequence[SpareRank], envs: Sequence[Mapping[str, str]], spec_path: Path,
                  log_dir: Path, names: Sequence[str]) -> bool:
        """Give each rank its trial (autotune.worker.main.wait_for_trial); False if one is gone (all are ended)."""
        try:
            for rank, env, name in zip(ranks, envs, names):
                order = {"spec": str(spec_path), "env": {k: env[k] for k in PER_TRIAL_ENV if k in env},
                         "stdout": [str(rank.stdout), str(log_dir / f"{name}.stdout")],
                         "stderr": [str(rank.stderr), str(log_dir / f"{name}.stderr")]}
                assert rank.proc.stdin is not None
                rank.proc.stdin.write((json.dumps(order) + "\n").encode())
                rank.proc.stdin.close()
        except (BrokenPipeError, OSError):
            self.drop(ranks)
            return False
        return True

    def hold_unready(self) -> None:
        """A trial is measuring: stop the held ranks still importing (SIGSTOP) until `resume`."""
        for rank in (self.held[1] if self.held else []):
            if rank not in self.stopped and not rank.ready.exists() and rank.proc.poll() is None:
                with _quiet():
                    os.killpg(rank.proc.pid, signal.SIGSTOP)
                self.stopped.append(rank)

    def resume(self) -> None:
        for rank in self.stopped:
            with _quiet():
                os.killpg(rank.proc.pid, signal.SIGCONT)
        self.stopped = []

    def close(self) -> None:
        """End the held ranks, if any."""
        self.resume()
        held, self.held = self.held, None
        if held is not None:
            self.drop(held[1])


def ranks_environment(options: LaunchOptions, accelerator: str, master_port: int) -> dict[str, str]:
    """The environment a trial's ranks (or its launcher) share on this node."""
    place = options.placement
    base = {**trial_environment(options, accelerator), "MASTER_ADDR": place.master_addr if place else MASTER_ADDR,
            "MASTER_PORT": str(master_port), "LOCAL_SIZE": str(place.local_world_size if place else options.ranks)}
    if place is None:
        # One machine: the ranks' own sockets (gloo's and NCCL's pairs and bootstrap) listen on
        # loopback, not on the interface an inherited setting or the host name would pick.
        base.update(GLOO_SOCKET_IFNAME=LOOPBACK_IFNAME, NCCL_SOCKET_IFNAME=LOOPBACK_IFNAME)
    else:
        base.update(place.env)
        if place.ifname:  # the interface of this node's cluster address ('=': NCCL's exact match, not a prefix)
            base.update(GLOO_SOCKET_IFNAME=place.ifname, NCCL_SOCKET_IFNAME=f"={place.ifname}")
    # The trial's rank 0 hosts its rendezvous store (autotune.worker.main.host_store); this variable inherited (a
    # tuner started under torchrun's agent) would have every rank wait, 30 minutes, on a store nobody serves.
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    base["OMP_NUM_THREADS"] = rank_threads(base, int(base["LOCAL_SIZE"]))
    return base


def direct_environments(options: LaunchOptions, base: Mapping[str, str]) -> list[dict[str, str]]:
    """Each rank's environment where the runner starts the ranks itself (`direct`), this node's ranks in order."""
    place = options.placement
    ranks = place.ranks if place else tuple(range(options.ranks))
    local = place.local_ranks if place else ranks
    world, node = (place.world_size, place.node_rank) if place else (options.ranks, 0)
    return [{**base, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": base["LOCAL_SIZE"], "GROUP_RANK": str(node), PARENT_ENV: str(os.getpid())}
            for rank, local_rank in zip(ranks, local)]


def ahead_allowed(options: LaunchOptions, cores: int | None = None) -> bool:
    """Whether a trial of `options` may run on ranks started ahead and start the next trial's: the built-in worker
    or script mode's shim, launched directly, every rank on this machine, and a core beside each rank for each
    spare's imports (on the 2-core CPU, two spares importing beside 2-rank trials slowed their initialize more than
    they saved: 5.3-5.6 s a trial against 4.5 s without, one sequence of four)."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    return options.module in SPARE_MODULES and options.launcher == "direct" and options.placement is None \
        and cores >= 2 * options.ranks


def _end(procs: Sequence[Popen]) -> None:
    for proc in procs:
        with _quiet():
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdin is not None:
            with _quiet():
                proc.stdin.close()
    for proc in procs:
        proc.wait()


def _quiet() -> contextlib.suppress:
    """Ignore that a process is already gone (or no longer ours to signal)."""
    return contextlib.suppress(ProcessLookupError, PermissionError, BrokenPipeError)


def run_worker(spec: WorkerSpec, options: LaunchOptions, spares: Spares | None = None) -> RunOutcome:
    """Run the trial described by `spec` (whose `log_dir` receives every file) and return its outcome; with
    `spares`, on ranks started ahead where they fit, and starting the next trial's meanwhile."""
    log_dir = Path(spec.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_shm()  # what earlier trials of killed tuners left behind
    relaunched: list[dict[str, Any]] = []
    while True:
        trial = Trial(spec, options, log_dir, spares)
        try:
            trial.launch()
            trial.watch()
        finally:
            trial.end()  # also on KeyboardInterrupt / SystemExit: no process of the trial outlives this call
        outcome = replace(trial.outcome(), relaunched=tuple(relaunched))
        taken = port_taken(outcome)
        if taken is None or len(relaunched) >= RELAUNCHES:
            return outcome
        relaunched.append(set_aside(outcome, taken))


def port_taken(outcome: RunOutcome) -> int | None:
    """The rendezvous port a crashed trial's rank 0 found taken by another process (autotune.worker.main.PortTaken):
    anything on the machine can bind a port between the runner's claim and the rank's bind."""
    if outcome.status != "crash":
        return None
    return next((int(r["port_taken"]) for r in outcome.reports if r and r.get("port_taken")), None)


def set_aside(outcome: RunOutcome, port: int) -> dict[str, Any]:
    """Move a launch's rank files into a folder of their own (`port-taken-<port>/`), so that the trial launched
    again writes its own beside the backend's; returns what the record keeps of that launch."""
    log_dir = Path(outcome.log_dir)
    aside = log_dir / f"port-taken-{port}"
    aside.mkdir(exist_ok=True)
    for path in log_dir.iterdir():
        if path.is_file() and path.name.startswith(("rank", "launcher.")):
            path.replace(aside / path.name)
    return {"port": port, "seconds": round(outcome.wall_time_s, 2), "logs": aside.name}


class Trial:
    """The ranks this runner starts (all of a trial's, or one node's share: `LaunchOptions.placement`)."""

    def __init__(self, spec: WorkerSpec, options: LaunchOptions, log_dir: Path, spares: Spares | None = None) -> None:
        self.options, self.log_dir = options, log_dir
        self.spares = spares if spares is not None and ahead_allowed(options) else None
        self.spare_key: tuple | None = None  # what the next trial's ranks, started once this one's imported, share
        self.ahead: list[SpareRank] | None = None  # ranks started ahead that took this trial, until each began it
        self.argv: list[str] = []  # how this trial's ranks start (direct launch), one environment each
        self.envs: list[dict[str, str]] = []
        self.placement = options.placement
        self.rank_ids: tuple[int, ...] = self.placement.ranks if self.placement else tuple(range(options.ranks))
        self.launch_time = time.time()
        self.spec = WorkerSpec(**{**spec.__dict__, "launch_time": self.launch_time})
        self.procs: list[Popen] = []
        self.logs: list[Any] = []
        self.seen: set[int] = set()
        self.verdict: tuple[str, str] | None = None  # the runner's own: timeout or the budget watchdog
        self.failed_at: float | None = None
        self.ended_at: float | None = None
        self.exits_seen: tuple[int | None, ...] = ()  # exit codes before the runner killed anything
        self.devices: dict[int, str] = {}  # rank -> the accelerator it reported
        self.peaks: dict[int, int] = {}  # rank -> highest VmHWM read (CPU ranks)
        # A multi-node trial's port was found on rank 0's node; its ranks share no memory segments (LOCAL_SIZE).
        self.master_port = self.placement.master_port if self.placement else claim_port()
        self._deadline = self.launch_time + options.timeout_s
        self._build_pause = 0.0
        self._last = self.launch_time

    # -- launch -------------------------------------------------------------------------------------
    def launch(self) -> None:
        spec_path = self.spec.write()
        o = self.options
        base = ranks_environment(o, self.spec.accelerator, self.master_port)
        worker = ["-m", o.module, str(spec_path)]
        if o.launcher == "direct":
            self.argv = [o.python, *worker]
            self.envs = direct_environments(o, base)
            if self.spares is not None:
                self.spare_key = Spares.key([o.python, "-m", o.module], self.envs)
                ranks = self.spares.take(self.spare_key)
                if ranks is not None and self.spares.hand_over(ranks, self.envs, spec_path, self.log_dir,
                                                               self._names()):
                    self.procs += [r.proc for r in ranks]
                    self.seen.update(r.proc.pid for r in ranks)
                    self.ahead = ranks
                    return
            self._start_ranks()
        elif o.launcher == "torchrun":
            self._start([o.python, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={o.ranks}",
                         f"--master-addr={MASTER_ADDR}", f"--master-port={base['MASTER_PORT']}", *worker], base, "launcher")
        else:
            self._start([o.python, "-m", "deepspeed.launcher.runner", "--num_gpus", str(o.ranks),
                         "--master_port", base["MASTER_PORT"], "--module", *worker[1:]], base, "launcher")

    def _names(self) -> list[str]:
        return [f"rank{rank}" for rank in self.rank_ids]

    def _start_ranks(self) -> None:
        for env, name in zip(self.envs, self._names()):
            self._start(self.argv, env, name)

    def _start(self, argv: list[str], env: Mapping[str, str], name: str) -> None:
        out = (self.log_dir / f"{name}.stdout").open("ab")
        err = (self.log_dir / f"{name}.stderr").open("ab")
        self.logs += [out, err]
        proc = Popen(argv, env=dict(env), stdin=DEVNULL, stdout=out, stderr=err, start_new_session=True)
        self.procs.append(proc)
        self.seen.add(proc.pid)

    # -- watch --------------------------------------------------------------------------------------
    def watch(self) -> None:
        try:
            while not self.check():
                time.sleep(self.options.poll_s)
        finally:
            self.stop_watching()

    def stop_watching(self) -> None:
        """The ranks' exits as they are before anything is killed (a rank that died on its own)."""
        self.exits_seen = tuple(p.poll() for p in self.procs)

    def check(self) -> bool:
        """One look at the ranks: True once the trial is over here (every report in, a failure past its
        grace, every process exited, the budget breached, or the timeout passed)."""
        o = self.options
        now = time.time()
        phases = self._phases()
        if self.ahead is not None and self._spare_lost(phases):
            return False
        self._tend_spares(phases)
        if any(p.get("phase") == "build_ops" for p in phases.values()) and self._build_pause < MAX_BUILD_PAUSE_S:
            self._build_pause += now - self._last  # a first-use op build is not the config's fault
        self._last = now
        reports = [read_report(self.log_dir, r) for r in self.rank_ids]
        if all(r is not None for r in reports) or any(r is not None and r.get("port_taken") for r in reports):
            return True  # (with the port taken, the other ranks wait for a store that will never answer)
        if self.failing(reports):
            self.failed_at = self.failed_at or now
            if now - self.failed_at >= o.grace_s or all(p.poll() is not None for p in self.procs):
                return True
        elif all(p.poll() is not None for p in self.procs):
            return True  # everything exited without all reports: judged in outcome()
        breach = self._watch_memory(phases)
        if breach:
            self.verdict = ("oom", breach)
            return True
        if now > self._deadline + self._build_pause:
            where = ", ".join(f"rank {r} in {p.get('phase')}" for r, p in sorted(phases.items())) or "no rank started"
            paused = f" and {self._build_pause:.0f} s of C++ op builds" if self._build_pause >= 1 else ""
            self.verdict = ("timeout", f"no result within the timeout of {o.timeout_s:g} s{paused} ({where})")
            return True
        return False

    def _spare_lost(self, phases: Mapping[int, Mapping[str, Any]]) -> bool:
        """A rank started ahead that exited before it took the trial (its imports opened the device, or it was
        killed): the trial's own ranks start instead (True), as if none had been ahead."""
        if all(p.poll() is None or rank in phases for p, rank in zip(self.procs, self.rank_ids)):
            if len(phases) == len(self.rank_ids):
                self.ahead = None  # every rank took the trial
            return False
        assert self.ahead is not None and self.spares is not None
        ranks, self.ahead = self.ahead, None
        _end(self.procs)
        self.procs = []
        for rank, name in zip(ranks, self._names()):  # why it was lost, beside the trial's own log
            with contextlib.suppress(OSError):
                rank.stderr.replace(self.log_dir / f"{name}.ahead.stderr")
        self.spares.drop(ranks)
        self._start_ranks()
        return True

    def _tend_spares(self, phases: Mapping[int, Mapping[str, Any]]) -> None:
        """Start the next trial's ranks once this trial's have made their imports (each past `start`); keep the
        ones still importing off the cores while this trial measures."""
        if self.spares is None:
            return
        if self.spare_key is not None and len(phases) == len(self.rank_ids) \
                and all(p.get("phase") != "start" for p in phases.values()):
            self.spares.start(self.options.python, self.options.module, self.envs)
            self.spare_key = None
        if any(p.get("phase") == "measure" for p in phases.values()):
            self.spares.hold_unready()

    def failing(self, reports: Sequence[dict[str, Any] | None] | None = None) -> bool:
        """A rank here reported a failure or exited badly, or the runner has its own verdict."""
        if reports is None:
            reports = [read_report(self.log_dir, r) for r in self.rank_ids]
        return (self.verdict is not None or any(r is not None and r.get("status") != "ok" for r in reports)
                or self._exited_badly())

    def _phases(self) -> dict[int, dict[str, Any]]:
        latest = {}
        for rank in self.rank_ids:
            events = read_events(self.log_dir, rank)
            if events:
                latest[rank] = events[-1]
                self.seen.update(e["pid"] for e in events if "pid" in e)
                self.seen.update(e["child_pid"] for e in events if "child_pid" in e)
                self.devices.update({rank: e["device"] for e in events if "device" in e})
        return latest

    def _exited_badly(self) -> bool:
        return any(p.poll() not in (None, 0) for p in self.procs)

    def _watch_memory(self, phases: Mapping[int, Mapping[str, Any]]) -> str | None:
        budget = self.options.memory_budget_bytes
        for rank, event in phases.items():
            if self.devices.get(rank) != "cpu":
                continue  # not known yet, or CUDA, where the allocator enforces the budget inside the rank
            peak = procmem.peak_rss(event["pid"])
            if peak is None:
                continue
            self.peaks[rank] = max(peak, self.peaks.get(rank, 0))
            if budget and peak > budget:
                return (f"rank {rank} grew to {peak / 2**20:.1f} MiB resident, past the memory budget of "
                        f"{budget / 2**20:.1f} MiB (in phase {event.get('phase')})")
        return None

    # -- end ----------------------------------------------------------------------------------------
    def end(self) -> None:
        """Kill every process of the trial and reap the ones that are ours."""
        victims = self._members()
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its session: the rank and anything it started
            except (ProcessLookupError, PermissionError):
                pass
        for victim in victims:
            try:
                victim.kill()  # descendants that left the group
            except psutil.Error:
                pass
        for proc in self.procs:
            proc.wait()
        deadline = time.time() + 10
        while not all(_gone(v) for v in victims) and time.time() < deadline:
            time.sleep(0.01)
        for log in self.logs:
            log.close()
        if self.spares is not None:
            self.spares.resume()
        if self.placement is None:
            remove_shm_buffers(MASTER_ADDR, self.master_port)
            release_port(self.master_port)
        self.ended_at = time.time()

    def _members(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for pid in self.seen | {p.pid for p in self.procs}:
            try:
                proc = psutil.Process(pid)
                found[pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
                    self.seen.add(child.pid)
            except psutil.Error:
                continue
        return [p for pid, p in found.items() if pid != os.getpid()]

    # -- verdict ------------------------------------------------------------------------------------
    def outcome(self) -> RunOutcome:
        reports = tuple(read_report(self.log_dir, r) for r in self.rank_ids)
        codes = tuple(p.returncode for p in self.procs)
        status, error = judge(self.verdict, self.rank_ids, reports, self.exits_seen, codes, self.options.launcher,
                              self._tail)
        end = self.ended_at or time.time()
        return RunOutcome(status, error, reports, end - self.launch_time, self.launch_time, str(self.log_dir),
                          tuple(sorted(self.seen)), codes, tuple(self.peaks[r] for r in sorted(self.peaks)), self.master_port)

    def share(self) -> RankShare:
        """This runner's evidence, once its ranks are ended, for a judge that sees every node's (ray_ranks)."""
        return RankShare(self.rank_ids, self.verdict, tuple(read_report(self.log_dir, r) for r in self.rank_ids),
                         self.exits_seen, tuple(p.returncode for p in self.procs),
                         tuple(self.peaks[r] for r in sorted(self.peaks)), tuple(sorted(self.seen)),
                         {r: self._tail(f"rank{r}") for r in self.rank_ids}, self.launch_time,
                         self.ended_at or time.time())

    def _tail(self, name: str) -> str:
        path = self.log_dir / f"{name}.stderr"
        try:
            lines = path.read_text(errors="replace").rstrip().splitlines()[-STDERR_TAIL_LINES:]
        except FileNotFoundError:
            return ""
        return (STDERR_TAIL + "\n" + "\n".join(lines)) if lines else ""


def judge(verdict: tuple[str, str] | None, ranks: Sequence[int], reports: Sequence[dict[str, Any] | None],
          exits_seen: Sequence[int | None], codes: Sequence[int | None], launcher: str,
          tail: Callable[[str], str]) -> tuple[str, str | None]:
    """A trial's status and message from its evidence: the runner's own verdict, then the ranks' reports
    (in the order of `ranks`), exits and signals; `tail(name)` quotes the end of a rank's (or the launcher's)
    stderr."""
    if verdict is not None:
        return verdict
    failures = [(r, rep) for r, rep in zip(ranks, reports) if rep is not None and rep.get("status") != "ok"]
    for wanted in ("oom", "unsupported", "untrained"):  # definitive, whichever rank saw it
        for rank, rep in failures:
            if rep["status"] == wanted:
                return wanted, f"rank {rank} in {rep.get('phase')}: {rep.get('error')}"
    if launcher == "direct":
        # A rank that died without a report (a signal, os._exit) is the cause; its peers then
        # fail on a broken connection or are killed by us, so they come second.
        died = [(r, c) for r, rep, c in zip(ranks, reports, exits_seen) if rep is None and c not in (None, 0)]
        if died:
            rank, code = died[0]
            return "crash", f"rank {rank} {describe_exit(code)} without a report{tail(f'rank{rank}')}"
    if failures:
        rank, rep = failures[0]
        name = f"rank{rank}" if launcher == "direct" else "launcher"
        return "crash", f"rank {rank} in {rep.get('phase')}: {rep.get('error')}{tail(name)}"
    if all(rep is not None for rep in reports):
        return "ok", None
    missing = [r for r, rep in zip(ranks, reports) if rep is None]
    name = "rank%d" % missing[0] if launcher == "direct" else "launcher"
    exits = ", ".join(describe_exit(c) for c in codes)
    return "crash", f"rank(s) {missing} ended without a report ({exits}){tail(name)}"


def _gone(proc: psutil.Process) -> bool:
    """Ended: absent, or a zombie that only its parent (not always us) can reap."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
