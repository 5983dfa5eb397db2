"""A shard under misuse and failures: refused requests, early clocks,
restarted and dead workers, memory and message limits."""

import gc
import threading
import time

import numpy as np
import pytest
import zmq

from keras_geeps import checkpoint, protocol, shm
from keras_geeps.shard import server as shard_module
from keras_geeps.shard import writer as writer_module
from keras_geeps.auth import keygen
from keras_geeps.cluster import ClusterSpec
from keras_geeps.protocol import MsgType
from keras_geeps.shard import ShardServer, ShardSettings
from tests import rss_bytes
from tests.test_shard import RawPeer


def spec(rows, width, name="t"):
    return {"name": name, "rows": rows, "width": width, "dtype": "float32",
            "row_start": 0, "row_end": rows}


@pytest.fixture
def servers():
    """Factory: a started thread-mode shard for `num_workers` workers."""
    started, peers = [], []

    def make(num_workers=2, **settings):
        settings.setdefault("shared_memory", False)
        server = ShardServer("tcp://127.0.0.1:0", 0, 1, num_workers,
                             ShardSettings(**settings)).start()
        started.append(server)
        return server

    def peer(server, worker, incarnation=1):
        p = RawPeer(server.address, worker)
        peers.append(p)
        reply = p.ask(MsgType.HELLO, meta={"incarnation": incarnation})
        assert reply.type == MsgType.WELCOME, reply
        p.welcome = reply
        return p

    make.peer = peer
    yield make
    for p in peers:
        p.close()
    for server in started:
        server.stop()


def _create(peer, rows, width, value=0.0, table=0):
    reply = peer.ask(MsgType.CREATE, table=table,
                     arrays=[np.full((rows, width), value, np.float32)],
                     meta=dict(spec(rows, width), chunk_row=0))
    assert reply.type == MsgType.ACK, reply


def _two_workers_one_table(servers, server):
    """Workers 0 (the creator of a 4 x 2 table 0) and 1 (declares it)."""
    first, other = servers.peer(server, 0), servers.peer(server, 1)
    _create(first, 4, 2)
    assert other.ask(MsgType.DECLARE, table=0,
                     meta=spec(4, 2)).type == MsgType.ACK
    return first, other


def _past_pushes(peer):
    """The next message `peer` gets that is not a subscribed table's PUSH."""
    while True:
        message = peer.recv()
        if message.type != MsgType.PUSH:
            return message


def _restarted_worker0(server):
    """A new process of worker 0 that said HELLO and was welcomed."""
    again = RawPeer(server.address, 0)
    again.welcome = again.ask(MsgType.HELLO, meta={"incarnation": 2})
    assert again.welcome.type == MsgType.WELCOME
    return again


def test_refused_and_admin_requests_leave_no_sequence_gaps(servers):
    server = servers(num_workers=1)
    peer = servers.peer(server, 0)
    _create(peer, 4, 3)
    assert peer.ask(MsgType.STATS).type == MsgType.STATS_REPLY
    assert peer.ask(MsgType.UPDATE, table=0, clk=5, arrays=[
        np.ones((4, 3), np.float32)]).type == MsgType.ERROR
    for clk in range(50):
        peer.send(peer.message(MsgType.UPDATE, table=0, clk=clk,
                               arrays=[np.ones((4, 3), np.float32)]))
        assert peer.ask_past_pushes(MsgType.CLOCK, table=0,
                                    clk=clk).type == MsgType.ACK
    tracker = server._seqs[0]
    deadline = time.monotonic() + 5  # the last ACK leaves before the mark
    while tracker.upto != peer.seq and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tracker.upto == peer.seq and not tracker.above


def test_clocks_before_the_initial_rows_wait_for_them(servers):
    server = servers(num_workers=2)
    creator, other = servers.peer(server, 0), servers.peer(server, 1)
    first_half = np.full((2, 3), 7, np.float32)
    assert creator.ask(MsgType.CREATE, table=0, arrays=[first_half],
                       meta=dict(spec(4, 3), chunk_row=0)).type == MsgType.ACK
    assert other.ask(MsgType.DECLARE, table=0,
                     meta=spec(4, 3)).type == MsgType.ACK
    assert creator.ask(MsgType.CLOCK, table=0, clk=0).type == MsgType.ACK
    assert other.ask(MsgType.CLOCK, table=0, clk=0).type == MsgType.ACK
    assert other.drain() == []  # nothing half-initialised is pushed
    assert server.snapshot_stats()["tables"]["0"]["global_clock"] == 0
    assert creator.ask(MsgType.CREATE, table=0, arrays=[first_half + 1],
                       meta=dict(spec(4, 3), chunk_row=2)).type == \
        MsgType.ACK
    pushes = [m for m in other.drain() if m.type == MsgType.PUSH]
    assert [m.clk for m in pushes] == [0, 1]
    np.testing.assert_array_equal(pushes[-1].arrays[0],
                                  [[7] * 3, [7] * 3, [8] * 3, [8] * 3])


def test_a_worker_restarted_mid_clock_stops_the_job(servers):
    server = servers(num_workers=2, worker_timeout=30)
    first, other = _two_workers_one_table(servers, server)
    first.send(first.message(MsgType.UPDATE, table=0, clk=0,
                             arrays=[np.ones((4, 2), np.float32)]))
    assert first.ask_past_pushes(MsgType.CLOCK, table=0,
                                 clk=0).type == MsgType.ACK
    # Worker 0's process dies and a new one starts at once, before the
    # worker timeout: its clock-0 update cannot be taken back.
    again = RawPeer(server.address, 0)
    try:
        reply = again.ask(MsgType.HELLO, meta={"incarnation": 2})
        assert reply.type == MsgType.ERROR
        assert reply.meta["code"] == protocol.ERROR_WORKER_DEAD
        assert "worker 0 restarted" in reply.meta["error"]
        told = [m for m in other.drain() if m.type == MsgType.ERROR]
        assert told and "worker 0 restarted" in told[0].meta["error"]
    finally:
        again.close()


def test_a_worker_restarted_between_clocks_carries_on(servers):
    """The new process takes the worker's place; the old one (it may only
    have been cut off) can never take it back from its replacement."""
    server = servers(num_workers=2, worker_timeout=30)
    first, other = _two_workers_one_table(servers, server)
    for peer in (first, other):
        assert peer.ask_past_pushes(MsgType.CLOCK, table=0,
                                    clk=0).type == MsgType.ACK
    again = _restarted_worker0(server)
    try:
        # (a new process all the same: its WELCOME says where it joins)
        assert again.welcome.meta["rejoined_at"] == 1
        ack = again.ask_past_pushes(MsgType.DECLARE, table=0,
                                    meta=spec(4, 2))
        assert ack.meta["global_clock"] == 1
        reply = first.ask_past_pushes(MsgType.HELLO,
                                      meta={"incarnation": 1})
        assert reply.type == MsgType.ERROR
        assert reply.meta["code"] == protocol.ERROR_WORKER_DEAD
        again.send(again.message(MsgType.UPDATE, table=0, clk=1,
                                 arrays=[np.ones((4, 2), np.float32)]))
        assert again.ask_past_pushes(MsgType.CLOCK, table=0,
                                     clk=1).type == MsgType.ACK
        assert server.snapshot_stats()["dead_workers"] == []
    finally:
        again.close()


