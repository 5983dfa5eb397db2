"""The sealed data channel: AEGIS-256X4 messages keyed by a CURVE handshake.

libzmq's CURVE encrypts every byte with salsa20-poly1305 in its I/O
threads, at well under half the plain bulk throughput of a link (see
benchmarks/RESULTS.md). With CURVE keys, a worker therefore says HELLO to a
shard over the CURVE socket only: ZeroMQ's ZAP authenticates it there, and
the WELCOME (encrypted by CURVE) hands it a session: a routing id, one
fresh random 256-bit key per direction and the port of the shard's data
socket. Every later message of either side travels on that plain TCP
socket, each frame sealed with AEGIS-256X4, the AEAD of the CFRG's AEGIS
draft (libaegis through the `pyaegis` package: AES-NI/VAES, about 30 GB/s
per core here, three times OpenSSL's AES-256-GCM), so the bulk rows cost
one cheap cipher pass per side. The data socket admits only connections
that name a live session and its random token, one connection per token
(ZAP, `auth.ShardAuth.apply_session_check`); heartbeats stay on CURVE.

A sealed message is the frames

    [MAGIC, session id, counter (8 bytes, little endian), sealed frame...]

where each sealed frame is `ciphertext || 32-byte tag` of one frame of
`protocol.encode(message)`, with nonce `counter || frame index (4 bytes)`
(zero-padded to 32 bytes) and associated data `MAGIC || session id ||
counter || frame count`. The sender's counter grows by one per message and
a receiver accepts only the counter after the last it accepted: a frame
cannot be altered, dropped, reordered, moved to another message or session,
or replayed without the tag failing or the counter check refusing it, and
a whole message cannot go missing unnoticed (`SealGap`: the next one
tells, and its owner starts the session over, resending what was lost). Keys
live only in the two processes' memory, and a new session (every HELLO)
gets new ones, so no (key, nonce) pair is ever used twice.

A received frame is opened in place, where ZeroMQ put it (as plain frames
are used where they arrive), or where its reader wants the rows
(`Channel.open(defer=True)` and `SealedFrame`: a worker opens a push that
a read waits for straight into the read's buffer, and a shard an update
straight into the clock's rows not written yet, so the cipher's pass is
also the copy or write that would follow); sealing writes into buffers
reused once ZeroMQ has let go of them (`Buffers`: one pool per thread, at
most 32 MiB kept), and only a few large messages ahead of the wire
(`Sender`): sealing a whole 16 MB reply at once keeps a core from the
copies that move it.

Example:

>>> keys = new_session()
>>> worker = Channel(keys["session"], keys["c2s"], keys["s2c"])
>>> shard = Channel(keys["session"], keys["s2c"], keys["c2s"])
>>> sealed = worker.seal([b"header", np.arange(4, dtype=np.float32)])
>>> [bytes(f) for f in shard.open(sealed)][0]
b'header'
"""

import collections
import os
import sys
import time

import numpy as np

from keras_geeps.protocol import aligned_empty, frame_view

MAGIC = b"GS2"  # GS1: AES-256-GCM with 16-byte tags
CIPHER = "aegis256x4"
TAG_BYTES = 32
KEY_BYTES = 32
NONCE_BYTES = 32
SESSION_BYTES = 8
# A `Sender` seals a session's next message only while ZeroMQ still holds
# fewer than this many of its large sealed messages (2 MB row chunks: a
# few ms of wire ahead), and a paced loop looks again every PACE_S seconds.
# A sender that moved nothing for STALLED_S (a reader that stopped
# reading) is looked at every STALLED_PACE_S instead.
IN_FLIGHT = 3
PACE_S = 0.0002
STALLED_S = 0.05
STALLED_PACE_S = 0.01


class SealError(Exception):
    """A sealed message that does not open: forged, altered or replayed."""


class SealGap(SealError):
    """A genuine sealed message whose counter skips some: the messages in
    between were lost (a connection that broke and came back, or one that
    did not open), so the session cannot go on without losing them."""


INSTALL_HINT = ("pip install 'keras-geeps[curve]' (or "
                "'pyaegis>=0.3.1,<0.4')")


