"""Confirmation of close calls: after the search, the configs whose measured throughput lies within the
launch-to-launch spread of the best are run again in fresh processes, and the recommendation is the best
median over each config's runs.

One launch can mislead: on this machine two launches of one config differed by a median of 13%, by 43%
at the 90th percentile and by 3.9x at worst (ARCHITECTURE.md section 4), so the single fastest trial of a
search is often a lucky launch (the winner's curse) and a runner-up a few percent behind may be the faster
config. The rules, all functions of the recorded trials (so a resumed sweep makes the same decisions):

- A *repeat* is a trial of a config the sweep measured before; it is recorded in trials.jsonl like any
  trial, with `"phase": "confirm"` and `"repeat_of": <trial number of the config's first run>`. A failed
  repeat (oom, crash, ...) counts as throughput 0: a config that fails one launch in two is no safe pick.
- The *spread* is the standard deviation `sigma` of ln(throughput) between launches of one config: pooled
  from this run's repeats once they give MIN_DOF degrees of freedom, before that the backend's prior
  (real trials: this machine's measured 13% median difference; the simulated backend: its noise).
- The *finalists* are the configs whose median lies within WINDOW typical launch differences
  (0.954 sigma, the median |ln(a/b)| of two launches) of the best median, at most MAX_FINALISTS of them.
  The best alone is a finalist too: its repeats catch a lucky launch, after which the runners-up may come
  within the window.
- Each finalist is run until it has `1 + repeats` runs, fewest runs first; the finalists are chosen anew
  after every result.
- Budget: repeats count in the sweep's trial budget. The search stops early enough to leave them room
  (`reserve`), but confirmation never takes more than SHARE of the trials while the search could still use
  them; once the search is done (the strategy has nothing left), it may use the rest.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Collection, Iterable, Sequence

from autotune.values.config import Config
from autotune.values.results import CONFIRM, TrialResult
from autotune.values.units import counted

DEFAULT_REPEATS = 2  # repeats per finalist for backends whose trials run on devices (deepspeed, script)
MAX_FINALISTS = 3
SHARE = 0.25  # of the trial budget, at most, while the search could still use the trials
WINDOW = 1.0  # finalists: within this many typical launch differences of the best median
MIN_DOF = 3  # degrees of freedom of this run's repeats before they replace the prior spread
# The median |ln(a/b)| of two launches is sigma * sqrt(2) * 0.6745 (the median of a half-normal).
TYPICAL = math.sqrt(2) * 0.6744897501960817
# Two launches of one config differed by a median of 13% on this machine (ARCHITECTURE.md section 4;
# benchmarks/confirmation.py measures it again from benchmarks/surfaces/repeats/).
MACHINE_SPREAD = 0.13
MACHINE_SIGMA = math.log1p(MACHINE_SPREAD) / TYPICAL

PHASE = CONFIRM  # a repeat's `phase` (TrialResult.phase)


def is_repeat(result: TrialResult) -> bool:
    return result.phase == CONFIRM


def default_repeats(backend_name: str) -> int:
    """DEFAULT_REPEATS for a registered backend whose trials run on devices, else 0 (simulated, replay: the
    same config gives the same answer, unless the simulation has noise and the caller asks)."""
    from autotune.backends.factory import backend_kind
    from autotune.values.config import ConfigError

    try:
        return DEFAULT_REPEATS if backend_kind(backend_name).real else 0
    except ConfigError:  # a user's backend object: no kind registered
        return 0


def prior_sigma(backend_name: str, backend: Any = None) -> float:
    """The launch spread assumed before this run has repeats of its own: a backend's own `noise` (the
    simulated backend's lognormal sigma), this machine's measured spread for real trials, else 0."""
    noise = getattr(backend, "noise", None)
    if isinstance(noise, (int, float)) and not isinstance(noise, bool) and math.isfinite(noise) and noise >= 0:
        return float(noise)
    return MACHINE_SIGMA if default_repeats(backend_name) else 0.0


@dataclass(frozen=True)
class Spread:
    """The launch-to-launch spread of throughput: sigma of ln(throughput), and where it came from."""

    sigma: float
    dof: int  # degrees of freedom from this run's repeats (0: the prior)
    source: str

    @property
    def typical(self) -> float:
        """The median relative difference between two launches of one config (0.13: 13%)."""
        return math.expm1(TYPICAL * self.sigma)


@dataclass(frozen=True)
class Candidate:
    """One config's runs within the budget: its first run (the search's) and its repeats."""

    config: Config
    results: tuple[TrialResult, ...]
    throughputs: tuple[float, ...]  # 0.0 for a run that failed or went over budget

    @property
    def first(self) -> TrialResult:
        return self.results[0]

    @property
    def runs(self) -> int:
        return len(self.results)

    @property
    def median(self) -> float:
        return statistics.median(self.throughputs)

    @property
    def failed(self) -> int:
        return sum(t == 0.0 for t in self.throughputs)

    @property
    def trials(self) -> tuple[int, ...]:
        return tuple(int(r.extra.get("trial", 0)) for r in self.results)

    def logs(self) -> list[float]:
        return [math.log(t) for t in self.throughputs if t > 0]


def candidates(results: Iterable[TrialResult], budget_bytes: int | None) -> list[Candidate]:
    """Every config with a run within the budget, best median first; among equal medians the lower peak (the highest
    of its runs within the budget: what as_one reports), then the smaller config (its knobs in order: stage, micro-batch, ...). Never the record's order: trials in
    flight together (a Ray cluster) are recorded as they finish, and a tie then went to whichever finished first."""
    runs: dict[Config, list[TrialResult]] = {}
    for r in results:
        if r.status != "pruned":
            runs.setdefault(r.config, []).append(r)
    out = []
    for config, group in runs.items():
        if any(r.fits(budget_bytes) for r in group):
            out.append(Candidate(config, tuple(group),
                                 tuple(r.throughput if r.fits(budget_bytes) else 0.0 for r in group)))

    def rank(c: Candidate) -> tuple[float, float, Config]:
        peaks = [r.peak_memory_bytes for r in c.results if r.fits(budget_bytes) and r.peak_memory_bytes]
        return -c.median, max(peaks) if peaks else math.inf, c.config  # Config's order: its knobs', smallest first
    return sorted(out, key=rank)


def spread(cands: Sequence[Candidate], prior: float | None) -> Spread:
    """Pooled sigma of ln(throughput) over the configs run more than once (failed runs left out), once
    they give MIN_DOF degrees of freedom; before that the prior (None: unknown, taken as 0)."""
    squares, dof, groups = 0.0, 0, 0
    for c in cands:
        logs = c.logs()
        if len(logs) > 1:
            mean = sum(logs) / len(logs)
            squares += sum((x - mean) ** 2 for x in logs)
            dof += len(logs) - 1
            groups += 1
    if dof >= MIN_DOF or (dof and prior is None):
        return Spread(math.sqrt(squares / dof), dof,
                      f"this run's repeats ({counted(groups, 'config')}, {counted(dof, 'degree')} of freedom)")
    if prior is None or prior == 0:
        return Spread(0.0, 0, "none assumed (no repeats yet)")
    # The machine prior was measured on the developers' 2-core CPU, not on the machine at hand: said so.
    return Spread(prior, 0, "a prior until this run's repeats measure it: launches on the developers' 2-core CPU"
                  if prior == MACHINE_SIGMA else "the backend's noise")


def finalists(cands: Sequence[Candidate], sp: Spread) -> list[Candidate]:
    """The best and the configs whose median lies within WINDOW typical launch differences of it."""
    if not cands:
        return []
    top = cands[0].median
    window = WINDOW * TYPICAL * sp.sigma
    close = [c for c in cands if c.median > 0 and math.log(top / c.median) <= window + 1e-12]
    return close[:MAX_FINALISTS]


@dataclass(frozen=True)
class Plan:
    """What confirmation still wants, given the recorded results and the repeats in flight."""

    finalists: tuple[Candidate, ...]
    spread: Spread
    wanted: int  # repeats not yet started
    next: Config | None  # the next repeat to launch (None: none wanted, or all wanted are in flight)


def plan(results: Sequence[TrialResult], budget_bytes: int | None, repeats: int, prior: float | None,
         in_flight: Collection[Config] = ()) -> Plan:
    """The finalists and the repeats they still need: each finalist up to 1 + `repeats` runs, counting those
    in flight; the finalist with the fewest runs goes next (the faster first among equals). While the best
    stands alone and is not confirmed, one more slot of `repeats` is wanted for a runner-up it may let in."""
    cands = candidates(results, budget_bytes)
    sp = spread(cands, prior)
    chosen = finalists(cands, sp)
    if repeats <= 0 or not chosen:
        return Plan(tuple(chosen), sp, 0, None)
    flying = {c: sum(f == c for f in in_flight) for c in set(in_flight)}
    runs = {c.config: c.runs + flying.get(c.config, 0) for c in chosen}
    wanted = sum(max(0, 1 + repeats - n) for n in runs.values())
    if len(chosen) == 1 and runs[chosen[0].config] < 1 + repeats:
        wanted += repeats
    ready = [c for c in chosen if runs[c.config] < 1 + repeats and c.config not in flying]
    ready.sort(key=lambda c: runs[c.config])  # stable: the faster first among equals
    return Plan(tuple(chosen), sp, wanted, ready[0].config if ready else None)


def reserve(results: Sequence[TrialResult], budget_bytes: int | None, repeats: int, prior: float | None,
            trials: int, in_flight: Collection[Config] = ()) -> int:
    """Trials the search leaves for confirmation now: what the plan wants, at most SHARE of `trials` less
    the repeats already run."""
    if repeats <= 0:
        return 0
    done = sum(is_repeat(r) for r in results) + sum(1 for c in in_flight if any(r.config == c for r in results))
    cap = max(0, int(SHARE * trials) - done)
    return min(plan(results, budget_bytes, repeats, prior, in_flight).wanted, cap)


def trials_to_confirm(results: Sequence[TrialResult], budget_bytes: int | None, repeats: int,
                      prior: float | None) -> tuple[int, int]:
    """The `--trials` a resumed sweep needs for confirmation to run every repeat it wants now, and how many search
    trials it runs first: the search goes on while confirmation's share of `--trials` is short of the repeats."""
    launched = sum(r.status != "pruned" for r in results)
    wanted = plan(results, budget_bytes, repeats, prior).wanted
    done = sum(is_repeat(r) for r in results)
    trials = max(launched + wanted, math.ceil((wanted + done) / SHARE))
    return trials, trials - launched - wanted


