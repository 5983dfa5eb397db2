"""Shard checkpoints: the on-disk format, atomic writes, loading.

A shard snapshots a table whenever the table's global clock reaches a
multiple of K (`--checkpoint-every K`): the snapshot holds exactly the
updates of the clocks before that clock, so the snapshots of one table on
every shard are at the same clock and together form a consistent copy of
the job. The shard then writes all its latest snapshots to

    <dir>/shard-<id>-of-<num_shards>.ckpt.npz

an uncompressed numpy `.npz` archive with

- `meta`: a uint8 array holding UTF-8 JSON: {"format": 1, "shard_id",
  "num_shards", "num_workers", "tables": {"<table id>": {"spec": {name,
  rows, width, dtype, row_start, row_end[, per_clock: true]}, "clock":
  C}}, "left": [worker ids]} ("left": the workers whose client had
  closed, which a restored shard does not wait to hear from; absent in
  older files: none; "per_clock": only for a per-clock table, see
  `protocol.PER_CLOCK`);
- `table_<id>`: the table's rows on this shard at clock C
  (row_end - row_start rows of `width` elements; bfloat16 stored as its
  uint16 bits).

Writes go to a temporary file in the same folder, are fsynced, then
renamed over the old file: a crash at any point leaves either the old or
the new checkpoint, never a torn one. Workers keep every update of the
clocks at or after a table's checkpoint clock and replay them to a shard
restored from it (`keras-geeps shard --checkpoint-dir DIR --restore`).

A shard writes a checkpoint of no tables when it starts (without
--restore; one found there is renamed `<file>.previous`), so one killed
before its first snapshot was durable restores empty rather than failing.
A table the restored checkpoint lacks is created again by the worker that
created it, which keeps the initial rows until a checkpoint holds them,
and every worker replays it from clock 0.
"""

import json
import os
import tempfile

import numpy as np

from keras_geeps import protocol

FORMAT = 1
# Clocks a checkpoint may hold: below the shard's dead-worker mark.
MAX_CLOCK = 1 << 61
# How every checkpoint file starts (a zip archive's first local header).
ZIP_MAGIC = b"PK\x03\x04"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, unwritable or for another
    job."""


def checkpoint_path(directory, shard_id, num_shards):
    """The checkpoint file of one shard."""
    return os.path.join(directory,
                        f"shard-{shard_id}-of-{num_shards}.ckpt.npz")


def write(directory, shard_id, num_shards, num_workers, snapshots,
          left=()):
    """Atomically writes a shard's table snapshots.

    Args:
        directory: the checkpoint folder (created if missing).
        shard_id, num_shards, num_workers: the shard's place in the job.
        snapshots: {table_id: (spec dict, clock, rows array)}.
        left: ids of the workers that left (closed their client).

    Returns:
        The checkpoint file's path.
    """
    os.makedirs(directory, exist_ok=True)
    meta = {"format": FORMAT, "shard_id": shard_id, "num_shards": num_shards,
            "num_workers": num_workers, "tables": {
                str(tid): {"spec": spec, "clock": int(clock)}
                for tid, (spec, clock, _) in snapshots.items()},
            "left": sorted(int(w) for w in left)}
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    for tid, (spec, _, rows) in snapshots.items():
        if spec["dtype"] == "bfloat16":
            rows = rows.view(np.uint16)
        arrays[f"table_{tid}"] = rows
    path = checkpoint_path(directory, shard_id, num_shards)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _archive(path, f):
    """The npz archive open in `f`; a file that does not start as one
    is refused here (np.load would take it for a pickle)."""
    if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
        raise CheckpointError(f"{path} is not a checkpoint: it does not "
                              f"start as an npz (zip) archive does "
                              f"(torn, or another kind of file)")
    f.seek(0)
    return np.load(f, allow_pickle=False)


def load(directory, shard_id, num_shards, num_workers):
    """Reads a shard's table snapshots (`load_job`'s first half)."""
    return load_job(directory, shard_id, num_shards, num_workers)[0]


def load_job(directory, shard_id, num_shards, num_workers):
    """Reads a shard's checkpoint.

    Args:
        directory: the checkpoint folder.
        shard_id, num_shards, num_workers: the shard's place in the job;
            the checkpoint must be for the same ones.

    Returns:
        ({table_id: (spec dict, clock, rows array)}, the set of the
        workers that had left).

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    path = checkpoint_path(directory, shard_id, num_shards)
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint of shard {shard_id}/"
                              f"{num_shards} at {path}")
    try:
        with open(path, "rb") as f, _archive(path, f) as archive:
            meta = json.loads(archive["meta"].tobytes().decode())
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"{path}: format {meta.get('format')}"
                                      f" is not {FORMAT}")
            for key, mine in (("shard_id", shard_id),
                              ("num_shards", num_shards),
                              ("num_workers", num_workers)):
                if meta[key] != mine:
                    raise CheckpointError(f"{path} is for {key}="
                                          f"{meta[key]}, this shard has "
                                          f"{mine}")
            tables = {}
            for tid, entry in meta["tables"].items():
                spec = entry["spec"]
                problem = protocol.table_spec_problem(
                    int(tid) if tid.isdigit() and tid == str(int(tid))
                    else tid, spec)
                clock = entry["clock"]
                if problem is None and (
                        isinstance(clock, bool) or not isinstance(clock, int)
                        or not 0 <= clock < MAX_CLOCK):
                    problem = f"table {tid}: clock {clock!r} is not an int " \
                              f"in [0, {MAX_CLOCK})"
                if problem is not None:
                    raise CheckpointError(f"{path}: {problem}")
                rows = archive[f"table_{tid}"]
                dtype = protocol.numpy_dtype(spec["dtype"])
                stored = np.dtype(np.uint16) if spec["dtype"] == "bfloat16" \
                    else dtype  # npz keeps bfloat16 rows as their bits
                if rows.dtype != stored:
                    raise CheckpointError(f"{path}: table {tid} holds "
                                          f"{rows.dtype.name} rows, spec "
                                          f"says {spec['dtype']}")
                rows = rows.view(dtype)
                expected = (spec["row_end"] - spec["row_start"],
                            spec["width"])
                if rows.shape != expected:
                    raise CheckpointError(f"{path}: table {tid} has shape "
                                          f"{rows.shape}, spec says "
                                          f"{expected}")
                tables[int(tid)] = (spec, clock, rows.copy())
            left = meta.get("left", [])
            if not isinstance(left, list) or not all(
                    isinstance(w, int) and not isinstance(w, bool)
                    and 0 <= w < num_workers for w in left):
                raise CheckpointError(f"{path}: left {left!r} is not a list "
                                      f"of worker ids in [0, {num_workers})")
            return tables, set(left)
    except CheckpointError:
        raise
    except Exception as exc:  # zip/npz/JSON errors of many kinds
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") \
            from exc
