"""`ShardRecovery`: a worker gets a shard that refused it back in step.

A shard refuses a worker it does not know (`hello_required`): either its
process restarted, or its connection broke and came back under a new
routing id (a sealed link that lost messages is treated alike). The
worker says HELLO again, and the WELCOME's incarnation tells which:

- the same process: the worker resends, under their own numbers, the
  updates, clocks and creates the shard may not have got (it handles each
  number once), asks for its rows again and releases what it held back;
- a restarted process: it restored each table at its checkpoint clock g.
  The worker re-declares each part, resends its updates and clocks of
  [g, now) from its replay log, at the shard's pace (a clock once the
  part's pushes show the shard within the slack of it: the restored
  shard holds no more pending clocks than while running), then its held
  traffic minus what the replay already carried, and the requests
  callers still wait on (the old shard took them unanswered). Updates
  the checkpoint covers are never resent, those it does not are resent
  once: nothing is lost or applied twice. Without checkpoints its tables
  are lost: the client fails, naming it.

A shard that restarts again, or a link that breaks again, while it is
being recovered starts the recovery over; the given-up attempt's late
replies are ignored. Everything here runs in the client's I/O thread.
"""

import logging
import time

from keras_geeps.client.connection import Future
from keras_geeps.client.table import no_push
from keras_geeps.errors import GeePSError, GeePSWorkerFailedError
from keras_geeps.protocol import Message, MsgType

log = logging.getLogger("keras_geeps.client")

# A recovery whose HELLO has no answer after this long says HELLO again:
# the shard that took it may have died too, and its successor, which
# refuses everything before a HELLO, would never answer the old one.
RECOVERY_HELLO_RETRY_S = 5.0


class _RecoveryAttempt:
    """One try at recovering a restarted shard: when its HELLO was sent,
    whether the shard answered it (a WELCOME, or a refusal), and the
    futures of its requests (forgotten if it is given up)."""

    __slots__ = ("started", "answered", "futures")

    def __init__(self):
        self.started = time.monotonic()
        self.answered = False
        self.futures = []

    def future(self, callback):
        """A `Future` for one of this attempt's requests."""
        future = Future(callback)
        self.futures.append(future)
        return future


class _PacedReplay:
    """The rest of one part's replay: clocks [next, boundary) of `table`,
    each sent once the restored shard's clock of the part (`seen`, from
    its pushes) is within `window` of it."""

    __slots__ = ("table", "part", "next", "boundary", "seen", "window")

    def __init__(self, table, part, start, boundary, window):
        self.table, self.part = table, part
        self.next, self.boundary = start, boundary
        self.seen, self.window = start, window

    def due(self):
        """Whether the next clock may go."""
        return self.next < self.boundary and \
            self.next < self.seen + self.window


