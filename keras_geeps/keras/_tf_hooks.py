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

It also holds the one reach into Keras' optimizers: `install_update_capture`
lets the sync take a step's additive update from `Optimizer.assign_add` /
`assign_sub` (the methods every built-in optimizer's `update_step` writes a
variable through) instead of writing the variable and measuring the change
afterwards, and `optimizer_refuses_capture` reads the optimizer settings
under which that would be wrong.
"""

import contextlib
import inspect
import threading
import weakref

import keras

from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util


class GeePSExtended(one_device_strategy.OneDeviceExtended):
    """OneDevice placement plus three hooks into a `ParameterSync`."""

    def __init__(self, container_strategy, device, sync):
        super().__init__(container_strategy, device)
        self._geeps_sync = sync

    def _create_variable(self, next_creator, **kwargs):
        variable = super()._create_variable(next_creator, **kwargs)
        trainable = kwargs.get("trainable")
        self._geeps_sync.track_variable(variable,
                                        trainable is None or bool(trainable))
        return variable

    def _update(self, var, fn, args, kwargs, group):
        self._geeps_sync.note_update(var)
        with capturing(self._geeps_sync.update_capture(var)):
            return super()._update(var, fn, args, kwargs, group)

    def _call_for_each_replica(self, fn, args, kwargs):
        parent = super()._call_for_each_replica
        return self._geeps_sync.wrap_step(
            lambda: parent(fn, args, kwargs), is_keras_train_step(fn))


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


def in_xla_context():
    """True while tracing for XLA (jit_compile), which cannot run our ops."""
    return control_flow_util.GraphOrParentsInXlaContext(
        tf_ops.get_default_graph())


# ------------------------------------------------- optimizer update capture
_current = threading.local()
_syncs = weakref.WeakSet()  # ParameterSyncs that may hold captured layers


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


def install_update_capture(sync):
    """Routes Keras optimizers' `assign_add` / `assign_sub` through
    `capturing`, and calls `sync.catch_up(variables)` from
    `finalize_variable_values` (what `fit` calls on its way out), so that a
    captured last update reaches the variables. Idempotent."""
    _syncs.add(sync)
    cls = keras.optimizers.Optimizer
    if cls.__dict__.get("_geeps_capture_installed"):
        return
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
    finalize = cls.finalize_variable_values

    def finalize_variable_values(self, var_list):
        finalize(self, var_list)
        for active in list(_syncs):
            active.catch_up(var_list)

    finalize_variable_values.__doc__ = finalize.__doc__
    cls.finalize_variable_values = finalize_variable_values
    cls._geeps_capture_installed = True


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
