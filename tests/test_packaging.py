"""The installed layout: envs/ and search_spaces/ live inside the autotune package."""

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    on_disk = set()
    for name, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base)
            sub = ".".join(relative.parts)
            qualified = f"{name}.{sub}" if sub else name
            if not any(qualified.startswith(other + ".") and other != name for other in mapping):
                on_disk.add(qualified)
    assert on_disk <= listed, f"add to pyproject packages: {sorted(on_disk - listed)}"


def test_envs_and_search_spaces_import_under_autotune():
    spaces = importlib.import_module("autotune.search_spaces")
    assert Path(spaces.__file__).parent == ROOT / "search_spaces"
    assert importlib.import_module("autotune.envs").__name__ == "autotune.envs"
