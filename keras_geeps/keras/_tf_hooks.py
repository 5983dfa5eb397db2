"""The one place keras_geeps reaches into TensorFlow's private distribute API.

Keras 3's `model.fit` runs every step through the current
`tf.distribute.Strategy` (`strategy.run` -> `extended._call_for_each_replica`),
creates variables through it, and its optimizer applies each variable's
update through `extended.update` -> `extended._update`. Those are the only
hooks that let a parameter server see the variables and wrap every compiled
train step without changing the user's model; TensorFlow has no public way
to subclass a strategy's extended object. This module holds that reach and
nothing else, and TensorFlow's minor version is pinned in setup.py because
of it (tests/keras/test_tf_hooks.py checks that these hooks still fire).

It also holds the reach into Keras: `install_update_capture` lets the sync
take a step's additive update from `Optimizer.assign_add` / `assign_sub`
(the methods every built-in optimizer's `update_step` writes a variable
through) instead of writing the variable and measuring the change
afterwards, and `optimizer_refuses_capture` reads the optimizer settings
under which that would be wrong. After a step the variables are not the
shards' rows (a captured update is not in them; a measured one is this
worker's own, unscaled), so `_install_catch_ups` makes Keras catch them up
wherever user code can see them between steps: `CallbackList`'s dispatch
(before epoch / train end, evaluate / predict begin, and around train
batches when a callback reads weights there), after `train_on_batch`, and
in `finalize_variable_values` (the end of `fit`; under `use_ema` that
makes the workers' mean moving averages the weights everywhere,
`ParameterSync.finalize_moving_average`); and at `fit`'s start, and at
each `train_on_batch`, has the first step take the shards' rows, whatever
weights were set since. `install_write_watch` tells the syncs of eager
writes to tf.Variables (a callback's `set_weights` between steps), whose
layers' next pushes must then be measured rather than captured.
`install_fit_hooks` has a worker that rejoined a job under way line up
with the others' epochs as `fit` begins (keras/rejoin.py), the
strategy's `EpochLogAverager` (keras/epoch_logs.py) replace an epoch's logs
by their mean over the workers before epoch-end callbacks, its
`NonTrainableAverager` (keras/non_trainable.py) do the same for the
model's BatchNorm statistics (before `fit`'s validation when it validates),
the final sync
run before train-end callbacks, and an exception raised in a step's pull or
push come out of `fit`, `evaluate`, `predict` and `*_on_batch` as itself
rather than as the `tf.errors.UnknownError` `tf.py_function` makes of it.
"""

import contextlib
import copy
import functools
import inspect
import threading
import weakref

import keras
import tensorflow as tf

from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.framework import errors as tf_errors
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import resource_variable_ops

from keras_geeps.keras import rejoin


def _callers(max_frames):
    """The `self` of each of the caller's callers, nearest first (None for
    a function's frame), `max_frames` at most."""
    frame = inspect.currentframe().f_back
    for _ in range(max_frames):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return
        yield frame.f_locals.get("self")


def _creating_keras_variable(max_frames=16):
    """The path of the Keras variable whose TF variable is being created
    (the caller's callers), or None for a plain TF variable.

    A TF variable's name carries TensorFlow's name scopes, which a layer
    built lazily inside a traced step (a Sequential model without an
    Input, a subclassed model) does not enter: its variables are named
    plain 'kernel' and 'bias'. Its Keras variable, whose initialisation
    creates it, knows its path ('model/dense/kernel').
    """
    for owner in _callers(max_frames):
        if isinstance(owner, keras.Variable):
            return owner.path
    return None


def _creating_layer_weight(max_frames=48):
    """Whether the TF variable being created is a Keras layer's weight:
    the nearest Keras object among the callers is a layer, not an
    optimizer (its slots) or a metric (its totals), which a model's
    compile or step may create inside a layer's call."""
    for owner in _callers(max_frames):
        if isinstance(owner, (keras.optimizers.Optimizer,
                              keras.metrics.Metric)):
            return False
        if isinstance(owner, keras.layers.Layer):
            return True
    return False


