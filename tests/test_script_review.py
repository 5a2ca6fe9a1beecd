"""Script mode as a reviewer found it (defects 1-6): a resume after a first trial that never showed the model,
--trial-timeout for the first trial, failures in the script's own words, the report of a script that cannot be
tuned, launch.sh for a script that builds its config in code, and a quiet `autotune.tune()` from Python.

Unit-level where the real file formats suffice (a run directory written by the real writers); real trials only
for what the shim and the runner do (a script that crashes at import, one that fails its own argparse, one that
hangs before deepspeed.initialize) and for the launch of the wrapper under torchrun."""

from __future__ import annotations

import argparse
import io
import json
import os
import runpy
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from torch import nn

import autotune
from autotune.api import ScriptRun, TuneSpec, own_outputs
from autotune.backends.script import Script
from autotune.cli import main
from autotune.drivers.progress import QuietProgress
from autotune.drivers.stop import StopReason
from autotune.outputs import script as session
from autotune.outputs.report import write_outputs
from autotune.script import apply
from autotune.script.inspect_model import model_info
from autotune.script import shim
from autotune.script.shim import KEEP_SCRIPT_BATCH, Shim, ScriptVerdict, StderrTail, print_failure
from autotune.search.rundir import RunDir
from autotune.trials.runner import free_port
from autotune.values.config import Config
from autotune.values.dsconfig import ds_config
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult, read_results
from autotune.values.settings import RunSettings
from autotune.search_spaces import load_choices
from autotune.worker.protocol import WorkerSpec, record_phase

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SHIM_FILE = "autotune/script/shim.py"


class Heard(QuietProgress):
    """Callbacks that keep the sweep's lines (`message`), as a front end's would print them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def script_settings(micro=(1, 2, 4, 8)) -> RunSettings:
    choices = replace(load_choices("cpu"), micro_batch=micro, precision=("fp32",))
    return RunSettings(session.placeholder(None, 1), PROFILES["cpu"], 2**32, "optuna", "script", 0, choices)


# -- defect 3: the script's own words, no traceback of the shim's ----------------------------------------------

def test_a_scripts_exception_is_printed_from_its_own_first_frame_and_a_verdict_prints_nothing(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("def load():\n    raise RuntimeError('no data found')\n\nload()\n")
    caught: list[BaseException] = []
    # As the shim runs it (Shim.run_script): runpy called from the shim's file, the exception caught there.
    exec(compile("try:\n    runpy.run_path(path, run_name='__main__')\nexcept RuntimeError as err:\n"
                 "    caught.append(err)\n", shim.__file__, "exec"), {"runpy": runpy, "path": str(script),
                                                                     "caught": caught})
    print_failure(caught[0])
    printed = capsys.readouterr().err
    assert printed.startswith("Traceback (most recent call last):\n  File \"" + str(script))
    assert printed.rstrip().endswith("RuntimeError: no data found") and "runpy" not in printed
    assert shim.__file__ not in printed
    for own in (ScriptVerdict("never_initialized", "the script ended without calling deepspeed.initialize"),
                SystemExit(2)):
        print_failure(own)
        assert capsys.readouterr().err == ""  # the verdict's message is the trial's error; argparse said its line
    print_failure(SystemExit("config.yaml not found"))  # as Python prints sys.exit("...")
    assert capsys.readouterr().err == "config.yaml not found\n"
    # A script that does not compile has no frame of its own: Python's lines for it, none of the shim's.
    script.write_text("def load(:\n    pass\n")
    caught.clear()
    exec(compile("try:\n    runpy.run_path(path, run_name='__main__')\nexcept SyntaxError as err:\n"
                 "    caught.append(err)\n", shim.__file__, "exec"), {"runpy": runpy, "path": str(script),
                                                                    "caught": caught})
    print_failure(caught[0])
    printed = capsys.readouterr().err
    assert printed.startswith(f'  File "{script}", line 1') and "SyntaxError" in printed
    assert shim.__file__ not in printed and "runpy" not in printed and "Traceback" not in printed


def shim_for(tmp_path) -> Shim:
    workload = session.placeholder(None, 1)
    config = Config(0, 1, 0, "fp32")
    return Shim(WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path),
                           extra={KEEP_SCRIPT_BATCH: True}), 0)


def test_an_argparse_error_is_the_trials_error_line(tmp_path):
    shim = shim_for(tmp_path)
    shim.last_phase = "script"
    shim.stderr = StderrTail(io.StringIO())
    parser = argparse.ArgumentParser(prog="train_plain.py")
    parser.add_argument("--steps", type=int)
    real = sys.stderr
    sys.stderr = shim.stderr
    try:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["--stepz", "5"])
    finally:
        sys.stderr = real
    report = shim.failure(exited.value)
    assert report["verdict"] == "crashed_before_initialize"
    assert report["error"] == ("the script failed before calling deepspeed.initialize: train_plain.py: error: "
                               "unrecognized arguments: --stepz 5 (exit code 2)")
    assert shim.stderr.stream.getvalue().startswith("usage: train_plain.py")  # the stream got every write


# -- defect 4 and 1: the report of a script that cannot be tuned; its resume ------------------------------------

FATAL = ("crashed_before_initialize: rank 0 in script: the script failed before calling deepspeed.initialize: "
         "RuntimeError: no data found; last lines of stderr:\nTraceback (most recent call last):\n"
         "  File \"/w/train.py\", line 2, in <module>\nRuntimeError: no data found")


def fatal_run(tmp_path) -> tuple[RunDir, RunSettings, Path]:
    """A run directory as a sweep leaves it whose first trial crashed at the script's import."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    script = tmp_path / "train.py"
    script.write_text("raise RuntimeError('no data found')\n")
    settings = script_settings()
    run_dir.append(TrialResult(Config(0, 1, 0, "fp32"), "crash", wall_time_s=2.0, backend="script",
                               error=FATAL.partition(": ")[2],
                               extra={"trial": 1, "script_verdict": "crashed_before_initialize"}))
    session.save(run_dir, Script(str(script)), None, [], FATAL)
    run_dir.write_settings(settings)
    return run_dir, settings, script


