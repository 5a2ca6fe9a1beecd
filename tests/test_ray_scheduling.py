"""The Ray driver's scheduling logic without a cluster (drivers/ray.py `Job`): several proposals of one
sweep in flight, a sequential strategy waits for a result, the trial budget counts trials in flight, and
what a trial asks the cluster for. The same code against a real cluster: tests/test_ray_cluster.py."""

from __future__ import annotations

import pytest

from autotune.drivers.sweep import Sweep
from autotune.values.config import ConfigError
from autotune.drivers.stop import StopReason
from autotune.drivers.progress import QuietProgress
from autotune.drivers.loop import TrialReply, run_jobs
from autotune.drivers.ray import BackendSpec, Flight, Job, TrialResources, trial_resources
from autotune.drivers.sweep import Budget
from autotune.values.hardware import PROFILES
from autotune.search.rundir import RunDir, RunSettings
from autotune.search_spaces import load_choices
from autotune.values.workload import make_workload


def settings(strategy: str, backend: str = "simulated", model: str = "tiny", gpus: int = 1, hardware: str = "cpu"):
    workload = make_workload(model, None, gpus)
    choices = load_choices("cpu" if hardware == "cpu" else "default")
    return RunSettings(workload, PROFILES[hardware], 2**30 if hardware == "cpu" else 40 * 2**30, strategy, backend,
                       0, choices)


def job(tmp_path, strategy: str, trials: int = 10, name: str | None = None, cpus: float = 1.0,
        budget: Budget | None = None) -> Job:
    s = settings(strategy)
    run = RunDir(tmp_path / (name or strategy))
    run.write_settings(s)
    sweep = Sweep.open(run, s, s.space())
    return Job(name or strategy, sweep, budget or Budget(trials), TrialResources(cpus=cpus),
               BackendSpec(s, str(run.path)), QuietProgress())


def fly(j: Job, config) -> None:
    j.in_flight.append(Flight(j, config, 1))


@pytest.mark.parametrize("strategy", [pytest.param("optuna", marks=pytest.mark.slow), "random",
                                      pytest.param("hybrid", marks=pytest.mark.slow)])  # hybrid loads the policy
def test_several_distinct_proposals_in_flight(tmp_path, strategy):
    j = job(tmp_path, strategy)
    for _ in range(4):
        config = j.next_config()
        assert config is not None and not j.waiting
        fly(j, config)
    assert len({f.config for f in j.in_flight}) == 4


def test_a_sequential_strategy_waits_for_its_result(tmp_path):
    j = job(tmp_path, "grid")
    first = j.next_config()
    fly(j, first)
    assert j.next_config() is None and j.waiting and j.reason is None
    j.in_flight.pop()
    j.waiting = False
    j.sweep.finish(first, BackendSpec(settings("grid"), str(tmp_path))().run(first))
    second = j.next_config()
    assert second is not None and second != first


def test_the_trial_budget_counts_trials_in_flight(tmp_path):
    j = job(tmp_path, "optuna", trials=2)
    configs = []
    for _ in range(2):
        configs.append(j.next_config())
        fly(j, configs[-1])
    assert j.next_config() is None and j.waiting and j.reason is None
    backend = BackendSpec(settings("optuna"), str(tmp_path))()
    for config in configs:
        j.in_flight.pop()
        j.sweep.finish(config, backend.run(config))
    j.waiting = False
    assert j.next_config() is None and j.reason == StopReason.TRIALS and j.sweep.launched == 2