class GeePSExtended(one_device_strategy.OneDeviceExtended):
    """OneDevice placement plus three hooks into a `ParameterSync`."""

    def __init__(self, container_strategy, device, sync):
        super().__init__(container_strategy, device)
        self._geeps_sync = sync

    def _create_variable(self, next_creator, **kwargs):
        variable = super()._create_variable(next_creator, **kwargs)
        trainable = kwargs.get("trainable")
        # An integer (or bool) one, trainable by default in TF and Keras,
        # takes no gradient: like a non-trainable weight it is this
        # worker's own, starting from worker 0's value.
        trainable = (trainable is None or bool(trainable)) and \
            variable.dtype.is_floating
        self._geeps_sync.track_variable(
            variable, trainable, keras_path=_creating_keras_variable(),
            layer_weight=not trainable and _creating_layer_weight())
        return variable

    def _update(self, var, fn, args, kwargs, group):
        self._geeps_sync.note_update(var)
        with capturing(self._geeps_sync.update_capture(var)):
            return super()._update(var, fn, args, kwargs, group)

    def _call_for_each_replica(self, fn, args, kwargs):
        parent = super()._call_for_each_replica
        train = is_keras_train_step(fn)
        if train:  # its model's tables: another's may be loaded yet
            model = inspect.unwrap(fn).__self__

            def builds():  # (read only when variables are pending)
                return model.weights
        else:
            builds = not is_keras_eval_step(fn)
        return self._geeps_sync.wrap_step(
            lambda: parent(fn, args, kwargs), train, builds_tables=builds)


def init_strategy(strategy, device, sync):
    """Initialises `strategy` (a OneDeviceStrategy subclass) with our hooks."""
    distribute_lib.Strategy.__init__(strategy,
                                     GeePSExtended(strategy, device, sync))


def is_keras_train_step(fn):
    """True when `fn` is a Keras model's bound `train_step` (what fit runs).

    `strategy.run` hands the step over wrapped by autograph, so the bound
    method is found by unwrapping.
    """
    fn = inspect.unwrap(fn)
    owner = getattr(fn, "__self__", None)
    return (getattr(fn, "__name__", "") == "train_step"
            and hasattr(owner, "compile") and hasattr(owner, "fit"))


def is_keras_eval_step(fn):
    """True when `fn` is a Keras model's test step (`evaluate`) or predict
    step (`predict`: a closure of `make_predict_function`). Such a step
    builds no parameter tables: weights set before the first `fit` (a
    pretrained model's, loaded after a `predict`) are what the tables
    start from."""
    fn = inspect.unwrap(fn)
    owner = getattr(fn, "__self__", None)
    if getattr(fn, "__name__", "") == "test_step":
        return hasattr(owner, "compile") and hasattr(owner, "fit")
    return getattr(fn, "__qualname__", "").endswith(
        "make_predict_function.<locals>.one_step_on_data")


def in_xla_context():
    """True while tracing for XLA (jit_compile), which cannot run our ops."""
    return control_flow_util.GraphOrParentsInXlaContext(
        tf_ops.get_default_graph())


# ------------------------------------------------- optimizer update capture
_current = threading.local()
_all_syncs = weakref.WeakSet()  # every open ParameterSync


def restoring():
    """Whether this thread restores weights: in `Model.load_weights`,
    `Layer.set_weights` or `fit`'s callbacks' `on_train_begin` (where
    `BackupAndRestore` restores its backup). Eager writes then are
    restores (`ParameterSync.note_outside_write`)."""
    return getattr(_current, "restoring", False)


@contextlib.contextmanager
def _restoring():
    previous = restoring()
    _current.restoring = True
    try:
        yield
    finally:
        _current.restoring = previous


def _install_restore_watch():
    """Has `Model.load_weights` and `Layer.set_weights` run `_restoring`.
    Idempotent."""
    for cls, name in ((keras.Model, "load_weights"),
                      (keras.layers.Layer, "set_weights")):
        original = cls.__dict__[name]
        if getattr(original, "_geeps_restores", False):
            continue

        @functools.wraps(original)
        def restores(self, *args, _original=original, **kwargs):
            with _restoring():
                return _original(self, *args, **kwargs)

        restores._geeps_restores = True
        setattr(cls, name, restores)


def track_sync(sync):
    """Registers a new `ParameterSync`: Keras' end of `fit` and its errors
    are handled through it (`install_fit_hooks`)."""
    _all_syncs.add(sync)


@contextlib.contextmanager
def capturing(capture):
    """Offers the optimizer's additive updates made inside to `capture`
    (an object with `offer(optimizer, variable, value, sign) -> bool`; a
    refused offer is applied to the variable as usual). None offers none."""
    previous = getattr(_current, "capture", None)
    _current.capture = capture
    try:
        yield
    finally:
        _current.capture = previous


