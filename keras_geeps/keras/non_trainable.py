"""Non-trainable statistics (BatchNorm's) averaged over the workers.

The shards hold the trainable weights; what a layer keeps besides, such as
BatchNormalization's moving mean and variance, each worker updates from
its own batches, so without more the workers would end `fit` with
statistics of their own part of the data, and a model saved by worker 0
would normalise by worker 0's alone. TF's MirroredStrategy reads such
statistics as their mean over the replicas; here, at every epoch end
(before the epoch-end callbacks, after the epoch logs are averaged), every
worker's statistics are replaced by their mean over the live workers
(`keras/worker_mean.py`), so every worker, the models they save and the
next epoch start from the same ones.

Averaged: the model's non-trainable floating-point variables that no
frozen layer (`trainable=False`) holds, so a frozen BatchNorm's statistics
(and a frozen backbone's weights, which never change) cost nothing.
Random seed states and other integer variables are left alone. The
variables' paths, shapes and dtypes make the barrier's key: workers whose
models differ get a clear error. One table per layout, named
`keras_geeps.non_trainable.<n>` in the order the layouts first come; like
the epoch logs, it needs epoch ends that line up across workers.
"""

import zlib

import keras
import numpy as np

from keras_geeps.errors import GeePSTimeoutError
from keras_geeps.keras.worker_mean import WorkerMean

TABLE_PREFIX = "keras_geeps.non_trainable"


def averaged_variables(model):
    """The variables of `model` whose workers' values are averaged: its
    non-trainable floating-point variables held by no frozen layer.

    Args:
        model: a Keras model (or layer).

    Returns:
        A list of `keras.Variable`s, in the model's order.
    """
    frozen = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if not layer.trainable:
            frozen.update(id(v) for v in layer.weights)
    return [v for v in model.non_trainable_variables
            if id(v) not in frozen and keras.backend.is_float_dtype(v.dtype)]


class NonTrainableAverager:
    """Replaces a model's non-trainable statistics by the workers' mean.

    `GeePSStrategy(average_non_trainable=True)` has one, which `fit` calls
    at every epoch end (keras/_tf_hooks); a custom loop can call it at
    points every worker reaches alike.

    Args:
        client: the worker's `GeePSClient`.

    Example:

    ```python
    averager = NonTrainableAverager(strategy.client)
    for epoch in range(epochs):
        ...  # this worker's steps
        averager.average(model)  # every worker, after the same steps
    ```
    """

    def __init__(self, client):
        self.client = client
        self._means = {}  # layout key -> WorkerMean

    def average(self, model):
        """Sets each of `averaged_variables(model)` to its mean over the
        live workers (collective). A no-op with one worker, or when the
        model has no such variables.

        Returns:
            The number of variables averaged.

        Raises:
            GeePSError: the workers' models hold different variables.
            GeePSTimeoutError: a worker did not reach this epoch's end in
                the client's timeout.
        """
        if self.client.num_workers == 1:
            return 0
        variables = averaged_variables(model)
        if not variables:
            return 0
        layout = [(v.path, tuple(v.shape), str(v.dtype)) for v in variables]
        key = float(zlib.crc32(repr(layout).encode()))
        values = [np.asarray(v.numpy(), np.float64).reshape(-1)
                  for v in variables]
        sizes = [a.size for a in values]
        mean = self._means.get(key)
        if mean is None:
            mean = self._means[key] = WorkerMean(
                self.client, f"{TABLE_PREFIX}.{len(self._means)}", sum(sizes))
        try:
            means = mean.mean(
                np.concatenate(values), key,
                mismatch=f"the workers' models have different non-trainable "
                         f"variables (this worker: {len(layout)}, "
                         f"{layout[:3]}...): give every worker the same "
                         f"model, or pass GeePSStrategy("
                         f"average_non_trainable=False)")
        except GeePSTimeoutError as exc:
            raise GeePSTimeoutError(
                f"averaging the non-trainable variables (BatchNorm "
                f"statistics): a worker did not reach this epoch's end "
                f"(epoch ends must line up across workers): {exc}") from exc
        offset = 0
        for variable, size in zip(variables, sizes):  # (cast by assign)
            variable.assign(means[offset:offset + size].reshape(
                variable.shape))
            offset += size
        return len(variables)
