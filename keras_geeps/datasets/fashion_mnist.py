"""Fashion-MNIST from the Debian package `dataset-fashion-mnist`, via tfds.

The main keras_geeps job trains on Fashion-MNIST and must never reach the
network. Debian's `dataset-fashion-mnist` installs the four original idx
files under /usr/share/datasets/fashion-mnist, but the stock tfds
`fashion_mnist` builder cannot use them as a manual_dir: Debian recompressed
them, so their checksums differ from the ones tfds records. This module is a
tfds builder of its own that parses the idx files with numpy and writes an
ordinary tfds dataset (TFRecords plus `dataset_info.json`), prepared once per
data folder; every later `load` reads that.

Images are stored as raw uint8 tensors, not PNGs: preparing and reading
70,000 28x28 images is about twice as fast that way, and the extra 25 MB on
disk does not matter. Examples keep the order of the source files
(`disable_shuffling`), so example i of a split is image i of the idx file.

Where things are read from and written to:
    source_dir: argument, else `$KERAS_GEEPS_FASHION_MNIST_DIR`, else
        /usr/share/datasets/fashion-mnist.
    data_dir: argument, else `$KERAS_GEEPS_TFDS_DIR`, else
        ~/.cache/keras_geeps/tfds. The prepared data does not record which
        source_dir it came from: use one data_dir per source_dir.

Example:

```python
from keras_geeps.datasets import fashion_mnist

train = fashion_mnist.load("train").shuffle(10_000).batch(128)
test = fashion_mnist.load("test").batch(1024)
images, labels = next(iter(train))  # float32 (128, 28, 28, 1), int64 (128,)
```
"""

import gzip
import math
import os
import zlib

import numpy as np
# tensorflow_datasets itself is light (it imports TensorFlow lazily); the
# builder class below needs it at definition time. keras_geeps and
# keras_geeps.datasets do not import this module, so `import keras_geeps`
# stays cheap.
import tensorflow_datasets as tfds

from keras_geeps.errors import GeePSError, GeePSTimeoutError

DEFAULT_SOURCE_DIR = "/usr/share/datasets/fashion-mnist"
SOURCE_DIR_ENV = "KERAS_GEEPS_FASHION_MNIST_DIR"
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "keras_geeps", "tfds")
DATA_DIR_ENV = "KERAS_GEEPS_TFDS_DIR"
LOCK_TIMEOUT_S = 600

IMAGE_SHAPE = (28, 28, 1)
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
NUM_CLASSES = len(CLASS_NAMES)
# Examples per split in the full set the Debian package installs.
NUM_EXAMPLES = {"train": 60_000, "test": 10_000}
# Split name -> (images file, labels file) inside source_dir.
SOURCE_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# idx magic numbers: 0x08 (unsigned byte) in byte 3, the rank in byte 4.
_IMAGES_MAGIC = 0x00000803
_LABELS_MAGIC = 0x00000801

_HOW_TO_FIX = (
    "Install the files with `sudo apt-get install dataset-fashion-mnist` "
    f"(add --reinstall if they are damaged), or set {SOURCE_DIR_ENV} to a "
    "folder holding " + ", ".join(
        name for pair in SOURCE_FILES.values() for name in pair) + ".")


class FashionMnistSourceError(GeePSError):
    """A Fashion-MNIST source file is missing or corrupt.

    The message names the file, what is wrong with it, and how to install
    the Debian package or point `$KERAS_GEEPS_FASHION_MNIST_DIR` elsewhere.
    """


def _source_error(path, problem):
    return FashionMnistSourceError(
        f"Fashion-MNIST source file {path} {problem}. {_HOW_TO_FIX}")


