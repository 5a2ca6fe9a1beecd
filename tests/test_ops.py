"""DeepSpeed's C++ ops on every CUDA image (issue 25): the arch list a trial builds them for, the preflight that
builds them before the first trial, and a sweep that stops when one cannot be built. Built from the first real
GPU run (benchmarks/gpu-runs/h200-2026-11-26): its image set TORCH_CUDA_ARCH_LIST=9.0a and every FusedAdam build
crashed in build_ops, config after config (kit-first-crash/)."""

import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

import autotune
from autotune import cli
from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.values.config import Config
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.stop import StopReason
from autotune.drivers.sweep import Budget, Sweep
from autotune.trials.ops import (ARCH_ENV, BuildFailure, OpBuildFailed, build_failure, deepspeed_arch_list, preflight,
                          with_deepspeed_arch_list)
from autotune.values.results import TrialResult, read_results
from autotune.trials.runner import LaunchOptions, RunOutcome, trial_environment
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.worker.main import build_failure as worker_build_failure, needed_builders

CRASH = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu-runs" / "h200-2026-11-26" / "kit-first-crash"
REAL_ERROR = CRASH.joinpath("rank0.stderr").read_text().strip().splitlines()[-1]  # the ValueError's own line
FUSED_ADAM_DS = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                 "zero_optimization": {"stage": 0}}


def real_result() -> TrialResult:
    return TrialResult.from_dict(json.loads(CRASH.joinpath("result.json").read_text()))


# -- the arch list -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),  # the H200 image's
    ("10.0a;12.0f+PTX", "10.0;12.0+PTX"),
    ("9.0a+PTX", "9.0+PTX"),
    ("8.0 9.0a", "8.0;9.0"),  # space-separated, one variant
    ("9.0;9.0a+PTX", "9.0+PTX"),  # duplicates merge; +PTX if any had it
    ("9.0a 9.0", "9.0"),
    ("9.0", "9.0"),  # already good: as it was
    ("8.0;8.6+PTX", "8.0;8.6+PTX"),
    ("8.0 8.6", "8.0 8.6"),
    ("", ""),  # empty: DeepSpeed probes the devices, as when unset
    (None, None),
    ("native", None),  # torch's "the visible GPUs", which DeepSpeed cannot parse: unset means the same to it
    ("Hopper", "Hopper"),  # not an arch list DeepSpeed parses: left for it (and the preflight) to report
    ("sm_90a", "sm_90a"),
    ("9.0;sm_90a", "9.0;sm_90a"),
])
def test_the_arch_list_keeps_each_capability_without_its_variant(value, expected):
    assert deepspeed_arch_list(value) == expected


class _Probe:
    """A CUDA op builder of DeepSpeed 0.19.8 in JIT mode, for its own compute_capability_args (no GPU needed
    once TORCH_CUDA_ARCH_LIST is set)."""

    def __new__(cls):
        builder = importlib.import_module("deepspeed.ops.op_builder.builder")

        class Probe(builder.CUDAOpBuilder):
            BUILD_VAR, NAME = "DS_BUILD_PROBE", "probe"

            def __init__(self):
                super().__init__(name=self.NAME)

            def absolute_name(self):
                return self.NAME

            def sources(self):
                return []

        probe = Probe()
        probe.jit_mode = True
        return probe


@pytest.mark.parametrize("value", ["9.0a", "10.0a;12.0f+PTX", "9.0a 8.0", "12.0f"])
def test_deepspeeds_own_parser_takes_the_rewritten_list_and_not_the_images(value, monkeypatch):
    probe = _Probe()
    monkeypatch.setenv(ARCH_ENV, value)
    with pytest.raises(ValueError) as raised:
        probe.compute_capability_args()
    if value == "9.0a":  # the very error of the H200 run
        assert f"ValueError: {raised.value}" == REAL_ERROR
    assert worker_build_failure(raised.value, "fused_adam")["arch_list_fault"]  # raised where the list is parsed
    fixed = deepspeed_arch_list(value)
    monkeypatch.setenv(ARCH_ENV, fixed)
    assert probe.compute_capability_args() == []  # JIT mode: torch makes the -gencode flags from the variable
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    flags = _get_cuda_arch_flags()  # torch's own check of the list DeepSpeed left in the variable
    for entry in fixed.split(";"):
        number = entry.split("+")[0].replace(".", "")
        assert f"-gencode=arch=compute_{number},code=sm_{number}" in flags  # the device's capability still built