def recommend(results: Sequence[TrialResult], budget_bytes: int | None) -> TrialResult | None:
    """The config with the best median over its runs (fastest single run where none was repeated; among equals
    the lower peak, then the smaller config: candidates), as one result (`as_one`)."""
    cands = candidates(results, budget_bytes)
    return as_one(cands[0], budget_bytes) if cands else None


def as_one(candidate: Candidate, budget_bytes: int | None) -> TrialResult:
    """A config's runs as one result: its first run's record with the median throughput and step time and the
    highest peak of its runs (what a user should plan for), `runs` and `throughput_runs` added; a config run
    once, that run."""
    if candidate.runs == 1:
        return candidate.first
    ok = [r for r in candidate.results if r.fits(budget_bytes)]
    median = candidate.median
    first = candidate.first
    per_sample_tokens = (first.tokens_per_s / first.throughput) if first.tokens_per_s and first.ok else None
    peaks = [r.peak_memory_bytes for r in ok if r.peak_memory_bytes]
    representative = first if first.fits(budget_bytes) else ok[0]
    # The step time of the median throughput (throughput is the global batch over it), not a median of its own:
    # the two medians of two runs disagree (6.88 s against 16 / 2.36 = 6.78 s).
    step = representative.step_time_s
    return replace(representative, status="ok", throughput_samples_per_s=median,
                   tokens_per_s=None if per_sample_tokens is None else median * per_sample_tokens,
                   step_time_s=step * representative.throughput / median if step and median else step,
                   peak_memory_bytes=max(peaks) if peaks else representative.peak_memory_bytes,
                   extra={**representative.extra, "trial": first.extra.get("trial"), "runs": candidate.runs,
                          "throughput_runs": list(candidate.throughputs)})


def normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@dataclass(frozen=True)
class Comparison:
    """The pick against one other finalist."""

    other: Candidate
    gap: float  # the pick's median over the other's, less 1
    wins: int  # pairs (a run of the pick, a run of the other) the pick's run was faster in
    pairs: int
    probability: float | None  # that the pick is truly faster, given the spread (None: spread unknown)


def compare(pick: Candidate, other: Candidate, sp: Spread) -> Comparison:
    wins = sum(a > b for a in pick.throughputs for b in other.throughputs)
    pairs = pick.runs * other.runs
    gap = pick.median / other.median - 1 if other.median > 0 else math.inf
    a, b = pick.logs(), other.logs()
    probability = None
    if a and b and sp.sigma > 0:
        difference = sum(a) / len(a) - sum(b) / len(b)
        probability = normal_cdf(difference / (sp.sigma * math.sqrt(1 / len(a) + 1 / len(b))))
    elif a and b and sp.dof:  # repeats that never varied: the order is certain
        probability = 1.0 if sum(a) / len(a) > sum(b) / len(b) else 0.5
    return Comparison(other, gap, wins, pairs, probability)


def confidence_words(probability: float | None) -> str:
    if probability is None:
        return "unknown (no measure of the launch spread)"
    if probability >= 0.95:
        return "sure"
    if probability >= 0.8:
        return "likely, not certain"
    if probability >= 0.6:
        return "a lean, not a decision"
    return "a toss-up: within the launch noise, either will do"


