#include "server/model_config_pbtxt.h"

#ifdef HEARTH_HAVE_PROTOBUF
#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <string_view>
#include <type_traits>

#include "model_config.pb.h"
#endif

namespace hearth {

#ifndef HEARTH_HAVE_PROTOBUF

Result<PbtxtAsYaml> PbtxtToYaml(const std::string& path, const std::string&) {
  return Unimplemented(path +
                       ": this hearth was built without protobuf, which reads config.pbtxt "
                       "(install libprotobuf-dev and protobuf-compiler and build again), or "
                       "write the model's config as config.yaml");
}

Result<std::string> ModelConfigJsonToPbtxt(const std::string&) {
  return Unimplemented(
      "a config override needs protobuf, which this hearth was built without (install "
      "libprotobuf-dev and protobuf-compiler and build again)");
}

#else

namespace {

namespace pb = google::protobuf;
using ParseInfoTree = pb::TextFormat::ParseInfoTree;

// The fields hearth implements, by their path in inference.ModelConfig
// (without indices; a map's entries are `key` and `value`). Any other field
// set in a config.pbtxt is an error naming it.
const std::set<std::string_view>& Implemented() {
  static const std::set<std::string_view> fields = {
      "name",
      "platform",
      "backend",
      "max_batch_size",
      "version_policy",
      "version_policy.latest",
      "version_policy.latest.num_versions",
      "version_policy.specific",
      "version_policy.specific.versions",
      "input",
      "input.name",
      "input.data_type",
      "input.dims",
      "input.optional",
      "input.format",
      "output",
      "output.name",
      "output.data_type",
      "output.dims",
      "output.label_filename",
      "instance_group",
      "instance_group.name",
      "instance_group.count",
      "instance_group.kind",
      "instance_group.gpus",
      "dynamic_batching",
      "dynamic_batching.preferred_batch_size",
      "dynamic_batching.max_queue_delay_microseconds",
      "dynamic_batching.priority_levels",
      "dynamic_batching.default_priority_level",
      "dynamic_batching.default_queue_policy",
      "dynamic_batching.default_queue_policy.default_timeout_microseconds",
      "dynamic_batching.default_queue_policy.max_queue_size",
      "parameters",
      "parameters.key",
      "parameters.value",
      "parameters.value.string_value",
      "model_transaction_policy",
      "model_transaction_policy.decoupled",
      "sequence_batching",
      "sequence_batching.max_sequence_idle_microseconds",
      "sequence_batching.direct",
      "sequence_batching.direct.max_queue_delay_microseconds",
      "sequence_batching.direct.minimum_slot_utilization",
      "sequence_batching.oldest",
      "sequence_batching.oldest.max_candidate_sequences",
      "sequence_batching.oldest.preferred_batch_size",
      "sequence_batching.oldest.max_queue_delay_microseconds",
      "sequence_batching.oldest.preserve_ordering",
      "sequence_batching.control_input",
      "sequence_batching.control_input.name",
      "sequence_batching.control_input.control",
      "sequence_batching.control_input.control.kind",
      "sequence_batching.control_input.control.int32_false_true",
      "sequence_batching.control_input.control.fp32_false_true",
      "sequence_batching.control_input.control.bool_false_true",
      "sequence_batching.control_input.control.data_type",
      "sequence_batching.state",
      "sequence_batching.state.input_name",
      "sequence_batching.state.output_name",
      "sequence_batching.state.data_type",
      "sequence_batching.state.dims",
      "sequence_batching.state.initial_state",
      "sequence_batching.state.initial_state.data_type",
      "sequence_batching.state.initial_state.dims",
      "sequence_batching.state.initial_state.zero_data",
      "sequence_batching.state.initial_state.data_file",
      "sequence_batching.state.initial_state.name",
      "ensemble_scheduling",
      "ensemble_scheduling.step",
      "ensemble_scheduling.step.model_name",
      "ensemble_scheduling.step.model_version",
      "ensemble_scheduling.step.input_map",
      "ensemble_scheduling.step.input_map.key",
      "ensemble_scheduling.step.input_map.value",
      "ensemble_scheduling.step.output_map",
      "ensemble_scheduling.step.output_map.key",
      "ensemble_scheduling.step.output_map.value",
  };
  return fields;
}

// Fields of Triton's model configuration that proto/model_config.proto
// leaves out, by message: the parser refuses them as unknown, and the error
// then says that they are Triton's and not hearth's.
const std::map<std::string_view, std::set<std::string_view> >& TritonOnly() {
  static const std::map<std::string_view, std::set<std::string_view> > fields = {
      {"inference.ModelConfig",
       {"runtime", "batch_input", "batch_output", "optimization", "cc_model_filenames",
        "metric_tags", "model_warmup", "model_operations", "model_repository_agents",
        "model_metrics"}},
      {"inference.ModelInstanceGroup",
       {"rate_limiter", "secondary_devices", "profile", "passive", "host_policy"}},
      {"inference.ModelSequenceBatching", {"iterative_sequence"}},
      {"inference.ModelSequenceBatching.State",
       {"use_same_buffer_for_input_output", "use_growable_memory"}},
      {"inference.ModelInput", {"is_non_linear_format_io"}},
      {"inference.ModelOutput", {"is_non_linear_format_io"}},
  };
  return fields;
}

constexpr std::string_view kNotImplemented =
    "hearth does not implement this field of Triton's model configuration (remove it)";

// The first error the parser reports, with its place (0-based, as reported).
class FirstError final : public pb::io::ErrorCollector {
 public:
#if GOOGLE_PROTOBUF_VERSION >= 4022000
  void RecordError(int line, pb::io::ColumnNumber column, absl::string_view message) override {
    Keep(line, column, std::string(message));
  }
#else
  void AddError(int line, pb::io::ColumnNumber column, const std::string& message) override {
    Keep(line, column, message);
  }
#endif

