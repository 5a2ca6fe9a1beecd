"""A sweep workload whose trial the Ray cluster cannot place (more ranks than all its nodes hold) gets its own
verdict, whether it is the only workload that reaches the cluster or one of several; `tune` refuses such a
command in one line. The cluster is faked (its nodes' resources), so nothing starts Ray."""

from __future__ import annotations

import csv

import pytest

import autotune.drivers.ray as ray_driver
from autotune.cli import main
from autotune.drivers.stop import StopReason

ONE_CONFIG = "space: {zero_stage: [0], micro_batch: [1], ckpt_interval: [0], precision: [fp32]}"
THREE = f"  - {{name: three, model: tiny, gpus: 3, backend: deepspeed, hardware: cpu, {ONE_CONFIG}}}\n"


def fake_cluster(monkeypatch, resources: dict[str, float]) -> None:
    """A cluster of one node holding `resources`, as the placement checks see it (ray.nodes); nothing connects to
    it, and no trial may be submitted."""
    import ray

    monkeypatch.setattr(ray_driver, "connect", lambda address: None)
    monkeypatch.setattr(ray_driver, "disconnect", lambda: None)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": resources}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: resources)

    def refuse(*args, **kwargs):
        raise AssertionError("no trial of this sweep may be submitted")
    monkeypatch.setattr(ray_driver.RayExecutor, "submit", refuse)


@pytest.fixture
def two_cpu_cluster(monkeypatch):
    fake_cluster(monkeypatch, {"CPU": 2.0})


@pytest.mark.parametrize("others", [
    "",  # the only workload
    "  - {name: nofit, model: tiny, backend: deepspeed, hardware: cpu, memory_budget: 50MiB}\n",  # ruled out before Ray
])
def test_a_sweeps_only_workload_on_ray_that_the_cluster_cannot_place_gets_its_own_verdict(tmp_path, capsys,
                                                                                           two_cpu_cluster, others):
    sweep = tmp_path / "one.yaml"
    sweep.write_text("defaults: {trials: 2, global_batch: 12}\nworkloads:\n" + THREE + others)
    out = tmp_path / "o1"
    code = main(["sweep", str(sweep), "--out", str(out)])
    said = capsys.readouterr()
    assert code == 1, said.err  # a workload without a recommendation, not a refused command (2)
    line = next(x for x in said.out.splitlines() if "cannot place" in x)
    assert line.startswith("three: gpus 3: the Ray cluster cannot place 3 ranks of 1 CPU, not even across its "
                           "nodes: it holds 2"), line  # named once, by its own key, not tune's --gpus
    assert "--gpus" not in said.out + said.err
    with open(out / "sweep_summary.csv", newline="") as handle:
        rows = {row["workload"]: row for row in csv.DictReader(handle)}
    assert rows["three"]["stopped"] == StopReason.NO_NODE.text and rows["three"]["trials"] == "0"
    assert "no node" in rows["three"]["verdict"] and "run more trials" not in rows["three"]["verdict"]
    assert (out / "sweep_summary.md").is_file() and not (out / "three" / "trials.jsonl").exists()
    report = (out / "three" / "report.md").read_text()
    assert "one trial needs (3 ranks, one CPU per rank): run it on a cluster with such nodes, or with fewer gpus" \
        in report and "every trial ran within the budget" not in report
    assert set(rows) == {"three", *(["nofit"] if others else [])}


def test_tune_still_refuses_a_trial_the_cluster_cannot_place_in_one_line(tmp_path, capsys, two_cpu_cluster):
    code = main(["tune", "--model", "tiny", "--gpus", "3", "--global-batch", "12", "--backend", "deepspeed",
                 "--hardware", "cpu", "--trials", "1", "--out", str(tmp_path / "t"), "--ray-address", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("autotune tune: error: --gpus (the workload's `gpus`) 3: the Ray cluster cannot place 3 ranks"), err
    assert not (tmp_path / "t" / "trials.jsonl").exists()


def test_a_workload_whose_trial_no_node_holds_is_named_once_and_told_what_one_trial_needs(tmp_path, capsys,
                                                                                          monkeypatch):
    """A simulated trial asks for 1 CPU, which this cluster of GPUs alone lacks (and such a trial is not spread)."""
    fake_cluster(monkeypatch, {"GPU": 1.0})
    sweep = tmp_path / "sim.yaml"
    sweep.write_text("workloads:\n  - {name: sim, model: tiny, trials: 1}\n")
    assert main(["sweep", str(sweep), "--out", str(tmp_path / "o")]) == 1
    out = capsys.readouterr().out
    assert "sim no node of the cluster has 1 CPU for one trial: nothing runs for this workload" in out, out
    assert "sim sim:" not in out
    verdict = (tmp_path / "o" / "sim" / "report.md").read_text()
    assert "one trial needs (1 CPU): run it on a cluster with such nodes." in verdict


def test_tune_many_of_several_workloads_gives_each_its_verdict_by_default(tmp_path, two_cpu_cluster):
    """From Python, RayOptions' default decides by the call: several workloads (tune_many) each get their verdict,
    as `autotune sweep`'s do; one (tune()) is refused."""
    import autotune
    from autotune.api import Plan, tune_many
    from autotune.drivers.ray import RayOptions
    from autotune.values.config import ConfigError

    spec = autotune.TuneSpec(autotune.make_workload("tiny", gpus=3, global_batch=12), autotune.load_hardware("cpu"),
                             trials=1, backend="deepspeed")
    results = tune_many([Plan(spec, tmp_path / "a"), Plan(spec, tmp_path / "b")], executor=RayOptions("local"))
    assert [r.stop_reason for r in results] == [StopReason.NO_NODE] * 2
    with pytest.raises(ConfigError, match="cannot place 3 ranks"):
        autotune.tune(spec, out=tmp_path / "c", executor=RayOptions("local"))
