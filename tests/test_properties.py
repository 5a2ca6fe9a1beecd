"""Property-based tests (Hypothesis) of every input the user controls (issue 14): the CLI's flags with
arbitrary text, each file loader (space, hardware, sweep, surface, trials, run.json) with arbitrary bytes and
arbitrary JSON/YAML values. Whatever the input: no traceback, exit 0 or 2 with one line on stderr, the
loaders raise ConfigError or return a value, and a bad input leaves the recorded run byte-identical.
The last test runs every entry of the bad-input corpus (tests/bad_inputs/corpus.yaml) in-process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from autotune.backends.replay import load_surface
from autotune.cli import build_parser
from autotune.values.config import ConfigError
from autotune.values.hardware import load_hardware
from autotune.values.results import read_results
from autotune.search.rundir import RunDir
from autotune.search_spaces import load_choices
from autotune.commands.sweep_file import load_sweep

sys.path.insert(0, str(Path(__file__).parent / "bad_inputs"))
import corpus  # noqa: E402  (tests/bad_inputs/corpus.py: the corpus and its runner)

# Modest and unhurried: these run in CI with the rest of the suite. No example database (no .hypothesis/
# folder in the working tree); a failure prints the falsifying example to reproduce it. Derandomized, so CI
# tries the same examples every run (a red CI is a change's, not a draw's); HYPOTHESIS_EXPLORE=1 draws new
# ones, to look for inputs not tried yet.
FAST = settings(max_examples=30, deadline=None, database=None, derandomize="HYPOTHESIS_EXPLORE" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
RUNS = settings(FAST, max_examples=12)  # each example runs a sweep or regenerates a report (~0.5 s)

# Text a user could type, biased towards what parsers choke on: numbers of every size and sign, sizes and
# durations with units, nan/inf, control characters, surrogates-free unicode.
NUMBERS = st.one_of(st.integers(-10**30, 10**30).map(str), st.integers(10**300, 10**500).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr),
                    st.sampled_from(["nan", "inf", "-inf", "1e400", "-0", "0x10", "1_000", " 5 ", "", "٣"]))
UNITS = st.sampled_from(["", "B", "KB", "MiB", "GiB", "TiB", "GB", "XB", "s", "m", "h", "d", "%"])
TEXT = st.one_of(st.text(max_size=30), NUMBERS, st.tuples(NUMBERS, UNITS).map("".join))

# JSON/YAML values of every shape
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-10**25, 10**25), st.integers(10**300, 10**400),
                   st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                   st.sampled_from(["ok", "oom", "bf16", "cpu", "none", "tiny", "a100-80gb", "48GiB", "768e9"]))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                      max_leaves=12)
BYTES = st.one_of(st.binary(max_size=200), st.binary(max_size=40).map(lambda b: b"\xff\xfe" + b))


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No inherited hook or cluster address, and a scratch working directory (`runs/` defaults land there)."""
    for name in list(os.environ):
        if name.startswith(("AUTOTUNE_", "RAY_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A fresh folder per Hypothesis example (function-scoped fixtures are shared by all examples)."""
    with tempfile.TemporaryDirectory(prefix="autotune-prop-") as folder:
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            yield Path(folder)
        finally:
            os.chdir(cwd)


def assert_clean(argv: list[str], code: int | None, stderr: str) -> None:
    """Exit 0, or exit 2 with one line `autotune ...: error: ...`, or `tune`'s verdict that nothing fits
    (exit 1, said on stdout); never a traceback, never the top-level guard's internal error."""
    where = f"autotune {' '.join(argv)!r}"
    assert "Traceback (most recent call last)" not in stderr, f"{where}: traceback:\n{stderr}"
    verdict = argv[0] == "tune" and code == 1 and not stderr.strip()
    assert code in (0, 2) or verdict, f"{where}: exit {code}: {stderr[-2000:]}"
    if code == 2:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("autotune"), f"{where}: stderr is not one line: {stderr!r}"


def run_cli(argv: list[str]) -> tuple[int | None, str]:
    code, stderr = corpus.call_main(argv)
    assert_clean(argv, code, stderr)
    return code, stderr


def copy_run(folder: Path) -> Path:
    """A recorded simulated run (3 trials) of the corpus' templates, copied into `folder`."""
    target = folder / "run"
    shutil.copytree(corpus.templates() / "run", target, ignore=shutil.ignore_patterns(".lock"))
    return target


def recorded(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes() for name in ("run.json", "trials.jsonl") if (run / name).is_file()}


# ---------------------------------------------------------------------------------------------------------
# (i) the argument parsers: any text for any flag of any command parses or exits 2 with one line

def _flags() -> list[tuple[list[str], str]]:
    """(command path, option) for every option that takes a value, of every command and subcommand."""
    import argparse

    out: list[tuple[list[str], str]] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and action.nargs != 0 and action.dest != "help":
                out.append((path, action.option_strings[-1]))
    walk(build_parser(), [])
    return out


FLAGS = _flags()


def test_every_command_has_flags_under_test() -> None:
    commands = {" ".join(path) for path, _ in FLAGS}
    assert {"estimate", "tune", "trial", "surface record", "surface show", "rl train", "rl export", "sweep"} <= commands


@FAST
@given(flag=st.sampled_from(FLAGS), value=TEXT)
def test_argument_parser_any_text(flag: tuple[list[str], str], value: str) -> None:
    """Parsing only (no command runs): the value is checked where it enters, one line or a value."""
    path, option = flag
    argv = [*path, f"{option}={value}"]
    with contextlib.redirect_stderr(err := __import__("io").StringIO()), contextlib.redirect_stdout(None):
        try:
            build_parser().parse_known_args(argv)
            code = 0
        except SystemExit as done:
            code = int(done.code or 0)
    assert_clean(argv, code, err.getvalue())


ESTIMATE_FLAGS = ["--gpu-memory", "--top", "--gpus", "--global-batch", "--seq-len", "--hardware", "--space", "--model"]


@FAST
@given(option=st.sampled_from(ESTIMATE_FLAGS), value=TEXT)
def test_estimate_any_flag_value(option: str, value: str) -> None:
    with scratch():
        run_cli(["estimate", "--top", "2", f"{option}={value}"])


@RUNS
@given(option=st.sampled_from(["--memory-budget", "--seed", "--time-budget", "--seq-len", "--strategy",
                               "--hardware", "--memory-budget", "--concurrency", "--gpus-per-trial"]), value=TEXT)
def test_tune_simulated_any_flag_value(option: str, value: str) -> None:
    with scratch() as folder:
        run_cli(["tune", "--backend", "simulated", "--strategy", "random", "--trials", "2", "--out",
                 str(folder / "r"), f"{option}={value}"])


@FAST
@given(option=st.sampled_from(["--top", "--memory-budget"]), value=TEXT)
def test_surface_show_any_flag_value(option: str, value: str) -> None:
    with scratch() as folder:
        shutil.copy(corpus.templates() / "surface.jsonl", folder / "s.jsonl")
        run_cli(["surface", "show", str(folder / "s.jsonl"), f"{option}={value}"])


# ---------------------------------------------------------------------------------------------------------
# (ii) the file loaders: arbitrary bytes and arbitrary JSON/YAML values give ConfigError or a value

def only_config_error(load, *args: Any) -> None:
    try:
        load(*args)
    except ConfigError:
        pass


def yaml_text(value: Any) -> str:
    return yaml.safe_dump(value, allow_unicode=True)


SPACE_DOC = {"zero_stage": [0, 1], "micro_batch": [1, 2], "ckpt_interval": [0], "precision": ["bf16"]}
HARDWARE_DOC = {"base": "a100-80gb", "name": "x", "memory_bytes": "48GiB", "mem_bandwidth": 768e9}
SWEEP_DOC = {"defaults": {"backend": "simulated", "trials": 2}, "workloads": [{"name": "a", "model": "tiny"}]}


def replace_one(doc: Any, data: st.DataObject) -> Any:
    """`doc` with one value somewhere inside it replaced by an arbitrary one (or a key added)."""
    doc = json.loads(json.dumps(doc))
    node = doc
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys + ["new-key"]) if isinstance(node, dict) else st.sampled_from(keys))
        child = node.get(key) if isinstance(node, dict) else node[key]
        if isinstance(child, (dict, list)) and child and data.draw(st.booleans()):
            node = child
            continue
        node[key] = data.draw(VALUES)
        return doc


