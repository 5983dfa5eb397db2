"""The `keras-geeps` command line: shard, launch, stats, stop, checkpoint,
align-checkpoints, keygen, build-ops."""

import argparse
import json
import os
import sys
import time

from keras_geeps import _build
from keras_geeps import shard as shard_module


def _cmd_shard(args):
    return shard_module.run_from_args(args)


def _cmd_launch(args):
    from keras_geeps.launch import check_restarts, launch  # noqa: PLC0415
    command = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("keras-geeps launch: give the worker command after --",
              file=sys.stderr)
        return 2
    if min(args.workers, args.shards) < 1:
        print(f"keras-geeps launch: --workers and --shards must be >= 1, "
              f"not {args.workers} and {args.shards}", file=sys.stderr)
        return 2
    if args.shard_restarts is not None and args.checkpoint_every <= 0:
        print("keras-geeps launch: --shard-restarts needs --checkpoint-dir "
              "and --checkpoint-every K (> 0): a shard starts again from "
              "its checkpoint", file=sys.stderr)
        return 2
    shard_restarts = 3 if args.shard_restarts is None else \
        args.shard_restarts
    if min(args.checkpoint_every, shard_restarts, args.worker_restarts,
           args.job_restarts, args.worker_timeout) < 0:
        print("keras-geeps launch: --checkpoint-every, --shard-restarts, "
              "--worker-restarts, --job-restarts and --worker-timeout must "
              "be >= 0", file=sys.stderr)
        return 2
    shard_args = []
    if args.checkpoint_dir:
        shard_args += ["--checkpoint-dir", args.checkpoint_dir,
                       "--checkpoint-every", str(args.checkpoint_every)]
    elif args.checkpoint_every or args.restore:
        print(f"keras-geeps launch: "
              f"{'--restore' if args.restore else '--checkpoint-every'} "
              f"needs --checkpoint-dir", file=sys.stderr)
        return 2
    if args.restore:
        shard_args.append("--restore")
    if args.max_pending_clocks is not None:
        shard_args += ["--max-pending-clocks", str(args.max_pending_clocks)]
    if args.deterministic_sums:
        shard_args.append("--deterministic-sums")
    if args.worker_timeout:
        shard_args += ["--worker-timeout", str(args.worker_timeout)]
    if args.on_worker_failure:
        shard_args += ["--on-worker-failure", args.on_worker_failure]
    restarts = shard_restarts if args.checkpoint_every > 0 else 0
    try:  # what every shard, or launch, would refuse at start, said here
        from keras_geeps.shard import ShardSettings  # noqa: PLC0415
        ShardSettings(checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every,
                      worker_timeout=args.worker_timeout,
                      **({} if args.max_pending_clocks is None else
                         {"max_pending_clocks": args.max_pending_clocks}))
        check_restarts(shard_args, shard_restarts=restarts,
                       worker_restarts=args.worker_restarts,
                       job_restarts=args.job_restarts)
    except ValueError as exc:
        print(f"keras-geeps launch: {exc}", file=sys.stderr)
        return 2
    return launch(command, num_workers=args.workers, num_shards=args.shards,
                  shard_args=shard_args, shard_restarts=restarts,
                  worker_restarts=args.worker_restarts,
                  job_restarts=args.job_restarts)


