"""Whether a trial's optimizer steps trained, as the engine shows it: each step applied or skipped (DeepSpeed's fp16
loss scaler skips a step whose gradients overflowed, and halves its scale), the loss of each, and the verdict a
measurement needs before it may be `ok` (issue 40: every fp16 trial on a GPU had skipped every step, recorded ok).

The worker and the script shim keep one `Ledger` per rank: warm-up lasts until a step was applied (fp16's search for
its scale, from 2^16 down, is warm-up), only applied steps are timed, the memory window opens after the first
applied step (the optimizer's state exists), and at the end `verdict()` names what no measurement may hide: every step
skipped, a loss that is not finite, or one that never moved. Overflow decisions are all-reduced inside DeepSpeed,
so every rank's ledger agrees.

Only fp16 has a loss scaler, so only there is a skipped step normal (the search for its scale, an overflow now and
then). In fp32 and bf16 DeepSpeed skips a step only when its gradients were not finite: any skipped step, or any loss
that is not finite, makes the trial `nonfinite` (never `overflow`), and ends warm-up at once. In fp16 a loss that is
not finite on an applied step is `nonfinite`, and a scaler that did not settle over the measured steps (most of them
skipped, or the last STUCK_STEPS in a row) `overflow`. The record's `loss_first` is the first applied step's loss (the
first step's where none was applied), `loss_last` the last step's, applied or not: a run whose loss turned NaN ends on
NaN, not on its last finite loss; null in JSON where not finite, the fault's message naming it.

A loss held in 16 bits moves in steps of its quantum (bf16: 2^-5 near 6.4, 8 bits of mantissa), so a run that trains
can repeat one value for several steps; a loss whose values are all exactly representable in bf16 or fp16 counts as
flat only after FLAT_STEPS_16BIT applied steps, any other (fp32) after 2.
"""

from __future__ import annotations

import math
import struct
import traceback
from dataclasses import dataclass, field
from typing import Any

from autotune.values.results import FLAT, NONFINITE, OVERFLOW, SCALER_AT_MINIMUM

# More warm-up steps than DeepSpeed's dynamic scaler needs to go from 2^16 to its minimum of 1 (hysteresis 2, then
# one halving an overflow: 18 steps), after which it raises SCALER_AT_MINIMUM on the next overflow.
SETTLE_STEPS = 24
MIN_LOSS_SCALE = 1.0  # autotune.values.dsconfig's min_loss_scale: a step that overflows there never trains
# Applied steps a loss must repeat one value over to be flat: one held in fp32 moves on every step that trains; one
# held in 16 bits (its every value exact in bf16 or fp16) can stay on one quantum while it trains (a bf16 loss of
# 6.4375 four times, then 5.7188): only so many repeats say its updates changed nothing.
FLAT_STEPS = 2
FLAT_STEPS_16BIT = 16
# fp16: skipped steps in a row at the end of a run that say its scaler did not settle. DeepSpeed's hysteresis of 2 lets
# a settled scaler skip one step keeping its scale, then skip one halving it; a third in a row overflowed at half the
# scale the run trained at: its last steps did not train.
STUCK_STEPS = 3


# The keys of a rank's report, and of the trial's record, that show what its optimizer steps did (Ledger.evidence).
TRAINING_EVIDENCE = ("steps_applied", "steps_skipped", "steps_skipped_measuring", "first_applied_step", "loss_first",
                     "loss_last", "loss_scale", "optimizer_state_bytes")


class Untrained(Exception):
    """The trial's steps did not train (`fault`: autotune.values.results.TRAINING_FAULTS); `evidence` is the ledger."""

    def __init__(self, fault: str, message: str, evidence: dict[str, Any]) -> None:
        super().__init__(message)
        self.fault, self.evidence = fault, evidence


