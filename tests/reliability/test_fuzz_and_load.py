"""Fuzzing a live shard; 16 worker processes x 200 clocks against 4 shards."""

import json
import os
import random
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_geeps import protocol
from keras_geeps.launch import LocalCluster, worker_env
from keras_geeps.protocol import Message, MsgType
from tests import rss_bytes

pytestmark = pytest.mark.slow

SEEDS = [Message(kind, table=0, clk=0, worker=0, seq=5, arrays=arrays,
                 meta=meta) for kind, arrays, meta in [
    (MsgType.UPDATE, [np.ones((4, 8), np.float32)], {"chunk_row": 0}),
    (MsgType.UPDATE, [np.array([1, 3], np.int64),
                      np.ones((2, 8), np.float32)], {"indexed": True}),
    (MsgType.CLOCK, [], {}),
    (MsgType.READ, [], {}),
    (MsgType.DECLARE, [], {"name": "t", "rows": 4, "width": 8,
                           "dtype": "float32", "row_start": 0,
                           "row_end": 4}),
    (MsgType.CREATE, [np.ones((4, 8), np.float32)], {
        "name": "t", "rows": 4, "width": 8, "dtype": "float32",
        "row_start": 0, "row_end": 4, "chunk_row": 0}),
    (MsgType.HEARTBEAT, [], {}),
    (MsgType.STATS, [], {}),
    # Shared-memory forms: a reference instead of rows, a release.
    (MsgType.UPDATE, [], {"chunk_row": 0, "ref": [1, 3, 0, 128]}),
    (MsgType.READ, [], {"shm": True}),
    (MsgType.RELEASE, [], {"arena": "00" * 16, "buffers": [1, 2]}),
    (MsgType.LEAVE, [], {}),  # (a stranger's: the worker stays a member)
]]


def _restructured(rng, frames):
    """`frames` as a well-formed message whose arrays changed in kind, not
    in bytes: one dropped, doubled, added, swapped, cast, reshaped or cut
    short (the header describing them still fits, so the request gets
    past decoding into the handler's own checks). `frames` unchanged
    where they do not decode."""
    try:
        message = protocol.decode(frames)
    except protocol.ProtocolError:
        return frames
    arrays = [np.array(a) for a in message.arrays]
    dtypes = [np.float32, np.float64, np.int64, np.int32, np.uint8]
    action = rng.choice(["drop", "double", "add", "swap", "cast",
                         "reshape", "cut"])
    index = rng.randrange(len(arrays)) if arrays else None
    if action == "add" or index is None:
        shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
        arrays.insert(rng.randint(0, len(arrays)), np.array(
            [rng.randint(-2, 9) for _ in range(int(np.prod(shape)))]
        ).astype(rng.choice(dtypes)).reshape(shape))
    elif action == "drop":
        del arrays[index]
    elif action == "double":
        arrays.insert(index, arrays[index])
    elif action == "swap":
        arrays.reverse()
    elif action == "cast":  # (NaN or inf cast to an integer: whatever)
        with np.errstate(invalid="ignore", over="ignore"):
            arrays[index] = arrays[index].astype(rng.choice(dtypes))
    elif action == "reshape":
        array = arrays[index]
        arrays[index] = rng.choice([array.reshape(-1), array[None],
                                    array.reshape(array.shape[::-1])])
    else:
        array = arrays[index]
        arrays[index] = array[:rng.randint(0, len(array))] \
            if array.ndim else array.reshape(-1)[:0]
    message.arrays = arrays
    try:
        return [bytes(f) for f in protocol.encode(message)]
    except protocol.ProtocolError:
        return frames


