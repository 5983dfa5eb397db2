// Registration of SwapOut / SwapIn: move a tensor to host memory and back.
//
// GeePS keeps what does not fit on the GPU in pinned host memory and stages it
// in ahead of use; these ops are the two copies. On a GPU they run on TF's
// device<->host copy streams, so a prefetch overlaps compute. On the CPU they
// are plain copies into a fresh buffer.

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"

namespace tensorflow {
namespace geeps {

REGISTER_OP("Geeps>SwapOut")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: {float, half, bfloat16, double, int32, int64, uint8}")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
Copies a tensor into (pinned, on a GPU) host memory.
)doc");

REGISTER_OP("Geeps>SwapIn")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: {float, half, bfloat16, double, int32, int64, uint8}")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
Copies a host tensor into the memory of the device the op runs on.
)doc");

}  // namespace geeps
}  // namespace tensorflow
