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

When `fit` validates, the statistics are averaged before the validation
instead (`on_test_begin` within `fit`), so that the `val_*` figures, and
the callbacks that choose a model by them, measure the model the workers
then hold and save.

Averaged: the model's non-trainable floating-point variables that no
frozen layer (`trainable=False`) holds and no parameter table holds (a
frozen LoRA kernel is the shards', alike everywhere), so a frozen
BatchNorm's statistics (and a frozen backbone's weights, which never
change) cost nothing. Statistics or not: a constant one (a fixed random
projection) is averaged too, which leaves it as it is, as every worker
started from worker 0's value (`initial_values.py`). Random seed
states and other integer variables are left alone. The variables' paths,
shapes and dtypes make the barrier's key: workers whose models differ get
a clear error. One table per layout
and client (strategies sharing a client share them), named
`keras_geeps.non_trainable.<n>` in the order the layouts first come; like
the epoch logs, it needs epoch ends that line up across workers (a worker
that rejoins a job under way lines up first: keras/rejoin.py).
"""

import weakref
import zlib

import keras
import numpy as np

from keras_geeps.keras.worker_mean import WorkerMean

TABLE_PREFIX = "keras_geeps.non_trainable"
# client -> {layout key: WorkerMean}: one table per layout and client
_MEANS = weakref.WeakKeyDictionary()


def averaged_variables(model, sync=None):
    """The variables of `model` whose workers' values are averaged: its
    non-trainable floating-point variables held by no frozen layer and
    by no parameter table of `sync`.

    Args:
        model: a Keras model (or layer).
        sync: the strategy's `ParameterSync`, or None.

    Returns:
        A list of `keras.Variable`s, in the model's order.
    """
    frozen = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if not layer.trainable:
            frozen.update(id(v) for v in layer.weights)
    candidates = [v for v in model.non_trainable_variables
                  if id(v) not in frozen and
                  keras.backend.is_float_dtype(v.dtype)]
    return candidates if sync is None else sync.not_held(candidates)


class NonTrainableAverager:
    """Replaces a model's non-trainable statistics by the workers' mean.

    `GeePSStrategy(average_non_trainable=True)` has one, which `fit` calls
    at every epoch end, or before the validation when `fit` validates
    (keras/_tf_hooks); a custom loop can call it at
    points every worker reaches alike.

    Args:
        client: the worker's `GeePSClient`.
        sync: the strategy's `ParameterSync`, whose tables' variables are
            left out; None (the default) for none.

    Example:

    ```python
    averager = NonTrainableAverager(strategy.client)
    for epoch in range(epochs):
        ...  # this worker's steps
        averager.average(model)  # every worker, after the same steps
    ```
    """

    def __init__(self, client, sync=None):
        self.client = client
        self.sync = sync

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
        variables = self._averaged(model)
        if not variables:
            return 0
        mean, layout, key = self._mean_of(variables)
        values = np.concatenate([np.asarray(v.numpy(), np.float64).reshape(-1)
                                 for v in variables])
        means = mean.mean(
            values, key,
            mismatch=f"the workers' models have different non-trainable "
                     f"variables (this worker: {len(layout)}, "
                     f"{layout[:3]}...): give every worker the same model, "
                     f"or pass GeePSStrategy(average_non_trainable=False)",
            what="averaging the non-trainable variables (BatchNorm "
                 "statistics)")
        _assign(variables, means)
        return len(variables)

    def adopt(self, model):
        """Sets each of `averaged_variables(model)` to the others' mean at
        their last barrier, which this worker took part in with nothing
        (`WorkerMean.skip`) or missed: a worker that rejoined a job under
        way (`keras/rejoin.py`) starts from the others' statistics, not
        from the job's starting ones. Waits for the others to finish that
        barrier.

        Returns:
            The number of variables set: none with one worker, before the
            first barrier, or where the others' variables differ.
        """
        variables = self._averaged(model)
        if not variables:
            return 0
        mean, _, key = self._mean_of(variables)
        try:
            self.client.table(mean.name)
        except KeyError:  # (made by no worker yet: not made here either,
            return 0      # out of the others' table order)
        means = mean.last(key)
        if means is None:
            return 0
        _assign(variables, means)
        return len(variables)

    def _averaged(self, model):
        """`averaged_variables(model)`, or none with one worker."""
        if self.client.num_workers == 1:
            return []
        return averaged_variables(model, self.sync)

    def worker_mean(self, model):
        """The `WorkerMean` `model`'s statistics are averaged through (its
        table is made at its first use), or None when it has none."""
        variables = averaged_variables(model, self.sync)
        return self._mean_of(variables)[0] if variables else None

    def _mean_of(self, variables):
        """(WorkerMean, layout, key) of a list of averaged variables: one
        table per layout and client, named in the order layouts come."""
        layout = [(v.path, tuple(v.shape), str(v.dtype)) for v in variables]
        key = float(zlib.crc32(repr(layout).encode()))
        means_of = _MEANS.setdefault(self.client, {})
        mean = means_of.get(key)
        if mean is None:
            size = sum(int(np.prod(v.shape)) for v in variables)
            mean = means_of[key] = WorkerMean(
                self.client, f"{TABLE_PREFIX}.{len(means_of)}", size)
        return mean, layout, key


def _assign(variables, values):
    """Sets `variables` (in order) from the flat float64 `values`."""
    offset = 0
    for variable in variables:  # (cast by assign)
        size = int(np.prod(variable.shape))
        variable.assign(values[offset:offset + size].reshape(variable.shape))
        offset += size