def _read_idx(path, magic, rank):
    """Returns the uint8 array in gzip'd idx file `path`, checked."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise _source_error(path, "does not exist") from None
    except (OSError, EOFError, zlib.error) as e:
        raise _source_error(path, f"is not a readable gzip file ({e})") from e
    header_bytes = 4 * (1 + rank)
    if len(data) < header_bytes:
        raise _source_error(
            path, f"is corrupt: {len(data)} bytes, shorter than an idx header")
    found_magic = int.from_bytes(data[:4], "big")
    if found_magic != magic:
        raise _source_error(
            path, f"is corrupt: idx magic number {found_magic:#010x}, "
            f"expected {magic:#010x}")
    shape = tuple(int(d) for d in np.frombuffer(data, ">u4", rank, 4))
    payload_bytes = len(data) - header_bytes
    declared = math.prod(shape)  # Python ints: np.prod wraps at 2**64
    if payload_bytes != declared:
        raise _source_error(
            path, f"is corrupt: header says shape {shape} "
            f"({declared} bytes), file holds {payload_bytes}")
    return np.frombuffer(data, np.uint8, offset=header_bytes).reshape(shape)


def read_split(split, source_dir=None):
    """Reads one split of the idx files into numpy arrays.

    The parser behind the builder, public so that tools and tests can look
    at the raw data without tensorflow-datasets. Every check a truncated or
    wrong file could fail (gzip, magic number, declared vs. actual size,
    28x28 images, as many labels as images, labels below 10) raises
    `FashionMnistSourceError` with a message saying how to fix it.

    Args:
        split: "train" or "test".
        source_dir: folder of the four idx .gz files. Defaults to None:
            `$KERAS_GEEPS_FASHION_MNIST_DIR`, else
            /usr/share/datasets/fashion-mnist.

    Returns:
        `(images, labels)`: uint8 arrays of shape (n, 28, 28) and (n,).

    Example:

    ```python
    images, labels = read_split("test")
    assert images.shape == (10_000, 28, 28)
    ```
    """
    if split not in SOURCE_FILES:
        raise ValueError(
            f"split must be one of {sorted(SOURCE_FILES)}, got {split!r}")
    source_dir = resolve_source_dir(source_dir)
    images_name, labels_name = SOURCE_FILES[split]
    images_path = os.path.join(source_dir, images_name)
    labels_path = os.path.join(source_dir, labels_name)
    if not os.path.isdir(source_dir):
        raise FashionMnistSourceError(
            f"Fashion-MNIST source folder {source_dir} does not exist. "
            f"{_HOW_TO_FIX}")
    images = _read_idx(images_path, _IMAGES_MAGIC, 3)
    labels = _read_idx(labels_path, _LABELS_MAGIC, 1)
    if images.shape[1:] != IMAGE_SHAPE[:2]:
        raise _source_error(
            images_path, f"is corrupt: images are {images.shape[1:]}, "
            f"expected {IMAGE_SHAPE[:2]}")
    if len(images) != len(labels):
        raise _source_error(
            labels_path, f"is corrupt: {len(labels)} labels for "
            f"{len(images)} images in {images_name}")
    if len(labels) and int(labels.max()) >= NUM_CLASSES:
        raise _source_error(
            labels_path, f"is corrupt: label {int(labels.max())} is not "
            f"below {NUM_CLASSES}")
    return images, labels


def resolve_source_dir(source_dir=None):
    """Returns `source_dir`, else `$KERAS_GEEPS_FASHION_MNIST_DIR`, else the
    Debian package's folder, with `~` expanded (as `resolve_data_dir`)."""
    return os.path.expanduser(os.fspath(
        source_dir or os.environ.get(SOURCE_DIR_ENV) or DEFAULT_SOURCE_DIR))


def resolve_data_dir(data_dir=None):
    """Returns `data_dir`, else `$KERAS_GEEPS_TFDS_DIR`, else
    ~/.cache/keras_geeps/tfds, with `~` expanded."""
    return os.path.expanduser(os.fspath(
        data_dir or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR))


class LocalFashionMnist(tfds.core.GeneratorBasedBuilder):
    """tfds builder of Fashion-MNIST from local idx files, never the network.

    Registered with tfds as "local_fashion_mnist", so once prepared it can
    also be read with `tfds.builder("local_fashion_mnist", data_dir=...)`.
    Most callers want `load` instead, which prepares it once under a file
    lock and returns the (image, label) pairs.

    Args:
        source_dir: folder of the four idx .gz files. Defaults to None:
            `$KERAS_GEEPS_FASHION_MNIST_DIR`, else
            /usr/share/datasets/fashion-mnist.
        **kwargs: passed to `tfds.core.GeneratorBasedBuilder` (`data_dir`,
            ...).

    Example:

    ```python
    builder = LocalFashionMnist(data_dir="/tmp/tfds")
    builder.download_and_prepare(download_config=offline_download_config())
    test = builder.as_dataset(split="test", as_supervised=True)
    ```
    """

    name = "local_fashion_mnist"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Raw uint8 images, source file order."}

    def __init__(self, *, source_dir=None, **kwargs):
        self._source_dir = resolve_source_dir(source_dir)
        super().__init__(**kwargs)

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Fashion-MNIST (Zalando): 28x28 grayscale images of 10 "
                "kinds of clothing, read from the Debian package "
                "dataset-fashion-mnist."),
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Tensor(
                    shape=IMAGE_SHAPE, dtype=np.uint8),
                "label": tfds.features.ClassLabel(names=CLASS_NAMES),
            }),
            supervised_keys=("image", "label"),
            homepage="https://github.com/zalandoresearch/fashion-mnist",
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing is downloaded.
        # Read and check every file before writing anything.
        arrays = {split: read_split(split, self._source_dir)
                  for split in SOURCE_FILES}
        return {split: self._generate_examples(images, labels)
                for split, (images, labels) in arrays.items()}

    def _generate_examples(self, images, labels):
        for index, (image, label) in enumerate(zip(images, labels)):
            yield index, {"image": image[..., np.newaxis],
                          "label": int(label)}


