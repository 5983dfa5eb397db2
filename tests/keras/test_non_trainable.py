"""Non-trainable statistics averaged over workers through a shard table
(real shards; each worker thread builds its own Keras model)."""

import threading
import time

import keras
import numpy as np
import pytest

from keras_geeps.errors import GeePSError, GeePSTimeoutError
from keras_geeps.keras import non_trainable
from keras_geeps.keras.non_trainable import NonTrainableAverager
from keras_geeps.keras.worker_mean import WorkerMean
from tests.worker_threads import run_clients, run_worker_threads

_BUILD = threading.Lock()  # (Keras' name scopes are global: build in turn)


def _model(bn_name="bn", units=4):
    with _BUILD:
        model = keras.Sequential([
            keras.Input((3,)),
            keras.layers.Dense(units, name="dense"),
            keras.layers.BatchNormalization(name=bn_name),
            keras.layers.BatchNormalization(name="frozen"),
            keras.layers.Dropout(0.5, seed=1, name="dropout"),  # int state
            keras.layers.Dense(2, name="head"),
        ], name="model")
    model.get_layer("frozen").trainable = False
    return model


def _set_statistics(model, w):
    rng = np.random.default_rng(w)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            size = layer.moving_mean.shape
            layer.moving_mean.assign(rng.normal(size=size).astype(
                np.float32))
            layer.moving_variance.assign(
                rng.uniform(0.5, 2.0, size=size).astype(np.float32))


def _statistics(model, name):
    layer = model.get_layer(name)
    return [np.array(v.numpy()) for v in (layer.moving_mean,
                                          layer.moving_variance)]


def test_only_trainable_layers_float_statistics_are_averaged():
    model = _model()
    names = [v.path for v in non_trainable.averaged_variables(model)]
    assert names == ["model/bn/moving_mean", "model/bn/moving_variance"]
    model.trainable = False  # a frozen model: nothing to average
    assert non_trainable.averaged_variables(model) == []


def test_variables_of_parameter_tables_are_left_out(thread_cluster):
    """LoRA freezes a Dense kernel in a trainable layer: created
    trainable, it is in a parameter table, the shards' (alike on every
    worker), not a statistic."""
    from keras_geeps.keras.strategy import GeePSStrategy  # noqa: PLC0415
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10) as client:
        strategy = GeePSStrategy(client=client)
        try:
            with strategy.scope(), _BUILD:
                model = keras.Sequential([
                    keras.Input((3,)),
                    keras.layers.Dense(4, name="dense"),
                    keras.layers.BatchNormalization(name="bn"),
                ], name="lora")
                model.get_layer("dense").enable_lora(2)
            assert "lora/dense/kernel" in [  # frozen by LoRA
                v.path for v in model.non_trainable_variables]
            names = [v.path for v in non_trainable.averaged_variables(
                model, strategy.parameter_sync)]
            assert names == ["lora/bn/moving_mean",
                             "lora/bn/moving_variance"]
            assert "lora/dense/kernel" in [  # (without the sync's tables)
                v.path for v in non_trainable.averaged_variables(model)]
        finally:
            strategy.close()


def test_every_worker_gets_the_mean_statistics(thread_cluster):
    cluster = thread_cluster(2, 3)

    def epochs(client, w):
        model = _model()
        _set_statistics(model, w)
        own = _statistics(model, "bn"), _statistics(model, "frozen")
        averager = NonTrainableAverager(client)
        seen = []
        for _ in range(2):  # a second epoch end: the mean of equal values
            assert averager.average(model) == 2
            seen.append(_statistics(model, "bn"))
        return own, seen, _statistics(model, "frozen")

    results = run_clients(cluster, epochs, timeout=30)
    for i in range(2):  # moving_mean, moving_variance
        # float64 sum of the float32 values, divided, rounded to float32
        expected = (sum(results[w][0][0][i].astype(np.float64)
                        for w in range(3)) / 3).astype(np.float32)
        assert not np.array_equal(results[0][0][0][i],
                                  results[1][0][0][i])
        for w in range(3):
            _, seen, frozen = results[w]
            for epoch in range(2):
                np.testing.assert_array_equal(seen[epoch][i], expected)
            # A frozen layer keeps its own statistics.
            np.testing.assert_array_equal(frozen[i], results[w][0][1][i])


