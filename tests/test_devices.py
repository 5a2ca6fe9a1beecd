"""The accelerator follows the hardware profile: nothing sets it for the process, `--hardware auto` maps the
devices found to a profile, a profile this machine cannot run is refused before any trial, and the CUDA side of
a rank (device pinning, the budget cap, the peak as nvidia-smi shows it, out-of-memory errors) is right."""

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from autotune.cli import main
from autotune.values.config import Config, ConfigError
from autotune.trials import devices
from autotune.trials.devices import (Gpu, LocalMachine, auto_hardware, check_machine, probe, profile_name,
                                     resolve_hardware)
from autotune.prediction.estimate import estimate
from autotune.values.hardware import EMULATED_BF16_SLOWDOWN, GiB, PROFILES, hardware_from_dict, with_cpu_bf16
from autotune.search_spaces import default_choices, load_choices, space_note
from autotune.worker.device import (AcceleratorMismatch, BudgetBelowContext, CudaMemory, allocator_fraction,
                                    check_accelerator, open_device)
from autotune.worker.main import Unsupported, check_supported, classify
from autotune.worker.protocol import WorkerSpec
from autotune.values.workload import make_workload

CPU_BOX = LocalMachine((), 64 * GiB, 16)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def gpus(name: str, n: int, memory_gib: float, capability=(9, 0)) -> LocalMachine:
    return LocalMachine(tuple(Gpu(name, int(memory_gib * GiB), capability) for _ in range(n)), 512 * GiB, 32)


