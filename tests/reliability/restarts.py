"""Helpers of the shard-restart tests."""

import os
import signal
import threading
import time

import numpy as np


def wait_for_checkpoint(client, table, clock, timeout=30):
    """Waits until the shard holding `table` wrote it at `clock` or later."""
    _wait_for_written(client, table.parts[0][0], lambda tables: tables[
        str(table.id)]["ckpt_clock"] >= clock, f"{table.name!r} at clock "
        f"{clock}", timeout)


def wait_for_shard_checkpoint(client, shard, clock, timeout=30):
    """Waits until `shard` wrote every table it holds at `clock` or later
    (a test that kills it then knows what it is restored from)."""
    _wait_for_written(client, shard, lambda tables: tables and all(
        t["ckpt_clock"] >= clock for t in tables.values()),
        f"shard {shard}'s tables at clock {clock}", timeout)


def _wait_for_written(client, shard, written, what, timeout):
    """Polls `shard`'s table stats until `written(them)` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if written(client.shard_stats()[shard]["tables"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of {what} within {timeout} s")


def ask_across_a_restart(client, cluster, ask):
    """Calls `ask()` in a thread while the shard is stopped (SIGSTOP: the
    request waits in its socket), then SIGKILLs it and starts it again
    with --restore. Returns (ask's result, seconds it took)."""
    victim = cluster.shards[0]
    os.kill(victim.process.pid, signal.SIGSTOP)
    result = {}
    asking = threading.Thread(target=lambda: result.update(value=ask()))
    started = time.monotonic()
    asking.start()
    time.sleep(0.5)
    victim.kill()  # (a stopped process dies of SIGKILL too)
    cluster.shards[0] = victim.restart(["--restore"])
    asking.join(client.timeout + 5)
    assert "value" in result, "the request was not answered"
    return result["value"], time.monotonic() - started


def counted_to_a_checkpoint(client, clocks=2):
    """A 4 x 4 table "t" every clock adds 1 to, for `clocks` clocks, until
    its shard wrote it at that clock. Returns the table."""
    table = client.create_table("t", 4, 4)
    for _ in range(clocks):
        client.update(table, np.ones((4, 4), np.float32))
        client.clock()
        client.read(table)
    wait_for_checkpoint(client, table, clocks)
    return table


def killed_one_clock_past_a_checkpoint(client, cluster):
    """`counted_to_a_checkpoint`, then clock 2 (only in the worker's log),
    then SIGKILL of shard 0. Returns (the table, the killed shard)."""
    table = counted_to_a_checkpoint(client)
    client.update(table, np.ones((4, 4), np.float32))
    client.clock()
    victim = cluster.shards[0]
    victim.kill()
    return table, victim
