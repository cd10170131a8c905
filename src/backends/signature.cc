// What a backend takes and gives, from its weights' metadata alone. Kept
// apart from the math so that the server can check configs against
// checkpoints without linking any backend (workers are exec'd).
#include "backends/backend.h"
#include "backends/model_weights.h"

namespace hearth {

uint64_t IoSpec::bytes_per_sample() const {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : dims) n *= static_cast<uint64_t>(d);
  return n;
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
