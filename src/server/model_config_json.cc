#include "server/model_config_json.h"

#include <nlohmann/json.hpp>

#include "common/datatype.h"

namespace hearth {

std::string ModelConfigJson(const ModelConfig& c) {
  using nlohmann::json;
  auto ios = [](const std::vector<IoConfig>& list) {
    json out = json::array();
    for (const IoConfig& io : list) {
      out.push_back({{"name", io.name},
                     {"data_type", std::string(TritonDataTypeName(io.dtype))},
                     {"dims", io.dims}});
      if (io.optional) out.back()["optional"] = true;
    }
    return out;
  };
  json j = {{"name", c.name},
            {"backend", c.backend},
            {"max_batch_size", c.max_batch_size},
            {"input", ios(c.inputs)},
            {"output", ios(c.outputs)}};
  json groups = json::array();
  for (const InstanceGroup& g : c.instance_groups) {
    json group = {{"count", g.count}, {"kind", g.kind_gpu ? "KIND_GPU" : "KIND_CPU"}};
    if (!g.gpus.empty()) group["gpus"] = g.gpus;
    groups.push_back(std::move(group));
  }
  j["instance_group"] = groups;
  json batching = {{"max_queue_delay_microseconds", c.max_queue_delay_us},
                   {"preferred_batch_size", c.preferred_batch_sizes}};
  if (c.priority_levels > 0) batching["priority_levels"] = c.priority_levels;
  if (c.default_priority_level > 0) batching["default_priority_level"] = c.default_priority_level;
  if (c.default_timeout_us > 0)
    batching["default_queue_policy"] = {{"default_timeout_microseconds", c.default_timeout_us}};
  j["dynamic_batching"] = batching;
  json parameters = json::object();
  for (const auto& [k, v] : c.parameters) parameters[k] = {{"string_value", v}};
  j["parameters"] = parameters;
  j["version_policy"] = {{"specific", {{"versions", {c.version}}}}};
  j["model_transaction_policy"] = {{"decoupled", c.decoupled}};
  // Config values are bytes as written; a value that is not UTF-8 is
  // replaced, never an exception.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace hearth
