"""The mean of one vector per worker, taken at a barrier through a shard table.

`model.fit` under a GeePS strategy averages a few things over the workers
at every epoch end: the epoch's logs (`keras/epoch_logs.py`) and the
non-trainable statistics, such as BatchNorm's moving mean and variance
(`keras/non_trainable.py`). Both go through a `WorkerMean`: every worker
adds its numbers to the one float64 row of a per-clock table
(`GeePSClient.create_table(per_clock=True)`), clocks it and reads it at
exactly that clock (a barrier); the row there is the sum over the workers
that took part (a dead worker, under `on_worker_failure="continue"`, no
longer counts), and nothing else: the shards start each clock's row from
zeros, so no worker has to zero it, and a barrier that a worker missed
(dead, or restarted) leaves nothing behind in later ones.

The row holds a count and a key (a hash saying what the numbers mean:
workers whose keys differ get a clear error instead of a mean of unlike
values), then per value its finite part and how many workers sent NaN,
+inf and -inf. Non-finite values never enter the table, so one NaN cannot
poison later barriers. A mean of equal values is that value exactly (the
float64 sum of up to 2**29 equal float32 values is exact).
"""

import numpy as np

from keras_geeps import protocol
from keras_geeps.errors import (GeePSError, GeePSServerError,
                                GeePSTimeoutError)

_HEAD = 2       # count, key
_PER_VALUE = 4  # finite part, #NaN, #+inf, #-inf


class WorkerMean:
    """Means over the live workers of one float64 vector of `size` each.

    Collective: every worker calls `mean` at the same points (the barrier
    waits for every live worker's clock of the table). The table is
    created at the first call (every worker makes it at the same point of
    its table order, as table ids need), or taken over when the client
    has one by that name already (another strategy's).

    Args:
        client: the worker's `GeePSClient`.
        name: the table's name.
        size: how many values each worker sends.

    Example:

    ```python
    mean = WorkerMean(client, "my.means", 3)
    mean.mean(np.array([1.0, 2.0, np.nan]), key=7.0,  # on every worker
              mismatch="the workers mean different things")
    ```
    """

    def __init__(self, client, name, size):
        self.client = client
        self.name = name
        self.size = size

    @property
    def width(self):
        """The table's row width."""
        return _HEAD + _PER_VALUE * self.size

    def table(self):
        """The table, created (or taken over) at the first call."""
        try:
            table = self.client.table(self.name)
        except KeyError:
            try:
                return self.client.create_table(
                    self.name, 1, self.width, dtype="float64",
                    per_clock=True)
            except GeePSServerError as exc:
                if exc.code != protocol.ERROR_TABLE_EXISTS:
                    raise
                # Another worker made another table at this point of the
                # table order: its barriers come in another order.
                raise GeePSError(
                    f"{self.name}: the workers reached their epoch-end "
                    f"barriers in different orders ({exc}). Every worker "
                    f"must average alike: the same validation settings "
                    f"(validation_data / validation_split, "
                    f"validation_freq) and callbacks on all, since the "
                    f"statistics are averaged before validation where it "
                    f"runs") from exc
        if (table.rows, table.width, table.per_clock) != (1, self.width,
                                                          True):
            raise GeePSError(
                f"table {self.name!r} is {table.rows} x {table.width}"
                f"{' per clock' if table.per_clock else ''}, not the "
                f"per-clock 1 x {self.width} of a mean of {self.size} values")
        return table

    def mean(self, values, key, mismatch, what="averaging"):
        """The mean over the live workers of each value, at a barrier.

        Args:
            values: this worker's `size` numbers (converted to float64).
            key: a float every worker must pass alike (what the values
                are: a hash of their names and shapes).
            mismatch: the message of the `GeePSError` raised when the
                workers' keys differ.
            what: what is averaged, the start of a timeout's message
                (e.g. "averaging the epoch logs").

        Returns:
            A float64 array of `size`: NaN where a worker sent NaN or
            workers sent both infinities, else +-inf where one sent it.

        Raises:
            GeePSError: `mismatch`, or a wrong number of values.
            GeePSTimeoutError: a worker did not reach the barrier (this
                epoch's end) in the client's timeout: `what`, then the
                client's error.
        """
        values = np.asarray(values, np.float64).reshape(-1)
        if values.size != self.size:
            raise GeePSError(f"{self.name}: {values.size} values, not "
                             f"{self.size}")
        try:
            return self._mean(values, key, mismatch)
        except GeePSTimeoutError as exc:
            raise GeePSTimeoutError(
                f"{what}: a worker did not reach this epoch's end (epoch "
                f"ends must line up across workers): {exc}") from exc

    def _mean(self, values, key, mismatch):
        table = self.table()
        client = self.client
        clock = table.clock
        row = np.zeros((1, self.width))
        row[0, 0], row[0, 1] = 1.0, key
        per_value = row[0, _HEAD:].reshape(self.size, _PER_VALUE)
        finite = np.isfinite(values)
        per_value[:, 0] = np.where(finite, values, 0.0)
        per_value[:, 1] = np.isnan(values)
        per_value[:, 2] = values == np.inf
        per_value[:, 3] = values == -np.inf
        client.update(table, row)
        client.clock([table])
        # At exactly the next clock: no worker can be past the clock this
        # one is at (each takes every barrier), so the row is this one's.
        sums = client.read(table, clock=clock + 1 + client.slack)[0]
        count = int(round(sums[0]))
        if count < 1 or sums[1] != count * key:
            raise GeePSError(mismatch)
        return self._means(sums, count)

    def _means(self, sums, count):
        """The means of a barrier's sums (its row) over `count` workers,
        non-finite values as `mean` returns them."""
        per_value = sums[_HEAD:].reshape(self.size, _PER_VALUE)
        nan, pos, neg = (np.round(per_value[:, i]) > 0 for i in (1, 2, 3))
        means = per_value[:, 0] / count
        means[pos] = np.inf
        means[neg] = -np.inf
        means[nan | (pos & neg)] = np.nan
        return means

    def last(self, key=None):
        """The means of the last barrier the workers completed, as `mean`
        returned them there, without taking part in one: what a worker
        that rejoined a job under way reads to learn where the others are.

        Reads the table at this worker's clock of it (its clock is the
        barrier it would join next): the row there holds the last
        barrier's sums alone.

        Args:
            key: the key the values there must have been sent with (what
                they mean), or None for any. Defaults to None.

        Returns:
            A float64 array of `size`, or None before the first barrier
            (or when its key is not `key`).
        """
        table = self.table()
        clock = table.clock
        if clock == 0:
            return None
        last = self.client.read(table, clock=clock + self.client.slack)[0]
        count = int(round(last[0]))
        if count < 1 or key is not None and last[1] != count * key:
            return None
        return self._means(last, count)

    def skip(self):
        """Takes part in this worker's next barrier with no values: the
        others' mean there does not count this worker, which does not wait
        for it either (it clocks the table and returns)."""
        self.client.clock([self.table()])
