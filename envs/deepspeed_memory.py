"""`autotune/DeepSpeedMemory-v0`: tune one workload's DeepSpeed memory config under a memory budget,
one trial per step.

Configuration: an `EnvConfig` (envs/config.py, which lists the keys) or an `env_config` dict of the same
keys, as RLlib and `gymnasium.make("autotune/DeepSpeedMemory-v0", env_config={...})` pass it.

Episode. `reset` asks the environment's episode source (envs/episodes.py; by default the tasks the
config describes: a fixed workload, one drawn by the workload sampler, or a replay surface) for a task
and a start config (not yet measured). Each `step` applies an action (envs/actions.py): an edit of the
current config, or a `jump` to the best unmeasured config of the predictions corrected by the episode's
trials (envs/residuals.py), followed by one trial of the new config through the backend; `run` (a trial
of the current config); or `stop`. The episode terminates on `stop` and is truncated after `horizon`
steps (a masked action uses one up too); a step after either is a ResetNeeded error, no trial run. A step
changes the episode only once its trial returned: one interrupted (Ctrl-C in the backend) leaves it as it was.
`close()` closes the backends the episode source made (a real backend's ranks started ahead).

Observation: `{"observations": float32 vector (envs/observation.py FEATURES), "action_mask": float32
0/1 per action}` (the layout of RLlib's action-masking examples). The mask forbids edits that lead to
configs invalid for the task (Space.invalid_reason) or, on replay, not measured in the surface;
`run` once the current config was measured; `stop` before any trial.

Reward: envs/reward.py. `info`: `result` (the TrialResult as a dict, {} when nothing ran), `config`
(current), `best` (the episode's best feasible config, throughput, peak and step, or {}), `trials`,
`action`, `invalid_action`, `task`, `reference_throughput` (the reward's normaliser),
`optimum_throughput` (the task's true best where known: simulated without noise, replay; else None) and
`chance_of_better` (unless `chance_info` is off: the sweep's convergence stop's figure, autotune.search.convergence: the chance that an unmeasured
config fits and is more than 2% faster than the best, from the episode's corrected predictions);
with `flat_info`, numbers and strings with the same keys at every step (`_flat_info`; a figure not there is -1,
`ABSENT`). `result` and `best` are dicts at every step, so that gymnasium's vector environments
can merge them; a figure that is None in one copy and an integer in another (a real out-of-memory trial's missing
peak) can still trip that merge, which `flat_info` avoids. A source may
rewrite the info (the training simulator's flat info judges the best config by its hidden truth).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any, Mapping

import gymnasium as gym
import numpy as np

from autotune.values.config import KNOBS, Config, ConfigError
from autotune.values.results import TrialResult

from autotune.envs import observation as obs
from autotune.envs.actions import ACTIONS, FIRST_EDIT, JUMP, RUN, STOP
from autotune.envs.config import BACKENDS, CONFIG_KEYS, DEFAULT_SAMPLER, STARTS, EnvConfig
from autotune.envs.episodes import Episode, EpisodeSource, TaskSource
from autotune.envs.residuals import Residuals

__all__ = ["BACKENDS", "CONFIG_KEYS", "DEFAULT_SAMPLER", "STARTS", "DeepSpeedMemoryEnv", "EnvConfig", "Episode",
           "EpisodeSource"]


class DeepSpeedMemoryEnv(gym.Env):
    """`env_config`: an EnvConfig or a dict of its keys. `source`: where episodes come from (default: the
    tasks `env_config` describes, envs/episodes.py TaskSource, built from the same config)."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, env_config: EnvConfig | Mapping[str, Any] | None = None, render_mode: str | None = None, *,
                 source: EpisodeSource | None = None) -> None:
        self.config = config = EnvConfig.of(env_config)
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ConfigError(f"render_mode={render_mode!r}: allowed {self.metadata['render_modes']}")
        self.render_mode = render_mode
        self.horizon = config.horizon
        self.reward_spec = config.reward
        self.source: EpisodeSource = source if source is not None else TaskSource(config)

        self.action_space = gym.spaces.Discrete(len(ACTIONS))
        self.observation_space = gym.spaces.Dict({
            "observations": gym.spaces.Box(-1.0, 1.0, (obs.size(config.observe_seconds),), np.float32),
            "action_mask": gym.spaces.Box(0.0, 1.0, (len(ACTIONS),), np.float32),
        })
        self._episode: Episode | None = None
        self._ended = True  # no episode under way: before the first reset, after the step that ended one, after close()

    # -- gymnasium API ------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is None and self._episode is None and self.config.seed is not None:
            seed = int(self.config.seed)
        super().reset(seed=seed)
        episode = self.source.episode(self.np_random)
        start = self.source.start(episode, self.np_random)
        land = episode.landscape
        self._episode, self._current = episode, start  # after the draws, which may build a landscape (slow)
        self._ended = False
        self._measured = np.zeros(len(land), dtype=bool)
        self._steps = 0
        self._trials = 0
        self._best_throughput = 0.0
        self._best_before = 0.0
        self._best: dict[str, Any] | None = None
        self._best_index = -1
        self._last: TrialResult | None = None
        self._ops_built: set[str | None] = {None}  # the ops this episode's trials have loaded (None: no op)
        self._residuals = Residuals(land)
        self.allowed = np.ones(len(land), dtype=bool)  # configs `jump` may go to (a caller may narrow them)
        return self._observation(), self._info(None, "reset", False)

    def step(self, action: Any):
        if self._episode is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        if self._ended:  # as gymnasium's OrderEnforcing refuses a step before reset: no trial past the end
            raise gym.error.ResetNeeded("step() called after the episode ended: call reset()")
        if not self.action_space.contains(action):  # outside Discrete(18): no action at all, not a masked one
            raise ValueError(f"action {action!r}: allowed an integer 0..{len(ACTIONS) - 1} (autotune.envs.actions.ACTIONS)")
        action = int(action)
        target = self._target(action)
        invalid = not self._mask_now[action] or (action != STOP and target < 0)
        # The trial before any change: one interrupted (Ctrl-C in the backend) leaves the episode as it was.
        result = None if invalid or action == STOP else self._trial(target)
        self._steps += 1
        if result is not None:
            self._record(target, result)
        reward = self._reward(action, invalid, result)
        terminated = not invalid and action == STOP
        truncated = not terminated and self._steps >= self.horizon
        self._ended = terminated or truncated
        return self._observation(), float(reward), terminated, truncated, self._info(result, ACTIONS[action], invalid)

    def _reward(self, action: int, invalid: bool, result: TrialResult | None) -> float:
        """envs/reward.py: a penalty for a masked action, the stop's reward, or the trial's."""
        ep, spec = self._episode, self.reward_spec
        assert ep is not None
        if invalid:
            return -spec.invalid_action_penalty
        if action == STOP:
            return spec.stop(self._best_throughput, ep.reference, self.horizon - self._steps + 1)
        assert result is not None
        return spec.trial(result, ep.task.memory_budget_bytes, ep.reference, self._best_before, ep.seconds_unit)

    def render(self) -> str | None:  # type: ignore[override]  # an "ansi" frame is a string
        if self.render_mode != "ansi" or self._episode is None:
            return None
        config = self._episode.landscape.configs[self._current]
        last = self._last
        status = "-" if last is None else f"{last.status} {last.throughput_samples_per_s or 0:.4g} samples/s"
        best = "-" if self._best is None else f"{self._best['throughput_samples_per_s']:.4g} samples/s"
        return f"step {self._steps}/{self.horizon} {config.label()}: {status}; best {best}"

    def close(self) -> None:
        """Close the backends the episode source made (its `close`, where it has one); a later reset makes new ones."""
        close = getattr(self.source, "close", None)
        if callable(close):
            close()
        self._ended = True  # its backend is closed: a step needs a reset first
        super().close()

    # -- episode mechanics --------------------------------------------------------------------------

    def _target(self, action: int) -> int:
        """The config a trial action (run, an edit, jump) leads to; -1 where none (`stop`, an edit off the space,
        `jump` with nowhere to go), whatever the mask says."""
        ep = self._episode
        assert ep is not None
        if action == STOP:
            return -1
        if action == JUMP:
            return self._jump
        if action == RUN:
            return self._current
        return int(ep.landscape.moves[self._current, action])

    def _trial(self, index: int) -> TrialResult:
        """One trial of config `index`, as seen under the task's budget; changes nothing of the episode."""
        ep = self._episode
        assert ep is not None
        return ep.backend.run(ep.landscape.configs[index]).under_budget(ep.task.memory_budget_bytes)

    def _record(self, index: int, result: TrialResult) -> None:
        """The episode after a trial of config `index`: there now, its result observed, the best updated."""
        ep = self._episode
        assert ep is not None
        config = ep.landscape.configs[index]
        budget = ep.task.memory_budget_bytes
        self._current = index
        self._residuals.observe(index, result, budget)
        self._measured[index] = True
        if result.status != "pruned":  # a trial that ran loaded its op, out of memory or not
            self._ops_built.add(ep.landscape.trial_ops[index])
        self._trials += 1
        self._last = result
        self._best_before = self._best_throughput
        if result.fits(budget) and (result.throughput_samples_per_s or 0.0) > self._best_throughput:
            self._best_throughput = float(result.throughput_samples_per_s or 0.0)
            self._best_index = index
            self._best = {"config": config.to_dict(), "throughput_samples_per_s": self._best_throughput,
                          "peak_memory_bytes": result.peak_memory_bytes, "step": self._steps}

    # -- observation --------------------------------------------------------------------------------

    def _mask(self) -> np.ndarray:
        ep = self._episode
        assert ep is not None
        mask = ep.landscape.edit_mask[self._current].copy()
        if self.config.mask_revisits:
            moves = ep.landscape.moves[self._current, FIRST_EDIT:]
            mask[FIRST_EDIT:] *= ~self._measured[moves]
        mask[RUN] = float(not self._measured[self._current])
        mask[JUMP] = float(self._jump >= 0)
        mask[STOP] = float(self._trials > 0)
        return mask

    def _observation(self) -> dict[str, np.ndarray]:
        ep = self._episode
        assert ep is not None
        land, budget, cur = ep.landscape, ep.task.memory_budget_bytes, self._current
        vector = np.zeros(obs.size(self.config.observe_seconds), dtype=np.float32)
        vector[obs.TASK_AT:obs.CONFIG_AT] = ep.task_features
        vector[obs.CONFIG_AT:obs.RESULT_AT] = ep.static[cur]
        last = self._last
        vector[obs.RESULT_AT + obs.STATUS_SLOT["none" if last is None else last.status]] = 1.0
        at = obs.RESULT_AT + len(obs.OBSERVED_STATUSES)
        if last is not None:
            measured = last.throughput_samples_per_s or 0.0
            if self._best_throughput > 0:
                vector[at] = min(1.0, measured / self._best_throughput)
            if last.peak_memory_bytes is not None:
                vector[at + 1] = obs.ratio_feature(float(last.peak_memory_bytes), budget, 4.0)
                vector[at + 3] = obs.ratio_feature(float(last.peak_memory_bytes), float(land.peak[cur]))
            if measured > 0:
                vector[at + 2] = obs.ratio_feature(measured, float(land.throughput[cur]))
        e = obs.EPISODE_AT
        vector[e] = (self.horizon - self._steps) / self.horizon
        vector[e + 1] = self._trials / self.horizon
        vector[e + 2] = float(self._best is not None)
        vector[e + 3] = float(self._best_index == cur)
        vector[e + 4] = min(1.0, self._best_throughput / ep.predicted_best / 2)
        vector[e + 5] = float(self._measured[cur])
        self._jump_features(vector)
        self._fit_features(vector)
        if self.config.observe_seconds:
            self._seconds_features(vector)
        self._mask_now = self._mask()
        return {"observations": vector, "action_mask": self._mask_now.copy()}

    def _jump_features(self, vector: np.ndarray) -> None:
        """Where `jump` leads (self._jump, -1 if nowhere) and its corrected predictions in the observation."""
        ep = self._episode
        assert ep is not None
        budget, model = ep.task.memory_budget_bytes, self._residuals
        candidates = model.fits(budget) & ~self._measured & self.allowed & ep.landscape.host_fits
        log_throughput = model.log_throughput()
        self._jump = int(np.argmax(np.where(candidates, log_throughput, -np.inf)))
        if not candidates[self._jump]:
            self._jump = -1
            return
        throughput = math.exp(log_throughput[self._jump])
        block = obs.ACTIONS_AT + JUMP * len(obs.PREDICTION_NAMES)
        vector[block] = obs.ratio_feature(model.peak_at(self._jump), budget, 4.0)
        vector[block + 1] = min(1.0, throughput / ep.predicted_best / 2)
        if self._best_throughput > 0:
            vector[obs.EPISODE_AT + 6] = obs.ratio_feature(throughput, self._best_throughput)

    def _targets(self) -> tuple[np.ndarray, np.ndarray]:
        """The actions that lead to a config (`run`: the current one; `jump`: self._jump) and those configs."""
        assert self._episode is not None
        targets = self._episode.landscape.moves[self._current].copy()
        targets[RUN], targets[JUMP] = self._current, self._jump
        leads = np.flatnonzero(targets >= 0)
        return leads, targets[leads]

    def _fit_features(self, vector: np.ndarray) -> None:
        """Per action, the probability that the config it leads to fits the budget (0 where it leads nowhere)."""
        ep = self._episode
        assert ep is not None
        leads, targets = self._targets()
        vector[obs.FIT_AT + leads] = self._residuals.fit_probability(targets, ep.task.memory_budget_bytes)

    def _seconds_features(self, vector: np.ndarray) -> None:
        """Per action, the predicted seconds of a trial of the config it leads to, in the episode's unit (0 where it
        leads nowhere): its op's first build counted while no trial of this episode has loaded that op."""
        ep = self._episode
        assert ep is not None
        land = ep.landscape
        leads, to = self._targets()
        built = np.array([land.trial_ops[i] in self._ops_built for i in to], dtype=bool)
        seconds = land.trial_seconds[to] + np.where(built, 0.0, land.first_build_s[to])
        vector[obs.SECONDS_AT + leads] = obs.seconds_feature(seconds, ep.seconds_unit)

    # -- info -------------------------------------------------------------------------------------------

    def _info(self, result: TrialResult | None, action: str, invalid: bool) -> dict[str, Any]:
        ep = self._episode
        assert ep is not None
        current = ep.landscape.configs[self._current]
        if self.config.flat_info:
            info = self._flat_info(result, action, invalid, current)
        else:
            config = {k: getattr(current, k) for k in KNOBS}
            # {} rather than None where nothing is there: gymnasium's vector environments merge a dict key by key
            info = {"result": {} if result is None else _result_dict(result, config),
                    "config": config,
                    "best": {} if self._best is None else dict(self._best),
                    "trials": self._trials, "action": action, "invalid_action": invalid,
                    "task": ep.task_info, "reference_throughput": ep.reference,
                    "optimum_throughput": ep.optimum}
        if self.config.chance_info:  # the same key at every step, flat or not
            info["chance_of_better"] = self._chance_of_better()
        return self.source.info(ep, info, result)

    def _chance_of_better(self) -> float:
        ep = self._episode
        assert ep is not None
        untried = np.flatnonzero(~self._measured)
        return self._residuals.chance_of_better(untried, ep.task.memory_budget_bytes, self._best_throughput)

    def _flat_info(self, result: TrialResult | None, action: str, invalid: bool, current: Config) -> dict[str, Any]:
        """Same keys and value types at every step (vector environments merge infos key by key); a figure absent
        is ABSENT, not NaN, which equals nothing, itself included (gymnasium's checker compares infos)."""
        ep = self._episode
        assert ep is not None
        best = self._best
        return {"trials": self._trials, "action": action, "invalid_action": invalid,
                "status": "none" if result is None else result.status,
                "throughput_samples_per_s": ABSENT if result is None else float(result.throughput_samples_per_s or ABSENT),
                "peak_memory_bytes": ABSENT if result is None or result.peak_memory_bytes is None
                else float(result.peak_memory_bytes),
                "config": current.to_json(), "result": "" if result is None else result.to_json(),
                "best_throughput": self._best_throughput,
                "best_config": "" if best is None else json.dumps(best["config"]),
                "reference_throughput": float(ep.reference),
                "optimum_throughput": ABSENT if ep.optimum is None else float(ep.optimum)}


ABSENT = -1.0  # a flat info's figure that is not there (throughputs, peaks and optima are never negative)
RESULT_FIELDS = tuple(f.name for f in fields(TrialResult) if f.name not in ("config", "extra"))


def _result_dict(result: TrialResult, config: dict[str, Any]) -> dict[str, Any]:
    """TrialResult.to_dict() with the config's dict precomputed (asdict dominated the step time)."""
    out: dict[str, Any] = {"config": dict(config)}
    for name in RESULT_FIELDS:
        out[name] = getattr(result, name)
    out.update(result.extra)
    return out
