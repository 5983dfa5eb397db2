// Helpers shared by the keras_geeps kernels (host compiler only): device
// aliases, index validation, the CPU work splitter, resource-variable locking
// and copy-on-write, and the bridge to the CUDA launchers.

#ifndef KERAS_GEEPS_OPS_CC_KERNELS_COMMON_H_
#define KERAS_GEEPS_OPS_CC_KERNELS_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if GOOGLE_CUDA
#include "gpu_launchers.h"
#include "xla/stream_executor/stream.h"
#endif

namespace tensorflow {
namespace geeps {

using CPUDevice = Eigen::ThreadPoolDevice;
using GPUDevice = Eigen::GpuDevice;  // a tag only; Eigen's GPU code is unused.

// The elements of an input tensor, read without Tensor::flat<T>()'s check of
// Eigen's 64-byte alignment: a tensor from DLPack (numpy, shared memory)
// aliases memory aligned only as its allocator chose, which flat<T>() would
// abort the process on. The kernels read inputs through plain pointers.
template <typename T>
const T* Elements(const Tensor& tensor) {
  return reinterpret_cast<const T*>(tensor.tensor_data().data());
}

// A variable's elements to write, as Elements: a variable assigned a tensor
// from DLPack may keep that memory.
template <typename T>
T* MutableElements(Tensor* tensor) {
  return const_cast<T*>(Elements<T>(*tensor));
}

// A variable's tensor of shape [rows, width] as a matrix view to write (as
// MutableElements; the kernels use its data() and dimensions only).
template <typename T>
typename TTypes<T>::Matrix MutableMatrixElements(Tensor* tensor) {
  return typename TTypes<T>::Matrix(MutableElements<T>(tensor),
                                    tensor->dim_size(0), tensor->dim_size(1));
}

// An input tensor of shape [rows, width] as a matrix view (as Elements).
template <typename T>
typename TTypes<T>::ConstMatrix MatrixElements(const Tensor& tensor) {
  return typename TTypes<T>::ConstMatrix(
      Elements<T>(tensor), tensor.dim_size(0), tensor.dim_size(1));
}

inline absl::Status BadIndexError(int64_t position, int64_t value,
                                  int64_t rows) {
  return absl::InvalidArgumentError(absl::StrCat(
      "indices[", position, "] = ", value, " is not in [0, ", rows, ")"));
}

// Position of the first of indices[0..n) outside [0, rows), or -1. Scans
// blocks branch-free (so the compiler vectorises it) and only looks for the
// position inside a block that holds a bad index.
template <typename Index>
int64_t FindBadIndexCpu(const Index* indices, int64_t n, int64_t rows) {
  constexpr int64_t kBlock = 1024;
  const uint64_t limit = static_cast<uint64_t>(rows);
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    bool bad = false;
    for (int64_t i = start; i < end; ++i) {
      // A negative index becomes a huge unsigned one.
      bad |= static_cast<uint64_t>(static_cast<int64_t>(indices[i])) >= limit;
    }
    if (!bad) continue;
    for (int64_t i = start; i < end; ++i) {
      if (static_cast<uint64_t>(static_cast<int64_t>(indices[i])) >= limit) {
        return i;
      }
    }
  }
  return -1;
}

// Runs fn(begin, end) over [0, total) units of `unit_bytes` each on the CPU
// worker pool of `ctx`. Memory-bound loops gain from threads only in large
// blocks, so small jobs run inline and big ones split into about four blocks
// per thread, none under 64 KiB.
inline void ParallelForBlocks(OpKernelContext* ctx, int64_t total,
                              int64_t unit_bytes,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (total <= 0) return;
  constexpr int64_t kInlineBytes = 256 << 10;
  constexpr int64_t kMinBlockBytes = 64 << 10;
  const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  const int threads = workers == nullptr ? 1 : workers->num_threads;
  const int64_t unit = std::max<int64_t>(unit_bytes, 1);
  if (threads <= 1 || total * unit < kInlineBytes) {
    fn(0, total);
    return;
  }
  const int64_t min_block = (kMinBlockBytes + unit - 1) / unit;
  const int64_t block =
      std::max<int64_t>(min_block, (total + 4 * threads - 1) / (4 * threads));
  workers->workers->ParallelFor(
      total, thread::ThreadPool::SchedulingParams::Fixed(block), fn);
}

// Copies of at least this many bytes in total use StreamingCopy: their
// output is bigger than a core's cache, so caching it only costs bandwidth.
constexpr int64_t kStreamingBytes = 4 << 20;

// memcpy with non-temporal stores where the CPU has them (x86-64 SSE2): a
// plain copy first reads every destination line into the cache, then writes
// it back, so it moves three bytes per byte copied; streaming stores skip
// the read. The stores are weakly ordered: call StreamingFence() before the
// data is handed to another thread.
inline void StreamingCopy(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = std::min<size_t>(
      bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

// d[k] = (a[k] - b[k]) * scale for floats, with streaming stores (as in
// StreamingCopy: the output is written, never read, by this core).
inline void StreamingSubtractScale(float* d, const float* a, const float* b,
                                   int64_t n, float scale) {
  int64_t k = 0;
#if defined(__SSE2__)
  for (; k < n && (reinterpret_cast<uintptr_t>(d + k) & 15); ++k) {
    d[k] = (a[k] - b[k]) * scale;
  }
  const __m128 s = _mm_set1_ps(scale);
  for (; k + 8 <= n; k += 8) {
    const __m128 x0 = _mm_sub_ps(_mm_loadu_ps(a + k), _mm_loadu_ps(b + k));
    const __m128 x1 =
        _mm_sub_ps(_mm_loadu_ps(a + k + 4), _mm_loadu_ps(b + k + 4));
    _mm_stream_ps(d + k, scale == 1.0f ? x0 : _mm_mul_ps(x0, s));
    _mm_stream_ps(d + k + 4, scale == 1.0f ? x1 : _mm_mul_ps(x1, s));
  }
#endif
  for (; k < n; ++k) d[k] = (a[k] - b[k]) * scale;
}

// d[k] = a[k] * scale for floats, with streaming stores.
inline void StreamingScale(float* d, const float* a, int64_t n, float scale) {
  int64_t k = 0;
#if defined(__SSE2__)
  for (; k < n && (reinterpret_cast<uintptr_t>(d + k) & 15); ++k) {
    d[k] = a[k] * scale;
  }
  const __m128 s = _mm_set1_ps(scale);
  for (; k + 8 <= n; k += 8) {
    _mm_stream_ps(d + k, _mm_mul_ps(_mm_loadu_ps(a + k), s));
    _mm_stream_ps(d + k + 4, _mm_mul_ps(_mm_loadu_ps(a + k + 4), s));
  }
#endif
  for (; k < n; ++k) d[k] = a[k] * scale;
}

// d[k] = b[k] + a[k] * scale for floats, with streaming stores.
inline void StreamingAddScaled(float* d, const float* b, const float* a,
                               int64_t n, float scale) {
  int64_t k = 0;
#if defined(__SSE2__)
  for (; k < n && (reinterpret_cast<uintptr_t>(d + k) & 15); ++k) {
    d[k] = b[k] + a[k] * scale;
  }
  const __m128 s = _mm_set1_ps(scale);
  for (; k + 8 <= n; k += 8) {
    _mm_stream_ps(d + k, _mm_add_ps(_mm_loadu_ps(b + k),
                                    _mm_mul_ps(_mm_loadu_ps(a + k), s)));
    _mm_stream_ps(d + k + 4,
                  _mm_add_ps(_mm_loadu_ps(b + k + 4),
                             _mm_mul_ps(_mm_loadu_ps(a + k + 4), s)));
  }
#endif
  for (; k < n; ++k) d[k] = b[k] + a[k] * scale;
}

inline void StreamingFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Copies `bytes` bytes with the CPU worker pool.
inline void ParallelMemcpy(OpKernelContext* ctx, void* dst, const void* src,
                           int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const bool streaming = bytes >= kStreamingBytes;
  ParallelForBlocks(ctx, bytes, 1, [=](int64_t begin, int64_t end) {
    if (!streaming) {
      std::memcpy(d + begin, s + begin, end - begin);
      return;
    }
    StreamingCopy(d + begin, s + begin, end - begin);
    StreamingFence();
  });
}

#if GOOGLE_CUDA
// The cudaStream_t of the op's compute stream.
inline void* GpuStream(OpKernelContext* ctx) {
  return ctx->op_device_context()->stream()->platform_specific_handle().stream;
}

inline absl::Status GpuStatus(int error, const char* what) {
  if (error == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      "keras_geeps CUDA kernel ", what, " failed: ",
      geeps_gpu::ErrorString(error), ". These kernels were built with CUDA ",
      geeps_gpu::RuntimeVersion() / 1000, ".",
      geeps_gpu::RuntimeVersion() % 1000 / 10,
      "; if the driver is older, rebuild with a matching nvcc "
      "(KERAS_GEEPS_NVCC=/path/to/nvcc python -m keras_geeps._build "
      "--force)."));
}

template <typename T>
struct GpuDType;
template <>
struct GpuDType<float> {
  static constexpr geeps_gpu::DType value = geeps_gpu::kFloat32;
};
template <>
struct GpuDType<Eigen::half> {
  static constexpr geeps_gpu::DType value = geeps_gpu::kFloat16;
};
template <>
struct GpuDType<bfloat16> {
  static constexpr geeps_gpu::DType value = geeps_gpu::kBFloat16;
};
template <>
struct GpuDType<double> {
  static constexpr geeps_gpu::DType value = geeps_gpu::kFloat64;
};
#endif  // GOOGLE_CUDA

// Copies the contents of `src` into `dst` (same size) on the device.
template <typename Device>
absl::Status CopyTensorBytes(OpKernelContext* ctx, const Tensor& src,
                             Tensor* dst);

template <>
inline absl::Status CopyTensorBytes<CPUDevice>(OpKernelContext* ctx,
                                               const Tensor& src, Tensor* dst) {
  ParallelMemcpy(ctx, dst->data(), src.data(), src.TotalBytes());
  return absl::OkStatus();
}

#if GOOGLE_CUDA
template <>
inline absl::Status CopyTensorBytes<GPUDevice>(OpKernelContext* ctx,
                                               const Tensor& src, Tensor* dst) {
  return GpuStatus(geeps_gpu::CopyDeviceToDevice(GpuStream(ctx), dst->data(),
                                                 src.data(), src.TotalBytes()),
                   "copy-on-write");
}
#endif

// Checks, with the variable's lock held, that it is initialised and of dtype.
// `what` names it in messages (e.g. "variable 3").
inline absl::Status CheckVariable(Var* var, DataType dtype,
                                  const std::string& what) {
  if (!var->is_initialized) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " is not initialized"));
  }
  if (var->tensor()->dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has dtype ", DataTypeString(var->tensor()->dtype()),
        " but the op was given dtype ", DataTypeString(dtype)));
  }
  return absl::OkStatus();
}

