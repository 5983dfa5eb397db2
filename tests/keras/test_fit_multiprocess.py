"""`model.fit` on 2 worker processes x 2 shard processes, on sklearn digits."""

import io
import json
import sys

import numpy as np
import pytest

from keras_geeps.launch import launch

pytestmark = pytest.mark.slow
WORKER = [sys.executable, "-m", "tests.keras.fit_worker"]


def _run(tmp_path, *args, workers=2, shards=2, expect=0):
    output = io.StringIO()
    code = launch(WORKER + ["--out", str(tmp_path), *args],
                  num_workers=workers, num_shards=shards, output=output)
    assert code == expect, output.getvalue()[-4000:]
    if expect:
        return output.getvalue()
    results = []
    for w in range(workers):
        weights = np.load(tmp_path / f"worker{w}.npz")
        results.append((
            [weights[f"arr_{i}"] for i in range(len(weights.files))],
            json.loads((tmp_path / f"worker{w}.json").read_text())))
    return results


def _reference_weights(batch, steps, lr, ema=False):
    """One process, plain Keras, the combined batch (2 x batch)."""
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    from tests.keras import fit_worker  # noqa: PLC0415
    keras.utils.set_random_seed(0)
    x, y = fit_worker.digits()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * batch)
    model = fit_worker.build_model()
    fit_worker.compile_model(model, "sgd", lr, 1, ema=ema)
    if steps:  # (0: the initial weights)
        model.fit(ds.take(steps), epochs=1, verbose=0, shuffle=False)
    return model.get_weights()


@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_bsp_sgd_equals_one_process_with_combined_batch(tmp_path, monkeypatch,
                                                        shared_memory):
    monkeypatch.setenv("KERAS_GEEPS_SHM", shared_memory)
    steps, batch, lr = 12, 16, 0.2
    results = _run(tmp_path, "--batch", str(batch), "--lr", str(lr),
                   "--max-steps", str(steps), "--steps-per-execution", "4")
    (w0, r0), (w1, r1) = results
    assert r0["stats"]["clock"] == r1["stats"]["clock"] == steps
    for stats in (r0["stats"], r1["stats"]):
        # Over TCP, pulls that wait get the pushes in their buffers as
        # they arrive; over shared memory rows are used where they lie.
        assert (stats["bytes_delivered"] > 0) == (shared_memory == "0")
    # BSP with plain SGD on the CPU: updates are taken from the optimizer.
    assert r0["stats"]["captured_tables"] == r0["stats"]["tables"] > 0
    for a, b in zip(w0, w1):  # identical on every worker
        np.testing.assert_array_equal(a, b)
    reference = _reference_weights(batch, steps, lr)
    moved = max(float(np.abs(a - b).max()) for a, b in
                zip(reference, _reference_weights(batch, 0, lr)))
    assert moved > 0.01  # training really changed the weights
    for ours, ref in zip(w0, reference):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=2e-5)


def test_use_ema_ends_with_the_mean_moving_average_on_every_worker(
        tmp_path):
    """Each worker's optimizer keeps moving averages of its own variables
    (its update on the pulled values); under BSP "average" their mean is
    the moving average one process keeps with the combined batch. After
    fit every worker holds that mean (not the shards' last values, which
    the final sync used to pull back over the averages)."""
    steps, batch, lr = 12, 16, 0.2
    results = _run(tmp_path, "--batch", str(batch), "--lr", str(lr),
                   "--max-steps", str(steps), "--ema")
    (w0, r0), (w1, r1) = results
    for a, b in zip(w0, w1):  # identical on every worker
        np.testing.assert_array_equal(a, b)
    reference = _reference_weights(batch, steps, lr, ema=True)
    raw = _reference_weights(batch, steps, lr)
    assert max(float(np.abs(a - b).max()) for a, b in
               zip(reference, raw)) > 0.01  # the averages are not the last
    for ours, ref in zip(w0, reference):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=2e-5)
    # The averages reached the shards with one clock more.
    assert r0["stats"]["clock"] == r1["stats"]["clock"] == steps + 1


