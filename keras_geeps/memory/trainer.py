"""Layer-wise training under a device-memory budget (GeePS' memory manager).

`model.fit` compiles a whole step into one graph: every layer's parameters
are read at the start and held until the gradient is done, so nothing can
leave the device mid-step. `LayerwiseTrainer` runs the step layer by layer
instead, each layer's forward and backward a compiled `tf.function`, so that
between two uses a staged layer's parameters really leave the device:

- A *resident* layer keeps its Keras variables (and its optimizer state) on
  the device all the time, as under `model.fit`.
- A *staged* layer's variables hold no storage between uses (0 elements;
  see `swapping.empty_variable`); its values live in a host store (pinned
  on a GPU). A background prefetcher swaps them in (`ops.swap_in`, straight
  into the variables) ahead of the layer's forward use and again ahead of
  its backward use (with its optimizer state), within the access pool's
  bytes; after the layer's update a background writer swaps parameters and
  state out (`ops.swap_out`) and empties the variables.
- An *offloaded* activation (a layer's input) is swapped out after the
  layer's forward use and prefetched back for its backward use.

The backward of a layer is computed from what is on the device then: a
Dense layer from its saved input and output and its parameters read again
("explicit"); another layer from its forward pass's tape when nothing of it
left the device ("taped"), else by running its forward again from its saved
input ("recompute", with its non-trainable state such as BatchNorm
statistics and dropout seeds restored first, so it computes the same
thing). Each layer's update is applied as soon as its gradient is known,
by its own copy of the optimizer (GeePS keeps optimizer state as each
layer's local data); with a `ParameterSync` it is then pushed to the shards
and clocked, layer by layer, and each staged layer is pulled from the
shards straight into the host store.

Every byte the trainer holds on the device is counted in a `DeviceLedger`
(resident tables, pool, activations); with `audit=True` every change is
also measured (the variables' real storage, the tensors held) and compared.
"""

import contextlib
import functools
import time
import warnings
import weakref

import numpy as np
import tensorflow as tf

from keras_geeps import ops
from keras_geeps.checks import check_count, check_device
from keras_geeps.errors import GeePSError
from keras_geeps.memory import swapping
from keras_geeps.memory.planner import check_budget
from keras_geeps.memory.planner import plan as make_plan
from keras_geeps.memory.recorder import (chain_layers, explicit_backward,
                                         record_model)
from keras_geeps.memory.swapping import (AccessPool, DeviceLedger, HostStore,
                                         Worker, tensor_bytes)


def _tf_variable(variable):
    """The tf.Variable behind a keras.Variable (TensorFlow backend)."""
    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(f"{variable!r} is no TensorFlow-backed variable")


def _global_seed_state():
    """The tf.Variable of Keras' global `SeedGenerator` (the one random ops
    without a `seed`, e.g. `keras.random.dropout(x, 0.5)`, draw from)."""
    from keras.src.random.seed_generator import \
        global_seed_generator  # noqa: PLC0415
    return _tf_variable(global_seed_generator().state)


# Model methods that read or write the weights: they materialize first.
_WEIGHT_READERS = ("get_weights", "save_weights", "save", "set_weights",
                   "load_weights")
# A staged layer's own: it materializes first too. Keras' saving code
# (`keras.saving.save_model`, a `.keras` or `.weights.h5` file however it
# is written or read) goes through the last two.
_LAYER_WEIGHT_READERS = ("get_weights", "set_weights", "save_own_variables",
                         "load_own_variables")
# A trainer of its own (no strategy) materializes for these too; under a
# strategy they ask for strategy.sync() first (the shards' latest values).
_LOCAL_READERS = ("predict", "evaluate", "predict_on_batch", "test_on_batch")


def _non_trainable_by_layer(layers):
    """Per layer, its non-trainable tf.Variables not listed for an
    earlier layer (a shared variable counts once)."""
    seen, per_layer = set(), []
    for layer in layers:
        mine = []
        for v in layer.non_trainable_variables:
            tv = _tf_variable(v)
            if id(tv) not in seen:
                seen.add(id(tv))
                mine.append(tv)
        per_layer.append(mine)
    return per_layer


def _non_trainable(layers):
    """The layers' non-trainable tf.Variables, each once."""
    return [v for mine in _non_trainable_by_layer(layers) for v in mine]


def _fixed_bytes(layers):
    """Per layer, bytes of its non-trainable variables (counted once)."""
    return [sum(tensor_bytes(v) for v in mine)
            for mine in _non_trainable_by_layer(layers)]


def _probe_state_bytes(optimizer, layers):
    """Per layer, the bytes its optimizer state will take, measured on
    host stand-ins (so nothing is allocated on the device)."""
    import keras  # noqa: PLC0415
    sizes = []
    with tf.device("/cpu:0"):
        for layer in layers:
            if not layer.trainable_variables:
                sizes.append(0)
                continue
            probe = _clone_optimizer(optimizer)
            before = {id(v) for v in probe.variables}
            # not trainable: inside a GeePSStrategy's scope a trainable
            # variable would become a parameter table
            stand_ins = [keras.Variable(tf.zeros(v.shape, v.dtype),
                                        dtype=v.dtype, trainable=False)
                         for v in layer.trainable_variables]
            probe.build(stand_ins)
            sizes.append(sum(tensor_bytes(_tf_variable(v))
                             for v in probe.variables
                             if id(v) not in before))
    return sizes


def _call(method, *args):
    return method(*args)


def _written_variables(concrete, variables):
    """Those of `variables` that the traced function `concrete` may write:
    every one its graph uses other than by reading it (an assignment, or
    a call into a function that may assign)."""
    inner = {id(outer): placeholder
             for outer, placeholder in concrete.graph.captures}
    written = []
    for v in variables:
        placeholder = inner.get(id(v.handle))
        if placeholder is not None and any(
                op.type != "ReadVariableOp"
                for op in placeholder.consumers()):
            written.append(v)
    return written


def _config_of(optimizer):
    """`optimizer.get_config()`, but for its learning rate: a schedule
    need not be serializable, as `model.fit` needs none (the copies share
    the schedule itself, `_clone_optimizer`)."""
    import keras  # noqa: PLC0415
    rate = getattr(optimizer, "_learning_rate", None)
    if not isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return optimizer.get_config()
    optimizer._learning_rate = 0.001
    try:
        return optimizer.get_config()
    finally:
        optimizer._learning_rate = rate


def _warn_of_regularizers(layers):
    """Warns that the layers' regularizers (kernel, bias, activity...) are
    not added to the loss, which `model.fit` would add."""
    named = [f"{layer.name}.{attr}" for layer in layers
             for attr, value in vars(layer).items()
             if attr.endswith("regularizer") and value is not None]
    if named:
        warnings.warn(
            f"the layer-wise trainer does not add regularisation losses to "
            f"the loss (model.fit would): {', '.join(named[:4])}"
            f"{' and more' if len(named) > 4 else ''} are ignored",
            stacklevel=3)


