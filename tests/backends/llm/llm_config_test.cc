// config.json and generation_config.json of published checkpoints (as their
// repositories hold them), every refusal with its message, and the rotary
// frequencies against transformers' formula.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "backends/llm/llm_model.h"

namespace hearth::llm {
namespace {

using json = nlohmann::json;

// meta-llama/Llama-3.1-8B
constexpr std::string_view kLlama31Config = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";
constexpr std::string_view kLlama31Generation = R"({
  "bos_token_id": 128000,
  "do_sample": true,
  "eos_token_id": 128001,
  "temperature": 0.6,
  "top_p": 0.9,
  "transformers_version": "4.43.0.dev0"
})";

// meta-llama/Llama-2-7b-hf
constexpr std::string_view kLlama2Config = R"({
  "_name_or_path": "meta-llama/Llama-2-7b-hf",
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";
constexpr std::string_view kLlama2Generation = R"({
  "bos_token_id": 1,
  "do_sample": true,
  "eos_token_id": 2,
  "pad_token_id": 0,
  "temperature": 0.6,
  "max_length": 4096,
  "top_p": 0.9,
  "transformers_version": "4.31.0.dev0"
})";

// mistralai/Mistral-7B-v0.3
constexpr std::string_view kMistralConfig = R"({
  "architectures": ["MistralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 32768
})";
constexpr std::string_view kMistralGeneration = R"({
  "_from_model_config": true,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "transformers_version": "4.42.0.dev0"
})";

// Qwen/Qwen2.5-0.5B
constexpr std::string_view kQwenConfig = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 32768,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_mrope": false,
  "use_sliding_window": false,
  "vocab_size": 151936
})";
constexpr std::string_view kQwenGeneration = R"({
  "bos_token_id": 151643,
  "do_sample": false,
  "eos_token_id": 151643,
  "max_new_tokens": 2048,
  "transformers_version": "4.37.0"
})";
// Qwen/Qwen2.5-0.5B-Instruct's: a repetition penalty this engine does not apply.
constexpr std::string_view kQwenInstructGeneration = R"({
  "bos_token_id": 151643,
  "pad_token_id": 151643,
  "do_sample": true,
  "eos_token_id": [151645, 151643],
  "repetition_penalty": 1.1,
  "temperature": 0.7,
  "top_p": 0.8,
  "top_k": 20,
  "transformers_version": "4.37.0"
})";

ModelConfig MustParse(std::string_view config, std::string_view generation = "") {
  auto c = ParseModelConfig(config, generation);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : ModelConfig{};
}

// `base` with `key` set to `value` (a JSON text; "DELETE" removes it).
std::string With(std::string_view base, const std::string& key, const std::string& value) {
  json j = json::parse(base);
  if (value == "DELETE") {
    j.erase(key);
  } else {
    j[key] = json::parse(value);
  }
  return j.dump();
}

// The refusal of `config` (and `generation`): InvalidArgument, its message
// holding every one of `parts`.
void ExpectRefused(const std::string& config, std::initializer_list<std::string_view> parts,
                   std::string_view generation = "") {
  auto c = ParseModelConfig(config, generation);
  ASSERT_FALSE(c.ok()) << "accepted: " << config;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().ToString();
  for (std::string_view part : parts) {
    EXPECT_NE(c.status().message().find(part), std::string::npos)
        << "'" << part << "' not in: " << c.status().message();
  }
}

TEST(LlmConfig, Llama31) {
  const ModelConfig c = MustParse(kLlama31Config, kLlama31Generation);
  EXPECT_EQ(c.family, Family::kLlama);
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.max_positions, 131072);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_TRUE(c.rope_scaling.llama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.dtype, DType::kBF16);
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({128001}));
  EXPECT_FLOAT_EQ(c.default_temperature, 0.6f);
  EXPECT_FLOAT_EQ(c.default_top_p, 0.9f);
  EXPECT_EQ(c.default_top_k, 50);  // GenerationConfig's default, as transformers samples
  EXPECT_TRUE(c.notes.empty());
}