def _mutated(rng, frames, least=0, most=4):
    """`frames` after `least` to `most` bit flips, cuts, growths, header
    values replaced (the header's own or its meta's) or arrays changed
    (`_restructured`), chosen by `rng`."""
    values = [
        lambda: rng.randint(-3, 10), lambda: rng.randint(-2**63, 2**64 - 1),
        lambda: None, lambda: rng.random() < 0.5, lambda: float("nan"),
        lambda: "".join(rng.choice("a_\x00\u00e9")
                        for _ in range(rng.randint(0, 8))),
        lambda: [rng.randint(-2**63, 2**63 - 1)
                 for _ in range(rng.randint(0, 3))],
        lambda: [rng.randint(-5, 40)] * 2,
        lambda: {"chunk_row": rng.randint(-3, 9)}]
    for _ in range(rng.randint(least, most)):
        index = rng.randrange(len(frames))
        raw = bytearray(frames[index])
        action = rng.choice(["flip", "cut", "grow", "header", "header",
                             "arrays"])
        if action == "arrays":
            frames = _restructured(rng, frames)
            continue
        if action == "flip" and raw:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif action == "cut":
            raw = raw[:rng.randint(0, len(raw))]
        elif action == "grow":
            raw += rng.randbytes(rng.randint(1, 64))
        elif action == "header" and index == 0:
            try:
                header = msgpack.unpackb(bytes(raw), raw=False)
            except Exception:  # an earlier mutation broke it already
                continue
            if not isinstance(header, dict) or not header:
                continue
            target = header
            if isinstance(header.get("meta"), dict) and header["meta"] and \
                    rng.random() < 0.6:
                target = header["meta"]
            target[rng.choice(sorted(map(str, target)))] = \
                rng.choice(values)()
            raw = bytearray(msgpack.packb(header))
        frames[index] = bytes(raw)
    return frames


@st.composite
def hostile_frames(draw):
    if draw(st.booleans()):
        return draw(st.lists(st.binary(max_size=512), min_size=1,
                             max_size=5))
    frames = [bytes(f) for f in protocol.encode(draw(st.sampled_from(SEEDS)))]
    return _mutated(draw(st.randoms(use_true_random=False)), frames,
                    least=1, most=6)


