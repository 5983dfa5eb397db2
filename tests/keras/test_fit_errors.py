"""What `fit` raises when the parameter server fails, and the datasets
`distribute_dataset` refuses. Real shards on 127.0.0.1, real TensorFlow.

The pulls and pushes run inside the compiled step as `tf.py_function`s,
which hand TensorFlow only an exception's message: without keras_geeps'
re-raise a `GeePSTimeoutError` or `GeePSWorkerFailedError` would come out
of `fit` as `tf.errors.UnknownError`.
"""

import contextlib
import os
import threading
import time
import warnings

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")
import tensorflow as tf  # noqa: E402

from keras_geeps.errors import (GeePSError, GeePSTimeoutError,  # noqa
                                GeePSWorkerFailedError)
from keras_geeps.keras import GeePSStrategy  # noqa: E402
from keras_geeps.shard import ShardSettings  # noqa: E402
from tests.keras import regression_data, small_model  # noqa: E402

BATCH = 4


def _from_a_step(excinfo):
    """The GeePS error came out of a step's op, through TensorFlow."""
    assert isinstance(excinfo.value.__cause__, tf.errors.OpError)


@pytest.mark.parametrize("capture", [True, False])
def test_a_pull_timing_out_inside_fit_raises_geeps_timeout_error(
        thread_cluster, capture):
    # Worker 1 never comes: worker 0's second step waits for its clock.
    cluster = thread_cluster(1, 2)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=1.5),
                             capture_updates=capture)
    try:
        model = small_model(strategy)
        x, y = regression_data(4 * BATCH)
        with pytest.raises(GeePSTimeoutError,
                           match="workers \\[1\\]") as excinfo:
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                      verbose=0, callbacks=strategy.callbacks())
        _from_a_step(excinfo)
        assert strategy.parameter_sync.steps == 1
        # evaluate waits for the same clock: the same class (in the
        # catch-up before its first step: step 1's update is pushed).
        with pytest.raises(GeePSTimeoutError):
            model.evaluate(x, y, batch_size=BATCH, verbose=0)
    finally:
        strategy.close()


def _sgd_step(model, optimizer):
    """A custom loop's step: mse of `model`, its gradients applied by
    `optimizer`; returns the loss."""
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables),
                                      variables))
        return loss
    return step


def test_a_custom_loops_errors_keep_their_class(thread_cluster):
    """In a custom loop, a pull timing out comes out of the user's
    tf.function as TensorFlow's UnknownError, and within
    `strategy.reraise()` as GeePSTimeoutError; a step that trains a
    variable outside the scope fails its tracing with GeePSError (not
    AutoGraph's StagingError), naming the variable."""
    cluster = thread_cluster(1, 2)  # worker 1 never comes
    strategy = GeePSStrategy(client=cluster.client(0, timeout=1.5))
    try:
        model = small_model(strategy)
        x, y = regression_data(BATCH)

        def train_step(model, optimizer):
            step = _sgd_step(model, optimizer)
            return tf.function(lambda x, y: strategy.run(step, args=(x, y)))

        in_scope = train_step(model, model.optimizer)
        # (step 1 ends by pulling what it pushed: worker 1's clock 0 too)
        with pytest.raises(tf.errors.UnknownError, match="workers \\[1\\]"):
            in_scope(x, y)
        with pytest.raises(GeePSTimeoutError, match="workers \\[1\\]") as \
                excinfo:
            with strategy.reraise():
                in_scope(x, y)
        _from_a_step(excinfo)
        with strategy.reraise(), pytest.raises(ValueError, match="boom"):
            raise ValueError("boom")  # anything else passes unchanged
        outside = keras.Sequential([keras.Input((5,)),
                                    keras.layers.Dense(2, name="alone")])
        with pytest.raises(GeePSError, match="alone/kernel"):
            train_step(outside, keras.optimizers.SGD(0.1))(x, y)
    finally:
        strategy.close()


