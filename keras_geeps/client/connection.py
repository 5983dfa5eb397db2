"""The worker's background I/O thread: it alone owns the shard sockets.

The training thread never touches a socket. It hands encoded messages to
this thread through a queue (and rings a doorbell, an inproc socket), and
waits only where consistency requires it, on conditions this thread
signals when replies and pushes arrive.
"""

import collections
import logging
import threading

import zmq

from keras_geeps import protocol
from keras_geeps.errors import GeePSServerError
from keras_geeps.protocol import MsgType, ProtocolError

log = logging.getLogger("keras_geeps.client")


class Future:
    """The reply to one request, filled in by the I/O thread."""

    __slots__ = ("event", "message", "error")

    def __init__(self):
        self.event = threading.Event()
        self.message = None
        self.error = None

    def set(self, message=None, error=None):
        self.message, self.error = message, error
        self.event.set()


class IOThread:
    """Owns one DEALER socket per shard and moves messages both ways.

    Args:
        addresses: the shard addresses, index = shard id.
        on_rows: called as on_rows(shard, message) in this thread for every
            PUSH and ROWS message.
        name: the thread's name.
    """

    def __init__(self, addresses, on_rows, name="geeps-io"):
        self._addresses = list(addresses)
        self._on_rows = on_rows
        self._context = zmq.Context()
        self._outbox = collections.deque()
        self._doorbell_lock = threading.Lock()
        endpoint = f"inproc://geeps-doorbell-{id(self)}"
        self._doorbell_in = self._context.socket(zmq.PULL)
        self._doorbell_in.bind(endpoint)
        self._doorbell = self._context.socket(zmq.PUSH)
        self._doorbell.connect(endpoint)
        self._sockets = []
        for address in self._addresses:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(address)
            self._sockets.append(sock)
        self._futures = {}  # (shard, seq) -> Future
        self._lock = threading.Lock()
        self.errors = collections.deque()  # async errors for the caller
        self.bytes_out = 0
        self.bytes_in = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name,
                                        daemon=True)
        self._thread.start()

    def send(self, shard, message, future=None):
        """Queues `message` for `shard`; `future` receives the reply."""
        frames = protocol.encode(message)
        if future is not None:
            with self._lock:
                self._futures[(shard, message.seq)] = future
        self._outbox.append((shard, frames))
        self._ring()

    def _ring(self):
        with self._doorbell_lock:
            try:
                self._doorbell.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # rings are queued already: the thread will wake

    def close(self, timeout=5.0):
        """Stops the thread and closes every socket."""
        if self._stop:
            return
        self._stop = True
        self._ring()
        self._thread.join(timeout)
        with self._doorbell_lock:
            self._doorbell.close(linger=0)
        self._context.term()

    def _run(self):
        poller = zmq.Poller()
        poller.register(self._doorbell_in, zmq.POLLIN)
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        index = {sock: i for i, sock in enumerate(self._sockets)}
        try:
            while not self._stop:
                events = dict(poller.poll(100))
                if self._doorbell_in in events:
                    while True:
                        try:
                            self._doorbell_in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self._flush_outbox()
                for sock, shard in index.items():
                    if sock in events:
                        self._drain(sock, shard)
        except Exception:  # keep the reason; the caller times out on it
            log.exception("keras_geeps I/O thread failed")
            self.errors.append(GeePSServerError("the I/O thread failed; see "
                                                "the log"))
        finally:
            for sock in self._sockets:
                sock.close(linger=0)
            self._doorbell_in.close(linger=0)

    def _flush_outbox(self):
        while self._outbox:
            shard, frames = self._outbox.popleft()
            self.bytes_out += sum(len(f) if isinstance(f, bytes) else f.nbytes
                                  for f in frames)
            self._sockets[shard].send_multipart(frames, copy=False)

    def _drain(self, sock, shard):
        for _ in range(512):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.bytes_in += sum(len(f) for f in frames)
            try:
                message = protocol.decode(frames)
            except ProtocolError as exc:
                log.error("shard %d sent a malformed message: %s", shard, exc)
                self.errors.append(GeePSServerError(
                    f"shard {shard} sent a malformed message: {exc}"))
                continue
            self._deliver(shard, message)

    def _deliver(self, shard, message):
        kind = message.type
        if kind in (MsgType.PUSH, MsgType.ROWS):
            self._on_rows(shard, message)
            return
        with self._lock:
            future = self._futures.pop((shard, message.seq), None)
        if kind == MsgType.ERROR:
            error = GeePSServerError(
                f"shard {shard} ({self._addresses[shard]}) refused request "
                f"{message.seq}: {message.meta.get('error')}")
            if future is not None:
                future.set(error=error)
            else:
                self.errors.append(error)
        elif future is not None:
            future.set(message)
