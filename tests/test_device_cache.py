"""The device-resident cache (TF variables + custom ops) against numpy sums."""

import time

import numpy as np
import pytest
import tensorflow as tf

from keras_geeps.client.device_cache import DeviceParameterCache
from keras_geeps.errors import GeePSError
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
    for want of memory). The clock's own updates must survive that raise and
    go out when the clock is tried again."""
    rows, width = 8, 4
    nbytes = rows * width * 4
    # Room for the rows and one clock's updates: while worker 1 has not
    # clocked, worker 0's second clock finds no memory for its update.
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        max_table_bytes=2 * nbytes, shared_memory=False))
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
        cache.clock()  # clock 1: refused by the shard, reported later
        deadline = time.monotonic() + 20
        while not w0._io.errors and time.monotonic() < deadline:
            time.sleep(0.01)  # the refusal reaches worker 0's I/O thread
        assert w0._io.errors, "the shard did not refuse clock 1's update"
        w1.clock()
        w1.clock()
        w1.read(t1)  # the shard is at clock 2: room for an update again
        cache.update(t0, tf.constant(deltas[2]))
        with pytest.raises(GeePSError, match="no memory for clock 1"):
            cache.clock()  # raises the earlier refusal, sends nothing
        cache.clock()  # the retry sends clock 2's update
        w1.clock()
        expected = init + deltas[0] + deltas[2]  # clock 1's was refused
        np.testing.assert_array_equal(w1.read(t1), expected)
        np.testing.assert_array_equal(cache.read(t0).numpy(), expected)
