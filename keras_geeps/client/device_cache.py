"""GeePS's device-resident parameter cache: tables and update log in TF.

In GeePS each worker's cached parameters and its buffered updates live in
GPU memory, and every access is one batched kernel over a pre-built index.
`DeviceParameterCache` is that cache over a `GeePSClient`: each table is a
`[rows, width]` TensorFlow variable (on the GPU when there is one) plus an
update-log variable of the same shape. Data moves only through the custom
ops: fresh rows from the shards are written into the cache variable with
`unpack`; a read is one `gather_rows` over the access's pre-built index;
an update is one `scatter_add_rows` into the log (indexes are checked
against the table once, when built, so these ops skip their own check,
which on a GPU waits for the device); `clock()` packs the log into one
contiguous buffer with `pack` and hands it to the client to send.

`GeePSStrategy` does not need this class (a Keras model's own variables are
its cache); it serves custom code that reads and updates row subsets, e.g.
embedding tables.

Row order: an `AccessHandle` holds its rows sorted and unique (the virtual
iteration records which rows an access touches, not the caller's order).
`read(handle)` returns those rows in that order and `update(handle, delta)`
takes one delta row per handle row, in that order. To read or update in
your own order, with repeats (an embedding batch), pass `rows=`: `read`
then returns `len(rows)` rows in that order and `update` adds `delta[i]`
into row `rows[i]`, duplicate rows adding up; every row must be one the
handle recorded.

With the client's `read_my_writes`, an update goes into the cache as well
as the log, so reads return this worker's own updates at once, as the
client's do.
"""

import collections

import numpy as np
import tensorflow as tf

from keras_geeps import ops
from keras_geeps.checks import check_count
from keras_geeps.client.access import AccessHandle, row_list


class _CachedTable:
    def __init__(self, table, device):
        self.table = table
        with tf.device(device):
            self.cache = tf.Variable(tf.zeros([table.rows, table.width],
                                              table.dtype.name),
                                     trainable=False,
                                     name=f"geeps_cache_{table.id}")
            self.log = tf.Variable(tf.zeros_like(self.cache),
                                   trainable=False,
                                   name=f"geeps_log_{table.id}")
        self.layout = ops.PackLayout([self.cache])
        self.ages = None      # the shard data ages the cache holds
        self.dirty = False    # the log holds updates not yet sent
        # id(handle) -> (handle, int64 index tensor), least recently used
        # first; holding the handle keeps its id from being reused.
        self.indexes = collections.OrderedDict()


