"""Progress a person can follow: the live line (phase, elapsed time, ETA), pruned configs one line per batch with
their cause, verdicts that name the limit that was hit (device memory, host memory for offload, NVMe space),
and the phase events a real DeepSpeed trial writes for the live line."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from autotune.backends.deepspeed import DeepSpeedBackend
from autotune.cli import main
from autotune.values.config import Config
from autotune.values.dsconfig import DsOptions
from autotune.drivers.progress import ConsoleProgress, eta_s, format_clock, format_duration
from autotune.drivers.ray import LabelledProgress
from autotune.values.hardware import PROFILES, GiB
from autotune.search.pruning import (DEVICE_MEMORY, HOST_MEMORY, NVME_SPACE, Pruner, cause_of, describe_causes,
                              cause_counts, host_need_bytes)
from autotune.values.results import TrialResult, read_results
from autotune.trials.runner import RunOutcome
from autotune.worker.main import oom_cause
from autotune.worker.measure import MeasureSettings
from autotune.worker.protocol import PHASE_LABELS, describe_phase, read_events
from autotune.values.workload import make_workload

CONFIG = Config(2, 4, 0, "bf16", "cpu")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def console_progress(total: int = 5) -> tuple[ConsoleProgress, FakeClock, io.StringIO]:
    out = io.StringIO()
    clock = FakeClock()
    return ConsoleProgress(total, Console(file=out, width=200), clock=clock), clock, out


def ok(config: Config, number: int, wall: float = 30.0) -> TrialResult:
    return TrialResult(config, "ok", throughput_samples_per_s=4.0, peak_memory_bytes=GiB, wall_time_s=wall,
                       extra={"trial": number})


def pruned(number: int, cause: str) -> TrialResult:
    return TrialResult(Config(0, number, 0, "fp32"), "pruned", error=f"over {cause}",
                       extra={"trial": number, "cause": cause})


# -- the live line ----------------------------------------------------------------------------------

def test_live_line_shows_the_phase_the_elapsed_time_and_the_eta():
    progress, clock, out = console_progress(total=5)
    phase = ["building ops (cpu_adam)"]
    progress.follow(lambda: phase[0])
    progress.started(1, 1, CONFIG)
    clock.now += 74
    line = progress.live_line()
    assert line == f"trial 1/5 (#1) {CONFIG.label()}: building ops (cpu_adam) · 1:14"  # no ETA before a result
    phase[0] = "measuring (step 3)"
    clock.now += 0.1  # the phase is read again only every half second
    assert "building ops" in progress.live_line()
    clock.now += 1.0
    assert "measuring (step 3) · 1:15" in progress.live_line()
    progress.finished(ok(CONFIG, 1), 1, None)
    # Trials of 60, 120 and 90 s: the median (90 s) times the 2 trials left, less what the running one has done.
    for number, seconds in ((2, 120), (3, 90)):
        progress.started(number, number, Config(0, number, 0, "fp32"))
        clock.now += seconds
        progress.finished(ok(Config(0, number, 0, "fp32"), number), number, None)
    assert sorted(round(d) for d in progress.durations) == [75, 90, 120]  # 74 s + 1.1 s for the first
    progress.started(4, 4, Config(0, 4, 0, "fp32"))
    clock.now += 30
    assert progress.eta() == pytest.approx(90 * 2 - 30)
    assert progress.live_line().endswith("· 0:30 · sweep ETA 2 min")
    progress.close()
    printed = out.getvalue().splitlines()
    assert len(printed) == 3 and all(line.startswith("trial ") for line in printed)  # the live line is not logged
    # After each result: 75 s x 4 left, the median 97.5 s x 3 left, 90 s x 2 left.
    assert [line.split("ETA ")[1] for line in printed] == ["5 min", "5 min", "3 min"]


def test_eta_divides_the_trials_left_among_parallel_slots():
    assert eta_s([], 10) is None  # nothing measured yet
    assert eta_s([10, 20, 600], 4) == 80  # the median, not the mean: one slow trial does not skew it
    assert eta_s([60], 8, slots=4) == 120 and eta_s([60], 9, slots=4) == 180
    assert eta_s([60], 1, running_s=100) == 0 and eta_s([60], 0) == 0
    assert [format_clock(s) for s in (0, 42, 725, 3723)] == ["0:00", "0:42", "12:05", "1:02:03"]
    assert [format_duration(s) for s in (4, 42, 420, 7500)] == ["4 s", "40 s", "7 min", "2 h 05 min"]


def test_with_a_time_budget_the_eta_counts_the_trials_it_still_lets_start():
    """--time-budget 5 min of 60 s trials (their recorded wall times, a simulated GPU's, not this clock's): after two,
    three more may start, whatever the trial budget says; the live line says what is spent. A resumed sweep's earlier
    trials count."""
    out = io.StringIO()
    clock = FakeClock()
    progress = ConsoleProgress(30, Console(file=out, width=200), clock=clock, time_budget_s=300)
    for number in (1, 2):
        progress.started(number, number, Config(0, number, 0, "fp32"))
        clock.now += 10  # this clock's 10 s; the trial's recorded wall time is 60 s
        progress.finished(ok(Config(0, number, 0, "fp32"), number, wall=60.0), number, None)
    assert progress.eta() == pytest.approx(3 * 10)  # 3 trials may start (120 of 300 s spent), 10 s each here
    progress.started(3, 3, CONFIG)
    assert progress.live_line().endswith("· 2 min of the 5 min time budget spent · sweep ETA 30 s")
    progress.close()
    resumed = ConsoleProgress(30, Console(file=io.StringIO()), clock=FakeClock(), time_budget_s=300)
    resumed.resumed_with([ok(CONFIG, n, wall=60.0) for n in range(1, 5)] + [pruned(5, "device_memory")])
    resumed.started(6, 5, Config(0, 6, 0, "fp32"))
    resumed.durations.append(20.0)
    assert resumed.eta() == pytest.approx(20.0)  # 240 of 300 s spent: the running trial is the last to start

def test_ray_results_count_the_time_between_results_times_the_slots():
    progress, clock, out = console_progress(total=10)
    progress.set_slots(4)
    for number in range(1, 3):
        clock.now += 30  # a result every 30 s from 4 slots: 2 min a trial (not the 15 s a simulated one claims)
        progress.finished(ok(Config(0, number, 0, "fp32"), number, wall=15.0), number, None)
    assert progress.durations == [120, 120]
    assert progress.eta() == pytest.approx(120 * 2)  # 8 left, 4 at a time, 2 min each
    assert "ETA 4 min" in out.getvalue().splitlines()[-1]


# -- pruned configs, one line per batch -----------------------------------------------------------------

def test_pruned_configs_are_one_line_per_batch_with_their_causes():
    progress, _, out = console_progress()
    progress.pruned(pruned(2, DEVICE_MEMORY))
    assert progress.live_line() == "pruning: 1 config predicted not to fit so far"
    for number in range(3, 7):
        progress.pruned(pruned(number, DEVICE_MEMORY if number < 5 else HOST_MEMORY))
    assert out.getvalue() == ""  # gathered until something else is printed
    assert progress.live_line() == "pruning: 5 configs predicted not to fit so far"
    progress.started(7, 1, CONFIG)
    progress.pruned(pruned(8, NVME_SPACE))
    progress.message("done")
    lines = out.getvalue().splitlines()
    assert lines[0] == "pruned    5 configs (#2-#6): 3 predicted over device memory, 2 over host memory (offloaded state)"
    assert lines[1].startswith("pruned    #8") and "over nvme_space" in lines[1]  # a batch of one keeps its reason
    assert lines[2] == "done"


def test_the_status_column_lines_up_under_the_spaces_longest_label():
    progress, _, out = console_progress()
    long, short = Config(3, 128, 12, "bf16", "nvme", "nvme"), Config(0, 1, 0, "fp32")
    progress.use_space([short, long])
    for number, config in enumerate((short, long), 1):
        progress.started(number, number, config)
        progress.finished(ok(config, number), number, None)
    progress.pruned(TrialResult(short, "pruned", error="over device memory", extra={"trial": 3}))
    progress.message("done")
    lines = out.getvalue().splitlines()
    assert len(long.label()) == 34 and lines[0].index(" ok ") == lines[1].index(" ok "), lines
    assert lines[2].index("over device memory") == lines[2].index("z0 mb1") + 35, lines  # the pruned line's too


def test_a_sweep_of_several_workloads_batches_pruned_configs_per_workload():
    out = io.StringIO()
    progress = LabelledProgress("llama", 5, Console(file=out, width=200))
    for number in range(1, 4):
        progress.pruned(pruned(number, HOST_MEMORY))
    progress.finished(ok(CONFIG, 4), 1, None)
    progress.pruned(pruned(5, DEVICE_MEMORY))
    progress.pruned(pruned(6, DEVICE_MEMORY))
    progress.close()  # the sweep's end prints the last batch
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0] == "llama pruned    3 configs (#1-#3): 3 predicted over host memory (offloaded state)"
    assert lines[1].startswith("llama trial   1/5 #4")
    assert lines[2] == "llama pruned    2 configs (#5-#6): 2 predicted over device memory"


def test_causes_come_from_the_pruner_or_the_failure_message():
    workload, l4 = make_workload("llama-70b"), PROFILES["l4"]
    pruner = Pruner(workload, l4, l4.memory_bytes)
    offloaded = Config(3, 1, 1, "bf16", "cpu", "cpu")  # fits the L4's 24 GiB, not its node's 256 GiB of RAM
    result = pruner.check(offloaded, "simulated")
    need = host_need_bytes(pruner.predict(offloaded), workload, l4)
    assert result is not None and result.extra["cause"] == HOST_MEMORY and need > l4.host_memory_bytes
    assert "of host memory per node" in result.error and "256 GiB of l4" in result.error
    assert pruner.check(Config(0, 8, 0, "bf16"), "simulated").extra["cause"] == DEVICE_MEMORY
    # NVMe: checked against the free space given (Pruner.for_settings measures it where trials run here).
    nvme = Config(3, 1, 1, "bf16", "nvme", "nvme")
    roomy = Pruner(workload, l4, l4.memory_bytes, nvme_free_bytes=2**50)
    assert roomy.check(nvme, "deepspeed") is None
    full = Pruner(workload, l4, l4.memory_bytes, nvme_free_bytes=GiB).check(nvme, "deepspeed")
    assert full is not None and full.extra["cause"] == NVME_SPACE and "free at the NVMe path" in full.error
    # Records without a recorded cause (older runs, other backends) are read from their message.
    by_text = {"Ray killed the trial's worker for lack of host memory: ...": HOST_MEMORY,
               "OSError: [Errno 28] No space left on device": NVME_SPACE,
               "peak 9000 bytes exceeds the budget of 10 bytes": DEVICE_MEMORY}
    for text, cause in by_text.items():
        assert cause_of(TrialResult(CONFIG, "oom" if cause != NVME_SPACE else "crash", error=text)) == cause
    assert cause_of(TrialResult(CONFIG, "crash", error="ValueError: bad")) is None
    assert describe_causes(cause_counts([result, result, full])) == "2 over host memory (offloaded state), 1 over NVMe space"


def test_a_host_memory_oom_teaches_the_pruner_by_host_need():
    workload, l4 = make_workload("llama-13b"), PROFILES["l4"].with_(host_memory_bytes=1024 * GiB)
    pruner = Pruner(workload, l4, l4.memory_bytes)
    failed, bigger, smaller = Config(3, 1, 1, "bf16", "cpu", "cpu"), Config(3, 1, 1, "fp32", "cpu", "cpu"), \
        Config(3, 1, 1, "bf16", "cpu")
    assert pruner.check(bigger, "simulated") is None  # the profile says the host has room
    taught = pruner.with_out_of_memory(failed, HOST_MEMORY)
    assert taught.out_of_memory == frozenset() and taught.out_of_host_memory == {failed}
    result = taught.check(bigger, "simulated")
    assert result.extra["cause"] == HOST_MEMORY and f"{failed.label()} ran out of host memory" in result.error
    assert taught.check(smaller, "simulated") is None  # its offloaded state is smaller: still worth a try
    assert pruner.with_out_of_memory(failed, None) == pruner  # a crash of no known cause teaches nothing


def test_a_failed_host_allocation_on_a_gpu_rank_is_host_memory(tmp_path):
    host = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1234 bytes")
    assert oom_cause(host, "cuda") == HOST_MEMORY and oom_cause(MemoryError(), "cuda") == HOST_MEMORY
    assert oom_cause(host, "cpu") == DEVICE_MEMORY  # on the CPU accelerator the host's memory is the device's
    assert oom_cause(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "cuda") == DEVICE_MEMORY
    # The backend records the rank's cause with the oom result.
    backend = DeepSpeedBackend(make_workload("tiny"), None, PROFILES["cpu"], logs_dir=tmp_path)
    report = {"status": "oom", "error": str(host), "cause": HOST_MEMORY}
    outcome = RunOutcome("oom", f"rank 0 in initialize: {host}", (report,), 3.0, 0.0, str(tmp_path), (), (1,))
    result = backend._result(CONFIG, outcome, {})
    assert result.status == "oom" and result.extra["cause"] == HOST_MEMORY and cause_of(result) == HOST_MEMORY


# -- through `autotune tune` ----------------------------------------------------------------------------

def run(capsys, *argv: str) -> tuple[int, list[str]]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().out.splitlines()


def test_llama_70b_on_an_l4_says_host_memory_not_the_budget(capsys, tmp_path):
    code, lines = run(capsys, "tune", "--model", "llama-70b", "--hardware", "l4", "--trials", "5",
                      "--backend", "simulated", "--out", str(tmp_path / "run"))
    text = " ".join(lines)
    assert code == 1 and len(lines) < 12, lines  # was 818 lines, one per pruned config
    assert "host memory (offloaded state)" in text and "256 GiB per l4 node" in text
    assert "raise the budget" not in text
    report = (tmp_path / "run" / "report.md").read_text()
    assert "host memory (offloaded state)" in report and "raise the budget" not in report


L4_SMALL_HOST = """name: l4-192g-host
memory_bytes: 24GiB
peak_flops: {fp32: 30.0e12, fp16: 121.0e12, bf16: 121.0e12}
mem_bandwidth: 300.0e9
host_link_bw: 24.0e9
intra_node_bw: 10.0e9
inter_node_bw: 3.0e9
gpus_per_node: 8
host_memory_bytes: 192GiB
"""


def test_a_sweep_prints_one_line_per_batch_of_pruned_configs(capsys, tmp_path):
    """llama-13b on an L4 whose node has 192 GiB: most configs exceed the device, some offload the host."""
    hardware = tmp_path / "l4.yaml"
    hardware.write_text(L4_SMALL_HOST)
    out = tmp_path / "run"
    code, lines = run(capsys, "tune", "--model", "llama-13b", "--hardware", str(hardware), "--trials", "5",
                      "--strategy", "random", "--backend", "simulated", "--out", str(out))
    results = read_results(out / "trials.jsonl")
    pruned_results = [r for r in results if r.status == "pruned"]
    batches = [line for line in lines if line.startswith("pruned    ")]
    assert code == 1 and len(pruned_results) > 50 and len(lines) < 30, lines
    # Every pruned config is in exactly one batch line, and each batch counts its causes.
    counted = 0
    for line in batches:
        head = line.split(":")[0].split()
        counted += int(head[1]) if head[2] == "configs" else 1
    assert counted == len(pruned_results)
    assert {r.extra["cause"] for r in pruned_results} == {DEVICE_MEMORY, HOST_MEMORY}
    total = next(line for line in lines if line.startswith(f"pruned {len(pruned_results)} configs in all"))
    counts = cause_counts(pruned_results)
    assert f"{counts[DEVICE_MEMORY]} predicted over device memory, {counts[HOST_MEMORY]} over host memory" in total
    report = (out / "report.md").read_text()
    assert f"- Pruned (not run): {describe_causes(counts, 'predicted over')}" in report
    assert "| pruned | host memory (offloaded state) |" in report


# -- a real trial's phases --------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_real_trial_reports_its_phases_for_the_live_line(tmp_path):
    """One tiny DeepSpeed trial: the live line's phase source sees it run, and its events file holds each phase
    (ops loaded or built, initializing, warming up, every measured step)."""
    measure = MeasureSettings(warmup_steps=1, min_steps=2, max_steps=3, rel_tol=0.5, max_measure_s=60.0)
    backend = DeepSpeedBackend(make_workload("tiny", global_batch=4), None, PROFILES["cpu"],
                               DsOptions(force_ds_cpu_optimizer=False), tmp_path / "logs", timeout_s=900,
                               measure=measure)
    box: list[TrialResult] = []
    trial = threading.Thread(target=lambda: box.append(backend.run(Config(0, 2, 0, "fp32"))))
    seen: list[str] = []
    trial.start()
    while trial.is_alive():
        phase = backend.phase()
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
        time.sleep(0.02)
    trial.join()
    result = box[0]
    assert result.ok, result.error
    assert backend.phase() is None  # between trials
    events = read_events(result.extra["log_dir"], 0)
    phases = [e["phase"] for e in events]
    assert phases[:2] == ["start", "build_ops"] and phases[-1] == "done"
    for phase in ("dist_init", "build", "initialize", "warmup", "measure"):
        assert phase in phases
    ops = [e for e in events if e["phase"] == "build_ops" and "op" in e]
    assert ops and all(isinstance(e["building"], bool) for e in ops)
    assert [e["op"] for e in ops] == ["fused_adam"]  # not shm_comm, which DeepSpeed's CPU backend loads for inference
    steps = [e["step"] for e in events if e["phase"] == "measure" and "step" in e]
    assert steps == list(range(1, result.extra["steps_measured"] + 1))
    # What the live line showed came from these events, in their order.
    labels = [describe_phase(events[: i + 1]) for i in range(len(events))]
    assert seen and all(label in labels for label in seen)
    assert [labels.index(label) for label in seen] == sorted(labels.index(label) for label in seen)
    assert describe_phase(events[: phases.index("warmup") + 1]) == PHASE_LABELS["warmup"] == "warming up"
    assert labels[-2] == f"measuring (step {steps[-1]})"
    build = ops[0]
    assert describe_phase([build]) == f"{'building' if build['building'] else 'loading'} ops ({build['op']})"
    assert json.loads(Path(result.extra["log_dir"], "result.json").read_text())["status"] == "ok"
