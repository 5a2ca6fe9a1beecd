"""The bad-input corpus (corpus.yaml beside this file): loading it, preparing each entry's files, and running
an entry in-process (`autotune.cli.main`) or as a subprocess (`python -m autotune.cli`, as a user would).

Used by tests/test_properties.py (in-process, one test per entry) and benchmarks/robustness.py (subprocesses).

An entry of corpus.yaml:

    - label: short name (unique)
      category: what kind of bad input (overflow, encoding, hardware, paths, json-lines, ...)
      argv: [command, flags...]        # run with the entry's own empty folder as the working directory
      exit: 2                          # expected exit code (default 2); a list allows either
      setup: [run, surface, file]      # templates copied in first: a recorded simulated run (./run),
                                       # a simulated surface (./surface.jsonl), a plain file (./a_file)
      remove: [path], mkdir: [path]    # then, in this order: paths removed, folders made,
      files: {path: text}              # files written (UTF-8),
      latin1_files: {path: text}       # files written byte for byte ("\xff\xfe" is two bytes),
      append: {path: text}             # text appended, and
      json_set: {path: {key: value}}   # keys of a JSON file replaced (a dotted key reaches inside)
      symlinks: {path: target}         # symbolic links made (after the files; an existing path is replaced)
      env: {NAME: value}               # environment variables of the command
      mentions: [text]                 # the error line must contain each (the bad value, the file)
      then: {argv: [...], exit: 0}     # a follow-up command (the corrected one) and its expected exit
      isolate: true                    # tests run it as a subprocess too (it may block in native code)

Placeholders in argv, file texts and env values: {huge} (400 nines), {long} (a 300-character name),
{tmp} (the entry's folder, absolute). A bad input (exit 2) is clean when its stderr is one line starting with
`autotune`, without a traceback, naming what `mentions` lists, and every file of the recorded run it was
given (run.json, trials.jsonl) is byte-identical afterwards; a fine input (exit 0), or a sweep's verdict
(exit 1: nothing fits) where an entry allows it, is clean when it exits so without a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
CORPUS = HERE / "corpus.yaml"
REPO = HERE.parent.parent
SUBSTITUTIONS = {"{huge}": "9" * 400, "{long}": "x" * 300}
RECORDED = ("run/run.json", "run/trials.jsonl")  # what a bad input must leave byte-identical


@dataclass(frozen=True)
class Entry:
    label: str
    category: str
    argv: tuple[str, ...]
    expected: tuple[int, ...]
    raw: dict[str, Any] = field(repr=False, compare=False, hash=False)

    @property
    def command(self) -> str:
        """The command as a user names it: `tune`, `surface show`, `rl train`, ..."""
        head = self.argv[0] if self.argv else ""
        if head not in ("estimate", "tune", "report", "trial", "surface", "rl", "sweep"):
            return "(top level)"  # no command, an unknown one, a flag before any
        if head in ("surface", "rl") and len(self.argv) > 1 and not self.argv[1].startswith("-"):
            return f"{head} {self.argv[1]}"
        return head


@dataclass(frozen=True)
class Outcome:
    entry: Entry
    exit_code: int | None  # None: an exception escaped main (in-process) or the process timed out
    stderr: str
    problem: str | None  # None: clean

    @property
    def clean(self) -> bool:
        return self.problem is None


def load_corpus(path: Path = CORPUS) -> list[Entry]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    entries = []
    for raw in data["entries"]:
        expected = raw.get("exit", 2)
        entries.append(Entry(raw["label"], raw.get("category", "flags"), tuple(str(a) for a in raw["argv"]),
                             tuple(expected) if isinstance(expected, list) else (int(expected),), raw))
    labels = [e.label for e in entries]
    duplicates = {label for label in labels if labels.count(label) > 1}
    if duplicates:
        raise ValueError(f"{path}: labels used twice: {sorted(duplicates)}")
    return entries


def expand(text: str, folder: Path) -> str:
    for key, value in SUBSTITUTIONS.items():
        text = text.replace(key, value)
    return text.replace("{tmp}", str(folder))


@lru_cache(maxsize=None)
def templates() -> Path:
    """A recorded simulated run (3 trials) and a simulated surface of the tiny model, made once per process."""
    root = Path(tempfile.mkdtemp(prefix="autotune-corpus-templates-"))
    for argv in (["tune", "--backend", "simulated", "--strategy", "random", "--trials", "3", "--out", f"{root}/run"],
                 ["surface", "record", "--backend", "simulated", "--out", f"{root}/surface.jsonl", "--limit", "12"]):
        code, stderr = call_main(argv)
        if code != 0:
            raise RuntimeError(f"corpus template `autotune {' '.join(argv)}` failed: {stderr[-2000:]}")
    (root / "a_file").write_text("a plain file\n")
    return root


def prepare(entry: Entry, folder: Path) -> None:
    """Lay out the entry's files in `folder` (its working directory)."""
    raw = entry.raw
    source = templates()
    for name in raw.get("setup", []):
        target = {"run": "run", "surface": "surface.jsonl", "file": "a_file"}[name]
        if (source / target).is_dir():
            shutil.copytree(source / target, folder / target, ignore=shutil.ignore_patterns(".lock"))
        else:
            shutil.copy2(source / target, folder / target)
    for name in raw.get("remove", []):
        path = folder / expand(name, folder)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for name in raw.get("mkdir", []):
        (folder / expand(name, folder)).mkdir(parents=True)
    for name, text in (raw.get("files") or {}).items():
        path = folder / expand(name, folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(expand(text, folder), encoding="utf-8")
    for name, text in (raw.get("latin1_files") or {}).items():
        path = folder / expand(name, folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(expand(text, folder).encode("latin-1"))
    for name, text in (raw.get("append") or {}).items():
        with open(folder / name, "a", encoding="utf-8") as out:
            out.write(expand(text, folder))
    for name, target in (raw.get("symlinks") or {}).items():  # the link replaces whatever is there
        link = folder / expand(name, folder)
        link.unlink(missing_ok=True)
        link.symlink_to(expand(target, folder))
    for name, changes in (raw.get("json_set") or {}).items():
        path = folder / name
        data = json.loads(path.read_text())
        for key, value in changes.items():
            *parents, last = key.split(".")
            node = data
            for parent in parents:
                node = node[parent]
            node[last] = value
        path.write_text(json.dumps(data))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in RECORDED if (folder / name).is_file()}


def judge(entry: Entry, exit_code: int | None, stderr: str, before: dict[str, bytes], folder: Path,
          expected: tuple[int, ...] | None = None, mentions: list[str] | None = None) -> str | None:
    """None if the outcome is what the entry promises, else what is wrong (one line)."""
    expected = expected or entry.expected
    lines = [line for line in stderr.splitlines() if line.strip()]
    if "Traceback" in stderr:
        return f"traceback ({lines[-1] if lines else ''})"
    if exit_code not in expected:
        last = lines[-1] if lines else "(no stderr)"
        return f"exit {exit_code}, expected {'/'.join(map(str, expected))}: {last[:200]}"
    if exit_code == 2:
        if len(lines) != 1:
            return f"{len(lines)} lines on stderr, expected one: {' | '.join(lines)[:300]}"
        if not lines[0].startswith("autotune"):
            return f"error line does not start with the program name: {lines[0][:200]}"
        for text in mentions if mentions is not None else entry.raw.get("mentions", []):
            if expand(str(text), folder) not in lines[0]:
                return f"error does not name {text!r}: {lines[0][:200]}"
        after = snapshot(folder)
        changed = [name for name in before if after.get(name) != before[name]]
        if changed:
            return f"changed recorded files: {changed}"
    return None


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOTUNE_", "RAY_"))}
    env.update(extra)
    return env


def run_subprocess(entry: Entry, folder: Path, timeout_s: float = 120.0) -> Outcome:
    """Run the entry as a user would: `python -m autotune.cli ARGV` in its folder."""
    prepare(entry, folder)
    before = snapshot(folder)
    env = _env({k: expand(str(v), folder) for k, v in (entry.raw.get("env") or {}).items()})
    code, stderr = _spawn(entry.argv, folder, env, timeout_s)
    problem = judge(entry, code, stderr, before, folder)
    if problem is None and "then" in entry.raw:
        then = entry.raw["then"]
        code, stderr = _spawn(tuple(str(a) for a in then["argv"]), folder, env, timeout_s)
        problem = judge(entry, code, stderr, {}, folder, expected=(int(then.get("exit", 0)),), mentions=[])
        problem = problem and f"follow-up `{' '.join(then['argv'])}`: {problem}"
    return Outcome(entry, code, stderr, problem)


def _spawn(argv: tuple[str, ...], folder: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    args = [expand(a, folder) for a in argv]
    try:
        done = subprocess.run([sys.executable, "-m", "autotune.cli", *args], cwd=folder, env=env,
                              capture_output=True, text=True, errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        return None, f"timed out after {timeout_s:.0f} s; stderr so far: {err.stderr!r}"[:500]
    return done.returncode, done.stderr


def run_in_process(entry: Entry, folder: Path) -> Outcome:
    """Run the entry through `autotune.cli.main` in this process, with `folder` as the working directory.
    The caller sets the entry's environment (pytest's monkeypatch) and restores the working directory."""
    prepare(entry, folder)
    before = snapshot(folder)
    os.chdir(folder)
    code, stderr = call_main([expand(a, folder) for a in entry.argv])
    problem = judge(entry, code, stderr, before, folder)
    if problem is None and "then" in entry.raw:
        then = entry.raw["then"]
        code, stderr = call_main([expand(str(a), folder) for a in then["argv"]])
        problem = judge(entry, code, stderr, {}, folder, expected=(int(then.get("exit", 0)),), mentions=[])
        problem = problem and f"follow-up `{' '.join(then['argv'])}`: {problem}"
    return Outcome(entry, code, stderr, problem)


def call_main(argv: list[str]) -> tuple[int | None, str]:
    """(exit code, stderr) of `autotune.cli.main(argv)`; an exception that escapes main is reported as a
    traceback on stderr, as the user would see it."""
    import traceback

    from autotune.cli import main

    err, out = io.StringIO(), io.StringIO()
    code: int | None
    # Warnings are recorded, not printed: in one process a library warns about what an earlier command did
    # (gymnasium: "Overriding environment ... already in registry"); the subprocess runs show what users see.
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), warnings.catch_warnings(record=True):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException:  # noqa: BLE001 - any escape is the finding
            code = None
            err.write(traceback.format_exc())
    return code, err.getvalue()
