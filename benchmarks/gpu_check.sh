#!/usr/bin/env bash
# One prepared check of the custom ops on a GPU machine:
#   1. rebuilds the op library with the CUDA kernels (forced),
#   2. runs tests/test_ops.py, GPU variants included (they skip without a GPU),
#   3. prints gather / scatter-add bandwidth in GB/s beside a device-to-device
#      copy (tf.raw_ops.DeepCopy) in the same run.
# Without a GPU it still builds, runs the tests and says the bandwidth part
# was skipped, so it can be tried anywhere.
#
# Usage: bash benchmarks/gpu_check.sh [python]   (default: .venv/bin/python)
source "$(dirname "$0")/gpu_env.sh" "$@"

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  2>/dev/null || echo "nvidia-smi: none"

echo "== build (CUDA, forced)"
start=$(date +%s)
"$PY" -m keras_geeps._build --force --cuda
echo "build took $(( $(date +%s) - start )) s"

echo "== tests/test_ops.py"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_ops.py

echo "== bandwidth"
"$PY" - <<'EOF'
import time

import numpy as np
import tensorflow as tf

from keras_geeps import ops

if not tf.config.list_physical_devices("GPU"):
    print("no GPU visible to TensorFlow: bandwidth part skipped")
    raise SystemExit(0)


def per_call(fn, sync, calls=20):
    """Seconds per call of fn(), timed from the first call to the device
    being idle again (sync() fetches a scalar of the last result)."""
    for _ in range(3):
        sync(fn())
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    sync(out)
    return (time.perf_counter() - start) / calls


def sync_value(t):
    return tf.reshape(t, [-1])[:1].numpy()


with tf.device("/GPU:0"):
    rows, width, n = 1 << 20, 128, 1 << 20
    rng = np.random.default_rng(0)
    table = tf.Variable(tf.random.stateless_normal([rows, width], seed=[1, 2]))
    indices = tf.constant(rng.integers(0, rows, size=n), tf.int32)
    updates = tf.random.stateless_normal([n, width], seed=[3, 4])
    flat = tf.random.stateless_normal([n * width], seed=[5, 6])
    moved = n * width * 4  # bytes of rows gathered or added

    gather = tf.function(lambda: ops.gather_rows(table, indices))
    tf_gather = tf.function(lambda: tf.gather(table, indices))
    np.testing.assert_array_equal(gather().numpy(), tf_gather().numpy())

    def scatter():
        ops.scatter_add_rows(table, indices, updates)
        return table.handle

    copy = lambda: tf.raw_ops.DeepCopy(x=flat)
    results = {
        "gather_rows": per_call(gather, sync_value),
        "tf.gather": per_call(tf_gather, sync_value),
        "scatter_add_rows": per_call(
            scatter, lambda _: sync_value(ops.gather_rows(table, [0]))),
        "d2d copy (DeepCopy)": per_call(copy, sync_value),
    }
    # Reads plus writes: 2x the bytes for gather and copy, 3x for an add.
    traffic = {"gather_rows": 2, "tf.gather": 2, "scatter_add_rows": 3,
               "d2d copy (DeepCopy)": 2}
    for name, seconds in results.items():
        print(f"{name:<22} {seconds * 1e3:8.3f} ms  "
              f"{traffic[name] * moved / seconds / 1e9:8.1f} GB/s")
EOF

# The memory-management case (issue 5): tests/memory on the GPU, TF's peak
# GPU memory under a budget vs without, and memory_bench at GPU sizes.
bash benchmarks/gpu_memory_check.sh "$PY"

# The Keras face (issue 4) on the GPU: plain model.fit vs GeePS with one
# worker and one shard (the shard's add on the host, pack/unpack on the
# device), 10 M-parameter model; about a minute.
if has_gpu; then
  echo "== fit_bench (10 M model)"
  "$PY" benchmarks/fit_bench.py --models 10M
fi
