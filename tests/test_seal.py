"""The sealed data channel: framing against tampering, reused buffers,
paced sending."""

import contextlib
import itertools
import sys
import time
import types

import numpy as np
import pytest
import zmq

from keras_geeps import seal


@pytest.fixture
def pair():
    keys = seal.new_session()
    worker = seal.Channel(keys["session"], keys["c2s"], keys["s2c"])
    shard = seal.Channel(keys["session"], keys["s2c"], keys["c2s"])
    return worker, shard


def _frames():
    return [b"a header", np.arange(1000, dtype=np.float32),
            np.zeros((0,), np.uint8)]


_ENDPOINTS = itertools.count()


def _inproc_pair(context):
    """Two connected PAIR sockets over inproc (sender, receiver)."""
    # (a closed socket's inproc name is freed asynchronously: a new name)
    endpoint = f"inproc://test-seal-{next(_ENDPOINTS)}"
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    a.bind(endpoint)
    b.connect(endpoint)
    return a, b


def _received(frames):
    """`frames` as ZeroMQ hands them to a receiver (zmq.Frame, no copy)."""
    a, b = _inproc_pair(zmq.Context.instance())
    with a, b:
        a.send_multipart(frames)
        return b.recv_multipart(copy=False)


def test_round_trip_in_both_directions(pair):
    worker, shard = pair
    for sender, receiver in ((worker, shard), (shard, worker)) * 2:
        sealed = sender.seal(_frames())
        assert len(sealed[4]) == 4000 + seal.TAG_BYTES
        opened = receiver.open(sealed)
        assert bytes(opened[0]) == b"a header"
        np.testing.assert_array_equal(opened[1].view(np.float32),
                                      np.arange(1000, dtype=np.float32))
        assert opened[2].nbytes == 0
        # Not a received frame: opened into a new (aligned) buffer, the
        # sealed one untouched.
        assert opened[1].ctypes.data % 64 == 0
        assert not np.shares_memory(opened[1], sealed[4])


def test_received_frames_open_in_place(pair):
    worker, shard = pair
    frames = _received(worker.seal(_frames()))
    opened = shard.open(frames)
    np.testing.assert_array_equal(opened[1].view(np.float32),
                                  np.arange(1000, dtype=np.float32))
    # Where ZeroMQ put it, as plain frames are used.
    assert opened[1].ctypes.data == np.frombuffer(
        frames[4].buffer, np.uint8).ctypes.data
    # A forged received frame fails and is not used.
    forged = _received(worker.seal(_frames()))
    forged[4].buffer[7] ^= 1
    with pytest.raises(seal.SealError, match="authenticate"):
        shard.open(forged)
    # It was not taken: the next genuine one tells it is missing.
    with pytest.raises(seal.SealGap):
        shard.open(_received(worker.seal(_frames())))


def test_read_only_frames_open_into_aligned_buffers(pair):
    worker, shard = pair
    sealed = [bytes(frame) for frame in worker.seal(_frames())]
    opened = shard.open(sealed)
    np.testing.assert_array_equal(opened[1].view(np.float32),
                                  np.arange(1000, dtype=np.float32))
    assert opened[1].ctypes.data % 64 == 0  # DLPack-ready
    assert bytes(shard.open([bytes(f) for f in worker.seal(_frames())])[0]) \
        == b"a header"


def test_deferred_frames_open_where_the_caller_says(pair):
    """With defer=True only the header is opened (and the counter taken);
    a rows frame opens into a caller's buffer, keeping its sealed bytes,
    then again in place: the same rows each time."""
    worker, shard = pair
    frames = _received(worker.seal(_frames()))
    header, rows, empty = shard.open(frames, defer=True)
    assert bytes(header) == b"a header"
    assert shard.received == worker.sent
    assert isinstance(rows, seal.SealedFrame) and rows.nbytes == 4000
    assert rows.sealed_view.nbytes == 4000
    into = np.empty(1000, np.float32)
    rows.open_into(into)
    np.testing.assert_array_equal(into, np.arange(1000, dtype=np.float32))
    in_place = rows.open()  # the sealed bytes were kept for this
    np.testing.assert_array_equal(in_place.view(np.float32), into)
    assert in_place.ctypes.data == np.frombuffer(
        frames[4].buffer, np.uint8).ctypes.data
    assert rows.open() is in_place  # once
    again = np.zeros(1000, np.float32)
    rows.open_into(again)  # after an open in place: a copy of the rows
    np.testing.assert_array_equal(again, into)
    assert empty.open().nbytes == 0
    with pytest.raises(ValueError, match="opens into 4000 bytes, not 3996"):
        rows.open_into(np.empty(999, np.float32))


