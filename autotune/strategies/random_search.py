"""`random`: uniform over the valid configs of the space, without replacement (seeded). Its results go to the sweep's
Optuna study as they are recorded (optuna_search.StudyRecord), so that the study loads and reads as any other's."""

from __future__ import annotations

import random

from autotune.values.config import Config
from autotune.values.results import TrialResult
from autotune.strategies import SearchContext
from autotune.strategies.optuna_search import StudyRecord


class RandomStrategy:
    name = "random"

    def __init__(self, context: SearchContext) -> None:
        self.order = list(context.space.configs)
        random.Random(context.seed).shuffle(self.order)
        self.known: set[Config] = set()
        self._next = 0
        self.study = StudyRecord(context, self.name)

    def propose(self) -> Config | None:
        self.study.follow_record()
        # Each config is proposed once: a driver with several trials in flight (drivers/ray.py) asks again
        # before the first result is in.
        while self._next < len(self.order) and self.order[self._next] in self.known:
            self._next += 1
        if self._next >= len(self.order):
            return None
        self._next += 1
        return self.order[self._next - 1]

    @property
    def notes(self) -> list[str]:
        """What following the record changed in its study (optuna_search.Record.follow), for the sweep to say."""
        return self.study.notes

    def observe(self, config: Config, result: TrialResult) -> None:
        self.known.add(config)
        self.study.observe(config, result, self.name)
