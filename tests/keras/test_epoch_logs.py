"""Epoch logs averaged over workers through a shard table (real shards)."""

import numpy as np
import pytest

from keras_geeps.errors import GeePSError
from keras_geeps.keras import epoch_logs
from keras_geeps.keras.epoch_logs import EpochLogAverager
from keras_geeps.shard import ShardSettings
from tests.worker_threads import run_clients, run_worker_threads


def test_every_worker_gets_the_mean_of_each_epoch(thread_cluster):
    cluster = thread_cluster(2, 3)

    def epochs(client, w):
        averager = EpochLogAverager(client)
        seen = []
        for epoch in range(3):
            logs = {"loss": float(w + 10 * epoch), "val_accuracy":
                    np.float32(0.5 + w / 10), "note": "text",
                    "steps": np.int64(w)}
            averager.average(logs)
            seen.append(logs)
        return seen

    results = run_clients(cluster, epochs, timeout=20)
    for epoch in range(3):
        for w in range(3):
            logs = results[w][epoch]
            assert logs["loss"] == pytest.approx(1.0 + 10 * epoch)
            assert logs["val_accuracy"] == pytest.approx(0.6)
            assert logs["steps"] == pytest.approx(1.0)
            assert logs["note"] == "text"  # not a number: left alone


def test_per_class_metrics_are_averaged_element_by_element(thread_cluster):
    """A metric that is an array (`F1Score(average=None)`, a confusion
    matrix) is averaged element by element and keeps its shape; a worker
    whose array has another shape is named as having other keys."""
    cluster = thread_cluster(1, 3)

    def epoch(client, w):
        f1_score = np.array([w, 2 * w, 0.5], np.float32)
        logs = {"loss": float(w), "f1_score": f1_score,
                "confusion": np.full((2, 2), 3 * w, np.int64),
                "empty": np.zeros(0)}
        EpochLogAverager(client).average(logs)
        return logs

    results = run_clients(cluster, epoch, timeout=20)
    for logs in results.values():
        assert logs["loss"] == pytest.approx(1.0)
        np.testing.assert_allclose(logs["f1_score"], [1.0, 2.0, 0.5])
        np.testing.assert_allclose(logs["confusion"], np.full((2, 2), 3.0))
        assert logs["empty"].size == 0  # no number: left alone
    cluster = thread_cluster(1, 2)

    def other_shapes(w):
        with cluster.client(w, timeout=20) as client:
            EpochLogAverager(client).average(
                {"loss": 1.0, "f1_score": np.ones(3 if w else 4)})

    _, errors = run_worker_threads(2, other_shapes)
    assert len(errors) == 2
    assert all(isinstance(e, GeePSError) and "different keys" in str(e)
               and "f1_score(" in str(e) for e in errors)


def test_a_metric_per_class_of_a_thousand_classes_is_averaged(
        thread_cluster):
    """More than 251 numbers (F1Score(average=None) over 300 classes) were
    refused at the first epoch end, after a whole epoch; past MAX_KEYS
    they still are, naming the way out."""
    cluster = thread_cluster(1, 2)

    def epoch(client, w):
        logs = {"loss": float(w), "f1_score": np.full(1000, w, np.float32)}
        averager = EpochLogAverager(client)
        averager.average(logs)
        too_many = {"f1_score": np.zeros(epoch_logs.MAX_KEYS + 1)}
        with pytest.raises(GeePSError, match=f"{epoch_logs.MAX_KEYS + 1} "
                                             f"numbers in the epoch logs"):
            averager.average(too_many)
        return logs

    for logs in run_clients(cluster, epoch, timeout=20).values():
        assert logs["loss"] == pytest.approx(0.5)
        np.testing.assert_allclose(logs["f1_score"], np.full(1000, 0.5))


def test_one_worker_is_left_alone(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=5) as client:
        logs = {"loss": np.float32(2.5)}
        EpochLogAverager(client).average(logs)
        assert logs == {"loss": np.float32(2.5)}
        # No table was made for it (creating one by that name works).
        client.create_table(epoch_logs.TABLE, 2, 3, "float64")


@pytest.mark.parametrize("second", [
    {"loss": 1.0, "accuracy": 0.5},        # the same count, other keys
    {"loss": 1.0, "auc": 0.5, "val_loss": 2.0},  # another count
])
def test_workers_with_different_keys_get_a_clear_error(thread_cluster,
                                                       second):
    cluster = thread_cluster(1, 2)

    def epoch(w):
        with cluster.client(w, timeout=20) as client:
            EpochLogAverager(client).average(
                dict(second) if w else {"loss": 1.0, "auc": 0.5})

    _, errors = run_worker_threads(2, epoch)
    assert len(errors) == 2
    assert all(isinstance(e, GeePSError) and "different keys" in str(e)
               for e in errors)


