"""The workload sampler: range of tasks, held-out splits, pools; and the shared layouts of the landscape."""

import numpy as np
import pytest

from autotune.values.config import ConfigError
from autotune.envs.landscape import LruCache, build_landscape, build_layout, validity_key
from autotune.envs.sampler import WorkloadSampler
from autotune.prediction.estimate import estimate
from autotune.values.space import Space


def draws(sampler, n=300, seed=0):
    rng = np.random.default_rng(seed)
    return [sampler.sample(rng) for _ in range(n)]


def test_train_split_never_draws_held_out_tasks_and_covers_the_range():
    sampler = WorkloadSampler("train")
    tasks = draws(sampler)
    assert all(sampler.held_out(t) == () for t in tasks)
    params = [t.workload.model.params for t in tasks]
    assert 1e6 <= min(params) < 1e7 and 1e10 < max(params) <= 7e10
    assert {t.hardware.name for t in tasks} == {"v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb"}
    assert {t.workload.model.arch for t in tasks} == {"gpt", "llama"}
    assert len({t.workload.gpus for t in tasks}) >= 5
    assert not {"gpt2-large", "llama-13b"} & {t.workload.model.name for t in tasks}
    for t in tasks:
        assert t.memory_budget_bytes <= t.hardware.memory_bytes
        assert t.workload.global_batch % t.workload.gpus == 0


def test_test_split_holds_out_at_least_one_dimension_and_all_mixes():
    sampler = WorkloadSampler("test")
    tasks = draws(sampler)
    held = [sampler.held_out(t) for t in tasks]
    assert all(held)
    assert {dim for h in held for dim in h} == {"shape", "budget", "hardware"}
    mixed = WorkloadSampler("all")
    kinds = {bool(mixed.held_out(t)) for t in draws(mixed)}
    assert kinds == {True, False}


def test_held_out_shapes_are_a_property_of_the_shape():
    sampler = WorkloadSampler("test", held_out_budget_fractions=(), held_out_profiles=())
    tasks = draws(sampler, 100)
    assert all(sampler.held_out(t) == ("shape",) for t in tasks)
    train = WorkloadSampler("train", held_out_shape_fraction=0.5)
    assert all(not train.shape_held_out(t.workload.model) for t in draws(train, 100))


def test_pool_is_fixed_by_its_seed():
    sampler = WorkloadSampler(pool_size=5, seed=3)
    tasks = draws(sampler, 100)
    assert len({(t.workload, t.hardware.name, t.memory_budget_bytes) for t in tasks}) <= 5
    assert WorkloadSampler(pool_size=5, seed=3).pool == sampler.pool
    assert WorkloadSampler(pool_size=5, seed=4).pool != sampler.pool
    assert draws(WorkloadSampler(), 20, seed=7) == draws(WorkloadSampler(), 20, seed=7)


def test_bad_sampler_settings():
    for kwargs, match in [({"split": "dev"}, "split"), ({"profiles": ("tpu",)}, "profile"),
                          ({"budget_fractions": (1.5,)}, "budget fraction"), ({"pool_size": 0}, "pool_size"),
                          ({"held_out_presets": ("gpt5",)}, "preset"), ({"min_params": 1e9, "max_params": 1e6}, "empty"),
                          ({"profiles": ("l4",)}, "every hardware is held out"), ({"space": "nope"}, "no such file")]:
        with pytest.raises(ConfigError, match=match):
            WorkloadSampler(**kwargs)


def test_layouts_shared_by_validity_key_equal_each_space_own_configs():
    layouts = {}
    tasks = draws(WorkloadSampler("all"), 30, seed=11)
    for task in tasks:
        space = Space(task.choices, task.workload, task.hardware)
        key = validity_key(space)
        if key not in layouts:
            layouts[key] = build_layout(space)
        assert layouts[key].configs == space.configs, task.workload.model.name
    assert len(layouts) < len(tasks)  # the point of sharing


def test_landscape_predictions_and_feasibility():
    task = draws(WorkloadSampler(), 1, seed=2)[0]
    space = Space(task.choices, task.workload, task.hardware)
    land = build_landscape(space, lambda c: estimate(c, task.workload, task.hardware))
    for i in range(0, len(land), max(1, len(land) // 20)):
        est = estimate(land.configs[i], task.workload, task.hardware)
        assert land.peak[i] == est.peak_bytes and land.throughput[i] == pytest.approx(est.throughput_samples_per_s)
    fits = land.feasible(task.memory_budget_bytes)
    assert (land.peak[fits] <= task.memory_budget_bytes).all()
    if fits.any():
        assert land.predicted_best(task.memory_budget_bytes) == land.throughput[fits].max()


def test_lru_cache_evicts_the_least_recently_used():
    cache = LruCache(2)
    built = []
    get = lambda key: cache.get(key, lambda: built.append(key) or key)  # noqa: E731
    get("a"), get("b"), get("a"), get("c"), get("a"), get("b")
    assert built == ["a", "b", "c", "b"] and len(cache) == 2
