"""Experiment tracking with MLflow (the optional `tracking` extra: mlflow-skinny).

A sweep is one parent run; every trial it launches is a nested run under it: params are the config's knobs,
metrics its throughput, tokens/s, peak memory, step time, wall time and the predictions it launched on, tags its
status, error, trial number (the report's) and phase (search or confirm). Pruned configs never ran: they are
counted on the parent, not logged one by one (each stays in trials.jsonl and report.md). At the end of each
session the parent gets the recommendation: the best config's knobs as `best.*` tags (tags, not params: MLflow
params are immutable, and a resumed sweep may find a better config), its throughput, peak and step time as
`best_*` metrics, the status counts, and the outputs (best_*.json, summary.json, report.md, plots) as artifacts.

The store is any MLflow tracking URI; `local_uri(folder)` is the default when tracking is asked for without
one: `sqlite:///<folder>/mlflow.db`, with artifacts in `<folder>/mlartifacts` (MLflow 3's plain file store
refuses to start unless MLFLOW_ALLOW_FILE_STORE=true, so the local default is SQLite).

Resume: the parent's id is kept in the run directory (`mlflow.json`, per store), so a resumed sweep continues
the same parent run; trials are matched by their number (tag `autotune.trial`), so none is logged twice and
any recorded but not yet logged (a crash in between, a session without tracking) are logged on the next start.
A child is created with its tags (nested from the start); one left half-logged (not FINISHED or FAILED) by a stop
is deleted, as the session ends (Ctrl-C) or by the next one (SIGKILL), and its trial logged again.
A store that fails mid-sweep does not stop the sweep: tracking stops for the session with one warning.

A tracking server (http(s)://) is asked once, within `PROBE_TIMEOUT_S`, before the sweep opens it
(`check_reachable`): one that refuses the connection or does not answer is one line, not minutes of MLflow's
retries; once it has answered, every call keeps MLflow's retries (a server that blips overnight loses nothing).

mlflow is imported only when tracking is on (it takes seconds to import).
"""

from __future__ import annotations

import importlib.util
import math
import time
import logging
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol, Sequence

from autotune.backends.replay import searched_space
from autotune.values.config import ConfigError
from autotune.values.results import TRACKED_FIGURES, TrialResult
from autotune.values.settings import masked

if TYPE_CHECKING:
    from autotune.search.rundir import RunFolder
    from autotune.values.settings import RunSettings

EXTRA = "tracking"  # pip install 'ds-autotune[tracking]'
STATE = "mlflow.json"  # in the run directory: the parent run of each store
LOCAL_DB = "mlflow.db"
LOCAL_ARTIFACTS = "mlartifacts"
DEFAULT_EXPERIMENT = "ds-autotune"  # MLFLOW_EXPERIMENT_NAME, MLflow's own variable, names another
TRIAL_TAG = "autotune.trial"  # a child run's trial number (1-based, the report's)
PARENT_TAG = "mlflow.parentRunId"  # what makes a run nested, in MLflow's UI and search
TAG_LIMIT = 5000  # MLflow caps tag values (8000 characters in MLflow 3); an error text is cut to this
PROBE_TIMEOUT_S = 5.0  # a tracking server's first answer, before the sweep: connect, then the response's start


class Tracker(Protocol):
    """What a sweep tells experiment tracking: each result as it is recorded (drivers/sweep.py), and the
    outputs once the session ends (api.close_run, once per sweep of the runner)."""

    def trial(self, result: TrialResult) -> None: ...

    def finish(self, best: TrialResult | None, summary: Mapping[str, Any], files: Sequence[Path], verdict: str,
               stop_reason: str) -> None: ...


class NoTracking:
    """Tracking off: hears everything, logs nothing."""

    def trial(self, result: TrialResult) -> None:
        pass

    def finish(self, best: TrialResult | None, summary: Mapping[str, Any], files: Sequence[Path], verdict: str,
               stop_reason: str) -> None:
        pass


NO_TRACKING = NoTracking()