def test_sync_warns_when_no_step_ran_through_the_strategy(thread_cluster):
    """A custom step called without strategy.run trains the worker's copy
    alone (no table is ever built): strategy.sync() at the end says so
    instead of returning as if all was synced. After a step through
    strategy.run it syncs without a word."""
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    try:
        model = small_model(strategy)
        x, y = regression_data(BATCH)
        step = _sgd_step(model, model.optimizer)

        tf.function(step)(x, y)  # not through strategy.run
        with pytest.warns(UserWarning, match="no step that trains them has "
                          "run through the strategy, so 4 trainable "
                          "variables"):
            strategy.sync()
        tf.function(lambda x, y: strategy.run(step, args=(x, y)))(x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy.sync()
        assert strategy.client.shard_stats()[0]["updates_applied"] == 2
    finally:
        strategy.close()


def _dying_pair(thread_cluster):
    """Worker 0's strategy (slack 1: the catch-up ending a one-step fit or
    train_on_batch waits for no one) on a 2-worker cluster whose shard
    declares a worker dead after 3 s of silence."""
    cluster = thread_cluster(1, 2, settings=ShardSettings(worker_timeout=3))
    return cluster, GeePSStrategy(
        client=cluster.client(0, timeout=60, heartbeat_interval=0.2,
                              slack=1),
        capture_updates=False, average_epoch_logs=False)


def test_a_worker_declared_dead_inside_fit_raises_geeps_worker_failed(
        thread_cluster):
    cluster, strategy = _dying_pair(thread_cluster)
    stalled = None
    try:
        model = small_model(strategy)
        x, y = regression_data(4 * BATCH)
        # One step alone (tables built and traced, clock 1).
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
        # Worker 1 says HELLO, then falls silent: declared dead 3 s later,
        # while worker 0's pull at clock 2 waits for its clock 0.
        stalled = cluster.client(1, timeout=60, heartbeat_interval=0)
        with pytest.raises(GeePSWorkerFailedError,
                           match="worker 1") as excinfo:
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                      verbose=0)
        _from_a_step(excinfo)
    finally:
        strategy.close()
        if stalled is not None:
            stalled.close()


def test_train_on_batch_raises_the_geeps_error_too(thread_cluster):
    # train_on_batch ends with a catch-up, which waits for what the next
    # step's pull would: an error in that step comes from a worker declared
    # dead meanwhile.
    cluster, strategy = _dying_pair(thread_cluster)
    stalled = None
    try:
        model = small_model(strategy)
        x, y = regression_data(BATCH)
        model.train_on_batch(x, y)  # clock 0 -> 1
        stalled = cluster.client(1, timeout=60, heartbeat_interval=0)
        table = strategy.parameter_sync.tables[0].table
        deadline = time.monotonic() + 30
        with pytest.raises(GeePSWorkerFailedError):  # known to worker 0
            while time.monotonic() < deadline:
                strategy.client.wait_fresh(table)  # within the slack
                time.sleep(0.2)
        with pytest.raises(GeePSWorkerFailedError,
                           match="worker 1") as excinfo:
            model.train_on_batch(x, y)
        _from_a_step(excinfo)
    finally:
        strategy.close()
        if stalled is not None:
            stalled.close()


def test_a_model_built_outside_the_scope_is_refused_not_trained_alone(
        thread_cluster):
    """Keras fits a model under the strategy it was built in: one built
    outside the scope would train on this worker alone, with no table,
    silently. With the strategy's callbacks, fit refuses it, naming its
    variables, and has changed nothing; the model built inside trains."""
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    try:
        x, y = regression_data(8)
        outside = keras.Sequential([keras.Input((5,)),
                                    keras.layers.Dense(2, name="alone")])
        for compile_inside in (False, True):
            with strategy.scope() if compile_inside else \
                    contextlib.nullcontext():
                outside.compile(optimizer="sgd", loss="mse",
                                jit_compile=False)
            before = outside.get_weights()
            with pytest.raises(GeePSError, match=r"model 'sequential\w*' "
                               r"was not built in strategy.scope\(\) \(its "
                               r"variables sequential\w*/alone/kernel"):
                outside.fit(x, y, batch_size=BATCH, verbose=0,
                            callbacks=strategy.callbacks())
            for a, b in zip(before, outside.get_weights()):
                np.testing.assert_array_equal(a, b)
        model = small_model(strategy)
        model.fit(x, y, batch_size=BATCH, verbose=0,
                  callbacks=strategy.callbacks())
        assert strategy.client.shard_stats()[0]["updates_applied"] > 0
    finally:
        strategy.close()


