"""DeepSpeed's C++ ops (JIT-built on first use) for a sweep's trials: the CUDA arch list they build for, the
preflight that builds them once before the first trial, and the one line that says why one cannot be built.

- `deepspeed_arch_list`: TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8 parses it. Its `compute_capability_args`
  reads each entry as `<int>.<int>[+PTX]`, so the arch-specific variants of current CUDA images (`9.0a`,
  `10.0a`, `12.0f`) crash every FusedAdam build with `ValueError: invalid literal for int() with base 10:
  '0a'` (benchmarks/gpu-runs/h200-2026-11-26). A variant compiles for the same compute capability as its plain
  entry, which is what DeepSpeed's ops need: each entry becomes `major.minor`, `+PTX` kept. The runner applies
  it to every rank's environment (autotune.trials.runner.trial_environment).
- `preflight`: in a child process (autotune.worker.preflight) with the trials' environment, load every op the
  space's trials load, with a progress line for each that must be built first. What it loaded is recorded
  (`BuiltOps`), so a later sweep whose ops are all built starts without the child (~5 s of imports). A failure is `OpBuildFailed`:
  one line naming the op, the cause and the fix (autotune.cli: exit 1), before any trial is recorded.
- `BuildFailure`: that line, from a preflight's failure event or from a trial that crashed loading ops
  (`build_failure`): a sweep stops at the second such crash of an op (autotune.drivers.loop), not one
  crash per config.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from autotune.prediction import trial_time
from autotune.worker.main import ARCH_LIST_PARSERS, PARENT_ENV, needed_builders

ARCH_ENV = "TORCH_CUDA_ARCH_LIST"
# One entry as torch accepts it, with an arch-specific (`a`) or family (`f`) variant letter allowed.
_ARCH_ENTRY = re.compile(r"(\d+)\.(\d+)[a-z]?(\+PTX)?")
# A first build's time, measured (seconds): the trial-time model's (autotune.prediction.trial_time, which names the
# measurements), per accelerator and op.
FIRST_BUILD_S = {(accelerator, op): seconds for accelerator, model in (("cuda", trial_time.CUDA), ("cpu", trial_time.CPU))
                 for op, seconds in model.op_build_s}
PREFLIGHT_TIMEOUT_S = 1800.0 + 120.0  # the runner's longest build pause, plus importing torch and DeepSpeed
REPEATED_BUILD_FAILURES = 2  # crashes of one op while loading it after which a sweep stops


class OpBuildFailed(Exception):
    """A DeepSpeed op the trials need cannot be built or loaded here: no trial of the space would run. Its
    message is one line (the op, the cause, the fix); the CLI prints it and exits 1."""


def deepspeed_arch_list(value: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST (`value`; None: unset) as DeepSpeed 0.19.8's op builder can parse it; None: unset it.

    Entries are separated by `;` or spaces. A variant (`9.0a`, `12.0f`) becomes its plain capability (`9.0`),
    `+PTX` is kept, duplicates merge (`+PTX` if any of them had it). `native` (torch's "the visible GPUs")
    becomes unset, which DeepSpeed reads the same way (it probes the devices). A list that needs none of this
    is returned as it is; a value that is not an arch list (`Hopper`, `sm_90a`) too, for DeepSpeed or torch
    to report (the preflight names the fix)."""
    if value is None:
        return None
    if value.strip() == "native":
        return None
    entries = [e for e in value.strip().replace(" ", ";").split(";") if e]
    archs: dict[tuple[int, int], bool] = {}
    for entry in entries:
        match = _ARCH_ENTRY.fullmatch(entry)
        if match is None:
            return value
        key = (int(match[1]), int(match[2]))
        archs[key] = archs.get(key, False) or bool(match[3])
    plain = [f"{major}.{minor}{'+PTX' if ptx else ''}" for (major, minor), ptx in archs.items()]
    return value if plain == entries else ";".join(plain)


