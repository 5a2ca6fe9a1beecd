"""Sweep files (autotune/commands/sweep_file.py): parsing, defaults, and one-line errors naming file, key, value and
what is allowed; the summary table; CLI usage errors of `autotune sweep` and of the Ray flags of `tune`."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.values.config import ConfigError
from autotune.commands.sweep_file import load_sweep
from autotune.outputs.sweep import write_summary

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sweep.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_the_example_sweep_file_loads():
    sweep = load_sweep(EXAMPLE)
    names = [w.name for w in sweep.workloads]
    assert len(names) == len(set(names)) >= 3
    by_name = {w.name: w for w in sweep.workloads}
    xl = by_name["gpt2-xl-8gpu"].settings
    assert (xl.workload.gpus, xl.workload.global_batch, xl.hardware.name, xl.memory_budget_bytes) == (8, 256, "a100-40gb", 40 * 2**30)
    assert by_name["gpt2-xl-8gpu"].budget.trials == 16 and xl.strategy == "optuna" and xl.backend == "simulated"
    custom = by_name["llama-13b-custom-shape"].settings.workload.model
    assert (custom.layers, custom.hidden, custom.arch) == (40, 5120, "llama")


def test_docs_ray_md_lists_every_option_a_sweep_file_takes():
    from autotune.api import spec_options

    paragraph = (Path(__file__).resolve().parent.parent / "docs" / "ray.md").read_text().split("**Batch sweeps.**")[1]
    listed = paragraph.split("under its\nflag's name:", 1)[1].split(";", 1)[0].replace("\n", " ")
    assert {key.strip() for key in listed.split(",")} == {option.key for _, option, _ in spec_options()}


def test_defaults_apply_and_workloads_override(tmp_path):
    sweep = load_sweep(write(tmp_path, """
defaults: {trials: 7, strategy: random, memory_budget: 1GiB}
concurrency: 3
workloads:
  - {name: a, model: tiny}
  - {name: b, model: tiny, trials: 2, strategy: grid, seed: 4, time_budget: 90m}
"""))
    a, b = sweep.workloads
    assert (a.budget.trials, a.settings.strategy, a.settings.memory_budget_bytes) == (7, "random", 2**30)
    assert (b.budget.trials, b.settings.strategy, b.settings.seed, b.budget.time_s) == (2, "grid", 4, 5400.0)
    assert a.settings.hardware.name == "cpu" and sweep.concurrency == 3


@pytest.mark.parametrize("body, expected", [
    ("workloads: []", "workloads: expected a non-empty list"),
    ("workloads:\n  - {name: a, modle: tiny}", "workloads[0]: unknown key 'modle': allowed name, model,"),
    ("workloads:\n  - {name: a, model: tiny4}", "workloads[0].model: 'tiny4': allowed tiny, gpt2-small"),
    ("workloads:\n  - {name: a, memory_budget: 12XB}", "workloads[0].memory_budget: '12XB':"),
    ("workloads:\n  - {name: a, trials: 0}", "workloads[0].trials: 0: '0' must be a positive integer (allowed a positive integer)"),
    ("workloads:\n  - {name: a, strategy: bayes}", "workloads[0].strategy: 'bayes': allowed grid, random, optuna"),
    ("workloads:\n  - {name: a, backend: cuda}", "workloads[0].backend: 'cuda': allowed deepspeed, simulated, replay"),
    ("workloads:\n  - {name: a}\n  - {name: a}", "workloads[1].name: 'a' is used twice"),
    ("workloads:\n  - {name: 'a/b'}", "workloads[0].name: 'a/b': allowed letters, digits"),
    ("workloads:\n  - {model: tiny}", "workloads[0]: no name: each workload needs one, its run directory's"),
    ("workloads:\n  - {name: a, strategy: rl, policy: nope}", "workloads[0].policy: 'nope': no such folder (nor /"),
    ("workloads:\n  - {name: a, hardware: h900}", "workloads[0].hardware: unknown hardware 'h900'"),
    ("workloads:\n  - {name: a, model: {layers: 2, hidden: 10, heads: 3, vocab: 10, seq_len: 8}}",
     "workloads[0].model: model hidden=10 is not divisible by heads=3"),
    ("workloads:\n  - {name: a, model: {layers: 2, width: 8}}", "workloads[0].model: {'layers': 2, 'width': 8}:"),
    ("workloads:\n  - {name: a, surface: s.jsonl}", "workloads[0]: surface is only for backend replay"),
    ("defaults: {name: x}\nworkloads:\n  - {name: a}", "defaults: unknown key 'name'"),
    ("concurrency: 0\nworkloads:\n  - {name: a}", "concurrency: 0: allowed a positive integer"),
    ("workload:\n  - {name: a}", "unknown key 'workload': allowed defaults, workloads, concurrency"),
])
def test_bad_sweep_files_get_one_line_errors(tmp_path, body, expected):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)) and expected in message, message


def test_summary_table_markdown_and_csv(tmp_path):
    rows = [{"workload": "a", "model": "tiny", "gpus": 1, "global_batch": 16, "hardware": "cpu", "memory_budget": "1 GiB",
             "strategy": "optuna", "backend": "simulated", "trials": 3, "pruned": 2, "recommended": "z1 mb8 ck0 bf16",
             "config_json": "{}", "throughput_samples_per_s": 6.5, "peak_memory": "800 MiB", "peak_memory_bytes": 1,
             "stopped": "trial budget spent", "verdict": "v", "report": "a/report.md"},
            {"workload": "b", "model": "llama-70b", "gpus": 1, "global_batch": 8, "hardware": "a100-40gb",
             "memory_budget": "1 GiB", "strategy": "optuna", "backend": "simulated", "trials": 0, "pruned": 540,
             "recommended": "",
             "config_json": "", "throughput_samples_per_s": "", "peak_memory": "", "peak_memory_bytes": "",
             "stopped": "nothing fits", "verdict": "no config fits the budget", "report": "b/report.md"}]
    md, csv_path = write_summary(tmp_path, rows)
    text = md.read_text()
    assert "| a | tiny | 1 | 16 | 1 GiB | 3 | 2 | z1 mb8 ck0 bf16 | 6.5 | 800 MiB | trial budget spent | [report](a/report.md) |" in text
    assert "| 0 | 540 | none: no config fits the budget" in text
    assert "*trials*: trials launched; *pruned*: configs predicted not to fit" in text  # what the counts mean
    with open(csv_path, newline="") as handle:
        read = list(csv.DictReader(handle))
    assert [r["workload"] for r in read] == ["a", "b"] and read[0]["throughput_samples_per_s"] == "6.5"
    assert [(r["trials"], r["pruned"]) for r in read] == [("3", "2"), ("0", "540")]


def test_cli_usage_errors(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert main(["sweep", str(EXAMPLE), "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err
    code = main(["tune", "--backend", "simulated", "--trials", "1", "--concurrency", "2", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert code == 2 and "--concurrency 2: only with --ray-address" in err
