"""Weights a callback sets during `fit` reach the shards, captured or not.

Under BSP a CPU layer's update is captured from the optimizer and pushed
without being measured on the variables (keras/capture.py). A callback
that changes the weights between steps (`set_weights` in `on_epoch_end`
or `on_train_batch_begin`, as pruning or clipping callbacks do) would then
lose its change at the next pull. These tests train one worker on a real
shard with such callbacks and compare the weights with plain Keras.
"""

import os
import time

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from keras_geeps.keras import GeePSStrategy  # noqa: E402
from tests.keras import (  # noqa: E402
    flat_weights, one_worker_strategy, regression_data, shard_rows,
    small_model)
from tests.worker_threads import run_worker_threads  # noqa: E402

STEPS, BATCH, EPOCHS = 4, 4, 3


class _HalveAtEpochEnd(keras.callbacks.Callback):
    """`set_weights` with every weight halved, at each epoch's end but the
    last (a change after the last step stays the worker's, as one made
    between two fits: no step takes it to the shards)."""

    WRITES = 2 * (EPOCHS - 1)  # layer writes a following step pushes

    def on_epoch_end(self, epoch, logs=None):
        if epoch < EPOCHS - 1:
            self.model.set_weights([w * 0.5
                                    for w in self.model.get_weights()])


class _ClipAtBatchBegin(keras.callbacks.Callback):
    """Clips the first layer's kernel to [-0.2, 0.2] through its Keras
    variable before the second batch of each epoch, and writes the second
    layer's bias through its tf.Variable."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch != 1:
            return
        kernel = self.model.layers[0].kernel
        kernel.assign(np.clip(kernel.numpy(), -0.2, 0.2))
        bias = self.model.layers[1].bias
        bias.value.assign_add(np.full(bias.shape, 0.25, np.float32))

    WRITES = 2 * EPOCHS


class _PruneAndClipInAFunction(keras.callbacks.Callback):
    """Before every batch, zeroes row 0 of the first kernel with an eager
    `scatter_update` (pruning an input), and clips the second kernel in a
    `tf.function` (traced at the first batch, before the tables exist:
    its later runs are unseen, so that layer's pushes are all measured)."""

    def __init__(self):
        super().__init__()
        self._clip = tf.function(
            lambda v: v.assign(tf.clip_by_value(v, -0.3, 0.3)))

    def on_train_batch_begin(self, batch, logs=None):
        kernel = self.model.layers[0].kernel.value
        kernel.scatter_update(tf.IndexedSlices(
            tf.zeros((1, kernel.shape[1])), tf.constant([0])))
        self._clip(self.model.layers[1].kernel.value)

    # every step's push of layer "b" (traced clip) and of layer "a"
    # (scattered), but the first (its write came before the tables, which
    # start from it)
    WRITES = 2 * EPOCHS * STEPS - 1


def _fit(model, callback):
    x, y = regression_data(STEPS * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
              verbose=0, callbacks=[callback])
    return flat_weights(model)


@pytest.mark.parametrize("callback", [_HalveAtEpochEnd, _ClipAtBatchBegin,
                                      _PruneAndClipInAFunction])
@pytest.mark.parametrize("capture", [True, False])
def test_weights_set_by_a_callback_during_fit_reach_the_shards(
        thread_cluster, capture, callback):
    """One worker trains as plain Keras does, the callback's writes
    included, and the shards end with the worker's weights."""
    with one_worker_strategy(thread_cluster,
                             capture_updates=capture) as strategy:
        model = small_model(strategy)
        start = model.get_weights()
        got = _fit(model, callback())
        assert bool(strategy.parameter_sync.captured_layers) == capture
        assert strategy.parameter_sync.stats()["outside_write_pushes"] == \
            (callback.WRITES if capture else 0)
        rows = shard_rows(strategy)
    np.testing.assert_array_equal(got, rows)
    reference = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3),
                                  keras.layers.Dense(2)])
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      jit_compile=False)
    reference.set_weights(start)
    np.testing.assert_allclose(got, _fit(reference, callback()), rtol=1e-5,
                               atol=1e-6)


def test_keras_callbacks_leave_every_push_captured(thread_cluster, tmp_path):
    """Keras' own callbacks and `fit`'s validation write no weights between
    steps: every push of the fit stays captured (none measured)."""
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.EarlyStopping(patience=5),
        keras.callbacks.ReduceLROnPlateau(),
        keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))]
    with one_worker_strategy(thread_cluster) as strategy:
        model = small_model(strategy)
        x, y = regression_data(2 * STEPS * BATCH)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                  validation_split=0.5, verbose=0,
                  callbacks=callbacks + strategy.callbacks())
        stats = strategy.parameter_sync.stats()
    assert stats["captured_tables"] == stats["tables"] == 2
    assert stats["steps"] == EPOCHS * STEPS
    assert stats["outside_write_pushes"] == 0