  bool seen = false;
  int first_line = -1;
  int first_column = -1;
  std::string first_message;

 private:
  void Keep(int l, int c, std::string m) {
    if (seen) return;
    seen = true;
    first_line = l;
    first_column = c;
    first_message = std::move(m);
  }
};

std::string Place(int line, int column) {
  if (line < 0) return "";
  return std::to_string(line + 1) + ":" + std::to_string(column + 1);
}

// Where field `name` of the message `tree` describes was written (its
// `index`th value; a list written [a, b] has one place, its start), or "".
std::string At(const ParseInfoTree* tree, const pb::Descriptor* d, const char* name,
               int index = 0) {
  if (tree == nullptr) return "";
  const pb::FieldDescriptor* f = d->FindFieldByName(name);
  if (f == nullptr) return "";
  if (!f->is_repeated()) index = -1;  // what ParseInfoTree asks of a singular field
  pb::TextFormat::ParseLocation at = tree->GetLocation(f, index);
  if (at.line < 0 && index > 0) at = tree->GetLocation(f, 0);
  return Place(at.line, at.column);
}

const ParseInfoTree* Nested(const ParseInfoTree* tree, const pb::Descriptor* d, const char* name,
                            int index = 0) {
  if (tree == nullptr) return nullptr;
  const pb::FieldDescriptor* f = d->FindFieldByName(name);
  if (f == nullptr) return nullptr;
  return tree->GetTreeForNested(f, f->is_repeated() ? index : -1);
}

Status ErrorAt(const std::string& path, const std::string& place, const std::string& field,
               std::string_view what) {
  return InvalidArgument(path + (place.empty() ? "" : ":" + place) + ": " + field + ": " +
                         std::string(what));
}

// Every field set in `m` is one of Implemented(); `field` is how errors
// name `m` (input[0]), `schema` its path without indices (input).
Status CheckImplemented(const std::string& path, const pb::Message& m, const ParseInfoTree* tree,
                        const std::string& field, const std::string& schema) {
  const pb::Reflection* r = m.GetReflection();
  std::vector<const pb::FieldDescriptor*> set;
  r->ListFields(m, &set);
  for (const pb::FieldDescriptor* f : set) {
    const std::string name = field.empty() ? f->name() : field + "." + f->name();
    const std::string where = schema.empty() ? f->name() : schema + "." + f->name();
    if (Implemented().count(where) == 0) {
      const int index = f->is_repeated() ? 0 : -1;
      const std::string place = tree == nullptr ? ""
                                                : Place(tree->GetLocation(f, index).line,
                                                        tree->GetLocation(f, index).column);
      if (where == "version_policy.all")
        return ErrorAt(path, place, name,
                       "hearth serves one version of a model: leave version_policy out, or give "
                       "latest { num_versions: 1 } (the highest version) or specific { versions: "
                       "N }");
      return ErrorAt(path, place, name, kNotImplemented);
    }
    if (f->cpp_type() != pb::FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(m, f); ++i)
        RETURN_IF_ERROR(CheckImplemented(path, r->GetRepeatedMessage(m, f, i),
                                         tree ? tree->GetTreeForNested(f, i) : nullptr,
                                         name + "[" + std::to_string(i) + "]", where));
    } else {
      RETURN_IF_ERROR(CheckImplemented(
          path, r->GetMessage(m, f), tree ? tree->GetTreeForNested(f, -1) : nullptr, name, where));
    }
  }
  return Status::Ok();
}

// The 0-based column where `name` last begins on line `line` of `text`
// before `column`, or npos.
size_t NameColumn(std::string_view text, int line, int column, std::string_view name) {
  if (line < 0 || column < 0) return std::string_view::npos;
  size_t start = 0;
  for (int l = 0; l < line; ++l) {
    start = text.find('\n', start);
    if (start == std::string_view::npos) return std::string_view::npos;
    ++start;
  }
  const std::string_view rest = text.substr(start);
  const std::string_view upto =
      rest.substr(0, std::min<size_t>(static_cast<size_t>(column), rest.find('\n')));
  return upto.rfind(name);
}

bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    i += n;
  }
  return true;
}

