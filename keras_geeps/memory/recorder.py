"""GeePS's virtual iteration for a Keras model: one step's accesses, recorded.

Before training, GeePS walks one step without doing it and notes every read,
update and local-data access, in order, with its size; the memory planner
works from that list. Here the list is derived from the model itself: the
model is a chain of layers (a `keras.Sequential`, or a functional model whose
layers feed one another in order), each layer with parameters is one
parameter table, and the intermediate data that must survive from the
forward pass to the backward pass is each layer's input (and the model's
output, which the loss needs). Shapes come from Keras' symbolic shape
inference (`compute_output_spec`), so nothing is computed.

One step, as recorded:

    forward, layer 0 .. L-1:  read table i; keep local act i (the input)
    the loss:                 keep local output
    backward, L-1 .. 0:       fetch act i+1 (if the layer's backward needs
                              its output); fetch act i; read table i;
                              fetch local state i (optimizer slots);
                              update table i
"""

import numpy as np

from keras_geeps.checks import check_count

KINDS = ("read", "update", "local")
# The dtypes `keras_geeps.ops.swap_out` / `swap_in` copy (their op's "T").
SWAPPABLE_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32",
                    "int64", "uint8")


class UnitRecord:
    """One layer of the chain, as the planner sees it.

    Attributes:
        index: position in the chain.
        name: the layer's name.
        param_bytes: bytes of its trainable variables (its parameter table).
        state_bytes: bytes of its optimizer state (e.g. momentum); GeePS
            treats it as local data, staged with the table here.
        fixed_bytes: bytes of its non-trainable variables (a frozen
            layer's weights, BatchNorm statistics, seed states): never
            staged, always on the device.
        input_bytes: bytes of its input for one batch, kept from the forward
            pass to the backward pass.
        output_bytes: bytes of its output for one batch.
        backward: "explicit" when the layer's gradient is computed from its
            saved input and output and the parameters read again (Dense);
            "autodiff" when TensorFlow's tape computes it (then a layer
            whose parameters or input leave the device is recomputed from
            its input in the backward pass).
        needs_output: the explicit backward reads the layer's output too.
        flops: forward multiply-adds x 2, an estimate for reports.
        input_dtype: the dtype of its input ("float32", "int16"), or None
            when unknown. The planner offloads only inputs of a dtype the
            swap ops copy (`offloadable`).
    """

    __slots__ = ("index", "name", "param_bytes", "state_bytes", "input_bytes",
                 "output_bytes", "backward", "needs_output", "flops",
                 "fixed_bytes", "input_dtype")

    def __init__(self, index, name, param_bytes, input_bytes, output_bytes=0,
                 state_bytes=0, backward="autodiff", needs_output=False,
                 flops=0, fixed_bytes=0, input_dtype=None):
        if backward not in ("explicit", "autodiff"):
            raise ValueError(f"backward must be 'explicit' or 'autodiff', "
                             f"not {backward!r}")
        if state_bytes and not param_bytes:
            raise ValueError(f"layer {name!r}: optimizer state without "
                             "parameters")
        for field, value in (("index", index), ("param_bytes", param_bytes),
                             ("input_bytes", input_bytes),
                             ("output_bytes", output_bytes),
                             ("state_bytes", state_bytes),
                             ("flops", flops), ("fixed_bytes", fixed_bytes)):
            check_count(f"layer {name!r}: {field}", value, 0)
        self.index = int(index)
        self.name = str(name)
        self.param_bytes = int(param_bytes)
        self.state_bytes = int(state_bytes)
        self.input_bytes = int(input_bytes)
        self.output_bytes = int(output_bytes)
        self.backward = backward
        self.needs_output = bool(needs_output)
        self.flops = int(flops)
        self.fixed_bytes = int(fixed_bytes)
        self.input_dtype = None if input_dtype is None else str(input_dtype)

    @property
    def has_params(self):
        return self.param_bytes > 0

    @property
    def offloadable(self):
        """Whether its input can wait in host memory: the swap ops
        (`keras_geeps.ops.swap_out` / `swap_in`) copy its dtype (an
        unknown dtype is taken to be one they copy)."""
        return self.input_dtype is None or \
            self.input_dtype in SWAPPABLE_DTYPES

    @property
    def table_bytes(self):
        """Parameters plus optimizer state: what staging the table moves."""
        return self.param_bytes + self.state_bytes

    def __repr__(self):
        return (f"UnitRecord({self.index} {self.name!r}, params="
                f"{self.param_bytes}, state={self.state_bytes}, input="
                f"{self.input_bytes}, {self.backward})")


