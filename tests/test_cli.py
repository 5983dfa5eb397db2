"""The `keras-geeps` command line against real shard processes."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_geeps.auth import keygen
from keras_geeps.cli import main as cli_main
from keras_geeps.launch import LocalCluster, check_restarts, launch
from tests.processes import alive, launch_one_worker


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "keras_geeps", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_stats_and_stop_a_standalone_shard(process_cluster):
    cluster = process_cluster(1, 1)
    with cluster.client(0, timeout=10) as client:
        table = client.create_table("t", 4, 4, init=np.ones((4, 4)))
        client.clock()
        client.read(table, clock=1)
    address = cluster.addresses[0]
    result = _cli("stats", "--shards", address)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["tables"]["0"]["name"] == "t"
    assert stats["tables"]["0"]["global_clock"] == 1
    assert _cli("stop", "--shards", address).returncode == 0
    assert cluster.shards[0].process.wait(10) == 0


def test_stats_of_a_dead_address_fails_clearly(process_cluster):
    cluster = process_cluster(1, 1)
    address = cluster.addresses[0]
    cluster.shards[0].kill()
    result = _cli("stats", "--shards", address, "--timeout", "1")
    assert result.returncode != 0
    assert "did not answer within 1.0 s" in result.stderr


def test_an_unanswered_admin_command_ends_at_its_timeout(capsys):
    """The command gave up at --timeout, then spent 2 s more closing,
    lingering to send a request to a shard that never answered."""
    started = time.monotonic()
    assert cli_main(["stats", "--shards", "127.0.0.1:9", "--timeout",
                     "1"]) == 1
    assert time.monotonic() - started < 2.0
    assert "did not answer within 1.0 s" in capsys.readouterr().err


def test_stop_reaches_every_shard_when_one_is_down(process_cluster):
    """`stop` asked one shard at a time and gave up at the first that
    did not answer, leaving the others running; `stats` printed nothing.
    Every shard is asked at once; those that did not answer are named."""
    cluster = process_cluster(3, 1)
    cluster.shards[0].kill()
    shards = ",".join(cluster.addresses)
    result = _cli("stats", "--shards", shards, "--timeout", "2")
    assert result.returncode == 1
    assert result.stdout.count('"shard_id"') == 2
    assert "shard 0 (" in result.stderr and "did not answer" in \
        result.stderr and "2 of 3 shards answered" in result.stderr
    result = _cli("stop", "--shards", shards, "--timeout", "2")
    assert result.returncode == 1 and "shard 0 (" in result.stderr
    for shard in cluster.shards[1:]:
        assert shard.process.wait(10) == 0


def test_shard_restore_without_a_checkpoint_fails_in_one_line(tmp_path):
    result = _cli("shard", "--bind", "tcp://127.0.0.1:0", "--shard-id", "0",
                  "--num-shards", "1", "--num-workers", "1",
                  "--checkpoint-dir", str(tmp_path), "--restore")
    assert result.returncode == 1
    assert "keras-geeps shard: no checkpoint of shard 0/1 at" in \
        result.stderr
    assert "Traceback" not in result.stderr
    result = _cli("shard", "--shard-id", "0", "--num-shards", "1",
                  "--num-workers", "1", "--checkpoint-dir", str(tmp_path),
                  "--checkpoint-every", "-2")
    assert result.returncode == 1
    assert "checkpoint_every must be an int >= 0, not -2" in result.stderr
    for flag, value, problem in (
            ("--max-message-bytes", "-5", "max_message_bytes must be an "
             "int >= 1, not -5"),
            ("--max-tables", "0", "max_tables must be an int >= 1, not 0"),
            ("--max-pending-clocks", "-1", "max_pending_clocks must be an "
             "int >= 0, not -1"),
            ("--worker-timeout", "-1", "worker_timeout must be a number "
             "of seconds >= 0 (0: not watched), not -1.0")):
        result = _cli("shard", "--shard-id", "0", "--num-shards", "1",
                      "--num-workers", "1", flag, value)
        assert result.returncode == 1, (flag, result.stderr)
        assert result.stderr.startswith(f"keras-geeps shard: {problem}"), \
            result.stderr


def test_shard_restore_dir_restores_from_and_checkpoints_to_dir(
        process_cluster, tmp_path):
    """`keras-geeps shard --restore DIR` restores from DIR and goes on
    writing checkpoints there (as `--checkpoint-dir DIR --restore`); a
    launcher's appended `--restore` keeps DIR; two folders are refused."""
    from keras_geeps.launch import ShardProcess  # noqa: PLC0415
    from tests.reliability.restarts import (  # noqa: PLC0415
        killed_one_clock_past_a_checkpoint, wait_for_checkpoint)

    cluster = process_cluster(1, 1, output=None, shard_args=[
        "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"])
    with cluster.client(0, timeout=30, heartbeat_interval=0.2) as client:
        table, victim = killed_one_clock_past_a_checkpoint(client, cluster)
        cluster.shards[0] = ShardProcess(
            0, 1, 1, ["--restore", str(tmp_path), "--checkpoint-every", "2",
                      "--restore"], output=None, bind=victim.address)
        np.testing.assert_array_equal(client.read(table), 3.0)
        client.update(table, np.ones((4, 4), np.float32))
        client.clock()
        np.testing.assert_array_equal(client.read(table), 4.0)
        assert client.shard_stats()[0]["restored_clock"] == 2
        wait_for_checkpoint(client, table, 4)  # written to DIR again
    result = _cli("shard", "--shard-id", "0", "--num-shards", "1",
                  "--num-workers", "1", "--restore", str(tmp_path),
                  "--checkpoint-dir", str(tmp_path / "other"))
    assert result.returncode == 1
    assert "--restore and --checkpoint-dir name different folders" in \
        result.stderr