class DeviceParameterCache:
    """A worker's parameter cache and update log, kept as TF variables.

    Args:
        client: the worker's `GeePSClient`.
        device: where the variables live. Defaults to None: the first GPU if
            one is visible, else the CPU.
        max_indexes: how many handles' index tensors each table keeps (the
            least recently used are dropped). Defaults to 256.

    Example:

    ```python
    cache = DeviceParameterCache(client)
    emb = client.create_table("embedding", rows=100_000, width=64)
    with client.virtual_iteration() as vi:
        h_read = vi.read(emb, rows=batch_rows)
        h_update = vi.update(emb, rows=batch_rows)
    vectors = cache.read(h_read)                # one gather kernel, the
                                                # rows sorted and unique
    cache.update(h_update, -0.1 * grads)        # one scatter-add kernel
    batch = cache.read(h_read, rows=batch_rows)  # the caller's order
    cache.clock()                               # one pack, one send
    ```
    """

    def __init__(self, client, device=None, max_indexes=256):
        check_count("max_indexes", max_indexes, 1)
        self.client = client
        self.max_indexes = int(max_indexes)
        if device is None:
            device = ("/gpu:0" if tf.config.list_physical_devices("GPU")
                      else "/cpu:0")
        self.device = device
        self._tables = {}

    def _entry(self, table):
        entry = self._tables.get(table.id)
        if entry is None:
            entry = self._tables[table.id] = _CachedTable(table, self.device)
        return entry

    def _handle(self, what):
        return self.client.handle_for(what)

    def _index(self, entry, handle):
        cached = entry.indexes.get(id(handle))
        if cached is not None and cached[0] is handle:
            entry.indexes.move_to_end(id(handle))
            return cached[1]
        with tf.device(self.device):
            index = tf.constant(handle.rows, tf.int64)
        entry.indexes[id(handle)] = (handle, index)
        while len(entry.indexes) > self.max_indexes:
            entry.indexes.popitem(last=False)
        return index

    def _rows_index(self, handle, rows):
        """The index for `rows` (any order, repeats) of `handle`'s rows."""
        rows = row_list(handle.table, rows)
        if handle.rows is not None and rows.size:
            pos = np.searchsorted(handle.rows, rows)
            pos = np.minimum(pos, len(handle.rows) - 1)
            missing = rows[handle.rows[pos] != rows] if len(handle.rows) \
                else rows
            if missing.size:
                raise ValueError(
                    f"rows {missing[:8].tolist()} are not rows of {handle!r}:"
                    " record them in the virtual iteration's access")
        with tf.device(self.device):
            return tf.constant(rows, tf.int64)

    def refresh(self, what):
        """Waits per the slack, then moves newer shard rows into the cache."""
        handle = self._handle(what)
        entry = self._entry(handle.table)
        self.client.wait_fresh(handle)
        if entry.ages == tuple(handle.table.ages):
            return entry
        host = self.client.read(handle.table)
        entry.ages = tuple(handle.table.last_read_ages)
        ops.unpack(host.reshape(-1), [entry.cache], entry.layout)
        if entry.table.read_my_writes and entry.dirty:
            # The client's rows hold the updates it was given; the log's,
            # not given it before `clock()`, are this worker's writes too.
            entry.cache.assign_add(entry.log)
        return entry

    def read(self, what, rows=None):
        """Returns the rows of an access (a `Tensor`), fresh per the slack.

        Args:
            what: a `Table`, its name, or an `AccessHandle`.
            rows: optional row ids, any order, repeats allowed, all rows of
                the access. Defaults to None: the access's rows, sorted and
                unique (every row for a whole table).

        Returns:
            A `[len(rows), width]` tensor, rows in the order asked.
        """
        handle = self._handle(what)
        entry = self.refresh(handle)
        if rows is not None:
            return ops.gather_rows(entry.cache,
                                   self._rows_index(handle, rows),
                                   check_indices=False)
        if handle.rows is None:
            return tf.identity(entry.cache)
        return ops.gather_rows(entry.cache, self._index(entry, handle),
                               check_indices=False)

    def update(self, what, delta, rows=None):
        """Adds `delta` (rows of the access) into the table's update log.

        Args:
            what: a `Table`, its name, or an `AccessHandle`.
            delta: a tensor of shape (rows, width): one row per row of the
                access (sorted, unique), or per entry of `rows`.
            rows: optional row ids, any order, repeats allowed (they add
                up), all rows of the access. Defaults to None.

        Raises:
            ValueError: `delta` has not one row per row updated.
        """
        handle = self._handle(what)
        entry = self._entry(handle.table)
        table = handle.table
        shape = tuple(np.shape(delta))
        count = int(shape[0]) if len(shape) else 0
        if len(shape) != 2 or shape[1] != table.width:
            raise ValueError(f"update of {handle.name!r}: delta has shape "
                             f"{shape}, not (rows, {table.width})")
        with tf.device(self.device):
            delta = tf.cast(delta, entry.log.dtype)
        targets = [entry.log]
        if table.read_my_writes:  # this worker reads its writes at once
            targets.append(entry.cache)
        if rows is not None:
            index = self._rows_index(handle, rows)
            if count != int(index.shape[0]):
                raise ValueError(
                    f"update of {handle.name!r}: delta has {count} rows for "
                    f"{int(index.shape[0])} entries of rows")
        elif isinstance(handle, AccessHandle) and handle.rows is not None:
            if count != len(handle.rows):
                raise ValueError(
                    f"update of {handle.name!r}: delta has {count} rows, the "
                    f"access {len(handle.rows)} (its rows, sorted and unique, "
                    f"begin {handle.rows[:8].tolist()}): to update in your "
                    "own order, with repeats, pass rows=")
            index = self._index(entry, handle)
        elif count != table.rows:
            raise ValueError(f"update of {handle.name!r}: delta has {count} "
                             f"rows, the table {table.rows}")
        else:
            index = None
        for target in targets:
            if index is None:
                target.assign_add(delta)
            else:
                ops.scatter_add_rows(target, index, delta,
                                     check_indices=False)
        entry.dirty = True

    def clock(self):
        """Sends every table's logged updates (one pack each) and clocks
        the client: every table it holds, this cache's or not (a worker's
        clock, as in GeePS). A client a `GeePSStrategy` also uses clocks
        the strategy's tables apart from its pushes: give the cache a
        client of its own."""
        for entry in self._tables.values():
            if entry.dirty:
                buffer = ops.pack([entry.log], entry.layout)
                # `update` may raise (an error the I/O thread recorded
                # earlier, a lost shard): the log is zeroed only once the
                # client took the updates, so a retry still sends them.
                self.client.update(entry.table, buffer.numpy(), copy=False)
                entry.log.assign(tf.zeros_like(entry.log))
                entry.dirty = False
        self.client.clock()
