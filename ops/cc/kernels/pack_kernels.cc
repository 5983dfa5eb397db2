// Kernels of Pack, PackDelta, PackTensors, PackTensorsDelta and Unpack.

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common.h"
#include "pack.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace geeps {
namespace functor {
namespace {

// Calls fn(segment, begin, end) for each piece of [begin, end) that lies in
// one segment, skipping empty segments.
template <typename Fn>
void ForEachSegmentPiece(const std::vector<int64_t>& offsets, int64_t begin,
                         int64_t end, Fn fn) {
  // The last segment starting at or before `begin`: the one holding it.
  size_t s = std::upper_bound(offsets.begin(), offsets.end(), begin) -
             offsets.begin() - 1;
  int64_t pos = begin;
  while (pos < end) {
    const int64_t piece_end = std::min(end, offsets[s + 1]);
    fn(s, pos, piece_end);
    pos = piece_end;
    while (pos < end && offsets[s + 1] <= pos) ++s;
  }
}

template <typename T>
void CopyElements(T* dst, const T* src, int64_t len, bool streaming) {
  if (streaming) {
    StreamingCopy(dst, src, len * sizeof(T));
  } else {
    std::memcpy(dst, src, len * sizeof(T));
  }
}

// out = (srcs - snapshot) * scales[segment] over the layout, on the CPU
// worker pool; without a snapshot, out = srcs * scales[segment]; with
// `add_to_snapshot`, out = snapshot + srcs * scales[segment]. Used by
// PackDelta (scale 1), PackDeltaInto and PackTensorsInto. A float32 output
// of kStreamingBytes or more is written with streaming stores (it is read by
// someone else).
template <typename T>
void ScaleSegments(OpKernelContext* ctx, const std::vector<const T*>& srcs,
                   const std::vector<int64_t>& offsets, const T* snapshot,
                   T* out, const std::vector<float>& scales,
                   bool add_to_snapshot = false) {
  const bool streaming =
      std::is_same<T, float>::value &&
      offsets.back() * static_cast<int64_t>(sizeof(T)) >= kStreamingBytes;
  ParallelForBlocks(
      ctx, offsets.back(), sizeof(T), [&](int64_t begin, int64_t end) {
        ForEachSegmentPiece(
            offsets, begin, end, [&](size_t s, int64_t from, int64_t to) {
              const T* __restrict__ src = srcs[s] + (from - offsets[s]);
              const T* __restrict__ old =
                  snapshot == nullptr ? nullptr : snapshot + from;
              T* __restrict__ dst = out + from;
              const int64_t len = to - from;
              const float scale = scales[s];
              if constexpr (std::is_same<T, float>::value) {
                if (streaming) {
                  if (old == nullptr) {
                    StreamingScale(dst, src, len, scale);
                  } else if (add_to_snapshot) {
                    StreamingAddScaled(dst, old, src, len, scale);
                  } else {
                    StreamingSubtractScale(dst, src, old, len, scale);
                  }
                  return;
                }
              }
              // Half types scale in float, as TensorFlow's own kernels do.
              using Acc = typename std::conditional<
                  std::is_same<T, double>::value, double, float>::type;
              const Acc scale_acc = static_cast<Acc>(scale);
              if (old == nullptr) {
                for (int64_t k = 0; k < len; ++k) {
                  dst[k] = static_cast<T>(static_cast<Acc>(src[k]) * scale_acc);
                }
              } else if (add_to_snapshot) {
                for (int64_t k = 0; k < len; ++k) {
                  dst[k] = static_cast<T>(static_cast<Acc>(old[k]) +
                                          static_cast<Acc>(src[k]) * scale_acc);
                }
              } else if (scale == 1.0f) {
                for (int64_t k = 0; k < len; ++k) dst[k] = src[k] - old[k];
              } else {
                for (int64_t k = 0; k < len; ++k) {
                  const T delta = src[k] - old[k];
                  dst[k] = static_cast<T>(static_cast<Acc>(delta) * scale_acc);
                }
              }
            });
        if (streaming) StreamingFence();
      });
}

}  // namespace

template <typename T>
struct PackSegments<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx,
                          const std::vector<const T*>& srcs,
                          const std::vector<int64_t>& offsets,
                          const T* snapshot, T* out) {
    if (snapshot != nullptr) {
      ScaleSegments(ctx, srcs, offsets, snapshot, out,
                    std::vector<float>(offsets.size() - 1, 1.0f));
      return absl::OkStatus();
    }
    const bool streaming =
        offsets.back() * static_cast<int64_t>(sizeof(T)) >= kStreamingBytes;
    ParallelForBlocks(
        ctx, offsets.back(), sizeof(T), [&](int64_t begin, int64_t end) {
          ForEachSegmentPiece(
              offsets, begin, end, [&](size_t s, int64_t from, int64_t to) {
                CopyElements(out + from, srcs[s] + (from - offsets[s]),
                             to - from, streaming);
              });
          if (streaming) StreamingFence();
        });
    return absl::OkStatus();
  }
};

