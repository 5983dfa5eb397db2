"""Keeps a model's variables in step with the shards, one table per layer.

GeePS keeps each layer's parameters as one table of fixed-width rows. Here
a layer's trainable variables become one table; every step the worker
*pulls* each table (waits until it is as fresh as the slack requires, then
assigns it into the variables with one `unpack` op), runs the step with its
own optimizer, and *pushes* the step's additive update (one `pack` op
computing `value - snapshot`), then clocks the table. Pushes are issued in
reverse layer order so the last layers' updates leave while the earlier
layers are still in backprop. Under BSP the update is instead taken from the
optimizer before it reaches the variables (`capture.UpdateCapture`); when
this worker is a table's only writer, the push writes the pulled rows plus
that update into a buffer the shard lends (`GeePSClient.lend_target`), and
the shard adds nothing.

The pulls and pushes are `tf.py_function`s placed in the compiled train step
itself, so they run at every step, `steps_per_execution` included.
"""

import functools
import logging
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from keras_geeps import ops, protocol
from keras_geeps.errors import GeePSError
from keras_geeps.keras import _tf_hooks, initial_values
from keras_geeps.keras.capture import UpdateCapture, variable_name

log = logging.getLogger(__name__)

MAX_ROW_WIDTH = 1024  # elements per row, at most
# Layers smaller than this leave with the next layer's push (one
# py_function call costs ~0.1-0.3 ms; a bias-sized layer is not worth it).
MIN_PUSH_BYTES = 1 << 20
_BFLOAT16 = np.dtype(tf.bfloat16.as_numpy_dtype)  # ml_dtypes' bfloat16


