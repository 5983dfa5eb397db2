// Functors behind GatherRows and ScatterAddRows, templated on Device, the
// data type T and the index type. CPU specialisations live in
// gather_scatter_kernels.cc; GPU ones (there too, under GOOGLE_CUDA) call the
// launchers of gather_scatter_gpu.cu.cc.

#ifndef KERAS_GEEPS_OPS_CC_KERNELS_GATHER_SCATTER_H_
#define KERAS_GEEPS_OPS_CC_KERNELS_GATHER_SCATTER_H_

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_types.h"

namespace tensorflow {
namespace geeps {
namespace functor {

// out[i, :] = params[indices[i], :]. Checks every index first and fails with
// InvalidArgument naming the first one outside [0, rows). The GPU one skips
// that check (which waits for the device) when `check_indices` is false, and
// then zero-fills the rows of out-of-range indices; the CPU one always checks
// (it would read out of bounds otherwise).
template <typename Device, typename T, typename Index>
struct GatherRows {
  absl::Status operator()(OpKernelContext* ctx,
                          typename TTypes<T>::ConstMatrix params,
                          typename TTypes<Index>::ConstFlat indices,
                          typename TTypes<T>::Matrix out, bool check_indices);
};

// params[indices[i], :] += updates[i, :]; duplicate indices accumulate. Checks
// every index before writing anything, so a bad index leaves params as it was.
// `check_indices` as for GatherRows (unchecked on a GPU, out-of-range rows
// are not added).
template <typename Device, typename T, typename Index>
struct ScatterAddRows {
  absl::Status operator()(OpKernelContext* ctx,
                          typename TTypes<T>::Matrix params,
                          typename TTypes<Index>::ConstFlat indices,
                          typename TTypes<T>::ConstMatrix updates,
                          bool check_indices);
};

}  // namespace functor
}  // namespace geeps
}  // namespace tensorflow

#endif  // KERAS_GEEPS_OPS_CC_KERNELS_GATHER_SCATTER_H_
