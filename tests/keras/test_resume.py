"""A `model.fit` job killed mid-epoch resumes from the shards' checkpoint."""

import io
import json
import sys

import numpy as np
import pytest

from keras_geeps import checkpoint
from keras_geeps.keras import epoch_logs
from keras_geeps.launch import launch

pytestmark = pytest.mark.slow
WORKER = [sys.executable, "-m", "tests.keras.fit_worker"]


def test_fit_killed_mid_epoch_resumes_from_shard_checkpoint(tmp_path):
    ckpt, backup, out = (tmp_path / d for d in ("ckpt", "backup", "out"))
    out.mkdir()
    shard_args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    common = ["--out", str(out), "--epochs", "3", "--optimizer", "adam",
              "--lr", "0.01", "--backup-dir", str(backup)]
    log = io.StringIO()
    # Epochs have 28 steps per worker; everyone dies in epoch 2, batch 10.
    code = launch(WORKER + common + ["--die-all-at", "1:10"], 2, 2,
                  output=log, shard_args=shard_args)
    assert code == 9, log.getvalue()[-3000:]
    saved = [checkpoint.load(ckpt, s, 2, 2) for s in range(2)]
    # Every parameter table on every shard at one clock (the epoch logs'
    # table clocks once per epoch).
    clocks = {clock for tables in saved for spec, clock, _ in tables.values()
              if spec["name"] != epoch_logs.TABLE}
    assert len(clocks) == 1
    restored_clock = clocks.pop()
    assert 28 < restored_clock <= 28 + 11 and restored_clock % 4 == 0

    log = io.StringIO()
    code = launch(WORKER + common, 2, 2, output=log,
                  shard_args=shard_args + ["--restore"])
    assert code == 0, log.getvalue()[-3000:]
    results = [json.loads((out / f"worker{w}.json").read_text())
               for w in range(2)]
    weights = [np.load(out / f"worker{w}.npz") for w in range(2)]
    for result in results:
        # Resumed at epoch 2 (BackupAndRestore), from the shards' clock.
        assert len(result["history"]["loss"]) == 2
        assert result["stats"]["clock"] == restored_clock + 2 * 28
        assert result["history"]["loss"][-1] < 0.45
    for name in weights[0].files:
        np.testing.assert_array_equal(weights[0][name], weights[1][name])


def test_launch_job_restarts_resume_a_fit_killed_mid_epoch(tmp_path):
    """The same job in one `launch(job_restarts=1)`: when every worker dies
    in epoch 2, the launcher stops the shards and starts the whole job
    again, the shards with --restore; the workers' BackupAndRestore
    resumes them at epoch 2 from the shards' checkpoint, and they end
    together."""
    ckpt, backup, out = (tmp_path / d for d in ("ckpt", "backup", "out"))
    out.mkdir()
    log = io.StringIO()
    code = launch(WORKER + ["--out", str(out), "--epochs", "3",
                            "--optimizer", "adam", "--lr", "0.01",
                            "--backup-dir", str(backup), "--die-all-at",
                            "1:10"], 2, 2, output=log, job_restarts=1,
                  shard_args=["--checkpoint-dir", str(ckpt),
                              "--checkpoint-every", "4"])
    text = log.getvalue()
    assert code == 0, text[-3000:]
    assert "exited with code 9; stopped the other processes" in text
    assert "[launch] starting the whole job again, the shards with " \
        "--restore (0 job restarts left)" in text
    assert "restored" in text  # (the shards' own warning)
    results = [json.loads((out / f"worker{w}.json").read_text())
               for w in range(2)]
    weights = [np.load(out / f"worker{w}.npz") for w in range(2)]
    for result in results:
        assert len(result["history"]["loss"]) == 2  # epochs 2 and 3
        restored_clock = result["stats"]["clock"] - 2 * 28
        assert 28 < restored_clock <= 28 + 11 and restored_clock % 4 == 0
    for name in weights[0].files:
        np.testing.assert_array_equal(weights[0][name], weights[1][name])
    with pytest.raises(ValueError, match=r"restarts \(--job-restarts\) need"):
        launch(["true"], job_restarts=1)


def test_fit_goes_on_through_a_shard_killed_and_restarted(tmp_path):
    """SIGKILL shard 1 in the middle of epoch 1 of a 2-worker BSP fit; the
    launcher restarts it with --restore and the workers replay what its
    checkpoint lacks: the final weights equal those of the same fit left
    alone, bit for bit: the shards add each clock's updates in worker
    order (--deterministic-sums), not as they arrive."""
    weights = []
    for run, kill in (("plain", []), ("killed", ["--kill-shard-at",
                                                 "1:0:17"])):
        out = tmp_path / run
        out.mkdir()
        shard_args = ["--checkpoint-dir", str(tmp_path / f"ckpt-{run}"),
                      "--checkpoint-every", "4", "--deterministic-sums"]
        log = io.StringIO()
        code = launch(WORKER + ["--out", str(out), "--epochs", "2",
                                "--lr", "0.05", *kill], 2, 2, output=log,
                      shard_args=shard_args, shard_restarts=1)
        text = log.getvalue()
        assert code == 0, text[-3000:]
        assert ("killing shard 1" in text) == bool(kill), text[-3000:]
        if kill:
            assert "starting it again with --restore" in text, text[-3000:]
            assert "shard 1 recovered" in text, text[-3000:]
        weights.append([np.load(out / f"worker{w}.npz") for w in range(2)])
    for name in weights[0][0].files:
        for w in range(2):
            np.testing.assert_array_equal(weights[1][w][name],
                                          weights[0][0][name])
