// CUDA kernels of GatherRows and ScatterAddRows, behind the launchers
// declared in gpu_launchers.h. Pure CUDA: no TensorFlow or Eigen header (see
// gpu_launchers.h for why), so the data types are CUDA's own __half and
// __nv_bfloat16, bit-identical to Eigen::half and tensorflow::bfloat16.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu_launchers.h"

namespace geeps_gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover the rest

// A block shape for row-wise work: x threads walk a row's `units`, y threads
// take different rows, so narrow rows still fill a block.
dim3 RowBlock(int64_t units) {
  int x = 1;
  while (x < units && x < kThreads) x <<= 1;
  return dim3(x, kThreads / x);
}

int64_t GridFor(int64_t rows_of_work, int rows_per_block) {
  int64_t blocks = (rows_of_work + rows_per_block - 1) / rows_per_block;
  if (blocks < 1) blocks = 1;
  return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

template <typename Index>
__global__ void FindBadIndexKernel(const Index* indices, int64_t n,
                                   int64_t rows,
                                   unsigned long long* first_bad) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < n; i += stride) {
    const int64_t v = static_cast<int64_t>(indices[i]);
    if (v < 0 || v >= rows) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
    }
  }
}

// Copies rows in units U (uint4, uint2, ... chosen by alignment).
template <typename U, typename Index>
__global__ void GatherKernel(const U* __restrict__ params, int64_t rows,
                             int64_t row_units,
                             const Index* __restrict__ indices, int64_t n,
                             U* __restrict__ out) {
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y;
       i < n; i += row_stride) {
    const int64_t r = static_cast<int64_t>(indices[i]);
    const bool ok = r >= 0 && r < rows;
    U* dst = out + i * row_units;
    const U* src = params + (ok ? r : 0) * row_units;
    for (int64_t j = threadIdx.x; j < row_units; j += blockDim.x) {
      dst[j] = ok ? src[j] : U{};
    }
  }
}

__device__ inline void AtomicAddValue(float* a, float v) { atomicAdd(a, v); }
// Four floats in one vector atomic where the chip has it (sm_90, CUDA 12.1+:
// each element is added atomically), else four scalar ones.
__device__ inline void AtomicAddValue(float4* a, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && CUDART_VERSION >= 12010
  atomicAdd(a, v);
#else
  float* f = reinterpret_cast<float*>(a);
  atomicAdd(f, v.x);
  atomicAdd(f + 1, v.y);
  atomicAdd(f + 2, v.z);
  atomicAdd(f + 3, v.w);
#endif
}
__device__ inline void AtomicAddValue(double* a, double v) { atomicAdd(a, v); }
__device__ inline void AtomicAddValue(__half* a, __half v) { atomicAdd(a, v); }
__device__ inline void AtomicAddValue(__nv_bfloat16* a, __nv_bfloat16 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  atomicAdd(a, v);
#else
  // No native bf16 atomic add before sm_80: a 16-bit compare-and-swap loop
  // (sm_70+), adding in float and rounding once, as the native one does.
  unsigned short* word = reinterpret_cast<unsigned short*>(a);
  unsigned short old = *word;
  unsigned short assumed;
  do {
    assumed = old;
    const float sum =
        __bfloat162float(__ushort_as_bfloat16(assumed)) + __bfloat162float(v);
    old = atomicCAS(word, assumed, __bfloat16_as_ushort(__float2bfloat16(sum)));
  } while (assumed != old);
#endif
}

// Two 16-bit values in one vector atomic (each added and rounded alone, as
// the scalar adds do): native for half2 on sm_60+, for bfloat162 on sm_80+;
// before that, the bfloat16 pair takes the scalar compare-and-swap adds.
__device__ inline void AtomicAddValue(__half2* a, __half2 v) {
  atomicAdd(a, v);
}
__device__ inline void AtomicAddValue(__nv_bfloat162* a, __nv_bfloat162 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  atomicAdd(a, v);
#else
  __nv_bfloat16* pair = reinterpret_cast<__nv_bfloat16*>(a);
  AtomicAddValue(pair, v.x);
  AtomicAddValue(pair + 1, v.y);
#endif
}

template <typename T, typename Index>
__global__ void ScatterAddKernel(T* params, int64_t rows, int64_t width,
                                 const Index* __restrict__ indices, int64_t n,
                                 const T* __restrict__ updates) {
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y;
       i < n; i += row_stride) {
    const int64_t r = static_cast<int64_t>(indices[i]);
    if (r < 0 || r >= rows) continue;
    T* dst = params + r * width;
    const T* src = updates + i * width;
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
      AtomicAddValue(dst + j, src[j]);
    }
  }
}

template <typename U, typename Index>
int LaunchGather(cudaStream_t stream, const void* params, int64_t rows,
                 int64_t row_units, const Index* indices, int64_t n,
                 void* out) {
  const dim3 block = RowBlock(row_units);
  GatherKernel<U, Index><<<GridFor(n, block.y), block, 0, stream>>>(
      static_cast<const U*>(params), rows, row_units, indices, n,
      static_cast<U*>(out));
  return cudaGetLastError();
}

