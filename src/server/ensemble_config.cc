#include "server/ensemble_config.h"

#include <algorithm>
#include <map>
#include <set>

#include "common/datatype.h"

namespace hearth {
namespace {

using namespace config_yaml;  // NOLINT(google-build-using-namespace): the config's own helpers

std::string StepField(size_t i) { return "ensemble_scheduling.step[" + std::to_string(i) + "]"; }

Result<std::vector<std::pair<std::string, std::string>>> TensorMap(const Ctx& c,
                                                                   const YAML::Node& n,
                                                                   const std::string& field) {
  if (!n.IsMap() || n.size() == 0)
    return c.Error(n, field,
                   "must be a non-empty map from the step model's tensor to the ensemble's");
  if (n.size() > kMaxModelTensors)
    return c.Error(n, field, "more than " + std::to_string(kMaxModelTensors) + " entries");
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& kv : n) {
    ASSIGN_OR_RETURN(std::string key, Key(c, kv.first, field));
    ASSIGN_OR_RETURN(std::string value, String(c, kv.second, field + "." + key));
    if (key.empty() || value.empty()) return c.Error(kv.first, field, "names must not be empty");
    if (key.size() > kMaxTensorNameBytes || value.size() > kMaxTensorNameBytes)
      return c.Error(kv.first, field,
                     "a name is longer than " + std::to_string(kMaxTensorNameBytes) + " bytes");
    out.emplace_back(std::move(key), std::move(value));
  }
  return out;
}

std::string Shape(const std::vector<int64_t>& dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i > 0 ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

// Shapes as KServe gives them (the batch dimension first, -1, when batching):
// the same rank, each dimension equal or -1 in either.
bool ShapesAgree(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && a[i] != -1 && b[i] != -1) return false;
  return true;
}

// The order in which the steps can run (each once every tensor it takes
// exists), as far as it goes: a step missing from it waits on itself.
std::vector<size_t> RunOrder(const ModelConfig& m) {
  std::set<std::string> ready;
  for (const IoConfig& in : m.inputs) ready.insert(in.name);
  const std::vector<EnsembleStep>& steps = *m.ensemble;
  std::vector<bool> placed(steps.size(), false);
  std::vector<size_t> order;
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (placed[i]) continue;
      if (!std::all_of(steps[i].inputs.begin(), steps[i].inputs.end(),
                       [&](const auto& in) { return ready.count(in.second) > 0; }))
        continue;
      placed[i] = progress = true;
      order.push_back(i);
      for (const auto& out : steps[i].outputs) ready.insert(out.second);
    }
  }
  return order;
}

}  // namespace

Status ReadEnsembleScheduling(const Ctx& c, const YAML::Node& node, ModelConfig& m) {
  const std::string field = "ensemble_scheduling";
  if (!node.IsMap() || node.size() != 1 || !node["step"])
    return c.Error(node, field, "must be {step: [...]}");
  const YAML::Node steps = node["step"];
  if (!steps.IsSequence() || steps.size() == 0)
    return c.Error(steps, field + ".step", "must be a non-empty list");
  if (steps.size() > kMaxEnsembleSteps)
    return c.Error(steps, field + ".step",
                   "more than " + std::to_string(kMaxEnsembleSteps) + " steps");
  std::vector<EnsembleStep> out;
  for (size_t i = 0; i < steps.size(); ++i) {
    const YAML::Node& s = steps[i];
    const std::string f = StepField(i);
    if (!s.IsMap()) return c.Error(s, f, "must be a map with model_name, input_map, output_map");
    for (const auto& kv : s) {
      ASSIGN_OR_RETURN(std::string key, Key(c, kv.first, f));
      if (key != "model_name" && key != "model_version" && key != "input_map" &&
          key != "output_map")
        return c.Error(kv.first, f + "." + key,
                       "unknown field (model_name, model_version, input_map, output_map)");
    }
    EnsembleStep step;
    if (!s["model_name"]) return c.Error(s, f + ".model_name", "missing");
    ASSIGN_OR_RETURN(step.model, String(c, s["model_name"], f + ".model_name"));
    if (step.model.empty()) return c.Error(s["model_name"], f + ".model_name", "is empty");
    if (step.model == m.name)
      return c.Error(s["model_name"], f + ".model_name",
                     "names the ensemble itself (a cycle): a step runs another model");
    if (s["model_version"]) {
      ASSIGN_OR_RETURN(step.version, Number<int64_t>(c, s["model_version"], f + ".model_version"));
      if (step.version < -1 || step.version == 0)
        return c.Error(s["model_version"], f + ".model_version",
                       "must be -1 (the served version) or a version number");
    }
    if (!s["input_map"]) return c.Error(s, f + ".input_map", "missing");
    if (!s["output_map"]) return c.Error(s, f + ".output_map", "missing");
    ASSIGN_OR_RETURN(step.inputs, TensorMap(c, s["input_map"], f + ".input_map"));
    ASSIGN_OR_RETURN(step.outputs, TensorMap(c, s["output_map"], f + ".output_map"));
    out.push_back(std::move(step));
  }
  m.ensemble = std::move(out);
  return CheckEnsembleGraph(m);
}

