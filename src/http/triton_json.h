// The JSON of Triton's REST extensions that are not inference: statistics,
// the repository index and control, and system shared memory. Pure
// functions, thread-safe, never throw (bodies are parsed with ParseJsonBody:
// strictly, every failure an InvalidArgument that names the field).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

// {"model_stats": [{"name", "version", "last_inference", "inference_count",
// "execution_count", "inference_stats": {"success": {"count", "ns"}, "fail",
// "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
// "cache_miss"}, "response_stats": {}, "batch_stats": [{"batch_size",
// "compute_input", "compute_infer", "compute_output"}], "memory_usage": []}]},
// every field of Triton's /v2/models[/{m}]/stats (cache_hit and cache_miss are
// zero: there is no response cache).
std::string ModelStatisticsJson(const std::vector<ModelStatistics>& statistics);

// [{"name", "version", "state", "reason"}], Triton's repository index (a
// version or reason that is empty is left out, as Triton does).
std::string RepositoryIndexJson(const std::vector<RepositoryEntry>& entries);

// [{"name", "key", "offset", "byte_size"}], Triton's system shared memory status.
std::string SystemSharedMemoryStatusJson(const std::vector<SharedMemoryRegion>& regions);

// The body of POST /v2/repository/index: empty, or {"ready": bool}. Returns
// whether only ready models are asked for.
Result<bool> ParseRepositoryIndexBody(std::string_view body);

// The body of a repository load or unload: empty, or an object whose only
// member is "parameters", holding no parameter but `allowed` (Triton's
// `config` and `file:` overrides of a load are refused: the model's
// directory is loaded as it is).
Status CheckRepositoryControlBody(std::string_view body, std::string_view allowed);

struct SystemSharedMemoryRegistration {
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};
// {"key": string, "offset": uint (default 0), "byte_size": uint}.
Result<SystemSharedMemoryRegistration> ParseSystemSharedMemoryRegisterBody(std::string_view body);

}  // namespace hearth