def _ask_all(args, msg_type, answered=None):
    """Sends one admin request (STATS, STOP, CHECKPOINT) to every shard of
    `args.shards` (over CURVE with `args.curve_secret_key`) at once, and
    waits `args.timeout` seconds in all for the replies. `answered(shard,
    reply)` is called for each reply, in shard order; then, if any shard
    did not answer (or refused), a GeePSError names every such shard: one
    that is down does not keep the others from being asked."""
    from keras_geeps.client.connection import Future, IOThread  # noqa
    from keras_geeps.cluster import ClusterSpec  # noqa: PLC0415
    from keras_geeps.errors import GeePSError  # noqa: PLC0415
    from keras_geeps.protocol import Message  # noqa: PLC0415
    from keras_geeps.checks import check_seconds  # noqa: PLC0415
    try:
        spec = ClusterSpec(args.shards.split(","))
        check_seconds("--timeout", args.timeout)
    except ValueError as exc:
        raise SystemExit(f"keras-geeps {args.cmd}: {exc}") from exc
    timeout = args.timeout
    curve = None
    if args.curve_secret_key or args.curve_server_key:
        if not (args.curve_secret_key and args.curve_server_key):
            raise SystemExit("--curve-secret-key and --curve-server-key go "
                             "together")
        from keras_geeps.auth import ClientKeys  # noqa: PLC0415
        try:
            curve = ClientKeys(args.curve_secret_key, args.curve_server_key)
        except ValueError as exc:  # (a missing file: OSError, in main)
            raise SystemExit(f"keras-geeps {args.cmd}: {exc}") from exc
    io = IOThread(spec.shards, lambda *_: None, name="geeps-admin",
                  curve=curve)
    try:
        futures = []
        for shard in range(len(spec.shards)):
            futures.append(Future())
            io.send(shard, Message(msg_type, seq=1), futures[-1])
        deadline = time.monotonic() + timeout
        silent, refused = [], []
        for shard, (address, future) in enumerate(zip(spec.shards,
                                                      futures)):
            if not future.event.wait(max(0.0, deadline - time.monotonic())):
                silent.append(f"shard {shard} ({address}) did not answer "
                              f"within {timeout} s")
            elif future.error:  # (its text names the shard)
                refused.append(str(future.error))
            elif answered is not None:
                answered(shard, future.message)
    finally:
        io.close(linger=0)  # (every answer is in: nothing more to send)
    if silent or refused:
        hint = ("are these CURVE keys allowed? or does it require none?"
                if curve else "or does it require CURVE keys?")
        problems = refused + ([f"{'; '.join(silent)}; is it running "
                               f"({hint})"] if silent else [])
        answering = len(spec.shards) - len(silent)
        raise GeePSError(f"{'; '.join(problems)} ({answering} of "
                         f"{len(spec.shards)} shards answered, "
                         f"{len(refused)} refused)")


def _cmd_stats(args):
    from keras_geeps.protocol import MsgType, stats_of  # noqa: PLC0415
    _ask_all(args, MsgType.STATS, lambda _, reply: print(
        json.dumps(stats_of(reply), indent=1), flush=True))
    return 0


def _cmd_stop(args):
    from keras_geeps.protocol import MsgType  # noqa: PLC0415
    _ask_all(args, MsgType.STOP)
    return 0


def _cmd_checkpoint(args):
    from keras_geeps.protocol import MsgType  # noqa: PLC0415
    _ask_all(args, MsgType.CHECKPOINT)
    return 0


def _cmd_align_checkpoints(args):
    from keras_geeps import checkpoint  # noqa: PLC0415
    from keras_geeps.checks import check_count  # noqa: PLC0415
    try:
        check_count("--shards", args.shards, 1)
        check_count("--workers", args.workers, 1)
    except ValueError as exc:
        print(f"keras-geeps align-checkpoints: {exc}", file=sys.stderr)
        return 2
    try:
        aligned = checkpoint.align_job(args.directory, args.shards,
                                       args.workers)
    except checkpoint.CheckpointError as exc:
        print(f"keras-geeps align-checkpoints: {exc}", file=sys.stderr)
        return 1
    for tid, clock in sorted(aligned.items()):
        print(f"table {tid}: " + (f"clock {clock}" if clock is not None else
                                  "no clock all its shards hold: left out "
                                  "(created again from its initial values)"))
    return 0


def _cmd_keygen(args):
    from keras_geeps.auth import (check_key_folder,  # noqa: PLC0415
                                  check_key_name, keygen, pair_paths)
    try:  # every name first: a bad one writes no pair
        check_key_folder(args.directory)
        for name in args.names:
            check_key_name(name)
        if len(set(args.names)) != len(args.names):
            raise ValueError(f"a name given twice: {args.names}")
    except ValueError as exc:
        print(f"keras-geeps keygen: {exc}", file=sys.stderr)
        return 2
    if not args.force:  # and every pair's files: one there writes none
        for name in args.names:
            for path in pair_paths(args.directory, name):
                if os.path.exists(path):
                    print(f"keras-geeps keygen: {path} exists: keep it "
                          f"(peers hold its public key) or pass --force; "
                          f"no pair was written", file=sys.stderr)
                    return 1
    for name in args.names:
        try:
            public, secret = keygen(args.directory, name,
                                    overwrite=args.force)
        except FileExistsError as exc:
            print(f"keras-geeps keygen: {exc}", file=sys.stderr)
            return 1
        print(f"{name}: public {public}, secret {secret}")
    return 0


def _cmd_build_ops(args):
    return _build.main(args=args)


