"""`autotune report` of a damaged run directory, and what its plots and --json show.

A torn last line of trials.jsonl is moved aside and said (as `tune --resume` says it), and the verdict says the
record lost a trial since its outputs were written; a stop.json or calibration.json that is not one, or a record
that is gone while the outputs describe trials, is refused in one line (exit 2) with nothing written. The plots:
the memory breakdown's title whole and naming the devices it shows, the throughput plot's points whole (headroom
at the top, the zero line's failures over pruned configs and the budget line), its memory axis not stretched by
configs pruned far over the budget; --json's byte counts whole numbers."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from autotune.cli import main
from autotune.outputs import plots
from autotune.outputs.report import tables, write_outputs
from autotune.search.rundir import RunDir, RunSettings
from autotune.search_spaces import load_choices
from autotune.values.config import Config
from autotune.values.hardware import PROFILES
from autotune.values.results import TrialResult, append_result, read_results
from autotune.values.workload import make_workload
from cli_run import cli

GiB = 2**30
TUNE = ["tune", "--backend", "simulated", "--strategy", "random", "--seed", "1"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    """A finished 5-trial simulated sweep; tests copy it."""
    out = tmp_path_factory.mktemp("damaged") / "r"
    assert main([*TUNE, "--trials", "5", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(swept, tmp_path) -> Path:
    copy = tmp_path / "r"
    shutil.copytree(swept, copy)
    return copy


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run directory (the lock file aside) and its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def one_line_error(code: int, err: str, *words: str, command: str = "report") -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"autotune {command}: error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def tear(run: Path, cut: int = 60) -> bytes:
    """Cut trials.jsonl's last line short, as a crash mid-write leaves it; the torn bytes."""
    trials = run / "trials.jsonl"
    whole = trials.read_bytes()
    trials.write_bytes(whole[:-cut])
    return whole[whole.rindex(b"\n", 0, len(whole) - 1) + 1:-cut]


# -- item 1: a torn last line

def test_a_torn_last_line_is_said_as_tune_says_it_and_the_verdict_follows_it(run, capsys):
    torn = tear(run)
    code, out, err = cli(["report", str(run)], capsys)
    aside = run / "trials.jsonl.torn-1"
    assert aside.read_bytes() == torn
    # The line `tune --resume` prints (RunFolder.notes), on stderr: stdout keeps the verdict and the files.
    assert err == (f"{run / 'trials.jsonl'}:5: an incomplete last line ({len(torn)} bytes, a write cut short) was moved "
                   f"to {aside}; the results before it are kept\n")
    # The record lost its last trial: unfinished (a resume runs it again), but not "killed": its outputs were written.
    verdict = out.splitlines()[0]
    assert verdict.startswith("its record lost 1 trial since its outputs were written (4 of 5 left in trials.jsonl), "
                              f"unfinished: continue it with the same command and --resume --out {run} (resume=True from "
                              "Python); best so far ")
    assert "killed" not in verdict and code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] is None and summary["trials"] == 4 and "resume" in summary
    assert "a torn last line moved aside" in summary["stopped"]
    assert (run / "report.md").read_text().split("\n")[2] == f"**{verdict[0].upper()}{verdict[1:]}.**"
    # Said once (nothing is repaired the second time); the same verdict from the same record.
    code, again, err = cli(["report", str(run)], capsys)
    assert code == 0 and err == "" and again.splitlines()[0] == verdict


def test_the_study_following_the_torn_record_is_said_once_without_optunas_own_lines(run, capfd):
    """A random sweep's study held the torn trial: report brings it to the record and says so as `tune --resume`
    does; Optuna's "A new study created in RDB" INFO lines stay out (a reviewer saw two on stderr)."""
    tear(run)
    code, out, err = cli(["report", str(run)], capfd)
    assert code == 0 and "A new study created" not in out + err
    assert "the Optuna study 'autotune' followed trials.jsonl: it held report_trial 5" in out


def test_report_json_says_the_repair_on_stderr_and_keeps_stdout_one_document(run, capfd):
    tear(run)
    code, out, err = cli(["report", str(run), "--json"], capfd)
    assert code == 0, err
    assert "an incomplete last line" in err and "trials.jsonl.torn-1" in err
    assert json.loads(out)["verdict"].startswith("its record lost 1 trial")


