// Registration and shape functions of Pack / Unpack.
//
// Pack copies a list of variables into one contiguous 1-D buffer following a
// layout built once (`sizes`; segment i starts at sizes[0] + ... + sizes[i-1]),
// so a whole model's parameters or updates travel as one transfer. Unpack is
// the way back, assigning or adding the buffer into the variables.

#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace geeps {
namespace {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// Reads the layout's sizes and their total; rejects a layout whose length is
// not N or that holds a negative size.
absl::Status LayoutSizes(InferenceContext* c, std::vector<int64_t>* sizes,
                         int64_t* total) {
  TF_RETURN_IF_ERROR(c->GetAttr("sizes", sizes));
  int64_t n;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  if (static_cast<int64_t>(sizes->size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("the layout has ",
                                                   sizes->size(), " sizes but ",
                                                   n, " variables were given"));
  }
  *total = 0;
  for (size_t i = 0; i < sizes->size(); ++i) {
    if ((*sizes)[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sizes[", i, "] = ", (*sizes)[i], " is negative"));
    }
    if ((*sizes)[i] > std::numeric_limits<int64_t>::max() - *total) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the layout's sizes add up to more than ",
          std::numeric_limits<int64_t>::max(), " elements (at sizes[", i,
          "] = ", (*sizes)[i], ")"));
    }
    *total += (*sizes)[i];
  }
  return absl::OkStatus();
}

// Checks that what the graph knows of segment i's shape (from a resource
// handle's shape data or a tensor's static shape) holds sizes[i] elements.
absl::Status CheckSegment(InferenceContext* c, int i, ShapeHandle shape,
                          int64_t size) {
  if (!c->FullyDefined(shape)) return absl::OkStatus();
  const int64_t n = c->Value(c->NumElements(shape));
  if (n != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "variable ", i, " has shape ", c->DebugString(shape), " (", n,
        " elements) but the layout gives it ", size, " elements"));
  }
  return absl::OkStatus();
}

// Checks that input i is a vector of `length` elements, as far as known.
absl::Status CheckVectorInput(InferenceContext* c, int i, int64_t length) {
  ShapeHandle vector;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &vector));
  return c->Merge(vector, c->Vector(length), &vector);
}

// Shape function of the PackTensors*Into ops: N values, their scales, then
// `buffers` vectors of the layout's total size.
absl::Status PackTensorsIntoShape(InferenceContext* c, int buffers) {
  std::vector<int64_t> sizes;
  int64_t total;
  TF_RETURN_IF_ERROR(LayoutSizes(c, &sizes, &total));
  const int n = static_cast<int>(sizes.size());
  for (int i = 0; i < n; ++i) {
    TF_RETURN_IF_ERROR(CheckSegment(c, i, c->input(i), sizes[i]));
  }
  TF_RETURN_IF_ERROR(CheckVectorInput(c, n, n));  // scales
  for (int i = 1; i <= buffers; ++i) {
    TF_RETURN_IF_ERROR(CheckVectorInput(c, n + i, total));
  }
  return absl::OkStatus();
}

// Shape function shared by the four pack ops. The N values (resource handles
// or tensors) come first; a snapshot, when `delta`, follows them.
absl::Status PackShape(InferenceContext* c, bool resources, bool delta) {
  std::vector<int64_t> sizes;
  int64_t total;
  TF_RETURN_IF_ERROR(LayoutSizes(c, &sizes, &total));
  DataType dtype;
  TF_RETURN_IF_ERROR(c->GetAttr("dtype", &dtype));
  const int n = static_cast<int>(sizes.size());
  for (int i = 0; i < n; ++i) {
    if (resources) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      const auto* handle_data = c->input_handle_shapes_and_types(i);
      if (handle_data != nullptr && !handle_data->empty()) {
        if ((*handle_data)[0].dtype != dtype) {
          return absl::InvalidArgumentError(
              absl::StrCat("variable ", i, " has dtype ",
                           DataTypeString((*handle_data)[0].dtype),
                           " but the layout is ", DataTypeString(dtype)));
        }
        TF_RETURN_IF_ERROR(
            CheckSegment(c, i, (*handle_data)[0].shape, sizes[i]));
      }
    } else {
      TF_RETURN_IF_ERROR(CheckSegment(c, i, c->input(i), sizes[i]));
    }
  }
  ShapeHandle out = c->Vector(total);
  if (delta) {
    ShapeHandle snapshot;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(n), 1, &snapshot));
    TF_RETURN_IF_ERROR(c->Merge(snapshot, out, &out));
  }
  c->set_output(0, out);
  return absl::OkStatus();
}

}  // namespace

