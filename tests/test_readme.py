"""Every command of the README runs (issue 43): each line of its ```bash blocks, in order, in a scratch folder that
holds links to the repository's benchmarks/ and examples/, run here as written or, where it needs a GPU or minutes,
with the substitution named below. A line none of these rules covers fails the test: a command added to the README
comes with its test.

As written: `autotune estimate`, `autotune tune` on the simulated backend, `autotune report`, `autotune surface show`.
With a substitution:
- `--hardware auto` (estimate, tune): `--hardware h100-80gb --gpus 8`, the 8-GPU H100 node auto would find, and for
  tune also `--backend simulated --trials 2`: the estimator as the trials, so the command's parsing, checks, search
  and outputs run, its trials do not;
- `~` is the shell's: the scratch folder is HOME, holding Llama-3-8B's published config.json under models/;
- `autotune tune --script train.py ... -- ARGS`: parsed and planned as the command does (`script_spec_from`: the
  script, its arguments, the autotuning block of its ds_config.json, the hardware check), no trial run; train.py is
  examples/train_hf.py (its `--deepspeed` takes the config file, as on the README's line) and ds_config.json the
  README's example config;
- `bash RUN/launch.sh torchrun train.py ...`: run with a `torchrun` stub first on PATH that prints its arguments;
- `autotune trial`: planned as the command plans it (the target, the config's checks, the estimator's prediction),
  no DeepSpeed run (tests/test_trial_cli.py runs real trials);
- `autotune sweep FILE`: the file loaded and each workload's run planned, no Ray started (tests/test_sweeps*.py run
  sweeps);
- `autotune rl train`: parsed (RLlib training takes minutes: tests/test_rl_training.py trains);
- `pip install` and `scripts/...`: what they name exists: the checkout's pyproject.toml and the extras it declares,
  the scripts, executable.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
HOME_CONFIG = "models/Meta-Llama-3-8B/config.json"  # what `~/models/Meta-Llama-3-8B/config.json` names, under HOME


def readme() -> str:
    return README.read_text()


def bash_blocks(text: str) -> list[list[list[str]]]:
    """The README's ```bash blocks, each a list of its command lines as the shell splits them (continuations joined,
    comments dropped)."""
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        lines = [shlex.split(line, comments=True) for line in body.replace("\\\n", " ").splitlines()]
        blocks.append([line for line in lines if line])
    return blocks


def json_example(text: str) -> dict:
    """The README's example ds_config.json: its one ```json block."""
    (block,) = re.findall(r"^```json\n(.*?)^```", text, re.S | re.M)
    return json.loads(block)


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


# -- the rules, one per kind of line

def check_pip(line: list[str]) -> None:
    assert line[:2] == ["pip", "install"], line
    for target in (t for t in line[2:] if not t.startswith("-")):
        match = re.fullmatch(r"\.(?:\[([a-z,-]+)\])?", target)
        assert match, f"{shlex.join(line)}: only the checkout (., .[extras]) is installed this way"
        assert (ROOT / "pyproject.toml").is_file()
        named = match.group(1).split(",") if match.group(1) else []
        assert set(named) <= set(extras()), f"{target}: extras not declared in pyproject.toml"


def check_script(line: list[str]) -> None:
    path = ROOT / line[0]
    assert path.is_file() and path.stat().st_mode & stat.S_IXUSR, f"{line[0]}: not an executable script"


def substituted(line: list[str]) -> list[str]:
    """The line's autotune arguments with the GPU substitutions of the docstring."""
    argv = [os.path.expanduser(arg) if arg.startswith("~/") else arg for arg in line[1:]]
    command = argv[0]
    if command in ("estimate", "tune") and "--script" not in argv and "--hardware" in argv:
        at = argv.index("--hardware")
        if argv[at + 1] == "auto":
            argv[at + 1] = "h100-80gb"
            if "--gpus" not in argv:
                argv += ["--gpus", "8"]
            if command == "tune":
                assert "--backend" not in argv, "a real-trial line names no backend: the default, deepspeed"
                argv += ["--backend", "simulated"]
                if "--trials" in argv:
                    argv[argv.index("--trials") + 1] = "2"
                else:
                    argv += ["--trials", "2"]
    return argv


def run_cli(argv: list[str], capsys) -> None:
    from autotune.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"autotune {shlex.join(argv)}: exit {code}\n{err[-2000:]}"


def plan_script_tune(argv: list[str], scratch: Path, text: str) -> None:
    from autotune.cli import parse
    from autotune.commands.tune import script_spec_from

    args = parse(argv)
    script = Path(args.script)
    assert script.name == "train.py" and (scratch / script).is_file()
    spec = script_spec_from(args)
    assert spec.backend == "deepspeed" and spec.script_args == tuple(argv[argv.index("--") + 1:])
    block = json_example(text)["autotuning"]
    assert spec.strategy == "optuna" and spec.trials == block["tuner_num_trials"]  # the README's block, read
    assert any("autotuning block read" in note for note in args._notes)


def plan_trial(argv: list[str]) -> None:
    import autotune
    from autotune.cli import parse
    from autotune.commands.common import target_from
    from autotune.commands.trial import check_config
    from autotune.values.config import Config

    args = parse(argv)
    target = target_from(args, real=True)
    config = Config(args.zero_stage, args.micro_batch, args.ckpt_interval, args.precision, args.offload_optimizer,
                    args.offload_param)
    check_config(config, target.workload, target.hardware, args.nvme_path)
    assert autotune.predict(config, target.workload, target.hardware).peak_bytes > 0


