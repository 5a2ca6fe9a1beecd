"""Confirmation of close calls (autotune/search/confirm.py): the finalists, the repeats they get, the best median as
the pick; end to end on the simulated backend with noise (recorded repeats, resume mid-confirmation, a
SIGKILL mid-confirmation) and once with real DeepSpeed trials."""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autotune
from autotune.search import confirm
from autotune.backends.factory import SLEEP_ENV
from autotune.backends.simulated import SimulatedBackend
from autotune.cli import main
from autotune.values.config import Config, ConfigError
from autotune.drivers.local import run_local
from autotune.drivers.progress import QuietProgress
from autotune.drivers.sweep import Budget, Sweep
from autotune.search_spaces import load_choices
from autotune.values.space import Space
from autotune.strategies import make_strategy
from autotune.outputs.report import summarize
from autotune.values.results import TrialResult, read_results
from autotune.search.rundir import RunSettings

GiB = 2**30
BUDGET = 2 * GiB
A, B, C, D = Config(0, 8, 0, "bf16"), Config(1, 8, 0, "bf16"), Config(2, 8, 0, "bf16"), Config(3, 8, 0, "bf16")


def run(config: Config, throughput: float | None, trial: int, repeat_of: int | None = None, status: str = "ok",
        peak_gib: float = 1.0) -> TrialResult:
    extra: dict = {"trial": trial}
    if repeat_of is not None:
        extra.update(phase="confirm", repeat_of=repeat_of)
    return TrialResult(config, status, throughput_samples_per_s=throughput if status == "ok" else None,
                       tokens_per_s=throughput * 256 if status == "ok" and throughput else None,
                       step_time_s=16 / throughput if status == "ok" and throughput else None,
                       peak_memory_bytes=int(peak_gib * GiB), memory_budget_bytes=BUDGET, wall_time_s=10.0,
                       backend="deepspeed", extra=extra)


# -- the rules, on hand-made results


def test_the_pick_is_the_best_median_not_the_fastest_single_run():
    results = [run(A, 10.0, 1), run(B, 9.0, 2), run(C, 5.0, 3),
               run(A, 6.0, 4, repeat_of=1), run(B, 8.5, 5, repeat_of=2, peak_gib=1.3), run(A, 7.0, 6, repeat_of=1)]
    pick = confirm.recommend(results, BUDGET)
    assert pick.config == B and pick.throughput_samples_per_s == pytest.approx(8.75)
    assert pick.extra["trial"] == 2 and pick.extra["runs"] == 2 and pick.extra["throughput_runs"] == [9.0, 8.5]
    assert pick.peak_memory_bytes == int(1.3 * GiB)  # the highest peak of its runs: what to plan for
    assert pick.tokens_per_s == pytest.approx(8.75 * 256)
    assert pick.step_time_s == pytest.approx(16 / 8.75)  # the step of the median throughput, not a median of steps
    # Without repeats it is the fastest run itself; among equals the lower peak, then the smaller config (never the record's
    # order, which on a Ray cluster is the order trials finished in).
    single = [run(A, 10.0, 1), run(B, 10.0, 2), run(C, 11.0, 3, peak_gib=2.5)]  # C is over budget
    assert confirm.recommend(single, BUDGET) is single[0]
    assert confirm.recommend([run(C, 11.0, 1, peak_gib=2.5)], BUDGET) is None


def test_a_failed_repeat_counts_as_zero():
    results = [run(A, 10.0, 1), run(B, 9.0, 2), run(A, None, 3, repeat_of=1, status="oom", peak_gib=2.4),
               run(B, 9.2, 4, repeat_of=2), run(A, 10.5, 5, repeat_of=1)]
    cands = confirm.candidates(results, BUDGET)
    a = next(c for c in cands if c.config == A)
    assert a.throughputs == (10.0, 0.0, 10.5) and a.failed == 1 and a.median == 10.0
    # Two failures in three runs: no longer the pick, however fast its one good run.
    results.append(run(A, None, 6, repeat_of=1, status="crash"))
    assert confirm.recommend(results, BUDGET).config == B