def test_a_deferred_frame_that_was_tampered_with_never_opens(pair):
    worker, shard = pair
    frames = _received(worker.seal(_frames()))
    frames[4].buffer[0] ^= 1
    _, rows, _ = shard.open(frames, defer=True)  # the header is genuine
    with pytest.raises(seal.SealError, match="frame 1 does not authenticate"):
        rows.open_into(np.empty(1000, np.float32))
    with pytest.raises(seal.SealError, match="frame 1 does not authenticate"):
        rows.open()
    # The frame cannot be moved to another message or place either.
    sealed = worker.seal(_frames() + [np.ones(1000, np.float32)])
    moved = sealed[:4] + [sealed[6], sealed[5], sealed[4]]  # 1 <-> 3
    _, rows, _, last = shard.open(moved, defer=True)
    with pytest.raises(seal.SealError, match="authenticate"):
        rows.open()
    with pytest.raises(seal.SealError, match="authenticate"):
        last.open()


def test_the_ciphertext_hides_the_rows(pair):
    worker, _ = pair
    rows = np.full(4096, 7, np.uint8)
    body = np.asarray(worker.seal([b"h", rows])[4])
    assert body.nbytes == rows.nbytes + seal.TAG_BYTES
    # 7 would appear ~16 times by chance; a plain copy has it 4096 times.
    assert np.count_nonzero(body[:rows.nbytes] == 7) < 100


def test_seal_buffers_in_flight_on_a_socket_are_not_reused(pair):
    worker, shard = pair
    rows = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect("tcp://127.0.0.1:9")  # nobody there: the frame waits
    try:
        sealed = worker.seal([b"h", rows])
        address = sealed[4].ctypes.data
        sock.send_multipart(sealed, copy=False)
        del sealed  # only pyzmq holds it now
        again = worker.seal([b"h", rows])
        assert again[4].ctypes.data != address
        del again
    finally:
        sock.close(linger=0)
        context.term()
    # libzmq let go of it: reused (pyzmq releases it from its own thread).
    for _ in range(100):
        reused = worker.seal([b"h", rows])
        if reused[4].ctypes.data == address:
            break
        del reused
        time.sleep(0.01)
    else:
        raise AssertionError("the released buffer was never reused")


def test_seal_buffers_are_reused_only_when_nothing_holds_them(pair):
    worker, shard = pair
    rows = np.arange(1 << 16, dtype=np.float32)  # 256 KiB: pooled
    first = worker.seal([b"h", rows])
    held = memoryview(first[4])  # as ZeroMQ holds a frame until it is sent
    kept = bytes(first[4])
    del first
    second = worker.seal([b"h", rows])
    assert second[4].ctypes.data != np.asarray(held).ctypes.data
    assert bytes(held) == kept  # not overwritten while held
    address = second[4].ctypes.data
    del second
    third = worker.seal([b"h", rows])
    assert third[4].ctypes.data == address  # free again: reused
    # A slice keeps the whole buffer from reuse.
    part = third[4][100:200]
    del third
    fourth = worker.seal([b"h", rows])
    assert fourth[4].ctypes.data != address
    del part
    # Never more than the pool's limit kept.
    frames = [worker.seal([b"h", rows]) for _ in range(200)]
    assert 0 < worker._buffers.nbytes <= worker._buffers.max_bytes
    assert len({f[4].ctypes.data for f in frames}) == 200
    # Small frames (pyzmq copies them) are not pooled.
    del frames
    pool = seal.Buffers()
    small = pool.take(100)
    del small
    assert pool.nbytes == 0
    shard.received = worker.sent  # (the 200 above were never sent)
    opened = shard.open(worker.seal([b"h", rows]))
    np.testing.assert_array_equal(opened[1].view(np.float32), rows)


def _flip(frame, at):
    mutated = np.frombuffer(bytes(frame), np.uint8).copy()
    mutated[at] ^= 1
    return mutated


