#include "http/workers_json.h"

#include <nlohmann/json.hpp>
#include <optional>

namespace hearth {
namespace {

using json = nlohmann::json;

// The member `key` of `object` as a T; InvalidArgument naming `where.key`.
template <typename T>
Result<T> Member(const json& object, const char* key, const std::string& where) {
  const std::string field = where + "." + key;
  if (!object.is_object()) return InvalidArgument(where + ": not a JSON object");
  auto it = object.find(key);
  if (it == object.end()) return InvalidArgument(field + ": missing");
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) return InvalidArgument(field + ": not a boolean");
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) return InvalidArgument(field + ": not a string");
  } else if constexpr (std::is_unsigned_v<T>) {
    if (!it->is_number_unsigned()) return InvalidArgument(field + ": not a non-negative integer");
  } else {
    if (!it->is_number_integer()) return InvalidArgument(field + ": not an integer");
  }
  return it->get<T>();
}

// The member `key` of `object` as a byte count, nullopt where it is absent
// or null (unknown, or a server older than the member).
Result<std::optional<uint64_t>> OptionalBytes(const json& object, const char* key,
                                              const std::string& where) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::optional<uint64_t>();
  if (!it->is_number_unsigned())
    return InvalidArgument(where + "." + key + ": not a non-negative integer or null");
  return std::optional<uint64_t>(it->get<uint64_t>());
}

// A byte count, or null when unknown.
json BytesOrNull(const std::optional<uint64_t>& bytes) {
  return bytes.has_value() ? json(*bytes) : json(nullptr);
}

Result<const json*> List(const json& object, const char* key, const std::string& where) {
  if (!object.is_object()) return InvalidArgument(where + ": not a JSON object");
  auto it = object.find(key);
  if (it == object.end() || !it->is_array())
    return InvalidArgument(where + "." + key + ": missing, or not a list");
  return &*it;
}

Result<PlacementWorkers> ParsePlacement(const json& p, const std::string& where) {
  PlacementWorkers out;
  ASSIGN_OR_RETURN(out.device, Member<std::string>(p, "device", where));
  ASSIGN_OR_RETURN(const json* workers, List(p, "workers", where));
  for (size_t i = 0; i < workers->size(); ++i) {
    const json& w = (*workers)[i];
    const std::string at = where + ".workers[" + std::to_string(i) + "]";
    WorkerInfo info;
    ASSIGN_OR_RETURN(info.index, Member<int>(w, "index", at));
    ASSIGN_OR_RETURN(info.pid, Member<int64_t>(w, "pid", at));
    ASSIGN_OR_RETURN(info.ready, Member<bool>(w, "ready", at));
    ASSIGN_OR_RETURN(info.restarts, Member<uint64_t>(w, "restarts", at));
    ASSIGN_OR_RETURN(info.device_memory_bytes, Member<uint64_t>(w, "device_memory_bytes", at));
    // Absent from a server older than streams: none.
    if (w.contains("streams")) {
      ASSIGN_OR_RETURN(info.streams, Member<uint64_t>(w, "streams", at));
    }
    ASSIGN_OR_RETURN(info.driver_device_memory_bytes,
                     OptionalBytes(w, "driver_device_memory_bytes", at));
    out.workers.push_back(info);
  }
  ASSIGN_OR_RETURN(const json* standbys, List(p, "standbys", where));
  for (size_t i = 0; i < standbys->size(); ++i) {
    StandbyInfo info;
    ASSIGN_OR_RETURN(info.pid, Member<int64_t>((*standbys)[i], "pid",
                                               where + ".standbys[" + std::to_string(i) + "]"));
    out.standbys.push_back(info);
  }
  ASSIGN_OR_RETURN(const json* spares, List(p, "hot_spares", where));
  for (size_t i = 0; i < spares->size(); ++i) {
    const json& s = (*spares)[i];
    const std::string at = where + ".hot_spares[" + std::to_string(i) + "]";
    HotSpareInfo info;
    ASSIGN_OR_RETURN(info.pid, Member<int64_t>(s, "pid", at));
    ASSIGN_OR_RETURN(info.device_memory_bytes, Member<uint64_t>(s, "device_memory_bytes", at));
    ASSIGN_OR_RETURN(info.warm_up_us, Member<uint64_t>(s, "warm_up_us", at));
    ASSIGN_OR_RETURN(info.driver_device_memory_bytes,
                     OptionalBytes(s, "driver_device_memory_bytes", at));
    out.hot_spares.push_back(info);
  }
  return out;
}

}  // namespace

std::string WorkersJson(const std::vector<ModelWorkers>& models) {
  json list = json::array();
  for (const ModelWorkers& m : models) {
    json placements = json::array();
    for (const PlacementWorkers& p : m.placements) {
      json workers = json::array(), standbys = json::array(), spares = json::array();
      for (const WorkerInfo& w : p.workers)
        workers.push_back(
            {{"index", w.index},
             {"pid", w.pid},
             {"ready", w.ready},
             {"restarts", w.restarts},
             {"device_memory_bytes", w.device_memory_bytes},
             {"driver_device_memory_bytes", BytesOrNull(w.driver_device_memory_bytes)},
             {"streams", w.streams}});
      for (const StandbyInfo& s : p.standbys) standbys.push_back({{"pid", s.pid}});
      for (const HotSpareInfo& s : p.hot_spares)
        spares.push_back(
            {{"pid", s.pid},
             {"device_memory_bytes", s.device_memory_bytes},
             {"warm_up_us", s.warm_up_us},
             {"driver_device_memory_bytes", BytesOrNull(s.driver_device_memory_bytes)}});
      placements.push_back({{"device", p.device},
                            {"workers", std::move(workers)},
                            {"standbys", std::move(standbys)},
                            {"hot_spares", std::move(spares)}});
    }
    list.push_back({{"name", m.name},
                    {"version", m.version},
                    {"standby_mode", m.standby_mode},
                    {"standby_workers", m.standby_workers},
                    {"placements", std::move(placements)}});
  }
  return json{{"models", std::move(list)}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<std::vector<ModelWorkers>> ParseWorkersJson(std::string_view text) {
  const json body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return InvalidArgument("the answer is not JSON");
  ASSIGN_OR_RETURN(const json* models, List(body, "models", "the answer"));
  std::vector<ModelWorkers> out;
  for (size_t i = 0; i < models->size(); ++i) {
    const json& m = (*models)[i];
    const std::string at = "models[" + std::to_string(i) + "]";
    ModelWorkers model;
    ASSIGN_OR_RETURN(model.name, Member<std::string>(m, "name", at));
    ASSIGN_OR_RETURN(model.version, Member<std::string>(m, "version", at));
    ASSIGN_OR_RETURN(model.standby_mode, Member<std::string>(m, "standby_mode", at));
    ASSIGN_OR_RETURN(model.standby_workers, Member<int>(m, "standby_workers", at));
    ASSIGN_OR_RETURN(const json* placements, List(m, "placements", at));
    for (size_t j = 0; j < placements->size(); ++j) {
      ASSIGN_OR_RETURN(
          PlacementWorkers p,
          ParsePlacement((*placements)[j], at + ".placements[" + std::to_string(j) + "]"));
      model.placements.push_back(std::move(p));
    }
    out.push_back(std::move(model));
  }
  return out;
}

}  // namespace hearth
