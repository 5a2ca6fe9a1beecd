"""The Optuna study of a sweep, read through optuna-dashboard's own HTTP API (a real server on loopback) and
Optuna's API: knob values, results, metric name, feasibility and the report's trial numbers; `--storage`
(a shared SQLite database, a journal file) with resume; bad storages refused before anything is written."""

from __future__ import annotations

import csv
import io
import json
import shutil
import threading
import urllib.request
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import optuna
import pytest

import autotune
from autotune.cli import main
from autotune.values.config import KNOBS
from autotune.values.results import read_results
from autotune.search.rundir import RunDir
from autotune.search.study_storage import study_name
from cli_run import cli

GiB = 2**30
BUDGET = "0.7GiB"  # the tiny model on the simulated CPU: some configs fit, some run out of memory, some are pruned
TRIALS = 10


def tune(out: Path, strategy: str = "optuna", *extra: str, trials: int = TRIALS) -> None:
    assert main(["tune", "--model", "tiny", "--memory-budget", BUDGET, "--strategy", strategy, "--trials",
                 str(trials), "--backend", "simulated", "--seed", "1", "--out", str(out), *extra]) == 0


@contextmanager
def dashboard(storage: Any) -> Iterator[str]:
    """optuna-dashboard's WSGI app on a free loopback port; yields its base URL."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    import optuna_dashboard

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = make_server("127.0.0.1", 0, optuna_dashboard.wsgi(storage), handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.status == 200
        return response.read()


def read_study(storage: Any, name: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The dashboard's study detail and CSV export of study `name`."""
    with dashboard(storage) as base:
        studies = json.loads(get(f"{base}/api/studies"))["study_summaries"]
        ids = [s["study_id"] for s in studies if s["study_name"] == name]
        assert len(ids) == 1, [s["study_name"] for s in studies]
        detail = json.loads(get(f"{base}/api/studies/{ids[0]}"))
        rows = list(csv.DictReader(io.StringIO(get(f"{base}/csv/{ids[0]}").decode())))
    return detail, rows


def attrs(trial: dict[str, Any]) -> dict[str, str]:
    return {a["key"]: a["value"] for a in trial["user_attrs"]}


