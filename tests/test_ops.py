"""keras_geeps.ops against numpy / tf.gather / tf.tensor_scatter_nd_add.

Every op over dtypes, index dtypes and shapes (empty, single row, repeats),
eagerly, in tf.function and inside a Keras fit step; invalid input; threads;
the CUDA build. GPU variants run where TensorFlow sees a GPU (`needs_gpu`).
"""

import os
import pathlib
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_geeps import _build, ops

REPO = pathlib.Path(__file__).resolve().parent.parent
DTYPES = [tf.float32, tf.float16, tf.bfloat16, tf.float64]
INDEX_DTYPES = [tf.int32, tf.int64]
DEVICES = ["CPU", pytest.param("GPU", marks=pytest.mark.needs_gpu)]
INVALID = tf.errors.InvalidArgumentError


@pytest.fixture(params=DEVICES)
def device(request):
    with tf.device(f"/{request.param}:0"):
        yield request.param


def _ints(rng, shape, low=-4, high=5):
    """Small integers: every sum below is exact in float16 and bfloat16."""
    return rng.integers(low, high, size=shape).astype(np.float32)


def _np(tensor):
    return np.asarray(tensor.numpy(), dtype=np.float64)


def _rounded(fn, a, b):
    """fn(a, b) rounded once into a's dtype, as the kernels compute it (in
    float for 16-bit types)."""
    wide = np.float64 if a.dtype == np.float64 else np.float32
    return fn(a.astype(wide), b.astype(wide)).astype(a.dtype)


# (rows, width, n): random orders with repeats, a single row, zero width, an
# empty table with no indices, no indices, and a size that runs threaded.
GATHER_SHAPES = [(5, 3, 8), (1, 4, 3), (6, 0, 4), (0, 3, 0), (7, 5, 0),
                 (400, 160, 900)]


@pytest.mark.parametrize("rows,width,n", GATHER_SHAPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", ["variable", "tensor"])
def test_gather_rows_matches_tf_gather(device, source, dtype, index_dtype,
                                       rows, width, n):
    rng = np.random.default_rng(rows * 1000 + width * 10 + n)
    values = tf.constant(rng.standard_normal((rows, width)), dtype=dtype)
    indices = tf.constant(rng.integers(0, max(rows, 1), size=n),
                          dtype=index_dtype)
    table = tf.Variable(values) if source == "variable" else values
    got = ops.gather_rows(table, indices)
    assert got.dtype == dtype and got.shape == (n, width)
    np.testing.assert_array_equal(_np(got), _np(tf.gather(values, indices)))
    want = _np(values)[indices.numpy().astype(np.int64)]
    np.testing.assert_array_equal(_np(got), want)


SCATTER_SHAPES = [(5, 3, 12), (1, 4, 5), (6, 0, 4), (4, 3, 0), (0, 2, 0),
                  (300, 256, 2000)]


@pytest.mark.parametrize("rows,width,n", SCATTER_SHAPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_add_rows_matches_tensor_scatter_nd_add(device, dtype,
                                                        index_dtype, rows,
                                                        width, n):
    rng = np.random.default_rng(rows * 1000 + width * 10 + n)
    initial = tf.constant(_ints(rng, (rows, width)), dtype=dtype)
    updates = tf.constant(_ints(rng, (n, width)), dtype=dtype)
    # The big case hits only 7 distinct rows: most of its indices repeat.
    distinct = max(1, min(rows, 7) if n > 100 else rows)
    indices = tf.constant(rng.integers(0, distinct, size=n), dtype=index_dtype)
    variable = tf.Variable(initial)
    assert ops.scatter_add_rows(variable, indices, updates) is None
    if rows * width:  # TF refuses indices into an empty tensor
        expected = tf.tensor_scatter_nd_add(initial, indices[:, None], updates)
        np.testing.assert_array_equal(_np(variable), _np(expected))
    reference = _np(initial)
    np.add.at(reference, indices.numpy().astype(np.int64), _np(updates))
    np.testing.assert_array_equal(_np(variable), reference)


def test_an_empty_python_list_of_indices_is_no_rows():
    """[] converts to a float32 tensor; as indices it means no rows."""
    variable = tf.Variable(tf.ones([3, 2]))
    assert ops.gather_rows(variable, []).shape == (0, 2)
    ops.scatter_add_rows(variable, [], tf.zeros([0, 2]))
    np.testing.assert_array_equal(variable.numpy(), np.ones([3, 2]))
    with pytest.raises(TypeError, match="indices must be int32 or int64"):
        ops.gather_rows(variable, [0.5])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), width=st.integers(0, 9),
       indices=st.lists(st.integers(0, 39), max_size=60))
def test_scatter_add_then_gather_property(rows, width, indices):
    indices = [i % rows for i in indices]
    rng = np.random.default_rng(len(indices))
    updates = _ints(rng, (len(indices), width))
    variable = tf.Variable(tf.zeros([rows, width]))
    ops.scatter_add_rows(variable, tf.constant(indices, tf.int64), updates)
    reference = np.zeros((rows, width))
    np.add.at(reference, np.array(indices, dtype=np.int64), updates)
    np.testing.assert_array_equal(variable.numpy(), reference)
    np.testing.assert_array_equal(
        ops.gather_rows(variable, tf.constant(indices, tf.int32)).numpy(),
        reference[np.array(indices, dtype=np.int64)])


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_gather_rows_gradient_matches_numeric(dtype):
    params = tf.constant(np.random.default_rng(0).standard_normal((5, 3)),
                         dtype=dtype)
    indices = tf.constant([4, 0, 4, 2])
    theoretical, numerical = tf.test.compute_gradient(
        lambda p: ops.gather_rows(p, indices), [params])
    np.testing.assert_allclose(theoretical[0], numerical[0],
                               atol=1e-3 if dtype == tf.float32 else 1e-8)
    # Row 4 is gathered twice, row 1 never: the Jacobian says so.
    assert theoretical[0].sum() == 4 * 3


