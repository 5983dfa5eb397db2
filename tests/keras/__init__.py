"""Tests of the Keras face: real shards on 127.0.0.1, real TensorFlow."""

import contextlib

import numpy as np


def regression_data(rows):
    """Seeded (x, y): `rows` samples of 5 features and 2 targets."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 5)).astype(np.float32)
    y = rng.standard_normal((rows, 2)).astype(np.float32)
    return x, y


def flat_weights(model):
    """`model`'s weights, in order, as one vector."""
    return np.concatenate([w.reshape(-1) for w in model.get_weights()])


def shard_rows(strategy):
    """The shards' rows of every table of `strategy`, in table order, as
    one vector."""
    return np.concatenate([strategy.client.read(layer.table).reshape(-1)
                           for layer in strategy.parameter_sync.tables])


def small_model(strategy, name=None):
    """A seeded 5 -> 3 -> 2 Dense model (layers "a", "b"), SGD(0.1) on
    mse, built and compiled in `strategy`'s scope, without XLA. `name`:
    the model's (its tables' prefix), Keras' own when None; workers in one
    process need the same one."""
    import keras  # noqa: PLC0415 (TensorFlow's backend is set by then)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)),
                                  keras.layers.Dense(3, name="a"),
                                  keras.layers.Dense(2, name="b")],
                                 name=name)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      jit_compile=False)
    return model


@contextlib.contextmanager
def one_worker_strategy(thread_cluster, **kwargs):
    """A `GeePSStrategy` (kwargs passed on) of the one worker of a new
    1-shard thread cluster (`thread_cluster`: the fixture), closed after."""
    from keras_geeps.keras import GeePSStrategy  # noqa: PLC0415
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20), **kwargs)
    try:
        yield strategy
    finally:
        strategy.close()
