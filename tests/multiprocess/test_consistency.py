"""Real shard processes and worker processes: sums, BSP, SSP, failures."""

import io
import json
import sys
import time

import numpy as np
import pytest

from keras_geeps.errors import GeePSTimeoutError
from keras_geeps.launch import launch

WORKER = [sys.executable, "-m", "tests.multiprocess.ps_worker"]
pytestmark = pytest.mark.slow


def _expected(clocks, workers):
    """The value of every big-table element after `clocks` clocks."""
    return 1.0 + sum((w + 1) * (c + 1) for w in range(workers)
                     for c in range(clocks))


def _run(tmp_path, workers, shards, *args):
    output = io.StringIO()
    code = launch(WORKER + ["--out", str(tmp_path), *args],
                  num_workers=workers, num_shards=shards, output=output)
    assert code == 0, output.getvalue()[-3000:]
    return [json.loads((tmp_path / f"worker{w}.json").read_text())
            for w in range(workers)]


@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_bsp_four_workers_two_shards_fifty_clocks(tmp_path, monkeypatch,
                                                  shared_memory):
    monkeypatch.setenv("KERAS_GEEPS_SHM", shared_memory)
    results = _run(tmp_path, 4, 2, "--clocks", "50", "--slack", "0")
    for result in results:
        # Co-located processes exchange rows through shared memory unless
        # it is turned off: no silent fall-back to TCP either way.
        stats = result["stats"]
        if shared_memory == "1":
            assert stats["shm_bytes_received"] > 0.9 * stats["bytes_received"]
            assert stats["shm_bytes_sent"] > 0.9 * stats["bytes_sent"]
            assert stats["bytes_delivered"] == 0  # rows read where they lie
        else:
            assert stats["shm_bytes_received"] == stats["shm_bytes_sent"] == 0
            # Reads that waited got pushes in their buffers as they came.
            assert stats["bytes_delivered"] > 0
        # Final values: the exact sums, on every worker.
        assert result["final_min"] == result["final_max"] == _expected(50, 4)
        assert result["final_small"] == result["final_small_max"] == 200.0
        for clk, age, parts, small_age, s_low, s_high in result["reads"]:
            # BSP: a read at clock c sees all updates of clocks < c, and
            # (pushes are exact) none of later clocks.
            assert age == clk and small_age == clk
            assert len(parts) == 2  # the big table spans both shards
            for part_age, low, high in parts:
                assert part_age == clk
                assert low == high == _expected(clk, 4)
            assert s_low == s_high == 4.0 * clk


@pytest.mark.parametrize("slack", [1, 3])
def test_ssp_bound_holds_and_fast_workers_block(tmp_path, slack):
    clocks, delay = 30, 0.03
    results = _run(tmp_path, 4, 2, "--clocks", str(clocks), "--slack",
                   str(slack), "--max-delay", str(delay))
    stale_reads = 0
    for result in results:
        assert result["final_min"] == result["final_max"] == \
            _expected(clocks, 4)
        for clk, age, parts, small_age, s_low, s_high in result["reads"]:
            assert age >= clk - slack, (result["worker"], clk, age)
            assert small_age >= clk - slack
            assert s_low == s_high == 4.0 * small_age
            for part_age, low, high in parts:
                # Each shard's rows hold exactly the clocks before their age.
                assert part_age >= age
                assert low == high == _expected(part_age, 4)
            stale_reads += age < clk
    assert stale_reads > 0  # slack was used
    # Worker 0 sleeps least; it must have waited for the slowest worker.
    fastest, slowest = results[0], results[3]
    # Unblocked it would finish in a few ms; the slack holds it to within
    # slack + 1 clocks of the slowest, so it spends most of its time waiting.
    assert fastest["elapsed"] >= 0.5 * slowest["elapsed"]
    assert fastest["wait_seconds"] >= 0.3 * slowest["elapsed"]


def test_launcher_stops_everything_when_a_worker_fails(tmp_path):
    output = io.StringIO()
    started = time.monotonic()
    code = launch(WORKER + ["--out", str(tmp_path), "--clocks", "100000",
                            "--fail-worker", "1"],
                  num_workers=2, num_shards=2, output=output)
    text = output.getvalue()
    assert code == 3, text[-2000:]
    assert "worker 1 (pid" in text and "exited with code 3" in text
    assert time.monotonic() - started < 60
    assert not (tmp_path / "worker0.json").exists()  # stopped, not finished


def test_dead_shard_gives_clear_timeout(process_cluster):
    cluster = process_cluster(2, 1)
    with cluster.client(0, timeout=2.0) as client:
        table = client.create_table("t", 1000, 128)
        assert len(table.parts) == 2
        client.read(table)
        cluster.shards[1].kill()
        client.update(table, np.ones((1000, 128), np.float32))
        client.clock()
        started = time.monotonic()
        with pytest.raises(GeePSTimeoutError,
                           match=r"shard 1 \(tcp://127.0.0.1:\d+\) does not "
                                 r"answer"):
            client.read(table)
        assert time.monotonic() - started < 3 * 2.0 + 1


def test_dead_shard_at_connect_gives_clear_timeout(process_cluster):
    cluster = process_cluster(1, 1)
    address = cluster.addresses[0]
    cluster.shards[0].kill()
    from keras_geeps.client import GeePSClient  # noqa: PLC0415
    from keras_geeps.cluster import ClusterSpec  # noqa: PLC0415
    with pytest.raises(GeePSTimeoutError, match="did not answer HELLO"):
        GeePSClient(ClusterSpec([address]), timeout=1.0)
