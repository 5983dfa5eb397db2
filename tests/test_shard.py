"""A shard in a thread, driven through raw sockets and through the client."""

import time

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_geeps import protocol
from keras_geeps.errors import GeePSServerError
from keras_geeps.protocol import Message, MsgType
from keras_geeps.shard import ShardServer, ShardSettings
from keras_geeps.shard.sessions import SeqTracker


class RawPeer:
    """A bare DEALER socket speaking the protocol by hand."""

    def __init__(self, address, worker=0, options=()):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, 5000)
        for option, value in options:  # (before the connection is made)
            self.socket.setsockopt(option, value)
        self.socket.connect(address)
        self.worker = worker
        self.seq = 0

    def message(self, kind, **kwargs):
        self.seq += 1
        kwargs.setdefault("worker", self.worker)
        return Message(kind, seq=self.seq, **kwargs)

    def send(self, message):
        frames = protocol.encode(message)
        self.socket.send_multipart(frames)
        return frames

    def recv(self):
        return protocol.decode(self.socket.recv_multipart())

    def ask(self, kind, **kwargs):
        self.send(self.message(kind, **kwargs))
        return self.recv()

    def ask_past_pushes(self, kind, **kwargs):
        """Like `ask`, skipping the pushes of subscribed tables."""
        self.send(self.message(kind, **kwargs))
        while True:
            reply = self.recv()
            if reply.type != MsgType.PUSH:
                return reply

    def drain(self, timeout_ms=300):
        """Every message that arrives within `timeout_ms` of the last."""
        received = []
        while self.socket.poll(timeout_ms):
            received.append(self.recv())
        return received

    def close(self):
        self.socket.close()
        self.context.term()


SPEC = {"name": "t", "rows": 4, "width": 3, "dtype": "float32",
        "row_start": 0, "row_end": 4}


@pytest.fixture
def shard():
    server = ShardServer("tcp://127.0.0.1:0", 0, 1, 1,
                         ShardSettings(max_message_bytes=1 << 20,
                                       max_tables=8)).start()
    yield server
    server.stop()


@pytest.fixture
def peer(shard):
    p = RawPeer(shard.address)
    assert p.ask(MsgType.HELLO, meta={"num_workers": 1,
                                      "num_shards": 1}).type == MsgType.WELCOME
    init = np.zeros((4, 3), np.float32)
    reply = p.ask(MsgType.CREATE, table=0, arrays=[init],
                  meta=dict(SPEC, chunk_row=0))
    assert reply.type == MsgType.ACK
    yield p
    p.close()


def _read(peer, clk=0):
    reply = peer.ask(MsgType.READ, table=0, clk=clk)
    assert reply.type == MsgType.ROWS, reply
    return reply.arrays[0]


def test_updates_before_the_initial_rows_wait_for_them():
    """Worker 1's updates of clocks 0 and 1 reach a declared table before
    worker 0's CREATE (a replay to a shard restored without the table):
    they are kept as deltas and land on the initial rows."""
    server = ShardServer("tcp://127.0.0.1:0", 0, 1, 2).start()
    peers = [RawPeer(server.address, w) for w in range(2)]
    try:
        for p in peers:
            assert p.ask(MsgType.HELLO, meta={
                "num_workers": 2, "num_shards": 1}).type == MsgType.WELCOME
        other, creator = peers[1], peers[0]
        ack = other.ask(MsgType.DECLARE, table=0, meta=SPEC)
        assert ack.type == MsgType.ACK and ack.meta["ready"] is False
        for clk in range(2):
            other.send(other.message(MsgType.UPDATE, table=0, clk=clk,
                                     arrays=[np.full((4, 3), 2.0 + clk,
                                                     np.float32)]))
            assert other.ask(MsgType.CLOCK, table=0,
                             clk=clk).type == MsgType.ACK
        init = np.arange(12, dtype=np.float32).reshape(4, 3)
        ack = creator.ask(MsgType.CREATE, table=0, arrays=[init],
                          meta=dict(SPEC, chunk_row=0))
        assert ack.type == MsgType.ACK and ack.meta["ready"] is True
        for clk, total in enumerate([3, 7]):  # 2 + 1, then 3 + 1 more
            creator.send(creator.message(MsgType.UPDATE, table=0, clk=clk,
                                         arrays=[np.ones((4, 3),
                                                         np.float32)]))
            assert creator.ask_past_pushes(MsgType.CLOCK, table=0,
                                           clk=clk).type == MsgType.ACK
            creator.drain()  # the push
            np.testing.assert_array_equal(_read(creator, clk=clk + 1),
                                          init + total)
    finally:
        for p in peers:
            p.close()
        server.stop()


