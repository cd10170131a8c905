#include "server/model_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <optional>

namespace hearth {
namespace {

namespace fs = std::filesystem;

struct Ctx {
  std::string file;
  Status Error(const YAML::Node& node, const std::string& field, const std::string& what) const {
    const int line = node.Mark().line >= 0 ? node.Mark().line + 1 : 0;
    return InvalidArgument(file + ":" + std::to_string(line) + ": " + field + ": " + what);
  }
};

template <typename T>
Result<T> Scalar(const Ctx& c, const YAML::Node& n, const std::string& field) {
  if (!n.IsScalar()) return c.Error(n, field, "must be a single value");
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    return c.Error(n, field, "'" + n.Scalar() + "' is not a valid value");
  }
}

Result<std::vector<int64_t>> Dims(const Ctx& c, const YAML::Node& n, const std::string& field) {
  if (!n.IsSequence() || n.size() == 0) return c.Error(n, field, "must be a non-empty list of positive integers");
  std::vector<int64_t> dims;
  for (const auto& d : n) {
    ASSIGN_OR_RETURN(int64_t v, Scalar<int64_t>(c, d, field));
    if (v <= 0) return c.Error(d, field, "dimension " + std::to_string(v) + " must be positive");
    dims.push_back(v);
  }
  return dims;
}

Result<std::vector<IoConfig>> Ios(const Ctx& c, const YAML::Node& n, const std::string& field) {
  if (!n.IsSequence() || n.size() == 0) return c.Error(n, field, "must be a non-empty list");
  std::vector<IoConfig> ios;
  for (size_t i = 0; i < n.size(); ++i) {
    const YAML::Node& e = n[i];
    const std::string f = field + "[" + std::to_string(i) + "]";
    if (!e.IsMap()) return c.Error(e, f, "must be a map with name, data_type, dims");
    for (const auto& kv : e) {
      const std::string key = kv.first.as<std::string>();
      if (key != "name" && key != "data_type" && key != "dims")
        return c.Error(kv.first, f, "unknown field '" + key + "'");
    }
    if (!e["name"] || !e["data_type"] || !e["dims"])
      return c.Error(e, f, "needs name, data_type and dims");
    IoConfig io;
    ASSIGN_OR_RETURN(io.name, Scalar<std::string>(c, e["name"], f + ".name"));
    ASSIGN_OR_RETURN(std::string type, Scalar<std::string>(c, e["data_type"], f + ".data_type"));
    auto dtype = ParseTritonDataType(type);
    if (!dtype) return c.Error(e["data_type"], f + ".data_type", "'" + type + "' is not a known TYPE_*");
    io.dtype = *dtype;
    ASSIGN_OR_RETURN(io.dims, Dims(c, e["dims"], f + ".dims"));
    ios.push_back(std::move(io));
  }
  return ios;
}

}  // namespace

std::optional<DType> ParseTritonDataType(std::string_view name) {
  static const std::pair<std::string_view, DType> kTypes[] = {
      {"TYPE_FP64", DType::kF64},  {"TYPE_FP32", DType::kF32}, {"TYPE_FP16", DType::kF16},
      {"TYPE_BF16", DType::kBF16}, {"TYPE_INT64", DType::kI64}, {"TYPE_INT32", DType::kI32},
      {"TYPE_INT16", DType::kI16}, {"TYPE_INT8", DType::kI8},   {"TYPE_UINT8", DType::kU8},
      {"TYPE_BOOL", DType::kBool}};
  for (const auto& [n, d] : kTypes)
    if (n == name) return d;
  return std::nullopt;
}

