import os
import signal

import pytest

from autotune.trials.runner import rank_threads

# No DS_ACCELERATOR here: trials get theirs from the hardware profile (autotune.worker.device), and
# tests/test_devices.py checks that nothing in the package sets it for the process.

# A test run started in the background by a shell without job control (nohup cmd &) inherits SIGINT
# ignored, and would pass that on to every process it starts; the Ctrl-C tests need it delivered, as at a
# terminal (a Python handler, unlike SIG_IGN, is reset to the default in the processes it starts).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Under pytest-xdist (scripts/test) the workers share the cores as a trial's ranks do: each process's OpenMP
# threads, and each trial's ranks, take an even share instead of all of them, so that two tests' threads do not
# spin against each other (set before torch loads; a setting of the caller's own is kept).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ["OMP_NUM_THREADS"] = rank_threads(os.environ, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


# Slow files that start no Ray and no second rank: a group of their own, run beside the others (in one group the
# slow tests alone set the suite's time). Each trial picks its own free port, so such a test beside another slow
# one measures slower, not wrong. A new slow file joins the Ray group until it is named here; a test here that
# does start Ray names its group itself (test_api.py's rl strategy).
BESIDE = {"test_api.py", "test_confirm.py", "test_devices.py", "test_env_deepspeed.py", "test_gpu_kit.py",
          "test_gpu_validation.py", "test_installed_package.py", "test_models.py", "test_ops.py", "test_progress.py",
          "test_report.py", "test_resume.py", "test_scale.py", "test_script_loops.py", "test_script_real.py",
          "test_script_units.py", "test_strategies.py", "test_trial_cli.py", "test_tune_cli.py",
          "test_tune_deepspeed.py", "test_wandb_tracking.py", "test_worker.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (scripts/test: --dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """The slow tests in two xdist groups, each run one test after another on one worker: real trials, Ray
    clusters and RLlib take a core or two each, and the Ray and two-rank ones stay together (`BESIDE` holds
    the rest). The fast tests fill the workers meanwhile."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("slow-beside" if item.path.name in BESIDE else "slow"))
