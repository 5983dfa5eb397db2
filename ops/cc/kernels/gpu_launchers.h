// Host-side entry points of the CUDA kernels (the *_gpu.cu.cc files).
//
// Why plain functions on raw pointers: the CUDA toolkit that builds these
// kernels need not match the one TensorFlow was built with, and nvcc cannot
// always compile TensorFlow's or Eigen's GPU headers. So the .cu.cc files
// include nothing of TensorFlow, and this header includes nothing of CUDA:
// the stream travels as `void*` (a cudaStream_t), tensors as raw pointers.
// The TF-facing functors (GPU specialisations in the kernels' .cc files,
// built by the host compiler) call these.
//
// Every function returns 0 on success or a cudaError_t value; ErrorString()
// turns it into words.

#ifndef KERAS_GEEPS_OPS_CC_KERNELS_GPU_LAUNCHERS_H_
#define KERAS_GEEPS_OPS_CC_KERNELS_GPU_LAUNCHERS_H_

#include <cstddef>
#include <cstdint>

namespace geeps_gpu {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// Bytes per element of `dtype`.
inline int64_t DTypeSize(DType dtype) {
  return dtype == kFloat64 ? 8 : dtype == kFloat32 ? 4 : 2;
}

const char* ErrorString(int error);
int RuntimeVersion();  // e.g. 13000 for CUDA 13.0.

// Finds the first position i with indices[i] outside [0, rows). Blocks until
// the answer is on the host: *bad_position is i (or -1), *bad_value the index
// found there. `scratch` is 8 bytes of device memory.
int FindBadIndex(void* stream, const void* indices, bool index64, int64_t n,
                 int64_t rows, void* scratch, int64_t* bad_position,
                 int64_t* bad_value);

// out[i, :] = params[indices[i], :] for a [rows, width] params. Rows whose
// index is out of range are zero-filled (callers check with FindBadIndex).
int GatherRows(void* stream, DType dtype, const void* params, int64_t rows,
               int64_t width, const void* indices, bool index64, int64_t n,
               void* out);

// params[indices[i], :] += updates[i, :] with atomic adds, so duplicate
// indices accumulate. Out-of-range indices are skipped (callers check first).
int ScatterAddRows(void* stream, DType dtype, void* params, int64_t rows,
                   int64_t width, const void* indices, bool index64, int64_t n,
                   const void* updates);

// out[offsets[i] + k] = srcs[i][k] (- snapshot[offsets[i] + k] when snapshot
// is not null) for k < offsets[i + 1] - offsets[i]. `srcs` and `offsets`
// (num + 1 entries) are host arrays.
int PackSegments(void* stream, DType dtype, const void* const* srcs,
                 const int64_t* offsets, int num, const void* snapshot,
                 void* out);

// dsts[i][k] = (or +=, when add) buffer[offsets[i] + k].
int UnpackSegments(void* stream, DType dtype, const void* buffer,
                   void* const* dsts, const int64_t* offsets, int num,
                   bool add);

int CopyDeviceToDevice(void* stream, void* dst, const void* src, size_t bytes);

}  // namespace geeps_gpu

#endif  // KERAS_GEEPS_OPS_CC_KERNELS_GPU_LAUNCHERS_H_