def _aegis():
    """pyaegis's cffi bindings of libaegis: (ffi, lib), initialised."""
    try:
        from pyaegis._aegis_ffi import ffi, lib  # noqa: PLC0415
        for name in ("encrypt", "decrypt"):
            getattr(lib, f"{CIPHER}_{name}")
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"keras_geeps: CURVE keys need the `pyaegis` package (0.3.x) for "
            f"the sealed data channel: {INSTALL_HINT} ({exc})") from exc
    lib.aegis_init()  # picks the CPU's fastest implementation (idempotent)
    return ffi, lib


def require():
    """Raises ImportError, naming what to install, without `pyaegis`."""
    _aegis()


def new_session():
    """A fresh session: its routing id and one key per direction (bytes).

    Returns:
        dict with "session" (SESSION_BYTES, first byte never 0: ZeroMQ
        reserves those routing ids), "c2s" and "s2c" (KEY_BYTES each).
    """
    session = b"S" + os.urandom(SESSION_BYTES - 1)
    return {"session": session, "c2s": os.urandom(KEY_BYTES),
            "s2c": os.urandom(KEY_BYTES)}


class Buffers:
    """Sealed frames' buffers, reused once nothing else refers to them.

    ZeroMQ holds a frame sent without copying until it is on the wire, so
    sealed buffers are many and short-lived; a fresh one costs page faults
    and cache misses on its first write (sealing 2 MB into one is ~1.5x
    slower than into a reused one). A buffer is handed out again only when
    nothing but this pool holds it or its memory: its reference counts and
    its base's equal those of a probe array held by nothing else, measured
    by the same code (so the interpreter's way of counting, e.g. 3.14's
    borrowed references, does not matter). Frames under ZeroMQ's copy
    threshold are copied by pyzmq anyway and are not pooled. One pool
    serves all the channels of one thread (a shard's serve loop, a worker's
    I/O thread); it must not be shared between threads.

    Args:
        max_bytes: the most bytes kept for reuse. Defaults to 32 MiB.
    """

    MIN_BYTES = 1 << 16  # pyzmq's copy threshold for copy=False sends

    def __init__(self, max_bytes=32 << 20):
        self._arrays = []
        self.max_bytes = max_bytes
        self._free = self._references([aligned_empty(1)])[0]

    @staticmethod
    def _references(arrays):
        return [(sys.getrefcount(a), sys.getrefcount(a.base)) for a in arrays]

    def take(self, nbytes):
        """A uint8 array of `nbytes` (64-byte aligned): a free one of that
        size, else a new one (kept for reuse while under `max_bytes`)."""
        if nbytes < self.MIN_BYTES:
            return aligned_empty(nbytes)
        references = self._references(self._arrays)
        for array, counts in zip(self._arrays, references):
            if counts == self._free and array.nbytes == nbytes:
                return array
        if self.nbytes + nbytes > self.max_bytes:  # drop the free ones
            self._arrays = [a for a, counts in zip(self._arrays, references)
                            if counts != self._free]
        array = aligned_empty(nbytes)
        if self.nbytes + nbytes <= self.max_bytes:
            self._arrays.append(array)
        return array

    @property
    def nbytes(self):
        """Bytes of the buffers kept (in use or free)."""
        return sum(a.nbytes for a in self._arrays)


