#include "server/model_config.h"

#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/parser.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>

#include "common/datatype.h"
#include "common/model_parameters.h"
#include "common/regular_file.h"
#include "protocol/worker_protocol.h"
#include "server/ensemble_config.h"
#include "server/model_config_pbtxt.h"
#include "server/model_config_yaml.h"
#include "server/sequence_config.h"

namespace hearth {
namespace {

namespace fs = std::filesystem;
using namespace config_yaml;  // NOLINT(google-build-using-namespace): the config's own helpers

Result<std::vector<IoConfig>> Ios(const Ctx& c, const YAML::Node& n, const std::string& field) {
  if (!n.IsSequence() || n.size() == 0) return c.Error(n, field, "must be a non-empty list");
  if (n.size() > kMaxModelTensors)
    return c.Error(n, field, "more than " + std::to_string(kMaxModelTensors) + " entries");
  std::vector<IoConfig> ios;
  for (size_t i = 0; i < n.size(); ++i) {
    const YAML::Node& e = n[i];
    const std::string f = field + "[" + std::to_string(i) + "]";
    if (!e.IsMap()) return c.Error(e, f, "must be a map with name, data_type, dims");
    for (const auto& kv : e) {
      ASSIGN_OR_RETURN(std::string key, Key(c, kv.first, f));
      if (key != "name" && key != "data_type" && key != "dims" &&
          ((key != "optional" && key != "format") || field != "input") &&
          (key != "label_filename" || field != "output"))
        return c.Error(kv.first, f, "unknown field " + Quote(key));
    }
    if (!e["name"] || !e["data_type"] || !e["dims"])
      return c.Error(e, f, "needs name, data_type and dims");
    IoConfig io;
    ASSIGN_OR_RETURN(io.name, String(c, e["name"], f + ".name"));
    ASSIGN_OR_RETURN(std::string type, String(c, e["data_type"], f + ".data_type"));
    auto dtype = ParseTritonDataType(type);
    if (!dtype)
      return c.Error(e["data_type"], f + ".data_type", Quote(type) + " is not a known TYPE_*");
    io.dtype = *dtype;
    ASSIGN_OR_RETURN(io.dims, Dims(c, e["dims"], f + ".dims"));
    if (e["optional"]) {
      const YAML::Node o = e["optional"];
      if (!o.IsScalar() || (o.Scalar() != "true" && o.Scalar() != "false"))
        return c.Error(o, f + ".optional", "must be true or false");
      io.optional = o.Scalar() == "true";
    }
    if (e["format"]) {
      ASSIGN_OR_RETURN(io.format, String(c, e["format"], f + ".format"));
      if (io.format != "FORMAT_NONE" && io.format != "FORMAT_NCHW" && io.format != "FORMAT_NHWC")
        return c.Error(e["format"], f + ".format",
                       Quote(io.format) + " is not FORMAT_NONE, FORMAT_NCHW or FORMAT_NHWC");
      if (io.format == "FORMAT_NONE") io.format.clear();
    }
    if (e["label_filename"]) {
      ASSIGN_OR_RETURN(io.label_filename, String(c, e["label_filename"], f + ".label_filename"));
      const std::string& l = io.label_filename;
      if (l.empty() || l == "." || l == ".." || l.find('/') != std::string::npos ||
          l.find('\0') != std::string::npos || l.size() > NAME_MAX)
        return c.Error(e["label_filename"], f + ".label_filename",
                       Quote(l) + " is not the name of a file in the model's directory");
    }
    if (io.name.empty() || io.name.size() > kMaxTensorNameBytes)
      return c.Error(e["name"], f + ".name",
                     "must have 1 to " + std::to_string(kMaxTensorNameBytes) + " bytes");
    if (io.dims.size() > kMaxModelTensorRank)
      return c.Error(e["dims"], f + ".dims",
                     "more than " + std::to_string(kMaxModelTensorRank) + " dimensions");
    for (const IoConfig& other : ios)
      if (other.name == io.name)
        return c.Error(e["name"], f + ".name", Quote(io.name) + " is listed twice");
    ios.push_back(std::move(io));
  }
  return ios;
}

// A whole small file, refused unless it is a regular file of at most
// `limit` bytes (never opened if it is a FIFO, a device or a directory);
// `what` names it in the error for one too large ("a config").
Result<std::string> ReadSmallFile(const std::string& path, uint64_t limit, const char* what) {
  struct stat st {};
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path, &st));
  auto too_large = [&](uint64_t bytes) {
    return InvalidArgument(path + ": " + std::to_string(bytes) + " bytes, over the limit of " +
                           std::to_string(limit) + " bytes for " + what);
  };
  if (static_cast<uint64_t>(st.st_size) > limit) return too_large(st.st_size);
  std::string text(static_cast<size_t>(st.st_size) + 1, '\0');
  size_t got = 0;
  // Read until end of file, one byte past the size seen: a file growing
  // under us is still held to the limit.
  for (;;) {
    if (got == text.size()) {
      if (text.size() > limit) return too_large(text.size());
      text.resize(std::min<size_t>(text.size() * 2 + 1, limit + 1));
    }
    const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("reading " + path, errno);
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > limit) return too_large(got);
  text.resize(got);
  return text;
}

// The whole config file (ReadSmallFile, at most kMaxConfigBytes).
Result<std::string> ReadConfigFile(const std::string& path) {
  Result<std::string> text = ReadSmallFile(path, kMaxConfigBytes, "a config");
  if (!text.ok() && text.status().code() == StatusCode::kNotFound)
    return NotFound(path +
                    ": missing (every model directory needs a config.yaml or a config.pbtxt)");
  return text;
}

