"""`CheckpointWriter` on a real disk: answers, backoff, who left."""

import os
import shutil
import types

import numpy as np
import pytest

from keras_geeps import checkpoint
from keras_geeps.shard import writer as writer_module
from keras_geeps.shard.settings import RequestError
from keras_geeps.shard.writer import (MAX_CHECKPOINT_REQUESTS,
                                      CheckpointWriter, Written)

SPEC = {"name": "w", "rows": 4, "width": 3, "dtype": "float32",
        "row_start": 0, "row_end": 4}


def _finish(writer):
    writer.join(20)
    return writer.finished()


def test_a_write_answers_the_requests_queued_before_it_only(tmp_path):
    writer = CheckpointWriter(str(tmp_path), 0, 1, 2)
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    writer.request(b"w0", 1)
    assert writer.due()
    writer.start({0: (SPEC, 5, rows)}, left={1}, dead={0})
    assert not writer.due()  # one write at a time
    writer.request(b"w1", 2)  # waits for the next write
    assert _finish(writer) == Written({0: 5}, True, [(b"w0", 1)])
    assert writer.requests == [(b"w1", 2)]
    assert writer.left_written == frozenset({1})
    assert writer.dead_written == frozenset({0})
    assert writer.due() and writer.finished() is None
    tables, left, dead = checkpoint.load_job(str(tmp_path), 0, 1, 2)
    assert left == {1} and dead == {0}
    np.testing.assert_array_equal(tables[0][2], rows)
    assert tables[0][1] == 5


def test_a_failed_write_refuses_its_requests_and_backs_off(tmp_path,
                                                           monkeypatch):
    now = [1000.0]  # the writer's clock, moved by hand
    monkeypatch.setattr(writer_module, "time",
                        types.SimpleNamespace(monotonic=lambda: now[0]))
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    writer = CheckpointWriter(str(blocker / "ckpt"), 0, 1, 1)
    writer.request(b"w0", 1)
    writer.start({}, left={0})
    assert _finish(writer) == Written({}, False, [(b"w0", 1)])
    assert writer.left_written == frozenset()  # not on disk
    assert not writer.due()  # 1 s, then 2, 4 ... 60
    now[0] += 0.9
    assert not writer.due()
    now[0] += 0.2
    assert writer.due()
    writer.start({}, left=())
    assert not _finish(writer).ok
    now[0] += 1.9
    assert not writer.due()
    blocker.unlink()  # the disk is fine again
    now[0] += 0.2
    assert writer.due()
    writer.start({}, left={0})
    assert _finish(writer).ok
    assert writer.due()  # no backoff after a success
    assert writer.left_written == frozenset({0})
    shutil.rmtree(blocker)
    blocker.write_bytes(b"")  # failing again: from 1 s
    for backoff in (1, 2, 4, 8, 16, 32, 60, 60):
        writer.start({}, left=())
        assert not _finish(writer).ok
        now[0] += backoff - 0.1
        assert not writer.due(), backoff
        now[0] += 0.2
        assert writer.due(), backoff


def test_requests_beyond_the_bound_are_refused(tmp_path):
    writer = CheckpointWriter(str(tmp_path), 0, 1, 1)
    for seq in range(MAX_CHECKPOINT_REQUESTS):
        writer.request(b"w0", seq)
    with pytest.raises(RequestError, match="already wait"):
        writer.request(b"w0", MAX_CHECKPOINT_REQUESTS)
    assert len(writer.requests) == MAX_CHECKPOINT_REQUESTS


def test_write_empty_keeps_a_checkpoint_found_and_names_a_bad_folder(
        tmp_path):
    writer = CheckpointWriter(str(tmp_path), 0, 1, 1)
    writer.start({0: (SPEC, 3, np.ones((4, 3), np.float32))}, left=())
    assert _finish(writer).ok
    writer.write_empty()  # a restart without --restore
    assert checkpoint.load(str(tmp_path), 0, 1, 1) == {}
    kept = tmp_path / "kept"
    kept.mkdir()
    path = checkpoint.checkpoint_path(str(tmp_path), 0, 1)
    os.replace(path + ".previous",
               checkpoint.checkpoint_path(str(kept), 0, 1))
    assert checkpoint.load(str(kept), 0, 1, 1)[0][1] == 3
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="a-file"):
        CheckpointWriter(str(blocker), 0, 1, 1).write_empty()


def test_a_second_shard_on_a_folder_in_use_is_refused(tmp_path):
    """Two jobs' shard 0 of 1 started on one folder: the second moved the
    first's checkpoint away, and each then overwrote the other's. The
    second is refused, naming the folder and the process holding it, and
    touches nothing; a shard of another place may share the folder, and
    once the first has stopped a shard restores from it."""
    from keras_geeps.shard import ShardServer, ShardSettings  # noqa

    settings = ShardSettings(checkpoint_dir=str(tmp_path),
                             shared_memory=False)
    first = ShardServer("tcp://127.0.0.1:0", 0, 1, 1, settings).start()
    try:
        before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
        with pytest.raises(checkpoint.CheckpointError,
                           match=f"in use by another shard 0 of 1 \\(process "
                                 f"{os.getpid()}"):
            ShardServer("tcp://127.0.0.1:0", 0, 1, 1, settings)
        assert {p.name: p.stat().st_mtime_ns
                for p in tmp_path.iterdir()} == before
        ShardServer("tcp://127.0.0.1:0", 1, 2, 1, settings)._close()
    finally:
        first.stop()
    ShardServer("tcp://127.0.0.1:0", 0, 1, 1, settings,
                restore=True)._close()