def test_the_report_of_a_script_that_cannot_be_tuned_says_why_first_and_no_placeholder(tmp_path):
    run_dir, settings, script = fatal_run(tmp_path)
    outputs = write_outputs(run_dir, settings, own=own_outputs(settings), stop_reason=StopReason.FATAL.value)
    report = (run_dir.path / "report.md").read_text()
    head = report.split("## Top configs")[0]
    assert report.startswith("# ds-autotune report: train.py (script)\n\n**The script cannot be tuned as it is: "
                             "crashed_before_initialize: rank 0 in script: the script failed before calling "
                             "deepspeed.initialize: RuntimeError: no data found; the error is the script's own")
    assert "- Workload: train.py: its model not seen (no trial reached deepspeed.initialize), global batch not " \
           "read, 1 x cpu" in head
    assert "4.3M" not in report and "global batch 16" not in report and "run more trials" not in report
    assert "Optuna study" not in report  # the search never opened one
    assert head.index("**The script cannot be tuned") < head.index("- Stopped: a failure no other config can avoid "
                                                                    "(the verdict names it)")
    section = report.split("## Script mode")[1]
    assert f"- Script: `{script.resolve()}` (no arguments)\n" in section and "` ``" not in section
    assert "  ```\n  Traceback (most recent call last):" in section  # the stderr lines fenced, not in a bullet
    assert outputs.verdict.startswith("the script cannot be tuned as it is: crashed_before_initialize")


