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
    if (s.streams.has_value()) {
      const ModelStatistics::Streams& t = *s.streams;
      models.back()["hearth_streams"] = {{"in_flight", t.in_flight},
                                         {"opened", t.opened},
                                         {"resumed", t.resumed},
                                         {"responses", t.responses},
                                         {"tokens", t.tokens}};
    }
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

Result<ModelLoadOverrides> ParseRepositoryLoadBody(std::string_view body) {
  Result<json> parsed = ObjectBody(body, "repository load");
  if (!parsed.ok()) return parsed.status();
  ModelLoadOverrides overrides;
  for (const auto& [key, value] : parsed->items()) {
    if (key != "parameters")
      return InvalidArgument("repository load: unknown field '" + key + "' (only 'parameters')");
    if (!value.is_object())
      return InvalidArgument("repository load: 'parameters' must be an object");
    for (const auto& [name, parameter] : value.items()) {
      const bool file = name.rfind("file:", 0) == 0;
      if (name != "config" && !file)
        return InvalidArgument("parameter '" + name.substr(0, 64) +
                               "' is not one a load takes ('config', 'file:PATH')");
      if (!parameter.is_string())
        return InvalidArgument("parameter '" + name.substr(0, 64) + "' must be a string" +
                               (file ? " (the file's bytes in base64)" : " (JSON text)"));
      const std::string& text = parameter.get_ref<const std::string&>();
      if (!file) {
        overrides.config_json = text;
        continue;
      }
      if (overrides.files.size() == kMaxOverrideFiles)
        return InvalidArgument("repository load: more than " + std::to_string(kMaxOverrideFiles) +
                               " file overrides");
      ASSIGN_OR_RETURN(std::vector<std::byte> bytes,
                       DecodeBase64(text, "parameter '" + name.substr(0, 64) + "'"));
      overrides.files.emplace_back(
          name.substr(5), std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    }
  }
  return overrides;
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

std::string CudaSharedMemoryStatusJson(const std::vector<CudaSharedMemoryRegion>& regions) {
  json list = json::array();
  for (const CudaSharedMemoryRegion& r : regions) {
    list.push_back({{"name", r.name}, {"device_id", r.device_id}, {"byte_size", r.byte_size}});
  }
  return list.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<std::vector<std::byte>> DecodeBase64(std::string_view text, std::string_view what) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  const std::string bad = std::string(what) + " is not base64 (RFC 4648, padded with '='): ";
  if (text.size() % 4 != 0)
    return InvalidArgument(bad + std::to_string(text.size()) + " characters, not a multiple of 4");
  std::vector<std::byte> out;
  out.reserve(text.size() / 4 * 3);
  for (size_t at = 0; at < text.size(); at += 4) {
    const bool last = at + 4 == text.size();
    const size_t pad = last ? (text[at + 3] == '=' ? (text[at + 2] == '=' ? 2 : 1) : 0) : 0;
    uint32_t group = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = text[at + k];
      const int v = k >= 4 - pad ? 0 : value(c);
      if (v < 0)
        return InvalidArgument(bad + "character " + std::to_string(at + k) + " is not of its " +
                               "alphabet");
      group = group << 6 | static_cast<uint32_t>(v);
    }
    // Padding leaves bits unused: a canonical encoding has them zero.
    if ((pad == 1 && (group & 0xff) != 0) || (pad == 2 && (group & 0xffff) != 0))
      return InvalidArgument(bad + "the last group has bits set past its end");
    out.push_back(static_cast<std::byte>(group >> 16));
    if (pad < 2) out.push_back(static_cast<std::byte>(group >> 8 & 0xff));
    if (pad < 1) out.push_back(static_cast<std::byte>(group & 0xff));
  }
  return out;
}

Result<CudaSharedMemoryRegistration> ParseCudaSharedMemoryRegisterBody(std::string_view body) {
  constexpr size_t kMaxHandleText = 4096;
  Result<json> parsed = ObjectBody(body, "CUDA shared memory registration");
  if (!parsed.ok()) return parsed.status();
  CudaSharedMemoryRegistration r;
  bool has_handle = false, has_device = false, has_size = false;
  const std::string what = "CUDA shared memory registration: ";
  for (const auto& [name, value] : parsed->items()) {
    if (name == "raw_handle") {
      const json* b64 =
          value.is_object() && value.size() == 1 && value.contains("b64") ? &value["b64"] : nullptr;
      if (b64 == nullptr || !b64->is_string())
        return InvalidArgument(what + "'raw_handle' must be {\"b64\": \"<base64 of the handle>\"}");
      const auto& text = b64->get_ref<const std::string&>();
      if (text.size() > kMaxHandleText)
        return InvalidArgument(what + "'raw_handle' has " + std::to_string(text.size()) +
                               " characters of base64; a CUDA IPC handle takes 88");
      ASSIGN_OR_RETURN(r.raw_handle, DecodeBase64(text, "'raw_handle'"));
      has_handle = true;
    } else if (name == "device_id") {
      if (!value.is_number_integer() ||
          (value.is_number_unsigned() && value.get<uint64_t>() > INT64_MAX))
        return InvalidArgument(what + "'device_id' must be an integer (of 64 bits)");
      r.device_id = value.get<int64_t>();
      has_device = true;
    } else if (name == "byte_size") {
      if (!value.is_number_unsigned())
        return InvalidArgument(what + "'byte_size' must be a non-negative integer");
      r.byte_size = value.get<uint64_t>();
      has_size = true;
    } else {
      return InvalidArgument(what + "unknown field '" + name + "'");
    }
  }
  if (!has_handle) return InvalidArgument(what + "'raw_handle' is missing");
  if (!has_device) return InvalidArgument(what + "'device_id' is missing");
  if (!has_size) return InvalidArgument(what + "'byte_size' is missing");
  return r;
}

std::string LogSettingsJson(const LogSettings& settings) {
  return json{{"log_file", settings.file},
              {"log_info", settings.info},
              {"log_warning", settings.warning},
              {"log_error", settings.error},
              {"log_verbose_level", settings.verbose_level},
              {"log_format", settings.format}}
      .dump();
}

Result<LogSettingsUpdate> ParseLogSettingsBody(std::string_view body) {
  Result<json> parsed = ObjectBody(body, "log settings");
  if (!parsed.ok()) return parsed.status();
  LogSettingsUpdate update;
  for (const auto& [key, value] : parsed->items()) {
    if (key == "log_verbose_level") {
      if (!value.is_number_unsigned() || value.get<uint64_t>() > UINT32_MAX) {
        return InvalidArgument("log settings: 'log_verbose_level' must be an integer from 0 to " +
                               std::to_string(UINT32_MAX) + ", got " + value.dump());
      }
      update.verbose_level = value.get<uint32_t>();
    } else if (key == "log_info" || key == "log_warning" || key == "log_error") {
      if (!value.is_boolean()) {
        return InvalidArgument("log settings: '" + key + "' must be a boolean, got " +
                               value.dump());
      }
      (key == "log_info"      ? update.info
       : key == "log_warning" ? update.warning
                              : update.error) = value.get<bool>();
    } else if (key == "log_format" || key == "log_file") {
      if (!value.is_string()) {
        return InvalidArgument("log settings: '" + key + "' must be a string, got " + value.dump());
      }
      (key == "log_format" ? update.format : update.file) = value.get<std::string>();
    } else {
      return InvalidArgument("log settings: unknown field '" + key +
                             "' (Triton's: log_file, log_info, log_warning, log_error, "
                             "log_verbose_level, log_format)");
    }
  }
  return update;
}

std::string TraceSettingsJson(const std::vector<TraceSetting>& settings) {
  json out = json::object();
  for (const TraceSetting& s : settings) {
    if (s.name == "trace_level") {
      out[s.name] = s.value;
    } else {
      out[s.name] = s.value.empty() ? std::string() : s.value.front();
    }
  }
  return out.dump();
}

Status CheckTraceSettingsBody(std::string_view body) {
  Result<json> parsed = ObjectBody(body, "trace settings");
  if (!parsed.ok()) return parsed.status();
  for (const auto& [key, value] : parsed->items()) {
    std::vector<std::string> values;
    if (value.is_string()) {
      values.push_back(value.get<std::string>());
    } else if (value.is_array()) {
      for (const json& v : value) {
        if (!v.is_string()) {
          return InvalidArgument("trace settings: '" + key +
                                 "' must be a string or a list of strings, got " + value.dump());
        }
        values.push_back(v.get<std::string>());
      }
    } else if (!value.is_null()) {
      return InvalidArgument("trace settings: '" + key +
                             "' must be a string, a list of strings or null, got " + value.dump());
    }
    RETURN_IF_ERROR(CheckTraceSettingUpdate(key, values, value.is_null()));
  }
  return Status::Ok();
}

}  // namespace hearth
