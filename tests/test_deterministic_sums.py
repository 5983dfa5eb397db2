"""`ShardSettings.deterministic_sums`: a clock's updates are added in
worker order, whatever order they arrive in, so reruns are bit-identical."""

import contextlib
import time

import numpy as np
import pytest

from keras_geeps.protocol import MsgType
from keras_geeps.shard import ShardServer, ShardSettings
from tests.test_shard import RawPeer
from tests.worker_threads import run_clients

WORKERS = 3
CLOCKS = 4
SPEC = {"name": "t", "rows": 6, "width": 5, "dtype": "float32",
        "row_start": 0, "row_end": 6}
SHAPE = (SPEC["rows"], SPEC["width"])


def _updates(seed):
    """Each worker's updates of each clock: whole, partial and indexed
    (with a repeated row), of magnitudes far apart, so that float sums
    depend on their order. [clock][worker] -> [(kind, row or index, rows)]."""
    rng = np.random.default_rng(seed)

    def values(n):
        return (rng.standard_normal((n, SHAPE[1]))
                * 10.0 ** rng.integers(-4, 8, (n, 1))).astype(np.float32)

    plan = []
    for _ in range(CLOCKS):
        per_worker = []
        for _ in range(WORKERS):
            start = int(rng.integers(0, SHAPE[0] - 1))
            index = np.array([1, 4, 1, 5], np.int64)
            per_worker.append([
                ("rows", 0, values(SHAPE[0])),
                ("rows", start, values(SHAPE[0] - start)),
                ("indexed", index, values(index.size))])
        plan.append(per_worker)
    return plan


def _expected(base, plan):
    """The rows after every clock: updates added in worker order."""
    rows = base.copy()
    for per_worker in plan:
        for updates in per_worker:
            for kind, where, values in updates:
                if kind == "indexed":
                    np.add.at(rows, where, values)
                else:
                    rows[where:where + values.shape[0]] += values
    return rows


def _arrival(plan, seed):
    """One random interleaving of the workers' streams ((worker, clock,
    update or None for its CLOCK)), each worker's own order kept: workers
    run ahead of others by whole clocks (SSP) and finish out of order."""
    rng = np.random.default_rng(seed)
    streams = [[(w, clk, u) for clk in range(CLOCKS)
                for u in plan[clk][w] + [None]] for w in range(WORKERS)]
    events = []
    while any(streams):
        w = rng.choice([i for i, s in enumerate(streams) if s])
        events.append(streams[w].pop(0))
    return events


@contextlib.contextmanager
def _shard(settings, base, workers=WORKERS, spec=SPEC):
    """A thread shard and a raw peer per worker, each past its HELLO:
    worker 0 created table 0 (`spec`) with rows `base`, the others
    declared it. Yields (server, peers)."""
    server = ShardServer("tcp://127.0.0.1:0", 0, 1, workers, settings).start()
    peers = [RawPeer(server.address, w) for w in range(workers)]
    try:
        for p in peers:
            assert p.ask(MsgType.HELLO, meta={
                "num_workers": workers, "num_shards": 1,
                "incarnation": 1}).type == MsgType.WELCOME
        assert peers[0].ask(MsgType.CREATE, table=0, arrays=[base],
                            meta=dict(spec, chunk_row=0)).type == MsgType.ACK
        for p in peers[1:]:
            assert p.ask(MsgType.DECLARE, table=0, meta=spec).type == \
                MsgType.ACK
        yield server, peers
    finally:
        for p in peers:
            p.close()
        server.stop()


