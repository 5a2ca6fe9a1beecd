"""MLflow tracking (autotune/outputs/tracking.py) against a real MLflow store (SQLite, read back with MlflowClient):
one parent run per sweep, one nested run per launched trial with its knobs, measurements, status and error,
the recommendation and the outputs on the parent; a resumed sweep continues the same parent and logs only
trials not logged yet (also those of a session without tracking); missing mlflow, a bad URI and a store
that fails mid-sweep."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import autotune
from autotune.outputs import tracking
from autotune.values.config import ConfigError
from autotune.values.results import read_results
from cli_run import cli

GiB = 2**30
SPACE = """zero_stage: [0, 1, 2]
micro_batch: [4, 8]
ckpt_interval: [0]
precision: [fp32, bf16]
offload_optimizer: [none]
offload_param: [none]
"""
TUNE = ["tune", "--model", "tiny", "--backend", "simulated", "--strategy", "optuna", "--memory-budget", "0.85GiB",
        "--seed", "2"]


def runs_in(uri: str) -> tuple[list, dict[int, object]]:
    """The parent runs and the nested runs (by trial number) of the store's ds-autotune experiment."""
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(tracking.DEFAULT_EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if tracking.PARENT_TAG not in r.data.tags]
    children: dict[int, object] = {}
    for run in runs:
        if tracking.PARENT_TAG in run.data.tags:
            number = int(run.data.tags[tracking.TRIAL_TAG])
            assert number not in children, f"trial {number} logged twice"
            children[number] = run
    return parents, children


def check_children(children: dict, results, parent_id: str) -> None:
    """Each launched trial of trials.jsonl is one nested run with its knobs, measurements, status and error."""
    launched = {r.extra["trial"]: r for r in results if r.status != "pruned"}
    assert set(children) == set(launched)
    for number, result in launched.items():
        run = children[number]
        assert run.data.tags[tracking.PARENT_TAG] == parent_id
        assert run.data.params == {knob: str(value) for knob, value in result.config.to_dict().items()}
        assert run.data.tags["status"] == result.status and run.info.run_name == f"#{number} {result.config.label()}"
        assert run.data.tags["phase"] == result.extra.get("phase", "search")
        assert run.info.status == ("FINISHED" if result.ok else "FAILED")
        for key in ("throughput_samples_per_s", "peak_memory_bytes", "step_time_s"):
            value = getattr(result, key)
            if value is None:
                assert key not in run.data.metrics
            else:
                assert run.data.metrics[key] == pytest.approx(value)
        assert run.data.tags.get("error") == (result.error[:tracking.TAG_LIMIT] if result.error else None)


def check_recommendation(uri: str, parent, run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    best = summary["best"]
    tags, metrics = parent.data.tags, parent.data.metrics
    assert {k: tags[f"best.{k}"] for k in best["config"]} == {k: str(v) for k, v in best["config"].items()}
    assert tags["best.trial"] == str(summary["best_trial_index"])
    assert metrics["best_throughput_samples_per_s"] == pytest.approx(best["throughput_samples_per_s"])
    assert metrics["best_peak_memory_bytes"] == pytest.approx(best["peak_memory_bytes"])
    assert metrics["trials_recorded"] == summary["trials"]
    assert {s: metrics[f"trials_{s}"] for s in summary["status_counts"]} == summary["status_counts"]
    assert tags["verdict"].startswith("recommended ") and tags["autotune.run_dir"] == str(run_dir.resolve())
    client = MlflowClient(uri)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"best_ds_config.json", "best_hf_ds_config.json", "summary.json", "report.md", "plots"} <= artifacts
    assert {"trials.jsonl", "stop.json", "calibration.json"} <= artifacts  # the record beside the outputs
    local = Path(client.download_artifacts(parent.info.run_id, "best_ds_config.json", str(run_dir.parent)))
    assert json.loads(local.read_text()) == json.loads((run_dir / "best_ds_config.json").read_text())


