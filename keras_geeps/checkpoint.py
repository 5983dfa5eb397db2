"""Shard checkpoints: the on-disk format, atomic writes, loading.

A shard snapshots a table whenever the table's global clock reaches a
multiple of K (`--checkpoint-every K`), and at the clock a worker that
left, died (the job going on without it) or rejoined had reached, whose
updates no worker could replay: the snapshot holds exactly the
updates of the clocks before that clock, so the snapshots of one table on
every shard are at the same clock and together form a consistent copy of
the job. The shard then writes all its latest snapshots to

    <dir>/shard-<id>-of-<num_shards>.ckpt.npz

an uncompressed numpy `.npz` archive with

- `meta`: a uint8 array holding UTF-8 JSON: {"format": 1, "shard_id",
  "num_shards", "num_workers", "tables": {"<table id>": {"spec": {name,
  rows, width, dtype, row_start, row_end[, per_clock: true]}, "clock":
  C[, "own_clock": true]}}, "left": [worker ids], "dead": [worker ids]}
  ("own_clock": C is this shard's own, see below; "left": the workers
  whose client had closed, which a restored shard does not wait to hear
  from; "dead": those declared dead, the job going on without them
  (`--on-worker-failure continue`), whose clocks a restored shard does
  not wait for; either absent in older files: none; "per_clock": only for
  a per-clock table, see `protocol.PER_CLOCK`);
- `table_<id>`: the table's rows on this shard at clock C
  (row_end - row_start rows of `width` elements; bfloat16 stored as its
  uint16 bits).

Writes go to a temporary file in the same folder, are fsynced, then
renamed over the old file: a crash at any point leaves either the old or
the new checkpoint, never a torn one. Each table's snapshot before its
latest is kept in

    <dir>/shard-<id>-of-<num_shards>.older.ckpt.npz

(the replaced file itself, by a hard link made before the rename, when
the new one moves every table; otherwise a copy that keeps the older
snapshot of each table the new one leaves at its clock, so a write that
moves only some tables, as per-layer clocks crossing a multiple of K one
after another make, never leaves a table's latest clock in both files;
and a snapshot at the shard's own clock, which the table's other shards
may not hold (one taken on request, or where a worker rejoined), never
displaces there one at a clock they all take: a multiple of K, or where
a worker left or died):
each shard writes on its own, so a whole job killed between two shards'
writes leaves one shard's latest snapshot of a table a checkpoint ahead
of another's; `align_job`, run
before a whole job starts again from its checkpoint (`keras-geeps launch`
does; by hand, `keras-geeps align-checkpoints`), takes every table back to
the latest clock all its shards hold, from these two files.

Workers keep every update of the clocks at or after a table's checkpoint
clock and replay them to a shard restored from it (`keras-geeps shard
--checkpoint-dir DIR --restore`).

A shard writes a checkpoint of no tables when it starts (without
--restore; the two files found there, if they hold tables, are renamed
`<file>.previous`, or `.previous.N` where that exists), so one killed
before its first snapshot was durable restores empty rather than failing.
A table the restored checkpoint lacks is created again by the worker that
created it, which keeps the initial rows until a checkpoint holds them,
and every worker replays it from clock 0.
"""

import contextlib
import io
import json
import math
import os
import shutil
import tempfile
import zipfile

import numpy as np

from keras_geeps import protocol

