"""What Optuna's samplers see of an autotune study: the encoding they were tuned on, whatever the study stores.

The study stores what optuna-dashboard and the `optuna` CLI read (strategies/optuna_search.py): each ordered
knob (zero_stage, micro_batch, ckpt_interval) as a categorical over its real values (micro-batch 1/2/4/8), and
a config that ran and failed (out of memory, crash) as PRUNED with its constraint and no value, so the history
plots hold no floor of zeros. The samplers still see what they saw before (and what studies written before
hold): `<knob>_index`, an integer over the value's position, so that TPE's and the GP's kernels know that
micro-batch 4 lies between 2 and 8 (a categorical hides the order); and a failure as COMPLETE with the value
in its system attribute SAMPLER_VALUE_KEY (0.0), so the GP, which models COMPLETE trials only, still learns
the failed region from it (TPE ranks infeasible PRUNED and COMPLETE trials alike, by their constraint).
A study of either encoding, or of both (one resumed across the change), so samples exactly as before.

The samplers' random state (`random_state`, `set_random_state`: every numpy generator the sampler draws from, its
own and its fallback sampler's) is what a study does not hold: a resumed sweep's sampler, seeded afresh, would
draw what the first session's drew at its start, not what it would have drawn next. The optuna strategy keeps it in
the study after each proposal and sets it again when the study is resumed (strategies/optuna_search.py), so that
the same seed samples the same sweep across a resume.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Mapping, Sequence
from typing import Any, cast

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

INDEX = "_index"  # the samplers' name of an ordered knob: `micro_batch_index`
SAMPLER_VALUE_KEY = "autotune:sampler_value"  # on a PRUNED trial that ran: the value the samplers learn


class SamplerView(optuna.samplers.BaseSampler):
    """`inner` sampling over index-encoded ordered knobs of a study that stores their values."""

    def __init__(self, inner: optuna.samplers.BaseSampler, ordered: Mapping[str, Sequence[Any]]) -> None:
        self.inner = inner
        self.ordered = {knob: list(values) for knob, values in ordered.items()}  # knob -> the space's values
        self._finished: dict[int, FrozenTrial] = {}  # finished trials' views by trial id: they no longer change

    # -- translation

    def _index_distribution(self, name: str, dist: BaseDistribution) -> tuple[str, BaseDistribution] | None:
        if name in self.ordered and isinstance(dist, CategoricalDistribution):
            return name + INDEX, IntDistribution(0, len(dist.choices) - 1)
        return None

    def trial(self, trial: FrozenTrial) -> FrozenTrial:
        """`trial` as the samplers knew it."""
        if trial._trial_id in self._finished:
            return self._finished[trial._trial_id]
        params, dists, changed = {}, {}, False
        for name, dist in trial.distributions.items():
            value, indexed = trial.params[name], self._index_distribution(name, dist)
            if indexed is not None:
                value, (name, dist), changed = int(dist.to_internal_repr(value)), indexed, True
            params[name], dists[name] = value, dist
        ran = trial.state == TrialState.PRUNED and SAMPLER_VALUE_KEY in trial.system_attrs
        view = trial
        if changed or ran:
            view = copy.copy(trial)
            view.params, view.distributions = params, dists
            if ran:
                view.state, view.values = TrialState.COMPLETE, [trial.system_attrs[SAMPLER_VALUE_KEY]]
        if trial.state.is_finished():
            self._finished[trial._trial_id] = view
        return view

    def _real_space(self, space: dict[str, BaseDistribution]) -> dict[str, BaseDistribution]:
        out: dict[str, BaseDistribution] = {}
        for name, dist in space.items():
            knob = name.removesuffix(INDEX)
            values = self.ordered.get(knob)
            if name.endswith(INDEX) and values is not None and dist == IntDistribution(0, len(values) - 1):
                name, dist = knob, CategoricalDistribution(values)
            out[name] = dist
        return out

    def _view(self, study: optuna.Study) -> optuna.Study:
        return cast(optuna.Study, _StudyView(study, self))

    # -- the sampler interface, delegated

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self._real_space(self.inner.infer_relative_search_space(self._view(study), self.trial(trial)))

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        indexed: dict[str, BaseDistribution] = {}
        real: dict[str, tuple[str, CategoricalDistribution]] = {}  # index name -> (knob, its real distribution)
        for name, dist in search_space.items():
            pair = self._index_distribution(name, dist)
            if pair is not None:
                assert isinstance(dist, CategoricalDistribution)
                real[pair[0]] = (name, dist)
                name, dist = pair
            indexed[name] = dist
        params = self.inner.sample_relative(self._view(study), self.trial(trial), indexed)
        out = {}
        for name, value in params.items():
            if name in real:
                name, value = real[name][0], real[name][1].choices[value]
            out[name] = value
        return out

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        pair = self._index_distribution(param_name, param_distribution)
        view = self._view(study)
        if pair is None:
            return self.inner.sample_independent(view, self.trial(trial), param_name, param_distribution)
        assert isinstance(param_distribution, CategoricalDistribution)
        return param_distribution.choices[self.inner.sample_independent(view, self.trial(trial), *pair)]

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.inner.before_trial(self._view(study), self.trial(trial))

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        if state == TrialState.PRUNED and SAMPLER_VALUE_KEY in trial.system_attrs:
            state, values = TrialState.COMPLETE, [trial.system_attrs[SAMPLER_VALUE_KEY]]
        self.inner.after_trial(self._view(study), self.trial(trial), state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()

    # -- the random state, kept across a resume (module doc)

    def random_state(self) -> dict[str, Any]:
        """Every generator the sampler draws from, by attribute path, as JSON."""
        return {path: _encoded(state.get_state()) for path, state in random_states(self.inner).items()}

    def set_random_state(self, kept: Mapping[str, Any]) -> None:
        """The generators as `random_state` gave them; one it does not name (another sampler's) is left as it is."""
        for path, state in random_states(self.inner).items():
            if isinstance(kept.get(path), list):
                state.set_state(_decoded(kept[path]))


def random_states(sampler: optuna.samplers.BaseSampler, path: str = "") -> dict[str, np.random.RandomState]:
    """The numpy generators a sampler draws from, by attribute path: its own (`_rng`) and those of the samplers it
    falls back on (TPE's `_random_sampler`, the GP's `_independent_sampler`)."""
    found: dict[str, np.random.RandomState] = {}
    for name, value in sorted(vars(sampler).items()):
        if type(value).__name__ == "LazyRandomState":  # Optuna's own lazily seeded one (a private class: by name)
            found[path + name] = value.rng
        elif isinstance(value, np.random.RandomState):
            found[path + name] = value
        elif isinstance(value, optuna.samplers.BaseSampler) and value is not sampler and path.count(".") < 2:
            found.update(random_states(value, f"{path}{name}."))
    return found


def _encoded(state: Any) -> list[Any]:
    """A numpy generator's state (MT19937: its key, position and cached Gaussian) as JSON."""
    _, key, position, has_gauss, cached = state
    return [[int(k) for k in key], int(position), int(has_gauss), float(cached)]


def _decoded(kept: list[Any]) -> tuple[Any, ...]:
    key, position, has_gauss, cached = kept
    return "MT19937", np.array(key, dtype=np.uint32), int(position), int(has_gauss), float(cached)


class _StudyView:
    """The study with its trials as the samplers knew them; everything else (storage, directions) the study's."""

    def __init__(self, study: optuna.Study, view: SamplerView) -> None:
        self._study, self._sampler = study, view

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None,
                    use_cache: bool = False) -> list[FrozenTrial]:
        trials = [self._sampler.trial(t) for t in self._study._get_trials(deepcopy=deepcopy, use_cache=use_cache)]
        return trials if states is None else [t for t in trials if t.state in states]

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)

    @property
    def trials(self) -> list[FrozenTrial]:
        return self.get_trials()
