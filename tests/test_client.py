"""The worker client against thread shards: reads, updates, slack, indexes."""

import functools
import gc
import os
import re
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from keras_geeps import protocol, seal
from keras_geeps.client import GeePSClient
from keras_geeps.cluster import ClusterSpec, RowPartitioner
from keras_geeps.errors import GeePSError, GeePSTimeoutError
from keras_geeps.protocol import Message, MsgType
from keras_geeps.shard import ShardServer, ShardSettings
from tests.reliability.restarts import wait_for_checkpoint
from tests.worker_threads import run_clients


def test_partitioner_is_deterministic_and_balanced():
    a, b = RowPartitioner(3), RowPartitioner(3)
    sizes = [(1000, 512), (1, 40), (7, 4), (5000, 512), (2, 8)]
    placed_a = [a.place(*s) for s in sizes]
    assert placed_a == [b.place(*s) for s in sizes]
    assert placed_a[0] == [(0, 0, 333), (1, 333, 666), (2, 666, 1000)]
    assert len(placed_a[1]) == 1 and placed_a[1][0][0] == 0
    assert placed_a[2][0][0] == 1  # least-loaded shard takes small tables
    assert max(a.shard_bytes) - min(a.shard_bytes) <= 2 * 512 + 40


def test_cluster_spec_from_tf_config():
    spec = ClusterSpec.from_tf_config({
        "cluster": {"ps": ["h1:1", "h2:2"], "worker": ["w:1", "w:2", "w:3"]},
        "task": {"type": "worker", "index": 2}})
    assert spec.shards == ["tcp://h1:1", "tcp://h2:2"]
    assert (spec.num_workers, spec.worker_id) == (3, 2)
    with pytest.raises(ValueError, match="no cluster.ps"):
        ClusterSpec.from_tf_config({"cluster": {"worker": ["w:1"]}})
    chief = ClusterSpec.from_tf_config({
        "cluster": {"ps": ["h1:1"], "chief": ["c:1"], "worker": ["w:1"]},
        "task": {"type": "worker", "index": 0}})
    assert (chief.num_workers, chief.worker_id) == (2, 1)
    cluster = {"ps": ["h1:1"], "worker": ["w:1"], "evaluator": ["e:1"]}
    for config, pattern in [
            ("{not json", "TF_CONFIG is not JSON"),
            ({"cluster": cluster, "task": "worker"}, "task {type, index}"),
            ({"cluster": cluster, "task": {"type": "evaluator"}},
             "task is a 'evaluator': only chief and worker"),
            ({"cluster": cluster, "task": {"type": "ps", "index": 0}},
             "task is a 'ps'"),
            ({"cluster": cluster, "task": {"type": "worker", "index": "0"}},
             "index '0' is not an int"),
            ({"cluster": {"ps": [7000], "worker": ["w:1"]},  # (TypeError)
              "task": {"type": "worker", "index": 0}},
             "shard address 7000 is not a string")]:
        with pytest.raises(ValueError, match=pattern):
            ClusterSpec.from_tf_config(config)


def test_cluster_spec_from_env_names_a_bad_variable(monkeypatch):
    monkeypatch.setenv("KERAS_GEEPS_SHARDS", "h:1,h:2")
    monkeypatch.setenv("KERAS_GEEPS_NUM_WORKERS", "two")
    with pytest.raises(ValueError, match=r"\$KERAS_GEEPS_NUM_WORKERS is "
                                         r"'two', not an integer"):
        ClusterSpec.from_env()
    monkeypatch.setenv("KERAS_GEEPS_NUM_WORKERS", "2")
    monkeypatch.setenv("KERAS_GEEPS_WORKER_ID", "2")
    with pytest.raises(ValueError, match=r"worker_id 2 .*\(from "
                                         r"\$KERAS_GEEPS_SHARDS, "):
        ClusterSpec.from_env()  # (which variables: it said nothing)
    monkeypatch.setenv("KERAS_GEEPS_WORKER_ID", "1")
    assert ClusterSpec.from_env().worker_id == 1


def test_cluster_spec_names_an_address_that_is_not_tcp_host_port():
    assert ClusterSpec(["[::1]:7000", "tcp://h:65535"]).shards == [
        "tcp://[::1]:7000", "tcp://h:65535"]
    for bad in ("h", "h:", ":7000", "h:0", "h:65536", "h:x", "h:\u00b2",
                "ipc:///tmp/s", "tcp://h", "tcp://*:7000", "a b:7000"):
        with pytest.raises(ValueError, match=re.escape(
                f"shard address '{bad}' is not host:port")):
            ClusterSpec(["h:1", bad])
    with pytest.raises(ValueError, match="tcp://h:1 is listed twice "
                                         r"\(shards 0 and 2\)"):
        ClusterSpec(["h:1", "h:2", "tcp://h:1"])


