"""The device-resident cache (TF variables + custom ops) against numpy sums."""

import time

import numpy as np
import pytest
import tensorflow as tf

from keras_geeps.client.device_cache import DeviceParameterCache
from keras_geeps.errors import GeePSError, GeePSWorkerFailedError
from keras_geeps.shard import ShardSettings
from tests.worker_threads import run_worker_threads


def test_two_workers_row_subsets_match_numpy(thread_cluster):
    cluster = thread_cluster(2, 2)
    rows = {0: np.array([5, 1999, 7, 1000]), 1: np.array([7, 3, 1000])}

    def worker(w):
        with cluster.client(w, timeout=20) as client:
            cache = DeviceParameterCache(client)
            init = np.arange(2000 * 64, dtype=np.float32).reshape(2000, 64)
            table = client.create_table("emb", 2000, 64, init=init)
            assert len(table.parts) == 2
            with client.virtual_iteration() as vi:
                h_read = vi.read(table, rows[w])
                h_update = vi.update(table, rows[w])
            for step in range(4):
                got = cache.read(h_read).numpy()
                expected = init.copy()
                for v in range(2):
                    expected[np.unique(rows[v])] += (v + 1) * step
                np.testing.assert_array_equal(got, expected[h_read.rows])
                delta = tf.fill([len(h_update.rows), 64], float(w + 1))
                cache.update(h_update, delta)
                cache.clock()
            return cache.read(table).numpy()

    results, errors = run_worker_threads(2, worker)
    assert not errors, errors[0]
    init = np.arange(2000 * 64, dtype=np.float32).reshape(2000, 64)
    for v in range(2):
        init[np.unique(rows[v])] += (v + 1) * 4
    np.testing.assert_array_equal(results[0], init)
    np.testing.assert_array_equal(results[1], init)


def test_index_of_a_dead_handle_is_never_reused(thread_cluster):
    """Handles recorded per step (rows differ per batch) die and their ids
    are reused: each read must still return its own rows."""
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=20) as client:
        cache = DeviceParameterCache(client, max_indexes=4)
        init = np.arange(100 * 4, dtype=np.float32).reshape(100, 4)
        table = client.create_table("emb", 100, 4, init=init)
        for step in range(20):
            with client.virtual_iteration() as vi:
                rows = np.array([step, step + 50])
                handle = vi.read(table, rows)
            np.testing.assert_array_equal(cache.read(handle).numpy(),
                                          init[rows])
            del handle
            cache.clock()
        assert len(cache._tables[table.id].indexes) <= 4


def test_rows_in_the_callers_order_with_repeats(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=20) as client:
        cache = DeviceParameterCache(client)
        init = np.arange(20, dtype=np.float32).reshape(10, 2)
        table = client.create_table("emb", 10, 2, init=init)
        batch_rows = np.array([7, 3, 3])  # unsorted, a repeat
        with client.virtual_iteration() as vi:
            h_read = vi.read(table, batch_rows)
            h_update = vi.update(table, batch_rows)
        # Without rows=: the handle's rows, sorted and unique.
        np.testing.assert_array_equal(cache.read(h_read).numpy(),
                                      init[[3, 7]])
        np.testing.assert_array_equal(
            cache.read(h_read, rows=batch_rows).numpy(), init[batch_rows])
        delta = np.array([[1, 1], [2, 2], [4, 4]], np.float32)
        with pytest.raises(ValueError, match="delta has 3 rows"):
            cache.update(h_update, tf.constant(delta))
        with pytest.raises(ValueError, match="not rows of"):
            cache.read(h_read, rows=[5])
        cache.update(h_update, tf.constant(delta), rows=batch_rows)
        cache.clock()
        expected = init.copy()
        np.add.at(expected, batch_rows, delta)
        np.testing.assert_array_equal(cache.read(table).numpy(), expected)


