// What a backend takes and gives, from its weights' metadata alone. Kept
// apart from the math so that the server can check configs against
// checkpoints without linking any backend (workers are exec'd).
#include "backends/backend.h"
#include "backends/model_weights.h"
#include "common/checked_size.h"

namespace hearth {

Result<uint64_t> IoSpec::bytes_per_sample() const {
  return ShapeBytes(dtype, dims, "'" + name + "'");
}

Result<std::pair<std::vector<IoSpec>, std::vector<IoSpec>>> BackendSignature(
    std::string_view kind, const std::vector<TensorView>& weights) {
  if (kind == "mlp") {
    ASSIGN_OR_RETURN(MlpWeights w, ValidateMlpWeights(weights));
    return std::pair{MlpInputs(w), MlpOutputs(w)};
  }
  if (kind == "scale") {
    ASSIGN_OR_RETURN(ScaleWeights w, ValidateScaleWeights(weights));
    return std::pair{ScaleInputs(w), ScaleOutputs()};
  }
  return InvalidArgument("unknown backend kind '" + std::string(kind) + "' (known: mlp, scale)");
}

}  // namespace hearth