class _HalveAtEpochAndFirstBatchBegin(keras.callbacks.Callback):
    """Halves the weights at each epoch's begin, and the first kernel again
    before its first batch: writes between `fit`'s start and its first
    step, which that step's pull must not replace."""

    def on_epoch_begin(self, epoch, logs=None):
        self.model.set_weights([w * 0.5 for w in self.model.get_weights()])

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            kernel = self.model.layers[0].kernel
            kernel.assign(kernel.numpy() * 0.5)


def _fit_twice_from(model, pretrained):
    """predict, then weights loaded (a pretrained model's), two fits."""
    x, y = regression_data(STEPS * BATCH)
    model.predict(x[:2], verbose=0)  # (before any table exists)
    model.set_weights(pretrained)
    for _ in range(2):
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                  verbose=0, callbacks=[_HalveAtEpochAndFirstBatchBegin()])
    return flat_weights(model)


@pytest.mark.parametrize("capture", [True, False])
def test_weights_loaded_after_a_predict_and_set_as_a_fit_begins_count(
        thread_cluster, capture):
    """A `predict` before the first fit builds no tables (which would start
    from the weights then, and replace those loaded after it), and what a
    callback writes at `on_epoch_begin` or before the first batch of a
    second fit is not replaced by that fit's first pull."""
    pretrained = [np.full(w.shape, 0.1 * (i + 1), np.float32)
                  for i, w in enumerate(small_model(
                      _NoStrategy()).get_weights())]
    with one_worker_strategy(thread_cluster,
                             capture_updates=capture) as strategy:
        model = small_model(strategy)
        got = _fit_twice_from(model, pretrained)
        rows = shard_rows(strategy)
    np.testing.assert_array_equal(got, rows)
    reference = small_model(_NoStrategy())
    np.testing.assert_allclose(got, _fit_twice_from(reference, pretrained),
                               rtol=1e-5, atol=1e-6)


class _NoStrategy:
    """Keras' default strategy, for `small_model` (plain Keras)."""

    @staticmethod
    def scope():
        import contextlib  # noqa: PLC0415
        return contextlib.nullcontext()


def _two_models_loaded_between(strategy_or_none, pretrained):
    """Models A and B made together; A trained; B loaded (a pretrained
    model's weights) and trained."""
    scope = _NoStrategy() if strategy_or_none is None else strategy_or_none
    first = small_model(scope, name="first")
    second = small_model(scope, name="second")
    x, y = regression_data(STEPS * BATCH)
    first.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    second.set_weights(pretrained)
    second.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return flat_weights(first), flat_weights(second)


def test_a_second_models_weights_loaded_after_the_first_trained_count(
        thread_cluster):
    """A model's tables are built at its own first train step: another
    model's training built them before, from its weights then, and the
    weights loaded after were replaced as its fit began (1.1 off)."""
    pretrained = [np.full(w.shape, 0.1 * (i + 1), np.float32)
                  for i, w in enumerate(small_model(
                      _NoStrategy()).get_weights())]
    with one_worker_strategy(thread_cluster) as strategy:
        got = _two_models_loaded_between(strategy, pretrained)
        names = [layer.name for layer in strategy.parameter_sync.tables]
    assert names == ["first/a", "first/b", "second/a", "second/b"]
    for mine, plain in zip(got, _two_models_loaded_between(None,
                                                           pretrained)):
        np.testing.assert_allclose(mine, plain, rtol=1e-5, atol=1e-6)


class _WithTemperature(keras.Sequential):
    """A model whose train step also trains a raw tf.Variable attribute,
    which Keras does not count among its weights."""

    def build_temperature(self):
        self.temperature = tf.Variable(1.0, name="temperature")
        self.temperature_optimizer = keras.optimizers.SGD(0.05)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(
                self(x, training=True) * self.temperature - y))
        grads = tape.gradient(loss, self.trainable_weights +
                              [self.temperature])
        self.optimizer.apply_gradients(zip(grads[:-1],
                                           self.trainable_weights))
        self.temperature_optimizer.apply_gradients(
            [(grads[-1], self.temperature)])
        return {"loss": loss}


