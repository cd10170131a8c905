// backend llm's model files against any bytes: the first byte picks which
// file the rest is.
//   0: config.json (no generation_config.json);
//   1: generation_config.json beside a fixed Llama-shaped config.json;
//   2: tokenizer.json;
//   3: tokenizer_config.json.
// Each parser never crashes and refuses only with InvalidArgument naming the
// file. What it accepts keeps its header's promises: a config's dimensions,
// token ids and sampling defaults in range and RoPE's frequencies finite; a
// tokenizer whose ids all lie below vocab_size, whose encodings of a fixed
// corpus decode, and whose incremental detokenizer gives exactly what Decode
// gives; a tokenizer_config.json whose template renders a fixed chat within
// tight limits or fails with InvalidArgument or ResourceExhausted.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <string>
#include <string_view>

#include "backends/llm/chat_template.h"
#include "backends/llm/llm_model.h"
#include "backends/llm/tokenizer.h"
#include "nlohmann/json.hpp"

namespace {

using hearth::StatusCode;
using hearth::llm::ChatTemplateConfig;
using hearth::llm::ChatTemplateOptions;
using hearth::llm::Detokenizer;
using hearth::llm::ModelConfig;
using hearth::llm::Tokenizer;

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "llm_files_fuzzer: %s\n", what);
    std::abort();
  }
}

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// A refusal: InvalidArgument, its message naming `file` first.
void RequireRefusal(const hearth::Status& status, std::string_view file) {
  Require(status.code() == StatusCode::kInvalidArgument, "a refusal is not InvalidArgument");
  Require(StartsWith(status.message(), file), "a refusal does not name the file first");
}

constexpr std::string_view kConfig = R"({
  "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"
})";

void CheckConfig(const ModelConfig& c) {
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  for (int64_t d : {c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
                    c.head_dim, c.vocab_size, c.max_positions}) {
    Require(d >= 1 && d <= kMaxDim, "an accepted config has a dimension out of range");
  }
  Require(c.num_heads % c.num_kv_heads == 0, "num_key_value_heads does not divide the heads");
  Require(c.head_dim % 2 == 0, "an accepted config has an odd head_dim");
  Require(c.num_heads * c.head_dim <= kMaxDim, "heads times head_dim is too large");
  Require(!c.architecture.empty(), "an accepted config names no architecture");
  Require(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps >= 0, "rms_norm_eps out of range");
  Require(std::isfinite(c.rope_theta) && c.rope_theta > 0, "rope_theta out of range");
  Require(c.bos_token_id >= -1 && c.bos_token_id < c.vocab_size, "bos_token_id out of range");
  for (int64_t id : c.eos_token_ids) {
    Require(id >= 0 && id < c.vocab_size, "an eos id out of range");
  }
  Require(std::isfinite(c.default_temperature) && c.default_temperature >= 0,
          "the default temperature is out of range");
  Require(c.default_top_p > 0 && c.default_top_p <= 1, "the default top_p is out of range");
  Require(c.default_top_k >= 0, "the default top_k is negative");
  for (const std::string& note : c.notes) {
    Require(StartsWith(note, "config.json: ") || StartsWith(note, "generation_config.json: "),
            "a note does not name its file");
  }
  // Bounded: head_dim is at most 2^16.
  const std::vector<double> inv = c.InverseFrequencies();
  Require(static_cast<int64_t>(inv.size()) == c.head_dim / 2, "not head_dim / 2 frequencies");
  for (double f : inv) Require(std::isfinite(f) && f >= 0, "a RoPE frequency is not finite");
}

constexpr std::string_view kCorpus[] = {
    "Hello, world! It's 2024.",
    "  leading and   runs of   spaces\n\n\ttabs\r\n",
    "café naïve Ångström façade",
    "日本語のテキスト、中文文本。한국어",
    "emoji 🦙🔥👩‍👩‍👧 flags 🇨🇭",
    "<s></s><|begin_of_text|><|eot_id|>[INST]<unk>",
    "\xff\xfe not UTF-8 \xc3",
};