def test_launch_requires_a_command():
    result = _cli("launch", "--workers", "1", "--shards", "1")
    assert result.returncode == 2
    assert "give the worker command" in result.stderr


def test_launch_and_shard_refuse_counts_that_cannot_be():
    """No shards, no workers or a shard id outside the job: one line
    saying so, no traceback, nothing started."""
    for workers, shards in (("2", "0"), ("0", "1")):
        result = _cli("launch", "--workers", workers, "--shards", shards,
                      "--", "true")
        assert result.returncode == 2
        assert result.stderr.strip() == (
            f"keras-geeps launch: --workers and --shards must be >= 1, "
            f"not {workers} and {shards}")
    for (shard, workers), problem in (
            (("2", "1"), "shard_id 2 is not in [0, 2)"),
            (("0", "0"), "num_workers must be an int >= 1, not 0")):
        result = _cli("shard", "--bind", "tcp://127.0.0.1:0", "--shard-id",
                      shard, "--num-shards", "2", "--num-workers", workers)
        assert result.returncode == 1
        assert result.stderr.strip().endswith(f"keras-geeps shard: {problem}")
        assert "Traceback" not in result.stderr
    for shards, workers in ((0, 1), (-1, 1), (1, 0), (1.5, 1), (True, 1)):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            LocalCluster(shards, workers)
    LocalCluster(np.int64(1), np.int64(1)).stop()  # any integral type


