"""Command-line inputs and the top-level guard (issue 14): every flag is checked where it enters (one line naming
the value and what is allowed, exit 2, nothing written), output paths are checked before anything is written,
a new sweep that fails before its first trial leaves nothing behind, and any other exception is one line naming
the log that holds its traceback, exit 1 (`--debug` prints it)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import autotune.commands.estimate as estimate_command
import autotune.api as tune_command  # open_sweep: a phase of the runner `autotune tune` reaches through autotune.tune()
from autotune.commands.common import make_dir
from autotune.values.config import ConfigError
from cli_run import cli

NINES = "9" * 400
FAST_TUNE = ["tune", "--backend", "simulated", "--model", "tiny", "--trials", "2"]


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """An empty current directory, and the error log's default home inside the test's folder."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return work


def one_line_error(code, err: str, prog: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in err, err


# -- numbers ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["estimate", "--gpu-memory", f"{NINES}TiB"], "is too large: allowed 1 B to 1024 TiB"),
    (["estimate", "--gpu-memory", "1025TiB"], "size '1025TiB' is too large: allowed 1 B to 1024 TiB"),
    (FAST_TUNE + ["--memory-budget", f"{NINES}TiB"], "is too large: allowed 1 B to 1024 TiB"),
    (["surface", "show", "s.jsonl", "--memory-budget", f"{NINES}GB"], "is too large: allowed 1 B to 1024 TiB"),
    (["estimate", "--top", "-1"], "argument --top: '-1' must be a positive integer"),
    (["estimate", "--top", "0"], "argument --top: '0' must be a positive integer"),
    (["estimate", "--gpus", str(10**12)], f"'{10**12}' is too large: allowed 1 to 4096 GPUs"),
    (FAST_TUNE + ["--gpus-per-trial", str(10**12), "--ray-address", "local"], "allowed 1 to 4096 GPUs"),
    (["estimate", "--global-batch", "9" * 5000], "is too large: allowed 1 to 2147483647"),
    (FAST_TUNE + ["--trials", NINES], "argument --trials:"),
    (["surface", "record", "--backend", "simulated", "--out", "s.jsonl", "--timeout", "-5"],
     "argument --timeout: duration '-5' must be positive"),
    (["surface", "record", "--backend", "simulated", "--out", "s.jsonl", "--max-measure-s", "0"],
     "duration '0' must be positive"),
    (["trial", "--zero-stage", "1", "--micro-batch", "1", "--precision", "bf16", "--timeout", "0"],
     "duration '0' must be positive"),
    (["trial", "--zero-stage", "1", "--micro-batch", "1", "--precision", "bf16", "--warmup-steps", "-1"],
     "'-1' must be 0 or a positive integer"),
    (["trial", "--zero-stage", "7", "--micro-batch", "1", "--precision", "bf16"], "'7' is too large: allowed 0 to 3"),
    (["trial", "--zero-stage", "3", "--micro-batch", "1", "--precision", "bf16", "--offload-param", "nvme",
      "--nvme-path", "/nonexistent/nvme"], "argument --nvme-path: '/nonexistent/nvme': no such directory"),
    (FAST_TUNE + ["--time-budget", NINES], "is too long: allowed more than 0 s, at most 366d"),
    (FAST_TUNE + ["--time-budget", "1h30"], "duration '1h30' is not understood: give each number its unit"),
    (FAST_TUNE + ["--strategy", "optuna", "--seed", "1180591620717411303424"],
     "argument --seed: '1180591620717411303424' is too large: allowed 0 to 4294967295"),
    (FAST_TUNE + ["--seed", "-1"], "argument --seed: '-1' must be 0 or a positive integer"),
    (["surface", "record", "--backend", "simulated", "--out", "s.jsonl", "--seed", str(2**32)],
     "allowed 0 to 4294967295"),
    (["rl", "train", "--seed", str(2**32)], "allowed 0 to 4294967295"),
    (["rl", "train", "--noise", "nan"], "'nan' must be a finite number >= 0"),
    (["rl", "train", "--workers", "100000"], "'100000' is too large: allowed 0 to 4096 runners"),
    (["rl", "train", "--hiddens", ",".join(["8"] * 17)], "at most 16 of them"),
    (["rl", "train", "--hiddens", "128," + NINES], "integers from 1 to 65536"),
    (["rl", "train", "--backend", "replay", "--memory-budget", "1GiB,zz"], "size 'zz' is not understood"),
    (["rl", "train", "--memory-budget", "0"], "size '0' must be positive"),
    (FAST_TUNE + ["--ray-address", "127.0.0.1:0"], "'127.0.0.1:0' is not a Ray address: allowed local, auto or host:port"),
    (["sweep", "s.yaml", "--ray-address", "host"], "'host' is not a Ray address"),
    (["estimate", "--model", "1" * 300], "argument --model: model '111"),  # too long a name for a file: not OSError
    (["estimate", "--hardware", "1" * 300], "argument --hardware:"),
    (["rl", "export", "1" * 300, "--out", "x"], "autotune rl export: error: '111"),
    (["rl", "export", "nope", "--out", "x"], "autotune rl export: error: 'nope': no such checkpoint; allowed a training run's folder (RUN), "),
    (["estimate", "--model", "x\ry\u2028z"], "argument --model: model x\\ry\\u2028z"),  # one line, whatever it holds
])
def test_bad_numbers_are_one_line_exit_2_and_write_nothing(argv, fragment, workdir, capsys):
    code, _, err = cli(argv, capsys)
    prog = "autotune " + " ".join(argv[:2] if argv[0] in ("surface", "rl") else argv[:1])
    one_line_error(code, err, prog, fragment)
    assert NINES not in err  # a huge value is named, not echoed in full
    assert list(workdir.iterdir()) == []