@dataclass
class Ledger:
    """One rank's optimizer steps, in order."""

    fp16: bool = False
    applied: int = 0
    skipped: int = 0
    skipped_measuring: int = 0  # skipped steps after warm-up: not timed
    losses: list[float] = field(default_factory=list)  # each applied step's loss (its last micro-step's)
    trace: list[tuple[bool, float | None]] = field(default_factory=list)  # every step: (applied, loss or None)
    first_applied: int | None = None  # 1-based step number of the first applied step
    loss_scale: float | None = None  # fp16: the scaler's scale after the latest step
    last_applied: bool = False
    optimizer_state_bytes: int | None = None  # when measurement began (autotune.worker.training.state_bytes)
    measured: int = 0  # steps after warm-up, applied or skipped
    skipped_in_a_row: int = 0  # skipped steps since the latest applied one

    @property
    def steps(self) -> int:
        return self.applied + self.skipped

    @property
    def settled(self) -> bool:
        """The latest step was applied: the scaler found a scale that trains, and the optimizer's state exists."""
        return self.last_applied

    def record(self, applied: bool, loss: float | None, loss_scale: float | None, measuring: bool = False) -> None:
        """One optimizer step; `loss` None where it is not known (a script that never passed one to backward)."""
        self.last_applied = applied
        self.loss_scale = loss_scale
        self.trace.append((applied, loss))
        self.measured += measuring
        if applied:
            self.applied += 1
            self.skipped_in_a_row = 0
            if loss is not None:
                self.losses.append(loss)
            if self.first_applied is None:
                self.first_applied = self.steps
        else:
            self.skipped += 1
            self.skipped_measuring += measuring
            self.skipped_in_a_row += 1

    def observe(self, engine: Any, skipped_before: int, loss: Any, measuring: bool = False) -> bool:
        """Record the optimizer step a DeepSpeed `engine` just took (`skipped_before`: its `skipped_steps` before the
        step, `loss`: the step's last loss tensor); returns whether it was applied."""
        applied = engine.skipped_steps == skipped_before
        scale = getattr(engine.optimizer, "loss_scale", None) if self.fp16 else None
        value = float(loss.detach().float().item()) if loss is not None else None
        self.record(applied, value, float(scale) if scale is not None else None, measuring)
        return applied

    def warming(self, warmup_steps: int) -> bool:
        """Whether warm-up goes on: fewer than `warmup_steps` steps (at least one), or the latest skipped; raises
        Untrained at once on a step that did not train (`nonfinite`: a loss not finite; outside fp16 any skipped
        step), and in fp16 when the scaler still skips at its minimum scale, or after SETTLE_STEPS more steps."""
        fault = self.nonfinite()
        if fault is not None:
            raise self.untrained(*fault)
        if self.steps < max(warmup_steps, 1):  # at least one step: the memory window opens after an applied one
            return True
        if self.settled:
            return False
        at_minimum = self.loss_scale is not None and self.loss_scale <= MIN_LOSS_SCALE
        if self.steps >= warmup_steps + SETTLE_STEPS or at_minimum:
            raise self.untrained(OVERFLOW, self._overflow_message())
        return True

    def verdict(self) -> tuple[str, str] | None:
        """(fault, message) when the steps do not show training, else None."""
        fault = self.nonfinite()
        if fault is not None:
            return fault
        if not self.applied:  # fp16 (outside it a skipped step is `nonfinite` above), or no step at all
            return OVERFLOW, self._overflow_message()
        if self.fp16 and self.measured and (2 * self.skipped_measuring > self.measured
                                            or self.skipped_in_a_row >= STUCK_STEPS):
            return OVERFLOW, self._unsettled_message()
        if all(loss == self.losses[0] for loss in self.losses[1:]):
            width = sixteen_bit(self.losses)
            if len(self.losses) >= (FLAT_STEPS_16BIT if width else FLAT_STEPS):
                held = f", held in {width}" if width else ""
                return FLAT, (f"the loss never moved over {self.applied} applied optimizer steps ({self.losses[0]:g}"
                              f"{held}): the updates changed nothing")
        return None

    def nonfinite(self) -> tuple[str, str] | None:
        """(`nonfinite`, message) naming the first step that did not train for want of finite numbers: one whose loss
        was not finite (in fp16 an applied one: a skipped one is the loss scaler's), or outside fp16 a skipped one
        (without a loss scaler DeepSpeed skips a step only when its gradients were not finite); else None."""
        for number, (applied, loss) in enumerate(self.trace, 1):
            bad_loss = loss is not None and not math.isfinite(loss)
            if not (bad_loss and (applied or not self.fp16) or not (applied or self.fp16)):
                continue
            where = f"step {number} of {self.steps}"
            what = (f"the loss was {loss} at {where}" if bad_loss else
                    f"{where} was skipped, its gradients not finite (its loss {_shown(loss)})")
            notes = [f"the last step's loss {_shown(self.trace[-1][1])}"] if number < self.steps else []
            notes += [f"{self.skipped} of {self.steps} steps skipped"] if self.skipped else []
            shown = f" ({', '.join(notes)})" if notes else ""
            scaler = "" if self.fp16 else "; without fp16's loss scaler a step that trains is never skipped"
            return NONFINITE, f"{what}{shown}{scaler}: the steps did not train"
        return None

    def untrained(self, fault: str, message: str) -> Untrained:
        return Untrained(fault, message, self.evidence())

    def _overflow_message(self) -> str:
        scale = f", loss scale down to {self.loss_scale:g}" if self.loss_scale is not None else ""
        kind = "fp16: " if self.fp16 else ""
        return (f"{kind}every one of {self.steps} optimizer steps overflowed and was skipped{scale}: no step trained, "
                "so no figure of this config would be a measurement")

    def _unsettled_message(self) -> str:
        scale = f", loss scale down to {self.loss_scale:g}" if self.loss_scale is not None else ""
        return (f"fp16: {self.skipped_measuring} of the {self.measured} measured optimizer steps overflowed and were "
                f"skipped, the last {self.skipped_in_a_row} in a row{scale}: the loss scaler did not settle, so no "
                "figure of this config would be a measurement")

    def evidence(self) -> dict[str, Any]:
        """The keys a rank's report (and the trial's record) carries: TRAINING_EVIDENCE. `loss_first`: the first
        applied step's loss (the first step's where none was applied); `loss_last`: the last step's, applied or not."""
        def finite(loss: float | None) -> float | None:  # JSON has no NaN: the fault's message names a loss that was not
            return loss if loss is not None and math.isfinite(loss) else None

        first = self.trace[self.first_applied - 1 if self.first_applied else 0][1] if self.trace else None
        values = (self.applied, self.skipped, self.skipped_measuring, self.first_applied, finite(first),
                  finite(self.trace[-1][1] if self.trace else None), self.loss_scale, self.optimizer_state_bytes)
        return dict(zip(TRAINING_EVIDENCE, values))


