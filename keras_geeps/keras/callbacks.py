"""Keras callbacks of the GeePS strategy, each doing one thing."""

import keras

from keras_geeps.errors import GeePSError


def _check_strategy(strategy):
    from keras_geeps.keras.strategy import GeePSStrategy  # noqa: PLC0415
    if not isinstance(strategy, GeePSStrategy):
        raise TypeError(f"strategy must be a keras_geeps GeePSStrategy, not "
                        f"{type(strategy).__name__}")


class ParameterServerCallback(keras.callbacks.Callback):
    """Reports parameter-server figures per epoch and syncs at the end.

    Adds to each epoch's `logs` (so the progress bar, `History` and
    `TensorBoard` show them): `ps_wait_s` (seconds the steps waited for
    fresh parameters), `ps_sent_mb` / `ps_received_mb` (traffic with the
    shards), `ps_data_age` (clocks reflected by the parameters last read)
    and `ps_step_ms` (time in pulls and pushes per step). At the end of
    training it pulls the final parameters, so every worker ends with the
    same trainable weights (under `use_ema` the moving averages, already
    written everywhere when `fit` finalized the optimizer: see
    `ParameterSync.finalize_moving_average`); and it turns XLA off (XLA
    cannot run the sync). A model built outside the strategy's scope is
    refused as training begins (`GeePSError`): it would train alone.

    Args:
        strategy: the `GeePSStrategy`.

    Example:

    ```python
    model.fit(ds, epochs=3, callbacks=[ParameterServerCallback(strategy)])
    ```
    """

    def __init__(self, strategy):
        super().__init__()
        _check_strategy(strategy)
        self.strategy = strategy
        self._start = None
        self._synced = False  # this fit's final sync done

    def on_train_begin(self, logs=None):
        self._synced = False
        self._check_model()
        if getattr(self.model, "jit_compile", False):
            self.model.jit_compile = False
            self.model.make_train_function(force=True)

    def _check_model(self):
        """Refuses a model built outside the strategy's scope: no table
        holds its variables, and `fit` would train it on this worker
        alone, without a word (Keras fits it under the strategy it was
        built in)."""
        # (integer weights take no gradient: no table holds them)
        trainable = [v for v in self.model.trainable_variables
                     if keras.backend.is_float_dtype(v.dtype)]
        if not trainable:
            raise GeePSError(
                f"model {self.model.name!r} has no trainable weights (every "
                f"layer frozen?): fit under the GeePS strategy has nothing "
                f"to train through the shards. Unfreeze a layer, or fit it "
                f"outside the strategy")
        outside = self.strategy.parameter_sync.not_held(trainable)
        if self.model.distribute_strategy is self.strategy and not outside:
            return
        names = ", ".join(v.path if hasattr(v, "path") else v.name
                          for v in outside[:3])
        if len(outside) > 3:
            names += f" and {len(outside) - 3} more"
        raise GeePSError(
            f"model {self.model.name!r} was not built in strategy.scope()"
            f"{f' (its variables {names})' if names else ''}: no "
            f"parameter table holds its variables, so fit would train it "
            f"on this worker alone. Build the model, and compile it, inside "
            f"`with strategy.scope():`")

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self.strategy.ps_stats()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or self._start is None:
            return
        now = self.strategy.ps_stats()
        steps = max(1, now["steps"] - self._start["steps"])
        logs["ps_wait_s"] = round(now["pull_wait_seconds"]
                                  - self._start["pull_wait_seconds"], 3)
        logs["ps_sent_mb"] = round((now["bytes_sent"]
                                    - self._start["bytes_sent"]) / 1e6, 2)
        logs["ps_received_mb"] = round((now["bytes_received"]
                                        - self._start["bytes_received"])
                                       / 1e6, 2)
        logs["ps_data_age"] = now["data_age"]
        logs["ps_step_ms"] = round(
            1e3 * ((now["pull_seconds"] - self._start["pull_seconds"])
                   + (now["push_seconds"] - self._start["push_seconds"]))
            / steps, 2)

    def sync_before_train_end(self):
        """Brings the weights to the shards' latest values, once per `fit`.

        Keras' `CallbackList` calls it (keras/_tf_hooks) before any
        callback's `on_train_end`: a callback that then sets weights, such
        as `EarlyStopping(restore_best_weights=True)`, keeps them, wherever
        it stands in the list.
        """
        if not self._synced:
            sync = self.strategy.parameter_sync
            if self.model is not None:
                # A fit that ran no step (epochs=0, initial_epoch past
                # epochs, no data): its model's tables now, so that every
                # worker ends with the same (worker 0's initial) weights.
                sync.build_pending(self.model.weights)
            self.strategy.sync()
            self._synced = True

    def on_train_end(self, logs=None):
        self.sync_before_train_end()  # (called directly, not by fit)


class ChiefOnly(keras.callbacks.Callback):
    """Runs a callback on worker 0 only (e.g. checkpoints, by default).

    Args:
        callback: the callback to wrap.
        strategy: the `GeePSStrategy`.

    Example:

    ```python
    ChiefOnly(keras.callbacks.ModelCheckpoint("ckpt.keras"), strategy)
    ```
    """

    def __init__(self, callback, strategy):
        super().__init__()
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(f"callback must be a keras.callbacks.Callback, "
                            f"not {type(callback).__name__}")
        _check_strategy(strategy)
        self.callback = callback
        self.strategy = strategy

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)


def _chief_only(hook):
    def method(self, *args, **kwargs):
        if self.strategy.is_chief:
            return getattr(self.callback, hook)(*args, **kwargs)
        return None
    method.__name__ = hook
    return method


for _hook in ("on_train_begin", "on_train_end", "on_epoch_begin",
              "on_epoch_end", "on_train_batch_begin", "on_train_batch_end",
              "on_test_begin", "on_test_end", "on_test_batch_begin",
              "on_test_batch_end", "on_predict_begin", "on_predict_end",
              "on_predict_batch_begin", "on_predict_batch_end"):
    setattr(ChiefOnly, _hook, _chief_only(_hook))


# Keras callbacks whose batch hooks read the logs, never the weights.
_LOGS_ONLY = (keras.callbacks.History, keras.callbacks.ProgbarLogger,
              keras.callbacks.TensorBoard, keras.callbacks.TerminateOnNaN)
_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin",
                "on_train_batch_end")


def reads_weights_per_batch(callback):
    """Whether `callback` may read the model's weights at a train batch.

    Under captured updates the weights trail the shards by one step, and
    catching them up before a batch's callbacks costs a pull outside the
    step: done only when a callback may look. That is any callback with a
    batch hook of its own, except Keras' logging ones and a
    `ModelCheckpoint` / `BackupAndRestore` saving per epoch.

    Args:
        callback: a `keras.callbacks.Callback`.

    Returns:
        bool.
    """
    if isinstance(callback, ChiefOnly):
        return reads_weights_per_batch(callback.callback)
    if isinstance(callback, (ParameterServerCallback, *_LOGS_ONLY)):
        return False
    if isinstance(callback, (keras.callbacks.ModelCheckpoint,
                             keras.callbacks.BackupAndRestore)):
        return callback.save_freq != "epoch"
    # Keras marks Callback's empty hooks `_is_default` (utils.default).
    return any(not getattr(getattr(callback, hook), "_is_default", False)
               for hook in _BATCH_HOOKS)
