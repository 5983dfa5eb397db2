"""A worker that rejoined a `model.fit` job under way lines up its epochs.

Under `on_worker_failure="continue"` the other workers go on without a
dead worker; a restarted one rejoins at the tables' current clock, most
likely in the middle of the others' epoch. Its own `fit` would start a
fresh epoch there, so its epoch ends, and with them the epoch-end
barriers (the averaged logs, keras/epoch_logs.py; the BatchNorm
statistics, keras/non_trainable.py), would fall where the others' do not.

So at the start of its `fit` such a worker reads from the epoch logs'
table where the others' last epoch ended (the epoch and the parameter
tables' clock, which every barrier carries) and, with its own steps per
epoch, where their current epoch ends. It clocks its parameter tables to
there without updates (first those a clock behind the others: rejoining in
the middle of the others' step, when they have clocked some tables and not
yet the rest), one clock at a time as the others step (so each wait
is one of their steps, within the client's timeout), takes part in that
epoch end's barriers with nothing of its own (`WorkerMean.skip`), and its
`fit` starts at the next epoch. When the others are at the very start of
an epoch it starts there instead. Either way every worker then ends its
epochs, and the job, together, as Horovod's elastic workers join at the
next commit. The rejoined worker's optimizer state starts anew (or from its
`BackupAndRestore`), its data from the start of its part, and its averaged
statistics (BatchNorm's) from the others' at that epoch end
(`NonTrainableAverager.adopt`), not from the job's first ones.

Where the others' place cannot be read (no epoch has ended since the job
started, the logs are not averaged, the steps per epoch are unknown, or the
clocks do not fit), `fit` warns instead, as before, and starts where it
stands. Any worker can rejoin so, worker 0 too, however many epoch ends it
missed: the barriers' tables are per-clock (keras/worker_mean.py), so the
last barrier's row holds its sums alone.
"""

import logging
import warnings
import weakref

log = logging.getLogger("keras_geeps.keras")

# Clients whose worker has lined up (once per rejoin, not at every fit).
_LINED_UP = weakref.WeakSet()


class _CannotLineUp(Exception):
    """Why this worker cannot tell where the others' epochs end."""


def _barrier_names(strategy):
    """The epoch-end averaging the strategy does ("epoch_logs",
    "non_trainable"): what needs epoch ends that line up."""
    return [name for name in ("epoch_logs", "non_trainable")
            if getattr(strategy, name, None) is not None]


def line_up(strategy, model, steps_per_epoch):
    """Brings a worker that rejoined a job under way to the others' epochs.

    Called by `fit` (keras/_tf_hooks) at its start, before its first epoch.
    A no-op unless the worker rejoined (`client.rejoined_at`) and the
    strategy averages at epoch ends.

    Args:
        strategy: the `GeePSStrategy`.
        model: the model being fit.
        steps_per_epoch: this `fit`'s steps per epoch, or None if unknown.

    Returns:
        The epoch `fit` must start at, or None to start where it would.
    """
    client = getattr(strategy, "client", None)
    rejoined_at = getattr(client, "rejoined_at", None)
    barriers = _barrier_names(strategy)
    if rejoined_at is None or not barriers or client.num_workers == 1 \
            or client in _LINED_UP:
        return None
    try:
        skips, pending, epoch, end = _plan(strategy, model, steps_per_epoch)
    except _CannotLineUp as why:
        warnings.warn(
            f"worker {client.worker_id} rejoined a job under way at clock "
            f"{rejoined_at} but cannot line up with the other workers' "
            f"epochs ({why}): its epoch ends line up with theirs only if "
            f"this fit starts exactly where their epoch does; else the "
            f"epoch-end averaging ({', '.join(barriers)}) waits for them "
            f"until the timeout. Jobs whose workers may restart mid-way "
            f"without that need GeePSStrategy(average_epoch_logs=False, "
            f"average_non_trainable=False) on every worker", stacklevel=3)
        _LINED_UP.add(client)
        return None
    sync = strategy.parameter_sync
    tables = sync.stepped_tables()  # (not a frozen layer's)
    now = sync.clock
    if now == end - steps_per_epoch:  # they are starting an epoch too
        for mean in pending:  # a barrier of the epoch end they are at
            mean.skip()
        start = epoch + 1
    else:
        log.warning("worker %d: at clock %d, joins the other workers' "
                    "epoch end at clock %d, then starts at epoch %d",
                    client.worker_id, now, end, epoch + 2)
        for _ in range(end - now):
            client.clock(tables)
            client.wait_fresh(tables[0])
        for mean in skips:
            mean.skip()
        start = epoch + 2
    if strategy.non_trainable is not None:
        # The others' statistics at that epoch end, not the job's first.
        strategy.non_trainable.adopt(model)
    _LINED_UP.add(client)
    return start


