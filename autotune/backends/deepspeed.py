"""The deepspeed backend: each trial is a short real DeepSpeed training run of the built-in model, in its
own processes (autotune.trials.runner), measured by the worker (autotune.worker) and turned into a TrialResult.

Result (ARCHITECTURE.md section 3, plus extra keys written flat):
- throughput: global batch / median optimizer-step wall time of rank 0 (every micro-step, after warm-up);
- peak_memory_bytes: the worst rank's true peak of the whole process over the measured window (CPU: the
  resident set, VmHWM; CUDA: the allocator's max reserved plus the memory outside it, as nvidia-smi shows:
  autotune.worker.device);
- extra: peak_memory_growth_bytes (that peak minus the rank's baseline before the model was built),
  baseline_memory_bytes, startup_peak_bytes (peak during build, initialize and warm-up),
  predicted_peak_bytes and predicted_step_time_s (the estimator's, when the backend has a hardware
  profile), step_time_iqr_s, step_times_s, steps_measured, stop_reason, ranks, log_dir, master_port,
  launch_to_first_step_s, phases_s (where the launch-to-first-step time went), import_ahead_s (the imports its
  ranks made before the trial, started ahead: autotune.trials.runner.Spares; None: started with it), build (rank 0's model as built:
  dtype, device, the build's peak over the baseline, and what deepspeed.initialize cast, moved or kept of its
  parameters: autotune.worker.main), what its optimizer steps did (steps_applied, steps_skipped,
  steps_skipped_measuring, first_applied_step, loss_first (the first applied step's) and loss_last (the last step's), loss_scale,
  optimizer_state_bytes when the memory window opened: autotune.worker.training), model_revision, expected_step_time_s (most
  measured steps, two at least, `slow_factor` times longer end the measurement: stop_reason `slow`,
  autotune.worker.measure.far_behind); on CUDA also
  peak_allocated_bytes, peak_reserved_bytes, cuda_context_bytes and outside_allocator_bytes.
Trials run on the hardware profile's accelerator (`Hardware.accelerator`; CPU without a profile). A rank that
finds another one (e.g. a GPU profile on a machine without CUDA) ends its trial `unsupported` and sets
`fatal`, which stops the sweep: no other config would run either. A crash while loading DeepSpeed's C++ ops
records its op, cause and fix (`extra["op_failure"]`, autotune.trials.ops.BuildFailure): the sweep stops when one op
fails twice (autotune.drivers.loop). A trial whose steps did not train (every step skipped by fp16's loss scaler, a
loss not finite or never moving) is `untrained`, with its `fault` and the same step counts. `preflight` loads the ops
a set of configs needs; `prepare` those of one config before its trial, where no earlier preflight loaded them: a
sweep builds an op when its first trial that loads it is about to start, not before the search (issue 41: a sweep
that never launches an offloaded optimizer never builds cpu_adam: 36 s on an H200, ~75 s on the 2-core CPU,
benchmarks/results/ops_first_use.md).
A config that cannot even be written as a DeepSpeed config (e.g. NVMe offload without a path) is
`unsupported` without a launch. Failures are results; only the tuner's interruption (KeyboardInterrupt)
propagates, after the trial's processes are gone.
"""

from __future__ import annotations

import json
import math
import os
import re
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from autotune.values.config import Config, ConfigError
from autotune.values.dsconfig import DsOptions, ds_config
from autotune.prediction.estimate import Calibration, Estimate, estimate
from autotune.values.hardware import Hardware
from autotune.trials.ops import ARCH_ENV, PREFLIGHT_TIMEOUT_S, BuildFailure, arch_note, preflight
from autotune.values.results import TrialResult
from autotune.values.settings import check_budget
from autotune.trials.runner import LaunchOptions, RunOutcome, Spares, run_worker, trial_environment
from autotune.worker.main import needed_builders
from autotune.worker.measure import MeasureSettings
from autotune.worker.protocol import WorkerSpec, current_phase, phases_from_events, read_events, write_json_atomic
from autotune.worker.training import TRAINING_EVIDENCE
from autotune.values.workload import Workload


