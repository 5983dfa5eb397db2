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

The table (`TABLE`, one per client, fixed width) has two rows; epoch end
c writes row c % 2. A row holds a count and a hash of the keys, then per
key (in sorted order) its finite value and how many workers sent NaN, +inf
and -inf; the figures are read as the row's change between the two clocks.
Non-finite values never enter the table, so one NaN cannot poison later
epochs, and while row c % 2 takes the figures, worker 0 subtracts the other
row's contents from it (x - x is exactly 0): each epoch starts from a zero
row, so a huge loss in one epoch costs the next ones no precision. (Without
a live worker 0 the change is still exact in its counts, and its values
lose only what float64 loses next to the leftovers.) Workers whose logs
have different keys get a clear error instead of a mean of unlike values.

Epoch ends must line up across workers, as BSP `fit` needs anyway: a
worker that restarts mid-job (`on_worker_failure="continue"`) would leave
the others at the barrier; pass `GeePSStrategy(average_epoch_logs=False)`
for such jobs.
"""

import zlib

import numpy as np

from keras_geeps.errors import GeePSError, GeePSTimeoutError

TABLE = "keras_geeps.epoch_logs"
MAX_KEYS = 256
_HEAD = 2                 # count, key hash
_PER_KEY = 4              # finite value, #NaN, #+inf, #-inf
WIDTH = _HEAD + _PER_KEY * MAX_KEYS


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

    def _table(self):
        try:
            return self.client.table(TABLE)  # (another strategy's client)
        except KeyError:
            pass
        # Every worker averages at the same epoch ends, so they all create
        # it at the same point of their table order, as table ids need.
        return self.client.create_table(TABLE, 2, WIDTH, dtype="float64")

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
        key_hash = float(zlib.crc32("\0".join(keys).encode()))
        try:
            table = self._table()
            clock, slack = table.clock, self.client.slack
            write = clock % 2
            # At exactly this clock and the next: no worker can be past
            # the clock this one is at, so the rows are those of the clock.
            rows_before = self.client.read(table, clock=clock + slack)
            before = rows_before[write]
            rows = np.zeros((2, WIDTH))
            row = rows[write]
            row[0], row[1] = 1.0, key_hash
            for i, key in enumerate(keys):
                value, at = values[key], _HEAD + _PER_KEY * i
                row[at + 1:at + 4] = (np.isnan(value), value == np.inf,
                                      value == -np.inf)
                if np.isfinite(value):
                    row[at] = value
            if self.client.worker_id == 0:  # the next epoch's row: to zero
                rows[1 - write] = -rows_before[1 - write]
            self.client.update(table, rows)
            self.client.clock([table])
            after = self.client.read(table, clock=clock + 1 + slack)[write]
        except GeePSTimeoutError as exc:
            raise GeePSTimeoutError(
                f"averaging the epoch logs: a worker did not reach this "
                f"epoch's end (epoch ends must line up across workers): "
                f"{exc}") from exc
        change = after - before
        count = int(round(change[0]))
        if count < 1 or change[1] != count * key_hash:
            raise GeePSError(
                f"the workers' epoch logs have different keys (this worker: "
                f"{keys}): give every worker the same metrics and "
                f"validation settings")
        for i, key in enumerate(keys):
            at = _HEAD + _PER_KEY * i
            nan, pos, neg = np.round(change[at + 1:at + 4])
            if nan or (pos and neg):
                mean = float("nan")
            elif pos or neg:
                mean = float("inf") if pos else float("-inf")
            else:
                mean = float(change[at] / count)
            flat[key] = mean
        logs.clear()
        logs.update(flat)