def test_a_resent_create_of_an_existing_table_still_says_so(
        servers, monkeypatch):
    """A CREATE chunk resent after a broken connection, whose kept answer
    later chunks pushed out, is still answered "existing": the worker must
    not take its fresh initial rows for the table's."""
    monkeypatch.setattr(shard_module, "KEPT_ANSWERS", 2)
    server = servers(num_workers=1, worker_timeout=30)
    first = servers.peer(server, 0)
    _create(first, 4, 2, value=5.0)
    assert first.ask_past_pushes(MsgType.CLOCK, table=0,
                                 clk=0).type == MsgType.ACK
    again = _restarted_worker0(server)
    try:
        chunks = []
        for row in range(4):  # its creator's initial rows, chunk by chunk
            chunks.append(again.message(
                MsgType.CREATE, table=0, arrays=[np.zeros((1, 2), np.float32)],
                meta=dict(spec(4, 2), chunk_row=row)))
            again.send(chunks[-1])
            reply = again.recv()
            while reply.type == MsgType.PUSH:
                reply = again.recv()
            assert reply.meta.get("existing")
        again.send(chunks[0])  # resent (its answer lost), pushed out
        reply = again.recv()
        while reply.type == MsgType.PUSH:
            reply = again.recv()
        assert reply.type == MsgType.ACK and reply.meta.get("existing")
        assert reply.meta["global_clock"] == 1
    finally:
        again.close()


def test_a_sequence_number_far_ahead_is_refused_not_counted(servers):
    """One request numbered far past the worker's latest would make every
    later one count as done (its updates dropped unanswered): refused."""
    server = servers(num_workers=1)
    peer = servers.peer(server, 0)
    _create(peer, 4, 3)
    jump = peer.message(MsgType.STATS)
    jump.seq += 1 << 20
    peer.send(jump)
    reply = peer.recv()
    assert reply.type == MsgType.ERROR
    assert "sequence number" in reply.meta["error"]
    hello = peer.message(MsgType.HELLO, meta={"incarnation": 1})
    hello.seq += 1 << 20  # nor by a HELLO of the same process
    peer.send(hello)
    assert peer.recv().type == MsgType.ERROR
    peer.send(peer.message(MsgType.UPDATE, table=0, clk=0,
                           arrays=[np.ones((4, 3), np.float32)]))
    assert peer.ask_past_pushes(MsgType.CLOCK, table=0,
                                clk=0).type == MsgType.ACK
    rows = peer.ask_past_pushes(MsgType.READ, table=0, clk=1)
    assert rows.type == MsgType.ROWS
    np.testing.assert_array_equal(rows.arrays[0], 1)


def test_one_worker_cannot_take_every_waiting_read(servers):
    """Reads that wait are bounded per worker (its share of
    max_parked_reads), reads of clocks no worker can reach are refused, and
    a worker's reads from a route it left stop counting."""
    server = servers(num_workers=2, max_parked_reads=8)
    first, other = _two_workers_one_table(servers, server)
    reply = first.ask(MsgType.READ, table=0, clk=1 << 40)
    assert reply.type == MsgType.ERROR and "max_pending_clocks" in \
        reply.meta["error"]
    for _ in range(4):  # its share: parked, no answer yet
        first.send(first.message(MsgType.READ, table=0, clk=1))
    reply = first.ask(MsgType.READ, table=0, clk=1)
    assert reply.type == MsgType.ERROR and "waiting reads" in \
        reply.meta["error"]
    for _ in range(4):  # the other worker still gets its share
        other.send(other.message(MsgType.READ, table=0, clk=1))
    assert [m.type for m in other.drain() if m.type != MsgType.PUSH] == []
    # Worker 0 connects again (a new route): its old reads stop counting.
    again = RawPeer(server.address, 0)
    again.seq = first.seq  # (the same process: it numbers on)
    try:
        assert again.ask(MsgType.HELLO, meta={"incarnation": 1}).type == \
            MsgType.WELCOME
        again.send(again.message(MsgType.READ, table=0, clk=1))
        for peer in (again, other):
            peer.send(peer.message(MsgType.CLOCK, table=0, clk=0))
        answered = [m for m in again.drain() if m.type == MsgType.ROWS]
        assert len(answered) == 1 and answered[0].clk == 1
        assert len([m for m in other.drain()
                    if m.type == MsgType.ROWS]) == 4
        assert server.snapshot_stats()["parked_reads"] == 0
    finally:
        again.close()


def test_stats_of_many_tables_outgrow_no_header_limit(servers):
    """A shard's statistics grow with its tables: they travel as a frame,
    not in the header (whose 64 KiB limit they passed at ~380 tables)."""
    server = servers(num_workers=1)
    peer = servers.peer(server, 0)
    for table in range(600):
        peer.send(peer.message(MsgType.DECLARE, table=table,
                               meta=spec(1, 1, name=f"layer_{table:04d}")))
    assert all(m.type == MsgType.ACK for m in
               (peer.recv() for _ in range(600)))
    reply = peer.ask(MsgType.STATS)
    stats = protocol.stats_of(reply)
    assert len(reply.arrays[0]) > protocol.MAX_HEADER_BYTES
    assert len(stats["tables"]) == 600
    reply = peer.ask(MsgType.DECLARE, table=600,
                     meta=spec(1, 1, name="x" * 1025))
    assert reply.type == MsgType.ERROR and "at most 1024" in \
        reply.meta["error"]


def test_a_checkpoint_beyond_the_limits_is_not_restored(tmp_path):
    rows = np.zeros((4, 2), np.float32)
    checkpoint.write(tmp_path, 0, 1, 1, {t: (spec(4, 2, f"t{t}"), 3, rows)
                                         for t in range(3)})
    # As CREATEs: each table's rows twice (three times on a checkpointing
    # shard), with two written flags per row (8 here).
    need = 3 * (2 * rows.nbytes + 8)
    for limits in ({"max_tables": 2}, {"max_table_bytes": need - 1},
                   {"max_message_bytes": 7},
                   {"max_table_bytes": need, "checkpoint_every": 1}):
        with pytest.raises(checkpoint.CheckpointError,
                           match="beyond this shard's limits"):
            ShardServer("tcp://127.0.0.1:0", 0, 1, 1, ShardSettings(
                checkpoint_dir=str(tmp_path), shared_memory=False,
                **limits), restore=True)
    server = ShardServer("tcp://127.0.0.1:0", 0, 1, 1, ShardSettings(
        checkpoint_dir=str(tmp_path), shared_memory=False,
        max_table_bytes=3 * (3 * rows.nbytes + 8), checkpoint_every=1),
        restore=True)
    assert server.snapshot_stats()["restored_clock"] == 3
    server._close()
    server = ShardServer("tcp://127.0.0.1:0", 0, 1, 1, ShardSettings(
        checkpoint_dir=str(tmp_path), shared_memory=False), restore=True)
    assert server.snapshot_stats()["restored_clock"] == 3
    server._close()


def test_continue_mode_restart_mid_clock_rejoins(servers):
    server = servers(num_workers=2, worker_timeout=30,
                     on_worker_failure="continue")
    first, other = _two_workers_one_table(servers, server)
    assert first.ask_past_pushes(MsgType.CLOCK, table=0,
                                 clk=0).type == MsgType.ACK
    again = _restarted_worker0(server)
    try:
        assert again.welcome.meta["rejoined_at"] == 0
        ack = again.ask_past_pushes(MsgType.DECLARE, table=0,
                                    meta=spec(4, 2))
        assert ack.meta["global_clock"] == 0  # it redoes clock 0
        assert again.ask_past_pushes(MsgType.CLOCK, table=0,
                                     clk=0).type == MsgType.ACK
        assert other.ask_past_pushes(MsgType.CLOCK, table=0,
                                     clk=0).type == MsgType.ACK
        # (the last CLOCK's ACK leaves before the clock advances, in the
        # shard's thread)
        deadline = time.monotonic() + 5
        while server.snapshot_stats()["tables"]["0"]["global_clock"] != 1:
            assert time.monotonic() < deadline, "clock 0 never completed"
            time.sleep(0.01)
        # Only the old process counts as dead: the new one's connection
        # can break and come back (the same incarnation says HELLO again).
        assert again.ask_past_pushes(MsgType.HELLO, meta={
            "incarnation": 2}).type == MsgType.WELCOME
    finally:
        again.close()