class Channel:
    """Seals what one side sends and opens what it receives, in a session.

    Args:
        session: the session id (bytes).
        send_key: this side's key for sending.
        receive_key: the other side's key (what it sends with).
        buffers: the `Buffers` pool sealing writes into, shared by the
            channels one thread uses. Defaults to a pool of its own.

    Raises:
        ImportError: naming the missing `pyaegis` package.
    """

    def __init__(self, session, send_key, receive_key, buffers=None):
        ffi, lib = _aegis()
        self._ffi = ffi
        self._encrypt = getattr(lib, f"{CIPHER}_encrypt")
        self._decrypt = getattr(lib, f"{CIPHER}_decrypt")
        self.session = bytes(session)
        self._send_key = bytes(send_key)
        self._receive_key = bytes(receive_key)
        for key in (self._send_key, self._receive_key):
            if len(key) != KEY_BYTES:
                raise ValueError(f"a {CIPHER} key has {KEY_BYTES} bytes, "
                                 f"not {len(key)}")
        self.sent = 0       # the last counter sealed
        self.received = 0   # the last counter opened
        self._buffers = Buffers() if buffers is None else buffers

    def _aad(self, counter, count):
        return (MAGIC + self.session + counter.to_bytes(8, "little")
                + count.to_bytes(4, "little"))

    @staticmethod
    def _nonce(counter, index):
        return (counter.to_bytes(8, "little") + index.to_bytes(4, "little")
                ).ljust(NONCE_BYTES, b"\0")

    def seal(self, frames):
        """The sealed frames of one message (`frames`: bytes or buffers,
        at least one)."""
        if not frames:
            raise ValueError("a sealed message needs at least one frame")
        self.sent += 1
        counter = self.sent
        aad = self._aad(counter, len(frames))
        sealed = [MAGIC, self.session, counter.to_bytes(8, "little")]
        from_buffer = self._ffi.from_buffer
        for index, frame in enumerate(frames):
            data = frame_view(frame)
            out = self._buffers.take(data.nbytes + TAG_BYTES)
            if self._encrypt(from_buffer(out), TAG_BYTES, from_buffer(data),
                             data.nbytes, aad, len(aad),
                             self._nonce(counter, index), self._send_key):
                raise SealError(f"{CIPHER} failed to seal frame {index}")
            sealed.append(out)
        return sealed

    def open(self, frames, defer=False):
        """The plain frames of a sealed message: uint8 arrays, each in
        place in its sealed frame when that is a received `zmq.Frame`
        (whose sealed bytes are then gone), else in a new 64-byte aligned
        buffer.

        Args:
            frames: the received frames.
            defer: if True, only the header frame (the first) is opened
                (and with it the counter checked and taken); the others come
                back unopened, as `SealedFrame`s, for the caller to open
                where their rows are wanted, each then checked by its own
                tag. Defaults to False.

        Raises:
            SealError: it is not a sealed message of this session, a tag
                fails (with `defer`: the header's), or its counter is not
                above the last one opened.
            SealGap: a genuine message (its header authenticates) whose
                counter is more than one above the last opened: messages
                were lost. The counter is not taken.
        """
        if len(frames) < 4 or bytes(frame_view(frames[0])) != MAGIC:
            # (a message has a header frame: with no frame nothing would
            # authenticate its counter)
            raise SealError("not a sealed message")
        if bytes(frame_view(frames[1])) != self.session:
            raise SealError("a sealed message of another session")
        counter_bytes = bytes(frame_view(frames[2]))
        if len(counter_bytes) != 8:
            raise SealError("a sealed message without its counter")
        counter = int.from_bytes(counter_bytes, "little")
        if counter <= self.received:
            raise SealError(f"counter {counter} is not above {self.received}:"
                            f" a replayed or reordered message")
        body = frames[3:]
        aad = self._aad(counter, len(body))
        sealed = [SealedFrame(self, aad, self._nonce(counter, index), index,
                              frame) for index, frame in enumerate(body)]
        header = sealed[0].open()  # authenticates the counter
        if counter != self.received + 1:
            raise SealGap(f"counter {counter} follows {self.received}: "
                          f"{counter - self.received - 1} message(s) lost")
        opened = [header] + (
            sealed[1:] if defer else [frame.open() for frame in sealed[1:]])
        self.received = counter
        return opened


