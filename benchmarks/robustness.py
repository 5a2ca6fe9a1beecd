"""Robustness: every bad input of the corpus gives a one-line error, and every injected fault is survived.

1. The corpus (tests/bad_inputs/corpus.yaml): each entry runs as a user runs it, `python -m autotune.cli ARGV`
   in a fresh folder, and is clean when it exits as promised (2 for a bad input) with one line on stderr
   naming the value, no traceback, and the recorded run it was given byte-identical. Tried / clean per
   command and category; every unclean input is listed.
2. Faults, each checked for "nothing lost" (every trial recorded before the fault is still in trials.jsonl,
   at its place, byte for byte; trials numbered 1..N once each; the resumed sweep completes its budget):
   - SIGKILL, SIGTERM, SIGINT of `autotune tune --backend simulated` (trials slowed by
     AUTOTUNE_SIMULATED_TRIAL_SLEEP_S) at random moments, then `--resume`;
   - a torn last line of trials.jsonl (a write cut short), and a complete last line missing only its newline;
   - two tuners on one run directory: the second is refused in one line, the first goes on;
   - an unreachable `--ray-address`: one line, exit 2, within 30 s;
   - a full disk under study.db (Optuna's StorageInternalError from SQLAlchemy's "database or disk is full",
     injected): one line naming study.db and "no space left", exit 1, nothing lost, then --resume;
   - /dev/shm segments of another run's SIGKILLed tuner (planted with its owner marker): gone after the start
     of a simulated sweep of another run; a live runner's kept;
   - one real DeepSpeed trial whose tuner is killed with SIGKILL: its /dev/shm segments are gone after the
     next start (`--resume`) (skip with --no-real);
   - with --ray: a tuner driving a local Ray instance killed with SIGKILL, then resumed.

    python benchmarks/robustness.py [--jobs 2] [--rounds 3] [--no-real] [--ray] [--only TEXT] [--no-faults]
                                    [--no-corpus] [--in-process]

Writes benchmarks/results/robustness.md and robustness.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent / "tests" / "bad_inputs"))
import corpus  # noqa: E402  (the corpus and its runner, shared with tests/test_properties.py)

SLEEP_ENV = "AUTOTUNE_SIMULATED_TRIAL_SLEEP_S"
TRIALS = 8
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
STRATEGIES = ("random", "optuna", "hybrid", "grid")


# ---------------------------------------------------------------------------------------------------------
# 1. the corpus

def run_corpus(entries: list[corpus.Entry], jobs: int, timeout_s: float, in_process: bool) -> list[corpus.Outcome]:
    corpus.templates()  # made once, before the workers share it
    root = Path(tempfile.mkdtemp(prefix="robustness-corpus-"))
    outcomes: list[corpus.Outcome] = []
    with Progress() as progress, ThreadPoolExecutor(max(1, jobs)) as pool:
        task = progress.add_task("bad inputs", total=len(entries))

        def one(args: tuple[int, corpus.Entry]) -> corpus.Outcome:
            i, entry = args
            folder = root / f"{i:04d}"
            folder.mkdir()
            try:
                if in_process and not entry.raw.get("isolate"):
                    return in_process_run(entry, folder)
                return corpus.run_subprocess(entry, folder, timeout_s)
            except Exception as err:  # noqa: BLE001 - a broken entry is reported, not fatal
                return corpus.Outcome(entry, None, "", f"could not run the entry: {err!r}")

        for outcome in (map if in_process else pool.map)(one, enumerate(entries)):
            outcomes.append(outcome)
            if not outcome.clean:
                progress.console.print(f"[red]unclean[/red] {escape(f'[{outcome.entry.command}] {outcome.entry.label}: {outcome.problem}')}",
                                       markup=True, highlight=False)
            progress.advance(task)
    return outcomes


def in_process_run(entry: corpus.Entry, folder: Path) -> corpus.Outcome:
    """Quicker, less faithful: the entry through autotune.cli.main in this process (one at a time: it changes
    the working directory and the environment)."""
    saved, cwd = dict(os.environ), os.getcwd()
    os.environ.update({k: corpus.expand(str(v), folder) for k, v in (entry.raw.get("env") or {}).items()})
    try:
        return corpus.run_in_process(entry, folder)
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)


def corpus_tables(outcomes: list[corpus.Outcome]) -> tuple[list[list[str]], list[list[str]]]:
    """Rows (command, category, tried, clean) and the unclean inputs (command, label, problem)."""
    tried: Counter[tuple[str, str]] = Counter()
    clean: Counter[tuple[str, str]] = Counter()
    for o in outcomes:
        key = (o.entry.command, o.entry.category)
        tried[key] += 1
        clean[key] += o.clean
    rows = [[command, category, str(tried[command, category]), str(clean[command, category])]
            for command, category in sorted(tried)]
    rows.append(["all", "all", str(sum(tried.values())), str(sum(clean.values()))])
    unclean = [[o.entry.command, o.entry.label, o.problem or ""] for o in outcomes if not o.clean]
    return rows, unclean


# ---------------------------------------------------------------------------------------------------------
# 2. faults

@dataclass(frozen=True)
class Fault:
    kind: str
    detail: str
    survived: bool
    recorded_before: int  # complete trial lines before the fault
    kept: int  # of those, still in place after the resume
    final_trials: int
    note: str


def tune_argv(out: Path, strategy: str, trials: int = TRIALS, seed: int = 4) -> list[str]:
    return [sys.executable, "-m", "autotune.cli", "tune", "--backend", "simulated", "--strategy", strategy,
            "--trials", str(trials), "--memory-budget", "0.85GiB", "--seed", str(seed), "--out", str(out)]


def env_with(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOTUNE_", "RAY_"))}
    env.update(extra)
    return env


def complete_lines(path: Path) -> list[bytes]:
    """The lines of trials.jsonl that hold a whole JSON object (a torn tail is not a recorded trial)."""
    if not path.is_file():
        return []
    out = []
    for raw in path.read_bytes().splitlines():
        try:
            if isinstance(json.loads(raw), dict):
                out.append(raw)
        except ValueError:
            pass
    return out


def check_after(kind: str, detail: str, before: list[bytes], run: Path, resume: subprocess.CompletedProcess,
                budget: int = TRIALS, note: str = "") -> Fault:
    """Nothing lost: the resume ended well, every line recorded before is still in place, the trials are
    numbered 1..N once each and the budget was completed (pruned trials are recorded but not launched)."""
    after = complete_lines(run / "trials.jsonl")
    kept = sum(1 for i, line in enumerate(before) if i < len(after) and after[i] == line)
    records = [json.loads(line) for line in after]
    numbers = [r.get("trial") for r in records]
    launched = sum(1 for r in records if r.get("status") != "pruned")  # the budget counts launched trials
    problems = []
    if resume.returncode != 0:
        problems.append(f"resume exit {resume.returncode}: {resume.stderr.strip().splitlines()[-1:] or ''}")
    if "Traceback" in (resume.stderr or ""):
        problems.append("traceback")
    if kept != len(before):
        problems.append(f"{len(before) - kept} recorded trial(s) lost or changed")
    if numbers != list(range(1, len(after) + 1)):
        problems.append(f"trial numbers {numbers}")
    if launched != budget:
        problems.append(f"{launched} trials launched, budget {budget}")
    return Fault(kind, detail, not problems, len(before), kept, len(after), "; ".join(problems) or note)


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return predicate()
        time.sleep(0.02)
    return False


def resume(run: Path, strategy: str, budget: int = TRIALS, **env: str) -> subprocess.CompletedProcess:
    """The same command again with --resume; plain when the tuner was stopped before it recorded its settings
    (a sweep that never started is started afresh, as its user would)."""
    again = ["--resume"] if (run / "run.json").exists() else []
    return subprocess.run([*tune_argv(run, strategy, budget), *again], env=env_with(**env), capture_output=True,
                          text=True, timeout=600)


def kill_and_resume(root: Path, name: str, signum: signal.Signals, strategy: str, rng: random.Random) -> Fault:
    run = root / f"{name}-{strategy}-{rng.randrange(10**6)}"
    proc = subprocess.Popen(tune_argv(run, strategy), env=env_with(**{SLEEP_ENV: "0.3"}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    target = rng.randint(0, TRIALS - 2)  # trials recorded before the signal (0: during start-up or the first)
    wait_for(lambda: len(complete_lines(run / "trials.jsonl")) >= target, proc, 120)
    time.sleep(rng.uniform(0, 0.35))  # anywhere within the trial in flight (each takes 0.3 s)
    proc.send_signal(signum)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return Fault("kill + resume", f"{name} {strategy}", False, 0, 0, 0, f"{name}: tuner still running after 60 s")
    before = complete_lines(run / "trials.jsonl")
    after_signal = proc.stderr.read() if proc.stderr else ""
    if name != "SIGKILL" and "Traceback" in after_signal:
        return Fault("kill + resume", f"{name} {strategy}", False, len(before), 0, 0, f"{name}: traceback on stderr")
    result = check_after("kill + resume", f"{name} {strategy} after {len(before)} trials", before, run,
                         resume(run, strategy))
    return result


def broken_tail(root: Path, strategy: str, how: str) -> Fault:
    """A run of 3 trials whose trials.jsonl then ends in a torn line, or in a complete line without its
    newline; resumed to a budget of 5."""
    run = root / f"tail-{how}-{strategy}"
    done = subprocess.run(tune_argv(run, strategy, trials=3), env=env_with(), capture_output=True, text=True)
    if done.returncode != 0:
        return Fault("broken tail", how, False, 0, 0, 0, f"first session exit {done.returncode}")
    trials = run / "trials.jsonl"
    before = complete_lines(trials)
    if how == "torn last line":
        with trials.open("ab") as out:
            out.write(b'{"config": {"zero_stage": 1, "micro_')
    else:  # truncate -s -1: the last trial is complete, only its newline is missing
        os.truncate(trials, trials.stat().st_size - 1)
    return check_after("broken tail", f"{how} ({strategy})", before, run, resume(run, strategy, budget=5), budget=5)


def concurrent_tuners(root: Path, strategy: str) -> Fault:
    run = root / f"concurrent-{strategy}"
    first = subprocess.Popen(tune_argv(run, strategy), env=env_with(**{SLEEP_ENV: "0.3"}),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(complete_lines(run / "trials.jsonl")) >= 1, first, 120)
    notes = []
    for extra in (["--resume"], []):
        second = subprocess.run([*tune_argv(run, strategy), *extra], env=env_with(), capture_output=True, text=True,
                                timeout=120)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        if second.returncode != 2 or len(lines) != 1 or "Traceback" in second.stderr:
            notes.append(f"second tuner{' --resume' if extra else ''}: exit {second.returncode}, {lines[-1:]}")
    first.wait(timeout=300)
    finished = subprocess.CompletedProcess(first.args, first.returncode, "", first.stderr.read() if first.stderr else "")
    fault = check_after("concurrent tuners", f"second tuner refused ({strategy})", [], run, finished)
    problems = [p for p in [*notes, "" if fault.survived else fault.note] if p]
    return Fault(fault.kind, fault.detail, not problems, 0, 0, fault.final_trials, "; ".join(problems))


def unreachable_ray(root: Path) -> Fault:
    run = root / "unreachable-ray"
    start = time.monotonic()
    try:
        done = subprocess.run([*tune_argv(run, "random", trials=2), "--ray-address", "127.0.0.1:1"], env=env_with(),
                              capture_output=True, text=True, timeout=90)
        code, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired:
        code, stderr = None, "(no answer in 90 s)"
    took = time.monotonic() - start
    lines = [line for line in stderr.splitlines() if line.strip()]
    ok = code == 2 and took < 30 and len(lines) == 1 and "Traceback" not in stderr
    return Fault("hang", "tune --ray-address 127.0.0.1:1", ok, 0, 0, 0,
                 f"exit {code} after {took:.1f} s; stderr {' | '.join(lines)[-300:]}")


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*")}


def our_ports(pid: int) -> set[int]:
    """Ports of the trials whose shared-memory owner marker names process `pid` (autotune.trials.runner)."""
    ports = set()
    for marker in Path("/dev/shm").glob(f"*_{os.getuid()}_*.owner"):
        try:
            if json.loads(marker.read_text()).get("pid") == pid:
                ports.add(int(marker.name[:-len(".owner")].rsplit("_", 1)[-1]))
        except (OSError, ValueError):
            pass
    return ports


def real_trial_killed(root: Path) -> Fault:
    """SIGKILL the tuner while its real DeepSpeed trial holds its /dev/shm segments; after the ranks are gone,
    the next start (--resume) removes them."""
    run = root / "real"
    argv = [sys.executable, "-m", "autotune.cli", "tune", "--backend", "deepspeed", "--model", "tiny", "--gpus", "2",
            "--hardware", "cpu", "--strategy", "grid", "--trials", "2", "--out", str(run)]
    proc = subprocess.Popen(argv, env=env_with(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    mine: set[str] = set()

    def segments_seen() -> bool:
        for port in our_ports(proc.pid):
            mine.update(name for name in shm_segments() if f"_{port}_" in name)
        return bool(mine)

    if not wait_for(segments_seen, proc, 300):
        proc.kill()
        proc.wait()
        return Fault("real trial", "SIGKILL during a DeepSpeed trial", False, 0, 0, 0,
                     "no /dev/shm segment of the trial seen (trial ended or never started)")
    before = complete_lines(run / "trials.jsonl")
    proc.kill()
    proc.wait()
    # the ranks notice their runner is gone and end; a segment still held is not stale yet
    time.sleep(10)
    done = subprocess.run([*argv, "--resume"], env=env_with(), capture_output=True, text=True, timeout=900)
    left = mine & shm_segments()
    fault = check_after("real trial", "SIGKILL during a DeepSpeed trial, then --resume", before, run, done, budget=2)
    problems = [p for p in [f"{len(left)} /dev/shm segment(s) of the killed trial left: {sorted(left)}" if left else "",
                            "" if fault.survived else fault.note] if p]
    return Fault(fault.kind, fault.detail, not problems, fault.recorded_before, fault.kept, fault.final_trials,
                 "; ".join(problems) or f"{len(mine)} segment(s) of the killed trial removed")


def dead_runner_segments_other_run(root: Path) -> Fault:
    """A tuner of another run killed with SIGKILL left its trial's segments in /dev/shm (a marker naming its
    gone pid, one ~66 MB segment per rank in life, small here): the start of any ds-autotune sweep, here a
    simulated one of another run that launches no real trial, removes them; a live runner's are kept."""
    uid = os.getuid()
    code = ("import sys; from autotune.trials.runner import claim_port; print(claim_port())")
    dead = int(subprocess.run([sys.executable, "-c", code], env=env_with(), capture_output=True, text=True,
                              check=True).stdout)  # the claiming process has exited: its runner is gone
    from autotune.trials.runner import claim_port, release_port  # this process: a live runner

    live = claim_port()
    planted = [Path("/dev/shm") / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{rank}"
               for port in (dead, live) for rank in (0, 1)]
    for path in planted:
        path.write_bytes(b"x" * 4096)
    try:
        run = root / "another-run"
        done = subprocess.run(tune_argv(run, "random", trials=1), env=env_with(), capture_output=True, text=True,
                              timeout=300)
        left = [p.name for p in planted[:2] if p.exists()]
        kept = all(p.exists() for p in planted[2:])
        problems = [f"exit {done.returncode}" if done.returncode else "",
                    f"{len(left)} segment(s) of the dead runner left: {left}" if left else "",
                    "" if kept else "a live runner's segment was removed"]
    finally:
        for path in planted[2:]:
            path.unlink(missing_ok=True)
        release_port(live)
    problems = [p for p in problems if p]
    return Fault("dead runner's /dev/shm", "segments of a SIGKILLed tuner, then a simulated sweep of another run",
                 not problems, 0, 0, 0, "; ".join(problems) or "2 segment(s) of the dead runner removed, the live "
                 "runner's 2 kept")