class ShardRecovery:
    """The recoveries of one worker's shards, and their state.

    It works on its `GeePSClient`'s tables, replay log and I/O thread,
    and gives a shard up through the client (`_lose`), which then fails
    every call that needs it, naming why.

    Args:
        client: the `GeePSClient` whose shards it recovers.

    Example:

    ```python
    # In the client's I/O thread, on a refusal or a broken sealed link:
    client._recovery.begin(shard)
    # ... and on each of its turns:
    client._recovery.retry_unanswered()
    ```
    """

    def __init__(self, client):
        self._client = client
        self._recovering = {}  # shard -> DECLAREs still to be answered
        self._attempts = {}    # shard -> its recovery's _RecoveryAttempt
        self._boundaries = {}  # (shard, table id) -> first clock not replayed
        # shard -> {(table id, part)} whose replay its restart recovery has
        # still to send (while that recovery is under way)
        self._restoring = {}
        # shard -> futures of a finished recovery's (or reconnect's)
        # requests, forgotten at the next: a shard that restarts again never
        # answers them
        self._finished_futures = {}
        # (shard, table id, part) -> _PacedReplay: a replay under way, sent
        # as the restored shard's clock of the part moves on
        self._paced = {}

    def begin(self, shard):
        """`shard` refused this worker, or its sealed link lost messages:
        recovers it. Once the shard has welcomed this recovery's HELLO, it
        knows this worker: a refusal after the WELCOME (replies come in
        order) is from a shard that restarted again, and a break after it
        is a new one, so the recovery starts over."""
        attempt = self._attempts.get(shard)
        self._start(shard, again=attempt is not None and attempt.answered)

    def resend_after(self, shard, future):
        """A request a restarted shard refused (it had not seen this
        worker's HELLO): sent again once the shard is recovered, or failed
        at once with the reason it cannot be."""
        client = self._client
        if shard in client._lost:
            future.set(error=GeePSError(client._lost[shard]))
        elif future.callback is not None:
            pass  # a recovery's own request: that recovery started over
        elif shard not in client._io.held:
            future.set(error=GeePSError(
                f"shard {shard} ({client.cluster.shards[shard]}) refused "
                f"{future.request.type.name} of worker {client.worker_id} "
                f"(it restarted), and it is not being recovered"))
        else:
            client._io.requeue(shard, future)

    def retry_unanswered(self):
        """Says HELLO again where a recovery's HELLO went unanswered for
        RECOVERY_HELLO_RETRY_S (every I/O turn: nothing to do is cheap)."""
        if not self._attempts:
            return
        now = time.monotonic()
        for shard, attempt in list(self._attempts.items()):
            if not attempt.answered and \
                    now - attempt.started > RECOVERY_HELLO_RETRY_S:
                self._start(shard, again=True)

    # ------------------------------------------------------------ steps
    def _start(self, shard, again=False):
        """Holds `shard`'s traffic back and says HELLO again; its WELCOME
        says whether it is the same process (`_reconnected`) or a
        restarted one (re-declared and replayed).

        With `again`, a recovery under way is given up (its late replies
        are ignored) and started over. A reconnect while a restart
        recovery is under way resends what it sent and replays only the
        parts whose replay had not gone out (`_reconnected_restoring`).
        """
        client = self._client
        if shard in client._lost or (shard in self._recovering
                                     and not again):
            return
        address = client.cluster.shards[shard]
        log.warning("worker %d: shard %d (%s) refused this worker%s; saying "
                    "HELLO again", client.worker_id, shard, address,
                    " again while being recovered" if again else "")
        client._io.held.add(shard)
        client._io.requeue_unanswered(shard)
        parts = [(table, part) for table in client._live_tables()
                 for part, (s, _, _) in enumerate(table.parts) if s == shard]
        for table, part in parts:  # a push torn by the restart: dropped
            table.incoming[part] = no_push()
        self._recovering[shard] = len(parts)
        hello = client._hello_message()
        hello.worker, hello.seq = client.worker_id, client._next_seq(shard)
        given_up = self._attempts.get(shard)
        if given_up is not None:  # its requests will never be answered
            client._io.forget(given_up.futures)
        # (nor will a finished recovery's requests still unanswered)
        client._io.forget(self._finished_futures.pop(shard, []))
        attempt = self._attempts[shard] = _RecoveryAttempt()

        def welcomed(message, error):
            if self._attempts.get(shard) is not attempt:
                return  # an attempt given up (the shard restarted again)
            attempt.answered = True
            if error is None:
                wrong = client._wrong_shard(shard, message)
                error = GeePSError(wrong) if wrong else None
            if error is not None:  # this worker cannot rejoin: for good
                self._failed(shard, error)
                return
            known = client._shard_incarnations.get(shard)
            if known is not None and message.meta.get("incarnation") == known:
                if shard in self._restoring:
                    self._reconnected_restoring(shard, parts, message,
                                                attempt)
                else:
                    self._reconnected(shard, parts, message)
                return
            if not client._keep_log:
                client._lose(shard, f"shard {shard} ({address}) restarted, "
                                    f"but the shards write no checkpoints "
                                    f"(--checkpoint-every): its tables are "
                                    f"lost")
                return
            log.warning("worker %d: shard %d (%s) restarted; recovering",
                        client.worker_id, shard, address)
            self._drop_paced(shard)  # (replayed anew from its checkpoint)
            self._restoring[shard] = {(t.id, p) for t, p in parts}
            client._io.forget_unacknowledged(shard)  # the replay covers them
            client._on_welcome(shard, message)
            if not parts:
                self._finish(shard)
            for table, part in parts:
                self._redeclare(shard, table, part, attempt)

        client._io.send_now(shard, hello, attempt.future(welcomed))

    def _failed(self, shard, error):
        """A recovery of `shard` that cannot finish: for good. A shard that
        says this worker is dead (or the job stopped) stops the job here
        too; anything else loses the shard, naming why: every later call
        raises it, none waits for its timeout."""
        client = self._client
        if isinstance(error, GeePSWorkerFailedError):
            client._stop_job(error)
        else:
            client._lose(shard, f"recovering shard {shard} "
                                f"({client.cluster.shards[shard]}) failed: "
                                f"{error}")

    def _failing(self, shard):
        """A future callback that fails `shard`'s recovery on an error."""
        def on_reply(message, error):
            del message
            if error is not None:
                self._failed(shard, error)
        return on_reply

    def _reconnected(self, shard, parts, welcome):
        """The recovery's WELCOME came from the shard's same process: its
        connection broke and came back. Resends what it may not have got,
        asks for each part's rows again (a push the break tore is gone: a
        DECLARE pushes them anew), then sends what was held."""
        client = self._client
        address = client.cluster.shards[shard]
        if shard in client._shm_peers or shard in client._shm_upload:
            # Updates in shared memory are not kept for sending again.
            client._lose(shard, f"the connection to shard {shard} "
                                f"({address}), which shares memory with "
                                f"this worker, broke and came back; updates "
                                f"may be lost")
            return
        client._on_welcome(shard, welcome)
        resent = client._io.resend_unacknowledged(shard)
        declared = self._finished_futures.setdefault(shard, [])
        for table, part in parts:
            declared.append(Future(self._failing(shard)))
            client._io.send_now(shard, self._declare(shard, table, part),
                                declared[-1])
        client._io.release(shard, lambda: client._next_seq(shard))
        del self._recovering[shard]
        del self._attempts[shard]
        client.reconnects += 1
        log.warning("worker %d: reconnected to shard %d (%s), the same "
                    "process: resent %d updates, clocks and creates it may "
                    "not have got", client.worker_id, shard, address, resent)

    def _reconnected_restoring(self, shard, parts, welcome, attempt):
        """A reconnect to a restarted shard whose recovery was under way:
        what that recovery sent (re-created rows, replays) is resent under
        its own numbers, like anything else; the parts whose replay had not
        gone out yet are re-declared and replayed, the others only
        re-declared, for their rows."""
        client = self._client
        client._on_welcome(shard, welcome)
        client._io.resend_unacknowledged(shard)
        pending = self._restoring[shard]
        paced = [key for key in self._paced if key[0] == shard]
        self._recovering[shard] = len(paced) + sum(
            (t.id, p) in pending for t, p in parts)
        for table, part in parts:
            if (table.id, part) in pending:
                self._redeclare(shard, table, part, attempt)
            else:
                client._io.send_now(shard, self._declare(
                    shard, table, part), attempt.future(
                        self._failing(shard)))
        for key in paced:  # (their clocks sent so far were resent above)
            self._pump(*key)
        if not self._recovering.get(shard, 1):
            self._finish(shard)
        client.reconnects += 1
        log.warning("worker %d: reconnected to shard %d, the same process, "
                    "while recovering it from its restart",
                    client.worker_id, shard)

    def _declare(self, shard, table, part):
        """A DECLARE of `table`'s `part` on `shard` (numbered): the shard
        answers with the table's clocks and pushes the part's rows."""
        client = self._client
        return Message(MsgType.DECLARE, table.id, worker=client.worker_id,
                       seq=client._next_seq(shard),
                       meta=client._shm_meta(shard, table.spec_meta(part)))

    def _redeclare(self, shard, table, part, attempt):
        """Declares `part` to the restarted shard; its answer (the clock
        the shard restored it at) starts the part's replay."""
        declare = self._declare(shard, table, part)

        def declared(message, error):
            if self._attempts.get(shard) is not attempt:
                return
            if error is None and "global_clock" not in message.meta:
                error = GeePSError(f"it answered the DECLARE of table "
                                   f"{table.name!r} without the table's "
                                   f"clock (global_clock)")
            if error is not None:
                self._failed(shard, error)
                return
            if not message.meta.get("ready", True) and \
                    not self._create_again(shard, table, part, attempt):
                return
            self._replay(shard, table, part, message.meta["global_clock"])

        self._client._io.send_now(shard, declare, attempt.future(declared))

    def _create_again(self, shard, table, part, attempt):
        """A shard restored without `table` (killed before its first
        checkpoint of it was durable): the initializer sends the initial
        rows again, before its replay; other workers' replayed updates wait
        on the shard for them. False (and the client failed) when nobody
        can: a checkpoint had held the table (the shard was started without
        --restore, or from another folder), or its creator no longer holds
        its initial rows.
        """
        client = self._client
        initial = table.init.get(part)
        if initial is None:
            ckpt = int(table.part_ckpt[part])
            if ckpt >= 0:
                reason = (f"which a checkpoint at clock {ckpt} held: was it "
                          f"started without --restore, or from another "
                          f"--checkpoint-dir?")
            elif client.worker_id == client.initializer:
                reason = ("and this worker, its creator, no longer holds "
                          "its initial rows")
            else:
                return True  # the initializer sends them
            client._lose(shard, f"shard {shard} restarted without table "
                                f"{table.name!r}, {reason}")
            return False
        log.warning("worker %d: shard %d restarted before a checkpoint held "
                    "table %r; creating it again", client.worker_id, shard,
                    table.name)
        table.created_again.add(part)
        for message in client._create_messages(table, part, initial):
            message.worker = client.worker_id
            message.seq = client._next_seq(shard)
            client._io.send_now(shard, message,
                                attempt.future(self._failing(shard)))
        return True

    def _replay(self, shard, table, part, restored_clock):
        """Resends `part`'s updates and clocks from `restored_clock` (the
        restarted shard's) up to this worker's clock, from the log, paced
        by the shard's clock (`_pump`)."""
        client = self._client
        with client._clock_lock:  # (clock() adds to the log meanwhile)
            boundary = table.clock
            missing = [c for c in range(restored_clock, boundary)
                       if c not in table.log]
            if missing:
                client._lose(shard, f"cannot recover table {table.name!r} "
                                    f"on shard {shard}: it restarted at "
                                    f"clock {restored_clock}, but this "
                                    f"worker no longer holds the updates of "
                                    f"clock {missing[0]}")
                return
            self._boundaries[(shard, table.id)] = boundary
        # From here on what it sent is resent under its own numbers after
        # a reconnect (not replayed again): it is paced, not restoring.
        self._restoring[shard].discard((table.id, part))
        self._paced[(shard, table.id, part)] = _PacedReplay(
            table, part, restored_clock, boundary, client.slack + 1)
        self._pump(shard, table.id, part)

    def welcomed(self, shard):
        """Whether `shard` is being recovered and welcomed this worker's
        HELLO (what is sent now goes to the process that answered)."""
        attempt = self._attempts.get(shard)
        return attempt is not None and attempt.answered and \
            shard not in self._client._lost

    @property
    def replaying(self):
        """Whether a replay is under way (`on_push` has something to do)."""
        return bool(self._paced)

    def on_push(self, shard, table, part, clock):
        """A push of `part` at `clock` from `shard` (I/O thread): sends the
        clocks of its replay now due (not while a new recovery of the
        shard waits for its WELCOME: that says whether to go on)."""
        key = (shard, table.id, part)
        paced = self._paced.get(key)
        if paced is None or clock <= paced.seen:
            return
        paced.seen = clock
        if shard in self._client._lost:
            del self._paced[key]
        elif self.welcomed(shard):
            self._pump(*key)

    def _drop_paced(self, shard):
        """Forgets `shard`'s replays under way (it restarted again)."""
        for key in [key for key in self._paced if key[0] == shard]:
            del self._paced[key]

    def _pump(self, shard, table_id, part):
        """Sends the due clocks of a paced replay (updates, then CLOCK, in
        order), at most `slack + 1` ahead of the shard's clock of the part:
        a worker's replay never makes the restored shard hold more pending
        clocks than its running did (all its logged clocks at once could
        need far more than --max-table-bytes holds). Ends the part's
        replay once it is all sent."""
        client = self._client
        paced = self._paced[(shard, table_id, part)]
        table = paced.table
        _, start, end = table.parts[part]
        with client._clock_lock:  # (clock() adds to the log meanwhile)
            while paced.due():
                clk = paced.next
                if clk not in table.log:
                    del self._paced[(shard, table_id, part)]
                    client._lose(shard, f"cannot recover table "
                                        f"{table.name!r} on shard {shard}: "
                                        f"this worker no longer holds the "
                                        f"updates of clock {clk}")
                    return
                buffer = table.log[clk]
                if buffer is not None:
                    for message in client._update_messages(
                            table, clk, buffer, start, end):
                        message.worker = client.worker_id
                        message.seq = client._next_seq(shard)
                        client._io.send_now(shard, message)
                client._io.send_now(shard, Message(
                    MsgType.CLOCK, table.id, clk=clk,
                    worker=client.worker_id, seq=client._next_seq(shard)))
                paced.next += 1
        if paced.next < paced.boundary:
            return
        del self._paced[(shard, table_id, part)]
        self._recovering[shard] -= 1
        if self._recovering[shard] == 0:
            self._finish(shard)

    def _finish(self, shard):
        """Every part replayed: sends the held traffic, minus updates and
        clocks the replay already carried."""
        client = self._client

        def replayed_already(message):
            return (message.type in (MsgType.UPDATE, MsgType.CLOCK)
                    and message.clk < self._boundaries.get(
                        (shard, message.table), -1))

        client._io.release(shard, lambda: client._next_seq(shard),
                           replayed_already)
        del self._recovering[shard]
        attempt = self._attempts.pop(shard)
        self._finished_futures.setdefault(shard, []).extend(
            f for f in attempt.futures if not f.event.is_set())
        self._restoring.pop(shard, None)
        log.warning("worker %d: shard %d recovered", client.worker_id, shard)
