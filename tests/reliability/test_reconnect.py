"""A connection to a live shard that breaks and comes back loses nothing.

Worker 0's messages go through a `CuttableLink`, a TCP forwarder the test
resets (or silences) mid-transfer: what it was carrying is lost, ZeroMQ
reconnects, the shard (the same process) refuses the new connection until
the worker says HELLO (or, on a sealed link, tells the loss by the gap in
its counters), and its WELCOME tells the worker it is a reconnect, not a
restart. The worker then resends, under their own sequence numbers, the
updates and clocks the shard may not have got (it handles each number
once), and asks for its rows again. No checkpoints are needed. Every
worker adds 1 to every element of a table each clock (BSP), so the final
rows say whether an update was lost or applied twice.
"""

import contextlib
import random
import sys
import time

import numpy as np
import pytest

from keras_geeps import protocol
from keras_geeps.client import GeePSClient
from keras_geeps.cluster import ClusterSpec
from keras_geeps.launch import LocalCluster
from tests.reliability.keyed import keyed_cluster, worker_keys
from tests.reliability.tcp_cut import CuttableLink
from tests.worker_threads import run_worker_threads

ROWS, WIDTH = 256, 1024          # 1 MiB of float32 per update
CHUNK = 1 << 18                  # sent as four 256 KiB chunks
CLOCKS = 14
# Clocks whose update (True: worker to shard) or push (False: the rows
# back) the link is cut part of the way into.
CUTS = {2: True, 5: False, 6: True, 9: True, 11: False, 12: True}


class _Clients:
    """Clients of a 2-worker cluster: worker 0's connects to `address`."""

    def __init__(self, cluster, address, **kwargs):
        self._cluster, self._address, self._kwargs = cluster, address, kwargs

    def __call__(self, w):
        kwargs = dict(timeout=30, shared_memory=False, chunk_bytes=CHUNK,
                      heartbeat_interval=0.2, **self._kwargs)
        if w == 0:
            return GeePSClient(ClusterSpec([self._address], 2, 0), **kwargs)
        return self._cluster.client(w, **kwargs)


def count(clients, clocks, before_clock=None, after_read=None):
    """Two workers add 1 to every element each clock for `clocks` clocks;
    worker 0 calls `before_clock(clk)` before each `clock()` and
    `after_read(clk)` after each read. Fails on any error; returns
    ({w: client stats}, the shard's stats) once both read exactly
    2 x clocks everywhere."""

    def work(w):
        with clients(w) as client:
            table = client.create_table("t", ROWS, WIDTH)
            for clk in range(clocks):
                client.update(table, np.ones((ROWS, WIDTH), np.float32))
                if w == 0 and before_clock is not None:
                    before_clock(clk)
                client.clock()
                client.read(table, clock=clk + 1)
                if w == 0 and after_read is not None:
                    after_read(clk)
            np.testing.assert_array_equal(client.read(table, clock=clocks),
                                          2.0 * clocks)
            return client.stats(), client.shard_stats()[0]

    results, errors = run_worker_threads(2, work, timeout=120)
    assert not errors, errors
    return {w: r[0] for w, r in results.items()}, results[1][1]


def cutting(link, cuts=CUTS, seed=0):
    """A `before_clock` that cuts `link` part of the way into worker 0's
    update or push at the clocks `cuts` says (an update's after two of
    its chunks got through: the shard had those, and drops them when they
    are resent)."""
    draw = random.Random(seed)

    def cut(clk):
        if clk in cuts:
            first = 2 * CHUNK if cuts[clk] else 0
            link.cut_after(draw.randrange(first, ROWS * WIDTH * 4),
                           inbound=cuts[clk])
    return cut


def _target(address):
    host, port = address.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


