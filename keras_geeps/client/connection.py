"""The worker's background I/O thread: it alone owns the shard sockets.

The training thread never touches a socket. It hands encoded messages to
this thread through a queue (and rings a doorbell, an inproc socket), and
waits only where consistency requires it, on conditions this thread
signals when replies and pushes arrive. The thread also sends a heartbeat
to every shard each `heartbeat_interval` seconds, and can hold a shard's
outgoing traffic while that shard is being recovered.
"""

import collections
import functools
import logging
import reprlib
import threading
import time

import zmq

from keras_geeps import protocol, seal
from keras_geeps.errors import GeePSError, GeePSServerError
from keras_geeps.protocol import Message, MsgType, ProtocolError

log = logging.getLogger("keras_geeps.client")

CLOSED = "the client is closed"
# How long a closing client's sockets may take to send what it queued
# (its last clock's updates and clocks) to shards that are gone.
CLOSE_LINGER_S = 2.0
# The requests a shard handles at most once per sequence number (it
# remembers the numbers it handled): a worker keeps those it wrote until a
# reply to a later one shows the shard got them, and sends them again,
# under the same numbers, when its connection broke and came back.
RESENDABLE = frozenset({MsgType.CREATE, MsgType.UPDATE, MsgType.CLOCK})


class Future:
    """The reply to one request, filled in by the I/O thread.

    Args:
        callback: optional `callback(message, error)` run in the I/O thread
            when the reply arrives (it may send with `IOThread.send_now`).

    Attributes:
        shard, request: where the request went and the request itself (set
            when it is sent), so that it can be sent again or forgotten.
        written: True once the I/O thread wrote the request to its socket
            (and not held it back since).
    """

    __slots__ = ("event", "message", "error", "callback", "shard",
                 "request", "written")

    def __init__(self, callback=None):
        self.event = threading.Event()
        self.message = None
        self.error = None
        self.callback = callback
        self.shard = None
        self.request = None
        self.written = False

    def set(self, message=None, error=None):
        self.message, self.error = message, error
        self.event.set()
        if self.callback is not None:
            self.callback(message, error)

    def cancel(self, error):
        """Fails the future without running its callback (on close)."""
        self.message, self.error = None, error
        self.event.set()


class _SealedLink:
    """A shard's sealed data socket, the session's channel and the sender
    that paces what goes out on it.

    Sends never block: a DEALER whose only connection the shard's ZAP
    refused (a restarted shard, on the same data port, that does not know
    the session) has nowhere to queue, and a blocking send would stop the
    I/O thread for good. `on_refused(link)` is called instead, and the
    message is lost, as on a broken connection."""

    def __init__(self, socket, channel, on_refused):
        self.socket = socket
        self.channel = channel
        self.sender = seal.Sender(channel, self._send)
        self.broken = False  # it lost messages: nothing more is opened
        self.heard = time.monotonic()  # when a message last came on it
        self._on_refused = on_refused

    def _send(self, frames, track):
        try:
            return self.socket.send_multipart(frames, zmq.NOBLOCK,
                                              copy=False, track=track)
        except zmq.Again:
            self._on_refused(self)
            return None


def _sealed_link_fields(sealed):
    """WELCOME's `sealed` field ([data port, session, c2s key, s2c key,
    connect token]; protocol), checked.

    Raises:
        ProtocolError: naming what is wrong with it.
    """
    sizes = (seal.SESSION_BYTES, seal.KEY_BYTES, seal.KEY_BYTES)
    try:
        port, *hexes, token = sealed
        ok = isinstance(port, int) and not isinstance(port, bool) and \
            0 < port < 1 << 16 and isinstance(token, str) and \
            0 < len(token) <= 256 and token.isalnum() and all(
                isinstance(h, str) and len(bytes.fromhex(h)) == size
                for h, size in zip(hexes, sizes, strict=True)) and \
            bytes.fromhex(hexes[0])[0] != 0
    except (TypeError, ValueError):  # not a list of five, or not hex
        ok = False
    if not ok:
        raise ProtocolError(
            f"WELCOME: its sealed field {reprlib.repr(sealed):.120} is not "
            f"[data port, session ({seal.SESSION_BYTES} bytes, hex), two "
            f"keys ({seal.KEY_BYTES} bytes, hex), connect token]")
    return sealed


