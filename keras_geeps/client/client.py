"""The GeePS worker client: tables, reads with slack, buffered updates, clocks.

One `GeePSClient` per worker process. It keeps a cached copy of every table
(filled by the shards' pushes), buffers this worker's additive updates for
the current clock, and on `clock()` sends them and the clock to the shards.
A background I/O thread owns the sockets; the calling thread blocks only in
`read` (until the cache is as fresh as the slack requires) and in table
creation, and every such wait is bounded by `timeout`.

Consistency: a read at clock c with slack s returns data that reflects
every worker's updates of all clocks up to c - s - 1. Slack 0 is BSP; a
large slack approximates asynchronous training.
"""

import atexit
import collections
import collections.abc
import functools
import itertools
import logging
import numbers
import os
import threading
import time
import weakref

import numpy as np

from keras_geeps import protocol, seal, shm
from keras_geeps.auth import ClientKeys
from keras_geeps.checks import check_count, check_index, check_seconds
from keras_geeps.client.access import (AccessHandle, AccessPlan,
                                       VirtualIteration)
from keras_geeps.client.connection import CLOSED, Future, IOThread
from keras_geeps.client.recovery import ShardRecovery
from keras_geeps.client.table import PartRows, SealedRows, Table, no_push
from keras_geeps.cluster import ClusterSpec, RowPartitioner
from keras_geeps.errors import (GeePSError, GeePSServerError,
                                GeePSTimeoutError, GeePSWorkerFailedError)
from keras_geeps.protocol import Message, MsgType, ProtocolError

log = logging.getLogger("keras_geeps.client")

# How long `close` waits for the shards to take its LEAVE (at most the
# client's timeout).
LEAVE_WAIT_S = 5.0
AT_EXIT_LEAVE_WAIT_S = 1.0  # (at the interpreter's exit: shards may be gone)
# A worker heartbeats at least this many times per a shard's worker_timeout.
HEARTBEATS_PER_TIMEOUT = 3
# How often a clock held back by a full replay log asks the shards how far
# their checkpoints are.
CHECKPOINT_POLL_S = 0.2


def _same_memory(a, b):
    """True when arrays `a` and `b` are the very same memory (the buffer a
    caller filled is the one this client handed out)."""
    return a.ctypes.data == b.ctypes.data and a.nbytes == b.nbytes


class _Delivery:
    """A read waiting for pushes of whole parts: each part's next push goes
    into the read's buffer as its chunks arrive, opened there when sealed
    (one pass instead of opening in place and copying after), copied there
    when not (while the rest is on the wire instead of after it).

    Args:
        regions: {part: the read buffer's rows for that part}.
    """

    __slots__ = ("regions", "filling", "done")

    def __init__(self, regions):
        self.regions = regions
        self.filling = {}  # part -> [age, rows placed] of the arriving push
        self.done = {}     # part -> age of the push its region holds whole


def _close_at_exit(client):
    """An exit hook that closes `client` if it is still alive and open: a
    script that ends without `close()` still says LEAVE (its shards must
    not take the end for a death)."""
    ref, pid = weakref.ref(client), os.getpid()

    def close():
        alive = ref()
        # (not in a forked child: the client's threads and sockets are the
        # parent's)
        if alive is not None and not alive._closed and os.getpid() == pid:
            alive._close(AT_EXIT_LEAVE_WAIT_S)
    return close


def _as_table_dtype(values, dtype, what):
    """`values` as a `dtype` array, refusing a conversion that would change
    them: to another kind (floats truncated to ints, NaN to an int) or out
    of an integer dtype's range (signed into unsigned: no negative). Float
    to a narrower float (float64 gradients into a float32 table) rounds,
    as any float update does.

    Raises:
        ValueError: naming `what`, the values' dtype and the table's.
    """
    values = np.asarray(values)
    if values.dtype == dtype:
        return values
    integers = dtype.kind in "iu" and values.dtype.kind in "iub"
    if not integers and not np.can_cast(values.dtype, dtype, "same_kind"):
        raise ValueError(
            f"{what} cannot be {dtype}: it holds {values.dtype} values, "
            f"which converting would change (truncate) or fail on; give "
            f"it {dtype} values")
    if integers and values.size and values.dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            raise ValueError(
                f"{what} cannot be {dtype}: it holds values in [{low}, "
                f"{high}], beyond [{info.min}, {info.max}]")
    return values.astype(dtype, copy=False)