TEST(LlmConfig, Llama2) {
  const ModelConfig c = MustParse(kLlama2Config, kLlama2Generation);
  EXPECT_EQ(c.family, Family::kLlama);
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.max_positions, 4096);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);  // absent: the default
  EXPECT_FALSE(c.rope_scaling.llama3);
  EXPECT_EQ(c.dtype, DType::kF16);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({2}));
  EXPECT_FLOAT_EQ(c.default_temperature, 0.6f);
}

TEST(LlmConfig, Mistral) {
  const ModelConfig c = MustParse(kMistralConfig, kMistralGeneration);
  EXPECT_EQ(c.family, Family::kMistral);
  EXPECT_EQ(c.max_positions, 32768);  // sliding_window null
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.vocab_size, 32768);
  EXPECT_EQ(c.default_temperature, 0.0f);  // no do_sample: greedy
  EXPECT_TRUE(c.notes.empty());
}

TEST(LlmConfig, MistralSlidingWindowCapsPositions) {
  // Mistral-7B-v0.1's window, narrower than its positions.
  const ModelConfig c = MustParse(With(kMistralConfig, "sliding_window", "4096"));
  EXPECT_EQ(c.max_positions, 4096);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_NE(c.notes[0].find("config.json: sliding_window 4096"), std::string::npos) << c.notes[0];
  EXPECT_NE(c.notes[0].find("32768"), std::string::npos) << c.notes[0];
  // As wide as the positions: nothing to say.
  const ModelConfig wide = MustParse(With(kMistralConfig, "sliding_window", "32768"));
  EXPECT_EQ(wide.max_positions, 32768);
  EXPECT_TRUE(wide.notes.empty());
}

TEST(LlmConfig, Qwen25) {
  const ModelConfig c = MustParse(kQwenConfig, kQwenGeneration);
  EXPECT_EQ(c.family, Family::kQwen2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_heads, 14);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.max_positions, 32768);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({151643}));
  EXPECT_EQ(c.default_temperature, 0.0f);  // do_sample false
}

TEST(LlmConfig, QwenInstructGeneration) {
  const ModelConfig c = MustParse(kQwenConfig, kQwenInstructGeneration);
  // config.json's eos first, then generation_config.json's others.
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({151643, 151645}));
  EXPECT_FLOAT_EQ(c.default_temperature, 0.7f);
  EXPECT_FLOAT_EQ(c.default_top_p, 0.8f);
  EXPECT_EQ(c.default_top_k, 20);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_EQ(c.notes[0],
            "generation_config.json: repetition_penalty 1.1 is not applied "
            "(not implemented)");
}

TEST(LlmConfig, GenerationDetails) {
  // Llama 3.1 Instruct's eos list; top_k null: none.
  const ModelConfig c = MustParse(kLlama31Config, R"({"do_sample": true, "eos_token_id":
      [128001, 128008, 128009], "top_k": null, "bos_token_id": 128000})");
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({128001, 128008, 128009}));
  EXPECT_EQ(c.default_top_k, 0);
  EXPECT_FLOAT_EQ(c.default_temperature, 1.0f);
  EXPECT_FLOAT_EQ(c.default_top_p, 1.0f);
  // Without do_sample the sampling fields are defaults for nothing: greedy.
  const ModelConfig greedy = MustParse(kLlama31Config, R"({"temperature": 0.6, "top_k": 5})");
  EXPECT_EQ(greedy.default_temperature, 0.0f);
  EXPECT_EQ(greedy.default_top_k, 0);
  // No eos anywhere.
  const ModelConfig none = MustParse(With(kLlama31Config, "eos_token_id", "null"));
  EXPECT_TRUE(none.eos_token_ids.empty());
  const ModelConfig no_bos = MustParse(With(kLlama31Config, "bos_token_id", "DELETE"));
  EXPECT_EQ(no_bos.bos_token_id, -1);
}