class Trackers:
    """Several trackers hearing the same sweep (MLflow and W&B)."""

    def __init__(self, trackers: tuple[Tracker, ...]) -> None:
        self.trackers = trackers

    def trial(self, result: TrialResult) -> None:
        for tracker in self.trackers:
            tracker.trial(result)

    def finish(self, best: TrialResult | None, summary: Mapping[str, Any], files: Sequence[Path], verdict: str,
               stop_reason: str) -> None:
        for tracker in self.trackers:
            tracker.finish(best, summary, files, verdict, stop_reason)


def local_uri(folder: str | Path) -> str:
    """The default store: a SQLite database in `folder` (the run or sweep directory)."""
    return f"sqlite:///{(Path(folder) / LOCAL_DB).resolve()}"


def resolve_uri(uri: str | bool | None, folder: str | Path) -> str | None:
    """The tracking URI a sweep in `folder` logs to: None or False, none; True, the local default; a string,
    itself. ConfigError for anything else, or when mlflow is not installed."""
    if uri is None or uri is False:
        return None
    check_uri(uri)
    return local_uri(folder) if uri is True else absolute_sqlite(str(uri).strip())


# The pip name of the database driver SQLAlchemy imports for a scheme (postgresql, mysql, mssql), by module name
DB_DRIVERS = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
              "pymysql": "pymysql", "pymssql": "pymssql", "pyodbc": "pyodbc"}


def absolute_sqlite(uri: str) -> str:
    """A SQLite URI with a relative path (sqlite:///rel.db) made absolute: resumed from another directory, the
    sweep would log into a second database and lose its parent run. Other URIs as they are."""
    scheme, sep, rest = uri.partition(":///")
    if not sep or scheme.split("+", 1)[0].lower() != "sqlite" or rest.startswith("/") or not rest \
            or rest.startswith(":memory:"):
        return uri
    path, query, params = rest.partition("?")
    return f"{scheme}:///{Path(path).resolve()}{query}{params}"


def check_uri(uri: str | bool | None) -> None:
    """What can be checked before anything is written: a non-empty URI (or True/None/False) and mlflow
    installed. Whether the store answers is found when the sweep opens it."""
    if uri is None or uri is False:
        return
    if not (uri is True or (isinstance(uri, str) and uri.strip() and uri.isprintable())):
        raise ConfigError(f"MLflow tracking URI {str(uri)[:80]!r}: allowed {_ALLOWED} or True for "
                          "sqlite:///<run dir>/mlflow.db")
    if isinstance(uri, str):
        _check_scheme(uri.strip())
    check_available()


_ALLOWED = "an MLflow tracking URI (sqlite:///PATH, http(s)://SERVER, postgresql://..., mysql://..., databricks)"
_SCHEMES = {"", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "databricks-uc", "uc"}


def _check_scheme(uri: str) -> None:
    """Refuse, before the sweep starts, a scheme MLflow does not know (nor a plugin adds) and a plain file
    store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true."""
    import os
    from importlib.metadata import entry_points
    from urllib.parse import urlparse

    if uri.lower() in ("databricks", "databricks-uc", "uc"):  # MLflow's names of a Databricks workspace
        return
    scheme = urlparse(uri).scheme.lower()
    base = scheme.split("+", 1)[0]  # postgresql+psycopg2://...
    shown = masked(uri) if "@" in uri else uri
    if len(scheme) == 1:  # a Windows drive letter: a path
        base = ""
    if base not in _SCHEMES and base not in {e.name for e in entry_points(group="mlflow.tracking_store")}:
        raise ConfigError(f"MLflow tracking URI {shown!r}: unknown scheme {scheme!r}: allowed {_ALLOWED}")
    database = _sqlite_path(uri)
    if database is not None and database.is_dir():  # MLflow would retry opening it for a minute and a half
        raise ConfigError(f"MLflow tracking URI {shown!r}: {database} is a directory: allowed sqlite:///PATH to "
                          "a database file (created if missing)")
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("1", "true", "yes")
    if base in ("", "file") and not allowed:
        raise ConfigError(f"MLflow tracking URI {shown!r}: a file store, which MLflow 3 refuses unless "
                          "MLFLOW_ALLOW_FILE_STORE=true; use sqlite:///PATH/mlflow.db (or --mlflow: one in the run "
                          "directory)")