def test_client_names_bad_settings_and_unknown_tables(thread_cluster):
    cluster = thread_cluster(1, 1)
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="timeout must be a number of "
                                             "seconds > 0"):
            cluster.client(0, timeout=bad)
    for kwargs, error, pattern in [
            ({"slack": -1}, ValueError, "slack must be an int >= 0, not -1"),
            ({"slack": 1.5}, ValueError, "slack must be an int >= 0"),
            ({"slack": "1"}, ValueError, "slack must be an int >= 0"),
            ({"timeout": "x"}, ValueError, "timeout must be a number"),
            ({"initializer": 1}, ValueError,
             r"initializer 1 is not in \[0, 1\)"),
            ({"chunk_bytes": 0}, ValueError, "chunk_bytes must be an int"),
            ({"heartbeat_interval": -1}, ValueError,
             r"heartbeat_interval must be a number of seconds >= 0 \(0: "
             r"none sent\)"),
            ({"max_log_clocks": 0}, ValueError, "max_log_clocks must be"),
            ({"curve": ("a", "b")}, TypeError, "ClientKeys"),
            ({"cluster": "tcp://127.0.0.1:1"}, TypeError,
             "cluster must be a ClusterSpec")]:
        with pytest.raises(error, match=pattern):
            GeePSClient(**dict({"cluster": cluster.spec(0)}, **kwargs))
    with cluster.client(0, timeout=5) as client:
        client.create_table("b", 2, 2)
        client.create_table("a", 2, 2)
        for call in (lambda: client.table("nope"),
                     lambda: client.read("nope"),
                     lambda: client.update("nope", np.ones((2, 2))),
                     lambda: client.clock(["a", "nope"])):
            with pytest.raises(KeyError, match=r"worker 0 has no table "
                                               r"'nope' \(its tables: "
                                               r"\['a', 'b'\]\)"):
                call()
        assert [t.clock for t in client.tables] == [0, 0]  # none clocked
        client.clock()
        np.testing.assert_array_equal(client.read("a", clock=1),
                                      np.zeros((2, 2)))


def test_bad_table_arguments_are_named_and_leave_nothing_behind(
        thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=5) as client:
        for args, kwargs, error, pattern in [
                ((5, 2, 2), {}, TypeError, "name is a str, got 5"),
                (("", 2, 2), {}, ValueError, "must not be empty"),
                (("t", 2.5, 2), {}, ValueError,
                 "table 't': rows must be an int >= 0, not 2.5"),
                (("t", 2, "2"), {}, ValueError,
                 "width must be an int >= 1, not '2'"),
                (("t", True, 2), {}, ValueError, "not True"),
                (("t", -1, 2), {}, ValueError, "rows must be an int >= 0"),
                (("t", 2, 0), {}, ValueError, "width must be an int >= 1"),
                (("t", 2, 2), {"dtype": "complex64"}, ValueError,
                 "cannot travel"),
                (("t", 2, 2), {"init": np.ones(3)}, ValueError,
                 "init has 3 elements, expected 4"),
                (("t", 2, 2), {"init": ["a"] * 4}, ValueError,
                 "init cannot be float32")]:
            with pytest.raises(error, match=pattern):
                client.create_table(*args, **kwargs)
        assert client.tables == []
        table = client.create_table("t", np.int64(2), np.int32(2))
        assert (table.rows, table.width) == (2, 2)
        assert type(table.rows) is int
        with pytest.raises(ValueError, match="exists already"):
            client.create_table("t", 2, 2)
        with pytest.raises(TypeError, match="a clock is an integer"):
            client.read(table, clock=0.5)
        with pytest.raises(ValueError, match="update of table 't' cannot"):
            client.update(table, [["a", "b"], ["c", "d"]])
        with pytest.raises(ValueError, match="out has shape"):
            client.read(table, out=np.empty((3, 2), np.float32))
        with pytest.raises(TypeError, match="takes a list of tables"):
            client.clock(3)
        client.update(table, np.ones((2, 2)))
        client.clock(table)  # one table, as well as a list of them
        np.testing.assert_array_equal(client.read(table, clock=1), 1.0)


def test_a_table_whose_creation_failed_moves_no_later_table(thread_cluster):
    """Tables are placed by the order they were created in, the same on
    every worker: one the creator failed to create (then made again) must
    not shift where the others go, or the workers' placements part."""
    cluster = thread_cluster(2, 2)
    with cluster.client(0, timeout=10) as first, \
            cluster.client(1, timeout=10) as second:
        with pytest.raises(ValueError, match="init has 3 elements"):
            first.create_table("a", 2, 2, init=np.ones(3))
        made = [first.create_table(name, 2, 2, init=np.full((2, 2), i))
                for i, name in enumerate("abc")]
        declared = [second.create_table(name, 2, 2) for name in "abc"]
        assert [t.parts for t in made] == [t.parts for t in declared]
        assert {t.parts[0][0] for t in made} == {0, 1}
        for i, table in enumerate(declared):
            np.testing.assert_array_equal(second.read(table), i)


def test_a_creation_one_shard_refused_keeps_its_id_from_later_tables(
        thread_cluster):
    """Shard 0 refuses a table split over both shards (no memory), shard 1
    takes it under its id: that id stays the name's, so later tables keep
    working (each took it again and was refused forever), and a retry of
    the name, with room made, goes through on it."""
    from keras_geeps.errors import GeePSServerError  # noqa: PLC0415
    cluster = thread_cluster(2, 1, settings=ShardSettings(
        max_table_bytes=600_000, shared_memory=False))
    with cluster.client(0, timeout=5, shared_memory=False) as client:
        client.create_table("small", 200, 250)  # 200 KB on shard 0
        with pytest.raises(GeePSServerError, match="memory limit"):
            client.create_table("big", 512, 256)  # 2 x 256 KiB
        assert [t.name for t in client.tables] == ["small"]
        with pytest.raises(KeyError):
            client.table("big")
        other = client.create_table("other", 10, 10)
        assert other.id == 2
        client.update(other, np.ones((10, 10)))
        client.clock([other])
        np.testing.assert_array_equal(client.read(other), 1.0)