def test_tables_created_after_a_death_do_not_wait_for_the_dead(servers):
    # (2 s: the live worker says nothing after its heartbeats, a stall of
    # the machine then must not take it for dead too)
    server = servers(num_workers=2, worker_timeout=2.0,
                     on_worker_failure="continue")
    live = servers.peer(server, 0)
    servers.peer(server, 1)  # says HELLO, then nothing
    deadline = time.monotonic() + 10
    while not server.snapshot_stats()["dead_workers"]:
        live.send(live.message(MsgType.HEARTBEAT))
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _create(live, 4, 3)
    live.send(live.message(MsgType.UPDATE, table=0, clk=0,
                           arrays=[np.ones((4, 3), np.float32)]))
    assert live.ask_past_pushes(MsgType.CLOCK, table=0, clk=0).type == \
        MsgType.ACK
    reply = live.ask_past_pushes(MsgType.READ, table=0, clk=1)
    assert reply.type == MsgType.ROWS and reply.clk == 1
    np.testing.assert_array_equal(reply.arrays[0], np.ones((4, 3)))


def test_a_paused_shard_reads_what_came_before_it_declares_deaths(
        servers, monkeypatch):
    """A shard paused past worker_timeout (a garbage collection, a long
    request, a stopped process) looked at its workers' silence before it
    read the heartbeats that came meanwhile, and declared a live worker
    dead; it reads them first now."""
    server = servers(num_workers=1, worker_timeout=0.5)
    live = servers.peer(server, 0)
    real_drain = type(server)._drain
    pauses = []

    def drain_then_pause(self, sock, dispatch):
        emptied = real_drain(self, sock, dispatch)
        if not pauses and self._last_seen:  # once, past the HELLO
            pauses.append(time.monotonic())
            time.sleep(1.2)  # the next turn's housekeeping comes first
        return emptied

    monkeypatch.setattr(type(server), "_drain", drain_then_pause)
    deadline = time.monotonic() + 5
    while not pauses or time.monotonic() < pauses[0] + 1.8:
        live.send(live.message(MsgType.HEARTBEAT))
        assert time.monotonic() < deadline
        time.sleep(0.1)
    stats = server.snapshot_stats()
    assert stats["dead_workers"] == [] and stats["failed"] is None, stats
    assert not [m for m in live.drain(100) if m.type == MsgType.ERROR]


def test_a_stalled_worker_declared_dead_is_told_so(servers):
    """A worker that stalls past worker_timeout with its connection up (a
    paused process) is declared dead (continue mode): it is told at once,
    and each request it sends later, heartbeats included, is refused with
    worker_dead (it waits on nothing: no push would ever come)."""
    server = servers(num_workers=2, worker_timeout=2.0,  # (as above)
                     on_worker_failure="continue")
    live, stalled = _two_workers_one_table(servers, server)
    deadline = time.monotonic() + 10
    while not server.snapshot_stats()["dead_workers"]:
        live.send(live.message(MsgType.HEARTBEAT))
        assert time.monotonic() < deadline
        time.sleep(0.1)
    told = [m for m in stalled.drain() if m.type == MsgType.ERROR]
    assert len(told) == 1
    assert told[0].meta["code"] == protocol.ERROR_WORKER_DEAD
    assert "worker 1 was declared dead" in told[0].meta["error"]
    for kind, meta in ((MsgType.HEARTBEAT, {}), (MsgType.CLOCK, {}),
                       (MsgType.DECLARE, spec(4, 2))):
        reply = stalled.ask_past_pushes(kind, table=0, clk=0, meta=meta)
        assert reply.type == MsgType.ERROR, kind
        assert reply.meta["code"] == protocol.ERROR_WORKER_DEAD
    assert live.ask_past_pushes(MsgType.CLOCK, table=0,
                                clk=0).type == MsgType.ACK
    reply = live.ask_past_pushes(MsgType.READ, table=0, clk=1)
    assert reply.type == MsgType.ROWS and reply.clk == 1
    # A replacement rejoins (at the table's clock, its WELCOME says; a
    # first HELLO says nothing); the stalled process cannot take its place.
    assert "rejoined_at" not in stalled.welcome.meta
    replacement = servers.peer(server, 1, incarnation=2)
    assert replacement.welcome.meta["rejoined_at"] == 1
    reply = stalled.ask_past_pushes(MsgType.HELLO, meta={"incarnation": 1})
    assert reply.type == MsgType.ERROR
    assert reply.meta["code"] == protocol.ERROR_WORKER_DEAD
    assert replacement.ask_past_pushes(MsgType.DECLARE, table=0,
                                       meta=spec(4, 2)).type == MsgType.ACK
    assert server.snapshot_stats()["dead_workers"] == []


def test_a_worker_that_never_connects_is_declared_dead(servers,
                                                       monkeypatch):
    monkeypatch.setattr(shard_module, "STARTUP_GRACE_S", 0.5)
    server = servers(num_workers=2, worker_timeout=1.0)
    live = servers.peer(server, 0)  # worker 1 never says HELLO
    _create(live, 4, 3)
    live.send(live.message(MsgType.CLOCK, table=0, clk=0))
    errors = []
    deadline = time.monotonic() + 10
    while not errors and time.monotonic() < deadline:
        live.send(live.message(MsgType.HEARTBEAT))
        errors = [m for m in live.drain(100) if m.type == MsgType.ERROR]
    assert errors, "worker 1 was never declared dead"
    assert "worker 1 never connected" in errors[0].meta["error"]


def test_a_slow_reader_is_pushed_the_freshest_rows_not_every_clock(
        servers):
    """A subscriber that clocks and reads nothing pinned one buffer of the
    table per clock, queued for it (with a 60 KB table, 20,000 CLOCKs
    took 1.1 GB; here the job was refused once max_table_bytes was
    spent). A push now waits while none of the last one to that worker
    has left, and the worker gets the freshest rows when it reads."""
    table_bytes = (1 << 16) * 4 * 4  # 1 MiB
    server = servers(num_workers=2, max_table_bytes=8 * table_bytes)
    writer = servers.peer(server, 0)
    slow = RawPeer(server.address, 1)  # subscribes, then never reads
    slow.socket.setsockopt(zmq.RCVHWM, 1)
    slow.socket.setsockopt(zmq.RCVBUF, 4096)
    clocks = 200
    try:
        assert slow.ask(MsgType.HELLO).type == MsgType.WELCOME
        _create(writer, 1 << 16, 4)
        slow.send(slow.message(MsgType.DECLARE, table=0,
                               meta=spec(1 << 16, 4)))
        update = np.ones((1 << 16, 4), np.float32)
        for clk in range(clocks):
            writer.send(writer.message(MsgType.UPDATE, table=0, clk=clk,
                                       arrays=[update]))
            reply = writer.ask_past_pushes(MsgType.CLOCK, table=0, clk=clk)
            assert reply.type == MsgType.ACK, reply
            slow.send(slow.message(MsgType.CLOCK, table=0, clk=clk))
            writer.drain(5)
        deadline = time.monotonic() + 10
        while server.snapshot_stats()["tables"]["0"]["global_clock"] < \
                clocks:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stats = server.snapshot_stats()
        assert stats["held_bytes"] <= 4 * table_bytes, stats["held_bytes"]
        assert stats["pushes_deferred"] > clocks // 2
        pushes = [m for m in slow.drain(1000) if m.type == MsgType.PUSH]
        assert len(pushes) < clocks // 4, len(pushes)
        last = max(pushes, key=lambda m: m.clk)
        assert last.clk == clocks
        np.testing.assert_array_equal(last.arrays[0], clocks)
    finally:
        slow.close()


def _a_table_and_a_deaf_peer(servers, rows):
    """A shard (2 workers, max_table_bytes 1 MiB) holding table 0 (`rows`
    x 1 of ones) made by worker 0's peer; worker 1's peer reads almost
    nothing (its ZeroMQ takes one message, its socket 4 KB). Returns
    (server, creator, deaf)."""
    server = servers(num_workers=2, max_table_bytes=1 << 20)
    creator = servers.peer(server, 0)
    _create(creator, rows, 1, value=1.0)
    deaf = RawPeer(server.address, 1, options=[(zmq.RCVHWM, 1),
                                               (zmq.RCVBUF, 4096)])
    return server, creator, deaf