def test_importing_every_module_leaves_the_environment_alone():
    # Third-party imports first (what they do to os.environ is theirs), then every module of the package.
    code = textwrap.dedent("""
        import json, os, pkgutil, importlib
        import torch, deepspeed, optuna, gymnasium, ray, ray.tune, ray.rllib, yaml, scipy, rich, matplotlib  # noqa
        before = dict(os.environ)
        import autotune
        names = [m.name for m in pkgutil.walk_packages(autotune.__path__, "autotune.")
                 if not m.name.endswith("__main__")]
        for name in names:
            importlib.import_module(name)
        after = dict(os.environ)
        print(json.dumps({"modules": len(names), "changed": sorted(k for k in before.keys() | after.keys()
                                                                  if before.get(k) != after.get(k))}))
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["modules"] > 60  # envs, strategies, drivers, rl, worker, script ... all imported
    assert found["changed"] == []


@pytest.mark.parametrize("name, profile", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H100 PCIe", "h100-80gb"), ("NVIDIA H800", "h100-80gb"),
    ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "h200"), ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("Tesla V100-SXM2-32GB", "v100-32gb"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("NVIDIA A10G", "a10g"),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_device_names_map_to_profiles(name, profile):
    assert profile_name(name) == profile


def test_auto_takes_memory_count_and_precisions_from_the_devices():
    h100 = auto_hardware(gpus("NVIDIA H100 80GB HBM3", 8, 79.1))
    assert h100.name == "h100-80gb" and h100.accelerator == "cuda"
    assert h100.memory_bytes == int(79.1 * GiB) and h100.gpus_per_node == 8
    assert h100.host_memory_bytes == 512 * GiB and h100.supports("bf16") and h100.supports("fp16")
    assert h100.peak_flops == PROFILES["h100-80gb"].peak_flops

    v100 = auto_hardware(gpus("Tesla V100-SXM2-16GB", 4, 15.8, (7, 0)))
    assert v100.name == "v100-32gb" and v100.memory_bytes == int(15.8 * GiB)
    assert not v100.supports("bf16") and v100.supports("fp16")

    unknown = auto_hardware(gpus("NVIDIA GeForce RTX 4090", 2, 23.6, (8, 9)))
    assert unknown.name == "nvidia-geforce-rtx-4090" and unknown.supports("bf16")  # Ampere+: bf16
    assert unknown.mem_bandwidth == PROFILES["a100-80gb"].mem_bandwidth  # its generation's figures
    turing = auto_hardware(gpus("Quadro RTX 8000", 1, 47.5, (7, 5)))
    assert not turing.supports("bf16")

    mixed = auto_hardware(LocalMachine((Gpu("NVIDIA A100-SXM4-80GB", 80 * GiB, (8, 0)),
                                        Gpu("NVIDIA A100-SXM4-40GB", 40 * GiB, (8, 0))), 256 * GiB, 8))
    assert mixed.name == "a100-40gb" and mixed.memory_bytes == 40 * GiB  # the smallest device bounds a config


def test_auto_on_a_cpu_machine_is_the_cpu_profile_with_its_memory():
    hardware = auto_hardware(CPU_BOX)
    assert hardware.is_cpu and hardware.accelerator == "cpu" and not hardware.supports("fp16")
    assert hardware.memory_bytes == hardware.host_memory_bytes == 64 * GiB and hardware.gpus_per_node == 16


def test_probe_here_finds_this_machine():
    machine = probe()
    assert machine.accelerator == "cpu" and machine.gpus == ()  # no GPU on this machine kind or in CI
    assert machine.host_memory_bytes > 2**30 and machine.cpu_count >= 1
    # The child process's answer (what a CUDA machine runs) agrees on the host.
    out = subprocess.run([sys.executable, "-m", "autotune.trials.devices"], capture_output=True, text=True, check=True)
    child = LocalMachine.from_dict(json.loads(out.stdout))
    assert child.gpus == () and child.host_memory_bytes == machine.host_memory_bytes


def test_a_gpu_profile_is_refused_where_there_is_no_gpu():
    with pytest.raises(ConfigError, match=r"--hardware \(`hardware`\) a100-80gb is a GPU profile, but this machine has no CUDA GPU"):
        check_machine(PROFILES["a100-80gb"], 1, CPU_BOX)
    check_machine(PROFILES["cpu"], 2, gpus("NVIDIA H100 80GB HBM3", 1, 79.1))  # CPU trials run anywhere
    node = gpus("NVIDIA H100 80GB HBM3", 2, 79.1)
    check_machine(PROFILES["h100-80gb"], 2, node, 70 * GiB)
    with pytest.raises(ConfigError, match=r"--gpus \(the workload.s `gpus`\) 4: .* this machine has 2 .*allowed 1 to 2"):
        check_machine(PROFILES["h100-80gb"], 4, node)
    with pytest.raises(ConfigError, match=r"memory budget 80 GiB .* more than this machine's GPU holds"):
        check_machine(PROFILES["h100-80gb"], 1, node, 80 * GiB)


TRIAL = ["trial", "--model", "tiny", "--zero-stage", "1", "--micro-batch", "2", "--ckpt-interval", "0",
         "--precision", "bf16", "--offload-optimizer", "none", "--memory-budget", "4GiB"]


@pytest.mark.parametrize("argv", [
    TRIAL + ["--hardware", "a100-80gb"],  # the example: ran on the CPU and was recorded ok
    ["tune", "--model", "tiny", "--backend", "deepspeed", "--hardware", "h100-80gb", "--trials", "2"],
    ["surface", "record", "--model", "tiny", "--hardware", "l4", "--out", "{tmp}/surface.jsonl"],
    ["tune", "--script", str(EXAMPLES / "train_plain.py"), "--hardware", "a100-40gb", "--trials", "2"],
])
def test_a_gpu_profile_on_this_cpu_machine_is_one_line_and_exit_2(argv, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] in ("trial", "tune"):
        argv += ["--run-dir" if argv[0] == "trial" else "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a GPU profile, but this machine has no CUDA GPU" in err, err
    assert not any(tmp_path.iterdir())  # nothing was written: no trial, no run directory, no surface


def test_a_sweep_file_with_a_gpu_profile_is_refused_before_the_cluster_starts(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("workloads:\n  - {name: big, model: tiny, backend: deepspeed, hardware: a100-80gb}\n")
    assert main(["sweep", str(sweep), "--out", str(tmp_path / "out"), "--ray-address", "local"]) == 2
    err = capsys.readouterr().err.strip()
    assert "workload 'big'" in err and "no CUDA GPU" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_estimate_with_hardware_auto_says_what_it_detected(capsys):
    assert main(["estimate", "--model", "tiny", "--hardware", "auto", "--json", "--top", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"] == "cpu" and out["detected"]["machine"].startswith("no CUDA GPU, CPU only")
    assert out["memory_budget_bytes"] == probe().host_memory_bytes
    assert main(["estimate", "--model", "tiny", "--hardware", "auto", "--top", "1"]) == 0
    assert "detected no CUDA GPU, CPU only" in capsys.readouterr().out


# -- the rank's side: unit tests of the CUDA logic with a fake device -------------------------------

class FakeCuda:
    """torch.cuda's memory calls over a device of `total` bytes, `outside` of them not the allocator's."""

    def __init__(self, total=80 * GiB, outside=500 * 2**20):
        self.total, self.outside, self.reserved, self.max_reserved, self.max_allocated = total, outside, 0, 0, 0
        self.fraction = None

    def mem_get_info(self, device):
        return self.total - self.outside - self.reserved, self.total

    def memory_reserved(self, device):
        return self.reserved

    def max_memory_reserved(self, device):
        return self.max_reserved

    def max_memory_allocated(self, device):
        return self.max_allocated

    def reset_peak_memory_stats(self, device):
        self.max_reserved = self.reserved

    def get_device_properties(self, device):
        return SimpleNamespace(total_memory=self.total)

    def set_per_process_memory_fraction(self, fraction, device):
        self.fraction = (fraction, device)


class FakeAccel:
    def __init__(self, name="cuda", count=8, fp16=True, aio=True):
        self.name, self.count, self.fp16, self.aio, self.device = name, count, fp16, aio, None

    def device_name(self):
        return self.name

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.device = index

    def is_fp16_supported(self):
        return self.fp16

    def is_bf16_supported(self):
        return True

    def create_op_builder(self, name):
        return SimpleNamespace(is_compatible=lambda verbose: True) if self.aio else None


def test_cuda_peak_is_reserved_plus_what_lies_outside_the_allocator():
    cuda = FakeCuda(outside=500 * 2**20)
    memory = CudaMemory(cuda, 0)
    assert memory.context == 500 * 2**20 and memory.current() == 500 * 2**20
    cuda.reserved, cuda.max_reserved, cuda.max_allocated = 10 * GiB, 12 * GiB, 11 * GiB
    assert memory.peak() == 12 * GiB + 500 * 2**20 and memory.peak_allocated() == 11 * GiB
    cuda.outside = 900 * 2**20  # NCCL's buffers appeared with the first collective
    memory.finish()
    assert memory.peak() == 12 * GiB + 900 * 2**20
    assert memory.details() == {"cuda_context_bytes": 500 * 2**20, "outside_allocator_bytes": 900 * 2**20,
                                "peak_reserved_bytes": 12 * GiB}
    memory.reset_peak()
    assert memory.peak() == 10 * GiB + 900 * 2**20


def test_the_budget_caps_the_allocator_net_of_the_context():
    assert allocator_fraction(40 * GiB, 80 * GiB, 0) == 0.5
    assert allocator_fraction(41 * GiB, 80 * GiB, 1 * GiB) == 0.5
    assert allocator_fraction(100 * GiB, 80 * GiB, 1 * GiB) == 1.0  # a budget above the card: the card
    with pytest.raises(BudgetBelowContext):
        allocator_fraction(2**29, 80 * GiB, 2**30)
    assert classify(BudgetBelowContext("x"))[0] == "oom"


def test_open_device_pins_the_rank_and_applies_the_budget():
    cuda, accel = FakeCuda(total=80 * GiB, outside=2**30), FakeAccel(count=8)
    memory = open_device("cuda", accel, SimpleNamespace(cuda=cuda), 3, 41 * GiB)
    assert accel.device == 3 and isinstance(memory, CudaMemory)  # LOCAL_RANK 3 -> GPU 3: never shared
    assert cuda.fraction == (0.5, 3)
    open_device("cuda", FakeAccel(count=8), SimpleNamespace(cuda=(uncapped := FakeCuda())), 0, None)
    assert uncapped.fraction is None


@pytest.mark.parametrize("wanted, accel, local_rank, message", [
    ("cuda", FakeAccel("cpu"), 0, "planned for DeepSpeed's cuda accelerator .* but this rank got cpu"),
    ("cpu", FakeAccel("cuda"), 0, "planned for DeepSpeed's cpu accelerator .* but this rank got cuda"),
    ("cuda", FakeAccel("cuda", count=0), 0, "LOCAL_RANK 0 has no GPU of its own: 0 visible"),
    ("cuda", FakeAccel("cuda", count=2), 2, "LOCAL_RANK 2 has no GPU of its own: 2 visible"),
])
def test_a_rank_on_the_wrong_accelerator_stops_before_the_model(wanted, accel, local_rank, message):
    with pytest.raises(AcceleratorMismatch, match=message):
        open_device(wanted, accel, SimpleNamespace(cuda=FakeCuda()), local_rank, None)
    check_accelerator("cpu", "cpu", 0, 5)  # CPU ranks need no device of their own


@pytest.mark.parametrize("error, status", [
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), "oom"),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "oom"),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
                  "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'"),
     "oom"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "crash"),
    (AcceleratorMismatch("planned for cuda"), "unsupported"),
])
def test_device_errors_are_classified(error, status):
    assert classify(error)[0] == status


def test_torch_out_of_memory_is_oom():
    import torch

    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))[0] == "oom"


def spec_for(config: Config) -> WorkerSpec:
    workload = make_workload("tiny")
    from autotune.values.dsconfig import DsOptions, ds_config

    return WorkerSpec(config, workload, ds_config(config, workload, DsOptions(nvme_path="/tmp")), "/tmp",
                      accelerator="cuda")


def test_fp16_runs_with_dynamic_loss_scaling_where_the_device_has_it():
    config = Config(2, 4, 0, "fp16", "none", "none")
    spec = spec_for(config)
    assert spec.ds_config["fp16"]["enabled"] and spec.ds_config["fp16"]["loss_scale"] == 0  # dynamic
    check_supported(spec, dict(spec.ds_config), FakeAccel(fp16=True))
    with pytest.raises(Unsupported, match="fp16 is not supported"):
        check_supported(spec, dict(spec.ds_config), FakeAccel("cpu", fp16=False))


def test_nvme_offload_without_async_io_is_unsupported_with_the_reason():
    spec = spec_for(Config(3, 4, 0, "bf16", "nvme", "nvme"))
    with pytest.raises(Unsupported, match="async_io"):
        check_supported(spec, dict(spec.ds_config), FakeAccel(aio=False))
    check_supported(spec, dict(spec.ds_config), FakeAccel(aio=True))


def test_a_spec_names_a_known_accelerator():
    with pytest.raises(ValueError, match="accelerator='rocm'"):
        WorkerSpec(Config(0, 4, 0, "bf16", "none", "none"), make_workload("tiny"), {}, "/tmp", accelerator="rocm")


# -- the runner and a real rank --------------------------------------------------------------------

FAKE_RANK = """
import os, sys
from autotune.worker.protocol import WorkerSpec, report_path, write_json_atomic
spec = WorkerSpec.read(sys.argv[1])
rank = int(os.environ["RANK"])
write_json_atomic(report_path(spec.log_dir, rank), {"status": "ok", "accelerator": os.environ.get("DS_ACCELERATOR"),
                                                      "local_rank": int(os.environ["LOCAL_RANK"])})
"""


def test_the_runner_gives_every_rank_the_specs_accelerator_and_its_own_device(tmp_path):
    import os

    from autotune.trials.runner import LaunchOptions, run_worker

    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    spec = spec_for(Config(2, 4, 0, "bf16", "none", "none"))
    spec = WorkerSpec(**{**spec.__dict__, "log_dir": str(tmp_path / "trial")})
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    # The caller's environment says cpu; the spec (from a GPU profile) says cuda: the spec wins.
    options = LaunchOptions(ranks=2, timeout_s=60, module="fake_rank", env={"PYTHONPATH": path, "DS_ACCELERATOR": "cpu"})
    outcome = run_worker(spec, options)
    assert outcome.status == "ok", outcome.error
    assert [r["accelerator"] for r in outcome.reports] == ["cuda", "cuda"]
    assert [r["local_rank"] for r in outcome.reports] == [0, 1]  # one device per rank


@pytest.mark.slow
def test_a_real_rank_on_the_wrong_accelerator_is_unsupported_and_stops_the_sweep(tmp_path, monkeypatch):
    from autotune.backends.deepspeed import DeepSpeedBackend

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    backend = DeepSpeedBackend(make_workload("tiny", global_batch=4), hardware=PROFILES["a100-80gb"],
                               logs_dir=tmp_path, timeout_s=300)
    assert backend.accelerator == "cuda"
    result = backend.run(Config(0, 4, 0, "fp32", "none", "none"))
    assert result.status == "unsupported" and "has no GPU of its own: 0 visible" in result.error
    assert backend.fatal and "0 visible" in backend.fatal  # the drivers stop: no other config runs here


@pytest.mark.slow
def test_a_real_cpu_trial_needs_no_accelerator_in_the_environment(tmp_path, monkeypatch):
    from autotune.backends.deepspeed import DeepSpeedBackend
    from autotune.worker.measure import MeasureSettings

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    backend = DeepSpeedBackend(make_workload("tiny", global_batch=4), hardware=auto_hardware(probe()),
                               logs_dir=tmp_path, timeout_s=300, measure=MeasureSettings.fixed(1, 2))
    result = backend.run(Config(1, 4, 0, "fp32", "none", "none"))
    assert result.ok, result.error
    report = json.loads((Path(result.extra["log_dir"]) / "rank0.json").read_text())
    spec = json.loads((Path(result.extra["log_dir"]) / "spec.json").read_text())
    assert report["device"] == "cpu" and spec["accelerator"] == "cpu" and backend.fatal is None
    assert "cuda_context_bytes" not in result.extra


def test_a_profile_whose_nominal_memory_exceeds_the_device_is_not_refused():
    # An H100 reports 79.1 GiB; the h100-80gb profile says 80: only a budget the user chose is checked.
    from autotune.trials.devices import require_here

    node = gpus("NVIDIA H100 80GB HBM3", 1, 79.1)
    require_here(PROFILES["h100-80gb"], 1, None, node)
    with pytest.raises(ConfigError, match="memory budget 79.5 GiB is more than"):
        require_here(PROFILES["h100-80gb"], 1, int(79.5 * GiB), node)


# -- bf16 on the CPU (issue 24): native with AVX-512 BF16 / AMX, else emulated ~30x slower ----------------------
SAPPHIRE_RAPIDS = "fpu sse4_2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile"
COOPER_LAKE = "fpu sse4_2 avx2 avx512f avx512bw avx512_bf16"
EPYC_AVX2 = "fpu sse4_2 avx2 fma bmi2"  # Zen 2/3: no AVX-512, no BF16
SKYLAKE = "fpu sse4_2 avx2 avx512f avx512bw"  # AVX-512 without its BF16 extension


def _cpuinfo(tmp_path, line):
    path = tmp_path / "cpuinfo"
    path.write_text("".join(f"processor\t: {n}\nmodel name\t: some CPU\n{line}\n\n" for n in range(2)))
    return str(path)


@pytest.mark.parametrize("line, how", [
    (f"flags\t\t: {SAPPHIRE_RAPIDS}", "native"), (f"flags\t\t: {COOPER_LAKE}", "native"),
    (f"flags\t\t: {EPYC_AVX2}", "emulated"), (f"flags\t\t: {SKYLAKE}", "emulated"),
    ("Features\t: fp asimd sve bf16 i8mm", "native"), ("Features\t: fp asimd crc32", "emulated"),  # Arm
])
def test_the_cpu_bf16_follows_the_flags_of_proc_cpuinfo(tmp_path, monkeypatch, line, how):
    monkeypatch.setattr(devices, "mkldnn_bf16", lambda *a: pytest.fail("the flags answer: torch is not asked"))
    assert devices.cpu_bf16(_cpuinfo(tmp_path, line)) == how
    assert devices.cpu_model(_cpuinfo(tmp_path, line)) == "some CPU"  # what scripts/test prints first


@pytest.mark.parametrize("torch_says, how", [(True, "native"), (False, "emulated")])
def test_without_proc_cpuinfo_the_cpu_bf16_is_torchs_answer(tmp_path, monkeypatch, torch_says, how):
    monkeypatch.setattr(devices, "mkldnn_bf16", lambda *a: torch_says)
    assert devices.cpu_bf16(str(tmp_path / "no-cpuinfo")) == how


def test_torchs_bf16_answer_is_asked_in_a_child_process():
    import torch

    assert devices.mkldnn_bf16() is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert devices.mkldnn_bf16("/nonexistent/python") is False  # no answer: not native


def test_the_cpu_profile_prices_emulated_bf16_by_the_measured_factor():
    native = auto_hardware(replace(CPU_BOX, cpu_bf16="native"))
    emulated = auto_hardware(replace(CPU_BOX, cpu_bf16="emulated"))
    assert native.cpu_bf16 == "native" and native.peak_flops == PROFILES["cpu"].peak_flops
    assert emulated.cpu_bf16 == "emulated" and emulated.supports("bf16")  # a --space with bf16 still runs it
    assert emulated.peak_flops["bf16"] == emulated.peak_flops["fp32"] / EMULATED_BF16_SLOWDOWN
    assert auto_hardware(CPU_BOX).cpu_bf16 is None  # not read: the stock profile
    workload = make_workload("tiny")
    for hardware, slower in ((native, 1.0), (emulated, EMULATED_BF16_SLOWDOWN)):
        bf16, fp32 = (estimate(Config(0, 4, 0, p), workload, hardware).time["compute"] for p in ("bf16", "fp32"))
        assert bf16 / fp32 == pytest.approx(slower)
    assert "emulated" in LocalMachine((), GiB, 2, "emulated").describe()
    assert LocalMachine.from_dict({"gpus": [], "host_memory_bytes": GiB, "cpu_count": 2, "cpu_bf16": "native"}
                                  ).cpu_bf16 == "native"


def test_real_trials_on_a_cpu_profile_read_this_cpu_and_a_resume_keeps_what_was_read(monkeypatch):
    monkeypatch.setattr(devices, "cpu_bf16", lambda *a, **k: "emulated")
    real, _ = resolve_hardware(PROFILES["cpu"], real=True)
    assert real.cpu_bf16 == "emulated" and real.peak_flops["bf16"] < real.peak_flops["fp32"]
    assert resolve_hardware(PROFILES["cpu"], real=False)[0] == PROFILES["cpu"]  # simulated: the stock profile
    assert resolve_hardware("auto", real=False)[0].cpu_bf16 == "emulated"  # auto is always this machine
    recorded = hardware_from_dict(real.to_dict(), "run.json")  # a resumed sweep's profile, read from run.json
    monkeypatch.setattr(devices, "cpu_bf16", lambda *a, **k: "native")
    assert resolve_hardware(recorded, real=True)[0] == real
    assert resolve_hardware(PROFILES["a100-80gb"], real=False)[0].cpu_bf16 is None
    with pytest.raises(ConfigError, match="cpu_bf16: 'fast': allowed native, emulated"):
        hardware_from_dict({**real.to_dict(), "cpu_bf16": "fast"}, "my.yaml")
    with pytest.raises(ConfigError, match="on a CPU profile"):
        PROFILES["a100-80gb"].with_(cpu_bf16="native")


def test_the_default_space_leaves_emulated_bf16_out_and_says_why():
    emulated = with_cpu_bf16(PROFILES["cpu"], "emulated")
    assert default_choices(emulated).precision == ("fp32",)
    assert "left out of the space" in space_note(emulated, default_choices(emulated))
    named = load_choices("cpu")  # named: kept, and the line says what it costs
    assert named.precision == ("bf16", "fp32") and "slower" in space_note(emulated, named)
    native = with_cpu_bf16(PROFILES["cpu"], "native")
    assert default_choices(native).precision == ("bf16", "fp32") and space_note(native, named) == "bf16: native on this CPU"
    assert default_choices(PROFILES["cpu"]) == named and space_note(PROFILES["cpu"], named) is None


def test_estimate_and_tune_on_a_cpu_that_emulates_bf16(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(devices, "cpu_bf16", lambda *a, **k: "emulated")
    assert main(["estimate", "--model", "tiny", "--hardware", "auto"]) == 0
    out = capsys.readouterr().out
    assert "bf16 emulated" in out and "left out of the space" in out
    assert "│ fp32 │" in out and "│ bf16 │" not in out  # the table's precision column
    assert main(["tune", "--model", "tiny", "--hardware", "auto", "--backend", "simulated", "--trials", "3",
                 "--strategy", "random", "--out", str(tmp_path / "run")]) == 0
    assert "bf16: emulated on this CPU" in capsys.readouterr().out
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["space"]["precision"] == ["fp32"] and run["hardware"]["cpu_bf16"] == "emulated"
    assert "Bf16: emulated on this CPU" in (tmp_path / "run" / "report.md").read_text()


def test_a_library_sweep_of_real_trials_on_the_cpu_profile_reads_this_cpu(monkeypatch):
    import autotune

    monkeypatch.setattr(devices, "cpu_bf16", lambda *a, **k: "emulated")
    workload, cpu = make_workload("tiny"), autotune.load_hardware("cpu")
    real = autotune.TuneSpec(workload, cpu, backend="deepspeed").settings()
    assert real.hardware.cpu_bf16 == "emulated" and real.choices.precision == ("fp32",)
    simulated = autotune.TuneSpec(workload, cpu, backend="simulated").settings()
    assert simulated.hardware == cpu and simulated.choices.precision == ("bf16", "fp32")