// The YAML being written, a line at a time, each with where it came from.
class Writer {
 public:
  explicit Writer(const std::string& path) : path_(path) {}

  void Line(int indent, const std::string& text, const std::string& origin) {
    out_.yaml += std::string(indent, ' ') + text + "\n";
    out_.origins.push_back(origin);
  }

  // A string as a YAML double-quoted scalar; strings that are not UTF-8
  // are refused (YAML holds text).
  Result<std::string> Quote(const std::string& s, const std::string& place,
                            const std::string& field) const {
    if (!ValidUtf8(s)) return ErrorAt(path_, place, field, "is not valid UTF-8");
    std::string q = "\"";
    for (char ch : s) {
      const auto u = static_cast<unsigned char>(ch);
      if (ch == '"' || ch == '\\') {
        q += '\\';
        q += ch;
      } else if (u < 0x20 || u == 0x7f) {
        char hex[5];
        std::snprintf(hex, sizeof hex, "\\x%02x", u);
        q += hex;
      } else {
        q += ch;
      }
    }
    return q + "\"";
  }

  PbtxtAsYaml Take() { return std::move(out_); }

 private:
  const std::string& path_;
  PbtxtAsYaml out_;
};

// Triton's platforms, as the backends hearth would run them under.
Result<std::string> BackendOfPlatform(const std::string& path, const std::string& place,
                                      const std::string& platform) {
  static const std::map<std::string_view, std::string_view> kPlatforms = {
      {"onnxruntime_onnx", "onnxruntime"},   {"pytorch_libtorch", "pytorch"},
      {"tensorflow_graphdef", "tensorflow"}, {"tensorflow_savedmodel", "tensorflow"},
      {"tensorrt_plan", "tensorrt"},
  };
  const auto it = kPlatforms.find(platform);
  if (it != kPlatforms.end()) return std::string(it->second);
  return ErrorAt(path, place, "platform",
                 "'" + platform.substr(0, 64) +
                     "' is not a platform hearth knows (ensemble, onnxruntime_onnx, "
                     "pytorch_libtorch, tensorflow_graphdef, tensorflow_savedmodel, "
                     "tensorrt_plan); give the model's backend instead");
}

// The fields every entry of input and output has.
template <typename Io>
Status WriteIos(Writer& w, const char* list, const pb::RepeatedPtrField<Io>& ios,
                const ParseInfoTree* tree) {
  if (ios.empty()) return Status::Ok();
  const pb::Descriptor* top = inference::ModelConfig::descriptor();
  const pb::Descriptor* d = Io::descriptor();
  w.Line(0, std::string(list) + ":", At(tree, top, list));
  for (int i = 0; i < ios.size(); ++i) {
    const Io& io = ios.Get(i);
    const ParseInfoTree* t = Nested(tree, top, list, i);
    const std::string field = std::string(list) + "[" + std::to_string(i) + "]";
    bool first = true;
    auto lead = [&first] {
      const char* l = first ? "- " : "  ";
      first = false;
      return std::string(l);
    };
    if (!io.name().empty()) {
      ASSIGN_OR_RETURN(std::string name, w.Quote(io.name(), At(t, d, "name"), field + ".name"));
      w.Line(2, lead() + "name: " + name, At(t, d, "name"));
    }
    if (io.data_type() != inference::TYPE_INVALID)
      w.Line(2, lead() + "data_type: " + inference::DataType_Name(io.data_type()),
             At(t, d, "data_type"));
    if (io.dims_size() > 0) {
      w.Line(2, lead() + "dims:", At(t, d, "dims"));
      for (int k = 0; k < io.dims_size(); ++k)
        w.Line(6, "- " + std::to_string(io.dims(k)), At(t, d, "dims", k));
    }
    if constexpr (std::is_same_v<Io, inference::ModelInput>) {
      if (io.optional()) w.Line(2, lead() + "optional: true", At(t, d, "optional"));
      if (io.format() != inference::ModelInput::FORMAT_NONE)
        w.Line(2, lead() + "format: " + inference::ModelInput::Format_Name(io.format()),
               At(t, d, "format"));
    } else {
      if (!io.label_filename().empty()) {
        ASSIGN_OR_RETURN(std::string file, w.Quote(io.label_filename(), At(t, d, "label_filename"),
                                                   field + ".label_filename"));
        w.Line(2, lead() + "label_filename: " + file, At(t, d, "label_filename"));
      }
    }
    if (first) w.Line(2, "- {}", At(tree, top, list, i));
  }
  return Status::Ok();
}

