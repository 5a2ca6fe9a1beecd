"""Pretrained policies shipped with the package (package data): `default/` holds policy.pt, policy.json
(the network, the environment layout, and the exact training command, seed and figures) and
PROVENANCE.md."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEFAULT = "default"


def policy_path(name: str = DEFAULT) -> Path:
    return Path(str(files(__name__) / name))
