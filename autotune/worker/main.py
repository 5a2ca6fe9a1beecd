"""The trial worker: `python -m autotune.worker <spec.json>`, one process per rank; or `--spare READY`, a rank
started ahead of its trial (autotune.trials.runner.Spares): it makes every trial's imports, writes READY, then
waits on stdin for the trial it joins (`wait_for_trial`).

It builds the built-in model where it trains (ZeRO 0-2: on the rank's device in its training dtype, no fp32
copy on the host for initialize to move and cast, autotune.worker.model.build; ZeRO-3: partitioned under
zero.Init), calls `deepspeed.initialize` with the spec's DeepSpeed config, runs warm-up
steps, then measured optimizer steps (every micro-step of gradient accumulation) until the step time is
stable (autotune.worker.measure), and writes its report `rank<r>.json` (autotune.worker.protocol):
- step times (rank 0's decide when to stop; the decision is broadcast so all ranks stop together);
- the process's memory: a baseline before the model is built, the peak during start-up, and the true
  peak over the measured window (CPU: VmHWM after clear_refs; CUDA: max reserved after a reset);
- or a structured failure: `unsupported` (checked through DeepSpeed's accelerator API before
  initialize), `oom` (the allocator's out-of-memory exceptions), `crash` (anything else, with its type).
Rank environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) comes from the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import errno
import importlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from autotune.worker.device import AcceleratorMismatch, open_device
from autotune.worker.imports import without_mlflow
from autotune.worker.measure import iqr, median_rel_se, stop_reason
from autotune.worker.protocol import WorkerSpec, record_phase, report_path, write_json_atomic
from autotune.worker.training import Ledger, Untrained, scaler_gave_up, state_bytes
from autotune.values.results import OVERFLOW, SCALER_AT_MINIMUM

PR_SET_PDEATHSIG = 1
SPARE_DEVICE_EXIT = 3  # a spare rank's exit when its imports opened the device (it would hold device memory)
PARENT_ENV = "AUTOTUNE_PARENT_PID"  # set by the runner when it is this process's parent
CPU_OOM = "DefaultCPUAllocator: can't allocate memory"  # c10's own report of a failed CPU allocation
# Out-of-memory reported as a RuntimeError (or torch.distributed's DistBackendError) rather than
# torch.OutOfMemoryError: CUDA errors raised outside the caching allocator, cuBLAS handle or workspace
# allocation, NCCL's own buffers ("Cuda failure 'out of memory'", ncclUnhandledCudaError).
DEVICE_OOM_MARKERS = ("cublas_status_alloc_failed", "cudaerrormemoryallocation", "cuda error: out of memory",
                      "cuda out of memory", "failure 'out of memory'", "hip out of memory")
STALE_LOCK_AGE_S = 60.0  # a live build writes its ninja file and starts compiling well within this
LOCK_SWEEP_S = 5.0  # how often a load waiting on a build lock checks whether its holder died
SLOW_LOAD_S = 5.0  # loading a built op takes about a second here: one still loading after this is being built
# Where DeepSpeed's op builder and torch parse TORCH_CUDA_ARCH_LIST: a failure raised there is the variable's.
ARCH_LIST_PARSERS = ("compute_capability_args", "_get_cuda_arch_flags")


TRAINING_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # precision -> torch dtype name
OVERFLOW_FACTOR = 1e30  # the overflow fault's: any loss times this is inf in fp16


class Unsupported(Exception):
    """The config cannot run on this machine's accelerator or software."""


class UnsupportedModel(Unsupported):
    """The built-in model cannot be built in this shape (a mixture of experts): no config would run."""


