"""Takes a train step's optimizer updates before they reach the variables.

Under BSP every step replaces the variables with fresh rows from the
shards, so writing the optimizer's update into a variable only to measure
`variable - snapshot` afterwards costs three passes over the model that
nobody needs. Keras' built-in optimizers write every parameter through
`Optimizer.assign_add` / `assign_sub`; while a step is traced, those calls
are offered to an `UpdateCapture`, which keeps the update tensor instead,
and the push writes it (scaled) straight into the shard's upload buffer.

Anything that needs the written variable within the step refuses the
offer, and the update is applied as usual: a moving average (`use_ema`),
gradient accumulation, a constraint, an update under a condition (a loss
scale optimizer), a sparse update, or a variable already written directly
earlier in the step (weight decay). Steps run eagerly are never captured:
their direct writes leave no op to check. A layer is captured only when
every one of its variables was; the captured updates of a layer that is not
are applied at the end of the step, before its push measures the change.
So are, at push time, those of a layer whose weights were written between
steps (a callback's `set_weights`; `ParameterSync.note_outside_write`).

A read of a variable after its captured update in the same step (a GAN's
generator pass through the discriminator it has just updated) is found
only once the step is traced, too late to apply that update instead: the
step is refused with a `GeePSError` naming `capture_updates=False`.
"""

import keras
import tensorflow as tf

from keras_geeps.errors import GeePSError
from keras_geeps.keras import _tf_hooks


class UpdateCapture:
    """The captured optimizer updates of one traced train step.

    Args:
        graph: the graph the step is traced into.
        variables: the tf.Variables whose updates may be captured.

    Example:

    ```python
    capture = UpdateCapture(tf.compat.v1.get_default_graph(), variables)
    # ... the step is traced; `_tf_hooks.capturing(capture.expect(var))`
    # wraps each variable's optimizer update ...
    captured = capture.finish(layers)  # {layer index: (tensors, signs)}
    ```
    """

    def __init__(self, graph, variables):
        self.graph = graph
        self.start = len(graph.get_operations())
        self.variables = {id(v): v for v in variables}
        self.handles = {id(v.handle) for v in variables}
        self.current = None    # the variable being updated now
        self.updates = {}      # id(variable) -> [(value, sign)]
        self._scanned = self.start
        self._written = set()  # id(handle) written directly so far
        # id(handle) -> the graph position of its first captured update
        self.offered_at = {}

    def expect(self, variable):
        """This capture, primed for `variable`'s update (None when the
        variable is not one it may capture)."""
        if id(variable) not in self.variables:
            return None
        self.current = variable
        return self

    def offer(self, optimizer, variable, value, sign):
        """Keeps `sign * value` as `variable`'s update; False if refused."""
        if isinstance(variable, keras.Variable):
            variable = variable._value  # its tf.Variable
        if variable is not self.current:
            return False
        if self._refusal(optimizer, variable, value) is not None:
            return False
        value = tf.cast(value, variable.dtype)
        self.updates.setdefault(id(variable), []).append((value, sign))
        self.offered_at.setdefault(id(variable.handle),
                                   len(self.graph.get_operations()))
        return True

    def _refusal(self, optimizer, variable, value):
        if isinstance(value, tf.IndexedSlices):
            return "a sparse update"
        if tf.compat.v1.get_default_graph() is not self.graph:
            return "an update under a condition or loop"
        if not value.shape.is_fully_defined() or \
                value.shape != variable.shape:
            return "an update whose shape is not the variable's"
        reason = _tf_hooks.optimizer_refuses_capture(optimizer, variable)
        if reason is not None:
            return reason
        count = len(self.graph.get_operations())
        self._written |= _tf_hooks.ops_writing(self.graph, self.handles,
                                               self._scanned)
        self._scanned = count
        if id(variable.handle) in self._written:
            return "the variable was written directly earlier in the step"
        return None

    def finish(self, layers):
        """Decides, after the step is traced, which layers were captured.

        Args:
            layers: the `LayerTable`s, in table order.

        Returns:
            {layer index: (tensors, signs)}, the update of variable i being
            `signs[i] * tensors[i]`, for every layer whose variables all
            had their updates captured and written nowhere else. Other
            layers' captured updates are applied to their variables here
            (the step's last writes to them).

        Raises:
            GeePSError: a captured variable is also written by another op
                of the step (its update could not be placed in order), or
                read after its update (a second pass through a model
                after an optimizer updated it in the same step, as a GAN's
                generator step through the discriminator): the read would
                see the value before the update.
        """
        written = _tf_hooks.ops_writing(self.graph, self.handles, self.start)
        late = _tf_hooks.ops_using_after(self.graph, self.offered_at)
        if late:
            names = ", ".join(sorted(
                variable_name(v) for v in self.variables.values()
                if id(v.handle) in late))
            raise GeePSError(
                f"the train step reads {names} after the optimizer updated "
                f"them (a second pass through a model in the same step, as "
                f"in a GAN); a captured update is not in the variables "
                f"within the step, so that read would see the old values: "
                f"create the strategy with capture_updates=False")
        captured = {}
        for index, layer in enumerate(layers):
            kept = [self.updates.get(id(v)) for v in layer.variables]
            for variable, updates in zip(layer.variables, kept):
                if updates and id(variable.handle) in written:
                    raise GeePSError(
                        f"{variable.name}: the optimizer's update was "
                        f"captured, but another op of the step also writes "
                        f"the variable; create the strategy with "
                        f"capture_updates=False")
            if all(kept):
                combined = [_combine(updates) for updates in kept]
                captured[index] = tuple(list(part) for part in zip(*combined))
                continue
            for variable, updates in zip(layer.variables, kept):
                if updates:
                    value, sign = _combine(updates)
                    if sign > 0:
                        variable.assign_add(value)
                    else:
                        variable.assign_sub(value)
        return captured


def variable_name(variable):
    """A variable's Keras path if it has one, else its TF name."""
    return getattr(variable, "path", None) or variable.name.split(":")[0]


def _combine(updates):
    """One (tensor, sign) for a variable's list of captured updates."""
    if len(updates) == 1:
        return updates[0]
    return tf.add_n([value if sign > 0 else -value
                     for value, sign in updates]), 1.0