def _run(settings, base, events, spec=SPEC):
    """Drives a 3-worker shard through `events`; returns the final rows and
    the shard's stats."""
    with _shard(settings, base, spec=spec) as (server, peers):
        for worker, clk, update in events:
            p = peers[worker]
            if update is None:
                reply = p.ask_past_pushes(MsgType.CLOCK, table=0, clk=clk)
                assert reply.type == MsgType.ACK, reply
                continue
            kind, where, values = update
            if kind == "indexed":
                p.send(p.message(MsgType.UPDATE, table=0, clk=clk,
                                 arrays=[where, values],
                                 meta={"indexed": True}))
            else:
                p.send(p.message(MsgType.UPDATE, table=0, clk=clk,
                                 arrays=[values], meta={"chunk_row": where}))
        reply = peers[0].ask_past_pushes(MsgType.READ, table=0, clk=CLOCKS)
        assert reply.type == MsgType.ROWS, reply
        return reply.arrays[0].copy(), server.snapshot_stats()


@pytest.mark.parametrize("order", [1, 2, 3])
def test_updates_are_added_in_worker_order_whatever_their_arrival(order):
    plan = _updates(seed=7)
    base = np.full(SHAPE, 1.5, np.float32)
    rows, stats = _run(ShardSettings(deterministic_sums=True), base,
                       _arrival(plan, seed=order))
    np.testing.assert_array_equal(rows, _expected(base, plan))
    table = stats["tables"]["0"]
    assert table["global_clock"] == CLOCKS and table["held_updates"] == 0
    assert table["pending_clocks"] == []
    assert stats["updates_applied"] == CLOCKS * WORKERS * 3


@pytest.mark.parametrize("order", [1, 2])
def test_a_per_clock_tables_clock_sums_its_updates_alone_in_worker_order(
        order):
    """A per-clock table (`protocol.PER_CLOCK`): early updates wait as
    deltas, held ones go in on zeros, not on the clock before's rows."""
    plan = _updates(seed=7)
    base = np.full(SHAPE, 1.5, np.float32)
    rows, _ = _run(ShardSettings(deterministic_sums=True), base,
                   _arrival(plan, seed=order), dict(SPEC, per_clock=True))
    np.testing.assert_array_equal(
        rows, _expected(np.zeros(SHAPE, np.float32), plan[-1:]))


def test_the_updates_are_order_sensitive_without_the_setting():
    """The check above is not vacuous: added as they arrive, the same
    updates round differently from one arrival order to another."""
    plan = _updates(seed=7)
    base = np.full(SHAPE, 1.5, np.float32)
    results = [_run(ShardSettings(), base, _arrival(plan, seed=order))[0]
               for order in (1, 2, 3)]
    expected = _expected(base, plan)
    assert any(not np.array_equal(r, expected) for r in results)
    for r in results:  # the same sums all the same, up to rounding
        np.testing.assert_allclose(r, expected, rtol=1e-5, atol=1e3)


def test_held_updates_count_against_the_memory_limit():
    """Updates waiting for their turn are memory the shard holds: past
    max_table_bytes they are refused with an error, not kept, and the
    clock they belong to cannot complete without them: that worker's
    CLOCK stops the job."""
    table_bytes = SHAPE[0] * SHAPE[1] * 4
    settings = ShardSettings(deterministic_sums=True,
                             max_table_bytes=6 * table_bytes)
    with _shard(settings, np.zeros(SHAPE, np.float32), workers=2) as (
            server, peers):
        late = peers[1]
        # Worker 0 has not finished clock 0: worker 1's updates wait.
        for _ in range(10):
            late.send(late.message(MsgType.UPDATE, table=0, clk=0,
                                   arrays=[np.ones(SHAPE, np.float32)],
                                   meta={"chunk_row": 0}))
        errors = [m for m in late.drain() if m.type != MsgType.PUSH]
        assert errors and all(e.type == MsgType.ERROR and "no memory" in
                              e.meta["error"] for e in errors), errors
        stats = server.snapshot_stats()
        held = stats["tables"]["0"]["held_updates"]
        assert 1 <= held and held + len(errors) == 10
        assert stats["held_bytes"] <= settings.max_table_bytes
        assert peers[0].ask_past_pushes(MsgType.CLOCK, table=0,
                                        clk=0).type == MsgType.ACK
        reply = late.ask(MsgType.CLOCK, table=0, clk=0)
        assert reply.type == MsgType.ERROR
        assert "refused an update of its clock 0 for lack of memory" in \
            reply.meta["error"]
        assert server.snapshot_stats()["tables"]["0"]["global_clock"] == 0