def test_admin_commands_and_shard_say_bad_input_in_one_line(tmp_path):
    """A bad address, a shard that does not answer, a key file missing,
    not a key or a folder, a bind that fails, a checkpoint folder that is
    a file: one line naming it, exit 1."""
    bad_key = tmp_path / "bad.key_secret"
    bad_key.write_text("not a key\n")
    shard = ("shard", "--shard-id", "0", "--num-shards", "1",
             "--num-workers", "1")
    for args, line in (
            (("stats", "--shards", "nohost"), "keras-geeps stats: shard "
             "address 'nohost' is not host:port"),
            (("stop", "--shards", "127.0.0.1:9", "--timeout", "0.5"),
             "keras-geeps stop: shard 0 (tcp://127.0.0.1:9) did not answer "
             "within 0.5 s"),
            (("checkpoint", "--shards", "127.0.0.1:9", "--curve-secret-key",
              str(tmp_path / "none.key_secret"), "--curve-server-key",
              str(bad_key)), f"keras-geeps checkpoint: CURVE key file "
             f"{tmp_path / 'none.key_secret'} does not exist"),
            (("stats", "--shards", "127.0.0.1:9", "--curve-secret-key",
              str(bad_key), "--curve-server-key", str(bad_key)),
             f"keras-geeps stats: {bad_key} is not a CURVE key file"),
            ((*shard, "--bind", "tcp://nowhere"), "keras-geeps shard: "),
            ((*shard, "--curve-secret-key", str(bad_key),
              "--curve-allowed-clients", str(tmp_path)),
             f"keras-geeps shard: {bad_key} is not a CURVE key file"),
            (("stats", "--shards", "127.0.0.1:9", "--curve-secret-key",
              str(tmp_path), "--curve-server-key", str(bad_key)),
             f"keras-geeps stats: {tmp_path} is a folder, not a CURVE key"),
            ((*shard, "--bind", "tcp://127.0.0.1:0", "--restore",
              str(bad_key)), f"keras-geeps shard: {bad_key} is a file: the "
             f"checkpoints")):
        result = _cli(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert result.stderr.startswith(line), (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _launch(tmp_path, source, workers, shards):
    """`keras-geeps launch` of `source` as each worker's script."""
    script = tmp_path / "w.py"
    script.write_text(source)
    return _cli("launch", "--workers", str(workers), "--shards",
                str(shards), "--", sys.executable, str(script))


def test_launch_runs_workers_and_exits_zero(tmp_path):
    result = _launch(
        tmp_path,
        "import numpy as np\n"
        "from keras_geeps.client import GeePSClient\n"
        "c = GeePSClient(timeout=20)\n"
        "t = c.create_table('t', 2, 2)\n"
        "for _ in range(3):\n"
        "    c.read(t); c.update(t, np.ones((2, 2), np.float32)); c.clock()\n"
        "print('final', c.read(t, clock=3)[0, 0], flush=True)\n", 2, 2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("final 6.0") == 2
    assert "[worker 0]" in result.stdout and "[worker 1]" in result.stdout


def test_launch_starts_a_killed_shard_again_and_loses_nothing(tmp_path):
    """SIGKILL one of two shards mid-job, twice (a worker does it: the
    shard's stats give its pid): `launch --checkpoint-every` starts it
    again with --restore each time, the workers recover, and every update
    counts once."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os, signal, numpy as np\n"
        "from keras_geeps.client import GeePSClient\n"
        "c = GeePSClient(timeout=60, heartbeat_interval=0.2)\n"
        "a, b = c.create_table('a', 2, 2), c.create_table('b', 2, 2)\n"
        "for clk in range(12):\n"
        "    for t in (a, b):\n"
        "        c.read(t); c.update(t, np.ones((2, 2), np.float32))\n"
        "    c.clock()\n"
        "    if clk in (3, 8) and c.worker_id == 0:\n"
        "        os.kill(c.shard_stats()[1]['pid'], signal.SIGKILL)\n"
        "print('final', c.read(a, clock=12)[0, 0], c.read(b, clock=12)[0, 0],"
        " flush=True)\n")
    result = _cli("launch", "--workers", "2", "--shards", "2",
                  "--checkpoint-dir", str(tmp_path / "ckpt"),
                  "--checkpoint-every", "2", "--", sys.executable,
                  str(script), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("final 24.0 24.0") == 2
    assert "[launch] shard 1 (pid" in result.stdout
    for left in (2, 1):
        assert f"starting it again with --restore ({left} restarts left)" \
            in result.stdout
    result = _cli("launch", "--checkpoint-every", "-1", "--", "true")
    assert result.returncode == 2 and "must be >= 0" in result.stderr
    ckpt = ["--checkpoint-dir", str(tmp_path / "k"), "--checkpoint-every",
            "70"]
    result = _cli("launch", *ckpt, "--", "true")
    assert result.returncode == 2
    assert "needs max_pending_clocks >= 69" in result.stderr
    result = _cli("launch", *ckpt, "--max-pending-clocks", "69", "--",
                  "true")
    assert result.returncode == 0, result.stderr


def test_launch_starts_a_failed_worker_again_and_it_rejoins(tmp_path):
    """Worker 1 exits with code 3 after 5 clocks (its first run only):
    `launch --worker-restarts 1` starts it again, its shards' WELCOME says
    where it rejoins (whether they had declared it dead by then, or it
    took its old process's place between clocks), it goes on from there,
    and both end at clock 20 with every clock's updates counted once."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time, numpy as np\n"
        "from keras_geeps.client import GeePSClient\n"
        "c = GeePSClient(timeout=30, heartbeat_interval=0.1)\n"
        "t = c.create_table('t', 2, 2)\n"
        "print('start', c.worker_id, c.rejoined_at, t.clock, flush=True)\n"
        "marker = os.path.join(sys.argv[1], 'died')\n"
        "while t.clock < 20:\n"
        "    c.read(t); c.update(t, np.ones((2, 2), np.float32)); c.clock()\n"
        "    if c.worker_id == 1 and t.clock == 5 and \\\n"
        "            not os.path.exists(marker):\n"
        "        c.read(t, clock=5)  # (its 5th CLOCK went out)\n"
        "        open(marker, 'w').close(); os._exit(3)\n"
        "    time.sleep(0.05)\n"
        "print('final', c.worker_id, c.read(t, clock=20)[0, 0], flush=True)\n")
    result = _cli("launch", "--workers", "2", "--shards", "2",
                  "--worker-timeout", "1", "--on-worker-failure", "continue",
                  "--worker-restarts", "1", "--", sys.executable,
                  str(script), str(tmp_path), timeout=120)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "[launch] worker 1 (pid" in out
    assert "exited with code 3; starting it again (0 restarts left)" in out
    starts = [line.split()[-3:] for line in out.splitlines()
              if "start 1" in line]
    assert starts[0] == ["1", "None", "0"]
    rejoined, clock = int(starts[1][1]), int(starts[1][2])
    assert rejoined == clock >= 5, starts
    # Worker 0's 20 clocks, worker 1's first 5 and those from its rejoin.
    final = f"{20 + 5 + 20 - rejoined:.1f}"
    assert out.count(f"final 0 {final}") == out.count(f"final 1 {final}") \
        == 1, out


def test_launch_refuses_restarts_that_cannot_work():
    """The CLI and `launch` refuse, with one message, before starting
    anything."""
    result = _cli("launch", "--worker-restarts", "1", "--", "true")
    assert result.returncode == 2
    assert "worker restarts (--worker-restarts) need --worker-timeout" \
        in result.stderr
    result = _cli("launch", "--job-restarts", "1", "--", "true")
    assert result.returncode == 2
    assert "job restarts (--job-restarts) need --checkpoint-dir" \
        in result.stderr
    with pytest.raises(ValueError, match=r"restarts \(--worker-restarts\)"):
        launch(["true"], worker_restarts=1, shard_args=[
            "--worker-timeout", "5"])  # (stop: the default)
    with pytest.raises(ValueError, match=r"must be >= 0, not 0, -1, 0"):
        launch(["true"], worker_restarts=-1)
    check_restarts(["--worker-timeout", "5", "--on-worker-failure",
                    "continue"], worker_restarts=1)
    check_restarts(["--checkpoint-dir", "/nonexistent", "--checkpoint-every",
                    "4"], shard_restarts=2, job_restarts=1)


def test_launch_passes_deterministic_sums_to_its_shards(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(
        "from keras_geeps.client import GeePSClient\n"
        "with GeePSClient(timeout=20) as c:\n"
        "    print('ordered', [s['deterministic_sums'] for s in "
        "c.shard_stats()], flush=True)\n")
    for flag, shown in (([], "[False, False]"),
                        (["--deterministic-sums"], "[True, True]")):
        result = _cli("launch", "--workers", "1", "--shards", "2", *flag,
                      "--", sys.executable, str(script))
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"ordered {shown}" in result.stdout, result.stdout


_COUNTING_WORKER = """
import numpy as np
from keras_geeps.client import GeePSClient
client = GeePSClient(timeout=30)
table = client.create_table("t", 1, 1)
before = float(client.read(table)[0, 0])
for _ in range(3):
    client.update(table, np.ones((1, 1), np.float32))
    client.clock()
after = float(client.read(table, clock=table.clock)[0, 0])
print(f"counted from {before} to {after} at clock {table.clock}")
client.close()
"""


def test_launch_restore_resumes_a_job_from_its_checkpoints(tmp_path):
    """A job whose launcher ended (here: the job did) starts again from
    the shards' checkpoints with `launch --restore`: the tables keep their
    values and clocks. Without it the launcher had no way to (a second
    launch moved the checkpoints aside and started afresh)."""
    worker = tmp_path / "count.py"
    worker.write_text(_COUNTING_WORKER)
    flags = ["launch", "--workers", "1", "--shards", "2",
             "--checkpoint-dir", str(tmp_path / "ckpt"),
             "--checkpoint-every", "1"]
    command = ["--", sys.executable, str(worker)]
    first = _cli(*flags, *command)
    assert first.returncode == 0, first.stdout[-2000:]
    assert "counted from 0.0 to 3.0 at clock 3" in first.stdout
    again = _cli(*flags, "--restore", *command)
    assert again.returncode == 0, again.stdout[-2000:]
    assert "counted from 3.0 to 6.0 at clock 6" in again.stdout
    refused = _cli("launch", "--restore", *command)
    assert refused.returncode == 2
    assert "--restore needs --checkpoint-dir" in refused.stderr


def test_launch_without_checkpoints_stops_when_a_shard_dies(tmp_path):
    result = _launch(
        tmp_path,
        "import os, signal, time\n"
        "from keras_geeps.client import GeePSClient\n"
        "c = GeePSClient(timeout=20)\n"
        "c.create_table('t', 2, 2)\n"
        "if c.worker_id == 0:\n"
        "    os.kill(c.shard_stats()[0]['pid'], signal.SIGKILL)\n"
        "time.sleep(30)\n", 1, 1)
    assert result.returncode == 1
    assert "shard 0 (pid" in result.stdout and "died with code -9" in \
        result.stdout


def test_checkpoint_on_request(process_cluster, tmp_path):
    cluster = process_cluster(1, 1, shard_args=[
        "--checkpoint-dir", str(tmp_path)])
    with cluster.client(0, timeout=10) as client:
        table = client.create_table("t", 4, 4, init=np.ones((4, 4)))
        for _ in range(3):
            client.update(table, np.ones((4, 4), np.float32))
            client.clock()
        client.read(table)
    result = _cli("checkpoint", "--shards", cluster.addresses[0])
    assert result.returncode == 0, result.stderr
    from keras_geeps import checkpoint  # noqa: PLC0415
    (spec, clock, rows), = checkpoint.load(tmp_path, 0, 1, 1).values()
    assert spec["name"] == "t" and clock == 3
    np.testing.assert_array_equal(rows, np.full((4, 4), 4.0))


def test_a_refused_checkpoint_request_is_named_as_refused(process_cluster):
    """A shard that answers with a refusal answered: the error is its
    reason, not a question whether it runs."""
    cluster = process_cluster(1, 1)
    result = _cli("checkpoint", "--shards", cluster.addresses[0])
    assert result.returncode == 1
    assert "this shard has no checkpoint_dir" in result.stderr
    assert "(1 of 1 shards answered, 1 refused)" in result.stderr
    assert "is it running" not in result.stderr


def test_launch_gives_every_worker_the_same_tf_config(tmp_path):
    result = _launch(
        tmp_path,
        "import json, os\n"
        "config = json.loads(os.environ['TF_CONFIG'])\n"
        "print('cluster', json.dumps(config['cluster'], sort_keys=True),"
        " flush=True)\n", 3, 1)
    assert result.returncode == 0, result.stdout + result.stderr
    clusters = {line.split("cluster ", 1)[1]
                for line in result.stdout.splitlines() if "cluster " in line}
    assert len(clusters) == 1 and len(json.loads(clusters.pop())[
        "worker"]) == 3


def test_sigterm_to_the_launcher_stops_its_workers(tmp_path):
    launcher, worker = launch_one_worker(tmp_path, 120)
    try:
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGTERM, out
        assert "stopped by signal" in out
        assert not alive(worker)
    finally:
        launcher.kill()


def test_launch_survives_a_closed_output():
    class ClosedPipe:  # `keras-geeps launch ... | head -1` after head left
        lines = 0

        def write(self, text):
            self.lines += 1
            if self.lines > 1:
                raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    started = time.monotonic()
    code = launch([sys.executable, "-c",
                   "for i in range(200000): print('line', i)"], 1, 1,
                  output=ClosedPipe())
    assert code == 0
    assert time.monotonic() - started < 60  # the worker never blocked


def test_keygen_writes_private_secrets_and_keeps_existing_keys(tmp_path):
    keys = tmp_path / "keys"
    result = _cli("keygen", str(keys), "shard", "worker0")
    assert result.returncode == 0, result.stderr
    assert os.stat(keys).st_mode & 0o777 == 0o700
    assert os.stat(keys / "shard.key_secret").st_mode & 0o777 == 0o600
    assert os.stat(keys / "shard.key").st_mode & 0o777 == 0o644
    before = (keys / "shard.key").read_bytes()
    result = _cli("keygen", str(keys), "shard")
    assert result.returncode == 1 and "exists" in result.stderr
    assert (keys / "shard.key").read_bytes() == before
    assert _cli("keygen", "--force", str(keys), "shard").returncode == 0
    assert (keys / "shard.key").read_bytes() != before


def test_keygen_force_replaces_an_open_secret_and_a_link(tmp_path):
    """--force wrote the new secret into the old file, keeping its mode
    (readable by anyone) or following a link to somewhere else."""
    keys = tmp_path / "keys"
    assert _cli("keygen", str(keys), "shard", "worker0").returncode == 0
    os.chmod(keys / "shard.key_secret", 0o644)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    os.chmod(elsewhere, 0o644)
    (keys / "worker0.key_secret").unlink()
    (keys / "worker0.key_secret").symlink_to(elsewhere)
    result = _cli("keygen", "--force", str(keys), "shard", "worker0")
    assert result.returncode == 0, result.stderr
    for name in ("shard", "worker0"):
        secret = keys / f"{name}.key_secret"
        assert not secret.is_symlink()
        assert os.stat(secret).st_mode & 0o777 == 0o600
        assert "secret-key" in secret.read_text()
    assert elsewhere.read_text() == "untouched"
    assert sorted(p.name for p in keys.iterdir()) == [
        "shard.key", "shard.key_secret", "worker0.key", "worker0.key_secret"]


def test_keygen_refuses_names_that_are_paths_and_writes_nothing(tmp_path):
    keys = tmp_path / "keys"
    for name in ("../evil", "", ".hidden", "a/b", "x" * 101):
        result = _cli("keygen", str(keys), "fine", name)
        assert result.returncode == 2, (name, result.stderr)
        assert result.stderr.startswith(
            f"keras-geeps keygen: key name {name!r} must be"), result.stderr
    assert not keys.exists() and not list(tmp_path.iterdir())
    for name in ("../x", "-x", None):
        with pytest.raises(ValueError, match=f"key name {name!r} must be"):
            keygen(str(keys), name)
    assert not keys.exists()
    assert _cli("keygen", str(keys), "w.0_a-1").returncode == 0


def test_keygen_refuses_a_folder_others_may_write_to(tmp_path):
    """Others who may write to the folder (no sticky bit) could swap a
    public key for theirs before it is copied to the peers: refused, with
    nothing written. A folder with the sticky bit (as /tmp) is fine."""
    keys = tmp_path / "shared"
    keys.mkdir()
    keys.chmod(0o777)
    result = _cli("keygen", str(keys), "shard")
    assert result.returncode == 2, result.stderr
    assert "may be written by others (mode 0o777, no sticky bit)" in \
        result.stderr
    assert not list(keys.iterdir())
    with pytest.raises(ValueError, match="may be written by others"):
        keygen(str(keys), "shard")
    keys.chmod(0o1777)
    assert _cli("keygen", str(keys), "shard").returncode == 0


@pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")
def test_keygen_refuses_a_folder_another_user_owns(tmp_path):
    """Its owner may replace any file in it, sticky bit or not; so may the
    owner of a folder above it (moving the key folder aside for one of
    its own), or of a link on the way (pointing it elsewhere)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o1777)
    os.chown(theirs, 65534, 65534)  # nobody
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.chown(link, 65534, 65534, follow_symlinks=False)
    for keys, owned in ((theirs, theirs), (theirs / "keys", theirs),
                        (link, link)):
        result = _cli("keygen", str(keys), "shard")
        assert result.returncode == 2, result.stderr
        assert f"{owned} belongs to another user (uid 65534)" in \
            result.stderr
    assert not list(theirs.iterdir()) and not list(mine.iterdir())
    assert _cli("keygen", str(mine / "keys"), "shard").returncode == 0


def test_launch_aligns_checkpoints_before_restoring_a_whole_job(tmp_path):
    """A job killed between its two shards' checkpoint writes: `launch`
    with --restore first takes the table back to the clock both hold, and
    says so; a shard stopped on purpose (exit 0) ends the job without a
    job restart."""
    import io  # noqa: PLC0415

    from keras_geeps import checkpoint  # noqa: PLC0415

    def spec(start, end):
        return {"name": "t", "rows": 6, "width": 2, "dtype": "float32",
                "row_start": start, "row_end": end}

    directory = str(tmp_path)
    for shard, (start, end), clocks in ((0, (0, 4), (2, 4)),
                                        (1, (4, 6), (2,))):
        for clock in clocks:
            checkpoint.write(directory, shard, 2, 1, {0: (
                spec(start, end), clock,
                np.full((end - start, 2), clock, np.float32))})
    output = io.StringIO()
    assert launch([sys.executable, "-c", "pass"], num_workers=1,
                  num_shards=2, output=output,
                  shard_args=["--checkpoint-dir", directory,
                              "--checkpoint-every", "2", "--restore"]) == 0
    assert "table 0: the shards' checkpoints were at clocks [2, 4]; all " \
           "at 2 now" in output.getvalue()
    assert checkpoint.load(directory, 0, 2, 1)[0][1] == 2
    # A worker that stops shard 0 on purpose: no restart of the job.
    stopper = ("import os; from keras_geeps.cli import main; "
               "main(['stop', '--shards', os.environ["
               "'KERAS_GEEPS_SHARDS'].split(',')[0]]); ")
    output = io.StringIO()
    code = launch([sys.executable, "-c", stopper + "import time; "
                   "time.sleep(30)"], num_workers=1, num_shards=2,
                  output=output, job_restarts=1,
                  shard_args=["--checkpoint-dir", directory,
                              "--checkpoint-every", "2"])
    text = output.getvalue()
    assert code == 1 and "shard 0" in text and "was stopped" in text, text
    assert "starting the whole job again" not in text


def test_bad_flag_values_get_one_line_not_a_traceback(tmp_path, capsys):
    """Values argparse's types let through (a level that is none, a size
    past libzmq's int64, a timeout of 0, inf or nan, an address to bind
    rather than reach) are refused with one line naming the flag."""
    from keras_geeps.cli import main  # noqa: PLC0415
    shard = ["shard", "--shard-id", "0", "--num-shards", "1",
             "--num-workers", "1"]
    for argv, pattern in [
            ([*shard, "--log-level", "bogus"], "invalid choice: 'BOGUS'"),
            ([*shard, "--max-message-bytes", str(1 << 63)],
             "max_message_bytes must be at most"),
            (["stats", "--shards", "127.0.0.1:1", "--timeout", "inf"],
             "--timeout must be a number of seconds > 0"),
            (["stop", "--shards", "127.0.0.1:1", "--timeout", "0"],
             "--timeout must be"),
            (["stats", "--shards", "tcp://*:7000"], "is not host:port"),
            (["launch", "--worker-timeout", "nan", "--", "true"],
             "worker_timeout must be a number of seconds"),
            ([*shard, "--data-bind", "tcp://127.0.0.1:0"],
             "--data-bind needs --curve-secret-key"),
            (["launch", "--shard-restarts", "5", "--", "true"],
             "--shard-restarts needs --checkpoint-dir")]:
        with pytest.raises(SystemExit) as exited:
            code = main(argv)
            raise SystemExit(code)
        message = str(exited.value.code) + capsys.readouterr().err
        assert exited.value.code != 0 and re.search(pattern, message), \
            (argv, message)
        assert "Traceback" not in message


def test_keygen_refuses_before_writing_any_pair(tmp_path, capsys):
    from keras_geeps.cli import main  # noqa: PLC0415
    keys = tmp_path / "keys"
    assert main(["keygen", str(keys), "w1"]) == 0
    assert main(["keygen", str(keys), "w0", "w1"]) == 1
    assert "w1.key exists" in capsys.readouterr().err
    assert main(["keygen", str(keys), "a", "a"]) == 2
    assert "a name given twice" in capsys.readouterr().err
    assert sorted(os.listdir(keys)) == ["w1.key", "w1.key_secret"]


def test_build_ops_takes_its_flags():
    """`build-ops` took its arguments as a REMAINDER, which takes nothing
    that starts with "-": `build-ops --no-cuda` was refused as an
    unrecognized argument. The flags the README gives now work."""
    first = _cli("build-ops", timeout=600)  # (cached: seconds)
    assert first.returncode == 0, first.stderr
    kind = "--cuda" if "CUDA" in first.stdout else "--no-cuda"
    again = _cli("build-ops", kind, timeout=600)  # the same library
    assert again.returncode == 0, again.stderr
    library = first.stdout.strip().splitlines()[-1]
    assert again.stdout.strip().splitlines()[-1] == library
    both = _cli("build-ops", "--cuda", "--no-cuda")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    usage = _cli("build-ops", "--help").stdout
    assert "[--force] [--cuda | --no-cuda]" in usage
