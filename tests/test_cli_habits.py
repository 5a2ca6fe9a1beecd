"""The habits other command lines taught their users (issue 43): usage and --version, one flag name per idea,
an explicit default model, did-you-mean, tables that fit the terminal, a closed pipe that ends quietly, library
log lines on stderr, --quiet / --verbose, and the checks of a budget above the device and of `--hardware auto`
asked for GPUs it has not got (one line, exit 2)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console

import autotune
import autotune.trials.devices as devices
from autotune.drivers.progress import ConsoleProgress
from autotune.strategies import check_strategy
from autotune.trials.devices import LocalMachine
from autotune.values.config import Config, ConfigError
from autotune.values.hardware import PROFILES, GiB
from autotune.values.results import TrialResult
from autotune.values.settings import memory_budget
from cli_run import cli

REPO = Path(__file__).resolve().parents[1]
TUNE = ["tune", "--backend", "simulated", "--strategy", "random", "--trials", "2"]


def one_line_error(code, err: str, prog: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in err, err


# -- usage and --version -------------------------------------------------------------------------------------

def test_bare_autotune_prints_the_commands_and_exits_2(capsys):
    code, out, err = cli([], capsys)
    assert out.startswith("usage: autotune") and all(f"    {name} " in out for name in ("estimate", "tune", "sweep"))
    one_line_error(code, err, "autotune", "a command is required: one of estimate, tune,")


@pytest.mark.parametrize("command, choices", [("rl", "{train,export}"), ("surface", "{record,show}")])
def test_a_command_without_its_subcommand_names_the_choices(command, choices, capsys):
    code, _, err = cli([command], capsys)
    one_line_error(code, err, f"autotune {command}", f"the following arguments are required: {choices}")


def test_version_prints_the_package_version(capsys):
    assert cli(["--version"], capsys) == (0, f"autotune {autotune.__version__}\n", "")


# -- one flag name per idea ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--memory-budget", "--gpu-memory"])
def test_estimate_takes_tunes_budget_flag_and_keeps_its_old_name(flag, capsys):
    code, out, _ = cli(["estimate", "--model", "gpt2-small", "--hardware", "a100-40gb", flag, "20GiB", "--top", "1",
                        "--json"], capsys)
    assert code == 0 and json.loads(out)["memory_budget_bytes"] == 20 * GiB


def test_an_unknown_flag_is_named_by_its_command_with_the_closest_flag(capsys):
    code, _, err = cli(["estimate", "--memory-budjet", "3GiB"], capsys)
    one_line_error(code, err, "autotune estimate",
                   "unrecognized arguments: --memory-budjet 3GiB (did you mean --memory-budget?)")
    code, _, err = cli(["surface", "show", "s.jsonl", "--bogus"], capsys)
    one_line_error(code, err, "autotune surface show", "unrecognized arguments: --bogus")


def test_a_commands_flag_before_its_name_is_told_where_it_goes(capsys):
    code, _, err = cli(["--json", "estimate", "--model", "tiny"], capsys)
    one_line_error(code, err, "autotune estimate", "--json before the command: estimate's options go after its name "
                   "(autotune estimate --json ...)")
    assert "did you mean" not in err


@pytest.mark.parametrize("argv, fragment", [
    (["estimate", "--model", "tiny", "--memory-budget", "-2GiB"], "size '-2GiB' must be positive"),
    (TUNE + ["--model", "tiny", "--train-for", "-2h"], "duration '-2h' must be positive"),
    (["estimate", "--model", "tiny", "--gpus", "-3"], "'-3' must be a positive integer"),
])
def test_a_negative_value_is_named_by_its_flags_check(argv, fragment, capsys):
    # argparse alone takes `-2GiB` for a flag: "expected one argument", naming neither the value nor what is allowed
    code, _, err = cli(argv, capsys)
    one_line_error(code, err, f"autotune {argv[0]}", fragment)


# -- the default model ---------------------------------------------------------------------------------------

def test_tune_says_which_model_it_took_when_none_was_named(tmp_path, capsys):
    help_text = " ".join(cli(["tune", "--help"], capsys)[1].split())
    assert "(default: tiny;" in help_text and "(default: None)" not in help_text
    code, out, _ = cli([*TUNE, "--out", str(tmp_path / "a")], capsys)
    assert code == 0 and out.splitlines()[0] == "model: tiny (the default; --model to choose)"
    code, out, _ = cli([*TUNE, "--model", "tiny", "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and "the default" not in out


# -- did you mean ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, prog, fragment", [
    (["estimate", "--model", "llama-7"], "autotune estimate", "unknown model 'llama-7' (did you mean llama-7b or "
                                                              "llama-70b?): not a preset"),
    (["estimate", "--model", "lama-13b"], "autotune estimate", "(did you mean llama-13b?)"),
    (["estimate", "--hardware", "h100"], "autotune estimate", "unknown hardware 'h100' (did you mean h100-80gb?): "
                                                              "allowed"),
    (["estimate", "--space", "defualt"], "autotune estimate", "search space 'defualt' (did you mean default?): no "
                                                              "such file"),
    ([*TUNE, "--strategy", "optuan"], "autotune tune", "invalid choice: 'optuan' (did you mean optuna?): choose "
                                                       "from 'grid'"),
    (["estimat"], "autotune", "invalid choice: 'estimat' (did you mean estimate?)"),
    (["estimate", "--hardware", "A100-80GB"], "autotune estimate", "(did you mean a100-80gb?)"),  # not h100-80gb
    (["estimate", "--model", "Llama-13B"], "autotune estimate", "(did you mean llama-13b?)"),
])
def test_a_mistyped_name_gets_the_closest(argv, prog, fragment, capsys):
    code, _, err = cli(argv, capsys)
    one_line_error(code, err, prog, fragment)


def test_no_suggestion_when_nothing_is_close(capsys):
    code, _, err = cli(["estimate", "--model", "gpt5"], capsys)
    one_line_error(code, err, "autotune estimate", "unknown model 'gpt5': not a preset")


def test_the_librarys_strategy_check_suggests_too():
    with pytest.raises(ConfigError, match=r"strategy 'hybird' \(did you mean hybrid\?\): allowed grid"):
        check_strategy("hybird")


# -- tables that fit the terminal ------------------------------------------------------------------------------

ESTIMATE = ["estimate", "--model", "gpt2-large", "--hardware", "h100-80gb", "--memory-budget", "30GiB", "--top", "3"]


@pytest.mark.parametrize("columns", [80, 200])
def test_estimates_tables_fit_the_terminal_and_cut_no_header(columns, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, _ = cli(ESTIMATE, capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("gpt2-large: 774.0M parameters") and lines[1].startswith("allocator: ")  # prose, unwrapped
    assert max(cell_len(line) for line in lines[2:]) <= columns  # the tables
    assert "…" not in out  # rich's cut ("gradie…")
    words = out.split()
    assert "│ bf16 │" in out and "samples/s" in words
    if columns == 200:  # every knob and memory term a column
        assert {"stage", "micro", "gradients", "optim", "activ", "overhead", "step"} <= set(words)
    else:  # the knobs as the config label abbreviates them, the memory terms in --json
        assert {"z", "mb", "acc", "oo", "op", "peak", "host"} <= set(words) and "gradients" not in words
        assert "memory terms and step times: --json, or a wider terminal (COLUMNS=200)" in out


# -- a closed pipe, and stdout for the command's output only -------------------------------------------------

def test_a_reader_that_takes_one_line_ends_the_command_quietly(tmp_path):
    """`autotune estimate | head -1`: exit 0, nothing on stderr (as `git log | head -1`)."""
    process = subprocess.Popen([sys.executable, "-m", "autotune.cli", *ESTIMATE, "--top", "100"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                               env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": "80"})
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().startswith(b"gpt2-large")
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0 and err == ""


def test_deepspeeds_log_lines_go_to_stderr_and_its_info_under_verbose():
    """The logger "DeepSpeed" writes to sys.stdout as DeepSpeed makes it; while a command runs it writes to stderr,
    at INFO under --verbose. Its accelerator detection line ("Setting accelerator to CPU ... unable to detect
    it"), which this process (checking configs only) printed amid the summary, is kept for --verbose alone."""
    code = ("import sys; from autotune.cli import deepspeed_logs_to_stderr as logs\n"
            "with logs(verbose=sys.argv[1] == 'verbose'):\n"
            "    from deepspeed.utils.logging import logger\n"
            "    from deepspeed.accelerator import get_accelerator; get_accelerator()\n"
            "    logger.warning('a warning'); logger.info('quiet info')\n"
            "with logs(verbose=True):\n"
            "    logger.info('verbose info')\n"
            "print('the output')\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # auto-detected, as a user's shell has it
    for mode in ("quiet", "verbose"):
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "the output\n"
        assert "a warning" in done.stderr and "verbose info" in done.stderr
        assert ("quiet info" in done.stderr) is (mode == "verbose")
        assert ("Setting accelerator to CPU" in done.stderr) is (mode == "verbose"), done.stderr


# -- --quiet / --verbose ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_prints_only_the_results(where, tmp_path, capsys):
    rest = [*TUNE, "--out", str(tmp_path / "run")]
    code, out, err = cli(["--quiet", *rest] if where == "before" else [*rest, "--quiet"], capsys)
    assert code == 0, err
    assert out.startswith("stopped: trial budget spent") and "recommended " in out and "report: " in out
    assert "trial   1/2" not in out and "tuning tiny" not in out and "the default" not in out


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_subcommands_subcommand_takes_the_global_flags_and_quiet_says_its_results_only(where, tmp_path, capsys):
    rest = ["record", "--model", "tiny", "--backend", "simulated", "--memory-budget", "1GiB", "--limit", "2",
            "--out", str(tmp_path / "s.jsonl")]
    code, out, err = cli(["--quiet", "surface", *rest] if where == "before" else ["surface", *rest, "--quiet"], capsys)
    assert code == 0, err
    assert out == f"{tmp_path / 's.jsonl'}: 2 configs recorded now, 2 of 216 measured\n"  # no line a config
    for argv in (["rl", "train", "--quiet", "--help"], ["surface", "show", "--verbose", "--help"]):
        assert cli(argv, capsys)[0] == 0, argv  # was: unrecognized arguments


def test_quiet_and_verbose_together_are_refused(capsys):
    code, _, err = cli(["--quiet", *TUNE, "--verbose"], capsys)
    one_line_error(code, err, "autotune tune", "--quiet and --verbose: choose one")


def trial_result(config: Config) -> TrialResult:
    return TrialResult(config, "ok", throughput_samples_per_s=4.0, peak_memory_bytes=GiB, wall_time_s=3.0,
                       backend="deepspeed", extra={"trial": 1})


def test_the_quiet_display_says_results_only():
    out = io.StringIO()
    progress = ConsoleProgress(3, Console(file=out, width=120), quiet=True)
    config = Config(2, 4, 0, "fp32", "cpu")
    progress.started(1, 1, config)
    progress.finished(trial_result(config), 1, trial_result(config))
    progress.pruned(TrialResult(Config(0, 8, 0, "fp32"), "pruned", backend="simulated", error="over 1 GiB"))
    progress.message("a note")
    progress.result("the recommendation")
    progress.close()
    assert out.getvalue() == "the recommendation\n"


def test_verbose_says_each_phase_of_the_running_trial_on_stderr():
    phases = iter(["loading DeepSpeed", "loading DeepSpeed", "initializing", "measuring"])
    out, errors = io.StringIO(), io.StringIO()
    progress = ConsoleProgress(3, Console(file=out, width=200), verbose=True, phase_every_s=0.01,
                               errors=Console(file=errors, width=200))
    progress.follow(lambda: next(phases, "measuring"))
    config = Config(2, 4, 0, "fp32", "cpu")
    progress.started(1, 1, config)
    deadline = time.monotonic() + 10
    while "measuring" not in errors.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    progress.finished(trial_result(config), 1, None)
    assert errors.getvalue().splitlines() == [f"trial 1/3 (#1) {config.label()}: {phase}"
                                              for phase in ("loading DeepSpeed", "initializing", "measuring")]
    assert "trial   1/3" in out.getvalue() and "loading" not in out.getvalue()


# -- a budget above the device ---------------------------------------------------------------------------------

BEYOND = "memory budget 200 GiB exceeds h100-80gb's 80 GiB per device: allowed up to 80 GiB (the device's memory)"


@pytest.mark.parametrize("argv, prog", [
    ([*TUNE, "--model", "gpt2-large", "--hardware", "h100-80gb", "--memory-budget", "200GiB"], "autotune tune"),
    (["estimate", "--model", "gpt2-large", "--hardware", "h100-80gb", "--memory-budget", "200GiB"], "autotune estimate"),
])
def test_a_budget_above_the_device_is_refused(argv, prog, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(argv, capsys)
    one_line_error(code, err, prog, BEYOND)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_the_budget_may_be_the_whole_device_and_no_more():
    h100 = PROFILES["h100-80gb"]
    assert memory_budget(None, h100) == memory_budget(80 * GiB, h100) == 80 * GiB
    with pytest.raises(ConfigError, match="exceeds h100-80gb's 80 GiB per device"):
        memory_budget(80 * GiB + 1, h100)


# -- --hardware auto asked for GPUs it has not got ---------------------------------------------------------------

def test_auto_on_a_machine_without_gpus_refuses_more_ranks_than_cores(monkeypatch, capsys):
    machine = LocalMachine((), 24 * GiB, 2, "emulated")
    monkeypatch.setattr(devices, "probe", lambda *args, **kwargs: machine)
    code, _, err = cli(["estimate", "--hardware", "auto", "--gpus", "8"], capsys)
    one_line_error(code, err, "autotune estimate", "--gpus (the workload's `gpus`) 8 with --hardware auto: auto found no CUDA GPU, CPU only "
                   "(2 cores, 24 GiB RAM, bf16 emulated), whose cpu profile runs 1 to 2 ranks; to predict 8 GPUs pass "
                   "--hardware <a GPU profile> (v100-32gb, a100-40gb")
    code, out, _ = cli(["estimate", "--hardware", "auto", "--gpus", "2", "--top", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["workload"]["gpus"] == 2


def test_quiet_estimate_prints_the_tables_without_its_notes(monkeypatch, capsys):
    monkeypatch.setattr(devices, "probe", lambda *args, **kwargs: LocalMachine((), 24 * GiB, 2, "emulated"))
    code, out, _ = cli(["estimate", "--hardware", "auto", "--top", "1"], capsys)
    assert code == 0 and out.startswith("detected no CUDA GPU") and "left out of the space" in out
    code, out, _ = cli(["--quiet", "estimate", "--hardware", "auto", "--top", "1"], capsys)
    assert code == 0 and out.startswith("tiny: 4.3M parameters") and "detected" not in out and "left out" not in out


def test_an_interrupt_the_command_did_not_handle_says_how_to_go_on(tmp_path):
    from autotune.cli import _resume_hint

    tune, sweep, other = tmp_path / "tune", tmp_path / "sweep", tmp_path / "trial"
    for folder, name in ((tune, "run.json"), (sweep, "sweep.yaml"), (other, "trials.jsonl")):
        folder.mkdir()
        (folder / name).write_text("{}")
    assert f"continue with the same command and --resume (`autotune report {tune}`" in _resume_hint(tune)
    assert _resume_hint(sweep).endswith(f"--resume --out {sweep}")
    assert _resume_hint(other) == _resume_hint(None) == ""