def test_the_spread_is_the_prior_until_the_repeats_give_enough_degrees_of_freedom():
    one_pair = confirm.candidates([run(A, 10.0, 1), run(A, 8.0, 2, repeat_of=1)], BUDGET)
    prior = confirm.spread(one_pair, 0.1)
    assert prior.sigma == 0.1 and prior.dof == 0 and prior.typical == pytest.approx(math.expm1(confirm.TYPICAL * 0.1))
    assert confirm.spread(one_pair, None).dof == 1  # no prior: the one pair is all there is
    results = [run(A, 10.0, 1), run(A, 8.0, 2, repeat_of=1), run(A, 9.0, 3, repeat_of=1),
               run(B, 5.0, 4), run(B, 6.0, 5, repeat_of=4)]
    pooled = confirm.spread(confirm.candidates(results, BUDGET), 0.1)
    logs_a, logs_b = [math.log(x) for x in (10, 8, 9)], [math.log(x) for x in (5, 6)]
    squares = sum((x - statistics.mean(logs_a)) ** 2 for x in logs_a) + sum((x - statistics.mean(logs_b)) ** 2
                                                                           for x in logs_b)
    assert pooled.dof == 3 and pooled.sigma == pytest.approx(math.sqrt(squares / 3))
    assert "this run's repeats" in pooled.source
    assert confirm.MACHINE_SPREAD == pytest.approx(confirm.Spread(confirm.MACHINE_SIGMA, 0, "").typical)
    # The machine prior is the developers' CPU's, not a measurement of the machine at hand: said so.
    machine = confirm.spread(one_pair, confirm.MACHINE_SIGMA).source
    assert "prior" in machine and "this machine" not in machine


def test_finalists_are_within_the_spread_of_the_best_and_at_most_three():
    results = [run(A, 10.0, 1), run(B, 9.5, 2), run(C, 9.0, 3), run(D, 8.9, 4), run(Config(0, 4, 0, "bf16"), 7.0, 5)]
    cands = confirm.candidates(results, BUDGET)
    wide = confirm.Spread(confirm.MACHINE_SIGMA, 0, "")  # 13%: A, B, C, D are close; the 7.0 is not
    assert [c.config for c in confirm.finalists(cands, wide)] == [A, B, C]
    narrow = confirm.Spread(math.log(1.06) / confirm.TYPICAL, 0, "")  # 6%
    assert [c.config for c in confirm.finalists(cands, narrow)] == [A, B]
    assert [c.config for c in confirm.finalists(cands, confirm.Spread(0.0, 0, ""))] == [A]


def test_the_plan_runs_the_fewest_runs_first_and_keeps_a_slot_for_a_runner_up():
    sigma = confirm.MACHINE_SIGMA
    results = [run(A, 10.0, 1), run(B, 9.5, 2), run(C, 5.0, 3)]
    plan = confirm.plan(results, BUDGET, 2, sigma)
    assert [c.config for c in plan.finalists] == [A, B] and plan.wanted == 4 and plan.next == A
    # A repeat in flight counts as a run and is not proposed twice.
    plan = confirm.plan(results, BUDGET, 2, sigma, in_flight={A})
    assert plan.wanted == 3 and plan.next == B
    results += [run(A, 10.2, 4, repeat_of=1)]
    assert confirm.plan(results, BUDGET, 2, sigma).next == B  # B has fewer runs now
    # The best alone: its own repeats, and a slot for a runner-up its repeats may let into the window.
    alone = [run(A, 10.0, 1), run(C, 5.0, 2)]
    plan = confirm.plan(alone, BUDGET, 2, sigma)
    assert [c.config for c in plan.finalists] == [A] and plan.wanted == 4 and plan.next == A
    done = alone + [run(A, 9.8, 3, repeat_of=1), run(A, 10.1, 4, repeat_of=1)]
    plan = confirm.plan(done, BUDGET, 2, sigma)
    assert plan.wanted == 0 and plan.next is None
    # A lucky first run: once its repeats pull its median down, the runner-up is a finalist.
    lucky = [run(A, 14.0, 1), run(B, 10.0, 2), run(A, 9.0, 3, repeat_of=1), run(A, 9.4, 4, repeat_of=1)]
    plan = confirm.plan(lucky, BUDGET, 2, sigma)
    assert [c.config for c in plan.finalists] == [B, A] and plan.next == B
    assert confirm.plan(results, BUDGET, 0, sigma).wanted == 0


