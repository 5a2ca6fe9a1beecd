"""The library's public API: the README's Python example runs as written, every strategy runs on every
backend through `autotune.tune`, and `import autotune` stays cheap."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autotune
from autotune.values.config import ConfigError
from micro import MICRO

ROOT = Path(__file__).resolve().parent.parent
SURFACE = ROOT / "benchmarks" / "surfaces" / "tiny-cpu.jsonl"
STRATEGIES = ("grid", "random", "optuna", "optuna-gp", "rl", "hybrid")


def readme_python() -> str:
    section = ROOT.joinpath("README.md").read_text().split("## From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_python(), "README.md", "exec"), {})
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[20")]  # DeepSpeed's logs
    assert "trials launched" in out[0] and "samples/s" in out[1] and out[2].endswith("best_ds_config.json")
    assert out[3] == "1"  # the objective's fastest micro-batch
    assert (tmp_path / "runs/notebook/best_ds_config.json").exists()
    assert (tmp_path / "runs/notebook-mine/trials.jsonl").exists()


def test_a_sweep_from_python_prints_no_optuna_info_lines_and_leaves_optunas_level_as_it_was(tmp_path):
    import logging

    import optuna

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    lines = Lines()
    before = optuna.logging.get_verbosity()  # other test modules quiet Optuna when they are collected
    optuna.logging.set_verbosity(optuna.logging.INFO)  # Optuna's default, a user's notebook
    logging.getLogger("optuna").addHandler(lines)
    try:
        autotune.tune(spec("optuna", "simulated", trials=3), tmp_path / "run")
        assert optuna.logging.get_verbosity() == optuna.logging.INFO
        optuna.logging.get_logger("optuna.study").info("after the sweep")  # Optuna speaks again
    finally:
        logging.getLogger("optuna").removeHandler(lines)
        optuna.logging.set_verbosity(before)
    said = [r.getMessage() for r in lines.records]
    assert said == ["after the sweep"], said  # not "A new study created in RDB ...", nor a line a trial


def spec(strategy: str, backend, trials: int = 4, **changes) -> autotune.TuneSpec:
    values = dict(workload=autotune.make_workload("tiny", global_batch=16), hardware=autotune.load_hardware("cpu"),
                  memory_budget_bytes=int(0.85 * 2**30), strategy=strategy, trials=trials, backend=backend, seed=1)
    return autotune.TuneSpec(**{**values, **changes})


class Halving:
    """A user's objective: throughput falls with the micro-batch, no memory limit."""

    name = "halving"

    def run(self, config):
        return autotune.TrialResult(config, "ok", throughput_samples_per_s=100.0 / config.micro_batch,
                                    step_time_s=0.01 * config.micro_batch, peak_memory_bytes=2**20,
                                    backend=self.name)


def backends():
    return {"simulated": {}, "replay": {"surface": str(SURFACE)}, "objective": {}}


@pytest.mark.parametrize("backend", list(backends()))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_on_every_backend(strategy, backend, tmp_path):
    chosen = Halving() if backend == "objective" else backend
    result = autotune.tune(spec(strategy, chosen, **backends()[backend]), out=tmp_path / "run")
    assert isinstance(result.stop_reason, autotune.StopReason)
    assert 1 <= result.launched <= 4 and result.results
    assert all(r.backend == (Halving.name if backend == "objective" else backend)
               for r in result.results if r.status != "pruned")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trials"] == len(result.results) and summary["strategy"] == strategy
    if result.best is not None:
        assert result.best_ds_config.exists() and result.best.fits(result.summary["memory_budget_bytes"])
    resumed = autotune.tune(spec(strategy, chosen, **backends()[backend]), out=tmp_path / "run", resume=True)
    assert resumed.results[:len(result.results)] == result.results  # nothing recorded is lost or repeated


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.xdist_group("slow")) if s == "rl" else s
                                      for s in STRATEGIES])  # RLlib starts Ray: the Ray tests' group (conftest.py)
def test_every_strategy_on_real_deepspeed_trials(strategy, tmp_path):
    # Global batch 4: at most 4 micro-steps a step (16 at micro-batch 1), so a trial is mostly its launch; the
    # strategies still choose among every stage, precision, offload and checkpointing of the CPU space.
    workload = autotune.make_workload(MICRO, global_batch=4)
    result = autotune.tune(spec(strategy, "deepspeed", trials=2, workload=workload), out=tmp_path / "run")
    ran = [r for r in result.results if r.status != "pruned"]
    assert ran and all(r.backend == "deepspeed" for r in ran)
    assert any(r.ok for r in ran), [r.error for r in ran]


