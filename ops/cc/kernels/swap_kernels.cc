// Kernels of SwapOut and SwapIn.
//
// On a GPU both are AsyncOpKernels that hand the copy to the device context,
// which runs it on TensorFlow's device<->host copy streams (ordered after the
// compute stream's pending work) and calls back when it is done: the executor
// keeps running other ops meanwhile, so a swap overlaps compute. SwapOut's
// output is pinned host memory (on_host + gpu_compatible), which is what lets
// the copy run asynchronously at full speed. On the CPU both are an honest
// copy into a fresh host buffer.

#include "absl/strings/str_cat.h"
#include "common.h"
#include "tensorflow/core/common_runtime/device.h"

namespace tensorflow {
namespace geeps {
namespace {

class HostCopyOp : public OpKernel {
 public:
  explicit HostCopyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, input.shape(), &output));
    ParallelMemcpy(ctx, output->data(), input.data(), input.TotalBytes());
  }
};

#define GEEPS_REGISTER_CPU(T)                                          \
  REGISTER_KERNEL_BUILDER(                                             \
      Name("Geeps>SwapOut").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      HostCopyOp);                                                     \
  REGISTER_KERNEL_BUILDER(                                             \
      Name("Geeps>SwapIn").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
      HostCopyOp);

GEEPS_REGISTER_CPU(float)
GEEPS_REGISTER_CPU(Eigen::half)
GEEPS_REGISTER_CPU(bfloat16)
GEEPS_REGISTER_CPU(double)
GEEPS_REGISTER_CPU(int32_t)
GEEPS_REGISTER_CPU(int64_t)
GEEPS_REGISTER_CPU(uint8_t)
#undef GEEPS_REGISTER_CPU

#if GOOGLE_CUDA

class SwapOutGpuOp : public AsyncOpKernel {
 public:
  explicit SwapOutGpuOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    AllocatorAttributes pinned;
    pinned.set_on_host(true);
    pinned.set_gpu_compatible(true);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ctx->allocate_output(0, input.shape(), &output, pinned), done);
    if (input.NumElements() == 0) {
      done();
      return;
    }
    DeviceContext* device_context = ctx->op_device_context();
    OP_REQUIRES_ASYNC(ctx, device_context != nullptr,
                      absl::InternalError(absl::StrCat(
                          "SwapOut: the GPU has no device context")),
                      done);
    device_context->CopyDeviceTensorToCPU(
        &input, "geeps_swap_out", static_cast<Device*>(ctx->device()), output,
        [ctx, done](const absl::Status& status) {
          ctx->SetStatus(status);
          done();
        });
  }
};

class SwapInGpuOp : public AsyncOpKernel {
 public:
  explicit SwapInGpuOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, input.shape(), &output),
                         done);
    if (input.NumElements() == 0) {
      done();
      return;
    }
    DeviceContext* device_context = ctx->op_device_context();
    OP_REQUIRES_ASYNC(ctx, device_context != nullptr,
                      absl::InternalError(absl::StrCat(
                          "SwapIn: the GPU has no device context")),
                      done);
    device_context->CopyCPUTensorToDevice(
        &input, static_cast<Device*>(ctx->device()), output,
        [ctx, done](const absl::Status& status) {
          ctx->SetStatus(status);
          done();
        });
  }
};

#define GEEPS_REGISTER_GPU(T)                          \
  REGISTER_KERNEL_BUILDER(Name("Geeps>SwapOut")        \
                              .Device(DEVICE_GPU)      \
                              .HostMemory("output")    \
                              .TypeConstraint<T>("T"), \
                          SwapOutGpuOp);               \
  REGISTER_KERNEL_BUILDER(Name("Geeps>SwapIn")         \
                              .Device(DEVICE_GPU)      \
                              .HostMemory("input")     \
                              .TypeConstraint<T>("T"), \
                          SwapInGpuOp);

// int32 is left out on purpose: TensorFlow keeps int32 tensors of GPU ops in
// host memory, so a GPU swap of one would copy host to host.
GEEPS_REGISTER_GPU(float)
GEEPS_REGISTER_GPU(Eigen::half)
GEEPS_REGISTER_GPU(bfloat16)
GEEPS_REGISTER_GPU(double)
GEEPS_REGISTER_GPU(int64_t)
GEEPS_REGISTER_GPU(uint8_t)
#undef GEEPS_REGISTER_GPU

#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace geeps
}  // namespace tensorflow