class PortTaken(OSError):
    """Another process bound the trial's rendezvous port between the runner's claim and rank 0's bind: the
    machine's doing, not the config's; the runner launches the trial again on another port."""

    def __init__(self, addr: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"the trial's rendezvous port {addr}:{port} was taken by another "
                                           "process before rank 0 bound it")
        self.port = port


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.worker")
    parser.add_argument("spec", nargs="?")
    parser.add_argument("--spare", metavar="READY", help="start ahead of a trial: import, write READY, wait on stdin")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)  # passed by DeepSpeed's launcher
    args = parser.parse_args(argv)
    if (args.spec is None) == (args.spare is None):
        parser.error("give the trial's spec.json, or --spare READY")
    die_with_parent()
    without_mlflow()
    ahead = None
    if args.spare is not None:
        ahead = spare_imports()
        args.spec = wait_for_trial(args.spare, ahead)
    spec = WorkerSpec.read(args.spec)
    rank = int(os.environ.get("RANK", "0"))
    started = time.time()
    record_phase(spec.log_dir, rank, "start")
    if spec.fault == "hang":
        _hang(spec, rank)
    phases: dict[str, float] = {}  # run() fills it phase by phase: a failure reports those it finished
    try:
        report = run(spec, rank, started, ahead, phases)
        code = 0
    except BaseException as err:  # every failure becomes a report; the runner decides what to do next
        traceback.print_exc()
        status, message = classify(err)
        report = {"status": status, "error": message, "exception": type(err).__name__,
                  "phase": _last_phase, "rank": rank, "pid": os.getpid(),
                  "fatal": isinstance(err, (AcceleratorMismatch, UnsupportedModel)),  # nor would any other config
                  **untrained_evidence(err), **port_evidence(err),
                  # where its seconds went before it failed (the trial-time model prices an out-of-memory trial too)
                  "phases_s": dict(phases), "import_ahead_s": ahead}
        if status == "oom":
            report["cause"] = oom_cause(err, spec.accelerator)
        if _last_phase == "build_ops":  # the op, and whether TORCH_CUDA_ARCH_LIST is to blame (autotune.trials.ops)
            report.update(build_failure(err, _last_op))
        code = 1
    write_json_atomic(report_path(spec.log_dir, rank), report)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter and process-group teardown: the runner needs nothing more from this process and
    # gloo's teardown can wait on peers that are gone.
    os._exit(code)


_last_phase = "start"
_last_op: str | None = None


def _phase(spec: WorkerSpec, rank: int, phase: str, **info: Any) -> None:
    global _last_phase, _last_op  # the phase (and op) reached is reported on failure; one process, one trial
    _last_phase = phase
    _last_op = info.get("op", _last_op)
    record_phase(spec.log_dir, rank, phase, **info)


def classify(err: BaseException) -> tuple[str, str]:
    """(status, one-line message) from the exception's type, never from the word 'error'."""
    message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:500]
    if isinstance(err, (Unsupported, AcceleratorMismatch)):
        return "unsupported", str(err)
    if isinstance(err, Untrained):
        return "untrained", str(err)
    if isinstance(err, MemoryError):
        return "oom", message
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(err, getattr(torch, "OutOfMemoryError", ())):
        return "oom", message
    if isinstance(err, RuntimeError) and (CPU_OOM in str(err) or any(m in str(err).lower() for m in DEVICE_OOM_MARKERS)):
        return "oom", message
    return "crash", message


def untrained_evidence(err: BaseException) -> dict[str, Any]:
    """An untrained trial's fault and its ledger (autotune.worker.training), for its report; else nothing."""
    return {"fault": err.fault, **err.evidence} if isinstance(err, Untrained) else {}


def port_evidence(err: BaseException) -> dict[str, Any]:
    """The rendezvous port a failure found taken (PortTaken), for its report; else nothing."""
    return {"port_taken": err.port} if isinstance(err, PortTaken) else {}


def _overflow_fault(fault: str | None) -> int:
    """Test fault `overflow:N` (autotune.worker.protocol.FAULTS): the first N optimizer steps' losses are scaled past
    fp16's range, so that their gradients overflow (`overflow` alone: every step). 0: no such fault."""
    if not fault or not fault.startswith("overflow"):
        return 0
    _, _, count = fault.partition(":")
    return int(count) if count else 10**9


def oom_cause(err: BaseException, accelerator: str) -> str:
    """What an out-of-memory failure ran out of (autotune.search.pruning.CAUSES): a failed host allocation on a GPU
    rank is host memory (offloaded state, pinned buffers); on the CPU accelerator the host is the device."""
    host = isinstance(err, MemoryError) or CPU_OOM in str(err)
    return "host_memory" if host and accelerator != "cpu" else "device_memory"


