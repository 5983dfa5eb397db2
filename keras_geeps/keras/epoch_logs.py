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

The table (`TABLE`, one per client, one per-clock row of fixed width: room
for `MAX_KEYS` (4090) numbers and six more) is a
`keras/worker_mean.WorkerMean`, keyed by a hash of the logs' keys: workers
whose logs have different keys get a clear error instead of a mean of
unlike values, and a NaN or an infinity in one epoch does not poison the
later ones. Each barrier also carries the epoch and the parameter tables'
clock it was taken at, the statistics table's clock after that epoch end,
and its own number (all alike on every worker), so that a worker that
rejoins a job under way can read where the others' epochs end
(`last_epoch_end`, which also checks that the row it reads is the last
barrier's).

Epoch ends must line up across workers, as BSP `fit` needs anyway. A
worker that restarts mid-job (`on_worker_failure="continue"`) and rejoins
learns it from its shards (`client.rejoined_at`); its `fit` then first
lines up with the others' next epoch end (`keras/rejoin.py`).
"""

import collections
import zlib

import numpy as np

from keras_geeps.errors import GeePSError
from keras_geeps.keras.worker_mean import WorkerMean

TABLE = "keras_geeps.epoch_logs"
# Before the logs' numbers: where the epoch ended (`EpochEnd`), the
# barrier's number (the table's clock it is taken at) and the clock's
# square (its mean is the clock's squared only when every worker's clock
# is the same).
_EPOCH, _CLOCK, _STATISTICS, _BARRIER, _CLOCK_SQUARE, _LOGS = range(6)
# Numbers an epoch's logs may hold: room for a per-class metric of a few
# thousand classes (`F1Score(average=None)`); each worker sends and reads
# a row of 128 KiB per epoch end.
MAX_KEYS = 4096 - _LOGS


def _check_clocks(means, epoch, clock):
    """Raises on every worker when the workers' clocks at this epoch end
    differ: the mean of their squares is then more than their mean's
    square (equal ones give it exactly, in float64, below 2**26 steps).
    Workers that ran different numbers of steps would otherwise wait for
    each other's clocks until the timeout, blaming no data. (Only those
    that got here: a worker more steps ahead than the slack allows waits
    in its step for the others' clocks, and they here for its, until the
    timeout.)"""
    mean, square = means[_CLOCK], means[_CLOCK_SQUARE]
    if clock is None or not (np.isfinite(mean) and np.isfinite(square)):
        return
    if square != mean * mean:
        spread = np.sqrt(max(square - mean * mean, 0.0))
        raise GeePSError(
            f"the workers ended epoch {epoch} after different numbers of "
            f"steps (this worker at clock {clock}; the workers' mean "
            f"{mean:g}, spread {spread:.3g}): every worker must run as many "
            f"steps per epoch. Give each the same number of batches: "
            f"strategy.distribute_dataset(ds) cuts the workers' parts to "
            f"one length, or pass steps_per_epoch to fit")


class EpochEnd(collections.namedtuple(
        "EpochEnd", ["epoch", "clock", "statistics_clock"])):
    """Where an averaged epoch ended: the epoch, the parameter tables'
    clock, and the clock of the table averaging the model's statistics
    after that epoch end's barrier (keras/non_trainable.py), or None."""


def _numeric(value):
    """`value` as a float64 array when it is a real number or an array of
    them (a per-class metric: `F1Score(average=None)`), not of bools or
    empty; else None."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return None
    try:
        array = np.asarray(value)
    except Exception:  # (whatever a callback put there)
        return None
    if array.dtype.kind not in "iuf" or not array.size:
        return None
    return array.astype(np.float64)


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
        self.worker_mean = WorkerMean(client, TABLE, _LOGS + MAX_KEYS)

    def last_epoch_end(self):
        """Where the workers' last averaged epoch ended, read without
        taking part in a barrier (by a worker that rejoined: see
        `keras/rejoin.py`).

        Returns:
            An `EpochEnd`, or None when there was no barrier yet, or it did
            not say (`average` called without `epoch` and `clock`).

        Raises:
            GeePSError: the row read is not the last barrier's (its number
                is not the one before the table's clock).
        """
        means = self.worker_mean.last()
        if means is None or not np.all(np.isfinite(means[:_CLOCK + 1])):
            return None
        barrier = self.worker_mean.table().clock - 1
        if means[_BARRIER] != barrier:
            raise GeePSError(
                f"the epoch logs' table at clock {barrier + 1} holds the "
                f"sums of barrier {means[_BARRIER]:g}, not of {barrier}: "
                f"were its rows restored from another job's checkpoint?")
        statistics = means[_STATISTICS]
        return EpochEnd(int(round(means[_EPOCH])), int(round(means[_CLOCK])),
                        int(round(statistics)) if np.isfinite(statistics)
                        else None)

    def average(self, logs, epoch=None, clock=None, statistics_clock=None):
        """Replaces the numbers in `logs` (in place) by their mean over the
        live workers, arrays of them (a per-class metric) element by
        element; leaves other entries alone (nested dicts are flattened
        first, as Keras' callbacks see them). A no-op with one worker.

        Args:
            logs: the epoch's logs (a dict).
            epoch: the epoch that ends (alike on every worker), or None.
            clock: the parameter tables' clock at this epoch end (alike on
                every worker), or None. With `epoch`, what
                `last_epoch_end` reads.
            statistics_clock: the clock the statistics' table will have
                after this epoch end's averaging, or None.

        Raises:
            GeePSError: the workers' logs have different keys, or more
                than `MAX_KEYS` numbers, or their `clock`s differ (every
                worker raises it, at the same barrier).
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
        count = sum(values[k].size for k in keys)
        if count > MAX_KEYS:
            raise GeePSError(
                f"{count} numbers in the epoch logs: at most {MAX_KEYS} "
                f"can be averaged over the workers (pass GeePSStrategy("
                f"average_epoch_logs=False))")
        row = np.zeros(_LOGS + MAX_KEYS)
        row[_EPOCH] = np.nan if epoch is None else epoch
        row[_CLOCK] = np.nan if clock is None else clock
        row[_CLOCK_SQUARE] = np.nan if clock is None else float(clock) ** 2
        row[_STATISTICS] = np.nan if statistics_clock is None \
            else statistics_clock
        row[_BARRIER] = self.worker_mean.table().clock
        row[_LOGS:_LOGS + count] = np.concatenate(
            [values[k].reshape(-1) for k in keys])
        # (the shapes in the key: a vector of another length is no match)
        shaped = [f"{k}{values[k].shape if values[k].ndim else ''}"
                  for k in keys]
        means = self.worker_mean.mean(
            row, key=float(zlib.crc32("\0".join(shaped).encode())),
            mismatch=f"the workers' epoch logs have different keys (this "
                     f"worker: {shaped}): give every worker the same "
                     f"metrics and validation settings",
            what="averaging the epoch logs")
        _check_clocks(means, epoch, clock)
        start = _LOGS
        for key in keys:
            value = values[key]
            mean = means[start:start + value.size]
            flat[key] = float(mean[0]) if not value.ndim else \
                mean.reshape(value.shape).copy()
            start += value.size
        logs.clear()
        logs.update(flat)