@pytest.mark.parametrize("slack", [1, 2, 1000])
def test_ssp_and_async_converge_within_the_bound(tmp_path, slack):
    results = _run(tmp_path, "--slack", str(slack), "--epochs", "8",
                   "--optimizer", "sgd", "--lr", "0.1")
    for weights, result in results:
        losses = result["history"]["loss"]
        # From ~2.2 in the first epoch to below 0.9 (stale reads need the
        # gentler learning rate: at 0.2 SSP oscillates where BSP does not;
        # "async", up to 64 clocks stale, is the slowest).
        assert losses[-1] < 0.9, losses
        assert losses[-1] < 0.4 * losses[0], losses
        # "Async" (slack 1000) is capped by the shards' max_pending_clocks.
        assert result["stats"]["max_staleness"] <= min(slack, 64)
    for a, b in zip(results[0][0], results[1][0]):  # final sync
        np.testing.assert_array_equal(a, b)


def test_fit_features_validation_evaluate_predict_save(tmp_path):
    results = _run(tmp_path, "--epochs", "2", "--steps-per-execution", "4",
                   "--validate", "--save", "--optimizer", "adam", "--lr",
                   "0.01")
    for _, result in results:
        history = result["history"]
        assert {"val_loss", "val_accuracy", "ps_wait_s", "ps_sent_mb",
                "ps_data_age"} <= set(history)
        assert len(history["loss"]) == 2
        assert result["evaluate"]["accuracy"] > 0.85
        assert result["predict_accuracy"] > 0.8
        assert result["reload_max_diff"] == 0.0
        assert history["ps_sent_mb"][0] > 0


@pytest.mark.parametrize("mode", [(), ("--no-capture",), ("--slack", "2")])
def test_epoch_logs_are_averaged_so_early_stopping_agrees(tmp_path, mode):
    """Worker 1 validates on shuffled labels (its own val_loss rises while
    worker 0's falls), and both run EarlyStopping(patience=0) on val_loss.
    On its own figures worker 1 would stop after epoch 2 while worker 0
    goes on, waiting for worker 1's clocks until the timeout. The logs
    every callback sees are the workers' mean, the same on both, so they
    stop after the same epoch and restore the same weights: the best
    epoch's, although EarlyStopping stands before strategy.callbacks() (whose
    final sync runs before any train-end callback)."""
    results = _run(tmp_path, "--epochs", "6", "--val-per-worker",
                   "--early-stop", "--lr", "0.3", "--timeout", "30",
                   *mode)
    (weights0, result0), (weights1, result1) = results
    history0, history1 = result0["history"], result1["history"]
    assert 2 <= len(history0["loss"]) == len(history1["loss"]) < 6
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(history0[key], history1[key], rtol=1e-6)
    for a, b in zip(weights0, weights1):
        np.testing.assert_array_equal(a, b)
    best = int(np.argmin(history0["val_loss"]))
    for result in (result0, result1):
        sums = result["epoch_weight_sums"]
        assert best < len(sums) - 1  # it stopped after a worse epoch
        assert result["final_weight_sum"] == sums[best] != sums[-1]
        # ps figures come from the parameter tables, not the logs' table
        # (clocked once per epoch): 28 steps per epoch.
        assert result["stats"]["data_age"] >= 28 * len(sums) - 2