def test_every_trial_process_gets_the_rewritten_list(monkeypatch):
    monkeypatch.setenv(ARCH_ENV, "9.0a")
    options = LaunchOptions()
    assert trial_environment(options, "cuda")[ARCH_ENV] == "9.0"
    assert trial_environment(replace(options, env={ARCH_ENV: "10.0a;12.0f+PTX"}), "cuda")[ARCH_ENV] == "10.0;12.0+PTX"
    assert trial_environment(options, "cuda")["DS_ACCELERATOR"] == "cuda"
    monkeypatch.setenv(ARCH_ENV, "native")
    assert ARCH_ENV not in trial_environment(options, "cuda")
    monkeypatch.delenv(ARCH_ENV)
    assert ARCH_ENV not in trial_environment(options, "cuda")
    assert with_deepspeed_arch_list({"A": "1"}) == {"A": "1"}
    assert os.environ.get(ARCH_ENV) is None  # this process's own is never changed


def test_a_launched_rank_runs_with_the_rewritten_list(tmp_path, monkeypatch):
    """A real rank (the `hang` fault stops it before torch is imported) started by the runner's launch."""
    import threading

    from autotune.values.dsconfig import ds_config
    from autotune.trials.runner import run_worker
    from autotune.worker.protocol import WorkerSpec, read_events

    monkeypatch.setenv(ARCH_ENV, "9.0a 10.0a;12.0f+PTX")
    config, workload = Config(0, 2, 0, "fp32"), autotune.make_workload("tiny")
    spec = WorkerSpec(config, workload, ds_config(config, workload), str(tmp_path / "trial"), fault="hang")
    seen: dict[str, str] = {}

    def look() -> None:
        for _ in range(600):
            events = read_events(spec.log_dir, 0)
            if events and events[-1]["phase"] == "hang":
                seen.update(psutil.Process(events[-1]["pid"]).environ())
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=look)
    watcher.start()
    outcome = run_worker(spec, LaunchOptions(timeout_s=3.0))
    watcher.join()
    assert outcome.status == "timeout"  # the hang, ended by the runner
    assert seen[ARCH_ENV] == "9.0;10.0;12.0+PTX" and seen["DS_ACCELERATOR"] == "cpu"


# -- the one line of a failed build --------------------------------------------------------------------------

def test_the_h200_crash_recorded_by_an_older_tuner_reads_as_one_line_with_its_fix():
    failure = build_failure(real_result())
    assert failure is not None and failure.op is None  # that record does not name the op
    assert failure.cause == REAL_ERROR
    line = failure.line()
    assert "\n" not in line and REAL_ERROR in line
    assert "set TORCH_CUDA_ARCH_LIST to the GPU's compute capability" in line  # from the traceback it quotes
    assert build_failure(replace(real_result(), error="rank 0 in initialize: RuntimeError: boom")) is None
    assert build_failure(replace(real_result(), status="oom")) is None


def test_a_failure_names_its_op_cause_and_fix():
    report = {"error": REAL_ERROR, "op": "fused_adam", "arch_list_fault": True, "capability": "9.0"}
    line = BuildFailure.of(report, "9.0a").line()
    assert line == ("DeepSpeed's fused_adam op cannot be built or loaded: ValueError: invalid literal for int() with "
                    "base 10: '0a' (TORCH_CUDA_ARCH_LIST='9.0a'); fix: set TORCH_CUDA_ARCH_LIST=9.0")
    compiler = BuildFailure.of({"error": "RuntimeError: Error building extension 'fused_adam'", "op": "fused_adam"},
                               None, "/logs/preflight.stderr")
    assert compiler.fix == "read the build's output in /logs/preflight.stderr"