def test_resource_gather_gradient_matches_tf_gather(device):
    variable = tf.Variable(tf.random.stateless_normal([6, 4], seed=[1, 2]))
    indices = tf.constant([5, 1, 5, 0], tf.int64)
    weights = tf.random.stateless_normal([4, 4], seed=[3, 4])
    with tf.GradientTape() as tape:  # no watch(): the read is recorded
        ours = tf.reduce_sum(ops.gather_rows(variable, indices) * weights)
    grad = tape.gradient(ours, variable)
    assert isinstance(grad, tf.IndexedSlices)
    with tf.GradientTape() as tape:
        theirs = tf.reduce_sum(tf.gather(variable, indices) * weights)
    expected = tape.gradient(theirs, variable)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6)
    np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(),
                               tf.convert_to_tensor(expected).numpy(),
                               rtol=1e-6)


def test_pack_gradient_matches_numeric():
    a = tf.constant(np.arange(6.0).reshape(2, 3))
    b = tf.constant([7.0, 8.0], dtype=tf.float64)
    snapshot = tf.constant(np.ones(8))
    layout = ops.PackLayout([a, b])
    weights = tf.constant(np.arange(8.0) + 1)
    theoretical, numerical = tf.test.compute_gradient(
        lambda x, y, s: ops.pack([x, y], layout, snapshot=s) * weights,
        [a, b, snapshot])
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, atol=1e-8)
    np.testing.assert_array_equal(np.diag(theoretical[0]), np.arange(6) + 1)
    np.testing.assert_array_equal(np.diag(theoretical[2]), -(np.arange(8) + 1))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("bad,position", [(-1, 2), (5, 1), (2**31 - 1, 3)])
def test_invalid_indices_are_named(device, index_dtype, bad, position):
    table = tf.Variable(tf.ones([5, 2]))
    indices = [0, 1, 2, 3]
    indices[position] = bad
    indices = tf.constant(indices, index_dtype)
    message = rf"indices\[{position}\] = {bad} is not in \[0, 5\)"
    with pytest.raises(INVALID, match=message):
        ops.gather_rows(table, indices)
    with pytest.raises(INVALID, match=message):
        ops.gather_rows(tf.ones([5, 2]), indices)
    with pytest.raises(INVALID, match=message):
        ops.scatter_add_rows(table, indices, tf.ones([4, 2]))
    np.testing.assert_array_equal(table.numpy(), np.ones([5, 2]))  # untouched
    with pytest.raises(INVALID, match=message):
        tf.function(lambda: ops.gather_rows(table, indices))()


def test_unchecked_indices_are_still_checked_on_the_cpu():
    """check_indices=False skips only the GPU's check: on the CPU a bad index
    would read or write out of bounds, so it still fails, naming it."""
    table = tf.Variable(tf.ones([5, 2]))
    indices = tf.constant([0, 7], tf.int32)
    message = r"indices\[1\] = 7 is not in \[0, 5\)"
    with tf.device("/CPU:0"):
        with pytest.raises(INVALID, match=message):
            ops.gather_rows(table, indices, check_indices=False)
        with pytest.raises(INVALID, match=message):
            ops.gather_rows(tf.ones([5, 2]), indices, check_indices=False)
        with pytest.raises(INVALID, match=message):
            ops.scatter_add_rows(table, indices, tf.ones([2, 2]),
                                 check_indices=False)
        with pytest.raises(INVALID, match=message):
            tf.function(lambda: ops.gather_rows(table, indices,
                                                check_indices=False))()
    np.testing.assert_array_equal(table.numpy(), np.ones([5, 2]))


@pytest.mark.needs_gpu
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_unchecked_indices_on_a_gpu_zero_fill_and_skip(index_dtype):
    """On a GPU, check_indices=False neither checks nor waits: rows of
    out-of-range indices gather as zeros and are not added, as in TF's own
    GPU gather and scatters; the others are exact."""
    values = np.arange(10, dtype=np.float32).reshape(5, 2) + 1
    indices = tf.constant([4, -1, 0, 5, 4], index_dtype)
    with tf.device("/GPU:0"):
        table = tf.Variable(values)
        want = np.zeros([5, 2], np.float32)
        want[[0, 2, 4]] = values[[4, 0, 4]]
        for source in (table, tf.constant(values)):
            got = ops.gather_rows(source, indices, check_indices=False)
            np.testing.assert_array_equal(got.numpy(), want)
        ops.scatter_add_rows(table, indices, tf.ones([5, 2]),
                             check_indices=False)
    added = values.copy()
    added[4] += 2
    added[0] += 1
    np.testing.assert_array_equal(table.numpy(), added)


def test_invalid_int64_index_is_named_exactly():
    with pytest.raises(INVALID, match=r"indices\[1\] = 1099511627776 is not"):
        ops.gather_rows(tf.ones([3, 1]), tf.constant([0, 2**40], tf.int64))


