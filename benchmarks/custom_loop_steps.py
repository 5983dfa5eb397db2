"""Steps per second of a custom training loop through the shards.

Each worker runs a hand-written SGD step of a 784-512-512-10 MLP (0.67 M
parameters) through `strategy.run` inside a `tf.function`, on one fixed
batch of 64, for `STEPS` steps after 30 warm-up steps; BSP. Meant to be
run by the launcher, and again on another checkout to compare (the figure
is a rate of this machine at this moment: compare runs made back to back):

    keras-geeps launch --workers 2 --shards 2 -- \\
        python benchmarks/custom_loop_steps.py

Each worker's last line is a JSON object with `worker` and
`steps_per_s`.
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_geeps  # noqa: E402

STEPS = int(os.environ.get("STEPS", 300))
WARM_UP, BATCH = 30, 64


def main():
    strategy = keras_geeps.GeePSStrategy()
    rng = np.random.default_rng(strategy.worker_id)
    images = tf.constant(rng.standard_normal((BATCH, 784)), tf.float32)
    labels = tf.constant(rng.integers(0, 10, BATCH))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10)], name="mlp")
        optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(step, args=(x, y))

    for _ in range(WARM_UP):
        train_step(images, labels)
    started = time.perf_counter()
    for _ in range(STEPS):
        loss = train_step(images, labels)
    float(loss)
    seconds = time.perf_counter() - started
    strategy.sync()
    print(json.dumps({"worker": strategy.worker_id,
                      "steps_per_s": round(STEPS / seconds, 1)}), flush=True)
    strategy.close()


if __name__ == "__main__":
    main()