def test_what_a_trial_asks_the_cluster_for():
    assert trial_resources(settings("optuna")).demand() == {"CPU": 1.0}
    real_cpu = trial_resources(settings("optuna", "deepspeed", gpus=2))
    assert real_cpu.demand() == {"CPU": 2.0}
    gpu = settings("optuna", "deepspeed", model="gpt2-xl", gpus=4, hardware="a100-40gb")
    assert trial_resources(gpu).demand() == {"CPU": 1.0, "GPU": 4.0}
    assert trial_resources(gpu, 8).options()["num_gpus"] == 8.0
    with pytest.raises(ConfigError, match=r"--gpus-per-trial \(RayOptions' `gpus_per_trial`\) 2: a trial of this workload runs 4 ranks"):
        trial_resources(gpu, 2)
    with pytest.raises(ConfigError, match=r"--gpus-per-trial \(RayOptions' `gpus_per_trial`\) 3: the cpu profile's trials take one CPU per rank"):
        trial_resources(settings("optuna", "deepspeed", gpus=2), 3)


def test_a_trial_the_cluster_flags_refuse_is_refused_before_anything_is_written(tmp_path, capsys):
    from autotune.cli import main

    out = tmp_path / "run"
    assert main(["tune", "--backend", "simulated", "--gpus", "2", "--gpus-per-trial", "1", "--ray-address", "local",
                 "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--gpus-per-trial (RayOptions' `gpus_per_trial`) 1: a trial of this workload runs 2 ranks" in captured.err
    assert not out.exists()
    slots = TrialResources(cpus=0.0, custom=(("slot", 1.0),))
    assert slots.demand() == {"slot": 1.0} and slots.devices == 1.0


def test_a_fatal_backend_verdict_stops_the_job(tmp_path):
    """A backend that says no config can succeed (StopReason.FATAL) stops proposals once its trials
    in flight are in."""
    j = job(tmp_path, "optuna")
    config = j.next_config()
    fly(j, config)
    j.fatal = "the script never reached an optimizer step"
    assert j.next_config() is None and j.waiting and j.reason is None
    j.in_flight.pop()
    j.waiting = False
    assert j.next_config() is None and j.reason == StopReason.FATAL


class Devices:
    """An executor of `capacity` devices (CPUs here), trials finishing in the order they started."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.flights: list = []
        self.started: list[str] = []

    def used(self) -> float:
        return sum(f.job.resources.cpus for f in self.flights)

    def room(self, job: Job) -> bool:
        return self.used() + job.resources.cpus <= self.capacity

    def submit(self, flight) -> None:
        self.flights.append(flight)
        self.started.append(flight.job.name)

    def wait(self):
        flight = self.flights.pop(0)
        spec = flight.job.make_backend
        return flight, TrialReply(spec().run(flight.config))

    def in_flight(self) -> int:
        return len(self.flights)

    def cancel(self) -> None:
        self.flights.clear()


def test_a_workload_of_wider_trials_is_not_starved_by_a_narrower_one(tmp_path):
    """Two devices; `narrow` trials take one, `wide` trials both. The free device waits for the workload served
    least until its trial fits (it started only once `narrow` had run all its trials), so they take turns."""
    jobs = [job(tmp_path, "random", name=name, cpus=cpus, budget=Budget(4, confirm=0))
            for name, cpus in (("narrow", 1.0), ("wide", 2.0))]
    executor = Devices(2)
    assert run_jobs(jobs, executor) == {"narrow": StopReason.TRIALS, "wide": StopReason.TRIALS}
    assert executor.started == ["narrow", "wide"] * 4


def test_an_interrupt_leaves_a_workload_that_had_finished_its_budget_finished(tmp_path):
    """One device. Ctrl-C during `long`'s first trial: `short` had run its 1 trial (its budget spent, nothing in
    flight; not asked to propose again yet) and is not marked interrupted; `long` is."""

    class Interrupted(Devices):
        def wait(self):
            if "long" in self.started:
                raise KeyboardInterrupt
            return super().wait()

    jobs = [job(tmp_path, "random", name=name, budget=Budget(trials, confirm=0))
            for name, trials in (("short", 1), ("long", 10))]
    assert run_jobs(jobs, Interrupted(1)) == {"short": StopReason.TRIALS, "long": StopReason.INTERRUPTED}