def assert_reads_like_the_run(detail: dict[str, Any], rows: list[dict[str, str]], run: Path) -> None:
    """Every recorded trial is in the study under its report number, with its knobs' values, status, results
    and feasibility as the dashboard sees them; proposals that never ran are neither COMPLETE nor numbered."""
    results = read_results(run / "trials.jsonl")
    budget = RunDir(run).read_settings().memory_budget_bytes
    assert detail["objective_names"] == ["throughput_samples_per_s"]
    assert set(KNOBS) | {"status", "report_trial", "throughput_samples_per_s", "peak_memory_bytes", "feasible"} <= {
        a["key"] for a in detail["union_user_attrs"]}
    numbered = {int(attrs(t)["report_trial"]): t for t in detail["trials"] if "report_trial" in attrs(t)}
    assert sorted(numbered) == list(range(1, len(results) + 1))
    # The plots' axes: each knob a categorical over the space's values, in order.
    space = json.loads({a["key"]: a["value"] for a in detail["user_attrs"]}["space"])
    for name in ("intersection_search_space", "union_search_space"):
        axes = {d["name"]: d["distribution"] for d in detail[name]}
        assert sorted(axes) == sorted(KNOBS), name
        for knob in KNOBS:
            assert axes[knob]["type"] == "CategoricalDistribution"
            # (the dashboard merges the trials' choices as a set: their order is the trials', below)
            assert sorted(c["value"] for c in axes[knob]["choices"]) == sorted(str(v) for v in space[knob])
    for number, result in enumerate(results, 1):
        trial, a = numbered[number], attrs(numbered[number])
        for knob in KNOBS:
            assert a[knob] == str(getattr(result.config, knob)), (number, knob)
        assert a["config"] == result.config.label() and a["status"] == result.status
        # The parameters the dashboard plots are the knobs' values (micro-batch 1/2/4/8, not 0-3).
        params = {p["name"]: p for p in trial["params"]}
        assert sorted(params) == sorted(KNOBS)
        for knob in KNOBS:
            assert params[knob]["param_external_value"] == str(getattr(result.config, knob)), (number, knob)
            assert [c["value"] for c in params[knob]["distribution"]["choices"]] == [str(v) for v in space[knob]]
        # A config that ran and failed (out of memory) is infeasible and has no value: no floor of zeros.
        assert trial["state"] == ("Complete" if result.fits(budget) else "Pruned")
        # Feasibility as optuna-dashboard computes it: every constraint <= 0.
        assert len(trial["constraints"]) == 1
        assert (trial["constraints"][0] <= 0) is result.fits(budget) is (a["feasible"] == "True")
        if not result.fits(budget):
            assert "values" not in trial and trial["constraints"][0] > 0
        else:
            assert trial["values"] == [pytest.approx(result.throughput)]
        if result.throughput_samples_per_s is not None:
            assert float(a["throughput_samples_per_s"]) == pytest.approx(result.throughput_samples_per_s)
        if result.peak_memory_bytes is not None:
            assert int(a["peak_memory_bytes"]) == result.peak_memory_bytes
    for trial in detail["trials"]:
        a = attrs(trial)
        if "report_trial" in a:
            continue
        if trial["state"] == "Waiting":  # queued and never asked (a warm start the budget left no room for)
            assert a["status"] == "queued" and {knob: a[knob] for knob in KNOBS}
        else:  # never ran: an invalid combination, a repeat, or a sampled config the forecast found unlikely to fit
            assert (trial["state"], a["status"]) in {("Pruned", "invalid"), ("Fail", "repeat"),
                                                     ("Pruned", "unlikely to fit")}
    # The best trial is the recommendation.
    best = json.loads((run / "summary.json").read_text())["best"]["config"]
    assert {k: attrs(detail["best_trials"][0])[k] for k in KNOBS} == {k: str(v) for k, v in best.items()}
    # The CSV export: the metric's name heads the value column, the knobs' values are columns.
    assert len(rows) == len(detail["trials"]) and "throughput_samples_per_s" in rows[0]
    by_number = {int(r["UserAttribute report_trial"]): r for r in rows if r["UserAttribute report_trial"]}
    assert [int(by_number[n]["UserAttribute micro_batch"]) for n in sorted(by_number)] == [
        r.config.micro_batch for r in results]


@pytest.fixture(scope="module")
def optuna_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "tiny-optuna"
    tune(out)
    return out


def test_the_dashboard_reads_a_tuned_study_with_knob_values_results_and_feasibility(optuna_run):
    detail, rows = read_study(f"sqlite:///{optuna_run / 'study.db'}", "autotune")
    assert_reads_like_the_run(detail, rows, optuna_run)
    results = read_results(optuna_run / "trials.jsonl")
    # (guided by the forecast, the search may avoid every out-of-memory here; feasibility is checked per trial
    # in assert_reads_like_the_run)
    assert "ok" in {r.status for r in results}
    launched = [r for r in results if r.status != "pruned"]
    # (the search may end before TRIALS once no untried config is worth a trial nor likely to fit)
    budget = RunDir(optuna_run).read_settings().memory_budget_bytes
    fit = [r for r in results if r.fits(budget)]
    assert sum(t["state"] == "Complete" for t in detail["trials"]) == len(fit) < len(launched) <= TRIALS
    # This run has out-of-memory trials: infeasible PRUNED trials, their micro-batch a value of the space.
    ooms = [t for t in detail["trials"] if attrs(t)["status"] == "oom"]
    assert ooms and all(t["state"] == "Pruned" and t["constraints"][0] > 0 and "values" not in t for t in ooms)
    batches = {p["param_external_value"] for t in detail["trials"] for p in t["params"] if p["name"] == "micro_batch"}
    assert batches <= {"1", "2", "4", "8"} and len(batches) > 1
    # (Invalid combinations: guided by the sweep's forecast this run proposes none; tests/test_strategies.py
    # covers how they are told.)
    user = {a["key"]: a["value"] for a in detail["user_attrs"]}
    assert json.loads(user["space"])["micro_batch"] == [1, 2, 4, 8]
    assert int(user["memory_budget_bytes"]) == RunDir(optuna_run).read_settings().memory_budget_bytes


