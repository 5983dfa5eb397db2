"""Epoch logs averaged over workers through a shard table (real shards)."""

import threading

import numpy as np
import pytest

from keras_geeps.errors import GeePSError
from keras_geeps.keras.epoch_logs import EpochLogAverager


def _on_workers(clients, fn):
    """Runs fn(worker, client) on every client at once; returns results."""
    results, errors = {}, []

    def run(w, client):
        try:
            results[w] = fn(w, client)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w, c))
               for w, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def test_every_worker_gets_the_mean_of_each_epoch(thread_cluster):
    cluster = thread_cluster(2, 3)
    clients = [cluster.client(w, timeout=20) for w in range(3)]

    def epochs(w, client):
        averager = EpochLogAverager(client)
        seen = []
        for epoch in range(3):
            logs = {"loss": float(w + 10 * epoch), "val_accuracy":
                    np.float32(0.5 + w / 10), "note": "text",
                    "steps": np.int64(w)}
            averager.average(logs)
            seen.append(logs)
        return seen

    results, errors = _on_workers(clients, epochs)
    assert not errors, errors[0]
    for epoch in range(3):
        for w in range(3):
            logs = results[w][epoch]
            assert logs["loss"] == pytest.approx(1.0 + 10 * epoch)
            assert logs["val_accuracy"] == pytest.approx(0.6)
            assert logs["steps"] == pytest.approx(1.0)
            assert logs["note"] == "text"  # not a number: left alone
    for client in clients:
        client.close()


def test_one_worker_is_left_alone(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=5) as client:
        logs = {"loss": np.float32(2.5)}
        EpochLogAverager(client).average(logs)
        assert logs == {"loss": np.float32(2.5)}
        # No table was made for it (creating one by that name works).
        client.create_table("keras_geeps.epoch_logs.3", 1, 3, "float64")


def test_workers_with_different_keys_get_a_clear_error(thread_cluster):
    cluster = thread_cluster(1, 2)
    clients = [cluster.client(w, timeout=20) for w in range(2)]

    def epoch(w, client):
        EpochLogAverager(client).average(
            {"loss": 1.0, ("accuracy" if w else "auc"): 0.5})

    _, errors = _on_workers(clients, epoch)
    assert len(errors) == 2
    assert all(isinstance(e, GeePSError) and "different keys" in str(e)
               for e in errors)
    for client in clients:
        client.close()
