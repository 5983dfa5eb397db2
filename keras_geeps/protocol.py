"""The keras_geeps wire format: message types, encoding, decoding, validation.

Every message is a list of ZeroMQ frames::

    [msgpack header, raw frame, raw frame, ...]

(a shard's ROUTER socket sees one routing-identity frame in front). The
header is a small msgpack map; arrays travel as raw frames, never pickled,
and are described in the header by their dtype and shape so the receiver can
check every frame length before it looks at a byte of data.

This module owns the schema. The shard and the client import it and never
build a header by hand. `decode` validates every field and every frame and
raises `ProtocolError` (and nothing else) for anything malformed, truncated,
of the wrong version or too large.
"""

import enum
import json
import reprlib

import msgpack
import numpy as np

PROTOCOL_VERSION = 2  # 2: STATS_REPLY carries its JSON as a frame

# Defaults for the limits a receiver enforces. A shard may lower or raise
# them through its settings; they exist so that a hostile or broken peer
# cannot make a process allocate without bound.
MAX_HEADER_BYTES = 64 * 1024
MAX_FRAMES = 4096
MAX_MESSAGE_BYTES = 1 << 31
MAX_DIM = 1 << 40
MAX_META_ITEMS = 64
# Lists and maps in a header nest at most this deep (a frame's shape is
# at 4): deeper ones are refused before anything walks them recursively.
MAX_HEADER_NESTING = 8

# Row data is split into frames of about this many bytes: ZeroMQ streams
# 1-4 MB frames far faster than one huge frame, and the receiver can
# consume each chunk while the next is still on the wire.
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024

# ZeroMQ I/O threads per process (shard or worker). Each connection's
# CURVE encryption runs in one I/O thread; two let a shard serve two
# workers (or a worker two shards) on two cores: a 2x2 `fit` with CURVE
# went from 0.62-0.70 to 0.74 of its plain speed.
IO_THREADS = 2

# ZeroMQ's own heartbeats (ZMTP PING/PONG, in its I/O threads) on a
# worker's sockets to a shard on another host: a connection that hears
# nothing for LINK_TIMEOUT_MS after a PING is closed and connects again,
# and a sealed link that hears nothing that long (the shard echoes the
# worker's heartbeats on it) is ended. A half-open TCP connection (a
# peer's end reset by a network fault, the other never told) thus breaks
# within seconds, not TCP's minutes, and the worker resumes (see the
# client's recovery). Not on loopback, where no network breaks but a
# process paused in a debugger for longer would lose its connections.
LINK_PING_MS = 2000
LINK_TIMEOUT_MS = 20000
LINK_HEARTBEATS_ON_LOOPBACK = False  # (tests turn them on)


