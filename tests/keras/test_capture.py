"""Captured optimizer updates (keras/capture.py) against measured deltas.

Under BSP the sync takes each layer's update from the optimizer instead of
writing it into the variables and measuring `variable - snapshot`. These
tests train the same model with capture on and off on real shards and
compare the weights, and check every case that must fall back to writing
the variables.
"""

import functools
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")
import tensorflow as tf  # noqa: E402

from keras_geeps.keras import GeePSStrategy  # noqa: E402
from tests.keras import one_worker_strategy, regression_data  # noqa: E402

STEPS, BATCH = 6, 8


def _model(constraint=None):
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(4, activation="tanh", name="a",
                           kernel_constraint=constraint),
        keras.layers.Dense(2, name="b")])


def _train(thread_cluster, optimizer, capture, slack=0, constraint=None,
           callbacks=False, run_eagerly=False):
    """Fits on a fresh 1-shard cluster; returns (weights, shard rows,
    captured layer names)."""
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20, slack=slack),
                             capture_updates=capture)
    try:
        with strategy.scope():
            model = _model(constraint)
            model.compile(optimizer=optimizer(), loss="mse",
                          jit_compile=False, run_eagerly=run_eagerly)
        x, y = regression_data(STEPS * BATCH)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=strategy.callbacks() if callbacks else None)
        sync = strategy.parameter_sync
        rows = [strategy.client.read(layer.table).reshape(-1).copy()
                for layer in sync.tables]
        weights = [np.concatenate([v.numpy().reshape(-1)
                                   for v in layer.variables])
                   for layer in sync.tables]
        names = [name.rsplit("/", 1)[-1] for name in sync.captured_layers]
        lent = strategy.client.shard_stats()[0]["lent_updates"]
        return weights, rows, names, lent
    finally:
        strategy.close()


def _close(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.SGD(0.05),
    lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    lambda: keras.optimizers.Adam(0.01)], ids=["sgd", "nesterov", "adam"])
def test_captured_updates_train_like_measured_ones(thread_cluster, optimizer):
    weights, rows, names, lent = _train(thread_cluster, optimizer,
                                        capture=True)
    assert names == ["a", "b"]
    # The only writer wrote its new rows into buffers the shard lent it:
    # every update of both tables after the first step's.
    assert lent == 2 * (2 * STEPS - 1), lent
    plain_weights, plain_rows, plain_names, plain_lent = _train(
        thread_cluster, optimizer, capture=False)
    assert plain_names == [] and plain_lent == 0
    _close(rows, plain_rows)
    # `fit` pulls on its way out: the variables hold the last update too.
    _close(weights, rows)
    _close(weights, plain_weights)


def test_weight_decay_ema_and_constraints_are_not_captured(thread_cluster):
    decay = functools.partial(keras.optimizers.AdamW, 0.01,
                              weight_decay=0.1)
    weights, rows, names, _ = _train(thread_cluster, decay, capture=True)
    assert names == []
    _close(rows, _train(thread_cluster, decay, capture=False)[1])

    ema = functools.partial(keras.optimizers.SGD, 0.05, use_ema=True)
    assert _train(thread_cluster, ema, capture=True)[2] == []

    sgd = functools.partial(keras.optimizers.SGD, 0.05)
    constraint = keras.constraints.MaxNorm(0.3)
    weights, rows, names, _ = _train(thread_cluster, sgd, capture=True,
                                     constraint=constraint)
    assert names == ["b"]  # layer a's kernel has the constraint
    plain = _train(thread_cluster, sgd, capture=False, constraint=constraint)
    _close(rows, plain[1])
    _close(weights, plain[0])


def test_loss_scaling_and_ssp_write_the_variables(thread_cluster):
    def scaled():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    weights, rows, names, _ = _train(thread_cluster, scaled, capture=True)
    assert names == []  # the inner update runs under a condition
    _close(rows, _train(thread_cluster, scaled, capture=False)[1])

    sgd = functools.partial(keras.optimizers.SGD, 0.05)
    assert _train(thread_cluster, sgd, capture=True, slack=1)[2] == []


def test_run_eagerly_writes_the_variables(thread_cluster):
    """Eagerly, a direct write (weight decay) leaves no op to check: no
    capture, and AdamW trains as with capture off."""
    decay = functools.partial(keras.optimizers.AdamW, 0.01,
                              weight_decay=0.1)
    weights, rows, names, _ = _train(thread_cluster, decay, capture=True,
                                     run_eagerly=True)
    assert names == []
    plain = _train(thread_cluster, decay, capture=False)
    _close(rows, plain[1])
    _close(weights, plain[0])


def test_capture_leaves_optimizers_outside_geeps_alone(thread_cluster):
    """Once a strategy has patched Optimizer's methods, optimizers outside
    any GeePS step still write their variables."""
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    try:
        assert keras.optimizers.Optimizer.__dict__["_geeps_capture_installed"]
        variable = keras.Variable(np.ones(3, np.float32))
        optimizer = keras.optimizers.SGD(0.5)
        optimizer.build([variable])
        optimizer.apply([tf.constant([1.0, 2.0, 3.0])], [variable])
        np.testing.assert_allclose(variable.numpy(), [0.5, 0.0, -0.5])
        optimizer.finalize_variable_values([variable])
        np.testing.assert_allclose(variable.numpy(), [0.5, 0.0, -0.5])
    finally:
        strategy.close()


class _TwoPhase(keras.Model):
    """A GAN-like step: updates layer "a", then passes through it again
    (reading its new weights) to update layer "b", each with its own
    optimizer."""

    def __init__(self):
        super().__init__(name="two_phase")
        self.a = keras.layers.Dense(4, activation="tanh", name="a")
        self.b = keras.layers.Dense(2, name="b")

    def build(self, input_shape):
        self.a.build(input_shape)
        self.b.build((*input_shape[:-1], 4))

    def call(self, x):
        return self.b(self.a(x))

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.opt_a = keras.optimizers.SGD(0.1)
        self.opt_b = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        x, y = data
        for layer, optimizer in ((self.a, self.opt_a),
                                 (self.b, self.opt_b)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x) - y))
            variables = layer.trainable_variables
            optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


def _two_phase():
    keras.utils.set_random_seed(1)
    model = _TwoPhase()
    model.build((None, 5))
    model.compile(jit_compile=False)
    return model


@pytest.mark.parametrize("capture", [True, False])
def test_a_read_after_a_captured_update_is_refused(thread_cluster, capture):
    """A captured update is not in the variable within the step: the
    second pass would see "a"'s old weights. That step is refused, naming
    the remedy; without capture it trains as plain Keras."""
    from keras_geeps.errors import GeePSError  # noqa: PLC0415

    x, y = regression_data(STEPS * BATCH)
    reference = _two_phase()
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    with one_worker_strategy(thread_cluster,
                             capture_updates=capture) as strategy:
        with strategy.scope():
            model = _two_phase()
        if capture:
            with pytest.raises(GeePSError, match="capture_updates=False"):
                model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            return
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        _close(model.get_weights(), reference.get_weights())
