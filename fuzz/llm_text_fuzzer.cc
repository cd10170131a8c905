// backend llm's text side against any request: the first byte picks what
// the rest is.
//   0, 1: a prompt for the byte-level (Llama 3-shaped) or SentencePiece-style
//         (Mistral-shaped) tokenizer, encoded with and without special
//         tokens parsed; what encodes must decode, and the incremental
//         detokenizer must give exactly what Decode gives.
//   2:    token ids (4 bytes each) to decode, any of them out of range.
//   3:    a chat's messages (JSON, or the text as one user message) through
//         three real chat templates: rendered or refused, never a crash.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "backends/llm/chat_template.h"
#include "backends/llm/tokenizer.h"
#include "nlohmann/json.hpp"

namespace {

using hearth::llm::ChatTemplate;
using hearth::llm::Detokenizer;
using hearth::llm::Tokenizer;

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "llm_text_fuzzer: %s\n", what);
    std::abort();
  }
}

const Tokenizer& Load(const char* name) {
  auto t = Tokenizer::Load(std::string(HEARTH_FUZZ_LLM_DATA) + "/tokenizers/" + name +
                           "/tokenizer.json");
  Require(t.ok(), "a fixture tokenizer does not load");
  return *std::move(t).value().release();  // lives for the process
}

const std::vector<ChatTemplate>& Templates() {
  static const std::vector<ChatTemplate>* templates = [] {
    auto* out = new std::vector<ChatTemplate>;
    for (const char* name : {"llama3.1.jinja", "qwen2.5.jinja", "mistral-v0.1.jinja"}) {
      const std::string path = std::string(HEARTH_FUZZ_LLM_DATA) + "/templates/" + name;
      FILE* f = std::fopen(path.c_str(), "rb");
      Require(f != nullptr, "a fixture template is missing");
      std::string text;
      char buf[4096];
      for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
      std::fclose(f);
      auto parsed = ChatTemplate::Parse(text);
      Require(parsed.ok(), "a fixture template does not parse");
      out->push_back(std::move(*parsed));
    }
    return out;
  }();
  return *templates;
}

void Tokenize(const Tokenizer& t, std::string_view text) {
  for (bool add_special : {false, true}) {
    for (bool parse_special : {false, true}) {
      auto ids = t.Encode(text, add_special, parse_special);
      if (!ids.ok()) continue;
      for (bool skip : {false, true}) {
        auto decoded = t.Decode(*ids, skip);
        Require(decoded.ok(), "ids from Encode do not decode");
        Detokenizer d(t, skip);
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Tokenizer& byte_level = Load("npm_llama3_style");
  static const Tokenizer& sentencepiece = Load("npm_mistral_style");
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      Tokenize(byte_level, rest);
      break;
    case 1:
      Tokenize(sentencepiece, rest);
      break;
    case 2: {
      std::vector<int32_t> ids(rest.size() / 4);
      if (!ids.empty()) std::memcpy(ids.data(), rest.data(), ids.size() * 4);
      for (const Tokenizer* t : {&byte_level, &sentencepiece}) {
        (void)t->Decode(ids, false);
        Detokenizer d(*t, true);
        for (int32_t id : ids) (void)d.Push(id);
        (void)d.Flush();
      }
      break;
    }
    default: {
      nlohmann::ordered_json messages = nlohmann::ordered_json::parse(rest, nullptr, false);
      if (messages.is_discarded())
        messages =
            nlohmann::ordered_json::array({{{"role", "user"}, {"content", std::string(rest)}}});
      nlohmann::ordered_json context = {{"messages", messages},
                                        {"add_generation_prompt", true},
                                        {"bos_token", "<s>"},
                                        {"eos_token", "</s>"},
                                        {"tools", nullptr}};
      for (const ChatTemplate& t : Templates()) (void)t.Render(context);
      break;
    }
  }
  return 0;
}
