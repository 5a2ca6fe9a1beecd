"""A sweep whose trials crash alike whatever the config (a script that exits at its fifth step, a broken
environment) stops after three such configs with one line naming the cause (drivers/loop.py Job._repeated_crash):
a reviewer's `tune --script` spent all 8 trials on `rank 0 in measure: fatal: bad data (exit code 3)`, each
line saying a better config was 100% likely. Crashes that differ, or alike only where ZeRO partitions or only in a
reduced precision, are those configs' own and the sweep goes on."""

from __future__ import annotations

import autotune
from autotune.drivers.stop import StopReason
from autotune.values.config import Config
from autotune.values.results import STDERR_TAIL, TrialResult


class Crashing:
    """Every trial crashes; `cause(config)` is its error up to the stderr quote, `ok(config)` runs instead."""

    name = "crashing"

    def __init__(self, cause, ok=lambda config: False):
        self.cause, self.ok = cause, ok

    def run(self, config: Config) -> TrialResult:
        if self.ok(config):
            return TrialResult(config, "ok", throughput_samples_per_s=1.0, step_time_s=1.0, peak_memory_bytes=2**20,
                               backend=self.name)
        return TrialResult(config, "crash", backend=self.name,
                           error=f"{self.cause(config)}{STDERR_TAIL}\nwarning {config.label()}")


class Lines(autotune.QuietProgress):
    def __init__(self):
        self.lines = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def sweep(tmp_path, backend, trials=8, lines=None, strategy="random", **knobs):
    spec = autotune.TuneSpec(autotune.make_workload("tiny", global_batch=16), autotune.load_hardware("cpu"),
                             memory_budget_bytes=2**30, strategy=strategy, trials=trials, backend=backend, seed=1,
                             **knobs)
    return autotune.tune(spec, out=tmp_path / "run", callbacks=lines or Lines())


def test_three_configs_crashing_alike_stop_the_sweep_with_the_cause(tmp_path):
    lines = Lines()
    # Four configs, two per ZeRO stage: any three hold both stages.
    space = autotune.Choices(zero_stage=(0, 1), micro_batch=(1, 2), ckpt_interval=(0,), precision=("fp32",))
    result = sweep(tmp_path, Crashing(lambda c: "rank 0 in measure: fatal: bad data (exit code 3)"), lines=lines,
                   space=space)
    assert result.stop_reason is StopReason.FATAL
    assert len(result.results) == 3 and len({r.config for r in result.results}) == 3
    [stop] = [line for line in lines.lines if line.startswith("stopping: ")]
    assert "3 configs crashed alike" in stop and "fatal: bad data (exit code 3): a failure of the script" in stop
    assert "warning" not in stop  # the cause, not the stderr each quotes
    assert "fatal: bad data (exit code 3)" in result.verdict


def test_crashes_of_their_own_configs_or_after_a_trial_ran_do_not_stop_it(tmp_path):
    # Each config's own crash (its label in the cause): the budget is spent.
    own = sweep(tmp_path / "own", Crashing(lambda c: f"rank 0 in step: {c.label()} failed"))
    assert own.stop_reason is StopReason.TRIALS and len(own.results) == 8
    # Alike, but a trial ran first: a config's failure, whatever the others'.
    first = []
    ran = sweep(tmp_path / "ran", Crashing(lambda c: "bad", ok=lambda c: not first and not first.append(c)))
    assert ran.results[0].status == "ok" and ran.stop_reason is not StopReason.FATAL and len(ran.results) > 4
    # Alike only where ZeRO partitions (DeepSpeed refuses the script's optimizer there), or only in bf16 (a loop
    # feeding fp32 into a bf16 model): those configs' failure; stage 0, fp32, is tried.
    grid = dict(micro_batch=(1, 2, 4, 8), ckpt_interval=(0,))
    for name, space, fails in (
            ("zero", autotune.Choices(zero_stage=(0, 1, 2, 3), precision=("fp32",), **grid), lambda c: c.zero_stage),
            ("bf16", autotune.Choices(zero_stage=(0, 1), precision=("bf16", "fp32"), **grid),
             lambda c: c.precision == "bf16")):
        ran = sweep(tmp_path / name, Crashing(lambda c: "bad", ok=lambda c, fails=fails: not fails(c)), trials=12,
                    space=space)
        assert ran.stop_reason is not StopReason.FATAL and ran.best is not None, name
