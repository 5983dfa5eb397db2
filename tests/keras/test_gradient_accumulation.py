"""`gradient_accumulation_steps`: fit trains as plain Keras does (real
shards, real TensorFlow).

Keras adds each step's gradients into its accumulators through the
distribution's `update`, so the strategy sees those (non-trainable)
optimizer variables updated; the step was refused as updating variables
in no parameter table, whatever the strategy's capture setting.
"""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from tests.keras import (  # noqa: E402
    flat_weights, one_worker_strategy, regression_data)

STEPS, BATCH, EPOCHS = 4, 4, 2


def _compiled():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(3, name="a"),
                              keras.layers.Dense(2, name="b")])
    model.compile(optimizer=keras.optimizers.SGD(
        0.1, momentum=0.9, gradient_accumulation_steps=2), loss="mse",
        jit_compile=False)
    return model


def _fit(model, callbacks=None):
    x, y = regression_data(STEPS * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
              verbose=0, callbacks=callbacks)


@pytest.mark.parametrize("capture", [True, False])
def test_fit_accumulates_gradients_as_plain_keras(thread_cluster, capture):
    reference = _compiled()  # plain Keras, no strategy
    start = flat_weights(reference)
    _fit(reference)
    assert np.abs(flat_weights(reference) - start).max() > 1e-2  # it trained

    with one_worker_strategy(thread_cluster,
                             capture_updates=capture) as strategy:
        with strategy.scope():
            model = _compiled()
        _fit(model, strategy.callbacks())
        np.testing.assert_allclose(flat_weights(model),
                                   flat_weights(reference),
                                   rtol=1e-5, atol=1e-6)
        rows = np.concatenate([
            strategy.client.read(layer.table).reshape(-1)
            for layer in strategy.parameter_sync.tables])
        np.testing.assert_allclose(rows, flat_weights(model), rtol=1e-6,
                                   atol=1e-7)