def install_update_capture():
    """Routes Keras optimizers' `assign_add` / `assign_sub` through
    `capturing`, and has Keras call every sync's `catch_up(variables)`
    wherever user code can see the weights between steps
    (`_install_catch_ups`), so that a captured last update is in the
    variables then. Idempotent."""
    cls = keras.optimizers.Optimizer
    if cls.__dict__.get("_geeps_capture_installed"):
        return
    _install_catch_ups()
    install_write_watch()
    for name, sign in (("assign_add", 1.0), ("assign_sub", -1.0)):
        original = getattr(cls, name)

        def method(self, variable, value, _original=original, _sign=sign):
            capture = getattr(_current, "capture", None)
            if capture is not None and capture.offer(self, variable, value,
                                                     _sign):
                return None
            return _original(self, variable, value)

        method.__name__ = name
        method.__doc__ = original.__doc__
        setattr(cls, name, method)
    cls._geeps_capture_installed = True


# The tf.Variable methods that write it.
_WRITES = ("assign", "assign_add", "assign_sub", "scatter_add",
           "scatter_sub", "scatter_max", "scatter_min", "scatter_mul",
           "scatter_div", "scatter_update", "batch_scatter_update",
           "scatter_nd_add", "scatter_nd_sub", "scatter_nd_update",
           "scatter_nd_max", "scatter_nd_min")


def install_write_watch():
    """Has every sync hear of each write of a tf.Variable through its
    methods (`assign*`, `scatter*`) outside the steps it wraps: an eager
    one (a callback's `set_weights`, `load_weights`, a variable's own
    `assign` or `scatter_update`) is noted at once
    (`ParameterSync.note_outside_write`); one traced into a function
    outside any step (a callback's `tf.function`), when traced
    (`note_traced_write`), for good, since that function may run before
    any push. A captured layer's next push must carry such writes, as a
    measured one does, and under "sum" any layer's push must send them
    averaged over the workers. Costs a check per eager write and per
    traced one, nothing per run of a traced step. Idempotent."""
    _install_restore_watch()
    if resource_variable_ops.BaseResourceVariable.__dict__.get(
            "_geeps_writes_watched"):
        return
    classes = (resource_variable_ops.BaseResourceVariable,
               resource_variable_ops.ResourceVariable)
    for cls in classes:
        for name in _WRITES:
            original = cls.__dict__.get(name)
            if original is None:
                continue

            @functools.wraps(original)
            def watched(self, *args, _original=original, **kwargs):
                if _all_syncs:
                    eager = tf.executing_eagerly()
                    for active in list(_all_syncs):
                        if eager:
                            active.note_outside_write(self)
                        else:
                            active.note_traced_write(self)
                return _original(self, *args, **kwargs)

            setattr(cls, name, watched)
    resource_variable_ops.BaseResourceVariable._geeps_writes_watched = True


def release_sync(sync):
    """Stops catching up `sync`'s variables (its client is closing)."""
    _all_syncs.discard(sync)


def catch_up(variables):
    """Brings `variables` to the shards' rows where a step pushed since
    their last pull (`ParameterSync.catch_up`)."""
    for active in list(_all_syncs):
        active.catch_up(variables)


def _for_model(model, method, **kwargs):
    """Calls `method` (the name of a `ParameterSync` method taking
    variables, and `kwargs`) of every open sync with `model`'s weights;
    nothing without a model or a sync."""
    if model is not None and _all_syncs:
        weights = model.weights
        for active in list(_all_syncs):
            getattr(active, method)(weights, **kwargs)


def _catch_up_model(model):
    _for_model(model, "catch_up")


def _restart_model_from_shards(model):
    _for_model(model, "restart_from_shards")


# CallbackList methods before whose callbacks the weights are made current:
# once per epoch or per call, never per step.
_CATCH_UP_BEFORE = ("on_epoch_end", "on_train_end", "on_test_begin",
                    "on_predict_begin")


