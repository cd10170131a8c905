// BindWeights: transformers' names bound to their roles; every missing,
// misshapen or mistyped tensor refused by name.
#include <gtest/gtest.h>

#include <string>

#include "backends/llm/llm_model.h"
#include "llm_test_model.h"

namespace hearth::llm {
namespace {

using testing::HostModel;
using testing::MakeModel;
using testing::TinyConfig;

void ExpectRefused(const ModelConfig& c, const std::vector<TensorView>& views, StatusCode code,
                   std::initializer_list<std::string_view> parts) {
  auto w = BindWeights(c, views);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), code) << w.status().ToString();
  for (std::string_view part : parts) {
    EXPECT_NE(w.status().message().find(part), std::string::npos)
        << "'" << part << "' not in: " << w.status().message();
  }
}

TEST(LlmWeights, BindsEveryRole) {
  const ModelConfig c = TinyConfig(Family::kLlama, DType::kBF16);
  HostModel m = MakeModel(c, 1);
  // An old checkpoint's buffer, not a weight: ignored.
  m.tensors.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq",
                       DType::kF32,
                       {4},
                       std::vector<std::byte>(16)});
  const std::vector<TensorView>& views = m.Views();
  auto w = BindWeights(c, views);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->embed->name, "model.embed_tokens.weight");
  EXPECT_EQ(w->final_norm->name, "model.norm.weight");
  EXPECT_EQ(w->lm_head->name, "lm_head.weight");
  ASSERT_EQ(w->layers.size(), 2u);
  const LayerWeights& l = w->layers[1];
  EXPECT_EQ(l.input_norm->name, "model.layers.1.input_layernorm.weight");
  EXPECT_EQ(l.q->name, "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(l.k->name, "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(l.v->name, "model.layers.1.self_attn.v_proj.weight");
  EXPECT_EQ(l.o->name, "model.layers.1.self_attn.o_proj.weight");
  EXPECT_EQ(l.post_norm->name, "model.layers.1.post_attention_layernorm.weight");
  EXPECT_EQ(l.gate->name, "model.layers.1.mlp.gate_proj.weight");
  EXPECT_EQ(l.up->name, "model.layers.1.mlp.up_proj.weight");
  EXPECT_EQ(l.down->name, "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(l.q_bias, nullptr);
  // Views into the caller's tensors, not copies.
  EXPECT_GE(w->embed, views.data());
  EXPECT_LT(w->embed, views.data() + views.size());
}

TEST(LlmWeights, Qwen2BiasesAndTiedHead) {
  const ModelConfig c = TinyConfig(Family::kQwen2);
  HostModel m = MakeModel(c, 1);
  auto w = BindWeights(c, m.Views());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->lm_head, w->embed);
  EXPECT_EQ(w->layers[0].q_bias->name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(w->layers[0].k_bias->name, "model.layers.0.self_attn.k_proj.bias");
  EXPECT_EQ(w->layers[0].v_bias->name, "model.layers.0.self_attn.v_proj.bias");

  HostModel no_bias = MakeModel(c, 1);
  std::erase_if(no_bias.tensors, [](const auto& t) { return t.name.ends_with("k_proj.bias"); });
  ExpectRefused(c, no_bias.Views(), StatusCode::kNotFound,
                {"missing tensor 'model.layers.0.self_attn.k_proj.bias'"});
}

TEST(LlmWeights, TiedOrNot) {
  ModelConfig tied = TinyConfig();
  tied.tie_word_embeddings = true;
  HostModel with_head = MakeModel(TinyConfig(), 1);
  ExpectRefused(tied, with_head.Views(), StatusCode::kInvalidArgument,
                {"'lm_head.weight' is present", "tie_word_embeddings is true"});
  HostModel without_head = MakeModel(tied, 1);
  auto w = BindWeights(tied, without_head.Views());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->lm_head, w->embed);
  ExpectRefused(TinyConfig(), without_head.Views(), StatusCode::kNotFound,
                {"missing tensor 'lm_head.weight'", "tie_word_embeddings is false"});
}

TEST(LlmWeights, RefusesMissingTensors) {
  const ModelConfig c = TinyConfig();
  for (const std::string name :
       {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.o_proj.weight"}) {
    HostModel m = MakeModel(c, 1);
    std::erase_if(m.tensors, [&](const auto& t) { return t.name == name; });
    ExpectRefused(c, m.Views(), StatusCode::kNotFound, {"missing tensor '" + name + "'"});
  }
}

TEST(LlmWeights, RefusesWrongShapeDtypeAndSize) {
  const ModelConfig c = TinyConfig(Family::kLlama, DType::kF16);
  {
    HostModel m = MakeModel(c, 1);
    m.Find("model.layers.0.mlp.gate_proj.weight")->shape = {32, 48};  // transposed
    ExpectRefused(c, m.Views(), StatusCode::kInvalidArgument,
                  {"tensor 'model.layers.0.mlp.gate_proj.weight': expected shape [48,32], got "
                   "[32,48]"});
  }
  {
    HostModel m = MakeModel(c, 1);
    // k_proj sized for every head, not the kv heads (no GQA in the checkpoint).
    HostModel::Tensor* k = m.Find("model.layers.1.self_attn.k_proj.weight");
    k->shape = {32, 32};
    k->bytes.resize(32 * 32 * 2);
    ExpectRefused(c, m.Views(), StatusCode::kInvalidArgument,
                  {"tensor 'model.layers.1.self_attn.k_proj.weight': expected shape [16,32], got "
                   "[32,32]"});
  }
  {
    HostModel m = MakeModel(c, 1);
    m.Find("model.norm.weight")->dtype = DType::kBF16;
    ExpectRefused(c, m.Views(), StatusCode::kInvalidArgument,
                  {"tensor 'model.norm.weight': expected dtype F16", "torch_dtype", "got BF16"});
  }
  {
    HostModel m = MakeModel(c, 1);
    m.Find("model.layers.1.post_attention_layernorm.weight")->bytes.resize(10);
    ExpectRefused(c, m.Views(), StatusCode::kInvalidArgument,
                  {"tensor 'model.layers.1.post_attention_layernorm.weight': 10 bytes, expected "
                   "64"});
  }
  {
    HostModel m = MakeModel(c, 1);
    m.tensors.push_back(m.tensors.front());
    ExpectRefused(c, m.Views(), StatusCode::kInvalidArgument, {"appears twice"});
  }
}

TEST(LlmWeights, RefusesWhatTheConfigDoesNotHave) {
  const ModelConfig c = TinyConfig();
  {
    // A third layer in a checkpoint whose config says two.
    ModelConfig three = c;
    three.num_layers = 3;
    HostModel m = MakeModel(three, 1);
    ExpectRefused(c, m.Views(), StatusCode::kInvalidArgument,
                  {"model.layers.2.", "past config.json's num_hidden_layers 2"});
  }
  {
    // Qwen2-style biases beside a Llama config.
    ModelConfig biased = c;
    biased.qkv_bias = true;
    HostModel m = MakeModel(biased, 1);
    ExpectRefused(c, m.Views(), StatusCode::kInvalidArgument,
                  {"model.layers.0.self_attn.q_proj.bias", "does not have"});
  }
}

}  // namespace
}  // namespace hearth::llm