def test_mismatched_shapes_are_invalid_argument(device):
    table = tf.Variable(tf.zeros([4, 3]))
    with pytest.raises(INVALID, match="must be a matrix"):
        ops.gather_rows(tf.zeros([4]), [0])
    with pytest.raises(INVALID, match="indices must be a vector"):
        ops.gather_rows(table, [[0]])
    with pytest.raises(INVALID, match="updates has rows of width 2"):
        ops.scatter_add_rows(table, [0], tf.zeros([1, 2]))
    with pytest.raises(INVALID, match="updates has 2 rows but indices has 1"):
        ops.scatter_add_rows(table, [0], tf.zeros([2, 3]))
    with pytest.raises(INVALID, match=r"the variable must be a matrix"):
        ops.scatter_add_rows(tf.Variable(tf.zeros([4])), [0], tf.zeros([1, 1]))
    # The wrappers convert to the variable's dtype; the raw op checks it.
    with pytest.raises(INVALID, match="the variable has dtype double but the "
                       "op was given dtype float"):
        ops._gen.geeps_resource_scatter_add_rows(
            tf.Variable(tf.zeros([4, 3], tf.float64)).handle, [0],
            tf.zeros([1, 3]))


def test_a_table_with_no_rows_is_refused_before_the_output_is_made():
    """Every index is out of range; [n, width] need not even be a shape
    (4 x 2**62 elements overflows): an error naming it, not an abort."""
    empty = tf.zeros([0, 2 ** 62])
    for table, what in ((empty, "params"), (tf.Variable(empty), "variable")):
        with pytest.raises(INVALID, match=f"indices has 4 entries but .*"
                                          f"{what} has no rows"):
            ops.gather_rows(table, [0, 0, 0, 0])
    assert ops.gather_rows(empty, tf.zeros([0], tf.int32)).shape == \
        (0, 2 ** 62)


