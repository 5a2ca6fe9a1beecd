"""`autotune estimate` counts a config as fitting only when its offloaded state is within the profile's host memory
as well as its peak within the budget, as `tune` judges it; and when nothing fits it says why in one line, not
with an empty table. Pure prediction: no trial runs."""

import json

import pytest

from autotune import make_workload
from autotune.backends.simulated import SimulatedBackend
from autotune.cli import main
from autotune.commands.estimate import host_split
from autotune.prediction.ranking import rank_configs
from autotune.search.pruning import Pruner, cause_of
from autotune.search_spaces import space_for
from autotune.values.config import Config
from autotune.values.hardware import load_hardware
from autotune.values.dsconfig import DsOptions, ds_config
from autotune.values.results import HOST_MEMORY

# A user's command: 28 configs fit 40 GiB per device, all with offloaded state over the profile's 1 TiB of host memory.
LLAMA_70B = ["estimate", "--model", "llama-70b", "--gpus", "1", "--global-batch", "8", "--hardware", "a100-40gb",
             "--memory-budget", "40GiB"]
TiB = 2**40


def estimate_json(argv, capsys) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_configs_over_host_memory_are_not_predicted_to_fit(capsys):
    data = estimate_json(LLAMA_70B, capsys)
    assert data["host_memory_bytes"] == TiB
    assert data["fit_count"] == 0 and data["fit"] == []  # was 28, the first needing 1.13 TiB of host memory
    over = data["over_host_memory"]
    assert over["count"] == 28 and over["smallest_need_bytes"] > TiB
    assert data["fit_count"] + over["count"] + sum(g["count"] for g in data["do_not_fit"]) == data["configs"]
    assert "1.13 TiB of host memory" in data["nothing_fits"] and "1 TiB" in data["nothing_fits"]


def test_what_estimate_leaves_out_for_host_memory_is_what_tune_does_not_measure(capsys):
    """Every config estimate leaves out for host memory runs out of it in tune's simulated backend, and once the
    first has, tune's pruner skips the others for host memory; every config it ranks runs."""
    workload, hardware, budget = make_workload("llama-70b", 8, 1), load_hardware("a100-40gb"), 40 * 2**30
    ranking, over_host = host_split(rank_configs(space_for(None, workload, hardware), budget), hardware)
    assert len(over_host) == 28 and not ranking.fits
    backend = SimulatedBackend(workload, hardware, budget)
    assert all(cause_of(backend.run(est.config)) == HOST_MEMORY for est in over_host)
    pruner = Pruner(workload, hardware, budget).with_out_of_memory(over_host[0].config, HOST_MEMORY)
    for est in over_host[1:]:
        pruned = pruner.check(est.config, backend.name)
        assert pruned is not None and cause_of(pruned) == HOST_MEMORY
    data = estimate_json(LLAMA_70B, capsys)
    assert data["over_host_memory"]["config"] == over_host[0].config.to_dict()


