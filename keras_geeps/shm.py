"""Shared memory between a worker and a shard on the same host.

GeePS notes that traffic to a co-located shard can skip the network. Here a
worker and a shard on one host hand each other row buffers through shared
memory instead of copying them through loopback TCP: a shard's fresh rows
are read where the shard wrote them, a worker's update where the worker put
it. Only a small message crosses the socket.

Buffers are anonymous memory files (`os.memfd_create`), opened by the peer
through `/proc/<pid>/fd/<fd>`. Nothing is named in `/dev/shm`, so a killed
process leaks nothing: the kernel frees a buffer when its last descriptor
and mapping are gone. Only a process that may open the owner's `/proc`
entries (the same user, the same pid namespace) can map them; a handshake
proves it before any buffer is used: the owner shares a probe buffer
holding a random token and the peer reads it back. Peers that fail it (other
hosts, other containers) simply keep using TCP frames.

Every memory file an arena makes is named after its role ("worker" or
"shard"), its random token and the buffer's number, and a peer maps only
files of exactly that name: a peer that names some other process's memory
file, whose contents it happens to know (zeros, or rows it wrote itself),
as its probe or its buffer cannot make us read that process's memory. A
shard's token is told to every worker it welcomes, so the role matters too:
a shard maps only worker buffers, never another shard's.

Every buffer is sealed against shrinking (`F_SEAL_SHRINK`) before a peer
sees it, and a reader refuses unsealed ones (the seal is checked before the
size), huge-page files, and files larger than it was told to map: a peer
cannot truncate memory we have mapped and so crash us with SIGBUS, nor use
up our address space.

Set `KERAS_GEEPS_SHM=0` to turn shared memory off everywhere.

Example:

>>> arena = Arena()
>>> buffer = arena.allocate(1024)
>>> peer = PeerBuffers.connect(arena.describe())
>>> buffer.array[:4] = [1, 2, 3, 4]
>>> bytes(peer.view(buffer.ref(0, 4)))
b'\\x01\\x02\\x03\\x04'
>>> arena.close()
"""

import fcntl
import itertools
import logging
import mmap
import os
import reprlib
import stat
import threading
import weakref
from collections import OrderedDict

import numpy as np

log = logging.getLogger("keras_geeps.shm")

TOKEN_BYTES = 16
ENV_SWITCH = "KERAS_GEEPS_SHM"
ROLES = ("worker", "shard")
PROBE_ID = 0  # the probe's buffer number


def enabled_by_env():
    """False when `KERAS_GEEPS_SHM=0` turns shared memory off."""
    return os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no")


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _check_role(role):
    if role not in ROLES:
        raise ValueError(f"an arena's role is one of {ROLES}, not {role!r}")
    return role


def buffer_name(role, token, buffer_id):
    """The memory file name of buffer `buffer_id` of an arena (`token`:
    bytes)."""
    return f"keras_geeps-{role}-{token.hex()}-{buffer_id}"


def supported():
    """Whether this platform has memfd files and a /proc to open them by."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SharedBuffer:
    """One memfd-backed buffer of this process, shareable with peers.

    Attributes:
        id: its number within the arena (never reused).
        fd: the descriptor peers open through /proc.
        array: a writable uint8 numpy view of all of it.
    """

    __slots__ = ("id", "fd", "array", "_mmap", "__weakref__")

    def __init__(self, buffer_id, nbytes, name=None):
        self.id = buffer_id
        self.fd = os.memfd_create(name or f"keras_geeps-{buffer_id}",
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, max(nbytes, 1))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            self._mmap = mmap.mmap(self.fd, max(nbytes, 1))
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._mmap, np.uint8, count=nbytes)

    @property
    def nbytes(self):
        return self.array.nbytes

    def ref(self, offset, nbytes):
        """The wire reference to `nbytes` of this buffer from `offset`."""
        return [self.id, self.fd, int(offset), int(nbytes)]

    def close(self):
        """Closes the descriptor; the memory goes once no view is left."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def unmap(self):
        """Closes the descriptor and the mapping (with the descriptor
        `mmap` keeps of its own) at once: for a buffer of which no view
        but `array` was made, which is gone after."""
        self.close()
        self.array = None
        self._mmap.close()


def _raise_fd_limit():
    """Every shared buffer keeps a descriptor open (peers open it through
    /proc): lift the soft limit on open files to the hard one."""
    try:
        import resource  # noqa: PLC0415 (POSIX only)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (
                hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError) as exc:
        log.debug("could not raise the open-files limit: %s", exc)