@pytest.mark.parametrize("tamper,why", [
    (lambda f: f[:3] + [_flip(f[3], 0)] + f[4:], "authenticate"),
    (lambda f: f[:3] + [_flip(f[4], -1)] + f[4:], "authenticate"),  # tag
    (lambda f: f[:3] + [f[4], f[3]] + f[5:], "authenticate"),  # reordered
    (lambda f: f[:-1], "authenticate"),  # a frame dropped
    (lambda f: f + [f[-1]], "authenticate"),  # a frame added
    (lambda f: f[:2] + [(7).to_bytes(8, "little")] + f[3:], "authenticate"),
    (lambda f: [f[0], b"Sother!!"] + f[2:], "another session"),
    (lambda f: [b"XX1"] + f[1:], "not a sealed"),
    (lambda f: f[:3] + [b"short"] + f[4:], "shorter than a tag"),
])
def test_tampered_messages_do_not_open(pair, tamper, why):
    worker, shard = pair
    with pytest.raises(seal.SealError, match=why) as raised:
        shard.open(tamper(worker.seal(_frames())))
    assert not isinstance(raised.value, seal.SealGap)
    # Nothing was taken from it: the next genuine message tells that one
    # is missing, and a resend of the same counter would open.
    with pytest.raises(seal.SealGap):
        shard.open(worker.seal(_frames()))
    assert shard.received == 0


def test_a_message_without_frames_cannot_move_the_counter(pair):
    worker, shard = pair
    forged = [seal.MAGIC, worker.session, (2 ** 64 - 1).to_bytes(8, "little")]
    with pytest.raises(seal.SealError, match="not a sealed"):
        shard.open(forged)
    cut = worker.seal(_frames())[:3]  # a genuine one cut to its counter
    with pytest.raises(seal.SealError, match="not a sealed"):
        shard.open(cut)
    assert shard.received == 0
    # The genuine one it was cut from is missing: the next tells.
    with pytest.raises(seal.SealGap):
        shard.open(worker.seal(_frames()))
    with pytest.raises(ValueError):
        worker.seal([])


def test_replayed_and_reordered_messages_do_not_open(pair):
    worker, shard = pair
    first, second = worker.seal(_frames()), worker.seal(_frames())
    shard.open(first)
    shard.open(second)
    for again in (first, second):
        with pytest.raises(seal.SealError, match="not above"):
            shard.open(again)


def test_a_lost_message_is_told_by_the_next(pair):
    """A genuine message whose counter skips one raises SealGap and is not
    taken: the message in between is gone (a connection that broke)."""
    worker, shard = pair
    shard.open(worker.seal(_frames()))
    worker.seal(_frames())  # lost on the way
    third = worker.seal(_frames())
    with pytest.raises(seal.SealGap, match="counter 3 follows 1: 1 message"):
        shard.open(third)
    assert shard.received == 1
    # A forged "gap" does not authenticate: it cannot end a session.
    forged = worker.seal(_frames())
    forged[3] = _flip(forged[3], 0)
    with pytest.raises(seal.SealError, match="authenticate"):
        shard.open(forged)


def test_the_other_directions_key_does_not_open(pair):
    worker, _ = pair
    with pytest.raises(seal.SealError, match="authenticate"):
        worker.open(worker.seal(_frames()))  # c2s sealed, s2c expected


@contextlib.contextmanager
def _inproc_sender(channel, in_flight):
    """A `Sender` of `channel` on a PAIR socket over inproc, and the PAIR
    that receives: ZeroMQ holds what is sent (no copy) until the receiver
    has received it and let go of it."""
    context = zmq.Context()
    try:
        a, b = _inproc_pair(context)
        yield seal.Sender(channel, lambda frames, track: a.send_multipart(
            frames, copy=False, track=track), in_flight=in_flight), b
    finally:
        context.destroy(linger=0)


def _receive(sock, channel, sender, count):
    """`count` messages from `sock`, opened by `channel` (header bytes,
    then float32 copies of the other frames), pumping `sender` as its
    owner's loop would while nothing arrives."""
    received, deadline = [], time.monotonic() + 20
    while len(received) < count:
        assert time.monotonic() < deadline, f"got {len(received)}"
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            sender.pump()  # as the owner's loop does every PACE_S
            time.sleep(0.001)
            continue
        opened = channel.open(frames)
        received.append([bytes(opened[0])] + [
            o.view(np.float32).copy() for o in opened[1:]])
        del frames, opened  # ZeroMQ lets go: the next one is sealed
    return received