def test_waits_that_time_out_keep_to_their_timeout(thread_cluster):
    """A read's timeout is its bound, diagnosis included (the STATS asked
    then took up to min(5, timeout) more); shard_stats takes its own."""
    cluster = thread_cluster(1, 2)
    with cluster.client(0, timeout=3) as client:
        table = client.create_table("t", 2, 2)
        client.clock()  # worker 1 never does
        started = time.monotonic()
        with pytest.raises(GeePSTimeoutError, match="workers \\[1\\]"):
            client.read(table)
        assert time.monotonic() - started < 3 + 0.6 + 1.5  # (it was 6)
        assert client.shard_stats(timeout=0.5)[0]["tables"]
        with pytest.raises(ValueError, match="timeout must be"):
            client.shard_stats(timeout=0)


def test_a_declaration_that_timed_out_can_be_tried_again(thread_cluster):
    """Worker 1 declares a table before the creator made it and gives up
    after its timeout; once the creator made it, the same call succeeds
    (it raised 'exists already' before)."""
    cluster = thread_cluster(1, 2)
    with cluster.client(1, timeout=10) as second, \
            cluster.client(0, timeout=10) as first:
        second.timeout = 1  # (only the call meant to time out)
        with pytest.raises(GeePSTimeoutError):
            second.create_table("t", 2, 2)
        second.timeout = 10
        first.create_table("t", 2, 2, init=np.full((2, 2), 3.0))
        table = second.create_table("t", 2, 2)
        assert table.id == 0
        np.testing.assert_array_equal(second.read(table), 3.0)


def test_bsp_sums_over_two_shards(thread_cluster):
    cluster = thread_cluster(2, 3)
    init = np.arange(700 * 100, dtype=np.float32).reshape(700, 100)

    def body(client, w):
        table = client.create_table("big", 700, 100, init=init)
        small = client.create_table("small", 2, 3, dtype="float64")
        assert len(table.parts) == 2 and len(small.parts) == 1
        for clk in range(6):
            expected = init + sum((v + 1) * c for v in range(3)
                                  for c in range(clk))
            np.testing.assert_array_equal(client.read(table), expected)
            np.testing.assert_array_equal(client.read(small),
                                          np.full((2, 3), 3.0 * clk))
            client.update(table, np.full((700, 100), (w + 1) * clk,
                                         np.float32))
            client.update(small, np.ones((2, 3)))
            client.clock()
        return client.read(table, clock=6)

    results = run_clients(cluster, body)
    expected = init + sum((v + 1) * c for v in range(3) for c in range(6))
    for w in range(3):
        np.testing.assert_array_equal(results[w], expected)


def test_virtual_iteration_row_subsets(thread_cluster):
    cluster = thread_cluster(2, 1)
    with cluster.client(0) as client:
        table = client.create_table("emb", 2000, 64)
        rows = np.array([1999, 3, 1000, 4, 5, 1001], np.int64)
        with client.virtual_iteration() as vi:
            h_read = vi.read(table, rows)
            h_update = vi.update(table, rows)
            vi.local("activations", 1024)
        assert [h.kind for h in client.access_plan] == ["read", "update",
                                                        "local"]
        assert len(h_read.parts) == 2  # rows on both shards, index prebuilt
        assert "activations" in client.access_plan.table_rows()
        for step in range(3):
            values = client.read(h_read)
            np.testing.assert_array_equal(values, np.full((6, 64), step))
            client.update(h_update, np.ones((6, 64), np.float32))
            client.clock()
        full = client.read(table)
        assert full[sorted(rows)].min() == 3 and full.sum() == 3 * 6 * 64
        with client.virtual_iteration() as vi:  # (rows [] waits for none)
            nothing = vi.read(table, np.array([], np.int64))
        assert client.read(nothing, clock=5).shape == (0, 64)
        with pytest.raises(ValueError, match="row 2000 is outside"):
            client.virtual_iteration().read(table, [2000])


def test_access_rows_are_ids_or_a_mask_and_nothing_else(thread_cluster):
    """An access's rows: integer ids (sorted, each once) or a boolean
    mask of the table's rows; a float id (which would be cut to another
    row), ids of another shape or a mask of another length are refused,
    naming the table. Accesses may name their table."""
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=5) as client:
        table = client.create_table("t", 4, 2, init=np.arange(8))
        vi = client.virtual_iteration()
        mask = np.array([True, False, True, False])
        for rows, expected in [([3, 1, 3], [1, 3]), (mask, [0, 2]),
                               (np.array([2], np.uint8), [2]), ([], [])]:
            handle = vi.read("t", rows)
            np.testing.assert_array_equal(handle.rows, expected)
            np.testing.assert_array_equal(
                client.read(handle), np.arange(8).reshape(4, 2)[expected])
        for rows, error, pattern in [
                ([1.5], TypeError, "'t' are integer ids, got float64"),
                (["a"], TypeError, "integer ids"),
                ([[1, 2]], ValueError, r"1-D list of row ids, got shape"),
                ([True, False], ValueError, r"one entry per row \(4\)"),
                ([-1, 2], ValueError, "row -1 is outside"),
                (np.array([2**64 - 1], np.uint64), ValueError,
                 "row 18446744073709551615 is outside")]:
            with pytest.raises(error, match=pattern):
                vi.update(table, rows)
        with pytest.raises(KeyError, match="no table 'nope'"):
            vi.read("nope")
        with pytest.raises(TypeError, match="a Table or a table name"):
            vi.read(0)