TEST(LlmConfig, HeadDimKeyAndDefaults) {
  // Mistral-Nemo: head_dim 128 although 5120 / 32 = 160.
  std::string nemo = With(kMistralConfig, "hidden_size", "5120");
  nemo = With(nemo, "head_dim", "128");
  const ModelConfig c = MustParse(nemo);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.hidden_size, 5120);
  // head_dim null: hidden / heads.
  EXPECT_EQ(MustParse(With(kLlama31Config, "head_dim", "null")).head_dim, 128);
  // num_key_value_heads absent: transformers' default per family.
  EXPECT_EQ(MustParse(With(kLlama2Config, "num_key_value_heads", "DELETE")).num_kv_heads, 32);
  EXPECT_EQ(MustParse(With(kMistralConfig, "num_key_value_heads", "DELETE")).num_kv_heads, 8);
  EXPECT_EQ(MustParse(With(kMistralConfig, "num_key_value_heads", "null")).num_kv_heads, 32);
  EXPECT_EQ(MustParse(With(kLlama2Config, "max_position_embeddings", "DELETE")).max_positions,
            2048);
  // transformers >= 4.56 writes dtype.
  std::string dtype = With(kLlama31Config, "torch_dtype", "DELETE");
  EXPECT_EQ(MustParse(With(dtype, "dtype", "\"float32\"")).dtype, DType::kF32);
  // rope_type "default" is no scaling; "type" is the older spelling.
  EXPECT_FALSE(MustParse(With(kLlama2Config, "rope_scaling", R"({"rope_type": "default"})"))
                   .rope_scaling.llama3);
  EXPECT_TRUE(MustParse(With(kLlama31Config, "rope_scaling",
                             R"({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})"))
                  .rope_scaling.llama3);
  // transformers 5's rope_parameters, theta inside.
  std::string v5 = With(kLlama31Config, "rope_scaling", "DELETE");
  v5 = With(v5, "rope_theta", "DELETE");
  v5 = With(v5, "rope_parameters",
            R"({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192})");
  const ModelConfig p = MustParse(v5);
  EXPECT_TRUE(p.rope_scaling.llama3);
  EXPECT_DOUBLE_EQ(p.rope_theta, 500000.0);
  // Qwen2's layer_types, all full attention.
  EXPECT_EQ(
      MustParse(With(kQwenConfig, "layer_types", R"(["full_attention", "full_attention"])")).family,
      Family::kQwen2);
}