FORMAT = 1
# Clocks a checkpoint may hold: below the shard's dead-worker mark.
MAX_CLOCK = 1 << 61
# How every checkpoint file starts (a zip archive's first local header).
ZIP_MAGIC = b"PK\x03\x04"
# Most bytes a checkpoint's meta may hold (a table's entry takes about
# 200), and room for a member's npy header beside its rows: what a crafted
# file's members are held to before anything is read.
MAX_META_BYTES = 64 << 20
NPY_HEADER_BYTES = 1 << 16


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, unwritable or for another
    job."""


def checkpoint_path(directory, shard_id, num_shards, older=False):
    """The checkpoint file of one shard (with `older`: the one before).
    (`directory` made absolute as text, as `write`'s temporary files are:
    a `..` after a link removes the link's name.)"""
    kind = ".older" if older else ""
    return os.path.join(os.path.abspath(directory),
                        f"shard-{shard_id}-of-{num_shards}{kind}.ckpt.npz")


def make_folder(directory):
    """Creates `directory` and the folders above it that are missing, each
    made durable (its parent fsynced), so that a crash never loses a
    folder that checkpoints were written into."""
    missing = []
    # (`..` taken as text, as tempfile and the writes take it: even after
    # a link, it removes the name before it)
    directory = folder = os.path.abspath(directory)
    while not os.path.isdir(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    os.makedirs(directory, exist_ok=True)
    for folder in reversed(missing):
        try:
            _fsync_folder(os.path.dirname(folder))
        except PermissionError:  # a parent we may write, not read
            pass


def _fsync_folder(directory):
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def temporary_prefix(shard_id, num_shards):
    """How a shard's checkpoint being written is named until renamed (a
    shard removes its own left by a crash when it starts again)."""
    return f".ckpt-{shard_id}-of-{num_shards}-"


def write(directory, shard_id, num_shards, num_workers, snapshots,
          left=(), dead=(), own_clock=()):
    """Atomically writes a shard's table snapshots.

    Args:
        directory: the checkpoint folder (created if missing).
        shard_id, num_shards, num_workers: the shard's place in the job.
        snapshots: {table_id: (spec dict, clock, rows array)}.
        left: ids of the workers that left (closed their client).
        dead: ids of the workers declared dead, the job going on without
            them.
        own_clock: ids of the tables whose snapshot is at this shard's
            own clock (a requested checkpoint, a rejoin): the table's
            other shards may hold another. Replaced by a newer one, such a
            snapshot does not displace, as the table's older one, one at a
            clock every shard takes.

    Returns:
        The checkpoint file's path.
    """
    directory = os.path.abspath(directory)
    make_folder(directory)
    meta = {"format": FORMAT, "shard_id": shard_id, "num_shards": num_shards,
            "num_workers": num_workers, "tables": {
                str(tid): dict({"spec": spec, "clock": int(clock)}, **(
                    {"own_clock": True} if tid in own_clock else {}))
                for tid, (spec, clock, _) in snapshots.items()},
            "left": sorted(int(w) for w in left),
            "dead": sorted(int(w) for w in dead)}
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    for tid, (spec, _, rows) in snapshots.items():
        if spec["dtype"] == "bfloat16":
            rows = rows.view(np.uint16)
        arrays[f"table_{tid}"] = rows
    path = checkpoint_path(directory, shard_id, num_shards)
    older = checkpoint_path(directory, shard_id, num_shards, older=True)
    prefix = temporary_prefix(shard_id, num_shards)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    link = tmp + ".older"
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):  # the one replaced stays as the older
            sources = _older_sources(path, older, meta["tables"])
            try:
                if sources:
                    _write_composite(link, path, sources)
            except (CheckpointError, KeyError, TypeError, ValueError,
                    zipfile.BadZipFile):  # a damaged older: keep the latest
                sources = None
                if os.path.exists(link):
                    os.unlink(link)
            if sources is None:
                os.link(path, link)
            if sources != {}:
                os.replace(link, older)
        os.replace(tmp, path)
        _fsync_folder(directory)
    except BaseException:
        for leftover in (tmp, link):
            if os.path.exists(leftover):
                os.unlink(leftover)
        raise
    return path


def _older_sources(path, older, new_tables):
    """Where the older file's snapshot of each table comes from when the
    latest checkpoint `path` is replaced by one of `new_tables` (meta
    entries): a table whose clock the new one changes keeps its latest
    snapshot as its older one, unless that is at the shard's own clock
    and the older file's is not (`write`); a table it leaves at the same
    clock keeps the older file's, if that is at another clock (a write
    that moves only some tables, as per-layer clocks crossing a multiple
    of K one by one make, must not leave a table's latest clock in both
    files: `align_job` could then take no table back a checkpoint).

    Returns:
        None to keep `path` whole as the older file (what most writes
        do), {} to leave the older file as it is, else {table id: the
        file to copy its snapshot from}.
    """
    try:
        latest = read_meta(path)["tables"]
        before = read_meta(older)["tables"] if os.path.exists(older) else {}
        sources, from_older = {}, 0
        for tid, entry in latest.items():
            kept = before.get(tid)
            same = tid in new_tables and \
                new_tables[tid]["clock"] == entry["clock"]
            own = kept is not None and entry.get("own_clock") is True \
                and kept.get("own_clock") is not True
            if (same or own) and kept is not None and \
                    kept["clock"] != entry["clock"]:
                sources[tid] = older
                from_older += 1
            else:
                sources[tid] = path
    except (CheckpointError, KeyError, TypeError, AttributeError):
        return None  # a damaged file: kept whole, as any other
    if not from_older:
        return None
    if from_older == len(sources) == len(before):
        return {}  # the older file holds just these already
    return sources


def _write_composite(target, latest_path, sources):
    """Writes (and fsyncs) a checkpoint at `target` holding each table's
    snapshot from the file `sources` names, with the latest file's other
    meta. Rows are copied between the archives as they are stored, a
    megabyte at a time (no table is read whole into memory)."""
    files = {latest_path, *sources.values()}  # two at most
    metas = {path: read_meta(path) for path in files}
    meta = dict(metas[latest_path], tables={
        tid: metas[source]["tables"][tid] for tid, source in sources.items()})
    header = io.BytesIO()
    np.save(header, np.frombuffer(json.dumps(meta).encode(), np.uint8))
    with contextlib.ExitStack() as stack:
        archives = {path: stack.enter_context(zipfile.ZipFile(path))
                    for path in files}
        # (owner only, as the latest, which mkstemp makes: tables' rows)
        f = stack.enter_context(os.fdopen(os.open(
            target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb"))
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED,
                             allowZip64=True) as out:
            out.writestr("meta.npy", header.getvalue())
            for tid, source in sources.items():
                name = f"table_{tid}.npy"
                _stored(source, archives[source], f"table_{tid}", _rows_bytes(
                    metas[source]["tables"][tid]["spec"]))
                with archives[source].open(name) as rows, \
                        out.open(name, "w", force_zip64=True) as copy:
                    shutil.copyfileobj(rows, copy, 1 << 20)
        f.flush()
        os.fsync(f.fileno())


def _archive(path, f):
    """The npz archive open in `f`; a file that does not start as one
    is refused here (np.load would take it for a pickle)."""
    if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
        raise CheckpointError(f"{path} is not a checkpoint: it does not "
                              f"start as an npz (zip) archive does "
                              f"(torn, or another kind of file)")
    f.seek(0)
    return np.load(f, allow_pickle=False)


def _stored(path, archive, key, max_bytes):
    """The zip entry of `key` in `archive` (a zipfile.ZipFile), once found
    stored (uncompressed, as every checkpoint writes its members) and of at
    most `max_bytes`: a crafted file's compressed or oversized member
    must not set what a read allocates."""
    try:
        info = archive.getinfo(key + ".npy")
    except KeyError:
        raise CheckpointError(f"{path}: it holds no {key}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{path}: its {key} is compressed; a "
                              f"checkpoint's members are stored as they are")
    if info.file_size > max_bytes:
        raise CheckpointError(f"{path}: its {key} holds {info.file_size} "
                              f"bytes, more than the {max_bytes} it may")
    return info


def _member(path, archive, key, dtype, shape=None,
            max_bytes=MAX_META_BYTES):
    """The array `archive` (an npz) holds as `key`, read only once its
    entry passes `_stored` and its npy header says `dtype` and `shape`
    (None: any 1-D shape): what the header says is what a read allocates.
    The whole member is read, so that the zip's CRC-32 is checked."""
    info = _stored(path, archive.zip, key, max_bytes)
    readers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    with archive.zip.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in readers:
            raise CheckpointError(f"{path}: its {key} is npy version "
                                  f"{version}, not 1.0 or 2.0")
        got, fortran, got_dtype = readers[version](f)
        if got_dtype != dtype or fortran or (
                len(got) != 1 if shape is None else got != shape):
            raise CheckpointError(
                f"{path}: its {key} holds {got_dtype} {got}"
                f"{' (Fortran order)' if fortran else ''}, not {dtype} "
                f"{'(n,)' if shape is None else shape}")
        nbytes = math.prod(got) * dtype.itemsize
        if nbytes > max_bytes:
            raise CheckpointError(f"{path}: its {key} holds {nbytes} bytes, "
                                  f"more than the {max_bytes} it may")
        rows = bytearray(nbytes)
        if f.readinto(rows) != nbytes or f.read(1):
            raise CheckpointError(f"{path}: its {key} does not hold the "
                                  f"{nbytes} bytes its header says")
    return np.frombuffer(rows, dtype).reshape(got)


def _meta(path, archive):
    return json.loads(_member(path, archive, "meta",
                              np.dtype(np.uint8)).tobytes().decode())


def _rows_bytes(spec):
    """The bytes of a checkpoint's table member of `spec`, at most."""
    return (spec["row_end"] - spec["row_start"]) * spec["width"] * \
        protocol.numpy_dtype(spec["dtype"]).itemsize + NPY_HEADER_BYTES


def _existing(directory, shard_id, num_shards, older=False):
    """A shard's checkpoint path; CheckpointError naming it if missing."""
    path = checkpoint_path(directory, shard_id, num_shards, older)
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint of shard {shard_id}/"
                              f"{num_shards} at {path}")
    return path


def read_meta(path):
    """A checkpoint file's `meta` (the JSON dict), without its rows.

    Raises:
        CheckpointError: the file is missing, torn or no checkpoint.
    """
    try:
        with open(path, "rb") as f, _archive(path, f) as archive:
            meta = _meta(path, archive)
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path}: its meta is a JSON "
                                  f"{type(meta).__name__}, not the object "
                                  f"a checkpoint holds")
        return meta
    except CheckpointError:
        raise
    except Exception as exc:  # zip/npz/JSON errors of many kinds
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") \
            from exc


