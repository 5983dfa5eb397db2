"""The mean of one vector per worker, taken at a barrier through a shard table.

`model.fit` under a GeePS strategy averages a few things over the workers
at every epoch end: the epoch's logs (`keras/epoch_logs.py`) and the
non-trainable statistics, such as BatchNorm's moving mean and variance
(`keras/non_trainable.py`). Both go through a `WorkerMean`: every worker
adds its numbers to one float64 row of a two-row table, clocks it and reads
it at exactly that clock (a barrier); the row's change over the clock is
the sum over the workers that took part (a dead worker, under
`on_worker_failure="continue"`, no longer counts).

A row holds a count and a key (a hash saying what the numbers mean: workers
whose keys differ get a clear error instead of a mean of unlike values),
then per value its finite part and how many workers sent NaN, +inf and
-inf. Non-finite values never enter the table, so one NaN cannot poison
later barriers, and while row c % 2 takes the numbers of barrier c, worker
0 subtracts the other row's contents from it (x - x is exactly 0): every
barrier starts from a zero row, so a huge value at one costs the next ones
no precision. (Without a live worker 0 the change is still exact in its
counts, and its values lose only what float64 loses next to the
leftovers.) A mean of equal values is that value exactly (the float64 sum
of up to 2**29 equal float32 values is exact).
"""

import numpy as np

from keras_geeps.errors import GeePSError, GeePSTimeoutError

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
            return self.client.create_table(self.name, 2, self.width,
                                            dtype="float64")
        if (table.rows, table.width) != (2, self.width):
            raise GeePSError(
                f"table {self.name!r} is {table.rows} x {table.width}, not "
                f"the 2 x {self.width} of a mean of {self.size} values")
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
        clock, slack = table.clock, client.slack
        write = clock % 2
        # At exactly this clock and the next: no worker can be past the
        # clock this one is at, so the rows are those of the clock.
        rows_before = client.read(table, clock=clock + slack)
        before = rows_before[write]
        rows = np.zeros((2, self.width))
        rows[write, 0], rows[write, 1] = 1.0, key
        per_value = rows[write, _HEAD:].reshape(self.size, _PER_VALUE)
        finite = np.isfinite(values)
        per_value[:, 0] = np.where(finite, values, 0.0)
        per_value[:, 1] = np.isnan(values)
        per_value[:, 2] = values == np.inf
        per_value[:, 3] = values == -np.inf
        if client.worker_id == 0:  # the next barrier's row: to zero
            rows[1 - write] = -rows_before[1 - write]
        client.update(table, rows)
        client.clock([table])
        after = client.read(table, clock=clock + 1 + slack)[write]
        change = after - before
        count = int(round(change[0]))
        if count < 1 or change[1] != count * key:
            raise GeePSError(mismatch)
        return self._means(change, count)

    def _means(self, change, count):
        """The means of a barrier's sums (`change`: a row's worth) over
        `count` workers, non-finite values as `mean` returns them."""
        per_value = change[_HEAD:].reshape(self.size, _PER_VALUE)
        nan, pos, neg = (np.round(per_value[:, i]) > 0 for i in (1, 2, 3))
        means = per_value[:, 0] / count
        means[pos] = np.inf
        means[neg] = -np.inf
        means[nan | (pos & neg)] = np.nan
        return means

    def last(self):
        """The means of the last barrier the workers completed, as `mean`
        returned them there, without taking part in one: what a worker
        that rejoined a job under way reads to learn where the others are.

        Reads the table at this worker's clock of it (its clock is the
        barrier it would join next), so the row of the last barrier is
        still whole: worker 0 zeroes it only at that next barrier.

        Returns:
            A float64 array of `size`, or None before the first barrier.
        """
        table = self.table()
        clock = table.clock
        if clock == 0:
            return None
        rows = self.client.read(table, clock=clock + self.client.slack)
        last = rows[(clock - 1) % 2]
        count = int(round(last[0]))
        return self._means(last, count) if count >= 1 else None

    def skip(self):
        """Takes part in this worker's next barrier with no values: the
        others' mean there does not count this worker, which does not wait
        for it either (it clocks the table and returns). Worker 0 still
        zeroes the next barrier's row, as in `mean`."""
        table = self.table()
        client = self.client
        if client.worker_id == 0:
            write = table.clock % 2
            rows_before = client.read(table, clock=table.clock + client.slack)
            rows = np.zeros((2, self.width))
            rows[1 - write] = -rows_before[1 - write]
            client.update(table, rows)
        client.clock([table])
