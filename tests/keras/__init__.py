"""Tests of the Keras face: real shards on 127.0.0.1, real TensorFlow."""

import numpy as np


def regression_data(rows):
    """Seeded (x, y): `rows` samples of 5 features and 2 targets."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 5)).astype(np.float32)
    y = rng.standard_normal((rows, 2)).astype(np.float32)
    return x, y