def test_bad_specs_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="strategy 'annealing': allowed grid"):
        spec("annealing", "simulated")
    with pytest.raises(ConfigError, match="trials 0"):
        spec("grid", "simulated", trials=0)
    with pytest.raises(ConfigError, match="backend 'quantum': allowed deepspeed, simulated, replay$"):
        autotune.tune(spec("grid", "quantum"), out=tmp_path / "run")
    # The script kind runs TuneSpec.for_script's trials: given by name it made a run directory, then failed there.
    with pytest.raises(ConfigError, match=r"backend 'script': allowed deepspeed, simulated, replay \(a training "
                                          r"script's trials: TuneSpec.for_script\)"):
        spec("grid", "script")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="needs a run\\(config\\)"):
        autotune.tune(spec("grid", object()), out=tmp_path / "other")
    autotune.tune(spec("grid", "simulated", trials=1), out=tmp_path / "done")
    with pytest.raises(ConfigError, match=r"already holds a sweep: pass --resume \(resume=True from Python\)"):
        autotune.tune(spec("grid", "simulated", trials=1), out=tmp_path / "done")


@pytest.mark.parametrize("changes, named", [
    ({"trials": "5"}, "trials '5': must be a positive integer"),
    ({"trials": 2.5}, "trials 2.5: must be a positive integer"),
    ({"trials": True}, "trials True: must be a positive integer"),
    ({"time_budget_s": "8h"}, "time budget '8h': must be a positive number of seconds"),
    ({"trial_timeout_s": -1}, "trial timeout -1: must be a positive number of seconds"),
    ({"workload": "tiny"}, "workload 'tiny': allowed a Workload, e.g. autotune.make_workload("),
])
def test_a_python_value_of_the_wrong_type_is_one_line_naming_it(changes, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        spec("grid", "simulated", **changes)


def test_a_scripts_arguments_and_global_batch_are_checked_and_out_expands_the_home(tmp_path, monkeypatch):
    script = ROOT / "examples" / "train_dict.py"
    with pytest.raises(ConfigError, match=r"script_args '--steps 6': allowed a list of arguments"):
        autotune.TuneSpec.for_script(script, "--steps 6")
    with pytest.raises(ConfigError, match="global_batch 0: allowed a positive integer, or None"):
        autotune.TuneSpec.for_script(script, ["--steps", "6"], global_batch=0)
    monkeypatch.setenv("HOME", str(tmp_path))
    result = autotune.tune(spec("grid", "simulated", trials=1), out="~/run")
    assert result.run_dir == tmp_path / "run" and (tmp_path / "run" / "summary.json").is_file()


def test_a_sweep_that_fails_before_its_first_trial_leaves_nothing_that_refuses_the_corrected_call(tmp_path):
    from autotune.drivers.ray import RayOptions

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="cannot reach Ray cluster at 127.0.0.1:1"):
        autotune.tune(spec("grid", "simulated", trials=1), out=out, executor=RayOptions("127.0.0.1:1"))
    assert not out.exists()  # the cluster is reached before any run directory is written
    assert len(autotune.tune(spec("grid", "simulated", trials=1), out=out).results) == 1


def test_a_registered_backend_kind_is_built_by_the_factory(tmp_path, monkeypatch):
    from autotune.backends import factory

    monkeypatch.setattr(factory, "_REGISTRY", dict(factory._REGISTRY))  # the kind is gone after the test
    kind = autotune.BackendKind("halving", lambda settings, run_dir, options: Halving())
    autotune.register_backend(kind)
    result = autotune.tune(spec("random", "halving", trials=3), out=tmp_path / "run")
    assert result.best.config.micro_batch == min(r.config.micro_batch for r in result.results if r.ok)


def test_import_autotune_stays_cheap():
    code = "import sys, autotune; print(sorted(m for m in ('optuna', 'ray', 'rich', 'autotune.api') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert set(autotune.__all__) >= {"tune", "TuneSpec", "TuneResult", "predict", "rank_configs", "record_surface"}
    for name in autotune.__all__:
        assert getattr(autotune, name) is not None


def test_a_hub_id_names_one_run_folder():
    from autotune.api import default_run_dir

    path = default_run_dir("meta-llama/Meta-Llama-3-8B", "optuna")
    assert path.parent.name == "runs" and path.name.startswith("meta-llama--Meta-Llama-3-8B-optuna-")


def test_a_strategys_own_name_cannot_take_the_default_folder_out_of_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class Escaping:
        name = "a/../../evil"

        def propose(self):
            return autotune.Config(0, 1, 0, "fp32")

        def observe(self, config, result):
            pass

    result = autotune.tune(spec(Escaping(), "simulated", trials=1))
    assert result.run_dir.parent.resolve() == (tmp_path / "runs").resolve()
    assert result.run_dir.name.startswith("tiny-a-..-..-evil-") and not list(tmp_path.parent.glob("evil-*"))


