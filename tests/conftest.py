"""Shared fixtures: real shards on 127.0.0.1 with random ports."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs_gpu: runs only where TensorFlow sees a GPU")
    config.addinivalue_line(
        "markers", "slow: multi-process suites (deselect with -m 'not slow')")


def _has_gpu():
    try:
        import tensorflow as tf  # noqa: PLC0415
    except ImportError:
        return False
    return bool(tf.config.list_physical_devices("GPU"))


def pytest_collection_modifyitems(config, items):
    if not any("needs_gpu" in item.keywords for item in items):
        return
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (none visible to TensorFlow)")
    for item in items:
        if "needs_gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def thread_cluster():
    """Factory: LocalCluster(num_shards, num_workers) with thread shards."""
    from keras_geeps.launch import LocalCluster  # noqa: PLC0415
    clusters = []

    def make(num_shards=1, num_workers=1, **kwargs):
        cluster = LocalCluster(num_shards, num_workers, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def process_cluster():
    """Factory: LocalCluster(num_shards, num_workers) with shard processes."""
    from keras_geeps.launch import LocalCluster  # noqa: PLC0415
    clusters = []

    def make(num_shards=1, num_workers=1, **kwargs):
        cluster = LocalCluster(num_shards, num_workers, processes=True,
                               **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