# -- the preflight -------------------------------------------------------------------------------------------

def fake_child(tmp_path: Path) -> list[str]:
    """The preflight's child as it would have run on the H200 image: device, the build's start, the real stderr
    of the crash, its failure event (the real error line), exit 1."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        request = json.load(sys.stdin)
        assert request["accelerator"] == "cuda" and request["ds_configs"]
        print(json.dumps({{"event": "device", "accelerator": "cuda", "capability": "9.0"}}), flush=True)
        print("a library's own line on stdout", flush=True)
        print(json.dumps({{"event": "op", "op": "fused_adam", "building": True}}), flush=True)
        stderr = open({str(CRASH / "rank0.stderr")!r}).read()
        sys.stderr.write(stderr)
        print(json.dumps({{"event": "failed", "error": stderr.strip().splitlines()[-1], "op": "fused_adam",
                          "arch_list_fault": True, "capability": "9.0"}}), flush=True)
        sys.exit(1)
    """))
    return [sys.executable, str(script)]


def test_a_preflight_that_cannot_build_is_one_line_naming_op_cause_and_fix(tmp_path):
    said: list[str] = []
    log = tmp_path / "logs" / "preflight.stderr"
    with pytest.raises(OpBuildFailed) as failed:
        preflight("cuda", [FUSED_ADAM_DS], {**os.environ, ARCH_ENV: "sm_90a"}, sys.executable, log, said.append,
                  command=fake_child(tmp_path))
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("DeepSpeed's fused_adam op cannot be built or loaded: " + REAL_ERROR)
    assert "TORCH_CUDA_ARCH_LIST='sm_90a'" in message and message.endswith("fix: set TORCH_CUDA_ARCH_LIST=9.0")
    assert said == ["building DeepSpeed's fused_adam for sm_90, first use: ~30 s"]
    assert log.read_text() == CRASH.joinpath("rank0.stderr").read_text()  # the build's output, kept


def test_a_child_that_dies_without_a_word_is_one_line_too(tmp_path):
    log = tmp_path / "preflight.stderr"
    command = [sys.executable, "-c", "import sys; sys.stderr.write('Segmentation fault\\n'); sys.exit(139)"]
    with pytest.raises(OpBuildFailed) as failed:
        preflight("cpu", [FUSED_ADAM_DS], dict(os.environ), sys.executable, log, print, command=command)
    assert str(failed.value) == (f"loading DeepSpeed's ops before the first trial ended with exit code 139 "
                                 f"(Segmentation fault); fix: read {log}")


