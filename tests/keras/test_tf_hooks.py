"""The private TensorFlow hooks GeePSStrategy relies on still fire.

keras/_tf_hooks.py subclasses TF's OneDeviceExtended; a TensorFlow or Keras
upgrade that stops calling these hooks must fail here, not silently train
without syncing.
"""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from keras_geeps.errors import GeePSError  # noqa: E402
from keras_geeps.keras import GeePSStrategy  # noqa: E402
from keras_geeps.keras import _tf_hooks  # noqa: E402
from keras_geeps.keras.capture import variable_name  # noqa: E402


def _model():
    return keras.Sequential([keras.Input((4,)),
                             keras.layers.Dense(3, name="a"),
                             keras.layers.Dense(2, name="b")])


def test_hooks_see_variables_updates_and_steps(thread_cluster):
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    calls = {"updates": 0, "steps": [], "tracked": 0, "paths": [],
             "layer_weights": 0}
    sync = strategy.parameter_sync
    real_note, real_wrap, real_track = (sync.note_update, sync.wrap_step,
                                        sync.track_variable)

    def note(variable):
        calls["updates"] += 1
        real_note(variable)

    def wrap(call, is_train_step=False, builds_tables=True):
        builds = builds_tables if isinstance(builds_tables, bool) else \
            [variable_name(v) for v in builds_tables()]
        calls["steps"].append((is_train_step, builds))
        return real_wrap(call, is_train_step, builds_tables)

    def track(variable, trainable, keras_path=None, layer_weight=False):
        calls["tracked"] += trainable
        calls["paths"].append(keras_path)
        calls["layer_weights"] += layer_weight
        real_track(variable, trainable, keras_path, layer_weight)

    sync.note_update, sync.wrap_step, sync.track_variable = note, wrap, track
    try:
        with strategy.scope():
            model = _model()
            model.compile(optimizer="sgd", loss="mse", jit_compile=False)
        x = np.ones((8, 4), np.float32)
        model.fit(x, np.ones((8, 2), np.float32), batch_size=4, verbose=0)
        model.evaluate(x, np.ones((8, 2), np.float32), verbose=0)
        model.predict(x, verbose=0)
        assert calls["tracked"] == 4          # 2 kernels + 2 biases
        # (the optimizer's and metrics' variables are no layer's weights)
        assert calls["layer_weights"] == 0
        assert [p for p in calls["paths"] if p and "/" in p][:4] == [
            f"{model.name}/{layer}/{v}" for layer in "ab"
            for v in ("kernel", "bias")]      # their Keras variables' paths
        assert calls["updates"] == 4          # once per variable, at trace
        # fit's train_step detected (it builds its model's tables);
        # evaluate's test_step and predict's step too (they build none)
        assert calls["steps"][0] == (True, [
            f"{model.name}/{layer}/{v}" for layer in "ab"
            for v in ("kernel", "bias")])
        assert calls["steps"][1:] == [(False, False)] * 2
        assert [t.name for t in sync.tables] == [f"{model.name}/a",
                                                 f"{model.name}/b"]
        assert sync.steps == 2                # 8 samples / batch 4
    finally:
        strategy.close()


def test_train_step_bypassing_the_optimizer_is_a_clear_error(
        thread_cluster):
    class HandRolled(keras.Sequential):
        def train_step(self, data):
            for variable in self.trainable_variables:
                variable.assign(variable * 0.5)  # not through the optimizer
            return {}

    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    try:
        with strategy.scope():
            model = HandRolled([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(optimizer="sgd", loss="mse", jit_compile=False)
        with pytest.raises(GeePSError, match="through the optimizer"):
            model.fit(np.ones((4, 4)), np.ones((4, 2)), verbose=0)
    finally:
        strategy.close()


def test_optimizer_compiled_outside_scope_still_syncs(thread_cluster):
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    try:
        with strategy.scope():
            model = _model()
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
        model.fit(np.ones((4, 4)), np.ones((4, 2)), batch_size=2, verbose=0)
        assert strategy.parameter_sync.steps == 2
        table = strategy.parameter_sync.tables[0].table
        assert table.clock == 2
    finally:
        strategy.close()


def test_xla_is_refused_with_a_clear_error(thread_cluster):
    cluster = thread_cluster(1, 1)
    strategy = GeePSStrategy(client=cluster.client(0, timeout=20))
    try:
        with strategy.scope():
            model = _model()
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        with pytest.raises(GeePSError, match="jit_compile=False"):
            model.fit(np.ones((4, 4)), np.ones((4, 2)), verbose=0)
    finally:
        strategy.close()


def test_is_keras_train_step():
    model = _model()
    assert _tf_hooks.is_keras_train_step(model.train_step)
    assert not _tf_hooks.is_keras_train_step(model.test_step)
    assert not _tf_hooks.is_keras_train_step(lambda: None)