def is_loopback(address):
    """Whether a ZeroMQ tcp:// address names this host's loopback."""
    host = address.rsplit("//", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("localhost", "::1")


def set_link_heartbeats(sock, address):
    """Sets LINK_PING_MS and LINK_TIMEOUT_MS on a ZeroMQ socket about to
    connect to `address`, unless that is loopback."""
    import zmq  # noqa: PLC0415 (the wire format itself needs no ZeroMQ)
    if is_loopback(address) and not LINK_HEARTBEATS_ON_LOOPBACK:
        return
    sock.setsockopt(zmq.HEARTBEAT_IVL, LINK_PING_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, LINK_TIMEOUT_MS)


ALLOWED_DTYPES = (
    "float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8",
)


class ProtocolError(ValueError):
    """A message that does not follow the keras_geeps wire format."""


class MsgType(enum.IntEnum):
    """Every message type of the protocol.

    Worker -> shard requests carry a per-sender sequence number; the shard
    answers ACK (echoing it), a data reply, or ERROR. UPDATEs get no ACK of
    their own: a shard handles a connection's requests in order, so the ACK
    of the CLOCK that follows them acknowledges them all.
    """

    HELLO = 1        # worker registers; meta: num_workers, num_shards
    WELCOME = 2      # shard -> worker reply to HELLO; meta: shard settings
    CREATE = 3       # create a table; worker 0 sends initial rows
    DECLARE = 4      # subscribe to a table (created by another worker)
    READ = 5         # explicit read; clk = minimum global clock required
    ROWS = 6         # shard -> worker reply to READ; clk = data age
    UPDATE = 7       # additive delta; clk = the worker's current clock
    CLOCK = 8        # the worker finished clock `clk` of table `table`
    PUSH = 9         # shard -> worker unsolicited fresh rows; clk = data age
    ACK = 10         # shard -> worker: request `seq` done
    ERROR = 11       # shard -> worker: request `seq` refused; meta: error
    STATS = 12       # ask for statistics
    STATS_REPLY = 13  # meta: statistics
    STOP = 14        # ask the shard to shut down
    HEARTBEAT = 15   # worker -> shard: still alive (no reply)
    CHECKPOINT = 16  # ask the shard to write a checkpoint now (ACK after)
    RELEASE = 17     # worker -> shard: done reading these shared buffers
    LEAVE = 18       # worker -> shard: its client closes; silence from now
    #                  on is no death (ACK)


# Header keys and the Python types they must have. `meta` is a flat map of
# scalars and short lists, whose allowed keys depend on the message type.
_HEADER_FIELDS = {
    "v": int,        # protocol version
    "type": int,     # MsgType
    "table": int,    # table id (-1 when not about a table)
    "clk": int,      # clock (meaning depends on the type)
    "worker": int,   # sender's worker id (-1 from a shard)
    "seq": int,      # per-sender sequence number (request id)
    "frames": list,  # [[dtype, [dim, ...]], ...] one entry per raw frame
    "meta": dict,    # type-specific scalars
}

_META_SCHEMA = {
    # shm: the sender's `shm.Arena.describe()`; shm_ok: the shard can map
    # the worker's buffers (see keras_geeps/shm.py).
    MsgType.HELLO: {"num_workers": int, "num_shards": int,
                    "incarnation": int, "shm": list},
    MsgType.WELCOME: {"shard_id": int, "num_shards": int, "num_workers": int,
                      "max_message_bytes": int, "max_pending_clocks": int,
                      "checkpoint_every": int, "shm": list, "shm_ok": bool,
                      "sealed": list, "incarnation": int,
                      "worker_timeout": float, "rejoined_at": int},
    # sealed: [data port, session, c2s key, s2c key, connect token] (hex;
    # keras_geeps.seal). incarnation: the shard process's random number (a
    # worker that says HELLO again tells a reconnect from a restart by it).
    # worker_timeout: > 0 when the shard declares workers silent that long
    # dead: a worker heartbeats well within it, and says LEAVE on close.
    # rejoined_at: present when this HELLO is a new process of a worker
    # this shard knew (the others went on without it under "continue", or
    # it restarted between clocks, taking its old process's place): the
    # highest clock of the shard's tables it joined at.
    # shm: the worker maps this shard's buffers (rows may come as refs).
    # per_clock: the table's rows at each clock are the sums of that
    # clock's updates alone (table_spec_problem).
    MsgType.CREATE: {"name": str, "rows": int, "width": int, "dtype": str,
                     "row_start": int, "row_end": int, "per_clock": bool,
                     "chunk_row": int, "shm": bool},
    MsgType.DECLARE: {"name": str, "rows": int, "width": int, "dtype": str,
                      "row_start": int, "row_end": int, "per_clock": bool,
                      "shm": bool},
    MsgType.READ: {"shm": bool},
    # ref: [buffer id, fd, offset, nbytes] of the sender's shared buffer,
    # carried instead of a raw frame between co-located peers. lend: a ref
    # to the shard buffer a table's only writer may write its next rows
    # into; into: the id of that buffer, on the UPDATE that says it did.
    MsgType.ROWS: {"row_start": int, "row_end": int, "chunk_row": int,
                   "ckpt": int, "ref": list, "lend": list},
    MsgType.UPDATE: {"chunk_row": int, "indexed": bool, "ref": list,
                     "into": int},
    MsgType.CLOCK: {},
    MsgType.PUSH: {"row_start": int, "row_end": int, "chunk_row": int,
                   "ckpt": int,  # ckpt: the table's durable checkpoint clock
                   "ref": list, "lend": list},
    # On a CREATE / DECLARE: existing: the shard held the table already;
    # ready: the table has all its initial rows; restored: it is still at
    # the clock the shard's checkpoint gave it.
    MsgType.ACK: {"global_clock": int, "ckpt": int, "existing": bool,
                  "ready": bool, "restored": bool},
    MsgType.ERROR: {"error": str, "code": str},
    MsgType.STATS: {},
    MsgType.STATS_REPLY: {},  # one frame: JSON text (see stats_reply)
    MsgType.STOP: {},
    MsgType.HEARTBEAT: {},
    MsgType.CHECKPOINT: {},
    MsgType.RELEASE: {"arena": str, "buffers": list},  # buffer ids
    MsgType.LEAVE: {},
}

# ERROR codes a client acts on (other errors carry no code, or one that
# names the refusal for the caller: `GeePSServerError.code`).
ERROR_HELLO_REQUIRED = "hello_required"  # shard restarted: HELLO, replay
ERROR_WORKER_DEAD = "worker_dead"        # a worker stopped; the job stops
CLIENT_ACTS_ON = frozenset({ERROR_HELLO_REQUIRED, ERROR_WORKER_DEAD})
# A CREATE / DECLARE of a table id the shard holds with another spec.
ERROR_TABLE_EXISTS = "table_exists"

# How many raw frames each type may carry: (minimum, maximum).
_FRAME_COUNTS = {
    MsgType.CREATE: (0, MAX_FRAMES),
    # Rows travel as one frame each, or as a shared-memory "ref" (0 frames).
    MsgType.ROWS: (0, MAX_FRAMES),
    MsgType.UPDATE: (0, MAX_FRAMES),
    MsgType.PUSH: (0, MAX_FRAMES),
    MsgType.STATS_REPLY: (1, 1),
}

_INT_MIN = -(1 << 62)
_INT_MAX = 1 << 62


def dtype_name(dtype):
    """Returns the canonical wire name of a numpy (or ml_dtypes) dtype."""
    name = np.dtype(dtype).name
    if name not in ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {name!r} cannot travel; allowed: "
                            f"{', '.join(ALLOWED_DTYPES)}")
    return name