class SealedFrame:
    """One received frame of a sealed message, not opened yet.

    `open` opens it in place (once; later calls return the same array) and
    `open_into` into a buffer of the caller's, keeping the sealed bytes, so
    that a frame can be opened straight where its rows are wanted (a read
    waiting for them) and again later, in place, should its rows be wanted
    a second time. Either checks the tag: nothing unauthenticated is ever
    returned. Not thread-safe: its owner serialises the calls.

    Args:
        channel: the `Channel` that received it.
        aad: the message's associated data.
        nonce: this frame's nonce.
        index: its index in the message (for errors).
        frame: the received frame (`zmq.Frame`, bytes or buffer).

    Raises:
        SealError: the frame is shorter than a tag.
    """

    __slots__ = ("_channel", "_aad", "_nonce", "_index", "_data",
                 "_in_place", "_opened", "nbytes")

    def __init__(self, channel, aad, nonce, index, frame):
        data = frame_view(frame)
        if data.nbytes < TAG_BYTES:
            raise SealError(f"sealed frame {index} is shorter than a tag")
        self._channel, self._aad, self._nonce = channel, aad, nonce
        self._index, self._data = index, data
        # In place in a received ZeroMQ frame (ours alone), as plain frames
        # are used where they arrived; else into a new buffer.
        self._in_place = hasattr(frame, "buffer") and not data.readonly
        self._opened = None
        self.nbytes = data.nbytes - TAG_BYTES  # of the plain frame

    @property
    def sealed_view(self):
        """The sealed bytes without the tag: as long as the plain frame,
        so a header's sizes can be checked against it. Not the rows."""
        return self._data[:self.nbytes]

    def open(self):
        """The plain frame (uint8 array), opened in place the first time."""
        if self._opened is None:
            out = np.frombuffer(self._data, np.uint8, self.nbytes) \
                if self._in_place else aligned_empty(self.nbytes)
            self._decrypt(out)
            self._opened = out
        return self._opened

    def open_as(self, dtype, shape):
        """`open`'s plain frame as an array of `dtype` and `shape`."""
        return self.open().view(dtype).reshape(shape)

    def open_into(self, out):
        """Opens the frame into `out` (a writable buffer of `nbytes`),
        keeping the sealed bytes. If it raises, `out` holds nothing of use.

        Raises:
            SealError: the tag fails.
            ValueError: `out` is not `nbytes` long.
        """
        nbytes = memoryview(out).nbytes
        if nbytes != self.nbytes:
            raise ValueError(f"sealed frame {self._index} opens into "
                             f"{self.nbytes} bytes, not {nbytes}")
        if self._opened is not None:
            np.copyto(np.frombuffer(out, np.uint8), self._opened)
        else:
            self._decrypt(out)
        return out

    def _decrypt(self, out):
        channel = self._channel
        from_buffer = channel._ffi.from_buffer
        if channel._decrypt(from_buffer(out, require_writable=True),
                            from_buffer(self._data), self._data.nbytes,
                            TAG_BYTES, self._aad, len(self._aad), self._nonce,
                            channel._receive_key):
            raise SealError(f"sealed frame {self._index} does not "
                            f"authenticate")


class Queued:
    """A message a `Sender` holds: `done` once it is sealed and handed to
    ZeroMQ (its plain frames no longer read) or dropped, and, if
    `tracked`, once ZeroMQ has sent it too. It answers what a ZeroMQ
    `MessageTracker` does, so buffers behind it are reused after, and a
    tracked one tells its owner what still waits for a peer that reads
    nothing (the sealed copy of a small message, which no pacing holds
    back, would otherwise count as sent at once)."""

    __slots__ = ("frames", "tracked", "tracker")

    def __init__(self, frames, tracked=False):
        self.frames = frames
        self.tracked = tracked
        self.tracker = None  # ZeroMQ's, once sent (if tracked)

    @property
    def sealed(self):
        """True once the message was sealed and handed over, or dropped."""
        return self.frames is None

    @property
    def done(self):
        """True once nothing reads the plain frames any more (and, if
        tracked, ZeroMQ no longer holds the sealed ones)."""
        return self.frames is None and (self.tracker is None or
                                        self.tracker.done)