class Arena:
    """The buffers this process shares with co-located peers.

    `allocate` raises OSError when the process runs out of descriptors or
    memory; callers then send that buffer's rows over TCP.

    Args:
        role: "worker" or "shard": what this process is to its peers (a
            peer checks it). Defaults to "worker".
    """

    def __init__(self, role="worker"):
        _raise_fd_limit()
        self.role = _check_role(role)
        self.token = os.urandom(TOKEN_BYTES)
        self._ids = itertools.count(PROBE_ID + 1)
        self._probe = SharedBuffer(PROBE_ID, TOKEN_BYTES, self._name(
            PROBE_ID))
        self._probe.array[:] = np.frombuffer(self.token, np.uint8)
        self._buffers = weakref.WeakSet()

    def _name(self, buffer_id):
        return buffer_name(self.role, self.token, buffer_id)

    def describe(self):
        """What a peer needs to verify and map our buffers (a flat list)."""
        return [os.getpid(), _boot_id(), self._probe.fd, self.token.hex()]

    def allocate(self, nbytes):
        """A new `SharedBuffer` of `nbytes`."""
        buffer_id = next(self._ids)
        buffer = SharedBuffer(buffer_id, nbytes, self._name(buffer_id))
        self._buffers.add(buffer)
        return buffer

    def close(self):
        for buffer in list(self._buffers):
            buffer.close()
        if self._probe.array is not None:
            self._probe.unmap()  # (only describe() reads it: its fd)


class _Hold:
    """Keeps a mapped region alive; its finalizer says when it is unused.
    `writable` sets numpy's writeable flag on views made from it."""

    def __init__(self, array, writable=False):
        self.array = array
        interface = array.__array_interface__
        if writable:
            interface = dict(interface, data=(array.ctypes.data, False))
        self.__array_interface__ = interface


