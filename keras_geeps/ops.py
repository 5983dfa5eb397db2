"""The custom TensorFlow ops keras_geeps is built on, as thin wrappers.

GeePS moves parameters in batches named by index lists built once: a gather
of rows from a table, a scatter-add of rows into it, a pack of a whole list of
variables into one contiguous buffer (and the unpack back), and swaps between
device and host memory. TensorFlow has no single op for most of these (a pack
is a reshape per variable plus a concat; an unpack a split plus an assign per
variable), so they are C++/CUDA kernels here, one launch per access.

Importing this module loads the compiled library, building it first when no
build for these sources and this TensorFlow is cached (see
`keras_geeps._build`); it starts nothing else. When the library cannot be
built or loaded the import fails with the reason: there is no pure-Python
stand-in.

Example:

```python
import tensorflow as tf
from keras_geeps import ops

table = tf.Variable(tf.zeros([1000, 128]))
ops.scatter_add_rows(table, [3, 7, 3], tf.ones([3, 128]))
rows = ops.gather_rows(table, [3, 7])       # row 3 holds 2.0, row 7 holds 1.0
```
"""

import collections.abc
import math

import tensorflow as tf
# variable_accessed / variable_shape / BaseResourceVariable have no public
# equivalent; every custom op that reads a resource variable needs them.
from tensorflow.python.ops import resource_variable_ops

from keras_geeps import _build

__all__ = ["PackLayout", "gather_rows", "library_path", "pack",
           "scatter_add_rows", "swap_in", "swap_out", "unpack"]

_REBUILD = "python -m keras_geeps._build --force"

# The dtypes pack / unpack / gather_rows / scatter_add_rows take.
_FLOAT_DTYPES = (tf.float32, tf.float16, tf.bfloat16, tf.float64)


def _load():
    """Builds (if needed) and loads the library; ImportError saying why."""
    try:
        path = _build.build()
    except _build.BuildError as exc:
        raise ImportError(
            f"keras_geeps.ops: the custom TensorFlow ops are not built and "
            f"building them failed. Fix the cause below, then run `{_REBUILD}`"
            f" (set KERAS_GEEPS_CUDA=0 to leave the CUDA kernels out).\n"
            f"{exc}") from exc
    try:
        return path, tf.load_op_library(path)
    except (tf.errors.NotFoundError, OSError) as exc:
        info = _build.build_info(path)
        built_for = info.get("tf_version")
        if built_for and built_for != tf.__version__:
            reason = (f"it was built for TensorFlow {built_for} but this is "
                      f"TensorFlow {tf.__version__}")
        elif not info:
            reason = "it has no build record (an interrupted or foreign build)"
        else:
            reason = ("it does not match this TensorFlow's binary interface "
                      "(a TensorFlow reinstalled in place?)")
        raise ImportError(
            f"keras_geeps.ops: cannot load the custom-op library {path}: "
            f"{reason}. Rebuild it with `{_REBUILD}`.\nLoader said: {exc}"
        ) from exc


_LIBRARY_PATH, _gen = _load()


def library_path():
    """The path of the loaded custom-op library (str)."""
    return _LIBRARY_PATH


def _resource_variable(value):
    """The tf.Variable behind `value`, or None when `value` is no variable.

    Accepts a tf.Variable or a keras.Variable (TensorFlow backend), which
    wraps one. Keras hands the wrapped variable out as `.value`, except inside
    an autocast scope, where `.value` is a cast copy; then the only way to the
    variable is its private `_value`, reached for here alone.
    """
    if isinstance(value, resource_variable_ops.BaseResourceVariable):
        return value
    if not resource_variable_ops.is_resource_variable(value):
        return None
    for name in ("value", "_value"):
        inner = getattr(value, name, None)
        if isinstance(inner, resource_variable_ops.BaseResourceVariable):
            return inner
    raise TypeError(
        f"{value!r} acts as a resource variable but wraps no tf.Variable "
        "(a distributed variable?); pass the per-replica tf.Variable")


def _tensor_of(value, dtype):
    """`value` as a tensor of `dtype`; a variable's own value, not the cast
    copy an autocast scope makes of a keras.Variable."""
    variable = _resource_variable(value)
    return tf.convert_to_tensor(value if variable is None else variable,
                                dtype=dtype)