def test_one_worker_is_left_alone(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=5) as client:
        model = _model()
        _set_statistics(model, 0)
        before = _statistics(model, "bn")
        assert NonTrainableAverager(client).average(model) == 0
        for a, b in zip(before, _statistics(model, "bn")):
            np.testing.assert_array_equal(a, b)
        # No table was made for it (creating one by that name works).
        client.create_table(f"{non_trainable.TABLE_PREFIX}.0", 2, 3,
                            "float64")


def test_workers_with_different_models_get_a_clear_error(thread_cluster):
    cluster = thread_cluster(1, 2)

    def epoch(w):
        with cluster.client(w, timeout=20) as client:
            # As many values, under other names on worker 1.
            NonTrainableAverager(client).average(
                _model("bn" if w == 0 else "norm"))

    _, errors = run_worker_threads(2, epoch)
    assert len(errors) == 2
    assert all(isinstance(e, GeePSError) and
               "different non-trainable variables" in str(e)
               for e in errors)


def test_the_mean_of_non_finite_values(thread_cluster):
    cluster = thread_cluster(1, 2)
    sent = np.array([[1.0, np.nan, np.inf, np.inf, 1e300, 2.0],
                     [3.0, 1.0, 5.0, -np.inf, 1e300, 4.0]])

    def barriers(client, w):
        mean = WorkerMean(client, "means", 6)
        return [mean.mean(sent[w], key=5.0, mismatch="no"),
                mean.mean(sent[1 - w][::-1], key=5.0, mismatch="no")]

    results = run_clients(cluster, barriers, timeout=20)
    first = [2.0, np.nan, np.inf, np.nan, 1e300, 3.0]
    for w in range(2):
        np.testing.assert_array_equal(results[w][0], first)
        # NaN and inf did not stay behind for the next barrier.
        np.testing.assert_array_equal(results[w][1], first[::-1])


def test_a_wrong_number_of_values_is_refused(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=5) as client:
        with pytest.raises(GeePSError, match="3 values, not 2"):
            WorkerMean(client, "means", 2).mean([1, 2, 3], 1.0, "no")
        # Another mean of that name but of other values (the table a
        # strategy sharing the client made) is refused, naming both.
        WorkerMean(client, "means", 2).mean([1, 2], 1.0, "no")
        with pytest.raises(GeePSError, match=(
                "1 x 10 per clock, not the per-clock 1 x 14")):
            WorkerMean(client, "means", 3).mean([1, 2, 3], 1.0, "no")


def test_strategies_sharing_a_client_keep_a_table_per_layout(
        thread_cluster):
    cluster = thread_cluster(1, 2)

    def epochs(client, w):
        first, second = _model(), _model("norm", units=5)
        _set_statistics(first, w)
        _set_statistics(second, w + 2)
        # two averagers (two strategies' own) on one client
        for averager, model in ((NonTrainableAverager(client), first),
                                (NonTrainableAverager(client), second),
                                (NonTrainableAverager(client), first)):
            averager.average(model)
        tables = []
        for n in range(3):
            try:
                tables.append(client.table(
                    f"{non_trainable.TABLE_PREFIX}.{n}").width)
            except KeyError:
                pass
        return tables, _statistics(first, "bn"), _statistics(second, "norm")

    results = run_clients(cluster, epochs, timeout=30)
    # one table per layout: 2 x 4 and 2 x 5 values
    assert results[0][0] == results[1][0] == [2 + 4 * 8, 2 + 4 * 10]
    for i in range(2):
        np.testing.assert_array_equal(results[0][1][i], results[1][1][i])
        np.testing.assert_array_equal(results[0][2][i], results[1][2][i])


def test_a_worker_that_never_comes_is_named_within_the_timeout(
        thread_cluster):
    cluster = thread_cluster(1, 2)
    timed_out = threading.Event()

    def epoch(w):
        with cluster.client(w, timeout=2) as client:
            if w == 1:  # connected, but never reaches the barrier
                assert timed_out.wait(30)  # (closing would say LEAVE)
                return None
            model = _model()
            started = time.monotonic()
            try:
                with pytest.raises(GeePSTimeoutError,
                                   match="non-trainable variables"):
                    NonTrainableAverager(client).average(model)
            finally:
                timed_out.set()
            return time.monotonic() - started

    results, errors = run_worker_threads(2, epoch, timeout=30)
    assert not errors
    assert results[0] < 10  # the client's timeout, not forever


