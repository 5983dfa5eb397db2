"""Benchmarks keras_geeps.ops against the best pure-TensorFlow equivalents.

In the same run, on the same data, both sides compiled with tf.function,
warmed up and called in turns (so background load hits both alike), the
median of repeats:

- pack of a ~10M-parameter model of 20 variables vs tf.concat of reshapes,
- unpack (assign) of it vs tf.split + one assign per variable,
- gather of rows from a variable vs tf.gather (ResourceGather),
- scatter-add of rows into a variable vs tf.Variable.scatter_add,
- pack vs a plain numpy copy of the same bytes (allocating, like pack).

Prints a table, then as its last line a JSON object with `pack_vs_tf`,
`unpack_vs_tf`, `gather_vs_tf`, `scatter_add_vs_tf` (our speed / TF's speed,
higher is better) and `pack_vs_memcpy` (our speed / numpy copy's speed).

Example:

```
python benchmarks/ops_bench.py --repeats 30
```
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_geeps import ops  # noqa: E402


def median_seconds(fns, repeats, warmup=3):
    """Median wall time of each of `fns` over `repeats` calls.

    The functions take turns call by call, so load from other processes
    falls on all of them alike and their ratio stays meaningful.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def model_variables(rng, layers=10, width=1000):
    """~10M parameters in 20 variables: [width, width] kernels and biases."""
    variables = []
    for _ in range(layers):
        variables.append(tf.Variable(
            rng.standard_normal((width, width), dtype=np.float32)))
        variables.append(tf.Variable(
            rng.standard_normal((width,), dtype=np.float32)))
    return variables


def bench_pack_unpack(rng, repeats):
    variables = model_variables(rng)
    layout = ops.PackLayout(variables)
    sizes = list(layout.sizes)

    ours_pack = tf.function(lambda: ops.pack(variables, layout))
    tf_pack = tf.function(
        lambda: tf.concat([tf.reshape(v, [-1]) for v in variables], 0))
    np.testing.assert_array_equal(ours_pack().numpy(), tf_pack().numpy())

    buffer = tf.constant(rng.standard_normal(layout.total_size,
                                             dtype=np.float32))

    @tf.function
    def ours_unpack(b):
        ops.unpack(b, variables, layout)

    @tf.function
    def tf_unpack(b):
        for v, piece, shape in zip(variables, tf.split(b, sizes),
                                   layout.shapes):
            v.assign(tf.reshape(piece, shape))

    ours_unpack(buffer)
    np.testing.assert_array_equal(ours_pack().numpy(), buffer.numpy())
    tf_unpack(buffer * 2)
    np.testing.assert_array_equal(ours_pack().numpy(), buffer.numpy() * 2)

    source = buffer.numpy()
    pack, pack_tf, memcpy = median_seconds([ours_pack, tf_pack, source.copy],
                                           repeats)
    unpack, unpack_tf = median_seconds(
        [lambda: ours_unpack(buffer), lambda: tf_unpack(buffer)], repeats)
    return {"params": layout.total_size, "pack": pack, "pack_tf": pack_tf,
            "unpack": unpack, "unpack_tf": unpack_tf, "memcpy": memcpy,
            "bytes": source.nbytes}


def bench_rows(rng, repeats, rows=200_000, width=128, n=65_536):
    values = rng.standard_normal((rows, width), dtype=np.float32)
    indices = tf.constant(rng.integers(0, rows, size=n), tf.int32)
    updates = tf.constant(rng.standard_normal((n, width), dtype=np.float32))
    table = tf.Variable(values)

    ours_gather = tf.function(lambda i: ops.gather_rows(table, i))
    tf_gather = tf.function(lambda i: tf.gather(table, i))
    np.testing.assert_array_equal(ours_gather(indices).numpy(),
                                  tf_gather(indices).numpy())

    ours_table = tf.Variable(values)
    tf_table = tf.Variable(values)

    @tf.function
    def ours_scatter(i, u):
        ops.scatter_add_rows(ours_table, i, u)

    @tf.function
    def tf_scatter(i, u):
        tf_table.scatter_add(tf.IndexedSlices(u, i))

    ours_scatter(indices, updates)
    tf_scatter(indices, updates)
    np.testing.assert_allclose(ours_table.numpy(), tf_table.numpy(),
                               rtol=1e-5, atol=1e-5)
    gather, gather_tf = median_seconds(
        [lambda: ours_gather(indices), lambda: tf_gather(indices)], repeats)
    scatter, scatter_tf = median_seconds(
        [lambda: ours_scatter(indices, updates),
         lambda: tf_scatter(indices, updates)], repeats)
    return {"gather": gather, "gather_tf": gather_tf, "scatter_add": scatter,
            "scatter_add_tf": scatter_tf, "row_bytes_moved": n * width * 4}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    packs = bench_pack_unpack(rng, args.repeats)
    rows = bench_rows(rng, args.repeats)

    gb = 1e9
    print(f"library: {ops.library_path()}")
    intra = (tf.config.threading.get_intra_op_parallelism_threads()
             or os.cpu_count())
    print(f"threads: TF intra-op {intra}, cpus {os.cpu_count()}, load "
          f"{os.getloadavg()[0]:.1f}; median of {args.repeats}")
    print(f"{'op':<28}{'ours ms':>10}{'TF ms':>10}{'ours GB/s':>11}"
          f"{'ratio':>8}")
    lines = [
        ("pack (%.1fM params)" % (packs["params"] / 1e6), packs["pack"],
         packs["pack_tf"], packs["bytes"]),
        ("unpack assign", packs["unpack"], packs["unpack_tf"], packs["bytes"]),
        ("gather rows", rows["gather"], rows["gather_tf"],
         rows["row_bytes_moved"]),
        ("scatter-add rows", rows["scatter_add"], rows["scatter_add_tf"],
         rows["row_bytes_moved"]),
    ]
    for name, ours, theirs, nbytes in lines:
        print(f"{name:<28}{ours * 1e3:>10.2f}{theirs * 1e3:>10.2f}"
              f"{nbytes / ours / gb:>11.2f}{theirs / ours:>8.2f}")
    print(f"{'numpy copy (same bytes)':<28}{packs['memcpy'] * 1e3:>10.2f}"
          f"{'':>10}{packs['bytes'] / packs['memcpy'] / gb:>11.2f}")
    result = {
        "pack_vs_tf": round(packs["pack_tf"] / packs["pack"], 3),
        "unpack_vs_tf": round(packs["unpack_tf"] / packs["unpack"], 3),
        "gather_vs_tf": round(rows["gather_tf"] / rows["gather"], 3),
        "scatter_add_vs_tf": round(
            rows["scatter_add_tf"] / rows["scatter_add"], 3),
        "pack_vs_memcpy": round(packs["memcpy"] / packs["pack"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