OFFLOAD_DS = {**FUSED_ADAM_DS, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
# A child that loads what it is asked for (the builders' ops of the CPU accelerator) and counts its runs.
COUNTING_CHILD = textwrap.dedent("""
    import json, sys
    from autotune.worker.main import op_builders, prepared_ds_config
    request = json.load(sys.stdin)
    open(sys.argv[1], "a").write("run\\n")
    accel = type("A", (), {"device_name": lambda self: "cpu"})()
    names = []
    for ds in request["ds_configs"]:
        names += [n for n in op_builders(prepared_ds_config(ds), accel) if n not in names]
    ops = {"FusedAdamBuilder": "fused_adam", "CPUAdamBuilder": "cpu_adam"}
    print(json.dumps({"event": "device", "accelerator": "cpu", "capability": None}))
    print(json.dumps({"event": "done", "ops": [ops[n] for n in names], "builds": {n: [ops[n], ops[n]] for n in names}}))
""")


def test_ops_a_preflight_loaded_are_not_loaded_again_until_their_library_or_environment_changes(tmp_path,
                                                                                              monkeypatch):
    ext, runs = tmp_path / "ext", tmp_path / "runs"
    for op in ("fused_adam", "cpu_adam"):  # the libraries as torch's JIT build leaves them
        (ext / op).mkdir(parents=True)
        (ext / op / f"{op}.so").write_bytes(b"")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    command = [sys.executable, "-c", COUNTING_CHILD, str(runs)]
    before: list[int] = []  # the children run so far, each time a preflight was about to start one

    def run(ds_configs, environment=env):
        ops = preflight("cpu", ds_configs, environment, sys.executable, tmp_path / "preflight.stderr", print,
                        command=command, before_child=lambda: before.append(runs.read_text().count("run")
                                                                            if runs.exists() else 0))
        return ops, runs.read_text().count("run")

    assert run([FUSED_ADAM_DS]) == (("fused_adam",), 1)
    assert run([FUSED_ADAM_DS]) == (("fused_adam",), 1)  # recorded: no child
    assert run([OFFLOAD_DS, FUSED_ADAM_DS]) == (("cpu_adam", "fused_adam"), 2)  # a new op
    assert run([OFFLOAD_DS]) == (("cpu_adam",), 2)
    (ext / "cpu_adam" / "cpu_adam.so").unlink()  # the build removed: loaded (built) again
    assert run([OFFLOAD_DS]) == (("cpu_adam",), 3)
    assert run([FUSED_ADAM_DS], {**env, ARCH_ENV: "9.0"}) == (("fused_adam",), 4)
    assert before == [0, 1, 2, 3]  # told before each child, and only where one ran (a sweep's first spares start then)
    assert run([FUSED_ADAM_DS], {k: v for k, v in env.items() if k != "TORCH_EXTENSIONS_DIR"})[1] == 5  # no record
    (ext / "ds-autotune-ops.json").write_text("{not json")  # a damaged record is no record
    assert run([FUSED_ADAM_DS]) == (("fused_adam",), 6)
    assert run([FUSED_ADAM_DS]) == (("fused_adam",), 6)
    # The venv made again at the same path: its libraries are in place, but torch's build would find the new
    # sources and headers newer than them.
    monkeypatch.setattr("autotune.trials.ops._installed", lambda python: [1, 2])
    assert run([FUSED_ADAM_DS]) == (("fused_adam",), 7)


def test_the_ops_record_knows_this_interpreters_torch_and_deepspeed_install_only():
    import deepspeed
    import torch

    from autotune.trials.ops import _installed

    assert _installed(sys.executable) == [os.stat(torch.__file__).st_mtime_ns, os.stat(deepspeed.__file__).st_mtime_ns]
    assert _installed("/elsewhere/.venv/bin/python") == []  # another environment's: not known from here


def test_a_preflight_past_its_time_is_ended_with_the_compilers_it_started(tmp_path):
    pid_file = tmp_path / "compiler.pid"
    command = [sys.executable, "-c", textwrap.dedent(f"""
        import json, subprocess, sys, time
        compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL)
        open({str(pid_file)!r}, "w").write(str(compiler.pid))
        print(json.dumps({{"event": "op", "op": "fused_adam", "building": True}}), flush=True)
        time.sleep(120)
    """)]
    with pytest.raises(OpBuildFailed) as failed:
        preflight("cpu", [FUSED_ADAM_DS], dict(os.environ), sys.executable, tmp_path / "preflight.stderr",
                  lambda line: None, command=command, timeout_s=2.0)
    assert str(failed.value).startswith("loading DeepSpeed's ops before the first trial did not finish within 2 s")
    compiler = int(pid_file.read_text())

    def ended() -> bool:
        try:
            return psutil.Process(compiler).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    for _ in range(200):  # SIGKILL sent to its process group: the kernel ends it at once
        if ended():
            break
        time.sleep(0.05)
    assert ended()


@pytest.mark.slow
def test_a_real_preflight_without_ninja_fails_in_one_line_before_compiling(tmp_path):
    """The real child on the CPU accelerator, an op not built yet, no ninja on PATH: DeepSpeed's own error
    (seconds: the child imports torch and DeepSpeed)."""
    from deepspeed.git_version_info import installed_ops

    env = {**os.environ, "PATH": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "DS_ACCELERATOR": "cpu"}
    said: list[str] = []
    if installed_ops.get("fused_adam"):  # DeepSpeed installed with its ops prebuilt: nothing to build
        assert "fused_adam" in preflight("cpu", [FUSED_ADAM_DS], env, sys.executable,
                                                 tmp_path / "preflight.stderr", said.append)
        assert said == []
        return
    with pytest.raises(OpBuildFailed) as failed:
        preflight("cpu", [FUSED_ADAM_DS], env, sys.executable, tmp_path / "preflight.stderr", said.append)
    assert str(failed.value) == ("DeepSpeed's fused_adam op cannot be built or loaded: RuntimeError: Unable to "
                                 "JIT load the fused_adam op due to ninja not being installed; fix: install "
                                 "ninja in the trials' environment (pip install ninja)")
    assert said == ["building DeepSpeed's fused_adam for the CPU, first use: ~130 s"]
    assert "Traceback" in (tmp_path / "preflight.stderr").read_text()


@pytest.mark.slow
def test_a_gpu_sweep_on_a_machine_without_one_is_left_to_its_first_trial(tmp_path):
    """The real child finds no GPU for a cuda trial: nothing to build here; the first trial reports the mismatch
    (unsupported, fatal), as before the preflight existed."""
    # No GPU visible to the child, on any machine (a GPU machine would load the ops instead).
    env = {**trial_environment(LaunchOptions(), "cuda"), "CUDA_VISIBLE_DEVICES": ""}
    assert preflight("cuda", [FUSED_ADAM_DS], env, sys.executable, tmp_path / "preflight.stderr", print) == ()


@pytest.mark.slow
def test_a_real_preflight_on_the_cpu_loads_what_the_trials_load(tmp_path):
    """Without and with optimizer offload: FusedAdam and DeepSpeedCPUAdam (minutes on first use, about
    ten seconds once built); torch's AdamW (zero_force_ds_cpu_optimizer false) loads no Adam op."""
    backend = DeepSpeedBackend(autotune.make_workload("tiny"), logs_dir=tmp_path / "logs")
    configs = [Config(0, 2, 0, "fp32", "none", "none"), Config(2, 2, 0, "fp32", "cpu", "none")]
    said: list[str] = []
    assert backend.preflight(configs, said.append) == ("fused_adam", "cpu_adam")
    assert all(line.startswith("building DeepSpeed's ") for line in said)
    again: list[str] = []
    assert backend.preflight(configs, again.append) == ("fused_adam", "cpu_adam")
    assert again == []  # built now: loaded, nothing said


# -- the CLI: one line, exit 1, nothing recorded -------------------------------------------------------------

@pytest.fixture
def failing_preflight(tmp_path, monkeypatch):
    """Every preflight's child is the H200 crash's (the real parent code, the fake child)."""
    import autotune.backends.deepspeed as backend_module

    command = fake_child(tmp_path)

    def replayed(accelerator, ds_configs, env, python, log, say, **options):
        return preflight("cuda", ds_configs, env, python, log, say, command=command)

    monkeypatch.setattr(backend_module, "preflight", replayed)


def test_autotune_trial_stops_before_the_trial(tmp_path, failing_preflight, capsys):
    run_dir = tmp_path / "trial"
    code = cli.main(["trial", "--zero-stage", "0", "--micro-batch", "2", "--precision", "fp32",
                     "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 1
    assert "building DeepSpeed's fused_adam for sm_90" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("autotune trial: error: DeepSpeed's fused_adam op cannot be built or loaded: ValueError")
    assert last.endswith("fix: set TORCH_CUDA_ARCH_LIST=9.0")
    assert "Traceback" not in err and not (run_dir / "trials.jsonl").exists()


def test_autotune_tune_stops_before_the_first_trial(tmp_path, failing_preflight, capsys):
    out = tmp_path / "sweep"
    code = cli.main(["tune", "--model", "tiny", "--hardware", "cpu", "--backend", "deepspeed", "--strategy", "grid",
                     "--trials", "3", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("autotune tune: error: DeepSpeed's fused_adam op cannot be built")
    assert "Traceback" not in err
    assert not (out / "trials.jsonl").exists() and not (out / "run.json").exists()  # the command can be run again


def test_autotune_surface_record_stops_before_the_first_trial(tmp_path, failing_preflight, capsys):
    out = tmp_path / "surface.jsonl"
    code = cli.main(["surface", "record", "--model", "tiny", "--hardware", "cpu", "--backend", "deepspeed",
                     "--out", str(out), "--limit", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("fix: set TORCH_CUDA_ARCH_LIST=9.0")
    assert not out.exists()  # nothing recorded


# -- a sweep whose trials crash loading an op ----------------------------------------------------------------

class ReplayedCrash:
    """A backend whose every trial is the H200 run's: rank 0 crashed in build_ops on the 9.0a arch list."""

    name = "deepspeed"
    fatal = None

    def __init__(self) -> None:
        self.runs = 0

    def run(self, config):
        self.runs += 1
        return replace(real_result(), config=config)

    def close(self):
        pass


class Heard(QuietProgress):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def test_a_repeated_build_ops_crash_stops_the_sweep_with_one_line(tmp_path):
    backend = ReplayedCrash()
    spec = autotune.TuneSpec(autotune.make_workload("tiny", global_batch=16), autotune.load_hardware("cpu"),
                             strategy="grid", trials=10, backend=backend)
    progress = Heard()
    result = autotune.tune(spec, out=tmp_path / "run", callbacks=progress)
    assert result.stop_reason == StopReason.FATAL
    assert backend.runs == 2  # the second config's crash, not the tenth
    stops = [line for line in progress.lines if line.startswith("stopping: ")]
    assert len(stops) == 1 and "\n" not in stops[0] and REAL_ERROR in stops[0]
    recorded = read_results(tmp_path / "run" / "trials.jsonl")
    assert [r.status for r in recorded if r.status != "pruned"] == ["crash", "crash"]
    assert all(REAL_ERROR in r.error for r in recorded if r.status == "crash")  # each with its cause
    assert len({r.config for r in recorded if r.status == "crash"}) == 2


def test_the_deepspeed_backend_records_the_op_failure_and_the_sweep_stops_at_the_second(tmp_path, monkeypatch):
    """The worker's report of the H200 crash (its error, phase and the op and arch-list keys a rank adds now)
    through the real backend and local loop: each trial records its op failure, the second stops the sweep."""
    monkeypatch.setenv(ARCH_ENV, "9.0a")
    with pytest.raises(ValueError) as raised:  # the real exception, from DeepSpeed's own parser
        _Probe().compute_capability_args()
    monkeypatch.setenv(ARCH_ENV, "sm_90a")  # a list the rewrite leaves alone: the crash stays possible
    report = {"status": "crash", "error": REAL_ERROR, "exception": "ValueError", "phase": "build_ops", "rank": 0,
              "fatal": False, **worker_build_failure(raised.value, "fused_adam")}
    tail = real_result().error.split(REAL_ERROR, 1)[1]

    def crashed(spec, options):
        return RunOutcome("crash", f"rank 0 in build_ops: {REAL_ERROR}{tail}", (report,), 6.9, 0.0, spec.log_dir,
                          (), (1,))

    workload, hardware = autotune.make_workload("tiny", global_batch=16), autotune.load_hardware("cpu")
    backend = DeepSpeedBackend(workload, 2**30, hardware, logs_dir=tmp_path / "logs")
    backend.start_ranks = crashed
    space = Space(load_choices("cpu"), workload, hardware)
    recorded: list[TrialResult] = []
    sweep = Sweep.in_memory(space, 2**30, "grid", "deepspeed", record=recorded.append)
    assert run_local(sweep, backend, Budget(10), QuietProgress()) == StopReason.FATAL
    crashes = [r for r in recorded if r.status == "crash"]
    assert len(crashes) == 2
    assert crashes[0].extra["op_failure"] == {
        "op": "fused_adam", "cause": REAL_ERROR + " (TORCH_CUDA_ARCH_LIST='sm_90a')",
        "fix": "set TORCH_CUDA_ARCH_LIST to the GPU's compute capability without a variant letter (e.g. 9.0, not 9.0a)"}
    assert build_failure(crashes[1]).line().startswith("DeepSpeed's fused_adam op cannot be built or loaded: ValueError")


def test_the_worker_reports_the_op_and_blames_the_arch_list_only_where_it_is_parsed():
    try:
        raise RuntimeError("Error building extension 'fused_adam'")
    except RuntimeError as err:
        assert worker_build_failure(err, "fused_adam") == {"op": "fused_adam", "arch_list_fault": False,
                                                           "capability": None}


def test_build_ops_names_the_ops_it_can_build_in_one_line():
    """scripts/build-ops (scripts/setup's background build): an op it does not know is one line, exit 1, before
    anything is imported or built."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "AUTOTUNE_VENV": str(Path(sys.executable).parent.parent)}
    for args, named in ((["fused_adam", "shm_comm"], "shm_comm"), ([], "no op named")):
        done = subprocess.run(["bash", str(root / "scripts" / "build-ops"), *args], capture_output=True, text=True,
                              env=env)
        assert done.returncode == 1
        assert done.stderr.strip().splitlines()[-1] == f"build-ops: {named}: allowed fused_adam, cpu_adam"


# -- each op built at its first use (issue 41) ---------------------------------------------------------------

@pytest.fixture
def preflights(monkeypatch):
    """What the deepspeed backend's trials ask of the preflight, in order with the trials themselves (no child, no
    trial launched: a trial's result is the simulated backend's); `fail` names a builder whose build fails."""
    import autotune.backends.deepspeed as backend_module
    from autotune.backends.simulated import SimulatedBackend

    events: list[tuple[str, object]] = []
    fail: set[str] = set()

    def preflighted(accelerator, ds_configs, env, python, log, say, **options):
        builders = needed_builders(accelerator, ds_configs)
        events.append(("preflight", tuple(builders)))
        if fail & set(builders):
            raise OpBuildFailed(f"DeepSpeed's {sorted(fail)[0]} cannot be built or loaded: a test's failure")
        return tuple(builders)

    simulated = SimulatedBackend(autotune.make_workload("tiny"), autotune.load_hardware("cpu"), 2**34, seed=0)

    def ran(self, config):
        events.append(("run", config))
        return replace(simulated.run(config), backend="deepspeed")

    monkeypatch.setattr(backend_module, "preflight", preflighted)
    monkeypatch.setattr(DeepSpeedBackend, "run", ran)
    return events, fail


def builders_of(config: Config) -> set[str]:
    from autotune.values.dsconfig import ds_config

    return set(needed_builders("cpu", [ds_config(config, autotune.make_workload("tiny"))]))


def test_a_trials_ops_are_built_before_its_first_trial_that_loads_them_and_only_once(tmp_path, preflights):
    events, _ = preflights
    backend = DeepSpeedBackend(autotune.make_workload("tiny"), logs_dir=tmp_path / "logs")
    plain, plain2 = Config(0, 2, 0, "fp32", "none", "none"), Config(1, 4, 0, "fp32", "none", "none")
    offloaded, offloaded2 = Config(1, 2, 0, "fp32", "cpu", "none"), Config(2, 2, 0, "fp32", "cpu", "none")
    said: list[str] = []
    for config in (plain, plain2, offloaded, plain, offloaded2):
        backend.prepare(config, said.append)
    assert events == [("preflight", ("FusedAdamBuilder",)), ("preflight", ("CPUAdamBuilder",))]
    again = DeepSpeedBackend(autotune.make_workload("tiny"), logs_dir=tmp_path / "logs2")
    again.preflight([plain, offloaded], said.append)  # `autotune surface record`'s, of every config at once
    again.prepare(offloaded2, said.append)
    again.prepare(plain2, said.append)
    assert events[2:] == [("preflight", ("FusedAdamBuilder", "CPUAdamBuilder"))]


def deepspeed_spec(strategy) -> autotune.TuneSpec:
    return autotune.TuneSpec(autotune.make_workload("tiny", global_batch=16), autotune.load_hardware("cpu"),
                             strategy=strategy, trials=6, backend="deepspeed", stop_when=0.0)


def test_a_sweep_builds_each_op_just_before_the_first_trial_that_loads_it(tmp_path, preflights):
    """Real sweeps, their trials faked: no op is built that no trial loads (a sweep that never offloads its optimizer
    never builds cpu_adam), none twice, each before the first trial that loads it."""
    from test_user_strategy import FixedOrder

    events, _ = preflights
    offloaded, plain = Config(1, 4, 0, "fp32", "cpu", "none"), Config(1, 4, 0, "fp32", "none", "none")
    autotune.tune(deepspeed_spec(FixedOrder([offloaded, plain, Config(2, 4, 0, "fp32", "none", "none")])),
                  out=tmp_path / "s")
    ran = [c for kind, c in events if kind == "run"]
    assert ran[:2] == [offloaded, plain]
    assert events[:4] == [("preflight", ("CPUAdamBuilder",)), ("run", offloaded),
                          ("preflight", ("FusedAdamBuilder",)), ("run", plain)]
    assert [e for e in events[4:] if e[0] == "preflight"] == []

    events.clear()
    autotune.tune(deepspeed_spec(FixedOrder([plain, Config(1, 2, 0, "fp32", "none", "none")])), out=tmp_path / "p")
    assert [e for e in events if e[0] == "preflight"] == [("preflight", ("FusedAdamBuilder",))]


def test_an_op_that_cannot_be_built_mid_sweep_ends_it_and_keeps_its_trials(tmp_path, preflights):
    """The build's one line (autotune.cli prints it, exit 1: test_autotune_tune_stops_before_the_first_trial), the
    trials before it recorded, and the sweep resumes once the op builds."""
    from test_user_strategy import FixedOrder

    events, fail = preflights
    fail.add("CPUAdamBuilder")
    order = [Config(1, 1, 0, "fp32", "none", "none"), Config(1, 4, 0, "fp32", "cpu", "none"),
             Config(1, 4, 0, "fp32", "none", "none")]
    with pytest.raises(OpBuildFailed, match="CPUAdamBuilder cannot be built"):
        autotune.tune(deepspeed_spec(FixedOrder(order)), out=tmp_path / "s")
    recorded = read_results(tmp_path / "s" / "trials.jsonl")
    assert [r.config for r in recorded] == order[:1] and [c for kind, c in events if kind == "run"] == order[:1]
    fail.clear()  # fixed: the sweep resumes where it stopped, nothing run twice
    events.clear()
    autotune.tune(deepspeed_spec(FixedOrder(order)), out=tmp_path / "s", resume=True)
    again = read_results(tmp_path / "s" / "trials.jsonl")
    assert again[:1] == recorded and [r.config for r in again if r.phase != "confirm"] == order
    assert [c for kind, c in events if kind == "run"][0] == order[1]
