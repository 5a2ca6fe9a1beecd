"""The library from a notebook (docs/python.md): a bad value given to `autotune.tune`, `TuneSpec`, `predict`,
`rank_configs`, `make_backend`, `register_backend` or `record_surface` is one ConfigError naming it and what is
allowed, before anything is written; every path it takes expands `~`; a default run directory is always a new
one; Ctrl-C anywhere after the checks ends `tune()` with StopReason.INTERRUPTED (no exception), leaving a
directory the same call accepts; `ConsoleProgress` counts to the sweep's own trials."""

import io
import json
from datetime import datetime
from pathlib import Path

import pytest
from rich.console import Console

import autotune
from autotune import api
from autotune.api import resolve
from autotune.backends import factory
from autotune.drivers.stop import StopReason
from autotune.values.config import Config, ConfigError
from cli_run import cli

ROOT = Path(__file__).resolve().parent.parent
SURFACE = ROOT / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
MB1 = Config(0, 1, 0, "fp32")  # configs of the tiny CPU space at global batch 16
MB2 = Config(0, 2, 0, "fp32")


def spec(**changes) -> autotune.TuneSpec:
    values = dict(workload=autotune.make_workload("tiny", global_batch=16), hardware=autotune.load_hardware("cpu"),
                  memory_budget_bytes=int(0.85 * 2**30), strategy="random", trials=2, backend="simulated", seed=1,
                  stop_when=0.0)
    return autotune.TuneSpec(**{**values, **changes})


def uninterrupted(call):
    """call(), failing the test (not ending the session) if a KeyboardInterrupt escapes it."""
    try:
        return call()
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped tune(): docs/python.md promises StopReason.INTERRUPTED, no exception")