def test_ssp_reads_within_bound_and_exact_age(thread_cluster):
    cluster = thread_cluster(1, 2)
    slack = 2

    def body(client, w):
        table = client.create_table("t", 4, 4)
        seen = []
        for clk in range(12):
            age = client.wait_fresh(table)
            value = client.read(table)[0, 0]
            seen.append((clk, age, float(value)))
            if w == 1:
                threading.Event().wait(0.01)  # a slow worker
            client.update(table, np.ones((4, 4), np.float32))
            client.clock()
        return seen

    results = run_clients(cluster, body, slack=slack)
    for w, seen in results.items():
        for clk, age, value in seen:
            assert age >= clk - slack, (w, clk, age)
            # A push at age a holds exactly the clocks before a (2 workers).
            assert value >= 2 * (clk - slack), (w, clk, value)
    assert any(age < clk for clk, age, _ in results[0])  # stale reads happen


def test_read_my_writes(thread_cluster):
    cluster = thread_cluster(1, 2)

    def body(client, w):
        table = client.create_table("t", 2, 2)
        client.update(table, np.full((2, 2), w + 1.0, np.float32))
        mine = client.read(table)[0, 0]       # own update visible at once
        client.clock()
        client.update(table, np.full((2, 2), 10.0, np.float32))
        client.clock()
        fresh = client.read(table, clock=2 + 5)[0, 0]  # needs age 2
        return mine, fresh

    results = run_clients(cluster, body, slack=5, read_my_writes=True)
    assert results[0][0] == 1.0 and results[1][0] == 2.0
    # Both workers' clock-0 and clock-1 updates, never counted twice.
    assert results[0][1] == results[1][1] == 3.0 + 20.0


def test_worker_that_stops_clocking_is_named(thread_cluster):
    cluster = thread_cluster(1, 2)
    lazy_ready = threading.Event()
    done = threading.Event()

    def lazy():
        with cluster.client(1, timeout=10) as client:
            client.create_table("t", 2, 2)
            lazy_ready.set()
            done.wait(20)

    thread = threading.Thread(target=lazy)
    thread.start()
    try:
        with cluster.client(0, timeout=1.5) as client:
            table = client.create_table("t", 2, 2)
            lazy_ready.wait(10)
            client.clock()
            with pytest.raises(GeePSTimeoutError,
                               match=r"workers \[1\] have not finished "
                                     r"clock 0"):
                client.read(table)
    finally:
        done.set()
        thread.join(10)


def _push_chunk(table, age, row, value, rows=4):
    """A shard's PUSH chunk of `table` (width 2), as the I/O thread gets it."""
    return Message(MsgType.PUSH, table.id, clk=age,
                   arrays=[np.full((rows, 2), value, np.float32)],
                   meta={"row_start": 0, "chunk_row": row})


def _sealed(channels, message):
    """`message` sealed by one channel and opened, rows deferred, by the
    other: (message, sealed frames) as a sealed link hands them on."""
    sender, receiver = channels
    frames = [np.frombuffer(bytes(f), np.uint8).copy()
              for f in sender.seal(protocol.encode(message))]
    opened = receiver.open(frames, defer=True)
    return protocol.decode([opened[0]] + [f.sealed_view
                                          for f in opened[1:]]), opened[1:]


def test_a_push_sent_again_replaces_its_torn_chunks(thread_cluster):
    # A shard that dies mid-push leaves its first chunks with the worker;
    # restored, it pushes that age again: only the new chunks count.
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=2, heartbeat_interval=0) as client:
        table = client.create_table("t", 8, 2)
        chunk = functools.partial(_push_chunk, table)
        client._on_rows(0, chunk(5, 0, 7.0))  # torn after its first chunk
        client._on_rows(0, chunk(5, 0, 1.0))  # the same push again, whole
        client._on_rows(0, chunk(5, 4, 1.0))
        np.testing.assert_array_equal(client.read(table, clock=5),
                                      np.ones((8, 2)))
        client._on_rows(0, chunk(6, 4, 9.0))  # other chunking, then whole
        client._on_rows(0, chunk(6, 0, 2.0, rows=8))
        np.testing.assert_array_equal(client.read(table, clock=6),
                                      np.full((8, 2), 2.0))
        assert table.incoming[0][0] == -1  # nothing left half-assembled


def _waiting_read(client, table, out, clock):
    """Starts a read that waits; returns (thread, result dict) once its
    buffer is registered for delivery."""
    result = {}

    def read():
        try:
            result["rows"] = client.read(table, out=out, clock=clock)
        except Exception as exc:  # noqa: BLE001 (checked by the test)
            result["error"] = exc

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while table.delivery is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert table.delivery is not None, "the read did not wait"
    return thread, result


def test_a_waiting_read_gets_each_chunk_as_it_arrives(thread_cluster):
    """A read waiting for a push has its chunks put into its buffer as they
    come (a torn push's too, overwritten when it comes again), so nothing
    is left to copy once the last one is in."""
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10, heartbeat_interval=0) as client:
        table = client.create_table("t", 8, 2)
        chunk = functools.partial(_push_chunk, table)
        out = np.zeros((8, 2), np.float32)
        thread, result = _waiting_read(client, table, out, clock=5)
        client._on_rows(0, chunk(5, 0, 7.0))  # torn after its first chunk
        np.testing.assert_array_equal(out[:4], 7.0)  # there already
        client._on_rows(0, chunk(5, 0, 1.0))
        client._on_rows(0, chunk(5, 4, 1.0))
        thread.join(10)
        assert result["rows"] is out
        np.testing.assert_array_equal(out, np.ones((8, 2)))
        assert client.stats()["bytes_delivered"] == 3 * 32
        assert table.delivery is None
        # A read that did not wait copies from the cache.
        np.testing.assert_array_equal(client.read(table, clock=5), out)
        assert client.stats()["bytes_delivered"] == 3 * 32