def own_clock_tables(directory, shard_id, num_shards):
    """The ids of the tables whose snapshot in a shard's latest checkpoint
    is at the shard's own clock (`write`'s `own_clock`), which a restored
    shard keeps so: its next write must not let it displace the older
    snapshot at a clock every shard takes.

    Raises:
        CheckpointError: the checkpoint is missing or unreadable.
    """
    path = _existing(directory, shard_id, num_shards)
    tables = read_meta(path).get("tables")
    return {int(tid) for tid, entry in tables.items()
            if isinstance(entry, dict) and entry.get("own_clock") is True} \
        if isinstance(tables, dict) else set()


def load(directory, shard_id, num_shards, num_workers):
    """Reads a shard's table snapshots (`load_job`'s first half)."""
    return load_job(directory, shard_id, num_shards, num_workers)[0]


def load_job(directory, shard_id, num_shards, num_workers, older=False,
             limits=None):
    """Reads a shard's checkpoint.

    Args:
        directory: the checkpoint folder.
        shard_id, num_shards, num_workers: the shard's place in the job;
            the checkpoint must be for the same ones.
        older: read the checkpoint before the latest. Defaults to False.
        limits: optional `limits({table_id: spec})`, what is beyond the
            reader's limits (a string) or None, called with the checked
            specs before any rows are read. Defaults to None.

    Returns:
        ({table_id: (spec dict, clock, rows array)}, the set of the
        workers that had left, the set of those declared dead).

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    path = _existing(directory, shard_id, num_shards, older)
    try:
        with open(path, "rb") as f, _archive(path, f) as archive:
            meta = _meta(path, archive)
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
            specs = {}
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
                specs[int(tid)] = (spec, clock)
            problem = None if limits is None else limits(
                {tid: spec for tid, (spec, _) in specs.items()})
            if problem is not None:
                raise CheckpointError(f"{path}: {problem}")
            tables = {}
            for tid, (spec, clock) in specs.items():
                dtype = protocol.numpy_dtype(spec["dtype"])
                stored = np.dtype(np.uint16) if spec["dtype"] == "bfloat16" \
                    else dtype  # npz keeps bfloat16 rows as their bits
                rows = _member(path, archive, f"table_{tid}", stored, (
                    spec["row_end"] - spec["row_start"], spec["width"]),
                    _rows_bytes(spec))
                tables[tid] = (spec, clock, rows.view(dtype))
            gone = {}
            for key in ("left", "dead"):
                workers = meta.get(key, [])
                if not isinstance(workers, list) or not all(
                        isinstance(w, int) and not isinstance(w, bool)
                        and 0 <= w < num_workers for w in workers):
                    raise CheckpointError(
                        f"{path}: {key} {workers!r} is not a list of "
                        f"worker ids in [0, {num_workers})")
                gone[key] = set(workers)
            if gone["left"] & gone["dead"]:
                raise CheckpointError(
                    f"{path}: workers {sorted(gone['left'] & gone['dead'])}"
                    f" are both left and dead")
            return tables, gone["left"], gone["dead"]
    except CheckpointError:
        raise
    except Exception as exc:  # zip/npz/JSON errors of many kinds
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") \
            from exc


def _clocks_of(path):
    """{table id: (spec, clock)} from a checkpoint's meta (no rows read)."""
    try:
        clocks = {int(tid): (entry["spec"], entry["clock"])
                  for tid, entry in read_meta(path)["tables"].items()}
        for spec, clock in clocks.values():
            if not all(isinstance(value, int) and not isinstance(value, bool)
                       for value in (clock, spec["rows"], spec["row_start"],
                                     spec["row_end"])):
                raise TypeError(f"table {spec.get('name')!r}: its clock "
                                f"and row range are not ints")
        return clocks
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: its meta lists no tables as a "
                              f"checkpoint's does ({exc!r})") from None


