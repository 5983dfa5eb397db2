"""The moving parts of memory management: host store, pool, ledger, threads.

- `DeviceLedger` counts the bytes the memory manager holds on the device,
  by category (resident tables, access pool, saved activations), with the
  peak; with an audit function it also measures the real storage after
  every change and records any disagreement.
- `AccessPool` is the double-buffered access pool as flow control: a
  staged access reserves its bytes before it is brought in and releases
  them when it leaves, and a reservation waits while the pool is full.
- `Worker` is a background thread running queued jobs in order: one brings
  staged data in ahead of use (the prefetcher), one writes updated data
  back out (the writer), so both overlap with the training thread's
  compute.
- `empty_variable` / `assign_variable` give a TensorFlow variable's storage
  back and take new storage without copying (see their docstrings).
"""

import collections
import queue
import threading
import time
import warnings

import numpy as np
import tensorflow as tf

from keras_geeps.checks import check_count, check_seconds
from keras_geeps.errors import GeePSError

CATEGORIES = ("resident", "pool", "activations", "materialized")


def tensor_bytes(tensor):
    """Bytes of a tensor's data."""
    return int(np.prod(tensor.shape, dtype=np.int64)) * tensor.dtype.size


# -------------------------------------------------------------- variables
# A tf.Variable's shape is fixed when it is created, and TensorFlow has no
# public call that frees its storage. The AssignVariableOp kernel, though,
# takes `validate_shape=False` (what variables created with an unknown shape
# use): assigning a 0-element tensor that way drops the variable's buffer
# (returned to the device allocator), and assigning the real value later
# gives it storage again. Only these two functions do it; between the two
# the variable must not be read (the trainer never does: it fills a staged
# layer's variables before any use). `stored_bytes` reads the size of the
# storage a variable really holds (VariableShape reads the runtime shape,
# not the static one), which is what the ledger's audit sums.
def empty_variable(variable):
    """Gives `variable`'s storage back (it then holds 0 elements)."""
    # Of unknown static shape, else a graph's shape check refuses it.
    empty = tf.raw_ops.PlaceholderWithDefault(
        input=tf.zeros([0], variable.dtype), shape=tf.TensorShape(None))
    tf.raw_ops.AssignVariableOp(resource=variable.handle, value=empty,
                                validate_shape=False)


def assign_variable(variable, value):
    """Gives `variable` the storage of `value` (shape checked by the caller).

    Inside a `tf.function`, when `value` is an intermediate (e.g. a
    `swap_in` output), the variable adopts its buffer: no copy.
    """
    tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value,
                                validate_shape=False)


def stored_bytes(variables):
    """Bytes the variables' storage really holds right now (a tensor)."""
    total = tf.constant(0, tf.int64)
    for v in variables:
        shape = tf.raw_ops.VariableShape(input=v.handle, out_type=tf.int64)
        total += tf.reduce_prod(shape) * v.dtype.size
    return total


# -------------------------------------------------------------- ledger
class DeviceLedger:
    """Bytes the memory manager holds on the device, by category, with peaks.

    Args:
        audit: optional callable returning the bytes really held right now
            (measured, not counted). When given, every change is followed by
            a measurement; `audit_peak` is the largest measured, and
            `mismatches` lists (counted, measured, what) whenever the two
            disagree. Defaults to None.
    """

    def __init__(self, audit=None):
        self.lock = threading.RLock()
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        self.peak_by_category = dict.fromkeys(CATEGORIES, 0)
        self.audit = audit
        self.audit_peak = 0
        self.audits = 0
        self.mismatches = []

    @property
    def current(self):
        return sum(self.bytes[c] for c in CATEGORIES if c != "materialized")

    def change(self, category, delta, what=""):
        """Adds `delta` bytes to `category` (call after the memory moved)."""
        with self.lock:
            value = self.bytes[category] + int(delta)
            if value < 0:  # refused: the count stays as it was
                raise GeePSError(f"ledger: {category} would go negative "
                                 f"({value:,} bytes) at {what!r}")
            self.bytes[category] = value
            self.peak_by_category[category] = max(
                self.peak_by_category[category], self.bytes[category])
            self.peak_bytes = max(self.peak_bytes, self.current)
            if self.audit is not None:
                self.check(what)

    def check(self, what=""):
        """Measures the real bytes now and compares them with the count."""
        with self.lock:
            measured = int(self.audit())
            self.audits += 1
            # Materialized layers are outside the budget: not in the peak.
            outside = self.bytes["materialized"]
            self.audit_peak = max(self.audit_peak, measured - outside)
            counted = self.current + outside
            if measured != counted:
                self.mismatches.append((counted, measured, what))
            return measured

    def figures(self):
        with self.lock:
            return {"device_bytes": self.current,
                    "peak_device_bytes": self.peak_bytes,
                    **{f"peak_{c}_bytes": self.peak_by_category[c]
                       for c in CATEGORIES},
                    "audit_peak_bytes": self.audit_peak,
                    "audits": self.audits,
                    "audit_mismatches": len(self.mismatches)}