def test_optunas_own_api_reads_real_values_and_the_report_names_the_study(optuna_run):
    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{optuna_run / 'study.db'}")
    assert study.metric_names == ["throughput_samples_per_s"]
    best = study.best_trial
    summary = json.loads((optuna_run / "summary.json").read_text())
    assert best.user_attrs["report_trial"] == summary["best_trial_index"]
    assert {k: best.user_attrs[k] for k in KNOBS} == summary["best"]["config"]
    assert best.user_attrs["micro_batch"] == summary["best"]["config"]["micro_batch"]  # not an index
    report = (optuna_run / "report.md").read_text()
    assert "Optuna study: `autotune` in `study.db` here (`optuna-dashboard sqlite:///study.db`" in report
    assert "`report_trial`" in report


def test_the_hybrid_strategys_study_reads_the_same(tmp_path):
    run = tmp_path / "tiny-hybrid"
    tune(run, "hybrid")
    detail, rows = read_study(f"sqlite:///{run / 'study.db'}", "autotune")
    assert_reads_like_the_run(detail, rows, run)
    numbered = sorted((int(attrs(t)["report_trial"]), attrs(t)["proposed_by"]) for t in detail["trials"]
                      if "report_trial" in attrs(t))
    proposers = [by for _, by in numbered]
    # The likeliest best first, Optuna's most valuable configs, then the policy taking turns with them (and TPE
    # where none is worth its risk).
    assert proposers[0] == "warm start"
    assert {"warm start"} <= set(proposers) <= {"policy", "warm start", "optuna", "nearest untried",
                                                          "expected gain", "near the best", "likeliest to fit"}


def test_storage_url_puts_the_study_in_a_shared_database_and_resume_continues_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    first, second = tmp_path / "first", tmp_path / "second"
    tune(first, "optuna", "--storage", url, trials=6)
    tune(second, "optuna", "--storage", url, trials=4)
    tune(first, "optuna", "--storage", url, "--resume", trials=TRIALS)
    for run in (first, second):
        assert not (run / "study.db").exists() and (run / "trials.jsonl").is_file() and (run / "report.md").is_file()
        assert f"in `{url}`" in (run / "report.md").read_text()
    names = {s.study_name for s in optuna.get_all_study_summaries(url)}
    assert names == {study_name(first, url), study_name(second, url)}
    detail, rows = read_study(url, study_name(first, url))  # resumed: one study, numbered on from the record
    assert_reads_like_the_run(detail, rows, first)
    # (at most TRIALS: the search ends early once no untried config is worth a trial nor likely to fit)
    launched = [r for r in read_results(first / "trials.jsonl") if r.status != "pruned"]
    fit = [r for r in launched if r.fits(RunDir(first).read_settings().memory_budget_bytes)]
    assert sum(t["state"] == "Complete" for t in detail["trials"]) == len(fit) and len(launched) <= TRIALS
    assert len(launched) > 6  # the resumed run went on
    assert json.loads((first / "run.json").read_text())["storage"] == url


def test_the_library_takes_a_journal_file_as_storage(tmp_path):
    journal = tmp_path / "studies.log"
    spec = autotune.TuneSpec(autotune.make_workload("tiny"), autotune.load_hardware("cpu"),
                             memory_budget_bytes=int(0.7 * GiB), strategy="optuna", trials=TRIALS,
                             backend="simulated", seed=1, storage=str(journal))
    run = tmp_path / "run"
    result = autotune.tune(spec, out=run)
    assert result.best is not None and not (run / "study.db").exists()
    detail, rows = read_study(str(journal), study_name(run, str(journal)))  # the dashboard opens the journal itself
    assert_reads_like_the_run(detail, rows, run)


