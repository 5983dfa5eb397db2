"""Shard checkpoints, SIGKILL + restore with replay, worker failure."""

import time

import numpy as np
import pytest

from keras_geeps import checkpoint
from keras_geeps.errors import GeePSWorkerFailedError
from keras_geeps.launch import LocalCluster
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
    with pytest.raises(checkpoint.CheckpointError, match="cannot read"):
        checkpoint.load(tmp_path, 0, 2, 3)


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
                    on_clock(clk)
            return (client.read(counter, clock=clocks),
                    client.read(small, clock=clocks))

    return run_worker_threads(cluster.num_workers, run, timeout=180)


def test_sigkill_shard_restore_and_replay_lose_and_repeat_nothing(tmp_path):
    clocks, workers = 40, 4
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5"]
    cluster = LocalCluster(2, workers, processes=True, shard_args=args,
                           output=None)
    restarted = {}

    def kill_and_restart(clk):
        if clk == 17 and not restarted:
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
