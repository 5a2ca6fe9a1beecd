"""Script mode as a third review found it: a script that fails the same way after deepspeed.initialize whatever the
config spent the whole budget (its records without the steps it took); an MLP's first trial reported 256x its tokens/s;
a sweep of `untrained` trials said "run more trials"; `trial --script`'s advice named a space it does not have; the
script's own precision changed silently; an MLP's attention "assumed" fused SDPA; and a report stopped by a verdict
spoke of a budget.

Unit-level: the backend's trials are the runner's outcomes without processes (as tests/test_log_numbering.py's)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import test_script_review
from autotune.api import own_outputs
from autotune.backends.script import Script, ScriptBackend
from autotune.commands import trial as trial_command
from autotune.drivers.stop import StopReason
from autotune.outputs import script as session
from autotune.outputs.report import no_fit_verdict, write_outputs
from autotune.script import alike
from autotune.script.batch import ScriptBatch
from autotune.script.inspect_model import describe, model_info, watch_attention
from autotune.script.shim import KEEP_SCRIPT_BATCH, MICRO_BATCH_FIX, ScriptVerdict, Shim
from autotune.search.rundir import RunDir
from autotune.trials.runner import LaunchOptions, RunOutcome
from autotune.values.config import Config
from autotune.values.dsconfig import ds_config
from autotune.values.results import TrialResult
from autotune.worker.measure import MeasureSettings
from autotune.worker.protocol import WorkerSpec, events_path, read_events, record_phase

BOOM = {"status": "crash", "error": "RuntimeError: boom after 3 steps", "exception": "RuntimeError", "phase": "measure",
        "rank": 0, "verdict": None, "initialized": True, "steps": 3, "site": "train.py:44 in <module>",
        "steps_applied": 3, "steps_skipped": 0, "loss_first": 1.5, "loss_last": 0.75, "step_times_s": [0.02, 0.03]}


def fake_backend(tmp_path: Path, outcome) -> ScriptBackend:
    """The script backend of a run directory whose trials' ranks end as `outcome(spec)` says (no process)."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    backend = ScriptBackend(Script(str(script)), session.placeholder(None, 1), 2**32, logs_dir=run / "logs",
                            shape_known=False, ranks_ahead=False)
    backend._cpu_info = {"brand_raw": "test"}  # no py-cpuinfo probe

    def start(spec: WorkerSpec, options: LaunchOptions) -> RunOutcome:
        status, error, report, launch, wall = outcome(spec)
        return RunOutcome(status, error, (report,), wall, launch, spec.log_dir, (), (1,))

    backend.start_ranks = start
    return backend


def crashing(report=BOOM):
    return lambda spec: ("crash", f"rank 0 in measure: {report['error']}", dict(report), time.time(), 1.0)


# -- 2: a failure of the script's own after deepspeed.initialize stops the sweep -----------------------------------

def test_two_configs_crashing_alike_after_their_steps_stop_the_sweep_with_the_scripts_words(tmp_path):
    backend = fake_backend(tmp_path, crashing())
    first = backend.run(Config(0, 1, 0, "fp32"))
    assert backend.fatal is None and first.status == "crash"
    # What it measured before the failure is kept (steps_applied was null)
    assert (first.extra["steps_applied"], first.extra["loss_first"], first.extra["loss_last"]) == (3, 1.5, 0.75)
    assert first.extra["steps_measured"] == 2 and first.extra[alike.FAILURE]["site"] == "train.py:44 in <module>"
    backend.run(Config(0, 1, 0, "fp32"))  # the same config again: nothing proven
    assert backend.fatal is None
    second = backend.run(Config(1, 2, 0, "fp32"))
    assert backend.fatal == ("fails_alike_after_initialize: RuntimeError: boom after 3 steps (train.py:44 in <module>), "
                             "after 3 optimizer steps, in z0 mb1 ck0 fp32 and z1 mb2 ck0 fp32 alike: the same failure "
                             "of the script whatever the config")
    assert second.extra["script_verdict"] == alike.VERDICT
    assert json.loads((Path(second.extra["log_dir"]) / "result.json").read_text())["script_verdict"] == alike.VERDICT


@pytest.mark.parametrize("other", [
    {"site": "train.py:50 in <module>"},  # raised elsewhere
    {"error": "RuntimeError: boom after 4 steps", "steps": 4},  # at another point of the loop
    {"steps": 0, "steps_applied": 0},  # before any optimizer step: what the engine runs first is the config's
    {"status": "oom"},
    {"verdict": "ignores_micro_batch"},
])
def test_a_failure_only_one_config_has_stops_nothing(tmp_path, other):
    backend = fake_backend(tmp_path, crashing())
    backend.run(Config(0, 1, 0, "fp32"))
    backend.start_ranks = fake_backend(tmp_path, crashing({**BOOM, **other})).start_ranks
    backend.run(Config(1, 2, 0, "fp32"))
    assert backend.fatal in (None, f"ignores_micro_batch: rank 0 in measure: {BOOM['error']}")
    assert backend.fatal is None or other.get("verdict")


