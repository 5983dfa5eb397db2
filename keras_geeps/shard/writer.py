"""`CheckpointWriter`: writes a shard's checkpoints beside its serve loop.

One checkpoint is written at a time, in a thread, from snapshots the serve
loop took (`Table.snapshot`), so serving goes on while the disk works. A
write that fails is retried after 1, 2, 4 ... 60 s, not every turn of the
loop. CHECKPOINT requests wait here for the next write that starts after
them, and learn how it went from `finished`.
"""

import collections
import fcntl
import logging
import os
import threading
import time

from keras_geeps import checkpoint
from keras_geeps.shard.settings import RequestError

log = logging.getLogger("keras_geeps.shard")

# How many CHECKPOINT requests may wait for the writer; more are refused.
MAX_CHECKPOINT_REQUESTS = 64
# The longest wait before retrying a checkpoint whose write failed.
WRITER_BACKOFF_MAX_S = 60.0
# How long a stopping shard waits for the checkpoint being written.
WRITER_JOIN_S = 60.0

# What a finished write did: `written` maps each table id it wrote to the
# clock of that table's rows (empty when it failed); `ok` says it
# succeeded; `requests` are the (identity, seq) of the CHECKPOINT requests
# it answers.
Written = collections.namedtuple("Written", "written ok requests")


