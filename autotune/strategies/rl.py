"""`rl`: a trained policy (autotune.rl) searches the space one trial at a time, by single-knob edits of the
current config and by jumps to the best unmeasured config of the predictions corrected by its trials.

The policy acts in the same environment it was trained in (`autotune/DeepSpeedMemory-v0`), built for
this search's workload, hardware, budget and space, whose backend is a relay: the environment's trial
of a config returns the result the driver measured for it. `propose()` takes the policy's greedy masked
action and returns the config that action leads to; `observe()` hands that config's result to the
environment, which steps and yields the next observation. The episode starts at the estimator's best
predicted config and ends after the training horizon, or earlier where the sweep stops: the policy's own `stop`
is masked, since when a search has done enough is the sweep's one decision (its stop rule, trial and time
budgets), and the policy learnt its stop at a flat price per trial in simulated worlds (on the held-out GPU-like
worlds at 3% noise, `rl` ended by the policy's stop reached 98% of the optimum in 58% of runs, median 677
trial-seconds; ended by the sweep, 76% and 288 s: benchmarks/results/rl_seconds_policy.md). In `hybrid` the
policy may stop (`may_stop`): there its stop hands the search over to Optuna. Its best feasible config is the
recommendation. Edits back to configs measured earlier in the episode are masked
(`mask_revisits`), as is, on a replay surface, every config the surface never measured (`jump` chooses
among the surface's configs only). A proposal the tuner prunes is not a trial: the policy proposes again
from the same state without it, so a pruning-heavy start (an uncalibrated estimator that over-predicts
memory) does not use up the episode.

The policy is the shipped one (autotune/policies/default), or an exported one (`autotune rl export`: a folder of
policy.pt + policy.json) that `autotune tune --policy DIR` names (TuneSpec.policy; `load_policy` refuses a folder
that is not one, or a policy whose network does not fit the environment's observation and action spaces).

Resume: the policy is deterministic, so a resumed sweep replays the same walk, each known config
answered from the record (run.json keeps the --policy folder: a resumed sweep must name the same).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.values.config import Config, ConfigError, first_line
from autotune.envs.actions import JUMP, RUN, STOP
from autotune.values.results import TrialResult
from autotune.strategies import SearchContext

if TYPE_CHECKING:
    from autotune.envs.landscape import Landscape
    from autotune.rl.policy import Policy

DEFAULT_HORIZON = 16


class Relay:
    """A backend whose `run` returns the result the driver measured (set just before the step)."""

    def __init__(self, name: str = "relay") -> None:
        self.name = name
        self.result: TrialResult | None = None

    def run(self, config: Config) -> TrialResult:
        result, self.result = self.result, None
        if result is None or result.config != config:
            raise RuntimeError(f"relay: no measured result for {config.to_json()}")
        return result


class RLStrategy:
    name = "rl"

    def __init__(self, context: SearchContext, policy: Any = None, max_trials: int | None = None,
                 may_stop: bool = False) -> None:
        from autotune.envs import DeepSpeedMemoryEnv
        from autotune.rl.policy import Policy
        from autotune.policies import policy_path

        self.context = context
        self.policy = policy if policy is not None else Policy.load(policy_path())
        training = self.policy.meta.get("training", {}).get("settings", {})
        horizon = int(training.get("horizon", DEFAULT_HORIZON))
        self.max_trials = max_trials
        self.may_stop = may_stop  # the policy's `stop` ends its proposals (hybrid: Optuna goes on alone)
        space = context.space
        self.relay = Relay()
        self.env = DeepSpeedMemoryEnv({
            "backend": self.relay, "workload": space.workload, "hardware": space.hardware,
            "memory_budget": context.budget_bytes, "space": space.choices, "start": "estimator",
            "horizon": horizon, "mask_revisits": True, "seed": context.seed,
            "observe_seconds": bool(getattr(self.policy, "observes_seconds", False))})
        self.observation, _ = self.env.reset(seed=context.seed)
        if space.only is not None:
            self._start_within_space()
        self.pending: tuple[int, Config] | None = None
        self.proposed = 0
        self.pruned: set[Config] = set()  # proposals the tuner's pruner refused: never proposed again
        self.done = False

    # -- the Strategy interface

    def propose(self) -> Config | None:
        if self.done:
            return None
        if self.pending is not None:
            return self.pending[1]  # not observed yet: the same proposal stands
        if self.max_trials is not None and self.proposed >= self.max_trials:
            self.done = True
            return None
        mask = self._mask()
        if not mask[1:].any():
            self.done = True
            return None
        action = self.policy.act({"observations": self.observation["observations"], "action_mask": mask})
        if action == STOP:  # only where the policy may stop: it hands the search over
            self.done = True
            return None
        config = self._target(action)
        self.pending = (action, config)
        self.proposed += 1
        return config

    def observe(self, config: Config, result: TrialResult) -> None:
        if self.pending is None or self.pending[1] != config:
            return  # history of a resumed sweep, or someone else's trial: the walk asks again if it needs it
        action, _ = self.pending
        self.pending = None
        if result.status == "pruned":
            # Not a trial: the policy proposes again from the same state without that config (the
            # tuner's calibrated pruner knows better than the environment's uncalibrated predictions).
            self.proposed -= 1
            self.pruned.add(config)
            env = self.env
            index = self._landscape().index.get(config)
            if index is not None:
                env.allowed[index] = False
            self.observation = env._observation()
            return
        self.relay.result = result
        self.observation, _, terminated, truncated, _ = self.env.step(action)
        if terminated or truncated:
            self.done = True

    # -- helpers

    def _landscape(self) -> Landscape:
        episode = self.env._episode
        assert episode is not None, "the environment was reset in __init__"
        return episode.landscape

    def _start_within_space(self) -> None:
        """On a restricted space (a replay surface), start at the estimator's best predicted config among the
        space's configs rather than of the whole product of the knob values, which the surface may never
        have measured (the environment takes its start from its own, unrestricted view of the space)."""
        env = self.env
        landscape, budget = self._landscape(), self.context.budget_bytes
        inside = np.array([c in self.context.space for c in landscape.configs])
        env.allowed = inside
        if not inside.any() or inside[env._current]:
            self.observation = env._observation()  # `jump` now chooses within the space
            return
        fits = inside & landscape.feasible(budget)
        pool = np.flatnonzero(fits) if fits.any() else np.flatnonzero(inside)
        key = landscape.throughput if fits.any() else -landscape.peak
        env._current = int(pool[np.argmax(key[pool])])
        self.observation = env._observation()

    def _target(self, action: int) -> Config:
        """The config an action leads to from the current one (the environment's move table)."""
        env = self.env
        landscape = self._landscape()
        if action == JUMP:
            return landscape.configs[env._jump]
        index = env._current if action == RUN else int(landscape.moves[env._current, action])
        return landscape.configs[index]

    def _mask(self) -> np.ndarray:
        """The environment's mask, without `stop` unless the policy may stop (alone, the sweep decides when the
        search ends), narrowed to actions leading into this search's space (a replay surface's measured configs)
        and away from configs the tuner pruned."""
        mask = np.array(self.observation["action_mask"], dtype=np.float32)
        if not self.may_stop:
            mask[STOP] = 0.0
        space = self.context.space
        if space.only is not None or self.pruned:
            for action in np.flatnonzero(mask[1:] > 0.5) + 1:
                target = self._target(int(action))
                if target not in space or target in self.pruned:
                    mask[action] = 0.0
        return mask


def load_policy(folder: str | Path) -> "Policy":
    """The exported policy in `folder` (`autotune rl export`: policy.pt + policy.json) for `--policy`, loaded as the
    shipped one is (Policy.load, which refuses another format or environment layout); ConfigError, one line, for a
    folder that is not one, unreadable files, or a network whose inputs and outputs are not the environment's
    observation and action spaces (DeepSpeedMemoryEnv's: a feature per observation, a logit per action)."""
    from autotune.envs.actions import ACTIONS
    from autotune.envs.observation import size
    from autotune.rl.policy import META, WEIGHTS, NotWeights, Policy, training_run_hint

    path = Path(folder)
    expected = f"expected a folder holding {WEIGHTS} and {META}, as `autotune rl export` writes"
    if not path.is_dir():
        raise ConfigError(f"--policy (`policy`) {folder}: {'not a folder' if path.exists() else 'no such folder'}: {expected}")
    missing = [name for name in (META, WEIGHTS) if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"--policy (`policy`) {folder}: no {' or '.join(missing)} there{training_run_hint(path)}: {expected}")
    try:
        policy = Policy.load(path)
    except NotWeights as err:  # random bytes: torch's own words advise loading it as code (weights_only=False)
        raise ConfigError(f"--policy (`policy`) {folder}: its {WEIGHTS} and {META} do not load as a policy: {err}") from None
    except ConfigError as err:
        raise ConfigError(f"--policy (`policy`) {folder}: {err}") from None
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as err:
        # a spec without its keys, weights that are not its network's (another shape), a damaged policy.pt
        raise ConfigError(f"--policy (`policy`) {folder}: its {WEIGHTS} and {META} do not load as a policy ({first_line(err)}): export "
                          "it again with `autotune rl export`") from None
    obs_dim, n_actions = size(policy.observes_seconds), len(ACTIONS)
    if (policy.spec.obs_dim, policy.spec.n_actions) != (obs_dim, n_actions):
        raise ConfigError(f"--policy (`policy`) {folder}: its network takes {policy.spec.obs_dim} observation features and "
                          f"gives {policy.spec.n_actions} actions; the environment has {obs_dim} and {n_actions}: "
                          "retrain it with `autotune rl train`")
    return policy


def rl(context: SearchContext, policy: Any = None) -> RLStrategy:
    """`rl` with the shipped policy, or `policy` (a loaded Policy: TuneSpec.policy's, strategies.with_policy)."""
    return RLStrategy(context, policy)
