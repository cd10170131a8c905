// A version directory of backend: llm for the tests and benches that run the
// engine with an executor of their own, which does no model math: the
// config.json of a model too small to matter, the Llama 3-shaped fixture
// tokenizer of tests/data/llm, Llama 3's chat template, and zero F32 weights
// of the config's names and shapes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "hearth/attach.h"
#include "nlohmann/json.hpp"

namespace hearth::llm::testing {

inline constexpr int64_t kTinyVocab = 1500;  // the fixture tokenizer's 1492, and rows past it
inline constexpr int32_t kTinyEot = 1490;    // <|eot_id|>
inline constexpr int32_t kTinyBos = 1481;    // <|begin_of_text|>

// Writes config.json, tokenizer.json and tokenizer_config.json into `dir`
// (which must exist) from `data` (tests/data/llm).
inline void WriteTinyVersion(const std::filesystem::path& dir, const std::filesystem::path& data,
                             int64_t max_positions) {
  const nlohmann::json config = {{"architectures", {"LlamaForCausalLM"}},
                                 {"model_type", "llama"},
                                 {"hidden_size", 8},
                                 {"intermediate_size", 16},
                                 {"num_hidden_layers", 1},
                                 {"num_attention_heads", 2},
                                 {"num_key_value_heads", 1},
                                 {"vocab_size", kTinyVocab},
                                 {"max_position_embeddings", max_positions},
                                 {"rms_norm_eps", 1e-5},
                                 {"rope_theta", 10000.0},
                                 {"hidden_act", "silu"},
                                 {"tie_word_embeddings", true},
                                 {"torch_dtype", "float32"},
                                 {"bos_token_id", kTinyBos},
                                 {"eos_token_id", kTinyEot}};
  std::ofstream(dir / "config.json") << config.dump();
  std::filesystem::copy_file(data / "tokenizers" / "npm_llama3_style" / "tokenizer.json",
                             dir / "tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::ifstream t(data / "templates" / "llama3.jinja");
  const std::string tmpl((std::istreambuf_iterator<char>(t)), std::istreambuf_iterator<char>());
  std::ofstream(dir / "tokenizer_config.json")
      << nlohmann::json({{"bos_token", "<|begin_of_text|>"},
                         {"eos_token", "<|eot_id|>"},
                         {"chat_template", tmpl}})
             .dump();
}

// The config's weights, zeros held in `storage` (which must outlive them).
inline std::vector<TensorView> TinyWeights(std::vector<std::vector<float>>& storage) {
  std::vector<TensorView> weights;
  const auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    storage.emplace_back(static_cast<size_t>(n), 0.0f);
    TensorView v;
    v.name = name;
    v.dtype = DType::kF32;
    v.shape = std::move(shape);
    v.data = storage.back().data();
    v.nbytes = static_cast<uint64_t>(n) * 4;
    weights.push_back(std::move(v));
  };
  add("model.embed_tokens.weight", {kTinyVocab, 8});
  add("model.norm.weight", {8});
  add("model.layers.0.input_layernorm.weight", {8});
  add("model.layers.0.post_attention_layernorm.weight", {8});
  add("model.layers.0.self_attn.q_proj.weight", {8, 8});
  add("model.layers.0.self_attn.k_proj.weight", {4, 8});
  add("model.layers.0.self_attn.v_proj.weight", {4, 8});
  add("model.layers.0.self_attn.o_proj.weight", {8, 8});
  add("model.layers.0.mlp.gate_proj.weight", {16, 8});
  add("model.layers.0.mlp.up_proj.weight", {16, 8});
  add("model.layers.0.mlp.down_proj.weight", {8, 16});
  return weights;
}

}  // namespace hearth::llm::testing