class Access:
    """One recorded access of the step.

    Attributes:
        position: index in the step's sequence.
        kind: "read", "update" or "local".
        phase: "forward", "loss" or "backward".
        unit: index of the layer the access belongs to (the output's
            consumer, the loss, is unit L).
        item: what is accessed: "table:NAME", "act:NAME" (a layer's input),
            "output" (the model's output) or "state:NAME".
        nbytes: bytes accessed.
    """

    __slots__ = ("position", "kind", "phase", "unit", "item", "nbytes")

    def __init__(self, position, kind, phase, unit, item, nbytes):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        self.position = position
        self.kind = kind
        self.phase = phase
        self.unit = unit
        self.item = item
        self.nbytes = int(nbytes)

    def __repr__(self):
        return (f"Access(#{self.position} {self.phase} {self.kind} "
                f"{self.item!r}, {self.nbytes} bytes)")


class AccessSequence:
    """The ordered accesses of one training step (GeePS' virtual iteration).

    Args:
        units: the layers of the chain, as `UnitRecord`s in forward order.
        output_bytes: bytes of the model's output for one batch. Defaults
            to the last unit's `output_bytes`.
        batch_size: the batch size the sizes are for (for reports).
            Defaults to None.

    Example:

    >>> seq = AccessSequence([UnitRecord(0, "dense", 4096, 512),
    ...                       UnitRecord(1, "out", 1024, 256)])
    >>> [a.item for a in seq.accesses][:3]
    ['table:dense', 'act:dense', 'table:out']
    """

    def __init__(self, units, output_bytes=None, batch_size=None):
        self.units = list(units)
        for i, unit in enumerate(self.units):
            if unit.index != i:
                raise ValueError(f"unit {unit.name!r} has index {unit.index}"
                                 f", expected {i}")
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")
        if output_bytes is None:
            output_bytes = self.units[-1].output_bytes if self.units else 0
        self.output_bytes = int(output_bytes)
        self.batch_size = batch_size
        self.accesses = self._build()

    def _build(self):
        accesses = []

        def add(kind, phase, unit, item, nbytes):
            accesses.append(Access(len(accesses), kind, phase, unit, item,
                                   nbytes))

        for u in self.units:
            if u.has_params:
                add("read", "forward", u.index, f"table:{u.name}",
                    u.param_bytes)
            add("local", "forward", u.index, f"act:{u.name}", u.input_bytes)
        last = len(self.units)
        add("local", "loss", last, "output", self.output_bytes)
        # No gradient flows back past the first layer with parameters: the
        # backward pass stops there.
        for u in reversed(self.units[self.first_with_params:]):
            if u.backward == "explicit" and u.needs_output:
                add("local", "backward", u.index, self.output_item(u.index),
                    self.output_bytes_of(u.index))
            add("local", "backward", u.index, f"act:{u.name}", u.input_bytes)
            if u.has_params:
                add("read", "backward", u.index, f"table:{u.name}",
                    u.param_bytes)
                if u.state_bytes:
                    add("local", "backward", u.index, f"state:{u.name}",
                        u.state_bytes)
                add("update", "backward", u.index, f"table:{u.name}",
                    u.param_bytes)
        return accesses

    def output_item(self, index):
        """The item holding unit `index`'s output (the next unit's input)."""
        if index + 1 < len(self.units):
            return f"act:{self.units[index + 1].name}"
        return "output"

    def output_bytes_of(self, index):
        if index + 1 < len(self.units):
            return self.units[index + 1].input_bytes
        return self.output_bytes

    def __len__(self):
        return len(self.accesses)

    def __iter__(self):
        return iter(self.accesses)

    def first_access(self, item):
        """Position of the first access of `item` (None if never)."""
        for access in self.accesses:
            if access.item == item:
                return access.position
        return None

    @property
    def first_with_params(self):
        """Index of the first unit with parameters (the number of units
        when none has any): the backward pass ends there, so the layers
        before it keep no input for it."""
        return next((u.index for u in self.units if u.has_params),
                    len(self.units))

    def early_peak(self):
        """Activation bytes on the device while a layer before
        `first_with_params` runs: its input and its output, nothing kept."""
        return max((u.input_bytes + self.output_bytes_of(u.index)
                    for u in self.units[:self.first_with_params]), default=0)

    @property
    def param_bytes(self):
        return sum(u.param_bytes for u in self.units)

    @property
    def state_bytes(self):
        return sum(u.state_bytes for u in self.units)

    @property
    def fixed_bytes(self):
        """Non-trainable variables: always on the device."""
        return sum(u.fixed_bytes for u in self.units)

    @property
    def activation_bytes(self):
        return sum(u.input_bytes for u in self.units) + self.output_bytes

    def __str__(self):
        lines = [f"{'#':>4}  {'phase':<8} {'kind':<7} {'item':<36} "
                 f"{'bytes':>14}"]
        for a in self.accesses:
            lines.append(f"{a.position:>4}  {a.phase:<8} {a.kind:<7} "
                         f"{a.item[:36]:<36} {a.nbytes:>14,}")
        return "\n".join(lines)


