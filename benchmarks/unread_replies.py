"""What a peer that sends READs and never reads its socket costs a shard.

A shard queues its replies for such a peer (its ZeroMQ stops taking from
TCP): this script starts a shard process, creates a 64 KB table (under
pyzmq's 64 KiB copy threshold, where frames used to be copied into the
queue) and sends READs from a DEALER whose receive side is throttled to
one message and a 4 KiB socket buffer, reading nothing. It reports how
much the shard process grew, against what copies of every reply would
take (the baseline: 190 MB for 3000 READs before replies went zero-copy
and unsent ones were bounded), how many READs got rows and how many were
refused (`MAX_UNSENT_READS`).

With `--stats N` the peer sends N STATS instead (no HELLO is needed for
one), against a shard holding 100 tables of 1000-character names, whose
every reply copies their figures (~115 KB): the baseline is N such
replies; past `MAX_UNSENT_STATS` unsent ones its STATS are refused.

With `--clocks N` the peer, a subscriber of the table, finishes N clocks
of it with worker 0, who adds ones to it at each clock and reads what it
is sent: each clock's rows are pushed to both. The baseline is a copy of
the table per clock (N x 64 KB), what queued for the peer before a push
waited while none of the last one to it had left (`pushes_deferred`).

With `--garbage N` a peer that said no HELLO sends N one-byte messages
(never valid msgpack), each refused with an ERROR: the baseline is N such
replies (their bytes as one that is read); past `MAX_UNSENT_ERRORS`
waiting for a peer that is no worker's, its refusals go unanswered.

Example:

    .venv/bin/python benchmarks/unread_replies.py --reads 3000
    .venv/bin/python benchmarks/unread_replies.py --stats 1500
    .venv/bin/python benchmarks/unread_replies.py --garbage 400000
    .venv/bin/python benchmarks/unread_replies.py --clocks 20000

The last line is JSON: `reads`, `answered`, `refused`, `rss_growth_bytes`,
`copies_bytes` (reads x table bytes) and `growth_vs_copies`; with
`--stats` or `--garbage`, `requests` (messages sent) in place of `reads`;
with `--clocks`, `clocks` and `pushes_deferred` in place of `reads`,
`answered` and `refused`.
"""

import argparse
import json
import time

import numpy as np
import zmq

from keras_geeps import protocol
from keras_geeps.launch import LocalCluster
from keras_geeps.protocol import Message, MsgType

ROWS = 16_000  # float32, width 1: 64,000 bytes