def test_a_read_that_starts_mid_push_copies_it_whole(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10, heartbeat_interval=0) as client:
        table = client.create_table("t", 8, 2)
        client._on_rows(0, _push_chunk(table, 6, 0, 2.0))
        out = np.zeros((8, 2), np.float32)
        thread, result = _waiting_read(client, table, out, clock=6)
        client._on_rows(0, _push_chunk(table, 6, 4, 3.0))
        thread.join(10)
        np.testing.assert_array_equal(out, [[2.0, 2.0]] * 4 + [[3.0, 3.0]] * 4)
        assert result["rows"] is out


def test_a_read_that_gave_up_is_not_written_to(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10, heartbeat_interval=0) as client:
        table = client.create_table("t", 8, 2)
        out = np.zeros((8, 2), np.float32)
        client.timeout = 0.3  # (only the call meant to time out)
        with pytest.raises(GeePSTimeoutError):
            client.read(table, out=out, clock=5)
        assert table.delivery is None
        client._on_rows(0, _push_chunk(table, 5, 0, 1.0, rows=8))
        np.testing.assert_array_equal(out, 0.0)
        assert client.stats()["bytes_delivered"] == 0


def test_a_read_only_buffer_fails_the_read_not_the_io_thread(
        thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10, heartbeat_interval=0,
                        shared_memory=False) as client:
        table = client.create_table("t", 8, 2)
        client.update(table, np.ones((8, 2), np.float32))
        client.clock()
        frozen = np.zeros((8, 2), np.float32)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            client.read(table, out=frozen)
        client.update(table, np.ones((8, 2), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table), 2.0)
        # A chunk that claims to start before its part is refused too.
        client._on_rows(0, _push_chunk(table, 9, -4, 1.0))
        assert "beyond its part" in str(client._io.errors.pop())
        assert table.incoming[0][0] == -1


def test_sealed_rows_open_straight_into_a_waiting_read(thread_cluster):
    """From a sealed link, a waiting read's chunks are opened into its
    buffer (one pass, no copy after) and kept sealed in the cache, opened
    again only when wanted: into the next read's buffer, or in place for a
    part of them. (A chunk that does not authenticate ends the link:
    tests/reliability/test_reconnect.py.)"""
    keys = seal.new_session()
    channels = (seal.Channel(keys["session"], keys["s2c"], keys["c2s"]),
                seal.Channel(keys["session"], keys["c2s"], keys["s2c"]))
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10, heartbeat_interval=0) as client:
        table = client.create_table("t", 8, 2)

        def chunk(age, row, value):
            return _sealed(channels, _push_chunk(table, age, row, value))

        out = np.zeros((8, 2), np.float32)
        thread, result = _waiting_read(client, table, out, clock=5)
        client._on_rows(0, *chunk(5, 0, 1.0))
        client._on_rows(0, *chunk(5, 4, 2.0))
        thread.join(10)
        expected = np.array([[1.0, 1.0]] * 4 + [[2.0, 2.0]] * 4)
        np.testing.assert_array_equal(result["rows"], expected)
        assert client.stats()["bytes_delivered"] == 2 * 32
        # The cache kept the sealed rows: opened into the next buffer ...
        np.testing.assert_array_equal(client.read(table, clock=5), expected)
        # ... or, for some of their rows, in place (then kept opened).
        with client.virtual_iteration() as iteration:
            rows = iteration.read(table, rows=np.array([1, 6]))
        np.testing.assert_array_equal(client.read(rows, clock=5),
                                      expected[[1, 6]])
        assert client.read_shared(table, clock=5) is None  # two chunks
        np.testing.assert_array_equal(client.read(table, clock=5), expected)


def _memfds():
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "memfd:" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own descriptor)
            pass
    return count


def test_failed_construction_closes_what_it_opened():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = ClusterSpec([f"tcp://127.0.0.1:{port}"])
    gc.collect()  # earlier tests' shards
    memfds = _memfds()
    threads = set(threading.enumerate())  # earlier tests' may linger
    for _ in range(3):
        with pytest.raises(GeePSTimeoutError, match="did not answer HELLO"):
            GeePSClient(spec, timeout=0.3, shared_memory=True)
    gc.collect()
    assert _memfds() == memfds
    assert not [t for t in set(threading.enumerate()) - threads
                if t.name.startswith("geeps-io")]


def test_closed_client_raises_a_clear_error_and_wakes_waiters(
        thread_cluster):
    cluster = thread_cluster(1, 2)
    client = cluster.client(0, timeout=30)
    other = cluster.client(1, timeout=30)
    try:
        table = client.create_table("t", 2, 2)
        other.create_table("t", 2, 2)
        client.clock()
        errors = []

        def blocked_read():  # waits for worker 1, which never clocks
            try:
                client.read(table)
            except GeePSError as exc:
                errors.append(exc)

        reader = threading.Thread(target=blocked_read)
        reader.start()
        time.sleep(0.5)
        started = time.monotonic()
        client.close()
        reader.join(10)
        assert time.monotonic() - started < 8  # not the 30 s timeout
        assert len(errors) == 1 and "client is closed" in str(errors[0])
        assert not isinstance(errors[0], GeePSTimeoutError)
        for call in (lambda: client.update(table, np.ones((2, 2))),
                     client.clock, lambda: client.read(table),
                     client.shard_stats,
                     lambda: client.create_table("u", 2, 2)):
            with pytest.raises(GeePSError, match="worker 0: the client is "
                                                 "closed"):
                call()
        client.close()  # again: nothing happens
    finally:
        client.close()
        other.close()