def check_available() -> None:
    """ConfigError naming the extra to install when mlflow is missing."""
    try:
        found = importlib.util.find_spec("mlflow") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        found = False
    if not found:
        raise ConfigError(_MISSING)


_MISSING = f"MLflow tracking needs mlflow: pip install 'ds-autotune[{EXTRA}]' (it installs mlflow-skinny)"


@contextmanager
def tracked(uri: str | None, run_dir: "RunFolder", settings: "RunSettings", history: Sequence[TrialResult],
            warn: Callable[[str], None], name: str | None = None, wandb: str | None = None) -> Iterator[Tracker]:
    """The sweep's tracker for one session: MLflow at `uri` and W&B project `wandb` (autotune.outputs.wandb_tracking),
    either, both or none (NO_TRACKING); each one's parent run opened or continued, the history not yet logged logged
    now. MLflow's parent ends FINISHED (KILLED when the sweep was interrupted, or on Ctrl-C), FAILED on an error."""
    # MLflow first: its open is the one that refuses (a store it cannot reach), before W&B writes its state
    mlflow = None if uri is None else MlflowTracker.open(uri, run_dir, settings, history, warn=warn, name=name)
    try:
        trackers: list[Tracker] = [] if mlflow is None else [mlflow]
        if wandb is not None:
            from autotune.outputs.wandb_tracking import WandbTracker

            trackers.append(WandbTracker.open(wandb, run_dir, settings, history, warn=warn, name=name))
        yield trackers[0] if len(trackers) == 1 else Trackers(tuple(trackers)) if trackers else NO_TRACKING
    except KeyboardInterrupt:
        if mlflow is not None:
            mlflow.end("KILLED")
        raise
    except BaseException:
        if mlflow is not None:
            mlflow.end("FAILED")
        raise
    if mlflow is not None:
        mlflow.end(mlflow.final_status)


