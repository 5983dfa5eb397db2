#!/usr/bin/env bash
# Builds tests/cuda/launchers_check.cu.cc with the op library's CUDA sources,
# in two variants:
#   OUT/launchers_check_sass  machine code for sm_90 and sm_80 (the Hopper and
#                             Ampere paths: native bf16 atomics)
#   OUT/launchers_check_ptx75 PTX for compute_75 only, which the driver
#                             compiles at load time: the pre-sm_80 path of
#                             the kernels (the bf16 compare-and-swap add)
# Usage: bash tests/cuda/build.sh OUT_DIR   (nvcc: $KERAS_GEEPS_NVCC or PATH)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
kernels="$here/../../ops/cc/kernels"
out=${1:?usage: build.sh OUT_DIR}
nvcc=${KERAS_GEEPS_NVCC:-nvcc}
mkdir -p "$out"
sources=(-x cu "$here/launchers_check.cu.cc" "$kernels/gather_scatter_gpu.cu.cc"
         "$kernels/pack_gpu.cu.cc")
"$nvcc" -std=c++17 -O2 -gencode arch=compute_90,code=sm_90 \
  -gencode arch=compute_80,code=sm_80 -o "$out/launchers_check_sass" \
  "${sources[@]}" &
"$nvcc" -std=c++17 -O2 -gencode arch=compute_75,code=compute_75 \
  -o "$out/launchers_check_ptx75" "${sources[@]}" &
wait %1
wait %2