def numpy_dtype(name):
    """Returns the numpy dtype of a wire dtype name (bfloat16: ml_dtypes)."""
    if name not in ALLOWED_DTYPES:
        raise ProtocolError(f"unknown dtype {name!r}; allowed: "
                            f"{', '.join(ALLOWED_DTYPES)}")
    if name == "bfloat16":
        import ml_dtypes  # noqa: PLC0415 (ships with TensorFlow and JAX)
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Message:
    """One decoded (or to-be-encoded) protocol message.

    Args:
        type: a `MsgType`.
        table: table id, or -1. Defaults to -1.
        clk: the clock this message is about. Defaults to 0.
        worker: the sender's worker id, or -1 for a shard. Defaults to -1.
        seq: the sender's sequence number. Defaults to 0.
        arrays: numpy arrays sent as raw frames. Defaults to none.
        meta: type-specific fields (see `_META_SCHEMA`). Defaults to none.

    Example:

    >>> m = Message(MsgType.CLOCK, table=3, clk=7, worker=1, seq=42)
    >>> decode(encode(m)).clk
    7
    """

    __slots__ = ("type", "table", "clk", "worker", "seq", "arrays", "meta")

    def __init__(self, type, table=-1, clk=0, worker=-1, seq=0, arrays=(),
                 meta=None):
        self.type = MsgType(type)
        self.table = table
        self.clk = clk
        self.worker = worker
        self.seq = seq
        self.arrays = list(arrays)
        self.meta = dict(meta or {})

    def __repr__(self):
        shapes = [a.shape for a in self.arrays]
        return (f"Message({self.type.name}, table={self.table}, "
                f"clk={self.clk}, worker={self.worker}, seq={self.seq}, "
                f"arrays={shapes}, meta={self.meta})")


def encode(message):
    """Encodes a `Message` into a list of frames for `send_multipart`.

    The arrays are passed through as buffers (no copy); send them with
    `copy=False` and do not modify them until ZeroMQ is done with them.

    Args:
        message: the `Message` to encode.

    Returns:
        A list `[header_bytes, buffer, buffer, ...]`.
    """
    _check_meta(message.type, message.meta)
    frames_spec = []
    buffers = []
    for array in message.arrays:
        if not isinstance(array, np.ndarray):
            raise ProtocolError(f"array frames must be numpy arrays, got "
                                f"{type(array).__name__}")
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        frames_spec.append([dtype_name(array.dtype), list(array.shape)])
        buffers.append(array.reshape(-1).view(np.uint8) if array.size else
                       b"")
    header = {
        "v": PROTOCOL_VERSION,
        "type": int(message.type),
        "table": int(message.table),
        "clk": int(message.clk),
        "worker": int(message.worker),
        "seq": int(message.seq),
        "frames": frames_spec,
        "meta": message.meta,
    }
    return [msgpack.packb(header, use_bin_type=True)] + buffers


