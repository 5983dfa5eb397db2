"""A `model.fit` worker on sklearn's digits for the multi-process tests.

Run under `keras-geeps launch`; writes its final weights, history and
parameter-server figures to --out/worker<w>.npz / .json.
"""

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_geeps  # noqa: E402


def digits():
    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int64")
    return x, y


def build_model(batchnorm=False):
    normalise = [keras.layers.BatchNormalization(momentum=0.5, name="bn")] \
        if batchnorm else []
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu", name="hidden"),
        *normalise,
        keras.layers.Dense(10, name="logits"),
    ])


def compile_model(model, optimizer, lr, steps_per_execution, ema=False):
    # (use_ema: moving averages of momentum 0.8, the weights after fit)
    kwargs = {"use_ema": True, "ema_momentum": 0.8} if ema else {}
    opt = (keras.optimizers.SGD(lr, **kwargs) if optimizer == "sgd"
           else keras.optimizers.Adam(lr, **kwargs))
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)


class WeightSums(keras.callbacks.Callback):
    """Records a checksum of the weights at every epoch end."""

    def __init__(self):
        super().__init__()
        self.sums = []

    def on_epoch_end(self, epoch, logs=None):
        self.sums.append(weight_sum(self.model))


def weight_sum(model):
    return float(sum(np.square(w.astype(np.float64)).sum()
                     for w in model.get_weights()))


class AtBatch(keras.callbacks.Callback):
    """Calls `act()` once, at the end of batch `step` of epoch `epoch` (or
    the first batch after, in a later epoch too)."""

    def __init__(self, step, epoch=0):
        super().__init__()
        self.step, self.epoch = step, epoch
        self.current_epoch, self.done = 0, False

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self.done and self.current_epoch >= self.epoch and \
                batch >= self.step:
            self.done = True
            self.act()


class DieAt(AtBatch):
    def __init__(self, step, epoch=0, code=7):
        super().__init__(step, epoch)
        self.code = code

    def act(self):
        print("dying on purpose", flush=True)
        os._exit(self.code)


class HoldAt(AtBatch):
    """Waits (120 s at most) at a batch until `path` exists: a test holds
    the job there until a replacement worker has rejoined, whatever the
    machine's pace."""

    def __init__(self, step, epoch, path):
        super().__init__(step, epoch)
        self.path = path

    def act(self):
        print(f"holding until {self.path} exists", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path) and time.monotonic() < deadline:
            time.sleep(0.05)


