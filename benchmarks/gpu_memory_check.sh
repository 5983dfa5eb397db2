#!/usr/bin/env bash
# The memory case of the GPU check (benchmarks/gpu_check.sh calls it):
#   1. runs tests/memory on the GPU (swapping changes no weight; the ledger's
#      measured bytes never exceed the budget);
#   2. trains a 2.7 GB MLP (40 x Dense(4096)) with no budget and with budgets
#      of 50%, 25% and 10% of its parameter bytes, each in its own process,
#      and compares the peak GPU memory TensorFlow reports
#      (tf.config.experimental.get_memory_info) with the budget plus
#      TensorFlow's own workspace (gradients, kernel scratch: measured as the
#      no-budget run's peak minus the bytes the trainer itself holds there);
#   3. runs benchmarks/memory_bench.py at GPU sizes.
# Without a GPU it says so and stops after step 1 (whose GPU-only parts skip).
#
# Usage: bash benchmarks/gpu_memory_check.sh [python]  (default: .venv/bin/python)
source "$(dirname "$0")/gpu_env.sh" "$@"

echo "== tests/memory"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/memory

if ! has_gpu; then
  echo "no GPU visible to TensorFlow: peak-memory and benchmark parts skipped"
  exit 0
fi

echo "== peak GPU memory under a budget"
RUN=$(mktemp -d)
trap 'rm -rf "$RUN"' EXIT
cat >"$RUN/one.py" <<'EOF'
"""One configuration in a fresh process: prints a JSON line."""
import json
import sys

import keras
import numpy as np
import tensorflow as tf

from keras_geeps.memory.trainer import LayerwiseTrainer

LAYERS, WIDTH, BATCH, STEPS = 40, 4096, 256, 3
fraction = None if sys.argv[1] == "none" else float(sys.argv[1])
keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((WIDTH,))]
    + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS)]
    + [keras.layers.Dense(16)])
params = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
budget = None if fraction is None else int(fraction * params)
trainer = LayerwiseTrainer(
    model, keras.optimizers.SGD(0.01),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True), BATCH,
    device_memory_budget=budget, offload_activations="auto")
rng = np.random.default_rng(0)
x = rng.standard_normal((BATCH, WIDTH), np.float32)
y = rng.integers(0, 16, BATCH)
float(trainer.train_step(x, y))          # traces, warms the allocator
tf.config.experimental.reset_memory_stats("GPU:0")
for _ in range(STEPS):
    loss = trainer.train_step(x, y)
float(loss)
info = tf.config.experimental.get_memory_info("GPU:0")
stats = trainer.stats()
print(json.dumps({
    "fraction": fraction, "budget": budget, "param_bytes": params,
    "tf_peak": info["peak"], "tf_current": info["current"],
    "ledger_peak": stats["peak_device_bytes"],
    "plan_device_bytes": trainer.plan.device_bytes,
    "step_s": stats["step_seconds"] / stats["steps"]}))
trainer.close()
EOF
for f in none 0.5 0.25 0.1; do
  "$PY" "$RUN/one.py" "$f" | tail -n 1 | tee -a "$RUN/results.jsonl"
done
"$PY" - "$RUN/results.jsonl" <<'EOF'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
free = rows[0]
workspace = free["tf_peak"] - free["ledger_peak"]
mib = 2**20
print(f"TensorFlow's own workspace (no-budget peak - trainer's bytes): "
      f"{workspace / mib:.0f} MiB")
print(f"{'budget':>8} {'MiB':>8} {'TF peak':>9} {'ledger':>8} "
      f"{'limit':>9} {'ok':>4} {'step s':>7}")
failed = False
for r in rows:
    limit = None if r["budget"] is None else r["budget"] + workspace
    ok = limit is None or r["tf_peak"] <= limit * 1.02
    failed |= not ok
    name = "none" if r["fraction"] is None else f"{r['fraction']:.0%}"
    print(f"{name:>8} {(r['budget'] or 0) / mib:>8.0f} "
          f"{r['tf_peak'] / mib:>9.0f} {r['ledger_peak'] / mib:>8.0f} "
          f"{(limit or 0) / mib:>9.0f} {'yes' if ok else 'NO':>4} "
          f"{r['step_s']:>7.3f}")
sys.exit(1 if failed else 0)
EOF

echo "== memory_bench (GPU sizes)"
"$PY" benchmarks/memory_bench.py --layers 40 --width 4096 --batch 512 \
  --steps 8 --rounds 2