def test_a_config_that_ran_means_the_failures_are_the_configs(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    run_dir.append(TrialResult(Config(2, 4, 0, "fp32"), "ok", throughput_samples_per_s=10.0, step_time_s=1.0,
                               wall_time_s=1.0, backend="script", extra={"trial": 1}))
    backend = fake_backend(tmp_path, crashing())
    backend.run(Config(0, 1, 0, "fp32"))
    backend.run(Config(1, 2, 0, "fp32"))
    assert backend.fatal is None


def stepping(gaps: list[float], end_after: float):
    """A trial that ran out of time: rank 0's events, initialize ending at t0, its optimizer steps `gaps` apart,
    killed `end_after` seconds after its last step."""
    def outcome(spec):
        t = t0 = 1_000_000.0
        lines = [{"t": t0 - 3, "phase": "initialize"}, {"t": t0, "phase": "warmup"}]
        for n, gap in enumerate(gaps, 1):
            t += gap
            lines.append({"t": t, "phase": "measure", "steps": n, "steps_applied": n, "loss_first": 2.0,
                          "loss_last": 2.0 - n / 10})
        events_path(spec.log_dir, 0).write_text("".join(json.dumps(line) + "\n" for line in lines))
        launch = t0 - 5
        return "timeout", "no result within the timeout of 45 s (rank 0 in measure)", None, launch, t + end_after - launch
    return outcome


def test_two_configs_that_stop_stepping_after_their_steps_stop_the_sweep(tmp_path):
    backend = fake_backend(tmp_path, stepping([0.1, 0.05], 40.0))
    first = backend.run(Config(0, 1, 0, "fp32"))
    assert first.status == "timeout" and backend.fatal is None
    assert first.extra["steps_applied"] == 2 and first.extra["loss_last"] == pytest.approx(1.8)  # kept from its events
    backend.run(Config(0, 2, 0, "fp32"))  # apart in micro-batch only: a layout's own stall would come alike
    assert backend.fatal is None
    backend.run(Config(2, 2, 0, "fp32"))
    assert backend.fatal is not None and backend.fatal.startswith(
        "fails_alike_after_initialize: the script stopped stepping after 2 optimizer steps in z0 mb1 ck0 fp32 and "
        "z2 mb2 ck0 fp32 alike (no optimizer step in the last 40 s before the trial's time ran out")


@pytest.mark.parametrize("a, b, apart", [
    (Config(3, 1, 0, "bf16"), Config(3, 4, 1, "bf16"), False),  # a ZeRO-3 checkpoint failing at step N: ZeRO-3's own
    (Config(1, 1, 0, "bf16"), Config(3, 1, 0, "bf16"), False),  # both partition
    (Config(0, 1, 0, "bf16"), Config(3, 1, 0, "bf16"), True),
    (Config(1, 1, 0, "bf16"), Config(1, 1, 0, "fp32"), True),
    (Config(1, 1, 0, "fp32"), Config(1, 1, 0, "fp32", offload_optimizer="cpu"), True),
])
def test_only_configs_apart_in_layout_prove_a_failure_the_scripts(a, b, apart):
    assert alike.apart(a, b) is apart and alike.apart(b, a) is apart


def test_a_slow_config_that_runs_out_of_time_is_no_stall(tmp_path):
    assert alike.stall_of([{"t": 0.0, "phase": "warmup"}, {"t": 20.0, "steps": 1}, {"t": 40.0, "steps": 2}], 45.0) is None
    backend = fake_backend(tmp_path, stepping([20.0, 20.0], 5.0))
    backend.run(Config(0, 1, 0, "fp32"))
    backend.run(Config(0, 2, 0, "fp32"))
    assert backend.fatal is None


def test_the_report_of_a_sweep_stopped_by_failures_alike_puts_the_verdict_first(tmp_path):
    run_dir, settings, _ = test_script_review.fatal_run(tmp_path)
    session.save(run_dir, Script(str(tmp_path / "train.py")), None, [], None)  # the first trial was no verdict
    error = "rank 0 in measure: RuntimeError: boom after 3 steps"
    run_dir.append(TrialResult(Config(1, 2, 0, "fp32"), "crash", wall_time_s=2.0, backend="script", error=error,
                               extra={"trial": 2, "script_verdict": alike.VERDICT,
                                      alike.WHY: "RuntimeError: boom after 3 steps (train.py:44 in <module>), after 3 "
                                                 "optimizer steps, in z0 mb1 ck0 fp32 (trial 1) and z1 mb2 ck0 fp32 "
                                                 "alike: the same failure of the script whatever the config"}))
    outputs = write_outputs(run_dir, settings, own=own_outputs(settings), stop_reason=StopReason.FATAL.value)
    report = (run_dir.path / "report.md").read_text()
    assert report.startswith("# ds-autotune report: train.py (script)\n\n**The script cannot be tuned as it is: "
                             "fails_alike_after_initialize: RuntimeError: boom after 3 steps (train.py:44 in <module>)")
    assert "no config avoids a failure the script has after its steps" in report.split("\n")[2]
    assert "run more trials" not in report and outputs.verdict.startswith("the script cannot be tuned as it is")


def shim_for(tmp_path, measure: MeasureSettings = MeasureSettings(), **extra) -> Shim:
    workload = session.placeholder(None, 1)
    config = Config(0, 1, 0, "fp32")
    return Shim(WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path), measure,
                           extra={KEEP_SCRIPT_BATCH: True, **extra}), 0)


