"""The Strategy protocol's contract (autotune.strategies): a strategy the user writes runs through
`autotune.tune()` as the registered ones do: its proposals run (or are pruned) in the order proposed, the
sweep stops when it has nothing left, a resumed sweep tells it the recorded results before it proposes, and
an object that is not a strategy is refused in one line."""

import json

import pytest

import autotune
from autotune.api import resolve
from autotune.values.config import ConfigError
from autotune.drivers.stop import StopReason


def spec(strategy, trials: int = 30) -> autotune.TuneSpec:
    return autotune.TuneSpec(autotune.make_workload("tiny", global_batch=16), autotune.load_hardware("cpu"),
                             memory_budget_bytes=int(0.85 * 2**30), strategy=strategy, trials=trials,
                             backend="simulated", seed=1, stop_when=0.0)


def configs(n: int) -> list:
    """n configs of the space, in an order no registered strategy uses (every third, from the end)."""
    _, space = resolve(spec("grid"))
    return list(space)[::-3][:n]


class FixedOrder:
    """A user's strategy: proposes its configs in order, skipping those it has been told of."""

    name = "fixed-order"

    def __init__(self, order):
        self.order = list(order)
        self.seen = {}
        self.events = []  # ("propose" | "observe", config)

    def propose(self):
        for config in self.order:
            if config not in self.seen:
                self.events.append(("propose", config))
                return config
        self.events.append(("propose", None))
        return None

    def observe(self, config, result):
        self.events.append(("observe", config))
        self.seen[config] = result


def test_a_user_strategy_runs_its_proposals_in_order_and_stops_when_done(tmp_path):
    order = configs(5)
    strategy = FixedOrder(order)
    result = autotune.tune(spec(strategy), out=tmp_path / "run")
    assert [r.config for r in result.results] == order  # each proposal recorded once: run or pruned
    assert result.stop_reason == StopReason.DONE
    assert set(strategy.seen) == set(order)
    assert all(strategy.seen[r.config].status == r.status for r in result.results)
    assert result.launched >= 1 and result.best is not None
    assert json.loads((tmp_path / "run" / "run.json").read_text())["strategy"] == "fixed-order"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["strategy"] == "fixed-order"


def test_a_resumed_sweep_tells_the_user_strategy_its_history_first(tmp_path):
    order = configs(6)
    first = autotune.tune(spec(FixedOrder(order), trials=2), out=tmp_path / "run")
    assert first.stop_reason == StopReason.TRIALS
    done = [r.config for r in first.results]
    assert done == order[:len(done)] and len(done) < len(order)
    again = FixedOrder(order)
    second = autotune.tune(spec(again), out=tmp_path / "run", resume=True)
    assert again.events[:len(done)] == [("observe", c) for c in done]  # before its first proposal
    assert [r.config for r in second.results] == order  # nothing run twice, the rest in order
    assert second.stop_reason == StopReason.DONE


class FromContext:
    """A strategy built from the sweep's context (the class itself is passed): the space's first configs."""

    name = "from-context"

    def __init__(self, context):
        self.todo = list(context.space)[:3]

    def propose(self):
        return self.todo.pop(0) if self.todo else None

    def observe(self, config, result):
        pass


def test_a_callable_builds_the_strategy_from_the_context(tmp_path):
    result = autotune.tune(spec(FromContext), out=tmp_path / "run")
    _, space = resolve(spec("grid"))
    assert [r.config for r in result.results] == list(space)[:3]
    assert result.stop_reason == StopReason.DONE
    assert json.loads((tmp_path / "run" / "run.json").read_text())["strategy"] == "from-context"


class ProposesOnly:
    def propose(self):
        return None


@pytest.mark.parametrize("bad", [ProposesOnly(), 42])
def test_an_object_that_is_not_a_strategy_is_one_line(bad):
    with pytest.raises(ConfigError) as err:
        spec(bad)
    message = str(err.value)
    assert "\n" not in message and "not a Strategy" in message and "observe(config, result)" in message


def test_a_builder_that_returns_no_strategy_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="not a Strategy") as err:
        autotune.tune(spec(lambda context: "grid"), out=tmp_path / "run")
    assert "\n" not in str(err.value)


def test_a_name_still_names_a_registered_strategy():
    with pytest.raises(ConfigError, match="strategy 'annealing': allowed grid"):
        spec("annealing")