# -------------------------------------------------------------- pool
class AccessPool:
    """The access pool: reservations of device bytes, bounded by `capacity`.

    Args:
        capacity: the pool's size in bytes (the plan's `pool_bytes`).
        timeout: seconds a reservation may wait. Defaults to 600.
    """

    def __init__(self, capacity, timeout=600.0):
        check_count("capacity", capacity, 0)
        check_seconds("timeout", timeout)
        self.capacity = int(capacity)
        self.timeout = timeout
        self.reserved = 0
        self.peak = 0
        self.wait_seconds = 0.0
        self._cond = threading.Condition()
        self._closed = False

    def reserve(self, nbytes, what=""):
        nbytes = int(nbytes)
        if nbytes < 0:  # would let later reservations pass the capacity
            raise GeePSError(f"access pool: {what!r} cannot reserve "
                             f"{nbytes:,} bytes")
        if nbytes > self.capacity:
            raise GeePSError(f"access pool: {what!r} needs {nbytes:,} bytes, "
                             f"more than the pool's {self.capacity:,}")
        started = time.perf_counter()
        deadline = started + self.timeout
        with self._cond:
            while self.reserved + nbytes > self.capacity and not self._closed:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise GeePSError(
                        f"access pool: {what!r} waited {self.timeout:.0f} s "
                        f"for {nbytes:,} bytes ({self.reserved:,} of "
                        f"{self.capacity:,} reserved)")
                self._cond.wait(min(remaining, 1.0))
            if self._closed:
                raise GeePSError("access pool closed")
            self.reserved += nbytes
            self.peak = max(self.peak, self.reserved)
        self.wait_seconds += time.perf_counter() - started

    def release(self, nbytes):
        nbytes = int(nbytes)
        if nbytes < 0:  # would reserve past the capacity unchecked
            raise GeePSError(f"access pool: cannot release {nbytes:,} bytes")
        with self._cond:
            if nbytes > self.reserved:
                raise GeePSError(f"access pool: cannot release {nbytes:,} "
                                 f"bytes, {self.reserved:,} are reserved")
            self.reserved -= nbytes
            self._cond.notify_all()

    def close(self):
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# -------------------------------------------------------------- threads
class Job:
    """A queued piece of work; `wait()` returns its result or raises."""

    __slots__ = ("fn", "what", "done", "result", "error")

    def __init__(self, fn, what):
        self.fn = fn
        self.what = what
        self.done = threading.Event()
        self.result = None
        self.error = None

    def wait(self, timeout=600.0):
        if not self.done.wait(timeout):
            raise GeePSError(f"{self.what} did not finish within "
                             f"{timeout:.0f} s")
        if self.error is not None:
            raise GeePSError(f"{self.what} failed: {self.error}") \
                from self.error
        return self.result


class Worker:
    """A background thread running submitted jobs one after another.

    TensorFlow releases the GIL while an op runs, so a job's copies overlap
    with the training thread's ops (on a GPU they run on TensorFlow's copy
    streams).

    Args:
        name: the thread's name.
        device: the `tf.device` the jobs run under. Defaults to None.
    """

    def __init__(self, name, device=None):
        self.device = device
        self._closed = False
        self._queue = queue.Queue()
        self._pending = collections.deque()
        self._thread = threading.Thread(target=self._run, name=name,
                                        daemon=True)
        self._thread.start()

    def submit(self, fn, what=""):
        if self._closed:
            raise GeePSError(f"{self._thread.name}: closed, cannot run "
                             f"{what or fn!r}")
        job = Job(fn, what)
        self._pending.append(job)
        self._queue.put(job)
        return job

    def _run(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self.device is not None:
                    with tf.device(self.device):
                        job.result = job.fn()
                else:
                    job.result = job.fn()
            except BaseException as exc:  # reported to whoever waits
                job.error = exc
            finally:
                # The job stays referenced (pending, and by whoever waits on
                # it) until the step ends: what its function holds (e.g. a
                # device tensor) must not stay alive with it. Cleared before
                # `done` is set, so a waiter never sees it still held.
                job.fn = None
                job.done.set()
            del job

    def drain(self, timeout=600.0):
        """Waits for every submitted job; raises the first failure."""
        error = None
        while self._pending:
            job = self._pending.popleft()
            try:
                job.wait(timeout)
            except GeePSError as exc:
                error = error or exc
        if error is not None:
            raise error

    def close(self, timeout=10.0):
        """Stops the thread after the jobs submitted so far; warns if one
        is still running after `timeout` seconds (the thread is a daemon:
        it does not keep the process alive)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            warnings.warn(f"{self._thread.name}: a job was still running "
                          f"{timeout:.0f} s after close()", RuntimeWarning,
                          stacklevel=2)


# -------------------------------------------------------------- host store
class HostStore:
    """Host-memory copies of the staged layers' variables (pinned on a GPU).

    One list of host tensors per layer: its parameters, then its optimizer
    state, in the layer's variable order.
    """

    def __init__(self):
        self._tensors = {}

    def put(self, unit, tensors):
        self._tensors[unit] = list(tensors)

    def get(self, unit):
        return self._tensors[unit]

    def __contains__(self, unit):
        return unit in self._tensors

    @property
    def nbytes(self):
        return sum(tensor_bytes(t) for ts in self._tensors.values()
                   for t in ts)
