"""Raw pyzmq echo of 16 MB in 2 MiB frames (for curve_link_check.sh).

`serve ADDRESS MODE` echoes; `ask ADDRESS MODE` prints the median round
trip in ms over 20 runs. MODE: `plain`; `curve` (libzmq's CURVE encrypts
every frame); `aesgcm` (no CURVE; each frame sealed with AES-256-GCM
through the `cryptography` package into a reused buffer, as a CURVE-keyed
data channel would: what a faster cipher would buy).
"""

import statistics
import sys
import time

import numpy as np
import zmq

CHUNK, TOTAL, TAG = 2 << 20, 16 << 20, 16
# A throwaway key pair, the same in both processes (a benchmark only).
PUBLIC = b"qy#Ag*hQgz5X(s5!fFE/oLKL#!S6pyKtq{24*lzI"
SECRET = b"!kfyYERMcTK[+NYNg?Kx&bej^n*sk=tI*=Km%.A0"
AES_KEY = bytes(range(32))


class Sealer:
    """AES-256-GCM per frame, nonce = a counter per direction."""

    def __init__(self, direction):
        from cryptography.hazmat.primitives.ciphers import (  # noqa: PLC0415
            Cipher, algorithms, modes)
        self._cipher = lambda nonce, tag=None: Cipher(
            algorithms.AES(AES_KEY), modes.GCM(nonce, tag))
        self.direction, self.count = direction, 0
        self.buffers = [np.empty(CHUNK + 64, np.uint8)
                        for _ in range(TOTAL // CHUNK)]

    def _nonce(self, direction, count):
        return bytes([direction]) + count.to_bytes(11, "little")

    def seal(self, k, frame):
        self.count += 1
        enc = self._cipher(self._nonce(self.direction, self.count)).encryptor()
        out = self.buffers[k]
        n = enc.update_into(frame, out)
        enc.finalize()
        out[n:n + TAG] = np.frombuffer(enc.tag, np.uint8)
        return out[:n + TAG]

    def open(self, frame, out, direction, count):
        data = memoryview(frame)
        dec = self._cipher(self._nonce(direction, count),
                           bytes(data[-TAG:])).decryptor()
        dec.update_into(data[:-TAG], out)
        dec.finalize()  # raises InvalidTag on a forged frame


def serve(sock, mode):
    rows = np.zeros(TOTAL, np.uint8)
    into = np.empty(TOTAL + 64, np.uint8)
    sealer, received = Sealer(1) if mode == "aesgcm" else None, 0
    while True:
        for k in range(TOTAL // CHUNK):
            ident, frame = sock.recv_multipart(copy=False)
            if len(frame) == 1:
                return
            if sealer:
                received += 1
                sealer.open(frame.buffer,
                            into[k * CHUNK:(k + 1) * CHUNK + 15], 0,
                            received)
        for k in range(TOTAL // CHUNK):
            part = rows[k * CHUNK:(k + 1) * CHUNK]
            sock.send_multipart(
                [ident.bytes, sealer.seal(k, part) if sealer else part],
                copy=False)


def ask(sock, mode):
    data, out = np.ones(TOTAL, np.uint8), np.empty(TOTAL + 64, np.uint8)
    sealer, received, times = Sealer(0) if mode == "aesgcm" else None, 0, []
    for i in range(22):
        started = time.perf_counter()
        for k in range(TOTAL // CHUNK):
            part = data[k * CHUNK:(k + 1) * CHUNK]
            sock.send(sealer.seal(k, part) if sealer else part, copy=False)
        for k in range(TOTAL // CHUNK):
            frame = sock.recv(copy=False)
            if sealer:
                received += 1
                sealer.open(frame.buffer,
                            out[k * CHUNK:(k + 1) * CHUNK + 15], 1, received)
        if i >= 2:
            times.append(time.perf_counter() - started)
    sock.send(b"x")
    time.sleep(0.3)
    print(f"{statistics.median(times) * 1e3:.1f}")


def main(role, address, mode):
    context = zmq.Context(io_threads=2)
    sock = context.socket(zmq.ROUTER if role == "serve" else zmq.DEALER)
    if mode == "curve" and role == "serve":
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = SECRET, PUBLIC
    elif mode == "curve":
        sock.curve_serverkey = PUBLIC
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    if role == "serve":
        sock.bind(address)
        serve(sock, mode)
    else:
        sock.connect(address)
        ask(sock, mode)


if __name__ == "__main__":
    main(*sys.argv[1:4])
