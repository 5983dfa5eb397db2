"""A worker restarted mid-`fit` lines up with the others' epochs.

Under on_worker_failure="continue" the others go on without a dead worker;
a restarted one rejoins mid-epoch, and its `fit` first clocks to the
others' next epoch end (keras/rejoin.py), so the epoch-end barriers of the
averaged logs and BatchNorm statistics line up and every worker ends
together.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_geeps.launch import worker_env
from keras_geeps.shard import ShardSettings

pytestmark = pytest.mark.slow
WORKER = [sys.executable, "-m", "tests.keras.fit_worker"]
EPOCHS = 16
# BatchNorm and validation: both barriers, the statistics' first (at
# validation), so the tables were made in that order too.
FIT_ARGS = ["--pace", "0.05", "--batchnorm", "--validate", "--lr", "0.05"]


@pytest.mark.parametrize("dies, freeze", [(1, True), (0, False)])
def test_a_restarted_worker_lines_up_with_the_others_epochs(
        tmp_path, thread_cluster, dies, freeze):
    """Worker `dies` is killed in epoch 1 and restarted; it misses two or
    more epoch ends (worker 0 too: the table it created, and the barriers
    once zeroed by it, go on without it). With `freeze` the hidden layer
    is frozen after its creation in the scope: its table stays at clock 0
    and must hold neither the epoch ends' clocks nor the rejoin back."""
    lives = 1 - dies
    cluster = thread_cluster(1, 2, settings=ShardSettings(
        worker_timeout=2, on_worker_failure="continue"))
    # The survivor waits mid-epoch 8 until the replacement has rejoined
    # (which may take long on a loaded machine): it then comes mid-run.
    go = tmp_path / "rejoined"
    common = WORKER + ["--out", str(tmp_path), "--epochs", str(EPOCHS),
                       *FIT_ARGS, *(["--freeze"] if freeze else []),
                       "--hold-at", f"8:10:{go}"]
    logs = {}

    def start(w, extra=(), name=None):
        log = open(tmp_path / f"{name or w}.log", "w")
        logs[name or w] = log
        return subprocess.Popen(common + list(extra), stdout=log,
                                stderr=subprocess.STDOUT,
                                env=dict(worker_env(cluster.spec(w)),
                                         PYTHONUNBUFFERED="1"))

    def tail(name):
        if not logs[name].closed:
            logs[name].flush()
        return (tmp_path / f"{name}.log").read_text()[-3000:]

    first = start(lives)
    dying = start(dies, ["--die-worker", str(dies), "--die-at", "1:5"],
                  "dying")
    try:
        assert dying.wait(timeout=180) == 7, tail("dying")
        # It misses at least the ends of epochs 1 to 3 (3 barriers, of
        # the logs and the statistics each).
        deadline = time.monotonic() + 120
        while f"Epoch 5/{EPOCHS}" not in tail(lives):
            assert time.monotonic() < deadline and first.poll() is None, \
                tail(lives)
            time.sleep(0.1)
        again = start(dies, name="again")
        deadline = time.monotonic() + 180
        while "rejoined a job under way" not in (
                tmp_path / "again.log").read_text():
            assert time.monotonic() < deadline and again.poll() is None, \
                tail("again")
            time.sleep(0.1)
        go.write_text("")
        assert again.wait(timeout=240) == 0, tail("again")
        assert first.wait(timeout=240) == 0, tail(lives)
    finally:
        for process in (first, dying):
            if process.poll() is None:
                process.kill()
        for log in logs.values():
            log.close()

    _assert_lined_up(tmp_path, lives, dies,
                     (tmp_path / "again.log").read_text())


@pytest.mark.parametrize("dies, worker_timeout", [(0, "2"), (1, "60")])
def test_launch_starts_a_dead_worker_again_and_its_fit_lines_up(
        tmp_path, dies, worker_timeout):
    """`keras-geeps launch --worker-restarts` starts a worker that dies in
    epoch 1 again, with 2 shards: it rejoins, lines up, and every worker
    ends together. Worker 0 (the tables' creator) is declared dead first
    (2 s); worker 1 comes back before its shards notice (60 s) and takes
    its old process's place (it died between clocks), at the clock where
    the others wait for it: its fit lines up all the same."""
    epochs = 10
    result = subprocess.run(
        [sys.executable, "-m", "keras_geeps", "launch", "--workers", "2",
         "--shards", "2", "--worker-timeout", worker_timeout,
         "--on-worker-failure", "continue", "--worker-restarts", "1", "--",
         *WORKER, "--out", str(tmp_path), "--epochs", str(epochs),
         *FIT_ARGS, "--die-worker", str(dies), "--die-at", "1:5"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert f"worker {dies} (pid" in out and "exited with code 7; " \
        "starting it again (0 restarts left)" in out
    declared_dead = f"worker {dies} sent nothing for" in out
    assert declared_dead == (worker_timeout == "2"), out[-3000:]
    _assert_lined_up(tmp_path, 1 - dies, dies, out, epochs)


def _assert_lined_up(tmp_path, lives, dies, text, epochs=EPOCHS):
    """Worker `dies` rejoined mid-run and ended its epochs with worker
    `lives` (their fit_worker results), `text` its output."""
    assert "rejoined a job under way" in text
    assert "cannot line up" not in text
    results = [json.loads((tmp_path / f"worker{w}.json").read_text())
               for w in (lives, dies)]
    assert results[0]["epochs_run"] == list(range(epochs))
    rejoined = results[1]["epochs_run"]
    assert rejoined, "the rejoined worker's fit ran no epoch: too late"
    assert 2 <= rejoined[0] < epochs - 1, rejoined  # it came mid-run
    assert rejoined == list(range(rejoined[0], epochs))
    # Its epoch ends fell on the others': the averaged logs of every epoch
    # it ran are the survivor's (the same mean), and the steps match.
    # (ps_* figures are each worker's own, added after the averaging.)
    for key, values in results[1]["history"].items():
        if not key.startswith("ps_"):
            assert values == results[0]["history"][key][rejoined[0]:], key
    assert results[0]["stats"]["clock"] == results[1]["stats"]["clock"]
    # Both end with the shards' weights and the averaged statistics.
    weights = [np.load(tmp_path / f"worker{w}.npz") for w in (lives, dies)]
    for name in weights[0].files:
        np.testing.assert_array_equal(weights[0][name], weights[1][name])
    assert results[0]["history"]["val_loss"][-1] < \
        results[0]["history"]["val_loss"][0]
