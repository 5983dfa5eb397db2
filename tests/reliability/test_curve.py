"""CURVE: keyed clients work; unkeyed and wrongly keyed ones are refused."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from keras_geeps.auth import ClientKeys
from keras_geeps.client import GeePSClient
from keras_geeps.cluster import ClusterSpec
from keras_geeps.errors import GeePSError
from tests.reliability.keyed import keyed_cluster, worker_keys
from tests.reliability.restarts import (ask_across_a_restart,
                                        counted_to_a_checkpoint,
                                        wait_for_checkpoint)
from tests.worker_threads import run_worker_threads


@pytest.fixture
def curve_cluster(keys):
    cluster = keyed_cluster(keys)
    yield cluster
    cluster.stop()


def test_sealed_workers_sum_exactly_through_reused_buffers(keys):
    """Three keyed workers (threads) on one keyed shard process push 1 MiB
    tables for 12 clocks: the shard seals every session's rows through one
    reused buffer pool and each worker through its own, so a buffer handed
    out while still being sent would fail a tag (a dropped message, a
    stall) or change a sum."""
    curve = worker_keys(keys)
    clocks, results, errors = 12, {}, []

    def work(w, cluster):
        try:
            with cluster.client(w, timeout=30, curve=curve,
                                shared_memory=False) as client:
                table = client.create_table("t", 1024, 256)
                for clk in range(clocks):
                    client.update(table, np.full((1024, 256), w + 1,
                                                 np.float32))
                    client.clock()
                    np.testing.assert_array_equal(
                        client.read(table, clock=clk + 1), 6.0 * (clk + 1))
                results[w] = client.shard_stats()[0]
        except BaseException as exc:  # reported below
            errors.append(exc)

    with keyed_cluster(keys, workers=3) as cluster:
        run_worker_threads(3, lambda w: work(w, cluster))
    assert not errors, errors[0]
    stats = results[0]
    assert stats["errors"] == 0 and stats["sealed_out"] >= 3 * clocks
    assert 0 < stats["seal_buffer_bytes"] <= 32 << 20


def test_rows_waiting_to_be_sealed_are_not_overwritten(keys):
    """Three keyed SSP workers push 16 MiB tables (eight 2 MiB chunks per
    push and session: more than the three a sender lets ZeroMQ hold, even
    on a fast machine): a shard's senders hold chunks back until ZeroMQ
    has sent earlier ones, while the workers run ahead and the clocks
    advance.
    The rows buffer a waiting chunk reads must not be handed out for a
    later clock's sums before it is sealed: every read must be whole (one
    value, a multiple of the per-clock sum 6) and the last one exact."""
    curve = worker_keys(keys)
    clocks, rows, width = 16, 4096, 1024
    errors, seen, stats = [], [], []

    def work(w, cluster):
        try:
            with cluster.client(w, timeout=60, curve=curve, slack=2,
                                shared_memory=False) as client:
                table = client.create_table("t", rows, width)
                delta = np.full((rows, width), w + 1, np.float32)
                for _ in range(clocks):
                    got = client.read(table)
                    seen.append((float(got.min()), float(got.max())))
                    client.update(table, delta)
                    client.clock()
                final = client.read(table, clock=clocks + 2)  # slack 2
                np.testing.assert_array_equal(final, 6.0 * clocks)
                stats.append(client.shard_stats()[0])
        except BaseException as exc:  # reported below
            errors.append(exc)

    with keyed_cluster(keys, workers=3) as cluster:
        run_worker_threads(3, lambda w: work(w, cluster))
    assert not errors, errors[0]
    torn = [(lo, hi) for lo, hi in seen if lo != hi or lo % 6]
    assert not torn, f"{len(torn)} of {len(seen)} reads torn: {torn[:3]}"
    last = max(stats, key=lambda s: s["sealed_out"])
    assert last["sealed_held_back"] > 0  # the senders did pace
    assert last["errors"] == 0


def test_keyed_client_reads_and_writes(keys, curve_cluster):
    curve = worker_keys(keys)
    with curve_cluster.client(0, timeout=10, curve=curve,
                              shared_memory=False) as client:
        table = client.create_table("t", 3, 4, init=np.ones((3, 4)))
        client.update(table, np.ones((3, 4), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table), np.full((3, 4), 2))
        # Reads that wait get the sealed rows opened straight into their
        # buffer; the cache keeps them sealed for a later read. (Over shared
        # memory, rows are read where they lie instead.)
        big = client.create_table("big", 1024, 1024)  # 4 MiB: two chunks
        out = np.empty((1024, 1024), np.float32)
        for clock in range(2, 10):
            client.update(big, np.ones((1024, 1024), np.float32))
            client.clock()
            assert client.read(big, out=out) is out
            np.testing.assert_array_equal(out, clock - 1)
        assert client.stats()["bytes_delivered"] >= big.nbytes
        np.testing.assert_array_equal(client.read(big), out)


def test_a_keyed_worker_that_closes_is_not_taken_for_dead(keys):
    """LEAVE travels sealed like every request: worker 1 closes its
    client, and the shard (--worker-timeout 1) takes its silence for no
    death while worker 0 goes on reading."""
    cluster = keyed_cluster(keys, workers=2,
                            shard_args=["--worker-timeout", "1.0"])
    try:
        clients = [cluster.client(w, timeout=20, curve=worker_keys(keys),
                                  shared_memory=False,
                                  heartbeat_interval=0.2) for w in range(2)]
        tables = [c.create_table("t", 4, 4) for c in clients]
        for client, table in zip(clients, tables):
            client.update(table, np.ones((4, 4), np.float32))
            client.clock()
        clients[1].close()
        time.sleep(2.0)
        np.testing.assert_array_equal(clients[0].read(tables[0]), 2.0)
        stats = clients[0].shard_stats()[0]
        assert stats["left_workers"] == [1] and stats["dead_workers"] == []
        clients[0].close()
    finally:
        cluster.stop()


@pytest.mark.parametrize("who", ["unkeyed", "stranger"])
def test_unkeyed_or_wrongly_keyed_client_is_refused(keys, curve_cluster, who):
    """The HELLO times out, or (once the refused handshake left the socket
    nowhere to queue it) cannot be sent: either way an error naming
    CURVE, within the timeout."""
    curve = None if who == "unkeyed" else worker_keys(keys, "stranger")
    spec = ClusterSpec(curve_cluster.addresses, 1, 0)
    started = time.monotonic()
    with pytest.raises(GeePSError, match="HELLO.*CURVE"):
        GeePSClient(spec, timeout=1.5, curve=curve)
    assert time.monotonic() - started < 5
    stats = curve_cluster.shards[0]
    assert stats.process.poll() is None  # the shard keeps running


def test_a_keyed_client_of_an_unkeyed_shard_is_told_both_ways(
        keys, thread_cluster):
    """A keyed worker's HELLO to a shard that takes no keys times out; its
    error asked only whether the worker's keys were allowed, pointing away
    from the cause."""
    cluster = thread_cluster(1, 1)
    spec = ClusterSpec(cluster.addresses, 1, 0)
    with pytest.raises(GeePSError, match="if it requires none, this "
                                         "worker must use none either"):
        GeePSClient(spec, timeout=1.0, curve=worker_keys(keys))


def test_a_key_list_that_does_not_fit_the_shards_is_named(keys):
    """Shard keys are one for all shards or one per shard: two for one
    shard is refused before anything connects."""
    curve = ClientKeys(keys / "worker.key_secret",
                       [keys / "shard.key", keys / "shard.key"])
    spec = ClusterSpec(["tcp://127.0.0.1:9"], 1, 0)  # (never reached)
    with pytest.raises(ValueError, match="2 shard keys for 1 shards"):
        GeePSClient(spec, timeout=1, curve=curve)


def test_everything_after_hello_travels_sealed(keys, curve_cluster):
    curve = worker_keys(keys)
    with curve_cluster.client(0, timeout=10, curve=curve,
                              shared_memory=False,
                              heartbeat_interval=0) as client:
        table = client.create_table("t", 1024, 256)
        for _ in range(3):
            client.update(table, np.ones((1024, 256), np.float32))
            client.clock()
        np.testing.assert_array_equal(client.read(table, clock=3), 3.0)
        stats = client.shard_stats()[0]
    # Only the HELLO went over CURVE (heartbeats would too); the 1 MiB
    # pushes came sealed.
    assert stats["sealed_in"] >= stats["messages_in"] - 1 >= 6
    assert stats["sealed_out"] >= 4 and stats["errors"] == 0
    # Its sealing buffers: reused, within the pool's bound (32 MiB).
    assert 1 << 20 <= stats["seal_buffer_bytes"] <= 32 << 20


def test_strangers_on_the_data_socket_get_nothing(keys, curve_cluster):
    import zmq  # noqa: PLC0415
    from zmq.utils.monitor import recv_monitor_message  # noqa: PLC0415

    curve = worker_keys(keys)
    with curve_cluster.client(0, timeout=10, curve=curve) as client:
        table = client.create_table("t", 4, 4)
        link = client._io._links[0]
        session = link.channel.session
        token = link.socket.plain_password  # what a sniffer could see
        before = client.shard_stats()[0]["messages_in"]
        context = zmq.Context()
        rng = np.random.default_rng(0)

        def peer(routing_id=None, password=token):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if routing_id is not None:
                sock.setsockopt(zmq.ROUTING_ID, routing_id)
            if password is not None:
                sock.plain_username, sock.plain_password = \
                    session.hex().encode(), password
            monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED |
                zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            sock.connect(curve_cluster.shards[0].data_address)
            return sock, monitor

        def handshake(monitor):
            assert monitor.poll(5000), "no handshake event"
            return recv_monitor_message(monitor)["event"]

        try:
            peers = {
                "stranger": peer(password=None),  # no credentials at all
                "guesser": peer(password=b"0" * len(token)),
                # the token the worker's connection spent, seen on the
                # wire: under its routing id, and under another
                "hijacker": peer(routing_id=session),
                "sniffer": peer(),
            }
            events = {name: handshake(monitor)
                      for name, (_, monitor) in peers.items()
                      if name != "stranger"}  # (its ZAP: no PLAIN at all)
            assert events == dict.fromkeys(
                ("guesser", "hijacker", "sniffer"),
                zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            for _ in range(300):
                frames = [bytes(rng.integers(0, 256, rng.integers(0, 64),
                                             np.uint8))
                          for _ in range(rng.integers(1, 5))]
                for sock, _ in peers.values():
                    try:
                        sock.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:  # nothing queued any more
                        pass
            for sock, _ in peers.values():
                assert not sock.poll(300)
        finally:
            context.destroy(linger=0)
        # The worker's own connection, which spent the token, goes on.
        client.update(table, np.ones((4, 4), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table, clock=1), 1.0)
        stats = client.shard_stats()[0]
        assert stats["messages_in"] - before <= 20  # theirs: none


class _HandSession:
    """A sealed session driven by hand: HELLO over CURVE (keys of
    "worker"), then requests sealed on the shard's data socket, each under
    the next sequence number. `hello()` starts a new session (the worker's
    sequence numbers go on). `data_options`: socket options of the data
    socket."""

    def __init__(self, keys, shard, worker=0, data_options=()):
        import zmq  # noqa: PLC0415
        self._zmq, self._keys, self._shard = zmq, keys, shard
        self.worker = worker
        self._data_options = data_options
        self.context = zmq.Context()
        self.seqs = iter(range(1, 10 ** 6))
        self.main = self.data = self.channel = None
        self.hello()

    def hello(self):
        from keras_geeps import protocol, seal  # noqa: PLC0415
        from keras_geeps.protocol import Message, MsgType  # noqa: PLC0415
        zmq = self._zmq
        if self.main is None:
            self.main = self.context.socket(zmq.DEALER)
            self.main.setsockopt(zmq.LINGER, 0)
            worker_keys(self._keys).apply(self.main, 0)
            self.main.connect(self._shard.address)
        self.main.send_multipart(protocol.encode(Message(
            MsgType.HELLO, worker=self.worker, seq=next(self.seqs), meta={
                "num_workers": 1, "num_shards": 1, "incarnation": 0})))
        assert self.main.poll(10000), "no WELCOME"
        welcome = protocol.decode(self.main.recv_multipart())
        assert welcome.type == MsgType.WELCOME, welcome.meta
        port, session, c2s, s2c, token = welcome.meta["sealed"]
        if self.data is not None:
            self.data.close()
        self.data = self.context.socket(zmq.DEALER)
        self.data.setsockopt(zmq.LINGER, 0)
        for option, value in self._data_options:
            self.data.setsockopt(option, value)
        self.data.setsockopt(zmq.ROUTING_ID, bytes.fromhex(session))
        self.data.plain_username, self.data.plain_password = (
            session.encode(), token.encode())
        self.data.connect(f"{self._shard.address.rsplit(':', 1)[0]}:{port}")
        self.session = bytes.fromhex(session)
        self.channel = seal.Channel(self.session, bytes.fromhex(c2s),
                                    bytes.fromhex(s2c))

    def sealed(self, kind, sealer=None, seq=None, **fields):
        """A request's sealed frames (bytes), under the next sequence
        number unless `seq`; sealed by `sealer` (a `seal.Channel`) if
        given."""
        from keras_geeps import protocol  # noqa: PLC0415
        from keras_geeps.protocol import Message  # noqa: PLC0415
        message = Message(kind, worker=self.worker,
                          seq=next(self.seqs) if seq is None else seq,
                          **fields)
        return [bytes(f) for f in (sealer or self.channel).seal(
            protocol.encode(message))]

    def answers(self, timeout_ms=500):
        """The sealed messages that come within `timeout_ms` of the last."""
        from keras_geeps import protocol  # noqa: PLC0415
        got = []
        while self.data.poll(timeout_ms):
            got.append(protocol.decode(self.channel.open(
                self.data.recv_multipart(copy=False))))
        return got

    def refusal(self):
        """The next message, in the clear: a refusal of the session."""
        from keras_geeps import protocol  # noqa: PLC0415
        assert self.data.poll(5000), "no answer"
        return protocol.decode(self.data.recv_multipart())

    def close(self):
        self.context.destroy(linger=0)


def _keyed_stats(keys, address):
    """A keyed shard's STATS, asked over CURVE with no HELLO (as `keras-geeps
    stats` does)."""
    import zmq  # noqa: PLC0415

    from keras_geeps import protocol  # noqa: PLC0415
    from keras_geeps.protocol import Message, MsgType  # noqa: PLC0415
    with zmq.Context() as context, context.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        worker_keys(keys).apply(sock, 0)
        sock.connect(address)
        sock.send_multipart(protocol.encode(Message(MsgType.STATS, seq=1)))
        assert sock.poll(10000), "no STATS reply"
        return protocol.stats_of(protocol.decode(sock.recv_multipart()))


@pytest.mark.parametrize("request_type", ["READ", "DECLARE"])
def test_sealed_replies_a_worker_never_reads_are_bounded(keys, request_type):
    """A keyed worker's session sends READs (or DECLAREs) of a 64 KB table
    and reads nothing. A sealed reply under 64 KiB counted as sent once
    sealed: past MAX_UNSENT_READS nothing was refused (nor were a
    DECLARE's rows held back), and 3000 sealed copies (+187 MB) queued
    outside max_table_bytes. Such replies are now tracked until ZeroMQ
    sent them, as on the plain socket."""
    import zmq  # noqa: PLC0415

    from keras_geeps.protocol import MsgType  # noqa: PLC0415
    from tests import rss_bytes  # noqa: PLC0415

    width = 16_000  # 64,000 bytes: below pyzmq's copy threshold
    meta = {"name": "t", "rows": 1, "width": width, "dtype": "float32",
            "row_start": 0, "row_end": 1}
    cluster = keyed_cluster(keys, shard_args=[
        "--max-table-bytes", str(1 << 20), "--no-shared-memory"])
    hand = _HandSession(keys, cluster.shards[0], data_options=[
        (zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)])
    try:
        hand.data.send_multipart(hand.sealed(
            MsgType.CREATE, table=0, meta=dict(meta, chunk_row=0),
            arrays=[np.ones((1, width), np.float32)]))
        assert [m.type for m in hand.answers()] == [MsgType.ACK]
        pid = cluster.shards[0].process.pid
        before = rss_bytes(pid)
        sent = 3000
        request = dict(clk=0) if request_type == "READ" else dict(meta=meta)
        for _ in range(sent):
            hand.data.send_multipart(hand.sealed(
                getattr(MsgType, request_type), table=0, **request))
        deadline = time.monotonic() + 60
        while (stats := _keyed_stats(keys, cluster.addresses[0]))[
                "messages_in"] < sent + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rss_bytes(pid) - before < sent * width * 4 // 8
        got = hand.answers(2000)  # it reads at last: each one answered
        answered = [m for m in got if m.type != MsgType.PUSH]
        assert len(answered) == sent
        refusals = [m for m in answered if m.type == MsgType.ERROR]
        assert len(refusals) == stats["errors"]
        if request_type == "READ":  # refused past MAX_UNSENT_READS
            assert stats["errors"] >= sent // 2, stats["errors"]
            assert "not sent yet (it reads none of them)" in \
                refusals[0].meta["error"]
        else:  # answered, the rows not sent again while the last wait
            assert stats["errors"] == 0
            assert stats["pushes_skipped"] >= sent // 2
    finally:
        hand.close()
        cluster.stop()


def test_forged_messages_in_a_live_session_are_dropped(keys, curve_cluster):
    """A session driven by hand (HELLO over CURVE, then the sealed data
    socket): messages sealed with a guessed key, replayed, tampered with or
    cut short are dropped, each counted as an error and none answered,
    while the session's own requests before and after are served. A
    genuine message that follows one that was dropped tells the shard it
    lost it: the session ends (hello_required, in the clear)."""
    from keras_geeps import protocol, seal  # noqa: PLC0415
    from keras_geeps.protocol import MsgType  # noqa: PLC0415

    hand = _HandSession(keys, curve_cluster.shards[0])
    try:
        def errors():
            hand.data.send_multipart(hand.sealed(MsgType.STATS))
            (reply,) = hand.answers()
            return protocol.stats_of(reply)["errors"]

        before = errors()
        guessed = seal.Channel(hand.session, b"k" * 32, b"k" * 32)
        replayed = hand.sealed(MsgType.STATS)
        hand.data.send_multipart(replayed)
        assert len(hand.answers()) == 1
        forged = [hand.sealed(MsgType.STATS, sealer=guessed), replayed]
        for frames in forged * 25:
            hand.data.send_multipart(frames)
        assert hand.answers() == []  # nothing forged is answered
        assert errors() == before + len(forged) * 25
        # Genuine messages altered on the way: a tag off, a frame cut.
        tampered = hand.sealed(MsgType.STATS)
        tampered[-1] = tampered[-1][:-1] + bytes([tampered[-1][-1] ^ 1])
        for frames in [tampered, hand.sealed(MsgType.STATS)[:-1]] * 25:
            hand.data.send_multipart(frames)
        assert hand.answers() == []
        # The next genuine one shows two were lost: the session is over.
        for why in ("the session lost messages", "unknown session"):
            hand.data.send_multipart(hand.sealed(MsgType.STATS))
            refusal = hand.refusal()
            assert refusal.type == MsgType.ERROR
            assert refusal.meta["code"] == protocol.ERROR_HELLO_REQUIRED
            assert why in refusal.meta["error"]
    finally:
        hand.close()


@pytest.mark.parametrize("written", [False, True])
def test_rows_that_do_not_open_change_nothing_and_are_taken_when_resent(
        keys, curve_cluster, written):
    """An UPDATE whose header opens but whose rows frame was altered (the
    rows are opened straight into the clock's rows, or, where a row was
    written already this clock, in place first) leaves the table as it
    was: the session ends at once (hello_required) and the same sequence
    number, resent over a new session, is applied, once."""
    from keras_geeps import protocol  # noqa: PLC0415
    from keras_geeps.protocol import MsgType  # noqa: PLC0415

    rows, width = 64, 1024  # 256 KiB: a frame ZeroMQ does not copy
    hand = _HandSession(keys, curve_cluster.shards[0])
    try:
        init = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
        hand.data.send_multipart(hand.sealed(
            MsgType.CREATE, table=0, arrays=[init],
            meta={"name": "t", "rows": rows, "width": width,
                  "dtype": "float32", "row_start": 0, "row_end": rows,
                  "chunk_row": 0}))
        assert [m.type for m in hand.answers()] == [MsgType.ACK]
        delta = np.full((rows, width), 0.5, np.float32)
        update = {"table": 0, "clk": 0, "arrays": [delta],
                  "meta": {"chunk_row": 0}}
        if written:  # rows [8, 16) written already this clock
            hand.data.send_multipart(hand.sealed(
                MsgType.UPDATE, table=0, clk=0, arrays=[delta[8:16]],
                meta={"chunk_row": 8}))
        seq = next(hand.seqs)
        tampered = hand.sealed(MsgType.UPDATE, seq=seq, **update)
        rows_frame = bytearray(tampered[-1])
        rows_frame[12345] ^= 4
        tampered[-1] = bytes(rows_frame)
        hand.data.send_multipart(tampered)
        refusal = hand.refusal()
        assert refusal.meta["code"] == protocol.ERROR_HELLO_REQUIRED
        assert "did not open" in refusal.meta["error"]
        hand.hello()
        hand.data.send_multipart(hand.sealed(MsgType.UPDATE, seq=seq,
                                             **update))
        hand.data.send_multipart(hand.sealed(MsgType.CLOCK, table=0, clk=0))
        hand.data.send_multipart(hand.sealed(MsgType.READ, table=0, clk=1))
        got = {m.type: m for m in hand.answers()}
        expected = init + delta
        expected[8:16] += delta[8:16] if written else 0
        np.testing.assert_array_equal(got[MsgType.ROWS].arrays[0], expected)
        hand.data.send_multipart(hand.sealed(MsgType.STATS))
        (reply,) = hand.answers()
        stats = protocol.stats_of(reply)
        assert stats["updates_applied"] == 1 + written
        assert stats["duplicates"] == 0
    finally:
        hand.close()


@pytest.mark.parametrize("same_data_port", [True, False])
def test_a_restarted_curve_shard_recovers_with_nothing_lost(
        keys, same_data_port):
    from keras_geeps.launch import ShardProcess  # noqa: PLC0415

    cluster = keyed_cluster(keys, checkpoint=True)
    curve = worker_keys(keys)
    try:
        with cluster.client(0, timeout=20, curve=curve,
                            heartbeat_interval=0.2) as client:
            table = client.create_table("t", 64, 64)
            for clk in range(10):
                client.read(table)
                client.update(table, np.ones((64, 64), np.float32))
                client.clock()
                if clk == 6:
                    # (restored from a checkpoint, not created again: the
                    # writer may lag on a loaded machine)
                    wait_for_checkpoint(client, table, 6)
                    old = cluster.shards[0]
                    old.kill()
                    # As the launcher restarts one (the same data port), or
                    # by hand without --data-bind: a new data port, which
                    # the CURVE heartbeat tells the worker.
                    if same_data_port:
                        cluster.shards[0] = old.restart(["--restore"])
                    else:
                        cluster.shards[0] = ShardProcess(
                            *old.args[:3], [*old.args[3], "--restore"],
                            output=sys.stderr, bind=old.address)
                        assert cluster.shards[0].data_address != \
                            old.data_address
            np.testing.assert_array_equal(client.read(table, clock=10),
                                          10.0)
            stats = client.shard_stats()[0]
            assert stats["restored_clock"] >= 0 and stats["sealed_in"] > 0
    finally:
        cluster.stop()


def test_a_request_dropped_with_the_old_sealed_link_is_sent_again(keys):
    """A STATS request queued on the sealed link to a stopped, then killed
    shard is dropped with that link when the restored shard welcomes the
    worker; it is sent again on the new one: answered before the timeout."""
    cluster = keyed_cluster(keys, checkpoint=True)
    try:
        with cluster.client(0, timeout=60, curve=worker_keys(keys),
                            heartbeat_interval=0.2) as client:
            table = counted_to_a_checkpoint(client)
            stats, seconds = ask_across_a_restart(client, cluster,
                                                  client.shard_stats)
            assert seconds < 30  # not the 60 s timeout
            assert stats[0]["restored_clock"] == 2
            client.update(table, np.ones((4, 4), np.float32))
            client.clock()
            np.testing.assert_array_equal(client.read(table), 3.0)
    finally:
        cluster.stop()


def test_a_session_speaks_for_its_own_worker_only(keys):
    from keras_geeps.client.connection import Future  # noqa: PLC0415
    from keras_geeps.protocol import Message, MsgType  # noqa: PLC0415

    cluster = keyed_cluster(keys, workers=2)
    try:
        mine = worker_keys(keys)
        with cluster.client(0, timeout=10, curve=mine) as client:
            errors = []
            future = Future(lambda m, e: errors.append(e))
            message = Message(MsgType.STATS, worker=1, seq=10 ** 6)
            client._io.send(0, message, future)
            assert future.event.wait(10)
            assert "session sent a request as worker 1" in str(errors[0])
    finally:
        cluster.stop()


def test_admin_commands_reach_curve_shards_with_keys(keys, curve_cluster):
    address = curve_cluster.addresses[0]
    cli = [sys.executable, "-m", "keras_geeps"]
    keyed = ["--curve-secret-key", str(keys / "worker.key_secret"),
             "--curve-server-key", str(keys / "shard.key")]
    result = subprocess.run(cli + ["stats", "--shards", address] + keyed,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert '"shard_id": 0' in result.stdout
    result = subprocess.run(cli + ["stats", "--shards", address,
                                   "--timeout", "1"],
                            capture_output=True, text=True, timeout=60)
    # (a timeout, or a refused handshake that left nowhere to send)
    assert result.returncode != 0 and "CURVE" in result.stderr
    result = subprocess.run(cli + ["stop", "--shards", address] + keyed,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert curve_cluster.shards[0].process.wait(10) == 0


def test_a_key_named_for_a_worker_speaks_for_that_worker_only(keys):
    from keras_geeps.errors import GeePSServerError  # noqa: PLC0415

    for name in ("worker0", "worker1"):  # bound: allowed/worker<N>.key
        subprocess.run([sys.executable, "-m", "keras_geeps", "keygen",
                        str(keys), name], check=True, capture_output=True)
        (keys / "allowed" / f"{name}.key").write_bytes(
            (keys / f"{name}.key").read_bytes())
    cluster = keyed_cluster(keys, workers=2)
    try:
        spec = ClusterSpec(cluster.addresses, 2, 1)
        zero = worker_keys(keys, "worker0")
        with pytest.raises(GeePSServerError,
                           match="bound to worker 0.*as worker 1"):
            GeePSClient(spec, timeout=10, curve=zero)
        one = worker_keys(keys, "worker1")
        GeePSClient(spec, timeout=10, curve=one).close()  # welcomed
        # An unbound allowed key (allowed/worker.key) may be any worker.
        anyone = worker_keys(keys)
        for worker in (0, 1):
            GeePSClient(ClusterSpec(cluster.addresses, 2, worker),
                        timeout=10, curve=anyone).close()
    finally:
        cluster.stop()


def test_sealed_updates_wait_their_turn_with_deterministic_sums(keys):
    """Workers 1 and 2 push and finish each clock before worker 0 pushes:
    with --deterministic-sums their sealed rows are opened (and checked)
    as they come and held, then added after worker 0's, so the sums equal
    numpy's in worker order exactly."""
    curve = worker_keys(keys)
    clocks, shape = 3, (256, 256)
    rng = np.random.default_rng(5)
    deltas = (rng.standard_normal((clocks, 3) + shape) * 10.0 ** rng.integers(
        -3, 7, (clocks, 3, shape[0], 1))).astype(np.float32)
    finished = [threading.Barrier(3) for _ in range(clocks)]
    results, errors = {}, []

    def work(w, cluster):
        try:
            with cluster.client(w, timeout=30, curve=curve,
                                shared_memory=False) as client:
                table = client.create_table("t", *shape)
                for clk in range(clocks):
                    if w == 0:  # the others have finished the clock
                        finished[clk].wait(timeout=30)
                    client.update(table, deltas[clk, w])
                    client.clock()
                    if w != 0:
                        client.shard_stats()  # they have come
                        finished[clk].wait(timeout=30)
                    results[w, clk] = client.read(table, clock=clk + 1)
                results[w] = client.shard_stats()[0]
        except BaseException as exc:  # reported below
            errors.append(exc)

    with keyed_cluster(keys, workers=3,
                       shard_args=["--deterministic-sums"]) as cluster:
        run_worker_threads(3, lambda w: work(w, cluster))
    assert not errors, errors[0]
    expected = np.zeros(shape, np.float32)
    for clk in range(clocks):
        for w in range(3):
            expected = expected + deltas[clk, w]
        for w in range(3):
            np.testing.assert_array_equal(results[w, clk], expected)
    stats = results[0]
    assert stats["errors"] == 0 and stats["updates_held"] >= 2 * clocks


@pytest.mark.parametrize("stray", ["not a key\n", None])
def test_an_allowed_clients_folder_that_would_admit_nobody_is_refused(
        keys, stray):
    """pyzmq only logs a `.key` file it cannot load, and then allows no
    client at all: a shard started with a stray file there (or with no key
    at all) served, and every worker timed out. It now refuses to start,
    naming the file."""
    allowed = keys / "allowed"
    if stray is None:
        (allowed / "worker.key").unlink()
        problem = "holds no .key file"
    else:
        (allowed / "notes.key").write_text(stray)
        problem = "notes.key is not a CURVE key file"
    result = subprocess.run(
        [sys.executable, "-m", "keras_geeps", "shard", "--bind",
         "tcp://127.0.0.1:0", "--shard-id", "0", "--num-shards", "1",
         "--num-workers", "1", "--curve-secret-key",
         str(keys / "shard.key_secret"), "--curve-allowed-clients",
         str(allowed)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert problem in result.stderr, result.stderr
