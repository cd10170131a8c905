// Tiny Llama-family models in host memory for the llm tests: a config, and
// every tensor BindWeights wants, with random values stored in the dtype
// asked for.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/llm/llm_model.h"
#include "common/float16.h"

namespace hearth::llm::testing {

inline ModelConfig TinyConfig(Family family = Family::kLlama, DType dtype = DType::kF32) {
  ModelConfig c;
  c.family = family;
  c.architecture = family == Family::kQwen2     ? "Qwen2ForCausalLM"
                   : family == Family::kMistral ? "MistralForCausalLM"
                                                : "LlamaForCausalLM";
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 64;
  c.max_positions = 128;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.qkv_bias = family == Family::kQwen2;
  c.tie_word_embeddings = family == Family::kQwen2;
  c.dtype = dtype;
  return c;
}

struct HostModel {
  struct Tensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::vector<Tensor> tensors;
  std::vector<TensorView> views;  // rebuilt by Views()

  void Add(std::string name, DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
           float mean, float bound) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::uniform_real_distribution<float> dist(mean - bound, mean + bound);
    Tensor t{std::move(name), dtype, std::move(shape),
             std::vector<std::byte>(n * DTypeSize(dtype))};
    for (size_t i = 0; i < n; ++i) {
      const float v = dist(rng);
      if (dtype == DType::kF32) {
        std::memcpy(t.bytes.data() + 4 * i, &v, 4);
      } else {
        const uint16_t h = dtype == DType::kF16 ? FloatToHalf(v) : FloatToBFloat16(v);
        std::memcpy(t.bytes.data() + 2 * i, &h, 2);
      }
    }
    tensors.push_back(std::move(t));
  }

  const std::vector<TensorView>& Views() {
    views.clear();
    for (const Tensor& t : tensors) {
      views.push_back(
          TensorView{t.name, t.dtype, t.shape, t.bytes.data(), 0, t.bytes.size(), Device::Host()});
    }
    return views;
  }

  Tensor* Find(const std::string& name) {
    for (Tensor& t : tensors) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }
};

// Every tensor of `c`, random under `seed`; the same seed gives the same
// values in every dtype up to that dtype's rounding (drawn in float, then
// rounded).
inline HostModel MakeModel(const ModelConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostModel m;
  const DType d = c.dtype;
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const float w = 1.0f / std::sqrt(static_cast<float>(h));
  m.Add("model.embed_tokens.weight", d, {c.vocab_size, h}, rng, 0.0f, 1.0f);
  m.Add("model.norm.weight", d, {h}, rng, 1.0f, 0.2f);
  if (!c.tie_word_embeddings) m.Add("lm_head.weight", d, {c.vocab_size, h}, rng, 0.0f, 2 * w);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    m.Add(p + "input_layernorm.weight", d, {h}, rng, 1.0f, 0.2f);
    m.Add(p + "self_attn.q_proj.weight", d, {q, h}, rng, 0.0f, 2 * w);
    m.Add(p + "self_attn.k_proj.weight", d, {kv, h}, rng, 0.0f, 2 * w);
    m.Add(p + "self_attn.v_proj.weight", d, {kv, h}, rng, 0.0f, 2 * w);
    if (c.qkv_bias) {
      m.Add(p + "self_attn.q_proj.bias", d, {q}, rng, 0.0f, 0.5f);
      m.Add(p + "self_attn.k_proj.bias", d, {kv}, rng, 0.0f, 0.5f);
      m.Add(p + "self_attn.v_proj.bias", d, {kv}, rng, 0.0f, 0.5f);
    }
    m.Add(p + "self_attn.o_proj.weight", d, {h, q}, rng, 0.0f, w);
    m.Add(p + "post_attention_layernorm.weight", d, {h}, rng, 1.0f, 0.2f);
    m.Add(p + "mlp.gate_proj.weight", d, {c.intermediate_size, h}, rng, 0.0f, 2 * w);
    m.Add(p + "mlp.up_proj.weight", d, {c.intermediate_size, h}, rng, 0.0f, 2 * w);
    m.Add(p + "mlp.down_proj.weight", d, {h, c.intermediate_size}, rng, 0.0f,
          1.0f / std::sqrt(static_cast<float>(c.intermediate_size)));
  }
  return m;
}

}  // namespace hearth::llm::testing