def _install_catch_ups():
    """Patches Keras where user code sees the weights between steps (each
    a no-op while no layer was pushed since its pull), and `fit`'s start
    (`on_train_begin`: the first step pulls the shards' rows whatever the
    weights were set to since). Idempotent."""
    from keras_geeps.keras.callbacks import (  # noqa: PLC0415
        reads_weights_per_batch)
    optimizer = keras.optimizers.Optimizer
    if optimizer.__dict__.get("_geeps_catch_ups_installed"):
        return
    optimizer._geeps_catch_ups_installed = True
    finalize = optimizer.finalize_variable_values

    @functools.wraps(finalize)
    def finalize_variable_values(self, var_list):
        if getattr(self, "use_ema", False):
            # The moving averages become the weights on every worker and
            # in the shards (`ParameterSync.finalize_moving_average`).
            for active in list(_all_syncs):
                if active.finalize_moving_average(
                        var_list, lambda: finalize(self, var_list)):
                    return
        finalize(self, var_list)
        catch_up(var_list)

    optimizer.finalize_variable_values = finalize_variable_values

    callback_list = keras.callbacks.CallbackList
    for name in _CATCH_UP_BEFORE:
        original = getattr(callback_list, name)

        @functools.wraps(original)
        def before(self, *args, _original=original, **kwargs):
            _catch_up_model(getattr(self, "_model", None))
            return _original(self, *args, **kwargs)

        setattr(callback_list, name, before)
    on_train_begin = callback_list.on_train_begin

    @functools.wraps(on_train_begin)
    def restarted(self, *args, **kwargs):
        _restart_model_from_shards(getattr(self, "_model", None))
        return on_train_begin(self, *args, **kwargs)

    callback_list.on_train_begin = restarted
    for name in ("on_train_batch_begin", "on_train_batch_end"):
        original = getattr(callback_list, name)

        @functools.wraps(original)
        def around_batch(self, *args, _original=original, **kwargs):
            # Here, in the dispatching thread: never beside the next step.
            if _all_syncs and _observes_batches(self, reads_weights_per_batch):
                _catch_up_model(getattr(self, "_model", None))
            return _original(self, *args, **kwargs)

        setattr(callback_list, name, around_batch)

    owner = next(k for k in keras.Model.__mro__
                 if "train_on_batch" in k.__dict__)
    train_on_batch = owner.train_on_batch

    @functools.wraps(train_on_batch)
    def train_on_batch_caught_up(self, *args, **kwargs):
        # Each call, as each fit, starts from the shards' rows: weights set
        # since the last call are this worker's alone, and a step measuring
        # its update on them would push their difference to the shards.
        _restart_model_from_shards(self)
        logs = train_on_batch(self, *args, **kwargs)
        _catch_up_model(self)
        return logs

    owner.train_on_batch = train_on_batch_caught_up