# -- item 2: stop.json and calibration.json that are not what a sweep wrote

@pytest.mark.parametrize("name, text, words", [
    ("calibration.json", '{"x":', ["calibration.json: not valid JSON (", "column 6"]),
    ("calibration.json", "[1, 2]", ["calibration.json: not a calibration file (expected a JSON object)"]),
    ("calibration.json", '{"memory_scale": "big"}', ["calibration.json: memory_scale: 'big': expected a number"]),
    ("calibration.json", '{"precision_scales": [1]}', ["calibration.json: precision_scales: [1]"]),
    # another JSON file, or a term misspelt (which would be silently the default): never read as a calibration
    ("calibration.json", '{"a": 1}', ["calibration.json: not a calibration file: unknown key 'a'; allowed overhead_bytes,"]),
    ("calibration.json", '{"memory_scal": 1.2}', ["not a calibration file: unknown key 'memory_scal'"]),
    ("calibration.json", '{}', ["calibration.json: not a calibration file: no key; allowed overhead_bytes,"]),
    ("stop.json", "garbage", ["stop.json: not valid JSON (", "column 1"]),
    ("stop.json", '{"stop_reason": "bogus", "trials": 5}', ["stop.json: stop reason 'bogus': allowed trials"]),
    ("stop.json", '{"stop_reason": "trials", "trials": -1}', ["stop.json: trials: -1: expected a whole number"]),
    ("stop.json", '{"stop_reason": "trials"}', ["stop.json: missing key(s) trials"]),
    ("stop.json", '"trials"', ["stop.json: 'trials': expected a JSON object"]),
])
def test_a_damaged_stop_or_calibration_file_is_refused_and_nothing_written(run, capsys, name, text, words):
    (run / name).write_text(text)
    before = snapshot(run)
    code, _, err = cli(["report", str(run)], capsys)
    one_line_error(code, err, str(run / name), *words)
    assert snapshot(run) == before  # no output rewritten (the breakdown uncalibrated, a "killed?" verdict)


def test_a_damaged_file_is_refused_before_a_torn_line_is_moved(run, capsys):
    tear(run)
    (run / "stop.json").write_text("garbage")
    before = snapshot(run)
    code, _, err = cli(["report", str(run)], capsys)
    one_line_error(code, err, "stop.json: not valid JSON")
    assert snapshot(run) == before and not (run / "trials.jsonl.torn-1").exists()


# -- item 3: the record gone, the outputs left

def test_a_run_whose_trials_jsonl_is_gone_is_refused_not_rewritten_as_no_trial_ran(run, capsys):
    (run / "trials.jsonl").unlink()
    before = snapshot(run)
    code, _, err = cli(["report", str(run)], capsys)
    one_line_error(code, err, f"{run}: no trials.jsonl, but its summary.json counts 5 trials: the record is gone; "
                              "nothing rewritten")
    assert snapshot(run) == before
    (run / "trials.jsonl").write_bytes(b"")  # emptied: gone all the same
    code, _, err = cli(["report", str(run)], capsys)
    one_line_error(code, err, "an empty trials.jsonl, but its summary.json counts 5 trials")
    (run / "summary.json").unlink()  # the outputs' other files still say trials ran
    code, _, err = cli(["report", str(run)], capsys)
    one_line_error(code, err, "but its stop.json counts 5 trials")
    (run / "stop.json").unlink()
    code, _, err = cli(["report", str(run)], capsys)
    one_line_error(code, err, "but its best_ds_config.json holds a recommendation")


@pytest.mark.parametrize("resume", [["--resume"], []], ids=["resume", "new"])
def test_tune_over_a_run_whose_trials_jsonl_is_gone_is_refused_too(run, capsys, resume):
    """A resume (or the same command without it) started over there and wrote 'no trial ran' over the outputs."""
    (run / "trials.jsonl").unlink()
    before = snapshot(run)
    code, _, err = cli([*TUNE, "--trials", "5", "--out", str(run), *resume], capsys)
    one_line_error(code, err, f"{run}: no trials.jsonl, but its summary.json counts 5 trials: the record is gone",
                   command="tune")
    assert snapshot(run) == before