def plan_sweep(argv: list[str], scratch: Path) -> None:
    from autotune.cli import parse
    from autotune.commands.sweep_file import load_sweep

    args = parse(argv)
    sweep = load_sweep(args.sweep_file)
    plans = [spec.plan(args.out or scratch / "runs" / "sweep", None) for spec in sweep.workloads]
    assert plans and all(plan.spec.trials > 0 for plan in plans)


def parse_rl(argv: list[str]) -> None:
    from autotune.cli import parse

    args = parse(argv)
    assert args.command == "rl" and args._rl.__name__ in ("run_train", "run_export")


def run_launch(line: list[str], scratch: Path) -> None:
    launch = scratch / line[1]
    assert launch.is_file(), f"{line[1]}: no such file (the README's tune line above writes it)"
    stubs = scratch / "stubs"
    stubs.mkdir(exist_ok=True)
    stub = stubs / "torchrun"
    stub.write_text('#!/bin/sh\necho "$@"\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(line, cwd=scratch, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    launched = done.stdout.split()
    assert launched[launched.index("train.py"):] == line[line.index("train.py"):]  # the script and its arguments
    assert "--nproc_per_node" in launched  # the trials' process count
    config = next((arg for arg in line if arg.endswith("best_ds_config.json")), None)
    assert config is None or (scratch / config).is_file()


def run_line(line: list[str], scratch: Path, text: str, capsys) -> None:
    """One README line by its rule (the module's docstring)."""
    if line[0] == "pip":
        return check_pip(line)
    if line[0].startswith("scripts/"):
        return check_script(line)
    if line[0] == "bash" and line[1].endswith("launch.sh"):
        return run_launch(line, scratch)
    assert line[0] == "autotune", f"README command with no rule in tests/test_readme.py: {shlex.join(line)}"
    argv = substituted(line)
    command = argv[0]
    if command == "tune" and "--script" in argv:
        return plan_script_tune(argv, scratch, text)
    if command == "tune":
        assert "--backend" in argv and argv[argv.index("--backend") + 1] == "simulated", shlex.join(line)
        return run_cli(argv, capsys)
    if command in ("estimate", "report") or argv[:2] == ["surface", "show"]:
        return run_cli(argv, capsys)
    if command == "trial":
        return plan_trial(argv)
    if command == "sweep":
        return plan_sweep(argv, scratch)
    if command == "rl":
        return parse_rl(argv)
    pytest.fail(f"README command with no rule in tests/test_readme.py: {shlex.join(line)}")


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A folder to run the README's lines in: links to benchmarks/ and examples/, HOME with Llama-3-8B's config.json,
    the user's train.py (examples/train_hf.py) and the README's ds_config.json."""
    from test_models import LLAMA_3_8B

    for name in ("benchmarks", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    config = tmp_path / HOME_CONFIG
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(LLAMA_3_8B))
    shutil.copy(ROOT / "examples" / "train_hf.py", tmp_path / "train.py")
    (tmp_path / "ds_config.json").write_text(json.dumps(json_example(readme()), indent=2))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


BLOCKS = bash_blocks(readme())


@pytest.mark.parametrize("block", BLOCKS, ids=[" / ".join(shlex.join(line[:2]) for line in b) for b in BLOCKS])
def test_every_command_of_the_readme_runs(block, scratch, capsys):
    text = readme()
    for line in block:
        run_line(line, scratch, text, capsys)


def test_the_readme_has_the_install_line_and_the_gpu_quick_start():
    lines = [shlex.join(line) for block in BLOCKS for line in block]
    assert "pip install ." in lines
    assert any(line.startswith("autotune tune --model") and "--hardware auto" in line for line in lines)
    assert any(line.startswith("autotune tune --script train.py") and " -- " in line for line in lines)
    assert {line.split()[1] for line in lines if line.startswith("autotune ")} >= {
        "estimate", "tune", "report", "trial", "surface", "sweep", "rl"}


def test_the_readme_stays_short():
    assert len(readme().split()) < 2500  # issue 43: a short README, the rest in docs/


def test_the_readmes_extras_are_pyprojects():
    named = set(re.findall(r"^\| `([a-z-]+)` \|", readme(), re.M))  # the first column of the extras' table
    assert named == set(extras())


def test_the_readmes_example_ds_config_maps_as_described():
    from autotune.values.ds_autotuning import read_autotuning
    from autotune.values.space import Choices

    block = read_autotuning(json_example(readme()), "ds_config.json")
    assert block is not None and dict(block.options) == {"strategy": "optuna", "trials": 20}
    assert block.micro_batch == (1, 16) and block.micro_batches == 4 and block.zero_stages == (1, 2, 3)
    assert block.notes == ()  # every key of the example maps
    narrowed = block.narrowed(Choices(zero_stage=(0, 1, 2, 3), micro_batch=(1, 2, 4, 8, 16, 32, 64)))
    assert narrowed.zero_stage == (1, 2, 3) and narrowed.micro_batch == (1, 2, 8, 16)


def markdown_links() -> list[tuple[Path, str]]:
    files = [README, *sorted((ROOT / "docs").glob("*.md"))]
    return [(path, link) for path in files for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text())
            if not re.match(r"[a-z]+:", link)]


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    heads = re.findall(r"^#+ (.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", head.lower()).replace(" ", "-") for head in heads}


@pytest.mark.parametrize("path, link", markdown_links(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_the_links_of_the_readme_and_docs_resolve(path, link):
    target, _, anchor = link.partition("#")
    file = (path.parent / target).resolve() if target else path
    assert file.exists(), f"{path.relative_to(ROOT)}: {link}: no such file"
    if anchor and file.suffix == ".md":
        assert anchor in anchors(file), f"{path.relative_to(ROOT)}: {link}: no such heading"

