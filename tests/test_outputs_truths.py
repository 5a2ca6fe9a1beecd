"""Issue 43: what the outputs people read say, and the messages under faults. report.md and summary.json say why the
sweep stopped (an interrupted one first, with how to continue it) and the chance of a better config; a simulated
run's figures are called predicted, and its launch.sh is a template for the target; every strategy's Optuna study
loads and names its strategy, and follows trials.jsonl when a line was removed by hand; a live run directory is
named by its holder's pid (`autotune report` refuses it); a read-only study.db is one line; trial log folders are
numbered by trial; the dashboard and MLflow UI extras are declared."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import optuna
import pytest

import autotune
from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.outputs import plots
from autotune.outputs.launch import LAUNCH_FILE, template_reason
from autotune.outputs.report import NOT_RECORDED, write_outputs
from autotune.search.rundir import STUDY, RunDir, read_only_named
from autotune.strategies import STRATEGIES
from autotune.values.config import Config, ConfigError
from autotune.values.results import read_results
from autotune.values.workload import make_workload
from cli_run import cli

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def tune(out: Path, strategy: str = "optuna", trials: int = 4, *, hardware: str = "cpu", model: str = "tiny",
         resume: bool = False) -> autotune.TuneResult:
    budget = int(0.85 * GiB) if hardware == "cpu" else None
    spec = autotune.TuneSpec(autotune.make_workload(model), autotune.load_hardware(hardware),
                             memory_budget_bytes=budget, strategy=strategy, trials=trials, backend="simulated", seed=4)
    return autotune.tune(spec, out=out, resume=resume)


def study_of(run: Path) -> optuna.Study:
    return optuna.load_study(study_name="autotune", storage=f"sqlite:///{run / STUDY}")


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> Path:
    """A finished simulated sweep (its outputs rewritten below as the runner writes them, with its stop reason)."""
    run = tmp_path_factory.mktemp("truths") / "run"
    tune(run, "optuna", 6)
    return run


def rewrite(run: Path, stop_reason: str | None, results=None):
    """The outputs as the runner writes them at the end of a session (api.close_sweep passes its StopReason)."""
    rd = RunDir(run)
    return write_outputs(rd, rd.read_settings(), results, stop_reason=stop_reason)


# ---- report and summary truths


def test_report_and_summary_say_why_the_sweep_stopped_and_the_chance_of_a_better_config(simulated, capsys):
    rewrite(simulated, "trials")
    report = (simulated / "report.md").read_text()
    summary = json.loads((simulated / "summary.json").read_text())
    assert "- Stopped: trial budget spent" in report
    assert summary["stop_reason"] == "trials" and summary["stopped"] == "trial budget spent"
    chance = summary["convergence"]["chance_of_better"]
    assert 0 <= chance <= 1 and "- Chance of a better config" in report
    # `autotune report` of the same trials keeps the recorded reason (stop.json), from the run directory alone...
    copy = simulated.parent / "copy"
    shutil.copytree(simulated, copy, ignore=shutil.ignore_patterns("summary.json", "report.md", "plots", "best_*"))
    code, out, err = cli(["report", str(copy)], capsys)
    assert code == 0, err
    assert json.loads((copy / "summary.json").read_text()) == json.loads((simulated / "summary.json").read_text())
    assert (copy / "report.md").read_text() == report
    # ...and says it is not known once the record holds trials the recorded outputs did not describe.
    rd = RunDir(simulated)
    results = rd.results()
    summary = rewrite(simulated, None, results[:-1]).summary
    assert summary["stop_reason"] is None and summary["stopped"] == NOT_RECORDED
    rewrite(simulated, "trials")


def test_the_report_names_a_study_only_where_there_is_one(simulated, capsys):
    # `autotune report` of a run whose study.db was removed: no "in `study.db` here".
    copy = simulated.parent / "no-study"
    shutil.copytree(simulated, copy, ignore=shutil.ignore_patterns(STUDY, "summary.json", "report.md", "plots"))
    code, _, err = cli(["report", str(copy)], capsys)
    assert code == 0, err
    assert not (copy / STUDY).exists() and "Optuna study" not in (copy / "report.md").read_text()
    assert "- Optuna study: `autotune` in `study.db` here" in (simulated / "report.md").read_text()


def test_a_converged_sweep_names_its_figure_and_a_bad_reason_is_one_line(simulated):
    summary = rewrite(simulated, "converged").summary
    assert summary["stopped"].startswith("search converged: ") and "chance an untried config is" in summary["stopped"]
    with pytest.raises(ConfigError, match=r"^stop reason 'tired': allowed trials, time, "):
        rewrite(simulated, "tired")
    rewrite(simulated, "trials")


def test_an_interrupted_sweep_says_so_first_with_how_to_continue_it(simulated):
    rd = RunDir(simulated)
    first = rd.results()[:1]
    outputs = rewrite(simulated, "interrupted", first)
    hint = f"continue it with the same command and --resume --out {rd.path} (resume=True from Python)"
    assert outputs.verdict.startswith("interrupted after 1 finished trial, unfinished: " + hint)
    assert "; best so far z" in outputs.verdict and "recommended" not in outputs.verdict
    lines = (simulated / "report.md").read_text().splitlines()
    assert lines[2].startswith("**Interrupted after 1 finished trial, unfinished: " + hint)  # right after the title
    assert "- Stopped: interrupted" in lines
    assert not any(line.startswith("**Recommended") for line in lines)  # no bold recommendation of 1 trial
    summary = json.loads((simulated / "summary.json").read_text())
    assert list(summary)[:3] == ["resume", "stop_reason", "stopped"]  # the hint first
    assert summary["resume"] == hint and summary["stop_reason"] == "interrupted"
    rewrite(simulated, "trials")


def test_a_simulated_runs_figures_are_called_predicted(simulated, monkeypatch):
    legends: dict[str, list[str]] = {}
    titles: dict[str, str] = {}
    save = plots._save

    def keep(fig, path):  # the plots' legends and titles, as drawn
        legends[path.name] = [t.get_text() for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
                              if legend is not None for t in legend.get_texts()]
        titles[path.name] = " ".join(ax.get_title() for ax in fig.axes)
        save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    rewrite(simulated, "trials")
    report = (simulated / "report.md").read_text()
    assert "- Figures predicted: the simulated backend predicts every figure" in report
    assert "; predicted trial time " in report and "; trial time" not in report
    breakdown = legends["memory_breakdown.png"]
    assert any(t.startswith("predicted peak ") for t in breakdown)
    assert not any("measured" in t for t in breakdown + legends["throughput_vs_memory.png"])
    # Its calibration was fitted to the estimator's own figures: the title said "calibrated on 20 trials".
    assert "predicted: no trial ran" in titles["memory_breakdown.png"]
    assert "calibrated" not in titles["memory_breakdown.png"]


def test_launch_sh_is_a_template_where_no_trial_ran_in_this_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("autotune.trials.devices.nvidia_driver_present", lambda: False)  # as on this CPU machine
    run = tmp_path / "a100"
    tune(run, "random", 2, hardware="a100-80gb", model="gpt2-small")
    text = (run / LAUNCH_FILE).read_text()
    assert "# ds-autotune: TEMPLATE for " in text.splitlines()[1]
    assert "# No trial of this sweep ran (simulated backend) and this machine has no a100-80gb's accelerator: " in text
    exports = [line for line in text.splitlines() if line.startswith("export ")]
    assert exports == ["export DS_ACCELERATOR=cuda"]  # the profile's; nothing of this CPU machine
    assert sys.prefix not in text and "OMP_NUM_THREADS=" not in text and "TORCH_EXTENSIONS_DIR=" not in text
    report = (run / "report.md").read_text()
    assert "a template for the target: no trial of this sweep ran (simulated backend)" in report
    a100, cpu = autotune.load_hardware("a100-80gb"), autotune.load_hardware("cpu")
    assert template_reason("deepspeed", a100) == "" and template_reason("script", a100) == ""  # where trials ran
    assert template_reason("simulated", cpu) == ""  # this machine gives a CPU profile's trials this environment


# ---- every strategy's study


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategys_study_loads_names_its_strategy_and_holds_the_record(strategy, tmp_path):
    run = tmp_path / strategy
    tune(run, strategy, 3)
    study = study_of(run)
    assert study.user_attrs["strategy"] == strategy
    record = read_results(run / "trials.jsonl")
    numbered = sorted((t.user_attrs["report_trial"], t.user_attrs["config"]) for t in study.get_trials()
                      if "report_trial" in t.user_attrs)
    assert numbered == [(r.extra["trial"], r.config.label()) for r in record]
    assert "(`pip install 'ds-autotune[dashboard]'`)" in (run / "report.md").read_text()


@pytest.mark.parametrize("strategy", ["optuna", "random"])
def test_the_study_follows_trials_jsonl_after_a_line_is_removed_by_hand(strategy, tmp_path):
    run = tmp_path / "run"
    tune(run, strategy, 5)
    lines = (run / "trials.jsonl").read_text().splitlines(keepends=True)
    removed = Config.from_dict(json.loads(lines[2])["config"])
    (run / "trials.jsonl").write_text("".join(lines[:2] + lines[3:]))
    tune(run, strategy, 7, resume=True)
    record = read_results(run / "trials.jsonl")
    pairs = {(r.extra["trial"], r.config.label()) for r in record}
    study = study_of(run)
    claimed = [(t.user_attrs["report_trial"], t.user_attrs["config"]) for t in study.get_trials()
               if "report_trial" in t.user_attrs]
    assert set(claimed) == pairs and len(claimed) == len(record)  # the study follows the record, no trial twice
    assert (3, removed.label()) not in claimed
    assert "followed trials.jsonl: it held report_trial 3 (" + removed.label() in study.user_attrs["followed_record"]
    kept = [s for s in optuna.get_all_study_names(f"sqlite:///{run / STUDY}") if s != "autotune"]
    assert len(kept) == 1 and kept[0].startswith("autotune (before following trials.jsonl, ")
    assert any(t.user_attrs.get("report_trial") == 3 for t in optuna.load_study(
        study_name=kept[0], storage=f"sqlite:///{run / STUDY}").get_trials())  # nothing the study held is lost


def test_the_extras_are_declared_and_named_where_people_read_them():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["dashboard"] == ["optuna-dashboard>=0.21"]
    assert extras["tracking-ui"] == ["mlflow>=3.0"]  # the full mlflow: `mlflow ui` runs
    assert extras["tracking"] == ["mlflow-skinny>=3.0"]  # logging only (CI)
    readme = " ".join((ROOT / "docs" / "tune.md").read_text().split())  # tune's MLflow and study docs (issue 43)
    assert "`mlflow ui --backend-store-uri sqlite:///<out>/mlflow.db` shows it, with `pip install -e '.[tracking-ui]'`" \
        in readme
    assert "optuna-dashboard: `pip install -e '.[dashboard]'`" in readme


# ---- faults


def test_busy_names_the_holder_and_creates_nothing(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.busy() is None and not run.path.exists()
    with run.locked():
        assert run.busy() == str(os.getpid())
    assert run.busy() is None


def test_autotune_report_refuses_a_live_run_directory_in_one_line(simulated, capsys):
    before = (simulated / "report.md").read_bytes()
    with RunDir(simulated).locked():
        code, out, err = cli(["report", str(simulated)], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.strip().endswith(f"error: {simulated} is in use by pid {os.getpid()}: its report is written when the "
                                "sweep ends (run autotune report then)")
    assert (simulated / "report.md").read_bytes() == before


def test_sqlites_readonly_error_is_named_in_one_line(tmp_path):
    db = tmp_path / STUDY
    sqlite3.connect(db).execute("create table t (x)").connection.close()
    ro = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as caught:
        ro.execute("insert into t values (1)")
    try:  # as Optuna wraps it
        raise RuntimeError("An exception is raised during the commit. e.g. exceeding max length") from caught.value
    except RuntimeError as wrapped:
        named = read_only_named(wrapped, str(db))
    assert named is not None and str(named).startswith(f"{db}: read-only (attempt to write a readonly database)")
    assert read_only_named(RuntimeError("disk I/O error"), str(db)) is None


def as_nobody(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a Python run as a user who cannot write root's files (root writes through any mode bits)."""
    command = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        # util-linux's setpriv (on every machine of ours): it runs the interpreter under /root as nobody, which
        # subprocess's own user= cannot (exec is refused there).
        assert shutil.which("setpriv") is not None, "running as root needs setpriv (util-linux) to be another user"
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    env = {**os.environ, "HOME": str(cwd), "MPLCONFIGDIR": str(cwd / "mpl"), "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_read_only_study_db_is_one_line_before_anything_writes(tmp_path):
    folder = Path(tempfile.mkdtemp(prefix="ro-study-"))  # every user may enter and write it
    try:
        folder.chmod(0o777)
        optuna.create_study(study_name="autotune", storage=f"sqlite:///{folder / STUDY}")
        (folder / STUDY).chmod(0o444)
        done = as_nobody("from autotune.search.rundir import RunDir\nfrom autotune.values.config import ConfigError\n"
                         f"try:\n    RunDir({str(folder)!r}).storage()\nexcept ConfigError as err:\n    print(err)",
                         folder)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == (
            f"{folder / STUDY}: read-only (attempt to write a readonly database): the sweep writes its Optuna study "
            f"there; make it writable (chmod u+w {folder / STUDY}) or move {STUDY} aside to resume without it")
    finally:
        shutil.rmtree(folder)


def test_trial_log_folders_are_numbered_by_trial(tmp_path):
    run = tmp_path / "run"
    backend = DeepSpeedBackend(make_workload("tiny"), logs_dir=run / "logs")
    config = Config(2, 4, 0, "fp32")
    assert backend._new_log_dir(config).name == "0001-" + "z2_mb4_ck0_fp32"  # no record yet
    (run / "trials.jsonl").write_text('{"trial": 1}\n{"trial": 2}\n')
    assert backend._new_log_dir(config).name == "0003-z2_mb4_ck0_fp32"  # the trial recorded third
    # Trial 3 was interrupted, then resumed: its second attempt keeps the number.
    assert backend._new_log_dir(config).name == "0003-z2_mb4_ck0_fp32-attempt2"
    other = Config(0, 8, 0, "fp32")
    (run / "trials.jsonl").write_text('{"trial": 1}\n{"trial": 2}\n{"trial": 3}\n')
    assert backend._new_log_dir(other).name == "0004-z0_mb8_ck0_fp32"
