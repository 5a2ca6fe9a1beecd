"""The policy and value networks as plain torch, shared by the RLlib module (training) and the Ray-free
policy (inference), so that exported weights load into exactly the network that was trained."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch import nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


@dataclass(frozen=True)
class NetSpec:
    """Shape of the networks: observation features in, one logit per discrete action out."""

    obs_dim: int
    n_actions: int
    hiddens: tuple[int, ...] = (128, 128)
    activation: str = "tanh"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: allowed {sorted(ACTIVATIONS)}")
        object.__setattr__(self, "hiddens", tuple(int(h) for h in self.hiddens))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hiddens": list(self.hiddens)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NetSpec":
        return cls(int(data["obs_dim"]), int(data["n_actions"]), tuple(data["hiddens"]), data["activation"])


def mlp(in_dim: int, hiddens: Sequence[int], out_dim: int, activation: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hiddens:
        layers += [nn.Linear(in_dim, width), ACTIVATIONS[activation]()]
        in_dim = width
    layers.append(nn.Linear(in_dim, out_dim))
    return nn.Sequential(*layers)


def policy_net(spec: NetSpec) -> nn.Sequential:
    net = mlp(spec.obs_dim, spec.hiddens, spec.n_actions, spec.activation)
    # Small last layer: the initial policy is near-uniform over the allowed actions (PPO practice).
    last = net[-1]
    assert isinstance(last, nn.Linear), "mlp ends in its output layer, a Linear"
    nn.init.orthogonal_(last.weight, gain=0.01)
    nn.init.zeros_(last.bias)
    return net


def value_net(spec: NetSpec) -> nn.Sequential:
    return mlp(spec.obs_dim, spec.hiddens, 1, spec.activation)


def mask_logits(logits: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Forbidden actions (mask 0) get the lowest float: probability exactly 0, no gradient through them."""
    return logits.masked_fill(action_mask <= 0.5, torch.finfo(logits.dtype).min)
