"""The package as the GPU machine runs it (issue 40): its wheel installed with `pip install --target` into a folder
on PYTHONPATH, no editable install, and `python -m autotune.cli` started from the repository root, where '' comes
first on sys.path and the checkout's autotune/ is the one imported; and the checkout with no install at all.

The children run `python -S` with the virtualenv's site-packages as a PYTHONPATH entry: not a site directory, so
its .pth files, the editable install's import hook among them, are not processed, as on the GPU machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = sysconfig.get_paths()["purelib"]  # the virtualenv's packages: the dependencies
SOURCES = ("pyproject.toml", "README.md", "autotune", "envs", "search_spaces")  # what the wheel is built from

# What a child imported, and its import finders by name (the editable install's is _EditableFinder).
PROBE = ("import json, sys, autotune, autotune.envs, autotune.search_spaces\n"
         "print(json.dumps({'autotune': autotune.__file__, 'envs': autotune.envs.__file__,\n"
         "                  'search_spaces': autotune.search_spaces.__file__,\n"
         "                  'finders': [getattr(f, '__name__', type(f).__name__) for f in sys.meta_path]}))")


def build_wheel(folder: Path) -> Path:
    """ds-autotune's wheel in `folder`, built from a copy of the sources: setuptools writes build/ and the egg-info
    beside them, and a build in the working tree could meet another test's."""
    with tempfile.TemporaryDirectory() as copy:
        source = Path(copy)
        for name in SOURCES:
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(ROOT / name, source / name)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-build-isolation", "-w", str(folder), str(source)], check=True, capture_output=True,
                       timeout=300)
    return next(folder.glob("ds_autotune-*.whl"))


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The wheel installed as scripts/gpu-validate installs the bundle's: into a folder of its own."""
    folder = tmp_path_factory.mktemp("installed")
    wheel = build_wheel(folder / "wheel")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--target", str(folder / "site"), str(wheel)], check=True, capture_output=True,
                   timeout=300)
    return folder / "site"


def run(pythonpath: list[str], *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def probe(pythonpath: list[str], cwd: Path = ROOT) -> dict:
    done = run(pythonpath, "-c", PROBE, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert not any("Editable" in name for name in seen["finders"]), seen["finders"]  # the GPU machine's path
    return seen


def the_checkouts(seen: dict) -> None:
    """The checkout's package whole: its autotune/ with its own envs/ and search_spaces/."""
    assert seen["autotune"] == str(ROOT / "autotune" / "__init__.py")
    assert seen["envs"] == str(ROOT / "envs" / "__init__.py")
    assert seen["search_spaces"] == str(ROOT / "search_spaces" / "__init__.py")
    assert seen["finders"][0] == "_CheckoutFolders"  # first: another checkout's editable hook comes after it


def tune(pythonpath: list[str], out: Path) -> dict:
    done = run(pythonpath, "-m", "autotune.cli", "tune", "--model", "tiny", "--backend", "simulated", "--trials", "3",
               "--out", str(out))
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return json.loads((out / "summary.json").read_text())


def test_the_checkout_imports_whole_from_the_root_with_no_install():
    the_checkouts(probe([SITE]))


def test_another_checkouts_editable_hook_does_not_serve_this_checkouts_sub_packages(tmp_path):
    """A clone run with a venv that holds an editable install of another checkout: its hook, ahead on sys.meta_path,
    would serve that checkout's envs/ and search_spaces/ beside this clone's autotune/ (a reviewer's edit of the
    clone's search_spaces/cpu.yaml had no effect)."""
    other = tmp_path / "other"
    for name in ("envs", "search_spaces"):
        (other / name).mkdir(parents=True)
        (other / name / "__init__.py").write_text("")
    hook = ("import importlib.util, sys\n"
            "class Other:\n"
            "    def find_spec(self, fullname, path, target=None):\n"
            "        parent, _, name = fullname.rpartition('.')\n"
            "        if parent != 'autotune' or name not in ('envs', 'search_spaces'):\n"
            "            return None\n"
            f"        folder = {str(other)!r} + '/' + name\n"
            "        return importlib.util.spec_from_file_location(fullname, folder + '/__init__.py',\n"
            "                                                      submodule_search_locations=[folder])\n"
            "sys.meta_path.insert(0, Other())\n")
    done = run([SITE], "-c", hook + PROBE)
    assert done.returncode == 0, done.stderr[-3000:]
    the_checkouts(json.loads(done.stdout))


def test_with_the_wheel_installed_the_root_imports_the_checkout_whole_and_elsewhere_the_install(target, tmp_path):
    the_checkouts(probe([str(target), SITE]))
    elsewhere = probe([str(target), SITE], cwd=tmp_path)
    assert elsewhere["autotune"] == str(target / "autotune" / "__init__.py")
    assert elsewhere["envs"] == str(target / "autotune" / "envs" / "__init__.py")
    assert elsewhere["search_spaces"] == str(target / "autotune" / "search_spaces" / "__init__.py")
    assert "_CheckoutFolders" not in elsewhere["finders"]  # an installed package serves its own


@pytest.mark.slow
def test_tune_from_the_root_with_the_wheel_installed_into_a_folder_writes_a_summary(target, tmp_path):
    the_checkouts(probe([str(target), SITE]))  # the path this run takes
    summary = tune([str(target), SITE], tmp_path / "run")
    assert summary["trials"] == 3 and summary["best"]


@pytest.mark.slow
def test_tune_from_the_root_with_no_install_writes_a_summary(tmp_path):
    the_checkouts(probe([SITE]))
    summary = tune([SITE], tmp_path / "run")
    assert summary["trials"] == 3 and summary["best"]


@pytest.mark.slow
def test_setup_says_what_it_is_doing(tmp_path):
    """scripts/setup (which scripts/demo and scripts/test run first) names each step on stderr instead of minutes of
    quiet pip (issue 43); here the virtualenv exists, so it only checks the install and says so."""
    venv = Path(sys.prefix)
    done = subprocess.run(["bash", "scripts/setup"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "AUTOTUNE_VENV": str(venv), "AUTOTUNE_EXTRAS": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("setup: ")]
    assert lines[0] == "setup: installing ds-autotune and its dependencies" and lines[-1].startswith("setup: ready in ")
    assert "[WARNING]" not in done.stdout  # DeepSpeed's log line of the import check stays out of the output
