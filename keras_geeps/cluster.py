"""Cluster specs and the row partitioning every worker computes alike.

A job has S shards (the `ps` job of `TF_CONFIG`) and N workers (the `worker`
job). Every worker computes the same mapping of table rows to shards from
the same table declarations made in the same order, so no coordinator is
needed; shards check that all workers agree.
"""

import json
import os

from keras_geeps.checks import check_count, check_index

ENV_SHARDS = "KERAS_GEEPS_SHARDS"          # comma-separated shard addresses
ENV_NUM_WORKERS = "KERAS_GEEPS_NUM_WORKERS"
ENV_WORKER_ID = "KERAS_GEEPS_WORKER_ID"

# Tables smaller than this are placed whole on one shard (splitting them
# would only add messages); larger ones are split evenly over all shards.
SPLIT_MIN_BYTES = 256 * 1024


class ClusterSpec:
    """Where the shards are, how many workers there are, and which one we are.

    Args:
        shards: list of shard addresses ("tcp://host:port" or "host:port").
        num_workers: number of workers in the job.
        worker_id: this worker's index in [0, num_workers).

    Raises:
        ValueError: no shards, an address that is not a TCP host and port
            (or one listed twice), no workers, or a worker_id outside
            [0, num_workers).
        TypeError: one address where a list of them is due.

    Example:

    >>> spec = ClusterSpec(["127.0.0.1:7000", "127.0.0.1:7001"], 2, 0)
    >>> spec.shards
    ['tcp://127.0.0.1:7000', 'tcp://127.0.0.1:7001']
    """

    def __init__(self, shards, num_workers=1, worker_id=0):
        if isinstance(shards, (str, bytes)):
            raise TypeError(f"shards is a list of addresses, got one "
                            f"{type(shards).__name__}: [{shards!r}]?")
        if not shards:
            raise ValueError("a cluster needs at least one shard address")
        self.shards = [_as_zmq_address(a) for a in shards]
        for index, address in enumerate(self.shards):
            if address in self.shards[:index]:
                raise ValueError(f"shard address {address} is listed twice "
                                 f"(shards {self.shards.index(address)} and "
                                 f"{index}): each shard has its own")
        check_count("num_workers", num_workers, 1)
        check_index("worker_id", worker_id, num_workers)
        self.num_workers = int(num_workers)
        self.worker_id = int(worker_id)

    @property
    def num_shards(self):
        return len(self.shards)

    def __repr__(self):
        return (f"ClusterSpec(shards={self.shards}, num_workers="
                f"{self.num_workers}, worker_id={self.worker_id})")

    @classmethod
    def from_tf_config(cls, tf_config=None):
        """Builds the spec from `TF_CONFIG` (ps job = shards).

        Args:
            tf_config: the JSON text or dict; defaults to `$TF_CONFIG`.
        """
        if tf_config is None:
            tf_config = os.environ.get("TF_CONFIG")
            if not tf_config:
                raise ValueError("TF_CONFIG is not set")
        try:
            config = (json.loads(tf_config) if isinstance(tf_config, str)
                      else tf_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"TF_CONFIG is not JSON: {exc}") from None
        try:
            cluster = config["cluster"]
            shards = cluster["ps"]
            workers = cluster.get("worker", []) + cluster.get("chief", [])
            task = config.get("task", {"type": "worker", "index": 0})
            kind, index = task.get("type", "worker"), task.get("index", 0)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"TF_CONFIG has no cluster.ps job and task "
                             f"{{type, index}}: {exc!r}") from None
        if kind not in ("worker", "chief"):
            raise ValueError(
                f"TF_CONFIG's task is a {kind!r}: only chief and worker "
                f"tasks train (the shards are the ps job, started with "
                f"`keras-geeps shard`; an evaluator runs no GeePS worker)")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"TF_CONFIG's task index {index!r} is not an "
                             f"int")
        worker_id = 0 if kind == "chief" else index + len(
            cluster.get("chief", []))
        return cls(shards, max(1, len(workers)), worker_id)

    @classmethod
    def from_env(cls):
        """Builds the spec from keras_geeps' variables, else `TF_CONFIG`."""
        shards = os.environ.get(ENV_SHARDS)
        if shards:
            counts = []
            for name, default in ((ENV_NUM_WORKERS, "1"),
                                  (ENV_WORKER_ID, "0")):
                text = os.environ.get(name, default)
                try:
                    counts.append(int(text))
                except ValueError:
                    raise ValueError(f"${name} is {text!r}, not an "
                                     f"integer") from None
            try:
                return cls(shards.split(","), *counts)
            except ValueError as exc:
                raise ValueError(f"{exc} (from ${ENV_SHARDS}, "
                                 f"${ENV_NUM_WORKERS} and "
                                 f"${ENV_WORKER_ID})") from None
        return cls.from_tf_config()

    def to_env(self):
        """Returns the environment variables that describe this worker."""
        return {ENV_SHARDS: ",".join(self.shards),
                ENV_NUM_WORKERS: str(self.num_workers),
                ENV_WORKER_ID: str(self.worker_id)}