def install_fit_hooks():
    """Patches Keras' `CallbackList` for `fit` under a GeePS strategy:

    - `on_epoch_end` first averages the logs through the trained model's
      strategy (`strategy.epoch_logs`, when it has one), so every
      epoch-end callback sees the workers' mean (and, past that barrier,
      weights with every worker's last clock, whatever the slack), and then
      the model's
      non-trainable statistics (`strategy.non_trainable`), unless `fit`'s
      validation (`on_test_begin` of fit's own list, marked at
      `on_train_begin`) averaged them first;
    - `on_train_end` first has each `ParameterServerCallback` in the list
      bring the weights to the shards' latest, so a callback that then sets
      weights (`EarlyStopping(restore_best_weights=True)`) keeps them
      wherever it stands in the list.

    Both wrap the catch-ups of captured updates (`_install_catch_ups`,
    installed here first), so the order is the same whichever strategy
    came first: average, sync, catch up, then the callbacks. And Keras'
    `fit`, `evaluate`, `predict` and `*_on_batch` re-raise what a sync's
    op raised (`_install_reraise`). Idempotent; installed by every
    `GeePSStrategy`, whatever its options.
    """
    from keras_geeps.keras.callbacks import (  # noqa: PLC0415
        ParameterServerCallback)
    callback_list = keras.callbacks.CallbackList
    if callback_list.__dict__.get("_geeps_fit_hooks_installed"):
        return
    _install_catch_ups()
    on_train_begin = callback_list.on_train_begin
    on_test_begin = callback_list.on_test_begin
    on_epoch_end = callback_list.on_epoch_end
    on_train_end = callback_list.on_train_end

    def strategy_of(callbacks):
        model = getattr(callbacks, "_model", None)
        return model, getattr(model, "distribute_strategy", None)

    def average_statistics(callbacks):
        model, strategy = strategy_of(callbacks)
        statistics = getattr(strategy, "non_trainable", None)
        if statistics is not None:  # (BatchNorm's: the workers' mean)
            statistics.average(model)

    @functools.wraps(on_train_begin)
    def fitting(self, *args, **kwargs):
        self._geeps_fitting = True  # (this list: fit's own)
        self._geeps_statistics_averaged = False
        with _restoring():
            result = on_train_begin(self, *args, **kwargs)
        # After the callbacks' own (BackupAndRestore sets the epoch too).
        model, strategy = strategy_of(self)
        start = rejoin.line_up(strategy, model, self.params.get("steps"))
        if start is not None:
            self._geeps_epoch_before = _start_fit_at_epoch(model, start)
        # The shards' rows now, not at the first step: what a callback
        # writes from here on (at on_epoch_begin, before the first batch)
        # is a write of this fit, which the first step carries.
        _for_model(model, "pull_restarted")
        return result

    @functools.wraps(on_test_begin)
    def validated_averaged(self, *args, **kwargs):
        # fit's validation (the same list): measure the averaged model
        if getattr(self, "_geeps_fitting", False):
            average_statistics(self)
            self._geeps_statistics_averaged = True
        return on_test_begin(self, *args, **kwargs)

    @functools.wraps(on_epoch_end)
    def averaged(self, epoch, logs=None):
        model, strategy = strategy_of(self)
        averager = getattr(strategy, "epoch_logs", None)
        averaged_first = getattr(self, "_geeps_statistics_averaged", False)
        if averager is not None and logs is not None:
            # before any callback sees them; with where the epoch ended
            averager.average(
                logs, epoch=epoch, clock=strategy.parameter_sync.clock,
                statistics_clock=rejoin.statistics_clock_after(
                    strategy, model, averaged_first))
            # Every worker has pushed the whole epoch: under SSP too, the
            # callbacks (a ModelCheckpoint, EarlyStopping's best weights)
            # see the same weights on every worker, at no wait.
            _for_model(model, "catch_up", current=True)
        if not averaged_first:
            average_statistics(self)
        self._geeps_statistics_averaged = False
        return on_epoch_end(self, epoch, logs)

    @functools.wraps(on_train_end)
    def synced_first(self, *args, **kwargs):
        self._geeps_fitting = False
        if hasattr(self, "_geeps_epoch_before"):  # (a later fit: its own)
            _start_fit_at_epoch(self._model, self.__dict__.pop(
                "_geeps_epoch_before"))
        for callback in self.callbacks:
            if isinstance(callback, ParameterServerCallback):
                callback.sync_before_train_end()
        return on_train_end(self, *args, **kwargs)

    callback_list.on_train_begin = fitting
    callback_list.on_test_begin = validated_averaged
    callback_list.on_epoch_end = averaged
    callback_list.on_train_end = synced_first
    _install_reraise()
    callback_list._geeps_fit_hooks_installed = True


def _start_fit_at_epoch(model, epoch):
    """Has the `fit` whose callbacks are beginning start at `epoch`;
    returns what it would have started at (None: its `initial_epoch`), to
    be put back at its end.

    Keras' `fit` reads `model._initial_epoch` (before its own
    `initial_epoch`) right after `on_train_begin`, as
    `keras.callbacks.BackupAndRestore` uses it; there is no public hook.
    tests/keras/test_fit_errors.py's rejoin tests check that it still
    takes.
    """
    before = model._initial_epoch
    model._initial_epoch = epoch
    return before


# Keras methods that run compiled steps: an exception our pull / push ops
# raise inside one comes out of them as TensorFlow's error.
_RUNS_STEPS = ("fit", "evaluate", "predict", "train_on_batch",
               "test_on_batch", "predict_on_batch")


def _install_reraise():
    """Patches Keras' `fit`, `evaluate`, `predict` and `*_on_batch` so that
    an exception raised in a sync's pull or push op (a `tf.py_function`,
    which hands TensorFlow only its message: `tf.errors.UnknownError`)
    comes out as itself, with its class (`GeePSTimeoutError`,
    `GeePSWorkerFailedError`, ...), chained to TensorFlow's error.
    Idempotent."""
    for name in _RUNS_STEPS:
        owner = next(k for k in keras.Model.__mro__ if name in k.__dict__)
        original = owner.__dict__[name]
        if getattr(original, "_geeps_reraises", False):
            continue

        @functools.wraps(original)
        def reraising(self, *args, _original=original, _name=name,
                      **kwargs):
            with reraising_failures(), _fitting(self, _name == "fit"):
                return _original(self, *args, **kwargs)

        reraising._geeps_reraises = True
        setattr(owner, name, reraising)