def test_values_at_the_limits_are_accepted(workdir, capsys):
    # a budget is at most the device's memory (autotune.values.settings.memory_budget): a device of 1024 TiB
    (workdir / "huge.yaml").write_text("base: a100-80gb\nmemory_bytes: 1024TiB\n")
    code, out, _ = cli(["estimate", "--gpus", "4096", "--global-batch", "4096", "--gpu-memory", "1024TiB",
                        "--hardware", "huge.yaml", "--top", "1", "--json"], capsys)
    assert code == 0 and '"memory_budget_bytes": 1125899906842624' in out


# -- seeds and the run directory ------------------------------------------------------------------------------

def test_a_refused_seed_leaves_no_run_directory_and_the_corrected_command_works(workdir, capsys):
    argv = FAST_TUNE + ["--strategy", "optuna", "--out", "run"]
    code, _, err = cli(argv + ["--seed", "1180591620717411303424"], capsys)
    one_line_error(code, err, "autotune tune", "--seed")
    assert not (workdir / "run").exists()
    code, _, err = cli(argv + ["--seed", str(2**32 - 1)], capsys)
    assert code == 0, err
    assert (workdir / "run" / "run.json").is_file() and (workdir / "run" / "trials.jsonl").is_file()


def test_a_new_sweep_that_fails_before_its_first_trial_leaves_no_sweep_behind(workdir, capsys, monkeypatch):
    """An error after run.json is written (an unreachable Ray cluster, say) takes it back: otherwise the
    corrected command is refused with 'already holds a sweep'."""
    real_open_sweep = tune_command.open_sweep

    def unreachable(stack, run_dir, *args, **kwargs):
        assert run_dir.settings_path.is_file()  # the failure comes after the sweep's settings were written
        raise ConfigError("--ray-address 10.0.0.1:6379: cannot connect to Ray")

    monkeypatch.setattr(tune_command, "open_sweep", unreachable)
    code, _, err = cli(FAST_TUNE + ["--out", "run"], capsys)
    one_line_error(code, err, "autotune tune", "cannot connect to Ray")
    assert sorted(p.name for p in (workdir / "run").iterdir()) == [".lock"]  # no run.json, no study.db
    (workdir / "run" / "logs").mkdir()  # what a failed op build or an internal error leaves: the corrected command adds to it
    (workdir / "run" / "logs" / "preflight.stderr").write_text("error: ...\n")
    monkeypatch.setattr(tune_command, "open_sweep", real_open_sweep)
    code, _, err = cli(FAST_TUNE + ["--out", "run"], capsys)
    assert code == 0, err
    settings = (workdir / "run" / "run.json").read_text()

    # A resumed sweep is never taken back, nor one with trials.
    monkeypatch.setattr(tune_command, "open_sweep", unreachable)
    code, _, err = cli(FAST_TUNE + ["--out", "run", "--resume"], capsys)
    one_line_error(code, err, "autotune tune", "cannot connect to Ray")
    assert (workdir / "run" / "run.json").read_text() == settings
    assert (workdir / "run" / "study.db").is_file() and (workdir / "run" / "trials.jsonl").is_file()