// A list of numbers as a YAML flow list: [a, b].
template <typename List>
std::string FlowList(const List& values) {
  std::string out = "[";
  for (int k = 0; k < values.size(); ++k) {
    if (k > 0) out += ", ";
    if constexpr (std::is_same_v<std::decay_t<decltype(values.Get(k))>, bool>) {
      out += values.Get(k) ? "true" : "false";
    } else if constexpr (std::is_floating_point_v<std::decay_t<decltype(values.Get(k))> >) {
      char buffer[32];
      std::snprintf(buffer, sizeof buffer, "%.9g", static_cast<double>(values.Get(k)));
      out += buffer;
    } else {
      out += std::to_string(values.Get(k));
    }
  }
  return out + "]";
}

// sequence_batching, its fields as the YAML reader takes them
// (server/sequence_config.h), which checks them.
Status WriteSequence(Writer& w, const inference::ModelSequenceBatching& s,
                     const ParseInfoTree* tree) {
  using Sequence = inference::ModelSequenceBatching;
  const pb::Descriptor* top = inference::ModelConfig::descriptor();
  const pb::Descriptor* d = Sequence::descriptor();
  const ParseInfoTree* t = Nested(tree, top, "sequence_batching");
  w.Line(0, "sequence_batching:", At(tree, top, "sequence_batching"));
  // An empty map, whatever follows.
  w.Line(2, "max_sequence_idle_microseconds: " + std::to_string(s.max_sequence_idle_microseconds()),
         At(t, d, "max_sequence_idle_microseconds"));
  if (s.has_direct()) {
    const auto& direct = s.direct();
    const ParseInfoTree* st = Nested(t, d, "direct");
    const pb::Descriptor* sd = Sequence::StrategyDirect::descriptor();
    w.Line(2, "direct:", At(t, d, "direct"));
    w.Line(4,
           "max_queue_delay_microseconds: " + std::to_string(direct.max_queue_delay_microseconds()),
           At(st, sd, "max_queue_delay_microseconds"));
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.9g",
                  static_cast<double>(direct.minimum_slot_utilization()));
    w.Line(4, std::string("minimum_slot_utilization: ") + buffer,
           At(st, sd, "minimum_slot_utilization"));
  } else if (s.has_oldest()) {
    const auto& oldest = s.oldest();
    const ParseInfoTree* st = Nested(t, d, "oldest");
    const pb::Descriptor* sd = Sequence::StrategyOldest::descriptor();
    w.Line(2, "oldest:", At(t, d, "oldest"));
    w.Line(4,
           "max_queue_delay_microseconds: " + std::to_string(oldest.max_queue_delay_microseconds()),
           At(st, sd, "max_queue_delay_microseconds"));
    if (oldest.max_candidate_sequences() != 0)
      w.Line(4, "max_candidate_sequences: " + std::to_string(oldest.max_candidate_sequences()),
             At(st, sd, "max_candidate_sequences"));
    if (oldest.preferred_batch_size_size() > 0)
      w.Line(4, "preferred_batch_size: " + FlowList(oldest.preferred_batch_size()),
             At(st, sd, "preferred_batch_size"));
    w.Line(4, std::string("preserve_ordering: ") + (oldest.preserve_ordering() ? "true" : "false"),
           At(st, sd, "preserve_ordering"));
  }
  if (s.control_input_size() > 0) {
    const pb::Descriptor* cd = Sequence::ControlInput::descriptor();
    const pb::Descriptor* kd = Sequence::Control::descriptor();
    w.Line(2, "control_input:", At(t, d, "control_input"));
    for (int i = 0; i < s.control_input_size(); ++i) {
      const auto& input = s.control_input(i);
      const ParseInfoTree* it = Nested(t, d, "control_input", i);
      const std::string field = "sequence_batching.control_input[" + std::to_string(i) + "]";
      ASSIGN_OR_RETURN(std::string name,
                       w.Quote(input.name(), At(it, cd, "name"), field + ".name"));
      w.Line(4, "- name: " + name, At(t, d, "control_input", i));
      w.Line(4, "  control:", At(it, cd, "control"));
      for (int k = 0; k < input.control_size(); ++k) {
        const auto& control = input.control(k);
        const ParseInfoTree* kt = Nested(it, cd, "control", k);
        w.Line(8, "- kind: " + Sequence::Control::Kind_Name(control.kind()),
               At(it, cd, "control", k));
        if (control.int32_false_true_size() > 0)
          w.Line(8, "  int32_false_true: " + FlowList(control.int32_false_true()),
                 At(kt, kd, "int32_false_true"));
        if (control.fp32_false_true_size() > 0)
          w.Line(8, "  fp32_false_true: " + FlowList(control.fp32_false_true()),
                 At(kt, kd, "fp32_false_true"));
        if (control.bool_false_true_size() > 0)
          w.Line(8, "  bool_false_true: " + FlowList(control.bool_false_true()),
                 At(kt, kd, "bool_false_true"));
        if (control.data_type() != inference::TYPE_INVALID)
          w.Line(8, "  data_type: " + inference::DataType_Name(control.data_type()),
                 At(kt, kd, "data_type"));
      }
    }
  }
  if (s.state_size() > 0) {
    const pb::Descriptor* sd = Sequence::State::descriptor();
    const pb::Descriptor* id = Sequence::InitialState::descriptor();
    w.Line(2, "state:", At(t, d, "state"));
    for (int i = 0; i < s.state_size(); ++i) {
      const auto& state = s.state(i);
      const ParseInfoTree* st = Nested(t, d, "state", i);
      const std::string field = "sequence_batching.state[" + std::to_string(i) + "]";
      ASSIGN_OR_RETURN(std::string in, w.Quote(state.input_name(), At(st, sd, "input_name"),
                                               field + ".input_name"));
      ASSIGN_OR_RETURN(std::string out, w.Quote(state.output_name(), At(st, sd, "output_name"),
                                                field + ".output_name"));
      w.Line(4, "- input_name: " + in, At(t, d, "state", i));
      w.Line(4, "  output_name: " + out, At(st, sd, "output_name"));
      w.Line(4, "  data_type: " + inference::DataType_Name(state.data_type()),
             At(st, sd, "data_type"));
      w.Line(4, "  dims: " + FlowList(state.dims()), At(st, sd, "dims"));
      if (state.initial_state_size() > 0) {
        w.Line(4, "  initial_state:", At(st, sd, "initial_state"));
        for (int k = 0; k < state.initial_state_size(); ++k) {
          const auto& initial = state.initial_state(k);
          const ParseInfoTree* it = Nested(st, sd, "initial_state", k);
          w.Line(8, "- data_type: " + inference::DataType_Name(initial.data_type()),
                 At(st, sd, "initial_state", k));
          w.Line(8, "  dims: " + FlowList(initial.dims()), At(it, id, "dims"));
          if (initial.has_zero_data()) w.Line(8, "  zero_data: true", At(it, id, "zero_data"));
          if (initial.has_data_file()) {
            ASSIGN_OR_RETURN(std::string file, w.Quote(initial.data_file(), At(it, id, "data_file"),
                                                       field + ".initial_state.data_file"));
            w.Line(8, "  data_file: " + file, At(it, id, "data_file"));
          }
        }
      }
    }
  }
  return Status::Ok();
}

