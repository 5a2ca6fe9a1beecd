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
    # a key whose value is text takes a string only, never its str() (`wandb: 5` logged to a project named "5")
    ("workloads:\n  - {name: a, wandb: 5}", "workloads[0].wandb: 5: allowed a W&B project name (a string)"),
    ("defaults: {wandb: true}\nworkloads:\n  - {name: a}", "defaults.wandb: True: allowed a W&B project name (a string)"),
    ("workloads:\n  - {name: a, mlflow_uri: true}", "workloads[0].mlflow_uri: True: allowed an MLflow tracking URI (a string"),
    ("workloads:\n  - {name: a, storage: [a]}", "workloads[0].storage: ['a']: allowed an Optuna storage (a string"),
    ("workloads:\n  - {name: a, backend: replay, surface: 5}", "workloads[0].surface: 5: allowed a replay surface's path (a string"),
    ("workloads:\n  - {name: a, strategy: rl, policy: 5}", "workloads[0].policy: 5: allowed an exported policy's folder (a string"),
    ("workloads:\n  - {name: a, hardware: true}", "workloads[0].hardware: True: allowed a hardware profile's name, auto, or"),
    ("workloads:\n  - {name: 7}", "workloads[0].name: 7: allowed a name (a string of letters, digits"),
    ("workloads:\n  - {name: a, space: nope.yaml}", "workloads[0].space: 'nope.yaml': no such file (nor /"),
    ("defaults: {space: nope}\nworkloads:\n  - {name: a}", "defaults.space: 'nope': no such file (nor /"),
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


@pytest.mark.parametrize("key, value", [
    ("wandb", "5"), ("wandb", "[p]"), ("mlflow_uri", "5"), ("storage", "7"), ("storage", "{a: 1}"), ("surface", "true"),
    ("policy", "true"), ("hardware", "[cpu]"), ("space", "5"), ("script", "5"), ("model", "5"), ("name", "false"),
    ("stack", "5"), ("allocator", "true"), ("strategy", "5"), ("backend", "[simulated]"), ("trials", "true"),
    ("seed", "1.5"), ("confirm", "true"), ("gpus", "[1]"), ("global_batch", "true"), ("gpus_per_trial", "1.5"),
    ("memory_budget", "true"), ("time_budget", "[1]"), ("train_for", "true"), ("trial_timeout", "{a: 1}"),
    ("target_gpus", "true"), ("stop_when", "[0.1]"), ("script_args", "'--a b'"), ("seq_len", "true"), ("seq_len", "0"),
])
def test_a_wrong_type_for_any_workload_key_is_refused_naming_the_key(tmp_path, key, value):
    """Every key of a workload (in `defaults:` too) refuses a value of the wrong type: none slips through as its str()."""
    for body in (f"workloads:\n  - {{name: a, {key}: {value}}}", f"defaults: {{{key}: {value}}}\nworkloads:\n  - {{name: a}}"):
        if key == "name" and body.startswith("defaults"):
            continue  # not a defaults key (refused as unknown)
        if key == "name":  # once: a key given twice is refused as such (autotune.files.load_yaml)
            body = f"workloads:\n  - {{name: {value}}}"
        if key == "script_args":  # only with a script
            (tmp_path / "train.py").write_text("")
            body = body.replace("{name: a", "{name: a, script: train.py")
        path = write(tmp_path, body)
        with pytest.raises(ConfigError) as err:
            load_sweep(path)
        where = "defaults" if body.startswith("defaults") else "workloads[0]"
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{path}: {where}.{key}: ") and "allowed" in message, message


def test_seq_len_replaces_the_models_as_tunes_flag_and_goes_with_the_model(tmp_path):
    (tmp_path / "train.py").write_text("")
    sweep = load_sweep(write(tmp_path, """
defaults: {model: gpt2-small, seq_len: 512}
workloads:
  - {name: a}
  - {name: b, model: {layers: 2, hidden: 64, heads: 4, vocab: 100, seq_len: 64}, seq_len: 128}
  - {name: c, model: llama-1b}
  - {name: d, script: train.py}
"""))
    a, b, c, d = sweep.workloads
    assert a.settings.workload.model.seq_len == 512 and a.settings.workload.model.name == "gpt2-small"
    assert b.settings.workload.model.seq_len == 128 and c.settings.workload.model.seq_len == 512
    assert d.tune.script is not None  # its own script replaces the defaults' model and seq_len (REPLACES)
    path = write(tmp_path, "workloads:\n  - {name: a, script: train.py, seq_len: 256}")
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert str(err.value) == (f"{path}: workloads[0].seq_len: 256: a script brings its model and its sequence length "
                              "(allowed: seq_len with model)")