// Each output's labels, read from its label_filename in `model_dir`: one
// label a line (a final newline ends the last; "\r\n" ends a line too).
Status ReadLabels(const std::string& model_dir, std::vector<IoConfig>& outputs) {
  for (IoConfig& io : outputs) {
    if (io.label_filename.empty()) continue;
    const std::string path = (fs::path(model_dir) / io.label_filename).string();
    Result<std::string> text = ReadSmallFile(path, kMaxLabelFileBytes, "a labels file");
    if (!text.ok()) return text.status().WithContext("output '" + io.name + "': label_filename");
    size_t start = 0;
    while (start < text->size()) {
      size_t end = text->find('\n', start);
      if (end == std::string::npos) end = text->size();
      size_t stop = end;
      if (stop > start && (*text)[stop - 1] == '\r') --stop;
      io.labels.emplace_back(*text, start, stop - start);
      start = end + 1;
    }
  }
  return Status::Ok();
}

struct Version {
  uint64_t number = 0;
  std::string dir;          // its directory's name, as written ("007" is version 7)
  bool sharded = false;     // holds model.safetensors.index.json
  bool weightless = false;  // (backend: python) model.py and no checkpoint
};

// What a version directory's checkpoint is named: the index, if there is
// one (the version directory is then a sharded checkpoint directory), else
// model.safetensors.
constexpr std::string_view kCheckpointFiles =
    "model.safetensors, or model.safetensors.index.json with its shards";

// Whether `path` leads somewhere (a dangling link does not); a loop of links
// or a directory that cannot be searched is an error naming it.
Result<bool> Exists(const fs::path& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) return false;
  if (ec) {
    if (ec.value() == ELOOP) return InvalidArgument(path.string() + ": a loop of symbolic links");
    return InvalidArgument(path.string() + ": " + ec.message());
  }
  return true;
}

// Numeric subdirectories holding a checkpoint (kCheckpointFiles), or, with
// `code_only` (backend: python), a model.py without one: a model that
// needs no weights; with `any` (an ensemble, which has no files of its
// own), every numeric directory. Symbolic links are followed once per entry (no
// recursion), so a loop is an error naming it.
Result<std::vector<Version>> FindVersions(const std::string& model_dir, bool code_only,
                                          bool any = false,
                                          std::vector<Version>* without_files = nullptr) {
  std::vector<Version> versions;
  std::error_code ec;
  fs::directory_iterator it(model_dir, ec);
  if (ec) return InvalidArgument(model_dir + ": cannot be read as a directory: " + ec.message());
  size_t entries = 0;
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    if (++entries > kMaxDirectoryEntries)
      return InvalidArgument(model_dir + ": more than " + std::to_string(kMaxDirectoryEntries) +
                             " entries");
    const fs::path path = it->path();
    const std::string name = path.filename().string();
    if (name.empty() ||
        !std::all_of(name.begin(), name.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      continue;
    std::error_code sec;
    const fs::file_status st = fs::status(path, sec);
    if (sec) {
      if (sec.value() == ELOOP)
        return InvalidArgument(path.string() + ": a loop of symbolic links");
      return InvalidArgument(path.string() + ": " + sec.message());
    }
    if (!fs::is_directory(st)) continue;
    Version v;
    v.dir = name;
    const auto [end, perr] = std::from_chars(name.data(), name.data() + name.size(), v.number);
    if (perr != std::errc() || end != name.data() + name.size())
      return InvalidArgument(path.string() + ": version directory name " + Quote(name) +
                             " is not a number below 2^64");
    if (!any) {
      ASSIGN_OR_RETURN(v.sharded, Exists(path / "model.safetensors.index.json"));
    }
    if (!any && !v.sharded) {
      ASSIGN_OR_RETURN(bool single, Exists(path / "model.safetensors"));
      if (!single) {
        if (code_only) {
          ASSIGN_OR_RETURN(v.weightless, Exists(path / "model.py"));
        }
        if (!v.weightless) {
          if (without_files != nullptr) without_files->push_back(v);
          continue;
        }
      }
    }
    for (const Version& other : versions)
      if (other.number == v.number)
        return InvalidArgument(model_dir + ": version directories " + Quote(other.dir) + " and " +
                               Quote(v.dir) + " are the same version " + std::to_string(v.number));
    versions.push_back(std::move(v));
  }
  if (ec) return InvalidArgument(model_dir + ": cannot be read as a directory: " + ec.message());
  std::sort(versions.begin(), versions.end(),
            [](const Version& a, const Version& b) { return a.number < b.number; });
  return versions;
}

// What a model config may not hold, found in the parser's events before any
// node is built:
// - Aliases (`*name`). yaml-cpp shares an anchored node among its aliases,
//   so that loading is cheap, but every walk of the document (the duplicate
//   key check, the fields' reads) visits each alias's whole subtree: ten
//   levels of nine aliases in 400 bytes ("billion laughs") are 3.5e9 visits,
//   and `&a [*a]` is a cycle. Triton's configs have no aliases, and a model
//   config is short enough to write out, so every alias is refused rather
//   than bounded: the document is then a tree no larger than the file.
// - Merge keys (a plain `<<` key), which need an alias to merge anything,
//   and whose meaning differs between yaml-cpp versions (0.7 reads `<<` as
//   a key like any other). A quoted '<<' is an ordinary key.
// - More than kMaxConfigNodes values, each of which yaml-cpp would build a
//   node for.
// The first of these ends the parse (ConfigEvents::Refused).
class ConfigEvents final : public YAML::EventHandler {
 public:
  struct Refused {};

  ConfigEvents(const Ctx& c, std::string_view text) : c_(c), text_(text) {}
  const Status& status() const { return status_; }

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& mark, YAML::anchor_t) override {
    Begin(mark);
    End();
  }
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override {
    Refuse(mark, AliasAt(mark),
           "aliases are not supported in model configs (write the value out in full)");
  }
  void OnScalar(const YAML::Mark& mark, const std::string& tag, YAML::anchor_t,
                const std::string& value) override {
    // yaml-cpp tags a plain scalar "?", a quoted one "!".
    if (value == "<<" && tag == "?" && !frames_.empty() && frames_.back().map &&
        frames_.back().at_key)
      Refuse(mark, Path(),
             "merge keys (<<) are not supported in model configs (write the keys out)");
    Begin(mark);
    if (!frames_.empty() && frames_.back().map && frames_.back().at_key) frames_.back().key = value;
    End();
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    Begin(mark);
    frames_.emplace_back();
  }
  void OnSequenceEnd() override {
    frames_.pop_back();
    End();
  }
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    Begin(mark);
    frames_.emplace_back().map = true;
  }
  void OnMapEnd() override {
    frames_.pop_back();
    End();
  }

 private:
  // A list or map being read: where the next value goes.
  struct Frame {
    bool map = false;
    bool at_key = true;  // map: the next value is a key
    std::string key;     // map: the last key read
    size_t index = 0;    // list: the next value's index
  };

  void Begin(const YAML::Mark& mark) {
    if (++values_ > kMaxConfigNodes)
      Refuse(mark, "",
             "more than " + std::to_string(kMaxConfigNodes) +
                 " values (lists, maps and single values); a model config needs far fewer");
  }
  void End() {
    if (frames_.empty()) return;
    Frame& f = frames_.back();
    if (f.map) {
      f.at_key = !f.at_key;
    } else {
      ++f.index;
    }
  }

  // Where the next value goes, as the other errors name fields: input[0].dims.
  std::string Path() const {
    std::string path;
    for (const Frame& f : frames_) {
      if (!f.map) {
        path += "[" + std::to_string(f.index) + "]";
      } else if (!f.at_key) {
        path += (path.empty() ? "" : ".") + f.key;
      }
    }
    return path.empty() ? "(top level)" : path;
  }

  // The alias as written (`*name`), read back from the text at its mark.
  std::string AliasAt(const YAML::Mark& mark) const {
    if (mark.pos < 0 || static_cast<size_t>(mark.pos) >= text_.size() || text_[mark.pos] != '*')
      return "*";
    const size_t end = text_.find_first_of(" \t\r\n,[]{}", mark.pos + 1);
    std::string name(text_.substr(mark.pos, std::min<size_t>(end, mark.pos + 65) - mark.pos));
    return name;
  }

  [[noreturn]] void Refuse(const YAML::Mark& mark, const std::string& field,
                           const std::string& what) {
    status_ =
        InvalidArgument(c_.Where(mark.line) + ": " + (field.empty() ? "" : field + ": ") + what);
    throw Refused{};
  }

  const Ctx& c_;
  std::string_view text_;
  std::vector<Frame> frames_;
  size_t values_ = 0;
  Status status_;
};

