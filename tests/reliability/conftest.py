"""Fixtures of the reliability tests."""

import subprocess
import sys

import pytest


@pytest.fixture
def keys(tmp_path):
    """A folder with `keygen`'s pairs "shard", "worker" and "stranger";
    only "worker" is allowed."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "keras_geeps", "keygen", str(tmp_path),
         "shard", "worker", "stranger"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    key = (tmp_path / "worker.key").read_bytes()
    (allowed / "worker.key").write_bytes(key)
    return tmp_path
