"""A custom training loop's weights between its `strategy.run` steps.

Keras' `fit` catches the variables up where its callbacks can see them; a
custom loop has no such points, so each of its steps ends with the shards'
rows in the variables. These tests train real shards with hand-written
loops that read and write the weights between steps, and compare them
with plain TensorFlow / Keras.
"""

import os

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

STEPS, BATCH = 4, 4


class _Plain:
    """Keras' default strategy: `scope()` and `run` as plain TensorFlow."""

    @staticmethod
    def scope():
        import contextlib  # noqa: PLC0415
        return contextlib.nullcontext()

    @staticmethod
    def run(step, args):
        return step(*args)


def _write(model, how):
    """Halves the first kernel between steps (a max-norm or pruning loop)."""
    if how == "assign":
        kernel = model.layers[0].kernel
        kernel.assign(kernel * 0.5)
    elif how == "set_weights":
        weights = model.get_weights()
        weights[0] = weights[0] * 0.5
        model.set_weights(weights)


def _sgd_step(model, optimizer):
    """A hand-written step: `optimizer` on the mse of `model`."""
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def _custom_loop(strategy, start, x, y, write, lr=0.1, seen=None):
    """SGD on mse with a hand-written step run through `strategy.run`;
    `write` between steps; `seen(model)` after each step, before it."""
    model = small_model(strategy, name="m")
    model.set_weights(start)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(lr)

    step = _sgd_step(model, optimizer)

    @tf.function
    def train_step(xb, yb):
        return strategy.run(step, args=(xb, yb))

    for i in range(len(x) // BATCH):
        part = slice(i * BATCH, (i + 1) * BATCH)
        train_step(tf.constant(x[part]), tf.constant(y[part]))
        if seen is not None:
            seen(model)
        _write(model, write)
    return model


@pytest.mark.parametrize("write", ["none", "assign", "set_weights"])
def test_a_custom_loops_step_ends_with_the_shards_rows(thread_cluster, write):
    """After each step the weights are the shards' rows, and a write
    between steps is kept: the next step's pull replaced it (0.73 off
    plain TensorFlow at the end)."""
    start = small_model(_Plain()).get_weights()
    x, y = regression_data(STEPS * BATCH)
    with one_worker_strategy(thread_cluster) as strategy:
        between = []
        model = _custom_loop(strategy, start, x, y, write, seen=lambda m: (
            between.append((flat_weights(m), shard_rows(strategy)))))
        got = flat_weights(model)
        strategy.sync()
        np.testing.assert_array_equal(flat_weights(model), got)
    assert len(between) == STEPS
    for weights, rows in between:
        np.testing.assert_array_equal(weights, rows)
    plain = _custom_loop(_Plain(), start, x, y, write)
    np.testing.assert_allclose(got, flat_weights(plain), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("keras_step", [False, True])
def test_a_write_in_the_steps_own_function_comes_after_the_pull(
        thread_cluster, keras_step):
    """A loop's `tf.function` halving a kernel right after `strategy.run`
    (its own step, or `model.train_step`, whose update is captured): the
    write is ordered after the step's closing pull, so it halves the
    updated weights, as in plain TensorFlow (0.025 off before)."""
    start = small_model(_Plain()).get_weights()
    x, y = regression_data(STEPS * BATCH)

    def run(strategy):
        model = small_model(strategy, name="m")
        model.set_weights(start)
        kernel = model.layers[0].kernel
        step = _sgd_step(model, model.optimizer)

        @tf.function
        def train(xb, yb):
            if keras_step:
                strategy.run(model.train_step, args=((xb, yb),))
            else:
                strategy.run(step, args=(xb, yb))
            kernel.assign(kernel * 0.5)

        for i in range(STEPS):
            part = slice(i * BATCH, (i + 1) * BATCH)
            train(tf.constant(x[part]), tf.constant(y[part]))
        return flat_weights(model)

    with one_worker_strategy(thread_cluster) as strategy:
        got = run(strategy)
    np.testing.assert_allclose(got, run(_Plain()), rtol=1e-6, atol=1e-7)


def test_model_train_step_run_in_a_custom_loop_leaves_current_weights(
        thread_cluster):
    """`strategy.run(model.train_step)` in a loop's own `tf.function`: its
    updates are captured (as in `fit`), and each step ends with the weights
    of plain Keras' `train_on_batch` (they lagged a step behind)."""
    x, y = regression_data(STEPS * BATCH)
    reference = small_model(_Plain())
    expected = []
    with one_worker_strategy(thread_cluster) as strategy:
        model = small_model(strategy)
        model.set_weights(reference.get_weights())

        @tf.function
        def train_step(xb, yb):
            return strategy.run(model.train_step, args=((xb, yb),))

        for i in range(STEPS):
            part = slice(i * BATCH, (i + 1) * BATCH)
            reference.train_on_batch(x[part], y[part])
            expected.append(flat_weights(reference))
            train_step(tf.constant(x[part]), tf.constant(y[part]))
            np.testing.assert_allclose(flat_weights(model), expected[-1],
                                       rtol=1e-6, atol=1e-7)
        assert len(strategy.parameter_sync.captured_layers) == 2


def test_two_workers_custom_loops_agree_between_steps(thread_cluster):
    """Two workers (threads) under BSP "average", halving a kernel after
    every step: after each step both hold the same weights, the shards'
    rows, and they end where one plain worker with the combined batch
    does."""
    cluster = thread_cluster(1, 2)
    start = small_model(_Plain()).get_weights()
    x, y = regression_data(2 * STEPS * BATCH)
    parts = []
    for w in range(2):  # combined batch i: worker 0's batch i, then 1's
        rows = np.arange(len(x)).reshape(-1, 2, BATCH)[:, w].reshape(-1)
        parts.append((x[rows], y[rows]))

    def worker(w):
        strategy = GeePSStrategy(client=cluster.client(w, timeout=30))
        try:
            between = []
            model = _custom_loop(
                strategy, start, *parts[w], "assign",
                seen=lambda m: between.append(flat_weights(m)))
            return between, flat_weights(model)
        finally:
            strategy.close()

    results, errors = run_worker_threads(2, worker, timeout=120)
    assert not errors, errors
    for mine, theirs in zip(results[0][0], results[1][0]):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(results[0][1], results[1][1])
    plain = small_model(_Plain())
    plain.set_weights(start)
    kernel = plain.layers[0].kernel
    optimizer = keras.optimizers.SGD(0.1)
    for i in range(STEPS):
        part = slice(2 * i * BATCH, 2 * (i + 1) * BATCH)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(plain(x[part]) - y[part]))
        grads = tape.gradient(loss, plain.trainable_variables)
        optimizer.apply_gradients(zip(grads, plain.trainable_variables))
        kernel.assign(kernel * 0.5)
    np.testing.assert_allclose(results[0][1], flat_weights(plain), rtol=1e-6,
                               atol=1e-7)


class _Subclassed(keras.Model):
    """The TensorFlow tutorial's kind of model: layers built at its first
    call, inside the first traced step."""

    def __init__(self, name):
        super().__init__(name=name)
        self.a = keras.layers.Dense(
            3, name="a", kernel_initializer=keras.initializers.Constant(0.1))
        self.b = keras.layers.Dense(
            2, name="b", kernel_initializer=keras.initializers.Constant(-0.2))

    def call(self, x):
        return self.b(self.a(x))


def _lazy_loop(strategy, x, y, first=None, eager=False, keras_step=False):
    """SGD on a `_Subclassed` model created (not built) in the scope,
    through a step of ours or its compiled `train_step`; `first`: another
    model trained one step before it."""
    with strategy.scope():
        model = _Subclassed("lazy")
        optimizer = keras.optimizers.SGD(0.1)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    if first is not None:
        _custom_loop(strategy, first, x[:BATCH], y[:BATCH], "none")

    step = _sgd_step(model, optimizer)

    def train_step(xb, yb):
        if keras_step:
            return strategy.run(model.train_step, args=((xb, yb),))
        return strategy.run(step, args=(xb, yb))

    if not eager:
        train_step = tf.function(train_step)
    for i in range(STEPS):
        part = slice(i * BATCH, (i + 1) * BATCH)
        train_step(tf.constant(x[part]), tf.constant(y[part]))
    return model


@pytest.mark.parametrize("after_another,keras_step", [
    (False, False), (True, False), (True, True)])
def test_a_model_built_at_its_first_step_gets_its_tables(
        thread_cluster, after_another, keras_step):
    """Its variables are created while the first step is traced, not yet
    initialized: that trace was refused ("in no parameter table"), or,
    after another model's tables, failed to pack them. The trace
    `tf.function` makes once they are initialized builds their tables."""
    x, y = regression_data(STEPS * BATCH)
    first = small_model(_Plain()).get_weights() if after_another else None
    with one_worker_strategy(thread_cluster) as strategy:
        got = flat_weights(_lazy_loop(strategy, x, y, first,
                                      keras_step=keras_step))
        names = [layer.name for layer in strategy.parameter_sync.tables]
        rows = shard_rows(strategy)
    assert names[-2:] == ["lazy/a", "lazy/b"]
    assert len(names) == (4 if after_another else 2)
    np.testing.assert_array_equal(got, rows[-len(got):])
    plain = flat_weights(_lazy_loop(_Plain(), x, y, keras_step=keras_step))
    np.testing.assert_allclose(got, plain, rtol=1e-6, atol=1e-7)


def test_a_model_built_at_an_eager_first_step_is_named(thread_cluster):
    """Run eagerly, the step that creates a model's variables has already
    run without them: refused, saying how to build the model first."""
    x, y = regression_data(STEPS * BATCH)
    from keras_geeps.errors import GeePSError  # noqa: PLC0415
    with one_worker_strategy(thread_cluster) as strategy:
        with pytest.raises(GeePSError, match=r"lazy/a/kernel.*build the "
                           r"model before the first step"):
            _lazy_loop(strategy, x, y, eager=True)


def test_a_closed_strategy_lets_go_of_the_model_and_refuses_steps(
        thread_cluster):
    """TensorFlow keeps a traced step's py_functions, and with them the
    sync, as long as it keeps the function's graph: closing the strategy
    drops the variables, rows and buffers the sync held (a closed
    strategy kept the model's size four times over), and a step run
    after says the strategy was closed."""
    from keras_geeps.errors import GeePSError  # noqa: PLC0415
    x, y = regression_data(STEPS * BATCH)
    start = small_model(_Plain()).get_weights()
    with one_worker_strategy(thread_cluster) as strategy:
        model = _custom_loop(strategy, start, x, y, "none")
        sync = strategy.parameter_sync
        layers = list(sync.tables)
        assert all(layer.snapshot is not None for layer in layers)

        @tf.function
        def step(xb):
            return strategy.run(lambda v: model(v), args=(xb,))

        step(tf.constant(x[:BATCH]))
    assert sync.closed
    for layer in layers:
        assert layer.variables == () and layer.snapshot is None
        assert layer._reads._buffers is None
    with pytest.raises(tf.errors.UnknownError, match="strategy was closed"):
        step(tf.constant(x[:BATCH]))
    with pytest.raises(GeePSError, match="strategy was closed"):
        sync.pull_all()