@dataclass(frozen=True)
class Confirmation:
    """The confirmation of a finished sweep, for the report and summary.json."""

    finalists: tuple[Candidate, ...]  # the pick first
    spread: Spread
    comparisons: tuple[Comparison, ...]  # the pick against each other finalist
    repeats: int  # repeat trials recorded

    @property
    def pick(self) -> Candidate:
        return self.finalists[0]

    @property
    def probability(self) -> float | None:
        """That the pick is faster than every other finalist (the product over them, as if independent;
        1 with no other finalist)."""
        out = 1.0
        for c in self.comparisons:
            if c.probability is None:
                return None
            out *= c.probability
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "repeat_trials": self.repeats,
            "spread": {"sigma": self.spread.sigma, "typical_difference": self.spread.typical,
                       "dof": self.spread.dof, "source": self.spread.source},
            "finalists": [{"config": c.config.to_dict(), "trials": list(c.trials), "runs": c.runs,
                           "throughputs": list(c.throughputs), "median": c.median, "min": min(c.throughputs),
                           "max": max(c.throughputs), "failed": c.failed} for c in self.finalists],
            "pick_faster_probability": self.probability,
            "comparisons": [{"config": c.other.config.to_dict(), "gap": c.gap, "wins": c.wins, "pairs": c.pairs,
                             "probability": c.probability} for c in self.comparisons],
        }


def confirmation(results: Sequence[TrialResult], budget_bytes: int | None, prior: float | None) -> Confirmation | None:
    """The finalists as the sweep ended and how sure the pick is; None when nothing ran within the budget."""
    cands = candidates(results, budget_bytes)
    if not cands:
        return None
    sp = spread(cands, prior)
    chosen = finalists(cands, sp)
    # Configs that were repeated but fell out of the window stay in the table: the reader sees why.
    repeated = [c for c in cands if c.runs > 1 and c not in chosen]
    shown = tuple(chosen + repeated)
    comparisons = tuple(compare(shown[0], c, sp) for c in shown[1:])
    return Confirmation(shown, sp, comparisons, sum(is_repeat(r) for r in results))