def test_a_flag_refused_by_the_command_writes_nothing(workdir, capsys):
    """--concurrency without --ray-address is refused by the command, not argparse: still before run.json."""
    code, _, err = cli(FAST_TUNE + ["--concurrency", "2", "--out", "run"], capsys)
    one_line_error(code, err, "autotune tune", "--concurrency 2: only with --ray-address")
    assert not (workdir / "run").exists()


@pytest.mark.parametrize("value", ["abc", "-1", "nan", NINES])
def test_a_bad_environment_variable_is_one_line_naming_it(value, workdir, capsys, monkeypatch):
    from autotune.backends.factory import SLEEP_ENV

    monkeypatch.setenv(SLEEP_ENV, value)
    code, _, err = cli(FAST_TUNE + ["--strategy", "random", "--out", "run"], capsys)
    one_line_error(code, err, "autotune tune", f"environment variable {SLEEP_ENV}=")
    assert not (workdir / "run" / "run.json").exists()


def test_files_read_are_checked_before_anything_starts(workdir, capsys):
    """--script and rl train --surface name the missing file first; a surface is read before Ray starts."""
    (workdir / "a-dir").mkdir()
    code, _, err = cli(FAST_TUNE + ["--script", "nope.py"], capsys)
    one_line_error(code, err, "autotune tune", "argument --script: 'nope.py': no such file")
    code, _, err = cli(FAST_TUNE + ["--script", "a-dir"], capsys)
    one_line_error(code, err, "autotune tune", "argument --script: 'a-dir' is not a regular file")
    code, _, err = cli(["rl", "train", "--backend", "replay", "--surface", "nope.jsonl"], capsys)
    one_line_error(code, err, "autotune rl train", "argument --surface: 'nope.jsonl': no such file")
    (workdir / "s.jsonl").write_bytes(b"\xff\xfe{}\n")
    code, _, err = cli(["rl", "train", "--out", "p", "--backend", "replay", "--surface", "s.jsonl"], capsys)
    one_line_error(code, err, "autotune rl train", "s.jsonl")
    assert sorted(p.name for p in workdir.iterdir()) == ["a-dir", "s.jsonl"]


def test_an_empty_model_or_space_file_is_called_empty_and_a_folder_not_a_hardware_name(workdir, capsys):
    (workdir / "empty.yaml").write_text("")
    code, _, err = cli(["estimate", "--model", "empty.yaml"], capsys)
    one_line_error(code, err, "autotune estimate", "empty.yaml: the file is empty: expected a mapping of model shape keys")
    code, _, err = cli(["estimate", "--space", "empty.yaml"], capsys)
    one_line_error(code, err, "autotune estimate", "empty.yaml: empty: expected a mapping of knob -> list of values")
    code, _, err = cli(["estimate", "--hardware", str(workdir)], capsys)  # a folder: never "unknown hardware"
    one_line_error(code, err, "autotune estimate", f"hardware {workdir}: not a file; allowed [")


# -- output paths ------------------------------------------------------------------------------------------------

