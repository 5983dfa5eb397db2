"""Push+pull round trip per clock through the shards vs raw pyzmq.

For parameter sets of 4, 64 and 256 MB over 1 and 2 shard processes, one
worker (BSP) adds a delta to the whole set, clocks, and reads the fresh
rows back (the shards' push). Beside it, in the same run, the same bytes
make a raw pyzmq round trip over the same transport: an echo process per
"shard" that sends every chunk message straight back. GB/s counts the bytes
sent plus the bytes received, per second. keras_geeps runs with shared
memory off for that comparison (the transport shards on other machines
use); `geeps_shm_gbps` is the same round trip through shared memory, which
co-located workers and shards use by default.

Usage:
    python benchmarks/ps_throughput.py [--sizes-mb 4 64 256] [--shards 1 2]

The last line is a JSON object; `ratio_vs_raw_zmq` is the 64 MB / 2 shard
figure (keras_geeps GB/s / raw pyzmq GB/s).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import zmq

from keras_geeps import protocol
from keras_geeps.launch import LocalCluster

WIDTH = 1024  # floats per row: 4 KiB rows


def echo_server():
    """Child mode: a ROUTER that returns every message to its sender."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind("tcp://127.0.0.1:0")
    print(sock.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            break
        sock.send_multipart(frames, copy=False)


def start_echo(count):
    procs, addresses = [], []
    for _ in range(count):
        proc = subprocess.Popen([sys.executable, __file__, "--echo-server"],
                                stdout=subprocess.PIPE)
        addresses.append(proc.stdout.readline().decode().strip())
        procs.append(proc)
    return procs, addresses


def raw_round_trip(addresses, nbytes, repeats, chunk_bytes):
    """Median seconds to send `nbytes` split over the echo servers and back."""
    context = zmq.Context()
    socks = []
    for address in addresses:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
    share = nbytes // len(socks)
    data = np.ones(share // 4, np.float32)
    back = np.empty_like(data)
    step = chunk_bytes // 4
    chunks = [(s, min(s + step, data.size)) for s in range(0, data.size, step)]
    times = []
    for i in range(repeats + 2):
        started = time.perf_counter()
        for sock in socks:
            for s, e in chunks:
                sock.send_multipart([b"h", data[s:e]], copy=False)
        for sock in socks:
            for s, e in chunks:
                frames = sock.recv_multipart(copy=False)
                back[s:e] = np.frombuffer(frames[1].buffer, np.float32)
        if i >= 2:
            times.append(time.perf_counter() - started)
    for sock in socks:
        sock.send_multipart([b"stop"])
        sock.close()
    context.term()
    return statistics.median(times)


def geeps_round_trip(num_shards, nbytes, repeats, chunk_bytes,
                     shared_memory=False):
    """Median seconds per clock: update the whole set, clock, read it back."""
    rows = nbytes // (WIDTH * 4)
    with LocalCluster(num_shards, 1, processes=True) as cluster:
        with cluster.client(0, slack=0, timeout=300, chunk_bytes=chunk_bytes,
                            shared_memory=shared_memory) as client:
            table = client.create_table("params", rows, WIDTH)
            out = np.empty((rows, WIDTH), np.float32)
            deltas = [np.full((rows, WIDTH), 0.5, np.float32)
                      for _ in range(2)]
            times = []
            for i in range(repeats + 2):
                started = time.perf_counter()
                client.update(table, deltas[i % 2], copy=False)
                client.clock()
                client.read(table, out=out)
                if i >= 2:
                    times.append(time.perf_counter() - started)
            assert out[0, 0] == 0.5 * (repeats + 2), "lost an update"
            assert out[-1, -1] == out[0, 0]
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+",
                        default=[4, 64, 256])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunk-bytes", type=int,
                        default=protocol.DEFAULT_CHUNK_BYTES)
    parser.add_argument("--echo-server", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        echo_server()
        return
    results = {}
    print(f"{'size':>7} {'shards':>6} {'geeps GB/s':>11} {'raw zmq GB/s':>13}"
          f" {'ratio':>6} {'shm GB/s':>10}")
    for size_mb in args.sizes_mb:
        nbytes = size_mb << 20
        repeats = max(3, min(30, 512 // size_mb))
        for shards in args.shards:
            procs, addresses = start_echo(shards)
            try:
                raw = raw_round_trip(addresses, nbytes, repeats,
                                     args.chunk_bytes)
            finally:
                for proc in procs:
                    proc.wait(10)
            ours = geeps_round_trip(shards, nbytes, repeats, args.chunk_bytes)
            shared = geeps_round_trip(shards, nbytes, repeats,
                                      args.chunk_bytes, shared_memory=True)
            ours_gbs = 2 * nbytes / ours / 1e9
            shm_gbs = 2 * nbytes / shared / 1e9
            raw_gbs = 2 * nbytes / raw / 1e9
            results[f"{size_mb}MB_{shards}shard"] = {
                "geeps_gbps": round(ours_gbs, 3), "raw_zmq_gbps":
                round(raw_gbs, 3), "ratio": round(raw / ours, 3),
                "geeps_ms_per_clock": round(ours * 1e3, 2),
                "geeps_shm_gbps": round(shm_gbs, 3)}
            print(f"{size_mb:>5}MB {shards:>6} {ours_gbs:>11.2f} "
                  f"{raw_gbs:>13.2f} {raw / ours:>6.2f} {shm_gbs:>10.2f}",
                  flush=True)
    key = "64MB_2shard"
    summary = {"ratio_vs_raw_zmq": results.get(key, {}).get("ratio"),
               "results": results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