class DeepSpeedBackend:
    name = "deepspeed"

    def __init__(self, workload: Workload, memory_budget_bytes: int | None = None, hardware: Hardware | None = None,
                 ds_options: DsOptions = DsOptions(), logs_dir: str | Path = "runs/logs", timeout_s: float = 600.0,
                 measure: MeasureSettings = MeasureSettings(), *, calibration: Calibration = Calibration(),
                 launcher: str = "direct", env: Mapping[str, str] | None = None, seed: int = 0,
                 fault: str | None = None, accelerator: str | None = None, ranks_ahead: bool = True,
                 in_sequence: bool = False) -> None:
        if memory_budget_bytes is not None:
            check_budget(memory_budget_bytes)
        if timeout_s <= 0:
            raise ConfigError(f"timeout {timeout_s!r}: must be a positive number of seconds")
        self.workload = workload
        self.memory_budget_bytes = memory_budget_bytes
        self.hardware = hardware
        self.ds_options = ds_options
        self.logs_dir = Path(logs_dir)
        self.measure = measure
        self.calibration = calibration
        self.seed = seed
        self.fault = fault  # tests only: see autotune.worker.protocol.FAULTS
        # DeepSpeed's accelerator of every trial: the profile's (a GPU profile: cuda); no profile: the CPU's.
        self.accelerator = accelerator or (hardware.accelerator if hardware is not None else "cpu")
        self.fatal: str | None = None  # set when a rank found the wrong accelerator: no config can run here
        self._cpu_info: dict[str, Any] | None = None
        self._running: Path | None = None  # the log directory of the trial in flight
        self._fastest_step_s: float | None = None  # of this backend's ok trials: a config far behind it stops early
        self._launched: set[Config] = set()  # configs this backend ran: another run is a re-measurement
        self._ops_ready: set[str] = set()  # the op builders a preflight of this backend loaded (or left to a trial)
        self._arch_said = False  # the arch list's note, said at the first preflight only
        self.launch = LaunchOptions(ranks=workload.gpus, timeout_s=timeout_s, memory_budget_bytes=memory_budget_bytes,
                                    launcher=launcher, env=dict(env or {}),
                                    allocator=hardware.allocator if hardware is not None else None)
        # What starts, watches and judges a trial's ranks: all on this machine; a trial spanning a Ray cluster's
        # nodes swaps in autotune.drivers.ray_ranks.SpanningLaunch, which raises NodeLost when a node dies.
        self.start_ranks: Callable[[WorkerSpec, LaunchOptions], RunOutcome] = self._start_here
        # The next trial's ranks, started ahead during a trial (autotune.trials.runner.Spares); ended by close(), or
        # when the backend is collected unclosed.
        self.spares = Spares(self.logs_dir / "spares") if ranks_ahead else None
        if self.spares is not None:
            weakref.finalize(self, self.spares.close)
        self._started_here = 1 if in_sequence else 0  # in_sequence: its first trial is a sweep's too

    def predict(self, config: Config) -> Estimate | None:
        if self.hardware is None or not self.hardware.supports(config.precision):
            return None
        return estimate(config, self.workload, self.hardware, self.calibration)

    def close(self) -> None:
        """End the next trial's ranks started ahead, if any (each trial ends its own processes)."""
        if self.spares is not None:
            self.spares.close()

    def _start_here(self, spec: WorkerSpec, options: LaunchOptions) -> RunOutcome:
        """run_worker, starting the next trial's ranks ahead from a backend's second trial on (from its first where
        it was built `in_sequence`): one that ran a trial is running a sweep (a Ray task's backend runs one trial,
        `autotune trial` one), and its next trials are launched on ranks whose imports are done."""
        self._started_here += 1
        return run_worker(spec, options, self.spares if self._started_here > 1 else None)

    def preflight(self, configs: Iterable[Config], say: Callable[[str], None], *,
                  timeout_s: float = PREFLIGHT_TIMEOUT_S) -> tuple[str, ...]:
        """Before the first trial: load, in a child process with the trials' environment, the C++ ops that trials
        of `configs` load, building those not built yet (autotune.trials.ops.preflight; `say` hears what it does).
        Raises autotune.trials.ops.OpBuildFailed (one line) when one cannot be, or when it takes over `timeout_s` (a
        time-boxed caller: benchmarks/gpu_kit.py); returns the ops loaded."""
        return self._preflight(self._ds_configs(configs), say, timeout_s)

    def prepare(self, config: Config, say: Callable[[str], None]) -> None:
        """Before `config`'s trial (drivers/local.py): the ops it loads, unless a preflight of this backend loaded
        them already; a build is said (`say`) and its failure is OpBuildFailed, as the preflight's."""
        found = self._ds_configs([config])
        if found and not set(needed_builders(self.accelerator, found)) <= self._ops_ready:
            self._preflight(found, say, PREFLIGHT_TIMEOUT_S)

    def _ds_configs(self, configs: Iterable[Config]) -> list[dict[str, Any]]:
        """The distinct DeepSpeed configs of `configs` (one that cannot be written is never launched either)."""
        configs_ds: dict[str, dict[str, Any]] = {}
        for config in configs:
            try:
                ds = ds_config(config, self.workload, self.ds_options)
            except ConfigError:
                continue  # never launched either (`unsupported` without a launch)
            configs_ds.setdefault(json.dumps(ds, sort_keys=True), ds)
        return list(configs_ds.values())

    def _preflight(self, configs_ds: list[dict[str, Any]], say: Callable[[str], None], timeout_s: float) -> tuple[str, ...]:
        if not configs_ds:
            return ()
        env = trial_environment(self.launch, self.accelerator)
        note = arch_note(os.environ, env)
        if note and not self._arch_said:
            say(note)
            self._arch_said = True
        loaded = preflight(self.accelerator, configs_ds, env, self.launch.python, self.logs_dir / "preflight.stderr",
                           say, cpu_info=self.cpu_info(), timeout_s=timeout_s, before_child=self._spares_while_built)
        # Ready, loaded or not: where the child found no device for them (a GPU profile here), the trial says so.
        self._ops_ready.update(needed_builders(self.accelerator, configs_ds))
        return loaded

    def _spares_while_built(self) -> None:
        """The next trial's ranks, started while its ops build (up to minutes on a fresh machine), where that trial
        will run on ranks started ahead (`_start_here`) and none were started during the trial before."""
        if self.spares is not None and self._started_here >= 1:
            self.spares.start_first(self.launch, self.accelerator)

    def phase(self) -> str | None:
        """Where the trial in flight is (rank 0's latest phase, e.g. 'building ops (cpu_adam)'); None between
        trials. Read from another thread by the progress display."""
        running = self._running
        return current_phase(running) if running is not None else None

    def run(self, config: Config) -> TrialResult:
        log_dir = self._new_log_dir(config)
        predicted = self.predict(config)
        extra: dict[str, Any] = {"ranks": self.workload.gpus, "log_dir": str(log_dir), **self._trial_extra()}
        if predicted is not None:
            extra.update(predicted_peak_bytes=predicted.peak_bytes, predicted_step_time_s=predicted.step_time_s)
        measure = self._measure_for(predicted) if config not in self._launched else self.measure
        self._launched.add(config)
        if measure.expected_step_s is not None:
            extra["expected_step_time_s"] = measure.expected_step_s
        try:
            ds = ds_config(config, self.workload, self.ds_options)
        except ConfigError as err:
            result = TrialResult(config, "unsupported", memory_budget_bytes=self.memory_budget_bytes,
                                 backend=self.name, error=str(err), extra=extra)
        else:
            spec = WorkerSpec(config, self.workload, ds, str(log_dir), measure, self.memory_budget_bytes,
                              self.seed, fault=self.fault, cpu_info=self.cpu_info(), extra=self._spec_extra(),
                              accelerator=self.accelerator)
            self._running = log_dir
            try:
                outcome = self.start_ranks(spec, self.launch)
            finally:
                self._running = None
            self._read_outcome(log_dir, outcome, extra)
            result = self._result(config, outcome, extra)
        if result.status == "ok" and result.step_time_s is not None:
            self._fastest_step_s = min(result.step_time_s, self._fastest_step_s or math.inf)
        write_json_atomic(log_dir / "result.json", result.to_dict())
        return result

    def _measure_for(self, predicted: Estimate | None) -> MeasureSettings:
        """This trial's measurement: once a config has been measured, a step is expected to take the larger of
        the fastest step so far and this config's prediction; one many times longer than both is far behind
        (MeasureSettings.slow_factor), and one whose every measured step is slower than the fastest so far stops at
        its minimum of steps (MeasureSettings.behind_margin). Before any measurement nothing is known to be behind:
        full measurement; so is a config run again (confirmation's repeats), whose purpose is its measurement: a
        first step slowed by something else (script mode's lazy setup: 51x) stopped repeats of the best after one
        step, and their one step pulled the recommendation's median down."""
        if self._fastest_step_s is None:
            return self.measure
        expected = max(self._fastest_step_s, predicted.step_time_s if predicted is not None else 0.0)
        return replace(self.measure, expected_step_s=expected, best_step_s=self._fastest_step_s)

    # Hooks for backends that run another worker through the same launch (backends/script.py).

    def _trial_extra(self) -> dict[str, Any]:
        """Extra keys of every result of this backend."""
        return {}

    def _spec_extra(self) -> dict[str, Any]:
        """Extra keys of the worker's spec."""
        return {}

    def _read_outcome(self, log_dir: Path, outcome: RunOutcome, extra: dict[str, Any]) -> None:
        """Add what the trial's worker left in `log_dir` to the result's `extra`."""

    def _seq_len(self, extra: Mapping[str, Any]) -> int:
        """Tokens per sample, for tokens_per_s."""
        return self.workload.model.seq_len

    def _global_batch(self, extra: Mapping[str, Any]) -> int:
        """Samples per optimizer step, for the throughput."""
        return self.workload.global_batch

    def cpu_info(self) -> dict[str, Any] | None:
        """py-cpuinfo's description of this machine, asked once per backend instead of per trial."""
        if self._cpu_info is None:
            try:
                import cpuinfo  # a dependency of DeepSpeed

                self._cpu_info = cpuinfo.get_cpu_info()
            except Exception:  # noqa: BLE001  (the trial's own op builders have a fallback: lscpu)
                self._cpu_info = {}
        return self._cpu_info or None

    def _new_log_dir(self, config: Config) -> Path:
        """`<logs_dir>/<NNNN>-<config label>`, made here (`claim_log_dir`: no two launches share one), NNNN the
        number the trial would be recorded under if no other trial were recorded first: the complete lines of the run
        directory's trials.jsonl beside logs/ + 1 (pruned configs are recorded before the next launch). One trial at a
        time (this machine's sweeps) that is its number; with several in flight (a Ray sweep) another may be
        recorded first, and the sweep moves the folder to the number it records the result under
        (`settle_log_dir`). A second folder of this config at that number (the trial was interrupted, then resumed)
        gets `-attempt<k>`. A run directory that recorded nothing yet (its `.lock` or run.json beside logs/, no
        record: a first trial interrupted, then run again) numbers from 1 again, whatever folders that attempt
        left. Logs outside a run directory are numbered after the trial folders already there."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        record = self.logs_dir.parent / "trials.jsonl"  # autotune.search.rundir.TRIALS, a layer above
        try:
            with open(record, "rb") as handle:
                number = sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b"")) + 1
        except FileNotFoundError:
            # autotune.search.rundir's LOCK and SETTINGS, a layer above: the run directory held or begun
            in_run_dir = any((self.logs_dir.parent / name).exists() for name in (".lock", "run.json"))
            number = 1 if in_run_dir else sum(
                1 for p in self.logs_dir.iterdir() if p.is_dir() and re.match(r"\d{4}-", p.name)) + 1
        except OSError as err:
            raise ConfigError(f"{record}: cannot be read ({err.strerror or err}): a trial's log folder is numbered "
                              "after it") from None
        return claim_log_dir(self.logs_dir, number, folder_label(config))

    def _result(self, config: Config, outcome: RunOutcome, extra: dict[str, Any]) -> TrialResult:
        budget = self.memory_budget_bytes
        # A launch lost to a taken rendezvous port (runner.port_taken) cost the sweep its seconds too.
        wall_time_s = outcome.wall_time_s + sum(r["seconds"] for r in outcome.relaunched)
        extra = {**extra, "master_port": outcome.master_port,
                 **({"relaunched": [dict(r) for r in outcome.relaunched]} if outcome.relaunched else {})}
        if outcome.status != "ok":
            fatal = next((r["error"] for r in outcome.reports if r and r.get("fatal")), None)
            self.fatal = self.fatal or fatal
            cause = next((r["cause"] for r in outcome.reports if r and r.get("cause")), None)
            if outcome.status == "oom" and cause:  # device or host memory, as the rank that ran out saw it
                extra["cause"] = cause
            ops = next((r for r in outcome.reports if r and r.get("status") == "crash" and r.get("phase") == "build_ops"),
                       None)
            if outcome.status == "crash" and ops is not None:  # the environment's failure, not the config's
                arch_list = trial_environment(self.launch, self.accelerator).get(ARCH_ENV)
                extra["op_failure"] = BuildFailure.of(ops, arch_list, extra.get("log_dir")).to_dict()
            timed = next((r for r in outcome.reports if r and r.get("phases_s")), None)
            if timed is not None:  # the phases rank 0 (or the first that reported them) finished before it failed
                extra.update(phases_s=timed["phases_s"], import_ahead_s=timed.get("import_ahead_s"))
            elif extra.get("log_dir"):  # stopped from outside, no report: rank 0's events say how far it got
                phases = phases_from_events(read_events(extra["log_dir"], 0), outcome.launch_time)
                if phases:
                    extra["phases_s"] = phases
            untrained = next((r for r in outcome.reports if r and r.get("status") == "untrained"), None)
            if outcome.status == "untrained" and untrained is not None:  # what its steps did, as rank 0 counted them
                extra.update({k: untrained.get(k) for k in ("fault", *TRAINING_EVIDENCE)})
            # The highest resident set the runner saw (CPU): for an oom, how far past the budget it went.
            return TrialResult(config, outcome.status, error=outcome.error, extra=extra, memory_budget_bytes=budget,
                               wall_time_s=wall_time_s, backend=self.name,
                               peak_memory_bytes=max(outcome.observed_peaks, default=None))
        reports = [r for r in outcome.reports if r is not None]
        assert len(reports) == len(outcome.reports), "the runner judges a trial ok only with every rank's report"
        first = reports[0]
        worst = max(reports, key=lambda r: r["peak_memory_bytes"])
        step = first["step_time_s"]
        throughput = self._global_batch(extra) / step
        extra.update(
            peak_memory_growth_bytes=worst["peak_memory_bytes"] - worst["baseline_memory_bytes"],
            baseline_memory_bytes=worst["baseline_memory_bytes"],
            startup_peak_bytes=max(r["startup_peak_bytes"] for r in reports),
            step_time_iqr_s=first["step_time_iqr_s"], step_times_s=first["step_times_s"],
            steps_measured=len(first["step_times_s"]), stop_reason=first["stop_reason"],
            launch_to_first_step_s=first["first_step_time"] - outcome.launch_time,
            phases_s=first["phases_s"], import_ahead_s=first.get("import_ahead_s"), build=first.get("build"), optimizer=first["optimizer"],
            basic_optimizer=first.get("basic_optimizer"),
            threads_per_rank=first["threads"], model_revision=first.get("model_revision"),
            **{key: first.get(key) for key in TRAINING_EVIDENCE})
        for key in ("peak_allocated_bytes", "cuda_context_bytes", "outside_allocator_bytes", "peak_reserved_bytes"):
            if worst.get(key) is not None:
                extra[key] = worst[key]
        return TrialResult(config, "ok", throughput_samples_per_s=throughput,
                           tokens_per_s=throughput * self._seq_len(extra), step_time_s=step,
                           peak_memory_bytes=worst["peak_memory_bytes"], extra=extra, memory_budget_bytes=budget,
                           wall_time_s=wall_time_s, backend=self.name)


# A trial's log folder (docs/trials.md): `<logs>/<NNNN>-<config label>[-attempt<k>]`, NNNN its number in trials.jsonl.

def folder_label(config: Config) -> str:
    """The config's label as a folder name."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", config.label())