def test_ten_thousand_hostile_frames_leave_the_shard_serving():
    cluster = LocalCluster(1, 1, processes=True, output=None)
    context = zmq.Context()
    hostile = context.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.setsockopt(zmq.RCVTIMEO, 5000)
    hostile.connect(cluster.addresses[0])
    counts = {"sent": 0}
    try:
        client = cluster.client(0, timeout=10)
        table = client.create_table("t", 4, 8)

        @settings(max_examples=10_300, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(frames=hostile_frames())
        def attack(frames):
            if _takes_over(frames):
                # A well-formed STOP or HELLO is a legitimate request: without
                # CURVE any peer may send one (see test_curve.py for keys).
                return
            hostile.send_multipart(frames)
            hostile.recv_multipart()  # every message gets one reply
            counts["sent"] += 1
            if counts["sent"] % 500 == 0:  # the valid client keeps working
                clock = table.clock
                client.update(table, np.ones((4, 8), np.float32))
                client.clock()
                np.testing.assert_array_equal(
                    client.read(table), np.full((4, 8), clock + 1.0))

        attack()
        assert counts["sent"] >= 10_000
        assert cluster.shards[0].process.poll() is None
        clock = table.clock
        client.update(table, np.ones((4, 8), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table),
                                      np.full((4, 8), clock + 1.0))
        stats = client.shard_stats()[0]
        assert stats["errors"] >= 10_000 - 100  # STATS seeds get replies
        assert stats["internal_errors"] == 0
        client.close()
    finally:
        hostile.close()
        context.term()
        cluster.stop()


SEQ_WINDOW = 1 << 16  # a shard's window of request numbers (SeqTracker)


class _KnownWorker:
    """Worker 1 as a raw socket that said HELLO, so its requests get past
    the HELLO check into the handlers, with a reference of the table.

    The reference adds exactly the updates the shard did not refuse. A
    request whose (mutated) number the shard has handled before is a
    resend (`SeqTracker`): an UPDATE or CLOCK under it has no effect.
    Every request is followed by a STATS: the shard answers in order, so
    any refusal of the request comes before the STATS' reply. Numbers far
    from the worker's own are not sent (unless they jump beyond the
    window): they would slide the shard's window of handled numbers past
    the worker's, after which the shard ignores everything it sends.
    """

    def __init__(self, context, address, table):
        self.table = table
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, 10_000)
        self.socket.connect(address)
        self.seq, self.clk = 100, 0
        self.taken = set()    # numbers handed out (never handed out again)
        self.handled = set()  # numbers the shard handled
        self.reference = np.zeros((4, 8), np.float32)
        welcome = self.request(Message(
            MsgType.HELLO, worker=1, seq=self.next_seq(),
            meta={"num_workers": 2, "num_shards": 1, "incarnation": 7}))
        assert welcome.type == MsgType.WELCOME, welcome
        self.hello_seq = welcome.seq
        declared = self.request(Message(MsgType.DECLARE, table.id, worker=1,
                                        seq=self.next_seq(),
                                        meta=table.spec_meta(0)))
        assert declared.type != MsgType.ERROR, declared

    def next_seq(self):
        self.seq += 1
        while self.seq in self.taken:
            self.seq += 1
        self.taken.add(self.seq)
        return self.seq

    def request(self, message):
        """Sends a well-formed request; returns its reply."""
        self.handled.add(message.seq)
        self.socket.send_multipart(protocol.encode(message))
        while True:  # (pushed rows and late replies to reads: skipped)
            reply = protocol.decode(self.socket.recv_multipart())
            if reply.seq == message.seq and reply.type != MsgType.ROWS:
                return reply

    def seed(self, rng):
        """A well-formed request of this worker, numbered."""
        t, h, seq = self.table, self.clk, self.next_seq()
        return rng.choice([
            lambda: Message(MsgType.UPDATE, t.id, clk=h, worker=1, seq=seq,
                            arrays=[np.ones((4, 8), np.float32)],
                            meta={"chunk_row": 0}),
            lambda: Message(MsgType.UPDATE, t.id, clk=h, worker=1, seq=seq,
                            arrays=[np.full((2, 8), 2, np.float32)],
                            meta={"chunk_row": 2}),
            lambda: Message(MsgType.UPDATE, t.id, clk=h, worker=1, seq=seq,
                            arrays=[np.array([1, 3, 1], np.int64),
                                    np.full((3, 8), 3, np.float32)],
                            meta={"indexed": True}),
            lambda: Message(MsgType.CLOCK, t.id, clk=h, worker=1, seq=seq),
            lambda: Message(MsgType.READ, t.id, clk=h, worker=1, seq=seq),
            lambda: Message(MsgType.DECLARE, t.id, worker=1, seq=seq,
                            meta=t.spec_meta(0)),
            lambda: Message(MsgType.CREATE, worker=1, seq=seq,
                            arrays=[np.full((4, 8), 9, np.float32)],
                            meta=dict(t.spec_meta(0), chunk_row=0)),
            lambda: Message(MsgType.CREATE, worker=1, seq=seq,
                            arrays=[np.ones((4, 8), np.float32)],
                            meta={"name": "u", "rows": 4, "width": 8,
                                  "dtype": "float32", "row_start": 0,
                                  "row_end": 4, "chunk_row": 0}),
            lambda: Message(MsgType.HEARTBEAT, worker=1, seq=seq),
        ])()

    def attack(self, frames):
        """Sends `frames`; applies what the shard took to the reference.
        False (and nothing sent) for a HELLO, STOP or LEAVE, legitimate
        requests that end this worker's session or the shard, and for
        rows of values beyond 1e6 or not finite, legitimate too: they
        would hide a lost or doubled update in the reference."""
        try:
            message = protocol.decode(frames)
        except protocol.ProtocolError:
            message = None  # the shard refuses it undecoded: nothing handled
        resend = False
        if message is not None:
            if message.type in (MsgType.HELLO, MsgType.STOP, MsgType.LEAVE):
                return False
            if any(rows.dtype.kind == "f" and rows.size and not (
                    np.abs(rows.astype(np.float64)) <= 1e6).all()
                   for rows in message.arrays):
                return False
            if message.worker == 1 and \
                    message.seq <= max(self.handled) + SEQ_WINDOW:
                # (beyond: refused as a jump, and not taken)
                resend = message.seq <= self.hello_seq or \
                    message.seq in self.handled
                if not resend and abs(message.seq - self.seq) > 1000:
                    # Far from this worker's numbers, it moves the shard's
                    # window: the lower ones would all count as handled.
                    return False
                self.taken.add(message.seq)
                self.handled.add(message.seq)
        self.socket.send_multipart(frames)
        stats = Message(MsgType.STATS, worker=1, seq=self.next_seq())
        self.handled.add(stats.seq)
        self.socket.send_multipart(protocol.encode(stats))
        refused = False
        while True:
            reply = protocol.decode(self.socket.recv_multipart())
            if reply.seq == stats.seq and reply.type != MsgType.ROWS:
                break
            refused |= reply.type == MsgType.ERROR and (
                message is None or reply.seq in (message.seq, -1))
        if refused or resend or message is None or message.worker != 1 \
                or message.table != self.table.id:
            return True
        if message.type == MsgType.UPDATE and message.meta.get("indexed"):
            np.add.at(self.reference, message.arrays[0], message.arrays[1])
        elif message.type == MsgType.UPDATE:
            row = message.meta.get("chunk_row", 0)
            for rows in message.arrays:
                self.reference[row:row + rows.shape[0]] += rows
                row += rows.shape[0]
        elif message.type == MsgType.CLOCK:
            self.clk += 1
        return True

    def clock(self):
        reply = self.request(Message(MsgType.CLOCK, self.table.id,
                                     clk=self.clk, worker=1,
                                     seq=self.next_seq()))
        assert reply.type == MsgType.ACK, reply
        self.clk += 1