def _two_workers(thread_cluster):
    """A 1-shard cluster of 2 workers, and 16 samples of 5 -> 2 (x, y)."""
    rng = np.random.default_rng(0)
    return (thread_cluster(1, 2), rng.normal(size=(16, 5)).astype("float32"),
            rng.normal(size=(16, 2)).astype("float32"))


def test_validating_on_one_worker_only_is_named(thread_cluster):
    """The statistics are averaged before validation where it runs, after
    the logs elsewhere: with validation on worker 0 only, the workers make
    their barrier tables in different orders. Worker 0 is told why (not
    the shard's 'table 3 exists as ...'); worker 1 waits, then times out."""
    from keras_geeps.keras.strategy import GeePSStrategy  # noqa: PLC0415
    cluster, x, y = _two_workers(thread_cluster)

    def worker(w):
        strategy = GeePSStrategy(client=cluster.client(w, timeout=5))
        try:
            with _BUILD, strategy.scope():
                keras.utils.set_random_seed(1)
                model = keras.Sequential([
                    keras.Input((5,)), keras.layers.Dense(4, name="a"),
                    keras.layers.BatchNormalization(name="bn"),
                    keras.layers.Dense(2, name="b")], name="m")
                model.compile(optimizer="sgd", loss="mse",
                              jit_compile=False)
            validation = {"validation_data": (x[:8], y[:8])} if w == 0 \
                else {}
            with pytest.raises(GeePSError) as raised:
                model.fit(x[w::2], y[w::2], batch_size=4, verbose=0,
                          callbacks=strategy.callbacks(), **validation)
            return raised.value
        finally:
            strategy.close()

    results, errors = run_worker_threads(2, worker)
    assert not errors, errors[0]
    assert "reached their epoch-end barriers in different orders" in \
        str(results[0]) and "validation settings" in str(results[0])
    assert isinstance(results[1], GeePSTimeoutError)


def test_workers_training_their_models_in_other_orders_are_refused(
        thread_cluster):
    """Each model's tables are made at its own first train step, so the
    workers must train their models in one order: worker 1 fitting its
    second model first declares (as table 0) what worker 0 creates as its
    first model's. Whichever comes second is refused naming both tables;
    the other waits for it, and times out."""
    from keras_geeps.keras.strategy import GeePSStrategy  # noqa: PLC0415
    cluster, x, y = _two_workers(thread_cluster)

    def worker(w):
        strategy = GeePSStrategy(client=cluster.client(w, timeout=5))
        try:
            with _BUILD, strategy.scope():
                models = [keras.Sequential([
                    keras.Input((5,)), keras.layers.Dense(2, name="a")],
                    name=name) for name in ("first", "second")]
                for model in models:
                    model.compile(optimizer="sgd", loss="mse",
                                  jit_compile=False)
            with pytest.raises(GeePSError) as raised:
                for model in models if w == 0 else models[::-1]:
                    model.fit(x[w::2], y[w::2], batch_size=4, verbose=0,
                              callbacks=strategy.callbacks())
            return raised.value
        finally:
            strategy.close()

    results, errors = run_worker_threads(2, worker)
    assert not errors, errors[0]
    refused = [str(e) for e in results.values()
               if not isinstance(e, GeePSTimeoutError)]
    assert len(refused) == 1, results
    assert "exists as" in refused[0] and "'first/a'" in refused[0] and \
        "'second/a'" in refused[0]


class _RandomProjection(keras.layers.Layer):
    """A fixed random projection: a weight made non-trainable, with a
    random initializer, in a trainable layer."""

    def build(self, input_shape):
        self.proj = self.add_weight(shape=(input_shape[-1], 6),
                                    initializer="random_normal",
                                    trainable=False, name="proj")

    def call(self, x):
        return keras.ops.relu(x @ self.proj)


