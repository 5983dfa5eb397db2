"""`launch`'s process handling: signals, output, leftovers, bad input.

Real shard and worker processes on 127.0.0.1; each test names the way the
launcher failed before.
"""

import io
import os
import signal
import sys
import time

import pytest

from keras_geeps import launch as launch_module
from keras_geeps.launch import ShardProcess, check_restarts, launch
from tests.processes import alive, launch_one_worker, wait_for_file


def test_a_stop_signal_during_a_spawn_waits_until_the_child_is_recorded():
    """A SIGTERM raised inside `Popen`, after the fork, left the worker
    unrecorded (its children outlived the launcher), or was lost in an
    after-fork hook (the launcher went on). It now waits for the end of
    the spawn and its bookkeeping."""
    saved = launch_module._stop_on_signals()
    recorded = []
    try:
        with pytest.raises(launch_module._Stopped) as stopped:
            with launch_module._signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # (the handler has run by now)
                recorded.append("child")
        assert stopped.value.signum == signal.SIGTERM
        assert recorded == ["child"]
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_a_stop_signal_during_a_shards_spawn_leaves_no_shard(monkeypatch):
    """A SIGTERM that came while shard 1's process was being spawned
    raised as the spawn ended, before the shard was recorded, and before
    the guard that kills it: `launch` returned 143 with that shard still
    running (in a library caller, for as long as the caller lived)."""
    spawned = []
    real_popen = launch_module.subprocess.Popen

    class SignalledPopen(real_popen):
        def __init__(self, command, *args, **kwargs):
            super().__init__(command, *args, **kwargs)
            if "keras_geeps.shard" in command and \
                    command[command.index("--shard-id") + 1] == "1":
                spawned.append(self.pid)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # (the handler has run by now)

    monkeypatch.setattr(launch_module.subprocess, "Popen", SignalledPopen)
    try:
        code = launch([sys.executable, "-c", "import time; time.sleep(30)"],
                      num_workers=1, num_shards=2, output=io.StringIO())
        assert code == 128 + signal.SIGTERM
        assert len(spawned) == 1 and not alive(spawned[0])
    finally:
        for pid in spawned:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_launcher_under_nohup_goes_on_after_a_hang_up(tmp_path):
    """The launcher replaced an inherited SIG_IGN of SIGHUP: `nohup
    keras-geeps launch ...` stopped the job at logout."""
    launcher, _ = launch_one_worker(
        tmp_path, 2,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        launcher.send_signal(signal.SIGHUP)
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, out
        assert "stopped by signal" not in out
    finally:
        launcher.kill()


def test_a_shard_stops_cleanly_on_a_hang_up():
    """Shards share the launcher's process group: a closed terminal's
    SIGHUP killed them outright, without their last checkpoint."""
    output = io.StringIO()
    # A test run under nohup ignores SIGHUP, which the shard would inherit
    # (and keep ignoring, as it should): a handler here is reset to the
    # default in the child.
    before = signal.signal(signal.SIGHUP, lambda *_: None)
    try:
        shard = ShardProcess(0, 1, 1, output=output)
    finally:
        signal.signal(signal.SIGHUP, before)
    try:
        shard.process.send_signal(signal.SIGHUP)
        assert shard.process.wait(30) == 0
        shard.terminate()
        assert "shard 0 stopped after" in output.getvalue()
    finally:
        shard.kill()


def test_a_stopped_workers_prints_reach_the_output(tmp_path, monkeypatch):
    """Workers write to a pipe: a Python worker's prints stayed in its
    buffer, and were lost when the launcher stopped it after another
    worker failed."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    printed = tmp_path / "printed"
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['KERAS_GEEPS_WORKER_ID'] == '1':\n"
        "    print('hello from worker 1')\n"
        f"    open({str(printed)!r}, 'w').write('yes')\n"
        "    time.sleep(120)\n"
        f"while not os.path.exists({str(printed)!r}):\n"
        "    time.sleep(0.05)\n"
        "sys.exit(3)\n")
    output = io.StringIO()
    code = launch([sys.executable, str(script)], num_workers=2,
                  num_shards=1, output=output)
    assert code == 3, output.getvalue()
    assert "[worker 1] hello from worker 1" in output.getvalue()


def test_what_a_worker_leaves_running_is_killed_with_the_job(tmp_path):
    """A process left in a worker's group that ignores SIGTERM outlived
    the launcher, even after the worker exited 0: only a worker still
    running got SIGKILL."""
    pid_file = tmp_path / "pid"
    code = launch(["bash", "-c", f"(trap '' TERM; exec sleep 100) & "
                                 f"echo $! > {pid_file}"],
                  num_workers=1, num_shards=1, output=io.StringIO())
    assert code == 0
    assert not alive(int(wait_for_file(pid_file)))


def test_a_worker_killed_by_a_signal_is_reported_as_128_plus_its_number(
        tmp_path):
    output = io.StringIO()
    code = launch([sys.executable, "-c",
                   "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                  num_workers=1, num_shards=1, output=output)
    assert code == 128 + signal.SIGKILL, output.getvalue()
    assert "exited with code -9" in output.getvalue()


def test_bad_launch_arguments_are_named_before_anything_starts():
    """An empty command raised IndexError once the shards ran; shard
    restarts without checkpoints were accepted, then failed when a shard
    died; bad shard flags were reported as '2' (argparse's exit code)."""
    for command in ([], "python train.py", ["python", 3]):
        with pytest.raises(ValueError, match="non-empty list of strings"):
            launch(command, num_workers=1, num_shards=1)
    with pytest.raises(ValueError, match=r"shard restarts \(--shard-"
                                         r"restarts\) need --checkpoint-dir"):
        check_restarts([], shard_restarts=1)
    with pytest.raises(ValueError, match="--max-tables: invalid int value"):
        check_restarts(["--max-tables", "many"])


def test_flags_given_with_equals_are_read_as_given_apart(tmp_path):
    """`--checkpoint-dir=D` got a shard the 10 s stop of one without
    checkpoints (SIGKILL in its last write), and `--restore=D` skipped
    the alignment of the checkpoints: both were matched as whole words."""
    output = io.StringIO()
    folder = tmp_path / "ckpt"
    shard = ShardProcess(0, 1, 1, [f"--checkpoint-dir={folder}"],
                         output=output)
    try:
        assert shard.stop_timeout() > 10
    finally:
        shard.terminate()
    # A whole job restored from a folder with no checkpoint: the
    # alignment (run first) names it, instead of a shard failing to start.
    code = launch(["true"], num_workers=1, num_shards=1, output=output,
                  shard_args=[f"--restore={tmp_path / 'none'}"])
    assert code == 1
    assert "keras-geeps launch: no checkpoint of shard 0/1" in \
        output.getvalue()