template <typename T>
struct UnpackSegments<CPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const T* buffer,
                          const std::vector<T*>& dsts,
                          const std::vector<int64_t>& offsets, bool add) {
    const bool streaming =
        offsets.back() * static_cast<int64_t>(sizeof(T)) >= kStreamingBytes;
    ParallelForBlocks(
        ctx, offsets.back(), sizeof(T), [&](int64_t begin, int64_t end) {
          ForEachSegmentPiece(
              offsets, begin, end, [&](size_t s, int64_t from, int64_t to) {
                T* __restrict__ dst = dsts[s] + (from - offsets[s]);
                const T* __restrict__ src = buffer + from;
                const int64_t len = to - from;
                if (!add) {
                  CopyElements(dst, src, len, streaming);
                  return;
                }
                for (int64_t k = 0; k < len; ++k) {
                  dst[k] += src[k];
                }
              });
          if (streaming) StreamingFence();
        });
    return absl::OkStatus();
  }
};

#if GOOGLE_CUDA
template <typename T>
struct PackSegments<GPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx,
                          const std::vector<const T*>& srcs,
                          const std::vector<int64_t>& offsets,
                          const T* snapshot, T* out) {
    if (offsets.back() == 0) return absl::OkStatus();
    std::vector<const void*> raw(srcs.begin(), srcs.end());
    return GpuStatus(
        geeps_gpu::PackSegments(GpuStream(ctx), GpuDType<T>::value, raw.data(),
                                offsets.data(), static_cast<int>(srcs.size()),
                                snapshot, out),
        "Pack");
  }
};

template <typename T>
struct UnpackSegments<GPUDevice, T> {
  absl::Status operator()(OpKernelContext* ctx, const T* buffer,
                          const std::vector<T*>& dsts,
                          const std::vector<int64_t>& offsets, bool add) {
    if (offsets.back() == 0) return absl::OkStatus();
    std::vector<void*> raw(dsts.begin(), dsts.end());
    return GpuStatus(geeps_gpu::UnpackSegments(
                         GpuStream(ctx), GpuDType<T>::value, buffer, raw.data(),
                         offsets.data(), static_cast<int>(dsts.size()), add),
                     "Unpack");
  }
};
#endif  // GOOGLE_CUDA

}  // namespace functor

namespace {

// Reads the `sizes` attr into offsets (sizes.size() + 1 prefix sums).
absl::Status LayoutOffsets(OpKernelConstruction* ctx,
                           std::vector<int64_t>* offsets) {
  std::vector<int64_t> sizes;
  TF_RETURN_IF_ERROR(ctx->GetAttr("sizes", &sizes));
  offsets->assign(1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sizes[", i, "] = ", sizes[i], " is negative"));
    }
    if (sizes[i] > std::numeric_limits<int64_t>::max() - offsets->back()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the layout's sizes add up to more than ",
          std::numeric_limits<int64_t>::max(), " elements (at sizes[", i,
          "] = ", sizes[i], ")"));
    }
    offsets->push_back(offsets->back() + sizes[i]);
  }
  return absl::OkStatus();
}

absl::Status CheckSegmentSize(int i, const TensorShape& shape,
                              const std::vector<int64_t>& offsets) {
  const int64_t size = offsets[i + 1] - offsets[i];
  if (shape.num_elements() != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("variable ", i, " has shape ", shape.DebugString(), " (",
                     shape.num_elements(),
                     " elements) but the layout gives it ", size, " elements"));
  }
  return absl::OkStatus();
}

