"""Where the CPU of fault_bench's 16 MB round trip goes, thread by thread.

fault_bench's `curve_vs_plain` times a push+pull round trip of a 16 MB
table (1 worker, 1 shard process, shared memory off), sealed against plain.
This script runs the same trip alone on each side in turn (plain, sealed,
plain, sealed), `--trips` times, and reads every thread's user+system time
from /proc/<pid>/task/*/stat before and after: the worker's threads (this
process: its main thread, its I/O thread `geeps-io-w0`, ZeroMQ's
`ZMQbg/IO/*`, pyzmq's frame-freeing thread) and the shard's (its serve
loop is "main"). Also the share
of both cores busy over the loop (/proc/stat). Linux only.

Usage:
    python benchmarks/round_trip_cpu.py [--trips 200]

The last line is a JSON object: per side, `ms_per_trip`, `cores_busy` and
`cpu_ms_per_trip` (thread name -> CPU ms per trip, summed over the
side's two runs and divided by the trips of both).
"""

import argparse
import collections
import json
import os
import tempfile
import threading
import time

import numpy as np

import fault_bench  # (benchmarks/ is on sys.path)
from keras_geeps.launch import LocalCluster

TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def _python_thread_names():
    """{native thread id: name} of this process's Python threads (the OS
    calls them all "python"); pyzmq's frame-freeing thread by its class."""
    names = {}
    for thread in threading.enumerate():
        cls = type(thread).__name__
        names[thread.native_id] = ("pyzmq gc" if "Garbage" in cls
                                   else thread.name)
    return names


def thread_cpu_ms(pid, prefix):
    """{prefix + thread name: CPU ms so far} of process `pid`'s threads
    (threads of one name summed: ZeroMQ's I/O threads, say). In another
    process the main thread is "main" and other Python threads "python"."""
    names = _python_thread_names() if pid == os.getpid() else {pid: "main"}
    cpu = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid)) or stat[stat.index("(") + 1:
                                           stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        # fields 14 and 15 of stat(5) (utime, stime), counted from 3 here
        cpu[prefix + name] += (int(fields[11]) + int(fields[12])) * TICK_MS
    return cpu


def idle_and_total_ticks():
    """(idle + iowait ticks, all ticks) of all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)


def measure(keys_dir, sealed, trips, rows=4096, width=1024):
    """One side's loop: (seconds per trip, cores busy, Counter of CPU ms
    by thread over the loop)."""
    shard_args, curve = [], None
    if sealed:
        shard_args = fault_bench.curve_shard_args(keys_dir)
        curve = fault_bench.curve_client_keys(keys_dir)
    with LocalCluster(1, 1, processes=True, output=None,
                      shard_args=shard_args) as cluster, \
            cluster.client(0, timeout=60, curve=curve,
                           shared_memory=False) as client:
        table = client.create_table("p", rows, width)
        out = np.empty((rows, width), np.float32)
        delta = np.ones((rows, width), np.float32)

        def trip():
            client.update(table, delta, copy=False)
            client.clock()
            client.read(table, out=out)

        for _ in range(3):
            trip()
        shard_pid = cluster.shards[0].process.pid

        def snapshot():
            return (thread_cpu_ms(os.getpid(), "worker ")
                    + thread_cpu_ms(shard_pid, "shard "))

        before, (idle0, all0) = snapshot(), idle_and_total_ticks()
        started = time.perf_counter()
        for _ in range(trips):
            trip()
        seconds = (time.perf_counter() - started) / trips
        after, (idle1, all1) = snapshot(), idle_and_total_ticks()
    busy = os.cpu_count() * (1 - (idle1 - idle0) / max(1, all1 - all0))
    after.subtract(before)
    return seconds, busy, after


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=200)
    args = parser.parse_args()
    sides = {"plain": [], "sealed": []}
    with tempfile.TemporaryDirectory() as keys:
        fault_bench.write_curve_keys(keys)
        for name in ("plain", "sealed") * 2:
            seconds, busy, cpu = measure(keys, name == "sealed", args.trips)
            sides[name].append((seconds, busy, cpu))
            print(f"{name}: {seconds * 1e3:.2f} ms per trip, {busy:.2f} "
                  f"cores busy; CPU ms per trip: " + ", ".join(
                      f"{k} {v / args.trips:.2f}"
                      for k, v in sorted(cpu.items()) if v > 0), flush=True)
    report = {}
    for name, runs in sides.items():
        total = collections.Counter()
        for _, _, cpu in runs:
            total.update(cpu)
        report[name] = {
            "ms_per_trip": round(1e3 * np.mean([r[0] for r in runs]), 2),
            "cores_busy": round(float(np.mean([r[1] for r in runs])), 2),
            "cpu_ms_per_trip": {
                k: round(v / (args.trips * len(runs)), 2)
                for k, v in sorted(total.items()) if v > 0}}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
