"""The first trial of a script sweep on a Ray cluster (`autotune tune --script ... --ray-address`): the trial
that shows the tuner the script's model and global batch (autotune.outputs.script.first_trial) runs as a Ray
task from the shipped copy of the script (drivers/ray_script.py), as every later trial does, so the machine
that runs `autotune` needs none of the trials' devices."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autotune.values.config import Config, ConfigError
from autotune.drivers.loop import TrialReply, TrialResources
from autotune.drivers.ray import RayOptions, describe_cluster, fits_some_node, run_trial, trial_resources
from autotune.trials.cluster import connect, disconnect
from autotune.drivers.ray_script import ShippedScript, land_log_files, shipment_of
from autotune.values.results import TrialResult
from autotune.script.ship import pack

if TYPE_CHECKING:
    from autotune.backends.script import Script
    from autotune.search.rundir import RunDir
    from autotune.values.settings import RunSettings

FirstTrial = Callable[[Config, bool], "tuple[TrialResult, str | None]"]


def first_trial_runner(options: RayOptions, run_dir: "RunDir", settings: "RunSettings", script: "Script",
                       timeout_s: float = 600.0, say: Callable[[str], None] = lambda line: None) -> FirstTrial:
    """Runs a script sweep's first trial as a Ray task (autotune.outputs.script.first_trial's `remote`): the
    cluster stays connected for the sweep's trials (drivers/ray.run_on_cluster disconnects at its end) unless the
    trial ended the sweep or failed to run. `say` hears the cluster and what travels (the sweep's display)."""

    def run(config: Config, keep_script_batch: bool) -> tuple[TrialResult, str | None]:
        shipment = shipment_of(script, run_dir)  # refused before connecting when too large
        resources = trial_resources(settings, options.gpus_per_trial)
        connect(options.address)
        try:
            say(f"Ray cluster {options.address}: {describe_cluster()}; one trial asks for {resources.describe()}; "
                f"{shipment.describe()}")
            for note in shipment.notes:
                say(note)
            if not fits_some_node(resources):
                raise ConfigError(f"no node of the Ray cluster at {options.address} has {resources.describe()} for "
                                  "one trial of the script")
            reply = _run_remote(ShippedScript(settings, str(run_dir.path.resolve()), shipment, pack(shipment),
                                              timeout_s, shape_known=False, keep_script_batch=keep_script_batch),
                                config, resources)
        except BaseException:
            disconnect()
            raise
        if reply.fatal:
            disconnect()
        return land_log_files(reply.result), reply.fatal

    return run


def _run_remote(spec: ShippedScript, config: Config, resources: TrialResources) -> TrialReply:
    """One trial as a Ray task, waited for; a task that raised or whose worker died is a crash."""
    import ray
    from ray import exceptions as rex

    ref = ray.remote(run_trial).options(max_retries=0, **resources.options()).remote(spec, config)
    try:
        return ray.get(ref)
    except KeyboardInterrupt:
        ray.cancel(ref)  # a KeyboardInterrupt in the task: the backend ends its processes
        ray.wait([ref], timeout=15)
        raise
    except rex.RayError as err:
        cause = err.cause if isinstance(err, rex.RayTaskError) and err.cause else err
        text = str(cause).strip().splitlines()
        return TrialReply(TrialResult(config, "crash", backend="script", error=f"the trial's Ray task failed: "
                                      f"{type(cause).__name__}: {text[0] if text else ''}"))