# ------------------------------------------------------------ Keras models
def chain_layers(model):
    """The layers of `model` in execution order (input layers dropped).

    The layer-wise trainer runs them one after another, each on the previous
    one's output, which is what a `keras.Sequential` does; for any other
    model the trainer checks that on a probe batch
    (`LayerwiseTrainer._verify_chain`).

    Raises:
        ValueError: the model is no `keras.Sequential` and no functional
            model (`keras.Model(inputs, outputs)`), is not built, has no
            layers or more than one input, or uses a layer twice or shares
            a variable between layers.
    """
    import keras  # noqa: PLC0415
    from keras.src.models.functional import Functional  # noqa: PLC0415
    if not isinstance(model, (keras.Sequential, Functional)):
        raise ValueError(
            f"{type(model).__name__} is a subclassed model (its call() "
            "runs whatever it codes): the layer-wise trainer takes a "
            "keras.Sequential or a functional model (keras.Model(inputs, "
            "outputs)) whose layers form a chain")
    if not model.built:
        raise ValueError("the model must be built (give it a keras.Input or "
                         "call model.build) before its step is recorded")
    inputs = getattr(model, "inputs", None) or []
    if len(inputs) > 1:
        raise ValueError(f"the model has {len(inputs)} inputs: the "
                         f"layer-wise trainer takes a chain of layers from "
                         f"one input")
    layers = [layer for layer in model.layers
              if not isinstance(layer, keras.layers.InputLayer)]
    if not layers:
        raise ValueError("the model has no layers")
    _check_unshared(layers)
    return layers


def _check_unshared(layers):
    """Refuses a layer used twice, or a variable two layers hold (tied
    weights): each layer is a unit with an optimizer copy of its own,
    staged on its own, so a shared variable would get two updates (and
    be emptied under the other's feet)."""
    seen, owner = set(), {}
    for layer in layers:
        if id(layer) in seen:
            raise ValueError(
                f"layer {layer.name!r} is used twice in the model (a shared "
                f"layer): the layer-wise trainer updates and stages each "
                f"layer on its own, so it cannot train shared weights")
        seen.add(id(layer))
        for variable in layer.weights:
            other = owner.setdefault(id(variable), layer)
            if other is not layer:
                raise ValueError(
                    f"layers {other.name!r} and {layer.name!r} share the "
                    f"variable {variable.path!r} (tied weights): the "
                    f"layer-wise trainer updates and stages each layer on "
                    f"its own, so it cannot train shared weights")


