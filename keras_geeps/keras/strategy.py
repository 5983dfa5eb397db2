"""`GeePSStrategy`: data-parallel `model.fit` through keras_geeps shards."""

import warnings

import tensorflow as tf

from keras_geeps.checks import check_device
from keras_geeps.client import GeePSClient
from keras_geeps.cluster import ClusterSpec
from keras_geeps.errors import GeePSError
from keras_geeps.keras import _tf_hooks
from keras_geeps.keras.epoch_logs import EpochLogAverager
from keras_geeps.keras.non_trainable import NonTrainableAverager
from keras_geeps.keras.sync import ParameterSync, check_update_mode
from keras_geeps.memory.planner import check_budget


class GeePSStrategy(tf.distribute.OneDeviceStrategy):
    """Trains a Keras model on N workers through GeePS parameter-server shards.

    Keras 3's `model.fit` has no parameter-server path; this strategy is one.
    Variables created in its `scope()` become parameter tables (one per
    layer, fixed-width rows, spread over the shards), initialised from
    worker 0. Every training step pulls each table as fresh as the slack
    requires, runs the step with the worker's own optimizer, and pushes the
    step's additive update, layer by layer. Slack 0 is BSP; slack s > 0 lets
    a worker run up to s clocks ahead of the slowest (SSP).

    With `update_mode="average"` (the default) each worker's update is
    divided by the number of workers: under plain SGD, N workers with
    per-worker batch B then follow one worker with batch N * B, to float
    rounding.
    `"sum"` adds the updates unscaled. Weights a callback writes between
    steps (on every worker, as Keras runs it) reach the shards as the
    workers' mean change in either mode.

    Create the model *and* compile it (which creates the optimizer) inside
    `scope()`, pass `jit_compile=False` (XLA cannot run the sync), and give
    `fit` the strategy's `callbacks()` so that every epoch reports its
    parameter-server figures and every worker ends with the same trainable
    weights (under `use_ema` the workers' mean moving averages) and the
    same BatchNorm statistics (their mean over the workers, taken at every
    epoch end: `average_non_trainable`); optimizer state stays each
    worker's own. An error of a step's pull or push (`GeePSTimeoutError`,
    `GeePSWorkerFailedError`, ...) comes out of `fit`, `evaluate`,
    `predict` and `*_on_batch` as itself, not as TensorFlow's
    `UnknownError`.

    Example:

    ```python
    strategy = keras_geeps.GeePSStrategy()        # TF_CONFIG / launcher env
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=False)
    model.fit(strategy.distribute_dataset(train_ds), epochs=3,
              callbacks=strategy.callbacks())
    ```

    Args:
        cluster: a `ClusterSpec`. Defaults to None: from the launcher's
            environment variables, else `TF_CONFIG` (ps job = shards).
        slack: staleness bound in clocks (steps); 0 = BSP. Defaults to 0.
        update_mode: "average" or "sum". Defaults to "average".
        timeout: seconds any wait for shards or other workers may take
            before a `GeePSTimeoutError`. Defaults to 120.
        device: where the variables and the step run, one of this
            process's devices ("/gpu:1"; another is refused). Defaults to
            None: the first GPU if one is visible, else the CPU.
        client: an existing `GeePSClient` to use. Defaults to None (one is
            created from `cluster`, `slack`, `timeout` and `curve`).
        curve: a `keras_geeps.auth.ClientKeys` when the shards require
            CURVE. Defaults to None.
        device_memory_budget: bytes of device memory the parameters,
            their optimizer state, the non-trainable variables (frozen
            layers, BatchNorm statistics), the access pool and the saved
            activations may use; training then goes through
            `layerwise_trainer()`, which keeps what does not fit in host
            memory and stages it in as needed (README, "Memory
            management"). Defaults to None: all of the device's memory.
        capture_updates: under BSP (slack 0), take each CPU layer's update
            from the optimizer (`Optimizer.assign_add` / `assign_sub`, which
            Keras' built-in optimizers use) and write it straight into the
            upload buffer instead of into the variables, which the next
            pull replaces anyway: three passes over the model fewer per
            step. Updates that need the written variable within the step
            (moving averages, constraints, gradient accumulation, weight
            decay, sparse updates, eager steps) are applied as usual. The
            variables then trail the shards by the last step until a pull,
            except where user code can see them: they are caught up before
            `fit`'s epoch-end and train-end callbacks (and around train
            batches when a callback reads weights there), after
            `train_on_batch`, and at the end of `fit`. A layer whose
            weights are written between steps (a callback's `set_weights`
            or `assign` during `fit`) has its next push measured on the
            variables instead, so the change reaches the shards as without
            capture (`ps_stats()["outside_write_pushes"]` counts those
            pushes). Defaults to True.
        average_epoch_logs: before `fit`'s epoch-end callbacks run, replace
            each number in the epoch's logs (loss, metrics, validation
            metrics) by its mean over the live workers, so that deciding
            callbacks (`EarlyStopping`, `ReduceLROnPlateau`,
            `ModelCheckpoint(save_best_only=True)`) decide alike on every
            worker. Costs a barrier at every epoch end (a clock and one
            read of a small per-clock table; under SSP the slack is spent
            there) and needs epoch ends that line up across workers
            (`keras/epoch_logs.py`): a worker that rejoined a job under
            way (`client.rejoined_at`) lines up with the others' epochs at
            the start of its `fit` (`keras/rejoin.py`; it warns where it
            cannot). Defaults to True.
        average_non_trainable: at every epoch end of `fit` (before the
            callbacks, or before the validation when it validates),
            replace the model's non-trainable statistics
            (BatchNorm's moving mean and variance: the non-trainable
            floating-point variables no frozen layer and no parameter
            table holds) by their mean over the live workers, so that
            every worker, and the model it saves, normalises by the
            statistics of all the data, as TF's MirroredStrategy reads
            them. Costs a barrier at every epoch
            end when the model has such variables (none otherwise) and,
            like `average_epoch_logs`, needs epoch ends that line up
            across workers (`keras/non_trainable.py`). Defaults to True.
    """

    def __init__(self, cluster=None, slack=0, update_mode="average",
                 timeout=120.0, device=None, client=None, curve=None,
                 device_memory_budget=None, capture_updates=True,
                 average_epoch_logs=True, average_non_trainable=True):
        check_update_mode(update_mode)
        if device_memory_budget is not None:
            check_budget(device_memory_budget, "device_memory_budget")
        own_client = client is None
        if own_client:
            client = GeePSClient(cluster or ClusterSpec.from_env(),
                                 slack=slack, timeout=timeout, curve=curve)
        try:
            self._init(client, update_mode, device, device_memory_budget,
                       capture_updates)
            self.epoch_logs = EpochLogAverager(client) \
                if average_epoch_logs else None
            self.non_trainable = NonTrainableAverager(
                client, self.parameter_sync) if average_non_trainable else None
            _tf_hooks.install_fit_hooks()
        except BaseException:
            if own_client:  # its I/O thread would keep heartbeating
                client.close()
            raise

    def _init(self, client, update_mode, device, device_memory_budget,
              capture_updates):
        """The rest of `__init__`, once there is a client."""
        if device is None:
            device = ("/gpu:0" if tf.config.list_physical_devices("GPU")
                      else "/cpu:0")
        else:
            check_device(device)
        self.client = client
        self.parameter_sync = ParameterSync(client, update_mode,
                                            capture_updates=capture_updates)
        self.device_memory_budget = device_memory_budget
        self._device = device
        self._memory = None  # the LayerwiseTrainer, once created
        hooks = self.parameter_sync if device_memory_budget is None else \
            _BudgetGuard(self)
        _tf_hooks.init_strategy(self, device, hooks)

    # ------------------------------------------------------------ cluster
    @property
    def worker_id(self):
        return self.client.worker_id

    @property
    def num_workers(self):
        return self.client.num_workers

    @property
    def is_chief(self):
        """True on worker 0, which writes checkpoints by default."""
        return self.client.worker_id == 0

    @property
    def slack(self):
        return self.client.slack

    # --------------------------------------------------------------- data
    def distribute_dataset(self, dataset, shard=True):
        """Gives this worker its share of a (batched) dataset.

        Every worker takes every N-th element (batch), and all take the same
        number of them, so every worker runs the same number of steps (BSP
        needs that; a worker with one step more would wait for the others
        until the timeout). That needs the dataset's length: one that
        TensorFlow cannot count (after `filter`, from `from_generator`, ...)
        is refused, unless it is infinite (`repeat()`; `fit` then needs
        `steps_per_epoch`, which every worker runs). Shuffle after it, or
        with a seed every worker passes alike: a dataset shuffled without
        a seed is in another order in every process, and the workers'
        shares would overlap.

        Example:

        ```python
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
        ds = strategy.distribute_dataset(ds).shuffle(100)
        model.fit(ds, epochs=3, callbacks=strategy.callbacks())
        ```

        Args:
            dataset: a `tf.data.Dataset`, usually already batched.
            shard: False to give every worker the whole dataset (when the
                input is already split per worker). Defaults to True.

        Returns:
            The worker's `tf.data.Dataset`.

        Raises:
            ValueError: the dataset's length is unknown
                (`dataset.cardinality()` is `tf.data.UNKNOWN_CARDINALITY`).
                Declare it with `dataset.apply(
                tf.data.experimental.assert_cardinality(n))` (n elements in
                all, before sharding), or `repeat()` the dataset and pass
                `steps_per_epoch` to `fit`. Or it has fewer elements than
                there are workers: each worker's share would be empty.
        """
        if not shard or self.num_workers == 1:
            return dataset
        count = int(dataset.cardinality())
        if count == int(tf.data.UNKNOWN_CARDINALITY):
            raise ValueError(
                "distribute_dataset: TensorFlow cannot tell how many "
                "elements (batches) this dataset has (its cardinality is "
                "unknown, e.g. after filter() or from from_generator()), so "
                "the workers' shards cannot be cut to the same number of "
                "steps; a worker with a step more would wait for the others "
                "until the timeout. Declare the length: "
                "dataset.apply(tf.data.experimental.assert_cardinality(n)) "
                "with n the elements in all, before distribute_dataset; or "
                "repeat() the dataset and pass steps_per_epoch to fit")
        if 0 <= count < self.num_workers:
            raise ValueError(
                f"distribute_dataset: the dataset has {count} elements "
                f"(batches), fewer than the {self.num_workers} workers, so "
                f"each worker's share would be empty: batch it smaller or "
                f"repeat() it")
        shard_ds = dataset.shard(self.num_workers, self.worker_id)
        if count >= 0:
            shard_ds = shard_ds.take(count // self.num_workers)
        return shard_ds

    def experimental_distribute_dataset(self, dataset, options=None):
        """Returns `dataset` itself: one device needs no distributed iterator
        (it would cost ~7 ms per step)."""
        del options
        return dataset

    # ---------------------------------------------------------- training
    def callbacks(self, checkpoint_path=None, **checkpoint_kwargs):
        """The callbacks to give `model.fit`.

        Args:
            checkpoint_path: if given, a `keras.callbacks.ModelCheckpoint`
                writing there, on worker 0 only. Defaults to None.
            **checkpoint_kwargs: passed to `ModelCheckpoint`.

        Returns:
            A list of callbacks.
        """
        from keras_geeps.keras.callbacks import (  # noqa: PLC0415
            ChiefOnly, ParameterServerCallback)
        callbacks = [ParameterServerCallback(self)]
        if checkpoint_path:
            import keras  # noqa: PLC0415
            callbacks.append(ChiefOnly(keras.callbacks.ModelCheckpoint(
                checkpoint_path, **checkpoint_kwargs), self))
        return callbacks

    def reraise(self):
        """A context in which a step's parameter-server errors keep their
        class: for custom training loops.

        A pull or push runs inside the step as a `tf.py_function`, which
        hands TensorFlow only its exception's message: a
        `GeePSTimeoutError` or `GeePSWorkerFailedError` comes out of a
        `tf.function` as `tf.errors.UnknownError`. `fit`, `evaluate`,
        `predict` and `*_on_batch` re-raise it as itself; around your own
        steps, this does (any other error passes unchanged).

        Example:

        ```python
        with strategy.reraise():
            for x, y in dataset:
                train_step(x, y)   # a tf.function calling strategy.run
        ```
        """
        return _tf_hooks.reraising_failures()

    def sync(self):
        """Brings every worker's variables to the shards' latest values.

        Waits until the tables reflect every worker's last clock (ignoring
        the slack), then assigns them: after the same number of steps,
        every worker then holds identical trainable weights (non-trainable
        ones, e.g. BatchNorm statistics, are averaged at `fit`'s epoch
        ends, `average_non_trainable`, not here). A weight written after
        the last step, which no step takes to the shards, stays this
        worker's where no fresh rows come (under BSP: workers that made
        the same write end alike, as plain TensorFlow would), and is
        replaced by the shards' rows where they do (SSP). Under a
        memory budget the staged layers first get their variables back
        (`LayerwiseTrainer.materialize()`).
        """
        if self._memory is not None:
            self._memory.materialize()
        sync = self.parameter_sync
        if sync.pending_count():
            warnings.warn(
                f"strategy.sync(): no step that trains them has run through "
                f"the strategy, so {sync.pending_count()} trainable "
                f"variables created in its scope have no parameter table "
                f"and were not synced (a model not fit yet; a step that "
                f"trains them must run as strategy.run(step_fn, args), or "
                f"through fit; called directly, it trains this worker's "
                f"copy alone)", stacklevel=2)
        sync.pull_all(full=True)

    # ------------------------------------------------- memory management
    def layerwise_trainer(self, model, optimizer, loss, batch_size,
                          offload_activations=None, audit=False):
        """Records the model's step, plans it under the budget, and returns
        the `LayerwiseTrainer` that runs it through the shards.

        Create the model inside `scope()`. Each `trainer.train_step(x, y)`
        pulls every table (a staged layer's straight into host memory),
        runs the step layer by layer within `device_memory_budget`, and
        pushes and clocks each layer's update as soon as it is applied.

        Example:

        ```python
        strategy = keras_geeps.GeePSStrategy(device_memory_budget=2 << 30)
        with strategy.scope():
            model = build_model()
        trainer = strategy.layerwise_trainer(
            model, keras.optimizers.SGD(0.01), loss_fn, batch_size=64)
        print(strategy.memory_plan)
        for x, y in strategy.distribute_dataset(ds):
            trainer.train_step(x, y)
        strategy.sync()
        ```

        Args:
            model: a built Keras model that is a chain of layers.
            optimizer: a Keras optimizer (copied per layer, with its
                state; `close()` gives it the copies' state back), or
                its name.
            loss: a Keras loss, its name, or `loss(y_true, y_pred)`;
                per-sample losses are averaged over the batch.
            batch_size: the per-worker batch size.
            offload_activations: None, "auto" or a list of layer names.
                Defaults to None.
            audit: measure the device bytes after every change (tests).
                Defaults to False.

        Returns:
            A `keras_geeps.memory.LayerwiseTrainer`.
        """
        from keras_geeps.memory.trainer import (  # noqa: PLC0415
            LayerwiseTrainer)
        if self._memory is not None:
            self._memory.close()
            self._memory = None  # (a new one that fails leaves no plan)
        self._memory = LayerwiseTrainer(
            model, optimizer, loss, batch_size,
            device_memory_budget=self.device_memory_budget,
            offload_activations=offload_activations,
            sync=self.parameter_sync, device=self._device, audit=audit)
        return self._memory

    @property
    def memory_plan(self):
        """The `MemoryPlan` of the layer-wise trainer (print it for a table
        of what is resident, staged and offloaded), or None before
        `layerwise_trainer()`."""
        return self._memory.plan if self._memory is not None else None

    def ps_stats(self):
        """This worker's parameter-server figures (bytes, waits, data age)."""
        return self.parameter_sync.stats()

    def close(self):
        """Closes the connections to the shards."""
        if self._memory is not None:
            self._memory.close()
        self.parameter_sync.close()
        self.client.close()


class _BudgetGuard:
    """The strategy's hooks under a memory budget. A compiled Keras step
    (`model.fit`) holds every layer on the device, so an optimizer update
    inside one is refused; any other compiled step (evaluate, predict)
    needs the staged layers back first."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.sync = strategy.parameter_sync
        self.track_variable = self.sync.track_variable
        self._in_step = False

    def note_update(self, variable):
        if self._in_step:
            raise GeePSError(
                "model.fit cannot keep to device_memory_budget (its compiled "
                "step holds every layer on the device): train with "
                "strategy.layerwise_trainer(...).train_step")
        self.sync.note_update(variable)

    @staticmethod
    def update_capture(variable):
        return None  # the layerwise trainer updates variables itself

    def wrap_step(self, call, is_train_step=False, builds_tables=True):
        self._check_materialized()  # (at the trace: at once)
        # And at every run of the traced step, before its pulls: a
        # trainer's step since may have staged the layers out again.
        check = tf.py_function(self._check_materialized_op, [], tf.bool,
                               name="geeps_budget_check")
        self._in_step = True
        try:
            with tf.control_dependencies([check]):
                return self.sync.wrap_step(call, is_train_step,
                                           builds_tables)
        finally:
            self._in_step = False

    def _check_materialized(self):
        memory = self.strategy._memory
        if memory is not None and not memory.materialized:
            raise GeePSError(
                "the staged layers' variables are in host memory: call "
                "strategy.sync() (or trainer.materialize()) before "
                "evaluate / predict")

    def _check_materialized_op(self):
        try:
            self._check_materialized()
        except GeePSError as exc:  # (Keras re-raises it as such)
            self.sync._keep_failure(exc)
            raise
        return True
