"""The CUDA kernels, checked without TensorFlow by tests/cuda/launchers_check.

The harness calls each launcher of ops/cc/kernels/gpu_launchers.h on device
buffers and compares the output bit for bit with a host reference (every
dtype, both index widths, misaligned buffers, duplicate and out-of-range
indices, layouts of more segments than one launch takes). It is built here
wherever nvcc is, and run where a CUDA device is; on a GPU machine
`bash benchmarks/cuda_kernels_check.sh` also runs the large cases, the
compute-sanitizer checks and the bandwidth figures.
"""

import os
import pathlib
import shutil
import subprocess

import pytest

HERE = pathlib.Path(__file__).resolve().parent
NVCC = os.environ.get("KERAS_GEEPS_NVCC") or shutil.which("nvcc")
NO_DEVICE = 77  # the harness's exit status when no CUDA device is usable

pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc to build with")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda")
    proc = subprocess.run(["bash", str(HERE / "cuda" / "build.sh"), str(out)],
                          capture_output=True, text=True,
                          env={**os.environ, "KERAS_GEEPS_NVCC": NVCC})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.parametrize("variant", ["launchers_check_sass",
                                     "launchers_check_ptx75"])
def test_launchers_match_the_host_reference(harness, variant):
    binary = harness / variant
    assert os.access(binary, os.X_OK)
    proc = subprocess.run([str(binary)], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == NO_DEVICE:
        pytest.skip("needs a CUDA device (the harness found none); built only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 failed" in proc.stdout.splitlines()[-1]