def test_seq_tracker_skips_gaps_older_than_its_window(monkeypatch):
    """Numbers that never come (a recovering worker resends what it held
    under new ones) leave gaps: once the window passes them they count as
    done, so the tracker's memory stays bounded; within the window, late
    numbers are still told apart from resends."""
    monkeypatch.setattr(SeqTracker, "WINDOW", 8)
    tracker = SeqTracker(start=10)
    for seq in [12, 11, 14]:  # out of order; 13 not yet
        tracker.mark(seq)
    assert tracker.seen(11) and tracker.seen(12) and tracker.seen(14)
    assert not tracker.seen(13) and not tracker.seen(15)
    for seq in range(15, 100):  # 13 never comes
        tracker.mark(seq)
        assert len(tracker.above) <= 8 + 8 // 4
    assert tracker.seen(13) and tracker.upto == 99 and not tracker.above
    assert not tracker.beyond(107) and tracker.beyond(108)
    tracker.mark(1 << 40)  # (the shard refuses such a jump; see beyond)
    assert tracker.seen(1 << 40) and not tracker.seen((1 << 40) + 1)
    assert len(tracker.above) <= 8 + 8 // 4
    # A worker that leaves every other number unused: the set is rebuilt
    # once per quarter window, not on every message.
    monkeypatch.setattr(SeqTracker, "WINDOW", 64)
    tracker = SeqTracker(start=0)
    rebuilt, above = 0, tracker.above
    for seq in range(2, 2002, 2):  # 1000 numbers
        tracker.mark(seq)
        rebuilt += tracker.above is not above
        above = tracker.above
        assert len(above) <= (64 + 64 // 4) // 2 + 1
    assert rebuilt <= 1000 // 4  # once per 8 here (it was once per number)


def test_resent_update_is_applied_once(shard, peer):
    delta = np.ones((4, 3), np.float32)
    frames = peer.send(peer.message(MsgType.UPDATE, table=0, clk=0,
                                    arrays=[delta], meta={"chunk_row": 0}))
    peer.socket.send_multipart(frames)           # the same message again
    clock = peer.message(MsgType.CLOCK, table=0, clk=0)
    frames = peer.send(clock)
    assert peer.recv().type == MsgType.ACK
    push = peer.recv()                           # global clock 0 -> 1
    assert push.type == MsgType.PUSH and push.clk == 1
    np.testing.assert_array_equal(push.arrays[0], delta)
    peer.socket.send_multipart(frames)           # a resent CLOCK is a no-op
    assert peer.recv().type == MsgType.ACK
    np.testing.assert_array_equal(_read(peer), delta)
    stats = shard.snapshot_stats()
    assert stats["updates_applied"] == 1 and stats["duplicates"] == 2
    assert stats["tables"]["0"]["vclock"] == [1]


def test_indexed_update_with_duplicates(peer):
    # More entries than the table's 4 rows: repeated ids add up.
    index = np.array([3, 1, 3, 0, 3, 1], np.int64)
    rows = np.arange(18, dtype=np.float32).reshape(6, 3)
    peer.send(peer.message(MsgType.UPDATE, table=0, clk=0,
                           arrays=[index, rows], meta={"indexed": True}))
    # Reads see exactly the finished clocks: nothing until clock 0 ends.
    np.testing.assert_array_equal(_read(peer), np.zeros((4, 3)))
    assert peer.ask(MsgType.CLOCK, table=0, clk=0).type == MsgType.ACK
    push = peer.recv()
    expected = np.zeros((4, 3), np.float32)
    np.add.at(expected, index, rows)
    np.testing.assert_array_equal(push.arrays[0], expected)
    np.testing.assert_array_equal(_read(peer, clk=1), expected)


@pytest.mark.parametrize("message,pattern", [
    (dict(kind=MsgType.UPDATE, table=9, clk=0,
          arrays=[np.ones((4, 3), np.float32)]), "not created"),
    (dict(kind=MsgType.UPDATE, table=0, clk=5,
          arrays=[np.ones((4, 3), np.float32)]), "current clock is 0"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0,
          arrays=[np.ones((4, 2), np.float32)]), "width is 3"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0,
          arrays=[np.ones((4, 3), np.float64)]), "dtype float64"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"chunk_row": 2},
          arrays=[np.ones((4, 3), np.float32)]), "outside this shard"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"indexed": True},
          arrays=[np.array([7], np.int64), np.ones((1, 3), np.float32)]),
     "row index 7"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"indexed": True},
          arrays=[np.array([-1], np.int64), np.ones((1, 3), np.float32)]),
     "row index -1"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"indexed": True},
          arrays=[np.ones((1, 3), np.float32)]), "carries [indices, rows]"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"indexed": True},
          arrays=[np.array([1], np.int32), np.ones((1, 3), np.float32)]),
     "1-D int64"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"indexed": True},
          arrays=[np.array([[1]], np.int64), np.ones((1, 3), np.float32)]),
     "1-D int64"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"indexed": True},
          arrays=[np.array([1, 2], np.int64), np.ones((1, 3), np.float32)]),
     "2 indices for 1 rows"),
    # A second frame that is refused: the first must not be added either.
    (dict(kind=MsgType.UPDATE, table=0, clk=0,
          arrays=[np.ones((2, 3), np.float32), np.ones((2, 2), np.float32)]),
     "width is 3"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0), "without rows"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"ref": [1, 3, 0, 48]},
          arrays=[np.ones((4, 3), np.float32)]), "not both"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"ref": [1, 3, 0, 48]}),
     "shares no memory"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"into": 1},
          arrays=[np.ones((4, 3), np.float32)]), "carries no rows"),
    (dict(kind=MsgType.UPDATE, table=0, clk=0, meta={"into": 1}),
     "did not lend"),
    (dict(kind=MsgType.CLOCK, table=0, clk=3), "current clock is 0"),
    (dict(kind=MsgType.CLOCK, table=5, clk=0), "unknown table 5"),
    (dict(kind=MsgType.DECLARE, table=0, meta=dict(SPEC, width=5)),
     "exists as"),
    (dict(kind=MsgType.HELLO, meta={"num_workers": 3}),
     "num_workers=3"),
    (dict(kind=MsgType.READ, table=0, worker=4), "worker id 4"),
    (dict(kind=MsgType.PUSH, table=0, arrays=[np.ones((4, 3), np.float32)]),
     "not a request"),
])
def test_bad_requests_get_named_errors(peer, message, pattern):
    """Each refusal names its problem and leaves nothing behind: the
    clock then ends with the rows as they were (no frame of a refused
    update added)."""
    reply = peer.ask(message.pop("kind"), **message)
    assert reply.type == MsgType.ERROR
    assert pattern in reply.meta["error"]
    np.testing.assert_array_equal(_read(peer), np.zeros((4, 3)))
    assert peer.ask_past_pushes(MsgType.CLOCK, table=0,
                                clk=0).type == MsgType.ACK
    rows = peer.ask_past_pushes(MsgType.READ, table=0, clk=1)
    assert rows.type == MsgType.ROWS, rows
    np.testing.assert_array_equal(rows.arrays[0], np.zeros((4, 3)))


