// A generated tokenizer.json of Llama 3's shape and size (byte-level BPE,
// its pre-tokenizer regex, ignore_merges, 256 special added tokens, the
// <|begin_of_text|> template): for the load test and bench/tokenizer.
//
// Tokens grow from the 256 byte characters by appending or prepending one
// of a few letters (or Ġ) to an existing short token, each with its merge;
// then
// other splits of the tokens into two tokens are added as merges until
// there are `merges` of them (or no more splits exist).
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

namespace hearth::llm::synthetic {

struct SyntheticTokenizer {
  std::string json;
  size_t vocab = 0;  // model tokens
  size_t merges = 0;
  size_t added = 0;
};

inline void AppendJsonString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    const auto b = static_cast<uint8_t>(c);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (b < 0x20) {
      static const char kHex[] = "0123456789abcdef";
      *out += "\\u00";
      out->push_back(kHex[b >> 4]);
      out->push_back(kHex[b & 15]);
    } else {
      out->push_back(c);
    }
  }
  out->push_back('"');
}

inline std::string ByteLevelChar(int b) {
  const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int k = 0; k < b; ++k) {
      n += !((k >= 0x21 && k <= 0x7E) || (k >= 0xA1 && k <= 0xAC) || k >= 0xAE);
    }
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// merges_as_strings: "a b" (as Llama 3's own file has them) instead of ["a", "b"].
inline SyntheticTokenizer MakeSyntheticTokenizer(size_t vocab_tokens = 128000,
                                                 size_t merge_count = 280000, uint32_t seed = 1,
                                                 bool merges_as_strings = false) {
  std::mt19937 rng(seed);
  std::vector<std::string> tokens;
  std::unordered_set<std::string> seen;
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(ByteLevelChar(b));
    seen.insert(tokens.back());
  }
  const std::vector<std::string> alphabet = {"a", "e", "i", "o", "u", "n", "s",       "t",
                                             "r", "l", "h", "d", "c", "m", "\xC4\xA0" /* Ġ */};
  std::vector<std::pair<std::string, std::string>> merges;
  while (tokens.size() < vocab_tokens) {
    const std::string& base = tokens[rng() % std::min<size_t>(tokens.size(), 6000)];
    const std::string& c = alphabet[rng() % alphabet.size()];
    const bool append = rng() % 2 == 0;
    std::string token = append ? base + c : c + base;
    if (!seen.insert(token).second) continue;
    merges.emplace_back(append ? base : c, append ? c : base);
    tokens.push_back(std::move(token));
  }
  for (size_t i = 256; merges.size() < merge_count && i < tokens.size(); ++i) {
    const std::string& token = tokens[i];
    for (size_t cut = 1; cut + 1 < token.size() && merges.size() < merge_count; ++cut) {
      if ((static_cast<uint8_t>(token[cut]) & 0xC0) == 0x80) continue;  // inside a character
      std::string left = token.substr(0, cut);
      std::string right = token.substr(cut);
      if (seen.count(left) != 0 && seen.count(right) != 0) merges.emplace_back(left, right);
    }
  }

  SyntheticTokenizer out;
  out.vocab = tokens.size();
  out.merges = merges.size();
  out.added = 256;
  std::string& j = out.json;
  j.reserve(tokens.size() * 24 + merges.size() * 24 + 65536);
  j += R"({"version":"1.0","truncation":null,"padding":null,"added_tokens":[)";
  std::vector<std::string> specials;
  for (size_t i = 0; i < out.added; ++i) {
    specials.push_back(i == 0   ? "<|begin_of_text|>"
                       : i == 1 ? "<|end_of_text|>"
                       : i == 9 ? "<|eot_id|>"
                                : "<|reserved_special_token_" + std::to_string(i) + "|>");
    if (i > 0) j += ',';
    j += R"({"id":)" + std::to_string(tokens.size() + i) + R"(,"content":)";
    AppendJsonString(specials.back(), &j);
    j += R"(,"single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true})";
  }
  j +=
      R"(],"normalizer":null,"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":)";
  AppendJsonString(
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      &j);
  j +=
      R"(},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}]},)";
  j +=
      R"("post_processor":{"type":"Sequence","processors":[{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":false,"use_regex":true},{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<|begin_of_text|>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"pair":[],"special_tokens":{"<|begin_of_text|>":{"id":"<|begin_of_text|>","ids":[)";
  j += std::to_string(tokens.size());
  j +=
      R"(],"tokens":["<|begin_of_text|>"]}}}]},"decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},)";
  j +=
      R"("model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":true,"vocab":{)";
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (id > 0) j += ',';
    AppendJsonString(tokens[id], &j);
    j += ':' + std::to_string(id);
  }
  j += R"(},"merges":[)";
  for (size_t i = 0; i < merges.size(); ++i) {
    if (i > 0) j += ',';
    if (merges_as_strings) {
      AppendJsonString(merges[i].first + " " + merges[i].second, &j);
      continue;
    }
    j += '[';
    AppendJsonString(merges[i].first, &j);
    j += ',';
    AppendJsonString(merges[i].second, &j);
    j += ']';
  }
  j += "]}}";
  return out;
}

}  // namespace hearth::llm::synthetic
