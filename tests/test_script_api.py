"""Script mode from the library (issue 26): `autotune.tune(TuneSpec.for_script(...))` tunes a user's script as
`autotune tune --script` does, through the same door as every other sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autotune
from autotune.values.config import ConfigError
from autotune.values.results import read_results
from autotune.values.space import Choices

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "train_plain.py"


def test_a_script_spec_is_refused_in_one_line_where_it_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        autotune.TuneSpec.for_script(tmp_path / "missing.py")
    with pytest.raises(ConfigError, match="backend 'simulated' with a script: a script's trials are real runs"):
        autotune.TuneSpec.for_script(SCRIPT, backend="simulated")
    with pytest.raises(ConfigError, match="target_gpus 2 with a script"):
        autotune.TuneSpec.for_script(SCRIPT, target_gpus=2)
    spec = autotune.TuneSpec.for_script(SCRIPT, ["--steps", "5"], hardware="cpu")
    settings, space = autotune.api.resolve(spec)
    assert settings.backend == "script" and settings.workload.model.name == "unknown"  # until the first trial
    assert spec.script_spec().args == ("--steps", "5")


@pytest.mark.slow
def test_a_script_is_tuned_from_python_and_resumed(tmp_path):
    """Real trials of the plain DeepSpeed example: the first shows the model and keeps the script's global batch,
    the recommendation is the script's own config with the tuned keys, and a resume keeps the script."""
    space = Choices(zero_stage=(0, 1), micro_batch=(4, 8), ckpt_interval=(0,), precision=("fp32",))
    args = ["--deepspeed_config", str(EXAMPLES / "ds_config.json"), "--steps", "5"]
    spec = autotune.TuneSpec.for_script(SCRIPT, args, hardware="cpu", memory_budget_bytes=6 * 2**30, space=space,
                                        strategy="random", trials=2, confirm=0, stop_when=0)
    out = tmp_path / "run"
    result = autotune.tune(spec, out)
    results = read_results(out / "trials.jsonl")
    assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
    assert all(r.backend == "script" for r in results) and result.best is not None
    settings = json.loads((out / "run.json").read_text())
    assert settings["backend"] == "script" and settings["workload"]["global_batch"] == 16  # the script's own
    model = settings["workload"]["model"]
    assert (model["layers"], model["hidden"], model["vocab"]) == (2, 128, 1024)  # learned by the first trial
    best = json.loads((out / "best_ds_config.json").read_text())
    assert best["scheduler"]["type"] == "WarmupLR"  # the script's own config, tuned keys merged in
    assert best["zero_optimization"]["stage"] == result.best.config.zero_stage
    assert "## Script mode" in (out / "report.md").read_text()
    again = autotune.tune(autotune.TuneSpec.for_script(SCRIPT, args, hardware="cpu", memory_budget_bytes=6 * 2**30,
                                                       space=space, strategy="random", trials=3, confirm=0,
                                                       stop_when=0), out, resume=True)
    assert len(again.results) == 3 and len({r.config for r in again.results}) == 3
    with pytest.raises(ConfigError, match="--resume: .* tuned .*train_plain.py"):
        autotune.tune(autotune.TuneSpec.for_script(SCRIPT, ["--steps", "5"], hardware="cpu",
                                                   memory_budget_bytes=6 * 2**30, space=space, strategy="random",
                                                   trials=4), out, resume=True)
