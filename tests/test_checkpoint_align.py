"""Checkpoints of a whole job at one clock per table (`align_job`), the
checkpoint each write replaces kept as the older one, and a worker that
refuses shards restored at different clocks."""

import json
import os
import time

import numpy as np
import pytest

from keras_geeps import checkpoint
from keras_geeps.cli import main as cli_main
from keras_geeps.client.client import GeePSClient
from keras_geeps.cluster import ClusterSpec
from keras_geeps.errors import GeePSError
from keras_geeps.shard import ShardServer, ShardSettings
from keras_geeps.shard.writer import CheckpointWriter


def spec(name, rows, start, end, width=2):
    return {"name": name, "rows": rows, "width": width, "dtype": "float32",
            "row_start": start, "row_end": end}


def rows_of(value, count, width=2):
    return np.full((count, width), value, np.float32)


def test_each_write_keeps_the_one_it_replaced(tmp_path):
    directory = str(tmp_path)
    for clock in (2, 4, 6):
        checkpoint.write(directory, 0, 1, 1, {
            0: (spec("t", 3, 0, 3), clock, rows_of(clock, 3))})
    assert checkpoint.load(directory, 0, 1, 1)[0][1] == 6
    older = checkpoint.load_job(directory, 0, 1, 1, older=True)[0]
    assert older[0][1] == 4
    np.testing.assert_array_equal(older[0][2], rows_of(4, 3))
    assert sorted(os.listdir(directory)) == [
        "shard-0-of-1.ckpt.npz", "shard-0-of-1.older.ckpt.npz"]


def test_align_takes_each_table_to_the_clock_all_its_shards_hold(tmp_path):
    directory = str(tmp_path)
    # Table 0 (rows 0-3 on shard 0, 4-5 on shard 1): shard 0 wrote clock
    # 4, shard 1 was killed before it did. Table 1 lives on shard 1 only.
    # Table 2: shard 0 wrote it, shard 1 never held a snapshot of its part.
    checkpoint.write(directory, 0, 2, 3, {
        0: (spec("a", 6, 0, 4), 2, rows_of(2, 4))})
    checkpoint.write(directory, 0, 2, 3, {
        0: (spec("a", 6, 0, 4), 4, rows_of(4, 4)),
        2: (spec("c", 6, 0, 3), 4, rows_of(40, 3))}, left=[2], dead=[1])
    checkpoint.write(directory, 1, 2, 3, {
        0: (spec("a", 6, 4, 6), 2, rows_of(2, 2)),
        1: (spec("b", 5, 0, 5), 3, rows_of(3, 5))})
    assert checkpoint.align_job(directory, 2, 3) == {0: 2, 1: 3, 2: None}
    shard0, left0, dead0 = checkpoint.load_job(directory, 0, 2, 3)
    assert set(shard0) == {0} and shard0[0][1] == 2
    assert left0 == {2} and dead0 == {1}  # (carried over)
    np.testing.assert_array_equal(shard0[0][2], rows_of(2, 4))
    shard1 = checkpoint.load(directory, 1, 2, 3)
    assert {t: c for t, (_, c, _) in shard1.items()} == {0: 2, 1: 3}
    # Aligned already: nothing is rewritten the second time.
    stamp = os.stat(checkpoint.checkpoint_path(directory, 0, 2)).st_mtime_ns
    assert checkpoint.align_job(directory, 2, 3) == {0: 2, 1: 3}
    assert os.stat(checkpoint.checkpoint_path(
        directory, 0, 2)).st_mtime_ns == stamp
    os.unlink(checkpoint.checkpoint_path(directory, 1, 2))
    with pytest.raises(checkpoint.CheckpointError, match="shard 1/2"):
        checkpoint.align_job(directory, 2, 3)