def test_a_held_update_reserves_its_clocks_rows_buffer():
    """A held update's clock needs a rows buffer once its turn comes:
    `_hold` checked room for it but recorded nothing, so another table
    took that room and the buffer made later went past max_table_bytes
    (5.0 MB held against 4.2 MB). Reserved now: the other table is
    refused, and the limit holds when the held update goes in."""
    rows = 1 << 18
    a = dict(SPEC, rows=rows, row_end=rows, width=1)
    # B (2 x 1 MB, with flags 2.5 MB) fits in the 3 MiB table A leaves,
    # not in the 1.75 MiB it leaves with its clock's reserved buffer.
    b = dict(a, name="b", rows=250_000, row_end=250_000)
    table_bytes = rows * 4
    settings = ShardSettings(deterministic_sums=True, shared_memory=False,
                             max_table_bytes=4 * table_bytes,
                             max_message_bytes=8 * table_bytes)
    with _shard(settings, np.zeros((rows, 1), np.float32), spec=a) as (
            server, peers):
        # Worker 2's one-row update waits for workers 0 and 1.
        peers[2].send(peers[2].message(
            MsgType.UPDATE, table=0, clk=0, meta={"indexed": True},
            arrays=[np.array([5], np.int64), np.ones((1, 1), np.float32)]))
        assert peers[2].ask_past_pushes(MsgType.STATS).type == \
            MsgType.STATS_REPLY  # (so the update was handled first)
        reply = peers[0].ask(MsgType.CREATE, table=1, arrays=[
            np.zeros((b["rows"], 1), np.float32)], meta=dict(b, chunk_row=0))
        assert reply.type == MsgType.ERROR
        assert "max_table_bytes" in reply.meta["error"]
        held = server.snapshot_stats()["held_bytes"]
        assert 2 * table_bytes < held <= settings.max_table_bytes
        for p in peers[:2]:
            assert p.ask_past_pushes(MsgType.CLOCK, table=0,
                                     clk=0).type == MsgType.ACK
        assert server.snapshot_stats()["held_bytes"] <= \
            settings.max_table_bytes
        assert peers[2].ask_past_pushes(MsgType.CLOCK, table=0,
                                        clk=0).type == MsgType.ACK
        reply = peers[2].ask_past_pushes(MsgType.READ, table=0, clk=1)
        expected = np.zeros((rows, 1), np.float32)
        expected[5] = 1
        np.testing.assert_array_equal(reply.arrays[0], expected)


def test_an_update_in_turn_uses_the_buffer_held_updates_reserved():
    """Worker 1's held update reserved clock 0's rows buffer; worker 0's
    update of that clock, in turn, goes into that buffer: it was charged
    a second one, and refused at a limit it fits in."""
    rows = 1 << 16
    table_bytes = rows * 4
    spec = dict(SPEC, rows=rows, row_end=rows, width=1)
    settings = ShardSettings(
        deterministic_sums=True, shared_memory=False,
        max_table_bytes=2 * table_bytes + 2 * rows + 1024,
        max_message_bytes=4 * table_bytes)
    with _shard(settings, np.zeros((rows, 1), np.float32), workers=2,
                spec=spec) as (server, peers):
        for worker, row in ((1, 5), (0, 7)):  # worker 1's waits for 0's
            peers[worker].send(peers[worker].message(
                MsgType.UPDATE, table=0, clk=0, meta={"indexed": True},
                arrays=[np.array([row], np.int64),
                        np.ones((1, 1), np.float32)]))
            assert peers[worker].ask_past_pushes(MsgType.STATS).type == \
                MsgType.STATS_REPLY
        for p in peers:
            reply = p.ask_past_pushes(MsgType.CLOCK, table=0, clk=0)
            assert reply.type == MsgType.ACK, reply
        assert server.snapshot_stats()["errors"] == 0
        reply = peers[0].ask_past_pushes(MsgType.READ, table=0, clk=1)
        expected = np.zeros((rows, 1), np.float32)
        expected[[5, 7]] = 1
        np.testing.assert_array_equal(reply.arrays[0], expected)


