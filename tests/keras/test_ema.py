"""`use_ema=True`: after `fit` the model holds the moving averages, as in
plain Keras, and so do the shards (real shards, real TensorFlow).

Keras' `fit` ends by writing the optimizer's moving averages into the
weights (`finalize_variable_values`); the final sync that follows must not
pull the shards' raw values back over them. The 2-worker case (every
worker ends with the workers' mean average, which under BSP is what one
worker with the combined batch keeps) is in test_fit_multiprocess.py.
"""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from keras_geeps.keras import GeePSStrategy  # noqa: E402
from tests.keras import (  # noqa: E402
    flat_weights, regression_data, shard_rows)

STEPS, BATCH, EPOCHS = 4, 4, 2


def _compiled(use_ema):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(3, name="a"),
                              keras.layers.Dense(2, name="b")])
    model.compile(optimizer=keras.optimizers.SGD(
        0.1, use_ema=use_ema, ema_momentum=0.8), loss="mse",
        jit_compile=False)
    return model


def _fit(model, callbacks=None, epochs=EPOCHS):
    x, y = regression_data(STEPS * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False,
              verbose=0, callbacks=callbacks)
    return model.evaluate(x, y, batch_size=BATCH, verbose=0)


def test_fit_ends_with_the_moving_averages_as_plain_keras(thread_cluster):
    reference = _compiled(use_ema=True)  # plain Keras, no strategy
    reference_loss = _fit(reference)
    raw = _compiled(use_ema=False)
    _fit(raw)
    # The averages are far enough from the last values to tell apart.
    assert np.abs(flat_weights(reference) - flat_weights(raw)).max() > 1e-2

    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    try:
        with strategy.scope():
            model = _compiled(use_ema=True)
        loss = _fit(model, strategy.callbacks())
        np.testing.assert_allclose(flat_weights(model),
                                   flat_weights(reference),
                                   rtol=1e-5, atol=1e-6)
        assert loss == pytest.approx(reference_loss, rel=1e-5)
        # The shards hold them too: the job ends consistent.
        np.testing.assert_array_equal(shard_rows(strategy),
                                      flat_weights(model))
        # A later fit goes on from them, as Keras' does.
        _fit(reference, epochs=1)
        _fit(model, strategy.callbacks(), epochs=1)
        np.testing.assert_allclose(flat_weights(model),
                                   flat_weights(reference),
                                   rtol=1e-5, atol=1e-6)
    finally:
        strategy.close()


def test_without_the_strategys_callbacks_too(thread_cluster):
    """The averages are written at `finalize_variable_values`, which
    Keras' `fit` calls whatever the callbacks."""
    reference = _compiled(use_ema=True)
    _fit(reference)
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20),
                             capture_updates=False)
    try:
        with strategy.scope():
            model = _compiled(use_ema=True)
        _fit(model)
        np.testing.assert_allclose(flat_weights(model),
                                   flat_weights(reference),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(shard_rows(strategy),
                                      flat_weights(model))
    finally:
        strategy.close()


def test_the_mean_average_is_over_the_live_workers(thread_cluster):
    """With `on_worker_failure="continue"` and worker 1 declared dead, the
    workers' mean average is worker 0's own: it ends with its moving
    averages, in its model and in the shards (not halfway to them, as
    dividing by both workers would leave it)."""
    import time  # noqa: PLC0415

    from keras_geeps.shard import ShardSettings  # noqa: PLC0415

    # (3 s: worker 0's fit, heartbeats from a thread, may stall a while)
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        worker_timeout=3.0, on_worker_failure="continue"))
    strategy = GeePSStrategy(client=cluster.client(
        0, timeout=20, heartbeat_interval=0.1))
    try:
        lost = cluster.client(1, timeout=20, heartbeat_interval=0.1)
        lost._io.close()  # dies without a word
        deadline = time.monotonic() + 20
        while not strategy.client.shard_stats()[0]["dead_workers"]:
            assert time.monotonic() < deadline, "worker 1 not declared dead"
            time.sleep(0.1)
        with strategy.scope():
            model = _compiled(use_ema=True)
        _fit(model, strategy.callbacks())
        averages = np.concatenate([
            v.numpy().reshape(-1)
            for v in model.optimizer._model_variables_moving_average])
        np.testing.assert_allclose(flat_weights(model), averages, rtol=1e-6,
                                   atol=1e-7)
        np.testing.assert_array_equal(shard_rows(strategy),
                                      flat_weights(model))
    finally:
        strategy.close()
