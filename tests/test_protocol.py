"""The wire format: round trips, and every kind of malformed input refused."""

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_geeps import protocol
from keras_geeps.protocol import Message, MsgType, ProtocolError


def _example(kind):
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    meta = {
        MsgType.HELLO: {"num_workers": 4, "num_shards": 2, "incarnation": 9},
        MsgType.WELCOME: {"shard_id": 1, "num_shards": 2, "num_workers": 4,
                          "max_message_bytes": 1 << 20},
        MsgType.CREATE: {"name": "dense", "rows": 3, "width": 4,
                         "dtype": "float32", "row_start": 0, "row_end": 3,
                         "chunk_row": 0},
        MsgType.DECLARE: {"name": "dense", "rows": 3, "width": 4,
                          "dtype": "float32", "row_start": 0, "row_end": 3},
        MsgType.ROWS: {"row_start": 0, "row_end": 3, "chunk_row": 0},
        MsgType.UPDATE: {"chunk_row": 0, "indexed": False},
        MsgType.PUSH: {"row_start": 0, "row_end": 3, "chunk_row": 0},
        MsgType.ERROR: {"error": "no such table"},
    }.get(kind, {})
    arrays = [rows] if kind in (MsgType.CREATE, MsgType.ROWS, MsgType.UPDATE,
                                MsgType.PUSH) else []
    if kind == MsgType.STATS_REPLY:
        arrays = [np.frombuffer(b'{"tables": {}}', np.uint8)]
    return Message(kind, table=5, clk=17, worker=3, seq=99, arrays=arrays,
                   meta=meta)


@pytest.mark.parametrize("kind", list(MsgType))
def test_round_trip_every_type(kind):
    message = _example(kind)
    decoded = protocol.decode(protocol.encode(message))
    assert decoded.type == kind
    assert (decoded.table, decoded.clk, decoded.worker, decoded.seq) == (
        5, 17, 3, 99)
    assert decoded.meta == message.meta
    assert len(decoded.arrays) == len(message.arrays)
    for got, sent in zip(decoded.arrays, message.arrays):
        np.testing.assert_array_equal(got, sent)
        assert got.dtype == sent.dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32",
                                   "float64", "int32", "int64"])
def test_round_trip_dtypes_and_empty(dtype):
    dt = protocol.numpy_dtype(dtype)
    for shape in [(0, 4), (1, 1), (5, 3)]:
        array = np.arange(int(np.prod(shape))).astype(dt).reshape(shape)
        frames = protocol.encode(Message(MsgType.UPDATE, arrays=[array]))
        got = protocol.decode(frames).arrays[0]
        assert got.dtype == dt and got.shape == shape
        np.testing.assert_array_equal(got, array)


def _header(frames):
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(original, **changes):
    header = _header(original)
    header.update(changes)
    return [msgpack.packb(header, use_bin_type=True)] + list(original[1:])


def _good():
    return protocol.encode(_example(MsgType.UPDATE))


def test_wrong_version_is_named():
    with pytest.raises(ProtocolError, match="version 7"):
        protocol.decode(_with_header(_good(), v=7))


def test_truncated_frame_is_named():
    frames = _good()
    frames[1] = bytes(frames[1])[:-4]
    with pytest.raises(ProtocolError, match="frame 0.*44 bytes arrived"):
        protocol.decode(frames)


def test_missing_and_extra_frames():
    with pytest.raises(ProtocolError, match="describes 1 frames but 0"):
        protocol.decode(_good()[:1])
    with pytest.raises(ProtocolError, match="describes 1 frames but 2"):
        protocol.decode(_good() + [b"xx"])


def test_absurd_sizes_are_refused_before_allocation():
    frames = _with_header(_good(), frames=[["float32", [1 << 40, 1 << 40]]])
    with pytest.raises(ProtocolError, match="out of range|exceeds"):
        protocol.decode(frames)
    frames = _with_header(_good(), frames=[["float32", [1 << 20, 1 << 10]]])
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        protocol.decode(frames, max_message_bytes=1 << 20)
    # An empty frame whose other dimensions overflow numpy.
    frames = _with_header(_good(), frames=[["float32", [0, 1 << 40, 1 << 40]]])
    frames[1] = b""
    with pytest.raises(ProtocolError, match=r"frame 0: shape \[0, "):
        protocol.decode(frames)


