"""Which variables become tables, of which dtypes, and what the sync counts.

Real shards on 127.0.0.1 (thread_cluster), real TensorFlow.
"""

import os
import threading

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")
import tensorflow as tf  # noqa: E402

from keras_geeps.errors import GeePSError  # noqa: E402
from keras_geeps.keras import GeePSStrategy  # noqa: E402
from tests.keras import regression_data  # noqa: E402

STEPS, BATCH = 4, 4


def _fit(model, epochs=1, **kwargs):
    x, y = regression_data(STEPS * BATCH)
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False,
                     verbose=0, **kwargs)


def _compiled(name, *layers, optimizer="sgd"):
    model = keras.Sequential([keras.Input((5,)), *layers], name=name)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model


def _assert_weights_are_rows(strategy, layers):
    for layer in layers:
        rows = strategy.client.read(layer.table).reshape(-1)
        values = np.concatenate([v.numpy().reshape(-1)
                                 for v in layer.variables])
        np.testing.assert_array_equal(values, rows)


@pytest.fixture
def strategy(thread_cluster):
    """A GeePSStrategy over one thread shard, closed after the test."""
    strategy = GeePSStrategy(client=thread_cluster(1, 1).client(
        0, timeout=20))
    yield strategy
    strategy.close()


def test_a_model_created_after_the_first_step_gets_its_tables(
        strategy):
    sync = strategy.parameter_sync
    with strategy.scope():
        first = _compiled("first", keras.layers.Dense(2, name="d"))
    _fit(first)
    with strategy.scope():
        second = _compiled("second", keras.layers.Dense(3, name="e"),
                           keras.layers.Dense(2, name="f"))
    before = [w.copy() for w in second.get_weights()]
    _fit(second)
    assert [t.name for t in sync.tables] == [
        "first/d", "second/e", "second/f"]
    assert len(strategy.client.shard_stats()[0]["tables"]) == 3
    assert [t.table.clock for t in sync.tables] == [STEPS] * 3
    _assert_weights_are_rows(strategy, sync.tables)
    assert not any(np.array_equal(a, b) for a, b in
                   zip(before, second.get_weights()))


def test_functional_layers_of_one_name_never_share_a_table(strategy):
    """A functional model's variable paths hold only the layer's name: two
    such models with a layer "head" each would have been packed into one
    table, silently. Built together (a custom loop's step builds every
    pending table) they are refused, naming the path; a model whose
    tables come after another's (each model's at its own first train
    step) is refused with the remedy for both kinds of model."""
    def functional(name):
        inputs = keras.Input((5,))
        model = keras.Model(inputs, keras.layers.Dense(2, name="head")(
            inputs), name=name)
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
        return model

    with strategy.scope():
        first, second = functional("first"), functional("second")
    with pytest.raises(GeePSError, match="two variables are called "
                                         "'head/kernel'"):
        strategy.parameter_sync.build_pending()
    assert strategy.parameter_sync.tables == []
    del first
    with strategy.scope():
        third = functional("third")
    _fit(third)
    with strategy.scope():
        fourth = functional("fourth")
    with pytest.raises(GeePSError, match="give its layers distinct names"):
        _fit(fourth)
    del second


def test_lora_enabled_after_training_began_is_named_as_the_cause(strategy):
    """A layer given new variables after its table was built (LoRA
    enabled after the first fit) was told to give its model a distinct
    name; the error now names the late variables' cause first."""
    with strategy.scope():
        model = _compiled("lora", keras.layers.Dense(3, name="a"),
                          keras.layers.Dense(2, name="b"))
    _fit(model)
    with strategy.scope():
        model.layers[0].enable_lora(2)
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    with pytest.raises(GeePSError, match=r"made variables after training "
                                         r"began \(e.g. enable_lora\(\)"):
        _fit(model)


def test_layers_built_inside_the_first_step_get_a_table_each(strategy):
    """Layers built lazily, inside the traced step (a Sequential model
    without an Input), create TF variables named plain 'kernel' and
    'bias': their tables are named by the Keras paths instead, one per
    layer, and a second such model gets its own."""
    sync = strategy.parameter_sync
    models = []
    for name in ("lazy", "lazier"):
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(3, name="d"),
                                      keras.layers.Dense(2, name="e")],
                                     name=name)
            model.compile(optimizer="sgd", loss="mse", jit_compile=False)
        _fit(model)
        models.append(model)
    assert {v.value.name for v in models[0].trainable_variables} <= {
        "kernel:0", "bias:0"}, "TF names its lazy variables by path now"
    assert [t.name for t in sync.tables] == [
        "lazy/d", "lazy/e", "lazier/d", "lazier/e"]
    assert [len(t.variables) for t in sync.tables] == [2] * 4
    assert [t.table.clock for t in sync.tables] == [STEPS] * 4
    _assert_weights_are_rows(strategy, sync.tables)


