"""The same seed, the same sweep (docs/tune.md), across a resume: a sweep interrupted at its k-th recorded trial and
resumed records what the uninterrupted sweep records, config for config and in order, wherever k falls.

`hybrid` broke this (the reviewer's command below, Ctrl-C or kill -9 at 3, 9 or 14 lines: every resumed record
differed from trial 16 on, the policy's first trial): a resumed hybrid rebuilt neither whose turn it was nor where the
policy's walk stood (the policy answered from the record behind Optuna's turns), nor the refusals of the policy's
proposals, which the forecast made as it stood then (configs measured earlier refused at 77-79% likely to fit), nor
Optuna's count of guided turns when a proposal was in flight; and Optuna's samplers (TPE, and the tie-breaking of the
nearest untried config) drew from generators seeded afresh. The interrupt comes at a chosen moment, as in
tests/test_interrupt_resume_pruned.py: Ctrl-C while the k-th line is written (the trial in flight, not recorded), or
just after it (recorded, its strategy not told)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import optuna
import pytest

from autotune.cli import main
from autotune.search.rundir import RunDir
from autotune.strategies.hybrid import GUIDED_TURNS, REFUSED_KEY
from autotune.strategies.optuna_search import OptunaStrategy
from autotune.values.results import read_results

TRIALS = 20  # the policy's first trial of its own is the 16th, its second the 18th
TPE_TRIALS = 12  # TPE's 8 random startup trials, then its own draws


def command(out: Path, strategy: str, *extra: str, trials: int = TRIALS) -> list[str]:
    return ["tune", "--model", "tiny", "--backend", "simulated", "--memory-budget", "850MiB", "--trials", str(trials),
            "--seed", "11", "--strategy", strategy, "--out", str(out), "--quiet", *extra]


def record(run: Path) -> list[str]:
    return [f"{r.config.label()} {r.status}" for r in read_results(run / "trials.jsonl")]


def interrupt_at(monkeypatch: pytest.MonkeyPatch, k: int, after: bool) -> None:
    """Ctrl-C at the k-th line written to trials.jsonl: before it is written, or just after."""
    original = RunDir.append
    calls = [0]

    def append(self: RunDir, result: Any) -> None:
        calls[0] += 1
        if calls[0] == k and not after:
            raise KeyboardInterrupt
        original(self, result)
        if calls[0] == k:
            raise KeyboardInterrupt

    monkeypatch.setattr(RunDir, "append", append)


def tpe_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every guided turn left to TPE (as where no config is worth its risk), so that the samplers draw."""
    def guided(self: OptunaStrategy) -> None:
        self.turn += bool(self.outcomes or self.pending)  # a turn taken, as the guided pick counts it
        return None

    monkeypatch.setattr(OptunaStrategy, "_guided", guided)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The run directory of a sweep never interrupted, run once per strategy in this module."""
    runs: dict[tuple[str, bool, int], Path] = {}

    def run(strategy: str, tpe: bool = False, trials: int = TRIALS) -> Path:
        key = (strategy, tpe, trials)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"whole-{strategy}") / "whole"
            with pytest.MonkeyPatch.context() as patch:
                if tpe:
                    tpe_turns(patch)
                assert main(command(out, strategy, trials=trials)) == 0
            runs[key] = out
        return runs[key]

    return run


def interrupted_and_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str, k: int,
                            after: bool = False, trials: int = TRIALS) -> list[str]:
    """The record of the sweep interrupted at the k-th line and resumed."""
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        interrupt_at(patch, k, after)
        assert main(command(run, strategy, trials=trials)) == 130
    assert len(record(run)) == k - (not after)
    assert main(command(run, strategy, "--resume", trials=trials)) == 0
    return record(run)


def study(run: Path) -> optuna.Study:
    return optuna.load_study(study_name="autotune", storage=f"sqlite:///{run / 'study.db'}")


def refusals(run: Path) -> Any:
    """The policy's refusals the hybrid's study keeps."""
    kept = study(run)
    return kept._storage.get_study_system_attrs(kept._study_id).get(REFUSED_KEY)


# Before Optuna's last guided turn (its 8th proposal in flight), at the hand-over (the policy's first turn), the
# reviewer's 14, the policy's first trial of its own in flight (after its refusals of configs measured earlier), and
# after it, the policy's second one next.
@pytest.mark.parametrize("k", [3, GUIDED_TURNS + 1, 14, 16, 17])
def test_a_resumed_hybrid_sweep_is_the_uninterrupted_one(tmp_path, monkeypatch, uninterrupted, k):
    whole = uninterrupted("hybrid")
    assert interrupted_and_resumed(tmp_path, monkeypatch, "hybrid", k) == record(whole)
    assert refusals(tmp_path / "run") == refusals(whole)


def test_the_hybrid_case_is_the_one_that_broke(uninterrupted):
    """The policy's trials and refusals come after the hand-over, among them refusals of configs measured earlier,
    which the resumed sweep's forecast could not decide again."""
    whole = uninterrupted("hybrid")
    by = {t.user_attrs["report_trial"]: t.user_attrs.get("proposed_by") for t in study(whole).trials
          if "report_trial" in t.user_attrs}
    assert [n for n, who in sorted(by.items()) if who == "policy"] == [16, 18]
    measured = [line.rsplit(" ", 1)[0] for line in record(whole)]
    assert any(label in measured[:15] for _, label, _ in refusals(whole))


