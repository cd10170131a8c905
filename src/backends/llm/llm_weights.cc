// A Llama-family checkpoint's tensors bound to their roles, by transformers'
// names, each checked for dtype, shape and size before any executor reads it.
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "backends/llm/llm_model.h"

namespace hearth::llm {
namespace {

constexpr std::string_view kLayerPrefix = "model.layers.";

class Binder {
 public:
  Binder(const ModelConfig& config, const std::vector<TensorView>& weights)
      : config_(config), weights_(weights) {}

  Status Index() {
    for (const TensorView& t : weights_) {
      if (!by_name_.emplace(t.name, &t).second)
        return InvalidArgument("tensor '" + t.name + "' appears twice");
    }
    return Status::Ok();
  }

  bool Has(const std::string& name) const { return by_name_.count(name) != 0; }

  // The tensor, of config.dtype and exactly `shape` (and its bytes).
  Result<const TensorView*> Bind(const std::string& name, const std::vector<int64_t>& shape) {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return NotFound("missing tensor '" + name + "'");
    const TensorView& t = *it->second;
    if (t.dtype != config_.dtype) {
      return InvalidArgument(
          "tensor '" + name + "': expected dtype " + std::string(DTypeName(config_.dtype)) +
          " (config.json's torch_dtype), got " + std::string(DTypeName(t.dtype)));
    }
    if (t.shape != shape) {
      return InvalidArgument("tensor '" + name + "': expected shape " + ShapeString(shape) +
                             ", got " + ShapeString(t.shape));
    }
    const std::optional<uint64_t> bytes = TensorBytes(t.dtype, t.shape);
    if (!bytes || t.nbytes != *bytes) {
      return InvalidArgument("tensor '" + name + "': " + std::to_string(t.nbytes) +
                             " bytes, expected " + (bytes ? std::to_string(*bytes) : "?") +
                             " for " + std::string(DTypeName(t.dtype)) + ShapeString(t.shape));
    }
    if (t.data == nullptr) return InvalidArgument("tensor '" + name + "': no data");
    return &t;
  }

  const std::vector<TensorView>& weights() const { return weights_; }

 private:
  const ModelConfig& config_;
  const std::vector<TensorView>& weights_;
  std::unordered_map<std::string, const TensorView*> by_name_;
};

// N of "model.layers.N.rest", or -1 for another name.
int64_t LayerOf(std::string_view name) {
  if (!name.starts_with(kLayerPrefix)) return -1;
  name.remove_prefix(kLayerPrefix.size());
  int64_t n = -1;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), n);
  if (ec != std::errc() || end == name.data() + name.size() || *end != '.') return -1;
  return n;
}

}  // namespace

Result<ModelWeights> BindWeights(const ModelConfig& config,
                                 const std::vector<TensorView>& weights) {
  Binder b(config, weights);
  RETURN_IF_ERROR(b.Index());
  const int64_t hidden = config.hidden_size, inter = config.intermediate_size;
  const int64_t q_out = config.num_heads * config.head_dim;
  const int64_t kv_out = config.num_kv_heads * config.head_dim;

  ModelWeights w;
  ASSIGN_OR_RETURN(w.embed, b.Bind("model.embed_tokens.weight", {config.vocab_size, hidden}));
  ASSIGN_OR_RETURN(w.final_norm, b.Bind("model.norm.weight", {hidden}));
  if (config.tie_word_embeddings) {
    if (b.Has("lm_head.weight")) {
      return InvalidArgument(
          "tensor 'lm_head.weight' is present but config.json's tie_word_embeddings is true "
          "(the output projection is model.embed_tokens.weight): which one is meant?");
    }
    w.lm_head = w.embed;
  } else {
    auto head = b.Bind("lm_head.weight", {config.vocab_size, hidden});
    if (!head.ok() && head.status().code() == StatusCode::kNotFound) {
      return NotFound(
          "missing tensor 'lm_head.weight' (config.json's tie_word_embeddings is false)");
    }
    ASSIGN_OR_RETURN(w.lm_head, std::move(head));
  }

  w.layers.resize(static_cast<size_t>(config.num_layers));
  for (int64_t i = 0; i < config.num_layers; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    const std::string p = std::string(kLayerPrefix) + std::to_string(i) + ".";
    ASSIGN_OR_RETURN(l.input_norm, b.Bind(p + "input_layernorm.weight", {hidden}));
    ASSIGN_OR_RETURN(l.q, b.Bind(p + "self_attn.q_proj.weight", {q_out, hidden}));
    ASSIGN_OR_RETURN(l.k, b.Bind(p + "self_attn.k_proj.weight", {kv_out, hidden}));
    ASSIGN_OR_RETURN(l.v, b.Bind(p + "self_attn.v_proj.weight", {kv_out, hidden}));
    if (config.qkv_bias) {
      ASSIGN_OR_RETURN(l.q_bias, b.Bind(p + "self_attn.q_proj.bias", {q_out}));
      ASSIGN_OR_RETURN(l.k_bias, b.Bind(p + "self_attn.k_proj.bias", {kv_out}));
      ASSIGN_OR_RETURN(l.v_bias, b.Bind(p + "self_attn.v_proj.bias", {kv_out}));
    }
    ASSIGN_OR_RETURN(l.o, b.Bind(p + "self_attn.o_proj.weight", {hidden, q_out}));
    ASSIGN_OR_RETURN(l.post_norm, b.Bind(p + "post_attention_layernorm.weight", {hidden}));
    ASSIGN_OR_RETURN(l.gate, b.Bind(p + "mlp.gate_proj.weight", {inter, hidden}));
    ASSIGN_OR_RETURN(l.up, b.Bind(p + "mlp.up_proj.weight", {inter, hidden}));
    ASSIGN_OR_RETURN(l.down, b.Bind(p + "mlp.down_proj.weight", {hidden, inter}));
  }

  // What the config does not use is ignored (rotary_emb.inv_freq of old
  // checkpoints), except what says the config and the checkpoint disagree:
  // a layer past num_hidden_layers, a bias the config does not have.
  for (const TensorView& t : weights) {
    const int64_t layer = LayerOf(t.name);
    if (layer >= config.num_layers) {
      return InvalidArgument("tensor '" + t.name + "' is past config.json's num_hidden_layers " +
                             std::to_string(config.num_layers));
    }
    if (layer < 0 || !t.name.ends_with(".bias")) continue;
    const bool bound =
        config.qkv_bias && (t.name.ends_with("q_proj.bias") || t.name.ends_with("k_proj.bias") ||
                            t.name.ends_with("v_proj.bias"));
    if (!bound && (t.name.find("_proj.bias") != std::string::npos)) {
      return InvalidArgument("tensor '" + t.name + "' is a bias that " + config.architecture +
                             " with this config.json does not have (attention_bias, mlp_bias)");
    }
  }
  return w;
}

}  // namespace hearth::llm