class MlflowTracker:
    """One sweep's parent run in an MLflow store and the trials logged under it."""

    def __init__(self, client: Any, uri: str, experiment_id: str, run_id: str, logged: set[int],
                 warn: Callable[[str], None]) -> None:
        self.client = client
        self.uri = uri
        self.experiment_id = experiment_id
        self.run_id = run_id
        self.logged = logged  # trial numbers with a child run
        self.warn = warn
        self.broken: str | None = None  # why tracking stopped for this session
        self.final_status = "FINISHED"  # the parent's at the end of the session (KILLED: interrupted)
        self.partial: str | None = None  # the child run being logged (an interrupt can leave it half-logged)

    @classmethod
    def open(cls, uri: str, run_dir: "RunFolder", settings: "RunSettings", history: Sequence[TrialResult], *,
             warn: Callable[[str], None], name: str | None = None) -> "MlflowTracker":
        """The parent run of `run_dir` in the store at `uri` (continued if `mlflow.json` names one that still
        exists, else created), with every launched trial of `history` not yet logged logged now. ConfigError
        when the store cannot be opened."""
        state = _read_state(run_dir)
        key = masked(uri) or uri
        try:
            with _mlflow_warnings_only():  # "Creating initial MLflow database tables...": not the sweep's news
                client = _client(uri)
                parent = _existing_parent(client, state.get(key))
                if parent is None:
                    experiment_id = _experiment(client, uri)
                    parent = client.create_run(experiment_id, run_name=name or run_dir.path.name,
                                               tags=_parent_tags(run_dir, settings))
                    client.log_batch(parent.info.run_id, params=_params(_parent_params(settings)))
                    state[key] = {"experiment_id": experiment_id, "run_id": parent.info.run_id}
                    run_dir.write_json(STATE, state)
                else:
                    client.update_run(parent.info.run_id, status="RUNNING")
                experiment_id, run_id = parent.info.experiment_id, parent.info.run_id
                logged = _logged_trials(client, experiment_id, run_id)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001  MLflow's, SQLAlchemy's and requests' errors alike
            driver = DB_DRIVERS.get(err.name or "", err.name) if isinstance(err, ModuleNotFoundError) else None
            hint = f": the store's database driver is not installed here (pip install '{driver}')" if driver else ""
            raise ConfigError(f"MLflow tracking URI {key}: {_one_line(err)}{hint}") from None
        tracker = cls(client, uri, experiment_id, run_id, logged, warn)
        for number, result in enumerate(history, 1):  # a session without tracking, or a crash in between
            if "trial" not in result.extra:  # a run directory from before trials were numbered
                result = replace(result, extra={**result.extra, "trial": number})
            tracker.trial(result, late=True)
        return tracker

    def trial(self, result: TrialResult, late: bool = False) -> None:
        """Log a launched trial as a child run, once (pruned configs are counted at `finish`); `late`: it ran in
        an earlier session, tagged `logged_late` (its run's times are when it was logged: trials.jsonl keeps no
        clock time)."""
        number = result.extra.get("trial")
        if self.broken or result.status == "pruned" or not isinstance(number, int) or number in self.logged:
            return
        try:
            self._log_trial(result, number, late)
        except Exception as err:  # noqa: BLE001  a store that fails must not end a sweep of real trials
            self._broke(err)
            return
        self.logged.add(number)

    def finish(self, best: TrialResult | None, summary: Mapping[str, Any], files: Sequence[Path], verdict: str,
               stop_reason: str) -> None:
        """The recommendation, the status counts and the outputs on the parent run."""
        if self.broken:
            return
        from mlflow.entities import RunTag

        if str(stop_reason) == "interrupted":
            self.final_status = "KILLED"
        now = _now_ms()
        step = int(summary.get("trials") or 0)
        values: dict[str, Any] = {f"trials_{status}": n for status, n in summary.get("status_counts", {}).items()}
        values["trials_recorded"] = step
        if summary.get("convergence"):  # the chance of a better config after the last search trial
            values["chance_of_better"] = summary["convergence"]["chance_of_better"]
        tags = {"verdict": verdict[:TAG_LIMIT], "stop_reason": str(stop_reason)}
        if best is not None:
            values.update({f"best_{key}": getattr(best, key) for key in
                           ("throughput_samples_per_s", "tokens_per_s", "peak_memory_bytes", "step_time_s")})
            tags.update({f"best.{knob}": str(value) for knob, value in best.config.to_dict().items()})
            tags["best.config"] = best.config.label()
            tags["best.trial"] = str(summary.get("best_trial_index"))
        try:
            self.client.log_batch(self.run_id, metrics=_metrics(values, now, step),
                                  tags=[RunTag(k, v) for k, v in tags.items()])
            for path in files:
                if Path(path).is_file():
                    folder = Path(path).parent.name
                    self.client.log_artifact(self.run_id, str(path), artifact_path=folder if folder == "plots" else None)
        except Exception as err:  # noqa: BLE001  as in trial(): the outputs are in the run directory anyway
            self._broke(err)

    def end(self, status: str) -> None:
        """Mark the parent run ended for this session (a resumed sweep sets it running again); a child left
        half-logged by Ctrl-C is deleted (the next session logs its trial: a child is complete or absent)."""
        try:
            if self.partial is not None and not self.broken:
                _delete_runs(self.client, [self.partial])
            self.client.set_terminated(self.run_id, status=status)
        except Exception as err:  # noqa: BLE001
            self._broke(err)

    def _log_trial(self, result: TrialResult, number: int, late: bool) -> None:
        end = _now_ms()
        tags = {PARENT_TAG: self.run_id, TRIAL_TAG: str(number), "status": result.status,
                "phase": result.phase, "backend": result.backend, **({"logged_late": "true"} if late else {})}
        if result.error:
            tags["error"] = result.error[:TAG_LIMIT]
        if result.repeat_of is not None:
            tags["repeat_of"] = str(result.repeat_of)
        # Created with its tags: never a top-level orphan. Until set_terminated ends it, it is RUNNING: a Ctrl-C
        # before then has `end` delete it, a SIGKILL the next session's _logged_trials; its trial is logged again.
        run = self.client.create_run(self.experiment_id, start_time=end - int(1000 * result.wall_time_s),
                                     run_name=f"#{number} {result.config.label()}", tags=tags)
        self.partial = run.info.run_id
        values = {key: result.to_dict().get(key) for key in TRACKED_FIGURES}
        self.client.log_batch(run.info.run_id, metrics=_metrics(values, end, 0),
                              params=_params(result.config.to_dict()))
        self.client.set_terminated(run.info.run_id, status="FINISHED" if result.ok else "FAILED", end_time=end)
        self.partial = None

    def _broke(self, err: Exception) -> None:
        if self.broken is None:
            self.broken = _one_line(err)
            self.warn(f"MLflow tracking stopped for this session ({self.uri and masked(self.uri)}): {self.broken}; "
                      "the trials are recorded in the run directory, and --resume logs those missing")


