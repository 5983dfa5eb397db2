// Kernels of GatherRows, ResourceGatherRows and ResourceScatterAddRows.

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common.h"
#include "gather_scatter.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace geeps {
namespace functor {

template <typename T, typename Index>
struct GatherRows<CPUDevice, T, Index> {
  absl::Status operator()(OpKernelContext* ctx,
                          typename TTypes<T>::ConstMatrix params,
                          typename TTypes<Index>::ConstFlat indices,
                          typename TTypes<T>::Matrix out,
                          bool /*check_indices: always, on the CPU*/) {
    const int64_t rows = params.dimension(0);
    const int64_t width = params.dimension(1);
    const int64_t n = indices.size();
    const Index* idx = indices.data();
    const int64_t bad = FindBadIndexCpu(idx, n, rows);
    if (bad >= 0) return BadIndexError(bad, idx[bad], rows);
    if (width == 0 || n == 0) return absl::OkStatus();
    const T* src = params.data();
    T* dst = out.data();
    const int64_t row_bytes = width * static_cast<int64_t>(sizeof(T));
    // The rows are read in random order, which the hardware prefetcher
    // cannot guess: ask for the head of the row kAhead rows on while copying
    // this one, so several row reads are in flight at once.
    constexpr int64_t kAhead = 8;
    const int64_t prefetch_bytes = std::min<int64_t>(row_bytes, 512);
    ParallelForBlocks(ctx, n, row_bytes, [=](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (i + kAhead < end) {
          const char* ahead = reinterpret_cast<const char*>(
              src + static_cast<int64_t>(idx[i + kAhead]) * width);
          for (int64_t b = 0; b < prefetch_bytes; b += 64) {
            __builtin_prefetch(ahead + b);
          }
        }
        std::memcpy(dst + i * width, src + static_cast<int64_t>(idx[i]) * width,
                    row_bytes);
      }
    });
    return absl::OkStatus();
  }
};

template <typename T, typename Index>
struct ScatterAddRows<CPUDevice, T, Index> {
  absl::Status operator()(OpKernelContext* ctx,
                          typename TTypes<T>::Matrix params,
                          typename TTypes<Index>::ConstFlat indices,
                          typename TTypes<T>::ConstMatrix updates,
                          bool /*check_indices: always, on the CPU*/) {
    const int64_t rows = params.dimension(0);
    const int64_t width = params.dimension(1);
    const int64_t n = indices.size();
    const Index* idx = indices.data();
    const int64_t bad = FindBadIndexCpu(idx, n, rows);
    if (bad >= 0) return BadIndexError(bad, idx[bad], rows);
    if (width == 0 || n == 0) return absl::OkStatus();
    T* dst = params.data();
    const T* src = updates.data();
    auto add_row = [=](int64_t i) {
      T* __restrict__ d = dst + static_cast<int64_t>(idx[i]) * width;
      const T* __restrict__ s = src + i * width;
      for (int64_t j = 0; j < width; ++j) d[j] += s[j];
    };
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int shards = workers == nullptr ? 1 : workers->num_threads;
    constexpr int64_t kInlineBytes = 256 << 10;
    if (shards <= 1 ||
        n * width * static_cast<int64_t>(sizeof(T)) < kInlineBytes) {
      for (int64_t i = 0; i < n; ++i) add_row(i);
      return absl::OkStatus();
    }
    // Shard s owns the rows r with r % shards == s. Every shard reads all the
    // indices but writes only its own rows, so no two threads touch one row
    // and each row gets its updates in index order: duplicates accumulate
    // without locks or atomics, and the result equals a serial loop's.
    workers->workers->ParallelFor(
        shards, thread::ThreadPool::SchedulingParams::Fixed(1),
        [=](int64_t begin, int64_t end) {
          for (int64_t s = begin; s < end; ++s) {
            for (int64_t i = 0; i < n; ++i) {
              if (static_cast<int64_t>(idx[i]) % shards == s) add_row(i);
            }
          }
        });
    return absl::OkStatus();
  }
};

#if GOOGLE_CUDA
// Fails naming the first index outside [0, rows). Waits for the device: the
// kernels must not write out of bounds and the error must name the index.
template <typename Index>
absl::Status CheckIndicesGpu(OpKernelContext* ctx, const Index* indices,
                             int64_t n, int64_t rows) {
  if (n == 0) return absl::OkStatus();
  Tensor scratch;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT64, TensorShape({1}), &scratch));
  int64_t position = -1, value = 0;
  TF_RETURN_IF_ERROR(GpuStatus(
      geeps_gpu::FindBadIndex(GpuStream(ctx), indices, sizeof(Index) == 8, n,
                              rows, scratch.data(), &position, &value),
      "index check"));
  if (position >= 0) return BadIndexError(position, value, rows);
  return absl::OkStatus();
}

