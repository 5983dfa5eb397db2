"""Shard checkpoints, SIGKILL + restore with replay, worker failure."""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from keras_geeps import checkpoint, protocol
from keras_geeps.errors import (GeePSError, GeePSTimeoutError,
                                GeePSWorkerFailedError)
from keras_geeps.launch import LocalCluster
from keras_geeps.shard import ShardSettings
from tests.reliability.restarts import (ask_across_a_restart,
                                        counted_to_a_checkpoint,
                                        killed_one_clock_past_a_checkpoint,
                                        wait_for_checkpoint,
                                        wait_for_shard_checkpoint)
from tests.worker_threads import run_worker_threads

pytestmark = pytest.mark.slow


def test_checkpoint_write_is_atomic_and_round_trips(tmp_path, monkeypatch):
    spec = {"name": "t", "rows": 4, "width": 3, "dtype": "float32",
            "row_start": 0, "row_end": 4}
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    checkpoint.write(tmp_path, 0, 2, 3, {7: (spec, 10, rows)})
    loaded = checkpoint.load(tmp_path, 0, 2, 3)
    assert loaded[7][0] == spec and loaded[7][1] == 10
    np.testing.assert_array_equal(loaded[7][2], rows)

    # A crash between writing the temporary file and the rename leaves the
    # old checkpoint readable.
    def crash(src, dst):
        raise OSError("power cut")
    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        checkpoint.write(tmp_path, 0, 2, 3, {7: (spec, 20, rows + 1)})
    monkeypatch.undo()
    loaded = checkpoint.load(tmp_path, 0, 2, 3)
    assert loaded[7][1] == 10
    np.testing.assert_array_equal(loaded[7][2], rows)
    assert [p.name for p in tmp_path.iterdir()] == [
        "shard-0-of-2.ckpt.npz"]  # no temporary left behind
    with pytest.raises(checkpoint.CheckpointError, match="num_workers=3"):
        checkpoint.load(tmp_path, 0, 2, 4)
    (tmp_path / "shard-0-of-2.ckpt.npz").write_bytes(b"torn")
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint"):
        checkpoint.load(tmp_path, 0, 2, 3)
    # Rows of another dtype than the spec's are refused, not converted.
    checkpoint.write(tmp_path, 0, 2, 3, {7: (spec, 10, rows.astype(float))})
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"table_7 holds float64 \(4, 3\), not "
                             r"float32 \(4, 3\)"):
        checkpoint.load(tmp_path, 0, 2, 3)
    bf16 = dict(spec, dtype="bfloat16")
    rows16 = rows.astype(protocol.numpy_dtype("bfloat16"))
    checkpoint.write(tmp_path, 0, 2, 3, {7: (bf16, 10, rows16)})
    np.testing.assert_array_equal(checkpoint.load(tmp_path, 0, 2, 3)[7][2],
                                  rows16)
    # What a checkpoint says is checked as a CREATE's spec is, not trusted.
    for bad, says in ((dict(spec, row_end=5), "row range"),
                      (dict(spec, width=0), "width must be >= 1"),
                      (dict(spec, extra=1), "a spec has exactly"),
                      (dict(spec, name="n" * 2000), "name must be")):
        checkpoint.write(tmp_path, 0, 2, 3, {7: (bad, 10, rows)})
        with pytest.raises(checkpoint.CheckpointError, match=says):
            checkpoint.load(tmp_path, 0, 2, 3)
    for clock in (-1, 1 << 62):
        checkpoint.write(tmp_path, 0, 2, 3, {7: (spec, clock, rows)})
        with pytest.raises(checkpoint.CheckpointError, match="clock"):
            checkpoint.load(tmp_path, 0, 2, 3)
    # Who left and who died travel with the tables; older files (neither
    # key) say nobody did.
    checkpoint.write(tmp_path, 0, 2, 3, {7: (spec, 10, rows)}, left=[2, 0],
                     dead=[1])
    assert checkpoint.load_job(tmp_path, 0, 2, 3)[1:] == ({0, 2}, {1})
    checkpoint.write(tmp_path, 0, 2, 3, {7: (spec, 10, rows)})
    assert checkpoint.load_job(tmp_path, 0, 2, 3)[1:] == (set(), set())
    _rewrite_meta(tmp_path / "shard-0-of-2.ckpt.npz", drop=("left", "dead"))
    assert checkpoint.load_job(tmp_path, 0, 2, 3)[1:] == (set(), set())
    for key, bad in [(k, b) for k in ("left", "dead")
                     for b in ([3], [-1], [True])] + [("dead", [0])]:
        checkpoint.write(tmp_path, 0, 2, 3, {}, left=[0])
        _rewrite_meta(tmp_path / "shard-0-of-2.ckpt.npz", **{key: bad})
        with pytest.raises(checkpoint.CheckpointError, match=key):
            checkpoint.load_job(tmp_path, 0, 2, 3)


