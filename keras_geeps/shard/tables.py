"""The rows of a table that a shard owns, its clocks, and the buffers that
hold each clock's sum of updates."""

import logging

import numpy as np

from keras_geeps import protocol

log = logging.getLogger("keras_geeps.shard")


class Table:
    """The rows of one table that this shard owns, and its clocks."""

    def __init__(self, table_id, spec, num_workers):
        self.id = table_id
        self.spec = spec  # name, rows, width, dtype, row_start, row_end
        self.dtype = protocol.numpy_dtype(spec["dtype"])
        self.local_rows = spec["row_end"] - spec["row_start"]
        self.width = spec["width"]
        self.pool = None  # a BufferPool, given by the server
        self.data = np.zeros((self.local_rows, self.width), self.dtype)
        self.per_clock = bool(spec.get(protocol.PER_CLOCK))
        # What a per-clock table's clocks start from: zeros, one row
        # broadcast (read only, as every base is), which `Pending` knows
        # by its type and never reads.
        self.zeros = np.broadcast_to(
            np.zeros((min(1, self.local_rows), self.width), self.dtype),
            self.data.shape).view(ZeroRows)
        self.initialised = np.zeros(self.local_rows, bool)
        self.creator = None  # (worker, incarnation) sending the rows
        self.ready = self.local_rows == 0
        self.vclock = np.zeros(num_workers, np.int64)
        self.updated = np.full(num_workers, -1, np.int64)  # last clock sent
        self.global_clock = 0
        self.pending = {}  # clock >= global_clock -> Pending
        self.held = {}  # clock -> [Update] (deterministic_sums)
        # worker -> the first clock of which an update was refused for lack
        # of memory: that worker's clock of it can never be complete
        self.refused = {}
        self.subscribers = set()
        self.snapshot = None      # (clock, rows) taken for the next write
        # Whether that clock is this shard's own (a requested checkpoint,
        # a rejoin): other shards of the table may snapshot another.
        self.snapshot_own = False
        # Clocks past K's multiples to snapshot at too: where a worker
        # left, died or rejoined, whose updates no worker could replay.
        self.snapshot_at = set()
        self.lent = None          # (clock, worker, rows, SharedBuffer)
        self.ckpt_clock = -1      # clock of the durable (written) snapshot
        self.restored_clock = None  # the clock a checkpoint gave it
        self.restored = None      # rows loaded from a checkpoint (never
        # pooled: a snapshot, and a running writer, may still read them)

    @property
    def nbytes(self):
        return self.data.nbytes

    @property
    def clock_bytes(self):
        """What one more clock of updates holds: its rows buffer and its
        rows' written flags (`Pending.written`)."""
        return self.data.nbytes + self.local_rows

    def base_after(self, data):
        """The rows the clock after rows `data` starts from, before its
        updates: `data` itself, or zeros for a per-clock table (see
        `protocol.PER_CLOCK`)."""
        return self.zeros if self.per_clock else data


class ZeroRows(np.ndarray):
    """A base of zeros (`Table.zeros`): `Pending` copies the first update
    of a row instead of adding it to zeros, and fills rows with 0."""


class Pending:
    """The updates of one clock, summed as they arrive.

    For the table's current clock (`base` given) the buffer accumulates
    `base + updates` directly: when the clock completes, it *is* the fresh
    rows, with no extra pass. For later clocks (SSP), and for any clock of
    a table still waiting for its initial rows, it holds plain deltas until
    `rebase` makes it absolute. Rows never written hold garbage;
    `complete` fills them from `base`. A `ZeroRows` base is never read:
    the sums on it are the plain deltas.
    """

    def __init__(self, buffer, base=None):
        self.buffer = buffer
        self.written = np.zeros(buffer.shape[0], bool)
        self._set_base(base)

    def replace_base(self, old, new):
        """`new`, a copy of `old`, is the base from now on, if `old` was."""
        if self.base is old:
            self._set_base(new)

    def _set_base(self, base):
        self.base = base
        # What the first update of a row adds to: nothing (a copy), or base.
        self._adds_to = None if isinstance(base, ZeroRows) else base

    def add(self, start, rows):
        """Adds `rows` at row `start`."""
        end = start + rows.shape[0]
        written = self.written[start:end]
        target = self.buffer[start:end]
        if written.all():
            np.add(target, rows, out=target)
        elif not written.any():
            if self._adds_to is None:
                np.copyto(target, rows)
            else:
                np.add(self._adds_to[start:end], rows, out=target)
        else:
            self._fill(np.arange(start, end)[~written])
            np.add(target, rows, out=target)
        written[:] = True

    def add_sealed(self, start, rows, frame):
        """Adds the rows of sealed `frame` (`rows`: a view of its frame,
        as long as the rows it holds) at row `start`.

        Rows not written yet get them opened straight in (the cipher's pass
        is the write an add makes anyway, and the received frame is not
        written); others after opening the frame in place. If the frame
        does not open (`seal.SealError`), nothing changed.
        """
        end = start + rows.shape[0]
        written = self.written[start:end]
        if written.any():
            frame.open()  # in place: `rows` now holds them
            self.add(start, rows)
            return
        target = self.buffer[start:end]
        frame.open_into(target.reshape(-1).view(np.uint8))
        if self._adds_to is not None:
            np.add(target, self._adds_to[start:end], out=target)
        written[:] = True

    def add_indexed(self, index, rows):
        """Adds `rows` at row ids `index` (duplicates accumulate)."""
        self._fill(np.unique(index[~self.written[index]]))
        if index.size > 1 and np.all(index[1:] > index[:-1]):
            self.buffer[index] += rows
        else:
            np.add.at(self.buffer, index, rows)

    def _fill(self, fresh):
        self.buffer[fresh] = (0 if self._adds_to is None else
                              self._adds_to[fresh])
        self.written[fresh] = True

    def rebase(self, base):
        """Turns plain deltas into `base + deltas` (the clock became
        current)."""
        self._set_base(base)
        written, base = self.written, self._adds_to
        if base is None:
            pass
        elif written.all():
            np.add(self.buffer, base, out=self.buffer)
        elif written.any():
            self.buffer[written] += base[written]

    def complete(self):
        """Returns the full fresh rows (unwritten rows copied from base)."""
        if not self.written.all():
            self._fill(~self.written)
        return self.buffer