Result<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  ModelConfig m;
  m.name = fs::path(model_dir).filename().string();
  m.config_path = (fs::path(model_dir) / "config.yaml").string();
  Ctx c{m.config_path};
  YAML::Node root;
  try {
    root = YAML::LoadFile(m.config_path);
  } catch (const YAML::BadFile&) {
    return NotFound(m.config_path + ": cannot be read");
  } catch (const YAML::ParserException& e) {
    return InvalidArgument(m.config_path + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
  if (!root.IsMap()) return InvalidArgument(m.config_path + ": must be a YAML map");
  static const char* kKnown[] = {"name", "backend", "max_batch_size", "input", "output",
                                 "instance_group", "dynamic_batching", "parameters",
                                 "version_policy"};
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown))
      return c.Error(kv.first, key, "unknown field");
  }
  if (root["name"]) {
    ASSIGN_OR_RETURN(std::string name, Scalar<std::string>(c, root["name"], "name"));
    if (name != m.name) return c.Error(root["name"], "name", "'" + name + "' differs from the directory name '" + m.name + "'");
  }
  if (!root["backend"]) return InvalidArgument(m.config_path + ": backend: missing (mlp or scale)");
  ASSIGN_OR_RETURN(m.backend, Scalar<std::string>(c, root["backend"], "backend"));
  if (m.backend != "mlp" && m.backend != "scale")
    return c.Error(root["backend"], "backend", "'" + m.backend + "' is not one of mlp, scale");
  if (root["max_batch_size"]) {
    ASSIGN_OR_RETURN(m.max_batch_size, Scalar<int>(c, root["max_batch_size"], "max_batch_size"));
    if (m.max_batch_size < 0 || m.max_batch_size > 4096)
      return c.Error(root["max_batch_size"], "max_batch_size", "must be in [0, 4096]");
  }
  if (!root["input"]) return InvalidArgument(m.config_path + ": input: missing");
  if (!root["output"]) return InvalidArgument(m.config_path + ": output: missing");
  ASSIGN_OR_RETURN(m.inputs, Ios(c, root["input"], "input"));
  ASSIGN_OR_RETURN(m.outputs, Ios(c, root["output"], "output"));
  if (const YAML::Node g = root["instance_group"]) {
    if (!g.IsSequence() || g.size() != 1 || !g[0].IsMap())
      return c.Error(g, "instance_group", "must be a list of one {count, kind, gpus}");
    const YAML::Node e = g[0];
    if (e["count"]) {
      ASSIGN_OR_RETURN(m.instance_count, Scalar<int>(c, e["count"], "instance_group.count"));
      if (m.instance_count < 1 || m.instance_count > 256)
        return c.Error(e["count"], "instance_group.count", "must be in [1, 256]");
    }
    if (e["kind"]) {
      ASSIGN_OR_RETURN(std::string kind, Scalar<std::string>(c, e["kind"], "instance_group.kind"));
      if (kind != "KIND_GPU" && kind != "KIND_CPU")
        return c.Error(e["kind"], "instance_group.kind", "'" + kind + "' is not KIND_GPU or KIND_CPU");
      m.kind_gpu = kind == "KIND_GPU";
    }
    if (e["gpus"]) {
      if (!e["gpus"].IsSequence()) return c.Error(e["gpus"], "instance_group.gpus", "must be a list");
      for (const auto& gpu : e["gpus"]) {
        ASSIGN_OR_RETURN(int id, Scalar<int>(c, gpu, "instance_group.gpus"));
        if (id < 0) return c.Error(gpu, "instance_group.gpus", "must be non-negative");
        m.gpus.push_back(id);
      }
    }
  }
  if (const YAML::Node d = root["dynamic_batching"]) {
    if (!d.IsMap()) return c.Error(d, "dynamic_batching", "must be a map");
    if (d["max_queue_delay_microseconds"]) {
      ASSIGN_OR_RETURN(m.max_queue_delay_us, Scalar<uint64_t>(c, d["max_queue_delay_microseconds"], "dynamic_batching.max_queue_delay_microseconds"));
    }
    if (d["max_queue_size"]) {
      ASSIGN_OR_RETURN(m.max_queue_size, Scalar<uint64_t>(c, d["max_queue_size"], "dynamic_batching.max_queue_size"));
    }
    if (const YAML::Node q = d["default_queue_policy"]) {
      if (!q.IsMap() || !q["default_timeout_microseconds"])
        return c.Error(q, "dynamic_batching.default_queue_policy", "must be {default_timeout_microseconds: N}");
      ASSIGN_OR_RETURN(m.default_timeout_us, Scalar<uint64_t>(c, q["default_timeout_microseconds"], "dynamic_batching.default_queue_policy.default_timeout_microseconds"));
    }
    if (const YAML::Node p = d["preferred_batch_size"]) {
      if (!p.IsSequence()) return c.Error(p, "dynamic_batching.preferred_batch_size", "must be a list");
      for (const auto& b : p) {
        ASSIGN_OR_RETURN(int v, Scalar<int>(c, b, "dynamic_batching.preferred_batch_size"));
        if (v < 1 || (m.max_batch_size > 0 && v > m.max_batch_size))
          return c.Error(b, "dynamic_batching.preferred_batch_size", "must be in [1, max_batch_size]");
        m.preferred_batch_sizes.push_back(v);
      }
    }
  }
  if (const YAML::Node p = root["parameters"]) {
    if (!p.IsMap()) return c.Error(p, "parameters", "must be a map");
    for (const auto& kv : p) {
      const std::string key = kv.first.as<std::string>();
      if (key == "fault_injection") {
        // Off by default; for testing crash handling:
        // {on_value: X, kind: abort|segv|hang|cuda_illegal_address}.
        const YAML::Node f = kv.second;
        if (!f.IsMap() || !f["on_value"] || !f["kind"])
          return c.Error(f, "parameters.fault_injection", "must be {on_value: NUMBER, kind: abort|segv|hang|cuda_illegal_address}");
        ASSIGN_OR_RETURN(double on_value, Scalar<double>(c, f["on_value"], "parameters.fault_injection.on_value"));
        ASSIGN_OR_RETURN(std::string kind, Scalar<std::string>(c, f["kind"], "parameters.fault_injection.kind"));
        if (kind != "abort" && kind != "segv" && kind != "hang" && kind != "cuda_illegal_address")
          return c.Error(f["kind"], "parameters.fault_injection.kind",
                         "'" + kind + "' is not abort, segv, hang or cuda_illegal_address");
        m.fault_on_value = on_value;
        m.fault_kind = kind;
        continue;
      }
      if (!kv.second.IsScalar()) return c.Error(kv.second, "parameters." + key, "must be a single value");
      m.parameters[key] = kv.second.Scalar();
    }
    if (m.parameters.count("allow_tf32")) m.allow_tf32 = m.parameters["allow_tf32"] == "true";
  }

  // Versions: numeric subdirectories with a model.safetensors; the highest
  // unless version_policy: {specific: {versions: [N]}}.
  std::vector<uint64_t> versions;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(model_dir, ec)) {
    const std::string v = e.path().filename().string();
    if (!e.is_directory() || v.empty() || !std::all_of(v.begin(), v.end(), ::isdigit)) continue;
    if (fs::exists(e.path() / "model.safetensors")) versions.push_back(std::stoull(v));
  }
  if (versions.empty())
    return NotFound(model_dir + ": no version directory with a model.safetensors (expected " +
                    model_dir + "/1/model.safetensors)");
  std::sort(versions.begin(), versions.end());
  m.version = versions.back();
  if (const YAML::Node vp = root["version_policy"]) {
    const YAML::Node specific = vp["specific"];
    if (!specific || !specific["versions"] || !specific["versions"].IsSequence() || specific["versions"].size() != 1)
      return c.Error(vp, "version_policy", "only {specific: {versions: [N]}} is supported");
    ASSIGN_OR_RETURN(uint64_t want, Scalar<uint64_t>(c, specific["versions"][0], "version_policy.specific.versions"));
    if (std::find(versions.begin(), versions.end(), want) == versions.end())
      return c.Error(specific["versions"][0], "version_policy.specific.versions", "version " + std::to_string(want) + " has no model.safetensors");
    m.version = want;
  }
  m.checkpoint_path = (fs::path(model_dir) / std::to_string(m.version) / "model.safetensors").string();
  return m;
}

Result<std::vector<RepositoryModel>> ScanRepository(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NotFound("model repository " + dir + " is not a directory");
  std::vector<RepositoryModel> models;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_directory()) continue;
    RepositoryModel m;
    m.name = e.path().filename().string();
    Result<ModelConfig> config = LoadModelConfig(e.path().string());
    if (config.ok()) {
      m.config = std::move(config).value();
    } else {
      m.status = config.status();
      m.config.name = m.name;
    }
    models.push_back(std::move(m));
  }
  std::sort(models.begin(), models.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return models;
}

}  // namespace hearth