def _unaligned(values, keep, offset=16):
    """`values` copied `offset` bytes past a 64-byte boundary (numpy's
    allocator promises 16) and seen by TensorFlow there, through DLPack;
    `keep` holds the memory."""
    values = np.asarray(values)
    raw = np.zeros(values.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    array = raw[start:start + values.nbytes].view(values.dtype)
    array = array.reshape(values.shape)
    array[...] = values
    keep.append(array)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def test_inputs_from_dlpack_need_no_64_byte_alignment():
    """Eigen's flat<T>() aborts the process on such memory: every input is
    read through its plain pointer, against numpy."""
    rng = np.random.default_rng(8)
    keep = []
    table = _ints(rng, (5, 3))
    indices = np.array([4, 0, 4], np.int32)
    got = ops.gather_rows(_unaligned(table, keep), _unaligned(indices, keep))
    np.testing.assert_array_equal(got.numpy(), table[indices])
    variable = tf.Variable(table)
    updates = _ints(rng, (3, 3))
    ops.scatter_add_rows(variable, _unaligned(indices, keep),
                         _unaligned(updates, keep))
    want = table.copy()
    np.add.at(want, indices, updates)
    np.testing.assert_array_equal(variable.numpy(), want)

    variables = [tf.Variable(_ints(rng, s)) for s in [(2, 3), (4,)]]
    layout = ops.PackLayout(variables)
    packed = np.concatenate([v.numpy().ravel() for v in variables])
    snapshot = _ints(rng, (10,))
    np.testing.assert_array_equal(
        ops.pack(variables, layout, _unaligned(snapshot, keep)).numpy(),
        packed - snapshot)
    values = [_unaligned(v.numpy(), keep) for v in variables]
    np.testing.assert_array_equal(ops.pack(values, layout).numpy(), packed)
    out = np.zeros(10, np.float32)
    ops.pack_tensors_into(values, layout,
                          tf.experimental.dlpack.from_dlpack(out.__dlpack__()),
                          _unaligned(np.float32([2, -1]), keep))
    np.testing.assert_array_equal(out, packed * np.repeat([2, -1], [6, 4]))
    buffer = _ints(rng, (10,))
    ops.unpack(_unaligned(buffer, keep), variables, layout)
    np.testing.assert_array_equal(
        np.concatenate([v.numpy().ravel() for v in variables]), buffer)


def test_shape_functions_check_ranks_when_tracing():
    table = tf.Variable(tf.zeros([4, 3]))
    with pytest.raises(ValueError, match="must be rank 2"):
        tf.function(lambda: ops.gather_rows(tf.zeros([4]), [0]))()
    with pytest.raises(ValueError, match="must be rank 1"):
        tf.function(lambda: ops.gather_rows(table, [[0]]))()
    with pytest.raises(ValueError, match="Dimensions must be equal"):
        tf.function(
            lambda: ops.scatter_add_rows(table, [0], tf.zeros([1, 2])))()
    layout = ops.PackLayout([(2, 2)])
    with pytest.raises(ValueError, match="layout gives it 4 elements"):
        tf.function(lambda: ops.pack([tf.zeros([3])], layout))()
    # With shapes unknown at trace time the kernels check instead.
    gather = tf.function(
        ops.gather_rows, input_signature=[tf.TensorSpec(None, tf.float32),
                                          tf.TensorSpec(None, tf.int32)])
    with pytest.raises(INVALID, match="must be a matrix"):
        gather(tf.zeros([4]), tf.constant([0]))
    with pytest.raises(INVALID, match=r"indices\[0\] = 9"):
        gather(tf.zeros([4, 1]), tf.constant([9]))


def _variables(rng, shapes, dtype):
    return [tf.Variable(tf.constant(rng.standard_normal(s), dtype=dtype))
            for s in shapes]


# A scalar, an empty variable, a single row, and one big enough to run
# threaded (> 256 KiB).
PACK_SHAPES = [(3, 4), (), (0, 5), (1, 7), (300, 300), (11,)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_matches_concat(device, dtype):
    rng = np.random.default_rng(1)
    variables = _variables(rng, PACK_SHAPES, dtype)
    layout = ops.PackLayout(variables)
    assert layout.sizes == (12, 1, 0, 7, 90000, 11)
    assert layout.offsets == (0, 12, 13, 13, 20, 90020)
    assert layout.total_size == 90031 and layout.dtype == dtype
    expected = tf.concat([tf.reshape(v, [-1]) for v in variables], 0)
    packed = ops.pack(variables, layout)
    np.testing.assert_array_equal(_np(packed), _np(expected))
    # Tensors as well as variables, and inside tf.function.
    tensors = [tf.convert_to_tensor(v) for v in variables]
    packed = ops.pack(tensors, layout)
    np.testing.assert_array_equal(_np(packed), _np(expected))
    np.testing.assert_array_equal(
        _np(tf.function(lambda: ops.pack(variables, layout))()), _np(expected))
    # The delta since a snapshot: rounded once, as numpy does in the dtype.
    snapshot = tf.constant(rng.standard_normal(layout.total_size), dtype=dtype)
    want = _rounded(np.subtract, packed.numpy(), snapshot.numpy())
    got = ops.pack(variables, layout, snapshot).numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ops.pack(tensors, layout, snapshot).numpy(),
                                  want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_assign_and_add_match_split(device, dtype):
    rng = np.random.default_rng(2)
    variables = _variables(rng, PACK_SHAPES, dtype)
    layout = ops.PackLayout(variables)
    before = [v.numpy() for v in variables]
    buffer = tf.constant(rng.standard_normal(layout.total_size), dtype=dtype)
    pieces = tf.split(buffer, layout.sizes)
    ops.unpack(buffer, variables, layout, mode="add")
    for v, old, piece in zip(variables, before, pieces):
        want = _rounded(np.add, old, piece.numpy().reshape(old.shape))
        np.testing.assert_array_equal(v.numpy(), want)
    ops.unpack(buffer, variables, layout)
    for v, piece, shape in zip(variables, pieces, layout.shapes):
        np.testing.assert_array_equal(v.numpy(),
                                      tf.reshape(piece, shape).numpy())
    # Round trip through tf.function.
    doubled = tf.function(
        lambda: ops.unpack(ops.pack(variables, layout) * 2, variables, layout))
    doubled()
    np.testing.assert_array_equal(_np(ops.pack(variables, layout)),
                                  2 * _np(buffer))


def test_unpack_keeps_earlier_reads(device):
    """Copy-on-write: a value read before an in-place write keeps its value."""
    variable = tf.Variable(tf.zeros([4, 2]))
    read = variable.read_value()
    layout = ops.PackLayout([variable])
    ops.unpack(tf.ones([8]), [variable], layout, mode="add")
    ops.scatter_add_rows(variable, [0], [[5.0, 5.0]])
    np.testing.assert_array_equal(read.numpy(), np.zeros([4, 2]))
    np.testing.assert_array_equal(variable.numpy()[0], [6.0, 6.0])


def test_pack_layout_mismatches_are_invalid_argument(device):
    a, b = tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([3]))
    wrong = ops.PackLayout([(2, 2), (4,)])
    with pytest.raises(INVALID, match=r"variable 1 has shape \[3\] \(3 "
                       r"elements\) but the layout gives it 4 elements"):
        ops.pack([a, b], wrong)
    a.assign(tf.ones([2, 2]))
    with pytest.raises(INVALID, match="variable 1 has shape"):
        ops.unpack(tf.fill([8], 9.0), [a, b], wrong)
    np.testing.assert_array_equal(a.numpy(), np.ones([2, 2]))  # untouched
    layout = ops.PackLayout([a, b])
    with pytest.raises(INVALID, match="buffer has shape \\[6\\] but the "
                       "layout needs a vector of 7 elements"):
        ops.unpack(tf.zeros([6]), [a, b], layout)
    with pytest.raises(INVALID, match="snapshot has shape"):
        ops.pack([a, b], layout, snapshot=tf.zeros([5]))
    with pytest.raises(INVALID, match="variables 0 and 1 are the same"):
        ops.unpack(tf.zeros([8]), [a, a], ops.PackLayout([a, a]))
    c = tf.Variable(tf.zeros([3], tf.float64))
    with pytest.raises(INVALID, match="variable 1 has dtype double"):
        ops.pack([a, c], ops.PackLayout([(2, 2), (3,)], dtype=tf.float32))
    with pytest.raises(ValueError, match="2 segments but 1 variables"):
        ops.pack([a], layout)
    with pytest.raises(ValueError, match="share one dtype"):
        ops.PackLayout([a, c])
    with pytest.raises(ValueError, match="'assign' or 'add'"):
        ops.unpack(tf.zeros([7]), [a, b], layout, mode="sub")


def test_pack_layout_refuses_a_single_item_and_dtypes_pack_cannot_take():
    """One variable or one shape given bare would be read as its rows or
    its dimensions: refused, as is a dtype pack / unpack do not take."""
    variable = tf.Variable(tf.zeros([3, 2]))
    for bare in [(4, 5), variable, tf.zeros([3]), tf.TensorShape([2]), "ab"]:
        with pytest.raises(TypeError, match="a list of variables or shapes"):
            ops.PackLayout(bare)
    assert ops.PackLayout([(4, 5)]).shapes == ((4, 5),)
    assert ops.PackLayout([variable]).sizes == (6,)
    assert ops.PackLayout([()]).total_size == 1
    for dtype in [tf.int32, tf.string, tf.complex64]:
        with pytest.raises(TypeError, match="dtype must be one of"):
            ops.PackLayout([(2,)], dtype=dtype)
    with pytest.raises(TypeError, match="not int64"):
        ops.PackLayout([tf.Variable(tf.zeros([2], tf.int64))])


@pytest.mark.parametrize("dtype", DTYPES + [tf.int32, tf.int64, tf.uint8])
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4), (200, 1000)])
def test_swap_out_and_in_copy_exactly(dtype, shape):
    rng = np.random.default_rng(3)
    value = tf.cast(tf.constant(rng.integers(0, 100, size=shape)), dtype)
    host = ops.swap_out(value)
    assert host.dtype == dtype and host.shape == shape
    assert "CPU" in host.device
    back = ops.swap_in(host)
    np.testing.assert_array_equal(host.numpy(), value.numpy())
    np.testing.assert_array_equal(back.numpy(), value.numpy())
    roundtrip = tf.function(lambda x: ops.swap_in(ops.swap_out(x)))
    np.testing.assert_array_equal(roundtrip(value).numpy(), value.numpy())