def row_width(total, max_width=MAX_ROW_WIDTH):
    """The widest row width <= max_width that divides `total` exactly.

    Rows of a table have one fixed width; choosing a divisor means a layer's
    packed buffer is exactly rows * width elements, with no padding copy.

    Args:
        total: number of elements of the table.
        max_width: the widest row allowed. Defaults to 1024.

    Example:

    >>> row_width(784 * 128 + 128)
    1004
    """
    if total <= max_width:
        return max(1, total)
    best = 1
    for d in range(1, int(total ** 0.5) + 1):
        if total % d == 0:
            for w in (d, total // d):
                if best < w <= max_width:
                    best = w
    return best


def layer_name(variable, keras_path=None):
    """The layer path of a variable: of its Keras path if it has one
    ('model/dense/kernel' -> 'model/dense'), else of its TF name
    ('model/dense/kernel:0' -> 'model/dense')."""
    name = keras_path or variable.name.split(":")[0]
    return name.rsplit("/", 1)[0] if "/" in name else name


def as_tensor(array, dtype=None):
    """A CPU tensor sharing `array`'s memory (DLPack; must be 64-B aligned).

    `tf.convert_to_tensor` copies; at ~40 MB per step that copy is a
    measurable part of a step. DLPack has no bfloat16 for numpy: such an
    array travels as its uint16 view and is bitcast back (no copy either).

    Args:
        array: a 64-byte aligned numpy array.
        dtype: the numpy dtype of its elements, when `array` may be an
            untyped view of them (shared memory hands bfloat16 rows out as
            'V2'). Defaults to None: `array.dtype`.
    """
    if dtype is not None and array.dtype != dtype:
        array = array.view(dtype)
    if array.dtype == _BFLOAT16:
        return tf.bitcast(as_tensor(array.view(np.uint16)), tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def as_host_array(tensor):
    """A numpy view of a CPU tensor (DLPack), a copy for other devices.

    `Tensor.numpy()` copies; the client sends the view without a copy and
    holds it (and so the tensor) until ZeroMQ is done with it. A bfloat16
    tensor is viewed through its uint16 bitcast.
    """
    if "CPU" not in tensor.device.upper():
        return tensor.numpy()
    if tensor.dtype == tf.bfloat16:
        return np.from_dlpack(tf.bitcast(tensor, tf.uint16)).view(_BFLOAT16)
    return np.from_dlpack(tensor)


def _ids(variables):
    """The ids of the tf.Variables of `variables` (tf or keras.Variables)."""
    return {id(v._value if isinstance(v, keras.Variable) else v)
            for v in variables}


class LayerTable:
    """One layer's variables, their pack layout, and their client table."""

    def __init__(self, name, variables, table, layout):
        self.name = name
        self.variables = variables
        self.table = table
        self.layout = layout
        self.snapshot = None       # tensor: the variables after the pull
        self.snapshot_stale = False  # variables changed since the snapshot
        self.pulled_ages = None
        self.on_cpu = all("CPU" in v.device.upper() for v in variables)
        # Pushed by a train step since the last pull: the variables may
        # trail the shards (a captured update is not in them; a measured
        # one is in them unscaled, without the other workers').
        self.behind = False
        # Written eagerly since the last pull (a callback's set_weights):
        # the next push measures the update, captured or not.
        self.written_outside = False
        # A function traced outside the steps writes it: every push is
        # measured (`ParameterSync.note_traced_write`).
        self.written_by_functions = False
        # Under "sum": the change written outside the steps since the pull,
        # measured at the step's pull (`ParameterSync._measure_outside`).
        self.outside_change = None
        # Pushed with a measured update (the variables hold it): at the
        # first eager write since, their packed values then, so that the
        # next pull can tell the write from the step's own update (the
        # layer-wise trainer's steps pull at their start, not their end).
        self.measured_push = False
        self.before_write = None
        self.pulled_shared = None  # the pulled shard rows, if shared
        self._reads = _BufferPair(layout.total_size, table.dtype)
        self._uploads = _BufferPair(layout.total_size, table.dtype)

    def let_go(self):
        """Drops the variables, rows and buffers (the sync is closing)."""
        self.variables = ()
        self.snapshot = self.pulled_shared = self.outside_change = None
        self._reads = _BufferPair(self.layout.total_size, self.table.dtype)
        self._uploads = _BufferPair(self.layout.total_size, self.table.dtype)

    def next_buffer(self):
        """A host buffer to read rows into (not the last one handed out)."""
        return self._reads.next()

    def take_back_buffer(self):
        """Undoes the last `next_buffer` (a read into it failed)."""
        self._reads.take_back()

    def next_upload(self):
        """A host buffer for a captured update (when no shard lends one)."""
        return self._uploads.next().reshape(self.table.rows, self.table.width)


class _BufferPair:
    """Two 64-byte aligned 1-D buffers, handed out in turn (allocated at the
    first use): the one handed out last stays untouched meanwhile."""

    def __init__(self, size, dtype):
        self.size, self.dtype = size, dtype
        self._buffers = None
        self._next = 0

    def next(self):
        if self._buffers is None:
            self._buffers = [protocol.aligned_empty(self.size, self.dtype)
                             for _ in range(2)]
        buffer = self._buffers[self._next]
        self._next ^= 1
        return buffer

    def take_back(self):
        """Undoes the last `next` (its buffer was not used after all), so
        the one handed out before stays untouched."""
        self._next ^= 1


def check_update_mode(update_mode):
    """Raises ValueError unless `update_mode` is "average" or "sum"."""
    if update_mode not in ("average", "sum"):
        raise ValueError(f"update_mode must be 'average' or 'sum', not "
                         f"{update_mode!r}")


class ParameterSync:
    """Moves a model's variables to and from the shards around each step.

    Args:
        client: the worker's `GeePSClient`.
        update_mode: "average" (default) divides each worker's update by
            the number of workers, so N workers with per-worker batch B
            under plain SGD behave like one worker with batch N * B;
            "sum" adds the updates as they are. A change written outside
            the steps (a callback's, on every worker) goes as the workers'
            mean in either mode.
        max_row_width: widest table row. Defaults to 1024.
        capture_updates: under BSP, push CPU layers' updates taken from the
            optimizer rather than measured on the variables (see
            `keras_geeps.keras.capture`). Defaults to True.
    """

    def __init__(self, client, update_mode="average",
                 max_row_width=MAX_ROW_WIDTH, capture_updates=True):
        check_update_mode(update_mode)
        self.client = client
        self.update_mode = update_mode
        self.scale = 1.0 / client.num_workers if update_mode == "average" \
            else 1.0
        # A write outside the steps (a callback's) is every worker's, as
        # Keras runs each callback on every worker: the shards get the
        # workers' mean change, whatever the update mode.
        self.outside_scale = 1.0 / client.num_workers
        self.max_row_width = max_row_width
        self.tables = []
        self._layer_of = {}        # id(tf.Variable) -> its LayerTable
        # ids of tf.Variables a function traced outside the steps writes,
        # noted before their table was built (`note_traced_write`)
        self._traced_writes = set()
        self._candidates = []
        # TF name -> how many trainable variables with no Keras path had it
        # (eager TF names every unnamed one 'Variable'): `_unique_path`
        self._tf_names = {}
        self._constants = []       # non-trainable ones (initial_values)
        # ids of those restored before the build (`note_outside_write`):
        # load_weights, set_weights, BackupAndRestore; they are kept
        self._constants_written = set()
        self._updated = None
        self.capture_updates = capture_updates
        self._capture = None       # the UpdateCapture of the step traced now
        self.captured_layers = []  # layers the last train step captures
        if capture_updates:
            _tf_hooks.install_update_capture()
        _tf_hooks.install_write_watch()
        self.lock = threading.Lock()
        self.pull_wait_seconds = 0.0
        self.pull_seconds = 0.0
        self.push_seconds = 0.0
        self.steps = 0             # steps pushed
        self.max_staleness = 0     # most clocks a read lagged its clock
        # pushes of captured layers measured instead (note_outside_write)
        self.outside_write_pushes = 0
        # Keras' fits running on this sync (`_tf_hooks`): their callbacks
        # catch the variables up; steps outside any end by doing so.
        self.fitting = 0
        self.closed = False
        # What the pull / push ops raised: tf.py_function hands TensorFlow
        # only the message, so `_tf_hooks` re-raises these (take_failure).
        self._failures = []
        _tf_hooks.track_sync(self)

    @property
    def built(self):
        return bool(self.tables)

    def close(self):
        """Lets go of the model's variables and every table's rows and
        buffers (`GeePSStrategy.close`): a step traced through this sync
        keeps it alive as long as TensorFlow keeps that function's graph,
        but nothing of the model. A pull or push after raises."""
        self.closed = True
        _tf_hooks.release_sync(self)
        for layer in self.tables:
            layer.let_go()
        self._layer_of = {}
        self._candidates = []
        self._constants = []
        self._constants_written = set()

    def _check_open(self):
        if self.closed:
            raise GeePSError("the strategy was closed: its steps pull and "
                             "push nothing any more")

    @property
    def clock(self):
        """This worker's clock of its parameter tables (they clock
        together: one per step), or None before they are built. A table
        the steps no longer clock (a layer frozen after it was created in
        the scope: its table stays at the clock it had) does not hold it
        back (`stepped_tables`)."""
        stepped = self.stepped_tables()
        return min(table.clock for table in stepped) if stepped else None

    def stepped_tables(self):
        """The parameter tables the training steps clock: all but those
        more than one clock behind the furthest (within one: in the middle
        of a step, which clocks one table after another)."""
        tables = [layer.table for layer in self.tables]
        if not tables:
            return []
        furthest = max(table.clock for table in tables)
        return [table for table in tables if table.clock >= furthest - 1]

    # --------------------------------------------------- strategy hooks
    def track_variable(self, variable, trainable, keras_path=None,
                       layer_weight=False):
        """Called for every variable created in the strategy's scope.

        A trainable one (floating-point: `GeePSExtended` passes an integer
        one, which takes no gradient, as not trainable) gets a table at the
        next step, also when created
        after the first tables (a second model, a new head): one table per
        layer, named by `keras_path` (its Keras variable's path) when it
        has one, else by its TF name. A non-trainable `layer_weight` (a
        Keras layer's, not an optimizer's or a metric's) gets worker 0's
        value at that build (`initial_values`).
        """
        if trainable:
            if keras_path is None:
                keras_path = self._unique_path(variable)
            self._candidates.append((variable, keras_path))
        elif layer_weight and not tf.inside_function():
            # Worker 0's starting value, shared at the next build. Not one
            # a traced step creates (a model built lazily): it may have
            # changed by the build after.
            self._constants.append(variable)

    def _unique_path(self, variable):
        """The table path of a trainable tf.Variable that is no Keras
        one: its TF name, with '_<n>' added to the n-th repeat of a name in
        creation order (as Keras names its own), which is the same on
        every worker running the same program; None for the first."""
        name = variable.name.split(":")[0]
        seen = self._tf_names.get(name, 0)
        self._tf_names[name] = seen + 1
        return f"{name}_{seen}" if seen else None

    def not_held(self, variables):
        """The ones of `variables` (tf or keras.Variables) that no
        parameter table holds, nor will at the next build: a table holds
        those created trainable in the scope, whatever their `trainable`
        says now (LoRA's frozen kernel)."""
        held = _ids(v for layer in self.tables for v in layer.variables) | \
            _ids(v for v, _ in self._candidates)
        return [v for v in variables if not _ids([v]) <= held]

    def note_outside_write(self, variable):
        """Notes an eager write to `variable` (a tf.Variable), outside any
        traced step: its layer's next push is measured on the variables
        (with the step's captured update applied first), so that a
        callback's `set_weights` during `fit` reaches the shards as it
        would without capture (`_tf_hooks`). A non-trainable one not
        shared yet (`initial_values`) restored (`load_weights`,
        `set_weights`, a fit's callbacks as it begins: `BackupAndRestore`)
        keeps its value at the build. No-op for other variables."""
        layer = self._layer_of.get(id(variable))
        if layer is None:
            if self._constants and _tf_hooks.restoring() and any(
                    v is variable for v in self._constants):
                self._constants_written.add(id(variable))
            return
        layer.written_outside = True
        if layer.snapshot_stale and layer.measured_push and \
                layer.before_write is None:
            try:  # (the write itself comes after this)
                layer.before_write = ops.pack(layer.variables, layer.layout)
            except tf.errors.InvalidArgumentError:
                pass  # a staged layer's empty variables: nothing to keep

    def note_traced_write(self, variable):
        """Notes a write to `variable` traced into a function outside the
        steps this sync wraps (a callback's `tf.function`): it may run
        between any two steps, unseen, so from now on every push of its
        layer is measured on the variables (a captured update applied
        first). No-op inside a step (its optimizer's writes) and for
        other variables."""
        if self._updated is not None:
            return  # tracing a step of ours
        layer = self._layer_of.get(id(variable))
        if layer is None:  # (its table, if any, is built later)
            self._traced_writes.add(id(variable))
        elif not layer.written_by_functions:
            layer.written_by_functions = True
            log.debug("parameter table %r: a function written outside the "
                      "steps writes it; its pushes are measured from now "
                      "on", layer.name)

    def note_update(self, variable):
        """Called for every variable the optimizer updates (at trace time)."""
        if self._updated is not None:
            self._updated[id(variable)] = variable

    def update_capture(self, variable):
        """The capture that may take `variable`'s optimizer update, or None."""
        if self._capture is None:
            return None
        return self._capture.expect(variable)

    def wrap_step(self, call, is_train_step=False, builds_tables=True):
        """Runs `call` (one step) between pulls and pushes of the tables.

        Args:
            call: the step, a callable of no arguments.
            is_train_step: whether it is a Keras model's `train_step`.
            builds_tables: whether the tables of variables tracked since
                the last build are built first: True, False (a Keras test
                or predict step: weights set between one and the first
                `fit` are what the tables start from) or the variables
                whose tables to build, or a callable returning them (a
                Keras train step: its model's weights, so that another
                model's weights, loaded before its own first `fit`, are
                what its tables start from; the others it trains get
                theirs once traced). Defaults to True.
        """
        if _tf_hooks.in_xla_context():
            raise GeePSError(
                "GeePSStrategy cannot run inside an XLA-compiled function: "
                "compile the model with jit_compile=False (Keras turns XLA on "
                "by default when a GPU is visible)")
        if self._updated is not None:
            # A step's own nested call_for_each_replica (LossScaleOptimizer
            # applies its inner optimizer through one): already wrapped.
            return call()
        if builds_tables is True:
            self.build_pending()
        elif builds_tables is not False and self._candidates:
            self.build_pending(builds_tables() if callable(builds_tables)
                               else builds_tables)
            if not self.tables:  # (none of them a model's weight: all)
                self.build_pending()
        known = _ids(v for v, _ in self._candidates)
        if not self.tables:
            return self._run_untabled(call, known)
        # One op pulls every table, in layer order: the step waits for all
        # of them anyway, and each py_function call costs ~0.1-0.3 ms.
        pulls = [tf.py_function(self._pull_all_op, [], tf.bool,
                                name="geeps_pull")]
        self._updated = {}
        self._capture = self._new_capture(is_train_step)
        try:
            with tf.control_dependencies(pulls):
                result = call()
            traced = self._updated
            updated = self._without_created(traced, known)
            captured = {}
            if self._capture is not None:
                captured = self._capture.finish(self.tables)
                self.captured_layers = [self.tables[i].name
                                        for i in sorted(captured)]
        finally:
            self._updated = None  # no step is being traced
            self._capture = None
        if is_train_step and not traced:
            raise GeePSError(
                "the train step updated no parameter table through the "
                "optimizer, so nothing would reach the shards: create the "
                "model inside strategy.scope() and update its variables "
                "with its optimizer (optimizer.apply / apply_gradients)")
        # Variables of the scope the step trains beyond its model's weights
        # (a tf.Variable attribute, another model it reaches): their
        # tables now, pulled by the step's pull op when it runs.
        pending = _ids(v for v, _ in self._candidates)
        strays = [v for key, v in updated.items() if key in pending]
        if strays:
            self.build_pending(strays)
        self._check_tabled(updated)
        groups = self._push_groups(updated)
        pushes = [self._push_after_updates(group, captured,
                                           group is groups[-1])
                  for group in groups]  # the last one counts the step
        if pushes and not self.fitting:
            # A custom loop's step (or `train_on_batch`): nothing of Keras'
            # catches the variables up where the loop reads or writes them,
            # so the step ends with the shards' rows in them (under BSP the
            # wait the next step's pull would have had, moved: that pull
            # then finds nothing). A step traced in `fit` has no such op;
            # one traced outside, run in a fit later, skips it. It takes
            # the variables' handles, so that what the function does with
            # them after `strategy.run` is ordered after it.
            handles = [v.handle for group in groups for i in group
                       for v in self.tables[i].variables]
            with tf.control_dependencies(pushes):
                tf.py_function(lambda *_: self._catch_up_op(), handles,
                               tf.bool, name="geeps_catch_up")
        return result

    def _push_groups(self, updated):
        """The updated tables' indices in push groups, in push order.

        Backprop reaches the last layer first: push in reverse layer order,
        each group as soon as its variables are updated, a group holding at
        least MIN_PUSH_BYTES but where the tables end.
        """
        groups, group, group_bytes = [], [], 0
        for i in reversed(range(len(self.tables))):
            layer = self.tables[i]
            if not any(id(v) in updated for v in layer.variables):
                continue
            group.append(i)
            group_bytes += layer.table.nbytes
            if group_bytes >= MIN_PUSH_BYTES:
                groups.append(group)
                group, group_bytes = [], 0
        if group:
            groups.append(group)
        return groups

    def _run_untabled(self, call, known):
        """Runs a step while there is no table: it must update nothing
        (but variables it created, `_without_created`)."""
        self._updated = {}
        try:
            result = call()
            updated = self._without_created(self._updated, known)
        finally:
            self._updated = None
        self._check_tabled(updated)
        return result

    def _without_created(self, updated, known):
        """`updated` ({id: variable}) less the variables of the scope the
        step created as it was traced (a model built at its first call: a
        subclassed model, a Sequential without an Input), which are not
        yet initialized, so no table can start from them. `tf.function`
        then runs their initializers and traces the step again, without
        creating any: that trace builds their tables and is what runs.
        Should it run this trace instead, its first op raises, naming
        them; a step run eagerly raises at once."""
        created = [(v, path) for v, path in self._candidates
                   if id(v) not in known and id(v) in updated]
        if not created:
            return updated
        names = ", ".join(sorted(path or variable_name(v)
                                 for v, path in created))
        message = (f"the step created the variables {names} as it ran (a "
                   f"model built at its first call), so no parameter table "
                   f"could start from their values: build the model before "
                   f"the first step, in strategy.scope() (model.build("
                   f"input_shape), or call it once on a batch)")
        if not tf.inside_function():
            raise GeePSError(message)

        def refuse():
            raise GeePSError(message)
        tf.py_function(refuse, [], tf.bool, name="geeps_created_variables")
        created_ids = _ids(v for v, _ in created)
        return {key: v for key, v in updated.items()
                if key not in created_ids}

    def _check_tabled(self, updated):
        """Raises when the step updates a trainable variable that is in no
        table. (Non-trainable ones are the optimizer's own: gradient
        accumulators, which Keras updates through the strategy too.)"""
        tabled = {id(v) for layer in self.tables for v in layer.variables}
        missing = [v for key, v in updated.items()
                   if key not in tabled and v.trainable]
        if missing:
            names = ", ".join(sorted(variable_name(v) for v in missing))
            raise GeePSError(
                f"the step updates variables that are in no parameter "
                f"table, so their updates would never reach the shards: "
                f"{names}. Create every layer the step trains inside "
                f"strategy.scope()")

    def _new_capture(self, is_train_step):
        # Only while tracing: run eagerly, a direct write (weight decay)
        # happens at once and leaves no op the capture could check.
        if not (is_train_step and self.capture_updates
                and self.client.slack == 0 and tf.inside_function()):
            return None
        variables = [v for layer in self.tables if layer.on_cpu
                     for v in layer.variables]
        if not variables:
            return None
        return UpdateCapture(tf.compat.v1.get_default_graph(), variables)

    def _push_after_updates(self, indices, captured, count_step):
        # Captured updates are the push's inputs; reading the other
        # variables orders the push after their updates.
        reads = [v.read_value() for i in indices if i not in captured
                 for v in self.tables[i].variables]
        tensors, signs = [], {}
        for i in indices:
            if i in captured:
                values, signs[i] = captured[i]
                tensors += values
        with tf.control_dependencies(reads):
            return tf.py_function(
                functools.partial(self._push_op, indices, signs, count_step),
                tensors, tf.bool, name=f"geeps_push_{indices[-1]}")

    # ------------------------------------------------------------ tables
    def pending_count(self):
        """How many trainable variables created in the scope have no table
        yet: theirs are built at the next step run through the strategy."""
        return len(self._candidates)

    def build_pending(self, variables=None):
        """Builds the tables of variables tracked since the last build, if
        any (outside any function being traced).

        Args:
            variables: build only the tracked ones among these (a model's
                weights: its first train step), leaving the others pending.
                Defaults to None: all of them.
        """
        if self._candidates:
            with tf.init_scope():
                self.build(variables)

    def build(self, variables=None):
        """Creates one table per layer from the tracked trainable variables.

        Collective: every worker builds the same tables in the same order
        (the same model code creates the same variables, and trains its
        models in the same order). Worker 0's values initialise the tables;
        the others take them at their first pull. The non-trainable
        floating-point variables tracked so far (of `variables`, when
        given) get worker 0's starting values here, but for those
        restored since their creation (`initial_values`). Variables
        created after a build (a second model in the scope) get their
        tables at the next build, appended to `tables`.

        Args:
            variables: build only the tracked ones among these, leaving the
                others pending (a second model's, whose weights may still
                be loaded before its own first `fit`). Defaults to None:
                all of them.

        Raises:
            GeePSError: a layer's new variables would need a table whose
                name an existing table has (a layer that created variables
                after its table was built, or two models of the same name).
        """
        chosen, pending = self._candidates, []
        constants, constants_left = self._constants, []
        if variables is not None:
            wanted = _ids(variables)
            chosen = [c for c in self._candidates if id(c[0]) in wanted]
            pending = [c for c in self._candidates if id(c[0]) not in wanted]
            constants = [v for v in self._constants if id(v) in wanted]
            constants_left = [v for v in self._constants
                              if id(v) not in wanted]
        groups, paths = {}, {}
        for variable, keras_path in chosen:
            key = (layer_name(variable, keras_path), variable.dtype.name)
            groups.setdefault(key, []).append(variable)
            path = keras_path or variable.name.split(":")[0]
            if path in paths.setdefault(key, set()):
                self._candidates = pending
                raise GeePSError(
                    f"two variables are called {path!r}: two layers of one "
                    f"name (in two functional models, whose variable paths "
                    f"hold only the layer's name) would share one parameter "
                    f"table; give the layers distinct names")
            paths[key].add(path)
        self._candidates = pending
        existing = {layer.table.name for layer in self.tables}
        for (name, dtype), variables in groups.items():
            table_name = name if dtype == "float32" else f"{name}:{dtype}"
            if table_name in existing:
                raise GeePSError(
                    f"{', '.join(variable_name(v) for v in variables)}: "
                    f"created after the parameter table {table_name!r} was "
                    f"built, which they would have to join. Either a layer "
                    f"made variables after training began (e.g. "
                    f"enable_lora(), or a layer built lazily on a later "
                    f"call): build and configure every layer before the "
                    f"first step; or two models share a name: give each "
                    f"model a distinct name (a functional model's "
                    f"variables carry only their layer's name: give its "
                    f"layers distinct names)")
            layout = ops.PackLayout(variables)
            total = layout.total_size
            width = row_width(total, self.max_row_width)
            init = ops.pack(variables, layout).numpy() \
                if self.client.worker_id == self.client.initializer else None
            table = self.client.create_table(table_name, total // width,
                                             width, dtype, init=init)
            layer = LayerTable(name, variables, table, layout)
            layer.written_by_functions = bool(
                _ids(variables) & self._traced_writes)
            self.tables.append(layer)
            self._layer_of.update((i, layer) for i in _ids(variables))
        # Right after the trainable ones' tables: every worker at the same
        # point of its table order.
        self._constants = constants_left
        written = self._constants_written & _ids(constants)
        self._constants_written -= written
        if constants:
            initial_values.share_initial_values(
                self.client, constants,
                lambda total: row_width(total, self.max_row_width),
                written=written)

    def table_report(self):
        """A printable list of tables: layer, rows x width, bytes, shards."""
        lines = [f"{'table':<40} {'rows x width':>16} {'bytes':>12} shards"]
        for layer in self.tables:
            t = layer.table
            lines.append(f"{layer.name[:40]:<40} {t.rows:>8} x {t.width:<6}"
                         f" {t.nbytes:>12,} "
                         f"{','.join(str(s) for s, _, _ in t.parts)}")
        return "\n".join(lines)

    # ------------------------------------------------ eager pull / push
    def pull(self, index, full=False, values=None, current=False):
        """Brings table `index` into its variables if the shards have news.

        Args:
            index: the table's position in `tables`.
            full: wait for every worker's last clock, ignoring the slack,
                as at the end of training. Defaults to False.
            values: the table's current values, in layout order, when they
                are not in its variables (the memory manager's host copies):
                fresh rows are then returned, not assigned. Defaults to None.
            current: wait for every worker's last clock as `full` does,
                with training going on: a write since the last pull stays
                for the next step to carry. Defaults to False.

        Returns:
            The pulled rows (a 1-D tensor sharing the pull buffer) when
            fresh rows came in, else None.
        """
        self._check_open()
        layer = self.tables[index]
        table = layer.table
        started = time.perf_counter()
        # (before any read: the rows under the snapshot stay until then)
        # A full pull ends training: no step would carry the write, which
        # stays the worker's where no fresh rows come (and goes where they
        # do: every worker then holds the same rows).
        written = self._write_since_pull(layer, values) \
            if not full else None
        layer.before_write = None
        clock = table.clock + self.client.slack if full or current \
            else None
        # Not under self.lock: the push this pull may be waiting for can
        # come from another thread (the memory manager's write-back).
        delivered = None
        if self.client.delivers(table, clock=clock):
            # A push over TCP must come: the read gets it in its buffer as
            # it arrives (opened there when sealed), with no copy after.
            delivered = layer.next_buffer()
            try:
                self.client.read(table, out=delivered.reshape(table.rows,
                                                              table.width),
                                 clock=clock)
            except BaseException:
                # (the other buffer may hold the rows of layer.snapshot)
                layer.take_back_buffer()
                raise
        else:
            self.client.wait_fresh(table, clock=clock)
        self.pull_wait_seconds += time.perf_counter() - started
        current = layer.variables if values is None else values
        if delivered is None and tuple(table.ages) == layer.pulled_ages and \
                layer.snapshot is not None:
            if layer.snapshot_stale:  # own updates stay; re-base the delta
                layer.snapshot = self._own_view(layer, current, values)
                layer.snapshot_stale = False
                layer.behind = False  # (as the shards will apply it)
            if values is None:
                self._measure_outside(layer)
            self.pull_seconds += time.perf_counter() - started
            return None
        with self.lock:
            # A co-located shard's rows are used where they lie (only our
            # ops read them); others, and the memory manager's host copies
            # (which TF may compute on in place), are copied out.
            if delivered is not None:
                buffer, shared = delivered, False
            else:
                buffer = self.client.read_shared(table) if values is None \
                    else None
                shared = buffer is not None
                if buffer is None:
                    buffer = layer.next_buffer()
                    self.client.read(table, out=buffer.reshape(
                        table.rows, table.width))
        buffer = buffer.reshape(-1)
        layer.pulled_ages = tuple(table.last_read_ages)
        layer.behind = False
        self.max_staleness = max(self.max_staleness,
                                 table.clock - table.last_read_age)
        snapshot = as_tensor(buffer, table.dtype)
        layer.pulled_shared = snapshot if shared else None
        if values is None and written is not None:
            # A write since the last pull (SSP: fresh rows came meanwhile)
            # stays, on the fresh rows, for the next push to carry.
            ops.unpack(snapshot + written, layer.variables, layer.layout)
            layer.written_outside = True
            layer.outside_change = self._scaled_apart(written)
        elif values is None:
            ops.unpack(snapshot, layer.variables, layer.layout)
            layer.written_outside = False
            layer.outside_change = None
        layer.snapshot = snapshot
        layer.snapshot_stale = False
        self.pull_seconds += time.perf_counter() - started
        if values is not None and written is not None:
            # (the host copies take it, for the next push to carry)
            layer.outside_change = self._scaled_apart(written)
            return snapshot + written
        return snapshot

    def _scaled_apart(self, written):
        """What of a write since the last pull the next push sends at
        `outside_scale` (`_send`): None where that is the push's own scale,
        which then carries the write with the rest of the update."""
        return written if self.outside_scale != self.scale else None

    def _pull_all_op(self):
        try:
            for index in range(len(self.tables)):
                self.pull(index)
        except Exception as exc:
            self._keep_failure(exc)
            raise
        return True

    def _catch_up_op(self):
        if self.fitting:
            return True
        try:
            for index, layer in enumerate(self.tables):
                if layer.behind:
                    self.pull(index)
        except Exception as exc:
            self._keep_failure(exc)
            raise
        return True

    def _keep_failure(self, exc):
        """Keeps what a pull or push op raised: TensorFlow turns it into a
        `tf.errors.UnknownError` holding only its message."""
        failures = self._failures
        failures.append(exc)
        del failures[:-4]  # (the last few: one per op of a failed step)

    def take_failure(self, message):
        """The exception a pull or push op raised that TensorFlow reported
        as an error with `message`, or None; forgets every kept one.

        Keras' `fit`, `evaluate`, `predict` and `*_on_batch` re-raise it
        in place of TensorFlow's error (`_tf_hooks`), so that a
        `GeePSTimeoutError` or `GeePSWorkerFailedError` keeps its class.
        """
        failures, self._failures = self._failures, []
        for failure in reversed(failures):
            text = str(failure)
            if text and text in message:
                return failure
        return None

    def _own_view(self, layer, current, values):
        """The variables' values once their own last update counts as the
        shards apply it (no fresh rows came in; SSP). Under "average" that
        is `snapshot + update / num_workers`, written back into the
        variables: a worker that steps on must not see its own update N
        times as large as everyone else will. Returns the new snapshot."""
        packed = ops.pack(current, layer.layout)
        if self.scale == 1.0 or values is not None:
            return packed
        own = layer.snapshot + self.scale * (packed - layer.snapshot)
        ops.unpack(own, layer.variables, layer.layout)
        return own

    def _write_since_pull(self, layer, values=None):
        """What was written into `layer`'s variables (or `values`, the
        memory manager's host copies of them) outside the steps since its
        last pull, when that can be told from the rest: no push since (its
        own update would be in it too) or the values before the first
        write after a measured push (`before_write`), and no restart
        (whose pull replaces what was set between fits). Else None."""
        if layer.before_write is not None:
            return ops.pack(layer.variables if values is None else values,
                            layer.layout, snapshot=layer.before_write)
        if values is not None:
            return None
        if not (layer.written_outside or layer.written_by_functions) or \
                layer.snapshot is None or layer.snapshot_stale or \
                layer.pulled_ages is None:
            return None
        return ops.pack(layer.variables, layer.layout,
                        snapshot=layer.snapshot)

    def _measure_outside(self, layer):
        """Keeps what was written into `layer`'s variables outside the
        steps since its pull (`note_outside_write`, `note_traced_write`),
        where the update mode does not scale it as it should: under "sum"
        each worker's push would carry the change in full, N times what
        N workers writing the same change (a callback's) meant. Called at
        a pull that kept the variables, the step's before its update, so
        that the step's push can send `outside_scale` of it."""
        if self.outside_scale == self.scale or layer.snapshot is None or \
                not (layer.written_outside or layer.written_by_functions):
            return
        layer.outside_change = ops.pack(layer.variables, layer.layout,
                                        snapshot=layer.snapshot)

    def _push_op(self, indices, signs, count_step, *tensors):
        position = 0
        try:
            for index in indices:
                update = None
                if signs and index in signs:
                    count = len(signs[index])
                    update = (tensors[position:position + count],
                              signs[index])
                    position += count
                self._send(index, update=update)
                self.tables[index].behind = True
        except Exception as exc:
            self._keep_failure(exc)
            raise
        if count_step:  # one push op per step does
            self.steps += 1
        return True

    def catch_up(self, variables, current=False):
        """Pulls the layers among `variables` that a train step pushed
        since their last pull (`current`: every one of them, with every
        worker's last clock whatever the slack, as after the epoch-end
        barrier, where every worker then sees the same weights).

        After a step a layer's variables are not what the shards hold: a
        captured update is not in them at all, a measured one (GPU, SSP,
        `capture_updates=False`) is in them as this worker made it, neither
        scaled for "average" nor with the other workers' updates. Called
        wherever user code can see the weights between steps: before a
        `fit` callback's epoch / train end, after `train_on_batch`, at
        `fit`'s end (`_tf_hooks`). Costs nothing when no layer is behind.

        Args:
            variables: tf.Variables or keras.Variables (a model's weights).
            current: pull every layer among them, with every worker's
                last clock whatever the slack. Defaults to False.
        """
        behind = [i for i, layer in enumerate(self.tables) if layer.behind]
        if not behind and not current:
            return
        # (under SSP, a layer pulled since its push may lack rows that
        # came since: pulled again, at no cost where none did)
        for index in self._holding(variables, None if current else behind):
            self.pull(index, current=current)

    def _holding(self, variables, indices=None):
        """The positions (among `indices`; defaults to all) of the tables
        holding one of `variables` (tf or keras.Variables)."""
        wanted = _ids(variables)
        return [i for i in (range(len(self.tables)) if indices is None
                            else indices)
                if any(id(v) in wanted for v in self.tables[i].variables)]

    def restart_from_shards(self, variables):
        """Has the next pull of each layer among `variables` assign the
        shards' rows, whether or not they changed since the last pull.

        Called as `fit` begins and before each `train_on_batch`
        (`_tf_hooks`): weights set between fits or calls
        (`set_weights`, `load_weights`, `EarlyStopping(
        restore_best_weights=True)`) are this worker's alone, and a step
        starting from them would push their difference to the shards as
        part of its update. A layer pushed since its last pull (a custom
        loop's, under SSP) is left to its pull's own view.

        Args:
            variables: tf.Variables or keras.Variables (a model's weights).
        """
        for index in self._holding(variables):
            layer = self.tables[index]
            if not layer.snapshot_stale:
                layer.pulled_ages = None  # the next pull reads and assigns

    def pull_restarted(self, variables):
        """Pulls now the layers among `variables` that
        `restart_from_shards` marked (and any never pulled), as `fit`'s
        callbacks begin: a write of theirs from then on (at
        `on_epoch_begin`, before the first batch) is one of this fit, that
        the first step carries, not one its pull replaces."""
        for index in self._holding(variables):
            if self.tables[index].pulled_ages is None:
                self.pull(index)

    def push(self, index, values=None):
        """Sends the update of table `index` since its last pull, and
        clocks it. A caller pushing every table (`push_all`, the memory
        manager) ends a step with table 0, which counts the step.

        Args:
            index: the table's position in `tables`.
            values: the table's current values, in layout order, when they
                are not in its variables (the memory manager's host
                copies). Defaults to None: the variables.

        Raises:
            GeePSError: the table was never pulled (there is nothing to
                measure the update against).
        """
        self._send(index, values)
        if index == 0:
            self.steps += 1

    def _send(self, index, values=None, update=None, scale=None):
        """Pushes and clocks table `index`: `update` is (tensors, signs),
        the optimizer's update of each variable, captured instead of
        applied (the update is `sign * tensor`); None measures it as the
        values minus the pulled snapshot. `scale` replaces the update
        mode's factor (a measured update only). A change written outside
        the steps goes at `outside_scale` (`_measure_outside`)."""
        self._check_open()
        started = time.perf_counter()
        layer = self.tables[index]
        outside = layer.outside_change if scale is None else None
        layer.outside_change = None
        scale = self.scale if scale is None else scale
        table = layer.table
        if update is None and layer.snapshot is None:
            raise GeePSError(
                f"parameter table {layer.name!r}: push before any pull; an "
                f"update is measured against the values pulled last, so "
                f"pull (pull_all, or strategy.run) before the step")
        if update is not None and (layer.written_outside or
                                   layer.written_by_functions or
                                   outside is not None):
            # Weights set since the pull: measure the update with them.
            for variable, value, sign in zip(layer.variables, *update):
                variable.assign_add(value if sign > 0 else -value)
            update = None
            self.outside_write_pushes += 1
        if update is not None:
            rows = self._write_captured(layer, *update)
        elif values is None and outside is None and \
                layer.snapshot is not None and layer.on_cpu and \
                (target := self._update_target(table)) is not None:
            ops.pack_delta_into(layer.variables, layer.layout,
                                layer.snapshot,
                                as_tensor(target.reshape(-1), table.dtype),
                                scale=scale)
            rows = target
        else:
            delta = ops.pack(layer.variables if values is None else values,
                             layer.layout, snapshot=layer.snapshot)
            if scale != 1.0:
                delta = delta * tf.constant(scale, delta.dtype)
            if outside is not None:
                delta = delta + outside * tf.constant(
                    self.outside_scale - scale, delta.dtype)
            rows = as_host_array(delta).reshape(table.rows, table.width)
        with self.lock:
            self.client.update(table, rows, copy=False)
            self.client.clock([table])
        layer.snapshot_stale = True
        layer.measured_push = update is None
        layer.written_outside = False
        self.push_seconds += time.perf_counter() - started

    def _update_target(self, table):
        with self.lock:  # memory a co-located shard reads, if any
            return self.client.update_target(table)

    def _write_captured(self, layer, tensors, signs):
        """Writes a captured update where it will travel from; the rows."""
        scales = [sign * self.scale for sign in signs]
        dtype = layer.table.dtype
        if layer.pulled_shared is not None:
            with self.lock:  # the table's only writer: its new rows
                lent = self.client.lend_target(layer.table)
            if lent is not None:
                ops.pack_tensors_into(tensors, layer.layout,
                                      as_tensor(lent.reshape(-1), dtype),
                                      scales, base=layer.pulled_shared)
                return lent
        rows = self._update_target(layer.table)
        if rows is None:
            rows = layer.next_upload()
        ops.pack_tensors_into(tensors, layer.layout,
                              as_tensor(rows.reshape(-1), dtype), scales)
        return rows

    def finalize_moving_average(self, variables, overwrite):
        """Ends training with the optimizer's moving averages (`use_ema`)
        as the weights, the same on every worker and in the shards.

        Each worker keeps its own averages (optimizer state is local), of
        its variables after its own update: under BSP "average" their mean
        over the workers is the moving average of the shards' values, what
        one worker with the combined batch keeps. So every table among
        `variables` is brought to every worker's last clock, `overwrite()`
        writes this worker's averages into the variables, each worker
        pushes `(its average - rows) / live workers` (whatever the update
        mode; the workers no shard declared dead) and clocks once more, and
        the tables are pulled again: every worker then holds the workers'
        mean average, as do the shards (a later `fit` goes on from it, as
        Keras' would). Collective: every worker's `fit` ends here
        (`Optimizer.finalize_variable_values`, patched in `_tf_hooks`).

        Args:
            variables: the weights being finalized (tf.Variables or
                keras.Variables).
            overwrite: writes this worker's averages into them.

        Returns:
            False, having done nothing, when no table holds any of
            `variables`; else True.
        """
        wanted = _ids(variables)
        indices = [i for i, layer in enumerate(self.tables)
                   if any(id(v) in wanted for v in layer.variables)]
        if not indices:
            return False
        for index in indices:
            self.pull(index, full=True)
        overwrite()
        for index in reversed(indices):
            self._send(index, scale=1.0 / self._live_workers())
        for index in indices:
            self.pull(index, full=True)
        return True

    def _live_workers(self):
        """The workers not declared dead (by any shard: under
        `on_worker_failure="continue"` the others go on without them)."""
        dead = set()
        for stats in self.client.shard_stats():
            dead.update(stats.get("dead_workers", ()))
        return max(1, self.client.num_workers - len(dead))

    def pull_all(self, full=False):
        """Eagerly pulls every table (`full`: wait for every worker's last
        clock, ignoring the slack, as at the end of training)."""
        for index in range(len(self.tables)):
            self.pull(index, full=full)

    def push_all(self):
        """Eagerly pushes every table's update since the last pull, and
        clocks it (for hand-written loops outside `strategy.run`).

        Raises:
            GeePSError: a table was never pulled; nothing is sent then.
        """
        unpulled = [layer.name for layer in self.tables
                    if layer.snapshot is None]
        if unpulled:
            raise GeePSError(
                f"push_all before any pull of the parameter tables "
                f"{', '.join(map(repr, unpulled))}: an update is measured "
                f"against the values pulled last; call pull_all() first")
        for index in reversed(range(len(self.tables))):
            self.push(index)

    def stats(self):
        """This worker's parameter-server figures (data age and clock: of
        the parameter tables, not of other tables the client holds, such
        as the epoch logs')."""
        figures = self.client.stats(self.stepped_tables() or None)
        figures.update(pull_wait_seconds=self.pull_wait_seconds,
                       pull_seconds=self.pull_seconds,
                       push_seconds=self.push_seconds, steps=self.steps,
                       max_staleness=self.max_staleness,
                       tables=len(self.tables),
                       captured_tables=len(self.captured_layers),
                       outside_write_pushes=self.outside_write_pushes)
        return figures