def _clone_optimizer(optimizer):
    config = _config_of(optimizer)
    if config.get("global_clipnorm"):
        raise ValueError("global_clipnorm spans every layer; the layer-wise "
                         "trainer updates each layer on its own: use clipnorm")
    if type(optimizer).__name__ == "LossScaleOptimizer":
        raise ValueError("LossScaleOptimizer is not supported by the "
                         "layer-wise trainer")
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is not None:  # (a custom schedule need not round-trip)
        config = dict(config, learning_rate=0.001)
    clone = type(optimizer).from_config(config)
    if rate is not None:
        # The given optimizer's rate variable, or its schedule (called with
        # each copy's step count, which follows the given one's): setting
        # `optimizer.learning_rate` between steps reaches every copy.
        clone._learning_rate = rate
    # `exclude_from_weight_decay()` is no part of the config. What it set
    # names variables (by their key, the same for every copy) or a pattern
    # of their names: each copy excludes the same ones.
    for attr in _WEIGHT_DECAY_EXCLUSIONS:
        if hasattr(optimizer, attr):
            value = getattr(optimizer, attr)
            setattr(clone, attr, set(value) if isinstance(value, set)
                    else value)
    clone._exclude_from_weight_decay_cache = {}
    return clone


# Set by `optimizer.exclude_from_weight_decay()`.
_WEIGHT_DECAY_EXCLUSIONS = ("_exclude_from_weight_decay",
                            "_exclude_from_weight_decay_pattern")


def _step_count(optimizer):
    """The optimizer's step counter, a variable (`iterations` is a tensor
    computed from it under gradient accumulation)."""
    count = getattr(optimizer, "_iterations", None)
    return optimizer.iterations if count is None else count


def _slot_prefixes(variables):
    """The name prefixes of the slots Keras makes for `variables`
    (`add_variable_from_reference`: `{path with _ for /}_{kind}`)."""
    return tuple(v.path.replace("/", "_") + "_" for v in variables
                 if hasattr(v, "path"))


def _split_state(state, variables):
    """({name: variable} of the slots named after one of `variables`,
    [the other state variables, in order: the optimizer's own, such as
    Nadam's momentum product, or slots Keras names otherwise]).

    Raises:
        ValueError: two slots of one name.
    """
    prefixes = _slot_prefixes(variables)
    named, others = {}, []
    for v in state:
        if prefixes and v.name.startswith(prefixes):
            if v.name in named:
                raise ValueError(
                    f"the optimizer holds two state variables named "
                    f"{v.name!r}: the layer-wise trainer cannot tell which "
                    f"layer's each is")
            named[v.name] = v
        else:
            others.append(v)
    return named, others


def _own_state(optimizer):
    """The optimizer's state variables but its step count and rate."""
    own = {id(_step_count(optimizer))}
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is not None:
        own.add(id(rate))
    return [v for v in optimizer.variables if id(v) not in own]


def _shapes(variables):
    return [tuple(v.shape) for v in variables]


def _state_pairs(optimizer, units):
    """[(a layer copy's state variable, the optimizer's)] for every state
    variable of the units' copies: slots by name (Keras names them after
    their variable's path, the same in every copy), the rest (state of
    the optimizer's own, e.g. Nadam's momentum product) in order, where
    every copy has as many of the same shapes as the optimizer.

    Raises:
        ValueError: naming what has no counterpart (the optimizer was
            built for other variables, or keeps state the trainer cannot
            tell apart by layer, e.g. Adafactor's factored moments).
    """
    named, others = _split_state(_own_state(optimizer),
                                 optimizer._trainable_variables)
    pairs = []
    for unit in units:
        if unit.optimizer is None:
            continue
        mine, rest = _split_state(unit.state, unit.params)
        for name, v in mine.items():
            source = named.get(name)
            if source is None or tuple(source.shape) != tuple(v.shape):
                raise ValueError(
                    f"the optimizer has state (built for "
                    f"{len(optimizer._trainable_variables)} variables) but "
                    f"no {name!r} of shape {tuple(v.shape)} for layer "
                    f"{unit.name!r}: it was used for other variables than "
                    f"this model's, and the layer's copy would start "
                    f"without it. Give it an optimizer built for this "
                    f"model, or a fresh one "
                    f"(type(opt).from_config(opt.get_config()))")
            pairs.append((v, source))
        if _shapes(rest) != _shapes(others):
            raise ValueError(
                f"{type(optimizer).__name__} keeps state the layer-wise "
                f"trainer cannot tell apart by layer ({len(others)} "
                f"variables not named after a model variable, of shapes "
                f"{_shapes(others)[:4]}; layer {unit.name!r}'s copy has "
                f"{_shapes(rest)[:4]})")
        pairs.extend(zip(rest, others))
    return pairs


def _has_state(optimizer):
    return optimizer.built or \
        int(tf.convert_to_tensor(_step_count(optimizer)).numpy()) > 0


def _carry_state_in(optimizer, units):
    """Starts each layer's optimizer copy from `optimizer`'s state: its step
    count and the layer's slots (moments, accumulators, moving averages;
    `_state_pairs`). Refuses a state it cannot place (a copy would start
    from none of it, silently)."""
    if not _has_state(optimizer):
        return
    pairs = _state_pairs(optimizer, units) if optimizer.built else []
    for unit in units:
        if unit.optimizer is not None:
            _step_count(unit.optimizer).assign(_step_count(optimizer))
    for copy, source in pairs:
        copy.assign(source)


def _build_on_host(optimizer, variables):
    """Builds `optimizer` for `variables` with its state in host memory
    (Keras places each slot beside its variable, on the device, where the
    trainer's budget has no room for a second state), in the scope of the
    distribution strategy it was made in."""
    def on_host(next_creator, **kwargs):
        with tf.device("/cpu:0"):  # (inside Keras' colocation: wins)
            return next_creator(**kwargs)

    strategy = getattr(optimizer, "_distribution_strategy", None)
    scope = strategy.scope() if strategy is not None and \
        strategy is not tf.distribute.get_strategy() else \
        contextlib.nullcontext()
    with scope, tf.variable_creator_scope(on_host):
        optimizer.build(variables)


def _state_placeable(units):
    """Whether an unbuilt optimizer, once built for the model, could take
    the copies' state (`_state_pairs`): every copy's state not named
    after its variables has the same shapes."""
    rests = [_shapes(_split_state(u.state, u.params)[1])
             for u in units if u.optimizer is not None]
    return all(rest == rests[0] for rest in rests)


