"""The `keras-geeps` command line against real shard processes."""

import json
import subprocess
import sys

import numpy as np


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "keras_geeps", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_stats_and_stop_a_standalone_shard(process_cluster):
    cluster = process_cluster(1, 1)
    with cluster.client(0, timeout=10) as client:
        table = client.create_table("t", 4, 4, init=np.ones((4, 4)))
        client.clock()
        client.read(table, clock=1)
    address = cluster.addresses[0]
    result = _cli("stats", "--shards", address)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["tables"]["0"]["name"] == "t"
    assert stats["tables"]["0"]["global_clock"] == 1
    assert _cli("stop", "--shards", address).returncode == 0
    assert cluster.shards[0].process.wait(10) == 0


def test_stats_of_a_dead_address_fails_clearly(process_cluster):
    cluster = process_cluster(1, 1)
    address = cluster.addresses[0]
    cluster.shards[0].kill()
    result = _cli("stats", "--shards", address, "--timeout", "1")
    assert result.returncode != 0
    assert "did not answer within 1.0 s" in result.stderr


def test_launch_requires_a_command():
    result = _cli("launch", "--workers", "1", "--shards", "1")
    assert result.returncode == 2
    assert "give the worker command" in result.stderr


def test_launch_runs_workers_and_exits_zero(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(
        "import numpy as np\n"
        "from keras_geeps.client import GeePSClient\n"
        "c = GeePSClient(timeout=20)\n"
        "t = c.create_table('t', 2, 2)\n"
        "for _ in range(3):\n"
        "    c.read(t); c.update(t, np.ones((2, 2), np.float32)); c.clock()\n"
        "print('final', c.read(t, clock=3)[0, 0], flush=True)\n")
    result = _cli("launch", "--workers", "2", "--shards", "2", "--",
                  sys.executable, str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("final 6.0") == 2
    assert "[worker 0]" in result.stdout and "[worker 1]" in result.stdout


def test_checkpoint_on_request(process_cluster, tmp_path):
    cluster = process_cluster(1, 1, shard_args=[
        "--checkpoint-dir", str(tmp_path)])
    with cluster.client(0, timeout=10) as client:
        table = client.create_table("t", 4, 4, init=np.ones((4, 4)))
        for _ in range(3):
            client.update(table, np.ones((4, 4), np.float32))
            client.clock()
        client.read(table)
    result = _cli("checkpoint", "--shards", cluster.addresses[0])
    assert result.returncode == 0, result.stderr
    from keras_geeps import checkpoint  # noqa: PLC0415
    (spec, clock, rows), = checkpoint.load(tmp_path, 0, 1, 1).values()
    assert spec["name"] == "t" and clock == 3
    np.testing.assert_array_equal(rows, np.full((4, 4), 4.0))