def test_a_model_with_nothing_to_train_and_bad_callbacks_are_named(
        thread_cluster):
    from keras_geeps.keras import ChiefOnly, ParameterServerCallback  # noqa

    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    try:
        model = small_model(strategy)
        for layer in model.layers:
            layer.trainable = False
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
        x, y = regression_data(8)
        with pytest.raises(GeePSError, match="has no trainable weights"):
            model.fit(x, y, batch_size=BATCH, verbose=0,
                      callbacks=strategy.callbacks())
        for args, pattern in [
                ((None,), "strategy must be a keras_geeps GeePSStrategy"),
                ((keras.callbacks.History(), None), "strategy must be"),
                (("ck.keras", strategy), "callback must be a keras.callb")]:
            with pytest.raises(TypeError, match=pattern):
                (ParameterServerCallback if len(args) == 1 else
                 ChiefOnly)(*args)
    finally:
        strategy.close()


def test_a_fit_that_runs_no_step_ends_with_the_same_weights(thread_cluster):
    """fit(epochs=0) (or initial_epoch past epochs) runs no step, yet the
    strategy's callbacks promise identical weights at its end: the tables
    are made there and every worker takes worker 0's initial values,
    without the warning a direct sync() with no step gets."""
    cluster = thread_cluster(1, 2)

    def worker(w):
        strategy = GeePSStrategy(client=cluster.client(w, timeout=20))
        try:
            with strategy.scope():
                keras.utils.set_random_seed(w)  # different initial values
                model = keras.Sequential([keras.Input((5,)),
                                          keras.layers.Dense(3, name="a")],
                                         name="m")
                model.compile(optimizer="sgd", loss="mse", jit_compile=False)
            x, y = regression_data(8)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                model.fit(x, y[:, :1].repeat(3, 1), epochs=2,
                          initial_epoch=2, verbose=0,
                          callbacks=strategy.callbacks())
            return model.get_weights()
        finally:
            strategy.close()

    from tests.worker_threads import run_worker_threads  # noqa: PLC0415
    results, errors = run_worker_threads(2, worker)
    assert not errors, errors[0]
    for a, b in zip(results[0], results[1]):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------ distribute_dataset
def _strategies(thread_cluster):
    cluster = thread_cluster(1, 2)
    return [GeePSStrategy(client=cluster.client(w, timeout=20))
            for w in range(2)]


def _length(dataset):
    return sum(1 for _ in dataset)


