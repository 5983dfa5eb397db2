"""A damaged checkpoint file never restores other rows than were written.

A disk or a copy can flip a bit or cut a file short. The format's zip
container keeps a CRC-32 of every member, and `checkpoint.load_job`
checks the rest: each damaged file must either fail with a
`CheckpointError` naming it, or (a bit of zip bookkeeping that nothing
reads) load exactly what was written.
"""

import io
import json
import os
import zipfile

import numpy as np
import pytest

from keras_geeps import checkpoint, protocol

SPECS = {
    3: {"name": "dense", "rows": 6, "width": 5, "dtype": "float32",
        "row_start": 0, "row_end": 6},
    8: {"name": "half", "rows": 4, "width": 3, "dtype": "bfloat16",
        "row_start": 2, "row_end": 4},
}


@pytest.fixture
def written(tmp_path):
    """A checkpoint of two tables, its bytes, and what it holds."""
    rng = np.random.default_rng(3)
    snapshots = {
        3: (SPECS[3], 10, rng.standard_normal((6, 5)).astype(np.float32)),
        8: (SPECS[8], 10, rng.standard_normal((2, 3)).astype(
            protocol.numpy_dtype("bfloat16"))),
    }
    path = checkpoint.write(tmp_path, 1, 2, 3, snapshots, left={2},
                            dead={0})
    with open(path, "rb") as f:
        return tmp_path, path, f.read(), snapshots


def _outcome(directory, path, snapshots):
    """'same' when the damaged file loads what was written, 'refused'
    when it fails naming the file; anything else fails the test."""
    try:
        tables, left, dead = checkpoint.load_job(directory, 1, 2, 3)
    except checkpoint.CheckpointError as exc:
        assert str(path) in str(exc), exc
        return "refused"
    assert left == {2} and dead == {0}
    assert tables.keys() == snapshots.keys()
    for tid, (spec, clock, rows) in snapshots.items():
        assert tables[tid][0] == spec and tables[tid][1] == clock
        np.testing.assert_array_equal(tables[tid][2].view(np.uint8),
                                      rows.view(np.uint8))
    return "same"


def test_every_flipped_bit_is_refused_or_harmless(written):
    directory, path, raw, snapshots = written
    # Where the stored rows lie in the file (the archive is uncompressed):
    # a flip there must always be refused.
    rows_at = set()
    for _, _, rows in snapshots.values():
        start = raw.find(rows.tobytes())
        assert start > 0 and raw.count(rows.tobytes()) == 1
        rows_at.update(range(start, start + rows.nbytes))
    harmless = []
    for at in range(len(raw)):
        damaged = bytearray(raw)
        damaged[at] ^= 1 << (at % 8)
        with open(path, "wb") as f:
            f.write(damaged)
        if _outcome(directory, path, snapshots) == "same":
            harmless.append(at)
    assert not rows_at.intersection(harmless)
    # Only zip bookkeeping that loading does not read (times, attributes,
    # sizes duplicated elsewhere) may change unnoticed.
    assert len(harmless) < 0.25 * len(raw), len(harmless)


def test_every_cut_is_refused(written):
    directory, path, raw, snapshots = written
    for length in range(len(raw)):
        with open(path, "wb") as f:
            f.write(raw[:length])
        assert _outcome(directory, path, snapshots) == "refused", length


@pytest.mark.parametrize("content", [b"torn", b"\x80\x04K\x01.", b""],
                         ids=["text", "pickle", "empty"])
def test_a_file_that_is_no_archive_is_named_as_such(tmp_path, content):
    """np.load takes such a file for a pickle and suggests loading it
    unsafely; the error says what it is instead."""
    path = checkpoint.checkpoint_path(tmp_path, 0, 1)
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.load_job(tmp_path, 0, 1, 1)
    assert f"{path} is not a checkpoint" in str(caught.value)
    assert "pickle" not in str(caught.value)