FULL_DISK = """
import sys, sqlite3
import optuna
from sqlalchemy.exc import OperationalError
from autotune.cli import main

def full(*args, **kwargs):  # SQLite out of room at a commit, as Optuna's RDBStorage reports it
    try:
        raise OperationalError("INSERT INTO trials", (), sqlite3.OperationalError("database or disk is full"))
    except OperationalError as err:
        raise optuna.exceptions.StorageInternalError("An exception is raised during the commit. This typically "
                                                     "happens due to invalid data in the commit, e.g. exceeding "
                                                     "max length. ") from err

optuna.storages.RDBStorage._create_new_trial = full
sys.exit(main(sys.argv[1:]))
"""


def full_disk(root: Path) -> Fault:
    """A study database that cannot grow (the real exception types, injected): one line naming study.db and
    "no space left", exit 1; nothing recorded lost; the resume once there is room completes the budget."""
    run = root / "full-disk"
    first = subprocess.run(tune_argv(run, "optuna", trials=3), env=env_with(), capture_output=True, text=True)
    if first.returncode != 0:
        return Fault("full disk", "study.db full", False, 0, 0, 0, f"first session exit {first.returncode}")
    before = complete_lines(run / "trials.jsonl")
    argv = [*tune_argv(run, "optuna", trials=5), "--resume"]
    full = subprocess.run([sys.executable, "-c", FULL_DISK, *argv[3:]], env=env_with(), capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in full.stderr.splitlines() if line.strip()]
    named = (full.returncode == 1 and len(lines) == 1 and "no space left" in lines[0]
             and str(run / "study.db") in lines[0] and "internal error" not in lines[0])
    fault = check_after("full disk", "study.db full (StorageInternalError from OperationalError), then --resume",
                        before, run, resume(run, "optuna", budget=5), budget=5)
    problems = [p for p in ["" if named else f"exit {full.returncode}: {' | '.join(lines)[-300:]}",
                            "" if fault.survived else fault.note] if p]
    return Fault(fault.kind, fault.detail, not problems, fault.recorded_before, fault.kept, fault.final_trials,
                 "; ".join(problems) or lines[0].replace(str(run), "<run>")[:120])