def test_requests_that_time_out_leave_no_futures(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10, heartbeat_interval=0) as client:
        table = client.create_table("t", 2, 2)
        client.timeout = 0.5  # (only the calls meant to time out)
        cluster.stop()
        with pytest.raises(GeePSTimeoutError, match="did not answer STATS"):
            client.shard_stats()
        with pytest.raises(GeePSTimeoutError, match="does not answer"):
            client.read(table, clock=3)
        assert client._io._futures == {}


def test_row_chunks_fit_the_shards_message_limit(thread_cluster):

    cluster = thread_cluster(2, 1, settings=ShardSettings(
        max_message_bytes=256 << 10, shared_memory=False))
    with cluster.client(0, timeout=20, shared_memory=False) as client:
        assert client.chunk_bytes <= 256 << 10
        init = np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256)
        table = client.create_table("big", 4096, 256, init=init)  # 4 MiB
        client.update(table, np.ones((4096, 256), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table), init + 1)
        with pytest.raises(ValueError, match="one row of 1048576 bytes"):
            client.create_table("wide", 2, 1 << 18)


def test_a_stopped_job_fails_every_later_call_and_keeps_one_error(
        thread_cluster):
    """Worker 1 dies (stop mode): worker 0's read fails naming it, and so
    does every later call; the shard refuses each of worker 0's heartbeats
    meanwhile, and the client keeps one error, not one per heartbeat."""
    from keras_geeps.errors import GeePSWorkerFailedError  # noqa: PLC0415

    cluster = thread_cluster(1, 2, settings=ShardSettings(
        worker_timeout=1.0, shared_memory=False))
    survivor = cluster.client(0, timeout=20, heartbeat_interval=0.05)
    doomed = cluster.client(1, timeout=20, heartbeat_interval=0.05)
    table = survivor.create_table("t", 4, 4)
    doomed.create_table("t", 4, 4)
    doomed._io.close()  # it dies: its heartbeats stop
    survivor.clock()
    with pytest.raises(GeePSWorkerFailedError, match="worker 1"):
        survivor.read(table, clock=1)
    deadline = time.monotonic() + 10  # a few heartbeats refused, then
    while survivor._io.heartbeat_interval:  # none sent
        assert time.monotonic() < deadline, "heartbeats go on"
        time.sleep(0.05)
    assert not survivor._io.errors
    for _ in range(2):
        with pytest.raises(GeePSWorkerFailedError, match="worker 1"):
            survivor.update(table, np.ones((4, 4), np.float32))
    survivor.close()
    doomed.close()


def test_heartbeats_come_well_within_a_shards_worker_timeout(
        thread_cluster):
    """A shard that declares workers silent for 1.5 s dead: the worker's
    default 1 s heartbeat is lowered to 0.5 s (the WELCOME says the
    timeout), so an idle worker is not taken for dead."""

    cluster = thread_cluster(1, 1, settings=ShardSettings(
        worker_timeout=1.5, shared_memory=False))
    with cluster.client(0, timeout=10) as client:
        assert client._io.heartbeat_interval == pytest.approx(0.5)
        table = client.create_table("t", 2, 2)
        time.sleep(4.0)  # (an idle worker, past two timeouts)
        client.update(table, np.ones((2, 2), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table), 1.0)
        assert cluster.shards[0].snapshot_stats()["dead_workers"] == []


def test_the_replay_log_bound_lies_between_two_checkpoints_and_a_replay(
        tmp_path, thread_cluster):
    """max_log_clocks holds at least the K clocks between two checkpoints
    and at most the max_pending_clocks + 1 a restarted shard takes in a
    replay; by default min(4 K + slack, max_pending_clocks + 1)."""

    cluster = thread_cluster(1, 1, settings=ShardSettings(
        shared_memory=False, checkpoint_dir=str(tmp_path),
        checkpoint_every=5, max_pending_clocks=30))
    for bad in (4, 32):
        with pytest.raises(ValueError, match=r"max_log_clocks=\d+ must be "
                                             r"in \[5, 31\]"):
            cluster.client(0, timeout=10, max_log_clocks=bad)
    for slack, default in ((0, 20), (3, 23), (20, 31)):
        with cluster.client(0, timeout=10, slack=slack) as client:
            assert client._max_log_clocks == default


def test_shards_checkpointing_at_different_intervals_are_refused(tmp_path):
    """Shards that checkpoint at different intervals (or only some) would
    hold no consistent checkpoint of the job: connecting says so."""

    servers = [ShardServer("tcp://127.0.0.1:0", i, 2, 1, ShardSettings(
        shared_memory=False, checkpoint_dir=str(tmp_path / str(i)),
        checkpoint_every=every)).start() for i, every in enumerate((5, 0))]
    try:
        with pytest.raises(GeePSError, match=r"checkpoint-every \[5, 0\]"):
            GeePSClient(ClusterSpec([s.address for s in servers]),
                        timeout=10)
    finally:
        for server in servers:
            server.stop()