class CheckpointWriter:
    """One shard's checkpoints in `directory`, written one at a time.

    Args:
        directory: the checkpoint folder (`checkpoint.checkpoint_path`
            names this shard's file in it).
        shard_id: this shard's index.
        num_shards: the job's shard count.
        num_workers: the job's worker count.

    Example:

    >>> import tempfile
    >>> writer = CheckpointWriter(tempfile.mkdtemp(), shard_id=0,
    ...                           num_shards=1, num_workers=2)
    >>> writer.write_empty()  # before serving
    >>> writer.request(b"worker-0", seq=7)  # a CHECKPOINT request
    >>> writer.due()
    True
    >>> writer.start({}, left=())  # {table id: (spec, clock, rows)}
    >>> writer.join(10)
    >>> writer.finished()
    Written(written={}, ok=True, requests=[(b'worker-0', 7)])
    """

    def __init__(self, directory, shard_id, num_shards, num_workers):
        self.directory = os.path.abspath(directory)  # (checkpoint_path)
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.requests = []   # (identity, seq) waiting for a write
        # The workers that left, and those declared dead, as the last
        # checkpoint written holds them.
        self.left_written = self.dead_written = frozenset()
        self._thread = None
        self._covers = 0     # how many of `requests` the write covers
        self._backoff = 0.0  # after failed writes: seconds to wait
        self._retry_at = 0.0
        self._lock = None    # the descriptor holding the folder's lock

    def lock(self):
        """Takes this shard's lock of the folder (`<shard file>.lock`, an
        exclusive `flock`, which the system drops when the process dies),
        before anything is read or written there: another job's shard of
        the same place, started on the same folder, would move this one's
        checkpoint away and the two would overwrite each other's.

        Raises:
            checkpoint.CheckpointError: another process (or shard server
                in this one) holds it, or the folder cannot be written.
        """
        path = checkpoint.checkpoint_path(
            self.directory, self.shard_id, self.num_shards)[
                :-len(".ckpt.npz")] + ".lock"
        try:
            checkpoint.make_folder(self.directory)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise checkpoint.CheckpointError(
                f"cannot write checkpoints to {self.directory}: "
                f"{exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise checkpoint.CheckpointError(
                f"{self.directory} is in use by another shard "
                f"{self.shard_id} of {self.num_shards} (process "
                f"{holder or '?'}, holding {path}): give each job its "
                f"own --checkpoint-dir") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock = fd

    def unlock(self):
        """Lets the folder's lock go (the shard is closing)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def request(self, identity, seq):
        """Queues a CHECKPOINT request for the next write to answer.

        Raises:
            RequestError: MAX_CHECKPOINT_REQUESTS already wait.
        """
        if len(self.requests) >= MAX_CHECKPOINT_REQUESTS:
            raise RequestError(f"{len(self.requests)} checkpoint requests "
                               f"already wait for the one being written")
        self.requests.append((identity, seq))

    def due(self):
        """Whether a write may start now: none is under way, and a failed
        one's backoff has passed."""
        return self._thread is None and time.monotonic() >= self._retry_at

    def start(self, snapshots, left, dead=(), own_clock=()):
        """Writes `snapshots` ({table id: (spec, clock, rows)}), the
        workers that `left` and those declared `dead` in a thread; it
        answers every request queued so far. `own_clock`: the tables
        snapshotted at this shard's own clock (`checkpoint.write`)."""
        left, dead = frozenset(left), frozenset(dead)
        thread = threading.Thread(target=self._write,
                                  args=(snapshots, sorted(left),
                                        sorted(dead), set(own_clock)),
                                  daemon=True,
                                  name=f"geeps-ckpt-{self.shard_id}")
        thread.written, thread.ok = {}, False
        thread.left, thread.dead = left, dead
        self._covers = len(self.requests)
        self._thread = thread
        thread.start()

    def finished(self):
        """The `Written` of a write that ended since the last call, else
        None."""
        thread = self._thread
        if thread is None or thread.is_alive():
            return None
        self._thread = None
        if thread.ok:
            self.left_written, self.dead_written = thread.left, thread.dead
        self._backoff = 0.0 if thread.ok else min(
            WRITER_BACKOFF_MAX_S, max(1.0, 2 * self._backoff))
        self._retry_at = time.monotonic() + self._backoff
        answered = self.requests[:self._covers]
        del self.requests[:self._covers]
        return Written(thread.written, thread.ok, answered)

    def join(self, timeout=WRITER_JOIN_S):
        """Waits up to `timeout` s (default WRITER_JOIN_S) for the write
        under way; logs one that does not end in time."""
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("shard %d: the checkpoint being written did not "
                      "finish within %g s", self.shard_id, timeout)

    def _write(self, snapshots, left, dead, own_clock):
        thread = threading.current_thread()
        try:
            checkpoint.write(self.directory, self.shard_id, self.num_shards,
                             self.num_workers, snapshots, left, dead,
                             own_clock)
            thread.written = {tid: clock
                              for tid, (_, clock, _) in snapshots.items()}
            thread.ok = True
        except OSError:
            log.exception("shard %d: writing the checkpoint failed",
                          self.shard_id)

    def write_empty(self):
        """Writes a checkpoint of no tables, before serving: a shard killed
        before it wrote any table restores empty (its workers then create
        the tables again and replay), while --restore from a folder that
        never held this shard's checkpoint still fails, naming it. The
        checkpoints holding tables found there (a restart that forgot
        --restore), the latest and the one before it (`.older`, what
        `align-checkpoints` may take a table back to), are kept as
        `<file>.previous`, or `.previous.1`, `.2` ... where that exists,
        both with the same suffix: a second forgetful restart never
        replaces them.

        Raises:
            checkpoint.CheckpointError: the folder cannot be written.
        """
        path = checkpoint.checkpoint_path(self.directory, self.shard_id,
                                          self.num_shards)
        older = checkpoint.checkpoint_path(self.directory, self.shard_id,
                                           self.num_shards, older=True)
        try:
            self.remove_leftovers()
            found = [name for name in (path, older)
                     if os.path.exists(name) and _holds_tables(name)]
            if found:
                suffix = _free_suffix((path, older))  # (a pair's)
                for name in found:
                    os.replace(name, name + suffix)
                log.warning("shard %d: started without --restore; moved the "
                            "checkpoints there to %s", self.shard_id,
                            ", ".join(name + suffix for name in found))
            for name in (path, older):  # ones of no tables: nothing lost
                if os.path.exists(name):
                    os.unlink(name)
            checkpoint.write(self.directory, self.shard_id, self.num_shards,
                             self.num_workers, {})
        except OSError as exc:
            raise checkpoint.CheckpointError(
                f"cannot write checkpoints to {self.directory}: "
                f"{exc}") from exc

    def remove_leftovers(self):
        """Removes this shard's checkpoints that a crash left half written
        (temporary files no rename took)."""
        prefix = checkpoint.temporary_prefix(self.shard_id, self.num_shards)
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(prefix):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass


def _holds_tables(path):
    """Whether the checkpoint at `path` holds a table (an unreadable or
    foreign one counts as holding some: it is kept, not overwritten)."""
    try:
        return checkpoint.read_meta(path).get("tables") != {}
    except checkpoint.CheckpointError:
        return True


def _free_suffix(paths):
    """".previous", or ".previous.1", ".2" ... the first that no path of
    `paths` with it added names an existing file."""
    suffix, n = ".previous", 0
    while any(os.path.exists(path + suffix) for path in paths):
        n += 1
        suffix = f".previous.{n}"
    return suffix