@FAST
@given(content=BYTES)
def test_loaders_any_bytes(content: bytes) -> None:
    with scratch() as folder:
        for name, load in [("space.yaml", load_choices), ("hw.yaml", load_hardware), ("sweep.yaml", load_sweep),
                           ("s.jsonl", load_surface), ("trials.jsonl", read_results)]:
            (folder / name).write_bytes(content)
            only_config_error(load, str(folder / name))
        run = copy_run(folder)
        (run / "run.json").write_bytes(content)
        only_config_error(RunDir(run).read_settings)


@FAST
@given(value=VALUES)
def test_yaml_loaders_any_value(value: Any) -> None:
    with scratch() as folder:
        for name, load in [("space.yaml", load_choices), ("hw.yaml", load_hardware), ("sweep.yaml", load_sweep)]:
            (folder / name).write_text(yaml_text(value))
            only_config_error(load, str(folder / name))


@FAST
@given(data=st.data())
def test_space_file_one_value_changed(data: st.DataObject) -> None:
    """A space YAML that loads must give a space `estimate` can rank, or a one-line error."""
    with scratch() as folder:
        (folder / "space.yaml").write_text(yaml_text(replace_one(SPACE_DOC, data)))
        run_cli(["estimate", "--top", "2", "--space", str(folder / "space.yaml")])