def ray_driver_killed(root: Path, rng: random.Random) -> Fault:
    run = root / "ray-driver"
    argv = [*tune_argv(run, "random"), "--ray-address", "local", "--concurrency", "2"]
    proc = subprocess.Popen(argv, env=env_with(**{SLEEP_ENV: "0.5"}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(lambda: len(complete_lines(run / "trials.jsonl")) >= rng.randint(1, 4), proc, 300)
    proc.kill()
    proc.wait()
    before = complete_lines(run / "trials.jsonl")
    return check_after("ray driver", "SIGKILL of a tuner on --ray-address local, then --resume (local)", before, run,
                       resume(run, "random"))


def run_faults(rounds: int, real: bool, ray: bool, seed: int) -> list[Fault]:
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="robustness-faults-"))
    jobs: list[Callable[[], Fault]] = []
    for name, signum in SIGNALS.items():
        for i in range(rounds):
            strategy = STRATEGIES[i % len(STRATEGIES)]
            jobs.append(lambda name=name, signum=signum, strategy=strategy: kill_and_resume(root, name, signum, strategy, rng))
    for strategy in ("random", "optuna"):
        jobs.append(lambda strategy=strategy: broken_tail(root, strategy, "torn last line"))
        jobs.append(lambda strategy=strategy: broken_tail(root, strategy, "last line without its newline"))
    jobs.append(lambda: concurrent_tuners(root, "optuna"))
    jobs.append(lambda: unreachable_ray(root))
    jobs.append(lambda: full_disk(root))
    jobs.append(lambda: dead_runner_segments_other_run(root))
    if real:
        jobs.append(lambda: real_trial_killed(root))
    if ray:
        jobs.append(lambda: ray_driver_killed(root, rng))
    faults = []
    with Progress() as progress:
        task = progress.add_task("faults", total=len(jobs))
        for job in jobs:
            try:
                fault = job()
            except Exception as err:  # noqa: BLE001 - a fault the harness could not run counts as not survived
                fault = Fault("harness", getattr(job, "__name__", "job"), False, 0, 0, 0, repr(err))
            colour = "green" if fault.survived else "red"
            progress.console.print(f"[{colour}]{'survived' if fault.survived else 'NOT survived'}[/{colour}] "
                                   f"{escape(f'{fault.kind}: {fault.detail}: {fault.note}')}", markup=True, highlight=False)
            faults.append(fault)
            progress.advance(task)
    return faults