@pytest.fixture
def read_only_dir(tmp_path, monkeypatch) -> Path:
    """A directory this process may not write: by its mode, or (as root, whom modes do not stop) by what
    os.access says of it, the check the validator makes."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if Path(path) == folder and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    yield folder


def bad_outputs(work: Path, read_only: Path) -> list[tuple[str, str]]:
    (work / "a-file").write_text("x")
    return [
        ("a-file", "'a-file' exists and is not a directory"),
        ("a-file/run", f"'a-file/run': {work / 'a-file'} is not a directory"),
        ("/dev/null/x", "'/dev/null/x': /dev/null is not a directory"),
        (str(read_only), "is not a writable directory"),
        (str(read_only / "run"), f"{read_only} is not a writable directory"),
        ("n" * 300, "a name of 300 bytes: allowed at most 255 bytes per name"),
        ("", "an empty path"),
    ]


@pytest.mark.parametrize("command", [
    FAST_TUNE + ["--out"],
    ["sweep", "s.yaml", "--out"],
    ["rl", "train", "--out"],
    ["rl", "export", "/", "--out"],  # any existing directory passes as the checkpoint here
    ["trial", "--zero-stage", "1", "--micro-batch", "1", "--precision", "bf16", "--run-dir"],
    ["surface", "record", "--backend", "simulated", "--out", "s.jsonl", "--logs"],
])
def test_bad_output_directories_are_one_line_naming_the_path(command, workdir, read_only_dir, capsys):
    prog = "autotune " + " ".join(command[:2] if command[0] in ("surface", "rl") else command[:1])
    for path, fragment in bad_outputs(workdir, read_only_dir):
        code, _, err = cli(command + [path], capsys)
        one_line_error(code, err, prog, f"argument {command[-1]}:", fragment)
    assert sorted(p.name for p in workdir.iterdir()) == ["a-file"]


def test_bad_surface_files_are_one_line_naming_the_path(workdir, read_only_dir, capsys):
    (workdir / "a-dir").mkdir()
    (workdir / "a-file").write_text("x")
    record = ["surface", "record", "--backend", "simulated", "--out"]
    for path, fragment in [("a-dir", "'a-dir' is a directory: name a file (e.g. a-dir/out.jsonl)"),
                           (".", "'.' is a directory"),
                           ("a-file/s.jsonl", "is not a directory"),
                           ("/dev/null/s.jsonl", "/dev/null is not a directory"),
                           (str(read_only_dir / "s.jsonl"), "is not a writable directory"),
                           ("/dev/null", "'/dev/null' is not a regular file"),
                           ("new/", "ends with '/': name a file"),
                           ("s" * 300 + ".jsonl", "a name of 306 bytes")]:
        code, _, err = cli(record + [path], capsys)
        one_line_error(code, err, "autotune surface record", "argument --out:", fragment)
    code, _, err = cli(["report", "a-file"], capsys)
    one_line_error(code, err, "autotune report", "'a-file' exists and is not a directory")
    code, _, err = cli(["report", "nowhere"], capsys)
    one_line_error(code, err, "autotune report", "'nowhere': no such directory")
    assert sorted(p.name for p in workdir.iterdir()) == ["a-dir", "a-file"]


def test_a_writable_output_is_accepted_and_created_with_its_parents(workdir, capsys):
    code, _, err = cli(["surface", "record", "--backend", "simulated", "--limit", "2", "--out", "a/b/s.jsonl"], capsys)
    assert code == 0, err
    assert len((workdir / "a" / "b" / "s.jsonl").read_text().splitlines()) == 2


def test_a_directory_that_cannot_be_created_is_a_config_error_naming_it(workdir, capsys):
    (workdir / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"--out a-file/x: cannot create the directory: Not a directory"):
        make_dir(Path("a-file/x"), "--out")
    # The default run directory is not a flag argparse checks: `runs` here is a file.
    (workdir / "runs").write_text("x")
    code, _, err = cli(FAST_TUNE, capsys)
    one_line_error(code, err, "autotune tune", "the default run directory runs/tiny-", "cannot create the directory")


# -- the top-level guard -------------------------------------------------------------------------------------

def boom(args):
    raise RuntimeError("a bug\nover two lines")


def test_an_internal_error_is_one_line_naming_its_log(workdir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(estimate_command, "run", boom)
    code, out, err = cli(["estimate"], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1, err
    log = tmp_path / "cache" / "ds-autotune" / "last-error.log"
    assert err == f"autotune estimate: internal error: RuntimeError: a bug over two lines (traceback in {log})\n"
    text = log.read_text()
    assert text.startswith("Traceback (most recent call last):") and "in boom" in text and "a bug" in text


@pytest.mark.parametrize("argv", [["--debug", "estimate"], ["estimate", "--debug"]])
def test_debug_prints_the_traceback_too(argv, workdir, capsys, monkeypatch):
    monkeypatch.setattr(estimate_command, "run", boom)
    code, _, err = cli(argv, capsys)
    lines = err.splitlines()
    assert code == 1 and lines[0] == "Traceback (most recent call last):" and any("in boom" in line for line in lines)
    assert lines[-1].startswith("autotune estimate: internal error: RuntimeError: a bug over two lines (traceback in ")


def test_debug_is_off_unless_asked(workdir, capsys):
    from autotune.cli import build_parser

    assert build_parser().parse_args(["estimate"]).debug is False
    assert build_parser().parse_args(["--debug", "estimate"]).debug is True


def test_an_internal_error_of_a_sweep_is_logged_in_its_run_directory(workdir, capsys, monkeypatch):
    def crash(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(tune_command, "open_sweep", crash)
    code, _, err = cli(FAST_TUNE + ["--out", "run"], capsys)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("autotune tune: internal error: ZeroDivisionError: division by zero (traceback in run/logs/error-")
    logs = list((workdir / "run" / "logs").iterdir())
    assert len(logs) == 1 and "ZeroDivisionError" in logs[0].read_text()
    assert not (workdir / "run" / "run.json").exists()  # nothing ran: the corrected command starts afresh


def test_an_error_raised_while_parsing_is_guarded_too(workdir, capsys, monkeypatch):
    import autotune.commands.common as common

    def broken_loader(text):
        raise KeyError(text)  # argparse lets through anything but ArgumentTypeError, TypeError, ValueError

    monkeypatch.setattr(common, "load_model", broken_loader)
    code, _, err = cli(["estimate", "--model", "tiny"], capsys)
    assert code == 1 and err.count("\n") == 1 and err.startswith("autotune: internal error: KeyError: 'tiny' (traceback in ")


def test_the_log_falls_back_to_a_new_temp_file_and_never_follows_a_symlink(workdir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(estimate_command, "run", boom)
    cache = tmp_path / "cache" / "ds-autotune"
    cache.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (cache / "last-error.log").symlink_to(victim)
    code, _, err = cli(["estimate"], capsys)
    assert code == 1 and victim.read_text() == "keep me"
    assert not (cache / "last-error.log").is_symlink() and "a bug" in (cache / "last-error.log").read_text()

    monkeypatch.setenv("XDG_CACHE_HOME", str(victim))  # a file: the cache cannot be used
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    code, _, err = cli(["estimate"], capsys)
    (log,) = temp.iterdir()
    assert code == 1 and f"(traceback in {log})" in err and "a bug" in log.read_text()


def test_config_errors_interrupts_and_argparse_errors_keep_their_exit_codes(workdir, capsys, monkeypatch):
    def refuse(args):
        raise ConfigError("--thing 3: allowed 1\n  or 2")  # kept on one line

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(estimate_command, "run", refuse)
    assert cli(["estimate"], capsys)[1:] == ("", "autotune estimate: error: --thing 3: allowed 1 or 2\n")
    monkeypatch.setattr(estimate_command, "run", interrupted)
    assert cli(["estimate"], capsys) == (130, "", "autotune estimate: interrupted\n")
    code, _, err = cli(["estimate", "--no-such-flag"], capsys)
    one_line_error(code, err, "autotune estimate", "unrecognized arguments: --no-such-flag")  # the command's name
    code, _, err = cli(["no-such-command"], capsys)
    assert code == 2 and "invalid choice: 'no-such-command'" in err


def test_a_reader_that_leaves_early_is_not_a_traceback(tmp_path):
    """`autotune estimate --json | head -c 1`: the broken pipe ends the command quietly, exit 0 (as `git log`)."""
    process = subprocess.Popen([sys.executable, "-m", "autotune.cli", "estimate", "--json", "--top", "200"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                               env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.read(1) == b"{"
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipeError" not in err, err


def test_make_dir_names_the_file_system_error(tmp_path):
    with pytest.raises(ConfigError) as refused:
        make_dir(tmp_path / ("n" * 300), "--logs")
    assert str(refused.value).endswith(f"cannot create the directory: {os.strerror(errno.ENAMETOOLONG)}")
