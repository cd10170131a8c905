// GET /metrics: the served models' counters, workers and memory in the
// Prometheus text exposition format (version 0.0.4).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "server/device_process_memory.h"
#include "server/model_runtime.h"

namespace hearth {

// What one device's store holds (Store::HeldArenas).
struct StoreSample {
  std::string device;  // "cpu", "cuda:N", "hostN"
  uint64_t arenas = 0, bytes = 0;
};

// One family per metric, a sample per model (and per worker, per
// placement, per device's store). `driver`: what the NVIDIA driver accounts
// to the hot spares' processes, where NVML answered (ReadDriverMemory).
std::string PrometheusText(const std::vector<std::pair<std::string, const ModelRuntime*>>& served,
                           const std::vector<StoreSample>& stores = {},
                           const DriverMemory& driver = {});

}  // namespace hearth
