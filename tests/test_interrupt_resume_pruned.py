"""Ctrl-C, then --resume, loses no config from the record: the resumed trials.jsonl holds the configs an uninterrupted
sweep records, each once, with the same outcome.

The case that lost them: llama-70b on one 40 GiB device, where the first trial shows that the offloaded state needs
more host memory than the node has, after which no config of the space is predicted to fit. An uninterrupted
sweep goes on recording every config its strategy proposes as pruned until the strategy ends; a resume stopped at
its start ("nothing fits", Sweep.refused_at_start), so every config the interrupted session had not reached was
missing (`autotune sweep examples/sweep.yaml` interrupted at 25 s: 539 of 540 lines). And a resumed Optuna study
counted the proposals it had refused as unlikely to fit (never run nor recorded) as tried, so the resumed search
never reached them. The interrupt comes at a chosen moment: at the Nth line written to trials.jsonl, or at the
Nth proposal asked of the Optuna study."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import optuna
import pytest

import autotune
from autotune import TuneSpec, make_workload
from autotune.api import resolve
from autotune.drivers.sweep import Sweep
from autotune.drivers.stop import StopReason
from autotune.search.rundir import RunDir
from autotune.strategies.optuna_search import UNLIKELY, OptunaStrategy
from autotune.values.config import Config
from autotune.values.results import read_results

# The first trial (ZeRO 3, both states offloaded: the only layout predicted to fit the device) runs out of host
# memory; then every config is pruned, each recorded with its reason.
SPACE = """\
zero_stage: [0, 1, 2, 3]
micro_batch: [1, 4]
ckpt_interval: [0, 1]
precision: [bf16]
offload_optimizer: [none, cpu]
offload_param: [none, cpu]
nvme_path: null
"""


def spec(tmp_path: Path, strategy: str = "optuna") -> TuneSpec:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return TuneSpec(make_workload("llama-70b", 8, 1), "a100-40gb", memory_budget_bytes=40 * 2**30,
                    strategy=strategy, backend="simulated", trials=16, space=str(space))


def record(run: Path) -> list[tuple[Config, str]]:
    return [(r.config, r.status) for r in read_results(run / "trials.jsonl")]


def interrupted_at(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, n: int,
                   after: bool = False) -> Callable[[], None]:
    """`owner.name` raises KeyboardInterrupt (Ctrl-C) at its `n`th call (`after`: once that call is done); returns
    what restores it."""
    original = getattr(owner, name)
    calls = [0]

    def interrupting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n and not after:
            raise KeyboardInterrupt
        done = original(*args, **kwargs)
        if calls[0] == n:
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(owner, name, interrupting)
    return lambda: monkeypatch.setattr(owner, name, original)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], list[tuple[Config, str]]]:
    """The uninterrupted sweep's record of a strategy, guided or not: each made once for this module's tests."""
    made: dict[tuple[str, bool], list[tuple[Config, str]]] = {}

    def record_of(strategy: str, guided: bool) -> list[tuple[Config, str]]:
        if (strategy, guided) not in made:
            folder = tmp_path_factory.mktemp("whole")
            with pytest.MonkeyPatch.context() as patch:
                if not guided:
                    patch.setattr(OptunaStrategy, "_guided", lambda self: None)
                autotune.tune(spec(folder, strategy), folder / "whole")
            made[strategy, guided] = record(folder / "whole")
        return made[strategy, guided]

    return record_of


def interrupt_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expected: list[tuple[Config, str]],
                         owner: Any, name: str, n: int, strategy: str = "optuna") -> None:
    """The uninterrupted sweep's record `expected`, and the record of the same sweep interrupted at the `n`th call of
    `owner.name` and resumed: the same configs, each once, with the same outcomes, in the same order."""
    assert len(expected) > 30 and Counter(s for _, s in expected)["oom"] == 1  # one trial, the rest pruned

    run = tmp_path / "interrupted"
    restore = interrupted_at(monkeypatch, owner, name, n)
    first = autotune.tune(spec(tmp_path, strategy), run)
    restore()
    assert first.stop_reason is StopReason.INTERRUPTED
    assert 0 < len(record(run)) < len(expected)  # interrupted with configs left to record

    resumed = autotune.tune(spec(tmp_path, strategy), run, resume=True)
    got = record(run)
    configs = [c for c, _ in got]
    assert len(configs) == len(set(configs)), "a config recorded twice"
    missing = {c.label() for c, _ in expected} - {c.label() for c in configs}
    assert not missing, f"lost from the record after the resume: {sorted(missing)}"
    assert sorted(got, key=lambda p: p[0].label()) == sorted(expected, key=lambda p: p[0].label())
    assert got == expected  # and in the same order: the same seed, the same sweep (tests/test_resume_same_sweep.py)
    assert resumed.stop_reason is StopReason.NOTHING_FITS


@pytest.mark.parametrize("strategy", ["optuna", "hybrid"])
@pytest.mark.parametrize("n", [2, 20])
def test_a_resume_records_every_config_the_interrupted_session_had_not_reached(tmp_path, monkeypatch, uninterrupted,
                                                                              n, strategy):
    """Interrupted at the nth line of trials.jsonl (the oom is the first, each pruned config one more). The hybrid's
    policy has its turns among the pruned configs (each of its proposals refused as unlikely to fit, or pruned)."""
    interrupt_and_resume(tmp_path, monkeypatch, uninterrupted(strategy, True), RunDir, "append", n, strategy)


@pytest.mark.parametrize("n", [5, 9])
def test_a_resumed_optuna_study_does_not_count_its_refused_proposals_as_tried(tmp_path, monkeypatch, uninterrupted, n):
    """Every turn TPE's (no guided pick): each sampled proposal unlikely to fit is refused (told to the study, not
    recorded) and the nearest untried config runs in its place (here, pruned); the refused configs stay untried,
    and later proposals reach them. Interrupted at the nth proposal asked of the study, the resumed search must
    reach them too."""
    expected = uninterrupted("optuna", False)
    monkeypatch.setattr(OptunaStrategy, "_guided", lambda self: None)
    interrupt_and_resume(tmp_path, monkeypatch, expected, optuna.Study, "ask", n)


def test_a_resumed_study_keeps_a_refused_proposal_untried(tmp_path, monkeypatch):
    """The strategy's own state: what a refused proposal is in the session that refused it (untried), it is in a
    study loaded by a resumed sweep."""
    monkeypatch.setattr(OptunaStrategy, "_guided", lambda self: None)
    run = tmp_path / "run"
    restore = interrupted_at(monkeypatch, optuna.Study, "ask", 7)
    autotune.tune(spec(tmp_path), run)
    restore()
    study = optuna.load_study(study_name="autotune", storage=f"sqlite:///{run / 'study.db'}")
    refused = {t.user_attrs["config"] for t in study.trials if t.user_attrs.get("status") == UNLIKELY}
    recorded = {c.label() for c, _ in record(run)}
    assert refused - recorded, "no refused proposal left unrecorded: the case is not tested"

    run_dir = RunDir(run)
    sweep = Sweep.open(run_dir, run_dir.read_settings(), resolve(spec(tmp_path))[1])
    tried = {c.label() for c in sweep.strategy.outcomes}  # type: ignore[attr-defined]
    assert tried == recorded


def test_ctrl_c_just_after_a_trials_line_is_written_is_counted_by_the_outputs(tmp_path, monkeypatch):
    """The interrupt lands after the second trial's line is durable and before the sweep's own list holds it (a closed
    terminal's SIGHUP did, in CI): summary.json, stop.json and the result count what the record holds."""
    interrupted_at(monkeypatch, RunDir, "append", 2, after=True)
    run = tmp_path / "run"
    result = autotune.tune(spec(tmp_path), run)
    lines = len(record(run))
    assert result.stop_reason is StopReason.INTERRUPTED and lines == 2 == len(result.results)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trials"] == lines and json.loads((run / "stop.json").read_text())["trials"] == lines
