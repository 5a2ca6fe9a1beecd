"""How much of the estimator's throughput error pairs of knob values explain, on measured surfaces (issue 28).

The convergence figure (autotune/search/convergence.py, `Process`) splits a config's own residual, what its knob
values' offsets leave of log(predicted / measured step time), into a part shared through pairs of knob values and
an independent rest, PAIR_SHARE of it on the pairs. This measures that share on every config of a surface: the
calibrated estimator's log-ratios (autotune.prediction.calibrate, fitted on the whole surface), least squares with
one offset per knob value, then with every pair of knob values added; each residual variance over its degrees of
freedom (so the pairs' extra parameters are not counted as explained), and the share is 1 - the second / the first.

    python benchmarks/pair_share.py [SURFACE.jsonl ...]   (default: benchmarks/surfaces/*.jsonl)

Prints a table and writes benchmarks/results/pair_share.{md,json}. A surface with fewer configs than the pairs
have parameters has no share ("-").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np

from autotune.backends.replay import load_surface, replay_space, replay_workload
from autotune.prediction.calibrate import error_observations, fit_calibration
from autotune.search.convergence import PAIR_SHARE
from autotune.values.config import KNOBS, Config

ROOT = Path(__file__).resolve().parent


def design(configs: list[Config], pairs: bool) -> np.ndarray:
    """A common column, one per knob value but the first of its knob, and with `pairs` one per pair of those."""
    values = {k: sorted({getattr(c, k) for c in configs}, key=str)[1:] for k in KNOBS}
    columns = [np.ones(len(configs))]
    single = {(k, v): np.array([getattr(c, k) == v for c in configs], dtype=float) for k in KNOBS for v in values[k]}
    columns += single.values()
    if pairs:
        for k1, k2 in itertools.combinations(KNOBS, 2):
            columns += [single[(k1, v1)] * single[(k2, v2)] for v1 in values[k1] for v2 in values[k2]]
    return np.array(columns).T


def residual_sd(xs: np.ndarray, ys: np.ndarray) -> tuple[float | None, int]:
    """The least-squares residual's sd over its degrees of freedom (None where none are left), and the rank."""
    coef, *_ = np.linalg.lstsq(xs, ys, rcond=None)
    rank = int(np.linalg.matrix_rank(xs))
    dof = len(ys) - rank
    return (math.sqrt(float(((ys - xs @ coef) ** 2).sum()) / dof) if dof > 0 else None), rank


def measure(path: Path) -> dict:
    surface = load_surface(path)
    workload = replay_workload(path)
    hardware = replay_space(path, workload).hardware
    results = list(surface.results.values())
    calibration = fit_calibration(results, workload, hardware)
    seen = error_observations(results, [], workload, hardware, calibration, 2 ** 60).time
    configs, ys = [c for c, _ in seen], np.array([y for _, y in seen])
    knobs, knob_params = residual_sd(design(configs, False), ys)
    both, pair_params = residual_sd(design(configs, True), ys)
    share = 1 - (both / knobs) ** 2 if knobs and both is not None else None
    return {"surface": path.name, "configs": len(configs), "knob_values_sd": knobs, "knob_params": knob_params,
            "with_pairs_sd": both, "pair_params": pair_params, "share": share}


def table(rows: list[dict]) -> list[str]:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["| surface | configs | residual sd, knob values (params) | with pairs (params) | pairs' share |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['surface']} | {r['configs']} | {num(r['knob_values_sd'], '.3f')} ({r['knob_params']}) | "
              f"{num(r['with_pairs_sd'], '.3f')} ({r['pair_params']}) | {num(r['share'], '.0%')} |" for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("surfaces", type=Path, nargs="*", help="surface JSONL files (default: the committed ones)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "pair_share",
                        help="where the .md and .json go (default: benchmarks/results/pair_share)")
    args = parser.parse_args()
    paths = args.surfaces or sorted((ROOT / "surfaces").glob("*.jsonl"))
    for path in paths:
        if not path.is_file():
            parser.error(f"surface {str(path)!r}: no such file (allowed: a surface JSONL, e.g. "
                         "benchmarks/surfaces/tiny-cpu.jsonl)")
    rows = [measure(path) for path in paths]
    lines = ["# Pairs of knob values in the estimator's throughput error", "",
             "`" + " ".join(["python benchmarks/pair_share.py", *map(str, args.surfaces)]) + "`",
             "", *table(rows), "",
             f"The convergence figure puts PAIR_SHARE = {PAIR_SHARE:.0%} of a config's own residual on pairs."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"pair_share": PAIR_SHARE, "surfaces": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
