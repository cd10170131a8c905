// The tokenizer of backend: llm against hand-written tokenizer.json fixtures
// (tests/data/llm/*_tiny.json) whose ids are worked out by hand in the
// comments: byte-level BPE with Llama 3's regex and SentencePiece-style BPE
// with byte fallback; round trips, the streaming detokenizer against
// Decode, and malformed files.
#include "backends/llm/tokenizer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backends/llm/tokenizer_internal.h"
#include "synthetic_tokenizer.h"

namespace hearth::llm {
namespace {

using Ids = std::vector<int32_t>;
using Json = nlohmann::ordered_json;
namespace ti = tokenizer_internal;

const std::string kDataDir = HEARTH_LLM_TEST_DATA_DIR;

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

Json Fixture(const std::string& name) { return Json::parse(ReadText(kDataDir + "/" + name)); }

std::unique_ptr<Tokenizer> Make(const Json& json) {
  auto tokenizer = Tokenizer::Parse(json.dump(), "test.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  return tokenizer.ok() ? std::move(tokenizer).value() : nullptr;
}

Ids Encode(const Tokenizer& t, std::string_view text, bool add_special = false,
           bool parse_special = true) {
  auto ids = t.Encode(text, add_special, parse_special);
  EXPECT_TRUE(ids.ok()) << ids.status().ToString();
  return ids.ok() ? *ids : Ids{};
}

std::string Decode(const Tokenizer& t, const Ids& ids, bool skip_special = false) {
  auto text = t.Decode(ids, skip_special);
  EXPECT_TRUE(text.ok()) << text.status().ToString();
  return text.ok() ? *text : std::string("<error>");
}

// Every prefix of `ids` through a fresh detokenizer: the pushes (each of them
// valid UTF-8) and the flush must give Decode of that prefix, and what the
// pushes gave must be a prefix of it.
void ExpectStreamMatchesDecode(const Tokenizer& t, const Ids& ids, bool skip_special) {
  Detokenizer stream = t.NewDetokenizer(skip_special);
  std::string pushed;
  for (size_t n = 0; n <= ids.size(); ++n) {
    const std::string want = Decode(t, Ids(ids.begin(), ids.begin() + n), skip_special);
    Detokenizer copy = stream;
    const std::string flushed = copy.Flush();
    EXPECT_TRUE(ti::IsValidUtf8(flushed));
    EXPECT_EQ(pushed + flushed, want) << "prefix of " << n << " ids";
    EXPECT_EQ(want.compare(0, pushed.size(), pushed), 0) << "prefix of " << n << " ids";
    if (n == ids.size()) break;
    auto piece = stream.Push(ids[n]);
    ASSERT_TRUE(piece.ok()) << piece.status().ToString();
    EXPECT_TRUE(ti::IsValidUtf8(*piece)) << "push of id " << ids[n];
    pushed += *piece;
  }
}

const std::vector<std::string>& Corpus() {
  static const std::vector<std::string> corpus = {
      "",
      "hello world",
      "Hello, World! It's 2024; we'RE 100% sure.",
      "  leading and trailing spaces  ",
      "tabs\tand\nnewlines\n\n\r\nend\n",
      "caf\xC3\xA9 na\xC3\xAFve r\xC3\xA9sum\xC3\xA9 \xC3\x85ngstr\xC3\xB6m",      // accents
      "e\xCC\x81 combining acute",                                                 // e + U+0301
      "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE6\x96\x87\xE7\xAB\xA0",  // Japanese
      "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C\xEF\xBC\x81",  // Chinese
      "emoji \xF0\x9F\x98\x80\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD and \xF0\x9F\x87\xAB\xF0\x9F\x87\xB7",
      "zwj \xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x92\xBB family",
      "numbers 1234567 3.14159 -42",
      "mixed\xE3\x80\x80ideographic\xC2\xA0nbsp\xE1\xA0\x8Emongolian",
      "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
      "hellohellohellohello worldworld world",
      "<|begin_of_text|>system<|eot_id|> <s>hi</s> <tool> cat cats",
      "code: if (x != y) { return a->b[0]; } // done",
      "\x01\x02 control \x7F bytes",
  };
  return corpus;
}

// ---------------------------------------------------------------- parts

TEST(TokenizerText, Utf8LossyReplacesMaximalSubparts) {
  auto lossy = [](std::string_view bytes) {
    std::string out;
    ti::AppendUtf8Lossy(bytes, &out);
    return out;
  };
  const std::string fffd(ti::kReplacementChar);
  EXPECT_EQ(lossy("abc"), "abc");
  EXPECT_EQ(lossy("\xE4\xBD"
                  "a"),
            fffd + "a");                                 // truncated 3-byte sequence: one
  EXPECT_EQ(lossy("\xED\xA0\x80"), fffd + fffd + fffd);  // a surrogate: three
  EXPECT_EQ(lossy("\xC0\xAF"), fffd + fffd);             // an overlong: two
  EXPECT_EQ(lossy("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // past U+10FFFF
  EXPECT_EQ(lossy("\xF0\x9F\x98"), fffd);                           // truncated at the end: one
  EXPECT_EQ(lossy("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
  EXPECT_FALSE(ti::IsValidUtf8("\xED\xA0\x80"));
  EXPECT_TRUE(ti::IsValidUtf8("\xF0\x9F\x98\x80"));
  EXPECT_EQ(ti::CompleteUtf8Prefix("ab\xF0\x9F\x98"), 2u);
  EXPECT_EQ(ti::CompleteUtf8Prefix("ab\xF0\x9F\x98\x80"), 6u);
  EXPECT_EQ(ti::CompleteUtf8Prefix("ab\xC3"), 2u);
  EXPECT_EQ(ti::CompleteUtf8Prefix("ab\xFF"), 3u);      // ill-formed, not incomplete
  EXPECT_EQ(ti::CompleteUtf8Prefix("ab\xE0\x80"), 4u);  // E0 80 can never complete
}

TEST(TokenizerText, ByteLevelMapIsGpt2s) {
  EXPECT_EQ(ti::ByteToCodePoint('a'), uint32_t{'a'});
  EXPECT_EQ(ti::ByteToCodePoint(' '), 0x120u);   // Ġ
  EXPECT_EQ(ti::ByteToCodePoint('\n'), 0x10Au);  // Ċ
  EXPECT_EQ(ti::ByteToCodePoint(0x00), 0x100u);
  EXPECT_EQ(ti::ByteToCodePoint(0x7F), 0x121u);
  EXPECT_EQ(ti::ByteToCodePoint(0xAD), 0x143u);
  EXPECT_EQ(ti::ByteToCodePoint(0xFF), 0xFFu);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ti::CodePointToByte(ti::ByteToCodePoint(b)), b);
  EXPECT_EQ(ti::CodePointToByte(0x144), -1);
}

TEST(TokenizerText, WhiteSpaceIsOnigurumasNotPcre2s) {
  EXPECT_EQ(ti::RewriteWhiteSpaceClasses(R"(\s+(?!\S)|[^\s\p{L}])"),
            R"(\p{White_Space}+(?!\P{White_Space})|[^\p{White_Space}\p{L}])");
  EXPECT_EQ(ti::RewriteWhiteSpaceClasses(R"(\\s\Q\s\E)"), R"(\\s\Q\s\E)");
  auto regex = ti::Regex::Compile(R"(\s)");
  ASSERT_TRUE(regex.ok()) << regex.status().ToString();
  std::vector<std::pair<size_t, size_t>> matches;
  ASSERT_TRUE((*regex)->FindAll("\xE1\xA0\x8E", &matches).ok());  // U+180E: not White_Space
  EXPECT_TRUE(matches.empty());
  ASSERT_TRUE((*regex)->FindAll("\xE3\x80\x80 \t", &matches).ok());  // U+3000, space, tab
  EXPECT_EQ(matches.size(), 3u);
}

TEST(TokenizerText, RegexEmptyMatchesAdvance) {
  auto regex = ti::Regex::Compile("x*");
  ASSERT_TRUE(regex.ok());
  std::vector<std::pair<size_t, size_t>> matches;
  ASSERT_TRUE((*regex)->FindAll("axxb", &matches).ok());
  // Oniguruma's find_iter: "" at 0, "xx" at 1, then "" at 3 is refused
  // (right after the last match) and "" at 4 taken.
  const std::vector<std::pair<size_t, size_t>> want = {{0, 0}, {1, 3}, {4, 4}};
  EXPECT_EQ(matches, want);
}

TEST(TokenizerText, BadRegexIsRefusedWithItsPosition) {
  auto regex = ti::Regex::Compile("(unclosed");
  ASSERT_FALSE(regex.ok());
  EXPECT_NE(regex.status().message().find("does not compile"), std::string::npos);
}

// ---------------------------------------------------------------- byte-level

class TokenizerByteLevelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    json_ = Fixture("byte_level_tiny.json");
    tok_ = Make(json_);
    ASSERT_NE(tok_, nullptr);
  }
  Json json_;
  std::unique_ptr<Tokenizer> tok_;
};

// Ids of the fixture: byte b is token b (its GPT-2 character); then
// he 256, ll 257, hell 258, hello 259, Ġw 260, or 261, Ġwor 262, ld 263,
// Ġworld 264, ĠĠ 265, yz 266, xy 267, aa 268, ĊĊ 269, abc 270 (no merge makes
// it); added (the next ids, as `tokenizers` numbers them): <|begin_of_text|>
// 271, <|eot_id|> 272, <tool> 273 (not special), <mask> 274 (lstrip,
// rstrip), cat 275 (single_word, not special).
TEST_F(TokenizerByteLevelTest, Sizes) {
  EXPECT_EQ(tok_->vocab_size(), 276);
  EXPECT_EQ(tok_->TokenId("<|eot_id|>"), 272);
  EXPECT_EQ(tok_->TokenId("\xC4\xA0world"), 264);  // Ġworld
  EXPECT_EQ(tok_->TokenId("nope"), std::nullopt);
  EXPECT_EQ(tok_->TokenText(259), "hello");
  EXPECT_EQ(tok_->TokenText(276), std::nullopt);
  EXPECT_TRUE(tok_->IsSpecial(271));
  EXPECT_FALSE(tok_->IsSpecial(273));
  EXPECT_FALSE(tok_->IsSpecial(259));
  EXPECT_FALSE(tok_->IsSpecial(-1));
  EXPECT_FALSE(tok_->IsSpecial(100000));
}

TEST_F(TokenizerByteLevelTest, WordsAndMerges) {
  // "hello", " world": both in the vocab (ignore_merges).
  EXPECT_EQ(Encode(*tok_, "hello world"), (Ids{259, 264}));
  // h e l l o w: he (rank 0), ll (1), hell (2), hello (3); w stays.
  EXPECT_EQ(Encode(*tok_, "hellow"), (Ids{259, 'w'}));
  // H e l l o: only "l l" applies.
  EXPECT_EQ(Encode(*tok_, "Hello"), (Ids{'H', 'e', 257, 'o'}));
  // x y z: "y z" has the lower rank (10 < 11).
  EXPECT_EQ(Encode(*tok_, "xyz"), (Ids{'x', 266}));
  // a a a: equal ranks, the leftmost first.
  EXPECT_EQ(Encode(*tok_, "aaa"), (Ids{268, 'a'}));
  // "abc" has no merges but is in the vocab: ignore_merges takes it whole.
  EXPECT_EQ(Encode(*tok_, "abc"), (Ids{270}));
  EXPECT_EQ(Encode(*tok_, ""), Ids{});
}

TEST_F(TokenizerByteLevelTest, IgnoreMergesOff) {
  json_["model"]["ignore_merges"] = false;
  auto tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "abc"), (Ids{'a', 'b', 'c'}));
  EXPECT_EQ(Encode(*tok, "hello world"), (Ids{259, 264}));  // the merges reach them too
}

TEST_F(TokenizerByteLevelTest, Llama3RegexPieces) {
  // "a", "\n\n" (\s*[\r\n]+), "b"; \n is Ċ (token 10); "Ċ Ċ" merges to 269.
  EXPECT_EQ(Encode(*tok_, "a\n\nb"), (Ids{'a', 269, 'b'}));
  // " " (\s+(?!\S) leaves the last space), " x" ([^\r\n\p{L}\p{N}]?\p{L}+):
  // the two spaces are in different pieces, so ĠĠ (265) is not made.
  EXPECT_EQ(Encode(*tok_, "  x"), (Ids{' ', ' ', 'x'}));
  // Trailing spaces: one piece, merged.
  EXPECT_EQ(Encode(*tok_, "a  "), (Ids{'a', 265}));
  // \p{N}{1,3}: 123 | 45.
  EXPECT_EQ(Encode(*tok_, "12345"), (Ids{'1', '2', '3', '4', '5'}));
  // (?i:'m) takes "'M"; é is C3 A9 (tokens 195, 169); 😀 is F0 9F 98 80.
  EXPECT_EQ(Encode(*tok_, "I'M"), (Ids{'I', '\'', 'M'}));
  EXPECT_EQ(Encode(*tok_, "\xC3\xA9"), (Ids{0xC3, 0xA9}));
  EXPECT_EQ(Encode(*tok_, "\xF0\x9F\x98\x80"), (Ids{0xF0, 0x9F, 0x98, 0x80}));
}

TEST_F(TokenizerByteLevelTest, SpecialTokens) {
  EXPECT_EQ(Encode(*tok_, "hello", /*add_special=*/true), (Ids{271, 259}));
  EXPECT_EQ(Encode(*tok_, "<|begin_of_text|>hi<|eot_id|>"), (Ids{271, 'h', 'i', 272}));
  // As plain text: "<|", "begin", "_of", "_text", "|>", "hi", "<|", "eot",
  // "_id", "|>" (Llama 3's regex), none merged.
  const Ids plain = {'<', '|', 'b', 'e', 'g', 'i', 'n', '_', 'o', 'f', '_', 't', 'e', 'x', 't',
                     '|', '>', 'h', 'i', '<', '|', 'e', 'o', 't', '_', 'i', 'd', '|', '>'};
  EXPECT_EQ(Encode(*tok_, "<|begin_of_text|>hi<|eot_id|>", false, /*parse_special=*/false), plain);
  // <tool> is not special: matched either way.
  EXPECT_EQ(Encode(*tok_, "a<tool>b", false, false), (Ids{'a', 273, 'b'}));
  // <mask> takes the spaces on both sides (lstrip, rstrip).
  EXPECT_EQ(Encode(*tok_, "a <mask> b"), (Ids{'a', 274, 'b'}));
  // cat: single_word, so not inside "cats"; ". " after it is fine.
  EXPECT_EQ(Encode(*tok_, "a cat."), (Ids{'a', ' ', 275, '.'}));
  EXPECT_EQ(Encode(*tok_, "cats"), (Ids{'c', 'a', 't', 's'}));
}

TEST_F(TokenizerByteLevelTest, Decode) {
  EXPECT_EQ(Decode(*tok_, {271, 259, 264, 272}), "<|begin_of_text|>hello world<|eot_id|>");
  EXPECT_EQ(Decode(*tok_, {271, 259, 264, 272}, /*skip_special=*/true), "hello world");
  EXPECT_EQ(Decode(*tok_, {273}, true), "<tool>");  // not special: kept
  EXPECT_EQ(Decode(*tok_, {0xC3, 0xA9}), "\xC3\xA9");
  EXPECT_EQ(Decode(*tok_, {0xC3}), ti::kReplacementChar);
  EXPECT_EQ(Decode(*tok_, {0xC3, 'a'}), std::string(ti::kReplacementChar) + "a");
  EXPECT_EQ(Decode(*tok_, {}), "");
  for (const int32_t bad : {-1, 276, 1 << 30}) {
    auto text = tok_->Decode(Ids{259, bad}, false);
    ASSERT_FALSE(text.ok()) << bad;
    EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(text.status().message().find("token id " + std::to_string(bad)), std::string::npos)
        << text.status().message();
  }
}

TEST_F(TokenizerByteLevelTest, RoundTrips) {
  for (const std::string& text : Corpus()) {
    for (const bool parse_special : {false, true}) {
      const Ids ids = Encode(*tok_, text, false, parse_special);
      EXPECT_EQ(Decode(*tok_, ids), text) << text;
      if (!parse_special) {
        for (const int32_t id : ids) EXPECT_FALSE(tok_->IsSpecial(id)) << text;
      }
      ExpectStreamMatchesDecode(*tok_, ids, false);
      ExpectStreamMatchesDecode(*tok_, ids, true);
    }
  }
}

TEST_F(TokenizerByteLevelTest, DetokenizerHoldsPartialCharacters) {
  Detokenizer stream = tok_->NewDetokenizer(false);
  EXPECT_EQ(*stream.Push(0xF0), "");
  EXPECT_EQ(*stream.Push(0x9F), "");
  EXPECT_EQ(*stream.Push(0x98), "");
  EXPECT_EQ(*stream.Push(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(*stream.Push(259), "hello");
  EXPECT_EQ(*stream.Push(0xC3), "");
  EXPECT_EQ(*stream.Push('a'), std::string(ti::kReplacementChar) + "a");
  EXPECT_EQ(*stream.Push(0xE4), "");
  EXPECT_EQ(stream.Flush(), ti::kReplacementChar);
  EXPECT_FALSE(stream.Push(-5).ok());
  EXPECT_FALSE(stream.Push(276).ok());
}

TEST_F(TokenizerByteLevelTest, InvalidUtf8IsReplacedNotFatal) {
  // As Python's decode(errors="replace"), then encoded.
  EXPECT_EQ(Encode(*tok_,
                   "a\xFF"
                   "b"),
            Encode(*tok_,
                   "a\xEF\xBF\xBD"
                   "b"));
  EXPECT_EQ(Encode(*tok_, "\xE4\xBD"), Encode(*tok_, "\xEF\xBF\xBD"));
  std::mt19937 rng(1);
  for (int i = 0; i < 300; ++i) {
    std::string bytes(rng() % 64, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    auto ids = tok_->Encode(bytes, true, i % 2 == 0);
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    std::string repaired;
    ti::AppendUtf8Lossy(bytes, &repaired);
    auto text = tok_->Decode(*ids, true);
    ASSERT_TRUE(text.ok());
    EXPECT_EQ(*text, repaired);
  }
}

TEST_F(TokenizerByteLevelTest, LongInputsStayLinear) {
  // One piece of 1 MiB each (runs of spaces, letters, digits, punctuation,
  // newlines): the regexes and the merges must neither fail nor crawl.
  for (const char c : {' ', 'a', '7', '!', '\n'}) {
    const std::string text(1 << 20, c);
    const Ids ids = Encode(*tok_, text);
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(Decode(*tok_, ids), text);
  }
  const Ids ids = Encode(*tok_, std::string(1 << 20, 'a'));
  EXPECT_EQ(ids.size(), size_t{1} << 19);  // "a a" merges every pair
}

TEST_F(TokenizerByteLevelTest, ConcurrentEncodes) {
  std::vector<Ids> want;
  for (const std::string& text : Corpus()) want.push_back(Encode(*tok_, text, true));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < Corpus().size(); ++i) {
          auto ids = tok_->Encode(Corpus()[i], true, true);
          if (!ids.ok() || *ids != want[i]) ++mismatches;
          auto text = tok_->Decode(want[i], false);
          if (!text.ok()) ++mismatches;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(TokenizerByteLevelTest, PlainByteLevelUsesGpt2Regex) {
  // ByteLevel with use_regex: GPT-2's pieces. " world" and "hello" as
  // before; "  x" splits as " ", " x" too; 12345 is one \p{N}+ piece.
  json_["pre_tokenizer"] = Json::parse(
      R"({"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true})");
  auto tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "hello world"), (Ids{259, 264}));
  EXPECT_EQ(Encode(*tok, "12345"), (Ids{'1', '2', '3', '4', '5'}));
  // 's is a piece of its own in both; GPT-2's is case-sensitive, so 'S is
  // "'" + "S" (' ?[^\s\p{L}\p{N}]+' then '\p{L}+').
  EXPECT_EQ(Encode(*tok, "it'S"), (Ids{'i', 't', '\'', 'S'}));
  // add_prefix_space puts a space before the text: " hello" is Ġ + hello.
  json_["pre_tokenizer"]["add_prefix_space"] = true;
  tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "hello"), (Ids{' ', 259}));
}

// ---------------------------------------------------------------- SentencePiece-style

class TokenizerSentencePieceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    json_ = Fixture("sentencepiece_tiny.json");
    tok_ = Make(json_);
    ASSERT_NE(tok_, nullptr);
  }
  Json json_;
  std::unique_ptr<Tokenizer> tok_;
};

