#!/usr/bin/env bash
# The CUDA kernels on a GPU machine, with no TensorFlow needed: builds
# tests/cuda/launchers_check.cu.cc (tests/cuda/build.sh), runs both variants
# (sm_80/sm_90 machine code, and compute_75 PTX for the pre-Ampere paths),
# the large grid-stride cases, compute-sanitizer's memcheck and initcheck
# where it works, and the bandwidth figures against a device-to-device copy.
# benchmarks/gpu_check.sh is the TensorFlow-side check; this one also runs
# where no CUDA build of TensorFlow is installed.
#
# Usage: bash benchmarks/cuda_kernels_check.sh [OUT_DIR]  (default build/cuda)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/cuda}
status=0

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  2>/dev/null || echo "nvidia-smi: none"
nvcc --version 2>/dev/null | tail -1

echo "== build"
start=$(date +%s)
bash tests/cuda/build.sh "$out" || exit 1
echo "build took $(( $(date +%s) - start )) s"

run() {  # run NAME COMMAND...: prints the output, records a failure
  echo "== $1"
  shift
  "$@"
  local rc=$?
  [ $rc -eq 0 ] || { echo "exit status $rc"; status=1; }
}

run "sm_80/sm_90 machine code, large cases, bench" \
  "$out/launchers_check_sass" --large --bench
run "compute_75 PTX (JIT), large cases" "$out/launchers_check_ptx75" --large
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck initcheck; do
    run "compute-sanitizer --tool $tool" compute-sanitizer --tool "$tool" \
      --error-exitcode 9 "$out/launchers_check_sass"
  done
else
  echo "== compute-sanitizer: not installed, skipped"
fi
exit $status
