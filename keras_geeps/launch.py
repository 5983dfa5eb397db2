"""Local clusters: shards and workers on this machine, for tests and demos.

`LocalCluster` starts S shards (threads or subprocesses) on 127.0.0.1 with
free ports. `launch` runs S shard processes and N copies of a worker
command, each told its place through `TF_CONFIG` and keras_geeps'
variables, streams their output with a prefix, and tears everything down,
also when one of them fails (which it names, exiting non-zero).
"""

import codecs
import contextlib
import ctypes
import io
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from keras_geeps import checkpoint
from keras_geeps.checkpoint import CheckpointError
from keras_geeps.checks import check_count
from keras_geeps.cluster import ClusterSpec
from keras_geeps.errors import GeePSError
from keras_geeps.shard.writer import WRITER_JOIN_S

_READY = re.compile(r"serving (tcp://\S+)(?: \(sealed data (tcp://\S+)\))?")


try:  # resolved here: the child may not import or dlopen after fork
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """Child-side: get SIGTERM when the parent dies (Linux), so a crashed
    test or launcher never leaves shard processes behind."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Gate:
    """Where the launcher's stop signals wait (`_signals_held`)."""

    depth = 0        # nested `_signals_held` blocks under way
    pending = None   # the first stop signal that came during them


@contextlib.contextmanager
def _signals_held():
    """Holds the launcher's stop signals (SIGINT, SIGTERM, SIGHUP, with
    `_stop_on_signals`' handlers) back until the block ends, where the
    first that came meanwhile raises: a child started in the block is
    recorded first (the exception raised inside `Popen`, after the fork,
    left the child unknown, or was lost in an after-fork hook)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (signal handlers run in the main thread only)
        return
    _Gate.depth += 1
    try:
        yield
    except BaseException:
        _Gate.pending = None  # (what raised ends the job anyway)
        raise
    finally:
        _Gate.depth -= 1
    if _Gate.depth == 0 and _Gate.pending is not None:
        signum, _Gate.pending = _Gate.pending, None
        _raise_for(signum)


def _raise_for(signum):
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise _Stopped(signum)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pump(stream, prefix, sink, lines=None):
    """Copies a child's output to `sink` with `prefix` at each line start.

    Complete lines go out as they come. Text without a newline yet is held
    (so two children's lines do not interleave), except a line that redraws
    itself with carriage returns (a progress bar), which is forwarded up to
    its last carriage return so it stays live, the prefix written again
    after each return. Complete lines also go to `lines` (a queue), if
    given. Thread body.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    held = []  # the pieces of the line without a newline yet
    while True:
        chunk = os.read(stream.fileno(), 65536)
        text = decoder.decode(chunk, final=not chunk)
        complete, redraw = [], ""
        if chunk and "\n" not in text and "\r" not in text:
            held.append(text)  # (joined once, when its line ends)
        else:
            *complete, last = ("".join(held) + text).split("\n")
            if not chunk and last:
                complete, last = complete + [last], ""
            if "\r" in last:  # forward the redrawn part of a progress bar
                cut = last.rindex("\r")
                redraw, last = last[:cut], last[cut:]
            held = [last]
        if lines is not None:
            for line in complete:
                lines.put(line)
        if sink is not None and (complete or redraw):
            out = [_prefixed(line, prefix) + "\n" for line in complete]
            if redraw:
                out.append(_prefixed(redraw, prefix))
            try:
                sink.write("".join(out))
                sink.flush()
            except (OSError, ValueError):  # e.g. `launch ... | head` ended:
                sink = None  # keep draining, or the child blocks writing
        if not chunk:
            break
    stream.close()


def _say(output, line):
    """Writes one line of the launcher's own to `output` (if it still
    takes any)."""
    try:
        output.write(line + "\n")
        output.flush()
    except (OSError, ValueError):
        pass


def _prefixed(text, prefix):
    """`text` with `prefix` at its start and after each carriage return."""
    return "\r".join(prefix + part if part else part
                     for part in text.split("\r"))


class _UntilReady(queue.Queue):
    """A shard's output lines, kept only until its address was read."""

    done = False

    def put(self, item, *args, **kwargs):
        if not self.done:
            super().put(item, *args, **kwargs)


class ShardProcess:
    """One shard run as `python -m keras_geeps.shard` in a child process.

    Args:
        shard_id, num_shards, num_workers: the shard's place in the job.
        extra_args: more `keras-geeps shard` flags. Defaults to none.
        output: where the shard's output lines go (prefixed), or None.
        start_timeout: seconds to wait for the shard's address. Defaults
            to 60.
        bind: the address to bind. Defaults to a free port on 127.0.0.1.
    """

    def __init__(self, shard_id, num_shards, num_workers, extra_args=(),
                 output=sys.stderr, start_timeout=60.0,
                 bind="tcp://127.0.0.1:0"):
        self.shard_id = shard_id
        self.args = (shard_id, num_shards, num_workers, tuple(extra_args))
        self.output = output
        command = [sys.executable, "-u", "-m", "keras_geeps.shard",
                   "--bind", bind, "--shard-id", str(shard_id),
                   "--num-shards", str(num_shards),
                   "--num-workers", str(num_workers), *extra_args]
        # Linux sends the parent-death signal when the *thread* that forked
        # exits, so only children of the main thread can use it.
        in_main = threading.current_thread() is threading.main_thread()
        self.process = None
        self.address = self.data_address = None
        self._asked = False
        lines = _UntilReady()
        try:
            with _signals_held():  # (what came meanwhile raises at its end)
                self.process = subprocess.Popen(
                    command, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent if in_main else None)
            self._pump = threading.Thread(
                target=_pump, args=(self.process.stdout,
                                    f"[shard {shard_id}] ", output, lines),
                daemon=True)
            self._pump.start()
            self._wait_ready(lines, start_timeout)
        except BaseException:  # (a signal meanwhile too): none left behind
            if self.process is not None:
                self.kill()
            raise
        lines.done = True  # later lines only go to `output`

    def _wait_ready(self, lines, start_timeout):
        deadline = time.monotonic() + start_timeout
        while self.address is None:
            remaining = deadline - time.monotonic()
            try:
                line = lines.get(timeout=max(0.01, min(remaining, 0.5)))
            except queue.Empty:
                if self.process.poll() is not None:
                    raise GeePSError(
                        f"shard {self.shard_id} exited with code "
                        f"{self.process.returncode} before serving (its "
                        f"output says why)") from None
                if remaining <= 0:
                    raise GeePSError(
                        f"shard {self.shard_id} did not start serving "
                        f"within {start_timeout:.0f} s") from None
                continue
            match = _READY.search(line)
            if match:
                self.address, self.data_address = match.groups()

    def terminate(self, timeout=None):
        """SIGTERM, then SIGKILL if it has not exited within `timeout`
        seconds. Defaults to None: 10 s, or, for a shard that writes
        checkpoints, long enough for the write under way and its last one
        (`writer.WRITER_JOIN_S` each): SIGKILL would lose them."""
        if timeout is None:
            timeout = self.stop_timeout()
        self.ask_to_stop()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._pump.join(2.0)

    def stop_timeout(self):
        """`terminate`'s default wait, in seconds (from the parsed flags:
        `--checkpoint-dir=D` counts as `--checkpoint-dir D`)."""
        settings = _shard_settings(self.args[3])
        return 2 * WRITER_JOIN_S + 10.0 if settings.checkpoint_dir \
            else 10.0

    def ask_to_stop(self):
        """SIGTERM (once): the shard finishes what it does and exits."""
        if self.process.poll() is None and not self._asked:
            self._asked = True
            self.process.send_signal(signal.SIGTERM)

    def kill(self):
        """SIGKILL (for failure tests)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self, extra_args=(), start_timeout=600.0):
        """A new shard process on the same address (after `kill`).

        Args:
            extra_args: flags to add (e.g. ["--restore"]).
            start_timeout: seconds to wait for it to serve. Defaults to
                600: a restore reads the whole checkpoint first (a shard
                that fails exits, and is reported at once).
        """
        shard_id, num_shards, num_workers, args = self.args
        args = list(args)
        if "--data-bind" in args:  # (added by an earlier restart)
            at = args.index("--data-bind")
            del args[at:at + 2]
        if self.data_address:  # the same sealed data address too
            args += ["--data-bind", self.data_address]
        # Appended as given: a flag that repeats an earlier restart's
        # (--restore) is harmless; dropping "already there" arguments
        # would also drop a value equal to another flag's.
        args += list(extra_args)
        # (a port briefly taken meanwhile: the shard retries its bind)
        return ShardProcess(shard_id, num_shards, num_workers, args,
                            self.output, start_timeout=start_timeout,
                            bind=self.address)


class LocalCluster:
    """S shards on 127.0.0.1, as threads or subprocesses.

    Args:
        num_shards: how many shards. Defaults to 1.
        num_workers: how many workers the shards expect. Defaults to 1.
        processes: run shards as subprocesses (True) or threads (False).
            Defaults to False.
        settings: a `ShardSettings` for thread shards. Defaults to None.
        output: where subprocess shards' output goes. Defaults to stderr.
        shard_args: extra `keras-geeps shard` flags for subprocess shards.
            Defaults to none.
        start_timeout: seconds each subprocess shard may take to serve.
            Defaults to 60.

    Raises:
        ValueError: `num_shards` or `num_workers` is not an int >= 1.

    Example:

    ```python
    with LocalCluster(num_shards=2, num_workers=1) as cluster:
        client = cluster.client(worker_id=0)
        ...
    ```
    """

    def __init__(self, num_shards=1, num_workers=1, processes=False,
                 settings=None, output=sys.stderr, shard_args=(),
                 start_timeout=60.0):
        check_count("num_shards", num_shards, least=1)
        check_count("num_workers", num_workers, least=1)
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.processes = processes
        self.shards = []
        try:
            for shard_id in range(num_shards):
                if processes:
                    self.shards.append(ShardProcess(
                        shard_id, num_shards, num_workers, shard_args,
                        output=output, start_timeout=start_timeout))
                else:
                    from keras_geeps.shard import ShardServer  # noqa
                    self.shards.append(ShardServer(
                        "tcp://127.0.0.1:0", shard_id, num_shards,
                        num_workers, settings).start())
        except BaseException:
            self.stop()
            raise

    @property
    def addresses(self):
        return [shard.address for shard in self.shards]

    def spec(self, worker_id=0):
        """The `ClusterSpec` of worker `worker_id`."""
        return ClusterSpec(self.addresses, self.num_workers, worker_id)

    def client(self, worker_id=0, **kwargs):
        """A `GeePSClient` for worker `worker_id` (kwargs passed on)."""
        from keras_geeps.client import GeePSClient  # noqa: PLC0415
        return GeePSClient(self.spec(worker_id), **kwargs)

    def stop(self):
        """Stops every shard (subprocesses: all asked at once, each then
        waited for, and killed past its `terminate` timeout)."""
        if self.processes:
            for shard in self.shards:
                shard.ask_to_stop()
            deadline = time.monotonic() + max(
                (shard.stop_timeout() for shard in self.shards), default=0)
        for shard in self.shards:
            if self.processes:
                shard.terminate(max(0.0, deadline - time.monotonic()))
            else:
                shard.stop()
        self.shards = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def worker_addresses(num_workers):
    """Placeholder worker addresses for TF_CONFIG (keras_geeps itself only
    counts them): free ports at the time of the call."""
    return [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)]


def worker_env(spec, base=None, workers=None):
    """The environment a worker process gets: TF_CONFIG and our variables.

    Args:
        spec: the worker's `ClusterSpec`.
        base: the environment to start from. Defaults to os.environ.
        workers: every worker's address for TF_CONFIG, the same list for
            all workers of a job. Defaults to `worker_addresses(...)`.
    """
    env = dict(os.environ if base is None else base)
    tf_config = {
        "cluster": {
            "ps": [a.replace("tcp://", "") for a in spec.shards],
            "worker": list(workers or worker_addresses(spec.num_workers)),
        },
        "task": {"type": "worker", "index": spec.worker_id},
    }
    env["TF_CONFIG"] = json.dumps(tf_config)
    env.update(spec.to_env())
    return env


def launch(command, num_workers=2, num_shards=2, output=sys.stdout,
           shard_args=(), poll_interval=0.1, shard_restarts=0,
           worker_restarts=0, job_restarts=0):
    """Runs `command` on `num_workers` local workers against local shards.

    Args:
        command: the worker command line (a list), e.g.
            ["python", "train.py"].
        num_workers: how many worker processes. Defaults to 2.
        num_shards: how many shard processes. Defaults to 2.
        output: where prefixed output lines go. Defaults to stdout.
        shard_args: extra `keras-geeps shard` flags. Defaults to none.
        poll_interval: seconds between looks at the processes. Defaults
            to 0.1.
        shard_restarts: how many times in all a shard that dies is
            started again, with `--restore`, on its addresses (its workers
            then recover; it needs `--checkpoint-dir` and
            `--checkpoint-every` > 0 in `shard_args`). Defaults to 0: a
            dead shard stops the job.
        worker_restarts: how many times in all a worker that exits with
            an error (or is killed) is started again, with the same worker
            id and environment: it rejoins the job at the tables' clock
            (and `fit` lines up with the others' epochs). It needs
            `--worker-timeout` > 0 and `--on-worker-failure continue` in
            `shard_args`, so that the others go on without it meanwhile.
            Defaults to 0: a failing worker stops the job.
        job_restarts: how many times in all the whole job is started
            again when it fails (a worker or shard failed past the
            restarts above; not when interrupted or signalled): every
            process is stopped, the shards start again with `--restore`
            from their checkpoint, and every worker starts afresh (a
            `fit` with `keras.callbacks.BackupAndRestore` resumes at its
            last backup, the parameters at the shards' checkpoint). It
            needs `--checkpoint-dir` and `--checkpoint-every` > 0 in
            `shard_args`. Defaults to 0.

    Returns:
        0 when every worker exits 0; otherwise the first failing worker's
        exit code (128 + n for one killed by signal n; 1 for a shard's
        failure), after stopping everything else.

    Raises:
        ValueError: `command` is not a non-empty list of strings, or the
            restarts cannot work with `shard_args` (`check_restarts`).

    Example:

    ```python
    code = launch(["python", "train.py"], num_workers=2, num_shards=2,
                  shard_args=["--checkpoint-dir", "/tmp/ckpt",
                              "--checkpoint-every", "10"],
                  shard_restarts=3)
    ```
    """
    if isinstance(command, str) or not command or not all(
            isinstance(part, str) for part in command):
        raise ValueError(f"command must be a non-empty list of strings "
                         f"(the worker's command line), not {command!r}")
    check_restarts(shard_args, shard_restarts=shard_restarts,
                   worker_restarts=worker_restarts, job_restarts=job_restarts)
    budget = {"shard": shard_restarts, "worker": worker_restarts}
    restore = []
    while True:
        if _shard_settings([*shard_args, *restore]).restore:
            try:  # every worker starts afresh: each table at one clock
                _align(shard_args, num_shards, num_workers, output)
            except CheckpointError as exc:
                _say(output, f"keras-geeps launch: {exc}")
                return 1
        failure = _run_job(command, num_workers, num_shards, output,
                           [*shard_args, *restore], poll_interval, budget)
        if failure is None:
            return 0
        message, code, restartable = failure
        _say(output, f"keras-geeps launch: {message}; stopped the other "
                     f"processes")
        if not restartable or job_restarts <= 0:
            return code
        job_restarts -= 1
        _say(output, f"[launch] starting the whole job again, the shards "
                     f"with --restore ({job_restarts} job restarts left)")
        restore = [] if _shard_settings(shard_args).restore else \
            ["--restore"]


def _align(shard_args, num_shards, num_workers, output):
    """`checkpoint.align_job` on the shards' checkpoint folder, saying
    which tables it took back."""
    directory = _shard_settings(shard_args).checkpoint_dir
    before = checkpoint.table_clocks(directory, num_shards)
    for tid, clock in checkpoint.align_job(directory, num_shards,
                                           num_workers).items():
        clocks = sorted(set(before.get(tid, {}).values()))
        if clock is None:
            _say(output, f"[launch] table {tid}: its shards' checkpoints "
                         f"hold no common clock; it starts again from its "
                         f"initial values")
        elif clocks != [clock]:
            _say(output, f"[launch] table {tid}: the shards' checkpoints "
                         f"were at clocks {clocks}; all at {clock} now")


def _run_job(command, num_workers, num_shards, output, shard_args,
             poll_interval, budget):
    """One run of `launch`'s job: its shards and workers, until every
    worker exits 0 (returns None) or something fails past the restarts
    left in `budget` ({"shard": n, "worker": n}, spent in place): returns
    (message, exit code, whether a job restart may follow)."""
    workers, pumps = [], []
    failure = cluster = None
    addresses = worker_addresses(num_workers)
    in_main = threading.current_thread() is threading.main_thread()
    saved = _stop_on_signals() if in_main else {}

    def start_worker(worker_id):
        env = worker_env(cluster.spec(worker_id), workers=addresses)
        # A pipe, not a terminal: without this a Python worker's prints
        # wait in its buffer, and are lost when it is stopped.
        env.setdefault("PYTHONUNBUFFERED", "1")
        process = subprocess.Popen(
            command, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent if in_main else None)
        pump = threading.Thread(target=_pump, args=(
            process.stdout, f"[worker {worker_id}] ", output), daemon=True)
        pump.start()
        pumps.append(pump)
        return process

    try:
        # (a restore reads the whole checkpoint first)
        cluster = LocalCluster(num_shards, num_workers, processes=True,
                               output=output, shard_args=shard_args,
                               start_timeout=600.0 if _shard_settings(
                                   shard_args).restore else 60.0)
        for worker_id in range(num_workers):
            with _signals_held():  # (recorded, to be stopped)
                workers.append(start_worker(worker_id))
        while failure is None:
            codes = [p.poll() for p in workers]
            for worker_id, code in enumerate(codes):
                if code in (None, 0):
                    continue
                exited = (f"worker {worker_id} (pid {workers[worker_id].pid})"
                          f" exited with code {code}")
                if budget["worker"] <= 0:  # (killed by a signal: 128+n)
                    failure = (exited, code if code > 0 else 128 - code,
                               True)
                    break
                budget["worker"] -= 1
                _signal_group(workers[worker_id].pid, signal.SIGKILL)
                _say(output, f"[launch] {exited}; starting it again "
                             f"({budget['worker']} restarts left)")
                workers[worker_id].wait()
                with _signals_held():
                    workers[worker_id] = start_worker(worker_id)
                codes[worker_id] = None
            if failure is None:
                for index, shard in enumerate(cluster.shards):
                    if shard.process.poll() is None:
                        continue
                    died = (f"shard {shard.shard_id} (pid "
                            f"{shard.process.pid}) died with code "
                            f"{shard.process.returncode}")
                    if shard.process.returncode == 0:
                        # stopped on purpose (`keras-geeps stop`): the job
                        # ends, and is not started again
                        failure = (f"shard {shard.shard_id} (pid "
                                   f"{shard.process.pid}) was stopped", 1,
                                   False)
                        break
                    if budget["shard"] <= 0:
                        failure = (died, 1, True)
                        break
                    budget["shard"] -= 1
                    _say(output, f"[launch] {died}; starting it again with "
                                 f"--restore ({budget['shard']} restarts "
                                 f"left)")
                    try:
                        cluster.shards[index] = shard.restart(["--restore"])
                    except GeePSError as exc:
                        failure = (f"{died}, and did not start again: "
                                   f"{exc}", 1, True)
                        break
            if failure is None and all(code == 0 for code in codes):
                break
            time.sleep(poll_interval)
    except KeyboardInterrupt:
        failure = ("interrupted", 130, False)
    except _Stopped as stopped:
        failure = (f"stopped by signal {stopped.signum}",
                   128 + stopped.signum, False)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        hurried = _stop_workers(workers)
        for pump in pumps:
            pump.join(2.0)
        if cluster is not None:
            _stop_cluster(cluster, at_once=hurried)
    return failure


def _stop_workers(workers, timeout=10.0):
    """SIGTERM to every worker's process group, SIGKILL to the groups with
    anyone left in them after `timeout` s (what a worker started and left
    running too, also after the worker exited 0), or at once on another
    Ctrl-C meanwhile. Returns whether that Ctrl-C came."""
    for process in workers:  # and whatever each started in its group
        _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    hurried = False
    try:
        while time.monotonic() < deadline and any(
                process.poll() is None or _group_alive(process.pid)
                for process in workers):
            time.sleep(0.02)
    except KeyboardInterrupt:
        hurried = True  # a second Ctrl-C: no more waiting
    for process in workers:
        _signal_group(process.pid, signal.SIGKILL)
        while True:
            try:
                process.wait()
                break
            except KeyboardInterrupt:
                continue  # SIGKILLed: the wait is short
    return hurried


def _group_alive(pgid):
    """Whether process group `pgid` has a process left (a leader not yet
    reaped counts: poll it first)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (someone's, still there)
        return True
    return True


def _stop_cluster(cluster, at_once=False):
    """`cluster.stop()`; at once (a second Ctrl-C came), or on a Ctrl-C
    during its waits, the shards are killed."""
    try:
        if not at_once:
            cluster.stop()
            return
    except KeyboardInterrupt:
        pass
    for shard in list(cluster.shards):
        shard.kill()
    cluster.shards = []


def check_restarts(shard_args=(), shard_restarts=0, worker_restarts=0,
                   job_restarts=0):
    """Checks that the restarts asked of `launch` can work with the shard
    flags `shard_args`; what `launch` (and `keras-geeps launch`, before it
    starts anything) refuses.

    Args:
        shard_args: the `keras-geeps shard` flags, as for `launch`.
        shard_restarts: as for `launch`.
        worker_restarts: as for `launch`.
        job_restarts: as for `launch`.

    Raises:
        ValueError: naming the restarts that cannot work, and what they
            need.

    Example:

    ```python
    check_restarts(["--worker-timeout", "10", "--on-worker-failure",
                    "continue"], worker_restarts=2)  # fine
    check_restarts([], job_restarts=1)  # ValueError: needs checkpoints
    ```
    """
    if min(shard_restarts, worker_restarts, job_restarts) < 0:
        raise ValueError(
            "shard, worker and job restarts (--shard-restarts, "
            "--worker-restarts, --job-restarts) must be >= 0, not "
            f"{shard_restarts}, {worker_restarts}, {job_restarts}")
    settings = _shard_settings(shard_args)
    checkpoints = settings.checkpoint_dir and settings.checkpoint_every > 0
    for kind, count, why in (
            ("shard", shard_restarts, "a shard starts again from its "
                                      "checkpoint"),
            ("job", job_restarts, "the job starts again from the shards' "
                                  "checkpoint")):
        if count > 0 and not checkpoints:
            raise ValueError(
                f"{kind} restarts (--{kind}-restarts) need --checkpoint-dir "
                f"and --checkpoint-every K (> 0) in the shard flags: {why}")
    if worker_restarts > 0 and not (settings.worker_timeout > 0 and
                                    settings.on_worker_failure == "continue"):
        raise ValueError(
            "worker restarts (--worker-restarts) need --worker-timeout S "
            "(> 0) and --on-worker-failure continue in the shard flags: the "
            "other workers must go on without a worker that died")


def _shard_settings(shard_args):
    """The `keras-geeps shard` flags `shard_args` give (parsed; a
    `--restore DIR` folded into checkpoint_dir)."""
    from keras_geeps.shard.command import (  # noqa: PLC0415
        build_parser, settle_restore_flags)
    said = io.StringIO()  # (argparse writes its reason, then exits 2)
    try:
        with contextlib.redirect_stderr(said):
            args, _ = build_parser().parse_known_args(
                ["--shard-id", "0", "--num-shards", "1", "--num-workers",
                 "1", *shard_args])
            settle_restore_flags(args)
    except SystemExit as exc:
        reason = said.getvalue().strip().splitlines()[-1:] or [str(exc)]
        raise ValueError(f"shard_args {list(shard_args)} are not valid "
                         f"`keras-geeps shard` flags: {reason[0]}") from exc
    return args


class _Stopped(Exception):
    """The launcher got SIGTERM or SIGHUP: stop every process it started."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _stop_on_signals():
    """Makes SIGTERM and SIGHUP raise `_Stopped`, and SIGINT
    KeyboardInterrupt, or wait for the end of a `_signals_held` block
    (main thread only); one ignored (SIGHUP under `nohup`) stays ignored.
    Returns the handlers replaced."""
    def stop(signum, _frame):
        if _Gate.depth:
            _Gate.pending = _Gate.pending or signum
            return
        _raise_for(signum)

    return {signum: signal.signal(signum, stop)
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            if signal.getsignal(signum) is not signal.SIG_IGN}


def _signal_group(pid, signum):
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:  # the group is gone already
        pass