def test_a_shard_that_welcomed_hears_heartbeats_while_another_is_late():
    """A worker waits for every shard's WELCOME (one may still be loading a
    large checkpoint); a shard that already welcomed it gets heartbeats
    meanwhile, well within its worker_timeout as soon as that WELCOME
    comes (whatever the worker's heartbeat_interval), and does not count
    it dead."""
    early = ShardServer("tcp://127.0.0.1:0", 0, 2, 1, ShardSettings(
        worker_timeout=1.0, shared_memory=False)).start()
    with socket.socket() as probe:  # a free port for the late shard
        probe.bind(("127.0.0.1", 0))
        late_address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    late = []
    starter = threading.Timer(3.0, lambda: late.append(ShardServer(
        late_address, 1, 2, 1, ShardSettings(shared_memory=False)).start()))
    starter.start()
    try:
        with GeePSClient(ClusterSpec([early.address, late_address], 1, 0),
                         timeout=20, shared_memory=False,
                         heartbeat_interval=2.0) as client:
            table = client.create_table("t", 8, 4)
            client.update(table, np.ones((8, 4), np.float32))
            client.clock()
            np.testing.assert_array_equal(client.read(table, clock=1), 1.0)
        assert early.snapshot_stats()["dead_workers"] == []
    finally:
        starter.join()
        early.stop()
        for server in late:
            server.stop()


def test_a_worker_that_fails_to_connect_leaves_the_shards_it_reached():
    """Shard 1 never answers the HELLO: the client fails naming it, and
    shard 0, which welcomed the worker and declares silent workers dead,
    hears it leave instead of stopping the job for its silence."""
    shard = ShardServer("tcp://127.0.0.1:0", 0, 2, 1, ShardSettings(
        worker_timeout=1.0, shared_memory=False)).start()
    context = zmq.Context()
    mute = context.socket(zmq.ROUTER)  # up, never answering
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(GeePSTimeoutError, match="shard 1 .* did not "
                           "answer HELLO within 1.0 s"):
            GeePSClient(ClusterSpec([shard.address,
                                     f"tcp://127.0.0.1:{port}"], 1, 0),
                        timeout=1.0, shared_memory=False)
        time.sleep(2.0)  # past its worker_timeout
        stats = shard.snapshot_stats()
        assert (stats["left_workers"], stats["failed"]) == ([0], None)
    finally:
        mute.close()
        context.term()
        shard.stop()


def test_close_sends_the_last_clock_before_its_sockets_go(thread_cluster):
    """update, clock, close(): the last clock's 1 MiB update and CLOCK
    were still in ZeroMQ's queues when the sockets closed without
    lingering, and the other worker waited for them until its timeout
    (2 to 8 of 20 trials). Every trial must see them."""
    for trial in range(20):
        cluster = thread_cluster(1, 2, settings=ShardSettings(
            shared_memory=False))
        w1 = cluster.client(1, timeout=5, shared_memory=False)
        w0 = cluster.client(0, timeout=5, shared_memory=False)
        t0 = w0.create_table("t", 256, 1024)
        t1 = w1.create_table("t", 256, 1024)
        w0.update(t0, np.ones((256, 1024)))
        w0.clock()
        w0.close()
        w1.clock()
        np.testing.assert_array_equal(w1.read(t1)[:2, :4], 1, str(trial))
        w1.close()
        cluster.stop()


def test_foreign_tables_repeated_tables_and_lossy_outs_are_refused(
        thread_cluster):
    first, second = thread_cluster(1, 1), thread_cluster(1, 1)
    with first.client(0, timeout=10) as a, second.client(0, timeout=10) as b:
        ta = a.create_table("t", 2, 2)
        b.create_table("t", 2, 2)
        for call in (lambda: b.update(ta, np.ones((2, 2))),
                     lambda: b.read(ta),
                     lambda: b.clock([ta])):
            with pytest.raises(ValueError, match="belongs to another client"):
                call()
        with pytest.raises(ValueError, match="got a table twice"):
            a.clock([ta, "t"])
        assert ta.clock == 0
        a.update(ta, np.full((2, 2), 5.75))
        a.clock()
        with pytest.raises(ValueError, match="would convert"):
            a.read(ta, out=np.zeros((2, 2), np.int32))
        with pytest.raises(ValueError, match="clocks start at 0"):
            a.read(ta, clock=-7)
        np.testing.assert_array_equal(a.read(ta), 5.75)


def test_updates_and_inits_a_conversion_would_change_are_refused(
        thread_cluster):
    """A value the table's dtype cannot hold is refused, naming the table,
    instead of truncated or wrapped (0.5 -> 0, 1e10 -> -2**31)."""
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10) as client:
        counts = client.create_table("counts", 2, 2, dtype="int32")
        for delta, pattern in (
                (np.full((2, 2), 0.5), r"it holds float64 values"),
                (np.full((2, 2), 1e10), r"it holds float64 values"),
                (np.full((2, 2), 2**40), r"it holds values in "
                                         r"\[1099511627776, 1099511627776\],"
                                         r" beyond")):
            with pytest.raises(ValueError, match="update of table 'counts' "
                                                 "cannot be int32: " +
                                                 pattern):
                client.update(counts, delta)
        with pytest.raises(ValueError, match=r"table 'g': init cannot be "
                                             r"int32: it holds float64"):
            client.create_table("g", 1, 2, dtype="int32",
                                init=[np.nan, 2.7])
        client.update(counts, [[1, 2], [3, 4]])        # python ints
        client.update(counts, np.ones((2, 2), np.uint8))
        pixels = client.create_table("pixels", 1, 2, dtype="uint8",
                                     init=[[1, 2]])    # python ints
        client.update(pixels, np.array([[3, 4]], np.int32))
        with pytest.raises(ValueError, match=r"update of table 'pixels' "
                           r"cannot be uint8: it holds values in \[-1, 4\],"
                           r" beyond \[0, 255\]"):
            client.update(pixels, [[-1, 4]])
        floats = client.create_table("floats", 2, 2)   # float32
        client.update(floats, np.full((2, 2), 0.25))   # float64: rounds
        client.clock()
        np.testing.assert_array_equal(client.read(counts),
                                      [[2, 3], [4, 5]])
        np.testing.assert_array_equal(client.read(floats), 0.25)
        np.testing.assert_array_equal(client.read(pixels), [[4, 6]])