def _rewrite_meta(path, drop=(), **changes):
    """Rewrites a checkpoint's meta JSON with `changes` and without the
    keys in `drop` (a forged file, or one an older version wrote)."""
    with np.load(path) as archive:
        arrays = dict(archive)
    meta = json.loads(arrays["meta"].tobytes())
    meta.update(changes)
    for key in drop:
        del meta[key]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _counter_workers(cluster, clocks, on_clock=None, timeout=60):
    """4 workers each add 1 (and a worker-specific delta) every clock."""
    def run(w):
        with cluster.client(w, timeout=timeout,
                            heartbeat_interval=0.2) as client:
            counter = client.create_table("counter", 700, 128)
            small = client.create_table("small", 2, 2, "float64")
            for clk in range(clocks):
                client.read(counter)
                client.update(counter, np.ones((700, 128), np.float32))
                client.update(small, np.full((2, 2), w + 1.0))
                client.clock()
                if on_clock is not None and w == 0:
                    on_clock(clk, client)
            return (client.read(counter, clock=clocks),
                    client.read(small, clock=clocks))

    return run_worker_threads(cluster.num_workers, run, timeout=180)


def test_sigkill_shard_restore_and_replay_lose_and_repeat_nothing(tmp_path):
    clocks, workers = 40, 4
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5"]
    cluster = LocalCluster(2, workers, processes=True, shard_args=args,
                           output=None)
    restarted = {}

    def kill_and_restart(clk, client):
        if clk == 17 and not restarted:
            wait_for_shard_checkpoint(client, 1, 5)  # (the writer may lag)
            victim = cluster.shards[1]
            victim.kill()
            time.sleep(0.5)
            restarted["at"] = time.monotonic()
            cluster.shards[1] = victim.restart(["--restore"])

    try:
        results, errors = _counter_workers(cluster, clocks, kill_and_restart)
        assert not errors, errors[0]
        assert restarted
        for w in range(workers):
            counter, small = results[w]
            # every worker added 1 per clock: exactly clocks * workers
            assert counter.min() == counter.max() == clocks * workers
            assert small.min() == small.max() == clocks * sum(
                range(1, workers + 1))
        stats = [s for s in cluster.client(0).shard_stats()]
        # restored from a checkpoint before the kill, then replayed
        assert 5 <= stats[1]["restored_clock"] <= 17
        assert stats[1]["restored_clock"] % 5 == 0
    finally:
        cluster.stop()


def test_a_restarted_shard_with_deterministic_sums_ends_bit_identical(
        tmp_path):
    """4 workers push float updates of magnitudes far apart (their sums
    depend on the order of the adds) to 2 shards with
    --deterministic-sums; shard 1 is SIGKILLed mid-run and restored from
    its checkpoint while the workers replay: the final rows equal numpy's
    worker-order sums bit for bit, as an undisturbed run's would."""
    clocks, workers, shape = 16, 4, (1024, 128)  # split over both shards
    rng = np.random.default_rng(13)
    deltas = (rng.standard_normal((clocks, workers) + shape)
              * 10.0 ** rng.integers(-3, 7, (clocks, workers, shape[0], 1))
              ).astype(np.float32)
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4",
            "--deterministic-sums"]
    cluster = LocalCluster(2, workers, processes=True, shard_args=args,
                           output=None)

    def run(w):
        with cluster.client(w, timeout=60,
                            heartbeat_interval=0.2) as client:
            table = client.create_table("t", *shape)
            for clk in range(clocks):
                client.read(table)
                client.update(table, deltas[clk, w])
                client.clock()
                if w == 0 and clk == 9:
                    wait_for_shard_checkpoint(client, 1, 4)
                    _restart(cluster, 1, ["--restore"])
            return client.read(table, clock=clocks)

    try:
        results, errors = run_worker_threads(workers, run, timeout=180)
        assert not errors, errors[0]
        expected = np.zeros(shape, np.float32)
        for clk in range(clocks):
            for w in range(workers):
                expected = expected + deltas[clk, w]
        for w in range(workers):
            np.testing.assert_array_equal(results[w], expected)
        stats = cluster.client(0).shard_stats()
        assert stats[1]["restored_clock"] in (4, 8)
        assert all(s["deterministic_sums"] for s in stats)
    finally:
        cluster.stop()


