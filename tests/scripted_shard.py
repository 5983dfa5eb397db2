"""A peer at a shard's address that answers from a script: how the tests
send a worker replies no real shard sends (malformed, or missing fields),
as a faulty or hostile shard would."""

import threading

import numpy as np
import zmq

from keras_geeps import protocol
from keras_geeps.protocol import Message, MsgType


def welcome(hello, **meta):
    """A WELCOME to `hello` for shard 0 of 1, with `meta` over its
    fields."""
    return Message(MsgType.WELCOME, seq=hello.seq, meta=dict({
        "shard_id": 0, "num_shards": 1,
        "num_workers": hello.meta["num_workers"],
        "max_message_bytes": protocol.MAX_MESSAGE_BYTES,
        "max_pending_clocks": 16, "checkpoint_every": 0,
        "incarnation": 1, "worker_timeout": 0.0}, **meta))


def declared(declare, rows, global_clock=0):
    """A real shard's answer to a DECLARE of a table of `rows` (a float32
    array) at `global_clock`: its ACK, then the rows pushed."""
    return [Message(MsgType.ACK, table=declare.table, seq=declare.seq,
                    meta={"global_clock": global_clock, "ready": True}),
            Message(MsgType.PUSH, table=declare.table, clk=global_clock,
                    meta={"row_start": 0, "row_end": len(rows),
                          "chunk_row": 0}, arrays=[rows])]


class ScriptedShard:
    """A ROUTER on a free loopback port whose thread answers each message
    with `script(message)`: a list of `Message`s (or None: no answer).

    Example:

    ```python
    shard = ScriptedShard(lambda m: [welcome(m)]
                          if m.type == MsgType.HELLO else None)
    ...
    shard.stop()
    ```
    """

    def __init__(self, script):
        self.script = script
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if not self._socket.poll(50):
                continue
            identity, *frames = self._socket.recv_multipart()
            for reply in self.script(protocol.decode(frames)) or ():
                self._socket.send_multipart([identity,
                                             *protocol.encode(reply)])

    def stop(self):
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()


def a_table(shard_rows=np.zeros((2, 2), np.float32)):
    """A script: WELCOME (checkpoints every clock) and DECLAREs answered
    as a real shard does, with `shard_rows`; nothing else."""
    def script(message):
        if message.type == MsgType.HELLO:
            return [welcome(message, checkpoint_every=1)]
        if message.type == MsgType.DECLARE:
            return declared(message, shard_rows)
        return None
    return script


class Restarting:
    """A script: `a_table()` until `restart()`; then, as a restarted
    shard, it answers the next HEARTBEAT hello_required, welcomes the
    HELLO after it as a new incarnation, and answers each DECLARE with
    `on_declare(message)`."""

    def __init__(self, on_declare):
        self._before = a_table()
        self._on_declare = on_declare
        self._restarted = self._told = False

    def restart(self):
        self._restarted = True

    def __call__(self, message):
        if not self._restarted:
            return self._before(message)
        if message.type == MsgType.HEARTBEAT and not self._told:
            self._told = True
            return [Message(MsgType.ERROR, meta={
                "error": "HELLO first",
                "code": protocol.ERROR_HELLO_REQUIRED})]
        if message.type == MsgType.HELLO:
            return [welcome(message, checkpoint_every=1, incarnation=2)]
        if message.type == MsgType.DECLARE:
            return self._on_declare(message)
        return None
