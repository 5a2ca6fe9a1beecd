import json
import subprocess
import sys

import pytest

from autotune.cli import main


def test_estimate_table_ranks_fitting_configs_and_groups_the_rest(capsys):
    assert main(["estimate", "--model", "gpt2-large", "--gpus", "16", "--gpu-memory", "32GiB",
                 "--global-batch", "512", "--hardware", "v100-32gb", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "gpt2-large" in out and "Top 5 configs predicted to fit" in out
    words = " ".join(out.split())  # a narrow table wraps its title
    assert "predicted not to fit, by the term that breaks the budget" in words
    assert "bf16" not in out  # V100 has no bf16


def test_estimate_json_is_documented_shape(capsys):
    assert main(["estimate", "--model", "llama-7b", "--gpus", "8", "--gpu-memory", "40GB",
                 "--global-batch", "256", "--hardware", "a100-40gb", "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory_budget_bytes"] == 40 * 10**9
    assert data["workload"]["gpus"] == 8 and data["hardware"] == "a100-40gb"
    assert len(data["fit"]) == 3
    throughputs = [row["throughput_samples_per_s"] for row in data["fit"]]
    assert throughputs == sorted(throughputs, reverse=True)
    for row in data["fit"]:
        assert row["memory"]["total"] <= data["memory_budget_bytes"]
        assert set(row["memory"]) >= {"weights", "gradients", "optimizer_states", "activations", "buffers", "overhead"}
        assert row["gradient_accumulation_steps"] * row["config"]["micro_batch"] * 8 == 256
    assert data["fit_count"] + sum(g["count"] for g in data["do_not_fit"]) == data["configs"]
    for group in data["do_not_fit"]:
        assert group["smallest_peak_bytes"] > data["memory_budget_bytes"]


def test_user_hardware_profile_from_yaml(tmp_path, capsys):
    profile = tmp_path / "my-gpu.yaml"
    profile.write_text("base: a100-80gb\nmemory_bytes: 48GiB\nname: rtx-a6000\n")
    assert main(["estimate", "--model", "gpt2-small", "--hardware", str(profile), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"] == "rtx-a6000" and data["memory_budget_bytes"] == 48 * 2**30


@pytest.mark.parametrize("args, fragment", [
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--gpus", "0"], "'0' must be a positive integer"),
    (["--gpus", "-2"], "'-2' must be a positive integer"),
    (["--global-batch", "many"], "'many' is not an integer"),
    (["--gpu-memory", "lots"], "size 'lots' is not understood"),
    (["--gpu-memory=-3GB"], "size '-3GB' must be positive"),
    (["--gpu-memory", "0GiB"], "size '0GiB' must be positive"),
    (["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["--hardware", "nowhere/a6000.yaml"], "hardware nowhere/a6000.yaml: no such file; allowed ['a100-40gb'"),
    (["--space", "nowhere.yaml"], "search space 'nowhere.yaml': no such file"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = main(["estimate", *args])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_the_header_names_the_sequence_length(capsys):
    assert main(["estimate", "--top", "1", "--seq-len", "96"]) == 0
    assert "tiny: 4.3M parameters, seq 96, global batch 16," in capsys.readouterr().out


def test_console_script_runs():
    done = subprocess.run([sys.executable, "-m", "autotune.cli", "estimate", "--model", "nope"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown model 'nope'" in done.stderr
    done = subprocess.run([sys.executable, "-m", "autotune.cli", "estimate", "--top", "3"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "tiny" in done.stdout


def test_a_space_that_is_a_directory_says_so(tmp_path, capsys):
    from autotune.cli import main

    assert main(["estimate", "--model", "tiny", "--space", str(tmp_path)]) == 2
    assert f"search space '{tmp_path}': is a directory: name a YAML file in it" in capsys.readouterr().err