def test_a_replay_up_to_max_pending_clocks_ahead_is_taken(tmp_path):
    """With checkpoints every K = 3 clocks and max_pending_clocks = 2 (the
    least K allows), the shard is killed after worker 0's clock 17 and
    restored at 15: worker 0's replay of clocks 15-17 runs 2 clocks ahead
    of the restored clock, which the shard takes, and nothing is lost or
    applied twice. (K = 4 is refused at start, as is any K past
    max_pending_clocks + 1.)"""
    clocks = 24
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "3",
            "--max-pending-clocks", "2"]
    with pytest.raises(ValueError, match="max_pending_clocks >= 3"):
        ShardSettings(checkpoint_dir=str(tmp_path), checkpoint_every=4,
                      max_pending_clocks=2)
    cluster = LocalCluster(1, 2, processes=True, shard_args=args,
                           output=None)
    restarted = []

    def kill_and_restart(clk, _client):
        if clk == 16:  # (the global clock cannot pass 17 meanwhile)
            time.sleep(0.5)  # the clock-15 checkpoint is written
        if clk == 17 and not restarted:
            victim = cluster.shards[0]
            victim.kill()
            restarted.append(clk)
            cluster.shards[0] = victim.restart(["--restore"])

    try:
        results, errors = _counter_workers(cluster, clocks, kill_and_restart)
        assert not errors, errors[0]
        assert restarted
        for w in range(2):
            counter, small = results[w]
            assert counter.min() == counter.max() == clocks * 2
            assert small.min() == small.max() == clocks * 3
        # (18 only if worker 1 finished clock 17 and the shard wrote it
        # before the kill: then nothing was replayed)
        assert cluster.client(0).shard_stats()[0]["restored_clock"] in (15,
                                                                        18)
    finally:
        cluster.stop()


def test_a_replay_needs_no_more_shard_memory_than_the_run(tmp_path):
    """Two workers run 31 clocks of a 256 KiB table on a shard with room
    for 8 copies of it (the run needs 5-6: its rows, a clock's updates,
    the snapshot and pushes still being sent); the shard is SIGKILLed and
    restored at clock 16. Each worker replayed its 15 logged clocks at
    once, the restored shard needed a pending copy per clock ahead, and
    the updates it refused were lost (the job then stopped). The replay
    now goes at the shard's pace, releasing the pushed rows as it goes,
    and the job ends with every update counted once."""
    rows = width = 256
    table_bytes = rows * width * 4
    cluster = LocalCluster(1, 2, processes=True, output=None, shard_args=[
        "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "16",
        "--max-table-bytes", str(8 * table_bytes)])
    ones = np.ones((rows, width), np.float32)

    def run(clocks, client, table):
        for _ in range(clocks):
            client.read(table)
            client.update(table, ones)
            client.clock()
        return client.read(table, clock=table.clock)

    try:
        clients = [cluster.client(w, timeout=30, heartbeat_interval=0.2)
                   for w in range(2)]
        pairs = [(c, c.create_table("t", rows, width)) for c in clients]
        # A log is trimmed by the pushes that say a checkpoint is written:
        # the pushes of clocks 17-30 (the writer may lag the run).
        for clocks in (17, 14):
            results, errors = run_worker_threads(
                2, lambda w: run(clocks, *pairs[w]), timeout=120)
            assert not errors, errors[0]
            wait_for_checkpoint(clients[0], pairs[0][1], 16)
        assert sorted(pairs[0][1].log) == list(range(16, 31))
        _restart(cluster, 0, ["--restore"])
        results, errors = run_worker_threads(
            2, lambda w: run(1, *pairs[w]), timeout=120)
        assert not errors, errors[0]
        for w in range(2):
            np.testing.assert_array_equal(results[w], 64.0)
        assert clients[0].shard_stats()[0]["restored_clock"] == 16
        for client in clients:
            client.close()
    finally:
        cluster.stop()


def test_dead_worker_stops_the_others_with_a_named_error(tmp_path):
    cluster = LocalCluster(1, 2, processes=True, output=None,
                           shard_args=["--worker-timeout", "1.5"])
    try:
        with cluster.client(0, timeout=30, heartbeat_interval=0.2) as client:
            table = client.create_table("t", 2, 2)
            lazy = cluster.client(1, timeout=30, heartbeat_interval=0.2)
            lazy.create_table("t", 2, 2)
            lazy._io.close()  # worker 1 goes silent: no heartbeats
            client.clock()
            started = time.monotonic()
            with pytest.raises(GeePSWorkerFailedError,
                               match=r"worker 1 sent nothing for"):
                client.read(table)
            assert time.monotonic() - started < 10  # not the 30 s timeout
    finally:
        cluster.stop()