// Ids: <unk> 0, <s> 1, </s> 2, <0x00>..<0xFF> 3..258 (byte b is 3 + b),
// ▁ 259, h 260, e 261, l 262, o 263, ▁h 264, ll 265, ▁he 266, llo 267,
// ▁hello 268, w 269, r 270, d 271, ▁w 272, or 273, ▁wor 274, ld 275,
// ▁world 276, a 277, é 278, ▁▁ 279, < 280, s 281, > 282, <s 283.
// Merges by rank: ▁ h, l l, ▁h e, ll o, ▁he llo, ▁ w, o r, ▁w or, l d,
// ▁wor ld, ▁ ▁, < s, <s > (which makes <s>, a special token).
TEST_F(TokenizerSentencePieceTest, Words) {
  // "▁hello▁world": ▁h, ll, ▁he, llo, ▁hello, ▁w, or, ▁wor, ld, ▁world.
  EXPECT_EQ(Encode(*tok_, "hello world"), (Ids{268, 276}));
  EXPECT_EQ(Encode(*tok_, "hello world", true), (Ids{1, 268, 276}));
  // "▁▁hello": "▁ h" (rank 0) at 1 wins over "▁ ▁" (rank 10) at 0.
  EXPECT_EQ(Encode(*tok_, " hello"), (Ids{259, 268}));
  // "▁a▁▁b": b is not in the vocab: <0x62> = 101; "▁ ▁" merges.
  EXPECT_EQ(Encode(*tok_, "a  b"), (Ids{259, 277, 279, 101}));
  // 日 = E6 97 A5: bytes 233, 154, 168; é is in the vocab.
  EXPECT_EQ(Encode(*tok_, "\xE6\x97\xA5"), (Ids{259, 233, 154, 168}));
  EXPECT_EQ(Encode(*tok_, "\xC3\xA9"), (Ids{259, 278}));
  EXPECT_EQ(Encode(*tok_, ""), Ids{});
  EXPECT_EQ(Encode(*tok_, "", true), Ids{1});
}