def test_a_torn_only_line_leaves_no_record_and_is_refused_after_the_repair_is_said(run, capsys):
    trials = run / "trials.jsonl"
    trials.write_bytes(trials.read_bytes()[:30])  # the first record cut short: nothing whole is left
    code, _, err = cli(["report", str(run)], capsys)
    assert code == 2 and "an incomplete last line" in err.splitlines()[0], err
    assert err.splitlines()[1].endswith("an empty trials.jsonl, but its summary.json counts 5 trials: the record "
                                        "is gone; nothing rewritten")
    assert json.loads((run / "summary.json").read_text())["trials"] == 5


def test_a_run_killed_before_its_first_trial_still_gets_its_no_trial_outputs(run, tmp_path, capsys):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(run / "run.json", fresh / "run.json")
    code, out, err = cli(["report", str(fresh)], capsys)
    assert code == 1, err
    assert out.startswith("ended without writing its outputs (killed?) before any trial finished")
    assert json.loads((fresh / "summary.json").read_text())["trials"] == 0
    code, _, err = cli(["report", str(fresh)], capsys)  # its own "0 trials" summary is no record that was lost
    assert code == 1, err


# -- item 4: plots

@pytest.fixture
def figures(monkeypatch) -> dict[str, object]:
    """Every figure the plots save, by file name, drawn (laid out) as saved."""
    saved: dict[str, object] = {}
    save = plots._save

    def keep(fig, path):
        save(fig, path)
        FigureCanvasAgg(fig).draw()  # laid out again at the figure's own dpi, for the transforms below
        saved[Path(path).name] = fig

    monkeypatch.setattr(plots, "_save", keep)
    return saved


def point(config: Config, status: str, throughput: float | None, peak_gib: float | None, trial: int,
          predicted_gib: float | None = None) -> TrialResult:
    return TrialResult(config, status, throughput_samples_per_s=throughput,
                       peak_memory_bytes=None if peak_gib is None else int(peak_gib * GiB),
                       memory_budget_bytes=30 * GiB, wall_time_s=0.0 if status == "pruned" else 10.0,
                       backend="simulated", error=None if status == "ok" else f"{status}: over",
                       extra={"trial": trial, "predicted_peak_bytes": int((predicted_gib or peak_gib or 1) * GiB)})


def marker_radius_px(fig, size_pt2: float) -> float:
    return math.sqrt(size_pt2) / 2 * fig.dpi / 72


def far_and_failed(figures, tmp_path):
    """The throughput plot of three configs that ran (under 1 GiB), two out of memory and three pruned out to 530
    GiB, under a budget of 30 GiB: (its figure, its axes)."""
    ok = [point(Config(2, mb, 0, "bf16"), "ok", t, 0.8 + mb / 100, i)
          for i, (mb, t) in enumerate([(1, 4.8), (2, 5.45), (4, 6.05)], 1)]
    failed = [point(Config(0, 16, 0, "bf16"), "oom", None, 31.0, 4), point(Config(0, 32, 0, "bf16"), "oom", None, 90.0, 5)]
    pruned = [point(Config(0, mb, 0, "fp32"), "pruned", None, None, 5 + i, predicted_gib=gib)
              for i, (mb, gib) in enumerate([(8, 31.0), (16, 120.0), (32, 530.0)], 1)]
    plots.throughput_vs_memory([*ok, *failed, *pruned], 30 * GiB, ok[-1], tmp_path / "t.png", figures="predicted")
    fig = figures["t.png"]
    return fig, fig.axes[0]


def test_configs_pruned_far_over_the_budget_do_not_stretch_the_memory_axis(figures, tmp_path):
    _, ax = far_and_failed(figures, tmp_path)
    # A margin over the budget, not out to 530 GiB (the points that ran were squeezed into its first 5%).
    low, high = ax.get_xlim()
    assert low == 0 and 30 < high <= 36
    # The far ones at its edge, counted where they are drawn.
    notes = [t.get_text() for t in ax.texts]
    assert any(n.startswith(f"2 pruned and 1 failed past {high:.3g} GiB (up to 530 GiB)") for n in notes), notes
    edge = [c for c in ax.collections if len(c.get_offsets()) and all(x == high for x, _ in c.get_offsets())]
    assert sum(len(c.get_offsets()) for c in edge) == 3