// The first document's events, refused as ConfigEvents says; may throw
// yaml-cpp's parser exceptions, as YAML::Load would for the same text.
Status CheckConfigEvents(const Ctx& c, const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  ConfigEvents events(c, text);
  try {
    parser.HandleNextDocument(events);
  } catch (const ConfigEvents::Refused&) {
  }
  return events.status();
}

// YAML lets a map name a key twice and keeps one of the values: a second
// `parameters:` would be dropped without a word. Every map of the file,
// however deep, must name each key once. Linear in the file's size: with
// aliases refused (CheckConfigEvents), each node is visited once.
Status NoDuplicateKeys(const Ctx& c, const YAML::Node& node, const std::string& where) {
  if (node.IsSequence()) {
    for (const auto& e : node) RETURN_IF_ERROR(NoDuplicateKeys(c, e, where));
  } else if (node.IsMap()) {
    std::set<std::string> seen;
    for (const auto& kv : node) {
      if (!kv.first.IsScalar()) continue;  // refused where the key is read
      const std::string& key = kv.first.Scalar();
      const std::string field = where.empty() ? key : where + "." + key;
      if (!seen.insert(key).second)
        return c.Error(kv.first, field, "is given twice (give each key once)");
      RETURN_IF_ERROR(NoDuplicateKeys(c, kv.second, field));
    }
  }
  return Status::Ok();
}

// Whether a version directory (a numeric subdirectory) of `model_dir`
// holds model.py. Errors only for a directory that cannot be read.
Result<bool> HoldsModelPy(const std::string& model_dir) {
  ASSIGN_OR_RETURN(std::vector<Version> versions,
                   FindVersions(model_dir, /*code_only=*/true, /*ensemble=*/false));
  for (const Version& v : versions) {
    ASSIGN_OR_RETURN(const bool has, Exists(fs::path(model_dir) / v.dir / "model.py"));
    if (has) return true;
  }
  return false;
}