// ensemble_scheduling, its maps' entries in the file's order (read through
// reflection, so that a key written twice is seen, as in parameters).
Status WriteEnsemble(Writer& w, const inference::ModelEnsembling& e, const ParseInfoTree* tree) {
  using Step = inference::ModelEnsembling::Step;
  const pb::Descriptor* top = inference::ModelConfig::descriptor();
  const pb::Descriptor* d = inference::ModelEnsembling::descriptor();
  const pb::Descriptor* sd = Step::descriptor();
  const ParseInfoTree* t = Nested(tree, top, "ensemble_scheduling");
  if (e.step_size() == 0) {
    w.Line(0, "ensemble_scheduling: {}", At(tree, top, "ensemble_scheduling"));
    return Status::Ok();
  }
  w.Line(0, "ensemble_scheduling:", At(tree, top, "ensemble_scheduling"));
  w.Line(2, "step:", At(t, d, "step"));
  for (int i = 0; i < e.step_size(); ++i) {
    const Step& step = e.step(i);
    const ParseInfoTree* st = Nested(t, d, "step", i);
    const std::string field = "ensemble_scheduling.step[" + std::to_string(i) + "]";
    ASSIGN_OR_RETURN(std::string name,
                     w.Quote(step.model_name(), At(st, sd, "model_name"), field + ".model_name"));
    w.Line(4, "- model_name: " + name, At(t, d, "step", i));
    if (step.model_version() != 0)
      w.Line(4, "  model_version: " + std::to_string(step.model_version()),
             At(st, sd, "model_version"));
    for (const char* map : {"input_map", "output_map"}) {
      const pb::Reflection* r = step.GetReflection();
      const pb::FieldDescriptor* f = sd->FindFieldByName(map);
      const int n = r->FieldSize(step, f);
      if (n == 0) continue;
      w.Line(4, std::string("  ") + map + ":", At(st, sd, map));
      for (int k = 0; k < n; ++k) {
        const pb::Message& entry = r->GetRepeatedMessage(step, f, k);
        const pb::Descriptor* ed = entry.GetDescriptor();
        const pb::Reflection* er = entry.GetReflection();
        const ParseInfoTree* et = Nested(st, sd, map, k);
        const std::string place = et != nullptr ? At(et, ed, "key") : At(st, sd, map, k);
        const std::string entry_field = field + "." + map + "[" + std::to_string(k) + "]";
        ASSIGN_OR_RETURN(std::string key, w.Quote(er->GetString(entry, ed->FindFieldByName("key")),
                                                  place, entry_field + ".key"));
        ASSIGN_OR_RETURN(std::string value,
                         w.Quote(er->GetString(entry, ed->FindFieldByName("value")), place,
                                 entry_field + ".value"));
        w.Line(8, key + ": " + value, place);
      }
    }
  }
  return Status::Ok();
}

