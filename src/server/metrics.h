// GET /metrics: the served models' counters, workers and memory in the
// Prometheus text exposition format (version 0.0.4).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "server/supervisor.h"

namespace hearth {

// One family per metric, a sample per model (and per worker, per device).
std::string PrometheusText(const std::vector<std::pair<std::string, const ModelRuntime*>>& served);

}  // namespace hearth