Status CheckEnsembleGraph(const ModelConfig& m) {
  auto error = [&](const std::string& field, const std::string& what) {
    return InvalidArgument(m.config_path + ": " + field + ": " + what);
  };
  if (!m.ensemble || m.ensemble->empty()) return error("ensemble_scheduling.step", "no steps");
  const std::vector<EnsembleStep>& steps = *m.ensemble;
  // Who produces each ensemble tensor: "input" (the request) or a step's field.
  std::map<std::string, std::string> producer;
  for (const IoConfig& in : m.inputs) producer[in.name] = "input '" + in.name + "'";
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string f = StepField(i);
    if (steps[i].model == m.name)
      return error(f + ".model_name", "names the ensemble itself (a cycle)");
    if (steps[i].inputs.empty()) return error(f + ".input_map", "is empty");
    if (steps[i].outputs.empty()) return error(f + ".output_map", "is empty");
    for (const auto& [step_tensor, tensor] : steps[i].outputs) {
      const std::string here = f + ".output_map['" + step_tensor + "']";
      auto [it, added] = producer.emplace(tensor, here);
      if (!added)
        return error(here, "ensemble tensor '" + tensor + "' is produced twice (also by " +
                               it->second + ")");
    }
  }
  std::set<std::string> taken;
  for (size_t i = 0; i < steps.size(); ++i) {
    for (const auto& [step_tensor, tensor] : steps[i].inputs) {
      if (producer.count(tensor) == 0)
        return error(StepField(i) + ".input_map['" + step_tensor + "']",
                     "ensemble tensor '" + tensor +
                         "' is never produced (by no step, and not an input of the ensemble)");
      taken.insert(tensor);
    }
  }
  for (const IoConfig& in : m.inputs)
    if (taken.count(in.name) == 0)
      return error("input", "'" + in.name + "' is taken by no step (map it in a step's input_map)");
  for (const IoConfig& out : m.outputs) {
    auto it = producer.find(out.name);
    if (it == producer.end() || it->second.rfind("input ", 0) == 0)
      return error("output",
                   "'" + out.name + "' is produced by no step (map it in a step's output_map)");
  }
  const std::vector<size_t> order = RunOrder(m);
  if (order.size() < steps.size()) {
    std::string stuck;
    for (size_t i = 0; i < steps.size(); ++i)
      if (std::find(order.begin(), order.end(), i) == order.end())
        stuck += (stuck.empty() ? "" : ", ") + std::to_string(i) + " (" + steps[i].model + ")";
    return error("ensemble_scheduling.step",
                 "steps " + stuck + " wait on each other's outputs (a cycle)");
  }
  return Status::Ok();
}

