"""Per-episode figures logged during training, from the environment's last `info` of each episode:
trials run, whether the best feasible config found is within 2% of the task's optimum, best / optimum,
and trials that ran out of memory."""

from __future__ import annotations

from typing import Any

from ray.rllib.callbacks.callbacks import RLlibCallback

from autotune.rl.figures import episode_figures

WINDOW = 500  # the per-iteration figures are means over the last WINDOW episodes (RLlib smooths over a window)


class EpisodeFigures(RLlibCallback):
    def on_episode_step(self, *, episode: Any, metrics_logger: Any = None, **kwargs: Any) -> None:
        if episode.get_infos(-1).get("status") == "oom":
            # Counted on the episode itself, so that the end callback sees all of its steps.
            episode.custom_data["oom"] = episode.custom_data.get("oom", 0) + 1

    def on_episode_end(self, *, episode: Any, metrics_logger: Any = None, **kwargs: Any) -> None:
        if metrics_logger is None:
            return
        figures = episode_figures(episode.get_infos(-1), episode.custom_data.get("oom", 0))
        for key, value in figures.items():
            if value is not None:
                metrics_logger.log_value(key, value, reduce="mean", window=WINDOW)