def test_a_sweep_resumed_from_a_moved_directory_goes_on_in_the_study_run_json_names(tmp_path):
    journal = tmp_path / "studies.log"
    spec = autotune.TuneSpec(autotune.make_workload("tiny"), autotune.load_hardware("cpu"),
                             memory_budget_bytes=int(0.7 * GiB), strategy="optuna", trials=4,
                             backend="simulated", seed=1, storage=str(journal))
    began, moved = tmp_path / "began", tmp_path / "moved"
    autotune.tune(spec, out=began)
    began.rename(moved)  # or resumed on another host: a name made from host and path would change
    autotune.tune(replace(spec, trials=TRIALS), out=moved, resume=True)
    name = json.loads((moved / "run.json").read_text())["study"]
    assert name == study_name(began, str(journal)) != study_name(moved, str(journal))
    assert [s.study_name for s in optuna.get_all_study_summaries(RunDir(moved).storage(str(journal)))] == [name]
    detail, rows = read_study(str(journal), name)
    assert_reads_like_the_run(detail, rows, moved)
    assert sum(r.status != "pruned" for r in read_results(moved / "trials.jsonl")) > 4  # it went on
    settings = json.loads((moved / "run.json").read_text())
    (moved / "run.json").write_text(json.dumps({**settings, "study": 7}))
    with pytest.raises(autotune.ConfigError, match=r"run.json: study: 7: allowed a study name"):
        autotune.tune(replace(spec, trials=TRIALS + 2), out=moved, resume=True)


@pytest.mark.parametrize("storage, says, syntax", [
    ("foo://nowhere", "cannot be opened", False),
    # No driver here, or nothing listening: refused either way, when it is opened.
    ("postgresql://tuner:s3cret@127.0.0.1:1/studies", "", False),
    ("sqlite:////nonexistent-folder/study.db", "does not exist", True),
    ("sqlite:///:memory:", "in-memory", True),
    ("/nonexistent-folder/studies.log", "does not exist", True),
    ("{tmp}", "a folder", True),
    ("{tmp}/existing.db", "pass sqlite:///", True),
    ("{tmp}/notes.txt", "not an Optuna journal", True),
], ids=["unknown-dialect", "postgres-unreachable", "sqlite-no-folder", "sqlite-memory", "journal-no-folder",
        "folder", "sqlite-file-as-journal", "not-a-journal"])
def test_a_bad_storage_is_one_line_exit_2_and_nothing_written(storage, says, syntax, tmp_path, capsys):
    optuna.create_study(storage=f"sqlite:///{tmp_path / 'existing.db'}")
    (tmp_path / "notes.txt").write_text("not a journal\n")
    storage = storage.replace("{tmp}", str(tmp_path))
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "run"
    code, stdout, err = cli(["tune", "--backend", "simulated", "--strategy", "optuna", "--trials", "2",
                             "--out", str(out), "--storage", storage], capsys)
    assert code == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune tune: error: storage '"), err
    assert says in lines[0] and "allowed: an Optuna RDB URL" in lines[0]
    assert "s3cret" not in err  # a password is never shown
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not out.exists()
    spec = autotune.TuneSpec(autotune.make_workload("tiny"), autotune.load_hardware("cpu"), strategy="optuna",
                             trials=2, backend="simulated", storage=None if syntax else storage)
    with pytest.raises(autotune.ConfigError, match="storage '"):  # the library: at construction or on opening
        if syntax:
            autotune.TuneSpec(spec.workload, spec.hardware, storage=storage)
        else:
            autotune.tune(replace(spec, storage=storage), out=out)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not out.exists()


def test_a_database_of_another_application_is_refused_unchanged_and_an_empty_one_taken(tmp_path, capsys):
    """RDBStorage added Optuna's tables to a database of another application (an MLflow store) before refusing it
    with Optuna's version message: its tables are looked at, read-only, before Optuna opens it."""
    import hashlib
    import sqlite3

    database = tmp_path / "mlflow.db"
    with sqlite3.connect(database) as connection:
        connection.executescript("CREATE TABLE experiments (id INTEGER); CREATE TABLE runs (id INTEGER);"
                                 "CREATE TABLE alembic_version (version_num TEXT);")
    connection.close()
    digest = hashlib.sha256(database.read_bytes()).hexdigest()
    url, out = f"sqlite:///{database}", tmp_path / "run"
    code, stdout, err = cli(["tune", "--backend", "simulated", "--trials", "2", "--out", str(out), "--storage", url],
                            capsys)
    lines = err.strip().splitlines()
    assert code == 2 and stdout == "" and len(lines) == 1, err
    assert (f"storage '{url}': not an Optuna storage (it holds tables alembic_version, experiments, runs): give an "
            "empty database or an Optuna one") in lines[0]
    assert hashlib.sha256(database.read_bytes()).hexdigest() == digest and not out.exists()
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()  # a database file without tables: Optuna's to set up
    tune(out, "optuna", "--storage", f"sqlite:///{empty}", trials=2)
    assert len(optuna.get_all_study_summaries(f"sqlite:///{empty}")) == 1