def test_nan_and_inf_do_not_poison_later_epochs(thread_cluster):
    cluster = thread_cluster(1, 2)
    sent = [  # per epoch: (worker 0's, worker 1's) value of each key
        {"a": (1.0, float("nan")), "b": (np.inf, 2.0), "c": (3.0, 5.0)},
        {"a": (1.0, 3.0), "b": (np.inf, -np.inf), "c": (-np.inf, 1.0)},
        {"a": (1e12, 1e12), "b": (1.0, 2.0), "c": (1.0, 1.0)},
        {"a": (1e-3, 2e-3), "b": (4.0, 2.0), "c": (0.5, 1.5)},
    ]

    def epochs(client, w):
        averager, seen = EpochLogAverager(client), []
        for values in sent:
            logs = {k: v[w] for k, v in values.items()}
            averager.average(logs)
            seen.append(logs)
        return seen

    results = run_clients(cluster, epochs, timeout=20)
    expected = [{"a": np.nan, "b": np.inf, "c": 4.0},
                {"a": 2.0, "b": np.nan, "c": -np.inf},
                {"a": 1e12, "b": 1.5, "c": 1.0},
                {"a": 1.5e-3, "b": 3.0, "c": 1.0}]  # 1e12 left no trace
    for w in range(2):
        for got, want in zip(results[w], expected):
            for key, value in want.items():
                np.testing.assert_allclose(got[key], value, rtol=1e-12)


def test_nested_logs_are_flattened_and_strategies_share_the_table(
        thread_cluster):
    cluster = thread_cluster(1, 2)

    def epoch(client, w):
        logs = {"loss": float(w), "out": {"out_loss": 2.0 * w}}
        EpochLogAverager(client).average(logs)
        again = {"loss": 4.0 * w}
        EpochLogAverager(client).average(again)  # a second strategy's
        return logs, again

    results = run_clients(cluster, epoch, timeout=20)
    for logs, again in results.values():
        assert logs == {"loss": 0.5, "out_loss": 1.0}
        assert again == {"loss": 2.0}


def test_every_strategy_installs_the_averaging(thread_cluster, monkeypatch):
    """Also without captured updates (whose hooks install other patches)."""
    from keras_geeps.keras import GeePSStrategy, _tf_hooks  # noqa: PLC0415

    calls = []
    monkeypatch.setattr(_tf_hooks, "install_fit_hooks",
                        lambda: calls.append(1))
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=5),
                             capture_updates=False)
    assert calls == [1] and strategy.epoch_logs is not None
    strategy.close()


def test_the_fit_hooks_wrap_the_catch_ups():
    """Whichever strategy came first (capture on or off), `fit` averages
    the logs and syncs before captured updates are caught up, then the
    callbacks run: the patches stack in one order."""
    import keras  # noqa: PLC0415

    from keras_geeps.keras import _tf_hooks  # noqa: PLC0415

    _tf_hooks.install_fit_hooks()
    _tf_hooks.install_fit_hooks()  # idempotent
    assert keras.optimizers.Optimizer.__dict__.get(
        "_geeps_catch_ups_installed")
    callback_list = keras.callbacks.CallbackList
    for name, outer in (("on_epoch_end", "averaged"),
                        ("on_train_end", "synced_first")):
        method = getattr(callback_list, name)
        assert method.__code__.co_name == outer
        assert method.__wrapped__.__code__.co_name == "before"


def test_the_last_epoch_end_is_read_whatever_barriers_worker_0_missed(
        thread_cluster):
    """A rejoining worker reads where the others' last epoch ended from
    the last barrier's row, which holds that barrier's sums alone: also
    after barriers that worker 0 (once the one that zeroed the rows)
    missed, one or several in a row."""
    cluster = thread_cluster(1, 3, settings=ShardSettings(
        worker_timeout=1, on_worker_failure="continue"))
    # Worker 0 sends no heartbeats: silent between barriers, it is
    # declared dead at the next one, which goes on without it.
    clients = {0: cluster.client(0, timeout=20, heartbeat_interval=0)}
    clients.update({w: cluster.client(w, timeout=20, heartbeat_interval=0.2)
                    for w in (1, 2)})
    spent = []

    def barrier(epoch, workers):
        def body(i):
            EpochLogAverager(clients[workers[i]]).average(
                {"loss": 1.0}, epoch=epoch, clock=10 * (epoch + 1))
        _, errors = run_worker_threads(len(workers), body)
        assert not errors, errors

    def rejoin_worker_0():
        spent.append(clients[0])
        clients[0] = cluster.client(0, timeout=20, heartbeat_interval=0)
        return EpochLogAverager(clients[0]).last_epoch_end()

    try:
        barrier(0, [0, 1, 2])
        barrier(1, [1, 2])
        assert rejoin_worker_0() == epoch_logs.EpochEnd(1, 20, None)
        barrier(2, [1, 2])  # (the rejoined worker 0 is silent too)
        barrier(3, [1, 2])
        assert rejoin_worker_0() == epoch_logs.EpochEnd(3, 40, None)
        barrier(4, [0, 1, 2])  # and it takes part again
        assert rejoin_worker_0() == epoch_logs.EpochEnd(4, 50, None)
    finally:
        for client in spent + list(clients.values()):
            client.close()
