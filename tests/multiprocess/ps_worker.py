"""A worker process for the multi-process tests (run by `launch`).

Each worker w adds (w + 1) * (c + 1) to every element of a table split over
the shards, and 1 to a small table, at every clock c; it records the data
age and value of every read and writes them, with its final reads, as JSON.
"""

import argparse
import json
import random
import sys
import time

import numpy as np

from keras_geeps.client import GeePSClient
from keras_geeps.cluster import ClusterSpec


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--clocks", type=int, default=50)
    parser.add_argument("--slack", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.0)
    parser.add_argument("--fail-worker", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    spec = ClusterSpec.from_env()
    w = spec.worker_id
    if w == args.fail_worker:
        time.sleep(0.5)
        print(f"worker {w} fails on purpose", flush=True)
        sys.exit(3)
    rng = random.Random(1234 + w)
    client = GeePSClient(spec, slack=args.slack, timeout=args.timeout)
    big = client.create_table("big", 1200, 128, init=np.ones((1200, 128)))
    small = client.create_table("small", 3, 5, dtype="float64")
    reads = []
    started = time.monotonic()
    for clk in range(args.clocks):
        values = client.read(big)
        parts = [[age, float(values[start:end].min()),
                  float(values[start:end].max())]
                 for age, (_, start, end) in zip(big.last_read_ages,
                                                 big.parts)]
        small_values = client.read(small)
        reads.append([clk, big.last_read_age, parts, small.last_read_age,
                      float(small_values.min()), float(small_values.max())])
        if args.max_delay:
            share = (w + 1) / spec.num_workers
            time.sleep(rng.uniform(0, args.max_delay) * share)
        client.update(big, np.full((1200, 128), (w + 1) * (clk + 1),
                                   np.float32))
        client.update(small, np.ones((3, 5)))
        client.clock()
    elapsed = time.monotonic() - started
    final = client.read(big, clock=args.clocks + args.slack)
    final_small = client.read(small, clock=args.clocks + args.slack)
    result = {"worker": w, "reads": reads, "elapsed": elapsed,
              "wait_seconds": client.wait_seconds,
              "final_min": float(final.min()), "final_max": float(final.max()),
              "final_small": float(final_small.min()),
              "final_small_max": float(final_small.max()),
              "stats": client.stats()}
    with open(f"{args.out}/worker{w}.json", "w") as f:
        json.dump(result, f)
    client.close()


if __name__ == "__main__":
    main()