TEST(LlmConfig, RefusesWhatChangesTheMath) {
  ExpectRefused(With(kLlama31Config, "hidden_act", "\"gelu\""),
                {"config.json: hidden_act \"gelu\"", "not implemented"});
  ExpectRefused(With(kLlama31Config, "attention_bias", "true"),
                {"config.json: attention_bias true", "LlamaForCausalLM"});
  ExpectRefused(With(kMistralConfig, "attention_bias", "true"),
                {"config.json: attention_bias true", "MistralForCausalLM"});
  ExpectRefused(With(kLlama31Config, "mlp_bias", "true"), {"config.json: mlp_bias true"});
  ExpectRefused(With(kLlama2Config, "rope_scaling", R"({"type": "linear", "factor": 2.0})"),
                {"config.json: rope_scaling.type \"linear\"", "not implemented"});
  ExpectRefused(With(kLlama2Config, "rope_scaling", R"({"rope_type": "dynamic", "factor": 2.0})"),
                {"config.json: rope_scaling.rope_type \"dynamic\""});
  ExpectRefused(With(kQwenConfig, "rope_scaling",
                     R"({"type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32768})"),
                {"config.json: rope_scaling.type \"yarn\""});
  ExpectRefused(With(kLlama2Config, "rope_scaling", R"({"factor": 2.0})"),
                {"config.json: rope_scaling.rope_type is missing"});
  ExpectRefused(With(kLlama2Config, "rope_scaling", R"({"rope_type": "llama3", "type": "yarn"})"),
                {"config.json: rope_scaling.type \"yarn\"", "contradicts"});
  ExpectRefused(With(kLlama31Config, "rope_scaling",
                     R"({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})"),
                {"config.json: rope_scaling.factor is missing"});
  ExpectRefused(With(kLlama31Config, "rope_scaling",
                     R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})"),
                {"config.json: rope_scaling.high_freq_factor 4.0", "low_freq_factor"});
  ExpectRefused(With(kLlama31Config, "rope_scaling",
                     R"({"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})"),
                {"config.json: rope_scaling.factor 0.5"});
  ExpectRefused(With(kLlama31Config, "rope_scaling",
                     R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                         "attention_factor": 1.2})"),
                {"config.json: rope_scaling.attention_factor 1.2", "not implemented"});
  ExpectRefused(With(kLlama31Config, "rope_parameters", R"({"rope_type": "default"})"),
                {"config.json: rope_scaling", "rope_parameters"});
  ExpectRefused(With(kLlama2Config, "partial_rotary_factor", "0.5"),
                {"config.json: partial_rotary_factor 0.5"});
  ExpectRefused(With(kLlama31Config, "num_key_value_heads", "5"),
                {"config.json: num_key_value_heads 5", "does not divide", "32"});
  ExpectRefused(
      With(kLlama31Config, "quantization_config", R"({"quant_method": "awq", "bits": 4})"),
      {"config.json: quantization_config", "awq", "not implemented"});
  ExpectRefused(With(kLlama2Config, "pretraining_tp", "2"), {"config.json: pretraining_tp 2"});
  ExpectRefused(With(kQwenConfig, "use_sliding_window", "true"),
                {"config.json: use_sliding_window true"});
  ExpectRefused(With(kQwenConfig, "use_mrope", "true"), {"config.json: use_mrope true"});
  ExpectRefused(With(kQwenConfig, "layer_types", R"(["full_attention", "sliding_attention"])"),
                {"config.json: layer_types", "\"sliding_attention\""});
}

TEST(LlmConfig, RefusesWhatIsMalformed) {
  ExpectRefused(With(kLlama31Config, "architectures", R"(["MixtralForCausalLM"])"),
                {"config.json: architectures [\"MixtralForCausalLM\"]", "not implemented"});
  ExpectRefused(With(kLlama31Config, "architectures", "DELETE"),
                {"config.json: architectures is missing"});
  ExpectRefused(
      With(kLlama31Config, "architectures", R"(["LlamaForCausalLM", "MistralForCausalLM"])"),
      {"config.json: architectures", "not a list of one"});
  ExpectRefused(With(kLlama31Config, "model_type", "\"mistral\""),
                {"config.json: model_type \"mistral\"", "contradicts"});
  ExpectRefused(With(kLlama31Config, "torch_dtype", "\"int8\""),
                {"config.json: torch_dtype \"int8\"", "not implemented"});
  ExpectRefused(With(kLlama31Config, "torch_dtype", "DELETE"),
                {"config.json: torch_dtype is missing"});
  ExpectRefused(With(kLlama31Config, "dtype", "\"float16\""),
                {"config.json: dtype \"float16\"", "contradicts torch_dtype \"bfloat16\""});
  ExpectRefused(With(kLlama31Config, "hidden_size", "DELETE"),
                {"config.json: hidden_size is missing"});
  ExpectRefused(With(kLlama31Config, "hidden_size", "4096.5"),
                {"config.json: hidden_size 4096.5", "not an integer"});
  ExpectRefused(With(kLlama31Config, "vocab_size", "-1"), {"config.json: vocab_size -1"});
  ExpectRefused(With(kLlama31Config, "hidden_size", "4100"),
                {"config.json: num_attention_heads 32", "does not divide hidden_size 4100"});
  ExpectRefused(With(kLlama31Config, "head_dim", "63"), {"config.json: head_dim 63", "odd"});
  ExpectRefused(With(kLlama31Config, "eos_token_id", "128256"),
                {"config.json: eos_token_id 128256", "vocab_size"});
  ExpectRefused(With(kLlama31Config, "eos_token_id", R"([1, "two"])"),
                {"config.json: eos_token_id [1,\"two\"]"});
  ExpectRefused(With(kLlama31Config, "rms_norm_eps", "\"1e-5\""),
                {"config.json: rms_norm_eps \"1e-5\"", "not a number"});
  ExpectRefused(With(kLlama31Config, "tie_word_embeddings", "1"),
                {"config.json: tie_word_embeddings 1", "not true or false"});
  ExpectRefused(With(kMistralConfig, "sliding_window", "0"), {"config.json: sliding_window 0"});
  ExpectRefused("{\"architectures\": ", {"config.json: invalid JSON"});
  ExpectRefused("[1, 2]", {"config.json: not a JSON object"});
}