def test_a_sender_seals_only_a_few_large_messages_ahead(pair):
    worker, shard = pair
    with _inproc_sender(worker, in_flight=3) as (sender, b):
        messages = [[f"h{i}".encode(), np.full(1 << 16, i, np.float32)]
                    for i in range(10)]  # 256 KiB each: large
        queued = [sender.send(m) for m in messages]
        # Three went to ZeroMQ, which holds them (nobody received them);
        # the rest wait, unsealed, their frames still read later.
        assert [q.done for q in queued] == [True] * 3 + [False] * 7
        assert sender.waiting == 7 and not sender.pump()
        # A small message waits its turn too: order is kept.
        last = sender.send([b"small"])
        assert not last.done and sender.waiting == 8
        received = _receive(b, shard, sender, 11)
        assert sender.waiting == 0 and all(q.done for q in queued + [last])
        for (header, *rows), message in zip(received, messages):
            assert header == message[0]
            np.testing.assert_array_equal(rows[0], message[1])
        assert received[-1] == [b"small"]


def test_small_messages_are_not_held_back(pair):
    worker, shard = pair
    sent = []
    sender = seal.Sender(worker, lambda frames, track: sent.append(frames),
                         in_flight=1)
    for i in range(50):  # no tracker for small ones: all go at once
        assert sender.send([b"ack", np.arange(i, dtype=np.uint8)]).done
    assert sender.waiting == 0 and len(sent) == 50
    assert [bytes(shard.open(f)[0]) for f in sent] == [b"ack"] * 50


def test_a_closed_sender_drops_what_waits(pair):
    worker, _ = pair
    with _inproc_sender(worker, in_flight=1) as (sender, _):
        rows = np.zeros(1 << 16, np.float32)
        queued = [sender.send([b"h", rows]) for _ in range(4)]
        assert sender.waiting == 3 and not queued[1].done
        sender.close()  # its session is gone: nothing reads `rows` now
        assert sender.waiting == 0 and all(q.done for q in queued)
        assert sender.pump()


def test_a_stalled_reader_is_looked_at_less_often(pair, monkeypatch):
    worker, _ = pair
    now = [1000.0]  # seal's clock, moved by hand (no stall can move it)
    monkeypatch.setattr(seal, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], sleep=time.sleep))
    with _inproc_sender(worker, in_flight=1) as (sender, _):
        assert seal.pump_all([sender]) is None  # nothing waits
        rows = np.zeros(1 << 16, np.float32)
        for _ in range(3):
            sender.send([b"h", rows])
        now[0] += seal.STALLED_S * 0.5
        assert seal.pump_all([sender]) == seal.PACE_S
        now[0] += seal.STALLED_S * 1.5  # nobody reads: nothing moves
        assert seal.pump_all([sender]) == seal.STALLED_PACE_S
        sender.close()
        assert seal.pump_all([sender]) is None


def test_rows_a_sender_holds_back_stay_out_of_the_shards_pool(pair):
    """A shard retires a rows buffer with the trackers of its sends; for a
    sealed session those are `Queued`s: the buffer is not handed out for
    new sums while a chunk of it still waits to be sealed."""
    from keras_geeps.shard.tables import BufferPool  # noqa: PLC0415

    worker, shard = pair
    pool = BufferPool((256, 256), np.dtype(np.float32))
    rows = pool.get()
    rows[:] = 1.0
    with _inproc_sender(worker, in_flight=1) as (sender, b):
        queued = [sender.send([b"h", rows[:128]]),
                  sender.send([b"h", rows[128:]])]
        assert queued[0].done and not queued[1].done
        pool.put(rows, queued)
        other = pool.get()  # not `rows`: a chunk of it waits
        assert not np.shares_memory(other, rows)
        other[:] = 2.0
        pool.put(other)
        for _, chunk in _receive(b, shard, sender, 2):
            np.testing.assert_array_equal(chunk, 1.0)
        assert all(q.done for q in queued)
        assert pool.get() is rows  # sealed and sent: reusable


