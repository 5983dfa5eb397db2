"""Worker 0's starting values of the variables no parameter table holds.

A parameter table starts from worker 0's values of its layer's trainable
variables (`ParameterSync.build`), so every worker trains the same model
whatever seeds its process drew. A model's non-trainable variables are
no table's: a frozen layer's weights (`trainable=False`), a weight made
non-trainable with a random initializer (`SpectralNormalization`'s `u`),
BatchNorm's statistics. Without more each worker would start from its own
random draw of them: frozen weights would differ between workers for the
whole run, and the epoch-end mean of the statistics (`non_trainable.py`)
would average random draws into a weight no worker ever held.

So, where the strategy builds the tables of a model's trainable variables,
it shares its layers' non-trainable floating-point weights created in its
scope (not an optimizer's slots or a metric's totals) the same way:
worker 0 creates a table holding their values (one per dtype,
`keras_geeps.initial.<n>:<dtype>`, n counting the client's such tables),
and every worker assigns what it reads there at clock 0 into its
variables. The table is never clocked or updated: a worker that rejoins a
job under way, worker 0 too, reads the job's starting values there, not
its own new draw.

But for the variables restored before the first step: by
`Model.load_weights` or `Layer.set_weights` (a job resumed by hand), or by
`fit`'s callbacks as it begins (`keras.callbacks.BackupAndRestore`
resuming `fit`: its backup holds the statistics averaged at the last epoch
end, alike on every worker). Those keep what was restored: the starting
values would undo a resume's statistics on every worker but worker 0. (Any
other write, e.g. in a layer's `build` or by `adapt()`, makes a starting
value, worker 0's shared as ever.)

It costs the shards, and each worker's cache, the variables' bytes once.
Integer variables (random seed states, counters) are left as they are.
"""

import weakref

import keras
import tensorflow as tf

from keras_geeps import ops

TABLE_PREFIX = "keras_geeps.initial"
# client -> how many such tables it has made (the next one's number)
_COUNTS = weakref.WeakKeyDictionary()


def shared_kinds(variables):
    """Those of `variables` whose starting values are shared: the
    floating-point ones, grouped by dtype name, in the given order.

    Args:
        variables: tf.Variables.

    Returns:
        A dict {dtype name: [variables]}.
    """
    groups = {}
    for variable in variables:
        if keras.backend.is_float_dtype(variable.dtype.name):
            groups.setdefault(variable.dtype.name, []).append(variable)
    return groups


def share_initial_values(client, variables, row_width, written=()):
    """Gives every worker worker 0's values of `variables` (collective:
    every worker calls it at the same point of its table order with the
    same variables, in the same order), but for those `written`.

    Args:
        client: the worker's `GeePSClient`.
        variables: tf.Variables (non-trainable, held by no table).
        row_width: a function giving a table's row width from its size.
        written: ids of those of `variables` that keep their values
            (restored). Defaults to none.

    Returns:
        The number of variables whose values were shared.

    Example:

    ```python
    # (ParameterSync.build does this for a model's non-trainable weights)
    share_initial_values(strategy.client, frozen_weights, row_width)
    ```
    """
    shared = 0
    for dtype, group in shared_kinds(variables).items():
        number = _COUNTS.get(client, 0)
        _COUNTS[client] = number + 1
        layout = ops.PackLayout(group)
        total = layout.total_size
        if not total:
            continue
        width = row_width(total)
        creator = client.worker_id == client.initializer
        init = ops.pack(group, layout).numpy() if creator else None
        table = client.create_table(f"{TABLE_PREFIX}.{number}:{dtype}",
                                    total // width, width, dtype, init=init)
        # (worker 0's own rows, or the job's where the table existed: a
        # job resumed or rejoined)
        rows = client.read(table, clock=0).reshape(-1)
        kept = [(v, tf.identity(v)) for v in group if id(v) in written]
        ops.unpack(rows, group, layout)
        for variable, value in kept:
            variable.assign(value)
        shared += len(group) - len(kept)
    return shared