def test_a_resume_whose_first_trial_never_showed_the_model_runs_nothing_and_says_to_start_anew(tmp_path):
    run_dir, settings, script = fatal_run(tmp_path)
    script.write_text((EXAMPLES / "train_dict.py").read_text())  # fixed since
    before = (run_dir.path / "run.json").read_text()
    heard = Heard()
    mode = ScriptRun(str(script))
    ran = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "first_trial", lambda *a, **k: ran.append(a))
        settings_after, _, ended = mode.start(run_dir, settings, settings.space(), True, heard, None)
    assert not ran and ended is not None and ended.stop_reason == StopReason.FATAL and ended.best is None
    assert heard.lines[0].startswith(f"--resume: {run_dir.path} holds nothing to go on from: its first trial ended "
                                     "the sweep before the script reached deepspeed.initialize "
                                     "(crashed_before_initialize: rank 0 in script:")
    assert "start a new sweep: the same command without --resume, with another --out" in heard.lines[0]
    assert len(run_dir.results()) == 1 and (run_dir.path / "run.json").read_text() == before
    assert not (run_dir.path / "best_ds_config.json").exists()


# -- defect 2: --trial-timeout bounds the first trial --------------------------------------------------------

def test_the_first_trial_gets_the_trial_timeout_and_its_lines_go_to_the_callbacks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    spec = TuneSpec.for_script(script, trial_timeout_s=15.0)
    assert spec.mode == ScriptRun(str(script), (), None, 15.0)
    got = {}

    def first_trial(run_dir, settings, space, script, timeout_s=None, **kwargs):
        got.update(timeout_s=timeout_s, say=kwargs["say"])
        return settings, space, None

    heard = Heard()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "first_trial", first_trial)
        spec.mode.start(RunDir(tmp_path / "run"), script_settings(), script_settings().space(), False, heard, None)
    assert got["timeout_s"] == 15.0 and got["say"] == heard.message


def test_a_first_trial_that_times_out_in_the_script_before_initialize_is_its_verdict(tmp_path, monkeypatch):
    """What comes before deepspeed.initialize is the same for every config: the sweep stops there."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    script = tmp_path / "hang.py"
    script.write_text("import time\nwhile True:\n    time.sleep(1)\n")
    log_dir = run_dir.logs_dir / "0001-z0_mb1_ck0_fp32"
    log_dir.mkdir(parents=True)
    for phase in ("start", "build_ops", "script"):
        record_phase(log_dir, 0, phase)

    class Backend:
        fatal = None

        def __init__(self, *args, **kwargs):
            self.timeout_s = args[6]

        def run(self, config):
            return TrialResult(config, "timeout", wall_time_s=self.timeout_s, backend="script",
                               error=f"no result within the timeout of {self.timeout_s:g} s (rank 0 in script)",
                               extra={"log_dir": str(log_dir)})

    monkeypatch.setattr(session, "script_backend", Backend)
    heard = Heard()
    settings = script_settings()
    _, _, fatal = session.first_trial(run_dir, settings, settings.space(), Script(str(script)), 15.0, say=heard.message)
    assert fatal == "timed_out_before_initialize: no result within the timeout of 15 s (rank 0 in script)"
    [result] = run_dir.results()
    assert result.extra["script_verdict"] == "timed_out_before_initialize" and result.extra["trial"] == 1
    assert heard.lines[-1] == "first trial timeout: no result within the timeout of 15 s (rank 0 in script)"
    # A timeout after deepspeed.initialize (the model seen) or before the script ran is no verdict.
    record_phase(log_dir, 0, "initialize")
    assert not session.waited_in_script(result)


# -- defect 5: launch.sh applies the recommendation to a script that builds its config in code -------------------

DICT_SCRIPT = """\
import argparse, json
import deepspeed, torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "zero_allow_untested_optimizer": True,
          "gradient_clipping": 0.5, "zero_optimization": {"stage": 0}}
model = torch.nn.Linear(4, 1)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), config=CONFIG)
print("ENGINE " + json.dumps({"micro": engine.train_micro_batch_size_per_gpu(), "steps": args.steps,
                              "accumulation": engine.gradient_accumulation_steps(),
                              "stage": engine.zero_optimization_stage(), "clipping": engine.gradient_clipping(),
                              "lr": engine.basic_optimizer.param_groups[0]["lr"]}), flush=True)