def _require_variable(value, what):
    variable = _resource_variable(value)
    if variable is None:
        raise TypeError(f"{what} must be a tf.Variable or keras.Variable, "
                        f"got {type(value).__name__}")
    return variable


def _indices(indices):
    if isinstance(indices, (list, tuple)) and not indices:
        indices = tf.zeros([0], tf.int64)  # (an empty list reads as float)
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    return indices


def gather_rows(table, indices, check_indices=True):
    """Gathers whole rows of a matrix: `table[indices[i], :]` for every i.

    GeePS reads a batch of rows named by an index list built once; this is
    that read as one kernel, from a variable (under its read lock, visible to
    `tf.GradientTape` like any variable read) or from a tensor. Every index is
    checked: one outside `[0, rows)` fails the op with InvalidArgumentError
    naming its position and value. On a GPU that check waits for the device
    (the op cannot fail later), about 18 us a call behind queued work on an
    H200 (benchmarks/RESULTS.md); an index built and checked once, as
    `DeviceParameterCache`'s are, can skip it with `check_indices=False`.

    Args:
        table: tf.Variable, keras.Variable or tensor of shape `[rows, width]`
            and dtype float32, float16, bfloat16 or float64.
        indices: int32 or int64 vector of row numbers, any order, repeats
            allowed.
        check_indices: bool. If False, a GPU op does not check the indices
            (nor wait for the device): the rows of indices outside
            `[0, rows)` come out as zeros, as in `tf.gather` on a GPU. The
            CPU op always checks (it would read out of bounds otherwise).
            Defaults to True.

    Returns:
        A tensor `[len(indices), width]` of the table's dtype (a
        keras.Variable is read at its own dtype, not autocast). Its gradient
        with respect to the table is an `IndexedSlices`.

    Example:

    ```python
    table = tf.Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    gather_rows(table, [2, 0])  # [[5., 6.], [1., 2.]]
    ```
    """
    indices = _indices(indices)
    variable = _resource_variable(table)
    if variable is not None:
        resource_variable_ops.variable_accessed(variable)
        return _gen.geeps_resource_gather_rows(
            variable.handle, indices, dtype=variable.dtype,
            check_indices=check_indices)
    return _gen.geeps_gather_rows(tf.convert_to_tensor(table), indices,
                                  check_indices=check_indices)


@tf.RegisterGradient("Geeps>GatherRows")
def _gather_rows_grad(op, grad):
    params_shape = tf.shape(op.inputs[0], out_type=op.inputs[1].dtype)
    return [tf.IndexedSlices(grad, op.inputs[1], params_shape), None]


@tf.RegisterGradient("Geeps>ResourceGatherRows")
def _resource_gather_rows_grad(op, grad):
    params_shape = resource_variable_ops.variable_shape(
        op.inputs[0], out_type=op.inputs[1].dtype)
    return [tf.IndexedSlices(grad, op.inputs[1], params_shape), None]


def scatter_add_rows(variable, indices, updates, check_indices=True):
    """Adds `updates[i]` into row `indices[i]` of a variable, in place.

    GeePS applies an update batch as one kernel into the parameter cache or
    the update log. Duplicate indices accumulate. The add runs under the
    variable's lock, so concurrent scatter-adds lose nothing; every index is
    checked before anything is written, so a bad index (reported by position
    and value in an InvalidArgumentError) leaves the variable unchanged.

    Args:
        variable: tf.Variable or keras.Variable of shape `[rows, width]`,
            dtype float32, float16, bfloat16 or float64.
        indices: int32 or int64 vector of row numbers.
        updates: tensor `[len(indices), width]`, converted to the variable's
            dtype.
        check_indices: bool. If False, a GPU op does not check the indices
            (nor wait for the device, see `gather_rows`): rows of indices
            outside `[0, rows)` are not added. The CPU op always checks.
            Defaults to True.

    Returns:
        None eagerly and inside tf.function (where automatic control
        dependencies order it); the Operation in a tf.compat.v1 graph.

    Example:

    ```python
    table = tf.Variable(tf.zeros([4, 2]))
    scatter_add_rows(table, [1, 1], [[1.0, 1.0], [2.0, 2.0]])  # row 1: 3, 3
    ```
    """
    variable = _require_variable(variable, "variable")
    indices = _indices(indices)
    updates = tf.convert_to_tensor(updates, dtype=variable.dtype)
    op = _gen.geeps_resource_scatter_add_rows(variable.handle, indices,
                                              updates,
                                              check_indices=check_indices)
    return None if tf.inside_function() else op