def offline_download_config():
    """Returns a `tfds.download.DownloadConfig` that never uses the network.

    No prepared copy is fetched from GCS, and no statistics are computed
    (they would only slow preparation down).
    """
    return tfds.download.DownloadConfig(
        try_download_gcs=False,
        compute_stats=tfds.download.ComputeStatsMode.SKIP,
    )


def _is_prepared(builder):
    # tfds writes into a temporary folder and renames it when done, so the
    # info file exists only for a complete dataset. builder.is_prepared()
    # says the same but logs a warning when the folder is not there yet.
    return os.path.exists(os.path.join(builder.data_dir, "dataset_info.json"))


def prepare(data_dir=None, source_dir=None):
    """Prepares the dataset in `data_dir` unless it is there; returns the
    builder.

    Safe to call from several processes at once: a file lock in `data_dir`
    makes one of them prepare (a few seconds) while the others wait, then
    read what it wrote. An already prepared `data_dir` is only read, so it
    may be read-only.

    Args:
        data_dir: tfds data folder. Defaults to None: `$KERAS_GEEPS_TFDS_DIR`,
            else ~/.cache/keras_geeps/tfds.
        source_dir: folder of the four idx .gz files, read only when
            preparing. Defaults to None: `$KERAS_GEEPS_FASHION_MNIST_DIR`,
            else /usr/share/datasets/fashion-mnist.

    Returns:
        A prepared `LocalFashionMnist`.

    Example:

    ```python
    builder = prepare()
    print(builder.info.splits["train"].num_examples)  # 60000
    ```
    """
    import filelock  # noqa: PLC0415

    data_dir = resolve_data_dir(data_dir)
    builder = LocalFashionMnist(data_dir=data_dir, source_dir=source_dir)
    if _is_prepared(builder):
        return builder
    os.makedirs(data_dir, exist_ok=True)
    lock_path = os.path.join(data_dir, f"{LocalFashionMnist.name}.lock")
    try:
        with filelock.FileLock(lock_path, timeout=LOCK_TIMEOUT_S):
            # Another process may have prepared it while this one waited; a
            # fresh builder reads its info from disk and skips the work.
            builder = LocalFashionMnist(data_dir=data_dir,
                                        source_dir=source_dir)
            builder.download_and_prepare(
                download_config=offline_download_config())
    except filelock.Timeout:
        raise GeePSTimeoutError(
            f"waited {LOCK_TIMEOUT_S} s for {lock_path}: another process is "
            "preparing Fashion-MNIST and has not finished. If none is, "
            "delete the lock file.") from None
    return builder


def info(data_dir=None, source_dir=None):
    """Returns the `tfds.core.DatasetInfo` of the prepared dataset.

    Counts come from what was prepared, so they also hold for a smaller
    source set; `NUM_EXAMPLES` gives the full set's counts without
    preparing anything.

    Args:
        data_dir: tfds data folder. Defaults to None: `$KERAS_GEEPS_TFDS_DIR`,
            else ~/.cache/keras_geeps/tfds.
        source_dir: folder of the idx .gz files, read only when preparing.
            Defaults to None: `$KERAS_GEEPS_FASHION_MNIST_DIR`, else
            /usr/share/datasets/fashion-mnist.

    Example:

    ```python
    steps = info().splits["train"].num_examples // 128
    ```
    """
    return prepare(data_dir, source_dir).info


def load(split="train", data_dir=None, source_dir=None, as_float=True):
    """Returns one split of Fashion-MNIST as `(image, label)` pairs.

    The training jobs' single entry to the data: prepares the tfds dataset
    on first use (see `prepare`) and reads it back in source order,
    unshuffled and unbatched, so each worker can shard, shuffle and batch
    it as its job needs.

    Args:
        split: a tfds split: "train", "test", or a slice such as
            "train[:10%]". Defaults to "train".
        data_dir: tfds data folder. Defaults to None: `$KERAS_GEEPS_TFDS_DIR`,
            else ~/.cache/keras_geeps/tfds.
        source_dir: folder of the idx .gz files, read only when preparing.
            Defaults to None: `$KERAS_GEEPS_FASHION_MNIST_DIR`, else
            /usr/share/datasets/fashion-mnist.
        as_float: images as float32 scaled to [0, 1] if True, as the stored
            uint8 if False. Defaults to True.

    Returns:
        A `tf.data.Dataset` of `(image, label)`: image float32 (or uint8)
        of shape (28, 28, 1), label an int64 scalar in [0, 10).

    Example:

    ```python
    train = load("train").shuffle(10_000).batch(128)
    model.fit(train, epochs=1)
    ```
    """
    dataset = prepare(data_dir, source_dir).as_dataset(
        split=split, as_supervised=True, shuffle_files=False)
    if not as_float:
        return dataset
    import tensorflow as tf  # noqa: PLC0415
    return dataset.map(
        lambda image, label: (tf.cast(image, tf.float32) / 255.0, label),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
