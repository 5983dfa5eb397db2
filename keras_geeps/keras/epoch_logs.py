"""Epoch-end logs averaged over the workers, through a shard table.

Each worker of a `model.fit` job computes its own epoch metrics (its
training loss over its part of the data, its validation metrics). TF's
multi-worker strategies report global metrics, and callbacks that decide
(`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint(save_best_only)`)
must decide alike on every worker: one that stops while the others go on
would leave them waiting for its clock. So before any callback sees an
epoch's logs, every worker adds its numbers to one float64 row, clocks it
and reads it at exactly that clock (a barrier at every epoch end); the logs
then hold the mean over the workers that took part (a dead worker, under
`on_worker_failure="continue"`, is no longer counted).

The table (`TABLE`, one per client, two rows of fixed width: room for
`MAX_KEYS` numbers) is a `keras/worker_mean.WorkerMean`, keyed by a hash of
the logs' keys: workers whose logs have different keys get a clear error
instead of a mean of unlike values, and a NaN or an infinity in one epoch
does not poison the later ones.

Epoch ends must line up across workers, as BSP `fit` needs anyway: a
worker that restarts mid-job (`on_worker_failure="continue"`) would leave
the others at the barrier; pass `GeePSStrategy(average_epoch_logs=False,
average_non_trainable=False)` to every worker of such jobs (the
statistics' barrier, keras/non_trainable.py, needs the same). A worker that
rejoins a job under way learns it from its shards (`client.rejoined_at`),
and its `fit` warns while either averaging is on.
"""

import zlib

import numpy as np

from keras_geeps.errors import GeePSError
from keras_geeps.keras.worker_mean import WorkerMean

TABLE = "keras_geeps.epoch_logs"
MAX_KEYS = 256


def _numeric(value):
    """`value` as a float when it is a real number (not a bool), else None."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _flat(logs):
    """`logs` flattened as Keras' CallbackList does (nested dicts merged)."""
    flat = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            flat.update(_flat(value))
        else:
            flat[key] = value
    return flat


class EpochLogAverager:
    """Averages a worker's epoch-end logs with the other workers'.

    Args:
        client: the worker's `GeePSClient`.

    Example:

    ```python
    averager = EpochLogAverager(strategy.client)
    averager.average(logs)   # at every epoch end, on every worker
    ```
    """

    def __init__(self, client):
        self.client = client
        self._mean = WorkerMean(client, TABLE, MAX_KEYS)

    def average(self, logs):
        """Replaces the numbers in `logs` (in place) by their mean over the
        live workers; leaves other entries alone (nested dicts are
        flattened first, as Keras' callbacks see them). A no-op with one
        worker.

        Raises:
            GeePSError: the workers' logs have different keys, or more
                than `MAX_KEYS` numbers.
            GeePSTimeoutError: a worker did not reach this epoch's end in
                the client's timeout.
        """
        if logs is None or self.client.num_workers == 1:
            return
        flat = _flat(logs)
        values = {k: _numeric(v) for k, v in flat.items()}
        keys = sorted(k for k, v in values.items() if v is not None)
        if not keys:
            return
        if len(keys) > MAX_KEYS:
            raise GeePSError(
                f"{len(keys)} numbers in the epoch logs: at most {MAX_KEYS} "
                f"can be averaged over the workers (pass GeePSStrategy("
                f"average_epoch_logs=False))")
        row = np.zeros(MAX_KEYS)
        row[:len(keys)] = [values[k] for k in keys]
        means = self._mean.mean(
            row, key=float(zlib.crc32("\0".join(keys).encode())),
            mismatch=f"the workers' epoch logs have different keys (this "
                     f"worker: {keys}): give every worker the same metrics "
                     f"and validation settings",
            what="averaging the epoch logs")
        for i, key in enumerate(keys):
            flat[key] = float(means[i])
        logs.clear()
        logs.update(flat)
