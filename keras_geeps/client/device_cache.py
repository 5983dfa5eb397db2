"""GeePS's device-resident parameter cache: tables and update log as TF variables.

In GeePS each worker's cached parameters and its buffered updates live in
GPU memory, and every access is one batched kernel over a pre-built index.
`DeviceParameterCache` is that cache over a `GeePSClient`: each table is a
`[rows, width]` TensorFlow variable (on the GPU when there is one) plus an
update-log variable of the same shape. Data moves only through the custom
ops: fresh rows from the shards are written into the cache variable with
`unpack`; a read is one `gather_rows` over the access's pre-built index;
an update is one `scatter_add_rows` into the log (duplicate rows add up);
`clock()` packs the log into one contiguous buffer with `pack` and hands it
to the client to send.

`GeePSStrategy` does not need this class (a Keras model's own variables are
its cache); it serves custom code that reads and updates row subsets, e.g.
embedding tables.
"""

import tensorflow as tf

from keras_geeps import ops
from keras_geeps.client.access import AccessHandle


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
        self.indexes = {}     # id(handle) -> int64 index tensor


class DeviceParameterCache:
    """A worker's parameter cache and update log, kept as TF variables.

    Args:
        client: the worker's `GeePSClient`.
        device: where the variables live. Defaults to None: the first GPU if
            one is visible, else the CPU.

    Example:

    ```python
    cache = DeviceParameterCache(client)
    emb = client.create_table("embedding", rows=100_000, width=64)
    with client.virtual_iteration() as vi:
        h_read = vi.read(emb, rows=batch_rows)
        h_update = vi.update(emb, rows=batch_rows)
    vectors = cache.read(h_read)                # one gather kernel
    cache.update(h_update, -0.1 * grads)        # one scatter-add kernel
    cache.clock()                               # one pack, one send
    ```
    """

    def __init__(self, client, device=None):
        self.client = client
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
        index = entry.indexes.get(id(handle))
        if index is None:
            with tf.device(self.device):
                index = tf.constant(handle.rows, tf.int64)
            entry.indexes[id(handle)] = index
        return index

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
        return entry

    def read(self, what):
        """Returns the rows of an access (a `Tensor`), fresh per the slack.

        Args:
            what: a `Table`, its name, or an `AccessHandle`.
        """
        handle = self._handle(what)
        entry = self.refresh(handle)
        if handle.rows is None:
            return tf.identity(entry.cache)
        return ops.gather_rows(entry.cache, self._index(entry, handle))

    def update(self, what, delta):
        """Adds `delta` (rows of the access) into the table's update log.

        Args:
            what: a `Table`, its name, or an `AccessHandle`.
            delta: a tensor of shape (rows accessed, width).
        """
        handle = self._handle(what)
        entry = self._entry(handle.table)
        if isinstance(handle, AccessHandle) and handle.rows is not None:
            ops.scatter_add_rows(entry.log, self._index(entry, handle), delta)
        else:
            entry.log.assign_add(tf.reshape(delta, entry.log.shape))
        entry.dirty = True

    def clock(self):
        """Sends every table's logged updates (one pack each) and clocks."""
        for entry in self._tables.values():
            if entry.dirty:
                buffer = ops.pack([entry.log], entry.layout)
                entry.log.assign(tf.zeros_like(entry.log))
                self.client.update(entry.table, buffer.numpy(), copy=False)
                entry.dirty = False
        self.client.clock()