def test_a_worker_that_dies_mid_clock_releases_the_updates_after_it():
    """Workers 1 and 2 finish clock 0 while worker 0, which sent its
    update, goes silent: their updates wait for it, and go in (in worker
    order) once it is declared dead and the job goes on without it."""
    settings = ShardSettings(deterministic_sums=True, worker_timeout=0.5,
                             on_worker_failure="continue",
                             shared_memory=False)
    base = np.full(SHAPE, 1.5, np.float32)
    with _shard(settings, base) as (server, peers):
        updates = [u[0][2] for u in _updates(seed=3)[0]]
        for w in (2, 0, 1):
            peers[w].send(peers[w].message(MsgType.UPDATE, table=0, clk=0,
                                           arrays=[updates[w]]))
        for p in (peers[2], peers[1]):
            assert p.ask_past_pushes(MsgType.CLOCK, table=0,
                                     clk=0).type == MsgType.ACK
        assert server.snapshot_stats()["tables"]["0"]["held_updates"] == 2
        live = peers[1:]
        deadline = time.monotonic() + 10
        while not server.snapshot_stats()["dead_workers"]:
            for p in live:
                p.send(p.message(MsgType.HEARTBEAT))
            assert time.monotonic() < deadline
            time.sleep(0.1)
        reply = peers[1].ask_past_pushes(MsgType.READ, table=0, clk=1)
        assert reply.type == MsgType.ROWS and reply.clk == 1
        np.testing.assert_array_equal(
            reply.arrays[0], ((base + updates[0]) + updates[1]) + updates[2])
        assert server.snapshot_stats()["tables"]["0"]["held_updates"] == 0


@pytest.mark.parametrize("slack", [0, 1])
def test_shared_memory_updates_wait_their_turn_in_place(thread_cluster,
                                                        slack):
    """Co-located workers write their updates into the shared upload
    buffers the shards read (`update_target`), and worker 0 always comes
    last: the shards hold the others' rows where they are, without a
    copy, and the worker writes such a buffer again only once its clock is
    complete, so the sums equal numpy's in worker order bit for bit."""
    clocks, shape = 6, (300, 40)
    rng = np.random.default_rng(11)
    deltas = (rng.standard_normal((clocks, WORKERS) + shape)
              * 10.0 ** rng.integers(-3, 7, (clocks, WORKERS, shape[0], 1))
              ).astype(np.float32)
    cluster = thread_cluster(2, WORKERS, settings=ShardSettings(
        deterministic_sums=True, shared_memory=True))

    def body(client, w):
        table = client.create_table("t", *shape)
        for clk in range(clocks):
            client.read(table)  # as training would, before its update
            if w == 0:
                time.sleep(0.05)  # the others' updates come first
            target = client.update_target(table)
            assert target is not None
            target[:] = deltas[clk, w]
            client.update(table, target, copy=False)
            client.clock()
        # (with slack s, a read at clock c may lack the last s clocks)
        return client.read(table, clock=clocks + slack), client.stats()

    results = run_clients(cluster, body, timeout=20, slack=slack)
    expected = np.zeros(shape, np.float32)
    for clk in range(clocks):
        for w in range(WORKERS):
            expected = expected + deltas[clk, w]
    for rows, stats in results.values():
        np.testing.assert_array_equal(rows, expected)
        assert stats["shm_bytes_sent"] > 0
    stats = [server.snapshot_stats() for server in cluster.shards]
    assert sum(s["updates_held"] for s in stats) > 0
    assert sum(s["shm_bytes_in"] for s in stats) > 0
    assert all(t["held_updates"] == 0 for s in stats
               for t in s["tables"].values())