class _AssignedProjection(_RandomProjection):
    """A fixed random projection its layer draws in `build` and assigns
    (an eager write before any fit, which is no restore)."""

    def build(self, input_shape):
        self.proj = self.add_weight(shape=(input_shape[-1], 6),
                                    initializer="zeros", trainable=False,
                                    name="proj")
        self.proj.assign(np.random.normal(  # (set_random_seed seeds it)
            size=(input_shape[-1], 6)).astype("float32"))


def test_every_worker_starts_from_worker_0s_non_trainable_weights(
        thread_cluster):
    """Workers seeded differently (as processes without a common seed)
    draw different random non-trainable weights: they take worker 0's at
    the first step, as the parameter tables take its trainable ones. A
    frozen layer's would otherwise differ for the whole run; a trainable
    layer's would be replaced at the first epoch end by the mean of two
    random draws, a weight no worker held. The optimizer's slots and the
    metrics' totals (each worker's own) are not shared."""
    from keras_geeps.keras.strategy import GeePSStrategy  # noqa: PLC0415
    cluster, x, y = _two_workers(thread_cluster)

    def worker(w):
        strategy = GeePSStrategy(client=cluster.client(w, timeout=10))
        try:
            with _BUILD, strategy.scope():
                keras.utils.set_random_seed(100 + w)
                frozen = _RandomProjection(name="frozen")
                frozen.trainable = False
                assigned = _AssignedProjection(name="ap")
                assigned.trainable = False
                model = keras.Sequential([
                    keras.Input((5,)), _RandomProjection(name="rp"), frozen,
                    keras.layers.Dense(5, name="to5"), assigned,
                    keras.layers.BatchNormalization(name="bn"),
                    keras.layers.Dense(2, name="head")], name="m")
                model.compile(optimizer=keras.optimizers.Adam(0.01),
                              loss="mse", jit_compile=False)
            start = {v.path: np.array(v.numpy()) for v in model.weights}
            model.fit(x[w::2], y[w::2], batch_size=4, epochs=2, verbose=0,
                      callbacks=strategy.callbacks())
            end = {v.path: np.array(v.numpy()) for v in model.weights}
            return start, end, strategy.parameter_sync._constants
        finally:
            strategy.close()

    results, errors = run_worker_threads(2, worker)
    assert not errors, errors[0]
    (start0, end0, left0), (start1, end1, _) = results[0], results[1]
    for path in ("m/rp/proj", "m/frozen/proj", "m/ap/proj"):
        assert not np.array_equal(start0[path], start1[path])
        np.testing.assert_array_equal(end0[path], start0[path])
        np.testing.assert_array_equal(end1[path], start0[path])
    for path in end0:  # the statistics averaged, the rest trained alike
        np.testing.assert_allclose(end0[path], end1[path], rtol=1e-6)
    assert left0 == []  # nothing left to share at a later build


def _killed_and_resumed(tmp_path, worker):
    """Runs `worker(addresses, w, resumed)` for 2 worker threads against a
    shard writing a checkpoint every clock, then again against it
    restored from there: the results of the second run, by worker."""
    from keras_geeps.shard import ShardServer  # noqa: PLC0415
    from keras_geeps.shard.settings import ShardSettings  # noqa: PLC0415
    settings = ShardSettings(checkpoint_dir=str(tmp_path / "ckpt"),
                             checkpoint_every=1)
    for resumed in (False, True):
        shard = ShardServer("tcp://127.0.0.1:0", 0, 1, 2, settings,
                            restore=resumed).start()
        try:
            results, errors = run_worker_threads(
                2, lambda w: worker([shard.address], w, resumed),
                timeout=120)
        finally:
            shard.stop()
        assert not errors, errors[0]
    return results