class PackLayout:
    """Where each variable of a list lives in one contiguous 1-D buffer.

    GeePS moves a layer's (or a model's) parameters as one contiguous
    transfer with an index built once; this is that index. Segment i holds
    the elements of variable i in row-major order, starting at `offsets[i]`,
    with no padding.

    Args:
        variables_or_shapes: list of tf.Variable / keras.Variable / tensors
            (their shapes and dtype are used) or of shapes (tuples or
            tf.TensorShape). Shapes must be fully known.
        dtype: the buffer's dtype. Defaults to None: the dtype of the
            variables (float32 for a list of shapes). When given with
            variables it must match theirs.

    Attributes:
        shapes: tuple of tuples, the shape of every segment.
        sizes: tuple of ints, the number of elements of every segment.
        offsets: tuple of ints, where every segment starts.
        total_size: int, the length of the buffer.
        dtype: tf.DType of the buffer.

    Example:

    ```python
    weights = [tf.Variable(tf.zeros([2, 3])), tf.Variable(tf.zeros([4]))]
    layout = PackLayout(weights)
    layout.offsets, layout.total_size  # (0, 6), 10
    ```
    """

    def __init__(self, variables_or_shapes, dtype=None):
        if hasattr(variables_or_shapes, "dtype") or isinstance(
                variables_or_shapes, (str, bytes, tf.TensorShape)) or \
                not isinstance(variables_or_shapes, collections.abc.Iterable) \
                or (isinstance(variables_or_shapes, tuple) and all(
                    isinstance(d, int) for d in variables_or_shapes)
                    and variables_or_shapes):
            raise TypeError(
                f"PackLayout takes a list of variables or shapes, got "
                f"{variables_or_shapes!r}: wrap one in a list ([v] or "
                f"[(4, 5)])")
        shapes = []
        dtypes = set()
        for item in variables_or_shapes:
            # A keras.Variable's own dtype, not its autocast one.
            variable = _resource_variable(item)
            item = item if variable is None else variable
            if hasattr(item, "shape") and hasattr(item, "dtype"):
                shape = tf.TensorShape(item.shape)
                dtypes.add(tf.as_dtype(item.dtype))
            else:
                shape = tf.TensorShape(item)
            if not shape.is_fully_defined():
                raise ValueError(f"PackLayout needs fully known shapes, got "
                                 f"{shape} at position {len(shapes)}")
            shapes.append(tuple(shape.as_list()))
        if len(dtypes) > 1:
            raise ValueError(f"PackLayout variables must share one dtype, got "
                             f"{sorted(d.name for d in dtypes)}")
        if dtype is not None:
            dtype = tf.as_dtype(dtype)
            if dtypes and dtypes != {dtype}:
                raise ValueError(f"PackLayout dtype {dtype.name} differs from "
                                 f"the variables' {dtypes.pop().name}")
        elif dtypes:
            dtype = dtypes.pop()
        else:
            dtype = tf.float32
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"PackLayout dtype must be one of "
                            f"{[d.name for d in _FLOAT_DTYPES]} (what pack "
                            f"and unpack take), not {dtype.name}")
        self.shapes = tuple(shapes)
        self.sizes = tuple(math.prod(s) for s in shapes)
        offsets = [0]
        for size in self.sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = tuple(offsets[:-1])
        self.total_size = offsets[-1]
        self.dtype = dtype

    def __len__(self):
        return len(self.sizes)

    def __repr__(self):
        return (f"PackLayout({len(self)} segments, total_size="
                f"{self.total_size}, dtype={self.dtype.name})")


def _check_layout(items, layout):
    if len(items) != len(layout):
        raise ValueError(f"the layout has {len(layout)} segments but "
                         f"{len(items)} variables were given")


