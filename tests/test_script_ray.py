"""Script mode on Ray (`autotune tune --script ... --ray-address`): what travels with a trial (the script's
folder and the files its arguments name, autotune.script.ship), and real script sweeps on a private local
Ray instance (`--ray-address local`): the trials run the shipped copy, with the local run's verdicts. The sweep
is of issue 18's plain DeepSpeed script, whose global batch of 1 is kept and whose recommendation trains the
unchanged script. (A script that cannot be tuned gets its verdict on Ray, from its shipped copy, and a script
sweep on Ray is resumed, in tests/test_sweeps_script.py's sweep on a local Ray instance.)"""

from __future__ import annotations

import contextlib
import json
import io
import shutil
import tarfile
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.values.config import ConfigError
from autotune.drivers import ray_script
from autotune.drivers.ray_script import LOG_FILES, ShippedScript, land_log_files, read_log_files
from autotune.values.results import TrialResult, read_results
from autotune.script.ship import OUTSIDE, SHIP_LIMIT_BYTES, pack, plan, unpack
from test_script_real import run_unchanged

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


# -- what is shipped (fast) ------------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's folder: the script, a sibling module, its config, data; caches, a venv and an old run."""
    src = tmp_path / "proj"
    for name, text in {"train.py": "import helper\n", "helper.py": "X = 1\n", "ds.json": "{}", "data/tok.txt": "abc",
                       "__pycache__/helper.cpython-311.pyc": "x", ".git/HEAD": "ref", ".venv/lib/big.py": "x",
                       "runs/old/run.json": "{}", "runs/old/logs/0001/rank0.stdout": "x"}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return src


def test_the_scripts_folder_travels_without_caches_or_run_directories(project, tmp_path):
    outside = tmp_path / "configs" / "zero.json"
    outside.parent.mkdir()
    outside.write_text('{"zero_optimization": {"stage": 2}}')
    args = ("--deepspeed_config", "ds.json", "--data=data", f"--extra={outside}", "--steps", "30",
            "--out", str(tmp_path), str(project / "helper.py"))
    shipment = plan("train.py", args, cwd=project)
    assert shipment.root == str(project.resolve())
    shipped = sorted(target for _, target in shipment.files)
    assert shipped == [f"{OUTSIDE}/3/zero.json", "proj/data/tok.txt", "proj/ds.json", "proj/helper.py",
                       "proj/train.py"]
    assert shipment.script == "proj/train.py" and shipment.cwd == "proj"
    assert [(p.index, p.prefix, p.target) for p in shipment.paths] == [
        (1, "", "proj/ds.json"), (2, "--data=", "proj/data"), (3, "--extra=", f"{OUTSIDE}/3/zero.json"),
        (8, "", "proj/helper.py")]
    # A folder outside the script's is not shipped: the node must read it where it is.
    assert shipment.notes == (f"{tmp_path}: not shipped (a folder outside {project.resolve()}): every node must "
                              "read it at that path",)
    # Run from a subfolder of the script's: the node's working directory is that subfolder's copy.
    assert plan(str(project / "train.py"), (), cwd=project / "data").cwd == "proj/data"
    assert plan(str(project / "train.py"), (), cwd=tmp_path).cwd == "proj"


def test_the_packed_files_unpack_with_the_arguments_pointing_into_the_copy(project, tmp_path):
    shipment = plan("train.py", ("--deepspeed_config", "ds.json", "--tag", "ds"), cwd=project)
    bundle = pack(shipment)
    shutil.rmtree(project)  # the node needs nothing of the driver's folder
    landed = unpack(shipment, bundle, tmp_path / "node")
    assert landed.script == str(tmp_path / "node" / "proj" / "train.py")
    assert landed.args == ("--deepspeed_config", str(tmp_path / "node" / "proj" / "ds.json"), "--tag", "ds")
    assert landed.cwd == str(tmp_path / "node" / "proj")
    assert (tmp_path / "node" / "proj" / "helper.py").read_text() == "X = 1\n"
    assert not (tmp_path / "node" / "proj" / ".venv").exists()


def test_a_bundle_cannot_write_outside_its_folder(tmp_path):
    shipment = plan(str(SCRIPTS / "plain_ds_train.py"), ())
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        unpack(shipment, evil.getvalue(), tmp_path / "node")
    assert not (tmp_path / "escaped.txt").exists()