def test_replies_a_peer_never_reads_are_bounded(servers):
    """A peer that sends READs and reads nothing (its ZeroMQ stops taking
    from TCP) makes the shard queue the replies. Rows under 64 KiB were
    copied into that queue, outside max_table_bytes: 3000 READs of a
    64 KB table took 190 MB. Rows now go zero-copy (the table's own,
    counted buffer), and past MAX_UNSENT_READS replies not yet sent the
    peer's READs are refused, until it reads."""
    rows = 16_000  # 64,000 bytes: below pyzmq's copy threshold
    server, creator, deaf = _a_table_and_a_deaf_peer(servers, rows)
    table_spec = spec(rows, 1)
    try:
        assert deaf.ask(MsgType.HELLO, meta={
            "incarnation": 1}).type == MsgType.WELCOME
        assert deaf.ask(MsgType.DECLARE, table=0,
                        meta=table_spec).type == MsgType.ACK
        gc.collect()
        before = rss_bytes()
        reads = 3000
        for _ in range(reads):
            deaf.send(deaf.message(MsgType.READ, table=0, clk=0))
        deadline = time.monotonic() + 60
        while server.snapshot_stats()["messages_in"] < reads + 4 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        stats = server.snapshot_stats()
        assert stats["errors"] >= reads // 2, stats["errors"]
        grown = rss_bytes() - before
        assert grown < reads * rows * 4 // 8, grown
        assert stats["held_bytes"] <= 1 << 20
        # The creator is served all the while.
        reply = creator.ask(MsgType.READ, table=0, clk=0)
        np.testing.assert_array_equal(reply.arrays[0], 1.0)
        # The deaf peer reads at last: every READ got rows or a refusal
        # saying why, and its READs are answered again.
        got = [m for m in deaf.drain(1000) if m.type != MsgType.PUSH]
        assert len(got) == reads
        refusals = [m.meta["error"] for m in got if m.type == MsgType.ERROR]
        assert len(refusals) == stats["errors"]
        assert all("not sent yet (it reads none of them)" in e
                   for e in refusals), refusals[:1]
        assert {m.type for m in got} == {MsgType.ROWS, MsgType.ERROR}
        deadline = time.monotonic() + 10
        while (reply := deaf.ask(MsgType.READ, table=0, clk=0)).type != \
                MsgType.ROWS:  # (the last trackers may still be finishing)
            assert time.monotonic() < deadline, reply
            time.sleep(0.05)
        np.testing.assert_array_equal(reply.arrays[0], 1.0)
    finally:
        deaf.close()


@pytest.mark.parametrize("request_type", ["DECLARE", "CREATE"])
def test_rows_answering_requests_a_peer_never_reads_are_not_repeated(
        servers, request_type):
    """A DECLARE, or a CREATE of a table that exists, is answered with the
    table's rows. A peer that repeated them and read nothing had the shard
    queue a copy each time, outside max_table_bytes (3000 DECLAREs of a
    64 KB table: 180 MB). The rows now go zero-copy, and not again while
    the last ones still wait to go to that peer: every request is
    answered, none refused, and the rows come once."""
    rows = 16_000  # 64,000 bytes: below pyzmq's copy threshold
    server, creator, deaf = _a_table_and_a_deaf_peer(servers, rows)
    table_spec = spec(rows, 1)
    kind = getattr(MsgType, request_type)
    request = dict(meta=table_spec) if kind == MsgType.DECLARE else dict(
        meta=dict(table_spec, chunk_row=0),
        arrays=[np.zeros((1, 1), np.float32)])
    try:
        assert deaf.ask(MsgType.HELLO, meta={
            "incarnation": 1}).type == MsgType.WELCOME
        gc.collect()
        before = rss_bytes()
        sent = 3000
        for _ in range(sent):
            deaf.send(deaf.message(kind, table=0, **request))
        deadline = time.monotonic() + 60
        while server.snapshot_stats()["messages_in"] < sent + 2 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        stats = server.snapshot_stats()
        assert stats["errors"] == 0
        assert stats["pushes_skipped"] >= sent // 2, stats["pushes_skipped"]
        grown = rss_bytes() - before
        assert grown < sent * rows * 4 // 8, grown
        assert stats["held_bytes"] <= 1 << 20
        # The deaf peer reads at last: every request answered, the rows
        # once for each that was not skipped, all of them the table's (not
        # the zeros of a CREATE).
        drained = deaf.drain(1000)
        assert sum(m.type == MsgType.ACK for m in drained) == sent
        pushes = [m for m in drained if m.type == MsgType.PUSH]
        # (read again: the last request may have been counted in, not yet
        # handled, when `stats` was taken)
        skipped = server.snapshot_stats()["pushes_skipped"]
        assert len(pushes) == sent - skipped
        for push in pushes:
            np.testing.assert_array_equal(push.arrays[0], 1.0)
        assert len(drained) == sent + len(pushes)
        # A request now (the rows taken) gets the rows again.
        assert deaf.ask(kind, table=0, **request).type == MsgType.ACK
        assert deaf.recv().type == MsgType.PUSH
    finally:
        deaf.close()


def test_a_declare_after_part_of_its_rows_came_gets_them_all(servers):
    """A worker took the first chunks of a table's rows (a `create_table`
    that failed drops them, and is tried again) and declares it again:
    the rest of the first push did not give it row 0 again, and the
    retried creation waited for rows that never came. The rows go
    again once any of the last ones went."""
    rows, chunk = 1 << 20, 64 << 10  # 4 MiB of float32: 64 chunks
    server = servers(num_workers=2, chunk_bytes=chunk)
    creator = servers.peer(server, 0)
    _create(creator, rows, 1, value=1.0)
    slow = RawPeer(server.address, 1, options=[(zmq.RCVHWM, 1),
                                               (zmq.RCVBUF, 4096)])
    try:
        assert slow.ask(MsgType.HELLO, meta={
            "incarnation": 1}).type == MsgType.WELCOME
        slow.send(slow.message(MsgType.DECLARE, table=0, meta=spec(rows, 1)))
        taken = [slow.recv() for _ in range(4)]  # the ACK and 3 chunks
        assert [m.type for m in taken] == [MsgType.ACK] + [MsgType.PUSH] * 3
        reply = slow.ask(MsgType.DECLARE, table=0, meta=spec(rows, 1))
        rest = [reply] + slow.drain(1000)
        pushed = [m for m in rest if m.type == MsgType.PUSH]
        starts = [m.meta["chunk_row"] for m in pushed]
        assert starts.count(0) == 1  # the rows again, from row 0
        assert sum(m.arrays[0].shape[0] for m in pushed) == 2 * rows - \
            sum(m.arrays[0].shape[0] for m in taken[1:])
        assert server.snapshot_stats()["pushes_skipped"] == 0
    finally:
        slow.close()


