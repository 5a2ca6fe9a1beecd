import signal

import pytest

# No DS_ACCELERATOR here: trials get theirs from the hardware profile (autotune.worker.device), and
# tests/test_devices.py checks that nothing in the package sets it for the process.

# A test run started in the background by a shell without job control (nohup cmd &) inherits SIGINT
# ignored, and would pass that on to every process it starts; the Ctrl-C tests need it delivered, as at a
# terminal (a Python handler, unlike SIG_IGN, is reset to the default in the processes it starts).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (scripts/test: --dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """Every slow test in one xdist group, so they run one after another on one worker, as they would alone:
    real trials, Ray clusters and RLlib each take a core or two, and two of them at once on a 2-core machine
    would measure each other. The fast tests take the other worker meanwhile."""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("slow"))