class GeePSClient:
    """A worker's connection to the keras_geeps shards.

    Args:
        cluster: a `ClusterSpec`; defaults to `ClusterSpec.from_env()`
            (keras_geeps' launcher variables, else `TF_CONFIG`).
        slack: staleness bound; 0 = BSP (default), s > 0 = SSP.
        timeout: seconds any wait may take before `GeePSTimeoutError`
            (> 0). Defaults to 120.
        read_my_writes: if True, a worker's reads include its own updates at
            once, replayed on top of the shards' data. Defaults to False.
        initializer: the worker whose initial values create tables.
            Defaults to 0.
        chunk_bytes: size of the row chunks sent. Defaults to 2 MiB.
        heartbeat_interval: seconds between heartbeats to every shard (so
            shards detect a dead worker, and this worker a restarted
            shard); 0 sends none. Lowered to a third of a shard's
            `--worker-timeout` where that is shorter. Defaults to 1.
        curve: a `keras_geeps.auth.ClientKeys` for shards that require
            CURVE. Defaults to None.
        shared_memory: exchange rows with shards on this host through
            shared memory (`keras_geeps.shm`) when the handshake succeeds.
            Defaults to True unless `KERAS_GEEPS_SHM=0`.
        max_log_clocks: with shard checkpoints (`--checkpoint-every K`),
            a worker keeps every update the checkpoints do not cover yet,
            to replay to a restarted shard; a `clock()` that finds this
            many clocks kept waits (up to `timeout`, then
            `GeePSTimeoutError`) for the shards to write one, so a slow or
            failing disk slows the worker rather than filling its memory,
            and a restarted shard never gets a replay longer than it takes
            (max_pending_clocks + 1 clocks). Defaults to min(4 K + slack,
            max_pending_clocks + 1).

    Example:

    ```python
    client = GeePSClient(ClusterSpec(["tcp://127.0.0.1:5555"]))
    table = client.create_table("w", rows=4, width=8, init=np.ones((4, 8)))
    client.update(table, np.full((4, 8), 0.5, np.float32))
    client.clock()
    print(client.read(table))   # 1 + 0.5 x workers, once all clocked
    client.close()
    ```
    """

    def __init__(self, cluster=None, slack=0, timeout=120.0,
                 read_my_writes=False, initializer=0,
                 chunk_bytes=protocol.DEFAULT_CHUNK_BYTES,
                 heartbeat_interval=1.0, curve=None, shared_memory=None,
                 max_log_clocks=None):
        self.cluster = cluster or ClusterSpec.from_env()
        if not isinstance(self.cluster, ClusterSpec):
            raise TypeError(f"cluster must be a ClusterSpec (or None: from "
                            f"the launcher's variables or TF_CONFIG), got "
                            f"{type(cluster).__name__}")
        check_count("slack", slack, 0)
        self.slack = int(slack)
        check_seconds("timeout", timeout)  # (every wait is bounded)
        self.timeout = float(timeout)
        check_index("initializer", initializer, self.cluster.num_workers)
        check_count("chunk_bytes", chunk_bytes, 1)
        check_seconds("heartbeat_interval", heartbeat_interval,
                      zero_means="none sent")
        if max_log_clocks is not None:
            check_count("max_log_clocks", max_log_clocks, 1)
        if curve is not None and not isinstance(curve, ClientKeys):
            raise TypeError(f"curve must be a keras_geeps.auth.ClientKeys "
                            f"(ClientKeys(secret_key_file, server_key_file"
                            f")), got {type(curve).__name__}")
        if curve is not None and len(curve.server_keys) not in (
                1, self.cluster.num_shards):
            raise ValueError(f"curve holds {len(curve.server_keys)} shard "
                             f"keys for {self.cluster.num_shards} shards: "
                             f"give one for all, or one per shard")
        self.read_my_writes = read_my_writes
        self.initializer = initializer
        self.chunk_bytes = chunk_bytes
        self.worker_id = self.cluster.worker_id
        self.num_workers = self.cluster.num_workers
        self._tables = []  # by id; a failed creation's stays (`failed`)
        self._by_name = {}
        self._partitioner = RowPartitioner(self.cluster.num_shards)
        self._cond = threading.Condition()
        self._seq_lock = threading.Lock()
        self._seqs = [itertools.count(1) for _ in self.cluster.shards]
        self.wait_seconds = 0.0
        self.bytes_delivered = 0  # rows put into waiting reads' buffers
        self.reconnects = 0  # broken connections to a live shard, resumed
        # The clock (> 0) this worker rejoined a job under way at (a new
        # process of a worker its shards knew: one the others went on
        # without under `on_worker_failure="continue"`, or one restarted
        # between clocks), else None: set from the shards' first welcomes.
        self.rejoined_at = None
        self.access_plan = AccessPlan()
        self._clock_lock = threading.Lock()  # clock() vs a recovery replay
        self._curve = curve
        self._closed = False
        self._lost = {}  # shard -> why its tables are gone (restarted)
        self._shard_incarnations = {}  # shard -> its process's number
        self._watching = set()  # shards that declare silent workers dead
        self._recovery = ShardRecovery(self)  # of shards that restarted
        self._job_failed = None  # the first unasked worker_dead error
        self._shm_peers = {}   # shard -> (shm.PeerBuffers, its arena token)
        self._shm_upload = set()  # shards that map our update buffers
        self._releases = collections.deque()  # (shard, token, buffer id)
        self.shm_bytes_in = 0
        self.shm_bytes_out = 0
        self._arena = self._io = None
        self._keep_log = False  # set from the shards' welcomes
        self._max_log_clocks = max_log_clocks
        self._at_exit = None
        try:
            self._connect(shared_memory, heartbeat_interval)
        except BaseException:
            self.close()  # the arena's descriptors, the I/O thread
            raise
        self._at_exit = _close_at_exit(self)
        atexit.register(self._at_exit)

    def _connect(self, shared_memory, heartbeat_interval):
        """Opens the arena and the connections, and greets every shard."""
        if self._curve is not None:
            seal.require()  # keyed shards seal everything after the HELLO
        if shared_memory is None:
            shared_memory = shm.enabled_by_env() and shm.supported()
        self._arena = shm.Arena() if shared_memory else None
        # Heartbeats start with each shard's WELCOME: a shard that waits
        # for another to answer (one still loading its checkpoint) must not
        # count this worker dead meanwhile.
        self._io = IOThread(self.cluster.shards, self._on_rows,
                            on_error=self._on_error_code,
                            on_broken=self._on_link_broken,
                            worker_id=self.worker_id, curve=self._curve,
                            name=f"geeps-io-w{self.worker_id}",
                            on_turn=self._on_io_turn,
                            on_close=self._flush_releases,
                            on_welcome=self._watched_by,
                            heartbeat_interval=heartbeat_interval)
        self._incarnation = int.from_bytes(os.urandom(6), "little")
        welcomes = self._request_all([
            (shard, self._hello_message())
            for shard in range(self.cluster.num_shards)], "HELLO")
        for shard, welcome in enumerate(welcomes):
            wrong = self._wrong_shard(shard, welcome)
            if wrong:
                raise GeePSError(wrong)
            self._on_welcome(shard, welcome)
        rejoined_at = max(w.meta.get("rejoined_at", 0) for w in welcomes)
        if rejoined_at > 0:  # (at 0 nothing was under way)
            self.rejoined_at = rejoined_at
            log.warning("worker %d rejoined a job under way at clock %d",
                        self.worker_id, self.rejoined_at)
        # Keep sent updates for replay only when shards write checkpoints,
        # all at the same clocks: a job's checkpoint is consistent only so,
        # and a shard without them would keep the log from being trimmed.
        every = [w.meta.get("checkpoint_every", 0) for w in welcomes]
        if len(set(every)) > 1:
            raise GeePSError(
                f"the shards checkpoint at different intervals "
                f"(--checkpoint-every {every}, shard by shard): start them "
                f"all with the same one")
        self._keep_log = every[0] > 0
        # A worker may run at most max_pending_clocks ahead of the global
        # clock (the shards bound their per-clock buffers): a larger slack
        # ("async") is capped there.
        bound = min(w.meta.get("max_pending_clocks", 1 << 30)
                    for w in welcomes)
        if self.slack > bound:
            log.warning("slack %d capped to %d by the shards' "
                        "max_pending_clocks", self.slack, bound)
            self.slack = bound
        if self._keep_log:
            # The log holds at least the clocks between two checkpoints,
            # and at most as many as a restarted shard takes in a replay
            # (max_pending_clocks past its restored clock).
            most = bound + 1
            if self._max_log_clocks is None:
                self._max_log_clocks = min(4 * every[0] + self.slack, most)
            elif not every[0] <= self._max_log_clocks <= most:
                raise ValueError(
                    f"max_log_clocks={self._max_log_clocks} must be in "
                    f"[{every[0]}, {most}]: at least the clocks between two "
                    f"checkpoints (--checkpoint-every {every[0]}), at most "
                    f"a replay a restarted shard takes (max_pending_clocks "
                    f"+ 1)")
        # A shard drops the connection of a peer whose frame exceeds its
        # max_message_bytes: row chunks stay within the smallest limit.
        self.max_frame_bytes = min(
            w.meta.get("max_message_bytes", protocol.MAX_MESSAGE_BYTES)
            for w in welcomes)
        self.chunk_bytes = min(self.chunk_bytes, self.max_frame_bytes)

    # --------------------------------------------------------- plumbing
    def _next_seq(self, shard):
        with self._seq_lock:
            return next(self._seqs[shard])

    def _send(self, shard, message, future=None):
        if self._closed:
            raise self._closed_error()
        self._queue(shard, message, future)

    def _queue(self, shard, message, future=None):
        """Numbers `message` and hands it to the I/O thread (which may
        still send while it closes)."""
        message.worker = self.worker_id
        message.seq = self._next_seq(shard)
        self._io.send(shard, message, future)

    def _hello_message(self):
        meta = {"num_workers": self.num_workers,
                "num_shards": self.cluster.num_shards,
                "incarnation": self._incarnation}
        if self._arena is not None:
            meta["shm"] = self._arena.describe()
        return Message(MsgType.HELLO, meta=meta)

    def _wrong_shard(self, shard, welcome):
        """Why the shard that answered at `shard`'s address is not shard
        `shard` (a list in another order than the other workers', one
        shard named twice, e.g. as 127.0.0.1 and localhost), or None."""
        answered = welcome.meta.get("shard_id")
        if answered == shard:
            return None
        return (f"the shard at {self.cluster.shards[shard]}, the cluster's "
                f"shard {shard}, says it is shard {answered}: every worker "
                f"must list the shards in the order of their shard ids "
                f"(each once)")

    # ---------------------------------------------------- shared memory
    def _on_welcome(self, shard, welcome):
        """Notes which process `shard` is, and uses shared memory with it if
        both sides can map the other's."""
        self._shard_incarnations[shard] = welcome.meta.get("incarnation")
        self._shm_peers.pop(shard, None)
        self._shm_upload.discard(shard)
        meta = welcome.meta
        if self._arena is None or not meta.get("shm_ok"):
            address = self.cluster.shards[shard]
            if self._arena is not None and meta.get("shm_ok") is False and (
                    "//127." in address or "//localhost:" in address):
                log.warning("worker %d: shard %d (%s) is on this host but "
                            "cannot map this worker's buffers; rows go "
                            "through TCP", self.worker_id, shard, address)
            return
        peer = shm.PeerBuffers.connect(meta.get("shm"), role="shard")
        if peer is not None:
            self._shm_peers[shard] = (peer, peer.token.hex())
            self._shm_upload.add(shard)
            log.info("worker %d: shard %d shares memory with this worker",
                     self.worker_id, shard)
        else:  # it maps ours, we cannot map its: say so
            log.warning("worker %d: shard %d (%s) is on this host but its "
                        "buffers cannot be mapped; rows go through TCP",
                        self.worker_id, shard, self.cluster.shards[shard])

    def _shm_meta(self, shard, meta):
        if shard in self._shm_peers:
            meta["shm"] = True
        return meta

    def _shared_rows(self, shard, message, table):
        """The rows a co-located shard's PUSH/ROWS reference (held until
        no view of them is left, then released)."""
        peer, token = self._shm_peers.get(shard, (None, None))
        if peer is None:
            raise ValueError("it shares no memory with this worker")
        ref = message.meta["ref"]
        rows = peer.rows(ref, table.dtype, table.width, functools.partial(
            self._releases.append, (shard, token, ref[0])))
        self.shm_bytes_in += rows.nbytes
        return rows

    def _on_io_turn(self):
        self._flush_releases()
        self._recovery.retry_unanswered()

    def _flush_releases(self):
        """Tells shards which of their buffers this worker let go of."""
        if not self._releases:
            return
        batches = {}
        while self._releases:
            shard, token, buffer_id = self._releases.popleft()
            batches.setdefault((shard, token), []).append(buffer_id)
        for (shard, token), buffers in batches.items():
            message = Message(MsgType.RELEASE, meta={
                "arena": token, "buffers": buffers})
            if self._recovery.welcomed(shard):
                # Not held behind the recovery: a replay's pushes pile up
                # on the shard, counted as its memory, until released.
                message.worker = self.worker_id
                message.seq = self._next_seq(shard)
                self._io.send_now(shard, message)
            else:
                # _queue: the I/O thread's last turn, on close, sends them
                # too.
                self._queue(shard, message)

    def _upload_entry(self, table, clock):
        """A shared buffer for one clock's update of a whole table: one
        whose last update every shard has applied (pushes of a later age
        came) and the replay log no longer holds, or a new one; None past a
        bound (the update then goes by TCP)."""
        applied = int(table.ages.min())
        for entry in table.uploads:
            if entry[1] < applied and not (entry[2] and entry[1] in
                                           table.log):
                entry[1], entry[2] = clock, False
                return entry
        if len(table.uploads) >= min(self.slack, 2) + 3:
            return None
        try:
            entry = [self._arena.allocate(table.nbytes), clock, False]
        except OSError as exc:  # out of descriptors: this update by TCP
            log.warning("worker %d: no shared upload buffer for table %r "
                        "(%s); its update goes through TCP", self.worker_id,
                        table.name, exc)
            return None
        table.uploads.append(entry)
        return entry

    def update_target(self, what):
        """A buffer to write this clock's whole-table update into, or None.

        When a shard of the table shares memory with this worker, the
        returned (rows, width) array lies in memory that shard reads: pass
        it to `update(..., copy=False)` after filling it and the update
        travels without a copy. None when no shard shares memory (or every
        shared buffer is still in use): build the update elsewhere.

        Args:
            what: a `Table` or its name.

        Returns:
            A writable, 64-byte aligned (rows, width) array, or None.
        """
        table = self.handle_for(what).table
        if self._arena is None or table.update_buffer is not None or \
                not any(s in self._shm_upload for s, _, _ in table.parts):
            return None
        with table.lock:
            entry = self._upload_entry(table, table.clock)
        if entry is None:
            return None
        array = entry[0].array[:table.nbytes].view(table.dtype).reshape(
            table.rows, table.width)
        table.upload_target = (array, entry)
        return array

    def lend_target(self, what):
        """The shard's own buffer for this clock's new rows, or None.

        A shard lends it when this worker is the table's only writer and
        shares memory with it (`ShardSettings.lend_buffers`). Write the
        table's *new rows* there: the rows `read_shared` returned for this
        clock plus the update. Then pass the array to
        `update(..., copy=False)`: the shard adopts the buffer as the rows
        of the next clock, with no add of its own.

        Args:
            what: a `Table` or its name.

        Returns:
            A writable, 64-byte aligned (rows, width) array, or None (no
            lend for this clock: send an update as usual).
        """
        table = self.handle_for(what).table
        lend = table.lend
        if lend is None or self._keep_log or table.read_my_writes or \
                table.update_buffer is not None or len(table.parts) != 1 \
                or not lend[0] == table.clock == int(table.ages[0]):
            return None
        _, shard, ref = lend
        peer = self._shm_peers.get(shard, (None, None))[0]
        if peer is None:
            return None
        try:
            array = peer.rows(ref, table.dtype, table.width, writable=True)
        except ValueError as exc:
            log.warning("worker %d: cannot write the buffer shard %d lent "
                        "for table %r (%s); updating as usual",
                        self.worker_id, shard, table.name, exc)
            table.lend = None
            return None
        if array.shape[0] != table.rows or array.ctypes.data % 64:
            table.lend = None
            return None
        table.lent_target = (array, shard, ref[0])
        return array

    def _request_all(self, requests, what, timeout=None):
        """Sends [(shard, message)] and waits for every reply, `timeout`
        seconds at most (None: the client's).

        An error the I/O thread queues meanwhile (a restarted shard, a dead
        worker) is raised at once, not after the timeout.
        """
        futures = []
        try:
            for shard, message in requests:
                future = Future()
                self._send(shard, message, future)
                futures.append(future)
            limit = self.timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            for future in futures:
                self._await_reply(future, deadline, what, limit)
            return [future.message for future in futures]
        finally:  # unanswered ones are waited for no more
            self._io.forget(futures)

    def _await_reply(self, future, deadline, what, limit):
        while not future.event.wait(
                min(0.1, max(0.0, deadline - time.monotonic()))):
            if self._closed:
                raise self._closed_error()
            if self._io.errors:
                raise self._io.errors.popleft()
            for failed in (self._job_failed, self._io.failed):
                if failed is not None:  # no reply can come any more
                    raise failed.with_traceback(None)
            if future.shard in self._lost:  # (its error went to another)
                raise GeePSError(self._lost[future.shard])
            if time.monotonic() >= deadline:
                shard = future.shard
                if shard in self._io.held:  # (sent once it is done)
                    raise GeePSTimeoutError(
                        f"worker {self.worker_id}: {what} waited "
                        f"{limit:.1f} s: {self._recovery_pending(shard)}")
                hint = (" (if it requires CURVE keys: are this worker's keys"
                        " allowed? if it requires none, this worker must "
                        "use none either)" if self._curve is not None else
                        " (or does it require CURVE keys?)")
                raise GeePSTimeoutError(
                    f"worker {self.worker_id}: shard {shard} "
                    f"({self.cluster.shards[shard]}) did not answer {what} "
                    f"within {limit:.1f} s: is it running?{hint}")
        if self._closed:
            raise self._closed_error()
        if future.error is not None:
            raise future.error

    def _raise_async_errors(self):
        """Raises what went wrong since: the client was closed, an error
        the I/O thread queued, and for good: the job stopped (or this
        worker was declared dead), the I/O thread failed, or a shard's
        tables are lost."""
        if self._closed:
            raise self._closed_error()
        if self._io.errors:
            raise self._io.errors.popleft()
        for failed in (self._job_failed, self._io.failed):
            if failed is not None:  # (each raise starts a new traceback)
                raise failed.with_traceback(None)
        lost = list(self._lost.values())  # the I/O thread adds to it
        if lost:
            raise GeePSError(lost[0])

    def _closed_error(self):
        return GeePSError(f"worker {self.worker_id}: {CLOSED}")

    # ----------------------------------------------------------- tables
    def create_table(self, name, rows, width, dtype="float32", init=None,
                     per_clock=False):
        """Creates (worker 0) or declares (other workers) a table.

        Every worker must create the same tables in the same order: that is
        how they agree on table ids and on the rows each shard holds (the
        shards check it). The initializer's `init` gives the initial rows;
        on the other workers the call returns once those have arrived.

        Args:
            name: the table's name (unique).
            rows: number of rows.
            width: elements per row.
            dtype: element type. Defaults to "float32".
            init: initial values, shape (rows, width) or any shape with
                rows * width elements; zeros when None. Used on the
                initializer only.
            per_clock: if True, the rows at each clock c > 0 are the sums
                of the updates of clock c - 1 alone (zeros where none
                came), not of every clock's so far: what every worker
                added at a barrier, with no zeroing to leave to anyone (a
                worker that dies cannot leave stale sums behind). Such a
                table ignores `read_my_writes`. Defaults to False.

        Returns:
            The `Table`.

        Example:

        ```python
        table = client.create_table("counts", 1, 3, dtype="float64",
                                    per_clock=True)
        client.update(table, np.ones((1, 3)))
        client.clock([table])
        client.read(table, clock=1 + client.slack)  # [[W, W, W]]: W workers
        ```
        """
        self._raise_async_errors()
        if not isinstance(name, str):
            raise TypeError(f"a table's name is a str, got {name!r} "
                            f"({type(name).__name__})")
        if not name:
            raise ValueError("a table's name must not be empty")
        if name in self._by_name:
            raise ValueError(f"table {name!r} exists already")
        check_count(f"table {name!r}: rows", rows, 0)
        check_count(f"table {name!r}: width", width, 1)
        rows, width = int(rows), int(width)  # (numpy integers too)
        dtype = protocol.numpy_dtype(protocol.dtype_name(dtype))
        if width * dtype.itemsize > self.max_frame_bytes:
            raise ValueError(f"table {name!r}: one row of "
                             f"{width * dtype.itemsize} bytes exceeds the "
                             f"shards' max_message_bytes "
                             f"({self.max_frame_bytes}); use narrower rows")
        # Counted once created: a creation that fails moves no later table.
        parts = self._partitioner.plan(rows, width * dtype.itemsize)
        reserved = self._reserved_id(name)
        table = Table(len(self._tables) if reserved is None else reserved,
                      name, rows, width, dtype, parts,
                      self.read_my_writes and not per_clock, bool(per_clock))
        creator = self.worker_id == self.initializer
        requests, request_parts = [], []
        for part, (shard, _, _) in enumerate(parts):
            if not creator:
                requests.append((shard, Message(
                    MsgType.DECLARE, table.id,
                    meta=self._shm_meta(shard, table.spec_meta(part)))))
                request_parts.append(part)
        if creator:
            if init is not None:
                values = _as_table_dtype(init, dtype, f"table {name!r}: init")
                if values.size != rows * width:
                    raise ValueError(f"table {name!r}: init has {values.size}"
                                     f" elements, expected {rows * width}")
                values = values.reshape(rows, width)
                for part, (_, start, end) in enumerate(parts):
                    table.part_rows[part] = PartRows(
                        [(0, values[start:end].copy())])
            for part, (shard, _, _) in enumerate(parts):
                initial = table.part_rows[part].chunks[0][1]
                if self._keep_log:  # (read-my-writes adds into the cache's)
                    table.init[part] = initial.copy() \
                        if self.read_my_writes else initial
                for message in self._create_messages(table, part, initial):
                    requests.append((shard, message))
                    request_parts.append(part)
        table.all_rows = AccessHandle(-1, "read", table)
        # Registered before the requests: a push may follow the ACK at once.
        if reserved is None:
            self._tables.append(table)
        else:
            self._tables[reserved] = table
        self._by_name[name] = table
        try:
            replies = self._request_all(requests,
                                        f"creation of table {name!r}")
            self._created(table, creator, replies, request_parts)
        except BaseException:
            # Some shard may hold it under this id (it took the request,
            # another refused it or did not answer): the id stays this
            # name's, for a retry, and the next table takes the next one,
            # as on the workers where the creation went through.
            del self._by_name[name]
            table.failed = True
            raise
        self._partitioner.take(parts, width * dtype.itemsize)
        return table

    def _reserved_id(self, name):
        """The id a failed creation of `name` left (None: a new one)."""
        for table in self._tables:
            if table.failed and table.name == name:
                return table.id
        return None

    def _live_tables(self):
        return [table for table in self._tables if not table.failed]

    def _created(self, table, creator, replies, request_parts):
        """A creation every shard acknowledged: which rows are whose, and a
        worker (re)joining a job under way starts at its clock."""
        parts = table.parts
        created = set()  # parts this creator's rows make (no shard had them)
        if creator:
            # Parts a shard held already (restored from a checkpoint, or a
            # running job this restarted creator joins) come pushed and
            # replace ours; the others hold our rows, at age 0 (also those
            # our recovery created again on a shard restored without them).
            theirs = {part for part, reply in zip(request_parts, replies)
                      if reply.meta.get("existing")} - table.created_again
            with self._cond:
                for part in range(len(parts)):
                    if part in theirs:
                        table.init.pop(part, None)
                    else:
                        table.ages[part] = max(table.ages[part], 0)
            created = set(range(len(parts))) - theirs - table.created_again
            creator = not theirs
        if not creator:  # a worker (re)joining a running job starts there
            self._check_restored_clocks(table, replies, request_parts,
                                        created)
            table.clock = max((r.meta.get("global_clock", 0)
                               for r in replies), default=0)
            # Creation is collective: return once the initial rows are here
            # (a shard would hold an update until the creator's rows came).
            self.wait_fresh(table, clock=table.clock + self.slack)

    def _check_restored_clocks(self, table, replies, request_parts,
                               created=()):
        """Refuses a table its shards restored at different clocks, or
        restored on some shards while others' checkpoints lacked it (a
        whole job killed between two shards' checkpoint writes, started
        again without `keras-geeps align-checkpoints`): no worker could go
        on from there, every wait would time out.

        Args:
            table: the table being created.
            replies: the shards' CREATE replies, one per request part.
            request_parts: the part each reply is for.
            created: parts this creator's rows created now (no shard held
                them).
        """
        restored, others = {}, {}
        for part, reply in zip(request_parts, replies):
            shard = table.parts[part][0]
            clock = reply.meta.get("global_clock", 0)
            if part in created:
                clock = None  # its checkpoint lacked it
            (restored if reply.meta.get("restored") else others)[shard] = \
                clock
        if not restored:
            return
        # A job under way (one shard restarted alone) has its other shards
        # at most a clock apart from the restored one, never created anew.
        first = min(restored.values())
        if len(set(restored.values())) > 1 or any(
                clock is None or clock < first - 1
                for clock in others.values()):
            clocks = {**restored, **others}
            raise GeePSError(
                f"table {table.name!r}: its shards were restored from "
                f"checkpoints at different clocks ("
                + ", ".join(f"shard {s}: " + (
                    "not in its checkpoint" if c is None else str(c))
                    for s, c in sorted(clocks.items()))
                + "): run `keras-geeps align-checkpoints DIR --shards "
                f"{self.cluster.num_shards} --workers {self.num_workers}` on "
                "the shards' checkpoint folder before starting them with "
                "--restore (keras-geeps launch does)")

    def _create_messages(self, table, part, initial):
        """The CREATE chunks that give a shard part its initial rows."""
        shard, start, end = table.parts[part]
        messages = []
        for c0, c1 in protocol.row_chunks(end - start, table.width,
                                          table.dtype.itemsize,
                                          self.chunk_bytes):
            meta = dict(table.spec_meta(part), chunk_row=c0)
            messages.append(Message(
                MsgType.CREATE, table.id,
                arrays=[initial[c0:c1]] if c1 > c0 else [],
                meta=self._shm_meta(shard, meta)))
        return messages

    def table(self, name):
        """Returns the table called `name`.

        Raises:
            KeyError: naming the tables this worker has.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"worker {self.worker_id} has no table {name!r} "
                           f"(its tables: {sorted(self._by_name)})") from None

    @property
    def tables(self):
        return self._live_tables()

    def virtual_iteration(self):
        """Records one step's accesses; returns the recorder.

        Example:

        ```python
        with client.virtual_iteration() as vi:
            h_read = vi.read(table)
            h_update = vi.update(table)
        for step in range(steps):
            params = client.read(h_read)
            client.update(h_update, compute_delta(params))
            client.clock()
        ```
        """
        self.access_plan = AccessPlan()
        return VirtualIteration(self.access_plan, self.table)

    # ------------------------------------------------------ the I/O side
    def _on_rows(self, shard, message, sealed=None):
        """Runs in the I/O thread for every PUSH / ROWS chunk (`sealed`:
        see `IOThread`)."""
        if not 0 <= message.table < len(self._tables):
            self._io.errors.append(GeePSError(
                f"shard {shard} pushed unknown table {message.table}"))
            return
        table = self._tables[message.table]
        if table.failed:  # (a shard that took it pushes it all the same)
            return
        part = table.part_of.get((shard, message.meta.get("row_start")))
        if part is not None and self._recovery.replaying:
            self._recovery.on_push(shard, table, part, message.clk)
        shared = "ref" in message.meta and not message.arrays
        if shared:
            lend = message.meta.get("lend")
            if lend is not None and len(table.parts) == 1:
                table.lend = (message.clk, shard, lend)
            try:
                rows = self._shared_rows(shard, message, table)
            except ValueError as exc:
                peer = self._shm_peers.get(shard, (None, None))[0]
                if peer is not None and not peer.alive():
                    # Pushed just before its process died: the restarted
                    # shard pushes the rows again when this worker recovers.
                    log.warning("worker %d: dropped a push of table %r from "
                                "shard %d, whose process is gone (%s)",
                                self.worker_id, table.name, shard, exc)
                    return
                self._io.errors.append(GeePSError(
                    f"shard {shard} pushed shared rows of table "
                    f"{table.name!r} this worker cannot read: {exc}"))
                return
        elif len(message.arrays) == 1:
            rows = message.arrays[0]
        else:
            self._io.errors.append(GeePSError(
                f"shard {shard} pushed {len(message.arrays)} frames for "
                f"table {table.name!r}; a push carries one"))
            return
        if part is None or rows.dtype != table.dtype or (
                rows.ndim != 2 or rows.shape[1] != table.width):
            self._io.errors.append(GeePSError(
                f"shard {shard} pushed rows that do not fit table "
                f"{table.name!r}: {message!r}"))
            return
        _, start, end = table.parts[part]
        begin = message.meta.get("chunk_row", 0)
        if begin < 0 or begin + rows.shape[0] > end - start:
            self._io.errors.append(GeePSError(
                f"shard {shard} pushed rows beyond its part of table "
                f"{table.name!r}"))
            return
        incoming = table.incoming[part]
        # A shard sends a push's chunks in row order: a chunk that starts
        # before the rows received so far end begins the push again (a
        # restarted shard resending the age a torn push had).
        restart = incoming[0] != message.clk or begin < incoming[3]
        try:
            if not shared:  # (shared rows are read where they lie)
                rows = self._place(table, part, message.clk, begin, rows,
                                   sealed[0] if sealed else None, restart)
        except seal.SealError as exc:
            log.error("dropped a sealed chunk of table %r from shard %d: %s",
                      table.name, shard, exc)
            # Its counter was taken: the link lost it as a break would.
            self._io.break_link(shard, f"lost a chunk ({exc})")
            return
        self._note_checkpoint(table, part, message.meta.get("ckpt", -1))
        if restart:
            incoming[:] = [message.clk, 0, {}, 0]
        incoming[2][begin] = rows
        incoming[1] += rows.shape[0]
        incoming[3] = begin + rows.shape[0]
        if incoming[1] < end - start:
            return
        age = message.clk
        fresh = PartRows(sorted(incoming[2].items()))
        incoming[:] = no_push()
        with table.lock:
            if age > table.ages[part]:
                if table.read_my_writes:  # replay own, uncovered updates
                    rows_ = fresh.writable()
                    for clk, delta in list(table.own.items()):
                        if clk >= age:
                            rows_ += delta[start:end]
                    if table.update_buffer is not None:  # this clock's
                        rows_ += table.update_buffer[start:end]
                table.part_rows[part] = fresh
                table.ages[part] = age
                delivery = table.delivery
                if delivery is not None and \
                        delivery.filling.get(part) == [age, end - start]:
                    delivery.done[part] = age
            floor = table.ages.min()
            for clk in [c for c in table.own if c < floor]:
                del table.own[clk]
        with self._cond:
            self._cond.notify_all()

    def _watched_by(self, shard, welcome):
        """Notes that `shard`, whose WELCOME this is, declares silent
        workers dead (if it does), and heartbeats well within its limit.
        Called by the I/O thread as each WELCOME comes (that of a
        recovery too), not once every shard answered: meanwhile (a shard
        still loading its checkpoint, or not answering at all) this worker
        must not fall silent there, and a client that fails to connect
        must say LEAVE there (close())."""
        watch = welcome.meta.get("worker_timeout", 0.0)
        if watch > 0:
            self._watching.add(shard)
            self._heartbeat_within(watch)

    def _heartbeat_within(self, worker_timeout):
        """Heartbeats at least HEARTBEATS_PER_TIMEOUT times per a shard's
        worker_timeout, whatever `heartbeat_interval` said (unless 0: none
        at all), so a live worker is never taken for dead."""
        interval = self._io.heartbeat_interval
        most = worker_timeout / HEARTBEATS_PER_TIMEOUT
        if interval > most:
            log.info("worker %d: heartbeats every %.3g s, not %.3g s: a "
                     "shard declares workers silent for %.3g s dead",
                     self.worker_id, most, interval, worker_timeout)
            self._io.heartbeat_interval = most

    def _note_checkpoint(self, table, part, ckpt):
        """`part`'s shard wrote `table` durably at clock `ckpt`: the replay
        log drops the clocks every part's checkpoint covers."""
        if ckpt > table.part_ckpt[part]:
            with self._clock_lock:
                table.part_ckpt[part] = ckpt
                table.init.pop(part, None)  # the checkpoint holds them now
                covered = int(table.part_ckpt.min())
                for clk in [c for c in table.log if c < covered]:
                    del table.log[clk]

    def _place(self, table, part, age, begin, rows, frame, restart):
        """The rows of a chunk as the cache keeps them: put into the buffer
        of a read that waits for the part (`_Delivery`), opened there when
        sealed (`frame`, a `seal.SealedFrame`: `rows` then only gives
        dtype and shape), else opened in place.

        Raises:
            seal.SealError: sealed rows that do not authenticate (a read
                waiting for them copies from the cache instead).
        """
        with table.lock:  # a read takes its delivery back under it
            delivery = table.delivery
            filling = None
            if delivery is not None and part in delivery.regions and \
                    part not in delivery.done:
                if restart:  # placed from its first chunk on, or not at all
                    delivery.filling[part] = [age, 0]
                filling = delivery.filling.get(part)
            if filling is not None:
                region = delivery.regions[part][begin:begin + rows.shape[0]]
                try:
                    if frame is None:
                        np.copyto(region, rows)
                    else:
                        frame.open_into(region.reshape(-1).view(np.uint8))
                except seal.SealError:
                    del delivery.filling[part]  # its region holds no push
                    raise
                filling[1] += rows.shape[0]
                self.bytes_delivered += rows.nbytes
                return rows if frame is None else SealedRows(frame, rows)
        if frame is None:
            return rows
        return frame.open_as(rows.dtype, rows.shape)

    # ------------------------------------------- failures and recovery
    def _on_error_code(self, shard, message, future):
        """Runs in the I/O thread for an ERROR that carries a code."""
        code = message.meta.get("code")
        text = message.meta.get("error", "")
        if self._job_failed is not None and \
                code == protocol.ERROR_HELLO_REQUIRED:
            # Declared dead (or the job stopped): this process must not
            # take its worker's place again, as a replacement may have.
            if future is not None:
                future.set(error=self._job_failed)
            return
        if code == protocol.ERROR_HELLO_REQUIRED:
            # Stale requests after a restart land here.
            self._recovery.begin(shard)
            if future is not None:
                self._recovery.resend_after(shard, future)
            return
        error = (GeePSWorkerFailedError(f"shard {shard}: {text}")
                 if code == protocol.ERROR_WORKER_DEAD
                 else GeePSError(f"shard {shard}: {text}"))
        if future is not None:
            future.set(error=error)
        elif code == protocol.ERROR_WORKER_DEAD:
            self._stop_job(error)
        else:
            self._io.errors.append(error)
        with self._cond:
            self._cond.notify_all()

    def _on_link_broken(self, shard, reason):
        """A sealed link that lost messages (I/O thread): recovered as a
        refusal would be; the WELCOME tells a reconnect from a restart."""
        del reason  # (logged by the I/O thread)
        self._recovery.begin(shard)

    def _fail(self, error):
        self._io.errors.append(error)
        with self._cond:
            self._cond.notify_all()

    def _stop_job(self, error):
        """This worker was declared dead, or the job stopped (I/O thread):
        for good, every later call raises `error` (the first one kept: a
        stopped job's shards refuse each heartbeat too), and nothing is
        kept alive."""
        if self._job_failed is None:
            self._job_failed = error
            self._io.heartbeat_interval = 0
        with self._cond:
            self._cond.notify_all()

    def _lose(self, shard, reason):
        """Gives `shard` up for good: `reason` is raised once where a caller
        waits, then by every later call."""
        log.error("worker %d: %s", self.worker_id, reason)
        self._lost[shard] = reason
        self._fail(GeePSError(reason))

    # ----------------------------------------------------- reads, updates
    def handle_for(self, what):
        """The `AccessHandle` for a table, its name, or a handle itself."""
        if isinstance(what, AccessHandle):
            if what.table is None:
                raise TypeError(f"{what} is a {what.kind} access (data of "
                                f"the worker's own), not a table's: it has "
                                f"no rows to read or update")
            self._check_own(what.table)
            return what
        if isinstance(what, str):
            what = self.table(what)
        if isinstance(what, Table):
            self._check_own(what)
            return what.all_rows
        raise TypeError(f"expected a Table, a table name or an AccessHandle,"
                        f" got {type(what).__name__}")

    def _check_own(self, table):
        """Refuses a table (or a handle of one) another client made: its id
        and parts are that client's job's, and its rows would go there."""
        if self._by_name.get(table.name) is not table:
            raise ValueError(f"table {table.name!r} belongs to another "
                             f"client: use this client's "
                             f"(client.table({table.name!r}))")

    def _required_age(self, table, clock):
        """The data age a read of `table` at `clock` (None: its current
        clock) needs under the slack."""
        if clock is None:
            clock = table.clock
        elif isinstance(clock, (bool, np.bool_)) or \
                not isinstance(clock, numbers.Integral):
            raise TypeError(f"a read of table {table.name!r} at clock "
                            f"{clock!r}: a clock is an integer (or None: "
                            f"this worker's clock of the table)")
        elif clock < 0:
            raise ValueError(f"a read of table {table.name!r} at clock "
                             f"{clock}: clocks start at 0")
        return max(0, int(clock) - self.slack)

    def wait_fresh(self, what, clock=None):
        """Blocks until `what` is as fresh as the slack requires.

        Args:
            what: a `Table`, its name, or an `AccessHandle`.
            clock: the clock being read at; defaults to the table's current
                clock on this worker.

        Returns:
            The data age of the rows read (clocks reflected).

        Raises:
            GeePSTimeoutError: naming the shard that does not answer or the
                workers that are behind, after `timeout` seconds.
        """
        handle = self.handle_for(what)
        table = handle.table
        required = self._required_age(table, clock)
        parts = [p for p, _, _ in handle.parts]
        if handle.rows is not None and not parts:
            return 0  # an access of no rows: nothing to wait for
        started = time.monotonic()
        deadline = started + self.timeout
        with self._cond:
            while True:
                self._raise_async_errors()
                ages = table.ages[parts] if parts else table.ages
                if not len(ages) or ages.min() >= required:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.5))
        waited = time.monotonic() - started
        self.wait_seconds += waited
        ages = table.ages[parts] if parts else table.ages
        if len(ages) and ages.min() < required:
            raise self._timeout_error(table, parts, required)
        return int(ages.min()) if len(ages) else 0

    def read(self, what, out=None, clock=None):
        """Returns the rows of a table (or an access), fresh per the slack.

        A read that has to wait for the push of whole table parts (and a
        table without `read_my_writes`) gets that push's chunks in its
        output as they arrive, opened there when the link is sealed: no
        copy is left once the last one is in (`stats()["bytes_delivered"]`
        counts them). Otherwise the cached rows are copied out.

        Args:
            what: a `Table`, its name, or an `AccessHandle` from
                `virtual_iteration()` (its pre-built index is used).
            out: optional array to copy into (shape (rows, width)).
            clock: the clock read at; defaults to the table's current clock.

        Returns:
            A (rows, width) numpy array (a copy: later pushes do not change
            it).
        """
        handle = self.handle_for(what)
        table = handle.table
        count = table.rows if handle.rows is None else len(handle.rows)
        if out is None:
            out = np.empty((count, table.width), table.dtype)
        elif not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array, got "
                            f"{type(out).__name__}")
        elif out.shape != (count, table.width):
            raise ValueError(f"out has shape {out.shape}, the read gives "
                             f"{(count, table.width)}")
        elif out.dtype != table.dtype:
            raise ValueError(f"out has dtype {out.dtype}, table "
                             f"{table.name!r} holds {table.dtype}: a copy "
                             f"into it would convert (truncate) the rows")
        elif not out.flags.writeable:
            raise ValueError(f"out is read-only: a read of table "
                             f"{table.name!r} cannot be written there")
        delivery = self._deliver_into(handle, out, clock)
        try:
            self.wait_fresh(handle, clock)
        finally:
            if delivery is not None:
                with table.lock:
                    table.delivery = None
        with table.lock:
            for part, buffer_rows, local_rows in handle.parts:
                # (a part its delivery holds whole, unless a newer push
                # came since, is in `out` already)
                if delivery is None or \
                        delivery.done.get(part) != table.ages[part]:
                    table.part_rows[part].copy_to(out[buffer_rows],
                                                  local_rows)
            ages = [table.ages[part] for part, _, _ in handle.parts]
        table.last_read_ages = [int(a) for a in ages]
        table.last_read_age = int(min(ages)) if ages else table.data_age
        return out

    def delivers(self, what, clock=None):
        """Whether a whole-table `read` of `what` at `clock` now would get
        its rows in its buffer as they arrive: it has to wait for a push,
        the push comes over TCP, not shared memory, and the table keeps no
        own writes (a push that has begun to arrive goes to the cache
        first and is copied out as before).

        Args:
            what: a `Table` or its name.
            clock: the clock read at; defaults to the table's current clock.
        """
        table = self.handle_for(what).table
        with table.lock:
            return self._waits_for_push(table, range(len(table.parts)),
                                        clock) and not any(
                shard in self._shm_peers for shard, _, _ in table.parts)

    def _waits_for_push(self, table, parts, clock):
        """Whether a read of `parts` of `table` at `clock` must wait for a
        push that can be delivered into its buffer: the table keeps no own
        writes and a part is older than the read needs (under table.lock).
        """
        parts = list(parts)
        return not table.read_my_writes and bool(parts) and \
            table.ages[parts].min() < self._required_age(table, clock)

    def _deliver_into(self, handle, out, clock):
        """Registers `out` to receive the pushes a read must wait for, as
        they arrive (`_Delivery`), when it reads whole parts of a table
        that holds no own writes and is not fresh yet. Returns the
        delivery, or None."""
        table = handle.table
        if out.dtype != table.dtype or not out.flags.c_contiguous or \
                not out.flags.writeable:
            return None  # (a read-only `out` was refused before)
        regions = {}
        for part, buffer_rows, local_rows in handle.parts:
            _, start, end = table.parts[part]
            if not isinstance(local_rows, slice) or \
                    local_rows.stop - local_rows.start != end - start:
                return None
            regions[part] = out[buffer_rows]
        with table.lock:
            if table.delivery is not None or \
                    not self._waits_for_push(table, regions, clock):
                return None
            table.delivery = _Delivery(regions)
            return table.delivery

    def read_shared(self, what, clock=None):
        """The rows of a whole table without a copy, when they can be had so.

        A co-located shard's push arrives as one shared-memory buffer; this
        returns it itself (64-byte aligned, so TensorFlow can alias it). It
        is mapped read-only: the writeable flag is set only so DLPack can
        export it, and a write faults. It stays valid while referenced.

        Args:
            what: a `Table` or its name.
            clock: the clock read at; defaults to the table's current clock.

        Returns:
            A (rows, width) array, or None when the rows are not one aligned
            buffer (use `read`).
        """
        handle = self.handle_for(what)
        table = handle.table
        if handle.rows is not None or len(table.parts) != 1:
            return None
        self.wait_fresh(handle, clock)
        with table.lock:
            chunks = table.part_rows[0].chunks
            if len(chunks) != 1 or not isinstance(chunks[0][1], np.ndarray):
                return None
            array = chunks[0][1]
            if array.shape[0] != table.rows or array.ctypes.data % 64 or \
                    array.flags.writeable:  # ours: read-my-writes changes it
                return None
            age = int(table.ages[0])
        table.last_read_ages = [age]
        table.last_read_age = age
        return shm.PeerBuffers.writable_alias(array)

    def update(self, what, delta, copy=True):
        """Adds `delta` to this clock's update of a table (or an access).

        Updates are additive and buffered until `clock()`, which sends them.

        Args:
            what: a `Table`, its name, or an `AccessHandle`.
            delta: the rows to add, shape (rows accessed, width) or any shape
                of as many elements.
            copy: if False and this is the table's first whole-table update
                of the clock, the client keeps `delta` itself and sends it
                without copying; the caller must not change it until the
                shards applied it (a read at the clock after next waits for
                that, with slack 0 or 1). Where the client keeps updates
                longer (the replay log of checkpointing shards,
                read-my-writes) or a read that soon need not wait for them
                (slack >= 2: a resend after a broken connection would send
                what the caller wrote there since), it keeps a copy, so the
                caller may then reuse the buffer. Defaults to True.
        """
        self._raise_async_errors()
        handle = self.handle_for(what)
        table = handle.table
        count = table.rows if handle.rows is None else len(handle.rows)
        delta = np.asarray(delta)
        if delta.size != count * table.width:
            raise ValueError(f"update of table {table.name!r} has "
                             f"{delta.size} elements, expected "
                             f"{count * table.width}")
        delta = np.ascontiguousarray(_as_table_dtype(
            delta, table.dtype, f"update of table {table.name!r}").reshape(
                count, table.width))
        self._check_lent(table, handle, delta, copy)
        with table.lock:  # the I/O thread replays own updates under it
            self._accumulate(table, handle, delta, copy)
            if table.read_my_writes:
                for part, buffer_rows, local_rows in handle.parts:
                    table.part_rows[part].writable()[local_rows] += \
                        delta[buffer_rows]

    @staticmethod
    def _check_lent(table, handle, delta, copy):
        """A lent buffer (`lend_target`) holds the table's new rows, which
        the shard adopts as they are: it must be the clock's only update,
        kept (copy=False), or its rows would be added as an update. An
        ordinary update instead gives the lend up for this clock."""
        lent = table.lent_target
        if lent is None:
            return
        if _same_memory(delta, lent[0]):
            if copy or handle.rows is not None or \
                    table.update_buffer is not None:
                raise ValueError(
                    f"update of table {table.name!r}: the buffer "
                    f"lend_target gave holds the table's new rows, not an "
                    f"update: pass it alone, whole, with copy=False "
                    f"(update(table, lent, copy=False)), or send an update "
                    f"as usual")
        elif table.update_buffer is not None and \
                _same_memory(table.update_buffer, lent[0]):
            raise ValueError(
                f"update of table {table.name!r}: this clock's update is "
                f"the lent buffer's new rows already; no other update may "
                f"follow it in the clock")
        else:
            table.lent_target = None  # not used this clock

    @staticmethod
    def _accumulate(table, handle, delta, copy):
        if table.update_buffer is None:
            if handle.rows is None and not copy:
                table.update_buffer, table.update_owned = delta, False
            elif handle.rows is None:
                table.update_buffer = delta.copy()
                table.update_owned = True
            else:
                table.update_buffer = np.zeros((table.rows, table.width),
                                               table.dtype)
                table.update_owned = True
                table.update_buffer[handle.rows] = delta
            return
        if not table.update_owned:
            table.update_buffer = table.update_buffer.copy()
            table.update_owned = True
        if handle.rows is None:
            np.add(table.update_buffer, delta, out=table.update_buffer)
        else:
            table.update_buffer[handle.rows] += delta

    def clock(self, tables=None):
        """Finishes this worker's current clock: sends updates, then clocks.

        Args:
            tables: the tables (or names) to clock, or one of them;
                defaults to all. GeePS clocks tables separately so each
                layer's update can leave as soon as it is ready.

        Raises:
            KeyError: a name of no table (then no table is clocked).
            TypeError: `tables` is neither a table, a name nor a list of
                them.
        """
        self._raise_async_errors()
        if isinstance(tables, (str, Table)):
            tables = [tables]
        elif tables is not None and not isinstance(
                tables, collections.abc.Iterable):
            raise TypeError(f"clock() takes a list of tables or their "
                            f"names, got {type(tables).__name__}")
        # (every one is looked up first: one unknown clocks none)
        tables = self._live_tables() if tables is None else [
            self.handle_for(t).table for t in tables]
        if len({id(table) for table in tables}) != len(tables):
            raise ValueError(f"clock() got a table twice "
                             f"({[table.name for table in tables]}): each "
                             f"is clocked once per clock")
        # Every wait first: one that times out leaves none clocked (and
        # the tables at one clock), as the README says.
        for table in tables:
            if self._keep_log and len(table.log) >= self._max_log_clocks:
                self._wait_for_checkpoint(table)
        for table in tables:
            with self._clock_lock:  # a replay sees every clock whole or not
                buffer = self._send_update(table)
                if self._keep_log:
                    table.log[table.clock] = buffer
                for shard, _, _ in table.parts:
                    self._send(shard, Message(MsgType.CLOCK, table.id,
                                              clk=table.clock))
                table.clock += 1

    def _wait_for_checkpoint(self, table):
        """Holds this clock back while `table`'s replay log holds
        `max_log_clocks` clocks: the shards' checkpoints lag that far (a
        slow or failing disk), and the log, kept until they cover it, would
        grow without end. Asks the shards for their checkpoint clocks
        meanwhile: a slow disk slows the worker to its pace.

        Raises:
            GeePSTimeoutError: no checkpoint came within `timeout`, naming
                the clocks the shards' checkpoints are at.
        """
        deadline = time.monotonic() + self.timeout
        shards = sorted({shard for shard, _, _ in table.parts})
        while len(table.log) >= self._max_log_clocks:
            self._raise_async_errors()
            if time.monotonic() >= deadline:
                at = {shard: int(table.part_ckpt[part])
                      for part, (shard, _, _) in enumerate(table.parts)}
                with self._clock_lock:  # (the I/O thread trims it)
                    oldest = min(table.log, default=table.clock)
                raise GeePSTimeoutError(
                    f"worker {self.worker_id}: the replay log of table "
                    f"{table.name!r} holds {len(table.log)} clocks (from "
                    f"clock {oldest}), max_log_clocks="
                    f"{self._max_log_clocks}, and the shards wrote no "
                    f"checkpoint of it past clocks {at} (shard: clock) in "
                    f"{self.timeout:.1f} s: is a shard's --checkpoint-dir "
                    f"full or failing? (see the shard's log)")
            replies = self._request_all(  # (within the one deadline)
                [(s, Message(MsgType.STATS)) for s in shards], "STATS",
                max(0.05, deadline - time.monotonic()))
            for shard, reply in zip(shards, replies):
                entry = self._stats_of(shard, reply).get(
                    "tables", {}).get(str(table.id))
                for part, (s, _, _) in enumerate(table.parts):
                    if s == shard and entry is not None:
                        self._note_checkpoint(table, part,
                                              entry["ckpt_clock"])
            if len(table.log) >= self._max_log_clocks:
                time.sleep(CHECKPOINT_POLL_S)

    def _send_update(self, table):
        """Sends this clock's update of `table`; returns it (the array the
        replay log may keep), or None when there is none."""
        with table.lock:
            buffer = table.update_buffer
            if buffer is None:
                return None
            buffer = self._kept_update(table, buffer)
            table.update_buffer = None
            if table.read_my_writes:
                table.own[table.clock] = buffer
        lent, table.lent_target, table.lend = table.lent_target, None, None
        if lent is not None and _same_memory(buffer, lent[0]):
            table.upload_target = None
            self.shm_bytes_out += buffer.nbytes
            self._send(lent[1], Message(MsgType.UPDATE, table.id,
                                        clk=table.clock,
                                        meta={"chunk_row": 0,
                                              "into": lent[2]}))
            return buffer
        entry = self._shared_update(table, buffer)
        row_bytes = table.width * table.dtype.itemsize
        for shard, start, end in table.parts:
            if entry is not None and shard in self._shm_upload and end > start:
                self.shm_bytes_out += (end - start) * row_bytes
                self._send(shard, Message(
                    MsgType.UPDATE, table.id, clk=table.clock,
                    meta={"chunk_row": 0, "ref": entry[0].ref(
                        start * row_bytes, (end - start) * row_bytes)}))
                continue
            for message in self._update_messages(table, table.clock, buffer,
                                                 start, end):
                self._send(shard, message)
        return buffer

    def _kept_update(self, table, buffer):
        """`buffer`, or a copy of it where this client keeps the update past
        this clock (the replay log, read-my-writes, or with slack >= 2
        until the shards acknowledge it, which a read at the clock after
        next no longer waits for) but the caller owns the memory
        (`update(..., copy=False)`) and may reuse it. The shared buffers
        `update_target` / `lend_target` gave out are this client's: the log
        holds them without a copy."""
        if table.update_owned or not (self._keep_log or table.read_my_writes
                                      or self.slack >= 2):
            return buffer
        for given in (table.upload_target, table.lent_target):
            if given is not None and _same_memory(buffer, given[0]):
                return buffer
        return buffer.copy()

    def _shared_update(self, table, buffer):
        """The upload entry holding `buffer`'s rows for co-located shards:
        the one `update_target` gave when the update was written there, else
        a free one it is copied into; None if no shard shares memory."""
        target, table.upload_target = table.upload_target, None
        if not any(s in self._shm_upload for s, _, _ in table.parts):
            return None
        if target is not None:
            array, entry = target
            if _same_memory(buffer, array):
                entry[2] = self._keep_log  # the log keeps this very memory
                return entry
        entry = self._upload_entry(table, table.clock)
        if entry is not None:
            np.copyto(entry[0].array[:table.nbytes].view(table.dtype)
                      .reshape(buffer.shape), buffer)
        return entry

    def _update_messages(self, table, clock, buffer, start, end):
        """UPDATE messages carrying buffer's rows [start, end) in chunks
        (TCP frames: a replay after a shard restart always uses these)."""
        for c0, c1 in protocol.row_chunks(end - start, table.width,
                                          table.dtype.itemsize,
                                          self.chunk_bytes):
            if c1 > c0:
                yield Message(MsgType.UPDATE, table.id, clk=clock,
                              arrays=[buffer[start + c0:start + c1]],
                              meta={"chunk_row": c0})

    # ------------------------------------------------- stats, diagnosis
    def shard_stats(self, timeout=None):
        """Returns each shard's statistics (a list of dicts, by shard id).

        Args:
            timeout: seconds to wait for every answer. Defaults to None:
                the client's timeout.
        """
        if timeout is not None:
            check_seconds("timeout", timeout)
        replies = self._request_all(
            [(s, Message(MsgType.STATS))
             for s in range(self.cluster.num_shards)], "STATS", timeout)
        return [self._stats_of(s, r) for s, r in enumerate(replies)]

    def _stats_of(self, shard, reply):
        """`protocol.stats_of(reply)`; a malformed one a `GeePSServerError`
        naming `shard`."""
        try:
            return protocol.stats_of(reply)
        except ProtocolError as exc:
            raise GeePSServerError(
                f"shard {shard} ({self.cluster.shards[shard]}) sent a "
                f"malformed STATS reply: {exc}") from None

    def stats(self, tables=None):
        """Returns this worker's figures: bytes moved, waits, data ages,
        and `reconnects` (connections to a live shard that broke and were
        resumed with nothing lost).

        Args:
            tables: the tables whose data age (the oldest) and clock (the
                furthest) are given. Defaults to all of this client's.
        """
        tables = self._live_tables() if tables is None else tables
        return {"bytes_sent": self._io.bytes_out + self.shm_bytes_out,
                "bytes_received": self._io.bytes_in + self.shm_bytes_in,
                "shm_bytes_sent": self.shm_bytes_out,
                "shm_bytes_received": self.shm_bytes_in,
                "wait_seconds": self.wait_seconds,
                "bytes_delivered": self.bytes_delivered,
                "reconnects": self.reconnects,
                "data_age": min((t.data_age for t in tables), default=0),
                "clock": max((t.clock for t in tables), default=0)}

    def _recovery_pending(self, shard):
        """Why what goes to `shard` waits: its recovery is under way."""
        return (f"this worker's recovery of shard {shard} "
                f"({self.cluster.shards[shard]}), restarted or reconnected, "
                f"is not done: it waits for the shard's WELCOME, or to "
                f"replay clocks the shard takes once the other workers have "
                f"replayed theirs (has every worker a client open, sending "
                f"heartbeats?)")

    def _timeout_error(self, table, parts, required):
        lines, asked = [], {}
        for shard in sorted({table.parts[p][0] for p in parts
                             if table.ages[p] < required}):
            if shard in self._io.held:  # (a STATS would wait behind it)
                lines.append(self._recovery_pending(shard))
                continue
            asked[shard] = Future()
            self._send(shard, Message(MsgType.STATS), asked[shard])
        # All at once, and briefly: a live shard answers in milliseconds,
        # and the wait that timed out must not last twice its timeout; at
        # least 0.5 s, though (a busy or collecting shard answers late,
        # and is then named dead).
        deadline = time.monotonic() + min(2.0, max(0.5, 0.2 * self.timeout))
        for shard, future in asked.items():
            address = self.cluster.shards[shard]
            answered = future.event.wait(max(0.0,
                                             deadline - time.monotonic()))
            self._io.forget([future])
            if not answered or future.error:
                lines.append(f"shard {shard} ({address}) does not answer: it "
                             f"is dead or unreachable")
                continue
            try:
                info = self._stats_of(shard, future.message)
            except GeePSServerError as exc:
                lines.append(str(exc))
                continue
            shard_table = info.get("tables", {}).get(str(table.id))
            if shard_table is None or not shard_table["ready"]:
                lines.append(f"shard {shard} ({address}) has no initial "
                             f"values for table {table.name!r} yet (worker "
                             f"{self.initializer} creates them)")
                continue
            behind = [w for w, c in enumerate(shard_table["vclock"])
                      if c < required]
            lines.append(f"shard {shard} ({address}): workers {behind} have "
                         f"not finished clock {required - 1} (vector clock "
                         f"{shard_table['vclock']})")
        return GeePSTimeoutError(
            f"worker {self.worker_id} waited {self.timeout:.1f} s to read "
            f"table {table.name!r} with data age >= {required} (its own "
            f"clock {table.clock}, slack {self.slack}; it has "
            f"{table.ages.tolist()}): " + "; ".join(lines))

    def stop_shards(self):
        """Asks every shard to shut down (bounded wait for their ACKs)."""
        self._request_all([(s, Message(MsgType.STOP))
                           for s in range(self.cluster.num_shards)], "STOP")

    def close(self):
        """Tells the shards this worker leaves, and closes the connections;
        the client is unusable afterwards.

        The shards then take this worker's silence for no death (a shard
        started with `--worker-timeout`), unless another worker goes on
        past the clocks it finished: then the job stops naming it, or goes
        on without it (`--on-worker-failure continue`). A shard that writes
        checkpoints answers once one holds this worker's last clocks (the
        replay log goes with this client): while it is up, that is waited
        for up to `timeout`. A new client of the
        same worker id joins again. A client still open when the
        interpreter exits is closed then (atexit). Threads waiting in the
        client, and every later call, raise `GeePSError` ("... the client
        is closed").
        """
        self._close(LEAVE_WAIT_S)

    def _close(self, leave_wait):
        if not self._closed:
            self._leave(leave_wait)
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # wake `wait_fresh`
        if self._io is not None:
            self._io.close()  # fails the requests still waiting
        # Nothing runs for this client any more: a closed client kept as
        # an object holds no rows, buffers or shard mappings. The arena
        # first: it closes the descriptors of the buffers it still knows
        # of, which it forgets (weakly held) once the tables let go.
        if self._arena is not None:
            self._arena.close()
        for table in self._tables:
            table.let_go()
        self._shm_peers.clear()
        self._shm_upload.clear()
        self._releases.clear()

    def _leave(self, wait):
        """Sends LEAVE to every shard that watches for silent workers, or to
        every shard where they write checkpoints (a shard answers once a
        checkpoint holds this worker's last clocks: its replay log closes
        with it), and waits `wait` seconds at most for their ACKs, which
        follow everything sent before. Nothing when the job stopped or the
        I/O thread failed; a shard that does not answer is only logged (a
        worker_timeout there may then declare this worker dead). (What was
        sent to the others leaves before the sockets close:
        `IOThread.close`.)"""
        if self._io is None or self._job_failed is not None or \
                self._io.failed is not None:
            return
        futures, probes, failures = [], {}, []
        try:
            shards = range(self.cluster.num_shards) if self._keep_log \
                else sorted(list(self._watching))  # (I/O thread adds)
            for shard in shards:
                if shard not in self._lost:
                    futures.append(Future())
                    self._queue(shard, Message(MsgType.LEAVE), futures[-1])
                    if self._keep_log:  # (is it up? `_await_leave`)
                        probes[shard] = Future()
                        self._queue(shard, Message(MsgType.STATS),
                                    probes[shard])
            # Heartbeats go on to the shards yet to answer (the I/O thread
            # asks at each beat): one that restarts meanwhile answers
            # hello_required, and the recovery replays this worker's
            # clocks and sends the LEAVE again. (Not to those that
            # answered: one restarted would answer so too, and this worker
            # would be a member there again.)
            self._io.heartbeat_only = lambda: {
                f.shard for f in futures if not f.event.is_set()}
            self._io.heartbeat_interval = self._io.heartbeat_interval or 1.0
            started = time.monotonic()
            limit = min(self.timeout, wait)
            for future in futures:
                try:
                    self._await_leave(future, started, limit,
                                      probes.get(future.shard))
                except GeePSError as exc:  # (the others are waited for)
                    failures.append(exc)
        except GeePSError as exc:
            failures.append(exc)
        finally:
            self._io.heartbeat_interval = 0
            self._io.forget(futures + list(probes.values()))
        for exc in failures:
            log.warning("worker %d: closing without every shard hearing it "
                        "leave: %s", self.worker_id, exc)

    def _await_leave(self, future, started, limit, probe):
        """Waits for a LEAVE's ACK: `limit` s from `started` for a shard
        that is gone, up to the client's timeout for one that is up (it
        answered the STATS `probe` sent with the LEAVE, or the HELLO of a
        recovery of it) (`_await_leave_checkpoint`)."""
        try:
            self._await_reply(future, started + limit, "LEAVE", limit)
        except GeePSTimeoutError:
            up = probe is not None and (
                probe.event.is_set() and probe.error is None
                or self._recovery.welcomed(future.shard))
            if not up:
                raise
            self._await_leave_checkpoint(future, started)

    def _await_leave_checkpoint(self, future, started):
        """Waits on the ACK of a LEAVE from a shard that is up (or being
        recovered), up to the client's timeout since `started`: the shard
        gives it once a checkpoint holds this worker's last clocks, which
        waits for the other workers to finish them. Going sooner would
        leave those updates in no checkpoint and no replay log."""
        try:
            self._await_reply(future, started + self.timeout, "LEAVE",
                              self.timeout)
        except GeePSTimeoutError:
            raise GeePSTimeoutError(
                f"worker {self.worker_id}: shard {future.shard} "
                f"({self.cluster.shards[future.shard]}) is up but wrote no "
                f"checkpoint holding this worker's last clocks within "
                f"{self.timeout:g} s (timeout; the other workers have not "
                f"finished them, or its checkpoints fail): should it "
                f"restart before it does, the updates of those clocks are "
                f"in no checkpoint and no replay log") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