def test_the_shim_reports_the_steps_before_a_failure_and_where_it_was_raised(tmp_path):
    shim = shim_for(tmp_path, MeasureSettings(warmup_steps=3))
    shim.accel = SimpleNamespace(synchronize=lambda: None)
    shim.engine = SimpleNamespace(skipped_steps=0, optimizer=None)
    shim.initialized, shim.loss, shim.last_phase = True, torch.tensor(1.25), "warmup"
    for _ in range(2):
        shim.optimizer_stepped(0)  # as measured_step calls it at a gradient-accumulation boundary
    [*_, last] = read_events(tmp_path, 0)  # each step's event: how far the script got, what its steps did
    assert (last["phase"], last["steps"], last["steps_applied"], last["loss_last"]) == ("warmup", 2, 2, 1.25)

    def train():
        raise RuntimeError("boom after 2 steps")

    try:
        train()
    except RuntimeError as err:
        report = shim.failure(err)
    assert (report["status"], report["steps"], report["steps_applied"], report["loss_first"]) == ("crash", 2, 2, 1.25)
    assert report["site"].startswith("test_script_review3.py:") and report["site"].endswith(" in train")
    assert alike.crash_of(report) == {"kind": "crash", "steps": 2, "exception": "RuntimeError",
                                      "error": "RuntimeError: boom after 2 steps", "site": report["site"]}


# -- 3: tokens/s of a model without a sequence length ----------------------------------------------------------

def test_a_first_trial_of_a_model_without_a_sequence_counts_tokens_as_samples(tmp_path):
    backend = fake_backend(tmp_path, crashing())
    assert backend.workload.model.seq_len == 256  # the placeholder's, before the script showed its model
    assert backend._seq_len({"script_model": {"class": "Sequential", "params": 2177}}) == 1
    assert backend._seq_len({"script_model": {"class": "GPT", "params": 2177, "seq_len": 128}}) == 128


# -- 6: every trial untrained ------------------------------------------------------------------------------------