class Pace(keras.callbacks.Callback):
    """Sleeps `seconds` after every train batch (a slower worker)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


class KillShardAt(AtBatch):
    """SIGKILLs shard `shard` once, at batch `step` of epoch `epoch` (the
    launcher, with shard_restarts, starts it again with --restore)."""

    def __init__(self, client, shard, epoch, step):
        super().__init__(step, epoch)
        self.client, self.shard = client, shard

    def act(self):
        pid = self.client.shard_stats()[self.shard]["pid"]
        print(f"killing shard {self.shard} (pid {pid})", flush=True)
        os.kill(pid, signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--slack", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--ema", action="store_true",
                        help="the optimizer keeps moving averages (use_ema)")
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--val-per-worker", action="store_true",
                        help="validate on a slice of its own per worker; "
                        "worker 1's labels shuffled (its val_loss rises)")
    parser.add_argument("--no-capture", action="store_true",
                        help="GeePSStrategy(capture_updates=False)")
    parser.add_argument("--freeze", action="store_true",
                        help="freeze the hidden layer after its creation "
                             "(its table then never clocks)")
    parser.add_argument("--batchnorm", action="store_true",
                        help="a BatchNormalization layer after the hidden")
    parser.add_argument("--own-statistics", action="store_true",
                        help="GeePSStrategy(average_non_trainable=False)")
    parser.add_argument("--early-stop", action="store_true",
                        help="EarlyStopping(patience=0) on val_loss")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--die-worker", type=int, default=-1)
    parser.add_argument("--die-at", default="0:3",
                        help="EPOCH:BATCH where --die-worker exits (code 7)")
    parser.add_argument("--pace", type=float, default=0.0,
                        help="seconds every worker sleeps after each batch")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--hold-at", default="",
                        help="EPOCH:BATCH:FILE: wait there for FILE")
    parser.add_argument("--backup-dir", default="",
                        help="keras.callbacks.BackupAndRestore folder")
    parser.add_argument("--die-all-at", default="",
                        help="EPOCH:BATCH where every worker exits (code 9)")
    parser.add_argument("--kill-shard-at", default="",
                        help="SHARD:EPOCH:BATCH where worker 0 SIGKILLs "
                        "that shard")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    strategy = keras_geeps.GeePSStrategy(
        slack=args.slack, timeout=args.timeout,
        capture_updates=not args.no_capture,
        average_non_trainable=not args.own_statistics)
    w = strategy.worker_id
    x, y = digits()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
    if args.max_steps:
        ds = ds.take(args.max_steps * strategy.num_workers)
    with strategy.scope():
        model = build_model(batchnorm=args.batchnorm)
        if args.freeze:  # transfer learning: a base frozen once built
            model.get_layer("hidden").trainable = False
        compile_model(model, args.optimizer, args.lr,
                      args.steps_per_execution, ema=args.ema)
    callbacks = strategy.callbacks()
    if w == args.die_worker and strategy.client.rejoined_at is None:
        # (a process started again, which rejoins, does not die again)
        epoch, batch = map(int, args.die_at.split(":"))
        callbacks.append(DieAt(batch, epoch))
    if args.pace:
        callbacks.append(Pace(args.pace))
    if args.hold_at and strategy.client.rejoined_at is None:
        epoch, batch, path = args.hold_at.split(":", 2)
        callbacks.append(HoldAt(int(batch), int(epoch), path))
    if args.backup_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(
            os.path.join(args.backup_dir, f"worker{w}"), save_freq=4))
    sums = WeightSums()
    if args.early_stop:  # first: before strategy.callbacks() on purpose
        callbacks[:0] = [keras.callbacks.EarlyStopping(
            monitor="val_loss", patience=0, restore_best_weights=True), sums]
    if args.kill_shard_at and w == 0:
        shard, epoch, batch = map(int, args.kill_shard_at.split(":"))
        callbacks.append(KillShardAt(strategy.client, shard, epoch, batch))
    died_all = os.path.join(args.out, f"died_all_{w}")
    if args.die_all_at and not os.path.exists(died_all):
        # (once: a job started again from the checkpoint goes on)
        epoch, batch = map(int, args.die_all_at.split(":"))
        open(died_all, "w").close()
        callbacks.append(DieAt(batch, epoch, code=9))
    validation = (x[:200], y[:200]) if args.validate else None
    if args.val_per_worker:
        labels = y[200 * w:200 * (w + 1)]
        if w == 1:
            labels = np.random.default_rng(1).permutation(labels)
        validation = (x[200 * w:200 * (w + 1)], labels)
    history = model.fit(
        strategy.distribute_dataset(ds), epochs=args.epochs, verbose=2,
        callbacks=callbacks, validation_data=validation)
    result = {"worker": w, "history": history.history,
              "epochs_run": history.epoch,
              "stats": strategy.ps_stats(), "epoch_weight_sums": sums.sums,
              "final_weight_sum": weight_sum(model)}
    if args.validate:
        result["evaluate"] = model.evaluate(x, y, verbose=0,
                                            return_dict=True)
        # the validation data again, as fit validated it
        result["evaluate_validation"] = model.evaluate(
            x[:200], y[:200], batch_size=args.batch, verbose=0,
            return_dict=True)
        predictions = model.predict(x[:50], verbose=0)
        result["predict_accuracy"] = float(
            (predictions.argmax(1) == y[:50]).mean())
    if args.save:
        path = os.path.join(args.out, f"model{w}.keras")
        model.save(path)
        reloaded = keras.models.load_model(path)
        result["reload_max_diff"] = max(
            float(np.abs(a - b).max()) for a, b in
            zip(model.get_weights(), reloaded.get_weights()))
    np.savez(os.path.join(args.out, f"worker{w}.npz"), *model.get_weights())
    with open(os.path.join(args.out, f"worker{w}.json"), "w") as f:
        json.dump(result, f, default=float)
    strategy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