def test_dead_worker_continue_mode_and_rejoin(tmp_path):
    cluster = LocalCluster(1, 2, processes=True, output=None, shard_args=[
        "--worker-timeout", "1.0", "--on-worker-failure", "continue"])
    try:
        with cluster.client(0, timeout=30, heartbeat_interval=0.2) as client:
            table = client.create_table("t", 2, 2)
            lazy = cluster.client(1, timeout=30, heartbeat_interval=0.2)
            lazy.create_table("t", 2, 2)
            lazy._io.close()  # dies
            for _ in range(3):
                client.update(table, np.ones((2, 2), np.float32))
                client.clock()
                client.read(table)  # no longer waits for worker 1
            assert client.read(table)[0, 0] == 3.0
            # A restarted worker 1 rejoins at the current clock.
            with cluster.client(1, timeout=30,
                                heartbeat_interval=0.2) as again:
                rejoined = again.create_table("t", 2, 2)
                assert rejoined.clock == 3
                np.testing.assert_array_equal(again.read(rejoined),
                                              np.full((2, 2), 3.0))
                again.update(rejoined, np.ones((2, 2), np.float32))
                again.clock()
                client.update(table, np.ones((2, 2), np.float32))
                client.clock()
                assert client.read(table, clock=4)[0, 0] == 5.0
    finally:
        cluster.stop()


def _two_workers_two_clocks(cluster, **kwargs):
    """Clients of workers 0 and 1 that each added 1 to a 4 x 4 table "t"
    at clocks 0 and 1. Returns [(client, table)] (the caller closes)."""
    pairs = [(client, client.create_table("t", 4, 4)) for client in (
        cluster.client(w, timeout=30, heartbeat_interval=0.2, **kwargs)
        for w in range(2))]
    for _ in range(2):
        for client, table in pairs:
            client.update(table, np.ones((4, 4), np.float32))
            client.clock()
    return pairs


def test_a_worker_that_closed_its_client_is_not_taken_for_dead(
        process_cluster):
    """Worker 1 finishes and closes its client (LEAVE); worker 0 goes on
    reading for longer than worker_timeout: no error. When worker 0 then
    finishes a clock worker 1 never will, the job stops, naming it as one
    that left. (Before LEAVE, the first read already failed: "worker 1
    sent nothing".)"""
    cluster = process_cluster(1, 2, output=None,
                              shard_args=["--worker-timeout", "1.0"])
    (client, table), (other, _) = _two_workers_two_clocks(cluster)
    with client:
        other.close()
        time.sleep(2.0)
        np.testing.assert_array_equal(client.read(table),
                                      np.full((4, 4), 4.0))
        stats = client.shard_stats()[0]
        assert stats["left_workers"] == [1] and stats["dead_workers"] == []
        client.update(table, np.ones((4, 4), np.float32))
        client.clock()
        started = time.monotonic()
        with pytest.raises(GeePSWorkerFailedError,
                           match=r"worker 1 left \(closed its client\) "
                                 r"having finished 2 clocks of table 't', "
                                 r"and worker 0 went on to finish 3"):
            client.read(table)
        assert time.monotonic() - started < 10


def _worker_script(address, *body, workers=1, worker=0):
    """Python source that opens a client of `worker` on the shard at
    `address` (as `c`), then runs the lines of `body`."""
    return "\n".join([
        "import os, sys, time", "import numpy as np",
        "from keras_geeps.client import GeePSClient",
        "from keras_geeps.cluster import ClusterSpec",
        f"c = GeePSClient(ClusterSpec([{address!r}], {workers}, {worker}), "
        f"timeout=30, heartbeat_interval=0.2)", *body]) + "\n"