absl::Status CheckBuffer(const Tensor& buffer, const char* what,
                         int64_t total) {
  if (!TensorShapeUtils::IsVector(buffer.shape()) ||
      buffer.NumElements() != total) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has shape ", buffer.shape().DebugString(),
                     " but the layout needs a vector of ", total, " elements"));
  }
  return absl::OkStatus();
}

// Checks every variable's dtype and element count against the layout
// (all of them, before any is touched).
template <typename T>
absl::Status CheckLayoutVariables(
    const std::vector<core::RefCountPtr<Var>>& vars,
    const std::vector<int64_t>& offsets) {
  for (size_t i = 0; i < vars.size(); ++i) {
    TF_RETURN_IF_ERROR(CheckVariable(vars[i].get(), DataTypeToEnum<T>::value,
                                     absl::StrCat("variable ", i)));
    TF_RETURN_IF_ERROR(CheckSegmentSize(static_cast<int>(i),
                                        vars[i]->tensor()->shape(), offsets));
  }
  return absl::OkStatus();
}

// Pack of resource variables (kResources) or of tensors, optionally minus a
// snapshot (kDelta).
template <typename Device, typename T, bool kResources, bool kDelta>
class PackOp : public OpKernel {
 public:
  explicit PackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, LayoutOffsets(ctx, &offsets_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int n = static_cast<int>(offsets_.size()) - 1;
    const int64_t total = offsets_.back();
    OP_REQUIRES(
        ctx, ctx->num_inputs() == n + (kDelta ? 1 : 0),
        absl::InvalidArgumentError(absl::StrCat(
            "the layout has ", n, " sizes but ",
            ctx->num_inputs() - (kDelta ? 1 : 0), " variables were given")));
    const T* snapshot = nullptr;
    if (kDelta) {
      const Tensor& snap = ctx->input(n);
      OP_REQUIRES_OK(ctx, CheckBuffer(snap, "snapshot", total));
      snapshot = Elements<T>(snap);
    }
    // Every input is checked against the layout before the output is
    // allocated: a layout that is not the inputs' fails naming the input,
    // not on the allocation of a buffer its sizes make up.
    std::vector<const T*> srcs(n);
    functor::PackSegments<Device, T> pack;
    if (!kResources) {
      for (int i = 0; i < n; ++i) {
        OP_REQUIRES_OK(ctx,
                       CheckSegmentSize(i, ctx->input(i).shape(), offsets_));
        srcs[i] = Elements<T>(ctx->input(i));
      }
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &out));
      OP_REQUIRES_OK(
          ctx, pack(ctx, srcs, offsets_, snapshot, out->flat<T>().data()));
      return;
    }
    std::vector<core::RefCountPtr<Var>> vars;
    OP_REQUIRES_OK(ctx, LookupVariables(ctx, 0, n, &vars));
    VariableListLock lock(vars, /*exclusive=*/false);
    OP_REQUIRES_OK(ctx, CheckLayoutVariables<T>(vars, offsets_));
    for (int i = 0; i < n; ++i) srcs[i] = Elements<T>(*vars[i]->tensor());
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &out));
    OP_REQUIRES_OK(ctx,
                   pack(ctx, srcs, offsets_, snapshot, out->flat<T>().data()));
  }

 private:
  std::vector<int64_t> offsets_;
};

template <typename Device, typename T>
class UnpackOp : public OpKernel {
 public:
  explicit UnpackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, LayoutOffsets(ctx, &offsets_));
    std::string mode;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("mode", &mode));
    add_ = mode == "add";
  }

  void Compute(OpKernelContext* ctx) override {
    const int n = static_cast<int>(offsets_.size()) - 1;
    OP_REQUIRES(ctx, ctx->num_inputs() == n + 1,
                absl::InvalidArgumentError(absl::StrCat(
                    "the layout has ", n, " sizes but ", ctx->num_inputs() - 1,
                    " variables were given")));
    const Tensor& buffer = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckBuffer(buffer, "buffer", offsets_.back()));
    std::vector<core::RefCountPtr<Var>> vars;
    OP_REQUIRES_OK(ctx, LookupVariables(ctx, 1, n, &vars));
    // Two segments writing one variable would race (and make no sense).
    std::unordered_map<Var*, int> position;
    for (int i = 0; i < n; ++i) {
      auto inserted = position.emplace(vars[i].get(), i);
      OP_REQUIRES(ctx, inserted.second,
                  absl::InvalidArgumentError(absl::StrCat(
                      "variables ", inserted.first->second, " and ", i,
                      " are the same variable; a layout may name each "
                      "variable once")));
    }
    VariableListLock lock(vars, /*exclusive=*/true);
    OP_REQUIRES_OK(ctx, CheckLayoutVariables<T>(vars, offsets_));
    std::vector<T*> dsts(n);
    for (int i = 0; i < n; ++i) {
      Var* var = vars[i].get();
      OP_REQUIRES_OK(ctx, PrepareToUpdate<Device>(ctx, var,
                                                  /*keep_contents=*/add_,
                                                  /*sparse=*/false));
      dsts[i] = MutableElements<T>(var->tensor());
    }
    OP_REQUIRES_OK(
        ctx, functor::UnpackSegments<Device, T>()(ctx, Elements<T>(buffer),
                                                  dsts, offsets_, add_));
  }

 private:
  std::vector<int64_t> offsets_;
  bool add_;
};