class Update:
    """The rows of one UPDATE, added to its clock's `Pending` at once or,
    held until its turn (`ShardSettings.deterministic_sums`), once the
    updates of the workers before its own in that clock went in.

    Args:
        worker: who sent it.
        row: the row its (first) array starts at; ignored with `index`.
        arrays: its rows (received frames, or a co-located worker's
            shared memory, which it does not write again before the clock
            ends).
        index: the row ids of an indexed update (its one array), or None.
    """

    __slots__ = ("worker", "row", "arrays", "index")

    def __init__(self, worker, row, arrays, index=None):
        self.worker, self.row, self.arrays, self.index = (worker, row,
                                                          arrays, index)

    @property
    def nbytes(self):
        """Bytes it holds."""
        return sum(a.nbytes for a in self.arrays) + (
            0 if self.index is None else self.index.nbytes)

    def add_to(self, pending):
        """Adds its rows to `pending` (a `Pending`)."""
        if self.index is not None:
            pending.add_indexed(self.index, self.arrays[0])
            return
        row = self.row
        for array in self.arrays:
            pending.add(row, array)
            row += array.shape[0]


class BufferPool:
    """Reuses row buffers once nothing reads them any more.

    Fresh 100 MB allocations cost page faults on every clock; a buffer
    handed to zero-copy sends is reusable once their trackers are done and
    no worker holds it through shared memory.

    Args:
        shape, dtype: of every buffer.
        arena: a `shm.Arena` to allocate shareable buffers from, or None.
        busy: `busy(buffer_id)` is True while a worker holds that shared
            buffer.
        keep: how many free buffers to keep. Defaults to 3.
    """

    def __init__(self, shape, dtype, arena=None, busy=None, keep=3):
        self.shape, self.dtype, self.keep = shape, dtype, keep
        self.arena = arena
        self.busy = busy or (lambda buffer_id: False)
        self.shared = {}  # id(array) -> its shm.SharedBuffer
        self.free = []  # (buffer, [trackers])
        # id(array) -> the worker a buffer was lent to: its process maps
        # it writable for as long as it lives (`drop_writer`).
        self.writers = {}

    def _reusable(self, buffer, trackers):
        shared = self.shared.get(id(buffer))
        return all(t.done for t in trackers) and (
            shared is None or not self.busy(shared.id))

    def get(self):
        for i, (buffer, trackers) in enumerate(self.free):
            if self._reusable(buffer, trackers):
                del self.free[i]
                return buffer
        nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        if self.arena is None or nbytes == 0:
            return np.empty(self.shape, self.dtype)
        try:
            shared = self.arena.allocate(nbytes)
        except OSError as exc:  # out of descriptors: this one goes by TCP
            log.warning("no shared buffer (%s); rows of this clock go "
                        "through TCP", exc)
            return np.empty(self.shape, self.dtype)
        array = shared.array.view(self.dtype).reshape(self.shape)
        self.shared[id(array)] = shared
        return array

    @property
    def nbytes(self):
        """Bytes of the free buffers kept (for reuse, or still being sent)."""
        return len(self.free) * int(np.prod(self.shape)) * self.dtype.itemsize

    def has_reusable(self):
        """Whether `get` would hand out a kept buffer (no new memory)."""
        return any(self._reusable(*entry) for entry in self.free)

    def shrink(self):
        """Drops every free buffer nothing reads any more."""
        kept = []
        for buffer, trackers in self.free:
            if self._reusable(buffer, trackers):
                self.discard(buffer)
            else:
                kept.append((buffer, trackers))
        self.free = kept

    def discard(self, buffer):
        """Drops `buffer` for good (never handed out again)."""
        self.writers.pop(id(buffer), None)
        shared = self.shared.pop(id(buffer), None)
        if shared is not None:
            shared.close()

    def lend(self, buffer, worker):
        """Notes that `worker`'s process maps `buffer` writable."""
        self.writers[id(buffer)] = worker

    def drop_writer(self, worker):
        """Forgets the buffers lent to `worker`'s process, which is gone or
        replaced yet may still write into them (a hung one): the free ones
        are dropped for good.

        Returns:
            The ids of those still in use (the table's rows, a clock's
            sums), which the caller must copy out and `discard`.
        """
        mine = {key for key, w in self.writers.items() if w == worker}
        if not mine:
            return set()
        freed = [buffer for buffer, _ in self.free if id(buffer) in mine]
        self.free = [e for e in self.free if id(e[0]) not in mine]
        for buffer in freed:
            self.discard(buffer)
        for key in mine:
            self.writers.pop(key, None)
        return mine - {id(buffer) for buffer in freed}

    def put(self, buffer, trackers=()):
        if self.arena is not None and id(buffer) not in self.shared:
            return  # e.g. the first rows: keep only shareable buffers
        self.free.append((buffer, list(trackers)))
        # Past `keep`, drop buffers nobody reads. One a worker holds (or
        # has yet to map) stays open until released: closing it could let
        # its descriptor number name another buffer.
        i = 0
        while len(self.free) > self.keep and i < len(self.free):
            if not self._reusable(*self.free[i]):
                i += 1
                continue
            dropped, _ = self.free.pop(i)
            self.discard(dropped)