def test_a_worker_script_that_ends_without_close_leaves_all_the_same(
        process_cluster):
    """Worker 1 is a process whose script ends without `close()`: its
    client closes at the interpreter's exit and says LEAVE, so worker 0,
    still reading after worker_timeout, gets no error."""
    cluster = process_cluster(1, 2, output=None,
                              shard_args=["--worker-timeout", "1.0"])
    script = _worker_script(
        cluster.addresses[0], "t = c.create_table('t', 4, 4)",
        "c.update(t, np.ones((4, 4), np.float32))", "c.clock()",
        "print('done', c.read(t)[0, 0], flush=True)", workers=2, worker=1)
    with cluster.client(0, timeout=30, heartbeat_interval=0.2) as client:
        table = client.create_table("t", 4, 4)
        client.update(table, np.ones((4, 4), np.float32))
        client.clock()
        result = subprocess.run([sys.executable, "-c", script],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "done 2.0" in result.stdout
        time.sleep(2.0)
        np.testing.assert_array_equal(client.read(table), 2.0)
        stats = client.shard_stats()[0]
        assert stats["left_workers"] == [1] and stats["dead_workers"] == []


def test_a_forked_child_does_not_close_its_parents_client(process_cluster):
    """A child forked from a worker (and ending normally, atexit hooks
    run) leaves the parent's client alone: no LEAVE, no wait."""
    cluster = process_cluster(1, 1, output=None,
                              shard_args=["--worker-timeout", "30"])
    script = _worker_script(
        cluster.addresses[0], "t = c.create_table('t', 4, 4)",
        # (a LEAVE's wait at exit made 30 s: far above a loaded exit's)
        "import keras_geeps.client.client as module",
        "module.AT_EXIT_LEAVE_WAIT_S = 30.0",
        "started = time.monotonic()", "child = os.fork()",
        "if child == 0:", "    sys.exit(0)", "os.waitpid(child, 0)",
        "print('child took', round(time.monotonic() - started, 2))",
        "print('left', c.shard_stats()[0]['left_workers'])",
        "c.update(t, np.ones((4, 4), np.float32))", "c.clock()",
        "print('read', c.read(t)[0, 0], flush=True)")
    result = subprocess.run([sys.executable, "-c", script],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "left []" in lines and "read 1.0" in lines, result.stdout
    took = float(next(x for x in lines if x.startswith("child took"))
                 .split()[-1])
    assert took < 15, result.stdout  # (a LEAVE's wait is 30 s here)


def test_under_continue_the_others_go_on_past_one_that_left_and_it_comes_back(
        process_cluster):
    cluster = process_cluster(1, 2, output=None, shard_args=[
        "--worker-timeout", "1.0", "--on-worker-failure", "continue"])
    (client, table), (other, _) = _two_workers_two_clocks(cluster)
    with client:
        other.close()
        client.update(table, np.ones((4, 4), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table),
                                      np.full((4, 4), 5.0))
        # A new client of worker 1 (not refused: it left, it did not hang)
        # joins at the current clock.
        with cluster.client(1, timeout=30, heartbeat_interval=0.2) as again:
            rejoined = again.create_table("t", 4, 4)
            assert rejoined.clock == 3
            again.update(rejoined, np.ones((4, 4), np.float32))
            again.clock()
            client.update(table, np.ones((4, 4), np.float32))
            client.clock()
            np.testing.assert_array_equal(client.read(table),
                                          np.full((4, 4), 7.0))
        assert client.shard_stats()[0]["left_workers"] == [1]


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_worker_that_dies_with_its_shard_is_noticed_after_the_restore(
        tmp_path, process_cluster, policy):
    """Worker 1 dies with the shard (one machine). The restored shard
    counts each worker as heard from at the restore: worker 1 never says
    HELLO, and is declared dead after worker_timeout (it was after 60 s,
    past worker 0's 30 s timeout): worker 0 fails naming it, or goes on
    without it."""
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2",
            "--worker-timeout", "1.5", "--on-worker-failure", policy]
    cluster = process_cluster(1, 2, shard_args=args, output=None)
    (client, table), (other, _) = _two_workers_two_clocks(cluster)
    with client:
        client.read(table)
        wait_for_checkpoint(client, table, 2)
        client.update(table, np.ones((4, 4), np.float32))
        client.clock()  # clock 2: only in worker 0's log
        victim = cluster.shards[0]
        victim.kill()
        other._io.close()  # worker 1 dies with it (no LEAVE)
        cluster.shards[0] = victim.restart(["--restore"])
        started = time.monotonic()
        if policy == "stop":
            with pytest.raises(GeePSWorkerFailedError,
                               match=r"worker 1 sent nothing since this "
                                     r"shard's restore"):
                client.read(table)
        else:
            np.testing.assert_array_equal(client.read(table),
                                          np.full((4, 4), 5.0))
            assert client.shard_stats()[0]["dead_workers"] == [1]
        assert time.monotonic() - started < 15


def test_a_restored_shard_remembers_who_left(tmp_path, process_cluster):
    """Worker 1 leaves after the last clock; the shard writes that down
    (a checkpoint of the same clock); killed and restored, it does not
    wait to hear from worker 1, and worker 0 goes on reading."""
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2",
            "--worker-timeout", "1.0"]
    cluster = process_cluster(1, 2, shard_args=args, output=None)
    (client, table), (other, _) = _two_workers_two_clocks(cluster)
    with client:
        client.read(table)
        wait_for_checkpoint(client, table, 2)
        other.close()
        deadline = time.monotonic() + 10
        while checkpoint.load_job(tmp_path, 0, 1, 2)[1] != {1}:
            assert time.monotonic() < deadline, "LEAVE not written down"
            time.sleep(0.05)
        _restart(cluster, 0, ["--restore"])
        np.testing.assert_array_equal(client.read(table),
                                      np.full((4, 4), 4.0))
        time.sleep(2.0)
        np.testing.assert_array_equal(client.read(table),
                                      np.full((4, 4), 4.0))
        stats = client.shard_stats()[0]
        assert stats["restored_clock"] == 2
        assert stats["left_workers"] == [1] and stats["dead_workers"] == []


def _restart(cluster, shard, args):
    victim = cluster.shards[shard]
    victim.kill()
    time.sleep(0.3)
    cluster.shards[shard] = victim.restart(args)


