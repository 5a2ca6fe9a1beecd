"""Every trial proves it trained (issue 40): the ledger of a rank's optimizer steps and its verdicts, DeepSpeed's own
loss scaler driven to its end, and the records of both H200 runs whose fp16 trials never stepped, recognized."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autotune.backends.replay import ReplayBackend, load_surface
from autotune.values.results import (FLAT, NONFINITE, OVERFLOW, TrialResult, as_recorded_proves, read_results,
                                     relabel_note, relabelled)
from autotune.worker.measure import MAX_STEPS, MeasureSettings, stop_reason
from autotune.worker.training import (FLAT_STEPS_16BIT, SETTLE_STEPS, TRAINING_EVIDENCE, Ledger, Untrained,
                                      scaler_gave_up, sixteen_bit)

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "gpu-runs"


# -- the ledger ----------------------------------------------------------------------------------------------

def test_warm_up_lasts_until_a_step_was_applied():
    ledger = Ledger(fp16=True)
    assert ledger.warming(1)  # no step yet
    scale = 2.0**16
    for _ in range(5):  # the scaler's search for its scale: skipped steps
        ledger.record(False, 10.4, scale)
        scale /= 2
        assert ledger.warming(1)
    ledger.record(True, 10.4, scale)
    assert not ledger.warming(1) and ledger.first_applied == 6 and ledger.skipped == 5
    ledger.record(True, 10.1, scale, measuring=True)
    assert ledger.verdict() is None


def test_warm_up_takes_at_least_one_step_even_when_none_is_asked():
    ledger = Ledger()
    assert ledger.warming(0)
    ledger.record(True, 5.0, None)
    assert not ledger.warming(0)


def test_a_scaler_at_its_minimum_still_skipping_is_untrained():
    ledger = Ledger(fp16=True)
    ledger.record(False, 10.0, 2.0)
    assert ledger.warming(1)
    ledger.record(False, 10.0, 1.0)
    with pytest.raises(Untrained) as caught:
        ledger.warming(1)
    assert caught.value.fault == OVERFLOW and "every one of 2 optimizer steps overflowed" in str(caught.value)
    assert caught.value.evidence["steps_skipped"] == 2 and caught.value.evidence["steps_applied"] == 0


def test_warm_up_is_bounded_when_the_scale_is_unknown():
    ledger = Ledger(fp16=True)  # fp16 whose optimizer shows no scale (outside fp16 a skipped step ends warm-up at once)
    for _ in range(1 + SETTLE_STEPS - 1):
        ledger.record(False, 10.0, None)
        assert ledger.warming(1)
    ledger.record(False, 10.0, None)
    with pytest.raises(Untrained):
        ledger.warming(1)


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("losses, fault", [
    ([], OVERFLOW), ([8.3, math.nan, 8.1], NONFINITE), ([8.3, math.inf], NONFINITE), ([8.3, 8.3, 8.3], FLAT),
    ([8.3, 8.2], None), ([8.3], None)])
def test_verdicts(losses, fault, fp16):
    if not losses and not fp16:
        fault = NONFINITE  # no loss scaler: a skipped step's gradients were not finite, never an overflow
    ledger = Ledger(fp16=fp16)
    for loss in losses:
        ledger.record(True, loss, None)
    if not losses:
        ledger.record(False, 8.3, None)
    verdict = ledger.verdict()
    assert (verdict[0] if verdict else None) == fault
    if verdict:
        assert "\n" not in verdict[1]


def _verdict(losses):
    ledger = Ledger()
    for loss in losses:
        ledger.record(True, loss, None)
    verdict = ledger.verdict()
    return verdict[0] if verdict else None


def test_a_bf16_loss_on_one_quantum_is_not_flat_over_a_few_steps():
    """`autotune trial --script plain_ckpt.py --zero-stage 3 --micro-batch 8 --precision bf16 --offload-param cpu`:
    bf16 holds a loss near 6.4 in steps of 2^-5, so one that trains printed 6.4375 four times, then 5.7188."""
    torch = pytest.importorskip("torch")
    bf16 = [float(torch.tensor(v, dtype=torch.bfloat16).float()) for v in (6.44, 6.45, 6.43, 6.4375)]
    assert set(bf16) == {6.4375} and sixteen_bit(bf16) == "bf16"
    assert _verdict(bf16) is None
    assert _verdict([6.4375] * 4 + [5.71875]) is None
    fp16 = [float(torch.tensor(6.4401, dtype=torch.float16).float())] * 4
    assert sixteen_bit(fp16) == "fp16" and _verdict(fp16) is None


def test_an_fp32_loss_that_never_moves_is_flat_over_the_same_steps():
    fp32 = [6.437712669372559] * 4  # a value of fp32, exact in neither 16-bit format
    assert sixteen_bit(fp32) is None and _verdict(fp32) == FLAT
    assert _verdict([6.437712669372559] * 2) == FLAT


def test_a_16_bit_loss_that_never_moves_over_enough_steps_is_flat():
    assert _verdict([6.4375] * (FLAT_STEPS_16BIT - 1)) is None
    assert _verdict([6.4375] * FLAT_STEPS_16BIT) == FLAT
    ledger = Ledger()
    for _ in range(FLAT_STEPS_16BIT):
        ledger.record(True, 0.0, None)  # a constant loss
    assert ledger.verdict()[0] == FLAT and "held in bf16" in ledger.verdict()[1]


def test_sixteen_bit_formats():
    assert sixteen_bit([6.4375, 5.71875]) == "bf16" and sixteen_bit([1.0 + 2**-10]) == "fp16"
    assert sixteen_bit([8.3]) is None and sixteen_bit([1e6 + 1]) is None and sixteen_bit([1e39]) is None
    assert sixteen_bit([]) is None


def test_evidence_is_json_even_for_a_loss_that_is_not_finite():
    ledger = Ledger(fp16=True)
    ledger.record(True, math.nan, 1024.0)
    evidence = ledger.evidence()
    assert set(evidence) == set(TRAINING_EVIDENCE)
    assert json.loads(json.dumps(evidence, allow_nan=False))["loss_first"] is None


def test_a_loss_never_passed_is_not_judged():
    """A script that never hands its loss to engine.backward: the steps count, no loss verdict is made."""
    ledger = Ledger()
    for _ in range(3):
        ledger.record(True, None, None)
    assert ledger.verdict() is None and ledger.evidence()["loss_first"] is None


def _run(fp16, steps, warmup_steps=1):
    """A ledger as a rank keeps it: warm-up while `warming`, then measured steps; `steps`: (applied, loss) each."""
    ledger = Ledger(fp16=fp16)
    measuring = False
    for applied, loss in steps:
        ledger.record(applied, loss, 1024.0 if fp16 else None, measuring)
        measuring = measuring or not ledger.warming(warmup_steps)
    return ledger


@pytest.mark.parametrize("fp16", [False, True])
def test_a_loss_that_goes_nan_mid_run_is_not_a_measurement(fp16):
    """The review's script: its loss NaN from step 6 of 10. In fp32 and bf16 DeepSpeed's ZeRO skips those steps (not
    finite gradients), and the trial was recorded ok: 5 applied, 5 skipped, loss_last the last finite loss. In fp16 a
    NaN on an applied step (ZeRO-0 applies it) is no more a measurement."""
    losses = [10.0, 9.5, 9.1, 8.8, 8.6] + [math.nan] * 5
    ledger = _run(False, [(loss == loss, loss) for loss in losses])
    assert (ledger.applied, ledger.skipped) == (5, 5)
    fault, message = ledger.verdict()
    assert fault == NONFINITE and "the loss was nan at step 6 of 10" in message and "overflow" not in message
    assert "5 of 10 steps skipped" in message and "the last step's loss nan" in message and "\n" not in message
    evidence = ledger.evidence()
    assert evidence["loss_first"] == 10.0 and evidence["loss_last"] is None  # the last step's loss: NaN, not 8.6
    record = TrialResult.from_dict({"config": {"zero_stage": 2, "micro_batch": 2, "ckpt_interval": 0,
                                               "precision": "bf16"}, "status": "untrained", "backend": "deepspeed",
                                    "error": message, "fault": fault, **evidence})
    assert json.loads(record.to_json())["loss_last"] is None  # trials.jsonl stays JSON (no NaN token)
    applied = _run(fp16, [(True, loss) for loss in losses])  # a NaN loss the optimizer applied
    assert applied.verdict()[0] == NONFINITE and "the loss was nan at step 6 of 10" in applied.verdict()[1]


def test_outside_fp16_any_skipped_step_is_not_a_measurement():
    """fp32 and bf16 have no loss scaler: a skipped step had gradients that were not finite, whatever its loss."""
    ledger = _run(False, [(True, 10.0), (True, 9.0), (False, 8.5), (True, 8.0)])
    fault, message = ledger.verdict()
    assert fault == NONFINITE and "step 3 of 4 was skipped, its gradients not finite (its loss 8.5" in message
    assert ledger.evidence()["loss_last"] == 8.0
    assert _run(True, [(True, 10.0), (True, 9.0), (False, 8.5), (True, 8.0)]).verdict() is None  # fp16: an overflow


def test_a_nan_loss_from_the_first_step_in_bf16_is_named_so_never_an_overflow():
    """The review's bf16 script, NaN from step 1: it read 'every one of 10 optimizer steps overflowed', fault
    overflow, loss_first null. Warm-up now ends at the first such step; the verdict says what happened."""
    ledger = Ledger()
    ledger.record(False, math.nan, None)
    with pytest.raises(Untrained) as caught:
        ledger.warming(1)
    assert caught.value.fault == NONFINITE and "the loss was nan at step 1 of 1" in str(caught.value)
    for _ in range(9):  # a script that runs its steps anyway: the shim's verdict at its end
        ledger.record(False, math.nan, None)
    fault, message = ledger.verdict()
    assert fault == NONFINITE and "the loss was nan at step 1 of 10" in message and "overflow" not in message
    assert "10 of 10 steps skipped" in message and ledger.evidence()["steps_applied"] == 0


def test_fp16_skipped_steps_in_warm_up_are_normal_but_a_stuck_scaler_is_not():
    warm_up = [(False, 10.4)] * 4 + [(True, 10.4)]  # the scaler's search for its scale, then an applied step
    trained = _run(True, warm_up + [(True, 10.2), (False, 10.1), (True, 10.0), (True, 9.8)])
    assert trained.verdict() is None and trained.skipped == 5 and trained.measured == 4
    assert _run(True, warm_up + [(True, 10.2), (False, math.inf), (False, 10.1), (True, 9.8)]).verdict() is None
    # loss_first: where training started (the first applied step; the worker's overflow fault makes the skipped
    # steps' losses inf); loss_last: the last step's, applied or not.
    scaled = _run(True, [(False, math.inf)] * 3 + [(True, 10.4), (True, 10.2), (False, 10.1)])
    assert (scaled.evidence()["loss_first"], scaled.evidence()["loss_last"]) == (10.4, 10.1)
    # The last STUCK_STEPS steps skipped: the scaler overflows still at half the scale the run trained at.
    stuck = _run(True, warm_up + [(True, 10.2), (True, 10.0), (True, 9.9)] + [(False, 9.9)] * 3)
    fault, message = stuck.verdict()
    assert fault == OVERFLOW and "3 of the 6 measured optimizer steps overflowed" in message
    assert "the last 3 in a row" in message and "did not settle" in message
    # Most of the measured steps skipped, none STUCK_STEPS in a row.
    mostly = _run(True, warm_up + [(False, 10.2), (True, 10.1), (False, 10.0), (False, 10.0), (True, 9.9)])
    assert mostly.verdict()[0] == OVERFLOW and "3 of the 5 measured" in mostly.verdict()[1]
    # A loss not finite on an applied step is no overflow: nonfinite, as outside fp16.
    assert _run(True, warm_up + [(True, math.nan), (True, 9.9)]).verdict()[0] == NONFINITE


def test_skipped_steps_in_the_measurement_count_towards_its_limit():
    settings = MeasureSettings(min_steps=3, max_steps=5, rel_tol=0.0)
    assert stop_reason([1.0, 1.0], 2.0, settings, skipped=2) is None
    assert stop_reason([1.0, 1.0], 2.0, settings, skipped=3) == MAX_STEPS


def test_deepspeeds_own_scaler_driven_to_its_minimum_is_recognized(monkeypatch):
    """DeepSpeed's DynamicLossScaler, from 2^16 as our configs start it (autotune.values.dsconfig), overflowing every
    step: it halves to its minimum and then raises; the worker reads that as every step overflowed. (Its log lines
    ask for the rank: rank 0, without a process group.)"""
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)

    from autotune.values.dsconfig import FP16_LOSS_SCALING

    scaling = FP16_LOSS_SCALING
    scaler = DynamicLossScaler(init_scale=2.0**scaling["initial_scale_power"], scale_window=scaling["loss_scale_window"],
                               min_scale=scaling["min_loss_scale"], delayed_shift=scaling["hysteresis"],
                               consecutive_hysteresis=False)
    ledger = Ledger(fp16=True)
    with pytest.raises(Exception) as caught:
        for _ in range(100):
            scaler.update_scale(True)
            ledger.record(False, 10.4, scaler.loss_scale)
            if ledger.loss_scale > 1:
                assert ledger.warming(1)
    assert scaler_gave_up(caught.value)
    # One overflow spends the hysteresis, 16 halve 2^16 to 1; the next raised. The worker stops at scale 1 already.
    assert ledger.steps == scaling["hysteresis"] - 1 + scaling["initial_scale_power"] and ledger.loss_scale == 1
    with pytest.raises(Untrained):
        ledger.warming(1)
    assert not scaler_gave_up(RuntimeError("Current loss scale already at minimum"))  # raised elsewhere: not it


# -- old records -------------------------------------------------------------------------------------------

def _ok(**extra):
    return TrialResult.from_dict({"config": {"zero_stage": 2, "micro_batch": 2, "ckpt_interval": 0, "precision": "fp16"},
                                  "status": "ok", "throughput_samples_per_s": 3.6, "step_time_s": 2.2,
                                  "peak_memory_bytes": 22 * 10**9, "backend": "deepspeed", **extra})


def test_an_old_record_whose_loss_never_moved_is_read_as_untrained():
    old = as_recorded_proves(_ok(loss_first=10.43, loss_last=10.43))
    assert old.status == "untrained" and old.extra["fault"] == OVERFLOW and old.extra["recorded_status"] == "ok"
    assert old.throughput_samples_per_s is None and old.peak_memory_bytes == 22 * 10**9  # kept, for the record
    assert "never moved" in old.error
    assert as_recorded_proves(_ok(loss_first=10.43, loss_last=9.8)).ok  # it trained
    assert as_recorded_proves(_ok()).ok  # no loss recorded (simulated, replayed): nothing to judge
    # A record with step counts was judged by its own trial: left as it is.
    assert as_recorded_proves(_ok(loss_first=10.4, loss_last=10.4, steps_applied=3, steps_skipped=0)).ok
    assert json.loads(old.to_json())["status"] == "untrained"


def test_the_h200_runs_fp16_trials_are_recognized_and_no_other():
    """The runs' files (benchmarks/gpu-runs): the 11-26 kit's two llama-3b fp16 trials and each tune's fp16 trial
    were recorded ok with loss_first == loss_last; the 11-27 30-step fp16 trial crashed when the scaler gave up. On
    11-30 (the model's RMSNorm in fp32) every fp16 trial trained: each step applied, its loss moving."""
    found, fp16_trained = {}, 0
    for path in sorted(RUNS.glob("h200-*/**/*.jsonl")):
        if path.name.endswith("events.jsonl") or {"work", "logs"} & set(path.relative_to(RUNS).parts):
            continue  # the kit's own copies and the ranks' event logs
        results = read_results(path)
        found[str(path.relative_to(RUNS))] = sorted((r.config.label(), r.extra.get("recorded_status"))
                                                     for r in results if r.status == "untrained")
        for r in results:
            if r.status == "ok" and r.config.precision == "fp16":
                assert path.relative_to(RUNS).parts[0] == "h200-2026-11-30", (path, r.config.label())
                assert r.extra["steps_skipped"] == 0 and r.extra["steps_applied"] >= 3
                fp16_trained += 1
            if r.status == "ok":
                assert r.extra["loss_first"] != r.extra["loss_last"]  # every remaining ok trial trained
    assert fp16_trained == 4  # the kit's surfaces; its tune's fp16 trial is in work/ (kit.md: fp16_trained 5)
    assert found == {
        "h200-2026-11-26/kit/surfaces/h200-llama-1b.jsonl": [],
        "h200-2026-11-26/kit/surfaces/h200-llama-3b.jsonl": [("z3 mb16 ck1 fp16 oo=cpu op=cpu", "ok"),
                                                             ("z3 mb32 ck1 fp16 oo=cpu op=cpu", "ok")],
        "h200-2026-11-26/tune/trials.jsonl": [("z3 mb4 ck2 fp16 oo=cpu", "ok")],
        "h200-2026-11-27/fp16-trial/trials.jsonl": [("z2 mb2 ck0 fp16", "crash")],
        "h200-2026-11-27/kit/h200-llama-1b.jsonl": [],
        "h200-2026-11-27/tune/trials.jsonl": [("z3 mb4 ck2 fp16 oo=cpu", "ok")],
        "h200-2026-11-30/kit/h200-llama-1b.jsonl": [],
        "h200-2026-11-30/kit/h200-llama-3b.jsonl": [],
        "h200-2026-11-30/tune/trials.jsonl": [],
    }
    single = json.loads((RUNS / "h200-2026-11-27" / "fp16-trial" / "trial-12-steps.json").read_text())["result"]
    assert as_recorded_proves(TrialResult.from_dict(single)).status == "untrained"


def test_a_replayed_surface_says_so_once_and_never_replays_them_as_measurements(tmp_path):
    path = RUNS / "h200-2026-11-26" / "kit" / "surfaces" / "h200-llama-3b.jsonl"
    surface = load_surface(path)
    assert surface.notes == (relabel_note(2, path),) and "2 fp16 trial(s)" in surface.notes[0]
    backend = ReplayBackend(surface)
    assert backend.notes == surface.notes
    fp16 = [c for c in surface.configs if c.precision == "fp16"]
    assert len(fp16) == 2 and all(backend.run(c).status == "untrained" for c in fp16)
    assert surface.best(None).config.precision == "bf16"  # the optimum of the table is a trial that trained
    assert relabelled(surface.results.values()) == 2 and relabel_note(0, path) is None


def test_the_gpu_kit_reports_what_each_trials_steps_did_and_wants_an_fp16_trial_that_trained():
    """The kit (benchmarks/gpu_kit.py) tunes fp16 beside bf16 on a GPU and reports each trial's steps; on the 11-27
    run's tune it finds the fp16 trial untrained and the bf16 one trained, so its fp16 check is not met."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_kit
    import kit_plan

    assert "fp16" in gpu_kit.TUNE_GPU_CHOICES.precision
    rows = gpu_kit.training([RUNS / "h200-2026-11-27" / "tune" / "trials.jsonl"])
    assert [(r["config"], r["status"], gpu_kit.trained(r)) for r in rows] == [
        ("z2 mb8 ck4 bf16 oo=cpu", "ok", True), ("z3 mb4 ck2 fp16 oo=cpu", "untrained", False)]
    plan = kit_plan.plan_call(540, kit_plan.GPU_OVERHEADS, [], tune_trial_s=25)
    checks = gpu_kit.checks(gpu_kit.GPU_KIT, plan, {}, {}, 500.0, 8, rows)
    assert not checks["fp16_trained"]["met"] and checks["ok_trials_trained"]["met"]
    table = gpu_kit.kit_markdown({"command": "c", "machine": "m", "hardware": "h200", "seconds": 1.0, "limit_s": 9.0,
                                  "phases": [], "checks": checks, "plan": plan.to_dict(), "recording": {},
                                  "tune": {}, "training": rows})
    assert "| 11-27 |" not in table and "| tune | z3 mb4 ck2 fp16 oo=cpu | untrained (overflow) | None |" in table
    # Each trial's launch to its first measured step; none of the 11-27 trials ran on ranks started ahead.
    assert [r["import_ahead_s"] for r in rows] == [None, None] and all(r["first_step_s"] > 10 for r in rows)
    assert "| launch to 1st step | initialize | imports made ahead |" in table
    assert all(r["initialize_s"] > 5 for r in rows)  # 11-27's initialize: 20.5-29.1 s with the optimizer offloaded


def _records(data):
    """Every result or rank record in a JSON value (a record, or one under `result`)."""
    if isinstance(data, dict):
        if "status" in data:
            yield data
        if isinstance(data.get("result"), dict):
            yield from _records(data["result"])


def test_no_committed_gpu_record_holds_a_trial_that_never_stepped_as_a_measurement(tmp_path, capsys):
    import shutil
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import prove_gpu_runs

    files = [p for p in RUNS.rglob("*") if p.suffix in (".json", ".jsonl") and not p.name.endswith(".events.jsonl")]
    for path in files:
        values = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
            if path.suffix == ".jsonl" else [json.loads(path.read_text())]
        for record in (r for v in values for r in _records(v)):
            moved = record.get("loss_first") is None or record.get("loss_first") != record.get("loss_last")
            assert record["status"] != "ok" or moved or "steps_applied" in record, path
    # The committed copies are already as they prove themselves: the rewrite changes nothing there.
    copy = tmp_path / "runs"
    shutil.copytree(RUNS, copy)
    assert prove_gpu_runs.main([str(copy)]) == 0 and f"0 of {len(files)} record files" in capsys.readouterr().out
    # A raw record and a rank's report, as the runs wrote them: rewritten, every other key kept.
    raw = _ok(loss_first=10.77, loss_last=10.77).to_dict()
    rank = {"status": "ok", "rank": 0, "loss_first": 10.77, "loss_last": 10.77, "peak_memory_bytes": 22 * 10**9}
    trained = _ok(loss_first=10.77, loss_last=9.1).to_dict()
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "t.jsonl").write_text(json.dumps(raw) + "\n" + json.dumps(trained) + "\n")
    (folder / "rank0.json").write_text(json.dumps(rank))
    assert prove_gpu_runs.main([str(folder)]) == 0
    first, second = (json.loads(line) for line in (folder / "t.jsonl").read_text().splitlines())
    assert first["status"] == "untrained" and first["recorded_status"] == "ok" and first["fault"] == OVERFLOW
    assert first["throughput_samples_per_s"] is None and "never moved" in first["error"]
    assert {k: v for k, v in first.items() if k not in prove_gpu_runs.PROVEN} == \
        {k: v for k, v in raw.items() if k not in prove_gpu_runs.PROVEN}
    assert second == trained
    assert json.loads((folder / "rank0.json").read_text()) == {**rank, "status": "untrained", "fault": OVERFLOW,
                                                                   "recorded_status": "ok"}