def test_a_hybrid_sweep_interrupted_after_a_policy_trial_was_recorded_resumes_as_it_was(tmp_path, monkeypatch,
                                                                                       uninterrupted):
    """Ctrl-C between the record of the policy's trial and the strategy's hearing of it: the resumed sweep tells its
    study (as the record's) and goes on as the uninterrupted one."""
    whole = uninterrupted("hybrid")
    assert interrupted_and_resumed(tmp_path, monkeypatch, "hybrid", 16, after=True) == record(whole)


def test_a_hybrid_sweep_interrupted_twice(tmp_path, monkeypatch, uninterrupted):
    whole = uninterrupted("hybrid")
    run = tmp_path / "run"
    for k, resume in ((5, []), (12, ["--resume"])):  # 4 lines recorded, then 15: the policy's own first in flight
        with monkeypatch.context() as patch:
            interrupt_at(patch, k, after=False)
            assert main(command(run, "hybrid", *resume)) == 130
    assert main(command(run, "hybrid", "--resume")) == 0
    assert record(run) == record(whole)


def test_a_hybrid_study_kept_before_refusals_were_still_resumes(tmp_path, monkeypatch):
    """A study of a sweep begun before the policy's refusals were kept (no REFUSED_KEY): the replay infers them where
    the record says (a proposal neither recorded before nor next), and the sweep goes on, every config once."""
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        interrupt_at(patch, 17, after=False)
        assert main(command(run, "hybrid")) == 130
    before = record(run)
    kept = study(run)
    kept._storage.set_study_system_attr(kept._study_id, REFUSED_KEY, None)
    assert main(command(run, "hybrid", "--resume")) == 0
    after = record(run)
    assert after[:len(before)] == before and len(after) == TRIALS
    assert len({line.rsplit(" ", 1)[0] for line in after}) == TRIALS


@pytest.mark.parametrize("strategy, k", [("optuna", 6), ("rl", 10), ("random", 6), ("grid", 4)])
def test_the_other_strategies_resume_as_the_uninterrupted_sweep(tmp_path, monkeypatch, uninterrupted, strategy, k):
    whole = uninterrupted(strategy)
    assert interrupted_and_resumed(tmp_path, monkeypatch, strategy, k) == record(whole)


# Optuna during TPE's random startup and after it; hybrid on its first turns after the hand-over.
@pytest.mark.parametrize("strategy, k", [("optuna", 4), ("optuna", 10), ("hybrid", 11)])
def test_tpe_draws_after_a_resume_what_it_would_have_drawn(tmp_path, monkeypatch, uninterrupted, strategy, k):
    """TPE's proposals (and the nearest untried config's tie-breaks) depend on the generators' state: a resumed
    study sets it again from the study, rather than seeding it afresh (which drew the first session's first draws)."""
    whole = uninterrupted(strategy, tpe=True, trials=TPE_TRIALS)
    tpe_turns(monkeypatch)
    assert interrupted_and_resumed(tmp_path, monkeypatch, strategy, k, trials=TPE_TRIALS) == record(whole)
    assert "optuna" in {t.user_attrs.get("proposed_by") for t in study(whole).trials}  # TPE drew
