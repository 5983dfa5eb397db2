"""The main job: `model.fit` of a CNN on Fashion-MNIST through GeePS shards.

Run it on a local cluster (2 shards + 2 workers) with

    keras-geeps launch --workers 2 --shards 2 -- \
        python examples/fashion_mnist_fit.py

or `make demo`. Each worker trains on its half of the 60,000 training images
(BSP by default), worker 0 then evaluates on the 10,000 test images and
prints the test accuracy, images/s and the parameter-server figures. The
data comes from Debian's `dataset-fashion-mnist` through a
tensorflow-datasets builder (`keras_geeps.datasets.fashion_mnist`).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_geeps  # noqa: E402
from keras_geeps.datasets import fashion_mnist  # noqa: E402


def build_model():
    """A small CNN: two conv blocks and a dense head (~0.4 M parameters)."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu", name="conv1"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu", name="conv2"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(128, activation="relu", name="dense"),
        keras.layers.Dense(10, name="logits"),
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--slack", type=int, default=0,
                        help="0 = BSP; s > 0 = SSP")
    parser.add_argument("--steps-per-execution", type=int, default=8)
    parser.add_argument("--train-examples", type=int, default=0,
                        help="use only this many training images (0 = all)")
    parser.add_argument("--verbose", type=int, default=1,
                        help="Keras verbosity: 1 = progress bar (worker 0; "
                             "other workers print one line per epoch), "
                             "2 = one line per epoch")
    args = parser.parse_args()

    keras.utils.set_random_seed(1)
    strategy = keras_geeps.GeePSStrategy(slack=args.slack)
    train = fashion_mnist.load("train")
    if args.train_examples:
        train = train.take(args.train_examples)
    train = train.shuffle(10_000, seed=1).batch(
        args.batch_size * strategy.num_workers, drop_remainder=True)
    # Each global batch is split: this worker takes its slice of it.
    train = strategy.distribute_dataset(train.unbatch().batch(
        args.batch_size, drop_remainder=True)).prefetch(tf.data.AUTOTUNE)
    # tf.data's autotuning thread can take ~5-15 s to tear down an epoch's
    # iterator on saturated cores, and under BSP the other workers wait.
    options = tf.data.Options()
    options.autotune.enabled = False
    train = train.with_options(options)

    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(args.lr),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"], jit_compile=False,
            steps_per_execution=args.steps_per_execution)
    if strategy.is_chief:
        print(strategy.parameter_sync.table_report()
              if strategy.parameter_sync.built else
              f"worker 0 of {strategy.num_workers}; tables are created at "
              f"the first step")

    if not strategy.is_chief:
        args.verbose = min(2, max(args.verbose, 2))  # one bar is enough
    started = time.perf_counter()
    history = model.fit(train, epochs=args.epochs, verbose=args.verbose,
                        callbacks=strategy.callbacks())
    seconds = time.perf_counter() - started
    steps = strategy.ps_stats()["steps"]
    images_per_s = steps * args.batch_size / seconds
    stats = strategy.ps_stats()
    summary = {
        "worker": strategy.worker_id,
        "images_per_s_this_worker": round(images_per_s, 1),
        "images_per_s_cluster": round(images_per_s * strategy.num_workers, 1),
        "train_seconds": round(seconds, 1),
        "ps_wait_s": round(stats["pull_wait_seconds"], 2),
        "ps_sent_mb": round(stats["bytes_sent"] / 1e6, 1),
        "ps_received_mb": round(stats["bytes_received"] / 1e6, 1),
        "final_train_accuracy": round(history.history["accuracy"][-1], 4),
    }
    if strategy.is_chief:
        print(strategy.parameter_sync.table_report())
        test = fashion_mnist.load("test").batch(256)
        result = model.evaluate(test, verbose=0, return_dict=True)
        summary["test_accuracy"] = round(result["accuracy"], 4)
        summary["test_images"] = 10_000
        print(f"test accuracy {result['accuracy']:.4f} on 10,000 test images;"
              f" {summary['images_per_s_cluster']:.0f} images/s over "
              f"{strategy.num_workers} workers")
    print(json.dumps(summary))
    strategy.close()


if __name__ == "__main__":
    main()