TEST_F(TokenizerSentencePieceTest, SpecialTokens) {
  // Split before normalizing: "hello" gets its own ▁.
  EXPECT_EQ(Encode(*tok_, "<s>hello"), (Ids{1, 268}));
  // As text: ▁ < s > h e l l o; l l, ll o, < s; "<s >" would make <s> (id 1):
  // refused, since the text may not make special tokens.
  EXPECT_EQ(Encode(*tok_, "<s>hello", false, false), (Ids{259, 283, 282, 260, 261, 267}));
  EXPECT_EQ(Encode(*tok_, "hello</s>", true), (Ids{1, 268, 2}));
}

TEST_F(TokenizerSentencePieceTest, Decode) {
  EXPECT_EQ(Decode(*tok_, {1, 268, 276}), "<s> hello world");
  EXPECT_EQ(Decode(*tok_, {1, 268, 276}, true), "hello world");  // the strip of one space
  EXPECT_EQ(Decode(*tok_, {259, 268}), " hello");
  EXPECT_EQ(Decode(*tok_, {259, 233, 154, 168}), "\xE6\x97\xA5");
  // Byte fallback: an invalid group is one U+FFFD per byte.
  const std::string fffd(ti::kReplacementChar);
  EXPECT_EQ(Decode(*tok_, {233, 154, 277}), fffd + fffd + "a");
  EXPECT_EQ(Decode(*tok_, {3 + 'A', 3 + 0xC3}), fffd + fffd);  // the group, not each byte
}

