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