Result<PbtxtAsYaml> Write(const std::string& path, const inference::ModelConfig& mc,
                          const ParseInfoTree* tree) {
  Writer w(path);
  const pb::Descriptor* top = inference::ModelConfig::descriptor();
  if (!mc.name().empty()) {
    ASSIGN_OR_RETURN(std::string name, w.Quote(mc.name(), At(tree, top, "name"), "name"));
    w.Line(0, "name: " + name, At(tree, top, "name"));
  }
  if (!mc.backend().empty()) {
    ASSIGN_OR_RETURN(std::string backend,
                     w.Quote(mc.backend(), At(tree, top, "backend"), "backend"));
    w.Line(0, "backend: " + backend, At(tree, top, "backend"));
  } else if (mc.platform() == "ensemble") {
    w.Line(0, "platform: ensemble", At(tree, top, "platform"));
  } else if (!mc.platform().empty()) {
    ASSIGN_OR_RETURN(std::string backend,
                     BackendOfPlatform(path, At(tree, top, "platform"), mc.platform()));
    w.Line(0, "backend: " + backend, At(tree, top, "platform"));
  }
  if (mc.max_batch_size() != 0)
    w.Line(0, "max_batch_size: " + std::to_string(mc.max_batch_size()),
           At(tree, top, "max_batch_size"));
  RETURN_IF_ERROR(WriteIos(w, "input", mc.input(), tree));
  RETURN_IF_ERROR(WriteIos(w, "output", mc.output(), tree));

  if (mc.instance_group_size() > 0) {
    const pb::Descriptor* d = inference::ModelInstanceGroup::descriptor();
    w.Line(0, "instance_group:", At(tree, top, "instance_group"));
    for (int i = 0; i < mc.instance_group_size(); ++i) {
      const inference::ModelInstanceGroup& g = mc.instance_group(i);
      const ParseInfoTree* t = Nested(tree, top, "instance_group", i);
      const std::string field = "instance_group[" + std::to_string(i) + "]";
      bool first = true;
      auto lead = [&first] {
        const char* l = first ? "- " : "  ";
        first = false;
        return std::string(l);
      };
      if (!g.name().empty()) {
        ASSIGN_OR_RETURN(std::string name, w.Quote(g.name(), At(t, d, "name"), field + ".name"));
        w.Line(2, lead() + "name: " + name, At(t, d, "name"));
      }
      if (g.count() != 0)
        w.Line(2, lead() + "count: " + std::to_string(g.count()), At(t, d, "count"));
      // KIND_AUTO (0, unset) is Triton's default: the GPUs where there are
      // some, which is hearth's default too.
      if (g.kind() != inference::ModelInstanceGroup::KIND_AUTO)
        w.Line(2, lead() + "kind: " + inference::ModelInstanceGroup::Kind_Name(g.kind()),
               At(t, d, "kind"));
      if (g.gpus_size() > 0) {
        w.Line(2, lead() + "gpus:", At(t, d, "gpus"));
        for (int k = 0; k < g.gpus_size(); ++k)
          w.Line(6, "- " + std::to_string(g.gpus(k)), At(t, d, "gpus", k));
      }
      if (first) w.Line(2, "- {}", At(tree, top, "instance_group", i));
    }
  }

  if (mc.has_dynamic_batching()) {
    const inference::ModelDynamicBatching& b = mc.dynamic_batching();
    const pb::Descriptor* d = inference::ModelDynamicBatching::descriptor();
    const ParseInfoTree* t = Nested(tree, top, "dynamic_batching");
    std::vector<std::pair<std::string, std::string> > lines;
    if (b.preferred_batch_size_size() > 0) {
      lines.emplace_back("  preferred_batch_size:", At(t, d, "preferred_batch_size"));
      for (int k = 0; k < b.preferred_batch_size_size(); ++k)
        lines.emplace_back("    - " + std::to_string(b.preferred_batch_size(k)),
                           At(t, d, "preferred_batch_size", k));
    }
    if (b.max_queue_delay_microseconds() != 0)
      lines.emplace_back(
          "  max_queue_delay_microseconds: " + std::to_string(b.max_queue_delay_microseconds()),
          At(t, d, "max_queue_delay_microseconds"));
    if (b.priority_levels() != 0)
      lines.emplace_back("  priority_levels: " + std::to_string(b.priority_levels()),
                         At(t, d, "priority_levels"));
    if (b.default_priority_level() != 0)
      lines.emplace_back("  default_priority_level: " + std::to_string(b.default_priority_level()),
                         At(t, d, "default_priority_level"));
    if (b.has_default_queue_policy()) {
      const inference::ModelQueuePolicy& q = b.default_queue_policy();
      const pb::Descriptor* qd = inference::ModelQueuePolicy::descriptor();
      const ParseInfoTree* qt = Nested(t, d, "default_queue_policy");
      // Triton's max_queue_size is the default queue's; 0 there is no limit,
      // which hearth does not have: left out, hearth's own limit holds.
      if (q.max_queue_size() != 0)
        lines.emplace_back("  max_queue_size: " + std::to_string(q.max_queue_size()),
                           At(qt, qd, "max_queue_size"));
      if (q.default_timeout_microseconds() != 0) {
        lines.emplace_back("  default_queue_policy:", At(t, d, "default_queue_policy"));
        lines.emplace_back(
            "    default_timeout_microseconds: " + std::to_string(q.default_timeout_microseconds()),
            At(qt, qd, "default_timeout_microseconds"));
      }
    }
    if (lines.empty()) {
      w.Line(0, "dynamic_batching: {}", At(tree, top, "dynamic_batching"));
    } else {
      w.Line(0, "dynamic_batching:", At(tree, top, "dynamic_batching"));
      for (const auto& [text, origin] : lines) w.Line(0, text, origin);
    }
  }

  if (mc.parameters_size() > 0) {
    // Through reflection, so that the entries come in the file's order and a
    // key written twice is seen (the map keeps one of them).
    const pb::Reflection* r = mc.GetReflection();
    const pb::FieldDescriptor* f = top->FindFieldByName("parameters");
    w.Line(0, "parameters:", At(tree, top, "parameters"));
    for (int i = 0; i < r->FieldSize(mc, f); ++i) {
      const pb::Message& entry = r->GetRepeatedMessage(mc, f, i);
      const pb::Descriptor* ed = entry.GetDescriptor();
      const pb::Reflection* er = entry.GetReflection();
      const std::string key = er->GetString(entry, ed->FindFieldByName("key"));
      const auto& value = static_cast<const inference::ModelParameter&>(
          er->GetMessage(entry, ed->FindFieldByName("value")));
      const ParseInfoTree* et = Nested(tree, top, "parameters", i);
      const std::string place = et != nullptr ? At(et, ed, "key") : At(tree, top, "parameters", i);
      const std::string field = "parameters[" + std::to_string(i) + "]";
      ASSIGN_OR_RETURN(std::string k, w.Quote(key, place, field + ".key"));
      ASSIGN_OR_RETURN(std::string v,
                       w.Quote(value.string_value(), place, field + ".value.string_value"));
      w.Line(2, k + ": " + v, place);
    }
  }

  if (mc.has_model_transaction_policy()) {
    const ParseInfoTree* t = Nested(tree, top, "model_transaction_policy");
    w.Line(0, "model_transaction_policy:", At(tree, top, "model_transaction_policy"));
    const bool decoupled = mc.model_transaction_policy().decoupled();
    w.Line(2, std::string("decoupled: ") + (decoupled ? "true" : "false"),
           decoupled ? At(t, inference::ModelTransactionPolicy::descriptor(), "decoupled")
                     : At(tree, top, "model_transaction_policy"));
  }

  if (mc.has_sequence_batching()) RETURN_IF_ERROR(WriteSequence(w, mc.sequence_batching(), tree));
  if (mc.has_ensemble_scheduling())
    RETURN_IF_ERROR(WriteEnsemble(w, mc.ensemble_scheduling(), tree));

  if (mc.has_version_policy()) {
    const inference::ModelVersionPolicy& v = mc.version_policy();
    const pb::Descriptor* d = inference::ModelVersionPolicy::descriptor();
    const ParseInfoTree* t = Nested(tree, top, "version_policy");
    if (v.has_latest() && v.latest().num_versions() > 1)
      return ErrorAt(path,
                     At(Nested(t, d, "latest"), inference::ModelVersionPolicy::Latest::descriptor(),
                        "num_versions"),
                     "version_policy.latest.num_versions",
                     "hearth serves one version of a model (the highest): give 1, or leave "
                     "version_policy out");
    // latest { num_versions: 1 } is what hearth does without a version_policy.
    if (v.has_specific()) {
      const ParseInfoTree* st = Nested(t, d, "specific");
      const pb::Descriptor* sd = inference::ModelVersionPolicy::Specific::descriptor();
      if (v.specific().versions_size() != 1)
        return ErrorAt(path, At(t, d, "specific"), "version_policy.specific.versions",
                       "hearth serves one version of a model: give one version");
      w.Line(0, "version_policy:", At(tree, top, "version_policy"));
      w.Line(2, "specific:", At(t, d, "specific"));
      w.Line(4, "versions:", At(st, sd, "versions"));
      w.Line(6, "- " + std::to_string(v.specific().versions(0)), At(st, sd, "versions"));
    }
  }
  return w.Take();
}

}  // namespace

