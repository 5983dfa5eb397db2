"""A worker's cached view of one parameter table: its rows as the shards'
pushes left them, its clocks, and what it keeps for recovery."""

import threading

import numpy as np

from keras_geeps import protocol


class PartRows:
    """The cached rows of one shard part, kept as the chunks that arrived.

    Pushed chunks are used where ZeroMQ received them (no copy into a
    cache array); a read copies them straight into its output. A sealed
    chunk that was opened straight into a read's buffer stays sealed here
    (`SealedRows`) until its rows are wanted again: then it is opened into
    that read's buffer too, or once in place.
    """

    __slots__ = ("chunks",)

    def __init__(self, chunks):
        self.chunks = chunks  # [(first row, array)], sorted, covering

    @classmethod
    def zeros(cls, rows, width, dtype):
        return cls([(0, np.zeros((rows, width), dtype))])

    def array(self, i):
        """The rows of chunk `i` (a sealed one is opened in place, once)."""
        start, rows = self.chunks[i]
        if isinstance(rows, SealedRows):
            rows = rows.opened()
            self.chunks[i] = (start, rows)
        return rows

    def copy_to(self, out, local_rows):
        """out[...] = rows `local_rows` (a slice or sorted int array)."""
        if isinstance(local_rows, slice):
            lo, hi = local_rows.start, local_rows.stop
            for i, (start, rows) in enumerate(self.chunks):
                a, b = max(lo, start), min(hi, start + rows.shape[0])
                if a >= b:
                    continue
                target = out[a - lo:b - lo]
                if isinstance(rows, SealedRows) and b - a == \
                        rows.shape[0] and target.flags.c_contiguous and \
                        target.dtype == rows.dtype:
                    rows.open_into(target)  # the copy and the cipher in one
                else:
                    target[...] = self.array(i)[a - start:b - start]
            return
        starts = np.array([start for start, _ in self.chunks])
        which = np.searchsorted(starts, local_rows, side="right") - 1
        for i, (start, _) in enumerate(self.chunks):
            mask = which == i
            if mask.any():
                out[mask] = self.array(i)[local_rows[mask] - start]

    def writable(self):
        """One writable array of all rows (made once, for read-my-writes)."""
        arrays = [self.array(i) for i in range(len(self.chunks))]
        if len(arrays) != 1 or not arrays[0].flags.writeable:
            self.chunks = [(0, np.concatenate(arrays) if len(arrays) > 1
                            else arrays[0].copy())]
        return self.chunks[0][1]


class SealedRows:
    """Rows of a sealed chunk that were opened into a read's buffer as they
    arrived (`GeePSClient._place`), kept sealed in the cache until wanted
    again.

    Args:
        frame: the chunk's `seal.SealedFrame`.
        like: an array of the rows' dtype and shape.
    """

    __slots__ = ("frame", "dtype", "shape")

    def __init__(self, frame, like):
        self.frame, self.dtype, self.shape = frame, like.dtype, like.shape

    def opened(self):
        """The rows, opened in place (once)."""
        return self.frame.open_as(self.dtype, self.shape)

    def open_into(self, out):
        """Opens the rows into `out` (C-contiguous, of their shape)."""
        self.frame.open_into(out.reshape(-1).view(np.uint8))


def no_push():
    """The assembly state of a part no push is arriving for."""
    return [-1, 0, {}, 0]


class Table:
    """A worker's view of one parameter table (rows of fixed width).

    Attributes:
        id: the table id (order of creation, the same on every worker).
        name: the table's name.
        rows, width, dtype: its shape and element type.
        parts: [(shard, row_start, row_end)], its placement on the shards.
        per_clock: whether its rows at each clock are the sums of the
            clock before's updates alone (`GeePSClient.create_table`).
        clock: this worker's current clock of the table.
    """

    def __init__(self, table_id, name, rows, width, dtype, parts,
                 read_my_writes, per_clock=False):
        self.id = table_id
        self.name = name
        self.rows = rows
        self.width = width
        self.dtype = dtype
        self.parts = parts
        self.per_clock = per_clock
        self.part_of = {(shard, start): i
                        for i, (shard, start, _) in enumerate(parts)}
        # The rows of each shard part. A push is collected chunk by chunk
        # and swapped in whole, so a read never sees half a push and its
        # data age is exact.
        self.part_rows = [PartRows.zeros(end - start, width, dtype)
                          for _, start, end in parts]
        self.ages = np.full(len(parts), -1, np.int64)
        self.last_read_age = -1     # data age of the last `read`
        self.last_read_ages = []    # ... of each part it touched
        # The push being assembled per part: [age, rows received,
        # {chunk_row: rows}, end of the furthest chunk].
        self.incoming = [no_push() for _ in parts]
        self.clock = 0
        # Shared buffers co-located shards read updates from:
        # [[shm.SharedBuffer, clock used, held by the log]].
        self.uploads = []
        self.upload_target = None   # (array, entry) given by update_target
        self.lend = None            # (clock, shard, ref): a shard's lent rows
        self.lent_target = None     # (array, shard, buffer id) given out
        self.update_buffer = None   # this clock's summed updates
        self.update_owned = False   # True: we allocated update_buffer
        self.read_my_writes = read_my_writes
        self.own = {}               # clock -> update rows (read-my-writes)
        # clock -> the update sent (None: none) for every clock a shard's
        # durable checkpoint does not cover yet, replayed if it restarts.
        self.log = {}
        self.part_ckpt = np.full(len(parts), -1, np.int64)
        # part -> the initial rows this worker created it with (the cache's
        # own array unless read-my-writes adds into that), kept until a
        # durable checkpoint holds the part: a shard that restarts before
        # then has no copy of them.
        self.init = {}
        # A creation that failed (some shard may hold it under its id):
        # the id stays this name's (a later creation of it takes it
        # again), and the table is in no list, clock or read.
        self.failed = False
        self.created_again = set()  # parts whose init went to a shard
        # restored without them (their rows are still these)
        self.lock = threading.Lock()
        self.all_rows = None        # the handle for whole-table access
        self.delivery = None        # a waiting read's _Delivery (`read`)

    def let_go(self):
        """Drops the rows and buffers a closed client no longer uses (its
        cache, shared-memory uploads, update buffers, replay log), so that
        a closed client kept as an object holds no table memory."""
        with self.lock:
            self.part_rows = []
            self.incoming = []
            self.uploads = []
            self.upload_target = self.lend = self.lent_target = None
            self.update_buffer = self.delivery = None
            self.own = {}
            self.log = {}
            self.init = {}

    @property
    def nbytes(self):
        return self.rows * self.width * self.dtype.itemsize

    @property
    def data_age(self):
        """Clocks reflected by the cached rows (-1: none arrived yet)."""
        return int(self.ages.min()) if len(self.ages) else 0

    def spec_meta(self, part):
        """The table spec a CREATE or DECLARE of `part` carries
        (`protocol.table_spec`)."""
        _, start, end = self.parts[part]
        meta = {"name": self.name, "rows": self.rows, "width": self.width,
                "dtype": self.dtype.name, "row_start": start,
                "row_end": end}
        if self.per_clock:
            meta[protocol.PER_CLOCK] = True
        return meta

    def __repr__(self):
        return (f"Table({self.id}, {self.name!r}, {self.rows}x{self.width} "
                f"{self.dtype.name}, parts={self.parts})")
