"""scripts/test runs the suite on two pytest-xdist workers with `--dist loadgroup`: the slow tests of one group
(tests/conftest.py) run one after another on one worker, their session fixtures set up once. A pytest and
pytest-xdist that stop honouring the groups (pytest 9.2 with pytest-xdist 3.8) still pass every test, only
slower and with two Ray clusters at once: this checks the installed pair honours them."""

import os
import subprocess
import sys

PROBE = '''
import os
import pytest

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("n", range(4))
def test_grouped(n):
    with open(os.environ["PROBE_OUT"], "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
'''


def test_the_installed_pytest_xdist_keeps_a_group_on_one_worker(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "workers.txt"
    done = subprocess.run([sys.executable, "-m", "pytest", "test_probe.py", "-n", "2", "--dist", "loadgroup", "-q",
                           "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PROBE_OUT": str(out)})
    assert done.returncode == 0, done.stdout[-2000:]
    workers = out.read_text().split()
    assert len(workers) == 4 and len(set(workers)) == 1, workers