def test_a_create_chunk_over_rows_already_written_is_refused_whole(peer):
    """A table's initial rows come in chunks; one that overlaps rows
    already written is refused, and none of its rows are written (its
    corrected resend must find them free)."""
    spec = dict(SPEC, name="chunked")
    second = np.full((2, 3), 1, np.float32)  # rows [2, 4) first
    assert peer.ask(MsgType.CREATE, table=1, arrays=[second],
                    meta=dict(spec, chunk_row=2)).type == MsgType.ACK
    for row, rows, over in [(2, 2, 2), (3, 1, 3), (1, 2, 1)]:
        reply = peer.ask(MsgType.CREATE, table=1,
                         arrays=[np.full((rows, 3), 7, np.float32)],
                         meta=dict(spec, chunk_row=row))
        assert reply.type == MsgType.ERROR, reply
        assert f"rows from {over} are already initialised" in \
            reply.meta["error"]
    # Two frames, the second over written rows: the first is not kept.
    reply = peer.ask(MsgType.CREATE, table=1,
                     arrays=[np.full((1, 3), 7, np.float32),
                             np.full((1, 3), 7, np.float32)],
                     meta=dict(spec, chunk_row=1))
    assert reply.type == MsgType.ERROR, reply
    assert "rows from 2 are already initialised" in reply.meta["error"]
    first = np.full((2, 3), 2, np.float32)
    assert peer.ask(MsgType.CREATE, table=1, arrays=[first],
                    meta=dict(spec, chunk_row=0)).type == MsgType.ACK
    rows = peer.ask_past_pushes(MsgType.READ, table=1, clk=0)
    assert rows.type == MsgType.ROWS, rows
    np.testing.assert_array_equal(rows.arrays[0],
                                  np.concatenate([first, second]))


