"""What steers the tuner from a result's extra keys is typed and checked (issue 26): TrialResult.phase,
.repeat_of, .cause, .global_batch, .script_model, .runs and .throughput_runs; the JSON line keeps them flat,
so records written before load as they did."""

import json

import pytest

from autotune.values.config import Config, ConfigError
from autotune.search.pruning import cause_of
from autotune.values.results import CAUSE_NAMES, CONFIRM, DEVICE_MEMORY, HOST_MEMORY, SEARCH, TrialResult

CONFIG = Config(1, 2, 0, "fp32")


def test_the_typed_views_default_for_a_search_trial():
    result = TrialResult(CONFIG, "ok", throughput_samples_per_s=3.0)
    assert (result.phase, result.repeat_of, result.cause) == (SEARCH, None, None)


def test_a_recorded_line_of_a_repeat_and_of_a_pruned_config_loads_typed_and_writes_back_the_same():
    repeat = {"config": CONFIG.to_dict(), "status": "ok", "throughput_samples_per_s": 3.0, "trial": 7,
              "phase": "confirm", "repeat_of": 2}
    pruned = {"config": CONFIG.to_dict(), "status": "pruned", "cause": "host_memory", "fit_probability": 0.01}
    for line, typed in ((repeat, (CONFIRM, 2, None)), (pruned, (SEARCH, None, HOST_MEMORY))):
        result = TrialResult.from_json(json.dumps(line))
        assert (result.phase, result.repeat_of, result.cause) == typed
        assert {k: v for k, v in result.to_dict().items() if k in line} == line
    assert cause_of(TrialResult.from_dict(pruned)) == HOST_MEMORY


def test_an_older_record_without_a_cause_still_has_one_read_from_its_message():
    old = TrialResult(CONFIG, "oom", error="peak 3 GiB exceeds the budget")
    assert old.cause is None and cause_of(old) == DEVICE_MEMORY


@pytest.mark.parametrize("key, value, allowed", [
    ("phase", "warmup", "search, confirm or null"),
    ("repeat_of", 0, "a trial number >= 1 or null"),
    ("repeat_of", "2", "a trial number >= 1 or null"),
    ("cause", "disk", ", ".join(CAUSE_NAMES) + " or null"),
])
def test_a_steering_key_out_of_range_is_one_line_when_made_or_read(key, value, allowed):
    with pytest.raises(ConfigError, match="^" + key) as made:
        TrialResult(CONFIG, "crash", extra={key: value})
    assert str(made.value) == f"{key}: {value!r}: allowed {allowed}"
    with pytest.raises(ConfigError) as read:
        TrialResult.from_dict({"config": CONFIG.to_dict(), "status": "crash", key: value})
    assert str(read.value) == str(made.value)


def test_a_script_trials_batch_and_model_and_a_confirmed_results_runs_are_typed_and_checked():
    kept = TrialResult(CONFIG, "ok", throughput_samples_per_s=3.0,
                       extra={"global_batch": 8, "script_model": {"seq_len": 64}, "runs": 3,
                              "throughput_runs": [3.0, 2.9, 3.1]})
    assert (kept.global_batch, kept.script_model, kept.runs, kept.throughput_runs) == (8, {"seq_len": 64}, 3,
                                                                                        (3.0, 2.9, 3.1))
    plain = TrialResult(CONFIG, "ok", throughput_samples_per_s=3.0)
    assert (plain.global_batch, plain.script_model, plain.runs, plain.throughput_runs) == (None, None, None, ())
    for key, bad in (("global_batch", 0), ("script_model", "gpt2"), ("runs", 1.5), ("throughput_runs", [1.0, None])):
        with pytest.raises(ConfigError, match=key):
            TrialResult(CONFIG, "ok", throughput_samples_per_s=3.0, extra={key: bad})