def _fit_with_temperature(scope):
    with scope.scope():
        keras.utils.set_random_seed(1)
        model = _WithTemperature([keras.Input((5,)),
                                  keras.layers.Dense(3, name="a"),
                                  keras.layers.Dense(2, name="b")],
                                 name="tempered")
        model.build_temperature()
        model.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=False)
    x, y = regression_data(STEPS * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return np.append(flat_weights(model), model.temperature.numpy())


def test_a_variable_the_step_trains_beyond_its_models_weights_is_tabled(
        thread_cluster):
    """A train step builds its model's tables; a variable of the scope it
    trains beyond the model's weights gets its table once the step is
    traced, and trains as in plain Keras."""
    with one_worker_strategy(thread_cluster) as strategy:
        got = _fit_with_temperature(strategy)
        names = [layer.name for layer in strategy.parameter_sync.tables]
        assert strategy.parameter_sync.pending_count() == 0
    assert len(names) == 3 and "temperature" in names[-1]
    np.testing.assert_allclose(got, _fit_with_temperature(_NoStrategy()),
                               rtol=1e-5, atol=1e-6)


def _two_worker_parts(x, y):
    """Worker w's rows, such that the combined batch i of plain Keras
    (2 * BATCH rows) is batch i of worker 0 followed by that of worker 1."""
    parts = []
    for w in range(2):
        rows = np.arange(len(x)).reshape(-1, 2, BATCH)[:, w].reshape(-1)
        parts.append((x[rows], y[rows]))
    return parts


@pytest.mark.parametrize("callback", [_HalveAtEpochEnd,
                                      _PruneAndClipInAFunction])
@pytest.mark.parametrize("capture", [True, False])
@pytest.mark.parametrize("update_mode", ["average", "sum"])
def test_every_workers_callback_write_reaches_the_shards_once(
        thread_cluster, update_mode, capture, callback):
    """Keras runs each callback on every worker: two workers (threads)
    making the same writes (eagerly, and in a `tf.function`) end where one
    plain Keras worker with the combined batch does, under "sum" too, which
    took each worker's change in full (0.35 off)."""
    cluster = thread_cluster(1, 2)
    start = small_model(_NoStrategy()).get_weights()
    x, y = regression_data(2 * STEPS * BATCH)
    parts = _two_worker_parts(x, y)

    def worker(w):
        strategy = GeePSStrategy(client=cluster.client(w, timeout=30),
                                 update_mode=update_mode,
                                 capture_updates=capture)
        try:
            model = small_model(strategy, name="m")
            model.set_weights(start)
            model.fit(*parts[w], batch_size=BATCH, epochs=EPOCHS,
                      shuffle=False, verbose=0, callbacks=[callback()])
            assert bool(strategy.parameter_sync.captured_layers) == capture
            return flat_weights(model), shard_rows(strategy)
        finally:
            strategy.close()

    results, errors = run_worker_threads(2, worker, timeout=120)
    assert not errors, errors
    (mine, rows), (theirs, _) = results[0], results[1]
    np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(mine, rows)
    # Under "sum" each worker's mean-gradient step adds up: plain Keras
    # with the combined batch steps twice as far.
    reference = small_model(_NoStrategy())
    reference.optimizer.learning_rate.assign(
        0.1 if update_mode == "average" else 0.2)
    reference.set_weights(start)
    reference.fit(x, y, batch_size=2 * BATCH, epochs=EPOCHS, shuffle=False,
                  verbose=0, callbacks=[callback()])
    np.testing.assert_allclose(mine, flat_weights(reference), rtol=1e-5,
                               atol=1e-6)


class _EpochEndWeights(keras.callbacks.Callback):
    """Records the weights each epoch end shows; worker 1's batches end
    late, so that under SSP worker 0 runs up to the slack ahead."""

    def __init__(self, slow):
        super().__init__()
        self.slow = slow
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        if self.slow:
            time.sleep(0.05)

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(flat_weights(self.model))


def test_under_ssp_every_worker_sees_the_same_weights_at_epoch_ends(
        thread_cluster):
    """The epoch-end catch-up honoured the slack, though the epoch-log
    barrier had every worker's whole epoch pushed: a ModelCheckpoint or
    EarlyStopping's best weights held each worker's own partial view, and
    EarlyStopping(restore_best_weights=True) left the workers with
    different final weights. Past the barrier they now read every
    worker's last clock."""
    cluster = thread_cluster(1, 2)
    x, y = regression_data(2 * 3 * STEPS * BATCH)
    parts = _two_worker_parts(x, y)

    def worker(w):
        strategy = GeePSStrategy(client=cluster.client(w, timeout=60,
                                                       slack=2))
        try:
            model = small_model(strategy, name="m")
            recorder = _EpochEndWeights(slow=w == 1)
            model.fit(*parts[w], batch_size=BATCH, epochs=EPOCHS,
                      shuffle=False, verbose=0, callbacks=[
                          recorder, keras.callbacks.EarlyStopping(
                              monitor="loss", patience=EPOCHS,
                              restore_best_weights=True)])
            return recorder.seen, flat_weights(model)
        finally:
            strategy.close()

    results, errors = run_worker_threads(2, worker, timeout=120)
    assert not errors, errors
    (mine, final), (theirs, their_final) = results[0], results[1]
    assert len(mine) == len(theirs) == EPOCHS
    for epoch in range(EPOCHS):
        np.testing.assert_array_equal(mine[epoch], theirs[epoch])
    np.testing.assert_array_equal(final, their_final)