class _Unit:
    """One layer at run time: its variables, optimizer and compiled steps."""

    def __init__(self, index, layer, optimizer, device):
        self.index = index
        self.name = layer.name
        self.record = None     # its UnitRecord, set by the trainer
        self.layer = layer
        self.device = device
        self.params = list(layer.trainable_variables)
        self.tf_params = [_tf_variable(v) for v in self.params]
        self.optimizer = optimizer
        self.state = []
        if optimizer is not None:
            before = {id(v) for v in optimizer.variables}
            with tf.device(device):
                optimizer.build(self.params)
            self.state = [v for v in optimizer.variables
                          if id(v) not in before]
        self.tf_state = [_tf_variable(v) for v in self.state]
        self.tf_all = self.tf_params + self.tf_state
        self.param_bytes = sum(tensor_bytes(v) for v in self.tf_params)
        self.table_bytes = sum(tensor_bytes(v) for v in self.tf_all)
        self.nt = [_tf_variable(v) for v in layer.non_trainable_variables]
        self._written = None   # those of `nt` the forward writes
        self.explicit, self.needs_output = explicit_backward(layer)
        self.want_dx = False   # set by the trainer
        self.tables = []       # ParameterSync table indices
        self.table_positions = {}  # table index -> positions in tf_params

        def fn(method):
            # TensorFlow's retracing warning counts traces per code object
            # (every layer's closure would share one): a partial has none,
            # so it counts each layer's function on its own.
            return tf.function(functools.partial(_call, method),
                               reduce_retracing=True)

        self.forward = fn(self._forward)
        self.fill_params = fn(self._fill_params)
        self.fill_all = fn(self._fill_all)
        self.empty_params = fn(self._empty_params)
        self.empty_all = fn(self._empty_all)
        self.stash = fn(self._stash)
        self.apply = fn(self._apply)
        self.backward_explicit = fn(self._backward_explicit)
        self.backward_apply = fn(self._backward_apply)

    @property
    def has_params(self):
        return bool(self.params)

    # ---------------------------------------------------------- compute
    def _forward(self, x, mask=None):
        """The layer's forward; returns (output, the output's Keras mask or
        None). `mask`, the input's Keras mask (e.g. an `Embedding` with
        `mask_zero=True` made it), is attached to the input as the previous
        layer's call would have attached it to its output, so the layer
        takes it and computes its output's mask as in a Keras model."""
        from keras.src import backend  # noqa: PLC0415
        if mask is not None:
            backend.set_keras_mask(x, mask)
        y = self.layer(x, training=True)
        return y, backend.get_keras_mask(y)

    def taped_forward(self, x, mask=None):
        """Runs the forward under a tape watching what the gradient needs;
        returns (tape, output, output mask)."""
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape:
            if self.want_dx:
                tape.watch(x)
            tape.watch(self.tf_params)
            y, y_mask = self.forward(x, mask)
        return tape, y, y_mask

    def tape_gradient(self, tape, x, y, dy):
        """(dx, [the parameters' gradients]): a parameter the output does
        not depend on gets None, which the optimizer skips as Keras' `fit`
        does (a zero would still decay it and move its moments)."""
        sources = ([x] if self.want_dx else []) + self.tf_params
        grads = tape.gradient(y, sources, output_gradients=dy)
        if self.want_dx:
            dx = grads[0] if grads[0] is not None else tf.zeros_like(x)
            return dx, grads[1:]
        return None, grads

    def _backward_explicit(self, x, y, dy):
        """Dense's gradient from its input, output and kernel, computed in
        the layer's compute dtype (as its forward was: a mixed-precision
        policy casts the kernel, a float64 input is cast) and returned in
        each variable's dtype, dx in the input's."""
        import keras  # noqa: PLC0415
        compute = tf.as_dtype(self.layer.compute_dtype)
        x_dtype = x.dtype
        x = tf.cast(x, compute)
        y = tf.cast(y, compute)
        dy = tf.cast(dy, compute)
        act = self.layer.activation
        if act is keras.activations.relu:
            dz = tf.raw_ops.ReluGrad(gradients=dy, features=y)
        elif act is keras.activations.sigmoid:
            dz = tf.raw_ops.SigmoidGrad(y=y, dy=dy)
        elif act is keras.activations.tanh:
            dz = tf.raw_ops.TanhGrad(y=y, dy=dy)
        else:
            dz = dy
        kernel = _tf_variable(self.layer.kernel)
        w = tf.cast(kernel.read_value(), compute)
        x2 = tf.reshape(x, [-1, w.shape[0]])
        dz2 = tf.reshape(dz, [-1, w.shape[1]])
        grads = {id(kernel): tf.matmul(x2, dz2, transpose_a=True)}
        if self.layer.bias is not None:
            grads[id(_tf_variable(self.layer.bias))] = tf.reduce_sum(dz2, 0)
        dx = None
        if self.want_dx:
            dx = tf.reshape(tf.matmul(dz2, w, transpose_b=True), tf.shape(x))
            dx = tf.cast(dx, x_dtype)
        return dx, [tf.cast(grads[id(v)], v.dtype) for v in self.tf_params]

    def _backward_apply(self, x, y, dy):
        """The explicit backward and the optimizer's update, in one call."""
        dx, grads = self._backward_explicit(x, y, dy)
        self.optimizer.apply(grads, self.params)
        return dx

    def _apply(self, grads):
        self.optimizer.apply(grads, self.params)

    def snapshot_state(self, x, mask=None):
        """Copies of the non-trainable variables the forward writes
        (BatchNorm statistics, a dropout's seed; not a frozen layer's
        weights, which it only reads) and of Keras' global seed generator,
        before a forward that will be recomputed."""
        if self._written is None:
            self._written = _written_variables(
                self.forward.get_concrete_function(x, mask), self.nt)
        return ([(v, tf.identity(v.read_value())) for v in self._written],
                _global_seed_state().read_value())

    def restore_state(self, values):
        """Puts back what `snapshot_state` copied; returns the global seed
        generator's state before (to put back after the recompute)."""
        variables, seed = values
        for v, value in variables:
            v.assign(value)
        state = _global_seed_state()
        now = state.read_value()
        state.assign(seed)
        return now

    # ---------------------------------------------------------- staging
    def _fill(self, variables, hosts):
        with tf.device(self.device):
            for v, h in zip(variables, hosts):
                swapping.assign_variable(v, ops.swap_in(h))

    def _fill_params(self, hosts):
        self._fill(self.tf_params, hosts)

    def _fill_all(self, hosts):
        self._fill(self.tf_all, hosts)

    def _empty_params(self):
        self._empty(self.tf_params)

    def _empty_all(self):
        self._empty(self.tf_all)

    def _empty(self, variables):
        with tf.device(self.device):
            for v in variables:
                swapping.empty_variable(v)

    def _stash(self):
        with tf.device(self.device):
            hosts = [ops.swap_out(v.read_value()) for v in self.tf_all]
            with tf.control_dependencies(hosts):
                for v in self.tf_all:
                    swapping.empty_variable(v)
        return hosts