// The memory of `out`, an input that aliases caller memory (DLPack): the
// *Into ops write it by contract.
template <typename T>
T* CallerMemory(const Tensor& out) {
  return const_cast<T*>(Elements<T>(out));
}

// PackDeltaInto: (variables - snapshot) * scale written into `out`'s memory,
// which the caller owns (a host buffer shared with a co-located shard, seen
// by TensorFlow through DLPack). CPU only: the buffer is host memory.
template <typename T>
class PackDeltaIntoOp : public OpKernel {
 public:
  explicit PackDeltaIntoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, LayoutOffsets(ctx, &offsets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int n = static_cast<int>(offsets_.size()) - 1;
    const int64_t total = offsets_.back();
    OP_REQUIRES(ctx, ctx->num_inputs() == n + 2,
                absl::InvalidArgumentError(absl::StrCat(
                    "the layout has ", n, " sizes but ", ctx->num_inputs() - 2,
                    " variables were given")));
    const Tensor& snap = ctx->input(n);
    const Tensor& out = ctx->input(n + 1);
    OP_REQUIRES_OK(ctx, CheckBuffer(snap, "snapshot", total));
    OP_REQUIRES_OK(ctx, CheckBuffer(out, "out", total));
    std::vector<core::RefCountPtr<Var>> vars;
    OP_REQUIRES_OK(ctx, LookupVariables(ctx, 0, n, &vars));
    VariableListLock lock(vars, /*exclusive=*/false);
    OP_REQUIRES_OK(ctx, CheckLayoutVariables<T>(vars, offsets_));
    std::vector<const T*> srcs(n);
    for (int i = 0; i < n; ++i) srcs[i] = Elements<T>(*vars[i]->tensor());
    functor::ScaleSegments(ctx, srcs, offsets_, Elements<T>(snap),
                           CallerMemory<T>(out), std::vector<float>(n, scale_));
  }

 private:
  std::vector<int64_t> offsets_;
  float scale_;
};

#define GEEPS_REGISTER_INTO(T)                               \
  REGISTER_KERNEL_BUILDER(Name("Geeps>PackDeltaInto")        \
                              .Device(DEVICE_CPU)            \
                              .TypeConstraint<T>("dtype"),   \
                          PackDeltaIntoOp<T>);
GEEPS_REGISTER_INTO(float)
GEEPS_REGISTER_INTO(Eigen::half)
GEEPS_REGISTER_INTO(bfloat16)
GEEPS_REGISTER_INTO(double)
#undef GEEPS_REGISTER_INTO

