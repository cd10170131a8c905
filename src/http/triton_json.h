// The JSON of Triton's REST extensions that are not inference: statistics,
// the repository index and control, system and CUDA shared memory, and the
// log and trace settings. Pure
// functions, thread-safe, never throw (bodies are parsed with ParseJsonBody:
// strictly, every failure an InvalidArgument that names the field).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/log_settings.h"
#include "common/trace_settings.h"
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
// member is "parameters", holding no parameter but `allowed`.
Status CheckRepositoryControlBody(std::string_view body, std::string_view allowed);

// The body of a repository load: as CheckRepositoryControlBody, with
// Triton's overrides among the parameters: "config" (a string: the model's
// config as Triton's JSON) and "file:PATH" (a string: the file's bytes in
// base64). Their limits are the service's to check.
Result<ModelLoadOverrides> ParseRepositoryLoadBody(std::string_view body);

struct SystemSharedMemoryRegistration {
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};
// {"key": string, "offset": uint (default 0), "byte_size": uint}.
Result<SystemSharedMemoryRegistration> ParseSystemSharedMemoryRegisterBody(std::string_view body);

// [{"name", "device_id", "byte_size"}], Triton's CUDA shared memory status.
std::string CudaSharedMemoryStatusJson(const std::vector<CudaSharedMemoryRegion>& regions);

struct CudaSharedMemoryRegistration {
  std::vector<std::byte> raw_handle;  // decoded; its size is the service's to check
  int64_t device_id = 0;
  uint64_t byte_size = 0;
};
// Triton's (tritonclient's register_cuda_shared_memory): {"raw_handle":
// {"b64": base64 of the handle}, "device_id": int, "byte_size": uint}, every
// field required. The base64 is RFC 4648's standard alphabet, padded; at
// most 4 KiB of it (a handle is 64 bytes).
Result<CudaSharedMemoryRegistration> ParseCudaSharedMemoryRegisterBody(std::string_view body);

// RFC 4648 base64 (standard alphabet, '=' padding required), strictly: any
// other character, a length not a multiple of 4, or bits left over in the
// last group are an InvalidArgument naming `what`.
Result<std::vector<std::byte>> DecodeBase64(std::string_view text, std::string_view what);

// {"log_file", "log_info", "log_warning", "log_error", "log_verbose_level",
// "log_format"}: Triton's GET /v2/logging.
std::string LogSettingsJson(const LogSettings& settings);

// The body of POST /v2/logging: an object of any of those fields
// (log_verbose_level a non-negative integer, the three log_* kinds
// booleans, log_format and log_file strings); InvalidArgument naming an
// unknown field or a value of the wrong type.
Result<LogSettingsUpdate> ParseLogSettingsBody(std::string_view body);

// {"trace_level": ["OFF"], "trace_rate": "1000", ...}: Triton's GET
// /v2/trace/setting (trace_level a list, the others strings).
std::string TraceSettingsJson(const std::vector<TraceSetting>& settings);

// Checks the body of POST /v2/trace/setting: an object of settings, each a
// string, a list of strings, or null (cleared), against what hearth can
// set (CheckTraceSettingUpdate).
Status CheckTraceSettingsBody(std::string_view body);

}  // namespace hearth
