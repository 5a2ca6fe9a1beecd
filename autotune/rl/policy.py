"""A trained policy as a small file pair, loaded without Ray: `policy.pt` (the policy network's torch
weights) and `policy.json` (its shape, the action and observation layout it was trained on, and how
it was trained). Rebuilt as the plain torch network of `autotune.rl.network`; proposing costs one
forward pass of a small MLP."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from autotune.values.config import ConfigError
from autotune.values.units import shown
from autotune.files import atomic_output, load_json, sha256, write_atomic
from autotune.rl.network import NetSpec, mask_logits, policy_net

WEIGHTS = "policy.pt"
META = "policy.json"
FORMAT = 1


def layout(seconds: bool = False) -> dict[str, list[str]]:
    """The environment's action names and observation feature names (with the seconds block where `seconds`,
    EnvConfig.observe_seconds): a policy only fits the layout it was trained on."""
    from autotune.envs.actions import ACTIONS
    from autotune.envs.observation import features

    return {"actions": list(ACTIONS), "features": list(features(seconds))}


@dataclass(frozen=True)
class Policy:
    spec: NetSpec
    net: torch.nn.Module
    meta: Mapping[str, Any]
    path: Path | None = None

    @classmethod
    def load(cls, path: str | Path, check_layout: bool = True) -> "Policy":
        """From a directory holding policy.pt and policy.json (a training run's `policy/` or a shipped one).
        `check_layout`: refuse a policy trained on another action/observation layout than autotune's env."""
        folder = Path(path)
        if folder.is_file():
            folder = folder.parent
        weights, meta_path = folder / WEIGHTS, folder / META
        if not weights.is_file() or not meta_path.is_file():
            raise ConfigError(f"policy {str(path)!r}: expected {WEIGHTS} and {META} in that directory"
                              f"{training_run_hint(folder)}")
        meta = load_json(meta_path, "a policy's metadata (JSON)")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise ConfigError(f"policy {str(path)!r}: format {found!r}, this version reads {FORMAT}")
        if check_layout and not any(all(meta.get(k) == v for k, v in layout(seconds).items()) for seconds in (False, True)):
            raise ConfigError(f"policy {str(path)!r} was trained on another environment layout (actions or features "
                              f"differ): retrain it with `autotune rl train`")
        from autotune.envs import ENV_ID

        env = meta.get("env", ENV_ID)  # a policy saved without it (save_policy's callers) is taken as this one's
        if env != ENV_ID:
            raise ConfigError(f"policy {str(path)!r} was trained on environment {shown(str(env), 80)}, not {ENV_ID}: "
                              f"train one with `autotune rl train`")
        spec = NetSpec.from_dict(meta["spec"])
        net = policy_net(spec)
        net.load_state_dict(load_weights(weights))
        net.eval()
        return cls(spec, net, meta, folder)

    @property
    def observes_seconds(self) -> bool:
        """Trained on observations with each action's predicted trial seconds (EnvConfig.observe_seconds)."""
        return self.meta.get("features") == layout(True)["features"]

    def logits(self, observation: Mapping[str, np.ndarray]) -> np.ndarray:
        """Masked logits of one observation {"observations": vector, "action_mask": 0/1 per action}."""
        features = torch.as_tensor(np.asarray(observation["observations"], dtype=np.float32)).unsqueeze(0)
        mask = torch.as_tensor(np.asarray(observation["action_mask"], dtype=np.float32)).unsqueeze(0)
        with torch.no_grad():
            return mask_logits(self.net(features), mask)[0].numpy()

    def act(self, observation: Mapping[str, np.ndarray]) -> int:
        """The greedy action among those the mask allows."""
        mask = np.asarray(observation["action_mask"])
        if not (mask > 0.5).any():
            raise ValueError("the action mask allows no action")
        logits = self.logits(observation)
        logits[mask <= 0.5] = -np.inf
        return int(np.argmax(logits))


class NotWeights(ConfigError):
    """policy.pt is not a torch weights file (random bytes, another file, one cut short)."""


def load_weights(path: Path) -> Any:
    """policy.pt's state dict (torch's weights-only loader: no code in it runs); ConfigError, one line, for a file that
    is not a torch weights file, without torch's advice to load it with weights_only=False (arbitrary code)."""
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol ..." of a file that is no torch save anyway
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):  # unreadable: said as such (strategies.rl)
        raise
    except Exception as err:  # noqa: BLE001  torch's loaders raise anything on random bytes (IndexError, KeyError ...)
        raise NotWeights(f"{path} is not a torch weights file ({weights_error(err)}): export it again") from None
    if not isinstance(state, dict):
        raise NotWeights(f"{path} is not a torch weights file (it holds a {type(state).__name__}, not a state dict): "
                          f"export it again")
    return state


def weights_error(err: BaseException) -> str:
    """What torch.load said of a file it could not read, short, without its advice on weights_only."""
    text = str(err)
    if "WeightsUnpickler error:" in text:  # the weights-only loader's cause, after its advice
        text = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n", 1)[0]
    elif "weights_only" in text:
        text = ""
    else:
        text = text.strip().split("\n", 1)[0].split(". ", 1)[0]
    text = " ".join(text.split())
    name = type(err).__name__
    return f"{name}: {text[:117] + '...' if len(text) > 120 else text}" if text else name


def digest(folder: str | Path) -> str:
    """The SHA-256 of an exported policy's two files: what a sweep searched with, whatever its folder holds later."""
    return sha256(Path(folder) / META, Path(folder) / WEIGHTS)


def training_run_hint(folder: str | Path) -> str:
    """Where `folder` is a training run's (`autotune rl train --out`), ` (a training run: its policy is
    'RUN/policy')`; else empty."""
    inner = Path(folder) / "policy"
    return f" (a training run: its policy is {str(inner)!r})" if (inner / WEIGHTS).is_file() else ""


def save_policy(folder: str | Path, spec: NetSpec, state_dict: Mapping[str, torch.Tensor],
                meta: Mapping[str, Any]) -> Path:
    """Write policy.pt and policy.json into `folder`, each replaced atomically. `meta` should carry the
    layout (`actions`, `features`) of the environment it was trained on."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_output(folder / WEIGHTS) as handle:
        torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, handle)
    data = {"format": FORMAT, "spec": spec.to_dict(), **dict(meta)}
    write_json(folder / META, data)
    return folder


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")