def test_the_recommended_star_is_drawn_whole_below_the_top(figures, tmp_path):
    # Every trial ran, within 25% of each other's throughput: the axis's top was the best's own (its star cut).
    ok = [point(Config(2, mb, 0, "bf16"), "ok", t, 0.8 + mb / 100, i)
          for i, (mb, t) in enumerate([(1, 4.8), (2, 5.45), (4, 6.05)], 1)]
    plots.throughput_vs_memory(ok, 24 * GiB, ok[-1], tmp_path / "t.png", figures="predicted")
    fig = figures["t.png"]
    ax = fig.axes[0]
    top = ax.transData.transform((0, ax.get_ylim()[1]))[1]
    star_y = ax.transData.transform((0, 6.05))[1]
    assert star_y + marker_radius_px(fig, 220) <= top


def test_failures_on_the_zero_line_are_drawn_over_pruned_configs_and_the_budget_line(figures, tmp_path):
    fig, ax = far_and_failed(figures, tmp_path)
    crosses = next(c for c in ax.collections if c.get_label().startswith("failed, predicted peak (2)"))
    triangles = next(c for c in ax.collections if c.get_label().startswith("pruned, predicted peak (3)"))
    budget = next(line for line in ax.lines if line.get_label().startswith("budget"))
    assert crosses.get_zorder() > max(triangles.get_zorder(), budget.get_zorder())
    # ...and whole: the axis does not cut them in half at y = 0.
    bottom = ax.transData.transform((0, ax.get_ylim()[0]))[1]
    assert ax.transData.transform((0, 0))[1] - marker_radius_px(fig, crosses.get_sizes()[0]) >= bottom


def test_the_throughput_plot_of_configs_within_the_axis_says_nothing_is_off_it(figures, tmp_path):
    ok = [point(Config(2, 1, 0, "bf16"), "ok", 5.0, 1.0, 1)]
    plots.throughput_vs_memory(ok, 2 * GiB, ok[0], tmp_path / "t.png")
    ax = figures["t.png"].axes[0]
    assert not ax.texts and 2 < ax.get_xlim()[1] <= 2.5


def run_with(tmp_path: Path, settings: RunSettings, results: list[TrialResult]) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.write_settings(settings)
    for r in results:
        append_result(run.trials_path, r)
    return run


def cpu_results() -> list[TrialResult]:
    def ok(mb: int, throughput: float, peak_gib: float, trial: int) -> TrialResult:
        return TrialResult(Config(2, mb, 0, "bf16"), "ok", throughput_samples_per_s=throughput,
                           tokens_per_s=throughput * 256, step_time_s=16 / throughput,
                           peak_memory_bytes=int(peak_gib * GiB), memory_budget_bytes=2 * GiB, wall_time_s=10.0,
                           backend="deepspeed", extra={"trial": trial, "predicted_peak_bytes": int(peak_gib * GiB)})
    return [ok(1, 10.0, 1.0, 1), ok(2, 14.0, 1.2, 2), ok(4, 13.0, 1.6, 3), ok(8, 12.0, 1.9, 4)]


def cpu_settings(**changes) -> RunSettings:
    settings = RunSettings(make_workload("tiny"), PROFILES["cpu"], 2 * GiB, "optuna", "deepspeed", 0, load_choices("cpu"))
    return replace(settings, **changes)


@pytest.mark.parametrize("target, words", [(None, "on 1 device, calibrated"), (2, "on 2 devices (the target; the "
                                                                                     "trials ran on 1)")])
def test_the_memory_breakdown_title_is_whole_and_names_the_devices_it_shows(figures, tmp_path, target, words):
    from autotune.prediction.calibrate import save_calibration
    from autotune.prediction.estimate import Calibration

    settings = cpu_settings(target_gpus=target)
    run = run_with(tmp_path, settings, cpu_results())
    save_calibration(run.path, Calibration(samples=12), settings.workload, settings.hardware)
    outputs = write_outputs(run, settings)
    assert outputs.best is not None
    fig = figures["memory_breakdown.png"]
    title = fig.axes[0].title
    # Within the figure: "..., calibrated on 12 t" was cut at its right edge.
    box = title.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.x1
    assert words in title.get_text() and "calibrated on 12 trials" in title.get_text()
    if target is not None:  # the target's breakdown, beside the peak report.md's table predicts there
        peak = next(line for line in fig.axes[0].lines if "predicted peak on 2" in line.get_label())
        assert peak.get_xdata()[0] * GiB == pytest.approx(outputs.summary["target"]["pick"]["predicted_peak_bytes"])


