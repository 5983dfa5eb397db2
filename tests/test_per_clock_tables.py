"""Per-clock tables (`create_table(per_clock=True)`): the rows at each
clock are the sums of the clock before's updates alone, on real shards."""

import time

import numpy as np
import pytest

from keras_geeps import checkpoint, protocol
from keras_geeps.errors import GeePSError
from keras_geeps.launch import LocalCluster
from tests.reliability.restarts import wait_for_checkpoint
from tests.worker_threads import run_clients

ROWS, WIDTH = 700, 100


def _added(worker, clk):
    """What `worker` adds at clock `clk` (None: nothing; clock 3 has no
    update from anyone, clock 5 none from worker 1)."""
    if clk == 3 or (clk == 5 and worker == 1):
        return None
    return np.full((ROWS, WIDTH), (worker + 1) * (clk + 1), np.float64)


def _sums(clk, workers):
    """The rows of a per-clock table at clock `clk` > 0."""
    added = [a for a in (_added(w, clk - 1) for w in range(workers))
             if a is not None]
    return sum(added) if added else np.zeros((ROWS, WIDTH))


@pytest.mark.parametrize("slack", [0, 2])
def test_each_clock_holds_the_sums_of_its_updates_alone(thread_cluster,
                                                        slack):
    """Two shards, three workers, under BSP and SSP (early updates of a
    later clock wait as deltas): whatever clock a read's rows are at (their
    data age), they hold exactly that clock's sums; a clock without
    updates holds zeros. An ordinary table beside it keeps the running
    sums."""
    cluster = thread_cluster(2, 3)
    clocks = 8

    def body(client, w):
        table = client.create_table("sums", ROWS, WIDTH, dtype="float64",
                                    per_clock=True)
        parts = [(start, end) for _, start, end in table.parts]
        total = client.create_table("total", 2, 2)
        assert table.per_clock and len(table.parts) == 2
        seen = []
        for clk in range(clocks):
            rows = client.read(table)
            seen.append((table.last_read_ages, rows))
            if w == 2:
                time.sleep(0.01)  # the others run ahead within the slack
            delta = _added(w, clk)
            if delta is not None:
                client.update(table, delta)
            client.update(total, np.ones((2, 2), np.float32))
            client.clock()
        last = client.read(table, clock=clocks + slack)
        return parts, seen, last, client.read(total, clock=clocks + slack)

    results = run_clients(cluster, body, slack=slack, timeout=30)
    ages_seen = set()
    for parts, seen, last, total in results.values():
        for ages, rows in seen:
            for (start, end), age in zip(parts, ages):
                ages_seen.add(age)
                want = np.zeros((end - start, WIDTH)) if age == 0 \
                    else _sums(age, 3)[start:end]
                np.testing.assert_array_equal(rows[start:end], want)
        np.testing.assert_array_equal(last, _sums(clocks, 3))
        np.testing.assert_array_equal(total, np.full((2, 2), 3.0 * clocks))
    assert {0, 4, 6} <= ages_seen  # zeros at 4, worker 1 missing at 6


def test_every_worker_must_agree_that_a_table_is_per_clock(thread_cluster):
    cluster = thread_cluster(1, 2)
    with cluster.client(0, timeout=5) as first, \
            cluster.client(1, timeout=5) as second:
        first.create_table("t", 2, 2, per_clock=True)
        with pytest.raises(GeePSError, match="exists as .*per_clock"):
            second.create_table("t", 2, 2)


def test_the_spec_says_per_clock_only_as_true():
    spec = {"name": "t", "rows": 2, "width": 2, "dtype": "float32",
            "row_start": 0, "row_end": 2}
    assert protocol.table_spec(dict(spec, per_clock=False)) == spec
    assert protocol.table_spec(dict(spec, per_clock=True)) == dict(
        spec, per_clock=True)
    assert protocol.table_spec_problem(0, dict(spec, per_clock=True)) is None
    assert "per_clock is true" in protocol.table_spec_problem(
        0, dict(spec, per_clock=1))
    assert "a spec has exactly" in protocol.table_spec_problem(
        0, dict(spec, other=True))


@pytest.mark.slow
def test_a_restored_shard_keeps_a_per_clock_table_and_its_replay(tmp_path):
    """SIGKILL of the shard three clocks past a checkpoint, restart with
    --restore: the checkpoint says the table is per-clock, the workers'
    replay rebuilds the clocks after it from zeros, and every clock's rows
    are that clock's sums, before and after."""
    workers, clocks = 2, 10
    cluster = LocalCluster(1, workers, processes=True, output=None,
                           shard_args=["--checkpoint-dir", str(tmp_path),
                                       "--checkpoint-every", "4"])
    clients = [cluster.client(w, timeout=30) for w in range(workers)]
    try:
        def step(clk):
            for w, client in enumerate(clients):
                table = client.table("sums")
                delta = _added(w, clk)
                if delta is not None:
                    client.update(table, delta)
                client.clock([table])
            for client in clients:
                rows = client.read("sums", clock=clk + 1)
                np.testing.assert_array_equal(rows, _sums(clk + 1, workers))

        for client in clients:  # (worker 0 first: it creates the table)
            client.create_table("sums", ROWS, WIDTH, dtype="float64",
                                per_clock=True)
        for clk in range(5):
            step(clk)
        wait_for_checkpoint(clients[0], clients[0].table("sums"), 4)
        tables = checkpoint.load(str(tmp_path), 0, 1, workers)
        spec, ckpt_clock, rows = tables[0]
        assert spec["per_clock"] is True and ckpt_clock == 4
        np.testing.assert_array_equal(rows, _sums(4, workers))
        victim = cluster.shards[0]
        victim.kill()
        cluster.shards[0] = victim.restart(["--restore"])
        for clk in range(5, clocks):
            step(clk)
        stats = clients[0].shard_stats()[0]
        assert stats["restored_clock"] == 4
    finally:
        for client in clients:
            client.close()
        cluster.stop()


def test_a_per_clock_table_is_never_lent(thread_cluster):
    """A lent buffer takes the worker's rows + update as the clock's rows:
    not what a per-clock table's clock holds, so its shard lends one only
    for the ordinary table beside it."""
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=20) as client:
        sums = client.create_table("sums", 64, 32, per_clock=True)
        plain = client.create_table("plain", 64, 32)
        for clk in range(4):
            for table in (sums, plain):
                client.read_shared(table)
            assert client.lend_target(sums) is None
            lent = client.lend_target(plain)
            assert (lent is not None) == (clk > 0)  # (clock 0: no lend)
            client.update(sums, np.full((64, 32), clk + 1.0, np.float32))
            client.update(plain, np.ones((64, 32), np.float32))
            client.clock()
            np.testing.assert_array_equal(client.read(sums), clk + 1.0)
        stats = client.shard_stats()[0]
        assert stats["errors"] == 0
        assert [t["per_clock"] for t in stats["tables"].values()] == [
            True, False]