def table_clocks(directory, num_shards):
    """{table id: {shard: clock}} of the shards' latest checkpoints (from
    their metas; a shard without one is left out).

    Raises:
        CheckpointError: a checkpoint that cannot be read.
    """
    clocks = {}
    for shard in range(num_shards):
        path = checkpoint_path(directory, shard, num_shards)
        if os.path.exists(path):
            for tid, (_, clock) in _clocks_of(path).items():
                clocks.setdefault(tid, {})[shard] = clock
    return clocks


def _picks_at(tid, target, latest, older):
    """{shard: whether from its older file} of the snapshots of table `tid`
    at clock `target` that together cover its rows, one per shard that
    holds a part of it; None where some part is at no such clock. A
    shard's older file counts only where its latest holds the table too:
    a part only the older holds is from a run an earlier alignment left
    out, not this one's."""
    rows = next(tables[tid][0]["rows"] for tables in latest
                if tid in tables)
    picks, covered = {}, 0
    for shard in range(len(latest)):
        if tid not in latest[shard]:
            continue
        for from_older, tables in ((False, latest[shard]),
                                   (True, older[shard])):
            spec, clock = tables.get(tid, (None, None))
            if clock == target:
                picks[shard] = from_older
                covered += spec["row_end"] - spec["row_start"]
                break
    if covered != rows or any(tid in latest[s] and s not in picks
                              for s in range(len(latest))):
        return None
    return picks