def test_align_finds_a_common_clock_below_the_least_latest(tmp_path):
    """Shard 0 is at 7 (older 5), shard 1 at 8 (older 5): neither holds
    7, but both hold 5, which the table is taken to, not dropped."""
    directory = str(tmp_path)
    for shard, clocks in ((0, (5, 7)), (1, (5, 8))):
        for clock in clocks:
            checkpoint.write(directory, shard, 2, 1, {0: (
                spec("a", 4, 2 * shard, 2 * shard + 2), clock,
                rows_of(clock, 2))})
    assert checkpoint.align_job(directory, 2, 1) == {0: 5}
    for shard in (0, 1):
        tables = checkpoint.load(directory, shard, 2, 1)
        assert tables[0][1] == 5
        np.testing.assert_array_equal(tables[0][2], rows_of(5, 2))


@pytest.mark.parametrize("flagged", [True, False])
def test_a_shards_own_clocks_keep_the_last_one_all_take(tmp_path, flagged):
    """Shard 0 of a split table wrote 10, 20, 23 (a checkpoint request,
    at its own clock) and 30; shard 1 wrote 10, 20 and 24 (the request)
    before the job died. Each keeps 20 as its older snapshot, so the job
    aligns there; unflagged, as before, no clock of the table was in both
    shards' files and it went back to its initial values."""
    directory = str(tmp_path)
    for shard, clocks in ((0, (10, 20, 23, 30)), (1, (10, 20, 24))):
        for clock in clocks:
            checkpoint.write(directory, shard, 2, 1, {0: (
                spec("t", 4, 2 * shard, 2 * shard + 2), clock,
                rows_of(clock, 2))},
                own_clock={0} if flagged and clock in (23, 24) else ())
    got = checkpoint.align_job(directory, 2, 1)
    if not flagged:
        assert got == {0: None}
        return
    assert got == {0: 20}
    for shard in range(2):
        tables = checkpoint.load(directory, shard, 2, 1)
        assert tables[0][1] == 20
        np.testing.assert_array_equal(tables[0][2], rows_of(20, 2))


def test_a_clock_all_shards_take_displaces_as_before(tmp_path):
    """Where a worker left at 23 (a clock every shard snapshots) and
    shard 1, busy writing, never wrote 20: shard 0's 20 gives way to 23
    as its older snapshot, and the job aligns at 23."""
    directory = str(tmp_path)
    for shard, clocks in ((0, (10, 20, 23, 30)), (1, (10, 23))):
        for clock in clocks:
            checkpoint.write(directory, shard, 2, 1, {0: (
                spec("t", 4, 2 * shard, 2 * shard + 2), clock,
                rows_of(clock, 2))})
    assert checkpoint.align_job(directory, 2, 1) == {0: 23}


@pytest.mark.parametrize("meta", [
    [1, 2], "text", {"tables": []},
    {"tables": {"0": {"spec": {"name": "t"}, "clock": 3}}},
    {"tables": {"0": {"spec": spec("t", 2, 0, 2), "clock": "3"}}}])
def test_a_foreign_meta_is_a_checkpoint_error_naming_the_file(tmp_path,
                                                              meta):
    path = checkpoint.checkpoint_path(str(tmp_path), 0, 1)
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    for call in (lambda: checkpoint.align_job(str(tmp_path), 1, 1),
                 lambda: checkpoint.table_clocks(str(tmp_path), 1)):
        with pytest.raises(checkpoint.CheckpointError, match=path):
            call()
    # A shard started there without --restore keeps it aside, unread.
    CheckpointWriter(str(tmp_path), 0, 1, 1).write_empty()
    assert os.path.exists(path + ".previous")


def test_align_checkpoints_command(tmp_path, capsys):
    directory = str(tmp_path)
    checkpoint.write(directory, 0, 1, 1, {0: (spec("a", 2, 0, 2), 1,
                                              rows_of(1, 2))})
    assert cli_main(["align-checkpoints", directory, "--shards", "1",
                     "--workers", "1"]) == 0
    assert "table 0: clock 1" in capsys.readouterr().out
    assert cli_main(["align-checkpoints", directory, "--shards", "0",
                     "--workers", "1"]) == 2
    assert cli_main(["align-checkpoints", str(tmp_path / "none"),
                     "--shards", "1", "--workers", "1"]) == 1
    assert "no checkpoint of shard 0/1" in capsys.readouterr().err