# ---------------------------------------------------------------------------------------------------------
# report

def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
            *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows)]


def report(outcomes: list[corpus.Outcome], faults: list[Fault], command: str) -> str:
    console = Console(width=180)
    lines = ["# Robustness: bad inputs and injected faults", "", f"`{command}` on {os.cpu_count()} cores "
             f"({sys.platform}); each bad input runs as `python -m autotune.cli ...` in a fresh folder.", ""]
    if outcomes:
        rows, unclean = corpus_tables(outcomes)
        table = Table(title="Bad inputs (tests/bad_inputs/corpus.yaml): tried / clean")
        for column in ("command", "category", "tried", "clean"):
            table.add_column(column, justify="right" if column in ("tried", "clean") else "left")
        for row in rows:
            table.add_row(*map(Text, row), style="red" if row[2] != row[3] else None)
        console.print(table)
        total = rows[-1]
        lines += [f"## Bad inputs: {total[3]} of {total[2]} clean", "",
                  *markdown_table(["command", "category", "tried", "clean"], rows), ""]
        if unclean:
            bad = Table(title=f"Unclean inputs ({len(unclean)})")
            for column in ("command", "input", "what went wrong"):
                bad.add_column(column, overflow="fold")
            for row in unclean:
                bad.add_row(*map(Text, row))
            console.print(bad)
            lines += [f"### Unclean inputs ({len(unclean)})", "", *markdown_table(["command", "input", "what went wrong"],
                                                                                   unclean), ""]
    if faults:
        table = Table(title="Injected faults: tried / survived (nothing lost)")
        for column in ("fault", "detail", "survived", "recorded before", "kept", "trials after", "note"):
            table.add_column(column, overflow="fold")
        rows = [[f.kind, f.detail, "yes" if f.survived else "NO", str(f.recorded_before), str(f.kept),
                 str(f.final_trials), f.note] for f in faults]
        for row in rows:
            table.add_row(*map(Text, row), style=None if row[2] == "yes" else "red")
        console.print(table)
        survived = sum(f.survived for f in faults)
        console.print(f"faults: {survived} of {len(faults)} survived")
        lines += [f"## Faults: {survived} of {len(faults)} survived with nothing lost", "",
                  *markdown_table(["fault", "detail", "survived", "recorded before", "kept", "trials after", "note"],
                                  rows), ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="bad inputs run at once (default: 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one bad input may take (default: 120)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the bad inputs through autotune.cli.main in this process (quicker; not the record)")
    parser.add_argument("--only", default=None, help="run only the corpus entries whose label contains this text")
    parser.add_argument("--rounds", type=int, default=3, help="kills per signal (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default: 0)")
    parser.add_argument("--no-corpus", action="store_true", help="skip the bad inputs")
    parser.add_argument("--no-faults", action="store_true", help="skip the fault injections")
    parser.add_argument("--no-real", action="store_true", help="skip the real DeepSpeed trial killed with SIGKILL")
    parser.add_argument("--ray", action="store_true", help="also kill a tuner driving a local Ray instance")
    args = parser.parse_args()
    entries = [e for e in corpus.load_corpus() if args.only is None or args.only in e.label]
    outcomes = [] if args.no_corpus else run_corpus(entries, args.jobs, args.timeout, args.in_process)
    faults = [] if args.no_faults else run_faults(args.rounds, not args.no_real, args.ray, args.seed)
    command = "python benchmarks/robustness.py " + " ".join(sys.argv[1:])
    text = report(outcomes, faults, command.strip())
    if args.only is None and not (args.no_corpus or args.no_faults or args.in_process):  # only a full run is the record
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "robustness.md").write_text(text)
        (RESULTS / "robustness.json").write_text(json.dumps({
            "command": command.strip(),
            "corpus": [{"command": o.entry.command, "category": o.entry.category, "label": o.entry.label,
                        "argv": list(o.entry.argv), "exit_code": o.exit_code, "clean": o.clean, "problem": o.problem}
                       for o in outcomes],
            "faults": [asdict(f) for f in faults]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
