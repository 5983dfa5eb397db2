"""A shard's limits and tuning, and the error of a refused request."""

from keras_geeps import protocol, shm
from keras_geeps.checks import check_count, check_seconds

# The largest count or size a setting takes (libzmq's limits are int64).
MAX_SETTING = 1 << 62


class ShardSettings:
    """Limits and tuning of one shard.

    Args:
        max_message_bytes: largest message accepted. Defaults to 1 GiB.
        max_tables: most tables the shard will hold. Defaults to 4096.
        max_table_bytes: most bytes of rows (all tables) the shard will
            hold: rows, pending clocks (and their rows' written flags),
            lent and snapshot buffers, pooled buffers still being sent,
            and held updates (deterministic_sums) with their clock's rows
            buffer. Defaults to 16 GiB.
        max_pending_clocks: how far ahead of the global clock a worker's
            update or clock may be (bounds SSP buffers, and the clocks one
            advance covers). Defaults to 64.
        max_parked_reads: most reads waiting for freshness, each worker at
            most its share (max_parked_reads / num_workers). Defaults to
            4096.
        chunk_bytes: size of the row chunks the shard sends. Defaults to
            `protocol.DEFAULT_CHUNK_BYTES`.
        poll_timeout_ms: poll loop turn, so stop requests and housekeeping
            run even when idle. Defaults to 100.
        checkpoint_dir: where checkpoints are written. Defaults to None
            (no checkpoints).
        checkpoint_every: snapshot a table whenever its global clock
            reaches a multiple of this (0: only on request); at most
            `max_pending_clocks` + 1, so that a restart's replay is taken.
            Defaults to 0.
        worker_timeout: seconds without any message (workers send
            heartbeats) after which a worker is dead; 0 disables the check.
            A worker whose client closed (LEAVE) is not watched.
            Defaults to 0.
        on_worker_failure: "stop" (every worker gets an error naming the
            dead one) or "continue" (the clocks stop waiting for it; a
            restarted worker rejoins). Defaults to "stop".
        shared_memory: exchange rows with workers on this host through
            shared memory (see `keras_geeps.shm`). Defaults to True where
            the host supports it (memfd and /proc) unless
            `KERAS_GEEPS_SHM` is `0`, `false` or `no`.
        max_held_buffers: most row buffers of one table a worker may hold
            through shared memory; past it the worker gets copies by TCP.
            Defaults to 4.
        lend_buffers: when a table has one writer (a 1-worker job) that
            shares memory with the shard and `checkpoint_every` is 0, lend
            it the buffer of the table's next rows with every push: the
            worker writes `rows + update` there itself and the shard adopts
            it, with no add of its own. Defaults to True.
        deterministic_sums: add each clock's updates in worker order (all of
            worker 0's, then worker 1's, ...) instead of as they arrive, so
            that a job run twice on the same data ends with bit-identical
            parameters (float addition is not associative: three updates
            added in another order round differently), a restarted shard's
            replay included. An update whose turn has not come (a worker
            numbered below its sender has not finished the clock) is held,
            counted against max_table_bytes, until it has; so are updates
            of clocks ahead of the table's (SSP). Defaults to False.

    Raises:
        ValueError: naming a setting out of its range (a limit or size
            below 1, max_pending_clocks, max_held_buffers, checkpoint_every
            or worker_timeout below 0) or two that do not go together.
    """

    def __init__(self, max_message_bytes=1 << 30, max_tables=4096,
                 max_table_bytes=16 << 30, max_pending_clocks=64,
                 max_parked_reads=4096,
                 chunk_bytes=protocol.DEFAULT_CHUNK_BYTES,
                 poll_timeout_ms=100, checkpoint_dir=None,
                 checkpoint_every=0, worker_timeout=0.0,
                 on_worker_failure="stop", shared_memory=None,
                 max_held_buffers=4, lend_buffers=True,
                 deterministic_sums=False):
        for name, value, least in (
                ("max_message_bytes", max_message_bytes, 1),
                ("max_tables", max_tables, 1),
                ("max_table_bytes", max_table_bytes, 1),
                ("max_pending_clocks", max_pending_clocks, 0),
                ("max_parked_reads", max_parked_reads, 1),
                ("chunk_bytes", chunk_bytes, 1),
                ("poll_timeout_ms", poll_timeout_ms, 1),
                ("checkpoint_every", checkpoint_every, 0),
                ("max_held_buffers", max_held_buffers, 0)):
            check_count(name, value, least)
            if value > MAX_SETTING:
                raise ValueError(f"{name} must be at most {MAX_SETTING:,}, "
                                 f"not {value:,}")
        check_seconds("worker_timeout", worker_timeout,
                      zero_means="not watched")
        if on_worker_failure not in ("stop", "continue"):
            raise ValueError(f"on_worker_failure must be 'stop' or "
                             f"'continue', not {on_worker_failure!r}")
        if checkpoint_every and not checkpoint_dir:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        if checkpoint_every > max_pending_clocks + 1:
            raise ValueError(
                f"checkpoint_every={checkpoint_every} needs "
                f"max_pending_clocks >= {checkpoint_every - 1} (it is "
                f"{max_pending_clocks}): after a restart each worker "
                f"replays up to checkpoint_every - 1 + its slack clocks "
                f"past the restored one, and the shard refuses a clock "
                f"more than max_pending_clocks ahead")
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.worker_timeout = worker_timeout
        self.on_worker_failure = on_worker_failure
        self.max_message_bytes = max_message_bytes
        self.max_tables = max_tables
        self.max_table_bytes = max_table_bytes
        self.max_pending_clocks = max_pending_clocks
        self.max_parked_reads = max_parked_reads
        self.chunk_bytes = chunk_bytes
        self.poll_timeout_ms = poll_timeout_ms
        self.shared_memory = (shm.enabled_by_env() and shm.supported()
                              if shared_memory is None
                              else bool(shared_memory))
        self.max_held_buffers = max_held_buffers
        self.lend_buffers = lend_buffers
        self.deterministic_sums = deterministic_sums


class RequestError(Exception):
    """A well-formed request the shard refuses (answered with ERROR)."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


class NoRoomError(RequestError):
    """A request refused for lack of memory within max_table_bytes."""