def decode(frames, max_message_bytes=MAX_MESSAGE_BYTES):
    """Decodes and validates a received message.

    Args:
        frames: the received frames (bytes, memoryviews or `zmq.Frame`s),
            header first; the routing identity must already be removed.
        max_message_bytes: refuse messages whose raw frames add up to more.
            Defaults to `MAX_MESSAGE_BYTES` (2 GiB).

    Returns:
        A `Message` whose arrays are read-only numpy views of the frames.

    Raises:
        ProtocolError: naming what is wrong, for any malformed, truncated,
            wrong-version or oversized message.
    """
    if not frames:
        raise ProtocolError("empty message: no header frame")
    size = frame_view(frames[0]).nbytes  # (checked before any copy)
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes exceeds the "
                            f"limit of {MAX_HEADER_BYTES}")
    raw_header = _frame_bytes(frames[0])
    try:
        header = msgpack.unpackb(
            raw_header, raw=False, strict_map_key=True, use_list=True,
            max_str_len=MAX_HEADER_BYTES, max_bin_len=MAX_HEADER_BYTES,
            max_array_len=MAX_FRAMES, max_map_len=MAX_META_ITEMS,
            max_ext_len=0)
    except Exception as exc:  # msgpack raises many unrelated types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got "
                            f"{type(header).__name__}")
    if _nesting(header) > MAX_HEADER_NESTING:
        raise ProtocolError(f"header nests lists and maps more than "
                            f"{MAX_HEADER_NESTING} deep")
    if set(header) != set(_HEADER_FIELDS):
        missing = sorted(set(_HEADER_FIELDS) - set(header))
        extra = sorted(map(str, set(header) - set(_HEADER_FIELDS)))
        raise ProtocolError(f"header fields wrong: missing {missing}, "
                            f"unexpected {extra}")
    for key, kind in _HEADER_FIELDS.items():
        value = header[key]
        if kind is int:
            _check_int(key, value)
        elif not isinstance(value, kind):
            raise ProtocolError(f"header field {key!r} must be "
                                f"{kind.__name__}, got {type(value).__name__}")
    if header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header['v']} is not "
                            f"supported (this side speaks "
                            f"{PROTOCOL_VERSION})")
    try:
        msg_type = MsgType(header["type"])
    except ValueError:
        raise ProtocolError(f"unknown message type {header['type']}") from None
    _check_meta(msg_type, header["meta"])

    spec = header["frames"]
    data_frames = frames[1:]
    if len(spec) != len(data_frames):
        raise ProtocolError(f"{msg_type.name}: header describes {len(spec)} "
                            f"frames but {len(data_frames)} arrived")
    low, high = _FRAME_COUNTS.get(msg_type, (0, 0))
    if not low <= len(spec) <= high:
        raise ProtocolError(f"{msg_type.name} carries {len(spec)} frames; "
                            f"it takes {low} to {high}")
    arrays = []
    total = 0
    for index, (entry, frame) in enumerate(zip(spec, data_frames)):
        dtype, shape = _check_frame_spec(index, entry)
        count = 1
        for dim in shape:
            count *= dim
        expected = count * dtype.itemsize
        total += expected
        if total > max_message_bytes:
            raise ProtocolError(f"message of more than {total} bytes exceeds "
                                f"the limit of {max_message_bytes}")
        buffer = frame_view(frame)
        if buffer.nbytes != expected:
            raise ProtocolError(f"frame {index}: header says {dtype.name}"
                                f"{list(shape)} = {expected} bytes, but "
                                f"{buffer.nbytes} bytes arrived")
        try:
            arrays.append(np.frombuffer(buffer, dtype=dtype).reshape(shape)
                          if expected else np.zeros(shape, dtype))
        except ValueError as exc:  # e.g. [0, 2**40, 2**40]: too big a shape
            raise ProtocolError(f"frame {index}: shape {list(shape)}: "
                                f"{exc}") from None
    return Message(msg_type, header["table"], header["clk"], header["worker"],
                   header["seq"], arrays, header["meta"])


