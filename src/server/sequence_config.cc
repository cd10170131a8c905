#include "server/sequence_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/datatype.h"
#include "common/regular_file.h"

namespace hearth {
namespace {

using config_yaml::Ctx;
using config_yaml::Dims;
using config_yaml::Key;
using config_yaml::Number;
using config_yaml::Quote;
using config_yaml::String;

constexpr std::string_view kNotImplemented =
    "hearth does not implement this field of Triton's sequence batching (remove it)";

// Every key of map `n` is one of `allowed`; `refused` keys are Triton's,
// named as not implemented.
Status CheckKeys(const Ctx& c, const YAML::Node& n, const std::string& field,
                 std::initializer_list<std::string_view> allowed,
                 std::initializer_list<std::string_view> refused = {}) {
  if (!n.IsMap()) return c.Error(n, field, "must be a map");
  for (const auto& kv : n) {
    ASSIGN_OR_RETURN(std::string key, Key(c, kv.first, field));
    if (std::find(refused.begin(), refused.end(), key) != refused.end())
      return c.Error(kv.first, field + "." + key, std::string(kNotImplemented));
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      std::string known;
      for (std::string_view a : allowed) known += (known.empty() ? "" : ", ") + std::string(a);
      return c.Error(kv.first, field + "." + key, "unknown field (" + known + ")");
    }
  }
  return Status::Ok();
}

Result<bool> Bool(const Ctx& c, const YAML::Node& n, const std::string& field) {
  if (!n.IsScalar() || (n.Scalar() != "true" && n.Scalar() != "false"))
    return c.Error(n, field, "must be true or false");
  return n.Scalar() == "true";
}

Result<DType> DataType(const Ctx& c, const YAML::Node& n, const std::string& field) {
  ASSIGN_OR_RETURN(std::string type, String(c, n, field));
  const std::optional<DType> dtype = ParseTritonDataType(type);
  if (!dtype) return c.Error(n, field, Quote(type) + " is not a known TYPE_*");
  return *dtype;
}

// A strategy's batching: direct or oldest.
Status ReadStrategy(const Ctx& c, const YAML::Node& s, bool oldest, ModelConfig& m) {
  const std::string field = std::string("sequence_batching.") + (oldest ? "oldest" : "direct");
  if (oldest) {
    RETURN_IF_ERROR(CheckKeys(c, s, field,
                              {"max_candidate_sequences", "preferred_batch_size",
                               "max_queue_delay_microseconds", "preserve_ordering"}));
  } else {
    RETURN_IF_ERROR(
        CheckKeys(c, s, field, {"max_queue_delay_microseconds", "minimum_slot_utilization"}));
  }
  if (s["max_queue_delay_microseconds"]) {
    const std::string f = field + ".max_queue_delay_microseconds";
    ASSIGN_OR_RETURN(m.max_queue_delay_us,
                     Number<uint64_t>(c, s["max_queue_delay_microseconds"], f));
    if (m.max_queue_delay_us > kMaxQueueDelayUs)
      return c.Error(s["max_queue_delay_microseconds"], f,
                     "must be at most " + std::to_string(kMaxQueueDelayUs) + " (60 s)");
  }
  if (const YAML::Node u = s["minimum_slot_utilization"]) {
    ASSIGN_OR_RETURN(double v, Number<double>(c, u, field + ".minimum_slot_utilization"));
    if (v != 0)
      return c.Error(u, field + ".minimum_slot_utilization",
                     "hearth has no batch slots: a batch of sequences forms as any other, "
                     "waiting at most max_queue_delay_microseconds (leave it out or 0)");
  }
  if (const YAML::Node p = s["preserve_ordering"]) {
    ASSIGN_OR_RETURN(bool v, Bool(c, p, field + ".preserve_ordering"));
    if (v)
      return c.Error(p, field + ".preserve_ordering",
                     "hearth answers each request when it is done; the requests of one "
                     "sequence run in order (leave it out or false)");
  }
  if (const YAML::Node n = s["max_candidate_sequences"]) {
    int candidates = 0;
    ASSIGN_OR_RETURN(candidates, Number<int>(c, n, field + ".max_candidate_sequences"));
    if (candidates < 1 || candidates > kMaxMaxSequences)
      return c.Error(n, field + ".max_candidate_sequences",
                     "must be from 1 to " + std::to_string(kMaxMaxSequences));
    m.max_sequences = candidates;
  }
  if (const YAML::Node p = s["preferred_batch_size"]) {
    const std::string f = field + ".preferred_batch_size";
    if (!p.IsSequence()) return c.Error(p, f, "must be a list");
    for (const auto& b : p) {
      ASSIGN_OR_RETURN(int v, Number<int>(c, b, f));
      if (v < 1 || (m.max_batch_size > 0 && v > m.max_batch_size))
        return c.Error(b, f, "must be in [1, max_batch_size]");
      m.preferred_batch_sizes.push_back(v);
    }
    std::sort(m.preferred_batch_sizes.begin(), m.preferred_batch_sizes.end());
  }
  return Status::Ok();
}

const char* KindName(SequenceControl::Kind kind) {
  switch (kind) {
    case SequenceControl::Kind::kStart:
      return "CONTROL_SEQUENCE_START";
    case SequenceControl::Kind::kReady:
      return "CONTROL_SEQUENCE_READY";
    case SequenceControl::Kind::kEnd:
      return "CONTROL_SEQUENCE_END";
    case SequenceControl::Kind::kCorrid:
      return "CONTROL_SEQUENCE_CORRID";
  }
  return "?";
}

Result<SequenceControl> ReadControl(const Ctx& c, const YAML::Node& e, const std::string& field) {
  RETURN_IF_ERROR(
      CheckKeys(c, e, field,
                {"kind", "int32_false_true", "fp32_false_true", "bool_false_true", "data_type"}));
  SequenceControl control;
  // Triton's default kind is START (its enum's 0).
  if (e["kind"]) {
    ASSIGN_OR_RETURN(std::string kind, String(c, e["kind"], field + ".kind"));
    bool found = false;
    for (auto k : {SequenceControl::Kind::kStart, SequenceControl::Kind::kReady,
                   SequenceControl::Kind::kEnd, SequenceControl::Kind::kCorrid}) {
      if (kind == KindName(k)) {
        control.kind = k;
        found = true;
      }
    }
    if (!found)
      return c.Error(e["kind"], field + ".kind",
                     Quote(kind) +
                         " is not CONTROL_SEQUENCE_START, CONTROL_SEQUENCE_READY, "
                         "CONTROL_SEQUENCE_END or CONTROL_SEQUENCE_CORRID");
  }
  const char* lists[] = {"int32_false_true", "fp32_false_true", "bool_false_true"};
  const DType types[] = {DType::kI32, DType::kF32, DType::kBool};
  int given = 0;
  for (int i = 0; i < 3; ++i) {
    const YAML::Node l = e[lists[i]];
    if (!l) continue;
    ++given;
    const std::string f = field + "." + lists[i];
    if (!l.IsSequence() || l.size() != 2) return c.Error(l, f, "must be [false value, true value]");
    control.dtype = types[i];
    if (i == 2) {
      ASSIGN_OR_RETURN(bool f0, Bool(c, l[0], f));
      ASSIGN_OR_RETURN(bool f1, Bool(c, l[1], f));
      control.false_value = f0 ? 1 : 0;
      control.true_value = f1 ? 1 : 0;
    } else if (i == 0) {
      ASSIGN_OR_RETURN(int32_t f0, Number<int32_t>(c, l[0], f));
      ASSIGN_OR_RETURN(int32_t f1, Number<int32_t>(c, l[1], f));
      control.false_value = f0;
      control.true_value = f1;
    } else {
      ASSIGN_OR_RETURN(float f0, Number<float>(c, l[0], f));
      ASSIGN_OR_RETURN(float f1, Number<float>(c, l[1], f));
      control.false_value = f0;
      control.true_value = f1;
    }
  }
  if (control.kind == SequenceControl::Kind::kCorrid) {
    if (given > 0)
      return c.Error(e, field, "CONTROL_SEQUENCE_CORRID takes data_type, no false/true values");
    if (!e["data_type"])
      return c.Error(e, field,
                     "CONTROL_SEQUENCE_CORRID needs data_type (TYPE_UINT64, TYPE_INT64, "
                     "TYPE_UINT32, TYPE_INT32 or TYPE_STRING)");
    ASSIGN_OR_RETURN(control.dtype, DataType(c, e["data_type"], field + ".data_type"));
    if (control.dtype != DType::kU64 && control.dtype != DType::kI64 &&
        control.dtype != DType::kU32 && control.dtype != DType::kI32 &&
        control.dtype != DType::kBytes)
      return c.Error(e["data_type"], field + ".data_type",
                     "a correlation id is TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or "
                     "TYPE_STRING");
    return control;
  }
  if (e["data_type"])
    return c.Error(e["data_type"], field + ".data_type",
                   std::string(KindName(control.kind)) +
                       " takes its type from int32_false_true, fp32_false_true or "
                       "bool_false_true, not data_type");
  if (given != 1)
    return c.Error(e, field,
                   std::string(KindName(control.kind)) +
                       " needs one of int32_false_true, fp32_false_true, bool_false_true");
  return control;
}

Result<SequenceState> ReadState(const Ctx& c, const YAML::Node& e, const std::string& field,
                                const std::string& model_dir) {
  RETURN_IF_ERROR(CheckKeys(c, e, field,
                            {"input_name", "output_name", "data_type", "dims", "initial_state"},
                            {"use_same_buffer_for_input_output", "use_growable_memory"}));
  if (!e["input_name"] || !e["output_name"] || !e["data_type"] || !e["dims"])
    return c.Error(e, field, "needs input_name, output_name, data_type and dims");
  SequenceState state;
  ASSIGN_OR_RETURN(state.input, String(c, e["input_name"], field + ".input_name"));
  ASSIGN_OR_RETURN(state.output, String(c, e["output_name"], field + ".output_name"));
  for (const auto* name : {&state.input, &state.output})
    if (name->empty() || name->size() > kMaxTensorNameBytes)
      return c.Error(e, field,
                     "input_name and output_name must have 1 to " +
                         std::to_string(kMaxTensorNameBytes) + " bytes");
  ASSIGN_OR_RETURN(state.dtype, DataType(c, e["data_type"], field + ".data_type"));
  if (state.dtype == DType::kBytes)
    return c.Error(e["data_type"], field + ".data_type",
                   "a state is a tensor of numbers (TYPE_STRING state is not served)");
  ASSIGN_OR_RETURN(state.dims, Dims(c, e["dims"], field + ".dims"));
  if (state.dims.size() > kMaxModelTensorRank)
    return c.Error(e["dims"], field + ".dims",
                   "more than " + std::to_string(kMaxModelTensorRank) + " dimensions");
  state.initial_dims = state.dims;
  for (int64_t& d : state.initial_dims)
    if (d < 0) d = 0;
  if (const YAML::Node list = e["initial_state"]) {
    const std::string f = field + ".initial_state";
    if (!list.IsSequence() || list.size() != 1)
      return c.Error(list, f, "must be a list of one initial state");
    const YAML::Node i = list[0];
    const std::string fi = f + "[0]";
    RETURN_IF_ERROR(CheckKeys(c, i, fi, {"data_type", "dims", "zero_data", "data_file", "name"}));
    if (!i["data_type"] || !i["dims"] || (!i["zero_data"] == !i["data_file"]))
      return c.Error(i, fi, "needs data_type, dims and one of zero_data: true or data_file");
    if (i["data_file"]) {
      ASSIGN_OR_RETURN(state.initial_data_file, String(c, i["data_file"], fi + ".data_file"));
      const std::string& file = state.initial_data_file;
      if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
          file.find('\0') != std::string::npos)
        return c.Error(i["data_file"], fi + ".data_file",
                       Quote(file) + " is not a file name (a file in the model's initial_state/)");
    }
    ASSIGN_OR_RETURN(DType dtype, DataType(c, i["data_type"], fi + ".data_type"));
    if (dtype != state.dtype)
      return c.Error(i["data_type"], fi + ".data_type",
                     std::string(TritonDataTypeName(dtype)) + " differs from the state's " +
                         std::string(TritonDataTypeName(state.dtype)));
    ASSIGN_OR_RETURN(state.initial_dims, Dims(c, i["dims"], fi + ".dims"));
    bool agrees = state.initial_dims.size() == state.dims.size();
    for (size_t k = 0; agrees && k < state.dims.size(); ++k)
      agrees = state.initial_dims[k] > 0 &&
               (state.dims[k] < 0 || state.dims[k] == state.initial_dims[k]);
    if (!agrees)
      return c.Error(
          i["dims"], fi + ".dims",
          "must be the state's dims " + ShapeString(state.dims) + " with each -1 given a size");
  }
  const std::optional<uint64_t> bytes = TensorBytes(state.dtype, state.initial_dims);
  if (!bytes || *bytes > kMaxSequenceStateBytes)
    return c.Error(e["dims"], field + ".dims",
                   "the initial state is over the limit of " +
                       std::to_string(kMaxSequenceStateBytes) + " bytes");
  if (!state.initial_data_file.empty()) {
    const std::string path = model_dir + "/initial_state/" + state.initial_data_file;
    const std::string f = field + ".initial_state[0].data_file";
    struct stat st {};
    Result<UniqueFd> fd = OpenRegularFile(path, &st);
    if (!fd.ok()) return c.Error(e["initial_state"][0]["data_file"], f, fd.status().message());
    if (static_cast<uint64_t>(st.st_size) != *bytes)
      return c.Error(e["initial_state"][0]["data_file"], f,
                     path + " has " + std::to_string(st.st_size) + " bytes; the initial state " +
                         ShapeString(state.initial_dims) + " of " +
                         std::string(TritonDataTypeName(state.dtype)) + " takes " +
                         std::to_string(*bytes));
    state.initial_data.resize(*bytes);
    size_t got = 0;
    while (got < state.initial_data.size()) {
      const ssize_t n =
          ::read(fd->get(), state.initial_data.data() + got, state.initial_data.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return c.Error(
            e["initial_state"][0]["data_file"], f,
            "reading " + path +
                (n == 0 ? ": it ended early" : ": " + std::string(std::strerror(errno))));
      got += static_cast<size_t>(n);
    }
  }
  return state;
}

}  // namespace