def test_dead_worker_stops_the_others_with_a_clear_error(tmp_path):
    # Started by hand (not by the launcher, which would stop worker 0 as
    # soon as worker 1 dies): worker 0 must stop on its own, with an error.
    import subprocess  # noqa: PLC0415
    import time  # noqa: PLC0415

    from keras_geeps.launch import LocalCluster, worker_env  # noqa: PLC0415
    with LocalCluster(2, 2, processes=True, output=None) as cluster:
        procs = [subprocess.Popen(
            WORKER + ["--out", str(tmp_path), "--die-worker", "1",
                      "--timeout", "15", "--epochs", "3"],
            env=worker_env(cluster.spec(w)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT) for w in range(2)]
        # (communicate: its output is read, so a full pipe never blocks
        # it, and closed)
        procs[1].communicate(timeout=120)
        assert procs[1].returncode == 7  # died on purpose
        died = time.monotonic()
        output, _ = procs[0].communicate(timeout=120)
        assert procs[0].returncode != 0
        assert time.monotonic() - died < 15 + 30  # the timeout, not a hang
        text = output.decode(errors="replace")
        assert "GeePSTimeoutError" in text
        assert "workers [1] have not finished clock" in text


def test_custom_loop_example_runs(tmp_path):
    output = io.StringIO()
    code = launch([sys.executable, "examples/custom_loop.py", "--epochs",
                   "4", "--out", str(tmp_path)],
                  num_workers=2, num_shards=2, output=output)
    assert code == 0, output.getvalue()[-4000:]
    results = [json.loads((tmp_path / f"custom{w}.json").read_text())
               for w in range(2)]
    weights = [np.load(tmp_path / f"custom{w}.npz") for w in range(2)]
    for name in weights[0].files:  # same parameters after strategy.sync()
        np.testing.assert_array_equal(weights[0][name], weights[1][name])
    for result in results:
        # Loss starts near 2.3; 4 epochs of SGD bring it under 0.5.
        assert result["final_loss"] < 0.5 and result["accuracy"] > 0.85
        assert result["clock"] == result["steps"] > 0


def test_batchnorm_statistics_end_as_the_workers_mean(tmp_path):
    """Each worker's BatchNorm keeps statistics of its own batches; at the
    epoch end they become the mean over the workers, on every worker. One
    epoch: the averaging does not change the training itself (BatchNorm
    normalises by the batch while training), so the run where each keeps
    its own tells what the mean must be."""
    import keras  # noqa: PLC0415

    from tests.keras import fit_worker  # noqa: PLC0415
    statistics = [i for i, v in enumerate(
        fit_worker.build_model(batchnorm=True).weights) if not v.trainable]
    assert len(statistics) == 2  # moving mean and variance
    keras.backend.clear_session()
    args = ["--batchnorm", "--batch", "16", "--max-steps", "12"]
    runs = {}
    for name, extra in (("own", ["--own-statistics"]), ("mean", [])):
        (tmp_path / name).mkdir()
        runs[name] = [weights for weights, _ in
                      _run(tmp_path / name, *args, *extra)]
    own, mean = runs["own"], runs["mean"]
    for i, (a, b) in enumerate(zip(*own)):
        if i in statistics:  # each its own data's
            assert float(np.abs(a - b).max()) > 1e-3
        else:
            np.testing.assert_array_equal(a, b)
    for i in statistics:
        np.testing.assert_array_equal(mean[0][i], mean[1][i])
        expected = (own[0][i].astype(np.float64) + own[1][i]) / 2
        # (two runs' float sums differ by arrival order: ~1e-7)
        np.testing.assert_allclose(mean[0][i], expected, rtol=1e-5,
                                   atol=1e-5)
    for i, (ours, theirs) in enumerate(zip(mean[0], own[0])):
        if i not in statistics:  # the training itself: the same
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_validation_measures_the_model_with_the_averaged_statistics(
        tmp_path):
    """fit averages the BatchNorm statistics before it validates, so the
    last epoch's val_loss is the loss of the model every worker ends
    with (not the mean of each worker's loss with its own statistics)."""
    results = _run(tmp_path, "--batchnorm", "--validate", "--batch", "16",
                   "--max-steps", "12")
    for _, result in results:
        assert result["history"]["val_loss"][-1] == pytest.approx(
            result["evaluate_validation"]["loss"], rel=1e-6)
