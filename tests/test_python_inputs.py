"""The library's inputs a reviewer drove from Python (docs/python.md): a strategy class or backend builder whose
signature the sweep cannot call, a user backend whose `run` returns no TrialResult, numpy's integers, a bad
`record_surface` limit, a Choices knob of the wrong kind or value, and a path that is no path are each one
ConfigError line naming the value and what is allowed (not a TypeError or AttributeError from deep inside), and
`RunDir` expands `~` as every path the library takes."""

from pathlib import Path

import numpy as np
import pytest

import autotune
from autotune.api import resolve
from autotune.backends import factory
from autotune.search.rundir import RunDir
from autotune.strategies import SearchContext, make_strategy
from autotune.values.config import Config, ConfigError
from autotune.values.hardware import load_hardware
from autotune.values.results import TrialResult
from autotune.values.space import Choices

BUDGET = int(0.85 * 2**30)


def spec(**changes) -> autotune.TuneSpec:
    values = dict(workload=autotune.make_workload("tiny", global_batch=16), hardware=autotune.load_hardware("cpu"),
                  memory_budget_bytes=BUDGET, strategy="random", trials=2, backend="simulated", seed=1, stop_when=0.0)
    return autotune.TuneSpec(**{**values, **changes})


def one_line(err: pytest.ExceptionInfo, *parts: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, text


@pytest.fixture(scope="module")
def space():
    return resolve(spec())[1]


# -- 1: a strategy class whose __init__ does not take the SearchContext -------------------------------------------

class NoArg:
    def __init__(self):
        pass

    def propose(self):
        return None

    def observe(self, config, result):
        pass


class RaisesInside:
    """A builder that takes the context but whose own code raises TypeError: that error stays its own."""

    def __init__(self, context):
        raise TypeError("the user's own bug")


def test_a_strategy_class_with_the_wrong_init_is_one_line(space):
    with pytest.raises(ConfigError) as err:
        spec(strategy=NoArg)
    one_line(err, "strategy", "NoArg", "one argument, the sweep's SearchContext", "builder(context) -> Strategy")
    context = SearchContext(space, BUDGET)
    with pytest.raises(ConfigError) as err:
        make_strategy(NoArg, context)
    one_line(err, "NoArg", "SearchContext")
    with pytest.raises(TypeError, match="the user's own bug"):
        make_strategy(RaisesInside, context)


# -- 2: a user backend whose run returns no TrialResult; a build of the wrong arity -------------------------------

class ReturnsDict:
    def run(self, config):
        return {"status": "ok"}


class FullBackendReturnsStr:
    """Every method of the Backend protocol (as_backend used to pass it through unchecked)."""

    name = "text"
    fatal = None

    def run(self, config):
        return "ok"

    def close(self):
        pass


class Works:
    name = "works"
    fatal = None
    noise = 0.01  # an attribute of its own, which the drivers may read through the adapter

    def run(self, config):
        return TrialResult(config, "ok", throughput_samples_per_s=float(config.micro_batch), step_time_s=1.0,
                           peak_memory_bytes=2**20, backend=self.name)

    def close(self):
        pass


@pytest.mark.parametrize("backend, named", [(ReturnsDict(), "{'status': 'ok'} (a dict)"),
                                            (FullBackendReturnsStr(), "'ok' (a str)")])
def test_a_user_backend_that_returns_no_trial_result_is_one_line(tmp_path, backend, named):
    with pytest.raises(ConfigError) as err:
        autotune.tune(spec(backend=backend), out=tmp_path / "run")
    one_line(err, "returned", named, "allowed a TrialResult")


def test_a_user_backend_that_returns_trial_results_still_runs_and_keeps_its_attributes(tmp_path):
    adapted = factory.as_backend(Works())
    assert adapted.name == "works" and getattr(adapted, "noise") == 0.01
    result = autotune.tune(spec(backend=Works()), out=tmp_path / "run")
    assert len(result.results) == 2 and all(r.ok for r in result.results)


def test_a_backend_kind_whose_build_takes_the_wrong_arguments_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(factory, "_REGISTRY", dict(factory._REGISTRY))  # the kinds are gone after the test
    for build in (lambda settings: Works(), lambda settings, run_dir, options, extra: Works()):
        with pytest.raises(ConfigError) as err:
            autotune.BackendKind("mine", build)
        one_line(err, "BackendKind 'mine' build", "build(settings, run_dir, options) -> Backend")
    autotune.register_backend(autotune.BackendKind("dicts", lambda settings, run_dir, options: ReturnsDict()))
    backend = autotune.make_backend(spec(backend="dicts").settings(), str(tmp_path))
    with pytest.raises(ConfigError) as err:
        backend.run(Config(0, 1, 0, "fp32"))
    one_line(err, "backend 'ReturnsDict'", "(a dict): allowed a TrialResult")
    autotune.register_backend(autotune.BackendKind("nothing", lambda settings, run_dir, options: None))
    with pytest.raises(ConfigError) as err:
        autotune.make_backend(spec(backend="nothing").settings(), str(tmp_path))
    one_line(err, "backend kind 'nothing': its build returned None: needs a run(config)")


# -- 3: numpy's integers are whole numbers; bool stays refused ------------------------------------------------------

def test_numpy_integers_are_taken_as_whole_numbers(space):
    workload = autotune.make_workload("tiny", global_batch=np.int64(16), gpus=np.int64(1))
    assert type(workload.global_batch) is int and type(workload.gpus) is int and workload.global_batch == 16
    settings = spec(workload=workload, memory_budget_bytes=np.int64(2**30), seed=np.int64(7)).settings()
    assert (settings.memory_budget_bytes, settings.seed) == (2**30, 7)
    assert type(settings.memory_budget_bytes) is int and type(settings.seed) is int  # run.json writes them
    assert autotune.rank_configs(space, np.int64(2**30)) == autotune.rank_configs(space, 2**30)
    assert autotune.rank_configs(space, np.float32(2**30)).budget_bytes == 2**30


def test_a_sweep_of_numpy_numbers_runs_and_records_plain_ones(tmp_path):
    """trials, confirm, a time budget and a target of numpy's types were refused (or, as np.float32, reached
    run.json's JSON, which takes none)."""
    import json

    workload = autotune.make_workload("tiny", global_batch=16, gpus=1)
    given = spec(workload=workload, trials=np.int64(2), seed=np.int64(3), confirm=np.int64(0),
                 time_budget_s=np.float32(600), target_gpus=np.int64(2))
    assert (type(given.trials), type(given.seed), type(given.confirm), type(given.time_budget_s)) == (int, int, int,
                                                                                                     float)
    result = autotune.tune(given, out=tmp_path / "run")
    assert len(result.results) == 2
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["seed"] == 3 and run["target_gpus"] == 2 and run["budget"]["time_budget_s"] == 600


def test_bool_is_still_no_number():
    for call, named in ((lambda: spec(memory_budget_bytes=True), "memory budget True"),
                        (lambda: spec(seed=True), "seed True is not a whole number"),
                        (lambda: autotune.make_workload("tiny", global_batch=True), "global_batch=True"),
                        (lambda: autotune.rank_configs(resolve(spec())[1], True), "budget_bytes True")):
        with pytest.raises(ConfigError) as err:
            call()
        one_line(err, named)


# -- 4: record_surface's limit --------------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [-1, 0, "3", 2.5, True])
def test_a_record_surface_limit_that_is_no_positive_whole_number_is_one_line(space, tmp_path, limit):
    backend = factory.simulated_backend(space.workload, space.hardware, BUDGET)
    with pytest.raises(ConfigError) as err:
        autotune.record_surface(space, backend, tmp_path / "s.jsonl", limit=limit, progress=lambda line: None)
    one_line(err, f"limit {limit!r}: allowed None (every config) or a positive whole number")
    assert list(tmp_path.iterdir()) == []


def test_a_record_surface_limit_records_that_many(space, tmp_path):
    backend = factory.simulated_backend(space.workload, space.hardware, BUDGET)
    done = autotune.record_surface(space, backend, tmp_path / "s.jsonl", limit=np.int64(2), progress=lambda line: None)
    assert done.recorded == 2


# -- 5: Choices' knobs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("knob, value, named", [
    ("micro_batch", "12", "Choices micro_batch '12': allowed a list of positive integers"),
    ("micro_batch", 4, "Choices micro_batch 4: allowed a list of positive integers"),
    ("zero_stage", (7,), "Choices zero_stage: bad value 7: allowed one of 0, 1, 2, 3"),
    ("micro_batch", (0, 2), "Choices micro_batch: bad value 0: allowed positive integers"),
    ("micro_batch", (2.0,), "Choices micro_batch: bad value 2.0: allowed positive integers"),
    ("ckpt_interval", (True,), "Choices ckpt_interval: bad value True"),
    ("precision", ("fp8",), "Choices precision: bad value 'fp8': allowed one of fp32, fp16, bf16"),
    ("precision", "bf16", "Choices precision 'bf16': allowed a list of one of fp32, fp16, bf16"),
    ("offload_optimizer", ("gpu",), "Choices offload_optimizer: bad value 'gpu': allowed one of none, cpu, nvme"),
    ("offload_param", (None,), "Choices offload_param: bad value None"),
])
def test_a_choices_knob_of_the_wrong_kind_or_value_is_one_line(knob, value, named):
    with pytest.raises(ConfigError) as err:
        Choices(**{knob: value})
    one_line(err, named)


