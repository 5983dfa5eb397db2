"""Captured updates never show: user code sees weights equal to the shards.

Under BSP a captured update is pushed instead of written into the
variables, which trail the shards by one step until the next pull. Keras
catches them up wherever user code can look between steps (keras/_tf_hooks):
before epoch-end and train-end callbacks, around train batches when a
callback reads weights there, and after `train_on_batch`; never per step
otherwise. These tests compare what callbacks and `train_on_batch` callers
see with the shards' rows, on real shards.
"""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from keras_geeps.keras import GeePSStrategy  # noqa: E402
from tests.keras import (  # noqa: E402
    flat_weights, regression_data, shard_rows, small_model)
from tests.worker_threads import run_worker_threads  # noqa: E402

STEPS, BATCH, EPOCHS = 4, 4, 2


def _strategy(thread_cluster):
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    return strategy, small_model(strategy)


class _Compare(keras.callbacks.Callback):
    """Records (weights, shard rows) at epoch ends, train end and, with
    `batches`, train batch ends."""

    def __init__(self, strategy, batches=False):
        super().__init__()
        self.strategy = strategy
        self.seen = {"epoch": [], "train_end": [], "batch": []}
        if batches:
            self.on_train_batch_end = self._batch_end

    def _record(self, where):
        self.seen[where].append((flat_weights(self.model),
                                 shard_rows(self.strategy)))

    def on_epoch_end(self, epoch, logs=None):
        self._record("epoch")

    def on_train_end(self, logs=None):
        self._record("train_end")

    def _batch_end(self, batch, logs=None):
        self._record("batch")


def _count_catch_up_pulls(sync):
    """Counts the catch-ups that had a layer to pull (instrumented)."""
    counts = {"pulls": 0}
    real = sync.catch_up

    def catch_up(variables, **kwargs):
        counts["pulls"] += any(layer.behind for layer in sync.tables)
        real(variables, **kwargs)

    sync.catch_up = catch_up
    return counts


def test_epoch_and_train_end_callbacks_see_the_shards_rows(thread_cluster,
                                                           tmp_path):
    strategy, model = _strategy(thread_cluster)
    try:
        compare = _Compare(strategy)
        counts = _count_catch_up_pulls(strategy.parameter_sync)
        path = str(tmp_path / "ckpt-{epoch}.weights.h5")
        x, y = regression_data(STEPS * BATCH)
        # `compare` first: Keras calls callbacks in order, ours sync last.
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                  verbose=0, callbacks=[compare] + strategy.callbacks(
                      checkpoint_path=path, save_weights_only=True))
        assert strategy.parameter_sync.captured_layers  # the case at hand
        assert len(compare.seen["epoch"]) == EPOCHS
        for weights, rows in compare.seen["epoch"] + compare.seen["train_end"]:
            np.testing.assert_array_equal(weights, rows)
        # The chief's checkpoints hold the shards' rows of their epoch.
        for epoch, (_, rows) in enumerate(compare.seen["epoch"], 1):
            model.load_weights(path.format(epoch=epoch))
            np.testing.assert_array_equal(flat_weights(model), rows)
        # No per-batch catch-up without a callback reading weights there:
        # at most one per epoch end.
        assert 0 < counts["pulls"] <= EPOCHS, counts
    finally:
        strategy.close()


def test_a_callback_reading_weights_per_batch_sees_the_shards_rows(
        thread_cluster):
    strategy, model = _strategy(thread_cluster)
    try:
        compare = _Compare(strategy, batches=True)
        x, y = regression_data(STEPS * BATCH)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                  verbose=0, callbacks=[compare])
        assert len(compare.seen["batch"]) == STEPS * EPOCHS
        for weights, rows in compare.seen["batch"]:
            np.testing.assert_array_equal(weights, rows)
    finally:
        strategy.close()


def test_train_on_batch_leaves_the_weights_current(thread_cluster):
    strategy, model = _strategy(thread_cluster)
    try:
        x, y = regression_data(STEPS * BATCH)
        for step in range(3):
            model.train_on_batch(x[:BATCH], y[:BATCH])
            assert strategy.parameter_sync.captured_layers
            np.testing.assert_array_equal(flat_weights(model),
                                          shard_rows(strategy))
            np.testing.assert_allclose(model(x).numpy(),
                                       model.predict(x, verbose=0),
                                       rtol=1e-6, atol=1e-6)
        assert strategy.parameter_sync.steps == 3
    finally:
        strategy.close()