def test_a_tracked_tune_logs_a_parent_a_nested_run_per_trial_and_the_recommendation(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    run_dir = tmp_path / "run"
    import logging

    import mlflow  # noqa: F401  its loggers configured as on any import
    level = logging.getLogger("mlflow").level
    captured: list[str] = []
    spy = logging.Handler()
    spy.emit = lambda record: captured.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("mlflow").addHandler(spy)
    try:
        code, out, err = cli([*TUNE, "--trials", "4", "--out", str(run_dir), "--mlflow-uri", uri], capfd)
    finally:
        logging.getLogger("mlflow").removeHandler(spy)
    assert code == 0, err
    # A new store's "Creating initial MLflow database tables..." is not the sweep's news; MLflow's level restored.
    assert not [m for m in captured if "database tables" in m] and logging.getLogger("mlflow").level == level
    parents, children = runs_in(uri)
    assert len(parents) == 1
    parent = parents[0]
    state = json.loads((run_dir / tracking.STATE).read_text())
    assert state[uri]["run_id"] == parent.info.run_id and parent.info.status == "FINISHED"
    assert parent.info.run_name == "run"
    assert parent.data.params["model"] == "tiny" and parent.data.params["strategy"] == "optuna"
    assert parent.data.params["memory_budget_bytes"] == str(int(0.85 * GiB))
    results = read_results(run_dir / "trials.jsonl")
    check_children(children, results, parent.info.run_id)
    assert len(children) == 4
    check_recommendation(uri, parent, run_dir)
    # Artifacts beside the SQLite store, not in ./mlruns of wherever the tuner ran.
    assert (tmp_path / "store" / tracking.LOCAL_ARTIFACTS).is_dir() and not (tmp_path / "mlruns").exists()
    assert f"MLflow: {uri}" in out


def test_resume_continues_the_parent_and_logs_each_trial_once(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    code, _, err = cli([*TUNE, "--trials", "2", "--out", str(run_dir), "--mlflow"], capfd)
    assert code == 0, err
    uri = tracking.local_uri(run_dir)  # --mlflow: a SQLite store in the run directory
    assert (run_dir / tracking.LOCAL_DB).is_file() and (run_dir / tracking.LOCAL_ARTIFACTS).is_dir()
    (parent,), first = runs_in(uri)
    first_ids = {n: r.info.run_id for n, r in first.items()}
    assert sorted(first) == [1, 2]
    # A session without tracking, then one with it again: the trials it missed are logged, none twice.
    code, _, err = cli([*TUNE, "--trials", "4", "--out", str(run_dir), "--resume"], capfd)
    assert code == 0, err
    assert len(runs_in(uri)[1]) == 2
    code, out, err = cli([*TUNE, "--trials", "6", "--out", str(run_dir), "--resume", "--mlflow", "--json"], capfd)
    assert code == 0, err
    parents, children = runs_in(uri)
    assert [p.info.run_id for p in parents] == [parent.info.run_id]
    assert json.loads(out)["mlflow"] == {"uri": uri, "experiment_id": parent.info.experiment_id,
                                         "run_id": parent.info.run_id}
    results = read_results(run_dir / "trials.jsonl")
    check_children(children, results, parent.info.run_id)
    assert len(children) == 6 and {n: children[n].info.run_id for n in first_ids} == first_ids
    # Those of the untracked session are marked: their runs' times are when they were logged, not when they ran.
    assert {n for n, run in children.items() if run.data.tags.get("logged_late") == "true"} == {3, 4}
    parent = MlflowClient(uri).get_run(parent.info.run_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials_recorded"] == len(results)
    check_recommendation(uri, parent, run_dir)
    assert not (tmp_path / "mlruns").exists()


def test_a_relative_sqlite_store_is_the_same_store_when_the_sweep_resumes_from_elsewhere(tmp_path, monkeypatch, capfd):
    """sqlite:///rel.db is relative to where the tuner ran: resumed from another directory, it logged into a second
    database under a new parent run (mlflow.json then pointed there). The path is made absolute when given."""
    assert tracking.absolute_sqlite("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert tracking.absolute_sqlite("postgresql://u@h/db") == "postgresql://u@h/db"
    assert tracking.absolute_sqlite("sqlite://") == "sqlite://"
    first, other = tmp_path / "a", tmp_path / "b"
    first.mkdir(), other.mkdir()
    monkeypatch.chdir(first)
    assert tracking.absolute_sqlite("sqlite:///rel.db?timeout=5") == f"sqlite:///{first / 'rel.db'}?timeout=5"
    run_dir = tmp_path / "run"
    code, out, err = cli([*TUNE, "--trials", "2", "--out", str(run_dir), "--mlflow-uri", "sqlite:///rel.db"], capfd)
    assert code == 0, err
    uri = f"sqlite:///{first / 'rel.db'}"
    assert f"MLflow: {uri}" in out
    monkeypatch.chdir(other)
    code, _, err = cli([*TUNE, "--trials", "3", "--out", str(run_dir), "--resume", "--mlflow-uri", "sqlite:///../a/rel.db"],
                       capfd)
    assert code == 0, err
    assert not (other / "rel.db").exists()
    parents, children = runs_in(uri)
    assert len(parents) == 1 and sorted(children) == [1, 2, 3]
    assert list(json.loads((run_dir / tracking.STATE).read_text())) == [uri]


def test_failed_trials_carry_their_status_and_error(tmp_path, monkeypatch, capfd):
    """The library path (TuneSpec.mlflow_uri) on a replay surface where one config crashed."""
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    surface = tmp_path / "surface.jsonl"
    code, _, err = cli(["surface", "record", "--model", "tiny", "--hardware", "cpu", "--space", str(space),
                        "--backend", "simulated", "--out", str(surface)], capfd)
    assert code == 0, err
    lines = [json.loads(line) for line in surface.read_text().splitlines()]
    crashed = lines[0]
    crashed.update(status="crash", throughput_samples_per_s=None, tokens_per_s=None, step_time_s=None,
                   error="RuntimeError: the rank died\n" + "x" * 6000)
    surface.write_text("".join(json.dumps(line) + "\n" for line in lines))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = autotune.TuneSpec(autotune.make_workload("tiny", global_batch=16), autotune.load_hardware("cpu"),
                             memory_budget_bytes=GiB, strategy="random", trials=12, backend="replay",
                             surface=str(surface), space=str(space), mlflow_uri=uri)
    result = autotune.tune(spec, out=tmp_path / "run")
    (parent,), children = runs_in(uri)
    check_children(children, result.results, parent.info.run_id)
    failed = [r for r in children.values() if r.data.tags["status"] == "crash"]
    assert len(failed) == 1 and failed[0].info.status == "FAILED"
    assert failed[0].data.tags["error"].startswith("RuntimeError: the rank died")
    assert len(failed[0].data.tags["error"]) == tracking.TAG_LIMIT
    assert "throughput_samples_per_s" not in failed[0].data.metrics
    assert parent.data.metrics["trials_crash"] == 1 and parent.data.tags["best.config"] == result.best.config.label()


def test_missing_mlflow_names_the_extra_and_writes_nothing(tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    code, out, err = cli([*TUNE, "--trials", "2", "--out", str(tmp_path / "run"), "--mlflow"], capfd)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "pip install 'ds-autotune[tracking]'" in err
    assert not (tmp_path / "run" / "run.json").exists()
    with pytest.raises(ConfigError, match=r"ds-autotune\[tracking\]"):
        autotune.TuneSpec(autotune.make_workload("tiny"), autotune.load_hardware("cpu"), mlflow_uri=True)


@pytest.mark.parametrize("uri, named", [
    ("gopher://host/x", "unknown scheme 'gopher'"),
    ("/some/folder", "MLFLOW_ALLOW_FILE_STORE=true"),
    ("file:///some/folder", "use sqlite:///PATH/mlflow.db"),
    (" ", "MLflow tracking URI"),
    ("sqlite:///{tmp}", "is a directory"),
])
def test_a_bad_uri_is_one_line_before_anything_is_written(uri, named, tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = uri.format(tmp=tmp_path)
    run_dir = tmp_path / "run"
    code, out, err = cli([*TUNE, "--trials", "1", "--out", str(run_dir), "--mlflow-uri", uri], capfd)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and named in err
    assert not (run_dir / "run.json").exists() and not (run_dir / tracking.STATE).exists()


def test_a_database_store_without_its_driver_names_what_to_install(tmp_path, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "MySQLdb", None)  # not installed, whatever this machine has
    code, out, err = cli([*TUNE, "--trials", "1", "--out", str(tmp_path / "run"), "--mlflow-uri",
                          "mysql://u@127.0.0.1:1/db"], capfd)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "MLflow tracking URI mysql://u@127.0.0.1:1/db: " in err and "(pip install 'mysqlclient')" in err


def test_a_store_that_cannot_be_opened_leaves_no_sweep_behind(tmp_path, capfd, monkeypatch):
    """The store is opened before the first trial: a server that does not answer is one line, exit 2, and
    the corrected command starts the sweep (nothing is left that says 'already holds a sweep')."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own: fail at once, not in minutes
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    run_dir = tmp_path / "run"
    code, _, err = cli([*TUNE, "--trials", "1", "--out", str(run_dir), "--mlflow-uri", f"http://127.0.0.1:{port}"],
                       capfd)
    assert code == 2 and f"MLflow tracking URI http://127.0.0.1:{port}:" in err
    assert len(err.strip().splitlines()) == 1
    assert not (run_dir / "run.json").exists() and not (run_dir / "trials.jsonl").exists()
    code, _, err = cli([*TUNE, "--trials", "1", "--out", str(run_dir)], capfd)
    assert code == 0, err


@pytest.fixture
def silent_server():
    """A server that accepts connections and never answers (a hung tracking server, a port behind a stuck
    proxy), on 127.0.0.2: its port."""
    from test_procs_robust import serving

    yield from serving(None)


def unreachable(uri: str, tmp_path: Path, capfd, monkeypatch) -> str:
    """`autotune tune --mlflow-uri uri` with MLflow's own retries as they are by default: it must fail in one line,
    exit 2, nothing written, decided by the probe before MLflow's client (whose retries take minutes) is ever
    used. Its error line."""
    import mlflow

    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)

    def never(*args, **kwargs):
        raise AssertionError("MLflow's client was used: its retries would take minutes")

    monkeypatch.setattr(mlflow, "MlflowClient", never)
    monkeypatch.setattr(tracking, "tracked", never)
    run_dir = tmp_path / "run"
    code, _, err = cli([*TUNE, "--trials", "1", "--out", str(run_dir), "--mlflow-uri", uri], capfd)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"MLflow tracking URI {uri}: " in err, err
    assert not run_dir.exists()
    return err.strip()


def test_a_refused_tracking_server_is_one_line_within_seconds(tmp_path, capfd, monkeypatch):
    err = unreachable("http://127.0.0.1:1", tmp_path, capfd, monkeypatch)
    assert "http://127.0.0.1:1: connection refused; is the tracking server running" in err


def test_a_tracking_server_that_never_answers_is_one_line_within_its_timeout(silent_server, tmp_path, capfd,
                                                                              monkeypatch):
    monkeypatch.setattr(tracking, "PROBE_TIMEOUT_S", 1.5)  # the default, 5 s, the same way: the test kept short
    err = unreachable(f"http://127.0.0.2:{silent_server}", tmp_path, capfd, monkeypatch)
    assert f"http://127.0.0.2:{silent_server}: no answer within 1.5 s; is the tracking server running" in err


@pytest.mark.parametrize("status", [200, 401, 503])
def test_a_server_that_answers_is_left_to_mlflow_and_its_retries(status, monkeypatch):
    """Any HTTP answer, even an error, is a server there: what it means (authentication, a server busy for a
    moment) is MLflow's to handle, with its retries, which the check leaves as they are."""
    import http.server
    import os
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    before = dict(os.environ)
    try:
        tracking.check_reachable(f"http://127.0.0.1:{server.server_port}/")
    finally:
        server.shutdown()
        server.server_close()
    assert dict(os.environ) == before
    tracking.check_reachable("sqlite:////nonexistent/mlflow.db")  # not a server: nothing to ask


class Failing:
    """A store that goes away: every call raises."""

    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise ConnectionError("the tracking server went away")
        return call


def test_a_store_failing_mid_sweep_warns_once_and_the_sweep_goes_on():
    warnings: list[str] = []
    tracker = tracking.MlflowTracker(Failing(), "http://server:5000", "1", "parent", set(), warnings.append)
    config = autotune.Config(0, 4, 0, "bf16", "none", "none")
    for number in (1, 2, 3):
        tracker.trial(autotune.TrialResult(config, "ok", throughput_samples_per_s=1.0, extra={"trial": number}))
    tracker.finish(None, {"trials": 3}, [], "no config fits", "trials")
    tracker.end("FINISHED")
    assert len(warnings) == 1 and "the tracking server went away" in warnings[0] and "--resume" in warnings[0]
    assert tracker.logged == set()


def test_a_trials_evidence_that_it_trained_is_logged_with_its_figures(tmp_path):
    """Steps applied and skipped and the loss at the first and last applied step: what makes a measurement one
    (values.results) goes to the tracker too, so that a run in MLflow shows it trained."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e")
    parent = client.create_run(experiment).info.run_id
    tracker = tracking.MlflowTracker(client, uri, experiment, parent, set(), print)
    config = autotune.Config(0, 4, 0, "fp32", "none", "none")
    tracker.trial(autotune.TrialResult(config, "ok", throughput_samples_per_s=3.0, extra={
        "trial": 1, "steps_applied": 6, "steps_skipped": 0, "first_applied_step": 1, "loss_first": 5.5,
        "loss_last": 5.25}))
    (child,) = [r for r in client.search_runs([experiment]) if r.info.run_id != parent]
    assert {k: child.data.metrics[k] for k in ("steps_applied", "steps_skipped", "loss_first", "loss_last")} == \
        {"steps_applied": 6, "steps_skipped": 0, "loss_first": 5.5, "loss_last": 5.25}


def interrupt_logging(monkeypatch, number: int) -> None:
    """Ctrl-C while trial `number`'s run is being logged: after its run is created, before its values."""
    real = MlflowClient.log_batch

    def log_batch(self, run_id, *args, **kwargs):
        if any(p.key == "zero_stage" for p in kwargs.get("params") or ()) \
                and self.get_run(run_id).info.run_name.startswith(f"#{number} "):
            raise KeyboardInterrupt
        return real(self, run_id, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)


def check_resumed(uri: str, run_dir: Path, late: set[int]) -> None:
    """One parent, each launched trial once as its nested run, complete; the half-logged one logged again, late."""
    parents, children = runs_in(uri)
    assert len(parents) == 1, [p.info.run_name for p in parents]
    check_children(children, read_results(run_dir / "trials.jsonl"), parents[0].info.run_id)
    assert {n for n, run in children.items() if run.data.tags.get("logged_late") == "true"} == late


def test_a_trial_interrupted_while_it_is_logged_leaves_no_orphan_and_is_logged_once_on_resume(tmp_path, monkeypatch,
                                                                                             capfd):
    """The child run was created without its tags, which a second call added: a Ctrl-C in between left a
    top-level run RUNNING beside the parent, and the resume logged the trial again beside it."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    uri = tracking.local_uri(run_dir)
    interrupt_logging(monkeypatch, 2)
    code, _, err = cli([*TUNE, "--trials", "3", "--out", str(run_dir), "--mlflow"], capfd)
    assert code == 130, err
    (parent,), children = runs_in(uri)
    assert parent.info.status == "KILLED" and sorted(children) == [1]  # the half-logged child is deleted
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    code, _, err = cli([*TUNE, "--trials", "3", "--out", str(run_dir), "--resume", "--mlflow"], capfd)
    assert code == 0, err
    check_resumed(uri, run_dir, late={2})


KILLER = """import os, signal, sys
from mlflow.tracking import MlflowClient
real = MlflowClient.log_batch
def log_batch(self, run_id, *args, **kwargs):
    if any(p.key == "zero_stage" for p in kwargs.get("params") or ()) \\
            and self.get_run(run_id).info.run_name.startswith("#2 "):
        os.kill(os.getpid(), signal.SIG{name})  # SIGTERM: the tuner's Ctrl-C (autotune.trials.interrupts)
        signal.pause()
    return real(self, run_id, *args, **kwargs)
MlflowClient.log_batch = log_batch
from autotune.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("name", ["TERM", "KILL"])
def test_a_tuner_killed_while_it_logs_a_trial_is_logged_once_on_resume(name, tmp_path, monkeypatch, capfd):
    """A real signal mid-log, in a tuner of its own: SIGTERM ends it as Ctrl-C does (the child deleted as it
    ends), SIGKILL leaves the child RUNNING, which the resume deletes before it logs the trial again."""
    import subprocess

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    uri = tracking.local_uri(run_dir)
    root = Path(autotune.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", KILLER.format(name=name), *TUNE, "--trials", "3", "--out",
                           str(run_dir), "--mlflow"], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == (130 if name == "TERM" else -9), done.stderr
    children = runs_in(uri)[1]
    assert sorted(children) == ([1] if name == "TERM" else [1, 2])  # 2: half-logged, RUNNING
    code, _, err = cli([*TUNE, "--trials", "3", "--out", str(run_dir), "--resume", "--mlflow"], capfd)
    assert code == 0, err
    check_resumed(uri, run_dir, late={2})
