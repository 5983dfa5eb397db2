"""Bounds on what a peer that sends and never reads can make a shard hold.

A shard answers every malformed or refused request with an ERROR, and
logs it. Sent to a peer that never reads its socket, those replies pile up
in ZeroMQ's queue (the shard sets no high-water mark: a worker's rows must
never be dropped), and a flood of one-byte messages fills the log. Without
CURVE anyone on the network can be such a peer. `UnsentReplies` counts the
replies each peer has not taken and says when to stop answering it;
`LogBudget` lets through a bounded number of lines per interval and says
how many it held back.
"""

import collections
import time


class UnsentReplies:
    """The replies each peer has not taken yet (ZeroMQ trackers), within a
    bound per peer and over all peers.

    Args:
        per_peer: most replies one peer may have waiting.
        total: most replies all peers together may have waiting.

    Example:

    ```python
    unsent = UnsentReplies(per_peer=64, total=4096)
    if unsent.room_for(identity):
        unsent.add(identity, socket.send(frame, copy=False, track=True))
    ```
    """

    def __init__(self, per_peer, total):
        self.per_peer = per_peer
        self.total = total
        self._waiting = {}  # identity -> deque of trackers, oldest first
        self._count = 0

    def room_for(self, identity):
        """Whether one more reply may be queued for `identity` (after
        forgetting the replies that went out)."""
        self._prune(identity)
        if self._count >= self.total:
            for other in list(self._waiting):
                self._prune(other)
        waiting = self._waiting.get(identity, ())
        return len(waiting) < self.per_peer and self._count < self.total

    def add(self, identity, tracker):
        """Counts a queued reply (`tracker`: its `zmq.MessageTracker`; None,
        a reply already gone, counts nothing)."""
        if tracker is None or tracker.done:
            return
        self._waiting.setdefault(identity, collections.deque()).append(
            tracker)
        self._count += 1

    def __len__(self):
        return self._count

    def _prune(self, identity):
        waiting = self._waiting.get(identity)
        if waiting is None:
            return
        while waiting and waiting[0].done:  # (ZeroMQ sends them in order)
            waiting.popleft()
            self._count -= 1
        if not waiting:
            del self._waiting[identity]


class LogBudget:
    """At most `lines` log lines every `interval` seconds; the rest are
    counted, and the next line let through says how many were held back.

    Args:
        lines: lines let through per interval.
        interval: seconds. Defaults to 10.0.
        clock: the time source. Defaults to `time.monotonic`.

    Example:

    ```python
    budget = LogBudget(20)
    budget.warning(log, "refused a request (seq %d)", seq)
    ```
    """

    def __init__(self, lines, interval=10.0, clock=time.monotonic):
        self.lines = lines
        self.interval = interval
        self._clock = clock
        self._start = None
        self._used = 0
        self._held = 0

    def take(self):
        """None when the line must not be logged (it is counted), else the
        number of lines held back since the last one let through."""
        now = self._clock()
        if self._start is None or now - self._start >= self.interval:
            self._start, self._used = now, 0
        if self._used >= self.lines:
            self._held += 1
            return None
        self._used += 1
        held, self._held = self._held, 0
        return held

    def warning(self, logger, message, *args):
        """`logger.warning(message, *args)` if the budget lets the line
        through, with the note of the lines it held back appended."""
        held = self.take()
        if held is not None:
            logger.warning(message + "%s", *args, self.note(held))

    @staticmethod
    def note(held):
        """A suffix for the line `take` let through: the lines it held."""
        return f" ({held} similar lines not logged)" if held else ""
