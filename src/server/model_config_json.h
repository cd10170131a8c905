// A model's config in Triton's JSON form (what /v2/models/{m}/config
// returns, and what a Python model's initialize() gets as model_config).
#pragma once

#include <string>

#include "server/model_config.h"

namespace hearth {

std::string ModelConfigJson(const ModelConfig& config);

}  // namespace hearth
