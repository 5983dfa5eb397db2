"""A TensorFlow custom training loop through GeePS shards.

`strategy.run(step_fn, args)` inside a `tf.function` works as with any
`tf.distribute` strategy: before the step each layer's table is pulled (as
fresh as the slack requires), after it the optimizer's update of each layer
is pushed, the table clocked and pulled back: between steps the weights are
the shards' rows. Create the model and the optimizer inside
`strategy.scope()`; run the steps within `strategy.reraise()` so the
parameter server's errors keep their class; call `strategy.sync()` at the
end so every worker holds the final parameters.

    keras-geeps launch --workers 2 --shards 2 -- python examples/custom_loop.py

Data: scikit-learn's bundled digits (1,797 8x8 images), no download.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_geeps  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--slack", type=int, default=0)
    parser.add_argument("--out", default="",
                        help="write final weights (npz) and figures here")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    strategy = keras_geeps.GeePSStrategy(slack=args.slack)
    dataset = strategy.distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size))

    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(args.lr)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(images, labels):
        def step(images, labels):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(images, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(step, args=(images, labels))

    # (reraise: a GeePSTimeoutError or GeePSWorkerFailedError of a step
    # keeps its class, instead of TensorFlow's UnknownError)
    with strategy.reraise():
        for epoch in range(args.epochs):
            losses = [float(train_step(images, labels))
                      for images, labels in dataset]
            print(f"worker {strategy.worker_id} epoch {epoch + 1}: "
                  f"loss {np.mean(losses):.4f}", flush=True)
    strategy.sync()  # every worker now holds the final parameters
    accuracy = float((model.predict(x, verbose=0).argmax(1) == y).mean())
    figures = {"worker": strategy.worker_id, "final_loss": float(
        np.mean(losses)), "accuracy": accuracy, **strategy.ps_stats()}
    print(json.dumps(figures), flush=True)
    if args.out:
        np.savez(os.path.join(args.out, f"custom{strategy.worker_id}.npz"),
                 *model.get_weights())
        with open(os.path.join(args.out,
                               f"custom{strategy.worker_id}.json"), "w") as f:
            json.dump(figures, f)
    strategy.close()


if __name__ == "__main__":
    main()
