"""A connection to a live shard that breaks and comes back loses nothing.

The worker's messages go through a `CuttableLink`, a TCP forwarder the
test resets mid-update: what it was carrying is lost, ZeroMQ reconnects,
the shard (the same process) refuses the new connection until the worker
says HELLO, and its WELCOME tells the worker it is a reconnect, not a
restart. The worker then resends, under their own sequence numbers, the
updates and clocks the shard may not have got (it handles each number
once), and asks for its rows again. No checkpoints are needed.
"""

import random
import sys

import numpy as np
import pytest

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


def count_through(link, clients, cuts=CUTS, seed=0):
    """Every worker adds 1 to every element each clock (BSP), worker 0
    through `link`, which is cut part of the way into worker 0's update
    or its push at the clocks `cuts` says. Returns ({w: final rows},
    {w: client stats}, the shard's stats, errors)."""
    draw = random.Random(seed)

    def work(w):
        with clients(w) as client:
            table = client.create_table("t", ROWS, WIDTH)
            for clk in range(CLOCKS):
                client.update(table, np.ones((ROWS, WIDTH), np.float32))
                if w == 0 and clk in cuts:
                    # (an update's cut after two of its chunks got through:
                    # the shard had those, and drops them when resent)
                    first = 2 * CHUNK if cuts[clk] else 0
                    link.cut_after(draw.randrange(first, ROWS * WIDTH * 4),
                                   inbound=cuts[clk])
                client.clock()
                client.read(table, clock=clk + 1)
            return (client.read(table, clock=CLOCKS), client.stats(),
                    client.shard_stats()[0])

    results, errors = run_worker_threads(len(clients.workers), work,
                                         timeout=120)
    return ({w: r[0] for w, r in results.items()},
            {w: r[1] for w, r in results.items()},
            results[1][2] if 1 in results else None, errors)


class _Clients:
    """Clients of a 2-worker cluster: worker 0's connects to `address`."""

    def __init__(self, cluster, address, **kwargs):
        self.workers = range(cluster.num_workers)
        self._cluster, self._address, self._kwargs = cluster, address, kwargs

    def __call__(self, w):
        kwargs = dict(timeout=30, shared_memory=False, chunk_bytes=CHUNK,
                      heartbeat_interval=0.2, **self._kwargs)
        if w == 0:
            return GeePSClient(ClusterSpec([self._address], 2, 0), **kwargs)
        return self._cluster.client(w, **kwargs)


def _target(address):
    host, port = address.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


@pytest.mark.slow
def test_a_broken_connection_loses_nothing_and_applies_nothing_twice():
    with LocalCluster(1, 2, processes=True, output=sys.stderr) as cluster:
        link = CuttableLink(_target(cluster.addresses[0]))
        try:
            finals, stats, shard, errors = count_through(
                link, _Clients(cluster, link.address))
        finally:
            link.close()
        assert not errors, errors
        for w in (0, 1):
            np.testing.assert_array_equal(finals[w], 2.0 * CLOCKS)
        assert link.cuts == len(CUTS) + 1  # (+1: close)
        assert stats[0]["reconnects"] >= len(CUTS)
        assert stats[1]["reconnects"] == 0
        # Chunks that got through before a cut were sent again, and dropped.
        assert shard["duplicates"] >= 1


@pytest.mark.slow
def test_a_sealed_link_that_breaks_loses_nothing(keys):
    """With CURVE keys the rows go over the sealed data link, whose socket
    keeps its routing id across a reconnect: the shard, or the worker,
    tells the loss by the gap in the sealed counters (`seal.SealGap`),
    the session is ended, and the worker's HELLO over CURVE starts a new
    one over which it resends. Both links go through forwarders on
    127.0.0.2 (the data link keeps the shard's port number there); the
    data link is cut mid-update."""
    with keyed_cluster(keys, workers=2) as cluster:
        main = CuttableLink(_target(cluster.addresses[0]), host="127.0.0.2")
        data_target = _target(cluster.shards[0].data_address)
        data = CuttableLink(data_target, host="127.0.0.2",
                            port=data_target[1])
        try:
            finals, stats, shard, errors = count_through(data, _Clients(
                cluster, main.address, curve=worker_keys(keys)))
        finally:
            main.close()
            data.close()
        assert not errors, errors
        for w in (0, 1):
            np.testing.assert_array_equal(finals[w], 2.0 * CLOCKS)
        assert stats[0]["reconnects"] >= len(CUTS)
        assert stats[1]["reconnects"] == 0
        assert shard["duplicates"] >= 1