def test_a_shard_list_in_another_order_is_refused_at_once(thread_cluster):
    """A worker whose shard list is out of order (or names a shard twice)
    would place tables on the wrong shards and time out later, blaming
    another worker: the shards' WELCOME names who they are."""
    cluster = thread_cluster(2, 1, settings=ShardSettings(
        worker_timeout=30, shared_memory=False))
    shards = list(cluster.spec(0).shards)
    host, port = shards[0].rsplit(":", 1)
    for wrong in (shards[::-1], [shards[0], "tcp://localhost:" + port]):
        started = time.monotonic()
        with pytest.raises(GeePSError, match=r"the cluster's shard 0, says "
                           r"it is shard 1|the cluster's shard 1, says it "
                           r"is shard 0"):
            GeePSClient(ClusterSpec(wrong, 1, 0), timeout=10)
        assert time.monotonic() - started < 5  # not a timeout
        if wrong == shards[::-1]:
            # Every shard that welcomed it heard it leave (its silence is
            # no death, which would stop the job). (Named twice, shard 0
            # has two connections of the worker, which take its place from
            # each other: the one it heard last decides.)
            for shard in cluster.shards:
                assert shard.snapshot_stats()["left_workers"] == [0]
    with cluster.client(0, timeout=10) as client:  # the right order works
        client.create_table("t", 4, 2)


def test_local_handles_and_non_array_outs_are_named(thread_cluster):
    cluster = thread_cluster(1, 1)
    with cluster.client(0, timeout=10) as client:
        table = client.create_table("t", 2, 2)
        with client.virtual_iteration() as vi:
            local = vi.local("activations", 1024)
        for call in (lambda: client.read(local),
                     lambda: client.update(local, np.ones((2, 2)))):
            with pytest.raises(TypeError, match="is a local access"):
                call()
        with pytest.raises(TypeError, match="out must be a numpy array, "
                                            "got list"):
            client.read(table, out=[[0, 0], [0, 0]])


def _mapped_memfd_bytes():
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "memfd:" in line:
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                total += high - low
    return total


def test_a_closed_client_kept_as_an_object_holds_no_table_memory(
        process_cluster):
    """Its cached rows, upload buffers and mappings of the shard's buffers
    go at close(), not when the object is collected, and so do their
    descriptors, which kept the memory of every closed client (one
    16 MiB upload buffer each) with nothing mapping it."""
    cluster = process_cluster(1, 1, output=None)
    gc.collect()
    before = _mapped_memfd_bytes()
    memfds = _memfds()
    kept = []
    for _ in range(2):
        client = cluster.client(0, timeout=30, shared_memory=True)
        table = client.create_table("big", 1024, 4096)  # 16 MiB
        client.update(table, np.ones((1024, 4096), np.float32))
        client.clock()
        client.read(table)
        assert _mapped_memfd_bytes() - before >= 16 << 20
        client.close()
        kept.append(client)
        gc.collect()
        assert _mapped_memfd_bytes() - before < 1 << 20
        assert _memfds() == memfds
        with pytest.raises(GeePSError, match="the client is closed"):
            client.read(table)


def test_a_clock_that_times_out_clocks_no_table(tmp_path):
    """Table a's shard writes checkpoints, table b's cannot (its folder
    became a file): b's replay log fills and clock() times out. It used to
    have clocked a already, leaving the tables a clock apart for good."""
    folders = [tmp_path / "a", tmp_path / "b"]
    shards = [ShardServer("tcp://127.0.0.1:0", i, 2, 1, ShardSettings(
        shared_memory=False, checkpoint_dir=str(folders[i]),
        checkpoint_every=1)).start() for i in range(2)]
    try:
        with GeePSClient(ClusterSpec([s.address for s in shards], 1, 0),
                         timeout=2, max_log_clocks=2) as client:
            a = client.create_table("a", 2, 2)
            b = client.create_table("b", 2, 2)
            assert [a.parts[0][0], b.parts[0][0]] == [0, 1]
            for table in (a, b):  # their first checkpoints
                wait_for_checkpoint(client, table, 0)
            folders[1].rename(tmp_path / "away")
            folders[1].write_bytes(b"")
            with pytest.raises(GeePSTimeoutError, match="table 'b'"):
                for _ in range(4):
                    client.update(a, np.ones((2, 2)))
                    client.update(b, np.ones((2, 2)))
                    client.clock()
            assert a.clock == b.clock
    finally:
        for shard in shards:
            shard.stop()


def test_close_is_bounded_when_the_io_thread_hangs():
    """An I/O thread stuck in a turn kept its sockets open, and
    close()'s context.term() waited for them with no bound."""
    from keras_geeps.client.connection import CLOSE_LINGER_S, IOThread
    release = threading.Event()
    io = IOThread(["tcp://127.0.0.1:1"], lambda *_: None,
                  on_turn=lambda: release.wait(60), name="geeps-io-stuck")
    try:
        time.sleep(0.2)  # in its first turn
        started = time.monotonic()
        io.close(timeout=0.5)
        assert time.monotonic() - started < 0.5 + CLOSE_LINGER_S + 2
    finally:
        release.set()