// Versions: numeric subdirectories with a checkpoint (any, for an
// ensemble); the highest unless version_policy: {specific: {versions: [N]}}.
Status PickVersion(const Ctx& c, const YAML::Node& root, const std::string& model_dir,
                   ModelConfig& m) {
  const bool code_only = m.backend == "python";
  const bool ensemble = m.ensemble.has_value();
  std::vector<Version> without_files;
  ASSIGN_OR_RETURN(std::vector<Version> versions,
                   FindVersions(model_dir, code_only, ensemble, &without_files));
  if (versions.empty() && ensemble)
    return NotFound(model_dir + ": no version directory (an ensemble has no files, but a version " +
                    "directory all the same, as in Triton: make " + model_dir + "/1, empty)");
  if (versions.empty())
    return NotFound(
        model_dir + ": no version directory holding " + std::string(kCheckpointFiles) +
        (code_only ? ", or model.py" : "") + " (expected " + model_dir +
        "/1/model.safetensors, or " + model_dir +
        "/1/model.safetensors.index.json and the shards it names" +
        (code_only ? ", or " + model_dir + "/1/model.py for a model without weights" : "") + ")");
  const Version* chosen = &versions.back();
  if (const YAML::Node vp = root["version_policy"]) {
    const YAML::Node specific = vp.IsMap() ? vp["specific"] : YAML::Node();
    if (!specific || !specific.IsMap() || !specific["versions"] ||
        !specific["versions"].IsSequence() || specific["versions"].size() != 1)
      return c.Error(vp, "version_policy", "only {specific: {versions: [N]}} is supported");
    ASSIGN_OR_RETURN(uint64_t want, Number<uint64_t>(c, specific["versions"][0],
                                                     "version_policy.specific.versions"));
    auto it = std::find_if(versions.begin(), versions.end(),
                           [&](const Version& v) { return v.number == want; });
    if (it == versions.end())
      return c.Error(specific["versions"][0], "version_policy.specific.versions",
                     "version " + std::to_string(want) + " has no directory" +
                         (ensemble ? std::string()
                                   : " holding " + std::string(kCheckpointFiles) +
                                         (code_only ? ", or model.py" : "")));
    chosen = &*it;
  }
  m.version = chosen->number;
  if (!root["version_policy"]) {
    std::sort(without_files.begin(), without_files.end(),
              [](const Version& a, const Version& b) { return a.number > b.number; });
    for (const Version& v : without_files)
      if (v.number > chosen->number) m.passed_over_versions.push_back(v.dir);
  }
  // A sharded checkpoint is its directory; one file is named as before, so
  // that what the store reports for it does not change.
  const fs::path version_dir = fs::path(model_dir) / chosen->dir;
  m.version_dir = version_dir.string();
  // Empty for a version without weights: the stores hold nothing for it.
  m.checkpoint_path = chosen->weightless || ensemble ? std::string()
                      : chosen->sharded              ? version_dir.string()
                                                     : (version_dir / "model.safetensors").string();
  return Status::Ok();
}

// platform: ensemble: its name, max_batch_size, inputs, outputs, steps
// and version policy; nothing of workers or batching, which are its steps'.
Result<ModelConfig> ParseEnsemble(const Ctx& c, const YAML::Node& root,
                                  const std::string& model_dir, ModelConfig m) {
  const YAML::Node platform = root["platform"];
  if (!platform)
    return c.Error(root["ensemble_scheduling"], "ensemble_scheduling",
                   "is for a model with platform: ensemble");
  ASSIGN_OR_RETURN(std::string kind, String(c, platform, "platform"));
  if (kind != "ensemble")
    return c.Error(platform, "platform",
                   Quote(kind) +
                       ": the only platform a config.yaml names is ensemble (give the "
                       "model's backend instead)");
  for (const char* field : {"backend", "instance_group", "dynamic_batching", "sequence_batching",
                            "parameters", "model_transaction_policy"})
    if (root[field])
      return c.Error(root[field], field,
                     "an ensemble has no workers of its own: its steps' models have their "
                     "own " +
                         std::string(field) + " (remove it)");
  if (!root["ensemble_scheduling"])
    return InvalidArgument(m.config_path + ": ensemble_scheduling: missing (platform: ensemble)");
  if (!root["input"] || !root["output"])
    return InvalidArgument(m.config_path + ": " + (root["input"] ? "output" : "input") +
                           ": missing (an ensemble lists its inputs and outputs)");
  if (root["max_batch_size"]) {
    ASSIGN_OR_RETURN(m.max_batch_size, Number<int>(c, root["max_batch_size"], "max_batch_size"));
    if (m.max_batch_size < 0 || m.max_batch_size > 4096)
      return c.Error(root["max_batch_size"], "max_batch_size", "must be in [0, 4096]");
  }
  ASSIGN_OR_RETURN(m.inputs, Ios(c, root["input"], "input"));
  ASSIGN_OR_RETURN(m.outputs, Ios(c, root["output"], "output"));
  RETURN_IF_ERROR(ReadLabels(model_dir, m.outputs));
  for (size_t i = 0; i < m.inputs.size(); ++i)
    if (m.inputs[i].optional)
      return c.Error(root["input"][i]["optional"], "input[" + std::to_string(i) + "].optional",
                     "an ensemble's inputs are all required");
  RETURN_IF_ERROR(ReadEnsembleScheduling(c, root["ensemble_scheduling"], m));
  RETURN_IF_ERROR(PickVersion(c, root, model_dir, m));
  return m;
}