Result<PbtxtAsYaml> PbtxtToYaml(const std::string& path, const std::string& text) {
  inference::ModelConfig config;
  ParseInfoTree tree;
  FirstError errors;
  pb::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  parser.WriteLocationsTo(&tree);
  if (!parser.ParseFromString(text, &config)) {
    const std::string place = Place(errors.first_line, errors.first_column);
    std::string where = path + (place.empty() ? "" : ":" + place);
    // `Message type "inference.ModelConfig" has no field named "sequence_batching".`
    constexpr std::string_view kType = "Message type \"", kField = "\" has no field named \"";
    const std::string& e = errors.first_message;
    const size_t field_at = e.find(kField);
    if (e.rfind(kType, 0) == 0 && field_at != std::string::npos && e.size() > 1 &&
        e.back() == '.') {
      const std::string type = e.substr(kType.size(), field_at - kType.size());
      const size_t name_at = field_at + kField.size();
      const std::string name = e.substr(name_at, e.size() - 2 - name_at);
      // The parser reports the token after the name: the name's own place
      // is its last occurrence before that on the line.
      const size_t column = NameColumn(text, errors.first_line, errors.first_column, name);
      if (column != std::string::npos)
        where = path + ":" + Place(errors.first_line, static_cast<int>(column));
      const auto known = TritonOnly().find(type);
      if (known != TritonOnly().end() && known->second.count(name) > 0)
        return InvalidArgument(where + ": " + name + ": " + std::string(kNotImplemented));
      return InvalidArgument(where + ": " + name +
                             ": not a field of Triton's model configuration (" + type + ")");
    }
    return InvalidArgument(where + ": " + (e.empty() ? "not a valid config.pbtxt" : e));
  }
  RETURN_IF_ERROR(CheckImplemented(path, config, &tree, "", ""));
  ASSIGN_OR_RETURN(PbtxtAsYaml yaml, Write(path, config, &tree));
  if (yaml.yaml.empty()) {
    // Nothing set: an empty map, which then lacks its backend (not an empty YAML document).
    yaml.yaml = "{}\n";
    yaml.origins = {""};
  }
  return yaml;
}