def _block_checkpoints(folder):
    """Makes the shard's checkpoint writes fail from now on (even as root: a
    file takes the folder's place). Returns the undo."""
    away = folder.with_name(folder.name + ".away")
    folder.rename(away)
    folder.write_bytes(b"")

    def undo():
        folder.unlink()
        away.rename(folder)
    return undo


def test_a_failing_checkpoint_disk_holds_the_clock_back_not_memory(
        tmp_path, process_cluster):
    """Checkpoints every 2 clocks, and the shard's folder fails: the
    worker's replay log fills up to max_log_clocks (4 K = 8), and the next
    clock waits for a checkpoint, failing after the timeout with the cause,
    nothing sent. With the disk back, a clock waits only until the shard
    wrote one (its retry backs off: up to some seconds), and nothing is
    lost or applied twice."""
    folder = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(folder), "--checkpoint-every", "2"]
    cluster = process_cluster(1, 1, shard_args=args, output=None)
    with cluster.client(0, timeout=3, heartbeat_interval=0.2) as client:
        table = client.create_table("t", 4, 4)
        # (its clock-0 checkpoint written first: a writer under way would
        # make the folder again)
        wait_for_checkpoint(client, table, 0)
        undo = _block_checkpoints(folder)
        for _ in range(8):
            client.update(table, np.ones((4, 4), np.float32))
            client.clock()
            client.read(table)
        assert len(table.log) == 8
        started = time.monotonic()
        with pytest.raises(GeePSTimeoutError,
                           match=r"the replay log of table 't' holds 8 "
                                 r"clocks .* --checkpoint-dir full or "
                                 r"failing"):
            client.clock()
        assert 3 <= time.monotonic() - started < 8
        assert table.clock == 8  # that clock was not sent
        undo()
        client.timeout = 30  # the shard's retry comes after its back-off
        client.update(table, np.ones((4, 4), np.float32))
        client.clock()
        assert len(table.log) < 8
        np.testing.assert_array_equal(client.read(table), 9.0)
        assert client.shard_stats()[0]["tables"][str(table.id)][
            "ckpt_clock"] >= 2


@pytest.mark.parametrize("late_table", [False, True])
def test_a_table_no_checkpoint_held_yet_is_created_again_and_replayed(
        tmp_path, process_cluster, late_table):
    """SIGKILL before any checkpoint held table "t": the restored shard has
    only the empty checkpoint it wrote at start (or one of an earlier
    table). The worker that created "t" sends its initial rows again, both
    workers replay every clock (the other's updates may come first and wait
    for the rows), and the sums are exact."""
    folder = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(folder), "--checkpoint-every", "3"]
    cluster = process_cluster(1, 2, shard_args=args, output=None)
    clocks, kill_at = 8, 4
    init = np.arange(12, dtype=np.float32).reshape(3, 4)
    undo, both = {}, threading.Barrier(2, timeout=60)

    def run(w):
        with cluster.client(w, timeout=60, heartbeat_interval=0.2) as client:
            tables = []
            if late_table:
                tables.append(client.create_table("early", 2, 2))
                if w == 0:
                    wait_for_checkpoint(client, tables[0], 0)
            both.wait()
            if w == 0:
                undo["it"] = _block_checkpoints(folder)
            both.wait()
            table = client.create_table("t", 3, 4, init=init)
            tables.append(table)
            for clk in range(clocks):
                client.read(table)
                for t in tables:
                    client.update(t, np.full((t.rows, t.width), w + 1,
                                             np.float32))
                client.clock()
                if clk == kill_at and w == 0:
                    cluster.shards[0].kill()
                    undo.pop("it")()
                    cluster.shards[0] = cluster.shards[0].restart(
                        ["--restore"])
            reads = [client.read(t, clock=clocks) for t in tables]
            if w == 0:
                wait_for_checkpoint(client, table, 6)
            both.wait()
            client.clock()  # its push tells the workers of that checkpoint
            client.read(table, clock=clocks + 1)
            assert table.init == {}  # so the creator keeps no copy
            if w == 0:
                reads.append(client.shard_stats()[0]["restored_clock"])
            return reads

    results, errors = run_worker_threads(2, run, timeout=120)
    assert not errors, errors[0]
    for w in range(2):
        np.testing.assert_array_equal(results[w][-1 if w else -2],
                                      init + clocks * 3)
        if late_table:
            np.testing.assert_array_equal(results[w][0],
                                          np.full((2, 2), clocks * 3.0))
    # restored from the checkpoint written at start, or early's at clock 0
    assert results[0][-1] == (0 if late_table else -1)


