#include "backends/model_weights.h"

#include <cstdint>
#include <limits>
#include <string>

namespace hearth {
namespace {

// Dimensions go to BLAS as 32-bit ints (OpenBLAS LP64) and to CUDA kernels as
// grid sizes; bigger models are rejected rather than silently truncated.
constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();

Result<const TensorView*> Find(const std::vector<TensorView>& weights, std::string_view name) {
  const TensorView* found = nullptr;
  for (const TensorView& t : weights) {
    if (t.name != name) continue;
    if (found != nullptr)
      return InvalidArgument("tensor '" + std::string(name) + "' appears twice");
    found = &t;
  }
  if (found == nullptr) return NotFound("missing tensor '" + std::string(name) + "'");
  return found;
}

// Checks rank, every dimension in (0, kMaxDim], byte size and data pointer;
// `expected` entries of 0 are free (taken from the tensor).
Status CheckShape(const TensorView& t, const std::vector<int64_t>& expected) {
  bool match = t.shape.size() == expected.size();
  for (size_t i = 0; match && i < expected.size(); ++i) {
    match =
        t.shape[i] > 0 && t.shape[i] <= kMaxDim && (expected[i] == 0 || t.shape[i] == expected[i]);
  }
  if (!match) {
    std::string want = "[";
    for (size_t i = 0; i < expected.size(); ++i) {
      want +=
          (i > 0 ? "," : "") + (expected[i] == 0 ? std::string("*") : std::to_string(expected[i]));
    }
    return InvalidArgument("tensor '" + t.name + "': expected shape " + want + "], got " +
                           ShapeString(t.shape));
  }
  uint64_t bytes = DTypeSize(t.dtype);
  for (int64_t d : t.shape)
    bytes *= static_cast<uint64_t>(d);  // < 2^62 * 8 by kMaxDim and rank <= 2
  if (t.nbytes != bytes) {
    return InvalidArgument("tensor '" + t.name + "': " + std::to_string(t.nbytes) +
                           " bytes, expected " + std::to_string(bytes) + " for " +
                           std::string(DTypeName(t.dtype)) + ShapeString(t.shape));
  }
  return Status::Ok();
}

Status CheckDType(const TensorView& t, DType expected) {
  if (t.dtype == expected) return Status::Ok();
  return InvalidArgument("tensor '" + t.name + "': expected dtype " +
                         std::string(DTypeName(expected)) + ", got " +
                         std::string(DTypeName(t.dtype)));
}

}  // namespace

Result<MlpWeights> ValidateMlpWeights(const std::vector<TensorView>& weights) {
  MlpWeights w;
  ASSIGN_OR_RETURN(w.encoder_weight, Find(weights, "encoder.weight"));
  ASSIGN_OR_RETURN(w.encoder_bias, Find(weights, "encoder.bias"));
  ASSIGN_OR_RETURN(w.head_weight, Find(weights, "head.weight"));
  ASSIGN_OR_RETURN(w.head_bias, Find(weights, "head.bias"));

  w.dtype = w.encoder_weight->dtype;
  if (w.dtype != DType::kF32 && w.dtype != DType::kF16 && w.dtype != DType::kBF16) {
    return InvalidArgument("tensor 'encoder.weight': expected dtype F32, F16 or BF16, got " +
                           std::string(DTypeName(w.dtype)));
  }
  for (const TensorView* t : {w.encoder_bias, w.head_weight, w.head_bias}) {
    RETURN_IF_ERROR(
        CheckDType(*t, w.dtype).WithContext("all mlp weights must share encoder.weight's dtype"));
  }
  RETURN_IF_ERROR(CheckShape(*w.encoder_weight, {0, 0}));
  w.hidden = w.encoder_weight->shape[0];
  w.in = w.encoder_weight->shape[1];
  RETURN_IF_ERROR(CheckShape(*w.encoder_bias, {w.hidden}));
  RETURN_IF_ERROR(CheckShape(*w.head_weight, {0, w.hidden}));
  w.out = w.head_weight->shape[0];
  RETURN_IF_ERROR(CheckShape(*w.head_bias, {w.out}));
  return w;
}

Result<ScaleWeights> ValidateScaleWeights(const std::vector<TensorView>& weights) {
  ScaleWeights w;
  ASSIGN_OR_RETURN(w.weight, Find(weights, "weight"));
  RETURN_IF_ERROR(CheckDType(*w.weight, DType::kF32));
  RETURN_IF_ERROR(CheckShape(*w.weight, {0}));
  w.n = w.weight->shape[0];
  return w;
}

std::vector<IoSpec> MlpInputs(const MlpWeights& w) { return {{"input", DType::kF32, {w.in}}}; }

std::vector<IoSpec> MlpOutputs(const MlpWeights& w) {
  return {{"logits", DType::kF32, {w.out}}, {"argmax", DType::kI64, {1}}};
}

std::vector<IoSpec> ScaleInputs(const ScaleWeights& w) { return {{"x", DType::kF32, {w.n}}}; }
std::vector<IoSpec> ScaleOutputs() { return {{"y", DType::kF32, {1}}}; }

Status CheckWeightsDevice(const std::vector<TensorView>& weights, Device device) {
  for (const TensorView& t : weights) {
    if (t.device != device) {
      return InvalidArgument("tensor '" + t.name + "' is on " + t.device.ToString() +
                             ", but the backend runs on " + device.ToString());
    }
  }
  return Status::Ok();
}

}  // namespace hearth
