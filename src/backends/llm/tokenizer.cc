// backend: llm tokenizer — the pipeline: added tokens found in the text
// (AddedVocabulary::extract_and_normalize), normalizer, pre-tokenizer, BPE,
// post-processor template; Decode and the streaming Detokenizer.
#include "backends/llm/tokenizer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>

#include "backends/llm/tokenizer_internal.h"
#include "common/regular_file.h"

namespace hearth::llm {
namespace {

using tokenizer_internal::AddedToken;
using tokenizer_internal::AddedTokenMatcher;
using tokenizer_internal::TokenizerData;

// tokenizer.json files are ~10 MB; a file past this is not one.
constexpr off_t kMaxFileBytes = off_t{1} << 30;

// A part of the text: an added token (id >= 0) or text for the model.
struct Segment {
  std::string_view text;
  size_t start = 0;
  int32_t id = -1;
};

uint32_t LastCodePoint(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return tokenizer_internal::NextCodePoint(s, &i);
}

uint32_t FirstCodePoint(std::string_view s) {
  size_t i = 0;
  return tokenizer_internal::NextCodePoint(s, &i);
}

// Where the whitespace run that ends `s` starts.
size_t TrailingSpaceStart(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t i = end - 1;
    while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
    size_t j = i;
    if (!tokenizer_internal::IsWhiteSpace(tokenizer_internal::NextCodePoint(s, &j))) break;
    end = i;
  }
  return end;
}

// The length of the whitespace run that starts `s`.
size_t LeadingSpaceLength(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    if (!tokenizer_internal::IsWhiteSpace(tokenizer_internal::NextCodePoint(s, &j))) break;
    i = j;
  }
  return i;
}

// AddedVocabulary::find_matches: splits `sentence` at the added tokens the
// matcher finds (leftmost, longest), applying each token's single_word,
// lstrip and rstrip; special tokens are passed over when !parse_special.
void SplitAdded(std::string_view sentence, const AddedTokenMatcher& matcher,
                const std::vector<AddedToken>& added, bool parse_special,
                std::vector<Segment>* out) {
  out->clear();
  if (matcher.empty()) {
    out->push_back(Segment{sentence, 0, -1});
    return;
  }
  size_t start_offset = 0;
  AddedTokenMatcher::Match match;
  for (size_t from = 0; matcher.FindNext(sentence, from, &match);) {
    from = match.end;
    const AddedToken& token = added[match.token];
    if (!parse_special && token.special) continue;
    if (match.start < start_offset) continue;  // inside what an rstrip took
    size_t start = match.start;
    size_t stop = match.end;
    if (token.single_word) {
      const bool space_before =
          start == 0 || !tokenizer_internal::IsWordChar(LastCodePoint(sentence.substr(0, start)));
      const bool space_after =
          stop == sentence.size() ||
          !tokenizer_internal::IsWordChar(FirstCodePoint(sentence.substr(stop)));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) start = std::max(TrailingSpaceStart(sentence.substr(0, start)), start_offset);
    if (token.rstrip) stop += LeadingSpaceLength(sentence.substr(stop));
    if (start_offset < start) {
      out->push_back(
          Segment{sentence.substr(start_offset, start - start_offset), start_offset, -1});
    }
    out->push_back(Segment{sentence.substr(start, stop - start), start, token.id});
    start_offset = stop;
  }
  if (start_offset < sentence.size()) {
    out->push_back(Segment{sentence.substr(start_offset), start_offset, -1});
  }
}

Status UnknownId(const TokenizerData& data, int32_t id) {
  return InvalidArgument(data.name + ": token id " + std::to_string(id) +
                         " is not in the vocabulary (vocab_size " +
                         std::to_string(data.tokens.size()) + ")");
}

bool KnownId(const TokenizerData& data, int32_t id) {
  return id >= 0 && static_cast<size_t>(id) < data.tokens.size() &&
         data.kinds[id] != tokenizer_internal::kNoToken;
}

Result<std::string> ReadFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 && errno == ENOENT) return NotFound(path + ": no such file");
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path, &st));
  if (st.st_size > kMaxFileBytes) {
    return InvalidArgument(path + ": " + std::to_string(st.st_size) +
                           " bytes is too large for a tokenizer.json");
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("read " + path, errno);
    if (n == 0) return InvalidArgument(path + ": shrank while it was read");
    done += static_cast<size_t>(n);
  }
  return text;
}

}  // namespace