def pack(variables, layout, snapshot=None):
    """Packs a list of variables into one contiguous 1-D buffer.

    GeePS sends a model's parameters, or its updates, as one contiguous
    transfer. This copies every variable into its segment of `layout` in one
    op (multi-threaded on the CPU, one kernel launch on a GPU), optionally
    subtracting a previously packed `snapshot` so the result is the update
    made since then. Variables are read under their read locks. Sizes or
    dtypes that do not match the layout fail with InvalidArgumentError.

    Args:
        variables: list of tf.Variable / keras.Variable (the main case) or of
            tensors, in the layout's order.
        layout: the `PackLayout` of that list.
        snapshot: optional 1-D tensor of `layout.total_size` elements, e.g. an
            earlier `pack` of the same variables. Defaults to None.

    Returns:
        A 1-D tensor of `layout.total_size` elements and `layout.dtype`: the
        values, or the values minus `snapshot`.

    Example:

    ```python
    weights = [tf.Variable(tf.ones([2, 2])), tf.Variable(tf.zeros([3]))]
    layout = PackLayout(weights)
    before = pack(weights, layout)
    weights[1].assign_add([1.0, 2.0, 3.0])
    pack(weights, layout, snapshot=before)  # [0, 0, 0, 0, 1, 2, 3]
    ```
    """
    variables = list(variables)
    _check_layout(variables, layout)
    sizes = list(layout.sizes)
    if snapshot is not None:
        snapshot = tf.convert_to_tensor(snapshot, dtype=layout.dtype)
    resources = [_resource_variable(v) for v in variables]
    if all(r is not None for r in resources):
        for variable in resources:
            resource_variable_ops.variable_accessed(variable)
        handles = [r.handle for r in resources]
        if snapshot is None:
            return _gen.geeps_pack(handles, dtype=layout.dtype, sizes=sizes)
        return _gen.geeps_pack_delta(handles, snapshot, sizes=sizes)
    values = [_tensor_of(v, layout.dtype) for v in variables]
    if snapshot is None:
        return _gen.geeps_pack_tensors(values, sizes=sizes)
    return _gen.geeps_pack_tensors_delta(values, snapshot, sizes=sizes)


def pack_delta_into(variables, layout, snapshot, out, scale=1.0):
    """Writes `(variables - snapshot) * scale` into the memory of `out`.

    `pack(..., snapshot=...)` returns a new tensor; this writes the update
    straight into a host buffer the caller owns (a co-located shard reads
    it from shared memory), saving the copy from a fresh tensor and the
    fresh tensor's page faults, and folds in the averaging scale. CPU
    variables only (`out` is host memory); runs eagerly.

    Args:
        variables: resource variables on the CPU, in the layout's order.
        layout: their `PackLayout`.
        snapshot: 1-D tensor of `layout.total_size` elements (the values the
            update is measured from).
        out: 1-D tensor of `layout.total_size` elements that aliases the
            destination memory: `tf.experimental.dlpack.from_dlpack` of a
            64-byte aligned numpy array itself, not a TensorFlow op's
            result from it (a slice is a copy, which the op would write
            instead; a reshape of a variable shares the variable's memory,
            which it would write past the variable's lock). Its memory is
            overwritten.
        scale: multiplies the update. Defaults to 1.0.

    Example:

    ```python
    weights = [tf.Variable(tf.ones([4]))]
    layout = PackLayout(weights)
    before = pack(weights, layout)
    weights[0].assign_add([1.0, 2.0, 3.0, 4.0])
    target = np.zeros(4, np.float32)  # 64-byte aligned in practice
    pack_delta_into(weights, layout, before,
                    tf.experimental.dlpack.from_dlpack(target.__dlpack__()),
                    scale=0.5)
    target  # [0.5, 1.0, 1.5, 2.0]
    ```
    """
    variables = list(variables)
    _check_layout(variables, layout)
    if not tf.executing_eagerly():
        raise ValueError("pack_delta_into writes caller memory: call it "
                         "eagerly (e.g. inside tf.py_function)")
    resources = [_resource_variable(v) for v in variables]
    if any(r is None for r in resources):
        raise TypeError("pack_delta_into takes resource variables")
    for variable in resources:
        if "CPU" not in variable.device.upper():
            raise ValueError(f"pack_delta_into takes CPU variables; "
                             f"{variable.name} is on {variable.device}")
        resource_variable_ops.variable_accessed(variable)
    _check_out(out, layout, "pack_delta_into")
    snapshot = tf.convert_to_tensor(snapshot, dtype=layout.dtype)
    _gen.geeps_pack_delta_into([r.handle for r in resources], snapshot, out,
                               sizes=list(layout.sizes), scale=float(scale))