def align_job(directory, num_shards, num_workers):
    """Takes every shard's checkpoint to one clock per table.

    Each shard snapshots a table when its clock reaches a multiple of K and
    writes on its own, so after the whole job was killed one shard's
    latest snapshot of a table can be a checkpoint ahead of another's. A
    shard restarted alone is restored from its latest (its workers replay
    what follows), but a whole job started again from its checkpoint needs
    the shards of each table at one clock: this rewrites, where needed,
    each shard's checkpoint with every table at the latest clock all of
    its shards hold (from the latest or the older file). A table some
    shard's part of which is in neither at that clock is left out
    everywhere: its creator creates it again, from its initial values.
    The plan comes from the files' metas; rows are read only for a shard
    whose checkpoint is rewritten.

    Args:
        directory: the checkpoint folder of all `num_shards` shards.
        num_shards, num_workers: the job's.

    Returns:
        {table id: the clock it is at now, or None where it was left out}.

    Raises:
        CheckpointError: a shard's latest checkpoint is missing or
            unreadable, or (where rewritten) for another job.

    Example:

    ```python
    align_job("/tmp/ckpt", num_shards=2, num_workers=4)  # {0: 20, 1: 20}
    ```
    """
    latest, older = [], []
    for shard in range(num_shards):
        latest.append(_clocks_of(_existing(directory, shard, num_shards)))
        try:
            older.append(_clocks_of(_existing(directory, shard, num_shards,
                                              older=True)))
        except CheckpointError:
            older.append({})  # none yet, or unreadable: no way back
    # chosen[shard]: {table id: True where its older file holds the clock}
    chosen = [{} for _ in range(num_shards)]
    result = {}
    for tid in sorted({tid for tables in latest for tid in tables}):
        # The latest clock every shard of the table holds: at most the
        # least of their latest, and perhaps only an older one.
        ceiling = min(tables[tid][1] for tables in latest if tid in tables)
        candidates = sorted({tables[tid][1] for tables in latest + older
                             if tid in tables and tables[tid][1] <= ceiling},
                            reverse=True)
        result[tid] = None
        for target in candidates:
            picks = _picks_at(tid, target, latest, older)
            if picks is not None:
                result[tid] = target
                for shard, from_older in picks.items():
                    chosen[shard][tid] = from_older
                break
    for shard in range(num_shards):
        if set(chosen[shard]) == set(latest[shard]) and \
                not any(chosen[shard].values()):
            continue  # every table of it as it is
        tables, left, dead = load_job(directory, shard, num_shards,
                                      num_workers)
        before = load_job(directory, shard, num_shards, num_workers,
                          older=True)[0] if any(
                              chosen[shard].values()) else {}
        write(directory, shard, num_shards, num_workers,
              {tid: (before if from_older else tables)[tid]
               for tid, from_older in chosen[shard].items()}, left, dead)
    return result
