"""Raw pyzmq echo of 16 MB in 2 MiB frames (for curve_link_check.sh).

`serve ADDRESS MODE` echoes; `ask ADDRESS MODE` prints the median round
trip in ms over 20 runs. MODE: `plain`; `curve` (libzmq's CURVE encrypts
every frame); `sealed` (no CURVE; each message sealed by keras_geeps's data
channel, `keras_geeps.seal.Channel`, as a CURVE-keyed job's data travels,
though sealed up front: without `seal.Sender`'s pacing).
"""

import statistics
import sys
import time

import numpy as np
import zmq

from keras_geeps import seal

CHUNK, TOTAL = 2 << 20, 16 << 20
# A throwaway key pair and session, the same in both processes (a
# benchmark only).
PUBLIC = b"qy#Ag*hQgz5X(s5!fFE/oLKL#!S6pyKtq{24*lzI"
SECRET = b"!kfyYERMcTK[+NYNg?Kx&bej^n*sk=tI*=Km%.A0"
SESSION, C2S, S2C = b"Sbench!!", bytes(range(32)), bytes(range(32, 64))


def channel(role, mode):
    if mode != "sealed":
        return None
    if role == "serve":
        return seal.Channel(SESSION, S2C, C2S)
    return seal.Channel(SESSION, C2S, S2C)


def _chunks(array):
    """The CHUNK-sized views of a TOTAL-byte array, in order."""
    return [array[k:k + CHUNK] for k in range(0, TOTAL, CHUNK)]


def _framed(sealer, part):
    """The frames that carry `part` (sealed, with a sealer)."""
    return sealer.seal([part]) if sealer else [part]


def _body(sealer, frames):
    """The chunk that received `frames` carry (opened, with a sealer)."""
    return sealer.open(frames)[0] if sealer else frames[0].buffer


def serve(sock, mode):
    rows = np.zeros(TOTAL, np.uint8)
    into = np.empty(TOTAL, np.uint8)
    sealer = channel("serve", mode)
    while True:
        for dest in _chunks(into):
            ident, *frames = sock.recv_multipart(copy=False)
            if len(frames[-1]) == 1:
                return
            dest[:] = _body(sealer, frames)
        for part in _chunks(rows):
            sock.send_multipart([ident.bytes] + _framed(sealer, part),
                                copy=False)


def ask(sock, mode):
    data, out = np.ones(TOTAL, np.uint8), np.empty(TOTAL, np.uint8)
    sealer, times = channel("ask", mode), []
    for i in range(22):
        started = time.perf_counter()
        for part in _chunks(data):
            sock.send_multipart(_framed(sealer, part), copy=False)
        for dest in _chunks(out):
            dest[:] = _body(sealer, sock.recv_multipart(copy=False))
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
