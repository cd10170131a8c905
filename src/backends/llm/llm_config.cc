// config.json and generation_config.json of a Llama-family checkpoint, read
// the way transformers reads them (its defaults where a field is absent),
// and refused by name wherever they ask for math this engine does not do.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backends/llm/llm_model.h"
#include "common/regular_file.h"

namespace hearth::llm {
namespace {

using json = nlohmann::json;

constexpr std::string_view kConfigFile = "config.json";
constexpr std::string_view kGenerationFile = "generation_config.json";
// Far beyond any real config (a few KiB); bounds what a hostile one can cost.
constexpr uint64_t kMaxConfigBytes = 4ull << 20;
// Dimensions reach the kernels as 32-bit ints and CUDA as grid sizes.
constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();

// A value as messages quote it: its JSON, cut short.
std::string Quote(const json& value) {
  std::string text = value.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

// The fields of one JSON object of one file, read with transformers'
// defaults and checked; every error names the file, the field (with its
// parent: "rope_scaling.factor") and the value.
class Fields {
 public:
  Fields(const json& object, std::string_view file, std::string prefix = "")
      : object_(object), file_(file), prefix_(std::move(prefix)) {}

  // The value, or nullptr when absent. null counts as present here.
  const json* Find(std::string_view key) const {
    auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }
  // Absent or null.
  bool Unset(std::string_view key) const {
    const json* v = Find(key);
    return v == nullptr || v->is_null();
  }

  std::string Name(std::string_view key) const { return prefix_ + std::string(key); }

  Status Error(std::string_view key, const json& value, std::string_view why) const {
    return InvalidArgument(std::string(file_) + ": " + Name(key) + " " + Quote(value) + " " +
                           std::string(why));
  }
  Status Missing(std::string_view key, std::string_view what) const {
    return InvalidArgument(std::string(file_) + ": " + Name(key) + " is missing (" +
                           std::string(what) + ")");
  }

  // An integer in [min, max]; absent or null: `fallback`, or an error
  // without one.
  Result<int64_t> Int(std::string_view key, std::optional<int64_t> fallback, int64_t min,
                      int64_t max) const {
    const json* v = Find(key);
    if (v == nullptr || v->is_null()) {
      if (fallback) return *fallback;
      return Missing(key, "an integer is required");
    }
    return CheckInt(key, *v, min, max);
  }
  Result<int64_t> CheckInt(std::string_view key, const json& v, int64_t min, int64_t max) const {
    int64_t n = 0;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return Error(key, v, "is out of range");
      n = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      n = v.get<int64_t>();
    } else {
      return Error(key, v, "is not an integer");
    }
    if (n < min || n > max) {
      return Error(key, v,
                   "is out of range (" + std::to_string(min) + " to " + std::to_string(max) + ")");
    }
    return n;
  }

  // A finite number; absent or null: `fallback`, or an error without one.
  Result<double> Number(std::string_view key, std::optional<double> fallback) const {
    const json* v = Find(key);
    if (v == nullptr || v->is_null()) {
      if (fallback) return *fallback;
      return Missing(key, "a number is required");
    }
    if (!v->is_number()) return Error(key, *v, "is not a number");
    const double d = v->get<double>();
    if (!std::isfinite(d)) return Error(key, *v, "is not finite");
    return d;
  }

  Result<bool> Bool(std::string_view key, bool fallback) const {
    const json* v = Find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_boolean()) return Error(key, *v, "is not true or false");
    return v->get<bool>();
  }

  Result<std::optional<std::string>> String(std::string_view key) const {
    const json* v = Find(key);
    if (v == nullptr || v->is_null()) return std::optional<std::string>();
    if (!v->is_string()) return Error(key, *v, "is not a string");
    return std::optional<std::string>(v->get<std::string>());
  }

  // Token ids: an integer or a list of integers in [0, vocab); null: none.
  Status TokenIds(std::string_view key, int64_t vocab, std::vector<int64_t>* out) const {
    const json* v = Find(key);
    if (v == nullptr || v->is_null()) return Status::Ok();
    if (v->is_array()) {
      for (const json& id : *v) {
        auto n = CheckInt(key, id, 0, vocab - 1);
        if (!n.ok()) return Error(key, *v, "holds an id that is not an integer below vocab_size");
        out->push_back(*n);
      }
      return Status::Ok();
    }
    auto n = CheckInt(key, *v, 0, vocab - 1);
    if (!n.ok()) return Error(key, *v, "is not a token id below vocab_size (or a list of them)");
    out->push_back(*n);
    return Status::Ok();
  }

