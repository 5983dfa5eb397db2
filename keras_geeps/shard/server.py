"""`ShardServer`: a shard's poll loop and the handling of every request.

See the package's docstring for what a shard keeps and promises.
"""

import collections
import logging
import os
import threading
import time

import numpy as np
import zmq

from keras_geeps import checkpoint, protocol, seal, shm
from keras_geeps.checks import check_count, check_index
from keras_geeps.protocol import Message, MsgType, ProtocolError
from keras_geeps.shard.bounds import LogBudget, UnsentReplies
from keras_geeps.shard.sessions import SeqTracker, Session, user_id
from keras_geeps.shard.settings import NoRoomError, RequestError, \
    ShardSettings
from keras_geeps.shard.tables import BufferPool, Pending, Table, Update
from keras_geeps.shard.writer import CheckpointWriter

log = logging.getLogger("keras_geeps.shard")

# How long after the job's first HELLO (or a restore) a worker that never
# said HELLO counts as dead, when it exceeds worker_timeout: room to start.
STARTUP_GRACE_S = 60.0
# The requests handled at most once per sequence number (a worker resends
# them after its connection broke), and how many of a worker's latest
# answers to them that say more than a bare ACK would (a refusal; a
# CREATE's ACK of a table that existed, or at a clock past 0) are kept to
# answer a resend with. Those are rare: a table's thousands of CREATE
# chunks do not push them out.
ONCE_ONLY = frozenset({MsgType.CREATE, MsgType.UPDATE, MsgType.CLOCK})
KEPT_ANSWERS = 1024
# How long a bind to a port in use is retried (a restarted shard's port
# can be briefly taken: a worker reconnecting to a free loopback port may
# get it as its own source port, TCP self-connect, until ZeroMQ drops it).
BIND_RETRY_S = 5.0

# How many earlier processes of a worker are remembered as never to be let
# back (one per restart).
MAX_BURIED = 1024

DEAD_CLOCK = 1 << 62  # a dead worker's vector-clock entry: never the minimum
# Replies to READs one worker may have that ZeroMQ has not sent yet (it
# reads none of them); its further READs are refused until it does.
# (Clients get their rows by PUSH, and send no READ.)
MAX_UNSENT_READS = 64
# STATS replies (a copy of every table's figures) waiting for a peer that
# reads none, per peer and in all.
MAX_UNSENT_STATS = 4
MAX_UNSENT_STATS_ALL = 64
# ERROR replies waiting for a peer that is no worker's and reads none,
# per peer and in all: past that its refused requests go unanswered.
MAX_UNSENT_ERRORS = 64
MAX_UNSENT_ERRORS_ALL = 4096
# Pushes of a table queued for a worker (none of the oldest sent) past
# which the next waits, owed (`_push_to_subscribers`): two, so that a
# worker reading as fast as the table advances never waits for a look.
PUSHES_QUEUED = 2
# How often the loop looks whether owed pushes may go (`_pay_owed_pushes`):
# every 1 ms, and every 10 ms once none was owed or paid for 50 ms (a
# worker that reads nothing: the loop does not spin for it).
OWED_PUSH_POLL_S = 0.001
OWED_PUSH_IDLE_S = 0.01
OWED_PUSH_STALLED_S = 0.05
# Lines of refused or dropped requests logged per 10 s (the rest counted).
REFUSAL_LOG_LINES = 20

# The refusals of an UPDATE or CLOCK that is not of the worker's current
# clock (`ShardServer._check_clock`).
_UPDATE_OFF_CLOCK = ("worker {worker} sent an update of table {table} for "
                     "clock {clk}, but its current clock is {current}")
_CLOCK_OFF_CLOCK = ("worker {worker} finished clock {clk} of table {table}, "
                    "but its current clock is {current}")


def _opens_into_rows(message):
    """True for a sealed UPDATE whose one frame of rows may be opened
    straight into the clock's rows (`Pending.add_sealed`): rows sent
    whole, not by index, shared memory or a lent buffer."""
    return message.type == MsgType.UPDATE and len(message.arrays) == 1 \
        and not {"indexed", "into", "ref"} & message.meta.keys()