// Everything but reading the file; may throw yaml-cpp's exceptions (the caller catches them).
Result<ModelConfig> ParseConfigText(const std::string& model_dir, const std::string& text,
                                    ModelConfig m, const std::vector<std::string>* origins) {
  Ctx c{m.config_path, origins};
  YAML::Node root;
  try {
    RETURN_IF_ERROR(CheckConfigEvents(c, text));
    root = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    return InvalidArgument(c.Where(e.mark.line) + ": nested " + std::to_string(e.depth()) +
                           " levels deep, past the parser's limit");
  } catch (const YAML::ParserException& e) {
    return InvalidArgument(c.Where(e.mark.line) + ": " + e.msg);
  }
  if (!root.IsMap()) return InvalidArgument(m.config_path + ": must be a YAML map");
  RETURN_IF_ERROR(NoDuplicateKeys(c, root, ""));
  static const char* kKnown[] = {"name",
                                 "backend",
                                 "max_batch_size",
                                 "input",
                                 "output",
                                 "instance_group",
                                 "dynamic_batching",
                                 "parameters",
                                 "version_policy",
                                 "model_transaction_policy",
                                 "sequence_batching",
                                 "platform",
                                 "ensemble_scheduling"};
  for (const auto& kv : root) {
    ASSIGN_OR_RETURN(std::string key, Key(c, kv.first, "(top level)"));
    if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown))
      return c.Error(kv.first, key, "unknown field");
  }
  if (root["name"]) {
    ASSIGN_OR_RETURN(std::string name, String(c, root["name"], "name"));
    if (name != m.name)
      return c.Error(root["name"], "name",
                     Quote(name) + " differs from the directory name " + Quote(m.name));
  }
  if (root["platform"] || root["ensemble_scheduling"]) return ParseEnsemble(c, root, model_dir, m);
  if (!root["backend"]) {
    // Triton's form (config.pbtxt, a load's override) finds the backend
    // from the model's files, as Triton does: model.py is the python
    // backend's.
    ASSIGN_OR_RETURN(const bool python, origins != nullptr ? HoldsModelPy(model_dir) : false);
    if (!python)
      return InvalidArgument(m.config_path + ": backend: missing (mlp, scale, python, ...)");
    m.backend = "python";
  } else {
    ASSIGN_OR_RETURN(m.backend, String(c, root["backend"], "backend"));
  }
  // The kinds are the workers' (the backend registry): an unknown one fails
  // the model when its first worker says so. Here only its form is checked.
  if (m.backend.empty() || m.backend.size() > 64 ||
      m.backend.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos)
    return c.Error(root["backend"], "backend",
                   Quote(m.backend) + " is not a backend name (lower-case letters, digits, _)");
  if (root["max_batch_size"]) {
    ASSIGN_OR_RETURN(m.max_batch_size, Number<int>(c, root["max_batch_size"], "max_batch_size"));
    if (m.max_batch_size < 0 || m.max_batch_size > 4096)
      return c.Error(root["max_batch_size"], "max_batch_size", "must be in [0, 4096]");
  }
  // Both or neither: a config without them takes what the backend reports.
  if (root["input"].IsDefined() != root["output"].IsDefined())
    return InvalidArgument(m.config_path + ": " + (root["input"] ? "output" : "input") +
                           ": missing (list both input and output, or neither to take the "
                           "backend's)");
  if (root["input"]) {
    ASSIGN_OR_RETURN(m.inputs, Ios(c, root["input"], "input"));
    ASSIGN_OR_RETURN(m.outputs, Ios(c, root["output"], "output"));
    RETURN_IF_ERROR(ReadLabels(model_dir, m.outputs));
  }
  if (const YAML::Node t = root["model_transaction_policy"]) {
    const char* form = "must be {decoupled: true|false}";
    if (!t.IsMap() || t.size() != 1 || !t["decoupled"] || !t["decoupled"].IsScalar())
      return c.Error(t, "model_transaction_policy", form);
    const std::string v = t["decoupled"].Scalar();
    if (v != "true" && v != "false")
      return c.Error(t["decoupled"], "model_transaction_policy.decoupled", form);
    m.decoupled = v == "true";
  }
  // backend: llm is a generation engine: decoupled, batching its streams
  // itself, with the generate extension's input and outputs unless the
  // config lists its own, and resumable.
  if (m.backend == "llm") {
    if (root["model_transaction_policy"] && !m.decoupled)
      return c.Error(root["model_transaction_policy"]["decoupled"],
                     "model_transaction_policy.decoupled",
                     "backend llm streams its responses: true, or leave it out");
    m.decoupled = true;
    if (m.max_batch_size != 0)
      return c.Error(root["max_batch_size"], "max_batch_size",
                     "backend llm batches its streams itself (continuous batching): leave "
                     "max_batch_size out or 0, and set parameters.max_streams");
    if (m.inputs.empty()) {
      // A prompt (completions, generate) or a chat (chat completions): each
      // request gives one of them.
      m.inputs = {{"text_input", DType::kBytes, {1}, true}, {"messages", DType::kBytes, {1}, true}};
      m.outputs = {{"text_output", DType::kBytes, {1}},
                   {"token_ids", DType::kI64, {-1}},
                   {"prompt_tokens", DType::kI64, {1}},
                   {"completion_tokens", DType::kI64, {1}},
                   {"finish_reason", DType::kBytes, {1}}};
    }
    m.resumable = std::any_of(m.outputs.begin(), m.outputs.end(), [](const IoConfig& o) {
      return o.name == "token_ids" && o.dtype == DType::kI64 && o.dims == std::vector<int64_t>{-1};
    });
  }
  for (size_t i = 0; i < m.inputs.size(); ++i)
    if (m.inputs[i].optional && !m.decoupled)
      return c.Error(root["input"][i]["optional"], "input[" + std::to_string(i) + "].optional",
                     "only a decoupled model's inputs may be optional (a batch needs every "
                     "input of every request)");
  if (const YAML::Node g = root["instance_group"]) {
    if (!g.IsSequence() || g.size() == 0)
      return c.Error(g, "instance_group", "must be a list of {count, kind, gpus}");
    if (g.size() > kMaxInstanceGroups)
      return c.Error(g, "instance_group",
                     "more than " + std::to_string(kMaxInstanceGroups) + " groups");
    m.instance_groups.clear();
    for (size_t i = 0; i < g.size(); ++i) {
      const YAML::Node e = g[i];
      const std::string field = "instance_group[" + std::to_string(i) + "]";
      if (!e.IsMap()) return c.Error(e, field, "must be {count, kind, gpus}");
      for (const auto& kv : e) {
        ASSIGN_OR_RETURN(std::string key, Key(c, kv.first, field));
        // Triton's `name` only labels the group.
        if (key != "count" && key != "kind" && key != "gpus" && key != "name")
          return c.Error(kv.first, field + "." + key, "unknown field (count, kind, gpus, name)");
      }
      InstanceGroup group;
      if (e["count"]) {
        ASSIGN_OR_RETURN(group.count, Number<int>(c, e["count"], field + ".count"));
        if (group.count < 1 || group.count > kMaxGroupInstances)
          return c.Error(e["count"], field + ".count",
                         "must be in [1, " + std::to_string(kMaxGroupInstances) + "]");
      }
      if (e["kind"]) {
        ASSIGN_OR_RETURN(std::string kind, String(c, e["kind"], field + ".kind"));
        if (kind != "KIND_GPU" && kind != "KIND_CPU")
          return c.Error(e["kind"], field + ".kind", Quote(kind) + " is not KIND_GPU or KIND_CPU");
        group.kind_gpu = kind == "KIND_GPU";
      }
      if (const YAML::Node gpus = e["gpus"]) {
        if (!gpus.IsSequence()) return c.Error(gpus, field + ".gpus", "must be a list");
        if (!group.kind_gpu && gpus.size() > 0)
          return c.Error(gpus, field + ".gpus", "a KIND_CPU group names no GPUs");
        for (const auto& gpu : gpus) {
          ASSIGN_OR_RETURN(int id, Number<int>(c, gpu, field + ".gpus"));
          if (id < 0 || id >= kMaxGpuOrdinal)
            return c.Error(gpu, field + ".gpus",
                           std::to_string(id) + " is not a GPU ordinal (0 to " +
                               std::to_string(kMaxGpuOrdinal - 1) + ")");
          if (std::find(group.gpus.begin(), group.gpus.end(), id) != group.gpus.end())
            return c.Error(gpu, field + ".gpus", "lists GPU " + std::to_string(id) + " twice");
          group.gpus.push_back(id);
        }
      }
      m.instance_groups.push_back(std::move(group));
    }
  }
  if (const YAML::Node d = root["dynamic_batching"]) {
    if (!d.IsMap()) return c.Error(d, "dynamic_batching", "must be a map");
    for (const auto& kv : d) {
      ASSIGN_OR_RETURN(std::string key, Key(c, kv.first, "dynamic_batching"));
      static constexpr std::string_view kFields[] = {
          "max_queue_delay_microseconds", "max_queue_size",
          "default_queue_policy",         "priority_levels",
          "default_priority_level",       "preferred_batch_size"};
      if (std::find(std::begin(kFields), std::end(kFields), key) == std::end(kFields))
        return c.Error(kv.first, "dynamic_batching." + key,
                       "unknown field (max_queue_delay_microseconds, max_queue_size, "
                       "default_queue_policy, priority_levels, default_priority_level, "
                       "preferred_batch_size)");
    }
    if (d["max_queue_delay_microseconds"]) {
      ASSIGN_OR_RETURN(m.max_queue_delay_us,
                       Number<uint64_t>(c, d["max_queue_delay_microseconds"],
                                        "dynamic_batching.max_queue_delay_microseconds"));
      if (m.max_queue_delay_us > kMaxQueueDelayUs)
        return c.Error(d["max_queue_delay_microseconds"],
                       "dynamic_batching.max_queue_delay_microseconds",
                       "must be at most " + std::to_string(kMaxQueueDelayUs) + " (60 s)");
    }
    if (d["max_queue_size"]) {
      ASSIGN_OR_RETURN(m.max_queue_size,
                       Number<uint64_t>(c, d["max_queue_size"], "dynamic_batching.max_queue_size"));
    }
    if (const YAML::Node q = d["default_queue_policy"]) {
      if (!q.IsMap() || !q["default_timeout_microseconds"] || q.size() != 1)
        return c.Error(q, "dynamic_batching.default_queue_policy",
                       "must be {default_timeout_microseconds: N}");
      ASSIGN_OR_RETURN(
          m.default_timeout_us,
          Number<uint64_t>(c, q["default_timeout_microseconds"],
                           "dynamic_batching.default_queue_policy.default_timeout_microseconds"));
    }
    if (d["priority_levels"]) {
      ASSIGN_OR_RETURN(m.priority_levels, Number<uint64_t>(c, d["priority_levels"],
                                                           "dynamic_batching.priority_levels"));
    }
    if (d["default_priority_level"]) {
      ASSIGN_OR_RETURN(m.default_priority_level,
                       Number<uint64_t>(c, d["default_priority_level"],
                                        "dynamic_batching.default_priority_level"));
      if (m.default_priority_level < 1 ||
          (m.priority_levels > 0 && m.default_priority_level > m.priority_levels))
        return c.Error(d["default_priority_level"], "dynamic_batching.default_priority_level",
                       "must be in [1, priority_levels]");
    }
    if (const YAML::Node p = d["preferred_batch_size"]) {
      if (!p.IsSequence())
        return c.Error(p, "dynamic_batching.preferred_batch_size", "must be a list");
      for (const auto& b : p) {
        ASSIGN_OR_RETURN(int v, Number<int>(c, b, "dynamic_batching.preferred_batch_size"));
        if (v < 1 || (m.max_batch_size > 0 && v > m.max_batch_size))
          return c.Error(b, "dynamic_batching.preferred_batch_size",
                         "must be in [1, max_batch_size]");
        m.preferred_batch_sizes.push_back(v);
      }
    }
  }
  if (const YAML::Node sequence = root["sequence_batching"]) {
    if (root["dynamic_batching"])
      return c.Error(sequence, "sequence_batching",
                     "a model has dynamic_batching or sequence_batching, not both (a sequence "
                     "model batches as its strategy, direct or oldest, says)");
    RETURN_IF_ERROR(ReadSequenceBatching(c, sequence, m));
  }
  if (const YAML::Node p = root["parameters"]) {
    if (!p.IsMap()) return c.Error(p, "parameters", "must be a map");
    size_t parameter_bytes = 0;
    for (const auto& kv : p) {
      ASSIGN_OR_RETURN(std::string key, Key(c, kv.first, "parameters"));
      if (key == "fault_injection") {
        // Off by default; for testing crash handling:
        // {on_value: X, kind: abort|segv|hang|cuda_illegal_address}.
        const YAML::Node f = kv.second;
        if (!f.IsMap() || !f["on_value"] || !f["kind"])
          return c.Error(f, "parameters.fault_injection",
                         "must be {on_value: NUMBER, kind: abort|segv|hang|cuda_illegal_address}");
        ASSIGN_OR_RETURN(double on_value,
                         Number<double>(c, f["on_value"], "parameters.fault_injection.on_value"));
        ASSIGN_OR_RETURN(std::string kind, String(c, f["kind"], "parameters.fault_injection.kind"));
        if (kind != "abort" && kind != "segv" && kind != "hang" && kind != "cuda_illegal_address")
          return c.Error(f["kind"], "parameters.fault_injection.kind",
                         Quote(kind) + " is not abort, segv, hang or cuda_illegal_address");
        m.fault_on_value = on_value;
        m.fault_kind = kind;
        continue;
      }
      if (!kv.second.IsScalar())
        return c.Error(kv.second, "parameters." + key, "must be a single value");
      if (key.empty()) return c.Error(kv.first, "parameters", "empty parameter name");
      parameter_bytes += key.size() + kv.second.Scalar().size();
      if (m.parameters.size() == kMaxModelParameters)
        return c.Error(kv.first, "parameters",
                       "more than " + std::to_string(kMaxModelParameters) + " parameters");
      if (parameter_bytes > kMaxModelParameterBytes)
        return c.Error(kv.first, "parameters." + key,
                       "the parameters' names and values come to more than the limit of " +
                           std::to_string(kMaxModelParameterBytes) + " bytes");
      m.parameters[key] = kv.second.Scalar();
    }
    // Each name read below is one of the list backends let pass (a name
    // added here must be added there).
    static_assert(IsServerModelParameter("allow_tf32") &&
                  IsServerModelParameter("standby_workers") && IsServerModelParameter("zygote") &&
                  IsServerModelParameter("standby_mode") &&
                  IsServerModelParameter("max_sequences") &&
                  IsServerModelParameter("max_streams") && IsServerModelParameter("resumable"));
    if (m.parameters.count("allow_tf32")) {
      const std::string& v = m.parameters["allow_tf32"];
      if (v != "true" && v != "false")
        return c.Error(p["allow_tf32"], "parameters.allow_tf32",
                       Quote(v) + " is not true or false");
      m.allow_tf32 = v == "true";
    }
    if (m.parameters.count("standby_workers")) {
      ASSIGN_OR_RETURN(m.standby_workers,
                       Number<int>(c, p["standby_workers"], "parameters.standby_workers"));
      if (m.standby_workers < 0 || m.standby_workers > kMaxStandbyWorkers)
        return c.Error(p["standby_workers"], "parameters.standby_workers",
                       "must be from 0 to " + std::to_string(kMaxStandbyWorkers));
    }
    if (m.parameters.count("zygote")) {
      const std::string& zygote = m.parameters["zygote"];
      if (zygote != "true" && zygote != "false")
        return c.Error(p["zygote"], "parameters.zygote", Quote(zygote) + " is not true or false");
      if (zygote == "true" && m.backend != "python")
        return c.Error(p["zygote"], "parameters.zygote",
                       "only backend: python forks its workers from a zygote; this model's "
                       "backend is " +
                           Quote(m.backend));
      m.zygote = zygote == "true";
    }
    if (m.parameters.count("standby_mode")) {
      const std::string& mode = m.parameters["standby_mode"];
      if (mode != "cold" && mode != "hot")
        return c.Error(p["standby_mode"], "parameters.standby_mode",
                       Quote(mode) + " is not cold or hot");
      m.standby_hot = mode == "hot";
      if (m.standby_hot && m.standby_workers == 0)
        return c.Error(p["standby_mode"], "parameters.standby_mode",
                       "hot keeps parameters.standby_workers processes started, and "
                       "parameters.standby_workers is 0 (give it 1 or more)");
    }
    if (m.parameters.count("max_sequences")) {
      ASSIGN_OR_RETURN(m.max_sequences,
                       Number<int>(c, p["max_sequences"], "parameters.max_sequences"));
      if (m.max_sequences < 1 || m.max_sequences > kMaxMaxSequences)
        return c.Error(p["max_sequences"], "parameters.max_sequences",
                       "must be from 1 to " + std::to_string(kMaxMaxSequences));
      if (!m.sequence)
        return c.Error(p["max_sequences"], "parameters.max_sequences",
                       "sequences are for models with sequence_batching");
    }
    if (m.parameters.count("max_streams")) {
      ASSIGN_OR_RETURN(m.max_streams, Number<int>(c, p["max_streams"], "parameters.max_streams"));
      if (m.max_streams < 1 || m.max_streams > static_cast<int>(control::kMaxStreams))
        return c.Error(p["max_streams"], "parameters.max_streams",
                       "must be from 1 to " + std::to_string(control::kMaxStreams));
      if (!m.decoupled)
        return c.Error(p["max_streams"], "parameters.max_streams",
                       "streams are for decoupled models (model_transaction_policy: "
                       "{decoupled: true}); this model answers batches");
    }
    if (m.parameters.count("resumable")) {
      const std::string& v = m.parameters["resumable"];
      if (v != "true" && v != "false")
        return c.Error(p["resumable"], "parameters.resumable", Quote(v) + " is not true or false");
      m.resumable = v == "true";
      if (m.resumable && !m.decoupled)
        return c.Error(p["resumable"], "parameters.resumable",
                       "only a decoupled model's streams resume; this model answers batches");
      if (m.resumable) {
        auto t = std::find_if(m.outputs.begin(), m.outputs.end(),
                              [](const IoConfig& o) { return o.name == "token_ids"; });
        if (t == m.outputs.end() || t->dtype != DType::kI64 || t->dims != std::vector<int64_t>{-1})
          return c.Error(p["resumable"], "parameters.resumable",
                         "a stream resumes from the token ids its client has, which the model "
                         "gives in an output token_ids of TYPE_INT64 and dims [-1]; this model "
                         "has none such");
      }
    }
  }

  RETURN_IF_ERROR(PickVersion(c, root, model_dir, m));
  return m;
}

}  // namespace