def _named_model(strategy):
    """small_model's layers in a model named "m" (workers built in threads
    must name their tables alike: Keras numbers unnamed models globally)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)),
                                  keras.layers.Dense(3, name="a"),
                                  keras.layers.Dense(2, name="b")], name="m")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      jit_compile=False)
    return model


def test_measured_updates_are_caught_up_on_every_worker(thread_cluster):
    """Without captured updates (as on a GPU or under SSP) a step leaves
    the worker's own update, unscaled, in its variables: two workers
    (threads) under BSP "average", with no validation and without the
    strategy's callbacks, see the shards' rows at every epoch end and
    train end, and the same weights."""
    cluster = thread_cluster(1, 2)
    x, y = regression_data(2 * STEPS * BATCH)

    def worker(w):
        strategy = GeePSStrategy(client=cluster.client(w, timeout=30),
                                 capture_updates=False)
        try:
            model = _named_model(strategy)
            compare = _Compare(strategy)
            part = slice(w * STEPS * BATCH, (w + 1) * STEPS * BATCH)
            model.fit(x[part], y[part], batch_size=BATCH, epochs=EPOCHS,
                      shuffle=False, verbose=0, callbacks=[compare])
            assert not strategy.parameter_sync.captured_layers
            return compare.seen, flat_weights(model)
        finally:
            strategy.close()

    results, errors = run_worker_threads(2, worker, timeout=120)
    assert not errors, errors
    for seen, final in results.values():
        assert len(seen["epoch"]) == EPOCHS and len(seen["train_end"]) == 1
        for weights, rows in seen["epoch"] + seen["train_end"]:
            np.testing.assert_array_equal(weights, rows)
        np.testing.assert_array_equal(final, seen["train_end"][0][1])
    for where in ("epoch", "train_end"):
        for (mine, _), (theirs, _) in zip(results[0][0][where],
                                          results[1][0][where]):
            np.testing.assert_array_equal(mine, theirs)


def _assert_one_plain_step(got, start, x, y):
    """`got` is one plain Keras SGD(0.1) step on (x, y) from `start`."""
    keras.utils.set_random_seed(1)
    reference = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3),
                                  keras.layers.Dense(2)])
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      jit_compile=False)
    reference.set_weights(start)
    reference.train_on_batch(x, y)
    np.testing.assert_allclose(got, flat_weights(reference), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("capture", [True, False])
def test_a_later_fit_goes_on_from_the_shards_values(thread_cluster,
                                                    capture):
    """Weights set between fits (set_weights here; EarlyStopping's restore
    or load_weights alike) stay this worker's: the next fit's first step
    starts from the shards' rows, as one plain Keras SGD step from them."""
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20),
                             capture_updates=capture)
    try:
        model = small_model(strategy)
        x, y = regression_data(STEPS * BATCH)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0)
        shards = [w.copy() for w in model.get_weights()]
        np.testing.assert_array_equal(flat_weights(model),
                                      shard_rows(strategy))
        model.set_weights([w + 1.0 for w in shards])
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1,
                  shuffle=False, verbose=0)
        assert bool(strategy.parameter_sync.captured_layers) == capture
        got = flat_weights(model)
        np.testing.assert_array_equal(got, shard_rows(strategy))
    finally:
        strategy.close()
    _assert_one_plain_step(got, shards, x[:BATCH], y[:BATCH])


@pytest.mark.parametrize("capture", [True, False])
def test_each_train_on_batch_goes_on_from_the_shards_values(thread_cluster,
                                                            capture):
    """Weights set between `train_on_batch` calls stay this worker's, as
    between fits: the next call's step starts from the shards' rows (one
    plain Keras SGD step from them), and nothing of the set weights
    reaches the shards, whether the update is captured or measured."""
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20),
                             capture_updates=capture)
    try:
        model = small_model(strategy)
        x, y = regression_data(BATCH)
        model.train_on_batch(x, y)
        shards = [w.copy() for w in model.get_weights()]
        model.set_weights([w + 1.0 for w in shards])
        model.train_on_batch(x, y)
        got = flat_weights(model)
        np.testing.assert_array_equal(got, shard_rows(strategy))
    finally:
        strategy.close()
    _assert_one_plain_step(got, shards, x, y)