Result<std::vector<std::string>> CheckEnsembleSteps(const ModelConfig& m,
                                                    const FindComposingModel& find) {
  auto error = [&](const std::string& field, const std::string& what) {
    return InvalidArgument(m.config_path + ": " + field + ": " + what);
  };
  RETURN_IF_ERROR(CheckEnsembleGraph(m));
  const std::vector<EnsembleStep>& steps = *m.ensemble;
  // Each ensemble tensor's datatype and full shape (as KServe gives them),
  // and what fixed them, as far as they are known.
  struct Known {
    DType dtype;
    std::vector<int64_t> shape;
    std::string from;
  };
  auto full = [&](const IoConfig& io) {
    std::vector<int64_t> shape;
    if (m.max_batch_size > 0) shape.push_back(-1);
    shape.insert(shape.end(), io.dims.begin(), io.dims.end());
    return shape;
  };
  std::map<std::string, Known> known;
  for (const IoConfig& in : m.inputs)
    known[in.name] = {in.dtype, full(in), "the ensemble's input '" + in.name + "'"};
  std::map<std::string, const IoConfig*> outputs;
  for (const IoConfig& out : m.outputs) outputs[out.name] = &out;
  auto agree = [&](const std::string& field, const std::string& what, const TensorMetadata& t,
                   const Known& k) -> Status {
    if (t.dtype != k.dtype)
      return error(field, what + " is " + std::string(TritonDataTypeName(t.dtype)) + " but " +
                              k.from + " is " + std::string(TritonDataTypeName(k.dtype)));
    if (!ShapesAgree(t.shape, k.shape))
      return error(field, what + " has shape " + Shape(t.shape) + " but " + k.from + " has shape " +
                              Shape(k.shape));
    return Status::Ok();
  };
  std::set<std::string> reaches;
  for (size_t i : RunOrder(m)) {
    const EnsembleStep& step = steps[i];
    const std::string f = StepField(i);
    Result<ComposingModel> found = find(step.model);
    if (!found.ok())
      return error(f + ".model_name", "model '" + step.model + "': " + found.status().message());
    const ModelMetadata& md = found->metadata;
    const std::string model = "model '" + step.model + "'";
    const std::string served = md.versions.empty() ? "" : md.versions.front();
    if (step.version != -1 && std::to_string(step.version) != served)
      return error(f + ".model_version", "version " + std::to_string(step.version) + " of " +
                                             model + " is not served (it serves version " + served +
                                             "; -1 takes the served one)");
    if (md.decoupled)
      return error(f + ".model_name",
                   model +
                       " is decoupled (any number of responses per request); an ensemble's "
                       "steps answer once each");
    if (md.sequence)
      return error(f + ".model_name", model +
                                          " serves sequences (sequence_batching); an ensemble "
                                          "does not pass sequences on to its steps");
    if (m.max_batch_size > 0 && md.max_batch_size < m.max_batch_size)
      return error(f + ".model_name", model + " batches at most " +
                                          std::to_string(md.max_batch_size) +
                                          " rows, fewer than the ensemble's max_batch_size " +
                                          std::to_string(m.max_batch_size));
    for (const std::string& r : found->reaches) {
      if (r == m.name)
        return error(f + ".model_name",
                     model + " is an ensemble whose steps reach this one (a cycle)");
      reaches.insert(r);
    }
    reaches.insert(step.model);
    for (const auto& [step_tensor, tensor] : step.inputs) {
      const std::string field = f + ".input_map['" + step_tensor + "']";
      const std::string& name = step_tensor;  // a lambda captures no structured binding (clang)
      auto t = std::find_if(md.inputs.begin(), md.inputs.end(),
                            [&](const TensorMetadata& x) { return x.name == name; });
      if (t == md.inputs.end()) return error(field, model + " has no input '" + step_tensor + "'");
      RETURN_IF_ERROR(agree(field, model + "'s input '" + step_tensor + "'", *t, known.at(tensor)));
    }
    for (const TensorMetadata& t : md.inputs) {
      const bool mapped = std::any_of(step.inputs.begin(), step.inputs.end(),
                                      [&](const auto& in) { return in.first == t.name; });
      if (!mapped && !t.optional)
        return error(f + ".input_map", model + "'s input '" + t.name + "' is not mapped");
    }
    for (const auto& [step_tensor, tensor] : step.outputs) {
      const std::string field = f + ".output_map['" + step_tensor + "']";
      const std::string& name = step_tensor;  // a lambda captures no structured binding (clang)
      auto t = std::find_if(md.outputs.begin(), md.outputs.end(),
                            [&](const TensorMetadata& x) { return x.name == name; });
      if (t == md.outputs.end())
        return error(field, model + " has no output '" + step_tensor + "'");
      const std::string what = model + "'s output '" + step_tensor + "'";
      if (auto out = outputs.find(tensor); out != outputs.end())
        RETURN_IF_ERROR(agree(
            field, what, *t,
            {out->second->dtype, full(*out->second), "the ensemble's output '" + tensor + "'"}));
      known[tensor] = {t->dtype, t->shape, what + " (step " + std::to_string(i) + ")"};
    }
  }
  return std::vector<std::string>(reaches.begin(), reaches.end());
}

}  // namespace hearth
