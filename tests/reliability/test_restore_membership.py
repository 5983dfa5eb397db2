"""A shard restored after a worker left, died or rejoined loses nothing.

Workers replay to a restored shard the updates its checkpoint lacks, but
a worker that left (closed its client) or died took its replay log along,
and one that rejoined holds nothing from before it rejoined. The shard
therefore snapshots each table at that worker's clock and writes it (a
LEAVE is answered once that checkpoint is on disk). These tests SIGKILL
a real shard process after each event and restore it: the tables end as
without the kill (counter tables: every worker adds 1 each clock).
"""

import threading
import time

import numpy as np
import pytest

from keras_geeps import checkpoint
from keras_geeps.client import client as client_module
from keras_geeps.errors import GeePSTimeoutError
from keras_geeps.launch import LocalCluster

pytestmark = pytest.mark.slow

ROWS, WIDTH = 4, 4


def _cluster(directory, policy, worker_timeout="1.5", every="2"):
    return LocalCluster(1, 2, processes=True, output=None, shard_args=[
        "--checkpoint-dir", str(directory), "--checkpoint-every", every,
        "--on-worker-failure", policy, "--worker-timeout", worker_timeout])


def _clients(cluster):
    clients = [cluster.client(w, timeout=15, heartbeat_interval=0.2)
               for w in range(2)]
    return clients, [c.create_table("t", ROWS, WIDTH) for c in clients]


def _step(pairs):
    for client, table in pairs:
        client.update(table, np.ones((ROWS, WIDTH), np.float32))
        client.clock()


def _on_disk(directory):
    """(clock, value) of the table in the shard's latest checkpoint;
    (-1, None) while no checkpoint holds it yet."""
    tables = checkpoint.load(str(directory), 0, 1, 2)
    if 0 not in tables:
        return -1, None
    return tables[0][1], float(tables[0][2][0, 0])


def _wait_on_disk(directory, clock):
    deadline = time.monotonic() + 10
    while _on_disk(directory)[0] < clock:
        assert time.monotonic() < deadline, _on_disk(directory)
        time.sleep(0.05)


def _restart(cluster):
    victim = cluster.shards[0]
    victim.kill()
    cluster.shards[0] = victim.restart(["--restore"])


def _new_worker_1_then_restore(cluster, clients, tables, directory, want):
    """A new process of worker 1 joins at clock 3; once a checkpoint at 3
    is on disk the shard is killed and restored, both workers do clock 4
    and read `want` in every cell."""
    clients[1] = cluster.client(1, timeout=15, heartbeat_interval=0.2)
    tables[1] = clients[1].create_table("t", ROWS, WIDTH)
    assert tables[1].clock == 3
    _wait_on_disk(directory, 3)
    _restart(cluster)
    _step(zip(clients, tables))
    for client, table in zip(clients, tables):
        np.testing.assert_array_equal(client.read(table, clock=4),
                                      np.full((ROWS, WIDTH), want))
    _close_all(clients)


def _close_all(clients):
    for client in clients:
        client.close()


@pytest.mark.parametrize("policy,worker_timeout", [
    ("stop", "1.5"), ("continue", "1.5"), ("stop", "0")])
def test_a_worker_that_left_keeps_its_updates(tmp_path, policy,
                                              worker_timeout):
    """Worker 1 finishes clock 3 (past the clock-2 checkpoint) and leaves;
    its close returns once a checkpoint at 3 is on disk, so a restore
    keeps its clock-2 update and the job neither stops blaming it nor
    drops it. Also where the shard watches for no silent workers
    (--worker-timeout 0): the LEAVE is for the checkpoint all the same."""
    cluster = _cluster(tmp_path, policy, worker_timeout)
    try:
        clients, tables = _clients(cluster)
        for _ in range(3):
            _step(zip(clients, tables))
        assert clients[0].read(tables[0], clock=3)[0, 0] == 6.0
        clients[1].close()
        assert _on_disk(tmp_path) == (3, 6.0)
        _restart(cluster)
        np.testing.assert_array_equal(
            clients[0].read(tables[0], clock=3), np.full((ROWS, WIDTH), 6))
        stats = clients[0].shard_stats()[0]
        assert stats["failed"] is None and stats["left_workers"] == [1]
        assert stats["tables"]["0"]["vclock"] == [3, 3]
        clients[0].close()
    finally:
        cluster.stop()