template <typename Index>
int GatherDispatch(cudaStream_t stream, DType dtype, const void* params,
                   int64_t rows, int64_t width, const Index* indices, int64_t n,
                   void* out) {
  // Copy in the widest unit the row size and both base addresses allow.
  const int64_t row_bytes = width * DTypeSize(dtype);
  const uintptr_t align = reinterpret_cast<uintptr_t>(params) |
                          reinterpret_cast<uintptr_t>(out) |
                          static_cast<uintptr_t>(row_bytes);
  if (align % 16 == 0) {
    return LaunchGather<uint4>(stream, params, rows, row_bytes / 16, indices, n,
                               out);
  }
  if (align % 8 == 0) {
    return LaunchGather<uint2>(stream, params, rows, row_bytes / 8, indices, n,
                               out);
  }
  if (align % 4 == 0) {
    return LaunchGather<unsigned int>(stream, params, rows, row_bytes / 4,
                                      indices, n, out);
  }
  return LaunchGather<unsigned short>(stream, params, rows, row_bytes / 2,
                                      indices, n, out);
}

template <typename T, typename Index>
int LaunchScatterAdd(cudaStream_t stream, void* params, int64_t rows,
                     int64_t width, const Index* indices, int64_t n,
                     const void* updates) {
  const dim3 block = RowBlock(width);
  ScatterAddKernel<T, Index><<<GridFor(n, block.y), block, 0, stream>>>(
      static_cast<T*>(params), rows, width, indices, n,
      static_cast<const T*>(updates));
  return cudaGetLastError();
}

template <typename Index>
int ScatterAddDispatch(cudaStream_t stream, DType dtype, void* params,
                       int64_t rows, int64_t width, const Index* indices,
                       int64_t n, const void* updates) {
  // Rows of whole, aligned vectors take one vector add per vector: float4
  // for float32, pairs for the 16-bit types.
  const uintptr_t align = reinterpret_cast<uintptr_t>(params) |
                          reinterpret_cast<uintptr_t>(updates);
  const bool pairs = width % 2 == 0 && align % 4 == 0;
  switch (dtype) {
    case kFloat32:
      if (width % 4 == 0 && align % 16 == 0) {
        return LaunchScatterAdd<float4>(stream, params, rows, width / 4,
                                        indices, n, updates);
      }
      return LaunchScatterAdd<float>(stream, params, rows, width, indices, n,
                                     updates);
    case kFloat16:
      if (pairs) {
        return LaunchScatterAdd<__half2>(stream, params, rows, width / 2,
                                         indices, n, updates);
      }
      return LaunchScatterAdd<__half>(stream, params, rows, width, indices, n,
                                      updates);
    case kBFloat16:
      if (pairs) {
        return LaunchScatterAdd<__nv_bfloat162>(stream, params, rows,
                                                width / 2, indices, n, updates);
      }
      return LaunchScatterAdd<__nv_bfloat16>(stream, params, rows, width,
                                             indices, n, updates);
    case kFloat64:
      return LaunchScatterAdd<double>(stream, params, rows, width, indices, n,
                                      updates);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

int FindBadIndex(void* stream_ptr, const void* indices, bool index64, int64_t n,
                 int64_t rows, void* scratch, int64_t* bad_position,
                 int64_t* bad_value) {
  *bad_position = -1;
  *bad_value = 0;
  if (n == 0) return 0;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  auto* first_bad = static_cast<unsigned long long*>(scratch);
  cudaError_t err =
      cudaMemsetAsync(first_bad, 0xff, sizeof(*first_bad), stream);
  if (err != cudaSuccess) return err;
  const int64_t blocks = GridFor(n, kThreads);
  if (index64) {
    FindBadIndexKernel<<<blocks, kThreads, 0, stream>>>(
        static_cast<const int64_t*>(indices), n, rows, first_bad);
  } else {
    FindBadIndexKernel<<<blocks, kThreads, 0, stream>>>(
        static_cast<const int32_t*>(indices), n, rows, first_bad);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  unsigned long long position = 0;
  err = cudaMemcpyAsync(&position, first_bad, sizeof(position),
                        cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  if ((err = cudaStreamSynchronize(stream)) != cudaSuccess) return err;
  if (position == ~0ull) return 0;
  *bad_position = static_cast<int64_t>(position);
  if (index64) {
    int64_t value = 0;
    err =
        cudaMemcpyAsync(&value, static_cast<const int64_t*>(indices) + position,
                        sizeof(value), cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    *bad_value = value;
  } else {
    int32_t value = 0;
    err =
        cudaMemcpyAsync(&value, static_cast<const int32_t*>(indices) + position,
                        sizeof(value), cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    *bad_value = value;
  }
  return err;
}

int GatherRows(void* stream, DType dtype, const void* params, int64_t rows,
               int64_t width, const void* indices, bool index64, int64_t n,
               void* out) {
  if (n == 0 || width == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (index64) {
    return GatherDispatch(s, dtype, params, rows, width,
                          static_cast<const int64_t*>(indices), n, out);
  }
  return GatherDispatch(s, dtype, params, rows, width,
                        static_cast<const int32_t*>(indices), n, out);
}

int ScatterAddRows(void* stream, DType dtype, void* params, int64_t rows,
                   int64_t width, const void* indices, bool index64, int64_t n,
                   const void* updates) {
  if (n == 0 || width == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (index64) {
    return ScatterAddDispatch(s, dtype, params, rows, width,
                              static_cast<const int64_t*>(indices), n, updates);
  }
  return ScatterAddDispatch(s, dtype, params, rows, width,
                            static_cast<const int32_t*>(indices), n, updates);
}

}  // namespace geeps_gpu