def test_a_folder_too_large_to_ship_is_refused_in_one_line(project):
    (project / "data" / "big.bin").write_bytes(b"\0" * 3000)
    with pytest.raises(ConfigError) as err:
        plan("train.py", (), cwd=project, limit=2048)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"--script train.py with --ray-address: its directory {project.resolve()} holds more than "
                           "a Ray trial ships (2 KiB = 2,048 bytes, or 10,000 files): ")
    assert "the largest data/big.bin (2.93 KiB)" in text and "keep the script, its modules and configs" in text


def test_tune_refuses_a_script_folder_over_the_limit_before_any_trial(project, tmp_path, capsys):
    with open(project / "data" / "big.bin", "wb") as big:
        big.truncate(SHIP_LIMIT_BYTES + 1)  # sparse: no disk used
    out = tmp_path / "run"
    code = main(["tune", "--script", str(project / "train.py"), "--ray-address", "local", "--trials", "2",
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("autotune tune: error: --script ") and "more than a Ray trial ships (64 MiB = 67,108,864 bytes" in err[0]
    assert not out.exists()


def test_a_shipped_backend_runs_the_copy_and_removes_it(tmp_path):
    from autotune.backends.script import ScriptBackend
    from autotune.search.rundir import RunSettings
    from autotune.outputs.script import placeholder
    from autotune.values.hardware import load_hardware
    from autotune.values.space import Choices

    settings = RunSettings(placeholder(1, 1), load_hardware("cpu"), 2**30, "optuna", "script", 0, Choices())
    shipment = plan(str(SCRIPTS / "plain_ds_train.py"), ("--deepspeed_config", str(SCRIPTS / "plain_ds_config.json")))
    backend = ShippedScript(settings, str(tmp_path / "run"), shipment, pack(shipment))()
    inner = backend.inner
    assert isinstance(inner, ScriptBackend) and backend.name == "script"
    copy = Path(inner.script.path)
    assert copy.parent != SCRIPTS and copy.read_text() == (SCRIPTS / "plain_ds_train.py").read_text()
    assert inner.script.args == ("--deepspeed_config", str(copy.parent / "plain_ds_config.json"))
    assert inner.cwd == str(copy.parent) and inner.logs_dir == tmp_path / "run" / "logs"
    backend.close()
    assert not copy.exists()


def test_log_files_come_back_to_the_driver_where_they_are_missing(tmp_path):
    node = tmp_path / "node" / "0002-z1"
    node.mkdir(parents=True)
    (node / "user_ds_config.json").write_text('{"optimizer": {}}')
    (node / "rank0.stdout").write_bytes(b"x" * (ray_script.LOG_FILE_MAX + 1))  # a long log stays there
    files = read_log_files(node)
    assert files == {"user_ds_config.json": '{"optimizer": {}}'}
    here = tmp_path / "driver" / "0002-z1"
    from autotune.values.config import Config

    result = TrialResult(Config(1, 1, 0, "bf16"), "crash", extra={"log_dir": str(here), LOG_FILES: files, "trial": 2})
    landed = land_log_files(result)
    assert landed.extra == {"log_dir": str(here), "trial": 2}
    assert json.loads((here / "user_ds_config.json").read_text()) == {"optimizer": {}}
    (here / "user_ds_config.json").write_text("{}")  # present here (the same machine): left as it is
    land_log_files(result)
    assert (here / "user_ds_config.json").read_text() == "{}"


# -- real script sweeps on a local Ray instance (slow) ---------------------------------------------------

SPACE = """\
zero_stage: [0, 1, 2]
micro_batch: [1, 2]
ckpt_interval: [0]
precision: [fp32]
offload_optimizer: [none]
offload_param: [none]
"""
SCRIPT_ARGS = "--deepspeed --deepspeed_config plain_ds_config.json --steps 30"  # relative to the script's folder


def tune(out: Path, space: Path, script: Path, trials: int, more: tuple[str, ...] = ()) -> int:
    return main(["tune", "--script", str(script), "--script-args", SCRIPT_ARGS, "--space", str(space),
                 "--strategy", "optuna", "--trials", str(trials), "--memory-budget", "6GiB", "--out", str(out),
                 "--ray-address", "local", *more])


@pytest.fixture(scope="module")
def ray_sweep(tmp_path_factory):
    """Issue 18's plain script, copied to a folder of its own and tuned from there (its config named relative
    to it) with 3 trials on a local Ray instance; the folder is renamed away once the sweep's trials have
    their copy, so they can only run the shipped one (--backend deepspeed named, as a user may: a script's
    trials are DeepSpeed's). Returns the exit code, the folder, the run directory and what the sweep
    printed."""
    base = tmp_path_factory.mktemp("script_ray")
    src = base / "src"
    src.mkdir()
    for name in ("plain_ds_train.py", "plain_ds_config.json"):
        shutil.copy(SCRIPTS / name, src / name)
    space = base / "space.yaml"
    space.write_text(SPACE)
    original = ray_script.script_job

    def then_hidden(*args, **kwargs):
        job = original(*args, **kwargs)
        src.rename(base / "hidden")
        return job

    mp = pytest.MonkeyPatch()
    mp.setattr(ray_script, "script_job", then_hidden)
    mp.chdir(src)
    out = base / "run"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = tune(out, space, src / "plain_ds_train.py", 3, more=("--backend", "deepspeed"))
    finally:
        mp.undo()
        if (base / "hidden").exists():
            (base / "hidden").rename(src)
    return code, src, out, printed.getvalue()


@pytest.mark.slow
def test_a_script_sweep_on_ray_runs_the_shipped_copy_with_the_local_verdicts(ray_sweep, tmp_path):
    """Issue 18: micro-batch 1, no accumulation, 30 engine.step() calls. The tuner used to impose a global
    batch of 16 (one optimizer step in 30 micro-steps: too_few_steps) and to recommend 16."""
    code, src, out, printed = ray_sweep
    assert code == 0, printed
    assert "global batch 1 (micro-batch 1 x gradient accumulation 1 x 1 rank, from the DeepSpeed config): the " \
           "script's own, kept" in printed
    assert "Ray cluster local: " in printed and "travel with each trial" in printed  # the display's lines
    results = read_results(out / "trials.jsonl")
    # Every trial ok, the script's global batch of 1 kept, still tuned: every stage at micro-batch 1.
    assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]
    assert len({r.config for r in results}) == 3 and {r.config.zero_stage for r in results} == {0, 1, 2}
    assert results[0].extra["script_model"]["attention"] == "sdpa"  # MHA with need_weights=False: torch's SDPA
    # The later trials, in flight together: each log folder carries the number its result is recorded under.
    assert [Path(r.extra["log_dir"]).name[:5] for r in results] == ["0001-", "0002-", "0003-"]
    for r in results:
        assert r.backend == "script" and r.config.micro_batch == 1 and r.extra["global_batch"] == 1
        assert "script_verdict" not in r.extra and LOG_FILES not in r.extra
        assert r.extra["script"] == str(src / "plain_ds_train.py") and r.extra["node_ip"] == "127.0.0.1"
        # The rank ran the copy: its spec names the copy and the config's copy, in the copy's folder.
        spec = json.loads((Path(r.extra["log_dir"]) / "spec.json").read_text())["extra"]
        copy = Path(spec["script"])
        assert copy == Path(r.extra["script_copy"]) and copy.parent != src and not copy.exists()  # removed after
        assert spec["script_args"] == ["--deepspeed", "--deepspeed_config", str(copy.parent / "plain_ds_config.json"),
                                       "--steps", "30"]
        assert spec["script_cwd"] == str(copy.parent)
        used = json.loads((Path(r.extra["log_dir"]) / "ds_config.json").read_text())
        assert (used["train_batch_size"], used["gradient_accumulation_steps"]) == (1, 1)
    settings = json.loads((out / "run.json").read_text())
    assert settings["workload"]["global_batch"] == 1 and settings["space"]["micro_batch"] == [1]
    best = json.loads((out / "best_ds_config.json").read_text())
    assert (best["train_batch_size"], best["train_micro_batch_size_per_gpu"], best["gradient_accumulation_steps"]) \
        == (1, 1, 1)
    assert best["optimizer"] == json.loads((src / "plain_ds_config.json").read_text())["optimizer"]
    assert "the script's own, kept" in (out / "report.md").read_text()
    ran = run_unchanged(src / "plain_ds_train.py", ["--deepspeed", "--deepspeed_config", str(out / "best_ds_config.json"),
                                                     "--steps", "3"], tmp_path)
    assert ran.returncode == 0 and "training done: 3 steps, global batch 1" in ran.stdout, ran.stderr[-3000:]