def test_a_worker_leaving_ahead_waits_while_its_shard_is_up(tmp_path,
                                                            monkeypatch):
    """Worker 1 finishes clock 3 and closes while worker 0 has not begun
    (it starts 2 s later, past the LEAVE wait): the shard is up, so the
    close waits for the checkpoint at 3 instead of dropping its replay
    log. A restore right after the close keeps all of worker 1's
    updates."""
    monkeypatch.setattr(client_module, "LEAVE_WAIT_S", 0.5)
    cluster = _cluster(tmp_path, "continue")
    try:
        clients, tables = _clients(cluster)
        _step([(clients[1], tables[1])] * 3)
        late = threading.Thread(target=lambda: (
            time.sleep(2), _step([(clients[0], tables[0])] * 3)))
        late.start()
        started = time.monotonic()
        clients[1].close()
        assert time.monotonic() - started > 1.5
        _restart(cluster)
        late.join()
        np.testing.assert_array_equal(
            clients[0].read(tables[0], clock=3), np.full((ROWS, WIDTH), 6))
        clients[0].close()
    finally:
        cluster.stop()


def test_a_shard_restarted_while_a_worker_waits_to_leave_recovers(
        tmp_path, monkeypatch):
    """Worker 1 finishes clock 6 and closes while worker 0 is at 4 (the
    checkpoint at 4 written); the shard is killed and restored while the
    close waits for the checkpoint at 6. The closing client's heartbeats
    go on to that shard, so it recovers it and replays clocks 4 and 5;
    the checkpoint at 4 does not count worker 1 as left (it would have
    been left behind there, and the job stopped): worker 0 reads both
    workers' 6 clocks, and the close returns."""
    monkeypatch.setattr(client_module, "LEAVE_WAIT_S", 0.5)
    cluster = _cluster(tmp_path, "stop")
    try:
        clients, tables = _clients(cluster)
        _step([(clients[1], tables[1])] * 6)
        for _ in range(4):
            _step([(clients[0], tables[0])])
            clients[0].read(tables[0])
        _wait_on_disk(tmp_path, 4)
        closing = threading.Thread(target=clients[1].close)
        closing.start()
        time.sleep(1.5)  # past the LEAVE wait: waiting for the checkpoint
        assert closing.is_alive()
        assert checkpoint.load_job(str(tmp_path), 0, 1, 2)[1] == set()
        _restart(cluster)
        _step([(clients[0], tables[0])] * 2)
        np.testing.assert_array_equal(
            clients[0].read(tables[0], clock=6), np.full((ROWS, WIDTH), 12))
        closing.join(10)
        assert not closing.is_alive()
        assert checkpoint.load_job(str(tmp_path), 0, 1, 2)[1] == {1}
        clients[0].close()
    finally:
        cluster.stop()


def test_a_dead_workers_updates_survive_a_restore(tmp_path):
    """Under "continue" worker 1 dies after clock 3: the shard snapshots
    at 3 as it stops waiting for it, so a restore keeps its clock-2
    update, and the job goes on with worker 0."""
    cluster = _cluster(tmp_path, "continue")
    try:
        clients, tables = _clients(cluster)
        for _ in range(3):
            _step(zip(clients, tables))
        clients[1]._io.close()  # dies: no LEAVE, no heartbeats
        _wait_on_disk(tmp_path, 3)
        assert _on_disk(tmp_path) == (3, 6.0)
        _restart(cluster)
        _step([(clients[0], tables[0])])
        np.testing.assert_array_equal(
            clients[0].read(tables[0], clock=4), np.full((ROWS, WIDTH), 7))
        clients[0].close()
    finally:
        cluster.stop()


def test_a_rejoined_worker_recovers_from_a_restore(tmp_path):
    """Worker 1 dies after clock 2, worker 0 does clock 2 alone, a new
    worker 1 rejoins at clock 3: the shard snapshots there, so a restore
    does not ask the new process for updates it never made, and both
    workers go on."""
    cluster = _cluster(tmp_path, "continue")
    try:
        clients, tables = _clients(cluster)
        for _ in range(2):
            _step(zip(clients, tables))
        clients[1]._io.close()
        deadline = time.monotonic() + 15
        while clients[0].shard_stats()[0]["dead_workers"] != [1]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        _step([(clients[0], tables[0])])
        assert clients[0].read(tables[0], clock=3)[0, 0] == 5.0
        _new_worker_1_then_restore(cluster, clients, tables, tmp_path, 7)
    finally:
        cluster.stop()


def test_a_worker_replaced_between_clocks_leaves_nothing_to_replay(tmp_path):
    """Worker 1's process dies after clock 3, before the shard notices,
    and a new process of it carries on in its place at 3. It holds no
    updates from before it started, so the shard snapshots at 3 as it
    takes over: a restore from that checkpoint asks it for nothing it
    never made, and both go on."""
    cluster = _cluster(tmp_path, "stop", worker_timeout="60")
    try:
        clients, tables = _clients(cluster)
        for _ in range(3):
            _step(zip(clients, tables))
        # (the shard has every clock: one it had not would be unfinished)
        assert clients[0].read(tables[0], clock=3)[0, 0] == 6.0
        clients[1]._io.close()  # dies between clocks: no LEAVE
        _new_worker_1_then_restore(cluster, clients, tables, tmp_path, 8)
    finally:
        cluster.stop()


