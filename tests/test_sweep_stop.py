"""Why a sweep stopped, as the first session says it and as a resume says it (autotune/drivers/stop.py): a workload
whose trials show that nothing of its space fits stops "nothing fits" on its first run, not "the strategy proposes
nothing more"; the sweep summary counts launched trials (pruned configs apart); a Ctrl-C before any trial finished
is said as an interruption to resume, not as "run more trials"."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import autotune
from autotune.backends.simulated import SimulatedBackend
from autotune.cli import main
from autotune.drivers.stop import StopReason
from autotune.outputs.report import interrupted_verdict, no_fit_verdict
from autotune.search.rundir import RunDir, RunSettings
from autotune.search_spaces import load_choices
from autotune.values.results import TrialResult, read_results
from autotune.values.space import Space

# llama-70b on one 40 GiB device: only ZeRO 3 with both states offloaded to the CPU is predicted to fit the device at
# all, and its first trial shows the offloaded state needs more host memory than the node has (the simulated
# backend's verdict); after it, no config of the space is predicted to fit.
SPACE = """\
zero_stage: [3]
micro_batch: [1, 2, 4]
ckpt_interval: [1, 2]
precision: [bf16]
offload_optimizer: [cpu]
offload_param: [cpu]
nvme_path: null
"""


def unfittable(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return ["tune", "--backend", "simulated", "--model", "llama-70b", "--gpus", "1", "--global-batch", "8",
            "--hardware", "a100-40gb", "--memory-budget", "40GiB", "--trials", "16", "--space", str(space),
            "--out", str(out), *extra]


def stop_of(run: Path) -> tuple[str, str]:
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads((run / "stop.json").read_text())["stop_reason"] == summary["stop_reason"]
    return summary["stop_reason"], summary["stopped"]


def test_a_first_run_whose_trials_show_nothing_fits_says_so_as_its_resume_does(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(unfittable(tmp_path, run)) == 1  # no recommendation
    out = capsys.readouterr().out
    results = read_results(run / "trials.jsonl")
    assert [r.status for r in results if r.status != "pruned"] == ["oom"]  # one trial ran, out of host memory
    first = stop_of(run)
    assert first == (StopReason.NOTHING_FITS.value, StopReason.NOTHING_FITS.text), out
    assert f"stopped: {StopReason.NOTHING_FITS.text}; 1 trial launched" in out
    assert "proposes nothing more" not in out + (run / "report.md").read_text()
    assert f"- Stopped: {StopReason.NOTHING_FITS.text}" in (run / "report.md").read_text()

    assert main(unfittable(tmp_path, run, "--resume")) == 1
    out = capsys.readouterr().out
    assert stop_of(run) == first and f"stopped: {StopReason.NOTHING_FITS.text}; 1 trial launched" in out
    assert read_results(run / "trials.jsonl") == results  # nothing more ran


def test_a_trial_budget_spent_on_a_trial_that_showed_nothing_fits_says_nothing_fits(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(unfittable(tmp_path, run, "--trials", "1")) == 1
    assert stop_of(run)[0] == StopReason.NOTHING_FITS.value, capsys.readouterr().out  # not "trial budget spent"
    assert main(unfittable(tmp_path, run, "--trials", "1", "--resume")) == 1
    assert stop_of(run)[0] == StopReason.NOTHING_FITS.value


def test_nothing_fits_at_the_start_names_no_trials_jsonl_it_never_wrote(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["tune", "--backend", "simulated", "--model", "tiny", "--memory-budget", "1MiB", "--trials", "3",
                 "--out", str(run)]) == 1
    out = capsys.readouterr().out
    assert not (run / "trials.jsonl").exists()
    assert f"stopped: {StopReason.NOTHING_FITS.text}; 0 trials launched, nothing recorded" in out, out
    assert "trials.jsonl" not in out


def test_the_stop_text_of_nothing_fits_holds_after_trials_ran():
    """A first run stops "nothing fits" after trials ran: its text must not say that nothing was run."""
    assert "nothing was run" not in StopReason.NOTHING_FITS.text
    assert StopReason.NOTHING_FITS.text.startswith("no config of the space is predicted to fit")


def test_the_sweep_summary_counts_launched_trials_and_pruned_configs_apart(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"""
concurrency: 1  # one trial in flight: the too-big workload's second proposal follows its first one's result
defaults: {{backend: simulated, strategy: optuna, trials: 3}}
workloads:
  - {{name: tiny, model: tiny, global_batch: 16, memory_budget: 0.85GiB}}
  - {{name: too-big, model: llama-70b, gpus: 1, global_batch: 8, hardware: a100-40gb, memory_budget: 40GiB,
      space: {space}}}