def test_tune_many_takes_one_or_more_plans_each_with_its_own_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"plans \[\]: allowed a list of one or more Plans"):
        autotune.tune_many([])
    one = autotune.Plan(spec("grid", "simulated", trials=1), tmp_path / "same")
    # The second found the first's lock and named this very process as "another tuner", the first folder made.
    with pytest.raises(ConfigError, match="plans 0 and 1 both have out=.*same'. allowed one plan per run directory"):
        autotune.tune_many([one, autotune.Plan(one.spec, str(tmp_path / "x" / ".." / "same"))])
    assert not (tmp_path / "same").exists()
    (result,) = autotune.tune_many([one])
    assert result.run_dir == tmp_path / "same" and len(result.results) == 1


@pytest.mark.parametrize("changes, named", [
    ({"address": 5}, "RayOptions address 5: allowed a cluster's address"),
    ({"gpus_per_trial": "2"}, "RayOptions gpus_per_trial '2': allowed a whole number >= 1 or None"),
    ({"concurrency": 0}, "RayOptions concurrency 0: allowed a whole number >= 1 or None"),
    ({"max_failures": -1}, "RayOptions max_failures -1: allowed a whole number >= 0"),
    ({"refuse_unplaceable": 1}, "RayOptions refuse_unplaceable 1: allowed True, False or None"),
])
def test_ray_options_are_checked_when_made(changes, named):
    """They raised TypeError deep in the run (`argument of type 'int' is not iterable`), after the checks."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        autotune.RayOptions(**{"address": "local", **changes})


def test_the_trial_timeout_reaches_each_trials_backend_from_the_cli_and_a_sweep_file(tmp_path, monkeypatch):
    """An option added once (TuneSpec.trial_timeout_s, issue 42): `autotune tune --trial-timeout` and a sweep file's
    `trial_timeout` parse it as one, and the runner builds the trials' backend with it."""
    import autotune.api as api
    from autotune.cli import main
    from autotune.commands.sweep_file import load_sweep

    built = []
    real = api.make_backend
    monkeypatch.setattr(api, "make_backend", lambda settings, run_dir, options: built.append(options) or
                        real(settings, run_dir, options))
    assert main(["tune", "--backend", "simulated", "--trials", "1", "--trial-timeout", "20m",
                 "--out", str(tmp_path / "run")]) == 0
    assert [options.timeout_s for options in built] == [1200.0]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("workloads:\n  - {name: a, model: tiny, trial_timeout: 90s}\n  - {name: b, model: tiny}\n")
    assert [w.tune.trial_timeout_s for w in load_sweep(sweep).workloads] == [90.0, None]
    sweep.write_text("workloads:\n  - {name: a, trial_timeout: soon}\n")
    with pytest.raises(ConfigError, match=r"workloads\[0\]\.trial_timeout: 'soon': .*allowed a duration"):
        load_sweep(sweep)


def test_a_result_names_only_the_recommended_configs_its_sweep_wrote(tmp_path):
    best = autotune.TrialResult(autotune.Config(1, 4, 0, "fp32"), "ok", throughput_samples_per_s=1.0)
    (tmp_path / "best_ds_config.json").write_text("{}")  # script mode: its own config with the tuned keys, no HF one
    result = autotune.api.TuneResult(best, (best,), autotune.StopReason.DONE, tmp_path)
    assert result.best_ds_config == tmp_path / "best_ds_config.json" and result.best_hf_ds_config is None
    assert autotune.api.TuneResult(None, (), autotune.StopReason.DONE, tmp_path).best_ds_config is None


def test_each_trial_records_one_prediction_its_step_time_and_throughput_agree(tmp_path):
    result = autotune.tune(spec("random", "simulated", trials=4), out=tmp_path / "run")
    batch = 16  # spec()'s global batch
    for r in (r for r in result.results if r.status != "pruned"):
        extra = r.extra
        assert extra["predicted_throughput_samples_per_s"] == pytest.approx(batch / extra["predicted_step_time_s"])


def test_refusals_a_python_caller_meets_name_its_arguments_beside_the_flags(tmp_path):
    """They named only the CLI's flags (`--out`, `--resume`, `--target-gpus`, `--policy`) to a notebook's user."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"--out \(`out`\) .*afile/run: cannot create the directory"):
        autotune.tune(spec("grid", "simulated", trials=1), out=tmp_path / "afile" / "run")
    with pytest.raises(ConfigError, match=r"--resume \(resume=True\): .* \(the call with resume=False\)"):
        autotune.tune(spec("grid", "simulated", trials=1), out=tmp_path / "none", resume=True)
    with pytest.raises(ConfigError, match=r"--target-gpus \(`target_gpus`\) 0: allowed"):
        spec("grid", "simulated", target_gpus=0)
    with pytest.raises(ConfigError, match=r"--policy \(`policy`\): only with --strategy \(`strategy`\) rl or hybrid"):
        spec("grid", "simulated", policy=str(tmp_path))
