"""`model.fit` images/s: plain Keras vs GeePS (1 worker, 2x2 BSP and SSP).

For a ~1 M and a ~10 M parameter MLP (synthetic 784-feature inputs: this
measures throughput, not accuracy), one run measures
  - plain single-process `model.fit` (no strategy),
  - GeePS with 1 worker + 1 shard (BSP), with the optimizer's updates
    captured (the default) and measured on the variables
    (`capture_updates=False`),
  - GeePS with 2 workers x 2 shards, BSP and SSP (slack 1),
each as its own process(es), timing the second epoch (the first traces and
warms up). Per-step time waiting for parameters comes from the strategy.
A 2-worker rate is both workers' timed images over the span from the first
one's start to the last one's end (their epochs need not line up).

Usage:
    python benchmarks/fit_bench.py [--steps 40] [--batch 128] [--models 1M 10M]

The last line is a JSON object; `one_worker_vs_plain` is the 10 M model's
GeePS 1-worker images/s over plain images/s (target >= 0.9).
"""

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time

MODELS = {"1M": [1024, 256], "10M": [2048, 2048, 2048]}


def barrier(client):
    """Returns once every worker has called it (a 1-element table that
    each worker clocks once; reading it fresh waits for all of them)."""
    import numpy as np  # noqa: PLC0415
    table = client.create_table("fit_bench_barrier", 1, 1)
    client.update(table, np.ones((1, 1), np.float32))
    client.clock([table])
    client.wait_fresh(table, clock=table.clock + client.slack)


def worker_main(args):
    """Child mode: train one configuration and write its figures."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    strategy = None
    if args.geeps:
        import keras_geeps  # noqa: PLC0415
        curve = None
        if args.curve_dir:  # keys as fault_bench writes them
            from keras_geeps.auth import ClientKeys  # noqa: PLC0415
            from keras_geeps.cluster import ClusterSpec  # noqa: PLC0415
            worker = ClusterSpec.from_env().worker_id
            curve = ClientKeys(f"{args.curve_dir}/worker{worker}.key_secret",
                               f"{args.curve_dir}/shard.key")
        strategy = keras_geeps.GeePSStrategy(
            slack=args.slack, curve=curve,
            capture_updates=not args.no_capture)
    workers = strategy.num_workers if strategy else 1
    rng = np.random.default_rng(0)
    x = rng.random((args.steps * args.batch * workers, 784), np.float32)
    y = rng.integers(0, 10, len(x))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
    ds = strategy.distribute_dataset(ds) if strategy else ds
    ds = ds.cache().prefetch(4)

    def build():
        layers = [keras.Input((784,))]
        layers += [keras.layers.Dense(u, activation="relu")
                   for u in MODELS[args.model]]
        model = keras.Sequential(layers + [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), jit_compile=False,
                      steps_per_execution=args.steps_per_execution)
        return model

    if strategy:
        with strategy.scope():
            model = build()
    else:
        model = build()
    times = []
    windows = []  # wall-clock (start, end) of each epoch

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if strategy and times:
                # A barrier, so the workers' timed epochs start together:
                # tearing down the last fit's tf.data iterator can stall a
                # worker for seconds when the CPUs are saturated (its
                # prefetch threads), and the others would time their wait.
                barrier(strategy.client)
            self.start = time.perf_counter()
            self.wall_start = time.time()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)
            windows.append((self.wall_start, time.time()))

    callbacks = [EpochTimer()] + (strategy.callbacks() if strategy else [])
    before = None
    model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
    if strategy:
        before = strategy.ps_stats()
    model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
    figures = {"images_per_s": args.steps * args.batch / times[-1],
               "images": args.steps * args.batch, "window": windows[-1],
               "params": int(model.count_params())}
    if strategy:
        after = strategy.ps_stats()
        steps = max(1, after["steps"] - before["steps"])
        figures["wait_ms_per_step"] = 1e3 * (
            after["pull_wait_seconds"] - before["pull_wait_seconds"]) / steps
        figures["sync_ms_per_step"] = 1e3 * (
            (after["pull_seconds"] - before["pull_seconds"])
            + (after["push_seconds"] - before["push_seconds"])) / steps
        figures["worker"] = strategy.worker_id
        strategy.close()
    with open(os.path.join(args.out, f"fig{figures.get('worker', 0)}.json"),
              "w") as f:
        json.dump(figures, f)


def cluster_images_per_s(figures):
    """All workers' timed images over the span from the first worker's
    start to the last one's end: workers whose timed epochs do not line up
    (one traced longer) cannot overstate the cluster's rate."""
    start = min(f["window"][0] for f in figures)
    end = max(f["window"][1] for f in figures)
    return sum(f["images"] for f in figures) / (end - start)


def run_config(args, model, workers=0, shards=0, slack=0, shard_args=(),
               curve_dir="", worker_args=()):
    """Runs one configuration; returns the workers' figures."""
    from keras_geeps.launch import launch  # noqa: PLC0415
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, __file__, "--worker", "--out", out,
                   "--model", model, "--steps", str(args.steps), "--batch",
                   str(args.batch), "--steps-per-execution",
                   str(args.steps_per_execution), "--slack", str(slack)]
        if curve_dir:
            command += ["--curve-dir", curve_dir]
        command += list(worker_args)
        if workers:
            log = io.StringIO()
            code = launch(command + ["--geeps"], num_workers=workers,
                          num_shards=shards, output=log,
                          shard_args=shard_args)
            if code:
                raise RuntimeError(log.getvalue()[-3000:])
        else:
            subprocess.run(command, check=True)
        return [json.load(open(os.path.join(out, name)))
                for name in sorted(os.listdir(out))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["1M", "10M"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--worker", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--geeps", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", default="1M", help=argparse.SUPPRESS)
    parser.add_argument("--slack", type=int, default=0,
                        help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--curve-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--no-capture", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    results = {}
    for model in args.models:
        plain = run_config(args, model)[0]
        one = run_config(args, model, 1, 1)[0]
        measured = run_config(args, model, 1, 1,
                              worker_args=["--no-capture"])[0]
        bsp = run_config(args, model, 2, 2, slack=0)
        ssp = run_config(args, model, 2, 2, slack=1)
        row = {
            "params": plain["params"],
            "plain_images_per_s": round(plain["images_per_s"], 1),
            "one_worker_images_per_s": round(one["images_per_s"], 1),
            "one_worker_vs_plain": round(one["images_per_s"]
                                         / plain["images_per_s"], 3),
            "one_worker_uncaptured_vs_plain": round(
                measured["images_per_s"] / plain["images_per_s"], 3),
            "one_worker_wait_ms_per_step": round(one["wait_ms_per_step"], 2),
            "one_worker_sync_ms_per_step": round(one["sync_ms_per_step"], 2),
            "bsp_2x2_images_per_s": round(cluster_images_per_s(bsp), 1),
            "bsp_2x2_wait_ms_per_step": round(max(f["wait_ms_per_step"]
                                                  for f in bsp), 2),
            "ssp1_2x2_images_per_s": round(cluster_images_per_s(ssp), 1),
            "ssp1_2x2_wait_ms_per_step": round(max(f["wait_ms_per_step"]
                                                   for f in ssp), 2),
        }
        results[model] = row
        print(f"{model}: {json.dumps(row)}", flush=True)
    summary = {"one_worker_vs_plain": results.get("10M", {}).get(
        "one_worker_vs_plain"), "models": results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