torch.distributed.destroy_process_group()
"""
USER_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "zero_allow_untested_optimizer": True,
               "gradient_clipping": 0.5, "zero_optimization": {"stage": 0}}


def recommended_run(tmp_path, via: str = "deepspeed.initialize", args: tuple[str, ...] = ("--steps", "3"),
                    best_config: Config = Config(1, 4, 0, "fp32"), switch: str | None = None,
                    seen: dict | None = None) -> tuple[RunDir, Path]:
    """A script sweep's run directory as its trials leave it: the script builds its config (global batch 8) in
    code, no argument names it (unless `args` do); its best trial ran ZeRO 1 at micro-batch 4 (`best_config`)."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    script = tmp_path / "train.py"
    script.write_text(DICT_SCRIPT)
    model = {**model_info(nn.Linear(4, 1)), **(seen or {}), "via": via, "checkpoint_switch": switch,
             "batch": {"global_batch": 8, "micro_batch": 8, "accumulation": 1, "ranks": 1,
                       "source": "DeepSpeed config"}}
    settings, settled, notes = session.with_global_batch(script_settings(), model, None)
    log_dir = run_dir.logs_dir / "0002-z1_mb4_ck0_fp32"
    log_dir.mkdir(parents=True)
    (log_dir / "user_ds_config.json").write_text(json.dumps(USER_CONFIG))
    best = TrialResult(best_config, "ok", throughput_samples_per_s=100.0, step_time_s=0.08,
                       peak_memory_bytes=2**28, wall_time_s=5.0, backend="script",
                       extra={"trial": 1, "log_dir": str(log_dir), "script_model": model, "global_batch": 8})
    run_dir.append(best)
    session.save(run_dir, Script(str(script), args), model, notes, None, settled)
    run_dir.write_settings(settings)
    write_outputs(run_dir, settings, own=own_outputs(settings), stop_reason=StopReason.TRIALS.value)
    return run_dir, script


def test_launch_sh_applies_a_config_built_in_code_through_the_wrapper_and_says_so(tmp_path):
    run_dir, script = recommended_run(tmp_path)
    best = str(run_dir.path.resolve() / "best_ds_config.json")
    command = shlex.join(["--module", "autotune.script.apply", best, str(script.resolve()), "--steps", "3"])
    launch = (run_dir.path / "launch.sh").read_text()
    assert f"[ $# -gt 0 ] || set -- {command}" in launch and f"#   bash launch.sh torchrun {command}" in launch
    assert "# The script builds its DeepSpeed config in code: `--module autotune.script.apply` gives" in launch
    keys = json.loads(launch.split("\n")[4].removeprefix("# "))  # the tuned keys, to put into the script's dict
    assert keys["train_micro_batch_size_per_gpu"] == 4 and keys["zero_optimization"]["stage"] == 1
    report = (run_dir.path / "report.md").read_text()
    assert f"- Launch: `bash launch.sh torchrun {command}`" in report
    assert "so launch.sh applies best_ds_config.json through `python -m autotune.script.apply`" in report
    assert '"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2' in report


def test_recommended_checkpointing_of_a_file_config_script_goes_through_the_wrapper(tmp_path):
    # The script names its config file: launch.sh ran it with best_ds_config.json alone, and the recommended
    # checkpointing (the model's switch, no config key) was dropped without a word; its peak was measured with it.
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(USER_CONFIG))
    run_dir, script = recommended_run(tmp_path, args=("--deepspeed_config", str(config), "--steps", "3"),
                                      best_config=Config(1, 4, 1, "fp32"), switch="gradient_checkpointing_enable")
    best = str(run_dir.path.resolve() / "best_ds_config.json")
    command = shlex.join(["--module", "autotune.script.apply", "--checkpointing", "on", best, str(script.resolve()),
                          "--deepspeed_config", best, "--steps", "3"])
    launch = (run_dir.path / "launch.sh").read_text()
    assert f"#   bash launch.sh torchrun {command}" in launch
    assert "# The recommendation checkpoints activations: `--module autotune.script.apply --checkpointing on` calls" \
        in launch
    report = (run_dir.path / "report.md").read_text()
    assert "call model.gradient_checkpointing_enable() before deepspeed.initialize" in report
    # Without checkpointing recommended, the script runs as it is, the file in its argument.
    (tmp_path / "plain").mkdir()
    plain, _ = recommended_run(tmp_path / "plain", args=("--deepspeed_config", str(config)))
    assert "autotune.script.apply" not in (plain.path / "launch.sh").read_text()
    assert "recommended_trainer_flags" not in json.loads((plain.path / "script.json").read_text())  # no Trainer


