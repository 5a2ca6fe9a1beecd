"""The RLlib RLModule (new API stack) that PPO trains: an MLP policy whose logits are masked by the
observation's `action_mask`, and a separate MLP value function.

Written from scratch rather than subclassing PPO's default module (as RLlib's action-masking example does)
so that the networks are the plain torch ones of `autotune.rl.network`: the exported policy is then
rebuilt without Ray, layer for layer.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch

from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis.value_function_api import ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule

from autotune.rl.network import NetSpec, mask_logits, policy_net, value_net

OBS_KEY = "observations"
MASK_KEY = "action_mask"


def net_spec(observation_space: gym.Space | None, action_space: gym.Space | None,
             model_config: dict[str, Any]) -> NetSpec:
    if not isinstance(observation_space, gym.spaces.Dict) or {OBS_KEY, MASK_KEY} - set(observation_space.spaces):
        raise ValueError(f"the masked policy needs a Dict observation space with keys {OBS_KEY!r} and "
                         f"{MASK_KEY!r}, got {observation_space}")
    if not isinstance(action_space, gym.spaces.Discrete):
        raise ValueError(f"the masked policy needs a Discrete action space, got {action_space}")
    features = observation_space[OBS_KEY]
    return NetSpec(obs_dim=int(gym.spaces.flatdim(features)), n_actions=int(action_space.n),
                   hiddens=tuple(model_config.get("hiddens", (128, 128))),
                   activation=model_config.get("activation", "tanh"))


class MaskedPolicyModule(TorchRLModule, ValueFunctionAPI):
    """`model_config`: {"hiddens": [128, 128], "activation": "tanh"}."""

    def setup(self) -> None:
        # RLModule types these as optional and model_config as a dict or RLlib's DefaultModelConfig; net_spec
        # refuses spaces that are not the masked policy's, and this module's settings are a dict.
        config = self.model_config
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"the masked policy's model_config is a dict {{'hiddens': [...], 'activation': ...}}, "
                             f"got {config!r}")
        self.spec = net_spec(self.observation_space, self.action_space, dict(config or {}))
        self.pi = policy_net(self.spec)
        # Built on inference-only copies too: the state dicts of learner and env runners then match.
        self.vf = value_net(self.spec)

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        obs = batch[Columns.OBS]
        logits = self.pi(obs[OBS_KEY].float())
        return {Columns.ACTION_DIST_INPUTS: mask_logits(logits, obs[MASK_KEY])}

    def compute_values(self, batch: dict[str, Any], embeddings: Any = None) -> torch.Tensor:
        return self.vf(batch[Columns.OBS][OBS_KEY].float()).squeeze(-1)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy network's weights alone: what inference needs."""
        return {k: v.detach().cpu().clone() for k, v in self.pi.state_dict().items()}
