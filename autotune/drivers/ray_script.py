"""Script-mode trials as Ray tasks (`autotune tune --script ... --ray-address`): the script's files travel with
each trial (autotune.script.ship) and it runs from their copy on the node Ray picks, unchanged, through the
same script backend as on this machine, so its verdicts, results and trial log are the same.

- The first trial (the one that shows the tuner the script's model and global batch, autotune.outputs.script)
  runs on the cluster too (drivers/ray_script_first.py): the driver's machine need not have the trials' devices.
- Every later trial is a task of the Ray driver (drivers/ray.py) whose backend builder is `ShippedScript`:
  the factory's `script` kind reads the script from the run directory, which a node without the driver's
  filesystem does not have; this builder carries the packed files instead (put once per sweep in Ray's
  object store) and unpacks them into a fresh folder per trial, removed when the trial ends.
- Results come back as the backend made them, with `script` the script on the driver and `script_copy` the
  copy the node ran. The small files of the trial's log directory that the driver reads afterwards (the
  script's DeepSpeed config for the recommendation, the config the trial used, the model seen) come back
  with the result and are written to the driver's `logs/<trial>/` where the node's were not seen there
  (another machine without a shared filesystem); they are not recorded in trials.jsonl.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.backends import Backend
from autotune.backends.factory import TrialOptions
from autotune.values.config import Config
from autotune.drivers.loop import Flight, Job, TrialReply, TrialResources
from autotune.drivers.progress import Progress
from autotune.drivers.sweep import Budget, Sweep
from autotune.values.results import TrialResult
from autotune.script.ship import Landed, Shipment, pack, plan, unpack

if TYPE_CHECKING:
    from autotune.backends.script import Script, ScriptBackend
    from autotune.search.rundir import RunDir
    from autotune.values.settings import RunSettings

LOG_FILES = "_log_files"  # result extra on its way back from the node; removed before it is recorded
LOG_FILE_MAX = 1 * 2**20  # a log file larger than this stays on the node (the ranks' output of a long run)
LOG_FILES_MAX = 4 * 2**20


@dataclass(frozen=True)
class ShippedScript:
    """Builds a script trial's backend on the node that runs it, from the shipped copy of the script."""

    settings: "RunSettings"
    run_dir: str  # absolute; the trial's log goes to its logs/ on the node
    shipment: Shipment
    bundle: Any  # the packed files (bytes), or a Ray ObjectRef to them
    timeout_s: float = 600.0  # a trial's limit (the script backend's default, as the factory's script kind)
    shape_known: bool = True  # False: the first trial, which learns the model
    keep_script_batch: bool = False  # True: the first trial runs the script's own global batch

    def __call__(self) -> Backend:
        from autotune.backends.factory import script_backend
        from autotune.backends.script import Script
        from autotune.values.dsconfig import DsOptions

        bundle = self.bundle
        if not isinstance(bundle, bytes):
            import ray

            bundle = ray.get(bundle)
        top = tempfile.mkdtemp(prefix="autotune-script-")
        try:
            landed = unpack(self.shipment, bundle, top)
            s = self.settings
            inner = script_backend(Script(landed.script, landed.args), s.workload, s.memory_budget_bytes, s.hardware,
                                   DsOptions(nvme_path=s.choices.nvme_path), Path(self.run_dir) / "logs",
                                   self.timeout_s, shape_known=self.shape_known,
                                   keep_script_batch=self.keep_script_batch, cwd=landed.cwd)
        except BaseException:
            shutil.rmtree(top, ignore_errors=True)
            raise
        return ShippedBackend(inner, landed, str(Path(self.shipment.root) / Path(self.shipment.script).name))


class ShippedBackend:
    """The script backend running the shipped copy; its results name the driver's script, and carry back the
    small files of the trial's log; `close` removes the copy."""

    name = "script"

    def __init__(self, inner: "ScriptBackend", landed: Landed, script: str) -> None:
        self.inner = inner
        self.landed = landed
        self.script = script

    @property
    def fatal(self) -> str | None:
        return self.inner.fatal

    def run(self, config: Config) -> TrialResult:
        result = self.inner.run(config)
        log_dir = result.extra.get("log_dir")
        extra = {**result.extra, "script": self.script, "script_copy": self.landed.script,
                 LOG_FILES: read_log_files(Path(log_dir)) if log_dir else {}}
        return replace(result, extra=extra)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            shutil.rmtree(self.landed.top, ignore_errors=True)


def read_log_files(log_dir: Path) -> dict[str, str]:
    """The trial log's small files by name (those the driver reads: configs, model, result, rank reports)."""
    found: dict[str, str] = {}
    total = 0
    for path in sorted(log_dir.iterdir()) if log_dir.is_dir() else ():
        size = path.stat().st_size if path.is_file() else LOG_FILE_MAX + 1
        if size > LOG_FILE_MAX or total + size > LOG_FILES_MAX:
            continue
        found[path.name] = path.read_text(errors="replace")
        total += size
    return found


def land_log_files(result: TrialResult) -> TrialResult:
    """The result without its carried log files, which are written to its log directory on this machine where
    missing (the node was another machine); the log directory is as the node named it (the same absolute path)."""
    files = result.extra.get(LOG_FILES)
    if files is None:
        return result
    extra = {k: v for k, v in result.extra.items() if k != LOG_FILES}
    log_dir = Path(result.extra["log_dir"]) if result.extra.get("log_dir") else None
    if log_dir is not None and files:
        missing = {name: text for name, text in files.items() if not (log_dir / name).exists()}
        if missing:
            log_dir.mkdir(parents=True, exist_ok=True)
            for name, text in missing.items():
                (log_dir / Path(name).name).write_text(text)
    return replace(result, extra=extra)


class ScriptJob(Job):
    """A script sweep's job: each result lands its log files on this machine before it is recorded."""

    def record(self, flight: Flight, reply: TrialReply) -> None:
        super().record(flight, TrialReply(land_log_files(reply.result), reply.fatal))


def shipment_of(script: "Script", run_dir: "RunDir") -> Shipment:
    """What travels with the script's trials (the run directory, if inside the script's folder, does not)."""
    return plan(script.path, script.args, exclude=(run_dir.path,))


def script_job(sweep: Sweep, settings: "RunSettings", run_dir: "RunDir", budget: Budget, resources: TrialResources,
               progress: Progress, name: str | None = None, options: TrialOptions = TrialOptions()) -> Job:
    """The Ray driver's job for a script sweep (the cluster is connected): its files put once in the object
    store, each trial's backend built from them on its node. `name`: the job's (default: the model's)."""
    import ray

    from autotune.backends.script import Script, read_script_info

    script = Script.from_dict(read_script_info(run_dir.path)["script"])
    shipment = shipment_of(script, run_dir)
    progress.message(shipment.describe())
    for note in shipment.notes:
        progress.message(note)
    spec = ShippedScript(settings, str(run_dir.path.resolve()), shipment, ray.put(pack(shipment)))
    if options.timeout_s is not None:  # how a script trial runs beyond its settings: its limit (TuneSpec.trial_options)
        spec = replace(spec, timeout_s=options.timeout_s)
    return ScriptJob(name or settings.workload.model.name, sweep, budget, resources, spec, progress)