def test_a_restart_without_restore_keeps_the_checkpoint_and_says_so(
        tmp_path, process_cluster):
    """Restarting a killed shard without --restore: its checkpoint is kept
    as .previous (not overwritten), and the worker fails naming the
    mistake instead of waiting."""
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    cluster = process_cluster(1, 1, shard_args=args, output=None)
    with cluster.client(0, timeout=20, heartbeat_interval=0.2) as client:
        t = client.create_table("t", 4, 4, init=np.ones((4, 4)))
        for _ in range(3):
            client.update(t, np.ones((4, 4), np.float32))
            client.clock()
            client.read(t)
        wait_for_checkpoint(client, t, 2)
        client.update(t, np.ones((4, 4), np.float32))
        client.clock()  # its push tells the worker of that checkpoint
        client.read(t)
        _restart(cluster, 0, [])
        started = time.monotonic()
        with pytest.raises(GeePSError, match="started without --restore"):
            for _ in range(3):
                client.update(t, np.ones((4, 4), np.float32))
                client.clock()
                client.read(t)
        assert time.monotonic() - started < 10  # not the 20 s timeout
        # For good: every later call says so at once too (it once waited
        # for its timeout, and a read's then blamed a healthy shard).
        for call in (lambda: client.read(t, clock=1 << 20),
                     client.shard_stats, client.clock):
            started = time.monotonic()
            with pytest.raises(GeePSError,
                               match="started without --restore"):
                call()
            assert time.monotonic() - started < 5
    kept = checkpoint.load(tmp_path, 0, 1, 1)
    assert kept == {}  # the restarted shard's own, empty
    previous = tmp_path / "shard-0-of-1.ckpt.npz.previous"
    previous.rename(tmp_path / "shard-0-of-1.ckpt.npz")
    (spec, clock, rows), = checkpoint.load(tmp_path, 0, 1, 1).values()
    assert clock >= 2
    np.testing.assert_array_equal(rows, np.full((4, 4), 1.0 + clock))