def test_every_plot_keeps_its_texts_inside_the_figure_and_its_legend_off_the_axes(figures, tmp_path):
    """The margins are measured from the texts (no layout engine): the widest ones still fit, a long config label,
    six-digit throughput ticks, a two-line title with the target's devices, failures past the axis's edge."""
    from autotune.prediction.estimate import estimate

    wide = Config(3, 128, 12, "fp32", "nvme", "nvme")
    ok = [point(Config(2, mb, 0, "bf16"), "ok", 123456.7 * mb, 10 + mb, i) for i, mb in enumerate((1, 2, 4), 1)]
    failed = [point(wide, "oom", None, 900.0, 4)]
    best = replace(ok[-1], config=wide)
    plots.throughput_vs_memory([*ok, *failed], 30 * GiB, best, tmp_path / "t.png", figures="replayed")
    plots.best_so_far([*ok, *failed], 30 * GiB, tmp_path / "b.png")
    est = estimate(wide, make_workload("tiny"), PROFILES["cpu"])
    plots.memory_breakdown(est, 30 * GiB, 25 * GiB, tmp_path / "m.png", figures="predicted", calibrated=12,
                           devices=64, measured_devices=8)
    assert set(figures) == {"t.png", "b.png", "m.png"}
    for name, fig in figures.items():
        renderer = fig.canvas.get_renderer()
        inside = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # every text, in pixels
        assert (inside.x0 >= 0 and inside.y0 >= 0 and inside.x1 <= fig.bbox.x1 and inside.y1 <= fig.bbox.y1), name
        ax = fig.axes[0]
        for legend in fig.legends:  # below the axes' tick labels and axis label, not over them
            assert legend.get_window_extent(renderer).y1 <= ax.get_tightbbox(renderer).y0, name


# -- item 5: byte counts in --json

def test_report_json_byte_counts_are_whole_numbers(run, capfd):
    code, out, err = cli(["report", str(run), "--json"], capfd)
    assert code == 0, err
    doc = json.loads(out)
    peaks = [row["predicted_peak_bytes"] for row in doc["top_configs"]] + [doc["best"]["predicted_peak_bytes"]]
    assert peaks and all(type(p) is int for p in peaks), peaks

    def floats(value, key=""):
        if isinstance(value, dict):
            return [f for k, v in value.items() for f in floats(v, k)]
        if isinstance(value, list):
            return [f for v in value for f in floats(v, key)]
        return [(key, value)] if key.endswith("_bytes") and isinstance(value, float) else []

    assert floats(doc) == []
    # As the record is read back (its predicted peak parsed as a number), the table's row says it whole.
    rows = tables(read_results(run / "trials.jsonl"), doc["memory_budget_bytes"])["top_configs"]
    assert all(type(r["predicted_peak_bytes"]) is int for r in rows)


def test_a_record_holding_a_config_outside_the_space_still_reports(tmp_path, capsys):
    """A user's strategy could propose a knob value outside the space before the sweep refused such proposals; the
    recorded line made every later `autotune report` an internal error (the study's distributions are the space's)."""
    import autotune
    from autotune.cli import main
    from autotune.values.config import Config

    class Outside:
        name = "outside"

        def __init__(self):
            self.order = [Config(0, 2, 0, "fp32"), Config(0, 4, 0, "fp32")]

        def propose(self):
            return self.order.pop(0) if self.order else None

        def observe(self, config, result):
            pass

    out = tmp_path / "run"
    spec = autotune.TuneSpec(autotune.make_workload("tiny", global_batch=16), autotune.load_hardware("cpu"),
                             strategy=Outside(), trials=2, backend="simulated", stop_when=0.0)
    autotune.tune(spec, out=out)
    lines = (out / "trials.jsonl").read_text().splitlines()
    line = json.loads(lines[-1])
    line["config"]["micro_batch"], line["trial"] = 1024, len(lines) + 1
    with open(out / "trials.jsonl", "a") as record:
        record.write(json.dumps(line) + "\n")
    capsys.readouterr()
    assert main(["report", str(out)]) == 0, capsys.readouterr().err