#define GEEPS_PACK_ATTRS                              \
  Attr("N: int >= 0")                                 \
      .Attr("dtype: {float, half, bfloat16, double}") \
      .Attr("sizes: list(int) >= 0")

REGISTER_OP("Geeps>Pack")
    .Input("resources: N * resource")
    .Output("buffer: dtype")
    .GEEPS_PACK_ATTRS
    .SetShapeFn([](InferenceContext* c) { return PackShape(c, true, false); })
    .Doc(R"doc(
Copies N resource variables into one 1-D buffer laid out by `sizes`.
)doc");

REGISTER_OP("Geeps>PackDelta")
    .Input("resources: N * resource")
    .Input("snapshot: dtype")
    .Output("buffer: dtype")
    .GEEPS_PACK_ATTRS
    .SetShapeFn([](InferenceContext* c) { return PackShape(c, true, true); })
    .Doc(R"doc(
Packs N resource variables minus a packed snapshot: the update since then.
)doc");

REGISTER_OP("Geeps>PackTensors")
    .Input("values: N * dtype")
    .Output("buffer: dtype")
    .GEEPS_PACK_ATTRS
    .SetShapeFn([](InferenceContext* c) { return PackShape(c, false, false); })
    .Doc(R"doc(
Copies N tensors into one 1-D buffer laid out by `sizes`.
)doc");

REGISTER_OP("Geeps>PackTensorsDelta")
    .Input("values: N * dtype")
    .Input("snapshot: dtype")
    .Output("buffer: dtype")
    .GEEPS_PACK_ATTRS
    .SetShapeFn([](InferenceContext* c) { return PackShape(c, false, true); })
    .Doc(R"doc(
Packs N tensors minus a packed snapshot.
)doc");

REGISTER_OP("Geeps>Unpack")
    .Input("buffer: dtype")
    .Input("resources: N * resource")
    .GEEPS_PACK_ATTRS.Attr("mode: {'assign', 'add'} = 'assign'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int64_t> sizes;
      int64_t total;
      TF_RETURN_IF_ERROR(LayoutSizes(c, &sizes, &total));
      TF_RETURN_IF_ERROR(CheckVectorInput(c, 0, total));
      for (int i = 1; i < c->num_inputs(); ++i) {
        ShapeHandle unused;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Writes a packed 1-D buffer back into N resource variables, in place under
their locks: `assign` overwrites them, `add` adds the buffer into them.
)doc");

REGISTER_OP("Geeps>PackDeltaInto")
    .Input("resources: N * resource")
    .Input("snapshot: dtype")
    .Input("out: dtype")
    .GEEPS_PACK_ATTRS.Attr("scale: float = 1.0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int64_t> sizes;
      int64_t total;
      TF_RETURN_IF_ERROR(LayoutSizes(c, &sizes, &total));
      const int n = static_cast<int>(sizes.size());
      TF_RETURN_IF_ERROR(CheckVectorInput(c, n, total));      // snapshot
      return CheckVectorInput(c, n + 1, total);                // out
    })
    .Doc(R"doc(
Writes (N resource variables - snapshot) * scale into the memory of `out`,
a host buffer the caller owns and shares with TensorFlow (CPU only). Lets a
worker put its update straight into memory a co-located shard reads.
)doc");

REGISTER_OP("Geeps>PackTensorsInto")
    .Input("values: N * dtype")
    .Input("scales: float")
    .Input("out: dtype")
    .GEEPS_PACK_ATTRS
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      return PackTensorsIntoShape(c, /*buffers=*/1);  // out
    })
    .Doc(R"doc(
Writes N tensors, segment i times scales[i], into the memory of `out`, a host
buffer the caller owns and shares with TensorFlow (CPU only). Lets a worker
put an optimizer's captured update straight into memory a co-located shard
reads. The scales are an input, not an attribute, so that new values never
instantiate a new kernel.
)doc");

REGISTER_OP("Geeps>PackTensorsOntoBaseInto")
    .Input("values: N * dtype")
    .Input("scales: float")
    .Input("base: dtype")
    .Input("out: dtype")
    .GEEPS_PACK_ATTRS
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      return PackTensorsIntoShape(c, /*buffers=*/2);  // base, out
    })
    .Doc(R"doc(
PackTensorsInto plus a packed `base`: writes base + values[i] * scales[i]
into the memory of `out`. A table's only writer puts its new rows (the rows
it pulled plus its update) straight into the buffer its shard lent it.
)doc");

#undef GEEPS_PACK_ATTRS

}  // namespace geeps
}  // namespace tensorflow
