// CUDA kernels of Pack and Unpack, plus the small runtime helpers the TF side
// needs (device-to-device copy, error text), behind gpu_launchers.h. Pure
// CUDA: no TensorFlow or Eigen header.
//
// One launch handles up to kMaxSegments variables: their pointers and
// offsets travel by value in the kernel's parameters (no host-to-device copy
// of a pointer table), and blockIdx.y picks the segment.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "gpu_launchers.h"

namespace geeps_gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxSegments = 128;  // keeps the parameters near 2 KiB
constexpr int64_t kMaxBlocksPerSegment = 2048;

struct Segments {
  const void* ptr[kMaxSegments];
  int64_t offset[kMaxSegments + 1];
};

// Arithmetic in float for the 16-bit types, rounding once, as the CPU kernels
// (Eigen::half, bfloat16) do.
__device__ inline float ToFloat(__half v) { return __half2float(v); }
__device__ inline float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ inline T FromFloat(float v);
template <>
__device__ inline __half FromFloat<__half>(float v) {
  return __float2half(v);
}
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

template <typename T>
__device__ inline T Sub(T a, T b) {
  return FromFloat<T>(ToFloat(a) - ToFloat(b));
}
template <>
__device__ inline float Sub(float a, float b) {
  return a - b;
}
template <>
__device__ inline double Sub(double a, double b) {
  return a - b;
}

template <typename T>
__device__ inline T Add(T a, T b) {
  return FromFloat<T>(ToFloat(a) + ToFloat(b));
}
template <>
__device__ inline float Add(float a, float b) {
  return a + b;
}
template <>
__device__ inline double Add(double a, double b) {
  return a + b;
}

// Each thread moves kUnroll elements a turn, blockDim.x apart (so a warp's
// accesses stay contiguous), all loads before any store: kUnroll times the
// bytes in flight of one element a thread, which a copy at HBM speed needs,
// and no alignment asked of the segments (a layout's offsets can be odd).
// Pack and Unpack keep a kernel each, with __restrict__ pointers: one kernel
// over both, through a step object and void pointers, measured unpack-add
// 1.4x slower on an H200 (benchmarks/RESULTS.md).
constexpr int kUnroll = 4;

template <typename T, bool kDelta>
__global__ void PackKernel(Segments segments, const T* __restrict__ snapshot,
                           T* __restrict__ out) {
  const int s = blockIdx.y;
  const int64_t begin = segments.offset[s];
  const int64_t size = segments.offset[s + 1] - begin;
  const T* __restrict__ src = static_cast<const T*>(segments.ptr[s]);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t first =
           blockIdx.x * static_cast<int64_t>(blockDim.x) * kUnroll + threadIdx.x;
       first < size; first += stride) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = first + u * static_cast<int64_t>(blockDim.x);
      if (k < size) {
        v[u] = kDelta ? Sub(src[k], snapshot[begin + k]) : src[k];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = first + u * static_cast<int64_t>(blockDim.x);
      if (k < size) out[begin + k] = v[u];
    }
  }
}

template <typename T, bool kAdd>
__global__ void UnpackKernel(Segments segments, const T* __restrict__ buffer) {
  const int s = blockIdx.y;
  const int64_t begin = segments.offset[s];
  const int64_t size = segments.offset[s + 1] - begin;
  T* __restrict__ dst = static_cast<T*>(const_cast<void*>(segments.ptr[s]));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t first =
           blockIdx.x * static_cast<int64_t>(blockDim.x) * kUnroll + threadIdx.x;
       first < size; first += stride) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = first + u * static_cast<int64_t>(blockDim.x);
      if (k < size) {
        v[u] = kAdd ? Add(dst[k], buffer[begin + k]) : buffer[begin + k];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = first + u * static_cast<int64_t>(blockDim.x);
      if (k < size) dst[k] = v[u];
    }
  }
}

// Fills `segments` with [first, first + count) of the layout and returns the
// grid for it.
dim3 Chunk(const void* const* ptrs, const int64_t* offsets, int first,
           int count, Segments* segments) {
  int64_t largest = 0;
  for (int i = 0; i < count; ++i) {
    segments->ptr[i] = ptrs[first + i];
    segments->offset[i] = offsets[first + i];
    largest = std::max(largest, offsets[first + i + 1] - offsets[first + i]);
  }
  segments->offset[count] = offsets[first + count];
  const int64_t blocks =
      std::min(kMaxBlocksPerSegment,
               std::max<int64_t>(1, (largest + kThreads * kUnroll - 1) /
                                        (kThreads * kUnroll)));
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(count));
}

template <typename T>
int LaunchPack(cudaStream_t stream, const void* const* srcs,
               const int64_t* offsets, int num, const void* snapshot,
               void* out) {
  for (int first = 0; first < num; first += kMaxSegments) {
    const int count = std::min(kMaxSegments, num - first);
    Segments segments;
    const dim3 grid = Chunk(srcs, offsets, first, count, &segments);
    if (snapshot != nullptr) {
      PackKernel<T, true><<<grid, kThreads, 0, stream>>>(
          segments, static_cast<const T*>(snapshot), static_cast<T*>(out));
    } else {
      PackKernel<T, false><<<grid, kThreads, 0, stream>>>(segments, nullptr,
                                                          static_cast<T*>(out));
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return 0;
}

template <typename T>
int LaunchUnpack(cudaStream_t stream, const void* buffer, void* const* dsts,
                 const int64_t* offsets, int num, bool add) {
  for (int first = 0; first < num; first += kMaxSegments) {
    const int count = std::min(kMaxSegments, num - first);
    Segments segments;
    const dim3 grid = Chunk(const_cast<const void* const*>(dsts), offsets,
                            first, count, &segments);
    if (add) {
      UnpackKernel<T, true><<<grid, kThreads, 0, stream>>>(
          segments, static_cast<const T*>(buffer));
    } else {
      UnpackKernel<T, false><<<grid, kThreads, 0, stream>>>(
          segments, static_cast<const T*>(buffer));
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return 0;
}

}  // namespace

const char* ErrorString(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

int RuntimeVersion() { return CUDART_VERSION; }

int PackSegments(void* stream, DType dtype, const void* const* srcs,
                 const int64_t* offsets, int num, const void* snapshot,
                 void* out) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32:
      return LaunchPack<float>(s, srcs, offsets, num, snapshot, out);
    case kFloat16:
      return LaunchPack<__half>(s, srcs, offsets, num, snapshot, out);
    case kBFloat16:
      return LaunchPack<__nv_bfloat16>(s, srcs, offsets, num, snapshot, out);
    case kFloat64:
      return LaunchPack<double>(s, srcs, offsets, num, snapshot, out);
  }
  return cudaErrorInvalidValue;
}

int UnpackSegments(void* stream, DType dtype, const void* buffer,
                   void* const* dsts, const int64_t* offsets, int num,
                   bool add) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32:
      return LaunchUnpack<float>(s, buffer, dsts, offsets, num, add);
    case kFloat16:
      return LaunchUnpack<__half>(s, buffer, dsts, offsets, num, add);
    case kBFloat16:
      return LaunchUnpack<__nv_bfloat16>(s, buffer, dsts, offsets, num, add);
    case kFloat64:
      return LaunchUnpack<double>(s, buffer, dsts, offsets, num, add);
  }
  return cudaErrorInvalidValue;
}

int CopyDeviceToDevice(void* stream, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return 0;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                         static_cast<cudaStream_t>(stream));
}

}  // namespace geeps_gpu
