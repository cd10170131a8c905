// backend: llm — the parts of the tokenizer (tokenizer.h), shared by its
// source files and its tests; nothing else includes this.
//
//   tokenizer_text.cc       UTF-8, PCRE2 regexes, normalizers, pre-tokenizers
//   tokenizer_bpe.cc        the BPE model and its hash tables
//   tokenizer_decoder.cc    the decoder chain and its streaming form
//   tokenizer_json.cc       reading tokenizer.json into TokenizerData
//   tokenizer.cc            added tokens, Encode, Decode, Detokenizer
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hearth/status.h"

namespace hearth::llm::tokenizer_internal {

// ---------------------------------------------------------------- UTF-8

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Whether `bytes` is well-formed UTF-8 (no surrogates, no overlongs).
bool IsValidUtf8(std::string_view bytes);
// Appends `bytes` with each maximal ill-formed subsequence replaced by
// U+FFFD: Rust's String::from_utf8_lossy, Python's errors="replace".
void AppendUtf8Lossy(std::string_view bytes, std::string* out);
// The length of the longest prefix of `bytes` that does not end inside a
// sequence that is well-formed so far but incomplete (such a tail may still
// become a character when more bytes come).
size_t CompleteUtf8Prefix(std::string_view bytes);
// The code point at s[*i] of valid UTF-8, advancing *i past it.
uint32_t NextCodePoint(std::string_view s, size_t* i);
void AppendCodePoint(uint32_t cp, std::string* out);
// Unicode White_Space (Oniguruma's and Rust's \s).
bool IsWhiteSpace(uint32_t cp);
// Rust regex's \w: Alphabetic, marks, decimal numbers, connector
// punctuation, joiners (for added tokens' single_word).
bool IsWordChar(uint32_t cp);

// ---------------------------------------------------------------- regex

// A PCRE2 pattern compiled once (UTF | UCP, JIT when available). Immutable;
// Find may be called from several threads.
class Regex {
 public:
  // InvalidArgument with PCRE2's message and offset. \s and \S are rewritten
  // to \p{White_Space} / \P{White_Space} first (see tokenizer.h).
  static Result<std::unique_ptr<Regex>> Compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Every non-overlapping match in `text` (valid UTF-8), left to right, as
  // [start, end) byte offsets; after an empty match the search goes on one
  // character later. ResourceExhausted when PCRE2 gives up (match limit).
  Status FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* matches) const;

  bool jit() const { return jit_; }

 private:
  Regex(void* code, bool jit) : code_(code), jit_(jit) {}
  void* code_;  // pcre2_code_8*
  bool jit_;
};

// The pattern as PCRE2 gets it (the \s rewrite); exposed for tests.
std::string RewriteWhiteSpaceClasses(std::string_view pattern);

// ---------------------------------------------------------------- normalizers

struct NormalizerStep {
  enum class Kind { kNfc, kPrepend, kReplace };
  Kind kind = Kind::kNfc;
  std::string pattern;  // kReplace: the literal replaced
  std::string content;  // kPrepend: what is prepended; kReplace: the replacement
};

// Applies the steps in order to `text` (valid UTF-8).
Status Normalize(const std::vector<NormalizerStep>& steps, std::string* text);

// ---------------------------------------------------------------- pre-tokenizers

enum class PrependScheme { kFirst, kAlways, kNever };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace };
  Kind kind = Kind::kSplit;
  // kSplit: a compiled regex, or a literal when regex is null.
  std::shared_ptr<const Regex> regex;
  std::string literal;
  // kByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // kMetaspace
  std::string replacement = "\xE2\x96\x81";  // U+2581
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
};

// A pre-token; at_start: it begins at byte 0 of the text given to Encode
// (Metaspace's prepend_scheme "first").
struct Piece {
  std::string text;
  bool at_start = false;
};

// Splits and maps `pieces` through the steps in order; empty pieces are
// dropped, as `tokenizers` drops them.
Status PreTokenize(const std::vector<PreTokenizerStep>& steps, std::vector<Piece>* pieces);

// The GPT-2 byte-to-unicode map ByteLevel uses: byte b becomes the code
// point ByteToCodePoint(b); CodePointToByte inverts it (-1 for others).
uint32_t ByteToCodePoint(uint8_t b);
int CodePointToByte(uint32_t cp);
// GPT-2's pre-tokenizer regex (ByteLevel with use_regex: true).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------- BPE

// Open addressing from a token string to its id; the strings live in the
// caller's vector (tokens[id]), which must outlive the map and not change.
class StringIdMap {
 public:
  void Reset(const std::vector<std::string>* tokens, size_t expected);
  // Inserts token `id` (tokens[id]); returns the id already there under the
  // same string, or -1 when it was new.
  int32_t Insert(int32_t id);
  int32_t Find(std::string_view s) const { return Find(s, {}, Hash(s)); }  // -1 when absent

  // The hash of a string, or of the concatenation first + second
  // (Hash(second, Hash(first))), so that merges look up "ab" without building
  // it; and the lookup by it, which Prefetch can start early (loading
  // 280,000 merges is mostly waiting on memory).
  static uint32_t Hash(std::string_view s, uint32_t h = 2166136261u) {
    for (const char c : s) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
    return h;
  }
  void Prefetch(uint32_t hash) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[Spread(hash) & (slots_.size() - 1)]);
  }
  // The id of first + second.
  int32_t Find(std::string_view first, std::string_view second, uint32_t hash) const;
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint32_t hash = 0;
    int32_t id = -1;
  };
  // FNV-1a's low bits are poor for a power-of-two table: mixed first.
  static size_t Spread(uint32_t hash) { return (hash * 0x9E3779B1u) >> 7; }
  void Grow();
  const std::vector<std::string>* tokens_ = nullptr;
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

