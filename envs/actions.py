"""The environment's actions: edits of the current config, plus `run` and `stop`.

The action set is the same for every workload and space (a fixed `Discrete(len(ACTIONS))`), so one
policy serves all tasks; the mask says which actions the current task and config allow.

- `stop`: end the episode (recommend the best feasible config found); allowed once a trial has run.
- `run`: measure the current config as it is; allowed while it has not been measured in this episode
  (the start config of an episode is not measured until `run` or an edit back to it).
- `<knob>+` / `<knob>-` for the ordered knobs (ZeRO stage, micro-batch, checkpoint interval): move to the
  next larger / smaller value of the space's choices that gives a valid config, skipping values that
  are invalid for this workload (e.g. a micro-batch that does not divide the global batch).
- `<knob>=<value>` for the categorical knobs (precision, optimizer offload, parameter offload): set the
  value, if it is in the space, differs from the current one and gives a valid config.
- `jump`: move to the config with the best throughput predicted by the estimator *corrected by this
  episode's measurements* (envs/residuals.py) among those not measured yet and predicted to fit; a walk
  of single edits costs a trial per step, and the corrected optimum is often several edits away.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.values.config import KNOBS, OFFLOADS, PRECISIONS

ORDERED_KNOBS = ("zero_stage", "micro_batch", "ckpt_interval")
CATEGORICAL_KNOBS = {"precision": PRECISIONS, "offload_optimizer": OFFLOADS, "offload_param": OFFLOADS}


@dataclass(frozen=True)
class Edit:
    knob: str
    step: int = 0  # +1 / -1 along an ordered knob; 0 for a categorical set
    value: str | None = None  # the value a categorical edit sets

    @property
    def knob_position(self) -> int:
        return KNOBS.index(self.knob)

    @property
    def name(self) -> str:
        if self.value is not None:
            return f"{self.knob}={self.value}"
        return f"{self.knob}{'+' if self.step > 0 else '-'}"


STOP, RUN = 0, 1
EDITS: tuple[Edit, ...] = (
    *(Edit(knob, step) for knob in ORDERED_KNOBS for step in (+1, -1)),
    *(Edit(knob, value=value) for knob, values in CATEGORICAL_KNOBS.items() for value in values),
)
FIRST_EDIT = 2
JUMP = FIRST_EDIT + len(EDITS)
ACTIONS: tuple[str, ...] = ("stop", "run", *(edit.name for edit in EDITS), "jump")


def action_index(name: str) -> int:
    return ACTIONS.index(name)