@pytest.mark.needs_gpu
def test_swap_moves_between_gpu_and_host():
    with tf.device("/GPU:0"):
        value = tf.random.stateless_normal([1000, 100], seed=[5, 6])
        host = ops.swap_out(value)
        back = ops.swap_in(host)
    assert "CPU" in host.device and "GPU" in back.device
    np.testing.assert_array_equal(back.numpy(), value.numpy())


def test_concurrent_scatter_adds_lose_nothing():
    rows, width, calls, threads = 64, 256, 15, 8
    variable = tf.Variable(tf.zeros([rows, width]))
    plans = [np.random.default_rng(t).integers(0, rows, size=(calls, 512))
             for t in range(threads)]
    errors = []

    def worker(plan):
        try:
            for indices in plan:
                ops.scatter_add_rows(variable, indices,
                                     tf.ones([len(indices), width]))
        except Exception as exc:  # reported below, not swallowed
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(p,)) for p in plans]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in pool)
    counts = np.bincount(np.concatenate([p.ravel() for p in plans]),
                         minlength=rows)
    np.testing.assert_array_equal(variable.numpy(),
                                  np.repeat(counts[:, None], width, axis=1))


def test_keras_fit_step_with_gather_pack_and_unpack():
    keras = pytest.importorskip("keras")

    class Lookup(keras.layers.Layer):
        """An embedding whose read is ops.gather_rows (or tf.gather)."""

        def __init__(self, gather, **kwargs):
            super().__init__(**kwargs)
            self.gather = gather

        def build(self, input_shape):
            self.table = self.add_weight(
                shape=(10, 4), initializer=keras.initializers.RandomNormal(
                    seed=1), name="table")

        def call(self, ids):
            return self.gather(self.table, tf.reshape(ids, [-1]))

    class MirroredModel(keras.Model):
        """Each step packs the update it made and adds it into a mirror."""

        def train_step(self, data):
            x, y = data
            snapshot = ops.pack(self.trainable_variables, self.layout)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            delta = ops.pack(self.trainable_variables, self.layout, snapshot)
            ops.unpack(delta, self.mirror, self.layout, mode="add")
            return {"loss": loss}

    def make(gather, cls):
        ids = keras.Input(shape=(1,), dtype="int32")
        hidden = Lookup(gather)(ids)
        out = keras.layers.Dense(1, kernel_initializer=keras.initializers
                                 .GlorotUniform(seed=2))(hidden)
        model = cls(ids, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      jit_compile=False)
        return model

    rng = np.random.default_rng(4)
    x = rng.integers(0, 10, size=(64, 1)).astype(np.int32)
    y = rng.standard_normal((64, 1)).astype(np.float32)
    ours = make(ops.gather_rows, MirroredModel)
    ours.layout = ops.PackLayout(ours.trainable_variables)
    ours.mirror = [tf.Variable(v.numpy()) for v in ours.trainable_variables]
    theirs = make(tf.gather, keras.Model)
    theirs.set_weights(ours.get_weights())
    start = ours.get_weights()
    history = ours.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    theirs.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert len(history.history["loss"]) == 2
    for a, b, s in zip(ours.get_weights(), theirs.get_weights(), start):
        assert not np.allclose(a, s)  # it trained
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for mirror, weight in zip(ours.mirror, ours.trainable_variables):
        np.testing.assert_allclose(mirror.numpy(), weight.numpy(), atol=1e-5)


def test_library_is_cached_and_loaded_from_cache():
    path = ops.library_path()
    assert pathlib.Path(path).is_file()
    info = _build.build_info(path)
    assert info["tf_version"] == tf.__version__
    mtime = os.path.getmtime(path)
    assert _build.build(cuda=info["cuda"]) == path  # cached: no rebuild
    assert os.path.getmtime(path) == mtime


def test_pruning_removes_older_builds_and_killed_builds_staging(tmp_path):
    for name in ("tf2.21.0-cpu-old", "tf2.21.0-cpu-new",
                 ".tf2.21.0-cpu-new-killed1", ".tf2.21.0-cpu-old-killed2",
                 ".old-tf2.21.0-cpu-new-x", "tf2.21.0-cuda-other"):
        (tmp_path / name).mkdir()
    (tmp_path / "tf2.21.0-cpu-old.lock").touch()
    (tmp_path / "tf2.21.0-cpu-new.lock").touch()
    _build._prune_stale(tmp_path, "tf2.21.0-cpu-new")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tf2.21.0-cpu-new", "tf2.21.0-cpu-new.lock", "tf2.21.0-cuda-other"]