namespace {

// `text` as the YAML of `file` (config.yaml, or config.pbtxt with the
// origins of its YAML's lines).
// `label`: how errors name the config (its path, or kConfigOverrideLabel).
Result<ModelConfig> ParseYaml(const std::string& model_dir, const std::string& label,
                              const std::string& text, const std::vector<std::string>* origins) {
  ModelConfig m;
  m.name = fs::path(model_dir).filename().string();
  m.config_path = label;
  try {
    return ParseConfigText(model_dir, text, std::move(m), origins);
  } catch (const YAML::Exception& e) {
    // Conversions and lookups on a document of an unexpected shape, or one
    // nested past yaml-cpp's depth limit.
    return InvalidArgument(Ctx{label, origins}.Where(e.mark.line) + ": " + e.msg);
  } catch (const std::exception& e) {
    return InvalidArgument(label + ": " + e.what());
  }
}

}  // namespace

Result<ModelConfig> ParseModelConfig(const std::string& model_dir, const std::string& text) {
  return ParseYaml(model_dir, (fs::path(model_dir) / "config.yaml").string(), text, nullptr);
}

Result<ModelConfig> ParseModelConfigPbtxt(const std::string& model_dir, const std::string& text) {
  const std::string path = (fs::path(model_dir) / "config.pbtxt").string();
  ASSIGN_OR_RETURN(PbtxtAsYaml yaml, PbtxtToYaml(path, text));
  return ParseYaml(model_dir, path, yaml.yaml, &yaml.origins);
}

