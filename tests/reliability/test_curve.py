"""CURVE: keyed clients work; unkeyed and wrongly keyed ones are refused."""

import subprocess
import sys

import numpy as np
import pytest

from keras_geeps.auth import ClientKeys
from keras_geeps.client import GeePSClient
from keras_geeps.cluster import ClusterSpec
from keras_geeps.errors import GeePSTimeoutError
from keras_geeps.launch import LocalCluster


@pytest.fixture
def keys(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "keras_geeps", "keygen", str(tmp_path),
         "shard", "worker", "stranger"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (allowed / "worker.key").write_bytes((tmp_path / "worker.key").read_bytes())
    return tmp_path


@pytest.fixture
def curve_cluster(keys):
    cluster = LocalCluster(1, 1, processes=True, output=None, shard_args=[
        "--curve-secret-key", str(keys / "shard.key_secret"),
        "--curve-allowed-clients", str(keys / "allowed")])
    yield cluster
    cluster.stop()


def test_keyed_client_reads_and_writes(keys, curve_cluster):
    curve = ClientKeys(keys / "worker.key_secret", keys / "shard.key")
    with curve_cluster.client(0, timeout=10, curve=curve) as client:
        table = client.create_table("t", 3, 4, init=np.ones((3, 4)))
        client.update(table, np.ones((3, 4), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table), np.full((3, 4), 2))


@pytest.mark.parametrize("who", ["unkeyed", "stranger"])
def test_unkeyed_or_wrongly_keyed_client_is_refused(keys, curve_cluster, who):
    curve = None if who == "unkeyed" else ClientKeys(
        keys / "stranger.key_secret", keys / "shard.key")
    spec = ClusterSpec(curve_cluster.addresses, 1, 0)
    with pytest.raises(GeePSTimeoutError,
                       match="did not answer HELLO.*CURVE"):
        GeePSClient(spec, timeout=1.5, curve=curve)
    stats = curve_cluster.shards[0]
    assert stats.process.poll() is None  # the shard keeps running