TEST_F(TokenizerSentencePieceTest, RoundTrips) {
  for (const std::string& text : Corpus()) {
    for (const bool parse_special : {false, true}) {
      const Ids ids = Encode(*tok_, text, false, parse_special);
      // <s> parsed splits the text, and each part gets its own ▁ (as in
      // `tokenizers`): only text without it comes back as it was.
      if (!parse_special || text.find("<s>") == std::string::npos) {
        EXPECT_EQ(Decode(*tok_, ids), text) << text;
      }
      ExpectStreamMatchesDecode(*tok_, ids, false);
      ExpectStreamMatchesDecode(*tok_, ids, true);
    }
    // With <s> first, skipped: the leading space is still stripped once.
    Ids ids = Encode(*tok_, text, true, false);
    EXPECT_EQ(Decode(*tok_, ids, true), text);
    ExpectStreamMatchesDecode(*tok_, ids, true);
  }
}

TEST_F(TokenizerSentencePieceTest, DetokenizerHoldsByteGroups) {
  Detokenizer stream = tok_->NewDetokenizer(true);
  EXPECT_EQ(*stream.Push(1), "");    // <s>, skipped
  EXPECT_EQ(*stream.Push(259), "");  // "▁": the stream's leading space, stripped
  EXPECT_EQ(*stream.Push(233), "");
  EXPECT_EQ(*stream.Push(154), "");
  EXPECT_EQ(*stream.Push(168), "");  // 日 is complete, but a byte could still follow
  EXPECT_EQ(*stream.Push(268), "\xE6\x97\xA5 hello");
  EXPECT_EQ(*stream.Push(259), " ");  // not the start any more
  EXPECT_EQ(*stream.Push(3 + 0xE4), "");
  EXPECT_EQ(stream.Flush(), ti::kReplacementChar);
  // A new stream after Flush: its leading space is stripped again.
  EXPECT_EQ(*stream.Push(268), "hello");
}