def run(spec: WorkerSpec, rank: int, started: float, ahead: float | None = None,
        phases: dict[str, float] | None = None) -> dict[str, Any]:
    """The trial; `ahead`: the seconds a spare rank spent importing before its trial was handed to it (reported as
    import_ahead_s, off the trial's clock: its spawn_s is then the hand-over, its import_s what was left of them).
    `phases`: filled with each phase's seconds as it ends (the caller's, to report a failure's)."""
    phases = {} if phases is None else phases
    phases["spawn_s"] = started - spec.launch_time if spec.launch_time else 0.0
    clock = _PhaseClock(phases)

    import torch
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from autotune.worker.model import GPT, MODEL_REVISION, build, synthetic_batch, unsupported_reason

    clock.lap("import_s")
    if unsupported_reason(spec.workload.model):
        raise UnsupportedModel(unsupported_reason(spec.workload.model))
    accel = get_accelerator()
    device_name = accel.device_name()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    memory = open_device(spec.accelerator, accel, torch, local_rank, spec.memory_budget_bytes)
    _phase(spec, rank, "build_ops", device=device_name)
    ds = prepared_ds_config(spec.ds_config)
    if _overflow_fault(spec.fault) and spec.accelerator == "cpu":
        # DeepSpeed runs fp16 on the CPU where oneDNN has fp16 kernels; elsewhere it refuses, though its fp16
        # optimizer and loss scaler work (slowly): the test fault exercises the real scaler on any CPU.
        type(accel).is_fp16_supported = lambda self: True
    check_supported(spec, ds, accel)
    if spec.cpu_info:
        import cpuinfo

        cpuinfo.get_cpu_info = lambda: dict(spec.cpu_info)  # DeepSpeed's builders import it at call time
    load_ops(ds, accel, lambda op, building: _phase(spec, rank, "build_ops", op=op, building=building))
    clock.lap("build_ops_s")

    _phase(spec, rank, "dist_init")
    from deepspeed.constants import default_pg_timeout

    store = host_store(torch, default_pg_timeout)  # noqa: F841  (rank 0: served while held)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
    world = torch.distributed.get_world_size()
    clock.lap("dist_init_s")
    baseline = memory.current()
    before_build_peak = memory.peak()
    memory.reset_peak()  # the build's own peak; the start-up peak is the larger of the two

    _phase(spec, rank, "build")
    torch.manual_seed(spec.seed)
    if spec.config.zero_stage == 3:  # built already partitioned, on the device, in its dtype, as Hugging Face does
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = GPT(spec.workload.model, spec.config.ckpt_interval)
    else:  # where the engine keeps it (DeepSpeedEngine._set_distributed_vars), in the dtype it would cast to
        model = build(spec.workload.model, spec.config.ckpt_interval, torch.device(accel.device_name(local_rank)),
                      getattr(torch, TRAINING_DTYPES[spec.config.precision]))
    built = [(p, p.dtype, p.device, p.data_ptr()) for p in model.parameters()]
    build_peak = memory.peak()
    clock.lap("build_s")

    _phase(spec, rank, "initialize")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    clock.lap("initialize_s")
    build_report = {
        "dtype": ",".join(sorted({str(dtype).removeprefix("torch.") for _, dtype, _, _ in built})),
        "device": ",".join(sorted({str(device) for _, _, device, _ in built})), "tensors": len(built),
        "peak_growth_bytes": build_peak - baseline,
        # What deepspeed.initialize did to the built parameters: with the model built where it trains, none
        # is cast or moved (ZeRO 0-2); an optimizer that flattens 16-bit weights gives them new storage.
        "cast_or_moved": sum(p.dtype != dtype or p.device != device for p, dtype, device, _ in built),
        "storage_kept": sum(p.data_ptr() == ptr for p, _, _, ptr in built),
        "same_parameters": [id(p) for p, *_ in built] == [id(p) for p in engine.module.parameters()],
    }
    del built

    generator = torch.Generator().manual_seed(spec.seed + rank)
    device = engine.device
    # The same batches every step: a model that trains lowers their loss, which the ledger checks.
    batches = [synthetic_batch(spec.workload.model, spec.config.micro_batch, generator, device)
               for _ in range(engine.gradient_accumulation_steps())]
    ledger = Ledger(fp16=spec.config.precision == "fp16")
    overflowing = _overflow_fault(spec.fault)

    def optimizer_step(measuring: bool = False) -> tuple[float, bool]:
        accel.synchronize()
        skipped_before = engine.skipped_steps
        t0 = time.perf_counter()
        try:
            for tokens, targets in batches:
                loss = engine(tokens, targets)
                if ledger.steps < overflowing:  # test fault: gradients past fp16's range
                    loss = loss * OVERFLOW_FACTOR
                engine.backward(loss)
                engine.step()
        except Exception as err:
            if scaler_gave_up(err):  # DeepSpeed's own end of an fp16 run whose every step overflows
                ledger.record(False, None, ledger.loss_scale, measuring)
                raise ledger.untrained(OVERFLOW, f"{ledger._overflow_message()} ({SCALER_AT_MINIMUM})") from err
            raise
        accel.synchronize()
        elapsed = time.perf_counter() - t0
        return elapsed, ledger.observe(engine, skipped_before, loss, measuring)

    _phase(spec, rank, "warmup")
    while ledger.warming(spec.measure.warmup_steps):  # until a step was applied: fp16's scale has settled
        optimizer_step()
    clock.lap("warmup_s")
    ledger.optimizer_state_bytes = state_bytes(engine.basic_optimizer)
    startup_peak = max(before_build_peak, memory.peak())
    memory.reset_peak()  # the window opens after an applied step: the optimizer's state exists

    first_step = time.time()
    _phase(spec, rank, "measure")
    times: list[float] = []  # applied steps only: a skipped step skips the update, the costliest part
    peaks: list[int] = []  # growth of the peak over the baseline after each measured step
    reason = None
    while reason is None:
        elapsed, applied = optimizer_step(measuring=True)
        if applied:
            times.append(elapsed)
            peaks.append(memory.peak() - baseline)
        reason = agree(torch, world, device,
                       lambda: stop_reason(times, time.time() - first_step, spec.measure, peaks,
                                           ledger.skipped_measuring))
        _phase(spec, rank, "measure", step=len(times))  # for the live progress line: steps measured so far
    memory.finish()
    peak = memory.peak()
    clock.lap("measure_s")
    fault = ledger.verdict()
    if fault is not None:
        raise ledger.untrained(*fault)
    _phase(spec, rank, "done")
    if world > 1:
        torch.distributed.barrier()  # every rank is past its last collective before anyone exits
    median = statistics.median(times)
    return {
        "status": "ok", "rank": rank, "pid": os.getpid(), "world_size": world, "device": device_name,
        "step_times_s": times, "peak_growth_per_step_bytes": peaks, "step_time_s": median, "step_time_iqr_s": iqr(times),
        "step_time_rel_se": median_rel_se(times) if len(times) > 1 else None, "stop_reason": reason,
        "baseline_memory_bytes": baseline, "peak_memory_bytes": peak, "startup_peak_bytes": startup_peak,
        "peak_allocated_bytes": memory.peak_allocated(), "first_step_time": first_step,
        "phases_s": phases, "import_ahead_s": ahead, "build": build_report, **ledger.evidence(), "model_revision": MODEL_REVISION,
        "optimizer": type(engine.optimizer).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
        "threads": torch.get_num_threads(), **memory.details(),
    }


