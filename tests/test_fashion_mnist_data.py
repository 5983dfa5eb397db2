"""Tests of keras_geeps.datasets.fashion_mnist against the Debian files.

The full set is prepared once per module (about 10 s on two cores) into a
temporary data folder; the error tests use tiny hand-written idx files. The
Debian package `dataset-fashion-mnist` is installed by `make setup`, so a
missing file fails these tests with the module's own explanation rather
than skipping them.
"""

import gzip
import os
import socket
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from keras_geeps.datasets import fashion_mnist

pytestmark = pytest.mark.timeout(300)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_network(*args, **kwargs):
    raise AssertionError(f"tried to open a network connection: {args}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A tfds data folder holding the prepared full Fashion-MNIST."""
    path = tmp_path_factory.mktemp("tfds")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", _no_network)
        patch.setattr(socket, "create_connection", _no_network)
        fashion_mnist.prepare(data_dir=path)
    return path


def _reference_split(prefix, count):
    """The first `count` images and labels of a split, parsed with struct."""
    source_dir = fashion_mnist.resolve_source_dir()
    with gzip.open(os.path.join(source_dir,
                                f"{prefix}-images-idx3-ubyte.gz")) as f:
        magic, _, rows, cols = struct.unpack(">4I", f.read(16))
        assert magic == 2051
        pixels = f.read(count * rows * cols)
    with gzip.open(os.path.join(source_dir,
                                f"{prefix}-labels-idx1-ubyte.gz")) as f:
        magic, _ = struct.unpack(">2I", f.read(8))
        assert magic == 2049
        labels = list(f.read(count))
    images = np.frombuffer(pixels, np.uint8).reshape(count, rows, cols, 1)
    return images, np.array(labels, np.int64)


def _write_idx(path, array, magic=None):
    """Writes `array` (uint8) as a gzip'd idx file, the header as given."""
    if magic is None:
        magic = 0x0800 + array.ndim
    header = struct.pack(f">{1 + array.ndim}I", magic, *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _write_source_dir(path, num_train=12, num_test=5):
    """A source folder of small, valid idx files; returns the arrays."""
    rng = np.random.default_rng(0)
    arrays = {}
    path.mkdir(exist_ok=True)
    for split, count in (("train", num_train), ("test", num_test)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = np.arange(count, dtype=np.uint8) % 10
        images_name, labels_name = fashion_mnist.SOURCE_FILES[split]
        _write_idx(path / images_name, images)
        _write_idx(path / labels_name, labels)
        arrays[split] = (images, labels)
    return arrays


def test_split_sizes(data_dir):
    splits = fashion_mnist.info(data_dir=data_dir).splits
    assert splits["train"].num_examples == 60_000
    assert splits["test"].num_examples == 10_000
    assert {name: splits[name].num_examples for name in ("train", "test")} \
        == fashion_mnist.NUM_EXAMPLES
    for split, expected in fashion_mnist.NUM_EXAMPLES.items():
        dataset = fashion_mnist.load(split, data_dir=data_dir)
        assert int(dataset.cardinality()) == expected


def test_every_example_read_and_all_classes_present(data_dir):
    for split, expected in fashion_mnist.NUM_EXAMPLES.items():
        dataset = fashion_mnist.load(split, data_dir=data_dir,
                                     as_float=False).batch(10_000)
        counts = np.zeros(fashion_mnist.NUM_CLASSES, np.int64)
        total = 0
        for images, labels in dataset:
            labels = labels.numpy()
            assert labels.min() >= 0 and labels.max() < 10
            counts += np.bincount(labels, minlength=10)
            total += len(labels)
        assert total == expected
        assert (counts > 0).all(), counts


def test_float_images_shape_dtype_range(data_dir):
    images, labels = next(iter(
        fashion_mnist.load("train", data_dir=data_dir).batch(1000)))
    assert images.dtype.name == "float32"
    assert images.shape == (1000, 28, 28, 1)
    assert labels.dtype.name == "int64"
    assert labels.shape == (1000,)
    images = images.numpy()
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert images.max() == 1.0  # Some pixel is white: scaled by 255.


def test_uint8_images_shape_dtype(data_dir):
    image, label = next(iter(
        fashion_mnist.load("test", data_dir=data_dir, as_float=False)))
    assert image.dtype.name == "uint8"
    assert image.shape == (28, 28, 1)
    assert label.dtype.name == "int64"
    assert label.shape == ()


@pytest.mark.parametrize("split,prefix", [("train", "train"),
                                          ("test", "t10k")])
def test_first_examples_equal_source_files(data_dir, split, prefix):
    count = 32
    want_images, want_labels = _reference_split(prefix, count)
    got = list(fashion_mnist.load(split, data_dir=data_dir,
                                  as_float=False).take(count))
    np.testing.assert_array_equal(
        np.stack([image.numpy() for image, _ in got]), want_images)
    np.testing.assert_array_equal(
        np.array([label.numpy() for _, label in got]), want_labels)
    floats = next(iter(fashion_mnist.load(split, data_dir=data_dir)
                       .batch(count)))[0].numpy()
    np.testing.assert_allclose(floats, want_images / 255.0, rtol=1e-6)


def test_read_split_matches_reference():
    images, labels = fashion_mnist.read_split("test")
    assert images.shape == (10_000, 28, 28)
    want_images, want_labels = _reference_split("t10k", 8)
    np.testing.assert_array_equal(images[:8, :, :, None], want_images)
    np.testing.assert_array_equal(labels[:8], want_labels)


def test_prepared_data_needs_no_source(data_dir, tmp_path):
    dataset = fashion_mnist.load("test[:3]", data_dir=data_dir,
                                 source_dir=tmp_path / "gone")
    assert len(list(dataset)) == 3


def test_missing_source_dir_gives_clear_error(tmp_path):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(fashion_mnist.FashionMnistSourceError) as raised:
        fashion_mnist.load(data_dir=tmp_path / "tfds", source_dir=missing)
    message = str(raised.value)
    assert str(missing) in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert fashion_mnist.SOURCE_DIR_ENV in message
    assert not fashion_mnist.LocalFashionMnist(
        data_dir=tmp_path / "tfds").is_prepared()


def test_source_dir_env_var(tmp_path, monkeypatch):
    missing = tmp_path / "from-env"
    monkeypatch.setenv(fashion_mnist.SOURCE_DIR_ENV, str(missing))
    assert fashion_mnist.resolve_source_dir() == str(missing)
    with pytest.raises(fashion_mnist.FashionMnistSourceError,
                       match="from-env"):
        fashion_mnist.read_split("train")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert fashion_mnist.resolve_source_dir("~/fmnist") == str(
        tmp_path / "fmnist")


def test_data_dir_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv(fashion_mnist.DATA_DIR_ENV, str(tmp_path))
    assert fashion_mnist.resolve_data_dir() == str(tmp_path)
    monkeypatch.delenv(fashion_mnist.DATA_DIR_ENV)
    assert fashion_mnist.resolve_data_dir() == os.path.expanduser(
        "~/.cache/keras_geeps/tfds")


def test_missing_file_names_it(tmp_path):
    _write_source_dir(tmp_path / "src")
    (tmp_path / "src" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(fashion_mnist.FashionMnistSourceError,
                       match="t10k-labels-idx1-ubyte.gz does not exist"):
        fashion_mnist.load(data_dir=tmp_path / "tfds",
                           source_dir=tmp_path / "src")


@pytest.mark.parametrize("damage,match", [
    ("magic", "magic number"),
    ("truncated", "header says shape"),
    ("overflowing", r"header says shape \(2147483648, 2147483648, 4\)"),
    ("not_gzip", "not a readable gzip file"),
    ("label_range", "label 12 is not below 10"),
    ("count_mismatch", "11 labels for 12 images"),
])
def test_corrupt_file_gives_clear_error(tmp_path, damage, match):
    source = tmp_path / "src"
    arrays = _write_source_dir(source)
    images, labels = arrays["train"]
    images_path = source / "train-images-idx3-ubyte.gz"
    labels_path = source / "train-labels-idx1-ubyte.gz"
    if damage == "magic":
        _write_idx(images_path, images, magic=0x0801)
    elif damage == "truncated":
        with gzip.open(images_path, "rb") as f:
            data = f.read()
        with gzip.open(images_path, "wb") as f:
            f.write(data[:-100])
    elif damage == "overflowing":  # dims whose uint64 product wraps to 0
        with gzip.open(images_path, "wb") as f:
            f.write(struct.pack(">4I", 0x0803, 1 << 31, 1 << 31, 4))
    elif damage == "not_gzip":
        images_path.write_bytes(b"this is not gzip")
    elif damage == "label_range":
        _write_idx(labels_path, np.where(labels == 3, 12, labels))
    elif damage == "count_mismatch":
        _write_idx(labels_path, labels[:-1])
    with pytest.raises(fashion_mnist.FashionMnistSourceError,
                       match=match) as raised:
        fashion_mnist.read_split("train", source_dir=source)
    assert "apt-get install dataset-fashion-mnist" in str(raised.value)


def test_small_source_dir_prepares_in_order(tmp_path):
    arrays = _write_source_dir(tmp_path / "src", num_train=12, num_test=5)
    for split, (want_images, want_labels) in arrays.items():
        got = list(fashion_mnist.load(split, data_dir=tmp_path / "tfds",
                                      source_dir=tmp_path / "src",
                                      as_float=False))
        assert len(got) == len(want_labels)
        np.testing.assert_array_equal(
            np.stack([image.numpy()[:, :, 0] for image, _ in got]),
            want_images)
        np.testing.assert_array_equal(
            [int(label) for _, label in got], want_labels)


_PREPARE_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from keras_geeps.datasets import fashion_mnist as fm

    data_dir, source_dir, log = sys.argv[1:]
    split_generators = fm.LocalFashionMnist._split_generators

    def logged(self, dl_manager):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(2)  # Hold the lock long enough for the other to wait.
        return split_generators(self, dl_manager)

    fm.LocalFashionMnist._split_generators = logged
    print(len(list(fm.load("train", data_dir, source_dir))))
""")


@pytest.mark.slow
def test_two_processes_prepare_once(tmp_path):
    _write_source_dir(tmp_path / "src", num_train=12)
    log = tmp_path / "prepared_by"
    env = dict(os.environ, PYTHONPATH=_REPO_ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARE_SCRIPT, str(tmp_path / "tfds"),
             str(tmp_path / "src"), str(log)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        for _ in range(2)]
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=240)
            assert process.returncode == 0, stderr[-3000:]
            outputs.append(stdout.split()[-1])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert outputs == ["12", "12"]
    assert len(log.read_text().split()) == 1