TEST_F(TokenizerSentencePieceTest, UnknownCharactersWithoutByteFallback) {
  json_["model"]["byte_fallback"] = false;
  auto tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  // ▁ 日 本 with fuse_unk: one <unk> for both.
  EXPECT_EQ(Encode(*tok, "\xE6\x97\xA5\xE6\x9C\xAC"), (Ids{259, 0}));
  json_["model"]["fuse_unk"] = false;
  tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "\xE6\x97\xA5\xE6\x9C\xAC"), (Ids{259, 0, 0}));
  json_["model"]["unk_token"] = nullptr;
  tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "a\xE6\x97\xA5"), (Ids{259, 277}));  // dropped, as tokenizers does
}

TEST_F(TokenizerSentencePieceTest, MetaspacePreTokenizer) {
  // The newer form: no normalizer, Metaspace with prepend_scheme "first".
  json_["normalizer"] = nullptr;
  json_["pre_tokenizer"] = Json::parse(
      R"({"type":"Metaspace","replacement":"\u2581","prepend_scheme":"first","split":false})");
  auto tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "hello world"), (Ids{268, 276}));
  // "hello" after <s> does not start the text: no ▁ before it.
  EXPECT_EQ(Encode(*tok, "<s>hello"), (Ids{1, 260, 261, 267}));
  json_["pre_tokenizer"]["prepend_scheme"] = "always";
  tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "<s>hello"), (Ids{1, 268}));
  json_["pre_tokenizer"]["prepend_scheme"] = "never";
  tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "hello world"), (Ids{260, 261, 267, 276}));
  // split: true cuts before each ▁ ("▁hello", "▁world"): the same ids here.
  json_["pre_tokenizer"]["prepend_scheme"] = "first";
  json_["pre_tokenizer"]["split"] = true;
  tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "hello world"), (Ids{268, 276}));
  EXPECT_EQ(Encode(*tok, "a  b"), (Ids{259, 277, 259, 259, 101}));  // ▁a | ▁ | ▁b
}

