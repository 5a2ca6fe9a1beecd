"""A sweep's files as people read them: sweep_summary.md's rows one line each whatever a verdict quotes, a stop
text that points at the console pointed at the report instead, a YAML key given twice refused (every YAML the tool
reads goes through autotune.files.load_yaml), and an error naming the defaults' key for a value taken from them."""

from __future__ import annotations

import re

import pytest

from autotune.commands.sweep_file import load_sweep
from autotune.drivers.stop import StopReason
from autotune.files import load_yaml
from autotune.outputs.sweep import summary_row, write_summary
from autotune.values.config import ConfigError
from autotune.values.hardware import load_hardware
from autotune.search_spaces import load_choices


def _unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_a_verdict_over_several_lines_or_with_a_pipe_stays_in_its_row(tmp_path):
    (tmp_path / "s.yaml").write_text("workloads:\n  - {name: s, model: tiny}\n")
    settings = load_sweep(tmp_path / "s.yaml").workloads[0].settings
    verdict = ("the script cannot be tuned as it is: crashed_before_initialize: rank 0 in script; last lines of "
               "stderr:\n  boom: a | b\n  second line")
    row = summary_row("s", settings, tmp_path / "s", tmp_path, None, {}, verdict, StopReason.FATAL.text)
    md, _ = write_summary(tmp_path, [row])
    rows = [line for line in md.read_text().splitlines() if line.startswith("|")]
    assert len(rows) == 3, rows  # header, separator, the workload's one row
    header, _, only = rows
    assert _unescaped_pipes(only) == _unescaped_pipes(header) == 13
    assert "last lines of stderr: boom: a \\| b second line" in only
    assert "a failure no other config can avoid (the verdict names it)" in only


@pytest.mark.parametrize("body, line, key", [
    ("defaults: {backend: simulated, trials: 1}\nworkloads:\n  - name: a\n    trials: 3\n    trials: 4\n", 5, "'trials'"),
    ("workloads:\n  - name: a\n    model: gpt2-xl\n    model: tiny\n", 4, "'model'"),
    ("workloads:\n  - {name: a, name: b}\n", 2, "'name'"),
    ("defaults: {trials: 1}\ndefaults: {trials: 2}\nworkloads:\n  - {name: a}\n", 2, "'defaults'"),
])
def test_a_key_given_twice_in_a_sweep_file_is_refused_naming_the_file_line_and_key(tmp_path, body, line, key):
    path = tmp_path / "dup.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:{line}: ") and f"key {key} given twice" in message, message


def test_every_yaml_the_tool_reads_refuses_a_key_given_twice_and_merge_keys_still_merge(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("zero_stage: [0]\nmicro_batch: [1]\nzero_stage: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"space.yaml:3: .*key 'zero_stage' given twice \(first on line 1\)"):
        load_choices(str(space))
    hardware = tmp_path / "hw.yaml"
    hardware.write_text("name: mine\nmemory_gb: 40\nmemory_gb: 80\n")
    with pytest.raises(ConfigError, match=r"hw.yaml:3: .*key 'memory_gb' given twice"):
        load_hardware(str(hardware))
    merged = tmp_path / "merge.yaml"
    merged.write_text("base: &b {trials: 2, seed: 1}\nmine:\n  <<: *b\n  seed: 3\n")
    assert load_yaml(merged)["mine"] == {"trials": 2, "seed": 3}  # its own key overrides the merged one
    (tmp_path / "same.yaml").write_text("{a: 1, a: 1}\n")
    with pytest.raises(ConfigError, match=r"same.yaml:1: .*key 'a' given twice"):
        load_yaml(tmp_path / "same.yaml")


def test_a_value_a_script_workload_takes_from_defaults_is_named_as_the_defaults(tmp_path):
    (tmp_path / "train.py").write_text("print('train')\n")
    path = tmp_path / "s.yaml"
    path.write_text("defaults: {backend: simulated}\nworkloads:\n  - {name: s, script: train.py}\n")
    with pytest.raises(ConfigError, match=r"s.yaml: defaults.backend: 'simulated': a script's trials are real runs"):
        load_sweep(path)
    path.write_text("defaults: {script_args: [--x]}\nworkloads:\n  - {name: s}\n")
    with pytest.raises(ConfigError, match=r"s.yaml: defaults.script_args: \['--x'\]: only with script"):
        load_sweep(path)