def prepared_ds_config(ds_config: Any) -> dict[str, Any]:
    """The spec's DeepSpeed config, with one translation: offloaded optimizer state with
    `zero_force_ds_cpu_optimizer: false` uses torch's AdamW (DeepSpeed's `torch_adam` switch) instead of
    DeepSpeedCPUAdam, whose C++ build takes minutes on first use."""
    ds = copy.deepcopy(dict(ds_config))
    offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    if offload and ds.get("zero_force_ds_cpu_optimizer") is False and "optimizer" in ds:
        ds["optimizer"].setdefault("params", {})["torch_adam"] = True
    return ds


def check_supported(spec: WorkerSpec, ds: dict[str, Any], accel: Any) -> None:
    """Refuse what this accelerator cannot run, as DeepSpeed would refuse it later, but structurally."""
    precision = spec.config.precision
    if precision == "fp16" and not accel.is_fp16_supported():
        raise Unsupported(f"precision fp16 is not supported by DeepSpeed's {accel.device_name()} accelerator here")
    if precision == "bf16" and not accel.is_bf16_supported():
        raise Unsupported(f"precision bf16 is not supported by DeepSpeed's {accel.device_name()} accelerator here")
    zero = ds.get("zero_optimization", {})
    if any(zero.get(key, {}).get("device") == "nvme" for key in ("offload_optimizer", "offload_param")):
        aio = accel.create_op_builder("AsyncIOBuilder")
        if aio is None or not aio.is_compatible(verbose=False):
            raise Unsupported("NVMe offload needs DeepSpeed's async_io op, which cannot be built here (libaio?)")