TEST_F(TokenizerSentencePieceTest, MetaspaceDecoder) {
  json_["decoder"] = Json::parse(
      R"({"type":"Metaspace","replacement":"\u2581","prepend_scheme":"first","split":false})");
  auto tok = Make(json_);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Decode(*tok, {268, 276}), "hello world");
  EXPECT_EQ(Decode(*tok, {259, 279, 268}), "   hello");  // only the first token loses its ▁
  EXPECT_EQ(Decode(*tok, {1, 268}), "<s> hello");
  EXPECT_EQ(Decode(*tok, {1, 268}, true), "hello");
  for (const std::string& text : Corpus()) {
    const Ids ids = Encode(*tok, text, true);
    ExpectStreamMatchesDecode(*tok, ids, false);
    ExpectStreamMatchesDecode(*tok, ids, true);
  }
}

// ---------------------------------------------------------------- NFC

TEST(TokenizerNfc, ComposesBeforeTheModel) {
  // Qwen2's normalizer: NFC. "e" + U+0301 becomes "é", C3 A9 (tokens 195,
  // 169); without NFC it is e, CC, 81.
  Json json = Fixture("byte_level_tiny.json");
  auto plain = Make(json);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(Encode(*plain, "e\xCC\x81"), (Ids{'e', 0xCC, 0x81}));
  json["normalizer"] = Json::parse(R"({"type":"NFC"})");
  auto tok = Make(json);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "e\xCC\x81"), (Ids{0xC3, 0xA9}));
  EXPECT_EQ(Encode(*tok, "\xC3\xA9"), (Ids{0xC3, 0xA9}));
  // Hangul jamo compose too; text already in NFC is left as it is.
  EXPECT_EQ(Encode(*tok, "\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB"),
            Encode(*tok, "\xED\x95\x9C"));                           // 한
  EXPECT_EQ(Encode(*tok, "\xEF\xAC\x81"), (Ids{0xEF, 0xAC, 0x81}));  // ﬁ: NFKC only
  // Special tokens are matched before normalizing; the text after them is
  // normalized by itself.
  EXPECT_EQ(Encode(*tok, "<|eot_id|>e\xCC\x81"), (Ids{272, 0xC3, 0xA9}));
}

TEST(TokenizerVocab, HolesAreUnknownIds) {
  // Without byte 0x01's token: id 1 is a hole in the vocabulary.
  Json json = Fixture("byte_level_tiny.json");
  json["model"]["vocab"].erase("\xC4\x81");  // ā, the byte-level form of 0x01
  json["added_tokens"] = Json::array();
  json["post_processor"] = nullptr;
  auto tok = Make(json);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 271);
  EXPECT_EQ(tok->TokenText(1), std::nullopt);
  auto text = tok->Decode(Ids{'a', 1}, false);
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.status().message().find("token id 1 is not in the vocabulary"), std::string::npos)
      << text.status().message();
  EXPECT_EQ(Encode(*tok,
                   "a\x01"
                   "b"),
            (Ids{'a', 'b'}));  // no token for it: dropped
  // Added tokens after a vocab with a hole: `tokenizers` numbers them from
  // the vocab's count (270), which is not the id written.
  json = Fixture("byte_level_tiny.json");
  json["model"]["vocab"].erase("\xC4\x81");
  auto refused = Tokenizer::Parse(json.dump(), "holes.json");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("has id 271 but `tokenizers` gives it 270"),
            std::string::npos)
      << refused.status().message();
}

// ---------------------------------------------------------------- bad input

struct BadCase {
  const char* what;
  std::function<void(Json*)> edit;
  const char* message;  // expected in the error
};

