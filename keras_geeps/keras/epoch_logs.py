"""Epoch-end logs averaged over the workers, through a shard table.

Each worker of a `model.fit` job computes its own epoch metrics (its
training loss over its part of the data, its validation metrics). TF's
multi-worker strategies report global metrics, and callbacks that decide
(`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint(save_best_only)`)
must decide alike on every worker: one that stops while the others go on
would leave them waiting for its clock. So before any callback sees an
epoch's logs, every worker adds `[1, key hash, values...]` to a one-row
float64 table, clocks it and reads it at exactly that clock; the logs then
hold the mean over the workers that took part (a dead worker, under
`on_worker_failure="continue"`, is no longer counted). Workers whose logs
have different keys get a clear error instead of a mean of unlike values.
"""

import numbers
import zlib

import numpy as np

from keras_geeps.errors import GeePSError, GeePSTimeoutError

TABLE_PREFIX = "keras_geeps.epoch_logs"


def _numeric(value):
    """`value` as a float when it is a real scalar, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 (anything not array-like)
        return None
    if array.ndim == 0 and array.dtype.kind in "fiu":
        return float(array)
    return None


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
        self._tables = {}  # width -> Table

    def _table(self, width):
        table = self._tables.get(width)
        if table is None:
            # Every worker averages the same logs at the same epochs, so
            # they create these tables in the same order, as table ids need.
            table = self.client.create_table(f"{TABLE_PREFIX}.{width}", 1,
                                             width, dtype="float64")
            self._tables[width] = table
        return table

    def average(self, logs):
        """Replaces the numbers in `logs` (in place) by their mean over the
        live workers; leaves other entries alone. A no-op with one worker.

        Raises:
            GeePSError: the workers' logs have different keys.
            GeePSTimeoutError: a worker did not reach this epoch's end in
                the client's timeout.
        """
        if logs is None or self.client.num_workers == 1:
            return
        numbers_ = {k: _numeric(v) for k, v in logs.items()}
        keys = sorted(k for k, v in numbers_.items() if v is not None)
        if not keys:
            return
        key_hash = float(zlib.crc32("\0".join(keys).encode()))
        table = self._table(len(keys) + 2)
        slack = self.client.slack
        clock = table.clock
        try:
            # At exactly this clock and the next: no worker can be past
            # the clock this one is at, so the rows are those of the clock.
            before = self.client.read(table, clock=clock + slack)[0]
            self.client.update(table, np.array(
                [[1.0, key_hash, *(numbers_[k] for k in keys)]]))
            self.client.clock([table])
            after = self.client.read(table, clock=clock + 1 + slack)[0]
        except GeePSTimeoutError as exc:
            raise GeePSTimeoutError(
                f"averaging the logs of epoch end {clock}: a worker did not "
                f"get there (its logs may have other keys than {keys}): "
                f"{exc}") from exc
        count, hashes, *sums = after - before
        workers = int(round(count))
        if workers < 1 or hashes != workers * key_hash:
            raise GeePSError(
                f"the workers' epoch logs have different keys (this worker: "
                f"{keys}): give every worker the same metrics and "
                f"validation settings")
        for key, total in zip(keys, sums):
            logs[key] = float(total / workers)