def _python(code, env_extra, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3",
               **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_failed_build_fails_import_with_the_reason(tmp_path):
    proc = _python("import keras_geeps.ops",
                   {"KERAS_GEEPS_OPS_DIR": str(tmp_path), "CXX": "false",
                    "KERAS_GEEPS_CUDA": "0"})
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert "python -m keras_geeps._build --force" in proc.stderr
    assert "$ false " in proc.stderr  # the failing command is shown


def test_a_missing_compiler_is_a_build_error_naming_it(tmp_path, monkeypatch,
                                                       capsys):
    """No compiler at $CXX: BuildError (what `ops._load` and the build-ops
    command catch), not FileNotFoundError; nothing is compiled."""
    missing = str(tmp_path / "no-such-g++")
    monkeypatch.setenv("CXX", missing)
    monkeypatch.setenv("KERAS_GEEPS_OPS_DIR", str(tmp_path / "ops"))
    monkeypatch.setenv("KERAS_GEEPS_CUDA", "0")
    with pytest.raises(_build.BuildError,
                       match=re.escape(f"cannot run the compiler "
                                       f"'{missing}'")):
        _build.build(force=True)
    assert _build.main(["--force", "--no-cuda"]) == 1
    assert f"cannot run the compiler '{missing}'" in capsys.readouterr().err
    # the staging folder is gone; only the lock file stays
    assert [p.suffix for p in (tmp_path / "ops").iterdir()] == [".lock"]
    proc = _python("import keras_geeps.ops",
                   {"KERAS_GEEPS_OPS_DIR": str(tmp_path / "ops"),
                    "CXX": missing, "KERAS_GEEPS_CUDA": "0"})
    assert "ImportError" in proc.stderr, proc.stderr[-3000:]
    assert f"cannot run the compiler '{missing}'" in proc.stderr


@pytest.mark.skipif(_build.find_nvcc() is None, reason="no nvcc")
@pytest.mark.parametrize("source", ["gather_scatter_gpu.cu.cc",
                                    "pack_gpu.cu.cc"])
def test_cuda_sources_compile_with_nvcc(tmp_path, source):
    path = _build.sources_dir() / "cc" / "kernels" / source
    proc = subprocess.run(
        [_build.find_nvcc(), "-x", "cu", "-std=c++17", "-O1", "-Xcompiler",
         "-fPIC", "-gencode", "arch=compute_90,code=sm_90", "-c", str(path),
         "-o", str(tmp_path / "out.o")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(_build.find_nvcc() is None, reason="no nvcc")
def test_cuda_build_loads_and_runs_cpu_kernels_without_a_gpu():
    # Cached when the default build already has CUDA (nvcc present);
    # otherwise this compiles it once.
    path = _build.build(cuda=True)
    info = _build.build_info(path)
    assert info["cuda"] is True and info["cuda_version"]
    # Its kernels use the CUDA runtime linked into it, of the version they
    # were compiled for, not the runtime stub TensorFlow's library exports
    # (another CUDA version): no cuda* symbol is left for that one.
    nm = subprocess.run(["nm", "-D", "--undefined-only", path],
                        capture_output=True, text=True, check=True)
    undefined = [line.split()[-1] for line in nm.stdout.splitlines()]
    assert not [s for s in undefined if s.lstrip("_").startswith("cuda")], \
        undefined
    proc = _python(
        "import numpy as np, tensorflow as tf\n"
        "from keras_geeps import _build, ops\n"
        f"assert ops.library_path() == {path!r}, ops.library_path()\n"
        "with tf.device('/CPU:0'):\n"
        "    t = tf.Variable(tf.reshape(tf.range(12.0), [4, 3]))\n"
        "    ops.scatter_add_rows(t, [1, 1], tf.ones([2, 3]))\n"
        "    got = ops.gather_rows(t, [1, 3]).numpy()\n"
        "np.testing.assert_array_equal(got, [[5, 6, 7], [9, 10, 11]])\n"
        "print('ok')\n",
        {"KERAS_GEEPS_CUDA": "1"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.float64])
def test_pack_delta_into_writes_the_scaled_delta_in_place(dtype):
    rng = np.random.default_rng(5)
    variables = _variables(rng, PACK_SHAPES, dtype)
    layout = ops.PackLayout(variables)
    snapshot = tf.constant(rng.standard_normal(layout.total_size), dtype=dtype)
    # One element in: memory from DLPack need not be 64-byte aligned.
    out = np.full(layout.total_size + 1, 7, dtype.as_numpy_dtype)[1:]
    alias = tf.experimental.dlpack.from_dlpack(out.__dlpack__())
    want = _rounded(np.subtract, ops.pack(variables, layout).numpy(),
                    snapshot.numpy())
    ops.pack_delta_into(variables, layout, snapshot, alias)
    np.testing.assert_array_equal(out, want)
    ops.pack_delta_into(variables, layout, snapshot, alias, scale=0.25)
    np.testing.assert_array_equal(out, want * dtype.as_numpy_dtype(0.25))


def test_pack_delta_into_refuses_bad_calls():
    variables = [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([3]))]
    layout = ops.PackLayout(variables)
    snapshot = tf.zeros([7])
    small = np.zeros(6, np.float32)
    with pytest.raises(INVALID, match="out has shape"):
        ops.pack_delta_into(variables, layout, snapshot,
                            tf.experimental.dlpack.from_dlpack(
                                small.__dlpack__()))
    with pytest.raises(TypeError, match="resource variables"):
        ops.pack_delta_into([tf.zeros([2, 2]), tf.zeros([3])], layout,
                            snapshot, tf.zeros([7]))
    with pytest.raises(ValueError, match="eagerly"):
        tf.function(lambda: ops.pack_delta_into(
            variables, layout, snapshot, tf.zeros([7])))()
    # An `out` TensorFlow would convert is a copy the op would write, the
    # caller's memory left as it was (a numpy array not 64-byte aligned,
    # another dtype): refused.
    target = np.zeros(8, np.float32)[1:]
    with pytest.raises(TypeError, match="__dlpack__"):
        ops.pack_delta_into(variables, layout, snapshot, target)
    with pytest.raises(TypeError, match="out is float64"):
        ops.pack_delta_into(variables, layout, snapshot,
                            tf.zeros([7], tf.float64))
    values = [tf.ones([2, 2]), tf.ones([3])]
    with pytest.raises(TypeError, match="__dlpack__"):
        ops.pack_tensors_into(values, layout, target, [1.0, 1.0])
    with pytest.raises(TypeError, match="out is float64"):
        ops.pack_tensors_into(values, layout, tf.zeros([7], tf.float64),
                              [1.0, 1.0])
    assert not target.any()


@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_pack_delta_into_streams_large_float_updates(scale):
    """Above 4 MB float32 takes the streaming-store path: same numbers."""
    rng = np.random.default_rng(6)
    variables = _variables(rng, [(1000, 1100), (3,), (7, 33)], tf.float32)
    layout = ops.PackLayout(variables)
    snapshot = tf.constant(rng.standard_normal(layout.total_size),
                           dtype=tf.float32)
    out = np.zeros(layout.total_size + 3, np.float32)[3:]  # misaligned
    ops.pack_delta_into(variables, layout, snapshot,
                        tf.experimental.dlpack.from_dlpack(out.__dlpack__()),
                        scale=scale)
    delta = ops.pack(variables, layout).numpy() - snapshot.numpy()
    np.testing.assert_array_equal(out, delta * np.float32(scale))
    # PackDelta streams its output too.
    np.testing.assert_array_equal(
        ops.pack(variables, layout, snapshot).numpy(), delta)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.float64])