def check_reachable(uri: str, timeout_s: float | None = None) -> None:
    """ConfigError in one line, within about `timeout_s` (PROBE_TIMEOUT_S), when the tracking server of an
    http(s) URI refuses the connection, cannot be resolved or does not answer: MLflow would retry each call for
    minutes first. One plain request, no retries, honouring MLflow's TLS variables; any HTTP answer, whatever its
    status, counts as reachable (authentication and the rest are MLflow's, with its retries). Other stores: no-op."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.scheme.lower() not in ("http", "https"):
        return
    import requests
    from mlflow.environment_variables import (MLFLOW_TRACKING_CLIENT_CERT_PATH, MLFLOW_TRACKING_INSECURE_TLS,
                                              MLFLOW_TRACKING_SERVER_CERT_PATH)

    timeout = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    url = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + "/health", "", ""))  # MLflow's
    verify: bool | str = MLFLOW_TRACKING_SERVER_CERT_PATH.get() or not MLFLOW_TRACKING_INSECURE_TLS.get()
    start = time.monotonic()
    try:
        with requests.get(url, timeout=(timeout, timeout), stream=True, allow_redirects=False, verify=verify,
                          cert=MLFLOW_TRACKING_CLIENT_CERT_PATH.get()):
            return
    except requests.RequestException as err:
        slow = time.monotonic() - start >= timeout * 0.9  # a TLS handshake that timed out reads as an SSLError
        why = f"no answer within {timeout:g} s" if isinstance(err, requests.Timeout) or slow else _cause(err)
    raise ConfigError(f"MLflow tracking URI {masked(uri) or uri}: {why}; is the tracking server running (mlflow "
                      "server), and its address reachable from here?")


def _cause(err: BaseException) -> str:
    """The socket-level reason of a failed request, in a few words ("connection refused")."""
    import socket
    import ssl

    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        exc = todo.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, socket.gaierror):
            return f"cannot resolve its host ({exc.strerror or exc})"
        if isinstance(exc, ssl.SSLError):
            return f"TLS: {exc.reason or exc}"
        if isinstance(exc, TimeoutError):
            return "no answer"
        if isinstance(exc, OSError) and exc.strerror:
            return exc.strerror.lower()
        todo += [e for e in (*exc.args, getattr(exc, "reason", None), exc.__cause__, exc.__context__)
                 if isinstance(e, BaseException)]
    return _one_line(err)


def parent_of(run_dir: "RunFolder", uri: str) -> dict[str, str]:
    """The experiment and parent run ids of `run_dir` in the store at `uri` (empty before the first session)."""
    entry = _read_state(run_dir).get(masked(uri) or uri) or {}
    return {key: str(entry[key]) for key in ("experiment_id", "run_id") if key in entry}


@contextmanager
def _mlflow_warnings_only() -> Iterator[None]:
    """MLflow's logger at WARNING while a store is first opened (its INFO lines on creating or migrating a
    database), its level restored after. MLflow sets its logger's level when first imported: imported first."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        pass  # _client's one line says what to install
    logger = logging.getLogger("mlflow")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _client(uri: str) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ConfigError(_MISSING) from None
    return MlflowClient(tracking_uri=uri)