def load_ops(ds: dict[str, Any], accel: Any, report: Callable[[str, bool], None] | None = None) -> None:
    """Build (first use on a machine: minutes) or load the C++ ops the trial will need, before the
    runner's timeout clock runs again (it pauses during this phase). `report(op, building)` hears of each
    op before it loads, and whether it has to be built first (what the progress line shows)."""
    skip_inference_ops()
    for name in op_builders(ds, accel):
        load_op(name, accel, report)


# DeepSpeed's CPU communication backend builds and loads its shm_comm op in init_distributed (a first build
# ~40-70 s on 2 cores) for one caller: inference_all_reduce (AutoTP inference). A training step's collectives
# go through torch.distributed (gloo), so trials mark the op unusable and DeepSpeed's build_shm_op skips it.
INFERENCE_ONLY_OPS = ("deepspeed_shm_comm",)


def skip_inference_ops() -> None:
    """Keep DeepSpeed from building and loading the ops only inference uses (INFERENCE_ONLY_OPS)."""
    import deepspeed.ops

    for name in INFERENCE_ONLY_OPS:
        deepspeed.ops.__compatible_ops__[name] = False


def op_builders(ds: dict[str, Any], accel: Any) -> list[str]:
    """The op builders (class names) a trial of DeepSpeed config `ds` loads on `accel` (autotune.trials.ops' preflight
    asks the same of every config of a space)."""
    names = []
    if not ds.get("optimizer", {}).get("params", {}).get("torch_adam", False):
        offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
        names.append("CPUAdamBuilder" if offload else "FusedAdamBuilder")
    return names