def _crafted(path, table, compression=zipfile.ZIP_STORED,
             meta_compression=zipfile.ZIP_STORED):
    """A checkpoint of table 3 (SPECS) at `path` whose table member holds
    `table` (an array, or the bytes of an npy file), written with
    `compression` (the meta with `meta_compression`)."""
    meta = {"format": checkpoint.FORMAT, "shard_id": 0, "num_shards": 1,
            "num_workers": 1, "left": [], "dead": [],
            "tables": {"3": {"spec": SPECS[3], "clock": 4}}}
    with zipfile.ZipFile(path, "w") as archive:
        for name, array, how in (
                ("meta", np.frombuffer(json.dumps(meta).encode(), np.uint8),
                 meta_compression), ("table_3", table, compression)):
            member = io.BytesIO()
            if isinstance(array, bytes):
                member.write(array)
            else:
                np.save(member, array)
            archive.writestr(name + ".npy", member.getvalue(), how)


def _npy_header(shape, descr="<f4"):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {
        "descr": descr, "fortran_order": False, "shape": shape})
    return header.getvalue()


@pytest.mark.parametrize("table, compression, problem", [
    # A member far larger than its spec: refused before it is read.
    (np.zeros((100_000, 5), np.float32), zipfile.ZIP_STORED,
     "table_3 holds 2000128 bytes, more than the 65656 it may"),
    # A deflated one (what a small file would inflate from): refused.
    (np.zeros((6, 5), np.float32), zipfile.ZIP_DEFLATED,
     "table_3 is compressed"),
    # A header whose shape would allocate 4 GB, over a few bytes.
    (_npy_header((1 << 28, 4)) + bytes(120), zipfile.ZIP_STORED,
     r"table_3 holds float32 \(268435456, 4\), not float32 \(6, 5\)"),
    (np.zeros((6, 5), np.float64), zipfile.ZIP_STORED,
     r"table_3 holds float64 \(6, 5\), not float32"),
    (np.zeros((6, 5), np.float32, order="F"), zipfile.ZIP_STORED,
     r"\(Fortran order\)"),
    # Rows cut short, or more than the header says.
    (_npy_header((6, 5)) + bytes(119), zipfile.ZIP_STORED,
     "does not hold the 120 bytes its header says"),
    (_npy_header((6, 5)) + bytes(121), zipfile.ZIP_STORED,
     "does not hold the 120 bytes its header says"),
])
def test_a_crafted_member_is_refused_before_it_is_read(tmp_path, table,
                                                       compression, problem):
    path = checkpoint.checkpoint_path(str(tmp_path), 0, 1)
    _crafted(path, table, compression)
    with pytest.raises(checkpoint.CheckpointError, match=problem):
        checkpoint.load_job(str(tmp_path), 0, 1, 1)
    _crafted(path, np.zeros((6, 5), np.float32), zipfile.ZIP_STORED,
             meta_compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(checkpoint.CheckpointError, match="meta is "
                       "compressed"):
        checkpoint.load_job(str(tmp_path), 0, 1, 1)
    _crafted(path, np.ones((6, 5), np.float32))  # the same, as written
    assert checkpoint.load(str(tmp_path), 0, 1, 1)[3][1] == 4


def test_the_folders_a_write_creates_are_made_durable(tmp_path,
                                                      monkeypatch):
    """A crash must not lose the folder entries the checkpoint is under:
    each folder the write creates has its parent fsynced."""
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (
        synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    directory = tmp_path / "run" / "checkpoints"
    checkpoint.write(str(directory), 0, 1, 1, {3: (
        SPECS[3], 1, np.ones((6, 5), np.float32))})
    for folder in (tmp_path, tmp_path / "run", directory):
        assert str(folder) in synced
    # `..` after a link removes the link's name, as tempfile takes it.
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    checkpoint.write(str(tmp_path / "link" / ".." / "new"), 0, 1, 1, {})
    assert checkpoint.load(str(tmp_path / "new"), 0, 1, 1) == {}
