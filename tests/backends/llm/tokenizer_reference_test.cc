// The tokenizer of backend: llm against `tokenizers` itself: the fixtures
// that tests/data/llm/make_tokenizer_fixtures.py writes (on a machine with
// the Python package) into tests/data/llm/tokenizers/<name>/. Each case of
// expected.json is checked: encode with and without the post-processor's
// special tokens, with special tokens as text, decode with and without
// skip_special_tokens, and the detokenizer over the same ids. Skipped, saying
// so, where the fixtures have not been generated.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "backends/llm/tokenizer.h"

namespace hearth::llm {
namespace {

using Ids = std::vector<int32_t>;

const std::string kFixtureDir = std::string(HEARTH_LLM_TEST_DATA_DIR) + "/tokenizers";

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
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

class TokenizerReferenceTest : public ::testing::TestWithParam<const char*> {};

TEST_P(TokenizerReferenceTest, MatchesTokenizers) {
  const std::string folder = kFixtureDir + "/" + GetParam();
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
  EXPECT_EQ(tok.vocab_size(), expected["vocab_size"].get<int32_t>());

  for (const nlohmann::json& c : expected["encode"]) {
    const std::string text = c["text"].get<std::string>();
    SCOPED_TRACE("text: " + Shown(text));
    auto ids = tok.Encode(text, false, true);
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    EXPECT_EQ(*ids, c["ids"].get<Ids>());
    auto with_special = tok.Encode(text, true, true);
    ASSERT_TRUE(with_special.ok());
    EXPECT_EQ(*with_special, c["ids_add_special"].get<Ids>());

    auto as_text = tok.Encode(text, false, false);
    ASSERT_TRUE(as_text.ok());
    const Ids want_as_text = c["ids_special_as_text"].get<Ids>();
    bool tokenizers_made_special = false;
    for (const int32_t id : want_as_text) tokenizers_made_special |= tok.IsSpecial(id);
    if (tokenizers_made_special) {
      // `tokenizers` let merges of the text make a special token; Encode
      // refuses such merges when special tokens are not parsed.
      for (const int32_t id : *as_text) EXPECT_FALSE(tok.IsSpecial(id)) << id;
    } else {
      EXPECT_EQ(*as_text, want_as_text);
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

INSTANTIATE_TEST_SUITE_P(Generated, TokenizerReferenceTest,
                         ::testing::Values("llama3_style", "llama2_style", "qwen2_style"));

}  // namespace
}  // namespace hearth::llm