def test_a_dataset_of_unknown_length_is_refused_with_the_remedy(
        thread_cluster):
    strategies = _strategies(thread_cluster)
    try:
        # 5 even numbers, but tf.data cannot count through filter: the
        # shards would be 3 and 2 batches, and worker 0 would wait at its
        # third step for worker 1 until the timeout.
        evens = tf.data.Dataset.range(10).filter(lambda v: v % 2 == 0)
        assert int(evens.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
        for strategy in strategies:
            with pytest.raises(ValueError, match="cardinality is unknown.*"
                               "assert_cardinality.*steps_per_epoch"):
                strategy.distribute_dataset(evens)
        # Declared, it is cut to the same number of steps on every worker.
        counted = evens.apply(tf.data.experimental.assert_cardinality(5))
        assert [_length(s.distribute_dataset(counted))
                for s in strategies] == [2, 2]
        # Repeated (infinite, for fit's steps_per_epoch): shard only.
        endless = strategies[1].distribute_dataset(evens.repeat())
        assert list(endless.take(4).as_numpy_iterator()) == [2, 6, 0, 4]
        # Already split per worker, or one worker: nothing to even out.
        assert strategies[0].distribute_dataset(evens, shard=False) is evens
        # Fewer batches than workers: every share would be empty (fit
        # would end in a bare StopIteration).
        for strategy in strategies:
            with pytest.raises(ValueError, match="1 elements .batches., "
                               "fewer than the 2 workers"):
                strategy.distribute_dataset(counted.batch(5))
    finally:
        for strategy in strategies:
            strategy.close()


def test_a_dataset_of_known_length_is_evened_out(thread_cluster):
    strategies = _strategies(thread_cluster)
    try:
        batches = tf.data.Dataset.range(10).batch(2)  # 5 batches
        shards = [list(s.distribute_dataset(batches).as_numpy_iterator())
                  for s in strategies]
        assert [len(s) for s in shards] == [2, 2]
        np.testing.assert_array_equal(np.concatenate(shards[0] + shards[1]),
                                      [0, 1, 4, 5, 2, 3, 6, 7])
    finally:
        for strategy in strategies:
            strategy.close()


def test_workers_running_different_numbers_of_steps_are_told_at_once(
        thread_cluster):
    """numpy data split unevenly (33 rows by 2, batch 4): worker 0 runs 5
    steps an epoch, worker 1 4. Their first epoch-end barrier carries both
    clocks, and both raise there, saying why, instead of waiting for each
    other's clocks until the timeout (20 s here)."""
    strategies = _strategies(thread_cluster)
    x, y = regression_data(33)
    errors = {}
    build = threading.Lock()

    def worker(w):
        with build:
            model = small_model(strategies[w], name="m")
        started = time.monotonic()
        try:
            model.fit(x[w::2], y[w::2], batch_size=BATCH, epochs=3,
                      verbose=0, callbacks=strategies[w].callbacks())
        except GeePSError as exc:
            errors[w] = (exc, time.monotonic() - started)

    threads = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        for strategy in strategies:
            strategy.close()
    assert sorted(errors) == [0, 1], errors
    for w, clock in ((0, 5), (1, 4)):
        exc, seconds = errors[w]
        assert not isinstance(exc, GeePSTimeoutError)
        assert f"ended epoch 0 after different numbers of steps (this " \
            f"worker at clock {clock}; the workers' mean 4.5" in str(exc)
        assert "distribute_dataset" in str(exc) and seconds < 20


def _rejoin_after(cluster, steps_before):
    """Worker 0 runs `steps_before(first, model)` while worker 1, silent,
    is declared dead; then worker 1 comes back. Returns (first, again):
    worker 0's and the rejoined worker 1's strategies, each with a model
    named "m" as `.model`."""
    first = GeePSStrategy(client=cluster.client(0, timeout=30,
                                                heartbeat_interval=0.2))
    silent = cluster.client(1, timeout=30, heartbeat_interval=0)
    assert silent.rejoined_at is None  # a first HELLO joins, not rejoins
    first.model = small_model(first, name="m")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # worker 0 never rejoined
        # Its second step waits until worker 1 is declared dead.
        steps_before(first, first.model)
    silent.close()
    again = GeePSStrategy(client=cluster.client(1, timeout=30,
                                                heartbeat_interval=0.2))
    again.model = small_model(again, name="m")
    return first, again


def test_a_worker_rejoining_at_an_epoch_start_starts_at_the_others_epoch(
        thread_cluster):
    """Under on_worker_failure="continue", a worker the others went on
    without learns at its HELLO the clock it rejoined at; rejoining where
    the others' epoch starts, its `fit` starts at their epoch (the epoch
    logs' barrier says which), with no warning."""
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        worker_timeout=1, on_worker_failure="continue"))
    x, y = regression_data(4 * BATCH)

    def one_epoch(strategy, model):  # 4 steps, then the epoch-end barrier
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0, callbacks=strategy.callbacks())

    first, again = _rejoin_after(cluster, one_epoch)
    try:
        assert first.parameter_sync.steps == 4
        assert again.client.rejoined_at == 4  # the layers' tables' clock
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # epochs=1: the others finished epoch 0, so nothing is left.
            history = again.model.fit(x, y, batch_size=BATCH, epochs=1,
                                      verbose=0)
        assert history.epoch == []
        assert again.parameter_sync.clock == 4
    finally:
        again.close()
        first.close()


def test_a_worker_rejoining_mid_epoch_joins_the_others_next_epoch_end(
        thread_cluster):
    """Rejoining 2 steps into the others' 4-step epoch, a worker's `fit`
    first clocks its tables to their epoch end (each clock as worker 0
    steps), takes part in that end's barrier with no logs, and starts at
    the next epoch, whose end it then averages with worker 0."""
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        worker_timeout=1, on_worker_failure="continue"))
    x, y = regression_data(4 * BATCH)

    def epoch_and_a_half(strategy, model):  # clocks 0-3, barrier, 4-5
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0, callbacks=strategy.callbacks())
        for _ in range(2):
            model.train_on_batch(x[:BATCH], y[:BATCH])

    first, again = _rejoin_after(cluster, epoch_and_a_half)
    logs_of_first = []

    def worker_0_goes_on():  # as its fit would: epoch 1's rest, epoch 2
        for epoch, steps in ((1, 2), (2, 4)):
            for _ in range(steps):
                first.model.train_on_batch(x[:BATCH], y[:BATCH])
            logs = {"loss": 10.0 * epoch}
            first.epoch_logs.average(logs, epoch=epoch,
                                     clock=first.parameter_sync.clock)
            logs_of_first.append(logs)

    thread = threading.Thread(target=worker_0_goes_on)
    try:
        assert again.client.rejoined_at == 6
        thread.start()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            history = again.model.fit(x, y, batch_size=BATCH, epochs=3,
                                      shuffle=False, verbose=0)
        thread.join(60)
        assert not thread.is_alive()
        assert history.epoch == [2]
        assert again.model._initial_epoch is None  # a later fit: its own
        assert again.parameter_sync.clock == first.parameter_sync.clock == 12
        # Epoch 1's barrier: worker 0 alone; epoch 2's: both, averaged.
        assert logs_of_first[0] == {"loss": 10.0}
        assert logs_of_first[1]["loss"] == history.history["loss"][0]
        assert logs_of_first[1]["loss"] != 20.0
    finally:
        if thread.ident is not None:  # (an assert may come before start)
            thread.join(60)
        again.close()
        first.close()


