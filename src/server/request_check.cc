#include "server/request_check.h"

#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "common/datatype.h"
#include "hearth/dtype.h"

namespace hearth {
namespace {

std::string Quote(std::string_view text) {
  return nlohmann::json(std::string(text))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string DatatypeString(DType dtype) {
  std::string_view name = KserveDatatypeName(dtype);
  return name.empty() ? std::string(DTypeName(dtype)) : std::string(name);
}

std::string InputLabel(std::string_view name) { return "input " + Quote(name); }

const TensorMetadata* FindTensor(const std::vector<TensorMetadata>& tensors,
                                 const std::string& name) {
  for (const TensorMetadata& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

}  // namespace

Status ValidateInferRequest(const InferRequest& request, const ModelMetadata& metadata) {
  const std::string model = Quote(metadata.name);
  std::set<std::string> seen;
  std::optional<int64_t> batch;
  std::string batch_input;
  for (const InferTensor& input : request.inputs) {
    const std::string label = InputLabel(input.name);
    if (!seen.insert(input.name).second) return InvalidArgument("duplicate " + label);
    const TensorMetadata* expected = FindTensor(metadata.inputs, input.name);
    if (expected == nullptr) return InvalidArgument("unknown " + label + " for model " + model);
    if (input.dtype != expected->dtype) {
      return InvalidArgument(label + ": datatype " + DatatypeString(input.dtype) +
                             " does not match the model's " + DatatypeString(expected->dtype));
    }
    const bool batched = metadata.max_batch_size > 0;
    // With batching the model's shape starts with -1 for the batch.
    const size_t skip = batched ? 1 : 0;
    const bool rank_ok =
        expected->shape.size() >= skip && input.shape.size() == expected->shape.size();
    bool dims_ok = rank_ok;
    for (size_t d = skip; dims_ok && d < input.shape.size(); ++d) {
      dims_ok = expected->shape[d] < 0 || expected->shape[d] == input.shape[d];
    }
    if (!dims_ok) {
      return InvalidArgument(label + ": shape " + ShapeString(input.shape) +
                             " does not match the model's " + ShapeString(expected->shape));
    }
    if (batched) {
      const int64_t n = input.shape[0];
      if (n < 1) return InvalidArgument(label + ": batch of " + std::to_string(n) + " is empty");
      if (n > metadata.max_batch_size) {
        return InvalidArgument(label + ": batch of " + std::to_string(n) +
                               " exceeds max_batch_size " +
                               std::to_string(metadata.max_batch_size));
      }
      if (!batch.has_value()) {
        batch = n;
        batch_input = input.name;
      } else if (*batch != n) {
        return InvalidArgument("inputs disagree on the batch size: " + InputLabel(batch_input) +
                               " has " + std::to_string(*batch) + ", " + label + " has " +
                               std::to_string(n));
      }
    }
  }
  for (const TensorMetadata& expected : metadata.inputs) {
    if (seen.count(expected.name) == 0) {
      return InvalidArgument("missing " + InputLabel(expected.name) + " for model " + model);
    }
  }
  std::set<std::string> requested;
  for (const RequestedOutput& output : request.outputs) {
    if (FindTensor(metadata.outputs, output.name) == nullptr) {
      return InvalidArgument("unknown output " + Quote(output.name) + " requested from model " +
                             model);
    }
    if (!requested.insert(output.name).second) {
      return InvalidArgument("output " + Quote(output.name) + " is requested twice");
    }
  }
  return Status::Ok();
}

}  // namespace hearth