TEST(LlmConfig, RefusesGenerationConfig) {
  const std::string c(kLlama31Config);
  ExpectRefused(c, {"generation_config.json: temperature 0", "do_sample"},
                R"({"do_sample": true, "temperature": 0})");
  ExpectRefused(c, {"generation_config.json: top_p 1.5"}, R"({"do_sample": true, "top_p": 1.5})");
  ExpectRefused(c, {"generation_config.json: top_k -3"}, R"({"do_sample": true, "top_k": -3})");
  ExpectRefused(c, {"generation_config.json: do_sample \"yes\""}, R"({"do_sample": "yes"})");
  ExpectRefused(c, {"generation_config.json: eos_token_id [128001,-1]"},
                R"({"eos_token_id": [128001, -1]})");
  ExpectRefused(c, {"generation_config.json: bos_token_id [1,2]"}, R"({"bos_token_id": [1, 2]})");
  ExpectRefused(c, {"generation_config.json: invalid JSON"}, "{");
}

class LlmConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "llm_config_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, std::string_view text) {
    std::ofstream(dir_ + "/" + name) << text;
  }
  std::string dir_;
};

TEST_F(LlmConfigFiles, ReadsBothFiles) {
  auto missing = ReadModelConfig(dir_);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(dir_ + "/config.json"), std::string::npos);

  Write("config.json", kLlama31Config);
  auto alone = ReadModelConfig(dir_);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  EXPECT_EQ(alone->default_temperature, 0.0f);

  Write("generation_config.json", kLlama31Generation);
  auto both = ReadModelConfig(dir_);
  ASSERT_TRUE(both.ok()) << both.status().ToString();
  EXPECT_FLOAT_EQ(both->default_temperature, 0.6f);

  Write("generation_config.json", "");
  auto empty = ReadModelConfig(dir_);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("generation_config.json: empty"), std::string::npos)
      << empty.status().message();

  std::filesystem::remove(dir_ + "/generation_config.json");
  Write("config.json", With(kLlama31Config, "hidden_act", "\"relu\""));
  auto bad = ReadModelConfig(dir_);
  ASSERT_FALSE(bad.ok());
  // The directory, the file, the field and the value.
  EXPECT_NE(bad.status().message().find(dir_ + ": config.json: hidden_act \"relu\""),
            std::string::npos)
      << bad.status().message();

  std::filesystem::remove(dir_ + "/config.json");
  std::filesystem::create_directory(dir_ + "/config.json");
  auto directory = ReadModelConfig(dir_);
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find("a directory"), std::string::npos)
      << directory.status().message();
}

