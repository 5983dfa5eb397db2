"""Shard kill/restart cycles (nothing lost, nothing twice) and CURVE's cost.

Part 1: 4 workers (threads) on 2 shard processes with `--checkpoint-every
5` run BSP; every `--clocks-per-cycle` clocks worker 0 SIGKILLs one shard
(alternating), restarts it with `--restore` on the same address, and times
how long until its next read completes (kill, restart, the workers' replay,
the clock's advance). Every worker adds 1 to every element of a counter
table at every clock, so the final counters must equal workers x clocks:
anything below is an update lost, anything above one applied twice.

Part 2: CURVE on vs off, in the same run, with shared memory off (the
traffic of shards on other machines, which is what CURVE is for). With
CURVE keys, the HELLO goes over CURVE and everything else over the sealed
AEGIS-256X4 data channel (`keras_geeps.seal`):
  - `curve_vs_plain`: the push+pull round trip of a 16 MB table (1 worker,
    1 shard process), nothing but transfer: the worst case. The plain and
    the keyed cluster run side by side and their trips alternate (40 each,
    medians), so the machine's drift falls on both alike;
  - `curve_vs_plain_fit`: `model.fit` images/s of fit_bench's 1 M model,
    2 worker x 2 shard processes, BSP: what a training job sees (two runs
    each, in turn).

Usage:
    python benchmarks/fault_bench.py [--cycles 20]

The last line is a JSON object with `cycles`, `updates_lost`,
`updates_duplicated`, `recovery_s_median` and `curve_vs_plain` (and
`curve_vs_plain_fit`).
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np

from keras_geeps import shm
from keras_geeps.auth import ClientKeys, keygen
from keras_geeps.launch import LocalCluster


def kill_restart_cycles(cycles, clocks_per_cycle, workers=4):
    clocks = cycles * clocks_per_cycle + clocks_per_cycle
    recoveries = []
    with tempfile.TemporaryDirectory() as ckpt:
        cluster = LocalCluster(2, workers, processes=True, output=None,
                               shard_args=["--checkpoint-dir", ckpt,
                                           "--checkpoint-every", "5"])
        results, errors = {}, []
        killed = {}

        def run(w):
            try:
                with cluster.client(w, timeout=120,
                                    heartbeat_interval=0.2) as client:
                    table = client.create_table("counter", 1000, 128)
                    for clk in range(clocks):
                        client.read(table)
                        if w == 0 and "at" in killed:
                            recoveries.append(time.monotonic()
                                              - killed.pop("at"))
                        client.update(table, np.ones((1000, 128),
                                                     np.float32))
                        client.clock()
                        if w == 0 and clk % clocks_per_cycle == \
                                clocks_per_cycle - 1 and \
                                len(recoveries) < cycles:
                            victim = len(recoveries) % 2
                            killed["at"] = time.monotonic()
                            cluster.shards[victim].kill()
                            cluster.shards[victim] = \
                                cluster.shards[victim].restart(["--restore"])
                    results[w] = client.read(table, clock=clocks)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(w,))
                   for w in range(workers)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            cluster.stop()
        if errors:
            raise errors[0]
    expected = workers * clocks
    lost = max(max(0.0, expected - float(r.min())) for r in results.values())
    duplicated = max(max(0.0, float(r.max()) - expected)
                     for r in results.values())
    return len(recoveries), int(lost), int(duplicated), recoveries


def write_curve_keys(curve_dir, clients=("worker",)):
    """Writes a shard key pair and one per name of `clients` into
    `curve_dir`, the clients' public keys also into `curve_dir/allowed`."""
    os.makedirs(f"{curve_dir}/allowed", exist_ok=True)
    keygen(curve_dir, "shard")
    for name in clients:
        keygen(curve_dir, name)
        shutil.copy(f"{curve_dir}/{name}.key",
                    f"{curve_dir}/allowed/{name}.key")


def curve_shard_args(curve_dir):
    """A keyed shard's flags, with the keys `write_curve_keys` wrote to
    `curve_dir`."""
    return ["--curve-secret-key", f"{curve_dir}/shard.key_secret",
            "--curve-allowed-clients", f"{curve_dir}/allowed"]


def curve_client_keys(curve_dir):
    """The "worker" client's `ClientKeys`, with the keys `write_curve_keys`
    wrote to `curve_dir`."""
    return ClientKeys(f"{curve_dir}/worker.key_secret",
                      f"{curve_dir}/shard.key")