def test_a_worker_rejoining_mid_step_brings_its_tables_to_one_clock(
        thread_cluster):
    """Worker 0 has clocked one of its two tables for its step when worker
    1 rejoins: the rejoined worker's tables are at two clocks. Its `fit`
    first clocks the lagging one (the others wait for it there), then
    lines up as usual; without that, its tables would stay a clock apart
    and the epoch-end barriers would wait until the timeout."""
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        worker_timeout=1, on_worker_failure="continue"))
    x, y = regression_data(4 * BATCH)

    def epoch_and_a_half_step(strategy, model):  # clocks 0-5, half of 6
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0, callbacks=strategy.callbacks())
        for _ in range(2):
            model.train_on_batch(x[:BATCH], y[:BATCH])
        tables = [layer.table for layer in strategy.parameter_sync.tables]
        assert len(tables) == 2
        strategy.client.clock(tables[:1])  # (an empty step 6, half done)
        # A reply comes after the shard took that clock (one socket, in
        # order): worker 1's HELLO, from another socket, finds it taken.
        strategy.client.shard_stats()

    first, again = _rejoin_after(cluster, epoch_and_a_half_step)

    def worker_0_goes_on():
        tables = [layer.table for layer in first.parameter_sync.tables]
        first.client.clock(tables[1:])  # the rest of step 6
        for epoch, steps in ((1, 1), (2, 4)):
            for _ in range(steps):
                first.model.train_on_batch(x[:BATCH], y[:BATCH])
            first.epoch_logs.average({"loss": 1.0}, epoch=epoch,
                                     clock=first.parameter_sync.clock)

    thread = threading.Thread(target=worker_0_goes_on)
    try:
        assert again.client.rejoined_at == 7
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again.parameter_sync.build_pending()
            clocks = [layer.table.clock
                      for layer in again.parameter_sync.tables]
            assert clocks == [7, 6]
            thread.start()
            history = again.model.fit(x, y, batch_size=BATCH, epochs=3,
                                      shuffle=False, verbose=0)
        thread.join(60)
        assert not thread.is_alive()
        assert history.epoch == [2]
        assert again.parameter_sync.clock == first.parameter_sync.clock == 12
        assert [layer.table.clock for layer in
                again.parameter_sync.tables] == [12, 12]
    finally:
        if thread.ident is not None:  # (an assert may come before start)
            thread.join(60)
        again.close()
        first.close()


def test_a_worker_rejoining_before_any_epoch_end_is_warned(thread_cluster):
    """With no epoch end yet there is nothing to read where the others'
    epochs end: the rejoined worker's `fit` warns that its epoch ends line
    up only if it starts where the others' epoch does."""
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        worker_timeout=1, on_worker_failure="continue"))
    x, y = regression_data(BATCH)

    def two_steps(strategy, model):
        for _ in range(2):
            model.train_on_batch(x, y)

    first, again = _rejoin_after(cluster, two_steps)
    try:
        assert again.client.rejoined_at == 2
        with pytest.warns(UserWarning, match=(
                "worker 1 rejoined a job under way at clock 2 but cannot "
                "line up with the other workers' epochs \\(no epoch of the "
                "others has ended yet\\)")) as caught:
            again.model.fit(x, y, batch_size=BATCH, epochs=0, verbose=0)
        message = next(str(w.message) for w in caught
                       if "rejoined a job under way" in str(w.message))
        assert "average_epoch_logs=False, average_non_trainable=False" in \
            message
    finally:
        again.close()
        first.close()
