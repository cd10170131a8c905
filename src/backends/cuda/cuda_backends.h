// CUDA backends, built into libhearth_backends_cuda.so only. The weights have
// been validated (model_weights.h) and are device addresses on `device`.
#pragma once

#include <memory>

#include "backends/backend.h"
#include "backends/model_weights.h"

namespace hearth {

Result<std::unique_ptr<Backend>> CreateMlpCuda(const MlpWeights& weights, int device,
                                               const BackendOptions& options);
Result<std::unique_ptr<Backend>> CreateScaleCuda(const ScaleWeights& weights, int device,
                                                 const BackendOptions& options);

}  // namespace hearth
