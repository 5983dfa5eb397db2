"""CURVE keys and keyed clusters for the reliability tests."""

import sys

from keras_geeps.auth import ClientKeys
from keras_geeps.launch import LocalCluster


def worker_keys(keys, name="worker"):
    """The client keys of `name` (its secret, the shard's public key)."""
    return ClientKeys(keys / f"{name}.key_secret", keys / "shard.key")


def keyed_cluster(keys, workers=1, checkpoint=False, shard_args=()):
    """A keyed shard process (1 shard, `workers` workers), with
    checkpoints every 2 clocks if `checkpoint`, and `shard_args`."""
    args = ["--curve-secret-key", str(keys / "shard.key_secret"),
            "--curve-allowed-clients", str(keys / "allowed"), *shard_args]
    if checkpoint:
        args += ["--checkpoint-dir", str(keys / "ckpt"),
                 "--checkpoint-every", "2"]
    return LocalCluster(1, workers, processes=True, output=sys.stderr,
                        shard_args=args)
