"""The device-resident cache (TF variables + custom ops) against numpy sums."""

import numpy as np
import tensorflow as tf

from keras_geeps.client.device_cache import DeviceParameterCache
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