def test_an_accelerate_loop_whose_config_is_set_in_code_is_launched_with_its_own_arguments(tmp_path):
    # Its DataLoader's batch flag rewritten to the tuned micro-batch while the plugin kept the script's own
    # accumulation: the command trained another global batch, on a config no trial measured.
    from autotune.script import accelerate_loop

    run_dir, script = recommended_run(tmp_path, via=accelerate_loop.VIA, args=("--bs", "8", "--accum", "1"),
                                      seen={accelerate_loop.INFO: {"loader_batch": 8, "script_micro_batch": 8}})
    launch = (run_dir.path / "launch.sh").read_text()
    assert f"#   bash launch.sh torchrun {shlex.join([str(script.resolve()), '--bs', '8', '--accum', '1'])}" in launch
    assert "# NOT TUNED" in launch
    assert "and pass --bs 4: " in (run_dir.path / "report.md").read_text()


def test_a_trainer_config_set_in_code_is_said_to_be_not_in_the_command(tmp_path):
    run_dir, script = recommended_run(tmp_path, via="transformers.TrainingArguments")
    launch = (run_dir.path / "launch.sh").read_text()
    assert "autotune.script.apply" not in launch and "# NOT TUNED: the script sets its DeepSpeed config in code" in launch
    report = (run_dir.path / "report.md").read_text()
    assert "the recommendation is NOT in launch.sh's command: no argument of the script names its DeepSpeed config" \
        in report


def test_the_wrapper_passes_a_launchers_local_rank_to_the_script():
    assert apply.parse(["--local_rank=0", "--checkpointing", "on", "b.json", "t.py", "--steps", "3"]) == (
        True, "b.json", "t.py", ["--local_rank=0", "--steps", "3"])
    assert apply.parse(["b.json", "t.py"]) == (None, "b.json", "t.py", [])
    with pytest.raises(SystemExit, match="usage"):
        apply.parse(["b.json"])