namespace tokenizer_internal {

void AddedTokenMatcher::Build(const std::vector<AddedToken>& tokens, bool normalized) {
  nodes_.assign(1, Node{});
  std::fill(std::begin(first_byte_), std::end(first_byte_), false);
  for (size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t].normalized != normalized || tokens[t].pattern.empty()) continue;
    int32_t node = 0;
    for (const char c : tokens[t].pattern) {
      const auto byte = static_cast<uint8_t>(c);
      int32_t child = Child(node, byte);
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
        auto& children = nodes_[node].children;
        children.insert(
            std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1})),
            std::make_pair(byte, child));
      }
      node = child;
    }
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int32_t>(t);
    first_byte_[static_cast<uint8_t>(tokens[t].pattern[0])] = true;
  }
}

int32_t AddedTokenMatcher::Child(int32_t node, uint8_t byte) const {
  const auto& children = nodes_[node].children;
  const auto it =
      std::lower_bound(children.begin(), children.end(), std::make_pair(byte, int32_t{-1}));
  return it != children.end() && it->first == byte ? it->second : -1;
}

bool AddedTokenMatcher::FindNext(std::string_view text, size_t from, Match* match) const {
  for (size_t i = from; i < text.size(); ++i) {
    if (!first_byte_[static_cast<uint8_t>(text[i])]) continue;
    int32_t node = 0;
    int32_t best = -1;
    size_t best_end = 0;
    for (size_t j = i; j < text.size(); ++j) {
      node = Child(node, static_cast<uint8_t>(text[j]));
      if (node < 0) break;
      if (nodes_[node].token >= 0) {
        best = nodes_[node].token;
        best_end = j + 1;
      }
    }
    if (best >= 0) {
      *match = Match{i, best_end, best};
      return true;
    }
  }
  return false;
}

}  // namespace tokenizer_internal

// ---------------------------------------------------------------- Tokenizer

Tokenizer::Tokenizer(std::unique_ptr<TokenizerData> data) : data_(std::move(data)) {}
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return Parse(text, path);
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::Parse(std::string_view json, std::string_view name) {
  auto data = std::make_unique<TokenizerData>();
  data->name.assign(name);
  RETURN_IF_ERROR(tokenizer_internal::ParseTokenizerJson(json, data.get()));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(data)));
}

Result<std::vector<int32_t>> Tokenizer::Encode(std::string_view text, bool add_special_tokens,
                                               bool parse_special) const {
  const TokenizerData& data = *data_;
  std::string repaired;
  if (!tokenizer_internal::IsValidUtf8(text)) {
    tokenizer_internal::AppendUtf8Lossy(text, &repaired);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (add_special_tokens) ids = data.template_prefix;

  std::vector<Segment> raw_segments;
  std::vector<Segment> segments;
  std::vector<tokenizer_internal::Piece> pieces;
  std::string normalized;
  SplitAdded(text, data.raw_matcher, data.added, parse_special, &raw_segments);
  for (const Segment& raw : raw_segments) {
    if (raw.id >= 0) {
      ids.push_back(raw.id);
      continue;
    }
    if (raw.text.empty()) continue;
    normalized.assign(raw.text);
    RETURN_IF_ERROR(tokenizer_internal::Normalize(data.normalizer, &normalized));
    SplitAdded(normalized, data.normalized_matcher, data.added, parse_special, &segments);
    for (const Segment& segment : segments) {
      if (segment.id >= 0) {
        ids.push_back(segment.id);
        continue;
      }
      pieces.clear();
      pieces.push_back(tokenizer_internal::Piece{std::string(segment.text),
                                                 raw.start == 0 && segment.start == 0});
      RETURN_IF_ERROR(tokenizer_internal::PreTokenize(data.pre_tokenizer, &pieces));
      for (const tokenizer_internal::Piece& piece : pieces) {
        data.model.Tokenize(piece.text, parse_special, &ids);
      }
    }
  }
  if (add_special_tokens) {
    ids.insert(ids.end(), data.template_suffix.begin(), data.template_suffix.end());
  }
  return ids;
}

Result<std::optional<std::string>> Tokenizer::FirstSpecialToken(std::string_view text) const {
  const TokenizerData& data = *data_;
  std::string repaired;
  if (!tokenizer_internal::IsValidUtf8(text)) {
    tokenizer_internal::AppendUtf8Lossy(text, &repaired);
    text = repaired;
  }
  // Encode's two passes: the added tokens of the raw text, then those of
  // each normalized piece between them.
  const auto special = [&](const std::vector<Segment>& segments) -> const AddedToken* {
    for (const Segment& segment : segments) {
      if (segment.id < 0) continue;
      for (const AddedToken& token : data.added)
        if (token.id == segment.id && token.special) return &token;
    }
    return nullptr;
  };
  std::vector<Segment> raw_segments;
  std::vector<Segment> segments;
  std::string normalized;
  SplitAdded(text, data.raw_matcher, data.added, /*parse_special=*/true, &raw_segments);
  if (const AddedToken* token = special(raw_segments)) return std::optional(token->content);
  for (const Segment& raw : raw_segments) {
    if (raw.id >= 0 || raw.text.empty()) continue;
    normalized.assign(raw.text);
    RETURN_IF_ERROR(tokenizer_internal::Normalize(data.normalizer, &normalized));
    SplitAdded(normalized, data.normalized_matcher, data.added, /*parse_special=*/true, &segments);
    if (const AddedToken* token = special(segments)) return std::optional(token->content);
  }
  return std::optional<std::string>();
}

Result<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                      bool skip_special_tokens) const {
  const TokenizerData& data = *data_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    if (!KnownId(data, id)) return UnknownId(data, id);
    if (skip_special_tokens && data.IsSpecial(id)) continue;
    tokens.emplace_back(data.DecoderToken(id));
  }
  return tokenizer_internal::DecodeChain(data.decoder, std::move(tokens));
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(data_->tokens.size()); }