def test_a_clock_that_raises_keeps_its_updates_for_a_retry(thread_cluster):
    """`clock()` hands the log to `client.update`, which first raises what
    went wrong earlier in the background (here: the shard refused an update
    for want of memory). The clock's own updates must survive that raise,
    kept for a retry. (That refusal itself stops the job at the refused
    clock: a retry raises so rather than go on without clock 1's update.)"""
    rows, width = 8, 4
    nbytes = rows * width * 4
    # Room for the rows and one clock's updates (with a written flag per
    # row, and one per initial row): while worker 1 has not clocked,
    # worker 0's second clock finds no memory for its update.
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        max_table_bytes=2 * nbytes + 2 * rows, shared_memory=False))
    with cluster.client(0, timeout=20) as w0, \
            cluster.client(1, timeout=20) as w1:
        init = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
        t0 = w0.create_table("t", rows, width, init=init)
        t1 = w1.create_table("t", rows, width)
        cache = DeviceParameterCache(w0)
        deltas = [np.full((rows, width), v, np.float32) for v in (1, 10, 100)]
        cache.update(t0, tf.constant(deltas[0]))
        cache.clock()  # clock 0: taken (held until worker 1 clocks)
        cache.update(t0, tf.constant(deltas[1]))
        cache.clock()  # clock 1: its update refused, its CLOCK stops the job
        deadline = time.monotonic() + 20
        while not w0._io.errors and time.monotonic() < deadline:
            time.sleep(0.01)  # the refusal reaches worker 0's I/O thread
        assert w0._io.errors, "the shard did not refuse clock 1's update"
        cache.update(t0, tf.constant(deltas[2]))
        with pytest.raises(GeePSError, match="clock 1"):
            cache.clock()  # raises the earlier refusal, sends nothing
        entry = cache._tables[t0.id]
        assert entry.dirty
        np.testing.assert_array_equal(entry.log.numpy(), deltas[2])
        with pytest.raises(GeePSWorkerFailedError,
                           match="refused an update of its clock 1"):
            w1.clock()
            w1.read(t1)


def test_read_my_writes_reads_match_the_clients(thread_cluster):
    """With read_my_writes the cache, as the client, returns this worker's
    own updates at once: logged, sent at its clock, and once the shards
    reflect them; never the shard rows alone."""
    cluster = thread_cluster(1, 2)
    with cluster.client(0, timeout=20, slack=1, read_my_writes=True) as w0, \
            cluster.client(1, timeout=20, slack=1) as w1:
        init = np.arange(8, dtype=np.float32).reshape(4, 2)
        t0 = w0.create_table("t", 4, 2, init=init)
        w1.create_table("t", 4, 2)
        cache = DeviceParameterCache(w0)
        with w0.virtual_iteration() as vi:
            h_rows = vi.update(t0, [1, 3])
        np.testing.assert_array_equal(cache.read(t0).numpy(), init)
        mine = init.copy()
        for step in range(3):
            ones = np.ones((4, 2), np.float32) * (step + 1)
            cache.update(t0, ones)                   # the whole table
            cache.update(h_rows, ones[:2], rows=[3, 1])
            mine += ones
            mine[[1, 3]] += ones[:2]
            # logged, not sent yet: read at once
            np.testing.assert_array_equal(cache.read(t0).numpy(), mine)
            if step == 1:  # the shards then reflect worker 0's clocks 0, 1
                w1.clock()
                w1.clock()
            cache.clock()
            np.testing.assert_array_equal(cache.read(t0).numpy(), mine)
            np.testing.assert_array_equal(w0.read(t0), mine)
        np.testing.assert_array_equal(cache.read(t0).numpy(), mine)


def test_bad_rows_and_deltas_are_refused_by_name(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=20) as client:
        with pytest.raises(ValueError, match="max_indexes must be an int"):
            DeviceParameterCache(client, max_indexes=-1)
        cache = DeviceParameterCache(client)
        table = client.create_table("t", 4, 3)
        with client.virtual_iteration() as vi:
            handle = vi.update(table, [0, 2])
        for rows, error, pattern in [
                ([0.9, 2.7], TypeError, "integer ids"),
                ([[0], [2]], ValueError, "1-D list"),
                ([True, False], ValueError, "one entry per row"),
                ([4], ValueError, "row 4 is outside"),
                ([1], ValueError, "not rows of")]:
            with pytest.raises(error, match=pattern):
                cache.read(handle, rows=rows)
        np.testing.assert_array_equal(
            cache.read(handle, rows=[True, False, True, False]).numpy(),
            np.zeros((2, 3)))
        for delta, pattern in [(np.zeros((3, 4), np.float32), r"\(3, 4\)"),
                               (np.zeros((5, 3), np.float32), "5 rows"),
                               (np.zeros(12, np.float32), r"\(12,\)")]:
            with pytest.raises(ValueError, match=pattern):
                cache.update(table, delta)
        cache.update(table, np.ones((4, 3)))  # float64: cast, as the client
        cache.clock()
        np.testing.assert_array_equal(cache.read(table).numpy(),
                                      np.ones((4, 3)))
