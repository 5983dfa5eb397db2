"""Training throughput under device-memory budgets (GeePS' memory manager).

One deep MLP (`--layers` hidden Dense(`--width`, relu) layers, synthetic
data: this measures speed, not accuracy) is trained by the layer-wise
trainer with `device_memory_budget` at 100%, 50%, 25% and 10% of its
parameter bytes (`offload_activations="auto"`, so the planner may also move
activations when the tables alone do not fit), and, for context, with no
budget and by plain Keras (`GradientTape` over the whole model, the same
optimizer). Every configuration runs `--rounds` times, interleaved, and
its best round counts (the machine may be shared). Each row gives the
plan's figures: resident / staged table bytes, pool, peak working set,
activations offloaded, and the ledger's measured peak.

Usage:
    python benchmarks/memory_bench.py [--layers 32] [--width 1024]
        [--batch 128] [--steps 4] [--rounds 3]

The last line is a JSON object with `budget50_vs_full`, `budget25_vs_full`
and `budget10_vs_full`: samples/s at that budget over samples/s at 100%
(target: >= 0.8 at 25% on the CPU).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_geeps.memory.trainer import LayerwiseTrainer  # noqa: E402

BUDGETS = [("full", 1.0), ("budget50", 0.5), ("budget25", 0.25),
           ("budget10", 0.1)]


def build(args):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((args.width,))]
    layers += [keras.layers.Dense(args.width, activation="relu")
               for _ in range(args.layers)]
    return keras.Sequential(layers + [keras.layers.Dense(16)])


def data(args):
    rng = np.random.default_rng(0)
    xs = [tf.constant(rng.standard_normal((args.batch, args.width),
                                          np.float32))
          for _ in range(args.steps)]
    ys = [tf.constant(rng.integers(0, 16, args.batch)) for _ in xs]
    return xs, ys


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def run_trainer(args, budget, batches):
    model = build(args)
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.01), loss_fn(),
                               args.batch, device_memory_budget=budget,
                               offload_activations="auto")
    xs, ys = batches
    try:
        for x, y in zip(xs[:2], ys[:2]):  # traces, warms up
            float(trainer.train_step(x, y))
        start = time.perf_counter()
        for x, y in zip(xs, ys):
            loss = trainer.train_step(x, y)
        float(loss)
        seconds = time.perf_counter() - start
        return seconds, trainer.plan, trainer.stats()
    finally:
        trainer.close()


def run_keras(args, batches):
    model = build(args)
    optimizer = keras.optimizers.SGD(0.01)
    loss = loss_fn()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return value

    xs, ys = batches
    for x, y in zip(xs[:2], ys[:2]):
        float(step(x, y))
    start = time.perf_counter()
    for x, y in zip(xs, ys):
        value = step(x, y)
    float(value)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    batches = data(args)
    model = build(args)
    param_bytes = sum(int(np.prod(v.shape)) * 4
                      for v in model.trainable_variables)
    del model
    samples = args.batch * args.steps
    device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    print(f"model: {args.layers} x Dense({args.width}, relu) + Dense(16), "
          f"{param_bytes / 2**20:.1f} MiB of parameters; batch "
          f"{args.batch}, {args.steps} timed steps, best of {args.rounds} "
          f"rounds; device {device}", flush=True)
    configs = [("keras", None), ("unlimited", None)] + [
        (name, int(frac * param_bytes)) for name, frac in BUDGETS]
    best, plans, stats = {}, {}, {}
    for _ in range(args.rounds):
        for name, budget in configs:
            if name == "keras":
                seconds = run_keras(args, batches)
            else:
                seconds, plans[name], stats[name] = run_trainer(
                    args, budget, batches)
            best[name] = min(best.get(name, float("inf")), seconds)
    header = (f"{'config':<10} {'budget MiB':>10} {'samples/s':>10} "
              f"{'vs full':>8} {'resident':>9} {'staged':>8} {'pool':>7} "
              f"{'peak ws':>8} {'acts off':>8} {'ledger pk':>9} "
              f"{'wait s':>7}")
    print(header)
    mib = 2**20
    result = {}
    for name, budget in configs:
        rate = samples / best[name]
        ratio = best["full"] / best[name]
        row = (f"{name:<10} {(budget or 0) / mib:>10.1f} {rate:>10.1f} "
               f"{ratio:>8.3f}")
        if name in plans:
            p, s = plans[name], stats[name]
            row += (f" {p.resident_bytes / mib:>9.1f} "
                    f"{p.staged_bytes / mib:>8.1f} {p.pool_bytes / mib:>7.1f}"
                    f" {p.peak_working_set / mib:>8.1f} "
                    f"{p.activation_host_bytes / mib:>8.1f} "
                    f"{s['peak_device_bytes'] / mib:>9.1f} "
                    f"{s['prefetch_wait_seconds']:>7.2f}")
            assert budget is None or s["peak_device_bytes"] <= budget
        print(row, flush=True)
        result[f"{name}_samples_per_s"] = round(rate, 1)
        if name.startswith("budget"):
            result[f"{name}_vs_full"] = round(ratio, 3)
    result["full_vs_unlimited"] = round(best["unlimited"] / best["full"], 3)
    result["unlimited_vs_keras"] = round(best["keras"] / best["unlimited"],
                                         3)
    result["param_bytes"] = param_bytes
    print(json.dumps(result))


if __name__ == "__main__":
    main()
