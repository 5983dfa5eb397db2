"""What a shard knows of each worker's connection: which of its requests
were handled (sequence numbers) and its sealed data session."""

import zmq


def user_id(frame):
    """The ZAP User-Id a frame arrived with (a CURVE client's z85 public
    key), or None."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None


class Session:
    """A worker's sealed data session (`keras_geeps.seal`): its channel
    and the sender that paces what goes out on it."""

    def __init__(self, worker, channel, sender):
        self.worker = worker
        self.channel = channel
        self.sender = sender


class SeqTracker:
    """Which request sequence numbers of one worker have been handled.

    A sliding window, like IPsec's anti-replay window (RFC 4303): a
    worker's requests come over one connection, out of order only by the
    few its threads number concurrently, so a number more than `WINDOW`
    below the highest handled counts as handled. Numbers that never come
    (a recovering worker sends what it held back under new ones) then cost
    no memory.
    """

    WINDOW = 1 << 16

    def __init__(self, start=0):
        self.upto = start      # every seq <= upto is done
        self.above = set()     # done seqs > upto + 1 (out of order)
        self.top = start       # the highest done

    def seen(self, seq):
        return seq <= self.upto or seq in self.above

    def beyond(self, seq):
        """Whether `seq` jumps more than the window past the highest done:
        no worker numbers that many requests that never arrive, and marking
        it would count every later one as done."""
        return seq > self.top + self.WINDOW

    def mark(self, seq):
        self.top = max(self.top, seq)
        if seq > self.upto:
            self.above.add(seq)
        # Gaps further back than the window will not fill: skipped (in
        # steps of a quarter window, so a worker that leaves gaps does not
        # make every message rebuild the set).
        floor = self.top - self.WINDOW
        if floor > self.upto + self.WINDOW // 4:
            self.upto = floor
            self.above = {s for s in self.above if s > floor}
        while self.upto + 1 in self.above:
            self.upto += 1
            self.above.discard(self.upto)