@pytest.mark.parametrize("restore", ["backup", "load_weights"])
def test_a_resumed_fit_keeps_the_statistics_its_backup_restored(tmp_path,
                                                                restore):
    """A job killed in epoch 1 and resumed: the shards restored from
    their checkpoint, each worker's `BackupAndRestore` (or its own
    `load_weights` before `fit`) restores the statistics of epoch 0's end
    (alike on every worker; here set to 3 by a callback, BatchNorm's
    momentum 1 keeping them so). The first step's build shares the
    starting values of the non-trainable weights: it gave worker 1 the
    job's starting ones (zeros) over its restored ones."""
    from keras_geeps.cluster import ClusterSpec  # noqa: PLC0415
    from keras_geeps.keras.strategy import GeePSStrategy  # noqa: PLC0415
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype(np.float32)
    y = rng.normal(size=(32, 2)).astype(np.float32)

    class SetThenDie(keras.callbacks.Callback):
        def __init__(self, saved):
            super().__init__()
            self.saved = saved

        def on_epoch_end(self, epoch, logs=None):
            self.model.get_layer("bn").moving_mean.assign(np.full(4, 3.0))
            self.model.save_weights(self.saved)

        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() > 4:
                raise RuntimeError("killed")

    class Probe(keras.callbacks.Callback):
        def __init__(self, seen):
            super().__init__()
            self.seen = seen

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(
                self.model.get_layer("bn").moving_mean.numpy().copy())

    def worker(addresses, w, resumed):
        strategy = GeePSStrategy(cluster=ClusterSpec(addresses, 2, w),
                                 timeout=30)
        seen = []
        try:
            with _BUILD, strategy.scope():
                model = keras.Sequential([
                    keras.Input((3,)), keras.layers.Dense(4, name="dense"),
                    keras.layers.BatchNormalization(momentum=1.0, name="bn"),
                    keras.layers.Dense(2, name="head")], name="model")
                model.compile(optimizer=keras.optimizers.SGD(0.01),
                              loss="mse", jit_compile=False)
            saved = str(tmp_path / f"w{w}.weights.h5")
            callbacks = strategy.callbacks() + [
                Probe(seen) if resumed else SetThenDie(saved)]
            epochs = 2
            if restore == "backup":
                callbacks.append(keras.callbacks.BackupAndRestore(
                    str(tmp_path / f"b{w}")))
            elif resumed:
                model.load_weights(saved)
                epochs = 1
            try:
                model.fit(x[w::2], y[w::2], batch_size=4, epochs=epochs,
                          verbose=0, callbacks=callbacks)
            except RuntimeError:
                assert not resumed
            return seen
        finally:
            strategy.close()

    results = _killed_and_resumed(tmp_path, worker)
    for w in range(2):  # every step of the resumed epoch, on both
        assert len(results[w]) == 4
        for mean in results[w]:
            np.testing.assert_array_equal(mean, np.full(4, 3.0))


def test_a_resumed_worker_0_takes_the_jobs_starting_weights(tmp_path):
    """Resumed with no backup, in processes seeded anew: worker 0 draws a
    new frozen random projection, but the job's (its own from the first
    run, on the shards) is what every worker trains with; it kept its new
    draw, which no other worker held."""
    from keras_geeps.cluster import ClusterSpec  # noqa: PLC0415
    from keras_geeps.keras.strategy import GeePSStrategy  # noqa: PLC0415
    x, y = (np.ones((8, 5), np.float32), np.ones((8, 2), np.float32))

    def worker(addresses, w, resumed):
        strategy = GeePSStrategy(cluster=ClusterSpec(addresses, 2, w),
                                 timeout=30)
        try:
            with _BUILD, strategy.scope():
                keras.utils.set_random_seed(100 + w + 10 * resumed)
                frozen = _RandomProjection(name="frozen")
                frozen.trainable = False
                model = keras.Sequential([
                    keras.Input((5,)), frozen,
                    keras.layers.Dense(2, name="head")], name="m")
                model.compile(optimizer="sgd", loss="mse", jit_compile=False)
            drawn = np.array(frozen.proj.numpy())
            model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                      callbacks=strategy.callbacks())
            return drawn, np.array(frozen.proj.numpy())
        finally:
            strategy.close()

    first = {}
    results = _killed_and_resumed(
        tmp_path, lambda a, w, resumed: first.setdefault(
            (w, resumed), worker(a, w, resumed)))
    job_start = first[0, False][0]
    assert not np.array_equal(results[0][0], job_start)  # a new draw
    for w in range(2):
        np.testing.assert_array_equal(results[w][1], job_start)