@contextlib.contextmanager
def _sealed_links(cluster):
    """Forwarders on 127.0.0.2 to a keyed shard's main and data sockets
    (the data link on the shard's port number: the WELCOME names only the
    port, the worker keeps the host it connected to). Yields (main,
    data)."""
    main = CuttableLink(_target(cluster.addresses[0]), host="127.0.0.2")
    data_target = _target(cluster.shards[0].data_address)
    data = CuttableLink(data_target, host="127.0.0.2", port=data_target[1])
    try:
        yield main, data
    finally:
        main.close()
        data.close()


@pytest.mark.slow
def test_a_broken_connection_loses_nothing_and_applies_nothing_twice():
    with LocalCluster(1, 2, processes=True, output=sys.stderr) as cluster:
        link = CuttableLink(_target(cluster.addresses[0]))
        try:
            stats, shard = count(_Clients(cluster, link.address), CLOCKS,
                                 before_clock=cutting(link))
        finally:
            link.close()
        assert link.cuts == len(CUTS) + 1  # (+1: close)
        assert stats[0]["reconnects"] >= len(CUTS)
        assert stats[1]["reconnects"] == 0
        # Chunks that got through before a cut were sent again, and dropped.
        assert shard["duplicates"] >= 1


@pytest.mark.slow
def test_a_sealed_link_that_breaks_loses_nothing(keys):
    """With CURVE keys the rows go over the sealed data link, whose
    session token admits one connection: the reconnect after a cut is
    refused, the worker's HELLO over CURVE starts a new session and it
    resends there what the shard did not acknowledge (what arrived before
    the cut is then a duplicate, dropped). Both links go through forwarders on
    127.0.0.2 (the data link keeps the shard's port number there); the
    data link is cut mid-update and mid-push."""
    with keyed_cluster(keys, workers=2) as cluster, \
            _sealed_links(cluster) as (main, data):
        stats, shard = count(_Clients(cluster, main.address,
                                      curve=worker_keys(keys)),
                             CLOCKS, before_clock=cutting(data))
        assert stats[0]["reconnects"] >= len(CUTS)
        assert stats[1]["reconnects"] == 0
        assert shard["duplicates"] >= 1


@pytest.mark.slow
def test_a_damaged_sealed_message_ends_the_link_and_loses_nothing(keys):
    """One bit flipped on the wire, mid-update and mid-push: the frame's
    tag fails, the message is dropped, and the link that lost it ends
    (the receiver tells it at once, or by the next counter), so the
    worker resends over a new session."""
    flips = {3: True, 6: False, 9: True, 11: False}
    draw = random.Random(1)
    with keyed_cluster(keys, workers=2) as cluster, \
            _sealed_links(cluster) as (main, data):

        def corrupt(clk):
            if clk in flips:
                data.corrupt_after(draw.randrange(2 * CHUNK,
                                                  ROWS * WIDTH * 4),
                                   inbound=flips[clk])

        stats, _ = count(_Clients(cluster, main.address,
                                  curve=worker_keys(keys)),
                         CLOCKS, before_clock=corrupt)
        assert stats[0]["reconnects"] >= len(flips)