@pytest.mark.parametrize("shapes",
                         [PACK_SHAPES, [(1000, 1100), (3,), (7, 33)]],
                         ids=["small", "streamed"])
def test_pack_tensors_into_writes_each_segment_times_its_scale(dtype, shapes):
    """Small and >4 MB (streaming stores for float32) layouts, misaligned
    destination, a scale per segment: the numpy product, bit for bit."""
    rng = np.random.default_rng(7)
    values = [tf.constant(rng.standard_normal(s), dtype=dtype) for s in shapes]
    layout = ops.PackLayout(values)
    scales = [(-1.0, 0.5, 1 / 3)[i % 3] for i in range(len(shapes))]
    out = np.full(layout.total_size + 1, 7, dtype.as_numpy_dtype)[1:]
    ops.pack_tensors_into(values, layout,
                          tf.experimental.dlpack.from_dlpack(out.__dlpack__()),
                          scales)
    # Reference: scales are float32 attributes; float64 multiplies in
    # float64, the others in float32 (as TensorFlow's half kernels do),
    # then round to the dtype.
    acc = np.float64 if dtype == tf.float64 else np.float32
    kind = dtype.as_numpy_dtype
    want = np.concatenate([
        (v.numpy().astype(acc) * acc(np.float32(s))).astype(kind).reshape(-1)
        for v, s in zip(values, scales)])
    np.testing.assert_array_equal(out, want)


def test_pack_tensors_into_refuses_bad_calls():
    values = [tf.zeros([2, 2]), tf.zeros([3])]
    layout = ops.PackLayout(values)
    out = tf.zeros([7])
    with pytest.raises(ValueError, match="one scale per segment"):
        ops.pack_tensors_into(values, layout, out, [1.0])
    with pytest.raises(INVALID, match="out has shape"):
        ops.pack_tensors_into(values, layout, tf.zeros([6]), [1.0, 1.0])
    with pytest.raises(INVALID, match="layout gives it 3 elements"):
        ops.pack_tensors_into([tf.zeros([2, 2]), tf.zeros([4])], layout, out,
                              [1.0, 1.0])
    with pytest.raises(ValueError, match="eagerly"):
        tf.function(lambda: ops.pack_tensors_into(values, layout, out,
                                                  [1.0, 1.0]))()


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.float64])
@pytest.mark.parametrize("shapes",
                         [PACK_SHAPES, [(1000, 1100), (3,), (7, 33)]],
                         ids=["small", "streamed"])
def test_pack_tensors_into_adds_a_base(dtype, shapes):
    """out = base + values * scales: the numpy reference, bit for bit."""
    rng = np.random.default_rng(8)
    values = [tf.constant(rng.standard_normal(s), dtype=dtype) for s in shapes]
    layout = ops.PackLayout(values)
    base = tf.constant(rng.standard_normal(layout.total_size), dtype=dtype)
    scales = [(-0.5, 1.0, 0.25)[i % 3] for i in range(len(shapes))]
    out = np.zeros(layout.total_size + 1, dtype.as_numpy_dtype)[1:]
    ops.pack_tensors_into(values, layout,
                          tf.experimental.dlpack.from_dlpack(out.__dlpack__()),
                          scales, base=base)
    acc = np.float64 if dtype == tf.float64 else np.float32
    scaled = np.concatenate([v.numpy().astype(acc).reshape(-1) * acc(s)
                             for v, s in zip(values, scales)])
    want = (base.numpy().astype(acc) + scaled).astype(dtype.as_numpy_dtype)
    np.testing.assert_array_equal(out, want)
    with pytest.raises(INVALID, match="base has shape"):
        ops.pack_tensors_into(values, layout, tf.zeros_like(base), scales,
                              base=base[1:])