def with_deepspeed_arch_list(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with its TORCH_CUDA_ARCH_LIST as DeepSpeed can parse it (deepspeed_arch_list)."""
    out = dict(env)
    fixed = deepspeed_arch_list(out.get(ARCH_ENV))
    if fixed is None:
        out.pop(ARCH_ENV, None)
    else:
        out[ARCH_ENV] = fixed
    return out


@dataclass(frozen=True)
class BuildFailure:
    """Why a DeepSpeed op could not be built or loaded, and what to do about it."""

    op: str | None  # DeepSpeed's name of the op (fused_adam, cpu_adam, ...); None: not known
    cause: str  # the exception, one line ("ValueError: invalid literal for int() with base 10: '0a'")
    fix: str

    def line(self) -> str:
        what = f"DeepSpeed's {self.op} op" if self.op else "a DeepSpeed op"
        return f"{what} cannot be built or loaded: {self.cause}; fix: {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "cause": self.cause, "fix": self.fix}

    @classmethod
    def of(cls, report: Mapping[str, Any], arch_list: str | None, log: str | None = None) -> "BuildFailure":
        """From a failure report (a rank's, or the preflight's `failed` event: autotune.worker.main.build_failure)
        of a process whose TORCH_CUDA_ARCH_LIST was `arch_list`; `log`: where its build output is."""
        cause = str(report.get("error") or "unknown error").strip().splitlines()[0].rstrip(".")
        if report.get("arch_list_fault"):
            cause += f" (TORCH_CUDA_ARCH_LIST={arch_list!r})" if arch_list is not None else ""
            fix = arch_fix(report.get("capability"))
        else:
            fix = _known_fix(cause) or (f"read the build's output in {log}" if log else
                                        "read the build's output in the trial's rank0.stderr")
        return cls(report.get("op"), cause, fix)


def arch_fix(capability: str | None) -> str:
    if capability:
        return f"set TORCH_CUDA_ARCH_LIST={capability}"
    return "set TORCH_CUDA_ARCH_LIST to the GPU's compute capability without a variant letter (e.g. 9.0, not 9.0a)"


# Causes whose fix is known, by a phrase of the exception's message (torch's cpp_extension and DeepSpeed's builders).
_FIXES = (("ninja is required", "install ninja in the trials' environment (pip install ninja)"),
          ("ninja not being installed", "install ninja in the trials' environment (pip install ninja)"),
          ("cuda_home", "install the CUDA toolkit (nvcc) of torch's CUDA version and set CUDA_HOME to it"),
          ("nvcc", "install the CUDA toolkit (nvcc) of torch's CUDA version and set CUDA_HOME to it"))


def _known_fix(cause: str) -> str | None:
    lowered = cause.lower()
    return next((fix for phrase, fix in _FIXES if phrase in lowered), None)


def build_failure(result: Any) -> BuildFailure | None:
    """The op failure of a trial that crashed loading DeepSpeed's ops (a TrialResult), else None. The deepspeed
    backend records it (`extra["op_failure"]`); older records are read from their message ("rank 0 in
    build_ops: ValueError: ...", the runner's form), their fix from the traceback quoted there."""
    if result.status != "crash":
        return None
    recorded = result.extra.get("op_failure")
    if isinstance(recorded, Mapping):
        return BuildFailure(recorded.get("op"), str(recorded.get("cause")), str(recorded.get("fix")))
    match = re.match(r"rank \d+ in build_ops: (.*)", result.error or "")
    if match is None:
        return None
    cause = match[1].split("; last lines of stderr", 1)[0]
    fault = any(name in (result.error or "") for name in ARCH_LIST_PARSERS)
    return BuildFailure.of({"error": cause, "arch_list_fault": fault}, None)


# -- the preflight -------------------------------------------------------------------------------------------

def preflight(accelerator: str, ds_configs: Sequence[Mapping[str, Any]], env: Mapping[str, str], python: str,
              log: Path, say: Callable[[str], None], *, cpu_info: Mapping[str, Any] | None = None,
              command: Sequence[str] | None = None, timeout_s: float = PREFLIGHT_TIMEOUT_S,
              before_child: Callable[[], None] | None = None) -> tuple[str, ...]:
    """Load, in a child process with the trials' environment `env`, every op a trial of one of `ds_configs`
    loads on `accelerator`, building those not built yet (`say` hears a line for each). Returns the ops loaded;
    raises OpBuildFailed (one line) when one cannot be. The child's stderr (a build's output) goes to `log`.
    `command`: the child (tests); default `python -m autotune.worker.preflight`. `before_child`: called when a
    child is needed (the ops' record does not say they are all built), before it starts."""
    record = BuiltOps.of(env, python, accelerator, cpu_info)
    needed = needed_builders(accelerator, ds_configs)
    known = record.ops(needed) if record is not None else None
    if known is not None:
        return known  # built and loaded by an earlier preflight of this environment: no child (~5 s) needed
    request = json.dumps({"accelerator": accelerator, "ds_configs": list(ds_configs),
                          "cpu_info": dict(cpu_info) if cpu_info else None})
    if before_child is not None:
        before_child()
    argv = list(command or [python, "-m", "autotune.worker.preflight"])
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    events: list[dict[str, Any]] = []
    with open(log, "wb") as err:
        child = subprocess.Popen(argv, env={**env, PARENT_ENV: str(os.getpid())}, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, start_new_session=True, text=True)
        timer = threading.Timer(timeout_s, _kill, (child,))
        timer.daemon = True
        timer.start()
        try:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(request)
            child.stdin.close()
            device: dict[str, Any] = {}
            for text in child.stdout:
                event = _event(text)
                if event is None:
                    continue  # a library's own print
                events.append(event)
                if event["event"] == "device":
                    device = event
                elif event["event"] == "op" and event.get("building"):
                    say(building_line(str(event.get("op")), accelerator, device.get("capability")))
            code = child.wait()
        finally:
            timer.cancel()
            _kill(child)  # Ctrl-C or a fault here: the child (a compiler under it) does not outlive this call
    failed = next((e for e in events if e["event"] == "failed"), None)
    if failed is not None:
        raise OpBuildFailed(BuildFailure.of(failed, env.get(ARCH_ENV), str(log)).line())
    if code != 0 or not any(e["event"] in ("done", "mismatch") for e in events):
        elapsed = time.monotonic() - started
        how = (f"did not finish within {timeout_s:g} s" if elapsed >= timeout_s else f"ended with exit code {code}")
        raise OpBuildFailed(f"loading DeepSpeed's ops before the first trial {how} ({_last_line(log)}); "
                            f"fix: read {log}")
    done: dict[str, Any] = next((e for e in events if e["event"] == "done"), {"ops": []})
    if record is not None and done.get("builds"):
        record.add(done["builds"])
    return tuple(done["ops"])


@dataclass(frozen=True)
class BuiltOps:
    """The ops an earlier preflight loaded in one environment (`<TORCH_EXTENSIONS_DIR>/ds-autotune-ops.json`, per
    python and the install of its torch and DeepSpeed, accelerator, arch list and CPU description): a sweep whose
    ops are all there, each with its built library in place, starts without the preflight's child. A library
    removed or an environment changed (a venv made again at the same path included) runs the child again; a
    library that is there but stale otherwise is rebuilt by torch when a rank loads it (the runner pauses its
    clock for that, as for any first build)."""

    folder: Path  # TORCH_EXTENSIONS_DIR
    key: str

    FILE = "ds-autotune-ops.json"

    @classmethod
    def of(cls, env: Mapping[str, str], python: str, accelerator: str,
           cpu_info: Mapping[str, Any] | None) -> "BuiltOps | None":
        folder = env.get("TORCH_EXTENSIONS_DIR")
        if not folder:
            return None  # torch's default folder: not this tool's to keep a record in
        # Of the CPU's description, what DeepSpeed's builders read (compiler flags); not its clock speed.
        cpu = {k: v for k, v in (cpu_info or {}).items() if k in ("arch", "flags", "vendor_id_raw")}
        key = json.dumps([os.path.abspath(python), accelerator, env.get(ARCH_ENV), cpu, _installed(python)],
                         sort_keys=True)
        return cls(Path(folder), hashlib.sha1(key.encode()).hexdigest()[:16])

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads((self.folder / self.FILE).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def ops(self, builders: Sequence[str]) -> tuple[str, ...] | None:
        """The ops `builders` load, if every one was loaded here before and its library is in place; else None."""
        known = self._read().get(self.key)
        if not isinstance(known, dict) or not all(isinstance(known.get(b), list) for b in builders):
            return None
        ops = []
        for builder in builders:
            op, folder = known[builder]
            if not (self.folder / str(folder) / f"{folder}.so").is_file():
                return None
            ops.append(str(op))
        return tuple(ops)

    def add(self, builds: Mapping[str, Any]) -> None:
        """Record `builds` (builder class -> [op, build folder]), loaded by a preflight's child just now."""
        data = self._read()
        entry = data.get(self.key)
        data[self.key] = {**(entry if isinstance(entry, dict) else {}), **builds}
        temporary = self.folder / f".{self.FILE}.{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(temporary, self.folder / self.FILE)  # a concurrent reader sees the old or the new file
        except OSError:
            temporary.unlink(missing_ok=True)  # a record not written: the next sweep runs the child again


def _installed(python: str) -> list[int]:
    """When torch and DeepSpeed were installed for `python` (their `__init__.py`'s mtime), if it is this interpreter:
    a venv deleted and made again at the same path has the same python but new sources and headers, which the
    ops' builds (ninja) find newer than the libraries, so torch rebuilds them in the first trial."""
    if os.path.abspath(python) != os.path.abspath(sys.executable):  # not a symlink's target: venvs share it
        return []
    stamps = []
    for package in ("torch", "deepspeed"):
        spec = importlib.util.find_spec(package)  # finds, does not import
        if spec is not None and spec.origin:
            stamps.append(os.stat(spec.origin).st_mtime_ns)
    return stamps


def building_line(op: str, accelerator: str, capability: str | None) -> str:
    """What the preflight says before an op's first build."""
    target = (f"sm_{capability.replace('.', '')}" if capability else "the CPU" if accelerator == "cpu"
              else f"DeepSpeed's {accelerator} accelerator")
    seconds = FIRST_BUILD_S.get((accelerator, op))
    return f"building DeepSpeed's {op} for {target}, first use: {f'~{seconds:.0f} s' if seconds else 'a minute or more'}"


def arch_note(before: Mapping[str, str], after: Mapping[str, str]) -> str | None:
    """A line saying how the trials' TORCH_CUDA_ARCH_LIST differs from this process's, if it does."""
    old, new = before.get(ARCH_ENV), after.get(ARCH_ENV)
    if old == new:
        return None
    return (f"TORCH_CUDA_ARCH_LIST={old!r} -> {'unset' if new is None else repr(new)} in the trials: DeepSpeed "
            "0.19.8's op builds parse plain major.minor entries only")


def _event(text: str) -> dict[str, Any] | None:
    try:
        event = json.loads(text)
    except ValueError:
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None


def _kill(child: subprocess.Popen) -> None:
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        child.wait()


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "no output"
