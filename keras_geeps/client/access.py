"""GeePS's virtual iteration: a step's accesses recorded, indexes pre-built.

Before training, the application walks through one step without doing it,
telling the client each read, update and local (private) access it will
make, in order. Each call returns an `AccessHandle`; afterwards the real
step passes the handles back, and everything that depends only on the
access (the row index list, where each shard's rows sit in the dense
buffer) was computed once, here, instead of on every step. The recorded
`AccessPlan` is also what the memory planner works from.
"""

import numpy as np

from keras_geeps.client.table import Table


class AccessHandle:
    """One recorded access, with its pre-built indexes.

    Attributes:
        position: index of the access in the recorded step.
        kind: "read", "update" or "local".
        table: the table (None for local accesses).
        rows: sorted unique int64 row ids, or None for all rows.
        nbytes: bytes of the dense buffer this access moves.
        parts: for table accesses, one (part, buffer_rows, local_rows) per
            shard part touched: positions in the dense buffer and row ids
            relative to the part's first row (slices when contiguous).
    """

    __slots__ = ("position", "kind", "table", "rows", "name", "nbytes",
                 "parts")

    def __init__(self, position, kind, table=None, rows=None, name=None,
                 nbytes=0):
        self.position = position
        self.kind = kind
        self.table = table
        self.name = name if name is not None else getattr(table, "name", "")
        self.rows = rows
        self.nbytes = nbytes
        self.parts = build_part_index(table, rows) if table is not None else []

    def __repr__(self):
        count = "all" if self.rows is None else len(self.rows)
        return (f"AccessHandle(#{self.position} {self.kind} {self.name!r}, "
                f"rows={count}, {self.nbytes} bytes)")


def build_part_index(table, rows):
    """Maps an access's rows onto the table's shard parts, once.

    Args:
        table: a client `Table` (has `parts` = [(shard, start, end), ...]).
        rows: sorted unique row ids, or None for every row.

    Returns:
        [(part_index, buffer_rows, local_rows)], where buffer_rows selects
        rows of the access's dense buffer and local_rows the same rows
        relative to the part's first row; both are slices when contiguous,
        int64 arrays otherwise.
    """
    index = []
    for part, (_, start, end) in enumerate(table.parts):
        if rows is None:
            if end > start:
                index.append((part, slice(start, end), slice(0, end - start)))
            continue
        lo, hi = np.searchsorted(rows, [start, end])
        if hi == lo:
            continue
        local = rows[lo:hi] - start
        if local[-1] - local[0] == hi - lo - 1:  # contiguous run
            index.append((part, slice(int(lo), int(hi)),
                          slice(int(local[0]), int(local[-1]) + 1)))
        else:
            index.append((part, slice(int(lo), int(hi)), local))
    return index


def row_ids(table, rows):
    """`rows` of `table` as sorted unique int64 row ids.

    Args:
        table: the `Table`.
        rows: a 1-D sequence of integer row ids, or a boolean mask with
            one entry per row of the table (as numpy indexes by one).

    Raises:
        TypeError: ids that are not integers (a float would be cut short
            to another row).
        ValueError: ids that are not 1-D, a mask of another length, or
            an id outside the table.
    """
    return np.unique(row_list(table, rows))


def row_list(table, rows):
    """`rows` of `table` as int64 row ids in the order given, repeats
    kept (`row_ids` checks and refusals).

    Args:
        table: the `Table`.
        rows: a 1-D sequence of integer row ids, or a boolean mask with
            one entry per row of the table.
    """
    array = np.asarray(rows)
    if array.dtype == np.bool_:
        if array.shape != (table.rows,):
            raise ValueError(f"a mask of table {table.name!r}'s rows has "
                             f"one entry per row ({table.rows}), got shape "
                             f"{array.shape}")
        return np.flatnonzero(array).astype(np.int64)
    if array.ndim != 1:
        raise ValueError(f"rows of table {table.name!r} are a 1-D list of "
                         f"row ids, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"rows of table {table.name!r} are integer ids, got "
                        f"{array.dtype} {array[:3].tolist()}")
    if array.size and (array.min() < 0 or array.max() >= table.rows):
        bad = array.min() if array.min() < 0 else array.max()
        raise ValueError(f"row {bad} is outside table {table.name!r} of "
                         f"{table.rows} rows")
    return array.astype(np.int64).reshape(-1)


class AccessPlan:
    """The ordered accesses of one step, as recorded by a virtual iteration.

    Example:

    >>> plan = AccessPlan()
    >>> len(plan)
    0
    """

    def __init__(self):
        self.handles = []

    def __len__(self):
        return len(self.handles)

    def __iter__(self):
        return iter(self.handles)

    def add(self, kind, table=None, rows=None, name=None, nbytes=None):
        """Records one access and returns its handle."""
        if rows is not None:
            rows = row_ids(table, rows)
        if nbytes is None:
            count = table.rows if rows is None else len(rows)
            nbytes = count * table.width * table.dtype.itemsize
        handle = AccessHandle(len(self.handles), kind, table, rows, name,
                              nbytes)
        self.handles.append(handle)
        return handle

    def table_rows(self):
        """Returns a printable table of the recorded accesses."""
        lines = [f"{'#':>4}  {'kind':<7} {'name':<32} {'bytes':>14}"]
        for h in self.handles:
            lines.append(f"{h.position:>4}  {h.kind:<7} {h.name[:32]:<32} "
                         f"{h.nbytes:>14,}")
        return "\n".join(lines)


class VirtualIteration:
    """Context manager that records a step's accesses into an `AccessPlan`.

    Args:
        plan: the `AccessPlan` to fill.
        lookup: gives the `Table` of a name (`GeePSClient.table`), so that
            accesses can name their table. Defaults to None (tables only).
    """

    def __init__(self, plan, lookup=None):
        self.plan = plan
        self._lookup = lookup

    def _table(self, table):
        if isinstance(table, str) and self._lookup is not None:
            return self._lookup(table)
        if not isinstance(table, Table):
            raise TypeError(f"expected a Table or a table name, got "
                            f"{type(table).__name__}")
        return table

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self, table, rows=None):
        """Records a read of `rows` (default: all) of `table` (or its name).

        The read gives the rows in ascending order of id, each once
        (`row_ids`: ids, or a boolean mask of the table's rows).
        """
        return self.plan.add("read", self._table(table), rows)

    def update(self, table, rows=None):
        """Records an update of `rows` (default: all) of `table` (or its
        name): its delta has one row per id, in ascending order, each
        once (`row_ids`)."""
        return self.plan.add("update", self._table(table), rows)

    def local(self, name, nbytes):
        """Records an access to private data (activations, optimizer state)."""
        return self.plan.add("local", name=name, nbytes=int(nbytes))