// transformers' _compute_llama3_parameters for Llama-3.2-1B (head_dim 64,
// rope_theta 500000, factor 32, low_freq_factor 1, high_freq_factor 4,
// original_max_position_embeddings 8192), computed with torch 1.13 by the
// function below, in float64 (kFloat64) and in transformers' own float32
// (kFloat32):
//
//   def llama3(dtype, dim=64, base=500000.0, factor=32.0, low=1.0, high=4.0, old=8192):
//       inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=dtype)
//                                  / dim))
//       low_wl, high_wl = old / low, old / high
//       wavelen = 2 * math.pi / inv_freq
//       inv_freq_llama = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
//       smooth = (old / wavelen - low) / (high - low)
//       smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
//       is_medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
//       return torch.where(is_medium, smoothed, inv_freq_llama)
constexpr double kFloat64[] = {1.0,
                               0.6636012376960885,
                               0.44036660267178046,
                               0.2922278225730151,
                               0.19392274474868576,
                               0.12868737343265052,
                               0.08539710028576561,
                               0.056669621445291044,
                               0.03760603093086393,
                               0.024955408670558694,
                               0.016560440080994446,
                               0.010989528534539826,
                               0.0072926647372171085,
                               0.004839421345719893,
                               0.0032114459947525913,
                               0.0012905479282092638,
                               0.00042955679655936815,
                               9.70828780262767e-05,
                               1.9461638184831125e-05,
                               1.291476718704739e-05,
                               8.570255489881478e-06,
                               5.687232150457046e-06,
                               3.7740542941082826e-06,
                               2.5044671007024935e-06,
                               1.661967467795309e-06,
                               1.102883668639601e-06,
                               7.318749675440419e-07,
                               4.856731343010108e-07,
                               3.2229329303788936e-07,
                               2.138742281610915e-07,
                               1.4192720251899592e-07,
                               9.418306725434909e-08};
constexpr float kFloat32[] = {1.0,
                              0.663601279258728,
                              0.44036662578582764,
                              0.2922278344631195,
                              0.193922758102417,
                              0.12868738174438477,
                              0.08539710193872452,
                              0.05666961893439293,
                              0.03760603070259094,
                              0.02495540864765644,
                              0.016560440883040428,
                              0.010989529080688953,
                              0.00729266507551074,
                              0.00483942124992609,
                              0.0032114461064338684,
                              0.0012905480107292533,
                              0.000429556705057621,
                              9.708286233944818e-05,
                              1.9461638657958247e-05,
                              1.291476746700937e-05,
                              8.570255886297673e-06,
                              5.687232260243036e-06,
                              3.7740544485131977e-06,
                              2.504467147446121e-06,
                              1.6619674170215148e-06,
                              1.1028836297555245e-06,
                              7.318749339901842e-07,
                              4.856731266045244e-07,
                              3.2229328894572973e-07,
                              2.1387423032592778e-07,
                              1.4192720243499934e-07,
                              9.418306490260875e-08};

TEST(LlmConfig, InverseFrequenciesLlama3) {
  std::string llama32 = With(kLlama31Config, "hidden_size", "2048");
  llama32 = With(llama32, "head_dim", "64");
  llama32 = With(llama32, "rope_scaling",
                 R"({"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"})");
  const std::vector<double> inv = MustParse(llama32).InverseFrequencies();
  ASSERT_EQ(inv.size(), 32u);
  for (size_t i = 0; i < inv.size(); ++i) {
    // The same formula in the same precision: equal to the last bits (pow
    // may differ from torch's by an ulp).
    EXPECT_NEAR(inv[i], kFloat64[i], 1e-14 * kFloat64[i]) << i;
    // What transformers holds (float32): within its rounding.
    EXPECT_NEAR(inv[i], kFloat32[i], 1e-6 * kFloat32[i]) << i;
  }
  // The three bands: 0 to 14 kept (short wavelengths), 15 to 17 smoothed, 18 on divided.
  EXPECT_DOUBLE_EQ(inv[14], std::pow(500000.0, -28.0 / 64));
  EXPECT_GT(inv[16], std::pow(500000.0, -32.0 / 64) / 32);
  EXPECT_LT(inv[16], std::pow(500000.0, -32.0 / 64));
  EXPECT_DOUBLE_EQ(inv[20], std::pow(500000.0, -40.0 / 64) / 32);
}

TEST(LlmConfig, InverseFrequenciesPlain) {
  const std::vector<double> inv = MustParse(kLlama2Config).InverseFrequencies();
  ASSERT_EQ(inv.size(), 64u);
  for (size_t i = 0; i < inv.size(); ++i) {
    EXPECT_DOUBLE_EQ(inv[i], 1.0 / std::pow(10000.0, static_cast<double>(2 * i) / 128)) << i;
  }
}

}  // namespace
}  // namespace hearth::llm
