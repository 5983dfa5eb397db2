"""A TCP forwarder on loopback whose connections a test can break.

A worker connected through a `CuttableLink` sees a real broken
connection when the test cuts it: both of the forwarder's sockets are
reset (SO_LINGER 0), whatever was on the way is lost, and ZeroMQ's
reconnect goes through the link again, to the same shard process. A
stalled link is a half-open connection: both ends stay connected while
everything sent on it vanishes; new connections go through.
"""

import socket
import struct
import threading


class CuttableLink:
    """Forwards TCP connections from a loopback port to `target`.

    Args:
        target: (host, port) the connections go on to.
        host: the loopback address to listen on. Defaults to 127.0.0.1.
        port: the port to listen on; 0 (the default) picks a free one.

    Example:

    >>> link = CuttableLink(("127.0.0.1", 5555))
    >>> link.address  # doctest: +SKIP
    'tcp://127.0.0.1:41234'
    >>> link.cut_after(1 << 20)  # mid-stream, once 1 MiB more went in
    >>> link.cut_after(1 << 20, inbound=False)  # or came back
    >>> link.stall()  # half-open: connected, carrying nothing
    >>> link.corrupt_after(1 << 20)  # one bit flipped on the way
    >>> link.cut_on(b"ready", inbound=False)  # when those bytes come back
    >>> link.close()
    """

    def __init__(self, target, host="127.0.0.1", port=0):
        self.target = target
        self._listener = socket.create_server((host, port))
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._pairs = []
        self._cut_at = None   # (inbound?, cut when that count reaches it)
        self._flip_at = None  # (inbound?, the byte of that count to flip)
        self._cut_on = None   # (inbound?, bytes whose chunk is cut)
        self.bytes_in = 0     # client -> target bytes forwarded
        self.bytes_out = 0    # target -> client bytes forwarded
        self.cuts = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self):
        """The ZeroMQ address to connect to instead of the target's."""
        return f"tcp://{self.host}:{self.port}"

    def cut(self):
        """Resets every connection through the link now."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self._cut_at = None
            self.cuts += 1
        for pair in pairs:
            for sock in pair[:2]:
                _reset(sock)

    def stall(self):
        """Drops, from now on, whatever the connections through the link
        now carry, either way, and closes none of them."""
        with self._lock:
            for pair in self._pairs:
                pair[2] = True

    def cut_after(self, nbytes, inbound=True):
        """Cuts once `nbytes` more bytes went from clients to the target
        (or, with `inbound` False, back from it); the chunk that reaches
        the mark is lost with the rest."""
        with self._lock:
            self._cut_at = (inbound, nbytes + (self.bytes_in if inbound
                                               else self.bytes_out))

    def cut_on(self, pattern, inbound=True):
        """Cuts when a chunk read from clients (or, with `inbound` False,
        from the target) contains `pattern`; that chunk is lost."""
        with self._lock:
            self._cut_on = (inbound, bytes(pattern))

    def corrupt_after(self, nbytes, inbound=True):
        """Flips one bit of the byte `nbytes` further on in the stream from
        clients to the target (or back, with `inbound` False), and
        forwards it: damage on the wire that TCP's checksum missed."""
        with self._lock:
            self._flip_at = (inbound, nbytes + (self.bytes_in if inbound
                                                else self.bytes_out))

    def close(self):
        self._closed = True
        self._listener.close()
        self.cut()

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            pair = [client, upstream, False]  # (stalled)
            with self._lock:
                self._pairs.append(pair)
            for source, sink, inbound in ((client, upstream, True),
                                          (upstream, client, False)):
                threading.Thread(target=self._pump,
                                 args=(source, sink, inbound, pair),
                                 daemon=True).start()

    def _pump(self, source, sink, inbound, pair):
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                _reset(sink)
                return
            with self._lock:
                before = self.bytes_in if inbound else self.bytes_out
                if inbound:
                    self.bytes_in += len(data)
                else:
                    self.bytes_out += len(data)
                flip = self._flip_at
                if flip is not None and flip[0] == inbound and \
                        before <= flip[1] < before + len(data):
                    data = bytearray(data)
                    data[flip[1] - before] ^= 0x10
                    self._flip_at = None
                due = self._cut_at is not None and \
                    self._cut_at[0] == inbound and \
                    (self.bytes_in if inbound else self.bytes_out) >= \
                    self._cut_at[1]
                if self._cut_on is not None and \
                        self._cut_on[0] == inbound and \
                        self._cut_on[1] in data:
                    self._cut_on, due = None, True
            if due:
                self.cut()
                return
            if pair[2]:
                continue
            try:
                sink.sendall(data)
            except OSError:
                _reset(source)
                return


def _reset(sock):
    """Closes `sock` with a reset (nothing it holds is delivered), waking
    a thread blocked reading it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                        struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)  # (no FIN: the close sends RST)
    except OSError:
        pass
    sock.close()
