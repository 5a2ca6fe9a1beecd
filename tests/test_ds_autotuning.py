"""DeepSpeed's own "autotuning" block read as ds-autotune's options where it maps (autotune/values/ds_autotuning.py,
issue 43), one line per key it cannot apply, one-line errors for values it cannot read."""

from __future__ import annotations

import pytest

from autotune.values.config import ConfigError
from autotune.values.ds_autotuning import read_autotuning
from autotune.values.space import Choices

# As DeepSpeed's autotuning tutorial writes it, with the stages to try in the config's own zero section.
DEEPSPEED_EXAMPLE = {
    "train_micro_batch_size_per_gpu": "auto",
    "zero_optimization": {"stage": [1, 2]},
    "autotuning": {"enabled": True, "fast": False, "metric": "throughput", "tuner_type": "model_based",
                   "tuner_num_trials": 24, "tuner_early_stopping": 5, "min_train_micro_batch_size_per_gpu": 2,
                   "max_train_micro_batch_size_per_gpu": 16, "num_tuning_micro_batch_sizes": 3,
                   "results_dir": "autotuning_results", "arg_mappings": {"train_micro_batch_size_per_gpu": "--mb"}},
}
SPACE = Choices(zero_stage=(0, 1, 2, 3), micro_batch=(1, 2, 4, 8, 16, 32))


def test_what_maps_is_taken_and_every_other_key_is_one_line():
    block = read_autotuning(DEEPSPEED_EXAMPLE, "ds_config.json")
    assert block is not None and dict(block.options) == {"strategy": "optuna", "trials": 24}
    narrowed = block.narrowed(SPACE)
    assert narrowed.zero_stage == (1, 2) and narrowed.micro_batch == (2, 8, 16)  # 3 of 2..16, both ends kept
    keys = [note.split(":")[1].strip().split(" ")[0] for note in block.notes]
    assert keys == ["autotuning.tuner_early_stopping", "autotuning.fast", "autotuning.arg_mappings",
                    "autotuning.results_dir"]
    assert all(note.startswith("ds_config.json: autotuning.") and "not applied" in note and "\n" not in note
               for note in block.notes)


def test_no_block_or_a_disabled_one_changes_nothing():
    assert read_autotuning({"train_batch_size": 8}) is None
    assert read_autotuning({"autotuning": {"enabled": False, "tuner_num_trials": 3}}) is None


def test_a_single_stage_is_the_scripts_own_and_all_is_every_stage():
    for stage in (2, "all", ["all"]):
        block = read_autotuning({"zero_optimization": {"stage": stage}, "autotuning": {"enabled": True}})
        assert block is not None and block.zero_stages is None and block.narrowed(SPACE).zero_stage == SPACE.zero_stage


@pytest.mark.parametrize("metric", ["latency", "flops"])
def test_latency_and_flops_rank_as_throughput_and_say_so(metric):
    block = read_autotuning({"autotuning": {"metric": metric}})
    assert block is not None and block.metric == metric and f"metric {metric}: ranked as throughput" in block.notes[0]
    assert "report.md gives the recommendation's latency per step and model FLOPS beside it" in block.notes[0]


def test_the_report_gives_the_recommendations_latency_and_model_flops(tmp_path):
    from autotune.api import TuneSpec, tune
    from autotune.outputs.report import model_flops_per_token
    from autotune.values.hardware import load_hardware
    from autotune.values.workload import make_workload

    spec = TuneSpec(make_workload("tiny", global_batch=16), load_hardware("cpu"), strategy="random", trials=2,
                    backend="simulated")
    best = tune(spec, tmp_path / "run").best
    tflops = model_flops_per_token(spec.workload.model) * best.tokens_per_s / 1e12
    assert (f"- Its other measures: latency {best.step_time_s:.3g} s per optimizer step (global batch 16), model FLOPS "
            f"{tflops:.3g} TFLOP/s per device") in (tmp_path / "run" / "report.md").read_text()


@pytest.mark.parametrize("block, expected", [
    ({"tuner_type": "bayes"}, "autotuning.tuner_type: 'bayes': allowed gridsearch, random, model_based"),
    ({"tuner_num_trials": 0}, "autotuning.tuner_num_trials: 0: allowed a whole number >= 1"),
    ({"metric": "speed"}, "autotuning.metric: 'speed': allowed throughput, latency, flops"),
    ({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4}, "allowed min <= max"),
    ("yes", "autotuning: 'yes': allowed an object"),
])
def test_values_it_cannot_read_are_one_line_errors(block, expected):
    with pytest.raises(ConfigError) as err:
        read_autotuning({"autotuning": block}, "ds.json")
    assert expected in str(err.value) and str(err.value).startswith("ds.json: ") and "\n" not in str(err.value)


def test_a_range_that_leaves_nothing_is_refused():
    block = read_autotuning({"autotuning": {"min_train_micro_batch_size_per_gpu": 64}}, "conf/ds.json")
    assert block is not None
    with pytest.raises(ConfigError, match=r"^conf/ds.json: autotuning: no micro-batch of the space"):
        block.narrowed(SPACE)


# -- `autotune tune --script train.py -- --deepspeed ds_config.json`: the block read from the script's own config --

def _tune_args(tmp_path, *flags, block=DEEPSPEED_EXAMPLE["autotuning"], after=True):
    import json
    from pathlib import Path

    from autotune.cli import parse

    scripts = Path(__file__).parent / "scripts"
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({**json.loads((scripts / "plain_ds_config.json").read_text()),
                                  "zero_optimization": {"stage": [0, 2]}, "autotuning": block}))
    script = ["--deepspeed_config", str(config), "--steps", "5"]
    argv = ["tune", "--script", str(scripts / "plain_ds_train.py"), "--hardware", "cpu", *flags]
    return parse(argv + (["--", *script] if after else ["--script-args", " ".join(script)]))


@pytest.mark.parametrize("after", [True, False], ids=["after --", "--script-args"])
def test_the_scripts_autotuning_block_sets_what_no_flag_set(tmp_path, after):
    from autotune.commands.tune import script_spec_from

    args = _tune_args(tmp_path, "--trials", "6", after=after)
    spec = script_spec_from(args)
    assert spec.script_args[0] == "--deepspeed_config" and spec.script_args[-2:] == ("--steps", "5")
    assert spec.strategy == "optuna" and spec.trials == 6  # tuner_type taken; --trials given on the command line wins
    assert spec.space.zero_stage == (0, 2) and set(spec.space.micro_batch) <= {2, 4, 8, 16}
    notes = args._notes
    assert notes[0].endswith("autotuning block read: strategy optuna, the space narrowed to its micro-batches and "
                             "ZeRO stages")
    assert any("tuner_early_stopping 5: not applied" in note for note in notes[1:])


def test_arguments_after_the_separator_are_only_for_a_script(capsys):
    from autotune.cli import main

    with pytest.raises(SystemExit) as done:  # argparse's own exit, one line
        main(["estimate", "--", "--deepspeed", "x.json"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.count("\n") == 1 and "arguments after --: --deepspeed x.json: only with --script" in err


def test_the_scripts_arguments_are_given_one_way(tmp_path, capsys):
    from pathlib import Path

    from autotune.cli import main

    script = Path(__file__).parent / "scripts" / "plain_ds_train.py"
    with pytest.raises(SystemExit) as done:
        main(["tune", "--script", str(script), "--script-args", "--steps 5", "--", "--steps", "5"])
    assert done.value.code == 2 and "--script-args and arguments after --: choose one" in capsys.readouterr().err
