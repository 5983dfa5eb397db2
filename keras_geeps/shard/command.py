"""The shard's command line: `keras-geeps shard` and `python -m
keras_geeps.shard`."""

import argparse
import logging
import os
import signal
import time

import zmq

from keras_geeps import checkpoint
from keras_geeps.shard.server import ShardServer
from keras_geeps.shard.settings import ShardSettings


def build_parser(parser=None):
    """Adds the shard's command-line flags to `parser` (or a new one)."""
    parser = parser or argparse.ArgumentParser(
        prog="keras-geeps shard", description="Run one keras_geeps shard.")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0",
                        help="ZeroMQ address to bind (port 0 = pick a free "
                             "one; the chosen address is printed)")
    parser.add_argument("--shard-id", type=int, required=True)
    parser.add_argument("--num-shards", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--max-message-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-tables", type=int, default=4096)
    parser.add_argument("--max-table-bytes", type=int, default=16 << 30)
    parser.add_argument("--max-pending-clocks", type=int, default=64)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints are written")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="snapshot each table every K clocks (0: only "
                             "on request)")
    parser.add_argument("--restore", action="append", nargs="?",
                        const=True, metavar="DIR",
                        help="start from the checkpoint in DIR, which is "
                             "then the --checkpoint-dir too, or (without "
                             "DIR) in --checkpoint-dir")
    parser.add_argument("--worker-timeout", type=float, default=0.0,
                        help="seconds of silence after which a worker is "
                             "dead (0: never)")
    parser.add_argument("--on-worker-failure", default="stop",
                        choices=["stop", "continue"])
    parser.add_argument("--curve-secret-key", default=None,
                        help="this shard's .key_secret file: require CURVE")
    parser.add_argument("--curve-allowed-clients", default=None,
                        help="folder of allowed clients' public .key files")
    parser.add_argument("--data-bind", default=None,
                        help="with CURVE: the sealed data socket's address "
                             "(default: --bind's host, a free port; give "
                             "a restarted shard the one it printed)")
    parser.add_argument("--deterministic-sums", action="store_true",
                        help="add each clock's updates in worker order, not "
                             "as they arrive: a job rerun on the same data "
                             "ends with bit-identical parameters")
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="never exchange rows with co-located workers "
                             "through shared memory (also: "
                             "KERAS_GEEPS_SHM=0)")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR",
                                 "CRITICAL"))
    return parser


def settle_restore_flags(args):
    """Folds `--restore DIR` into args.checkpoint_dir; args.restore becomes
    a bool. (--restore may repeat: a launcher appends it on a restart.)"""
    folders = {f for f in args.restore or () if isinstance(f, str)}
    if args.checkpoint_dir is not None:
        folders.add(args.checkpoint_dir)
    if len({os.path.realpath(f) for f in folders}) > 1:
        raise SystemExit(f"keras-geeps shard: --restore and "
                         f"--checkpoint-dir name different folders "
                         f"({', '.join(sorted(folders))}): a restored shard "
                         f"goes on writing its checkpoints where it was "
                         f"restored from")
    if args.restore and folders and args.checkpoint_dir is None:
        args.checkpoint_dir = folders.pop()
    args.restore = bool(args.restore)
    if args.checkpoint_dir is not None and \
            os.path.exists(args.checkpoint_dir) and \
            not os.path.isdir(args.checkpoint_dir):
        raise SystemExit(f"keras-geeps shard: {args.checkpoint_dir} is a "
                         f"file: the checkpoints (--checkpoint-dir, "
                         f"--restore) go in a folder")


def run_from_args(args):
    """Runs a shard process from parsed flags until STOP or SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s "
                               "%(message)s")
    settle_restore_flags(args)
    try:
        settings = ShardSettings(
            max_message_bytes=args.max_message_bytes,
            max_tables=args.max_tables, max_table_bytes=args.max_table_bytes,
            max_pending_clocks=args.max_pending_clocks,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            worker_timeout=args.worker_timeout,
            on_worker_failure=args.on_worker_failure,
            shared_memory=False if args.no_shared_memory else None,
            deterministic_sums=args.deterministic_sums)
    except ValueError as exc:
        raise SystemExit(f"keras-geeps shard: {exc}") from exc
    if args.restore and not args.checkpoint_dir:
        raise SystemExit("--restore needs --checkpoint-dir (the folder the "
                         "shard wrote its checkpoints to) or a folder: "
                         "--restore DIR")
    curve = None
    if args.curve_secret_key or args.curve_allowed_clients:
        if not (args.curve_secret_key and args.curve_allowed_clients):
            raise SystemExit("--curve-secret-key and --curve-allowed-clients"
                             " go together")
        curve = (args.curve_secret_key, args.curve_allowed_clients)
    if args.data_bind and curve is None:
        raise SystemExit("keras-geeps shard: --data-bind needs "
                         "--curve-secret-key and --curve-allowed-clients "
                         "(the sealed data socket exists only with CURVE)")
    try:
        server = ShardServer(args.bind, args.shard_id, args.num_shards,
                             args.num_workers, settings, restore=args.restore,
                             curve=curve, data_bind=args.data_bind)
    except (checkpoint.CheckpointError, ValueError, OSError,
            zmq.ZMQError) as exc:
        # a missing, foreign or torn checkpoint; a shard id or a worker
        # count that does not fit the job; a key file that cannot be
        # read; an address that cannot be bound
        raise SystemExit(f"keras-geeps shard: {exc}") from exc
    # A hang-up (the terminal of a launcher whose process group it shares
    # closing) stops it as SIGTERM does: its last checkpoint is written.
    # One ignored (under nohup) stays ignored.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda *_: server.request_stop())
    data = f" (sealed data {server.data_address})" \
        if server.data_address else ""
    print(f"keras_geeps shard {args.shard_id}/{args.num_shards} serving "
          f"{server.address}{data}", flush=True)
    started = time.monotonic()
    server.serve_forever()
    print(f"keras_geeps shard {args.shard_id} stopped after "
          f"{time.monotonic() - started:.1f} s", flush=True)
    return 0


def main(argv=None):
    """Entry point of `python -m keras_geeps.shard`."""
    return run_from_args(build_parser().parse_args(argv))