@pytest.mark.parametrize("change,pattern", [
    ({"type": 99}, "unknown message type 99"),
    ({"clk": "seven"}, "'clk' must be an integer"),
    ({"seq": True}, "'seq' must be an integer"),
    ({"meta": {"bogus": 1}}, "unexpected meta field 'bogus'"),
    ({"meta": {"chunk_row": "x"}}, "chunk_row"),
    ({"frames": [["complex64", [3, 4]]]}, "unknown dtype"),
    ({"frames": [["float32", [3, -4]]]}, "out of range"),
    ({"frames": [["float32", 12]]}, "spec must be"),
])
def test_bad_fields_are_named(change, pattern):
    with pytest.raises(ProtocolError, match=pattern):
        protocol.decode(_with_header(_good(), **change))


def test_a_deeply_nested_header_is_refused_as_a_protocol_error():
    """Hundreds of lists deep fit in a kilobyte of msgpack; describing
    them in the error (repr) raised RecursionError, not the ProtocolError
    a receiver catches."""
    # (msgpack packs 512 deep at most: the rest is spliced in as bytes)
    deep = b"\x91" * 1000 + b"\x90"  # a list of a list of ... of []
    marker = msgpack.packb("DEEP")
    for change in ({"frames": ["DEEP"]}, {"frames": [["float32", "DEEP"]]},
                   {"meta": {"ref": "DEEP"}}):
        frames = _with_header(_good(), **change)
        frames[0] = frames[0].replace(marker, deep)
        with pytest.raises(ProtocolError, match="nests lists and maps"):
            protocol.decode(frames)
    # A nesting just within the limit is judged by its fields.
    with pytest.raises(ProtocolError, match="spec must be"):
        protocol.decode(_with_header(_good(), frames=[[[[[[1]]]]]]))
    with pytest.raises(ProtocolError, match="header of 65537 bytes"):
        protocol.decode([b"x" * 65537])
    with pytest.raises(ProtocolError, match="not JSON"):
        protocol.stats_of(Message(MsgType.STATS_REPLY, arrays=[
            np.frombuffer(b"[" * 100000, np.uint8)]))


GOOD_TABLE = {"name": "t", "ready": True, "global_clock": 3,
              "vclock": [3, 4], "ckpt_clock": -1}


@pytest.mark.parametrize("tables", [
    [], {"0": []}, {"0": dict(GOOD_TABLE, name=None)},
    {"0": dict(GOOD_TABLE, ready=1)}, {"0": dict(GOOD_TABLE, vclock=3)},
    {"0": dict(GOOD_TABLE, vclock=[3, "4"])},
    {"0": dict(GOOD_TABLE, ckpt_clock=True)},
    {"0": {k: v for k, v in GOOD_TABLE.items() if k != "global_clock"}},
])
def test_stats_without_the_table_fields_workers_read_are_refused(tables):
    with pytest.raises(ProtocolError, match="its tables are not"):
        protocol.stats_of(protocol.stats_reply(1, {"tables": tables}))
    assert protocol.stats_of(protocol.stats_reply(1, {"tables": {
        "0": GOOD_TABLE}}))["tables"]["0"] == GOOD_TABLE


def test_header_not_a_map_and_missing_fields():
    with pytest.raises(ProtocolError, match="must be a map"):
        protocol.decode([msgpack.packb([1, 2, 3])])
    header = _header(_good())
    del header["seq"]
    with pytest.raises(ProtocolError, match="missing \\['seq'\\]"):
        protocol.decode([msgpack.packb(header)] + _good()[1:])
    with pytest.raises(ProtocolError, match="empty message"):
        protocol.decode([])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=256), min_size=0, max_size=4))
def test_random_bytes_only_raise_protocol_error(frames):
    try:
        protocol.decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_messages_only_raise_protocol_error(data):
    frames = [bytes(f) for f in protocol.encode(
        _example(data.draw(st.sampled_from(list(MsgType)))))]
    index = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[index])
    for _ in range(data.draw(st.integers(1, 8))):
        if raw and data.draw(st.booleans()):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(
                st.integers(0, 255))
        else:
            cut = data.draw(st.integers(0, len(raw)))
            raw = raw[:cut]
    frames[index] = bytes(raw)
    try:
        message = protocol.decode(frames)
    except ProtocolError:
        return
    # Whatever decodes must be self-consistent.
    for spec, array in zip(_header(frames)["frames"], message.arrays):
        assert list(array.shape) == spec[1]


def test_row_chunks_cover_rows_exactly():
    chunks = protocol.row_chunks(1000, 128, 4, chunk_bytes=64 * 1024)
    assert chunks[0] == (0, 128) and chunks[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert protocol.row_chunks(0, 8, 4) == [(0, 0)]