def test_a_sweep_whose_every_trial_did_not_train_says_it_is_the_scripts_failure(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    model = {**model_info(nn.Linear(4, 1)), "via": "deepspeed.initialize"}
    settings, settled, notes = session.with_global_batch(test_script_review.script_settings(), model, None)
    error = "rank 0 in warmup: the loss was nan at applied step 1 of 4: the steps did not train"
    for n, (stage, micro) in enumerate(((0, 1), (0, 8), (1, 8)), 1):
        run_dir.append(TrialResult(Config(stage, micro, 0, "fp32"), "untrained", wall_time_s=1.0, backend="script",
                                   error=error, extra={"fault": "nonfinite", "trial": n, "script_model": model}))
    session.save(run_dir, Script(str(script)), model, notes, None, settled)
    run_dir.write_settings(settings)
    verdict = write_outputs(run_dir, settings, own=own_outputs(settings), stop_reason=StopReason.TRIALS.value).verdict
    assert "every launched trial failed (3 untrained; the first: rank 0 in warmup: the loss was nan" in verdict
    assert "the script's (or its data's) failure, not a config's" in verdict and "run more trials" not in verdict
    assert "the program's or the environment's failure" in no_fit_verdict(settings, run_dir.results())  # built-in
    top = (run_dir.path / "report.md").read_text().split("## Top configs")[1].split("##")[0]
    assert "No trial has figures: every launched trial failed before it was measured" in top


# -- 7: `trial --script`'s advice names its own flags -----------------------------------------------------------------

def test_a_trials_micro_batch_that_cannot_keep_the_global_batch_names_the_trials_flag(tmp_path):
    shim = shim_for(tmp_path, **{MICRO_BATCH_FIX: trial_command.MICRO_BATCH_FIX})
    shim.spec = replace(shim.spec, config=Config(0, 5, 0, "fp32"))
    shim.script_batch = ScriptBatch.of(16, 1, 1, "DeepSpeed config")
    with pytest.raises(ScriptVerdict) as refused:
        shim.trial_config({"train_batch_size": 16}, None)
    assert refused.value.verdict == "global_batch_indivisible"
    assert str(refused.value).endswith("; pass --micro-batch one of them, or --global-batch to change the recipe")
    assert "space" not in str(refused.value)
    backend = ScriptBackend(Script(str(Path(test_script_review.__file__))), session.placeholder(None, 1),
                            micro_batch_fix=trial_command.MICRO_BATCH_FIX)
    assert backend._spec_extra()[MICRO_BATCH_FIX] == trial_command.MICRO_BATCH_FIX
    # The header: the trial reached deepspeed.initialize, where the shim stopped it before reading the model
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    for phase in ("start", "script", "initialize"):
        record_phase(log_dir, 0, phase)
    result = TrialResult(Config(0, 5, 0, "fp32"), "crash", backend="script", error="rank 0 in initialize: ...",
                         extra={"log_dir": str(log_dir), "script_verdict": "global_batch_indivisible"})
    header = trial_command.unseen_model("train.py", result, True, 16)
    assert header == ("train.py: its model not seen (the trial stopped in deepspeed.initialize before the model was "
                      "read), global batch the script's, which this micro-batch cannot keep (below)")


# -- 8: the script's own precision, changed, is said ---------------------------------------------------------------

def test_the_recommendation_says_it_runs_another_precision_than_the_scripts_config(tmp_path, monkeypatch):
    monkeypatch.setattr(test_script_review, "USER_CONFIG", {**test_script_review.USER_CONFIG, "fp16": {"enabled": True}})
    run_dir, _ = test_script_review.recommended_run(tmp_path)
    line = ("precision: the script's config asks for fp16; the recommendation runs fp32 (DeepSpeed refuses fp16 on the "
            "CPU (its CPU accelerator))")
    assert f"- {line}" in (run_dir.path / "report.md").read_text()
    outputs = session.outputs(run_dir, run_dir.read_settings(), run_dir.results()[0])
    assert line in outputs.notes  # the console's lines
    # Before the search: the first trial says no trial runs it
    settings = test_script_review.script_settings()
    assert session.precision_unrun("fp16", settings) == [
        "precision: the script's config asks for fp16, which no trial runs (DeepSpeed refuses fp16 on the CPU (its CPU "
        "accelerator)): the trials and the recommendation run fp32 instead"]
    assert session.precision_unrun("fp32", settings) == []
    assert session.asked_precision({"bf16": {"enabled": True}}, {}) == "bf16"
    assert session.asked_precision({"fp16": {"enabled": "auto"}}, {}) is None
    assert session.asked_precision({}, {"via": "transformers.TrainingArguments"}) is None


# -- 9: an MLP's attention, whether or not its first forward was seen -------------------------------------------------

def test_an_mlp_whose_first_forward_was_not_seen_is_no_attention_not_an_assumed_sdpa():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    unseen = describe(model_info(mlp))  # a verdict in the engine's first-batch check: no forward ran
    assert unseen.startswith("no attention seen (no attention module in the model") and "SDPA" not in unseen
    info = model_info(mlp)
    watch_attention(mlp, info, lambda: None)
    mlp(torch.randn(2, 8))
    assert describe(info).startswith("no attention seen in the first forward")

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

    assert describe(model_info(nn.Sequential(SelfAttention()))).startswith("attention fused SDPA (assumed")


# -- 10: a report stopped by a verdict speaks of no budget -----------------------------------------------------------

def test_the_top_configs_of_a_sweep_stopped_by_a_verdict_say_why_no_trial_has_figures(tmp_path):
    run_dir, settings, _ = test_script_review.fatal_run(tmp_path)
    write_outputs(run_dir, settings, own=own_outputs(settings), stop_reason=StopReason.FATAL.value)
    top = (run_dir.path / "report.md").read_text().split("## Top configs")[1].split("##")[0]
    assert "No trial has figures: the script stopped the sweep before any config was measured" in top
    assert "budget" not in top
