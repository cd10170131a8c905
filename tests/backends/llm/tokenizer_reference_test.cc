// The tokenizer of backend: llm against `tokenizers` itself: the fixtures
// that tests/data/llm/make_tokenizer_fixtures.py writes (on a machine with
// the Python package) into tests/data/llm/tokenizers/<name>/ (or the folder
// HEARTH_LLM_TOKENIZER_FIXTURES names). Each case of
// expected.json is checked: encode with and without the post-processor's
// special tokens, with special tokens as text, decode with and without
// skip_special_tokens, and the detokenizer over the same ids. Skipped, saying
// so, where the fixtures have not been generated.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "backends/llm/tokenizer.h"

namespace hearth::llm {
namespace {

using Ids = std::vector<int32_t>;

// HEARTH_LLM_TOKENIZER_FIXTURES names another folder of <name>/ fixtures.
std::string FixtureDir() {
  const char* dir = std::getenv("HEARTH_LLM_TOKENIZER_FIXTURES");
  return dir != nullptr && *dir != '\0' ? dir
                                        : std::string(HEARTH_LLM_TEST_DATA_DIR) + "/tokenizers";
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The four the script makes (skipped when absent), and any other folder
// with an expected.json.
std::vector<std::string> FixtureNames() {
  std::vector<std::string> names = {"llama3_style", "llama2_style", "mistral_style", "qwen2_style"};
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(FixtureDir(), error)) {
    const std::string name = entry.path().filename().string();
    if (Exists(entry.path().string() + "/expected.json") &&
        std::find(names.begin(), names.end(), name) == names.end()) {
      names.push_back(name);
    }
  }
  return names;
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return nlohmann::json::parse(buffer.str());
}

std::string Shown(const std::string& text) {
  return text.size() > 60 ? text.substr(0, 60) + "..." : text;
}

class TokenizerReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerReferenceTest, MatchesTokenizers) {
  const std::string folder = FixtureDir() + "/" + GetParam();
  const std::string expected_path = folder + "/expected.json";
  if (!Exists(expected_path)) {
    GTEST_SKIP() << "reference fixtures were not generated: " << expected_path
                 << " is missing (run python3 tests/data/llm/make_tokenizer_fixtures.py where "
                    "the tokenizers package is installed, and commit its output)";
  }
  auto loaded = Tokenizer::Load(folder + "/tokenizer.json");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const Tokenizer& tok = **loaded;
  const nlohmann::json expected = ReadJson(expected_path);
  // `tokenizers` counts the tokens; vocab_size() is the largest id + 1 (the
  // same where the ids have no holes).
  EXPECT_GE(tok.vocab_size(), expected["vocab_size"].get<int32_t>());

  for (const nlohmann::json& c : expected["encode"]) {
    const std::string text = c["text"].get<std::string>();
    SCOPED_TRACE("text: " + Shown(text));
    auto ids = tok.Encode(text, false, true);
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    EXPECT_EQ(*ids, c["ids"].get<Ids>());
    auto with_special = tok.Encode(text, true, true);
    ASSERT_TRUE(with_special.ok());
    EXPECT_EQ(*with_special, c["ids_add_special"].get<Ids>());

    if (c.contains("ids_special_as_text")) {
      auto as_text = tok.Encode(text, false, false);
      ASSERT_TRUE(as_text.ok());
      const Ids want_as_text = c["ids_special_as_text"].get<Ids>();
      bool tokenizers_made_special = false;
      for (const int32_t id : want_as_text) tokenizers_made_special |= tok.IsSpecial(id);
      if (tokenizers_made_special) {
        // `tokenizers` made special tokens from the text: by merges, which
        // Encode refuses when special tokens are not parsed, or as its unk
        // token, which both give. So every special id of ours is one of its.
        for (const int32_t id : *as_text) {
          if (tok.IsSpecial(id)) {
            EXPECT_NE(std::find(want_as_text.begin(), want_as_text.end(), id), want_as_text.end())
                << id;
          }
        }
      } else {
        EXPECT_EQ(*as_text, want_as_text);
      }
    }

    const Ids reference_ids = c["ids_add_special"].get<Ids>();
    for (const bool skip : {false, true}) {
      auto decoded = tok.Decode(reference_ids, skip);
      ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
      EXPECT_EQ(*decoded, c[skip ? "decoded_skip_special" : "decoded"].get<std::string>())
          << "skip_special_tokens " << skip;
      Detokenizer stream = tok.NewDetokenizer(skip);
      std::string streamed;
      for (const int32_t id : reference_ids) {
        auto piece = stream.Push(id);
        ASSERT_TRUE(piece.ok()) << piece.status().ToString();
        streamed += *piece;
      }
      streamed += stream.Flush();
      EXPECT_EQ(streamed, *decoded) << "detokenizer, skip_special_tokens " << skip;
    }
  }

  for (const nlohmann::json& c : expected["decode"]) {
    const Ids ids = c["ids"].get<Ids>();
    SCOPED_TRACE("decode of " + c["ids"].dump());
    for (const bool skip : {false, true}) {
      auto decoded = tok.Decode(ids, skip);
      ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
      EXPECT_EQ(*decoded, c[skip ? "text_skip_special" : "text"].get<std::string>());
      Detokenizer stream = tok.NewDetokenizer(skip);
      std::string streamed;
      for (const int32_t id : ids) streamed += *stream.Push(id);
      streamed += stream.Flush();
      EXPECT_EQ(streamed, *decoded) << "detokenizer, skip_special_tokens " << skip;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Generated, TokenizerReferenceTest, ::testing::ValuesIn(FixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           std::string name = param.param;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace hearth::llm