@pytest.mark.slow
def test_the_wrapper_under_torchrun_gives_deepspeed_the_tuned_keys_and_keeps_the_scripts_own(tmp_path):
    run_dir, _ = recommended_run(tmp_path)
    for _ in range(3):  # a port taken by another process meanwhile is tried again, as a user would
        ran = subprocess.run(["bash", str(run_dir.path / "launch.sh"), "torchrun"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=600, env={**os.environ, "PET_MASTER_PORT": str(free_port())})
        if "EADDRINUSE" not in ran.stderr:
            break
    lines = [line for line in ran.stdout.splitlines() if line.startswith("ENGINE ")]
    assert ran.returncode == 0 and lines, ran.stderr[-3000:]
    engine = json.loads(lines[-1].removeprefix("ENGINE "))
    assert (engine["micro"], engine["accumulation"], engine["stage"]) == (4, 2, 1)  # the recommendation
    assert (engine["clipping"], engine["lr"], engine["steps"]) == (0.5, 0.05, 3)  # the script's own, its arguments
    assert "ds-autotune: deepspeed.initialize gets the tuned keys of" in ran.stderr
    assert "ZeRO stage 1, micro-batch 4 x accumulation 2 (global batch 8), fp32" in ran.stderr


# -- real trials: a crash at import from Python (quiet), argparse's error, a hang before initialize ------------

SPACE = "zero_stage: [0]\nmicro_batch: [1, 2]\nckpt_interval: [0]\nprecision: [fp32]\noffload_optimizer: [none]\n" \
        "offload_param: [none]\n"


@pytest.fixture
def space_file(tmp_path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path


@pytest.mark.slow
def test_a_script_crashing_at_import_from_python_is_quiet_told_in_its_words_and_not_resumed(tmp_path, space_file,
                                                                                            capsys):
    script = tmp_path / "crash.py"
    script.write_text("import os\nraise RuntimeError('boom at import')\n")
    out = tmp_path / "run"
    spec = TuneSpec.for_script(script, ["--steps", "6"], space=str(space_file), trials=2, confirm=0)
    result = autotune.tune(spec, out)
    assert capsys.readouterr().out == ""  # defect 6: the default callbacks are quiet
    assert result.stop_reason == StopReason.FATAL and result.best is None
    [first] = read_results(out / "trials.jsonl")
    assert first.error.splitlines()[0] == ("rank 0 in script: the script failed before calling deepspeed.initialize: "
                                           "RuntimeError: boom at import; last lines of stderr:")
    assert first.error.splitlines()[-4:] == ["Traceback (most recent call last):",
                                             f'  File "{script}", line 2, in <module>',
                                             "    raise RuntimeError('boom at import')",
                                             "RuntimeError: boom at import"]  # the script's frame only
    assert SHIM_FILE not in first.error and "runpy" not in first.error
    report = (out / "report.md").read_text()
    assert report.startswith("# ds-autotune report: crash.py (script)\n\n**The script cannot be tuned as it is")
    assert "- Script: `" + str(script.resolve()) + "` with arguments `--steps 6`" in report
    # Fixed since, resumed: nothing runs on the stand-in workload; the record and run.json stay as they were.
    script.write_text((EXAMPLES / "train_dict.py").read_text())
    settings = (out / "run.json").read_text()
    heard = Heard()
    resumed = autotune.tune(spec, out, resume=True, callbacks=heard)
    assert resumed.stop_reason == StopReason.FATAL and len(read_results(out / "trials.jsonl")) == 1
    assert (out / "run.json").read_text() == settings and not (out / "best_ds_config.json").exists()
    assert "holds nothing to go on from" in heard.lines[0] and capsys.readouterr().out == ""


@pytest.mark.slow
def test_an_argparse_error_is_what_the_console_and_the_record_show(tmp_path, space_file, capsys):
    script = tmp_path / "train_plain.py"
    script.write_text("import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--steps', type=int)\n"
                      "parser.parse_args()\n")
    out = tmp_path / "run"
    code = main(["tune", "--script", str(script), "--space", str(space_file), "--trials", "2", "--out", str(out),
                 "--", "--stepz", "5"])
    printed = capsys.readouterr().out
    assert code == 1
    said = "train_plain.py: error: unrecognized arguments: --stepz 5 (exit code 2)"
    assert f"first trial crash: rank 0 in script: the script failed before calling deepspeed.initialize: {said}" \
        in printed
    [first] = read_results(out / "trials.jsonl")
    assert said in first.error.splitlines()[0]
    assert "SystemExit" not in first.error and SHIM_FILE not in first.error and "Traceback" not in first.error
    assert said in (out / "report.md").read_text().split("\n")[2]  # the headline


@pytest.mark.slow
def test_a_script_hanging_before_initialize_ends_at_the_trial_timeout_with_its_verdict(tmp_path, space_file, capsys):
    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('loading data ...', flush=True)\nwhile True:\n    time.sleep(1)\n")
    out = tmp_path / "run"
    code = main(["tune", "--script", str(script), "--space", str(space_file), "--trials", "2", "--trial-timeout",
                 "20s", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 1, printed
    [first] = read_results(out / "trials.jsonl")  # one trial, ended at 20 s (said below), not the 600 s default
    assert first.status == "timeout" and first.extra["script_verdict"] == "timed_out_before_initialize"
    assert "the script cannot be tuned as it is: timed_out_before_initialize: no result within the timeout of 20 s" \
        in printed