def round_trip_seconds(curve_dir, nbytes=16 << 20, repeats=40):
    """Median push+pull round trip of a `nbytes` table, plain and sealed.

    Both clusters (1 shard process each) run at once and their trips
    alternate, so the machine's drift (two cores, shared with the shards)
    falls on both alike. Returns (plain seconds, sealed seconds).
    """
    rows = nbytes // 4096
    keys = curve_client_keys(curve_dir)
    curve_args = curve_shard_args(curve_dir)
    with contextlib.ExitStack() as stack:
        runs = []
        for shard_args, curve in (([], None), (curve_args, keys)):
            cluster = stack.enter_context(LocalCluster(
                1, 1, processes=True, output=None, shard_args=shard_args))
            client = stack.enter_context(cluster.client(
                0, timeout=60, curve=curve, shared_memory=False))
            runs.append((client, client.create_table("p", rows, 1024), []))
        out = np.empty((rows, 1024), np.float32)
        delta = np.ones((rows, 1024), np.float32)
        for i in range(repeats + 2):
            for client, table, times in runs:
                started = time.perf_counter()
                client.update(table, delta, copy=False)
                client.clock()
                client.read(table, out=out)
                if i >= 2:
                    times.append(time.perf_counter() - started)
    return tuple(statistics.median(times) for _, _, times in runs)


def fit_images_per_s(curve_dir, rounds=2):
    """fit_bench's 1 M model, 2 workers x 2 shards, BSP: images/s without
    and with CURVE (shared memory off on both sides), each the mean of
    `rounds` runs taken in turn (plain, CURVE, plain, ...)."""
    import fit_bench  # noqa: PLC0415 (benchmarks/ is on sys.path)
    args = argparse.Namespace(steps=40, batch=128, steps_per_execution=1)
    curve_args = curve_shard_args(curve_dir)
    figures = ([], [])
    saved = os.environ.get(shm.ENV_SWITCH)
    os.environ[shm.ENV_SWITCH] = "0"  # workers inherit it
    try:
        for _ in range(rounds):
            for runs, shard_args, keys in ((figures[0], [], ""),
                                           (figures[1], curve_args,
                                            curve_dir)):
                workers = fit_bench.run_config(
                    args, "1M", 2, 2, shard_args=["--no-shared-memory",
                                                  *shard_args],
                    curve_dir=keys)
                runs.append(fit_bench.cluster_images_per_s(workers))
    finally:
        if saved is None:
            del os.environ[shm.ENV_SWITCH]
        else:
            os.environ[shm.ENV_SWITCH] = saved
    return tuple(statistics.mean(runs) for runs in figures)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--clocks-per-cycle", type=int, default=8)
    args = parser.parse_args()
    cycles, lost, duplicated, recoveries = kill_restart_cycles(
        args.cycles, args.clocks_per_cycle)
    print(f"{cycles} kill/restart cycles: lost {lost}, duplicated "
          f"{duplicated}, recovery median {statistics.median(recoveries):.2f}"
          f" s (max {max(recoveries):.2f} s)", flush=True)
    with tempfile.TemporaryDirectory() as keys:
        write_curve_keys(keys, ("worker", "worker0", "worker1"))
        plain, curve = round_trip_seconds(keys)
        print(f"16 MB round trip: plain {plain * 1e3:.1f} ms, CURVE "
              f"{curve * 1e3:.1f} ms", flush=True)
        fit_plain, fit_curve = fit_images_per_s(keys)
        print(f"model.fit 1 M model, 2 workers x 2 shards: plain "
              f"{fit_plain:.0f} images/s, CURVE {fit_curve:.0f} images/s",
              flush=True)
    print(json.dumps({
        "cycles": cycles, "updates_lost": lost,
        "updates_duplicated": duplicated,
        "recovery_s_median": round(statistics.median(recoveries), 3),
        "recovery_s_max": round(max(recoveries), 3),
        "curve_vs_plain": round(plain / curve, 3),
        "curve_vs_plain_fit": round(fit_curve / fit_plain, 3),
        "plain_fit_images_per_s": round(fit_plain, 1),
        "curve_fit_images_per_s": round(fit_curve, 1),
        "plain_round_trip_ms": round(plain * 1e3, 2),
        "curve_round_trip_ms": round(curve * 1e3, 2)}))


if __name__ == "__main__":
    main()