// (left id, right id) -> (rank, merged id), open addressing.
class MergeMap {
 public:
  struct Value {
    int32_t rank = -1;
    int32_t merged = -1;
  };
  void Reserve(size_t n);
  // A later merge of the same pair replaces the earlier one (as `tokenizers`
  // builds its map).
  void Insert(int32_t left, int32_t right, Value value);
  const Value* Find(int32_t left, int32_t right) const;
  void Prefetch(int32_t left, int32_t right) const;
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint64_t key = ~uint64_t{0};
    Value value;
  };
  void Grow();
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

struct BpeModel {
  StringIdMap vocab;  // over TokenizerData::tokens, model entries only
  MergeMap merges;
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  int32_t byte_ids[256];              // "<0xHH>" tokens, -1 when absent
  std::vector<int32_t> bmp_char_ids;  // id of the one-character token U+0000..U+FFFF, or -1
  std::vector<uint8_t> special;       // by id: 1 for special added tokens (never merged into
                                      // when allow_special is false)

  // Appends the ids of one pre-token (valid UTF-8) as `tokenizers`' BPE
  // gives them: characters (or their byte-fallback tokens, or unk), then
  // merges by rank, lowest first and leftmost among equals.
  void Tokenize(std::string_view piece, bool allow_special, std::vector<int32_t>* out) const;
};

// ---------------------------------------------------------------- decoders

struct DecoderStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace };
  Kind kind = Kind::kFuse;
  std::string pattern;  // kReplace
  std::string content;  // kReplace: replacement; kStrip: the character stripped
  size_t start = 0;     // kStrip
  std::string replacement = "\xE2\x96\x81";  // kMetaspace
  bool strip_first = true;                   // kMetaspace: prepend_scheme is not "never"
};

// `tokenizers`' decode_chain over the token strings, joined.
std::string DecodeChain(const std::vector<DecoderStep>& steps, std::vector<std::string> tokens);

// The decoder in the form a stream applies it token by token (checked to
// be equivalent to the chain when the tokenizer is loaded).
struct StreamDecoder {
  bool byte_level = false;  // ByteLevel: token chars -> bytes, then lossy UTF-8
  // Otherwise: per-token text steps (Replace / Metaspace), then byte
  // fallback groups, then a strip of the fused text's start.
  std::vector<DecoderStep> per_token;
  bool byte_fallback = false;
  std::string strip_char;
  size_t strip_start = 0;
};

// Checks that `steps` has a streamable form and returns it; InvalidArgument
// naming the step that breaks it (`where`: "decoder").
Result<StreamDecoder> MakeStreamDecoder(const std::vector<DecoderStep>& steps,
                                        std::string_view where);
// The per-token text of `token` (not a byte-fallback byte), `first`: it is
// the first token the decoder sees.
std::string StreamTokenText(const StreamDecoder& decoder, std::string_view token, bool first);
// A byte-fallback token "<0xHH>": its byte, else -1.
int ByteFallbackValue(std::string_view token);
// The bytes ByteLevel's decoder gives for a token.
void AppendByteLevelBytes(std::string_view token, std::string* out);

// ---------------------------------------------------------------- the whole

struct AddedToken {
  std::string content;
  std::string pattern;  // what is matched: content, or its normalized form
  int32_t id = -1;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// Leftmost-longest matching over a set of added tokens (a byte trie).
class AddedTokenMatcher {
 public:
  void Build(const std::vector<AddedToken>& tokens, bool normalized);
  bool empty() const { return nodes_.size() <= 1; }
  struct Match {
    size_t start = 0;
    size_t end = 0;
    int32_t token = -1;  // index into the vector given to Build
  };
  // The leftmost match starting at or after `from`, the longest there.
  bool FindNext(std::string_view text, size_t from, Match* match) const;

 private:
  struct Node {
    int32_t token = -1;
    std::vector<std::pair<uint8_t, int32_t>> children;  // sorted by byte
  };
  int32_t Child(int32_t node, uint8_t byte) const;
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

enum TokenKind : uint8_t { kNoToken = 0, kModelToken = 1, kAddedToken = 2 };

struct TokenizerData {
  std::string name;
  std::vector<std::string> tokens;  // by id; "" where kinds[id] == kNoToken
  std::vector<uint8_t> kinds;       // TokenKind by id
  BpeModel model;
  std::vector<AddedToken> added;
  std::vector<int32_t> added_by_id;      // index into added, or -1; by id
  AddedTokenMatcher raw_matcher;         // added tokens with normalized: false
  AddedTokenMatcher normalized_matcher;  // with normalized: true
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  // The post-processor's single template, flattened: ids before and after
  // the sequence (TemplateProcessing steps nest in order).
  std::vector<int32_t> template_prefix;
  std::vector<int32_t> template_suffix;
  std::vector<DecoderStep> decoder;
  StreamDecoder stream_decoder;

  // The string the decoder gets for a known id: an added token's pattern
  // (its normalized form when it is normalized, as `tokenizers` 0.23 decodes
  // it), else the vocab string.
  std::string_view DecoderToken(int32_t id) const {
    const int32_t added_index = added_by_id[id];
    return added_index >= 0 ? std::string_view(added[added_index].pattern)
                            : std::string_view(tokens[id]);
  }
  bool IsSpecial(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < model.special.size() && model.special[id] != 0;
  }
};

// Reads tokenizer.json text into `data` (everything but data->name, which
// the caller sets and messages use).
Status ParseTokenizerJson(std::string_view json, TokenizerData* data);

}  // namespace hearth::llm::tokenizer_internal
