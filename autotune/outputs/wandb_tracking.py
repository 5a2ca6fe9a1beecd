"""Experiment tracking with Weights & Biases (the optional `wandb` extra), beside MLflow (autotune.outputs.tracking), in
the same layout: a sweep is a group whose parent is a run of job type `sweep` (the settings as config; at the end of
each session the recommendation, the status counts and the stop reason as summary, the outputs as files), and every
trial it launches is a run of job type `trial` in that group (its knobs as config, its throughput, tokens/s, peak
memory, step time, wall time and the predictions it launched on as summary, its status, phase, trial number and
error). Pruned configs never ran: counted on the parent, not logged one by one.

Offline where WANDB_MODE=offline (W&B's own variable) or no API key is configured (WANDB_API_KEY, `wandb login`'s
netrc entry, W&B's settings files; found as wandb.init would, without prompting and without the network): the runs
stay in `<run dir>/wandb/`, one line says so, and `wandb sync <run dir>/wandb/offline-run-*` uploads them later.
Resume: the parent's id and the trial numbers already logged are kept in the run directory (`wandb.json`, per
project), so a resumed sweep continues the same parent and logs only what is missing. A trial's run id is the same in
every session (`<parent id>-<trial>`): one a stop left half-logged is logged again into the same run, its partial
offline folder dropped first, so that `wandb sync` uploads one run per trial. A W&B failure mid-sweep stops
tracking for the session with one warning, never the sweep.
wandb is imported only when asked for (seconds).
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from autotune.values.config import ConfigError
from autotune.values.results import TRACKED_FIGURES, TrialResult

if TYPE_CHECKING:
    from autotune.search.rundir import RunFolder
    from autotune.values.settings import RunSettings

EXTRA = "wandb"  # pip install 'ds-autotune[wandb]'
STATE = "wandb.json"  # in the run directory: per project, the parent run's id and the trials logged
FORBIDDEN = "/\\#?%:"  # W&B's Settings.validate_project refuses these in a project name (and past 128 characters)


def check_project(project: str | None) -> None:
    """A W&B project name and the wandb package there to log to it; ConfigError naming what to do."""
    if project is None:
        return
    if not isinstance(project, str) or not project.strip() or len(project) > 128 or set(project) & set(FORBIDDEN):
        raise ConfigError(f"W&B project {project!r}: allowed a project name of at most 128 characters, none of "
                          f"{' '.join(FORBIDDEN)} (W&B refuses them)")
    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"--wandb (`wandb`) {project}: W&B tracking needs wandb: pip install 'ds-autotune[{EXTRA}]'")


class WandbTracker:
    """One sweep's group in a W&B project: its parent run (job type `sweep`) and a run per launched trial."""

    def __init__(self, project: str, run_dir: "RunFolder", group: str, parent_id: str, logged: set[int],
                 warn: Callable[[str], None], config: Mapping[str, Any] | None = None) -> None:
        self.project, self.run_dir, self.group, self.parent_id = project, run_dir, group, parent_id
        self.config = dict(config or {})  # the parent's: the sweep's settings
        self.logged = logged
        self.warn = warn
        self.broken: str | None = None
        self.offline: str | None = None  # why the runs are written offline (None: online)

    @classmethod
    def open(cls, project: str, run_dir: "RunFolder", settings: "RunSettings", history: Sequence[TrialResult], *,
             warn: Callable[[str], None], name: str | None = None) -> "WandbTracker":
        """The group of `run_dir` in `project` (continued if `wandb.json` names it, else started; its parent run is
        written at `finish`, with the settings as config), every launched trial of `history` not yet logged logged
        now."""
        import secrets

        state = _read_state(run_dir)
        entry = state.get(project) or {}
        group = entry.get("group") or name or run_dir.path.name
        parent_id = entry.get("parent_id") or secrets.token_hex(4)  # W&B's run ids: 8 lowercase characters
        state[project] = {"group": group, "parent_id": parent_id, "logged": sorted(entry.get("logged", []))}
        run_dir.write_json(STATE, state)
        tracker = cls(project, run_dir, group, parent_id, set(state[project]["logged"]), warn, settings.to_dict())
        tracker.offline = offline_reason()
        if tracker.offline is not None:
            warn(f"W&B project {project} runs offline ({tracker.offline}): its runs stay in {run_dir.path / 'wandb'}/;"
                 f" after `wandb login` (or with WANDB_API_KEY set), {sync_command(run_dir)} uploads them")
        tracker._drop_partial()
        for number, result in enumerate(history, 1):  # a session without tracking, or a crash in between
            if "trial" not in result.extra:
                result = replace(result, extra={**result.extra, "trial": number})
            tracker.trial(result, late=True)
        return tracker

    def trial_id(self, number: int) -> str:
        """A trial's run id, the same in every session: a trial interrupted while it was logged is logged again
        into the same run (resume="allow"), never beside it as a second one."""
        return f"{self.parent_id}-{number}"

    def _drop_partial(self) -> None:
        """Remove the offline folders of this group's trials not logged (an earlier session stopped while it
        logged them, some without even a run record): their trials are logged again now, in a folder of the same
        run id, so `wandb sync` uploads one complete run per trial. Online, the run itself is continued."""
        ids = {self.trial_id(n) for n in self.logged}
        for folder in (self.run_dir.path / "wandb").glob(f"offline-run-*-{self.parent_id}-*"):
            run_id = folder.name.split("-", 3)[-1]  # offline-run-<YYYYMMDD_HHMMSS>-<run id>
            if run_id.startswith(f"{self.parent_id}-") and run_id not in ids and not folder.is_symlink():
                shutil.rmtree(folder, ignore_errors=True)

    def _init(self, job: str, name: str, run_id: str | None, config: Mapping[str, Any]) -> Any:
        import wandb

        return wandb.init(project=self.project, group=self.group, job_type=job, name=name, id=run_id,
                          resume="allow", config=dict(config), dir=str(self.run_dir.path), reinit="create_new",
                          settings=wandb.Settings(silent=True, console="off"),
                          mode="offline" if self.offline else None)  # offline: never W&B's login prompt

    def trial(self, result: TrialResult, late: bool = False) -> None:
        """Log a launched trial as a run of the group, once (pruned configs are counted at `finish`); `late`: it ran
        in an earlier session (its run's times are when it was logged: trials.jsonl keeps no clock time)."""
        number = result.extra.get("trial")
        if self.broken or result.status == "pruned" or not isinstance(number, int) or number in self.logged:
            return
        try:
            run = self._init("trial", f"#{number} {result.config.label()}", self.trial_id(number),
                             result.config.to_dict())
            line = result.to_dict()
            run.summary.update({key: line[key] for key in TRACKED_FIGURES if line.get(key) is not None})
            run.summary.update({"trial": number, "status": result.status, "phase": result.phase,
                                "backend": result.backend, **({"error": result.error} if result.error else {}),
                                **({"repeat_of": result.repeat_of} if result.repeat_of is not None else {}),
                                **({"logged_late": True} if late else {})})
            run.finish(exit_code=0 if result.ok else 1)
        except Exception as err:  # noqa: BLE001  a tracker that fails must not end a sweep of real trials
            self._broke(err)
            return
        self.logged.add(number)
        self._save()

    def finish(self, best: TrialResult | None, summary: Mapping[str, Any], files: Sequence[Path], verdict: str,
               stop_reason: str) -> None:
        """The recommendation, the status counts, the stop reason and the outputs on the parent run."""
        if self.broken:
            return
        values: dict[str, Any] = {f"trials_{status}": n for status, n in summary.get("status_counts", {}).items()}
        values.update(trials_recorded=int(summary.get("trials") or 0), verdict=verdict, stop_reason=str(stop_reason))
        if summary.get("convergence"):
            values["chance_of_better"] = summary["convergence"]["chance_of_better"]
        if best is not None:
            values.update({f"best_{key}": getattr(best, key) for key in
                           ("throughput_samples_per_s", "tokens_per_s", "peak_memory_bytes", "step_time_s")})
            values.update({f"best.{knob}": value for knob, value in best.config.to_dict().items()},
                          **{"best.config": best.config.label(), "best.trial": summary.get("best_trial_index")})
        self._drop_partial()  # a trial this session stopped logging (Ctrl-C): not among the folders to sync
        try:
            parent = self._init("sweep", f"sweep {self.group}", self.parent_id, self.config)
            parent.summary.update(values)
            for path in map(Path, files):
                if path.is_file():  # a copy in the run's files/: W&B's symlink would show the next session's
                    copy = Path(parent.dir) / (path.relative_to(self.run_dir.path)  # outputs, and dangle once synced
                                               if path.is_relative_to(self.run_dir.path) else path.name)
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, copy)
                    parent.save(str(copy), base_path=parent.dir, policy="now")
            parent.finish(exit_code=1 if str(stop_reason) == "interrupted" else 0)
        except Exception as err:  # noqa: BLE001  as in trial(): the outputs are in the run directory anyway
            self._broke(err)

    def _save(self) -> None:
        state = _read_state(self.run_dir)
        state[self.project] = {"group": self.group, "parent_id": self.parent_id, "logged": sorted(self.logged)}
        self.run_dir.write_json(STATE, state)

    def _broke(self, err: Exception) -> None:
        if self.broken is None:
            self.broken = _one_line(err)
            self.warn(f"W&B tracking stopped for this session (project {self.project}): {self.broken}; the trials "
                      "are recorded in the run directory, and --resume logs those missing")