def _shown(loss: float | None) -> str:
    return "unknown" if loss is None else f"{loss:g}"


def sixteen_bit(losses: list[float]) -> str | None:
    """"bf16" or "fp16" when every one of `losses` is exactly a value of that format (a loss held in it, whatever dtype
    it was read in), else None: an fp32 loss is exact in bf16 only by chance (1 in 2^16)."""
    def exact(loss: float, fmt: str) -> bool:
        try:
            if fmt == "bf16":  # fp32 whose low 16 bits are zero
                bits = struct.unpack("<I", struct.pack("<f", loss))[0]
                return struct.unpack("<f", struct.pack("<I", bits))[0] == loss and not bits & 0xFFFF
            return struct.unpack("<e", struct.pack("<e", loss))[0] == loss
        except (OverflowError, struct.error):
            return False

    if not losses:
        return None
    return next((fmt for fmt in ("bf16", "fp16") if all(exact(loss, fmt) for loss in losses)), None)


def scaler_gave_up(err: BaseException) -> bool:
    """Whether `err` is DeepSpeed's loss scaler refusing to go below its minimum scale: every step overflowed."""
    return SCALER_AT_MINIMUM in str(err) and any(f.name == "update_scale" for f in traceback.extract_tb(err.__traceback__))


def state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer state this rank holds (Adam's m and v, ...) in the torch optimizer DeepSpeed steps:
    0 before its first applied step."""
    total = 0
    for state in getattr(optimizer, "state", {}).values():
        for value in state.values() if isinstance(state, dict) else ():
            if hasattr(value, "numel") and hasattr(value, "element_size"):
                total += value.numel() * value.element_size()
    return total