Result<ModelConfig> ParseModelConfigOverride(const std::string& model_dir,
                                             const std::string& pbtxt) {
  // Empty origins: the client's JSON has no lines to name (Ctx::Where then
  // names the label alone).
  ASSIGN_OR_RETURN(PbtxtAsYaml yaml, PbtxtToYamlNamed(kConfigOverrideLabel, pbtxt));
  return ParseYaml(model_dir, kConfigOverrideLabel, yaml.yaml, &yaml.origins);
}

Result<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const fs::path yaml = fs::path(model_dir) / "config.yaml";
  const fs::path pbtxt = fs::path(model_dir) / "config.pbtxt";
  // A dangling link counts as absent here; reading it says what it is.
  ASSIGN_OR_RETURN(bool has_yaml, Exists(yaml));
  ASSIGN_OR_RETURN(bool has_pbtxt, Exists(pbtxt));
  if (has_yaml && has_pbtxt)
    return InvalidArgument(yaml.string() + " and " + pbtxt.string() +
                           ": a model directory holds one config, not both (remove one)");
  if (has_pbtxt) {
    ASSIGN_OR_RETURN(std::string text, ReadConfigFile(pbtxt.string()));
    return ParseModelConfigPbtxt(model_dir, text);
  }
  ASSIGN_OR_RETURN(std::string text, ReadConfigFile(yaml.string()));
  return ParseModelConfig(model_dir, text);
}