def test_module_example():
    import doctest  # noqa: PLC0415
    assert doctest.testmod(seal).failed == 0


def test_without_pyaegis_keys_fail_naming_the_extra(monkeypatch, tmp_path):
    from keras_geeps.auth import ClientKeys, keygen  # noqa: PLC0415
    from keras_geeps.client import GeePSClient  # noqa: PLC0415
    from keras_geeps.cluster import ClusterSpec  # noqa: PLC0415

    keygen(tmp_path, "shard")
    keygen(tmp_path, "worker")
    keys = ClientKeys(tmp_path / "worker.key_secret", tmp_path / "shard.key")
    monkeypatch.setitem(sys.modules, "pyaegis._aegis_ffi", None)
    with pytest.raises(ImportError, match=r"keras-geeps\[curve\]"):
        seal.require()
    with pytest.raises(ImportError, match=r"keras-geeps\[curve\]"):
        seal.Channel(b"S" * 8, bytes(32), bytes(32))
    # A keyed client fails at once, before any traffic, naming the extra.
    with pytest.raises(ImportError, match=r"keras-geeps\[curve\]"):
        GeePSClient(ClusterSpec(["tcp://127.0.0.1:9"], 1, 0), timeout=1,
                    curve=keys)


def test_a_keyed_shard_without_pyaegis_fails_at_start(monkeypatch,
                                                      tmp_path):
    from keras_geeps.auth import keygen  # noqa: PLC0415
    from keras_geeps.shard import ShardServer  # noqa: PLC0415

    keygen(tmp_path, "shard")
    keygen(tmp_path / "allowed", "worker")
    monkeypatch.setitem(sys.modules, "pyaegis._aegis_ffi", None)
    with pytest.raises(ImportError, match=r"keras-geeps\[curve\]"):
        ShardServer("tcp://127.0.0.1:0", 0, 1, 1, curve=(
            str(tmp_path / "shard.key_secret"), str(tmp_path / "allowed")))


def test_a_sender_not_ready_seals_nothing_until_it_is(pair):
    """A shard's new session holds its messages, unsealed, until the
    worker's first message on it (ZeroMQ would drop them on a route not
    connected yet, and the next one's counter would tell a loss)."""
    worker, shard = pair
    sent = []
    sender = seal.Sender(shard, lambda frames, track: sent.append(frames),
                         ready=False)
    queued = [sender.send([f"m{i}".encode()]) for i in range(3)]
    assert sent == [] and shard.sent == 0 and sender.waiting == 3
    assert seal.pump_all([sender]) is None  # nothing to look at again
    sender.ready = True
    assert seal.pump_all([sender]) is None and all(q.done for q in queued)
    assert [bytes(worker.open(f)[0]) for f in sent] == [b"m0", b"m1", b"m2"]


def test_a_worker_that_loses_a_sealed_reply_to_a_bad_frame_says_hello(pair):
    """A sealed reply other than rows (a STATS_REPLY) whose header opens,
    taking its counter, but whose body frame fails its tag was dropped
    with a log line only: no later message showed a gap, and the request
    waited for its timeout. Its link now breaks (the worker says HELLO
    again), as for a rows chunk."""
    from keras_geeps import protocol
    from keras_geeps.client.connection import IOThread, _SealedLink
    worker, shard = pair
    broken = []
    io = IOThread(["tcp://127.0.0.1:1"], lambda *_: None,
                  on_broken=lambda shard_id, why: broken.append(why),
                  name="geeps-io-sealed")
    sock = io._context.socket(zmq.DEALER)
    try:
        link = _SealedLink(sock, worker, lambda _: None)
        io._links[0] = link
        sealed = shard.seal(protocol.encode(protocol.stats_reply(
            7, {"tables": {}})))
        wire = [bytearray(memoryview(f).cast("B")) for f in sealed]
        wire[-1][0] ^= 1  # the body, on the wire
        assert io._open(0, [zmq.Frame(bytes(f)) for f in wire], link) == \
            (None, None)
        assert link.broken
        deadline = time.monotonic() + 10
        while not broken:  # (told at the end of the I/O thread's turn)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "lost a message" in broken[0]
    finally:
        sock.close(linger=0)
        io.close()
