"""The script backend: each trial runs the user's own training script, unchanged, on N ranks through
autotune.trials.runner (as the deepspeed backend runs the built-in worker), with autotune.script's shim applying
the trial's config at `deepspeed.initialize` and measuring the engine the script gets back.

Results are those of the deepspeed backend (same report keys, same TrialResult extras), plus:
- `script_model`: what the shim learned about the model (parameter count, layers, hidden, ..., the
  sequence length and micro-batch of the first batch, the checkpointing switch), also for a failed trial
  whenever the script got as far as `deepspeed.initialize`;
- `script_verdict`: for a failure caused by the script whatever the config (autotune.script.shim.VERDICTS),
  which the tuner acts on by stopping after that trial (`fatal`);
- `global_batch`: the samples per optimizer step the trial ran (its throughput counts those);
- for a trial that failed after `deepspeed.initialize`, what its steps did before (steps_applied, loss_first, ...,
  the steps measured: the rank's report, or for a trial that ran out of time its last step's event) and the
  failure's signature (autotune.script.alike.FAILURE): a failure a trial of another config had too, none having run,
  is the script's own and stops the sweep (`fails_alike_after_initialize`, autotune.script.alike: the rule);
- `tokens_per_s`: samples x the sequence length of the script's first batch; none seen (a model without one, an
  MLP): tokens are samples, as the estimator's shape of it has them (a sequence of 1).
With `keep_script_batch` (the tuner does not know the script's global batch yet: its first trial, or
`autotune trial --script` without --global-batch) a trial runs the global batch the script asks for
(autotune.script.batch), not the workload's; `script_model["batch"]` says which it was and where it was read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.trials.ops import PREFLIGHT_TIMEOUT_S
from autotune.values.config import Config, ConfigError
from autotune.values.dsconfig import DsOptions
from autotune.prediction.estimate import Calibration, Estimate
from autotune.values.hardware import Hardware
from autotune.values.results import TrialResult, iter_results
from autotune.trials.runner import RunOutcome
from autotune.script import alike
from autotune.script.shim import (FRAMEWORKS_ENV, KEEP_SCRIPT_BATCH, MICRO_BATCH_FIX, MODEL_FILE, SCRIPT_CWD,
                                  USER_CONFIG_FILE)
from autotune.worker.measure import MeasureSettings
from autotune.worker.protocol import read_events, write_json_atomic
from autotune.worker.training import TRAINING_EVIDENCE
from autotune.values.workload import Workload

SCRIPT_FILE = "script.json"  # in a script-mode run directory (autotune.outputs.script writes it)

SHIM = "autotune.script"


@dataclass(frozen=True)
class Script:
    """The user's training script and its arguments, as given on the command line."""

    path: str
    args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not Path(self.path).is_file():
            raise ConfigError(f"--script (TuneSpec.for_script's script) {self.path!r}: no such file")
        if not str(self.path).endswith(".py"):
            raise ConfigError(f"--script (TuneSpec.for_script's script) {self.path!r}: expected a Python file (.py)")

    @property
    def absolute(self) -> str:
        return str(Path(self.path).resolve())

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.absolute, "args": list(self.args)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Script":
        return cls(data["path"], tuple(data.get("args", ())))