def test_a_reconnecting_worker_gets_the_rows_its_declare_asks_for(servers):
    """A worker's recovery declares a table right behind a DECLARE of its
    own it held back (a link that broke in `create_table`), or after a
    re-HELLO on a new connection while rows still wait on the old one:
    neither is refused (a refusal failed `create_table`, or lost the
    shard for good), and the new connection gets the rows."""
    rows = 16_000
    server = servers(num_workers=2)
    creator = servers.peer(server, 0)
    _create(creator, rows, 1, value=2.0)
    old = RawPeer(server.address, 1, options=[(zmq.RCVHWM, 1),
                                              (zmq.RCVBUF, 4096)])
    new = RawPeer(server.address, 1)
    try:
        assert old.ask(MsgType.HELLO, meta={
            "incarnation": 1}).type == MsgType.WELCOME
        seen = server.snapshot_stats()["messages_in"]
        for _ in range(2):  # back to back, its socket not read
            old.send(old.message(MsgType.DECLARE, table=0,
                                 meta=spec(rows, 1)))
        deadline = time.monotonic() + 10
        while server.snapshot_stats()["messages_in"] < seen + 2:
            assert time.monotonic() < deadline  # (handled before the
            time.sleep(0.02)                    # other connection's)
        # The same process on a new connection (its old link half-open):
        # its rows wait on the old one, unread.
        new.seq = old.seq
        assert new.ask(MsgType.HELLO, meta={
            "incarnation": 1}).type == MsgType.WELCOME
        reply = new.ask(MsgType.DECLARE, table=0, meta=spec(rows, 1))
        assert reply.type == MsgType.ACK, reply
        pushed = new.recv()
        assert pushed.type == MsgType.PUSH
        np.testing.assert_array_equal(pushed.arrays[0], 2.0)
        got = old.drain(1000)
        assert [m.type for m in got if m.type != MsgType.PUSH] == [
            MsgType.ACK, MsgType.ACK]
    finally:
        old.close()
        new.close()


def test_a_burst_of_declares_of_many_tables_is_answered(servers):
    """A recovery declares every table of the worker at once, reading
    nothing meanwhile: rows of 100 tables queue for it, none refused (only
    a DECLARE of a table whose last rows are unsent is)."""
    rows, tables = 16_000, 100
    server = servers(num_workers=2)
    creator = servers.peer(server, 0)
    for table in range(tables):
        _create(creator, rows, 1, value=table, table=table)
    slow = RawPeer(server.address, 1, options=[(zmq.RCVHWM, 1),
                                               (zmq.RCVBUF, 4096)])
    try:
        assert slow.ask(MsgType.HELLO, meta={
            "incarnation": 1}).type == MsgType.WELCOME
        for table in range(tables):
            slow.send(slow.message(MsgType.DECLARE, table=table,
                                   meta=spec(rows, 1)))
        got = slow.drain(2000)
        assert [m.type for m in got] == [MsgType.ACK, MsgType.PUSH] * tables
        for table, push in enumerate(got[1::2]):
            assert push.table == table
            np.testing.assert_array_equal(push.arrays[0], table)
    finally:
        slow.close()


def test_refusals_to_a_stranger_that_never_reads_are_bounded(servers,
                                                             caplog):
    """A peer that said no HELLO sends one-byte garbage and reads nothing:
    each got an ERROR queued for it and a warning line, without bound
    (400,000 messages: +97 MB and a 47 MB log). Past MAX_UNSENT_ERRORS
    waiting its refusals go unanswered (counted in STATS), and at most
    REFUSAL_LOG_LINES lines are logged per 10 s, the next one saying how
    many were not."""
    server = servers(num_workers=1)
    worker = servers.peer(server, 0)
    stranger = RawPeer(server.address, 0, options=[(zmq.RCVHWM, 1),
                                                   (zmq.RCVBUF, 4096)])
    sent = 100_000
    try:
        with caplog.at_level("WARNING", logger="keras_geeps.shard"):
            for _ in range(sent):
                stranger.socket.send(b"\xc1")  # never valid msgpack
            deadline = time.monotonic() + 120
            while server.snapshot_stats()["messages_in"] < sent + 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        stats = server.snapshot_stats()
        assert stats["errors"] == sent and stats["internal_errors"] == 0
        # (what the kernel's socket buffers took went out: the rest not)
        assert stats["errors_unanswered"] >= sent // 4, stats
        lines = [r.getMessage() for r in caplog.records
                 if "refused a request" in r.getMessage()]
        assert len(lines) <= 13 * shard_module.REFUSAL_LOG_LINES, len(lines)
        assert any("similar lines not logged" in line for line in lines) \
            or len(lines) == shard_module.REFUSAL_LOG_LINES
        # A worker is answered all the while, refusals included.
        refused = worker.ask(MsgType.UPDATE, table=7, clk=0,
                             arrays=[np.ones((1, 1), np.float32)])
        assert "not created" in refused.meta["error"]
        got = stranger.drain(1000)
        assert len(got) == sent - stats["errors_unanswered"]
    finally:
        stranger.close()


def test_stats_replies_a_peer_never_reads_are_bounded(servers):
    """STATS needs no HELLO and its reply copies every table's figures
    (100 tables with long names: 115 KB for a 49-byte request): a peer
    that asks and reads nothing grew the shard by 170 MB in 1500
    requests. Past MAX_UNSENT_STATS replies not yet sent, its STATS are
    refused with a short ERROR until it reads; others are answered."""
    server = servers(num_workers=1, max_table_bytes=1 << 20)
    creator = servers.peer(server, 0)
    for table in range(100):
        creator.send(creator.message(MsgType.DECLARE, table=table, meta=spec(
            1, 1, name=f"{table:04d}" + "n" * 1000)))
    assert all(m.type == MsgType.ACK for m in
               (creator.recv() for _ in range(100)))
    deaf = RawPeer(server.address, 0, options=[(zmq.RCVHWM, 1),
                                               (zmq.RCVBUF, 4096)])
    try:
        gc.collect()
        before = rss_bytes()
        asked = 1500
        for _ in range(asked):
            deaf.send(deaf.message(MsgType.STATS))
        deadline = time.monotonic() + 60
        while server.snapshot_stats()["messages_in"] < asked + 100 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        stats = server.snapshot_stats()
        assert stats["errors"] >= asked * 9 // 10, stats["errors"]
        grown = rss_bytes() - before
        assert grown < 40 << 20, grown  # (was 170 MB)
        assert protocol.stats_of(creator.ask(MsgType.STATS))["tables"]
        got = deaf.drain(1000)
        # (past MAX_UNSENT_ERRORS refusals waiting, no more were queued)
        assert len(got) == asked - stats["errors_unanswered"]
        refusals = [m.meta["error"] for m in got if m.type == MsgType.ERROR]
        assert all("STATS replies" in e and "not taken yet" in e
                   for e in refusals), refusals[:1]
        deadline = time.monotonic() + 10
        while (reply := deaf.ask(MsgType.STATS)).type != \
                MsgType.STATS_REPLY:  # (the last trackers may be finishing)
            assert time.monotonic() < deadline, reply
            time.sleep(0.05)
    finally:
        deaf.close()


def test_a_table_that_could_take_no_update_is_refused(servers):
    server = servers(num_workers=1, max_table_bytes=1000)
    peer = servers.peer(server, 0)
    reply = peer.ask(MsgType.CREATE, table=0,
                     arrays=[np.zeros((50, 4), np.float32)],  # 800 bytes
                     meta=dict(spec(50, 4), chunk_row=0))
    assert reply.type == MsgType.ERROR
    assert "max_table_bytes" in reply.meta["error"]
    _create(peer, 25, 4)  # 400 bytes: room for its rows and an update
    peer.send(peer.message(MsgType.UPDATE, table=0, clk=0,
                           arrays=[np.ones((25, 4), np.float32)]))
    assert peer.ask_past_pushes(MsgType.CLOCK, table=0, clk=0).type == \
        MsgType.ACK


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_clock_whose_update_was_refused_stops_the_job(servers, policy):
    """Worker 0 runs a clock ahead; its clock-1 update finds no room (a
    second pending clock) and is refused. Its CLOCK of 1 used to be taken
    all the same, completing clock 1 without the update once worker 1
    got there: lost without a word. Now that CLOCK stops the job, and
    every worker is told why."""
    # 4 x 2 float32: rows 32 bytes, a clock's updates 32 + 4 flags; room
    # for the rows and one pending clock, not two.
    server = servers(num_workers=2, max_table_bytes=80,
                     on_worker_failure=policy)
    first, other = _two_workers_one_table(servers, server)
    ones = np.ones((4, 2), np.float32)
    for clk in range(2):
        first.send(first.message(MsgType.UPDATE, table=0, clk=clk,
                                 arrays=[ones]))
        if clk == 1:
            refused = _past_pushes(first)
            assert refused.type == MsgType.ERROR
            assert "no memory for clock 1" in refused.meta["error"]
        reply = first.ask_past_pushes(MsgType.CLOCK, table=0, clk=clk)
    assert reply.type == MsgType.ERROR, reply
    error = ("worker 0 finished clock 1 of table 't', but this shard "
             "refused an update of its clock 1 for lack of memory")
    assert error in reply.meta["error"]
    told = _past_pushes(other)
    assert told.type == MsgType.ERROR and error in told.meta["error"]
    assert error in server.snapshot_stats()["failed"]
    assert server.snapshot_stats()["tables"]["0"]["vclock"] == [1, 0]