class IOThread:
    """Owns one DEALER socket per shard and moves messages both ways.

    Args:
        addresses: the shard addresses, index = shard id.
        on_rows: called as on_rows(shard, message, sealed) in this thread
            for every PUSH and ROWS message. `sealed` is None, or (rows
            from a sealed link) one `seal.SealedFrame` per array of
            `message`, whose arrays then hold sealed bytes, not rows: only
            their dtype and shape are meant, until the frame is opened.
        on_error: called as on_error(shard, message, future) in this thread
            for an ERROR that carries a `code` (shard restarted, worker
            dead); `future` is the refused request's, or None.
        on_broken: called as on_broken(shard, reason) in this thread, at
            the end of the loop's turn, when a sealed link was ended
            (`break_link`): it lost messages (`seal.SealGap`, or a chunk
            that did not open), went silent, or the shard's data socket
            refused it. Later messages on it are dropped until a new
            WELCOME replaces it.
        on_turn: called as on_turn() in this thread at every turn of its
            loop, before the queued messages are written.
        on_close: called as on_close() in this thread once at a close,
            before what is queued is sent: what it queues goes too.
        on_welcome: called as on_welcome(shard, message) in this thread
            for every WELCOME, before its request's future is set.
        worker_id: this worker's id (heartbeats carry it).
        heartbeat_interval: seconds between heartbeats; 0 sends none
            (set `heartbeat_interval` later to start them). Each shard gets
            them once it has welcomed this worker (before, it would answer
            hello_required), from then on also across its restarts.
        curve: a `keras_geeps.auth.ClientKeys`, or None.
        name: the thread's name.
    """

    def __init__(self, addresses, on_rows, on_error=None, worker_id=-1,
                 heartbeat_interval=0.0, curve=None, name="geeps-io",
                 on_turn=None, on_broken=None, on_close=None,
                 on_welcome=None):
        self._addresses = list(addresses)
        self._on_welcome = on_welcome
        self._keyed = curve is not None
        self._on_broken = on_broken
        self._broken = {}  # shard -> why its link broke, told next turn
        self._on_turn = on_turn
        self._on_close = on_close
        self._on_rows = on_rows
        self._on_error = on_error
        self._worker_id = worker_id
        self.heartbeat_interval = heartbeat_interval
        # None: heartbeats go to every shard that welcomed us; else a
        # function giving the set of those that get them (a closing
        # client's, awaiting LEAVEs), asked at each beat.
        self.heartbeat_only = None
        self._linger = CLOSE_LINGER_S  # (what `close` gives)
        self._context = zmq.Context(io_threads=protocol.IO_THREADS)
        self._outbox = collections.deque()
        self._doorbell_lock = threading.Lock()
        endpoint = f"inproc://geeps-doorbell-{id(self)}"
        self._doorbell_in = self._context.socket(zmq.PULL)
        self._doorbell_in.bind(endpoint)
        self._doorbell = self._context.socket(zmq.PUSH)
        self._doorbell.connect(endpoint)
        self._links = {}  # shard -> _SealedLink, after a sealed WELCOME
        self._welcomed = set()  # shards that welcomed us: heartbeats go
        self._seal_buffers = None  # seal.Buffers of every link
        self._poll_sockets = {}  # socket -> shard, read by the thread
        self._sockets = []
        for shard, address in enumerate(self._addresses):
            sock = self._dealer(address)
            if curve is not None:
                curve.apply(sock, shard)
            sock.connect(address)
            self._sockets.append(sock)
        self._futures = {}  # (shard, seq) -> Future
        # shard -> {seq: Message} of RESENDABLE requests written to it and
        # not yet known to have arrived, in the order written.
        self._unacked = collections.defaultdict(collections.OrderedDict)
        self._lock = threading.Lock()
        self.held = set()   # shards whose queued traffic waits (recovery)
        self._backlog = collections.defaultdict(list)
        self.errors = collections.deque()  # async errors for the caller
        self.failed = None  # why this thread stopped serving, if it did
        self.bytes_out = 0
        self.bytes_in = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name,
                                        daemon=True)
        self._thread.start()

    def _dealer(self, address):
        """A DEALER with this thread's options, to connect to `address`."""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        protocol.set_link_heartbeats(sock, address)
        return sock

    def send(self, shard, message, future=None):
        """Queues `message` for `shard`; `future` receives the reply.

        Raises:
            GeePSError: the connections are closed.
        """
        if self._stop and threading.current_thread() is not self._thread:
            raise GeePSError(CLOSED)
        frames = protocol.encode(message)
        self._register(shard, message, future)
        self._outbox.append((shard, frames, message, future))
        self._ring()

    def send_now(self, shard, message, future=None):
        """Sends at once, ahead of held traffic (I/O thread only)."""
        self._register(shard, message, future)
        self._write(shard, protocol.encode(message), message, future)

    def _register(self, shard, message, future):
        if future is not None:
            future.shard, future.request = shard, message
            with self._lock:
                self._futures[(shard, message.seq)] = future

    def requeue(self, shard, future):
        """Holds a request `shard` refused until `shard` is released
        (I/O thread only); it is then sent again, in its original order."""
        self._register(shard, future.request, future)
        if future.written:  # (else the backlog holds it already)
            future.written = False
            self._backlog[shard].append((None, future.request, future))

    def requeue_unanswered(self, shard):
        """Holds again every request a caller waits on that went out to
        `shard` and has no reply (I/O thread only, `shard` held): a
        restarted shard never answers what its predecessor took, or what a
        replaced sealed link dropped. `release` sends them anew, first."""
        with self._lock:
            futures = [f for (s, _), f in self._futures.items()
                       if s == shard and f.written and f.callback is None]
        for future in futures:
            future.written = False
            self._backlog[shard].append((None, future.request, future))

    def forget(self, futures):
        """Drops the futures of requests nobody waits for any more."""
        with self._lock:
            for future in futures:
                if future.request is None:
                    continue
                key = (future.shard, future.request.seq)
                if self._futures.get(key) is future:
                    del self._futures[key]

    def release(self, shard, next_seq, drop=None):
        """Sends the traffic held for `shard` (I/O thread only).

        Messages `drop(message)` calls obsolete are skipped; the others get
        fresh sequence numbers from `next_seq()`, since the shard counts
        this worker's requests from the HELLO that preceded the release.
        """
        self._flush_outbox()  # (what was queued meanwhile is held too)
        self.held.discard(shard)
        # By original sequence number: refused requests that were sent
        # again (`requeue`) go before what was queued after them.
        backlog = sorted(self._backlog.pop(shard, []),
                         key=lambda entry: entry[1].seq)
        for frames, message, waiter in backlog:
            if drop is not None and drop(message):
                continue
            with self._lock:
                future = self._futures.pop((shard, message.seq), None)
                if waiter is not None and future is not waiter:
                    continue  # a request whose caller gave up meanwhile
                message.seq = next_seq()
                if future is not None:
                    self._futures[(shard, message.seq)] = future
            self._write(shard, protocol.encode(message), message, future)

    def resend_unacknowledged(self, shard):
        """Writes again, under their own sequence numbers, the RESENDABLE
        requests `shard` may not have got (I/O thread only, before
        `release`): its connection broke and came back, and a broken
        connection loses what it was carrying. The shard handles those it
        had not, and drops those it had. Held copies of the same requests
        (`requeue_unanswered`) are not sent a second time. Returns how
        many were written."""
        unacked = self._unacked.pop(shard, {})
        again = {id(message) for message in unacked.values()}
        self._backlog[shard] = [entry for entry in self._backlog[shard]
                                if id(entry[1]) not in again]
        for message in unacked.values():
            with self._lock:
                future = self._futures.get((shard, message.seq))
            self._write(shard, protocol.encode(message), message, future)
        return len(unacked)

    def break_link(self, shard, reason):
        """Ends `shard`'s sealed link: nothing more from it is opened, and
        `on_broken(shard, reason)` runs at the end of the loop's turn (not
        inside the read or write that found it, which may be a recovery's
        own), so the worker says HELLO again (I/O thread only)."""
        link = self._links.get(shard)
        if link is None or link.broken:
            return
        link.broken = True
        log.warning("worker %d: shard %d's sealed link %s: saying HELLO "
                    "again", self._worker_id, shard, reason)
        self._broken[shard] = reason

    def forget_unacknowledged(self, shard):
        """Drops what `resend_unacknowledged` would send: `shard` restarted,
        and its recovery's replay resends what its checkpoint lacks."""
        self._unacked.pop(shard, None)

    def _acknowledged(self, shard, seq):
        """A reply to request `seq` of `shard`: replies come in the order
        of the requests, so the shard got everything written before it.
        Only a reply to a RESENDABLE request (one kept here) drops any:
        a CLOCK's ACK comes every clock."""
        unacked = self._unacked.get(shard)
        if unacked and seq in unacked:
            while unacked.popitem(last=False)[0] != seq:
                pass

    def _ring(self):
        with self._doorbell_lock:
            if self._doorbell.closed:
                raise GeePSError(CLOSED)
            try:
                self._doorbell.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # rings are queued already: the thread will wake

    def close(self, timeout=5.0, linger=CLOSE_LINGER_S):
        """Stops the thread, closes every socket and fails every request
        still waiting for a reply; what is queued gets `linger` seconds to
        leave (default CLOSE_LINGER_S; 0 where nothing queued matters).
        The thread gets `timeout` + `linger` seconds to stop."""
        if self._stop:
            return
        self._linger = linger
        self._stop = True
        self._ring()
        self._thread.join(timeout + linger)
        with self._doorbell_lock:
            self._doorbell.close(linger=0)
        if self._thread.is_alive():
            # Its sockets are still open: term() would wait for them with
            # no bound. The thread is a daemon; the context is left to it.
            log.warning("keras_geeps I/O thread did not stop within %.0f s;"
                        " closing without it", timeout + linger)
        else:
            self._context.term()
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            future.cancel(GeePSError(CLOSED))

    def _run(self):
        poller = self._poller = zmq.Poller()
        poller.register(self._doorbell_in, zmq.POLLIN)
        for shard, sock in enumerate(self._sockets):
            poller.register(sock, zmq.POLLIN)
            self._poll_sockets[sock] = shard
        last_beat = -float("inf")  # (the interval may change meanwhile)
        try:
            while not self._stop:
                events = seal.poll_paced(poller, self._pump_links(), 100)
                if self._doorbell_in in events:
                    while True:
                        try:
                            self._doorbell_in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                if self._on_turn is not None:
                    self._on_turn()
                self._flush_outbox()
                for sock, shard in list(self._poll_sockets.items()):
                    # (a link replaced meanwhile is closed: skipped)
                    if sock in events and sock in self._poll_sockets:
                        self._drain(sock, shard)
                if self.heartbeat_interval and time.monotonic() >= \
                        last_beat + self.heartbeat_interval:
                    last_beat = time.monotonic()
                    only = self.heartbeat_only
                    for shard in sorted(self._welcomed if only is None
                                        else self._welcomed & only()):
                        self._heartbeat(shard)
                    self._watch_links()
                self._tell_broken()
        except Exception as exc:  # kept: every later call raises it
            log.exception("keras_geeps I/O thread failed")
            self.failed = GeePSServerError(
                f"the I/O thread failed ({type(exc).__name__}: {exc}); see "
                f"the log")
            self.failed.__cause__ = exc
        finally:
            # A close (not a failure) sends what is queued first: without
            # it the last clock's updates and CLOCKs, still in ZeroMQ's
            # queues, went with the sockets and the other workers waited
            # for them until their timeout.
            closing = self._stop and self.failed is None
            if closing and self._on_close is not None:
                # The loop may stop before a turn saw what was queued last
                # (released shared buffers: the shard held them for a
                # closed client).
                try:
                    self._on_close()
                except Exception:  # what was queued goes all the same
                    log.exception("keras_geeps I/O thread: on_close failed")
            if closing:
                try:
                    self._send_queued(self._linger)
                except Exception:  # closing all the same
                    log.exception("keras_geeps I/O thread: sending what "
                                  "was queued at close failed")
            linger = int(self._linger * 1000) if closing else 0
            for sock in self._sockets:
                sock.close(linger=linger)
            for link in self._links.values():
                link.socket.close(linger=linger)
            self._doorbell_in.close(linger=0)

    def _send_queued(self, limit):
        """Writes the outbox, then seals what the links' senders hold back
        as ZeroMQ sends what went before, for `limit` seconds at most."""
        deadline = time.monotonic() + limit
        self._flush_outbox()
        while self._pump_links() and time.monotonic() < deadline:
            time.sleep(0.001)

    def _heartbeat(self, shard):
        """A heartbeat over the main socket, also with a sealed link: a
        shard restarted on another data port answers it there (CURVE
        authenticated) with hello_required, and the worker recovers. With
        a sealed link, one more over the link, which the shard echoes: a
        message either side's link lost, even the last one sent, shows by
        the gap in the counters of the next (`seal.SealGap`)."""
        frames = protocol.encode(Message(MsgType.HEARTBEAT,
                                         worker=self._worker_id))
        self.bytes_out += sum(len(f) for f in frames)
        try:
            self._sockets[shard].send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # no connection takes it (CURVE refused us)
            pass
        link = self._links.get(shard)
        if link is not None and not link.broken:
            self.bytes_out += sum(len(f) for f in frames)
            link.sender.send(frames)

    def _write(self, shard, frames, message, future=None):
        """Sends a message's frames: sealed on the shard's data link once
        it has one (HELLO always goes over the main, CURVE, socket)."""
        kind = message.type
        if kind in RESENDABLE:
            self._unacked[shard][message.seq] = message
        if future is not None:
            future.written = True
        self.bytes_out += sum(len(f) if isinstance(f, bytes) else f.nbytes
                              for f in frames)
        link = self._links.get(shard)
        if link is not None and kind != MsgType.HELLO:
            link.sender.send(frames)
            return
        try:
            self._sockets[shard].send_multipart(frames, zmq.NOBLOCK,
                                                copy=False)
        except zmq.Again:  # no connection takes it: CURVE refused us
            hint = ("if it requires CURVE keys: are this worker's keys "
                    "allowed? if it requires none, this worker must use "
                    "none either" if self._keyed else
                    "does it require CURVE keys?")
            error = GeePSError(f"shard {shard} ({self._addresses[shard]}) "
                               f"has no connection that takes this worker's "
                               f"{kind.name}: it refused the connection "
                               f"({hint})")
            self._report(future, error)

    def _report(self, future, error):
        """Fails the request `future` waits on, or, with none, queues
        `error` for the caller (`errors`)."""
        if future is not None:
            future.set(error=error)
        else:
            self.errors.append(error)

    def _pump_links(self):
        """Seals what the links' senders hold back once ZeroMQ has sent
        enough of what went before (`seal.pump_all`)."""
        return seal.pump_all(link.sender for link in self._links.values())

    def _flush_outbox(self):
        while self._outbox:
            shard, frames, message, future = self._outbox.popleft()
            if shard in self.held:
                self._backlog[shard].append((frames, message, future))
            else:
                self._write(shard, frames, message, future)

    def _open_link(self, shard, sealed):
        """Starts (or replaces) the sealed data link a WELCOME gave (its
        fields checked: `_sealed_link_fields`)."""
        port, session, c2s, s2c, token = sealed
        plain_username = session
        session = bytes.fromhex(session)
        old = self._links.pop(shard, None)
        if old is not None:  # what it held back is dropped, as is its
            # socket's queue (recovery resends what matters)
            old.sender.close()
            self._poll_sockets.pop(old.socket, None)
            self._poller.unregister(old.socket)
            old.socket.close(linger=0)
        address = f"{self._addresses[shard].rsplit(':', 1)[0]}:{port}"
        sock = self._dealer(address)
        sock.setsockopt(zmq.ROUTING_ID, session)
        sock.plain_username = plain_username.encode()  # the shard's ZAP
        sock.plain_password = token.encode()  # check lets it connect
        sock.connect(address)
        if self._seal_buffers is None:  # one pool: all seal in this thread
            self._seal_buffers = seal.Buffers()
        self._links[shard] = _SealedLink(sock, seal.Channel(
            session, bytes.fromhex(c2s), bytes.fromhex(s2c),
            self._seal_buffers), functools.partial(self._link_refused, shard))
        self._poll_sockets[sock] = shard
        self._poller.register(sock, zmq.POLLIN)

    def _link_refused(self, shard, link):
        """`shard`'s data socket takes nothing (its ZAP refused the
        session: the shard restarted): the link is broken, and the worker
        says HELLO again (I/O thread)."""
        if self._links.get(shard) is link:
            self.break_link(shard, "is refused by the shard's data socket")

    def _tell_broken(self):
        """Runs `on_broken` for the links found broken since (I/O thread)."""
        broken, self._broken = self._broken, {}
        if self._on_broken is not None:
            for shard, reason in broken.items():
                self._on_broken(shard, reason)

    def _watch_links(self):
        """Breaks a sealed link that heard nothing, its echoed heartbeats
        included, for protocol.LINK_TIMEOUT_MS: a half-open connection,
        or one the shard keeps refusing (I/O thread; with heartbeats)."""
        quiet = time.monotonic() - protocol.LINK_TIMEOUT_MS / 1000
        for shard, link in self._links.items():
            if protocol.is_loopback(self._addresses[shard]) and \
                    not protocol.LINK_HEARTBEATS_ON_LOOPBACK:
                continue
            if link.heard < quiet:
                seconds = protocol.LINK_TIMEOUT_MS / 1000
                self.break_link(shard, f"heard nothing for {seconds:g} s")

    def _open(self, shard, frames, link):
        """The message in `frames` from `shard`, and its `seal.SealedFrame`s
        when its rows are left sealed (else None). From its main socket
        (CURVE when keys are set) anything goes; from its data `link` only
        sealed messages of the session and, in the clear, the
        hello_required error of a restarted shard (it can cause a recovery,
        nothing else). (None, None) for what does not qualify.

        The rows of a sealed PUSH or ROWS are not opened here: `on_rows`
        opens them where they are wanted (into a waiting read's buffer, so
        the cipher's pass is also the copy), else in place."""
        if link is None:
            return protocol.decode(frames), None
        if link.broken:
            return None, None
        if frames and bytes(frames[0].buffer) == seal.MAGIC:
            try:
                opened = link.channel.open(frames, defer=True)
            except seal.SealGap as exc:
                self.break_link(shard, f"lost messages ({exc})")
                return None, None
            except seal.SealError as exc:  # (its counter is not taken)
                log.error("dropped a sealed message from shard %d: %s",
                          shard, exc)
                return None, None
            sealed = opened[1:]
            message = protocol.decode(
                [opened[0]] + [frame.sealed_view for frame in sealed])
            if message.type in (MsgType.PUSH, MsgType.ROWS):
                return message, sealed
            try:
                message.arrays = [frame.open_as(array.dtype, array.shape)
                                  for array, frame in zip(message.arrays,
                                                          sealed)]
            except seal.SealError as exc:
                # Its header opened, taking its counter: the link lost this
                # message as a break would, and no later gap would say so.
                log.error("dropped a sealed %s from shard %d: %s",
                          message.type.name, shard, exc)
                self.break_link(shard, f"lost a message ({exc})")
                return None, None
            return message, None
        message = protocol.decode(frames)
        if message.type == MsgType.ERROR and message.meta.get("code") == \
                protocol.ERROR_HELLO_REQUIRED:
            return message, None
        log.error("dropped an unsealed %s on shard %d's data link",
                  message.type.name, shard)
        return None, None

    def _drain(self, sock, shard):
        link = self._links.get(shard)
        if link is not None and link.socket is not sock:
            link = None  # the main socket
        for _ in range(512):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.bytes_in += sum(len(f) for f in frames)
            if link is not None:
                link.heard = time.monotonic()
            try:
                message, sealed = self._open(shard, frames, link)
                if message is not None and message.type == MsgType.WELCOME \
                        and "sealed" in message.meta:
                    message.meta["sealed"] = _sealed_link_fields(
                        message.meta["sealed"])
            except ProtocolError as exc:
                log.error("shard %d sent a malformed message: %s", shard, exc)
                self.errors.append(GeePSServerError(
                    f"shard {shard} sent a malformed message: {exc}"))
                continue
            if message is not None:
                self._deliver(shard, message, sealed)

    def _deliver(self, shard, message, sealed=None):
        kind = message.type
        if kind == MsgType.WELCOME:
            self._welcomed.add(shard)
            if "sealed" in message.meta:
                self._open_link(shard, message.meta["sealed"])
            if self._on_welcome is not None:
                self._on_welcome(shard, message)
        if kind in (MsgType.PUSH, MsgType.ROWS):
            self._on_rows(shard, message, sealed)
            return
        code = message.meta.get("code") if kind == MsgType.ERROR else None
        if code != protocol.ERROR_HELLO_REQUIRED:  # (that one: not handled)
            self._acknowledged(shard, message.seq)
        with self._lock:
            future = self._futures.pop((shard, message.seq), None)
        if kind == MsgType.ERROR:
            if code in protocol.CLIENT_ACTS_ON and self._on_error is not None:
                self._on_error(shard, message, future)
                return
            error = GeePSServerError(
                f"shard {shard} ({self._addresses[shard]}) refused request "
                f"{message.seq}: {message.meta.get('error')}", code)
            self._report(future, error)
        elif future is not None:
            future.set(message)