def one_line(err: pytest.ExceptionInfo, *parts: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, text


class Proposes:
    """A user's strategy proposing `order` in turn, then nothing."""

    name = "proposes"

    def __init__(self, *order):
        self.order = list(order)

    def propose(self):
        return self.order.pop(0) if self.order else None

    def observe(self, config, result):
        pass


# -- 1, 2: the seed and the budget -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2**40, 2**32, -1, 1.5, "3", True])
def test_a_seed_numpy_and_optuna_refuse_is_refused_by_the_spec_naming_the_range(seed, tmp_path):
    with pytest.raises(ConfigError) as err:
        autotune.tune(spec(seed=seed), out=tmp_path / "run")
    one_line(err, f"seed {seed!r}" if not isinstance(seed, str) else "seed '3'", "0 to 4294967295")
    assert not (tmp_path / "run").exists()


def test_the_cli_and_the_library_check_the_seed_alike(capsys):
    from autotune.values.argtypes import MAX_SEED, SEEDS

    assert spec(seed=MAX_SEED).seed == MAX_SEED
    with pytest.raises(ConfigError, match="seed -1 must be 0 or a positive integer: allowed 0 to 4294967295"):
        spec(seed=-1)
    code, _, err = cli(["tune", "--backend", "simulated", "--seed", "-1"], capsys)
    assert code == 2 and f"'-1' must be 0 or a positive integer: allowed {SEEDS}" in err


@pytest.mark.parametrize("budget", [float("inf"), float("-inf"), float("nan")])
def test_a_memory_budget_that_is_no_number_of_bytes_is_one_line(budget):
    with pytest.raises(ConfigError) as err:
        spec(memory_budget_bytes=budget)
    one_line(err, f"memory budget {budget!r}", "a positive number of bytes")


# -- 3: arguments of the wrong kind --------------------------------------------------------------------------

class NoMessage:
    def started(self, number, launched, config): ...
    def finished(self, result, launched, best): ...
    def pruned(self, result): ...


@pytest.mark.parametrize("call, named", [
    (lambda: autotune.tune(spec(), out=42), "out 42: allowed a run directory's path"),
    (lambda: autotune.tune(spec(), out=""), "out '': allowed a run directory's path"),
    (lambda: autotune.tune(spec(), callbacks=42), "callbacks 42: allowed None or a Progress"),
    (lambda: autotune.tune(spec(), callbacks=NoMessage()), "(missing: message)"),
    (lambda: autotune.tune(None), "spec None: allowed a TuneSpec"),
    (lambda: autotune.tune(spec(), resume="yes"), "resume 'yes': allowed True"),
    (lambda: autotune.tune(spec(), executor="local"), "executor 'local': allowed autotune.RayOptions"),
    (lambda: spec(surface=42), "surface 42: allowed a replay surface's JSONL file"),
    (lambda: spec(space=42), "space 42: allowed a preset's name"),
    (lambda: spec(hardware=42), "hardware 42: allowed a profile's name"),
    (lambda: spec(storage=42), "storage 42: allowed an Optuna RDB URL"),
])
def test_an_argument_of_the_wrong_kind_is_one_config_error_and_nothing_is_written(call, named, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        call()
    one_line(err, named)
    assert list(tmp_path.iterdir()) == []


def test_a_strategy_proposing_no_config_is_named_with_what_it_returned(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        autotune.tune(spec(strategy=Proposes("z2 mb4")), out=out)
    one_line(err, "strategy 'proposes': propose() returned 'z2 mb4': allowed a Config of the space")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # as any sweep that fails before its first trial
    assert len(autotune.tune(spec(strategy=Proposes(MB1)), out=out).results) == 1  # the same call, corrected


def test_a_strategy_returning_junk_mid_sweep_keeps_what_was_recorded(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        autotune.tune(spec(strategy=Proposes(MB1, MB2, 3), trials=5), out=out)
    one_line(err, "strategy 'proposes': propose() returned 3")
    lines = (out / "trials.jsonl").read_text().splitlines()
    assert [json.loads(line)["config"]["micro_batch"] for line in lines] == [1, 2]
    resumed = autotune.tune(spec(strategy=Proposes(MB1, MB2), trials=5), out=out, resume=True)
    assert [r.config for r in resumed.results] == [MB1, MB2]


# -- 4: a proposal outside the space -------------------------------------------------------------------------

def test_a_proposal_outside_the_space_is_refused_before_it_is_recorded(tmp_path):
    out = tmp_path / "run"
    outside = Config(0, 1024, 0, "fp32")
    with pytest.raises(ConfigError) as err:
        autotune.tune(spec(strategy=Proposes(MB1, outside), trials=5), out=out)
    one_line(err, "strategy 'proposes'", "z0 mb1024 ck0 fp32", "micro_batch 1024 is not one of its values",
             "allowed 1, 2, 4, 8")
    recorded = [json.loads(line)["config"] for line in (out / "trials.jsonl").read_text().splitlines()]
    assert recorded == [MB1.to_dict()]  # nothing of the space's outside: `autotune report` reads the record
    code = autotune.tune(spec(strategy=Proposes(MB2), trials=5), out=out, resume=True)
    assert code.stop_reason == StopReason.DONE and (out / "report.md").is_file()


# -- 5: a surface without the replay backend -----------------------------------------------------------------

def test_a_surface_with_another_backend_is_refused_as_the_cli_refuses_it(tmp_path, capsys):
    expected = f"--surface (`surface`) {SURFACE} is only for --backend replay (got --backend simulated)"
    with pytest.raises(ConfigError) as err:
        autotune.tune(spec(surface=str(SURFACE)), out=tmp_path / "run")
    assert str(err.value) == expected
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="is only for --backend replay"):
        resolve(spec(surface=str(SURFACE)))
    code, _, cli_err = cli(["tune", "--backend", "simulated", "--surface", str(SURFACE), "--out",
                            str(tmp_path / "cli")], capsys)
    assert code == 2 and expected in cli_err


# -- 6: default run directories ------------------------------------------------------------------------------

class FrozenClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 1, 2, 3, 4, 5)


def test_two_sweeps_in_one_second_get_two_new_default_run_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(api, "datetime", FrozenClock)
    first = autotune.tune(spec())
    second = autotune.tune(spec())
    assert first.run_dir == Path("runs/tiny-random-20260102-030405")
    assert second.run_dir == Path("runs/tiny-random-20260102-030405-2")
    assert len(first.results) == len(second.results) == 2
    assert api.default_run_dir("tiny", "random", taken=[Path("runs/tiny-random-20260102-030405-3")]).name.endswith("-4")


# -- 7: `~` in every path --------------------------------------------------------------------------------------

@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return folder


def test_every_path_the_library_takes_expands_the_home_folder(home):
    (home / "space.yaml").write_text("zero_stage: [0]\nmicro_batch: [1, 2]\nckpt_interval: [0]\nprecision: [fp32]\n")
    (home / "surface.jsonl").write_bytes(SURFACE.read_bytes())
    tuned = autotune.tune(spec(space="~/space.yaml", storage="~/study.log"), out="~/run")
    assert tuned.run_dir == home / "run" and (home / "run" / "trials.jsonl").is_file()
    assert (home / "study.log").is_file()
    replayed = spec(backend="replay", surface="~/surface.jsonl", hardware=None)
    assert replayed.surface == str(home / "surface.jsonl") and resolve(replayed)[0].surface == replayed.surface
    with pytest.raises(ConfigError, match=str(home / "policy")):  # named as expanded: no folder named ~ is looked for
        spec(strategy="rl", policy="~/policy")
    _, space = resolve(spec(space="~/space.yaml"))
    backend = factory.simulated_backend(space.workload, space.hardware, int(0.85 * 2**30))
    autotune.record_surface(space, backend, "~/recorded.jsonl", progress=lambda line: None)
    assert len((home / "recorded.jsonl").read_text().splitlines()) == len(space)
    assert not Path("~").exists() and list(Path.cwd().iterdir()) == []


# -- 8: Ctrl-C anywhere after the checks -----------------------------------------------------------------------

def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("step", ["begin", "open_sweep", "make_backend"])
def test_ctrl_c_before_the_first_trial_returns_interrupted_and_the_same_call_starts_the_sweep(step, tmp_path,
                                                                                              monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as patched:
        patched.setattr(api, step, interrupt)
        result = uninterrupted(lambda: autotune.tune(spec(), out=out))
    assert result.stop_reason == StopReason.INTERRUPTED and result.results == () and result.best is None
    assert result.run_dir == out and not (out / "trials.jsonl").exists()
    again = uninterrupted(lambda: autotune.tune(spec(), out=out))  # not "already holds a sweep"
    assert again.stop_reason == StopReason.TRIALS and len(again.results) == 2


def test_ctrl_c_after_the_settings_are_written_leaves_a_sweep_that_resume_also_takes(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as patched:
        patched.setattr(api, "open_sweep", interrupt)
        assert uninterrupted(lambda: autotune.tune(spec(), out=out)).stop_reason == StopReason.INTERRUPTED
    assert (out / "run.json").is_file()
    assert len(uninterrupted(lambda: autotune.tune(spec(), out=out, resume=True)).results) == 2


def test_ctrl_c_in_the_first_trial_leaves_a_directory_the_same_call_takes(tmp_path):
    class Interrupted:
        name = "interrupted"

        def run(self, config):
            raise KeyboardInterrupt

    out = tmp_path / "run"
    result = uninterrupted(lambda: autotune.tune(spec(backend=Interrupted()), out=out))
    assert result.stop_reason == StopReason.INTERRUPTED and result.results == ()
    assert len(autotune.tune(spec(), out=out).results) == 2  # nothing was recorded: without resume
    with pytest.raises(ConfigError, match="already holds a sweep"):  # once something is, only with resume
        autotune.tune(spec(), out=out)


def test_ctrl_c_while_a_resumed_sweep_starts_or_writes_its_outputs_keeps_its_record(tmp_path, monkeypatch):
    out = tmp_path / "run"
    autotune.tune(spec(), out=out)
    before = (out / "trials.jsonl").read_bytes()
    for step in ("open_sweep", "close_sweep"):
        with monkeypatch.context() as patched:
            patched.setattr(api, step, interrupt)
            result = uninterrupted(lambda: autotune.tune(spec(trials=4), out=out, resume=True))
        assert result.stop_reason == StopReason.INTERRUPTED and len(result.results) >= 2 and result.best is not None
    assert (out / "trials.jsonl").read_bytes().startswith(before)
    assert len(autotune.tune(spec(trials=4), out=out, resume=True).results) == 4


def test_a_resume_of_an_empty_folder_says_to_run_without_resume(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(ConfigError, match=r"holds no sweep to resume .*: run the command without --resume \(the call with resume=False\)"):
        autotune.tune(spec(), out=tmp_path / "run", resume=True)


# -- 9: ConsoleProgress --------------------------------------------------------------------------------------

@pytest.mark.parametrize("given", [None, 99])
def test_console_progress_counts_to_the_sweeps_own_trials(given, tmp_path):
    text = io.StringIO()
    console = Console(file=text, width=200, soft_wrap=True)
    progress = autotune.ConsoleProgress(console=console) if given is None else autotune.ConsoleProgress(given, console)
    autotune.tune(spec(trials=3, strategy="grid"), out=tmp_path / "run", callbacks=progress)
    lines = [line for line in text.getvalue().splitlines() if line.startswith("trial")]
    assert lines and all("/3 " in line for line in lines), lines
    with pytest.raises(ConfigError, match="total_trials 0: allowed a positive integer, or None"):
        autotune.ConsoleProgress(0)


# -- 10: RayOptions --------------------------------------------------------------------------------------------

def test_ray_options_is_exported():
    from autotune.drivers.ray import RayOptions

    assert autotune.RayOptions is RayOptions and "RayOptions" in autotune.__all__


# -- 11: predict, rank_configs, make_backend, register_backend, record_surface ---------------------------------

@pytest.fixture(scope="module")
def space():
    return resolve(spec())[1]


def test_predict_checks_its_arguments_and_takes_a_profile_name(space):
    workload, hardware = space.workload, space.hardware
    assert autotune.predict(MB1, workload, "cpu") == autotune.predict(MB1, workload, hardware)
    assert autotune.predict(MB1.to_dict(), workload, hardware) == autotune.predict(MB1, workload, hardware)
    for call, named in ((lambda: autotune.predict("z2 mb4", workload, hardware), "config 'z2 mb4': allowed a Config"),
                        (lambda: autotune.predict(MB1, "tiny", hardware), "workload 'tiny': allowed a Workload"),
                        (lambda: autotune.predict(MB1, workload, 42), "hardware 42: allowed a Hardware"),
                        (lambda: autotune.predict(MB1, workload, "cpux"), "unknown hardware 'cpux'"),
                        (lambda: autotune.predict(MB1, workload, hardware, {}), "calibration {}: allowed")):
        with pytest.raises(ConfigError) as err:
            call()
        one_line(err, named)


def test_rank_configs_checks_its_arguments_and_takes_a_size(space):
    assert autotune.rank_configs(space, "1GiB") == autotune.rank_configs(space, 2**30)
    for call, named in ((lambda: autotune.rank_configs(space, -1), "budget_bytes: size -1 must be positive"),
                        (lambda: autotune.rank_configs(space, 0.0), "budget_bytes: size 0.0 must be positive"),
                        (lambda: autotune.rank_configs(space, float("inf")), "too large"),
                        (lambda: autotune.rank_configs(space, None), "budget_bytes None: allowed a positive number"),
                        (lambda: autotune.rank_configs(space, "lots"), "size 'lots' is not understood"),
                        (lambda: autotune.rank_configs(space.choices, 2**30), "a Space adds the workload and hardware"),
                        (lambda: autotune.rank_configs("cpu", 2**30), "space 'cpu': allowed a Space")):
        with pytest.raises(ConfigError) as err:
            call()
        one_line(err, named)


def test_make_backend_checks_its_arguments_and_takes_a_folder(tmp_path):
    settings = spec().settings()
    assert autotune.make_backend(settings, str(tmp_path)).name == "simulated"
    for call, named in ((lambda: autotune.make_backend("simulated"), "settings 'simulated': allowed a RunSettings"),
                        (lambda: autotune.make_backend(settings, 42), "run_dir 42: allowed a RunDir"),
                        (lambda: autotune.make_backend(settings, None, {}), "options {}: allowed a TrialOptions")):
        with pytest.raises(ConfigError) as err:
            call()
        one_line(err, named)


def test_a_backend_kind_that_cannot_be_registered_is_refused_and_the_registry_stays_whole(monkeypatch):
    monkeypatch.setattr(factory, "_REGISTRY", dict(factory._REGISTRY))
    for call, named in ((lambda: autotune.BackendKind(42, None), "BackendKind name 42: allowed a name"),
                        (lambda: autotune.BackendKind("my kind", print), "BackendKind name 'my kind'"),
                        (lambda: autotune.BackendKind("mine", None), "BackendKind 'mine' build None: allowed a callable"),
                        (lambda: autotune.BackendKind("mine", print, real="yes"), "real 'yes': allowed True or False"),
                        (lambda: autotune.register_backend("mine"), "backend kind 'mine': allowed a BackendKind")):
        with pytest.raises(ConfigError) as err:
            call()
        one_line(err, named)
    with pytest.raises(ConfigError, match="backend 'quantum': allowed deepspeed, simulated, replay, script$"):
        factory.backend_kind("quantum")


def test_record_surface_checks_its_arguments(space, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    backend = factory.simulated_backend(space.workload, space.hardware, int(0.85 * 2**30))
    for call, named in ((lambda: autotune.record_surface(space.choices, backend, "s.jsonl"), "allowed a Space"),
                        (lambda: autotune.record_surface(space, object(), "s.jsonl"), "needs a run(config)"),
                        (lambda: autotune.record_surface(space, backend, 42), "out 42: allowed a surface's JSONL"),
                        (lambda: autotune.record_surface(space, backend, "s.jsonl", repeats=0), "repeats 0")):
        with pytest.raises(ConfigError) as err:
            call()
        one_line(err, named)
    assert list(tmp_path.iterdir()) == []


def test_no_connection_to_the_study_is_left_open_after_tune_returns(tmp_path):
    """A notebook's process outlives its sweeps: study.db, -wal and -shm stayed open after tune() returned (copying
    study.db alone from a live notebook could then miss what the write-ahead log held)."""
    import os

    out = tmp_path / "run"
    autotune.tune(spec(strategy="optuna"), out=out)
    fds = Path("/proc/self/fd")
    held = [os.readlink(fd) for fd in fds.iterdir() if os.path.exists(fd)]
    assert not [path for path in held if path.startswith(str(out))], held


# -- the Python door's inputs a notebook user gets wrong (a review of 190: each one line, nothing written) ------

TINY = autotune.make_workload("tiny")


@pytest.mark.parametrize("call, words", [
    (lambda: autotune.predict(Config(0, 1, 0, "fp16"), TINY, "cpu"), "config z0 mb1 ck0 fp16: precision fp16 is not supported"),
    (lambda: autotune.predict(Config(0, 1, 0, "bf16", offload_param="cpu"), TINY, "cpu"), "offload_param needs zero_stage 3"),
    (lambda: autotune.predict(Config(0, 3, 0, "bf16"), TINY, "cpu"), "is not a multiple of micro_batch 3"),
    (lambda: autotune.predict(Config(0, 1, 99, "bf16"), TINY, "cpu"), "ckpt_interval 99 exceeds the model's 4 layers"),
    (lambda: autotune.Space(autotune.Choices(), "tiny", autotune.load_hardware("cpu")), "Space workload 'tiny': allowed a Workload"),
    (lambda: autotune.Space(autotune.Choices(), TINY, "cpu"), "Space hardware 'cpu': allowed a Hardware"),
    (lambda: autotune.Space({"zero_stage": [0]}, TINY, autotune.load_hardware("cpu")), "Space choices {'zero_stage': [0]}: allowed a Choices"),
    (lambda: Config.from_dict(5), "config 5: allowed an object of its knobs"),
    (lambda: Config.from_dict([1, 2]), "config [1, 2]: allowed an object of its knobs"),
    (lambda: Config.from_json("{zero"), "config '{zero': not JSON ("),
    (lambda: autotune.Plan(spec(), "out", "no"), "resume 'no': allowed True (continue the sweep in `out`) or False"),
    (lambda: autotune.tune(spec(memory_budget_bytes=10**30)), "memory budget 1000000000000000000000000000000: too large: allowed 1 B to 1024 TiB"),
])
def test_a_bad_library_input_is_one_config_error_naming_it(call, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        call()
    assert words in str(err.value) and "\n" not in str(err.value), err.value
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_numpy_integers_make_the_same_config_and_a_long_strategy_name_a_folder_that_can_exist():
    import numpy  # torch's dependency: always here

    made = Config(numpy.int64(0), numpy.int64(2), 0, "bf16")
    assert made == Config(0, 2, 0, "bf16") and type(made.micro_batch) is int and json.loads(made.to_json())["micro_batch"] == 2
    folder = api.default_run_dir("org/" + "m" * 300, "é" * 5000)
    assert len(folder.name.encode()) <= 255 - len("-99") and folder.name.startswith("org--mmm")
