// The JSON of GET /v2/hearth/workers, hearth's own endpoint: the served
// models' worker processes, standbys and hot spares (InferenceService::Workers),
// written by the front-end and read back by `hearth status --url`:
//
//   {"models": [{"name", "version", "standby_mode", "standby_workers",
//     "placements": [{"device",
//       "workers": [{"index", "pid", "ready", "restarts", "device_memory_bytes",
//                    "driver_device_memory_bytes"}],
//       "standbys": [{"pid"}],
//       "hot_spares": [{"pid", "device_memory_bytes", "warm_up_us",
//                       "driver_device_memory_bytes"}]}]}]}
//
// device_memory_bytes is what the process reported of its own buffers;
// driver_device_memory_bytes what the NVIDIA driver accounts to it (its CUDA
// context included), null when unknown (server/device_process_memory.h).
//
// Pure functions, thread-safe, never throw.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

std::string WorkersJson(const std::vector<ModelWorkers>& models);

// InvalidArgument naming the field for text that is not that JSON (a
// member missing or of the wrong type); members it does not know are
// skipped, so that an older reader reads a newer server.
Result<std::vector<ModelWorkers>> ParseWorkersJson(std::string_view text);

}  // namespace hearth