# A longer campaign: GEEPS_FUZZ_REQUESTS=200000 GEEPS_FUZZ_SEED=7 pytest ...
FUZZ_REQUESTS = int(os.environ.get("GEEPS_FUZZ_REQUESTS", 10_000))
FUZZ_SEED = int(os.environ.get("GEEPS_FUZZ_SEED", 20261206))


@pytest.mark.parametrize("shard_args", [
    [], ["--deterministic-sums"],
    ["--checkpoint-dir", "{tmp}", "--checkpoint-every", "3"]],
    ids=["plain", "deterministic-sums", "checkpoints"])
def test_a_known_workers_mutated_requests_leave_its_tables_exact(
        tmp_path, shard_args):
    """10,000 mutated requests of a worker the shard knows reach its
    update, clock, read, declare and create handlers: every 50, worker 0
    catches up and reads, and the table must equal the reference (each
    update the shard took applied once, nothing else). No request may
    hit an internal error (a bug the shard survives, in its STATS)."""
    cluster = LocalCluster(1, 2, processes=True, output=None, shard_args=[
        arg.format(tmp=tmp_path) for arg in shard_args])
    context = zmq.Context()
    rng = random.Random(FUZZ_SEED)
    try:
        with cluster.client(0, timeout=30) as client:
            table = client.create_table("t", 4, 8)
            known = _KnownWorker(context, cluster.addresses[0], table)
            worker0_clock, sent = 0, 0
            while sent < FUZZ_REQUESTS:
                frames = [bytes(f)
                          for f in protocol.encode(known.seed(rng))]
                if not known.attack(_mutated(rng, frames)):
                    continue
                sent += 1
                if sent % 50 == 0:
                    known.clock()
                    while worker0_clock < known.clk:
                        client.update(table, np.ones((4, 8), np.float32))
                        client.clock()
                        worker0_clock += 1
                        known.reference += 1
                    np.testing.assert_allclose(client.read(table),
                                               known.reference, rtol=1e-5)
            stats = client.shard_stats()[0]
        assert stats["internal_errors"] == 0
        assert stats["errors"] > FUZZ_REQUESTS // 2  # most are refused
        assert stats["updates_applied"] > FUZZ_REQUESTS // 10  # not all
        if "--checkpoint-every" in shard_args:
            assert stats["checkpoints"] > 0
        assert stats["deterministic_sums"] == ("--deterministic-sums"
                                               in shard_args)
        assert cluster.shards[0].process.poll() is None
    finally:
        context.destroy(linger=0)
        cluster.stop()


def test_sixteen_workers_two_hundred_clocks_four_shards(tmp_path):
    workers, clocks = 16, 200
    cluster = LocalCluster(4, workers, processes=True, output=None)
    try:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "tests.multiprocess.ps_worker", "--out",
             str(tmp_path), "--clocks", str(clocks), "--timeout", "120"],
            env=worker_env(cluster.spec(w)), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE) for w in range(workers)]
        for proc in procs:
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err.decode()[-2000:]
        expected = 1.0 + sum((w + 1) * (c + 1) for w in range(workers)
                             for c in range(clocks))
        for w in range(workers):
            result = json.loads((tmp_path / f"worker{w}.json").read_text())
            assert result["final_min"] == result["final_max"] == expected
            assert result["final_small"] == workers * clocks
        with cluster.client(0, timeout=10) as admin:
            stats = admin.shard_stats()
        # Every update accounted for: the big table has a part on each of
        # the 4 shards, the small one lives on one: 5 updates per worker
        # per clock, each applied exactly once.
        assert sum(s["updates_applied"] for s in stats) == \
            workers * clocks * 5
        assert sum(s["duplicates"] for s in stats) == 0
        for s in stats:
            table_bytes = sum(t["rows"] * t["width"] * 4
                              for t in s["tables"].values())
            assert s["held_bytes"] <= 4 * max(table_bytes, 1) + 1024
            pid = cluster.shards[s["shard_id"]].process.pid
            rss_kb = rss_bytes(pid) // 1024
            assert rss_kb < 400_000, rss_kb  # bounded: no growth per clock
    finally:
        cluster.stop()


def _takes_over(frames):
    try:
        return protocol.decode(frames).type in (MsgType.STOP, MsgType.HELLO)
    except protocol.ProtocolError:
        return False