def _rss_bytes(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class _Peer:
    """A bare DEALER speaking the protocol as worker `worker`."""

    def __init__(self, context, address, worker, deaf=False):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, 10_000)
        if deaf:  # its ZeroMQ soon stops taking from TCP
            self.socket.setsockopt(zmq.RCVHWM, 1)
            self.socket.setsockopt(zmq.RCVBUF, 4096)
        self.socket.connect(address)
        self.worker, self.seq = worker, 0

    def send(self, kind, **kwargs):
        self.seq += 1
        self.socket.send_multipart(protocol.encode(Message(
            kind, worker=self.worker, seq=self.seq, **kwargs)))
        return self.seq

    def ask(self, kind, **kwargs):
        seq = self.send(kind, **kwargs)
        while True:
            reply = protocol.decode(self.socket.recv_multipart())
            if reply.seq == seq and reply.type != MsgType.PUSH:
                return reply


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reads", type=int, default=3000)
    parser.add_argument("--stats", type=int, default=0,
                        help="send this many STATS instead of READs")
    parser.add_argument("--garbage", type=int, default=0,
                        help="send this many one-byte messages instead")
    parser.add_argument("--clocks", type=int, default=0,
                        help="finish this many clocks of the table instead")
    args = parser.parse_args()
    cluster = LocalCluster(1, 2, processes=True, shard_args=[
        "--max-table-bytes", str(1 << 20)])
    context = zmq.Context()
    try:
        address = cluster.spec(0).shards[0]
        pid = cluster.shards[0].process.pid
        spec = {"name": "t", "rows": ROWS, "width": 1, "dtype": "float32",
                "row_start": 0, "row_end": ROWS}
        creator = _Peer(context, address, 0)
        deaf = _Peer(context, address, 1, deaf=True)
        for peer in (creator, deaf):
            assert peer.ask(MsgType.HELLO, meta={
                "incarnation": 1}).type == MsgType.WELCOME
        assert creator.ask(MsgType.CREATE, table=0, arrays=[
            np.ones((ROWS, 1), np.float32)], meta=dict(
                spec, chunk_row=0)).type == MsgType.ACK
        assert deaf.ask(MsgType.DECLARE, table=0,
                        meta=spec).type == MsgType.ACK
        if args.stats:
            for table in range(1, 101):
                assert creator.ask(MsgType.DECLARE, table=table, meta=dict(
                    spec, name=f"{table:04d}" + "n" * 996, rows=1,
                    row_end=1)).type == MsgType.ACK
            reply_bytes = len(creator.ask(MsgType.STATS).arrays[0])
        if args.garbage:  # a stranger's: no HELLO
            deaf = _Peer(context, address, 1, deaf=True)
            reader = _Peer(context, address, 1)
            reader.socket.send(b"\xc1")
            reply_bytes = sum(map(len, reader.socket.recv_multipart()))
        if args.clocks:
            _clocks(creator, deaf, pid, args.clocks)
            return
        sent = args.garbage or args.stats or args.reads
        time.sleep(0.5)
        before = _rss_bytes(pid)
        for _ in range(sent):
            if args.garbage:
                deaf.socket.send(b"\xc1")
            elif args.stats:
                deaf.send(MsgType.STATS)
            else:
                deaf.send(MsgType.READ, table=0, clk=0)
        # Until the shard has taken every request (its message count).
        deadline = time.monotonic() + 120
        while True:
            stats = protocol.stats_of(creator.ask(MsgType.STATS))
            if stats["messages_in"] >= sent + 5 + 101 * bool(args.stats) \
                    + bool(args.garbage) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        grown = _rss_bytes(pid) - before
        refused = stats["errors"] - bool(args.garbage)  # (the reader's)
        copies = sent * (ROWS * 4 if not (args.stats or args.garbage)
                         else reply_bytes)
        what = "STATS" if args.stats else "one-byte messages" \
            if args.garbage else "READs"
        unanswered = stats.get("errors_unanswered", 0)
        print(f"{sent} {what}, none read: {sent - refused} answered, "
              f"{refused} refused ({unanswered} of them unanswered); shard "
              f"grew {grown / 1e6:.1f} MB (copies of every reply: "
              f"{copies / 1e6:.0f} MB)")
        print(json.dumps({
            "requests" if args.stats or args.garbage else "reads": sent,
            "answered": sent - refused,
            "refused": refused, "rss_growth_bytes": grown,
            "copies_bytes": copies,
            "growth_vs_copies": round(grown / copies, 4)}))
    finally:
        context.destroy(linger=0)
        cluster.stop()


def _clocks(creator, deaf, pid, clocks):
    """`--clocks`: worker 0 adds ones and reads; the deaf peer clocks."""
    ones = np.ones((ROWS, 1), np.float32)
    time.sleep(0.5)
    before = _rss_bytes(pid)
    for clk in range(clocks):
        creator.send(MsgType.UPDATE, table=0, clk=clk, arrays=[ones])
        assert creator.ask(MsgType.CLOCK, table=0,
                           clk=clk).type == MsgType.ACK
        deaf.send(MsgType.CLOCK, table=0, clk=clk)
    deadline = time.monotonic() + 120
    while True:
        stats = protocol.stats_of(creator.ask(MsgType.STATS))
        if stats["tables"]["0"]["global_clock"] >= clocks or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    grown = _rss_bytes(pid) - before
    copies = clocks * ROWS * 4
    deferred = stats.get("pushes_deferred", 0)  # (none before it was)
    print(f"{clocks} clocks, the subscriber reading none: "
          f"{deferred} pushes to it deferred; shard grew "
          f"{grown / 1e6:.1f} MB (a copy of the table per clock: "
          f"{copies / 1e6:.0f} MB)")
    print(json.dumps({
        "clocks": clocks, "pushes_deferred": deferred,
        "rss_growth_bytes": grown, "copies_bytes": copies,
        "growth_vs_copies": round(grown / copies, 4)}))


if __name__ == "__main__":
    main()