""")
    out = tmp_path / "sweep"
    code = main(["sweep", str(sweep), "--out", str(out), "--ray-address", "local"])
    printed = capsys.readouterr()
    assert code == 1 and (out / "sweep_summary.csv").is_file(), printed  # one workload got no recommendation
    assert f"too-big stopped: {StopReason.NOTHING_FITS.text}; 1 trial launched, 5 configs pruned" in printed.out
    with open(out / "sweep_summary.csv", newline="") as handle:
        rows = {r["workload"]: r for r in csv.DictReader(handle)}
    big = read_results(out / "too-big" / "trials.jsonl")
    assert rows["too-big"]["trials"] == "1" and rows["too-big"]["pruned"] == str(len(big) - 1) == "5"
    assert rows["too-big"]["stopped"] == StopReason.NOTHING_FITS.text
    assert json.loads((out / "too-big" / "stop.json").read_text())["stop_reason"] == "nothing fits"
    tiny = read_results(out / "tiny" / "trials.jsonl")
    assert rows["tiny"]["trials"] == "3" and rows["tiny"]["pruned"] == str(sum(r.status == "pruned" for r in tiny))
    md = (out / "sweep_summary.md").read_text()
    assert "| trials | pruned |" in md and "| 1 | 5 | none: no config fits" in md
    assert "proposes nothing more" not in md and StopReason.NOTHING_FITS.text in md

    # Resumed: the same reason, the same counts.
    code = main(["sweep", str(sweep), "--out", str(out), "--ray-address", "local", "--resume"])
    printed = capsys.readouterr()
    assert code == 1, printed.err[-3000:]
    with open(out / "sweep_summary.csv", newline="") as handle:
        again = {r["workload"]: r for r in csv.DictReader(handle)}
    assert {k: again["too-big"][k] for k in ("trials", "pruned", "stopped")} == \
        {k: rows["too-big"][k] for k in ("trials", "pruned", "stopped")}


def _interrupted(backend: SimulatedBackend, config: object) -> None:
    raise KeyboardInterrupt  # as a Ctrl-C during the sweep's first trial reaches the loop


def test_ctrl_c_before_any_trial_finished_says_to_resume_not_to_run_more_trials(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    command = ["tune", "--backend", "simulated", "--model", "tiny", "--memory-budget", "2GiB", "--trials", "6",
               "--out", str(run)]
    with monkeypatch.context() as patch:
        patch.setattr(SimulatedBackend, "run", _interrupted)
        assert main(command) == 130
    out = capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted"
    report = (run / "report.md").read_text()
    assert "run more trials" not in out and "run more trials" not in report
    verdict = next(line for line in out.splitlines() if line.startswith("interrupted before any trial finished"))
    assert f"continue it with the same command and --resume --out {run}" in verdict, out
    assert "no trial ran within the budget of 2 GiB yet, though" in verdict
    assert "untried configs are predicted to fit" in verdict
    assert "**Interrupted before any trial finished, unfinished:" in report
    assert out.count("--resume --out") == 1  # said once, in the verdict
    # "0 trials launched" alone read as if nothing had started: the trial stopped in flight is named
    assert "stopped: interrupted; 0 trials launched, nothing recorded; stopped in flight, not recorded (--resume " \
           "runs it again): z" in out
    # The resume itself runs the trials.
    assert main([*command, "--resume"]) == 0
    assert sum(r.status != "pruned" for r in read_results(run / "trials.jsonl")) == 6


def test_ctrl_c_just_after_a_trial_was_recorded_does_not_call_it_stopped_in_flight(tmp_path, monkeypatch, capsys):
    from autotune.drivers.progress import ConsoleProgress

    def interrupted(self, result, launched, best):
        raise KeyboardInterrupt  # its line is written; the display has not heard of it yet

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(ConsoleProgress, "finished", interrupted)
        assert main(["tune", "--backend", "simulated", "--trials", "3", "--out", str(run)]) == 130
    out = capsys.readouterr().out
    assert "stopped: interrupted; 1 trial launched, 1 recorded in" in out and "stopped in flight" not in out, out


@pytest.mark.parametrize("launched", [0, 2])
def test_an_interrupted_verdict_with_configs_left_says_no_more_than_to_resume(tmp_path, launched):
    """Interrupted with configs predicted to fit still untried, whether or not some trials ran (out of memory,
    here): the verdict is the resume first (interrupted_verdict), not "run more trials" (a new sweep)."""
    workload, hardware = autotune.make_workload("tiny"), autotune.load_hardware("cpu")
    space = Space(load_choices("cpu"), workload, hardware)
    settings = RunSettings(workload, hardware, 2 * 2**30, "optuna", "simulated", 0, space.choices)
    ran = [TrialResult(c, "oom", memory_budget_bytes=settings.memory_budget_bytes, backend="simulated",
                       extra={"cause": "device_memory"}) for c in list(space)[:launched]]
    inner = no_fit_verdict(settings, ran, interrupted=True)
    assert inner.startswith("no trial ran within the budget of 2 GiB yet, though") and "run more trials" not in inner
    assert ("the trials ran out of device memory (2)" in inner) == bool(launched)
    assert ": run more trials" in no_fit_verdict(settings, ran)  # not interrupted: as before
    one = [c for c in space if c not in {r.config for r in ran}][:1]
    others = [TrialResult(c, "oom", memory_budget_bytes=settings.memory_budget_bytes, backend="simulated",
                          extra={"cause": "device_memory"}) for c in space if c not in one]
    assert "though 1 untried config is predicted to fit" in no_fit_verdict(settings, others)
    text = interrupted_verdict(inner, ran, RunDir(tmp_path))
    when = "after 2 finished trials" if launched else "before any trial finished"
    assert text.startswith(f"interrupted {when}, unfinished: continue it with the same command and --resume")


def test_a_workload_of_a_sweep_is_continued_through_its_sweep(tmp_path):
    """A workload's report and summary.json named its own folder with `--out`; only the sweep's command and its
    directory (which keeps the sweep file) continue it."""
    sweep = tmp_path / "sweep"
    (sweep / "tiny").mkdir(parents=True)
    (sweep / "sweep.yaml").write_text("workloads: [{name: tiny}]\n")
    text = interrupted_verdict("best so far", [], RunDir(sweep / "tiny"))
    assert f"unfinished: continue it with the same `autotune sweep` command and --resume --out {sweep}; " in text
    alone = RunDir(tmp_path / "run")
    assert alone.resume_hint() == (f"continue it with the same command and --resume --out {tmp_path / 'run'} "
                                   "(resume=True from Python)")
