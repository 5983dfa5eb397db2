"""One parameter-server shard: tables, vector clocks, update application.

A shard owns, for every table, one contiguous range of its rows. Workers
send additive updates tagged with their clock; the shard applies each
exactly once (per-sender sequence numbers), keeps a vector clock per table,
and when a table's global clock (the minimum over workers) advances it pushes
the fresh rows to every subscribed worker, tagged with their data age.

The shard keeps this invariant: a table's rows hold exactly the updates of
the clocks before its global clock G. Updates of clock G and later (later
ones are possible with SSP) are summed in per-clock buffers and folded in
when G passes them, into a fresh buffer: published rows are never changed
in place, so every push and read reply is sent without a copy and reflects
exactly the clocks before its age.

Workers on the same host exchange rows with the shard through shared
memory (`keras_geeps.shm`) instead of loopback TCP: a push then carries a
reference to the shard's row buffer, which the worker releases (RELEASE)
once it no longer reads it; the shard reuses a buffer only when every
zero-copy send from it is done and no worker holds it.

Run it as a process (`keras-geeps shard ...` / `python -m keras_geeps.shard`)
or as a thread (`ShardServer(...).start()`, for tests and notebooks).

The package, by layer:

- `settings`: `ShardSettings` (limits and tuning) and `RequestError`;
- `tables`: one table's rows and clocks, the per-clock sums of updates,
  and the pool of row buffers they are made in;
- `sessions`: what the shard knows of each worker's connection: the
  sequence numbers it has handled, and sealed data sessions;
- `writer`: `CheckpointWriter`, which writes the checkpoints in a thread
  beside the poll loop, retries failed writes and answers CHECKPOINT;
- `server`: `ShardServer`, the poll loop and every request's handling;
- `command`: the command line (`keras-geeps shard`).
"""

from keras_geeps.shard.command import build_parser, main, run_from_args
from keras_geeps.shard.server import ShardServer
from keras_geeps.shard.settings import RequestError, ShardSettings

__all__ = ["RequestError", "ShardServer", "ShardSettings", "build_parser",
           "main", "run_from_args"]