  const json& object() const { return object_; }
  std::string_view file() const { return file_; }

 private:
  const json& object_;
  std::string_view file_;
  std::string prefix_;
};

Result<json> ParseObject(std::string_view text, std::string_view file) {
  json value;
  try {
    value = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return InvalidArgument(std::string(file) + ": invalid JSON: " + e.what());
  }
  if (!value.is_object()) return InvalidArgument(std::string(file) + ": not a JSON object");
  return value;
}

struct FamilyInfo {
  Family family;
  std::string_view architecture;
  std::string_view model_type;
  // transformers' defaults for what a config may leave out.
  int64_t max_position_embeddings;
  std::optional<int64_t> num_key_value_heads;  // absent; nullopt: num_attention_heads
};

constexpr FamilyInfo kFamilies[] = {
    {Family::kLlama, "LlamaForCausalLM", "llama", 2048, std::nullopt},
    {Family::kMistral, "MistralForCausalLM", "mistral", 4096 * 32, 8},
    {Family::kQwen2, "Qwen2ForCausalLM", "qwen2", 32768, 32},
};

// rope_scaling (or transformers 5's rope_parameters): "default" or
// "llama3", with exactly the keys of that type (an unknown key may change
// the frequencies: refused, not ignored).
Status ParseRope(const Fields& f, std::string_view key, ModelConfig* c) {
  const json* v = f.Find(key);
  if (v == nullptr || v->is_null()) return Status::Ok();
  if (!v->is_object()) return f.Error(key, *v, "is not an object");
  const Fields r(*v, f.file(), std::string(key) + ".");
  const bool parameters = key == "rope_parameters";

  ASSIGN_OR_RETURN(std::optional<std::string> rope_type, r.String("rope_type"));
  ASSIGN_OR_RETURN(std::optional<std::string> type, r.String("type"));
  if (rope_type && type && *rope_type != *type) {
    return r.Error("type", *r.Find("type"),
                   "contradicts " + r.Name("rope_type") + " \"" + *rope_type + "\"");
  }
  if (!rope_type) rope_type = type;
  if (!rope_type) return r.Missing("rope_type", "\"default\" or \"llama3\"");
  const std::string_view type_key = r.Find("rope_type") != nullptr ? "rope_type" : "type";
  if (*rope_type != "default" && *rope_type != "llama3") {
    return r.Error(type_key, *r.Find(type_key),
                   "is not implemented (only \"llama3\" and \"default\")");
  }
  const bool llama3 = *rope_type == "llama3";

  for (const auto& [name, value] : v->items()) {
    const bool known =
        name == "rope_type" || name == "type" || (parameters && name == "rope_theta") ||
        (llama3 && (name == "factor" || name == "low_freq_factor" || name == "high_freq_factor" ||
                    name == "original_max_position_embeddings"));
    if (!known) {
      if (name == "partial_rotary_factor") {
        ASSIGN_OR_RETURN(double partial, r.Number(name, 1.0));
        if (partial == 1.0) continue;
      }
      return r.Error(name, value, "is not implemented for rope_type \"" + *rope_type + "\"");
    }
  }
  if (parameters) {
    ASSIGN_OR_RETURN(c->rope_theta, r.Number("rope_theta", c->rope_theta));
    if (!(c->rope_theta > 0)) return r.Error("rope_theta", *r.Find("rope_theta"), "is not > 0");
  }
  if (!llama3) return Status::Ok();

  RopeScaling& s = c->rope_scaling;
  s.llama3 = true;
  ASSIGN_OR_RETURN(s.factor, r.Number("factor", std::nullopt));
  ASSIGN_OR_RETURN(s.low_freq_factor, r.Number("low_freq_factor", std::nullopt));
  ASSIGN_OR_RETURN(s.high_freq_factor, r.Number("high_freq_factor", std::nullopt));
  ASSIGN_OR_RETURN(s.original_max_position_embeddings,
                   r.Int("original_max_position_embeddings", std::nullopt, 1, kMaxDim));
  if (!(s.factor >= 1.0)) return r.Error("factor", *r.Find("factor"), "is not >= 1");
  if (!(s.low_freq_factor > 0)) {
    return r.Error("low_freq_factor", *r.Find("low_freq_factor"), "is not > 0");
  }
  // The smooth band divides by their difference.
  if (!(s.high_freq_factor > s.low_freq_factor)) {
    return r.Error("high_freq_factor", *r.Find("high_freq_factor"),
                   "is not above low_freq_factor " + Quote(*r.Find("low_freq_factor")));
  }
  return Status::Ok();
}

// Fields whose only value this engine implements is their default: refused
// by name and value otherwise.
Status RefuseUnless(const Fields& f, std::string_view key, bool implemented, std::string_view why) {
  if (implemented) return Status::Ok();
  return f.Error(key, *f.Find(key), why);
}

Status ParseConfig(const json& root, ModelConfig* c) {
  const Fields f(root, kConfigFile);

  // The family.
  const json* archs = f.Find("architectures");
  if (archs == nullptr || archs->is_null())
    return f.Missing("architectures",
                     "[\"LlamaForCausalLM\"], [\"MistralForCausalLM\"] or "
                     "[\"Qwen2ForCausalLM\"]");
  if (!archs->is_array() || archs->size() != 1 || !(*archs)[0].is_string())
    return f.Error("architectures", *archs, "is not a list of one architecture");
  c->architecture = (*archs)[0].get<std::string>();
  const FamilyInfo* family = nullptr;
  for (const FamilyInfo& info : kFamilies) {
    if (info.architecture == c->architecture) family = &info;
  }
  if (family == nullptr) {
    return f.Error("architectures", *archs,
                   "is not implemented (LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM)");
  }
  c->family = family->family;
  ASSIGN_OR_RETURN(std::optional<std::string> model_type, f.String("model_type"));
  if (model_type && *model_type != family->model_type) {
    return f.Error("model_type", *f.Find("model_type"),
                   "contradicts architectures " + Quote(*archs) + " (model_type \"" +
                       std::string(family->model_type) + "\")");
  }

  // Shapes.
  ASSIGN_OR_RETURN(c->hidden_size, f.Int("hidden_size", std::nullopt, 1, kMaxDim));
  ASSIGN_OR_RETURN(c->intermediate_size, f.Int("intermediate_size", std::nullopt, 1, kMaxDim));
  ASSIGN_OR_RETURN(c->num_layers, f.Int("num_hidden_layers", std::nullopt, 1, 1 << 16));
  ASSIGN_OR_RETURN(c->num_heads, f.Int("num_attention_heads", std::nullopt, 1, 1 << 16));
  ASSIGN_OR_RETURN(c->vocab_size, f.Int("vocab_size", std::nullopt, 1, kMaxDim));
  // Absent: the family's default; null: num_attention_heads (as transformers).
  std::optional<int64_t> kv_fallback = family->num_key_value_heads;
  if (f.Find("num_key_value_heads") != nullptr || !kv_fallback) kv_fallback = c->num_heads;
  ASSIGN_OR_RETURN(c->num_kv_heads, f.Int("num_key_value_heads", kv_fallback, 1, 1 << 16));
  if (c->num_heads % c->num_kv_heads != 0) {
    return f.Error("num_key_value_heads", json(c->num_kv_heads),
                   "does not divide num_attention_heads " + std::to_string(c->num_heads));
  }
  if (f.Unset("head_dim")) {
    if (c->hidden_size % c->num_heads != 0) {
      return f.Error("num_attention_heads", json(c->num_heads),
                     "does not divide hidden_size " + std::to_string(c->hidden_size) +
                         " (and head_dim is not given)");
    }
    c->head_dim = c->hidden_size / c->num_heads;
  } else {
    ASSIGN_OR_RETURN(c->head_dim, f.Int("head_dim", std::nullopt, 1, 1 << 16));
  }
  if (c->head_dim % 2 != 0) {
    return f.Error("head_dim", json(c->head_dim), "is odd (rotary embeddings rotate halves)");
  }
  if (c->num_heads * c->head_dim > kMaxDim) {
    return f.Error("num_attention_heads", json(c->num_heads),
                   "times head_dim " + std::to_string(c->head_dim) + " is too large");
  }
  ASSIGN_OR_RETURN(c->max_positions,
                   f.Int("max_position_embeddings", family->max_position_embeddings, 1, kMaxDim));

  // The math.
  ASSIGN_OR_RETURN(std::optional<std::string> act, f.String("hidden_act"));
  if (act && *act != "silu") {
    return f.Error("hidden_act", *f.Find("hidden_act"), "is not implemented (only \"silu\")");
  }
  ASSIGN_OR_RETURN(c->rms_norm_eps, f.Number("rms_norm_eps", 1e-6));
  if (!(c->rms_norm_eps >= 0)) {
    return f.Error("rms_norm_eps", *f.Find("rms_norm_eps"), "is negative");
  }
  ASSIGN_OR_RETURN(c->rope_theta, f.Number("rope_theta", 10000.0));
  if (!(c->rope_theta > 0)) return f.Error("rope_theta", *f.Find("rope_theta"), "is not > 0");
  if (!f.Unset("rope_parameters") && !f.Unset("rope_scaling")) {
    return f.Error("rope_scaling", *f.Find("rope_scaling"),
                   "beside rope_parameters: which one is meant?");
  }
  RETURN_IF_ERROR(ParseRope(f, "rope_scaling", c));
  RETURN_IF_ERROR(ParseRope(f, "rope_parameters", c));
  ASSIGN_OR_RETURN(double partial, f.Number("partial_rotary_factor", 1.0));
  RETURN_IF_ERROR(RefuseUnless(f, "partial_rotary_factor", partial == 1.0,
                               "is not implemented (only 1: rotary over the whole head)"));

  ASSIGN_OR_RETURN(bool attention_bias, f.Bool("attention_bias", false));
  ASSIGN_OR_RETURN(bool mlp_bias, f.Bool("mlp_bias", false));
  RETURN_IF_ERROR(RefuseUnless(f, "mlp_bias", !mlp_bias, "is not implemented"));
  if (c->family == Family::kQwen2) {
    // Qwen2 has biases on q, k and v whatever the config says; transformers
    // reads no attention_bias for it.
    c->qkv_bias = true;
  } else {
    RETURN_IF_ERROR(RefuseUnless(f, "attention_bias", !attention_bias,
                                 "is not implemented for " + c->architecture));
  }
  ASSIGN_OR_RETURN(int64_t tp, f.Int("pretraining_tp", 1, 1, kMaxDim));
  RETURN_IF_ERROR(RefuseUnless(f, "pretraining_tp", tp == 1, "is not implemented (only 1)"));
  if (!f.Unset("quantization_config")) {
    return f.Error("quantization_config", *f.Find("quantization_config"),
                   "is not implemented: quantized checkpoints are not served");
  }
  ASSIGN_OR_RETURN(bool mrope, f.Bool("use_mrope", false));
  RETURN_IF_ERROR(RefuseUnless(f, "use_mrope", !mrope, "is not implemented"));
  if (const json* layers = f.Find("layer_types"); layers != nullptr && !layers->is_null()) {
    if (!layers->is_array()) return f.Error("layer_types", *layers, "is not a list");
    for (const json& t : *layers) {
      if (!t.is_string() || t.get<std::string>() != "full_attention") {
        return f.Error("layer_types", *layers,
                       "holds " + Quote(t) + ": only \"full_attention\" is implemented");
      }
    }
  }

  // Sliding windows.
  if (c->family == Family::kQwen2) {
    ASSIGN_OR_RETURN(bool sliding, f.Bool("use_sliding_window", false));
    RETURN_IF_ERROR(RefuseUnless(f, "use_sliding_window", !sliding,
                                 "is not implemented (sliding-window attention)"));
  } else if (c->family == Family::kMistral && !f.Unset("sliding_window")) {
    ASSIGN_OR_RETURN(int64_t window, f.Int("sliding_window", std::nullopt, 1, kMaxDim));
    // transformers masks key j for query i when i - j >= window: below
    // `window` positions nothing is masked, so capping is exact.
    if (window < c->max_positions) {
      c->notes.push_back("config.json: sliding_window " + std::to_string(window) +
                         " caps the positions served to " + std::to_string(window) +
                         " (max_position_embeddings " + std::to_string(c->max_positions) +
                         "): sliding-window attention is not implemented");
      c->max_positions = window;
    }
  }

  ASSIGN_OR_RETURN(c->tie_word_embeddings, f.Bool("tie_word_embeddings", false));

  // The checkpoint's dtype: torch_dtype, or dtype (transformers >= 4.56).
  ASSIGN_OR_RETURN(std::optional<std::string> torch_dtype, f.String("torch_dtype"));
  ASSIGN_OR_RETURN(std::optional<std::string> dtype, f.String("dtype"));
  if (torch_dtype && dtype && *torch_dtype != *dtype) {
    return f.Error("dtype", *f.Find("dtype"), "contradicts torch_dtype \"" + *torch_dtype + "\"");
  }
  if (!torch_dtype) torch_dtype = dtype;
  if (!torch_dtype) return f.Missing("torch_dtype", "bfloat16, float16 or float32");
  const std::string_view dtype_key = f.Find("torch_dtype") != nullptr ? "torch_dtype" : "dtype";
  if (*torch_dtype == "bfloat16") {
    c->dtype = DType::kBF16;
  } else if (*torch_dtype == "float16") {
    c->dtype = DType::kF16;
  } else if (*torch_dtype == "float32") {
    c->dtype = DType::kF32;
  } else {
    return f.Error(dtype_key, *f.Find(dtype_key),
                   "is not implemented (bfloat16, float16 or float32)");
  }

  // Token ids.
  std::vector<int64_t> bos;
  RETURN_IF_ERROR(f.TokenIds("bos_token_id", c->vocab_size, &bos));
  if (bos.size() > 1) return f.Error("bos_token_id", *f.Find("bos_token_id"), "is not one id");
  c->bos_token_id = bos.empty() ? -1 : bos[0];
  RETURN_IF_ERROR(f.TokenIds("eos_token_id", c->vocab_size, &c->eos_token_ids));
  return Status::Ok();
}

// generation_config.json's settings of transformers' generate that change
// what is drawn, with the value that means "off".
struct UnappliedSetting {
  std::string_view key;
  double off;
};
constexpr UnappliedSetting kUnapplied[] = {
    {"repetition_penalty", 1.0},
    {"num_beams", 1.0},
    {"typical_p", 1.0},
    {"min_p", 0.0},
    {"epsilon_cutoff", 0.0},
    {"eta_cutoff", 0.0},
    {"no_repeat_ngram_size", 0.0},
    {"encoder_repetition_penalty", 1.0},
};

Status ParseGeneration(const json& root, ModelConfig* c) {
  const Fields f(root, kGenerationFile);
  std::vector<int64_t> bos;
  RETURN_IF_ERROR(f.TokenIds("bos_token_id", c->vocab_size, &bos));
  if (bos.size() > 1) return f.Error("bos_token_id", *f.Find("bos_token_id"), "is not one id");
  if (!bos.empty()) c->bos_token_id = bos[0];
  std::vector<int64_t> eos;
  RETURN_IF_ERROR(f.TokenIds("eos_token_id", c->vocab_size, &eos));
  for (int64_t id : eos) {
    bool seen = false;
    for (int64_t have : c->eos_token_ids) seen = seen || have == id;
    if (!seen) c->eos_token_ids.push_back(id);
  }

  ASSIGN_OR_RETURN(bool sample, f.Bool("do_sample", false));
  ASSIGN_OR_RETURN(double temperature, f.Number("temperature", 1.0));
  ASSIGN_OR_RETURN(double top_p, f.Number("top_p", 1.0));
  // Absent: GenerationConfig's 50; null: no top-k, as transformers.
  ASSIGN_OR_RETURN(int64_t top_k, f.Int("top_k", f.Find("top_k") == nullptr ? 50 : 0, 0, kMaxDim));
  if (sample) {
    if (!(temperature > 0)) {
      return f.Error("temperature", *f.Find("temperature"), "is not > 0 with do_sample true");
    }
    if (!(top_p > 0 && top_p <= 1)) {
      return f.Error("top_p", *f.Find("top_p"), "is not in (0, 1]");
    }
    c->default_temperature = static_cast<float>(temperature);
    c->default_top_p = static_cast<float>(top_p);
    c->default_top_k = static_cast<int32_t>(top_k);
  }
  for (const UnappliedSetting& s : kUnapplied) {
    const json* v = f.Find(s.key);
    if (v == nullptr || v->is_null() || (v->is_number() && v->get<double>() == s.off)) continue;
    c->notes.push_back("generation_config.json: " + std::string(s.key) + " " + Quote(*v) +
                       " is not applied (not implemented)");
  }
  return Status::Ok();
}

// The file's text: NotFound when absent (and `required`; else nullopt).
Result<std::optional<std::string>> ReadConfigFile(const std::string& path, bool required) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 && errno == ENOENT) {
    if (required) return NotFound(path + ": no such file");
    return std::optional<std::string>();
  }
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path, &st));
  if (static_cast<uint64_t>(st.st_size) > kMaxConfigBytes) {
    return InvalidArgument(path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                           std::to_string(kMaxConfigBytes) + " a config may have");
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("read " + path, errno);
    if (n == 0) return InvalidArgument(path + ": shrank while it was read");
    done += static_cast<size_t>(n);
  }
  return std::optional<std::string>(std::move(text));
}

}  // namespace

