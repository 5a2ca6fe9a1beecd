"""The one-call GPU kit's results folder (benchmarks/gpu_kit.py): at most 8 files, the device call's limit on what
comes back. The summary, the surfaces and tune's report as files of their own; everything else the call wrote
(trial logs, tune's whole run directory, the preflight's build log, nvidia-smi samples) in one tarball."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path
from typing import Mapping

MAX_FILES = 8
TARBALL = "logs.tar.gz"


class PackError(ValueError):
    """Results that cannot be packed as asked (one line): the results folder inside the work folder, more files than
    it may hold, a name that is not a plain file name."""


def check_folders(out: Path, work: Path) -> None:
    """Raises PackError when `out` is `work` or lies inside it: the tarball of `work` would hold the results and
    itself. The one rule, for pack and for the kit's command line (which refuses it before anything runs)."""
    if out.resolve().is_relative_to(work.resolve()):
        raise PackError(f"results folder {out} is the work folder {work} or inside it: the logs' tarball of the work "
                        "folder would hold the results and itself")


def pack(out: Path, copies: Mapping[str, Path | None], texts: Mapping[str, str], work: Path,
         reserved: int = 0) -> list[Path]:
    """Into `out`: each of `copies` (name -> file; a missing file, or None, is left out, and a file of that name an
    earlier call left in `out` is removed: `out` never shows an earlier call's result as this one's), each of `texts`
    (name -> content) and the tarball of `work`, leaving room for `reserved` files written later (the console log).
    Returns the files written. Raises PackError before writing anything when `out` lies in `work` (check_folders) or
    the files would exceed MAX_FILES."""
    check_folders(out, work)
    present = {name: path for name, path in copies.items() if path is not None and path.is_file()}
    count = len(present) + len(texts) + 1 + reserved
    if count > MAX_FILES:
        raise PackError(f"{count} result files: at most {MAX_FILES} come back from a device call")
    for name in (*present, *texts, TARBALL):
        if "/" in name or not name:
            raise PackError(f"result file name {name!r}: a plain file name")
    out.mkdir(parents=True, exist_ok=True)
    for name in copies:
        if name not in present and "/" not in name and name and (out / name).is_file():
            (out / name).unlink()  # an earlier call's: this call has none
    written = []
    for name, path in present.items():
        shutil.copyfile(path, out / name)
        written.append(out / name)
    for name, text in texts.items():
        (out / name).write_text(text)
        written.append(out / name)
    tarball = out / TARBALL
    with tarfile.open(tarball, "w:gz") as tar:
        if work.is_dir():
            tar.add(work, arcname=work.name)
    written.append(tarball)
    return written