def test_the_reserve_is_capped_at_a_quarter_of_the_trials():
    results = [run(A, 10.0, 1), run(B, 9.5, 2), run(C, 9.4, 3)]
    assert confirm.reserve(results, BUDGET, 2, confirm.MACHINE_SIGMA, trials=40) == 6
    assert confirm.reserve(results, BUDGET, 2, confirm.MACHINE_SIGMA, trials=12) == 3
    results.append(run(A, 10.1, 4, repeat_of=1))
    assert confirm.reserve(results, BUDGET, 2, confirm.MACHINE_SIGMA, trials=12) == 2  # one of the 3 is spent
    assert confirm.reserve(results, BUDGET, 2, confirm.MACHINE_SIGMA, trials=3) == 0
    assert confirm.reserve(results, BUDGET, 0, confirm.MACHINE_SIGMA, trials=40) == 0


def test_the_trials_a_resume_needs_to_confirm_every_close_call():
    # A sweep of 3 trials without confirmation: --trials 3 + its 4 wanted repeats would leave confirmation one
    # (a quarter of 7) while the search could use the rest; the report's command asks for what it really takes.
    workload, hardware = autotune.make_workload("tiny"), autotune.load_hardware("cpu")
    sweep = Sweep.in_memory(Space(load_choices("cpu"), workload, hardware), BUDGET, "random", "simulated")
    sweep.launch_sigma = NOISE
    run_local(sweep, noisy(), Budget(3, confirm=0), QuietProgress())
    wanted = confirm.plan(sweep.results, BUDGET, 2, NOISE).wanted
    trials, search_first = confirm.trials_to_confirm(sweep.results, BUDGET, 2, NOISE)
    assert wanted >= 2 and trials == 3 + search_first + wanted and trials * confirm.SHARE >= wanted
    assert run_local(sweep, noisy(), Budget(trials, confirm=2), QuietProgress()) == "trials"
    assert sweep.launched == trials and confirm.plan(sweep.results, BUDGET, 2, NOISE).wanted == 0
    assert sum(not confirm.is_repeat(r) for r in sweep.results if r.status != "pruned") == 3 + search_first
    # A long sweep needs no more search: its trials are the repeats.
    many = [run(Config(z, mb, ck, "bf16"), 10.0 - 0.01 * i, i) for i, (z, mb, ck) in
            enumerate(((z, mb, ck) for z in (0, 1) for mb in (1, 2, 4, 8) for ck in (0, 1, 2)), 1)]
    assert confirm.trials_to_confirm(many, BUDGET, 2, confirm.MACHINE_SIGMA) == (24 + 6, 0)  # 3 finalists x 2


def test_how_sure_the_pick_is():
    clear = [run(A, 10.0, 1), run(B, 9.0, 2)] + [run(A, 10.0 + i / 10, 3 + i, repeat_of=1) for i in range(2)] \
        + [run(B, 9.0 + i / 10, 5 + i, repeat_of=2) for i in range(2)]
    result = confirm.confirmation(clear, BUDGET, confirm.MACHINE_SIGMA)
    assert result.pick.config == A and result.repeats == 4
    (versus,) = result.comparisons
    assert versus.wins == 9 and versus.pairs == 9  # every run of A beat every run of B
    assert result.spread.dof == 4 and result.probability > 0.95
    assert confirm.confidence_words(result.probability) == "sure"
    toss = [run(A, 10.0, 1), run(B, 9.9, 2), run(A, 8.0, 3, repeat_of=1), run(B, 10.5, 4, repeat_of=2),
            run(A, 11.0, 5, repeat_of=1), run(B, 8.2, 6, repeat_of=2)]
    result = confirm.confirmation(toss, BUDGET, confirm.MACHINE_SIGMA)
    assert result.probability < 0.6 and "toss-up" in confirm.confidence_words(result.probability)
    summary = result.to_dict()
    assert summary["repeat_trials"] == 4 and summary["finalists"][0]["trials"] == [1, 3, 5]
    assert json.loads(json.dumps(summary)) == summary


def test_confirmation_is_on_for_real_trials_and_off_for_simulations():
    assert confirm.default_repeats("deepspeed") == confirm.default_repeats("script") == 2
    assert confirm.default_repeats("simulated") == confirm.default_repeats("replay") == 0
    assert confirm.default_repeats("someone's objective") == 0
    assert confirm.prior_sigma("deepspeed") == confirm.MACHINE_SIGMA and confirm.prior_sigma("replay") == 0.0
    workload, hardware = autotune.make_workload("tiny"), autotune.load_hardware("cpu")
    assert confirm.prior_sigma("simulated", SimulatedBackend(workload, hardware, BUDGET, noise=0.2)) == 0.2