def test_written_flags_of_pending_clocks_count_against_the_limit(servers):
    """Each pending clock keeps a written flag per row (a byte): with
    uint8 rows of width 1 that doubles what a clock holds. They went
    uncounted, and a worker running ahead held 1.94 times
    max_table_bytes; now they count, and the limit holds."""
    n = 1 << 20
    server = servers(num_workers=2, max_table_bytes=16 * n,
                     max_pending_clocks=64, max_message_bytes=4 * n)
    ahead, behind = servers.peer(server, 0), servers.peer(server, 1)
    table_spec = dict(spec(n, 1), dtype="uint8")
    assert ahead.ask(MsgType.CREATE, table=0,
                     arrays=[np.zeros((n, 1), np.uint8)],
                     meta=dict(table_spec, chunk_row=0)).type == MsgType.ACK
    assert behind.ask(MsgType.DECLARE, table=0,
                      meta=table_spec).type == MsgType.ACK
    for clk in range(64):  # worker 1 never clocks: every clock waits
        ahead.send(ahead.message(MsgType.UPDATE, table=0, clk=clk,
                                 arrays=[np.ones((n, 1), np.uint8)]))
        reply = ahead.ask_past_pushes(MsgType.CLOCK, table=0, clk=clk)
        if reply.type == MsgType.ERROR:
            assert "max_table_bytes" in reply.meta["error"], reply
            break
    assert 4 <= clk < 16, clk
    table = server._tables[0]
    held = table.data.nbytes + sum(p.buffer.nbytes + p.written.nbytes
                                   for p in table.pending.values())
    assert held == server.snapshot_stats()["held_bytes"] <= 16 * n


def test_a_pooled_buffer_dropped_to_make_room_is_not_counted_as_reused():
    """A table at the limit with a reusable pooled buffer: an update was
    charged only its flags (the buffer counted already), then the pool
    was shrunk to make room, dropping that very buffer, and the update
    went into a new one, past the limit."""
    rows = 1 << 16  # uint8 of width 1: the flags weigh what the rows do
    server = ShardServer("tcp://127.0.0.1:0", 0, 1, 1, ShardSettings(
        shared_memory=False, max_table_bytes=2 * rows))  # (not started)
    try:
        table = server._new_table(0, dict(spec(rows, 1), dtype="uint8"))
        server._tables[0] = table
        table.ready, table.initialised = True, None
        table.pool.put(np.empty((rows, 1), np.uint8))  # retired rows
        assert server._held_bytes() == 2 * rows
        with pytest.raises(shard_module.RequestError, match="no memory"):
            server._update(b"peer", protocol.Message(
                MsgType.UPDATE, table=0, clk=0, worker=0,
                arrays=[np.ones((rows, 1), np.uint8)],
                meta={"chunk_row": 0}))
        assert server._held_bytes() <= 2 * rows and not table.pending
    finally:
        server._close()


@pytest.mark.parametrize("every", [1, 0])
def test_a_checkpointing_shard_keeps_room_for_the_snapshot_too(
        servers, tmp_path, every):
    """With checkpoint_every the clock-0 snapshot copy takes a table's
    size at once: a table accepted with room for its rows and one clock's
    updates only then could never take an update. It is refused; one with
    room for the three takes its updates. The same with a checkpoint
    folder only: a checkpoint request (anyone's, `keras-geeps
    checkpoint`) leaves a snapshot kept from then on."""
    server = servers(num_workers=1, max_table_bytes=1000,
                     checkpoint_dir=str(tmp_path), checkpoint_every=every)
    peer = servers.peer(server, 0)
    reply = peer.ask(MsgType.CREATE, table=0,
                     arrays=[np.zeros((25, 4), np.float32)],  # 400 bytes
                     meta=dict(spec(25, 4), chunk_row=0))
    assert reply.type == MsgType.ERROR
    assert "3 times that with a clock's updates and its snapshot" in \
        reply.meta["error"]
    _create(peer, 20, 4)  # 320 bytes
    for clk in range(2):
        peer.send(peer.message(MsgType.UPDATE, table=0, clk=clk,
                               arrays=[np.ones((20, 4), np.float32)]))
        assert peer.ask_past_pushes(MsgType.CLOCK, table=0,
                                    clk=clk).type == MsgType.ACK
        if clk == 0:
            assert peer.ask_past_pushes(MsgType.CHECKPOINT).type == \
                MsgType.ACK
    assert server.snapshot_stats()["errors"] == 1  # the first CREATE only