class ShardServer:
    """A keras_geeps shard server.

    Args:
        bind: ZeroMQ address to bind, e.g. "tcp://127.0.0.1:0" (port 0
            picks a free port; `address` then tells which).
        shard_id: this shard's index in [0, num_shards).
        num_shards: how many shards the job has.
        num_workers: how many workers the job has.
        settings: a `ShardSettings`. Defaults to `ShardSettings()`.
        restore: load `settings.checkpoint_dir`'s checkpoint first; workers
            then replay the updates it does not cover (and create again the
            tables it does not hold yet). Defaults to False; without it, a
            shard with a `checkpoint_dir` writes an empty checkpoint there
            before it serves.
        curve: (secret_key_file, allowed_clients_dir) to require CURVE
            keys (see `keras_geeps.auth`). Defaults to None (no
            authentication). Workers then say HELLO over CURVE and send
            everything else on the sealed data socket (`keras_geeps.seal`).
        data_bind: the sealed data socket's address, with `curve`.
            Defaults to `bind`'s host on a free port (`data_address` tells
            which; a restarted shard must get the same one).

    Raises:
        ValueError: a count that is not an int, a shard_id outside
            [0, num_shards), no workers, or `restore` without a
            `checkpoint_dir`.
        TypeError: `settings` that are not a `ShardSettings`, or `curve`
            that is not a (key file, folder) pair.
        checkpoint.CheckpointError: a checkpoint to restore that is
            missing, unreadable or of another job, or a `checkpoint_dir`
            that cannot be written.
        zmq.ZMQError: `bind` (or `data_bind`) cannot be bound.

    Example:

    >>> server = ShardServer("tcp://127.0.0.1:0", 0, 1, 1).start()
    >>> server.address.startswith("tcp://127.0.0.1:")
    True
    >>> server.stop()
    """

    def __init__(self, bind, shard_id, num_shards, num_workers, settings=None,
                 restore=False, curve=None, data_bind=None):
        check_count("num_shards", num_shards, 1)
        check_index("shard_id", shard_id, num_shards)
        check_count("num_workers", num_workers, 1)
        settings = settings or ShardSettings()
        if not isinstance(settings, ShardSettings):
            raise TypeError(f"settings must be a ShardSettings, got "
                            f"{type(settings).__name__}")
        if curve is not None and (isinstance(curve, (str, bytes)) or
                                  len(curve) != 2):
            raise TypeError(f"curve is (secret_key_file, "
                            f"allowed_clients_dir), got {curve!r}")
        if restore and not settings.checkpoint_dir:
            raise ValueError("restore=True needs settings.checkpoint_dir: "
                             "the folder the shard wrote its checkpoints to")
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.settings = settings
        # This process's number: a worker whose connection broke and came
        # back tells this shard from a restarted one by it (WELCOME).
        self.incarnation = int.from_bytes(os.urandom(6), "little")
        self._tables = {}
        self._identities = {}     # worker id -> routing identity
        self._incarnations = {}   # worker id -> incarnation number
        self._seqs = {}           # worker id -> SeqTracker
        self._answers = {}        # worker id -> {seq: reply} (KEPT_ANSWERS)
        # worker id -> tables its CREATE found existing (the answer a
        # resent chunk gets once its kept answer was pushed out)
        self._existing = {}
        self._parked = []         # (identity, Message) reads waiting
        self._trackers = {}       # id(rows buffer) -> sends still using it
        self._unsent_reads = {}   # worker -> [[tracker]] of READ replies
        # worker -> {table id: (identity, deque of the [tracker]s of the
        # last PUSHES_QUEUED pushes of that table's rows to it)}
        # (`_push_waits`)
        self._unsent_pushes = {}
        # table id -> {worker} owed the table's rows: PUSHES_QUEUED pushes
        # of them waited to go to it, none of the oldest sent, when the
        # table advanced (`_push_to_subscribers`, `_pay_owed_pushes`)
        self._owed_pushes = {}
        self._owed_moved = 0.0  # when a push was last owed or paid
        self._unsent_stats = []   # [(identity, tracker)] of STATS replies
        self._unsent_errors = UnsentReplies(MAX_UNSENT_ERRORS,
                                            MAX_UNSENT_ERRORS_ALL)
        self._refusal_log = LogBudget(REFUSAL_LOG_LINES)
        self._last_seen = {}      # worker id -> time of its last message
        self._dead = set()        # workers declared dead
        self._left = set()        # workers that closed their client (LEAVE)
        # LEAVEs answered once a checkpoint holds the leaver's clocks:
        # [(identity, seq, {table id: clock})]
        self._leave_acks = []
        self._started = None      # first HELLO or restore: liveness watch
        self._served = []         # (socket, dispatch) the loop serves
        self._restored_at = None  # a restore of a job under way: its time
        self._failed = None       # the error every request gets ("stop")
        # Writes the checkpoints, when there is a checkpoint_dir.
        self._writer = None if not self.settings.checkpoint_dir else \
            CheckpointWriter(self.settings.checkpoint_dir, shard_id,
                             num_shards, num_workers)
        self._stop = threading.Event()
        self._thread = None
        self._shm_writers = {}    # worker id -> shm.PeerBuffers (updates)
        self._shm_readers = set()  # workers that map our row buffers
        self._holds = {}          # buffer id -> {worker: refs not released}
        self.stats = {"bytes_in": 0, "bytes_out": 0, "messages_in": 0,
                      "updates_applied": 0, "updates_held": 0,
                      "duplicates": 0, "errors": 0, "internal_errors": 0,
                      "errors_unanswered": 0, "pushes_skipped": 0,
                      "pushes_deferred": 0,
                      "pushes": 0, "checkpoints": 0, "restored_clock": -1,
                      "shm_bytes_in": 0, "shm_bytes_out": 0,
                      "lent_updates": 0, "sealed_in": 0, "sealed_out": 0,
                      "sealed_held_back": 0}
        self._sessions = {}       # session id -> Session (sealed data)
        self._unopened = None     # the sealed rows of the UPDATE in hand
        self._buried = {}         # worker -> incarnations declared dead
        self._seal_buffers = None  # seal.Buffers of every session
        self._curve_identities = {}  # worker -> its CURVE route (sealed)
        self._session_tokens = {}  # session hex -> token hex (data ZAP)
        self._curve_user = None   # the CURVE key of the message in hand
        self._context = zmq.Context(io_threads=protocol.IO_THREADS)
        self._auth = self._socket = self._arena = self._data = None
        self.data_address = None
        try:
            if curve is not None:
                from keras_geeps.auth import ShardAuth  # noqa: PLC0415
                self._auth = ShardAuth(self._context, *curve)
            self._socket, self.address = self._bind_router(
                bind, self._auth.apply if self._auth else None,
                handover=True)
            # `_send_to` says which frames are copied, whatever their size.
            self._socket.copy_threshold = 0
            if curve is not None:
                self._data = self._open_data_socket(
                    data_bind or self.address.rsplit(":", 1)[0] + ":0")
            # Shared memory with co-located workers (keras_geeps.shm).
            if self.settings.shared_memory:
                self._arena = shm.Arena(role="shard")
            if self._writer is not None:
                self._writer.lock()  # (one shard per place and folder)
            if restore:
                self._restore()
            elif self._writer is not None:
                self._writer.write_empty()
        except BaseException:  # nothing left open: no thread, no port
            self._close()
            raise

    # ----------------------------------------------------------- running
    def start(self):
        """Runs the serve loop in a daemon thread; returns self."""
        self._thread = threading.Thread(
            target=self.serve_forever, name=f"geeps-shard-{self.shard_id}",
            daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout=10.0):
        """Asks the serve loop to stop and waits for it (thread mode)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"shard {self.shard_id} did not stop "
                                   f"within {timeout} s")

    def request_stop(self):
        """Makes the serve loop end after its current turn (signal-safe)."""
        self._stop.set()

    def serve_forever(self):
        """Serves requests until `stop`, a STOP request or a signal."""
        poller = zmq.Poller()
        sockets = self._served = [(self._socket, self._dispatch)]
        if self._data is not None:
            sockets.append((self._data, self._dispatch_sealed))
        for sock, _ in sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    self._housekeeping()
                except Exception:  # a bug must not take the shard down
                    self._internal_error("in its housekeeping")
                try:
                    waiting = self._pump_sealed()
                    if self._owed_pushes and self._pay_owed_pushes():
                        # (their pushes leave with no message to wake it)
                        pace = OWED_PUSH_IDLE_S if time.monotonic() - \
                            self._owed_moved > OWED_PUSH_STALLED_S \
                            else OWED_PUSH_POLL_S
                        waiting = pace if waiting is None \
                            else min(waiting, pace)
                except Exception:  # a bug must not take the shard down
                    self._internal_error("sealing replies")
                    waiting = False
                ready = seal.poll_paced(poller, waiting,
                                        self.settings.poll_timeout_ms)
                for sock, dispatch in sockets:
                    if sock in ready:
                        self._drain(sock, dispatch)
        finally:
            if self._writer is not None:
                self._writer.join()
                try:  # snapshots taken while that write went on
                    self._checkpoint_turn(self._writer)
                    self._writer.join()
                    self._writer.finished()
                except Exception:  # stopping all the same
                    self._internal_error("writing its last checkpoint")
            self._close()
            log.info("shard %d stopped", self.shard_id)

    def _bind_router(self, address, secure=None, handover=False,
                     frame_overhead=0):
        """A ROUTER with the shard's options, bound to `address`.

        Args:
            address: where to bind.
            secure: called with the socket before it binds (CURVE, or the
                data socket's session check), or None.
            handover: ROUTER_HANDOVER (a reconnecting peer takes its
                routing id back at once). Defaults to False.
            frame_overhead: bytes a frame may carry beyond the message
                limit and its header (a seal's tag). Defaults to 0.

        Returns:
            (socket, the address it bound: port 0 resolved).
        """
        sock = self._context.socket(zmq.ROUTER)
        try:
            if secure is not None:
                secure(sock)
            sock.setsockopt(zmq.LINGER, 0)
            if handover:
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            # No frame larger than a whole message is taken in: libzmq
            # drops the connection of a peer that sends one before it is
            # buffered (room left for the header and any overhead).
            sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes
                            + protocol.MAX_HEADER_BYTES + frame_overhead)
            deadline = time.monotonic() + BIND_RETRY_S
            while True:
                try:
                    sock.bind(address)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or \
                            time.monotonic() >= deadline:
                        raise
                    time.sleep(0.1)
            return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException:  # an open socket would block context.term
            sock.close(linger=0)
            raise

    def _open_data_socket(self, address):
        """The plain ROUTER that sealed messages travel on (with CURVE)."""
        seal.require()  # a shard with CURVE keys seals its data channel
        # Connections must name a live session and its token (ZAP), and a
        # token admits one connection (the worker's first: one seen in the
        # clear on the wire is spent), so a stranger gets nothing buffered
        # here. No ROUTER_HANDOVER either: a second connection under a
        # session's routing id must not take over the worker's replies.
        sock, self.data_address = self._bind_router(
            address, lambda s: self._auth.apply_session_check(
                s, self._session_tokens), frame_overhead=seal.TAG_BYTES)
        return sock

    def _close(self):
        if self._writer is not None:
            self._writer.unlock()
        if self._data is not None:
            self._data.close(linger=0)
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._arena is not None:
            self._arena.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    # ---------------------------------------------------------- dispatch
    def _drain(self, sock, dispatch):
        """Serves what `sock` holds, 256 messages at most (then
        housekeeping); whether it held no more."""
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            self.stats["messages_in"] += 1
            self.stats["bytes_in"] += sum(len(f) for f in frames)
            if len(frames) < 2:
                self.stats["errors"] += 1
                self._refusal_log.warning(
                    log, "shard %d: dropped a message with no header",
                    self.shard_id)
                continue
            dispatch(frames)
            if self._stop.is_set():
                return True
        return False

    def _dispatch(self, frames):
        """A message from the main socket (over CURVE when keys are set)."""
        # The CURVE key it came with (ZAP User-Id), for HELLO's check.
        self._curve_user = user_id(frames[1]) if self._auth else None
        self._serve(frames[0].bytes, frames[1:])

    def _dispatch_sealed(self, frames):
        """A sealed message from the data socket: opened, then served as
        from ("sealed", session). Nothing that does not open is answered,
        except an unknown session (a restarted shard) and one that lost
        messages (`seal.SealGap`: it is ended): hello_required, and the
        worker's HELLO starts a new session, over which it resends what
        this shard may not have had."""
        try:
            self._open_sealed(frames)
        except Exception:  # a bug must not take the shard down
            self.stats["errors"] += 1
            self._internal_error("opening a sealed message")

    def _open_sealed(self, frames):
        route = frames[0].bytes
        session = self._sessions.get(route)
        if session is None:
            self._hello_required(route, "unknown session: say HELLO again "
                                        "(this shard may have restarted)")
            return
        try:
            # The header only: an UPDATE's rows are opened straight into
            # the clock's fresh rows when they can be (`Pending.add_sealed`),
            # everything else in place before it is handled (`_serve`).
            plain = session.channel.open(frames[1:], defer=True)
        except seal.SealGap as exc:
            log.warning("shard %d: ended worker %d's sealed session: %s",
                        self.shard_id, session.worker, exc)
            self._end_session(route)
            self._hello_required(route, f"the session lost messages ({exc})"
                                        f": say HELLO again")
            return
        except seal.SealError as exc:  # (forged: anyone on the path)
            self.stats["errors"] += 1
            self._refusal_log.warning(
                log, "shard %d: dropped a sealed message of worker %d: %s",
                self.shard_id, session.worker, exc)
            return
        self.stats["sealed_in"] += 1
        session.sender.ready = True  # its link is connected
        try:
            self._serve(("sealed", route), plain[:1], session.worker,
                        plain[1:])
        except seal.SealError as exc:  # its header opened, a frame did not
            self.stats["errors"] += 1
            log.warning("shard %d: ended worker %d's sealed session: a frame "
                        "of its message did not open: %s", self.shard_id,
                        session.worker, exc)
            self._end_session(route)
            self._hello_required(route, "a frame of a message did not open: "
                                        "say HELLO again")

    def _hello_required(self, route, error):
        """Answers a sealed route, in the clear, that it must say HELLO."""
        self.stats["errors"] += 1
        self._send_to(self._data, [route] + protocol.encode(Message(
            MsgType.ERROR, meta={"error": error,
                                 "code": protocol.ERROR_HELLO_REQUIRED})),
                      False)

    def _serve(self, identity, payload, sealed_worker=None, sealed=()):
        """Decodes and handles one request, answering an error for a bad one.

        `sealed`: the rest of a sealed message's frames (`seal.SealedFrame`s,
        after its opened header `payload`): decoded from their sealed bytes
        (as long as the rows) and opened before anything reads them. A frame
        that does not open raises `seal.SealError`, and the request is not
        handled (nor its sequence number taken).
        """
        message = None
        try:
            message = protocol.decode(
                list(payload) + [f.sealed_view for f in sealed],
                max_message_bytes=self.settings.max_message_bytes)
            if sealed_worker is not None and message.worker != sealed_worker:
                raise RequestError(f"worker {sealed_worker}'s session sent a "
                                   f"request as worker {message.worker}")
            if sealed_worker is not None and message.type == MsgType.HELLO:
                raise RequestError("HELLO goes over CURVE, not the sealed "
                                   "data channel")
            if sealed and _opens_into_rows(message):
                self._unopened = sealed[0]
            else:
                for frame in sealed:  # in place: the arrays see the rows
                    frame.open()
            self._handle(identity, message)
        except seal.SealError:
            raise
        except RequestError as exc:
            self._refuse(identity, message, str(exc), exc.code)
        except ProtocolError as exc:
            self._refuse(identity, message, str(exc))
        except Exception as exc:  # a bug must not take the shard down
            self._internal_error("handling a request")
            self._refuse(identity, message, f"internal error: {exc!r}")
        finally:
            self._unopened = None

    def _internal_error(self, doing):
        """Logs the exception in hand, a bug of the shard's own that it
        survived, and counts it in `internal_errors` (its STATS): a
        fuzzer or a monitor sees it without reading the log."""
        self.stats["internal_errors"] += 1
        log.exception("shard %d: internal error %s", self.shard_id, doing)

    def _refuse(self, identity, message, error, code=None):
        self.stats["errors"] += 1
        seq = message.seq if message is not None else -1
        table = message.table if message is not None else -1
        if code not in protocol.CLIENT_ACTS_ON:  # (those are logged
            # where they arise, or are routine: a restart's stale requests)
            self._refusal_log.warning(
                log, "shard %d: refused a request (seq %d): %s",
                self.shard_id, seq, error)
        meta = {"error": error[:2000]}
        if code is not None:
            meta["code"] = code
        # Bounded for peers that are no worker's (a worker reads its
        # socket, and may count on each answer); sealed ones are bounded
        # by their session.
        plain = not isinstance(identity, tuple) and \
            identity not in self._identities.values()
        if plain and not self._unsent_errors.room_for(identity):
            self.stats["errors_unanswered"] += 1
            return  # a peer that reads nothing: no more replies pile up
        tracker = self._answer(identity, message, Message(
            MsgType.ERROR, table=table, seq=seq, meta=meta), track=plain)
        if plain:
            self._unsent_errors.add(identity, tracker)

    def _answer(self, identity, request, reply, track=False):
        """Sends `reply` to `request`, kept for a resend of a ONCE_ONLY
        request from its worker's connection (the shard handles it once,
        and a resend means this answer may have been lost). Returns the
        reply's tracker with `track` (`_send`)."""
        telling = reply.type == MsgType.ERROR or \
            reply.meta.get("existing") or reply.meta.get("global_clock", 0)
        if telling and request is not None and request.type in ONCE_ONLY \
                and request.worker in self._seqs and \
                self._identities.get(request.worker) == identity:
            kept = self._answers.setdefault(request.worker,
                                            collections.OrderedDict())
            kept[request.seq] = reply
            if len(kept) > KEPT_ANSWERS:
                kept.popitem(last=False)
        return self._send(identity, reply, track=track)

    def _send(self, identity, message, track=False, zero_copy=False):
        """Sends `message`; returns a tracker of the zero-copy frames (with
        `track`), or None when nothing refers to them any more. Its rows go
        zero-copy whatever their size in a ROWS or STATS reply, or with
        `zero_copy` (`_send_to`)."""
        frames = protocol.encode(message)
        self.stats["bytes_out"] += sum(len(f) if isinstance(f, bytes)
                                       else f.nbytes for f in frames)
        rows_reply = zero_copy or message.type in (MsgType.ROWS,
                                                   MsgType.STATS_REPLY)
        if isinstance(identity, tuple):  # ("sealed", session)
            session = self._sessions.get(identity[1])
            if session is None:
                return None
            self.stats["sealed_out"] += 1
            # Its frames are read until sealed: that is what to track; a
            # reply whose tracker bounds how many wait for the peer, until
            # ZeroMQ sent its sealed copy too (one under 64 KiB is sealed
            # at once: done at once, it bounded nothing).
            queued = session.sender.send(frames, track=track and rows_reply)
            self.stats["sealed_held_back"] += not queued.sealed
            return queued if track else None
        return self._send_to(self._socket, [identity] + frames, track,
                             rows_reply=rows_reply)

    def _send_to(self, sock, frames, track, rows_reply=False):
        """Sends routed `frames` on `sock`; their tracker with `track`,
        else None, and None when the peer is gone.

        On the plain socket the routing id and header are copied, and so
        are rows under zmq.COPY_THRESHOLD, except in a reply to a READ or
        a STATS, or rows answering a DECLARE or CREATE (`rows_reply`):
        those go zero-copy whatever their size
        (and are tracked: a STATS reply's tracker bounds how many wait for
        a peer, `_stats`), so that
        rows queued for a peer that sends READs and reads nothing are the
        table's own buffers, which max_table_bytes counts (pooled until
        sent), not copies outside it (3000 READs of a 64 KB table took
        190 MB). The data socket's frames are `seal.Sender`'s, which
        tracks the large ones it reuses and the replies that bound what
        waits for a peer (`_send`); the rest are copied.
        """
        try:
            if sock is not self._socket:
                if not track:
                    return sock.send_multipart(frames, copy=False)
                # A frame under pyzmq's copy threshold is copied, and its
                # tracker done at once: the last goes as a zero-copy frame
                # whatever its size, so that its tracker tells when the
                # message left (sealed frames are never written again).
                last = zmq.Frame(frames[-1], copy=False, track=True,
                                 copy_threshold=0)
                sock.send_multipart(frames[:-1] + [last], copy=False)
                return last.tracker
            trackers = []
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                more = zmq.SNDMORE if i < last else 0
                if track and i == last and not trackers and \
                        isinstance(frame, bytes):
                    # A reply of a header only (an ERROR's, tracked to
                    # bound those waiting: `_refuse`): it tells when the
                    # reply went out.
                    trackers.append(sock.send(frame, more, copy=False,
                                              track=True))
                elif isinstance(frame, bytes) or not rows_reply and \
                        frame.nbytes < zmq.COPY_THRESHOLD:
                    sock.send(frame, more)
                else:
                    trackers.append(sock.send(frame, more, copy=False,
                                              track=True))
            return zmq.MessageTracker(*trackers) if track and trackers \
                else None
        except zmq.ZMQError as exc:  # peer gone: nothing to deliver to
            log.warning("shard %d: send failed: %s", self.shard_id, exc)
            return None

    def _handle(self, identity, message):
        worker = message.worker
        tracker = self._seqs.get(worker)
        if tracker is not None and message.type != MsgType.HELLO and \
                self._identities.get(worker) == identity and \
                tracker.beyond(message.seq):
            raise self._seq_jump(worker, message.seq)
        unopened = False
        try:
            self._handle_request(identity, message)
        except seal.SealError:  # rows that did not open: not handled, and
            unopened = True     # resent over the worker's next session
            raise
        finally:
            # Every sequence number a registered worker's connection used is
            # answered for good, refusals and admin requests included (a
            # worker resends a ONCE_ONLY request only when the answer may
            # be lost, and gets the one kept in _answers again): mark them
            # all, so the tracker keeps no gaps and its memory stays flat.
            # All but a jump (a refused HELLO of the same process's).
            tracker = self._seqs.get(worker)
            if tracker is not None and not unopened and \
                    not tracker.beyond(message.seq) and \
                    self._identities.get(worker) == identity:
                tracker.mark(message.seq)

    def _handle_request(self, identity, message):
        kind = message.type
        if kind == MsgType.STATS:
            self._stats(identity, message)
            return
        if kind == MsgType.STOP:
            self._send(identity, Message(MsgType.ACK, seq=message.seq))
            self._stop.set()
            return
        if kind == MsgType.CHECKPOINT:  # admin: ACK once written
            self._checkpoint_request(identity, message)
            return
        worker = message.worker
        if not 0 <= worker < self.num_workers:
            raise RequestError(f"worker id {worker} is not in "
                               f"[0, {self.num_workers})")
        if self._failed is not None:
            raise RequestError(self._failed, protocol.ERROR_WORKER_DEAD)
        if kind == MsgType.HELLO:
            self._hello(identity, message)
            return
        if worker in self._dead:  # it stalled, connected: tell it, always
            raise RequestError(self._declared_dead(worker),
                               protocol.ERROR_WORKER_DEAD)
        if kind == MsgType.HEARTBEAT and \
                self._curve_identities.get(worker) == identity:
            # A sealed session's heartbeats come over CURVE: a restarted
            # shard (on another data port) answers them hello_required.
            self._last_seen[worker] = time.monotonic()
            return
        if self._identities.get(worker) != identity:
            raise RequestError(f"worker {worker} must send HELLO first "
                               f"(this shard may have restarted)",
                               protocol.ERROR_HELLO_REQUIRED)
        self._last_seen[worker] = time.monotonic()
        if kind == MsgType.HEARTBEAT:
            if isinstance(identity, tuple):  # a sealed session's: echoed,
                # so a message of ours its link lost shows (seal.SealGap)
                self._send(identity, Message(MsgType.HEARTBEAT))
            return
        if kind == MsgType.RELEASE:
            self._release(worker, message)
            return
        if kind == MsgType.LEAVE:
            self._leave(identity, message)
            return
        handler = {
            MsgType.CREATE: self._create,
            MsgType.DECLARE: self._declare,
            MsgType.READ: self._read,
            MsgType.UPDATE: self._update,
            MsgType.CLOCK: self._clock,
        }.get(kind)
        if handler is None:
            raise RequestError(f"{kind.name} is not a request a shard takes")
        if kind in ONCE_ONLY and \
                self._seqs[worker].seen(message.seq):  # a resend: done
            self.stats["duplicates"] += 1
            answer = self._answers.get(worker, {}).get(message.seq)
            table = self._tables.get(message.table)
            if answer is None and kind == MsgType.CREATE and \
                    table is not None and \
                    message.table in self._existing.get(worker, ()):
                answer = self._table_ack(table, message.seq, existing=True)
            if answer is not None:  # the first answer was lost: again
                self._send(identity, answer)
            elif kind != MsgType.UPDATE:
                self._send(identity, Message(
                    MsgType.ACK, table=message.table, seq=message.seq))
            return
        handler(identity, message)

    def _seq_jump(self, worker, seq):
        return RequestError(
            f"sequence number {seq} is more than {SeqTracker.WINDOW} past "
            f"worker {worker}'s latest ({self._seqs[worker].top}): refused, "
            f"not counted")

    # ---------------------------------------------------------- requests
    def _stats(self, identity, message):
        """Answers STATS (anyone may ask: a monitor, a client before its
        HELLO). Its reply copies every table's figures, so for a peer that
        asks and reads nothing they would pile up (100 tables: 115 KB per
        49-byte request): at most MAX_UNSENT_STATS wait per peer, and
        MAX_UNSENT_STATS_ALL in all; past that, a short ERROR."""
        unsent = self._unsent_stats = [(who, tracker) for who, tracker
                                       in self._unsent_stats
                                       if not tracker.done]
        mine = sum(who == identity for who, _ in unsent)
        if mine >= MAX_UNSENT_STATS:
            raise RequestError(f"{mine} STATS replies to this peer are not "
                               f"taken yet: read them before asking again")
        if len(unsent) >= MAX_UNSENT_STATS_ALL:
            raise RequestError(f"{len(unsent)} STATS replies are not taken "
                               f"yet: read them before asking again")
        tracker = self._send(identity, protocol.stats_reply(
            message.seq, self.snapshot_stats()), track=True)
        if tracker is not None:
            unsent.append((identity, tracker))

    def _hello(self, identity, message):
        meta = message.meta
        for key, mine in (("num_workers", self.num_workers),
                          ("num_shards", self.num_shards)):
            if key in meta and meta[key] != mine:
                raise RequestError(f"worker {message.worker} expects "
                                   f"{key}={meta[key]}, this shard has "
                                   f"{mine}")
        worker = message.worker
        owner = self._auth.owner_of(self._curve_user) if self._auth else None
        if owner is not None and owner != worker:
            raise RequestError(f"this CURVE key is bound to worker {owner} "
                               f"(its allowed key file is worker{owner}.key)"
                               f"; it cannot say HELLO as worker {worker}")
        incarnation = meta.get("incarnation", 0)
        if incarnation in self._buried.get(worker, ()):
            raise RequestError(self._declared_dead(worker),
                               protocol.ERROR_WORKER_DEAD)
        previous = self._incarnations.get(worker)
        if previous == incarnation and self._seqs[worker].beyond(message.seq):
            raise self._seq_jump(worker, message.seq)
        rejoined_at = None
        if previous == incarnation and worker in self._dead:
            # (a death for silence buried this incarnation: refused above)
            # It left (closed its client), another worker went on past its
            # clocks (a death that buries nothing) and its process comes
            # back: it rejoins, as a new process of it would.
            rejoined_at = self._rejoin(worker)
        if previous != incarnation:
            # A new worker process (or this shard is new): its requests are
            # numbered from its HELLO on.
            self._seqs[worker] = SeqTracker(message.seq)
            self._answers.pop(worker, None)
            self._existing.pop(worker, None)
            self._forget_process(worker)
            if worker in self._dead:
                rejoined_at = self._rejoin(worker)
            elif previous is not None:
                rejoined_at = self._restarted(worker)
                # The old process never takes its place back (it may only
                # have been cut off): one a death buried, or this one.
                self._bury(worker, previous)
            self._incarnations[worker] = incarnation
        self._left.discard(worker)  # back (a new client): a member again
        self._identities[worker] = identity
        self._last_seen[worker] = time.monotonic()
        if self._started is None:
            self._started = self._last_seen[worker]
        welcome = {
            "shard_id": self.shard_id, "incarnation": self.incarnation,
            "num_shards": self.num_shards,
            "num_workers": self.num_workers,
            "max_message_bytes": self.settings.max_message_bytes,
            "max_pending_clocks": self.settings.max_pending_clocks,
            "checkpoint_every": self.settings.checkpoint_every,
            "worker_timeout": float(self.settings.worker_timeout)}
        if rejoined_at is not None:
            welcome["rejoined_at"] = rejoined_at
        # Its own number, whatever route the worker's later requests take
        # (with a sealed session: the data socket's, not this one).
        self._seqs[worker].mark(message.seq)
        if self._data is not None:
            welcome["sealed"] = self._new_session(worker)
            self._curve_identities[worker] = identity
        if self._arena is not None and "shm" in meta:
            # A worker's upload buffer holds a whole table, whose part here
            # is at most half of max_table_bytes (rows + a clock's sums);
            # a shard maps at most 5 per table at once: room for 8.
            peer = shm.PeerBuffers.connect(
                meta["shm"], role="worker", max_mapped_bytes=8 * (
                    self.num_shards * self.settings.max_table_bytes))
            if peer is not None:  # co-located: it can map ours too
                self._shm_writers[worker] = peer
                welcome.update(shm=self._arena.describe(), shm_ok=True)
            else:  # another host, container or user: TCP frames
                welcome["shm_ok"] = False
        self._send(identity, Message(MsgType.WELCOME, seq=message.seq,
                                     meta=welcome))

    def _new_session(self, worker):
        """A sealed session for `worker` (replacing its earlier one): its
        replies go there from now on. Returns WELCOME's `sealed` field."""
        for old in [k for k, v in self._sessions.items()
                    if v.worker == worker]:
            self._end_session(old)
        keys = seal.new_session()
        if self._seal_buffers is None:  # one pool: all seal in this thread
            self._seal_buffers = seal.Buffers()
        route = keys["session"]
        channel = seal.Channel(route, keys["s2c"], keys["c2s"],
                               self._seal_buffers)
        # (what goes to it waits for its first message: the worker's link
        # is connected then, and nothing is dropped on an unknown route)
        self._sessions[route] = Session(worker, channel, seal.Sender(
            channel, lambda frames, track: self._send_to(
                self._data, [route] + frames, track), ready=False))
        token = os.urandom(16).hex()  # lets it connect once (not a key)
        self._session_tokens[route.hex()] = token
        self._identities[worker] = ("sealed", route)
        port = int(self.data_address.rsplit(":", 1)[1])
        return [port, route.hex(), keys["c2s"].hex(), keys["s2c"].hex(),
                token]

    def _end_session(self, route):
        """Ends a sealed session: what it held back is dropped, its route
        is refused from now on."""
        self._sessions.pop(route).sender.close()
        self._session_tokens.pop(route.hex(), None)

    def _pump_sealed(self):
        """Seals what the sessions' senders hold back once ZeroMQ has sent
        enough of what went before (`seal.pump_all`)."""
        return seal.pump_all(s.sender for s in self._sessions.values())

    # ------------------------------------------------------ shared memory
    def _new_table(self, table_id, spec):
        table = Table(table_id, spec, self.num_workers)
        for worker in self._dead:  # the clock never waits for them
            table.vclock[worker] = DEAD_CLOCK
        table.pool = BufferPool((table.local_rows, table.width),
                                table.dtype, self._arena, self._held)
        return table

    def _held(self, buffer_id):
        return bool(self._holds.get(buffer_id))

    def _shared_buffer(self, table, array):
        return table.pool.shared.get(id(array)) if table.pool else None

    def _forget_process(self, worker):
        """A new or dead worker process holds none of our buffers, and
        what was sent to an earlier one counts against no READ of it."""
        self._unsent_reads.pop(worker, None)
        self._unsent_pushes.pop(worker, None)
        for table_id, owed in list(self._owed_pushes.items()):
            owed.discard(worker)  # (a new process declares its tables)
            if not owed:
                del self._owed_pushes[table_id]
        for table in self._tables.values():
            if table.lent is not None and table.lent[1] == worker:
                # Never reused: a hung old process may still write into it.
                self._end_lend(table, reuse=False)
            if table.pool is not None:
                self._disown(table, worker)
        self._shm_writers.pop(worker, None)
        self._shm_readers.discard(worker)
        for buffer_id, holders in list(self._holds.items()):
            holders.pop(worker, None)
            if not holders:
                del self._holds[buffer_id]

    def _disown(self, table, worker):
        """No rows of `table` stay in buffers once lent to `worker`'s process
        (gone or replaced: a hung one keeps them mapped writable), and no
        such buffer is handed out again: those in use are copied out."""
        in_use = table.pool.drop_writer(worker)
        if not in_use:
            return

        def copied(array):
            fresh = table.pool.get()  # (none of that process's now)
            np.copyto(fresh, array)
            self._trackers.pop(id(array), None)  # (its sends keep it alive)
            table.pool.discard(array)
            return fresh

        if id(table.data) in in_use:
            old = table.data
            table.data = copied(old)
            for pending in table.pending.values():
                pending.replace_base(old, table.data)
        for pending in table.pending.values():
            if id(pending.buffer) in in_use:
                pending.buffer = copied(pending.buffer)

    def _release(self, worker, message):
        if self._arena is None or \
                message.meta.get("arena") != self._arena.token.hex():
            return  # meant for an earlier incarnation of this shard
        buffers = message.meta.get("buffers", [])
        for buffer_id in buffers:
            holders = self._holds.get(buffer_id) \
                if isinstance(buffer_id, int) else None
            if holders and holders.get(worker, 0) > 0:
                holders[worker] -= 1
                if not holders[worker]:
                    del holders[worker]
                if not holders:
                    del self._holds[buffer_id]

    def _holds_of(self, worker, table):
        return sum(self._holds.get(shared.id, {}).get(worker, 0)
                   for shared in table.pool.shared.values())

    def _ref_rows(self, table, worker, ref):
        """The update rows a co-located worker left in shared memory."""
        peer = self._shm_writers.get(worker)
        if peer is None:
            raise RequestError(f"worker {worker} sent a shared-memory "
                               f"reference, but shares no memory with this "
                               f"shard")
        try:
            rows = peer.rows(ref, table.dtype, table.width)
        except ValueError as exc:
            raise RequestError(f"worker {worker}, table {table.id}: "
                               f"{exc}") from None
        self.stats["shm_bytes_in"] += rows.nbytes
        return rows

    def _table_for(self, message):
        spec = protocol.table_spec(message.meta)
        if any(v is None for v in spec.values()):
            raise RequestError(f"{message.type.name} needs name, rows, width, "
                               f"dtype, row_start and row_end")
        problem = protocol.table_spec_problem(message.table, spec)
        if problem is not None:
            raise RequestError(problem)
        table = self._tables.get(message.table)
        if table is not None:
            if table.spec != spec:
                raise RequestError(f"table {message.table} exists as "
                                   f"{table.spec}, worker {message.worker} "
                                   f"declares {spec}",
                                   protocol.ERROR_TABLE_EXISTS)
            return table
        if len(self._tables) >= self.settings.max_tables:
            raise RequestError(f"shard holds {len(self._tables)} tables, the "
                               f"limit (max_tables)")
        problem = self._row_problem(message.table, spec)
        if problem is not None:
            raise RequestError(problem)
        nbytes, room = self._table_room(spec)
        if not self._room_for(room):
            copies = self._table_copies()
            snapshot = " and its snapshot" if copies == 3 else ""
            raise RequestError(f"table {message.table} of {nbytes} bytes "
                               f"({copies} times that with a clock's "
                               f"updates{snapshot}) exceeds the shard's "
                               f"memory limit "
                               f"(max_table_bytes="
                               f"{self.settings.max_table_bytes}, "
                               f"{self._held_bytes()} bytes held)")
        table = self._new_table(message.table, spec)
        self._tables[message.table] = table
        return table

    def _row_problem(self, table_id, spec):
        """A row of the table too large for one message, or None."""
        row_bytes = spec["width"] * protocol.numpy_dtype(
            spec["dtype"]).itemsize
        if row_bytes > self.settings.max_message_bytes:
            return (f"table {table_id}: a row of {row_bytes} bytes exceeds "
                    f"max_message_bytes={self.settings.max_message_bytes}")
        return None

    def _table_room(self, spec):
        """(bytes of the table's rows here, bytes it needs): its rows + a
        clock's updates (+ the snapshot a checkpointing shard takes of it),
        and the written flags of its rows and of that clock's."""
        rows = spec["row_end"] - spec["row_start"]
        nbytes = rows * spec["width"] * protocol.numpy_dtype(
            spec["dtype"]).itemsize
        return nbytes, self._table_copies() * nbytes + 2 * rows

    def _table_copies(self):
        """Copies of a table's rows a table is admitted with room for: the
        rows and a clock's updates, and on a shard with a checkpoint folder
        the snapshot it keeps once it took one (every K clocks, or at a
        checkpoint request or a LEAVE, even without K)."""
        return 3 if self.settings.checkpoint_dir else 2

    def _restore_limits(self, specs):
        """What of a checkpoint's tables ({id: spec}) is beyond this
        shard's limits, checked as CREATEs of them would be, or None."""
        for table_id, spec in specs.items():
            problem = self._row_problem(table_id, spec)
            if problem is not None:
                return problem + " (beyond this shard's limits)"
        rooms = [self._table_room(spec) for spec in specs.values()]
        nbytes = sum(rows for rows, _ in rooms)
        need = sum(room for _, room in rooms)
        if len(specs) > self.settings.max_tables or \
                need > self.settings.max_table_bytes:
            return (f"{len(specs)} tables of {nbytes} bytes, beyond this "
                    f"shard's limits (max_tables={self.settings.max_tables},"
                    f" max_table_bytes={self.settings.max_table_bytes}, "
                    f"which must hold {need} bytes for them, as for CREATEs"
                    f" of them)")
        return None

    def _held_bytes(self):
        """Bytes of rows held: each table's rows, its pending clocks and
        lent buffer (with their rows' written flags), checkpoint snapshot, the
        pooled buffers it keeps for reuse (or that sends to slow readers
        still use), the flags of initial rows still coming, and the
        updates held for their turn (`ShardSettings.deterministic_sums`)
        with the rows buffer of each clock they wait in, which `_hold`
        reserved."""
        total = 0
        for t in self._tables.values():
            copies = 1 + len(t.pool.free)
            if t.snapshot is not None and t.snapshot[1] is not t.data:
                copies += 1
            # (a lent buffer becomes a pending clock: `_adopt_lent`)
            clocks = len(t.pending) + (t.lent is not None) + sum(
                1 for clk in t.held if clk not in t.pending)
            total += t.nbytes * copies + t.clock_bytes * clocks + sum(
                h.nbytes for held in t.held.values() for h in held)
            if t.initialised is not None:
                total += t.initialised.nbytes
        return total

    def _room_for(self, nbytes, table=None):
        """Whether `nbytes` more fit within max_table_bytes, once pooled
        buffers nothing reads are dropped. A buffer `table`'s pool hands
        out again costs nothing."""
        limit = self.settings.max_table_bytes
        reuse = table is not None and table.pool.has_reusable()
        # A buffer the pool hands out again is counted already (pooled).
        need = nbytes - table.nbytes if reuse else nbytes
        if need <= 0 or self._held_bytes() + need <= limit:
            return True
        for t in self._tables.values():
            t.pool.shrink()
        if reuse and not table.pool.has_reusable():  # it was dropped too
            need = nbytes
        return self._held_bytes() + need <= limit

    def _note_reader(self, message):
        if message.meta.get("shm") and message.worker in self._shm_writers:
            self._shm_readers.add(message.worker)

    def _create(self, identity, message):
        table = self._table_for(message)
        table.subscribers.add(message.worker)
        self._note_reader(message)
        if table.ready and table.initialised is None:
            # Restored from a checkpoint (or created before): the shard's
            # rows win over a restarted creator's fresh initial values.
            self._existing.setdefault(message.worker, set()).add(table.id)
            self._answer(identity, message, self._table_ack(
                table, message.seq, existing=True))
            if message.meta.get("chunk_row", 0) == 0:
                self._answering_push(table, message.worker)
            return
        creator = (message.worker, self._incarnations.get(message.worker))
        if table.creator is not None and table.creator != creator and \
                table.creator[0] == creator[0]:
            # The creator's process was replaced in the middle of sending
            # the rows: the new one sends them all again, and the table
            # must not mix the two processes' initial values.
            table.initialised[:] = False
        table.creator = creator
        # Every frame is checked before any is written: a refused CREATE
        # leaves no rows behind (its corrected resend must not find them).
        row, spans = message.meta.get("chunk_row", 0), []
        for array in message.arrays:
            self._check_rows(table, array, row)
            spans.append((slice(row, row + array.shape[0]), array))
            if table.initialised[spans[-1][0]].any():
                raise RequestError(f"table {table.id}: rows from {row} are "
                                   f"already initialised")
            row += array.shape[0]
        for rows, array in spans:
            table.data[rows] = array
            table.initialised[rows] = True
        complete = not table.ready and table.initialised.all()
        if complete:
            table.ready = True
            table.initialised = None
        self._answer(identity, message, self._table_ack(table, message.seq))
        if complete:
            self._maybe_snapshot(table, 0, table.data)  # restorable at once
            for worker in table.subscribers:
                if worker != message.worker:
                    self._push(table, worker)
            self._maybe_advance(table)  # clocks that came before the rows
            self._serve_parked()

    def _declare(self, identity, message):
        table = self._table_for(message)
        table.subscribers.add(message.worker)
        self._note_reader(message)
        self._send(identity, self._table_ack(table, message.seq))
        if table.ready:
            self._answering_push(table, message.worker)

    @staticmethod
    def _table_ack(table, seq, existing=False):
        meta = {"global_clock": table.global_clock, "ckpt": table.ckpt_clock,
                "ready": table.ready}
        if existing:
            meta["existing"] = True
        if table.restored_clock is not None and \
                table.global_clock == table.restored_clock:
            meta["restored"] = True  # at its checkpoint's clock still
        return Message(MsgType.ACK, table=table.id, seq=seq, meta=meta)

    def _read(self, identity, message):
        self._note_reader(message)
        table = self._tables.get(message.table)
        if table is not None and table.ready and message.clk > \
                table.global_clock + self.settings.max_pending_clocks + 1:
            raise RequestError(
                f"a read of table {message.table} at clock {message.clk}, "
                f"more than max_pending_clocks="
                f"{self.settings.max_pending_clocks} past its clock "
                f"{table.global_clock}: no worker gets that far ahead")
        if table is None or not table.ready \
                or table.global_clock < message.clk:
            self._park(identity, message)
            return
        worker = message.worker
        unsent = self._unsent_reads[worker] = [
            sends for sends in self._unsent_reads.get(worker, ())
            if not all(t.done for t in sends)]
        if len(unsent) >= MAX_UNSENT_READS:
            raise RequestError(
                f"{len(unsent)} replies to worker {worker}'s reads are not "
                f"sent yet (it reads none of them): refusing read of table "
                f"{message.table}")
        sends = self._send_rows(table, [identity], MsgType.ROWS,
                                message.seq, table.data)
        if sends:
            unsent.append(sends)

    def _answering_push(self, table, worker):
        """Pushes `table`'s rows to `worker` answering its DECLARE or
        CREATE, zero-copy (as a READ's rows: `_send_to`), but not while
        PUSHES_QUEUED pushes of them wait to go to the same connection,
        none of the oldest sent yet (`_push_waits`): they all come next,
        and any later clock's rows follow as to every subscriber. (Once
        some went, the worker may have dropped them, a table whose
        creation failed and is tried again: its rows go again.) A peer
        that repeats such requests and reads nothing had the shard queue a
        copy of the rows each time (3000 DECLAREs of a 64 KB table:
        +181 MB).
        (Not refused: a worker declares a table again in a recovery, right
        behind a request of its own it held back.)"""
        identity = self._identities.get(worker)
        if identity is None:
            return
        if self._push_waits(worker, identity, table):
            self.stats["pushes_skipped"] += 1
            return
        self._push_rows(worker, identity, table, table.data)

    def _push_waits(self, worker, identity, table):
        """Whether PUSHES_QUEUED pushes of `table`'s rows to `worker` at
        `identity` wait to go, none of the oldest sent yet (chunks leave
        in order: its first chunk's tracker tells)."""
        last = self._unsent_pushes.get(worker, {}).get(table.id)
        if last is None or last[0] != identity or \
                len(last[1]) < PUSHES_QUEUED:
            return False
        oldest = last[1][0]
        return bool(oldest) and not oldest[0].done

    def _sent_push(self, worker, identity, table, sends):
        """Notes a push of `table`'s rows to `worker` at `identity` (its
        trackers `sends`: none for a shared-memory reference)."""
        tables = self._unsent_pushes.setdefault(worker, {})
        last = tables.get(table.id)
        if last is None or last[0] != identity:
            last = tables[table.id] = (
                identity, collections.deque(maxlen=PUSHES_QUEUED))
        last[1].append(sends)

    def _push_rows(self, worker, identity, table, data):
        """Pushes `data`, `table`'s rows, to `worker` at `identity`,
        zero-copy (tracked, and queued as the table's own buffers, which
        max_table_bytes counts, not as copies: `_send_to`)."""
        self._sent_push(worker, identity, table, self._send_rows(
            table, [identity], MsgType.PUSH, 0, data, zero_copy=True))

    def _push_to_subscribers(self, table, data):
        """Pushes the rows of `table`'s new clock to every subscriber (as
        `_push_rows` does, all in one `_send_rows`), but to none for which
        PUSHES_QUEUED pushes of them wait, none of the oldest sent: that
        one is owed the table's rows (`_owed_pushes`), pushed at their
        clock of the moment once its oldest push started to leave
        (`_pay_owed_pushes`), as a worker takes the freshest rows anyway.
        So a worker that clocks and reads nothing has at most three
        pushes of a table queued, not one per clock (20,000 CLOCKs of a
        60 KB table took 1.1 GB)."""
        owed = self._owed_pushes.get(table.id, set())
        going = {}
        for worker in sorted(table.subscribers):
            identity = self._identities.get(worker)
            if identity is None:
                continue
            if self._push_waits(worker, identity, table):
                owed.add(worker)
                self.stats["pushes_deferred"] += 1
                self._owed_moved = time.monotonic()
            else:
                owed.discard(worker)
                going[identity] = worker
        if going:
            sends = {}
            self._send_rows(table, list(going), MsgType.PUSH, 0, data,
                            zero_copy=True, by_identity=sends)
            for identity, worker in going.items():
                self._sent_push(worker, identity, table,
                                sends.get(identity, []))
        if owed:
            self._owed_pushes[table.id] = owed
        else:
            self._owed_pushes.pop(table.id, None)

    def _pay_owed_pushes(self):
        """Pushes each table's current rows to the workers owed them whose
        earlier push started to leave (or who left, or are another process
        now). Returns whether some are still owed."""
        for table_id, owed in list(self._owed_pushes.items()):
            table = self._tables[table_id]
            for worker in sorted(owed):
                identity = self._identities.get(worker)
                if identity is None or worker not in table.subscribers:
                    owed.discard(worker)
                elif not self._push_waits(worker, identity, table):
                    owed.discard(worker)
                    self._owed_moved = time.monotonic()
                    self._push_rows(worker, identity, table, table.data)
            if not owed:
                del self._owed_pushes[table_id]
        return bool(self._owed_pushes)

    def _park(self, identity, message):
        """Keeps a read until its rows are fresh enough: at most
        max_parked_reads, and each worker at most its share of them."""
        limit = self.settings.max_parked_reads
        share = -(-limit // self.num_workers)
        if len(self._parked) >= share:
            self._prune_parked()
            mine = sum(m.worker == message.worker for _, m in self._parked)
            if len(self._parked) >= limit or mine >= share:
                raise RequestError(
                    f"too many waiting reads ({len(self._parked)}, {mine} "
                    f"of worker {message.worker}; max_parked_reads={limit}"
                    f"): refusing read of table {message.table}")
        self._parked.append((identity, message))

    def _prune_parked(self):
        """Drops waiting reads no answer can reach: of a dead worker, or
        from a route its worker left (a new connection or session; the
        worker asks again over it)."""
        self._parked = [(i, m) for i, m in self._parked
                        if m.worker not in self._dead
                        and self._identities.get(m.worker) == i]

    def _serve_parked(self):
        parked, self._parked = self._parked, []
        for identity, message in parked:
            try:
                self._read(identity, message)
            except RequestError as exc:  # (its worker can be told)
                self._refuse(identity, message, str(exc), exc.code)

    def _check_rows(self, table, array, row):
        """Refuses rows of another dtype or width, or (at local row `row`;
        None for an indexed update's, whose repeated ids add up) past the
        shard's rows."""
        if array.dtype != table.dtype:
            raise RequestError(f"table {table.id}: rows of dtype "
                               f"{array.dtype.name}, table holds "
                               f"{table.dtype.name}")
        if array.ndim != 2 or array.shape[1] != table.width:
            raise RequestError(f"table {table.id}: rows of shape "
                               f"{list(array.shape)}, table width is "
                               f"{table.width}")
        if row is not None and \
                not 0 <= row <= row + array.shape[0] <= table.local_rows:
            raise RequestError(f"table {table.id}: rows [{row}, "
                               f"{row + array.shape[0]}) are outside this "
                               f"shard's {table.local_rows} rows")

    def _update(self, identity, message):
        table = self._tables.get(message.table)
        if table is None:
            raise RequestError(f"update of table {message.table}, which is "
                               f"not created (or declared) here")
        # A table whose initial rows have not all come yet (a worker's
        # replay to a shard restored without it) holds the updates as
        # deltas: the clock waits for the rows anyway (`_maybe_advance`).
        worker, clk = message.worker, message.clk
        self._check_clock(table, worker, clk, _UPDATE_OFF_CLOCK)
        arrays = message.arrays
        indexed = message.meta.get("indexed", False)
        if indexed:
            if len(arrays) != 2:
                raise RequestError("an indexed update carries [indices, rows]")
            index, rows = arrays
            if index.ndim != 1 or index.dtype != np.int64:
                raise RequestError("update indices must be a 1-D int64 frame")
            self._check_rows(table, rows, None)
            if rows.shape[0] != index.shape[0]:
                raise RequestError(f"{index.shape[0]} indices for "
                                   f"{rows.shape[0]} rows")
            if index.size and (index.min() < 0
                               or index.max() >= table.local_rows):
                bad = index[(index < 0) | (index >= table.local_rows)][0]
                raise RequestError(f"table {table.id}: row index {bad} is "
                                   f"outside [0, {table.local_rows})")
        elif "into" in message.meta:  # the clock's rows: no add follows
            self._adopt_lent(table, worker, clk, message)
        else:
            if "ref" in message.meta:
                if arrays:
                    raise RequestError("an UPDATE carries frames or a "
                                       "shared-memory ref, not both")
                arrays = [self._ref_rows(table, worker,
                                         message.meta["ref"])]
            elif not arrays:
                raise RequestError("an UPDATE without rows")
            row = message.meta.get("chunk_row", 0)
            for array in arrays:
                self._check_rows(table, array, row)
                row += array.shape[0]
        update = Update(worker, message.meta.get("chunk_row", 0),
                        [rows] if indexed else arrays,
                        index if indexed else None)
        try:
            self._add_update(table, worker, clk, update, arrays)
        except NoRoomError:
            # The worker's CLOCK of it must not complete the clock without
            # it (`_clock`): the update would be lost without a word.
            table.refused.setdefault(worker, clk)
            raise
        # No ACK per update: requests are handled in order, so the ACK of
        # the CLOCK that follows acknowledges every update before it.
        table.updated[worker] = clk
        self.stats["updates_applied"] += 1

    def _add_update(self, table, worker, clk, update, arrays):
        """Adds a checked update to its clock's sum, or holds it for its
        turn (deterministic_sums).

        Raises:
            NoRoomError: no memory for it within max_table_bytes.
        """
        if self.settings.deterministic_sums and \
                not self._in_turn(table, worker, clk):
            update.arrays = self._rows_to_hold(update.arrays)
            self._hold(table, clk, update)
        else:
            if clk not in table.pending and clk not in table.held:
                # (held updates of the clock reserved its buffer: `_hold`)
                self._check_room(table, clk, table.clock_bytes, table)
            pending = self._pending_for(
                table, clk, table.base_after(table.data) if table.ready and
                clk == table.global_clock else None)
            if self._unopened is not None:  # one sealed frame: checked above
                pending.add_sealed(update.row, arrays[0], self._unopened)
            else:
                update.add_to(pending)

    def _check_room(self, table, clk, nbytes, reuse=None):
        """Raises NoRoomError unless `nbytes` more for clock `clk` of
        `table` fit within max_table_bytes (`reuse`: `_room_for`'s)."""
        if not self._room_for(nbytes, reuse):
            raise NoRoomError(
                f"no memory for clock {clk} updates of table {table.id} "
                f"(max_table_bytes={self.settings.max_table_bytes}, "
                f"{self._held_bytes()} bytes held, "
                f"{sum(t.pool.nbytes for t in self._tables.values())} "
                f"of them still being sent to slow readers)")

    # ---------------------------------- deterministic sums (worker order)
    def _in_turn(self, table, worker, clk):
        """Whether an update of `worker` for clock `clk` may be added now:
        the clock is the table's, and every worker before `worker` has
        finished it (or is dead) with nothing of theirs, or of its own,
        still held."""
        if not (table.ready and clk == table.global_clock):
            return False
        if not bool((table.vclock[:worker] > clk).all()):
            return False
        return not any(h.worker <= worker for h in table.held.get(clk, ()))

    def _rows_to_hold(self, arrays):
        """An update's rows as they can wait: a sealed frame opened (and so
        checked) now, in place; received frames, and a co-located worker's
        shared memory, as they are (a worker writes an upload buffer again
        only once every shard's rows of a later clock came, and a clock
        completes only after its held updates went in)."""
        if self._unopened is not None:
            opened = self._unopened.open_as(arrays[0].dtype, arrays[0].shape)
            self._unopened = None
            return [opened]
        return list(arrays)

    def _hold(self, table, clk, held):
        """Keeps `held` (an `Update`) until its turn, within
        max_table_bytes (with the clock's rows buffer, if it has none
        yet)."""
        fresh = clk not in table.pending and clk not in table.held
        self._check_room(table, clk,
                         held.nbytes + (table.clock_bytes if fresh else 0))
        table.held.setdefault(clk, []).append(held)
        self.stats["updates_held"] += 1

    def _add_held(self, table, clk, base):
        """Adds the held updates of clock `clk` whose turn has come, in
        worker order (each worker's in the order they came), onto `base`
        (the rows that clock starts from)."""
        held = table.held.get(clk)
        if not held:
            return
        unfinished = np.flatnonzero(table.vclock <= clk)
        # The first worker still in the clock may add; those after it wait.
        last = int(unfinished[0]) if unfinished.size else table.vclock.size
        due = sorted((h for h in held if h.worker <= last),
                     key=lambda h: h.worker)
        if not due:
            return
        rest = [h for h in held if h.worker > last]
        if rest:
            table.held[clk] = rest
        else:
            del table.held[clk]
        pending = self._pending_for(table, clk, base)
        for update in due:
            update.add_to(pending)

    @staticmethod
    def _pending_for(table, clk, base):
        """The `Pending` of clock `clk` of `table`, made on `base` (see
        `Pending`) if it has none yet."""
        pending = table.pending.get(clk)
        if pending is None:
            pending = table.pending[clk] = Pending(table.pool.get(), base)
        return pending

    def _adopt_lent(self, table, worker, clk, message):
        """An UPDATE whose rows + update the worker wrote into the buffer
        this shard lent it: that buffer becomes the clock's fresh rows."""
        lent = table.lent
        if message.arrays or "ref" in message.meta:
            raise RequestError("an UPDATE into a lent buffer carries no rows")
        if lent is None or lent[0] != clk or lent[1] != worker or \
                message.meta["into"] != lent[3].id or \
                clk != table.global_clock or clk in table.pending:
            raise RequestError(f"worker {worker} wrote clock {clk} of table "
                               f"{table.id} into buffer "
                               f"{message.meta['into']!r:.40}, which this "
                               f"shard did not lend it for that clock")
        table.lent = None
        pending = table.pending[clk] = Pending(lent[2], table.data)
        pending.written[:] = True
        self.stats["shm_bytes_in"] += lent[2].nbytes
        self.stats["lent_updates"] += 1

    def _lend(self, table, worker):
        """The buffer lent to `worker` for the table's next rows (see
        `ShardSettings.lend_buffers`), or None."""
        if not (self.settings.lend_buffers and self.num_workers == 1
                and not self.settings.checkpoint_every
                and not table.per_clock  # (its rows are not rows + update)
                and worker in self._shm_writers
                and table.global_clock not in table.pending):
            return None
        if table.lent is not None and table.lent[:2] == (table.global_clock,
                                                         worker):
            return table.lent[3]
        self._end_lend(table)
        if not self._room_for(table.clock_bytes, table):
            return None  # the update will come as usual, within the limit
        rows = table.pool.get()
        shared = self._shared_buffer(table, rows)
        if shared is None:
            table.pool.put(rows)
            return None
        table.lent = (table.global_clock, worker, rows, shared)
        table.pool.lend(rows, worker)
        return shared

    def _end_lend(self, table, reuse=True):
        """Takes back an unused lent buffer (its clock passed, or its
        worker is gone: then it is dropped, not reused)."""
        if table.lent is not None:
            if reuse:
                table.pool.put(table.lent[2])
            else:
                table.pool.discard(table.lent[2])
            table.lent = None

    def _check_clock(self, table, worker, clk, off_clock):
        """Refuses an UPDATE or CLOCK of `worker` at clock `clk` that is
        not its current clock of `table` (`off_clock`: the error's format,
        given worker, table, clk and current), or is too far ahead of the
        table's global clock (the client keeps its slack within it)."""
        current = int(table.vclock[worker])
        if clk != current:
            raise RequestError(off_clock.format(
                worker=worker, table=table.id, clk=clk, current=current))
        if clk - table.global_clock > self.settings.max_pending_clocks:
            raise RequestError(f"worker {worker} is {clk - table.global_clock}"
                               f" clocks ahead of table {table.id}'s global "
                               f"clock (max_pending_clocks="
                               f"{self.settings.max_pending_clocks})")

    def _clock(self, identity, message):
        table = self._tables.get(message.table)
        if table is None:
            raise RequestError(f"clock of unknown table {message.table}")
        worker, clk = message.worker, message.clk
        self._check_clock(table, worker, clk, _CLOCK_OFF_CLOCK)
        refused = table.refused.get(worker)
        if refused is not None and refused <= clk:
            error = (f"worker {worker} finished clock {clk} of table "
                     f"{table.spec['name']!r}, but this shard refused an "
                     f"update of its clock {refused} for lack of memory "
                     f"(max_table_bytes={self.settings.max_table_bytes}): "
                     f"the clock cannot complete without it; raise "
                     f"--max-table-bytes; the job stops")
            self._fail_job(error)
            raise RequestError(self._failed, protocol.ERROR_WORKER_DEAD)
        table.vclock[worker] = clk + 1
        self._send(identity, Message(MsgType.ACK, table=table.id,
                                     seq=message.seq))
        self._left_behind(table)
        self._maybe_advance(table)

    def _maybe_advance(self, table):
        if not table.ready:  # clocks wait for the initial rows
            return
        if table.held:
            self._add_held(table, table.global_clock,
                           table.base_after(table.data))
        new_global = int(table.vclock.min())
        if new_global > table.global_clock and new_global < DEAD_CLOCK:
            self._advance(table, new_global)

    def _advance(self, table, new_global):
        """Makes the finished clocks' rows current and pushes them."""
        data = table.data
        for clk in range(table.global_clock, new_global):
            if table.held:  # every worker finished clk: all of it is due
                self._add_held(table, clk, table.base_after(data))
            pending = table.pending.pop(clk, None)
            if pending is None and table.per_clock:  # no updates: zeros
                pending = Pending(table.pool.get(), table.zeros)
            if pending is not None:
                if pending.base is None:
                    pending.rebase(table.base_after(data))
                fresh = pending.complete()
                self._retire(table, data)
                data = fresh
            self._maybe_snapshot(table, clk + 1, data)
        table.data = data
        table.global_clock = new_global
        if table.lent is not None and table.lent[0] < new_global:
            self._end_lend(table)
        self._push_to_subscribers(table, data)
        waiting = table.pending.get(new_global)
        if waiting is not None:  # early (SSP) updates of the new clock
            waiting.rebase(table.base_after(data))
        if table.held:  # deterministic sums: early ones now in turn
            self._add_held(table, new_global, table.base_after(data))
        self.stats["pushes"] += 1
        self._serve_parked()

    def _retire(self, table, data):
        """Returns replaced rows to the pool, reusable once their sends end.
        Restored rows are not: they are the table's snapshot too, which a
        writer may still be saving when a later clock would be written into
        them (every other snapshot is a copy)."""
        if data is table.restored:
            table.restored = None
            self._trackers.pop(id(data), None)
            return
        table.pool.put(data, self._trackers.pop(id(data), []))

    def _push(self, table, worker):
        identity = self._identities.get(worker)
        if identity is not None:
            self._send_rows(table, [identity], MsgType.PUSH, 0, table.data)

    def _chunks(self, table):
        return protocol.row_chunks(table.local_rows, table.width,
                                   table.dtype.itemsize,
                                   self.settings.chunk_bytes)

    def _send_rows(self, table, identities, kind, seq, data,
                   zero_copy=False, by_identity=None):
        """Sends `data` (never changed later) in row chunks, zero-copy
        (small ones copied, but for a ROWS reply or with `zero_copy`:
        `_send_to`). Returns the sends' trackers; with `by_identity` (a
        dict), also puts each identity's there, in chunk order.

        Co-located workers get one reference to the buffer instead, and
        hold it until they RELEASE it.
        """
        shared = self._shared_buffer(table, data)
        if shared is not None:
            workers = {ident: w for w, ident in self._identities.items()}
            by_tcp = []
            for identity in identities:
                worker = workers.get(identity)
                if worker in self._shm_readers and self._holds_of(
                        worker, table) < self.settings.max_held_buffers:
                    self._send_ref(table, identity, worker, kind, seq,
                                   shared, data)
                else:
                    by_tcp.append(identity)
            identities = by_tcp
        trackers = []
        if not identities:
            return trackers
        for start, end in self._chunks(table):
            for identity, tracker in self._send_chunk(
                    table, identities, kind, seq, data, start, end,
                    zero_copy):
                trackers.append(tracker)
                if by_identity is not None:
                    by_identity.setdefault(identity, []).append(tracker)
        sending = [t for t in self._trackers.get(id(data), ()) if not t.done]
        self._trackers[id(data)] = sending + trackers
        return trackers

    def _send_ref(self, table, identity, worker, kind, seq, shared, data):
        meta = {"row_start": table.spec["row_start"],
                "row_end": table.spec["row_end"], "chunk_row": 0,
                "ckpt": table.ckpt_clock,
                "ref": shared.ref(0, data.nbytes)}
        if data is table.data:
            lent = self._lend(table, worker)
            if lent is not None:
                meta["lend"] = lent.ref(0, data.nbytes)
        holders = self._holds.setdefault(shared.id, {})
        holders[worker] = holders.get(worker, 0) + 1
        self.stats["shm_bytes_out"] += data.nbytes
        self._send(identity, Message(kind, table=table.id,
                                     clk=table.global_clock, seq=seq,
                                     meta=meta))

    def _send_chunk(self, table, identities, kind, seq, data, start, end,
                    zero_copy=False):
        meta = {"row_start": table.spec["row_start"],
                "row_end": table.spec["row_end"], "chunk_row": start,
                "ckpt": table.ckpt_clock}
        message = Message(kind, table=table.id, clk=table.global_clock,
                          seq=seq, arrays=[data[start:end]], meta=meta)
        sent = []  # (identity, tracker)
        for identity in identities:
            tracker = self._send(identity, message, track=True,
                                 zero_copy=zero_copy)
            if tracker is not None:
                sent.append((identity, tracker))
        return sent

    # ------------------------------------------- checkpoints, liveness
    def _maybe_snapshot(self, table, clock, data):
        every = self.settings.checkpoint_every
        if (every and clock % every == 0) or clock in table.snapshot_at:
            table.snapshot = (clock, data.copy())
            table.snapshot_own = False
        if table.snapshot_at:
            table.snapshot_at = {c for c in table.snapshot_at if c > clock}

    @staticmethod
    def _snapshot_cost(table):
        """Bytes a new snapshot of `table` adds: none where it replaces a
        copy of its own (one that is the rows themselves, at creation or
        restore, is no copy)."""
        copied = table.snapshot is not None and table.snapshot[1] is not \
            table.data
        return 0 if copied else table.nbytes

    def _snapshot_clocks_of(self, worker, own=False):
        """Has every table snapshot at the clock `worker` finished, where
        no checkpoint holds that clock yet: a worker that left, died (the
        job going on without it) or rejoined cannot replay what a restart
        of this shard from an older checkpoint would lose. Taken now where
        the table is at that clock, else when it gets there. `own`: that
        clock is this shard's own (where the worker rejoined or took over,
        at this shard's clock), not one every shard of the table takes.

        Returns:
            {table id: clock} of the tables whose checkpoint must still
            reach that clock (empty without a checkpoint_dir).
        """
        if self._writer is None:
            return {}
        wanted = {}
        for table in self._tables.values():
            clock = int(table.vclock[worker])
            if not table.ready or clock >= DEAD_CLOCK or \
                    clock <= table.ckpt_clock:
                continue
            wanted[table.id] = clock
            if table.snapshot is not None and table.snapshot[0] >= clock:
                continue  # one at (or past) it waits for the writer
            if clock == table.global_clock:
                extra = self._snapshot_cost(table)
                if not extra or self._room_for(extra):
                    table.snapshot = (clock, table.data.copy())
                    table.snapshot_own = own
                else:
                    log.warning("shard %d: no memory to snapshot table %r "
                                "at clock %d for worker %d", self.shard_id,
                                table.spec["name"], clock, worker)
                    del wanted[table.id]
            elif clock > table.global_clock:
                table.snapshot_at.add(clock)
        return wanted

    def _answer_leaves(self):
        """ACKs the LEAVEs whose clocks a written checkpoint now holds."""
        waiting = []
        written = {tid: t.ckpt_clock for tid, t in self._tables.items()}
        for identity, seq, clocks, worker in self._leave_acks:
            if self._holds_leave(written, clocks):
                self._send(identity, Message(MsgType.ACK, seq=seq))
            else:
                waiting.append((identity, seq, clocks, worker))
        self._leave_acks = waiting

    def _holds_leave(self, held, clocks):
        """Whether a checkpoint holding `held` (table id -> clock) holds a
        leaving worker's last `clocks` (table id -> clock); a table dropped
        since needs nothing."""
        return all(tid not in self._tables or tid in held and
                   held[tid] >= clock for tid, clock in clocks.items())

    def _checkpoint_request(self, identity, message):
        if self._writer is None:
            raise RequestError("this shard has no checkpoint_dir")
        # Copies only of tables that moved on since their snapshot (a
        # burst of requests copies nothing twice), and only within
        # max_table_bytes: a table with no snapshot of its own gains one.
        stale = [t for t in self._tables.values() if t.ready and (
            t.snapshot is None or t.snapshot[0] != t.global_clock)]
        extra = sum(self._snapshot_cost(t) for t in stale)
        if extra and not self._room_for(extra):
            raise RequestError(
                f"no memory to snapshot the tables for a checkpoint "
                f"({extra} bytes; max_table_bytes="
                f"{self.settings.max_table_bytes}, {self._held_bytes()} "
                f"bytes held)")
        self._writer.request(identity, message.seq)  # or refuses it
        for table in stale:
            table.snapshot = (table.global_clock, table.data.copy())
            table.snapshot_own = True

    def _housekeeping(self):
        if self._writer is not None:
            self._checkpoint_turn(self._writer)
        self._watch_workers()

    def _checkpoint_turn(self, writer):
        """Answers the requests a finished checkpoint write covered, and
        starts the next write when a request, a newer snapshot or a change
        of who left calls for one."""
        done = writer.finished()
        if done is not None:
            for table_id, clock in done.written.items():
                table = self._tables.get(table_id)
                if table is not None:
                    table.ckpt_clock = max(table.ckpt_clock, clock)
            self.stats["checkpoints"] += done.ok
            self._answer_leaves()
            for identity, seq in done.requests:
                self._send(identity, Message(MsgType.ACK, seq=seq) if done.ok
                           else Message(MsgType.ERROR, seq=seq, meta={
                               "error": "writing the checkpoint failed; "
                                        "see the shard's log"}))
        if not writer.due():
            return
        snapshots = {t.id: (t.spec, t.snapshot[0], t.snapshot[1])
                     for t in self._tables.values() if t.snapshot is not None}
        own = {t.id for t in self._tables.values()
               if t.snapshot is not None and t.snapshot_own}
        # A worker counts as left in the checkpoint that holds its last
        # clocks (its LEAVE is answered once that is written), not before:
        # restored from an earlier one, a shard still counts it a member,
        # whose client (waiting for that answer) recovers it and replays.
        held = {tid: clock for tid, (_, clock, _) in snapshots.items()}
        left = self._left - {
            worker for _, _, clocks, worker in self._leave_acks
            if not self._holds_leave(held, clocks)}
        if writer.requests or left != writer.left_written or \
                self._dead != writer.dead_written or any(
                    clock > self._tables[tid].ckpt_clock
                    for tid, (_, clock, _) in snapshots.items()):
            writer.start(snapshots, left, self._dead, own)

    def _watch_workers(self):
        """Declares dead the workers silent for longer than worker_timeout
        (after a restore of a job under way, each counts as heard from at
        the restore: a live one says HELLO within a heartbeat), and those
        that never said HELLO within STARTUP_GRACE_S of the job's first
        HELLO (or of the restore of a job that had not passed clock 0).
        Workers that left (LEAVE) are not watched."""
        timeout = self.settings.worker_timeout
        if not timeout or self._started is None or self._failed is not None:
            return
        if self._silent_workers(timeout):
            # What came while this shard was busy or paused (a long
            # request, a garbage collection, a stopped process) is read
            # first: a heartbeat waiting in its queue is no silence.
            self._catch_up(deadline=time.monotonic() + timeout)
        now = time.monotonic()
        for worker, seen in self._silent_workers(timeout, now):
            if self._failed is not None:
                return
            if seen is not None:
                since = (" since this shard's restore"
                         if seen == self._restored_at else "")
                self._worker_died(worker, (
                    f"worker {worker} sent nothing{since} for "
                    f"{now - seen:.1f} s (worker_timeout={timeout:g} s): it "
                    f"died or hangs"))
            else:
                self._worker_died(worker, (
                    f"worker {worker} never connected, "
                    f"{now - self._started:.0f} s after the job's start "
                    f"(or this shard's restore)"))

    def _silent_workers(self, timeout, now=None):
        """[(worker, time last seen or None)] of the watched workers
        silent for longer than `timeout`, or never connected within
        max(timeout, STARTUP_GRACE_S) of the start."""
        now = time.monotonic() if now is None else now
        grace = max(timeout, STARTUP_GRACE_S)
        silent = []
        for worker in range(self.num_workers):
            if worker in self._dead or worker in self._left:
                continue
            seen = self._last_seen.get(worker)
            if seen is None:
                quiet, limit = now - self._started, grace
            else:
                quiet, limit = now - seen, timeout
            if quiet > limit:
                silent.append((worker, seen))
        return silent

    def _catch_up(self, deadline):
        """Serves what the sockets hold, until they hold nothing or
        `deadline` (time.monotonic()) passes."""
        while not self._stop.is_set() and time.monotonic() < deadline:
            emptied = [self._drain(sock, dispatch)
                       for sock, dispatch in self._served]
            if all(emptied):
                return

    def _restore(self):
        if self._writer is not None:
            self._writer.remove_leftovers()
        tables, left, dead = checkpoint.load_job(
            self.settings.checkpoint_dir, self.shard_id, self.num_shards,
            self.num_workers, limits=self._restore_limits)
        own = checkpoint.own_clock_tables(
            self.settings.checkpoint_dir, self.shard_id, self.num_shards)
        for table_id, (spec, clock, rows) in tables.items():
            table = self._new_table(table_id, spec)
            table.data = rows
            table.initialised = None
            table.ready = True
            table.global_clock = clock
            table.vclock[:] = clock
            table.ckpt_clock = clock
            table.snapshot = (clock, rows)
            table.snapshot_own = table_id in own
            table.restored = rows
            table.restored_clock = clock
            self._tables[table_id] = table
        self._started = time.monotonic()
        self._left, self._dead = set(left), set(dead)
        self._writer.left_written = frozenset(left)
        self._writer.dead_written = frozenset(dead)
        for table in self._tables.values():
            for worker in dead:  # (until it rejoins: a new process of it)
                table.vclock[worker] = DEAD_CLOCK
        if any(t.global_clock > 0 for t in self._tables.values()):
            # Every worker had finished a clock: the live ones are running
            # and say HELLO within a heartbeat; the silence of the others
            # (one that died with this shard) counts from now.
            self._restored_at = self._started
            for worker in range(self.num_workers):
                if worker not in self._left and worker not in self._dead:
                    self._last_seen[worker] = self._restored_at
        self.stats["restored_clock"] = min(
            (t.global_clock for t in self._tables.values()), default=-1)
        log.warning("shard %d restored %d tables from %s (clocks %s)",
                    self.shard_id, len(tables), self.settings.checkpoint_dir,
                    sorted({t.global_clock for t in self._tables.values()}))

    @staticmethod
    def _declared_dead(worker):
        return (f"worker {worker} was declared dead (silent for more than "
                f"worker_timeout); the job went on without it: restart it "
                f"to rejoin")

    def _fail_job(self, error, but=None):
        """Stops the job: every request gets `error` from now on, and each
        worker (`but` that one) is told at once."""
        self._failed = error
        log.error("shard %d: %s", self.shard_id, self._failed)
        for other, identity in self._identities.items():
            if other != but:
                self._send(identity, Message(MsgType.ERROR, meta={
                    "error": self._failed,
                    "code": protocol.ERROR_WORKER_DEAD}))

    def _worker_died(self, worker, error, left=False):
        """Stops the job, or goes on without `worker` (on_worker_failure);
        one that `left` is not refused when it comes back."""
        if self.settings.on_worker_failure == "stop":
            self._fail_job(error + "; the job stops (on_worker_failure="
                           "stop)", but=worker)
            return
        log.warning("shard %d: %s; continuing without it", self.shard_id,
                    error)
        # That process never takes the worker's place again (a replacement
        # may have), and is told so where it still listens (stalled, not
        # dead): over CURVE when it has a sealed session, whose sender
        # closes now. (One that left closed its client: nothing to tell.)
        if not left:
            self._bury(worker, self._incarnations.get(worker))
        told = None if left else (self._curve_identities.get(worker)
                                  or self._identities.get(worker))
        if told is not None and not isinstance(told, tuple):
            self._send(told, Message(MsgType.ERROR, meta={
                "error": self._declared_dead(worker),
                "code": protocol.ERROR_WORKER_DEAD}))
        self._forget_process(worker)
        for session in self._sessions.values():
            if session.worker == worker:  # nothing more goes to it
                session.sender.close()
        self._snapshot_clocks_of(worker)  # (before its clocks are gone)
        for table in self._tables.values():
            table.vclock[worker] = DEAD_CLOCK
            table.subscribers.discard(worker)
            self._maybe_advance(table)
        # Last: whoever sees it dead (stats, from another thread too) also
        # sees its buffers freed and its clocks no longer awaited.
        self._dead.add(worker)
        self._left.discard(worker)
        self._prune_parked()

    def _leave(self, identity, message):
        """A worker whose client closes (LEAVE, answered with ACK once all
        its earlier requests were handled): its silence from now on is no
        death, until another worker goes on past the clocks it finished
        (`_left_behind`). Its HELLO (a new client) makes it a member
        again. Checkpoints remember who left (and who died)."""
        worker = message.worker
        self._left.add(worker)
        self._last_seen.pop(worker, None)
        self._forget_process(worker)  # (its client releases nothing more)
        # Its replay log goes with it: the ACK waits for a checkpoint at
        # the clocks it finished (the client waits LEAVE_WAIT_S at most).
        clocks = self._snapshot_clocks_of(worker)
        # One answer waits per worker: a LEAVE again supersedes it (a
        # peer repeating LEAVEs grew the list, which every turn scans).
        self._leave_acks = [entry for entry in self._leave_acks
                            if entry[3] != worker]
        if clocks:
            self._leave_acks.append((identity, message.seq, clocks, worker))
        else:
            self._send(identity, Message(MsgType.ACK, seq=message.seq))
        log.info("shard %d: worker %d left", self.shard_id, worker)
        for table in list(self._tables.values()):
            self._left_behind(table)

    def _left_behind(self, table):
        """A worker that left is needed after all where another went on
        past the clocks it finished of `table`: the job stops, naming it,
        or goes on without it (on_worker_failure)."""
        if not self._left or self._failed is not None:
            return
        members = [w for w in range(self.num_workers)
                   if w not in self._dead and w not in self._left]
        if not members:
            return
        ahead = max(members, key=lambda w: int(table.vclock[w]))
        for worker in sorted(self._left):
            done = int(table.vclock[worker])
            if done < table.vclock[ahead] and self._failed is None:
                self._worker_died(worker, (
                    f"worker {worker} left (closed its client) having "
                    f"finished {done} clocks of table "
                    f"{table.spec['name']!r}, and worker {ahead} went on to "
                    f"finish {int(table.vclock[ahead])}: the clocks it left "
                    f"undone never come"), left=True)

    def _bury(self, worker, incarnation):
        """That process of `worker` is refused from now on (its HELLO and
        so everything after it); the latest MAX_BURIED are remembered."""
        buried = self._buried.setdefault(worker, {})
        buried[incarnation] = True
        while len(buried) > MAX_BURIED:
            del buried[next(iter(buried))]

    def _restarted(self, worker):
        """A new process of a worker this shard still counts as live.

        Its old process died before `worker_timeout` noticed. If that
        process stopped between clocks (it finished every clock the others
        did and sent nothing of the next), the new one carries on in its
        place. Otherwise its last clock is half done (or done while the
        others' is not) and no update of it can be taken back: under
        on_worker_failure="stop" the job stops with that error; under
        "continue" the worker counts as dead and rejoins at once.

        Returns:
            The clock it rejoined at (`_rejoin`), or, where it carries on
            in its old process's place, the job's clock (`_job_clock`):
            either way its WELCOME says it joins a job under way.
        """
        midway = [t for t in self._tables.values()
                  if t.vclock[worker] != t.global_clock
                  or t.updated[worker] >= t.vclock[worker]]
        if not midway:
            # The new process replays nothing before its start: the old
            # one's clocks must reach a checkpoint (as a rejoin's do).
            self._snapshot_clocks_of(worker, own=True)
            return self._job_clock()
        table = midway[0]
        self._worker_died(worker, (
            f"worker {worker} restarted (a new process) while clock "
            f"{table.global_clock} of table {table.spec['name']!r} was "
            f"unfinished: its old process's updates of it cannot be taken "
            f"back"))
        if self._failed is not None:
            raise RequestError(self._failed, protocol.ERROR_WORKER_DEAD)
        return self._rejoin(worker)

    def _rejoin(self, worker):
        """A restarted worker joins at each table's current clock.

        Returns:
            The highest of those clocks (0 without tables).
        """
        self._dead.discard(worker)
        for table in self._tables.values():
            table.vclock[worker] = table.global_clock
            table.refused.pop(worker, None)
        # Its new process replays nothing before these clocks.
        self._snapshot_clocks_of(worker, own=True)
        clock = self._job_clock()
        log.warning("shard %d: worker %d rejoined at clock %d",
                    self.shard_id, worker, clock)
        return clock

    def _job_clock(self):
        """The highest clock of this shard's tables (0 without tables)."""
        return max((int(t.global_clock) for t in self._tables.values()),
                   default=0)

    # ------------------------------------------------------------ stats
    def snapshot_stats(self):
        """Returns a JSON-able dict of counters, clocks and tables."""
        tables = {}
        for table in self._tables.values():
            tables[str(table.id)] = {
                "name": table.spec["name"], "rows": table.local_rows,
                "width": table.width, "dtype": table.dtype.name,
                "per_clock": table.per_clock,
                "ready": table.ready, "global_clock": table.global_clock,
                "vclock": table.vclock.tolist(),
                "pending_clocks": sorted(table.pending),
                "held_updates": sum(map(len, table.held.values())),
                "ckpt_clock": table.ckpt_clock,
            }
        return dict(self.stats, shard_id=self.shard_id, pid=os.getpid(),
                    num_shards=self.num_shards, num_workers=self.num_workers,
                    tables=tables, held_bytes=self._held_bytes(),
                    deterministic_sums=self.settings.deterministic_sums,
                    workers=sorted(self._identities),
                    dead_workers=sorted(self._dead),
                    left_workers=sorted(self._left), failed=self._failed,
                    parked_reads=len(self._parked),
                    shm_workers=sorted(self._shm_readers),
                    shm_buffers=sum(len(t.pool.shared)
                                    for t in self._tables.values()),
                    shm_held=sum(sum(h.values())
                                 for h in self._holds.values()),
                    seal_buffer_bytes=(self._seal_buffers.nbytes
                                       if self._seal_buffers else 0),
                    sealed_waiting=sum(s.sender.waiting
                                       for s in self._sessions.values()))