@contextlib.contextmanager
def _fitting(model, fit):
    """Marks the sync of `model`'s strategy as in Keras' `fit` while
    within (when `fit`): its callbacks catch the variables up, so its
    steps need not (`ParameterSync.fitting`)."""
    sync = getattr(getattr(model, "distribute_strategy", None),
                   "parameter_sync", None) if fit else None
    if sync is None:
        yield
        return
    sync.fitting += 1
    try:
        yield
    finally:
        sync.fitting -= 1


@contextlib.contextmanager
def reraising_failures():
    """Within it, a `tf.errors.OpError` that reports an exception a sync's
    pull or push op raised comes out as that exception (a copy, chained
    to TensorFlow's error); any other error as it is."""
    try:
        yield
    except tf_errors.OpError as error:
        failure = _take_failure(error)
        if failure is None:
            raise
        raise _copy(failure) from error


def _copy(failure):
    """A copy of `failure` with its traceback (the client may keep and
    raise the original again: it must not take on this call's cause)."""
    try:
        fresh = copy.copy(failure)
    except Exception:  # an exception class copy cannot rebuild
        return failure
    return fresh.with_traceback(failure.__traceback__)


def _take_failure(error):
    """The exception a sync's op raised that `error` reports, or None."""
    message = getattr(error, "message", None) or str(error)
    for active in list(_all_syncs):
        failure = active.take_failure(message)
        if failure is not None:
            return failure
    return None


def _observes_batches(callback_list, reads_weights_per_batch):
    """Whether a callback of `callback_list` reads weights at train batches
    (remembered per list of callbacks: the check runs at every batch)."""
    key = tuple(map(id, callback_list.callbacks))
    cached = callback_list.__dict__.get("_geeps_observes_batches")
    if cached is None or cached[0] != key:
        cached = (key, any(map(reads_weights_per_batch,
                               callback_list.callbacks)))
        callback_list._geeps_observes_batches = cached
    return cached[1]


def optimizer_refuses_capture(optimizer, variable):
    """Why `optimizer`'s update of `variable` (a tf.Variable) must be written
    to the variable rather than captured, or None.

    An exponential moving average reads the updated variable within the
    step, gradient accumulation applies updates under a condition, and a
    constraint rewrites the variable after its update: each needs the
    variable itself up to date. Keras keeps the constraint on its own
    variable, found through the optimizer's `_trainable_variables`.
    """
    if getattr(optimizer, "use_ema", False):
        return "the optimizer keeps a moving average (use_ema)"
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return "the optimizer accumulates gradients"
    for keras_variable in getattr(optimizer, "_trainable_variables", ()):
        if getattr(keras_variable, "_value", None) is variable:
            if getattr(keras_variable, "constraint", None) is not None:
                return f"{keras_variable.path} has a constraint"
            return None
    return "the optimizer does not track the variable"


# Resource ops that only read a variable; any other op taking its handle
# (assignments, scatters, ResourceApply*, control flow) may write it.
READ_ONLY_RESOURCE_OPS = frozenset({
    "ReadVariableOp", "VariableShape", "VarIsInitializedOp", "ResourceGather",
    "ResourceGatherNd", "DestroyResourceOp"})


def ops_writing(graph, handles, start=0):
    """The external resource handles among `handles` (ids of `var.handle`)
    that an op of `graph` created at or after position `start` may write."""
    internal = {id(inner): id(outer) for outer, inner in graph.captures}
    written = set()
    for op in graph.get_operations()[start:]:
        if op.type in READ_ONLY_RESOURCE_OPS:
            continue
        for tensor in op.inputs:
            outer = internal.get(id(tensor), id(tensor))
            if outer in handles:
                written.add(outer)
    return written


def ops_using_after(graph, positions):
    """The external resource handles among `positions` ({id(var.handle):
    position in `graph.get_operations()`}) that an op of `graph` created
    at or after that handle's position takes as an input (a read, or any
    other use)."""
    if not positions:
        return set()
    internal = {id(inner): id(outer) for outer, inner in graph.captures}
    operations = graph.get_operations()
    used = set()
    for position in range(min(positions.values()), len(operations)):
        for tensor in operations[position].inputs:
            outer = internal.get(id(tensor), id(tensor))
            if positions.get(outer, position + 1) <= position:
                used.add(outer)
    return used