def test_forgetful_restarts_never_replace_a_kept_checkpoint(tmp_path):
    """A shard started without --restore keeps a checkpoint of tables it
    finds as <file>.previous; a second such start (its checkpoint of no
    tables found) keeps that one, and a third, after tables were written
    again, keeps both. Half-written files a crash left are removed."""
    directory = str(tmp_path)
    path = checkpoint.checkpoint_path(directory, 0, 1)
    checkpoint.write(directory, 0, 1, 1, {0: (spec("a", 2, 0, 2), 7,
                                              rows_of(7, 2))})
    stale = tmp_path / (checkpoint.temporary_prefix(0, 1) + "x.tmp")
    stale.write_bytes(b"torn")
    other = tmp_path / (checkpoint.temporary_prefix(1, 2) + "y.tmp")
    other.write_bytes(b"another shard's write under way")
    writer = CheckpointWriter(directory, 0, 1, 1)
    writer.write_empty()
    writer.write_empty()
    assert not stale.exists() and other.exists()
    assert checkpoint.load(directory, 0, 1, 1) == {}
    os.replace(path + ".previous", path)
    assert checkpoint.load(directory, 0, 1, 1)[0][1] == 7
    writer.write_empty()
    checkpoint.write(directory, 0, 1, 1, {0: (spec("a", 2, 0, 2), 9,
                                              rows_of(9, 2))})
    writer.write_empty()
    for name, clock in ((".previous", 7), (".previous.1", 9)):
        os.replace(path + name, path)
        assert checkpoint.load(directory, 0, 1, 1)[0][1] == clock
    assert not os.path.exists(
        checkpoint.checkpoint_path(directory, 0, 1, older=True))


def _shards(directory, restore):
    settings = ShardSettings(checkpoint_dir=directory, checkpoint_every=2,
                             shared_memory=False)
    return [ShardServer("tcp://127.0.0.1:0", shard, 2, 1, settings,
                        restore=restore).start() for shard in range(2)]


def _client(shards):
    return GeePSClient(ClusterSpec([s.address for s in shards],
                                   worker_id=0, num_workers=1), timeout=10,
                       shared_memory=False)


def _wait_for_checkpoints(directory, clock):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if all(checkpoint.load(directory, shard, 2, 1)[0][1] == clock
                   for shard in range(2)):
                return
        except (checkpoint.CheckpointError, KeyError):
            pass  # being written, or not yet holding the table
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint at clock {clock} within 20 s")


ROWS, WIDTH = 1024, 128  # 512 KiB: split over both shards