template <typename T, typename Index>
struct GatherRows<GPUDevice, T, Index> {
  absl::Status operator()(OpKernelContext* ctx,
                          typename TTypes<T>::ConstMatrix params,
                          typename TTypes<Index>::ConstFlat indices,
                          typename TTypes<T>::Matrix out, bool check_indices) {
    const int64_t rows = params.dimension(0);
    const int64_t width = params.dimension(1);
    const int64_t n = indices.size();
    if (check_indices) {
      TF_RETURN_IF_ERROR(CheckIndicesGpu(ctx, indices.data(), n, rows));
    }
    if (width == 0 || n == 0) return absl::OkStatus();
    return GpuStatus(
        geeps_gpu::GatherRows(GpuStream(ctx), GpuDType<T>::value, params.data(),
                              rows, width, indices.data(), sizeof(Index) == 8,
                              n, out.data()),
        "GatherRows");
  }
};

template <typename T, typename Index>
struct ScatterAddRows<GPUDevice, T, Index> {
  absl::Status operator()(OpKernelContext* ctx,
                          typename TTypes<T>::Matrix params,
                          typename TTypes<Index>::ConstFlat indices,
                          typename TTypes<T>::ConstMatrix updates,
                          bool check_indices) {
    const int64_t rows = params.dimension(0);
    const int64_t width = params.dimension(1);
    const int64_t n = indices.size();
    if (check_indices) {
      TF_RETURN_IF_ERROR(CheckIndicesGpu(ctx, indices.data(), n, rows));
    }
    if (width == 0 || n == 0) return absl::OkStatus();
    return GpuStatus(
        geeps_gpu::ScatterAddRows(GpuStream(ctx), GpuDType<T>::value,
                                  params.data(), rows, width, indices.data(),
                                  sizeof(Index) == 8, n, updates.data()),
        "ScatterAddRows");
  }
};
#endif  // GOOGLE_CUDA

}  // namespace functor

namespace {

// The indices, a vector input, as a flat view (as Elements: DLPack memory).
template <typename Index>
typename TTypes<Index>::ConstFlat IndexElements(const Tensor& indices) {
  return typename TTypes<Index>::ConstFlat(Elements<Index>(indices),
                                           indices.NumElements());
}

// Gathers rows of `params` into a new output 0; `what` names params in errors.
template <typename Device, typename T, typename Index>
void GatherFromMatrix(OpKernelContext* ctx, const Tensor& params,
                      const Tensor& indices, bool check_indices,
                      const char* what) {
  OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(params.shape()),
              absl::InvalidArgumentError(
                  absl::StrCat(what,
                               " must be a matrix [rows, width], "
                               "got shape ",
                               params.shape().DebugString())));
  OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
              absl::InvalidArgumentError(
                  absl::StrCat("indices must be a vector, got shape ",
                               indices.shape().DebugString())));
  const int64_t n = indices.dim_size(0);
  // Before the output is allocated: with no rows every index is out of
  // range, and [n, width] of a table with no rows may not even be a shape.
  OP_REQUIRES(ctx, n == 0 || params.dim_size(0) > 0,
              absl::InvalidArgumentError(absl::StrCat(
                  "indices has ", n, " entries but ", what,
                  " has no rows (shape ", params.shape().DebugString(),
                  ")")));
  TensorShape out_shape;
  OP_REQUIRES_OK(ctx, TensorShape::BuildTensorShape({n, params.dim_size(1)},
                                                    &out_shape));
  Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
  OP_REQUIRES_OK(ctx, functor::GatherRows<Device, T, Index>()(
                          ctx, MatrixElements<T>(params),
                          IndexElements<Index>(indices), out->matrix<T>(),
                          check_indices));
}

template <typename Device, typename T, typename Index>
class GatherRowsOp : public OpKernel {
 public:
  explicit GatherRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("check_indices", &check_indices_));
  }

  void Compute(OpKernelContext* ctx) override {
    GatherFromMatrix<Device, T, Index>(ctx, ctx->input(0), ctx->input(1),
                                       check_indices_, "params");
  }

 private:
  bool check_indices_;
};

template <typename Device, typename T, typename Index>
class ResourceGatherRowsOp : public OpKernel {
 public:
  explicit ResourceGatherRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("check_indices", &check_indices_));
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupVariable(ctx, 0, &var));
    tf_shared_lock lock(*var->mu());
    OP_REQUIRES_OK(ctx, CheckVariable(var.get(), DataTypeToEnum<T>::value,
                                      "the variable"));
    GatherFromMatrix<Device, T, Index>(ctx, *var->tensor(), ctx->input(1),
                                       check_indices_, "the variable");
  }

 private:
  bool check_indices_;
};