def _batch_mean(loss):
    """`loss` made to return a scalar: its per-sample values averaged (a
    scalar is its own mean), as `model.compile` reduces a loss. Given the
    model output's Keras mask, the loss is weighted by it as Keras weighs
    it. A callable that is no `keras.losses.Loss` (or a loss's name) is
    wrapped in Keras' `LossFunctionWrapper` first, as `model.compile`
    wraps it."""
    import keras  # noqa: PLC0415
    from keras.src import backend  # noqa: PLC0415
    from keras.src.losses.losses import \
        LossFunctionWrapper  # noqa: PLC0415
    if not callable(loss):
        raise TypeError(f"loss must be a Keras loss, its name or a callable "
                        f"loss(y_true, y_pred), got {type(loss).__name__}")

    # (always: the wrapper computes in float32 under mixed precision and
    # casts y_true to y_pred's dtype, as compile's loss does)
    wrapped = loss if isinstance(loss, keras.losses.Loss) else \
        LossFunctionWrapper(loss)

    def mean_loss(y_true, y_pred, mask=None):
        if mask is not None:
            backend.set_keras_mask(y_pred, mask)
        return tf.reduce_mean(wrapped(y_true, y_pred))
    return mean_loss


class LayerwiseTrainer:
    """Trains a Keras model layer by layer within a device-memory budget.

    Records the step once (`record_model`), plans it (`plan`) and then runs
    every step as the plan says: resident layers stay on the device, staged
    layers are prefetched through a double-buffered access pool by a
    background thread and written back by another, offloaded activations
    wait in host memory between the passes. The weights it reaches do not
    depend on the budget: a budget changes where data waits, not what is
    computed.

    The model must be a chain of layers (`keras.Sequential`, or a
    functional model checked to behave as one; a subclassed model is
    refused). Keras masks are carried from layer to layer (and a masked
    output's mask weights the loss), as in the model. Layer regularisation
    losses are not added to the loss; the optimizer is copied per layer,
    from its config and its `exclude_from_weight_decay` settings (so
    `global_clipnorm` and `LossScaleOptimizer` are refused), sharing its
    learning rate (variable or schedule: setting `optimizer.learning_rate`
    between steps reaches every copy). Each copy
    starts from the optimizer's state (its step count and the layer's
    slots, where it has taken steps or is built, as under `model.fit`; one
    built for other variables, or whose state cannot be told apart by
    layer, as Adafactor's, is refused), and `close()` gives the optimizer
    the state the copies reached, building it in host memory if need be: a
    later trainer (or `model.fit`) with the same optimizer goes on from
    there.

    Between steps the staged layers' variables hold no storage: call
    `materialize()` (or `GeePSStrategy.sync()`) before evaluating, predicting
    or calling the model; the next `train_step` releases them again.
    `model.get_weights()`, `model.save_weights()` and `model.save()`
    materialize by themselves, so they never return or write empty weights.

    Example:

    ```python
    trainer = LayerwiseTrainer(model, keras.optimizers.SGD(0.1),
                               keras.losses.SparseCategoricalCrossentropy(),
                               batch_size=64,
                               device_memory_budget=256 << 20)
    print(trainer.plan)
    for x, y in dataset:
        loss = trainer.train_step(x, y)
    trainer.materialize()
    model.evaluate(...)
    ```

    Args:
        model: a built Keras model (chain of layers).
        optimizer: a Keras optimizer (copied per layer, with its state),
            or its name ("sgd", "adam"), as `model.compile` takes it.
        loss: a Keras loss, its name ("mse"), or a callable
            `loss(y_true, y_pred)`; per-sample losses are averaged over
            the batch, as `model.compile` reduces them.
        batch_size: the training batch size (for the activation sizes).
        device_memory_budget: bytes the trainer may hold on the device
            (tables, non-trainable variables such as frozen layers and
            BatchNorm statistics, pool, saved activations). Defaults to
            None: no limit.
        offload_activations: None, "auto" or a list of layer names (see
            `plan`). Defaults to None.
        sync: a `ParameterSync` to pull from and push to the shards.
            Defaults to None (local training).
        device: where the step runs: one of this process's devices (a
            name of none is refused with a `ValueError`: TensorFlow would
            run the step elsewhere). Defaults to None: the first GPU if one
            is visible, else the CPU.
        audit: measure the real device bytes after every change and compare
            with the ledger (slower; for tests). Defaults to False.
    """

    def __init__(self, model, optimizer, loss, batch_size,
                 device_memory_budget=None, offload_activations=None,
                 sync=None, device=None, audit=False):
        import keras  # noqa: PLC0415
        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a Keras model, got "
                            f"{type(model).__name__}")
        check_count("batch_size", batch_size, 1)
        if device_memory_budget is not None:
            check_budget(device_memory_budget, "device_memory_budget")
        if optimizer is None:
            raise TypeError("optimizer must be a Keras optimizer or its name "
                            "(\"sgd\", \"adam\"), not None")
        if loss is None:
            raise TypeError("loss must be a Keras loss, its name (\"mse\") "
                            "or a callable loss(y_true, y_pred), not None")
        if sync is not None:
            from keras_geeps.keras.sync import ParameterSync  # noqa: PLC0415
            if not isinstance(sync, ParameterSync):
                raise TypeError(f"sync must be a keras_geeps ParameterSync "
                                f"(strategy.layerwise_trainer makes one), "
                                f"not {type(sync).__name__}")
        holder = getattr(model, "_geeps_layerwise_trainer", None)
        holder = holder() if holder is not None else None
        if holder is not None and not holder._closed:
            raise GeePSError(
                "another LayerwiseTrainer holds this model's staged layers "
                "(their variables are empty between its steps): close() it "
                "before making a new one")
        given = optimizer
        optimizer = keras.optimizers.get(optimizer)
        # The user's optimizer gets the copies' state back at close();
        # one made here from a name or config has no reader.
        self._optimizer = optimizer if optimizer is given else None
        # Each copy's apply() divides its gradients by the factor: the loss
        # is multiplied by it before the backward (`optimizer.scale_loss`).
        self._loss_scale = getattr(optimizer, "loss_scale_factor", None)
        loss = _batch_mean(keras.losses.get(loss) if isinstance(loss, str)
                           else loss)
        if device is None:
            device = ("/gpu:0" if tf.config.list_physical_devices("GPU")
                      else "/cpu:0")
        else:
            check_device(device)
        self.device = device
        self.model = model
        self.sync = sync
        self.layers = chain_layers(model)
        self._verify_chain()
        _warn_of_regularizers(self.layers)
        self._input_dtype = tf.as_dtype(model.inputs[0].dtype)
        fixed = _fixed_bytes(self.layers)
        self.store = HostStore()
        self.units = []
        early = None
        if device_memory_budget is not None:
            # Plan before any optimizer slot exists: one that cannot fit
            # fails here, not after the whole state sat on the device.
            probed = _probe_state_bytes(optimizer, self.layers)
            early = make_plan(record_model(
                model, batch_size, layers=self.layers, fixed_bytes=fixed,
                state_bytes=probed), device_memory_budget,
                offload_activations)
        if sync is not None and not sync.built:
            sync.build()  # (it reads the weights: before any is stashed)
        try:
            self._build_units(optimizer, device,
                              None if early is None else early.staged)
            if early is None:
                self.sequence = record_model(
                    model, batch_size, layers=self.layers,
                    fixed_bytes=fixed, state_bytes=[
                        u.table_bytes - u.param_bytes for u in self.units])
                self.plan = make_plan(self.sequence, None,
                                      offload_activations)
            else:
                self._check_probe(probed)
                self.sequence, self.plan = early.sequence, early
            self._set_up(loss, sync, audit)
        except BaseException:
            self._give_stashed_back()
            raise

    def _build_units(self, optimizer, device, staged):
        """Each layer's unit, its optimizer copy built on the device and
        started from `optimizer`'s state; a layer the plan stages (`staged`,
        by index) is stashed at once, before the next one's state is built:
        the device never holds more state than the plan counts."""
        for i, layer in enumerate(self.layers):
            unit = _Unit(i, layer, _clone_optimizer(optimizer)
                         if layer.trainable_variables else None, device)
            self.units.append(unit)
            _carry_state_in(optimizer, [unit])
            if staged is not None and staged[i]:
                self.store.put(i, unit.stash())

    def _check_probe(self, probed):
        built = [u.table_bytes - u.param_bytes for u in self.units]
        if built != probed:
            raise GeePSError(
                f"the optimizer's state took {built} bytes per layer, not "
                f"the {probed} measured on host stand-ins that the memory "
                f"plan was made with")

    def _give_stashed_back(self):
        """A constructor that fails gives the layers it stashed their
        parameters back: the model is left as it was given."""
        for unit in self.units:
            if unit.index in self.store:
                hosts = self.store.get(unit.index)
                unit.fill_params(hosts[:len(unit.tf_params)])

    def _set_up(self, loss, sync, audit):
        for unit, record in zip(self.units, self.sequence.units):
            unit.record = record
        first = [u.index for u in self.units if u.has_params]
        self._first_needed = first[0] if first else len(self.units)
        for unit in self.units:
            unit.want_dx = unit.index > self._first_needed
        self._loss = tf.function(loss, reduce_retracing=True)
        self.ledger = DeviceLedger(self._measure if audit else None)
        self.pool = AccessPool(self.plan.pool_bytes)
        self._held = {}   # activation index -> device tensor we hold
        self._act_category = {}
        self._host_acts = {}
        self.last_prefetches = []  # items the prefetcher brought in, last step
        self._materialized = False
        self._broken = False
        self._closed = False
        self.steps = 0
        self.step_seconds = 0.0
        self.prefetch_wait_seconds = 0.0
        self.swapped_in_bytes = 0
        self.swapped_out_bytes = 0
        if sync is not None:
            self._attach_sync(sync)
        self._fixed = _non_trainable(self.layers)
        self._audit_all = [v for u in self.units for v in u.tf_all] + \
            self._fixed
        with self._locked():  # (the staged ones are in the store)
            resident = self.sequence.fixed_bytes + sum(
                u.table_bytes for u in self.units
                if not self.plan.staged[u.index])
            self.ledger.change("resident", resident, "setup")
        self.prefetcher = Worker("geeps-prefetch", self.device)
        self.writer = Worker("geeps-writeback", self.device)
        self._guard_model()
        object.__setattr__(self.model, "_geeps_layerwise_trainer",
                           weakref.ref(self))

    # ------------------------------------------------------------ set-up
    def _verify_chain(self):
        import keras  # noqa: PLC0415
        if isinstance(self.model, keras.Sequential):
            return
        spec = self.model.inputs[0]
        shape = [2] + [d or 1 for d in spec.shape[1:]]
        if np.dtype(spec.dtype).kind == "f":
            x = tf.random.stateless_uniform(shape, seed=[7, 11],
                                            dtype=spec.dtype)
        else:
            x = tf.zeros(shape, spec.dtype)
        message = ("the model is not a chain of its layers (applying "
                   "model.layers one after another does not give its "
                   "output): the layer-wise trainer cannot run it")
        expected = self.model(x, training=False)
        out = x
        try:
            for layer in self.layers:
                out = layer(out, training=False)
        except Exception as exc:  # e.g. a merge layer given one tensor
            raise ValueError(message) from exc
        if not (tuple(np.shape(expected)) == tuple(np.shape(out))
                and np.allclose(np.asarray(expected), np.asarray(out),
                                rtol=1e-5, atol=1e-6)):
            raise ValueError(message)

    def _attach_sync(self, sync):
        owner = {}
        for unit in self.units:
            for pos, v in enumerate(unit.tf_params):
                owner[id(v)] = (unit, pos)
        for t, layer in enumerate(sync.tables):
            units = {id(owner.get(id(v), (None,))[0]) for v in
                     layer.variables}
            hits = [owner.get(id(v)) for v in layer.variables]
            if None in hits or len(units) != 1:
                raise GeePSError(
                    f"parameter table {layer.name!r} is not one layer of the "
                    "model given to the layer-wise trainer: create only this "
                    "model's variables in the strategy's scope")
            unit = hits[0][0]
            unit.tables.append(t)
            unit.table_positions[t] = [pos for _, pos in hits]
        for unit in self.units:
            covered = sum(len(p) for p in unit.table_positions.values())
            if covered != len(unit.tf_params):
                raise GeePSError(
                    f"layer {unit.name!r} has variables in no parameter "
                    f"table: create the model inside strategy.scope()")

    def _locked(self):
        """The ledger's lock while auditing (so a measurement never sees a
        copy half done), else nothing."""
        if self.ledger.audit is not None:
            return self.ledger.lock
        return contextlib.nullcontext()

    def _measure(self):
        total = int(swapping.stored_bytes(self._audit_all))
        return total + sum(tensor_bytes(t) for t in self._held.values())

    def measure_device_bytes(self):
        """Measured device bytes now: {"resident": tables the plan keeps on
        the device and the non-trainable variables, "staged": storage the
        staged layers' variables hold}."""
        resident = [v for u in self.units if not self.plan.staged[u.index]
                    for v in u.tf_all] + self._fixed
        staged = [v for u in self.units if self.plan.staged[u.index]
                  for v in u.tf_all]
        return {"resident": int(swapping.stored_bytes(resident)),
                "staged": int(swapping.stored_bytes(staged))}

    # ------------------------------------------------------ activations
    def _hold(self, index, tensor, category):
        with self._locked():
            self._held[index] = tensor
            self._act_category[index] = category
            self.ledger.change(category, tensor_bytes(tensor),
                               f"hold act {index}")

    def _drop(self, index):
        tensor = self._held.get(index)
        if tensor is None:
            return
        category = self._act_category.pop(index)
        with self._locked():
            del self._held[index]
            self.ledger.change(category, -tensor_bytes(tensor),
                               f"drop act {index}")
        if category == "pool":
            self.pool.release(tensor_bytes(tensor))

    def _offload(self, index):
        """Writer job: swaps activation `index` out and frees the device copy.

        The job finds the tensor by its index rather than being given it: a
        job holding it would keep the device copy alive after `_drop`, until
        the step ends (the jobs are referenced until then).
        """
        tensor = self._held[index]
        host = ops.swap_out(tensor)
        self._host_acts[index] = host
        self.swapped_out_bytes += tensor_bytes(tensor)
        del tensor  # `_held` holds the last reference: `_drop` frees it
        self._drop(index)

    # ------------------------------------------------------ staging jobs
    def _bring_forward(self, unit):
        """Prefetcher job: staged parameters into the layer's variables."""
        if self.sync is not None:
            self._pull_staged(unit)
        nbytes = unit.param_bytes
        self.pool.reserve(nbytes, f"forward {unit.name}")
        self.last_prefetches.append(f"table:{unit.name}")
        hosts = self.store.get(unit.index)[:len(unit.tf_params)]
        with self._locked():
            unit.fill_params(hosts)
            self.ledger.change("pool", nbytes, f"fill {unit.name}")
        self.swapped_in_bytes += nbytes

    def _release_forward(self, unit):
        """Writer job: empties a staged layer's variables after its forward
        use and gives its bytes back to the pool."""
        with self._locked():
            unit.empty_params()
            self.ledger.change("pool", -unit.param_bytes,
                               f"empty {unit.name}")
        self.pool.release(unit.param_bytes)

    def _bring_backward(self, unit, after):
        """Prefetcher job: staged parameters and state, offloaded input
        (after the jobs `after`: the forward release, the offload)."""
        staged = self.plan.staged[unit.index]
        offloaded = self.plan.offloaded[unit.index]
        for job in after:
            job.wait()
        nbytes = (unit.table_bytes if staged else 0) + \
            (unit.record.input_bytes if offloaded else 0)
        self.pool.reserve(nbytes, f"backward {unit.name}")
        if offloaded:  # in access order: the input, then the table
            self.last_prefetches.append(f"act:{unit.name}")
            host = self._host_acts.pop(unit.index)
            act = ops.swap_in(host)
            self._hold(unit.index, act, "pool")
            self.swapped_in_bytes += tensor_bytes(act)
            extra = unit.record.input_bytes - tensor_bytes(act)
            if extra < 0:
                raise GeePSError(
                    f"layer {unit.name!r}: its input has {tensor_bytes(act):,}"
                    f" bytes, more than the {unit.record.input_bytes:,} the "
                    "memory plan reserved for it")
            if extra:  # a last, smaller batch
                self.pool.release(extra)
        if staged:
            self.last_prefetches.append(f"table:{unit.name}")
            with self._locked():
                unit.fill_all(self.store.get(unit.index))
                self.ledger.change("pool", unit.table_bytes,
                                   f"fill all {unit.name}")
            self.swapped_in_bytes += unit.table_bytes

    def _write_back(self, unit, push=True):
        """Writer job: parameters and state out to the host store (and,
        with `push`, the update to the shards)."""
        with self._locked():
            hosts = unit.stash()
            self.ledger.change("pool", -unit.table_bytes,
                               f"stash {unit.name}")
        self.pool.release(unit.table_bytes)
        self.swapped_out_bytes += unit.table_bytes
        self.store.put(unit.index, hosts)
        if self.sync is not None and push:
            self._push_staged(unit, hosts)

    def _wait(self, job):
        started = time.perf_counter()
        result = job.wait()
        self.prefetch_wait_seconds += time.perf_counter() - started
        return result

    # ------------------------------------------------------------ the step
    def train_step(self, x, y):
        """Runs one training step; returns the loss (a scalar tensor).

        Args:
            x: a batch of inputs.
            y: its targets.
        """
        loss = self._run(x, y, None)
        self.steps += 1
        return loss

    def compute_gradients(self, x, y):
        """Runs a step's forward and backward under the plan without
        updating anything (nothing is pushed); returns (loss, gradients),
        gradients a list, per layer, of that layer's trainable-variable
        gradients (empty for a layer without parameters).

        Args:
            x: a batch of inputs.
            y: its targets.
        """
        gradients = {}
        loss = self._run(x, y, gradients)
        return loss, [gradients.get(u.index, []) for u in self.units]

    def _run(self, x, y, gradients):
        if self._closed:
            raise GeePSError("the trainer is closed")
        if self._broken:
            raise GeePSError("an earlier step failed midway; the trainer's "
                             "state is inconsistent: create a new one")
        self._check_batch(x, y)
        if self._materialized:
            self.release()
        started = time.perf_counter()
        try:
            with tf.device(self.device):
                loss = self._step(x, y, gradients)
        except BaseException:
            self._broken = True
            self.pool.close()
            raise
        self.step_seconds += time.perf_counter() - started
        return loss

    def _check_batch(self, x, y):
        """Refuses a batch the memory plan was not made for (its sizes come
        from the model's input shape at `batch_size`) before anything runs.
        """
        shape, targets = tuple(np.shape(x)), tuple(np.shape(y))
        expected = tuple(self.model.inputs[0].shape[1:])
        if not shape or shape[1:] != expected:
            raise ValueError(f"x has shape {shape}; the model takes inputs "
                             f"of shape (batch,) + {expected}")
        batch = shape[0]
        if batch == 0:
            raise ValueError("x is an empty batch")
        if batch > self.sequence.batch_size:
            raise ValueError(f"a batch of {batch} is larger than the "
                             f"batch_size={self.sequence.batch_size} the "
                             "memory plan was made for")
        if not targets or targets[0] != batch:
            raise ValueError(f"y has shape {targets}: it must hold one "
                             f"target per sample of x ({batch})")

    def _step(self, x, y, gradients=None):
        """One step; with a dict `gradients`, the gradients are put there
        (by layer index) instead of applied."""
        plan = self.plan
        units = self.units
        count = len(units)
        if self.sync is not None:
            for unit in units:
                if not plan.staged[unit.index]:
                    for t in unit.tables:
                        self.sync.pull(t)
        self.last_prefetches = []
        forward_jobs = {}
        for unit in units:
            if plan.staged[unit.index]:
                forward_jobs[unit.index] = self.prefetcher.submit(
                    functools.partial(self._bring_forward, unit),
                    f"prefetch of {unit.name} (forward)")
        with tf.device(self.device):
            x = tf.cast(x, self._input_dtype)  # the dtype the plan sized
        self._hold(0, x, "activations")
        del x
        tapes, states, offload_jobs, release_jobs = {}, {}, {}, {}
        masks = {0: None}  # index -> the Keras mask on activation index

        # ----- forward, layer by layer
        for unit in units:
            i = unit.index
            if i - 2 in offload_jobs:
                # The plan counts an offloaded activation on the device
                # while the next layer runs (three consecutive ones at
                # most, with that layer's input and output): gone before
                # the layer after next, however far the next offload is.
                offload_jobs[i - 2].wait()
            if i in forward_jobs:
                self._wait(forward_jobs[i])
            xi = self._held[i]
            needed = i >= self._first_needed
            mode = plan.modes[i]
            if needed and mode == "taped":
                tapes[i], yi, masks[i + 1] = unit.taped_forward(xi, masks[i])
            elif needed and mode == "recompute":
                states[i] = unit.snapshot_state(xi, masks[i])
                # the same computation
                _, yi, masks[i + 1] = unit.taped_forward(xi, masks[i])
            else:
                yi, masks[i + 1] = unit.forward(xi, masks[i])
            if not needed or mode != "recompute":
                masks.pop(i)  # only a recompute needs it again
            del xi
            if i in forward_jobs:
                release_jobs[i] = self.writer.submit(
                    functools.partial(self._release_forward, unit),
                    f"release of {unit.name} (forward)")
            self._hold(i + 1, yi, "activations")
            del yi
            if not needed:
                self._drop(i)
            elif plan.offloaded[i]:
                offload_jobs[i] = self.writer.submit(
                    functools.partial(self._offload, i),
                    f"offload of {unit.name}'s input")

        # ----- backward prefetches, in backward order
        backward_jobs = {}
        for unit in reversed(units[self._first_needed:]):
            i = unit.index
            if plan.staged[i] or plan.offloaded[i]:
                after = [job for job in (release_jobs.get(i),
                                         offload_jobs.get(i)) if job]
                backward_jobs[i] = self.prefetcher.submit(
                    functools.partial(self._bring_backward, unit, after),
                    f"prefetch of {unit.name} (backward)")

        # ----- the loss
        out = self._held[count]
        with tf.device(self.device):
            with tf.GradientTape() as tape:
                tape.watch(out)
                loss = self._loss(y, out, masks.pop(count))
                scaled = loss if self._loss_scale is None else \
                    loss * self._loss_scale
            dy = tape.gradient(scaled, out)
        del out, tape

        # ----- backward, layer by layer, each update applied and sent
        for unit in reversed(units[self._first_needed:]):
            i = unit.index
            if i in backward_jobs:
                self._wait(backward_jobs[i])
            xi = self._held[i]
            mode = plan.modes[i]
            grads = None
            if mode == "explicit":
                yi = self._held[i + 1] if unit.needs_output else xi
                if gradients is None and unit.has_params:
                    dx = unit.backward_apply(xi, yi, dy)  # update applied
                else:
                    dx, grads = unit.backward_explicit(xi, yi, dy)
            elif mode == "taped":
                tape = tapes.pop(i)
                dx, grads = unit.tape_gradient(tape, xi, self._held[i + 1],
                                               dy)
                del tape
            else:
                # the forward's non-trainable state and random draws again;
                # the global seed generator then goes on as it would have
                seed_now = unit.restore_state(states.pop(i))
                tape, yi, _ = unit.taped_forward(xi, masks.pop(i))
                dx, grads = unit.tape_gradient(tape, xi, yi, dy)
                del tape
                _global_seed_state().assign(seed_now)
            yi = None
            del xi, dy
            self._drop(i + 1)
            if unit.has_params:
                if gradients is not None:  # (all of them, zeros too)
                    gradients[i] = [tf.zeros_like(p) if g is None else g
                                    for g, p in zip(grads, unit.tf_params)]
                elif grads is not None:
                    unit.apply(grads)
                if plan.staged[i]:
                    self.writer.submit(
                        functools.partial(self._write_back, unit,
                                          gradients is None),
                        f"write-back of {unit.name}")
                elif self.sync is not None and gradients is None:
                    for t in unit.tables:
                        self.sync.push(t)
            del grads
            dy = dx
        del dy
        for index in list(self._held):
            self._drop(index)
        self.writer.drain()
        self.prefetcher.drain()
        return loss

    # ------------------------------------------------- parameter server
    def _pull_staged(self, unit):
        """Brings a staged layer's tables from the shards into the host
        store (no device memory is involved)."""
        hosts = self.store.get(unit.index)
        for t in unit.tables:
            table = self.sync.tables[t]
            layout = table.layout
            positions = unit.table_positions[t]
            with tf.device("/cpu:0"):
                # Pushed since the last pull: with no fresh rows (SSP) the
                # pull re-bases the snapshot on the values given, as they
                # are; a resident layer's variables get `snapshot + update
                # * scale` ("average": the own update as the shards apply
                # it, `ParameterSync._own_view`), and so do the host copies.
                base = table.snapshot if table.snapshot_stale else None
                fresh = self.sync.pull(t, values=[hosts[p]
                                                  for p in positions])
                if fresh is None:
                    if base is None or self.sync.scale == 1.0:
                        continue  # nothing new: the host copies stay
                    fresh = base + self.sync.scale * (table.snapshot - base)
                    table.snapshot = fresh
                pieces = tf.split(fresh, list(layout.sizes))
                for p, piece, shape in zip(positions, pieces, layout.shapes):
                    hosts[p] = tf.reshape(piece, shape)

    def _push_staged(self, unit, hosts):
        """Sends a staged layer's update (host values minus the pulled
        snapshot) and clocks its tables."""
        for t in unit.tables:
            values = [hosts[p] for p in unit.table_positions[t]]
            with tf.device("/cpu:0"):
                self.sync.push(t, values)

    # ------------------------------------------------------------ helpers
    def fit(self, dataset, epochs=1):
        """Runs `train_step` over `(x, y)` batches of `dataset` for `epochs`;
        returns the mean loss of each epoch (over its samples: each batch's
        mean weighted by its size, as Keras' `fit` reports it).

        Args:
            dataset: an iterable of `(x, y)` batches that can be iterated
                once per epoch (a `tf.data.Dataset`, a list; not a
                generator, which is spent after one epoch).
            epochs: how many passes over `dataset`. Defaults to 1.

        Raises:
            ValueError: `epochs` is not an int >= 1, or an epoch found no
                batch in `dataset`.
        """
        check_count("epochs", epochs, 1)
        history = []
        for epoch in range(epochs):
            losses, sizes = [], []
            for x, y in dataset:
                losses.append(float(self.train_step(x, y)))
                sizes.append(len(x))
            if not losses:
                raise ValueError(
                    f"epoch {epoch + 1} of {epochs} found no batch in the "
                    "dataset" + (" (a generator or iterator is spent after "
                                 "one pass: give a tf.data.Dataset or a "
                                 "list)" if epoch else ""))
            # (a short last batch weighs as its samples, as in Keras' fit)
            history.append(float(np.average(losses, weights=sizes)))
        return history

    def materialize(self):
        """Gives every staged layer its variables back (outside the budget),
        so the model can be evaluated, saved or synced. The next
        `train_step` stages them out again.

        All or nothing: if filling a layer fails (e.g. the device is out of
        memory: materialized weights are outside the budget), the layers
        filled so far are emptied again (the host store, untouched, still
        holds their values), the trainer stays as it was (not
        `materialized`) and the error is raised; calling it again retries.
        """
        if self._materialized:
            return
        self.writer.drain()
        filled, counted = [], []
        try:
            for unit in self.units:
                if self.plan.staged[unit.index]:
                    with self._locked():
                        filled.append(unit)
                        unit.fill_all(self.store.get(unit.index))
                        self.ledger.change("materialized", unit.table_bytes,
                                           f"materialize {unit.name}")
                        counted.append(unit)
        except BaseException:
            self._unfill(filled, counted)
            raise
        self._materialized = True

    def _unfill(self, filled, counted):
        """Empties the staged layers a failed `materialize()` filled (their
        values are still in the host store); if even that fails, the
        trainer is marked broken, so the model's weights are not read."""
        try:
            for unit in reversed(filled):
                with self._locked():
                    unit.empty_all()
                    if unit in counted:
                        self.ledger.change("materialized", -unit.table_bytes,
                                           f"unfill {unit.name}")
        except BaseException:
            self._broken = True
            raise

    def _guard_model(self):
        """Makes the model's weight readers and writers (`_WEIGHT_READERS`,
        with no strategy also `_LOCAL_READERS`, and each staged layer's
        `_LAYER_WEIGHT_READERS`) call
        `materialize()` first: between steps a staged layer's variables are
        empty, and reading them would return (or write) empty weights."""
        self._guarded = []
        owners = [self.model] + [u.layer for u in self.units
                                 if self.plan.staged[u.index]]
        for owner in owners:
            names = _LAYER_WEIGHT_READERS if owner is not self.model else \
                _WEIGHT_READERS + (_LOCAL_READERS if self.sync is None
                                   else ())
            for name in names:
                original = getattr(owner, name, None)
                if original is None or name in vars(owner):
                    continue
                object.__setattr__(owner, name,
                                   self._materializing(original))
                self._guarded.append((owner, name))

    def _materializing(self, method):
        @functools.wraps(method)
        def guarded(*args, **kwargs):
            if not self._closed and not self._broken:
                self.materialize()
            elif not self.materialized:
                raise GeePSError(
                    "an earlier step failed midway: the staged layers' "
                    "weights are not in the model's variables")
            return method(*args, **kwargs)
        return guarded

    def _unguard_model(self):
        for owner, name in getattr(self, "_guarded", []):
            if name in vars(owner):
                object.__delattr__(owner, name)
        self._guarded = []

    def release(self):
        """Stages the staged layers out again after `materialize()`."""
        if self._closed:
            raise GeePSError("the trainer is closed: the model keeps its "
                             "weights")
        if not self._materialized:
            return
        for unit in self.units:
            if self.plan.staged[unit.index]:
                with self._locked():
                    self.store.put(unit.index, unit.stash())
                    self.ledger.change("materialized", -unit.table_bytes,
                                       f"release {unit.name}")
        self._materialized = False

    @property
    def materialized(self):
        """True while every layer's variables hold their values."""
        return self._materialized or not any(self.plan.staged)

    def stats(self):
        """The trainer's figures: steps, time, waits, bytes moved, ledger."""
        return {"steps": self.steps, "step_seconds": self.step_seconds,
                "prefetch_wait_seconds": self.prefetch_wait_seconds,
                "pool_wait_seconds": self.pool.wait_seconds,
                "pool_peak_reserved": self.pool.peak,
                "swapped_in_bytes": self.swapped_in_bytes,
                "swapped_out_bytes": self.swapped_out_bytes,
                "host_store_bytes": self.store.nbytes,
                **self.ledger.figures()}

    def close(self):
        """Gives the staged layers their variables back (the model then
        holds all its weights), gives the optimizer the state its per-layer
        copies reached (its step count and slots; it is built for the
        model's variables first, in host memory, if it was not; an
        optimizer given by name is no one's and gets nothing; a state it
        cannot place is a warning) and stops the background threads.

        If giving the weights back fails (e.g. the device is out of memory:
        materialized weights are outside the budget), the error is raised
        and the trainer stays open as it was (`materialize()`): the host
        store keeps the staged layers' values and `close()` can be called
        again.

        After a step that failed midway the staged layers get the values
        last written back to the host store (a layer the failed step had
        not written back yet lacks that step's update), with a warning, and
        the optimizer keeps the state it had; if
        even that fails, reading or writing the model's weights keeps
        raising `GeePSError` rather than giving empty ones.
        """
        if self._closed:
            return
        if not self._broken:
            self.materialize()  # raises with the trainer open, as it was
            self._carry_state_out()  # (a warning where it cannot)
        try:
            if self._broken:
                self._recover_weights()
        finally:
            self._closed = True
            if self.materialized:
                self._unguard_model()
            self.pool.close()
            self.prefetcher.close()
            self.writer.close()
            self._forget_activations()

    def _forget_activations(self):
        """Lets go of the activations a failed step left held (on the
        device and in host memory): a closed trainer, kept as an object,
        keeps none of them."""
        with self._locked():
            for index, tensor in self._held.items():
                self.ledger.change(self._act_category[index],
                                   -tensor_bytes(tensor),
                                   f"forget act {index}")
            self._held.clear()
            self._act_category.clear()
            self._host_acts.clear()

    def _carry_state_out(self):
        """Gives the optimizer the trainer was given the state its
        per-layer copies reached (building it for the model's variables
        first, in host memory, where it was not built): a later trainer,
        `model.fit` or a checkpoint of the optimizer goes on from there.
        Then empties the copies' slots: after close() the trainer holds
        nothing. A state it cannot place (`_state_pairs`), or a failure,
        is a warning: the trainer closes all the same."""
        optimizer = self._optimizer
        units = [u for u in self.units if u.optimizer is not None]
        if optimizer is None or not units:
            return
        try:
            if not optimizer.built:
                if not _state_placeable(units):
                    raise ValueError(
                        f"{type(optimizer).__name__} keeps state the "
                        f"layer-wise trainer cannot tell apart by layer")
                _build_on_host(optimizer, self.model.trainable_variables)
            pairs = _state_pairs(optimizer, units)
            for copy, target in pairs:
                target.assign(copy)
            _step_count(optimizer).assign(_step_count(units[0].optimizer))
        except Exception as exc:  # noqa: BLE001 - a warning: closes anyway
            warnings.warn(f"the layer-wise trainer could not give the "
                          f"optimizer its layers' state ({exc}): the "
                          f"optimizer does not hold it, and a new trainer "
                          f"given it starts from what it holds",
                          RuntimeWarning, stacklevel=3)
        finally:
            for unit in units:
                unit._empty(unit.tf_state)

    def _recover_weights(self):
        """After a failed step: the staged layers' variables from the host
        store, as far as it goes."""
        # A prefetch still running (a pull into a staged layer's host
        # values) finishes before those values are read.
        for worker in (self.prefetcher, self.writer):
            try:
                worker.drain()
            except GeePSError:
                pass  # the failed step raised it already (and is drained)
        try:
            self.materialize()
        except Exception as exc:  # noqa: BLE001 - reported, weights guarded
            # (materialize() emptied what it filled: not materialized)
            warnings.warn(f"the layer-wise trainer closed after a failed "
                          f"step and could not restore the staged layers' "
                          f"weights ({exc}): the model's weights cannot be "
                          f"read", RuntimeWarning, stacklevel=3)
            return
        warnings.warn("the layer-wise trainer closed after a failed step: "
                      "its staged layers hold the values last written back "
                      "(a layer the failed step had not written back lacks "
                      "that step's update); the optimizer keeps the state "
                      "it had before the trainer", RuntimeWarning,
                      stacklevel=3)