def test_a_worker_refuses_shards_restored_at_different_clocks(tmp_path):
    """A whole job killed after shard 0 wrote clock 4 and before shard 1
    did: restored so, a worker refuses the table naming both clocks and
    the command; aligned, the job goes on from clock 2 everywhere."""
    directory = str(tmp_path)
    shards = _shards(directory, restore=False)
    try:
        with _client(shards) as client:
            table = client.create_table("t", ROWS, WIDTH)
            assert len({shard for shard, _, _ in table.parts}) == 2
            for clock in range(4):
                client.update(table, np.ones((ROWS, WIDTH), np.float32))
                client.clock()
                if clock == 1:  # clock 2 written everywhere, then 4
                    _wait_for_checkpoints(directory, 2)
            client.read(table)
    finally:
        for shard in shards:
            shard.stop()
    for shard in range(2):
        assert checkpoint.load(directory, shard, 2, 1)[0][1] == 4
    # Shard 1 "never wrote" clock 4: its latest is its older (clock 2).
    os.replace(checkpoint.checkpoint_path(directory, 1, 2, older=True),
               checkpoint.checkpoint_path(directory, 1, 2))
    shards = _shards(directory, restore=True)
    try:
        with _client(shards) as client:
            with pytest.raises(GeePSError, match=r"different clocks \("
                               r"shard 0: 4, shard 1: 2\): run `keras-geeps "
                               r"align-checkpoints DIR --shards 2 "
                               r"--workers 1`"):
                client.create_table("t", ROWS, WIDTH)
    finally:
        for shard in shards:
            shard.stop()
    assert checkpoint.align_job(directory, 2, 1) == {0: 2}
    shards = _shards(directory, restore=True)
    try:
        with _client(shards) as client:
            table = client.create_table("t", ROWS, WIDTH)
            assert table.clock == 2
            np.testing.assert_array_equal(client.read(table),
                                          np.full((ROWS, WIDTH), 2))
            client.update(table, np.ones((ROWS, WIDTH), np.float32))
            client.clock()
            np.testing.assert_array_equal(client.read(table),
                                          np.full((ROWS, WIDTH), 3))
    finally:
        for shard in shards:
            shard.stop()