TEST(TokenizerBadInput, RefusedWithFieldNames) {
  const std::vector<BadCase> cases = {
      {"model missing", [](Json* j) { j->erase("model"); }, "model: missing"},
      {"model type", [](Json* j) { (*j)["model"]["type"] = "WordPiece"; },
       "model.type: type \"WordPiece\" is not supported"},
      {"merge out of vocab",
       [](Json* j) {
         (*j)["model"]["merges"][0] = Json::array({"h", "\xE2\x82\xAC"});
       },
       "model.merges[0]: token \"\xE2\x82\xAC\" is not in model.vocab"},
      {"merge string form bad", [](Json* j) { (*j)["model"]["merges"][1] = "h e l"; },
       "model.merges[1]: \"h e l\" is not two tokens"},
      {"merge result out of vocab",
       [](Json* j) {
         (*j)["model"]["merges"].push_back(Json::array({"z", "z"}));
       },
       "token \"zz\" is not in model.vocab"},
      {"vocab id negative", [](Json* j) { (*j)["model"]["vocab"]["a"] = -3; },
       "model.vocab[\"a\"]: expected an id"},
      {"vocab id string", [](Json* j) { (*j)["model"]["vocab"]["a"] = "x"; }, "found a string"},
      {"vocab id huge", [](Json* j) { (*j)["model"]["vocab"]["a"] = 1 << 30; },
       "model.vocab[\"a\"]: expected an id in [0, 16777215]"},
      {"vocab id twice", [](Json* j) { (*j)["model"]["vocab"]["a"] = 98; }, "is also the id of"},
      {"vocab missing", [](Json* j) { (*j)["model"].erase("vocab"); }, "model.vocab: missing"},
      {"merges missing", [](Json* j) { (*j)["model"].erase("merges"); }, "model.merges: missing"},
      {"prefix", [](Json* j) { (*j)["model"]["continuing_subword_prefix"] = "##"; },
       "model.continuing_subword_prefix: \"##\" is not supported"},
      {"suffix", [](Json* j) { (*j)["model"]["end_of_word_suffix"] = "</w>"; },
       "model.end_of_word_suffix"},
      {"dropout", [](Json* j) { (*j)["model"]["dropout"] = 0.1; }, "model.dropout"},
      {"unk not in vocab", [](Json* j) { (*j)["model"]["unk_token"] = "<unk>"; },
       "model.unk_token: \"<unk>\" is not in model.vocab"},
      {"byte_fallback mistyped", [](Json* j) { (*j)["model"]["byte_fallback"] = "yes"; },
       "model.byte_fallback: expected a boolean, found a string"},
      {"normalizer", [](Json* j) { (*j)["normalizer"] = Json::parse(R"({"type":"NFKC"})"); },
       "normalizer.type: type \"NFKC\" is not supported"},
      {"nested normalizer",
       [](Json* j) {
         (*j)["normalizer"] = Json::parse(
             R"({"type":"Sequence","normalizers":[{"type":"NFC"},{"type":"Lowercase"}]})");
       },
       "normalizer.normalizers[1].type: type \"Lowercase\""},
      {"replace regex",
       [](Json* j) {
         (*j)["normalizer"] =
             Json::parse(R"({"type":"Replace","pattern":{"Regex":" +"},"content":" "})");
       },
       "normalizer.pattern: only a String pattern"},
      {"pre_tokenizer",
       [](Json* j) { (*j)["pre_tokenizer"] = Json::parse(R"({"type":"Whitespace"})"); },
       "pre_tokenizer.type: type \"Whitespace\""},
      {"split behavior",
       [](Json* j) { (*j)["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
       "pre_tokenizer.pretokenizers[0].behavior: \"Removed\" is not supported"},
      {"split invert", [](Json* j) { (*j)["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; },
       "pre_tokenizer.pretokenizers[0].invert"},
      {"split regex",
       [](Json* j) { (*j)["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a"; },
       "pre_tokenizer.pretokenizers[0].pattern.Regex: regex /(a/ does not compile"},
      {"post_processor",
       [](Json* j) { (*j)["post_processor"] = Json::parse(R"({"type":"RobertaProcessing"})"); },
       "post_processor.type: type \"RobertaProcessing\""},
      {"template token unknown",
       [](Json* j) {
         (*j)["post_processor"]["processors"][1]["single"][0]["SpecialToken"]["id"] = "<x>";
       },
       "\"<x>\" is not in post_processor.processors[1].special_tokens"},
      {"template without special_tokens",
       [](Json* j) { (*j)["post_processor"]["processors"][1].erase("special_tokens"); },
       "\"<|begin_of_text|>\" is not in post_processor.processors[1].special_tokens"},
      {"template id unknown",
       [](Json* j) {
         (*j)["post_processor"]["processors"][1]["special_tokens"]["<|begin_of_text|>"]["ids"][0] =
             99999;
       },
       "ids[0]: 99999 is not a token id"},
      {"decoder null", [](Json* j) { (*j)["decoder"] = nullptr; }, "decoder: missing or null"},
      {"decoder type", [](Json* j) { (*j)["decoder"] = Json::parse(R"({"type":"WordPiece"})"); },
       "decoder.type: type \"WordPiece\""},
      {"decoder order",
       [](Json* j) {
         (*j)["decoder"] = Json::parse(
             R"({"type":"Sequence","decoders":[{"type":"Fuse"},{"type":"Replace","pattern":{"String":"a"},"content":"b"}]})");
       },
       "decoder.decoders[1]: Replace and Metaspace are supported only before"},
      {"strip before fuse",
       [](Json* j) {
         (*j)["decoder"] = Json::parse(
             R"({"type":"Sequence","decoders":[{"type":"Strip","content":" ","start":1,"stop":0}]})");
       },
       "decoder.decoders[0]: Strip is supported only once, after Fuse"},
      {"strip stop",
       [](Json* j) {
         (*j)["decoder"] = Json::parse(R"({"type":"Strip","content":" ","start":1,"stop":1})");
       },
       "decoder.stop: only 0"},
      {"added id mismatch", [](Json* j) { (*j)["added_tokens"][0]["content"] = "a"; },
       "added_tokens[0]: \"a\" has id 271 but model.vocab gives it 97"},
      {"added id collides", [](Json* j) { (*j)["added_tokens"][0]["id"] = 97; },
       "added_tokens[0]: \"<|begin_of_text|>\" has id 97 but `tokenizers` gives it 271"},
      {"added id twice", [](Json* j) { (*j)["added_tokens"][1]["id"] = 271; },
       "added_tokens[1]: \"<|eot_id|>\" has id 271 but `tokenizers` gives it 272"},
      {"added content twice",
       [](Json* j) { (*j)["added_tokens"][1]["content"] = "<|begin_of_text|>"; },
       "added_tokens[1]: \"<|begin_of_text|>\" is already the added token with id 271"},
      {"added content missing", [](Json* j) { (*j)["added_tokens"][2].erase("content"); },
       "added_tokens[2].content: missing"},
      {"version", [](Json* j) { (*j)["version"] = "2.0"; }, "version: \"2.0\" is not supported"},
      {"not an object", [](Json* j) { *j = Json::array(); },
       "(document): expected an object, found an array"},
  };
  for (const BadCase& c : cases) {
    Json json = Fixture("byte_level_tiny.json");
    c.edit(&json);
    auto tokenizer = Tokenizer::Parse(json.dump(), "bad.json");
    ASSERT_FALSE(tokenizer.ok()) << c.what;
    EXPECT_EQ(tokenizer.status().code(), StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(tokenizer.status().message().find(c.message), std::string::npos)
        << c.what << ": " << tokenizer.status().message();
    EXPECT_EQ(tokenizer.status().message().rfind("bad.json: ", 0), 0u) << c.what;
  }
}

TEST(TokenizerBadInput, MalformedJsonNeverCrashes) {
  const std::string text = ReadText(kDataDir + "/sentencepiece_tiny.json");
  auto broken = Tokenizer::Parse("{\"model\": ", "broken.json");
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("broken.json: malformed JSON"), std::string::npos)
      << broken.status().message();
  // Every prefix length (stepped) and random byte flips: a Status, never a crash.
  for (size_t n = 0; n < text.size(); n += 7) {
    auto tok = Tokenizer::Parse(std::string_view(text).substr(0, n), "prefix.json");
    EXPECT_FALSE(tok.ok());
  }
  std::mt19937 rng(2);
  int parsed = 0;
  for (int i = 0; i < 400; ++i) {
    std::string mutated = text;
    for (int k = 0; k < 3; ++k) mutated[rng() % mutated.size()] = static_cast<char>(rng());
    auto tok = Tokenizer::Parse(mutated, "mutated.json");
    if (!tok.ok()) continue;
    ++parsed;
    auto ids = (*tok)->Encode("hello world \xE6\x97\xA5 <s>", true, true);
    ASSERT_TRUE(ids.ok());
    EXPECT_TRUE((*tok)->Decode(*ids, false).ok());
  }
  EXPECT_LT(parsed, 400);
}

TEST(TokenizerBadInput, Files) {
  auto missing = Tokenizer::Load(kDataDir + "/no_such_tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no_such_tokenizer.json"), std::string::npos);
  auto directory = Tokenizer::Load(kDataDir);
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find("a directory"), std::string::npos)
      << directory.status().message();
  auto loaded = Tokenizer::Load(kDataDir + "/byte_level_tiny.json");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->vocab_size(), 276);
}

TEST(TokenizerBadInput, MergesInStringForm) {
  Json json = Fixture("byte_level_tiny.json");
  Json strings = Json::array({"#version: 0.2"});
  for (const Json& pair : json["model"]["merges"]) {
    strings.push_back(pair[0].get<std::string>() + " " + pair[1].get<std::string>());
  }
  json["model"]["merges"] = strings;
  auto tok = Make(json);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "xyz aaa hellow"), (Ids{'x', 266, ' ', 268, 'a', ' ', 259, 'w'}));
}

// ---------------------------------------------------------------- scale

// A byte-level tokenizer of Llama 3's size: 128k tokens, 280k merges (the
// load time is measured by bench/tokenizer, not here).
TEST(TokenizerScale, LoadsALlama3SizedFile) {
  const synthetic::SyntheticTokenizer generated = synthetic::MakeSyntheticTokenizer();
  EXPECT_EQ(generated.vocab, 128000u);
  EXPECT_EQ(generated.merges, 280000u);
  auto tok = Tokenizer::Parse(generated.json, "large.json");
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->vocab_size(), 128256);
  EXPECT_EQ((*tok)->TokenId("<|eot_id|>"), 128009);
  const std::string text =
      "hello world, the tokenizer is large\n\nand it's fast: 12345 \xF0\x9F\x98\x80";
  const Ids ids = Encode(**tok, text, true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], 128000);
  EXPECT_LT(ids.size() - 1, text.size());  // some merges applied
  EXPECT_EQ(Decode(**tok, ids, true), text);
  ExpectStreamMatchesDecode(**tok, ids, false);
}

}  // namespace
}  // namespace hearth::llm
