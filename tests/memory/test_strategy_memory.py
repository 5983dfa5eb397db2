"""`GeePSStrategy(device_memory_budget=...)`: the layer-wise trainer through
real shards (threads on 127.0.0.1), against the same run without a budget."""

import keras
import numpy as np
import pytest

import keras_geeps
from keras_geeps.errors import GeePSError
from keras_geeps.memory import MemoryBudgetError
from tests.memory.test_trainer import (BATCH, STEPS, WIDTH, batches, loss_fn,
                                       mlp, param_bytes)


def run(cluster, budget, data):
    strategy = keras_geeps.GeePSStrategy(client=cluster.client(0, timeout=30),
                                         device_memory_budget=budget)
    try:
        with strategy.scope():
            model = mlp()
        assert strategy.memory_plan is None
        trainer = strategy.layerwise_trainer(
            model, keras.optimizers.SGD(0.05), loss_fn(), BATCH, audit=True)
        losses = [float(trainer.train_step(x, y)) for x, y in data]
        strategy.sync()
        predictions = model.predict(data[0][0], verbose=0)
        return (model.get_weights(), losses, predictions,
                strategy.memory_plan, trainer.stats(), strategy.ps_stats())
    finally:
        strategy.close()


def test_budget_through_the_shards_matches_no_budget(thread_cluster):
    data = batches((WIDTH,), 10)
    budget = param_bytes(mlp()) // 4
    free = run(thread_cluster(2, 1), None, data)
    tight = run(thread_cluster(2, 1), budget, data)
    plan, stats, ps = tight[3], tight[4], tight[5]
    assert sum(plan.staged) >= len(plan.staged) - 2
    assert "host" in str(plan) and f"{budget:,}" in str(plan)
    # The shards saw every layer's update every step, staged or not.
    assert ps["steps"] == STEPS and free[5]["steps"] == STEPS
    assert ps["tables"] == len(plan.staged)
    for a, b in zip(free[0], tight[0]):
        np.testing.assert_array_equal(a, b)
    assert free[1] == tight[1]
    np.testing.assert_array_equal(free[2], tight[2])
    assert max(float(np.abs(a - b).max())
               for a, b in zip(free[0], mlp().get_weights())) > 1e-3
    assert stats["audit_mismatches"] == 0
    assert stats["audit_peak_bytes"] <= budget


def test_fit_is_refused_and_too_small_a_budget_named(thread_cluster):
    cluster = thread_cluster(1, 1)
    strategy = keras_geeps.GeePSStrategy(client=cluster.client(0, timeout=30),
                                         device_memory_budget=4096)
    try:
        with strategy.scope():
            model = mlp()
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn(),
                          jit_compile=False)
        x, y = batches((WIDTH,), 10, steps=1)[0]
        with pytest.raises(GeePSError, match="layerwise_trainer"):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        with pytest.raises(MemoryBudgetError, match="minimum budget"):
            strategy.layerwise_trainer(model, keras.optimizers.SGD(0.1),
                                       loss_fn(), BATCH)
    finally:
        strategy.close()


def _one_worker_trainer(thread_cluster, budget, optimizer):
    """(strategy, its mlp(), the layer-wise trainer of it) of the only
    worker of one thread shard, under `budget`."""
    strategy = keras_geeps.GeePSStrategy(
        client=thread_cluster(1, 1).client(0, timeout=30),
        device_memory_budget=budget)
    try:
        with strategy.scope():
            model = mlp()
        return strategy, model, strategy.layerwise_trainer(
            model, optimizer, loss_fn(), BATCH)
    except BaseException:
        strategy.close()
        raise


def test_every_predict_on_staged_layers_is_refused_until_synced(
        thread_cluster):
    """The check that the staged layers are back on the device ran only
    when predict's step was traced: a predict after a later train step
    (the layers staged out again) reused the trace and failed inside the
    pull op, on variables of 0 elements, naming nothing to do."""
    strategy, model, trainer = _one_worker_trainer(
        thread_cluster, param_bytes(mlp()) // 4, keras.optimizers.SGD(0.05))
    try:
        model.compile(loss=loss_fn(), jit_compile=False)
        (x, y), = batches((WIDTH,), 10, steps=1)
        for _ in range(2):
            trainer.train_step(x, y)
            with pytest.raises(GeePSError, match="call strategy.sync"):
                model.predict(x, verbose=0)
            strategy.sync()
            assert np.isfinite(model.predict(x, verbose=0)).all()
    finally:
        strategy.close()


@pytest.mark.parametrize("staged", [True, False],
                         ids=["staged", "resident"])
def test_weights_set_between_steps_are_what_the_next_step_trains_from(
        thread_cluster, staged):
    """Each step pulls at its start: after a step's push a write between
    steps (set_weights, load_weights, pruning) could not be told from the
    step's own update, and the next pull put the shards' rows back over
    it, staged layers and resident ones alike. With a learning rate of 0
    the weights set are what the shards end with."""
    data = batches((WIDTH,), 10, steps=2)
    strategy, model, trainer = _one_worker_trainer(
        thread_cluster, param_bytes(mlp()) // 4 if staged else None,
        keras.optimizers.SGD(0.0))
    try:
        assert any(trainer.plan.staged) == staged
        trainer.train_step(*data[0])
        written = [np.full_like(w, 0.5) for w in model.get_weights()]
        model.set_weights(written)
        trainer.train_step(*data[1])
        strategy.sync()
        # (the write travels as a difference: float32 rounding)
        for mine, expected in zip(model.get_weights(), written):
            np.testing.assert_allclose(mine, expected, atol=1e-6)
        rows = np.concatenate([strategy.client.read(t.table).reshape(-1)
                               for t in strategy.parameter_sync.tables])
        np.testing.assert_allclose(rows, 0.5, atol=1e-6)
    finally:
        strategy.close()


def run_alone(cluster, budget, data):
    """Worker 0 of 2 trains under SSP "average" with a slack of the whole
    run: worker 1 never clocks, so no pull brings fresh rows, and each
    layer's own update must count as the shards apply it (halved)."""
    strategy = keras_geeps.GeePSStrategy(
        client=cluster.client(0, timeout=30, slack=len(data)),
        device_memory_budget=budget)
    try:
        with strategy.scope():
            model = mlp()
        trainer = strategy.layerwise_trainer(
            model, keras.optimizers.SGD(0.05), loss_fn(), BATCH, audit=True)
        for x, y in data:
            trainer.train_step(x, y)
        return (model.get_weights(), trainer.plan, trainer.stats(),
                strategy.ps_stats())
    finally:
        strategy.close()


def test_ssp_average_weights_do_not_depend_on_the_budget(thread_cluster):
    data = batches((WIDTH,), 10)
    free = run_alone(thread_cluster(1, 2), None, data)
    tight = run_alone(thread_cluster(1, 2), param_bytes(mlp()) // 4, data)
    assert not any(free[1].staged)
    assert sum(tight[1].staged) >= len(tight[1].staged) - 2
    assert tight[2]["audit_mismatches"] == 0
    for a, b in zip(free[0], tight[0]):
        np.testing.assert_array_equal(a, b)