Result<std::vector<ModelDirectory>> ListModelDirectories(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return NotFound("model repository " + dir + " is not a directory" +
                    (ec ? ": " + ec.message() : ""));
  fs::directory_iterator it(dir, ec);
  if (ec) return NotFound("model repository " + dir + " cannot be read: " + ec.message());
  std::vector<ModelDirectory> models;
  size_t entries = 0;
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    if (++entries > kMaxDirectoryEntries)
      return InvalidArgument("model repository " + dir + ": more than " +
                             std::to_string(kMaxDirectoryEntries) + " entries");
    std::error_code sec;
    const fs::file_status st = it->symlink_status(sec);
    // Links are models too: where they lead (or that they loop) is found
    // out when the model's config is read, and fails that model alone.
    if (sec || (!fs::is_directory(st) && !fs::is_symlink(st))) continue;
    ModelDirectory m;
    m.name = it->path().filename().string();
    m.path = it->path().string();
    if (std::any_of(m.name.begin(), m.name.end(),
                    [](char ch) { return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f; })) {
      std::string shown;
      for (char ch : m.name) {
        const auto u = static_cast<unsigned char>(ch);
        if (u < 0x20 || u == 0x7f) {
          char hex[5];
          std::snprintf(hex, sizeof hex, "\\x%02x", u);
          shown += hex;
        } else {
          shown += ch;
        }
      }
      m.name = shown;
      m.status =
          InvalidArgument(dir + "/" + shown + ": a model name must not hold control characters");
    }
    models.push_back(std::move(m));
  }
  if (ec) return NotFound("model repository " + dir + " cannot be read: " + ec.message());
  std::sort(models.begin(), models.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return models;
}

Result<std::vector<RepositoryModel>> ScanRepository(const std::string& dir) {
  ASSIGN_OR_RETURN(std::vector<ModelDirectory> dirs, ListModelDirectories(dir));
  std::vector<RepositoryModel> models;
  for (const ModelDirectory& d : dirs) {
    RepositoryModel m;
    m.name = d.name;
    m.config.name = d.name;
    m.status = d.status;
    if (m.status.ok()) {
      Result<ModelConfig> config = LoadModelConfig(d.path);
      if (config.ok()) {
        m.config = std::move(config).value();
      } else {
        m.status = config.status();
      }
    }
    models.push_back(std::move(m));
  }
  return models;
}

}  // namespace hearth