Status ReadSequenceBatching(const Ctx& c, const YAML::Node& node, ModelConfig& m) {
  const std::string field = "sequence_batching";
  RETURN_IF_ERROR(
      CheckKeys(c, node, field,
                {"max_sequence_idle_microseconds", "control_input", "state", "direct", "oldest"},
                {"iterative_sequence"}));
  if (m.decoupled)
    return c.Error(node, field,
                   "hearth runs sequences of models that answer each request once; this "
                   "model is decoupled");
  if (m.inputs.empty())
    return c.Error(node, field,
                   "a sequence model lists its input and output (the server adds its control "
                   "and state tensors to them)");
  if (node["direct"] && node["oldest"])
    return c.Error(node["oldest"], field + ".oldest", "give one strategy: direct or oldest");
  SequenceBatching s;
  // The model's directory, where initial_state/ is.
  const std::string model_dir = std::filesystem::path(m.config_path).parent_path().string();
  if (const YAML::Node idle = node["max_sequence_idle_microseconds"]) {
    ASSIGN_OR_RETURN(s.max_idle_us,
                     Number<uint64_t>(c, idle, field + ".max_sequence_idle_microseconds"));
    if (s.max_idle_us == 0) s.max_idle_us = 1'000'000;  // Triton's default
  }
  s.oldest = static_cast<bool>(node["oldest"]);
  if (const YAML::Node strategy = s.oldest ? node["oldest"] : node["direct"])
    RETURN_IF_ERROR(ReadStrategy(c, strategy, s.oldest, m));

  std::set<std::string> names;
  for (const IoConfig& io : m.inputs) names.insert(io.name);
  std::set<std::string> output_names;
  for (const IoConfig& io : m.outputs) output_names.insert(io.name);
  if (const YAML::Node list = node["control_input"]) {
    const std::string f = field + ".control_input";
    if (!list.IsSequence()) return c.Error(list, f, "must be a list");
    std::set<SequenceControl::Kind> kinds;
    for (size_t i = 0; i < list.size(); ++i) {
      const YAML::Node e = list[i];
      const std::string fi = f + "[" + std::to_string(i) + "]";
      RETURN_IF_ERROR(CheckKeys(c, e, fi, {"name", "control"}));
      if (!e["name"] || !e["control"]) return c.Error(e, fi, "needs name and control");
      ASSIGN_OR_RETURN(std::string name, String(c, e["name"], fi + ".name"));
      if (name.empty() || name.size() > kMaxTensorNameBytes)
        return c.Error(e["name"], fi + ".name",
                       "must have 1 to " + std::to_string(kMaxTensorNameBytes) + " bytes");
      if (!names.insert(name).second)
        return c.Error(e["name"], fi + ".name", Quote(name) + " is already an input of the model");
      const YAML::Node controls = e["control"];
      if (!controls.IsSequence() || controls.size() != 1)
        return c.Error(controls, fi + ".control",
                       "must be a list of one control (hearth gives each control its own input)");
      ASSIGN_OR_RETURN(SequenceControl control, ReadControl(c, controls[0], fi + ".control[0]"));
      if (!kinds.insert(control.kind).second)
        return c.Error(controls[0], fi + ".control[0].kind",
                       std::string(KindName(control.kind)) + " is given twice");
      control.input = name;
      s.controls.push_back(std::move(control));
    }
  }
  if (const YAML::Node list = node["state"]) {
    const std::string f = field + ".state";
    if (!list.IsSequence()) return c.Error(list, f, "must be a list");
    if (list.size() > kMaxSequenceStates)
      return c.Error(list, f, "more than " + std::to_string(kMaxSequenceStates) + " states");
    uint64_t total = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string fi = f + "[" + std::to_string(i) + "]";
      ASSIGN_OR_RETURN(SequenceState state, ReadState(c, list[i], fi, model_dir));
      if (!names.insert(state.input).second)
        return c.Error(list[i]["input_name"], fi + ".input_name",
                       Quote(state.input) + " is already an input of the model");
      if (!output_names.insert(state.output).second)
        return c.Error(list[i]["output_name"], fi + ".output_name",
                       Quote(state.output) + " is already an output of the model");
      total += TensorBytes(state.dtype, state.initial_dims).value_or(0);
      if (total > kMaxSequenceStateBytes)
        return c.Error(list[i], fi,
                       "the initial states come to more than the limit of " +
                           std::to_string(kMaxSequenceStateBytes) + " bytes");
      s.states.push_back(std::move(state));
    }
  }
  if (names.size() > kMaxModelTensors || output_names.size() > kMaxModelTensors)
    return c.Error(node, field,
                   "with its control and state tensors the model has more than " +
                       std::to_string(kMaxModelTensors) + " inputs or outputs");
  m.sequence = std::move(s);
  return Status::Ok();
}

}  // namespace hearth

namespace hearth {

std::vector<IoConfig> WorkerInputs(const ModelConfig& config) {
  std::vector<IoConfig> out = config.inputs;
  if (!config.sequence) return out;
  for (const SequenceControl& control : config.sequence->controls)
    out.push_back({control.input, control.dtype, {1}});
  for (const SequenceState& state : config.sequence->states)
    out.push_back({state.input, state.dtype, state.dims});
  return out;
}

std::vector<IoConfig> WorkerOutputs(const ModelConfig& config) {
  std::vector<IoConfig> out = config.outputs;
  if (!config.sequence) return out;
  for (const SequenceState& state : config.sequence->states)
    out.push_back({state.output, state.dtype, state.dims});
  return out;
}

}  // namespace hearth