def offline_reason() -> str | None:
    """Why W&B runs are written offline: "WANDB_MODE=offline" (W&B's settings say offline: its variable, or a
    settings file), "no API key configured", or None (online, or disabled: WANDB_MODE=disabled logs nothing)."""
    import os

    try:
        from wandb.sdk import wandb_setup

        settings = wandb_setup.singleton().settings  # W&B's own: its variables and settings files
        if settings._noop:
            return None
        if settings._offline:
            return f"WANDB_MODE={settings.mode}"
    except (ImportError, AttributeError):  # another wandb than this knows: its variable alone
        mode = os.environ.get("WANDB_MODE", "").strip().lower()
        if mode in ("offline", "dryrun"):
            return f"WANDB_MODE={mode}"
        if mode == "disabled":
            return None
        settings = None
    return None if _has_credentials(settings) else "no API key configured"


def _has_credentials(settings: Any) -> bool:
    """Whether wandb.init would find credentials without prompting, as wandb looks for them (WANDB_API_KEY or
    WANDB_IDENTITY_TOKEN_FILE, the netrc entry of W&B's host, an api_key setting), never asking the server."""
    import os

    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk.lib import wbauth
    except ImportError:  # a wandb before wbauth: its variables and settings (no key found: offline, nothing lost)
        pass
    else:
        try:
            host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
            return wbauth.authenticate_session(host=host, source="autotune", prompt=False,
                                               update_session=False) is not None
        except AuthenticationError:  # a key there, in a form W&B refuses: wandb.init names it (tracking stops)
            return True
        except (AttributeError, TypeError):  # another wbauth than this knows
            pass
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    return settings is not None and bool(getattr(settings, "api_key", None))


def where(run_dir: "RunFolder", project: str) -> str:
    """Where a sweep's W&B runs went, for its last lines: the project and group, and for offline runs the folder
    and the command that uploads them."""
    group = (_read_state(run_dir).get(project) or {}).get("group", run_dir.path.name)
    text = f"project {project}, group {group}"
    if offline_reason() is not None:
        text += f", offline in {run_dir.path / 'wandb'}/ ({sync_command(run_dir)} uploads them)"
    return text


def sync_command(run_dir: "RunFolder") -> str:
    """The command that uploads a sweep's offline W&B runs."""
    return f"`wandb sync {run_dir.path / 'wandb'}/offline-run-*`"


def _read_state(run_dir: "RunFolder") -> dict[str, Any]:
    data = run_dir.read_json(STATE)
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) and isinstance(v.get("parent_id"), str)
                                             and isinstance(v.get("logged", []), list) for v in data.values()):
        raise ConfigError(f"{run_dir.path / STATE}: expected an object of W&B project -> {{group, parent_id, logged}}; "
                          "remove it to start a new group")
    return data


def _one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0] if text else type(err).__name__