void CheckTokenizer(const Tokenizer& t) {
  Require(t.vocab_size() >= 1, "an accepted tokenizer has no ids");
  for (std::string_view text : kCorpus) {
    for (bool add_special : {false, true}) {
      for (bool parse_special : {false, true}) {
        auto ids = t.Encode(text, add_special, parse_special);
        if (!ids.ok()) {
          Require(ids.status().code() != StatusCode::kInternal, "Encode failed as Internal");
          continue;
        }
        for (int32_t id : *ids) Require(id >= 0 && id < t.vocab_size(), "an id past vocab_size");
        for (bool skip : {false, true}) {
          auto decoded = t.Decode(*ids, skip);
          Require(decoded.ok(), "ids from Encode do not decode");
          Detokenizer d = t.NewDetokenizer(skip);
          std::string streamed;
          for (int32_t id : *ids) {
            auto piece = d.Push(id);
            Require(piece.ok(), "an id from Encode does not detokenize");
            streamed += *piece;
          }
          streamed += d.Flush();
          Require(streamed == *decoded, "the detokenizer differs from Decode");
        }
      }
    }
  }
  // Ids the tokenizer does not know are refused, not read past its tables.
  const int32_t outside[] = {-1, t.vocab_size(), std::numeric_limits<int32_t>::max()};
  for (int32_t id : outside) {
    const int32_t one[] = {id};
    Require(!t.Decode(one, false).ok(), "Decode took an id outside the vocab");
  }
}

const nlohmann::ordered_json& Chat() {
  static const auto* chat = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "Grüße 👋"},
                 {"role": "assistant", "content": "Hi."},
                 {"role": "user", "content": "Again?"}],
    "add_generation_prompt": true, "tools": null})"));
  return *chat;
}

void CheckTokenizerConfig(const ChatTemplateConfig& c) {
  for (bool tools : {false, true}) {
    const hearth::llm::ChatTemplate* t = c.Select(tools);
    if (t == nullptr) continue;
    nlohmann::ordered_json context = Chat();
    const nlohmann::ordered_json special = c.SpecialTokens();
    for (const auto& [key, value] : special.items()) context[key] = value;
    ChatTemplateOptions options;
    options.limits.max_output_bytes = 1u << 20;
    options.limits.max_loop_iterations = 100'000;
    options.limits.max_depth = 64;
    options.now = [] {
      std::tm tm{};
      tm.tm_year = 124;
      tm.tm_mon = 6;
      tm.tm_mday = 26;
      return tm;
    };
    auto out = t->Render(context, options);
    if (out.ok()) {
      Require(out->size() <= options.limits.max_output_bytes, "a render past max_output_bytes");
    } else {
      const StatusCode code = out.status().code();
      Require(code == StatusCode::kInvalidArgument || code == StatusCode::kResourceExhausted,
              "Render failed with another code than InvalidArgument or ResourceExhausted");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: {
      auto c = hearth::llm::ParseModelConfig(rest, "");
      if (c.ok()) {
        CheckConfig(*c);
      } else {
        RequireRefusal(c.status(), "config.json");
      }
      break;
    }
    case 1: {
      auto c = hearth::llm::ParseModelConfig(kConfig, rest);
      if (c.ok()) {
        CheckConfig(*c);
      } else if (rest.empty()) {
        Require(false, "the fixed config.json is refused");
      } else {
        RequireRefusal(c.status(), "generation_config.json");
      }
      break;
    }
    case 2: {
      auto t = Tokenizer::Parse(rest, "tokenizer.json");
      if (t.ok()) {
        CheckTokenizer(**t);
      } else {
        RequireRefusal(t.status(), "tokenizer.json");
      }
      break;
    }
    default: {
      auto c = hearth::llm::ParseTokenizerConfig(rest, "tokenizer_config.json");
      if (c.ok()) {
        CheckTokenizerConfig(*c);
      } else {
        RequireRefusal(c.status(), "tokenizer_config.json");
      }
      break;
    }
  }
  return 0;
}
