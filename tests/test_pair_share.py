"""benchmarks/pair_share.py (issue 28): the share of the estimator's throughput error that pairs of knob values
explain, which defends the convergence figure's PAIR_SHARE: planted pairwise errors are found, none where there are
none, and the committed surfaces give what the figure's docs quote."""

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

from autotune.values.config import Config

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("pair_share", ROOT / "benchmarks" / "pair_share.py")
assert _SPEC is not None and _SPEC.loader is not None
pair_share = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pair_share)

CONFIGS = [Config(z, mb, ck, p)
           for z, mb, ck, p in itertools.product((0, 1, 2, 3), (1, 2, 4, 8), (0, 1), ("fp32", "bf16"))]


def test_planted_pairs_are_found_and_their_absence_too():
    rng = np.random.default_rng(0)
    main = np.array([0.1 * c.zero_stage - 0.05 * np.log2(c.micro_batch) for c in CONFIGS])
    pairs = np.array([0.2 * (c.zero_stage == 3 and c.micro_batch == 8)
                      + 0.15 * (c.ckpt_interval == 1 and c.precision == "bf16") for c in CONFIGS])
    noise = 0.02 * rng.standard_normal(len(CONFIGS))
    knobs, rank = pair_share.residual_sd(pair_share.design(CONFIGS, False), main + pairs + noise)
    both, pair_rank = pair_share.residual_sd(pair_share.design(CONFIGS, True), main + pairs + noise)
    assert rank == 1 + 3 + 3 + 1 + 1 and pair_rank > rank
    assert 1 - (both / knobs) ** 2 > 0.8
    knobs, _ = pair_share.residual_sd(pair_share.design(CONFIGS, False), main + noise)
    both, _ = pair_share.residual_sd(pair_share.design(CONFIGS, True), main + noise)
    assert 1 - (both / knobs) ** 2 < 0.3  # the extra parameters are not counted as explained
    assert pair_share.residual_sd(pair_share.design(CONFIGS[:3], True), main[:3])[0] is None  # no dof left


def test_the_committed_surfaces_have_the_quoted_shares():
    surfaces = sorted((ROOT / "benchmarks" / "surfaces").glob("*.jsonl"))
    rows = {r["surface"]: r for r in map(pair_share.measure, surfaces)}
    assert rows["tiny-cpu.jsonl"]["share"] == pytest.approx(0.75, abs=0.03)
    assert rows["small-llama-cpu.jsonl"]["share"] == pytest.approx(0.25, abs=0.03)