def test_a_bad_confirm_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="confirm -1"):
        spec(confirm=-1)
    with pytest.raises(ConfigError, match="confirm 1.5"):
        spec(confirm=1.5)
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--backend", "simulated", "--confirm", "-1", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2 and "--confirm" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# -- end to end on the simulated backend with noise (its noise is the prior spread)

NOISE = 0.15
TRIALS = 20


def spec(backend=None, trials: int = TRIALS, **changes) -> autotune.TuneSpec:
    workload, hardware = autotune.make_workload("tiny"), autotune.load_hardware("cpu")
    backend = backend if backend is not None else noisy()
    values = dict(workload=workload, hardware=hardware, memory_budget_bytes=BUDGET, strategy="optuna",
                  trials=trials, backend=backend, seed=3, confirm=2,
                  stop_when=0)  # these tests count trials: the convergence stop off (tests/test_convergence.py)
    return autotune.TuneSpec(**{**values, **changes})


def noisy(seed: int = 1) -> SimulatedBackend:
    return SimulatedBackend(autotune.make_workload("tiny"), autotune.load_hardware("cpu"), BUDGET, noise=NOISE,
                            seed=seed)


def check_confirmed_run(out: Path, trials: int) -> list[TrialResult]:
    """What every confirmed run holds: repeats recorded as such, the best median recommended everywhere."""
    results = read_results(out / "trials.jsonl")
    launched = [r for r in results if r.status != "pruned"]
    assert len(launched) == trials
    repeats = [r for r in results if confirm.is_repeat(r)]
    assert repeats, "nothing was confirmed"
    first_of = {}
    for number, r in enumerate(results, 1):
        assert r.extra["trial"] == number
        if confirm.is_repeat(r):
            original = results[r.extra["repeat_of"] - 1]
            assert original.config == r.config and not confirm.is_repeat(original)
        else:
            assert r.config not in first_of, "the search ran a config twice"
            first_of[r.config] = number
    runs: dict[Config, list[float]] = {}
    for r in launched:
        runs.setdefault(r.config, []).append(r.throughput_samples_per_s if r.fits(BUDGET) else 0.0)
    assert max(len(v) for v in runs.values()) <= 3  # 1 + confirm
    pick = max(runs, key=lambda c: (statistics.median(runs[c]), -first_of[c]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["config"] == pick.to_dict()
    assert summary["best"]["throughput_samples_per_s"] == pytest.approx(statistics.median(runs[pick]))
    assert summary["best_trial_index"] == first_of[pick]
    assert summary["confirmation"]["repeat_trials"] == len(repeats)
    assert summary["confirmation"]["finalists"][0]["config"] == pick.to_dict()
    ds = json.loads((out / "best_ds_config.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == pick.micro_batch
    assert ds["zero_optimization"]["stage"] == pick.zero_stage
    report = (out / "report.md").read_text()
    assert "## Confirmation of close calls" in report and "How sure:" in report
    assert f"| {pick.label()} | {', '.join(f'#{t}' for t in summary['confirmation']['finalists'][0]['trials'])} |" \
        in report
    return results


def test_simulated_sweep_confirms_its_close_calls(tmp_path):
    out = tmp_path / "run"
    result = autotune.tune(spec(), out=out)
    results = check_confirmed_run(out, TRIALS)
    assert result.best.config.to_dict() == json.loads((out / "summary.json").read_text())["best"]["config"]
    assert "median of" in result.verdict
    # Its peak is the highest of its runs, not its first run's (which the trial number alone said it was).
    summary = json.loads((out / "summary.json").read_text())
    assert f"(the highest of its runs; trial {summary['best_trial_index']} the first)" in result.verdict
    # The search's budget shrank by the repeats, no more: confirmation took at most a quarter of the trials.
    assert sum(confirm.is_repeat(r) for r in results) <= TRIALS // 4


class Spy:
    """A strategy that records what it is told."""

    def __init__(self, inner) -> None:
        self.inner, self.told = inner, []

    def propose(self):
        return self.inner.propose()

    def observe(self, config, result) -> None:
        self.told.append(result)
        self.inner.observe(config, result)


def test_the_strategy_hears_of_no_repeat():
    workload, hardware = autotune.make_workload("tiny"), autotune.load_hardware("cpu")
    space = Space(load_choices("cpu"), workload, hardware)
    spy: list[Spy] = []
    sweep = Sweep.in_memory(space, BUDGET, lambda context: spy.append(Spy(make_strategy("random", context))) or spy[0],
                            "simulated")
    sweep.launch_sigma = NOISE
    assert run_local(sweep, noisy(), Budget(16, confirm=2), QuietProgress()) == "trials"
    repeats = [r for r in sweep.results if confirm.is_repeat(r)]
    assert repeats and sweep.launched == 16
    assert not any(confirm.is_repeat(r) for r in spy[0].told)
    assert all(sweep.known[r.config].extra["trial"] == r.extra["repeat_of"] for r in repeats)
    assert sweep.best == confirm.recommend(sweep.results, BUDGET)


def test_confirmation_off_runs_no_repeat():
    workload, hardware = autotune.make_workload("tiny"), autotune.load_hardware("cpu")
    space = Space(load_choices("cpu"), workload, hardware)
    settings = RunSettings(workload, hardware, BUDGET, "random", "simulated", 0, space.choices)
    for budget in (Budget(16, confirm=0), Budget(16)):  # the simulated backend's default: off
        sweep = Sweep.in_memory(space, BUDGET, "random", "simulated")
        sweep.launch_sigma = NOISE
        run_local(sweep, noisy(), budget, QuietProgress())
        assert sweep.launched == 16 and not any(confirm.is_repeat(r) for r in sweep.results)
        assert "confirmation" not in summarize(sweep.results, settings)


class InterruptedAt:
    """A noisy simulation interrupted (Ctrl-C) on its `at`-th run, as the loop sees a Ctrl-C mid-trial."""

    name = "simulated"
    fatal = None

    def __init__(self, at: int) -> None:
        self.inner, self.at, self.calls = noisy(), at, 0
        self.noise = NOISE

    def run(self, config: Config) -> TrialResult:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.inner.run(config)

    def close(self) -> None:
        pass


def test_resume_mid_confirmation_loses_nothing(tmp_path):
    out = tmp_path / "run"
    reference = tmp_path / "reference"
    autotune.tune(spec(), out=reference)
    first_repeat = next(i for i, r in enumerate(read_results(reference / "trials.jsonl"), 1) if confirm.is_repeat(r))
    launched_before = sum(r.status != "pruned" for r in read_results(reference / "trials.jsonl")[:first_repeat])
    # Interrupted during its second repeat: the first repeat is recorded, the second is not.
    stopped = autotune.tune(spec(InterruptedAt(launched_before + 1)), out=out)
    assert stopped.stop_reason == "interrupted"
    before = read_results(out / "trials.jsonl")
    assert sum(confirm.is_repeat(r) for r in before) == 1 and confirm.is_repeat(before[-1])
    assert [r.to_dict() for r in before] == [r.to_dict() for r in read_results(reference / "trials.jsonl")[:len(before)]]
    resumed = autotune.tune(spec(), out=out, resume=True)
    assert resumed.stop_reason == "trials"
    after = check_confirmed_run(out, TRIALS)
    assert [r.to_dict() for r in after[:len(before)]] == [r.to_dict() for r in before]


def tune_command(out: Path, *extra: str) -> list[str]:
    return ["tune", "--backend", "simulated", "--strategy", "optuna", "--trials", "10", "--confirm", "2",
            "--memory-budget", "0.85GiB", "--seed", "4", "--out", str(out), *extra]


@pytest.mark.slow
def test_sigkill_mid_confirmation_then_resume(tmp_path, capsys):
    out = tmp_path / "run"
    env = {**os.environ, SLEEP_ENV: "0.3"}
    proc = subprocess.Popen([sys.executable, "-m", "autotune.cli", *tune_command(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    trials = out / "trials.jsonl"
    deadline = time.monotonic() + 120
    while not (trials.exists() and '"phase": "confirm"' in trials.read_text()):
        assert proc.poll() is None, f"tuner ended before confirming: {proc.stdout.read()}"
        assert time.monotonic() < deadline, "no repeat within 2 minutes"
        time.sleep(0.05)
    time.sleep(0.1)  # into the next repeat's trial
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = read_results(trials)
    assert any(confirm.is_repeat(r) for r in before)
    assert main(tune_command(out, "--resume")) == 0
    printed = capsys.readouterr().out
    after = read_results(trials)
    assert [r.to_dict() for r in after[:len(before)]] == [r.to_dict() for r in before]
    assert sum(r.status != "pruned" for r in after) == 10
    repeats = [r for r in after if confirm.is_repeat(r)]
    assert len(repeats) == 10 // 4  # the reserve: a quarter of the trials
    # Noise-free trials: the repeats measure exactly what the first runs did, of the fastest configs.
    fastest = max(r.throughput_samples_per_s for r in after if r.ok)
    assert all(r.throughput_samples_per_s == pytest.approx(fastest) for r in repeats)
    best = json.loads((out / "summary.json").read_text())["best"]
    runs = sum(r.config.to_dict() == best["config"] and r.status != "pruned" for r in after)
    assert runs > 1 and best["runs"] == runs and f"median of {runs} runs" in printed


# -- real DeepSpeed trials


@pytest.mark.slow
def test_real_deepspeed_confirmation(tmp_path, capsys):
    from micro import MICRO_FILE
    from test_tune_deepspeed import SPACE  # the real sweep test's space (no offload: no op builds), one config of it

    space = tmp_path / "space.yaml"
    space.write_text(SPACE.replace("zero_stage: [0, 1]", "zero_stage: [0]"))
    out = tmp_path / "run"
    # One config: the search is done after one trial, and the second is its repeat, in a fresh process.
    # (global batch 8: micro-batch 8 without accumulation, one micro-step a step)
    code = main(["tune", "--model", MICRO_FILE, "--global-batch", "8", "--backend", "deepspeed", "--space", str(space),
                 "--memory-budget", "3GiB", "--strategy", "grid", "--trials", "2", "--confirm", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    results = read_results(out / "trials.jsonl")
    assert [r.status for r in results] == ["ok"] * 2, [r.error for r in results]
    first, repeat = results
    assert repeat.config == first.config and repeat.extra["phase"] == "confirm" and repeat.extra["repeat_of"] == 1
    assert "phase" not in first.extra
    assert repeat.extra["log_dir"] != first.extra["log_dir"] and (Path(repeat.extra["log_dir"]) / "result.json").is_file()
    assert "confirming the close calls in fresh processes" in printed
    runs = [first.throughput_samples_per_s, repeat.throughput_samples_per_s]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["runs"] == 2 and summary["best"]["throughput_runs"] == runs
    assert summary["best"]["throughput_samples_per_s"] == pytest.approx(statistics.median(runs))
    assert summary["best"]["peak_memory_bytes"] == max(first.peak_memory_bytes, repeat.peak_memory_bytes)
    assert summary["confirmation"]["repeat_trials"] == 1
    assert summary["confirmation"]["finalists"][0]["trials"] == [1, 2]
    assert "median of 2 runs" in printed
    report = (out / "report.md").read_text()
    assert "## Confirmation of close calls" in report and f"| {first.config.label()} | #1, #2 | 2 |" in report


def test_the_confirmation_line_says_when_fewer_trials_are_left_than_it_wants(tmp_path, capsys):
    space = tmp_path / "space.yaml"  # one config: the search is done after one trial, the rest is confirmation
    space.write_text("zero_stage: [1]\nmicro_batch: [4]\nckpt_interval: [0]\nprecision: [fp32]\n"
                     "offload_optimizer: [none]\noffload_param: [none]\n")
    argv = ["tune", "--model", "tiny", "--hardware", "cpu", "--backend", "simulated", "--strategy", "grid",
            "--space", str(space), "--memory-budget", "2GiB", "--confirm", "2"]
    assert main([*argv, "--trials", "2", "--out", str(tmp_path / "short")]) == 0
    printed = capsys.readouterr().out
    assert "up to 3 runs each (1 trial of --trials left for it): z1 mb4" in printed, printed
    assert main([*argv, "--trials", "8", "--out", str(tmp_path / "enough")]) == 0
    printed = capsys.readouterr().out
    assert "up to 3 runs each: z1 mb4" in printed and "left for it" not in printed, printed


def test_a_tie_goes_the_same_way_whatever_order_the_trials_finished_in():
    """Two configs measured at exactly the same throughput (a simulated sweep on Ray, recorded in finish order): the
    pick is the lower peak, then the smaller config, in either order of the record."""
    same_peak = [run(B, 6.051, 1), run(A, 6.051, 2)]
    assert confirm.recommend(same_peak, BUDGET).config == A
    assert confirm.recommend(same_peak[::-1], BUDGET).config == A
    lower = [run(A, 6.051, 1, peak_gib=1.5), run(B, 6.051, 2, peak_gib=1.2)]
    assert confirm.recommend(lower, BUDGET).config == B
    assert confirm.recommend(lower[::-1], BUDGET).config == B