def needed_builders(accelerator: str, ds_configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The op builders (class names) the trials of `ds_configs` load on `accelerator`, as the child decides."""
    named = _Accelerator(accelerator)
    names: list[str] = []
    for ds in ds_configs:
        names += [n for n in op_builders(prepared_ds_config(dict(ds)), named) if n not in names]
    return names


@dataclass(frozen=True)
class _Accelerator:
    """What op_builders asks of DeepSpeed's accelerator, without importing DeepSpeed."""

    name: str

    def device_name(self) -> str:
        return self.name


def load_op(name: str, accel: Any, report: Callable[[str, bool], None] | None = None) -> None:
    """Build or load the op of builder class `name` (load_ops), clearing a stale build lock on the way."""
    import deepspeed.ops

    builder = accel.create_op_builder(name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    clear_stale_build_lock(builder.name)
    building = needs_build(builder.name)
    slow = None
    if report is not None:
        report(builder.NAME, building)
        if not building:  # torch rebuilds on changed sources or flags, or waits on another's build: say so
            slow = threading.Timer(SLOW_LOAD_S, report, (builder.NAME, True))
            slow.daemon = True
            slow.start()
    try:
        with _sweeping_stale_locks(builder.name):
            builder.load(verbose=False)
    except ImportError:
        # Another process's build of the same op was killed after we waited for it: no library. Make
        # torch forget this process's attempt so that the retry builds it (under the same file lock).
        from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

        JIT_EXTENSION_VERSIONER.entries.pop(builder.name, None)
        builder.jit_load(verbose=False)
    finally:
        if slow is not None:
            slow.cancel()


def build_failure(err: BaseException, op: str | None) -> dict[str, Any]:
    """What a failed op load tells the tuner beyond its message (autotune.trials.ops.BuildFailure): the op, whether
    DeepSpeed's or torch's parsing of TORCH_CUDA_ARCH_LIST raised it, and the GPU's compute capability (the
    arch list that would do)."""
    frames = traceback.extract_tb(err.__traceback__)
    capability = None
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", "0")))
            capability = f"{major}.{minor}"
    except Exception:  # noqa: BLE001  (a broken device: the message says enough)
        pass
    return {"op": op, "arch_list_fault": any(f.name in ARCH_LIST_PARSERS for f in frames), "capability": capability}


@contextlib.contextmanager
def _sweeping_stale_locks(name: str, every_s: float = LOCK_SWEEP_S) -> Iterator[None]:
    """While op `name` loads, look for a stale build lock every `every_s`: torch waits on the lock file
    forever, and a lock can turn stale after this load began waiting (a rank of the trial before, killed
    by the memory watchdog while it held the lock for the no-op build every load runs)."""
    done = threading.Event()

    def sweep() -> None:
        while not done.wait(every_s):
            clear_stale_build_lock(name)

    sweeper = threading.Thread(target=sweep, name=f"stale-lock-{name}", daemon=True)
    sweeper.start()
    try:
        yield
    finally:
        done.set()
        sweeper.join()


def needs_build(name: str) -> bool:
    """Whether loading op `name` will compile it (or wait for another process compiling it): it is not
    installed prebuilt and torch's build directory holds no library of it yet, or holds a build's lock."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get(name, False):
        return False
    build_dir = _get_build_directory(name, verbose=False)
    return not os.path.exists(os.path.join(build_dir, f"{name}.so")) or os.path.exists(os.path.join(build_dir, "lock"))


def clear_stale_build_lock(name: str, min_age_s: float = STALE_LOCK_AGE_S) -> bool:
    """Remove the lock of op `name`'s build directory if its builder died (a trial killed mid-build):
    torch waits for that lock file to go away, forever. Stale: older than `min_age_s` while no process
    works in the directory (ninja and the compilers run there). Returns whether it removed one."""
    import psutil
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = os.path.realpath(_get_build_directory(name, verbose=False))
    lock = os.path.join(build_dir, "lock")
    try:
        stat = os.stat(lock)
    except FileNotFoundError:
        return False
    if time.time() - stat.st_mtime < min_age_s:
        return False
    for proc in psutil.process_iter():
        try:
            if proc.cwd() == build_dir:
                return False
        except psutil.Error:  # gone, or not ours to inspect (a builder of our cache runs as us)
            continue
    try:
        if os.stat(lock).st_ino == stat.st_ino:  # still the same lock, not a new builder's
            os.unlink(lock)
            print(f"autotune: removed the stale build lock {lock}", file=sys.stderr)
            return True
    except FileNotFoundError:
        pass
    return False


def agree(torch: Any, world: int, device: Any, decide: Callable[[], str | None]) -> str | None:
    """Rank 0's stop decision, sent to every rank (they must run the same number of collectives)."""
    reason = decide()
    if world == 1:
        return reason
    from autotune.worker.measure import REASONS

    codes = [None, *REASONS]
    flag = torch.tensor([codes.index(reason)], dtype=torch.int64, device=device)
    torch.distributed.broadcast(flag, src=0)
    return codes[int(flag.item())]


class _PhaseClock:
    def __init__(self, phases: dict[str, float]) -> None:
        self.phases, self.last = phases, time.time()

    def lap(self, name: str) -> None:
        now = time.time()
        self.phases[name] = now - self.last
        self.last = now


def host_store(torch: Any, timeout: Any) -> Any:
    """Serve torch.distributed's rendezvous store on MASTER_ADDR only: loopback for a single-node trial, rank
    0's node's cluster address for a multi-node one (autotune.drivers.ray_ranks).

    With `env://`, rank 0's TCPStore listens on every interface (`*:<MASTER_PORT>`), reachable from any
    network. Instead rank 0 hosts the store itself on a socket bound to MASTER_ADDR (an IP address) and
    every rank, rank 0 included, joins it as a client, as under torchrun's agent
    (TORCHELASTIC_USE_AGENT_STORE): any later `env://` initialization (DeepSpeed's, a script's own) then
    finds the store instead of opening one. Returns the server on rank 0 (keep it referenced while the
    process group lives), else None. Does nothing under torchrun, whose agent hosts the store, or when
    MASTER_ADDR is a host name (not ours to resolve)."""
    import ipaddress
    import socket

    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") or not port.isdigit():
        return None
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return None  # a host name: not ours to change
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # this rank's own rendezvous: join, do not host
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        listener = socket.create_server((addr, int(port)), family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise PortTaken(addr, int(port)) from err
        raise
    try:
        server = torch.distributed.TCPStore(addr, int(port), world, True, timeout, wait_for_workers=False,
                                            master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now (and closes it)
    return server


# Modules deepspeed.initialize imports at its first call (DeepSpeed 0.19.8): its optimizer check imports its Muon
# optimizer, whose torch.compile decorator imports TorchDynamo and Inductor (~1,400 modules); the engine its
# expert-parallel modules, ZeRO its stage's optimizer. A spare imports them one at a time until its trial is handed
# over (the trial then waits at most for the module being imported, which its initialize would import anyway), where
# the trial's device leaves the host's cores to it. A CPU trial computes on every core: on the 2-core AMD EPYC
# (benchmarks/ranks_ahead.py, tiny) they took a spare's trial's `initialize_s` from 1.4-1.5 s to 0.15 s, but imported
# beside the trial before it they slowed that one as much: 0.95-0.97x wall per trial, against 0.78x without them.
# One another DeepSpeed lacks is left to initialize.
INITIALIZE_IMPORTS = ("torch._dynamo", "torch.profiler", "deepspeed.runtime.zero.muon.muon_optimizer",
                      "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
                      "deepspeed.runtime.superoffload.superoffload_stage3", "deepspeed.module_inject.auto_ep_layer",
                      "deepspeed.module_inject.auto_ep_config", "deepspeed.module_inject.auto_ep_comm",
                      "deepspeed.utils.pin_memory")


def spare_imports(initialize: bool | None = None) -> float:
    """What a spare rank imports ahead of its trial: the imports every trial makes (run's), and `initialize`
    (default: where the trial's accelerator, DS_ACCELERATOR, is not the CPU) those deepspeed.initialize makes at its
    first call (INITIALIZE_IMPORTS). Returns the seconds."""
    t0 = time.time()
    import torch  # noqa: F401
    import deepspeed  # noqa: F401
    from deepspeed.accelerator import get_accelerator  # noqa: F401

    import autotune.worker.model  # noqa: F401

    if initialize is None:
        initialize = os.environ.get("DS_ACCELERATOR", "cpu") != "cpu"
    for name in INITIALIZE_IMPORTS if initialize else ():
        if _trial_waiting():
            break
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return time.time() - t0


def _trial_waiting() -> bool:
    """Whether a spare's stdin has its trial (autotune.trials.runner.Spares.hand_over), or its end, to read now."""
    try:
        return bool(select.select([sys.stdin], [], [], 0)[0])
    except (OSError, ValueError):  # no stdin to poll (a closed or odd descriptor): as if nothing waited
        return False


def wait_for_trial(ready: str, took: float) -> str:
    """A spare rank, its imports made (`took` seconds, told in READY): then the trial it is handed, one JSON line on
    stdin (autotune.trials.runner.Spares.hand_over): its spec's path, the environment it differs by (its rendezvous
    port) and its log files, which take over this process's stdout and stderr with what they held so far. Returns
    the spec's path. End of input: no trial wanted this rank, it exits."""
    import torch

    if torch.cuda.is_initialized():  # device memory held here would be missing to the trial running meanwhile
        os._exit(SPARE_DEVICE_EXIT)
    write_json_atomic(Path(ready), {"pid": os.getpid(), "import_s": took})
    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)
    order = json.loads(line)
    Path(ready).unlink(missing_ok=True)
    os.environ.update(order["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, (before, path) in ((1, order["stdout"]), (2, order["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        with contextlib.suppress(FileNotFoundError):
            os.write(target, Path(before).read_bytes())  # what the imports printed, at the top of the trial's log
            os.unlink(before)
        os.dup2(target, fd)
        os.close(target)
    return order["spec"]


def die_with_parent() -> None:
    """Ask the kernel to kill this rank if the runner dies (e.g. SIGKILL to the tuner), so that no
    orphaned rank keeps running; then check the runner did not die before the request took effect."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(parent):
        os._exit(1)


def _hang(spec: WorkerSpec, rank: int) -> None:
    """Test fault: start a child (as a compiler or a data loader would) and never finish."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    _phase(spec, rank, "hang", child_pid=child.pid)
    while True:
        time.sleep(3600)