class Sender:
    """Seals one session's messages and sends them, a few ahead of the wire.

    Sealing all of a large reply at once keeps a core busy while ZeroMQ's
    I/O threads and the kernel, which move it, wait for one: on two cores
    a 16 MB push+pull round trip ran at 0.85-0.87 of plain sealed up front
    and 0.88-0.90 paced (benchmarks/RESULTS.md). A message is therefore
    sealed (in order) only while fewer than `in_flight` large messages of
    this session are still held by ZeroMQ; the rest wait here, and the
    owning loop pumps again as `pump_all` says (every PACE_S, or every
    STALLED_PACE_S once the reader stopped reading). The plain frames of a
    waiting message must not change (the caller's buffers stay in use
    until its `Queued` is done, as a zero-copy send's until its tracker
    is).

    Args:
        channel: the session's `Channel`.
        send: `send(sealed_frames, track)` hands a sealed message to ZeroMQ
            and returns its `MessageTracker` with `track`, else anything.
        in_flight: large messages ZeroMQ may hold before the next is
            sealed. Defaults to IN_FLIGHT.
        ready: if False, nothing is sealed until `ready` is set True: a
            shard's new session waits for the worker's first message on
            it, since ZeroMQ drops what goes to a route not connected yet
            (a lost message the next one's counter would tell). Defaults
            to True.

    Example:

    >>> keys = new_session()
    >>> channel = Channel(keys["session"], keys["c2s"], keys["s2c"])
    >>> sent = []
    >>> sender = Sender(channel, lambda frames, track: sent.append(frames))
    >>> sender.send([b"header"]).done, len(sent)
    (True, 1)
    """

    def __init__(self, channel, send, in_flight=IN_FLIGHT, ready=True):
        self.channel = channel
        self._send = send
        self.in_flight = in_flight
        self.ready = ready
        self._queue = collections.deque()
        self._trackers = collections.deque()
        self.moved = time.monotonic()  # when it last sent, or got work

    def send(self, frames, track=False):
        """Queues one message's plain frames and sends what it may.
        Returns the message's `Queued`, done only once ZeroMQ sent it
        with `track`."""
        queued = Queued(frames, track)
        if not self._queue:
            self.moved = time.monotonic()
        self._queue.append(queued)
        self.pump()
        return queued

    def pump(self):
        """Seals and sends waiting messages while ZeroMQ holds fewer than
        `in_flight` large ones. Returns True when none waits, or when it is
        not `ready` (its owner then has nothing to look at again)."""
        if not self.ready:
            return True
        queue, trackers = self._queue, self._trackers
        while queue:
            while trackers and trackers[0].done:
                trackers.popleft()
            if len(trackers) >= self.in_flight:
                return False
            queued = queue.popleft()
            frames, queued.frames = queued.frames, None
            large = frame_view(frames[-1]).nbytes >= Buffers.MIN_BYTES
            tracker = self._send(self.channel.seal(frames),
                                 large or queued.tracked)
            self.moved = time.monotonic()
            if large and tracker is not None:
                trackers.append(tracker)
            if queued.tracked and tracker is not None:
                queued.tracker = tracker
        return True

    @property
    def waiting(self):
        """Messages queued, not yet sealed."""
        return len(self._queue)

    def close(self):
        """Drops the messages not yet sealed (the session is gone)."""
        while self._queue:
            self._queue.popleft().frames = None
        self._trackers.clear()


def pump_all(senders):
    """Pumps every sender with messages waiting (an owning loop's turn).

    Returns:
        None when nothing waits, else the seconds until the loop should
        pump again: PACE_S, or STALLED_PACE_S when every waiting sender
        has moved nothing for STALLED_S (its reader stopped reading).
    """
    wait = None
    stalled = time.monotonic() - STALLED_S
    for sender in senders:
        if sender.waiting and not sender.pump():
            wait = PACE_S if sender.moved > stalled else (
                wait or STALLED_PACE_S)
    return wait


def poll_paced(poller, wait, timeout_ms):
    """One turn's `poller.poll` in a loop that pumps senders: `wait` is
    what `pump_all` returned. Returns the ready sockets (a dict)."""
    if wait is None:
        return dict(poller.poll(timeout_ms))
    if wait >= 0.001:  # a stalled reader: incoming requests still wake it
        return dict(poller.poll(min(timeout_ms, wait * 1000)))
    ready = dict(poller.poll(0))
    if not ready:
        time.sleep(wait)  # ZeroMQ drains meanwhile
    return ready