@FAST
@given(data=st.data())
def test_hardware_file_one_value_changed(data: st.DataObject) -> None:
    """A hardware YAML that loads must be a profile `estimate` can use, or a one-line error."""
    with scratch() as folder:
        (folder / "hw.yaml").write_text(yaml_text(replace_one(HARDWARE_DOC, data)))
        run_cli(["estimate", "--top", "2", "--model", "gpt2-small", "--hardware", str(folder / "hw.yaml")])


@FAST
@given(data=st.data())
def test_sweep_file_one_value_changed(data: st.DataObject) -> None:
    with scratch() as folder:
        (folder / "sweep.yaml").write_text(yaml_text(replace_one(SWEEP_DOC, data)))
        only_config_error(load_sweep, folder / "sweep.yaml")


def _template_line(name: str) -> dict[str, Any]:
    return json.loads((corpus.templates() / name).read_text().splitlines()[0])


@FAST
@given(data=st.data(), whole=VALUES)
def test_surface_line_any_value(data: st.DataObject, whole: Any) -> None:
    """A surface with one arbitrary line (a whole value, or one field of a real line changed): `surface show`
    shows it or refuses it in one line, and the loader raises nothing but ConfigError."""
    line = whole if data.draw(st.booleans()) else replace_one(_template_line("surface.jsonl"), data)
    with scratch() as folder:
        surface = folder / "s.jsonl"
        shutil.copy(corpus.templates() / "surface.jsonl", surface)
        with surface.open("a") as out:
            out.write(json.dumps(line) + "\n")
        only_config_error(load_surface, surface)
        run_cli(["surface", "show", str(surface), "--top", "3"])


@RUNS
@given(data=st.data(), whole=VALUES)
def test_trials_line_any_value(data: st.DataObject, whole: Any) -> None:
    """A recorded run whose trials.jsonl has one arbitrary line, then a good one: `report` regenerates or
    refuses in one line, and never changes the record."""
    line = whole if data.draw(st.booleans()) else replace_one(_template_line("run/trials.jsonl"), data)
    with scratch() as folder:
        run = copy_run(folder)
        good = (run / "trials.jsonl").read_text().splitlines()[0]
        with (run / "trials.jsonl").open("a") as out:
            out.write(json.dumps(line) + "\n" + good + "\n")
        only_config_error(read_results, run / "trials.jsonl")
        before = recorded(run)
        code, _ = run_cli(["report", str(run)])
        assert recorded(run) == before


