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
"""

import inspect

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
