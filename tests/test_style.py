"""The project's Python passes pycodestyle and pyflakes.

Lines of at most 79 characters, PEP 8 layout, and no unused import or
undefined name: checked here so a change that breaks them fails the
tests, naming each file, line and rule.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = ["keras_geeps", "tests", "examples", "benchmarks", "setup.py"]


@pytest.mark.parametrize("tool", ["pycodestyle", "pyflakes"])
def test_the_python_sources_pass(tool):
    result = subprocess.run(
        [sys.executable, "-m", tool, *CHECKED], cwd=ROOT,
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{tool} found problems:\n{result.stdout}{result.stderr}")