def pack_tensors_into(values, layout, out, scales, base=None):
    """Writes tensors, each times its own scale, into the memory of `out`.

    The counterpart of `pack_delta_into` for updates that are already
    tensors: an optimizer's additive update captured in the train step goes
    into a host buffer a co-located shard reads, in one multi-threaded pass
    (the scale folds in the update's sign and the workers' averaging). CPU
    tensors only; runs eagerly.

    Args:
        values: tensors in the layout's order (their sizes must match it).
        layout: their `PackLayout`.
        out: 1-D tensor of `layout.total_size` elements that aliases the
            destination memory (as for `pack_delta_into`). Its memory is
            overwritten.
        scales: one float per segment (a list or a float32 tensor):
            segment i is `values[i] * scales[i]`.
        base: optional 1-D tensor of `layout.total_size` elements added to
            the result (`out = base + values * scales`): new rows rather
            than an update. Defaults to None.

    Example:

    ```python
    layout = PackLayout([(2,), (3,)])
    target = np.zeros(5, np.float32)  # 64-byte aligned in practice
    pack_tensors_into([tf.ones([2]), tf.fill([3], 2.0)], layout,
                      tf.experimental.dlpack.from_dlpack(target.__dlpack__()),
                      scales=[-1.0, 0.5])
    target  # [-1, -1, 1, 1, 1]
    ```
    """
    values = list(values)
    _check_layout(values, layout)
    scales = tf.reshape(tf.cast(scales, tf.float32), [-1])
    if scales.shape[0] != len(layout):
        raise ValueError(f"pack_tensors_into takes one scale per segment: "
                         f"{scales.shape[0]} scales for {len(layout)} "
                         f"segments")
    if not tf.executing_eagerly():
        raise ValueError("pack_tensors_into writes caller memory: call it "
                         "eagerly (e.g. inside tf.py_function)")
    _check_out(out, layout, "pack_tensors_into")
    values = [_tensor_of(v, layout.dtype) for v in values]
    for value in values:
        if "CPU" not in value.device.upper():
            raise ValueError(f"pack_tensors_into takes CPU tensors; one is "
                             f"on {value.device}")
    if base is None:
        _gen.geeps_pack_tensors_into(values, scales, out,
                                     sizes=list(layout.sizes))
        return
    base = tf.convert_to_tensor(base, dtype=layout.dtype)
    _gen.geeps_pack_tensors_onto_base_into(values, scales, base, out,
                                           sizes=list(layout.sizes))


def _check_out(out, layout, name):
    """Raises unless `out` is a CPU tensor of the layout's dtype: anything
    else (a numpy array, another dtype, a GPU tensor) would be converted to
    a copy, which the op would write instead of the caller's memory."""
    if not isinstance(out, tf.Tensor):
        raise TypeError(
            f"{name}: out must be a tf.Tensor that aliases the destination, "
            f"not a {type(out).__name__} (TensorFlow would write a copy of "
            f"it): wrap a numpy array as "
            f"tf.experimental.dlpack.from_dlpack(array.__dlpack__())")
    if out.dtype != layout.dtype:
        raise TypeError(f"{name}: out is {out.dtype.name}, the layout "
                        f"{layout.dtype.name} (a conversion would write a "
                        f"copy)")
    if "CPU" not in out.device.upper():
        raise ValueError(f"{name}: out must be in host memory; it is on "
                         f"{out.device}")


def _pack_grad(op, grad, resources, delta):
    """Gradient of a pack: the buffer's gradient split back per input."""
    sizes = op.get_attr("sizes")
    grads = []
    for i, piece in enumerate(tf.split(grad, sizes) if sizes else []):
        value = op.inputs[i]
        shape = (resource_variable_ops.variable_shape(value) if resources
                 else tf.shape(value))
        grads.append(tf.reshape(piece, shape))
    if delta:
        grads.append(-grad)
    return grads


@tf.RegisterGradient("Geeps>Pack")
def _pack_resources_grad(op, grad):
    return _pack_grad(op, grad, resources=True, delta=False)


