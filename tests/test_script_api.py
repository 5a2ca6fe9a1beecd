"""Script mode from the library (issue 26): `autotune.tune(TuneSpec.for_script(...))` tunes a user's script as
`autotune tune --script` does, through the same door as every other sweep. Its real sweep (started from Python,
resumed from the command line, a resume of another script refused from both) is
tests/test_script_real.py::test_plain_script_with_a_config_path_is_tuned_and_its_recommendation_trains."""

from __future__ import annotations

from pathlib import Path

import pytest

import autotune
from autotune.values.config import ConfigError

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