@pytest.mark.parametrize("request_", ["stats", "create_table"])
def test_a_request_the_killed_shard_took_is_sent_again_on_recovery(
        tmp_path, process_cluster, request_):
    """A request the killed shard took and never answered (its stats; a
    table's creation, which the recovery also creates again) is sent again
    to the restored shard: answered well before the timeout."""
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    cluster = process_cluster(1, 1, shard_args=args, output=None)
    with cluster.client(0, timeout=60, heartbeat_interval=0.2) as client:
        t = counted_to_a_checkpoint(client)
        ask = {"stats": client.shard_stats,
               "create_table": lambda: client.create_table(
                   "u", 4, 4, init=np.full((4, 4), 5.0))}[request_]
        _, seconds = ask_across_a_restart(client, cluster, ask)
        assert seconds < 30  # not the 60 s timeout
        assert client.shard_stats()[0]["restored_clock"] == 2
        client.update(t, np.ones((4, 4), np.float32))
        if request_ == "create_table":
            u = client.table("u")
            client.update(u, np.ones((4, 4), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(t), np.full((4, 4), 3))
        if request_ == "create_table":
            # created once (at the clock the job was at), updated once
            np.testing.assert_array_equal(client.read(u), np.full((4, 4), 6))
        assert client._io._futures == {}


def test_a_split_table_created_across_a_restart_keeps_its_rows(
        tmp_path, process_cluster):
    """create_table of a table split over two shards, in several chunks,
    while shard 0 is stopped, killed and restored: the recovery creates
    its part again, the CREATE chunks sent again find it there, and the
    creator keeps its own rows (shard 1 never pushes them back to it)."""
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    cluster = process_cluster(2, 1, shard_args=args, output=None)
    with cluster.client(0, timeout=60, heartbeat_interval=0.2,
                        chunk_bytes=64 << 10) as client:
        counted_to_a_checkpoint(client)  # on shard 0
        init = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)
        u, seconds = ask_across_a_restart(
            client, cluster, lambda: client.create_table("u", 512, 256,
                                                         init=init))
        assert seconds < 30  # not the 60 s timeout
        assert [shard for shard, _, _ in u.parts] == [0, 1]
        np.testing.assert_array_equal(client.read(u), init)
        client.update(u, np.ones((512, 256), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(u), init + 1)
        assert client._io._futures == {}


def _one_that_takes_the_hello_and_dies(address, welcome):
    """A stand-in shard incarnation on `address`: it refuses everything
    with hello_required, as a restarted shard does, and closes (dies) on
    the first HELLO, after a WELCOME if `welcome`, else leaving it
    unanswered. Returns a thread; join it."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    deadline = time.monotonic() + 10
    while True:  # (the killed shard's port may be briefly taken)
        try:
            sock.bind(address)
            break
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

    def serve():
        try:
            while sock.poll(20000):
                identity, *frames = sock.recv_multipart()
                message = protocol.decode(frames)
                if message.type == protocol.MsgType.HELLO:
                    if welcome:  # (what the worker sends next: lost)
                        sock.send_multipart([identity, *protocol.encode(
                            protocol.Message(
                                protocol.MsgType.WELCOME, seq=message.seq,
                                meta={"shard_id": 0, "num_shards": 1,
                                      "num_workers": 1,
                                      "max_message_bytes": 1 << 30,
                                      "max_pending_clocks": 64,
                                      "checkpoint_every": 2}))])
                    return
                sock.send_multipart([identity, *protocol.encode(
                    protocol.Message(protocol.MsgType.ERROR, seq=message.seq,
                                     meta={"error": "HELLO first",
                                           "code":
                                           protocol.ERROR_HELLO_REQUIRED}))])
        finally:
            sock.close(linger=2000)
            context.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("welcome", [False, True])
def test_a_shard_that_dies_again_during_the_recovery_is_recovered(
        tmp_path, process_cluster, welcome):
    """The shard is killed; the incarnation that follows takes the
    recovery's HELLO and dies, at once or right after its WELCOME; the
    next one (restored) never saw a HELLO. The worker starts over (on the
    refusal of a request sent after that HELLO, or RECOVERY_HELLO_RETRY_S
    after an unanswered HELLO) and recovers: nothing lost or applied
    twice."""
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    cluster = process_cluster(1, 1, shard_args=args, output=None)
    with cluster.client(0, timeout=60, heartbeat_interval=0.2) as client:
        t, victim = killed_one_clock_past_a_checkpoint(client, cluster)
        started = time.monotonic()
        _one_that_takes_the_hello_and_dies(victim.address, welcome).join(30)
        cluster.shards[0] = victim.restart(["--restore"])
        np.testing.assert_array_equal(client.read(t), np.full((4, 4), 3))
        assert time.monotonic() - started < 30  # not the 60 s timeout
        client.update(t, np.ones((4, 4), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(t), np.full((4, 4), 4))
        assert client.shard_stats()[0]["restored_clock"] == 2
        assert client._io._futures == {}  # none left of the given-up try


def test_replay_resends_each_clocks_update_from_a_reused_buffer(
        tmp_path, process_cluster):
    # update(copy=False) from one buffer the caller refills every clock (as
    # keras' sync does): the replay log must hold each clock's own values.
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4"]
    cluster = process_cluster(1, 1, shard_args=args, output=None)
    with cluster.client(0, timeout=30, heartbeat_interval=0.2) as client:
        table = client.create_table("t", 3, 4)
        buffer = np.empty((3, 4), np.float32)
        for clk in range(10):
            if clk == 7:  # clocks 4..6 are in the log only
                wait_for_checkpoint(client, table, 4)
                _restart(cluster, 0, ["--restore"])
            buffer[:] = clk + 1
            client.update(table, buffer, copy=False)
            client.clock()
            client.read(table)  # applied: the buffer may be refilled
        np.testing.assert_array_equal(client.read(table, clock=10),
                                      np.full((3, 4), 55.0))
        assert client.shard_stats()[0]["restored_clock"] == 4


def test_request_refused_by_a_restarted_shard_is_sent_again(
        tmp_path, process_cluster):
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    cluster = process_cluster(1, 1, shard_args=args, output=None)
    with cluster.client(0, timeout=20, heartbeat_interval=0) as client:
        t = client.create_table("t", 4, 4, init=np.ones((4, 4)))
        for _ in range(2):
            client.read(t)
            client.update(t, np.ones((4, 4), np.float32))
            client.clock()
        wait_for_checkpoint(client, t, 2)
        _restart(cluster, 0, ["--restore"])
        started = time.monotonic()
        # Refused (no HELLO yet): recovery, then the CREATE again.
        u = client.create_table("u", 4, 4, init=np.full((4, 4), 2.0))
        assert time.monotonic() - started < 10  # not the 20 s timeout
        np.testing.assert_array_equal(client.read(t), np.full((4, 4), 3))
        client.update(t, np.ones((4, 4), np.float32))
        client.update(u, np.ones((4, 4), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(t), np.full((4, 4), 4))
        np.testing.assert_array_equal(client.read(u), np.full((4, 4), 3))
        assert client._io._futures == {}


def test_restart_without_checkpoints_fails_the_waiting_request_at_once(
        process_cluster):
    cluster = process_cluster(1, 1, output=None)
    with cluster.client(0, timeout=20, heartbeat_interval=0) as client:
        t = client.create_table("t", 4, 4)
        client.update(t, np.ones((4, 4), np.float32))
        client.clock()
        client.read(t)
        _restart(cluster, 0, [])
        started = time.monotonic()
        with pytest.raises(GeePSError, match="tables are lost"):
            client.create_table("u", 4, 4)
        assert time.monotonic() - started < 10  # not the 20 s timeout
        with pytest.raises(GeePSError, match="tables are lost"):
            client.read(t)  # and every later call
        assert client._io._futures == {}
