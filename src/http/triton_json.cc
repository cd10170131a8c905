#include "http/triton_json.h"

#include <nlohmann/json.hpp>

#include "http/json_body.h"

namespace hearth {
namespace {

using json = nlohmann::json;

json Duration(const DurationStatistics& d) { return {{"count", d.count}, {"ns", d.ns}}; }

// Parses a body that may be empty (as an empty object); it must be an object.
Result<json> ObjectBody(std::string_view body, std::string_view what) {
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) return json::object();
  Result<json> parsed = ParseJsonBody(body);
  if (!parsed.ok()) return parsed.status();
  if (!parsed->is_object())
    return InvalidArgument(std::string(what) + ": the body must be a JSON object");
  return parsed;
}

}  // namespace

std::string ModelStatisticsJson(const std::vector<ModelStatistics>& statistics) {
  json models = json::array();
  for (const ModelStatistics& s : statistics) {
    json batches = json::array();
    for (const BatchStatistics& b : s.batch_stats) {
      batches.push_back({{"batch_size", b.batch_size},
                         {"compute_input", Duration(b.compute_input)},
                         {"compute_infer", Duration(b.compute_infer)},
                         {"compute_output", Duration(b.compute_output)}});
    }
    models.push_back({{"name", s.name},
                      {"version", s.version},
                      {"last_inference", s.last_inference_ms},
                      {"inference_count", s.inference_count},
                      {"execution_count", s.execution_count},
                      {"inference_stats",
                       {{"success", Duration(s.success)},
                        {"fail", Duration(s.fail)},
                        {"queue", Duration(s.queue)},
                        {"compute_input", Duration(s.compute_input)},
                        {"compute_infer", Duration(s.compute_infer)},
                        {"compute_output", Duration(s.compute_output)},
                        // hearth has no response cache. Triton always sends these, and
                        // perf_analyzer reads them without checking that they are there.
                        {"cache_hit", Duration({})},
                        {"cache_miss", Duration({})}}},
                      // Per-response statistics (decoupled models) and memory usage are not
                      // kept: empty, as Triton's are for a model that has none.
                      {"response_stats", json::object()},
                      {"batch_stats", std::move(batches)},
                      {"memory_usage", json::array()}});
  }
  return json{{"model_stats", std::move(models)}}.dump(-1, ' ', false,
                                                       json::error_handler_t::replace);
}

std::string RepositoryIndexJson(const std::vector<RepositoryEntry>& entries) {
  json list = json::array();
  for (const RepositoryEntry& e : entries) {
    json entry = {{"name", e.name}};
    if (!e.version.empty()) entry["version"] = e.version;
    entry["state"] = e.state;
    if (!e.reason.empty()) entry["reason"] = e.reason;
    list.push_back(std::move(entry));
  }
  return list.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string SystemSharedMemoryStatusJson(const std::vector<SharedMemoryRegion>& regions) {
  json list = json::array();
  for (const SharedMemoryRegion& r : regions) {
    list.push_back(
        {{"name", r.name}, {"key", r.key}, {"offset", r.offset}, {"byte_size", r.byte_size}});
  }
  return list.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<bool> ParseRepositoryIndexBody(std::string_view body) {
  Result<json> parsed = ObjectBody(body, "repository index");
  if (!parsed.ok()) return parsed.status();
  bool ready = false;
  for (const auto& [key, value] : parsed->items()) {
    if (key != "ready") {
      return InvalidArgument("repository index: unknown field '" + key + "' (only 'ready')");
    }
    if (!value.is_boolean()) return InvalidArgument("repository index: 'ready' must be a boolean");
    ready = value.get<bool>();
  }
  return ready;
}

Status CheckRepositoryControlBody(std::string_view body, std::string_view allowed) {
  Result<json> parsed = ObjectBody(body, "repository control");
  if (!parsed.ok()) return parsed.status();
  for (const auto& [key, value] : parsed->items()) {
    if (key != "parameters") {
      return InvalidArgument("repository control: unknown field '" + key + "' (only 'parameters')");
    }
    if (!value.is_object()) {
      return InvalidArgument("repository control: 'parameters' must be an object");
    }
    for (const auto& [parameter, ignored] : value.items()) {
      if (parameter != allowed) {
        return InvalidArgument("parameter '" + parameter +
                               "' is not supported: hearth loads the model's directory in the "
                               "repository as it is, with no parameters");
      }
    }
  }
  return Status::Ok();
}

Result<SystemSharedMemoryRegistration> ParseSystemSharedMemoryRegisterBody(std::string_view body) {
  Result<json> parsed = ObjectBody(body, "shared memory registration");
  if (!parsed.ok()) return parsed.status();
  SystemSharedMemoryRegistration r;
  bool has_key = false;
  bool has_size = false;
  for (const auto& [name, value] : parsed->items()) {
    if (name == "key") {
      if (!value.is_string())
        return InvalidArgument("shared memory registration: 'key' must be a string");
      r.key = value.get<std::string>();
      has_key = true;
    } else if (name == "offset" || name == "byte_size") {
      if (!value.is_number_unsigned()) {
        return InvalidArgument("shared memory registration: '" + name +
                               "' must be a non-negative integer");
      }
      (name == "offset" ? r.offset : r.byte_size) = value.get<uint64_t>();
      if (name == "byte_size") has_size = true;
    } else {
      return InvalidArgument("shared memory registration: unknown field '" + name + "'");
    }
  }
  if (!has_key) return InvalidArgument("shared memory registration: 'key' is missing");
  if (!has_size) return InvalidArgument("shared memory registration: 'byte_size' is missing");
  return r;
}

}  // namespace hearth