def explicit_backward(layer):
    """Whether `layer` has a backward computed from (input, output, params).

    True for a plain `keras.layers.Dense` (no LoRA, not quantized) whose
    activation is linear, relu, sigmoid or tanh: its gradient is two matrix
    products, a sum and the activation's derivative taken from its output,
    so a staged Dense needs no recomputation. Returns (explicit,
    needs_output).
    """
    import keras  # noqa: PLC0415
    if type(layer) is not keras.layers.Dense:
        return False, False
    if getattr(layer, "lora_enabled", False) or \
            getattr(layer, "quantization_mode", None):
        return False, False
    activation = layer.activation
    if activation in (None, keras.activations.linear):
        return True, False
    if activation in (keras.activations.relu, keras.activations.sigmoid,
                      keras.activations.tanh):
        return True, True
    return False, False


def _nbytes(shape, dtype):
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _variable_bytes(variables):
    return sum(_nbytes(tuple(v.shape), v.dtype) for v in variables)


def _dense_flops(layer, input_shape):
    if type(layer).__name__ == "Dense":
        rows = int(np.prod(input_shape[:-1], dtype=np.int64))
        return 2 * rows * int(input_shape[-1]) * int(layer.units)
    return 0


def record_model(model, batch_size, state_bytes=None, layers=None,
                 fixed_bytes=None):
    """Records one training step of `model` as an `AccessSequence`.

    Nothing is computed: the sizes come from the variables and from Keras'
    symbolic shape inference at `batch_size`.

    Args:
        model: a built Keras model that is a chain of layers.
        batch_size: the training batch size.
        state_bytes: optional list (one per layer) of optimizer-state bytes.
            Defaults to None (no state).
        layers: the chain, if already extracted. Defaults to None.
        fixed_bytes: optional list (one per layer) of non-trainable bytes.
            Defaults to None: each layer's `non_trainable_variables`.

    Returns:
        An `AccessSequence`.

    Example:

    ```python
    seq = record_model(model, batch_size=64)
    print(seq)          # one line per access
    ```
    """
    import keras  # noqa: PLC0415
    check_count("batch_size", batch_size, 1)
    layers = chain_layers(model) if layers is None else layers
    for name, sizes in (("state_bytes", state_bytes),
                        ("fixed_bytes", fixed_bytes)):
        if sizes is not None and len(sizes) != len(layers):
            raise ValueError(f"{name} has {len(sizes)} entries for "
                             f"{len(layers)} layers: give one per layer")
    input_shape = tuple(model.inputs[0].shape) if getattr(
        model, "inputs", None) else None
    if input_shape is None:
        raise ValueError("the model has no known input shape: build it with "
                         "a keras.Input")
    if any(d is None for d in input_shape[1:]):
        raise ValueError(
            f"the model's input shape {input_shape} has a dimension of "
            "unknown size: the memory plan needs a fixed input shape (give "
            "keras.Input a full shape, e.g. pad variable-length sequences "
            "to one length)")
    spec = keras.KerasTensor((batch_size,) + tuple(input_shape[1:]),
                             dtype=model.inputs[0].dtype)
    units = []
    for i, layer in enumerate(layers):
        out = layer.compute_output_spec(spec)
        explicit, needs_output = explicit_backward(layer)
        units.append(UnitRecord(
            i, layer.name, _variable_bytes(layer.trainable_variables),
            _nbytes(spec.shape, spec.dtype), _nbytes(out.shape, out.dtype),
            state_bytes=state_bytes[i] if state_bytes is not None else 0,
            backward="explicit" if explicit else "autodiff",
            needs_output=needs_output,
            flops=_dense_flops(layer, spec.shape),
            fixed_bytes=(fixed_bytes[i] if fixed_bytes is not None else
                         _variable_bytes(layer.non_trainable_variables)),
            input_dtype=spec.dtype))
        spec = out
    return AccessSequence(units, batch_size=batch_size)