std::vector<double> ModelConfig::InverseFrequencies() const {
  // transformers' _compute_default_rope_parameters, then, for "llama3",
  // _compute_llama3_parameters: wavelengths shorter than
  // original / high_freq_factor are kept, longer than original /
  // low_freq_factor divided by factor, and those between interpolated.
  std::vector<double> inv(static_cast<size_t>(head_dim / 2));
  const RopeScaling& s = rope_scaling;
  const double low_wavelen =
      static_cast<double>(s.original_max_position_embeddings) / s.low_freq_factor;
  const double high_wavelen =
      static_cast<double>(s.original_max_position_embeddings) / s.high_freq_factor;
  for (size_t i = 0; i < inv.size(); ++i) {
    const double f =
        1.0 / std::pow(rope_theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    if (!s.llama3) {
      inv[i] = f;
      continue;
    }
    const double wavelen = 2 * std::numbers::pi / f;
    if (wavelen < high_wavelen) {
      inv[i] = f;
    } else if (wavelen > low_wavelen) {
      inv[i] = f / s.factor;
    } else {
      const double smooth =
          (static_cast<double>(s.original_max_position_embeddings) / wavelen - s.low_freq_factor) /
          (s.high_freq_factor - s.low_freq_factor);
      inv[i] = (1 - smooth) * f / s.factor + smooth * f;
    }
  }
  return inv;
}

Result<ModelConfig> ParseModelConfig(std::string_view config_json,
                                     std::string_view generation_config_json) {
  ModelConfig config;
  ASSIGN_OR_RETURN(json root, ParseObject(config_json, kConfigFile));
  RETURN_IF_ERROR(ParseConfig(root, &config));
  if (!generation_config_json.empty()) {
    ASSIGN_OR_RETURN(json generation, ParseObject(generation_config_json, kGenerationFile));
    RETURN_IF_ERROR(ParseGeneration(generation, &config));
  }
  return config;
}

Result<ModelConfig> ReadModelConfig(const std::string& version_dir) {
  ASSIGN_OR_RETURN(std::optional<std::string> config,
                   ReadConfigFile(version_dir + "/" + std::string(kConfigFile), true));
  const std::string generation_path = version_dir + "/" + std::string(kGenerationFile);
  ASSIGN_OR_RETURN(std::optional<std::string> generation, ReadConfigFile(generation_path, false));
  if (generation && generation->empty()) return InvalidArgument(generation_path + ": empty");
  auto parsed = ParseModelConfig(*config, generation.value_or(""));
  if (!parsed.ok()) return parsed.status().WithContext(version_dir);
  return parsed;
}

}  // namespace hearth::llm