// PackTensorsInto: N tensors, segment i times scales[i], written into `out`'s
// memory (as PackDeltaInto). A worker's captured optimizer update goes
// straight into memory a co-located shard reads. CPU only.
template <typename T, bool kBase>
class PackTensorsIntoOp : public OpKernel {
 public:
  explicit PackTensorsIntoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, LayoutOffsets(ctx, &offsets_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int n = static_cast<int>(offsets_.size()) - 1;
    const int extra = kBase ? 3 : 2;  // scales, [base,] out
    OP_REQUIRES(ctx, ctx->num_inputs() == n + extra,
                absl::InvalidArgumentError(absl::StrCat(
                    "the layout has ", n, " sizes but ",
                    ctx->num_inputs() - extra, " tensors were given")));
    const Tensor& scales = ctx->input(n);
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(scales.shape()) &&
                    scales.NumElements() == n,
                absl::InvalidArgumentError(absl::StrCat(
                    "scales has shape ", scales.shape().DebugString(),
                    ", the layout has ", n, " segments")));
    const T* base = nullptr;
    if (kBase) {
      OP_REQUIRES_OK(ctx, CheckBuffer(ctx->input(n + 1), "base",
                                      offsets_.back()));
      base = Elements<T>(ctx->input(n + 1));
    }
    const Tensor& out = ctx->input(n + extra - 1);
    OP_REQUIRES_OK(ctx, CheckBuffer(out, "out", offsets_.back()));
    std::vector<const T*> srcs(n);
    for (int i = 0; i < n; ++i) {
      OP_REQUIRES_OK(ctx, CheckSegmentSize(i, ctx->input(i).shape(), offsets_));
      srcs[i] = Elements<T>(ctx->input(i));
    }
    const float* scale_values = Elements<float>(scales);
    functor::ScaleSegments<T>(
        ctx, srcs, offsets_, base, CallerMemory<T>(out),
        std::vector<float>(scale_values, scale_values + n),
        /*add_to_snapshot=*/kBase);
  }

 private:
  std::vector<int64_t> offsets_;
};

#define GEEPS_REGISTER_TENSORS_INTO(T)                       \
  REGISTER_KERNEL_BUILDER(Name("Geeps>PackTensorsInto")      \
                              .Device(DEVICE_CPU)            \
                              .HostMemory("scales")          \
                              .TypeConstraint<T>("dtype"),   \
                          PackTensorsIntoOp<T, false>);      \
  REGISTER_KERNEL_BUILDER(Name("Geeps>PackTensorsOntoBaseInto") \
                              .Device(DEVICE_CPU)            \
                              .HostMemory("scales")          \
                              .TypeConstraint<T>("dtype"),   \
                          PackTensorsIntoOp<T, true>);
GEEPS_REGISTER_TENSORS_INTO(float)
GEEPS_REGISTER_TENSORS_INTO(Eigen::half)
GEEPS_REGISTER_TENSORS_INTO(bfloat16)
GEEPS_REGISTER_TENSORS_INTO(double)
#undef GEEPS_REGISTER_TENSORS_INTO

}  // namespace

#define GEEPS_REGISTER(DEV, DEVICE, T)                                       \
  REGISTER_KERNEL_BUILDER(Name("Geeps>Pack")                                 \
                              .Device(DEV)                                   \
                              .HostMemory("resources")                       \
                              .TypeConstraint<T>("dtype"),                   \
                          PackOp<DEVICE, T, true, false>);                   \
  REGISTER_KERNEL_BUILDER(Name("Geeps>PackDelta")                            \
                              .Device(DEV)                                   \
                              .HostMemory("resources")                       \
                              .TypeConstraint<T>("dtype"),                   \
                          PackOp<DEVICE, T, true, true>);                    \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("Geeps>PackTensors").Device(DEV).TypeConstraint<T>("dtype"),      \
      PackOp<DEVICE, T, false, false>);                                      \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("Geeps>PackTensorsDelta").Device(DEV).TypeConstraint<T>("dtype"), \
      PackOp<DEVICE, T, false, true>);                                       \
  REGISTER_KERNEL_BUILDER(Name("Geeps>Unpack")                               \
                              .Device(DEV)                                   \
                              .HostMemory("resources")                       \
                              .TypeConstraint<T>("dtype"),                   \
                          UnpackOp<DEVICE, T>);

#define GEEPS_REGISTER_ALL(DEV, DEVICE)    \
  GEEPS_REGISTER(DEV, DEVICE, float)       \
  GEEPS_REGISTER(DEV, DEVICE, Eigen::half) \
  GEEPS_REGISTER(DEV, DEVICE, bfloat16)    \
  GEEPS_REGISTER(DEV, DEVICE, double)

GEEPS_REGISTER_ALL(DEVICE_CPU, CPUDevice)
#if GOOGLE_CUDA
GEEPS_REGISTER_ALL(DEVICE_GPU, GPUDevice)
#endif

#undef GEEPS_REGISTER_ALL
#undef GEEPS_REGISTER

}  // namespace geeps
}  // namespace tensorflow