@tf.RegisterGradient("Geeps>PackDelta")
def _pack_resources_delta_grad(op, grad):
    return _pack_grad(op, grad, resources=True, delta=True)


@tf.RegisterGradient("Geeps>PackTensors")
def _pack_tensors_grad(op, grad):
    return _pack_grad(op, grad, resources=False, delta=False)


@tf.RegisterGradient("Geeps>PackTensorsDelta")
def _pack_tensors_delta_grad(op, grad):
    return _pack_grad(op, grad, resources=False, delta=True)


def unpack(buffer, variables, layout, mode="assign"):
    """Writes a packed buffer back into a list of variables, in place.

    The way back from `pack`: fresh parameters arriving as one buffer are
    assigned into the model's variables, or an update buffer is added into
    them, in one op under all their locks (taken in a fixed order, so
    concurrent unpacks cannot deadlock). A buffer or variable that does not
    match the layout fails with InvalidArgumentError before any variable is
    written; a variable listed twice is refused the same way.

    Args:
        buffer: 1-D tensor of `layout.total_size` elements, converted to
            `layout.dtype`.
        variables: list of tf.Variable / keras.Variable in the layout's order.
        layout: the `PackLayout` of that list.
        mode: "assign" to overwrite the variables, "add" to add the buffer
            into them. Defaults to "assign".

    Returns:
        None eagerly and inside tf.function (where automatic control
        dependencies order it); the Operation in a tf.compat.v1 graph.

    Example:

    ```python
    weights = [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([3]))]
    layout = PackLayout(weights)
    unpack(tf.range(7.0), weights, layout)             # weights[1]: [4, 5, 6]
    unpack(tf.ones([7]), weights, layout, mode="add")  # weights[1]: [5, 6, 7]
    ```
    """
    if mode not in ("assign", "add"):
        raise ValueError(f"mode must be 'assign' or 'add', not {mode!r}")
    variables = [_require_variable(v, "every variable") for v in variables]
    _check_layout(variables, layout)
    buffer = tf.convert_to_tensor(buffer, dtype=layout.dtype)
    op = _gen.geeps_unpack(buffer, [v.handle for v in variables],
                           sizes=list(layout.sizes), mode=mode)
    return None if tf.inside_function() else op


tf.no_gradient("Geeps>Unpack")
tf.no_gradient("Geeps>ResourceScatterAddRows")


def swap_out(tensor):
    """Copies a tensor into host memory.

    GeePS keeps what does not fit in GPU memory in pinned host memory. On a
    GPU this copy runs asynchronously on TensorFlow's device-to-host stream
    into pinned memory, so it overlaps the compute that follows; on the CPU
    it is a plain copy into a fresh buffer.

    Args:
        tensor: a tensor (float32, float16, bfloat16, float64, int64 or uint8;
            int32 too on the CPU).

    Returns:
        A tensor with the same value, held in host memory.

    Example:

    ```python
    activations = tf.random.normal([1000, 100])
    host = swap_out(activations)  # host memory (pinned, on a GPU)
    del activations               # its device memory can be reused now
    ```
    """
    return _gen.geeps_swap_out(tensor)


def swap_in(host_tensor):
    """Copies a host tensor into the memory of the device the op runs on.

    The way back from `swap_out`, for prefetching: on a GPU the copy runs
    asynchronously on TensorFlow's host-to-device stream, so issuing it ahead
    of use overlaps it with compute. On the CPU it is a plain copy.

    Args:
        host_tensor: a tensor in host memory, e.g. from `swap_out`.

    Returns:
        A tensor with the same value on the current device (the enclosing
        `tf.device` scope, else TensorFlow's default placement).

    Example:

    ```python
    host = swap_out(tf.ones([4, 4]))
    with tf.device("/CPU:0"):     # or "/GPU:0" to bring it back to a GPU
        again = swap_in(host)
    ```
    """
    return _gen.geeps_swap_in(host_tensor)


@tf.RegisterGradient("Geeps>SwapOut")
def _swap_out_grad(op, grad):
    del op
    return grad


@tf.RegisterGradient("Geeps>SwapIn")
def _swap_in_grad(op, grad):
    del op
    return grad
