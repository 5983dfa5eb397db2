"""The sealed data channel: AES-256-GCM messages keyed by a CURVE handshake.

libzmq's CURVE encrypts every byte with salsa20-poly1305 in its I/O
threads, at well under half the plain bulk throughput of a link (see
benchmarks/RESULTS.md). With CURVE keys, a worker therefore says HELLO to a
shard over the CURVE socket only: ZeroMQ's ZAP authenticates it there, and
the WELCOME (encrypted by CURVE) hands it a session: a routing id, one
fresh random 256-bit key per direction and the port of the shard's data
socket. Every later message of either side travels on that plain TCP
socket, each frame sealed with AES-256-GCM (OpenSSL through the
`cryptography` package, AES-NI), so the bulk rows cost one cipher pass per
side at several GB/s. The data socket admits only connections that name a
live session and its random token (ZAP, `auth.ShardAuth.apply_session_check`);
heartbeats stay on CURVE.

A sealed message is the frames

    [MAGIC, session id, counter (8 bytes, little endian), sealed frame...]

where each sealed frame is `ciphertext || 16-byte tag` of one frame of
`protocol.encode(message)`, with nonce `counter || frame index (4 bytes)`
and associated data `MAGIC || session id || counter || frame count`. The
sender's counter grows by one per message and a receiver accepts only
counters above the last it accepted: a frame cannot be altered, dropped,
reordered, moved to another message or session, or replayed without the
tag failing or the counter check refusing it. Keys live only in the two
processes' memory, and a new session (every HELLO) gets new ones, so no
(key, nonce) pair is ever used twice.

Example:

>>> keys = new_session()
>>> worker = Channel(keys["session"], keys["c2s"], keys["s2c"])
>>> shard = Channel(keys["session"], keys["s2c"], keys["c2s"])
>>> sealed = worker.seal([b"header", np.arange(4, dtype=np.float32)])
>>> [bytes(f) for f in shard.open(sealed)][0]
b'header'
"""

import os

import numpy as np

from keras_geeps.protocol import aligned_empty, frame_bytes

MAGIC = b"GS1"
TAG_BYTES = 16
KEY_BYTES = 32
SESSION_BYTES = 8


class SealError(Exception):
    """A sealed message that does not open: forged, altered or replayed."""


def available():
    """Whether the `cryptography` package (AES-GCM) can be imported."""
    try:
        from cryptography.hazmat.primitives import ciphers  # noqa: PLC0415
    except ImportError:
        return False
    return ciphers is not None


def new_session():
    """A fresh session: its routing id and one key per direction (bytes).

    Returns:
        dict with "session" (SESSION_BYTES, first byte never 0: ZeroMQ
        reserves those routing ids), "c2s" and "s2c" (KEY_BYTES each).
    """
    session = b"S" + os.urandom(SESSION_BYTES - 1)
    return {"session": session, "c2s": os.urandom(KEY_BYTES),
            "s2c": os.urandom(KEY_BYTES)}


class Channel:
    """Seals what one side sends and opens what it receives, in a session.

    Args:
        session: the session id (bytes).
        send_key: this side's key for sending.
        receive_key: the other side's key (what it sends with).

    Raises:
        ImportError: naming the missing `cryptography` package.
    """

    def __init__(self, session, send_key, receive_key):
        try:
            from cryptography.hazmat.primitives.ciphers import (  # noqa
                Cipher, algorithms, modes)
        except ImportError as exc:
            raise ImportError(
                "keras_geeps: CURVE keys need the `cryptography` package for "
                "the sealed data channel (pip install cryptography)") from exc
        self._cipher, self._gcm = Cipher, modes.GCM
        self.session = bytes(session)
        self._send_key = algorithms.AES(bytes(send_key))
        self._receive_key = algorithms.AES(bytes(receive_key))
        self.sent = 0       # the last counter sealed
        self.received = 0   # the last counter opened

    def _aad(self, counter, count):
        return (MAGIC + self.session + counter.to_bytes(8, "little")
                + count.to_bytes(4, "little"))

    @staticmethod
    def _nonce(counter, index):
        return counter.to_bytes(8, "little") + index.to_bytes(4, "little")

    def seal(self, frames):
        """The sealed frames of one message (`frames`: bytes or buffers,
        at least one)."""
        if not frames:
            raise ValueError("a sealed message needs at least one frame")
        self.sent += 1
        counter = self.sent
        aad = self._aad(counter, len(frames))
        sealed = [MAGIC, self.session, counter.to_bytes(8, "little")]
        for index, frame in enumerate(frames):
            data = frame_bytes(frame)
            out = np.empty(data.nbytes + TAG_BYTES + 15, np.uint8)
            encryptor = self._cipher(
                self._send_key, self._gcm(self._nonce(counter, index))
            ).encryptor()
            encryptor.authenticate_additional_data(aad)
            written = encryptor.update_into(data, out)
            encryptor.finalize()
            out[written:written + TAG_BYTES] = np.frombuffer(encryptor.tag,
                                                             np.uint8)
            sealed.append(out[:written + TAG_BYTES])
        return sealed

    def open(self, frames):
        """The plain frames of a sealed message (64-byte aligned arrays).

        Raises:
            SealError: it is not a sealed message of this session, a tag
                fails, or its counter is not above the last one opened.
        """
        if len(frames) < 4 or bytes(frame_bytes(frames[0])) != MAGIC:
            # (a message has a header frame: with no frame nothing would
            # authenticate its counter)
            raise SealError("not a sealed message")
        if bytes(frame_bytes(frames[1])) != self.session:
            raise SealError("a sealed message of another session")
        counter_bytes = bytes(frame_bytes(frames[2]))
        if len(counter_bytes) != 8:
            raise SealError("a sealed message without its counter")
        counter = int.from_bytes(counter_bytes, "little")
        if counter <= self.received:
            raise SealError(f"counter {counter} is not above {self.received}:"
                            f" a replayed or reordered message")
        body = frames[3:]
        aad = self._aad(counter, len(body))
        opened = []
        for index, frame in enumerate(body):
            data = frame_bytes(frame)
            if data.nbytes < TAG_BYTES:
                raise SealError(f"sealed frame {index} is shorter than a tag")
            size = data.nbytes - TAG_BYTES
            decryptor = self._cipher(
                self._receive_key,
                self._gcm(self._nonce(counter, index),
                          bytes(data[size:]))).decryptor()
            decryptor.authenticate_additional_data(aad)
            out = aligned_empty(size + 15)  # DLPack, streaming ops
            written = decryptor.update_into(data[:size], out)
            try:
                decryptor.finalize()
            except Exception as exc:  # cryptography's InvalidTag
                raise SealError(f"sealed frame {index} does not "
                                f"authenticate") from exc
            opened.append(out[:written])
        self.received = counter
        return opened