// Makes the variable's buffer private before an in-place write; the caller
// holds var->mu() exclusively. When an earlier read still shares the buffer
// (the reader must keep seeing the old value) the variable moves to a fresh
// copy, as TF's PrepareToUpdateVariable does; the old contents are copied only
// if `keep_contents` (an assign of every element need not). `sparse` writers
// also switch the variable to copy-on-read mode, as TF's sparse ops do
// (EnsureSparseVariableAccess), so later reads copy instead of every row
// update copying the whole table.
template <typename Device>
absl::Status PrepareToUpdate(OpKernelContext* ctx, Var* var, bool keep_contents,
                             bool sparse) {
  Tensor* tensor = var->tensor();
  if (!tensor->RefCountIsOne()) {
    AllocatorAttributes attr;
    attr.set_gpu_compatible(true);
    attr.set_nic_compatible(true);
    Tensor fresh;
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(tensor->dtype(), tensor->shape(), &fresh, attr));
    if (keep_contents) {
      TF_RETURN_IF_ERROR(CopyTensorBytes<Device>(ctx, *tensor, &fresh));
    }
    *tensor = fresh;
  }
  if (sparse) var->copy_on_read_mode.store(true);
  return absl::OkStatus();
}

// Looks up the variable behind resource input `index`, a scalar handle (the
// shape functions say so, but do not run in eager mode: a [2] handle
// tensor would silently be taken for its first handle).
inline absl::Status LookupVariable(OpKernelContext* ctx, int index,
                                   core::RefCountPtr<Var>* var) {
  const TensorShape& shape = ctx->input(index).shape();
  if (!TensorShapeUtils::IsScalar(shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat("input ", index, " must be one variable's handle (a "
                     "scalar), got a tensor of handles of shape ",
                     shape.DebugString()));
  }
  return LookupResource(ctx, HandleFromInput(ctx, index), var);
}