def build_parser():
    """The `keras-geeps` argument parser."""
    parser = argparse.ArgumentParser(
        prog="keras-geeps",
        description="GeePS-style parameter server for Keras and TensorFlow.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    shard = sub.add_parser("shard", help="run one shard server")
    shard_module.build_parser(shard)
    shard.set_defaults(func=_cmd_shard)

    launch = sub.add_parser(
        "launch", help="run S shards and N workers on this machine",
        usage="keras-geeps launch [--workers N] [--shards S] "
              "[--checkpoint-dir DIR --checkpoint-every K [--restore]] "
              "[--deterministic-sums] [--worker-timeout S "
              "--on-worker-failure continue --worker-restarts R] "
              "[--job-restarts J] -- COMMAND ...")
    launch.add_argument("--workers", type=int, default=2)
    launch.add_argument("--shards", type=int, default=2)
    launch.add_argument("--checkpoint-dir", default=None,
                        help="the shards' checkpoint folder")
    launch.add_argument("--restore", action="store_true",
                        help="start the shards from their checkpoints in "
                             "--checkpoint-dir (a job whose launcher was "
                             "stopped or killed), taken to one clock per "
                             "table first; every worker starts afresh")
    launch.add_argument("--checkpoint-every", type=int, default=0,
                        help="shards snapshot each table every K clocks; "
                             "with K > 0, a shard that dies is started "
                             "again from its checkpoint")
    launch.add_argument("--max-pending-clocks", type=int, default=None,
                        help="the shards' --max-pending-clocks (64 if not "
                             "given; at least K - 1)")
    launch.add_argument("--deterministic-sums", action="store_true",
                        help="the shards add each clock's updates in worker "
                             "order: a rerun ends bit-identical")
    launch.add_argument("--shard-restarts", type=int, default=None,
                        help="how many times in all dead shards are "
                             "started again (needs --checkpoint-every > 0; "
                             "3 if not given)")
    launch.add_argument("--worker-timeout", type=float, default=0.0,
                        help="the shards declare a worker silent S seconds "
                             "dead (0: never)")
    launch.add_argument("--on-worker-failure", default=None,
                        choices=("stop", "continue"),
                        help="what the shards do when a worker dies: stop "
                             "the job (default) or continue without it")
    launch.add_argument("--worker-restarts", type=int, default=0,
                        help="how many times in all workers that fail are "
                             "started again (with --on-worker-failure "
                             "continue): each rejoins the job under way")
    launch.add_argument("--job-restarts", type=int, default=0,
                        help="how many times in all the whole job is "
                             "started again when it fails (with "
                             "--checkpoint-every > 0): the shards from "
                             "their checkpoint, every worker afresh (a fit "
                             "with BackupAndRestore resumes)")
    launch.add_argument("command", nargs=argparse.REMAINDER)
    launch.set_defaults(func=_cmd_launch)

    for name, func, text in (
            ("stats", _cmd_stats, "print shard statistics"),
            ("stop", _cmd_stop, "stop shards"),
            ("checkpoint", _cmd_checkpoint,
             "make shards write a checkpoint now (returns once written)")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--shards", required=True,
                         help="comma-separated shard addresses")
        cmd.add_argument("--timeout", type=float, default=10.0)
        cmd.add_argument("--curve-secret-key", default=None,
                         help="for shards that require CURVE: an allowed "
                              "client's .key_secret file")
        cmd.add_argument("--curve-server-key", default=None,
                         help="... and the shards' public .key file")
        cmd.set_defaults(func=func)

    align = sub.add_parser(
        "align-checkpoints",
        help="before starting a whole job again with --restore: every "
             "table at the latest clock all its shards' checkpoints hold")
    align.add_argument("directory", help="the shards' checkpoint folder")
    align.add_argument("--shards", type=int, required=True,
                       help="the job's shard count")
    align.add_argument("--workers", type=int, required=True,
                       help="the job's worker count")
    align.set_defaults(func=_cmd_align_checkpoints)

    keygen = sub.add_parser(
        "keygen", help="write CURVE key pairs (NAME.key, NAME.key_secret)")
    keygen.add_argument("directory")
    keygen.add_argument("names", nargs="+",
                        help="e.g. shard worker0 worker1")
    keygen.add_argument("--force", action="store_true",
                        help="replace existing key pairs of these names")
    keygen.set_defaults(func=_cmd_keygen)

    build = sub.add_parser("build-ops", help="build the custom TF ops now")
    # (its flags were once taken as a REMAINDER, which takes nothing that
    # starts with "-": `build-ops --no-cuda` was refused)
    _build.add_arguments(build)
    build.set_defaults(func=_cmd_build_ops)
    return parser


def main(argv=None):
    """Entry point of the `keras-geeps` console command."""
    args = build_parser().parse_args(argv)
    from keras_geeps.errors import GeePSError  # noqa: PLC0415
    from keras_geeps.protocol import ProtocolError  # noqa: PLC0415
    try:
        return args.func(args)
    except (GeePSError, ProtocolError, OSError) as exc:  # a shard that
        # does not answer, refuses, or answers malformed; a key file that
        # cannot be read: said in one line
        print(f"keras-geeps {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