std::optional<int32_t> Tokenizer::TokenId(std::string_view token) const {
  for (const AddedToken& added : data_->added) {
    if (added.content == token) return added.id;
  }
  const int32_t id = data_->model.vocab.Find(token);
  return id >= 0 ? std::optional<int32_t>(id) : std::nullopt;
}

std::optional<std::string_view> Tokenizer::TokenText(int32_t id) const {
  if (!KnownId(*data_, id)) return std::nullopt;
  return std::string_view(data_->tokens[id]);
}

bool Tokenizer::IsSpecial(int32_t id) const { return data_->IsSpecial(id); }

Detokenizer Tokenizer::NewDetokenizer(bool skip_special_tokens) const {
  return Detokenizer(*this, skip_special_tokens);
}

// ---------------------------------------------------------------- Detokenizer

Detokenizer::Detokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : data_(tokenizer.data_.get()),
      skip_special_(skip_special_tokens),
      strip_left_(data_->stream_decoder.strip_start) {}

std::string Detokenizer::Emit(std::string text) {
  const std::string& strip = data_->stream_decoder.strip_char;
  size_t cut = 0;
  while (strip_left_ > 0 && cut < text.size()) {
    if (text.compare(cut, strip.size(), strip) != 0) {
      strip_left_ = 0;
      break;
    }
    cut += strip.size();
    --strip_left_;
  }
  if (cut < text.size()) strip_left_ = 0;  // the fused text's start is past
  text.erase(0, cut);
  return text;
}

Result<std::string> Detokenizer::Push(int32_t id) {
  const TokenizerData& data = *data_;
  if (!KnownId(data, id)) return UnknownId(data, id);
  if (skip_special_ && data.IsSpecial(id)) return std::string();
  const tokenizer_internal::StreamDecoder& decoder = data.stream_decoder;
  const std::string_view token = data.DecoderToken(id);
  std::string out;
  if (decoder.byte_level) {
    tokenizer_internal::AppendByteLevelBytes(token, &pending_);
    const size_t complete = tokenizer_internal::CompleteUtf8Prefix(pending_);
    tokenizer_internal::AppendUtf8Lossy(std::string_view(pending_).substr(0, complete), &out);
    pending_.erase(0, complete);
    return Emit(std::move(out));
  }
  std::string text = tokenizer_internal::StreamTokenText(decoder, token, first_token_);
  first_token_ = false;
  if (decoder.byte_fallback) {
    const int byte = tokenizer_internal::ByteFallbackValue(text);
    if (byte >= 0) {
      pending_.push_back(static_cast<char>(byte));
      return std::string();
    }
  }
  if (!pending_.empty()) {
    // The byte group ends here: its text, or one U+FFFD per byte.
    if (tokenizer_internal::IsValidUtf8(pending_)) {
      out = std::move(pending_);
    } else {
      for (size_t i = 0; i < pending_.size(); ++i) out += tokenizer_internal::kReplacementChar;
    }
    pending_.clear();
  }
  out += text;
  return Emit(std::move(out));
}

std::string Detokenizer::Flush() {
  std::string out;
  if (data_->stream_decoder.byte_level) {
    tokenizer_internal::AppendUtf8Lossy(pending_, &out);
  } else if (tokenizer_internal::IsValidUtf8(pending_)) {
    out = pending_;
  } else {
    for (size_t i = 0; i < pending_.size(); ++i) out += tokenizer_internal::kReplacementChar;
  }
  out = Emit(std::move(out));
  pending_.clear();
  first_token_ = true;
  strip_left_ = data_->stream_decoder.strip_start;
  return out;
}

}  // namespace hearth::llm