def _read_state(run_dir: "RunFolder") -> dict[str, Any]:
    data = run_dir.read_json(STATE)
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) and isinstance(v.get("run_id"), str)
                                             for v in data.values()):
        raise ConfigError(f"{run_dir.path / STATE}: expected an object of tracking URI -> {{experiment_id, run_id}}; "
                          "remove the file to start a new MLflow parent run")
    return data


def _existing_parent(client: Any, entry: Mapping[str, Any] | None) -> Any:
    """The parent run the state names, if the store still has it (not deleted)."""
    if not entry:
        return None
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(entry["run_id"])
    except MlflowException:  # gone (another store, or removed for good)
        return None
    return None if run.info.lifecycle_stage == "deleted" else run


def _experiment(client: Any, uri: str) -> str:
    import os

    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id
    return client.create_experiment(name, artifact_location=_artifact_location(uri))


def _artifact_location(uri: str) -> str | None:
    """Artifacts beside a SQLite store (MLflow's default is ./mlruns under whatever directory the tuner runs
    in); a server or database store keeps its own default."""
    database = _sqlite_path(uri)
    return None if database is None else (database.resolve().parent / LOCAL_ARTIFACTS).as_uri()


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:/// URI (None for another store, or SQLite in memory)."""
    if not uri.startswith("sqlite:///"):
        return None
    database = uri[len("sqlite:///"):].split("?", 1)[0]
    return None if not database or database == ":memory:" else Path(database)


LOGGED = ("FINISHED", "FAILED")  # a child's status once _log_trial ended it (FAILED: the trial failed)


def _logged_trials(client: Any, experiment_id: str, run_id: str) -> set[int]:
    """The trial numbers the parent has a child run for. A child still RUNNING (or killed) was interrupted while
    it was logged, in an earlier session (only one session holds the run directory): it is deleted, so that its
    trial is logged again, once, rather than left beside a second run."""
    numbers: set[int] = set()
    partial: list[str] = []
    token = None
    while True:
        page = client.search_runs([experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{run_id}'",
                                  max_results=1000, page_token=token)
        for run in page:
            number = run.data.tags.get(TRIAL_TAG, "")
            if run.info.status not in LOGGED:
                partial.append(run.info.run_id)
            elif number.isdigit():
                numbers.add(int(number))
        token = page.token
        if not token:
            break
    _delete_runs(client, partial)
    return numbers


def _delete_runs(client: Any, run_ids: Sequence[str]) -> None:
    """Half-logged child runs, deleted (MLflow's soft delete: out of searches, restorable in its UI)."""
    for run_id in run_ids:
        client.delete_run(run_id)


def _parent_tags(run_dir: "RunFolder", settings: "RunSettings") -> dict[str, str]:
    tags = {"autotune.run_dir": str(run_dir.path.resolve()), "model": settings.workload.model.name,
            "hardware": settings.hardware.name, "strategy": settings.strategy, "backend": settings.backend}
    if settings.storage:
        tags["autotune.optuna_storage"] = masked(settings.storage) or ""
    return tags


def _parent_params(settings: "RunSettings") -> dict[str, Any]:
    """What defines the sweep (a resumed sweep has the same: autotune.search.rundir.RunSettings.differences)."""
    w = settings.workload
    return {"model": w.model.name, "parameters": w.model.params, "layers": w.model.layers, "hidden": w.model.hidden,
            "seq_len": w.model.seq_len, "global_batch": w.global_batch, "gpus": w.gpus,
            "hardware": settings.hardware.name, "memory_budget_bytes": settings.memory_budget_bytes,
            "strategy": settings.strategy, "backend": settings.backend, "seed": settings.seed,
            "configs": len(searched_space(settings))}


def _params(values: Mapping[str, Any]) -> list[Any]:
    from mlflow.entities import Param

    return [Param(key, str(value)) for key, value in values.items()]


def _metrics(values: Mapping[str, Any], timestamp: int, step: int) -> list[Any]:
    from mlflow.entities import Metric

    return [Metric(key, float(value), timestamp, step) for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)]


def _now_ms() -> int:
    return int(time.time() * 1000)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."