def test_a_new_sweep_does_not_take_over_a_study_an_earlier_one_left(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    run = tmp_path / "run"
    tune(run, "optuna", "--storage", url, trials=2)
    shutil.rmtree(run)  # the run directory is deleted, its study stays
    code, _, err = cli(["tune", "--backend", "simulated", "--strategy", "optuna", "--trials", "2", "--out", str(run),
                        "--storage", url], capsys)
    assert code == 2 and "already holds study" in err and "optuna delete-study" in err and not run.exists()
    # A study none of whose trials was recorded (a sweep that failed before its first trial) is replaced.
    optuna.delete_study(study_name=study_name(run, url), storage=url)
    left = optuna.create_study(study_name=study_name(run, url), storage=url)
    left.enqueue_trial({"zero_stage_index": 0})
    tune(run, "optuna", "--storage", url, trials=2)
    trials = optuna.load_study(study_name=study_name(run, url), storage=url).trials
    assert sorted(t.user_attrs.get("report_trial") for t in trials if t.state.is_finished()
                  and "report_trial" in t.user_attrs) == [1, 2]


def test_resumed_optuna_study_keeps_report_numbers_after_a_result_recorded_but_never_told(tmp_path):
    """A record the study never heard of (the tuner died between recording and telling) is added on resume
    under its report number, with its knobs' values."""
    run = tmp_path / "run"
    tune(run, "optuna", trials=3)
    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{run / 'study.db'}")
    results = read_results(run / "trials.jsonl")
    lost = results[-1]
    # Forget the last told trial as if it had never been told: a fresh study holding all but it.
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    copy = optuna.create_study(study_name="autotune", storage=fresh, direction="maximize")
    for trial in study.trials:
        if trial.state.is_finished() and trial.user_attrs.get("report_trial") != len(results):
            copy.add_trial(trial)
    for name in ("study.db", "study.db-wal", "study.db-shm"):  # the WAL would replay the old study onto the new
        (run / name).unlink(missing_ok=True)
    Path(fresh.removeprefix("sqlite:///")).rename(run / "study.db")
    tune(run, "optuna", "--resume", trials=5)
    trials = optuna.load_study(study_name="autotune", storage=f"sqlite:///{run / 'study.db'}").trials
    told = [t for t in trials if t.user_attrs.get("report_trial") == len(results)]
    assert len(told) == 1 and told[0].user_attrs["proposed_by"] == "record"
    assert {k: told[0].user_attrs[k] for k in KNOBS} == lost.config.to_dict()
    numbers = sorted(t.user_attrs["report_trial"] for t in trials if "report_trial" in t.user_attrs)
    assert numbers == list(range(1, len(read_results(run / "trials.jsonl")) + 1))


def test_queued_configs_that_already_ran_are_skipped_and_every_trial_holds_its_own_config():
    """The hybrid's policy may run a config that waits in Optuna's warm-start queue: the queue's entry is a
    repeat (FAIL) and the proposal after it is a config of its own, told under its own parameters."""
    from autotune.backends.simulated import SimulatedBackend
    from autotune.values.hardware import PROFILES
    from autotune.search_spaces import load_choices
    from autotune.values.space import Space
    from autotune.strategies import SearchContext, make_strategy

    workload, hardware, budget = autotune.make_workload("tiny"), PROFILES["cpu"], 2 * GiB
    space = Space(load_choices("cpu"), workload, hardware)
    strategy = make_strategy("optuna", SearchContext(space, budget))
    backend = SimulatedBackend(workload, hardware, budget)
    queued = strategy.warm_start()
    assert len(queued) == 5  # the warm start: one per structure
    ran = []
    for config in queued[:2] + [queued[-1]]:  # run elsewhere (the policy), some ahead of others in the queue
        ran.append(replace(backend.run(config).under_budget(budget), extra={"trial": len(ran) + 1}))
        strategy.observe(config, ran[-1], proposed_by="policy")
    for _ in range(6):
        config = strategy.propose()
        assert config not in {r.config for r in ran}
        ran.append(replace(backend.run(config).under_budget(budget), extra={"trial": len(ran) + 1}))
        strategy.observe(config, ran[-1])
    assert [r.config for r in ran[3:5]] == queued[2:4]  # the queue's other entries, in order
    trials = strategy.study.get_trials()
    for trial in trials:
        if trial.state.is_finished() and trial.user_attrs["status"] != "invalid":
            assert strategy.config_of(trial.params).to_dict() == {k: trial.user_attrs[k] for k in KNOBS}
    numbered = {t.user_attrs["report_trial"]: t for t in trials if "report_trial" in t.user_attrs}
    assert sorted(numbered) == list(range(1, len(ran) + 1))
    for number, result in enumerate(ran, 1):
        assert strategy.config_of(numbered[number].params) == result.config
    repeats = [t for t in trials if t.user_attrs.get("status") == "repeat"]
    assert len(repeats) == 3 and all(t.state == optuna.trial.TrialState.FAIL for t in repeats)
    assert sorted(t.user_attrs["repeat_of_report_trial"] for t in repeats) == [1, 2, 3]


def old_encoding(trial: optuna.trial.FrozenTrial, choices) -> optuna.trial.FrozenTrial:
    """`trial` as a study written before 2026-11-26 held it: ordered knobs as `<knob>_index` integers, a config
    that ran and failed COMPLETE at 0.0 (no sampler value key)."""
    from optuna.distributions import IntDistribution

    from autotune.strategies.optuna_search import ORDERED
    from autotune.strategies.sampler_view import SAMPLER_VALUE_KEY

    params, dists = {}, {}
    for name, value in trial.params.items():
        if name in ORDERED:
            values = choices.knob_values(name)
            params[f"{name}_index"], dists[f"{name}_index"] = values.index(value), IntDistribution(0, len(values) - 1)
        else:
            params[name], dists[name] = value, trial.distributions[name]
    system = dict(trial.system_attrs)
    state, value = trial.state, trial.value
    if SAMPLER_VALUE_KEY in system:
        state, value = optuna.trial.TrialState.COMPLETE, system.pop(SAMPLER_VALUE_KEY)
    return optuna.trial.create_trial(state=state, value=value, params=params, distributions=dists,
                                     user_attrs=trial.user_attrs, system_attrs=system)


@pytest.mark.parametrize("kind", ["tpe", "gp"])
def test_the_samplers_propose_from_a_study_of_values_what_they_proposed_from_one_of_indices(kind):
    """Real values and PRUNED failures in the study change nothing the samplers do (sampler_view): step by step,
    TPE and the GP propose the same configs as from the index encoding with failures COMPLETE at 0.0."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    from autotune.search_spaces import load_choices
    from autotune.strategies.optuna_search import CONSTRAINTS_KEY, ORDERED, PENALTY
    from autotune.strategies.sampler_view import SAMPLER_VALUE_KEY, SamplerView

    choices = load_choices("cpu")
    ordered = {k: choices.knob_values(k) for k in ORDERED}
    new = {k: CategoricalDistribution(list(choices.knob_values(k))) for k in KNOBS}
    old = {(f"{k}_index" if k in ORDERED else k): (IntDistribution(0, len(ordered[k]) - 1) if k in ORDERED else d)
           for k, d in new.items()}

    def sampler() -> optuna.samplers.BaseSampler:
        if kind == "gp":
            return optuna.samplers.GPSampler(seed=3, n_startup_trials=8)
        return optuna.samplers.TPESampler(seed=3, multivariate=True, n_startup_trials=8, constant_liar=True)

    def truth(c: dict[str, Any]) -> tuple[float, float]:
        """A made-up surface: (throughput, peak / budget - 1); half the space runs out of memory."""
        peak = c["micro_batch"] * (1 + (c["ckpt_interval"] == 0)) * (4 - c["zero_stage"]) / 16 - 1
        return (0.0 if peak > 0 else c["micro_batch"] / (1 + 0.2 * c["zero_stage"])), peak

    studies = {"old": optuna.create_study(direction="maximize", sampler=sampler()),
               "new": optuna.create_study(direction="maximize", sampler=SamplerView(sampler(), ordered))}
    failures = 0
    for _ in range(12 if kind == "gp" else 24):
        proposed = {}
        for name, study in studies.items():
            trial = study.ask(old if name == "old" else new)
            c = {k.removesuffix("_index"): (ordered[k.removesuffix("_index")][v] if k.endswith("_index") else v)
                 for k, v in trial.params.items()}
            proposed[name] = c
            value, constraint = truth(c)
            trial.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_KEY, [constraint])
            if name == "new" and constraint > 0:
                trial.storage.set_trial_system_attr(trial._trial_id, SAMPLER_VALUE_KEY, PENALTY)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial, value)
        assert proposed["old"] == proposed["new"]
        failures += truth(proposed["new"])[1] > 0
    assert failures  # the failed region was there to learn
    states = {t.state for t in studies["new"].trials}
    assert states == {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}


def test_a_run_whose_study_holds_indices_resumes(tmp_path):
    """A run directory written before the real values (index parameters, failures COMPLETE at 0.0, a queued
    config waiting) resumes: the waiting config runs, every record is told under its number, no config twice,
    and the new trials hold the knobs' values."""
    run = tmp_path / "run"
    FIRST = 7  # its 7th trial is the search's first out of memory: the copy holds a failure the old way
    tune(run, "optuna", trials=FIRST)
    choices = RunDir(run).read_settings().choices
    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{run / 'study.db'}")
    fresh = f"sqlite:///{tmp_path / 'old.db'}"
    copy = optuna.create_study(study_name="autotune", storage=fresh, direction="maximize")
    for key, value in study.user_attrs.items():
        copy.set_user_attr(key, value)
    for trial in study.trials:
        if trial.state.is_finished():
            copy.add_trial(old_encoding(trial, choices))
    assert any(t.user_attrs["status"] == "oom" and t.value == 0.0 for t in copy.trials)  # written the old way
    ran = {r.config for r in read_results(run / "trials.jsonl")}
    queued = next(c for c in RunDir(run).read_settings().space() if c not in ran and c.precision == "fp32")
    indexed = {(f"{k}_index" if k in ("zero_stage", "micro_batch", "ckpt_interval") else k):
               (choices.knob_values(k).index(v) if k in ("zero_stage", "micro_batch", "ckpt_interval") else v)
               for k, v in queued.to_dict().items()}
    copy.enqueue_trial(indexed, user_attrs={"status": "queued"})
    for name in ("study.db", "study.db-wal", "study.db-shm"):
        (run / name).unlink(missing_ok=True)
    Path(fresh.removeprefix("sqlite:///")).rename(run / "study.db")

    tune(run, "optuna", "--resume", trials=FIRST + 4)
    results = read_results(run / "trials.jsonl")
    configs = [r.config for r in results]
    assert len(results) > FIRST and len(set(configs)) == len(configs)
    assert configs[FIRST] == queued  # the queue, carried over, comes first
    trials = optuna.load_study(study_name="autotune", storage=f"sqlite:///{run / 'study.db'}").trials
    numbered = {t.user_attrs["report_trial"]: t for t in trials if "report_trial" in t.user_attrs}
    assert sorted(numbered) == list(range(1, len(results) + 1))
    for number, result in enumerate(results, 1):
        trial = numbered[number]
        assert {k: trial.user_attrs[k] for k in KNOBS} == result.config.to_dict()
        if number > FIRST:  # written after the change: values, failures PRUNED
            assert {k: trial.params[k] for k in KNOBS} == result.config.to_dict()
            budget = RunDir(run).read_settings().memory_budget_bytes
            assert trial.state == (optuna.trial.TrialState.COMPLETE if result.fits(budget)
                                   else optuna.trial.TrialState.PRUNED)
        else:
            assert "micro_batch_index" in trial.params