Result<std::string> ModelConfigJsonToPbtxt(const std::string& json) {
  inference::ModelConfig config;
  pb::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto parsed = pb::util::JsonStringToMessage(json, &config, options);
  if (!parsed.ok())
    return InvalidArgument("the config override is not a model configuration hearth reads: " +
                           std::string(parsed.message()));
  std::string text;
  if (!pb::TextFormat::PrintToString(config, &text))
    return Internal("the config override could not be written as config.pbtxt");
  return text;
}

#endif  // HEARTH_HAVE_PROTOBUF

Result<PbtxtAsYaml> PbtxtToYamlNamed(const std::string& label, const std::string& text) {
  Result<PbtxtAsYaml> yaml = PbtxtToYaml(label, text);
  if (yaml.ok()) {
    yaml->origins.assign(yaml->origins.size(), "");
    return yaml;
  }
  // "LABEL:LINE:COLUMN: ..." -> "LABEL: ...".
  std::string message = yaml.status().message();
  if (message.compare(0, label.size(), label) == 0 && message.size() > label.size() &&
      message[label.size()] == ':') {
    const size_t digits = message.find_first_not_of("0123456789:", label.size());
    if (digits != std::string::npos && digits > label.size() + 1 && message[digits] == ' ')
      message.erase(label.size(), digits - 1 - label.size());
  }
  return Status(yaml.status().code(), std::move(message));
}

}  // namespace hearth