def test_a_worker_gone_for_good_stays_gone_after_a_restore(tmp_path):
    """Under "continue" with no silence watch (--worker-timeout 0),
    worker 1 leaves after clock 1 and worker 0 goes on past it: worker 1
    counts as dead. Checkpoints remember it, so the restored shard does
    not wait for its clocks (which no silence watch would ever end)."""
    cluster = _cluster(tmp_path, "continue", worker_timeout="0")
    try:
        clients, tables = _clients(cluster)
        _step(zip(clients, tables))
        clients[1].close()
        for _ in range(2):
            _step([(clients[0], tables[0])])
        deadline = time.monotonic() + 10
        while checkpoint.load_job(str(tmp_path), 0, 1, 2)[1:] != (
                set(), {1}) or _on_disk(tmp_path)[0] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _restart(cluster)
        _step([(clients[0], tables[0])])
        np.testing.assert_array_equal(
            clients[0].read(tables[0], clock=4), np.full((ROWS, WIDTH), 5))
        assert clients[0].shard_stats()[0]["dead_workers"] == [1]
        clients[0].close()
    finally:
        cluster.stop()


def test_a_read_timing_out_in_a_recovery_says_so(tmp_path):
    """Worker 1 hangs (its connections gone, and the shard watches for no
    silent workers), so it never replays to the restarted shard, and
    worker 0's recovery waits for its replay. A read of worker 0 that
    times out meanwhile says the recovery is not done; it named the shard
    dead before (its diagnostic STATS waited behind the recovery)."""
    cluster = _cluster(tmp_path, "continue", worker_timeout="0", every="4")
    try:
        fast = cluster.client(0, timeout=4, heartbeat_interval=0.2)
        idle = cluster.client(1, timeout=4, heartbeat_interval=0)
        pairs = [(c, c.create_table("t", ROWS, WIDTH)) for c in (fast, idle)]
        for _ in range(6):
            _step(pairs)
        fast.read(pairs[0][1], clock=6)
        _wait_on_disk(tmp_path, 4)
        idle._io.close()
        _restart(cluster)  # at 4: worker 0 replays 4, 5 once 1 replays 4
        _step(pairs[:1])
        with pytest.raises(GeePSTimeoutError,
                           match=r"recovery of shard 0 \(.*\), restarted "
                                 r"or reconnected, is not done"):
            fast.read(pairs[0][1], clock=7)
    finally:
        cluster.stop()


def test_a_shard_that_answered_a_leave_hears_no_more_of_the_worker(
        tmp_path, monkeypatch):
    """Two shards; the table lives on shard 0, so shard 1 answers worker
    1's LEAVE at once while shard 0 waits for its checkpoint at 6. Shard
    1 is restarted meanwhile: the closing client's heartbeats go only to
    shard 0, which has yet to answer. Heard from again, shard 1 would
    take worker 1 back as a member (its recovery says HELLO), and then,
    once the client is closed, as a dead one: the job would stop."""
    monkeypatch.setattr(client_module, "LEAVE_WAIT_S", 0.5)
    cluster = LocalCluster(2, 2, processes=True, output=None, shard_args=[
        "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2",
        "--on-worker-failure", "stop", "--worker-timeout", "1.5"])
    try:
        clients, tables = _clients(cluster)
        assert [shard for shard, _, _ in tables[0].parts] == [0]
        _step([(clients[1], tables[1])] * 6)
        for _ in range(4):
            _step([(clients[0], tables[0])])
        closing = threading.Thread(target=clients[1].close)
        closing.start()
        deadline = time.monotonic() + 10
        while checkpoint.load_job(str(tmp_path), 1, 2, 2)[1] != {1}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)  # past the LEAVE wait: waiting for shard 0
        assert closing.is_alive()
        cluster.shards[1].kill()
        cluster.shards[1] = cluster.shards[1].restart(["--restore"])
        time.sleep(1.0)  # heartbeats of the closing client: 0.2 s apart
        _step([(clients[0], tables[0])] * 2)
        closing.join(10)
        assert not closing.is_alive()
        time.sleep(2.0)  # past shard 1's worker_timeout
        stats = clients[0].shard_stats()
        assert [s["failed"] for s in stats] == [None, None]
        assert [s["left_workers"] for s in stats] == [[1], [1]]
        np.testing.assert_array_equal(
            clients[0].read(tables[0], clock=6), np.full((ROWS, WIDTH), 12))
        clients[0].close()
    finally:
        cluster.stop()
