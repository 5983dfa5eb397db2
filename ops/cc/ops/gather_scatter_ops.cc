// Registration and shape functions of the row gather / scatter-add ops.
//
// A GeePS table is a [rows, width] matrix; every access names a batch of
// rows through a pre-built index list, so one access is one kernel launch.

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace geeps {
namespace {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// Width of the variable behind resource input `input`, taken from the
// handle's shape data when the graph knows it (unknown otherwise). Checks the
// variable is a matrix of `dtype`.
absl::Status VariableWidth(InferenceContext* c, int input, DataType dtype,
                           DimensionHandle* width) {
  *width = c->UnknownDim();
  const auto* handle_data = c->input_handle_shapes_and_types(input);
  if (handle_data == nullptr || handle_data->empty()) return absl::OkStatus();
  const auto& shape_and_type = (*handle_data)[0];
  if (shape_and_type.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the variable has dtype ", DataTypeString(shape_and_type.dtype),
        " but the op was given dtype ", DataTypeString(dtype)));
  }
  ShapeHandle var_shape;
  TF_RETURN_IF_ERROR(c->WithRank(shape_and_type.shape, 2, &var_shape));
  *width = c->Dim(var_shape, 1);
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("Geeps>GatherRows")
    .Input("params: T")
    .Input("indices: Tindices")
    .Output("output: T")
    .Attr("T: {float, half, bfloat16, double}")
    .Attr("Tindices: {int32, int64}")
    .Attr("check_indices: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle params, indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &params));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      c->set_output(0, c->Matrix(c->Dim(indices, 0), c->Dim(params, 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Gathers whole rows of a matrix: output[i, :] = params[indices[i], :].

Fails with InvalidArgument naming the first index outside [0, rows). On a GPU
with check_indices=false the check (which waits for the device) is skipped:
rows of such indices come out as zeros, as in TF's own GPU gather. On the CPU
indices are always checked.
)doc");

REGISTER_OP("Geeps>ResourceGatherRows")
    .Input("resource: resource")
    .Input("indices: Tindices")
    .Output("output: dtype")
    .Attr("dtype: {float, half, bfloat16, double}")
    .Attr("Tindices: {int32, int64}")
    .Attr("check_indices: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused, indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      DataType dtype;
      TF_RETURN_IF_ERROR(c->GetAttr("dtype", &dtype));
      DimensionHandle width;
      TF_RETURN_IF_ERROR(VariableWidth(c, 0, dtype, &width));
      c->set_output(0, c->Matrix(c->Dim(indices, 0), width));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Gathers whole rows of a [rows, width] resource variable under its read lock.
check_indices as for GatherRows.
)doc");

REGISTER_OP("Geeps>ResourceScatterAddRows")
    .Input("resource: resource")
    .Input("indices: Tindices")
    .Input("updates: dtype")
    .Attr("dtype: {float, half, bfloat16, double}")
    .Attr("Tindices: {int32, int64}")
    .Attr("check_indices: bool = true")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused, indices, updates;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &updates));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(indices, 0), c->Dim(updates, 0), &n));
      DataType dtype;
      TF_RETURN_IF_ERROR(c->GetAttr("dtype", &dtype));
      DimensionHandle width;
      TF_RETURN_IF_ERROR(VariableWidth(c, 0, dtype, &width));
      TF_RETURN_IF_ERROR(c->Merge(width, c->Dim(updates, 1), &width));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Adds updates[i, :] into row indices[i] of a [rows, width] resource variable,
in place under the variable's lock. Duplicate indices accumulate. Every index
is checked before anything is written; on a GPU with check_indices=false the
check (which waits for the device) is skipped and rows of out-of-range indices
are not added, as in TF's own GPU scatters. On the CPU indices are always
checked.
)doc");

}  // namespace geeps
}  // namespace tensorflow
