"""Issue 14, files: every file the tool reads is validated (one-line ConfigError naming file[:line] and what is
allowed), nothing recorded is lost (a trials.jsonl last line that only lacks its newline), and every output is
written atomically through a unique temporary name, never through a planted symlink (autotune.files)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from autotune.backends.replay import load_surface
from autotune.cli import main
from autotune.values.config import ConfigError
from autotune.files import append_line, atomic_output, load_yaml, write_atomic
from autotune.values.hardware import PROFILES, load_hardware
from autotune.values.results import TrialResult, append_result, read_results
from autotune.search.rundir import RunDir
from autotune.search_spaces import load_choices
from autotune.commands.sweep_file import load_sweep
from cli_run import cli

ROOT = Path(__file__).resolve().parent.parent
TUNE = ["tune", "--backend", "simulated", "--strategy", "random", "--seed", "1"]
GOOD = {"config": {"zero_stage": 1, "micro_batch": 2, "ckpt_interval": 0, "precision": "bf16",
                   "offload_optimizer": "none", "offload_param": "none"},
        "status": "ok", "throughput_samples_per_s": 2.0, "peak_memory_bytes": 10**9, "wall_time_s": 1.0,
        "backend": "simulated", "workload": {"model": "tiny", "global_batch": 16, "gpus": 1}, "hardware": "cpu"}


def one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


@pytest.fixture(scope="module")
def run3(tmp_path_factory) -> Path:
    """A finished 3-trial simulated sweep; tests copy it."""
    out = tmp_path_factory.mktemp("runs") / "r"
    assert main([*TUNE, "--trials", "3", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(run3, tmp_path) -> Path:
    copy = tmp_path / "r"
    shutil.copytree(run3, copy)
    return copy


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- every loader: unreadable bytes, invalid YAML/JSON

LOADERS = {
    "space": (lambda p: load_choices(p), ".yaml"),
    "hardware": (lambda p: load_hardware(str(p)), ".yaml"),
    "sweep": (lambda p: load_sweep(p), ".yaml"),
    "surface": (lambda p: load_surface(p), ".jsonl"),
    "trials": (lambda p: read_results(p), ".jsonl"),
    "run.json": (lambda p: RunDir(p.parent).read_settings(), ".json"),
}


def loader_file(tmp_path: Path, kind: str, data: bytes) -> Path:
    path = tmp_path / ("run.json" if kind == "run.json" else f"f{LOADERS[kind][1]}")
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_non_utf8_bytes_are_one_line_naming_the_file(kind, tmp_path):
    path = loader_file(tmp_path, kind, b"\xff\xfezero_stage: [0]\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:1: not UTF-8 text") as err:
        LOADERS[kind][0](path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["space", "hardware", "sweep"])
def test_invalid_yaml_is_file_and_line(kind, tmp_path):
    path = loader_file(tmp_path, kind, b"base: l4\nname: [unclosed\nother: 1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:\d+: not valid YAML") as err:
        LOADERS[kind][0](path)
    assert "\n" not in str(err.value)


def test_yaml_constructor_errors_are_config_errors(tmp_path):
    path = tmp_path / "h.yaml"
    path.write_text("base: l4\nname: 2024-13-45\n")  # PyYAML's date constructor raises a plain ValueError
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(path)


@pytest.mark.parametrize("kind", ["surface", "trials", "run.json"])
def test_a_directory_where_a_file_belongs_is_one_line(kind, tmp_path):
    path = tmp_path / ("run.json" if kind == "run.json" else "f.jsonl")
    path.mkdir()
    if kind == "surface":  # the replay loader refuses anything that is not a file, a directory by name
        with pytest.raises(ConfigError, match="is a directory"):
            load_surface(path)
        return
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: is a directory"):
        LOADERS[kind][0](path)


# -- hardware YAML

def readme_hardware_example() -> str:
    text = (ROOT / "docs" / "estimate.md").read_text()  # the README's "Your own hardware" moved there (issue 43)
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "mem_bandwidth" in b)
    return block


def test_the_readme_hardware_example_loads(tmp_path):
    path = tmp_path / "rtx.yaml"
    path.write_text(readme_hardware_example())
    profile = load_hardware(str(path))
    assert profile.name == "rtx-a6000" and profile.memory_bytes == 48 * 2**30
    assert profile.mem_bandwidth == 768e9  # PyYAML reads 768e9 as a string: taken as the number it is
    assert profile.peak_flops == PROFILES["a100-80gb"].peak_flops


@pytest.mark.parametrize("line, words", [
    ("max_efficiency: 0", ["max_efficiency: 0", "(0, 1]"]),
    ("max_efficiency: 1.5", ["max_efficiency: 1.5", "(0, 1]"]),
    ("gpus_per_node: 0", ["gpus_per_node: 0", ">= 1"]),
    ("gpus_per_node: two", ["gpus_per_node: 'two'"]),
    ("mem_bandwidth: fast", ["mem_bandwidth: 'fast'", "positive number"]),
    ("mem_bandwidth: -1", ["mem_bandwidth: -1:"]),
    ("mem_bandwidth: [1, 2]", ["mem_bandwidth: [1, 2]"]),
    (f"mem_bandwidth: {10**400}", ["mem_bandwidth: 1000", "positive number"]),  # past what a float holds
    (f"peak_flops: {{bf16: {10**400}}}", ["peak_flops.bf16: 1000"]),
    ("peak_flops: 5", ["peak_flops: 5"]),
    ("peak_flops: {fp8: 1e15}", ["precision 'fp8'"]),
    ("peak_flops: {bf16: 0}", ["peak_flops.bf16: 0"]),
    ("is_cpu: 1", ["is_cpu: 1", "true or false"]),
    ("name: 5", ["name: 5"]),
    ("memory_bytes: huge", ["memory_bytes: size 'huge'"]),
    ("base: [l4]", ["base=['l4']"]),
])
def test_bad_hardware_values_are_named(tmp_path, line, words):
    path = tmp_path / "hw.yaml"
    path.write_text(f"base: l4\n{line}\n" if not line.startswith("base") else line + "\n")
    with pytest.raises(ConfigError) as err:
        load_hardware(str(path))
    message = str(err.value)
    assert message.startswith(str(path)) and "\n" not in message
    for word in words:
        assert word in message, message


def test_hardware_numbers_as_strings_and_zero_division_guard(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text("base: l4\npeak_flops: {bf16: 1.2e14, fp32: '3e13'}\nmax_efficiency: '0.4'\ngpus_per_node: 4\n")
    profile = load_hardware(str(path))
    assert profile.peak_flops == {"bf16": 1.2e14, "fp32": 3e13} and profile.max_efficiency == 0.4


def test_bad_hardware_file_through_the_cli_is_exit_2(tmp_path, capsys):
    path = tmp_path / "hw.yaml"
    path.write_text("base: l4\nmax_efficiency: 0\n")
    code, _, err = cli(["estimate", "--hardware", str(path)], capsys)
    one_line_error(code, err, "max_efficiency")


# -- JSON lines of a surface or trials.jsonl

BAD_LINES = [
    ("[1, 2, 3]", "expected a JSON object"),
    ('"a string"', "expected a JSON object"),
    ('{"config": 5, "status": "ok"}', "config: 5"),
    (json.dumps({**GOOD, "throughput_samples_per_s": "fast"}), "throughput_samples_per_s: 'fast'"),
    (json.dumps({**GOOD, "peak_memory_bytes": "1GB"}), "peak_memory_bytes: '1GB'"),
    (json.dumps({**GOOD, "peak_memory_bytes": -5}), "peak_memory_bytes: -5"),
    (json.dumps({**GOOD, "workload": {"model": 7}}), "workload"),
    (json.dumps({**GOOD, "workload": "tiny"}), "workload"),
    (json.dumps({**GOOD, "status": "great"}), "status='great'"),
    (json.dumps({**GOOD, "config": {**GOOD["config"], "zero_stage": "2"}}), "zero_stage='2'"),
    (json.dumps({**GOOD, "trial": {"n": 1}}), "trial: {'n': 1}"),
    ('{"config": ', "not valid JSON"),
]


@pytest.mark.parametrize("line, words", BAD_LINES)
def test_wrong_shaped_lines_name_file_line_and_field(tmp_path, line, words):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    for loader in (read_results, load_surface):
        with pytest.raises(ConfigError) as err:
            loader(path)
        message = str(err.value)
        assert message.startswith(f"{path}:2: ") and "\n" not in message, message
        assert words in message, message


def test_a_result_round_trips_through_its_strict_parser():
    result = TrialResult.from_dict({**GOOD, "trial": 3, "predicted_peak_bytes": 1.5e9, "anything": [1]})
    assert TrialResult.from_dict(json.loads(result.to_json())) == result
    assert result.extra["trial"] == 3 and result.extra["anything"] == [1]


@pytest.mark.parametrize("line, words", BAD_LINES[:7])
def test_bad_lines_through_every_command_are_exit_2(run, tmp_path, capsys, line, words):
    surface = tmp_path / "s.jsonl"
    surface.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    code, _, err = cli(["surface", "show", str(surface)], capsys)
    one_line_error(code, err, f"{surface}:2", words)
    code, _, err = cli([*TUNE, "--backend", "replay", "--surface", str(surface), "--trials", "2",
                        "--out", str(tmp_path / "replayed")], capsys)
    one_line_error(code, err, f"{surface}:2", words)
    space = tmp_path / "space.yaml"
    space.write_text("zero_stage: [1]\nmicro_batch: [2]\nckpt_interval: [0]\nprecision: [bf16]\n")
    code, _, err = cli(["surface", "record", "--model", "tiny", "--space", str(space), "--out", str(surface),
                        "--backend", "simulated"], capsys)
    one_line_error(code, err, f"{surface}:2", words)
    with (run / "trials.jsonl").open("a") as trials:
        trials.write(line + "\n")
    before = (run / "trials.jsonl").read_bytes()
    code, _, err = cli(["report", str(run)], capsys)
    one_line_error(code, err, "trials.jsonl:4", words)
    code, _, err = cli([*TUNE, "--trials", "5", "--out", str(run), "--resume"], capsys)
    one_line_error(code, err, "trials.jsonl:4", words)
    assert (run / "trials.jsonl").read_bytes() == before  # nothing recorded changed


# -- run.json

@pytest.mark.parametrize("change, words", [
    (lambda s: {**s, "memory_budget_bytes": 1.5}, "memory_budget_bytes: 1.5"),
    (lambda s: {**s, "memory_budget_bytes": "1GiB"}, "memory_budget_bytes: '1GiB'"),
    (lambda s: {**s, "seed": -1}, "seed: -1"),
    (lambda s: {**s, "hardware": {**s["hardware"], "max_efficiency": 0}}, "hardware: max_efficiency: 0"),
    (lambda s: {**s, "workload": {"model": {"name": "x"}, "global_batch": 1}}, "workload: model: missing layers"),
    (lambda s: {**s, "space": {"zero_stage": "all"}}, "space: zero_stage"),
    (lambda s: [s], "expected a JSON object"),
    (lambda s: {k: v for k, v in s.items() if k != "strategy"}, "missing key(s) strategy"),
])
def test_bad_run_json_is_refused_on_resume(run, capsys, change, words):
    settings = run / "run.json"
    settings.write_text(json.dumps(change(json.loads(settings.read_text()))))
    before = (run / "trials.jsonl").read_bytes()
    code, _, err = cli([*TUNE, "--trials", "5", "--out", str(run), "--resume"], capsys)
    one_line_error(code, err, str(settings), words)
    assert (run / "trials.jsonl").read_bytes() == before


def test_run_json_as_a_directory_is_refused_on_resume(run, capsys):
    (run / "run.json").unlink()
    (run / "run.json").mkdir()
    code, _, err = cli([*TUNE, "--trials", "5", "--out", str(run), "--resume"], capsys)
    one_line_error(code, err, "run.json: is a directory")


# -- nothing recorded is lost

def test_a_last_line_missing_only_its_newline_is_kept_on_resume(run, capsys):
    trials = run / "trials.jsonl"
    with trials.open("r+b") as f:  # truncate -s -1
        f.truncate(trials.stat().st_size - 1)
    kept = records_without_newline = trials.read_text().splitlines()
    assert len(records_without_newline) == 3 and len(read_results(trials)) == 3  # read as a result
    code, out, _ = cli([*TUNE, "--trials", "5", "--out", str(run), "--resume"], capsys)
    assert code == 0, out
    lines = trials.read_text().splitlines()
    assert lines[:3] == kept  # the third trial is intact, not merged into the next line
    assert [json.loads(line)["trial"] for line in lines] == [1, 2, 3, 4, 5]  # numbered once each


def test_a_torn_last_line_is_moved_aside_and_reported(run, capsys):
    trials = run / "trials.jsonl"
    whole = trials.read_bytes()
    torn = whole[whole.rindex(b"\n", 0, len(whole) - 1) + 1:-40]  # the third record, cut mid-write
    trials.write_bytes(whole[:len(whole) - 40])
    code, out, _ = cli([*TUNE, "--trials", "4", "--out", str(run), "--resume"], capsys)
    assert code == 0, out
    aside = run / "trials.jsonl.torn-1"
    assert aside.read_bytes() == torn
    assert f"trials.jsonl:3: an incomplete last line ({len(torn)} bytes" in out and str(aside) in out
    results = records(trials)
    assert results[:2] == [json.loads(line) for line in whole.decode().splitlines()[:2]]
    assert [r["trial"] for r in results] == [1, 2, 3, 4]


def test_appending_keeps_a_complete_last_line_and_moves_a_torn_one(tmp_path):
    path = tmp_path / "t.jsonl"
    first = TrialResult.from_dict(GOOD)
    path.write_text(first.to_json())  # no newline
    append_result(path, first)
    assert path.read_text() == first.to_json() + "\n" + first.to_json() + "\n"
    path.write_text(first.to_json() + "\n" + '{"config": {"zer')
    append_result(path, first)
    assert path.read_text() == (first.to_json() + "\n") * 2
    assert (tmp_path / "t.jsonl.torn-1").read_text() == '{"config": {"zer'


def test_surface_record_keeps_a_last_line_missing_its_newline(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text("zero_stage: [0, 1]\nmicro_batch: [2, 4]\nckpt_interval: [0]\nprecision: [bf16]\n")
    out = tmp_path / "s.jsonl"
    argv = ["surface", "record", "--model", "tiny", "--space", str(space), "--out", str(out), "--backend", "simulated"]
    assert cli([*argv, "--limit", "2"], capsys)[0] == 0
    with out.open("r+b") as f:
        f.truncate(out.stat().st_size - 1)
    assert cli(argv, capsys)[0] == 0
    configs = [json.dumps(r["config"], sort_keys=True) for r in records(out)]
    assert len(configs) == 4 == len(set(configs))


# -- atomic, symlink-safe writes

def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(run, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / ".lock").unlink()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"\.lock is a symbolic link: refusing"):
        with RunDir(run).locked():
            pass
    code, _, err = cli([*TUNE, "--trials", "5", "--out", str(run), "--resume"], capsys)
    one_line_error(code, err, ".lock is a symbolic link")
    assert victim.read_text() == "precious\n" and len(read_results(run / "trials.jsonl")) == 3


def test_a_lock_hard_linked_to_another_file_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "r"
    run.mkdir()
    os.link(victim, run / ".lock")
    with pytest.raises(ConfigError, match="hard links"):
        with RunDir(run).locked():
            pass
    assert victim.read_text() == "precious\n"


def test_the_lock_holder_pid_is_recorded_without_truncating_through_the_open(tmp_path):
    run = RunDir(tmp_path / "r")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / ".lock").write_text("99999999 stale\n")
    with run.locked():
        assert (tmp_path / "r" / ".lock").read_text() == f"{os.getpid()}\n"


def test_appends_refuse_a_symlinked_trials_file(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "trials.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        append_result(tmp_path / "trials.jsonl", TrialResult.from_dict(GOOD))
    with pytest.raises(ConfigError, match="symbolic link"):
        append_line(tmp_path / "trials.jsonl", "x")
    assert victim.read_text() == "precious\n"


def test_symlinks_planted_at_the_old_fixed_temp_names_do_not_matter(run, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("summary.json.tmp", "run.json.tmp", "report.md.tmp", "calibration.json.tmp",
                 "best_ds_config.json.tmp", "plots/best_so_far.png.tmp"):
        (run / name).symlink_to(victim)
    code, out, _ = cli(["report", str(run)], capsys)
    assert code == 0, out
    code, out, _ = cli([*TUNE, "--trials", "4", "--out", str(run), "--resume"], capsys)
    assert code == 0, out
    assert victim.read_text() == "precious\n"


def test_outputs_are_replaced_by_rename_not_rewritten_in_place(run, capsys):
    # A second name for each old output keeps the old bytes if the writer renames a new file over it; an
    # in-place write would change both names.
    outputs = ["report.md", "summary.json", "best_ds_config.json", "plots/best_so_far.png",
               "plots/throughput_vs_memory.png"]
    for name in outputs:
        os.link(run / name, run / f"{name}.old")
        (run / name).write_bytes(b"stale")  # so that the regenerated file differs
        os.link(run / name, run / f"{name}.stale")
    code, out, _ = cli(["report", str(run)], capsys)
    assert code == 0, out
    for name in outputs:
        assert (run / f"{name}.stale").read_bytes() == b"stale"
        assert (run / name).read_bytes() != b"stale"
    assert (run / "plots/best_so_far.png").read_bytes().startswith(b"\x89PNG")
    assert not [p for p in run.rglob("*.tmp")]


def test_write_atomic_leaves_the_old_file_and_no_temp_on_failure(tmp_path):
    target = tmp_path / "out.json"
    write_atomic(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_output(target) as handle:
            handle.write(b"half of the ne")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    assert (target.stat().st_mode & 0o777) == 0o666 & ~current_umask()


def test_write_atomic_replaces_a_symlink_not_its_target(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "out.md").symlink_to(victim)
    write_atomic(tmp_path / "out.md", "report\n")
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "out.md").is_symlink() and (tmp_path / "out.md").read_text() == "report\n"


def current_umask() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


def test_invalid_json_of_several_lines_names_its_line():
    from autotune.files import parse_json

    with pytest.raises(ConfigError, match=r"run.json: not valid JSON \(Expecting ',' delimiter at line 3 column 3\)"):
        parse_json('{\n  "a": 1\n  "b": 2\n}\n', "run.json")
    with pytest.raises(ConfigError, match=r"x.json: not valid JSON \(Expecting value at column 7\)"):
        parse_json('{"a": }', "x.json")  # one line: its column says where