def test_a_worker_that_left_and_was_left_behind_rejoins(servers):
    """Worker 1 left (LEAVE), worker 0 went on past its clocks (continue:
    a death that buries nothing), and worker 1 says HELLO again: it was
    welcomed yet refused every request as 'silent for more than
    worker_timeout', which no one had set. It rejoins at the clock."""
    server = servers(num_workers=2, on_worker_failure="continue")
    first, other = _two_workers_one_table(servers, server)
    assert other.ask_past_pushes(MsgType.LEAVE).type == MsgType.ACK
    assert first.ask_past_pushes(MsgType.CLOCK, table=0,
                                 clk=0).type == MsgType.ACK
    deadline = time.monotonic() + 10
    while 1 not in server.snapshot_stats()["dead_workers"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    welcome = other.ask_past_pushes(MsgType.HELLO, meta={"incarnation": 1})
    assert welcome.type == MsgType.WELCOME
    assert welcome.meta.get("rejoined_at") == 1
    assert other.ask_past_pushes(MsgType.DECLARE, table=0,
                                 meta=spec(4, 2)).type == MsgType.ACK
    assert server.snapshot_stats()["dead_workers"] == []


def test_a_creator_replaced_mid_creation_sends_all_the_rows_again(servers):
    """The creator sent the first of two chunks and its process died; its
    new process (welcomed: it died between clocks) sends both chunks
    again. The first was refused ('already initialised') and the table
    mixed the two processes' rows; now the new one's rows are the table."""
    server = servers(num_workers=2)
    first, other = servers.peer(server, 0), servers.peer(server, 1)
    table = spec(4, 2)
    assert other.ask(MsgType.DECLARE, table=0, meta=table).type == \
        MsgType.ACK
    assert first.ask(MsgType.CREATE, table=0, arrays=[
        np.ones((2, 2), np.float32)], meta=dict(table, chunk_row=0)).type \
        == MsgType.ACK
    again = servers.peer(server, 0, incarnation=2)
    for row in (0, 2):
        reply = again.ask_past_pushes(MsgType.CREATE, table=0, arrays=[
            np.full((2, 2), 5, np.float32)], meta=dict(table, chunk_row=row))
        assert reply.type == MsgType.ACK, reply.meta
    np.testing.assert_array_equal(server._tables[0].data, 5.0)


def test_rows_wider_than_a_message_and_odd_shm_pids_are_refused(servers):
    """A declaration with no local rows but a row of 8 TiB allocated that
    row (MemoryError, an internal error); a HELLO whose shared-memory pid
    is infinite raised OverflowError inside the handshake. Both are plain
    refusals (no shared memory for the second), nothing internal."""
    server = servers(num_workers=2, shared_memory=True)
    peer = servers.peer(server, 0)
    wide = dict(spec(10, 2 ** 40), dtype="float64", row_start=5, row_end=5)
    reply = peer.ask(MsgType.DECLARE, table=0, meta=wide)
    assert reply.type == MsgType.ERROR
    assert "exceeds max_message_bytes" in reply.meta["error"]
    other = RawPeer(server.address, 1)
    try:
        welcome = other.ask(MsgType.HELLO, meta={
            "incarnation": 1, "shm": [float("inf"), shm._boot_id(), 3,
                                      "00" * shm.TOKEN_BYTES]})
        assert welcome.type == MsgType.WELCOME
        assert not welcome.meta.get("shm_ok")
    finally:
        other.close()
    assert server.snapshot_stats()["internal_errors"] == 0


def test_an_oversized_frame_is_dropped_before_it_is_buffered(servers):
    server = servers(num_workers=1, max_message_bytes=1 << 20)
    hostile = RawPeer(server.address, 0)
    try:
        hostile.socket.send_multipart(
            protocol.encode(hostile.message(MsgType.STATS))[:1]
            + [np.zeros(64 << 20, np.uint8)])
        assert not hostile.socket.poll(500)  # connection dropped, no reply
    finally:
        hostile.close()
    peer = servers.peer(server, 0)
    assert peer.ask(MsgType.STATS).type == MsgType.STATS_REPLY
    assert server.snapshot_stats()["bytes_in"] < 1 << 20


def test_repeated_reads_keep_no_finished_sends(servers):
    server = servers(num_workers=1)
    peer = servers.peer(server, 0)
    _create(peer, 4, 3)
    for _ in range(300):
        assert peer.ask_past_pushes(MsgType.READ, table=0,
                                    clk=0).type == MsgType.ROWS
    assert sum(len(t) for t in server._trackers.values()) < 50


def test_a_shard_that_cannot_start_leaves_nothing_running(tmp_path):
    secret = keygen(tmp_path, "shard")[1]
    keygen(tmp_path / "allowed", "worker")
    first = ShardServer("tcp://127.0.0.1:0", 0, 1, 1,
                        ShardSettings(shared_memory=False))
    threads = set(threading.enumerate())
    try:
        with pytest.raises(zmq.ZMQError):
            ShardServer(first.address, 0, 1, 1,
                        ShardSettings(shared_memory=False),
                        curve=(secret, str(tmp_path / "allowed")))
        time.sleep(0.2)
        assert set(threading.enumerate()) <= threads
    finally:
        first._close()


def test_settings_out_of_range_are_named():
    for kwargs, problem in (
            ({"max_table_bytes": 0}, "max_table_bytes must be an int >= 1"),
            ({"chunk_bytes": 1.5}, "chunk_bytes must be an int >= 1, not "
                                   "1.5"),
            ({"max_tables": True}, "max_tables must be an int >= 1, not "
                                   "True"),
            ({"poll_timeout_ms": 0}, "poll_timeout_ms must be an int >= 1"),
            ({"max_held_buffers": -1}, "max_held_buffers must be an int >= "
                                       "0"),
            ({"worker_timeout": float("nan")}, "worker_timeout must be a "
                                               "number of seconds >= 0"),
            ({"worker_timeout": "5"}, "worker_timeout must be a number of "
                                      "seconds >= 0 \\(0: not watched\\), "
                                      "not '5'")):
        with pytest.raises(ValueError, match=problem):
            ShardSettings(**kwargs)
    settings = ShardSettings(max_pending_clocks=0, max_held_buffers=0,
                             max_message_bytes=np.int64(1 << 20))
    assert (settings.max_pending_clocks, settings.max_held_buffers) == (0, 0)


def test_a_shard_to_restore_without_a_checkpoint_dir_is_refused():
    with pytest.raises(ValueError, match="needs settings.checkpoint_dir"):
        ShardServer("tcp://127.0.0.1:0", 0, 1, 1, restore=True)


def test_restored_rows_stay_their_checkpoints_rows_without_shared_memory(
        tmp_path):
    """A restored table's rows are also its snapshot until its next one.
    Without shared memory the row pool would hand them out again once the
    table moved on, and the next checkpoint (another table's snapshot
    starts it) would hold a later clock's sums under the restored clock:
    a restore from it would apply those updates twice."""
    checkpoint.write(tmp_path, 0, 1, 1, {
        0: (spec(4, 2, "a"), 3, np.full((4, 2), 1, np.float32)),
        1: (spec(4, 2, "b"), 4, np.full((4, 2), 2, np.float32))})
    server = ShardServer("tcp://127.0.0.1:0", 0, 1, 1, ShardSettings(
        shared_memory=False, checkpoint_dir=str(tmp_path),
        checkpoint_every=5), restore=True).start()
    peer = RawPeer(server.address, 0)
    try:
        assert peer.ask(MsgType.HELLO, meta={"incarnation": 1}).type == \
            MsgType.WELCOME
        for table, name in ((0, "a"), (1, "b")):
            assert peer.ask_past_pushes(MsgType.DECLARE, table=table,
                                        meta=spec(4, 2, name)).type == \
                MsgType.ACK
        # Table 0 leaves its restored rows behind (clock 4), and its
        # clock-4 update goes into a buffer from its pool.
        peer.send(peer.message(MsgType.UPDATE, table=0, clk=3,
                               arrays=[np.ones((4, 2), np.float32)]))
        assert peer.ask_past_pushes(MsgType.CLOCK, table=0,
                                    clk=3).type == MsgType.ACK
        peer.send(peer.message(MsgType.UPDATE, table=0, clk=4,
                               arrays=[np.full((4, 2), 10, np.float32)]))
        # Table 1 reaches clock 5: a snapshot, so a checkpoint is written.
        assert peer.ask_past_pushes(MsgType.CLOCK, table=1,
                                    clk=4).type == MsgType.ACK
        deadline = time.monotonic() + 10
        while server.stats["checkpoints"] < 1 and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.stats["checkpoints"] >= 1
    finally:
        peer.close()
        server.stop()
    tables = checkpoint.load(tmp_path, 0, 1, 1)
    assert tables[1][1] == 5
    np.testing.assert_array_equal(tables[1][2], np.full((4, 2), 2))
    assert tables[0][1] == 3
    np.testing.assert_array_equal(tables[0][2], np.full((4, 2), 1))


def test_a_refused_create_writes_none_of_its_rows(servers):
    """A CREATE whose second frame is wrong is refused whole: its first
    frame's rows are not written, so the corrected CREATE is taken."""
    server = servers(num_workers=1)
    peer = servers.peer(server, 0)
    reply = peer.ask(MsgType.CREATE, table=0, arrays=[
        np.full((2, 3), 5, np.float32), np.zeros((2, 3), np.float64)],
        meta=dict(spec(4, 3), chunk_row=0))
    assert reply.type == MsgType.ERROR and "float64" in reply.meta["error"]
    _create(peer, 4, 3, value=7.0)
    assert peer.ask_past_pushes(MsgType.CLOCK, table=0,
                                clk=0).type == MsgType.ACK
    reply = peer.ask_past_pushes(MsgType.READ, table=0, clk=1)
    assert reply.type == MsgType.ROWS
    np.testing.assert_array_equal(reply.arrays[0], np.full((4, 3), 7))


def test_a_clock_too_far_ahead_is_refused(servers):
    """CLOCKs, like UPDATEs, stay within max_pending_clocks of the global
    clock: a worker cannot pile up clocks for one advance to run through
    when the slowest worker moves (or is declared dead)."""
    server = servers(num_workers=2, max_pending_clocks=2)
    first, _ = _two_workers_one_table(servers, server)
    for clk in range(3):
        assert first.ask_past_pushes(MsgType.CLOCK, table=0,
                                     clk=clk).type == MsgType.ACK
    reply = first.ask_past_pushes(MsgType.CLOCK, table=0, clk=3)
    assert reply.type == MsgType.ERROR
    assert "max_pending_clocks=2" in reply.meta["error"]
    assert server.snapshot_stats()["tables"]["0"]["global_clock"] == 0


def test_checkpoint_requests_are_bounded_and_copy_within_the_limit(
        servers, tmp_path, monkeypatch):
    """CHECKPOINT requests (anyone may send them) copy a table only when
    it moved on since its snapshot, only within max_table_bytes, and at
    most MAX_CHECKPOINT_REQUESTS wait for the writer; each is answered."""
    rows, width = 64, 64
    nbytes = rows * width * 4
    # Room for a table's rows, a clock's updates and its snapshot.
    room = 3 * nbytes + 2 * rows
    server = servers(num_workers=1, checkpoint_dir=str(tmp_path),
                     max_table_bytes=room)
    peer = servers.peer(server, 0)
    _create(peer, rows, width)
    tiny = servers.peer(servers(num_workers=2, checkpoint_dir=str(
        tmp_path / "tiny"), max_table_bytes=room), 0)
    _create(tiny, rows, width)
    for clk in range(2):  # worker 1 never clocks: two clocks pending take
        tiny.send(tiny.message(MsgType.UPDATE, table=0, clk=clk, arrays=[
            np.ones((rows, width), np.float32)]))  # the snapshot's room
        if clk == 0:
            assert tiny.ask_past_pushes(MsgType.CLOCK, table=0,
                                        clk=0).type == MsgType.ACK
    reply = tiny.ask_past_pushes(MsgType.CHECKPOINT)
    assert reply.type == MsgType.ERROR
    assert "no memory to snapshot" in reply.meta["error"]

    writing = threading.Event()
    real_write = checkpoint.write

    def slow_write(*args):  # a slow disk: the writer waits for the test
        assert writing.wait(20)
        return real_write(*args)

    monkeypatch.setattr(shard_module.checkpoint, "write", slow_write)
    limit = writer_module.MAX_CHECKPOINT_REQUESTS
    for _ in range(limit):
        peer.send(peer.message(MsgType.CHECKPOINT))
    refused = peer.ask(MsgType.CHECKPOINT)
    assert refused.type == MsgType.ERROR
    assert "already wait" in refused.meta["error"]
    snapshot = server._tables[0].snapshot[1]
    writing.set()
    replies = [peer.recv() for _ in range(limit)]
    assert [r.type for r in replies] == [MsgType.ACK] * limit
    assert server._tables[0].snapshot[1] is snapshot  # copied once
    assert checkpoint.load(tmp_path, 0, 1, 1)[0][1] == 0


def test_a_shard_servers_and_a_cluster_specs_arguments_are_named():
    """The Python API of a standalone shard and of a cluster spec refuses
    what the command line's parsing would: each problem named, nothing
    bound."""
    for args, kwargs, error, problem in [
            ((0.0, 1, 1), {}, ValueError, "shard_id must be an int >= 0, "
                                          "not 0.0"),
            ((0, 1, "2"), {}, ValueError, "num_workers must be an int >= 1, "
                                          "not '2'"),
            ((0, 1, 1.5), {}, ValueError, "num_workers must be an int"),
            ((0, 0, 1), {}, ValueError, "num_shards must be an int >= 1"),
            ((2, 2, 1), {}, ValueError, r"shard_id 2 is not in \[0, 2\)"),
            ((0, 1, 1), {"settings": {"max_tables": 3}}, TypeError,
             "settings must be a ShardSettings, got dict"),
            ((0, 1, 1), {"curve": "keys/shard.key_secret"}, TypeError,
             r"curve is \(secret_key_file, allowed_clients_dir\)")]:
        with pytest.raises(error, match=problem):
            ShardServer("tcp://127.0.0.1:0", *args, **kwargs)
    with pytest.raises(TypeError, match="shards is a list of addresses"):
        ClusterSpec("tcp://127.0.0.1:5555")
    for workers, worker, problem in [
            (0, 0, "num_workers must be an int"),
            (2, 1.0, "worker_id must be an int"),
            (2, 2, r"worker_id 2 is not in \[0, 2\)")]:
        with pytest.raises(ValueError, match=problem):
            ClusterSpec(["tcp://127.0.0.1:5555"], workers, worker)


def test_a_log_budget_lets_lines_through_per_interval_and_counts_the_rest():
    from keras_geeps.shard.bounds import LogBudget
    now = [0.0]
    budget = LogBudget(2, interval=10.0, clock=lambda: now[0])
    assert [budget.take() for _ in range(5)] == [0, 0, None, None, None]
    now[0] = 10.0  # a new interval: the first line says 3 were held back
    assert budget.take() == 3 and budget.take() == 0
    assert budget.take() is None
    assert LogBudget.note(3) == " (3 similar lines not logged)"
    assert LogBudget.note(0) == ""


def test_leaves_repeated_keep_one_answer_waiting(servers, tmp_path):
    """A LEAVE is answered once a checkpoint holds the leaver's clocks;
    a peer repeating LEAVEs meanwhile grew the answers waiting (100,000:
    +37 MB, each scanned every turn). The last one supersedes the others:
    one answer waits, and comes once the checkpoint is written."""
    server = servers(num_workers=2, checkpoint_dir=str(tmp_path),
                     checkpoint_every=50)
    first, other = _two_workers_one_table(servers, server)
    first.send(first.message(MsgType.UPDATE, table=0, clk=0,
                             arrays=[np.ones((4, 2), np.float32)]))
    assert first.ask_past_pushes(MsgType.CLOCK, table=0,
                                 clk=0).type == MsgType.ACK
    for _ in range(500):
        first.send(first.message(MsgType.LEAVE))
    last = first.seq
    deadline = time.monotonic() + 10
    while server.snapshot_stats()["messages_in"] < 505 and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(server._leave_acks) == 1
    assert other.ask_past_pushes(MsgType.CLOCK, table=0,
                                 clk=0).type == MsgType.ACK
    acks = [m for m in first.drain(2000) if m.type == MsgType.ACK]
    assert [m.seq for m in acks] == [last]


def test_rows_owed_to_a_worker_never_go_to_its_next_process(servers):
    """Rows owed to a worker's process that read nothing are not pushed
    to the process that replaces it: that one has declared no table yet
    (its client would fail on a push of a table it does not know), and
    gets the rows when it declares the table."""
    server = servers(num_workers=2)
    writer = servers.peer(server, 0)
    slow = RawPeer(server.address, 1, options=[(zmq.RCVHWM, 1),
                                               (zmq.RCVBUF, 4096)])
    rows = 1 << 16
    try:
        assert slow.ask(MsgType.HELLO, meta={
            "incarnation": 1}).type == MsgType.WELCOME
        _create(writer, rows, 4)
        slow.send(slow.message(MsgType.DECLARE, table=0, meta=spec(rows, 4)))
        for clk in range(20):
            assert writer.ask_past_pushes(MsgType.CLOCK, table=0,
                                          clk=clk).type == MsgType.ACK
            slow.send(slow.message(MsgType.CLOCK, table=0, clk=clk))
        deadline = time.monotonic() + 10
        while server.snapshot_stats()["tables"]["0"]["global_clock"] < 20:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert server.snapshot_stats()["pushes_deferred"] > 0
        new = RawPeer(server.address, 1)  # the worker's next process
        try:
            new.seq = slow.seq
            assert new.ask(MsgType.HELLO, meta={
                "incarnation": 2}).type == MsgType.WELCOME
            assert [m.type for m in new.drain(300)] == []
            assert new.ask(MsgType.DECLARE, table=0,
                           meta=spec(rows, 4)).type == MsgType.ACK
            push = new.recv()
            assert (push.type, push.clk) == (MsgType.PUSH, 20)
        finally:
            new.close()
    finally:
        slow.close()
