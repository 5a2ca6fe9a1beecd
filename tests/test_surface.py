"""`autotune surface record` / `show`: resumable recording, metadata, refusals."""

from dataclasses import replace
from pathlib import Path

import pytest

from autotune.backends.replay import ReplayBackend, load_surface
from autotune.cli import main
from autotune.values.config import Config, ConfigError
from autotune.values.results import read_results
from autotune.values.workload import make_workload

SPACE = """zero_stage: [0, 2]
micro_batch: [2, 4]
ckpt_interval: [0]
precision: [bf16]
"""


@pytest.fixture
def space_file(tmp_path: Path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path


def record(space_file: Path, out: Path, *extra: str) -> int:
    return main(["surface", "record", "--model", "tiny", "--space", str(space_file), "--out", str(out),
                 "--backend", "simulated", "--memory-budget", "1GiB", *extra])


def test_record_writes_every_config_once_with_its_workload(space_file, tmp_path, capsys):
    out = tmp_path / "surface.jsonl"
    assert record(space_file, out) == 0
    text = capsys.readouterr().out
    assert "[4/4]" in text and "4 of 4 measured" in text
    results = read_results(out)
    assert sorted(r.config for r in results) == sorted(
        Config(z, m, 0, "bf16") for z in (0, 2) for m in (2, 4))
    surface = load_surface(out)
    assert surface.workload == make_workload("tiny") and surface.hardware == "cpu"
    assert ReplayBackend(surface, 2**30).run(Config(2, 4, 0, "bf16")).status in ("ok", "oom")


def test_record_resumes_and_never_repeats_a_config(space_file, tmp_path, capsys):
    out = tmp_path / "surface.jsonl"
    assert record(space_file, out, "--limit", "1") == 0
    assert len(read_results(out)) == 1
    with out.open("a") as f:  # a crash in the middle of writing the second result
        f.write('{"config": {"zero_stage": 0, "micro_batch": 2, "ckpt_i')
    assert record(space_file, out) == 0
    assert "1 already measured, 3 to run" in capsys.readouterr().out
    configs = [r.config for r in read_results(out)]
    assert len(configs) == len(set(configs)) == 4
    assert record(space_file, out) == 0
    assert "4 already measured, 0 to run" in capsys.readouterr().out
    assert len(read_results(out)) == 4


def test_record_refuses_another_workload_in_the_same_file(space_file, tmp_path, capsys):
    out = tmp_path / "surface.jsonl"
    assert record(space_file, out, "--limit", "1") == 0
    code = main(["surface", "record", "--model", "tiny", "--global-batch", "32", "--space", str(space_file),
                 "--out", str(out), "--backend", "simulated"])
    err = capsys.readouterr().err
    assert code == 2 and "recorded for another workload" in err and len(err.strip().splitlines()) == 1
    assert len(read_results(out)) == 1


@pytest.mark.parametrize("flags, fragment", [
    (["--memory-budget", "2GiB"], "recorded under a memory budget of 1 GiB, not 2 GiB"),
    (["--hardware", "a100-80gb"], "recorded on 'cpu', not 'a100-80gb'"),
])
def test_record_refuses_to_extend_a_surface_under_another_budget_or_hardware(space_file, tmp_path, capsys, flags,
                                                                           fragment):
    # A trial past its budget is stopped as out of memory: a surface mixing two budgets would replay as neither.
    out = tmp_path / "surface.jsonl"
    assert record(space_file, out, "--limit", "1") == 0
    capsys.readouterr()
    assert record(space_file, out, *flags) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert len(read_results(out)) == 1


@pytest.mark.parametrize("flags, word", [(["--backend", "gpu"], "gpu"), (["--memory-budget", "lots"], "lots"),
                                         (["--limit", "0"], "0"), (["--model", "gpt5"], "gpt5")])
def test_bad_flags_exit_2_with_one_line(space_file, tmp_path, capsys, flags, word):
    with pytest.raises(SystemExit) as exit_:
        main(["surface", "record", "--space", str(space_file), "--out", str(tmp_path / "s.jsonl"), *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and word in err and len(err.strip().splitlines()) == 1


def test_show_ranks_within_a_budget(space_file, tmp_path, capsys):
    out = tmp_path / "surface.jsonl"
    assert record(space_file, out) == 0
    capsys.readouterr()
    assert main(["surface", "show", str(out), "--memory-budget", "2GiB"]) == 0
    text = capsys.readouterr().out
    assert "4 configs of tiny, global batch 16, 1 rank on cpu" in text and "z0 mb4 ck0 bf16" in text
    assert "Fastest 4 configs within 2 GiB" in text  # as many as it shows, not --top's 10
    assert main(["surface", "show", str(tmp_path / "none.jsonl")]) == 2


def test_show_says_a_directory_a_torn_last_line_and_a_mixed_surface(space_file, tmp_path, capsys):
    out = tmp_path / "surface.jsonl"
    assert record(space_file, out) == 0
    capsys.readouterr()
    assert main(["surface", "show", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "no such file" not in err and err.count("\n") == 1
    with out.open("a") as tail:
        tail.write('{"config": {"zero_stage"')  # a write cut short
    assert main(["surface", "show", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{out}:5: an incomplete last line" in text and "4 configs of tiny" in text
    # The same configs on another profile, appended: a mixed surface.
    lines = [line.replace('"hardware": "cpu"', '"hardware": "a100-40gb"') for line in out.read_text().splitlines()[:4]]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(out.read_text().rsplit("\n", 1)[0] + "\n" + "\n".join(lines) + "\n")
    assert main(["surface", "show", str(mixed)]) == 0
    assert "recorded on two hardwares, cpu and a100-40gb: replay refuses it" in capsys.readouterr().out
    assert main(["tune", "--backend", "replay", "--surface", str(mixed), "--out", str(tmp_path / "r")]) == 2
    assert "on two hardwares, cpu and a100-40gb" in capsys.readouterr().err and not (tmp_path / "r").exists()


class CrashingFirst:
    """Crashes the first time each config runs, then succeeds: a transient failure."""

    name = "deepspeed"

    def __init__(self):
        from autotune.backends.simulated import SimulatedBackend
        from autotune.values.hardware import PROFILES

        self.inner = SimulatedBackend(make_workload("tiny"), PROFILES["cpu"], 2**31)
        self.runs = []

    def run(self, config):
        from autotune.values.results import TrialResult

        self.runs.append(config)
        if self.runs.count(config) == 1:
            return TrialResult(config, "crash", backend=self.name, error="EADDRINUSE")
        return replace(self.inner.run(config), backend=self.name)  # as a backend's results say: its own name


def test_crashed_trials_are_run_again_and_every_attempt_kept(space_file, tmp_path):
    from autotune.drivers.recording import record_surface as record_space
    from autotune.values.hardware import PROFILES
    from autotune.search_spaces import load_choices
    from autotune.values.space import Space

    space = Space(load_choices(space_file), make_workload("tiny"), PROFILES["cpu"])
    out = tmp_path / "surface.jsonl"
    backend = CrashingFirst()
    done = record_space(space, backend, out, retries=1, progress=lambda _: None)
    assert done.recorded == done.total_measured == 4 and len(backend.runs) == 8
    lines = read_results(out)
    assert [r.status for r in lines].count("crash") == 4 and len(lines) == 8
    assert all(r.ok for r in load_surface(out).results.values())  # the last line of each config
    # No retries: a crash is final, and stays final on resume.
    out2 = tmp_path / "no-retry.jsonl"
    record_space(space, CrashingFirst(), out2, retries=0, progress=lambda _: None)
    assert record_space(space, CrashingFirst(), out2, retries=0, progress=lambda _: None).recorded == 0
    # A crash recorded earlier gets its retry when the recording resumes.
    assert record_space(space, CrashingFirst(), out2, retries=1, progress=lambda _: None).recorded == 4


class StopsAfter(CrashingFirst):
    """Succeeds `n` times, then says no config can succeed (`fatal`) or is interrupted (Ctrl-C)."""

    def __init__(self, n, interrupt=False):
        super().__init__()
        self.n, self.interrupt, self.fatal = n, interrupt, None

    def run(self, config):
        self.runs.append(config)
        if len(self.runs) > self.n:
            if self.interrupt:
                raise KeyboardInterrupt
            self.fatal = "every trial fails the same way"
        return replace(self.inner.run(config), backend=self.name)


def test_a_fatal_backend_stops_the_recording_and_an_interrupted_one_resumes(space_file, tmp_path, capsys):
    """The recording runs on the sweeps' trial loop: a backend's fatal verdict stops it with its line, and Ctrl-C keeps
    every finished trial for the resume; negative retries are refused."""
    from autotune.drivers.recording import record_surface as record_space
    from autotune.values.hardware import PROFILES
    from autotune.search_spaces import load_choices
    from autotune.values.space import Space

    space = Space(load_choices(space_file), make_workload("tiny"), PROFILES["cpu"])
    out = tmp_path / "fatal.jsonl"
    done = record_space(space, StopsAfter(1), out, progress=lambda _: None)
    assert (done.recorded, done.fatal, len(read_results(out))) == (2, "every trial fails the same way", 2)
    out = tmp_path / "interrupted.jsonl"
    with pytest.raises(KeyboardInterrupt):
        record_space(space, StopsAfter(2, interrupt=True), out, progress=lambda _: None)
    assert len(read_results(out)) == 2
    assert record_space(space, StopsAfter(9), out, progress=lambda _: None).recorded == 2
    assert len({r.config for r in read_results(out)}) == 4
    with pytest.raises(ConfigError, match="retries -1, repeats 1: need retries >= 0"):
        record_space(space, StopsAfter(9), out, retries=-1, progress=lambda _: None)

def test_an_interrupted_record_says_what_it_kept_and_that_the_same_command_goes_on(space_file, tmp_path, capsys,
                                                                                monkeypatch):
    from autotune.backends.simulated import SimulatedBackend

    run, calls = SimulatedBackend.run, []

    def interrupted_third(self, config):
        calls.append(config)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run(self, config)

    monkeypatch.setattr(SimulatedBackend, "run", interrupted_third)
    out = tmp_path / "s.jsonl"
    assert record(space_file, out) == 130
    err = capsys.readouterr().err
    assert (f"autotune surface record: interrupted: 2 configs recorded now in {out}, 2 of 4 measured; the same "
            "command records the rest") in err, err
    monkeypatch.setattr(SimulatedBackend, "run", run)
    assert record(space_file, out) == 0 and "2 configs recorded now, 4 of 4 measured" in capsys.readouterr().out


def test_repeats_measure_again_in_passes_and_replay_takes_the_median(space_file, tmp_path, capsys):
    out = tmp_path / "surface.jsonl"
    assert record(space_file, out) == 0
    wanted = tmp_path / "fastest.jsonl"
    wanted.write_text('{"zero_stage": 0, "micro_batch": 4, "ckpt_interval": 0, "precision": "bf16"}\n'
                      '{"config": {"zero_stage": 2, "micro_batch": 2, "ckpt_interval": 0, "precision": "bf16"}}\n')
    capsys.readouterr()
    assert record(space_file, out, "--configs", str(wanted), "--repeats", "3") == 0
    text = capsys.readouterr().out
    assert "4 configs in the space, 2 to record, 0 already measured 3 times, 4 to run" in text
    lines = read_results(out)
    assert len(lines) == 8
    # Passes: both configs' second measurements before either's third.
    assert {r.config for r in lines[4:6]} == {r.config for r in lines[6:8]} == {Config(0, 4, 0, "bf16"),
                                                                                Config(2, 2, 0, "bf16")}
    assert record(space_file, out, "--configs", str(wanted), "--repeats", "3") == 0
    assert "2 already measured 3 times, 0 to run" in capsys.readouterr().out
    # Three measurements of a config: replay reads the one of median throughput, whatever the order.
    config = Config(0, 2, 0, "bf16")
    base = next(r for r in lines if r.config == config)
    from dataclasses import replace

    from autotune.values.results import append_result
    for speed in (30.0, 10.0):
        append_result(out, replace(base, throughput_samples_per_s=speed))
    middle = sorted([30.0, 10.0, base.throughput_samples_per_s])[1]
    assert load_surface(out).results[config].throughput_samples_per_s == middle


def test_configs_outside_the_space_or_unreadable_exit_2_with_one_line(space_file, tmp_path, capsys):
    out = tmp_path / "surface.jsonl"
    outside = tmp_path / "outside.jsonl"
    outside.write_text('{"zero_stage": 3, "micro_batch": 2, "ckpt_interval": 0, "precision": "bf16"}\n')
    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text('{"zero_stage": "three"}\n')
    for path, word in ((outside, "z3 mb2 ck0 bf16"), (garbled, "garbled.jsonl:1"), (tmp_path / "none.jsonl", "none")):
        assert record(space_file, out, "--configs", str(path)) == 2
        err = capsys.readouterr().err
        assert word in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.slow
def test_a_real_recording_runs_its_second_trial_on_ranks_started_ahead_and_leaves_none(tmp_path, capsys):
    space = tmp_path / "fp32.yaml"
    space.write_text("zero_stage: [0, 1]\nmicro_batch: [4]\nckpt_interval: [0]\nprecision: [fp32]\n"
                     "offload_optimizer: [none]\noffload_param: [none]\n")
    out, logs = tmp_path / "surface.jsonl", tmp_path / "logs"
    code = main(["surface", "record", "--model", "tiny", "--space", str(space), "--out", str(out), "--backend",
                 "deepspeed", "--hardware", "cpu", "--memory-budget", "3GiB", "--max-steps", "3", "--logs", str(logs)])
    assert code == 0, capsys.readouterr().out
    first, second = read_results(out)
    assert first.ok and second.ok, (first.error, second.error)
    # The recording runs one trial after another (issue 41): the second's ranks imported during the first.
    assert first.extra["import_ahead_s"] is None and second.extra["import_ahead_s"] > 0
    assert second.extra["steps_applied"] >= 1 and second.extra["loss_first"] != second.extra["loss_last"]
    assert not list((logs / "spares").iterdir())  # none left for a trial that will not come


def test_a_surface_holds_one_backends_lines_and_replays_no_budget_its_ooms_say_nothing_of(space_file, tmp_path,
                                                                                        capsys):
    """A simulated recording appended into a measured surface replayed as measurements; a budget above the one its
    out-of-memory configs were recorded under replayed them as out of memory, recommending a slower config."""
    from dataclasses import replace as changed

    from autotune.values.results import append_result

    out = tmp_path / "surface.jsonl"
    assert record(space_file, out) == 0
    measured = tmp_path / "measured.jsonl"
    lines = read_results(out)
    for line in lines:
        append_result(measured, changed(line, backend="deepspeed"))
    assert record(space_file, measured) == 2
    assert "was recorded by the deepspeed backend, not simulated" in capsys.readouterr().err
    mixed = tmp_path / "mixed.jsonl"
    for line in (changed(lines[0], backend="deepspeed"), *lines[1:]):
        append_result(mixed, line)
    assert main(["tune", "--backend", "replay", "--surface", str(mixed), "--out", str(tmp_path / "m")]) == 2
    assert "recorded by two backends, deepspeed and simulated" in capsys.readouterr().err
    budget = 800 * 2**20
    ooms = tmp_path / "ooms.jsonl"
    for line in (changed(lines[0], status="oom", memory_budget_bytes=budget, throughput_samples_per_s=None,
                         tokens_per_s=None, step_time_s=None), *lines[1:]):
        append_result(ooms, changed(line, memory_budget_bytes=budget))
    assert main(["tune", "--backend", "replay", "--surface", str(ooms), "--memory-budget", "2GiB", "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--memory-budget (`memory_budget_bytes`) 2 GiB: the surface" in err and "allowed up to 800 MiB" in err
    assert main(["tune", "--backend", "replay", "--surface", str(ooms), "--memory-budget", "800MiB", "--trials", "2",
                 "--out", str(tmp_path / "fine")]) == 0
    assert main(["tune", "--backend", "replay", "--surface", str(out), "--seq-len", "512", "--out",
                 str(tmp_path / "s")]) == 2
    assert "--seq-len 512: the surface" in capsys.readouterr().err  # it replayed seq 256 and said nothing


def test_a_recording_goes_on_under_the_machines_memory_read_again(space_file, tmp_path, capsys):
    """The default budget is the machine's memory as read now, a few hundred KiB off from boot to boot: the committed
    surface could not be extended here ("recorded under a memory budget of 23.5 GiB, not 23.5 GiB")."""
    out = tmp_path / "surface.jsonl"
    assert record(space_file, out, "--limit", "2") == 0
    capsys.readouterr()
    moved = ["surface", "record", "--model", "tiny", "--space", str(space_file), "--out", str(out), "--backend",
             "simulated"]
    assert main([*moved, "--memory-budget", f"{2**30 - 450 * 1024}B"]) == 0
    assert len({r.config for r in read_results(out)}) == 4
    assert main([*moved, "--memory-budget", "2GiB"]) == 2
    assert "was recorded under a memory budget of 1 GiB, not 2 GiB" in capsys.readouterr().err
    assert main([*moved, "--memory-budget", f"{2**30 + 2**21}B"]) == 2  # 0.2% more: another budget, said exactly
    assert "not 1 GiB (1075838976 bytes)" in capsys.readouterr().err


def test_a_replay_where_nothing_fits_quotes_the_smallest_peak_measured(space_file, tmp_path, capsys):
    """It quoted the smallest predicted peak (792 MiB) where the surface had measured 592 MiB."""
    from dataclasses import replace as changed

    from autotune.values.results import append_result
    from autotune.values.units import format_size

    out = tmp_path / "surface.jsonl"
    assert record(space_file, out) == 0
    measured = tmp_path / "measured.jsonl"
    # Measured 8% below their predictions; the budget just below the smallest: the trials run and all are oom.
    lines = [changed(line, backend="deepspeed", peak_memory_bytes=int(line.peak_memory_bytes * 0.92))
             for line in read_results(out)]
    for line in lines:
        append_result(measured, line)
    smallest = min(lines, key=lambda r: r.peak_memory_bytes)
    budget = f"{smallest.peak_memory_bytes - 2**20}B"
    capsys.readouterr()
    assert main(["tune", "--backend", "replay", "--surface", str(measured), "--memory-budget", budget,
                 "--out", str(tmp_path / "r")]) == 1
    assert (f"no config fits the budget of {format_size(smallest.peak_memory_bytes - 2**20)}: the smallest peak its "
            "trials saw is "
            f"{format_size(smallest.peak_memory_bytes)} ({smallest.config.label()}), its prediction dominated by"
            in capsys.readouterr().out)


def test_a_replay_resumes_only_on_the_surface_it_began_with(space_file, tmp_path, capsys):
    """A surface whose figures changed was taken: the record mixed the old file's throughputs with the new one's."""
    import json

    out = tmp_path / "surface.jsonl"
    assert record(space_file, out) == 0
    run = ["tune", "--backend", "replay", "--surface", str(out), "--out", str(tmp_path / "r")]
    assert main([*run, "--trials", "2"]) == 0
    settings = json.loads((tmp_path / "r" / "run.json").read_text())
    assert len(settings["surface_sha256"]) == 64
    assert main([*run, "--trials", "3", "--resume"]) == 0  # the same file: it goes on
    lines = out.read_text().splitlines()
    out.write_text("\n".join([*lines[:-1], lines[-1].replace('"status": "ok"', '"status": "oom"')]) + "\n")
    capsys.readouterr()
    assert main([*run, "--trials", "4", "--resume"]) == 2
    assert "was started with other settings (surface_sha256: recorded " in capsys.readouterr().err
    # A run.json of a sweep begun before the digest resumes as it did (nothing to compare).
    (tmp_path / "r" / "run.json").write_text(json.dumps({**settings, "surface_sha256": None}))
    assert main([*run, "--trials", "4", "--resume"]) == 0