// Looks up the variables behind resource inputs [first, first + n).
inline absl::Status LookupVariables(OpKernelContext* ctx, int first, int n,
                                    std::vector<core::RefCountPtr<Var>>* vars) {
  vars->clear();
  vars->resize(n);
  for (int i = 0; i < n; ++i) {
    TF_RETURN_IF_ERROR(LookupVariable(ctx, first + i, &(*vars)[i]));
  }
  return absl::OkStatus();
}

// Holds the locks of a list of variables, shared or exclusive, taking each
// distinct one once and in increasing mu() address order (TF's rule for
// locking several variables, so no two ops deadlock).
class VariableListLock {
 public:
  VariableListLock(const std::vector<core::RefCountPtr<Var>>& vars,
                   bool exclusive)
      : exclusive_(exclusive) {
    for (const auto& var : vars) vars_.push_back(var.get());
    std::sort(vars_.begin(), vars_.end(),
              [](Var* a, Var* b) { return a->mu() < b->mu(); });
    vars_.erase(std::unique(vars_.begin(), vars_.end()), vars_.end());
    for (Var* var : vars_) {
      if (exclusive_) {
        var->mu()->lock();
      } else {
        var->mu()->lock_shared();
      }
    }
  }
  ~VariableListLock() {
    for (auto it = vars_.rbegin(); it != vars_.rend(); ++it) {
      if (exclusive_) {
        (*it)->mu()->unlock();
      } else {
        (*it)->mu()->unlock_shared();
      }
    }
  }

  VariableListLock(const VariableListLock&) = delete;
  VariableListLock& operator=(const VariableListLock&) = delete;

 private:
  const bool exclusive_;
  std::vector<Var*> vars_;  // distinct, in mu() address order
};

}  // namespace geeps
}  // namespace tensorflow

#endif  // KERAS_GEEPS_OPS_CC_KERNELS_COMMON_H_