def test_layouts_past_int64_or_not_the_inputs_are_refused_naming_why():
    """Sizes adding up past int64 are refused (the kernel once built a
    negative shape and aborted the process: run in a child), and a layout
    bigger than its inputs names the input rather than failing to
    allocate the buffer its sizes make up."""
    proc = _python(
        "import tensorflow as tf\n"
        "from keras_geeps import ops\n"
        "huge = ops.PackLayout([(2**62,), (2**62,)])\n"
        "cases = [([tf.Variable(tf.zeros([2])), tf.Variable(tf.zeros([2]))],"
        " huge), ([tf.zeros([2]), tf.zeros([2])], huge),\n"
        "         ([tf.Variable(tf.zeros([2]))], ops.PackLayout([(2**62,)])),"
        "\n         ([tf.zeros([2])], ops.PackLayout([(2**62,)]))]\n"
        "for inputs, layout in cases:\n"
        "    try:\n"
        "        ops.pack(inputs, layout)\n"
        "    except tf.errors.InvalidArgumentError as exc:\n"
        "        print('refused:', exc.message.splitlines()[0])\n", {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = [line for line in proc.stdout.splitlines()
               if line.startswith("refused:")]
    assert len(refused) == 4, proc.stdout
    for line in refused[:2]:
        assert "the layout's sizes add up to more than " \
               "9223372036854775807 elements (at sizes[1]" in line
    for line in refused[2:]:
        assert "variable 0 has shape [2] (2 elements) but the layout gives " \
               "it 4611686018427387904 elements" in line


def test_a_layout_of_keras_variables_has_their_dtype_under_autocast():
    """Inside an autocast scope a keras.Variable reads as float16; its
    layout still takes the variable's own float32, so pack and unpack of
    it work there."""
    import keras  # noqa: PLC0415
    from keras.src.backend import AutocastScope  # noqa: PLC0415
    kernel = keras.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    with AutocastScope("float16"):
        assert kernel.value.dtype == tf.float16
        layout = ops.PackLayout([kernel])
        assert layout.dtype == tf.float32
        np.testing.assert_array_equal(ops.pack([kernel], layout).numpy(),
                                      np.arange(6))
        # With a tensor beside it (the tensors' path): its own float32
        # values, not a float16 copy (1.0001 has no float16).
        kernel.assign(np.full((2, 3), 1.0001, np.float32))
        mixed = ops.PackLayout([kernel, (1,)])
        want = np.float32([1.0001] * 6 + [2])
        np.testing.assert_array_equal(
            ops.pack([kernel, tf.constant([2.0])], mixed).numpy(), want)
        out = np.zeros(7, np.float32)
        ops.pack_tensors_into([kernel, tf.constant([2.0])], mixed,
                              tf.experimental.dlpack.from_dlpack(
                                  out.__dlpack__()), [1.0, 1.0])
        np.testing.assert_array_equal(out, want)
        ops.unpack(tf.ones([6]), [kernel], layout)
    np.testing.assert_array_equal(kernel.numpy(), np.ones((2, 3)))


def test_the_build_key_follows_the_build_and_its_compiler(monkeypatch):
    """A changed compiler (CXX) or build script gets a new library, not
    the one built before."""
    monkeypatch.delenv("CXX", raising=False)
    key = _build.build_key(False)
    monkeypatch.setenv("CXX", "clang++")
    assert _build.build_key(False) != key
    monkeypatch.delenv("CXX")
    real = pathlib.Path.read_bytes
    script = pathlib.Path(_build.__file__)

    def edited(path):
        data = real(path)
        return data + b"# -O0\n" if path == script else data

    monkeypatch.setattr(pathlib.Path, "read_bytes", edited)
    assert _build.build_key(False) != key


_UNALIGNED_VARIABLE = """
import gc, numpy as np, tensorflow as tf
from keras_geeps import ops
base = np.zeros(64 + 16, np.float32)
off = (-base.ctypes.data // 4) % 16 + 1  # 4 bytes past a 64-byte boundary
caller = base[off:off + 12]
caller[:] = np.arange(12)
v = tf.Variable(tf.zeros([4, 3]))
t = tf.reshape(tf.experimental.dlpack.from_dlpack(caller.__dlpack__()),
               [4, 3])
v.assign(t)  # the variable keeps the caller's memory
del t
gc.collect()
layout = ops.PackLayout([v])
expected = np.arange(12, dtype=np.float32)
np.testing.assert_array_equal(ops.pack([v], layout).numpy(), expected)
out = np.zeros(12, np.float32)
ops.pack_delta_into([v], layout, tf.ones([12]),
                    tf.experimental.dlpack.from_dlpack(out.__dlpack__()))
np.testing.assert_array_equal(out, expected - 1)
ops.unpack(tf.ones([12]), [v], layout, mode="add")
expected += 1
np.testing.assert_array_equal(v.numpy().ravel(), expected)
ops.scatter_add_rows(v, [1, 1], tf.ones([2, 3]))
expected[3:6] += 2
np.testing.assert_array_equal(v.numpy().ravel(), expected)
print("exact")
"""


def test_ops_on_a_variable_holding_unaligned_caller_memory():
    """A variable assigned a tensor from DLPack keeps that memory, aligned
    only as its allocator chose: Pack, PackDeltaInto, Unpack and
    ScatterAddRows read and write it through plain pointers (Tensor::flat
    aborted the process on Eigen's 64-byte alignment check)."""
    proc = _python(_UNALIGNED_VARIABLE, {})
    assert proc.returncode == 0 and "exact" in proc.stdout, \
        (proc.returncode, proc.stderr[-3000:])


def test_a_tensor_of_handles_is_refused_where_one_variable_is_meant():
    """Shape functions do not run eagerly: the kernels check that a
    variable input is one handle, not take the first of several."""
    v = tf.Variable(tf.ones([4, 3]))
    handles = tf.stack([v.handle, v.handle])
    for call in (
            lambda: ops._gen.geeps_resource_gather_rows(
                handles, [0], dtype=tf.float32),
            lambda: ops._gen.geeps_resource_scatter_add_rows(
                handles, [0], tf.ones([1, 3])),
            lambda: ops._gen.geeps_pack([handles], dtype=tf.float32,
                                        sizes=[12])):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"must be one variable's handle \(a "
                                 r"scalar\), got a tensor of handles of "
                                 r"shape \[2\]"):
            call()
    np.testing.assert_array_equal(v.numpy(), 1.0)