def _as_zmq_address(address):
    """"host:port" or "tcp://host:port" as "tcp://host:port".

    Raises:
        ValueError: naming an address that is not a TCP host and port.
    """
    if not isinstance(address, str):
        raise ValueError(f"shard address {address!r} is not a string "
                         f"(host:port or tcp://host:port)")
    full = address if "://" in address else f"tcp://{address}"
    scheme, _, rest = full.partition("://")
    host, _, port = rest.rpartition(":")
    bad_host = not host or host == "*" or any(c.isspace() for c in host)
    bad_port = not (port.isascii() and port.isdigit()) or \
        not 0 < int(port) < 65536
    if scheme != "tcp" or bad_host or bad_port:
        raise ValueError(f"shard address {address!r} is not host:port or "
                         f"tcp://host:port with a port in [1, 65535]")
    return full


class RowPartitioner:
    """Assigns each new table's rows to shards, balancing bytes.

    A table of at least `split_min_bytes` (and at least one row per shard)
    is split into S contiguous, near-equal row ranges, one per shard; a
    smaller one goes whole to the shard holding the fewest bytes so far
    (lowest index on ties). The result depends only on the sequence of
    tables, so every worker that declares the same tables in the same order
    computes the same placement.

    Args:
        num_shards: how many shards.
        split_min_bytes: tables smaller than this are not split. Defaults
            to 256 KiB.

    Example:

    >>> p = RowPartitioner(2)
    >>> p.place(rows=1000, row_bytes=512)
    [(0, 0, 500), (1, 500, 1000)]
    >>> p.plan(rows=10, row_bytes=4)  # where the next would go: not placed
    [(0, 0, 10)]
    """

    def __init__(self, num_shards, split_min_bytes=SPLIT_MIN_BYTES):
        self.num_shards = num_shards
        self.split_min_bytes = split_min_bytes
        self.shard_bytes = [0] * num_shards

    def plan(self, rows, row_bytes):
        """Returns [(shard, row_start, row_end), ...] for a new table,
        without counting it: a table whose creation fails must not move
        where the later ones go (`take` counts one that was created)."""
        if (rows >= self.num_shards
                and rows * row_bytes >= self.split_min_bytes):
            return [(shard, rows * shard // self.num_shards,
                     rows * (shard + 1) // self.num_shards)
                    for shard in range(self.num_shards)]
        shard = min(range(self.num_shards), key=lambda s: self.shard_bytes[s])
        return [(shard, 0, rows)]

    def take(self, parts, row_bytes):
        """Counts the bytes of a table placed at `parts` (from `plan`)."""
        for shard, start, end in parts:
            self.shard_bytes[shard] += (end - start) * row_bytes

    def place(self, rows, row_bytes):
        """`plan`, then `take`: returns the new table's parts, counted."""
        parts = self.plan(rows, row_bytes)
        self.take(parts, row_bytes)
        return parts