class _Counting(keras.layers.Layer):
    """Counts its training calls in an int32 weight: trainable by default
    (Keras and TF both make integer variables so), with no gradient."""

    def build(self, shape):
        self.count = self.add_weight(shape=(), dtype="int32",
                                     initializer="zeros", name="count")

    def call(self, x, training=False):
        if training:
            self.count.assign_add(1)
        return x


def test_integer_weights_train_as_in_keras_and_get_no_table(strategy):
    """An integer weight (a layer's counter, a tf.Variable(0)) made the
    first step fail in PackLayout, which takes floating-point tables only;
    plain Keras trains the model. It stays this worker's own."""
    sync = strategy.parameter_sync
    with strategy.scope():
        model = _compiled("counted", _Counting(name="cnt"),
                          keras.layers.Dense(2, name="d"))
        steps = tf.Variable(0, name="steps")
    _fit(model, epochs=2)
    steps.assign_add(1)
    assert int(model.get_layer("cnt").count.numpy()) == 2 * STEPS
    assert [t.name for t in sync.tables] == ["counted/d"]
    assert sync.not_held([steps, model.get_layer("cnt").count]) == [
        steps, model.get_layer("cnt").count]
    _assert_weights_are_rows(strategy, sync.tables)


def test_unnamed_tf_variables_get_a_table_each(strategy):
    """Eager TF names every unnamed tf.Variable 'Variable': two of them
    were refused as 'two layers of one name'. They are told apart as Keras
    tells its own, by creation order, and train as they would alone."""
    x, y = regression_data(STEPS * BATCH)

    def train(distributed):
        with strategy.scope() if distributed else tf.name_scope("alone"):
            w = tf.Variable(tf.ones((5, 2)))
            b = tf.Variable(tf.fill((2,), 0.5))
            optimizer = keras.optimizers.SGD(0.1)

        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((xb @ w + b - yb) ** 2)
            grads = tape.gradient(loss, [w, b])
            optimizer.apply_gradients(zip(grads, [w, b]))

        @tf.function
        def run(xb, yb):
            if distributed:
                strategy.run(step, args=(xb, yb))
            else:
                step(xb, yb)

        for i in range(STEPS):
            run(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
        return w, b

    with strategy.reraise():
        w, b = train(distributed=True)
    strategy.sync()
    alone = train(distributed=False)
    sync = strategy.parameter_sync
    assert [t.name for t in sync.tables] == ["Variable", "Variable_1"]
    _assert_weights_are_rows(strategy, sync.tables)
    for mine, reference in zip((w, b), alone):
        np.testing.assert_allclose(mine.numpy(), reference.numpy(),
                                   rtol=1e-6, atol=1e-6)


def test_training_a_layer_created_outside_the_scope_is_a_clear_error(
        strategy):
    outside = keras.layers.Dense(2, name="outside")
    outside.build((None, 3))
    with strategy.scope():
        model = _compiled("mixed", keras.layers.Dense(3, name="inside"),
                          outside)
    with pytest.raises(GeePSError, match="in no parameter table.*"
                                         "outside/kernel"):
        _fit(model)


@pytest.mark.parametrize("capture", [True, False], ids=["captured",
                                                        "measured"])
def test_bfloat16_layers_train_and_match_their_rows(thread_cluster, capture):
    def build(name):
        keras.utils.set_random_seed(1)
        return _compiled(
            name, keras.layers.Dense(3, name="a", dtype="bfloat16"),
            keras.layers.Dense(2, name="b"),
            optimizer=keras.optimizers.SGD(0.1))

    plain = build("plain")
    before = plain.layers[0].kernel.numpy().copy()
    _fit(plain, epochs=2)
    assert not np.array_equal(before, plain.layers[0].kernel.numpy())
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20),
                             capture_updates=capture)
    sync = strategy.parameter_sync
    try:
        with strategy.scope():
            model = build("bf16")
        _fit(model, epochs=2)
        assert [(t.name, t.table.dtype.name) for t in sync.tables] == [
            ("bf16/a", "bfloat16"), ("bf16/b", "float32")]
        assert bool(sync.captured_layers) == capture
        assert sync.tables[0].table.clock == 2 * STEPS
        _assert_weights_are_rows(strategy, sync.tables)
        for got, want in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(np.float32(got), np.float32(want),
                                       rtol=1e-2, atol=1e-2)
    finally:
        strategy.close()