class PeerBuffers:
    """Maps a verified co-located peer's buffers.

    Mappings are cached and reused when the peer recycles a buffer, so they
    must never hold pages of their own: they are read-only, or shared and
    writable for a buffer the peer lends us to write into, never
    copy-on-write (a private copy written once would keep showing those
    stale pages after the peer rewrote the buffer). Read-only views are
    read-only numpy arrays; `writable_alias` serves consumers that need the
    flag but only read.

    Args:
        pid: the peer's process id.
        token: the peer's probe token (bytes).
        role: the peer's role ("worker" or "shard"): only memory files its
            arena named are mapped. Defaults to "worker".
        cache: how many mapped buffers to keep (a shard maps up to 5 upload
            buffers per table and worker). Defaults to 4096.
        max_mapped_bytes: the most bytes of the peer's files mapped at once:
            a larger file is refused, and the least recently used mappings
            are dropped to make room. Defaults to None (no limit).
    """

    def __init__(self, pid, token, role="worker", cache=4096,
                 max_mapped_bytes=None):
        self.pid = pid
        self.token = token
        self.role = _check_role(role)
        self._cache = OrderedDict()  # (buffer id, writable) -> (fd, array)
        self._cache_size = cache
        self._max_mapped = max_mapped_bytes
        self._mapped = 0  # bytes of the cached mappings
        self._lock = threading.Lock()
        self.probe_fd = None  # the descriptor `connect` verified

    def alive(self):
        """Whether the peer still holds the memory `connect` verified: False
        once its process is gone (its buffers can no longer be mapped)."""
        where = f"/proc/{self.pid}/fd"
        if self.probe_fd is not None:
            where += f"/{self.probe_fd}"
        return os.path.exists(where)

    @classmethod
    def connect(cls, description, role="worker", max_mapped_bytes=None):
        """Verifies a peer's `Arena.describe()`; None if we cannot map it.

        Args:
            description: what the peer's `Arena.describe()` returned.
            role: the role the peer's arena must have. Defaults to "worker".
            max_mapped_bytes: as for `PeerBuffers`. Defaults to None.
        """
        if not supported() or not isinstance(description, list) or \
                len(description) != 4:
            return None
        pid, boot, probe_fd, token_hex = description
        try:
            token = bytes.fromhex(token_hex)
            if boot != _boot_id() or not boot or len(token) != TOKEN_BYTES:
                return None
            peer = cls(int(pid), token, role,
                       max_mapped_bytes=max_mapped_bytes)
            probe = peer._map(int(probe_fd), TOKEN_BYTES, buffer_id=PROBE_ID)
            if probe[:TOKEN_BYTES].tobytes() != token:
                return None
            peer.probe_fd = int(probe_fd)
            return peer
        except (OSError, ValueError, TypeError, OverflowError) as exc:
            # (a pid or fd of inf: OverflowError)
            log.debug("no shared memory with pid %s: %s", pid, exc)
            return None

    def _map(self, fd, nbytes, writable=False, buffer_id=None):
        path = f"/proc/{self.pid}/fd/{fd}"
        # Only a memfd is opened: opening what a peer names could have side
        # effects (a device, a FIFO). The check after opening stays, as the
        # descriptor can change between the two. And only one of the peer's
        # arena, of the number it was named by (see the module's notes).
        link = os.readlink(path)
        if not link.startswith("/memfd:"):
            raise ValueError(f"{path} is not a memory file")
        name = buffer_name(self.role, self.token, buffer_id)
        if link not in (f"/memfd:{name}", f"/memfd:{name} (deleted)"):
            raise ValueError(f"{path} is not buffer {buffer_id} of the "
                             f"peer's arena")
        # O_NONBLOCK: a peer naming a FIFO must not block us.
        handle = os.open(path, (os.O_RDWR if writable else os.O_RDONLY)
                         | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(handle).st_mode):
                raise ValueError(f"{path} is not a memory file")
            try:
                seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise ValueError(f"{path} is not sealed against shrinking")
            # The size only after the seal: it can no longer shrink below
            # what we map (a read past the end would be SIGBUS).
            info = os.fstat(handle)
            if info.st_size < nbytes or info.st_size == 0:
                raise ValueError(f"{path} holds {info.st_size} bytes, "
                                 f"fewer than {nbytes}")
            if os.fstatvfs(handle).f_bsize != mmap.PAGESIZE:
                # Huge pages: a read of a hole the peer punched can fault.
                raise ValueError(f"{path} is not in ordinary pages")
            if self._max_mapped is not None and \
                    info.st_size > self._max_mapped:
                raise ValueError(f"{path} holds {info.st_size} bytes, more "
                                 f"than the {self._max_mapped} this peer may "
                                 f"have mapped")
            mapped = mmap.mmap(handle, info.st_size, access=(
                mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ))
        finally:
            os.close(handle)
        return np.frombuffer(mapped, np.uint8)

    def view(self, ref, writable=False):
        """The bytes a wire reference names, as a uint8 array.

        Args:
            ref: [buffer id, fd, offset, nbytes] from `SharedBuffer.ref`.
            writable: map the buffer for writing (one the peer lent us to
                write into). Defaults to False.

        Returns:
            A uint8 numpy array, read-only unless `writable` (see `hold` to
            learn when it and its views are gone).

        Raises:
            ValueError: naming what is wrong with the reference.
        """
        if not (isinstance(ref, list) and len(ref) == 4
                and all(isinstance(v, int) and not isinstance(v, bool)
                        for v in ref)):
            raise ValueError(f"a shared-memory reference is [buffer, fd, "
                             f"offset, nbytes], got "
                             f"{reprlib.repr(ref):.80}")
        buffer_id, fd, offset, nbytes = ref
        if buffer_id < 1 or fd < 0 or offset < 0 or nbytes < 0:
            raise ValueError(f"bad shared-memory reference {ref}")
        key = (buffer_id, writable)
        with self._lock:
            cached = self._cache.get(key)
            if cached is None or cached[0] != fd:
                try:
                    cached = (fd, self._map(fd, offset + nbytes, writable,
                                            buffer_id))
                except OSError as exc:
                    raise ValueError(f"cannot map buffer {buffer_id} of "
                                     f"pid {self.pid}: {exc}") from None
                self._uncache(key)
                self._cache[key] = cached
                self._mapped += cached[1].nbytes
                while len(self._cache) > self._cache_size or (
                        self._max_mapped is not None
                        and self._mapped > self._max_mapped):
                    self._uncache(next(iter(self._cache)))
            else:
                self._cache.move_to_end(key)
        whole = cached[1]
        if offset + nbytes > whole.nbytes:
            raise ValueError(f"reference {ref} reaches beyond buffer "
                             f"{buffer_id}'s {whole.nbytes} bytes")
        return whole[offset:offset + nbytes]

    def _uncache(self, key):
        """Forgets a cached mapping (unmapped once no view of it is left)."""
        dropped = self._cache.pop(key, None)
        if dropped is not None:
            self._mapped -= dropped[1].nbytes

    @staticmethod
    def writable_alias(array):
        """`array`'s memory with numpy's writeable flag set.

        DLPack cannot export read-only arrays, yet TensorFlow only reads
        the pulled rows it aliases. The memory stays mapped read-only: a
        write through the alias faults instead of corrupting anything.
        The alias keeps `array` (and so its hold) alive.
        """
        return np.asarray(_Hold(array, writable=True))

    def rows(self, ref, dtype, width, on_release=None, writable=False):
        """The (rows, width) array of `dtype` a wire reference names.

        Args:
            ref: [buffer id, fd, offset, nbytes] from `SharedBuffer.ref`.
            dtype: the table's dtype.
            width: the table's row width.
            on_release: called once no view of the rows is left (see
                `hold`). Defaults to None: not tracked.
            writable: as for `view`. Defaults to False.

        Raises:
            ValueError: naming what is wrong with the reference, or that it
                does not name whole, aligned rows.
        """
        raw = self.view(ref, writable)
        dtype = np.dtype(dtype)
        if raw.nbytes % (width * dtype.itemsize) or \
                raw.ctypes.data % dtype.itemsize:
            raise ValueError(f"a reference of {raw.nbytes} bytes is not "
                             f"whole rows of {width} {dtype.name}")
        if on_release is not None:
            raw = self.hold(raw, on_release)
        return raw.view(dtype).reshape(-1, width)

    @staticmethod
    def hold(array, on_release):
        """A view of `array` that calls `on_release()` once it and every
        view made from it (including DLPack exports) are gone."""
        holder = _Hold(array)
        weakref.finalize(holder, on_release)
        return np.asarray(holder)