def test_a_creator_refuses_a_table_restored_on_some_shards_only(tmp_path):
    """A whole job killed after shard 0 wrote a split table's first
    snapshot (clock 2) and before shard 1 did: restored so, its creator
    is refused at once, naming the shard whose checkpoint lacks it and the
    command (not a read timing out later on a torn table)."""
    directory = str(tmp_path)
    checkpoint.write(directory, 0, 2, 1, {
        0: (spec("t", ROWS, 0, ROWS // 2, WIDTH), 2,
            rows_of(2, ROWS // 2, WIDTH))})
    checkpoint.write(directory, 1, 2, 1, {})
    shards = _shards(directory, restore=True)
    try:
        with _client(shards) as client:
            started = time.monotonic()
            with pytest.raises(GeePSError, match=r"different clocks \("
                               r"shard 0: 2, shard 1: not in its "
                               r"checkpoint\): run `keras-geeps "
                               r"align-checkpoints"):
                client.create_table("t", ROWS, WIDTH)
            assert time.monotonic() - started < 5  # not the 10 s timeout
    finally:
        for shard in shards:
            shard.stop()
    assert checkpoint.align_job(directory, 2, 1) == {0: None}


def test_tables_moving_one_write_at_a_time_keep_their_own_older(tmp_path):
    """Per-layer clocks cross a multiple of K one table at a time, each a
    write of all the shard's snapshots: table 0 at 4 with table 1 still at
    2, then both at 4, then again (a worker left). The older file keeps
    each table's snapshot before its latest (0 at 2, 1 at 2), so a job
    killed before shard 1 wrote table 0 at 4 is aligned back to 2 rather
    than starting table 0 from its initial values."""
    directory = str(tmp_path)
    a0, a1, b = spec("a", 6, 0, 4), spec("a", 6, 4, 6), spec("b", 3, 0, 3)
    for clocks in ((2, 2), (4, 2), (4, 4), (4, 4)):
        checkpoint.write(directory, 0, 2, 2, {
            0: (a0, clocks[0], rows_of(clocks[0], 4)),
            1: (b, clocks[1], rows_of(10 + clocks[1], 3))},
            left=[1] if clocks == (4, 4) else [])
    older = checkpoint.load_job(directory, 0, 2, 2, older=True)[0]
    assert {t: c for t, (_, c, _) in older.items()} == {0: 2, 1: 2}
    for path in (checkpoint.checkpoint_path(directory, 0, 2),  # (the older
                 checkpoint.checkpoint_path(directory, 0, 2, older=True)):
        assert os.stat(path).st_mode & 0o777 == 0o600  # was a composite)
    np.testing.assert_array_equal(older[0][2], rows_of(2, 4))
    np.testing.assert_array_equal(older[1][2], rows_of(12, 3))
    checkpoint.write(directory, 1, 2, 2, {0: (a1, 2, rows_of(2, 2))})
    assert checkpoint.align_job(directory, 2, 2) == {0: 2, 1: 4}
    shard0, left0, _ = checkpoint.load_job(directory, 0, 2, 2)
    assert {t: c for t, (_, c, _) in shard0.items()} == {0: 2, 1: 4}
    assert left0 == {1}
    np.testing.assert_array_equal(shard0[0][2], rows_of(2, 4))
    np.testing.assert_array_equal(shard0[1][2], rows_of(14, 3))


def test_a_forgetful_restart_keeps_the_older_checkpoint_too(tmp_path):
    """The checkpoint before the latest (what align-checkpoints may take
    a table back to) is kept beside the latest, with the same suffix."""
    directory = str(tmp_path)
    for clock in (3, 5):
        checkpoint.write(directory, 0, 1, 1, {0: (spec("a", 2, 0, 2), clock,
                                                  rows_of(clock, 2))})
    path = checkpoint.checkpoint_path(directory, 0, 1)
    older = checkpoint.checkpoint_path(directory, 0, 1, older=True)
    open(path + ".previous", "wb").close()  # taken: both go to .previous.1
    CheckpointWriter(directory, 0, 1, 1).write_empty()
    assert not os.path.exists(older)
    os.replace(path + ".previous.1", path)
    os.replace(older + ".previous.1", older)
    assert checkpoint.load(directory, 0, 1, 1)[0][1] == 5
    assert checkpoint.read_meta(older)["tables"]["0"]["clock"] == 3


def test_an_older_part_from_a_run_left_out_is_never_picked(tmp_path):
    """Run 1: only shard 0 wrote table 0 (clocks 0, 5), so alignment left
    it out. Run 2 made it again; only shard 1 wrote it. Shard 0's older
    file still holds run 1's part at clock 5: it must not be put beside
    run 2's (one table from two runs)."""
    directory = str(tmp_path)

    def put(shard, clock, value):
        checkpoint.write(directory, shard, 2, 1, {0: (
            spec("u", 4, 2 * shard, 2 * shard + 2), clock,
            rows_of(value, 2))})
    for shard in range(2):
        checkpoint.write(directory, shard, 2, 1, {})
    put(0, 0, 100)
    put(0, 5, 105)
    assert checkpoint.align_job(directory, 2, 1) == {0: None}
    put(1, 0, 0)
    put(1, 5, 5)
    assert checkpoint.align_job(directory, 2, 1) == {0: None}


def test_a_restored_shard_keeps_its_own_clock_snapshot_so(tmp_path):
    """Shard 0 wrote clock 10 (a multiple of K, every shard's) then 12 on
    request (its own). Restored, then asked for a checkpoint before the
    table moves, it must keep 12 marked as its own: its next write at 15
    then keeps 10 as the older, the clock its other shards hold."""
    directory = str(tmp_path)
    table = {"name": "u", "rows": 2, "width": 2, "dtype": "float32",
             "row_start": 0, "row_end": 2}
    for clock, own in ((10, ()), (12, {0})):
        checkpoint.write(directory, 0, 1, 1, {0: (table, clock, rows_of(
            clock, 2))}, own_clock=own)
    shard = ShardServer("tcp://127.0.0.1:0", 0, 1, 1, ShardSettings(
        checkpoint_dir=directory, checkpoint_every=5, shared_memory=False),
        restore=True).start()
    try:
        assert cli_main(["checkpoint", "--shards", shard.address]) == 0
    finally:
        shard.stop()
    assert checkpoint.own_clock_tables(directory, 0, 1) == {0}
    checkpoint.write(directory, 0, 1, 1, {0: (table, 15, rows_of(15, 2))})
    assert checkpoint.read_meta(checkpoint.checkpoint_path(
        directory, 0, 1, older=True))["tables"]["0"]["clock"] == 10