def test_the_table_says_in_one_line_why_nothing_fits(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(LLAMA_70B) == 0
    out = capsys.readouterr().out
    assert "540 valid configs, 0 predicted to fit" in out
    assert "Top 0" not in out and "predicted to fit, fastest first" not in out  # no empty table
    lines = [line for line in out.splitlines() if line.startswith("no config is predicted to fit: ")]
    assert len(lines) == 1, out
    line = lines[0]
    assert "the 28 configs within the budget of 40 GiB per device need at least 1.13 TiB of host memory" in line
    assert "over the a100-40gb profile's 1 TiB" in line
    assert "the other 512 configs' smallest predicted peak is 40 GiB" in line and "over the budget of 40 GiB" in line
    assert "512 configs predicted not to fit" in " ".join(out.split())  # the groups table stays


def test_nothing_fits_the_budget_is_one_line_naming_the_smallest_peak(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    argv = ["estimate", "--model", "tiny", "--memory-budget", "1KiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Top 0" not in out and "fastest first" not in out
    line = next(line for line in out.splitlines() if line.startswith("no config is predicted to fit"))
    assert line.startswith("no config is predicted to fit: the smallest predicted peak is ")
    assert "over the budget of 1 KiB per device" in line and "host memory" not in line
    data = estimate_json(argv, capsys)
    assert data["fit"] == [] and data["nothing_fits"] == line
    assert data["over_host_memory"] == {"count": 0, "smallest_need_bytes": None, "config": None}


def test_some_fit_and_some_are_over_host_memory(tmp_path, capsys, monkeypatch):
    profile = tmp_path / "small-host.yaml"
    profile.write_text("base: a100-80gb\nname: small-host\nhost_memory_bytes: 210GiB\n")
    argv = ["estimate", "--model", "llama-13b", "--gpus", "1", "--hardware", str(profile), "--top", "500"]
    data = estimate_json(argv, capsys)
    over = data["over_host_memory"]
    assert data["fit_count"] > 0 and over["count"] > 0 and data["nothing_fits"] is None
    assert len(data["fit"]) == data["fit_count"]
    assert all(row["host_need_bytes"] <= data["host_memory_bytes"] for row in data["fit"])
    assert over["smallest_need_bytes"] > data["host_memory_bytes"]
    assert data["fit_count"] + over["count"] + sum(g["count"] for g in data["do_not_fit"]) == data["configs"]
    backend = SimulatedBackend(make_workload("llama-13b", None, 1), load_hardware(str(profile)), 80 * 2**30)
    assert all(backend.run(Config.from_dict(row["config"])).status == "ok" for row in data["fit"])  # as tune runs them
    assert cause_of(backend.run(Config.from_dict(over["config"]))) == HOST_MEMORY
    monkeypatch.setenv("COLUMNS", "120")
    assert main(argv[:-2] + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{data['fit_count']} predicted to fit" in out and "Top 3 configs predicted to fit" in out
    line = next(line for line in out.splitlines() if "over host memory" in line)
    assert line.startswith(f"{over['count']} configs within the budget but over host memory, not ranked")
    assert "of the small-host profile's 210 GiB" in line


@pytest.mark.parametrize("yaml, fragment", [
    ("base: a100-80gb\nhost_memory_bytes: 0\n", "host_memory_bytes"),
    ("base: a100-80gb\nhost_memory_bytes: lots\n", "host_memory_bytes"),
])
def test_a_bad_host_memory_is_one_line_and_exit_code_2(yaml, fragment, tmp_path, capsys):
    profile = tmp_path / "bad.yaml"
    profile.write_text(yaml)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["estimate", "--model", "llama-70b", "--hardware", str(profile)]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


@pytest.mark.parametrize("gpus", [1, 8])
def test_nvme_offload_prices_the_pinned_buffers_deepspeed_allocates_per_rank(gpus):
    """DeepSpeed's swappers pin, on every rank whatever the ranks, buffer_count buffers of the largest sub-group of
    the rank's partition in fp32 (optimizer) and buffer_count x buffer_size elements in the training dtype
    (parameters): for llama-7b at 8 ranks 4 x 842M x 4 bytes, not the 0.2 GB once counted."""
    from autotune.prediction.estimate import estimate

    workload = make_workload("llama-7b", gpus=gpus)
    hardware = load_hardware("a100-80gb")
    n_local = workload.model.params // gpus
    optimizer = estimate(Config(3, 1, 1, "bf16", "nvme"), workload, hardware).host_bytes
    both = estimate(Config(3, 1, 1, "bf16", "nvme", "nvme"), workload, hardware).host_bytes
    assert optimizer == 4 * min(10**9, n_local) * 4
    # buffer_size: DeepSpeed's 1e8 elements, or the largest parameter's partition (the 32000 x 4096 embedding) on one
    # rank, where 1e8 would fail zero.Init's "More elements ... than buffer size"; the config writes the same number
    ds = ds_config(Config(3, 1, 1, "bf16", "nvme", "nvme"), workload, DsOptions(nvme_path="/nvme"))
    buffer = 32000 * 4096 if gpus == 1 else 10**8
    assert ds["zero_optimization"]["offload_param"]["buffer_size"] == buffer
    assert both - optimizer == 5 * buffer * 2


@pytest.mark.parametrize("hardware, budget, said", [("a100-40gb", [], True), ("a100-40gb", ["--memory-budget", "39GiB"], False),
                                                    ("cpu", [], False)])
def test_a_named_gpu_profiles_default_budget_says_it_is_the_size_sold(hardware, budget, said, capsys):
    """The profile carries the size the device is sold as (40 GiB), a little over what CUDA exposes of it: a default
    budget from it says so, in the console and in --json; a chosen budget, or the cpu profile, says nothing."""
    line = f"memory budget: the {hardware} profile's 40 GiB, the size the device is sold as; CUDA exposes a little less"
    assert main(["estimate", "--model", "gpt2-small", "--hardware", hardware, "--top", "1", *budget]) == 0
    assert (line in capsys.readouterr().out) == said
    assert main(["estimate", "--model", "gpt2-small", "--hardware", hardware, "--top", "1", "--json", *budget]) == 0
    assert json.loads(capsys.readouterr().out).get("budget_note", "").startswith(line) == said