def test_space_and_other_paths_resolve_from_the_sweep_files_folder(tmp_path, monkeypatch):
    (tmp_path / "spaces").mkdir()
    (tmp_path / "spaces" / "small").write_text("zero_stage: [1, 2]\nprecision: [fp32]\n")
    path = write(tmp_path, "workloads:\n  - {name: a, space: spaces/small}\n")
    monkeypatch.chdir(tmp_path.parent)  # not the sweep file's folder
    (spec,) = load_sweep(path).workloads
    assert spec.tune.space == str(tmp_path / "spaces" / "small") and set(spec.space.choices.zero_stage) == {1, 2}


def test_neither_model_nor_script_tunes_tiny_and_says_so(tmp_path):
    """As `autotune tune` without --model: tiny, with a note the console shows; with backend replay, the surface's."""
    surface = Path(__file__).resolve().parents[1] / "benchmarks" / "surfaces" / "small-llama-cpu.jsonl"
    a, b, c = load_sweep(write(tmp_path, f"""
workloads:
  - {{name: a}}
  - {{name: b, model: gpt2-small}}
  - {{name: c, backend: replay, surface: {surface}}}
""")).workloads
    assert a.settings.workload.model.name == "tiny" and a.notes == ("model: tiny (the default; model: or script: to choose)",)
    assert b.notes == () and c.notes == ()
    assert c.settings.workload.model.name == "small-llama"  # the surface's, not tiny (once refused as --model tiny)
    assert (a.settings.hardware.name, a.settings.memory_budget_bytes) == ("cpu", 24 * 2**30)  # as docs/ray.md says
    assert b.settings.hardware.name == "a100-80gb"


def test_sweep_command_says_the_default_model_and_takes_wandb_for_every_workload(tmp_path, monkeypatch, capsys):
    """`--wandb PROJECT` takes the place of every workload's own wandb key, as --mlflow does of mlflow_uri; the
    default-model note comes before anything runs. tune_many is stubbed: no Ray, no trial."""
    import autotune.api

    seen = []

    def stub(plans, **_):
        seen.extend(plans)
        raise ConfigError("stub: nothing runs")
    monkeypatch.setattr(autotune.api, "tune_many", stub)
    path = write(tmp_path, "workloads:\n  - {name: a, wandb: own}\n  - {name: b, model: tiny}\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "--wandb", "shared"]) == 2
    out = capsys.readouterr().out
    assert "a: model: tiny (the default; model: or script: to choose)" in out and "b: model" not in out
    assert [plan.spec.wandb for plan in seen] == ["shared", "shared"]
    seen.clear()
    assert main(["sweep", str(path), "--out", str(tmp_path / "out2")]) == 2
    assert [plan.spec.wandb for plan in seen] == ["own", None]
    seen.clear()
    assert main(["sweep", str(path), "--out", str(tmp_path / "out3"), "--wandb", "a/b"]) == 2
    assert "W&B project 'a/b'" in capsys.readouterr().err and seen == []  # refused before anything runs


def test_sweep_help_offers_wandb_as_it_offers_mlflow(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--mlflow" in text and "--wandb PROJECT" in text and "in place of the workloads' own wandb keys" in text


def test_a_directory_is_not_a_sweep_file(tmp_path, capsys):
    assert main(["sweep", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "a directory: allowed a sweep YAML file" in err and "no such file" not in err


def test_docs_ray_md_says_the_sweep_files_defaults_concurrency_and_relative_paths():
    paragraph = (Path(__file__).resolve().parent.parent / "docs" / "ray.md").read_text().split("**Batch sweeps.**")[1]
    paragraph = " ".join(paragraph.split("**The summary.**")[0].split())
    for said in ("top-level `concurrency:`", "`--concurrency` takes its place", "hardware `cpu` (24 GiB",
                 "`a100-80gb` for another model", "neither `model:` nor `script:` tunes `tiny`",
                 "model: tiny (the default; model: or script: to choose)", "`wandb: 5` is refused",
                 "`--wandb PROJECT`"):
        assert said in paragraph, said
    assert "(`script:`, `space:`, `surface:`, `policy:`, a hardware or model YAML) are relative to the sweep file's folder" in paragraph


def test_report_of_a_sweep_directory_whose_workloads_recorded_nothing_is_one_line(tmp_path, capsys):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.yaml").write_text("workloads:\n  - {name: a}\n  - {name: b}\n")
    code = main(["report", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{out}: a sweep directory whose workloads (a, b) recorded nothing: no summary to write" in err
    assert sorted(p.name for p in out.iterdir()) == ["sweep.yaml"]
