"""Helpers of the tests that start and watch whole processes."""

import os
import subprocess
import sys
import time


def alive(pid):
    """Whether process `pid` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_file(path, timeout=60, process=None):
    """Waits until `path` holds some text (and `process`, if given, still
    runs); returns the text, stripped."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"no {path} within {timeout} s"
        assert process is None or process.poll() is None, \
            f"it exited with code {process.returncode} first"
        time.sleep(0.05)
    return path.read_text().strip()


def launch_one_worker(folder, seconds, **popen_kwargs):
    """Starts `keras-geeps launch` of one shard and one worker that writes
    its pid (to `folder`/pid) and sleeps `seconds`. Returns (the
    launcher's Popen, the worker's pid) once the worker runs."""
    pid_file = folder / "pid"
    script = folder / "w.py"
    script.write_text(
        "import os, time\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        f"time.sleep({seconds})\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_geeps", "launch", "--workers", "1",
         "--shards", "1", "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        **popen_kwargs)
    try:
        return launcher, int(wait_for_file(pid_file, process=launcher))
    except BaseException:
        launcher.kill()
        raise
