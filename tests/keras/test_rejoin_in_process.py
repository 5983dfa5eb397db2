"""A rejoining worker's `fit` lining up, in one process (threads), at the
moments a multi-process run rarely hits: between the two barriers of an
epoch end, and with a layer frozen after its table was made."""

import threading

import keras
import numpy as np

from keras_geeps.keras import GeePSStrategy, rejoin
from keras_geeps.shard import ShardSettings

BATCH = 4
rng = np.random.default_rng(0)
X = rng.normal(size=(16, 5)).astype("float32")
Y = rng.normal(size=(16, 2)).astype("float32")
# Keras' global state (the random seed, the scope) is one per process.
_BUILD = threading.Lock()


def _model(strategy, batchnorm=False, freeze=False):
    with _BUILD, strategy.scope():
        keras.utils.set_random_seed(1)
        middle = [keras.layers.BatchNormalization(name="bn")] \
            if batchnorm else []
        model = keras.Sequential([
            keras.Input((5,)), keras.layers.Dense(4, name="a"), *middle,
            keras.layers.Dense(2, name="b")], name="m")
        if freeze:  # a base frozen once its table was made
            model.get_layer("a").trainable = False
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                      jit_compile=False)
    return model


def _steps(strategy, model, count=4):
    for i in range(count):
        model.train_on_batch(X[i * BATCH:(i + 1) * BATCH],
                             Y[i * BATCH:(i + 1) * BATCH])


def _epoch_end(strategy, model, epoch, statistics=True):
    """What `fit`'s epoch end does without validation: the logs' barrier,
    then the statistics'."""
    strategy.epoch_logs.average(
        {"loss": 1.0}, epoch=epoch, clock=strategy.parameter_sync.clock,
        statistics_clock=rejoin.statistics_clock_after(strategy, model,
                                                       False))
    if statistics:
        strategy.non_trainable.average(model)


def _rejoin_and_fit(thread_cluster, first_steps, batchnorm=False,
                    freeze=False):
    """Worker 1 goes silent (declared dead) while worker 0 trains epoch 0
    by `fit` and then runs `first_steps(first, model)` by hand; worker 1
    then rejoins and fits 3 epochs while worker 0 goes on by hand (two
    more epoch ends). Returns (worker 1's epochs, worker 0's error or
    None, both strategies' parameter clocks, and with `batchnorm` worker
    1's statistics as its fit began and worker 0's after `then()`)."""
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        worker_timeout=1, on_worker_failure="continue"))
    first = GeePSStrategy(client=cluster.client(0, timeout=15,
                                                heartbeat_interval=0.2))
    silent = cluster.client(1, timeout=15, heartbeat_interval=0)
    model = _model(first, batchnorm, freeze)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=first.callbacks())
    then = first_steps(first, model)
    silent.close()
    again = GeePSStrategy(client=cluster.client(1, timeout=15,
                                                heartbeat_interval=0.2))
    errors, statistics = [], {}

    def bn_mean(of):
        return np.array(of.get_layer("bn").moving_mean.numpy())

    def worker0():
        try:
            then()
            if batchnorm:
                statistics[0] = bn_mean(model)
            _steps(first, model)
            _epoch_end(first, model, 2, batchnorm)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        rejoined = _model(again, batchnorm, freeze)
        assert again.client.rejoined_at is not None
        thread = threading.Thread(target=worker0)
        thread.start()
        began = keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: statistics.setdefault(
                1, bn_mean(rejoined)) if batchnorm else None)
        history = rejoined.fit(X, Y, batch_size=BATCH, epochs=3,
                               shuffle=False, verbose=0, callbacks=[began])
        thread.join(60)
        clocks = [s.parameter_sync.clock for s in (first, again)]
        return history.epoch, (errors or [None])[0], clocks, statistics
    finally:
        again.close()
        first.close()


def test_a_rejoin_between_the_logs_and_the_statistics_barrier(
        thread_cluster):
    """Worker 0 passed epoch 1's logs barrier, not yet its statistics
    barrier, when worker 1 rejoins: that barrier now waits for worker 1,
    which takes part with nothing, and both go on to the same clock.
    Worker 1 begins its epoch with worker 0's statistics of that barrier
    (it began with the job's first ones: zeros)."""
    def first_steps(first, model):
        _steps(first, model)
        _epoch_end(first, model, 1, statistics=False)
        return lambda: first.non_trainable.average(model)

    epochs, error, clocks, statistics = _rejoin_and_fit(
        thread_cluster, first_steps, batchnorm=True)
    assert error is None, error
    assert epochs == [2]
    assert clocks[0] == clocks[1] == 12
    assert np.abs(statistics[0]).max() > 0.01
    np.testing.assert_allclose(statistics[1], statistics[0], rtol=1e-6)


def test_a_frozen_layers_table_holds_nothing_back(thread_cluster):
    """A layer frozen after its table was made never clocks it: the
    epoch ends' clocks, worker 1's lining up and its ps_ figures go by the
    tables the steps clock; the frozen one stays at clock 0 on both."""
    def first_steps(first, model):
        _steps(first, model, 2)
        return lambda: (_steps(first, model, 2),
                        _epoch_end(first, model, 1, statistics=False))

    epochs, error, clocks, _ = _rejoin_and_fit(thread_cluster, first_steps,
                                               freeze=True)
    assert error is None, error
    assert epochs == [2]
    assert clocks[0] == clocks[1] == 12
