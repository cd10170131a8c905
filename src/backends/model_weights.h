// The weights of the built-in backends, checked once (names, dtypes, shapes,
// sizes) before any backend touches them. Shared by the CPU backends and the
// CUDA library, so both accept exactly the same checkpoints.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "backends/backend.h"
#include "hearth/attach.h"
#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

// Views into the caller's tensors; valid while they are.
struct MlpWeights {
  int64_t in = 0, hidden = 0, out = 0;
  DType dtype = DType::kF32;                   // F32, F16 or BF16, the same for all four
  const TensorView* encoder_weight = nullptr;  // [hidden, in]
  const TensorView* encoder_bias = nullptr;    // [hidden]
  const TensorView* head_weight = nullptr;     // [out, hidden]
  const TensorView* head_bias = nullptr;       // [out]
};

struct ScaleWeights {
  int64_t n = 0;
  const TensorView* weight = nullptr;  // [n], F32
};

// NotFound for a missing tensor, InvalidArgument for a wrong dtype, shape or
// byte size; every message names the tensor and the expected vs actual value.
Result<MlpWeights> ValidateMlpWeights(const std::vector<TensorView>& weights);
Result<ScaleWeights> ValidateScaleWeights(const std::vector<TensorView>& weights);

// InvalidArgument unless every weight lives on `device` (named in the message).
Status CheckWeightsDevice(const std::vector<TensorView>& weights, Device device);

// The signatures (backend.h) shared by the CPU and CUDA implementations.
std::vector<IoSpec> MlpInputs(const MlpWeights& w);
std::vector<IoSpec> MlpOutputs(const MlpWeights& w);
std::vector<IoSpec> ScaleInputs(const ScaleWeights& w);
std::vector<IoSpec> ScaleOutputs();

}  // namespace hearth