class ScriptBackend(DeepSpeedBackend):
    name = "script"

    def __init__(self, script: Script, workload: Workload, memory_budget_bytes: int | None = None,
                 hardware: Hardware | None = None, ds_options: DsOptions = DsOptions(),
                 logs_dir: str | Path = "runs/logs", timeout_s: float = 600.0,
                 measure: MeasureSettings = MeasureSettings(), *, calibration: Calibration = Calibration(),
                 shape_known: bool = True, keep_script_batch: bool = False,
                 env: Mapping[str, str] | None = None, cwd: str | None = None, ranks_ahead: bool = True,
                 in_sequence: bool = False, frameworks: Sequence[str] = (),
                 micro_batch_fix: str | None = None) -> None:
        # `frameworks`: those the script imported in its first trial, which ranks started ahead import too;
        # `micro_batch_fix`: how the command takes another micro-batch (`autotune trial`'s --micro-batch), for the
        # advice of a micro-batch that cannot keep the script's global batch (default: the sweep's space)
        env = {**(env or {}), **({FRAMEWORKS_ENV: ",".join(frameworks)} if frameworks else {})}
        super().__init__(workload, memory_budget_bytes, hardware, ds_options, logs_dir, timeout_s, measure,
                         calibration=calibration, env=env, ranks_ahead=ranks_ahead, in_sequence=in_sequence)
        self.script = script
        self.shape_known = shape_known  # False: `workload.model` is a placeholder until a trial inspects it
        self.keep_script_batch = keep_script_batch  # True: `workload.global_batch` too, the script's is run
        self.cwd = cwd  # the ranks' working directory (a Ray trial: the shipped copy's); None: this process's
        self.micro_batch_fix = micro_batch_fix
        self.launch = replace(self.launch, module=SHIM)
        self._ran: list[TrialResult] = []  # this backend's trials, for the rule of failures alike (autotune.script.alike)

    def run(self, config: Config) -> TrialResult:
        """The trial; one that failed as a trial of another config did (autotune.script.alike) gets that verdict and
        stops the sweep (`fatal`)."""
        result = super().run(config)
        verdict = alike.same_failure(self._history(), result)
        self._ran.append(result)
        if verdict is not None:
            name, _, why = verdict.partition(": ")
            result = replace(result, extra={**result.extra, "script_verdict": name, alike.WHY: why})
            self.fatal = self.fatal or verdict
            log_dir = result.extra.get("log_dir")
            if log_dir and Path(log_dir).is_dir():  # the trial's own copy of its result (DeepSpeedBackend.run)
                write_json_atomic(Path(log_dir) / "result.json", result.to_dict())
        return result

    def _history(self) -> list[TrialResult]:
        """The trials before this one: the run directory's record beside logs/ (a Ray trial's backend runs one
        trial), and this backend's own not recorded there (yet, or at all: `autotune trial`). A record that cannot
        be read is no history (the rule then stops nothing)."""
        try:
            recorded = list(iter_results(self.logs_dir.parent / "trials.jsonl"))  # autotune.search.rundir.TRIALS
        except (ConfigError, OSError):
            recorded = []
        seen = {r.extra.get("log_dir") for r in recorded}
        return recorded + [r for r in self._ran if r.extra.get("log_dir") not in seen]

    def predict(self, config: Config):
        return super().predict(config) if self.shape_known else None

    def preflight(self, configs: Iterable[Config], say: Callable[[str], None], *,
                  timeout_s: float = PREFLIGHT_TIMEOUT_S) -> tuple[str, ...]:
        """None: the ops a trial loads depend on the script's own DeepSpeed config, which its first trial shows
        (a crash loading them stops the sweep at its second, autotune.drivers.loop)."""
        return ()

    def prepare(self, config: Config, say: Callable[[str], None]) -> None:
        """Nothing before a trial, as `preflight`: the script's first trial shows what it loads."""

    def _measure_for(self, predicted: Estimate | None) -> MeasureSettings:
        # The estimator does not see the script's own loop (data, logging): only the fastest step measured so
        # far says that a config is far behind.
        return super()._measure_for(None)

    def _trial_extra(self) -> dict[str, Any]:
        return {"script": self.script.absolute}

    def _spec_extra(self) -> dict[str, Any]:
        return {"script": self.script.absolute, "script_args": list(self.script.args),
                KEEP_SCRIPT_BATCH: self.keep_script_batch, **({SCRIPT_CWD: self.cwd} if self.cwd else {}),
                **({MICRO_BATCH_FIX: self.micro_batch_fix} if self.micro_batch_fix else {})}

    def _read_outcome(self, log_dir: Path, outcome: RunOutcome, extra: dict[str, Any]) -> None:
        model = read_json(log_dir / MODEL_FILE)
        if model:
            extra["script_model"] = model
            if model.get("global_batch"):
                extra["global_batch"] = model["global_batch"]
        verdict = next((r.get("verdict") for r in outcome.reports if r and r.get("verdict")), None)
        if verdict:
            extra["script_verdict"] = verdict
            self.fatal = f"{verdict}: {outcome.error}"  # the script, not the config, failed: no trial helps
        if outcome.status != "ok":
            self._failed(log_dir, outcome, extra)

    def _failed(self, log_dir: Path, outcome: RunOutcome, extra: dict[str, Any]) -> None:
        """A failed trial's record keeps what its steps did before the failure (the rank's report; a trial that ran
        out of time, its rank 0's last step event) and the failure's signature (autotune.script.alike)."""
        report = next((r for r in outcome.reports if r and r.get("steps_applied") is not None), None)
        events = read_events(log_dir, 0) if outcome.status == "timeout" else []
        last = next((e for e in reversed(events) if isinstance(e.get("steps"), int)), None)
        done = report or last or {}
        extra.update({key: done[key] for key in TRAINING_EVIDENCE if done.get(key) is not None})
        if report is not None and report.get("step_times_s"):
            extra.update(step_times_s=report["step_times_s"], steps_measured=len(report["step_times_s"]))
        if outcome.status == "crash":
            signature = next((s for s in map(alike.crash_of, outcome.reports) if s is not None), None)
        elif outcome.status == "timeout":
            signature = alike.stall_of(events, outcome.launch_time + outcome.wall_time_s)
        else:
            signature = None
        if signature is not None:
            extra[alike.FAILURE] = signature

    def _seq_len(self, extra: Mapping[str, Any]) -> int:
        """The script's first batch's sequence length; a model seen without one (an MLP: no token ids) has tokens as
        samples, never the placeholder workload's sequence (autotune.outputs.script.placeholder)."""
        model = extra.get("script_model")
        if model:
            return int(model.get("seq_len") or 1)
        return self.workload.model.seq_len if self.shape_known else 1

    def _global_batch(self, extra: Mapping[str, Any]) -> int:
        return extra.get("global_batch") or self.workload.global_batch


def read_script_info(run_dir: str | Path) -> dict[str, Any]:
    """A script-mode run directory's `script.json`: the script, its arguments, the model learned, the notes."""
    data = read_json(Path(run_dir) / SCRIPT_FILE)
    if data is None:
        raise ConfigError(f"{run_dir} has no {SCRIPT_FILE}: not a script-mode sweep")
    return data


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def user_config(result: TrialResult) -> dict[str, Any] | None:
    """The DeepSpeed config the script passed, before the trial's keys, as recorded in the trial's logs."""
    log_dir = result.extra.get("log_dir")
    return read_json(Path(log_dir) / USER_CONFIG_FILE) if log_dir else None
