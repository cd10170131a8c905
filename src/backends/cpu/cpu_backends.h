// CPU reference backends (OpenBLAS). Weights must be host memory; the caller
// has validated them (model_weights.h).
#pragma once

#include <memory>

#include "backends/backend.h"
#include "backends/model_weights.h"

namespace hearth {

std::unique_ptr<Backend> CreateMlpCpu(const MlpWeights& weights, const BackendOptions& options);
std::unique_ptr<Backend> CreateScaleCpu(const ScaleWeights& weights, const BackendOptions& options);

}  // namespace hearth