def test_choices_keep_tuples_of_plain_values():
    choices = Choices(micro_batch=[np.int64(2), 4], precision=["fp32"])
    assert choices.micro_batch == (2, 4) and type(choices.micro_batch[0]) is int and choices.precision == ("fp32",)
    assert hash(choices) == hash(Choices(micro_batch=(2, 4), precision=("fp32",)))


# -- 6: paths: RunDir expands `~`; a path that is no path ----------------------------------------------------------

def test_run_dir_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert RunDir("~/x").path == tmp_path / "x"
    assert autotune.RunDir(Path("~") / "y").path == tmp_path / "y"


def test_load_hardware_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.yaml").write_text("base: cpu\nname: mine\n")
    assert load_hardware("~/mine.yaml").name == "mine"
    assert load_hardware(tmp_path / "mine.yaml").name == "mine"


@pytest.mark.parametrize("call, named", [(lambda: RunDir(5), "RunDir path 5: allowed a folder's path"),
                                         (lambda: RunDir(None), "RunDir path None: allowed a folder's path"),
                                         (lambda: load_hardware(5), "hardware 5: allowed a profile's name"),
                                         (lambda: load_hardware(["cpu"]), "hardware ['cpu']: allowed")])
def test_a_path_that_is_no_path_is_one_line(call, named):
    with pytest.raises(ConfigError) as err:
        call()
    one_line(err, named)
