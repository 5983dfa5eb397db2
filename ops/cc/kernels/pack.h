// Functors behind Pack and Unpack, templated on Device and the data type T.
// A layout is `offsets` (num + 1 entries): segment i of the 1-D buffer is
// [offsets[i], offsets[i + 1]) and mirrors the i-th variable's elements.

#ifndef KERAS_GEEPS_OPS_CC_KERNELS_PACK_H_
#define KERAS_GEEPS_OPS_CC_KERNELS_PACK_H_

#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"

namespace tensorflow {
namespace geeps {
namespace functor {

// out[offsets[i] + k] = srcs[i][k], minus snapshot[offsets[i] + k] when
// snapshot is not null.
template <typename Device, typename T>
struct PackSegments {
  absl::Status operator()(OpKernelContext* ctx,
                          const std::vector<const T*>& srcs,
                          const std::vector<int64_t>& offsets,
                          const T* snapshot, T* out);
};

// dsts[i][k] = buffer[offsets[i] + k], or += when `add`. The dsts must not
// overlap.
template <typename Device, typename T>
struct UnpackSegments {
  absl::Status operator()(OpKernelContext* ctx, const T* buffer,
                          const std::vector<T*>& dsts,
                          const std::vector<int64_t>& offsets, bool add);
};

}  // namespace functor
}  // namespace geeps
}  // namespace tensorflow

#endif  // KERAS_GEEPS_OPS_CC_KERNELS_PACK_H_