def _io_threads():
    return [t.name for t in threading.enumerate()
            if t.name.startswith("geeps-io")]


def test_a_failed_strategy_leaves_no_client_behind(thread_cluster):
    cluster = thread_cluster(1, 1)
    assert _io_threads() == []
    with pytest.raises(ValueError, match="update_mode"):
        GeePSStrategy(cluster=cluster.spec(0), update_mode="mean")
    assert _io_threads() == []
    with pytest.raises(ValueError, match="device_memory_budget"):
        GeePSStrategy(cluster=cluster.spec(0), device_memory_budget=-1)
    # Fails after creating its client (TensorFlow parses the device).
    with pytest.raises(ValueError, match="bogus"):
        GeePSStrategy(cluster=cluster.spec(0), device="bogus device")
    assert _io_threads() == []
    # A device this process does not have: TensorFlow would place the step
    # elsewhere without a word.
    for absent in ("/gpu:7", "/tpu:0", "/cpu:1"):
        with pytest.raises(ValueError, match=f"device '{absent}' is none of "
                                             f"this process's devices"):
            GeePSStrategy(cluster=cluster.spec(0), device=absent)
    assert _io_threads() == []
    # A client the caller gave stays open.
    client = cluster.client(0, timeout=20)
    try:
        with pytest.raises(ValueError, match="bogus"):
            GeePSStrategy(client=client, device="bogus device")
        assert _io_threads()
        client.create_table("still_open", 1, 1)
    finally:
        client.close()


def test_steps_are_counted_with_a_frozen_first_layer(strategy):
    sync = strategy.parameter_sync
    with strategy.scope():
        frozen = keras.layers.Dense(3, name="frozen", trainable=False)
        model = _compiled("partly", frozen, keras.layers.Dense(2))
    history = _fit(model, epochs=2, callbacks=strategy.callbacks())
    assert sync.steps == 2 * STEPS
    assert [t.table.clock for t in sync.tables] == [0, 2 * STEPS]
    # Per step, not the whole epoch's pull and push time in one.
    stats = sync.stats()
    per_step = 1e3 * (stats["pull_seconds"] + stats["push_seconds"]) \
        / sync.steps
    assert sum(history.history["ps_step_ms"]) <= 2 * per_step + 0.1


def test_custom_loop_steps_are_counted_with_a_frozen_first_layer(
        strategy):
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((5,)),
            keras.layers.Dense(3, name="frozen", trainable=False),
            keras.layers.Dense(2, name="b")])
        optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def train_step(x, y):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads,
                                          model.trainable_variables))
            return loss
        return strategy.run(step, args=(x, y))

    x, y = regression_data(STEPS * BATCH)
    for i in range(STEPS):
        train_step(x[i * BATCH:(i + 1) * BATCH],
                   y[i * BATCH:(i + 1) * BATCH])
    assert strategy.parameter_sync.steps == STEPS


def test_push_before_any_pull_is_a_clear_error(strategy):
    sync = strategy.parameter_sync
    with strategy.scope():
        _compiled("unpulled", keras.layers.Dense(2, name="d"))
    sync.build()
    with pytest.raises(GeePSError, match="unpulled/d.*pull"):
        sync.push_all()
    with pytest.raises(GeePSError, match="unpulled/d.*before any pull"):
        sync.push(0)
    assert sync.tables[0].table.clock == 0  # nothing was sent
    sync.pull_all()
    sync.push_all()
    assert sync.tables[0].table.clock == 1
    rows = strategy.client.read(sync.tables[0].table)
    np.testing.assert_array_equal(  # a zero update: the rows stand
        rows.reshape(-1), sync.tables[0].snapshot.numpy())


def _kernel_sync(mine, other, update_mode):
    """A 2x2 kernel that client `mine` syncs in `update_mode`, its table
    declared by client `other` too: (kernel, ParameterSync, other's
    table)."""
    from keras_geeps.keras.sync import ParameterSync  # noqa: PLC0415

    with tf.device("/cpu:0"):
        kernel = tf.Variable(tf.zeros((2, 2)), name="lay/kernel")
    sync = ParameterSync(mine, update_mode, capture_updates=False)
    sync.track_variable(kernel, True)
    sync.build()
    table = sync.tables[0].table
    return kernel, sync, other.create_table(table.name, table.rows,
                                            table.width)


