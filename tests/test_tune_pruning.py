"""Estimator consultation before each trial: pruning, its margin, and what out-of-memory results teach it."""

from __future__ import annotations

from autotune.config import Config
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.estimate import Calibration, estimate
from autotune.hardware import PROFILES
from autotune.pruning import MIN_MARGIN, OTHER_LAYOUT_SLACK, UNCALIBRATED_MARGIN, Pruner, layout
from autotune.results import TrialResult
from autotune.search_spaces import load_choices
from autotune.space import Space
from autotune.strategies import SearchContext, make_strategy
from autotune.workload import make_workload

WORKLOAD, HARDWARE = make_workload("tiny"), PROFILES["cpu"]
SMALL, BIG = Config(0, 1, 0, "bf16"), Config(0, 8, 0, "fp32")


def test_configs_beyond_the_margin_are_pruned_with_the_prediction_and_the_reason():
    big = estimate(BIG, WORKLOAD, HARDWARE)
    budget = int(big.peak_bytes / (1 + UNCALIBRATED_MARGIN)) - 1  # just beyond the margin
    pruned = Pruner(WORKLOAD, HARDWARE, budget).check(BIG, "deepspeed")
    assert pruned.status == "pruned" and pruned.backend == "deepspeed" and pruned.wall_time_s == 0
    assert pruned.extra["predicted_peak_bytes"] == big.peak_bytes
    assert pruned.extra["predicted_memory"] == big.memory.to_dict() and pruned.extra["pruning_margin"] == UNCALIBRATED_MARGIN
    assert "25% safety margin" in pruned.error and f"largest term: {big.memory.dominant}" in pruned.error
    # Within the margin it runs: the estimator may be over-predicting.
    assert Pruner(WORKLOAD, HARDWARE, int(big.peak_bytes / 1.2)).check(BIG, "deepspeed") is None


def measured(config: Config, peak: int) -> TrialResult:
    return TrialResult(config, "ok", throughput_samples_per_s=1.0, step_time_s=16.0, peak_memory_bytes=peak)


def test_margin_adapts_once_the_estimator_is_calibrated():
    pruner = Pruner(WORKLOAD, HARDWARE, 2**30)
    cal = Calibration(memory_scale=1.1, samples=2)
    predicted = [estimate(c, WORKLOAD, HARDWARE, cal).peak_bytes for c in (SMALL, BIG)]
    # The calibrated estimator over-predicts the second config by 10%, the first not at all.
    results = [measured(SMALL, predicted[0]), measured(BIG, int(predicted[1] / 1.10))]
    assert pruner.recalibrated(Calibration(), results).margin == UNCALIBRATED_MARGIN  # no calibration yet
    adapted = pruner.recalibrated(cal, results)
    assert adapted.calibration == cal and abs(adapted.margin - 0.10) < 1e-3
    exact = pruner.recalibrated(cal, [measured(SMALL, predicted[0])])
    assert exact.margin == MIN_MARGIN
    wild = pruner.recalibrated(cal, [measured(BIG, predicted[1] // 2)])
    assert wild.margin == UNCALIBRATED_MARGIN


def test_an_out_of_memory_result_prunes_bigger_configs():
    pruner = Pruner(WORKLOAD, HARDWARE, 100 * 2**30).with_out_of_memory(Config(2, 4, 0, "bf16"))
    assert "z2 mb4 ck0 bf16 ran out of memory" in pruner.check(Config(2, 8, 0, "bf16"), "simulated").error
    assert pruner.check(Config(2, 4, 0, "fp32"), "simulated") is not None  # fp32 needs more
    assert pruner.check(Config(2, 2, 0, "bf16"), "simulated") is None  # smaller: still worth a try
    # Other layouts: pruned only from OTHER_LAYOUT_SLACK above the failed config's prediction, as the
    # estimator's errors differ a little between layouts.
    failed = estimate(Config(2, 4, 0, "bf16"), WORKLOAD, HARDWARE).peak_bytes
    checked = 0
    for config in Space(load_choices("cpu"), WORKLOAD, HARDWARE):
        if layout(config) == layout(Config(2, 4, 0, "bf16")):
            continue
        peak = estimate(config, WORKLOAD, HARDWARE).peak_bytes
        assert (pruner.check(config, "simulated") is not None) == (peak >= failed * (1 + OTHER_LAYOUT_SLACK)), config
        checked += 1
    assert checked > 100


class Cliff:
    """Runs out of memory from micro-batch 4 up, whatever the estimator thinks."""

    name = "simulated"

    def __init__(self):
        self.ran: list[Config] = []

    def run(self, config: Config) -> TrialResult:
        self.ran.append(config)
        if config.micro_batch >= 4:
            return TrialResult(config, "oom", peak_memory_bytes=3 * 2**30, backend=self.name, error="oom")
        return measured(config, 2**30)


def test_sweep_never_launches_what_an_earlier_out_of_memory_rules_out():
    space = Space(load_choices("cpu"), WORKLOAD, HARDWARE)
    budget = 2 * 2**30
    backend = Cliff()
    pruner = Pruner(WORKLOAD, HARDWARE, budget)
    record: list[TrialResult] = []
    sweep = Sweep(make_strategy("random", SearchContext(space, budget, 1)), pruner, record.append, "simulated",
                  space_size=len(space))
    run_local(sweep, backend, Budget(10**6), QuietProgress())
    ooms = [r.config for r in record if r.status == "oom"]
    assert ooms and len(backend.ran) < len(space)
    for config in backend.ran:  # nothing launched after a smaller config of its layout ran out of memory
        earlier = backend.ran[: backend.ran.index(config)]
        assert not any(o in earlier and o.micro_batch <= config.micro_batch and o.precision == config.precision
                       and (o.zero_stage, o.ckpt_interval, o.offload_optimizer, o.offload_param)
                       == (config.zero_stage, config.ckpt_interval, config.offload_optimizer, config.offload_param)
                       for o in ooms)
    assert any("ran out of memory" in (r.error or "") for r in record if r.status == "pruned")
    # A resumed sweep remembers: the recorded out-of-memory results rebuild the same pruner.
    resumed = Sweep(make_strategy("random", SearchContext(space, budget, 1)), pruner, [].append, "simulated", record)
    assert resumed.pruner.out_of_memory == frozenset(ooms)
