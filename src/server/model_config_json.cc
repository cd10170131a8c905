#include "server/model_config_json.h"

#include <nlohmann/json.hpp>

#include "common/datatype.h"

namespace hearth {

std::string ModelConfigJson(const ModelConfig& c) {
  using nlohmann::json;
  // An input's format is always given (FORMAT_NONE where the config has
  // none), as Triton's JSON gives it: clients read it without a default.
  auto ios = [](const std::vector<IoConfig>& list, bool inputs) {
    json out = json::array();
    for (const IoConfig& io : list) {
      out.push_back({{"name", io.name},
                     {"data_type", std::string(TritonDataTypeName(io.dtype))},
                     {"dims", io.dims}});
      if (io.optional) out.back()["optional"] = true;
      if (inputs) out.back()["format"] = io.format.empty() ? "FORMAT_NONE" : io.format;
      if (!io.label_filename.empty()) out.back()["label_filename"] = io.label_filename;
    }
    return out;
  };
  json j = {{"name", c.name},
            {"backend", c.backend},
            {"max_batch_size", c.max_batch_size},
            {"input", ios(c.inputs, true)},
            {"output", ios(c.outputs, false)}};
  if (c.ensemble) {
    // As Triton shows an ensemble: its platform and steps, and nothing of
    // workers or batching (its steps' models have those).
    j["platform"] = "ensemble";
    json steps = json::array();
    for (const EnsembleStep& step : *c.ensemble) {
      json in = json::object(), out = json::object();
      for (const auto& [k, v] : step.inputs) in[k] = v;
      for (const auto& [k, v] : step.outputs) out[k] = v;
      steps.push_back({{"model_name", step.model},
                       {"model_version", step.version},
                       {"input_map", in},
                       {"output_map", out}});
    }
    j["ensemble_scheduling"] = {{"step", steps}};
    j["version_policy"] = {{"specific", {{"versions", {c.version}}}}};
    return j.dump(-1, ' ', false, json::error_handler_t::replace);
  }
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
  if (!c.sequence) {
    j["dynamic_batching"] = batching;
  } else {
    // Triton's sequence_batching, whose strategy holds the batching.
    const SequenceBatching& q = *c.sequence;
    json strategy = {{"max_queue_delay_microseconds", c.max_queue_delay_us}};
    if (q.oldest) {
      strategy["preferred_batch_size"] = c.preferred_batch_sizes;
      strategy["max_candidate_sequences"] = c.max_sequences;
    }
    json sequence = {{"max_sequence_idle_microseconds", q.max_idle_us},
                     {q.oldest ? "oldest" : "direct", strategy}};
    json controls = json::array();
    for (const SequenceControl& k : q.controls) {
      static const char* kKinds[] = {"CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY",
                                     "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_CORRID"};
      json control = {{"kind", kKinds[static_cast<int>(k.kind)]}};
      if (k.kind == SequenceControl::Kind::kCorrid) {
        control["data_type"] = std::string(TritonDataTypeName(k.dtype));
      } else if (k.dtype == DType::kI32) {
        control["int32_false_true"] = {static_cast<int32_t>(k.false_value),
                                       static_cast<int32_t>(k.true_value)};
      } else if (k.dtype == DType::kF32) {
        control["fp32_false_true"] = {k.false_value, k.true_value};
      } else {
        control["bool_false_true"] = {k.false_value != 0, k.true_value != 0};
      }
      controls.push_back({{"name", k.input}, {"control", json::array({control})}});
    }
    sequence["control_input"] = controls;
    json states = json::array();
    for (const SequenceState& st : q.states) {
      const std::string type(TritonDataTypeName(st.dtype));
      states.push_back(
          {{"input_name", st.input},
           {"output_name", st.output},
           {"data_type", type},
           {"dims", st.dims},
           {"initial_state",
            json::array(
                {st.initial_data_file.empty()
                     ? json{{"data_type", type}, {"dims", st.initial_dims}, {"zero_data", true}}
                     : json{{"data_type", type},
                            {"dims", st.initial_dims},
                            {"data_file", st.initial_data_file}}})}});
    }
    sequence["state"] = states;
    j["sequence_batching"] = sequence;
  }
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