def claim_log_dir(logs_dir: Path, number: int, label: str) -> Path:
    """Make `<logs_dir>/<NNNN>-<label>`, or the first of its `-attempt<k>` (k = 2, 3, ...) that no one made yet: an
    exclusive mkdir, so two claims never get one folder."""
    attempt = 1
    while True:
        path = logs_dir / (f"{number:04d}-{label}" + (f"-attempt{attempt}" if attempt > 1 else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            attempt += 1


def settle_log_dir(result: TrialResult, number: int) -> TrialResult:
    """`result` with its log folder under `number`, the one it is about to be recorded under (drivers/sweep.py,
    before the append). A launch names its folder after the trials recorded when it started
    (`DeepSpeedBackend._new_log_dir`): its number whenever trials run one at a time, and then nothing moves. With
    several in flight another trial may have been recorded first: the folder is moved to `<number>-<label>` (or
    its first free `-attempt<k>`: an earlier attempt of this config left a folder at that number), and every
    mention of it in the result (`log_dir`, the error, the op failure's fix, the folder's result.json) follows. A
    tuner killed after the move, before the append, leaves it under its number, unrecorded, as an interrupted
    trial's: the resumed trial at that number is its `-attempt2`. A result without a folder of this config's trial
    (another backend; a user's objective naming its own), or whose folder is not on this machine (a Ray node
    without the run directory's filesystem: the logs stay there as the node named them), is returned as it is."""
    log_dir = result.extra.get("log_dir")
    if not isinstance(log_dir, str):
        return result
    old = Path(log_dir)
    label = folder_label(result.config)
    named = re.fullmatch(rf"(\d{{4,}})-{re.escape(label)}(?:-attempt\d+)?", old.name)
    if named is None or int(named.group(1)) == number or not old.is_dir():
        return result
    new = claim_log_dir(old.parent, number, label)
    os.rename(old, new)  # onto the empty folder just claimed: atomic, and no other claim can take its name
    moved = _moved(old, new)
    saved = new / "result.json"  # the backend's copy of the result (DeepSpeedBackend.run)
    try:
        data = json.loads(saved.read_text())
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict):
        write_json_atomic(saved, moved(data))
    return replace(result, error=moved(result.error), extra=moved(result.extra))


def _moved(old: Path, new: Path) -> Callable[[Any], Any]:
    """A value with every mention of the folder `old` (the path, alone or followed by `/`...) made `new`."""
    mention = re.compile(re.escape(str(old)) + r"(?![\w-])")

    def move(value: Any) -> Any:
        if isinstance(value, str):
            return mention.sub(lambda _: str(new), value)
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(move(v) for v in value)
        return value

    return move