def _plan(strategy, model, steps_per_epoch):
    """Makes this worker's tables, in the others' order, and returns (the
    `WorkerMean`s whose barrier at the others' next epoch end it takes
    part in with nothing, those whose barrier at their last epoch end is
    still to come (it takes part in it with nothing when it starts at
    their next epoch), the others' last epoch, the clock their current
    epoch ends at).

    Raises:
        _CannotLineUp: saying why.
    """
    client = strategy.client
    if strategy.epoch_logs is None:
        raise _CannotLineUp("its epoch logs are not averaged: GeePSStrategy("
                            "average_epoch_logs=True) carries where epochs "
                            "end")
    if not steps_per_epoch:
        raise _CannotLineUp("this fit's steps per epoch are unknown")
    sync = strategy.parameter_sync
    sync.build_pending(model.weights)
    if not sync.tables:
        raise _CannotLineUp("the model has no parameter tables yet")
    _even_out(client, sync.stepped_tables())
    # The barrier tables in the order the others created them (their ids):
    # that order depends on where their fit averaged first.
    means = {strategy.epoch_logs.worker_mean.name:
             strategy.epoch_logs.worker_mean}
    statistics = strategy.non_trainable.worker_mean(model) \
        if strategy.non_trainable is not None else None
    if statistics is not None:
        means[statistics.name] = statistics
    names = _table_names(client)
    missing = [name for table_id, name in sorted(names.items())
               if table_id >= len(client.tables) and name not in means]
    if missing:
        raise _CannotLineUp(f"the job holds tables this worker does not "
                            f"know: {missing}")
    if strategy.epoch_logs.worker_mean.name not in names.values():
        raise _CannotLineUp("no epoch of the others has ended yet")
    for _, name in sorted(names.items()):
        if name in means:
            means[name].table()
    last = strategy.epoch_logs.last_epoch_end()
    if last is None:
        raise _CannotLineUp("the last epoch end carries no epoch and clock")
    end = last.clock + steps_per_epoch
    if not end - steps_per_epoch <= sync.clock <= end:
        raise _CannotLineUp(
            f"their last epoch ended at clock {last.clock} and this worker "
            f"is at {sync.clock}: do all workers have {steps_per_epoch} "
            f"steps per epoch?")
    # The barriers of the epoch end it joins: the logs', and the
    # statistics' unless the others took that one already (before their
    # validation, when the job rejoined).
    skips, pending = [strategy.epoch_logs.worker_mean], []
    if statistics is not None and statistics.name in names.values():
        clock = statistics.table().clock
        if clock == last.statistics_clock:
            skips.append(statistics)
        elif last.statistics_clock is not None and \
                clock == last.statistics_clock - 1:
            # The others passed the logs' barrier of their last epoch end
            # and not yet the statistics' (it comes after, without
            # validation): it waits for this worker now, with nothing.
            pending.append(statistics)
    return skips, pending, last.epoch, end


def _even_out(client, tables):
    """Clocks the tables behind the others (with no updates) to the
    furthest one's clock: a worker that rejoins while the others are in
    the middle of a step (they clock one table after another) finds its
    tables at two clocks, and each lagging one is a clock the others wait
    for it on. (`tables`: those the steps clock; a frozen layer's stays
    where it is, as on the other workers.)"""
    furthest = max(table.clock for table in tables)
    for table in tables:
        while table.clock < furthest:
            client.clock([table])


def statistics_clock_after(strategy, model, averaged):
    """The clock the table of `model`'s statistics will have after this
    epoch end's averaging (what the epoch logs' barrier carries for a
    worker that rejoins: whether that barrier is still to come), or None
    when they are not averaged.

    Args:
        strategy: the `GeePSStrategy`.
        model: the model being fit.
        averaged: whether this epoch end averaged them already (before
            `fit`'s validation).
    """
    statistics = getattr(strategy, "non_trainable", None)
    mean = statistics.worker_mean(model) if statistics is not None else None
    if mean is None:
        return None
    try:
        clock = strategy.client.table(mean.name).clock
    except KeyError:  # (made at its first barrier: this one)
        clock = 0
    return clock if averaged else clock + 1


def _table_names(client):
    """Every table the shards hold: id -> name."""
    names = {}
    for stats in client.shard_stats():
        for table_id, table in stats.get("tables", {}).items():
            names[int(table_id)] = table["name"]
    return names