@pytest.mark.slow
@pytest.mark.parametrize("sealed", [False, True])
def test_a_half_open_connection_is_given_up_and_resumed(monkeypatch, keys,
                                                        sealed):
    """The link goes silent mid-update: worker 0's connection stays open
    but carries nothing, either way. ZeroMQ's heartbeats (shortened here
    for the in-process worker, and on although the link is on loopback)
    close it and the socket connects again through the link; a sealed
    link, whose new connection the shard refuses (the session's token
    admits one connection), is ended at its next send that finds no
    connection or when it heard nothing for LINK_TIMEOUT_MS, whichever
    comes first. The worker resumes with nothing lost."""
    monkeypatch.setattr(protocol, "LINK_PING_MS", 100)
    monkeypatch.setattr(protocol, "LINK_TIMEOUT_MS", 1000)
    monkeypatch.setattr(protocol, "LINK_HEARTBEATS_ON_LOOPBACK", True)
    stalled = []

    def resumed_soon(clk):
        if clk == 1:
            assert time.monotonic() - stalled[0] < 10

    with contextlib.ExitStack() as stack:
        if sealed:
            cluster = stack.enter_context(keyed_cluster(keys, workers=2))
            main, link = stack.enter_context(_sealed_links(cluster))
            clients = _Clients(cluster, main.address,
                               curve=worker_keys(keys))
        else:
            cluster = stack.enter_context(LocalCluster(
                1, 2, processes=True, output=sys.stderr))
            link = CuttableLink(_target(cluster.addresses[0]))
            stack.callback(link.close)
            clients = _Clients(cluster, link.address)

        def stall(clk):
            if clk == 1:
                link.stall()
                stalled.append(time.monotonic())

        stats, _ = count(clients, 4, before_clock=stall,
                         after_read=resumed_soon)
        assert stats[0]["reconnects"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("when", ["during", "before"])
def test_a_break_in_a_restart_recovery_loses_nothing(tmp_path, caplog,
                                                     when):
    """The shard is killed after clock 5 and restarted from its clock-0
    checkpoint, and worker 0's link is cut while it recovers the shard:

    - "during" its replay of clocks 0-6, 2.5 MiB on (its clock-6 update,
      which the new shard refuses, then part of the replay). The replay
      goes at the shard's pace, so it is still under way: what of it went
      out, under new numbers and not yet acknowledged, is resent under
      those numbers after the next WELCOME, and the rest follows.
    - "before" any replay went out: on the restored shard's answer to its
      DECLARE (the ACK carries "ready", which msgpack writes as 0xa5
      "ready"; pushes, WELCOMEs and refusals carry no such key). The next
      WELCOME comes from the same restored process while the recovery is
      under way: the part is declared and replayed then.

    Either way the restored shard applies each update once."""
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "50"]

    def restart(clk):
        if clk == 5:
            victim = cluster.shards[0]
            victim.kill()
            cluster.shards[0] = victim.restart(["--restore"])
            if when == "during":
                link.cut_after(5 * ROWS * WIDTH * 2)
            else:
                link.cut_on(b"\xa5ready", inbound=False)

    with LocalCluster(1, 2, processes=True, output=sys.stderr,
                      shard_args=args) as cluster:
        link = CuttableLink(_target(cluster.addresses[0]))
        try:
            with caplog.at_level("WARNING", logger="keras_geeps.client"):
                stats, _ = count(_Clients(cluster, link.address), 8,
                                 after_read=restart)
        finally:
            link.close()
        assert link.cuts == 2  # (the cut, and close)
        assert stats[0]["reconnects"] >= 1
        assert "while recovering it from its restart" in caplog.text


def test_a_zero_copy_update_resent_after_a_break_is_the_one_sent(
        thread_cluster):
    """With slack 2 a caller may write into its `copy=False` update buffer
    again two clocks later (a read then need not wait for that update); if
    the update was lost on a broken connection meanwhile, the resend must
    carry what was sent, not what the caller wrote there since."""
    cluster = thread_cluster(1, 1)
    link = CuttableLink(_target(cluster.addresses[0]))
    try:
        with GeePSClient(ClusterSpec([link.address], 1, 0), timeout=30,
                         slack=2, shared_memory=False,
                         heartbeat_interval=0.2) as client:
            table = client.create_table("t", ROWS, WIDTH)
            buffer = np.ones((ROWS, WIDTH), np.float32)
            link.stall()  # clock 0's update and clock vanish on the way
            client.update(table, buffer, copy=False)
            client.clock()
            client.read(table)  # clock 1, slack 2: no wait
            buffer[:] = 100.0  # the caller's next update, being written
            link.cut()  # the connection breaks; the worker resends
            client.clock()
            client.clock()
            np.testing.assert_array_equal(client.read(table, clock=3), 1.0)
            assert client.stats()["reconnects"] >= 1
    finally:
        link.close()