@RUNS
@given(data=st.data(), whole=VALUES)
def test_run_settings_any_value(data: st.DataObject, whole: Any) -> None:
    """run.json as any JSON value, or with one value changed: read as settings or ConfigError; `report`
    and `tune --resume` regenerate or refuse in one line without touching the record."""
    with scratch() as folder:
        run = copy_run(folder)
        settings_doc = json.loads((run / "run.json").read_text())
        changed = whole if data.draw(st.booleans()) else replace_one(settings_doc, data)
        (run / "run.json").write_text(json.dumps(changed))
        only_config_error(RunDir(run).read_settings)
        before = recorded(run)
        code, _ = run_cli(["report", str(run)])
        assert recorded(run) == before
        code, _ = run_cli(["tune", "--backend", "simulated", "--strategy", "random", "--trials", "3",
                           "--out", str(run), "--resume"])
        if code == 2:
            assert recorded(run) == before


# ---------------------------------------------------------------------------------------------------------
# (iii) nothing changed: a bad flag given to `report` or `tune --resume` leaves the record byte-identical

RESUME = ["tune", "--backend", "simulated", "--strategy", "random", "--trials", "4", "--resume"]


@RUNS
@given(option=st.sampled_from(["--memory-budget", "--seed", "--time-budget", "--trials", "--gpus", "--global-batch",
                               "--seq-len", "--hardware", "--space", "--strategy", "--surface", "--model"]),
       value=TEXT)
def test_resume_with_any_flag_value_changes_nothing_when_refused(option: str, value: str) -> None:
    with scratch() as folder:
        run = copy_run(folder)
        before = recorded(run)
        code, _ = run_cli([*RESUME, "--out", str(run), f"{option}={value}"])
        if code == 2:
            assert recorded(run) == before
        else:  # resumed: the recorded trials are still the first lines, in order, unchanged
            assert (run / "trials.jsonl").read_bytes().startswith(before["trials.jsonl"])


def test_report_of_a_bad_record_changes_nothing() -> None:
    """The example of the issue: a wrong-shaped line in trials.jsonl; report refuses, the file is as it was."""
    with scratch() as folder:
        run = copy_run(folder)
        with (run / "trials.jsonl").open("a") as out:
            out.write('{"config": 5}\n')
        before = recorded(run)
        code, stderr = run_cli(["report", str(run)])
        assert code == 2 and "trials.jsonl" in stderr
        code, stderr = run_cli([*RESUME, "--out", str(run)])
        assert code == 2 and "trials.jsonl" in stderr
        assert recorded(run) == before


@pytest.mark.parametrize("tail", ["newline lost", "torn"])
def test_resume_after_a_broken_last_line_loses_nothing(tail: str) -> None:
    """The data-loss example of the issue: `truncate -s -1 RUN/trials.jsonl` (the last trial complete, only its
    newline lost), or a torn last line; `--resume` keeps every complete trial in place and numbers the new ones
    after them, each number once."""
    with scratch() as folder:
        run = copy_run(folder)
        trials = run / "trials.jsonl"
        kept = trials.read_bytes().splitlines()
        if tail == "newline lost":
            os.truncate(trials, trials.stat().st_size - 1)
        else:
            with trials.open("ab") as out:
                out.write(b'{"config": {"zero_stage": 1, "micro_')
        run_cli([*RESUME, "--out", str(run)])
        lines = trials.read_bytes().splitlines()
        assert lines[:len(kept)] == kept
        assert [json.loads(line)["trial"] for line in lines] == list(range(1, len(lines) + 1))
        assert len(lines) == 4


# ---------------------------------------------------------------------------------------------------------
# the corpus: every entry gives what it promises (exit code, one line naming the value, nothing changed)

CORPUS = corpus.load_corpus()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("entry", CORPUS, ids=[e.label for e in CORPUS])
def test_corpus_entry(entry: corpus.Entry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus.templates()  # made before the entry's environment, which may hold a bad variable for the command
    for name, value in (entry.raw.get("env") or {}).items():
        monkeypatch.setenv(name, corpus.expand(str(value), tmp_path))
    if entry.raw.get("isolate"):  # Ray's connection retries block in native code: a timeout must end them
        outcome = corpus.run_subprocess(entry, tmp_path, timeout_s=90)
    else:
        outcome = corpus.run_in_process(entry, tmp_path)
    assert outcome.clean, f"{entry.command}: {entry.label}: {outcome.problem}\n{outcome.stderr[-3000:]}"