def test_limits_refuse_excess(shard, peer):
    half = np.zeros((3 << 15, 2), np.float32)  # 2 x 768 KiB > 1 MiB limit
    reply = peer.ask(MsgType.UPDATE, table=0, clk=0, arrays=[half, half])
    assert reply.type == MsgType.ERROR and "exceeds the limit" in \
        reply.meta["error"]
    for table in range(1, 8):
        assert peer.ask(MsgType.DECLARE, table=table,
                        meta=dict(SPEC)).type == MsgType.ACK
    reply = peer.ask(MsgType.DECLARE, table=8, meta=dict(SPEC))
    assert "max_tables" in reply.meta["error"]


def test_a_new_connection_of_the_same_worker_resends_exactly_once():
    """Worker 0's connection breaks (a new DEALER: a new routing id). The
    shard refuses it until its HELLO, whose WELCOME carries the same
    shard incarnation; then an update it had under that number is dropped
    and one it never got is applied: the sum counts each once."""
    server = ShardServer("tcp://127.0.0.1:0", 0, 1, 1).start()
    other = ShardServer("tcp://127.0.0.1:0", 0, 1, 1).start()
    old, new = RawPeer(server.address), RawPeer(server.address)
    hello = {"num_workers": 1, "num_shards": 1, "incarnation": 7}
    ones = [np.ones((4, 3), np.float32)]

    def send(peer, kind, seq, **kwargs):
        peer.send(Message(kind, seq=seq, worker=0, **kwargs))

    try:
        send(old, MsgType.HELLO, 1, meta=hello)
        welcome = old.recv()
        incarnation = welcome.meta["incarnation"]
        send(old, MsgType.CREATE, 2, table=0, meta=dict(SPEC, chunk_row=0),
             arrays=[np.zeros((4, 3), np.float32)])
        assert old.recv().type == MsgType.ACK
        send(old, MsgType.UPDATE, 3, table=0, clk=0, arrays=ones)
        deadline = time.monotonic() + 10  # (the shard has it: no reply)
        while server.stats["updates_applied"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # (seq 4, an update of the same clock, was lost with the connection)
        send(new, MsgType.UPDATE, 5, table=0, clk=0, arrays=ones)
        refusal = new.recv()
        assert refusal.meta["code"] == protocol.ERROR_HELLO_REQUIRED
        send(new, MsgType.HELLO, 6, meta=hello)
        again = new.recv()
        assert again.meta["incarnation"] == incarnation  # not a restart
        for seq in (3, 4, 5):  # everything not acknowledged, as numbered
            send(new, MsgType.UPDATE, seq, table=0, clk=0, arrays=ones)
        send(new, MsgType.CLOCK, 7, table=0, clk=0)
        replies = [r for r in [new.recv()] + new.drain()
                   if r.type == MsgType.ACK]
        assert [r.seq for r in replies] == [7]
        send(new, MsgType.READ, 8, table=0, clk=1)
        rows = [r for r in [new.recv()] + new.drain()
                if r.type == MsgType.ROWS]
        np.testing.assert_array_equal(rows[-1].arrays[0], 3.0)  # not 4
        assert server.stats["duplicates"] == 1
        elsewhere = RawPeer(other.address)  # another shard: another number
        try:
            send(elsewhere, MsgType.HELLO, 1, meta=hello)
            assert elsewhere.recv().meta["incarnation"] != incarnation
        finally:
            elsewhere.close()
    finally:
        old.close()
        new.close()
        server.stop()
        other.stop()


def test_a_resent_request_gets_its_first_answer_again(shard, peer):
    """A refused UPDATE or CLOCK, or a CREATE, resent under its number
    (its answer was lost with a connection) is not handled again: it gets
    the answer it got the first time, not a bare ACK or silence."""
    def ask(seq, kind, **kwargs):
        """The replies to one request: the first within 5 s, then any
        more within 0.3 s."""
        peer.send(Message(kind, seq=seq, worker=0, **kwargs))
        replies = [peer.recv()]
        replies += peer.drain()
        return [r for r in replies if r.type != MsgType.PUSH]

    wrong = dict(table=0, clk=3, arrays=[np.ones((4, 3), np.float32)])
    first = ask(100, MsgType.UPDATE, **wrong)
    assert first[0].type == MsgType.ERROR and "clock 3" in \
        first[0].meta["error"]
    again = ask(100, MsgType.UPDATE, **wrong)
    assert [(r.type, r.meta) for r in again] == \
        [(MsgType.ERROR, first[0].meta)]
    assert shard.stats["duplicates"] == 1
    refused_clock = ask(101, MsgType.CLOCK, table=0, clk=5)
    assert ask(101, MsgType.CLOCK, table=0, clk=5)[0].meta == \
        refused_clock[0].meta
    # The fixture's CREATE (seq 2) again: acknowledged, not applied twice
    # (a fresh table's ACK says nothing a bare one does not).
    create = ask(2, MsgType.CREATE, table=0, arrays=[np.zeros((4, 3),
                                                              np.float32)],
                 meta=dict(SPEC, chunk_row=0))
    assert [r.type for r in create] == [MsgType.ACK]
    assert not create[0].meta.get("existing")
    assert len(shard._answers[0]) == 2  # the two refusals only


def test_requests_before_hello_are_refused(shard):
    p = RawPeer(shard.address)
    try:
        reply = p.ask(MsgType.READ, table=0)
        assert reply.type == MsgType.ERROR
        assert "HELLO first" in reply.meta["error"]
    finally:
        p.close()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_garbage_gets_errors_and_shard_keeps_serving(shard, peer, garbage):
    bad = RawPeer(shard.address, worker=0)
    try:
        bad.socket.send_multipart(garbage)
        reply = bad.recv()
        assert reply.type == MsgType.ERROR
    finally:
        bad.close()
    np.testing.assert_array_equal(_read(peer), np.zeros((4, 3)))


def test_stats_and_stop(shard, peer):
    reply = peer.ask(MsgType.STATS)
    stats = protocol.stats_of(reply)
    assert stats["tables"]["0"]["rows"] == 4 and stats["workers"] == [0]
    assert stats["bytes_in"] > 0 and stats["bytes_out"] > 0
    assert peer.ask(MsgType.STOP).type == MsgType.ACK
    shard.stop()
    assert not shard._thread.is_alive()


def test_client_surfaces_shard_errors(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(timeout=5) as client:
        table = client.create_table("x", 2, 2)
        with pytest.raises(ValueError, match="expected 4"):
            client.update(table, np.ones(5))
        with pytest.raises(GeePSServerError, match="exists as") as raised:
            # Another worker's view of the table that disagrees.
            client._tables.pop()
            del client._by_name["x"]
            client.create_table("x", 2, 3)
        assert raised.value.code == protocol.ERROR_TABLE_EXISTS


def test_process_shard_stops_on_sigterm(process_cluster):
    cluster = process_cluster(1, 1)
    shard = cluster.shards[0]
    shard.process.send_signal(15)
    assert shard.process.wait(10) == 0


def test_a_bind_to_a_port_briefly_in_use_is_retried(monkeypatch):
    """A restarted shard's port can be taken for a moment (a worker's
    reconnect may get it as its own source port): the shard waits for it,
    within BIND_RETRY_S, and fails naming the address after that."""
    import threading  # noqa: PLC0415

    from keras_geeps.shard import server as shard_module  # noqa: PLC0415

    context = zmq.Context()
    holder = context.socket(zmq.ROUTER)
    holder.bind("tcp://127.0.0.1:0")
    address = holder.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        monkeypatch.setattr(shard_module, "BIND_RETRY_S", 0.3)
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            ShardServer(address, 0, 1, 1)
        monkeypatch.setattr(shard_module, "BIND_RETRY_S", 10.0)
        threading.Timer(0.5, holder.close, kwargs={"linger": 0}).start()
        server = ShardServer(address, 0, 1, 1)
        assert server.address == address
        server._close()
    finally:
        holder.close(linger=0)
        context.term()
