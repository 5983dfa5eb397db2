"""A worker given replies no real shard sends (a faulty or hostile one,
scripted: tests/scripted_shard.py) fails with an error naming what is
wrong, within its timeout, its I/O thread alive."""

import contextlib
import time

import numpy as np
import pytest

from keras_geeps import protocol
from keras_geeps.client import GeePSClient
from keras_geeps.client.connection import _sealed_link_fields
from keras_geeps.cluster import ClusterSpec
from keras_geeps.errors import GeePSError, GeePSServerError, \
    GeePSTimeoutError
from keras_geeps.protocol import Message, MsgType, ProtocolError
from tests.scripted_shard import Restarting, ScriptedShard, a_table, \
    welcome

SESSION, KEY = "53" + "ab" * 7, "cd" * 32


@contextlib.contextmanager
def _worker_of(script, timeout, **options):
    """Worker 1 of 2's client of a `ScriptedShard` running `script`."""
    shard = ScriptedShard(script)
    try:
        client = GeePSClient(ClusterSpec([shard.address], 2, 1),
                             timeout=timeout, shared_memory=False, **options)
        try:
            yield client
        finally:
            client.close()
    finally:
        shard.stop()


@pytest.mark.parametrize("sealed", [
    ["not", "five", "fields"],
    [0, SESSION, KEY, KEY, "t0ken"],             # no port
    [True, SESSION, KEY, KEY, "t0ken"],
    [5555, "00" + "ab" * 7, KEY, KEY, "t0ken"],  # a route ZeroMQ reserves
    [5555, SESSION[:-2], KEY, KEY, "t0ken"],     # a byte short
    [5555, SESSION, "zz" * 32, KEY, "t0ken"],    # not hex
    [5555, SESSION, KEY, KEY, ""],
    [5555, SESSION, KEY, KEY, "t0 ken"],
    [5555, SESSION, KEY, KEY],
])
def test_a_malformed_sealed_field_is_refused_naming_it(sealed):
    with pytest.raises(ProtocolError, match="sealed field"):
        _sealed_link_fields(sealed)
    good = [5555, SESSION, KEY, KEY, "t0ken"]
    assert _sealed_link_fields(good) == good


def test_a_welcome_with_a_malformed_sealed_field_fails_the_client_at_once():
    shard = ScriptedShard(lambda m: [welcome(m, sealed=[1, 2])]
                          if m.type == MsgType.HELLO else None)
    try:
        started = time.monotonic()
        with pytest.raises(GeePSServerError, match="shard 0 sent a "
                           "malformed message: WELCOME: its sealed field"):
            GeePSClient(ClusterSpec([shard.address]), timeout=10,
                        shared_memory=False)
        assert time.monotonic() - started < 5  # not the timeout
    finally:
        shard.stop()


def test_a_recovery_declare_answered_without_its_clock_loses_the_shard():
    """The shard "restarts" (a heartbeat answered hello_required, a new
    incarnation) and answers the recovery's DECLARE with no clock: the
    shard is lost naming that, and the I/O thread lives on."""
    script = Restarting(lambda declare: [Message(
        MsgType.ACK, table=declare.table, seq=declare.seq, meta={})])
    with _worker_of(script, 5, heartbeat_interval=0.1) as client:
        table = client.create_table("t", 2, 2)
        script.restart()
        with pytest.raises(GeePSError, match="answered the DECLARE of table "
                           "'t' without the table's clock"):
            client.read(table, clock=1)
        assert client._io.failed is None


def test_a_malformed_stats_reply_is_named_in_a_read_timeout():
    script = a_table()
    with _worker_of(lambda m: [protocol.stats_reply(m.seq, {
            "tables": {"0": {"ready": True}}})]
            if m.type == MsgType.STATS else script(m), 1) as client:
        table = client.create_table("t", 2, 2)
        with pytest.raises(GeePSTimeoutError, match="sent a malformed STATS "
                           "reply: STATS_REPLY: its tables are not"):
            client.read(table, clock=1)
        with pytest.raises(GeePSServerError, match="shard 0 .* sent a "
                           "malformed STATS reply: .*its tables are not"):
            client.shard_stats()


def test_requests_held_behind_a_recovery_time_out_saying_so():
    """The "restarted" shard welcomes the recovery's HELLO and never
    answers its DECLARE: what waits behind the recovery times out naming
    it, not asking whether the shard runs."""
    script = Restarting(lambda declare: None)
    with _worker_of(script, 1, heartbeat_interval=0.1) as client:
        table = client.create_table("t", 2, 2)
        script.restart()
        deadline = time.monotonic() + 5
        while 0 not in client._io.held and time.monotonic() < deadline:
            time.sleep(0.02)
        for call, what in ((client.shard_stats, "STATS"),
                           (lambda: client.create_table("u", 2, 2),
                            "creation of table 'u'")):
            with pytest.raises(GeePSTimeoutError, match=f"{what} waited 1.0 "
                               f"s: this worker's recovery of shard 0 "):
                call()
        with pytest.raises(GeePSTimeoutError, match="this worker's recovery "
                           "of shard 0 .* is not done"):
            client.read(table, clock=1)
        np.testing.assert_array_equal(client.read(table), 0)