template <typename Device, typename T, typename Index>
class ResourceScatterAddRowsOp : public OpKernel {
 public:
  explicit ResourceScatterAddRowsOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("check_indices", &check_indices_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(1);
    const Tensor& updates = ctx->input(2);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
                absl::InvalidArgumentError(
                    absl::StrCat("indices must be a vector, got shape ",
                                 indices.shape().DebugString())));
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(updates.shape()),
                absl::InvalidArgumentError(
                    absl::StrCat("updates must be a matrix [n, width], "
                                 "got shape ",
                                 updates.shape().DebugString())));
    OP_REQUIRES(
        ctx, updates.dim_size(0) == indices.dim_size(0),
        absl::InvalidArgumentError(absl::StrCat(
            "updates has ", updates.dim_size(0), " rows but indices has ",
            indices.dim_size(0), " entries")));
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupVariable(ctx, 0, &var));
    mutex_lock lock(*var->mu());
    OP_REQUIRES_OK(ctx, CheckVariable(var.get(), DataTypeToEnum<T>::value,
                                      "the variable"));
    const TensorShape& shape = var->tensor()->shape();
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(shape),
                absl::InvalidArgumentError(
                    absl::StrCat("the variable must be a matrix [rows, "
                                 "width], got shape ",
                                 shape.DebugString())));
    OP_REQUIRES(ctx, shape.dim_size(1) == updates.dim_size(1),
                absl::InvalidArgumentError(absl::StrCat(
                    "updates has rows of width ", updates.dim_size(1),
                    " but the variable has shape ", shape.DebugString())));
    OP_REQUIRES_OK(ctx, PrepareToUpdate<Device>(ctx, var.get(),
                                                /*keep_contents=*/true,
                                                /*sparse=*/true));
    OP_REQUIRES_OK(ctx, functor::ScatterAddRows<Device, T, Index>()(
                            ctx, MutableMatrixElements<T>(var->tensor()),
                            IndexElements<Index>(indices),
                            MatrixElements<T>(updates), check_indices_));
  }

 private:
  bool check_indices_;
};

}  // namespace

#define GEEPS_REGISTER(DEV, DEVICE, T, INDEX)                      \
  REGISTER_KERNEL_BUILDER(Name("Geeps>GatherRows")                 \
                              .Device(DEV)                         \
                              .TypeConstraint<T>("T")              \
                              .TypeConstraint<INDEX>("Tindices"),  \
                          GatherRowsOp<DEVICE, T, INDEX>);         \
  REGISTER_KERNEL_BUILDER(Name("Geeps>ResourceGatherRows")         \
                              .Device(DEV)                         \
                              .HostMemory("resource")              \
                              .TypeConstraint<T>("dtype")          \
                              .TypeConstraint<INDEX>("Tindices"),  \
                          ResourceGatherRowsOp<DEVICE, T, INDEX>); \
  REGISTER_KERNEL_BUILDER(Name("Geeps>ResourceScatterAddRows")     \
                              .Device(DEV)                         \
                              .HostMemory("resource")              \
                              .TypeConstraint<T>("dtype")          \
                              .TypeConstraint<INDEX>("Tindices"),  \
                          ResourceScatterAddRowsOp<DEVICE, T, INDEX>);

#define GEEPS_REGISTER_ALL(DEV, DEVICE)             \
  GEEPS_REGISTER(DEV, DEVICE, float, int32_t)       \
  GEEPS_REGISTER(DEV, DEVICE, float, int64_t)       \
  GEEPS_REGISTER(DEV, DEVICE, Eigen::half, int32_t) \
  GEEPS_REGISTER(DEV, DEVICE, Eigen::half, int64_t) \
  GEEPS_REGISTER(DEV, DEVICE, bfloat16, int32_t)    \
  GEEPS_REGISTER(DEV, DEVICE, bfloat16, int64_t)    \
  GEEPS_REGISTER(DEV, DEVICE, double, int32_t)      \
  GEEPS_REGISTER(DEV, DEVICE, double, int64_t)

GEEPS_REGISTER_ALL(DEVICE_CPU, CPUDevice)
#if GOOGLE_CUDA
GEEPS_REGISTER_ALL(DEVICE_GPU, GPUDevice)
#endif

#undef GEEPS_REGISTER_ALL
#undef GEEPS_REGISTER

}  // namespace geeps
}  // namespace tensorflow