def test_own_update_under_ssp_counts_as_the_shards_apply_it(thread_cluster):
    """Average mode, 2 workers, slack 2: with no fresh rows a worker's
    variables hold snapshot + update / 2 (what the shards will hold from
    it), not its whole update; the fresh rows later agree."""
    cluster = thread_cluster(1, 2)
    mine = cluster.client(0, timeout=10, slack=2)
    other = cluster.client(1, timeout=10, slack=2)
    try:
        kernel, sync, theirs = _kernel_sync(mine, other, "average")
        table = sync.tables[0].table
        sync.pull(0)
        kernel.assign_add(tf.ones((2, 2)))
        sync.push(0)
        sync.pull(0)  # within the slack: no fresh rows yet
        np.testing.assert_array_equal(kernel.numpy(), 0.5)
        other.read(theirs)
        other.update(theirs, np.zeros((2, 2), np.float32))
        other.clock()
        mine.wait_fresh(table, clock=3)
        sync.pull(0)  # the shards' rows: the same view
        np.testing.assert_array_equal(kernel.numpy(), 0.5)
    finally:
        mine.close()
        other.close()


def test_a_full_pull_takes_the_fresh_rows_over_a_write(thread_cluster):
    """A full pull (`strategy.sync()`, the end of training) carries no
    write onto fresh rows: no step would take it to the shards, and every
    worker must end with the same rows."""
    cluster = thread_cluster(1, 2)
    mine = cluster.client(0, timeout=10, slack=2)
    other = cluster.client(1, timeout=10, slack=2)
    try:
        kernel, sync, theirs = _kernel_sync(mine, other, "sum")
        sync.pull(0)
        sync.push(0)
        sync.pull(0)  # within the slack: no fresh rows
        kernel.assign_add(tf.fill((2, 2), 4.0))  # after the last step
        other.read(theirs)
        other.update(theirs, np.full((2, 2), 2.0, np.float32))
        other.clock()
        sync.pull(0, full=True)
        np.testing.assert_array_equal(kernel.numpy(), 2.0)
    finally:
        mine.close()
        other.close()


@pytest.mark.parametrize("update_mode", ["average", "sum"])
def test_a_write_between_steps_stays_when_fresh_rows_come(thread_cluster,
                                                          update_mode):
    """SSP, 2 workers: a write made between two steps, after a pull that
    brought no fresh rows, is kept on the rows that come at the next pull
    (which replaced it) and reaches the shards with that step's push, as
    every worker's (at 1/2 from this one alone, in either mode)."""
    cluster = thread_cluster(1, 2)
    mine = cluster.client(0, timeout=10, slack=2)
    other = cluster.client(1, timeout=10, slack=2)
    try:
        kernel, sync, theirs = _kernel_sync(mine, other, update_mode)
        table = sync.tables[0].table
        sync.pull(0)
        sync.push(0)  # (a step that changed nothing)
        sync.pull(0)  # within the slack: no fresh rows
        kernel.assign_add(tf.fill((2, 2), 4.0))  # between the steps
        other.read(theirs)
        other.update(theirs, np.full((2, 2), 2.0, np.float32))
        other.clock()
        mine.wait_fresh(table, clock=3)  # (both workers' clock 1)
        sync.pull(0)  # fresh rows: the other's 2 (a raw update)
        fresh = 2.0
        np.testing.assert_array_equal(kernel.numpy(), fresh + 4.0)
        sync.push(0)  # the write, as every worker's: 4 / 2
        other.clock()
        np.testing.assert_array_equal(mine.read(table, clock=4),
                                      np.full((1, 4), fresh + 2.0))
    finally:
        mine.close()
        other.close()


def test_a_pull_that_times_out_gives_its_buffer_back(thread_cluster):
    """Over TCP a pull that must wait reads straight into the next of its
    layer's two buffers; when that read fails, the buffer is given back,
    so the next pull cannot write into the one under the live snapshot."""
    from keras_geeps.errors import GeePSTimeoutError  # noqa: PLC0415

    cluster = thread_cluster(1, 2)
    mine = cluster.client(0, timeout=0.5, shared_memory=False)
    other = cluster.client(1, timeout=10, shared_memory=False)
    try:
        kernel, sync, theirs = _kernel_sync(mine, other, "sum")
        layer = sync.tables[0]
        sync.pull(0)
        kernel.assign_add(tf.ones((2, 2)))
        sync.push(0)
        assert mine.delivers(layer.table)  # the other worker is behind
        expected = layer.next_buffer()
        layer.take_back_buffer()
        with pytest.raises(GeePSTimeoutError):
            sync.pull(0)
        got = layer.next_buffer()
        layer.take_back_buffer()
        assert got is expected
        other.update(theirs, np.full((2, 2), 2.0, np.float32))
        other.clock()
        sync.pull(0)
        np.testing.assert_array_equal(kernel.numpy(), 3.0)
    finally:
        mine.close()
        other.close()