def _nesting(value):
    """How deep lists and maps nest in `value` (walked without recursion:
    a hostile header may nest a thousand deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_HEADER_NESTING:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_int(key, value):
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"field {key!r} must be an integer, got "
                            f"{type(value).__name__}")
    if not _INT_MIN <= value <= _INT_MAX:
        raise ProtocolError(f"field {key!r} = {value} is out of range")


def _check_meta(msg_type, meta):
    schema = _META_SCHEMA[msg_type]
    for key, value in meta.items():
        if key not in schema:
            raise ProtocolError(f"{msg_type.name}: unexpected meta field "
                                f"{key!r}")
        kind = schema[key]
        if kind is int:
            _check_int(key, value)
        elif kind is bool:
            if not isinstance(value, bool):
                raise ProtocolError(f"{msg_type.name}: meta field {key!r} "
                                    f"must be a bool")
        elif not isinstance(value, kind):
            raise ProtocolError(f"{msg_type.name}: meta field {key!r} must "
                                f"be {kind.__name__}, got "
                                f"{type(value).__name__}")


def _check_frame_spec(index, entry):
    if (not isinstance(entry, list) or len(entry) != 2
            or not isinstance(entry[0], str)
            or not isinstance(entry[1], list)):
        raise ProtocolError(f"frame {index}: spec must be [dtype, shape], got "
                            f"{reprlib.repr(entry):.80}")
    dtype = numpy_dtype(entry[0])
    shape = entry[1]
    if len(shape) > 8:
        raise ProtocolError(f"frame {index}: rank {len(shape)} exceeds 8")
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ProtocolError(f"frame {index}: shape "
                                f"{reprlib.repr(shape):.80} must "
                                f"hold integers")
        if not 0 <= dim <= MAX_DIM:
            raise ProtocolError(f"frame {index}: dimension {dim} is out of "
                                f"range")
    return dtype, tuple(shape)


def _frame_bytes(frame):
    if isinstance(frame, bytes):
        return frame
    if hasattr(frame, "bytes"):  # zmq.Frame
        return frame.bytes
    return bytes(frame)


def frame_view(frame):
    """A flat byte view of a frame (bytes, zmq.Frame or array), no copy."""
    if hasattr(frame, "buffer"):  # zmq.Frame: zero-copy view
        return memoryview(frame.buffer).cast("B")
    return memoryview(frame).cast("B")


def aligned_empty(size, dtype=np.uint8, alignment=64):
    """A 1-D array of `size` elements whose data is `alignment`-byte
    aligned: TensorFlow can alias it (DLPack) and the streaming ops need
    no unaligned head."""
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + size * dtype.itemsize].view(dtype)


TABLE_SPEC_KEYS = ("name", "rows", "width", "dtype", "row_start", "row_end")
# A spec's optional key: True for a per-clock table, whose rows at clock
# c > 0 are the sums of the updates of clock c - 1 alone (zeros where
# none came), not the running sum of every clock's: a barrier's sums that
# need no zeroing (keras/worker_mean.py). Absent for the usual table.
PER_CLOCK = "per_clock"
MAX_NAME_CHARS = 1024  # the longest table name kept


def table_spec(meta):
    """The table spec a CREATE or DECLARE's `meta` carries (its values
    unchecked: see `table_spec_problem`): `TABLE_SPEC_KEYS`, and
    `PER_CLOCK` (True) only for a per-clock table."""
    spec = {k: meta.get(k) for k in TABLE_SPEC_KEYS}
    if meta.get(PER_CLOCK):
        spec[PER_CLOCK] = True
    return spec


def table_spec_problem(table_id, spec):
    """What is wrong with a table's spec (as CREATE and DECLARE carry it,
    and a checkpoint keeps it), or None.

    Args:
        table_id: the table's id.
        spec: a dict of exactly `TABLE_SPEC_KEYS`: name (str), rows,
            width, row_start and row_end (ints), dtype (a wire name); and,
            for a per-clock table, `PER_CLOCK`: True.

    Example:

    >>> table_spec_problem(0, {"name": "w", "rows": 4, "width": 2,
    ...     "dtype": "float32", "row_start": 0, "row_end": 5})
    'table 0: row range [0, 5) is not within [0, 4)'
    """
    if not isinstance(spec, dict) or \
            sorted(set(spec) - {PER_CLOCK}) != sorted(TABLE_SPEC_KEYS):
        return (f"table {table_id}: a spec has exactly "
                f"{', '.join(TABLE_SPEC_KEYS)} (and {PER_CLOCK}, if true)")
    if PER_CLOCK in spec and spec[PER_CLOCK] is not True:
        return f"table {table_id}: {PER_CLOCK} is true where present"
    if isinstance(table_id, bool) or not isinstance(table_id, int) or \
            not 0 <= table_id <= _INT_MAX:
        return f"table id {table_id!r} is not an int >= 0"
    if not isinstance(spec["name"], str) or \
            len(spec["name"]) > MAX_NAME_CHARS:
        return (f"table {table_id}: its name must be a string of at most "
                f"{MAX_NAME_CHARS} characters")
    if spec["dtype"] not in ALLOWED_DTYPES:
        return (f"table {table_id}: unknown dtype {spec['dtype']!r}; "
                f"allowed: {', '.join(ALLOWED_DTYPES)}")
    for key in ("rows", "width", "row_start", "row_end"):
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, int) or \
                not 0 <= value <= _INT_MAX:
            return f"table {table_id}: {key} must be an int >= 0"
    if spec["width"] < 1:
        return f"table {table_id}: width must be >= 1"
    if not 0 <= spec["row_start"] <= spec["row_end"] <= spec["rows"]:
        return (f"table {table_id}: row range [{spec['row_start']}, "
                f"{spec['row_end']}) is not within [0, {spec['rows']})")
    return None


def stats_reply(seq, stats):
    """A STATS_REPLY to request `seq` carrying `stats` (JSON-able) as JSON
    text in its one frame: a shard's statistics grow with its tables, past
    what a header may hold.

    Example:

    >>> stats_of(decode(encode(stats_reply(3, {"tables": {}}))))
    {'tables': {}}
    """
    text = json.dumps(stats).encode()
    return Message(MsgType.STATS_REPLY, seq=seq,
                   arrays=[np.frombuffer(text, np.uint8)])


def stats_of(message):
    """The statistics a STATS_REPLY carries (a dict).

    Raises:
        ProtocolError: when the frame is not a JSON object, or its tables
            lack the fields workers read (name, ready, clocks).
    """
    try:
        stats = json.loads(message.arrays[0].tobytes())
    except (IndexError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"STATS_REPLY: its frame is not JSON ({exc})"
                            ) from None
    if not isinstance(stats, dict):
        raise ProtocolError("STATS_REPLY: its frame is not a JSON object")
    tables = stats.get("tables", {})
    if not isinstance(tables, dict) or not all(
            isinstance(table, dict) and isinstance(table.get("name"), str)
            and isinstance(table.get("ready"), bool)
            and isinstance(table.get("vclock"), list)
            and all(map(_is_int, [table.get("global_clock"),
                                  table.get("ckpt_clock"),
                                  *table["vclock"]]))
            for table in tables.values()):
        raise ProtocolError("STATS_REPLY: its tables are not {id: {name, "
                            "ready, global_clock, vclock, ckpt_clock}}")
    return stats


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def row_chunks(num_rows, width, itemsize, chunk_bytes=DEFAULT_CHUNK_BYTES):
    """Splits `num_rows` rows into (start, end) ranges of about `chunk_bytes`.

    Args:
        num_rows: how many rows to split.
        width: elements per row.
        itemsize: bytes per element.
        chunk_bytes: target bytes per chunk. Defaults to 2 MiB.

    Returns:
        A list of (start, end) row ranges covering [0, num_rows); one empty
        range (0, 0) when num_rows is 0.
    """
    row_bytes = max(1, width * itemsize)
    step = max(1, chunk_bytes // row_bytes)
    if num_rows == 0:
        return [(0, 0)]
    return [(s, min(s + step, num_rows)) for s in range(0, num_rows, step)]
